//! The query pipeline shared by `specrag query`, the HTTP server and the evaluation:
//! retrieve -> load chunk KV (memory, disk or recompute) while the speculator scores the prompt
//! -> select -> align -> blended prefill -> decode. Every answer carries its timings and reuse
//! statistics.
//!
//! One file per job: `road.rs` checks a query and runs the steps in order; `request.rs` holds
//! what a query asks, `retrieve.rs` the chunks it reads and its prompt, `blend.rs` chunk KV,
//! selection and the blended prefill, `decode.rs` decoding or verification (the fidelity
//! guard's driving code is beside its policy, in `crate::fidelity`), `generate.rs` plain and
//! speculative generation from a cache, `context_cache.rs` the full caches kept for repeats,
//! `experiment.rs` the interface an evaluation implements and the trace it gets back.

pub(crate) mod backend;
mod blend;
mod context_cache;
mod decode;
mod experiment;
pub(crate) mod generate;
mod request;
mod retrieve;
mod road;

use crate::corpus::{Corpus, Engines};
use crate::fidelity::GuardPolicy;
use std::time::Instant;
use target_engine::VerifyMode;

pub use crate::answer::{Answer, ChunkRef, Reuse, Timings, VerifyStats};
pub use crate::method::{Method, SelectorInputs};
pub use context_cache::{ContextCache, DEFAULT_CONTEXT_CACHE_BYTES};
pub use experiment::{Experiment, Selected, Served, Traced};
pub use request::{
    ChunkOrder, LongContext, Passage, Piece, Query, ScoreSource, SpecDraft, DEFAULT_LONG_CONTEXT,
    DEFAULT_LONG_CONTEXT_MIN_TOKENS, DEFAULT_RATIO, DEFAULT_SPEC_DECODE,
};

/// The models and the data directory behind every query.
#[derive(Debug)]
pub struct Pipeline {
    pub engines: Engines,
    pub corpus: Corpus,
    pub score_source: ScoreSource,
    /// How decoding continues once the full cache is ready (`verify: true`).
    pub verify_mode: VerifyMode,
    /// When the fidelity guard of `balanced` requests escalates.
    pub guard: GuardPolicy,
    /// Speculative decoding for requests that do not say (`--spec-decode`).
    pub spec_decode: bool,
    /// In which order retrieved chunks enter the prompt (`--chunk-order`).
    pub chunk_order: ChunkOrder,
    /// What drafts for requests that do not say (`--spec-draft`).
    pub spec_draft: SpecDraft,
    /// Long-context drafting (`--long-context`).
    pub long_context: LongContext,
    /// Most tokens a request's prompt and answer may take together (`--max-context-tokens`;
    /// at most the target's context length; [`crate::admission::DEFAULT_MAX_CONTEXT_TOKENS`]
    /// unless set).
    pub max_context_tokens: usize,
    /// Bytes of KV one request may hold at once (`--kv-memory-budget`): a request over it is
    /// refused before any model work ([`crate::admission`]).
    pub kv_memory_budget: u64,
    /// The KV the running requests hold, against `kv_memory_budget`.
    pub kv_held: crate::admission::KvLedger,
    pub contexts: ContextCache,
}

/// The KV budget of a pipeline on `target`: the host's default, and on a GPU no more than
/// its free memory allows ([`crate::admission::device_budget`]).
fn default_budget(target: &crate::target::Target) -> u64 {
    let host = crate::admission::default_budget();
    match target {
        // Hot chunks kept on the device take their room from what is free.
        crate::target::Target::Device(d) => d.memory().map_or(host, |m| {
            let hot = d.hot_chunks().budget;
            crate::admission::device_budget(host, m.used.saturating_add(hot), m.total)
        }),
        crate::target::Target::Cpu(_) => host,
    }
}

/// Milliseconds since `t`.
pub(crate) fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

impl Pipeline {
    /// A pipeline with the default verification settings.
    pub fn new(mut engines: Engines, corpus: Corpus, score_source: ScoreSource) -> Self {
        let codec = corpus.store.disk().codec();
        engines.lossy_codec = codec.is_lossy().then_some(codec);
        let max_context_tokens =
            crate::admission::default_context(engines.target.config().context_length);
        let kv_memory_budget = default_budget(&engines.target);
        Self {
            engines,
            corpus,
            score_source,
            verify_mode: VerifyMode::FromFull,
            guard: GuardPolicy::default(),
            spec_decode: DEFAULT_SPEC_DECODE,
            chunk_order: ChunkOrder::default(),
            spec_draft: SpecDraft::default(),
            long_context: LongContext::default(),
            max_context_tokens,
            kv_memory_budget,
            kv_held: crate::admission::KvLedger::default(),
            contexts: ContextCache::new(DEFAULT_CONTEXT_CACHE_BYTES),
        }
    }
}
