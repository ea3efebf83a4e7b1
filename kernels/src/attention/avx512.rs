//! [`Tile::compute`] on 512-bit registers, bit for bit the AVX2 result.
//!
//! The AVX2 tile is load-bound: every score is a dot product over freshly loaded query and key
//! values, reduced on its own. Here a pair of query rows stays in registers while the keys
//! stream past (two FMAs per key load; 8 keys at a time for heads of 64, 4 for heads of 128,
//! whose two queries take 16 of the 32 registers), 8 scores are reduced together by a shuffle
//! tree (three instructions per halving for eight sums at once), and the output accumulates
//! 64 lanes of 4 rows per value load. The rows that read a block of keys or values first
//! (from memory, over a long context) fetch ahead, so that the block's arithmetic and the next
//! rows' loads overlap. Every lane still sees the same fused multiply-adds in the same
//! order, and the tree adds the same lane pairs (`l` and `l + w` for w = 8, 4, 2, 1) as
//! [`super::tile::Lanes::dot`]; float addition is commutative, so the scores, the softmax and the
//! outputs are the AVX2 path's exactly (tested), and a row's result still does not depend on
//! the rows that share the call.
//!
//! Head dimensions 64 and 128 (every default model); others take the AVX2 path.

// Register blocks index several arrays (queries, accumulators, keys) by the same counters.
#![allow(clippy::needless_range_loop)]

use super::tile::{softmax_in_place, AttentionShape, Lanes, Tile, ROW_GROUP};
use std::arch::x86_64::*;

/// Whether the CPU runs this path (checked once).
pub(super) fn available() -> bool {
    static AVX512: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX512.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
    })
}

/// Whether this path handles heads of dimension `d`.
pub(super) fn handles(d: usize) -> bool {
    matches!(d, 64 | 128)
}

