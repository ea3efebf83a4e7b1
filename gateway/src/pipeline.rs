//! The query pipeline shared by `specrag query`, the HTTP server and the evaluation:
//! retrieve -> load chunk KV (memory, disk or recompute) while the speculator scores the prompt
//! -> select -> align -> blended prefill -> decode. Every answer carries its timings and reuse
//! statistics.

use crate::corpus::{Corpus, Engines, LoadedChunk, Tier};
use crate::error::{GatewayError, Result};
use crate::fidelity::{Fidelity, GuardPolicy, GuardReport, LookRows};
use serde::{Deserialize, Serialize};
use speculator::{ChunkScores, LayerRange, ScoredTokens};
use std::sync::Arc;
use std::time::Instant;
use target_engine::prelude::*;
use target_engine::{
    Assembly, BlendOutput, ChunkKv, FinishReason, Flow, GenerateParams, KvCache, SamplingParams,
    SelectInput, Shown, SpecDecodeStats as SpecStats, TextStream, VerifyEvent, VerifyMode,
    VerifyParams,
};

pub use crate::answer::{Answer, ChunkRef, Reuse, Timings, VerifyStats};
pub use crate::method::{Method, SelectorInputs};

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
    /// client sends keep their order. The server's default (eval/study/guard-measurements.md,
    /// *The longest chunk first*).
    #[default]
    LongestFirst,
}

/// What the evaluation varies beyond what a request can ask, an interface the evaluation
/// implements ([`Pipeline::query_with`]); a served query is [`Served`], every default.
pub trait Experiment {
    /// In which order the retrieved chunks enter the prompt; `None`: the pipeline's
    /// (`--chunk-order`).
    fn order(&self) -> Option<ChunkOrder> {
        None
    }
    /// EPIC with this many recomputed tokens at the start of every chunk, instead of the `k`
    /// that spends the ρ budget.
    fn epic_k(&self) -> Option<usize> {
        None
    }
    /// SpecCache's layer range (the ablation); `None` keeps the speculator's.
    fn layers(&self) -> Option<LayerRange> {
        None
    }
    /// Where SpecCache's scores come from; `None` keeps the pipeline's setting.
    fn score_source(&self) -> Option<ScoreSource> {
        None
    }
    /// Hand back the prefill's cache in [`Traced::prefill`] (for teacher forcing).
    fn keep_prefill(&self) -> bool {
        false
    }
    /// Measure the blend's deviation signals ([`Traced::signals`]; a copy of the recomputed
    /// rows, which a served query does not pay for).
    fn blend_signals(&self) -> bool {
        false
    }
    /// Which chunk tokens the guard's second look recomputes; `None`: the pipeline's
    /// ([`GuardPolicy::look`]).
    fn look(&self) -> Option<LookRows> {
        None
    }
}

/// A served query: no experiment.
#[derive(Debug, Clone, Copy, Default)]
pub struct Served;

impl Experiment for Served {}

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
        }
    }
}

/// An answer with what the evaluation compares beyond the text.
#[derive(Debug, Clone)]
pub struct Traced {
    pub answer: Answer,
    /// The target's logits for the first generated token (after the blended or full prefill).
    pub first_logits: Vec<f32>,
    /// The generated token ids.
    pub ids: Vec<u32>,
    /// The prompt's token ids (template, chunks, question), what a full prefill reads.
    pub prompt_ids: Vec<u32>,
    /// The prefill's cache before decoding, where the experiment keeps it
    /// ([`Experiment::keep_prefill`]).
    pub prefill: Option<KvCache>,
    /// The chunk tokens the method recomputed.
    pub selected: Vec<Selected>,
    /// Per generated token decoded one by one, the top-2 logit gap it was chosen with
    /// ([`target_engine::decode::generate::top2_gap`]); empty for verified or escalated answers.
    pub margins: Vec<f32>,
    /// What the blended prefill knew of its own error (zeros for full recompute).
    pub signals: target_engine::BlendSignals,
}

/// A recomputed chunk token: which chunk of the prompt, where in it, and its text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Selected {
    /// The chunk's place in the prompt (0 = first).
    pub chunk: usize,
    /// Token offset within the chunk.
    pub offset: usize,
    pub text: String,
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
    /// fidelity guard moved the request to the full cache).
    Replace(&'a str),
}

/// Full KV caches of exact contexts (template + the ordered chunk set + question), so a
/// repeated query over the same chunks verifies without a full prefill. Bounded by bytes.
#[derive(Clone)]
pub struct ContextCache {
    inner: moka::sync::Cache<[u8; 32], Arc<(KvCache, Vec<f32>)>>,
    bytes: u64,
}

impl std::fmt::Debug for ContextCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContextCache")
            .field("entries", &self.inner.entry_count())
            .finish()
    }
}

impl ContextCache {
    /// Forgets every cached context (the evaluation measures verification's drafting, which a
    /// hit skips).
    pub fn clear(&self) {
        self.inner.invalidate_all();
    }

    /// How many contexts it holds.
    pub fn entries(&self) -> u64 {
        self.inner.run_pending_tasks();
        self.inner.entry_count()
    }

    /// A cache holding at most `bytes` of KV (f32 K and V of every layer).
    pub fn new(bytes: u64) -> Self {
        Self {
            inner: moka::sync::Cache::builder()
                .max_capacity(bytes)
                .weigher(|_, v: &Arc<(KvCache, Vec<f32>)>| {
                    u32::try_from(Self::weight(&v.0, &v.1)).unwrap_or(u32::MAX)
                })
                .build(),
            bytes,
        }
    }

    /// What an entry counts against the budget: f32 K and V of every layer, and the logits.
    fn weight(cache: &KvCache, logits: &[f32]) -> u64 {
        let kv = 2 * 4 * cache.n_layer() * cache.row_len() * cache.len();
        (kv + 4 * logits.len()) as u64
    }

    /// Keeps a copy of a context's full cache, unless it is larger than the whole budget (a
    /// copy that would be dropped at once is not made: ~1.9 GB at 32k tokens of the 1.5B).
    fn keep(&self, key: [u8; 32], cache: &KvCache, logits: &[f32]) {
        if Self::weight(cache, logits) <= self.bytes.min(u64::from(u32::MAX)) {
            self.inner
                .insert(key, Arc::new((cache.clone(), logits.to_vec())));
        }
    }

    /// The key of a full cache whose first `kept` rows came from stored KV (see
    /// [`Pipeline::escalate`]), apart from the true full cache's `key`.
    fn key_after_stored(key: &[u8; 32], kept: usize) -> [u8; 32] {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(b"after stored rows");
        h.update(key);
        h.update((kept as u64).to_le_bytes());
        h.finalize().into()
    }

    /// Keyed by collection too, so one tenant's cache hit (and its timing) never answers for
    /// another's request over the same text.
    fn key(fingerprint: &str, collection: &str, ids: &[u32]) -> [u8; 32] {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(fingerprint.as_bytes());
        h.update([0x1f]);
        h.update(collection.as_bytes());
        h.update([0x1f]);
        for id in ids {
            h.update(id.to_le_bytes());
        }
        h.finalize().into()
    }
}

/// The full prefill of a verified request, running since the request started.
struct FullPrefill {
    rx: std::sync::mpsc::Receiver<target_engine::Result<(KvCache, Vec<f32>)>>,
    hit: bool,
    ms: Arc<std::sync::Mutex<f64>>,
}

