//! Damage inside sled's own files (not in our blob format, which has its own checksum): a
//! flipped byte anywhere must end in a refused open (a startup error naming the directory) or
//! in reads that return the stored blob or nothing (so the gateway recomputes it), never in a
//! panic or a read error that would repeat on every query.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use chunkstore::{ChunkKey, ChunkStore, Codec, DiskStore, KvBlob};
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

/// How a damaged copy behaved.
#[derive(Debug, Default)]
struct Outcomes {
    refused: usize,
    opened: usize,
    intact_reads: usize,
    dropped_reads: usize,
}

fn check_damaged(
    dir: &Path,
    entries: &[(ChunkKey, KvBlob)],
    what: &str,
    seen: &mut Outcomes,
) -> TestResult {
    let opened = std::panic::catch_unwind(|| DiskStore::open(dir));
    let store = match opened {
        Err(_) => return Err(format!("opening a store with {what} panicked").into()),
        Ok(Err(e)) => {
            let message = e.to_string();
            assert!(
                message.contains(&dir.display().to_string()),
                "the open error does not name the directory: {message}"
            );
            seen.refused += 1;
            return Ok(());
        }
        Ok(Ok(store)) => store,
    };
    seen.opened += 1;
    for (k, expected) in entries {
        for attempt in 0..2 {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| store.get(k))) {
                Err(_) => return Err(format!("reading {k} with {what} panicked").into()),
                Ok(Err(e)) => {
                    return Err(format!(
                        "reading {k} with {what} failed (attempt {attempt}) instead of \
                         reporting the entry absent: {e}"
                    )
                    .into())
                }
                Ok(Ok(Some(got))) => {
                    assert_eq!(&*got, expected, "{what}: a damaged blob was served");
                    seen.intact_reads += 1;
                }
                Ok(Ok(None)) => seen.dropped_reads += 1,
            }
        }
    }
    // The store still takes the recomputed entry.
    let (k, b) = &entries[0];
    store.put(k, Arc::new(b.clone()))?;
    assert_eq!(store.get(k)?.as_deref(), Some(b), "{what}");
    Ok(())
}

#[test]
fn a_flipped_byte_in_sleds_files_is_a_refused_open_or_a_recompute() -> TestResult {
    let root = tempfile::tempdir()?;
    let original = root.path().join("store");
    // Small blobs live in sled's log (`db`); large ones (over 128 KiB) in files of their own
    // under `blobs/`.
    let entries: Vec<(ChunkKey, KvBlob)> = (1..=6)
        .map(|i| {
            let b = if i % 2 == 0 {
                blob(4, 64, 256, i)
            } else {
                small(i)
            };
            (key(i), b)
        })
        .collect();
    {
        // Raw: these synthetic values compress below the blob-file threshold losslessly.
        let store = DiskStore::open(&original)?.with_codec(Codec::Raw);
        for (k, b) in &entries {
            store.put(k, Arc::new(b.clone()))?;
        }
        store.flush()?;
    }
    let files = files_under(&original)?;
    assert!(
        files.iter().any(|f| f.to_string_lossy().contains("blobs")),
        "no large blob went to a blob file: {files:?}"
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut seen = Outcomes::default();
    let mut n = 0;
    for file in &files {
        let len = std::fs::metadata(file)?.len();
        if len == 0 {
            continue;
        }
        // Every file: its first bytes (headers), its last and a spread of random offsets.
        let mut offsets = vec![0, len / 2, len - 1];
        offsets.extend((0..6).map(|_| rng.gen_range(0..len)));
        for offset in offsets {
            n += 1;
            let copy = root.path().join(format!("copy{n}"));
            copy_dir(&original, &copy)?;
            let rel = file.strip_prefix(&original)?;
            let damaged = copy.join(rel);
            let mut bytes = std::fs::read(&damaged)?;
            bytes[offset as usize] ^= 0x5a;
            std::fs::write(&damaged, &bytes)?;
            let what = format!("byte {offset} of {} flipped", rel.display());
            check_damaged(&copy, &entries, &what, &mut seen)?;
            std::fs::remove_dir_all(&copy)?;
        }
    }
    // A blob file that is gone altogether.
    let blob_file = files
        .iter()
        .find(|f| f.to_string_lossy().contains("blobs"))
        .ok_or("no blob file")?;
    let copy = root.path().join("missing-blob");
    copy_dir(&original, &copy)?;
    std::fs::remove_file(copy.join(blob_file.strip_prefix(&original)?))?;
    check_damaged(&copy, &entries, "a blob file deleted", &mut seen)?;
    // Damage that appears while the store is open (a failing disk): every entry is read
    // back intact or reported absent, and a read error is never returned.
    let copy = root.path().join("damaged-while-open");
    copy_dir(&original, &copy)?;
    let store = DiskStore::open(&copy)?;
    for file in files_under(&copy)?
        .iter()
        .filter(|f| f.to_string_lossy().contains("blobs"))
    {
        let mut bytes = std::fs::read(file)?;
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x5a;
        std::fs::write(file, &bytes)?;
    }
    let mut dropped_while_open = 0;
    for (k, expected) in &entries {
        match store.get(k)? {
            Some(got) => assert_eq!(&*got, expected, "a damaged blob was served"),
            None => dropped_while_open += 1,
        }
    }
    assert!(dropped_while_open > 0, "the damage went unnoticed");
    assert!(store.stats().corrupt > 0);
    drop(store);
    eprintln!("{seen:?}, {dropped_while_open} dropped while open");
    assert!(seen.opened > 0, "no damaged copy opened: {seen:?}");
    assert!(
        seen.dropped_reads > 0,
        "no damage was ever detected at read time: {seen:?}"
    );
    Ok(())
}
