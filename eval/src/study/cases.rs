//! Running one case of the study: full recompute first, then every configuration compared
//! with it on the same prompt.

use super::*;
use crate::datasets::Case;
use crate::forcing::{teacher_force, Knobs};
use crate::run::{self, Dataset};
use crate::stats::{self};
use chunkstore::Codec;
use gateway::fidelity::Fidelity;
use gateway::pipeline::{Pipeline, Query, Traced};

/// A gold answer contained in the normalized prediction.
pub fn contains_gold(prediction: &str, golds: &[String]) -> bool {
    let p = crate::metrics::normalize_answer(prediction);
    golds.iter().any(|g| {
        let g = crate::metrics::normalize_answer(g);
        !g.is_empty() && format!(" {p} ").contains(&format!(" {g} "))
    })
}

pub(crate) fn mean_kl(reference: &[Vec<f32>], other: &[Vec<f32>]) -> f64 {
    let n = reference.len().min(other.len());
    if n == 0 {
        return 0.0;
    }
    (0..n)
        .map(|i| stats::kl_from_logits(&reference[i], &other[i]))
        .sum::<f64>()
        / n as f64
}

pub(crate) fn mean_nll(steps: &[Vec<f32>], ids: &[u32]) -> f64 {
    let n = steps.len().min(ids.len());
    if n == 0 {
        return f64::NAN;
    }
    (0..n)
        .map(|i| stats::nll_from_logits(&steps[i], ids[i] as usize))
        .sum::<f64>()
        / n as f64
}

/// Where `ids` first takes another token than `full_ids` (full recompute's), and full
/// recompute's logit gap between the two choices there. `path[i]` are full recompute's
/// next-token logits before its own `i`-th token (teacher forcing of its answer over its
/// cache, with one row after the last); up to the split the two answers share that path. An
/// answer that ends where the other goes on chose the end of generation: the best logit of
/// the `eog` tokens. `None` when the token sequences are equal or `path` is too short.
pub fn split_of(full_ids: &[u32], ids: &[u32], path: &[Vec<f32>], eog: &[u32]) -> Option<Split> {
    let at = full_ids.iter().zip(ids).take_while(|(a, b)| a == b).count();
    if at == full_ids.len() && at == ids.len() {
        return None;
    }
    let row = path.get(at)?;
    let logit = |id: Option<&u32>| match id {
        Some(&i) => row.get(i as usize).copied().unwrap_or(f32::NEG_INFINITY),
        None => eog
            .iter()
            .filter_map(|&e| row.get(e as usize).copied())
            .fold(f32::NEG_INFINITY, f32::max),
    };
    Some(Split {
        at,
        gap: logit(full_ids.get(at)) - logit(ids.get(at)),
    })
}

pub(crate) fn ask(
    pipeline: &Pipeline,
    ds: &Dataset,
    case: &Case,
    config: StudyConfig,
    verify: bool,
    measured: bool,
) -> anyhow::Result<Traced> {
    let q = Query {
        query: case.question.clone(),
        collection: run::collection_of(case),
        top_k: ds.top_k,
        method: config.method.query_method(),
        ratio: config.ratio,
        max_tokens: MAX_TOKENS,
        temperature: 0.0,
        seed: 0,
        verify,
        // Selectors are measured as they select (`fast`) unless the configuration names a
        // fidelity (`target_probe@0.25:balanced`).
        fidelity: config.fidelity,
        ..Default::default()
    };
    let knobs = Knobs {
        method: Some(config.method),
        order: ds.order,
        // A measured answer keeps its prefill (teacher forcing) and the blend's signals.
        keep_prefill: measured,
        blend_signals: measured,
        look: config.look,
        ..Default::default()
    };
    pipeline
        .query_with(&q, &knobs, &mut |_| true)
        .map_err(|e| anyhow::anyhow!("case {} with {}: {e}", case.id, config.label()))
}

/// How a study run stores chunk KV and what it measures besides the answers.
#[derive(Debug, Clone, Copy, Default)]
pub struct RunOptions {
    /// The store's codec (labels of lossy and lossless runs carry it, see
    /// [`StudyConfig::label_on`]).
    pub codec: Codec,
    /// Ask every servable configuration but the reference once more with `verify: true`.
    pub verify: bool,
}

