//! Chunking of documents by the target model's tokens and BM25 retrieval over a tantivy index,
//! with add, replace and delete of documents per collection.
//!
//! Design choices a reader must know: tokenization is injected ([`TokenCount`]), so this crate
//! never depends on a model or on the engine; each indexed chunk carries an opaque `key` supplied
//! by the caller, pointing at the chunk's precomputed KV in the chunk store, so search results
//! lead straight to reusable caches; and index changes are durable and searchable only after
//! [`Index::commit`], which the caller calls to batch ingestion.

mod chunk;
mod error;
mod index;

pub use chunk::{chunk_document, Chunk, ChunkParams, TokenCount};
pub use error::{Result, RetrieverError};
pub use index::{ChunkRecord, DocSummary, DocumentMeta, Hit, Index, IndexedChunk};
