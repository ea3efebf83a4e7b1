//! The fidelity study (`specrag-eval --study`): does selective recompute answer like full
//! recompute? Every case is answered by full recompute first; every other configuration is
//! compared with it per case on continuous measures (first-token KL, teacher-forced KL over full
//! recompute's answer, the gold answer's NLL) and on the answer itself (identical to full
//! recompute's, gold contained), with paired intervals in the report. Results are appended to
//! `study.jsonl` a case at a time, so a long run can be stopped and resumed (`--resume`).

use crate::datasets::Case;
use crate::run::{self, Dataset};
use crate::stats::{self, Interval, McNemar};
use chunkstore::Codec;
use gateway::fidelity::{Fidelity, GuardReport};
use gateway::pipeline::{
    Method, Pipeline, Query, QueryOptions, Selected, Timings, Traced, VerifyStats,
};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;

/// Generated tokens of every answer (identity is judged on whole answers of this length).
pub const MAX_TOKENS: usize = 32;
/// Bootstrap resamples of every interval.
const RESAMPLES: usize = 2000;

/// One configuration of the study: a method at a ratio.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StudyConfig {
    pub method: Method,
    pub ratio: f64,
    /// The request's fidelity; `fast` (the default, and every row written before the guard)
    /// measures the selector as it selects.
    #[serde(default = "fast", skip_serializing_if = "is_fast")]
    pub fidelity: Fidelity,
}

fn fast() -> Fidelity {
    Fidelity::Fast
}

fn is_fast(f: &Fidelity) -> bool {
    *f == Fidelity::Fast
}

impl StudyConfig {
    /// `method` at `ratio`, unguarded (`fidelity: fast`).
    pub fn at(method: Method, ratio: f64) -> Self {
        Self {
            method,
            ratio,
            fidelity: Fidelity::Fast,
        }
    }

    /// `method@ratio` (the ratio-free methods by name), then `:balanced` or `:exact` when the
    /// configuration is not `fast`.
    pub fn label(&self) -> String {
        let base = if self.method.budgeted() {
            format!("{}@{:.2}", self.method.name(), self.ratio)
        } else {
            self.method.name().to_string()
        };
        match self.fidelity {
            Fidelity::Fast => base,
            f => format!("{base}:{}", f.name()),
        }
    }

    /// The configuration a label names: a method's name, or a budgeted method at a ratio in
    /// `(0, 1]` written with two decimals (`target_probe@0.30`), exactly as [`label`] writes it.
    ///
    /// [`label`]: StudyConfig::label
    pub fn parse(label: &str) -> Option<Self> {
        let (base, fidelity) = match label.split_once(':') {
            Some((b, f)) => (b, Fidelity::parse(f).filter(|f| *f != Fidelity::Fast)?),
            None => (label, Fidelity::Fast),
        };
        let mut c = match base.split_once('@') {
            Some((m, r)) => Self::at(
                Method::parse(m).filter(Method::budgeted)?,
                r.parse().ok().filter(|r| *r > 0.0 && *r <= 1.0)?,
            ),
            None => {
                let method = Method::parse(base).filter(|m| !m.budgeted())?;
                Self::at(method, if method.is_full() { 1.0 } else { 0.0 })
            }
        };
        c.fidelity = fidelity;
        (c.label() == label).then_some(c)
    }

    /// [`StudyConfig::label`] of a run storing chunk KV with `codec`: `+codec` after it unless
    /// the storage is `raw` or the method reads no stored KV (full recompute), so one
    /// study.jsonl pairs a method on each codec against the same method on raw storage.
    pub fn label_on(&self, codec: Codec) -> String {
        if codec == Codec::Raw || self.method.is_full() {
            self.label()
        } else {
            format!("{}+{codec}", self.label())
        }
    }
}

/// How the study's first rows were stored (before rows named their codec).
fn raw_codec() -> String {
    Codec::Raw.name().into()
}

/// The configurations every case runs at `ratio` (full recompute first): the bounds, the
/// default method and the baselines it must beat.
pub fn main_configs(ratio: f64) -> Vec<StudyConfig> {
    let at = |method| StudyConfig::at(method, ratio);
    let mut out = vec![
        StudyConfig::at(Method::FullRecompute, 1.0),
        StudyConfig::at(Method::FullReuse, 0.0),
    ];
    out.extend(
        [
            Method::Oracle,
            Method::Random,
            Method::TargetProbe,
            Method::Cacheblend,
            Method::Epic,
        ]
        .map(at),
    );
    out
}

