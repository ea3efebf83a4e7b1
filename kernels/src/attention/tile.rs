//! The tile of the f32 attention kernel and what its AVX-512 and bf16 variants share: the head
//! layout, the fixed-order softmax and dot products (`Lanes`), and a tile of query rows. A leaf:
//! the kernels beside it and the entry points in `attention.rs` import from here, never from
//! each other's parent.

use crate::error::{shape_err, Result};

/// Head layout shared by queries and cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_head`).
    pub n_kv_head: usize,
    /// Dimension of one head.
    pub head_dim: usize,
}

impl AttentionShape {
    pub(super) fn check(&self, q: &[f32], pos: &[usize], k: &[f32], v: &[f32]) -> Result<usize> {
        let Self {
            n_head,
            n_kv_head,
            head_dim,
        } = *self;
        if n_kv_head == 0 || n_head % n_kv_head != 0 || head_dim == 0 {
            return Err(shape_err(
                "attention",
                format!("{n_head} heads over {n_kv_head} kv heads"),
            ));
        }
        if q.len() != pos.len() * n_head * head_dim {
            return Err(shape_err(
                "attention",
                format!("q has {} values for {} rows", q.len(), pos.len()),
            ));
        }
        let row = n_kv_head * head_dim;
        if k.len() != v.len() || !k.len().is_multiple_of(row) {
            return Err(shape_err(
                "attention",
                "k and v must hold whole rows of equal count",
            ));
        }
        let n_ctx = k.len() / row;
        if let Some(&p) = pos.iter().max() {
            if p >= n_ctx {
                return Err(shape_err(
                    "attention",
                    format!("query at position {p} but cache has {n_ctx} rows"),
                ));
            }
        }
        Ok(n_ctx)
    }
}

/// Softmax of one row of scores, in place: the maximum subtracted, [`exp_nonpositive`] per
/// score, the sum over 16 lanes with the fixed reduction of [`Lanes::dot`]. Written with plain
/// multiplies and adds (Rust never fuses them) so that every path, whatever vector width the
/// compiler picks for it, gets the same bits; a row's result depends only on the row.
#[inline(always)]
pub(super) fn softmax_in_place(row: &mut [f32]) {
    let mut m = [f32::NEG_INFINITY; 16];
    let mut chunks = row.chunks_exact(16);
    for c in &mut chunks {
        for (m, &x) in m.iter_mut().zip(c) {
            *m = m.max(x);
        }
    }
    let max = chunks
        .remainder()
        .iter()
        .chain(&m)
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    let mut acc = [0f32; 16];
    for c in row.chunks_mut(16) {
        // The tail is padded with -inf, whose exponential adds exact zeros.
        let mut x = [f32::NEG_INFINITY; 16];
        x[..c.len()].copy_from_slice(c);
        for (a, x) in acc.iter_mut().zip(&mut x) {
            *x = exp_nonpositive(*x - max);
            *a += *x;
        }
        let n = c.len();
        c.copy_from_slice(&x[..n]);
    }
    let mut w = 8;
    while w > 0 {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
        w /= 2;
    }
    let inv = 1.0 / acc[0];
    row.iter_mut().for_each(|s| *s *= inv);
}

/// `e^x` for the shifted scores of a softmax (`x <= 0`; -inf and anything below -87 give 0),
/// within ~2 ulp: Cody-Waite reduction by ln 2 in two parts and Cephes' degree-5 polynomial.
/// Branch-free and made of plain float operations, so it vectorizes (libm's `expf` is a call
/// per score, ~40% of the attention's time before) and gives the same bits on every path.
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(-87.0, 88.0);
    let n = (xc * LOG2E + 0.5).floor();
    let r = xc - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 0.166_666_65)
        * r
        + 0.5;
    let y = p * (r * r) + r + 1.0;
    // 2^n: n + 127 lands in the low mantissa bits of (n + 127) + 2^23, and the shift moves it
    // into the exponent field (the constant's own bits leave the word).
    let scale = f32::from_bits((n + (127.0 + 8_388_608.0)).to_bits() << 23);
    if x >= -87.0 {
        y * scale
    } else {
        0.0
    }
}

/// Whether the fused multiply-add kernels can run (checked once).
pub(super) fn fma_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static FMA: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *FMA.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The two primitives of a tile, each with a fixed order of operations: a dot product and a
/// "row group += probability x value row" step over 16 lanes.
pub(super) trait Lanes {
    /// `a · b`: 16 lane sums, the fixed pairwise reduction (lanes `l` and `l + w` for w = 8,
    /// 4, 2, 1), then the tail elements in order.
    fn dot(a: &[f32], b: &[f32]) -> f32;
    /// `a · b[i]` for four `b`: each exactly [`Lanes::dot`], interleaved so that the four
    /// dependency chains overlap.
    fn dot4(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
        b.map(|b| Self::dot(a, b))
    }
    /// `acc[r][l] += p[r] * v[l]` for 16 lanes `l` (`v.len() >= 16`).
    fn axpy16<const N: usize>(acc: &mut [[f32; 16]; N], p: [f32; N], v: &[f32]);
}

/// Plain Rust, separate multiply and add: for CPUs without FMA.
pub(super) struct Portable;

