//! `specrag-bench prefill` (prefill throughput at several lengths and decode latency) and
//! `specrag-bench blend` (blended against full prefill, every selector at each ratio).

use crate::args::{BenchMode, BlendArgs, PrefillArgs};
use eval::method::Method;
use gateway::cli::{load, load_pair, spinner, ModelArgs};
use gateway::method::SelectorInputs;
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;
use target_engine::prelude::*;
use target_engine::{
    reuse::fidelity, Assembly, BlendOutput, ChunkKv, KvCache, Model, PrefixKv, RagTemplate,
    SegmentKind, SelectInput,
};

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
    /// The attention precision the model ran (`f32` or `bf16`, `--attention`).
    pub attention: &'static str,
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
        attention: match model.attention() {
            kernels::AttentionPrecision::F32 => "f32",
            kernels::AttentionPrecision::Bf16 => "bf16",
        },
    })
}

/// One row of `specrag-bench blend`.
#[derive(Debug, Clone, Serialize)]
pub struct BlendRow {
    pub method: String,
    /// Recomputed chunk tokens over all chunk tokens (actual, not requested).
    pub ratio: f64,
    pub ms: f64,
    /// `ms / full_ms`, same run.
    pub rel: f64,
    /// How the reused chunk KV was precomputed: `after_prefix` or `standalone`.
    pub mode: String,
    /// KL divergence (nats) of the next-token distribution from full prefill's.
    pub kl: f64,
    /// SpecCache only: time in the speculator (tokenize, forward, spans).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculate_ms: Option<f64>,
    /// SpecCache only: time mapping the selection to target tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub align_ms: Option<f64>,
}

/// The report of `specrag-bench blend` (the JSON shape of the contract, plus mode and kl).
#[derive(Debug, Clone, Serialize)]
pub struct BlendReport {
    pub tokens: usize,
    pub full_ms: f64,
    pub rows: Vec<BlendRow>,
}

/// Settings of the blend benchmark.
#[derive(Debug, Clone)]
pub struct BlendBenchConfig {
    pub chunks: usize,
    pub chunk_tokens: usize,
    pub ratios: Vec<f64>,
    pub reps: usize,
    /// Precompute modes to measure.
    pub modes: Vec<BenchMode>,
}

/// Deterministic, varied English-like text (seeded), so chunks differ from each other.
fn synthetic_text(seed: u64, words: usize) -> String {
    const SUBJECTS: [&str; 8] = [
        "The archive",
        "A ferry captain",
        "The council",
        "Our chemist",
        "The orchard",
        "A courier",
        "The observatory",
        "Every miller",
    ];
    const VERBS: [&str; 8] = [
        "recorded",
        "questioned",
        "repaired",
        "measured",
        "traded",
        "described",
        "rebuilt",
        "catalogued",
    ];
    const OBJECTS: [&str; 8] = [
        "the northern canal",
        "seventeen copper bells",
        "a forgotten treaty",
        "the winter harvest",
        "two silver compasses",
        "the river toll",
        "an unusual comet",
        "the salt ledger",
    ];
    const TAILS: [&str; 8] = [
        "in 1847.",
        "before the flood.",
        "with great care.",
        "for the guild of Varn.",
        "near Oskel bridge.",
        "during the fair.",
        "at the request of Lady Imra.",
        "without telling anyone.",
    ];
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = |n: usize| {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((s >> 33) as usize) % n
    };
    let mut out = String::new();
    while out.split_whitespace().count() < words {
        out.push_str(&format!(
            "{} {} {} {} ",
            SUBJECTS[next(8)],
            VERBS[next(8)],
            OBJECTS[next(8)],
            TAILS[next(8)]
        ));
    }
    out
}

