//! Limits every request meets before a handler sees it: the size of its target and headers,
//! %-encoding of its path, a deadline for its body, and its share of the body bytes in flight
//! across connections ([`super::body_budget`]).
//!
//! hyper refuses what it cannot parse with a bare status and no body. Our own limits sit below
//! hyper's (which are raised in `serve_on`), so every request of ordinary shape that is too
//! big is answered here, as a problem, and logged like any other response.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body::{Frame, SizeHint};

use super::body_budget::{Charge, ChargedBody, Refusal};
use super::error::{ApiError, BodyTimeout};
use super::state::{AppState, DOCUMENTS_BODY_LIMIT, OPENAI_BODY_LIMIT, QUERY_BODY_LIMIT};

/// Longest request target (path and query) answered; longer gets 414.
pub const MAX_URI_BYTES: usize = 8 * 1024;
/// Most request headers answered; more gets 431.
pub const MAX_HEADERS: usize = 100;
/// Most bytes of header names and values together; more gets 431.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
/// hyper's own header count limit, above ours so that ours answers first.
pub const HYPER_MAX_HEADERS: usize = 4 * MAX_HEADERS;

/// A request body that fails with [`BodyTimeout`] once its deadline passes before its end,
/// however slowly or steadily it trickles in.
struct DeadlineBody {
    inner: Body,
    sleep: Pin<Box<tokio::time::Sleep>>,
    timeout: Duration,
    expired: bool,
}

impl http_body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        if self.expired {
            return Poll::Ready(None);
        }
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame);
        }
        if self.sleep.as_mut().poll(cx).is_ready() {
            self.expired = true;
            let timeout = self.timeout;
            return Poll::Ready(Some(Err(axum::Error::new(BodyTimeout(timeout)))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.expired || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Refuses requests over the target/header limits or with a path that is not valid
/// %-encoding (each a problem naming the limit), puts the body under the deadline
/// `--body-timeout-secs`, and charges it to the body bytes in flight
/// (`--max-body-bytes-in-flight`: 503 when it does not fit beside the others).
pub async fn limits(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let uri_len = req
        .uri()
        .path_and_query()
        .map_or(req.uri().path().len(), |pq| pq.as_str().len());
    if uri_len > MAX_URI_BYTES {
        return ApiError::Body(
            StatusCode::URI_TOO_LONG,
            format!("the request target is {uri_len} bytes; at most {MAX_URI_BYTES} are accepted"),
        )
        .into_response();
    }
    let headers = req.headers();
    let header_bytes: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    if headers.len() > MAX_HEADERS || header_bytes > MAX_HEADER_BYTES {
        return ApiError::Body(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            format!(
                "{} headers of {header_bytes} bytes; at most {MAX_HEADERS} headers of \
                 {MAX_HEADER_BYTES} bytes together are accepted",
                headers.len()
            ),
        )
        .into_response();
    }
    if let Some(bad) = bad_percent_escape(req.uri().path()) {
        return ApiError::Body(
            StatusCode::BAD_REQUEST,
            format!(
                "the path is not valid %-encoding: `{bad}` is not `%` followed by two hex digits"
            ),
        )
        .into_response();
    }
    let path = req.uri().path().to_string();
    let route_limit = route_body_limit(&path);
    let declared = declared_length(&req);
    if let Some(refused) = declared_too_large(&path, route_limit, declared) {
        return refused;
    }
    let charge = Arc::new(Charge::new(state.body_budget.clone()));
    // A body the handler will read is charged all its announced bytes before any is read, so
    // that a client announcing much and sending slowly cannot pass the budget.
    if req.method() == Method::POST && route_limit.is_some() {
        let announced = declared.map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX));
        if let Err(refusal) = charge.raise_to(announced) {
            return over_budget(&state, &path, refusal);
        }
    }
    let timeout = state.config.body_timeout;
    let body_charge = charge.clone();
    let req = req.map(|inner| {
        Body::new(DeadlineBody {
            inner: Body::new(ChargedBody::new(inner, body_charge, route_limit)),
            sleep: Box::pin(tokio::time::sleep(timeout)),
            timeout,
            expired: false,
        })
    });
    let response = next.run(req).await;
    // The handler answered a body refused mid-way as unreadable; say why instead.
    match charge.refusal() {
        Some(refusal) => over_budget(&state, &path, refusal),
        None => response,
    }
    // `charge` drops here: the body, and what the handler parsed from it, are gone.
}

/// The body limit of a route that reads its body.
fn route_body_limit(path: &str) -> Option<usize> {
    match path {
        "/rag/query" => Some(QUERY_BODY_LIMIT),
        "/v1/chat/completions" => Some(OPENAI_BODY_LIMIT),
        "/documents" => Some(DOCUMENTS_BODY_LIMIT),
        _ => None,
    }
}

/// The body length a request announces (`Content-Length`), when it says one.
fn declared_length(req: &Request) -> Option<u64> {
    req.headers()
        .get(axum::http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// A 413 at once for a body whose `Content-Length` already passes its route's limit, so that
/// a client announcing too much neither waits for the body deadline nor holds the connection
/// while it sends (the limit also holds on the bytes themselves, for bodies of unknown length).
fn declared_too_large(
    path: &str,
    route_limit: Option<usize>,
    declared: Option<u64>,
) -> Option<Response> {
    let limit = route_limit?;
    let declared = declared?;
    if declared <= limit as u64 {
        return None;
    }
    let message = format!(
        "the request body is {declared} bytes (Content-Length); at most {limit} are accepted \
         on {path}"
    );
    let status = StatusCode::PAYLOAD_TOO_LARGE;
    Some(closing(super::openai::in_route_shape(
        path,
        status,
        "invalid_request_error",
        message,
    )))
}

/// A body the budget of body bytes in flight refused, in its route's shape: 503 with
/// `Retry-After` while other bodies hold the budget, 413 for a body larger than all of it.
fn over_budget(state: &AppState, path: &str, refusal: Refusal) -> Response {
    state.metrics.body_budget_refused();
    let (status, kind, message) = match refusal {
        Refusal::Full { capacity } => (
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            format!(
                "the request bodies being received hold all {capacity} bytes the server \
                 accepts at once (--max-body-bytes-in-flight); retry after the time in \
                 Retry-After"
            ),
        ),
        Refusal::TooLarge { size, capacity } => (
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!(
                "the request body is {size} bytes or more; the server holds at most {capacity} \
                 bytes of request bodies at once (--max-body-bytes-in-flight), so it is never \
                 accepted"
            ),
        ),
    };
    let mut r = super::openai::in_route_shape(path, status, kind, message);
    if status == StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut().insert(
            axum::http::header::RETRY_AFTER,
            axum::http::HeaderValue::from_static("1"),
        );
    }
    closing(r)
}

/// `r` with `Connection: close`: the rest of the body is never read, so this connection is done.
fn closing(mut r: Response) -> Response {
    r.headers_mut().insert(
        axum::http::header::CONNECTION,
        axum::http::HeaderValue::from_static("close"),
    );
    r
}

/// The first `%` escape of `path` that is not `%` and two hex digits (shown with what
/// follows it, at most two characters).
fn bad_percent_escape(path: &str) -> Option<String> {
    let bytes = path.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let ok = bytes.len() >= i + 3
                && bytes[i + 1].is_ascii_hexdigit()
                && bytes[i + 2].is_ascii_hexdigit();
            if !ok {
                let end = (i + 3).min(bytes.len());
                return Some(String::from_utf8_lossy(&bytes[i..end]).into_owned());
            }
            i += 3;
        } else {
            i += 1;
        }
    }
    None
}

