//! `specrag ingest` end to end on tiny random models: bad inputs, crash durability (a real
//! `kill -9`), and chunk loading from memory, disk, or recompute.

use chunkstore::ChunkStore;
use gateway::corpus::{Corpus, Engines, Tier};
use gateway::method::Method;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use target_engine::prelude::*;
use target_engine::testing::{write_tiny_gguf, TinySpec};
use target_engine::{Architecture, LoadOptions, Model};

type TestResult = Result<(), Box<dyn std::error::Error>>;

struct Models {
    target: PathBuf,
    spec: PathBuf,
}

fn tiny_models(dir: &Path) -> Result<Models, Box<dyn std::error::Error>> {
    let target = dir.join("target.gguf");
    let spec = dir.join("spec.gguf");
    write_tiny_gguf(&target, &TinySpec::new(Architecture::Qwen2))?;
    let mut s = TinySpec::new(Architecture::Llama);
    s.seed = 7;
    write_tiny_gguf(&spec, &s)?;
    Ok(Models { target, spec })
}

fn specrag(models: &Models) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_specrag"));
    c.arg("--target")
        .arg(&models.target)
        .arg("--speculator")
        .arg(&models.spec)
        .env("RUST_LOG", "error");
    c
}

fn write_corpus(dir: &Path, docs: usize) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for i in 0..docs {
        let text = format!(
            "# Note {i}\n\nThe ant {i} ran in the sand near the tent.\n\nThen the ant {i} sat \
             in the attic and ate {} thin mints. The end of note {i}.",
            i * 7
        );
        std::fs::write(dir.join(format!("note{i:03}.md")), text)?;
    }
    Ok(())
}

/// Every indexed chunk has readable KV, and no blob is unreferenced (when `exact`).
fn check_consistent(data: &Path, exact: bool) -> Result<usize, Box<dyn std::error::Error>> {
    let corpus = Corpus::open(data, 1 << 20)?;
    let referenced = corpus.referenced_keys()?;
    for key in &referenced {
        let key: chunkstore::ChunkKey = key.parse()?;
        assert!(
            corpus.store.get(&key)?.is_some(),
            "indexed chunk {key} has no KV in the store"
        );
    }
    let stored = corpus.store.keys()?;
    if exact {
        assert_eq!(stored.len(), referenced.len(), "orphan blobs left");
    }
    Ok(corpus.index.documents(None)?.len())
}

#[allow(
    clippy::too_many_lines,
    reason = "a crash scenario: every step after the kill checks the state the kill left"
)]
#[test]
fn a_document_reported_committed_survives_kill_9_and_the_next_run_repairs() -> TestResult {
    let dir = tempfile::tempdir()?;
    let models = tiny_models(dir.path())?;
    let corpus_dir = dir.path().join("corpus");
    write_corpus(&corpus_dir, 300)?;
    let data = dir.path().join("data");
    let mut child = specrag(&models)
        .args([
            "ingest",
            "--json",
            "--batch-docs",
            "1",
            "--chunk-tokens",
            "24",
        ])
        .arg("--data")
        .arg(&data)
        .arg(&corpus_dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut committed = Vec::new();
    let mut finished = false;
    // The reader stays alive until after the kill, so the child cannot die of a closed pipe
    // (and unwind through sled's flushing destructors) instead of SIGKILL.
    let mut lines = BufReader::new(stdout).lines();
    for line in lines.by_ref() {
        let v: serde_json::Value = serde_json::from_str(&line?)?;
        match v["event"].as_str() {
            Some("committed") => {
                for d in v["documents"].as_array().ok_or("documents")? {
                    committed.push(d.as_str().ok_or("doc id")?.to_string());
                }
                if committed.len() >= 3 {
                    break;
                }
            }
            Some("summary") => finished = true,
            _ => {}
        }
    }
    child.kill()?; // SIGKILL
    let status = child.wait()?;
    drop(lines);
    {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            status.signal(),
            Some(9),
            "killed by SIGKILL, not ended by itself"
        );
    }
    assert!(
        !finished,
        "the run ended before it was killed; use more documents"
    );
    assert!(committed.len() >= 3);
    // Everything reported committed is searchable with its KV; nothing indexed lacks KV.
    {
        let corpus = Corpus::open(&data, 1 << 20)?;
        for id in &committed {
            let chunks = corpus.index.chunks_of("default", id)?;
            assert!(
                !chunks.is_empty(),
                "{id} was reported committed but is lost"
            );
        }
    }
    let before = check_consistent(&data, false)?;
    assert!(before >= committed.len() && before < 300, "{before}");
    // The next run completes, and leaves index and store exactly consistent.
    let out = specrag(&models)
        .args(["ingest", "--json", "--chunk-tokens", "24"])
        .arg("--data")
        .arg(&data)
        .arg(&corpus_dir)
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_str(
        String::from_utf8(out.stdout)?
            .lines()
            .last()
            .ok_or("no output")?,
    )?;
    assert_eq!(summary["event"], "summary");
    assert_eq!(summary["documents"], 300);
    assert!(
        summary["reused_chunks"].as_u64().ok_or("reused")? > 0,
        "chunks stored before the crash are reused"
    );
    assert_eq!(check_consistent(&data, true)?, 300);
    Ok(())
}

