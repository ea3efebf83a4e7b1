//! The disk tier: one file per chunk.
//!
//! Layout of a store directory:
//! ```text
//! STORE               what this directory is, and the layout version
//! LOCK                held (an OS file lock) by the one process that has the store open
//! 3f/3f9a…e1.kv       one encoded blob per chunk key, under the key's first two hex digits
//! tmp/                writes in progress, renamed into place when complete; emptied at open
//! ```
//!
//! The store is a cache of recomputable KV, and the layout is chosen so that damage stays
//! where it happens. A blob is written to `tmp/`, synced, and renamed over its final name, so
//! a reader sees the old file or the new one, never half of one. Every blob carries the blob
//! format's own checksum, so a flipped byte or a truncation is found at read time and that
//! one file is deleted and recomputed; a missing file is a miss. No file holds more than one
//! chunk, so no damage can make another key unreadable or unwritable, whichever collection it
//! belongs to. (The previous disk tier, a sled 0.34 database, failed every write to the keys
//! of a page whose blob file was gone, on every request and after restarts, and panicked while
//! recovering such a database; stores of that layout are migrated at open, see
//! [`DiskStore::open`].)

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::blob::KvBlob;
use crate::codec::Codec;
use crate::error::{Result, StoreError};
use crate::format::{decode, encode_with};
use crate::key::ChunkKey;
use crate::stats::{Counter, StoreStats};
use crate::store::ChunkStore;

/// The first line of `STORE`; the layout version follows it.
const MARKER: &str = "specrag chunk KV store: one file per chunk";
/// The layout this build writes and reads.
pub const LAYOUT_VERSION: u32 = 1;
const MARKER_FILE: &str = "STORE";
const LOCK_FILE: &str = "LOCK";
const TMP_DIR: &str = "tmp";
/// Extension of a chunk file.
const EXT: &str = "kv";
/// Files the earlier sled-based layout kept in its directory.
const SLED_FILES: [&str; 2] = ["conf", "db"];
/// How long `open` waits for the lock: a store reopened at once after its previous owner
/// dropped it (a restart, a test) should not fail.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// How the disk tier does the file operations whose failure matters: writing a new chunk
/// file (or a rewritten budget ledger), appending to the budget ledger, and syncing a
/// directory. The file system ([`FsWriter`]), or in fault tests a disk that fails part way
/// (full, say), to check what the store does then.
pub trait BlobWriter: Send + Sync {
    /// Creates `path`, writes `bytes` to it and makes them durable.
    fn write_new(&self, path: &Path, bytes: &[u8]) -> std::io::Result<()>;

    /// Appends `bytes` to `file` (a line of the budget ledger).
    fn append(&self, file: &mut File, bytes: &[u8]) -> std::io::Result<()> {
        file.write_all(bytes)
    }

    /// Makes the entries of directory `dir` (files created, renamed or deleted in it)
    /// durable.
    fn sync_dir(&self, dir: &Path) -> std::io::Result<()> {
        File::open(dir)?.sync_all()
    }
}

/// Writes through the file system.
#[derive(Debug, Clone, Copy, Default)]
pub struct FsWriter;

impl BlobWriter for FsWriter {
    fn write_new(&self, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
        let mut f = File::create(path)?;
        f.write_all(bytes)?;
        f.sync_data()
    }
}

/// Chunk KV caches stored on disk, one file each. A file that fails to decode is deleted and
/// reported absent; a file that cannot be read at all is too.
pub struct DiskStore {
    path: PathBuf,
    /// Held for the store's lifetime; the OS releases the lock when it is closed.
    _lock: File,
    /// How `put` stores payloads; `get` reads every codec.
    codec: Codec,
    /// Writes the bytes of new files.
    writer: Arc<dyn BlobWriter>,
    /// Shard directories whose entries changed since the last `flush` (synced by it).
    dirty: Mutex<BTreeSet<PathBuf>>,
    hits: Counter,
    misses: Counter,
    corrupt: Counter,
    /// The size of every file this store knows of: the entry and byte gauges. Kept true to
    /// the files as they are found (a file deleted behind the store's back leaves it when a
    /// read misses it).
    sizes: Mutex<HashMap<ChunkKey, u64>>,
    /// Operations the file system failed (each also logged with its key).
    errors: Counter,
    last_error: Mutex<Option<Instant>>,
}

impl std::fmt::Debug for DiskStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskStore")
            .field("path", &self.path)
            .finish()
    }
}

