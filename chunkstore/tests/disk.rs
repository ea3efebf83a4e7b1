//! The disk tier: damaged blobs are dropped and recomputed, data survives a reopen and a crash,
//! and a directory that is not a store is refused.

mod common;

use std::sync::{Arc, Mutex};

use chunkstore::{encode, encode_with, ChunkStore, Codec, DiskStore, StoreError, TieredStore};
use common::{blob, key, small, TestResult};

/// Stores `bytes` under key 1 next to a good blob under key 2, then checks that reading key 1
/// reports it absent, deletes it, counts it as corrupt and leaves key 2 alone.
fn dropped_as_corrupt(bytes: &[u8]) -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = DiskStore::open(dir.path())?;
    store.put(&key(2), Arc::new(small(2)))?;
    store.put_raw(&key(1), bytes)?;
    assert!(store.contains(&key(1))?);
    assert_eq!(store.stats().entries, 2);

    assert!(store.get(&key(1))?.is_none(), "a bad blob was served");
    assert!(
        store.get_raw(&key(1))?.is_none(),
        "the bad blob was not deleted"
    );
    assert!(!store.contains(&key(1))?);
    let s = store.stats();
    assert_eq!((s.corrupt, s.disk_misses, s.entries), (1, 1, 1));
    assert_eq!(
        s.disk_bytes,
        encode_with(&small(2), Codec::default()).len() as u64
    );
    assert!(store.keys()? == vec![key(2)]);
    // Later lookups are plain misses; the good entry is untouched.
    assert!(store.get(&key(1))?.is_none());
    assert_eq!(store.stats().corrupt, 1);
    assert_eq!(store.get(&key(2))?.as_deref(), Some(&small(2)));
    Ok(())
}

/// A log sink the test can read back.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .map_err(|_| std::io::Error::other("poisoned"))?
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn dropping_a_corrupt_blob_warns_with_key_and_reason() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = DiskStore::open(dir.path())?;
    store.put_raw(&key(1), b"GGUF not a kv blob")?;
    let sink = Captured::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    tracing::subscriber::with_default(subscriber, || store.get(&key(1)))?;
    let log = String::from_utf8(sink.0.lock().map_err(|_| "poisoned")?.clone())?;
    assert!(log.contains("WARN"), "{log}");
    assert!(log.contains(&key(1).to_string()), "{log}");
    assert!(log.contains("not a KV blob"), "{log}");
    Ok(())
}

#[test]
fn flipped_payload_byte_is_dropped() -> TestResult {
    let mut bytes = encode(&small(1));
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    dropped_as_corrupt(&bytes)
}

#[test]
fn truncated_blob_is_dropped() -> TestResult {
    let bytes = encode(&small(1));
    dropped_as_corrupt(&bytes[..bytes.len() / 2])?;
    dropped_as_corrupt(&bytes[..2])?;
    dropped_as_corrupt(&[])
}

#[test]
fn foreign_blob_is_dropped() -> TestResult {
    dropped_as_corrupt(b"{\"this is\": \"someone else's json\"}")
}

#[test]
fn future_version_blob_is_dropped() -> TestResult {
    let mut bytes = encode(&small(1));
    bytes[4..6].copy_from_slice(&2u16.to_le_bytes());
    dropped_as_corrupt(&bytes)
}

#[test]
fn tiered_store_recomputes_a_corrupt_disk_entry() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = TieredStore::open(dir.path(), 1 << 30)?;
    let mut bytes = encode(&small(1));
    bytes[60] ^= 0xff;
    store.disk().put_raw(&key(1), &bytes)?;
    assert!(store.get(&key(1))?.is_none());
    assert!(!store.contains(&key(1))?);
    assert_eq!(store.stats().corrupt, 1);
    // The gateway recomputes and stores it again.
    store.put(&key(1), Arc::new(small(1)))?;
    store.memory().clear();
    assert_eq!(store.get(&key(1))?.as_deref(), Some(&small(1)));
    Ok(())
}

#[test]
fn corrupt_blob_survives_reopen_until_read() -> TestResult {
    let dir = tempfile::tempdir()?;
    {
        let store = DiskStore::open(dir.path())?;
        store.put_raw(&key(1), b"SRKV\x01\x00garbage")?;
        store.flush()?;
    }
    let store = DiskStore::open(dir.path())?;
    assert_eq!(store.stats().entries, 1);
    assert!(store.get(&key(1))?.is_none());
    assert_eq!((store.stats().entries, store.stats().corrupt), (0, 1));
    Ok(())
}