/// What the first cases of each dataset run besides [`main_configs`]: the other methods at
/// `ratio`, and the ρ sweep of the bounds, the default and the baselines at `ratios`.
pub fn subset_configs(ratio: f64, ratios: &[f64]) -> Vec<StudyConfig> {
    let mut out: Vec<StudyConfig> = [
        Method::TargetProbeSpan,
        Method::SpecAttn,
        Method::SpecAttnFull,
        Method::Speccache,
    ]
    .map(|method| StudyConfig::at(method, ratio))
    .to_vec();
    for &ratio in ratios {
        for method in [
            Method::Oracle,
            Method::Random,
            Method::TargetProbe,
            Method::Cacheblend,
            Method::Epic,
            Method::Speccache,
        ] {
            out.push(StudyConfig::at(method, ratio));
        }
    }
    out
}

/// One answer of one configuration to one case, measured against full recompute's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StudyRecord {
    pub pairing: String,
    pub dataset: String,
    pub case: String,
    pub config: StudyConfig,
    pub label: String,
    pub answer: String,
    /// A gold answer is contained in the answer (normalized as LongBench does).
    pub correct: bool,
    /// The whole answer equals full recompute's.
    pub identical: bool,
    /// KL(full || this) of the first token's distribution.
    pub kl_first: f64,
    /// Mean over full recompute's answer tokens of KL(full || this), both teacher-forced.
    pub kl_tf: f64,
    /// Mean negative log-likelihood per token of the (first) gold answer.
    pub gold_nll: f64,
    pub ttft_ms: f64,
    pub timings: Timings,
    /// Recomputed chunk tokens over all chunk tokens.
    pub ratio: f64,
    pub selected: Vec<Selected>,
    /// How the run stored chunk KV (`--kv-codec`).
    #[serde(default = "raw_codec")]
    pub codec: String,
    /// With `--study-verify`: what the same query with `verify: true` drafted and accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<VerifyStats>,
    /// With `--study-verify`: the verified answer equals full recompute's (it must).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verified_identical: Option<bool>,
    /// With `--study-verify`: how decoding went on once the full cache was ready
    /// (`--study-verify-mode`; rows written before it was recorded ran `full`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify_mode: Option<String>,
    /// What the fidelity guard did (configurations that are not `fast`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guard: Option<GuardReport>,
    /// The first token's top-2 probability margin after this configuration's prefill (for full
    /// recompute: how sure the reference is), a per-request signal for the guard.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub margin_first: Option<f64>,
}

/// A case's prompt as the target reads it in a full prefill (template, chunks, question), so
/// that another engine can be timed on the same token ids
/// (`scripts/compare_ttft_llamacpp.py`); one line per case in `<out>/prompts.jsonl`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptRecord {
    pub pairing: String,
    pub dataset: String,
    pub case: String,
    /// The target model's file name.
    pub target: String,
    pub ids: Vec<u32>,
}

/// A gold answer contained in the normalized prediction.
pub fn contains_gold(prediction: &str, golds: &[String]) -> bool {
    let p = crate::metrics::normalize_answer(prediction);
    golds.iter().any(|g| {
        let g = crate::metrics::normalize_answer(g);
        !g.is_empty() && format!(" {p} ").contains(&format!(" {g} "))
    })
}

fn mean_kl(reference: &[Vec<f32>], other: &[Vec<f32>]) -> f64 {
    let n = reference.len().min(other.len());
    if n == 0 {
        return 0.0;
    }
    (0..n)
        .map(|i| stats::kl_from_logits(&reference[i], &other[i]))
        .sum::<f64>()
        / n as f64
}

fn mean_nll(steps: &[Vec<f32>], ids: &[u32]) -> f64 {
    let n = steps.len().min(ids.len());
    if n == 0 {
        return f64::NAN;
    }
    (0..n)
        .map(|i| stats::nll_from_logits(&steps[i], ids[i] as usize))
        .sum::<f64>()
        / n as f64
}