impl DiskStore {
    /// The store writing new blobs with `codec` (default [`Codec::Raw`]); blobs already
    /// stored with another codec stay readable.
    pub fn with_codec(mut self, codec: Codec) -> Self {
        self.codec = codec;
        self
    }

    /// The store writing new files through `writer` instead of the file system directly.
    pub fn with_writer(mut self, writer: Arc<dyn BlobWriter>) -> Self {
        self.writer = writer;
        self
    }

    /// What the store writes files and syncs directories through.
    pub fn writer(&self) -> Arc<dyn BlobWriter> {
        Arc::clone(&self.writer)
    }

    /// The codec new blobs are written with.
    pub fn codec(&self) -> Codec {
        self.codec
    }

    /// Opens the store in directory `path`, creating it if needed.
    ///
    /// Refused: a path that is a file; a non-empty directory that is not a chunk store (it is
    /// someone else's data); a store another process has open ([`StoreError::InUse`]); a
    /// store whose `STORE` file is damaged or of another layout ([`StoreError::Damaged`]).
    /// A store of the earlier sled layout is migrated: every entry that reads is copied into
    /// this layout, and the sled files are deleted; one sled cannot open is
    /// [`StoreError::Damaged`].
    pub fn open(path: &Path) -> Result<Self> {
        match classify(path)? {
            Found::Empty => create_layout(path)?,
            Found::Ours => check_marker(path)?,
            Found::Sled => migrate_sled(path)?,
        }
        let lock = lock(path)?;
        let store = Self {
            path: path.to_path_buf(),
            _lock: lock,
            codec: Codec::default(),
            writer: Arc::new(FsWriter),
            dirty: Mutex::new(BTreeSet::new()),
            hits: Counter::default(),
            misses: Counter::default(),
            corrupt: Counter::default(),
            sizes: Mutex::new(HashMap::new()),
            errors: Counter::default(),
            last_error: Mutex::new(None),
        };
        // Writes a crash interrupted never became entries.
        let tmp = path.join(TMP_DIR);
        if let Ok(listing) = std::fs::read_dir(&tmp) {
            for entry in listing.flatten() {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        std::fs::create_dir_all(&tmp).map_err(|e| io_err("open", None, &tmp, e))?;
        let sizes = store
            .files()?
            .into_iter()
            .map(|(key, file)| (key, std::fs::metadata(&file).map_or(0, |m| m.len())))
            .collect();
        *store.sizes() = sizes;
        Ok(store)
    }

    /// [`DiskStore::open`], except that a damaged store ([`StoreError::Damaged`]) is renamed
    /// to `<dir>.damaged-<unix seconds>` and an empty store created in its place: the store is
    /// a cache, so its contents are recomputed as they are needed. Returns where the damaged
    /// one went, if it was moved. A directory that is not a chunk store, or a store in use, is
    /// still refused.
    pub fn open_or_reset(path: &Path) -> Result<(Self, Option<PathBuf>)> {
        match Self::open(path) {
            Ok(store) => Ok((store, None)),
            Err(StoreError::Damaged { reason, .. }) => {
                let aside = aside_path(path, "damaged");
                tracing::error!(
                    path = %path.display(),
                    moved_to = %aside.display(),
                    %reason,
                    "THE CHUNK KV STORE IS DAMAGED and cannot be opened; it is only a cache, so \
                     it was moved aside and an empty one created: chunk KV is recomputed as \
                     queries need it (the index is untouched). Delete the moved copy when done \
                     looking at it."
                );
                std::fs::rename(path, &aside).map_err(|e| StoreError::Damaged {
                    path: path.to_path_buf(),
                    reason: format!(
                        "{reason}; moving it aside to {} failed: {e}",
                        aside.display()
                    ),
                })?;
                Ok((Self::open(path)?, Some(aside)))
            }
            Err(e) => Err(e),
        }
    }

    /// The directory of the store.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// When an operation last failed (`None`: never since opening).
    pub fn last_error(&self) -> Option<Instant> {
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The file of `key`.
    pub fn file_of(&self, key: &ChunkKey) -> PathBuf {
        let hex = key.to_string();
        self.path.join(&hex[..2]).join(format!("{hex}.{EXT}"))
    }

    /// The size of `key`'s file as this store knows it (`None`: not known to be stored).
    pub fn stored_bytes(&self, key: &ChunkKey) -> Option<u64> {
        self.sizes().get(key).copied()
    }

    /// Stores bytes as they are, without checking that they decode (for tests and tools that
    /// need to place damaged or foreign data; a later `get` drops them if they do not decode).
    pub fn put_raw(&self, key: &ChunkKey, bytes: &[u8]) -> Result<()> {
        self.write(key, bytes).inspect_err(|e| self.failed(e))
    }

    /// The stored bytes under `key`, undecoded.
    pub fn get_raw(&self, key: &ChunkKey) -> Result<Option<Vec<u8>>> {
        let file = self.file_of(key);
        match std::fs::read(&file) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err("get", Some(key), &file, e)),
        }
    }

    fn sizes(&self) -> std::sync::MutexGuard<'_, HashMap<ChunkKey, u64>> {
        self.sizes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a failed operation: counted, timed and logged with its key.
    fn failed(&self, e: &StoreError) {
        self.errors.add(1);
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
        tracing::warn!(path = %self.path.display(), "disk chunk store: {e}");
    }

    /// Writes `bytes` as the file of `key`: to `tmp/`, synced, renamed into place.
    fn write(&self, key: &ChunkKey, bytes: &[u8]) -> Result<()> {
        let file = self.file_of(key);
        let shard = file.parent().unwrap_or(&self.path).to_path_buf();
        let tmp = self
            .path
            .join(TMP_DIR)
            .join(format!("{key}.{:016x}", rand_suffix()));
        let result = (|| -> std::io::Result<()> {
            std::fs::create_dir_all(&shard)?;
            // `tmp/` deleted behind the store's back is made again, not a failed write.
            std::fs::create_dir_all(self.path.join(TMP_DIR))?;
            self.writer.write_new(&tmp, bytes)?;
            std::fs::rename(&tmp, &file)
        })();
        match result {
            Ok(()) => {
                self.sizes().insert(*key, bytes.len() as u64);
                self.dirty
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(shard);
                Ok(())
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(io_err("put", Some(key), &file, e))
            }
        }
    }

    /// Deletes the file of `key`; an absent one is not an error.
    fn delete(&self, key: &ChunkKey) -> Result<()> {
        let file = self.file_of(key);
        let removed = std::fs::remove_file(&file);
        if !matches!(&removed, Err(e) if e.kind() != std::io::ErrorKind::NotFound) {
            self.sizes().remove(key);
        }
        match removed {
            Ok(()) => {
                if let Some(shard) = file.parent() {
                    self.dirty
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(shard.to_path_buf());
                }
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err("remove", Some(key), &file, e)),
        }
    }

    /// Every chunk file with its key; files of other names are left alone.
    fn files(&self) -> Result<Vec<(ChunkKey, PathBuf)>> {
        let listing = |dir: &Path| std::fs::read_dir(dir).map_err(|e| io_err("keys", None, dir, e));
        let mut out = Vec::new();
        for shard in listing(&self.path)?.flatten() {
            let name = shard.file_name();
            let name = name.to_string_lossy();
            if name.len() != 2 || !name.bytes().all(|b| b.is_ascii_hexdigit()) {
                continue;
            }
            for entry in listing(&shard.path())?.flatten() {
                let path = entry.path();
                let key = path
                    .file_stem()
                    .filter(|_| path.extension().is_some_and(|e| e == EXT))
                    .and_then(|s| s.to_str())
                    .and_then(|s| s.parse::<ChunkKey>().ok());
                if let Some(key) = key {
                    out.push((key, path));
                }
            }
        }
        Ok(out)
    }
}

impl ChunkStore for DiskStore {
    fn get(&self, key: &ChunkKey) -> Result<Option<Arc<KvBlob>>> {
        let raw = match self.get_raw(key) {
            Ok(Some(raw)) => raw,
            Ok(None) => {
                // Gone behind the store's back, if it was known.
                self.sizes().remove(key);
                self.misses.add(1);
                return Ok(None);
            }
            // The file exists but cannot be read (an I/O error of a failing disk): the KV is
            // lost, but it can be recomputed, so the file goes and the caller recomputes.
            Err(e) => {
                self.failed(&e);
                if let Err(e) = self.delete(key) {
                    self.failed(&e);
                }
                self.corrupt.add(1);
                self.misses.add(1);
                return Ok(None);
            }
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
                *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
                if let Err(e) = self.delete(key) {
                    self.failed(&e);
                }
                self.corrupt.add(1);
                self.misses.add(1);
                Ok(None)
            }
        }
    }

