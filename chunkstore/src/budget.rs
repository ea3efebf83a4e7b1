//! The disk byte budget of KV stored at query time.
//!
//! Ingestion pins what it precomputes: those entries live as long as their chunks are
//! indexed. KV computed while answering (a chunk ingested with lazy KV, first retrieved; a
//! passage a client sent) is a cache entry instead, kept while it fits in a byte budget and
//! evicted by a policy when it does not. The policy is moka's (the crate the memory tier
//! already uses): W-TinyLFU, which admits a new entry only when it is estimated to be used
//! more often than the one it would push out, or plain LRU; `docs/performance.md` has the two
//! measured on a skewed query stream.
//!
//! Which entries are budgeted survives restarts in `BUDGET` beside the chunk files, an append
//! log of `+<key> <bytes>` and `-<key>` lines, compacted at open (a torn last line from a
//! crash is skipped); recency and frequency start afresh.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex};

use moka::notification::RemovalCause;
use moka::policy::EvictionPolicy;

use crate::error::{Result, StoreError};
use crate::key::ChunkKey;

/// The ledger's file name in the disk tier's directory.
pub const LEDGER_FILE: &str = "BUDGET";

/// Which budgeted entry goes first when the budget is full.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Eviction {
    /// W-TinyLFU: frequency-aware admission over an LRU window.
    #[default]
    TinyLfu,
    /// Least recently used.
    Lru,
}

impl FromStr for Eviction {
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

/// Budgeted entries, their stored sizes, and the policy that evicts them.
pub struct DiskBudget {
    cache: moka::sync::Cache<ChunkKey, u32>,
    /// Keys the policy evicted since the caller last drained them.
    evicted: Arc<Mutex<Vec<ChunkKey>>>,
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

/// The entries a ledger's lines leave, in the order they were first added.
fn replay(text: &str) -> Vec<(ChunkKey, u64)> {
    let mut live: HashMap<ChunkKey, (usize, u64)> = HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let (op, rest) = line.split_at(line.len().min(1));
        let mut words = rest.split(' ');
        let key = words.next().and_then(|k| k.parse::<ChunkKey>().ok());
        match (op, key, words.next().and_then(|b| b.parse::<u64>().ok())) {
            ("+", Some(k), Some(bytes)) => {
                live.entry(k).or_insert((n, bytes)).1 = bytes;
            }
            ("-", Some(k), None) => {
                live.remove(&k);
            }
            _ => {} // a torn line
        }
    }
    let mut out: Vec<_> = live.into_iter().collect();
    out.sort_by_key(|(_, (n, _))| *n);
    out.into_iter().map(|(k, (_, b))| (k, b)).collect()
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
        let compacted: String = entries.iter().map(|(k, b)| format!("+{k} {b}\n")).collect();
        let tmp = dir.join(format!("{LEDGER_FILE}.tmp"));
        std::fs::write(&tmp, compacted).map_err(|e| io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| io(&path, e))?;
        let ledger = OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|e| io(&path, e))?;
        let evicted = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&evicted);
        let cache = moka::sync::Cache::builder()
            .max_capacity(budget)
            .weigher(|_: &ChunkKey, bytes: &u32| *bytes)
            .eviction_policy(match policy {
                Eviction::TinyLfu => EvictionPolicy::tiny_lfu(),
                Eviction::Lru => EvictionPolicy::lru(),
            })
            .eviction_listener(move |k: Arc<ChunkKey>, _, cause: RemovalCause| {
                if cause.was_evicted() {
                    lock(&sink).push(*k);
                }
            })
            .build();
        let me = Self {
            cache,
            evicted,
            ledger: Mutex::new(ledger),
            path,
            budget,
        };
        let mut gone = Vec::new();
        for (k, b) in entries {
            gone.extend(me.admit(&k, b));
        }
        Ok((me, gone))
    }

    fn append(&self, line: &str) {
        if let Err(e) = lock(&self.ledger).write_all(line.as_bytes()) {
            tracing::warn!(path = %self.path.display(), "chunk store budget ledger: {e}");
        }
    }

    /// Budgets `key`, stored in `bytes` bytes. Returns the keys the policy evicted to make room
    /// (possibly `key` itself): the caller deletes their files.
    pub fn admit(&self, key: &ChunkKey, bytes: u64) -> Vec<ChunkKey> {
        self.append(&format!("+{key} {bytes}\n"));
        self.cache
            .insert(*key, u32::try_from(bytes).unwrap_or(u32::MAX));
        self.cache.run_pending_tasks();
        let gone = std::mem::take(&mut *lock(&self.evicted));
        for k in &gone {
            self.append(&format!("-{k}\n"));
        }
        gone
    }

    /// Notes a read of `key` (recency and frequency); nothing when it is not budgeted.
    pub fn touch(&self, key: &ChunkKey) {
        let _ = self.cache.get(key);
    }

    /// Stops budgeting `key` (it was pinned by ingestion, or removed); its file stays.
    pub fn forget(&self, key: &ChunkKey) {
        if self.cache.remove(key).is_some() {
            self.append(&format!("-{key}\n"));
        }
    }

    /// Whether `key` is budgeted.
    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.cache.contains_key(key)
    }

    /// Every budgeted key.
    pub fn keys(&self) -> Vec<ChunkKey> {
        self.cache.iter().map(|(k, _)| *k).collect()
    }

    /// Bytes the budgeted entries take, and the budget.
    pub fn usage(&self) -> (u64, u64) {
        self.cache.run_pending_tasks();
        (self.cache.weighted_size(), self.budget)
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
        assert!(b.admit(&key(1), 100).is_empty());
        assert!(b.admit(&key(2), 100).is_empty());
        b.touch(&key(1));
        assert!(b.admit(&key(3), 100).is_empty());
        // Full: the least recently used (2) goes.
        assert_eq!(b.admit(&key(4), 100), vec![key(2)]);
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
        let text = format!("+{a} 10\n+{b} 20\n-{a}\n+{a} 3");
        assert_eq!(replay(&text), vec![(b, 20), (a, 3)]);
        assert_eq!(replay(&format!("+{b} 20\n+{a}")), vec![(b, 20)]);
        assert!("fifo".parse::<Eviction>().is_err());
        assert_eq!("lru".parse::<Eviction>(), Ok(Eviction::Lru));
    }
}
