//! Damage to the disk tier's files: a flipped byte, a truncation or a deleted file anywhere
//! must end in reads that return the stored blob or nothing (so the gateway recomputes it) for
//! the damaged chunk alone, writes and removals that succeed for every key, and never a panic
//! or an error that would repeat on every query. A damaged `STORE` file is a refused open
//! that names the directory, or with `open_or_reset` a fresh store. A store of the earlier
//! sled layout is migrated; a damaged one is treated like a damaged store.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use chunkstore::{ChunkKey, ChunkStore, Codec, DiskStore, KvBlob, StoreError};
use common::{blob, key, small, TestResult};
use rand::{Rng, SeedableRng};

fn files_under(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            out.extend(files_under(&path)?);
        } else {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

/// Large and small entries, flushed; the store is closed when this returns.
fn filled_store(dir: &Path) -> Result<Vec<(ChunkKey, KvBlob)>, Box<dyn std::error::Error>> {
    let entries: Vec<(ChunkKey, KvBlob)> = (1..=6)
        .map(|i| {
            let b = if i % 2 == 0 {
                blob(4, 64, 64, i)
            } else {
                small(i)
            };
            (key(i), b)
        })
        .collect();
    let store = DiskStore::open(dir)?.with_codec(Codec::Raw);
    for (k, b) in &entries {
        store.put(k, Arc::new(b.clone()))?;
    }
    store.flush()?;
    Ok(entries)
}

/// One way of damaging a file.
#[derive(Debug, Clone, Copy)]
enum Damage {
    Flip(u64),
    Truncate(u64),
    Delete,
}

fn damage(file: &Path, how: Damage) -> std::io::Result<()> {
    match how {
        Damage::Flip(offset) => {
            let mut bytes = std::fs::read(file)?;
            bytes[offset as usize] ^= 0x5a;
            std::fs::write(file, &bytes)
        }
        Damage::Truncate(len) => std::fs::OpenOptions::new()
            .write(true)
            .open(file)?
            .set_len(len),
        Damage::Delete => std::fs::remove_file(file),
    }
}

/// Which entries may read back absent.
#[derive(Debug, Clone, Copy)]
enum Absent<'a> {
    None,
    Only(&'a ChunkKey),
    All,
}

/// Every entry reads back intact or absent (only those `absent` allows), and every key can be
/// removed and written again.
fn check(
    store: &DiskStore,
    entries: &[(ChunkKey, KvBlob)],
    absent: Absent<'_>,
    what: &str,
) -> TestResult {
    for (k, expected) in entries {
        for attempt in 0..2 {
            let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| store.get(k)))
                .map_err(|_| format!("reading {k} with {what} panicked"))?
                .map_err(|e| format!("reading {k} with {what} failed (attempt {attempt}): {e}"))?;
            match got {
                Some(got) => assert_eq!(&*got, expected, "{what}: a damaged blob was served"),
                None => assert!(
                    match absent {
                        Absent::None => false,
                        Absent::Only(d) => d == k,
                        Absent::All => true,
                    },
                    "{what}: an undamaged entry ({k}) became unreadable"
                ),
            }
        }
    }
    for (k, b) in entries {
        store.remove(k)?;
        assert_eq!(store.get(k)?, None, "{what}: {k} was removed");
        store.put(k, Arc::new(b.clone()))?;
        assert_eq!(
            store.get(k)?.as_deref(),
            Some(b),
            "{what}: {k} written again"
        );
    }
    assert_eq!(store.stats().entries, entries.len() as u64, "{what}");
    Ok(())
}

#[test]
fn damage_to_a_chunk_file_costs_that_chunk_alone() -> TestResult {
    let root = tempfile::tempdir()?;
    let original = root.path().join("store");
    let entries = filled_store(&original)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut detected = 0;
    let mut n = 0;
    for (k, _) in &entries {
        let rel = DiskStore::open(&original)?
            .file_of(k)
            .strip_prefix(&original)?
            .to_path_buf();
        let len = std::fs::metadata(original.join(&rel))?.len();
        let mut hows = vec![
            Damage::Delete,
            Damage::Truncate(0),
            Damage::Truncate(len / 2),
            Damage::Truncate(len - 1),
            Damage::Flip(0),
            Damage::Flip(len - 1),
        ];
        hows.extend((0..4).map(|_| Damage::Flip(rng.gen_range(0..len))));
        for how in hows {
            // Damage between a close and an open, and damage under an open store.
            for while_open in [false, true] {
                n += 1;
                let copy = root.path().join(format!("copy{n}"));
                copy_dir(&original, &copy)?;
                let what = format!("{how:?} of {} (store open: {while_open})", rel.display());
                let store = if while_open {
                    let store = DiskStore::open(&copy)?;
                    damage(&copy.join(&rel), how)?;
                    store
                } else {
                    damage(&copy.join(&rel), how)?;
                    DiskStore::open(&copy)?
                };
                if store.get(k)?.is_none() {
                    detected += 1;
                }
                check(&store, &entries, Absent::Only(k), &what)?;
                drop(store);
                std::fs::remove_dir_all(&copy)?;
            }
        }
    }
    // Every damage is a checksum (or length) failure at read time: none goes unnoticed.
    assert_eq!(detected, n, "some damage was served as a good blob");
    Ok(())
}

