//! The OpenAI-compatible routes: `POST /v1/chat/completions` (retrieval-augmented, the RAG
//! options in a `specrag` request extension) and `GET /v1/models`, with OpenAI's error shape.
//!
//! The last user turn is the retrieval query and ends the prompt; the client's system
//! messages and earlier turns go after the retrieved chunks, as plain text before the
//! question, never into the template prefix that chunk KV was precomputed after.

use super::error::{ApiError, RequestId};
use super::query::{await_answer, submit_query};
use super::state::AppState;
use crate::answer::Answer;
use crate::api::{QueryRequest, MAX_QUERY_CHARS};
use crate::engine::QueryEvent;
use crate::error::Fault;
use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio_stream::StreamExt;

/// Most characters of the system messages and earlier turns together: they are recomputed on
/// every request (~4k tokens).
pub const MAX_CONTEXT_CHARS: usize = 16 * 1024;
/// Most messages in one request.
pub const MAX_MESSAGES: usize = 256;
/// Most stop strings (OpenAI's limit) and their longest length.
const MAX_STOPS: usize = 4;
const MAX_STOP_CHARS: usize = 64;
/// The model id every server lists besides its target's file name.
pub const MODEL_ALIAS: &str = "specrag";

/// A chat completion request (OpenAI's fields that specrag serves, plus `specrag`).
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct ChatRequest {
    /// A model id from `GET /v1/models`.
    pub model: String,
    /// The conversation: `system`/`developer`, `user` and `assistant` turns; the last one is
    /// the user's question.
    #[schema(min_items = 1, max_items = 256)]
    pub messages: Vec<ChatMessage>,
    /// Most tokens to generate, 1 to 1024 (default 128).
    #[serde(default, deserialize_with = "crate::api::de_opt_int")]
    #[schema(minimum = 1, maximum = 1024)]
    pub max_tokens: Option<u64>,
    /// Same as `max_tokens` (the newer name); wins when both are sent.
    #[serde(default, deserialize_with = "crate::api::de_opt_int")]
    #[schema(minimum = 1, maximum = 1024)]
    pub max_completion_tokens: Option<u64>,
    /// 0 (greedy, default) to 2.
    #[serde(default)]
    #[schema(minimum = 0.0, maximum = 2.0)]
    pub temperature: Option<f32>,
    /// Nucleus sampling mass, above 0 to 1 (default 1).
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    pub top_p: Option<f32>,
    /// Sampler seed, 0 to 2^53 - 1.
    #[serde(default, deserialize_with = "crate::api::de_opt_int")]
    #[schema(minimum = 0, maximum = 9007199254740991_u64)]
    pub seed: Option<u64>,
    /// Up to 4 strings, each 1 to 64 characters: generation ends before the first one.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub stop: Option<Value>,
    /// Server-sent `chat.completion.chunk` events, then `data: [DONE]`.
    #[serde(default)]
    pub stream: Option<bool>,
    /// `{"include_usage": true}`: a last chunk with `usage` and no choices.
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Only 1 is served.
    #[serde(default, deserialize_with = "crate::api::de_opt_int")]
    #[schema(minimum = 1, maximum = 1)]
    pub n: Option<u64>,
    /// Not served (400).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub tools: Option<Value>,
    /// Not served (400 when true).
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// Not served (400 unless `{"type": "text"}`).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub response_format: Option<Value>,
    /// Retrieval and reuse options (the OpenAI clients' `extra_body`).
    #[serde(default)]
    pub specrag: Option<RagOptions>,
}

