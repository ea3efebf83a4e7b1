//! Storage of precomputed chunk KV caches: the blob format, an in-memory tier (weighted by
//! payload bytes) over an on-disk tier (one checksummed file per chunk), and hit/miss statistics.
//!
//! A chunk's cache is addressed by a [`ChunkKey`], the sha256 of everything that determines it
//! (model, collection, precompute mode, token ids, format), and stored as a [`KvBlob`] behind the
//! [`ChunkStore`] trait: [`MemoryStore`], [`DiskStore`] or the [`TieredStore`] of both.
//!
//! The design choice a reader must know: stored blobs are versioned and checksummed
//! ([`encode`]/[`decode`]), and a blob that fails to decode for any reason (damaged, truncated,
//! foreign, written by another format version) is deleted and reported absent, so the caller
//! recomputes it. A bad cache is never served.
//!
//! This crate knows nothing of models, tantivy or HTTP; the gateway converts the engine's chunk
//! caches to and from [`KvBlob`].

pub mod blob;
pub mod budget;
pub mod codec;
pub mod disk;
pub mod error;
pub mod format;
pub mod key;
pub mod memory;
pub mod predictive;
pub mod remote;
pub mod shares;
pub mod stats;
pub mod store;
pub mod tiered;
pub mod version;

pub use blob::{KvBlob, SpecScores};
pub use budget::{BudgetConfig, DiskBudget, Eviction};
pub use codec::Codec;
pub use disk::{BlobWriter, DiskStore, FsWriter};
pub use error::{FormatError, Result, StoreError};
pub use format::{decode, encode, encode_with, FORMAT_VERSION};
pub use key::{ChunkKey, KeyError};
pub use memory::MemoryStore;
pub use remote::{RemoteStats, RemoteStore};
pub use stats::StoreStats;
pub use store::ChunkStore;
pub use tiered::{Found, Reach, TieredStore};