/// The benchmark's prompt: the template prefix, `chunks` synthetic chunks of `chunk_tokens`
/// tokens, and a question.
fn bench_assembly(model: &Model, cfg: &BlendBenchConfig) -> Assembly {
    let tok = model.tokenizer();
    let template = RagTemplate::for_model(model);
    let mut asm = Assembly::default();
    let (t, ids) = template.prefix(tok);
    asm.push(SegmentKind::Prefix, &t, &ids);
    for i in 0..cfg.chunks {
        let text = synthetic_text(i as u64 + 1, cfg.chunk_tokens);
        let (text, mut ids) = template.chunk(tok, &text);
        ids.truncate(cfg.chunk_tokens);
        let text = if ids.len() < cfg.chunk_tokens {
            text
        } else {
            tok.decode(&ids, true)
        };
        asm.push(SegmentKind::Chunk(i), &text, &ids);
    }
    let (t, ids) = template.question(
        tok,
        "Which document mentions the salt ledger, and who catalogued it?",
    );
    asm.push(SegmentKind::Question, &t, &ids);
    asm
}

/// What every measurement of one precompute mode shares: the prompt, its reused chunk KV and
/// full prefill's time and logits (the reference of every row).
struct Bench<'a> {
    model: &'a Model,
    asm: &'a Assembly,
    prefix: &'a PrefixKv,
    chunks: Vec<&'a ChunkKv>,
    mode: BenchMode,
    full_ms: f64,
    full_logits: &'a [f32],
    reps: usize,
}

