//! Q8_0, Q5_0 and Q4_1 weights repacked for an int8 GEMM that is fast at every row count.
//!
//! Lane `f` of a 512-bit register holds 4 quants of output feature `f`, so one AVX-512 VNNI
//! `vpdpbusd` multiplies 4 inputs of 16 features with the activation's 4 bytes broadcast; the
//! float work (convert, scale, offset) happens once per block of 32 per feature. A tile is
//! [`TILE_M`] activation rows x 16 features. Every (feature, row) value is one fixed sequence
//! over the blocks, `acc = fma(dot, d_w·d_x, acc); acc = fma(o_w, d_x·Σq_x, acc)`, whatever
//! rows share the call and on either ISA (the portable path performs the same IEEE operations),
//! so a row is bit-identical alone, in a verification batch or in a 2048-row prefill: the
//! property the ρ = 1 identity and verification rest on. One kernel for every row count ends
//! the split between few-row int8 and many-row f32 panels (docs/performance.md).

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
}

impl Planes {
    fn quant_bytes(self) -> usize {
        match self {
            Planes::Bytes => 8 * CHUNK,
            Planes::Nibbles | Planes::NibblesHigh => 4 * CHUNK,
        }
    }
}

/// A weight matrix repacked from [`QMatrix`] (see the module documentation). It keeps the
/// file's bit width: 4 or 5 bits per quant plus an f16 scale and offset per block of 32.
#[derive(Clone)]
pub struct PackedMatrix {
    rows: usize,
    cols: usize,
    planes: Planes,
    /// `(groups, blocks, quant_bytes)` quants, laid out as [`Planes`] says.
    q: Vec<u8>,
    /// `(groups, blocks, 8)` fifth-bit masks ([`Planes::NibblesHigh`] only).
    hi: Vec<u64>,
    /// `(groups, blocks, 16)` f16 scales: the weight is `d · u + o`.
    d: Vec<u16>,
    /// `(groups, blocks, 16)` f16 offsets.
    o: Vec<u16>,
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

/// Activation rows quantized per block of 32: quants, scales `d`, and `d · Σ q` per block.
struct Acts {
    cols: usize,
    q: Vec<i8>,
    d: Vec<f32>,
    ds: Vec<f32>,
}

impl Acts {
    fn quantize(x: &[f32], cols: usize) -> Self {
        let nb = x.len() / 32;
        let mut q = vec![0i8; x.len()];
        let mut d = vec![0f32; nb];
        let mut ds = vec![0f32; nb];
        // Rows in parallel; each block's numbers depend on that block alone.
        q.par_chunks_mut(cols)
            .zip(d.par_chunks_mut(cols / 32))
            .zip(ds.par_chunks_mut(cols / 32))
            .zip(x.par_chunks(cols))
            .for_each(|(((q, d), ds), x)| {
                for (((xb, qb), d), ds) in x
                    .chunks_exact(32)
                    .zip(q.chunks_exact_mut(32))
                    .zip(d.iter_mut())
                    .zip(ds.iter_mut())
                {
                    let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let scale = amax / 127.0;
                    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                    let mut sum = 0i32;
                    for (dst, &v) in qb.iter_mut().zip(xb) {
                        *dst = (v * inv).round().clamp(-127.0, 127.0) as i8;
                        sum += i32::from(*dst);
                    }
                    *d = scale;
                    *ds = scale * sum as f32;
                }
            });
        Self { cols, q, d, ds }
    }
}

impl QMatrix {
    /// The matrix repacked for [`PackedMatrix::matmul`]; `None` for a format it does not take
    /// (the k-quants) or a block whose offset f16 cannot hold.
    pub fn pack(&self) -> Option<PackedMatrix> {
        let planes = match self.ty {
            QType::Q8_0 => Planes::Bytes,
            QType::Q5_0 => Planes::NibblesHigh,
            QType::Q4_1 => Planes::Nibbles,
            _ => return None,
        };
        let (rows, cols) = (self.rows, self.cols);
        let nb = cols / 32;
        let groups = rows.div_ceil(GROUP);
        let qb = planes.quant_bytes();
        let mut q = vec![0u8; groups * nb * qb];
        let mut hi = if planes == Planes::NibblesHigh {
            vec![0u64; groups * nb * 8]
        } else {
            Vec::new()
        };
        // Padding features of the last group keep zero scales and offsets: they add nothing.
        let mut d = vec![0u16; groups * nb * GROUP];
        let mut o = vec![0u16; groups * nb * GROUP];
        let view = self.view();
        for j in 0..rows {
            let (g, lane) = (j / GROUP, j % GROUP);
            let row = view.row(j);
            for b in 0..nb {
                let sub = portable::unpack(self.ty, row, b);
                // One scale and offset per block for these formats (both halves agree); both
                // come from f16 values, the offset times 16 or 128 (exact unless it overflows).
                let at = (g * nb + b) * GROUP + lane;
                let (dh, oh) = (f16::from_f32(sub.s[0]), f16::from_f32(sub.o[0]));
                if dh.to_f32() != sub.s[0] || oh.to_f32() != sub.o[0] {
                    return None;
                }
                d[at] = dh.to_bits();
                o[at] = oh.to_bits();
                let base = (g * nb + b) * qb;
                for (k, &u) in sub.u.iter().enumerate() {
                    let (c, byte) = (k / 4, lane * 4 + k % 4);
                    match planes {
                        Planes::Bytes => q[base + c * CHUNK + byte] = u,
                        Planes::Nibbles | Planes::NibblesHigh => {
                            q[base + (c / 2) * CHUNK + byte] |= (u & 0xF) << (4 * (c % 2));
                            if u & 0x10 != 0 {
                                hi[(g * nb + b) * 8 + c] |= 1 << byte;
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
            d,
            o,
        })
    }
}

/// The output, written by many tasks at disjoint places.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: every task writes its own feature group's columns only (see `matmul_on`).
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
        self.q.len() + 8 * self.hi.len() + 2 * (self.d.len() + self.o.len())
    }

    /// The quant `u` of feature `j` at input `k`.
    fn quant(&self, j: usize, k: usize) -> u8 {
        let nb = self.cols / 32;
        let (g, lane, b, kk) = (j / GROUP, j % GROUP, k / 32, k % 32);
        let (c, byte) = (kk / 4, lane * 4 + kk % 4);
        let base = (g * nb + b) * self.planes.quant_bytes();
        match self.planes {
            Planes::Bytes => self.q[base + c * CHUNK + byte],
            Planes::Nibbles | Planes::NibblesHigh => {
                let nib = (self.q[base + (c / 2) * CHUNK + byte] >> (4 * (c % 2))) & 0xF;
                let high = self.planes == Planes::NibblesHigh
                    && self.hi[(g * nb + b) * 8 + c] >> byte & 1 == 1;
                nib | (u8::from(high) << 4)
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
                let at = ((j / GROUP) * nb + k / 32) * GROUP + j % GROUP;
                let (d, o) = (
                    f16::from_bits(self.d[at]).to_f32(),
                    f16::from_bits(self.o[at]).to_f32(),
                );
                out.push(d.mul_add(f32::from(self.quant(j, k)), o));
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
        if x.len() != n * self.cols {
            return Err(shape_err(
                "packed matmul",
                format!("{} values for {n} rows of {} columns", x.len(), self.cols),
            ));
        }
        let isa = if Isa::best() == Isa::Avx512Vnni {
            isa
        } else {
            Isa::Portable
        };
        if n == 0 {
            return Ok(Vec::new());
        }
        let a = Acts::quantize(x, self.cols);
        let groups = self.rows.div_ceil(GROUP);
        let mut y = vec![0f32; n * self.rows];
        let out = Out(y.as_mut_ptr());
        // Groups per task: enough tasks for both cores and few enough to keep overhead low.
        let per_task = (groups / 32).max(1);
        (0..groups.div_ceil(per_task))
            .into_par_iter()
            .for_each(|t| {
                for g in t * per_task..((t + 1) * per_task).min(groups) {
                    let width = (self.rows - g * GROUP).min(GROUP);
                    match isa {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: `Isa::best()` confirmed the CPU features; group `g` writes
                        // columns `g * 16..g * 16 + width` of the `n` rows of `y` and no task
                        // shares a group.
                        Isa::Avx512Vnni => unsafe { vnni::group(self, &a, g, n, width, out) },
                        // SAFETY: as above.
                        _ => unsafe { group_portable(self, &a, g, n, width, out) },
                    }
                }
            });
        Ok(y)
    }
}

/// Feature group `g` for every row, written to `y[m * rows + g * 16..][..width]`.
///
/// # Safety
/// `out` must point at `n * p.rows` values that no one else touches in those columns.
unsafe fn group_portable(p: &PackedMatrix, a: &Acts, g: usize, n: usize, width: usize, out: Out) {
    let nb = p.cols / 32;
    for m in 0..n {
        let mut acc = [0f32; GROUP];
        for b in 0..nb {
            let xq = &a.q[m * a.cols + b * 32..][..32];
            let i = m * nb + b;
            for (f, acc) in acc.iter_mut().enumerate() {
                let j = g * GROUP + f;
                let dot: i32 = if j < p.rows {
                    (0..32)
                        .map(|k| i32::from(p.quant(j, b * 32 + k)) * i32::from(xq[k]))
                        .sum()
                } else {
                    0
                };
                let at = (g * nb + b) * GROUP + f;
                let (dw, ow) = (
                    f16::from_bits(p.d[at]).to_f32(),
                    f16::from_bits(p.o[at]).to_f32(),
                );
                *acc = (dot as f32).mul_add(dw * a.d[i], *acc);
                *acc = ow.mul_add(a.ds[i], *acc);
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

    /// [`group_portable`] on AVX-512 VNNI, [`TILE_M`] rows at a time.
    ///
    /// # Safety
    /// The CPU must have the features of [`Isa::Avx512Vnni`], and `out` as for
    /// [`group_portable`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    pub(super) unsafe fn group(
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
            match t {
                TILE_M => unsafe { tile::<TILE_M>(p, a, g, m0, width, out) },
                4..=7 => {
                    unsafe { tile::<4>(p, a, g, m0, width, out) };
                    for r in 4..t {
                        unsafe { tile::<1>(p, a, g, m0 + r, width, out) };
                    }
                }
                _ => {
                    for r in 0..t {
                        unsafe { tile::<1>(p, a, g, m0 + r, width, out) };
                    }
                }
            }
            m0 += t;
        }
    }

    /// The activation's 4 bytes of chunk `c` of block `b` of row `m`, in every lane.
    #[inline(always)]
    fn x4(a: &Acts, m: usize, b: usize, c: usize) -> __m512i {
        let xq = &a.q[m * a.cols + b * 32 + c * 4..][..4];
        let v = i32::from_le_bytes([xq[0] as u8, xq[1] as u8, xq[2] as u8, xq[3] as u8]);
        // SAFETY: AVX-512F is enabled in every caller.
        unsafe { _mm512_set1_epi32(v) }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    unsafe fn tile<const M: usize>(
        p: &PackedMatrix,
        a: &Acts,
        g: usize,
        m0: usize,
        width: usize,
        out: Out,
    ) {
        let nb = p.cols / 32;
        let qb = p.planes.quant_bytes();
        let low = _mm512_set1_epi8(0x0F);
        let sixteen = _mm512_set1_epi8(0x10);
        let mut acc = [_mm512_setzero_ps(); M];
        for b in 0..nb {
            let mut dot = [_mm512_setzero_si512(); M];
            let wb = &p.q[(g * nb + b) * qb..][..qb];
            match p.planes {
                Planes::Bytes => {
                    for c in 0..8 {
                        // SAFETY: 64 bytes at `c * 64` lie inside the block's 512.
                        let w = unsafe { _mm512_loadu_si512(wb.as_ptr().add(c * CHUNK).cast()) };
                        for (m, dm) in dot.iter_mut().enumerate() {
                            *dm = _mm512_dpbusd_epi32(*dm, w, x4(a, m0 + m, b, c));
                        }
                    }
                }
                Planes::Nibbles | Planes::NibblesHigh => {
                    let hi = &p.hi[..];
                    for pair in 0..4 {
                        // SAFETY: 64 bytes at `pair * 64` lie inside the block's 256.
                        let raw =
                            unsafe { _mm512_loadu_si512(wb.as_ptr().add(pair * CHUNK).cast()) };
                        let mut w0 = _mm512_and_si512(raw, low);
                        let mut w1 = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                        if p.planes == Planes::NibblesHigh {
                            let h = (g * nb + b) * 8 + 2 * pair;
                            w0 = _mm512_mask_add_epi8(w0, hi[h], w0, sixteen);
                            w1 = _mm512_mask_add_epi8(w1, hi[h + 1], w1, sixteen);
                        }
                        for (m, dm) in dot.iter_mut().enumerate() {
                            *dm = _mm512_dpbusd_epi32(*dm, w0, x4(a, m0 + m, b, 2 * pair));
                            *dm = _mm512_dpbusd_epi32(*dm, w1, x4(a, m0 + m, b, 2 * pair + 1));
                        }
                    }
                }
            }
            let at = (g * nb + b) * GROUP;
            // SAFETY: 16 scales and 16 offsets of the group's block.
            let (dw, ow) = unsafe {
                (
                    _mm512_cvtph_ps(_mm256_loadu_si256(p.d.as_ptr().add(at).cast())),
                    _mm512_cvtph_ps(_mm256_loadu_si256(p.o.as_ptr().add(at).cast())),
                )
            };
            for m in 0..M {
                let i = (m0 + m) * nb + b;
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[i]));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), scale, acc[m]);
                acc[m] = _mm512_fmadd_ps(ow, _mm512_set1_ps(a.ds[i]), acc[m]);
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
        let formats = [
            (QType::Q8_0, GgmlDType::Q8_0),
            (QType::Q5_0, GgmlDType::Q5_0),
            (QType::Q4_1, GgmlDType::Q4_1),
        ];
        // 40 rows: two whole groups and a padded one.
        let (rows, cols) = (40, 96);
        for (ty, g) in formats {
            let (m, w) = matrix(ty, g, rows, cols);
            let p = m.pack().expect("packs");
            // The same weights, bit for bit, in about the file's bytes.
            assert_eq!(
                p.dequantize_rows(3..rows).expect("dequantize"),
                m.dequantize_rows(3..rows).expect("dequantize"),
                "{ty:?}"
            );
            assert!(p.dequantize_rows(0..rows + 1).is_err());
            // Padding to 48 rows and an f16 offset per block: at most 10% more than the file.
            let file = rows * cols / ty.block_len() * ty.block_bytes();
            assert!(
                p.nbytes() * 40 <= file * 48 * 11 / 10,
                "{ty:?}: {} vs {file}",
                p.nbytes()
            );
            for n in [1, 3, 8, 13] {
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
                for isa in [Isa::Portable, Isa::Avx512Vnni] {
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
                // Both ISAs perform the same operations.
                assert_eq!(
                    p.matmul_on(Isa::Portable, &x, n).expect("portable"),
                    p.matmul_on(Isa::Avx512Vnni, &x, n).expect("vnni"),
                    "{ty:?} n={n}"
                );
            }
        }
    }

    #[test]
    fn k_quants_do_not_pack_and_shapes_are_checked() {
        let (m, _) = matrix(QType::Q4K, GgmlDType::Q4K, 16, 256);
        assert!(m.pack().is_none());
        let (m, _) = matrix(QType::Q8_0, GgmlDType::Q8_0, 16, 64);
        let p = m.pack().expect("packs");
        assert!(p.matmul(&[0.0; 63], 1).is_err());
        assert!(p.matmul(&[], 0).expect("empty").is_empty());
    }
}
