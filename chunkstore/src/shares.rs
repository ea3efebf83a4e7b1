//! One byte capacity shared by owners (collections) so that no owner can flush another's
//! protected bytes, however many owners appear.
//!
//! Each owner has a *floor* of `capacity / tenants` bytes, `tenants` a configured number
//! ([`DEFAULT_TENANTS`]) that does not change as owners come and go: while an owner holds no
//! more than its floor, none of its entries is evicted for another owner. Beyond its floor an
//! owner borrows free capacity, and borrowed bytes are what other owners' inserts reclaim,
//! from the largest borrower first (and only from an owner that borrows more than the
//! inserting owner would, so two borrowers never take turns evicting each other), and only by
//! an entry read more often than those it would push out (the count-min sketch below, under
//! either policy): a burst of one-off owners, each reading its entry once, cannot reclaim a
//! tenant's entries that were read as often, however many appear. When an insert cannot find
//! room that way, the owner makes room among its own entries, by its policy; when that is not
//! enough either, the new entry is refused, never a protected entry evicted. So an owner keeps at least its floor (whole entries: it loses none while it holds
//! no more than the floor), and more than `tenants` owners at once can only be refused room,
//! not take it from the first ones.
//!
//! Within an owner the victim is its least recently used entry ([`Eviction::Lru`], exact).
//! [`Eviction::TinyLfu`] keeps that order and adds TinyLFU admission, as moka's policy does:
//! a count-min sketch estimates how often each key was read (a hit or a miss), and an entry
//! that would push out the owner's own entries is admitted only if its estimate exceeds the
//! summed estimate of those it would push out. Reclaiming another owner's borrowed bytes
//! takes the same test under both policies: between owners the floors and the reads decide,
//! within one owner its policy.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use crate::key::ChunkKey;

/// How many tenants a capacity is divided among when none is configured: each owner's floor
/// is an eighth of the capacity.
pub const DEFAULT_TENANTS: u32 = 8;

/// Which entry of an owner goes first when it must make room.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Eviction {
    /// The least recently used, with TinyLFU admission: a new entry is kept only when it is
    /// estimated to be read more often than the entries it would push out.
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

/// An entry an insert removed: its key, owner and weight.
pub type Removed = (ChunkKey, String, u64);

/// Counters per row of the frequency sketch (a power of two).
const SKETCH_WIDTH: usize = 1 << 12;
const SKETCH_ROWS: usize = 4;
/// A counter saturates here (4 bits of frequency, as in TinyLFU).
const SKETCH_MAX: u8 = 15;

/// A count-min sketch of how often keys were read, halved every `10 x width` reads so that
/// old popularity fades (TinyLFU's reset). Keys are sha256 digests, so their bytes index the
/// rows directly.
struct Sketch {
    counters: Vec<u8>,
    added: usize,
}

impl Sketch {
    fn new() -> Self {
        Self {
            counters: vec![0; SKETCH_ROWS * SKETCH_WIDTH],
            added: 0,
        }
    }

    fn slots(key: &ChunkKey) -> [usize; SKETCH_ROWS] {
        let b = key.as_bytes();
        std::array::from_fn(|row| {
            let word =
                u32::from_le_bytes([b[4 * row], b[4 * row + 1], b[4 * row + 2], b[4 * row + 3]]);
            row * SKETCH_WIDTH + (word as usize & (SKETCH_WIDTH - 1))
        })
    }

    fn increment(&mut self, key: &ChunkKey) {
        for slot in Self::slots(key) {
            let c = &mut self.counters[slot];
            *c = (*c + 1).min(SKETCH_MAX);
        }
        self.added += 1;
        if self.added >= 10 * SKETCH_WIDTH {
            for c in &mut self.counters {
                *c /= 2;
            }
            self.added /= 2;
        }
    }

    fn estimate(&self, key: &ChunkKey) -> u64 {
        Self::slots(key)
            .into_iter()
            .map(|slot| u64::from(self.counters[slot]))
            .min()
            .unwrap_or(0)
    }
}

