//! The external KV cache: per layer K (after RoPE) and V, one row per absolute position, every
//! value an f16 (see [`KvCache::write`]).
//!
//! The model holds no cache; the engine owns these so they can be loaded, rotated, fused and
//! stored. Row `p` of every layer holds the token at position `p`, so a forward over any subset
//! of positions writes exactly its rows and attends to whatever the others hold.
//!
//! Also chunk KV as the store keeps it ([`ChunkKv`], [`PrefixKv`]): the layout both engines
//! read and write.

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use half::f16;

/// K and V rows of every layer, indexed by position.
#[derive(Debug)]
pub struct KvCache {
    n_layer: usize,
    row: usize,
    rows: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    filled: Vec<bool>,
    /// Per layer, the rows rounded and packed for bf16 attention (empty until a bf16 forward
    /// asks for them; kept up to date incrementally, see [`KvCache::bf16`]).
    bf16: Vec<kernels::Bf16Kv>,
}

/// A clone keeps the room the original had for more rows ([`KvCache::reserve`]): the
/// answer's rows are written into clones (each drafter's, the fidelity guard's).
impl Clone for KvCache {
    fn clone(&self) -> Self {
        let keep_room = |b: &Vec<f32>| {
            let mut c = Vec::with_capacity(b.capacity());
            c.extend_from_slice(b);
            c
        };
        Self {
            n_layer: self.n_layer,
            row: self.row,
            rows: self.rows,
            k: self.k.iter().map(keep_room).collect(),
            v: self.v.iter().map(keep_room).collect(),
            filled: self.filled.clone(),
            bf16: self.bf16.clone(),
        }
    }
}

impl KvCache {
    /// An empty cache shaped for `config`.
    pub fn new(config: &ModelConfig) -> Self {
        Self::with_shape(config.n_layer, config.kv_row())
    }

    /// An empty cache of `n_layer` layers with `row` values (kv heads x head dim) per position.
    pub fn with_shape(n_layer: usize, row: usize) -> Self {
        Self {
            n_layer,
            row,
            rows: 0,
            k: vec![Vec::new(); n_layer],
            v: vec![Vec::new(); n_layer],
            filled: Vec::new(),
            bf16: Vec::new(),
        }
    }

    /// Number of layers.
    pub fn n_layer(&self) -> usize {
        self.n_layer
    }

    /// Values per row (kv heads x head dim).
    pub fn row_len(&self) -> usize {
        self.row
    }

    /// Rows held: one past the highest position ever written.
    pub fn len(&self) -> usize {
        self.rows
    }

    /// True when no position has been written.
    pub fn is_empty(&self) -> bool {
        self.rows == 0
    }

    /// Rows the buffers have room for without growing (at least [`KvCache::len`]; more after
    /// [`KvCache::reserve`]): what the cache holds in memory, with its bf16 mirror's bytes
    /// beside ([`KvCache::mirror_bytes`]).
    pub fn capacity_rows(&self) -> usize {
        let row = self.row.max(1);
        self.k
            .iter()
            .chain(&self.v)
            .map(|b| b.capacity() / row)
            .max()
            .unwrap_or(0)
            .max(self.rows)
    }

    /// Bytes of the rows packed for bf16 attention (0 until a bf16 forward asks for them).
    pub fn mirror_bytes(&self) -> usize {
        if self.bf16.is_empty() {
            0
        } else {
            // bf16 K and V of every row the f32 buffers hold.
            2 * 2 * self.n_layer * self.row * self.rows
        }
    }

    /// Drops the bf16 mirror (a bf16 forward packs it again from the f32 rows when it needs
    /// it): for a copy kept for later, so it holds the rows once.
    pub fn drop_mirror(&mut self) {
        self.bf16 = Vec::new();
    }

    /// True when every row below `len()` holds a computed token.
    pub fn is_complete(&self) -> bool {
        self.filled.iter().all(|&f| f)
    }

    /// True when row `pos` holds a computed token.
    pub fn is_filled(&self, pos: usize) -> bool {
        self.filled.get(pos).copied().unwrap_or(false)
    }

    /// K rows `0..len()` of `layer`, `(len, kv heads, head dim)` row-major.
    pub fn k(&self, layer: usize) -> &[f32] {
        &self.k[layer][..self.rows * self.row]
    }

