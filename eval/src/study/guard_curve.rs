//! The fidelity guard's operating curve from a study run (`specrag-eval --guard-curve`):
//! for each margin threshold, what a `balanced` request would have answered, at what cost.
//!
//! A study row of a reused configuration (`fast`) records the top-2 logit gap of every token
//! it decoded; its case's full-recompute row records full recompute's answer and timings. The
//! guard escalates at the first watched token whose gap is below the threshold, and an
//! escalated answer is full recompute's token for token (the pipeline's tested invariant), so
//! each threshold's answers follow from the two rows. Costs are charged as the pipeline does,
//! erring high: an escalated request's total is the reused decode up to the escalation plus
//! full recompute's whole request; its first token is the reused one when the escalation
//! came after it and the answers agree (the token stays), otherwise it arrives once the full
//! prefill after the reused decode is done (a first token that may have agreed is charged
//! too). The pipeline's escalation keeps the reused cache's prefix and first chunk and
//! prefills the rest, so it costs less than charged here (0.56 against 0.61 of full
//! recompute's mean request on the held-out multi-hop questions); a run with `:balanced`
//! configurations measures the real guard.

use super::StudyRecord;
use crate::metrics::median;
use crate::stats::{wilson, Interval};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// What a guarded request would have been for one case.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GuardedCase {
    pub escalated: bool,
    pub identical: bool,
    /// Identical, or split from full recompute's answer only at a near tie of its own
    /// ([`StudyRecord::identical_or_near_tie`]).
    pub near_tie: bool,
    /// TTFT over full recompute's.
    pub ttft_ratio: f64,
    /// Whole request time over full recompute's.
    pub total_ratio: f64,
    pub f1: f64,
    pub full_f1: f64,
}

/// One threshold's outcome over a set of cases.
#[derive(Debug, Clone, PartialEq)]
pub struct CurvePoint {
    pub margin: f32,
    pub cases: usize,
    pub escalated: usize,
    pub identical: usize,
    pub identity: Interval,
    /// Cases identical or split only at a near tie of full recompute's own.
    pub near_tie: usize,
    pub median_ttft_ratio: f64,
    pub mean_total_ratio: f64,
    /// Mean F1 of the guarded answers over full recompute's mean F1.
    pub f1_ratio: f64,
    /// The costliest escalated request's time over full recompute's (0 without one).
    pub worst_escalated_ratio: f64,
}

/// The guard's decision on `row` (a reused configuration's answer) with full recompute's
/// `full` row of the same case; `None` when `row` has no margins recorded.
pub fn guard_case(
    row: &StudyRecord,
    full: &StudyRecord,
    margin: f32,
    horizon: usize,
) -> Option<GuardedCase> {
    let margins = row.margins.as_ref()?;
    let fire = margins.iter().take(horizon).position(|&m| m < margin);
    let (full_ttft, full_total) = (full.ttft_ms.max(1e-9), full.timings.total_ms.max(1e-9));
    let (ttft, total) = match fire {
        Some(i) => {
            let per_token = (row.timings.total_ms - row.ttft_ms).max(0.0) / margins.len() as f64;
            let moved = row.ttft_ms + i as f64 * per_token;
            // The tokens shown before the move stay when they agree with full recompute:
            // certainly when the whole answer does (and something was shown); otherwise the
            // first token is charged as arriving once the full cache is ready.
            let ttft = if i > 0 && row.identical {
                row.ttft_ms
            } else {
                moved + full.timings.prefill_ms
            };
            (ttft, moved + full.timings.total_ms)
        }
        None => (row.ttft_ms, row.timings.total_ms),
    };
    let full_f1 = full.f1.unwrap_or(0.0);
    Some(GuardedCase {
        escalated: fire.is_some(),
        identical: fire.is_some() || row.identical,
        near_tie: fire.is_some() || row.identical_or_near_tie(),
        ttft_ratio: ttft / full_ttft,
        total_ratio: total / full_total,
        f1: if fire.is_some() {
            full_f1
        } else {
            row.f1.unwrap_or(0.0)
        },
        full_f1,
    })
}

