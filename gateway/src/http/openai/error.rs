//! OpenAI's error shape (`error.message`, `type`, `param`, `code`) for every failure.

use crate::error::Fault;
use crate::http::error::ApiError;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use serde_json::{json, Value};

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
    pub(super) status: StatusCode,
    pub(super) body: OpenAiErrorBody,
}

impl OaiError {
    pub(crate) fn new(
        status: StatusCode,
        kind: &str,
        param: Option<&str>,
        message: String,
    ) -> Self {
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

    pub(super) fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some(param),
            message.into(),
        )
    }

    pub(super) fn code(mut self, code: &str) -> Self {
        self.body.code = Some(code.into());
        self
    }

    /// The same failure as `/rag/query` would report, in OpenAI's shape; a bad field of the
    /// RAG options is named under `specrag.`, the question under `messages`.
    pub(super) fn from_api(e: ApiError, request_id: &str) -> Self {
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
            StatusCode::SERVICE_UNAVAILABLE => (status, "server_error"),
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

    pub(super) fn json(&self) -> Value {
        json!({ "error": self.body })
    }
}

/// Where a `/rag/query` field lives in a chat request.
pub(super) fn openai_param(field: &str) -> String {
    match field {
        "query" | "messages" => "messages".into(),
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
        if matches!(
            self.status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        ) && !r.headers().contains_key(header::RETRY_AFTER)
        {
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

/// An error answered in its route's shape: OpenAI's under `/v1/` (`kind` its `type`), a
/// problem elsewhere.
pub(crate) fn in_route_shape(
    path: &str,
    status: StatusCode,
    kind: &str,
    message: String,
) -> Response {
    if path.starts_with("/v1/") {
        OaiError::new(status, kind, None, message).into_response()
    } else {
        ApiError::Body(status, message).into_response()
    }
}
