//! The interface every storage backend implements.

use std::sync::Arc;

use crate::blob::KvBlob;
use crate::error::Result;
use crate::key::ChunkKey;
use crate::stats::StoreStats;

/// A key-value store of chunk KV caches.
///
/// Keys are content addresses, so a key always names the same cache and concurrent writers of
/// one key write equal values. A blob that cannot be read back is reported as absent, never
/// returned: the caller recomputes it.
pub trait ChunkStore: Send + Sync {
    /// The blob stored under `key`, or `None` when absent (or found corrupt and dropped).
    fn get(&self, key: &ChunkKey) -> Result<Option<Arc<KvBlob>>>;
    /// Stores `blob` under `key`, replacing any previous one; rejects an inconsistent blob.
    fn put(&self, key: &ChunkKey, blob: Arc<KvBlob>) -> Result<()>;
    /// Deletes the entry under `key`; absent keys are not an error.
    fn remove(&self, key: &ChunkKey) -> Result<()>;
    /// Whether an entry exists under `key`, without decoding it or counting a lookup.
    fn contains(&self, key: &ChunkKey) -> Result<bool>;
    /// Makes every completed `put` and `remove` durable (a no-op in memory).
    fn flush(&self) -> Result<()>;
    /// A snapshot of the counters.
    fn stats(&self) -> StoreStats;
    /// Every key in the store (for a tiered store, those on disk).
    fn keys(&self) -> Result<Vec<ChunkKey>>;
}