#[allow(
    clippy::too_many_lines,
    reason = "a crash scenario: every step after the kill checks the state the kill left"
)]
#[test]
fn kill_9_during_an_http_ingest_loses_no_document_reported_committed() -> TestResult {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir()?;
    let models = tiny_models(dir.path())?;
    let data = dir.path().join("data");
    let mut server = specrag(&models)
        .args([
            "serve",
            "--addr",
            "127.0.0.1:0",
            "--max-request-tokens",
            "4000000",
        ])
        .arg("--data")
        .arg(&data)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()?;
    let stderr = server.stderr.take().ok_or("no stderr")?;
    let mut log = BufReader::new(stderr).lines();
    let addr = loop {
        let line = log.next().ok_or("the server ended before listening")??;
        if let Some(rest) = line.split("listening on http://").nth(1) {
            break rest
                .split_whitespace()
                .next()
                .ok_or("no address")?
                .to_string();
        }
    };
    let docs: Vec<serde_json::Value> = (0..400)
        .map(|i| {
            serde_json::json!({
                "id": format!("d{i}"),
                "text": format!("note {i}: the ant {i} ran in the sand near the tent and ate {} mints", i * 7),
            })
        })
        .collect();
    let body = serde_json::json!({"chunk_tokens": 16, "documents": docs}).to_string();
    let mut conn = std::net::TcpStream::connect(&addr)?;
    write!(
        conn,
        "POST /documents HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         accept: application/x-ndjson\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )?;
    // Read the streamed lines (chunked encoding: JSON lines between chunk-size lines) until
    // enough batches are reported committed, then kill the server mid-ingestion.
    let mut raw = Vec::new();
    let mut committed: Vec<String> = Vec::new();
    let mut buf = [0u8; 4096];
    let mut finished = false;
    while committed.len() < 48 {
        let n = conn.read(&mut buf)?;
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        committed.clear();
        for line in String::from_utf8_lossy(&raw).lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line.trim()) else {
                continue;
            };
            match v["event"].as_str() {
                Some("committed") => {
                    for d in v["documents"].as_array().ok_or("documents")? {
                        committed.push(d.as_str().ok_or("id")?.to_string());
                    }
                }
                Some("summary") => finished = true,
                _ => {}
            }
        }
    }
    server.kill()?; // SIGKILL
    let status = server.wait()?;
    {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(9));
    }
    assert!(
        !finished,
        "the ingestion ended before the kill; send more documents"
    );
    assert!(committed.len() >= 48, "{} committed", committed.len());
    let corpus = Corpus::open(&data, 1 << 20)?;
    for id in &committed {
        assert!(
            !corpus.index.chunks_of("default", id)?.is_empty(),
            "{id} was reported committed but is lost"
        );
    }
    let kept = corpus.index.documents(Some("default"))?.len();
    assert!(kept < 400, "{kept}");
    drop(corpus);
    // Every indexed chunk has its KV.
    check_consistent(&data, false)?;
    Ok(())
}

#[test]
fn bad_inputs_are_named_skipped_and_make_the_run_partial() -> TestResult {
    let dir = tempfile::tempdir()?;
    let models = tiny_models(dir.path())?;
    let corpus_dir = dir.path().join("corpus");
    write_corpus(&corpus_dir, 2)?;
    std::fs::write(corpus_dir.join("latin1.txt"), b"caf\xe9")?;
    std::fs::write(
        corpus_dir.join("docs.jsonl"),
        "{\"id\":\"a\",\"text\":\"the ant\"}\n{\"id\":\"a\",\"text\":\"again\"}\n{oops\n{\"id\":\"b\",\"text\":\" \"}\n",
    )?;
    let data = dir.path().join("data");
    let out = specrag(&models)
        .args(["ingest", "--no-spec-scores"])
        .arg("--data")
        .arg(&data)
        .arg(&corpus_dir)
        .output()?;
    assert_eq!(out.status.code(), Some(3), "partial run exit code");
    let err = String::from_utf8(out.stderr)?;
    for needle in [
        "latin1.txt:1: not valid UTF-8",
        "docs.jsonl:2: duplicate document id `a`",
        "docs.jsonl:3: malformed JSON line",
        "docs.jsonl:4: field `text` is empty",
    ] {
        assert!(err.contains(needle), "missing `{needle}` in:\n{err}");
    }
    let stdout = String::from_utf8(out.stdout)?;
    assert!(stdout.contains("ingested 3 documents"), "{stdout}");
    assert_eq!(check_consistent(&data, true)?, 3);
    Ok(())
}

#[test]
fn chunk_kv_loads_from_memory_disk_or_recompute_and_damage_is_never_served() -> TestResult {
    let dir = tempfile::tempdir()?;
    let models = tiny_models(dir.path())?;
    let opts = LoadOptions::default();
    let target = Arc::new(Model::load(&models.target, &opts)?);
    let spec = Arc::new(Model::load(&models.spec, &opts)?);
    let engines = Engines::new(target.clone(), Some(spec))?;
    let corpus = Corpus::open(&dir.path().join("data"), 1 << 30)?;
    let text = "the thin ant ran in the sand";
    let first = engines.load(&corpus.store, "c1", text)?;
    assert_eq!(first.tier, Tier::Recomputed);
    assert!(
        first.scores.is_some(),
        "speculator scores stored with the KV"
    );
    let again = engines.load(&corpus.store, "c1", text)?;
    assert_eq!(again.tier, Tier::Memory);
    assert_eq!(again.kv, first.kv);
    // Another collection never shares the entry.
    assert_eq!(
        engines.load(&corpus.store, "c2", text)?.tier,
        Tier::Recomputed
    );
    // From disk, after the memory tier is emptied.
    corpus.store.memory().clear();
    let disk = engines.load(&corpus.store, "c1", text)?;
    assert_eq!(disk.tier, Tier::Disk);
    assert_eq!(disk.kv, first.kv);
    // The stored KV equals a fresh precompute after the prefix.
    let (_, ids) = engines.segment(text);
    assert_eq!(disk.kv, target.precompute(&ids, Some(&engines.prefix))?);
    // Damage the blob on disk: it is dropped and recomputed, never served.
    corpus.store.memory().clear();
    let mut raw = corpus
        .store
        .disk()
        .get_raw(&first.key)?
        .ok_or("blob missing")?;
    let n = raw.len();
    raw[n - 3] ^= 0x55;
    corpus.store.disk().put_raw(&first.key, &raw)?;
    let repaired = engines.load(&corpus.store, "c1", text)?;
    assert_eq!(repaired.tier, Tier::Recomputed);
    assert_eq!(repaired.kv, first.kv);
    assert_eq!(corpus.store.stats().corrupt, 1);
    Ok(())
}

