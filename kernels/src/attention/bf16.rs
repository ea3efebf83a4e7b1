//! Attention with bfloat16 products on AVX-512 BF16 (`vdpbf16ps`): an opt-in precision.
//!
//! The f32 tile ([`super::avx512`]) keeps the head dimension along the register lanes, so every
//! score ends in a 16-to-1 reduction that costs about half as much as its multiply-adds; and a
//! float multiply-add does 16 products per instruction. Here queries, keys, probabilities and
//! values are rounded to bfloat16 (8-bit mantissa, to nearest even) and `vdpbf16ps` does 32
//! products per instruction, accumulating pairs into f32 lanes with exact products:
//!
//! - scores: keys go along the lanes, 16 per register, and consecutive pairs of the head
//!   dimension along each lane's two halves (packed per KV head, [`Bf16Kv`]); a query pair is
//!   broadcast, so a score is one lane's sequence of pair products in dimension order and needs
//!   no reduction;
//! - outputs: the head dimension goes along the lanes and consecutive pairs of keys along the
//!   halves, so a probability pair is broadcast against a packed pair of value rows.
//!
//! The softmax stays in f32 ([`super::softmax_in_place`]). Every lane is computed alone in a
//! fixed order (dimension pairs in order for a score, key pairs in position order for an
//! output, masked probabilities exact zeros), so a row's result still does not depend on the
//! rows that share the call (tested), which blended prefill relies on. It is not the f32
//! result: each element of q, k, p and v carries up to 2^-8 relative rounding (8 significant bits;
//! llama.cpp's f16 KV cache: 11 bits, 2^-11).
//!
//! Head dimensions 64 and 128 (every default model); the caller keeps f32 for others.

// Register blocks index several arrays (rows, accumulators, key blocks) by the same counters.
#![allow(clippy::needless_range_loop)]

