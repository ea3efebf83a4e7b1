//! What an evaluation run measures: the method configurations (method, ρ, EPIC's k, SpecCache's
//! layer range and score source), the model pairings, and the two budgets (`--quick` and the
//! default run).

use crate::forcing::Knobs;
use crate::method::Method;
use gateway::pipeline::{Method as Served, ScoreSource};
use serde::{Deserialize, Serialize};
use speculator::LayerRange;

/// The ratios every budgeted method runs at (SpecCache's sweep).
pub const RATIOS: [f64; 4] = [0.10, 0.15, 0.20, 0.25];
/// A target/speculator pairing the evaluation runs (`--pairings`); written in results.json as
/// its [`name`](Self::name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
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

/// The ratio of the single-ratio rows (layer ablation, ingestion-time scores, large pairing).
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

/// A configuration as answers name it, typed: what its label says (`full_recompute`,
/// `speccache@0.15`, `epic k=16`, `speccache@0.15 layers=final`,
/// `speccache@0.15 scores=ingest`). Records and identity rows carry it; results.json holds it
/// as the label (written by [`Display`](std::fmt::Display), read back by [`FromStr`]), so two
/// configurations are joined by their settings, and a label with a typo is an error where it
/// is read instead of a comparison that never matches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConfigKey {
    pub method: Method,
    /// ρ to the label's two decimals (`0.15` for `@0.15`); `None` for the methods without a
    /// budget and for EPIC at a fixed k.
    pub ratio: Option<f64>,
    /// EPIC recomputing the first k tokens of every chunk (`k=16`).
    pub epic_k: Option<usize>,
    /// SpecCache's layer range, when not the default (`layers=final`).
    pub layers: Option<LayerRange>,
    /// Where SpecCache's scores come from, when not the default (`scores=ingest`).
    pub score_source: Option<ScoreSource>,
}

/// `ratio` as a label writes it (two decimals), so that a key built from a [`Config`] equals
/// the key parsed back from its label.
fn label_ratio(ratio: f64) -> f64 {
    format!("{ratio:.2}").parse().unwrap_or(ratio)
}

fn score_source_name(s: ScoreSource) -> &'static str {
    match s {
        ScoreSource::Query => "query",
        ScoreSource::Ingest => "ingest",
    }
}

impl ConfigKey {
    /// The key of `method` at ρ = `ratio` with no other setting (the ratio is dropped for the
    /// methods without a budget).
    pub fn at(method: Method, ratio: f64) -> Self {
        Self {
            method,
            ratio: method.budgeted().then(|| label_ratio(ratio)),
            epic_k: None,
            layers: None,
            score_source: None,
        }
    }

    /// The reference, `full_recompute`.
    pub fn full_recompute() -> Self {
        Self::at(Method::FullRecompute, 1.0)
    }
}

impl std::fmt::Display for ConfigKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.method.name())?;
        if let Some(r) = self.ratio {
            write!(f, "@{r:.2}")?;
        }
        if let Some(k) = self.epic_k {
            write!(f, " k={k}")?;
        }
        if let Some(l) = self.layers {
            write!(f, " layers={}", l.name())?;
        }
        if let Some(s) = self.score_source {
            write!(f, " scores={}", score_source_name(s))?;
        }
        Ok(())
    }
}

/// A label that does not name a configuration as [`ConfigKey`] writes it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{label}` is not a configuration label ({why}); labels read like `full_recompute`, `speccache@0.15`, `epic k=16`, `speccache@0.15 layers=final`")]
pub struct BadLabel {
    pub label: String,
    pub why: String,
}

impl std::str::FromStr for ConfigKey {
    type Err = BadLabel;

