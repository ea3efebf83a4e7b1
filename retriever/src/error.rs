//! The crate's error type.

use std::path::PathBuf;

use thiserror::Error;

/// Result with [`RetrieverError`].
pub type Result<T> = std::result::Result<T, RetrieverError>;

/// Everything that can go wrong in chunking, indexing and search.
#[derive(Debug, Error)]
pub enum RetrieverError {
    /// A document's text has nothing but whitespace.
    #[error("text of document `{doc_id}` is empty or only whitespace; send at least one non-blank character")]
    EmptyText {
        /// Id of the document.
        doc_id: String,
    },
    /// An argument from the caller is out of range or malformed.
    #[error("invalid `{field}`: {reason}")]
    InvalidArgument {
        /// Name of the field or parameter at fault, as the client knows it.
        field: &'static str,
        /// What is wrong and what would be accepted.
        reason: String,
    },
    /// The injected tokenizer broke its contract (see [`crate::TokenCount`]).
    #[error("tokenizer: {reason}")]
    Tokenizer {
        /// What the tokenizer returned.
        reason: String,
    },
    /// The index directory could not be created or opened.
    #[error("index directory `{path}`: {reason}")]
    Directory {
        /// The directory given to [`crate::Index::open`].
        path: PathBuf,
        /// Why it could not be used.
        reason: String,
    },
    /// A stored chunk lacks a field or holds the wrong type: the index was written by
    /// something else or is damaged.
    #[error("index holds a chunk whose stored field `{field}` is missing or not a {expected}")]
    CorruptRecord {
        /// The schema field.
        field: &'static str,
        /// The type the field should hold.
        expected: &'static str,
    },
    /// tantivy failed while doing `action`.
    #[error("index {action}: {source}")]
    Tantivy {
        /// What the index was doing ("commit", "search", ...).
        action: &'static str,
        /// The underlying error.
        #[source]
        source: tantivy::TantivyError,
    },
}

impl RetrieverError {
    /// True when the caller sent something wrong (a 4xx), false for internal faults (a 5xx).
    pub fn is_bad_input(&self) -> bool {
        match self {
            RetrieverError::EmptyText { .. } | RetrieverError::InvalidArgument { .. } => true,
            RetrieverError::Tokenizer { .. }
            | RetrieverError::Directory { .. }
            | RetrieverError::CorruptRecord { .. }
            | RetrieverError::Tantivy { .. } => false,
        }
    }
}

/// Attaches what the index was doing to a tantivy error.
pub(crate) fn tantivy_err(
    action: &'static str,
) -> impl FnOnce(tantivy::TantivyError) -> RetrieverError {
    move |source| RetrieverError::Tantivy { action, source }
}
