//! A chunk KV tier on Redis or Valkey, shared by several gateway nodes (LMCache's remote
//! backend is the model): keys are the chunk store's sha256 keys under a prefix, values the
//! same versioned, checksummed blobs the disk tier writes.
//!
//! A blob is one `SET` (Redis applies a command whole), so a reader never sees half of one;
//! a value that does not decode (truncated, altered, another format) is a miss and is deleted,
//! never served. The connection is opened lazily and reopened after an error, so a Redis
//! restart costs the requests in flight a miss (they recompute) and nothing else.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::blob::KvBlob;
use crate::codec::Codec;
use crate::error::{Result, StoreError};
use crate::format::{decode, encode_with};
use crate::key::ChunkKey;
use crate::stats::Counter;

/// How long one Redis operation may take before it counts as failed.
const TIMEOUT: Duration = Duration::from_secs(5);
/// After a failed connect, operations fail at once for this long instead of each waiting for
/// a connect of its own (a query loads several chunks).
const BACKOFF: Duration = Duration::from_secs(2);

/// Counters of the remote tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemoteStats {
    pub hits: u64,
    pub misses: u64,
    /// Values found undecodable and deleted.
    pub corrupt: u64,
    /// Operations that failed (Redis unreachable, timeout).
    pub errors: u64,
}

/// The remote tier.
pub struct RemoteStore {
    client: redis::Client,
    conn: Mutex<Option<redis::Connection>>,
    /// When the last connect failed.
    failed_at: Mutex<Option<std::time::Instant>>,
    prefix: String,
    ttl: Option<Duration>,
    codec: Codec,
    url: String,
    hits: Counter,
    misses: Counter,
    corrupt: Counter,
    errors: Counter,
}

impl std::fmt::Debug for RemoteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteStore")
            .field("url", &self.url)
            .field("prefix", &self.prefix)
            .finish()
    }
}

fn remote_err(op: &'static str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Remote {
        op,
        reason: e.to_string(),
    }
}

impl RemoteStore {
    /// A store on the Redis at `url` (`redis://host:port[/db]`), keys under `prefix`, values
    /// expiring after `ttl` (none: kept until evicted by Redis' own policy). Nothing is
    /// contacted until the first operation.
    pub fn new(url: &str, prefix: &str, ttl: Option<Duration>) -> Result<Self> {
        let client = redis::Client::open(url).map_err(|e| remote_err("open", e))?;
        Ok(Self {
            client,
            conn: Mutex::new(None),
            failed_at: Mutex::new(None),
            prefix: prefix.to_string(),
            ttl,
            codec: Codec::default(),
            url: url.to_string(),
            hits: Counter::default(),
            misses: Counter::default(),
            corrupt: Counter::default(),
            errors: Counter::default(),
        })
    }

    /// Writes payloads with `codec`.
    pub fn with_codec(mut self, codec: Codec) -> Self {
        self.codec = codec;
        self
    }

    /// The Redis key of `key`.
    pub fn redis_key(&self, key: &ChunkKey) -> String {
        format!("{}{key}", self.prefix)
    }

    /// Runs `f` on the connection (opened now if needed). A connection that broke since its
    /// last use (Redis restarted) is replaced and `f` tried once more; any error drops the
    /// connection so the next call reconnects.
    fn with<T>(
        &self,
        op: &'static str,
        mut f: impl FnMut(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> Result<T> {
        let mut slot = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let reused = slot.is_some();
        for attempt in 0..2 {
            if slot.is_none() {
                let mut failed = self.failed_at.lock().unwrap_or_else(|p| p.into_inner());
                if failed.is_some_and(|t| t.elapsed() < BACKOFF) {
                    self.errors.add(1);
                    return Err(remote_err(
                        op,
                        "unreachable at the last attempt; retrying shortly",
                    ));
                }
                match self.connect() {
                    Ok(c) => {
                        *failed = None;
                        *slot = Some(c);
                    }
                    Err(e) => {
                        *failed = Some(std::time::Instant::now());
                        self.errors.add(1);
                        return Err(remote_err(op, e));
                    }
                }
            }
            let Some(conn) = slot.as_mut() else { break };
            match f(conn) {
                Ok(v) => return Ok(v),
                Err(e) => {
                    *slot = None;
                    let stale = e.is_io_error() || e.is_connection_dropped();
                    if !(attempt == 0 && reused && stale) {
                        self.errors.add(1);
                        return Err(remote_err(op, e));
                    }
                }
            }
        }
        self.errors.add(1);
        Err(remote_err(op, "no connection"))
    }

    fn connect(&self) -> redis::RedisResult<redis::Connection> {
        let c = self.client.get_connection_with_timeout(TIMEOUT)?;
        c.set_read_timeout(Some(TIMEOUT))?;
        c.set_write_timeout(Some(TIMEOUT))?;
        Ok(c)
    }

    /// The blob under `key`; `None` when absent or undecodable (then deleted).
    pub fn get(&self, key: &ChunkKey) -> Result<Option<Arc<KvBlob>>> {
        let rk = self.redis_key(key);
        let raw: Option<Vec<u8>> = self.with("get", |c| redis::cmd("GET").arg(&rk).query(c))?;
        let Some(raw) = raw else {
            self.misses.add(1);
            return Ok(None);
        };
        match decode(&raw) {
            Ok(blob) => {
                self.hits.add(1);
                Ok(Some(Arc::new(blob)))
            }
            Err(reason) => {
                tracing::warn!(key = %key, %reason, "dropping an unreadable KV blob from the remote store");
                // Unconditional: should another node have just replaced the value with a good
                // one, that one goes too and is recomputed by whoever needs it next (harmless).
                let _ = self.with("delete", |c| redis::cmd("DEL").arg(&rk).query::<i64>(c));
                self.corrupt.add(1);
                self.misses.add(1);
                Ok(None)
            }
        }
    }

    /// Stores `blob` under `key` (one `SET`, with the TTL when set).
    pub fn put(&self, key: &ChunkKey, blob: &KvBlob) -> Result<()> {
        blob.validate()
            .map_err(|source| StoreError::InvalidBlob { key: *key, source })?;
        let bytes = encode_with(blob, self.codec);
        let rk = self.redis_key(key);
        self.with("put", |c| {
            let mut cmd = redis::cmd("SET");
            cmd.arg(&rk).arg(&bytes);
            if let Some(ttl) = self.ttl {
                cmd.arg("PX").arg(ttl.as_millis().max(1) as u64);
            }
            cmd.query::<()>(c)
        })
    }

    /// Deletes the entry under `key` (absent keys are not an error).
    pub fn remove(&self, key: &ChunkKey) -> Result<()> {
        let rk = self.redis_key(key);
        self.with("delete", |c| redis::cmd("DEL").arg(&rk).query::<i64>(c))
            .map(|_| ())
    }

    /// Whether an entry exists under `key`.
    pub fn contains(&self, key: &ChunkKey) -> Result<bool> {
        let rk = self.redis_key(key);
        self.with("exists", |c| redis::cmd("EXISTS").arg(&rk).query::<i64>(c))
            .map(|n| n > 0)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> RemoteStats {
        RemoteStats {
            hits: self.hits.get(),
            misses: self.misses.get(),
            corrupt: self.corrupt.get(),
            errors: self.errors.get(),
        }
    }
}
