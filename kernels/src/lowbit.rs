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
    /// Per block, per kv head, per group of `W = 4 * 8 / bits` channels, per position of the
    /// block: 4 bytes, byte `i` holding channels `W * j + i + 4 * s` at bit `s * bits` (VNNI's
    /// layout: 16 positions' 4 bytes fill a 512-bit register, each lane 4 channels of one
    /// position, and `s` shifts bring the next 4 channels into place).
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
            n_kv_head,
            head_dim,
            ..
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
        let (bits, per_byte) = (self.bits as usize, 8 / self.bits as usize);
        let width = 4 * per_byte;
        let mut codes = vec![0u8; self.group * row];
        for (r, codes) in block.chunks_exact(row).zip(codes.chunks_exact_mut(row)) {
            for (((c, &x), &lo), &inv) in codes.iter_mut().zip(r).zip(&lo).zip(&inv) {
                *c = ((x - lo) * inv).round().clamp(0.0, levels) as u8;
            }
        }
        let mut out = Vec::with_capacity(self.group * self.row_bytes());
        for g in 0..n_kv_head {
            for j in 0..head_dim / width {
                for t in 0..self.group {
                    for i in 0..4 {
                        let mut byte = 0u8;
                        for s in 0..per_byte {
                            byte |=
                                codes[t * row + g * head_dim + width * j + i + 4 * s] << (s * bits);
                        }
                        out.push(byte);
                    }
                }
            }
        }
        (out, lo, step)
    }

    /// The dequantized key of kv head `g` at position `t` (below [`LowBitKeys::rows`]).
    pub fn dequantize(&self, t: usize, g: usize) -> Vec<f32> {
        let d = self.shape.head_dim;
        let b = t / self.group;
        let off = b * self.shape.n_kv_head * d + g * d;
        let mut x = vec![0f32; d];
        self.unpack(b, g, t % self.group, &mut x);
        for (c, x) in x.iter_mut().enumerate() {
            *x = self.lo[off + c] + self.step[off + c] * *x;
        }
        x
    }

    /// The codes of kv head `g` at position `t` of block `b`, as floats.
    #[inline(always)]
    fn unpack(&self, b: usize, g: usize, t: usize, x: &mut [f32]) {
        let (bits, per_byte) = (self.bits as usize, 8 / self.bits as usize);
        let width = 4 * per_byte;
        let groups = self.shape.head_dim / width;
        let mask = (1u8 << bits) - 1;
        let base = (b * self.shape.n_kv_head + g) * groups;
        for j in 0..groups {
            let at = ((base + j) * self.group + t) * 4;
            let bytes = &self.codes[at..at + 4];
            for s in 0..per_byte {
                for i in 0..4 {
                    x[width * j + i + 4 * s] = ((bytes[i] >> (s * bits)) & mask) as f32;
                }
            }
        }
    }

    /// Scaled scores `q·k / sqrt(head_dim)` of the query heads of kv head `g` (the group of
    /// `n_head / n_kv_head` heads, `q` holding one row of all `n_head` heads) against every
    /// quantized position: `out[h * rows + t]` for group head `h`.
    pub fn scores(&self, q: &[f32], g: usize, out: &mut Vec<f32>) -> Result<()> {
        let all: Vec<usize> = (0..self.blocks).collect();
        self.scores_of(q, g, &all, out)
    }

    /// [`LowBitKeys::scores`] over the positions of `blocks` only: with `n = blocks.len() *
    /// group`, `out[h * n + i * group + t]` is position `blocks[i] * group + t`.
    pub fn scores_of(
        &self,
        q: &[f32],
        g: usize,
        blocks: &[usize],
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let heads = self.check_query(q, g, blocks)?;
        let d = self.shape.head_dim;
        let q = &q[g * heads * d..(g + 1) * heads * d];
        out.clear();
        out.resize(heads * blocks.len() * self.group, 0.0);
        #[cfg(target_arch = "x86_64")]
        if vnni_available() && heads <= 8 && self.group.is_multiple_of(16) {
            // SAFETY: the CPU has the features `score_vnni` is compiled for; 16 positions
            // divide every block and at most 8 heads share a kv head.
            unsafe { self.score_vnni(q, g, blocks, out) };
            return Ok(());
        }
        #[cfg(target_arch = "x86_64")]
        if wide_available() {
            // SAFETY: the CPU has the features `score_wide` is compiled for.
            unsafe { self.score_wide(q, g, blocks, out) };
            return Ok(());
        }
        self.score_all(q, g, blocks, out);
        Ok(())
    }

    /// Checks one row of queries of every head against kv head `g` and quantized `blocks`;
    /// returns the query heads per kv head.
    fn check_query(&self, q: &[f32], g: usize, blocks: &[usize]) -> Result<usize> {
        let AttentionShape {
            n_head,
            n_kv_head,
            head_dim: d,
        } = self.shape;
        if q.len() != n_head * d || g >= n_kv_head || blocks.iter().any(|&b| b >= self.blocks) {
            return Err(shape_err(
                "low-bit keys",
                format!(
                    "{} query values for kv head {g} over blocks {blocks:?}",
                    q.len()
                ),
            ));
        }
        Ok(n_head / n_kv_head)
    }

    /// An upper bound of each block's scores from its minima and steps alone (every key of
    /// block `b` lies in the box `lo..=lo + levels * step`, Quest's page bound): per head the
    /// bound less the largest over `blocks`, then the largest over the group's heads; one
    /// value per block of `blocks`, at 1 / `group` of the cost of scoring its positions.
    pub fn block_bounds(&self, q: &[f32], g: usize, blocks: &[usize]) -> Result<Vec<f32>> {
        let heads = self.check_query(q, g, blocks)?;
        let d = self.shape.head_dim;
        let qg = &q[g * heads * d..(g + 1) * heads * d];
        let mut out = vec![f32::NEG_INFINITY; blocks.len()];
        #[cfg(target_arch = "x86_64")]
        if wide_available() {
            // SAFETY: the CPU has the features `bounds_wide` is compiled for.
            unsafe { self.bounds_wide(qg, g, blocks, &mut out) };
            return Ok(out);
        }
        self.bounds_all(qg, g, blocks, &mut out);
        Ok(out)
    }

    /// [`LowBitKeys::bounds_all`] on 512-bit registers (the same operations lane for lane:
    /// the same bits; without them the loop compiled for the baseline's 4-lane SSE). A
    /// SpeCache draft step bounds every block of every layer and kv head against the group's
    /// query heads: at 32k tokens of the default target this took ~51-53 ms per draft step
    /// to ~47-49 (`specrag-bench long`).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
    unsafe fn bounds_wide(&self, qg: &[f32], g: usize, blocks: &[usize], out: &mut [f32]) {
        self.bounds_all(qg, g, blocks, out);
    }

    /// [`LowBitKeys::block_bounds`]'s values into `out` (filled with -inf) for the group's
    /// query heads `qg`.
    #[inline(always)]
    fn bounds_all(&self, qg: &[f32], g: usize, blocks: &[usize], out: &mut [f32]) {
        let d = self.shape.head_dim;
        let mut per_head = vec![0f32; blocks.len()];
        for qh in qg.chunks_exact(d) {
            for (pb, &b) in per_head.iter_mut().zip(blocks) {
                *pb = self.block_bound(qh, b, g);
            }
            let max = per_head.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            for (o, &p) in out.iter_mut().zip(&per_head) {
                *o = o.max(p - max);
            }
        }
    }

    /// The largest score `qh·k / sqrt(d)` one query head `qh` can have against a key of kv
    /// head `g` in block `b`: every such key lies in the box `lo..=lo + levels * step`.
    #[inline(always)]
    pub fn block_bound(&self, qh: &[f32], b: usize, g: usize) -> f32 {
        let d = self.shape.head_dim;
        let levels = ((1u32 << self.bits) - 1) as f32;
        let off = b * self.shape.n_kv_head * d + g * d;
        let (lo, step) = (&self.lo[off..off + d], &self.step[off..off + d]);
        let mut acc = [0f32; 16];
        for ((q, lo), step) in qh
            .chunks_exact(16)
            .zip(lo.chunks_exact(16))
            .zip(step.chunks_exact(16))
        {
            for l in 0..16 {
                let a = q[l] * lo[l];
                let b = q[l] * (lo[l] + levels * step[l]);
                acc[l] += a.max(b);
            }
        }
        acc.iter().sum::<f32>() / (d as f32).sqrt()
    }

    /// How much the query heads of kv head `g` would attend to each position of `blocks`
    /// that lies in `positions` (positions outside get 0): per head the softmax of the
    /// approximate scores over those positions, then the largest over the group's heads
    /// (SpeContext's max over a GQA group); laid out as [`LowBitKeys::scores_of`]'s rows.
    pub fn importance(
        &self,
        q: &[f32],
        g: usize,
        blocks: &[usize],
        positions: std::ops::Range<usize>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let mut s = Vec::new();
        self.scores_of(q, g, blocks, &mut s)?;
        let n = blocks.len() * self.group;
        // Positions outside the range weigh nothing: -inf exponentiates to an exact 0.
        for (i, &b) in blocks.iter().enumerate() {
            for t in 0..self.group {
                let p = b * self.group + t;
                if !positions.contains(&p) {
                    for h in 0..s.len() / n.max(1) {
                        s[h * n + i * self.group + t] = f32::NEG_INFINITY;
                    }
                }
            }
        }
        out.clear();
        out.resize(n, 0.0);
        #[cfg(target_arch = "x86_64")]
        if wide_available() {
            // SAFETY: the CPU has the features `importance_wide` is compiled for.
            unsafe { importance_wide(&s, n, out) };
            return Ok(());
        }
        importance_all(&s, n, out);
        Ok(())
    }

    /// The query folded into block `b`'s steps (`q·step / sqrt(d)`), rounded to i8 per head
    /// with a scale per head, 4 channels per word (word `w` of a head holds channels
    /// `4w..4w + 4`, which is also the codes' order: group `j`, shift `s` is word
    /// `j * 8 / bits + s`), into `words`; the scales and the biases `q·lo / sqrt(d)` per head.
    #[inline(always)]
    fn fold_i8(&self, q: &[f32], b: usize, g: usize, f: &mut Folded) {
        let d = self.shape.head_dim;
        let scale = 1.0 / (d as f32).sqrt();
        let off = b * self.shape.n_kv_head * d + g * d;
        let (lo, step) = (&self.lo[off..off + d], &self.step[off..off + d]);
        f.words.clear();
        f.scales.clear();
        f.bias.clear();
        f.a.resize(d, 0.0);
        f.bytes.resize(d, 0);
        for qh in q.chunks_exact(d) {
            for ((a, &q), &s) in f.a.iter_mut().zip(qh).zip(step) {
                *a = q * s * scale;
            }
            let amax = f.a.iter().fold(0f32, |m, &x| m.max(x.abs()));
            let unit = amax / 127.0;
            let inv = if unit > 0.0 { 1.0 / unit } else { 0.0 };
            for (byte, &a) in f.bytes.iter_mut().zip(&f.a) {
                *byte = (a * inv).round() as i8 as u8;
            }
            f.words.extend(
                f.bytes
                    .chunks_exact(4)
                    .map(|w| i32::from_le_bytes([w[0], w[1], w[2], w[3]])),
            );
            f.scales.push(unit);
            f.bias.push(dot(qh, lo) * scale);
        }
    }

    /// [`LowBitKeys::scores`] on AVX-512 VNNI: per 16 positions and group of channels one load,
    /// `8 / bits` shifts, and one `vpdpbusd` (64 u8 x i8 products) per head and shift, the
    /// query rounded to i8 per block and head ([`LowBitKeys::fold_i8`]).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn score_vnni(&self, q: &[f32], g: usize, blocks: &[usize], out: &mut [f32]) {
        use std::arch::x86_64::*;
        let d = self.shape.head_dim;
        let heads = q.len() / d;
        let rows = blocks.len() * self.group;
        let (bits, per_byte) = (self.bits as usize, 8 / self.bits as usize);
        let groups = d / (4 * per_byte);
        let mask = _mm512_set1_epi8(((1u32 << bits) - 1) as i8);
        let mut f = Folded::default();
        let quarter = d / 4;
        for (i, &b) in blocks.iter().enumerate() {
            self.fold_i8(q, b, g, &mut f);
            let (words, scales, bias) = (&f.words, &f.scales, &f.bias);
            let base = (b * self.shape.n_kv_head + g) * groups;
            for t0 in (0..self.group).step_by(16) {
                let mut acc = [_mm512_setzero_si512(); 8];
                for j in 0..groups {
                    let at = ((base + j) * self.group + t0) * 4;
                    // SAFETY: 16 positions of 4 bytes from `at` lie inside the block.
                    let v = unsafe { _mm512_loadu_si512(self.codes.as_ptr().add(at).cast()) };
                    for s in 0..per_byte {
                        let shift = _mm_cvtsi32_si128((s * bits) as i32);
                        let u = _mm512_and_si512(_mm512_srl_epi16(v, shift), mask);
                        for h in 0..heads {
                            let w = _mm512_set1_epi32(words[h * quarter + j * per_byte + s]);
                            acc[h] = _mm512_dpbusd_epi32(acc[h], u, w);
                        }
                    }
                }
                for h in 0..heads {
                    let f = _mm512_cvtepi32_ps(acc[h]);
                    let r = _mm512_fmadd_ps(f, _mm512_set1_ps(scales[h]), _mm512_set1_ps(bias[h]));
                    let at = h * rows + i * self.group + t0;
                    assert!(at + 16 <= out.len());
                    // SAFETY: checked just above.
                    unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(at), r) };
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
    unsafe fn score_wide(&self, q: &[f32], g: usize, blocks: &[usize], out: &mut [f32]) {
        self.score_all(q, g, blocks, out);
    }

    /// The scoring loop, written for the compiler to vectorize: per block the query is folded
    /// into the block's steps and minima (`q·k = Σ q·lo + Σ (q·step)·code`), then each
    /// position unpacks its codes once for all heads of the group.
    #[inline(always)]
    fn score_all(&self, q: &[f32], g: usize, blocks: &[usize], out: &mut [f32]) {
        let d = self.shape.head_dim;
        let heads = q.len() / d;
        let rows = blocks.len() * self.group;
        let scale = 1.0 / (d as f32).sqrt();
        let mut a = vec![0f32; heads * d];
        let mut x = vec![0f32; d];
        let mut bias = vec![0f32; heads];
        for (i, &b) in blocks.iter().enumerate() {
            let off = b * self.shape.n_kv_head * d + g * d;
            let (lo, step) = (&self.lo[off..off + d], &self.step[off..off + d]);
            for h in 0..heads {
                let qh = &q[h * d..(h + 1) * d];
                for c in 0..d {
                    a[h * d + c] = qh[c] * step[c] * scale;
                }
                bias[h] = dot(qh, lo) * scale;
            }
            for t in 0..self.group {
                self.unpack(b, g, t, &mut x);
                for h in 0..heads {
                    out[h * rows + i * self.group + t] = bias[h] + dot(&a[h * d..(h + 1) * d], &x);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
unsafe fn importance_wide(s: &[f32], n: usize, out: &mut [f32]) {
    importance_all(s, n, out);
}

/// Per head (`n` scores each) the softmax, the maximum over heads.
#[inline(always)]
fn importance_all(s: &[f32], n: usize, out: &mut [f32]) {
    let mut e = vec![0f32; n];
    for sh in s.chunks_exact(n.max(1)) {
        let max = sh.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            continue;
        }
        for (e, &x) in e.iter_mut().zip(sh) {
            *e = crate::attention::exp_nonpositive(x - max);
        }
        let mut acc = [0f32; 16];
        let mut chunks = e.chunks_exact(16);
        for c in &mut chunks {
            for l in 0..16 {
                acc[l] += c[l];
            }
        }
        let sum = acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>();
        let inv = 1.0 / sum;
        for (o, &e) in out.iter_mut().zip(&e) {
            *o = o.max(e * inv);
        }
    }
}

/// A query folded into one block ([`LowBitKeys::fold_i8`]), with its scratch.
#[derive(Default)]
struct Folded {
    words: Vec<i32>,
    scales: Vec<f32>,
    bias: Vec<f32>,
    a: Vec<f32>,
    bytes: Vec<u8>,
}

/// Whether the CPU has every one of `features`, checked once per call site.
#[cfg(target_arch = "x86_64")]
macro_rules! detected {
    ($($f:tt),+) => {{
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| true $(&& is_x86_feature_detected!($f))+)
    }};
}

/// Whether the CPU has AVX-512 VNNI.
#[cfg(target_arch = "x86_64")]
fn vnni_available() -> bool {
    detected!("avx512f", "avx512bw", "avx512vnni")
}

/// Whether the CPU runs the 512-bit scoring loop.
#[cfg(target_arch = "x86_64")]
fn wide_available() -> bool {
    detected!("avx512f", "avx512bw", "avx2", "fma")
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
        for bits in [2, 4] {
            let mut lb = LowBitKeys::new(shape(), bits, 16).expect("shape");
            lb.update(&k).expect("update");
            let levels = ((1 << bits) - 1) as f32;
            let mut s = Vec::new();
            for g in 0..2 {
                lb.scores(&q, g, &mut s).expect("scores");
                for h in 0..3 {
                    let qh = &q[(g * 3 + h) * 64..(g * 3 + h + 1) * 64];
                    for t in 0..64 {
                        let kd = lb.dequantize(t, g);
                        let want: f32 = qh.iter().zip(&kd).map(|(a, b)| a * b).sum::<f32>() / 8.0;
                        // The VNNI path rounds q·step/8 to i8 per block and head: half a unit
                        // of 1/127 of its largest value per channel and code level.
                        let off = (t / 16) * 128 + g * 64;
                        let amax = qh
                            .iter()
                            .zip(&lb.step[off..off + 64])
                            .fold(0f32, |m, (q, s)| m.max((q * s / 8.0).abs()));
                        let bound = amax / 127.0 / 2.0 * levels * 64.0 + 1e-3;
                        let err = (s[h * 64 + t] - want).abs();
                        assert!(err <= bound, "{bits} bits {g}/{h}/{t}: {err} > {bound}");
                    }
                }
                // The portable loop, whichever path `scores` took here: f32 throughout.
                let mut plain = vec![0f32; 3 * 64];
                lb.score_all(
                    &q[g * 3 * 64..(g + 1) * 3 * 64],
                    g,
                    &[0, 1, 2, 3],
                    &mut plain,
                );
                for h in 0..3 {
                    let qh = &q[(g * 3 + h) * 64..(g * 3 + h + 1) * 64];
                    for t in 0..64 {
                        let kd = lb.dequantize(t, g);
                        let want: f32 = qh.iter().zip(&kd).map(|(a, b)| a * b).sum::<f32>() / 8.0;
                        assert!((plain[h * 64 + t] - want).abs() < 1e-3, "{g}/{h}/{t}");
                    }
                }
            }
        }
        // A block's bound holds for every key in it (dequantized, as scored) and for the
        // exact keys too (they lie in the same box).
        let lb = {
            let mut lb = LowBitKeys::new(shape(), 2, 16).expect("shape");
            lb.update(&k).expect("update");
            lb
        };
        for g in 0..2 {
            for h in 0..3 {
                let qh = &q[(g * 3 + h) * 64..(g * 3 + h + 1) * 64];
                for b in 0..4 {
                    let bound = lb.block_bound(qh, b, g);
                    for t in b * 16..(b + 1) * 16 {
                        let kd = lb.dequantize(t, g);
                        let exact = &k[t * row + g * 64..t * row + (g + 1) * 64];
                        for key in [&kd[..], exact] {
                            let s: f32 = qh.iter().zip(key).map(|(a, b)| a * b).sum::<f32>() / 8.0;
                            assert!(s <= bound + 1e-4, "{g}/{h}/{t}: {s} > {bound}");
                        }
                    }
                }
            }
            let all: Vec<usize> = (0..4).collect();
            let rel = lb.block_bounds(&q, g, &all).expect("bounds");
            assert!(rel.iter().all(|&r| r <= 0.0) && rel.contains(&0.0));
        }
        assert!(LowBitKeys::new(shape(), 3, 16).is_err());
    }
}
