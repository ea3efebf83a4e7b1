//! One suite, every backend: the same `ChunkStore` behaviour from memory, disk and tiered stores,
//! then what is particular to each.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;

use chunkstore::{ChunkStore, DiskStore, MemoryStore, StoreError, TieredStore};
use common::{blob, key, small, TestResult};
use tempfile::TempDir;

/// A store and the directory it lives in (unused by the memory store).
type Opened = (Box<dyn ChunkStore>, TempDir);

fn memory() -> Result<Opened, Box<dyn std::error::Error>> {
    Ok((Box::new(MemoryStore::new(1 << 30)), tempfile::tempdir()?))
}

fn disk() -> Result<Opened, Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    Ok((Box::new(DiskStore::open(dir.path())?), dir))
}

fn tiered() -> Result<Opened, Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    Ok((Box::new(TieredStore::open(dir.path(), 1 << 30)?), dir))
}

/// Lookups answered by any tier.
fn hits(store: &dyn ChunkStore) -> u64 {
    let s = store.stats();
    s.memory_hits + s.disk_hits
}

/// Lookups some tier could not answer.
fn misses(store: &dyn ChunkStore) -> u64 {
    let s = store.stats();
    s.memory_misses + s.disk_misses
}

mod cases {
    use super::*;

    pub fn roundtrip(store: &dyn ChunkStore) -> TestResult {
        let b = small(1);
        store.put(&key(1), Arc::new(b.clone()))?;
        assert!(store.contains(&key(1))?);
        let got = store.get(&key(1))?.ok_or("stored blob missing")?;
        assert_eq!(*got, b);
        Ok(())
    }

    pub fn roundtrip_without_scores(store: &dyn ChunkStore) -> TestResult {
        let mut b = small(2);
        b.scores = None;
        store.put(&key(2), Arc::new(b.clone()))?;
        assert_eq!(store.get(&key(2))?.as_deref(), Some(&b));
        Ok(())
    }

    pub fn missing_key_is_none(store: &dyn ChunkStore) -> TestResult {
        store.put(&key(1), Arc::new(small(1)))?;
        assert!(store.get(&key(99))?.is_none());
        assert!(!store.contains(&key(99))?);
        Ok(())
    }

    pub fn remove(store: &dyn ChunkStore) -> TestResult {
        store.put(&key(1), Arc::new(small(1)))?;
        store.put(&key(2), Arc::new(small(2)))?;
        store.remove(&key(1))?;
        assert!(store.get(&key(1))?.is_none());
        assert!(!store.contains(&key(1))?);
        assert!(
            store.get(&key(2))?.is_some(),
            "removing one key kept the other"
        );
        store.remove(&key(1))?; // absent: not an error
        assert_eq!(store.stats().entries, 1);
        Ok(())
    }

    pub fn overwrite(store: &dyn ChunkStore) -> TestResult {
        store.put(&key(1), Arc::new(small(1)))?;
        let newer = blob(3, 8, 5, 2);
        store.put(&key(1), Arc::new(newer.clone()))?;
        assert_eq!(store.get(&key(1))?.as_deref(), Some(&newer));
        assert_eq!(store.stats().entries, 1);
        Ok(())
    }

    pub fn stats_count_lookups(store: &dyn ChunkStore) -> TestResult {
        assert_eq!(
            (hits(store), misses(store), store.stats().entries),
            (0, 0, 0)
        );
        store.put(&key(1), Arc::new(small(1)))?;
        store.get(&key(1))?;
        store.get(&key(1))?;
        assert_eq!(hits(store), 2);
        assert_eq!(misses(store), 0);
        store.get(&key(2))?;
        assert_eq!(hits(store), 2);
        assert!(misses(store) >= 1);
        // contains is not a lookup
        store.contains(&key(3))?;
        let before = misses(store);
        store.contains(&key(3))?;
        assert_eq!(misses(store), before);
        let s = store.stats();
        assert_eq!(s.entries, 1);
        assert_eq!(s.corrupt, 0);
        assert!(s.memory_bytes + s.disk_bytes > 0);
        Ok(())
    }

    pub fn many_entries(store: &dyn ChunkStore) -> TestResult {
        let n = 200;
        for i in 0..n {
            store.put(&key(i), Arc::new(blob(2, 4, 1 + i as usize % 7, i)))?;
        }
        for i in 0..n {
            let got = store
                .get(&key(i))?
                .ok_or_else(|| format!("entry {i} missing"))?;
            assert_eq!(*got, blob(2, 4, 1 + i as usize % 7, i));
        }
        let keys: BTreeSet<_> = store.keys()?.into_iter().collect();
        assert_eq!(keys, (0..n).map(key).collect());
        assert_eq!(store.stats().entries, u64::from(n));
        store.flush()?;
        Ok(())
    }

