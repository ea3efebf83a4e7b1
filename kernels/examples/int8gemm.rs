//! Prototype for issue 17 (measurement only, not used by the engine): a blocked int8 GEMM over
//! Q5_0 weights repacked so that one AVX-512 VNNI `vpdpbusd` multiplies 4 weights of 16 output
//! features at once (lane = feature), with the activation's 4 bytes broadcast. The float work
//! (convert, scale) then happens once per block of 32 per feature instead of once per 4
//! lanes, and each (feature, row) result is a fixed sequence over blocks, the same for one row
//! (decode) and for 512 (prefill): exact per row, as the ρ = 1 identity needs.
//!
//! Times it against `QMatrix::matmul` (today's int8 path) and `QMatrix::matmul_dense` (today's
//! many-row path, f32 GEMM on dequantized panels) on one matrix, and checks it against a
//! dense product. `cargo run --release -p kernels --example int8gemm [rows cols]`

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kernels::{Isa, QMatrix, QType};
use rayon::prelude::*;
use std::time::Instant;

/// Output features per repacked group: the 16 lanes of a 512-bit register.
const GROUP: usize = 16;
/// Activation rows per register tile.
const TILE_M: usize = 8;

/// Q5_0 weights repacked: per group of 16 features and block of 32 inputs, 8 chunks of
/// `[feature][4 inputs]` unsigned quants (0..=31), then the 16 scales.
struct Packed {
    rows: usize,
    cols: usize,
    /// `(rows / 16, cols / 32, 8, 16, 4)` bytes.
    u: Vec<u8>,
    /// `(rows / 16, cols / 32, 16)` scales `d`; the weight is `d · (u − 16)`.
    d: Vec<f32>,
}

fn f16(b: &[u8]) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

impl Packed {
    fn from_q5_0(bytes: &[u8], rows: usize, cols: usize) -> Self {
        let nb = cols / 32;
        let mut u = vec![0u8; rows * cols];
        let mut d = vec![0f32; rows * nb];
        for j in 0..rows {
            let (g, lane) = (j / GROUP, j % GROUP);
            for b in 0..nb {
                let blk = &bytes[(j * nb + b) * 22..][..22];
                let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
                for k in 0..32 {
                    let nib = if k < 16 {
                        blk[6 + k] & 0x0F
                    } else {
                        blk[6 + k - 16] >> 4
                    };
                    let hi = ((qh >> k) & 1) as u8;
                    let base = ((g * nb + b) * 8 + k / 4) * GROUP * 4;
                    u[base + lane * 4 + k % 4] = nib | (hi << 4);
                }
                d[(g * nb + b) * GROUP + lane] = f16(blk);
            }
        }
        Self { rows, cols, u, d }
    }
}

/// Activations quantized per block of 32 (symmetric, as QMatrix does): quants, scales and
/// each block's quant sum.
struct Acts {
    q: Vec<i8>,
    d: Vec<f32>,
    sum: Vec<f32>,
}

fn quantize(x: &[f32]) -> Acts {
    let mut q = vec![0i8; x.len()];
    let mut d = Vec::with_capacity(x.len() / 32);
    let mut sum = Vec::with_capacity(x.len() / 32);
    for (xb, qb) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = amax / 127.0;
        let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
        let mut t = 0i32;
        for (o, &v) in qb.iter_mut().zip(xb) {
            *o = (v * inv).round().clamp(-127.0, 127.0) as i8;
            t += i32::from(*o);
        }
        d.push(s);
        sum.push(t as f32);
    }
    Acts { q, d, sum }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::*;
    use std::arch::x86_64::*;

    /// Rows `m0..m0 + M` of the output for feature group `g`: `out[m][lane]`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub fn tile<const M: usize>(
        p: &Packed,
        a: &Acts,
        g: usize,
        m0: usize,
        out: &mut [[f32; GROUP]; M],
    ) {
        let nb = p.cols / 32;
        let mut acc = [_mm512_setzero_ps(); M];
        for b in 0..nb {
            let mut dot = [_mm512_setzero_si512(); M];
            let wb = &p.u[(g * nb + b) * 8 * GROUP * 4..][..8 * GROUP * 4];
            for c in 0..8 {
                // SAFETY: 64 bytes at `c * 64` are inside the block's 512.
                let w = unsafe { _mm512_loadu_si512(wb.as_ptr().add(c * 64).cast()) };
                for (m, dm) in dot.iter_mut().enumerate() {
                    let xq = &a.q[(m0 + m) * p.cols + b * 32 + c * 4..][..4];
                    let x4 =
                        i32::from_le_bytes([xq[0] as u8, xq[1] as u8, xq[2] as u8, xq[3] as u8]);
                    *dm = _mm512_dpbusd_epi32(*dm, w, _mm512_set1_epi32(x4));
                }
            }
            // SAFETY: 16 scales of the group's block.
            let dw = unsafe { _mm512_loadu_ps(p.d.as_ptr().add((g * nb + b) * GROUP)) };
            for m in 0..M {
                let i = (m0 + m) * nb + b;
                let (dx, sx) = (a.d[i], a.sum[i]);
                // w·x = d_w·d_x·(Σ u·q − 16·Σ q): one fixed sequence per (feature, row).
                let s = _mm512_sub_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_set1_ps(16.0 * sx));
                acc[m] = _mm512_fmadd_ps(s, _mm512_mul_ps(dw, _mm512_set1_ps(dx)), acc[m]);
            }
        }
        for m in 0..M {
            // SAFETY: 16 floats.
            unsafe { _mm512_storeu_ps(out[m].as_mut_ptr(), acc[m]) };
        }
    }
}