/// What decoding starts from: the prefill's output, the verification's full prefill when the
/// request verifies, and the assembled prompt (for an escalation's full prefill) with its
/// chunks' texts (for a drafter's stored KV).
struct DecodeInput<'a> {
    out: BlendOutput,
    /// Leading rows of `out.cache` a full prefill computes alike ([`exact_rows`]).
    exact_rows: usize,
    /// Which chunk tokens a second look recomputes.
    look: LookRows,
    full_prefill: Option<FullPrefill>,
    asm: &'a Assembly,
    texts: &'a [&'a str],
}

/// What the fidelity guard hands to [`Pipeline::escalate`]: the prompt, the tokens decoded
/// from the reused cache and the text of them the client holds, and the reused cache itself,
/// whose first `exact_rows` rows the full prefill keeps ([`exact_rows`]).
struct Escalation<'a> {
    prompt: &'a [u32],
    generated: &'a [u32],
    shown: &'a str,
    reused: KvCache,
    exact_rows: usize,
}

/// What the guard's second look starts from: the prompt, the chunk tokens it recomputes, the
/// first decode (the doubted token last) and the text of it the client holds.
struct SecondLook<'a> {
    asm: &'a Assembly,
    extra: &'a [usize],
    first: &'a target_engine::Generation,
    sent: &'a str,
}

/// What the guard's second look needs of the blend besides its cache: the prompt, which
/// tokens it recomputes (`look`), the chunk tokens the selector ranked but left, the leading
/// rows an escalation keeps, how many chunk tokens there are, and when decoding started (for
/// the time to first token it may add to).
struct LookAgain<'a> {
    asm: &'a Assembly,
    look: LookRows,
    reserve: Vec<usize>,
    exact_rows: usize,
    chunk_tokens: usize,
    /// Rows the blended prefill computed (recomputed chunk tokens and the question).
    blend_rows: usize,
    started: Instant,
    timings: &'a mut Timings,
}

/// What decoding produced besides the answer's tokens.
struct Decoded {
    g: target_engine::Generation,
    verify: Option<VerifyStats>,
    guard: GuardReport,
    spec: Option<crate::answer::SpecDecodeReport>,
    /// Long-context drafting's rounds, when it drafted this answer.
    long: Option<crate::answer::SpecDecodeReport>,
}

/// What the guard reports for `q` before it decides anything: the fidelity it runs at
/// (`exact` where the request verifies).
fn guard_report(q: &Query) -> GuardReport {
    GuardReport {
        fidelity: if q.verify {
            Fidelity::Exact
        } else {
            q.fidelity
        },
        ..Default::default()
    }
}

/// How `q` samples and stops.
fn generate_params(q: &Query) -> GenerateParams {
    GenerateParams {
        max_tokens: q.max_tokens,
        sampling: SamplingParams {
            temperature: q.temperature,
            top_p: q.top_p,
            seed: q.seed,
        },
        stop: q.stop.clone(),
    }
}

/// Why an answer that went through a [`TextStream`] ended.
fn finish_reason(stream: &TextStream<'_>, cancelled: bool, eos: bool) -> FinishReason {
    if stream.stopped() {
        FinishReason::Stop
    } else if cancelled {
        FinishReason::Cancelled
    } else if eos {
        FinishReason::Eos
    } else {
        FinishReason::Length
    }
}

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
    pub contexts: ContextCache,
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
    fn uses_lookup(self) -> bool {
        self != Self::Model
    }

    fn uses_model(self) -> bool {
        self != Self::Lookup
    }
}

/// Speculative decoding unless a request says otherwise (`--spec-decode`): on, because on
/// real RAG prompts it decoded in 0.55-0.57 of the time per token with prompt lookup drafting, with
/// identical answers (docs/performance.md, *Speculative decoding*).
pub const DEFAULT_SPEC_DECODE: bool = true;

/// Default budget of the exact-context cache.
pub const DEFAULT_CONTEXT_CACHE_BYTES: u64 = 1 << 30;

/// Puts retrieval `hits` in `order` (see [`ChunkOrder`]); `passages`: the first hits are
/// passages a client sent, which keep their order.
fn arrange(hits: &mut [retriever::Hit], order: ChunkOrder, passages: bool) {
    match order {
        ChunkOrder::Rank => {}
        ChunkOrder::Document => hits.sort_by(|a, b| {
            (&a.record.doc_id, a.record.position).cmp(&(&b.record.doc_id, b.record.position))
        }),
        ChunkOrder::LongestFirst if !passages => {
            // The first of the longest, so that ties keep rank order.
            let longest = hits
                .iter()
                .enumerate()
                .rev()
                .max_by_key(|(_, h)| h.record.tokens)
                .map(|(i, _)| i);
            if let Some(i) = longest {
                hits[..=i].rotate_right(1);
            }
        }
        ChunkOrder::LongestFirst => {}
    }
}

/// The leading rows of a blended prefill's cache that a full prefill computes alike (cache
/// rows are f16, as stored KV is): the template prefix and the first chunk, where that chunk
/// was precomputed after the same prefix at its place and the blend left every row of it as
/// stored (none recomputed or moved; [`SelectInput::skips_exact`]). 0 otherwise: an
/// escalation then computes every row.
fn exact_rows(input: &SelectInput<'_>, recomputed: &[usize]) -> usize {
    match input.assembly.chunks().next() {
        Some(first) if input.skips_exact() && !recomputed.iter().any(|p| first.ids.contains(p)) => {
            first.ids.end
        }
        _ => 0,
    }
}

