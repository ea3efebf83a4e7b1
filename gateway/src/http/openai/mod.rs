//! The OpenAI-compatible routes: `POST /v1/chat/completions` (retrieval-augmented, the RAG
//! options in a `specrag` request extension) and `GET /v1/models`, with OpenAI's error shape.
//!
//! The last user turn is the retrieval query and ends the prompt; the client's system
//! messages and earlier turns go after the retrieved chunks, as plain text before the
//! question, never into the template prefix that chunk KV was precomputed after.

//!
//! `request.rs` reads a request into a [`Query`](crate::pipeline::Query), `response.rs` writes
//! completions and stream chunks, `error.rs` speaks OpenAI's error shape.

mod error;
mod limits;
mod request;
mod response;

pub(crate) use error::in_route_shape;
pub use error::{OaiError, OpenAiError, OpenAiErrorBody};
use limits::model_ids;
pub use limits::{MAX_CONTEXT_CHARS, MAX_MESSAGES, MAX_STOPS, MAX_STOP_CHARS, MODEL_ALIAS};
use request::to_query;
pub use request::{ChatMessage, ChatRequest, RagOptions, StreamOptions};
use response::{completion, stream_chunks, Meta};
pub use response::{AssistantMessage, ChatCompletion, Choice, Usage};

use crate::http::error::{ApiError, RequestId};
use crate::http::query::{await_answer, submit_query};
use crate::http::state::AppState;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::Response;
use axum::{Extension, Json};
use serde::Serialize;
use std::time::{SystemTime, UNIX_EPOCH};