fn ask(
    pipeline: &Pipeline,
    ds: &Dataset,
    case: &Case,
    config: StudyConfig,
    verify: bool,
    options: QueryOptions,
) -> anyhow::Result<Traced> {
    let q = Query {
        query: case.question.clone(),
        collection: run::collection_of(case),
        top_k: ds.top_k,
        method: config.method,
        ratio: config.ratio,
        max_tokens: MAX_TOKENS,
        temperature: 0.0,
        seed: 0,
        verify,
        options: QueryOptions {
            order: ds.order,
            ..options
        },
        // Selectors are measured as they select (`fast`) unless the configuration names a
        // fidelity (`target_probe@0.25:balanced`).
        fidelity: config.fidelity,
        ..Default::default()
    };
    pipeline
        .query_traced(&q, &mut |_| true)
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
    let reference = ask(
        pipeline,
        ds,
        case,
        configs[0],
        false,
        QueryOptions {
            forced: vec![gold_ids.clone()],
            force_answer: true,
            ..Default::default()
        },
    )?;
    if reference.answer.chunks.is_empty() {
        anyhow::bail!("case {} retrieved no chunk", case.id);
    }
    let ref_steps = reference.forced.get(1).cloned().unwrap_or_default();
    let mut out = Vec::with_capacity(configs.len());
    for (i, &config) in configs.iter().enumerate() {
        let t = if i == 0 {
            reference.clone()
        } else {
            let options = QueryOptions {
                forced: vec![gold_ids.clone(), reference.ids.clone()],
                ..Default::default()
            };
            ask(pipeline, ds, case, config, false, options)?
        };
        // The verified answer of the same query: drafts from this method's cache, checked
        // against full recompute's. A cached full context would skip the drafting.
        let verified = if run.verify && i > 0 && config.method.servable() {
            pipeline.contexts.clear();
            Some(ask(
                pipeline,
                ds,
                case,
                config,
                true,
                QueryOptions::default(),
            )?)
        } else {
            None
        };
        let steps = t.forced.get(1).map(Vec::as_slice).unwrap_or(&[]);
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
            kl_tf: mean_kl(&ref_steps, steps),
            gold_nll: mean_nll(t.forced.first().map_or(&[], Vec::as_slice), &gold_ids),
            ttft_ms: t.answer.timings.ttft_ms,
            timings: t.answer.timings,
            ratio: t.answer.reuse.ratio,
            selected: t.selected.clone(),
            codec: run.codec.name().into(),
            verify: verified.as_ref().and_then(|v| v.answer.verify),
            verify_mode: verified.as_ref().map(|_| pipeline.verify_mode.to_string()),
            verified_identical: verified.map(|v| v.answer.answer == reference.answer.answer),
            guard: (config.fidelity != Fidelity::Fast).then_some(t.answer.reuse.guard),
            margin_first: Some(stats::top2_margin(&t.first_logits)),
        });
    }
    Ok((out, reference.prompt_ids))
}

/// Cases of `path` (a study.jsonl) already answered by every label of `labels`, per
/// (pairing, dataset, case).
pub fn done_cases(records: &[StudyRecord], labels: &[String]) -> HashSet<(String, String, String)> {
    let mut have: BTreeMap<(String, String, String), HashSet<&str>> = BTreeMap::new();
    for r in records {
        have.entry((r.pairing.clone(), r.dataset.clone(), r.case.clone()))
            .or_default()
            .insert(&r.label);
    }
    have.into_iter()
        .filter(|(_, got)| labels.iter().all(|l| got.contains(l.as_str())))
        .map(|(k, _)| k)
        .collect()
}

/// Reads a study.jsonl (missing file: nothing yet). A torn last line (a run killed while
/// writing) is dropped; any other bad line is an error naming it.
pub fn read_records(path: &Path) -> anyhow::Result<Vec<StudyRecord>> {
    read_jsonl(path)
}

/// The lines of a JSON-lines file of `T` (see [`read_records`]).
pub fn read_jsonl<T: serde::de::DeserializeOwned>(path: &Path) -> anyhow::Result<Vec<T>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(anyhow::anyhow!("reading {}: {e}", path.display())),
    };
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut out = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        match serde_json::from_str(line) {
            Ok(r) => out.push(r),
            Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => break,
            Err(e) => anyhow::bail!("{}:{}: {e}", path.display(), i + 1),
        }
    }
    Ok(out)
}

