//! What bf16 attention changes in a model's answers: full prefill and greedy decoding of the
//! same prompts with f32 and with bf16 attention, alternating, one line per prompt and a summary
//! (next-token KL(f32 ‖ bf16) after the prompt, whether the top token and the whole greedy
//! answer agree, prefill times).
//!
//! `cargo run --release -p target-engine --example attention_precision -- MODEL.gguf
//! PROMPTS.jsonl [--limit N] [--max-tokens N]`, where PROMPTS.jsonl holds one `{"ids": [...]}`
//! per line (the fidelity study's `prompts.jsonl`; other fields are printed back).
#[path = "common/flags.rs"]
mod flags;

use kernels::AttentionPrecision;
use std::io::BufRead;
use std::time::Instant;
use target_engine::prelude::*;
use target_engine::{GenerateParams, LoadOptions, Model};

#[allow(
    clippy::too_many_lines,
    reason = "a measurement script that reads top to bottom: parse, run, print"
)]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str, default: usize| flags::number(&args, name, default);
    let (limit, max_tokens) = (flag("--limit", usize::MAX)?, flag("--max-tokens", 32)?);
    let [model, prompts, ..] = &args[..] else {
        return Err(
            "usage: attention_precision MODEL.gguf PROMPTS.jsonl [--limit N] [--max-tokens N]"
                .into(),
        );
    };
    if !AttentionPrecision::Bf16.supported() {
        return Err("this CPU has no AVX-512 BF16".into());
    }
    let load = |attention| {
        Model::load(
            model.as_ref(),
            &LoadOptions {
                attention,
                ..LoadOptions::default()
            },
        )
    };
    let (f32_model, bf16_model) = (
        load(AttentionPrecision::F32)?,
        load(AttentionPrecision::Bf16)?,
    );
    let params = GenerateParams {
        max_tokens,
        ..GenerateParams::default()
    };
    let (mut kls, mut top1, mut same, mut times) = (Vec::new(), 0, 0, [0f64; 2]);
    for line in std::io::BufReader::new(std::fs::File::open(prompts)?)
        .lines()
        .take(limit)
    {
        let v: serde_json::Value = serde_json::from_str(&line?)?;
        let ids: Vec<u32> = serde_json::from_value(v["ids"].clone())?;
        let mut logits = Vec::new();
        let mut answers = Vec::new();
        for (i, m) in [&f32_model, &bf16_model].into_iter().enumerate() {
            let t = Instant::now();
            let (_, l) = m.prefill(&ids)?;
            times[i] += t.elapsed().as_secs_f64();
            logits.push(l);
            answers.push(m.generate(&ids, &params)?.ids);
        }
        let kl = kl(&logits[0], &logits[1]);
        let agree = argmax(&logits[0]) == argmax(&logits[1]);
        let identical = answers[0] == answers[1];
        let first_diff = answers[0].iter().zip(&answers[1]).position(|(a, b)| a != b);
        println!(
            "{} {} {}: {} tokens, KL {kl:.2e}, top-1 {}, answer {}",
            v["pairing"].as_str().unwrap_or("-"),
            v["dataset"].as_str().unwrap_or("-"),
            v["case"].as_str().unwrap_or("-"),
            ids.len(),
            if agree { "same" } else { "DIFFERS" },
            match first_diff {
                None if identical => "identical".to_string(),
                None => "a prefix of the other".to_string(),
                Some(i) => format!("differs from token {i}"),
            }
        );
        kls.push(kl);
        top1 += usize::from(agree);
        same += usize::from(identical);
    }
    let n = kls.len();
    kls.sort_by(f64::total_cmp);
    println!(
        "{n} prompts: KL(f32 ‖ bf16) median {:.2e}, mean {:.2e}, max {:.2e}; top-1 agrees {top1}/{n}, \
         greedy {max_tokens}-token answer identical {same}/{n}; prefill {:.0} ms (f32) / {:.0} ms (bf16) per prompt",
        kls.get(n / 2).copied().unwrap_or(0.0),
        kls.iter().sum::<f64>() / n.max(1) as f64,
        kls.last().copied().unwrap_or(0.0),
        times[0] * 1e3 / n.max(1) as f64,
        times[1] * 1e3 / n.max(1) as f64,
    );
    Ok(())
}

fn argmax(x: &[f32]) -> usize {
    (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b })
}

/// KL(softmax(p) ‖ softmax(q)) in nats.
fn kl(p: &[f32], q: &[f32]) -> f64 {
    let logp = log_softmax(p);
    let logq = log_softmax(q);
    logp.iter()
        .zip(&logq)
        .map(|(&a, &b)| a.exp() * (a - b))
        .sum()
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let z: f64 = x.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
    x.iter().map(|&v| v as f64 - z).collect()
}