    pub fn invalid_blob_is_refused(store: &dyn ChunkStore) -> TestResult {
        let mut b = small(1);
        b.v.pop();
        let err = store
            .put(&key(1), Arc::new(b))
            .err()
            .ok_or("accepted a bad blob")?;
        assert!(matches!(err, StoreError::InvalidBlob { .. }), "{err}");
        assert!(err.to_string().contains(&key(1).to_string()), "{err}");
        assert!(!store.contains(&key(1))?);
        Ok(())
    }

    pub fn concurrent_use(store: &dyn ChunkStore) -> TestResult {
        std::thread::scope(|s| {
            let workers: Vec<_> = (0..4u32)
                .map(|t| {
                    s.spawn(move || -> Result<(), StoreError> {
                        for i in 0..25 {
                            let i = t * 100 + i;
                            store.put(&key(i), Arc::new(small(i)))?;
                            assert_eq!(store.get(&key(i))?.as_deref(), Some(&small(i)));
                        }
                        Ok(())
                    })
                })
                .collect();
            for w in workers {
                w.join().map_err(|_| "worker panicked")??;
            }
            Ok::<_, Box<dyn std::error::Error>>(())
        })?;
        assert_eq!(store.stats().entries, 100);
        Ok(())
    }
}

/// Runs every case of the suite against one backend, each in a fresh store.
macro_rules! suite {
    ($backend:ident) => {
        mod $backend {
            use super::*;

            fn run(case: fn(&dyn ChunkStore) -> TestResult) -> TestResult {
                let (store, _dir) = super::$backend()?;
                case(store.as_ref())
            }

            #[test]
            fn roundtrip() -> TestResult {
                run(cases::roundtrip)
            }
            #[test]
            fn roundtrip_without_scores() -> TestResult {
                run(cases::roundtrip_without_scores)
            }
            #[test]
            fn missing_key_is_none() -> TestResult {
                run(cases::missing_key_is_none)
            }
            #[test]
            fn remove() -> TestResult {
                run(cases::remove)
            }
            #[test]
            fn overwrite() -> TestResult {
                run(cases::overwrite)
            }
            #[test]
            fn stats_count_lookups() -> TestResult {
                run(cases::stats_count_lookups)
            }
            #[test]
            fn many_entries() -> TestResult {
                run(cases::many_entries)
            }
            #[test]
            fn invalid_blob_is_refused() -> TestResult {
                run(cases::invalid_blob_is_refused)
            }
            #[test]
            fn concurrent_use() -> TestResult {
                run(cases::concurrent_use)
            }
        }
    };
}

suite!(memory);
suite!(disk);
suite!(tiered);

#[test]
fn memory_capacity_is_in_payload_bytes() -> TestResult {
    let one = small(0).payload_bytes() as u64;
    let store = MemoryStore::new(10 * one);
    for i in 0..40 {
        store.put(&key(i), Arc::new(small(i)))?;
    }
    store.run_pending_tasks();
    let s = store.stats();
    assert!(
        s.memory_bytes <= 10 * one,
        "{} > capacity {}",
        s.memory_bytes,
        10 * one
    );
    assert!(s.entries <= 10 && s.entries > 0, "{} entries", s.entries);
    let resident = (0..40)
        .filter(|&i| store.contains(&key(i)).unwrap_or(false))
        .count();
    assert_eq!(resident as u64, s.entries);
    Ok(())
}

#[test]
fn memory_does_not_keep_a_blob_larger_than_its_capacity() -> TestResult {
    let big = blob(4, 64, 32, 1);
    let store = MemoryStore::new(big.payload_bytes() as u64 / 2);
    store.put(&key(1), Arc::new(big))?;
    store.run_pending_tasks();
    assert!(store.get(&key(1))?.is_none());
    assert_eq!(store.stats().memory_bytes, 0);
    Ok(())
}

#[test]
fn memory_bytes_are_payload_bytes() -> TestResult {
    let store = MemoryStore::new(1 << 30);
    store.put(&key(1), Arc::new(small(1)))?;
    store.put(&key(2), Arc::new(blob(3, 8, 5, 2)))?;
    let expected = small(1).payload_bytes() + blob(3, 8, 5, 2).payload_bytes();
    assert_eq!(store.stats().memory_bytes, expected as u64);
    Ok(())
}

#[test]
fn tiered_put_then_get_is_a_memory_hit() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = TieredStore::open(dir.path(), 1 << 30)?;
    store.put(&key(1), Arc::new(small(1)))?;
    store.get(&key(1))?;
    let s = store.stats();
    assert_eq!((s.memory_hits, s.disk_hits, s.disk_misses), (1, 0, 0));
    assert!(store.disk().contains(&key(1))?, "put wrote through to disk");
    Ok(())
}

