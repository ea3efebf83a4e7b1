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
use std::path::{Path, PathBuf};
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

    /// Appends `entry`; returns its id.
    pub fn append(&self, entry: &LogEntry) -> Result<String> {
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

    /// Records that entry `id` is applied here (kept across restarts).
    pub fn applied(&self, id: &str) -> Result<()> {
        let tmp = self.file.with_extension("tmp");
        std::fs::write(&tmp, id)
            .and_then(|()| std::fs::rename(&tmp, &self.file))
            .map_err(|source| GatewayError::Io {
                context: format!("writing {}", self.file.display()),
                source,
            })?;
        *self.position.lock().unwrap_or_else(|p| p.into_inner()) = id.to_string();
        Ok(())
    }

    /// The last entry id applied here.
    pub fn position(&self) -> String {
        self.position
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// This process' node id (in the entries it appends).
    pub fn node(&self) -> &str {
        &self.node
    }
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