    fn put(&self, key: &ChunkKey, blob: Arc<KvBlob>) -> Result<()> {
        blob.validate()
            .map_err(|source| StoreError::InvalidBlob { key: *key, source })?;
        self.put_raw(key, &encode_with(&blob, self.codec))
    }

    fn remove(&self, key: &ChunkKey) -> Result<()> {
        self.delete(key).inspect_err(|e| self.failed(e))
    }

    fn contains(&self, key: &ChunkKey) -> Result<bool> {
        Ok(self.file_of(key).is_file())
    }

    /// Syncs the directories whose entries changed, so every completed put (each file is
    /// synced when written) and remove survives a crash. A directory that fails stays to
    /// sync, with those after it, at the next flush; one deleted behind the store's back has
    /// nothing left to sync.
    fn flush(&self) -> Result<()> {
        let mut dirty = std::mem::take(&mut *self.dirty.lock().unwrap_or_else(|p| p.into_inner()));
        // A shard may be new since the last flush (made by any put, or by one that failed
        // after making it): the store's directory holds its entry, so it is synced too, or a
        // power loss could take the shard, and the blobs in it, away.
        if !dirty.is_empty() {
            dirty.insert(self.path.clone());
        }
        let mut left = dirty.into_iter();
        while let Some(dir) = left.next() {
            match self.writer.sync_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    let e = io_err("flush", None, &dir, e);
                    self.failed(&e);
                    let mut dirty = self.dirty.lock().unwrap_or_else(|p| p.into_inner());
                    dirty.insert(dir);
                    dirty.extend(left);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    fn stats(&self) -> StoreStats {
        let (entries, bytes) = {
            let sizes = self.sizes();
            (sizes.len() as u64, sizes.values().sum())
        };
        StoreStats {
            disk_hits: self.hits.get(),
            disk_misses: self.misses.get(),
            corrupt: self.corrupt.get(),
            disk_bytes: bytes,
            entries,
            errors: self.errors.get(),
            ..StoreStats::default()
        }
    }

    fn keys(&self) -> Result<Vec<ChunkKey>> {
        let mut keys: Vec<ChunkKey> = self
            .files()
            .inspect_err(|e| self.failed(e))?
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        keys.sort_unstable_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
        Ok(keys)
    }
}

/// What a store directory holds.
enum Found {
    /// Nothing (or no directory yet).
    Empty,
    /// A store of this layout (it has `STORE`).
    Ours,
    /// A store of the earlier sled layout.
    Sled,
}

/// Refuses a path that is a file or a non-empty directory that holds no store.
fn classify(path: &Path) -> Result<Found> {
    let not_a_store = |reason: String| StoreError::NotAStore {
        path: path.to_path_buf(),
        reason,
    };
    if !path.exists() {
        return Ok(Found::Empty);
    }
    if !path.is_dir() {
        return Err(not_a_store("it is not a directory".into()));
    }
    let names: Vec<String> = std::fs::read_dir(path)
        .map_err(|e| not_a_store(format!("cannot list it: {e}")))?
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .collect();
    if names.is_empty() {
        return Ok(Found::Empty);
    }
    if names.iter().any(|n| n == MARKER_FILE) {
        return Ok(Found::Ours);
    }
    if SLED_FILES.iter().all(|f| names.iter().any(|n| n == f)) {
        return Ok(Found::Sled);
    }
    let mut shown: Vec<&str> = names.iter().map(String::as_str).collect();
    shown.sort_unstable();
    shown.truncate(5);
    Err(not_a_store(format!(
        "the directory holds {shown:?}{} but no chunk store (expected a `{MARKER_FILE}` file); \
         pass an empty or new directory",
        if names.len() > shown.len() {
            ", ..."
        } else {
            ""
        },
    )))
}

fn marker_text() -> String {
    format!("{MARKER}\nlayout {LAYOUT_VERSION}\n")
}

/// Makes `path` an empty store of this layout.
fn create_layout(path: &Path) -> Result<()> {
    let made = (|| -> std::io::Result<()> {
        std::fs::create_dir_all(path.join(TMP_DIR))?;
        let tmp = path.join(TMP_DIR).join(MARKER_FILE);
        let mut f = File::create(&tmp)?;
        f.write_all(marker_text().as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path.join(MARKER_FILE))?;
        File::open(path)?.sync_all()
    })();
    made.map_err(|e| io_err("create", None, path, e))
}

/// A `STORE` file that is not this layout's means damage (or a store of another version).
fn check_marker(path: &Path) -> Result<()> {
    let file = path.join(MARKER_FILE);
    let text = std::fs::read(&file).map_err(|e| StoreError::Damaged {
        path: path.to_path_buf(),
        reason: format!("cannot read {}: {e}", file.display()),
    })?;
    if text != marker_text().as_bytes() {
        return Err(StoreError::Damaged {
            path: path.to_path_buf(),
            reason: format!(
                "{} does not say `{MARKER}` / `layout {LAYOUT_VERSION}` (damaged, or written \
                 by another version)",
                file.display()
            ),
        });
    }
    Ok(())
}

/// Takes the store's lock, waiting up to [`LOCK_WAIT`] for one being released.
fn lock(path: &Path) -> Result<File> {
    let file = path.join(LOCK_FILE);
    let f = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&file)
        .map_err(|e| io_err("open", None, &file, e))?;
    let start = Instant::now();
    loop {
        match f.try_lock() {
            Ok(()) => return Ok(f),
            Err(std::fs::TryLockError::WouldBlock) if start.elapsed() < LOCK_WAIT => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(StoreError::InUse {
                    path: path.to_path_buf(),
                })
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io_err("open", None, &file, e)),
        }
    }
}

