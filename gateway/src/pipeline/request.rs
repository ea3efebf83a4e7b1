//! What a query asks: the validated [`Query`] with its defaults, the passages it brings, the
//! pieces its answer streams in, and the server-wide settings a query may override (where
//! SpecCache's scores come from, chunk order, drafting, long-context drafting).

use crate::fidelity::Fidelity;
use crate::method::Method;
use serde::{Deserialize, Serialize};

/// A validated query.
#[derive(Debug, Clone)]
pub struct Query {
    /// The question: what retrieval searches for and what the prompt ends with.
    pub query: String,
    /// Plain text placed before the question, after the chunks (an OpenAI client's system
    /// message and earlier turns); recomputed on every request.
    pub context: String,
    /// Passages the client retrieved itself: read in this order instead of retrieving from
    /// the collection (which still scopes their stored KV). Empty: retrieve `top_k`.
    pub documents: Vec<Passage>,
    /// With `documents`: retrieve `top_k` from the collection as well, read after them (the
    /// passages an OpenAI client pasted into its messages add to retrieval; `documents` sent
    /// explicitly replace it).
    pub retrieve_too: bool,
    pub collection: String,
    pub top_k: usize,
    pub method: Method,
    /// ρ: recomputed chunk tokens over all chunk tokens (budget of the budgeted methods).
    pub ratio: f64,
    pub max_tokens: usize,
    pub temperature: f32,
    /// Nucleus sampling: the smallest set of tokens whose probabilities reach this mass.
    pub top_p: f32,
    /// Generation ends before the first of these strings (not with `verify`).
    pub stop: Vec<String>,
    pub seed: u64,
    pub verify: bool,
    /// How much quality the request may trade for speed; `Exact` goes with `verify`.
    pub fidelity: Fidelity,
    /// Speculative decoding (drafts from prompt lookup and/or the speculator, as `spec_draft`
    /// says, checked by the target); `None`: the pipeline's default.
    pub spec_decode: Option<bool>,
    /// What drafts for speculative decoding; `None`: the pipeline's default.
    pub spec_draft: Option<SpecDraft>,
    /// Long-context drafting for this request; `None`: the pipeline's default.
    pub long_context: Option<bool>,
    /// Most tokens the prompt and the answer may take together; `None`: the pipeline's
    /// `max_context_tokens` (never above it).
    pub max_context_tokens: Option<usize>,
    /// Report each answer token's logprob and this many alternatives (0 to 20); `None`:
    /// none (no cost).
    pub logprobs: Option<usize>,
}

/// The default ρ. The fidelity study found no selector, the oracle bound included, identical to
/// full recompute in 80% of the multi-hop profile cases at ρ = 0.15; `target_probe` at 0.25 was
/// the highest-identity setting whose median TTFT stays within 0.4 of full recompute's
/// (docs/evaluation.md, "Results of the fidelity study").
pub const DEFAULT_RATIO: f64 = 0.25;

/// A passage a query brings (validated: text not blank, id named).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Passage {
    pub id: String,
    pub text: String,
}

impl Query {
    /// The fidelity the request runs at: `exact` where it verifies, whatever `fidelity` says
    /// (what the guard's report names and what decoding is steered by).
    pub(crate) fn runs_at(&self) -> Fidelity {
        if self.verify {
            Fidelity::Exact
        } else {
            self.fidelity
        }
    }

    /// Whether the fidelity guard watches the decode from the reused cache: a `balanced`
    /// request under a method that reuses (full recompute decodes from the full cache
    /// already, `exact` is verified).
    pub(crate) fn guarded(&self) -> bool {
        self.runs_at() == Fidelity::Balanced && !self.method.is_full()
    }
}

impl Default for Query {
    fn default() -> Self {
        Self {
            query: String::new(),
            context: String::new(),
            documents: Vec::new(),
            retrieve_too: false,
            collection: "default".into(),
            top_k: 4,
            method: Method::TargetProbeShift,
            ratio: DEFAULT_RATIO,
            max_tokens: 128,
            temperature: 0.0,
            top_p: 1.0,
            stop: Vec::new(),
            seed: 0,
            verify: false,
            fidelity: Fidelity::default(),
            spec_decode: None,
            spec_draft: None,
            long_context: None,
            max_context_tokens: None,
            logprobs: None,
        }
    }
}