#[test]
fn ingestion_stops_between_chunks_when_asked_and_keeps_what_was_committed() -> TestResult {
    use gateway::ingest::{ingest_until, IngestConfig, IngestEvent};
    use gateway::input::SourceDoc;
    use std::cell::Cell;
    let dir = tempfile::tempdir()?;
    let models = tiny_models(dir.path())?;
    let opts = LoadOptions::default();
    let engines = Engines::new(Arc::new(Model::load(&models.target, &opts)?), None)?;
    let corpus = Corpus::open(&dir.path().join("data"), 1 << 30)?;
    let docs: Vec<SourceDoc> = (0..4)
        .map(|i| SourceDoc {
            id: format!("d{i}"),
            title: None,
            text: format!("document {i}: the thin ant ran in the sand near tent {i}"),
            origin: format!("d{i}"),
        })
        .collect();
    // One document per commit; stop once two chunks are stored.
    let cfg = IngestConfig {
        collection: "c".into(),
        chunk_tokens: 512,
        batch_docs: 1,
        ..Default::default()
    };
    let stored = Cell::new(0);
    let mut committed = Vec::new();
    let out = ingest_until(
        &corpus,
        &engines,
        docs,
        &cfg,
        |e| match e {
            IngestEvent::Chunk { .. } => stored.set(stored.get() + 1),
            IngestEvent::Committed { documents } => committed.extend(documents),
            _ => {}
        },
        &mut || stored.get() >= 2,
    );
    let err = out.expect_err("stopped").to_string();
    assert!(err.contains("went away"), "{err}");
    assert_eq!(committed, vec!["d0".to_string(), "d1".to_string()]);
    let listed = corpus.index.documents(Some("c"))?;
    let ids: Vec<&str> = listed.iter().map(|d| d.doc_id.as_str()).collect();
    assert_eq!(
        ids,
        vec!["d0", "d1"],
        "committed documents stay, nothing else"
    );
    Ok(())
}

/// Tiny target engines, a fresh corpus and `n` short documents.
fn tiny_setup(
    dir: &Path,
    n: usize,
) -> Result<(Engines, Corpus, Vec<gateway::input::SourceDoc>), Box<dyn std::error::Error>> {
    let models = tiny_models(dir)?;
    let engines = Engines::new(
        Arc::new(Model::load(&models.target, &LoadOptions::default())?),
        None,
    )?;
    let corpus = Corpus::open(&dir.join("data"), 1 << 30)?;
    let docs = (0..n)
        .map(|i| gateway::input::SourceDoc {
            id: format!("d{i}"),
            title: None,
            text: format!("document {i}: the thin ant ran in the sand near tent {i}"),
            origin: format!("d{i}"),
        })
        .collect();
    Ok((engines, corpus, docs))
}

