//! The document log shared by several gateway nodes: a Redis stream (next to the remote KV
//! tier, `--kv-remote`) that every ingestion and deletion is appended to, and that each
//! `specrag serve` follows, applying other nodes' entries to its own index. Ingestion on a
//! follower finds every chunk's KV in the remote tier, so it computes nothing; a node started
//! with an empty data directory catches up from the start of the stream. The position a node
//! has applied is kept in its data directory and shown by `/health`.
//!
//! Redis' stream is the protocol (appends are atomic and ordered, readers resume from an id);
//! enable AOF on the Redis (`appendonly yes`) for the log to survive a Redis restart.

use crate::error::{GatewayError, Result};
use crate::input::SourceDoc;
use crate::kvmode::KvMode;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// One entry of the log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum LogEntry {
    /// Documents committed in `collection` (one ingestion batch).
    Put {
        collection: String,
        chunk_tokens: usize,
        /// When their chunks' KV is computed: followers ingest the same way (an entry
        /// written before the log carried it reads as `eager`).
        #[serde(default)]
        kv: KvMode,
        docs: Vec<LogDoc>,
    },
    /// A document deleted from `collection`.
    Delete { collection: String, id: String },
}

/// A document as the log carries it (its text: followers chunk it themselves).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogDoc {
    pub id: String,
    pub title: Option<String>,
    pub text: String,
}

impl LogDoc {
    /// The document to ingest, its origin naming the log entry.
    pub fn source(&self, entry: &str) -> SourceDoc {
        SourceDoc {
            id: self.id.clone(),
            title: self.title.clone(),
            text: self.text.clone(),
            origin: format!("document log {entry}"),
        }
    }
}

/// The log of one deployment (a stream key on one Redis).
pub struct DocLog {
    client: redis::Client,
    stream: String,
    /// This process, so its own entries are not applied twice.
    node: String,
    /// The last entry id applied here (`0-0`: none).
    position: Mutex<String>,
    /// Where `position` is kept.
    file: PathBuf,
    /// The id of this node's last entry for each document it wrote, `(collection, id)`,
    /// until the position passes it: a foreign entry older than it must not undo the write
    /// ([`DocLog::superseded`]).
    local: Mutex<HashMap<(String, String), StreamId>>,
    /// Entries of other nodes passed over after failing every try.
    failed: AtomicU64,
    /// Deletions committed here whose append failed, `(collection, id)`: appended when the
    /// client asks again, though the document is gone here by then.
    unappended: Mutex<std::collections::HashSet<(String, String)>>,
    /// What [`DocLog::check_config`] found, for `/health`.
    warnings: std::sync::OnceLock<Vec<String>>,
}

/// A stream entry id, `ms-seq`, ordered as Redis orders them.
type StreamId = (u64, u64);

fn stream_id(id: &str) -> Option<StreamId> {
    let (ms, seq) = id.split_once('-')?;
    Some((ms.parse().ok()?, seq.parse().ok()?))
}

impl std::fmt::Debug for DocLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DocLog")
            .field("stream", &self.stream)
            .field("node", &self.node)
            .finish()
    }
}

fn log_err(op: &str, e: impl std::fmt::Display) -> GatewayError {
    GatewayError::Internal(format!("document log {op} failed: {e}"))
}

