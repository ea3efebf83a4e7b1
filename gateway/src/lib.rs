//! The gateway ties specrag together: the query pipeline (retrieve, load chunk KV, select,
//! blend, decode or verify), ingestion, the HTTP API (axum, utoipa) and the engine thread
//! behind it, the one `Method` type, and where the default models live. The `specrag` binary
//! (`src/bin/specrag/`) adds the command line and the model fetcher, none of which a server
//! needs; the measurements are eval's `specrag-bench`.
//!
//! The one design choice a reader must know: model math lives in `target-engine`; this crate
//! only finds files, validates what users type and reports results.

pub mod admission;
pub mod answer;
pub mod api;
pub mod auth;
pub mod cli;
pub mod client;
pub mod corpus;
pub mod demo;
pub mod doclog;
pub mod engine;
pub mod error;
pub mod fidelity;
pub mod http;
pub mod ingest;
pub mod input;
pub mod kvmode;
pub mod method;
pub mod metrics;
pub mod models;
pub mod passages;
pub mod pipeline;
pub mod process;
pub mod replication;
pub mod target;

pub use error::{Fault, GatewayError, Result};