/// One turn of the conversation.
#[derive(Debug, Clone, Deserialize, utoipa::ToSchema)]
pub struct ChatMessage {
    /// `system`, `developer`, `user` or `assistant`.
    pub role: String,
    /// A string, or a list of `{"type": "text", "text"}` parts.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub content: Option<Value>,
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize, utoipa::ToSchema)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// The `specrag` request extension: what `/rag/query` takes besides the question.
#[derive(Debug, Clone, Default, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RagOptions {
    /// Collection to retrieve from (default `default`).
    #[serde(default)]
    pub collection: Option<String>,
    /// Chunks to retrieve, 1 to 256 (default 4; the prompt must fit `max_context_tokens`).
    #[serde(default, deserialize_with = "crate::api::de_opt_int")]
    #[schema(minimum = 1, maximum = 256)]
    pub top_k: Option<u64>,
    /// How the tokens to recompute are chosen (as `/rag/query`'s `method`).
    #[serde(default)]
    pub method: Option<String>,
    /// ρ, 0 to 1 (default 0.25).
    #[serde(default)]
    #[schema(minimum = 0.0, maximum = 1.0)]
    pub recompute_ratio: Option<f64>,
    /// Answer exactly as full recompute would (streams only committed text).
    #[serde(default)]
    pub verify: Option<bool>,
    /// `fast`, `balanced` or `exact`, as `/rag/query`'s `fidelity` (default: the server's).
    #[serde(default)]
    pub fidelity: Option<crate::fidelity::Fidelity>,
    /// Speculative decoding, as `/rag/query`'s `spec_decode` (default: the server's).
    #[serde(default)]
    pub spec_decode: Option<bool>,
    /// What drafts, as `/rag/query`'s `spec_draft` (default: the server's).
    #[serde(default)]
    pub spec_draft: Option<crate::pipeline::SpecDraft>,
    /// Long-context drafting, as `/rag/query`'s `long_context` (default: the server's).
    #[serde(default)]
    pub long_context: Option<bool>,
    /// As `/rag/query`'s `max_context_tokens` (default and ceiling: the server's).
    #[serde(default)]
    #[schema(minimum = 1)]
    pub max_context_tokens: Option<u64>,
    /// Passages to answer from instead of retrieving, as `/rag/query`'s `documents`: their
    /// chunks' KV is reused by content, in any order, under the collection's scope; the
    /// messages' text stays the recomputed part of the prompt.
    #[serde(default)]
    #[schema(min_items = 1, max_items = 64)]
    pub documents: Option<Vec<crate::api::PassageInput>>,
    /// Read the passages pasted into the messages as passages (default true, and off when
    /// `documents` is sent): paragraphs of at least 200 characters in the system messages and
    /// the question's message, each with the short paragraphs just before it, are read like
    /// `documents` (stored KV reused by content, under the collection's scope), before the
    /// collection's retrieved chunks (none from a collection with nothing ingested); the
    /// other paragraphs stay the recomputed instructions. `false` sends the messages as plain
    /// text.
    #[serde(default)]
    pub find_passages: Option<bool>,
}

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct OpenAiError {
    pub error: OpenAiErrorBody,
}

/// The body of [`OpenAiError`].
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct OpenAiErrorBody {
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `rate_limit_error`, `timeout_error` or `server_error`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    pub code: Option<String>,
}

/// An error answered on the `/v1` routes.
#[derive(Debug)]
pub struct OaiError {
    status: StatusCode,
    body: OpenAiErrorBody,
}

impl OaiError {
    fn new(status: StatusCode, kind: &str, param: Option<&str>, message: String) -> Self {
        Self {
            status,
            body: OpenAiErrorBody {
                message,
                kind: kind.into(),
                param: param.map(str::to_string),
                code: None,
            },
        }
    }

    fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some(param),
            message.into(),
        )
    }

    fn code(mut self, code: &str) -> Self {
        self.body.code = Some(code.into());
        self
    }

    /// The same failure as `/rag/query` would report, in OpenAI's shape; a bad field of the
    /// RAG options is named under `specrag.`, the question under `messages`.
    fn from_api(e: ApiError, request_id: &str) -> Self {
        let (status, p) = e.problem();
        let param = match &e {
            ApiError::Gateway(g) => match g.fault() {
                Fault::BadInput(Some(f)) | Fault::TooLarge(f) => Some(openai_param(f)),
                _ => None,
            },
            _ => None,
        };
        let (status, kind) = match status {
            StatusCode::UNPROCESSABLE_ENTITY => (StatusCode::BAD_REQUEST, "invalid_request_error"),
            StatusCode::UNAUTHORIZED => (status, "authentication_error"),
            StatusCode::NOT_FOUND => (status, "not_found_error"),
            StatusCode::TOO_MANY_REQUESTS => (status, "rate_limit_error"),
            StatusCode::GATEWAY_TIMEOUT | StatusCode::REQUEST_TIMEOUT => (status, "timeout_error"),
            StatusCode::INTERNAL_SERVER_ERROR => (status, "server_error"),
            _ => (status, "invalid_request_error"),
        };
        let message = if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!(request_id = %request_id, detail = %p.detail, "request failed");
            format!("internal error; quote request id {request_id} to the operator")
        } else if p.detail.is_empty() {
            p.title
        } else {
            p.detail
        };
        Self::new(status, kind, param.as_deref(), message)
    }

    fn json(&self) -> Value {
        json!({ "error": self.body })
    }
}