/// Cuts a torn last line (a run killed while writing) off a study.jsonl, so appends start on
/// a fresh line. A missing file is fine.
pub fn repair(path: &Path) -> anyhow::Result<()> {
    let Ok(bytes) = std::fs::read(path) else {
        return Ok(());
    };
    if bytes.is_empty() || bytes.ends_with(b"\n") {
        return Ok(());
    }
    let keep = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| anyhow::anyhow!("opening {}: {e}", path.display()))?;
    f.set_len(keep as u64)?;
    f.sync_data()?;
    Ok(())
}

/// Appends the records of one case (or any JSON lines) and flushes them to disk.
pub fn append<T: Serialize>(path: &Path, records: &[T]) -> anyhow::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| anyhow::anyhow!("opening {}: {e}", path.display()))?;
    let mut buf = String::new();
    for r in records {
        buf.push_str(&serde_json::to_string(r)?);
        buf.push('\n');
    }
    f.write_all(buf.as_bytes())?;
    f.sync_data()?;
    Ok(())
}

/// The paired summary of one configuration against full recompute (and full reuse).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub pairing: String,
    pub dataset: String,
    pub label: String,
    pub n: usize,
    pub accuracy: Interval,
    /// Accuracy minus full recompute's, paired by case.
    pub accuracy_delta: Option<Interval>,
    pub mcnemar: Option<McNemar>,
    pub identical: Interval,
    pub kl_first: Interval,
    pub kl_tf: Interval,
    /// 1 − mean KL_tf / mean KL_tf of full reuse.
    pub gap_closed: Option<Interval>,
    pub gold_nll_delta: Option<Interval>,
    /// Median TTFT over full recompute's median TTFT, same run.
    pub ttft_ratio: f64,
    pub recomputed: f64,
}

fn by_label<'a>(
    records: &'a [StudyRecord],
    pairing: &str,
    dataset: &str,
) -> BTreeMap<String, BTreeMap<String, &'a StudyRecord>> {
    let mut out: BTreeMap<String, BTreeMap<String, &StudyRecord>> = BTreeMap::new();
    for r in records
        .iter()
        .filter(|r| r.pairing == pairing && r.dataset == dataset)
    {
        out.entry(r.label.clone())
            .or_default()
            .insert(r.case.clone(), r);
    }
    out
}

/// Values of `f` for the cases both `a` and `b` answered, in case order.
fn paired(
    a: &BTreeMap<String, &StudyRecord>,
    b: &BTreeMap<String, &StudyRecord>,
    f: impl Fn(&StudyRecord) -> f64,
) -> (Vec<f64>, Vec<f64>) {
    a.iter()
        .filter_map(|(case, ra)| b.get(case).map(|rb| (f(ra), f(rb))))
        .unzip()
}

/// Median of the finite values (the harness's one median, `metrics::median`).
fn median(v: Vec<f64>) -> f64 {
    let finite: Vec<f64> = v.into_iter().filter(|x| x.is_finite()).collect();
    crate::metrics::median(&finite)
}

/// Summaries of every configuration of every (pairing, dataset) in `records`.
pub fn summarize(records: &[StudyRecord]) -> Vec<Summary> {
    let mut keys: Vec<(String, String)> = records
        .iter()
        .map(|r| (r.pairing.clone(), r.dataset.clone()))
        .collect();
    keys.sort();
    keys.dedup();
    let mut out = Vec::new();
    let full_label = Method::FullRecompute.name();
    let reuse_label = Method::FullReuse.name();
    for (pairing, dataset) in keys {
        let labels = by_label(records, &pairing, &dataset);
        let empty = BTreeMap::new();
        let full = labels.get(full_label).unwrap_or(&empty);
        let reuse = labels.get(reuse_label).unwrap_or(&empty);
        let full_ttft = median(full.values().map(|r| r.ttft_ms).collect());
        let mut order: Vec<&String> = labels.keys().collect();
        order.sort_by_key(|l| first_index(records, l));
        for label in order {
            let rs = &labels[label];
            let vals = |f: fn(&StudyRecord) -> f64| rs.values().map(|r| f(r)).collect::<Vec<_>>();
            let (a, b) = paired(rs, full, |r| f64::from(u8::from(r.correct)));
            let (nll_a, nll_b) = paired(rs, full, |r| r.gold_nll);
            let (kl_a, kl_b) = paired(rs, reuse, |r| r.kl_tf);
            let n = rs.len();
            let correct = rs.values().filter(|r| r.correct).count();
            let identical = rs.values().filter(|r| r.identical).count();
            out.push(Summary {
                pairing: pairing.clone(),
                dataset: dataset.clone(),
                label: label.clone(),
                n,
                accuracy: stats::wilson(correct, n),
                accuracy_delta: stats::paired_bootstrap_diff(&a, &b, RESAMPLES, 1),
                mcnemar: stats::mcnemar(
                    &a.iter().map(|&x| x > 0.5).collect::<Vec<_>>(),
                    &b.iter().map(|&x| x > 0.5).collect::<Vec<_>>(),
                ),
                identical: stats::wilson(identical, n),
                kl_first: stats::bootstrap_mean(&vals(|r| r.kl_first), RESAMPLES, 2),
                kl_tf: stats::bootstrap_mean(&vals(|r| r.kl_tf), RESAMPLES, 3),
                gap_closed: stats::bootstrap_ratio_gap(&kl_a, &kl_b, RESAMPLES, 4),
                gold_nll_delta: stats::paired_bootstrap_diff(&nll_a, &nll_b, RESAMPLES, 5),
                ttft_ratio: median(vals(|r| r.ttft_ms)) / full_ttft,
                recomputed: crate::metrics::mean(&vals(|r| r.ratio)),
            });
        }
    }
    out
}

