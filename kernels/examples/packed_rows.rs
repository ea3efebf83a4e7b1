//! What the packed int8 GEMM ([`kernels::PackedMatrix`]) costs by the number of activation
//! rows, on matrices of the 1.5B target's shapes (Q4_K 8960 x 1536 as `ffn_gate`/`ffn_up`,
//! Q6_K 1536 x 8960 as `ffn_down`): best of `ROUNDS` per row count, row counts interleaved,
//! and the ratio to one row. Checking passes of speculative decoding run 2-16 rows.
//!
//! `cargo run --release -p kernels --example packed_rows [max_rows] [rounds]`
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use kernels::{QMatrix, QType};
use std::sync::Arc;
use std::time::Instant;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn matrix(ty: QType, g: GgmlDType, rows: usize, cols: usize) -> Res<kernels::PackedMatrix> {
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919 + 13) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let q = QTensor::quantize(&Tensor::from_vec(w, (rows, cols), &Device::Cpu)?, g)?;
    let m = QMatrix::new(ty, rows, cols, Arc::new(q.data()?.into_owned()))?;
    Ok(m.pack().ok_or("no packed form")?)
}

fn main() -> Res<()> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let max_rows = args.first().copied().unwrap_or(16);
    let rounds = args.get(1).copied().unwrap_or(20);
    let mats = [
        (
            "Q4_K 8960x1536",
            matrix(QType::Q4K, GgmlDType::Q4K, 8960, 1536)?,
        ),
        (
            "Q6_K 1536x8960",
            matrix(QType::Q6K, GgmlDType::Q6K, 1536, 8960)?,
        ),
    ];
    // The same products over 24 distinct copies of the Q4_K matrix (~185 MB: weights streamed
    // from memory, as in a decode step, instead of from cache).
    let many: Vec<kernels::PackedMatrix> = (0..24).map(|_| mats[0].1.clone()).collect();
    {
        let cols = many[0].cols();
        let x: Vec<f32> = (0..max_rows * cols)
            .map(|i| ((i * 31 + 7) % 200) as f32 / 100.0 - 1.0)
            .collect();
        let mut best = vec![f64::INFINITY; max_rows + 1];
        for _ in 0..rounds.div_ceil(4) {
            for n in 1..=max_rows {
                let t = Instant::now();
                for m in &many {
                    std::hint::black_box(m.matmul(&x[..n * cols], n)?);
                }
                best[n] = best[n].min(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        let line: Vec<String> = (1..=max_rows)
            .map(|n| format!("{n}: {:.2} ({:.2})", best[n], best[n] / best[1]))
            .collect();
        println!(
            "24 x Q4_K 8960x1536 from memory, ms (x one row): {}",
            line.join(", ")
        );
    }
    for (name, m) in &mats {
        let x: Vec<f32> = (0..max_rows * m.cols())
            .map(|i| ((i * 31 + 7) % 200) as f32 / 100.0 - 1.0)
            .collect();
        let mut best = vec![f64::INFINITY; max_rows + 1];
        for _ in 0..rounds {
            for n in 1..=max_rows {
                let t = Instant::now();
                std::hint::black_box(m.matmul(&x[..n * m.cols()], n)?);
                best[n] = best[n].min(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        let line: Vec<String> = (1..=max_rows)
            .map(|n| format!("{n}: {:.3} ({:.2})", best[n], best[n] / best[1]))
            .collect();
        println!("{name} ms (x one row): {}", line.join(", "));
    }
    Ok(())
}
