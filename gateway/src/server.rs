//! The HTTP API: axum routes, problem+json errors, request ids, API keys, metrics, the OpenAPI
//! document and a Swagger UI served from vendored assets.

use crate::api::{
    validate_collection, CollectionInfo, Deleted, DocumentInfo, DocumentList, DocumentsRequest,
    Health, IngestResponse, ModelInfo, Problem, QueryRequest,
};
use crate::auth::{ApiKey, Grant};
use crate::engine::{EngineHandle, IngestProgress, Job, JobError, QueryEvent, SubmitError};
use crate::error::{Fault, GatewayError};
use crate::input::InputProblem;
use crate::metrics::Metrics;
use crate::pipeline::{Answer, Pipeline};
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Extension, MatchedPath, Path, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde::Deserialize;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;
use utoipa::OpenApi;

/// One server-sent event of a streamed answer.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
struct SseEvent {
    /// `token`, `draft`, `commit`, `retract`, `done` or `error`.
    event: String,
    /// JSON: `{"text"}` for `token`, the answer object for `done`, a problem for `error`.
    data: String,
}

/// One line of a streamed `POST /documents` answer (`Accept: application/x-ndjson`); a
/// `summary` line carries the route's answer fields, an `error` line a problem's.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
struct IngestLine {
    /// `committed`, `problem`, `summary` or `error`.
    event: String,
    /// `committed`: the documents now durable and searchable.
    #[serde(skip_serializing_if = "Option::is_none")]
    documents: Option<Vec<String>>,
    /// `problem`: where the skipped document came from.
    #[serde(skip_serializing_if = "Option::is_none")]
    origin: Option<String>,
    /// `problem`: why it was skipped.
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<String>,
}

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Accepted bearer tokens and their reach; empty means no authentication.
    pub api_keys: Vec<ApiKey>,
    /// Jobs that may wait for the engine before requests are refused with 429.
    pub queue_capacity: usize,
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
    /// Ingestion also stores the speculator's own chunk KV (`spec_attn` reads it).
    pub speculator_kv: bool,
    /// The fidelity of requests that do not say (`--fidelity`).
    pub fidelity: crate::fidelity::Fidelity,
}

/// Default of [`ServerConfig::max_request_tokens`]: about 15 minutes of precompute for
/// Qwen-0.5B on 2 cores.
pub const DEFAULT_MAX_REQUEST_TOKENS: usize = 64 * 1024;
/// Default of [`ServerConfig::max_collection_tokens`]: ~50 GB of f16 KV for Qwen-0.5B.
pub const DEFAULT_MAX_COLLECTION_TOKENS: usize = 4 * 1024 * 1024;

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            api_keys: Vec::new(),
            queue_capacity: 8,
            request_timeout: Duration::from_secs(300),
            max_request_tokens: DEFAULT_MAX_REQUEST_TOKENS,
            max_collection_tokens: DEFAULT_MAX_COLLECTION_TOKENS,
            max_connections: 256,
            header_read_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            speculator_kv: false,
            fidelity: crate::fidelity::Fidelity::default(),
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
    /// When the server started, Unix seconds (`/v1/models`' `created`).
    pub started_unix: u64,
}

impl AppState {
    /// Starts the engine thread over `pipeline`.
    pub fn new(pipeline: Arc<Pipeline>, config: ServerConfig) -> Self {
        let metrics = Arc::new(Metrics::default());
        let engine = crate::engine::start(pipeline.clone(), config.queue_capacity, metrics.clone());
        Self {
            pipeline,
            engine,
            metrics,
            config: Arc::new(config),
            started_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        }
    }
}

/// Largest `/rag/query` body (the question is at most 8192 characters).
const QUERY_BODY_LIMIT: usize = 64 * 1024;
/// Largest `/v1/chat/completions` body (the question, 16 Ki characters of earlier turns).
const OPENAI_BODY_LIMIT: usize = 256 * 1024;
/// Largest `/documents` body.
const DOCUMENTS_BODY_LIMIT: usize = 32 * 1024 * 1024;

/// An error answered as `application/problem+json`.
#[derive(Debug)]
pub enum ApiError {
    Gateway(GatewayError),
    /// The body is not the JSON the route expects.
    Body(StatusCode, String),
    Unauthorized,
    Busy,
    Deadline,
    /// The body did not arrive within `--body-timeout-secs` (408, connection closed).
    BodyTimeout,
}