#[test]
fn token_budgets_refuse_before_model_work_and_count_replacements_once() -> TestResult {
    use gateway::ingest::{ingest, IngestConfig};
    use gateway::GatewayError;
    let dir = tempfile::tempdir()?;
    let (engines, corpus, docs) = tiny_setup(dir.path(), 3)?;
    let mut cfg = IngestConfig {
        collection: "c".into(),
        ..Default::default()
    };
    let first = ingest(&corpus, &engines, docs.clone(), &cfg, |_| {})?;
    let held = first.tokens;
    assert!(held > 3);
    // The request budget: one token short refuses the whole request, and nothing is computed.
    let more: Vec<_> = docs
        .iter()
        .map(|d| gateway::input::SourceDoc {
            id: format!("{}-more", d.id),
            ..d.clone()
        })
        .collect();
    cfg.max_request_tokens = Some(held - 1);
    let puts = corpus.store.stats().entries;
    match ingest(&corpus, &engines, more.clone(), &cfg, |_| {}) {
        Err(GatewayError::TooLarge { field, message }) => {
            assert_eq!(field, "documents");
            assert!(message.contains("--max-request-tokens"), "{message}");
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert_eq!(corpus.store.stats().entries, puts, "no KV was computed");
    cfg.max_request_tokens = Some(held);
    // The collection budget: re-sending the same documents replaces them (counted once) ...
    cfg.max_collection_tokens = Some(held);
    let again = ingest(&corpus, &engines, docs.clone(), &cfg, |_| {})?;
    assert_eq!(again.documents, 3);
    // ... while new ones would go over.
    match ingest(&corpus, &engines, more, &cfg, |_| {}) {
        Err(GatewayError::TooLarge { field, message }) => {
            assert_eq!(field, "collection");
            assert!(
                message.contains(&format!("holds {held} tokens")),
                "{message}"
            );
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert_eq!(corpus.index.documents(Some("c"))?.len(), 3);
    Ok(())
}

#[test]
fn a_panic_during_ingestion_rolls_back_the_batch_in_flight() -> TestResult {
    use gateway::ingest::{ingest, ingest_until, IngestConfig};
    let dir = tempfile::tempdir()?;
    let (engines, corpus, docs) = tiny_setup(dir.path(), 4)?;
    let cfg = IngestConfig {
        collection: "c".into(),
        batch_docs: 2,
        ..Default::default()
    };
    // Batch 1 (d0, d1) commits; d2 is added to the index writer, then the run panics before
    // d3, with d2 not committed.
    let mut seen = 0;
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        ingest_until(&corpus, &engines, docs.clone(), &cfg, |_| {}, &mut || {
            seen += 1;
            if seen == 4 {
                panic!("injected fault");
            }
            false
        })
    }));
    assert!(out.is_err(), "the panic reaches the caller");
    // A later run commits its own document only: d2's uncommitted add did not ride along.
    let later = vec![gateway::input::SourceDoc {
        id: "later".into(),
        ..docs[0].clone()
    }];
    ingest(&corpus, &engines, later, &cfg, |_| {})?;
    let ids: Vec<String> = corpus
        .index
        .documents(Some("c"))?
        .into_iter()
        .map(|d| d.doc_id)
        .collect();
    assert_eq!(ids, ["d0", "d1", "later"]);
    drop(corpus);
    check_consistent(&dir.path().join("data"), false).map(|_| ())
}

/// Blobs an interrupted run left behind are reused when their text comes back, and removed
/// by the end of the next run otherwise (garbage collection runs last, not first).
#[test]
fn blobs_an_interrupted_run_left_are_reused_or_collected_at_the_end_of_the_next() -> TestResult {
    use gateway::ingest::{ingest, ingest_until, IngestConfig};
    let dir = tempfile::tempdir()?;
    let (engines, corpus, docs) = tiny_setup(dir.path(), 6)?;
    let cfg = IngestConfig {
        collection: "c".into(),
        batch_docs: 2,
        ..Default::default()
    };
    // Stopped before d3's chunk: d0 and d1 committed, d2's blob stored but never indexed.
    let interrupted = |docs: Vec<gateway::input::SourceDoc>| {
        let mut seen = 0;
        ingest_until(&corpus, &engines, docs, &cfg, |_| {}, &mut || {
            seen += 1;
            seen == 4
        })
    };
    assert!(interrupted(docs[..4].to_vec()).is_err());
    assert_eq!(corpus.store.keys()?.len(), 3, "d2's blob left behind");
    let again = ingest(&corpus, &engines, vec![docs[2].clone()], &cfg, |_| {})?;
    assert_eq!((again.reused_chunks, again.garbage_removed), (1, 0));
    // Left behind again (d5's blob), and this time its text does not come back.
    let more = vec![
        docs[3].clone(),
        docs[4].clone(),
        docs[5].clone(),
        docs[0].clone(),
    ];
    assert!(interrupted(more).is_err());
    let other = ingest(&corpus, &engines, vec![docs[3].clone()], &cfg, |_| {})?;
    assert_eq!((other.reused_chunks, other.garbage_removed), (1, 1));
    drop(corpus);
    check_consistent(&dir.path().join("data"), true).map(|_| ())
}

/// Replication: a node commits its own write before appending it to the document log, so its
/// follower, behind, could meet another node's older entry for the same document after it and
/// apply it, leaving this node with the older text (or none) while every other node, applying
/// both in log order, holds the newer. Such an entry leaves the document as it is here;
/// the rest of the entry, and later entries, apply.
#[test]
fn an_older_log_entry_does_not_undo_a_newer_local_write() -> TestResult {
    use gateway::doclog::{DocLog, LogDoc, LogEntry};
    use gateway::ingest::{delete_document, ingest, IngestConfig};
    let dir = tempfile::tempdir()?;
    let (engines, mut corpus, docs) = tiny_setup(dir.path(), 2)?;
    // Never connected: nothing here appends (`log: false`), writes are noted as appended.
    corpus.doclog = Some(Arc::new(DocLog::open(
        "redis://127.0.0.1:1",
        "t",
        dir.path(),
    )?));
    let log = corpus.doclog.clone().ok_or("a log")?;
    let local = IngestConfig {
        collection: "c".into(),
        log: false,
        ..Default::default()
    };
    let applying = |entry: &str| IngestConfig {
        applying: Some(entry.into()),
        ..local.clone()
    };
    let text = |id: &str| -> Result<String, Box<dyn std::error::Error>> {
        Ok(corpus
            .index
            .chunks_of("c", id)?
            .iter()
            .map(|c| c.text.clone())
            .collect())
    };
    let as_log = |d: &gateway::input::SourceDoc| LogDoc {
        id: d.id.clone(),
        title: None,
        text: d.text.clone(),
    };
    let mut newer = docs[0].clone();
    newer.text = "document 0, the newer text: an owl in the barn".into();
    ingest(&corpus, &engines, vec![newer.clone()], &local, |_| {})?;
    log.record_local(
        &LogEntry::Put {
            collection: "c".into(),
            chunk_tokens: 512,
            kv: Default::default(),
            docs: vec![as_log(&newer)],
        },
        "20-0",
    );
    // Another node's entry 10-0 (d0's older text and d1) arrives now.
    ingest(&corpus, &engines, docs.clone(), &applying("10-0"), |_| {})?;
    assert!(text("d0")?.contains("the newer text"), "{}", text("d0")?);
    assert!(
        text("d1")?.contains("document 1"),
        "the rest of the entry applies"
    );
    // An older deletion of d0 is passed over; one of d1 applies.
    assert_eq!(
        delete_document(&corpus, &engines, "c", "d0", Some("15-0"))?,
        0
    );
    assert!(text("d0")?.contains("the newer text"));
    assert_eq!(
        delete_document(&corpus, &engines, "c", "d1", Some("16-0"))?,
        1
    );
    assert!(text("d1")?.is_empty());
    // A later entry applies over the local write.
    ingest(
        &corpus,
        &engines,
        vec![docs[0].clone()],
        &applying("21-0"),
        |_| {},
    )?;
    assert!(
        text("d0")?.contains("document 0: the thin ant"),
        "{}",
        text("d0")?
    );
    Ok(())
}

/// What [`with_an_orphan`] leaves: the models, the corpus, its documents and their config.
type Orphaned = (
    Engines,
    Corpus,
    Vec<gateway::input::SourceDoc>,
    gateway::ingest::IngestConfig,
);

/// Four tiny documents in batches of two, the run stopped before d3's chunk: d0 and d1
/// committed, d2's blob stored but never indexed (an orphan, as an interrupted run leaves).
fn with_an_orphan(dir: &Path) -> Result<Orphaned, Box<dyn std::error::Error>> {
    let (engines, corpus, docs) = tiny_setup(dir, 4)?;
    let cfg = gateway::ingest::IngestConfig {
        collection: "c".into(),
        batch_docs: 2,
        ..Default::default()
    };
    let mut seen = 0;
    let stopped =
        gateway::ingest::ingest_until(&corpus, &engines, docs.clone(), &cfg, |_| {}, &mut || {
            seen += 1;
            seen == 4
        });
    assert!(stopped.is_err());
    assert_eq!(corpus.store.keys()?.len(), 3, "d0, d1 and d2's orphan");
    Ok((engines, corpus, docs, cfg))
}

/// Issue 88: every ingestion and deletion read every chunk record and walked every KV file on
/// the engine thread, so queries waited behind a pass that grows with the index. The server's
/// ingestion (`ingest_until`) and deletion now remove what they touched (the chunks of a
/// replaced or deleted document, key by key); other garbage waits for a full collection.
#[test]
fn an_ingestion_or_deletion_collects_what_it_touched_not_the_whole_store() -> TestResult {
    use gateway::ingest::{delete_document, ingest_until};
    let dir = tempfile::tempdir()?;
    let (engines, corpus, docs, cfg) = with_an_orphan(dir.path())?;
    let mut d0 = docs[0].clone();
    d0.text = "document 0 again: an owl hunts mice in the barn".into();
    let replaced = ingest_until(&corpus, &engines, vec![d0], &cfg, |_| {}, &mut || false)?;
    assert_eq!(replaced.garbage_removed, 1, "d0's old chunk");
    assert_eq!(
        corpus.store.keys()?.len(),
        3,
        "the orphan waits for a full collection"
    );
    delete_document(&corpus, &engines, "c", "d1", None)?;
    assert_eq!(corpus.store.keys()?.len(), 2, "d1's chunk went with it");
    assert_eq!(corpus.collect_garbage(&engines)?, 1, "the orphan");
    assert_eq!(corpus.store.keys()?.len(), 1);
    drop(corpus);
    check_consistent(&dir.path().join("data"), true).map(|_| ())
}

/// The server's full collection runs without stopping the engine: listed on a thread of its
/// own, removed between queries. A server started over an orphan blob removes it.
#[test]
fn the_server_collects_garbage_listed_off_the_engine_thread() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (engines, corpus, _, _) = with_an_orphan(dir.path())?;
    let pipeline =
        gateway::pipeline::Pipeline::new(engines, corpus, gateway::pipeline::ScoreSource::Query);
    let state = gateway::http::AppState::new(Arc::new(pipeline), Default::default());
    let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while state.pipeline.corpus.store.keys()?.len() != 2 {
        assert!(
            std::time::Instant::now() < until,
            "the orphan was not collected"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Ok(())
}

#[test]
fn a_bad_flag_fails_before_any_model_loads() -> TestResult {
    let dir = tempfile::tempdir()?;
    let missing = dir.path().join("no-such-model.gguf");
    for args in [
        vec!["query", "q", "--verify-mode", "draft-every-99"],
        vec!["query", "q", "--method", "specache"],
        vec!["serve", "--spec-scores", "nowhere"],
        vec!["serve", "--api-key", "a,b"],
        vec!["serve", "--api-key", "k=no such collection"],
        vec!["serve", "--admin-key", "root=docs"],
        vec!["serve", "--timeout-secs", "18446744073709551615"],
        vec!["serve", "--memory-mb", "18446744073709551615"],
        vec!["serve", "--max-connections", "0"],
        vec!["serve", "--header-timeout-secs", "0"],
        vec!["serve", "--max-request-tokens", "0"],
        vec!["serve", "--prefill-order", "lifo"],
        vec!["ingest", "README.md", "--kv-codec", "zip"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_specrag"))
            .arg("--target")
            .arg(&missing)
            .args(&args)
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("invalid value"), "{args:?}: {err}");
        assert!(
            !err.contains("no-such-model"),
            "parsed before loading: {err}"
        );
    }
    Ok(())
}

#[test]
fn a_missing_model_file_is_the_callers_fault_exit_code_2() -> TestResult {
    let dir = tempfile::tempdir()?;
    let missing = dir.path().join("no-such-model.gguf");
    let out = Command::new(env!("CARGO_BIN_EXE_specrag"))
        .arg("--target")
        .arg(&missing)
        .args(["query", "q"])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("no-such-model") && err.contains("specrag models fetch"),
        "names the file and the command that fetches the defaults: {err}"
    );
    Ok(())
}

/// `--pairing` picks the default files: the large pair's 1.5B target unless `small`.
#[test]
fn the_pairing_picks_the_default_target() -> TestResult {
    let dir = tempfile::tempdir()?;
    for (pairing, file) in [
        (None, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
        (Some("large"), "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
        (Some("small"), "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    ] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_specrag"));
        cmd.env("SPECRAG_MODELS", dir.path())
            .env_remove("SPECRAG_TARGET")
            .env_remove("SPECRAG_PAIRING");
        if let Some(p) = pairing {
            cmd.args(["--pairing", p]);
        }
        let out = cmd.args(["tokenize", "hi"]).output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(file), "{pairing:?}: {err}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_specrag"))
        .args(["--pairing", "medium", "tokenize", "hi"])
        .output()?;
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--pairing"));
    Ok(())
}

#[test]
fn a_set_but_empty_key_list_refuses_to_start() -> TestResult {
    let dir = tempfile::tempdir()?;
    let missing = dir.path().join("no-such-model.gguf");
    for (var, value) in [
        ("SPECRAG_API_KEYS", ""),
        ("SPECRAG_API_KEYS", " "),
        ("SPECRAG_API_KEYS", ","),
        ("SPECRAG_API_KEYS", ";"),
        ("SPECRAG_ADMIN_KEYS", ""),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_specrag"))
            .arg("--target")
            .arg(&missing)
            .arg("serve")
            .env(var, value)
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{var}={value:?} started");
        assert!(
            err.contains("key") && !err.contains("no-such-model"),
            "{var}={value:?}: refused before loading, naming the keys: {err}"
        );
    }
    Ok(())
}

#[test]
fn speculator_kv_is_stored_with_its_chunk_collected_with_it_and_computed_when_missing() -> TestResult
{
    use gateway::ingest::{delete_document, ingest, IngestConfig};
    let dir = tempfile::tempdir()?;
    let models = tiny_models(dir.path())?;
    let opts = LoadOptions::default();
    let spec_model = Arc::new(Model::load(&models.spec, &opts)?);
    let engines = Engines::new(
        Arc::new(Model::load(&models.target, &opts)?),
        Some(spec_model.clone()),
    )?;
    let corpus = Corpus::open(&dir.path().join("data"), 1 << 30)?;
    let doc = |i: usize| gateway::input::SourceDoc {
        id: format!("d{i}"),
        title: None,
        text: format!("document {i}: the thin ant ran in the sand near tent {i}"),
        origin: format!("d{i}"),
    };
    let cfg = |speculator_kv| IngestConfig {
        collection: "c".into(),
        speculator_kv,
        ..Default::default()
    };
    let spec_key_of = |i: usize| -> Result<chunkstore::ChunkKey, Box<dyn std::error::Error>> {
        let (_, ids) = engines.segment(&doc(i).text);
        engines
            .spec_key(&engines.key("c", &ids))
            .ok_or_else(|| "no spec key".into())
    };
    // Without the flag only the target's KV is stored; spec_attn computes the rest on use.
    let plain = ingest(&corpus, &engines, vec![doc(0), doc(1)], &cfg(false), |_| {})?;
    assert_eq!(plain.speculator_kv_bytes, 0);
    assert!(!corpus.store.contains(&spec_key_of(0)?)?);
    let (kv, tier) = engines
        .load_spec_kv(&corpus.store, "c", &doc(0).text)?
        .ok_or("speculator")?;
    assert_eq!(tier, Tier::Recomputed);
    let (text, _) = engines.segment(&doc(0).text);
    let prefix = engines.spec_prefix.as_ref().ok_or("spec prefix")?;
    let spec = engines.spec.as_ref().ok_or("spec")?;
    assert_eq!(
        kv,
        spec.chunk_kv(prefix, &text)?,
        "the speculator's KV after its prefix"
    );
    assert_eq!(kv.fingerprint, spec_model.fingerprint());
    let (again, tier) = engines
        .load_spec_kv(&corpus.store, "c", &doc(0).text)?
        .ok_or("speculator")?;
    assert_eq!((tier, &again), (Tier::Memory, &kv));
    corpus.store.memory().clear();
    let (_, tier) = engines
        .load_spec_kv(&corpus.store, "c", &doc(0).text)?
        .ok_or("speculator")?;
    assert_eq!(tier, Tier::Disk);

    // With the flag: stored for new chunks and added to chunks stored before.
    let with = ingest(&corpus, &engines, vec![doc(1), doc(2)], &cfg(true), |_| {})?;
    assert!(with.speculator_kv_bytes > 0);
    for i in 0..3 {
        assert!(corpus.store.contains(&spec_key_of(i)?)?, "d{i}");
    }
    // Garbage collection keeps a chunk's speculator KV as long as the chunk is indexed ...
    assert_eq!(corpus.collect_garbage(&engines)?, 0);
    assert_eq!(corpus.store.keys()?.len(), 6);
    // ... and removes it with the chunk.
    delete_document(&corpus, &engines, "c", "d0", None)?;
    assert!(!corpus.store.contains(&spec_key_of(0)?)?);
    assert!(corpus.store.contains(&spec_key_of(1)?)?);
    assert_eq!(corpus.store.keys()?.len(), 4);

    // A damaged speculator entry is dropped and recomputed, never served.
    corpus.store.memory().clear();
    let key = spec_key_of(1)?;
    let mut raw = corpus.store.disk().get_raw(&key)?.ok_or("blob missing")?;
    let n = raw.len();
    raw[n - 3] ^= 0x55;
    corpus.store.disk().put_raw(&key, &raw)?;
    let (_, tier) = engines
        .load_spec_kv(&corpus.store, "c", &doc(1).text)?
        .ok_or("speculator")?;
    assert_eq!(tier, Tier::Recomputed);
    Ok(())
}

/// A lossy store (`--kv-codec int8`/`int4`) keys its chunks apart from exact ones, and its
/// memory tier serves what the disk would: the reused values do not depend on the tier.
#[test]
fn lossy_kv_is_keyed_apart_and_the_same_from_memory_or_disk() -> TestResult {
    let dir = tempfile::tempdir()?;
    let models = tiny_models(dir.path())?;
    let target = Arc::new(Model::load(&models.target, &LoadOptions::default())?);
    let text = "the thin ant ran in the sand";
    let exact = gateway::pipeline::Pipeline::new(
        Engines::new(target.clone(), None)?,
        Corpus::open(&dir.path().join("exact"), 1 << 30)?,
        gateway::pipeline::ScoreSource::Query,
    );
    let store = gateway::corpus::StoreOptions {
        codec: chunkstore::Codec::Int4,
        ..Default::default()
    };
    let lossy = gateway::pipeline::Pipeline::new(
        Engines::new(target, None)?,
        Corpus::open_with(&dir.path().join("lossy"), 1 << 30, &store)?,
        gateway::pipeline::ScoreSource::Query,
    );
    let (_, ids) = exact.engines.segment(text);
    assert_ne!(exact.engines.key("c", &ids), lossy.engines.key("c", &ids));
    let fresh = lossy.engines.load(&lossy.corpus.store, "c", text)?;
    assert_eq!(fresh.tier, Tier::Recomputed);
    let memory = lossy.engines.load(&lossy.corpus.store, "c", text)?;
    assert_eq!(memory.tier, Tier::Memory);
    lossy.corpus.store.memory().clear();
    let disk = lossy.engines.load(&lossy.corpus.store, "c", text)?;
    assert_eq!(disk.tier, Tier::Disk);
    assert_eq!(memory.kv, disk.kv, "memory holds what the disk gives back");
    assert_ne!(disk.kv, fresh.kv, "int4 changed the values");
    Ok(())
}

/// `kv: lazy` indexes text only: no chunk KV is computed at ingestion; the first query over a
/// chunk computes and stores it (under the disk budget), the next reads it, and the answers
/// are those of an eager corpus (the KV is the same). Ingesting the same documents eagerly
/// afterwards reuses the lazily computed KV and pins it.
#[test]
fn lazy_kv_is_computed_at_first_retrieval_and_answers_as_eager() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (engines, corpus, docs) = tiny_setup(dir.path(), 6)?;
    let lazy_cfg = gateway::ingest::IngestConfig {
        kv: gateway::ingest::KvMode::Lazy,
        ..Default::default()
    };
    let report = gateway::ingest::ingest(&corpus, &engines, docs.clone(), &lazy_cfg, |_| {})?;
    assert_eq!(
        (report.deferred_chunks, report.kv_bytes),
        (report.chunks, 0)
    );
    assert!(corpus.store.keys()?.is_empty(), "lazy ingestion stored KV");
    let lazy =
        gateway::pipeline::Pipeline::new(engines, corpus, gateway::pipeline::ScoreSource::Query);

    std::fs::create_dir_all(dir.path().join("eager"))?;
    let (engines, corpus, _) = tiny_setup(&dir.path().join("eager"), 0)?;
    gateway::ingest::ingest(&corpus, &engines, docs.clone(), &Default::default(), |_| {})?;
    let eager =
        gateway::pipeline::Pipeline::new(engines, corpus, gateway::pipeline::ScoreSource::Query);

    let q = gateway::pipeline::Query {
        query: "where did the ant near tent 3 run?".into(),
        top_k: 2,
        max_tokens: 8,
        ..Default::default()
    };
    let first = lazy.query(&q, &mut |_| true)?;
    assert_eq!(first.reuse.chunks_recomputed, 2);
    assert_eq!(lazy.corpus.store.cached_keys().len(), 2);
    let again = lazy.query(&q, &mut |_| true)?;
    assert_eq!(again.reuse.chunks_recomputed, 0);
    let reference = eager.query(&q, &mut |_| true)?;
    assert_eq!(
        (&first.answer, &again.answer),
        (&reference.answer, &reference.answer)
    );

    let report = gateway::ingest::ingest(
        &lazy.corpus,
        &lazy.engines,
        docs,
        &Default::default(),
        |_| {},
    )?;
    assert_eq!(report.reused_chunks, 2);
    assert!(
        lazy.corpus.store.cached_keys().is_empty(),
        "eager ingestion pins what it reuses"
    );
    Ok(())
}

