//! Times causal attention at both precisions: one decode row and a full prefill, one layer of
//! each default model's head layout (`--model 0.5b|1.5b|smollm2`, default 0.5b). The bf16
//! prefill includes packing the cache; its decode row reads a packed mirror, as the model's do.
use kernels::{
    causal_attention_packed, causal_attention_with, AttentionPrecision, AttentionShape, Bf16Kv,
};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let model = std::env::args().skip_while(|a| a != "--model").nth(1);
    let (n_head, n_kv_head, head_dim) = match model.as_deref().unwrap_or("0.5b") {
        "0.5b" => (14, 2, 64),
        "1.5b" => (12, 2, 128),
        "smollm2" => (9, 3, 64),
        other => return Err(format!("--model: unknown {other:?} (0.5b, 1.5b, smollm2)").into()),
    };
    let shape = AttentionShape {
        n_head,
        n_kv_head,
        head_dim,
    };
    let mut precisions = vec![AttentionPrecision::F32];
    if AttentionPrecision::Bf16.supported() {
        precisions.push(AttentionPrecision::Bf16);
    }
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
        let pos: Vec<usize> = (0..n_ctx).collect();
        let mut outs = Vec::new();
        for &p in &precisions {
            // A decode step as the model runs it: bf16 reads the mirror kept beside the cache.
            let mut mirror = Bf16Kv::new(shape);
            if p == AttentionPrecision::Bf16 {
                mirror.update(&k, &v, n_ctx);
            }
            let last = &q[(n_ctx - 1) * width..];
            let t = Instant::now();
            for _ in 0..20 {
                if p == AttentionPrecision::Bf16 {
                    causal_attention_packed(last, &[n_ctx - 1], &mirror)?;
                } else {
                    causal_attention_with(last, &[n_ctx - 1], &k, &v, shape, p)?;
                }
            }
            let decode = t.elapsed().as_secs_f64() * 1e3 / 20.0;
            let t = Instant::now();
            let out = causal_attention_with(&q, &pos, &k, &v, shape, p)?;
            let prefill = t.elapsed().as_secs_f64() * 1e3;
            println!(
                "n_ctx {n_ctx:5} {p:?}: one decode row {decode:8.3} ms, prefill {prefill:8.1} ms (one layer)"
            );
            outs.push(out);
        }
        if let [f32, bf16] = &outs[..] {
            let err = f32
                .iter()
                .zip(bf16)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            println!("n_ctx {n_ctx:5}: bf16 against f32, max abs difference {err:.2e}");
        }
    }
    Ok(())
}