/// Writes the tile's `rows x d` outputs into `out`.
///
/// # Safety
/// The CPU must have AVX-512F, AVX2 and FMA ([`available`]) and `handles(d)` must hold; the
/// tile's positions must lie inside the cache (checked by `AttentionShape::check`).
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn tile(t: &Tile<'_>, out: &mut [f32]) {
    // SAFETY: the caller's CPU features and positions (see # Safety); every pointer below
    // stays inside its slice: rows of `probs` and `out` by construction, keys and values up to
    // position kmax - 1 by the assertion above.
    unsafe {
        let AttentionShape {
            n_head,
            n_kv_head,
            head_dim: d,
        } = t.shape;
        assert!(handles(d) && out.len() == t.rows * d);
        let g = t.h / (n_head / n_kv_head);
        let row = n_kv_head * d;
        let scale = 1.0 / (d as f32).sqrt();
        let tile_pos = &t.pos[t.start..t.start + t.rows];
        let kmax = tile_pos.iter().max().map_or(0, |&p| p + 1);
        assert!(kmax == 0 || (kmax - 1) * row + g * d + d <= t.k.len().min(t.v.len()));
        // Key and value `j` of this head's group start at `j * row` from these.
        let keys = t.k.as_ptr().add(g * d);
        let values = t.v.as_ptr().add(g * d);
        let query = |r: usize| t.q[((t.start + r) * n_head + t.h) * d..][..d].as_ptr();

        // Probabilities `rows x kmax`, zero past each row's position. Keys go by blocks that
        // stay in L1 while every row of the tile passes over them.
        let mut probs = vec![0f32; t.rows * kmax];
        let base = probs.as_mut_ptr();
        let scores = Scores { keys, row, scale };
        for jb in (0..kmax).step_by(KEY_BLOCK) {
            let je = jb + KEY_BLOCK;
            let mut r = 0;
            while r < t.rows {
                let n = if r + 1 < t.rows { 2 } else { 1 };
                // Two rows share the key loads up to the shorter one's last whole block of 8.
                let common = if n == 2 {
                    (tile_pos[r].min(tile_pos[r + 1]) + 1) / 8 * 8
                } else {
                    0
                };
                let (pa, pb) = (base.add(r * kmax), base.add((r + 1) * kmax));
                for j in (jb..je.min(common)).step_by(8) {
                    let (q, o) = ([query(r), query(r + 1)], [pa.add(j), pb.add(j)]);
                    if d == 64 {
                        scores.block::<2, 4>(q, j, o, r == 0);
                    } else {
                        scores.pair_wide(q, j, o, r == 0);
                    }
                }
                for i in r..r + n {
                    let whole = (tile_pos[i] + 1) / 8 * 8;
                    let o = base.add(i * kmax);
                    for j in (jb.max(common)..je.min(whole)).step_by(8) {
                        scores.one(query(i), d, j, o.add(j), i == 0);
                    }
                }
                r += n;
            }
        }
        // The last keys of each row one at a time, then its softmax.
        for (i, &p) in tile_pos.iter().enumerate() {
            let row_probs = &mut probs[i * kmax..][..=p];
            scores.tail(query(i), d, (p + 1) / 8 * 8, row_probs);
            softmax_in_place(row_probs);
        }

        // Outputs, 4 rows and 64 lanes at a time, over the same blocks of keys (values).
        for jb in (0..kmax).step_by(KEY_BLOCK) {
            let mut r0 = 0;
            while r0 < t.rows {
                // The first row group reads the values from memory: it fetches ahead.
                let (n, fetch) = (ROW_GROUP.min(t.rows - r0), r0 == 0);
                let jmax = tile_pos[r0..r0 + n].iter().max().map_or(0, |&p| p + 1);
                let keys = jb..(jb + KEY_BLOCK).min(jmax);
                let p = |r: usize| probs[(r0 + r) * kmax..].as_ptr();
                let o = out[r0 * d..].as_mut_ptr();
                for c in (0..d).step_by(64) {
                    let (v, o) = (values.add(c), |r: usize| o.add(r * d + c));
                    let (ks, at) = (keys.clone(), ValueRows { at: v, row, fetch });
                    match n {
                        4 => {
                            weighted_sum([p(0), p(1), p(2), p(3)], ks, at, [o(0), o(1), o(2), o(3)])
                        }
                        3 => weighted_sum([p(0), p(1), p(2)], ks, at, [o(0), o(1), o(2)]),
                        2 => weighted_sum([p(0), p(1)], ks, at, [o(0), o(1)]),
                        _ => weighted_sum([p(0)], ks, at, [o(0)]),
                    }
                }
                r0 += n;
            }
        }
    }
}

/// Keys per block: 16 KB of keys or values at d = 64, which stay in L1 while the tile's rows
/// pass over them (at 2048 tokens a head's keys and values no longer fit in L2).
const KEY_BLOCK: usize = 64;

/// Rows ahead of the one being read whose lines are fetched first. A long context's keys and
/// values come from memory, and without this a tile's arithmetic waited for its loads: a decode
/// step over 32k tokens of the 1.5B target took about the sum of its memory time and its
/// arithmetic per layer (~2.5 ms), with it ~2.0. Measured at 8, 16, 32 and 64 rows ahead
/// (`examples/attn --context 32768`): 8-16 best, 64 (64 KB, past L1) worst.
const AHEAD: usize = 16;

/// Fetches the `lines` cache lines of 16 values at `at + AHEAD * row` into L1. A hint: it
/// never faults (the address may lie past the cache's end) and changes no result.
#[inline(always)]
unsafe fn prefetch(at: *const f32, row: usize, lines: usize) {
    let ahead = at.wrapping_add(AHEAD * row) as *const i8;
    for l in 0..lines {
        // SAFETY: a prefetch of any address is allowed; it does not fault.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * l)) };
    }
}

/// Scaled scores of query rows against the keys of one head group.
struct Scores {
    keys: *const f32,
    row: usize,
    scale: f32,
}

