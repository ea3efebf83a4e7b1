//! Q8_0, Q5_0, Q4_1, Q4_K and Q6_K weights repacked for an int8 GEMM that is fast at every row
//! count.
//!
//! Lane `f` of a 512-bit register holds 4 quants of output feature `f`, so one AVX-512 VNNI
//! `vpdpbusd` multiplies 4 inputs of 16 features with the activation's 4 bytes broadcast; the
//! float work (convert, scale, offset) happens once per block of 32 per feature. A tile is
//! [`TILE_M`] activation rows x 16 features. On AVX2 the same layout is read as two 256-bit
//! halves of 8 features, `vpmaddubsw` + `vpmaddwd` standing for `vpdpbusd` (`avx2` below: the
//! same integer dot products). Every (feature, row) value is one fixed sequence
//! over the blocks, `acc = fma(dot, d_w·d_x, acc); acc = fma(o_w, d_x·Σq_x, acc)`, whatever
//! rows share the call and on every ISA (the portable path performs the same IEEE operations),
//! so a row is bit-identical alone, in a verification batch or in a 2048-row prefill: the
//! property the ρ = 1 identity and verification rest on. One kernel for every row count ends
//! the split between few-row int8 and many-row f32 panels (docs/performance.md).
//!
//! The k-quants keep their own scale encoding (f16 super-block scales times small integer
//! block scales, multiplied exactly in f32 in the kernel), so they pack at their file size
//! and compute on the same weights as the file, bit for bit. Q6_K's scales are per 16 quants:
//! its blocks keep two integer dot products, one per half.

use super::{portable, Isa, QMatrix, QType};
use crate::error::{shape_err, Result};
use half::f16;
use rayon::prelude::*;

/// Output features per group: the 16 lanes of a 512-bit register.
const GROUP: usize = 16;
/// Activation rows per register tile.
const TILE_M: usize = 8;
/// Bytes of one chunk: 16 features x 4 quants.
const CHUNK: usize = GROUP * 4;
/// How far ahead of the block being computed its weights are prefetched (bytes).
const PREFETCH: usize = 4096;

/// How the quants of a (group, block) are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Planes {
    /// One byte per quant, 8 chunks of 64 bytes (Q8_0).
    Bytes,
    /// Two quants per byte: 4 pairs of chunks, byte `j` of pair `p` holding chunk `2p`'s quant
    /// `j` in its low nibble and chunk `2p + 1`'s in its high one (Q4_1, and Q5_0's low bits).
    Nibbles,
    /// [`Planes::Nibbles`] plus a fifth bit per quant: one `u64` per chunk, bit `j` for byte
    /// `j` (Q5_0).
    NibblesHigh,
    /// [`Planes::NibblesHigh`] plus a sixth bit: masks `8..16` of the block hold it (Q6_K).
    Nibbles6,
    /// [`Planes::Nibbles`] plus the fifth and sixth bits as 2-bit fields, for AVX2, which has
    /// no mask registers to add [`Planes::Nibbles6`]'s masks with: per pair `p` 32 bytes of the
    /// block's 128 (stored in its 16 `u64`s, little end first), byte `k` holding for the pair's
    /// byte `k` (bits 0-3) and `k + 32` (bits 4-7) the two high bits of chunk `2p`'s quant
    /// (bits 0-1 of the nibble) and chunk `2p + 1`'s (bits 2-3). Q6_K packed on AVX2.
    Nibbles6Fields,
}

impl Planes {
    fn quant_bytes(self) -> usize {
        match self {
            Planes::Bytes => 8 * CHUNK,
            Planes::Nibbles | Planes::NibblesHigh | Planes::Nibbles6 | Planes::Nibbles6Fields => {
                4 * CHUNK
            }
        }
    }

    /// High-bit masks per block.
    fn masks(self) -> usize {
        match self {
            Planes::Bytes | Planes::Nibbles => 0,
            Planes::NibblesHigh => 8,
            Planes::Nibbles6 | Planes::Nibbles6Fields => 16,
        }
    }
}

/// How the scale `s` and offset `o` of a (group, block) are stored: the weight is `s·u + o`.
#[derive(Clone, Debug)]
enum Scales {
    /// f16 `s` and `o` per (group, block, lane) (Q8_0, Q5_0, Q4_1).
    Block { d: Vec<u16>, o: Vec<u16> },
    /// Q4_K: f16 `d` and `dmin` per (group, super-block, lane), 6-bit `sc` and `m` per
    /// (group, block, lane); `s = d·sc`, `o = −(dmin·m)`, both exact in f32.
    Super {
        d: Vec<u16>,
        dmin: Vec<u16>,
        sc: Vec<u8>,
        m: Vec<u8>,
    },
    /// Q6_K: f16 `d` per (group, super-block, lane), i8 `sc` (stored as its byte) per
    /// (group, block, half, lane); per half `s = d·sc`, `o = −32·s`.
    Halves { d: Vec<u16>, sc: Vec<u8> },
}

impl Scales {
    fn nbytes(&self) -> usize {
        match self {
            Scales::Block { d, o } => 2 * (d.len() + o.len()),
            Scales::Super { d, dmin, sc, m } => 2 * (d.len() + dmin.len()) + sc.len() + m.len(),
            Scales::Halves { d, sc } => 2 * d.len() + sc.len(),
        }
    }

    /// Whether a block has one scale per half (two integer dot products).
    fn halves(&self) -> bool {
        matches!(self, Scales::Halves { .. })
    }

    /// `(s, o)` of half `h` of block `b` of group `g` at `lane` (`nb` blocks per row).
    fn get(&self, nb: usize, g: usize, b: usize, h: usize, lane: usize) -> (f32, f32) {
        let f = |bits: u16| f16::from_bits(bits).to_f32();
        let at = (g * nb + b) * GROUP + lane;
        let sup = (g * nb.div_ceil(8) + b / 8) * GROUP + lane;
        match self {
            Scales::Block { d, o } => (f(d[at]), f(o[at])),
            Scales::Super { d, dmin, sc, m } => (
                f(d[sup]) * f32::from(sc[at]),
                -(f(dmin[sup]) * f32::from(m[at])),
            ),
            Scales::Halves { d, sc } => {
                let s = f(d[sup]) * f32::from(sc[((g * nb + b) * 2 + h) * GROUP + lane] as i8);
                (s, s * -32.0)
            }
        }
    }
}

/// A weight matrix repacked from [`QMatrix`] (see the module documentation). It keeps the
/// file's bit width: 4, 5, 6 or 8 bits per quant plus the format's scales.
#[derive(Clone)]
pub struct PackedMatrix {
    rows: usize,
    cols: usize,
    planes: Planes,
    /// `(groups, blocks, quant_bytes)` quants, laid out as [`Planes`] says.
    q: Vec<u8>,
    /// `(groups, blocks, masks)` high-bit masks ([`Planes::masks`]).
    hi: Vec<u64>,
    scales: Scales,
}

impl std::fmt::Debug for PackedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedMatrix")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("planes", &self.planes)
            .finish_non_exhaustive()
    }
}

/// Activation rows quantized per block of 32: quants, scales `d`, `d · Σ q` per block and
/// per half block.
struct Acts {
    cols: usize,
    q: Vec<i8>,
    d: Vec<f32>,
    ds: Vec<f32>,
    ds2: Vec<f32>,
    /// `Σ q` per block (the AVX2 kernel's Q8_0 correction).
    sum: Vec<i32>,
}

impl Acts {
    fn quantize(x: &[f32], cols: usize) -> Self {
        let nb = x.len() / 32;
        let mut q = vec![0i8; x.len()];
        let mut d = vec![0f32; nb];
        let mut ds = vec![0f32; nb];
        let mut ds2 = vec![0f32; 2 * nb];
        let mut sums = vec![0i32; nb];
        // Rows in parallel; each block's numbers depend on that block alone.
        q.par_chunks_mut(cols)
            .zip(d.par_chunks_mut(cols / 32))
            .zip(ds.par_chunks_mut(cols / 32))
            .zip(ds2.par_chunks_mut(cols / 16))
            .zip(sums.par_chunks_mut(cols / 32))
            .zip(x.par_chunks(cols))
            .for_each(|(((((q, d), ds), ds2), sums), x)| {
                for (((((xb, qb), d), ds), ds2), total) in x
                    .chunks_exact(32)
                    .zip(q.chunks_exact_mut(32))
                    .zip(d.iter_mut())
                    .zip(ds.iter_mut())
                    .zip(ds2.chunks_exact_mut(2))
                    .zip(sums.iter_mut())
                {
                    let scale = super::quantize_block(xb, qb);
                    let sum: [i32; 2] = std::array::from_fn(|h| {
                        qb[h * 16..h * 16 + 16].iter().map(|&v| i32::from(v)).sum()
                    });
                    *d = scale;
                    *total = sum[0] + sum[1];
                    *ds = scale * (sum[0] + sum[1]) as f32;
                    ds2[0] = scale * sum[0] as f32;
                    ds2[1] = scale * sum[1] as f32;
                }
            });
        Self {
            cols,
            q,
            d,
            ds,
            ds2,
            sum: sums,
        }
    }
}

