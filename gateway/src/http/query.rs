//! `POST /rag/query`, and the steps every query route shares: reach, check, submit with a
//! deadline, and wait for the answer.

use super::error::{engine_dropped, error_event, ApiError, RequestId};
use super::middleware::{reach, submit};
use super::state::AppState;
use crate::api::{Problem, QueryRequest};
use crate::auth::Grant;
use crate::engine::{Job, QueryEvent};
use crate::pipeline::Answer;
use axum::extract::rejection::JsonRejection;
use axum::extract::{Extension, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use std::convert::Infallible;
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;

/// One server-sent event of a streamed answer.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(crate) struct SseEvent {
    /// `token`, `draft`, `commit`, `retract`, `replace`, `done` or `error`.
    event: String,
    /// JSON: `{"text"}` for `token`, the answer object for `done`, a problem for `error`.
    data: String,
}

/// Answer a question over a collection.
#[utoipa::path(
    post,
    path = "/rag/query",
    tag = "query",
    request_body = QueryRequest,
    responses(
        (status = 200, description = "The answer with its chunks, timings and reuse statistics. With `\"stream\": true`: server-sent events, `token` events carrying `{\"text\"}` pieces, then one `done` event carrying this object (or one `error` event carrying a problem). With `\"verify\": true` (greedy) the pieces come as `draft` (`{\"text\"}`, not final), `commit` (`{\"text\"}`, final) and `retract` (`{\"tokens\": n}`: the last n `draft` events are withdrawn) events; the committed text is the full-recompute answer. When the fidelity guard moves an answer to the full cache and withdraws streamed text, a `replace` event (`{\"text\"}`) carries the answer so far, which replaces what was streamed, and `token` events continue from it. Applied in order, the events leave exactly the `done` event's `answer`.",
            content((Answer = "application/json"), (SseEvent = "text/event-stream"))),
        (status = 400, description = "The body is not JSON of this shape; `field` names the field by its path where one is to blame (a value of the wrong type, an unknown or repeated field)", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "Missing or wrong API key", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "The collection holds nothing (or is outside the key's reach) and the request sends no passages of its own", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body larger than 4 MiB", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "The body is not sent as application/json", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "A field is out of range; `field` names it", body = Problem, content_type = "application/problem+json",
            example = json!({"type": "about:blank", "title": "Unprocessable Entity", "status": 422, "detail": "invalid `top_k`: must be 1 to 256, got 0", "field": "top_k"})),
        (status = 429, description = "The engine queue is full; see Retry-After", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The request bodies being received hold all the bytes the server accepts at once (`--max-body-bytes-in-flight`, default 256 MiB); see Retry-After. A body larger than all of them is answered 413", body = Problem, content_type = "application/problem+json"),
        (status = 504, description = "Not finished within the server's deadline", body = Problem, content_type = "application/problem+json"),
    ),
    security((), ("bearer" = []))
)]
pub(crate) async fn rag_query(
    State(state): State<AppState>,
    Extension(grant): Extension<Grant>,
    Extension(RequestId(id)): Extension<RequestId>,
    body: Result<Json<QueryRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(req) = body?;
    let query = req.validate_with(state.config.request_defaults())?;
    let submitted = submit_query(&state, &grant, query)?;
    if req.stream.unwrap_or(false) {
        let stream = tokio_stream::wrappers::ReceiverStream::new(submitted.rx).map(move |e| {
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
    Ok(Json::<Answer>(*await_answer(submitted).await?).into_response())
}

/// A query handed to the engine: its events, and when it is due.
pub(crate) struct Submitted {
    pub(crate) rx: tokio::sync::mpsc::Receiver<QueryEvent>,
    pub(crate) deadline: Instant,
}

/// The steps every query route takes before it waits: the collection within the key's reach,
/// a deadline, an event channel with room for every token of the longest answer (so a client
/// that stops reading can never block the engine thread), and the job queued where the
/// loaded models can serve the query
/// ([`EngineHandle::submit`](crate::engine::EngineHandle::submit) checks it).
pub(crate) fn submit_query(
    state: &AppState,
    grant: &Grant,
    query: crate::pipeline::Query,
) -> Result<Submitted, ApiError> {
    reach(grant, &query.collection)?;
    let deadline = Instant::now() + state.config.request_timeout;
    let (tx, rx) = tokio::sync::mpsc::channel(crate::api::MAX_TOKENS as usize + 8);
    submit(
        state,
        Job::Query {
            query,
            deadline,
            events: tx,
        },
    )?;
    Ok(Submitted { rx, deadline })
}

/// The finished answer of a submitted query, streamed pieces skipped; 504 a second after the
/// deadline, and a worker that went away is an internal error.
pub(crate) async fn await_answer(mut s: Submitted) -> Result<Box<Answer>, ApiError> {
    let until = tokio::time::Instant::from_std(s.deadline + Duration::from_secs(1));
    loop {
        match tokio::time::timeout_at(until, s.rx.recv()).await {
            Err(_) => return Err(ApiError::Deadline),
            Ok(None) => return Err(engine_dropped()),
            Ok(Some(QueryEvent::Done(a))) => return Ok(a),
            Ok(Some(QueryEvent::Failed(e))) => return Err(e.into()),
            Ok(Some(
                QueryEvent::Text(_)
                | QueryEvent::Draft(_)
                | QueryEvent::Commit(_)
                | QueryEvent::Retract(_)
                | QueryEvent::Replace(_),
            )) => {}
        }
    }
}