    /// Parses a label; only the form [`Display`](std::fmt::Display) writes is accepted (two
    /// decimals, settings in order), so what is read is written back byte for byte.
    fn from_str(label: &str) -> Result<Self, BadLabel> {
        let bad = |why: String| BadLabel {
            label: label.to_string(),
            why,
        };
        let mut parts = label.split(' ');
        let head = parts.next().unwrap_or_default();
        let (name, ratio) = match head.split_once('@') {
            Some((n, r)) => {
                let r: f64 = r
                    .parse()
                    .map_err(|_| bad(format!("ratio `{r}` is not a number")))?;
                (n, Some(r))
            }
            None => (head, None),
        };
        let method = Method::parse(name).ok_or_else(|| bad(format!("unknown method `{name}`")))?;
        let mut key = Self {
            method,
            ratio,
            epic_k: None,
            layers: None,
            score_source: None,
        };
        for part in parts {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| bad(format!("`{part}` is not a setting")))?;
            match k {
                "k" => {
                    key.epic_k = Some(v.parse().map_err(|_| bad(format!("k `{v}`")))?);
                }
                "layers" => {
                    key.layers = Some(
                        LayerRange::parse(v).ok_or_else(|| bad(format!("layer range `{v}`")))?,
                    );
                }
                "scores" => {
                    key.score_source = Some(match v {
                        "query" => ScoreSource::Query,
                        "ingest" => ScoreSource::Ingest,
                        _ => return Err(bad(format!("score source `{v}`"))),
                    });
                }
                _ => return Err(bad(format!("unknown setting `{k}`"))),
            }
        }
        if key.to_string() != label {
            return Err(bad(format!("written `{key}`")));
        }
        Ok(key)
    }
}

impl Serialize for ConfigKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ConfigKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let label = String::deserialize(d)?;
        label.parse().map_err(serde::de::Error::custom)
    }
}

/// One way of answering: a method and its settings. In results.json it carries its label
/// first ([`Config::label`]); reading checks that the label matches the settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(into = "ConfigRepr", try_from = "ConfigRepr")]
pub struct Config {
    pub method: Method,
    pub ratio: f64,
    pub group: Group,
    pub epic_k: Option<usize>,
    pub layers: Option<LayerRange>,
    pub score_source: Option<ScoreSource>,
}

/// [`Config`] as results.json writes it: its label, then its settings.
#[derive(Serialize, Deserialize)]
struct ConfigRepr {
    label: ConfigKey,
    method: Method,
    ratio: f64,
    group: Group,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    epic_k: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    layers: Option<LayerRange>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    score_source: Option<ScoreSource>,
}

impl From<Config> for ConfigRepr {
    fn from(c: Config) -> Self {
        Self {
            label: c.key(),
            method: c.method,
            ratio: c.ratio,
            group: c.group,
            epic_k: c.epic_k,
            layers: c.layers,
            score_source: c.score_source,
        }
    }
}

impl TryFrom<ConfigRepr> for Config {
    type Error = String;

    fn try_from(r: ConfigRepr) -> Result<Self, String> {
        let c = Self {
            method: r.method,
            ratio: r.ratio,
            group: r.group,
            epic_k: r.epic_k,
            layers: r.layers,
            score_source: r.score_source,
        };
        if c.key() != r.label {
            return Err(format!(
                "configuration label `{}` does not match its settings (`{}`)",
                r.label,
                c.key()
            ));
        }
        Ok(c)
    }
}

impl Config {
    fn new(method: Method, ratio: f64, group: Group) -> Self {
        Self {
            method,
            ratio,
            group,
            epic_k: None,
            layers: None,
            score_source: None,
        }
    }

    /// What the configuration's answers are filed under: method, ρ (when budgeted) and the
    /// settings.
    pub fn key(&self) -> ConfigKey {
        ConfigKey {
            method: self.method,
            ratio: self.budgeted().then(|| label_ratio(self.ratio)),
            epic_k: self.epic_k,
            layers: self.layers,
            score_source: self.score_source,
        }
    }

