//! Ingestion: documents -> chunks (target tokens) -> KV precompute (+ speculator scores) ->
//! chunk store, then the index. One path for the CLI and `POST /documents`.
//!
//! Durability order, per batch: every chunk blob is written and the store flushed *before* the
//! index commit that makes the document searchable, and a document is reported done only after
//! that commit. A crash can therefore leave blobs the index does not know (reused as is when
//! the same text comes back, since keys are content addresses, and otherwise removed by the
//! garbage collection that ends the next run) but never an indexed chunk without its KV.

use crate::corpus::{Corpus, Engines};
use crate::error::Result;
use crate::input::{InputProblem, SourceDoc};
use chunkstore::{ChunkKey, ChunkStore, KvBlob};
use retriever::{ChunkParams, DocumentMeta, IndexedChunk};
use std::sync::Arc;
use std::time::Instant;

/// Settings of an ingestion run.
#[derive(Debug, Clone)]
pub struct IngestConfig {
    pub collection: String,
    /// Most target tokens per chunk.
    pub chunk_tokens: usize,
    /// Documents per index commit.
    pub batch_docs: usize,
    /// Most tokens one run may precompute (checked after chunking, before any model work).
    pub max_request_tokens: Option<usize>,
    /// Most tokens the collection may hold after the run (replaced documents count once).
    pub max_collection_tokens: Option<usize>,
    /// Also store the speculator's own KV of every chunk (what `spec_attn` reads; without it
    /// the first `spec_attn` query over a chunk computes it). Costs storage, no extra pass.
    pub speculator_kv: bool,
    /// Append each committed batch to the shared document log (when the corpus has one);
    /// off when applying another node's entry.
    pub log: bool,
    /// When chunk KV is computed: now (`eager`) or at a chunk's first retrieval (`lazy`).
    pub kv: KvMode,
    /// The document log entry this run applies (another node's), if any: a document this
    /// node wrote after that entry is left as it is ([`crate::doclog::DocLog::superseded`]).
    pub applying: Option<String>,
}

pub use crate::kvmode::KvMode;

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            collection: "default".into(),
            chunk_tokens: 512,
            batch_docs: 16,
            max_request_tokens: None,
            max_collection_tokens: None,
            speculator_kv: false,
            log: true,
            applying: None,
            kv: KvMode::Eager,
        }
    }
}

/// What happened, as the run goes.
#[derive(Debug, Clone)]
pub enum IngestEvent {
    /// All documents are chunked: this many chunks and tokens, of which `stored_chunks` with
    /// `stored_tokens` tokens have their KV stored already (found in some tier of the store:
    /// nothing to compute for them). A lazy run computes nothing and counts none stored.
    Planned {
        chunks: usize,
        tokens: usize,
        stored_chunks: usize,
        stored_tokens: usize,
    },
    /// One chunk of `tokens` tokens is stored (computed now, or already in the store).
    Chunk { cached: bool, tokens: usize },
    /// These documents are durable and searchable.
    Committed { documents: Vec<String> },
    /// A document was skipped.
    Problem(InputProblem),
}

/// The summary of a run.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct IngestReport {
    pub collection: String,
    pub documents: usize,
    pub chunks: usize,
    pub tokens: usize,
    /// Chunks whose KV was already stored (same text, model and collection).
    pub reused_chunks: usize,
    /// Chunks indexed without KV (`kv: lazy`): computed at their first retrieval.
    pub deferred_chunks: usize,
    /// KV payload bytes of the chunks of this run.
    pub kv_bytes: u64,
    /// KV payload bytes per 512 tokens (a full default chunk).
    pub kv_bytes_per_512_tokens: u64,
    /// The speculator's KV payload bytes stored by this run (`speculator_kv`).
    pub speculator_kv_bytes: u64,
    /// What the disk tier grew by in this run: the blobs as stored (after `--kv-codec`,
    /// headers included), less what garbage collection removed.
    pub kv_stored_bytes: i64,
    pub seconds: f64,
    pub chunks_per_s: f64,
    pub tokens_per_s: f64,
    /// Orphan blobs removed before the run.
    pub garbage_removed: usize,
    pub failed: usize,
    /// Time to read the last chunk back from the memory and the disk tier.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load: Option<crate::corpus::LoadTimes>,
}

struct Planned {
    doc: SourceDoc,
    chunks: Vec<retriever::Chunk>,
}