impl QMatrix {
    /// The matrix repacked for [`PackedMatrix::matmul`]; `None` for a block whose scale or
    /// offset the packed encoding cannot hold exactly (a Q8_0/Q5_0/Q4_1 offset that overflows
    /// f16).
    pub fn pack(&self) -> Option<PackedMatrix> {
        self.pack_for(Isa::best())
    }

    /// [`QMatrix::pack`] in the layout `isa`'s kernel reads fastest (Q6_K's high bits as masks
    /// for AVX-512, as 2-bit fields for AVX2); any ISA multiplies either layout, to the same
    /// values.
    #[allow(
        clippy::too_many_lines,
        reason = "one match over the block formats, each arm a short unpack into the same planes"
    )]
    pub fn pack_for(&self, isa: Isa) -> Option<PackedMatrix> {
        let planes = match self.ty {
            QType::Q8_0 => Planes::Bytes,
            QType::Q5_0 => Planes::NibblesHigh,
            QType::Q4_1 | QType::Q4K => Planes::Nibbles,
            QType::Q6K if isa == Isa::Avx2 => Planes::Nibbles6Fields,
            QType::Q6K => Planes::Nibbles6,
        };
        let (rows, cols) = (self.rows, self.cols);
        let nb = cols / 32;
        let groups = rows.div_ceil(GROUP);
        let qb = planes.quant_bytes();
        let masks = planes.masks();
        let mut q = vec![0u8; groups * nb * qb];
        let mut hi = vec![0u64; groups * nb * masks];
        // Padding features of the last group keep zero scales and offsets: they add nothing.
        let (per_block, per_super) = (groups * nb * GROUP, groups * nb.div_ceil(8) * GROUP);
        let mut scales = match self.ty {
            QType::Q8_0 | QType::Q5_0 | QType::Q4_1 => Scales::Block {
                d: vec![0; per_block],
                o: vec![0; per_block],
            },
            QType::Q4K => Scales::Super {
                d: vec![0; per_super],
                dmin: vec![0; per_super],
                sc: vec![0; per_block],
                m: vec![0; per_block],
            },
            QType::Q6K => Scales::Halves {
                d: vec![0; per_super],
                sc: vec![0; 2 * per_block],
            },
        };
        let view = self.view();
        let bits = |blk: &[u8], at: usize| u16::from_le_bytes([blk[at], blk[at + 1]]);
        for j in 0..rows {
            let (g, lane) = (j / GROUP, j % GROUP);
            let row = view.row(j);
            for b in 0..nb {
                let sub = portable::unpack(self.ty, row, b);
                let at = (g * nb + b) * GROUP + lane;
                let sup = (g * nb.div_ceil(8) + b / 8) * GROUP + lane;
                let (blk, k) = super::locate(self.ty, row, b);
                match &mut scales {
                    Scales::Block { d, o } => {
                        // Both come from f16 values, the offset times 16 or 128 (exact unless
                        // it overflows).
                        let (dh, oh) = (f16::from_f32(sub.s[0]), f16::from_f32(sub.o[0]));
                        d[at] = dh.to_bits();
                        o[at] = oh.to_bits();
                    }
                    Scales::Super { d, dmin, sc, m } => {
                        d[sup] = bits(blk, 0);
                        dmin[sup] = bits(blk, 2);
                        (sc[at], m[at]) = super::q4k_scale_min(&blk[4..16], k);
                    }
                    Scales::Halves { d, sc } => {
                        d[sup] = bits(blk, 208);
                        for h in 0..2 {
                            sc[((g * nb + b) * 2 + h) * GROUP + lane] = blk[192 + 2 * k + h];
                        }
                    }
                }
                // The packed encoding must give the file's numbers exactly.
                for h in 0..2 {
                    if scales.get(nb, g, b, h, lane) != (sub.s[h], sub.o[h]) {
                        return None;
                    }
                }
                let base = (g * nb + b) * qb;
                for (k, &u) in sub.u.iter().enumerate() {
                    let (c, byte) = (k / 4, lane * 4 + k % 4);
                    match planes {
                        Planes::Bytes => q[base + c * CHUNK + byte] = u,
                        Planes::Nibbles6Fields => {
                            q[base + (c / 2) * CHUNK + byte] |= (u & 0xF) << (4 * (c % 2));
                            let at = (c / 2) * 32 + byte % 32;
                            let field = u64::from(u >> 4 & 3) << (4 * (byte / 32) + 2 * (c % 2));
                            hi[(g * nb + b) * masks + at / 8] |= field << (8 * (at % 8));
                        }
                        Planes::Nibbles | Planes::NibblesHigh | Planes::Nibbles6 => {
                            q[base + (c / 2) * CHUNK + byte] |= (u & 0xF) << (4 * (c % 2));
                            for bit in 0..masks / 8 {
                                if u >> (4 + bit) & 1 == 1 {
                                    hi[(g * nb + b) * masks + 8 * bit + c] |= 1 << byte;
                                }
                            }
                        }
                    }
                }
            }
        }
        Some(PackedMatrix {
            rows,
            cols,
            planes,
            q,
            hi,
            scales,
        })
    }
}

/// The output, written by many tasks at disjoint places.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: every task writes its own feature group's columns only (see `matmul_many_on`).
unsafe impl Send for Out {}
// SAFETY: as above.
unsafe impl Sync for Out {}

