//! What runs around every handler: the request id and the request log (`observe`), the
//! bearer-key check, a collection's reach, and handing a job to the engine.

use super::error::{problem_response, ApiError, InternalDetail, RequestId};
use super::state::AppState;
use crate::auth::Grant;
use crate::engine::{Job, SubmitError};
use crate::error::GatewayError;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use std::time::Instant;

/// Request id (taken from `x-request-id` when sane, else made up), echoed in the response and
/// logged with route, status and latency; counts requests by route and status.
pub(crate) async fn observe(State(state): State<AppState>, req: Request, next: Next) -> Response {
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
pub(crate) async fn require_key(
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
        if matches!(e, SubmitError::Busy) {
            state.metrics.busy();
        }
        ApiError::from(e)
    })
}
