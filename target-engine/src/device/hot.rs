//! Tiers for hot chunk KV: chunks placed recently stay where the device reads them fast (f16,
//! as stored, at the position they were computed at), least recently used first out, under a
//! byte budget. In device memory ([`HotChunks`]) placing a chunk found there is a
//! device-to-device copy and its RoPE recovery, with no upload from host memory (16-20 ms for
//! 4 x 512 tokens of a 7B's KV from pageable host memory on an H200, against ~0.06 ms device
//! to device); in page-locked host memory (the pinned tier, `pinned.rs`) it is an upload at
//! the bus's speed (~2 ms for the same bytes).

use crate::kv::ChunkKv;
use candle_core::Tensor;
use std::collections::HashMap;

/// A chunk's identity in the tier: what its KV depends on (the model and numerics that computed
/// it, where and after what, its tokens).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Key {
    fingerprint: String,
    base_pos: usize,
    mode: String,
    ids: Vec<u32>,
}

impl Key {
    pub(super) fn of(chunk: &ChunkKv) -> Self {
        Self {
            fingerprint: chunk.fingerprint.clone(),
            base_pos: chunk.base_pos,
            mode: format!("{:?}", chunk.mode),
            ids: chunk.ids.clone(),
        }
    }
}

/// A chunk's K and V on the device, f16 `(n_layer, rows, n_kv_head, head_dim)`, as uploaded.
#[derive(Clone)]
pub(super) struct Resident {
    pub(super) k: Tensor,
    pub(super) v: Tensor,
}

struct Entry<V> {
    kv: V,
    bytes: u64,
    used: u64,
}

/// A tier: at most `budget` bytes of chunk KV (`V`, cheap to clone), evicted least recently
/// used first.
pub(super) struct Tier<V> {
    budget: u64,
    held: u64,
    clock: u64,
    entries: HashMap<Key, Entry<V>>,
    /// Placements served from the tier, and those it could not serve while it was on.
    pub(super) hits: u64,
    pub(super) misses: u64,
}

impl<V> Default for Tier<V> {
    fn default() -> Self {
        Self {
            budget: 0,
            held: 0,
            clock: 0,
            entries: HashMap::new(),
            hits: 0,
            misses: 0,
        }
    }
}

/// The tier in device memory.
pub(super) type HotChunks = Tier<Resident>;

/// Where chunk KV waits between placements, least recently used out first under a byte budget
/// (`DeviceModel::set_chunk_tier`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkTier {
    /// Device memory: placing a chunk held there is a copy on the device, no upload.
    Device,
    /// Page-locked host memory: an upload at the bus's speed, not through the driver's staging
    /// of ordinary memory (on candle's CPU device, ordinary memory).
    Pinned,
}

/// What a tier holds and how it served.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HotStats {
    /// Bytes it may hold (0: off).
    pub budget: u64,
    /// Bytes held.
    pub held: u64,
    /// Chunks held.
    pub chunks: usize,
    /// Placements served from the tier, and those it could not serve while it was on.
    pub hits: u64,
    pub misses: u64,
}

impl<V: Clone> Tier<V> {
    /// Sets the budget, evicting what no longer fits.
    pub(super) fn set_budget(&mut self, bytes: u64) {
        self.budget = bytes;
        self.evict_to(bytes);
    }

    /// The chunk's KV where the tier holds it (counted as used now).
    pub(super) fn get(&mut self, key: &Key) -> Option<V> {
        if self.budget == 0 {
            return None;
        }
        self.clock += 1;
        let clock = self.clock;
        match self.entries.get_mut(key) {
            Some(e) => {
                e.used = clock;
                self.hits += 1;
                Some(e.kv.clone())
            }
            None => {
                self.misses += 1;
                None
            }
        }
    }

    /// Keeps `kv` (of `bytes` bytes) where it fits the budget, evicting the least recently
    /// used chunks to make room; a chunk larger than the whole budget is not kept.
    pub(super) fn put(&mut self, key: Key, kv: V, bytes: u64) {
        if bytes > self.budget || self.entries.contains_key(&key) {
            return;
        }
        self.evict_to(self.budget - bytes);
        self.clock += 1;
        self.held += bytes;
        let used = self.clock;
        self.entries.insert(key, Entry { kv, bytes, used });
    }

    fn evict_to(&mut self, room: u64) {
        while self.held > room {
            let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.used)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            if let Some(e) = self.entries.remove(&oldest) {
                self.held -= e.bytes;
            }
        }
    }

    /// Bytes it may hold (0: off).
    pub(super) fn budget(&self) -> u64 {
        self.budget
    }

    pub(super) fn stats(&self) -> HotStats {
        HotStats {
            budget: self.budget,
            held: self.held,
            chunks: self.entries.len(),
            hits: self.hits,
            misses: self.misses,
        }
    }
}
