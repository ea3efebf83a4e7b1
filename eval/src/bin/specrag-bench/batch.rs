//! `specrag-bench batch`: what batching decode steps buys on this machine. One context of
//! real text (this repository's ARCHITECTURE.md and README) is prefilled once; then `b`
//! requests over copies of it decode together, one pass over the weights per step
//! ([`target_engine::Model::decode_rows`], as `specrag serve --max-batch` runs them), for each
//! `b` asked. Prints the time of a pass, the time per token and the tokens/s, each against one
//! request alone in the same run, and whether every row's logits were one request's alone.

use crate::args::BatchArgs;
use gateway::cli::{load, ModelArgs};
use serde::Serialize;
use std::time::Instant;
use target_engine::{argmax, KvCache};

const TEXT: &str = concat!(
    include_str!("../../../../ARCHITECTURE.md"),
    include_str!("../../../../README.md")
);

#[derive(Serialize)]
struct Row {
    requests: usize,
    context: usize,
    pass_ms: f64,
    ms_per_token: f64,
    tokens_per_s: f64,
    /// Tokens/s against one request alone.
    speedup: f64,
    /// Every row's logits were those of one request alone, bit for bit.
    identical: bool,
}

pub fn batch_cmd(m: &ModelArgs, a: BatchArgs) -> anyhow::Result<()> {
    let model = load(&m.target_path()?, m)?;
    let mut ids = Vec::new();
    while ids.len() < a.context as usize {
        ids.extend(model.tokenizer().encode(TEXT, false).ids);
    }
    ids.truncate(a.context as usize);
    eprintln!(
        "prefilling {} tokens of ARCHITECTURE.md and README.md",
        ids.len()
    );
    let (cache, logits) = model.prefill(&ids)?;
    let first = argmax(&logits);
    let mut alone: Option<(f64, Vec<Vec<f32>>)> = None;
    for &b in &a.requests {
        let b = b as usize;
        let mut caches: Vec<KvCache> = vec![cache.clone(); b];
        let mut next = vec![[first]; b];
        let mut times = Vec::new();
        let mut rows_of_first = Vec::new();
        let mut identical = true;
        for _ in 0..a.steps {
            let mut steps: Vec<(&[u32], &mut KvCache)> = next
                .iter()
                .zip(caches.iter_mut())
                .map(|(id, c)| (&id[..], c))
                .collect();
            let t = Instant::now();
            let out = model.decode_rows(&mut steps)?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
            identical &= out.iter().all(|r| r == &out[0]);
            rows_of_first.push(out[0][0].clone());
            for (n, r) in next.iter_mut().zip(&out) {
                *n = [argmax(&r[0])];
            }
        }
        times.sort_by(f64::total_cmp);
        let pass_ms = times[times.len() / 2];
        let tokens_per_s = b as f64 * 1e3 / pass_ms;
        let (base, reference) = alone.get_or_insert((tokens_per_s, rows_of_first.clone()));
        identical &= *reference == rows_of_first;
        let row = Row {
            requests: b,
            context: ids.len(),
            pass_ms,
            ms_per_token: pass_ms / b as f64,
            tokens_per_s,
            speedup: tokens_per_s / *base,
            identical,
        };
        if a.json {
            println!("{}", serde_json::to_string(&row)?);
        } else {
            println!(
                "{:>3} requests after {} tokens: {:>7.1} ms a pass, {:>6.1} ms a token, {:>6.1} tokens/s ({:.2}x one alone), rows identical to one alone: {}",
                row.requests, row.context, row.pass_ms, row.ms_per_token, row.tokens_per_s, row.speedup, row.identical
            );
        }
    }
    Ok(())
}
