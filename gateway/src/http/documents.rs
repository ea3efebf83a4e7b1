//! The document routes: `POST /documents` (plain or NDJSON progress), `GET /documents` and
//! `DELETE /documents/{id}`.

use super::error::{engine_dropped, error_event, ApiError, RequestId};
use super::middleware::{reach, submit};
use super::state::AppState;
use crate::api::{
    validate_collection, Deleted, DocumentInfo, DocumentList, DocumentsRequest, IngestResponse,
    Problem,
};
use crate::auth::Grant;
use crate::engine::{IngestProgress, Job, JobError};
use crate::error::GatewayError;
use crate::input::InputProblem;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{Extension, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use std::convert::Infallible;

/// One line of a streamed `POST /documents` answer (`Accept: application/x-ndjson`); a
/// `summary` line carries the route's answer fields, an `error` line a problem's.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub(crate) struct IngestLine {
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
        (status = 503, description = "The request bodies being received hold all the bytes the server accepts at once (`--max-body-bytes-in-flight`, default 256 MiB); see Retry-After. A body larger than all of them is answered 413", body = Problem, content_type = "application/problem+json"),
    ),
    security((), ("bearer" = []))
)]
pub(crate) async fn post_documents(
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

pub(crate) type IngestReply = Result<(crate::ingest::IngestReport, Vec<InputProblem>), JobError>;

/// Writes an ingestion's progress and its end as JSON lines into `lines`. Returns early when
/// the client is gone, dropping the receivers, which stops the ingestion at its next chunk.
pub(crate) async fn stream_ingest(
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

pub(crate) fn ingest_response(
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
pub(crate) struct CollectionParam {
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
pub(crate) async fn list_documents(
    State(state): State<AppState>,
    Extension(grant): Extension<Grant>,
    q: Result<Query<CollectionParam>, QueryRejection>,
) -> Result<Json<DocumentList>, ApiError> {
    let Query(q) = q?;
    if let Some(c) = &q.collection {
        validate_collection("collection", c)?;
        reach(&grant, c)?;
    }
    // A key that reaches some collections lists those, each read alone (never the others').
    let scope: Vec<Option<String>> = match (q.collection, grant.collections()) {
        (Some(c), _) => vec![Some(c)],
        (None, None) => vec![None],
        (None, Some(reach)) => {
            let mut names = reach.to_vec();
            names.sort();
            names.dedup();
            names.into_iter().map(Some).collect()
        }
    };
    let pipeline = state.pipeline.clone();
    let docs = tokio::task::spawn_blocking(move || {
        let index = &pipeline.corpus.index;
        let mut docs = Vec::new();
        for c in &scope {
            docs.extend(index.documents(c.as_deref())?);
        }
        Ok::<_, retriever::RetrieverError>(docs)
    })
    .await
    .map_err(|_| engine_dropped())?
    .map_err(GatewayError::from)?;
    Ok(Json(DocumentList {
        documents: docs
            .into_iter()
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
pub(crate) async fn delete_document(
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
    if let Some(why) = crate::api::doc_id_problem(&id) {
        return Err(GatewayError::bad("id", why).into());
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    submit(
        &state,
        Job::Delete {
            collection: collection.clone(),
            id: id.clone(),
            applying: None,
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
