//! `specrag-bench overlap`: do the speculator's important tokens match the target's? For each
//! prompt, the Jaccard overlap of the top fraction of chunk tokens ranked by (a) the
//! speculator's deep layers, (b) the target's own deep layers and (c) the target's first layer
//! (SpecCache Figure 3). Rankings are compared in the target's tokens: a speculator score is
//! carried to every target token it overlaps (the best one wins).

use crate::args::OverlapArgs;
use gateway::cli::{load_pair, spinner, ModelArgs};
use serde::Serialize;
use speculator::{mean_norms, project_scores, target_spans, LayerRange, SpecCache};
use std::sync::Arc;
use target_engine::{Assembly, Model, RagTemplate, SegmentKind};

/// Real prose and tables for the prompts: the project's own documentation.
const PASSAGES: [&str; 4] = [
    include_str!("../../../../README.md"),
    include_str!("../../../../ARCHITECTURE.md"),
    include_str!("../../../../docs/blend.md"),
    include_str!("../../../../docs/performance.md"),
];

const QUESTIONS: [&str; 5] = [
    "Which crate owns the chunk KV blob format, and what must it not know about?",
    "How does CacheBlend choose which tokens to recompute?",
    "What limits prefill speed on this machine?",
    "Why are chunks precomputed after the template prefix?",
    "What does the speculator compute for each token?",
];

/// Settings of the overlap analysis.
#[derive(Debug, Clone)]
pub struct OverlapConfig {
    pub prompts: usize,
    pub chunks: usize,
    pub chunk_tokens: usize,
    /// Fraction of chunk tokens in each top set (SpecCache uses 0.2).
    pub top: f64,
}

/// Jaccard overlaps of one prompt (or their mean).
#[derive(Debug, Clone, Default, Serialize)]
pub struct OverlapRow {
    pub prompt: String,
    pub chunk_tokens: usize,
    /// Speculator deep layers vs target deep layers.
    pub spec_deep_vs_target_deep: f64,
    /// Target first layer vs target deep layers.
    pub target_first_vs_target_deep: f64,
    /// Speculator deep layers vs target first layer.
    pub spec_deep_vs_target_first: f64,
}

/// The report: one row per prompt, their mean, and what two random sets would share.
#[derive(Debug, Clone, Serialize)]
pub struct OverlapReport {
    pub target: String,
    pub speculator: String,
    pub top: f64,
    /// Expected Jaccard of two independent random sets of the same fraction: f / (2 - f).
    pub random: f64,
    pub rows: Vec<OverlapRow>,
    pub mean: OverlapRow,
}

/// Paragraphs of the documentation packed into chunk texts of at most `max` target tokens.
fn chunk_texts(model: &Model, max: usize) -> Vec<String> {
    let tok = model.tokenizer();
    let mut out = Vec::new();
    let mut cur = String::new();
    for para in PASSAGES
        .iter()
        .flat_map(|p| p.split("\n\n"))
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        let joined = if cur.is_empty() {
            para.to_string()
        } else {
            format!("{cur}\n\n{para}")
        };
        if tok.encode(&joined, false).ids.len() <= max || cur.is_empty() {
            cur = joined;
        } else {
            out.push(std::mem::replace(&mut cur, para.to_string()));
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Indices of the `ceil(frac * n)` highest scores (ties: lower index first).
pub fn top_set(scores: &[f32], frac: f64) -> Vec<usize> {
    let k = target_engine::budget(frac, scores.len());
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx.sort_unstable();
    idx
}

/// |A ∩ B| / |A ∪ B| of two sorted index sets (1 when both are empty).
pub fn jaccard(a: &[usize], b: &[usize]) -> f64 {
    let (mut i, mut j, mut inter) = (0, 0, 0usize);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                inter += 1;
                i += 1;
                j += 1;
            }
        }
    }
    let union = a.len() + b.len() - inter;
    if union == 0 {
        1.0
    } else {
        inter as f64 / union as f64
    }
}

fn assemble(model: &Model, texts: &[String], max: usize, question: &str) -> Assembly {
    let tok = model.tokenizer();
    let template = RagTemplate::for_model(model);
    let mut asm = Assembly::default();
    let (t, ids) = template.prefix(tok);
    asm.push(SegmentKind::Prefix, &t, &ids);
    for (i, text) in texts.iter().enumerate() {
        let (text, mut ids) = template.chunk(tok, text);
        // A single paragraph longer than a chunk: cut by tokens, keep text and ids in step.
        let text = if ids.len() > max {
            ids.truncate(max);
            tok.decode(&ids, true)
        } else {
            text
        };
        asm.push(SegmentKind::Chunk(i), &text, &ids);
    }
    let (t, ids) = template.question(tok, question);
    asm.push(SegmentKind::Question, &t, &ids);
    asm
}

