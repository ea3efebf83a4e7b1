//! Hit, miss and size statistics of the store tiers.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

/// A snapshot of a store's counters. Tiers a backend does not have stay zero.
///
/// A corrupt blob is also counted as a disk miss: the caller recomputes it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StoreStats {
    /// Lookups answered by the memory tier.
    pub memory_hits: u64,
    /// Lookups the memory tier could not answer.
    pub memory_misses: u64,
    /// Lookups answered by the disk tier.
    pub disk_hits: u64,
    /// Lookups the disk tier could not answer, corrupt entries included.
    pub disk_misses: u64,
    /// Disk entries that failed to decode and were deleted.
    pub corrupt: u64,
    /// Payload bytes held by the memory tier.
    pub memory_bytes: u64,
    /// Bytes of the encoded blobs in the disk tier (the file system rounds each file up to its blocks).
    pub disk_bytes: u64,
    /// Entries in the store (in the disk tier, for a tiered store: memory holds a subset).
    pub entries: u64,
    /// Disk operations the file system failed (each logged with its key); a tiered store
    /// answers them as absent (get) or skipped (put, remove), so they cost a recompute, never a
    /// request.
    pub errors: u64,
    /// Remote tier operations that failed (Redis unreachable, timeouts).
    pub remote_errors: u64,
}

/// A counter shared between threads (events, or a gauge such as the entry count).
#[derive(Debug, Default)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    pub(crate) fn add(&self, n: u64) {
        // Relaxed: counters are independent and only read for reporting.
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}