/// Answers `case` with every configuration (`configs[0]` is full recompute, the reference);
/// also returns the reference's prompt token ids.
pub fn run_case(
    pipeline: &Pipeline,
    pairing: &str,
    ds: &Dataset,
    case: &Case,
    configs: &[StudyConfig],
    run: RunOptions,
) -> anyhow::Result<(Vec<StudyRecord>, Vec<u32>)> {
    let gold = case.answers.first().map(String::as_str).unwrap_or("");
    let gold_ids = pipeline.engines.target.tokenizer().encode(gold, false).ids;
    let target = &**pipeline
        .engines
        .target
        .cpu_for("the study's teacher forcing")?;
    let reference = ask(pipeline, ds, case, configs[0], false, true)?;
    if reference.answer.chunks.is_empty() {
        anyhow::bail!("case {} retrieved no chunk", case.id);
    }
    // Teacher forcing of the gold answer and of full recompute's, after each prefill.
    let forced = |t: &Traced| -> anyhow::Result<[Vec<Vec<f32>>; 2]> {
        Ok([
            teacher_force(target, t, &gold_ids)?,
            teacher_force(target, t, &reference.ids)?,
        ])
    };
    // Full recompute's logits along its own answer, one row past its end (where another
    // answer splits from it, how near a tie full recompute's own choice was); its first rows
    // are the reference's own teacher forcing.
    let path = teacher_force(target, &reference, &[&reference.ids[..], &[0]].concat())?;
    let ref_forced = [
        teacher_force(target, &reference, &gold_ids)?,
        path[..reference.ids.len().max(1)].to_vec(),
    ];
    let ref_steps = &ref_forced[1];
    let tok = target.tokenizer();
    let eog: Vec<u32> = (0..tok.vocab_size() as u32)
        .filter(|&id| tok.is_end_of_generation(id))
        .collect();
    let mut out = Vec::with_capacity(configs.len());
    for (i, &config) in configs.iter().enumerate() {
        let (t, t_forced) = if i == 0 {
            (reference.clone(), ref_forced.clone())
        } else {
            // Each configuration pays for its own escalations: a full cache another
            // configuration's escalation left for the same prompt would make this one's free.
            pipeline.contexts.clear();
            let t = ask(pipeline, ds, case, config, false, true)?;
            let f = forced(&t)?;
            (t, f)
        };
        // The verified answer of the same query: drafts from this method's cache, checked
        // against full recompute's. A cached full context would skip the drafting.
        let verified = if run.verify && i > 0 && config.method.served().is_some() {
            pipeline.contexts.clear();
            Some(ask(pipeline, ds, case, config, true, false)?)
        } else {
            None
        };
        let steps = &t_forced[1];
        out.push(StudyRecord {
            pairing: pairing.into(),
            dataset: ds.name.clone(),
            case: case.id.clone(),
            config,
            label: config.label_on(run.codec),
            answer: t.answer.answer.clone(),
            correct: contains_gold(&t.answer.answer, &case.answers),
            identical: t.answer.answer == reference.answer.answer,
            kl_first: stats::kl_from_logits(&reference.first_logits, &t.first_logits),
            kl_tf: mean_kl(ref_steps, steps),
            gold_nll: mean_nll(&t_forced[0], &gold_ids),
            ttft_ms: t.answer.timings.ttft_ms,
            timings: t.answer.timings,
            ratio: t.answer.reuse.ratio,
            selected: t.selected.clone(),
            codec: run.codec.name().into(),
            verify: verified.as_ref().and_then(|v| v.answer.verify),
            verify_mode: verified.as_ref().map(|_| pipeline.verify_mode.to_string()),
            verify_spec: verified.as_ref().and_then(|v| v.answer.spec_decode.clone()),
            verified_identical: verified.map(|v| v.answer.answer == reference.answer.answer),
            guard: (config.fidelity != Fidelity::Fast).then_some(t.answer.reuse.guard),
            margin_first: Some(stats::top2_margin(&t.first_logits)),
            margins: (!t.margins.is_empty()).then(|| t.margins.clone()),
            f1: Some(crate::metrics::best_f1(&t.answer.answer, &case.answers)),
            signals: Some(RecordSignals {
                copy: copy_signals(tok, &t),
                ..RecordSignals::new(&t.signals, &t.first_logits)
            }),
            split: split_of(&reference.ids, &t.ids, &path, &eog),
        });
    }
    Ok((out, reference.prompt_ids))
}

/// [`CopySignals`] of a traced answer: its first word of three letters or more that a chunk
/// holds (spelled as after a space or as the answer spells it), the first chunk's tokens
/// counted as fresh with the recomputed ones.
fn copy_signals(tok: &target_engine::Tokenizer, t: &Traced) -> Option<CopySignals> {
    // The first chunk's rows are exact as stored (precomputed after the same prefix; the
    // study stores KV raw): fresh, as recomputed ones are.
    let fresh = t
        .selected
        .iter()
        .filter_map(|s| Some(t.chunks.get(s.chunk)?.start + s.offset))
        .chain(t.chunks.first().cloned().unwrap_or_default())
        .collect();
    t.answer
        .answer
        .split_whitespace()
        .map(|w| w.trim_matches(|c: char| !c.is_alphanumeric()))
        .take(COPY_WORDS)
        .enumerate()
        .filter(|(_, w)| w.chars().filter(|c| c.is_alphabetic()).count() >= 3)
        .find_map(|(at, w)| {
            let spellings = [
                tok.encode(&format!(" {w}"), false).ids,
                tok.encode(w, false).ids,
            ];
            CopySignals::new(w, at, &spellings, &t.prompt_ids, &t.chunks, &fresh)
        })
}