impl From<GatewayError> for ApiError {
    fn from(e: GatewayError) -> Self {
        Self::Gateway(e)
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Busy => Self::Busy,
            SubmitError::Stopped => Self::Gateway(GatewayError::Internal(
                "the engine thread has stopped".into(),
            )),
        }
    }
}

/// A worker (the engine thread or a blocking task) went away without answering: it panicked.
fn engine_dropped() -> ApiError {
    ApiError::Gateway(GatewayError::Internal(
        "a worker failed while running this request".into(),
    ))
}

impl From<JobError> for ApiError {
    fn from(e: JobError) -> Self {
        match e {
            JobError::Gateway(g) => Self::Gateway(g),
            JobError::Deadline => Self::Deadline,
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        if crate::request_limits::is_body_timeout(&r) {
            return Self::BodyTimeout;
        }
        let status = match r.status() {
            StatusCode::PAYLOAD_TOO_LARGE => StatusCode::PAYLOAD_TOO_LARGE,
            StatusCode::UNSUPPORTED_MEDIA_TYPE => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            _ => StatusCode::BAD_REQUEST,
        };
        Self::Body(status, r.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> Self {
        Self::Body(StatusCode::BAD_REQUEST, r.body_text())
    }
}

impl ApiError {
    pub(crate) fn problem(&self) -> (StatusCode, Problem) {
        let (status, detail, field) = match self {
            Self::Gateway(e) => {
                let (status, field) = match e.fault() {
                    Fault::BadInput(field) => (StatusCode::UNPROCESSABLE_ENTITY, field),
                    Fault::TooLarge(field) => (StatusCode::PAYLOAD_TOO_LARGE, Some(field)),
                    Fault::NotFound => (StatusCode::NOT_FOUND, None),
                    Fault::Internal => (StatusCode::INTERNAL_SERVER_ERROR, None),
                };
                (status, self.detail(), field.map(str::to_string))
            }
            Self::Body(s, m) => (*s, m.clone(), None),
            Self::Unauthorized => (
                StatusCode::UNAUTHORIZED,
                "missing or wrong API key: send `Authorization: Bearer <key>`".into(),
                None,
            ),
            Self::Busy => (
                StatusCode::TOO_MANY_REQUESTS,
                "the engine queue is full; retry after the time in Retry-After".into(),
                None,
            ),
            Self::Deadline => (
                StatusCode::GATEWAY_TIMEOUT,
                "the request did not finish within the server's deadline".into(),
                None,
            ),
            Self::BodyTimeout => (
                StatusCode::REQUEST_TIMEOUT,
                "the request body was not received within the server's body timeout \
                 (--body-timeout-secs); the connection is closed"
                    .into(),
                None,
            ),
        };
        (
            status,
            Problem {
                kind: "about:blank".into(),
                title: status.canonical_reason().unwrap_or("Error").into(),
                status: status.as_u16(),
                detail,
                field,
            },
        )
    }

    fn detail(&self) -> String {
        match self {
            Self::Gateway(e) => {
                let mut s = e.to_string();
                let mut src = std::error::Error::source(e);
                while let Some(inner) = src {
                    let m = inner.to_string();
                    if !s.contains(&m) {
                        s = format!("{s}: {m}");
                    }
                    src = inner.source();
                }
                s
            }
            _ => String::new(),
        }
    }
}

fn problem_response(status: StatusCode, p: &Problem) -> Response {
    let body = serde_json::to_string(p).unwrap_or_default();
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        body,
    )
        .into_response()
}

/// What an internal failure said, kept out of the response body: `observe` logs it with the
/// request id and answers only that id.
#[derive(Debug, Clone)]
struct InternalDetail(String);

/// The request id `observe` assigned, for handlers that answer errors outside a response
/// body (a stream's `error` event).
#[derive(Debug, Clone)]
pub(crate) struct RequestId(pub(crate) String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, p) = self.problem();
        let mut r = problem_response(status, &p);
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            r.extensions_mut().insert(InternalDetail(p.detail.clone()));
        }
        match self {
            Self::Busy => {
                r.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
            }
            Self::Unauthorized => {
                r.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            Self::BodyTimeout => {
                // The rest of the body may still trickle in: this connection is done.
                r.headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            _ => {}
        }
        r
    }
}

/// The router (tests drive it with `oneshot`, no socket needed).
pub fn app(state: AppState) -> Router {
    let protected = Router::new()
        .route(
            "/rag/query",
            post(rag_query).layer(DefaultBodyLimit::max(QUERY_BODY_LIMIT)),
        )
        .route(
            "/documents",
            post(post_documents)
                .layer(DefaultBodyLimit::max(DOCUMENTS_BODY_LIMIT))
                .get(list_documents),
        )
        .route("/documents/{id}", delete(delete_document))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    // The OpenAI routes check keys themselves: their errors have OpenAI's shape.
    let openai = Router::new()
        .route(
            "/v1/chat/completions",
            post(crate::openai::chat_completions).layer(DefaultBodyLimit::max(OPENAI_BODY_LIMIT)),
        )
        .route("/v1/models", get(crate::openai::list_models));
    Router::new()
        .merge(protected)
        .merge(openai)
        .route("/", get(web_page))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi_json))
        .route("/docs", get(docs_index))
        .route("/docs/", get(docs_index))
        .route("/docs/{file}", get(docs_asset))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            crate::request_limits::limits,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::Gateway(GatewayError::NotFound(
        "no such route; see /openapi.json or /docs".into(),
    ))
}