impl Scores {
    /// Scores of `R` rows (`C` 16-lane chunks each) against keys `j..j + 8`, written to
    /// `out[r][0..8]`.
    #[inline(always)]
    unsafe fn block<const R: usize, const C: usize>(
        &self,
        q: [*const f32; R],
        j: usize,
        out: [*mut f32; R],
        fetch: bool,
    ) {
        // SAFETY: `q` rows hold `16 * C` values, keys `j..j + 8` lie inside the cache and
        // `out` rows have 8 values from `out[r]` (the caller's bounds).
        unsafe {
            let qv: [[__m512; C]; R] =
                std::array::from_fn(|r| std::array::from_fn(|c| _mm512_loadu_ps(q[r].add(16 * c))));
            let mut acc = [[_mm512_setzero_ps(); 8]; R];
            for kk in 0..8 {
                let kp = self.keys.add((j + kk) * self.row);
                if fetch {
                    prefetch(kp, self.row, C);
                }
                for c in 0..C {
                    let kv = _mm512_loadu_ps(kp.add(16 * c));
                    for r in 0..R {
                        acc[r][kk] = _mm512_fmadd_ps(qv[r][c], kv, acc[r][kk]);
                    }
                }
            }
            let scale = _mm256_set1_ps(self.scale);
            for r in 0..R {
                _mm256_storeu_ps(out[r], _mm256_mul_ps(reduce8(acc[r]), scale));
            }
        }
    }

    /// Scores of two rows of 128 values against keys `j..j + 8`, written to `out[r][0..8]`:
    /// [`Scores::block`]'s `<2, 8>` (the same fused multiply-adds and tree per score) in two
    /// halves of 4 keys, so that both rows' queries (16 registers) and the accumulators (8) fit
    /// in the 32 registers. Each key load then feeds two multiply-adds instead of one.
    #[inline(always)]
    unsafe fn pair_wide(&self, q: [*const f32; 2], j: usize, out: [*mut f32; 2], fetch: bool) {
        // SAFETY: as for `block`, with 128 values per query row.
        unsafe {
            let qv: [[__m512; 8]; 2] =
                std::array::from_fn(|r| std::array::from_fn(|c| _mm512_loadu_ps(q[r].add(16 * c))));
            let scale = _mm_set1_ps(self.scale);
            for half in [0, 4] {
                let mut acc = [[_mm512_setzero_ps(); 4]; 2];
                for kk in 0..4 {
                    let kp = self.keys.add((j + half + kk) * self.row);
                    if fetch {
                        prefetch(kp, self.row, 8);
                    }
                    for c in 0..8 {
                        let kv = _mm512_loadu_ps(kp.add(16 * c));
                        for r in 0..2 {
                            acc[r][kk] = _mm512_fmadd_ps(qv[r][c], kv, acc[r][kk]);
                        }
                    }
                }
                // Lanes 0-3: row 0's four sums; lanes 4-7: row 1's.
                let sums = reduce8([
                    acc[0][0], acc[0][1], acc[0][2], acc[0][3], acc[1][0], acc[1][1], acc[1][2],
                    acc[1][3],
                ]);
                let lo = _mm256_castps256_ps128(sums);
                let hi = _mm256_extractf128_ps::<1>(sums);
                _mm_storeu_ps(out[0].add(half), _mm_mul_ps(lo, scale));
                _mm_storeu_ps(out[1].add(half), _mm_mul_ps(hi, scale));
            }
        }
    }

    /// Scores of one row against keys `j..j + 8`, written to `out[0..8]`.
    #[inline(always)]
    unsafe fn one(&self, q: *const f32, d: usize, j: usize, out: *mut f32, fetch: bool) {
        // SAFETY: as for `block`.
        unsafe {
            if d == 64 {
                self.block::<1, 4>([q], j, [out], fetch);
            } else {
                self.block::<1, 8>([q], j, [out], fetch);
            }
        }
    }