/// The 422 of a prompt (`prompt` tokens with `chunks` chunks, `retrieved` of them from the
/// collection) that does not fit `context` with the answer: naming the query when no chunk was
/// read, `documents` when the chunks are the client's own passages (`top_k` does not apply to
/// them), `messages` when they are passages found in an OpenAI request's messages and
/// retrieval added none, `top_k` otherwise.
fn too_long(
    q: &Query,
    prompt: usize,
    (chunks, retrieved): (usize, usize),
    context: usize,
) -> GatewayError {
    let max_tokens = q.max_tokens;
    if q.retrieve_too && !q.documents.is_empty() && retrieved == 0 {
        GatewayError::bad(
            "messages",
            format!(
                "the prompt ({prompt} tokens with {chunks} chunks of the {} passages found in \
                 the messages) plus max_tokens ({max_tokens}) exceeds the context limit of \
                 {context} tokens (max_context_tokens); send fewer or shorter passages, or \
                 lower max_tokens",
                q.documents.len()
            ),
        )
    } else if chunks == 0 {
        GatewayError::bad(
            "query",
            format!(
                "the prompt ({prompt} tokens, the question and no chunk) plus max_tokens \
                 ({max_tokens}) exceeds the context limit of {context} tokens \
                 (max_context_tokens); shorten the query"
            ),
        )
    } else if !q.documents.is_empty() && !q.retrieve_too {
        GatewayError::bad(
            "documents",
            format!(
                "the prompt ({prompt} tokens with {chunks} passages) plus max_tokens \
                 ({max_tokens}) exceeds the context limit of {context} tokens \
                 (max_context_tokens); send fewer or shorter passages, or lower max_tokens"
            ),
        )
    } else {
        let passages = if q.retrieve_too && !q.documents.is_empty() {
            format!(
                ", {} of them passages found in the messages",
                chunks - retrieved
            )
        } else {
            String::new()
        };
        GatewayError::bad(
            "top_k",
            format!(
                "the prompt ({prompt} tokens with {chunks} chunks{passages}) plus max_tokens \
                 ({max_tokens}) exceeds the context limit of {context} tokens \
                 (max_context_tokens); lower top_k or max_tokens"
            ),
        )
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

impl Pipeline {
    /// A pipeline with the default verification settings.
    pub fn new(mut engines: Engines, corpus: Corpus, score_source: ScoreSource) -> Self {
        let codec = corpus.store.disk().codec();
        engines.lossy_codec = codec.is_lossy().then_some(codec);
        let max_context_tokens =
            crate::admission::default_context(engines.target.config().context_length);
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
            kv_memory_budget: crate::admission::default_budget(),
            contexts: ContextCache::new(DEFAULT_CONTEXT_CACHE_BYTES),
        }
    }

    /// Greedy decoding from the blended output `draft`, verified against the full cache of the
    /// same prompt, which `full` delivers (computed on another thread since the request
    /// started, or taken from the exact-context cache).
    fn verify(
        &self,
        draft: BlendOutput,
        full: FullPrefill,
        (q, drafter): (&Query, Option<&mut target_engine::Drafter<'_>>),
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<(target_engine::Generation, VerifyStats, SpecStats)> {
        let (max_tokens, stop) = (q.max_tokens, &q.stop);
        let target = &self.engines.target;
        let tok = target.tokenizer();
        let hit = full.hit;
        let params = VerifyParams {
            max_tokens,
            mode: if hit {
                VerifyMode::FromFull
            } else {
                self.verify_mode
            },
            ..Default::default()
        };
        // Drafts, commits and withdrawals reach the client through one text stream: stop
        // strings end the answer, characters split across tokens are shown whole.
        let mut stream = TextStream::new(tok, stop);
        let mut show = |s: Shown<'_>| match s {
            Shown::Final(t) => on_piece(Piece::Commit(t)),
            Shown::Draft(t) => on_piece(Piece::Draft(t)),
            Shown::Retract(n) => on_piece(Piece::Retract(n)),
            Shown::Replace(t) => on_piece(Piece::Replace(t)),
        };
        let g = target.verified_generate_from(
            (draft.cache, draft.logits),
            full.rx,
            &params,
            &mut |e| {
                let flow = match e {
                    VerifyEvent::Draft { id } => stream.draft(id, &mut show),
                    VerifyEvent::Commit { ids } => stream.commit(&ids, &mut show),
                    VerifyEvent::Retract { n } => stream.retract(n, &mut show),
                };
                flow == Flow::Go
            },
            drafter,
        )?;
        let flow = stream.finish(&mut show);
        let finish = finish_reason(&stream, g.cancelled || flow == Flow::Cancel, g.eos);
        let stats = VerifyStats {
            drafted: g.drafted,
            accepted: g.accepted,
            corrected: g.corrected,
            rounds: g.rounds,
            mean_accepted: g.mean_accepted(),
            first_commit_ms: g.first_commit_ms,
            full_prefill_ms: *full.ms.lock().unwrap_or_else(|p| p.into_inner()),
            context_cache_hit: hit,
        };
        let generation = target_engine::Generation {
            text: stream.text(),
            ids: stream.ids().to_vec(),
            prefill_ms: 0.0,
            decode_ms_per_token: 0.0,
            finish,
            margins: Vec::new(),
        };
        Ok((generation, stats, g.spec))
    }

    /// Checks what the loaded models decide about a query (run before queueing it).
    pub fn check(&self, q: &Query) -> Result<()> {
        // A query that would retrieve from a collection holding nothing (a name mistyped, or
        // not ingested yet) is refused, not answered from no context at all. With passages of
        // its own the collection only scopes their stored KV, and may be new.
        if q.documents.is_empty() && !self.corpus.index.has_collection(&q.collection)? {
            return Err(GatewayError::NotFound(format!(
                "no collection `{}`: nothing is ingested into it (specrag ingest --collection {0}, \
                 or POST /documents), and the request sends no passages of its own",
                q.collection
            )));
        }
        if q.method.uses_speculator() && self.engines.spec.is_none() {
            return Err(GatewayError::bad(
                "method",
                format!(
                    "`{}` needs a speculator model and none is loaded",
                    q.method.name()
                ),
            ));
        }
        if let Some(m) = q.max_context_tokens {
            if m > self.max_context_tokens {
                return Err(GatewayError::bad(
                    "max_context_tokens",
                    format!(
                        "{m} is above this server's limit of {} tokens (--max-context-tokens)",
                        self.max_context_tokens
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The KV `q` will hold at once with a prompt of `prompt` tokens: the reused cache and
    /// the chunk KV it is built from (one cache for full recompute), a full cache beside them
    /// where the guard may escalate or the answer is verified, the drafter's cache when
    /// speculative decoding runs.
    pub fn kv_need(&self, q: &Query, prompt: usize) -> crate::admission::Need {
        let full_too = !q.method.is_full() && (q.verify || q.fidelity != Fidelity::Fast);
        let caches = if q.method.is_full() { 1 } else { 2 } + u64::from(full_too);
        let drafter = match &self.engines.spec {
            Some(spec) if q.spec_decode.unwrap_or(self.spec_decode) => {
                crate::admission::kv_bytes_per_token(spec.speculator.config())
            }
            _ => 0,
        };
        crate::admission::Need {
            tokens: (prompt + q.max_tokens) as u64,
            caches,
            target_per_token: crate::admission::kv_bytes_per_token(self.engines.target.config()),
            drafter_per_token: drafter,
        }
    }

    /// Answers `q`, streaming pieces to `on_piece` (return `false` to cancel).
    pub fn query(&self, q: &Query, on_piece: &mut dyn FnMut(Piece<'_>) -> bool) -> Result<Answer> {
        Ok(self.query_with(q, &Served, on_piece)?.answer)
    }

    /// [`Pipeline::query`] under an evaluation's experiment, also returning what the
    /// evaluation compares (the first token's logits, the recomputed tokens, ...).
    pub fn query_with(
        &self,
        q: &Query,
        exp: &dyn Experiment,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<Traced> {
        self.check(q)?;
        let t0 = Instant::now();
        let mut timings = Timings::default();
        let (hits, retrieved) = self.hits(q, exp.order().unwrap_or(self.chunk_order))?;
        timings.retrieve_ms = ms(t0);
        let texts: Vec<&str> = hits.iter().map(|h| h.record.text.as_str()).collect();
        let target = &self.engines.target;
        let asm = self.engines.template.assemble_with_context(
            target.tokenizer(),
            &texts,
            &q.context,
            &q.query,
        );
        let context = q
            .max_context_tokens
            .unwrap_or(self.max_context_tokens)
            .min(self.max_context_tokens);
        if asm.ids.len() + q.max_tokens > context {
            return Err(too_long(q, asm.ids.len(), (hits.len(), retrieved), context));
        }
        crate::admission::admit(&self.kv_need(q, asm.ids.len()), self.kv_memory_budget)?;
        if q.verify && q.temperature == 0.0 && !q.method.is_full() {
            // The full prefill starts now, beside KV load, speculation and the blend. (Full
            // recompute decodes from a full prefill already: its answer is the exact one.)
            let key = ContextCache::key(target.fingerprint(), &q.collection, &asm.ids);
            let cached = self.contexts.inner.get(&key);
            let hit = cached.is_some();
            let full_ms = Arc::new(std::sync::Mutex::new(0.0));
            return std::thread::scope(|s| {
                let (tx, rx) = std::sync::mpsc::channel();
                match cached {
                    Some(c) => {
                        let _ = tx.send(Ok((c.0.clone(), c.1.clone())));
                    }
                    None => {
                        let (ids, ms_out, contexts) = (&asm.ids, full_ms.clone(), &self.contexts);
                        let stop = target_engine::stop::current();
                        s.spawn(move || {
                            let t = Instant::now();
                            let r = target_engine::stop::with_stop(stop, || target.prefill(ids));
                            *ms_out.lock().unwrap_or_else(|p| p.into_inner()) = ms(t);
                            if let Ok((cache, logits)) = &r {
                                contexts.keep(key, cache, logits);
                            }
                            let _ = tx.send(r);
                        });
                    }
                }
                let full = FullPrefill {
                    rx,
                    hit,
                    ms: full_ms.clone(),
                };
                self.answer((q, exp), hits, &asm, t0, timings, on_piece, Some(full))
            });
        }
        self.answer((q, exp), hits, &asm, t0, timings, on_piece, None)
    }

    /// Everything after retrieval and assembly: KV load beside the speculator's pass, the
    /// method's selector and blended prefill, then decoding (or verification).
    #[allow(
        clippy::too_many_arguments,
        reason = "the request's parts as the two callers hold them; split into steps below"
    )]
    fn answer(
        &self,
        (q, exp): (&Query, &dyn Experiment),
        hits: Vec<retriever::Hit>,
        asm: &Assembly,
        t0: Instant,
        mut timings: Timings,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
        full_prefill: Option<FullPrefill>,
    ) -> Result<Traced> {
        let texts: Vec<&str> = hits.iter().map(|h| h.record.text.as_str()).collect();
        let (loaded, scored) = self.load_and_score((q, exp), &texts, asm, &mut timings)?;
        let mut reuse = Reuse::default();
        for l in &loaded {
            match l.tier {
                Tier::Memory => reuse.chunks_from_memory += 1,
                Tier::Disk => reuse.chunks_from_disk += 1,
                Tier::Remote => reuse.chunks_from_remote += 1,
                Tier::Recomputed => reuse.chunks_recomputed += 1,
            }
        }
        let (out, exact_rows) = self.blend((q, exp), asm, &loaded, scored, &mut timings)?;
        timings.ttft_ms = ms(t0);
        reuse.chunk_tokens = out.chunk_tokens;
        reuse.recomputed_tokens = out.recomputed.len();
        reuse.ratio = out.ratio();
        let first_logits = out.logits.clone();
        let signals = out.signals;
        let selected = self.selected(asm, &out.recomputed);
        let prefill = exp.keep_prefill().then(|| out.cache.clone());
        let td = Instant::now();
        let input = DecodeInput {
            out,
            exact_rows,
            look: exp.look().unwrap_or(self.guard.look),
            full_prefill,
            asm,
            texts: &texts,
        };
        let Decoded {
            g,
            verify,
            guard,
            spec,
            long,
        } = self.decode(q, input, &mut timings, on_piece)?;
        reuse.guard = guard;
        timings.decode_ms = ms(td);
        timings.total_ms = ms(t0);
        let ids = g.ids.clone();
        let margins = g.margins.clone();
        let answer = Answer {
            answer: g.text,
            method: q.method,
            finish_reason: g.finish,
            tokens: g.ids.len(),
            prompt_tokens: asm.ids.len(),
            chunks: hits
                .into_iter()
                .map(|h| ChunkRef {
                    id: h.record.chunk_id,
                    doc_id: h.record.doc_id,
                    title: h.record.title,
                    score: h.score,
                    position: h.record.position,
                    tokens: h.record.tokens,
                    text: h.record.text,
                })
                .collect(),
            timings,
            reuse,
            verify,
            spec_decode: spec,
            long_context: long,
        };
        Ok(Traced {
            answer,
            first_logits,
            ids,
            prompt_ids: asm.ids.clone(),
            prefill,
            selected,
            margins,
            signals,
        })
    }

    /// The chunks the prompt reads: the passages `q` brings, or the collection's `top_k` best
    /// (in document order when the options say so); and how many of them retrieval found.
    fn hits(&self, q: &Query, order: ChunkOrder) -> Result<(Vec<retriever::Hit>, usize)> {
        let mut hits = if q.documents.is_empty() {
            self.corpus.index.search(&q.collection, &q.query, q.top_k)?
        } else {
            self.passage_hits(q)?
        };
        let mut found = if q.documents.is_empty() {
            hits.len()
        } else {
            0
        };
        if !q.documents.is_empty() && q.retrieve_too {
            let retrieved = self.corpus.index.search(&q.collection, &q.query, q.top_k)?;
            let read: std::collections::HashSet<String> =
                hits.iter().map(|h| h.record.key.clone()).collect();
            let before = hits.len();
            hits.extend(
                retrieved
                    .into_iter()
                    .filter(|h| !read.contains(&h.record.key)),
            );
            found = hits.len() - before;
        }
        arrange(&mut hits, order, !q.documents.is_empty());
        Ok((hits, found))
    }

    /// The chunks of the passages `q` brings, as retrieval hits in their order: each passage
    /// cut as ingestion cuts documents, so a passage sent again (in any order, beside any
    /// others) is the same chunks and its stored KV is found by content.
    fn passage_hits(&self, q: &Query) -> Result<Vec<retriever::Hit>> {
        let tok = self.engines.target.tokenizer();
        let encode = |text: &str| {
            let e = tok.encode(text, false);
            (e.ids, e.offsets)
        };
        let params = retriever::ChunkParams {
            max_tokens: crate::ingest::IngestConfig::default().chunk_tokens,
        };
        let mut hits = Vec::new();
        for (i, p) in q.documents.iter().enumerate() {
            let chunks = retriever::chunk_document(&p.id, &p.text, &encode, &params)
                .map_err(|e| GatewayError::bad("documents", format!("passage {}: {e}", i + 1)))?;
            for (position, c) in chunks.into_iter().enumerate() {
                let (_, ids) = self.engines.segment(&c.text);
                let key = self.engines.key(&q.collection, &ids);
                hits.push(retriever::Hit {
                    score: 0.0,
                    record: retriever::ChunkRecord {
                        chunk_id: key.to_string(),
                        doc_id: p.id.clone(),
                        collection: q.collection.clone(),
                        title: None,
                        text: c.text,
                        position,
                        key: key.to_string(),
                        tokens: c.ids.len(),
                    },
                });
            }
        }
        Ok(hits)
    }

    /// Where each recomputed position sits among the prompt's chunks.
    fn selected(&self, asm: &Assembly, recomputed: &[usize]) -> Vec<Selected> {
        let tok = self.engines.target.tokenizer();
        let chunks: Vec<std::ops::Range<usize>> = asm.chunks().map(|s| s.ids.clone()).collect();
        recomputed
            .iter()
            .filter_map(|&p| {
                let chunk = chunks.iter().position(|r| r.contains(&p))?;
                Some(Selected {
                    chunk,
                    offset: p - chunks[chunk].start,
                    text: String::from_utf8_lossy(tok.token_bytes(asm.ids[p])).into_owned(),
                })
            })
            .collect()
    }

    /// True when `q` decodes from a full prefill and reads no chunk KV (full recompute, or
    /// sampling with verification: exact samples come from the full cache).
    fn reads_no_kv(q: &Query) -> bool {
        q.method.is_full() || (q.verify && q.temperature > 0.0)
    }

    /// Step 1: each chunk's KV (memory, disk or recompute) and, side by side, the speculator's
    /// query-time pass when the method needs one. Records `kv_load_ms` and `speculate_ms`.
    fn load_and_score(
        &self,
        (q, exp): (&Query, &dyn Experiment),
        texts: &[&str],
        asm: &Assembly,
        timings: &mut Timings,
    ) -> Result<(Vec<LoadedChunk>, Option<ScoredTokens>)> {
        let need_kv = !Self::reads_no_kv(q);
        let score_source = exp.score_source().unwrap_or(self.score_source);
        let layers = exp.layers();
        // spec_attn's scores depend on the question: never stored, always a query-time pass
        // (over the stored speculator chunk KV, or for spec_attn_full over the whole prompt).
        let attention = matches!(q.method, Method::SpecAttn | Method::SpecAttnFull);
        let query_time_scores = q.method.uses_speculator()
            && need_kv
            && (attention || score_source == ScoreSource::Query);
        let (loaded, scored) = std::thread::scope(|s| {
            let spec = query_time_scores.then(|| {
                let stop = target_engine::stop::current();
                s.spawn(move || -> Result<(ScoredTokens, f64)> {
                    target_engine::stop::with_stop(stop, || {
                        let t = Instant::now();
                        let spec = self.speculator(layers)?;
                        let toks = match q.method {
                            Method::SpecAttn => self.stored_attention(&spec, q, texts, asm)?,
                            Method::SpecAttnFull => spec.attention_scores(asm)?,
                            _ => spec.query_scores(asm)?,
                        };
                        Ok((toks, ms(t)))
                    })
                })
            });
            let t = Instant::now();
            let loaded: Result<Vec<LoadedChunk>> = if need_kv {
                // Each chunk's segment as the prompt holds it: tokenized once, by assembly.
                asm.chunks()
                    .map(|seg| {
                        let (text, ids) = asm.segment(seg);
                        let store = &self.corpus.store;
                        self.engines.load_segment(store, &q.collection, &text, ids)
                    })
                    .collect()
            } else {
                Ok(Vec::new())
            };
            let load_ms = ms(t);
            let scored = spec.map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(GatewayError::Internal("the speculator panicked".into()))
                })
            });
            (loaded.map(|l| (l, load_ms)), scored.transpose())
        });
        let (loaded, load_ms) = loaded?;
        timings.kv_load_ms = load_ms;
        let scored = scored?.map(|(toks, spec_ms)| {
            timings.speculate_ms = spec_ms;
            toks
        });
        Ok((loaded, scored))
    }

    /// Step 2: the method's selector over the loaded KV, and its blended prefill (or the full
    /// prefill). Records `align_ms` (selection) and `prefill_ms`. Also returns how many of
    /// the fused cache's leading rows a full prefill would compute alike ([`exact_rows`]).
    fn blend(
        &self,
        (q, exp): (&Query, &dyn Experiment),
        asm: &Assembly,
        loaded: &[LoadedChunk],
        mut scored: Option<ScoredTokens>,
        timings: &mut Timings,
    ) -> Result<(BlendOutput, usize)> {
        let target = &self.engines.target;
        let method = if Self::reads_no_kv(q) {
            Method::FullRecompute
        } else {
            q.method
        };
        let spec = if method.uses_speculator() {
            let mut spec = self.speculator(exp.layers())?;
            spec.params.complete_spans = method != Method::SpeccacheNospan;
            if scored.is_none() {
                scored = Some(self.ingest_scores(&spec, asm, loaded, timings)?);
            }
            Some(spec)
        } else {
            None
        };
        let selector = method.selector(SelectorInputs {
            spec: spec.as_ref(),
            scores: scored,
            epic_k: exp.epic_k(),
            seed: q.seed,
        });
        let kvs: Vec<&ChunkKv> = loaded.iter().map(|l| &l.kv).collect();
        let mut input = SelectInput::new(target, asm, &self.engines.prefix, &kvs, q.ratio);
        input.measure = exp.blend_signals();
        if self.engines.lossy_codec.is_some() {
            // Stored lossily, even the chunk precomputed after this very prefix is not exact:
            // it competes for the budget like the others.
            input.first_chunk_exact = false;
        }
        let t = Instant::now();
        let out = selector.prefill(&input)?;
        timings.align_ms = out.select_ms;
        timings.prefill_ms = ms(t) - out.select_ms;
        let kept = exact_rows(&input, &out.recomputed);
        Ok((out, kept))
    }

    /// Step 3: decoding from the prefill's cache under the fidelity guard, or drafting and
    /// verification against the full cache; with speculative decoding on, one drafter
    /// proposes tokens for the whole answer.
    fn decode(
        &self,
        q: &Query,
        input: DecodeInput<'_>,
        timings: &mut Timings,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<Decoded> {
        let started = Instant::now();
        let DecodeInput {
            out,
            mut exact_rows,
            look,
            full_prefill,
            asm,
            texts,
        } = input;
        let mut report = guard_report(q);
        let long = self.long_context_for(q, asm.ids.len());
        // The blended cache's decode, verification and escalation share the drafter (none
        // where long-context drafting replaces it).
        let mut drafter = self.drafter(q, asm, texts).filter(|_| !long);
        let spec_of = |d: &Option<_>, s: SpecStats| d.as_ref().map(|_: &_| s.into());
        let long_of = |s: &SpecStats| long.then(|| s.clone().into());
        if let Some(full) = full_prefill {
            let (g, mut stats, spec) = self.verify(out, full, (q, drafter.as_mut()), on_piece)?;
            stats.first_commit_ms += timings.ttft_ms;
            return Ok(Decoded {
                g,
                verify: Some(stats),
                guard: report,
                spec: spec_of(&drafter, spec),
                long: None,
            });
        }
        let mut cache = out.cache;
        let (mut g, mut spec, mut sent) = self.decode_guarded(
            q,
            (&mut cache, out.logits),
            drafter.as_mut(),
            &mut report,
            on_piece,
        )?;
        self.note_margins(q, &g, &mut report);
        let look = LookAgain {
            asm,
            look,
            reserve: out.reserve,
            exact_rows,
            chunk_tokens: out.chunk_tokens,
            blend_rows: out.recomputed.len() + asm.question_positions().len(),
            started,
            timings: &mut *timings,
        };
        let again = (&mut cache, drafter.as_mut());
        let decoded = (&mut g, &mut sent, &mut spec);
        exact_rows =
            self.look_again_if_doubted(q, (look, again), decoded, &mut report, on_piece)?;
        g.prefill_ms = timings.prefill_ms;
        let verify = q.verify.then(|| VerifyStats {
            full_prefill_ms: timings.prefill_ms,
            first_commit_ms: timings.ttft_ms,
            ..Default::default()
        });
        if report.escalated {
            let moved = Escalation {
                prompt: &asm.ids,
                generated: &g.ids,
                shown: &sent,
                reused: cache,
                exact_rows,
            };
            let (full, ready, more) =
                self.escalate(q, moved, drafter.as_mut(), &mut report, on_piece)?;
            spec.merge(&more);
            g = full;
            // Every token shown so far withdrawn: the answer's first token is the full
            // cache's, so time to first token runs until that cache was ready.
            if let Some(r) = ready.filter(|_| report.kept_tokens == 0) {
                timings.ttft_ms += r.duration_since(started).as_secs_f64() * 1e3;
            }
        }
        Ok(Decoded {
            g,
            verify,
            guard: report,
            long: long_of(&spec),
            spec: spec_of(&drafter, spec),
        })
    }

    /// What the guard saw of the first decode (`g`): the smallest top-2 gap, and for
    /// `balanced` requests the margin it was held to (methods that reuse nothing: none).
    fn note_margins(&self, q: &Query, g: &target_engine::Generation, report: &mut GuardReport) {
        if !q.method.is_full() {
            report.min_margin = g.margins.iter().copied().reduce(f32::min);
            if report.fidelity == Fidelity::Balanced {
                report.margin = Some(self.guard.margin_for(q.method));
            }
        }
    }

    /// The guard's second look ([`Pipeline::second_look`]) where it doubted a token of the
    /// first decode (`decoded`: the generation, the text sent and the drafts), on `cache`:
    /// `decoded` becomes what decoding goes on with, and the time to first token gains the
    /// recompute where the doubted token was the first and the look kept it. Nothing where
    /// the guard did not doubt a token or the look has nothing left to recompute. Returns the
    /// leading rows of `cache` a full prefill computes alike: `look.exact_rows`, and the
    /// look's own where it extended them ([`LookRows::Extend`]).
    fn look_again_if_doubted(
        &self,
        q: &Query,
        (look, (cache, drafter)): (
            LookAgain<'_>,
            (&mut KvCache, Option<&mut target_engine::Drafter<'_>>),
        ),
        (g, sent, spec): (&mut target_engine::Generation, &mut String, &mut SpecStats),
        report: &mut GuardReport,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<usize> {
        let extra = self.second_look_picks(report, &look);
        if extra.is_empty() {
            return Ok(look.exact_rows);
        }
        let t = &look.timings;
        let cost = crate::fidelity::LookCost {
            spent_ms: t.kv_load_ms
                + t.speculate_ms
                + t.align_ms
                + t.prefill_ms
                + look.started.elapsed().as_secs_f64() * 1e3,
            blend_ms: t.prefill_ms,
            blend_rows: look.blend_rows,
            prompt_rows: look.asm.ids.len(),
            exact_rows: look.exact_rows,
            question_rows: look.asm.question_positions().len(),
            look_rows: extra.len(),
            look_kept: look.look == LookRows::Extend && look.exact_rows > 0,
        };
        if !self.guard.affords_look(&cost) {
            // An escalation after the look would cost more than the bound allows: escalate
            // now, from the rows already exact.
            report.second_look_skipped = true;
            return Ok(look.exact_rows);
        }
        let exact_rows = match look.look {
            LookRows::Extend if look.exact_rows > 0 => {
                // The picks run in order from the first row not exact: each is computed over
                // rows that are.
                let run = extra
                    .iter()
                    .zip(look.exact_rows..)
                    .take_while(|(p, want)| **p == *want)
                    .count();
                look.exact_rows + run
            }
            _ => look.exact_rows,
        };
        let second = SecondLook {
            asm: look.asm,
            extra: &extra,
            first: g,
            sent,
        };
        let (g2, sent2, more, ready) =
            self.second_look(q, second, (cache, drafter), report, on_piece)?;
        spec.merge(&more);
        if !report.escalated && g.ids.len() == 1 {
            // The doubted token was the first: nothing was shown before the second look.
            look.timings.ttft_ms += ready.duration_since(look.started).as_secs_f64() * 1e3;
        }
        (*g, *sent) = (g2, sent2);
        Ok(exact_rows)
    }

    /// The chunk tokens a second look recomputes for a request the guard just stopped
    /// (`report`), the policy's share of the chunk tokens, where the guard doubted a token
    /// (not a loop); none otherwise. [`LookRows::Ranked`]: the first of the selector's reserve
    /// (best first) at or after the exact rows (rows an escalation keeps as full prefill's
    /// stay as they are). [`LookRows::Extend`]: the chunk tokens from the first row not exact
    /// on, in order. None for either where the selector ranked nothing it left.
    fn second_look_picks(&self, report: &GuardReport, look: &LookAgain<'_>) -> Vec<usize> {
        if !report.escalated || !report.uncertain || self.guard.second_look <= 0.0 {
            return Vec::new();
        }
        let budget =
            target_engine::reuse::select::budget(self.guard.second_look, look.chunk_tokens);
        let exact = look.exact_rows;
        match look.look {
            LookRows::Ranked => look
                .reserve
                .iter()
                .copied()
                .filter(|&p| p >= exact)
                .take(budget)
                .collect(),
            // Only where the selector ranked what it left, as for ranked picks: the same
            // requests take a look under either kind.
            LookRows::Extend if look.reserve.is_empty() => Vec::new(),
            LookRows::Extend => look
                .asm
                .chunk_positions()
                .into_iter()
                .filter(|&p| p >= exact)
                .take(budget)
                .collect(),
        }
    }

    /// The guard's second look: `look.extra` chunk tokens recomputed on top of the blend in
    /// `cache` (the question with them), then decoding restarted from that cache under the
    /// guard with one more rule: each of the tokens the first decode chose (`look.first`, the
    /// doubted one last) must be chosen again, the doubted one by at least the policy's
    /// [`confirm_gap`](crate::fidelity::GuardPolicy::confirm_gap). The text the client holds
    /// (`look.sent`) is not sent twice. Where every one is chosen again, decoding goes on
    /// from there and `report.escalated` is cleared; where one is not, the request escalates
    /// with the first decode's tokens and text; where the guard stops the decode later, with
    /// this one's.
    /// Returns the generation and text to go on with, and when the recompute was done.
    fn second_look(
        &self,
        q: &Query,
        look: SecondLook<'_>,
        (cache, drafter): (&mut KvCache, Option<&mut target_engine::Drafter<'_>>),
        report: &mut GuardReport,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<(target_engine::Generation, String, SpecStats, Instant)> {
        let SecondLook {
            asm,
            extra,
            first,
            sent,
        } = look;
        let t = Instant::now();
        let mut blended = std::mem::replace(cache, self.engines.target.new_cache());
        blended.truncate(asm.ids.len());
        let out = self.engines.target.blend_prefill_on(asm, blended, extra)?;
        let ready = Instant::now();
        report.second_look = true;
        report.second_look_tokens = extra.len();
        report.second_look_ms = ms(t);
        *report = GuardReport {
            loop_detected: false,
            uncertain: false,
            escalated: false,
            ..*report
        };
        *cache = out.cache;
        // The client holds `sent`: the same tokens give the same text, which is not sent again.
        let mut skip = sent.len();
        let mut forward = |p: Piece<'_>| match p {
            Piece::Token(t) if skip > 0 => {
                let n = t.len().min(skip);
                skip -= n;
                match t.get(n..) {
                    Some("") => true,
                    Some(rest) => on_piece(Piece::Token(rest)),
                    None => on_piece(Piece::Token(t)),
                }
            }
            p => on_piece(p),
        };
        let mut disagreed = false;
        let (g, spec, text) = self.decode_watched_as(
            q,
            (cache, out.logits, drafter),
            report,
            (&first.ids, &mut disagreed),
            &mut forward,
        )?;
        if disagreed {
            report.escalated = true;
            report.uncertain = true;
            return Ok((first.clone(), sent.to_string(), spec, ready));
        }
        Ok((g, text, spec, ready))
    }

    /// Whether `q`'s answer over a prompt of `prompt_tokens` drafts from the long-context
    /// view: greedy, not `verify` (which drafts from the blended cache against the full
    /// one), and the request's `long_context`, else the server's above its `min_tokens`.
    fn long_context_for(&self, q: &Query, prompt_tokens: usize) -> bool {
        q.temperature == 0.0
            && !q.verify
            && q.long_context
                .unwrap_or(self.long_context.on && prompt_tokens >= self.long_context.min_tokens)
    }

    /// [`Pipeline::decode_from`] under the fidelity guard (not for full recompute, which
    /// decodes from the full cache already, nor `exact`): `report` says whether it stopped
    /// the decode to escalate, and why. Also returns the text the client was sent (what it
    /// holds should the guard move the request to the full cache).
    fn decode_guarded(
        &self,
        q: &Query,
        (cache, logits): (&mut KvCache, Vec<f32>),
        drafter: Option<&mut target_engine::Drafter<'_>>,
        report: &mut GuardReport,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<(target_engine::Generation, SpecStats, String)> {
        let mut disagreed = false;
        self.decode_watched_as(
            q,
            (cache, logits, drafter),
            report,
            (&[], &mut disagreed),
            on_piece,
        )
    }

    /// [`Pipeline::decode_guarded`] where the first `agree.0.len()` tokens must be those ids
    /// (a second look's; not held to the margin, the last held to the confirm gap): the
    /// decode stops at the first that is not, setting `agree.1`. The rest are held to the
    /// guard.
    fn decode_watched_as(
        &self,
        q: &Query,
        (cache, logits, drafter): (
            &mut KvCache,
            Vec<f32>,
            Option<&mut target_engine::Drafter<'_>>,
        ),
        report: &mut GuardReport,
        (agree, disagreed): (&[u32], &mut bool),
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<(target_engine::Generation, SpecStats, String)> {
        let guarded = report.fidelity == Fidelity::Balanced && !q.method.is_full();
        let detector = target_engine::LoopDetector::default();
        let policy = self.guard;
        let (mut looped, mut uncertain) = (false, false);
        let mut look_gap = None;
        let mut watch = |ids: &[u32], gap: f32| {
            if let Some(&want) = agree.get(ids.len() - 1) {
                // The doubted token (the last to agree on) must be chosen decidedly.
                let doubted = ids.len() == agree.len();
                let same = ids.last() == Some(&want);
                if doubted && same {
                    look_gap = Some(gap);
                }
                *disagreed = !same || (doubted && !policy.confirms(gap));
                return *disagreed;
            }
            looped = guarded && detector.fires(ids);
            uncertain = guarded && policy.doubts(q.method, ids.len(), gap);
            looped || uncertain
        };
        let mut sent = String::new();
        let mut track = |p: Piece<'_>| {
            if let Piece::Token(t) = p {
                sent.push_str(t);
            }
            on_piece(p)
        };
        let (g, escalate, spec) =
            self.decode_from(q, (cache, logits), drafter, &mut track, &mut watch)?;
        if !agree.is_empty() {
            report.second_look_gap = look_gap;
        }
        if escalate {
            report.loop_detected = looped;
            report.uncertain = uncertain && !looped;
            report.escalated = true;
        }
        Ok((g, spec, sent))
    }

    /// Greedy or sampled decoding from `cache` and its last `logits`, with `drafter` (if any)
    /// proposing tokens; `watch` is asked after every token (see
    /// [`Generate::decode_watched`](target_engine::prelude::Generate::decode_watched)).
    fn decode_from(
        &self,
        q: &Query,
        (cache, logits): (&mut KvCache, Vec<f32>),
        drafter: Option<&mut target_engine::Drafter<'_>>,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
        watch: &mut dyn FnMut(&[u32], f32) -> bool,
    ) -> Result<(target_engine::Generation, bool, SpecStats)> {
        let target = &self.engines.target;
        let params = generate_params(q);
        let mut on_text = |t: &str| on_piece(Piece::Token(t));
        if self.long_context_for(q, cache.len()) {
            let mut view = target_engine::TopKView::new(self.long_context.view);
            let length = target_engine::ViewParams::default().length;
            return Ok(target.decode_view(
                (cache, logits),
                &mut view,
                (&params, length, 0.0),
                &mut on_text,
                watch,
            )?);
        }
        Ok(match drafter {
            Some(d) => {
                target.decode_speculative((cache, logits), d, &params, &mut on_text, watch)?
            }
            None => {
                let (g, e) = target.decode_watched(cache, logits, &params, &mut on_text, watch)?;
                (g, e, SpecStats::default())
            }
        })
    }

    /// The drafter for `q`, when speculative decoding is on for it (the request's
    /// `spec_decode`, else the server's), greedy or sampled: prompt lookup over the
    /// prompt's tokens and/or the speculator (when it shares the target's vocabulary), as
    /// `spec_draft` says. The speculator's cache (its stored KV of the chunks `texts`, stored
    /// now where missing, and a pass over the question) is built once it is first asked to
    /// draft, after the first token.
    fn drafter<'a>(
        &'a self,
        q: &'a Query,
        asm: &'a Assembly,
        texts: &'a [&'a str],
    ) -> Option<target_engine::Drafter<'a>> {
        if !q.spec_decode.unwrap_or(self.spec_decode) {
            return None;
        }
        let source = q.spec_draft.unwrap_or(self.spec_draft);
        let model = if source.uses_model() {
            self.model_drafter(q, asm, texts)
        } else {
            None
        };
        let lookup = source
            .uses_lookup()
            .then(|| target_engine::PromptLookup::new(asm.ids.clone()));
        match (model, lookup) {
            (Some(d), Some(l)) => Some(d.with_lookup(l)),
            (Some(d), None) => Some(d),
            (None, Some(l)) => Some(target_engine::Drafter::lookup_only(l)),
            (None, None) => None,
        }
    }

    /// The speculator as a drafter over its stored chunk KV, when one of the target's
    /// vocabulary is loaded.
    fn model_drafter<'a>(
        &'a self,
        q: &'a Query,
        asm: &'a Assembly,
        texts: &'a [&'a str],
    ) -> Option<target_engine::Drafter<'a>> {
        let spec = self.engines.spec.as_ref()?;
        let prefix = self.engines.spec_prefix.as_ref()?;
        if !self.engines.drafts {
            return None;
        }
        let build = move || -> target_engine::Result<(KvCache, Vec<f32>)> {
            let internal = |e: GatewayError| target_engine::EngineError::Caller(Box::new(e));
            let mut kvs = Vec::with_capacity(texts.len());
            for text in texts {
                let (kv, _) = self
                    .engines
                    .load_spec_kv(&self.corpus.store, &q.collection, text)
                    .map_err(internal)?
                    .ok_or_else(|| internal(GatewayError::Internal("no speculator".into())))?;
                kvs.push(kv);
            }
            let refs: Vec<&ChunkKv> = kvs.iter().collect();
            spec.draft_state_stored(asm, prefix, &refs)
                .map_err(|e| target_engine::EngineError::Caller(Box::new(e)))
        };
        Some(target_engine::Drafter::deferred(
            &spec.speculator,
            Box::new(build),
        ))
    }

    /// The fidelity guard's way out: the full prefill of `prompt` (or the context cache's
    /// copy), the tokens decoded so far checked against it, the agreeing prefix kept and
    /// decoding continued from the full cache. The full prefill keeps the reused cache's
    /// first `exact_rows` (the template prefix and the first chunk, precomputed after it:
    /// [`exact_rows`]) and computes the rest, so it costs what full recompute's would less
    /// that chunk. The full cache's tokens are chosen as a plain decode from it would choose
    /// them (greedy, or the seeded sampler's draw at each index), so the answer is full
    /// recompute's, token for token, for the same seed (`exact` requests never take such a
    /// cache all the same). The client, which holds `shown` of the text of `generated`, sees
    /// the kept prefix extended, or replaced where text it holds was withdrawn. Also returns
    /// when the full cache was ready.
    fn escalate(
        &self,
        q: &Query,
        moved: Escalation<'_>,
        drafter: Option<&mut target_engine::Drafter<'_>>,
        report: &mut GuardReport,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<(target_engine::Generation, Option<Instant>, SpecStats)> {
        let Escalation {
            prompt,
            generated,
            shown,
            mut reused,
            exact_rows: exact,
        } = moved;
        let target = &self.engines.target;
        let tok = target.tokenizer();
        let t = Instant::now();
        let key = ContextCache::key(target.fingerprint(), &q.collection, prompt);
        // A full cache over stored rows is kept apart: `exact` requests take only true ones.
        let kept_key = ContextCache::key_after_stored(&key, exact);
        let hit = self.contexts.inner.get(&key);
        let (cache, logits) = match hit.or_else(|| self.contexts.inner.get(&kept_key)) {
            Some(c) => (c.0.clone(), c.1.clone()),
            None if exact > 0 && exact < prompt.len() => {
                let logits = target.prefill_after(&mut reused, prompt, exact)?;
                report.full_prefill_ms = ms(t);
                report.full_prefill_kept_rows = exact;
                self.contexts.keep(kept_key, &reused, &logits);
                (reused, logits)
            }
            None => {
                drop(reused);
                let (cache, logits) = target.prefill(prompt)?;
                report.full_prefill_ms = ms(t);
                self.contexts.keep(key, &cache, &logits);
                (cache, logits)
            }
        };
        let ready = Some(Instant::now());
        let checked = generated.len().min(q.max_tokens);
        let mut stream = TextStream::resume(tok, &q.stop, generated, shown);
        let mut show = |s: Shown<'_>| match s {
            Shown::Final(t) => on_piece(Piece::Token(t)),
            Shown::Replace(t) => on_piece(Piece::Replace(t)),
            // Only final tokens come in below.
            Shown::Draft(_) | Shown::Retract(_) => true,
        };
        let pick = target_engine::Sampler::new(generate_params(q).sampling);
        let vg = target.continue_exact(
            (cache, logits),
            generated,
            (q.max_tokens, pick),
            &mut |e| {
                let flow = match e {
                    VerifyEvent::Retract { n } => stream.keep(checked - n, &mut show),
                    VerifyEvent::Commit { ids } => stream.commit(&ids, &mut show),
                    VerifyEvent::Draft { .. } => Flow::Go,
                };
                flow == Flow::Go
            },
            drafter,
        )?;
        // Also when nothing was withdrawn and nothing added: the text held back until now.
        let flow = stream.finish(&mut show);
        report.kept_tokens = vg.accepted;
        report.withdrawn_tokens = vg.drafted - vg.accepted;
        let g = target_engine::Generation {
            text: stream.text(),
            ids: stream.ids().to_vec(),
            prefill_ms: 0.0,
            decode_ms_per_token: 0.0,
            finish: finish_reason(&stream, vg.cancelled || flow == Flow::Cancel, vg.eos),
            margins: Vec::new(),
        };
        Ok((g, ready, vg.spec))
    }

    /// The SpecCache selector (over `layers`, where the experiment sets them).
    fn speculator(&self, layers: Option<LayerRange>) -> Result<speculator::SpecCache> {
        let mut spec = self
            .engines
            .spec
            .clone()
            .ok_or_else(|| GatewayError::bad("method", "no speculator model is loaded"))?;
        if let Some(layers) = layers {
            spec.layers = layers;
        }
        Ok(spec)
    }

    /// `spec_attn`'s scores: the speculator's stored KV of every chunk (computed and stored
    /// now where missing), then its question pass over them.
    fn stored_attention(
        &self,
        spec: &speculator::SpecCache,
        q: &Query,
        texts: &[&str],
        asm: &Assembly,
    ) -> Result<ScoredTokens> {
        let prefix = self
            .engines
            .spec_prefix
            .as_ref()
            .ok_or_else(|| GatewayError::bad("method", "no speculator model is loaded"))?;
        let mut kvs = Vec::with_capacity(texts.len());
        for text in texts {
            let (kv, _) = self
                .engines
                .load_spec_kv(&self.corpus.store, &q.collection, text)?
                .ok_or_else(|| GatewayError::bad("method", "no speculator model is loaded"))?;
            kvs.push(kv);
        }
        let refs: Vec<&ChunkKv> = kvs.iter().collect();
        Ok(spec.attention_scores_stored(asm, prefix, &refs)?)
    }

    /// SpecCache scores from ingestion; chunks stored without scores (or by another
    /// speculator) are scored now with a query-time pass instead.
    fn ingest_scores(
        &self,
        sel: &speculator::SpecCache,
        asm: &Assembly,
        loaded: &[LoadedChunk],
        timings: &mut Timings,
    ) -> Result<ScoredTokens> {
        let stored: Option<Vec<&ChunkScores>> = loaded
            .iter()
            .map(|l| l.scores.as_ref().filter(|s| s.layers == sel.layers))
            .collect();
        match stored {
            Some(s) => Ok(sel.ingested_scores(asm, &s)?),
            None => {
                let t = Instant::now();
                let toks = sel.query_scores(asm)?;
                timings.speculate_ms = ms(t);
                Ok(toks)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hit(doc: &str, position: usize, tokens: usize) -> retriever::Hit {
        retriever::Hit {
            score: 0.0,
            record: retriever::ChunkRecord {
                chunk_id: format!("{doc}/{position}"),
                doc_id: doc.into(),
                collection: "c".into(),
                title: None,
                text: String::new(),
                position,
                key: format!("{doc}/{position}"),
                tokens,
            },
        }
    }

    /// Issue 88: a prompt of passages pasted into the messages that did not fit named
    /// `specrag.top_k`, which the client never sent; it names the messages now.
    #[test]
    fn an_over_long_prompt_names_what_filled_it() {
        let passage = |i: usize| Passage {
            id: format!("messages[0]:{i}"),
            text: "x".into(),
        };
        let pasted = Query {
            documents: (1..=3).map(passage).collect(),
            retrieve_too: true,
            ..Query::default()
        };
        let field = |q: &Query, read: (usize, usize)| match too_long(q, 900, read, 512).fault() {
            crate::error::Fault::BadInput(f) => f,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(&pasted, (3, 0)), Some("messages"));
        assert_eq!(field(&pasted, (5, 2)), Some("top_k"));
        let sent = Query {
            retrieve_too: false,
            ..pasted.clone()
        };
        assert_eq!(field(&sent, (3, 0)), Some("documents"));
        assert_eq!(field(&Query::default(), (4, 4)), Some("top_k"));
        assert_eq!(field(&Query::default(), (0, 0)), Some("query"));
    }

    fn ids(hits: &[retriever::Hit]) -> Vec<&str> {
        hits.iter().map(|h| h.record.chunk_id.as_str()).collect()
    }

    #[test]
    fn longest_first_moves_the_longest_chunk_ahead_and_keeps_the_rest_ranked() {
        let ranked = vec![
            hit("a", 0, 90),
            hit("b", 3, 300),
            hit("c", 1, 120),
            hit("d", 0, 300),
        ];
        let mut hits = ranked.clone();
        arrange(&mut hits, ChunkOrder::LongestFirst, false);
        // b and d tie at 300 tokens: the better ranked one goes first.
        assert_eq!(ids(&hits), ["b/3", "a/0", "c/1", "d/0"]);
        let mut hits = ranked.clone();
        arrange(&mut hits, ChunkOrder::LongestFirst, true);
        assert_eq!(
            ids(&hits),
            ids(&ranked),
            "a client's passages keep their order"
        );
        let mut hits = ranked.clone();
        arrange(&mut hits, ChunkOrder::Rank, false);
        assert_eq!(ids(&hits), ids(&ranked));
        let mut hits = ranked;
        arrange(&mut hits, ChunkOrder::Document, false);
        assert_eq!(ids(&hits), ["a/0", "b/3", "c/1", "d/0"]);
        let mut none: Vec<retriever::Hit> = Vec::new();
        arrange(&mut none, ChunkOrder::LongestFirst, false);
        assert!(none.is_empty());
    }
}
