//! Following the document log: a thread that applies, through the engine, every entry other
//! nodes append (an ingestion that finds its KV in the remote tier, or a deletion). Apart
//! from `doclog.rs` so the log itself (which the corpus holds) needs neither the engine nor
//! ingestion.

use crate::doclog::{DocLog, LogEntry};
use std::time::Duration;

/// Follows the log in a thread of its own: every entry another node appended is applied
/// through the engine (an ingestion that finds its KV in the remote tier, or a deletion), then
/// recorded as applied. Redis being away is retried every second; an entry that fails is
/// tried [`TRIES`] times in all, then passed over and counted ([`DocLog::failed`], on
/// `/health`); when the engine stops the thread ends without recording the entry in hand, so
/// the next start applies it.
pub fn follow(engine: crate::engine::EngineHandle, log: std::sync::Arc<DocLog>) {
    let spawned = std::thread::Builder::new()
        .name("specrag-doclog".into())
        .spawn(move || loop {
            match log.read(Duration::from_secs(2)) {
                Err(e) => {
                    tracing::warn!("document log unavailable, retrying: {e}");
                    std::thread::sleep(Duration::from_secs(1));
                }
                Ok(entries) => {
                    for (id, node, entry) in entries {
                        if node != log.node() {
                            if let Some(entry) = entry {
                                let outcome = with_retries(
                                    || apply(&engine, &id, entry.clone()),
                                    std::thread::sleep,
                                );
                                match outcome {
                                    Applied::Done => {}
                                    Applied::Stopped => {
                                        tracing::error!(
                                            entry = id,
                                            "the engine stopped: the document log follower \
                                             ends; the next start applies this entry"
                                        );
                                        return;
                                    }
                                    Applied::Failed(e) => {
                                        log.note_failed();
                                        tracing::error!(
                                            entry = id,
                                            "document log entry not applied after {TRIES} \
                                             tries, passed over (its documents are missing \
                                             here until written again): {e}"
                                        );
                                    }
                                }
                            }
                        }
                        if let Err(e) = log.applied(&id) {
                            tracing::error!("cannot record the document log position: {e}");
                        }
                    }
                }
            }
        });
    if let Err(e) = spawned {
        tracing::error!("cannot start the document log follower: {e}");
    }
}

/// How many times an entry is tried before it is passed over (waiting 1, 2, 4 s between).
pub const TRIES: u32 = 4;

/// What applying an entry came to.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Applied {
    Done,
    /// It failed; why.
    Failed(String),
    /// The engine stopped (the server is shutting down).
    Stopped,
}

/// `attempt` until it is done or the engine stops, at most [`TRIES`] times, `sleep`ing 1, 2,
/// 4 s between (a full disk or a busy store may clear meanwhile).
fn with_retries(mut attempt: impl FnMut() -> Applied, mut sleep: impl FnMut(Duration)) -> Applied {
    let mut wait = Duration::from_secs(1);
    for tried in 1..=TRIES {
        match attempt() {
            Applied::Failed(e) if tried < TRIES => {
                tracing::warn!("document log entry failed (try {tried} of {TRIES}): {e}");
                sleep(wait);
                wait *= 2;
            }
            out => return out,
        }
    }
    Applied::Failed("no try made".into())
}

/// Submits `job` to the engine, waiting while its queue is full.
fn submit(
    engine: &crate::engine::EngineHandle,
    mut make: impl FnMut() -> crate::engine::Job,
) -> bool {
    loop {
        match engine.submit(make()) {
            Ok(()) => return true,
            Err(crate::engine::SubmitError::Busy) => std::thread::sleep(Duration::from_millis(200)),
            // A refusal is for queries; this submits ingestions and deletions only.
            Err(crate::engine::SubmitError::Stopped | crate::engine::SubmitError::Refused(_)) => {
                return false
            }
        }
    }
}

/// How a follower ingests another node's batch, log entry `entry`: as that node did (same
/// collection, chunk size and KV mode: a lazily ingested batch stays lazy), without logging
/// it again, and leaving the documents this node wrote since as they are.
fn follower_config(
    collection: &str,
    chunk_tokens: usize,
    kv: crate::kvmode::KvMode,
    entry: &str,
) -> crate::ingest::IngestConfig {
    crate::ingest::IngestConfig {
        collection: collection.to_string(),
        chunk_tokens,
        kv,
        log: false,
        applying: Some(entry.to_string()),
        ..Default::default()
    }
}

