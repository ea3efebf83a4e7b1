//! Times causal attention: one decode row and a full prefill, Qwen-0.5B's head layout.
use kernels::{causal_attention, AttentionShape};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let shape = AttentionShape {
        n_head: 14,
        n_kv_head: 2,
        head_dim: 64,
    };
    for n_ctx in [512usize, 1024, 2048] {
        let row = shape.n_kv_head * shape.head_dim;
        let k: Vec<f32> = (0..n_ctx * row)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        let v = k.iter().rev().copied().collect::<Vec<_>>();
        let width = shape.n_head * shape.head_dim;
        let q: Vec<f32> = (0..n_ctx * width)
            .map(|i| ((i * 104729) % 997) as f32 / 997.0 - 0.5)
            .collect();
        let t = Instant::now();
        for _ in 0..20 {
            causal_attention(&q[(n_ctx - 1) * width..], &[n_ctx - 1], &k, &v, shape)?;
        }
        let decode = t.elapsed().as_secs_f64() * 1e3 / 20.0;
        let pos: Vec<usize> = (0..n_ctx).collect();
        let t = Instant::now();
        causal_attention(&q, &pos, &k, &v, shape)?;
        let prefill = t.elapsed().as_secs_f64() * 1e3;
        println!(
            "n_ctx {n_ctx:5}: one decode row {decode:8.3} ms, prefill {prefill:8.1} ms (one layer)"
        );
    }
    Ok(())
}
