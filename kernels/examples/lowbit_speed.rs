//! Speed of the low-bit key scoring at one layer of the default target (2 kv heads x 128,
//! 12 query heads): `cargo run --release -p kernels --example lowbit_speed -- 32768`.
use kernels::{AttentionShape, LowBitKeys};
use rand::{Rng, SeedableRng};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: usize = std::env::args().nth(1).map_or(Ok(32768), |s| s.parse())?;
    let shape = AttentionShape {
        n_head: 12,
        n_kv_head: 2,
        head_dim: 128,
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let k: Vec<f32> = (0..n * 256).map(|_| rng.gen_range(-2.0..2.0)).collect();
    let q: Vec<f32> = (0..12 * 128).map(|_| rng.gen_range(-1.0..1.0)).collect();
    for bits in [4, 2] {
        let mut lb = LowBitKeys::new(shape, bits, 32)?;
        let t = Instant::now();
        lb.update(&k)?;
        let quant = t.elapsed().as_secs_f64() * 1e3;
        let mut s = Vec::new();
        let t = Instant::now();
        for _ in 0..10 {
            lb.scores(&q, 0, &mut s)?;
        }
        let score = t.elapsed().as_secs_f64() * 1e2;
        let t = Instant::now();
        for _ in 0..10 {
            let all: Vec<usize> = (0..lb.rows() / 32).collect();
            lb.importance(&q, 0, &all, 0..lb.rows(), &mut s)?;
        }
        let imp = t.elapsed().as_secs_f64() * 1e2;
        let t = Instant::now();
        let all: Vec<usize> = (0..lb.rows() / 32).collect();
        for _ in 0..10 {
            lb.block_bounds(&q, 0, &all)?;
        }
        let bounds = t.elapsed().as_secs_f64() * 1e2;
        println!(
            "{bits} bits, {n} rows: quantize {quant:.1} ms, scores {score:.2} ms, importance (with scores) {imp:.2} ms, block bounds {bounds:.2} ms per kv head"
        );
    }
    Ok(())
}
