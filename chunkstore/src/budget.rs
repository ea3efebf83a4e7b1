//! The disk byte budget of KV stored at query time.
//!
//! Ingestion pins what it precomputes: those entries live as long as their chunks are
//! indexed. KV computed while answering (a chunk ingested with lazy KV, first retrieved; a
//! passage a client sent) is a cache entry instead, kept while it fits in a byte budget and
//! evicted by a policy when it does not: least recently used, with or without TinyLFU
//! admission (a new entry is kept only when it is estimated to be read more often than what
//! it would push out); `docs/usage.md` (*Ingest*, the disk budget) has the two measured on a
//! skewed query stream.
//!
//! The budget is shared by collections ([`crate::shares`]): each has a floor of the budget
//! divided by the configured number of tenants, and while a collection holds no more than
//! its floor no other collection's writes evict its entries; beyond it a collection borrows
//! free room, which others reclaim. When no room can be found that way a new entry is
//! refused, so new collections cannot flush a tenant's KV.
//!
//! Which entries are budgeted, and for which collection, survives restarts in `BUDGET`
//! beside the chunk files, an append log of `+<key> <bytes> <collection>` and `-<key>` lines
//! (a torn line from a crash is skipped; a line without a collection, written before budgets
//! were shared, belongs to the collection `""`). Every budgeted file has its live `+` line
//! from before the file exists: the caller writes the line ([`DiskBudget::intend`], synced),
//! then the blob, then admits it; an eviction deletes the file before its `-` line is
//! written. So after a crash or a failed append no budgeted blob is outside the ledger: at
//! open, a live line whose file is missing is dropped and one whose file is there is
//! budgeted, and a file without a live line is a pinned one (or garbage of the index's,
//! which the gateway's garbage collection removes). The log is rewritten from what it holds
//! (a temporary file, synced and renamed over it) at open, while serving once its dead lines
//! outnumber its live ones twice, and after an append failed part way. Recency survives a
//! rewrite (lines are written least recently used first); read frequencies start afresh.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::disk::{BlobWriter, FsWriter};
use crate::error::{Result, StoreError};
use crate::key::ChunkKey;
use crate::shares::{Shares, DEFAULT_TENANTS};

pub use crate::shares::Eviction;

/// The ledger's file name in the disk tier's directory.
pub const LEDGER_FILE: &str = "BUDGET";

/// The ledger is rewritten while serving once its dead lines exceed twice its live ones
/// (counted as at least this many, so a small ledger is not rewritten every few lines).
const COMPACT_FLOOR: u64 = 64;

/// How large a disk budget is, how it evicts, and among how many tenants it is divided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetConfig {
    /// The budget in stored bytes.
    pub bytes: u64,
    /// Which of a collection's entries goes first.
    pub policy: Eviction,
    /// Each collection's floor is `bytes / tenants`.
    pub tenants: u32,
}

impl BudgetConfig {
    /// A budget of `bytes` evicted by `policy`, divided among [`DEFAULT_TENANTS`].
    pub fn new(bytes: u64, policy: Eviction) -> Self {
        Self {
            bytes,
            policy,
            tenants: DEFAULT_TENANTS,
        }
    }
}

/// The open ledger file and what it holds besides the budgeted entries.
struct Ledger {
    /// Appended to; `None` when a rewrite failed after replacing the file.
    file: Option<File>,
    /// Lines in the file.
    lines: u64,
    /// Keys with a live `+` line that the budget does not hold (bytes, collection): written
    /// ahead of their blob and not admitted yet, or evicted and their file not deleted yet.
    /// A rewrite keeps their lines: their file may exist.
    pending: HashMap<ChunkKey, (u64, String)>,
    /// An append or a rewrite failed part way: the file is rewritten before the next line.
    broken: bool,
}

/// Budgeted entries, their stored sizes and collections, and the policy that evicts them.
pub struct DiskBudget {
    shares: Shares<u32>,
    ledger: Mutex<Ledger>,
    dir: PathBuf,
    path: PathBuf,
    budget: u64,
    writer: Arc<dyn BlobWriter>,
}

impl std::fmt::Debug for DiskBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskBudget")
            .field("path", &self.path)
            .field("budget", &self.budget)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn io(path: &Path, source: std::io::Error) -> StoreError {
    crate::disk::io_err("budget ledger", None, path, source)
}

/// A budgeted entry as the ledger records it: key, stored bytes, collection.
type Entry = (ChunkKey, u64, String);

