//! The evaluation's catalogue of methods: every method the server serves
//! ([`gateway::pipeline::Method`]) under the same name, and the evaluation's own selectors
//! (ablations of `target_probe`, the oracle bound, the random floor) that no request can ask
//! for. Records name a method by [`Method::name`], so records written before a method left the
//! served set still read back.

use crate::selectors::{Ablation, Oracle, Random};
use gateway::pipeline::{Method as Served, SelectorInputs};
use serde::{Deserialize, Serialize};
use target_engine::{Selector, TargetProbe};

/// A method the evaluation runs: a served one, or one of its own.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    clap::ValueEnum,
    PartialOrd,
    Ord,
)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum Method {
    FullRecompute,
    FullReuse,
    Prefix,
    Epic,
    Cacheblend,
    Speccache,
    SpeccacheNospan,
    TargetProbe,
    TargetProbeSpan,
    SpecAttn,
    SpecAttnFull,
    /// `target_probe` with A^3's smoothing: scores averaged over 2 tokens on each side.
    ProbeSmooth,
    /// `target_probe` with ProphetKV's layer fusion: every layer probed, each normalized over
    /// the candidates before they are summed.
    ProbeFused,
    /// `target_probe` with QCFuse-style per-chunk anchors: the budget split evenly across
    /// chunks.
    ProbeAnchors,
    /// `target_probe` recomputing a chunk whole once the probe picked half of its tokens.
    ProbeWhole,
    /// `target_probe` recomputing whole the chunk the question attends to most, the rest of
    /// the budget spent on the others.
    ProbeTopChunk,
    /// `target_probe` recomputing its picks only through the deeper half of the layers, from
    /// their own chunk's residual stream there: at ρ 0.5 the cost of ρ 0.25 through every
    /// layer.
    ProbeDeep,
    /// `target_probe` with every reused chunk token run through the first 4 of 28 layers
    /// (fresh shallow rows for all) before its picks run through every layer.
    ProbeShallow,
    /// `target_probe` with each chunk's reused tokens moved, layer by layer, by the mean
    /// deviation its recomputed tokens showed.
    ProbeShift,
    TargetProbeShift,
    /// `target_probe_shift` spending its budget in two rounds: half where the question
    /// attends over the reused cache, the rest where a second probe over that blend attends.
    ProbeShiftTwice,
    /// Upper bound from a full prefill ([`Oracle`]).
    Oracle,
    /// Seeded uniform choice ([`Random`]).
    Random,
}

impl Method {
    /// Every method, in the order reports list them.
    pub const ALL: [Method; 23] = [
        Method::FullRecompute,
        Method::FullReuse,
        Method::Prefix,
        Method::Epic,
        Method::Cacheblend,
        Method::Speccache,
        Method::SpeccacheNospan,
        Method::TargetProbe,
        Method::TargetProbeSpan,
        Method::SpecAttn,
        Method::SpecAttnFull,
        Method::ProbeSmooth,
        Method::ProbeFused,
        Method::ProbeAnchors,
        Method::ProbeWhole,
        Method::ProbeTopChunk,
        Method::ProbeDeep,
        Method::ProbeShallow,
        Method::ProbeShift,
        Method::TargetProbeShift,
        Method::ProbeShiftTwice,
        Method::Oracle,
        Method::Random,
    ];

