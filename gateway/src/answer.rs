//! The answer to a query as the API returns it (`Answer` and its parts). It lives beside the
//! pipeline that builds it, apart from the request types in `api.rs`, so neither imports the
//! other back.

use crate::method::Method;
use serde::{Deserialize, Serialize};
use target_engine::FinishReason;

/// Where the time of one query went (milliseconds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Timings {
    pub retrieve_ms: f64,
    /// Loading chunk KV (memory, disk, or recompute on a miss).
    pub kv_load_ms: f64,
    /// The speculator's pass (runs in parallel with the KV load).
    pub speculate_ms: f64,
    /// Selection (top-K, spans, budget) and mapping onto target tokens.
    pub align_ms: f64,
    /// Blended (or full) prefill, including a baseline's own selection.
    pub prefill_ms: f64,
    /// From the request's arrival (on the server: its queueing, `queue_ms` included) until
    /// the first token's logits are ready.
    pub ttft_ms: f64,
    pub decode_ms: f64,
    /// From the request's arrival until its answer was complete.
    pub total_ms: f64,
    /// On the server, how long the request waited before its work began: in the queue for
    /// a query thread, then for its first prefill turn behind the other requests' prefills
    /// (0 where nothing else ran, and in process).
    #[serde(default)]
    pub queue_ms: f64,
}

/// How much of the prompt was reused.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Reuse {
    /// Chunk tokens in the prompt.
    pub chunk_tokens: usize,
    /// Chunk tokens the target recomputed.
    pub recomputed_tokens: usize,
    /// `recomputed_tokens / chunk_tokens` (0 with no chunks).
    pub ratio: f64,
    /// Chunks whose KV came from memory, from disk, or had to be computed now.
    pub chunks_from_memory: usize,
    pub chunks_from_disk: usize,
    /// Chunks read from the remote tier (`--kv-remote`) because no local tier had them.
    #[serde(default)]
    pub chunks_from_remote: usize,
    pub chunks_recomputed: usize,
    /// What the fidelity guard measured and decided (absent in records written before it).
    #[serde(default)]
    pub guard: crate::fidelity::GuardReport,
}

/// A retrieved chunk as reported with the answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ChunkRef {
    /// Chunk id (stable across re-ingestion of the same document).
    pub id: String,
    pub doc_id: String,
    pub title: Option<String>,
    /// BM25 score.
    pub score: f32,
    /// Position of the chunk within its document.
    pub position: usize,
    pub tokens: usize,
    pub text: String,
}

/// The answer to a query.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Answer {
    pub answer: String,
    pub method: Method,
    /// `eos`, `stop`, `length` or `cancelled`.
    #[schema(value_type = String, example = "eos")]
    pub finish_reason: FinishReason,
    /// Generated tokens.
    pub tokens: usize,
    /// Tokens of the prompt (template, chunks, question).
    #[serde(default)]
    pub prompt_tokens: usize,
    pub chunks: Vec<ChunkRef>,
    pub timings: Timings,
    pub reuse: Reuse,
    /// With `verify: true`: what drafting and verification did. The answer is the
    /// full-recompute answer token for token (with `temperature > 0` it is decoded from the
    /// full cache: the same samples full recompute draws with that seed, nothing drafted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<VerifyStats>,
    /// With speculative decoding (`spec_decode`, `--spec-decode`): what the drafter proposed
    /// and the target kept. The answer is the one plain decoding gives, token for token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_decode: Option<SpecDecodeReport>,
    /// With long-context drafting (`long_context`, `--long-context`): what SpeCache's view
    /// of the cache drafted and full attention kept, in the same shape (`lookup_*` stay 0).
    /// The answer is the one plain decoding gives, token for token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub long_context: Option<SpecDecodeReport>,
    /// With `logprobs`: per answer token, its log-probability under the distribution that
    /// chose it (the decode step, speculative or verification pass that chose it) and the
    /// most likely tokens there, in OpenAI's layout. Greedy answers' tokens are each their
    /// position's first alternative.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<TokenLogprob>>,
}