/// `y = x Wᵀ`, `(n, rows)`, parallel over feature groups.
#[cfg(target_arch = "x86_64")]
fn matmul(p: &Packed, x: &[f32], n: usize) -> Vec<f32> {
    let a = quantize(x);
    let groups = p.rows / GROUP;
    let cols: Vec<Vec<f32>> = (0..groups)
        .into_par_iter()
        .map(|g| {
            let mut col = vec![0f32; n * GROUP];
            let mut m0 = 0;
            while m0 < n {
                let t = (n - m0).min(TILE_M);
                if t == TILE_M {
                    let mut o = [[0f32; GROUP]; TILE_M];
                    // SAFETY: the caller checked the CPU features.
                    unsafe { vnni::tile::<TILE_M>(p, &a, g, m0, &mut o) };
                    for (m, r) in o.iter().enumerate() {
                        col[(m0 + m) * GROUP..][..GROUP].copy_from_slice(r);
                    }
                } else {
                    for m in m0..m0 + t {
                        let mut o = [[0f32; GROUP]; 1];
                        // SAFETY: as above.
                        unsafe { vnni::tile::<1>(p, &a, g, m, &mut o) };
                        col[m * GROUP..][..GROUP].copy_from_slice(&o[0]);
                    }
                }
                m0 += t;
            }
            col
        })
        .collect();
    let mut y = vec![0f32; n * p.rows];
    for (g, col) in cols.iter().enumerate() {
        for m in 0..n {
            y[m * p.rows + g * GROUP..][..GROUP].copy_from_slice(&col[m * GROUP..][..GROUP]);
        }
    }
    y
}

fn time<T>(reps: usize, mut f: impl FnMut() -> T) -> f64 {
    std::hint::black_box(f());
    let t = Instant::now();
    for _ in 0..reps {
        std::hint::black_box(f());
    }
    t.elapsed().as_secs_f64() / reps as f64
}

#[cfg(target_arch = "x86_64")]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    if Isa::best() != Isa::Avx512Vnni {
        println!("needs AVX-512 VNNI");
        return Ok(());
    }
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let (rows, cols) = match args[..] {
        [r, c] => (r, c),
        _ => (4864, 896),
    };
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
        .collect();
    let wt = Tensor::from_vec(w, (rows, cols), &Device::Cpu)?;
    let q = QTensor::quantize(&wt, GgmlDType::Q5_0)?;
    let bytes = q.data()?.into_owned();
    let packed = Packed::from_q5_0(&bytes, rows, cols);
    let m = QMatrix::new(QType::Q5_0, rows, cols, std::sync::Arc::new(bytes))?;
    let dense = q.dequantize(&Device::Cpu)?.t()?.contiguous()?;
    println!("Q5_0 {rows}x{cols}: repacked int8 GEMM vs QMatrix (int8 today) vs f32 panels (many rows today)");
    for n in [1usize, 4, 8, 16, 64, 512] {
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 31 % 200) as f32 / 100.0) - 1.0)
            .collect();
        let xt = Tensor::from_vec(x.clone(), (n, cols), &Device::Cpu)?;
        let want = xt.matmul(&dense)?.flatten_all()?.to_vec1::<f32>()?;
        let got = matmul(&packed, &x, n);
        let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
        let err = want
            .iter()
            .zip(&got)
            .fold(0f32, |a, (w, g)| a.max((w - g).abs()));
        // Rows must not depend on the batch: row 0 alone equals row 0 of the batch.
        let alone = matmul(&packed, &x[..cols], 1);
        let same = alone == got[..rows];
        let reps = (2000 / n).clamp(3, 200);
        let ours = time(reps, || matmul(&packed, &x, n));
        let today = time(reps, || m.matmul(&x, n));
        let panels = time(reps, || m.matmul_dense(&x, n));
        let gmac = (n * rows * cols) as f64 / 1e9;
        println!(
            "n={n:4}: repacked {:8.3} ms ({:6.1} GMAC/s) | QMatrix {:8.3} ms | panels {:8.3} ms | max err {:.2e} of {:.1} | row 0 alone identical: {same}",
            ours * 1e3,
            gmac / ours,
            today * 1e3,
            panels * 1e3,
            err,
            scale
        );
    }
    Ok(())
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    println!("x86-64 only");
}
