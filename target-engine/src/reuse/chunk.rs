//! Chunk KV precompute: the per-layer K (after RoPE) and V of a chunk's tokens, computed once
//! at ingestion and reused at query time after positional recovery.

use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::model::Model;
use half::f16;

/// Where a chunk's KV was computed. `AfterPrefix` reuses better (measured in `docs/blend.md`:
/// KL from full prefill 0.017 vs 0.145 with nothing recomputed) and is the mode to ingest with.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "mode")]
pub enum PrecomputeMode {
    /// Alone, at positions `0..n`.
    Standalone,
    /// After the template prefix, at positions `p..p+n`, attending to it (every chunk sees the
    /// real attention sink). `prefix_hash` names the prefix it was computed after.
    AfterPrefix { prefix_hash: String },
}

/// A chunk's cached KV: per layer `n x kv_row` values of K (rotated for `base_pos..`) and V,
/// stored as f16 (half the bytes of f32; the rounding is below the quantization noise of the
/// model's own weights).
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkKv {
    /// Fingerprint of the model that computed it.
    pub fingerprint: String,
    pub ids: Vec<u32>,
    /// Position of the first token when it was computed.
    pub base_pos: usize,
    pub mode: PrecomputeMode,
    /// Values per row (kv heads x head dim).
    pub row: usize,
    pub k: Vec<Vec<f16>>,
    pub v: Vec<Vec<f16>>,
}

impl ChunkKv {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// True for a chunk without tokens.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Payload bytes (K and V of every layer).
    pub fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|l| l.len() * 2).sum()
    }
}

/// The exact KV of the template prefix, shared by every request (ordinary prefix caching).
#[derive(Debug, Clone)]
pub struct PrefixKv {
    pub ids: Vec<u32>,
    pub cache: KvCache,
    /// sha256 of the model fingerprint and the prefix ids.
    pub hash: String,
}

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
        let mut h = <sha2::Sha256 as sha2::Digest>::new();
        sha2::Digest::update(&mut h, self.fingerprint().as_bytes());
        for id in ids {
            sha2::Digest::update(&mut h, id.to_le_bytes());
        }
        let hash = sha2::Digest::finalize(h)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Ok(PrefixKv {
            ids: ids.to_vec(),
            cache,
            hash,
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