fn first_index(records: &[StudyRecord], label: &str) -> usize {
    records
        .iter()
        .position(|r| r.label == label)
        .unwrap_or(usize::MAX)
}

/// Paired differences of `label` against each of `others` on teacher-forced KL and identity
/// (negative KL difference and positive identity difference favour `label`).
pub fn head_to_head(
    records: &[StudyRecord],
    pairing: &str,
    dataset: &str,
    label: &str,
    others: &[&str],
) -> Vec<(String, Option<Interval>, Option<Interval>)> {
    let labels = by_label(records, pairing, dataset);
    let Some(mine) = labels.get(label) else {
        return Vec::new();
    };
    others
        .iter()
        .filter_map(|o| {
            let theirs = labels.get(*o)?;
            let (a, b) = paired(mine, theirs, |r| r.kl_tf);
            let (ia, ib) = paired(mine, theirs, |r| f64::from(u8::from(r.identical)));
            Some((
                o.to_string(),
                stats::paired_bootstrap_diff(&a, &b, RESAMPLES, 6),
                stats::paired_bootstrap_diff(&ia, &ib, RESAMPLES, 7),
            ))
        })
        .collect()
}

/// Every `method+codec` label of (`pairing`, `dataset`) paired against the same method on raw
/// storage: (label, n, Δ first-token KL, Δ teacher-forced KL, Δ identical, Δ accuracy).
#[allow(clippy::type_complexity, reason = "one report row")]
pub fn codec_rows(
    records: &[StudyRecord],
    pairing: &str,
    dataset: &str,
) -> Vec<(String, usize, [Option<Interval>; 4])> {
    let labels = by_label(records, pairing, dataset);
    let mut out = Vec::new();
    for (label, mine) in &labels {
        let Some((base, _)) = label.split_once('+') else {
            continue;
        };
        let Some(raw) = labels.get(base) else {
            continue;
        };
        let diff = |f: fn(&StudyRecord) -> f64, seed| {
            let (a, b) = paired(mine, raw, f);
            stats::paired_bootstrap_diff(&a, &b, RESAMPLES, seed)
        };
        let n = mine.keys().filter(|c| raw.contains_key(*c)).count();
        out.push((
            label.clone(),
            n,
            [
                diff(|r| r.kl_first, 8),
                diff(|r| r.kl_tf, 9),
                diff(|r| f64::from(u8::from(r.identical)), 10),
                diff(|r| f64::from(u8::from(r.correct)), 11),
            ],
        ));
    }
    out.sort_by_key(|(l, ..)| first_index(records, l));
    out
}

/// What `verify: true` did per label of (`pairing`, `dataset`), over the rows that measured it.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyRow {
    pub label: String,
    /// The verify modes of the rows (`full`, `draft-every-N`), joined by `+` when mixed.
    pub mode: String,
    pub n: usize,
    /// Drafted tokens the full cache accepted, over all drafted.
    pub accepted: f64,
    /// Mean over cases of the drafted tokens accepted per verification pass.
    pub per_pass: f64,
    /// Answers whose every draft was accepted (the draft was full recompute's answer).
    pub all_accepted: Interval,
    /// Verified answers equal to full recompute's (must be all).
    pub identical: Interval,
}

