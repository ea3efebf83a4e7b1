//! Memory over disk: the store the gateway uses.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::blob::KvBlob;
use crate::budget::{BudgetConfig, DiskBudget, Eviction};
use crate::codec::Codec;
use crate::disk::DiskStore;
use crate::error::{Result, StoreError};
use crate::key::ChunkKey;
use crate::memory::MemoryStore;
use crate::remote::RemoteStore;
use crate::shares::DEFAULT_TENANTS;
use crate::stats::StoreStats;
use crate::store::ChunkStore;

/// A [`MemoryStore`] in front of a [`DiskStore`], optionally over a [`RemoteStore`] shared
/// with other nodes. Memory holds the hot subset, filled by puts and by disk hits; a local
/// miss reads through to the remote tier and fills both local tiers (on disk under the
/// budget), and puts write through to it; `remove` leaves it alone (other nodes may use the
/// entry). A remote failure is logged and counted, never an error of the store: the local
/// tiers (or a recompute) answer instead.
///
/// Entries are pinned (what ingestion precomputes, [`ChunkStore::put`] and
/// [`TieredStore::hold`]: on disk for as long as their chunk is indexed) or budgeted (KV
/// computed while answering, [`TieredStore::put_cached`]: on disk while the budget keeps it).
/// Every byte the disk tier writes is one or the other: no write, a remote tier's
/// read-through included, leaves a file outside both (a budgeted blob's ledger line is
/// written, synced, before the blob; [`crate::budget`]), and no budgeted entry exists
/// without its file. The memory tier and the disk budget are shared by collections with a
/// floor each of their capacity divided by [`TieredStore::with_tenants`]' count
/// ([`crate::shares`]).
///
/// The whole store is a cache, and a tier's failure degrades the same way: a get that fails
/// is a miss, a cached put or a remove that fails is skipped (logged with the key, counted in
/// [`StoreStats::errors`]), so a damaged file costs a recompute, never a failed request, and
/// one key's failure never touches another key. Three things are refused: an inconsistent
/// blob (the caller's bug), a pinned put whose file cannot be written (a full disk, say), and
/// a flush that cannot make the disk tier's directories or the ledger durable: ingestion
/// must not index a chunk whose KV is not on disk.
///
/// The tiers are not updated atomically together. That is harmless because keys are content
/// addresses: a get racing a put of the same key can only leave an equal blob in memory.
/// Budget evictions and pins are serialized, so a key pinned while the budget evicts it keeps
/// its file.
pub struct TieredStore {
    memory: MemoryStore,
    disk: DiskStore,
    remote: Option<RemoteStore>,
    /// The byte budget of entries stored at query time ([`TieredStore::put_cached`]); `None`:
    /// they are kept like pinned ones.
    budget: Option<DiskBudget>,
    /// When a failure this store answered for last happened (the disk tier counts its own
    /// failures in its statistics; the remote tier in its own).
    last_error: Mutex<Option<Instant>>,
    /// Held while budget evictions are applied and while a key is pinned or removed, so a
    /// key cannot be pinned between its eviction and the deletion of its file.
    evicting: Mutex<()>,
    /// Among how many tenants the memory tier and the disk budget are divided.
    tenants: u32,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl TieredStore {
    /// Combines two tiers.
    pub fn new(memory: MemoryStore, disk: DiskStore) -> Self {
        Self {
            memory,
            disk,
            remote: None,
            budget: None,
            last_error: Mutex::new(None),
            evicting: Mutex::new(()),
            tenants: DEFAULT_TENANTS,
        }
    }

    /// Divides the memory tier and the disk budget among `tenants` (at least 1;
    /// [`DEFAULT_TENANTS`] until set): a collection keeps what it holds of either up to the
    /// capacity divided by `tenants`, whatever other collections store.
    pub fn with_tenants(mut self, tenants: u32) -> Self {
        self.tenants = tenants.max(1);
        self.memory.set_tenants(self.tenants);
        if let Some(b) = &self.budget {
            b.set_tenants(self.tenants);
        }
        self
    }

    /// Puts entries stored with [`TieredStore::put_cached`] under a disk budget of `bytes`
    /// evicted by `policy`, reconciled with the files: ledger entries whose file is gone are
    /// dropped, and entries the ledger held beyond a budget lowered since are deleted now.
    pub fn with_budget(mut self, bytes: u64, policy: Eviction) -> Result<Self> {
        let config = BudgetConfig {
            bytes,
            policy,
            tenants: self.tenants,
        };
        let (budget, gone) =
            DiskBudget::open_with(self.disk.path(), config, self.disk.writer(), &|k, _| {
                self.disk.stored_bytes(k)
            })?;
        self.budget = Some(budget);
        self.delete_evicted(gone);
        Ok(self)
    }

    /// The disk budget, when there is one.
    pub fn budget(&self) -> Option<&DiskBudget> {
        self.budget.as_ref()
    }

    /// Deletes what the budget evicted: the file and the memory copy (an evicted entry is
    /// gone, not demoted to memory); then the ledger says so.
    fn delete_evicted(&self, keys: Vec<ChunkKey>) {
        for key in &keys {
            let _ = self.disk.remove(key);
            let _ = self.memory.remove(key);
        }
        if let Some(b) = &self.budget {
            b.dropped(&keys);
        }
    }

    /// Stores a blob computed while answering a query of `collection`: in memory, on disk
    /// under the disk budget (which may evict it or the collection's others at once), and in
    /// the remote tier. Without a budget it is kept like any entry. A disk write that fails,
    /// or a ledger line that cannot be written ahead of it, leaves it in memory only and out
    /// of the budget (the request that computed it goes on; the next one to miss both tiers
    /// recomputes it); a key already pinned on disk stays pinned.
    pub fn put_cached(&self, collection: &str, key: &ChunkKey, blob: Arc<KvBlob>) -> Result<()> {
        let _serial = lock(&self.evicting);
        blob.validate()
            .map_err(|source| StoreError::InvalidBlob { key: *key, source })?;
        let budgeted = self.budget.as_ref().filter(|b| {
            // Not budgeted but on disk: pinned.
            b.contains(key) || !self.disk.contains(key).unwrap_or(false)
        });
        let Some(budget) = budgeted else {
            let _ = self.disk.put(key, Arc::clone(&blob));
            return self.spread(collection, key, blob);
        };
        let written = self.write_budgeted(budget, collection, key, &blob);
        self.spread(collection, key, blob)?;
        if let Some(bytes) = written {
            self.delete_evicted(budget.admit(collection, key, bytes));
        }
        Ok(())
    }

    /// Writes `blob` to disk for `collection` with its ledger line written ahead; the bytes
    /// written, or `None` when the line or the blob could not be (logged and counted; the
    /// caller admits nothing). The caller holds `evicting`.
    fn write_budgeted(
        &self,
        budget: &DiskBudget,
        collection: &str,
        key: &ChunkKey,
        blob: &KvBlob,
    ) -> Option<u64> {
        let bytes = crate::format::encode_with(blob, self.disk.codec());
        let len = bytes.len() as u64;
        if let Err(e) = budget.intend(collection, key, len) {
            self.degraded("budget ledger", Some(key), &e);
            return None;
        }
        match self.disk.put_raw(key, &bytes) {
            Ok(()) => Some(len),
            Err(_) => {
                budget.dropped(&[*key]);
                None
            }
        }
    }

    /// Notes a read of `key` for the budget's policy (a hit of a budgeted entry).
    pub fn touch(&self, key: &ChunkKey) {
        if let Some(b) = &self.budget {
            b.touch(key);
        }
    }

    /// Takes `key` out of the budget (its file stays).
    fn unbudget(&self, key: &ChunkKey) {
        if let Some(b) = &self.budget {
            b.forget(key);
        }
    }

    /// Pins `key` for ingestion when some tier holds it: out of the budget and on disk
    /// (written from memory or the remote tier when the disk lacks it). `Ok(false)` when no
    /// tier holds it (the caller computes it and [`ChunkStore::put`]s it); an error when the
    /// disk cannot take it.
    pub fn hold(&self, key: &ChunkKey) -> Result<bool> {
        let _serial = lock(&self.evicting);
        self.unbudget(key);
        if self.disk.contains(key).unwrap_or(false) {
            return Ok(true);
        }
        let found = match self.memory.get(key)? {
            Some(b) => Some(b),
            None => match &self.remote {
                Some(r) => r.get(key).unwrap_or_else(|e| {
                    self.degraded("remote get", Some(key), &e);
                    None
                }),
                None => None,
            },
        };
        let Some(blob) = found else {
            return Ok(false);
        };
        self.disk.put(key, Arc::clone(&blob))?;
        self.memory.insert_valid(*key, blob);
        Ok(true)
    }

    /// Keys under the budget (garbage collection keeps them).
    pub fn cached_keys(&self) -> Vec<ChunkKey> {
        self.budget
            .as_ref()
            .map(DiskBudget::keys)
            .unwrap_or_default()
    }

    /// Writes `blob`, already on disk (or refused there), to the remote tier and to memory
    /// (in `collection`'s share).
    fn spread(&self, collection: &str, key: &ChunkKey, blob: Arc<KvBlob>) -> Result<()> {
        if let Some(remote) = &self.remote {
            if let Err(e) = remote.put(key, &blob) {
                self.degraded("remote put", Some(key), &e);
            }
        }
        // With a lossy codec memory holds what the disk gives back, so a chunk's values do
        // not depend on which tier answers.
        let codec = self.disk.codec();
        let blob = if codec.is_lossy() {
            Arc::new(crate::format::decode(&crate::format::encode_with(
                &blob, codec,
            ))?)
        } else {
            blob
        };
        self.memory.put_for(collection, key, blob)
    }

    /// Logs a remote tier failure the store answers for, and notes when (the disk tier logs,
    /// counts and times its own).
    fn degraded(&self, op: &'static str, key: Option<&ChunkKey>, e: &StoreError) {
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        let key = key.map(ToString::to_string).unwrap_or_default();
        tracing::warn!(%key, op, "chunk store {op} failed; carrying on without it (the KV is recomputed when needed): {e}");
    }

    /// When a tier last failed (`None`: never since opening), for health reporting.
    pub fn last_error(&self) -> Option<Instant> {
        let own = *self.last_error.lock().unwrap_or_else(|p| p.into_inner());
        own.max(self.disk.last_error())
    }

    /// Adds a remote tier below disk.
    pub fn with_remote(mut self, remote: RemoteStore) -> Self {
        self.remote = Some(remote);
        self
    }

    /// The remote tier, if any.
    pub fn remote(&self) -> Option<&RemoteStore> {
        self.remote.as_ref()
    }

    /// Makes sure the remote tier holds `key` (writing the local blob if it lacks it); an
    /// error when it cannot. Without a remote tier, nothing to do.
    pub fn ensure_remote(&self, key: &ChunkKey) -> Result<()> {
        let Some(remote) = &self.remote else {
            return Ok(());
        };
        if remote.contains(key)? {
            return Ok(());
        }
        let blob = match self.memory.get(key)? {
            Some(b) => b,
            None => self.disk.get(key)?.ok_or(StoreError::Remote {
                op: "share",
                reason: format!("chunk {key} is in no local tier"),
            })?,
        };
        remote.put(key, &blob)
    }

    /// The blob under `key` from the remote tier, filling memory and the disk (under the
    /// budget, for `collection`, like KV computed while answering); `None` without a remote
    /// tier, on a miss, or when Redis fails (logged).
    pub fn get_remote(&self, collection: &str, key: &ChunkKey) -> Result<Option<Arc<KvBlob>>> {
        let Some(remote) = &self.remote else {
            return Ok(None);
        };
        match remote.get(key) {
            Ok(Some(blob)) => {
                self.put_local_cached(collection, key, Arc::clone(&blob));
                Ok(Some(blob))
            }
            Ok(None) => Ok(None),
            Err(e) => {
                self.degraded("remote get", Some(key), &e);
                Ok(None)
            }
        }
    }

    /// A blob read from the remote tier into memory and onto disk under the budget (a disk
    /// or ledger write that fails is logged and counted, and leaves no budget entry).
    fn put_local_cached(&self, collection: &str, key: &ChunkKey, blob: Arc<KvBlob>) {
        let _serial = lock(&self.evicting);
        let written = match &self.budget {
            Some(b) => self.write_budgeted(b, collection, key, &blob),
            None => {
                let _ = self.disk.put(key, Arc::clone(&blob));
                None
            }
        };
        let _ = self.memory.put_for(collection, key, blob);
        if let (Some(b), Some(bytes)) = (&self.budget, written) {
            self.delete_evicted(b.admit(collection, key, bytes));
        }
    }

    /// [`TieredStore::open_with`], moving a damaged disk tier aside instead of refusing it
    /// ([`DiskStore::open_or_reset`]); also returns where the damaged one went.
    pub fn open_or_reset(
        dir: &Path,
        memory_capacity_bytes: u64,
        codec: Codec,
    ) -> Result<(Self, Option<std::path::PathBuf>)> {
        let (disk, moved) = DiskStore::open_or_reset(dir)?;
        Ok((
            Self::new(
                MemoryStore::new(memory_capacity_bytes),
                disk.with_codec(codec),
            ),
            moved,
        ))
    }

    /// Opens (or creates) the disk tier in `dir` under a memory tier of
    /// `memory_capacity_bytes` payload bytes.
    pub fn open(dir: &Path, memory_capacity_bytes: u64) -> Result<Self> {
        Self::open_with(dir, memory_capacity_bytes, Codec::default())
    }

    /// [`TieredStore::open`] with the disk tier writing payloads with `codec`.
    pub fn open_with(dir: &Path, memory_capacity_bytes: u64, codec: Codec) -> Result<Self> {
        Ok(Self::new(
            MemoryStore::new(memory_capacity_bytes),
            DiskStore::open(dir)?.with_codec(codec),
        ))
    }

    /// The memory tier.
    pub fn memory(&self) -> &MemoryStore {
        &self.memory
    }

    /// The disk tier.
    pub fn disk(&self) -> &DiskStore {
        &self.disk
    }
}

/// Which tier a read found its blob in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    Memory,
    /// On disk; now also in memory.
    Disk,
    /// In the remote tier; now also in memory and on disk.
    Remote,
}