use super::tile::AttentionShape;
#[cfg(target_arch = "x86_64")]
use super::tile::{softmax_in_place, ROW_GROUP};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Whether the CPU has AVX-512 BF16 (checked once).
pub(super) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static BF16: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *BF16.get_or_init(|| {
            is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether this path handles heads of dimension `d`.
pub(super) fn handles(d: usize) -> bool {
    matches!(d, 64 | 128)
}

/// `x` rounded to bfloat16, to nearest even (NaN stays NaN): the bits of the upper half.
#[inline(always)]
pub(super) fn bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// Two bfloat16 values in one lane: `lo` in the low half (the pair's first element).
#[inline(always)]
fn pair(lo: f32, hi: f32) -> u32 {
    u32::from(bf16(lo)) | (u32::from(bf16(hi)) << 16)
}

/// Keys per block of score lanes.
const LANES: usize = 16;

#[cfg(target_arch = "x86_64")]
/// Keys per cache block: 8 KB of packed keys or values at d = 64, which stay in L1 while the
/// tile's rows pass over them.
const KEY_BLOCK: usize = 64;

/// A KV cache's rows rounded to bfloat16 and packed for the bf16 attention: kept beside the
/// f32 cache and brought up to date incrementally ([`Bf16Kv::update`]), so a decode step packs
/// only the block of 16 rows its token lands in.
#[derive(Debug, Clone)]
pub struct Bf16Kv {
    shape: AttentionShape,
    heads: Vec<Packed>,
    /// Rows packed from the f32 cache and unchanged since.
    valid: usize,
    /// Rows the buffers hold (the last update's).
    rows: usize,
}

impl Bf16Kv {
    /// An empty mirror for caches of `shape`.
    pub fn new(shape: AttentionShape) -> Self {
        Self {
            shape,
            heads: (0..shape.n_kv_head)
                .map(|_| Packed {
                    k: Vec::new(),
                    v: Vec::new(),
                })
                .collect(),
            valid: 0,
            rows: 0,
        }
    }

    /// Whether this CPU runs bf16 attention for heads of `shape` (AVX-512 BF16, head
    /// dimension 64 or 128).
    pub fn handles(shape: AttentionShape) -> bool {
        available() && handles(shape.head_dim)
    }

    /// The head layout it was made for.
    pub fn shape(&self) -> AttentionShape {
        self.shape
    }

    /// Rows held (the last [`update`](Self::update)'s `n`).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Marks rows from `pos` on as changed in the f32 cache (the next update repacks them).
    pub fn invalidate_from(&mut self, pos: usize) {
        self.valid = self.valid.min(pos);
    }

    /// Packs rows `0..n` of the f32 caches `k` and `v` (layout `[row][n_kv_head][d]`), redoing
    /// only the blocks of 16 rows from the first changed one.
    pub fn update(&mut self, k: &[f32], v: &[f32], n: usize) {
        let from = self.valid.min(n) / LANES * LANES;
        let (shape, heads) = (self.shape, &mut self.heads);
        let pack = |(g, p): (usize, &mut Packed)| p.update(k, v, shape, g, from, n);
        // Packing a prompt's rows is worth the thread pool; a decode step's block is not.
        if n - from >= 256 {
            use rayon::prelude::*;
            heads.par_iter_mut().enumerate().for_each(pack);
        } else {
            heads.iter_mut().enumerate().for_each(pack);
        }
        self.valid = n;
        self.rows = n;
    }

    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) fn head(&self, g: usize) -> &Packed {
        &self.heads[g]
    }
}

/// One KV head's rows, rounded and packed.
#[derive(Debug, Clone)]
pub(super) struct Packed {
    /// `[n.div_ceil(16)][d / 2][16]`: for each block of 16 keys and pair of dimensions, the
    /// pair of every key of the block (zeros past `n`).
    k: Vec<u32>,
    /// `[n.div_ceil(16) * 8][d]`: for each pair of keys and dimension, the two keys' values
    /// (zeros past `n`).
    v: Vec<u32>,
}

impl Packed {
    /// Repacks KV head `g`'s rows from `from` (a multiple of 16) to `n` and sizes the buffers
    /// for `n` rows.
    #[allow(
        clippy::too_many_lines,
        clippy::too_many_arguments,
        reason = "the packing loops of K and V pairs per lane, one pass over the new rows; they must stay in step"
    )]
    fn update(
        &mut self,
        k: &[f32],
        v: &[f32],
        shape: AttentionShape,
        g: usize,
        from: usize,
        n: usize,
    ) {
        let d = shape.head_dim;
        let row = shape.n_kv_head * d;
        let (blocks, first) = (n.div_ceil(LANES), from / LANES);
        let half = d / 2;
        let at = |t: &[f32], j: usize, c: usize| if j < n { t[j * row + g * d + c] } else { 0.0 };
        self.k.resize(blocks * half * LANES, 0);
        for (b, block) in self
            .k
            .chunks_exact_mut(half * LANES)
            .enumerate()
            .skip(first)
        {
            for (dp, lanes) in block.chunks_exact_mut(LANES).enumerate() {
                for (l, x) in lanes.iter_mut().enumerate() {
                    let j = b * LANES + l;
                    *x = pair(at(k, j, 2 * dp), at(k, j, 2 * dp + 1));
                }
            }
        }
        self.v.resize(blocks * LANES / 2 * d, 0);
        for (jp, lanes) in self
            .v
            .chunks_exact_mut(d)
            .enumerate()
            .skip(first * LANES / 2)
        {
            for (c, x) in lanes.iter_mut().enumerate() {
                *x = pair(at(v, 2 * jp, c), at(v, 2 * jp + 1, c));
            }
        }
    }

    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    fn keys(&self, d: usize) -> usize {
        self.k.len() / (d / 2)
    }
}

