//! What an evaluation run measures: the method configurations (method, ρ, EPIC's k, SpecCache's
//! layer range and score source), the model pairings, and the two budgets (`--quick` and the
//! default run).

use gateway::pipeline::{Method, QueryOptions, ScoreSource};
use serde::{Deserialize, Serialize};
use speculator::LayerRange;

/// The ratios every budgeted method runs at (SpecCache's sweep).
pub const RATIOS: [f64; 4] = [0.10, 0.15, 0.20, 0.25];
/// The ratio of the single-ratio rows (layer ablation, ingestion-time scores, large pairing).
/// A target/speculator pairing the evaluation runs (`--pairings`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum PairingName {
    /// SmolLM2-135M -> Qwen2.5-Coder-0.5B (the default models).
    Small,
    /// Qwen2.5-Coder-0.5B -> Qwen2.5-Coder-1.5B.
    Large,
}

impl PairingName {
    /// The name in reports, results.json and the data directory.
    pub fn name(self) -> &'static str {
        match self {
            Self::Small => "small",
            Self::Large => "large",
        }
    }
}

impl std::fmt::Display for PairingName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

pub const MAIN_RATIO: f64 = 0.15;

/// Why a configuration is in the run; the report groups rows by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Group {
    /// Methods at the ratio sweep, and the ratio-free baselines.
    Main,
    /// EPIC with a fixed k per chunk.
    EpicK,
    /// SpecCache with another layer range.
    Ablation,
    /// SpecCache with the scores stored at ingestion.
    Ingest,
    /// ρ = 1: must answer exactly as full recompute.
    Identity,
}

/// One way of answering: a method and its settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// Unique name in reports, e.g. `speccache@0.15`, `epic k=16`, `speccache@0.15 layers=all`.
    pub label: String,
    pub method: Method,
    pub ratio: f64,
    pub group: Group,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epic_k: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<LayerRange>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub score_source: Option<ScoreSource>,
}

impl Config {
    fn new(method: Method, ratio: f64, group: Group) -> Self {
        let label = if method.budgeted() {
            format!("{}@{ratio:.2}", method.name())
        } else {
            method.name().to_string()
        };
        Self {
            label,
            method,
            ratio,
            group,
            epic_k: None,
            layers: None,
            score_source: None,
        }
    }

    /// The reference every other configuration is compared with.
    pub fn full_recompute() -> Self {
        Self::new(Method::FullRecompute, 1.0, Group::Main)
    }

    /// A method at ratio `ratio`.
    pub fn at(method: Method, ratio: f64) -> Self {
        Self::new(method, ratio, Group::Main)
    }

    /// EPIC recomputing the first `k` tokens of every chunk.
    pub fn epic_k(k: usize) -> Self {
        Self {
            label: format!("epic k={k}"),
            epic_k: Some(k),
            ..Self::new(Method::Epic, 0.0, Group::EpicK)
        }
    }

    /// SpecCache at `ratio` with importance averaged over `layers`.
    pub fn layers(layers: LayerRange, ratio: f64) -> Self {
        let mut c = Self::new(Method::Speccache, ratio, Group::Ablation);
        c.label = format!("{} layers={}", c.label, layers.name());
        c.layers = Some(layers);
        c
    }

    /// SpecCache at `ratio` with the speculator scores stored at ingestion.
    pub fn ingest_scores(ratio: f64) -> Self {
        let mut c = Self::new(Method::Speccache, ratio, Group::Ingest);
        c.label = format!("{} scores=ingest", c.label);
        c.score_source = Some(ScoreSource::Ingest);
        c
    }

    /// `method` at ρ = 1 (must equal full recompute).
    pub fn identity(method: Method) -> Self {
        Self::new(method, 1.0, Group::Identity)
    }

    /// The pipeline options this configuration sets.
    pub fn options(&self) -> QueryOptions {
        QueryOptions {
            epic_k: self.epic_k,
            layers: self.layers,
            score_source: self.score_source,
            ..Default::default()
        }
    }

    /// True for the reference configuration.
    pub fn is_reference(&self) -> bool {
        self.method == Method::FullRecompute
    }

    /// True when the configuration takes a ratio budget (the ρ sweep applies).
    pub fn budgeted(&self) -> bool {
        self.epic_k.is_none() && self.method.budgeted()
    }
}

