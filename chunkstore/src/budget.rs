//! The disk byte budget of KV stored at query time.
//!
//! Ingestion pins what it precomputes: those entries live as long as their chunks are
//! indexed. KV computed while answering (a chunk ingested with lazy KV, first retrieved; a
//! passage a client sent) is a cache entry instead, kept while it fits in a byte budget and
//! evicted by a policy when it does not. The policy is moka's (the crate the memory tier
//! already uses): W-TinyLFU, which admits a new entry only when it is estimated to be used
//! more often than the one it would push out, or plain LRU; `docs/usage.md` (*Ingest*, the
//! disk budget) has the two measured on a skewed query stream.
//!
//! The budget is shared fairly by collections ([`crate::shares`]): each collection with
//! budgeted KV may hold an equal share of it, and its entries are evicted only to make room
//! for its own (or for a collection that arrives and takes its share), so one tenant's
//! traffic never flushes another tenant's KV.
//!
//! Which entries are budgeted, and for which collection, survives restarts in `BUDGET`
//! beside the chunk files, an append log of `+<key> <bytes> <collection>` and `-<key>`
//! lines, compacted at open (a torn last line from a crash is skipped; a line without a
//! collection, written before budgets were shared, belongs to the collection `""`); recency
//! and frequency start afresh.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{Result, StoreError};
use crate::key::ChunkKey;
use crate::shares::Shares;

pub use crate::shares::Eviction;

/// The ledger's file name in the disk tier's directory.
pub const LEDGER_FILE: &str = "BUDGET";

/// Budgeted entries, their stored sizes and collections, and the policy that evicts them.
pub struct DiskBudget {
    shares: Shares<u32>,
    ledger: Mutex<File>,
    path: PathBuf,
    budget: u64,
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

impl DiskBudget {
    /// Opens (or starts) the ledger in `dir` with a budget of `budget` bytes. Returns the
    /// budget and the keys it no longer holds (over a budget lowered since): the caller
    /// deletes those.
    pub fn open(dir: &Path, budget: u64, policy: Eviction) -> Result<(Self, Vec<ChunkKey>)> {
        let path = dir.join(LEDGER_FILE);
        let text = match std::fs::read(&path) {
            Ok(b) => String::from_utf8_lossy(&b).into_owned(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(io(&path, e)),
        };
        let entries = replay(&text);
        let compacted: String = entries
            .iter()
            .map(|(k, b, o)| format!("+{k} {b} {o}\n"))
            .collect();
        let tmp = dir.join(format!("{LEDGER_FILE}.tmp"));
        std::fs::write(&tmp, compacted).map_err(|e| io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| io(&path, e))?;
        let ledger = OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|e| io(&path, e))?;
        let me = Self {
            shares: Shares::new(budget, policy, weigh),
            ledger: Mutex::new(ledger),
            path,
            budget,
        };
        let mut gone = Vec::new();
        for (k, b, o) in entries {
            gone.extend(me.admit(&o, &k, b));
        }
        Ok((me, gone))
    }

    fn append(&self, line: &str) {
        if let Err(e) = lock(&self.ledger).write_all(line.as_bytes()) {
            tracing::warn!(path = %self.path.display(), "chunk store budget ledger: {e}");
        }
    }

    /// Budgets `key` for `collection`, stored in `bytes` bytes. Returns the keys the policy
    /// evicted to make room (possibly `key` itself; only `collection`'s own, unless it is new
    /// to the budget and takes its share): the caller deletes their files.
    pub fn admit(&self, collection: &str, key: &ChunkKey, bytes: u64) -> Vec<ChunkKey> {
        self.append(&format!("+{key} {bytes} {collection}\n"));
        let gone = self
            .shares
            .insert(collection, *key, u32::try_from(bytes).unwrap_or(u32::MAX));
        for k in &gone {
            self.append(&format!("-{k}\n"));
        }
        gone
    }

    /// Notes a read of `key` (recency and frequency); nothing when it is not budgeted.
    pub fn touch(&self, key: &ChunkKey) {
        let _ = self.shares.get(key);
    }

    /// Stops budgeting `key` (it was pinned by ingestion, or removed); its file stays. A key
    /// the policy evicted but the caller has not been told of yet is kept too: its file is
    /// not deleted.
    pub fn forget(&self, key: &ChunkKey) {
        if self.shares.remove(key) {
            self.append(&format!("-{key}\n"));
        }
    }

    /// Whether `key` is budgeted.
    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.shares.contains(key)
    }

    /// Every budgeted key.
    pub fn keys(&self) -> Vec<ChunkKey> {
        self.shares.entries().into_iter().map(|(k, _)| k).collect()
    }

    /// Bytes the budgeted entries take, and the budget.
    pub fn usage(&self) -> (u64, u64) {
        (self.shares.usage().0, self.budget)
    }

    /// Bytes each collection's budgeted entries take.
    pub fn usage_by_collection(&self) -> Vec<(String, u64)> {
        self.shares.usage().1
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