async fn method_not_allowed() -> ApiError {
    ApiError::Body(
        StatusCode::METHOD_NOT_ALLOWED,
        "this route does not accept that method; see /openapi.json".into(),
    )
}

/// Request id (taken from `x-request-id` when sane, else made up), echoed in the response and
/// logged with route, status and latency; counts requests by route and status.
async fn observe(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let t = Instant::now();
    let id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.chars().all(|c| c.is_ascii_graphic()))
        .map(str::to_string)
        .unwrap_or_else(|| format!("{:016x}", rand::random::<u64>()));
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let method = req.method().clone();
    let mut req = req;
    req.extensions_mut().insert(RequestId(id.clone()));
    let mut resp = next.run(req).await;
    if let Some(InternalDetail(detail)) = resp.extensions_mut().remove::<InternalDetail>() {
        // The cause (paths, internal messages) goes to the log under the request id; the
        // client gets the id to quote.
        tracing::error!(request_id = %id, %detail, "request failed");
        let (status, mut p) = ApiError::Gateway(GatewayError::Internal(String::new())).problem();
        p.detail = format!("internal error; quote request id {id} to the operator");
        resp = problem_response(status, &p);
    }
    let status = resp.status().as_u16();
    state.metrics.request(&route, status);
    if resp.status() == StatusCode::REQUEST_TIMEOUT {
        state.metrics.body_timeout();
    }
    tracing::info!(request_id = %id, %method, route = %route, status, ms = t.elapsed().as_secs_f64() * 1e3, "request");
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// Bearer-token check on the query and document routes (when keys are configured); the
/// key's [`Grant`] travels with the request to the handler.
async fn require_key(
    State(state): State<AppState>,
    mut req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let grant =
        crate::auth::grant(&state.config.api_keys, req.headers()).ok_or(ApiError::Unauthorized)?;
    req.extensions_mut().insert(grant);
    Ok(next.run(req).await)
}

/// A collection outside the key's reach answers exactly as a missing one would: 404.
pub(crate) fn reach(grant: &Grant, collection: &str) -> Result<(), ApiError> {
    if grant.allows(collection) {
        Ok(())
    } else {
        Err(ApiError::Gateway(GatewayError::NotFound(format!(
            "no collection `{collection}`"
        ))))
    }
}

pub(crate) fn submit(state: &AppState, job: Job) -> Result<(), ApiError> {
    state.engine.submit(job).map_err(|e| {
        if e == SubmitError::Busy {
            state.metrics.busy();
        }
        ApiError::from(e)
    })
}

