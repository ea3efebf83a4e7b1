//! The one name of a reuse method, from the API, the CLI and the evaluation down to the one
//! [`Selector`] that serves a request.

use serde::{Deserialize, Serialize};
use speculator::{ScoredSpecCache, ScoredTokens, SpecCache};
use target_engine::{
    CacheBlend, Epic, FullRecompute, FullReuse, Oracle, PrefixCaching, Random, Selector,
    TargetProbe,
};

/// How the prompt's tokens to recompute are chosen (`method` in the API, `--method` on the
/// command line, a configuration of the evaluation).
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
    /// Recompute everything (the reference; no stored KV is used).
    FullRecompute,
    /// Reuse every chunk's KV as is.
    FullReuse,
    /// Reuse only the template prefix and an exact first chunk (ordinary prefix caching).
    Prefix,
    /// Recompute the first tokens of every chunk (EPIC), at the same budget.
    Epic,
    /// Recompute the tokens whose early-layer KV deviates most (CacheBlend).
    Cacheblend,
    /// The speculator picks the tokens by hidden-state norms (SpecCache), with span completion.
    Speccache,
    /// SpecCache without span completion (ablation).
    SpeccacheNospan,
    /// The question's pass over the reused cache picks the chunk tokens its deep layers
    /// attend to (query-aware, one question pass).
    TargetProbe,
    /// `target_probe` recomputing a few tokens around every pick instead of scattered tokens.
    TargetProbeSpan,
    /// The speculator's question-to-chunk attention (deeper half of its layers) picks the
    /// tokens, completed into spans and mapped onto target tokens as SpecCache does. The
    /// question runs over the speculator's own chunk KV stored at ingestion (computed and
    /// stored on first use otherwise): a query costs a speculator pass over the question only.
    SpecAttn,
    /// `spec_attn` with the speculator reading the whole prompt per query instead of its stored
    /// chunk KV (ablation: what the stored KV's missing cross-chunk context costs).
    SpecAttnFull,
    /// `target_probe` with A^3's smoothing: scores averaged over 2 tokens on each side
    /// (measurement only: refused by the API).
    ProbeSmooth,
    /// `target_probe` with ProphetKV's layer fusion: every layer probed, each normalized over
    /// the candidates before they are summed (measurement only: refused by the API).
    ProbeFused,
    /// `target_probe` with QCFuse-style per-chunk anchors: the budget split evenly across
    /// chunks (measurement only: refused by the API).
    ProbeAnchors,
    /// `target_probe` recomputing a chunk whole once the probe picked half of its tokens
    /// (measurement only: refused by the API).
    ProbeWhole,
    /// `target_probe` recomputing whole the chunk the question attends to most, the rest of
    /// the budget spent on the others (measurement only: refused by the API).
    ProbeTopChunk,
    /// `target_probe` recomputing its picks only through the deeper half of the layers, from
    /// their own chunk's residual stream there: at ρ 0.5 the cost of ρ 0.25 through every
    /// layer (measurement only: refused by the API).
    ProbeDeep,
    /// `target_probe` with every reused chunk token run through the first 4 of 28 layers
    /// (fresh shallow rows for all) before its picks run through every layer (measurement
    /// only: refused by the API).
    ProbeShallow,
    /// `target_probe` with each chunk's reused tokens moved, layer by layer, by the mean
    /// deviation its recomputed tokens showed (measurement only: refused by the API).
    ProbeShift,
    /// `target_probe` with each reused chunk token moved, layer by layer, as the picks whose
    /// keys it resembles were moved by recomputing (no extra recompute).
    TargetProbeShift,
    /// Upper bound from a full prefill (measurement only: refused by the API).
    Oracle,
    /// Seeded uniform choice (measurement only: refused by the API).
    Random,
}

/// Tokens on each side of a `target_probe_span` pick.
pub const PROBE_WINDOW: usize = 2;
/// The share of a chunk's tokens the probe must pick for `probe_whole` to recompute it whole.
pub const PROBE_WHOLE_AT: f64 = 0.5;
/// The fraction of the depth from which `probe_deep` recomputes its picks.
pub const PROBE_DEEP_FROM: f64 = 0.5;
/// The fraction of the depth every reused token runs under `probe_shallow` (4 of 28 layers).
pub const PROBE_SHALLOW_ALL: f64 = 1.0 / 7.0;
/// Tokens on each side averaged by `probe_smooth` (A^3's average pool of 5).
pub const PROBE_SMOOTH: usize = 2;

impl Method {
    /// Every method, in the order reports list them.
    pub const ALL: [Method; 22] = [
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
        Method::Oracle,
        Method::Random,
    ];