/// The entries a ledger's lines leave, in the order they were first added.
fn replay(text: &str) -> Vec<Entry> {
    let mut live: HashMap<ChunkKey, (usize, u64, String)> = HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let (op, rest) = line.split_at(line.len().min(1));
        let mut words = rest.split(' ');
        let key = words.next().and_then(|k| k.parse::<ChunkKey>().ok());
        let bytes = words.next().and_then(|b| b.parse::<u64>().ok());
        let owner = words.next().unwrap_or_default().to_string();
        match (op, key, bytes) {
            ("+", Some(k), Some(bytes)) if words.next().is_none() => {
                let e = live.entry(k).or_insert((n, bytes, String::new()));
                (e.1, e.2) = (bytes, owner);
            }
            ("-", Some(k), None) => {
                live.remove(&k);
            }
            _ => {} // a torn line
        }
    }
    let mut out: Vec<_> = live.into_iter().collect();
    out.sort_by_key(|(_, (n, _, _))| *n);
    out.into_iter().map(|(k, (_, b, o))| (k, b, o)).collect()
}

fn weigh(bytes: &u32) -> u32 {
    *bytes
}

fn weight(bytes: u64) -> u32 {
    u32::try_from(bytes).unwrap_or(u32::MAX)
}

fn added(key: &ChunkKey, bytes: u64, collection: &str) -> String {
    format!("+{key} {bytes} {collection}\n")
}

impl DiskBudget {
    /// Opens (or starts) the ledger in `dir` with a budget of `budget` bytes, trusting its
    /// lines. Returns the budget and the keys it no longer holds (over a budget lowered
    /// since): the caller deletes those and then reports them [`DiskBudget::dropped`].
    pub fn open(dir: &Path, budget: u64, policy: Eviction) -> Result<(Self, Vec<ChunkKey>)> {
        Self::open_with(
            dir,
            BudgetConfig::new(budget, policy),
            Arc::new(FsWriter),
            &|_, bytes| Some(bytes),
        )
    }