/// Summarizes guarded cases at one threshold.
pub fn point(margin: f32, cases: &[GuardedCase]) -> CurvePoint {
    let n = cases.len();
    let identical = cases.iter().filter(|c| c.identical).count();
    let ttft: Vec<f64> = cases.iter().map(|c| c.ttft_ratio).collect();
    let total: f64 = cases.iter().map(|c| c.total_ratio).sum();
    let (f1, full_f1): (f64, f64) = cases
        .iter()
        .fold((0.0, 0.0), |(a, b), c| (a + c.f1, b + c.full_f1));
    CurvePoint {
        margin,
        cases: n,
        escalated: cases.iter().filter(|c| c.escalated).count(),
        identical,
        identity: wilson(identical, n),
        near_tie: cases.iter().filter(|c| c.near_tie).count(),
        median_ttft_ratio: median(&ttft),
        mean_total_ratio: if n == 0 { f64::NAN } else { total / n as f64 },
        f1_ratio: if full_f1 > 0.0 {
            f1 / full_f1
        } else {
            f64::NAN
        },
        worst_escalated_ratio: cases
            .iter()
            .filter(|c| c.escalated)
            .map(|c| c.total_ratio)
            .fold(0.0, f64::max),
    }
}

/// When a perfect predictor decides to escalate (see [`oracle_case`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OracleAt {
    /// At the first token, as the guard decides: the reused prefill is already paid.
    FirstToken,
    /// Before any reused work: an escalated request costs full recompute's alone.
    BeforeReuse,
    /// At the first token, escalating only the answers that split from full recompute's
    /// beyond a near tie ([`StudyRecord::identical_or_near_tie`]): the fewest escalations for
    /// 100% identity up to near ties.
    BeyondNearTie,
}

/// What a guard that knew the answer would have done for one case: escalate exactly the
/// requests whose reused answer differs from full recompute's, at `at`. No predictor does
/// better on the same rows, so its point bounds every threshold's (and any other signal's):
/// the fewest escalations for 100% identity and the least time they can cost.
pub fn oracle_case(row: &StudyRecord, full: &StudyRecord, at: OracleAt) -> GuardedCase {
    let (full_ttft, full_total) = (full.ttft_ms.max(1e-9), full.timings.total_ms.max(1e-9));
    let escalated = match at {
        OracleAt::BeyondNearTie => !row.identical_or_near_tie(),
        OracleAt::FirstToken | OracleAt::BeforeReuse => !row.identical,
    };
    let (ttft, total) = match (escalated, at) {
        (false, _) => (row.ttft_ms, row.timings.total_ms),
        (true, OracleAt::FirstToken | OracleAt::BeyondNearTie) => (
            row.ttft_ms + full.timings.prefill_ms,
            row.ttft_ms + full.timings.total_ms,
        ),
        (true, OracleAt::BeforeReuse) => (full.ttft_ms, full.timings.total_ms),
    };
    let full_f1 = full.f1.unwrap_or(0.0);
    GuardedCase {
        escalated,
        identical: escalated || row.identical,
        near_tie: true,
        ttft_ratio: ttft / full_ttft,
        total_ratio: total / full_total,
        f1: if escalated {
            full_f1
        } else {
            row.f1.unwrap_or(0.0)
        },
        full_f1,
    }
}

/// Per dataset (and `pooled`), the perfect predictor's point on `label`'s rows, deciding at
/// the first token, before reuse, and at the first token for splits beyond a near tie only
/// (`margin` is NaN: no threshold).
pub fn oracle_points(records: &[StudyRecord], label: &str) -> BTreeMap<String, [CurvePoint; 3]> {
    let pairs = with_full(records, label);
    dataset_names(pairs.iter().map(|(r, _)| *r))
        .into_iter()
        .map(|ds| {
            let at = |when: OracleAt| {
                let cases: Vec<GuardedCase> = pairs
                    .iter()
                    .filter(|(r, _)| ds == "pooled" || r.dataset == ds)
                    .map(|(r, f)| oracle_case(r, f, when))
                    .collect();
                point(f32::NAN, &cases)
            };
            let points = [
                at(OracleAt::FirstToken),
                at(OracleAt::BeforeReuse),
                at(OracleAt::BeyondNearTie),
            ];
            (ds, points)
        })
        .collect()
}

/// `label`'s rows of `records`, each with full recompute's row of the same case (rows without
/// one are left out).
fn with_full<'a>(
    records: &'a [StudyRecord],
    label: &str,
) -> Vec<(&'a StudyRecord, &'a StudyRecord)> {
    let key = |r: &'a StudyRecord| (r.pairing.as_str(), r.dataset.as_str(), r.case.as_str());
    let full: BTreeMap<_, &StudyRecord> = records
        .iter()
        .filter(|r| r.label == "full_recompute")
        .map(|r| (key(r), r))
        .collect();
    records
        .iter()
        .filter(|r| r.label == label)
        .filter_map(|r| full.get(&key(r)).map(|f| (r, *f)))
        .collect()
}