/// How far a read walks: the local tiers only, or the remote one too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    Local,
    Remote,
}

impl TieredStore {
    /// The blob under `key` and the tier it came from, walking memory, disk and (with
    /// [`Reach::Remote`]) the remote tier; a blob found below memory is copied up, counted
    /// against `collection`'s share of memory (`None`: the shared share).
    pub fn get_in(
        &self,
        collection: Option<&str>,
        key: &ChunkKey,
        reach: Reach,
    ) -> Result<Option<(Arc<KvBlob>, Found)>> {
        if let Some(blob) = self.memory.get(key)? {
            return Ok(Some((blob, Found::Memory)));
        }
        if let Some(blob) = self.disk.get(key)? {
            match collection {
                Some(c) => self.memory.put_for(c, key, Arc::clone(&blob))?,
                None => self.memory.insert_valid(*key, Arc::clone(&blob)),
            }
            return Ok(Some((blob, Found::Disk)));
        }
        if reach == Reach::Local {
            return Ok(None);
        }
        // Which collection reads it, when not known: the budget's shared bucket.
        Ok(self
            .get_remote(collection.unwrap_or(""), key)?
            .map(|b| (b, Found::Remote)))
    }
}

impl ChunkStore for TieredStore {
    fn get(&self, key: &ChunkKey) -> Result<Option<Arc<KvBlob>>> {
        Ok(self.get_in(None, key, Reach::Remote)?.map(|(b, _)| b))
    }

