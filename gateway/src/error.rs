//! The gateway's error type. Errors are sorted into "the caller sent something wrong" and
//! "something inside failed" once, here, so the CLI and the HTTP API map them the same way.

use thiserror::Error;

/// Result with [`GatewayError`].
pub type Result<T> = std::result::Result<T, GatewayError>;

/// Everything the pipeline, ingestion and the store glue can fail with.
#[derive(Debug, Error)]
pub enum GatewayError {
    /// A request field or argument is invalid; the message names the field.
    #[error("invalid `{field}`: {message}")]
    BadInput {
        field: &'static str,
        message: String,
    },
    /// A request is over a size limit (HTTP 413); the message names the limit and its flag.
    #[error("`{field}` is too large: {message}")]
    TooLarge {
        field: &'static str,
        message: String,
    },
    /// A named thing does not exist (a document, a collection).
    #[error("{0}")]
    NotFound(String),
    /// A fault inside the server (a panicked worker, a stopped engine).
    #[error("internal error: {0}")]
    Internal(String),
    #[error(transparent)]
    Engine(#[from] target_engine::EngineError),
    #[error(transparent)]
    Store(#[from] chunkstore::StoreError),
    #[error(transparent)]
    Retriever(#[from] retriever::RetrieverError),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl GatewayError {
    /// A bad-input error for `field`.
    pub fn bad(field: &'static str, message: impl Into<String>) -> Self {
        Self::BadInput {
            field,
            message: message.into(),
        }
    }

    /// True when the caller is at fault (HTTP 4xx), false for internal faults (5xx). Engine
    /// errors are internal: requests are validated before they reach a model.
    pub fn is_bad_input(&self) -> bool {
        match self {
            Self::BadInput { .. } | Self::TooLarge { .. } | Self::NotFound(_) => true,
            Self::Retriever(e) => e.is_bad_input(),
            Self::Internal(_) | Self::Engine(_) | Self::Store(_) | Self::Io { .. } => false,
        }
    }
}
