//! Errors of the chunk store: bytes that are not a valid KV blob ([`FormatError`]), and failures
//! of the store itself ([`StoreError`]).

use std::path::PathBuf;

use crate::key::ChunkKey;

/// Why bytes could not be decoded as a KV blob, or why a blob is not self-consistent.
///
/// This is its own enum because the disk tier treats every variant the same way: the entry is
/// deleted and the chunk recomputed.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// The bytes do not start with the blob magic: something else was stored here.
    #[error("not a KV blob: magic bytes {found:02x?}, expected {expected:02x?} (\"SRKV\")")]
    ForeignMagic { found: [u8; 4], expected: [u8; 4] },
    /// Written by a newer (or unknown) version of this format.
    #[error(
        "KV blob format version {found} is not supported; this build reads version {supported}"
    )]
    UnsupportedVersion { found: u16, supported: u16 },
    /// The payload codec tag (formerly the dtype tag) is not one this build can read.
    #[error("KV blob codec tag {found} is not supported; this build reads {expected} (raw f16), 2 (lossless f16), 3 (int8) and 4 (int4)")]
    UnsupportedDtype { found: u16, expected: u16 },
    /// A compressed payload does not decode to the values its header announces.
    #[error("KV blob payload does not decode: {0}")]
    Codec(String),
    /// Fewer bytes than the header announces.
    #[error("KV blob truncated: {what} needs {needed} bytes, only {available} present")]
    Truncated {
        what: &'static str,
        needed: u64,
        available: usize,
    },
    /// More bytes than the header announces.
    #[error("KV blob has trailing bytes: header announces {expected} bytes, found {actual}")]
    TrailingBytes { expected: u64, actual: usize },
    /// The stored CRC32 does not match the bytes.
    #[error("KV blob checksum mismatch: stored crc32 {stored:#010x}, computed {computed:#010x}")]
    ChecksumMismatch { stored: u32, computed: u32 },
    /// Dimensions that must agree do not (layer count, row width, token count, scores).
    #[error("KV blob shape is inconsistent: {0}")]
    Shape(String),
    /// The metadata section is not the JSON this format expects.
    #[error("KV blob metadata is not valid: {0}")]
    Metadata(#[from] serde_json::Error),
}

/// An error of a [`ChunkStore`](crate::ChunkStore) operation.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A blob handed to `put` is not self-consistent; nothing was stored.
    #[error("refusing to store chunk {key}: {source}")]
    InvalidBlob {
        key: ChunkKey,
        #[source]
        source: FormatError,
    },
    /// Bytes could not be decoded as a KV blob (from [`decode`](crate::decode)).
    #[error(transparent)]
    Format(#[from] FormatError),
    /// The store directory exists but holds something other than a chunk store.
    #[error("{path} is not a chunk store: {reason}")]
    NotAStore { path: PathBuf, reason: String },
    /// The store directory is damaged (or of another layout) and cannot be opened;
    /// [`DiskStore::open_or_reset`](crate::DiskStore::open_or_reset) moves it aside instead.
    #[error("the chunk KV store at {path} is damaged: {reason}")]
    Damaged { path: PathBuf, reason: String },
    /// Another process has the store open.
    #[error("the chunk KV store at {path} is in use by another process (one process per data directory)")]
    InUse { path: PathBuf },
    /// A file operation failed on an open store.
    #[error("disk chunk store {op} failed{} ({}): {source}", key_suffix(.key), .file.display())]
    Disk {
        op: &'static str,
        key: Option<ChunkKey>,
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The remote tier refused or failed an operation.
    #[error("remote chunk store {op} failed: {reason}")]
    Remote { op: &'static str, reason: String },
    /// A chunk key in text form is not 64 hex digits, or a stored key is not 32 bytes.
    #[error(transparent)]
    InvalidKey(#[from] crate::key::KeyError),
}

fn key_suffix(key: &Option<ChunkKey>) -> String {
    key.map(|k| format!(" for chunk {k}")).unwrap_or_default()
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, StoreError>;