    /// The name in the API, on the command line and in reports.
    pub fn name(&self) -> &'static str {
        match self {
            Self::FullRecompute => "full_recompute",
            Self::FullReuse => "full_reuse",
            Self::Prefix => "prefix",
            Self::Epic => "epic",
            Self::Cacheblend => "cacheblend",
            Self::Speccache => "speccache",
            Self::SpeccacheNospan => "speccache_nospan",
            Self::TargetProbe => "target_probe",
            Self::TargetProbeSpan => "target_probe_span",
            Self::SpecAttn => "spec_attn",
            Self::SpecAttnFull => "spec_attn_full",
            Self::ProbeSmooth => "probe_smooth",
            Self::ProbeFused => "probe_fused",
            Self::ProbeAnchors => "probe_anchors",
            Self::ProbeWhole => "probe_whole",
            Self::ProbeTopChunk => "probe_top_chunk",
            Self::ProbeDeep => "probe_deep",
            Self::ProbeShallow => "probe_shallow",
            Self::ProbeShift => "probe_shift",
            Self::TargetProbeShift => "target_probe_shift",
            Self::Oracle => "oracle",
            Self::Random => "random",
        }
    }

    /// Parses a name of [`Method::name`].
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == s)
    }

    /// Methods the server answers with (`oracle` and `random` are measurement bounds).
    pub fn servable(&self) -> bool {
        !matches!(
            self,
            Self::Oracle
                | Self::Random
                | Self::ProbeSmooth
                | Self::ProbeFused
                | Self::ProbeAnchors
                | Self::ProbeWhole
                | Self::ProbeTopChunk
                | Self::ProbeDeep
                | Self::ProbeShallow
                | Self::ProbeShift
        )
    }

    /// True for the methods that need a speculator model and its scores.
    pub fn uses_speculator(&self) -> bool {
        matches!(
            self,
            Self::Speccache | Self::SpeccacheNospan | Self::SpecAttn | Self::SpecAttnFull
        )
    }

    /// True when ρ sets how much is recomputed (the others recompute a fixed set).
    pub fn budgeted(&self) -> bool {
        !matches!(self, Self::FullRecompute | Self::FullReuse | Self::Prefix)
    }

    /// True when the method reads no stored chunk KV at all.
    pub fn is_full(&self) -> bool {
        *self == Self::FullRecompute
    }

    /// The selector of this method for one request. `spec` and `scores` are SpecCache's
    /// (required by the SpecCache methods), `epic_k` fixes EPIC's tokens per chunk instead of
    /// spending the budget, `seed` seeds `random`.
    pub fn selector<'a>(&self, inputs: SelectorInputs<'a>) -> Box<dyn Selector + 'a> {
        match self {
            Self::FullRecompute => Box::new(FullRecompute),
            Self::FullReuse => Box::new(FullReuse),
            Self::Prefix => Box::new(PrefixCaching),
            Self::Epic => Box::new(Epic { k: inputs.epic_k }),
            Self::Cacheblend => Box::new(CacheBlend::default()),
            Self::Speccache | Self::SpeccacheNospan | Self::SpecAttn | Self::SpecAttnFull => {
                match inputs.spec {
                    Some(spec) => Box::new(ScoredSpecCache {
                        spec,
                        scores: inputs.scores.unwrap_or_default(),
                    }),
                    // Without a speculator nothing can be scored: reuse as is. Callers check
                    // `uses_speculator` against the loaded models before a request runs.
                    None => Box::new(FullReuse),
                }
            }
            Self::TargetProbe => Box::new(TargetProbe::default()),
            Self::TargetProbeSpan => Box::new(TargetProbe {
                window: PROBE_WINDOW,
                ..TargetProbe::default()
            }),
            Self::ProbeSmooth => Box::new(TargetProbe {
                smooth: PROBE_SMOOTH,
                ..TargetProbe::default()
            }),
            Self::ProbeFused => Box::new(TargetProbe {
                from_depth: 0.0,
                per_layer: true,
                ..TargetProbe::default()
            }),
            Self::ProbeAnchors => Box::new(TargetProbe {
                per_chunk: true,
                ..TargetProbe::default()
            }),
            Self::ProbeWhole => Box::new(TargetProbe {
                whole_at: PROBE_WHOLE_AT,
                ..TargetProbe::default()
            }),
            Self::ProbeTopChunk => Box::new(TargetProbe {
                whole_top: true,
                ..TargetProbe::default()
            }),
            Self::ProbeDeep => Box::new(TargetProbe {
                deep_from: PROBE_DEEP_FROM,
                ..TargetProbe::default()
            }),
            Self::ProbeShallow => Box::new(TargetProbe {
                shallow_all: PROBE_SHALLOW_ALL,
                ..TargetProbe::default()
            }),
            Self::ProbeShift => Box::new(TargetProbe {
                shift: true,
                ..TargetProbe::default()
            }),
            Self::TargetProbeShift => Box::new(TargetProbe {
                shift_similar: true,
                ..TargetProbe::default()
            }),
            Self::Oracle => Box::new(Oracle),
            Self::Random => Box::new(Random { seed: inputs.seed }),
        }
    }
}

/// What a method's selector may need besides the model and the prompt.
#[derive(Debug, Default)]
pub struct SelectorInputs<'a> {
    /// SpecCache with its settings for this request (span completion, layer range).
    pub spec: Option<&'a SpecCache>,
    /// The speculator's scores of the prompt's chunk tokens.
    pub scores: Option<ScoredTokens>,
    pub epic_k: Option<usize>,
    pub seed: u64,
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl utoipa::PartialSchema for Method {
    /// The methods the API serves (measurement-only methods are not part of the API).
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        let served = Self::ALL.iter().filter(|m| m.servable()).map(|m| m.name());
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .enum_values(Some(served))
            .description(Some(
                "How the prompt's tokens to recompute are chosen: `full_recompute` (the \
                 reference), `full_reuse`, `prefix`, `epic`, `cacheblend`, `speccache`, \
                 `speccache_nospan`, `target_probe` (the question's attention over the reused \
                 cache), `target_probe_span` (the same, a few tokens around each pick), \
                 `target_probe_shift` (`target_probe` with each reused token moved as the picks \
                 whose keys it resembles were moved by recomputing), \
                 `spec_attn` (the speculator's question attention over its stored chunk KV), \
                 `spec_attn_full` (the same over a speculator pass of the whole prompt).",
            ))
            .into()
    }
}

impl utoipa::ToSchema for Method {}

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
        assert!(!Method::Oracle.servable() && !Method::Random.servable());
        assert_eq!(Method::ALL.iter().filter(|m| m.servable()).count(), 12);
    }
}