/// The datasets of `rows`, sorted, then `pooled`.
fn dataset_names<'a>(rows: impl Iterator<Item = &'a StudyRecord>) -> Vec<String> {
    let mut names: Vec<String> = rows.map(|r| r.dataset.clone()).collect();
    names.sort();
    names.dedup();
    names.push("pooled".into());
    names
}

/// Per dataset (and `pooled`), the curve of configuration `label` over `margins`, watching
/// the first `horizon` tokens. Cases without a full-recompute row or margins are skipped.
pub fn curve(
    records: &[StudyRecord],
    label: &str,
    margins: &[f32],
    horizon: usize,
) -> BTreeMap<String, Vec<CurvePoint>> {
    let pairs = with_full(records, label);
    let mut out = BTreeMap::new();
    for ds in dataset_names(pairs.iter().map(|(r, _)| *r)) {
        let points = margins
            .iter()
            .map(|&m| {
                let cases: Vec<GuardedCase> = pairs
                    .iter()
                    .filter(|(r, _)| ds == "pooled" || r.dataset == ds)
                    .filter_map(|(r, f)| guard_case(r, f, m, horizon))
                    .collect();
                point(m, &cases)
            })
            .collect();
        out.insert(ds, points);
    }
    out
}

/// The area under the ROC curve of `risk` separating `positive` cases from the others (ties
/// count half): the chance a random positive scores above a random negative; NaN without both.
pub fn auc(cases: &[(f64, bool)]) -> f64 {
    let pos: Vec<f64> = cases.iter().filter(|c| c.1).map(|c| c.0).collect();
    let neg: Vec<f64> = cases.iter().filter(|c| !c.1).map(|c| c.0).collect();
    if pos.is_empty() || neg.is_empty() {
        return f64::NAN;
    }
    let mut wins = 0.0;
    for p in &pos {
        for n in &neg {
            wins += if p > n {
                1.0
            } else if p == n {
                0.5
            } else {
                0.0
            };
        }
    }
    wins / (pos.len() * neg.len()) as f64
}