/// The OpenAI routes' key check, in OpenAI's error shape: a layer, so a request without a
/// valid key is answered before its body is read (a client without a key holds none of the
/// body bytes the server accepts at once). The grant goes on as an extension.
pub(crate) async fn require_key(
    State(state): State<AppState>,
    mut req: Request,
    next: Next,
) -> Result<Response, OaiError> {
    let grant = crate::auth::grant(&state.config.api_keys, req.headers()).ok_or_else(|| {
        OaiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            None,
            "missing or wrong API key: send `Authorization: Bearer <key>`".into(),
        )
        .code("invalid_api_key")
    })?;
    req.extensions_mut().insert(grant);
    Ok(next.run(req).await)
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
pub(crate) async fn list_models(State(state): State<AppState>) -> Json<ModelList> {
    let created = state.started_unix;
    Json(ModelList {
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
    })
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
        (status = 404, description = "Unknown model (`model_not_found`), or a collection that holds nothing (or is outside the key's reach) when the messages bring no passages", body = OpenAiError),
        (status = 413, description = "Body larger than 4 MiB", body = OpenAiError),
        (status = 429, description = "The engine queue is full; see Retry-After", body = OpenAiError),
        (status = 503, description = "The request bodies being received hold all the bytes the server accepts at once (`--max-body-bytes-in-flight`, default 256 MiB); see Retry-After. A body larger than all of them is answered 413", body = OpenAiError),
        (status = 504, description = "Not finished within the server's deadline", body = OpenAiError),
    ),
    security((), ("bearer" = []))
)]
pub(crate) async fn chat_completions(
    State(state): State<AppState>,
    Extension(RequestId(id)): Extension<RequestId>,
    Extension(grant): Extension<crate::auth::Grant>,
    body: Result<Json<ChatRequest>, JsonRejection>,
) -> Result<Response, OaiError> {
    let Json(req) = body.map_err(|r| {
        if super::error::is_body_timeout(&r) {
            return OaiError::from_api(ApiError::BodyTimeout, &id);
        }
        let status = match r.status() {
            StatusCode::PAYLOAD_TOO_LARGE => StatusCode::PAYLOAD_TOO_LARGE,
            _ => StatusCode::BAD_REQUEST,
        };
        let param = super::error::rejected_field(&r);
        OaiError::new(
            status,
            "invalid_request_error",
            param.as_deref(),
            r.body_text(),
        )
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

#[cfg(test)]
mod tests {
    use super::error::*;
    use super::request::*;
    use super::response::*;
    use super::*;
    use crate::engine::QueryEvent;
    use serde_json::{json, Value};

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

    /// Paragraphs of a passage's size: `chars` characters of words.
    fn paragraph(n: usize, chars: usize) -> String {
        let mut p = format!("Passage {n}:");
        while p.len() < chars {
            p.push_str(" the keeper counts ships");
        }
        p.truncate(chars);
        p
    }

    /// Issue 88: 65 pasted paragraphs of 300 characters were refused with 400 (past 64
    /// passages the whole message became recomputed context, capped at 16 Ki characters). A
    /// retrieval pipeline's 20-100 chunks of 300-2,000 characters are read as passages.
    #[test]
    fn pasted_passages_of_retrieval_sizes_are_read() {
        for (n, chars) in [(65, 300), (64, 1000), (64, 2000), (100, 1000)] {
            let paras: Vec<String> = (0..n).map(|i| paragraph(i, chars)).collect();
            let system = format!("Answer from the context.\n\n{}", paras.join("\n\n"));
            let msgs = [msg("system", json!(system)), msg("user", json!("why?"))];
            let c = conversation(&msgs, true)
                .unwrap_or_else(|e| panic!("{n} x {chars}: {}", e.body.message));
            assert_eq!(c.passages.len(), n, "{n} x {chars}");
            assert_eq!(c.context, "Answer from the context.");
            crate::api::validate_passages("messages", &c.passages).expect("within the limits");
        }
    }

    /// Past what one query reads, the refusal names the message and the real limits.
    #[test]
    fn too_many_pasted_passages_are_refused_naming_the_limit() {
        let max = crate::api::MAX_QUERY_DOCUMENTS;
        let paras: Vec<String> = (0..=max).map(|i| paragraph(i, 300)).collect();
        let half = paras.len() / 2;
        let msgs = [
            msg("system", json!(paras[..half].join("\n\n"))),
            msg(
                "user",
                json!(format!("{}\n\nwhy?", paras[half..].join("\n\n"))),
            ),
        ];
        let e = conversation(&msgs, true).expect_err("over the count");
        assert_eq!(e.body.param.as_deref(), Some("messages[1].content"));
        assert!(
            e.body.message.contains(&format!("at most {max} passages")),
            "{}",
            e.body.message
        );
        // Under the count but over the characters.
        let big: Vec<String> = (0..200).map(|i| paragraph(i, 3000)).collect();
        let msgs = [
            msg("system", json!(big.join("\n\n"))),
            msg("user", json!("q")),
        ];
        let e = conversation(&msgs, true).expect_err("over the characters");
        assert_eq!(e.body.param.as_deref(), Some("messages[0].content"));
        let chars = crate::api::MAX_QUERY_DOCUMENTS_CHARS.to_string();
        assert!(e.body.message.contains(&chars), "{}", e.body.message);
    }

    /// Issue 88: the context's refusal said passages were "not counted" when they were (with
    /// detection off, every paragraph is context).
    #[test]
    fn the_context_refusal_says_whether_passages_were_counted() {
        let long = "x".repeat(MAX_CONTEXT_CHARS + 1);
        let m = [msg("system", json!(long)), msg("user", json!("q"))];
        let off = conversation(&m, false).expect_err("too long").body.message;
        assert!(!off.contains("besides the passages"), "{off}");
        assert!(off.contains("find_passages"), "{off}");
        let shorts = vec!["A short instruction."; 900].join("\n\n");
        let text = format!("{}\n\n{shorts}", paragraph(0, 300));
        let m = [msg("system", json!(text)), msg("user", json!("q"))];
        let on = conversation(&m, true).expect_err("too long").body.message;
        assert!(on.contains("besides the passages found in them"), "{on}");
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
        // Issue 88: an over-long prompt of pasted passages named `specrag.top_k`.
        assert_eq!(openai_param("messages"), "messages");
        assert_eq!(openai_param("max_tokens"), "max_tokens");
    }
}
