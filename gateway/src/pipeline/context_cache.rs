//! Full KV caches of exact contexts, kept so a repeated query over the same chunks verifies,
//! or escalates, without a full prefill.

use std::sync::Arc;
use target_engine::KvCache;

/// Default budget of the exact-context cache.
pub const DEFAULT_CONTEXT_CACHE_BYTES: u64 = 1 << 30;

/// Full KV caches of exact contexts (template + the ordered chunk set + question), so a
/// repeated query over the same chunks verifies without a full prefill. Bounded by bytes.
#[derive(Clone)]
pub struct ContextCache {
    inner: moka::sync::Cache<[u8; 32], Arc<(KvCache, Vec<f32>)>>,
    bytes: u64,
}

impl std::fmt::Debug for ContextCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContextCache")
            .field("entries", &self.inner.entry_count())
            .finish()
    }
}

impl ContextCache {
    /// Forgets every cached context (the evaluation measures verification's drafting, which a
    /// hit skips).
    pub fn clear(&self) {
        self.inner.invalidate_all();
    }

    /// How many contexts it holds.
    pub fn entries(&self) -> u64 {
        self.inner.run_pending_tasks();
        self.inner.entry_count()
    }

    /// A copy of the full cache and last logits kept under `key`, as a cache of engine cache
    /// type `C`. Only the CPU engine's caches are kept, so another engine's request finds none.
    pub(crate) fn get<C: 'static>(&self, key: &[u8; 32]) -> Option<(C, Vec<f32>)> {
        let hit = self.inner.get(key)?;
        let cache: Box<dyn std::any::Any> = Box::new(hit.0.clone());
        Some((*cache.downcast::<C>().ok()?, hit.1.clone()))
    }

    /// A cache holding at most `bytes` of KV (f32 K and V of every layer).
    pub fn new(bytes: u64) -> Self {
        Self {
            inner: moka::sync::Cache::builder()
                .max_capacity(bytes)
                .weigher(|_, v: &Arc<(KvCache, Vec<f32>)>| {
                    u32::try_from(Self::weight(&v.0, &v.1)).unwrap_or(u32::MAX)
                })
                .build(),
            bytes,
        }
    }

    /// What an entry counts against the budget: f32 K and V of every layer for every row its
    /// buffers have room for (a kept copy keeps the room reserved for the answer), its bf16
    /// mirror where it has one (a kept copy has none), and the logits.
    fn weight(cache: &KvCache, logits: &[f32]) -> u64 {
        let kv = 2 * 4 * cache.n_layer() * cache.row_len() * cache.capacity_rows();
        (kv + cache.mirror_bytes() + 4 * logits.len()) as u64
    }

    /// Keeps a copy of a context's full cache, unless it is larger than the whole budget (a
    /// copy that would be dropped at once is not made: ~1.9 GB at 32k tokens of the 1.5B), or
    /// is not the CPU engine's (a device cache stays in device memory, unkept).
    pub(crate) fn keep<C: 'static>(&self, key: [u8; 32], cache: &C, logits: &[f32]) {
        let Some(cache) = (cache as &dyn std::any::Any).downcast_ref::<KvCache>() else {
            return;
        };
        let weight = Self::weight(cache, logits) - cache.mirror_bytes() as u64;
        if weight <= self.bytes.min(u64::from(u32::MAX)) {
            let mut copy = cache.clone();
            // Kept once, in f32: a bf16 forward over a hit packs its mirror again.
            copy.drop_mirror();
            self.inner.insert(key, Arc::new((copy, logits.to_vec())));
        }
    }

    /// The key of a full cache whose first `kept` rows came from stored KV (see
    /// the guard's escalation, `crate::fidelity::drive`), apart from the true full cache's
    /// `key`.
    pub(crate) fn key_after_stored(key: &[u8; 32], kept: usize) -> [u8; 32] {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(b"after stored rows");
        h.update(key);
        h.update((kept as u64).to_le_bytes());
        h.finalize().into()
    }

    /// Keyed by collection too, so one tenant's cache hit (and its timing) never answers for
    /// another's request over the same text.
    pub(crate) fn key(fingerprint: &str, collection: &str, ids: &[u32]) -> [u8; 32] {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(fingerprint.as_bytes());
        h.update([0x1f]);
        h.update(collection.as_bytes());
        h.update([0x1f]);
        for id in ids {
            h.update(id.to_le_bytes());
        }
        h.finalize().into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kept copy keeps the room reserved for the answer's rows, so that room counts, not
    /// only the rows written.
    #[test]
    fn an_entry_weighs_the_room_it_keeps() {
        let mut c = KvCache::with_shape(2, 4);
        c.reserve(100);
        let rows = c.capacity_rows();
        assert!(rows >= 100, "{rows}");
        assert_eq!(c.mirror_bytes(), 0);
        let weight = (2 * 4 * 2 * 4 * rows + 4 * 10) as u64;
        assert_eq!(ContextCache::weight(&c, &[0.0; 10]), weight);
        let under = ContextCache::new(weight - 1);
        under.keep([1; 32], &c, &[0.0; 10]);
        assert_eq!(under.entries(), 0, "over the budget by its room");
        let fits = ContextCache::new(weight);
        fits.keep([1; 32], &c, &[0.0; 10]);
        assert_eq!(fits.entries(), 1);
    }
}