/// Where a `/rag/query` field lives in a chat request.
fn openai_param(field: &str) -> String {
    match field {
        "query" => "messages".into(),
        "max_tokens" | "temperature" | "seed" => field.into(),
        f => format!("specrag.{f}"),
    }
}

impl IntoResponse for OaiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.json())).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
        }
        if self.status == StatusCode::REQUEST_TIMEOUT {
            r.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        r
    }
}

/// The model ids this server answers to: its target's file name and [`MODEL_ALIAS`].
fn model_ids(state: &AppState) -> Vec<String> {
    let target = &state.pipeline.engines.target;
    let stem = target
        .path()
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| target.config().name.clone());
    vec![stem, MODEL_ALIAS.into()]
}

fn authorize(state: &AppState, headers: &HeaderMap) -> Result<crate::auth::Grant, OaiError> {
    crate::auth::grant(&state.config.api_keys, headers).ok_or_else(|| {
        OaiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            None,
            "missing or wrong API key: send `Authorization: Bearer <key>`".into(),
        )
        .code("invalid_api_key")
    })
}

/// The model list.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ModelList {
    /// `list`.
    pub object: String,
    pub data: Vec<ModelCard>,
}

/// One model of [`ModelList`].
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ModelCard {
    pub id: String,
    /// `model`.
    pub object: String,
    /// Unix seconds (when the server started).
    pub created: u64,
    pub owned_by: String,
}

/// The models `POST /v1/chat/completions` answers to.
#[utoipa::path(
    get,
    path = "/v1/models",
    tag = "openai",
    responses(
        (status = 200, description = "The target model under its file name and the alias `specrag`", body = ModelList),
        (status = 401, description = "Missing or wrong API key", body = OpenAiError),
    ),
    security((), ("bearer" = []))
)]
pub(crate) async fn list_models(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Json<ModelList>, OaiError> {
    authorize(&state, &headers)?;
    let created = state.started_unix;
    Ok(Json(ModelList {
        object: "list".into(),
        data: model_ids(&state)
            .into_iter()
            .map(|id| ModelCard {
                id,
                object: "model".into(),
                created,
                owned_by: "specrag".into(),
            })
            .collect(),
    }))
}

/// The text parts of a message's content (none when it is absent).
fn content_parts(m: &ChatMessage, i: usize) -> Result<Vec<String>, OaiError> {
    let param = format!("messages[{i}].content");
    match &m.content {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(
                |p| match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => Ok(t.clone()),
                    _ => Err(OaiError::invalid(
                        &param,
                        "only text parts (`{\"type\": \"text\", \"text\": ...}`) are served",
                    )),
                },
            )
            .collect(),
        Some(_) => Err(OaiError::invalid(
            &param,
            "must be a string or a list of text parts",
        )),
    }
}

/// What a chat request's messages hold.
#[derive(Debug, Default)]
struct Conversation {
    /// The last user turn, less the passages found in it.
    question: String,
    /// System messages (less their passages) and earlier turns: recomputed on every request.
    context: String,
    /// Passages found in the system messages and the question's message
    /// ([`crate::passages`]), in their order, named `messages[i]:n`.
    passages: Vec<crate::api::PassageInput>,
}

impl Conversation {
    /// Keeps `text`'s passages (when `find`) and returns the rest.
    fn take_passages(&mut self, text: &str, i: usize, keep_last: bool, find: bool) -> String {
        if !find {
            return text.to_string();
        }
        let split = crate::passages::split(text, keep_last);
        if split.passages.is_empty() {
            return text.to_string();
        }
        // Detection is a convenience: passages past what a query reads leave the whole message
        // prompt text, as with `find_passages: false`, rather than refusing the request.
        let chars = |ps: &mut dyn Iterator<Item = &String>| -> usize {
            ps.map(|p| p.chars().count()).sum()
        };
        let count = self.passages.len() + split.passages.len();
        let total =
            chars(&mut self.passages.iter().map(|p| &p.text)) + chars(&mut split.passages.iter());
        if count > crate::api::MAX_QUERY_DOCUMENTS || total > crate::api::MAX_QUERY_DOCUMENTS_CHARS
        {
            return text.to_string();
        }
        let prefix = format!("messages[{i}]:");
        // Earlier text parts of the same message numbered theirs first.
        let named = self
            .passages
            .iter()
            .filter(|p| p.id.as_ref().is_some_and(|id| id.starts_with(&prefix)))
            .count();
        let rest = split.rest_text();
        for (n, p) in split.passages.into_iter().enumerate() {
            self.passages.push(crate::api::PassageInput {
                id: Some(format!("{prefix}{}", named + n + 1)),
                text: p,
            });
        }
        rest
    }
}