/// Copies every entry of the sled store at `path` that still reads into a store of this
/// layout, which takes its place. sled 0.34 can panic while recovering a damaged database;
/// that, like an error, means the store is damaged.
fn migrate_sled(path: &Path) -> Result<()> {
    let damaged = |reason: String| StoreError::Damaged {
        path: path.to_path_buf(),
        reason,
    };
    let fresh = aside_path(path, "migrating");
    create_layout(&fresh)?;
    let copied = std::panic::catch_unwind(|| copy_sled_entries(path, &fresh));
    let (kept, lost) = match copied {
        Ok(Ok(counts)) => counts,
        Ok(Err(reason)) => {
            let _ = std::fs::remove_dir_all(&fresh);
            return Err(damaged(format!(
                "a store of the earlier sled layout that sled cannot read: {reason}"
            )));
        }
        Err(_) => {
            let _ = std::fs::remove_dir_all(&fresh);
            return Err(damaged(
                "a store of the earlier sled layout whose recovery panicked in sled".into(),
            ));
        }
    };
    let old = aside_path(path, "sled");
    std::fs::rename(path, &old)
        .and_then(|()| std::fs::rename(&fresh, path))
        .map_err(|e| io_err("migrate", None, path, e))?;
    if let Err(e) = std::fs::remove_dir_all(&old) {
        tracing::warn!(path = %old.display(), "could not delete the migrated sled store: {e}");
    }
    tracing::warn!(
        path = %path.display(),
        kept,
        lost,
        "migrated the chunk KV store from the earlier sled layout to one file per chunk \
         (entries that could not be read are recomputed when next needed)"
    );
    Ok(())
}

