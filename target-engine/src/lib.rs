//! The target engine: GGUF loading (qwen2, llama), a tokenizer built from the file's own
//! metadata, and a transformer forward pass written over candle ops.
//!
//! The one design choice a reader must know: the model holds no cache. [`Model::forward`] takes
//! token ids, their explicit positions and an external [`KvCache`] whose row `p` is the token
//! at position `p`; it writes the rows it computes and reads the others. Full prefill, decode,
//! and (later) recomputing an arbitrary subset of positions against reused chunk KV are all
//! the same call. The LM head is a separate step ([`Model::logits`]).

pub mod assembly;
pub mod blend;
pub mod chunk;
pub mod config;
pub mod error;
pub mod fidelity;
pub mod generate;
pub mod gguf;
pub mod kv;
pub mod model;
pub mod repetition;
pub mod sampling;
pub mod select;
pub mod sparse;
pub mod specontext;
pub mod speculative;
pub mod stop;
pub mod stream;
pub mod testing;
pub mod tokenizer;
pub mod verify;

pub use assembly::{Assembly, RagTemplate, Segment, SegmentKind};
pub use blend::{kind_at, BlendOutput};
/// Weight formats, for [`LoadOptions::requantize`].
pub use candle_core::quantized::GgmlDType;
pub use chunk::{ChunkKv, PrecomputeMode, PrefixKv};
pub use config::{Architecture, ModelConfig};
pub use error::{EngineError, Result};
pub use generate::{
    chat_prompt, raw_prompt, FinishReason, GenerateParams, Generation, DEFAULT_SYSTEM,
};
pub use kv::KvCache;
pub use model::{ForwardOutput, LoadOptions, Model};
pub use repetition::LoopDetector;
pub use sampling::{argmax, Sampler, SamplingParams};
pub use select::{
    budget, even_shares, top_k, CacheBlend, Epic, FullRecompute, FullReuse, Oracle, PrefixCaching,
    Random, SelectInput, Selector, TargetProbe,
};
pub use sparse::{kivi_cache, AttentionView, TopKConfig, TopKView, ViewGeneration, ViewParams};
pub use specontext::{ContextHead, RetrievalHead, RowScorer, SpeContextConfig, SpeContextView};
pub use speculative::{DraftLength, Drafter, PromptLookup, SpecDecodeStats};
pub use stream::{Flow, Shown, TextStream};
pub use tokenizer::{Encoding, TokenType, Tokenizer};
pub use verify::{VerifiedGeneration, VerifyEvent, VerifyMode, VerifyParams};