    /// V rows `0..len()` of `layer`.
    pub fn v(&self, layer: usize) -> &[f32] {
        &self.v[layer][..self.rows * self.row]
    }

    /// K rows `0..rows` of `layer` (which must be `<= len()`).
    pub(crate) fn k_prefix(&self, layer: usize, rows: usize) -> &[f32] {
        &self.k[layer][..rows * self.row]
    }

    /// V rows `0..rows` of `layer`.
    pub(crate) fn v_prefix(&self, layer: usize, rows: usize) -> &[f32] {
        &self.v[layer][..rows * self.row]
    }

    /// Rows `0..rows` of `layer` packed for bf16 attention
    /// ([`kernels::causal_attention_packed`]): only the rows written since the last call are
    /// packed again, so a decode step packs one block of 16 rows, not the whole context.
    pub(crate) fn bf16(
        &mut self,
        layer: usize,
        rows: usize,
        shape: kernels::AttentionShape,
    ) -> &kernels::Bf16Kv {
        if self.bf16.is_empty() {
            self.bf16 = vec![kernels::Bf16Kv::new(shape); self.n_layer];
        }
        let row = self.row;
        let kv = &mut self.bf16[layer];
        kv.update(
            &self.k[layer][..rows * row],
            &self.v[layer][..rows * row],
            rows,
        );
        kv
    }

    /// Drops every row at or after `len` (e.g. to roll back rejected draft tokens). The bf16
    /// mirror keeps its rows: no query attends to a row before it is written again, and the
    /// write marks it changed.
    pub fn truncate(&mut self, len: usize) {
        if len < self.rows {
            self.rows = len;
            self.filled.truncate(len);
            for l in 0..self.n_layer {
                self.k[l].truncate(len * self.row);
                self.v[l].truncate(len * self.row);
            }
        }
    }

    /// Makes room for the rows of a forward at `positions` and checks that, once they are
    /// written, every row up to the highest of them holds a token (no query may attend to a
    /// hole).
    pub(crate) fn prepare(&mut self, positions: &[usize]) -> Result<()> {
        let Some(&max) = positions.iter().max() else {
            return Ok(());
        };
        let needed = max + 1;
        self.grow(needed);
        let mut incoming = vec![false; needed];
        for &p in positions {
            if incoming[p] {
                return Err(EngineError::InvalidInput(format!(
                    "position {p} appears twice in one forward"
                )));
            }
            incoming[p] = true;
        }
        if let Some(hole) = (0..needed).find(|&r| !self.filled[r] && !incoming[r]) {
            return Err(EngineError::InvalidInput(format!(
                "cache has no token at position {hole}, below position {max} being computed"
            )));
        }
        Ok(())
    }

