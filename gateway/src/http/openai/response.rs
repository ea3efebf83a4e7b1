//! A completion and its stream: `chat.completion` objects and `chat.completion.chunk` events
//! built from the pipeline's answer and events.

use super::error::OaiError;
use crate::answer::Answer;
use crate::engine::QueryEvent;
use crate::http::error::ApiError;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use serde_json::{json, Value};
use std::convert::Infallible;
use tokio_stream::StreamExt;

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
    /// With `logprobs: true`: each answer token's log-probability; else null.
    pub logprobs: Option<ChoiceLogprobs>,
    /// `stop` (end of text or a stop string) or `length`.
    pub finish_reason: String,
}

/// A choice's token log-probabilities.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ChoiceLogprobs {
    pub content: Vec<crate::answer::TokenLogprob>,
}

pub(super) fn logprobs(a: &Answer) -> Option<ChoiceLogprobs> {
    a.logprobs.clone().map(|content| ChoiceLogprobs { content })
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

pub(super) fn usage(a: &Answer) -> Usage {
    Usage {
        prompt_tokens: a.prompt_tokens,
        completion_tokens: a.tokens,
        total_tokens: a.prompt_tokens + a.tokens,
    }
}

pub(super) fn finish(a: &Answer) -> &'static str {
    match a.finish_reason {
        target_engine::FinishReason::Length => "length",
        _ => "stop",
    }
}

pub(super) fn rag_info(a: &Answer) -> Value {
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

/// What every object of one completion repeats.
pub(super) struct Meta {
    pub(super) id: String,
    pub(super) created: u64,
    pub(super) model: String,
    pub(super) request_id: String,
}

impl Meta {
    /// A `chat.completion.chunk` with one choice.
    pub(super) fn chunk(&self, delta: Value, finish: Option<&str>) -> Value {
        json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        })
    }
}

pub(super) fn completion(meta: Meta, a: &Answer) -> Response {
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
            logprobs: logprobs(a),
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
pub(super) struct Sent {
    pub(super) text: String,
    /// A `specrag.replace` chunk was sent.
    pub(super) replaced: bool,
}

/// The chunks an engine event becomes: none (drafts and withdrawals while verifying: only
/// final text is sent), one, or two (the finish chunk and the usage chunk). Final text is a
/// `delta.content`. When the fidelity guard withdrew text this stream had already sent (an
/// OpenAI stream cannot take text back), a chunk with an empty delta and
/// `specrag.replace` carries the whole answer so far; content deltas go on after it, and the
/// finish chunk's `specrag.replaced` is true. A client that ignores the extension holds the
/// sent text; one that applies it holds the answer.
pub(super) fn event_chunks(
    meta: &Meta,
    e: QueryEvent,
    include_usage: bool,
    sent: &mut Sent,
) -> Vec<Value> {
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
            // The answer's tokens arrive with the text; their logprobs, all of them, here.
            if let Some(l) = logprobs(&a) {
                last["choices"][0]["logprobs"] = json!(l);
            }
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
pub(super) fn stream_chunks(
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