#[test]
fn reopened_store_returns_what_was_flushed() -> TestResult {
    let dir = tempfile::tempdir()?;
    let big = blob(4, 32, 64, 5);
    let stats_before = {
        let store = TieredStore::open(dir.path(), 1 << 30)?;
        store.put(&key(1), Arc::new(small(1)))?;
        store.put(&key(2), Arc::new(big.clone()))?;
        store.put(&key(3), Arc::new(small(3)))?;
        store.remove(&key(3))?;
        store.flush()?;
        store.stats()
    };
    let store = TieredStore::open(dir.path(), 1 << 30)?;
    let s = store.stats();
    assert_eq!((s.entries, s.disk_bytes), (2, stats_before.disk_bytes));
    assert_eq!(s.memory_bytes, 0, "memory starts cold");
    assert_eq!(store.get(&key(1))?.as_deref(), Some(&small(1)));
    assert_eq!(store.get(&key(2))?.as_deref(), Some(&big));
    assert!(
        store.get(&key(3))?.is_none(),
        "a flushed remove stays removed"
    );
    let mut keys = store.keys()?;
    keys.sort();
    let mut expected = vec![key(1), key(2)];
    expected.sort();
    assert_eq!(keys, expected);
    Ok(())
}

#[test]
fn a_store_reads_blobs_of_every_codec_whatever_it_writes() -> TestResult {
    let dir = tempfile::tempdir()?;
    let big = blob(4, 32, 64, 5);
    {
        let raw = DiskStore::open(dir.path())?;
        assert_eq!(raw.codec(), Codec::Raw, "the default");
        raw.put(&key(1), Arc::new(big.clone()))?;
        raw.flush()?;
    }
    let store = DiskStore::open(dir.path())?.with_codec(Codec::Lossless);
    store.put(&key(2), Arc::new(big.clone()))?;
    let tag = |k| -> Result<u16, StoreError> {
        let b = store.get_raw(&key(k))?.expect("stored");
        Ok(u16::from_le_bytes([b[10], b[11]]))
    };
    assert_eq!(
        (tag(1)?, tag(2)?),
        (Codec::Raw.tag(), Codec::Lossless.tag())
    );
    assert_eq!(store.get(&key(1))?.as_deref(), Some(&big));
    assert_eq!(store.get(&key(2))?.as_deref(), Some(&big));
    Ok(())
}

const CRASH_DIR_VAR: &str = "CHUNKSTORE_TEST_CRASH_DIR";

/// Child half of `flushed_put_survives_a_crash`: put, flush, then die without unwinding or
/// running destructors, like `kill -9`. Does nothing unless started by the parent.
#[test]
#[ignore]
fn crash_child_put_flush_abort() -> TestResult {
    let Some(dir) = std::env::var_os(CRASH_DIR_VAR) else {
        return Ok(());
    };
    let store = DiskStore::open(std::path::Path::new(&dir))?;
    store.put(&key(1), Arc::new(blob(3, 16, 40, 1)))?;
    store.flush()?;
    println!("flushed");
    std::process::abort();
}

#[test]
fn flushed_put_survives_a_crash() -> TestResult {
    let dir = tempfile::tempdir()?;
    let out = std::process::Command::new(std::env::current_exe()?)
        .args([
            "crash_child_put_flush_abort",
            "--exact",
            "--ignored",
            "--nocapture",
        ])
        .env(CRASH_DIR_VAR, dir.path())
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("flushed") && !out.status.success(),
        "child did not flush and crash: {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let store = DiskStore::open(dir.path())?;
    assert_eq!(store.get(&key(1))?.as_deref(), Some(&blob(3, 16, 40, 1)));
    assert_eq!(store.stats().entries, 1);
    Ok(())
}

#[test]
fn a_file_is_not_a_store() -> TestResult {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("notes.txt");
    std::fs::write(&file, "hello")?;
    let err = DiskStore::open(&file).err().ok_or("opened a file")?;
    assert!(matches!(err, StoreError::NotAStore { .. }), "{err}");
    assert!(err.to_string().contains("notes.txt"), "{err}");
    Ok(())
}