    /// Makes room for `additional` more rows in every layer without moving the cache again
    /// while they are written. A decode appends a row per token: without this, the first
    /// row past a cache held at its exact size (a clone's, or one built from chunks) moved
    /// every layer's K and V to blocks twice as big; at 32k tokens of the 1.5B target that
    /// held the first token back by ~2.7 s and the cache at up to twice its size.
    pub fn reserve(&mut self, additional: usize) {
        let want = (self.rows + additional) * self.row;
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            buf.reserve_exact(want.saturating_sub(buf.len()));
        }
        self.filled
            .reserve_exact((self.rows + additional).saturating_sub(self.filled.len()));
    }

    /// Extends every layer to `rows` rows (new rows empty, not yet computed).
    fn grow(&mut self, rows: usize) {
        if rows > self.rows {
            for l in 0..self.n_layer {
                self.k[l].resize(rows * self.row, 0.0);
                self.v[l].resize(rows * self.row, 0.0);
            }
            self.filled.resize(rows, false);
            self.rows = rows;
        }
    }

    /// Overwrites the K and V rows of `layer` at `positions` (all below `len()`), rounded to
    /// f16 as every write is, e.g. to inject KV computed elsewhere or to test that a damaged
    /// cache cannot change a verified answer.
    pub fn set_rows(
        &mut self,
        layer: usize,
        positions: &[usize],
        k: &[f32],
        v: &[f32],
    ) -> Result<()> {
        let n = positions.len() * self.row;
        if layer >= self.n_layer
            || positions.iter().any(|&p| p >= self.rows)
            || k.len() != n
            || v.len() != n
        {
            return Err(crate::error::EngineError::InvalidInput(format!(
                "set_rows: layer {layer}, {} positions, {} / {} values for a cache of {} rows",
                positions.len(),
                k.len(),
                v.len(),
                self.rows
            )));
        }
        self.write(layer, positions, k, v);
        Ok(())
    }

    /// Writes reused rows of one layer at `positions`, growing the cache as needed (the caller
    /// marks them computed once every layer is in place).
    pub(crate) fn place_rows(&mut self, layer: usize, positions: &[usize], k: &[f32], v: &[f32]) {
        self.grow(positions.iter().max().map_or(0, |&p| p + 1));
        self.write(layer, positions, k, v);
    }

    /// Writes K and V rows (`(positions.len(), row)` each) of one layer at their positions,
    /// each value rounded to the nearest f16.
    ///
    /// The cache holds f16 values, as llama.cpp's default KV cache and the chunk store do, so
    /// a chunk's stored rows are exactly the rows a whole prefill keeps for it: a reused
    /// first chunk is then bit for bit the prefix of full recompute, and an escalation that
    /// keeps it answers as full recompute does (with f32 rows, the stored chunk's rounding
    /// alone tipped full recompute's own near ties).
    pub(crate) fn write(&mut self, layer: usize, positions: &[usize], k: &[f32], v: &[f32]) {
        let row = self.row;
        if let (Some(kv), Some(&first)) = (self.bf16.get_mut(layer), positions.iter().min()) {
            kv.invalidate_from(first);
        }
        for (i, &p) in positions.iter().enumerate() {
            round_f16(
                &mut self.k[layer][p * row..(p + 1) * row],
                &k[i * row..(i + 1) * row],
            );
            round_f16(
                &mut self.v[layer][p * row..(p + 1) * row],
                &v[i * row..(i + 1) * row],
            );
        }
    }

    /// Marks rows as holding computed tokens.
    pub(crate) fn mark_filled(&mut self, positions: &[usize]) {
        for &p in positions {
            self.filled[p] = true;
        }
    }
}

/// `dst = src` with every value rounded to the nearest f16 (round to nearest even, as the
/// chunk store converts; a value past f16's range becomes infinite there too).
fn round_f16(dst: &mut [f32], src: &[f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = half::f16::from_f32(s).to_f32();
    }
}

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