#[test]
fn tiered_disk_hit_is_promoted_to_memory() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = TieredStore::open(dir.path(), 1 << 30)?;
    store.disk().put(&key(1), Arc::new(small(1)))?;
    assert_eq!(store.get(&key(1))?.as_deref(), Some(&small(1)));
    let s = store.stats();
    assert_eq!((s.memory_misses, s.disk_hits), (1, 1));
    assert!(store.memory().contains(&key(1))?);
    store.get(&key(1))?;
    let s = store.stats();
    assert_eq!((s.memory_hits, s.disk_hits), (1, 1));
    Ok(())
}

/// One walk names the tier it found a blob in: disk first (copied up), then memory; a local
/// read stops before the remote tier, and a miss is none.
#[test]
fn tiered_reads_report_their_tier() -> TestResult {
    use chunkstore::{Found, Reach};
    let dir = tempfile::tempdir()?;
    let store = TieredStore::open(dir.path(), 1 << 30)?;
    store.disk().put(&key(1), Arc::new(small(1)))?;
    let tier = |reach| -> Result<Option<Found>, StoreError> {
        Ok(store
            .get_in(Some("tenant"), &key(1), reach)?
            .map(|(_, f)| f))
    };
    assert_eq!(tier(Reach::Local)?, Some(Found::Disk));
    assert_eq!(tier(Reach::Remote)?, Some(Found::Memory));
    assert!(store.get_in(None, &key(2), Reach::Remote)?.is_none());
    Ok(())
}

#[test]
fn tiered_miss_counts_in_both_tiers() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = TieredStore::open(dir.path(), 1 << 30)?;
    assert!(store.get(&key(1))?.is_none());
    let s = store.stats();
    assert_eq!((s.memory_misses, s.disk_misses), (1, 1));
    Ok(())
}

#[test]
fn tiered_remove_clears_both_tiers() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = TieredStore::open(dir.path(), 1 << 30)?;
    store.put(&key(1), Arc::new(small(1)))?;
    store.remove(&key(1))?;
    assert!(!store.memory().contains(&key(1))?);
    assert!(!store.disk().contains(&key(1))?);
    Ok(())
}

#[test]
fn tiered_survives_a_small_memory_tier() -> TestResult {
    let dir = tempfile::tempdir()?;
    let one = small(0).payload_bytes() as u64;
    let store = TieredStore::open(dir.path(), 3 * one)?;
    for i in 0..20 {
        store.put(&key(i), Arc::new(small(i)))?;
    }
    // Apply any pending evictions now so that some gets must go to disk.
    store.memory().run_pending_tasks();
    for i in 0..20 {
        assert_eq!(store.get(&key(i))?.as_deref(), Some(&small(i)), "entry {i}");
    }
    let s = store.stats();
    assert_eq!(s.entries, 20);
    assert!(s.memory_bytes <= 3 * one);
    assert!(s.disk_hits > 0, "evicted entries came from disk");
    Ok(())
}

/// KV stored at query time stays within the disk budget (least recently used out first);
/// pinned entries are never counted or evicted, a put pins a budgeted key, and the budget is
/// the same after a reopen.
#[test]
fn query_time_entries_are_kept_within_the_disk_budget() -> TestResult {
    let dir = tempfile::tempdir()?;
    let open = || -> Result<TieredStore, StoreError> {
        TieredStore::open(dir.path(), 1 << 30)?.with_budget(0, chunkstore::Eviction::Lru)
    };
    let store = open()?;
    store.put(&key(0), Arc::new(small(0)))?;
    let size = store.disk().stored_bytes(&key(0)).unwrap_or(0);
    assert!(size > 0);
    drop(store);
    let store =
        TieredStore::open(dir.path(), 1 << 30)?.with_budget(3 * size, chunkstore::Eviction::Lru)?;
    for i in 1..=3 {
        store.put_cached("docs", &key(i), Arc::new(small(i)))?;
    }
    store.touch(&key(1));
    store.put_cached("docs", &key(4), Arc::new(small(4)))?;
    let on_disk = |i| store.disk().contains(&key(i)).unwrap_or(false);
    assert_eq!(
        (0..=4).map(on_disk).collect::<Vec<_>>(),
        [true, true, false, true, true]
    );
    // Ingestion takes key 3 over: pinned, out of the budget.
    store.put(&key(3), Arc::new(small(3)))?;
    let mut cached: Vec<String> = store.cached_keys().iter().map(|k| k.to_string()).collect();
    cached.sort();
    let mut want: Vec<String> = [1, 4].iter().map(|&i| key(i).to_string()).collect();
    want.sort();
    assert_eq!(cached, want);
    drop(store);
    let store =
        TieredStore::open(dir.path(), 1 << 30)?.with_budget(3 * size, chunkstore::Eviction::Lru)?;
    assert_eq!(store.cached_keys().len(), 2);
    assert!(store.disk().contains(&key(0))? && store.disk().contains(&key(3))?);
    Ok(())
}
