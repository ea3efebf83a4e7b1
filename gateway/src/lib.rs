//! The gateway ties specrag together: today the default-model management and the target-engine
//! commands behind the `specrag` binary; the RAG pipeline, HTTP API (axum, utoipa) and
//! ingestion arrive with issues 5 and 6.
//!
//! The one design choice a reader must know: model math lives in `target-engine`; this crate
//! only finds files, validates what users type and reports results.

pub mod api;
pub mod bench;
pub mod client;
pub mod corpus;
pub mod engine;
pub mod error;
pub mod ingest;
pub mod input;
pub mod method;
pub mod metrics;
pub mod models;
pub mod overlap;
pub mod pipeline;
pub mod process;
pub mod server;

pub use error::{GatewayError, Result};