    /// Stores a pinned entry (what ingestion precomputes): on disk, out of the disk budget.
    /// A disk write that fails is an error here (after it is logged and counted): the caller
    /// must not index a chunk whose KV is not on disk.
    fn put(&self, key: &ChunkKey, blob: Arc<KvBlob>) -> Result<()> {
        let _serial = lock(&self.evicting);
        self.unbudget(key);
        blob.validate()
            .map_err(|source| StoreError::InvalidBlob { key: *key, source })?;
        self.disk.put(key, Arc::clone(&blob))?;
        self.spread("", key, blob)
    }

    fn remove(&self, key: &ChunkKey) -> Result<()> {
        // Local tiers only: the remote tier is shared, and one node's garbage collection
        // cannot know which entries other nodes' indexes still use. Remote entries expire by
        // their TTL or Redis' eviction policy. The file goes before the ledger's line, so a
        // crash between them leaves a line without a file (dropped at open), never a file
        // outside the budget; a removal that fails leaves the entry budgeted (evicted in
        // time) or, when pinned, garbage, which the next collection removes.
        let _serial = lock(&self.evicting);
        if self.disk.remove(key).is_ok() {
            self.unbudget(key);
        }
        self.memory.remove(key)
    }

    /// Whether any tier holds `key`: an entry only the remote tier has counts (another node
    /// computed it; a get reads it through).
    fn contains(&self, key: &ChunkKey) -> Result<bool> {
        if self.memory.contains(key)? || self.disk.contains(key).unwrap_or(false) {
            return Ok(true);
        }
        Ok(self.remote.as_ref().is_some_and(|r| {
            r.contains(key).unwrap_or_else(|e| {
                self.degraded("remote contains", Some(key), &e);
                false
            })
        }))
    }

    /// Makes the disk tier's completed puts and removes and the ledger's lines durable. A
    /// failure is returned (after it is logged and counted): the caller must not commit an
    /// index over blobs a crash could lose.
    fn flush(&self) -> Result<()> {
        self.disk.flush()?;
        if let Some(b) = &self.budget {
            b.sync()
                .inspect_err(|e| self.degraded("budget ledger sync", None, e))?;
        }
        Ok(())
    }

    fn stats(&self) -> StoreStats {
        let memory = self.memory.stats();
        let disk = self.disk.stats();
        StoreStats {
            memory_hits: memory.memory_hits,
            memory_misses: memory.memory_misses,
            memory_bytes: memory.memory_bytes,
            remote_errors: self.remote.as_ref().map_or(0, |r| r.stats().errors),
            ..disk
        }
    }

    fn keys(&self) -> Result<Vec<ChunkKey>> {
        self.disk.keys()
    }
}