/// Runs the analysis for one target / speculator pairing.
pub fn overlap_report(
    target: &Model,
    speculator: Arc<Model>,
    cfg: &OverlapConfig,
    mut progress: impl FnMut(&str),
) -> target_engine::Result<OverlapReport> {
    let texts = chunk_texts(target, cfg.chunk_tokens);
    let spec = SpecCache::new(speculator.clone());
    let mut rows = Vec::new();
    for p in 0..cfg.prompts {
        // A seeded draw of distinct chunks per prompt (different sets and orders).
        let mut order: Vec<usize> = (0..texts.len()).collect();
        let mut s = p as u64 + 1;
        for i in (1..order.len()).rev() {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            order.swap(i, (s >> 33) as usize % (i + 1));
        }
        let picked: Vec<String> = (0..cfg.chunks)
            .map(|c| texts[order[c % order.len()]].clone())
            .collect();
        let question = QUESTIONS[p % QUESTIONS.len()];
        let asm = assemble(target, &picked, cfg.chunk_tokens, question);
        let chunk_pos = asm.chunk_positions();
        progress(&format!("prompt {}/{}: target", p + 1, cfg.prompts));
        let mut cache = target.new_cache();
        let positions: Vec<usize> = (0..asm.ids.len()).collect();
        let out = target.forward(&asm.ids, &positions, &mut cache, true)?;
        let n = asm.ids.len();
        let deep = mean_norms(&out.layers, LayerRange::LastThird, n)?;
        let first = mean_norms(&out.layers[..1], LayerRange::All, n)?;
        drop(out);
        let at_chunks = |s: &[f32]| chunk_pos.iter().map(|&p| s[p]).collect::<Vec<f32>>();
        progress(&format!("prompt {}/{}: speculator", p + 1, cfg.prompts));
        let scored = spec.query_scores(&asm)?;
        let spans = target_spans(&asm, target.tokenizer());
        let chunk_spans: Vec<_> = chunk_pos.iter().map(|&p| spans[p].clone()).collect();
        let spec_scores = project_scores(&scored.spans, &scored.scores, &chunk_spans);
        let (a, b, c) = (
            top_set(&spec_scores, cfg.top),
            top_set(&at_chunks(&deep), cfg.top),
            top_set(&at_chunks(&first), cfg.top),
        );
        rows.push(OverlapRow {
            prompt: question.to_string(),
            chunk_tokens: chunk_pos.len(),
            spec_deep_vs_target_deep: jaccard(&a, &b),
            target_first_vs_target_deep: jaccard(&c, &b),
            spec_deep_vs_target_first: jaccard(&a, &c),
        });
    }
    let m = rows.len().max(1) as f64;
    let mean = OverlapRow {
        prompt: "mean".into(),
        chunk_tokens: rows.iter().map(|r| r.chunk_tokens).sum::<usize>() / rows.len().max(1),
        spec_deep_vs_target_deep: rows.iter().map(|r| r.spec_deep_vs_target_deep).sum::<f64>() / m,
        target_first_vs_target_deep: rows
            .iter()
            .map(|r| r.target_first_vs_target_deep)
            .sum::<f64>()
            / m,
        spec_deep_vs_target_first: rows
            .iter()
            .map(|r| r.spec_deep_vs_target_first)
            .sum::<f64>()
            / m,
    };
    Ok(OverlapReport {
        target: target.config().name.clone(),
        speculator: speculator.config().name.clone(),
        top: cfg.top,
        random: cfg.top / (2.0 - cfg.top),
        rows,
        mean,
    })
}

/// `specrag-bench overlap`.
pub fn overlap_cmd(m: &ModelArgs, a: OverlapArgs) -> anyhow::Result<()> {
    let (model, spec) = load_pair(m)?;
    let bar = spinner(String::new());
    let cfg = OverlapConfig {
        prompts: a.prompts as usize,
        chunks: a.chunks as usize,
        chunk_tokens: a.chunk_tokens as usize,
        top: a.top,
    };
    let report = overlap_report(&model, spec, &cfg, |m| bar.set_message(m.to_string()))?;
    bar.finish_and_clear();
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    println!(
        "speculator {} -> target {}: Jaccard of the top {:.0}% chunk tokens (random sets: {:.3})",
        report.speculator,
        report.target,
        report.top * 100.0,
        report.random
    );
    println!(
        "{:<60} {:>7} {:>10} {:>10} {:>10}",
        "prompt", "tokens", "spec/deep", "L0/deep", "spec/L0"
    );
    for r in report.rows.iter().chain(std::iter::once(&report.mean)) {
        println!(
            "{:<60} {:>7} {:>10.3} {:>10.3} {:>10.3}",
            r.prompt.chars().take(60).collect::<String>(),
            r.chunk_tokens,
            r.spec_deep_vs_target_deep,
            r.target_first_vs_target_deep,
            r.spec_deep_vs_target_first
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jaccard_and_top_sets_by_hand() {
        assert_eq!(jaccard(&[1, 2, 3], &[2, 3, 4]), 0.5);
        assert_eq!(jaccard(&[], &[]), 1.0);
        assert_eq!(jaccard(&[1], &[2]), 0.0);
        // ceil(0.4 * 5) = 2; the tie between index 1 and 3 goes to the lower index.
        assert_eq!(top_set(&[0.1, 0.9, 0.2, 0.9, 0.5], 0.4), vec![1, 3]);
        assert_eq!(top_set(&[0.1, 0.8, 0.2, 0.9, 0.5], 0.2), vec![3]);
        assert_eq!(top_set(&[1.0, 1.0], 0.0), Vec::<usize>::new());
    }
}
