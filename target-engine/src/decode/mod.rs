//! Decoding strategies ([`batch`] runs the decode steps of concurrent requests together): each one uses the model's forward passes (`crate::model`) and the
//! cache's views (`crate::view`) to turn a prefilled cache into an answer. Plain and sampled
//! decoding ([`generate`] with the core's [`crate::sampling`], [`repetition`]'s loop detector), speculative decoding
//! with prompt lookup or a draft model ([`speculative`]), verification of a reused cache's
//! drafts against a full prefill ([`verify`]; [`checked`] is its greedy rule on any
//! [`crate::engine::Engine`]), long-context drafting from a sparse view
//! ([`sparse`], SpeCache) or a retrieval head ([`specontext`], SpeContext), and the one place
//! an answer's text is made from its tokens ([`stream`]); [`draft`] holds what the drafting
//! strategies share, so none imports another's internals.

/// Milliseconds since `t`.
pub(crate) fn ms(t: std::time::Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

pub mod batch;
pub mod checked;
pub mod draft;
pub mod generate;
pub mod logprobs;
pub mod repetition;
pub mod sparse;
pub mod specontext;
pub mod speculative;
pub mod stream;
mod turns;
pub mod verify;