impl PackedMatrix {
    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        self.q.len() + 8 * self.hi.len() + self.scales.nbytes()
    }

    /// The quant `u` of feature `j` at input `k`.
    fn quant(&self, j: usize, k: usize) -> u8 {
        let nb = self.cols / 32;
        let (g, lane, b, kk) = (j / GROUP, j % GROUP, k / 32, k % 32);
        let (c, byte) = (kk / 4, lane * 4 + kk % 4);
        let base = (g * nb + b) * self.planes.quant_bytes();
        match self.planes {
            Planes::Bytes => self.q[base + c * CHUNK + byte],
            Planes::Nibbles6Fields => {
                let nib = (self.q[base + (c / 2) * CHUNK + byte] >> (4 * (c % 2))) & 0xF;
                let at = (c / 2) * 32 + byte % 32;
                let word = self.hi[(g * nb + b) * self.planes.masks() + at / 8];
                let field = (word >> (8 * (at % 8) + 4 * (byte / 32) + 2 * (c % 2))) & 3;
                nib | (field as u8) << 4
            }
            Planes::Nibbles | Planes::NibblesHigh | Planes::Nibbles6 => {
                let nib = (self.q[base + (c / 2) * CHUNK + byte] >> (4 * (c % 2))) & 0xF;
                let masks = self.planes.masks();
                (0..masks / 8).fold(nib, |u, bit| {
                    let set = self.hi[(g * nb + b) * masks + 8 * bit + c] >> byte & 1;
                    u | (set as u8) << (4 + bit)
                })
            }
        }
    }

    /// Rows `range` of the matrix as f32 `(range.len(), cols)` (an embedding lookup).
    pub fn dequantize_rows(&self, range: std::ops::Range<usize>) -> Result<Vec<f32>> {
        if range.start > range.end || range.end > self.rows {
            return Err(shape_err(
                "packed dequantize",
                format!("rows {range:?} of {}", self.rows),
            ));
        }
        let nb = self.cols / 32;
        let mut out = Vec::with_capacity(range.len() * self.cols);
        for j in range {
            for k in 0..self.cols {
                let (s, o) = self
                    .scales
                    .get(nb, j / GROUP, k / 32, k % 32 / 16, j % GROUP);
                // Multiply, then add, as QMatrix does (not fused: a Q6_K product can round).
                out.push(s * f32::from(self.quant(j, k)) + o);
            }
        }
        Ok(out)
    }

    /// `y = x Wᵀ` for `n` rows `x` `(n, cols)`: returns `(n, rows)`, on the best ISA.
    pub fn matmul(&self, x: &[f32], n: usize) -> Result<Vec<f32>> {
        self.matmul_on(Isa::best(), x, n)
    }

    /// [`PackedMatrix::matmul`] on a chosen implementation (tests compare them).
    pub fn matmul_on(&self, isa: Isa, x: &[f32], n: usize) -> Result<Vec<f32>> {
        let mut y = Self::matmul_many_on(isa, &[self], x, n)?;
        Ok(y.pop().unwrap_or_default())
    }

    /// `x Wᵢᵀ` for several matrices of the same input width (q/k/v, gate/up): the activation
    /// rows are quantized once and every matrix's feature groups share one parallel loop.
    /// Each result is bit for bit [`PackedMatrix::matmul`]'s.
    pub fn matmul_many(mats: &[&PackedMatrix], x: &[f32], n: usize) -> Result<Vec<Vec<f32>>> {
        Self::matmul_many_on(Isa::best(), mats, x, n)
    }

    /// [`PackedMatrix::matmul_many`] on a chosen implementation.
    pub fn matmul_many_on(
        isa: Isa,
        mats: &[&PackedMatrix],
        x: &[f32],
        n: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let Some(first) = mats.first() else {
            return Ok(Vec::new());
        };
        let cols = first.cols;
        if let Some(m) = mats.iter().find(|m| m.cols != cols) {
            return Err(shape_err(
                "packed matmul_many",
                format!("matrices of {} and {cols} columns", m.cols),
            ));
        }
        super::check_rows("packed matmul", x, n, cols)?;
        // The ISA asked for where this CPU has it; the portable loop otherwise.
        let isa = match isa {
            Isa::Avx512Vnni if Isa::best() == Isa::Avx512Vnni => isa,
            #[cfg(target_arch = "x86_64")]
            // Either detected ISA implies AVX2, FMA and F16C (`Isa::detect`).
            Isa::Avx2 if Isa::best() != Isa::Portable => isa,
            _ => Isa::Portable,
        };
        let mut ys: Vec<Vec<f32>> = mats.iter().map(|m| vec![0f32; n * m.rows]).collect();
        if n == 0 {
            return Ok(ys);
        }
        let a = Acts::quantize(x, cols);
        // Tasks of a few groups each, never across matrices: enough tasks for both cores and
        // few enough to keep the overhead low.
        let total: usize = mats.iter().map(|m| m.rows.div_ceil(GROUP)).sum();
        let per_task = (total / 32).max(1);
        let mut tasks = Vec::with_capacity(total / per_task + mats.len());
        for (i, (m, y)) in mats.iter().zip(ys.iter_mut()).enumerate() {
            let groups = m.rows.div_ceil(GROUP);
            let out = Out(y.as_mut_ptr());
            tasks.extend((0..groups).step_by(per_task).map(|g| {
                let end = (g + per_task).min(groups);
                (i, g..end, out)
            }));
        }
        let run = |(i, range, out): &(usize, std::ops::Range<usize>, Out)| {
            let p = mats[*i];
            let halves = p.scales.halves();
            for g in range.clone() {
                let width = (p.rows - g * GROUP).min(GROUP);
                let out = *out;
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `Isa::best()` confirmed the CPU features; group `g` writes
                    // columns `g * 16..g * 16 + width` of the `n` rows of matrix `i`'s output
                    // and no task shares a (matrix, group).
                    Isa::Avx512Vnni if halves => unsafe {
                        vnni::group::<2>(p, &a, g, n, width, out)
                    },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: as above.
                    Isa::Avx512Vnni => unsafe { vnni::group::<1>(p, &a, g, n, width, out) },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `Isa::best()` confirmed AVX2, FMA and F16C; as above.
                    Isa::Avx2 if halves => unsafe { avx2::group::<2>(p, &a, g, n, width, out) },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: as above.
                    Isa::Avx2 => unsafe { avx2::group::<1>(p, &a, g, n, width, out) },
                    // SAFETY: as above.
                    _ => unsafe { group_portable(p, &a, g, n, width, out) },
                }
            }
        };
        if tasks.len() == 1 {
            run(&tasks[0]);
        } else {
            tasks.par_iter().for_each(run);
        }
        Ok(ys)
    }
}

