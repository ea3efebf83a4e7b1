//! One byte capacity shared fairly by owners (collections): each owner's entries live in a
//! moka cache of their own, bounded by an equal share of the capacity, so one owner's writes
//! evict only its own entries and never another's.
//!
//! The share is `capacity / n`, `n` the number of owners holding entries (the one inserting
//! counted). When an owner arrives or its last entry leaves, every owner's cache is rebuilt at
//! the new share: what no longer fits in a smaller share is evicted then (that is the
//! newcomer's room), and recency and frequency start afresh, as after a restart. Within an
//! owner the policy is moka's (W-TinyLFU or LRU).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use moka::notification::RemovalCause;
use moka::policy::EvictionPolicy;

use crate::key::ChunkKey;

/// Which entry of an owner goes first when its share is full.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Eviction {
    /// W-TinyLFU: frequency-aware admission over an LRU window.
    #[default]
    TinyLfu,
    /// Least recently used.
    Lru,
}

impl std::str::FromStr for Eviction {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "tinylfu" => Ok(Self::TinyLfu),
            "lru" => Ok(Self::Lru),
            _ => Err(format!("`{s}` is not an eviction policy: tinylfu or lru")),
        }
    }
}

impl std::fmt::Display for Eviction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::TinyLfu => "tinylfu",
            Self::Lru => "lru",
        })
    }
}

/// How an entry weighs (bytes).
pub type Weigher<V> = fn(&V) -> u32;

type Cache<V> = moka::sync::Cache<ChunkKey, V>;

struct Inner<V> {
    owners: HashMap<String, Cache<V>>,
    /// Which owner holds each key.
    owner_of: HashMap<ChunkKey, String>,
}