/// Answer a question over a collection.
#[utoipa::path(
    post,
    path = "/rag/query",
    tag = "query",
    request_body = QueryRequest,
    responses(
        (status = 200, description = "The answer with its chunks, timings and reuse statistics. With `\"stream\": true`: server-sent events, `token` events carrying `{\"text\"}` pieces, then one `done` event carrying this object (or one `error` event carrying a problem). With `\"verify\": true` (greedy) the pieces come as `draft` (`{\"text\"}`, not final), `commit` (`{\"text\"}`, final) and `retract` (`{\"tokens\": n}`: the last n drafted tokens are withdrawn) events; the committed text is the full-recompute answer.",
            content((Answer = "application/json"), (SseEvent = "text/event-stream"))),
        (status = 400, description = "The body is not JSON of this shape (an unknown field is named)", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or wrong API key", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body larger than 64 KiB", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "The body is not sent as application/json", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "A field is out of range; `field` names it", body = Problem, content_type = "application/problem+json",
            example = json!({"type": "about:blank", "title": "Unprocessable Entity", "status": 422, "detail": "invalid `top_k`: must be 1 to 32, got 0", "field": "top_k"})),
        (status = 429, description = "The engine queue is full; see Retry-After", body = Problem, content_type = "application/problem+json"),
        (status = 504, description = "Not finished within the server's deadline", body = Problem, content_type = "application/problem+json"),
    ),
    security((), ("bearer" = []))
)]
async fn rag_query(
    State(state): State<AppState>,
    Extension(grant): Extension<Grant>,
    Extension(RequestId(id)): Extension<RequestId>,
    body: Result<Json<QueryRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    let query = req.validate_with(state.config.fidelity)?;
    reach(&grant, &query.collection)?;
    state.pipeline.check(&query)?;
    let deadline = Instant::now() + state.config.request_timeout;
    // Room for every token of the longest answer, so a client that stops reading can never
    // block the engine thread.
    let (tx, mut rx) = tokio::sync::mpsc::channel(crate::api::MAX_TOKENS as usize + 8);
    submit(
        &state,
        Job::Query {
            query,
            deadline,
            events: tx,
        },
    )?;
    if req.stream.unwrap_or(false) {
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx).map(move |e| {
            Ok::<Event, Infallible>(match e {
                QueryEvent::Text(t) => Event::default()
                    .event("token")
                    .data(serde_json::json!({ "text": t }).to_string()),
                QueryEvent::Draft(t) => Event::default()
                    .event("draft")
                    .data(serde_json::json!({ "text": t }).to_string()),
                QueryEvent::Commit(t) => Event::default()
                    .event("commit")
                    .data(serde_json::json!({ "text": t }).to_string()),
                QueryEvent::Retract(n) => Event::default()
                    .event("retract")
                    .data(serde_json::json!({ "tokens": n }).to_string()),
                QueryEvent::Replace(t) => Event::default()
                    .event("replace")
                    .data(serde_json::json!({ "text": t }).to_string()),
                QueryEvent::Done(a) => Event::default()
                    .event("done")
                    .data(serde_json::to_string(&a).unwrap_or_default()),
                QueryEvent::Failed(e) => {
                    let mut p = error_event(ApiError::from(e), &id);
                    if let Some(fields) = p.as_object_mut() {
                        fields.remove("event");
                    }
                    Event::default().event("error").data(p.to_string())
                }
            })
        });
        return Ok(Sse::new(stream)
            .keep_alive(KeepAlive::default())
            .into_response());
    }
    let until = tokio::time::Instant::from_std(deadline + Duration::from_secs(1));
    loop {
        match tokio::time::timeout_at(until, rx.recv()).await {
            Err(_) => return Err(ApiError::Deadline),
            Ok(None) => return Err(engine_dropped()),
            Ok(Some(
                QueryEvent::Text(_)
                | QueryEvent::Draft(_)
                | QueryEvent::Commit(_)
                | QueryEvent::Retract(_)
                | QueryEvent::Replace(_),
            )) => {}
            Ok(Some(QueryEvent::Done(a))) => return Ok(Json::<Answer>(*a).into_response()),
            Ok(Some(QueryEvent::Failed(e))) => return Err(e.into()),
        }
    }
}