    /// Opens (or starts) the ledger in `dir` under `config`, appending and rewriting it
    /// through `writer`, and reconciles it with the files: `stored(key, bytes)` is the size
    /// of `key`'s file (`None`: there is none), given the size its line records. A line
    /// whose file is missing (written ahead of a blob a crash or a failure stopped) is
    /// dropped; one whose file is there is budgeted at the file's size. Returns the budget
    /// and the keys it no longer holds, as [`DiskBudget::open`].
    pub fn open_with(
        dir: &Path,
        config: BudgetConfig,
        writer: Arc<dyn BlobWriter>,
        stored: &dyn Fn(&ChunkKey, u64) -> Option<u64>,
    ) -> Result<(Self, Vec<ChunkKey>)> {
        let path = dir.join(LEDGER_FILE);
        let text = match std::fs::read(&path) {
            Ok(b) => String::from_utf8_lossy(&b).into_owned(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(io(&path, e)),
        };
        let shares = Shares::new(config.bytes, config.policy, weigh);
        shares.set_tenants(config.tenants);
        // What the budget no longer holds keeps its line until the caller deleted its file.
        let mut pending = HashMap::new();
        for (key, bytes, owner) in replay(&text) {
            let Some(bytes) = stored(&key, bytes) else {
                continue;
            };
            for (k, o, b) in shares.insert_reporting(&owner, key, weight(bytes)) {
                pending.insert(k, (b, o));
            }
        }
        let gone = pending.keys().copied().collect();
        let me = Self {
            shares,
            ledger: Mutex::new(Ledger {
                file: None,
                lines: 0,
                pending,
                broken: true,
            }),
            dir: dir.to_path_buf(),
            path,
            budget: config.bytes,
            writer,
        };
        me.rewrite(&mut lock(&me.ledger))?;
        Ok((me, gone))
    }

    /// Replaces the ledger file with the lines of what it holds: a temporary file, synced,
    /// renamed over it, the directory synced. A failure leaves the ledger marked for another
    /// try before the next line.
    fn rewrite(&self, ledger: &mut Ledger) -> Result<()> {
        ledger.broken = true;
        let mut text = String::new();
        for (k, (b, o)) in &ledger.pending {
            text.push_str(&added(k, *b, o));
        }
        for (k, o, b) in self.shares.entries() {
            text.push_str(&added(&k, b, &o));
        }
        let tmp = self.dir.join(format!("{LEDGER_FILE}.tmp"));
        self.writer
            .write_new(&tmp, text.as_bytes())
            .map_err(|e| io(&tmp, e))?;
        ledger.file = None;
        std::fs::rename(&tmp, &self.path).map_err(|e| io(&self.path, e))?;
        self.writer
            .sync_dir(&self.dir)
            .map_err(|e| io(&self.dir, e))?;
        let file = OpenOptions::new()
            .append(true)
            .open(&self.path)
            .map_err(|e| io(&self.path, e))?;
        ledger.file = Some(file);
        ledger.lines = text.lines().count() as u64;
        ledger.broken = false;
        Ok(())
    }

    /// Appends `line` (after rewriting the file if an earlier write failed), then rewrites
    /// the file if its dead lines outnumber its live ones twice.
    fn append(&self, ledger: &mut Ledger, line: &str) -> Result<()> {
        if ledger.broken || ledger.file.is_none() {
            self.rewrite(ledger)?;
        }
        let Some(file) = ledger.file.as_mut() else {
            return Err(io(&self.path, std::io::ErrorKind::NotFound.into()));
        };
        if let Err(e) = self.writer.append(file, line.as_bytes()) {
            ledger.broken = true;
            return Err(io(&self.path, e));
        }
        ledger.lines += 1;
        let live = self.shares.len() + ledger.pending.len() as u64;
        if ledger.lines - live.min(ledger.lines) > 2 * live.max(COMPACT_FLOOR) {
            // A failed rewrite is retried before the next line; this one is written.
            if let Err(e) = self.rewrite(ledger) {
                tracing::warn!(path = %self.path.display(), "chunk store budget ledger: {e}");
            }
        }
        Ok(())
    }

    /// [`DiskBudget::append`], a failure logged: the file is rewritten before the next line.
    fn append_or_log(&self, ledger: &mut Ledger, line: &str) {
        if let Err(e) = self.append(ledger, line) {
            tracing::warn!(path = %self.path.display(), "chunk store budget ledger: {e}");
        }
    }

    /// Records, durably, that `key` of `bytes` bytes is about to be written for `collection`,
    /// before its blob is: a blob written after a failed call here would be outside the
    /// budget, so the caller writes it only on `Ok`. Then either [`DiskBudget::admit`] (the
    /// blob is written) or [`DiskBudget::dropped`] (it is not).
    pub fn intend(&self, collection: &str, key: &ChunkKey, bytes: u64) -> Result<()> {
        let mut ledger = lock(&self.ledger);
        ledger.pending.insert(*key, (bytes, collection.to_string()));
        let synced = self
            .append(&mut ledger, &added(key, bytes, collection))
            .and_then(|()| match &ledger.file {
                Some(f) => f.sync_data().map_err(|e| io(&self.path, e)),
                None => Ok(()),
            });
        if synced.is_err() {
            ledger.pending.remove(key);
            ledger.broken = true;
        }
        synced
    }

    /// Budgets `key` for `collection`, stored in `bytes` bytes (its line written first unless
    /// [`DiskBudget::intend`] wrote it). Returns the keys the budget no longer holds (possibly
    /// `key` itself; another collection's only while it holds more than its floor): the
    /// caller deletes their files and then reports them [`DiskBudget::dropped`].
    pub fn admit(&self, collection: &str, key: &ChunkKey, bytes: u64) -> Vec<ChunkKey> {
        let mut ledger = lock(&self.ledger);
        if !ledger.pending.contains_key(key) {
            self.append_or_log(&mut ledger, &added(key, bytes, collection));
        }
        let removed = self
            .shares
            .insert_reporting(collection, *key, weight(bytes));
        ledger.pending.remove(key);
        let mut gone = Vec::with_capacity(removed.len());
        for (k, o, b) in removed {
            // A refused key weighs what its weigher gave: its line records the real bytes.
            let b = if k == *key { bytes } else { b };
            ledger.pending.insert(k, (b, o));
            gone.push(k);
        }
        gone
    }

    /// Notes that the files of `keys`, evicted or written ahead and never stored, are gone:
    /// their `-` lines are written now, after the files went.
    pub fn dropped(&self, keys: &[ChunkKey]) {
        let mut ledger = lock(&self.ledger);
        for key in keys {
            if ledger.pending.remove(key).is_some() && !self.shares.contains(key) {
                self.append_or_log(&mut ledger, &format!("-{key}\n"));
            }
        }
    }

    /// Notes a read of `key` (recency and frequency); nothing when it is not budgeted.
    pub fn touch(&self, key: &ChunkKey) {
        let _ = self.shares.get(key);
    }

    /// Stops budgeting `key` (it was pinned by ingestion, or removed); its file stays.
    pub fn forget(&self, key: &ChunkKey) {
        let mut ledger = lock(&self.ledger);
        let pending = ledger.pending.remove(key).is_some();
        if self.shares.remove(key) || pending {
            self.append_or_log(&mut ledger, &format!("-{key}\n"));
        } else if ledger.broken {
            // A `+` line of `key` may have been left by the failed write: the rewrite drops it.
            if let Err(e) = self.rewrite(&mut ledger) {
                tracing::warn!(path = %self.path.display(), "chunk store budget ledger: {e}");
            }
        }
    }

    /// Makes every line written so far durable (rewriting the file if a write failed).
    pub fn sync(&self) -> Result<()> {
        let mut ledger = lock(&self.ledger);
        if ledger.broken || ledger.file.is_none() {
            return self.rewrite(&mut ledger);
        }
        match &ledger.file {
            Some(f) => f.sync_data().map_err(|e| io(&self.path, e)),
            None => Ok(()),
        }
    }

    /// Divides the budget among `tenants` from now on (each collection's floor).
    pub fn set_tenants(&self, tenants: u32) {
        self.shares.set_tenants(tenants);
    }

    /// Whether `key` is budgeted.
    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.shares.contains(key)
    }