struct Entry<V> {
    owner: String,
    value: V,
    weight: u64,
    /// When it was last inserted or read (its place in its owner's recency order).
    tick: u64,
}

/// One owner's entries, least recently used first, and their bytes.
#[derive(Default)]
struct Owner {
    used: u64,
    order: BTreeMap<u64, ChunkKey>,
}

struct Inner<V> {
    entries: HashMap<ChunkKey, Entry<V>>,
    /// Owners holding entries, by name (a deterministic order to break ties in).
    owners: BTreeMap<String, Owner>,
    used: u64,
    tick: u64,
    tenants: u32,
    sketch: Sketch,
}

impl<V> Inner<V> {
    /// Takes `key` out, returning its entry.
    fn take(&mut self, key: &ChunkKey) -> Option<Entry<V>> {
        let e = self.entries.remove(key)?;
        self.used -= e.weight;
        if let Some(o) = self.owners.get_mut(&e.owner) {
            o.used -= e.weight;
            o.order.remove(&e.tick);
            if o.order.is_empty() {
                self.owners.remove(&e.owner);
            }
        }
        Some(e)
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }
}

/// Entries keyed by [`ChunkKey`], each held by one owner, under one shared capacity.
pub struct Shares<V: Clone + Send + Sync + 'static> {
    inner: Mutex<Inner<V>>,
    capacity: u64,
    policy: Eviction,
    weigher: Weigher<V>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<V: Clone + Send + Sync + 'static> Shares<V> {
    /// Empty, with `capacity` bytes to share among [`DEFAULT_TENANTS`] tenants, weighing
    /// entries with `weigher`.
    pub fn new(capacity: u64, policy: Eviction, weigher: Weigher<V>) -> Self {
        Self {
            inner: Mutex::new(Inner {
                entries: HashMap::new(),
                owners: BTreeMap::new(),
                used: 0,
                tick: 0,
                tenants: DEFAULT_TENANTS,
                sketch: Sketch::new(),
            }),
            capacity,
            policy,
            weigher,
        }
    }

    /// The whole capacity.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Divides the capacity among `tenants` (at least 1) from now on: each owner's floor is
    /// `capacity / tenants`. Nothing is evicted now; the floors apply from the next insert.
    pub fn set_tenants(&self, tenants: u32) {
        lock(&self.inner).tenants = tenants.max(1);
    }

    /// The bytes no other owner can take from an owner.
    pub fn floor(&self) -> u64 {
        self.capacity / u64::from(lock(&self.inner).tenants.max(1))
    }

    /// Inserts `key` for `owner` (moving it from another owner if it had one). Returns the
    /// keys removed to make room, and `key` itself when it is refused (then nothing else is
    /// removed): the caller drops what they name. Another owner's entry is removed only while
    /// that owner holds more than its floor.
    pub fn insert(&self, owner: &str, key: ChunkKey, value: V) -> Vec<ChunkKey> {
        self.insert_reporting(owner, key, value)
            .into_iter()
            .map(|(k, ..)| k)
            .collect()
    }

    /// [`Shares::insert`], naming the owner and weight of each key removed.
    pub fn insert_reporting(&self, owner: &str, key: ChunkKey, value: V) -> Vec<Removed> {
        let mut inner = lock(&self.inner);
        let weight = u64::from((self.weigher)(&value));
        inner.take(&key);
        let room = self
            .room_for(&inner, owner, &key, weight, true)
            .or_else(|| self.room_for(&inner, owner, &key, weight, false));
        let Some(victims) = room else {
            return vec![(key, owner.to_string(), weight)];
        };
        let removed = victims
            .iter()
            .filter_map(|v| inner.take(v).map(|e| (*v, e.owner, e.weight)))
            .collect();
        let tick = inner.next_tick();
        inner.used += weight;
        let o = inner.owners.entry(owner.to_string()).or_default();
        o.used += weight;
        o.order.insert(tick, key);
        inner.entries.insert(
            key,
            Entry {
                owner: owner.to_string(),
                value,
                weight,
                tick,
            },
        );
        removed
    }

    /// The entries to remove so that `owner` can insert `key` of `weight` bytes (reclaiming
    /// other owners' borrowed bytes where `reclaim`), or `None` when it must be refused.
    /// Decides without changing anything, so a refusal removes nothing.
    fn room_for(
        &self,
        inner: &Inner<V>,
        owner: &str,
        key: &ChunkKey,
        weight: u64,
        reclaim: bool,
    ) -> Option<Vec<ChunkKey>> {
        if weight > self.capacity {
            return None;
        }
        let floor = self.capacity / u64::from(inner.tenants.max(1));
        let mut need = (inner.used + weight).saturating_sub(self.capacity);
        // Each owner's bytes as the planned removals leave them, and how far down its
        // recency order they reach.
        let mut used: BTreeMap<&str, u64> = inner
            .owners
            .iter()
            .map(|(n, o)| (n.as_str(), o.used))
            .collect();
        let mut cursors: HashMap<&str, std::collections::btree_map::Values<'_, u64, ChunkKey>> =
            HashMap::new();
        let mut victims = Vec::new();
        let mut own_freq = 0u64;
        let mut others_freq = 0u64;
        while need > 0 {
            let mine = used.get(owner).copied().unwrap_or(0);
            let my_borrow = (mine + weight).saturating_sub(floor);
            let lender = used
                .iter()
                .filter(|(n, _)| **n != owner)
                .map(|(n, u)| (*n, u.saturating_sub(floor)))
                .filter(|(_, borrow)| reclaim && *borrow > my_borrow)
                .max_by_key(|(_, borrow)| *borrow)
                .map(|(n, _)| n);
            let from = lender.unwrap_or(owner);
            let cursor = cursors
                .entry(from)
                .or_insert_with(|| match inner.owners.get(from) {
                    Some(o) => o.order.values(),
                    None => std::collections::btree_map::Values::default(),
                });
            // Only the inserting owner can run out: a lender borrows, so it holds entries.
            let victim = cursor.next()?;
            let w = inner.entries.get(victim).map_or(0, |e| e.weight);
            if from == owner {
                own_freq += inner.sketch.estimate(victim);
            } else {
                others_freq += inner.sketch.estimate(victim);
            }
            if let Some(u) = used.get_mut(from) {
                *u -= w;
            }
            need = need.saturating_sub(w);
            victims.push(*victim);
        }
        let takes_others = victims
            .iter()
            .any(|v| inner.entries.get(v).is_some_and(|e| e.owner != owner));
        if takes_others && inner.sketch.estimate(key) <= others_freq {
            return None;
        }
        let pushes_own_out = victims
            .iter()
            .any(|v| inner.entries.get(v).is_some_and(|e| e.owner == owner));
        if self.policy == Eviction::TinyLfu
            && pushes_own_out
            && inner.sketch.estimate(key) <= own_freq
        {
            return None;
        }
        Some(victims)
    }

    /// Which owner holds `key`.
    pub fn owner(&self, key: &ChunkKey) -> Option<String> {
        lock(&self.inner).entries.get(key).map(|e| e.owner.clone())
    }

    /// The value under `key`, noting the read (a hit or a miss) for the policy.
    pub fn get(&self, key: &ChunkKey) -> Option<V> {
        let mut inner = lock(&self.inner);
        inner.sketch.increment(key);
        let (owner, old) = {
            let e = inner.entries.get(key)?;
            (e.owner.clone(), e.tick)
        };
        let tick = inner.next_tick();
        if let Some(o) = inner.owners.get_mut(&owner) {
            o.order.remove(&old);
            o.order.insert(tick, *key);
        }
        let e = inner.entries.get_mut(key)?;
        e.tick = tick;
        Some(e.value.clone())
    }

    /// Removes `key`; whether it was held.
    pub fn remove(&self, key: &ChunkKey) -> bool {
        lock(&self.inner).take(key).is_some()
    }

    /// Whether `key` is held.
    pub fn contains(&self, key: &ChunkKey) -> bool {
        lock(&self.inner).entries.contains_key(key)
    }

    /// Every held key with its owner and weight, least recently used first.
    pub fn entries(&self) -> Vec<(ChunkKey, String, u64)> {
        let inner = lock(&self.inner);
        let mut out: Vec<(u64, ChunkKey, String, u64)> = inner
            .entries
            .iter()
            .map(|(k, e)| (e.tick, *k, e.owner.clone(), e.weight))
            .collect();
        out.sort_unstable_by_key(|(tick, ..)| *tick);
        out.into_iter().map(|(_, k, o, w)| (k, o, w)).collect()
    }

    /// Bytes held, in all and per owner (by name).
    pub fn usage(&self) -> (u64, Vec<(String, u64)>) {
        let inner = lock(&self.inner);
        let per = inner
            .owners
            .iter()
            .map(|(n, o)| (n.clone(), o.used))
            .collect();
        (inner.used, per)
    }

    /// How many entries are held.
    pub fn len(&self) -> u64 {
        lock(&self.inner).entries.len() as u64
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops everything (the read frequencies are kept).
    pub fn clear(&self) {
        let mut inner = lock(&self.inner);
        inner.entries.clear();
        inner.owners.clear();
        inner.used = 0;
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
    /// another's entries. An owner within its floor loses nothing to another's inserts.
    #[test]
    fn an_owner_never_evicts_another_owners_entries() {
        let s = Shares::new(400, Eviction::Lru, weigh);
        s.set_tenants(2);
        assert!(s.insert("b", key(0), 100).is_empty());
        assert!(s.insert("b", key(1), 100).is_empty());
        let mut evicted = Vec::new();
        for i in 10..60 {
            evicted.extend(s.insert("a", key(i), 100));
        }
        assert!(s.contains(&key(0)) && s.contains(&key(1)), "b flushed");
        assert!(!evicted.contains(&key(0)) && !evicted.contains(&key(1)));
        assert_eq!(s.usage(), (400, vec![("a".into(), 200), ("b".into(), 200)]));
    }

    /// Regression (issue 88): every new owner re-divided the capacity as capacity / n and
    /// evicted what no longer fit, so naming new owners flushed an existing owner's entries.
    /// Now 100 new owners find the capacity full of protected bytes and are refused instead.
    #[test]
    fn a_hundred_new_owners_cannot_flush_an_owner_within_its_floor() {
        let s = Shares::new(1000, Eviction::TinyLfu, weigh);
        s.set_tenants(4);
        for i in 0..4 {
            assert!(s.insert("first", key(i), 50).is_empty());
        }
        let mut refused = 0;
        for i in 0..100 {
            let gone = s.insert(&format!("new-{i}"), key(100 + i), 50);
            assert!(gone.iter().all(|k| *k == key(100 + i)), "{gone:?}");
            refused += gone.len();
        }
        for i in 0..4 {
            assert!(
                s.contains(&key(i)),
                "the first owner's entry {i} was flushed"
            );
        }
        // The rest of the capacity went to the first newcomers; the others were refused.
        assert_eq!(refused, 100 - 16);
        assert_eq!(s.usage().0, 1000);
    }

    #[test]
    fn a_newcomer_reclaims_borrowed_bytes_from_the_largest_borrower() {
        let s = Shares::new(400, Eviction::Lru, weigh);
        s.set_tenants(4);
        for i in 0..3 {
            assert!(s.insert("a", key(i), 100).is_empty());
        }
        assert!(s.insert("b", key(10), 100).is_empty());
        // Full: a borrows 200, b nothing. c, within its floor and read more often than a's
        // entries (never read), takes a's oldest.
        s.get(&key(20));
        assert_eq!(s.insert("c", key(20), 100), vec![key(0)]);
        // a still borrows 100: d takes its next oldest, leaving a at its floor.
        s.get(&key(30));
        assert_eq!(s.insert("d", key(30), 100), vec![key(1)]);
        // Now nobody borrows: e is refused, nothing else moves.
        assert_eq!(s.insert("e", key(40), 100), vec![key(40)]);
        // An owner beyond its floor makes room among its own entries.
        assert_eq!(s.insert("b", key(11), 100), vec![key(10)]);
        assert_eq!(s.usage().0, 400);
        // A leaver's bytes are free for anyone to borrow.
        assert!(s.remove(&key(20)));
        assert!(s.insert("a", key(3), 100).is_empty());
    }

    /// Issue 88, at the sizes a tenant really holds: its passages above its floor (four of an
    /// eighth of the capacity each, the default 8 tenants) are borrowed bytes, and 100
    /// one-off collections, each reading its passage once, reclaim none of them (read once
    /// too); a collection whose passage is read more often does.
    #[test]
    fn one_off_owners_cannot_reclaim_a_tenants_borrowed_bytes() {
        let s = Shares::new(800, Eviction::Lru, weigh);
        for i in 0..4 {
            s.get(&key(i));
            assert!(s.insert("tenant", key(i), 150).is_empty());
        }
        for c in 0..100 {
            let k = key(100 + c);
            s.get(&k);
            let gone = s.insert(&format!("new-{c}"), k, 100);
            assert!(gone.iter().all(|g| *g == k), "{gone:?}");
        }
        for i in 0..4 {
            assert!(s.contains(&key(i)), "the tenant's entry {i} was reclaimed");
        }
        // A collection that keeps asking for its passage is admitted over the oldest.
        let k = key(900);
        for _ in 0..3 {
            s.get(&k);
        }
        assert_eq!(s.insert("busy", k, 100), vec![key(0)]);
    }

    #[test]
    fn borrowers_do_not_take_turns_evicting_each_other() {
        let s = Shares::new(400, Eviction::Lru, weigh);
        s.set_tenants(8);
        s.insert("a", key(0), 200);
        s.insert("b", key(1), 200);
        // Each borrows 150: a's next insert would borrow more than b, so it evicts its own.
        assert_eq!(s.insert("a", key(2), 200), vec![key(0)]);
        assert!(s.contains(&key(1)));
    }

    #[test]
    fn lru_order_is_exact_and_reads_renew_it() {
        let s = Shares::new(300, Eviction::Lru, weigh);
        for i in 0..3 {
            s.insert("a", key(i), 100);
        }
        assert_eq!(s.get(&key(0)), Some(100));
        assert_eq!(s.insert("a", key(3), 100), vec![key(1)]);
        assert_eq!(s.insert("a", key(4), 100), vec![key(2)]);
        assert_eq!(s.insert("a", key(5), 100), vec![key(0)]);
    }

    #[test]
    fn tinylfu_admits_a_newcomer_only_when_read_more_often_than_its_victims() {
        let s = Shares::new(200, Eviction::TinyLfu, weigh);
        for i in 0..2 {
            s.insert("a", key(i), 100);
            s.get(&key(i));
        }
        // Never read: refused, the entries read once stay.
        assert_eq!(s.insert("a", key(9), 100), vec![key(9)]);
        assert!(s.contains(&key(0)) && s.contains(&key(1)));
        // Read (missed) twice: more than the once-read victim, admitted over it.
        s.get(&key(9));
        s.get(&key(9));
        assert_eq!(s.insert("a", key(9), 100), vec![key(0)]);
        // An entry too large for the whole capacity is refused under any policy.
        assert_eq!(s.insert("a", key(8), 201), vec![key(8)]);
        assert!(s.contains(&key(9)));
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