    /// Scores of one row from key `from` to the end of `out` (its position), one at a time.
    #[inline(always)]
    unsafe fn tail(&self, q: *const f32, d: usize, from: usize, out: &mut [f32]) {
        // SAFETY: `q` holds `d` values, keys up to `out.len() - 1` lie inside the cache.
        unsafe {
            let qs = std::slice::from_raw_parts(q, d);
            for (j, s) in out.iter_mut().enumerate().skip(from) {
                let key = std::slice::from_raw_parts(self.keys.add(j * self.row), d);
                *s = super::simd::Avx2::dot(qs, key) * self.scale;
            }
        }
    }
}

/// The sums of eight 16-lane vectors, in order, each reduced as [`Lanes::dot`] reduces: lanes
/// `l` and `l + 8`, then `+ 4`, `+ 2`, `+ 1`.
#[inline(always)]
unsafe fn reduce8(a: [__m512; 8]) -> __m256 {
    // SAFETY: register-only intrinsics of the caller's target features.
    unsafe {
        // w = 8: [x.lo + x.hi, y.lo + y.hi] (128-bit blocks 0, 1 of x then of y).
        let half = |x: __m512, y: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
            )
        };
        let b = [
            half(a[0], a[1]),
            half(a[2], a[3]),
            half(a[4], a[5]),
            half(a[6], a[7]),
        ];
        // w = 4: block k holds the four partial sums of vector k (of four).
        let quarter = |x: __m512, y: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
            )
        };
        let c0 = quarter(b[0], b[1]);
        let c1 = quarter(b[2], b[3]);
        // w = 2: block k holds two sums of vector k, then two of vector k + 4.
        let d = _mm512_add_ps(
            _mm512_shuffle_ps::<0b01_00_01_00>(c0, c1),
            _mm512_shuffle_ps::<0b11_10_11_10>(c0, c1),
        );
        // w = 1: lane 0 of block k is vector k's sum, lane 2 vector k + 4's.
        let e = _mm512_add_ps(d, _mm512_permute_ps::<0b10_11_00_01>(d));
        let order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
        _mm512_castps512_ps256(_mm512_permutexvar_ps(order, e))
    }
}

/// Where [`weighted_sum`] reads the values: value `j` starts at `at + j * row`, and `fetch`
/// prefetches them ahead (the first row group reads them from memory).
#[derive(Clone, Copy)]
struct ValueRows {
    at: *const f32,
    row: usize,
    fetch: bool,
}

/// Adds keys `keys` (in position order) to 64 output lanes of `N` rows: `out[r] += Σ_j
/// p[r][j] v[j]`, one fused multiply-add per lane and key as [`Lanes::axpy16`]; the
/// accumulators round-trip through `out` exactly between blocks of keys.
#[inline(always)]
unsafe fn weighted_sum<const N: usize>(
    probs: [*const f32; N],
    keys: std::ops::Range<usize>,
    values: ValueRows,
    out: [*mut f32; N],
) {
    let ValueRows { at: v, row, fetch } = values;
    // SAFETY: probability rows hold the keys' values, value rows of `keys` lie inside the
    // cache and output rows have 64 lanes from `out[r]` (the caller's bounds).
    unsafe {
        let mut acc: [[__m512; 4]; N] =
            std::array::from_fn(|r| std::array::from_fn(|l| _mm512_loadu_ps(out[r].add(16 * l))));
        for j in keys {
            let vp = v.add(j * row);
            if fetch {
                prefetch(vp, row, 4);
            }
            let vv: [__m512; 4] = std::array::from_fn(|l| _mm512_loadu_ps(vp.add(16 * l)));
            for r in 0..N {
                let pb = _mm512_set1_ps(*probs[r].add(j));
                for l in 0..4 {
                    acc[r][l] = _mm512_fmadd_ps(pb, vv[l], acc[r][l]);
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
