//! The remote tier on a real `redis-server` (Debian's package, installed by
//! `scripts/setup-tests.sh`) on a loopback port: two nodes' tiered stores share it, a damaged
//! value is a miss and never served, a TTL is set, and Redis going away and coming back costs
//! misses only.

mod common;

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chunkstore::{ChunkStore, MemoryStore, RemoteStore, TieredStore};
use common::{blob, key, TestResult};

/// A `redis-server` on `port` with no persistence, killed when dropped.
struct Redis(Child);

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

fn redis(port: u16, dir: &std::path::Path) -> Redis {
    assert!(
        std::path::Path::new("/usr/bin/redis-server").is_file(),
        "/usr/bin/redis-server is missing: run scripts/setup-tests.sh (the README's test command does)"
    );
    let child = Command::new("/usr/bin/redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ])
        .args(["--appendonly", "no", "--dir"])
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server starts");
    let server = Redis(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).expect("url");
    while Instant::now() < deadline {
        if let Ok(mut c) = client.get_connection() {
            if redis::cmd("PING").query::<String>(&mut c).is_ok() {
                return server;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("redis-server did not answer on port {port}");
}

fn node(dir: &std::path::Path, port: u16) -> Result<TieredStore, Box<dyn std::error::Error>> {
    let remote = RemoteStore::new(
        &format!("redis://127.0.0.1:{port}"),
        "test:",
        Some(Duration::from_secs(600)),
    )?;
    Ok(
        TieredStore::new(MemoryStore::new(1 << 30), chunkstore::DiskStore::open(dir)?)
            .with_remote(remote),
    )
}

fn raw(port: u16) -> redis::Connection {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .and_then(|c| c.get_connection())
        .expect("a connection")
}

#[test]
fn a_blob_put_on_one_node_is_read_bit_for_bit_on_another() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let port = free_port();
    let _redis = redis(port, tmp.path());
    let a = node(&tmp.path().join("a"), port)?;
    let b = node(&tmp.path().join("b"), port)?;
    let big = blob(4, 32, 64, 5);
    a.put(&key(1), Arc::new(big.clone()))?;
    assert!(!b.disk().contains(&key(1))?, "b has nothing locally");
    assert_eq!(b.get(&key(1))?.as_deref(), Some(&big), "read through");
    assert!(b.disk().contains(&key(1))?, "and filled its disk tier");
    let stats = b.remote().ok_or("remote")?.stats();
    assert_eq!((stats.hits, stats.misses, stats.errors), (1, 0, 0));
    // The TTL is set on the key.
    let ttl: i64 = redis::cmd("PTTL")
        .arg("test:".to_string() + &key(1).to_string())
        .query(&mut raw(port))?;
    assert!(ttl > 500_000 && ttl <= 600_000, "{ttl}");
    // A node's delete (its garbage collection) stays local: another node may still use the
    // entry, which expires by its TTL.
    a.remove(&key(1))?;
    assert!(!a.disk().contains(&key(1))?);
    assert!(b.remote().ok_or("remote")?.contains(&key(1))?);
    Ok(())
}

#[test]
fn a_truncated_or_altered_value_is_a_miss_and_is_deleted() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let port = free_port();
    let _redis = redis(port, tmp.path());
    let a = node(&tmp.path().join("a"), port)?;
    let good = blob(2, 16, 8, 3);
    let mut con = raw(port);
    for (i, damage) in [0u32, 1].into_iter().enumerate() {
        let k = key(10 + i as u32);
        a.remote().ok_or("remote")?.put(&k, &good)?;
        let rk = a.remote().ok_or("remote")?.redis_key(&k);
        let mut bytes: Vec<u8> = redis::cmd("GET").arg(&rk).query(&mut con)?;
        if damage == 0 {
            bytes.truncate(bytes.len() / 2);
        } else {
            let mid = bytes.len() - 5;
            bytes[mid] ^= 0x40;
        }
        redis::cmd("SET")
            .arg(&rk)
            .arg(bytes)
            .query::<()>(&mut con)?;
        assert!(a.get(&k)?.is_none(), "damage {damage} is a miss");
        let exists: i64 = redis::cmd("EXISTS").arg(&rk).query(&mut con)?;
        assert_eq!(exists, 0, "the damaged value is deleted");
    }
    assert_eq!(a.remote().ok_or("remote")?.stats().corrupt, 2);
    Ok(())
}

#[test]
fn redis_going_away_costs_misses_and_coming_back_serves_again() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let port = free_port();
    let redis_a = redis(port, tmp.path());
    let a = node(&tmp.path().join("a"), port)?;
    let b = node(&tmp.path().join("b"), port)?;
    let x = blob(2, 16, 8, 7);
    a.put(&key(1), Arc::new(x.clone()))?;
    drop(redis_a);
    // Down: a local miss is a miss, a put is kept locally; no error reaches the caller.
    assert!(b.get(&key(1))?.is_none());
    b.put(&key(2), Arc::new(x.clone()))?;
    assert_eq!(b.get(&key(2))?.as_deref(), Some(&x));
    assert!(b.remote().ok_or("remote")?.stats().errors > 0);
    // Back (empty: no persistence here): the store reconnects by itself once the short
    // backoff after a failed connect has passed.
    let _redis_b = redis(port, tmp.path());
    std::thread::sleep(Duration::from_millis(2100));
    a.put(&key(3), Arc::new(x.clone()))?;
    assert_eq!(b.get(&key(3))?.as_deref(), Some(&x));
    Ok(())
}

/// Regression (issue 57): a remote hit was written to the local disk neither budgeted nor
/// pinned, so reads through the remote tier grew `kv/` past the disk budget. Now it is
/// budgeted like KV computed while answering: under a full budget it evicts, and every file
/// on disk is pinned or budgeted.
#[test]
fn a_remote_hit_under_a_full_budget_stays_within_it() -> TestResult {
    let tmp = tempfile::tempdir()?;
    let port = free_port();
    let _redis = redis(port, tmp.path());
    let a = node(&tmp.path().join("a"), port)?;
    let size = {
        let probe = chunkstore::DiskStore::open(&tmp.path().join("probe"))?;
        probe.put(&key(0), Arc::new(blob(2, 16, 8, 0)))?;
        probe.stored_bytes(&key(0)).unwrap_or(0)
    };
    let b = node(&tmp.path().join("b"), port)?.with_budget(2 * size, chunkstore::Eviction::Lru)?;
    b.put_cached("docs", &key(1), Arc::new(blob(2, 16, 8, 1)))?;
    b.put_cached("docs", &key(2), Arc::new(blob(2, 16, 8, 2)))?;
    for i in 3..8 {
        a.put(&key(i), Arc::new(blob(2, 16, 8, i)))?;
    }
    for i in 3..8 {
        assert!(b.get_remote("docs", &key(i))?.is_some(), "remote hit {i}");
    }
    let budget = b.budget().ok_or("budget")?;
    assert!(budget.usage().0 <= 2 * size, "{:?}", budget.usage());
    let files = b.disk().keys()?;
    assert!(
        files.len() <= 2,
        "{} files for a budget of two",
        files.len()
    );
    for k in files {
        assert!(
            budget.contains(&k),
            "{k} on disk neither pinned nor budgeted"
        );
    }
    Ok(())
}