/// The `predictive` codec is lossless: a corpus stored with it answers, from disk, exactly as
/// one stored raw, and its blobs give back the very KV the raw ones hold (issue 43).
#[test]
fn predictive_kv_answers_exactly_as_raw_kv() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (raw_engines, raw_corpus, docs) = tiny_setup(dir.path(), 5)?;
    std::fs::create_dir_all(dir.path().join("p"))?;
    let (engines, _, _) = tiny_setup(&dir.path().join("p"), 0)?;
    let store = gateway::corpus::StoreOptions {
        codec: chunkstore::Codec::Predictive,
        ..Default::default()
    };
    let corpus = Corpus::open_with(&dir.path().join("p/data"), 1 << 30, &store)?;
    for (e, c) in [(&raw_engines, &raw_corpus), (&engines, &corpus)] {
        gateway::ingest::ingest(c, e, docs.clone(), &Default::default(), |_| {})?;
        c.store.memory().clear();
    }
    for d in &docs {
        let raw = raw_engines.load(&raw_corpus.store, "default", &d.text)?;
        let coded = engines.load(&corpus.store, "default", &d.text)?;
        assert_eq!((raw.tier, coded.tier), (Tier::Disk, Tier::Disk));
        assert_eq!(
            raw.kv, coded.kv,
            "{}: the same KV from predictive blobs",
            d.id
        );
    }
    let raw = gateway::pipeline::Pipeline::new(
        raw_engines,
        raw_corpus,
        gateway::pipeline::ScoreSource::Query,
    );
    let coded =
        gateway::pipeline::Pipeline::new(engines, corpus, gateway::pipeline::ScoreSource::Query);
    same_answers_from_disk(
        &raw,
        &coded,
        &[Method::TargetProbe, Method::FullReuse, Method::Epic],
    )
}