/// [`VerifyRow`]s of (`pairing`, `dataset`), in the order the labels first appear.
pub fn verify_rows(records: &[StudyRecord], pairing: &str, dataset: &str) -> Vec<VerifyRow> {
    let mut out: Vec<VerifyRow> = by_label(records, pairing, dataset)
        .into_iter()
        .filter_map(|(label, rs)| {
            let v: Vec<(VerifyStats, bool)> = rs
                .values()
                .filter_map(|r| Some((r.verify?, r.verified_identical?)))
                .collect();
            if v.is_empty() {
                return None;
            }
            let modes: BTreeSet<&str> = rs
                .values()
                .filter(|r| r.verify.is_some())
                .map(|r| r.verify_mode.as_deref().unwrap_or("full"))
                .collect();
            let drafted: usize = v.iter().map(|(s, _)| s.drafted).sum();
            let accepted: usize = v.iter().map(|(s, _)| s.accepted).sum();
            let n = v.len();
            Some(VerifyRow {
                label,
                mode: modes.into_iter().collect::<Vec<_>>().join("+"),
                n,
                accepted: accepted as f64 / drafted.max(1) as f64,
                per_pass: v.iter().map(|(s, _)| s.mean_accepted).sum::<f64>() / n as f64,
                all_accepted: stats::wilson(v.iter().filter(|(s, _)| s.corrected == 0).count(), n),
                identical: stats::wilson(v.iter().filter(|(_, same)| *same).count(), n),
            })
        })
        .collect();
    out.sort_by_key(|r| first_index(records, &r.label));
    out
}

fn iv(i: &Interval, scale: f64, digits: usize) -> String {
    format!(
        "{:.d$} [{:.d$}, {:.d$}]",
        i.estimate * scale,
        i.lo * scale,
        i.hi * scale,
        d = digits
    )
}

fn opt_iv(i: &Option<Interval>, scale: f64, digits: usize) -> String {
    i.as_ref().map_or("–".into(), |i| iv(i, scale, digits))
}

/// Name of the pooled dataset of [`pooled`].
pub const ALL_DATASETS: &str = "all";

/// The records of every pairing that ran more than one dataset once more, as one dataset
/// ([`ALL_DATASETS`], cases named `dataset/case`), so that the report can pair the
/// configurations over every case of a pairing at once. A configuration that ran on some
/// datasets only is pooled over those (its `n` says so).
pub fn pooled(records: &[StudyRecord]) -> Vec<StudyRecord> {
    let mut datasets: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for r in records {
        datasets
            .entry(r.pairing.as_str())
            .or_default()
            .insert(r.dataset.as_str());
    }
    records
        .iter()
        .filter(|r| datasets[r.pairing.as_str()].len() > 1)
        .map(|r| StudyRecord {
            dataset: ALL_DATASETS.to_string(),
            case: format!("{}/{}", r.dataset, r.case),
            ..r.clone()
        })
        .collect()
}