/// Applies one entry of another node.
fn apply(engine: &crate::engine::EngineHandle, id: &str, entry: LogEntry) -> Applied {
    use crate::engine::Job;
    match entry {
        LogEntry::Put {
            collection,
            chunk_tokens,
            kv,
            docs,
        } => {
            let mut reply = None;
            let sent = submit(engine, || {
                let (tx, rx) = tokio::sync::oneshot::channel();
                reply = Some(rx);
                Job::Ingest {
                    docs: docs.iter().map(|d| d.source(id)).collect(),
                    cfg: follower_config(&collection, chunk_tokens, kv, id),
                    reply: tx,
                    progress: None,
                }
            });
            match reply.filter(|_| sent).map(|r| r.blocking_recv()) {
                Some(Ok(Ok((report, _)))) => {
                    tracing::info!(
                        entry = id,
                        documents = report.documents,
                        reused = report.reused_chunks,
                        "applied a document log entry"
                    );
                    Applied::Done
                }
                Some(Ok(Err(e))) => Applied::Failed(e.to_string()),
                _ => Applied::Stopped,
            }
        }
        LogEntry::Delete {
            collection,
            id: doc,
        } => {
            let mut reply = None;
            let sent = submit(engine, || {
                let (tx, rx) = tokio::sync::oneshot::channel();
                reply = Some(rx);
                Job::Delete {
                    collection: collection.clone(),
                    id: doc.clone(),
                    applying: Some(id.to_string()),
                    reply: tx,
                }
            });
            match reply.filter(|_| sent).map(|r| r.blocking_recv()) {
                // Already gone here (deleted twice, or never applied) is what was asked.
                Some(Ok(
                    Ok(_) | Err(crate::engine::JobError::Gateway(crate::GatewayError::NotFound(_))),
                )) => Applied::Done,
                Some(Ok(Err(e))) => Applied::Failed(e.to_string()),
                _ => Applied::Stopped,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvmode::KvMode;

    /// A failing entry is tried again after 1, 2 and 4 s, then passed over as failed; one that
    /// succeeds on a later try is done; a stopped engine ends at once (the entry is then not
    /// recorded as applied, so the next start applies it).
    #[test]
    fn an_entry_is_retried_then_passed_over_and_a_stop_is_not_a_failure() {
        let run = |mut outcomes: Vec<Applied>| {
            outcomes.reverse();
            let mut tries = 0;
            let mut slept = Vec::new();
            let out = with_retries(
                || {
                    tries += 1;
                    outcomes.pop().unwrap_or(Applied::Done)
                },
                |d| slept.push(d.as_secs()),
            );
            (out, tries, slept)
        };
        let failed = || Applied::Failed("disk full".into());
        assert_eq!(
            run(vec![failed(), failed(), Applied::Done]),
            (Applied::Done, 3, vec![1, 2])
        );
        assert_eq!(
            run(vec![failed(), failed(), failed(), failed(), Applied::Done]),
            (failed(), 4, vec![1, 2, 4])
        );
        assert_eq!(run(vec![Applied::Stopped]), (Applied::Stopped, 1, vec![]));
        assert_eq!(
            run(vec![failed(), Applied::Stopped]),
            (Applied::Stopped, 2, vec![1])
        );
    }

    /// Regression (issue 57): the log's `Put` carried no KV mode, so followers precomputed
    /// and pinned every chunk of a collection the ingesting node had ingested lazily.
    #[test]
    fn a_lazy_batch_is_applied_lazily() -> Result<(), serde_json::Error> {
        let entry = LogEntry::Put {
            collection: "c".into(),
            chunk_tokens: 64,
            kv: KvMode::Lazy,
            docs: vec![],
        };
        let LogEntry::Put {
            collection,
            chunk_tokens,
            kv,
            ..
        } = serde_json::from_str(&serde_json::to_string(&entry)?)?
        else {
            panic!("a put");
        };
        let cfg = follower_config(&collection, chunk_tokens, kv, "1-0");
        assert_eq!(
            (cfg.kv, cfg.log, cfg.chunk_tokens),
            (KvMode::Lazy, false, 64)
        );
        // An entry written before the log carried the mode was eager.
        let old: LogEntry =
            serde_json::from_str(r#"{"op":"put","collection":"c","chunk_tokens":8,"docs":[]}"#)?;
        assert!(matches!(
            old,
            LogEntry::Put {
                kv: KvMode::Eager,
                ..
            }
        ));
        Ok(())
    }
}