/// Each method answers the same from `a` and `b`, their chunks read from disk (the memory
/// tier emptied first), three of them.
fn same_answers_from_disk(
    a: &gateway::pipeline::Pipeline,
    b: &gateway::pipeline::Pipeline,
    methods: &[Method],
) -> TestResult {
    for &method in methods {
        let q = gateway::pipeline::Query {
            query: "where did the ant near tent 3 run?".into(),
            top_k: 3,
            max_tokens: 12,
            method,
            ..Default::default()
        };
        a.corpus.store.memory().clear();
        b.corpus.store.memory().clear();
        let (x, y) = (a.query(&q, &mut |_| true)?, b.query(&q, &mut |_| true)?);
        assert_eq!(x.answer, y.answer, "{method:?}");
        assert_eq!(y.reuse.chunks_from_disk, 3, "{method:?}: read from disk");
    }
    Ok(())
}

/// `int8-predictive` stores int8's values in fewer bytes: served from disk, every chunk's KV
/// and every answer are int8's.
#[test]
fn int8_predictive_kv_answers_exactly_as_int8_kv() -> TestResult {
    let dir = tempfile::tempdir()?;
    let mut pipelines = Vec::new();
    let mut docs = Vec::new();
    for (sub, codec) in [
        ("a", chunkstore::Codec::Int8),
        ("b", chunkstore::Codec::Int8Predictive),
    ] {
        let root = dir.path().join(sub);
        std::fs::create_dir_all(&root)?;
        let (engines, _, d) = tiny_setup(&root, 5)?;
        let store = gateway::corpus::StoreOptions {
            codec,
            ..Default::default()
        };
        let corpus = Corpus::open_with(&root.join("data2"), 1 << 30, &store)?;
        // The pipeline puts the lossy codec into the chunk key before anything is stored.
        let p = gateway::pipeline::Pipeline::new(
            engines,
            corpus,
            gateway::pipeline::ScoreSource::Query,
        );
        gateway::ingest::ingest(
            &p.corpus,
            &p.engines,
            d.clone(),
            &Default::default(),
            |_| {},
        )?;
        p.corpus.store.memory().clear();
        pipelines.push(p);
        docs = d;
    }
    let (int8, coded) = (&pipelines[0], &pipelines[1]);
    for d in &docs {
        let a = int8.engines.load(&int8.corpus.store, "default", &d.text)?;
        let b = coded
            .engines
            .load(&coded.corpus.store, "default", &d.text)?;
        assert_eq!((a.tier, b.tier), (Tier::Disk, Tier::Disk));
        assert_eq!(a.kv, b.kv, "{}: int8's KV from int8-predictive blobs", d.id);
    }
    same_answers_from_disk(int8, coded, &[Method::TargetProbe, Method::FullReuse])
}

