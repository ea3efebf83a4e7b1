//! The one name of a served reuse method, from the API and the CLI down to the one
//! [`Selector`] that serves a request. Every variant is served; the evaluation's own
//! selectors (ablations, bounds) live in `eval` and reach the pipeline through its
//! [`Experiment`](crate::pipeline::Experiment).

use serde::{Deserialize, Serialize};
use speculator::{ScoredSpecCache, ScoredTokens, SpecCache};
use target_engine::{
    CacheBlend, Engine, Epic, FullRecompute, FullReuse, PrefixCaching, Selector, TargetProbe,
};

/// Declares [`Method`] once: each variant's doc comment is its documentation in rustdoc, in
/// `--help` (clap reads the doc comments) and in the OpenAPI schema ([`Method::doc`]), and its
/// name is its name everywhere.
macro_rules! methods {
    ($($(#[doc = $doc:literal])+ $variant:ident = $name:literal,)+) => {
        /// How the prompt's tokens to recompute are chosen (`method` in the API, `--method` on
        /// the command line).
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
        pub enum Method {
            $(
                $(#[doc = $doc])+
                #[serde(rename = $name)]
                #[value(name = $name)]
                $variant,
            )+
        }

        impl Method {
            /// Every method, in the order reports list them.
            pub const ALL: &'static [Method] = &[$(Method::$variant),+];

            /// The name in the API, on the command line and in reports.
            pub fn name(&self) -> &'static str {
                match self {
                    $(Self::$variant => $name,)+
                }
            }

            /// The variant's doc comment, one line (what the OpenAPI schema says of it).
            pub fn doc(&self) -> String {
                let lines: &[&str] = match self {
                    $(Self::$variant => &[$($doc),+],)+
                };
                lines.iter().map(|l| l.trim()).collect::<Vec<_>>().join(" ")
            }
        }
    };
}

methods! {
    /// Recompute everything (the reference; no stored KV is used).
    FullRecompute = "full_recompute",
    /// Reuse every chunk's KV as is.
    FullReuse = "full_reuse",
    /// Reuse only the template prefix and an exact first chunk (ordinary prefix caching).
    Prefix = "prefix",
    /// Recompute the first tokens of every chunk (EPIC), at the same budget.
    Epic = "epic",
    /// Recompute the tokens whose early-layer KV deviates most (CacheBlend).
    Cacheblend = "cacheblend",
    /// The speculator picks the tokens by hidden-state norms (SpecCache), with span completion.
    Speccache = "speccache",
    /// SpecCache without span completion.
    SpeccacheNospan = "speccache_nospan",
    /// The question's pass over the reused cache picks the chunk tokens its deep layers
    /// attend to (query-aware, one question pass).
    TargetProbe = "target_probe",
    /// `target_probe` recomputing a few tokens around every pick instead of scattered tokens.
    TargetProbeSpan = "target_probe_span",
    /// The speculator's question-to-chunk attention (deeper half of its layers) picks the
    /// tokens, completed into spans and mapped onto target tokens as SpecCache does, over the
    /// speculator's own chunk KV stored at ingestion (computed and stored on first use
    /// otherwise): a query costs a speculator pass over the question only.
    SpecAttn = "spec_attn",
    /// `spec_attn` with the speculator reading the whole prompt per query instead of its
    /// stored chunk KV.
    SpecAttnFull = "spec_attn_full",
    /// `target_probe` with each reused chunk token moved, layer by layer, as the picks whose
    /// keys it resembles were moved by recomputing (no extra recompute). The default.
    TargetProbeShift = "target_probe_shift",
}

/// Tokens on each side of a `target_probe_span` pick.
pub const PROBE_WINDOW: usize = 2;

/// Where a SpecCache method's scores come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecScores {
    /// Hidden-state norms of the chunk tokens (stored at ingestion, or a query-time pass).
    Norms,
    /// The speculator's question attention over its stored chunk KV (always at query time).
    StoredAttention,
    /// The speculator's question attention over a pass of the whole prompt.
    PromptAttention,
}

impl Method {
    /// Parses a name of [`Method::name`].
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|m| m.name() == s)
    }

    /// Where the scores of a method that needs the speculator come from; `None` for the others.
    pub fn spec_scores(&self) -> Option<SpecScores> {
        match self {
            Self::Speccache | Self::SpeccacheNospan => Some(SpecScores::Norms),
            Self::SpecAttn => Some(SpecScores::StoredAttention),
            Self::SpecAttnFull => Some(SpecScores::PromptAttention),
            _ => None,
        }
    }

    /// True for the methods that need a speculator model and its scores.
    pub fn uses_speculator(&self) -> bool {
        self.spec_scores().is_some()
    }

    /// True when SpecCache's picks are completed into spans (every SpecCache method but
    /// `speccache_nospan`).
    pub fn completes_spans(&self) -> bool {
        *self != Self::SpeccacheNospan
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
    /// spending the budget.
    pub fn selector<'a>(&self, inputs: SelectorInputs<'a>) -> Box<dyn Selector + 'a> {
        match self {
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
            // Written once over the engine interface (never `None` for these).
            any => any
                .engine_selector(inputs.epic_k)
                .unwrap_or_else(|| Box::new(FullReuse)),
        }
    }
}