/// A piece of a streamed answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece<'a> {
    /// Final text (no verification).
    Token(&'a str),
    /// Text drafted from the reused cache, not final yet (verification).
    Draft(&'a str),
    /// Text now final (verification).
    Commit(&'a str),
    /// The last `n` drafted tokens were wrong and are withdrawn (verification).
    Retract(usize),
    /// The text streamed so far is replaced by this text, and the answer goes on from it (the
    /// fidelity guard moved the request to the full cache, or to a second look that answers).
    Replace(&'a str),
}

/// Where SpecCache's scores come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ScoreSource {
    /// One speculator pass over the whole prompt per query (the paper's method).
    Query,
    /// Scores stored with each chunk at ingestion (no speculator pass at query time; chunks
    /// after the first miss their cross-chunk context). Falls back to `Query` when a chunk has
    /// no stored scores.
    Ingest,
}

/// In which order retrieved chunks enter the prompt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ChunkOrder {
    /// Best BM25 score first.
    Rank,
    /// By document id, then position in the document: a long document retrieved whole reads
    /// in its own order (needle-in-a-haystack depth, LongBench contexts).
    Document,
    /// The retrieved chunk with the most tokens first, the others by rank. The first chunk's
    /// stored KV is exact where it stands (precomputed after the template prefix), so the
    /// blend recomputes none of it and an escalation's full prefill keeps it: the longer it
    /// is, the fewer rows are approximated and the less an escalation recomputes. Passages a
    /// client sends keep their order. The server's default (docs/fidelity-guard.md,
    /// *Why each default*).
    #[default]
    LongestFirst,
}

/// Long-context drafting (issue 44; `--long-context`, `long_context` per request): greedy
/// answers over prompts of at least `min_tokens` draft from SpeCache's view of the cache (the
/// rows a step attends to chosen on low-bit keys, [`target_engine::TopKView`]), every round
/// checked in one full-attention pass, so the answer is plain decoding's, token for token.
/// It replaces speculative decoding's drafter for those answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LongContext {
    pub on: bool,
    pub min_tokens: usize,
    pub view: target_engine::TopKConfig,
}

/// Prompts from which long-context drafting runs when it is on.
pub const DEFAULT_LONG_CONTEXT_MIN_TOKENS: usize = 24_576;

/// Long-context drafting unless a request says otherwise (`--long-context`): off, because with
/// decode attention grouped by kv head full attention decodes 8k-32k tokens faster than the
/// drafter does verified on 2 cores (docs/long-context.md has the figures).
pub const DEFAULT_LONG_CONTEXT: bool = false;

impl Default for LongContext {
    fn default() -> Self {
        Self {
            on: DEFAULT_LONG_CONTEXT,
            min_tokens: DEFAULT_LONG_CONTEXT_MIN_TOKENS,
            view: target_engine::TopKConfig::default(),
        }
    }
}

/// What proposes the tokens speculative decoding checks (`spec_draft`, `--spec-draft`). The
/// default is `lookup`: on 20 HotpotQA prompts with 256-token answers it decoded in 0.55 of
/// plain decoding's time per token, `both` in 0.67 and `model` in 0.88, every answer
/// identical (docs/performance.md, *Speculative decoding*).
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    clap::ValueEnum,
    utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum SpecDraft {
    /// Prompt lookup: the tokens that followed the longest tail of the answer (1-16 tokens)
    /// where it occurs in the prompt or the answer so far, more of them the longer the match
    /// (no model pass; works with any speculator, or none).
    #[default]
    Lookup,
    /// The speculator only (a model of the target's vocabulary over its stored chunk KV).
    Model,
    /// Prompt lookup first, the speculator where fewer than 2 tokens match.
    Both,
}

impl SpecDraft {
    pub(crate) fn uses_lookup(self) -> bool {
        self != Self::Model
    }

    pub(crate) fn uses_model(self) -> bool {
        self != Self::Lookup
    }
}

/// Speculative decoding unless a request says otherwise (`--spec-decode`): on, because on
/// real RAG prompts it decoded in 0.55-0.57 of the time per token with prompt lookup drafting, with
/// identical answers (docs/performance.md, *Speculative decoding*).
pub const DEFAULT_SPEC_DECODE: bool = true;