/// The configurations of a pairing. Full recompute always comes first: every later
/// configuration of a case is compared with its answer and first-token distribution.
pub fn configs(ratios: &[f64], extras: bool) -> Vec<Config> {
    let mut out = vec![
        Config::full_recompute(),
        Config::at(Method::FullReuse, 0.0),
        Config::at(Method::Prefix, 0.0),
    ];
    if extras {
        out.push(Config::epic_k(16));
        out.push(Config::epic_k(32));
    }
    for &r in ratios {
        for m in [
            Method::Epic,
            Method::Cacheblend,
            Method::Speccache,
            Method::SpeccacheNospan,
            Method::TargetProbe,
        ] {
            out.push(Config::at(m, r));
        }
    }
    if extras {
        for l in LayerRange::ALL {
            if l != LayerRange::LastThird {
                out.push(Config::layers(l, MAIN_RATIO));
            }
        }
        out.push(Config::ingest_scores(MAIN_RATIO));
    }
    out
}

/// The ρ = 1 configurations of the identity check.
pub fn identity_configs() -> Vec<Config> {
    [
        Method::Speccache,
        Method::Cacheblend,
        Method::Epic,
        Method::TargetProbe,
    ]
    .into_iter()
    .map(Config::identity)
    .collect()
}

/// A speculator -> target pairing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pairing {
    /// `small` (SmolLM2 -> Qwen-0.5B, the default) or `large` (Qwen-0.5B -> Qwen-1.5B).
    pub name: String,
    pub speculator: String,
    pub target: String,
}

/// Sizes of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct Budget {
    pub bridge_cases: usize,
    pub bridge_distractors: usize,
    pub bridge_filler_words: usize,
    pub needle_lengths: Vec<usize>,
    pub needle_depths: Vec<f64>,
    /// Ratios of the small pairing's sweep.
    pub ratios: Vec<f64>,
    /// EPIC k rows, the layer ablation and ingestion-time scores.
    pub extras: bool,
    /// Bridge cases of the large pairing (0: the large pairing is not run).
    pub large_cases: usize,
    /// Poisson load: requests per (method, rate), and rates as multiples of full recompute's
    /// service rate.
    pub load_requests: usize,
    pub load_factors: Vec<f64>,
    pub load_methods: Vec<Method>,
}

impl Budget {
    /// `--quick`: a smoke run (~1.5 minutes on 2 cores) that still covers every part of the
    /// report: both datasets, every method at one ratio, the ρ = 1 identity and the load test.
    pub fn quick() -> Self {
        Self {
            bridge_cases: 2,
            bridge_distractors: 2,
            bridge_filler_words: 40,
            needle_lengths: vec![200],
            needle_depths: vec![0.5],
            ratios: vec![MAIN_RATIO],
            extras: false,
            large_cases: 0,
            load_requests: 3,
            load_factors: vec![2.0],
            load_methods: vec![Method::FullRecompute, Method::TargetProbe],
        }
    }

    /// The default run (~30 minutes on 2 cores).
    pub fn default_run() -> Self {
        Self {
            bridge_cases: 16,
            bridge_distractors: 2,
            bridge_filler_words: 40,
            needle_lengths: vec![200, 500, 1000],
            needle_depths: vec![0.25, 0.75],
            ratios: RATIOS.to_vec(),
            extras: true,
            large_cases: 8,
            load_requests: 12,
            load_factors: vec![0.5, 1.0, 2.0],
            load_methods: vec![
                Method::FullRecompute,
                Method::TargetProbe,
                Method::Epic,
                Method::Cacheblend,
                Method::Speccache,
            ],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_recompute_comes_first_and_labels_are_unique() {
        for extras in [false, true] {
            let c = configs(&RATIOS, extras);
            assert!(c[0].is_reference());
            let mut labels: Vec<&str> = c.iter().map(|c| c.label.as_str()).collect();
            let n = labels.len();
            labels.sort();
            labels.dedup();
            assert_eq!(labels.len(), n, "labels are unique");
        }
        // 3 ratio-free + 5 methods x 4 ratios, and with extras 2 EPIC k, 3 layer ranges, 1
        // ingestion-score row.
        assert_eq!(configs(&RATIOS, false).len(), 3 + 20);
        assert_eq!(configs(&RATIOS, true).len(), 3 + 20 + 2 + 3 + 1);
    }

    #[test]
    fn options_follow_the_config() {
        let c = Config::layers(LayerRange::Final, 0.15);
        assert_eq!(c.label, "speccache@0.15 layers=final");
        assert_eq!(c.options().layers, Some(LayerRange::Final));
        let c = Config::epic_k(16);
        assert_eq!(c.options().epic_k, Some(16));
        assert!(!c.budgeted());
        let c = Config::ingest_scores(0.15);
        assert_eq!(c.options().score_source, Some(ScoreSource::Ingest));
        assert!(Config::at(Method::Cacheblend, 0.1).budgeted());
        assert!(!Config::at(Method::FullReuse, 0.0).budgeted());
        assert_eq!(Config::identity(Method::Epic).method, Method::Epic);
    }
}