/// Per dataset (and `pooled`), how well each per-request signal the guard could watch ranks
/// `label`'s answers that differ from full recompute's above those that do not (AUC): the
/// smallest top-2 logit gap over the whole answer, over its first 4 tokens, the first token's
/// gap, and the first token's top-2 probability margin. Each is negated (a small gap is risk).
pub fn signal_aucs(
    records: &[StudyRecord],
    label: &str,
) -> BTreeMap<String, [(&'static str, f64); 4]> {
    let rows: Vec<&StudyRecord> = records
        .iter()
        .filter(|r| r.label == label && r.margins.as_ref().is_some_and(|m| !m.is_empty()))
        .collect();
    let min_of = |r: &StudyRecord, n: usize| -> f64 {
        let m = r.margins.as_deref().unwrap_or(&[]);
        f64::from(m.iter().take(n).copied().fold(f32::INFINITY, f32::min))
    };
    dataset_names(rows.iter().copied())
        .into_iter()
        .map(|ds| {
            let of = |f: &dyn Fn(&StudyRecord) -> f64| {
                let cases: Vec<(f64, bool)> = rows
                    .iter()
                    .filter(|r| ds == "pooled" || r.dataset == ds)
                    .map(|r| (-f(r), !r.identical))
                    .collect();
                auc(&cases)
            };
            let aucs = [
                ("min gap, whole answer", of(&|r| min_of(r, usize::MAX))),
                ("min gap, first 4 tokens", of(&|r| min_of(r, 4))),
                ("first token's gap", of(&|r| min_of(r, 1))),
                (
                    "first token's probability margin",
                    of(&|r| r.margin_first.unwrap_or(f64::NAN)),
                ),
            ];
            (ds, aucs)
        })
        .collect()
}

/// Whether `text` repeats a run of `n` words (a loop, seen in the text: the study keeps no ids).
pub fn repeats_words(text: &str, n: usize) -> bool {
    let words: Vec<&str> = text.split_whitespace().collect();
    let mut seen = std::collections::HashSet::new();
    n > 0 && words.windows(n).any(|w| !seen.insert(w))
}

/// Cases whose `label` answer repeats a run of `n` words where full recompute's does not.
pub fn loops_absent_from_full(records: &[StudyRecord], label: &str, n: usize) -> Vec<String> {
    with_full(records, label)
        .into_iter()
        .filter(|(r, f)| repeats_words(&r.answer, n) && !repeats_words(&f.answer, n))
        .map(|(r, _)| r.case.clone())
        .collect()
}

/// One table row: `first` (the margin, or what decided) and `p`'s figures.
fn md_row(first: &str, p: &CurvePoint) -> String {
    let pct = |k: usize| 100.0 * k as f64 / p.cases.max(1) as f64;
    format!(
        "| {first} | {} | {} ({:.0}%) | {} ({:.0}% [{:.0}, {:.0}]) | {:.0}% | {:.2} | {:.2} | {:.2} | {:.3} |\n",
        p.cases,
        p.escalated,
        pct(p.escalated),
        p.identical,
        pct(p.identical),
        100.0 * p.identity.lo,
        100.0 * p.identity.hi,
        pct(p.near_tie),
        p.median_ttft_ratio,
        p.mean_total_ratio,
        p.worst_escalated_ratio,
        p.f1_ratio,
    )
}

/// The curve as markdown tables, one per dataset, each closed by the perfect predictor's
/// rows of `oracles` (the bound) where it has them.
pub fn markdown(
    curves: &BTreeMap<String, Vec<CurvePoint>>,
    oracles: &BTreeMap<String, [CurvePoint; 3]>,
    label: &str,
    horizon: usize,
) -> String {
    let mut md = format!(
        "Guard on `{label}`, watching the first {horizon} tokens: escalate when a token's \
         top-2 logit gap is below the margin (0 = never). The last two rows of each table \
         escalate exactly the answers that differ from full recompute's, at the first token \
         and before any reused work: what no predictor can beat on these rows; the third only \
         those that split beyond a near tie. A near-tie \
         split: the answer leaves full recompute's where full recompute's own logit for its \
         token was less than 0.15 above the other (rows that record where answers split).\n"
    );
    for (ds, points) in curves {
        let _ = writeln!(md, "\n### {ds}\n");
        md.push_str("| margin | cases | escalated | identical | identical or a near-tie split | median TTFT ÷ full | mean total ÷ full | worst escalated ÷ full | F1 ÷ full's |\n");
        md.push_str("|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
        for p in points {
            md.push_str(&md_row(&p.margin.to_string(), p));
        }
        if let Some([first, before, beyond]) = oracles.get(ds) {
            md.push_str(&md_row("perfect predictor, at the first token", first));
            md.push_str(&md_row("perfect predictor, before reuse", before));
            md.push_str(&md_row(
                "perfect predictor of splits beyond a near tie, at the first token",
                beyond,
            ));
        }
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::method::Method;
    use crate::study::StudyConfig;
    use gateway::pipeline::Timings;

    fn row(label: &str, case: &str, identical: bool, margins: Option<Vec<f32>>) -> StudyRecord {
        let full = label == "full_recompute";
        StudyRecord {
            pairing: "large".into(),
            dataset: "hotpotqa".into(),
            case: case.into(),
            config: StudyConfig {
                method: if full {
                    Method::FullRecompute
                } else {
                    Method::TargetProbe
                },
                ratio: if full { 1.0 } else { 0.25 },
                fidelity: Default::default(),
                look: None,
            },
            label: label.into(),
            answer: String::new(),
            correct: false,
            identical,
            kl_first: 0.0,
            kl_tf: 0.0,
            gold_nll: 0.0,
            ttft_ms: if full { 1000.0 } else { 300.0 },
            timings: Timings {
                prefill_ms: if full { 990.0 } else { 250.0 },
                total_ms: if full { 1400.0 } else { 700.0 },
                ..Default::default()
            },
            ratio: 0.25,
            selected: Vec::new(),
            codec: "raw".into(),
            verify: None,
            verified_identical: None,
            verify_spec: None,
            verify_mode: None,
            guard: None,
            margin_first: None,
            margins,
            f1: Some(if identical || full { 1.0 } else { 0.0 }),
            signals: None,
            split: None,
        }
    }

    fn guarded(row: &StudyRecord, full: &StudyRecord, margin: f32, horizon: usize) -> GuardedCase {
        match guard_case(row, full, margin, horizon) {
            Some(c) => c,
            None => panic!("the row has no margins"),
        }
    }

    #[test]
    fn escalation_at_a_small_gap_answers_as_full_recompute_at_both_prefills_cost() {
        let full = row("full_recompute", "a", true, None);
        let reused = row("tp", "a", false, Some(vec![3.0, 0.5, 4.0, 2.0]));
        let kept = guarded(&reused, &full, 0.4, usize::MAX);
        assert!(!kept.escalated && !kept.identical);
        assert!((kept.ttft_ratio - 0.3).abs() < 1e-12);
        assert!((kept.total_ratio - 0.5).abs() < 1e-12);
        let esc = guarded(&reused, &full, 1.0, usize::MAX);
        assert!(esc.escalated && esc.identical);
        // The answers differ: the first token waits for the full prefill after one step.
        assert!((esc.ttft_ratio - (300.0 + 100.0 + 990.0) / 1000.0).abs() < 1e-12);
        // Fired at the second token: one of four decode steps spent before the move.
        assert!((esc.total_ratio - (300.0 + 100.0 + 1400.0) / 1400.0).abs() < 1e-12);
        assert_eq!(esc.f1, 1.0);
        // Outside the horizon the gap is not watched.
        assert!(!guarded(&reused, &full, 1.0, 1).escalated);
        assert!(guard_case(&row("tp", "a", true, None), &full, 1.0, 9).is_none());
        // Agreeing answers keep the first token shown, unless the move came before it.
        let same = row("tp", "a", true, Some(vec![3.0, 0.5, 4.0, 2.0]));
        assert!((guarded(&same, &full, 1.0, 9).ttft_ratio - 0.3).abs() < 1e-12);
        let first = guarded(&same, &full, 4.0, 9);
        assert!((first.ttft_ratio - 1.29).abs() < 1e-12);
    }

    #[test]
    fn the_curve_pairs_rows_by_case_and_pools_datasets() {
        let recs = vec![
            row("full_recompute", "a", true, None),
            row("tp", "a", true, Some(vec![5.0, 5.0])),
            row("full_recompute", "b", true, None),
            row("tp", "b", false, Some(vec![5.0, 0.2])),
            row("tp", "orphan", false, Some(vec![0.1])),
        ];
        let c = curve(&recs, "tp", &[0.0, 1.0], usize::MAX);
        let pooled = &c["pooled"];
        assert_eq!(pooled[0].cases, 2);
        assert_eq!((pooled[0].escalated, pooled[0].identical), (0, 1));
        assert_eq!((pooled[1].escalated, pooled[1].identical), (1, 2));
        assert_eq!(c["hotpotqa"], *pooled);
        assert!((pooled[0].f1_ratio - 0.5).abs() < 1e-12);
        let md = markdown(&c, &oracle_points(&recs, "tp"), "tp", 32);
        assert!(md.contains("| 1 | 2 | 1 (50%) | 2 (100%"), "{md}");
        assert!(md.contains("| perfect predictor, before reuse | 2 | 1 (50%) | 2 (100%"));
    }

    #[test]
    fn the_perfect_predictor_escalates_exactly_the_differing_answers_at_the_cost_of_its_moment() {
        let full = row("full_recompute", "a", true, None);
        let differs = row("tp", "a", false, Some(vec![5.0]));
        let same = row("tp", "b", true, Some(vec![0.1]));
        let first = oracle_case(&differs, &full, OracleAt::FirstToken);
        assert!(first.escalated && first.identical);
        // The reused prefill is paid, then full recompute's prefill / whole request.
        assert!((first.ttft_ratio - 1.29).abs() < 1e-12);
        assert!((first.total_ratio - 1700.0 / 1400.0).abs() < 1e-12);
        let before = oracle_case(&differs, &full, OracleAt::BeforeReuse);
        assert_eq!((before.ttft_ratio, before.total_ratio), (1.0, 1.0));
        let kept = oracle_case(&same, &full, OracleAt::FirstToken);
        assert!(!kept.escalated && kept.identical);
        assert!((kept.total_ratio - 0.5).abs() < 1e-12);
        let mut tie = row("tp", "c", false, Some(vec![5.0]));
        tie.split = Some(crate::study::Split { at: 0, gap: 0.01 });
        let beyond = |r: &StudyRecord| oracle_case(r, &full, OracleAt::BeyondNearTie);
        assert!(beyond(&differs).escalated && !beyond(&tie).escalated);
        assert!(!beyond(&tie).identical && beyond(&tie).near_tie);
        let p = point(f32::NAN, &[first, kept]);
        assert_eq!((p.escalated, p.identical), (1, 2));
        assert!((p.worst_escalated_ratio - 1700.0 / 1400.0).abs() < 1e-12);
        assert_eq!(point(0.0, &[kept]).worst_escalated_ratio, 0.0);
    }

    #[test]
    fn a_split_counts_as_a_near_tie_only_under_the_bound() {
        let full = row("full_recompute", "a", true, None);
        let mut near = row("tp", "a", false, Some(vec![5.0]));
        near.split = Some(crate::study::Split { at: 0, gap: 0.05 });
        let mut far = row("tp", "b", false, Some(vec![5.0]));
        far.split = Some(crate::study::Split { at: 2, gap: 0.5 });
        let n = guarded(&near, &full, 0.3, 9);
        assert!(!n.escalated && !n.identical && n.near_tie);
        let f = guarded(&far, &full, 0.3, 9);
        assert!(!f.identical && !f.near_tie);
        // Escalated, the answer is full recompute's either way.
        assert!(guarded(&far, &full, 9.0, 9).near_tie);
        let p = point(0.3, &[n, f]);
        assert_eq!((p.identical, p.near_tie), (0, 1));
    }

    #[test]
    fn a_split_is_where_the_tokens_part_seen_from_full_recomputes_logits() {
        use crate::study::{split_of, Split};
        let split = |full: &[u32], ids: &[u32], path: &[Vec<f32>], eog: &[u32]| -> Split {
            match split_of(full, ids, path, eog) {
                Some(s) => s,
                None => panic!("no split of {ids:?} from {full:?}"),
            }
        };
        // Full recompute's path: before token 0 it prefers 1 (by 2.0 over 2); before token 1
        // it prefers 3 only by 0.1 over 4; after its last token it ends (eog 9) by 0.7 over 5.
        let path = vec![
            vec![0.0, 3.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            vec![0.0, 0.0, 0.0, 2.0, 1.9, 0.0, 0.0, 0.0, 0.0, 0.0],
            vec![0.0, 0.0, 0.0, 0.0, 0.0, 1.3, 0.0, 0.0, 0.0, 2.0],
        ];
        let full = [1, 3];
        assert_eq!(split_of(&full, &full, &path, &[9]), None);
        let s = split(&full, &[1, 4, 7], &path, &[9]);
        assert_eq!(s.at, 1);
        assert!((s.gap - 0.1).abs() < 1e-6);
        assert!((split(&full, &[2], &path, &[9]).gap - 2.0).abs() < 1e-6);
        // The other answer goes on where full recompute's ends: its end against the token.
        let longer = split(&full, &[1, 3, 5], &path, &[9]);
        assert_eq!(longer.at, 2);
        assert!((longer.gap - 0.7).abs() < 1e-6);
        // It ends where full recompute's goes on: full recompute's token against the end.
        let shorter = split(&full, &[1], &path, &[7]);
        assert!((shorter.gap - 2.0).abs() < 1e-6);
        assert_eq!(split_of(&full, &[1, 4], &path[..1], &[9]), None);
    }

    #[test]
    fn auc_is_the_chance_a_positive_outranks_a_negative() {
        assert_eq!(auc(&[(3.0, true), (2.0, false), (1.0, false)]), 1.0);
        assert_eq!(auc(&[(1.0, true), (2.0, false)]), 0.0);
        assert_eq!(auc(&[(2.0, true), (2.0, false)]), 0.5);
        assert!(auc(&[(1.0, true)]).is_nan());
        let mut a = row("tp", "a", true, Some(vec![3.0, 2.5]));
        a.margin_first = Some(0.9);
        let mut b = row("tp", "b", false, Some(vec![3.0, 0.1]));
        b.margin_first = Some(0.95);
        let aucs = signal_aucs(&[a, b], "tp");
        let pooled = aucs["pooled"];
        assert_eq!(pooled[0].1, 1.0);
        assert_eq!(pooled[2].1, 0.5);
        assert_eq!(pooled[3].1, 0.0);
    }

    #[test]
    fn a_loop_is_a_repeated_run_of_words_full_recompute_did_not_write() {
        assert!(repeats_words("a b c d a b c d", 4));
        assert!(!repeats_words("a b c d a b c e", 4));
        let mut looped = row("tp", "b", false, Some(vec![1.0]));
        looped.answer = "x y z x y z".into();
        let mut recs = vec![row("full_recompute", "b", true, None), looped.clone()];
        assert_eq!(
            loops_absent_from_full(&recs, "tp", 3),
            vec!["b".to_string()]
        );
        recs[0].answer = looped.answer.clone();
        assert!(loops_absent_from_full(&recs, "tp", 3).is_empty());
    }
}