/// Ingest documents (same path as `specrag ingest`); re-sending an id replaces the document.
/// With `Accept: application/x-ndjson` the answer streams one JSON object per line as the work
/// goes: `{"event":"committed","documents":[...]}` per committed batch, `{"event":"problem",
/// "origin","message"}` per skipped document, then `{"event":"summary",...}` (this route's
/// answer object) or `{"event":"error",...}` (a problem).
#[utoipa::path(
    post,
    path = "/documents",
    tag = "documents",
    request_body = DocumentsRequest,
    responses(
        (status = 200, description = "Documents chunked, KV precomputed and stored, index committed. With `Accept: application/x-ndjson`: JSON lines, `committed` (`{\"documents\"}`) per batch and `problem` (`{\"origin\",\"message\"}`) events as they happen, then one `summary` event carrying this object or one `error` event carrying a problem; a client that disconnects stops the ingestion at the next chunk, and every batch it was told about stays committed.",
            content((IngestResponse = "application/json"), (IngestLine = "application/x-ndjson"))),
        (status = 400, description = "The body is not JSON of this shape", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or wrong API key", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body larger than 32 MiB, a text over 1 Mi characters or texts over 2 Mi characters together (`field` is `documents[].text`), or the documents chunk into more tokens than one request may precompute (`--max-request-tokens`, default 65536; `field` is `documents`), or the collection would hold more than `--max-collection-tokens` (default 4194304; `field` is `collection`); checked before any model work", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "The body is not sent as application/json", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "A field is invalid; `field` names it", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "The engine queue is full", body = Problem, content_type = "application/problem+json"),
    ),
    security((), ("bearer" = []))
)]
async fn post_documents(
    State(state): State<AppState>,
    Extension(grant): Extension<Grant>,
    Extension(RequestId(id)): Extension<RequestId>,
    headers: HeaderMap,
    body: Result<Json<DocumentsRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    let (docs, mut cfg, skipped) = req.validate()?;
    reach(&grant, &cfg.collection)?;
    cfg.max_request_tokens = Some(state.config.max_request_tokens);
    cfg.max_collection_tokens = Some(state.config.max_collection_tokens);
    cfg.speculator_kv = state.config.speculator_kv;
    let streamed = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/x-ndjson"));
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (progress, progress_rx) = if streamed {
        let (p, r) = tokio::sync::mpsc::unbounded_channel();
        (Some(p), Some(r))
    } else {
        (None, None)
    };
    submit(
        &state,
        Job::Ingest {
            docs,
            cfg,
            reply: tx,
            progress,
        },
    )?;
    // No deadline: once started, ingestion runs to its end (it commits batch by batch), and
    // answering 504 while it goes on committing would tell the client the opposite of what
    // happened. A client that leaves stops it.
    let Some(progress_rx) = progress_rx else {
        let (report, problems) = rx.await.map_err(|_| engine_dropped())??;
        return Ok(Json(ingest_response(report, skipped, problems)).into_response());
    };
    let (lines, body) = tokio::sync::mpsc::channel::<Result<String, Infallible>>(16);
    tokio::spawn(stream_ingest(lines, progress_rx, rx, skipped, id));
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        axum::body::Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(body)),
    )
        .into_response())
}

type IngestReply = Result<(crate::ingest::IngestReport, Vec<InputProblem>), JobError>;

/// Writes an ingestion's progress and its end as JSON lines into `lines`. Returns early when
/// the client is gone, dropping the receivers, which stops the ingestion at its next chunk.
async fn stream_ingest(
    lines: tokio::sync::mpsc::Sender<Result<String, Infallible>>,
    mut progress: tokio::sync::mpsc::UnboundedReceiver<IngestProgress>,
    reply: tokio::sync::oneshot::Receiver<IngestReply>,
    skipped: Vec<InputProblem>,
    request_id: String,
) {
    let line = |v: serde_json::Value| Ok(format!("{v}\n"));
    let problem_line = |p: &InputProblem| {
        line(serde_json::json!({"event": "problem", "origin": p.origin, "message": p.message}))
    };
    for p in &skipped {
        if lines.send(problem_line(p)).await.is_err() {
            return;
        }
    }
    loop {
        let event = tokio::select! {
            event = progress.recv() => event,
            () = lines.closed() => return,
        };
        let next = match event {
            Some(IngestProgress::Committed(documents)) => {
                line(serde_json::json!({"event": "committed", "documents": documents}))
            }
            Some(IngestProgress::Problem(p)) => problem_line(&p),
            None => break, // the job ended
        };
        if lines.send(next).await.is_err() {
            return;
        }
    }
    let last = match reply.await {
        Ok(Ok((report, problems))) => {
            let mut v = serde_json::to_value(ingest_response(report, skipped, problems))
                .unwrap_or_default();
            v["event"] = serde_json::json!("summary");
            v
        }
        Ok(Err(e)) => error_event(ApiError::from(e), &request_id),
        Err(_) => error_event(engine_dropped(), &request_id),
    };
    let _ = lines.send(line(last)).await;
}

/// A problem as a stream's `error` event; an internal one carries only the request id.
fn error_event(e: ApiError, request_id: &str) -> serde_json::Value {
    let (status, mut p) = e.problem();
    if status == StatusCode::INTERNAL_SERVER_ERROR {
        tracing::error!(request_id = %request_id, detail = %p.detail, "request failed");
        p.detail = format!("internal error; quote request id {request_id} to the operator");
    }
    let mut v = serde_json::to_value(&p).unwrap_or_default();
    v["event"] = serde_json::json!("error");
    v
}