/// The question (last user turn), the context text (system messages, earlier turns) and,
/// when `find`, the passages pasted into the system messages and the question's message.
fn conversation(messages: &[ChatMessage], find: bool) -> Result<Conversation, OaiError> {
    if messages.is_empty() {
        return Err(OaiError::invalid(
            "messages",
            "must hold at least one message",
        ));
    }
    if messages.len() > MAX_MESSAGES {
        return Err(OaiError::invalid(
            "messages",
            format!("{} messages; at most {MAX_MESSAGES}", messages.len()),
        ));
    }
    let last = messages.len() - 1;
    let mut out = Conversation::default();
    let mut instructions = Vec::new();
    let mut turns = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let parts = content_parts(m, i)?;
        match (m.role.as_str(), i == last) {
            ("user", true) => out.question = out.take_passages(&parts.join("\n"), i, true, find),
            (_, true) => {
                return Err(OaiError::invalid(
                    &format!("messages[{i}].role"),
                    "the last message must be the user's question (role `user`)",
                ))
            }
            ("system" | "developer", false) => {
                for part in &parts {
                    instructions.push(out.take_passages(part, i, false, find));
                }
            }
            ("user", false) => turns.push(format!("User: {}", parts.join("\n").trim())),
            ("assistant", false) => turns.push(format!("Assistant: {}", parts.join("\n").trim())),
            (other, false) => {
                return Err(OaiError::invalid(
                    &format!("messages[{i}].role"),
                    format!(
                        "`{other}` is not served; expected system, developer, user or assistant"
                    ),
                ))
            }
        }
    }
    out.context = context_text(&instructions, &turns)?;
    let chars = out.question.chars().count();
    if chars > MAX_QUERY_CHARS {
        return Err(OaiError::invalid(
            &format!("messages[{last}].content"),
            format!("is {chars} characters; at most {MAX_QUERY_CHARS} are accepted"),
        ));
    }
    Ok(out)
}

/// The recomputed context: instructions, then the earlier turns, within
/// [`MAX_CONTEXT_CHARS`].
fn context_text(instructions: &[String], turns: &[String]) -> Result<String, OaiError> {
    let mut context = instructions
        .iter()
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("\n");
    if !turns.is_empty() {
        if !context.is_empty() {
            context.push_str("\n\n");
        }
        context.push_str("Conversation so far:\n");
        context.push_str(&turns.join("\n"));
    }
    let chars = context.chars().count();
    if chars > MAX_CONTEXT_CHARS {
        return Err(OaiError::invalid(
            "messages",
            format!(
                "the system messages and earlier turns are {chars} characters (passages found \
                 in them not counted); at most {MAX_CONTEXT_CHARS} are accepted (they are \
                 recomputed on every request)"
            ),
        ));
    }
    Ok(context)
}

fn stops(v: &Option<Value>) -> Result<Vec<String>, OaiError> {
    let list: Vec<String> = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| OaiError::invalid("stop", "must be a string or a list of strings"))?,
        Some(_) => {
            return Err(OaiError::invalid(
                "stop",
                "must be a string or a list of strings",
            ))
        }
    };
    if list.len() > MAX_STOPS {
        return Err(OaiError::invalid(
            "stop",
            format!("{} strings; at most {MAX_STOPS}", list.len()),
        ));
    }
    if let Some(bad) = list
        .iter()
        .find(|s| s.is_empty() || s.chars().count() > MAX_STOP_CHARS)
    {
        return Err(OaiError::invalid(
            "stop",
            format!("`{bad}`: each stop string must be 1 to {MAX_STOP_CHARS} characters"),
        ));
    }
    Ok(list)
}

