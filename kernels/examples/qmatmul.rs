//! Times `QMatrix::matmul` against candle's quantized matmul and a dense f32 matmul of the same
//! weights, `QMatrix::matmul_dense` (dequantized panels) and `PackedMatrix::matmul` (the
//! repacked int8 GEMM, for the formats it takes), over row counts from decode (1)
//! to prefill (512). Prints one line per case; compare
//! ratios within one run.
//!
//! `cargo run --release -p kernels --example qmatmul [rows cols [format]]`

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use kernels::{Isa, QMatrix, QType};
use std::time::Instant;

fn time<T>(reps: usize, mut f: impl FnMut() -> T) -> f64 {
    f();
    let t = Instant::now();
    for _ in 0..reps {
        std::hint::black_box(f());
    }
    t.elapsed().as_secs_f64() / reps as f64
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let raw: Vec<String> = std::env::args().skip(1).collect();
    // An optional third argument keeps one format (`Q8_0`, `Q5_0`, ...).
    let only = raw.get(2).cloned();
    let args: Vec<usize> = raw
        .iter()
        .take(2)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let (rows, cols) = match args[..] {
        [r, c] => (r, c),
        _ => (4864, 896),
    };
    println!("isa {:?}, weights {rows}x{cols}", Isa::best());
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
        .collect();
    let w = Tensor::from_vec(w, (rows, cols), &Device::Cpu)?;
    let dense_t = w.t()?.contiguous()?;
    for (ty, g) in [
        (QType::Q8_0, GgmlDType::Q8_0),
        (QType::Q5_0, GgmlDType::Q5_0),
        (QType::Q4_1, GgmlDType::Q4_1),
        (QType::Q4K, GgmlDType::Q4K),
        (QType::Q6K, GgmlDType::Q6K),
    ] {
        if cols % ty.block_len() != 0 || only.as_ref().is_some_and(|o| *o != format!("{ty:?}")) {
            continue;
        }
        let q = QTensor::quantize(&w, g)?;
        let m = QMatrix::new(ty, rows, cols, std::sync::Arc::new(q.data()?.into_owned()))?;
        let candle = QMatMul::from_qtensor(q)?;
        let packed = m.pack();
        for n in [1usize, 4, 8, 16, 24, 32, 48, 64, 512]
            .into_iter()
            .filter(|&n| n * rows <= 1 << 24)
        {
            let x: Vec<f32> = (0..n * cols)
                .map(|i| ((i * 31 % 200) as f32 / 100.0) - 1.0)
                .collect();
            let xt = Tensor::from_vec(x.clone(), (n, cols), &Device::Cpu)?;
            let reps = (2000 / n).clamp(3, 200);
            let ours = time(reps, || m.matmul(&x, n));
            let theirs = time(reps, || candle.forward(&xt));
            let dense = time(reps, || xt.matmul(&dense_t));
            let panels = time(reps, || m.matmul_dense(&x, n));
            let repacked = packed
                .as_ref()
                .map(|p| format!("{:8.3} ms", time(reps, || p.matmul(&x, n)) * 1e3))
                .unwrap_or_else(|| "       -   ".into());
            let gmac = (n * rows * cols) as f64 / 1e9;
            println!(
                "{ty:?} n={n:4}: qmatrix {:8.3} ms ({:6.1} GMAC/s, {:5.1} GB/s) | candle quantized {:8.3} ms | dense f32 {:8.3} ms | dequantized panels {:8.3} ms | packed {repacked}",
                ours * 1e3,
                gmac / ours,
                m.nbytes() as f64 / ours / 1e9,
                theirs * 1e3,
                dense * 1e3,
                panels * 1e3,
            );
        }
    }
    Ok(())
}