fn ingest_response(
    report: crate::ingest::IngestReport,
    mut problems: Vec<InputProblem>,
    more: Vec<InputProblem>,
) -> IngestResponse {
    problems.extend(more);
    IngestResponse {
        collection: report.collection,
        documents: report.documents,
        chunks: report.chunks,
        tokens: report.tokens,
        reused_chunks: report.reused_chunks,
        kv_bytes: report.kv_bytes,
        seconds: report.seconds,
        problems: problems.iter().map(|p| p.to_string()).collect(),
    }
}

/// Which collection a documents route acts on.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct CollectionParam {
    /// Collection (default `default`; for listing, all collections when absent).
    #[param(pattern = r"^[A-Za-z0-9._-]{1,128}$")]
    collection: Option<String>,
}

/// List documents.
#[utoipa::path(
    get,
    path = "/documents",
    tag = "documents",
    params(CollectionParam),
    responses(
        (status = 200, description = "Documents with their chunk and token counts", body = DocumentList),
        (status = 400, description = "Unknown query parameter", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or wrong API key", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid collection name", body = Problem, content_type = "application/problem+json"),
    ),
    security((), ("bearer" = []))
)]
async fn list_documents(
    State(state): State<AppState>,
    Extension(grant): Extension<Grant>,
    q: Result<Query<CollectionParam>, QueryRejection>,
) -> Result<Json<DocumentList>, ApiError> {
    let Query(q) = q?;
    if let Some(c) = &q.collection {
        validate_collection("collection", c)?;
        reach(&grant, c)?;
    }
    let pipeline = state.pipeline.clone();
    let docs = tokio::task::spawn_blocking(move || {
        pipeline.corpus.index.documents(q.collection.as_deref())
    })
    .await
    .map_err(|_| engine_dropped())?
    .map_err(GatewayError::from)?;
    Ok(Json(DocumentList {
        documents: docs
            .into_iter()
            .filter(|d| grant.allows(&d.collection))
            .map(|d| DocumentInfo {
                collection: d.collection,
                id: d.doc_id,
                title: d.title,
                chunks: d.chunks,
                tokens: d.tokens,
            })
            .collect(),
    }))
}