/// Entries keyed by [`ChunkKey`], each held by one owner, under one shared capacity.
pub struct Shares<V: Clone + Send + Sync + 'static> {
    inner: Mutex<Inner<V>>,
    capacity: u64,
    policy: Eviction,
    weigher: Weigher<V>,
    /// Keys evicted (by a policy or a smaller share) since the caller last drained them.
    evicted: Arc<Mutex<Vec<ChunkKey>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<V: Clone + Send + Sync + 'static> Shares<V> {
    /// Empty, with `capacity` bytes to share, weighing entries with `weigher`.
    pub fn new(capacity: u64, policy: Eviction, weigher: Weigher<V>) -> Self {
        Self {
            inner: Mutex::new(Inner {
                owners: HashMap::new(),
                owner_of: HashMap::new(),
            }),
            capacity,
            policy,
            weigher,
            evicted: Arc::new(Mutex::new(Vec::new())),
        }
    }

    /// The whole capacity.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    fn cache(&self, share: u64) -> Cache<V> {
        let sink = Arc::clone(&self.evicted);
        let weigher = self.weigher;
        moka::sync::Cache::builder()
            .max_capacity(share)
            .weigher(move |_: &ChunkKey, v: &V| weigher(v))
            .eviction_policy(match self.policy {
                Eviction::TinyLfu => EvictionPolicy::tiny_lfu(),
                Eviction::Lru => EvictionPolicy::lru(),
            })
            .eviction_listener(move |k: Arc<ChunkKey>, _, cause: RemovalCause| {
                if cause.was_evicted() {
                    lock(&sink).push(*k);
                }
            })
            .build()
    }

    /// Rebuilds every owner's cache at an equal share among `owners` (keeping their entries
    /// where they fit).
    fn reshare(&self, inner: &mut Inner<V>, owners: &[String]) {
        let share = self.capacity / owners.len().max(1) as u64;
        let mut rebuilt = HashMap::new();
        for name in owners {
            let fresh = self.cache(share);
            if let Some(old) = inner.owners.get(name) {
                for (k, v) in old.iter() {
                    fresh.insert(*k, v);
                }
                fresh.run_pending_tasks();
            }
            rebuilt.insert(name.clone(), fresh);
        }
        inner.owners = rebuilt;
    }

    /// Keys evicted since the last call, less any that were inserted again since.
    fn drain(&self, inner: &mut Inner<V>) -> Vec<ChunkKey> {
        let gone = std::mem::take(&mut *lock(&self.evicted));
        let mut out = Vec::new();
        for k in gone {
            let Some(owner) = inner.owner_of.get(&k) else {
                continue;
            };
            let held = inner.owners.get(owner).is_some_and(|c| c.contains_key(&k));
            if !held {
                inner.owner_of.remove(&k);
                out.push(k);
            }
        }
        if !out.is_empty() {
            self.drop_empty(inner);
        }
        out
    }

    /// Owners left without entries leave the sharing (the others' shares grow).
    fn drop_empty(&self, inner: &mut Inner<V>) {
        let live: std::collections::HashSet<&String> = inner.owner_of.values().collect();
        if live.len() != inner.owners.len() {
            let live: Vec<String> = live.into_iter().cloned().collect();
            self.reshare(inner, &live);
        }
    }

    /// Inserts `key` for `owner` (moving it from another owner if it had one). Returns the
    /// keys evicted to make room, possibly `key` itself: only `owner`'s, unless `owner` is new
    /// and every share shrank.
    pub fn insert(&self, owner: &str, key: ChunkKey, value: V) -> Vec<ChunkKey> {
        let mut inner = lock(&self.inner);
        if let Some(prev) = inner.owner_of.get(&key).filter(|p| *p != owner).cloned() {
            if let Some(c) = inner.owners.get(&prev) {
                c.invalidate(&key);
            }
        }
        inner.owner_of.insert(key, owner.to_string());
        if !inner.owners.contains_key(owner) {
            let mut owners: Vec<String> = inner.owners.keys().cloned().collect();
            owners.push(owner.to_string());
            self.reshare(&mut inner, &owners);
        }
        if let Some(c) = inner.owners.get(owner) {
            c.insert(key, value);
            c.run_pending_tasks();
        }
        self.drain(&mut inner)
    }

    /// Which owner holds `key`.
    pub fn owner(&self, key: &ChunkKey) -> Option<String> {
        lock(&self.inner).owner_of.get(key).cloned()
    }

    /// The value under `key`, noting the read for its owner's policy.
    pub fn get(&self, key: &ChunkKey) -> Option<V> {
        let inner = lock(&self.inner);
        let owner = inner.owner_of.get(key)?;
        inner.owners.get(owner)?.get(key)
    }

    /// Removes `key`, also when its eviction is not reported yet (it will not be: the caller
    /// keeps its file). Returns whether it was held or awaiting that report.
    pub fn remove(&self, key: &ChunkKey) -> bool {
        let mut inner = lock(&self.inner);
        let Some(owner) = inner.owner_of.remove(key) else {
            return false;
        };
        if let Some(c) = inner.owners.get(&owner) {
            c.invalidate(key);
        }
        lock(&self.evicted).retain(|k| k != key);
        self.drop_empty(&mut inner);
        true
    }

    /// Whether `key` is held.
    pub fn contains(&self, key: &ChunkKey) -> bool {
        let inner = lock(&self.inner);
        inner
            .owner_of
            .get(key)
            .and_then(|o| inner.owners.get(o))
            .is_some_and(|c| c.contains_key(key))
    }

    /// Every held key with its owner.
    pub fn entries(&self) -> Vec<(ChunkKey, String)> {
        let inner = lock(&self.inner);
        let mut out = Vec::new();
        for (owner, c) in &inner.owners {
            out.extend(c.iter().map(|(k, _)| (*k, owner.clone())));
        }
        out
    }

    /// Bytes held, in all and per owner.
    pub fn usage(&self) -> (u64, Vec<(String, u64)>) {
        let inner = lock(&self.inner);
        let mut per: Vec<(String, u64)> = inner
            .owners
            .iter()
            .map(|(o, c)| {
                c.run_pending_tasks();
                (o.clone(), c.weighted_size())
            })
            .collect();
        per.sort();
        (per.iter().map(|(_, b)| b).sum(), per)
    }

    /// How many entries are held.
    pub fn len(&self) -> u64 {
        let inner = lock(&self.inner);
        inner
            .owners
            .values()
            .map(|c| {
                c.run_pending_tasks();
                c.entry_count()
            })
            .sum()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops everything (no evictions reported).
    pub fn clear(&self) {
        let mut inner = lock(&self.inner);
        inner.owners.clear();
        inner.owner_of.clear();
        lock(&self.evicted).clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u32) -> ChunkKey {
        ChunkKey::new("model", "collection", "mode", &[i])
    }

    fn weigh(b: &u32) -> u32 {
        *b
    }

    /// Regression (issue 57): tenants shared one budget, so one tenant's writes flushed
    /// another's entries. Under shares, an owner's inserts evict only its own.
    #[test]
    fn an_owner_never_evicts_another_owners_entries() {
        let s = Shares::new(400, Eviction::Lru, weigh);
        assert!(s.insert("b", key(0), 100).is_empty());
        assert!(s.insert("b", key(1), 100).is_empty());
        let mut evicted = Vec::new();
        for i in 10..60 {
            evicted.extend(s.insert("a", key(i), 100));
        }
        assert!(s.contains(&key(0)) && s.contains(&key(1)), "b flushed");
        assert!(!evicted.contains(&key(0)) && !evicted.contains(&key(1)));
        let (total, per) = s.usage();
        assert!(total <= 400, "{per:?}");
        assert_eq!(per, vec![("a".into(), 200), ("b".into(), 200)]);
    }

    #[test]
    fn a_newcomer_gets_its_share_and_a_leaver_gives_it_back() {
        let s = Shares::new(400, Eviction::Lru, weigh);
        for i in 0..4 {
            assert!(s.insert("a", key(i), 100).is_empty());
        }
        // b arrives: a's share halves, two of a's entries go.
        let gone = s.insert("b", key(10), 100);
        assert_eq!(gone.len(), 2, "{gone:?}");
        assert_eq!(s.usage().0, 300);
        // b's last entry leaves: a has the whole capacity again.
        assert!(s.remove(&key(10)));
        for i in 20..22 {
            assert!(s.insert("a", key(i), 100).is_empty());
        }
        assert_eq!(s.usage(), (400, vec![("a".into(), 400)]));
    }

    #[test]
    fn a_key_inserted_again_after_its_eviction_is_not_reported_gone() {
        let s = Shares::new(200, Eviction::Lru, weigh);
        s.insert("a", key(0), 100);
        s.insert("a", key(1), 100);
        assert_eq!(s.insert("a", key(2), 100), vec![key(0)]);
        assert!(s.insert("a", key(0), 100).contains(&key(1)));
        assert!(s.contains(&key(0)));
    }
}