/// The validated query of a chat request.
fn to_query(state: &AppState, req: &ChatRequest) -> Result<crate::pipeline::Query, OaiError> {
    if !model_ids(state).contains(&req.model) {
        return Err(OaiError::new(
            StatusCode::NOT_FOUND,
            "not_found_error",
            Some("model"),
            format!(
                "model `{}` does not exist; GET /v1/models lists {}",
                req.model,
                model_ids(state).join(", ")
            ),
        )
        .code("model_not_found"));
    }
    if req.n.is_some_and(|n| n != 1) {
        return Err(OaiError::invalid("n", "only n = 1 is served"));
    }
    if req.tools.as_ref().is_some_and(|t| !t.is_null()) {
        return Err(OaiError::invalid("tools", "tools are not served"));
    }
    if req.logprobs == Some(true) {
        return Err(OaiError::invalid("logprobs", "logprobs are not served"));
    }
    if let Some(f) = req.response_format.as_ref().filter(|f| !f.is_null()) {
        if f.get("type").and_then(Value::as_str) != Some("text") {
            return Err(OaiError::invalid(
                "response_format",
                "only `{\"type\": \"text\"}` is served",
            ));
        }
    }
    let top_p = req.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(OaiError::invalid(
            "top_p",
            format!("must be above 0 and at most 1, got {top_p}"),
        ));
    }
    let seed = req.seed;
    let rag = req.specrag.clone().unwrap_or_default();
    let find = rag.documents.is_none() && rag.find_passages != Some(false);
    let conv = conversation(&req.messages, find)?;
    let stop = stops(&req.stop)?;
    let base = QueryRequest {
        query: conv.question,
        collection: rag.collection,
        top_k: rag.top_k,
        method: rag.method,
        recompute_ratio: rag.recompute_ratio,
        max_tokens: req.max_completion_tokens.or(req.max_tokens),
        temperature: req.temperature,
        seed,
        verify: rag.verify,
        fidelity: rag.fidelity,
        spec_decode: rag.spec_decode,
        spec_draft: rag.spec_draft,
        long_context: rag.long_context,
        max_context_tokens: rag.max_context_tokens,
        documents: rag.documents.clone(),
        stream: None,
    };
    let mut q = base
        .validate_with(state.config.fidelity)
        .map_err(|e| OaiError::from_api(ApiError::Gateway(e), ""))?;
    if !conv.passages.is_empty() {
        q.documents = crate::api::validate_passages("messages", &conv.passages)
            .map_err(|e| OaiError::from_api(ApiError::Gateway(e), ""))?;
        q.retrieve_too = true;
    }
    q.context = conv.context;
    q.top_p = top_p;
    q.stop = stop;
    Ok(q)
}

/// A chat completion (non-streamed).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ChatCompletion {
    pub id: String,
    /// `chat.completion`.
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<Choice>,
    pub usage: Usage,
    /// Chunks, timings, reuse and (with `verify`) verification of the answer.
    #[schema(value_type = Object)]
    pub specrag: Value,
}

/// The one choice of a completion.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Choice {
    pub index: u32,
    pub message: AssistantMessage,
    /// `stop` (end of text or a stop string) or `length`.
    pub finish_reason: String,
}

/// The assistant's answer.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct AssistantMessage {
    /// `assistant`.
    pub role: String,
    pub content: String,
}

/// Token counts.
#[derive(Debug, Clone, Copy, Serialize, utoipa::ToSchema)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

fn usage(a: &Answer) -> Usage {
    Usage {
        prompt_tokens: a.prompt_tokens,
        completion_tokens: a.tokens,
        total_tokens: a.prompt_tokens + a.tokens,
    }
}

fn finish(a: &Answer) -> &'static str {
    match a.finish_reason {
        target_engine::FinishReason::Length => "length",
        _ => "stop",
    }
}

