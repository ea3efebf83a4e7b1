//! The disk tier: encoded blobs in a sled database.
//!
//! Two trees change together in one sled transaction: `kv` maps a key to its encoded blob and
//! `kv_sizes` maps it to the blob's length. The second exists because sled can only count or
//! list a tree by reading it whole, and reading `kv` would read every multi-megabyte blob:
//! opening, `keys`, `contains` and the statistics read `kv_sizes` only.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sled::transaction::{ConflictableTransactionError, TransactionError};
use sled::{IVec, Transactional};

use crate::blob::KvBlob;
use crate::codec::Codec;
use crate::error::{Result, StoreError};
use crate::format::{decode, encode_with};
use crate::key::ChunkKey;
use crate::stats::{Counter, StoreStats};
use crate::store::ChunkStore;

/// Name of the sled tree that holds the encoded blobs.
pub const BLOB_TREE: &str = "kv";
/// Name of the sled tree that holds each blob's encoded length (u64, little-endian).
pub const SIZE_TREE: &str = "kv_sizes";
/// Files sled 0.34 keeps in its directory; a non-empty directory without them is not ours.
const SLED_FILES: [&str; 2] = ["conf", "db"];
/// sled's page cache. Small, because the memory tier above already holds hot blobs decoded;
/// a large page cache would keep a second, encoded copy of the same chunks.
const SLED_CACHE_BYTES: u64 = 64 << 20;
/// How long `open` waits for the database's file lock. sled's background threads keep it for
/// a few milliseconds after the last handle drops, so a store reopened at once (a restart, a
/// test) would otherwise fail; a store another process really holds fails after this.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Opens sled, waiting up to `LOCK_WAIT` for a lock that is being released.
fn open_sled(path: &Path) -> sled::Result<sled::Db> {
    let start = std::time::Instant::now();
    loop {
        let opened = sled::Config::new()
            .path(path)
            .cache_capacity(SLED_CACHE_BYTES)
            .open();
        match opened {
            // sled reports the lock as an io error whose only distinguishing mark is its text.
            Err(sled::Error::Io(e))
                if e.to_string().contains("could not acquire lock")
                    && start.elapsed() < LOCK_WAIT =>
            {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

/// Chunk KV caches stored on disk. A blob that fails to decode is deleted and reported absent.
pub struct DiskStore {
    /// Kept for flushing; the trees are handles into it.
    db: sled::Db,
    blobs: sled::Tree,
    sizes: sled::Tree,
    path: PathBuf,
    /// How `put` stores payloads; `get` reads every codec.
    codec: Codec,
    hits: Counter,
    misses: Counter,
    corrupt: Counter,
    /// Gauges, maintained by every committed put and remove.
    entries: Counter,
    bytes: Counter,
}

impl DiskStore {
    /// The store writing new blobs with `codec` (default [`Codec::Raw`]); blobs already
    /// stored with another codec stay readable.
    pub fn with_codec(mut self, codec: Codec) -> Self {
        self.codec = codec;
        self
    }

    /// The codec new blobs are written with.
    pub fn codec(&self) -> Codec {
        self.codec
    }

    /// Opens the store in directory `path`, creating it if needed.
    ///
    /// A path that is a file, or a non-empty directory that holds no sled database, is refused
    /// rather than filled with sled's files.
    pub fn open(path: &Path) -> Result<Self> {
        check_store_dir(path)?;
        let open_err = |source| StoreError::Open {
            path: path.to_path_buf(),
            source,
        };
        let db = open_sled(path).map_err(open_err)?;
        let blobs = db.open_tree(BLOB_TREE).map_err(open_err)?;
        let sizes = db.open_tree(SIZE_TREE).map_err(open_err)?;
        let (mut entries, mut bytes) = (0u64, 0u64);
        for item in sizes.iter() {
            let (_key, size) = item.map_err(open_err)?;
            entries += 1;
            bytes += read_size(&size);
        }
        let store = Self {
            db,
            blobs,
            sizes,
            path: path.to_path_buf(),
            codec: Codec::default(),
            hits: Counter::default(),
            misses: Counter::default(),
            corrupt: Counter::default(),
            entries: Counter::default(),
            bytes: Counter::default(),
        };
        store.entries.add(entries);
        store.bytes.add(bytes);
        Ok(store)
    }

    /// The directory of the database.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Stores bytes as they are, without checking that they decode (for tests and tools that
    /// need to place damaged or foreign data; a later `get` drops them if they do not decode).
    pub fn put_raw(&self, key: &ChunkKey, bytes: &[u8]) -> Result<()> {
        self.insert(key, IVec::from(bytes))
    }

    /// The stored bytes under `key`, undecoded.
    pub fn get_raw(&self, key: &ChunkKey) -> Result<Option<Vec<u8>>> {
        let raw = self
            .blobs
            .get(key.as_bytes())
            .map_err(disk_err("get", key))?;
        Ok(raw.map(|v| v.to_vec()))
    }

    fn insert(&self, key: &ChunkKey, value: IVec) -> Result<()> {
        let size = IVec::from(&(value.len() as u64).to_le_bytes());
        let old = (&self.blobs, &self.sizes)
            .transaction(|(blobs, sizes)| {
                blobs.insert(key.as_bytes(), value.clone())?;
                Ok::<_, ConflictableTransactionError<()>>(
                    sizes.insert(key.as_bytes(), size.clone())?,
                )
            })
            .map_err(tx_err("put", key))?;
        match old {
            Some(old_size) => self.bytes.sub(read_size(&old_size)),
            None => self.entries.add(1),
        }
        self.bytes.add(value.len() as u64);
        Ok(())
    }

    /// Deletes the entry under `key` if it still holds `expected` (any value when `None`), so
    /// that dropping a corrupt blob never deletes a good one written meanwhile.
    fn delete(&self, key: &ChunkKey, expected: Option<&IVec>) -> Result<()> {
        let removed = (&self.blobs, &self.sizes)
            .transaction(|(blobs, sizes)| {
                if let Some(expected) = expected {
                    if blobs.get(key.as_bytes())?.as_ref() != Some(expected) {
                        return Ok(None);
                    }
                }
                blobs.remove(key.as_bytes())?;
                Ok::<_, ConflictableTransactionError<()>>(sizes.remove(key.as_bytes())?)
            })
            .map_err(tx_err("remove", key))?;
        if let Some(size) = removed {
            self.entries.sub(1);
            self.bytes.sub(read_size(&size));
        }
        Ok(())
    }
}

impl ChunkStore for DiskStore {
    fn get(&self, key: &ChunkKey) -> Result<Option<Arc<KvBlob>>> {
        let raw = match self.blobs.get(key.as_bytes()) {
            Ok(raw) => raw,
            // sled cannot read the entry (its own checksum failed on a damaged page or blob
            // file, or the file is gone): the KV is lost, but it can be recomputed, so the
            // entry goes and the caller recomputes rather than failing every query that reads
            // it. A failing delete is logged; the next read takes this path again, which
            // still answers with a recompute.
            Err(e) => {
                tracing::warn!(
                    key = %key,
                    path = %self.path.display(),
                    reason = %e,
                    "the disk store cannot read this KV entry; dropping it, it will be recomputed"
                );
                if let Err(e) = self.delete(key, None) {
                    tracing::warn!(key = %key, "dropping the unreadable entry failed: {e}");
                }
                self.corrupt.add(1);
                self.misses.add(1);
                return Ok(None);
            }
        };
        let Some(raw) = raw else {
            self.misses.add(1);
            return Ok(None);
        };
        match decode(&raw) {
            Ok(blob) => {
                self.hits.add(1);
                Ok(Some(Arc::new(blob)))
            }
            Err(reason) => {
                tracing::warn!(
                    key = %key,
                    path = %self.path.display(),
                    %reason,
                    "dropping unreadable KV blob from the disk store; it will be recomputed"
                );
                self.delete(key, Some(&raw))?;
                self.corrupt.add(1);
                self.misses.add(1);
                Ok(None)
            }
        }
    }

    fn put(&self, key: &ChunkKey, blob: Arc<KvBlob>) -> Result<()> {
        blob.validate()
            .map_err(|source| StoreError::InvalidBlob { key: *key, source })?;
        self.insert(key, IVec::from(encode_with(&blob, self.codec)))
    }

    fn remove(&self, key: &ChunkKey) -> Result<()> {
        self.delete(key, None)
    }

    fn contains(&self, key: &ChunkKey) -> Result<bool> {
        self.sizes
            .contains_key(key.as_bytes())
            .map_err(disk_err("contains", key))
    }

    fn flush(&self) -> Result<()> {
        self.db.flush().map_err(|source| StoreError::Disk {
            op: "flush",
            key: None,
            source,
        })?;
        Ok(())
    }

    fn stats(&self) -> StoreStats {
        StoreStats {
            disk_hits: self.hits.get(),
            disk_misses: self.misses.get(),
            corrupt: self.corrupt.get(),
            disk_bytes: self.bytes.get(),
            entries: self.entries.get(),
            ..StoreStats::default()
        }
    }

    fn keys(&self) -> Result<Vec<ChunkKey>> {
        self.sizes
            .iter()
            .keys()
            .map(|key| {
                let key = key.map_err(|source| StoreError::Disk {
                    op: "keys",
                    key: None,
                    source,
                })?;
                ChunkKey::from_bytes(&key)
            })
            .collect()
    }
}

/// Refuses a path that is a file or a non-empty directory without sled's files.
fn check_store_dir(path: &Path) -> Result<()> {
    let not_a_store = |reason: String| StoreError::NotAStore {
        path: path.to_path_buf(),
        reason,
    };
    if !path.exists() {
        return Ok(());
    }
    if !path.is_dir() {
        return Err(not_a_store("it is not a directory".into()));
    }
    let names: Vec<String> = std::fs::read_dir(path)
        .map_err(|e| not_a_store(format!("cannot list it: {e}")))?
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .collect();
    if names.is_empty() || SLED_FILES.iter().all(|f| names.iter().any(|n| n == f)) {
        return Ok(());
    }
    let mut shown: Vec<&str> = names.iter().map(String::as_str).collect();
    shown.sort_unstable();
    shown.truncate(5);
    Err(not_a_store(format!(
        "the directory holds {shown:?}{} but no sled database (expected files {SLED_FILES:?}); \
         pass an empty or new directory",
        if names.len() > shown.len() {
            ", ..."
        } else {
            ""
        },
    )))
}

/// A stored length; an unreadable one (sled checksums its pages, so never expected) counts as
/// zero, which only skews the byte statistics.
fn read_size(bytes: &[u8]) -> u64 {
    bytes.try_into().map(u64::from_le_bytes).unwrap_or(0)
}

fn disk_err(op: &'static str, key: &ChunkKey) -> impl FnOnce(sled::Error) -> StoreError {
    let key = *key;
    move |source| StoreError::Disk {
        op,
        key: Some(key),
        source,
    }
}

fn tx_err(op: &'static str, key: &ChunkKey) -> impl FnOnce(TransactionError<()>) -> StoreError {
    let key = *key;
    move |e| StoreError::Disk {
        op,
        key: Some(key),
        source: match e {
            TransactionError::Storage(source) => source,
            // The closures above never abort.
            TransactionError::Abort(()) => sled::Error::Unsupported("aborted transaction".into()),
        },
    }
}
