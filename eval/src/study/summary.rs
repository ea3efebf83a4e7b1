//! What the study's records say: per-configuration summaries with paired intervals, head to
//! head comparisons, codec and verification rows, and the markdown report.

use super::*;
use crate::method::Method;
use crate::stats::{self, Interval, McNemar};
use gateway::pipeline::VerifyStats;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

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

pub(crate) fn by_label<'a>(
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
pub(crate) fn paired(
    a: &BTreeMap<String, &StudyRecord>,
    b: &BTreeMap<String, &StudyRecord>,
    f: impl Fn(&StudyRecord) -> f64,
) -> (Vec<f64>, Vec<f64>) {
    a.iter()
        .filter_map(|(case, ra)| b.get(case).map(|rb| (f(ra), f(rb))))
        .unzip()
}

/// Median of the finite values (the harness's one median, `metrics::median`).
pub(crate) fn median(v: Vec<f64>) -> f64 {
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

pub(crate) fn first_index(records: &[StudyRecord], label: &str) -> usize {
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
    /// Speculative decoding over the full cache: proposals accepted and drafted, summed.
    pub spec: (usize, usize),
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
                spec: rs
                    .values()
                    .filter_map(|r| r.verify_spec.as_ref())
                    .fold((0, 0), |(a, d), s| (a + s.accepted, d + s.drafted)),
            })
        })
        .collect();
    out.sort_by_key(|r| first_index(records, &r.label));
    out
}

pub(crate) fn iv(i: &Interval, scale: f64, digits: usize) -> String {
    format!(
        "{:.d$} [{:.d$}, {:.d$}]",
        i.estimate * scale,
        i.lo * scale,
        i.hi * scale,
        d = digits
    )
}

pub(crate) fn opt_iv(i: &Option<Interval>, scale: f64, digits: usize) -> String {
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
pub(crate) fn write_summary_table(
    out: &mut String,
    sums: &[Summary],
    pairing: &str,
    dataset: &str,
) {
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
pub(crate) fn write_codec_table(
    out: &mut String,
    records: &[StudyRecord],
    pairing: &str,
    dataset: &str,
) {
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
pub(crate) fn write_verify_table(
    out: &mut String,
    records: &[StudyRecord],
    pairing: &str,
    dataset: &str,
) {
    let verified = verify_rows(records, pairing, dataset);
    if !verified.is_empty() {
        out.push_str(
            "\nWith `verify: true` (drafts from the method's cache, checked against a full \
             prefill): drafted tokens accepted, accepted per verification pass, answers whose \
             every draft was accepted, and verified answers equal to full recompute's (must \
             be 100); `full` drafts only while the full prefill runs, `draft-every-N` to the \
             end; then what speculative decoding proposed once decoding went on from the full \
             cache (accepted / drafted):\n\n| config | mode | n | accepted % | per pass | all \
             accepted % | verified identical % | spec-decoded |\n|---|---|---|---|---|---|---|---|\n",
        );
        for r in verified {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {:.1} | {:.2} | {} | {} | {} / {} |",
                r.label,
                r.mode,
                r.n,
                r.accepted * 100.0,
                r.per_pass,
                iv(&r.all_accepted, 100.0, 0),
                iv(&r.identical, 100.0, 0),
                r.spec.0,
                r.spec.1
            );
        }
    }
}
