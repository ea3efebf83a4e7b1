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
    /// The request does not fit the server's capacity now (its KV over the memory budget);
    /// HTTP 503 with `Retry-After`.
    #[error("{0}")]
    OverCapacity(String),
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
    /// What failed while one document was being ingested, and which document (its file, or
    /// `file:line`).
    #[error("while ingesting {origin}: {source}")]
    InDocument {
        origin: String,
        #[source]
        source: Box<GatewayError>,
    },
}

impl GatewayError {
    /// This error, said to have happened while ingesting the document from `origin`.
    pub fn in_document(self, origin: &str) -> Self {
        Self::InDocument {
            origin: origin.to_string(),
            source: Box::new(self),
        }
    }

    /// A bad-input error for `field`.
    pub fn bad(field: &'static str, message: impl Into<String>) -> Self {
        Self::BadInput {
            field,
            message: message.into(),
        }
    }

    /// Whose fault this is, and the request field at fault where there is one: the one
    /// classification the HTTP API (status and `field`) and the CLI (exit code) answer from.
    /// Exhaustive over every variant below this crate too, so a new variant must be placed.
    pub fn fault(&self) -> Fault {
        use retriever::RetrieverError as R;
        match self {
            Self::BadInput { field, .. } => Fault::BadInput(Some(field)),
            Self::TooLarge { field, .. } => Fault::TooLarge(field),
            Self::NotFound(_) => Fault::NotFound,
            Self::OverCapacity(_) => Fault::Unavailable,
            Self::Retriever(e) => match e {
                R::EmptyText { .. } => Fault::BadInput(Some("documents[].text")),
                R::InvalidArgument { field, .. } => Fault::BadInput(Some(field)),
                R::Tokenizer { .. }
                | R::Directory { .. }
                | R::CorruptRecord { .. }
                | R::Tantivy { .. } => Fault::Internal,
            },
            Self::Engine(e) => Fault::of_engine(e),
            Self::Internal(_) | Self::Store(_) | Self::Io { .. } => Fault::Internal,
            Self::InDocument { source, .. } => source.fault(),
        }
    }

    /// True when the caller is at fault (HTTP 4xx), false for internal faults (5xx).
    pub fn is_bad_input(&self) -> bool {
        self.fault() != Fault::Internal
    }
}

/// Whose fault an error is ([`GatewayError::fault`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The caller sent something wrong (HTTP 422), naming the field where it can.
    BadInput(Option<&'static str>),
    /// The caller sent something over a size limit (HTTP 413).
    TooLarge(&'static str),
    /// A named thing does not exist (HTTP 404).
    NotFound,
    /// The server cannot take the request now (HTTP 503, `Retry-After`).
    Unavailable,
    /// Something inside failed (HTTP 500); the caller can do nothing about it.
    Internal,
}

impl Fault {
    /// An engine error as the gateway sees it: a model file the operator named (CLI) is the
    /// caller's fault; arguments the engine refuses are the gateway's own bug, since it
    /// validates requests before any model runs.
    pub fn of_engine(e: &target_engine::EngineError) -> Self {
        use target_engine::EngineError as E;
        match e {
            E::ModelNotFound { .. }
            | E::BadGguf { .. }
            | E::Unsupported { .. }
            | E::Metadata { .. }
            | E::Tokenizer(_) => Fault::BadInput(None),
            // The gateway's own error, carried through a callback it handed the engine.
            E::Caller(inner) => match inner.downcast_ref::<GatewayError>() {
                Some(g) => g.fault(),
                None => Fault::Internal,
            },
            E::InvalidInput(_)
            | E::Internal(_)
            | E::Kernel(_)
            | E::Candle(_)
            | E::Stopped
            | E::Io(_) => Fault::Internal,
        }
    }

    /// The classification of the first gateway or engine error in `e`'s chain (`Internal`
    /// when there is none): what the CLI's exit code follows.
    pub fn of_chain(e: &(dyn std::error::Error + 'static)) -> Self {
        let mut next = Some(e);
        while let Some(err) = next {
            if let Some(g) = err.downcast_ref::<GatewayError>() {
                return g.fault();
            }
            if let Some(en) = err.downcast_ref::<target_engine::EngineError>() {
                return Fault::of_engine(en);
            }
            next = err.source();
        }
        Fault::Internal
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use retriever::RetrieverError;
    use target_engine::EngineError;

    #[test]
    fn every_bad_input_error_names_its_field_and_engine_refusals_are_ours() {
        let retriever = GatewayError::from(RetrieverError::InvalidArgument {
            field: "top_k",
            reason: "must be 1 to 64".into(),
        });
        assert_eq!(retriever.fault(), Fault::BadInput(Some("top_k")));
        let empty = GatewayError::from(RetrieverError::EmptyText { doc_id: "d".into() });
        assert_eq!(empty.fault(), Fault::BadInput(Some("documents[].text")));
        assert_eq!(
            GatewayError::bad("query", "x").fault(),
            Fault::BadInput(Some("query"))
        );
        // The engine's caller is the gateway, which validated the request first.
        let refused = GatewayError::from(EngineError::InvalidInput("no token ids".into()));
        assert!(EngineError::InvalidInput(String::new()).is_bad_input());
        assert_eq!(refused.fault(), Fault::Internal);
        let bug = EngineError::Internal("lost track".into());
        assert!(!bug.is_bad_input());
        assert_eq!(GatewayError::from(bug).fault(), Fault::Internal);
        let missing = EngineError::ModelNotFound {
            path: "m.gguf".into(),
        };
        assert_eq!(GatewayError::from(missing).fault(), Fault::BadInput(None));
        // A gateway error that crossed the engine through a callback keeps its type.
        let carried = EngineError::Caller(Box::new(GatewayError::NotFound("collection".into())));
        assert!(!carried.is_bad_input());
        assert_eq!(carried.to_string(), "collection");
        assert_eq!(GatewayError::from(carried).fault(), Fault::NotFound);
        let foreign = EngineError::Caller("a speculator fault".into());
        assert_eq!(GatewayError::from(foreign).fault(), Fault::Internal);
    }

    #[test]
    fn the_chain_is_searched_through_context() {
        let e = anyhow::Error::from(EngineError::ModelNotFound {
            path: "m.gguf".into(),
        })
        .context("loading the target")
        .context("opening the pipeline");
        assert_eq!(Fault::of_chain(e.as_ref()), Fault::BadInput(None));
        let e = anyhow::anyhow!("plain");
        assert_eq!(Fault::of_chain(e.as_ref()), Fault::Internal);
        let e = anyhow::Error::from(GatewayError::bad("id", "x")).context("ingest");
        assert_eq!(Fault::of_chain(e.as_ref()), Fault::BadInput(Some("id")));
    }
}