impl Method {
    /// True for the methods every engine runs (the CPU engine's and the device's): those
    /// whose selector is written once over [`target_engine::Engine`]. CacheBlend and the
    /// SpecCache methods run on the CPU engine only.
    pub fn on_any_engine(&self) -> bool {
        !matches!(self, Self::Cacheblend) && !self.uses_speculator()
    }

    /// The selector of a method every engine runs ([`Method::on_any_engine`]), on engine `E`;
    /// `None` for the others. `epic_k` as for [`Method::selector`].
    pub fn engine_selector<'a, E: Engine + 'a>(
        &self,
        epic_k: Option<usize>,
    ) -> Option<Box<dyn Selector<E> + 'a>> {
        Some(match self {
            Self::FullRecompute => Box::new(FullRecompute),
            Self::FullReuse => Box::new(FullReuse),
            Self::Prefix => Box::new(PrefixCaching),
            Self::Epic => Box::new(Epic { k: epic_k }),
            Self::TargetProbe => Box::new(TargetProbe::default()),
            Self::TargetProbeSpan => Box::new(TargetProbe {
                window: PROBE_WINDOW,
                ..TargetProbe::default()
            }),
            Self::TargetProbeShift => Box::new(TargetProbe {
                shift: true,
                ..TargetProbe::default()
            }),
            Self::Cacheblend
            | Self::Speccache
            | Self::SpeccacheNospan
            | Self::SpecAttn
            | Self::SpecAttnFull => return None,
        })
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
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl utoipa::PartialSchema for Method {
    /// Every method by name, described by its doc comment.
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        let each: Vec<String> = Self::ALL
            .iter()
            .map(|m| format!("`{}`: {}", m.name(), m.doc()))
            .collect();
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .enum_values(Some(Self::ALL.iter().map(|m| m.name())))
            .description(Some(format!(
                "How the prompt's tokens to recompute are chosen. {}",
                each.join(" ")
            )))
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
        for &m in Method::ALL {
            assert_eq!(Method::parse(m.name()), Some(m));
            let json = serde_json::to_string(&m).expect("serialize");
            assert_eq!(json, format!("\"{}\"", m.name()));
            let back: Method = serde_json::from_str(&json).expect("deserialize");
            assert_eq!(back, m);
            let pv = m.to_possible_value().expect("a clap value");
            assert_eq!(pv.get_name(), m.name());
            let help = pv
                .get_help()
                .expect("clap help from the doc comment")
                .to_string();
            assert!(m.doc().starts_with(help.trim_end_matches('.')), "{help}");
        }
        assert_eq!(Method::parse("speccache@0.15"), None);
        assert_eq!(Method::parse("oracle"), None, "a bound of the evaluation's");
        assert_eq!(Method::ALL.len(), 12);
        assert_eq!(Method::value_variants().len(), Method::ALL.len());
    }

    #[test]
    fn the_schema_lists_every_method_with_its_doc_comment() {
        use utoipa::PartialSchema;
        let json = serde_json::to_value(Method::schema()).expect("schema");
        let names: Vec<&str> = json["enum"]
            .as_array()
            .expect("enum")
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        assert_eq!(
            names,
            Method::ALL.iter().map(|m| m.name()).collect::<Vec<_>>()
        );
        let text = json["description"].as_str().expect("description");
        for m in Method::ALL {
            let entry = format!("`{}`: {}", m.name(), m.doc());
            assert!(text.contains(&entry), "{entry} missing from {text}");
        }
        assert!(Method::TargetProbeShift.doc().contains("The default."));
        assert!(
            !Method::SpecAttn.doc().contains("  "),
            "lines joined by one space"
        );
    }
}
