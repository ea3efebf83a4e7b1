//! What a chat completion request says, read into a pipeline query: the messages, the
//! `specrag` options, stop strings.

use super::error::OaiError;
use super::limits::{model_ids, MAX_CONTEXT_CHARS, MAX_MESSAGES, MAX_STOPS, MAX_STOP_CHARS};
use crate::api::{QueryRequest, MAX_QUERY_CHARS};
use crate::http::error::ApiError;
use crate::http::state::AppState;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::Value;

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
    /// Return each answer token's log-probability in `choices[0].logprobs.content`, from the
    /// pass that chose it (every method, verified and speculative decoding included).
    #[serde(default)]
    pub logprobs: Option<bool>,
    /// With `logprobs: true`, this many most likely tokens at each position (0 to 20).
    #[serde(default, deserialize_with = "crate::api::de_opt_int")]
    #[schema(minimum = 0, maximum = 20)]
    pub top_logprobs: Option<u64>,
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
    /// ρ, 0 to 1 (default: the server's `--ratio`, 0.25 unless set).
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
    #[serde(default, deserialize_with = "crate::api::de_opt_int")]
    #[schema(minimum = 1)]
    pub max_context_tokens: Option<u64>,
    /// Passages to answer from instead of retrieving, as `/rag/query`'s `documents`: their
    /// chunks' KV is reused by content, in any order, under the collection's scope; the
    /// messages' text stays the recomputed part of the prompt.
    #[serde(default)]
    #[schema(min_items = 1, max_items = 256)]
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

/// The text parts of a message's content (none when it is absent).
pub(super) fn content_parts(m: &ChatMessage, i: usize) -> Result<Vec<String>, OaiError> {
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
pub(super) struct Conversation {
    /// The last user turn, less the passages found in it.
    pub(super) question: String,
    /// System messages (less their passages) and earlier turns: recomputed on every request.
    pub(super) context: String,
    /// Passages found in the system messages and the question's message
    /// ([`crate::passages`]), in their order, named `messages[i]:n`.
    pub(super) passages: Vec<crate::api::PassageInput>,
}

impl Conversation {
    /// Keeps `text`'s passages (when `find`) and returns the rest. Passages past what one
    /// query reads are refused, naming the message and the limits: reading them as prompt
    /// text instead would only move the refusal to the recomputed context's smaller cap.
    pub(super) fn take_passages(
        &mut self,
        text: &str,
        i: usize,
        keep_last: bool,
        find: bool,
    ) -> Result<String, OaiError> {
        if !find {
            return Ok(text.to_string());
        }
        let split = crate::passages::split(text, keep_last);
        if split.passages.is_empty() {
            return Ok(text.to_string());
        }
        let chars = |ps: &mut dyn Iterator<Item = &String>| -> usize {
            ps.map(|p| p.chars().count()).sum()
        };
        let count = self.passages.len() + split.passages.len();
        let total =
            chars(&mut self.passages.iter().map(|p| &p.text)) + chars(&mut split.passages.iter());
        use crate::api::{MAX_QUERY_DOCUMENTS as MAX_N, MAX_QUERY_DOCUMENTS_CHARS as MAX_C};
        if count > MAX_N || total > MAX_C {
            return Err(OaiError::invalid(
                &format!("messages[{i}].content"),
                format!(
                    "the messages hold {count} passages (paragraphs of {} or more characters) \
                     of {total} characters up to this one; one query reads at most {MAX_N} \
                     passages of {MAX_C} characters in all: send fewer, or send the rest in \
                     another request",
                    crate::passages::MIN_PASSAGE_CHARS
                ),
            ));
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
        Ok(rest)
    }
}

/// The question (last user turn), the context text (system messages, earlier turns) and,
/// when `find`, the passages pasted into the system messages and the question's message.
pub(super) fn conversation(messages: &[ChatMessage], find: bool) -> Result<Conversation, OaiError> {
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
            ("user", true) => out.question = out.take_passages(&parts.join("\n"), i, true, find)?,
            (_, true) => {
                return Err(OaiError::invalid(
                    &format!("messages[{i}].role"),
                    "the last message must be the user's question (role `user`)",
                ))
            }
            ("system" | "developer", false) => {
                for part in &parts {
                    instructions.push(out.take_passages(part, i, false, find)?);
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
    out.context = context_text(&instructions, &turns, !out.passages.is_empty())?;
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
/// [`MAX_CONTEXT_CHARS`] (`found`: passages were taken out of the instructions).
pub(super) fn context_text(
    instructions: &[String],
    turns: &[String],
    found: bool,
) -> Result<String, OaiError> {
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
                "the system messages and earlier turns are {chars} characters{}; at most \
                 {MAX_CONTEXT_CHARS} are accepted (they are recomputed on every request; \
                 passages, paragraphs of {} or more characters, are read apart{})",
                if found {
                    " besides the passages found in them"
                } else {
                    ""
                },
                crate::passages::MIN_PASSAGE_CHARS,
                if found {
                    ""
                } else {
                    " unless `specrag.find_passages` is false or `specrag.documents` is sent"
                },
            ),
        ));
    }
    Ok(context)
}

pub(super) fn stops(v: &Option<Value>) -> Result<Vec<String>, OaiError> {
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

/// The alternatives per token a chat request asks logprobs with (`top_logprobs`, 0 without
/// it), or `None` without `logprobs: true`.
fn logprobs_asked(req: &ChatRequest) -> Result<Option<u64>, OaiError> {
    match (req.logprobs == Some(true), req.top_logprobs) {
        (false, Some(_)) => Err(OaiError::invalid(
            "top_logprobs",
            "needs `logprobs: true` (send both, or neither)",
        )),
        (false, None) => Ok(None),
        (true, k) => {
            let k = k.unwrap_or(0);
            let most = target_engine::MAX_TOP_LOGPROBS as u64;
            if k > most {
                return Err(OaiError::invalid(
                    "top_logprobs",
                    format!("must be 0 to {most}, got {k}"),
                ));
            }
            Ok(Some(k))
        }
    }
}

/// The answer's length limit, `max_completion_tokens` (the newer name) before `max_tokens`;
/// the newer name is checked here so that an error names it as the client sent it (the query
/// knows only `max_tokens`).
fn max_tokens(req: &ChatRequest) -> Result<Option<u64>, OaiError> {
    let Some(n) = req.max_completion_tokens else {
        return Ok(req.max_tokens);
    };
    let most = u64::from(crate::api::MAX_TOKENS);
    if (1..=most).contains(&n) {
        Ok(Some(n))
    } else {
        Err(OaiError::invalid(
            "max_completion_tokens",
            format!("invalid `max_completion_tokens`: must be 1 to {most}, got {n}"),
        ))
    }
}

/// The validated query of a chat request.
pub(super) fn to_query(
    state: &AppState,
    req: &ChatRequest,
) -> Result<crate::pipeline::Query, OaiError> {
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
    let logprobs = logprobs_asked(req)?;
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
    let max_tokens = max_tokens(req)?;
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
        max_tokens,
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
        logprobs,
    };
    let mut q = base
        .validate_with(state.config.request_defaults())
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