impl Lanes for Portable {
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0f32; 16];
        let n16 = a.len() / 16 * 16;
        for (ca, cb) in a[..n16].chunks_exact(16).zip(b[..n16].chunks_exact(16)) {
            for l in 0..16 {
                acc[l] += ca[l] * cb[l];
            }
        }
        let mut w = 8;
        while w > 0 {
            for l in 0..w {
                acc[l] += acc[l + w];
            }
            w /= 2;
        }
        a[n16..]
            .iter()
            .zip(&b[n16..])
            .fold(acc[0], |s, (&x, &y)| s + x * y)
    }

    #[inline(always)]
    fn axpy16<const N: usize>(acc: &mut [[f32; 16]; N], p: [f32; N], v: &[f32]) {
        for (a, &pr) in acc.iter_mut().zip(&p) {
            for l in 0..16 {
                a[l] += pr * v[l];
            }
        }
    }
}

/// Query rows `start..start + rows` of head `h`: the unit of parallel work.
pub(super) struct Tile<'a> {
    pub(super) q: &'a [f32],
    pub(super) pos: &'a [usize],
    pub(super) k: &'a [f32],
    pub(super) v: &'a [f32],
    pub(super) shape: AttentionShape,
    pub(super) h: usize,
    pub(super) start: usize,
    pub(super) rows: usize,
}

impl Tile<'_> {
    /// Writes the tile's `rows x d` outputs into `out`.
    #[inline(always)]
    pub(super) fn compute<L: Lanes>(&self, out: &mut [f32]) {
        let AttentionShape {
            n_head,
            n_kv_head,
            head_dim: d,
        } = self.shape;
        let g = self.h / (n_head / n_kv_head);
        let row = n_kv_head * d;
        let scale = 1.0 / (d as f32).sqrt();
        let tile_pos = &self.pos[self.start..self.start + self.rows];
        let kmax = tile_pos.iter().max().map_or(0, |&p| p + 1);
        // Probabilities `rows x kmax`, zero past each row's position.
        let mut probs = vec![0f32; self.rows * kmax];
        for (r, (pr, &p)) in probs.chunks_exact_mut(kmax).zip(tile_pos).enumerate() {
            let qi = &self.q[((self.start + r) * n_head + self.h) * d..][..d];
            let done = (p + 1) / 4 * 4;
            let live = &mut pr[..=p];
            let key = |j: usize| &self.k[j * row + g * d..][..d];
            let mut quads = live.chunks_exact_mut(4);
            for (c, s) in (&mut quads).enumerate() {
                let j = 4 * c;
                let dots = L::dot4(qi, [key(j), key(j + 1), key(j + 2), key(j + 3)]);
                s.iter_mut().zip(dots).for_each(|(s, x)| *s = x * scale);
            }
            for (j, s) in quads.into_remainder().iter_mut().enumerate() {
                *s = L::dot(qi, key(done + j)) * scale;
            }
            softmax_in_place(live);
        }
        let mut r0 = 0;
        while r0 < self.rows {
            let n = ROW_GROUP.min(self.rows - r0);
            let group = RowGroup {
                probs: &probs,
                kmax,
                r0,
                jmax: tile_pos[r0..r0 + n].iter().max().map_or(0, |&p| p + 1),
                v: &self.v[g * d..],
                row,
                d,
            };
            let out = &mut out[r0 * d..(r0 + n) * d];
            match n {
                4 => group.compute::<L, 4>(out),
                3 => group.compute::<L, 3>(out),
                2 => group.compute::<L, 2>(out),
                _ => group.compute::<L, 1>(out),
            }
            r0 += n;
        }
    }
}

/// Query rows that share each loaded value row.
pub(super) const ROW_GROUP: usize = 4;

/// Output rows `r0..r0 + N` of a tile: `Σ_j p[r][j] v[j]` with keys in position order.
struct RowGroup<'a> {
    probs: &'a [f32],
    kmax: usize,
    r0: usize,
    /// One past the furthest position of the group (later keys are zero for every row).
    jmax: usize,
    /// Value rows of the head, `row` apart.
    v: &'a [f32],
    row: usize,
    d: usize,
}

impl RowGroup<'_> {
    #[inline(always)]
    fn compute<L: Lanes, const N: usize>(&self, out: &mut [f32]) {
        let d = self.d;
        let p = |r: usize, j: usize| self.probs[(self.r0 + r) * self.kmax + j];
        let mut c = 0;
        while c + 16 <= d {
            let mut acc = [[0f32; 16]; N];
            for j in 0..self.jmax {
                L::axpy16(
                    &mut acc,
                    std::array::from_fn(|r| p(r, j)),
                    &self.v[j * self.row + c..],
                );
            }
            for (r, a) in acc.iter().enumerate() {
                out[r * d + c..r * d + c + 16].copy_from_slice(a);
            }
            c += 16;
        }
        // Head dimensions that are not a multiple of 16: the rest one lane at a time.
        for l in c..d {
            for r in 0..N {
                let mut a = 0f32;
                for j in 0..self.jmax {
                    a += p(r, j) * self.v[j * self.row + l];
                }
                out[r * d + l] = a;
            }
        }
    }
}