/// Delete a document: its chunks leave the index and, unless another document uses them, the
/// KV store.
#[utoipa::path(
    delete,
    path = "/documents/{id}",
    tag = "documents",
    params(("id" = String, Path, description = "Document id (1 to 512 characters)", min_length = 1, max_length = 512, pattern = r"\S"), CollectionParam),
    responses(
        (status = 200, description = "Deleted", body = Deleted),
        (status = 400, description = "Unknown query parameter", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or wrong API key", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such document in the collection", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Invalid collection name", body = Problem, content_type = "application/problem+json"),
        (status = 429, description = "The engine queue is full", body = Problem, content_type = "application/problem+json"),
    ),
    security((), ("bearer" = []))
)]
async fn delete_document(
    State(state): State<AppState>,
    Extension(grant): Extension<Grant>,
    id: Result<Path<String>, PathRejection>,
    q: Result<Query<CollectionParam>, QueryRejection>,
) -> Result<Json<Deleted>, ApiError> {
    let Path(id) = id.map_err(|r| ApiError::Body(StatusCode::BAD_REQUEST, r.body_text()))?;
    let Query(q) = q?;
    let collection = q.collection.unwrap_or_else(|| "default".into());
    validate_collection("collection", &collection)?;
    reach(&grant, &collection)?;
    if id.trim().is_empty() || id.chars().count() > 512 {
        return Err(GatewayError::bad("id", "must be 1 to 512 characters, not only spaces").into());
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    submit(
        &state,
        Job::Delete {
            collection: collection.clone(),
            id: id.clone(),
            log: true,
            reply: tx,
        },
    )?;
    let chunks = rx.await.map_err(|_| engine_dropped())??;
    Ok(Json(Deleted {
        collection,
        id,
        chunks,
    }))
}

fn model_info(m: &target_engine::Model, admin: bool) -> ModelInfo {
    ModelInfo {
        name: m.config().name.clone(),
        path: admin.then(|| m.path().display().to_string()),
        fingerprint: m.fingerprint().to_string(),
    }
}

/// Liveness, models, collections and queue depth. Open to all; when the server has keys, the
/// collections are those the request's key reaches (none without a key) and model file paths
/// are shown to admin keys only.
#[utoipa::path(
    get,
    path = "/health",
    tag = "operations",
    responses((status = 200, description = "The server is up", body = Health)),
    security((), ("bearer" = []))
)]
async fn health(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Json<Health>, ApiError> {
    let grant = crate::auth::grant(&state.config.api_keys, &headers);
    let admin = grant.as_ref().is_some_and(|g| g.admin);
    let p = &state.pipeline;
    let pipeline = state.pipeline.clone();
    let collections = tokio::task::spawn_blocking(move || pipeline.corpus.index.collections())
        .await
        .map_err(|_| engine_dropped())?
        .map_err(GatewayError::from)?
        .into_iter()
        .filter(|(name, _)| grant.as_ref().is_some_and(|g| g.allows(name)))
        .map(|(name, chunks)| CollectionInfo { name, chunks })
        .collect();
    let store = store_health(&state.pipeline.corpus, admin);
    Ok(Json(Health {
        status: store.status.clone(),
        store,
        target: model_info(&p.engines.target, admin),
        speculator: p
            .engines
            .spec
            .as_ref()
            .map(|s| model_info(&s.speculator, admin)),
        collections,
        queue_depth: state.engine.depth(),
        queue_capacity: state.engine.capacity(),
        log_position: state.pipeline.corpus.doclog.as_ref().map(|l| l.position()),
    }))
}

/// The chunk store's part of `/health`.
fn store_health(corpus: &crate::corpus::Corpus, admin: bool) -> crate::api::StoreHealth {
    use chunkstore::ChunkStore;
    let stats = corpus.store.stats();
    let last_error_secs = corpus.store.last_error().map(|t| t.elapsed().as_secs());
    let recent = last_error_secs.is_some_and(|s| s < crate::api::STORE_DEGRADED_SECS);
    let reset = corpus.store_reset.as_ref().map(|p| {
        if admin {
            p.display().to_string()
        } else {
            "moved aside".to_string()
        }
    });
    crate::api::StoreHealth {
        status: if recent || reset.is_some() {
            "degraded"
        } else {
            "ok"
        }
        .into(),
        errors: stats.errors,
        last_error_secs,
        reset_at_startup: reset,
    }
}

/// Prometheus metrics.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    responses((status = 200, description = "Prometheus text exposition", body = String, content_type = "text/plain"))
)]
async fn metrics(State(state): State<AppState>) -> Response {
    use chunkstore::ChunkStore;
    let stats = state.pipeline.corpus.store.stats();
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(state.engine.depth(), &stats),
    )
        .into_response()
}

/// Adds the bearer security scheme.
struct Security;

impl utoipa::Modify for Security {
    fn modify(&self, api: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = api.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .description(Some(
                        "Required on the query and document routes when the server runs with --api-key",
                    ))
                    .build(),
            ),
        );
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "specrag",
        description = "RAG serving gateway with selective KV-cache reuse: chunk KV is precomputed at ingestion and reused at query time; a small speculative model picks the tokens the target model recomputes.",
        license(name = "Apache-2.0")
    ),
    paths(
        rag_query,
        post_documents,
        list_documents,
        delete_document,
        health,
        metrics,
        crate::openai::chat_completions,
        crate::openai::list_models
    ),
    modifiers(&Security),
    tags(
        (name = "query", description = "Answering questions"),
        (name = "documents", description = "Filling and inspecting collections"),
        (name = "openai", description = "OpenAI-compatible chat completions over a collection"),
        (name = "operations", description = "Health and metrics")
    )
)]
struct ApiDoc;

/// The OpenAPI document.
pub fn openapi() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// The OpenAPI document as pretty JSON (what `specrag openapi` prints and
/// `docs/openapi.json` holds).
pub fn openapi_json_text() -> String {
    openapi().to_pretty_json().unwrap_or_default()
}

async fn openapi_json() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        openapi_json_text(),
    )
        .into_response()
}

const SWAGGER_JS: &[u8] = include_bytes!("../assets/swagger-ui/swagger-ui-bundle.js");
const SWAGGER_CSS: &[u8] = include_bytes!("../assets/swagger-ui/swagger-ui.css");
const SWAGGER_ICON: &[u8] = include_bytes!("../assets/swagger-ui/favicon-32x32.png");

/// The web page: ask a collection, watch the answer stream, its sources, TTFT split and reuse,
/// and compare with full recompute. Served from the binary (no network at run time); it asks
/// for an API key when the server answers 401.
async fn web_page() -> Html<&'static str> {
    Html(include_str!("../assets/web/index.html"))
}

