//! Errors answered as `application/problem+json`: one mapping from [`GatewayError`] and the
//! engine's errors to HTTP, and the request id an internal error's answer carries.

use crate::api::Problem;
use crate::engine::{JobError, SubmitError};
use crate::error::{Fault, GatewayError};
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// An error answered as `application/problem+json`.
#[derive(Debug)]
pub enum ApiError {
    Gateway(GatewayError),
    /// The body is not what the route expects (its target, headers or encoding).
    Body(StatusCode, String),
    /// The body is not the JSON the route expects; the field, where one is to blame (its
    /// path, e.g. `top_k` or `documents[2].text`).
    Json(StatusCode, String, Option<String>),
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
            SubmitError::Refused(e) => Self::Gateway(e),
        }
    }
}

/// A worker (the engine thread or a blocking task) went away without answering: it panicked.
pub(crate) fn engine_dropped() -> ApiError {
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
        if is_body_timeout(&r) {
            return Self::BodyTimeout;
        }
        let status = match r.status() {
            StatusCode::PAYLOAD_TOO_LARGE => StatusCode::PAYLOAD_TOO_LARGE,
            StatusCode::UNSUPPORTED_MEDIA_TYPE => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            _ => StatusCode::BAD_REQUEST,
        };
        Self::Json(status, r.body_text(), rejected_field(&r))
    }
}

/// The field a JSON body was refused for: the path where a value had the wrong type or range
/// (`top_k`, `specrag.top_k`, `messages[0].content`), or the name of an unknown or repeated
/// field; `None` for a body that is not JSON at all.
pub(crate) fn rejected_field(r: &JsonRejection) -> Option<String> {
    let JsonRejection::JsonDataError(e) = r else {
        return None;
    };
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        if let Some(p) = inner.downcast_ref::<serde_path_to_error::Error<serde_json::Error>>() {
            let path = p.path().to_string();
            // At the top level the path is `.`: the message may still name the field.
            return if path == "." {
                named_field(&p.inner().to_string())
            } else {
                Some(path)
            };
        }
        src = inner.source();
    }
    None
}

/// The field serde's message `m` names as unknown or given twice.
fn named_field(m: &str) -> Option<String> {
    ["unknown field `", "duplicate field `"]
        .iter()
        .find_map(|pre| {
            let rest = m.split_once(pre)?.1;
            Some(rest.split_once('`')?.0.to_string())
        })
}

/// A query string refused: its problem's `field` names the parameter where serde does.
impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> Self {
        let text = r.body_text();
        let field = named_field(&text);
        Self::Json(StatusCode::BAD_REQUEST, text, field)
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
                    Fault::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, None),
                    Fault::Internal => (StatusCode::INTERNAL_SERVER_ERROR, None),
                };
                (status, self.detail(), field.map(str::to_string))
            }
            Self::Body(s, m) => (*s, m.clone(), None),
            Self::Json(s, m, f) => (*s, m.clone(), f.clone()),
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

pub(crate) fn problem_response(status: StatusCode, p: &Problem) -> Response {
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
pub(crate) struct InternalDetail(pub(crate) String);

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
        if status == StatusCode::SERVICE_UNAVAILABLE
            && !r.headers().contains_key(header::RETRY_AFTER)
        {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
        }
        r
    }
}

/// A problem as a stream's `error` event; an internal one carries only the request id.
pub(crate) fn error_event(e: ApiError, request_id: &str) -> serde_json::Value {
    let (status, mut p) = e.problem();
    if status == StatusCode::INTERNAL_SERVER_ERROR {
        tracing::error!(request_id = %request_id, detail = %p.detail, "request failed");
        p.detail = format!("internal error; quote request id {request_id} to the operator");
    }
    let mut v = serde_json::to_value(&p).unwrap_or_default();
    v["event"] = serde_json::json!("error");
    v
}

/// The request body did not arrive within the server's body timeout.
#[derive(Debug, thiserror::Error)]
#[error("the request body was not received within {0:?}")]
pub struct BodyTimeout(pub std::time::Duration);

/// Whether `e` or an error below it is a [`BodyTimeout`].
pub fn is_body_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.is::<BodyTimeout>() {
            return true;
        }
        cur = err.source();
    }
    false
}
