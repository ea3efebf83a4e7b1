//! Errors of the target engine, sorted into what the caller got wrong and what broke inside.

use std::path::PathBuf;

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model file is missing; the message names the command that fetches the defaults.
    #[error("model file {path} not found; run `specrag models fetch` to download the default models, or pass another GGUF file")]
    ModelNotFound { path: PathBuf },
    /// The GGUF file could not be read or parsed.
    #[error("cannot read GGUF file {path}: {reason}")]
    BadGguf { path: PathBuf, reason: String },
    /// The file is valid GGUF but describes a model this engine does not run.
    #[error("unsupported model in {path}: {reason}")]
    Unsupported { path: PathBuf, reason: String },
    /// A metadata key the engine needs is missing or has the wrong type.
    #[error("GGUF metadata key `{key}` is missing or malformed: {reason}")]
    Metadata { key: String, reason: String },
    /// The tokenizer data in the GGUF file cannot build a tokenizer.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The caller passed arguments that do not fit (token ids, positions, cache rows, a chunk
    /// computed by another model).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// The engine broke one of its own invariants (a worker thread stopped, verification lost
    /// track of its cache): a bug, never the caller's doing.
    #[error("engine fault: {0}")]
    Internal(String),
    /// An error from code the caller handed the engine (a drafter's deferred build), kept
    /// whole so the caller can recover its own type (`downcast_ref`).
    #[error(transparent)]
    Caller(Box<dyn std::error::Error + Send + Sync + 'static>),
    /// A kernel rejected its arguments.
    #[error(transparent)]
    Kernel(#[from] kernels::KernelError),
    /// A candle op failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// The work was stopped by the caller's stop condition (see [`crate::stop`]): a deadline
    /// passed or the client went away.
    #[error("stopped: the request ran past its deadline or was cancelled")]
    Stopped,
    /// I/O while reading the model file.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl EngineError {
    /// True when the error was caused by what the engine's caller supplied (a model file,
    /// arguments that do not fit), as opposed to a failure inside the engine. The gateway, the
    /// engine's caller, validates requests before they reach a model: for it an engine
    /// `InvalidInput` is its own bug (see `gateway::Fault`).
    pub fn is_bad_input(&self) -> bool {
        match self {
            Self::ModelNotFound { .. }
            | Self::BadGguf { .. }
            | Self::Unsupported { .. }
            | Self::Metadata { .. }
            | Self::Tokenizer(_)
            | Self::InvalidInput(_) => true,
            Self::Internal(_)
            | Self::Caller(_)
            | Self::Kernel(_)
            | Self::Candle(_)
            | Self::Stopped
            | Self::Io(_) => false,
        }
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, EngineError>;