/// Feature group `g` for every row, written to `y[m * rows + g * 16..][..width]`.
///
/// # Safety
/// `out` must point at `n * p.rows` values that no one else touches in those columns.
unsafe fn group_portable(p: &PackedMatrix, a: &Acts, g: usize, n: usize, width: usize, out: Out) {
    let nb = p.cols / 32;
    let halves = if p.scales.halves() { 2 } else { 1 };
    let len = 32 / halves;
    for m in 0..n {
        let mut acc = [0f32; GROUP];
        for b in 0..nb {
            let i = m * nb + b;
            for (f, acc) in acc.iter_mut().enumerate() {
                let j = g * GROUP + f;
                for h in 0..halves {
                    let k0 = b * 32 + h * len;
                    let xq = &a.q[m * a.cols + k0..][..len];
                    let dot: i32 = if j < p.rows {
                        (0..len)
                            .map(|k| i32::from(p.quant(j, k0 + k)) * i32::from(xq[k]))
                            .sum()
                    } else {
                        0
                    };
                    let (s, o) = p.scales.get(nb, g, b, h, f);
                    let ds = if halves == 2 {
                        a.ds2[2 * i + h]
                    } else {
                        a.ds[i]
                    };
                    *acc = (dot as f32).mul_add(s * a.d[i], *acc);
                    *acc = o.mul_add(ds, *acc);
                }
            }
        }
        // SAFETY: the caller's contract.
        unsafe {
            std::ptr::copy_nonoverlapping(acc.as_ptr(), out.0.add(m * p.rows + g * GROUP), width)
        };
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::*;
    use std::arch::x86_64::*;

    /// [`group_portable`] on AVX-512 VNNI, [`TILE_M`] rows at a time, for blocks with `H`
    /// scales (1, or 2 for one per half).
    ///
    /// # Safety
    /// The CPU must have the features of [`Isa::Avx512Vnni`], and `out` as for
    /// [`group_portable`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub(super) unsafe fn group<const H: usize>(
        p: &PackedMatrix,
        a: &Acts,
        g: usize,
        n: usize,
        width: usize,
        out: Out,
    ) {
        let mut m0 = 0;
        while m0 < n {
            let t = (n - m0).min(TILE_M);
            // SAFETY (all): the caller's contract.
            // Every row's arithmetic is the same whatever tile it is in (rows never mix), so
            // the split only decides how often the group's weights are unpacked: once per
            // tile. A tile of each size up to 8, so a checking pass of speculative decoding
            // unpacks each weight group once whatever its number of rows.
            unsafe {
                match t {
                    8 => tile::<8, H>(p, a, g, m0, width, out),
                    7 => tile::<7, H>(p, a, g, m0, width, out),
                    6 => tile::<6, H>(p, a, g, m0, width, out),
                    5 => tile::<5, H>(p, a, g, m0, width, out),
                    4 => tile::<4, H>(p, a, g, m0, width, out),
                    3 => tile::<3, H>(p, a, g, m0, width, out),
                    2 => tile::<2, H>(p, a, g, m0, width, out),
                    _ => tile::<1, H>(p, a, g, m0, width, out),
                }
            }
            m0 += t;
        }
    }

    /// The 4 activation bytes at `row + at`, in every lane.
    ///
    /// # Safety
    /// `row + at .. row + at + 4` must lie inside the activation quants (the hot loop has no
    /// bounds checks).
    #[inline(always)]
    unsafe fn x4(row: *const i8, at: usize) -> __m512i {
        // SAFETY: the caller's bounds; AVX-512F is enabled in every caller.
        unsafe { _mm512_set1_epi32(row.add(at).cast::<i32>().read_unaligned()) }
    }

    /// 16 f16 values at `at`, as f32.
    #[inline(always)]
    unsafe fn f16x16(v: &[u16], at: usize) -> __m512 {
        // SAFETY: the caller's bounds; F16C and AVX-512F are enabled in every caller.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(v[at..at + 16].as_ptr().cast())) }
    }

    /// 16 bytes at `at`, as f32 (signed or not).
    #[inline(always)]
    unsafe fn u8x16(v: &[u8], at: usize, signed: bool) -> __m512 {
        // SAFETY: the caller's bounds; AVX-512F is enabled in every caller.
        unsafe {
            let b = _mm_loadu_si128(v[at..at + 16].as_ptr().cast());
            let i = if signed {
                _mm512_cvtepi8_epi32(b)
            } else {
                _mm512_cvtepu8_epi32(b)
            };
            _mm512_cvtepi32_ps(i)
        }
    }

    /// The 16 lanes' `(s, o)` of block `b` of group `g`, per half ([`Scales::get`], the same
    /// IEEE operations).
    #[inline(always)]
    unsafe fn scales(sc: &Scales, nb: usize, g: usize, b: usize) -> [(__m512, __m512); 2] {
        let at = (g * nb + b) * GROUP;
        let sup = (g * nb.div_ceil(8) + b / 8) * GROUP;
        // SAFETY: in bounds by the layout; the caller's features.
        unsafe {
            match sc {
                Scales::Block { d, o } => {
                    let v = (f16x16(d, at), f16x16(o, at));
                    [v, v]
                }
                Scales::Super { d, dmin, sc, m } => {
                    let s = _mm512_mul_ps(f16x16(d, sup), u8x16(sc, at, false));
                    let o = _mm512_mul_ps(f16x16(dmin, sup), u8x16(m, at, false));
                    let neg = _mm512_castsi512_ps(_mm512_xor_si512(
                        _mm512_castps_si512(o),
                        _mm512_set1_epi32(i32::MIN),
                    ));
                    [(s, neg), (s, neg)]
                }
                Scales::Halves { d, sc } => {
                    let (d, m32) = (f16x16(d, sup), _mm512_set1_ps(-32.0));
                    let s0 = _mm512_mul_ps(d, u8x16(sc, 2 * at, true));
                    let s1 = _mm512_mul_ps(d, u8x16(sc, 2 * at + GROUP, true));
                    [(s0, _mm512_mul_ps(s0, m32)), (s1, _mm512_mul_ps(s1, m32))]
                }
            }
        }
    }

    /// `w0` and `w1` (chunks `2p` and `2p + 1`) with the fifth and sixth bits of the AVX2
    /// layout added ([`Planes::Nibbles6Fields`]: a matrix packed there, multiplied here).
    ///
    /// # Safety
    /// AVX-512F must be enabled in the caller; `fields` is the pair's 32 bytes.
    #[inline(always)]
    unsafe fn add_fields(w0: __m512i, w1: __m512i, fields: &[u64]) -> (__m512i, __m512i) {
        // SAFETY: the caller's features; the slice holds 4 `u64`s (32 bytes).
        unsafe {
            let all = _mm256_loadu_si256(fields[..4].as_ptr().cast());
            // Positions 0-31 from the low nibbles, 32-63 from the high ones.
            let f = _mm512_inserti64x4(_mm512_castsi256_si512(all), _mm256_srli_epi16(all, 4), 1);
            let f = _mm512_and_si512(f, _mm512_set1_epi8(0x0F));
            let b0 = _mm512_slli_epi16(_mm512_and_si512(f, _mm512_set1_epi8(3)), 4);
            let b1 = _mm512_slli_epi16(_mm512_and_si512(f, _mm512_set1_epi8(12)), 2);
            (_mm512_or_si512(w0, b0), _mm512_or_si512(w1, b1))
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    unsafe fn tile<const M: usize, const H: usize>(
        p: &PackedMatrix,
        a: &Acts,
        g: usize,
        m0: usize,
        width: usize,
        out: Out,
    ) {
        let nb = p.cols / 32;
        let qb = p.planes.quant_bytes();
        let masks = p.planes.masks();
        let halves = H == 2;
        let low = _mm512_set1_epi8(0x0F);
        let (sixteen, thirty_two) = (_mm512_set1_epi8(0x10), _mm512_set1_epi8(0x20));
        let mut acc = [_mm512_setzero_ps(); M];
        assert!((m0 + M) * a.cols <= a.q.len() && nb * 32 <= a.cols);
        // SAFETY: rows `m0..m0 + M` of the activations are in bounds (asserted above).
        let rows: [*const i8; M] =
            std::array::from_fn(|m| unsafe { a.q.as_ptr().add((m0 + m) * a.cols) });
        for b in 0..nb {
            let wb = &p.q[(g * nb + b) * qb..][..qb];
            let hi = &p.hi[(g * nb + b) * masks..][..masks];
            // The weights stream from memory once per pass; the hardware prefetcher alone
            // leaves the reads waiting on compute and the compute on reads (a checking pass of
            // 7 rows cost the one-row pass plus its compute). Asked for 4 KB ahead, they overlap:
            // 24 products of a 8960 x 1536 Q4_K matrix (`examples/packed_rows`) 6.5 -> 4.1 ms
            // for one row, 12.1 -> 7.3 ms for 8. A prefetch never faults, even past the end.
            for c in (0..qb).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(wb.as_ptr().wrapping_add(PREFETCH + c).cast());
            }
            // SAFETY: the scales of the group's block (16 lanes each) lie inside the vectors.
            let sw = unsafe { scales(&p.scales, nb, g, b) };
            // One integer dot product per half when the scales are per 16 quants, each added
            // to the rows' sums before the next half's begins: M live dot products, not H x M
            // (an 8-row tile of Q6_K would spill registers otherwise). The float operations
            // per row are the same sequence either way.
            for (h, (s, o)) in sw.iter().enumerate().take(H) {
                let mut dot = [_mm512_setzero_si512(); M];
                let parts = if halves { h * 2..h * 2 + 2 } else { 0..4 };
                match p.planes {
                    Planes::Bytes => {
                        for c in parts.start * 2..parts.end * 2 {
                            // SAFETY: 64 bytes at `c * 64` lie inside the block's 512.
                            let w =
                                unsafe { _mm512_loadu_si512(wb.as_ptr().add(c * CHUNK).cast()) };
                            for (dm, row) in dot.iter_mut().zip(rows) {
                                // SAFETY: chunk `c` of block `b` of a row of `a`.
                                *dm =
                                    _mm512_dpbusd_epi32(*dm, w, unsafe { x4(row, b * 32 + c * 4) });
                            }
                        }
                    }
                    Planes::Nibbles
                    | Planes::NibblesHigh
                    | Planes::Nibbles6
                    | Planes::Nibbles6Fields => {
                        for pair in parts {
                            // SAFETY: 64 bytes at `pair * 64` lie inside the block's 256.
                            let raw =
                                unsafe { _mm512_loadu_si512(wb.as_ptr().add(pair * CHUNK).cast()) };
                            let mut w0 = _mm512_and_si512(raw, low);
                            let mut w1 = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                            if p.planes == Planes::Nibbles6Fields {
                                // SAFETY: the pair's fields lie inside the block's 128 bytes.
                                (w0, w1) = unsafe { add_fields(w0, w1, &hi[4 * pair..][..4]) };
                            } else if masks >= 8 {
                                w0 = _mm512_mask_add_epi8(w0, hi[2 * pair], w0, sixteen);
                                w1 = _mm512_mask_add_epi8(w1, hi[2 * pair + 1], w1, sixteen);
                            }
                            if masks == 16 && p.planes == Planes::Nibbles6 {
                                w0 = _mm512_mask_add_epi8(w0, hi[8 + 2 * pair], w0, thirty_two);
                                w1 = _mm512_mask_add_epi8(w1, hi[9 + 2 * pair], w1, thirty_two);
                            }
                            let at = b * 32 + pair * 8;
                            for (dm, row) in dot.iter_mut().zip(rows) {
                                // SAFETY: chunks `2 pair` and `2 pair + 1` of block `b` of a row.
                                let (x0, x1) = unsafe { (x4(row, at), x4(row, at + 4)) };
                                *dm = _mm512_dpbusd_epi32(*dm, w0, x0);
                                *dm = _mm512_dpbusd_epi32(*dm, w1, x1);
                            }
                        }
                    }
                }
                for (m, (acc, dot)) in acc.iter_mut().zip(dot).enumerate() {
                    let i = (m0 + m) * nb + b;
                    let ds = if halves { a.ds2[2 * i + h] } else { a.ds[i] };
                    let scale = _mm512_mul_ps(*s, _mm512_set1_ps(a.d[i]));
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, *acc);
                    *acc = _mm512_fmadd_ps(*o, _mm512_set1_ps(ds), *acc);
                }
            }
        }
        let mask: __mmask16 = if width == GROUP {
            0xFFFF
        } else {
            (1u16 << width) - 1
        };
        for (m, v) in acc.iter().enumerate() {
            // SAFETY: the caller's contract: `width` columns of row `m0 + m` are this group's.
            unsafe { _mm512_mask_storeu_ps(out.0.add((m0 + m) * p.rows + g * GROUP), mask, *v) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The packed GEMM on AVX2 (no AVX-512): a 64-byte chunk of a group is two 256-bit halves,
    //! features 0-7 and 8-15, each multiplied as `vpdpbusd` would by `vpmaddubsw` pairs summed
    //! by `vpmaddwd`. The quants below 64 (4, 5 and 6 bits) keep every 16-bit sum exact (two
    //! pairs of `63 · 127`); Q8_0's unsigned quants `u = w + 128` go through their signed `w`
    //! (`|w| · sign(w)·x`, pairs below `2 · 128 · 127`) and add `128 Σ x` after. So every
    //! integer dot product is the VNNI kernel's and the float operations per (feature, row)
    //! are the same sequence: a row's values equal the other ISAs' bit for bit.
    use super::*;
    use std::arch::x86_64::*;

    /// Activation rows per register tile: each keeps two 8-lane dot products live.
    const TILE_M: usize = 4;

    /// [`group_portable`] on AVX2, [`TILE_M`] rows at a time, for blocks with `H` scales.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C, and `out` as for [`group_portable`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn group<const H: usize>(
        p: &PackedMatrix,
        a: &Acts,
        g: usize,
        n: usize,
        width: usize,
        out: Out,
    ) {
        let job = Job {
            p,
            a,
            g,
            width,
            out,
            pre: None,
        };
        if n <= TILE_M {
            // SAFETY: the caller's contract; one tile, nothing to share between tiles.
            unsafe { tiles::<H>(job, n) };
            return;
        }
        // Over more than one tile, the group's scales and unpacked quants are computed once
        // (the same operations, so the same values) and read by every tile, from this
        // thread's scratch (no allocation per group; nothing here calls back into rayon, so
        // the borrow is never taken twice).
        SCRATCH.with(|cell| {
            let mut scratch = cell.borrow_mut();
            let Scratch { scales, quants } = &mut *scratch;
            // SAFETY: the caller's features and contract.
            let pre = unsafe { prepare(p, g, scales, quants) };
            let job = Job {
                pre: Some(pre),
                ..job
            };
            // SAFETY: as above.
            unsafe { tiles::<H>(job, n) };
        });
    }

    /// What every tile of a group shares: the matrix, the activations, the group, its width
    /// and output, and its prepared tables.
    #[derive(Clone, Copy)]
    struct Job<'a> {
        p: &'a PackedMatrix,
        a: &'a Acts,
        g: usize,
        width: usize,
        out: Out,
        pre: Option<Pre<'a>>,
    }

    /// A thread's buffers for [`group`]'s tables.
    #[derive(Default)]
    struct Scratch {
        scales: Vec<f32>,
        quants: Vec<u8>,
    }

    thread_local! {
        static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
    }

    /// A group's scales and, for the nibble layouts, its quants as bytes, prepared once for
    /// all its tiles.
    #[derive(Clone, Copy)]
    struct Pre<'a> {
        /// [`SCALES_PER_BLOCK`] floats a block ([`scales_from`]).
        scales: &'a [f32],
        /// Per block its 8 chunks of 64 bytes, the quants [`unpack_pair`] returns (chunk `2p`
        /// from `w0`, `2p + 1` from `w1`, 32 bytes a feature half); empty for Q8_0's bytes.
        quants: &'a [u8],
    }

    /// Fills `scales` and `quants` for group `g` ([`Pre`]).
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn prepare<'a>(
        p: &PackedMatrix,
        g: usize,
        scales: &'a mut Vec<f32>,
        quants: &'a mut Vec<u8>,
    ) -> Pre<'a> {
        let nb = p.cols / 32;
        let qb = p.planes.quant_bytes();
        let masks = p.planes.masks();
        scales.resize(nb * SCALES_PER_BLOCK, 0.0);
        let nibbles = p.planes != Planes::Bytes;
        quants.resize(if nibbles { nb * 8 * CHUNK } else { 0 }, 0);
        for b in 0..nb {
            // SAFETY: the caller's features; the group's block lies inside the matrix, and
            // the destinations inside the buffers just sized.
            unsafe {
                let sc = [
                    scales_of(&p.scales, nb, g, b, 0),
                    scales_of(&p.scales, nb, g, b, 1),
                ];
                let dst = scales[b * SCALES_PER_BLOCK..][..SCALES_PER_BLOCK].as_mut_ptr();
                for (f, sc) in sc.iter().enumerate() {
                    for (h, (s, o)) in sc.iter().enumerate() {
                        _mm256_storeu_ps(dst.add(32 * f + 16 * h), *s);
                        _mm256_storeu_ps(dst.add(32 * f + 16 * h + 8), *o);
                    }
                }
                if nibbles {
                    let wb = &p.q[(g * nb + b) * qb..][..qb];
                    let hi = &p.hi[(g * nb + b) * masks..][..masks];
                    let dst = quants[b * 8 * CHUNK..][..8 * CHUNK].as_mut_ptr();
                    for pair in 0..4 {
                        let (w0, w1) = unpack_pair(wb, hi, pair, p.planes);
                        for f in 0..2 {
                            let at = 2 * pair * CHUNK + 32 * f;
                            _mm256_storeu_si256(dst.add(at).cast(), w0[f]);
                            _mm256_storeu_si256(dst.add(at + CHUNK).cast(), w1[f]);
                        }
                    }
                }
            }
        }
        Pre { scales, quants }
    }

    /// Every tile of the group's `n` rows.
    ///
    /// # Safety
    /// As [`group`]; `job.pre`, where given, prepared for the group.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tiles<const H: usize>(job: Job<'_>, n: usize) {
        let mut m0 = 0;
        while m0 < n {
            let t = (n - m0).min(TILE_M);
            // SAFETY (all): the caller's contract. Rows never mix, so the tiling only decides
            // how often the group's weights are unpacked.
            unsafe {
                match t {
                    4 => tile::<4, H>(job, m0),
                    3 => tile::<3, H>(job, m0),
                    2 => tile::<2, H>(job, m0),
                    _ => tile::<1, H>(job, m0),
                }
            }
            m0 += t;
        }
    }

    /// Floats of a block's scales in [`group`]'s table: per feature half, per scale half,
    /// 8 lanes of `s` then 8 of `o`.
    const SCALES_PER_BLOCK: usize = 64;

    /// The scales of block `b` stored by [`group`] in `table`, as [`scales_of`] returns them
    /// for feature halves 0 and 1.
    ///
    /// # Safety
    /// AVX must be enabled in the caller.
    #[inline(always)]
    unsafe fn scales_from(table: &[f32], b: usize) -> [[(__m256, __m256); 2]; 2] {
        let t = &table[b * SCALES_PER_BLOCK..][..SCALES_PER_BLOCK];
        // SAFETY: 64 floats checked above; the caller's features.
        unsafe {
            let p = t.as_ptr();
            [
                [
                    (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))),
                    (_mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))),
                ],
                [
                    (_mm256_loadu_ps(p.add(32)), _mm256_loadu_ps(p.add(40))),
                    (_mm256_loadu_ps(p.add(48)), _mm256_loadu_ps(p.add(56))),
                ],
            ]
        }
    }

    /// The 4 activation bytes at `row + at`, in every lane.
    ///
    /// # Safety
    /// `row + at .. row + at + 4` must lie inside the activation quants.
    #[inline(always)]
    unsafe fn x4(row: *const i8, at: usize) -> __m256i {
        // SAFETY: the caller's bounds; AVX is enabled in every caller.
        unsafe { _mm256_set1_epi32(row.add(at).cast::<i32>().read_unaligned()) }
    }

    /// 8 f16 values at `at`, as f32.
    #[inline(always)]
    unsafe fn f16x8(v: &[u16], at: usize) -> __m256 {
        // SAFETY: the slice bounds are checked; F16C is enabled in every caller.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(v[at..at + 8].as_ptr().cast())) }
    }

    /// 8 bytes at `at`, as f32 (signed or not).
    #[inline(always)]
    unsafe fn u8x8(v: &[u8], at: usize, signed: bool) -> __m256 {
        // SAFETY: the slice bounds are checked; AVX2 is enabled in every caller.
        unsafe {
            let b = _mm_loadl_epi64(v[at..at + 8].as_ptr().cast());
            let i = if signed {
                _mm256_cvtepi8_epi32(b)
            } else {
                _mm256_cvtepu8_epi32(b)
            };
            _mm256_cvtepi32_ps(i)
        }
    }

    /// `(s, o)` per half block of lanes `8f..8f + 8` of block `b` of group `g`: [`Scales::get`]'s
    /// IEEE operations.
    #[inline(always)]
    unsafe fn scales_of(
        sc: &Scales,
        nb: usize,
        g: usize,
        b: usize,
        f: usize,
    ) -> [(__m256, __m256); 2] {
        let at = (g * nb + b) * GROUP + 8 * f;
        let sup = (g * nb.div_ceil(8) + b / 8) * GROUP + 8 * f;
        // SAFETY: the caller's features; slices are bounds-checked.
        unsafe {
            match sc {
                Scales::Block { d, o } => {
                    let v = (f16x8(d, at), f16x8(o, at));
                    [v, v]
                }
                Scales::Super { d, dmin, sc, m } => {
                    let s = _mm256_mul_ps(f16x8(d, sup), u8x8(sc, at, false));
                    let o = _mm256_mul_ps(f16x8(dmin, sup), u8x8(m, at, false));
                    let neg = _mm256_xor_ps(o, _mm256_set1_ps(-0.0));
                    [(s, neg), (s, neg)]
                }
                Scales::Halves { d, sc } => {
                    let (d, m32) = (f16x8(d, sup), _mm256_set1_ps(-32.0));
                    let base = 2 * (g * nb + b) * GROUP + 8 * f;
                    let s0 = _mm256_mul_ps(d, u8x8(sc, base, true));
                    let s1 = _mm256_mul_ps(d, u8x8(sc, base + GROUP, true));
                    [(s0, _mm256_mul_ps(s0, m32)), (s1, _mm256_mul_ps(s1, m32))]
                }
            }
        }
    }

    /// 0xFF in byte `j` where bit `j` of `bits` is set.
    #[inline(always)]
    unsafe fn bytes_of(bits: u32) -> __m256i {
        // SAFETY: AVX2 is enabled in every caller.
        unsafe {
            let v = _mm256_set1_epi32(bits as i32);
            // Byte j takes byte j / 8 of `bits` (each 128-bit lane holds all four).
            let spread = _mm256_setr_epi8(
                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
                3, 3, 3, 3,
            );
            let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
            let b = _mm256_and_si256(_mm256_shuffle_epi8(v, spread), bit);
            _mm256_cmpeq_epi8(b, bit)
        }
    }

    /// The quants of chunks `2 pair` and `2 pair + 1` of a block, per feature half:
    /// the nibbles plus the fifth and sixth bits where the format has them.
    ///
    /// # Safety
    /// AVX2 must be enabled in the caller; `wb` holds the block's quant bytes and `hi` its
    /// `masks` high-bit masks.
    #[inline(always)]
    unsafe fn unpack_pair(
        wb: &[u8],
        hi: &[u64],
        pair: usize,
        planes: Planes,
    ) -> ([__m256i; 2], [__m256i; 2]) {
        let masks = planes.masks();
        // SAFETY (all): the caller's features; 64 bytes at `pair * 64` lie inside the block,
        // and its high bits inside `hi`.
        unsafe {
            let low = _mm256_set1_epi8(0x0F);
            let mut w0 = [_mm256_setzero_si256(); 2];
            let mut w1 = [_mm256_setzero_si256(); 2];
            for (f, half) in (0..2).zip([0, 32]) {
                let raw = _mm256_loadu_si256(wb[pair * CHUNK + half..][..32].as_ptr().cast());
                w0[f] = _mm256_and_si256(raw, low);
                w1[f] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                if planes == Planes::Nibbles6Fields {
                    // The pair's 32 bytes of fields: half 0 in the low nibbles, half 1 in the
                    // high ones (x86 is little-endian: byte `k` of the `u64`s is byte `k`).
                    let fields = &hi[4 * pair..][..4];
                    let all = _mm256_loadu_si256(fields.as_ptr().cast());
                    let nibbles = if f == 0 {
                        all
                    } else {
                        _mm256_srli_epi16(all, 4)
                    };
                    let mine = _mm256_and_si256(nibbles, low);
                    let (three, twelve) = (_mm256_set1_epi8(3), _mm256_set1_epi8(12));
                    let b0 = _mm256_slli_epi16(_mm256_and_si256(mine, three), 4);
                    let b1 = _mm256_slli_epi16(_mm256_and_si256(mine, twelve), 2);
                    w0[f] = _mm256_or_si256(w0[f], b0);
                    w1[f] = _mm256_or_si256(w1[f], b1);
                    continue;
                }
                if masks >= 8 {
                    w0[f] = _mm256_or_si256(w0[f], bit_bytes(hi[2 * pair], half, 0x10));
                    w1[f] = _mm256_or_si256(w1[f], bit_bytes(hi[2 * pair + 1], half, 0x10));
                }
                if masks == 16 {
                    w0[f] = _mm256_or_si256(w0[f], bit_bytes(hi[8 + 2 * pair], half, 0x20));
                    w1[f] = _mm256_or_si256(w1[f], bit_bytes(hi[9 + 2 * pair], half, 0x20));
                }
            }
            (w0, w1)
        }
    }

    /// [`unpack_pair`]'s quants, from the group's prepared bytes where there are some.
    ///
    /// # Safety
    /// As [`unpack_pair`]; `pre` prepared for this block's group.
    #[inline(always)]
    unsafe fn pair_of(
        pre: Option<Pre<'_>>,
        wb: &[u8],
        hi: &[u64],
        b: usize,
        pair: usize,
        planes: Planes,
    ) -> ([__m256i; 2], [__m256i; 2]) {
        // SAFETY: the caller's features; the slice bounds are checked.
        unsafe {
            match pre {
                Some(pre) => {
                    let q = &pre.quants[b * 8 * CHUNK + 2 * pair * CHUNK..][..2 * CHUNK];
                    let at = |o: usize| q[o..o + 32].as_ptr().cast::<__m256i>();
                    (
                        [_mm256_loadu_si256(at(0)), _mm256_loadu_si256(at(32))],
                        [
                            _mm256_loadu_si256(at(CHUNK)),
                            _mm256_loadu_si256(at(CHUNK + 32)),
                        ],
                    )
                }
                None => unpack_pair(wb, hi, pair, planes),
            }
        }
    }

    /// Chunk `c` of a Q8_0 block per feature half, as signed quants `w = u - 128` and their
    /// magnitudes.
    ///
    /// # Safety
    /// AVX2 must be enabled in the caller; `wb` holds the block's quant bytes.
    #[inline(always)]
    unsafe fn signed_chunk(wb: &[u8], c: usize) -> ([__m256i; 2], [__m256i; 2]) {
        // SAFETY: the caller's features; the slice bounds are checked. (No closures here: a
        // closure does not inherit its caller's target features, and the intrinsics in it
        // would become calls.)
        unsafe {
            let flip = _mm256_set1_epi8(-128);
            let lo = _mm256_loadu_si256(wb[c * CHUNK..][..32].as_ptr().cast());
            let hi = _mm256_loadu_si256(wb[c * CHUNK + 32..][..32].as_ptr().cast());
            let w = [_mm256_xor_si256(lo, flip), _mm256_xor_si256(hi, flip)];
            (w, [_mm256_abs_epi8(w[0]), _mm256_abs_epi8(w[1])])
        }
    }

    /// `value` in byte `j` where bit `half + j` of `mask` is set.
    #[inline(always)]
    unsafe fn bit_bytes(mask: u64, half: usize, value: i8) -> __m256i {
        // SAFETY: AVX2 is enabled in every caller.
        unsafe { _mm256_and_si256(bytes_of((mask >> half) as u32), _mm256_set1_epi8(value)) }
    }

    /// The first `width` of a group's 16 sums to `dst`.
    ///
    /// # Safety
    /// AVX must be enabled in the caller; `dst` must take `width` values.
    #[inline(always)]
    unsafe fn store(v: &[__m256; 2], dst: *mut f32, width: usize) {
        let mut vals = [0f32; GROUP];
        // SAFETY: 16 floats of local destination, then the caller's `width` values.
        unsafe {
            _mm256_storeu_ps(vals.as_mut_ptr(), v[0]);
            _mm256_storeu_ps(vals.as_mut_ptr().add(8), v[1]);
            std::ptr::copy_nonoverlapping(vals.as_ptr(), dst, width);
        }
    }

    /// The integer dot products of part `h` of block `b` (its 32 columns, or with two
    /// scales a block the half `h`) for `M` activation rows, per feature half; Q8_0's include
    /// the `128 Σ x` of its unsigned quants.
    ///
    /// # Safety
    /// AVX2 must be enabled in the caller; `rows` point at `M` activation rows of the job's.
    #[inline(always)]
    unsafe fn dots<const M: usize, const H: usize>(
        job: Job<'_>,
        rows: [*const i8; M],
        m0: usize,
        b: usize,
        h: usize,
    ) -> [[__m256i; 2]; M] {
        let (p, a) = (job.p, job.a);
        let nb = p.cols / 32;
        let (qb, masks) = (p.planes.quant_bytes(), p.planes.masks());
        let wb = &p.q[(job.g * nb + b) * qb..][..qb];
        let hi = &p.hi[(job.g * nb + b) * masks..][..masks];
        let parts = if H == 2 { h * 2..h * 2 + 2 } else { 0..4 };
        // Both feature halves of a chunk per pass, so each row's activation bytes are
        // broadcast once for the 16 features.
        // SAFETY (all): the caller's features; chunks of block `b` of the group and of the
        // rows, inside both.
        unsafe {
            let ones = _mm256_set1_epi16(1);
            let mut dot = [[_mm256_setzero_si256(); 2]; M];
            match p.planes {
                Planes::Bytes => {
                    for c in parts.start * 2..parts.end * 2 {
                        let (w, aw) = signed_chunk(wb, c);
                        for (dm, row) in dot.iter_mut().zip(rows) {
                            let x = x4(row, b * 32 + c * 4);
                            for f in 0..2 {
                                let pairs = _mm256_maddubs_epi16(aw[f], _mm256_sign_epi8(x, w[f]));
                                dm[f] = _mm256_add_epi32(dm[f], _mm256_madd_epi16(pairs, ones));
                            }
                        }
                    }
                    // Q8_0's signed quants: Σ u·x = Σ w·x + 128 Σ x.
                    for (m, dm) in dot.iter_mut().enumerate() {
                        let shift = _mm256_set1_epi32(a.sum[(m0 + m) * nb + b] << 7);
                        for d in dm.iter_mut() {
                            *d = _mm256_add_epi32(*d, shift);
                        }
                    }
                }
                Planes::Nibbles => {
                    // 4-bit quants (at most 15): a lane sums at most 8 `vpmaddubsw` pairs over
                    // a block, 16 products of at most 15 · 127, 30,480 < 2^15, so the pairs
                    // add in 16 bits and widen once per block (the same integer).
                    let mut d16 = [[_mm256_setzero_si256(); 2]; M];
                    for pair in parts {
                        let (w0, w1) = pair_of(job.pre, wb, hi, b, pair, p.planes);
                        let at = b * 32 + pair * 8;
                        for (d, row) in d16.iter_mut().zip(rows) {
                            let (x0, x1) = (x4(row, at), x4(row, at + 4));
                            for f in 0..2 {
                                let pairs = _mm256_add_epi16(
                                    _mm256_maddubs_epi16(w0[f], x0),
                                    _mm256_maddubs_epi16(w1[f], x1),
                                );
                                d[f] = _mm256_add_epi16(d[f], pairs);
                            }
                        }
                    }
                    for (dm, d) in dot.iter_mut().zip(d16) {
                        for f in 0..2 {
                            dm[f] = _mm256_madd_epi16(d[f], ones);
                        }
                    }
                }
                Planes::NibblesHigh | Planes::Nibbles6 | Planes::Nibbles6Fields => {
                    for pair in parts {
                        let (w0, w1) = pair_of(job.pre, wb, hi, b, pair, p.planes);
                        let at = b * 32 + pair * 8;
                        for (dm, row) in dot.iter_mut().zip(rows) {
                            let (x0, x1) = (x4(row, at), x4(row, at + 4));
                            for f in 0..2 {
                                // Quants below 64: four products stay below 2^15.
                                let pairs = _mm256_add_epi16(
                                    _mm256_maddubs_epi16(w0[f], x0),
                                    _mm256_maddubs_epi16(w1[f], x1),
                                );
                                dm[f] = _mm256_add_epi32(dm[f], _mm256_madd_epi16(pairs, ones));
                            }
                        }
                    }
                }
            }
            dot
        }
    }

    /// Rows `m0..m0 + M` of the job's group.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const M: usize, const H: usize>(job: Job<'_>, m0: usize) {
        let (p, a, g) = (job.p, job.a, job.g);
        let nb = p.cols / 32;
        let qb = p.planes.quant_bytes();
        let mut acc = [[_mm256_setzero_ps(); 2]; M];
        assert!((m0 + M) * a.cols <= a.q.len() && nb * 32 <= a.cols);
        // SAFETY: rows `m0..m0 + M` of the activations are in bounds (asserted above).
        let rows: [*const i8; M] =
            std::array::from_fn(|m| unsafe { a.q.as_ptr().add((m0 + m) * a.cols) });
        for b in 0..nb {
            let wb = &p.q[(g * nb + b) * qb..][..qb];
            // Ahead of use, as the VNNI kernel does (a prefetch never faults); quants
            // prepared in the scratch are read from there instead.
            if job.pre.is_none_or(|pre| pre.quants.is_empty()) {
                for c in (0..qb).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(wb.as_ptr().wrapping_add(PREFETCH + c).cast());
                }
            }
            // SAFETY: the scales of the group's block lie inside the vectors or the table.
            let [lo, hi8] = unsafe {
                match job.pre {
                    Some(pre) => scales_from(pre.scales, b),
                    None => [
                        scales_of(&p.scales, nb, g, b, 0),
                        scales_of(&p.scales, nb, g, b, 1),
                    ],
                }
            };
            let sw = [[lo[0], hi8[0]], [lo[1], hi8[1]]];
            for (h, sw) in sw.iter().enumerate().take(H) {
                // SAFETY: `rows` are the tile's, inside the activations.
                let dot = unsafe { dots::<M, H>(job, rows, m0, b, h) };
                for (m, (acc, dot)) in acc.iter_mut().zip(dot).enumerate() {
                    let i = (m0 + m) * nb + b;
                    let ds = if H == 2 { a.ds2[2 * i + h] } else { a.ds[i] };
                    for ((acc, dot), (s, o)) in acc.iter_mut().zip(dot).zip(sw) {
                        let scale = _mm256_mul_ps(*s, _mm256_set1_ps(a.d[i]));
                        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, *acc);
                        *acc = _mm256_fmadd_ps(*o, _mm256_set1_ps(ds), *acc);
                    }
                }
            }
        }
        for (m, v) in acc.iter().enumerate() {
            // SAFETY: the caller's contract: `width` columns of row `m0 + m` are this group's.
            unsafe { store(v, job.out.0.add((m0 + m) * p.rows + g * GROUP), job.width) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    use std::sync::Arc;

    fn matrix(ty: QType, g: GgmlDType, rows: usize, cols: usize) -> (QMatrix, Vec<f32>) {
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 + 13) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let t = Tensor::from_vec(w, (rows, cols), &Device::Cpu).expect("tensor");
        let q = QTensor::quantize(&t, g).expect("quantize");
        let deq = q
            .dequantize(&Device::Cpu)
            .and_then(|d| d.flatten_all())
            .and_then(|d| d.to_vec1::<f32>())
            .expect("dequantize");
        let bytes = q.data().expect("data").into_owned();
        let m = QMatrix::new(ty, rows, cols, Arc::new(bytes)).expect("qmatrix");
        (m, deq)
    }

    fn input(n: usize, cols: usize) -> Vec<f32> {
        (0..n * cols)
            .map(|i| ((i * 31 + 7) % 200) as f32 / 100.0 - 1.0)
            .collect()
    }

    #[test]
    fn products_match_the_dense_product_and_rows_do_not_depend_on_the_batch() {
        // The k-quants need whole super-blocks of 256 (two here: their scales change at 256).
        let formats = [
            (QType::Q8_0, GgmlDType::Q8_0, 96),
            (QType::Q5_0, GgmlDType::Q5_0, 96),
            (QType::Q4_1, GgmlDType::Q4_1, 96),
            (QType::Q4K, GgmlDType::Q4K, 512),
            (QType::Q6K, GgmlDType::Q6K, 512),
        ];
        // 40 rows: two whole groups and a padded one.
        let rows = 40;
        // Each layout (Q6_K's high bits as masks, or as the AVX2 kernel's 2-bit fields)
        // multiplied on every ISA.
        let layouts = formats
            .iter()
            .flat_map(|&f| [(f, Isa::Avx512Vnni), (f, Isa::Avx2)]);
        for ((ty, g, cols), layout) in layouts {
            let (m, w) = matrix(ty, g, rows, cols);
            let p = m.pack_for(layout).expect("packs");
            // The same weights, bit for bit, in about the file's bytes.
            assert_eq!(
                p.dequantize_rows(3..rows).expect("dequantize"),
                m.dequantize_rows(3..rows).expect("dequantize"),
                "{ty:?}"
            );
            assert!(p.dequantize_rows(0..rows + 1).is_err());
            // Padding to 48 rows and (legacy formats) an f16 offset per block: at most 10% more
            // than the file.
            let file = rows * cols / ty.block_len() * ty.block_bytes();
            assert!(
                p.nbytes() * 40 <= file * 48 * 11 / 10,
                "{ty:?}: {} vs {file}",
                p.nbytes()
            );
            for n in [1, 2, 3, 6, 7, 8, 13] {
                let x = input(n, cols);
                let want: Vec<f32> = (0..n)
                    .flat_map(|r| {
                        let (x, w) = (&x, &w);
                        (0..rows).map(move |j| {
                            (0..cols)
                                .map(|k| x[r * cols + k] * w[j * cols + k])
                                .sum::<f32>()
                        })
                    })
                    .collect();
                let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
                // An ISA this CPU lacks runs the portable loop (`Isa::best()` says which ran).
                for isa in [Isa::Portable, Isa::Avx512Vnni, Isa::Avx2] {
                    let got = p.matmul_on(isa, &x, n).expect("matmul");
                    let err = want
                        .iter()
                        .zip(&got)
                        .fold(0f32, |a, (w, g)| a.max((w - g).abs()));
                    // int8 activations: ~1% of the largest output.
                    assert!(
                        err <= 0.02 * scale,
                        "{ty:?} n={n} {isa:?}: {err} of {scale}"
                    );
                    // Each row equals itself computed alone, bit for bit.
                    for r in 0..n {
                        let alone = p
                            .matmul_on(isa, &x[r * cols..(r + 1) * cols], 1)
                            .expect("alone");
                        assert_eq!(
                            alone,
                            got[r * rows..(r + 1) * rows],
                            "{ty:?} {isa:?} row {r}"
                        );
                    }
                }
                // Every ISA performs the same operations.
                let portable = p.matmul_on(Isa::Portable, &x, n).expect("portable");
                for isa in [Isa::Avx512Vnni, Isa::Avx2] {
                    let got = p.matmul_on(isa, &x, n).expect("simd");
                    assert_eq!(portable, got, "{ty:?} n={n} {isa:?}");
                }
            }
        }
    }

    #[test]
    fn the_largest_quants_against_the_largest_activations_stay_exact_on_every_isa() {
        // Weights of ±1 quantize to the format's extreme quants, and activations of ±1 with
        // the weights' signs make every product its largest: where the SIMD kernels sum
        // quant pairs in 16 bits, a sum past 2^15 would saturate or wrap and differ from the
        // portable loop's 32-bit sums. Two sign patterns: mixed, and all +1 but one weight a
        // block (the largest quant nearly everywhere, so a lane's 16-bit sum over a block is
        // its largest); 2 rows (one tile) and 6 (the tiles of AVX2's prepared group).
        let mixed = |j: usize, k: usize| if (j * 7 + k * 3) % 5 < 2 { -1.0 } else { 1.0 };
        let high = |j: usize, k: usize| if k % 32 == j % 32 { -1.0 } else { 1.0 };
        let patterns: [&dyn Fn(usize, usize) -> f32; 2] = [&mixed, &high];
        for (ty, sign, n) in QType::ALL
            .into_iter()
            .flat_map(|ty| patterns.map(|s| (ty, s)))
            .flat_map(|(ty, s)| [(ty, s, 2), (ty, s, 6)])
        {
            let g = match ty {
                QType::Q8_0 => GgmlDType::Q8_0,
                QType::Q5_0 => GgmlDType::Q5_0,
                QType::Q4_1 => GgmlDType::Q4_1,
                QType::Q4K => GgmlDType::Q4K,
                QType::Q6K => GgmlDType::Q6K,
            };
            let (rows, cols) = (24, 512);
            let w: Vec<f32> = (0..rows * cols).map(|i| sign(i / cols, i % cols)).collect();
            let t = Tensor::from_vec(w, (rows, cols), &Device::Cpu).expect("tensor");
            let q = QTensor::quantize(&t, g).expect("quantize");
            let bytes = q.data().expect("data").into_owned();
            let m = QMatrix::new(ty, rows, cols, Arc::new(bytes)).expect("qmatrix");
            for (p, flip) in [Isa::Avx512Vnni, Isa::Avx2]
                .map(|layout| m.pack_for(layout).expect("packs"))
                .into_iter()
                .flat_map(|p| [(p.clone(), 1.0f32), (p, -1.0)])
            {
                let x: Vec<f32> = (0..n * cols)
                    .map(|k| flip * sign(k / cols, k % cols))
                    .collect();
                let portable = p.matmul_on(Isa::Portable, &x, n).expect("portable");
                for isa in [Isa::Avx512Vnni, Isa::Avx2] {
                    let got = p.matmul_on(isa, &x, n).expect("simd");
                    assert_eq!(portable, got, "{ty:?} {isa:?} flip {flip} n={n}");
                }
                // Row 0 against weight row 0 is every product at its largest: the dot equals
                // the sum of the absolute weights.
                let want: f32 = m
                    .dequantize_rows(0..1)
                    .expect("row")
                    .iter()
                    .map(|v| v.abs())
                    .sum();
                assert!(
                    (portable[0] * flip - want).abs() <= 0.02 * want,
                    "{ty:?}: {}",
                    portable[0]
                );
            }
        }
    }

    #[test]
    fn products_sharing_their_input_equal_the_separate_products() {
        // Mixed formats and sizes (one with more groups than tasks, so tasks hold several).
        let cols = 512;
        let mats: Vec<PackedMatrix> = [
            (QType::Q4K, GgmlDType::Q4K, 40),
            (QType::Q6K, GgmlDType::Q6K, 24),
            (QType::Q8_0, GgmlDType::Q8_0, 1100),
        ]
        .into_iter()
        .map(|(ty, g, rows)| matrix(ty, g, rows, cols).0.pack().expect("packs"))
        .collect();
        let refs: Vec<&PackedMatrix> = mats.iter().collect();
        for n in [1, 5, 9] {
            let x = input(n, cols);
            for isa in [Isa::Portable, Isa::Avx512Vnni, Isa::Avx2] {
                let many = PackedMatrix::matmul_many_on(isa, &refs, &x, n).expect("many");
                assert_eq!(many.len(), mats.len());
                for (p, y) in mats.iter().zip(&many) {
                    assert_eq!(*y, p.matmul_on(isa, &x, n).expect("alone"), "n={n} {isa:?}");
                }
            }
        }
        let (narrow, _) = matrix(QType::Q8_0, GgmlDType::Q8_0, 16, 64);
        let narrow = narrow.pack().expect("packs");
        let err = PackedMatrix::matmul_many(&[&mats[0], &narrow], &input(1, cols), 1);
        assert!(err.is_err());
        assert!(PackedMatrix::matmul_many(&[], &[], 0)
            .expect("none")
            .is_empty());
    }

    #[test]
    fn shapes_are_checked() {
        let (m, _) = matrix(QType::Q8_0, GgmlDType::Q8_0, 16, 64);
        let p = m.pack().expect("packs");
        assert!(p.matmul(&[0.0; 63], 1).is_err());
        assert!(p.matmul(&[], 0).expect("empty").is_empty());
    }
}
