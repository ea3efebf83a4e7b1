//! The in-memory tier: chunk KV bounded by payload bytes rather than entry count, since one
//! chunk's KV is megabytes and chunk lengths vary, shared by collections with a protected
//! floor each.

use std::sync::Arc;

use crate::blob::KvBlob;
use crate::error::{Result, StoreError};
use crate::key::ChunkKey;
use crate::shares::{Eviction, Shares};
use crate::stats::{Counter, StoreStats};
use crate::store::ChunkStore;

/// Chunk KV caches held in memory under a capacity of payload bytes, LRU with TinyLFU
/// admission. The capacity is shared by collections ([`crate::shares`]): a collection keeps
/// the chunks it holds here up to its floor (the capacity divided by the configured tenants)
/// whatever other collections insert, and borrows free room beyond it, which others reclaim;
/// so one tenant's traffic cannot push another's protected chunks out to disk. Entries
/// inserted without a collection ([`ChunkStore::put`], a disk hit read by key alone) share
/// the bucket `""`. A blob that finds no room is not kept.
pub struct MemoryStore {
    shares: Shares<Arc<KvBlob>>,
    hits: Counter,
    misses: Counter,
}

fn weigh(blob: &Arc<KvBlob>) -> u32 {
    u32::try_from(blob.payload_bytes()).unwrap_or(u32::MAX)
}

impl MemoryStore {
    /// An empty store holding at most `capacity_bytes` of K/V payload.
    pub fn new(capacity_bytes: u64) -> Self {
        Self {
            shares: Shares::new(capacity_bytes, Eviction::TinyLfu, weigh),
            hits: Counter::default(),
            misses: Counter::default(),
        }
    }

    /// The configured capacity in payload bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.shares.capacity()
    }

    /// Applies pending evictions now (they are applied at every insert).
    pub fn run_pending_tasks(&self) {}

    /// Divides the capacity among `tenants`: each collection's floor is the capacity divided
    /// by it ([`crate::shares::DEFAULT_TENANTS`] until set).
    pub fn set_tenants(&self, tenants: u32) {
        self.shares.set_tenants(tenants);
    }

    /// Inserts without validating (for blobs that were just decoded, hence already valid),
    /// under the collection that holds `key` already, or `""`.
    pub(crate) fn insert_valid(&self, key: ChunkKey, blob: Arc<KvBlob>) {
        let owner = self.shares.owner(&key).unwrap_or_default();
        self.shares.insert(&owner, key, blob);
    }

    /// Inserts a blob read for `collection` (counted in its share).
    pub fn put_for(&self, collection: &str, key: &ChunkKey, blob: Arc<KvBlob>) -> Result<()> {
        blob.validate()
            .map_err(|source| StoreError::InvalidBlob { key: *key, source })?;
        self.shares.insert(collection, *key, blob);
        Ok(())
    }

    /// Payload bytes each collection holds here.
    pub fn usage_by_collection(&self) -> Vec<(String, u64)> {
        self.shares.usage().1
    }

    /// Empties the tier; the counters are kept.
    pub fn clear(&self) {
        self.shares.clear();
    }
}

impl ChunkStore for MemoryStore {
    fn get(&self, key: &ChunkKey) -> Result<Option<Arc<KvBlob>>> {
        let found = self.shares.get(key);
        match found {
            Some(_) => self.hits.add(1),
            None => self.misses.add(1),
        }
        Ok(found)
    }

    fn put(&self, key: &ChunkKey, blob: Arc<KvBlob>) -> Result<()> {
        blob.validate()
            .map_err(|source| StoreError::InvalidBlob { key: *key, source })?;
        self.insert_valid(*key, blob);
        Ok(())
    }

    fn remove(&self, key: &ChunkKey) -> Result<()> {
        self.shares.remove(key);
        Ok(())
    }

    fn contains(&self, key: &ChunkKey) -> Result<bool> {
        Ok(self.shares.contains(key))
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }

    fn stats(&self) -> StoreStats {
        StoreStats {
            memory_hits: self.hits.get(),
            memory_misses: self.misses.get(),
            memory_bytes: self.shares.usage().0,
            entries: self.shares.len(),
            ..StoreStats::default()
        }
    }

    /// The keys currently held; any of them may be evicted by the next insert.
    fn keys(&self) -> Result<Vec<ChunkKey>> {
        Ok(self.shares.entries().into_iter().map(|(k, ..)| k).collect())
    }
}