/// The status hyper answered a connection it could not parse a request from (it writes the
/// status line with no body and closes): for the request log.
pub fn hyper_status(e: &(dyn std::error::Error + 'static)) -> Option<u16> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(h) = err.downcast_ref::<hyper::Error>() {
            if h.is_parse_too_large() {
                return Some(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE.as_u16());
            }
            if h.is_parse() {
                // hyper's only other parse statuses: 414 for a target over 64 KiB, else 400.
                let uri = h.to_string().to_ascii_lowercase().contains("uri");
                return Some(if uri { 414 } else { 400 });
            }
            if h.is_timeout() {
                return Some(StatusCode::REQUEST_TIMEOUT.as_u16());
            }
            return None;
        }
        cur = err.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::super::error::is_body_timeout;
    use super::*;

    #[test]
    fn malformed_percent_escapes_are_found() {
        for good in ["/documents/a%20b", "/documents/%FF", "/x", "/a%2fb%2F"] {
            assert_eq!(bad_percent_escape(good), None, "{good}");
        }
        for (bad, shown) in [
            ("/documents/%ZZ", "%ZZ"),
            ("/documents/a%2", "%2"),
            ("/documents/%", "%"),
            ("/d/%g1", "%g1"),
        ] {
            assert_eq!(bad_percent_escape(bad).as_deref(), Some(shown), "{bad}");
        }
    }

    #[test]
    fn a_timeout_is_found_below_other_errors() {
        let inner = axum::Error::new(BodyTimeout(Duration::from_secs(1)));
        assert!(is_body_timeout(&inner));
        let other = axum::Error::new(std::io::Error::other("reset"));
        assert!(!is_body_timeout(&other));
    }
}