/// The study's Markdown report: one table per (pairing, dataset), a pooled one per pairing
/// that ran several datasets, each followed by the head-to-head comparisons of `best` against
/// the baselines.
pub fn markdown(records: &[StudyRecord], best: &str) -> String {
    let mut out = String::from(
        "# Fidelity study\n\nEvery configuration is paired per case with full recompute's \
         answer (greedy, 32 tokens). Intervals are 95% (Wilson for proportions, paired \
         bootstrap of cases otherwise). Δ = configuration − full recompute. Gap closed = 1 − \
         mean teacher-forced KL / full reuse's. McNemar p compares correctness with full \
         recompute. The `all` section of a pairing pools its datasets' cases.\n",
    );
    // The pooled copies are summarized on their own; the originals are not copied.
    let pooled = pooled(records);
    let mut sums = summarize(records);
    sums.extend(summarize(&pooled));
    // Stable: each section keeps its configurations' order; `all` sorts first in a pairing.
    sums.sort_by(|a, b| (&a.pairing, &a.dataset).cmp(&(&b.pairing, &b.dataset)));
    let mut keys: Vec<(&str, &str)> = sums
        .iter()
        .map(|s| (s.pairing.as_str(), s.dataset.as_str()))
        .collect();
    keys.dedup();
    for (pairing, dataset) in keys {
        let records = if dataset == ALL_DATASETS {
            pooled.as_slice()
        } else {
            records
        };
        write_summary_table(&mut out, &sums, pairing, dataset);
        let h2h = head_to_head(
            records,
            pairing,
            dataset,
            best,
            &[
                "full_reuse",
                "cacheblend@0.15",
                "epic@0.15",
                "speccache@0.15",
                "random@0.15",
                "oracle@0.15",
            ],
        );
        if !h2h.is_empty() {
            let _ = write!(
                out,
                "\n`{best}` against each, paired (Δ teacher-forced KL < 0 and Δ identical > 0 \
                 favour `{best}`):\n\n| against | Δ KL teacher-forced | Δ identical pts |\n|---|---|---|\n"
            );
            for (o, kl, id) in h2h {
                let _ = writeln!(
                    out,
                    "| {o} | {} | {} |",
                    opt_iv(&kl, 1.0, 3),
                    opt_iv(&id, 100.0, 0)
                );
            }
        }
        write_codec_table(&mut out, records, pairing, dataset);
        write_verify_table(&mut out, records, pairing, dataset);
    }
    out
}

