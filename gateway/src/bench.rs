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

/// One measured variant of blended prefill.
type BlendRun<'a> = Box<dyn Fn() -> target_engine::Result<target_engine::BlendOutput> + 'a>;

/// One row of `specrag bench blend`.
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

/// The report of `specrag bench blend` (the JSON shape of the contract, plus mode and kl).
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
    /// Precompute modes to measure: `after_prefix`, `standalone`.
    pub modes: Vec<String>,
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

/// Blended prefill against full prefill on `chunks x chunk_tokens` tokens and a question, for
/// every baseline selector at each ratio and both precompute modes, in one run.
pub fn blend_report(
    model: &Model,
    speculator: Option<std::sync::Arc<Model>>,
    cfg: &BlendBenchConfig,
    mut progress: impl FnMut(&str),
) -> target_engine::Result<BlendReport> {
    use crate::method::{Method, SelectorInputs};
    use target_engine::{fidelity, Assembly, ChunkKv, RagTemplate, SegmentKind, SelectInput};
    let tok = model.tokenizer();
    let template = RagTemplate::default();
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
    progress("prefix and chunk precompute");
    let prefix = model.prefix_kv(&asm.ids[asm.prefix_range()])?;
    let chunk_ids: Vec<Vec<u32>> = asm
        .chunks()
        .map(|s| asm.ids[s.ids.clone()].to_vec())
        .collect();
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
    for (mode, chunks) in [("after_prefix", &after), ("standalone", &alone)] {
        if !cfg.modes.iter().any(|m| m == mode) {
            continue;
        }
        let refs: Vec<&ChunkKv> = chunks.iter().collect();
        let input = |ratio| SelectInput::new(model, &asm, &prefix, &refs, ratio);
        // Every target-only method at each ratio through its one selector; the fixed methods
        // once.
        let mut runs: Vec<(Method, f64)> = vec![
            (Method::FullRecompute, 1.0),
            (Method::FullReuse, 0.0),
            (Method::Prefix, 0.0),
        ];
        for &ratio in &cfg.ratios {
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
        let runs: Vec<(String, BlendRun<'_>)> = runs
            .into_iter()
            .map(|(m, ratio)| {
                let input = &input;
                let run: BlendRun<'_> =
                    Box::new(move || m.selector(SelectorInputs::default()).prefill(&input(ratio)));
                (format!("{}@{ratio}", m.name()), run)
            })
            .collect();
        for (name, run) in &runs {
            let mut times = Vec::new();
            let mut last = None;
            for r in 0..reps {
                progress(&format!("{mode} {name} {}/{reps}", r + 1));
                let t = Instant::now();
                last = Some(run()?);
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
            let Some(out) = last else { continue };
            let ms = median(times);
            rows.push(BlendRow {
                method: name.split('@').next().unwrap_or(name).to_string(),
                ratio: out.ratio(),
                ms,
                rel: ms / full_ms,
                mode: mode.to_string(),
                kl: fidelity::kl_divergence(&full_logits, &out.logits),
                speculate_ms: None,
                align_ms: None,
            });
        }
        // SpecCache (after-prefix KV only: it is the mode to ingest with), time split into
        // speculate / align / blended prefill.
        if let (Some(spec), "after_prefix") = (&speculator, mode) {
            // Ingestion-time scores: each chunk scored once after the template prefix, as
            // `specrag ingest` stores them; not part of the timed query.
            progress("speculator scores at ingestion");
            let ingest_sel = speculator::SpecCache::new(spec.clone());
            let spec_prefix = ingest_sel.prefix_state(asm.segment_text(&asm.segments[0]))?;
            let stored: Vec<speculator::ChunkScores> = asm
                .chunks()
                .map(|seg| ingest_sel.score_chunk(&spec_prefix, asm.segment_text(seg)))
                .collect::<Result<_, _>>()?;
            let stored_refs: Vec<&speculator::ChunkScores> = stored.iter().collect();
            // One SpecCache measurement: median total time over the reps, with the speculate /
            // align split of that run.
            let mut measure = |name: &str,
                               ratio: f64,
                               select: &dyn Fn() -> target_engine::Result<(
                Vec<usize>,
                speculator::SelectTimings,
            )>|
             -> target_engine::Result<()> {
                let mut samples = Vec::new();
                let mut last = None;
                for r in 0..reps {
                    progress(&format!("{mode} {name} {ratio} {}/{reps}", r + 1));
                    let t = Instant::now();
                    let (picked, timings) = select()?;
                    let out = model.blend_prefill(&asm, &prefix, &refs, &picked)?;
                    samples.push((t.elapsed().as_secs_f64() * 1e3, timings));
                    last = Some(out);
                }
                let Some(out) = last else { return Ok(()) };
                samples.sort_by(|a, b| a.0.total_cmp(&b.0));
                let (ms, timings) = samples[samples.len() / 2];
                rows.push(BlendRow {
                    method: name.to_string(),
                    ratio: out.ratio(),
                    ms,
                    rel: ms / full_ms,
                    mode: mode.to_string(),
                    kl: fidelity::kl_divergence(&full_logits, &out.logits),
                    speculate_ms: Some(timings.speculate_ms),
                    align_ms: Some(timings.align_ms),
                });
                Ok(())
            };
            for &ratio in &cfg.ratios {
                measure("speccache_ingest", ratio, &|| {
                    ingest_sel.select_ingested(&input(ratio), &stored_refs)
                })?;
                for complete_spans in [true, false] {
                    let sel = speculator::SpecCache {
                        params: speculator::SpanParams {
                            complete_spans,
                            ..Default::default()
                        },
                        ..speculator::SpecCache::new(spec.clone())
                    };
                    let name = if complete_spans {
                        Method::Speccache
                    } else {
                        Method::SpeccacheNospan
                    };
                    measure(name.name(), ratio, &|| sel.select_timed(&input(ratio)))?;
                }
            }
        }
    }
    Ok(BlendReport {
        tokens: asm.ids.len(),
        full_ms,
        rows,
    })
}
