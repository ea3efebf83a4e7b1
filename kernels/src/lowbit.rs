//! A low-bit copy of a layer's keys for choosing which cache rows a decode step attends to
//! (SpeCache's resident low-bit KV, KIVI's key quantization): keys are quantized per channel
//! over blocks of `group` consecutive positions (KIVI quantizes keys per channel: a few
//! channels carry outliers, and a per-token scale would flatten every other channel), `bits`
//! per value packed into bytes, with a minimum and a step per (block, kv head, channel).
//!
//! Only whole blocks are quantized; the rows after the last whole block stay with the caller
//! in full precision (KIVI's residual). Scoring a query against the codes costs one pass over
//! `bits / 32` of the f32 keys' bytes; the approximate scores pick the rows worth reading in
//! full precision.

use crate::attention::AttentionShape;
use crate::error::{shape_err, Result};
use rayon::prelude::*;

/// Keys of one layer at `bits` per value, quantized in blocks of `group` positions.
#[derive(Debug, Clone)]
pub struct LowBitKeys {
    shape: AttentionShape,
    bits: u32,
    group: usize,
    blocks: usize,
    /// Per block, per position, per kv head: `head_dim * bits / 8` bytes; byte `j` of a head
    /// holds channels `j + i * (head_dim * bits / 8)` for `i` in `0..8 / bits` at bit `i * bits`
    /// (so unpacking reads contiguous bytes for contiguous channels).
    codes: Vec<u8>,
    /// Per block, per (kv head, channel): the minimum and the step of the codes.
    lo: Vec<f32>,
    step: Vec<f32>,
}

impl LowBitKeys {
    /// An empty copy for `shape`; `bits` is 2 or 4 (8 / `bits` codes per byte).
    pub fn new(shape: AttentionShape, bits: u32, group: usize) -> Result<Self> {
        if !matches!(bits, 2 | 4) || group == 0 || !shape.head_dim.is_multiple_of(8) {
            return Err(shape_err(
                "low-bit keys",
                format!(
                    "{bits} bits in groups of {group} for head dimension {}",
                    shape.head_dim
                ),
            ));
        }
        Ok(Self {
            shape,
            bits,
            group,
            blocks: 0,
            codes: Vec::new(),
            lo: Vec::new(),
            step: Vec::new(),
        })
    }

    /// Bits per value.
    pub fn bits(&self) -> u32 {
        self.bits
    }

    /// Positions per quantized block.
    pub fn group(&self) -> usize {
        self.group
    }

    /// Positions quantized: every whole block below the rows given to [`LowBitKeys::update`].
    pub fn rows(&self) -> usize {
        self.blocks * self.group
    }

    /// Bytes held (codes, minima and steps).
    pub fn bytes(&self) -> usize {
        self.codes.len() + 4 * (self.lo.len() + self.step.len())
    }

    fn head_bytes(&self) -> usize {
        self.shape.head_dim * self.bits as usize / 8
    }

    fn row_bytes(&self) -> usize {
        self.shape.n_kv_head * self.head_bytes()
    }

    /// Forgets every block holding a position at or after `rows` (rows rewritten or dropped).
    pub fn truncate(&mut self, rows: usize) {
        let blocks = (rows / self.group).min(self.blocks);
        self.blocks = blocks;
        let per = self.shape.n_kv_head * self.shape.head_dim;
        self.codes.truncate(blocks * self.group * self.row_bytes());
        self.lo.truncate(blocks * per);
        self.step.truncate(blocks * per);
    }

    /// Quantizes every whole block of `k` (`(rows, n_kv_head, head_dim)`, keys at their
    /// positions) not quantized yet.
    pub fn update(&mut self, k: &[f32]) -> Result<()> {
        let row = self.shape.n_kv_head * self.shape.head_dim;
        if !k.len().is_multiple_of(row) {
            return Err(shape_err("low-bit keys", "keys must hold whole rows"));
        }
        let rows = k.len() / row;
        let (start, end) = (self.blocks, rows / self.group);
        if end <= start {
            return Ok(());
        }
        // Blocks are independent: a long prompt's are quantized on every core.
        let span = self.group * row;
        let parts: Vec<(Vec<u8>, Vec<f32>, Vec<f32>)> = k[start * span..end * span]
            .par_chunks(span)
            .map(|block| self.quantize_block(block))
            .collect();
        for (codes, lo, step) in parts {
            self.codes.extend_from_slice(&codes);
            self.lo.extend_from_slice(&lo);
            self.step.extend_from_slice(&step);
        }
        self.blocks = end;
        Ok(())
    }