impl DocLog {
    /// The log on the Redis at `url`, stream `{prefix}docs`, position kept in `data_dir`.
    pub fn open(url: &str, prefix: &str, data_dir: &Path) -> Result<Self> {
        let client =
            redis::Client::open(url).map_err(|e| GatewayError::bad("kv_remote", e.to_string()))?;
        let file = data_dir.join("doclog-position");
        let position = std::fs::read_to_string(&file)
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "0-0".into());
        Ok(Self {
            client,
            stream: format!("{prefix}docs"),
            node: format!("{:016x}", rand::random::<u64>()),
            position: Mutex::new(position),
            file,
            local: Mutex::new(HashMap::new()),
            failed: AtomicU64::new(0),
            unappended: Mutex::new(std::collections::HashSet::new()),
            warnings: std::sync::OnceLock::new(),
        })
    }

    fn connection(&self, read_timeout: Duration) -> Result<redis::Connection> {
        let c = self
            .client
            .get_connection_with_timeout(Duration::from_secs(5))
            .map_err(|e| log_err("connect", e))?;
        c.set_read_timeout(Some(read_timeout))
            .map_err(|e| log_err("connect", e))?;
        Ok(c)
    }

    /// Appends `entry`, a write this node has just committed; returns its id. A deletion
    /// that cannot be appended is remembered ([`DocLog::unlogged`]).
    pub fn append(&self, entry: &LogEntry) -> Result<String> {
        let id = self.xadd(entry);
        if let LogEntry::Delete {
            collection,
            id: doc,
        } = entry
        {
            let mut unappended = self.unappended.lock().unwrap_or_else(|p| p.into_inner());
            let key = (collection.clone(), doc.clone());
            if id.is_ok() {
                unappended.remove(&key);
            } else {
                unappended.insert(key);
            }
        }
        let id = id?;
        self.record_local(entry, &id);
        Ok(id)
    }

    fn xadd(&self, entry: &LogEntry) -> Result<String> {
        let json = serde_json::to_string(entry).map_err(|e| log_err("append", e))?;
        let mut c = self.connection(Duration::from_secs(5))?;
        redis::cmd("XADD")
            .arg(&self.stream)
            .arg("*")
            .arg("node")
            .arg(&self.node)
            .arg("entry")
            .arg(json)
            .query(&mut c)
            .map_err(|e| log_err("append", e))
    }

    /// True when this node deleted `doc` of `collection` but could not append the deletion.
    pub fn unlogged(&self, collection: &str, doc: &str) -> bool {
        self.unappended
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&(collection.to_string(), doc.to_string()))
    }

    /// Notes that this node wrote `entry`'s documents as log entry `id` ([`DocLog::append`]
    /// does, for what it appends).
    pub fn record_local(&self, entry: &LogEntry, id: &str) {
        let Some(at) = stream_id(id) else { return };
        let mut local = self.local.lock().unwrap_or_else(|p| p.into_inner());
        let mut note = |collection: &str, doc: &str| {
            local.insert((collection.to_string(), doc.to_string()), at);
        };
        match entry {
            LogEntry::Put {
                collection, docs, ..
            } => docs.iter().for_each(|d| note(collection, &d.id)),
            LogEntry::Delete { collection, id } => note(collection, id),
        }
    }

    /// True when this node wrote document `doc` of `collection` after log entry `entry` was
    /// appended: applying that older entry now would undo the newer write here, while every
    /// other node applies both in log order. Local writes are committed before they are
    /// appended, so a follower may meet an older foreign entry after them.
    pub fn superseded(&self, collection: &str, doc: &str, entry: &str) -> bool {
        let Some(entry) = stream_id(entry) else {
            return false;
        };
        let local = self.local.lock().unwrap_or_else(|p| p.into_inner());
        local
            .get(&(collection.to_string(), doc.to_string()))
            .is_some_and(|&mine| mine > entry)
    }

    /// Entries after the applied position, waiting up to `block` for one: `(id, node,
    /// entry)`. An entry that does not parse is returned as `None` (skipped, logged).
    pub fn read(&self, block: Duration) -> Result<Vec<(String, String, Option<LogEntry>)>> {
        let mut c = self.connection(block + Duration::from_secs(5))?;
        let from = self.position();
        let reply: redis::Value = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(16)
            .arg("BLOCK")
            .arg(block.as_millis() as u64)
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(&from)
            .query(&mut c)
            .map_err(|e| log_err("read", e))?;
        Ok(parse_xread(reply))
    }

    /// Records that entry `id` is applied here (kept across restarts, synced: a power loss
    /// must not send the node back to the start of the stream).
    /// The position moves on in memory even where the file cannot be written (the follower
    /// would otherwise read and apply the same entries again and again); the error says so.
    pub fn applied(&self, id: &str) -> Result<()> {
        use std::io::Write;
        *self.position.lock().unwrap_or_else(|p| p.into_inner()) = id.to_string();
        // Entries still to come are later than `id`: a local write no later than it can no
        // longer be undone by one.
        if let Some(at) = stream_id(id) {
            let mut local = self.local.lock().unwrap_or_else(|p| p.into_inner());
            local.retain(|_, mine| *mine > at);
        }
        let tmp = self.file.with_extension("tmp");
        std::fs::File::create(&tmp)
            .and_then(|mut f| {
                f.write_all(id.as_bytes())?;
                f.sync_all()
            })
            .and_then(|()| std::fs::rename(&tmp, &self.file))
            .map_err(|source| GatewayError::Io {
                context: format!("writing {}", self.file.display()),
                source,
            })
    }

    /// The last entry id applied here.
    pub fn position(&self) -> String {
        self.position
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Counts an entry of another node passed over after failing every try.
    pub fn note_failed(&self) {
        self.failed.fetch_add(1, Ordering::Relaxed);
    }

    /// Entries of other nodes this process passed over after failing every try: their
    /// documents are missing here until written again.
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }

    /// This process' node id (in the entries it appends).
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Reads the Redis' configuration once ([`DocLog::config_warnings`]), logs what can lose
    /// the log and keeps it for [`DocLog::warnings`].
    pub fn check_config(&self, ttl: Option<Duration>) {
        let found = self.config_warnings(ttl);
        for w in &found {
            tracing::warn!("--kv-remote: {w}");
        }
        let _ = self.warnings.set(found);
    }

    /// What [`DocLog::check_config`] found (none before it ran).
    pub fn warnings(&self) -> Vec<String> {
        self.warnings.get().cloned().unwrap_or_default()
    }

    /// What in the Redis' configuration can lose the log or refuse its appends, read with
    /// `CONFIG GET` (`ttl`: the chunk KV's TTL, `--kv-remote-ttl-secs`). Empty when nothing
    /// does, or when the Redis does not answer `CONFIG` (managed ones may refuse it).
    pub fn config_warnings(&self, ttl: Option<Duration>) -> Vec<String> {
        let Ok(mut c) = self.connection(Duration::from_secs(5)) else {
            return Vec::new();
        };
        let mut get = |name: &str| -> Option<String> {
            redis::cmd("CONFIG")
                .arg("GET")
                .arg(name)
                .query::<HashMap<String, String>>(&mut c)
                .ok()?
                .remove(name)
        };
        let (Some(maxmemory), Some(policy)) = (get("maxmemory"), get("maxmemory-policy")) else {
            return Vec::new();
        };
        let appendonly = get("appendonly");
        redis_warnings(
            &self.stream,
            &maxmemory,
            &policy,
            appendonly.as_deref(),
            ttl,
        )
    }
}