fn rag_info(a: &Answer) -> Value {
    let mut v =
        json!({ "chunks": a.chunks, "timings": a.timings, "reuse": a.reuse, "method": a.method });
    if let Some(verify) = &a.verify {
        v["verify"] = json!(verify);
    }
    if let Some(spec) = &a.spec_decode {
        v["spec_decode"] = json!(spec);
    }
    if let Some(long) = &a.long_context {
        v["long_context"] = json!(long);
    }
    v
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Answer a conversation's last question over a collection, OpenAI-style.
#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    tag = "openai",
    request_body = ChatRequest,
    responses(
        (status = 200, description = "A `chat.completion` with `usage` and a `specrag` object (chunks, timings, reuse, verify). With `\"stream\": true`: server-sent `data:` events, each a `chat.completion.chunk` (the last one with `finish_reason` carries `specrag`; with `stream_options.include_usage` one more with `usage` and no choices), then `data: [DONE]`; with `specrag.verify` only committed text is sent.",
            content((ChatCompletion = "application/json"), (String = "text/event-stream"))),
        (status = 400, description = "A field is invalid or not served; `error.param` names it", body = OpenAiError),
        (status = 401, description = "Missing or wrong API key", body = OpenAiError),
        (status = 404, description = "Unknown model (`model_not_found`) or collection", body = OpenAiError),
        (status = 413, description = "Body larger than 2 MiB", body = OpenAiError),
        (status = 429, description = "The engine queue is full; see Retry-After", body = OpenAiError),
        (status = 504, description = "Not finished within the server's deadline", body = OpenAiError),
    ),
    security((), ("bearer" = []))
)]
pub(crate) async fn chat_completions(
    State(state): State<AppState>,
    Extension(RequestId(id)): Extension<RequestId>,
    headers: HeaderMap,
    body: Result<Json<ChatRequest>, JsonRejection>,
) -> Result<Response, OaiError> {
    let grant = authorize(&state, &headers)?;
    let Json(req) = body.map_err(|r| {
        if super::error::is_body_timeout(&r) {
            return OaiError::from_api(ApiError::BodyTimeout, &id);
        }
        let status = match r.status() {
            StatusCode::PAYLOAD_TOO_LARGE => StatusCode::PAYLOAD_TOO_LARGE,
            _ => StatusCode::BAD_REQUEST,
        };
        OaiError::new(status, "invalid_request_error", None, r.body_text())
    })?;
    let query = to_query(&state, &req)?;
    let api = |e: ApiError| OaiError::from_api(e, &id);
    let submitted = submit_query(&state, &grant, query).map_err(api)?;
    let meta = Meta {
        id: format!("chatcmpl-{:016x}", rand::random::<u64>()),
        created: unix_now(),
        model: req.model.clone(),
        request_id: id.clone(),
    };
    if req.stream.unwrap_or(false) {
        let include_usage = req
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        return Ok(stream_chunks(submitted.rx, meta, include_usage));
    }
    let answer = await_answer(submitted).await.map_err(api)?;
    Ok(completion(meta, &answer))
}

/// What every object of one completion repeats.
struct Meta {
    id: String,
    created: u64,
    model: String,
    request_id: String,
}

impl Meta {
    /// A `chat.completion.chunk` with one choice.
    fn chunk(&self, delta: Value, finish: Option<&str>) -> Value {
        json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        })
    }
}

fn completion(meta: Meta, a: &Answer) -> Response {
    Json(ChatCompletion {
        id: meta.id,
        object: "chat.completion".into(),
        created: meta.created,
        model: meta.model,
        choices: vec![Choice {
            index: 0,
            message: AssistantMessage {
                role: "assistant".into(),
                content: a.answer.clone(),
            },
            finish_reason: finish(a).into(),
        }],
        usage: usage(a),
        specrag: rag_info(a),
    })
    .into_response()
}

/// What a streamed answer has sent so far: the text a client holds after applying every
/// chunk's `delta.content` and `specrag.replace`.
#[derive(Debug, Default)]
struct Sent {
    text: String,
    /// A `specrag.replace` chunk was sent.
    replaced: bool,
}

/// The chunks an engine event becomes: none (drafts and withdrawals while verifying: only
/// final text is sent), one, or two (the finish chunk and the usage chunk). Final text is a
/// `delta.content`. When the fidelity guard withdrew text this stream had already sent (an
/// OpenAI stream cannot take text back), a chunk with an empty delta and
/// `specrag.replace` carries the whole answer so far; content deltas go on after it, and the
/// finish chunk's `specrag.replaced` is true. A client that ignores the extension holds the
/// sent text; one that applies it holds the answer.
fn event_chunks(meta: &Meta, e: QueryEvent, include_usage: bool, sent: &mut Sent) -> Vec<Value> {
    match e {
        QueryEvent::Text(t) | QueryEvent::Commit(t) => {
            sent.text.push_str(&t);
            vec![meta.chunk(json!({ "content": t }), None)]
        }
        QueryEvent::Replace(t) => match t.strip_prefix(sent.text.as_str()) {
            Some("") => Vec::new(),
            Some(rest) => {
                let chunk = meta.chunk(json!({ "content": rest }), None);
                sent.text = t;
                vec![chunk]
            }
            None => {
                let mut chunk = meta.chunk(json!({}), None);
                chunk["specrag"] = json!({ "replace": t });
                sent.text = t;
                sent.replaced = true;
                vec![chunk]
            }
        },
        QueryEvent::Draft(_) | QueryEvent::Retract(_) => Vec::new(),
        QueryEvent::Done(a) => {
            let mut last = meta.chunk(json!({}), Some(finish(&a)));
            last["specrag"] = rag_info(&a);
            last["specrag"]["replaced"] = json!(sent.replaced);
            let mut out = vec![last];
            if include_usage {
                let mut u = meta.chunk(json!({}), None);
                u["choices"] = json!([]);
                u["usage"] = json!(usage(&a));
                out.push(u);
            }
            out
        }
        QueryEvent::Failed(e) => {
            vec![OaiError::from_api(ApiError::from(e), &meta.request_id).json()]
        }
    }
}

