//! The in-memory tier: a moka cache bounded by payload bytes rather than entry count, since one
//! chunk's KV is megabytes and chunk lengths vary.

use std::sync::Arc;

use moka::sync::Cache;

use crate::blob::KvBlob;
use crate::error::{Result, StoreError};
use crate::key::ChunkKey;
use crate::stats::{Counter, StoreStats};
use crate::store::ChunkStore;

/// Chunk KV caches held in memory, evicted by moka's TinyLFU policy once their payload bytes
/// exceed the capacity. A blob larger than the whole capacity is not kept.
pub struct MemoryStore {
    cache: Cache<ChunkKey, Arc<KvBlob>>,
    capacity_bytes: u64,
    hits: Counter,
    misses: Counter,
}

impl MemoryStore {
    /// An empty store holding at most `capacity_bytes` of K/V payload.
    pub fn new(capacity_bytes: u64) -> Self {
        let cache = Cache::builder()
            .max_capacity(capacity_bytes)
            .weigher(|_key, blob: &Arc<KvBlob>| {
                u32::try_from(blob.payload_bytes()).unwrap_or(u32::MAX)
            })
            .build();
        Self {
            cache,
            capacity_bytes,
            hits: Counter::default(),
            misses: Counter::default(),
        }
    }

    /// The configured capacity in payload bytes.
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_bytes
    }

    /// Applies pending evictions now; moka otherwise does this lazily during later operations.
    pub fn run_pending_tasks(&self) {
        self.cache.run_pending_tasks();
    }

    /// Inserts without validating (for blobs that were just decoded, hence already valid).
    pub(crate) fn insert_valid(&self, key: ChunkKey, blob: Arc<KvBlob>) {
        self.cache.insert(key, blob);
    }

    /// Empties the tier; the counters are kept.
    pub fn clear(&self) {
        self.cache.invalidate_all();
    }
}

impl ChunkStore for MemoryStore {
    fn get(&self, key: &ChunkKey) -> Result<Option<Arc<KvBlob>>> {
        let found = self.cache.get(key);
        match found {
            Some(_) => self.hits.add(1),
            None => self.misses.add(1),
        }
        Ok(found)
    }

    fn put(&self, key: &ChunkKey, blob: Arc<KvBlob>) -> Result<()> {
        blob.validate()
            .map_err(|source| StoreError::InvalidBlob { key: *key, source })?;
        self.cache.insert(*key, blob);
        Ok(())
    }

    fn remove(&self, key: &ChunkKey) -> Result<()> {
        self.cache.invalidate(key);
        Ok(())
    }

    fn contains(&self, key: &ChunkKey) -> Result<bool> {
        Ok(self.cache.contains_key(key))
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }

    fn stats(&self) -> StoreStats {
        // Sizes are only exact once pending inserts and evictions are applied.
        self.cache.run_pending_tasks();
        StoreStats {
            memory_hits: self.hits.get(),
            memory_misses: self.misses.get(),
            memory_bytes: self.cache.weighted_size(),
            entries: self.cache.entry_count(),
            ..StoreStats::default()
        }
    }

    /// The keys currently held; moka may evict any of them at any time.
    fn keys(&self) -> Result<Vec<ChunkKey>> {
        Ok(self.cache.iter().map(|(k, _)| *k).collect())
    }
}