/// Ingests `docs` into `corpus` with `engines`. Bad documents are reported through `on_event`
/// and skipped; store or index failures end the run with an error (what was committed stays).
/// Ends with a full garbage collection ([`Corpus::collect_garbage`]): the entry point of
/// offline ingestion (`specrag ingest`, the demo); the server calls [`ingest_until`].
pub fn ingest(
    corpus: &Corpus,
    engines: &Engines,
    docs: Vec<SourceDoc>,
    cfg: &IngestConfig,
    on_event: impl FnMut(IngestEvent),
) -> Result<IngestReport> {
    let mut report = ingest_until(corpus, engines, docs, cfg, on_event, &mut || false)?;
    // Offline nothing waits for it: the full collection (blobs of interrupted runs, another
    // model or template) ends the run. The server runs it on its collector thread instead.
    report.garbage_removed += corpus.collect_garbage(engines)?;
    Ok(report)
}

/// [`ingest`] that calls `between_chunks` before every chunk (the engine runs waiting queries
/// there) and, once it answers true, stops: documents already reported committed stay, the
/// batch in flight is rolled back, and the error says so. A panic inside the run is rolled
/// back the same way and then resumed.
pub fn ingest_until(
    corpus: &Corpus,
    engines: &Engines,
    docs: Vec<SourceDoc>,
    cfg: &IngestConfig,
    on_event: impl FnMut(IngestEvent),
    between_chunks: &mut dyn FnMut() -> bool,
) -> Result<IngestReport> {
    let docs = not_superseded(corpus, cfg, docs);
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        ingest_inner(corpus, engines, docs, cfg, on_event, between_chunks)
    }));
    let failed = !matches!(out, Ok(Ok(_)));
    if failed {
        // Uncommitted index changes of the failed batch must not ride along with a later
        // commit (their blobs may be collected as garbage first).
        if let Err(e) = corpus.index.rollback() {
            tracing::error!("rolling back the index after a failed ingest: {e}");
        }
    }
    match out {
        Ok(out) => out,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// `docs` less those this node wrote after the log entry `cfg` applies, if it applies one.
fn not_superseded(corpus: &Corpus, cfg: &IngestConfig, docs: Vec<SourceDoc>) -> Vec<SourceDoc> {
    let (Some(entry), Some(log)) = (&cfg.applying, &corpus.doclog) else {
        return docs;
    };
    docs.into_iter()
        .filter(|d| {
            let newer = log.superseded(&cfg.collection, &d.id, entry);
            if newer {
                tracing::info!(
                    entry = entry.as_str(),
                    document = d.id.as_str(),
                    "document log entry older than this node's own write of the document: \
                     not applied to it"
                );
            }
            !newer
        })
        .collect()
}

/// Refuses a run over the request's or the collection's token budget, before model work.
fn check_budget(
    corpus: &Corpus,
    cfg: &IngestConfig,
    planned: &[Planned],
    tokens: usize,
) -> Result<()> {
    if let Some(max) = cfg.max_request_tokens {
        if tokens > max {
            return Err(crate::GatewayError::TooLarge {
                field: "documents",
                message: format!(
                    "the documents chunk into {tokens} tokens; one request may precompute at most \
                     {max} (the server's --max-request-tokens): send fewer or shorter documents \
                     per request"
                ),
            });
        }
    }
    if let Some(max) = cfg.max_collection_tokens {
        let held: usize = corpus
            .index
            .documents(Some(&cfg.collection))?
            .iter()
            .map(|d| d.tokens)
            .sum();
        let mut replaced = 0;
        for p in planned {
            replaced += corpus
                .index
                .chunks_of(&cfg.collection, &p.doc.id)?
                .iter()
                .map(|c| c.tokens)
                .sum::<usize>();
        }
        let after = held - replaced.min(held) + tokens;
        if after > max {
            return Err(crate::GatewayError::TooLarge {
                field: "collection",
                message: format!(
                    "collection `{}` holds {held} tokens and would hold {after} after this request; \
                     it may hold at most {max} (the server's --max-collection-tokens)",
                    cfg.collection
                ),
            });
        }
    }
    Ok(())
}

fn ingest_inner(
    corpus: &Corpus,
    engines: &Engines,
    docs: Vec<SourceDoc>,
    cfg: &IngestConfig,
    mut on_event: impl FnMut(IngestEvent),
    between_chunks: &mut dyn FnMut() -> bool,
) -> Result<IngestReport> {
    if cfg.chunk_tokens == 0 {
        return Err(crate::GatewayError::bad(
            "chunk_tokens",
            "must be at least 1",
        ));
    }
    let t0 = Instant::now();
    let disk_before = corpus.store.disk().stats().disk_bytes;
    let mut report = IngestReport {
        collection: cfg.collection.clone(),
        ..Default::default()
    };
    let planned = plan(engines, docs, cfg, &mut report, &mut on_event);
    let total_chunks: usize = planned.iter().map(|p| p.chunks.len()).sum();
    let total_tokens: usize = planned
        .iter()
        .flat_map(|p| &p.chunks)
        .map(|c| c.ids.len())
        .sum();
    check_budget(corpus, cfg, &planned, total_tokens)?;
    let (stored_chunks, stored_tokens) = stored_already(corpus, engines, cfg, &planned)?;
    on_event(IngestEvent::Planned {
        chunks: total_chunks,
        tokens: total_tokens,
        stored_chunks,
        stored_tokens,
    });
    let mut last_key = None;
    let mut replaced_keys = Vec::new();
    for batch in planned.chunks(cfg.batch_docs.max(1)) {
        let mut done = Vec::new();
        let mut keys = Vec::new();
        for p in batch {
            let mut indexed = Vec::with_capacity(p.chunks.len());
            for chunk in &p.chunks {
                if between_chunks() {
                    return Err(crate::GatewayError::Internal(format!(
                        "ingestion stopped after {} committed documents: the client went away",
                        report.documents
                    )));
                }
                let (key, cached) = store_chunk(corpus, engines, cfg, &chunk.text, &mut report)
                    .map_err(|e| e.in_document(&p.doc.origin))?;
                keys.extend((cached || cfg.kv == KvMode::Eager).then_some(key));
                let tokens = chunk.ids.len();
                (report.chunks, report.tokens) = (report.chunks + 1, report.tokens + tokens);
                on_event(IngestEvent::Chunk { cached, tokens });
                indexed.push(IndexedChunk {
                    chunk: chunk.clone(),
                    key: key.to_string(),
                });
                last_key = Some(key);
            }
            let meta = DocumentMeta {
                id: p.doc.id.clone(),
                title: p.doc.title.clone(),
            };
            let replaced = corpus
                .index
                .add_document(&cfg.collection, &meta, &indexed)?;
            replaced_keys.extend(replaced.into_iter().map(|r| r.key));
            done.push(p.doc.id.clone());
        }
        // Blobs first, then the index: an indexed chunk always has its KV on disk.
        corpus.store.flush()?;
        corpus.index.commit()?;
        share(corpus, cfg, batch, &keys)?;
        report.documents += done.len();
        on_event(IngestEvent::Committed { documents: done });
    }
    // The chunks of replaced documents that no document uses any more go now, key by key;
    // blobs an interrupted run left behind are reused above when their text comes back and
    // the rest wait for a full collection (`Corpus::collect_garbage`: at the end of `specrag
    // ingest`, on the server's collector thread), which would cost every ingestion a pass
    // over the whole index and store.
    report.garbage_removed += corpus.collect_left(engines, &replaced_keys)?;
    report.seconds = t0.elapsed().as_secs_f64();
    report.kv_stored_bytes = corpus.store.disk().stats().disk_bytes as i64 - disk_before as i64;
    report.chunks_per_s = report.chunks as f64 / report.seconds.max(1e-9);
    report.tokens_per_s = report.tokens as f64 / report.seconds.max(1e-9);
    let c = engines.target.config();
    // K and V, f16, every layer.
    report.kv_bytes_per_512_tokens = (2 * 2 * c.n_layer * c.kv_row() * 512) as u64;
    if let Some(key) = last_key {
        report.load = crate::corpus::load_times(&corpus.store, &key)?;
    }
    Ok(report)
}

/// Cuts every document into chunks of target tokens; a document that cannot be chunked is
/// reported and left out.
fn plan(
    engines: &Engines,
    docs: Vec<SourceDoc>,
    cfg: &IngestConfig,
    report: &mut IngestReport,
    on_event: &mut impl FnMut(IngestEvent),
) -> Vec<Planned> {
    let tok = engines.target.tokenizer();
    let encode = |text: &str| {
        let e = tok.encode(text, false);
        (e.ids, e.offsets)
    };
    let params = ChunkParams {
        max_tokens: cfg.chunk_tokens,
    };
    let mut planned = Vec::new();
    for doc in docs {
        match retriever::chunk_document(&doc.id, &doc.text, &encode, &params) {
            Ok(chunks) => planned.push(Planned { doc, chunks }),
            Err(e) => {
                report.failed += 1;
                on_event(IngestEvent::Problem(InputProblem {
                    origin: doc.origin.clone(),
                    message: e.to_string(),
                }));
            }
        }
    }
    planned
}

/// The planned chunks (and their tokens) whose KV an eager run finds stored, so an estimate
/// of the work left counts only the rest; a lazy run computes nothing, and looks nothing up.
fn stored_already(
    corpus: &Corpus,
    engines: &Engines,
    cfg: &IngestConfig,
    planned: &[Planned],
) -> Result<(usize, usize)> {
    if cfg.kv == KvMode::Lazy {
        return Ok((0, 0));
    }
    let (mut chunks, mut tokens) = (0, 0);
    for chunk in planned.iter().flat_map(|p| &p.chunks) {
        let (_, ids) = engines.segment(&chunk.text);
        if corpus.store.contains(&engines.key(&cfg.collection, &ids))? {
            (chunks, tokens) = (chunks + 1, tokens + chunk.ids.len());
        }
    }
    Ok((chunks, tokens))
}

/// Makes sure the store holds the KV of the chunk with text `chunk_text` (and, with
/// `speculator_kv`, the speculator's): computed now unless stored before. Returns its key and
/// whether it was stored before. Eagerly ingested KV is pinned on disk before this returns
/// (a copy only memory or the remote tier held is written to disk; a disk that cannot take it
/// is an error, so the batch is rolled back rather than indexed without its KV).
fn store_chunk(
    corpus: &Corpus,
    engines: &Engines,
    cfg: &IngestConfig,
    chunk_text: &str,
    report: &mut IngestReport,
) -> Result<(ChunkKey, bool)> {
    let (text, ids) = engines.segment(chunk_text);
    let key = engines.key(&cfg.collection, &ids);
    if cfg.kv == KvMode::Lazy {
        let cached = corpus.store.contains(&key)?;
        if !cached {
            report.deferred_chunks += 1;
        }
        return Ok((key, cached));
    }
    let spec_key = engines.spec_key(&key).filter(|_| cfg.speculator_kv);
    // Computed at query time before (lazily, as a passage, or by another node): ingestion
    // holds it now.
    let cached = corpus.store.hold(&key)?;
    if cached {
        report.reused_chunks += 1;
        // Stored before with the target KV only: the speculator KV joins it.
        if let Some(sk) = spec_key {
            if !corpus.store.hold(&sk)? {
                if let Some((kv, _)) =
                    engines.load_spec_kv(&corpus.store, &cfg.collection, chunk_text)?
                {
                    report.speculator_kv_bytes += kv.bytes() as u64;
                }
                if !corpus.store.hold(&sk)? {
                    return Err(crate::GatewayError::Internal(format!(
                        "the speculator KV of chunk {key} could not be stored"
                    )));
                }
            }
        }
    } else {
        let (blob, spec): (KvBlob, _) = engines.compute_with(&text, &ids, spec_key.is_some())?;
        report.kv_bytes += blob.payload_bytes() as u64;
        corpus.store.put(&key, Arc::new(blob))?;
        if let (Some(sk), Some(b)) = (spec_key, spec) {
            report.speculator_kv_bytes += b.payload_bytes() as u64;
            corpus.store.put(&sk, Arc::new(b))?;
        }
    }
    Ok((key, cached))
}

/// With a document log (and `cfg.log`): every chunk's KV is in the remote tier, then the
/// batch is appended to the log. Only then are its documents reported committed: any node
/// can now index them without computing anything.
fn share(corpus: &Corpus, cfg: &IngestConfig, batch: &[Planned], keys: &[ChunkKey]) -> Result<()> {
    let Some(log) = corpus.doclog.as_ref().filter(|_| cfg.log) else {
        return Ok(());
    };
    let ids: Vec<&str> = batch.iter().map(|p| p.doc.id.as_str()).collect();
    let unshared = |e: &dyn std::fmt::Display| {
        crate::GatewayError::Internal(format!(
            "documents {ids:?} are committed on this node but not shared with the others: {e}"
        ))
    };
    for key in keys {
        corpus.store.ensure_remote(key).map_err(|e| unshared(&e))?;
    }
    let entry = crate::doclog::LogEntry::Put {
        collection: cfg.collection.clone(),
        chunk_tokens: cfg.chunk_tokens,
        kv: cfg.kv,
        docs: batch
            .iter()
            .map(|p| crate::doclog::LogDoc {
                id: p.doc.id.clone(),
                title: p.doc.title.clone(),
                text: p.doc.text.clone(),
            })
            .collect(),
    };
    log.append(&entry).map_err(|e| unshared(&e))?;
    Ok(())
}

/// Removes a document: its chunks leave the index (committed), then blobs no other document
/// uses leave the store. A local deletion (`applying` None) is appended to the document log,
/// where there is one, for the other nodes; one that applies another node's log entry is
/// not, and leaves a document this node wrote after that entry as it is (0 chunks removed).
/// Returns how many chunks the document had.
pub fn delete_document(
    corpus: &Corpus,
    engines: &Engines,
    collection: &str,
    doc_id: &str,
    applying: Option<&str>,
) -> Result<usize> {
    if let (Some(entry), Some(log)) = (applying, &corpus.doclog) {
        if log.superseded(collection, doc_id, entry) {
            tracing::info!(
                entry,
                document = doc_id,
                "document log deletion older than this node's own write of the document: \
                 not applied"
            );
            return Ok(0);
        }
    }
    let removed = corpus.index.delete_document(collection, doc_id)?;
    let log = corpus.doclog.as_ref().filter(|_| applying.is_none());
    let entry = crate::doclog::LogEntry::Delete {
        collection: collection.to_string(),
        id: doc_id.to_string(),
    };
    if removed.is_empty() {
        corpus.index.rollback()?;
        // A deletion committed here whose append failed (the client was told so) is appended
        // when the client asks again (best effort: the answer is 404 either way).
        if let Some(l) = log.filter(|l| l.unlogged(collection, doc_id)) {
            if let Err(e) = l.append(&entry) {
                tracing::warn!(document = doc_id, "document log: {e}");
            }
        }
        return Err(crate::GatewayError::NotFound(format!(
            "document `{doc_id}` is not in collection `{collection}`"
        )));
    }
    if let Err(e) = corpus.index.commit() {
        corpus.index.rollback()?;
        return Err(e.into());
    }
    let keys: Vec<String> = removed.iter().map(|r| r.key.clone()).collect();
    corpus.collect_left(engines, &keys)?;
    if let Some(l) = log {
        l.append(&entry)?;
    }
    Ok(removed.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use target_engine::testing::{write_tiny_gguf, TinySpec};

    type TestResult = std::result::Result<(), Box<dyn std::error::Error>>;

    fn doc(id: &str, text: &str) -> SourceDoc {
        SourceDoc {
            id: id.into(),
            title: None,
            text: text.into(),
            origin: id.into(),
        }
    }

    /// The `Planned` event of ingesting `docs` eagerly: chunks, tokens, and of them stored.
    fn planned(
        corpus: &Corpus,
        engines: &Engines,
        docs: Vec<SourceDoc>,
    ) -> std::result::Result<[usize; 4], Box<dyn std::error::Error>> {
        let mut plan = None;
        ingest(corpus, engines, docs, &IngestConfig::default(), |e| {
            if let IngestEvent::Planned {
                chunks,
                tokens,
                stored_chunks,
                stored_tokens,
            } = e
            {
                plan.get_or_insert([chunks, tokens, stored_chunks, stored_tokens]);
            }
        })?;
        Ok(plan.ok_or("no Planned event")?)
    }

    #[test]
    fn the_plan_counts_chunks_stored_already_apart_from_the_work_left() -> TestResult {
        // Issue 88: the estimate counted stored tokens as still to compute.
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("target.gguf");
        write_tiny_gguf(&path, &TinySpec::new(target_engine::Architecture::Qwen2))?;
        let model = target_engine::Model::load(&path, &Default::default())?;
        let engines = Engines::new(Arc::new(model), None)?;
        let corpus = Corpus::open(&dir.path().join("data"), 1 << 20)?;
        let a = doc("a", "The ant ran in the sand near the tent.");
        let b = doc("b", "Then the ant sat in the attic and ate thin mints.");
        let [chunks, tokens, stored, stored_tokens] = planned(&corpus, &engines, vec![a.clone()])?;
        assert_eq!((stored, stored_tokens), (0, 0));
        let [all, all_tokens, stored, stored_tokens] = planned(&corpus, &engines, vec![a, b])?;
        assert_eq!((stored, stored_tokens), (chunks, tokens));
        assert!(all > chunks && all_tokens > tokens);
        Ok(())
    }
}