/// Issue 60: a redirected run (`2>log`: stderr is not a terminal) writes plain progress lines
/// (done/total, tokens/s, an ETA), the estimate after the first computed chunk, and a last line
/// when done; `SPECRAG_PROGRESS_SECS=0` asks for a line per chunk.
#[test]
fn a_redirected_ingestion_logs_plain_progress_lines() -> TestResult {
    let dir = tempfile::tempdir()?;
    let models = tiny_models(dir.path())?;
    let corpus_dir = dir.path().join("corpus");
    write_corpus(&corpus_dir, 6)?;
    let out = specrag(&models)
        .env("SPECRAG_PROGRESS_SECS", "0")
        .env("RUST_LOG", "info")
        .args(["ingest", "--chunk-tokens", "24", "--data"])
        .arg(dir.path().join("data"))
        .arg(&corpus_dir)
        .output()?;
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
    // Log lines are plain text where stderr is not a terminal: no colour escapes.
    assert!(log.contains("INFO"), "{log}");
    assert!(!log.contains('\u{1b}'), "{log}");
    let all: Vec<&str> = log.lines().filter(|l| l.starts_with("ingest: ")).collect();
    // First what was read, before chunking (a large corpus takes a while there).
    let read = all.first().ok_or_else(|| format!("no lines in {log}"))?;
    assert!(
        read.contains("documents read") && read.ends_with("chunking and tokenizing them"),
        "{log}"
    );
    let lines = &all[1..];
    let total = lines
        .first()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.split('/').nth(1))
        .and_then(|n| n.parse::<usize>().ok())
        .ok_or_else(|| format!("no planned line in {log}"))?;
    assert!(total >= 6, "{log}");
    assert!(lines[0].ends_with("(planned)"), "{log}");
    assert!(
        lines.iter().any(|l| l.contains("chunks to precompute; at")),
        "the estimate after the first chunk: {log}"
    );
    let progress = lines.iter().filter(|l| l.contains("tokens/s, ETA")).count();
    assert!(progress >= total, "a line per chunk at 0 s: {log}");
    let last = lines.last().ok_or("no lines")?;
    assert!(
        last.starts_with(&format!("ingest: {total}/{total} chunks")) && last.ends_with("(done)"),
        "{log}"
    );
    Ok(())
}

/// `specrag models list` names the architectures any GGUF file may have, beside the defaults.
#[test]
fn models_list_names_the_supported_architectures() -> TestResult {
    let dir = tempfile::tempdir()?;
    let out = Command::new(env!("CARGO_BIN_EXE_specrag"))
        .args(["models", "list"])
        .env("SPECRAG_MODELS", dir.path())
        .output()?;
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout)?;
    assert!(text.contains("missing"), "{text}");
    assert!(
        text.contains(&format!(
            "runs (--target / --speculator): {};",
            Architecture::supported()
        )),
        "{text}"
    );
    Ok(())
}
