//! Times causal attention at both precisions: one decode row and a full prefill, one layer of
//! each default model's head layout (`--model 0.5b|1.5b|smollm2`, default 0.5b). The bf16
//! prefill includes packing the cache; its decode row reads a packed mirror, as the model's do.
//!
//! `--roofline` prints what bounds attention on this machine instead: the f32 multiply-add
//! rate of every core together (12 independent AVX-512 chains per core) and the rate at which
//! they stream memory (a 512 MiB buffer summed, one half per core).
//!
//! `--context N` times instead what a checking pass of speculative decoding does at the last
//! positions of an N-token cache: 1, 2, 4, 8 and 16 rows in one call (f32), with the rate of
//! its products (GFLOP/s) and the cost of each row past the first.
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
    if std::env::args().any(|a| a == "--roofline") {
        return roofline();
    }
    if let Some(n) = std::env::args().skip_while(|a| a != "--context").nth(1) {
        return checking_pass(shape, n.parse()?);
    }
    let mut precisions = vec![AttentionPrecision::F32];
    if AttentionPrecision::Bf16.supported() {
        precisions.push(AttentionPrecision::Bf16);
    }
    for n_ctx in [512usize, 1024, 2048] {
        let (k, v) = cache(shape, n_ctx);
        let width = shape.n_head * shape.head_dim;
        let q = queries(n_ctx * width);
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

/// Keys and values of `n_ctx` positions (fixed pseudo-random values in -0.5..0.5).
fn cache(shape: AttentionShape, n_ctx: usize) -> (Vec<f32>, Vec<f32>) {
    let row = shape.n_kv_head * shape.head_dim;
    let k: Vec<f32> = (0..n_ctx * row)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let v = k.iter().rev().copied().collect();
    (k, v)
}

/// `n` query values, as [`cache`]'s.
fn queries(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 104729) % 997) as f32 / 997.0 - 0.5)
        .collect()
}

/// One layer's attention for a checking pass of `rows` rows at the end of an `n_ctx` cache.
fn checking_pass(shape: AttentionShape, n_ctx: usize) -> Result<(), Box<dyn std::error::Error>> {
    let (k, v) = cache(shape, n_ctx);
    let width = shape.n_head * shape.head_dim;
    let mut one = 0.0;
    // `--rows R`: only R rows, repeated (for a profiler).
    let only: Option<usize> = match std::env::args().skip_while(|a| a != "--rows").nth(1) {
        Some(r) => Some(r.parse()?),
        None => None,
    };
    let counts = only.map_or(vec![1usize, 2, 4, 8, 16], |r| vec![r]);
    for rows in counts {
        let q = queries(rows * width);
        let pos: Vec<usize> = (n_ctx - rows..n_ctx).collect();
        let reps = if only.is_some() { 200 } else { 10 };
        causal_attention_with(&q, &pos, &k, &v, shape, AttentionPrecision::F32)?;
        let t = Instant::now();
        for _ in 0..reps {
            causal_attention_with(&q, &pos, &k, &v, shape, AttentionPrecision::F32)?;
        }
        let ms = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
        if rows == 1 {
            one = ms;
        }
        // Scores and weighted values: 2 x 2 flops per key, head dimension and query head.
        let flops = 4.0 * (rows * shape.n_head * shape.head_dim * n_ctx) as f64;
        println!(
            "n_ctx {n_ctx}, {rows:2} rows: {ms:7.3} ms (one layer), {:6.1} GFLOP/s, {:6.3} ms per row past the first",
            flops / ms / 1e6,
            (ms - one) / (rows.max(2) - 1) as f64
        );
    }
    Ok(())
}

/// The machine's f32 FMA rate and memory bandwidth, all cores together.
fn roofline() -> Result<(), Box<dyn std::error::Error>> {
    #[cfg(target_arch = "x86_64")]
    {
        if !is_x86_feature_detected!("avx512f") {
            return Err("--roofline measures with AVX-512; this CPU has none".into());
        }
        let threads = std::thread::available_parallelism()?.get();
        let iters = 100_000_000u64;
        let t = Instant::now();
        std::thread::scope(|s| {
            for i in 0..threads {
                // SAFETY: AVX-512F checked above.
                s.spawn(move || std::hint::black_box(unsafe { fma_chains(iters, i as f32) }));
            }
        });
        let flops = (threads as u64 * iters * 12 * 16 * 2) as f64;
        println!(
            "{threads} cores: {:.0} GFLOP/s of f32 multiply-adds",
            flops / t.elapsed().as_secs_f64() / 1e9
        );
        let n: usize = 128 << 20;
        let buf: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
        let t = Instant::now();
        let reps = 5;
        std::thread::scope(|s| {
            for part in buf.chunks(n.div_ceil(threads)) {
                // SAFETY: AVX-512F checked above.
                s.spawn(move || std::hint::black_box(unsafe { stream_sum(part, reps) }));
            }
        });
        println!(
            "{threads} cores: {:.1} GB/s read from memory",
            (n * 4 * reps) as f64 / t.elapsed().as_secs_f64() / 1e9
        );
    }
    Ok(())
}

/// 12 independent chains of 512-bit multiply-adds, `iters` steps each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_chains(iters: u64, seed: f32) -> f32 {
    use std::arch::x86_64::*;
    let (m, b) = (_mm512_set1_ps(0.999), _mm512_set1_ps(0.001));
    let mut acc: [__m512; 12] = std::array::from_fn(|i| _mm512_set1_ps(seed + i as f32));
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = _mm512_fmadd_ps(*a, m, b);
        }
    }
    acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
}

/// The sum of `x`, `reps` times over, four 512-bit accumulators.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn stream_sum(x: &[f32], reps: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); 4];
    for _ in 0..reps {
        for c in x.chunks_exact(64) {
            for (l, a) in acc.iter_mut().enumerate() {
                // SAFETY: 16 values of this 64-value chunk.
                *a = _mm512_add_ps(*a, unsafe { _mm512_loadu_ps(c.as_ptr().add(16 * l)) });
            }
        }
    }
    acc.iter().map(|&a| _mm512_reduce_add_ps(a)).sum()
}
