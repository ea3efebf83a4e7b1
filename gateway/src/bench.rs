//! `specrag bench prefill`: prefill throughput at several lengths and decode latency.

use serde::Serialize;
use std::time::Instant;
use target_engine::{KvCache, Model};

/// One prefill measurement.
#[derive(Debug, Clone, Serialize)]
pub struct PrefillPoint {
    pub tokens: usize,
    /// Median over the repetitions.
    pub ms: f64,
    pub tok_s: f64,
}

/// The report of one model (the JSON shape of the contract).
#[derive(Debug, Clone, Serialize)]
pub struct PrefillReport {
    pub model: String,
    pub prefill: Vec<PrefillPoint>,
    /// Median decode step after a 512-token prefill.
    pub decode_ms_per_token: f64,
}

/// Deterministic prompt ids of exactly `n` tokens: varied English text, tokenized and cycled.
pub fn bench_ids(model: &Model, n: usize) -> Vec<u32> {
    const TEXT: &str = "The printing press, developed around 1440 by Johannes Gutenberg, \
        combined movable metal type, oil-based inks and a screw press adapted from wine making. \
        Within decades presses operated in more than two hundred European cities, and the cost \
        of books fell sharply, which spread literacy, standardized spelling and accelerated the \
        exchange of scientific results between scholars who had never met. ";
    let ids = model.tokenizer().encode(TEXT, false).ids;
    ids.iter().copied().cycle().take(n).collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Measures prefill at each length (`reps` runs each, median) and `decode_steps` greedy decode
/// steps after a 512-token prefill.
pub fn prefill_report(
    model: &Model,
    lengths: &[usize],
    reps: usize,
    decode_steps: usize,
    mut progress: impl FnMut(&str),
) -> target_engine::Result<PrefillReport> {
    let mut points = Vec::new();
    for &n in lengths {
        let ids = bench_ids(model, n);
        let mut times = Vec::new();
        for r in 0..reps.max(1) {
            progress(&format!(
                "prefill {n} tokens, run {}/{}",
                r + 1,
                reps.max(1)
            ));
            let t = Instant::now();
            model.prefill(&ids)?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let ms = median(times);
        points.push(PrefillPoint {
            tokens: n,
            ms,
            tok_s: n as f64 / ms * 1e3,
        });
    }
    progress("decode");
    let ids = bench_ids(model, 512);
    let (mut cache, logits): (KvCache, Vec<f32>) = model.prefill(&ids)?;
    let mut next = target_engine::argmax(&logits);
    let mut steps = Vec::new();
    for _ in 0..decode_steps.max(1) {
        let pos = cache.len();
        let t = Instant::now();
        let out = model.forward(&[next], &[pos], &mut cache, false)?;
        let logits = model.last_logits(&out)?;
        steps.push(t.elapsed().as_secs_f64() * 1e3);
        next = target_engine::argmax(&logits);
    }
    Ok(PrefillReport {
        model: model.config().name.clone(),
        prefill: points,
        decode_ms_per_token: median(steps),
    })
}
