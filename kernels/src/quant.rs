//! Matrix products on GGUF's quantized weight blocks, without dequantizing them to f32.
//!
//! A [`QMatrix`] keeps a weight matrix in the file's own block format (Q8_0, Q5_0, Q4_1, Q4_K,
//! Q6_K: what the default models hold), so it costs what the file costs in memory and decode
//! reads ~5-6.5 bits per weight instead of 32. Activations are quantized per row to 8-bit
//! blocks of 32 (scale `d = max|x| / 127`, as llama.cpp's Q8_0), and every product is an
//! integer dot product of the block's unsigned quants `u` with the activation quants, scaled
//! per 16 or 32 weights: a weight is `s·u + o` for a per-block (or per-half-block) scale `s` and
//! offset `o`, so
//!
//! `Σ w·x ≈ Σ_blocks d_x · (s · Σ u·q_x + o · Σ q_x)`.
//!
//! Two implementations of the same arithmetic: AVX-512 VNNI (`vpdpbusd` on 256-bit vectors,
//! chosen at run time when the CPU has it) and a portable one, which on a CPU with AVX2 (and no
//! VNNI) runs as 256-bit integer kernels giving the portable values bit for bit (`avx2`: 4-7x
//! the portable decode speed). Either way each output element
//! is computed by the same sequence of operations whatever the number of rows or threads, so a
//! row's result never depends on which other rows were in the batch (lossless verification of
//! several drafted tokens in one pass relies on that).

use crate::error::{shape_err, Result};
use rayon::prelude::*;
use std::sync::Arc;

mod packed;
pub use packed::PackedMatrix;

/// The bytes of a matrix's blocks, shared with whoever owns them (a loaded file's tensor).
pub type Blocks = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// A GGUF block format this module computes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QType {
    /// 32 signed 8-bit quants and an f16 scale (34 bytes).
    Q8_0,
    /// 32 5-bit quants (offset 16) and an f16 scale (22 bytes).
    Q5_0,
    /// 32 4-bit quants, an f16 scale and an f16 minimum (20 bytes).
    Q4_1,
    /// 256 4-bit quants in 8 sub-blocks with 6-bit scales and minimums (144 bytes).
    Q4K,
    /// 256 6-bit quants (offset 32) in 16 sub-blocks with 8-bit scales (210 bytes).
    Q6K,
}

impl QType {
    /// Every type, for tests and listings.
    pub const ALL: [QType; 5] = [
        QType::Q8_0,
        QType::Q5_0,
        QType::Q4_1,
        QType::Q4K,
        QType::Q6K,
    ];

    /// Weights per block.
    pub const fn block_len(self) -> usize {
        match self {
            QType::Q8_0 | QType::Q5_0 | QType::Q4_1 => 32,
            QType::Q4K | QType::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            QType::Q8_0 => 34,
            QType::Q5_0 => 22,
            QType::Q4_1 => 20,
            QType::Q4K => 144,
            QType::Q6K => 210,
        }
    }
}

/// Which implementation a product runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust; runs anywhere.
    Portable,
    /// AVX-512 VNNI + VL + BW with FMA and F16C (Ice Lake / Sapphire Rapids / Zen 4 and later).
    Avx512Vnni,
    /// AVX2 with FMA and F16C, no AVX-512 VNNI (Haswell to Comet Lake, Zen 1-3): the int8
    /// products as `vpmaddubsw` pairs, giving the same values as the other two.
    Avx2,
}

impl Isa {
    /// The best implementation this CPU runs.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512vnni")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                return Isa::Avx512Vnni;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// [`Isa::detect`], computed once.
    pub fn best() -> Isa {
        static BEST: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *BEST.get_or_init(Isa::detect)
    }
}

/// A `(rows, cols)` weight matrix in a GGUF block format: `rows` output features, each a run of
/// `cols / block_len` blocks (GGUF's row-major layout).
#[derive(Clone)]
pub struct QMatrix {
    ty: QType,
    rows: usize,
    cols: usize,
    data: Blocks,
}

impl std::fmt::Debug for QMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QMatrix")
            .field("ty", &self.ty)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish_non_exhaustive()
    }
}

/// A matrix's bytes and row length, for indexing rows in hot loops.
#[derive(Clone, Copy)]
struct RowView<'a> {
    data: &'a [u8],
    row_bytes: usize,
}

impl<'a> RowView<'a> {
    fn row(self, j: usize) -> &'a [u8] {
        &self.data[j * self.row_bytes..(j + 1) * self.row_bytes]
    }
}

impl QMatrix {
    /// Wraps the raw blocks of a `(rows, cols)` matrix (shared, not copied).
    pub fn new(ty: QType, rows: usize, cols: usize, data: Blocks) -> Result<Self> {
        if rows == 0 || cols == 0 || !cols.is_multiple_of(ty.block_len()) {
            return Err(shape_err(
                "qmatrix",
                format!(
                    "{rows}x{cols} is not whole {ty:?} blocks of {}",
                    ty.block_len()
                ),
            ));
        }
        let want = rows * cols / ty.block_len() * ty.block_bytes();
        let len = (*data).as_ref().len();
        if len != want {
            return Err(shape_err(
                "qmatrix",
                format!("{len} bytes for a {rows}x{cols} {ty:?} matrix ({want} expected)"),
            ));
        }
        Ok(Self {
            ty,
            rows,
            cols,
            data,
        })
    }

    /// Block format.
    pub fn qtype(&self) -> QType {
        self.ty
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held (the file's size of this tensor).
    pub fn nbytes(&self) -> usize {
        self.bytes().len()
    }

    fn bytes(&self) -> &[u8] {
        (*self.data).as_ref()
    }

    fn row_bytes(&self) -> usize {
        self.cols / self.ty.block_len() * self.ty.block_bytes()
    }

    /// The blocks resolved once, for loops over rows (`Blocks::as_ref` is a dynamic call that
    /// cost ~10% of decode when made per row).
    fn view(&self) -> RowView<'_> {
        RowView {
            data: self.bytes(),
            row_bytes: self.row_bytes(),
        }
    }

    /// Dequantized rows `range` as `(range.len(), cols)` f32 values.
    pub fn dequantize_rows(&self, range: std::ops::Range<usize>) -> Result<Vec<f32>> {
        if range.start > range.end || range.end > self.rows {
            return Err(shape_err(
                "qmatrix",
                format!("rows {range:?} of {}", self.rows),
            ));
        }
        let mut out = vec![0f32; range.len() * self.cols];
        self.dequantize_into(Isa::best(), range, &mut out);
        Ok(out)
    }

    /// Rows `range` (in bounds) dequantized into `out` (`range.len() * cols` values).
    fn dequantize_into(&self, isa: Isa, range: std::ops::Range<usize>, out: &mut [f32]) {
        let view = self.view();
        for (j, dst) in range.zip(out.chunks_exact_mut(self.cols)) {
            let row = view.row(j);
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512Vnni if Isa::best() == Isa::Avx512Vnni => {
                    // SAFETY: the CPU has the features (checked on the line above).
                    unsafe { vnni::dequantize_row(self.ty, row, dst) }
                }
                _ => portable::dequantize_row(self.ty, row, dst),
            }
        }
    }