/// The sled half of [`migrate_sled`]: (entries kept, entries lost).
fn copy_sled_entries(from: &Path, to: &Path) -> std::result::Result<(u64, u64), String> {
    let db = sled::Config::new()
        .path(from)
        .open()
        .map_err(|e| e.to_string())?;
    let blobs = db.open_tree("kv").map_err(|e| e.to_string())?;
    let (mut kept, mut lost) = (0u64, 0u64);
    for item in blobs.iter() {
        let Ok((key, value)) = item else {
            lost += 1;
            continue;
        };
        let Ok(key) = ChunkKey::from_bytes(&key) else {
            lost += 1;
            continue;
        };
        let hex = key.to_string();
        let shard = to.join(&hex[..2]);
        let written = std::fs::create_dir_all(&shard)
            .and_then(|()| std::fs::write(shard.join(format!("{hex}.{EXT}")), &value));
        match written {
            Ok(()) => kept += 1,
            Err(e) => return Err(format!("writing the migrated entry {hex}: {e}")),
        }
    }
    Ok((kept, lost))
}

/// `<path>.<what>-<unix seconds>` (a sibling, so a rename never crosses file systems).
fn aside_path(path: &Path, what: &str) -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{what}-{secs}"));
    let candidate = path.with_file_name(&name);
    if !candidate.exists() {
        return candidate;
    }
    // Two in one second: add a counter.
    (1u32..)
        .map(|n| {
            let mut name = name.clone();
            name.push(format!("-{n}"));
            path.with_file_name(name)
        })
        .find(|p| !p.exists())
        .unwrap_or(candidate)
}

/// A random suffix for temporary names (two writers of one key never share a file).
fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

pub(crate) fn io_err(
    op: &'static str,
    key: Option<&ChunkKey>,
    file: &Path,
    source: std::io::Error,
) -> StoreError {
    StoreError::Disk {
        op,
        key: key.copied(),
        file: file.to_path_buf(),
        source,
    }
}