/// The streamed answer: a role chunk, the engine's events as chunks (translated by a task of
/// their own), then `data: [DONE]`.
fn stream_chunks(
    mut rx: tokio::sync::mpsc::Receiver<QueryEvent>,
    meta: Meta,
    include_usage: bool,
) -> Response {
    let (out_tx, out_rx) = tokio::sync::mpsc::channel::<Value>(crate::api::MAX_TOKENS as usize + 8);
    tokio::spawn(async move {
        let mut send = vec![meta.chunk(json!({"role": "assistant", "content": ""}), None)];
        let mut sent = Sent::default();
        loop {
            for v in send.drain(..) {
                if out_tx.send(v).await.is_err() {
                    return; // the client went away; dropping `rx` stops the engine
                }
            }
            let Some(e) = rx.recv().await else { return };
            send = event_chunks(&meta, e, include_usage, &mut sent);
        }
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(out_rx)
        .map(|v| Ok::<Event, Infallible>(Event::default().data(v.to_string())))
        .chain(tokio_stream::once(Ok(Event::default().data("[DONE]"))));
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: Value) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: Some(content),
        }
    }

    /// The guard's `replace` in an OpenAI stream: the rest is sent as content when it extends
    /// what was sent; otherwise a `specrag.replace` chunk carries the answer so far and the
    /// stream goes on (issue 57: a stream that went silent and ended as if complete).
    #[test]
    fn a_guard_replacement_extends_the_stream_or_replaces_it_and_goes_on() {
        let meta = Meta {
            id: "c".into(),
            created: 0,
            model: "m".into(),
            request_id: "r".into(),
        };
        let mut sent = Sent::default();
        let mut held = String::new();
        let mut step = |e: QueryEvent| {
            let chunks = event_chunks(&meta, e, false, &mut sent);
            let mut content = Vec::new();
            for c in chunks {
                if let Some(t) = c["specrag"]["replace"].as_str() {
                    held = t.to_string();
                    content.push(format!("<replace {t}>"));
                }
                if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
                    held.push_str(t);
                    content.push(t.to_string());
                }
            }
            (content, held.clone())
        };
        assert_eq!(step(QueryEvent::Text("The cat".into())).0, ["The cat"]);
        assert_eq!(step(QueryEvent::Replace("The cat sat".into())).0, [" sat"]);
        assert!(step(QueryEvent::Replace("The cat sat".into())).0.is_empty());
        assert_eq!(step(QueryEvent::Text(" down".into())).0, [" down"]);
        assert!(step(QueryEvent::Draft(" x".into())).0.is_empty());
        assert_eq!(
            step(QueryEvent::Replace("The dog".into())).0,
            ["<replace The dog>"]
        );
        assert_eq!(
            step(QueryEvent::Commit(" ran".into())),
            (vec![" ran".to_string()], "The dog ran".to_string())
        );
        assert_eq!(sent.text, "The dog ran");
        assert!(sent.replaced);
    }

    #[test]
    fn the_last_user_turn_is_the_question_and_the_rest_is_context() {
        let c = conversation(
            &[
                msg("system", json!("Be brief.")),
                msg("user", json!("Who wrote it?")),
                msg("assistant", json!("Ada.")),
                msg("user", json!([{"type": "text", "text": "When?"}])),
            ],
            true,
        )
        .expect("valid");
        assert_eq!(c.question, "When?");
        assert_eq!(
            c.context,
            "Be brief.\n\nConversation so far:\nUser: Who wrote it?\nAssistant: Ada."
        );
        assert!(c.passages.is_empty());
    }

    /// Issue 57: more pasted passages than a query reads (65 paragraphs of 210 characters in
    /// a system message) were refused with 400; past detection's limits the message stays
    /// prompt text, as with `find_passages: false`.
    #[test]
    fn too_many_pasted_passages_stay_prompt_text() {
        let para = "word ".repeat(42);
        let system = vec![para.trim(); crate::api::MAX_QUERY_DOCUMENTS + 1].join("\n\n");
        let msgs = [msg("system", json!(system)), msg("user", json!("why?"))];
        let c = conversation(&msgs, true).expect("served");
        assert!(c.passages.is_empty(), "{} passages", c.passages.len());
        assert_eq!(c.context, system);
        let fits = vec![para.trim(); crate::api::MAX_QUERY_DOCUMENTS].join("\n\n");
        let msgs = [msg("system", json!(fits)), msg("user", json!("why?"))];
        let c = conversation(&msgs, true).expect("served");
        assert_eq!(c.passages.len(), crate::api::MAX_QUERY_DOCUMENTS);
    }

    #[test]
    fn passages_pasted_into_messages_are_found_and_named() {
        let passage = |tag: &str| format!("{tag}: {}", "the keeper counts ships. ".repeat(10));
        let (a, b, c) = (passage("A"), passage("B"), passage("C"));
        let messages = [
            msg(
                "system",
                json!([
                    {"type": "text", "text": format!("Answer from the context.\n\n{a}\n\n{b}")},
                    {"type": "text", "text": "Be brief."},
                ]),
            ),
            msg("user", json!(format!("Context:\n\n{c}\n\nHow many ships?"))),
        ];
        let found = conversation(&messages, true).expect("valid");
        let ids: Vec<_> = found.passages.iter().map(|p| p.id.clone()).collect();
        let texts: Vec<_> = found.passages.iter().map(|p| p.text.clone()).collect();
        assert_eq!(
            ids,
            ["messages[0]:1", "messages[0]:2", "messages[1]:1"].map(|s| Some(s.to_string()))
        );
        assert_eq!(texts, [&a, &b, &c].map(|t| t.trim().to_string()));
        assert_eq!(found.context, "Answer from the context.\nBe brief.");
        assert_eq!(found.question, "Context:\n\nHow many ships?");
        // Off, the messages are plain text, as sent.
        let plain = conversation(&messages, false).expect("valid");
        assert!(plain.passages.is_empty());
        assert!(plain.context.contains(a.trim()) && plain.question.contains(c.trim()));
        // Passages do not count against the recomputed context's cap.
        let big = "y ".repeat(MAX_CONTEXT_CHARS);
        let m = [msg("system", json!(big)), msg("user", json!("q"))];
        assert_eq!(conversation(&m, true).expect("a passage").passages.len(), 1);
        assert!(conversation(&m, false).is_err());
    }

    #[test]
    fn bad_conversations_name_the_message() {
        let err = |m: &[ChatMessage]| conversation(m, false).expect_err("invalid").body.param;
        assert_eq!(err(&[]), Some("messages".into()));
        assert_eq!(
            err(&[msg("user", json!("a")), msg("assistant", json!("b"))]),
            Some("messages[1].role".into())
        );
        assert_eq!(
            err(&[msg("tool", json!("a")), msg("user", json!("b"))]),
            Some("messages[0].role".into())
        );
        assert_eq!(
            err(&[msg("user", json!([{"type": "image_url"}]))]),
            Some("messages[0].content".into())
        );
        let long = "x".repeat(MAX_CONTEXT_CHARS + 1);
        assert_eq!(
            err(&[msg("system", json!(long)), msg("user", json!("q"))]),
            Some("messages".into())
        );
    }

    #[test]
    fn stop_takes_a_string_or_up_to_four() {
        assert_eq!(stops(&Some(json!("\n"))).expect("ok"), vec!["\n"]);
        assert!(stops(&Some(json!(["a", "b", "c", "d", "e"]))).is_err());
        assert!(stops(&Some(json!([""]))).is_err());
        assert!(stops(&Some(json!(3))).is_err());
    }

    #[test]
    fn rag_fields_are_named_under_specrag() {
        assert_eq!(openai_param("top_k"), "specrag.top_k");
        assert_eq!(openai_param("query"), "messages");
        assert_eq!(openai_param("max_tokens"), "max_tokens");
    }
}