#[test]
fn a_foreign_directory_is_not_a_store() -> TestResult {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("index.html"), "<html>")?;
    std::fs::create_dir(dir.path().join("photos"))?;
    let err = TieredStore::open(dir.path(), 1 << 20)
        .err()
        .ok_or("opened a foreign directory")?;
    assert!(matches!(err, StoreError::NotAStore { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains(&dir.path().display().to_string()), "{msg}");
    assert!(msg.contains("index.html"), "{msg}");
    // Nothing was written into it.
    assert_eq!(std::fs::read_dir(dir.path())?.count(), 2);
    Ok(())
}

#[test]
fn garbage_sled_files_are_an_error_naming_the_path() -> TestResult {
    let dir = tempfile::tempdir()?;
    std::fs::write(dir.path().join("conf"), b"not a sled config")?;
    std::fs::write(dir.path().join("db"), vec![0xa5u8; 4096])?;
    let err = DiskStore::open(dir.path()).err().ok_or("opened garbage")?;
    assert!(
        err.to_string().contains(&dir.path().display().to_string()),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_store_in_use_is_an_error_naming_the_path() -> TestResult {
    let dir = tempfile::tempdir()?;
    let _first = DiskStore::open(dir.path())?;
    let err = DiskStore::open(dir.path()).err().ok_or("opened twice")?;
    assert!(matches!(err, StoreError::InUse { .. }), "{err}");
    assert!(
        err.to_string().contains(&dir.path().display().to_string()),
        "{err}"
    );
    Ok(())
}

#[test]
fn a_missing_directory_is_created() -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("a/b/store");
    let store = DiskStore::open(&path)?;
    store.put(&key(1), Arc::new(small(1)))?;
    assert!(path.join("STORE").is_file());
    Ok(())
}

/// Disk put, flush and cold get of realistic 6 MiB chunks (printed, not asserted).
#[test]
fn six_megabyte_chunks_on_disk_speed() -> TestResult {
    let dir = tempfile::tempdir()?;
    let store = DiskStore::open(dir.path())?;
    let n = 16;
    let blobs: Vec<_> = (0..n).map(|i| Arc::new(blob(24, 128, 512, i))).collect();
    let t = std::time::Instant::now();
    for (i, b) in (0..n).zip(&blobs) {
        store.put(&key(i), Arc::clone(b))?;
    }
    let put_s = t.elapsed().as_secs_f64() / f64::from(n);
    let t = std::time::Instant::now();
    store.flush()?;
    let flush_s = t.elapsed().as_secs_f64();
    drop(store);
    let t = std::time::Instant::now();
    let store = DiskStore::open(dir.path())?;
    let open_s = t.elapsed().as_secs_f64();
    let t = std::time::Instant::now();
    for (i, b) in (0..n).zip(&blobs) {
        assert!(
            store.get(&key(i))?.as_deref() == Some(b.as_ref()),
            "entry {i}"
        );
    }
    let get_s = t.elapsed().as_secs_f64() / f64::from(n);
    eprintln!(
        "{n} x 6 MiB on disk: put {:.1} ms each, flush {:.1} ms, reopen {:.1} ms, get {:.1} ms \
         each (decode included); {} bytes stored, {} in the store's files",
        put_s * 1e3,
        flush_s * 1e3,
        open_s * 1e3,
        get_s * 1e3,
        store.stats().disk_bytes,
        dir_size(dir.path())?,
    );
    Ok(())
}

fn dir_size(path: &std::path::Path) -> std::io::Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(path)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            dir_size(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

/// Records the directories a store syncs.
#[derive(Default)]
struct SyncLog(Mutex<Vec<std::path::PathBuf>>);

impl chunkstore::BlobWriter for SyncLog {
    fn write_new(&self, path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
        chunkstore::FsWriter.write_new(path, bytes)
    }

    fn sync_dir(&self, dir: &std::path::Path) -> std::io::Result<()> {
        self.0
            .lock()
            .map_err(|_| std::io::Error::other("poisoned"))?
            .push(dir.to_path_buf());
        std::fs::File::open(dir)?.sync_all()
    }
}

/// A blob in a shard directory made by its put survives a power loss only when the store's
/// own directory, which holds the new shard's entry, is synced too: a flush after puts syncs
/// it beside their shards (which shard is new is not tracked: two puts may race to make it).
#[test]
fn a_new_shard_is_synced_into_the_store_directory() -> TestResult {
    let dir = tempfile::tempdir()?;
    let log = Arc::new(SyncLog::default());
    let store = DiskStore::open(dir.path())?.with_writer(log.clone());
    let root = std::fs::canonicalize(dir.path())?;
    let synced = |log: &SyncLog| -> Result<Vec<std::path::PathBuf>, Box<dyn std::error::Error>> {
        let mut out = Vec::new();
        for d in std::mem::take(&mut *log.0.lock().map_err(|_| "poisoned")?) {
            out.push(std::fs::canonicalize(d)?);
        }
        Ok(out)
    };
    synced(&log)?;
    store.put(&key(1), Arc::new(small(1)))?;
    store.flush()?;
    let shard = std::fs::canonicalize(store.file_of(&key(1)).parent().ok_or("a shard")?)?;
    let first = synced(&log)?;
    assert!(first.contains(&root) && first.contains(&shard), "{first:?}");
    // Another blob in the same shard: the shard and the store's directory again.
    let mut same = (2..10_000)
        .map(key)
        .filter(|k| store.file_of(k).parent() == store.file_of(&key(1)).parent());
    let other = same.next().ok_or("a key in the same shard")?;
    store.put(&other, Arc::new(small(2)))?;
    store.flush()?;
    let mut second = synced(&log)?;
    second.sort();
    let mut want = vec![root, shard];
    want.sort();
    assert_eq!(second, want);
    // Nothing put: nothing synced.
    store.flush()?;
    assert!(synced(&log)?.is_empty());
    Ok(())
}