    /// One block's codes, minima and steps.
    fn quantize_block(&self, block: &[f32]) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
        let AttentionShape {
            n_kv_head, head_dim, ..
        } = self.shape;
        let row = n_kv_head * head_dim;
        let levels = ((1u32 << self.bits) - 1) as f32;
        // Channels are contiguous in a row: min and max over the block's rows, row by row.
        let mut lo = block[..row].to_vec();
        let mut hi = lo.clone();
        for r in block.chunks_exact(row).skip(1) {
            for ((lo, hi), &x) in lo.iter_mut().zip(hi.iter_mut()).zip(r) {
                *lo = lo.min(x);
                *hi = hi.max(x);
            }
        }
        let step: Vec<f32> = lo
            .iter()
            .zip(&hi)
            .map(|(&lo, &hi)| if hi > lo { (hi - lo) / levels } else { 0.0 })
            .collect();
        let inv: Vec<f32> = step
            .iter()
            .map(|&s| if s > 0.0 { 1.0 / s } else { 0.0 })
            .collect();
        let (bits, hb) = (self.bits as usize, self.head_bytes());
        let mut out = Vec::with_capacity(self.group * self.row_bytes());
        let mut codes = vec![0u8; row];
        for r in block.chunks_exact(row) {
            for (((c, &x), &lo), &inv) in codes.iter_mut().zip(r).zip(&lo).zip(&inv) {
                *c = ((x - lo) * inv).round().clamp(0.0, levels) as u8;
            }
            for head in codes.chunks_exact(head_dim) {
                let mut bytes = head[..hb].to_vec();
                for (i, part) in head.chunks_exact(hb).enumerate().skip(1) {
                    for (b, &c) in bytes.iter_mut().zip(part) {
                        *b |= c << (i * bits);
                    }
                }
                out.extend_from_slice(&bytes);
            }
        }
        (out, lo, step)
    }

    /// The dequantized key of kv head `g` at position `t` (below [`LowBitKeys::rows`]).
    pub fn dequantize(&self, t: usize, g: usize) -> Vec<f32> {
        let d = self.shape.head_dim;
        let (b, hb) = (t / self.group, self.head_bytes());
        let off = b * self.shape.n_kv_head * d + g * d;
        let bytes = &self.codes[t * self.row_bytes() + g * hb..][..hb];
        let mut x = vec![0f32; d];
        unpack(bytes, self.bits, &mut x);
        for (c, x) in x.iter_mut().enumerate() {
            *x = self.lo[off + c] + self.step[off + c] * *x;
        }
        x
    }

    /// Scaled scores `q·k / sqrt(head_dim)` of the query heads of kv head `g` (the group of
    /// `n_head / n_kv_head` heads, `q` holding one row of all `n_head` heads) against every
    /// quantized position: `out[h * rows + t]` for group head `h`.
    pub fn scores(&self, q: &[f32], g: usize, out: &mut Vec<f32>) -> Result<()> {
        let AttentionShape {
            n_head,
            n_kv_head,
            head_dim: d,
        } = self.shape;
        if q.len() != n_head * d || g >= n_kv_head {
            return Err(shape_err(
                "low-bit scores",
                format!("{} query values for kv head {g}", q.len()),
            ));
        }
        let heads = n_head / n_kv_head;
        let q = &q[g * heads * d..(g + 1) * heads * d];
        out.clear();
        out.resize(heads * self.rows(), 0.0);
        #[cfg(target_arch = "x86_64")]
        if wide_available() {
            // SAFETY: the CPU has the features `score_wide` is compiled for.
            unsafe { self.score_wide(q, g, out) };
            return Ok(());
        }
        self.score_all(q, g, out);
        Ok(())
    }

    /// How much the query heads of kv head `g` would attend to each quantized position in
    /// `from..to` (below [`LowBitKeys::rows`]): per head the softmax of the approximate scores
    /// over those positions, then the largest over the group's heads (SpeContext's max over a
    /// GQA group), `out[t - from]`.
    pub fn importance(
        &self,
        q: &[f32],
        g: usize,
        from: usize,
        to: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        if from > to || to > self.rows() {
            return Err(shape_err(
                "low-bit importance",
                format!("rows {from}..{to} of {}", self.rows()),
            ));
        }
        let mut s = Vec::new();
        self.scores(q, g, &mut s)?;
        out.clear();
        out.resize(to - from, 0.0);
        #[cfg(target_arch = "x86_64")]
        if wide_available() {
            // SAFETY: the CPU has the features `importance_wide` is compiled for.
            unsafe { importance_wide(&s, self.rows(), from, to, out) };
            return Ok(());
        }
        importance_all(&s, self.rows(), from, to, out);
        Ok(())
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
    unsafe fn score_wide(&self, q: &[f32], g: usize, out: &mut [f32]) {
        self.score_all(q, g, out);
    }

    /// The scoring loop, written for the compiler to vectorize: per block the query is folded
    /// into the block's steps and minima (`q·k = Σ q·lo + Σ (q·step)·code`), then each
    /// position unpacks its codes once for all heads of the group.
    #[inline(always)]
    fn score_all(&self, q: &[f32], g: usize, out: &mut [f32]) {
        let d = self.shape.head_dim;
        let heads = q.len() / d;
        let rows = self.rows();
        let scale = 1.0 / (d as f32).sqrt();
        let (hb, rb) = (self.head_bytes(), self.row_bytes());
        let mut a = vec![0f32; heads * d];
        let mut x = vec![0f32; d];
        let mut bias = vec![0f32; heads];
        for b in 0..self.blocks {
            let off = b * self.shape.n_kv_head * d + g * d;
            let (lo, step) = (&self.lo[off..off + d], &self.step[off..off + d]);
            for h in 0..heads {
                let qh = &q[h * d..(h + 1) * d];
                for c in 0..d {
                    a[h * d + c] = qh[c] * step[c] * scale;
                }
                bias[h] = dot(qh, lo) * scale;
            }
            for t in b * self.group..(b + 1) * self.group {
                unpack(&self.codes[t * rb + g * hb..][..hb], self.bits, &mut x);
                for h in 0..heads {
                    out[h * rows + t] = bias[h] + dot(&a[h * d..(h + 1) * d], &x);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn importance_wide(s: &[f32], rows: usize, from: usize, to: usize, out: &mut [f32]) {
    importance_all(s, rows, from, to, out);
}

/// Per head softmax over `from..to` of the scores `s[h * rows + t]`, the maximum over heads.
#[inline(always)]
fn importance_all(s: &[f32], rows: usize, from: usize, to: usize, out: &mut [f32]) {
    let mut e = vec![0f32; to - from];
    for sh in s.chunks_exact(rows.max(1)) {
        let sh = &sh[from..to];
        let max = sh.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for (e, &x) in e.iter_mut().zip(sh) {
            *e = crate::attention::exp_nonpositive(x - max);
            sum += *e;
        }
        let inv = 1.0 / sum;
        for (o, &e) in out.iter_mut().zip(&e) {
            *o = o.max(e * inv);
        }
    }
}

/// Whether the CPU runs the 512-bit scoring loop (checked once).
#[cfg(target_arch = "x86_64")]
fn wide_available() -> bool {
    static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WIDE.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
    })
}

/// Codes of one head (`x.len()` channels) as floats.
#[inline(always)]
fn unpack(bytes: &[u8], bits: u32, x: &mut [f32]) {
    let n = bytes.len();
    let mask = (1u8 << bits) - 1;
    for i in 0..(8 / bits) as usize {
        let shift = i as u32 * bits;
        for (x, &b) in x[i * n..(i + 1) * n].iter_mut().zip(bytes) {
            *x = ((b >> shift) & mask) as f32;
        }
    }
}

/// A dot product over 16 lanes (vectorizes without reassociation).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let mut ca = a.chunks_exact(16);
    let mut cb = b.chunks_exact(16);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn shape() -> AttentionShape {
        AttentionShape {
            n_head: 6,
            n_kv_head: 2,
            head_dim: 64,
        }
    }

    #[test]
    fn codes_round_trip_within_half_a_step() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let row = 2 * 64;
        let k: Vec<f32> = (0..100 * row).map(|_| rng.gen_range(-3.0..3.0)).collect();
        for bits in [2, 4] {
            let mut lb = LowBitKeys::new(shape(), bits, 32).expect("shape");
            lb.update(&k).expect("update");
            assert_eq!(lb.rows(), 96, "only whole blocks");
            let levels = ((1 << bits) - 1) as f32;
            for t in [0, 31, 32, 95] {
                for g in 0..2 {
                    let x = lb.dequantize(t, g);
                    let b = t / 32;
                    for (c, &x) in x.iter().enumerate() {
                        let col: Vec<f32> = (b * 32..b * 32 + 32)
                            .map(|s| k[s * row + g * 64 + c])
                            .collect();
                        let (lo, hi) = col
                            .iter()
                            .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
                        let half = (hi - lo) / levels / 2.0 + 1e-5;
                        assert!(
                            (x - k[t * row + g * 64 + c]).abs() <= half,
                            "{bits} bits at {t}/{g}/{c}"
                        );
                    }
                }
            }
            lb.truncate(70);
            assert_eq!(lb.rows(), 64);
            lb.update(&k).expect("again");
            assert_eq!(lb.rows(), 96);
        }
    }

    #[test]
    fn scores_are_the_dequantized_keys_dot_products() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let row = 2 * 64;
        let k: Vec<f32> = (0..64 * row).map(|_| rng.gen_range(-2.0..2.0)).collect();
        let q: Vec<f32> = (0..6 * 64).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let mut lb = LowBitKeys::new(shape(), 4, 16).expect("shape");
        lb.update(&k).expect("update");
        let mut s = Vec::new();
        for g in 0..2 {
            lb.scores(&q, g, &mut s).expect("scores");
            for h in 0..3 {
                for t in 0..64 {
                    let kd = lb.dequantize(t, g);
                    let qh = &q[(g * 3 + h) * 64..(g * 3 + h + 1) * 64];
                    let want: f32 = qh.iter().zip(&kd).map(|(a, b)| a * b).sum::<f32>() / 8.0;
                    assert!((s[h * 64 + t] - want).abs() < 1e-3, "{g}/{h}/{t}");
                }
            }
        }
        assert!(LowBitKeys::new(shape(), 3, 16).is_err());
    }
}
