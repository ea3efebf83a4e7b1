//! What the disk budget and the pins promise under faults and under several tenants: every
//! budgeted entry has its file and every file is pinned or budgeted (a full disk leaves no
//! phantom entry and loses no pin), an evicted entry is gone from memory too, a key pinned
//! while the budget evicts keeps its file, and one collection's writes never evict another
//! collection's entries, on disk or in memory.

mod common;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use chunkstore::{BlobWriter, ChunkStore, DiskStore, Eviction, MemoryStore, TieredStore};
use common::{key, small, TestResult};

/// A disk that fills up: writes succeed until `room` bytes are used, then the write in
/// progress stops part way with ENOSPC (as `write(2)` does), leaving a partial file.
struct FullDisk {
    room: AtomicU64,
}

impl BlobWriter for FullDisk {
    fn write_new(&self, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
        let want = bytes.len() as u64;
        let left = self.room.load(Ordering::SeqCst);
        if want > left {
            std::fs::write(path, &bytes[..left as usize])?;
            self.room.store(0, Ordering::SeqCst);
            return Err(std::io::Error::from_raw_os_error(28));
        }
        self.room.fetch_sub(want, Ordering::SeqCst);
        std::fs::write(path, bytes)
    }
}

/// A tiered store over `dir` whose disk takes `room` more bytes, under a budget of `budget`.
fn store_on(dir: &Path, room: u64, budget: u64) -> Result<TieredStore, chunkstore::StoreError> {
    let disk = DiskStore::open(dir)?.with_writer(Arc::new(FullDisk {
        room: AtomicU64::new(room),
    }));
    TieredStore::new(MemoryStore::new(1 << 30), disk).with_budget(budget, Eviction::Lru)
}

/// Bytes of one stored `small` blob.
fn one_file() -> Result<u64, Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let disk = DiskStore::open(dir.path())?;
    disk.put(&key(0), Arc::new(small(0)))?;
    Ok(disk.stored_bytes(&key(0)).unwrap_or(0))
}

/// Every budgeted key has its file, and the budget's bytes are its files' bytes.
fn assert_budget_matches_files(store: &TieredStore) {
    let budget = store.budget().expect("a budget");
    let mut bytes = 0;
    for k in store.cached_keys() {
        assert!(
            store.disk().contains(&k).unwrap_or(false),
            "budgeted {k} has no file"
        );
        bytes += store.disk().stored_bytes(&k).unwrap_or(0);
    }
    assert_eq!(budget.usage().0, bytes, "budget bytes != its files' bytes");
}

/// Regression (issue 57): on a full disk the write error was swallowed, the entry was
/// budgeted anyway (a phantom with no file, pushing real files out of the budget), and a
/// pinned put reported success, so ingestion indexed chunks whose KV was on no disk.
#[test]
fn a_full_disk_leaves_no_phantom_entry_and_no_lost_pin() -> TestResult {
    let dir = tempfile::tempdir()?;
    let size = one_file()?;
    // Room for three files, a budget of four.
    let store = store_on(dir.path(), 3 * size, 4 * size)?;
    store.put(&key(1), Arc::new(small(1)))?; // pinned
    store.put_cached("docs", &key(2), Arc::new(small(2)))?;
    store.put_cached("docs", &key(3), Arc::new(small(3)))?;
    // The disk is full now.
    store.put_cached("docs", &key(4), Arc::new(small(4)))?;
    store.put_cached("docs", &key(5), Arc::new(small(5)))?;
    assert!(!store.disk().contains(&key(4))? && !store.disk().contains(&key(5))?);
    assert!(
        !store.cached_keys().contains(&key(4)) && !store.cached_keys().contains(&key(5)),
        "a write that failed was budgeted"
    );
    assert_budget_matches_files(&store);
    // The real files are all still there: nothing was pushed out by phantoms.
    for i in 1..=3 {
        assert!(store.disk().contains(&key(i))?, "key {i} lost");
    }
    // A pinned put that cannot be written is an error, and leaves nothing behind.
    assert!(store.put(&key(6), Arc::new(small(6))).is_err());
    assert!(!store.disk().contains(&key(6))?);
    // Pinning what only memory holds needs the disk: an error too, never a silent success.
    assert!(
        store.memory().contains(&key(4))?,
        "kept in memory for the request"
    );
    assert!(store.hold(&key(4)).is_err());
    // The pinned entry and the budgeted ones survive a reopen with a working disk.
    drop(store);
    let store = TieredStore::open(dir.path(), 1 << 30)?.with_budget(4 * size, Eviction::Lru)?;
    assert!(store.disk().contains(&key(1))?);
    assert_eq!(store.cached_keys().len(), 2);
    assert_budget_matches_files(&store);
    let tmp_left = std::fs::read_dir(dir.path().join("tmp"))?.count();
    assert_eq!(tmp_left, 0, "partial writes are cleaned up");
    Ok(())
}