impl PrefixKv {
    /// The hash a prefix's KV is named by: sha256 of the model's fingerprint and the ids.
    pub fn hash_of(fingerprint: &str, ids: &[u32]) -> String {
        let mut h = <sha2::Sha256 as sha2::Digest>::new();
        sha2::Digest::update(&mut h, fingerprint.as_bytes());
        for id in ids {
            sha2::Digest::update(&mut h, id.to_le_bytes());
        }
        sha2::Digest::finalize(h)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holes_below_a_query_are_rejected() {
        let mut c = KvCache::with_shape(1, 2);
        assert!(c.prepare(&[0, 1, 2]).is_ok());
        c.mark_filled(&[0, 1, 2]);
        assert!(c.prepare(&[5]).is_err(), "rows 3 and 4 are empty");
        assert!(c.prepare(&[3, 3]).is_err(), "duplicate position");
        assert!(c.prepare(&[4, 3]).is_ok(), "order does not matter");
    }

    #[test]
    fn rows_are_kept_as_f16_and_stored_values_go_in_unchanged() {
        let mut c = KvCache::with_shape(1, 4);
        c.prepare(&[0, 1]).expect("room");
        let k = [0.1f32, 1.0 + 1e-4, -5.123_457, 70_000.0];
        let v = [1e-9f32, 2049.0, 0.333_333_34, -0.0];
        c.write(0, &[0], &k, &v);
        let f16 = |x: f32| half::f16::from_f32(x).to_f32();
        for i in 0..4 {
            assert_eq!(c.k(0)[i].to_bits(), f16(k[i]).to_bits(), "K {i}");
            assert_eq!(c.v(0)[i].to_bits(), f16(v[i]).to_bits(), "V {i}");
        }
        assert_ne!(c.k(0)[0], 0.1, "rounded, not copied");
        assert_eq!(c.v(0)[1], 2048.0, "2049 ties to even");
        assert!(
            c.k(0)[3].is_infinite(),
            "past f16's range, as the store converts it"
        );
        // A stored chunk's rows (f16 values) go in bit for bit.
        let stored: Vec<f32> = c.k(0)[..3].iter().chain(&[0.5]).copied().collect();
        let other = [0.1f32, 0.2, 0.3, 0.4];
        c.set_rows(0, &[0], &stored, &other).expect("rows");
        assert_eq!(&c.k(0)[..4], &stored[..]);
        for (i, &x) in other.iter().enumerate() {
            assert_eq!(
                c.v(0)[i].to_bits(),
                f16(x).to_bits(),
                "set_rows rounds V {i}"
            );
        }
    }

    #[test]
    fn truncate_drops_rows() {
        let mut c = KvCache::with_shape(2, 3);
        c.prepare(&[0, 1, 2, 3]).expect("contiguous");
        c.write(1, &[2], &[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0]);
        c.mark_filled(&[0, 1, 2, 3]);
        assert_eq!(&c.k(1)[6..9], &[1.0, 2.0, 3.0]);
        c.truncate(2);
        assert_eq!(c.len(), 2);
        assert_eq!(c.k(1).len(), 6);
        assert!(c.is_complete());
    }

    /// Rows written after `reserve` land without moving any layer's buffers, in the cache
    /// and in a clone of it (a clone keeps the room), and the values read back unchanged.
    #[test]
    fn reserved_rows_are_written_in_place_and_clones_keep_the_room() {
        let mut c = KvCache::with_shape(2, 3);
        c.prepare(&[0, 1, 2]).expect("contiguous");
        c.write(0, &[1], &[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0]);
        c.mark_filled(&[0, 1, 2]);
        c.reserve(5);
        let mut clone = c.clone();
        for cache in [&mut c, &mut clone] {
            let before: Vec<*const f32> = (0..2).map(|l| cache.k[l].as_ptr()).collect();
            for p in 3..8 {
                cache.prepare(&[p]).expect("next row");
                cache.write(1, &[p], &[p as f32; 3], &[0.5; 3]);
                cache.mark_filled(&[p]);
            }
            let after: Vec<*const f32> = (0..2).map(|l| cache.k[l].as_ptr()).collect();
            assert_eq!(before, after, "a reserved row moved the buffers");
            assert_eq!(&cache.k(0)[3..6], &[1.0, 2.0, 3.0]);
            assert_eq!(&cache.k(1)[21..24], &[7.0; 3]);
            assert_eq!(cache.len(), 8);
        }
    }

    #[test]
    fn the_bf16_mirror_follows_every_write_and_truncation() {
        use kernels::{causal_attention_packed, causal_attention_with, AttentionPrecision};
        use rand::{Rng, SeedableRng};
        let shape = kernels::AttentionShape {
            n_head: 4,
            n_kv_head: 2,
            head_dim: 64,
        };
        if !kernels::Bf16Kv::handles(shape) {
            eprintln!("skipped: no AVX-512 BF16 on this CPU");
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut random =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-2.0..2.0)).collect() };
        let row = shape.n_kv_head * shape.head_dim;
        let q = random(shape.n_head * shape.head_dim);
        let mut c = KvCache::with_shape(2, row);
        let all: Vec<usize> = (0..60).collect();
        c.prepare(&all).expect("rows");
        c.write(1, &all, &random(60 * row), &random(60 * row));
        c.mark_filled(&all);
        // Attention of one query at `p` through the mirror against f32 rows packed afresh.
        let check = |c: &mut KvCache, p: usize, what: &str| {
            let (k, v) = (
                c.k(1)[..(p + 1) * row].to_vec(),
                c.v(1)[..(p + 1) * row].to_vec(),
            );
            let fresh = causal_attention_with(&q, &[p], &k, &v, shape, AttentionPrecision::Bf16)
                .expect("attention");
            let mirrored =
                causal_attention_packed(&q, &[p], c.bf16(1, p + 1, shape)).expect("mirror");
            assert_eq!(mirrored, fresh, "{what}");
        };
        check(&mut c, 59, "first use");
        c.set_rows(1, &[3, 40], &random(2 * row), &random(2 * row))
            .expect("set");
        check(&mut c, 59, "rows rewritten below the last block");
        c.truncate(20);
        let tail: Vec<usize> = (20..50).collect();
        c.prepare(&tail).expect("rows");
        c.write(1, &tail, &random(30 * row), &random(30 * row));
        c.mark_filled(&tail);
        check(&mut c, 49, "truncated, then written again");
        check(&mut c, 10, "a shorter call");
        check(&mut c, 49, "and longer again");
    }
}
