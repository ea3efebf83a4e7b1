//! Errors of the kernel layer: shape mismatches a caller can cause.

/// A kernel was called with arguments that do not fit together.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// Two arguments disagree on a dimension.
    #[error("shape mismatch in {op}: {detail}")]
    Shape { op: &'static str, detail: String },
    /// The CPU cannot run what was asked for.
    #[error("{0}")]
    Unsupported(String),
    /// A candle op failed inside a reference implementation.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, KernelError>;

pub(crate) fn shape_err(op: &'static str, detail: impl Into<String>) -> KernelError {
    KernelError::Shape {
        op,
        detail: detail.into(),
    }
}