    /// The name in records, reports and on the command line (a served method's API name).
    pub fn name(&self) -> &'static str {
        NAMES[*self as usize]
    }

    /// Parses a name of [`Method::name`].
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == s)
    }

    /// The served method of the same name; `None` for the evaluation's own.
    pub fn served(&self) -> Option<Served> {
        Served::parse(self.name())
    }

    /// The served method a query of this method carries: its own, or `target_probe` for the
    /// evaluation's selectors (which the experiment then runs instead, [`Method::own_selector`]).
    pub fn query_method(&self) -> Served {
        self.served().unwrap_or(Served::TargetProbe)
    }

    /// True for the methods that need a speculator model and its scores.
    pub fn uses_speculator(&self) -> bool {
        self.served().is_some_and(|m| m.uses_speculator())
    }

    /// True when ρ sets how much is recomputed (the others recompute a fixed set).
    pub fn budgeted(&self) -> bool {
        self.served().is_none_or(|m| m.budgeted())
    }

    /// True when the method reads no stored chunk KV at all.
    pub fn is_full(&self) -> bool {
        self.served().is_some_and(|m| m.is_full())
    }

    /// The evaluation's own selector of this method (`seed` seeds `random`); `None` for a
    /// served method, whose selector the pipeline builds.
    pub fn own_selector(&self, seed: u64) -> Option<Box<dyn Selector>> {
        let ablation = |a: Ablation| -> Option<Box<dyn Selector>> { Some(Box::new(a)) };
        match self {
            Self::ProbeSmooth => ablation(Ablation::Smooth),
            Self::ProbeFused => ablation(Ablation::Fused),
            Self::ProbeAnchors => ablation(Ablation::Anchors),
            Self::ProbeWhole => ablation(Ablation::Whole),
            Self::ProbeTopChunk => ablation(Ablation::TopChunk),
            Self::ProbeDeep => ablation(Ablation::Deep),
            Self::ProbeShallow => ablation(Ablation::Shallow),
            Self::ProbeShift => ablation(Ablation::Shift),
            Self::ProbeShiftTwice => Some(Box::new(TargetProbe {
                shift: true,
                first_round: 0.5,
                ..TargetProbe::default()
            })),
            Self::Oracle => Some(Box::new(Oracle)),
            Self::Random => Some(Box::new(Random { seed })),
            _ => None,
        }
    }

    /// The selector of this method for one prompt outside the pipeline (the bench): the
    /// evaluation's own, or the served method's from `inputs`.
    pub fn selector<'a>(&self, inputs: SelectorInputs<'a>, seed: u64) -> Box<dyn Selector + 'a> {
        match self.own_selector(seed) {
            Some(own) => own,
            None => self.query_method().selector(inputs),
        }
    }
}

/// Each method's name, in declaration order (the order of [`Method::ALL`]).
const NAMES: [&str; 23] = [
    "full_recompute",
    "full_reuse",
    "prefix",
    "epic",
    "cacheblend",
    "speccache",
    "speccache_nospan",
    "target_probe",
    "target_probe_span",
    "spec_attn",
    "spec_attn_full",
    "probe_smooth",
    "probe_fused",
    "probe_anchors",
    "probe_whole",
    "probe_top_chunk",
    "probe_deep",
    "probe_shallow",
    "probe_shift",
    "target_probe_shift",
    "probe_shift_twice",
    "oracle",
    "random",
];

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_parse_serde_and_clap() {
        use clap::ValueEnum;
        for m in Method::ALL {
            assert_eq!(Method::parse(m.name()), Some(m));
            let json = serde_json::to_string(&m).expect("serialize");
            assert_eq!(json, format!("\"{}\"", m.name()));
            let pv = m.to_possible_value().expect("a clap value");
            assert_eq!(pv.get_name(), m.name());
        }
        assert_eq!(Method::parse("speccache@0.15"), None);
    }

    #[test]
    fn every_served_method_is_here_under_its_name_and_the_rest_are_the_evaluations_own() {
        for &s in Served::ALL {
            let m = Method::parse(s.name()).expect("a served method in the catalogue");
            assert_eq!(m.served(), Some(s));
            assert_eq!(m.query_method(), s);
            assert!(m.own_selector(0).is_none(), "{m}");
            assert_eq!(
                (m.budgeted(), m.is_full(), m.uses_speculator()),
                (s.budgeted(), s.is_full(), s.uses_speculator())
            );
        }
        let own: Vec<Method> = Method::ALL
            .into_iter()
            .filter(|m| m.served().is_none())
            .collect();
        assert_eq!(own.len(), Method::ALL.len() - Served::ALL.len());
        for m in own {
            assert!(m.own_selector(7).is_some(), "{m} has a selector of its own");
            assert!(m.budgeted() && !m.is_full() && !m.uses_speculator(), "{m}");
            assert_eq!(m.query_method(), Served::TargetProbe);
        }
    }
}