    /// `y = x Wᵀ` in f32 for many rows: weight rows are dequantized a panel at a time into a
    /// per-thread buffer that stays in cache and multiplied with the `gemm` crate's dense
    /// kernels. Prefill speed of dense weights without keeping a dense copy (~4x the file).
    pub fn matmul_dense(&self, x: &[f32], n: usize) -> Result<Vec<f32>> {
        check_rows("qmatmul", x, n, self.cols)?;
        let mut out = vec![0f32; n * self.rows];
        if n == 0 {
            return Ok(out);
        }
        // Few, large panels: GEMM packs the activations once per panel, which costs more than
        // the panel's trip through L3 (measured: 73-row panels ran 0.72x the speed of dense
        // copies at 1024 rows). Two panels per thread at least, at most 4 MiB of f32 each.
        let threads = rayon::current_num_threads().max(1);
        let panels = (2 * threads).max((self.rows * self.cols).div_ceil(1 << 20));
        let panel = self
            .rows
            .div_ceil(panels)
            .next_multiple_of(16)
            .min(self.rows);
        let dst = SharedOut(out.as_mut_ptr());
        let panels = self.rows.div_ceil(panel);
        (0..panels).into_par_iter().for_each_init(
            || vec![0f32; panel * self.cols],
            |buf, p| {
                let j0 = p * panel;
                let rows = panel.min(self.rows - j0);
                let w = &mut buf[..rows * self.cols];
                self.dequantize_into(Isa::best(), j0..j0 + rows, w);
                let dst = &dst;
                // SAFETY: `dst` points at the `(n, self.rows)` output; this panel writes its
                // columns j0..j0 + rows of every row, which no other panel touches. `x` holds
                // `n` rows of `cols` values and `w` `rows` rows of `cols` values (checked
                // above), read as the transposed right-hand side `(cols, rows)`.
                unsafe {
                    gemm::gemm(
                        n,
                        rows,
                        self.cols,
                        dst.0.add(j0),
                        1,
                        self.rows as isize,
                        false,
                        x.as_ptr(),
                        1,
                        self.cols as isize,
                        w.as_ptr(),
                        self.cols as isize,
                        1,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
            },
        );
        Ok(out)
    }

    /// `y = x Wᵀ` for `n` rows `x` `(n, cols)`: returns `(n, rows)`, on the best ISA.
    pub fn matmul(&self, x: &[f32], n: usize) -> Result<Vec<f32>> {
        self.matmul_on(Isa::best(), x, n)
    }

    /// [`QMatrix::matmul`] on a chosen implementation (tests compare them).
    pub fn matmul_on(&self, isa: Isa, x: &[f32], n: usize) -> Result<Vec<f32>> {
        check_rows("qmatmul", x, n, self.cols)?;
        let isa = if isa == Isa::Avx512Vnni && Isa::best() != Isa::Avx512Vnni {
            Isa::Portable
        } else {
            isa
        };
        if n == 0 {
            return Ok(Vec::new());
        }
        let acts = Acts::quantize(x, n, self.cols);
        // Output features in chunks, each task writing its own `(chunk, n)` block of the
        // transposed output; sized so both cores get several tasks even for decode.
        let chunk = (self.rows / 16).clamp(8, 64);
        let mut out_t = vec![0f32; self.rows * n];
        out_t
            .par_chunks_mut(chunk * n)
            .enumerate()
            .for_each(|(c, dst)| {
                let j0 = c * chunk;
                let js = j0..j0 + dst.len() / n;
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512Vnni => {
                        // SAFETY: `Isa::best()` confirmed the CPU features this path needs.
                        unsafe { vnni::rows(self, js, &acts, dst) }
                    }
                    _ => portable::rows(self, js, &acts, dst),
                }
            });
        if n == 1 {
            return Ok(out_t);
        }
        let mut out = vec![0f32; n * self.rows];
        for (j, col) in out_t.chunks_exact(n).enumerate() {
            for (r, &v) in col.iter().enumerate() {
                out[r * self.rows + j] = v;
            }
        }
        Ok(out)
    }
}

/// The output of [`QMatrix::matmul_dense`], written by several panels at disjoint columns.
struct SharedOut(*mut f32);
// SAFETY: panels write disjoint columns of the output (see `matmul_dense`).
unsafe impl Sync for SharedOut {}
// SAFETY: as above; the pointer outlives the parallel loop that uses it.
unsafe impl Send for SharedOut {}

/// Activation rows quantized to 8-bit blocks of 32.
struct Acts {
    n: usize,
    cols: usize,
    /// `(n, cols)` quants.
    q: Vec<i8>,
    /// One scale per block of 32.
    d: Vec<f32>,
    /// `d · Σ q` per half-block of 16: what a weight offset multiplies.
    ds: Vec<f32>,
    /// `d` per half-block of 16 (each block's scale twice), for vector loads.
    dh: Vec<f32>,
}

impl Acts {
    fn quantize(x: &[f32], n: usize, cols: usize) -> Self {
        let blocks = n * cols / 32;
        let mut q = vec![0i8; n * cols];
        let mut d = vec![0f32; blocks];
        let mut ds = vec![0f32; blocks * 2];
        let mut dh = vec![0f32; blocks * 2];
        for (b, (xb, qb)) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).enumerate() {
            let scale = quantize_block(xb, qb);
            d[b] = scale;
            dh[b * 2] = scale;
            dh[b * 2 + 1] = scale;
            for h in 0..2 {
                let s: i32 = qb[h * 16..h * 16 + 16].iter().map(|&v| i32::from(v)).sum();
                ds[b * 2 + h] = scale * s as f32;
            }
        }
        Self {
            n,
            cols,
            q,
            d,
            ds,
            dh,
        }
    }

    fn row(&self, r: usize) -> &[i8] {
        &self.q[r * self.cols..(r + 1) * self.cols]
    }
}