#[cfg(target_arch = "x86_64")]
/// Writes the `rows x d` outputs of query rows `start..start + rows` of head `h` into `out`
/// (zeros on entry), against `kv` (their head group's packed cache).
///
/// # Safety
/// The CPU must have AVX-512F and AVX-512 BF16 ([`available`]), `handles(d)` must hold, and
/// `kv` must hold every position of the rows.
#[target_feature(enable = "avx512f,avx512bf16")]
#[allow(
    clippy::too_many_lines,
    clippy::too_many_arguments,
    reason = "a SIMD tile: scores, softmax and outputs in registers of one loop nest, which a split would spill"
)]
pub(super) unsafe fn tile(
    q: &[f32],
    pos: &[usize],
    shape: AttentionShape,
    h: usize,
    start: usize,
    kv: &Packed,
    out: &mut [f32],
) {
    let d = shape.head_dim;
    let half = d / 2;
    let rows = pos.len();
    assert!(handles(d) && out.len() == rows * d);
    let kmax = pos.iter().max().map_or(0, |&p| p + 1);
    let kpad = kmax.div_ceil(LANES) * LANES;
    assert!(kpad <= kv.keys(d));
    let scale = 1.0 / (d as f32).sqrt();
    let qb: Vec<u32> = (0..rows)
        .flat_map(|r| {
            let qr = &q[((start + r) * shape.n_head + h) * d..][..d];
            qr.chunks_exact(2).map(|p| pair(p[0], p[1]))
        })
        .collect();
    // Row group `r0..r0 + n`'s keys end at the group's furthest position (a multiple of `m`).
    let group_end = |r0: usize, n: usize, m: usize| {
        pos[r0..r0 + n]
            .iter()
            .max()
            .map_or(0, |&p| p + 1)
            .div_ceil(m)
            * m
    };

    // Scores `rows x kpad`, by blocks of keys that stay in L1 while every row passes.
    let mut probs = vec![0f32; rows * kpad];
    // SAFETY: the CPU features (see # Safety); rows of `qb` hold `half` pairs, packed key
    // blocks up to `kpad / 16 <= kv.keys() / 16` exist, and score rows hold `kpad` values.
    unsafe {
        let (qp, pp, kb) = (qb.as_ptr(), probs.as_mut_ptr(), kv.k.as_ptr());
        for jb in (0..kpad).step_by(KEY_BLOCK) {
            let mut r0 = 0;
            while r0 < rows {
                let n = ROW_GROUP.min(rows - r0);
                let end = (jb + KEY_BLOCK).min(group_end(r0, n, LANES));
                let mut j = jb;
                while j < end {
                    let two = j + 2 * LANES <= end;
                    let keys = kb.add(j / LANES * half * LANES);
                    let q = |r: usize| qp.add((r0 + r) * half);
                    let o = |r: usize| pp.add((r0 + r) * kpad + j);
                    macro_rules! go {
                        ($($r:literal),*) => {
                            if two {
                                scores::<{ [$($r),*].len() }, 2>([$(q($r)),*], keys, half, scale, [$(o($r)),*])
                            } else {
                                scores::<{ [$($r),*].len() }, 1>([$(q($r)),*], keys, half, scale, [$(o($r)),*])
                            }
                        };
                    }
                    match n {
                        4 => go!(0, 1, 2, 3),
                        3 => go!(0, 1, 2),
                        2 => go!(0, 1),
                        _ => go!(0),
                    }
                    j += if two { 2 * LANES } else { LANES };
                }
                r0 += n;
            }
        }
    }

    // Softmax of each row's live keys in f32, then rounded to bfloat16; masked keys are exact
    // zeros up to `kpad` (a multiple of the key pairs the outputs read).
    let mut pb = vec![0u16; rows * kpad];
    for (i, &p) in pos.iter().enumerate() {
        let live = &mut probs[i * kpad..][..=p];
        softmax_in_place(live);
        for (b, &x) in pb[i * kpad..].iter_mut().zip(live.iter()) {
            *b = bf16(x);
        }
    }

    // Outputs, 4 rows and 64 lanes at a time, over the same blocks of keys (pairs of values).
    // SAFETY: the CPU features; probability rows hold `kpad / 2` pairs, packed value pairs up
    // to `kpad / 2 <= kv.keys() / 2` exist, and output rows hold `d` values.
    unsafe {
        let (pp, vb, op) = (pb.as_ptr().cast::<u32>(), kv.v.as_ptr(), out.as_mut_ptr());
        for jb in (0..kpad).step_by(KEY_BLOCK) {
            let mut r0 = 0;
            while r0 < rows {
                let n = ROW_GROUP.min(rows - r0);
                let end = (jb + KEY_BLOCK).min(group_end(r0, n, 2));
                let pairs = jb / 2..end.max(jb) / 2;
                let p = |r: usize| pp.add((r0 + r) * kpad / 2);
                for c in (0..d).step_by(64) {
                    let o = |r: usize| op.add((r0 + r) * d + c);
                    let (v, ps) = (vb.add(c), pairs.clone());
                    match n {
                        4 => weighted_sum(
                            [p(0), p(1), p(2), p(3)],
                            ps,
                            v,
                            d,
                            [o(0), o(1), o(2), o(3)],
                        ),
                        3 => weighted_sum([p(0), p(1), p(2)], ps, v, d, [o(0), o(1), o(2)]),
                        2 => weighted_sum([p(0), p(1)], ps, v, d, [o(0), o(1)]),
                        _ => weighted_sum([p(0)], ps, v, d, [o(0)]),
                    }
                }
                r0 += n;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
/// A vector of 32 bfloat16 values from 16 lanes of pairs.
#[inline(always)]
unsafe fn bh(x: __m512i) -> __m512bh {
    // SAFETY: both are 512 bits of plain data.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(x) }
}

#[cfg(target_arch = "x86_64")]
/// Scores of `R` rows against `B` blocks of 16 keys from `keys`: `out[r][0..16 B]`.
#[inline(always)]
unsafe fn scores<const R: usize, const B: usize>(
    q: [*const u32; R],
    keys: *const u32,
    half: usize,
    scale: f32,
    out: [*mut f32; R],
) {
    // SAFETY: rows of `q` hold `half` pairs, `keys` holds `B` packed blocks and rows of `out`
    // hold `16 B` values (the caller's bounds).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); B]; R];
        for dp in 0..half {
            let kv: [__m512bh; B] = std::array::from_fn(|b| {
                bh(_mm512_loadu_si512(
                    keys.add((b * half + dp) * LANES).cast::<__m512i>(),
                ))
            });
            for r in 0..R {
                let qv = bh(_mm512_set1_epi32(*q[r].add(dp) as i32));
                for b in 0..B {
                    acc[r][b] = _mm512_dpbf16_ps(acc[r][b], qv, kv[b]);
                }
            }
        }
        let s = _mm512_set1_ps(scale);
        for r in 0..R {
            for b in 0..B {
                _mm512_storeu_ps(out[r].add(b * LANES), _mm512_mul_ps(acc[r][b], s));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
/// Adds key pairs `pairs` (in position order) to 64 output lanes of `N` rows: `out[r] +=
/// Σ p[r][2jp] v[2jp] + p[r][2jp + 1] v[2jp + 1]`; the accumulators round-trip through `out`
/// exactly between blocks of keys.
#[inline(always)]
unsafe fn weighted_sum<const N: usize>(
    probs: [*const u32; N],
    pairs: std::ops::Range<usize>,
    v: *const u32,
    d: usize,
    out: [*mut f32; N],
) {
    // SAFETY: probability rows hold the pairs, packed value pairs of `pairs` exist (`d` apart)
    // and output rows have 64 lanes from `out[r]` (the caller's bounds).
    unsafe {
        let mut acc: [[__m512; 4]; N] =
            std::array::from_fn(|r| std::array::from_fn(|l| _mm512_loadu_ps(out[r].add(16 * l))));
        for jp in pairs {
            let vp = v.add(jp * d);
            let vv: [__m512bh; 4] =
                std::array::from_fn(|l| bh(_mm512_loadu_si512(vp.add(16 * l).cast::<__m512i>())));
            for r in 0..N {
                let pv = bh(_mm512_set1_epi32(probs[r].add(jp).read_unaligned() as i32));
                for l in 0..4 {
                    acc[r][l] = _mm512_dpbf16_ps(acc[r][l], pv, vv[l]);
                }
            }
        }
        for r in 0..N {
            for (l, a) in acc[r].iter().enumerate() {
                _mm512_storeu_ps(out[r].add(16 * l), *a);
            }
        }
    }
}