/// Regression (issue 57): budget eviction deleted the file but left the memory copy, and
/// an eager ingestion then counted the memory-only copy as stored: an indexed chunk with no
/// file.
#[test]
fn an_evicted_entry_is_gone_from_memory_too() -> TestResult {
    let dir = tempfile::tempdir()?;
    let size = one_file()?;
    let store = TieredStore::open(dir.path(), 1 << 30)?.with_budget(size, Eviction::Lru)?;
    store.put_cached("docs", &key(1), Arc::new(small(1)))?;
    store.put_cached("docs", &key(2), Arc::new(small(2)))?;
    assert!(!store.disk().contains(&key(1))?, "evicted from disk");
    assert!(
        !store.memory().contains(&key(1))?,
        "but still served from memory"
    );
    // Ingestion finds nothing to pin, so it computes and writes the chunk.
    assert!(!store.hold(&key(1))?);
    // What memory does hold is pinned onto disk.
    store.memory().put(&key(7), Arc::new(small(7)))?;
    assert!(store.hold(&key(7))?);
    assert!(store.disk().contains(&key(7))?);
    assert!(!store.cached_keys().contains(&key(7)));
    Ok(())
}

/// Eviction racing an ingestion of the same keys: one thread stores query-time KV under a
/// budget too small to keep it all (evicting all the time), another pins the same keys as an
/// eager ingestion would. Every key a pin reported held is on disk and out of the budget at
/// the end, and the budget's bytes are its files'.
#[test]
fn eviction_racing_an_ingestion_of_the_same_keys_loses_no_pin() -> TestResult {
    let dir = tempfile::tempdir()?;
    let size = one_file()?;
    let store =
        Arc::new(TieredStore::open(dir.path(), 1 << 30)?.with_budget(3 * size, Eviction::Lru)?);
    let writer = {
        let store = Arc::clone(&store);
        std::thread::spawn(move || -> Result<(), chunkstore::StoreError> {
            for round in 0..20u32 {
                for i in 0..40u32 {
                    let i = (i * 7 + round) % 40;
                    store.put_cached("docs", &key(i), Arc::new(small(i)))?;
                }
            }
            Ok(())
        })
    };
    let mut held = Vec::new();
    for round in 0..20u32 {
        for i in (round % 2..40).step_by(2) {
            if store.hold(&key(i))? {
                held.push(i);
            } else {
                store.put(&key(i), Arc::new(small(i)))?;
                held.push(i);
            }
        }
    }
    writer.join().map_err(|_| "writer panicked")??;
    held.sort_unstable();
    held.dedup();
    for i in held {
        assert!(
            store.disk().contains(&key(i))?,
            "pinned key {i} lost its file"
        );
        assert!(
            !store.cached_keys().contains(&key(i)),
            "pinned key {i} budgeted"
        );
    }
    assert_budget_matches_files(&store);
    Ok(())
}

/// Regression (issue 57): tenants shared one disk budget and one memory tier, so tenant A,
/// in its own collection, flushed tenant B's query-time KV (B then recomputed it). Each
/// collection now holds a fair share of both, and only its own writes evict its entries.
#[test]
fn one_collection_cannot_flush_another_collections_kv() -> TestResult {
    let dir = tempfile::tempdir()?;
    let size = one_file()?;
    let one = small(0).payload_bytes() as u64;
    let store = TieredStore::open(dir.path(), 4 * one)?.with_budget(4 * size, Eviction::Lru)?;
    store.put_cached("beta", &key(1), Arc::new(small(1)))?;
    store.put_cached("beta", &key(2), Arc::new(small(2)))?;
    for i in 100..160 {
        store.put_cached("alpha", &key(i), Arc::new(small(i)))?;
        store.touch(&key(i));
    }
    for i in [1, 2] {
        assert!(
            store.disk().contains(&key(i))?,
            "beta's {i} flushed from disk"
        );
        assert!(
            store.memory().contains(&key(i))?,
            "beta's {i} flushed from memory"
        );
    }
    let budget = store.budget().ok_or("budget")?;
    assert!(budget.usage().0 <= 4 * size);
    let per = budget.usage_by_collection();
    let beta_files = store.disk().stored_bytes(&key(1)).unwrap_or(0)
        + store.disk().stored_bytes(&key(2)).unwrap_or(0);
    assert_eq!(per.len(), 2, "{per:?}");
    assert_eq!(per[1], ("beta".to_string(), beta_files));
    assert!(
        per[0].0 == "alpha" && per[0].1 > 0 && per[0].1 <= 2 * size,
        "{per:?}"
    );
    assert_budget_matches_files(&store);
    // The shares survive a reopen (the ledger names each entry's collection).
    drop(store);
    let store = TieredStore::open(dir.path(), 4 * one)?.with_budget(4 * size, Eviction::Lru)?;
    store.put_cached("alpha", &key(200), Arc::new(small(200)))?;
    assert!(store.disk().contains(&key(1))? && store.disk().contains(&key(2))?);
    Ok(())
}
