//! `specrag ingest` end to end on tiny random models: bad inputs, crash durability (a real
//! `kill -9`), and chunk loading from memory, disk, or recompute.

use chunkstore::ChunkStore;
use gateway::corpus::{Corpus, Engines, Tier};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
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
        &|| stored.get() >= 2,
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