/// [`DocLog::config_warnings`] from the values read.
fn redis_warnings(
    stream: &str,
    maxmemory: &str,
    policy: &str,
    appendonly: Option<&str>,
    ttl: Option<Duration>,
) -> Vec<String> {
    let mut out = Vec::new();
    let limited = maxmemory.trim().parse::<u64>().map_or(true, |m| m > 0);
    if limited && policy.starts_with("allkeys-") {
        out.push(format!(
            "Redis evicts any key when full (maxmemory-policy {policy}): the document log \
             `{stream}` can be evicted with chunk KV, and nodes then miss documents; set \
             maxmemory-policy volatile-lru and --kv-remote-ttl-secs, so that only chunk KV (which \
             then has a TTL) is evicted"
        ));
    } else if limited && ttl.is_none() {
        out.push(format!(
            "Redis evicts only keys with a TTL (maxmemory-policy {policy}) and chunk KV has none \
             (--kv-remote-ttl-secs 0): once Redis is full it refuses writes, chunk KV is no \
             longer shared and new documents' log entries fail; set --kv-remote-ttl-secs"
        ));
    }
    if appendonly == Some("no") {
        out.push(format!(
            "Redis keeps no append-only file (appendonly no): a Redis restart loses the document \
             log `{stream}`, and a node started after it misses every document ingested before; \
             set appendonly yes"
        ));
    }
    out
}