/// One sub-block of 32 weights unpacked: `w[i] = s[i / 16] · u[i] + o[i / 16]`.
struct Sub {
    u: [u8; 32],
    s: [f32; 2],
    o: [f32; 2],
}

/// One block of 32 activations to int8: `round(v / d)` with `d = max |v| / 127`, rounded half
/// away from zero and clamped to ±127 (NaN to 0), as `(v * inv).round().clamp(..) as i8`;
/// returns `d`. Written so that it vectorizes on baseline x86-64 (`round` and saturating casts
/// are a libm call or a branch per value there: ~8% of a 2048-token prefill).
#[inline(always)]
fn quantize_block(xb: &[f32], qb: &mut [i8]) -> f32 {
    let (xb, qb): (&[f32; 32], &mut [i8; 32]) = (
        xb.try_into().expect("blocks of 32"),
        qb.try_into().expect("blocks of 32"),
    );
    let mut m = [0f32; 8];
    for c in xb.chunks_exact(8) {
        for (m, v) in m.iter_mut().zip(c) {
            *m = m.max(v.abs());
        }
    }
    let amax = m.iter().fold(0f32, |a, &b| a.max(b));
    let scale = amax / 127.0;
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    for (dst, &v) in qb.iter_mut().zip(xb) {
        *dst = quantize_value(v * inv);
    }
    scale
}

/// `y.round().clamp(-127.0, 127.0) as i8` from a truncation and the exact fraction `y - trunc
/// y`; clamping first changes nothing (every value past ±127 rounds to at least ±127).
#[inline(always)]
fn quantize_value(y: f32) -> i8 {
    #[allow(clippy::eq_op)] // NaN test that vectorizes as one compare
    let y = if y == y { y.clamp(-127.0, 127.0) } else { 0.0 };
    // SAFETY: `y` is finite and within ±127, so the truncation is representable.
    let t: i32 = unsafe { y.to_int_unchecked() };
    let f = y - t as f32;
    (t + i32::from(f >= 0.5) - i32::from(f <= -0.5)) as i8
}

#[inline(always)]
fn f16(bytes: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

/// Scale and minimum of Q4_K sub-block `j` from its 12 packed bytes (6 bits each).
#[inline(always)]
fn q4k_scale_min(sc: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (sc[j] & 63, sc[j + 4] & 63)
    } else {
        (
            (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4),
            (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4),
        )
    }
}

/// That `x` holds `n` rows of `cols` values (the input of a product).
fn check_rows(op: &'static str, x: &[f32], n: usize, cols: usize) -> Result<()> {
    if x.len() == n * cols {
        Ok(())
    } else {
        Err(shape_err(
            op,
            format!("{} values for {n} rows of {cols} columns", x.len()),
        ))
    }
}

/// Where sub-block `s` (of 32) of a row starts: its block's bytes and its index in the block.
#[inline(always)]
fn locate(ty: QType, row: &[u8], s: usize) -> (&[u8], usize) {
    let per = ty.block_len() / 32;
    let b = s / per;
    let bb = ty.block_bytes();
    (&row[b * bb..(b + 1) * bb], s % per)
}

mod portable {
    use super::*;

    /// Sub-block `s` of a row, unpacked (the reference the SIMD unpacking is tested against).
    #[inline(always)]
    pub(super) fn unpack(ty: QType, row: &[u8], s: usize) -> Sub {
        let (blk, k) = locate(ty, row, s);
        let mut u = [0u8; 32];
        match ty {
            QType::Q8_0 => {
                let d = f16(blk, 0);
                for (i, dst) in u.iter_mut().enumerate() {
                    *dst = blk[2 + i] ^ 0x80;
                }
                Sub {
                    u,
                    s: [d; 2],
                    o: [-128.0 * d; 2],
                }
            }
            QType::Q5_0 => {
                let d = f16(blk, 0);
                let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                for (i, dst) in u.iter_mut().enumerate() {
                    let nib = if i < 16 {
                        blk[6 + i] & 0xF
                    } else {
                        blk[6 + i - 16] >> 4
                    };
                    *dst = nib | ((((qh >> i) & 1) as u8) << 4);
                }
                Sub {
                    u,
                    s: [d; 2],
                    o: [-16.0 * d; 2],
                }
            }
            QType::Q4_1 => {
                let (d, m) = (f16(blk, 0), f16(blk, 2));
                for (i, dst) in u.iter_mut().enumerate() {
                    *dst = if i < 16 {
                        blk[4 + i] & 0xF
                    } else {
                        blk[4 + i - 16] >> 4
                    };
                }
                Sub {
                    u,
                    s: [d; 2],
                    o: [m; 2],
                }
            }
            QType::Q4K => {
                let (d, dmin) = (f16(blk, 0), f16(blk, 2));
                let (sc, m) = q4k_scale_min(&blk[4..16], k);
                let qs = &blk[16 + 32 * (k / 2)..16 + 32 * (k / 2) + 32];
                for (dst, &q) in u.iter_mut().zip(qs) {
                    *dst = if k % 2 == 0 { q & 0xF } else { q >> 4 };
                }
                let (s, o) = (d * f32::from(sc), -dmin * f32::from(m));
                Sub {
                    u,
                    s: [s; 2],
                    o: [o; 2],
                }
            }
            QType::Q6K => {
                // Sub-block k = 4·half + quarter of the 256: quants from ql (nibbles) and qh
                // (2-bit pairs), scales per 16.
                let (half, quarter) = (k / 4, k % 4);
                let ql = &blk[64 * half + 32 * (quarter % 2)..][..32];
                let qh = &blk[128 + 32 * half..][..32];
                let d = f16(blk, 208);
                for (l, dst) in u.iter_mut().enumerate() {
                    let lo = if quarter < 2 { ql[l] & 0xF } else { ql[l] >> 4 };
                    *dst = lo | (((qh[l] >> (2 * quarter)) & 3) << 4);
                }
                let sc = |h: usize| f32::from(blk[192 + 8 * half + 2 * quarter + h] as i8);
                let s = [d * sc(0), d * sc(1)];
                Sub {
                    u,
                    s,
                    o: [-32.0 * s[0], -32.0 * s[1]],
                }
            }
        }
    }

    /// One row dequantized: on AVX2 by [`avx2`](super::avx2) where the CPU has it (the same
    /// operations, so the same values), else by [`dequantize_row_on`].
    pub(super) fn dequantize_row(ty: QType, row: &[u8], dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if super::avx2::available() {
            // SAFETY: the CPU has the features (checked above).
            return unsafe { super::avx2::dequantize_row(ty, row, dst) };
        }
        dequantize_row_on(ty, row, dst);
    }