/// The section heading and the summary table of (`pairing`, `dataset`).
fn write_summary_table(out: &mut String, sums: &[Summary], pairing: &str, dataset: &str) {
    let _ = write!(
        out,
        "\n## {pairing} / {dataset}\n\n| config | n | recomputed | accuracy % | Δ accuracy pts | \
         McNemar p | identical % | KL first | KL teacher-forced | gap closed % | Δ gold NLL | \
         TTFT ÷ full |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    );
    for s in sums
        .iter()
        .filter(|s| s.pairing == pairing && s.dataset == dataset)
    {
        let _ = writeln!(
            out,
            "| {} | {} | {:.3} | {} | {} | {} | {} | {} | {} | {} | {} | {:.2} |",
            s.label,
            s.n,
            s.recomputed,
            iv(&s.accuracy, 100.0, 0),
            opt_iv(&s.accuracy_delta, 100.0, 0),
            s.mcnemar
                .map_or("–".into(), |m| format!("{:.3}", m.p_value)),
            iv(&s.identical, 100.0, 0),
            iv(&s.kl_first, 1.0, 3),
            iv(&s.kl_tf, 1.0, 3),
            opt_iv(&s.gap_closed, 100.0, 0),
            opt_iv(&s.gold_nll_delta, 1.0, 3),
            s.ttft_ratio
        );
    }
}

/// The codec table of (`pairing`, `dataset`), when the study ran any non-raw storage.
fn write_codec_table(out: &mut String, records: &[StudyRecord], pairing: &str, dataset: &str) {
    let codecs = codec_rows(records, pairing, dataset);
    if !codecs.is_empty() {
        out.push_str(
            "\nLossy and lossless storage (`--kv-codec`), each paired against the same method \
             on raw f16 storage (Δ = codec − raw):\n\n| on codec | n | Δ KL first | Δ KL \
             teacher-forced | Δ identical pts | Δ accuracy pts |\n|---|---|---|---|---|---|\n",
        );
        for (label, n, [klf, kltf, id, acc]) in codecs {
            let _ = writeln!(
                out,
                "| {label} | {n} | {} | {} | {} | {} |",
                opt_iv(&klf, 1.0, 3),
                opt_iv(&kltf, 1.0, 3),
                opt_iv(&id, 100.0, 0),
                opt_iv(&acc, 100.0, 0)
            );
        }
    }
}

/// The verification table of (`pairing`, `dataset`), when the study ran with `--study-verify`.
fn write_verify_table(out: &mut String, records: &[StudyRecord], pairing: &str, dataset: &str) {
    let verified = verify_rows(records, pairing, dataset);
    if !verified.is_empty() {
        out.push_str(
            "\nWith `verify: true` (drafts from the method's cache, checked against a full \
             prefill): drafted tokens accepted, accepted per verification pass, answers whose \
             every draft was accepted, and verified answers equal to full recompute's (must \
             be 100); `full` drafts only while the full prefill runs, `draft-every-N` to the \
             end:\n\n| config | mode | n | accepted % | per pass | all accepted % | verified \
             identical % |\n|---|---|---|---|---|---|---|\n",
        );
        for r in verified {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.1} | {:.2} | {} | {} |",
                r.label,
                r.mode,
                r.n,
                r.accepted * 100.0,
                r.per_pass,
                iv(&r.all_accepted, 100.0, 0),
                iv(&r.identical, 100.0, 0)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_label_parses_back_to_its_configuration() {
        for c in main_configs(0.15)
            .into_iter()
            .chain(subset_configs(0.15, &[0.3, 0.05]))
        {
            assert_eq!(StudyConfig::parse(&c.label()), Some(c), "{}", c.label());
        }
        let c = StudyConfig::parse("target_probe@0.30").expect("a ratio outside the sweep");
        assert_eq!((c.method, c.ratio), (Method::TargetProbe, 0.3));
        let g = StudyConfig::parse("target_probe@0.25:balanced").expect("a guarded one");
        assert_eq!(
            (g.method, g.fidelity),
            (Method::TargetProbe, Fidelity::Balanced)
        );
        assert_eq!(g.label(), "target_probe@0.25:balanced");
        // Old rows (no fidelity) read as fast, and fast configurations write no fidelity.
        let old: StudyConfig =
            serde_json::from_str(r#"{"method":"epic","ratio":0.15}"#).expect("an old row");
        assert_eq!(old, StudyConfig::at(Method::Epic, 0.15));
        assert_eq!(
            serde_json::to_string(&old).ok().as_deref(),
            Some(r#"{"method":"epic","ratio":0.15}"#)
        );
        for bad in [
            "target_probe@0.25:fast",
            "target_probe@0.25:lossless",
            "epic@0.2",
            "epic@1.50",
            "epic@0.00",
            "full_reuse@0.15",
            "target_probe",
            "nope@0.15",
            "epic@x",
        ] {
            assert_eq!(StudyConfig::parse(bad), None, "{bad}");
        }
    }

    fn record(dataset: &str, case: &str, label: &str, identical: bool, kl_tf: f64) -> StudyRecord {
        let (method, ratio) = match label.split_once('@') {
            Some((m, r)) => (
                Method::parse(m).expect("a method"),
                r.parse().expect("a ratio"),
            ),
            None => (Method::parse(label).expect("a method"), 0.0),
        };
        StudyRecord {
            pairing: "small".into(),
            dataset: dataset.into(),
            case: case.into(),
            config: StudyConfig::at(method, ratio),
            label: label.into(),
            answer: String::new(),
            correct: identical,
            identical,
            kl_first: kl_tf,
            kl_tf,
            gold_nll: 1.0,
            ttft_ms: 1.0,
            timings: Timings::default(),
            ratio,
            selected: Vec::new(),
            codec: raw_codec(),
            verify: None,
            verified_identical: None,
            verify_mode: None,
            guard: None,
            margin_first: None,
        }
    }

    #[test]
    fn the_pooled_section_pairs_every_case_of_every_dataset() {
        let mut recs = Vec::new();
        for (ds, n, same) in [("profiles", 3, true), ("records", 2, false)] {
            for i in 0..n {
                let case = format!("c{i}");
                recs.push(record(ds, &case, "full_recompute", true, 0.0));
                recs.push(record(ds, &case, "full_reuse", same, 0.4));
                recs.push(record(ds, &case, "target_probe@0.15", true, 0.1));
            }
        }
        // The same case name in both datasets stays two cases.
        let pooled = pooled(&recs);
        assert_eq!(pooled.len(), recs.len());
        let sums = summarize(&pooled);
        let reuse = sums
            .iter()
            .find(|s| s.label == "full_reuse")
            .expect("full reuse pooled");
        assert_eq!((reuse.dataset.as_str(), reuse.n), (ALL_DATASETS, 5));
        assert!((reuse.identical.estimate - 0.6).abs() < 1e-12);
        let probe = sums
            .iter()
            .find(|s| s.label == "target_probe@0.15")
            .expect("target_probe pooled");
        let gap = probe.gap_closed.expect("a gap against full reuse");
        assert!((gap.estimate - 0.75).abs() < 1e-9);
        let md = markdown(&recs, "target_probe@0.15");
        assert!(md.contains("## small / all") && md.contains("## small / records"));
        // One dataset: nothing to pool.
        assert!(super::pooled(&recs[..9]).is_empty());
    }
}
