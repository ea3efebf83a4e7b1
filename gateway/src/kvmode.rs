//! When ingestion computes chunk KV: one name for the API, the command line, ingestion and
//! the document log (which must carry it, or followers would precompute what the ingesting
//! node deferred).

/// When ingestion computes chunk KV.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    clap::ValueEnum,
    serde::Deserialize,
    serde::Serialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum KvMode {
    /// Precompute every chunk's KV now (pinned: kept while the chunk is indexed).
    #[default]
    Eager,
    /// Index the text only; a chunk's KV is computed the first time a query reads it and kept
    /// under the disk budget (`--kv-disk-budget`).
    Lazy,
}