/// Regression (issue 38): with the earlier sled store, a deleted blob file made every put and
/// remove of the keys in the damaged page fail, on every request and after restarts
/// ("put failed for chunk … No such file or directory"), and other collections' keys in the
/// same page with them. Every key stays writable and removable now.
#[test]
fn a_missing_file_never_blocks_a_write_or_a_removal() -> TestResult {
    let root = tempfile::tempdir()?;
    let dir = root.path().join("kv");
    let entries = filled_store(&dir)?;
    let store = DiskStore::open(&dir)?;
    let (gone, _) = &entries[1];
    std::fs::remove_file(store.file_of(gone))?;
    check(&store, &entries, Absent::Only(gone), "a deleted chunk file")?;
    drop(store);
    // And after a restart.
    let store = DiskStore::open(&dir)?;
    check(&store, &entries, Absent::None, "after reopening")?;
    Ok(())
}

/// Damage to the store's own `STORE` file: `open` refuses, naming the directory;
/// `open_or_reset` moves the store aside and starts an empty one that works.
#[test]
fn a_damaged_store_file_is_refused_or_reset() -> TestResult {
    for how in [Damage::Flip(3), Damage::Truncate(5), Damage::Delete] {
        let root = tempfile::tempdir()?;
        let dir = root.path().join("kv");
        let entries = filled_store(&dir)?;
        damage(&dir.join("STORE"), how)?;
        if matches!(how, Damage::Delete) {
            // Without its STORE file the directory is not recognisably a store: refused as
            // someone else's data, never moved or overwritten.
            let err = DiskStore::open_or_reset(&dir).err().ok_or("opened")?;
            assert!(matches!(err, StoreError::NotAStore { .. }), "{err}");
            continue;
        }
        let refused = DiskStore::open(&dir)
            .err()
            .ok_or("opened a damaged store")?;
        assert!(
            matches!(refused, StoreError::Damaged { .. }),
            "{how:?}: {refused}"
        );
        assert!(
            refused.to_string().contains(&dir.display().to_string()),
            "{refused}"
        );
        let (store, moved) = DiskStore::open_or_reset(&dir)?;
        let moved = moved.ok_or("nothing was moved aside")?;
        assert!(
            moved
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("kv.damaged-")),
            "{}",
            moved.display()
        );
        assert!(moved.join("STORE").is_file(), "the damaged store is kept");
        assert_eq!(store.stats().entries, 0);
        check(&store, &entries, Absent::All, "a reset store")?;
        drop(store);
        let (_store, moved) = DiskStore::open_or_reset(&dir)?;
        assert!(moved.is_none(), "a healthy store was moved");
    }
    Ok(())
}

/// Writes a store of the earlier sled layout (trees `kv` and `kv_sizes`).
fn sled_store(dir: &Path, entries: &[(ChunkKey, KvBlob)]) -> TestResult {
    let db = sled::Config::new().path(dir).open()?;
    let blobs = db.open_tree("kv")?;
    let sizes = db.open_tree("kv_sizes")?;
    for (k, b) in entries {
        let bytes = chunkstore::encode(b);
        sizes.insert(k.as_bytes(), &(bytes.len() as u64).to_le_bytes())?;
        blobs.insert(k.as_bytes(), bytes)?;
    }
    db.flush()?;
    Ok(())
}

#[test]
fn a_sled_store_of_the_earlier_layout_is_migrated() -> TestResult {
    let root = tempfile::tempdir()?;
    let dir = root.path().join("kv");
    let entries: Vec<(ChunkKey, KvBlob)> = (1..=4).map(|i| (key(i), small(i))).collect();
    sled_store(&dir, &entries)?;
    // sled's background threads release the directory a moment after the last handle.
    std::thread::sleep(std::time::Duration::from_millis(200));
    let store = DiskStore::open(&dir)?;
    assert_eq!(store.stats().entries, entries.len() as u64);
    for (k, b) in &entries {
        assert_eq!(store.get(k)?.as_deref(), Some(b), "{k} migrated");
    }
    assert!(!dir.join("db").exists(), "the sled files are gone");
    let leftovers: Vec<_> = std::fs::read_dir(root.path())?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "kv")
        .collect();
    assert!(leftovers.is_empty(), "migration left {leftovers:?} behind");
    Ok(())
}

#[test]
fn a_damaged_sled_store_is_refused_or_reset() -> TestResult {
    let root = tempfile::tempdir()?;
    let dir = root.path().join("kv");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("conf"), b"\x00\x01 not a sled configuration \xff")?;
    std::fs::write(dir.join("db"), vec![0xa5u8; 4096])?;
    let refused = DiskStore::open(&dir).err().ok_or("opened garbage")?;
    assert!(matches!(refused, StoreError::Damaged { .. }), "{refused}");
    assert!(refused.to_string().contains(&dir.display().to_string()));
    let (store, moved) = DiskStore::open_or_reset(&dir)?;
    assert!(moved.is_some_and(|m| m.join("conf").is_file()));
    store.put(&key(1), Arc::new(small(1)))?;
    assert_eq!(store.get(&key(1))?.as_deref(), Some(&small(1)));
    Ok(())
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    for file in files_under(from)? {
        let rel = file.strip_prefix(from).map_err(std::io::Error::other)?;
        let dest = to.join(rel);
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::copy(&file, &dest)?;
    }
    Ok(())
}