    /// Unique name in reports, e.g. `speccache@0.15`, `epic k=16`, `speccache@0.15 layers=all`.
    pub fn label(&self) -> String {
        self.key().to_string()
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
            epic_k: Some(k),
            ..Self::new(Method::Epic, 0.0, Group::EpicK)
        }
    }

    /// SpecCache at `ratio` with importance averaged over `layers`.
    pub fn layers(layers: LayerRange, ratio: f64) -> Self {
        let mut c = Self::new(Method::Speccache, ratio, Group::Ablation);
        c.layers = Some(layers);
        c
    }

    /// SpecCache at `ratio` with the speculator scores stored at ingestion.
    pub fn ingest_scores(ratio: f64) -> Self {
        let mut c = Self::new(Method::Speccache, ratio, Group::Ingest);
        c.score_source = Some(ScoreSource::Ingest);
        c
    }

    /// `method` at ρ = 1 (must equal full recompute).
    pub fn identity(method: Method) -> Self {
        Self::new(method, 1.0, Group::Identity)
    }

    /// What this configuration varies on a query beyond the request.
    pub fn knobs(&self) -> Knobs {
        Knobs {
            method: Some(self.method),
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
    pub name: PairingName,
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
    /// Served methods: the load test goes through the HTTP API.
    pub load_methods: Vec<Served>,
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
            load_methods: vec![Served::FullRecompute, Served::TargetProbe],
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
                Served::FullRecompute,
                Served::TargetProbe,
                Served::Epic,
                Served::Cacheblend,
                Served::Speccache,
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
            let mut labels: Vec<String> = c.iter().map(Config::label).collect();
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
    fn labels_parse_back_into_their_configuration() {
        let mut all = configs(&RATIOS, true);
        all.extend(identity_configs());
        for c in &all {
            let label = c.label();
            let key: ConfigKey = label.parse().expect("a label parses");
            assert_eq!(key, c.key(), "{label}");
            assert_eq!(key.to_string(), label);
            let json = serde_json::to_string(&key).expect("serialize");
            assert_eq!(json, format!("\"{label}\""));
            assert_eq!(serde_json::from_str::<ConfigKey>(&json).ok(), Some(key));
            let back: Config =
                serde_json::from_str(&serde_json::to_string(c).expect("serialize")).expect("read");
            assert_eq!(&back, c);
        }
        assert_eq!(Config::full_recompute().label(), "full_recompute");
        assert_eq!(Config::epic_k(16).label(), "epic k=16");
        assert_eq!(Config::at(Method::Speccache, 0.1).label(), "speccache@0.10");
        assert_eq!(
            Config::ingest_scores(0.15).label(),
            "speccache@0.15 scores=ingest"
        );
        assert_eq!(Config::identity(Method::Epic).label(), "epic@1.00");
        assert_eq!(
            "target_probe@0.15".parse::<ConfigKey>(),
            Ok(ConfigKey::at(Method::TargetProbe, 0.15))
        );
        // A typo is an error where the label is read, not a comparison that never matches.
        for bad in [
            "",
            "full_recompute ",
            "specache@0.15",
            "speccache@0.1",
            "speccache@x",
            "epic k=x",
            "speccache@0.15 layers=first",
            "speccache@0.15 scores=later",
            "speccache@0.15 depth=2",
            "speccache@0.15 scores=ingest layers=all",
        ] {
            assert!(bad.parse::<ConfigKey>().is_err(), "`{bad}` parsed");
            assert!(serde_json::from_str::<ConfigKey>(&format!("\"{bad}\"")).is_err());
        }
        // A label that disagrees with its settings is refused.
        let wrong = r#"{"label":"epic@0.15","method":"epic","ratio":0.2,"group":"main"}"#;
        assert!(serde_json::from_str::<Config>(wrong).is_err());
    }

    #[test]
    fn pairing_names_are_written_as_their_names() {
        for p in [PairingName::Small, PairingName::Large] {
            let json = serde_json::to_string(&p).expect("serialize");
            assert_eq!(json, format!("\"{}\"", p.name()));
            assert_eq!(serde_json::from_str::<PairingName>(&json).ok(), Some(p));
        }
        assert!(serde_json::from_str::<PairingName>("\"medium\"").is_err());
    }

    #[test]
    fn options_follow_the_config() {
        let c = Config::layers(LayerRange::Final, 0.15);
        assert_eq!(c.label(), "speccache@0.15 layers=final");
        assert_eq!(c.knobs().layers, Some(LayerRange::Final));
        let c = Config::epic_k(16);
        assert_eq!(c.knobs().epic_k, Some(16));
        assert!(!c.budgeted());
        let c = Config::ingest_scores(0.15);
        assert_eq!(c.knobs().score_source, Some(ScoreSource::Ingest));
        assert!(Config::at(Method::Cacheblend, 0.1).budgeted());
        assert!(!Config::at(Method::FullReuse, 0.0).budgeted());
        assert_eq!(Config::identity(Method::Epic).method, Method::Epic);
    }
}
