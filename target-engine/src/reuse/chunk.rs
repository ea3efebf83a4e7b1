//! Chunk KV precompute: the per-layer K (after RoPE) and V of a chunk's tokens, computed once
//! at ingestion and reused at query time after positional recovery.

use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::model::Model;
use half::f16;

pub use crate::kv::{ChunkKv, PrecomputeMode, PrefixKv};

/// Chunk KV from the model: the template prefix's, a chunk's precomputed standalone or after
/// the prefix, and a chunk's rows rotated into place in a cache.
pub trait Precompute {
    /// Computes the template prefix's KV once.
    fn prefix_kv(&self, ids: &[u32]) -> Result<PrefixKv>;

    /// Precomputes a chunk's KV, standalone or after `prefix`.
    fn precompute(&self, ids: &[u32], prefix: Option<&PrefixKv>) -> Result<ChunkKv>;

    /// The rows `base_pos..base_pos + ids.len()` of `cache` (which a forward over `ids` at
    /// those positions filled) as a chunk's KV: for callers whose forward does more than
    /// [`Precompute::precompute`]'s (the speculator scores a chunk in the same pass).
    fn chunk_rows(
        &self,
        cache: &KvCache,
        ids: &[u32],
        base_pos: usize,
        mode: PrecomputeMode,
    ) -> ChunkKv;

    /// Copies `chunk`'s rows into `cache` at `start..`, rotating K from the position it was
    /// computed at to its place (positional recovery), and marks them computed.
    fn place_chunk(&self, cache: &mut KvCache, chunk: &ChunkKv, start: usize) -> Result<()>;
}

impl Precompute for Model {
    fn prefix_kv(&self, ids: &[u32]) -> Result<PrefixKv> {
        let mut cache = self.new_cache();
        if !ids.is_empty() {
            let pos: Vec<usize> = (0..ids.len()).collect();
            self.forward(ids, &pos, &mut cache, false)?;
        }
        Ok(PrefixKv {
            ids: ids.to_vec(),
            cache,
            hash: PrefixKv::hash_of(self.fingerprint(), ids),
        })
    }

    fn precompute(&self, ids: &[u32], prefix: Option<&PrefixKv>) -> Result<ChunkKv> {
        if ids.is_empty() {
            return Err(EngineError::InvalidInput(
                "cannot precompute an empty chunk".into(),
            ));
        }
        let (mut cache, base_pos, mode) = match prefix {
            Some(p) => (
                p.cache.clone(),
                p.ids.len(),
                PrecomputeMode::AfterPrefix {
                    prefix_hash: p.hash.clone(),
                },
            ),
            None => (self.new_cache(), 0, PrecomputeMode::Standalone),
        };
        let pos: Vec<usize> = (base_pos..base_pos + ids.len()).collect();
        self.forward(ids, &pos, &mut cache, false)?;
        Ok(self.chunk_rows(&cache, ids, base_pos, mode))
    }

    fn chunk_rows(
        &self,
        cache: &KvCache,
        ids: &[u32],
        base_pos: usize,
        mode: PrecomputeMode,
    ) -> ChunkKv {
        let row = self.config().kv_row();
        let range = base_pos * row..(base_pos + ids.len()) * row;
        let to_f16 = |s: &[f32]| s.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>();
        let n_layer = self.config().n_layer;
        ChunkKv {
            fingerprint: self.fingerprint().to_string(),
            ids: ids.to_vec(),
            base_pos,
            mode,
            row,
            k: (0..n_layer)
                .map(|l| to_f16(&cache.k(l)[range.clone()]))
                .collect(),
            v: (0..n_layer)
                .map(|l| to_f16(&cache.v(l)[range.clone()]))
                .collect(),
        }
    }

    fn place_chunk(&self, cache: &mut KvCache, chunk: &ChunkKv, start: usize) -> Result<()> {
        let c = self.config();
        if chunk.fingerprint != self.fingerprint() {
            return Err(EngineError::InvalidInput(
                "chunk KV was computed by another model".into(),
            ));
        }
        if chunk.row != c.kv_row() || chunk.k.len() != c.n_layer || chunk.v.len() != c.n_layer {
            return Err(EngineError::InvalidInput(
                "chunk KV has the wrong shape for this model".into(),
            ));
        }
        let n = chunk.len();
        let delta = start as i64 - chunk.base_pos as i64;
        let deltas = vec![delta; n];
        let positions: Vec<usize> = (start..start + n).collect();
        let mut k_rows = Vec::with_capacity(n * chunk.row);
        let mut v_rows = Vec::with_capacity(n * chunk.row);
        for l in 0..c.n_layer {
            k_rows.clear();
            v_rows.clear();
            k_rows.extend(chunk.k[l].iter().map(|x| x.to_f32()));
            v_rows.extend(chunk.v[l].iter().map(|x| x.to_f32()));
            if k_rows.len() != n * chunk.row || v_rows.len() != n * chunk.row {
                return Err(EngineError::InvalidInput(format!(
                    "chunk KV layer {l} has a wrong row count"
                )));
            }
            self.rope_at(l)
                .rotate_by(&mut k_rows, c.n_kv_head, &deltas)?;
            cache.place_rows(l, &positions, &k_rows, &v_rows);
        }
        cache.mark_filled(&positions);
        Ok(())
    }
}