/// `XREAD`'s reply: `[[stream, [[id, [field, value, ...]], ...]]]`, or nil on timeout.
fn parse_xread(v: redis::Value) -> Vec<(String, String, Option<LogEntry>)> {
    use redis::Value as V;
    let text = |v: &V| match v {
        V::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        V::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    let mut out = Vec::new();
    let streams = match v {
        V::Array(s) => s,
        V::Map(m) => m.into_iter().map(|(k, v)| V::Array(vec![k, v])).collect(),
        _ => return out,
    };
    for s in streams {
        let V::Array(parts) = s else { continue };
        let Some(V::Array(entries)) = parts.get(1).cloned() else {
            continue;
        };
        for e in entries {
            let V::Array(e) = e else { continue };
            let (Some(id), Some(V::Array(fields))) = (e.first().and_then(text), e.get(1)) else {
                continue;
            };
            let mut node = String::new();
            let mut entry = None;
            for kv in fields.chunks(2) {
                match (
                    kv.first().and_then(text).as_deref(),
                    kv.get(1).and_then(text),
                ) {
                    (Some("node"), Some(n)) => node = n,
                    (Some("entry"), Some(j)) => {
                        entry = serde_json::from_str(&j)
                            .map_err(|e| tracing::warn!(id, "document log entry skipped: {e}"))
                            .ok();
                    }
                    _ => {}
                }
            }
            out.push((id, node, entry));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_settings_that_lose_the_log_are_named() {
        let day = Some(Duration::from_secs(86_400));
        let w = redis_warnings("s:docs", "1000000", "allkeys-lru", Some("yes"), day);
        assert_eq!(w.len(), 1);
        assert!(
            w[0].contains("allkeys-lru") && w[0].contains("`s:docs`"),
            "{w:?}"
        );
        // No memory limit: nothing is evicted, whatever the policy.
        assert!(redis_warnings("s:docs", "0", "allkeys-lru", Some("yes"), None).is_empty());
        // Evicting only keys with a TTL keeps the log; chunk KV needs one then.
        assert!(redis_warnings("s:docs", "1000000", "volatile-lru", Some("yes"), day).is_empty());
        let w = redis_warnings("s:docs", "1000000", "volatile-lru", Some("yes"), None);
        assert!(
            w.len() == 1 && w[0].contains("--kv-remote-ttl-secs"),
            "{w:?}"
        );
        let w = redis_warnings("s:docs", "0", "noeviction", Some("no"), None);
        assert!(w.len() == 1 && w[0].contains("appendonly yes"), "{w:?}");
    }

    fn put(collection: &str, ids: &[&str]) -> LogEntry {
        LogEntry::Put {
            collection: collection.into(),
            chunk_tokens: 64,
            kv: KvMode::Eager,
            docs: ids
                .iter()
                .map(|id| LogDoc {
                    id: (*id).into(),
                    title: None,
                    text: "t".into(),
                })
                .collect(),
        }
    }

    /// An entry is older than a local write by Redis' id order (milliseconds, then sequence),
    /// per document and collection; once the applied position passes a local write, it is
    /// forgotten (no older entry can come after the position).
    #[test]
    fn only_entries_older_than_a_local_write_of_the_same_document_are_superseded() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| log_err("test", e))?;
        // Never connected: the client connects at the first command.
        let log = DocLog::open("redis://127.0.0.1:1", "t", dir.path())?;
        log.record_local(&put("c", &["a", "b"]), "20-3");
        log.record_local(
            &LogEntry::Delete {
                collection: "c".into(),
                id: "z".into(),
            },
            "30-0",
        );
        assert!(log.superseded("c", "a", "20-2"));
        assert!(log.superseded("c", "b", "9-99"));
        assert!(log.superseded("c", "z", "29-9"));
        assert!(!log.superseded("c", "a", "20-4"), "a later entry applies");
        assert!(!log.superseded("c", "a", "100-0"));
        assert!(
            !log.superseded("other", "a", "1-0"),
            "another collection's document"
        );
        assert!(
            !log.superseded("c", "x", "1-0"),
            "a document not written here"
        );
        assert!(!log.superseded("c", "a", "garbage"));
        log.applied("25-0")?;
        assert_eq!(
            std::fs::read_to_string(dir.path().join("doclog-position"))
                .ok()
                .as_deref(),
            Some("25-0")
        );
        assert!(
            !log.superseded("c", "a", "20-2"),
            "forgotten past the position"
        );
        assert!(
            log.superseded("c", "z", "29-9"),
            "still ahead of the position"
        );
        Ok(())
    }

    /// A deletion committed here whose append failed is remembered, so the client's next
    /// DELETE (answered 404: the document is gone here) appends it; nothing else is.
    #[test]
    fn a_deletion_that_could_not_be_appended_is_remembered() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| log_err("test", e))?;
        // Nothing listens on port 1: every append fails.
        let log = DocLog::open("redis://127.0.0.1:1", "t", dir.path())?;
        let delete = LogEntry::Delete {
            collection: "c".into(),
            id: "d".into(),
        };
        assert!(log.append(&delete).is_err());
        assert!(log.unlogged("c", "d"));
        assert!(!log.unlogged("c", "e") && !log.unlogged("other", "d"));
        assert!(log.append(&put("c", &["p"])).is_err());
        assert!(
            !log.unlogged("c", "p"),
            "a put is appended again by its ingestion"
        );
        Ok(())
    }
}
