//! The fidelity study (`specrag-eval --study`): does selective recompute answer like full
//! recompute? Every case is answered by full recompute first; every other configuration is
//! compared with it per case on continuous measures (first-token KL, teacher-forced KL over full
//! recompute's answer, the gold answer's NLL) and on the answer itself (identical to full
//! recompute's, gold contained), with paired intervals in the report. Results are appended to
//! `study.jsonl` a case at a time, so a long run can be stopped and resumed (`--resume`).
//!
//! `mod.rs` holds the configurations; `cases.rs` runs a case, `records.rs` keeps the rows,
//! `summary.rs` reports them, `guard_curve.rs` derives the fidelity guard's operating curve.

mod cases;
pub mod guard_curve;
mod records;
mod summary;

pub use cases::*;
pub use records::*;
pub use summary::*;

use crate::method::Method;
use chunkstore::Codec;
use gateway::fidelity::{Fidelity, LookRows};
use serde::{Deserialize, Serialize};

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
    /// Which chunk tokens the guard's second look recomputes (`None`: the run's
    /// `--guard-look`); only a guarded configuration names one (`…:balanced:extend`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub look: Option<LookRows>,
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
            look: None,
        }
    }

    /// `method@ratio` (the ratio-free methods by name), then `:balanced` or `:exact` when the
    /// configuration is not `fast`, then `:ranked` or `:extend` when it names a second look.
    pub fn label(&self) -> String {
        let base = if self.method.budgeted() {
            format!("{}@{:.2}", self.method.name(), self.ratio)
        } else {
            self.method.name().to_string()
        };
        let guarded = match self.fidelity {
            Fidelity::Fast => base,
            f => format!("{base}:{}", f.name()),
        };
        match self.look {
            Some(l) => format!("{guarded}:{}", l.name()),
            None => guarded,
        }
    }

    /// The configuration a label names: a method's name, or a budgeted method at a ratio in
    /// `(0, 1]` written with two decimals (`target_probe@0.30`), exactly as [`label`] writes it.
    ///
    /// [`label`]: StudyConfig::label
    pub fn parse(label: &str) -> Option<Self> {
        let (base, guard) = match label.split_once(':') {
            Some((b, g)) => (b, Some(g)),
            None => (label, None),
        };
        let (fidelity, look) = match guard.map(|g| g.split_once(':').unwrap_or((g, ""))) {
            Some((f, l)) => (
                Fidelity::parse(f).filter(|f| *f != Fidelity::Fast)?,
                match l {
                    "" => None,
                    l => Some(LookRows::parse(l)?),
                },
            ),
            None => (Fidelity::Fast, None),
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
        c.look = look;
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

#[cfg(test)]
mod tests {

    /// The copy signals find the answer's word in the chunks, as any of its spellings, and
    /// count the fresh tokens around it, within its chunk.
    #[test]
    fn copy_signals_measure_the_fresh_kv_around_the_copied_word() {
        let prompt = [1, 2, 3, 10, 11, 12, 13, 14, 20, 21, 12, 23];
        let chunks = [3..8, 8..12];
        let fresh: std::collections::HashSet<usize> = [4, 9].into_iter().collect();
        // Spelled [12, 13] (at 5, chunk 0) or [12] alone (also at 10, chunk 1).
        let two = [vec![12, 13]];
        let c = CopySignals::new("w", 1, &two, &prompt, &chunks, &fresh).expect("found");
        assert_eq!((c.at, c.occurrences, c.chunks), (1, 1, 1));
        // Chunk 0 has 1 of 5 fresh.
        assert_eq!((c.near_max, c.near_min, c.chunk_share), (0.2, 0.2, 0.2));
        let either = [vec![99], vec![12]];
        let c = CopySignals::new("w", 0, &either, &prompt, &chunks, &fresh).expect("found");
        assert_eq!((c.occurrences, c.chunks), (2, 2));
        // Chunk 1 has 1 of 4 fresh.
        assert_eq!((c.near_max, c.near_min, c.chunk_share), (0.25, 0.2, 0.25));
        assert!(CopySignals::new("w", 0, &[vec![99]], &prompt, &chunks, &fresh).is_none());
    }
    use super::*;
    use gateway::pipeline::Timings;

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
        assert_eq!(g.look, None, "the run's second look");
        let e = StudyConfig::parse("target_probe_shift@0.25:balanced:extend").expect("a look");
        assert_eq!(
            (e.fidelity, e.look),
            (Fidelity::Balanced, Some(LookRows::Extend))
        );
        assert_eq!(e.label(), "target_probe_shift@0.25:balanced:extend");
        for bad in [
            "target_probe@0.25:extend",
            "target_probe@0.25:balanced:wide",
        ] {
            assert_eq!(StudyConfig::parse(bad), None, "{bad}");
        }
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
            verify_spec: None,
            verify_mode: None,
            guard: None,
            margin_first: None,
            margins: None,
            f1: None,
            signals: None,
            split: None,
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
