//! The gateway ties specrag together: the query pipeline (retrieve, load chunk KV, select,
//! blend, decode or verify), ingestion, the HTTP API (axum, utoipa) and the engine thread
//! behind it, the one `Method` type, and the default-model management of the `specrag` binary.
//!
//! The one design choice a reader must know: model math lives in `target-engine`; this crate
//! only finds files, validates what users type and reports results.

pub mod api;
pub mod auth;
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