impl Bench<'_> {
    fn input(&self, ratio: f64) -> SelectInput<'_> {
        SelectInput::new(self.model, self.asm, self.prefix, &self.chunks, ratio)
    }

    fn row(&self, method: &str, ms: f64, out: &BlendOutput) -> BlendRow {
        BlendRow {
            method: method.to_string(),
            ratio: out.ratio(),
            ms,
            rel: ms / self.full_ms,
            mode: self.mode.name().to_string(),
            kl: fidelity::kl_divergence(self.full_logits, &out.logits),
            speculate_ms: None,
            align_ms: None,
        }
    }

    /// Every target-only method through its one selector: the fixed methods once, the
    /// budgeted ones at each ratio.
    fn target_rows(
        &self,
        ratios: &[f64],
        progress: &mut dyn FnMut(&str),
    ) -> target_engine::Result<Vec<BlendRow>> {
        let mut runs: Vec<(Method, f64)> = vec![
            (Method::FullRecompute, 1.0),
            (Method::FullReuse, 0.0),
            (Method::Prefix, 0.0),
        ];
        for &ratio in ratios {
            for m in [
                Method::Epic,
                Method::Cacheblend,
                Method::TargetProbe,
                Method::TargetProbeSpan,
                Method::Oracle,
                Method::Random,
            ] {
                runs.push((m, ratio));
            }
        }
        let mut rows = Vec::new();
        for (method, ratio) in runs {
            let selector = method.selector(SelectorInputs::default(), 0);
            let mut times = Vec::new();
            let mut last = None;
            for r in 0..self.reps {
                progress(&format!(
                    "{} {}@{ratio} {}/{}",
                    self.mode.name(),
                    method.name(),
                    r + 1,
                    self.reps
                ));
                let t = Instant::now();
                last = Some(selector.prefill(&self.input(ratio))?);
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
            if let Some(out) = last {
                rows.push(self.row(method.name(), median(times), &out));
            }
        }
        Ok(rows)
    }

    /// SpecCache (after-prefix KV only: the mode to ingest with), its time split into
    /// speculate / align / blended prefill, with scores from ingestion and from a query-time
    /// pass with and without span completion.
    fn speccache_rows(
        &self,
        spec: &Arc<Model>,
        ratios: &[f64],
        progress: &mut dyn FnMut(&str),
    ) -> target_engine::Result<Vec<BlendRow>> {
        // Ingestion-time scores: each chunk scored once after the template prefix, as
        // `specrag ingest` stores them; not part of the timed query.
        progress("speculator scores at ingestion");
        let ingest_sel = speculator::SpecCache::new(spec.clone());
        let spec_prefix = ingest_sel.prefix_state(self.asm.segment_text(&self.asm.segments[0]))?;
        let stored: Vec<speculator::ChunkScores> = self
            .asm
            .chunks()
            .map(|seg| ingest_sel.score_chunk(&spec_prefix, self.asm.segment_text(seg)))
            .collect::<Result<_, _>>()?;
        let stored_refs: Vec<&speculator::ChunkScores> = stored.iter().collect();
        let spanned = |complete_spans| speculator::SpecCache {
            params: speculator::SpanParams {
                complete_spans,
                ..Default::default()
            },
            ..speculator::SpecCache::new(spec.clone())
        };
        let (with_spans, without_spans) = (spanned(true), spanned(false));
        let mut rows = Vec::new();
        for &ratio in ratios {
            let input = self.input(ratio);
            let runs: [(&str, SpecSelect<'_>); 3] = [
                (
                    "speccache_ingest",
                    Box::new(|| ingest_sel.select_ingested(&input, &stored_refs)),
                ),
                (
                    Method::Speccache.name(),
                    Box::new(|| with_spans.select_timed(&input)),
                ),
                (
                    Method::SpeccacheNospan.name(),
                    Box::new(|| without_spans.select_timed(&input)),
                ),
            ];
            for (name, select) in &runs {
                if let Some(row) = self.measure_speccache(name, ratio, select, progress)? {
                    rows.push(row);
                }
            }
        }
        Ok(rows)
    }

    /// One SpecCache measurement: median total time over the reps, with the speculate /
    /// align split of that run.
    fn measure_speccache(
        &self,
        name: &str,
        ratio: f64,
        select: &SpecSelect<'_>,
        progress: &mut dyn FnMut(&str),
    ) -> target_engine::Result<Option<BlendRow>> {
        let mut samples = Vec::new();
        let mut last = None;
        for r in 0..self.reps {
            progress(&format!(
                "{} {name} {ratio} {}/{}",
                self.mode.name(),
                r + 1,
                self.reps
            ));
            let t = Instant::now();
            let (picked, timings) = select()?;
            let out = self
                .model
                .blend_prefill(self.asm, self.prefix, &self.chunks, &picked)?;
            samples.push((t.elapsed().as_secs_f64() * 1e3, timings));
            last = Some(out);
        }
        let Some(out) = last else { return Ok(None) };
        samples.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (ms, timings) = samples[samples.len() / 2];
        Ok(Some(BlendRow {
            speculate_ms: Some(timings.speculate_ms),
            align_ms: Some(timings.align_ms),
            ..self.row(name, ms, &out)
        }))
    }
}

/// A SpecCache selection to time: the picked positions and the speculate / align split.
type SpecSelect<'a> =
    Box<dyn Fn() -> target_engine::Result<(Vec<usize>, speculator::SelectTimings)> + 'a>;

/// Blended prefill against full prefill on `chunks x chunk_tokens` tokens and a question, for
/// every baseline selector at each ratio and both precompute modes, in one run.
pub fn blend_report(
    model: &Model,
    speculator: Option<Arc<Model>>,
    cfg: &BlendBenchConfig,
    mut progress: impl FnMut(&str),
) -> target_engine::Result<BlendReport> {
    let asm = bench_assembly(model, cfg);
    progress("prefix and chunk precompute");
    let prefix = model.prefix_kv(&asm.ids[asm.prefix_range()])?;
    let chunk_ids: Vec<&[u32]> = asm.chunks().map(|s| &asm.ids[s.ids.clone()]).collect();
    let after: Vec<ChunkKv> = chunk_ids
        .iter()
        .map(|ids| model.precompute(ids, Some(&prefix)))
        .collect::<Result<_, _>>()?;
    let alone: Vec<ChunkKv> = chunk_ids
        .iter()
        .map(|ids| model.precompute(ids, None))
        .collect::<Result<_, _>>()?;
    let reps = cfg.reps.max(1);
    // The first forward of a freshly loaded model pays page faults on its weights (seconds on
    // the 1.5B model), which would inflate the reference and flatter every ratio.
    progress("warm-up");
    model.prefill(&asm.ids[..asm.ids.len().min(256)])?;
    let mut full_logits = Vec::new();
    let mut times = Vec::new();
    for r in 0..reps {
        progress(&format!("full prefill {}/{reps}", r + 1));
        let t = Instant::now();
        full_logits = model.prefill(&asm.ids)?.1;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let full_ms = median(times);
    let mut rows = Vec::new();
    for (mode, chunks) in [
        (BenchMode::AfterPrefix, &after),
        (BenchMode::Standalone, &alone),
    ] {
        if !cfg.modes.contains(&mode) {
            continue;
        }
        let bench = Bench {
            model,
            asm: &asm,
            prefix: &prefix,
            chunks: chunks.iter().collect(),
            mode,
            full_ms,
            full_logits: &full_logits,
            reps,
        };
        rows.extend(bench.target_rows(&cfg.ratios, &mut progress)?);
        if let (Some(spec), BenchMode::AfterPrefix) = (&speculator, mode) {
            rows.extend(bench.speccache_rows(spec, &cfg.ratios, &mut progress)?);
        }
    }
    Ok(BlendReport {
        tokens: asm.ids.len(),
        full_ms,
        rows,
    })
}

/// `specrag-bench blend`.
pub fn blend_cmd(m: &ModelArgs, a: BlendArgs) -> anyhow::Result<()> {
    let (model, spec) = load_pair(m)?;
    let bar = spinner(String::new());
    let cfg = BlendBenchConfig {
        chunks: a.chunks as usize,
        chunk_tokens: a.chunk_tokens as usize,
        ratios: a.ratios,
        reps: a.reps,
        modes: a.modes,
    };
    let report = blend_report(&model, Some(spec), &cfg, |m| bar.set_message(m.to_string()))?;
    bar.finish_and_clear();
    if a.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    println!(
        "{} tokens, full prefill {:.0} ms",
        report.tokens, report.full_ms
    );
    println!(
        "{:<13} {:<17} {:>6} {:>9} {:>6} {:>9} {:>10} {:>8}",
        "mode", "method", "ratio", "ms", "rel", "KL", "speculate", "align"
    );
    let opt = |x: Option<f64>| x.map_or(String::from("-"), |v| format!("{v:.0}"));
    for r in &report.rows {
        println!(
            "{:<13} {:<17} {:>6.3} {:>9.0} {:>6.3} {:>9.4} {:>10} {:>8}",
            r.mode,
            r.method,
            r.ratio,
            r.ms,
            r.rel,
            r.kl,
            opt(r.speculate_ms),
            opt(r.align_ms)
        );
    }
    Ok(())
}

/// `specrag-bench prefill`.
pub fn prefill_cmd(m: &ModelArgs, a: PrefillArgs) -> anyhow::Result<()> {
    let lengths: Vec<usize> = a.lengths.iter().map(|&n| n as usize).collect();
    let mut paths = vec![m.target_path()?];
    if !a.target_only {
        paths.push(m.speculator_path()?);
    }
    for path in paths {
        let model = load(&path, m)?;
        let bar = spinner(String::new());
        let report = prefill_report(&model, &lengths, a.reps, a.decode_steps, |msg| {
            bar.set_message(format!("{}: {msg}", model.config().name))
        })?;
        bar.finish_and_clear();
        if a.json {
            println!("{}", serde_json::to_string(&report)?);
            continue;
        }
        println!(
            "{} ({}, {} attention)",
            report.model,
            path.display(),
            report.attention
        );
        for p in &report.prefill {
            println!(
                "  prefill {:>5} tokens: {:>9.1} ms  {:>7.1} tok/s",
                p.tokens, p.ms, p.tok_s
            );
        }
        println!("  decode: {:.1} ms/token", report.decode_ms_per_token);
    }
    Ok(())
}