    /// Output features `js` for every activation row: on AVX2 by [`avx2`](super::avx2) where
    /// the CPU has it (the same integer dots and the same float operations in the same order,
    /// so the same values), else by [`rows_on`].
    pub(super) fn rows(m: &QMatrix, js: std::ops::Range<usize>, acts: &Acts, dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if super::avx2::available() {
            // SAFETY: the CPU has the features (checked above).
            return unsafe { super::avx2::rows(m, js, acts, dst) };
        }
        rows_on(m, js, acts, dst);
    }

    pub(super) fn dequantize_row_on(ty: QType, row: &[u8], dst: &mut [f32]) {
        for (s, dst) in dst.chunks_exact_mut(32).enumerate() {
            let sub = unpack(ty, row, s);
            for (i, d) in dst.iter_mut().enumerate() {
                let h = i / 16;
                *d = sub.s[h] * f32::from(sub.u[i]) + sub.o[h];
            }
        }
    }

    pub(super) fn rows_on(m: &QMatrix, js: std::ops::Range<usize>, acts: &Acts, dst: &mut [f32]) {
        let subs = m.cols / 32;
        let view = m.view();
        for (jj, j) in js.enumerate() {
            let row = view.row(j);
            let mut acc = vec![0f32; acts.n];
            for s in 0..subs {
                let sub = unpack(m.ty, row, s);
                for (r, a) in acc.iter_mut().enumerate() {
                    let xq = &acts.row(r)[s * 32..s * 32 + 32];
                    let b = r * subs + s;
                    for h in 0..2 {
                        let dot: i32 = (h * 16..h * 16 + 16)
                            .map(|i| i32::from(sub.u[i]) * i32::from(xq[i]))
                            .sum();
                        *a += acts.d[b] * sub.s[h] * dot as f32 + sub.o[h] * acts.ds[b * 2 + h];
                    }
                }
            }
            dst[jj * acts.n..(jj + 1) * acts.n].copy_from_slice(&acc);
        }
    }
}

