//! The target engine: GGUF loading (qwen2, llama, qwen3, phi3, gemma3), a tokenizer built from the file's own
//! metadata, and a transformer forward pass written over candle ops.
//!
//! The one design choice a reader must know: the model holds no cache. [`Model::forward`] takes
//! token ids, their explicit positions and an external [`KvCache`] whose row `p` is the token
//! at position `p`; it writes the rows it computes and reads the others. Full prefill, decode,
//! and recomputing an arbitrary subset of positions against reused chunk KV are all the same
//! call. The LM head is a separate step ([`Model::logits`]).
//!
//! One engine interface, two backends: [`Engine`] is what the served path asks of a target
//! model (prefill, chunk precompute, KV placed into a cache, the probe, the blended pass and
//! its shift, every row's logits, batched decode steps). [`Model`], the CPU engine, is the
//! bit-exact reference; [`device::DeviceModel`] runs the same passes as candle ops on a GPU.
//! What is built from the passes (the fused cache, the served selectors, the blend, greedy and
//! verified decoding, the decode batcher) is written once, generic over [`Engine`].
//!
//! A core and three wings. The core: [`gguf`], [`config`], [`tokenizer`], `weights` (loading
//! and quantized products), [`model`] (forward passes), [`engine`], [`chat`] (the file's chat
//! template), [`kv`] (caches, and chunk KV as stored), [`view`] (what a forward attends over
//! when a drafter reads less), `hook` (what a forward lets a strategy do to the cache at each
//! layer), [`sampling`] (choosing a token from logits, greedy or seeded), [`stop`], [`error`]
//! and [`testing`] (tiny random-weight files). The wings: [`decode`], the strategies that turn
//! a prefilled cache into an answer; [`reuse`], chunk KV, selection and the blended prefill
//! (and the CPU engine's side of [`Engine`]); [`device`], the device engine's passes and
//! continuous batching. The wings use the core, never each other, and the core uses none of
//! them.

pub mod chat;
pub mod config;
pub mod decode;
pub mod device;
pub mod engine;
pub mod error;
pub mod gguf;
mod hook;
pub mod kv;
pub mod model;
pub mod reuse;
pub mod sampling;
pub mod stop;
pub mod testing;
pub mod tokenizer;
pub mod view;
mod weights;

/// Weight formats, for [`LoadOptions::requantize`].
pub use candle_core::quantized::GgmlDType;
pub use chat::{ChatFormat, ChatSource};
pub use config::{Architecture, ModelConfig, SlidingWindow};
pub use decode::batch::{
    in_first_token_turn, in_prefill_turn, in_prefill_turn_of, prefill_pieces, take_turn_at,
    with_batcher, BatchStats, Batching, DecodeBatcher, PrefillOrder, TurnKind, WorkTurns,
};
pub use decode::checked::{greedy, verified_greedy, Verified};
pub use decode::draft::{DraftLength, SpecDecodeStats};
pub use decode::generate::{
    chat_prompt, raw_prompt, FilledCache, FinishReason, GenerateParams, Generation, Pick,
    Prefilled, DEFAULT_SYSTEM,
};
pub use decode::logprobs::{Logprob, TokenLogprobs, MAX_TOP_LOGPROBS};
pub use decode::repetition::LoopDetector;
pub use decode::sparse::{kivi_cache, TopKConfig, TopKView, ViewDraft, ViewGeneration, ViewParams};
pub use decode::specontext::{
    ContextHead, RetrievalHead, RowScorer, SpeContextConfig, SpeContextView,
};
pub use decode::speculative::{Drafter, PromptLookup};
pub use decode::stream::{Flow, Shown, TextStream};
pub use decode::verify::{Continuation, VerifiedGeneration, VerifyEvent, VerifyMode, VerifyParams};
pub use engine::{Engine, ShiftGroup, ShiftRule, Step, StepEngine};
pub use error::{EngineError, Result};
pub use kv::KvCache;
pub use kv::{ChunkKv, PrecomputeMode, PrefixKv};
pub use model::{ForwardOutput, LoadOptions, Model};
pub use reuse::assembly::{Assembly, RagTemplate, Segment, SegmentKind};
pub use reuse::blend::{
    blend_on, blend_shift, fused, kind_at, BlendOutput, BlendSignals, DeviationCheck,
};
pub use reuse::select::{
    budget, layer_span, ranked_rest, top_k, uncovered, CacheBlend, Epic, FullRecompute, FullReuse,
    PrefixCaching, Probe, ProbeScores, SelectInput, Selector, TargetProbe,
};
pub use sampling::{argmax, Sampler, SamplingParams};
pub use tokenizer::{Encoding, TokenType, Tokenizer};
pub use view::AttentionView;

/// The strategies' traits on [`Model`] (`use target_engine::prelude::*;`): the core keeps the
/// forward passes, each wing adds what it does with them.
pub mod prelude {
    pub use crate::decode::generate::Generate;
    pub use crate::decode::sparse::ViewDecode;
    pub use crate::decode::speculative::Speculate;
    pub use crate::decode::verify::Verify;
    pub use crate::reuse::blend::Blend;
    pub use crate::reuse::chunk::Precompute;
}
