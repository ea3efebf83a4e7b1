//! What every handler shares: the server's settings and state.

use crate::auth::ApiKey;
use crate::engine::EngineHandle;
use crate::metrics::Metrics;
use crate::pipeline::Pipeline;
use std::sync::Arc;
use std::time::Duration;

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Accepted bearer tokens and their reach; empty means no authentication.
    pub api_keys: Vec<ApiKey>,
    /// Jobs that may wait for the engine before requests are refused with 429.
    pub queue_capacity: usize,
    /// Queries that run at once, their decode steps batched (`--max-batch`).
    pub max_batch: usize,
    /// The order their prefills take turns in (`--prefill-order`).
    pub prefill_order: target_engine::PrefillOrder,
    /// Rows of an escalation's full prefill per prefill turn (`--prefill-piece`; 0: one turn).
    pub prefill_piece: usize,
    /// A request not finished within this time is answered 504 (and its work stopped).
    pub request_timeout: Duration,
    /// Most tokens one `POST /documents` may precompute (413 above).
    pub max_request_tokens: usize,
    /// Most tokens a collection may hold (413 for a request that would pass it).
    pub max_collection_tokens: usize,
    /// Most open connections; one more is answered 503 and closed.
    pub max_connections: usize,
    /// Time a client has to send a request's headers (and an idle connection stays open).
    pub header_read_timeout: Duration,
    /// Time a client has to send a request's body once its headers are in; a body not
    /// received by then is answered 408 and the connection closed.
    pub body_timeout: Duration,
    /// Most bytes of request bodies held at once across every connection; a body that does
    /// not fit beside the others is answered 503, one larger than all of it 413.
    pub max_body_bytes_in_flight: usize,
    /// Ingestion also stores the speculator's own chunk KV (`spec_attn` reads it).
    pub speculator_kv: bool,
    /// The fidelity of requests that do not say (`--fidelity`).
    pub fidelity: crate::fidelity::Fidelity,
    /// The recompute ratio ρ of requests that do not say (`--ratio`), within 0..=1 (outside it,
    /// such requests are refused as if they had sent it).
    pub recompute_ratio: f64,
}

impl ServerConfig {
    /// What requests that leave `fidelity` or `recompute_ratio` out get.
    pub fn request_defaults(&self) -> crate::api::RequestDefaults {
        crate::api::RequestDefaults {
            fidelity: self.fidelity,
            recompute_ratio: self.recompute_ratio,
        }
    }
}

/// Default of [`ServerConfig::max_batch`]: four requests decode 2.1-2.6x the tokens/s of one
/// on 2 CPU cores (docs/performance.md, *Requests batched*).
pub const DEFAULT_MAX_BATCH: usize = 4;
/// Default of [`ServerConfig::prefill_piece`]: an escalation's full prefill 256 rows a turn,
/// enough rows for the CPU engine's many-row kernels, few enough that a first prefill waits
/// seconds, not a whole full prefill, on 2 cores (docs/performance.md, *Against
/// llama-server*). 0 computes it in one turn.
pub const DEFAULT_PREFILL_PIECE: usize = 256;
/// Default of [`ServerConfig::max_request_tokens`]: about 15 minutes of precompute for
/// Qwen-0.5B on 2 cores.
pub const DEFAULT_MAX_REQUEST_TOKENS: usize = 64 * 1024;
/// Default of [`ServerConfig::max_collection_tokens`]: ~50 GB of f16 KV for Qwen-0.5B.
pub const DEFAULT_MAX_COLLECTION_TOKENS: usize = 4 * 1024 * 1024;
/// Default of [`ServerConfig::max_body_bytes_in_flight`]: eight of the largest bodies
/// (`/documents`' 32 MiB), where 256 connections could otherwise buffer 8 GiB.
pub const DEFAULT_MAX_BODY_BYTES_IN_FLIGHT: usize = 256 * 1024 * 1024;

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            api_keys: Vec::new(),
            queue_capacity: 8,
            max_batch: DEFAULT_MAX_BATCH,
            prefill_order: target_engine::PrefillOrder::default(),
            prefill_piece: DEFAULT_PREFILL_PIECE,
            request_timeout: Duration::from_secs(300),
            max_request_tokens: DEFAULT_MAX_REQUEST_TOKENS,
            max_collection_tokens: DEFAULT_MAX_COLLECTION_TOKENS,
            max_connections: 256,
            header_read_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_body_bytes_in_flight: DEFAULT_MAX_BODY_BYTES_IN_FLIGHT,
            speculator_kv: false,
            fidelity: crate::fidelity::Fidelity::default(),
            recompute_ratio: crate::pipeline::DEFAULT_RATIO,
        }
    }
}

/// Shared state of every handler.
#[derive(Debug, Clone)]
pub struct AppState {
    pub pipeline: Arc<Pipeline>,
    pub engine: EngineHandle,
    pub metrics: Arc<Metrics>,
    pub config: Arc<ServerConfig>,
    /// The request body bytes in flight, against `config.max_body_bytes_in_flight`.
    pub(crate) body_budget: Arc<super::body_budget::BodyBudget>,
    /// When the server started, Unix seconds (`/v1/models`' `created`).
    pub started_unix: u64,
}

impl AppState {
    /// Starts the engine thread over `pipeline`.
    pub fn new(pipeline: Arc<Pipeline>, config: ServerConfig) -> Self {
        let metrics = Arc::new(Metrics::default());
        let engine = crate::engine::start(
            pipeline.clone(),
            config.queue_capacity,
            crate::engine::Batching {
                max: config.max_batch,
                order: config.prefill_order,
                piece: config.prefill_piece,
            },
            metrics.clone(),
        );
        Self {
            pipeline,
            engine,
            metrics,
            body_budget: Arc::new(super::body_budget::BodyBudget::new(
                config.max_body_bytes_in_flight,
            )),
            config: Arc::new(config),
            started_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }
    }
}

/// Largest `/rag/query` body (the question is at most 8192 characters, the passages a query
/// brings 512 Ki characters of up to 4 bytes, escaped).
pub(crate) const QUERY_BODY_LIMIT: usize = 4 * 1024 * 1024;
/// Largest `/v1/chat/completions` body (the question, 16 Ki characters of earlier turns and
/// the passages of `specrag.documents` or pasted into the messages).
pub(crate) const OPENAI_BODY_LIMIT: usize = 4 * 1024 * 1024;
/// Largest `/documents` body.
pub(crate) const DOCUMENTS_BODY_LIMIT: usize = 32 * 1024 * 1024;