async fn docs_index() -> Html<&'static str> {
    Html(
        r##"<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>specrag API</title>
<link rel="stylesheet" href="/docs/swagger-ui.css">
<link rel="icon" type="image/png" href="/docs/favicon-32x32.png">
</head>
<body>
<div id="swagger-ui"></div>
<script src="/docs/swagger-ui-bundle.js"></script>
<script>
window.ui = SwaggerUIBundle({ url: "/openapi.json", dom_id: "#swagger-ui" });
</script>
</body>
</html>
"##,
    )
}

async fn docs_asset(Path(file): Path<String>) -> Result<Response, ApiError> {
    let (body, ty) = match file.as_str() {
        "swagger-ui-bundle.js" => (SWAGGER_JS, "application/javascript"),
        "swagger-ui.css" => (SWAGGER_CSS, "text/css"),
        "favicon-32x32.png" => (SWAGGER_ICON, "image/png"),
        _ => {
            return Err(ApiError::Gateway(GatewayError::NotFound(format!(
                "no such file /docs/{file}"
            ))))
        }
    };
    Ok((
        [
            (header::CONTENT_TYPE, ty),
            (header::CACHE_CONTROL, "public, max-age=86400"),
        ],
        body,
    )
        .into_response())
}

/// Serves `app(state)` on `addr` until Ctrl-C.
pub async fn serve(state: AppState, addr: std::net::SocketAddr) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    serve_on(state, listener).await
}

/// Serves on an already bound listener (tests bind port 0) until Ctrl-C, then waits up to
/// [`SHUTDOWN_GRACE`] for open connections.
///
/// Each connection holds one of `max_connections` permits; one over the cap is answered 503
/// and closed at once. A client must send a request's headers within `header_read_timeout`
/// (an idle keep-alive connection is closed after it too), so slow or silent clients cannot
/// hold the permits.
pub async fn serve_on(state: AppState, listener: tokio::net::TcpListener) -> std::io::Result<()> {
    let max_connections = state.config.max_connections;
    let permits = Arc::new(tokio::sync::Semaphore::new(max_connections));
    let header_timeout = state.config.header_read_timeout;
    let metrics = state.metrics.clone();
    let app = app(state);
    let shutdown = tokio::signal::ctrl_c();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of file descriptors and the like: wait, do not spin or exit.
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            metrics.connection_refused();
            metrics.request("connection_cap", 503);
            tracing::info!(route = "connection_cap", status = 503u16, peer = %peer, "request");
            tokio::spawn(refuse_connection(stream));
            continue;
        };
        let metrics = metrics.clone();
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let _permit = permit;
            // HTTP/1 only: protocol detection would read before hyper's header timer starts,
            // so a silent client would hold its connection forever.
            let mut builder =
                hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .http1_only();
            builder
                .http1()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout)
                // Above our own limits, so that `request_limits` answers those as problems.
                .max_headers(crate::request_limits::HYPER_MAX_HEADERS);
            let io = hyper_util::rt::TokioIo::new(stream);
            if let Err(e) = builder.serve_connection(io, service).await {
                // A request hyper could not parse: it answered a bare status and closed.
                match crate::request_limits::hyper_status(&*e) {
                    Some(status) => {
                        metrics.request("unparsed", status);
                        tracing::info!(route = "unparsed", status, reason = %e, "request");
                    }
                    None => tracing::debug!("connection ended: {e}"),
                }
            }
        });
    }
    // Every permit back means every connection has ended (the free ones are taken at once).
    let all = u32::try_from(max_connections).unwrap_or(u32::MAX);
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, permits.acquire_many(all)).await;
    Ok(())
}

/// How long shutdown waits for open connections.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Answers a connection over the cap with a 503 problem and closes it, spending at most a
/// second on a client that does not read.
async fn refuse_connection(mut stream: tokio::net::TcpStream) {
    use tokio::io::AsyncWriteExt;
    let body = r#"{"type":"about:blank","title":"Service Unavailable","status":503,"detail":"too many open connections; retry after the time in Retry-After"}"#;
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = stream.write_all(answer.as_bytes()).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

/// The runtime the binaries serve on: two workers are plenty, model work runs on the engine
/// thread.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
}

/// Serves `state` on a free loopback port in the background of the current runtime (the demo,
/// the evaluation's load test) and returns the address.
pub async fn spawn_loopback(state: AppState) -> std::io::Result<std::net::SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(serve_on(state, listener));
    Ok(addr)
}