/// `f::<T>(args)` for the block format `ty` as the const `T` the x86 kernels are monomorphized
/// on.
#[cfg(target_arch = "x86_64")]
macro_rules! per_format {
    ($ty:expr, $($f:ident)::+, $($arg:expr),*) => {{
        use $crate::quant::x86::{Q4K, Q4_1, Q5_0, Q6K, Q8_0};
        match $ty {
            QType::Q8_0 => $($f)::+::<Q8_0>($($arg),*),
            QType::Q5_0 => $($f)::+::<Q5_0>($($arg),*),
            QType::Q4_1 => $($f)::+::<Q4_1>($($arg),*),
            QType::Q4K => $($f)::+::<Q4K>($($arg),*),
            QType::Q6K => $($f)::+::<Q6K>($($arg),*),
        }
    }};
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! What the AVX-512 VNNI and the AVX2 kernels share: unpacking a sub-block of 32 weights
    //! into a vector of unsigned quants with its scales and offsets (AVX2 and F16C), the same
    //! values as [`portable::unpack`](super::portable). Every helper is `#[inline(always)]`
    //! without features of its own, so it compiles inside the `#[target_feature]` kernel that
    //! calls it.
    use super::*;
    use std::arch::x86_64::*;

    pub(super) const Q8_0: u8 = 0;
    pub(super) const Q5_0: u8 = 1;
    pub(super) const Q4_1: u8 = 2;
    pub(super) const Q4K: u8 = 3;
    pub(super) const Q6K: u8 = 4;

    /// # Safety
    /// F16C must be available.
    #[inline(always)]
    pub(super) unsafe fn f16(bytes: &[u8], at: usize) -> f32 {
        let bits = u16::from_le_bytes([bytes[at], bytes[at + 1]]);
        // SAFETY: the caller guarantees F16C.
        unsafe { _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits)))) }
    }

    /// 16 bytes of nibbles as 32 bytes: low nibbles first, then high nibbles (Q4_1's order).
    ///
    /// # Safety
    /// AVX2 must be available.
    #[inline(always)]
    unsafe fn nibbles16(p: &[u8]) -> __m256i {
        assert!(p.len() >= 16);
        // SAFETY: 16 bytes are in bounds (asserted); the caller guarantees AVX2.
        unsafe {
            let v = _mm_loadu_si128(p.as_ptr().cast());
            let m = _mm_set1_epi8(0x0F);
            _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m))
        }
    }

    /// # Safety
    /// AVX2 must be available.
    #[inline(always)]
    unsafe fn load32(p: &[u8]) -> __m256i {
        assert!(p.len() >= 32);
        // SAFETY: 32 bytes are in bounds (asserted); the caller guarantees AVX2.
        unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
    }

    /// Sub-block `s` of a row of format `T`: unsigned quants in a vector, scales and offsets
    /// per half.
    ///
    /// # Safety
    /// AVX2 and F16C must be available.
    #[inline(always)]
    pub(super) unsafe fn unpack<const T: u8>(
        row: &[u8],
        s: usize,
    ) -> (__m256i, [f32; 2], [f32; 2]) {
        // SAFETY: the caller guarantees AVX2 and F16C.
        unsafe {
            let low = _mm256_set1_epi8(0x0F);
            match T {
                Q8_0 => {
                    let blk = &row[s * 34..s * 34 + 34];
                    let d = f16(blk, 0);
                    let u = _mm256_xor_si256(load32(&blk[2..]), _mm256_set1_epi8(-128));
                    (u, [d; 2], [-128.0 * d; 2])
                }
                Q5_0 => {
                    let blk = &row[s * 22..s * 22 + 22];
                    let d = f16(blk, 0);
                    let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                    let hi = _mm256_and_si256(bits32(qh), _mm256_set1_epi8(0x10));
                    let u = _mm256_or_si256(nibbles16(&blk[6..]), hi);
                    (u, [d; 2], [-16.0 * d; 2])
                }
                Q4_1 => {
                    let blk = &row[s * 20..s * 20 + 20];
                    let (d, m) = (f16(blk, 0), f16(blk, 2));
                    (nibbles16(&blk[4..]), [d; 2], [m; 2])
                }
                Q4K => {
                    let (b, k) = (s / 8, s % 8);
                    let blk = &row[b * 144..b * 144 + 144];
                    let (d, dmin) = (f16(blk, 0), f16(blk, 2));
                    let (sc, m) = q4k_scale_min(&blk[4..16], k);
                    let q = load32(&blk[16 + 32 * (k / 2)..]);
                    let u = if k % 2 == 0 {
                        _mm256_and_si256(q, low)
                    } else {
                        _mm256_and_si256(_mm256_srli_epi16(q, 4), low)
                    };
                    let (s, o) = (d * f32::from(sc), -dmin * f32::from(m));
                    (u, [s; 2], [o; 2])
                }
                _ => {
                    let (b, k) = (s / 8, s % 8);
                    let blk = &row[b * 210..b * 210 + 210];
                    let (half, quarter) = (k / 4, k % 4);
                    let ql = load32(&blk[64 * half + 32 * (quarter % 2)..]);
                    let qh = load32(&blk[128 + 32 * half..]);
                    let lo = if quarter < 2 {
                        _mm256_and_si256(ql, low)
                    } else {
                        _mm256_and_si256(_mm256_srli_epi16(ql, 4), low)
                    };
                    let hi = match quarter {
                        0 => qh,
                        1 => _mm256_srli_epi16(qh, 2),
                        2 => _mm256_srli_epi16(qh, 4),
                        _ => _mm256_srli_epi16(qh, 6),
                    };
                    let hi = _mm256_slli_epi16(_mm256_and_si256(hi, _mm256_set1_epi8(3)), 4);
                    let d = f16(blk, 208);
                    let sc = |h: usize| f32::from(blk[192 + 8 * half + 2 * quarter + h] as i8);
                    let s = [d * sc(0), d * sc(1)];
                    (_mm256_or_si256(lo, hi), s, [-32.0 * s[0], -32.0 * s[1]])
                }
            }
        }
    }

    /// Bit `i` of `bits` as byte `i` of a vector: 0xFF where set, 0 where not.
    ///
    /// # Safety
    /// AVX2 must be available.
    #[inline(always)]
    unsafe fn bits32(bits: u32) -> __m256i {
        // SAFETY: the caller guarantees AVX2.
        unsafe {
            // Byte i takes byte i / 8 of `bits`, then keeps only bit i % 8 of it.
            let v = _mm256_shuffle_epi8(
                _mm256_set1_epi32(bits as i32),
                _mm256_set_epi64x(
                    0x0303_0303_0303_0303,
                    0x0202_0202_0202_0202,
                    0x0101_0101_0101_0101,
                    0,
                ),
            );
            let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe_u64 as i64);
            _mm256_cmpeq_epi8(_mm256_or_si256(v, others), _mm256_set1_epi8(-1))
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! The portable products on 256-bit integer vectors, for CPUs with AVX2 but without
    //! AVX-512 VNNI: the same unpacked quants ([`x86::unpack`](super::x86)), the same exact
    //! integer dot per half sub-block (`vpmaddubsw` pairs, exact for quants below 128; Q8_0's
    //! signed quants through their sign), then the same float operations in the same order as
    //! [`portable::rows_on`](super::portable), so every value equals the portable one.
    use super::x86::*;
    use super::*;
    use std::arch::x86_64::*;

    /// Whether this CPU runs these kernels (AVX2 and F16C), computed once.
    pub(super) fn available() -> bool {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("f16c")
        })
    }

    /// # Safety
    /// The CPU must have AVX2 and F16C ([`available`]).
    pub(super) unsafe fn dequantize_row(ty: QType, row: &[u8], dst: &mut [f32]) {
        // SAFETY: the caller guarantees the features.
        unsafe { per_format!(ty, dequantize_row_of, row, dst) }
    }

    /// `s·u + o` per weight: a multiply, then an add, as the portable path rounds.
    #[target_feature(enable = "avx2,f16c")]
    fn dequantize_row_of<const T: u8>(row: &[u8], dst: &mut [f32]) {
        for (s, out) in dst.chunks_exact_mut(32).enumerate() {
            // SAFETY: this function's features are those `unpack` needs.
            let (u, sc, o) = unsafe { unpack::<T>(row, s) };
            let mut bytes = [0u8; 32];
            // SAFETY: 32 bytes of destination; unaligned store.
            unsafe { _mm256_storeu_si256(bytes.as_mut_ptr().cast(), u) };
            for (e, dst) in out.chunks_exact_mut(8).enumerate() {
                let h = e / 2;
                // SAFETY: 8 bytes of source and 8 floats of destination; unaligned.
                unsafe {
                    let q = _mm_loadl_epi64(bytes[8 * e..].as_ptr().cast());
                    let v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
                    let w = _mm256_add_ps(
                        _mm256_mul_ps(_mm256_set1_ps(sc[h]), v),
                        _mm256_set1_ps(o[h]),
                    );
                    _mm256_storeu_ps(dst.as_mut_ptr(), w);
                }
            }
        }
    }

    /// # Safety
    /// The CPU must have AVX2 and F16C ([`available`]).
    pub(super) unsafe fn rows(
        m: &QMatrix,
        js: std::ops::Range<usize>,
        acts: &Acts,
        dst: &mut [f32],
    ) {
        // SAFETY: the caller guarantees the features.
        unsafe { per_format!(m.ty, rows_of, m, js, acts, dst) }
    }

    /// `Σ u·x` over each half (16 quants) of a sub-block, exactly.
    #[inline(always)]
    unsafe fn dots<const T: u8>(u: __m256i, x: __m256i) -> [i32; 2] {
        // SAFETY: the caller guarantees AVX2.
        unsafe {
            let ones = _mm256_set1_epi16(1);
            let per4 = if T == Q8_0 {
                // u = w + 128 for the signed quant w: Σ u·x = Σ w·x + 128 Σ x, with
                // |w| · sign(w)·x in pairs below 2·128·127.
                let w = _mm256_xor_si256(u, _mm256_set1_epi8(-128));
                let wx = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
                let sx = _mm256_maddubs_epi16(_mm256_set1_epi8(1), x);
                _mm256_add_epi32(
                    _mm256_madd_epi16(wx, ones),
                    _mm256_slli_epi32(_mm256_madd_epi16(sx, ones), 7),
                )
            } else {
                // Quants below 64: every pair sum stays below 2·63·127.
                _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones)
            };
            let (lo, hi) = (
                _mm256_castsi256_si128(per4),
                _mm256_extracti128_si256(per4, 1),
            );
            let s = _mm_hadd_epi32(lo, hi);
            let s = _mm_hadd_epi32(s, s);
            [_mm_cvtsi128_si32(s), _mm_extract_epi32(s, 1)]
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    fn rows_of<const T: u8>(m: &QMatrix, js: std::ops::Range<usize>, acts: &Acts, dst: &mut [f32]) {
        let subs = m.cols / 32;
        let view = m.view();
        for (jj, j) in js.enumerate() {
            let row = view.row(j);
            let acc = &mut dst[jj * acts.n..(jj + 1) * acts.n];
            acc.fill(0.0);
            for s in 0..subs {
                // SAFETY: this function's features are those `unpack` and `dots` need.
                let (u, sc, o) = unsafe { unpack::<T>(row, s) };
                for (r, a) in acc.iter_mut().enumerate() {
                    let xq = &acts.row(r)[s * 32..s * 32 + 32];
                    // SAFETY: 32 bytes of source; unaligned load; features as above.
                    let dot = unsafe { dots::<T>(u, _mm256_loadu_si256(xq.as_ptr().cast())) };
                    let b = r * subs + s;
                    for h in 0..2 {
                        *a += acts.d[b] * sc[h] * dot[h] as f32 + o[h] * acts.ds[b * 2 + h];
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    //! Helpers are `#[inline(always)]` without features of their own, so they compile inside
    //! the `#[target_feature]` kernel they are called from; each kernel is monomorphized per
    //! block format (`T`) and tile height (`R`), which leaves no branch in the inner loop.
    use super::*;
    use std::arch::x86_64::*;

    /// Activation rows per tile: each keeps one 8-lane accumulator in a register.
    const TILE: usize = 8;

    use super::x86::*;

    /// One row dequantized (`s·u + o`, multiply then add, as the portable path rounds).
    ///
    /// # Safety
    /// The CPU must have the features of [`Isa::Avx512Vnni`].
    pub(super) unsafe fn dequantize_row(ty: QType, row: &[u8], dst: &mut [f32]) {
        // SAFETY: the caller guarantees the features.
        unsafe { per_format!(ty, dequantize_row_of, row, dst) }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    fn dequantize_row_of<const T: u8>(row: &[u8], dst: &mut [f32]) {
        for (s, out) in dst.chunks_exact_mut(32).enumerate() {
            // SAFETY: this function's features are those `unpack` needs.
            let (u, sc, o) = unsafe { unpack::<T>(row, s) };
            let halves = [_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)];
            for (h, q) in halves.into_iter().enumerate() {
                let v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
                let w = _mm512_add_ps(
                    _mm512_mul_ps(v, _mm512_set1_ps(sc[h])),
                    _mm512_set1_ps(o[h]),
                );
                let dst = &mut out[16 * h..16 * h + 16];
                // SAFETY: 16 floats of destination; unaligned store.
                unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), w) };
            }
        }
    }

    /// Output features `js` for every activation row; `dst` is `(js.len(), n)`.
    ///
    /// # Safety
    /// The CPU must have the features of [`Isa::Avx512Vnni`].
    pub(super) unsafe fn rows(
        m: &QMatrix,
        js: std::ops::Range<usize>,
        acts: &Acts,
        dst: &mut [f32],
    ) {
        // SAFETY: the caller guarantees the features.
        unsafe { per_format!(m.ty, rows_of, m, js, acts, dst) }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    fn rows_of<const T: u8>(m: &QMatrix, js: std::ops::Range<usize>, acts: &Acts, dst: &mut [f32]) {
        let n = acts.n;
        let view = m.view();
        let mut r0 = 0;
        while r0 < n {
            let t = (n - r0).min(TILE);
            for (jj, j) in js.clone().enumerate() {
                let out = &mut dst[jj * n + r0..jj * n + r0 + t];
                let row = view.row(j);
                match t {
                    8 => tile::<T, 8>(row, acts, r0, out),
                    4..=7 => {
                        tile::<T, 4>(row, acts, r0, &mut out[..4]);
                        for r in 4..t {
                            tile::<T, 1>(row, acts, r0 + r, &mut out[r..r + 1]);
                        }
                    }
                    _ => {
                        for r in 0..t {
                            tile::<T, 1>(row, acts, r0 + r, &mut out[r..r + 1]);
                        }
                    }
                }
            }
            r0 += t;
        }
    }

    /// One weight row against activation rows `r0..r0 + R`: sub-blocks two at a time in
    /// 512-bit vectors (the last one alone when their count is odd).
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    fn tile<const T: u8, const R: usize>(row: &[u8], acts: &Acts, r0: usize, out: &mut [f32]) {
        let subs = acts.cols / 32;
        let mut acc = [_mm512_setzero_ps(); R];
        let mut off = [_mm_setzero_ps(); R];
        let xs: [&[i8]; R] = std::array::from_fn(|r| acts.row(r0 + r));
        let dh: [&[f32]; R] = std::array::from_fn(|r| &acts.dh[(r0 + r) * subs * 2..][..subs * 2]);
        let ds: [&[f32]; R] = std::array::from_fn(|r| &acts.ds[(r0 + r) * subs * 2..][..subs * 2]);
        // Lane i of a 512-bit dot holds 4 products of half-block i / 4.
        let spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        let mut s = 0;
        while s + 2 <= subs {
            // SAFETY: this function's features are those `unpack` needs.
            let ((ua, sa, oa), (ub, sb, ob)) =
                unsafe { (unpack::<T>(row, s), unpack::<T>(row, s + 1)) };
            let u = _mm512_inserti64x4(_mm512_castsi256_si512(ua), ub, 1);
            let sw = _mm_set_ps(sb[1], sb[0], sa[1], sa[0]);
            let ow = _mm_set_ps(ob[1], ob[0], oa[1], oa[0]);
            for r in 0..R {
                let xq = &xs[r][s * 32..s * 32 + 64];
                let (dq, dsq) = (&dh[r][2 * s..2 * s + 4], &ds[r][2 * s..2 * s + 4]);
                // SAFETY: the slices hold 64 bytes and 4 floats; unaligned loads.
                let (x, d4, s4) = unsafe {
                    (
                        _mm512_loadu_si512(xq.as_ptr().cast()),
                        _mm_loadu_ps(dq.as_ptr()),
                        _mm_loadu_ps(dsq.as_ptr()),
                    )
                };
                let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x);
                let scale =
                    _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(sw, d4)));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
                off[r] = _mm_fmadd_ps(ow, s4, off[r]);
            }
            s += 2;
        }
        if s < subs {
            // SAFETY: as above.
            let (u, sc, o) = unsafe { unpack::<T>(row, s) };
            let sw = _mm_set_ps(0.0, 0.0, sc[1], sc[0]);
            let ow = _mm_set_ps(0.0, 0.0, o[1], o[0]);
            for r in 0..R {
                let xq = &xs[r][s * 32..s * 32 + 32];
                let d4 = _mm_set_ps(0.0, 0.0, dh[r][2 * s + 1], dh[r][2 * s]);
                let s4 = _mm_set_ps(0.0, 0.0, ds[r][2 * s + 1], ds[r][2 * s]);
                // SAFETY: the slice holds 32 bytes; unaligned load.
                let x = unsafe { _mm256_loadu_si256(xq.as_ptr().cast()) };
                let dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
                let dot = _mm512_castsi256_si512(dot);
                let dot = _mm512_maskz_mov_epi32(0x00FF, dot);
                let scale =
                    _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(sw, d4)));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
                off[r] = _mm_fmadd_ps(ow, s4, off[r]);
            }
        }
        for r in 0..R {
            out[r] = _mm512_reduce_add_ps(acc[r]) + hsum4(off[r]);
        }
    }

    #[target_feature(enable = "avx2")]
    fn hsum4(s: __m128) -> f32 {
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// The SIMD unpacking of sub-block `s`, as plain values (tests compare it with the
    /// portable one).
    #[cfg(test)]
    pub(super) fn unpack_plain(ty: QType, row: &[u8], s: usize) -> Sub {
        assert_eq!(Isa::best(), Isa::Avx512Vnni);
        // SAFETY: the CPU has the features (asserted above).
        let (u, sc, o) = unsafe { per_format!(ty, unpack, row, s) };
        let mut bytes = [0u8; 32];
        // SAFETY: 32 bytes of destination; AVX is available (asserted above).
        unsafe { _mm256_storeu_si256(bytes.as_mut_ptr().cast(), u) };
        Sub { u: bytes, s: sc, o }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    use rand::{Rng, SeedableRng};

    #[test]
    fn quantize_value_is_round_clamp_and_cast() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut values: Vec<f32> = (0..100_000)
            .map(|_| rng.gen_range(-130.0f32..130.0))
            .collect();
        for k in -130..130 {
            let k = k as f32;
            // Ties, and the floats next to them and to the integers.
            for v in [k, k + 0.5, k - 0.5] {
                let up = f32::from_bits(v.to_bits() + 1);
                let down = f32::from_bits(v.to_bits().max(1) - 1);
                values.extend([v, up, down]);
            }
        }
        values.extend([0.499_999_97, -0.499_999_97, 1e30, -1e30, f32::INFINITY]);
        values.extend([f32::NEG_INFINITY, f32::NAN, -0.0]);
        for v in values {
            let want = v.round().clamp(-127.0, 127.0) as i8;
            assert_eq!(quantize_value(v), want, "{v:e}");
        }
    }

    fn ggml(ty: QType) -> GgmlDType {
        match ty {
            QType::Q8_0 => GgmlDType::Q8_0,
            QType::Q5_0 => GgmlDType::Q5_0,
            QType::Q4_1 => GgmlDType::Q4_1,
            QType::Q4K => GgmlDType::Q4K,
            QType::Q6K => GgmlDType::Q6K,
        }
    }

    fn random(len: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..len).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
    }

    /// A random matrix quantized by candle, as a QMatrix and candle's own dequantization.
    fn matrix(ty: QType, rows: usize, cols: usize, seed: u64) -> (QMatrix, Vec<f32>) {
        let w = Tensor::from_vec(random(rows * cols, seed), (rows, cols), &Device::Cpu)
            .expect("tensor");
        let q = QTensor::quantize(&w, ggml(ty)).expect("quantize");
        let bytes: Blocks = Arc::new(q.data().expect("data").into_owned());
        let dense = q
            .dequantize(&Device::Cpu)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .expect("dequantize");
        (QMatrix::new(ty, rows, cols, bytes).expect("qmatrix"), dense)
    }

    fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
    }

    #[test]
    fn dequantization_matches_candles_for_every_format() {
        for ty in QType::ALL {
            let (m, want) = matrix(ty, 6, 512, 1);
            let got = m.dequantize_rows(0..6).expect("rows");
            let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            let err = max_abs_diff(&got, &want);
            assert!(err <= 1e-6 * scale, "{ty:?}: {err}");
            let part = m.dequantize_rows(2..4).expect("rows");
            assert_eq!(part, got[2 * 512..4 * 512]);
        }
    }

    #[test]
    fn simd_unpacking_equals_the_portable_one() {
        if Isa::best() != Isa::Avx512Vnni {
            eprintln!("no AVX-512 VNNI here: only the portable path is tested");
            return;
        }
        for ty in QType::ALL {
            let (m, _) = matrix(ty, 3, 512, 2);
            for j in 0..3 {
                for s in 0..512 / 32 {
                    let a = portable::unpack(ty, m.view().row(j), s);
                    let b = vnni::unpack_plain(ty, m.view().row(j), s);
                    assert_eq!(a.u, b.u, "{ty:?} row {j} sub {s}");
                    assert_eq!(a.s, b.s, "{ty:?} row {j} sub {s}");
                    assert_eq!(a.o, b.o, "{ty:?} row {j} sub {s}");
                }
            }
        }
    }

    /// The AVX2 kernels give the portable values bit for bit: unpacking, dequantization and
    /// products, for every format and several row counts (Q8_0 quants at both extremes too).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_kernels_equal_the_portable_ones_bit_for_bit() {
        if !avx2::available() {
            eprintln!("no AVX2 here: only the portable path is tested");
            return;
        }
        let (rows, cols) = (9, 512);
        for ty in QType::ALL {
            let (mut m, _) = matrix(ty, rows, cols, 5);
            if ty == QType::Q8_0 {
                // Quants -128 and 127 in the first block of every row.
                let mut bytes = (*m.data).as_ref().to_vec();
                for j in 0..rows {
                    let blk = &mut bytes[j * (cols / 32) * 34..][..34];
                    blk[2] = 0x80;
                    blk[3] = 0x7F;
                }
                m = QMatrix::new(ty, rows, cols, Arc::new(bytes)).expect("qmatrix");
            }
            for j in 0..rows {
                for sb in 0..cols / 32 {
                    let a = portable::unpack(ty, m.view().row(j), sb);
                    // SAFETY: the CPU has the features (checked above).
                    let (u, sc, o) = unsafe { avx2_unpack(ty, m.view().row(j), sb) };
                    assert_eq!((a.u, a.s, a.o), (u, sc, o), "{ty:?} row {j} sub {sb}");
                }
                let (mut want, mut got) = (vec![0f32; cols], vec![0f32; cols]);
                portable::dequantize_row_on(ty, m.view().row(j), &mut want);
                // SAFETY: as above.
                unsafe { avx2::dequantize_row(ty, m.view().row(j), &mut got) };
                assert_eq!(bits(&want), bits(&got), "{ty:?} row {j}");
            }
            for n in [1, 2, 3, 8, 13] {
                let mut x = random(n * cols, 6 + n as u64);
                x[0] = 10.0; // a block whose quants reach ±127
                x[1] = -10.0;
                let acts = Acts::quantize(&x, n, cols);
                let (mut want, mut got) = (vec![0f32; rows * n], vec![0f32; rows * n]);
                portable::rows_on(&m, 0..rows, &acts, &mut want);
                // SAFETY: as above.
                unsafe { avx2::rows(&m, 0..rows, &acts, &mut got) };
                assert_eq!(bits(&want), bits(&got), "{ty:?} n {n}");
            }
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// # Safety
    /// The CPU must have AVX2 and F16C.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn avx2_unpack(ty: QType, row: &[u8], s: usize) -> ([u8; 32], [f32; 2], [f32; 2]) {
        use std::arch::x86_64::_mm256_storeu_si256;
        // SAFETY: this function's features are those `unpack` needs.
        let (u, sc, o) = unsafe { per_format!(ty, x86::unpack, row, s) };
        let mut bytes = [0u8; 32];
        // SAFETY: 32 bytes of destination; unaligned store.
        unsafe { _mm256_storeu_si256(bytes.as_mut_ptr().cast(), u) };
        (bytes, sc, o)
    }

    /// Products agree with the dense f32 product of the dequantized weights within the error
    /// of 8-bit activations, on both implementations.
    #[test]
    fn products_match_the_dense_product_on_both_isas() {
        let (rows, cols, n) = (37, 768, 11);
        let x = random(n * cols, 3);
        for ty in QType::ALL {
            let (m, w) = matrix(ty, rows, cols, 4);
            let mut want = vec![0f32; n * rows];
            let mut bound = vec![0f32; n * rows];
            for r in 0..n {
                for j in 0..rows {
                    let (xr, wj) = (&x[r * cols..(r + 1) * cols], &w[j * cols..(j + 1) * cols]);
                    want[r * rows + j] = xr.iter().zip(wj).map(|(a, b)| a * b).sum();
                    bound[r * rows + j] = xr.iter().zip(wj).map(|(a, b)| (a * b).abs()).sum();
                }
            }
            for isa in [Isa::Portable, Isa::best()] {
                let got = m.matmul_on(isa, &x, n).expect("matmul");
                for i in 0..n * rows {
                    // Each activation is off by at most half a step of 1/127 of its block max.
                    let tol = bound[i] / 127.0 + 1e-4;
                    assert!(
                        (got[i] - want[i]).abs() <= tol,
                        "{ty:?} {isa:?} element {i}: {} vs {} (tolerance {tol})",
                        got[i],
                        want[i]
                    );
                }
            }
        }
    }

    /// A row's result does not depend on the rows beside it: bit-identical alone and in a batch.
    #[test]
    fn rows_are_computed_independently_of_the_batch() {
        let (rows, cols, n) = (70, 512, 13);
        let x = random(n * cols, 5);
        for ty in QType::ALL {
            let (m, _) = matrix(ty, rows, cols, 6);
            for isa in [Isa::Portable, Isa::best()] {
                let all = m.matmul_on(isa, &x, n).expect("matmul");
                for r in 0..n {
                    let one = m
                        .matmul_on(isa, &x[r * cols..(r + 1) * cols], 1)
                        .expect("matmul");
                    assert_eq!(one, all[r * rows..(r + 1) * rows], "{ty:?} {isa:?} row {r}");
                }
            }
        }
    }

    #[test]
    fn simd_dequantization_is_bit_identical_to_the_portable_one() {
        for ty in QType::ALL {
            let (m, _) = matrix(ty, 5, 768, 9);
            let mut a = vec![0f32; 5 * 768];
            let mut b = vec![0f32; 5 * 768];
            m.dequantize_into(Isa::Portable, 0..5, &mut a);
            m.dequantize_into(Isa::best(), 0..5, &mut b);
            assert_eq!(a, b, "{ty:?}");
        }
    }

    /// Panels of dequantized rows through dense GEMM: the product of the dequantized weights
    /// up to f32 summation order, for shapes that leave a partial last panel.
    #[test]
    fn dense_panel_products_equal_the_dequantized_product() {
        let (cols, n) = (512, 9);
        let x = random(n * cols, 10);
        for (ty, rows) in [(QType::Q5_0, 300), (QType::Q4K, 129), (QType::Q6K, 17)] {
            let (m, w) = matrix(ty, rows, cols, 11);
            let got = m.matmul_dense(&x, n).expect("matmul");
            for r in 0..n {
                for j in 0..rows {
                    let (xr, wj) = (&x[r * cols..(r + 1) * cols], &w[j * cols..(j + 1) * cols]);
                    let want: f32 = xr.iter().zip(wj).map(|(a, b)| a * b).sum();
                    let mag: f32 = xr.iter().zip(wj).map(|(a, b)| (a * b).abs()).sum();
                    let g = got[r * rows + j];
                    assert!(
                        (g - want).abs() <= 1e-5 * mag + 1e-6,
                        "{ty:?} ({r}, {j}): {g} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn simd_and_portable_products_agree_closely() {
        let (rows, cols, n) = (16, 1024, 5);
        let x = random(n * cols, 7);
        for ty in QType::ALL {
            let (m, _) = matrix(ty, rows, cols, 8);
            let a = m.matmul_on(Isa::Portable, &x, n).expect("matmul");
            let b = m.matmul_on(Isa::best(), &x, n).expect("matmul");
            let scale = a.iter().fold(0f32, |s, v| s.max(v.abs()));
            assert!(max_abs_diff(&a, &b) <= 1e-5 * scale, "{ty:?}");
        }
    }

    #[test]
    fn shapes_that_do_not_fit_are_refused() {
        let bytes = |n: usize| -> Blocks { Arc::new(vec![0u8; n]) };
        assert!(QMatrix::new(QType::Q4K, 2, 128, bytes(144)).is_err());
        assert!(QMatrix::new(QType::Q8_0, 2, 64, bytes(4 * 34 - 1)).is_err());
        assert!(QMatrix::new(QType::Q8_0, 0, 64, bytes(0)).is_err());
        let m = QMatrix::new(QType::Q8_0, 2, 64, bytes(4 * 34)).expect("fits");
        assert!(m.matmul_dense(&[0.0; 63], 1).is_err());
        assert!(m.matmul(&[0.0; 63], 1).is_err());
        assert!(m.dequantize_rows(1..3).is_err());
        assert_eq!(m.matmul(&[1.0; 128], 2).expect("zeros"), vec![0.0; 4]);
    }
}