    /// Every budgeted key.
    pub fn keys(&self) -> Vec<ChunkKey> {
        self.shares.entries().into_iter().map(|(k, ..)| k).collect()
    }

    /// Bytes the budgeted entries take, and the budget.
    pub fn usage(&self) -> (u64, u64) {
        (self.shares.usage().0, self.budget)
    }

    /// Bytes each collection's budgeted entries take.
    pub fn usage_by_collection(&self) -> Vec<(String, u64)> {
        self.shares.usage().1
    }

    /// The bytes of the budget no other collection's writes can take from a collection.
    pub fn floor(&self) -> u64 {
        self.shares.floor()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> ChunkKey {
        ChunkKey::new("model", "collection", "mode", &[u32::from(i)])
    }

    #[test]
    fn the_budget_evicts_and_survives_a_reopen() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| io(Path::new("tmp"), e))?;
        let (b, gone) = DiskBudget::open(dir.path(), 300, Eviction::Lru)?;
        assert!(gone.is_empty());
        assert!(b.admit("c", &key(1), 100).is_empty());
        assert!(b.admit("c", &key(2), 100).is_empty());
        b.touch(&key(1));
        assert!(b.admit("c", &key(3), 100).is_empty());
        // Full: the least recently used (2) goes.
        assert_eq!(b.admit("c", &key(4), 100), vec![key(2)]);
        b.dropped(&[key(2)]);
        b.forget(&key(3));
        assert!(!b.contains(&key(3)) && b.contains(&key(1)));
        assert_eq!(b.usage(), (200, 300));
        drop(b);
        let (b, gone) = DiskBudget::open(dir.path(), 300, Eviction::Lru)?;
        let mut keys = b.keys();
        keys.sort_by_key(|k| k.to_string());
        let mut want = vec![key(1), key(4)];
        want.sort_by_key(|k| k.to_string());
        assert_eq!((keys, gone), (want, vec![]));
        drop(b);
        // A budget lowered since: what no longer fits is handed back to delete.
        let (b, gone) = DiskBudget::open(dir.path(), 150, Eviction::Lru)?;
        assert_eq!((b.keys().len(), gone.len()), (1, 1));
        Ok(())
    }

    #[test]
    fn a_torn_ledger_line_is_skipped() {
        let (a, b) = (key(1), key(2));
        let text = format!("+{a} 10 x\n+{b} 20\n-{a}\n+{a} 3 y");
        assert_eq!(
            replay(&text),
            vec![(b, 20, String::new()), (a, 3, "y".to_string())]
        );
        assert_eq!(
            replay(&format!("+{b} 20 x\n+{a}")),
            vec![(b, 20, "x".to_string())]
        );
        assert!("fifo".parse::<Eviction>().is_err());
        assert_eq!("lru".parse::<Eviction>(), Ok(Eviction::Lru));
    }
}