impl Answer {
    /// Counts `waited` before the request's work began (the server's queueing): in
    /// `timings.queue_ms`, and in every time measured from the request's arrival (time to
    /// first token, in all, and verification's first committed token).
    pub fn add_wait(&mut self, waited: std::time::Duration) {
        let ms = waited.as_secs_f64() * 1e3;
        self.timings.queue_ms += ms;
        self.timings.ttft_ms += ms;
        self.timings.total_ms += ms;
        if let Some(v) = self.verify.as_mut() {
            v.first_commit_ms += ms;
        }
    }
}

/// One answer token's evidence (OpenAI's `logprobs.content[]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TokenLogprob {
    /// The token's text (invalid UTF-8, a piece of a character, shown as U+FFFD).
    pub token: String,
    /// Natural log of its probability (-9999 where it is 0), computed in f32.
    pub logprob: f64,
    /// The token's bytes.
    pub bytes: Vec<u8>,
    /// The most likely tokens at this position, most likely first (as many as asked).
    pub top_logprobs: Vec<TopLogprob>,
}

/// A likely token at one position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f64,
    pub bytes: Vec<u8>,
}

/// A logprob as the API writes it: -9999 for an impossible token, as OpenAI does (JSON has
/// no infinity), widened to f64 so that every route writes the same digits.
fn finite(logprob: f32) -> f64 {
    if logprob.is_finite() {
        f64::from(logprob.max(-9999.0))
    } else {
        -9999.0
    }
}

impl TokenLogprob {
    /// The API's form of `t`, its tokens spelled by `tok`.
    pub fn of(tok: &target_engine::Tokenizer, t: &target_engine::TokenLogprobs) -> Self {
        let top = |l: &target_engine::Logprob| {
            let bytes = tok.token_bytes(l.id).to_vec();
            TopLogprob {
                token: String::from_utf8_lossy(&bytes).into_owned(),
                logprob: finite(l.logprob),
                bytes,
            }
        };
        let chosen = top(&t.chosen);
        Self {
            token: chosen.token,
            logprob: chosen.logprob,
            bytes: chosen.bytes,
            top_logprobs: t.top.iter().map(top).collect(),
        }
    }
}

/// What speculative decoding did for one answer: prompt lookup or the speculator (over its
/// own cache of the prompt) drafted tokens, the target checked them in one pass per round.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct SpecDecodeReport {
    /// Tokens proposed (by prompt lookup and the speculator).
    pub drafted: usize,
    /// Proposals the target agreed with (each saves one target pass).
    pub accepted: usize,
    /// Of `drafted` and `accepted`, those prompt lookup proposed (copied from the prompt;
    /// the rest came from the speculator).
    #[serde(default)]
    pub lookup_drafted: usize,
    #[serde(default)]
    pub lookup_accepted: usize,
    /// `accepted / drafted` (0 when nothing was drafted).
    pub acceptance: f64,
    /// Checking passes of the target.
    pub rounds: usize,
    /// The draft length at the end (it grows while proposals are accepted).
    pub draft_len: usize,
    /// Time spent drafting and checking (ms).
    pub draft_ms: f64,
    pub verify_ms: f64,
    /// Why drafting stopped early (decoding went on one token per pass; the answer is the
    /// same).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drafter_error: Option<String>,
}

impl From<target_engine::SpecDecodeStats> for SpecDecodeReport {
    fn from(s: target_engine::SpecDecodeStats) -> Self {
        Self {
            acceptance: s.acceptance(),
            drafted: s.drafted,
            accepted: s.accepted,
            lookup_drafted: s.lookup_drafted,
            lookup_accepted: s.lookup_accepted,
            rounds: s.rounds,
            draft_len: s.draft_len,
            draft_ms: s.draft_ms,
            verify_ms: s.verify_ms,
            drafter_error: s.drafter_error,
        }
    }
}

/// What verification did: tokens drafted from the reused cache, accepted by the full cache,
/// and corrected by it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct VerifyStats {
    pub drafted: usize,
    pub accepted: usize,
    pub corrected: usize,
    /// Verification passes over the full cache.
    pub rounds: usize,
    /// Mean drafted tokens accepted per pass.
    pub mean_accepted: f64,
    /// From the request's arrival to the first committed (final) token.
    pub first_commit_ms: f64,
    /// What the full prefill took (0 when the exact-context cache had it).
    pub full_prefill_ms: f64,
    /// The full cache of this exact context was already cached.
    pub context_cache_hit: bool,
}
