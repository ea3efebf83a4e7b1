//! The chunk store is a cache: damage to its files *while the server runs* (deleted,
//! truncated or altered chunk files, a chunk file that cannot be read at all, a damaged
//! `STORE` file found at the next start, damaged entries of the shared Redis tier) costs
//! recomputes, never a failed request. For each damage, on two tenants with scoped keys:
//! no 5xx, the other tenant unaffected, answers equal to those before the damage (and
//! verified answers equal to full recompute's), every indexed document still listed, and
//! writes and deletions of documents still answered 200.
//!
//! Real `specrag serve` on tiny random models, loopback only.

mod common;

use common::{redis_server, run, serve, tiny_models, Server, BIN};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

type TestResult = Result<(), Box<dyn std::error::Error>>;

const ALPHA_KEY: &str = "alpha-key";
const BETA_KEY: &str = "beta-key";

/// The tenants: key, collection, the file ingested into it, and its questions.
const TENANTS: [(&str, &str, &str, [&str; 2]); 2] = [
    (
        ALPHA_KEY,
        "alpha",
        "README.md",
        ["How is chunk KV stored?", "What does verify do?"],
    ),
    (
        BETA_KEY,
        "beta",
        "ARCHITECTURE.md",
        [
            "What does the kernels crate hold?",
            "Where are errors mapped?",
        ],
    ),
];

fn serve_args() -> Vec<String> {
    vec![
        // A memory tier too small to hold the chunks: reads go to the damaged disk tier.
        "--memory-mb".into(),
        "1".into(),
        "--api-key".into(),
        format!("{ALPHA_KEY}=alpha"),
        "--api-key".into(),
        format!("{BETA_KEY}=beta"),
    ]
}

/// One HTTP request with a bearer key; status and body.
fn http(port: u16, method: &str, path: &str, key: &str, body: Option<&Value>) -> (u16, String) {
    let body = body.map(Value::to_string).unwrap_or_default();
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", port)).expect("server reachable");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).expect("request sent");
    conn.write_all(body.as_bytes()).expect("body sent");
    let mut raw = Vec::new();
    conn.read_to_end(&mut raw).expect("response read");
    gateway::client::parse_response(&raw).expect("an HTTP response")
}

/// Every tenant's answers: (collection, question, method or `verify`) -> answer.
type Answers = Vec<((String, String, String), String)>;

fn answers(port: u16) -> Result<Answers, String> {
    let mut out = Vec::new();
    for (key, collection, _, questions) in TENANTS {
        for q in questions {
            for (label, extra) in [
                ("default", json!({})),
                ("full_recompute", json!({"method": "full_recompute"})),
                ("verify", json!({"verify": true})),
            ] {
                let mut body = json!({"query": q, "collection": collection, "max_tokens": 8});
                if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
                    b.extend(e.clone());
                }
                let (status, text) = http(port, "POST", "/rag/query", key, Some(&body));
                if status != 200 {
                    return Err(format!("{collection} {q:?} {label}: {status} {text}"));
                }
                let v: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
                let answer = v["answer"].as_str().unwrap_or_default().to_string();
                out.push(((collection.into(), (*q).into(), label.into()), answer));
            }
        }
    }
    Ok(out)
}

/// Every tenant's document ids.
fn documents(port: u16) -> Vec<String> {
    let mut ids = Vec::new();
    for (key, collection, _, _) in TENANTS {
        let (status, text) = http(
            port,
            "GET",
            &format!("/documents?collection={collection}"),
            key,
            None,
        );
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_default();
        for d in v["documents"].as_array().into_iter().flatten() {
            ids.push(format!(
                "{collection}/{}",
                d["id"].as_str().unwrap_or_default()
            ));
        }
    }
    ids.sort();
    ids
}

/// A data directory with both tenants ingested, built once and copied by every case.
fn ingested() -> &'static (tempfile::TempDir, Vec<std::ffi::OsString>) {
    static DATA: OnceLock<(tempfile::TempDir, Vec<std::ffi::OsString>)> = OnceLock::new();
    DATA.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let models = tiny_models(dir.path());
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        for (_, collection, file, _) in TENANTS {
            run(Command::new(BIN)
                .args(&models)
                .args(["ingest", "--collection", collection, "--data"])
                .arg(dir.path().join("data"))
                .arg(root.join(file)));
        }
        (dir, models)
    })
}

fn copy_dir(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let dest = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &dest)?;
        } else {
            std::fs::copy(entry.path(), &dest)?;
        }
    }
    Ok(())
}

/// The chunk files of the store under `data`, newest first.
fn chunk_files(data: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for shard in std::fs::read_dir(data.join("kv"))? {
        let shard = shard?.path();
        if !shard.is_dir() || shard.ends_with("tmp") {
            continue;
        }
        for f in std::fs::read_dir(&shard)? {
            let f = f?;
            files.push((f.metadata()?.modified()?, f.path()));
        }
    }
    files.sort();
    Ok(files.into_iter().rev().map(|(_, p)| p).collect())
}

/// A served copy of the ingested data: the server, its port and log, and the data directory.
struct Case {
    _dir: tempfile::TempDir,
    server: Option<Server>,
    port: u16,
    log: PathBuf,
    node: PathBuf,
    extra: Vec<String>,
}

impl Case {
    fn start(extra: &[&str]) -> Self {
        let (src, _) = ingested();
        let dir = tempfile::tempdir().expect("temp dir");
        let node = dir.path().join("node");
        copy_dir(&src.path().join("data"), &node.join("data")).expect("data copied");
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let (server, port, log) = Self::serve(&node, &extra);
        Self {
            _dir: dir,
            server: Some(server),
            port,
            log,
            node,
            extra,
        }
    }

    fn serve(node: &Path, extra: &[String]) -> (Server, u16, PathBuf) {
        let (_, models) = ingested();
        let mut args = serve_args();
        args.extend(extra.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        serve(node, models, &[], &args)
    }

    fn restart(&mut self) {
        drop(self.server.take());
        let (server, port, log) = Self::serve(&self.node, &self.extra);
        (self.server, self.port, self.log) = (Some(server), port, log);
    }

    fn data(&self) -> PathBuf {
        self.node.join("data")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// After damage: every answer as before, documents intact, both tenants can still add
    /// and delete documents, and nothing answered 5xx.
    fn check(&self, before: &Answers, docs: &[String], what: &str) -> TestResult {
        let after = answers(self.port).map_err(|e| format!("{what}: {e}\n{}", self.log()))?;
        for ((k, a), (_, b)) in before.iter().zip(&after) {
            assert_eq!(a, b, "{what}: {k:?} changed");
        }
        for ((c, q, label), a) in &after {
            if label == "verify" {
                let full = after
                    .iter()
                    .find(|((c2, q2, l2), _)| c2 == c && q2 == q && l2 == "full_recompute");
                assert_eq!(
                    full.map(|(_, f)| f),
                    Some(a),
                    "{what}: verified != full recompute"
                );
            }
        }
        assert_eq!(
            documents(self.port),
            docs,
            "{what}: indexed documents changed"
        );
        for (key, collection, _, _) in TENANTS {
            let doc = json!({"collection": collection, "documents": [
                {"id": "added", "text": "A short note added after the damage. It says little."}]});
            let (status, text) = http(self.port, "POST", "/documents", key, Some(&doc));
            assert_eq!(
                status,
                200,
                "{what}: adding to {collection}: {text}\n{}",
                self.log()
            );
            let path = format!("/documents/added?collection={collection}");
            let (status, text) = http(self.port, "DELETE", &path, key, None);
            assert_eq!(
                status,
                200,
                "{what}: deleting from {collection}: {text}\n{}",
                self.log()
            );
        }
        Ok(())
    }

    fn health(&self) -> Value {
        let (_, text) = http(self.port, "GET", "/health", ALPHA_KEY, None);
        serde_json::from_str(&text).unwrap_or_default()
    }
}

/// Applies `damage` to the store of a running server, then checks every answer.
fn damaged_while_serving(what: &str, damage: impl Fn(&Path) -> std::io::Result<()>) -> TestResult {
    let case = Case::start(&[]);
    let before = answers(case.port)?;
    let docs = documents(case.port);
    damage(&case.data())?;
    case.check(&before, &docs, what)?;
    // The damage is recomputed and stored again: the same after a restart.
    let mut case = case;
    case.restart();
    case.check(&before, &docs, &format!("{what}, after a restart"))
}

/// Regression (issue 38): the probe deleted the newest file of the store (then a sled blob
/// file) and every query of that collection answered 500, as did the other tenant's ingestion.
#[test]
fn the_newest_chunk_file_deleted() -> TestResult {
    damaged_while_serving("the newest chunk file deleted", |data| {
        std::fs::remove_file(&chunk_files(data)?[0])
    })
}

#[test]
fn every_chunk_file_truncated_or_altered() -> TestResult {
    damaged_while_serving("chunk files truncated and altered", |data| {
        for (i, f) in chunk_files(data)?.iter().enumerate() {
            let len = std::fs::metadata(f)?.len();
            match i % 3 {
                0 => std::fs::OpenOptions::new()
                    .write(true)
                    .open(f)?
                    .set_len(len / 2)?,
                1 => std::fs::OpenOptions::new()
                    .write(true)
                    .open(f)?
                    .set_len(0)?,
                _ => {
                    let mut bytes = std::fs::read(f)?;
                    let at = bytes.len() / 3;
                    bytes[at] ^= 0x5a;
                    std::fs::write(f, &bytes)?;
                }
            }
        }
        Ok(())
    })
}

/// A chunk file that cannot be read at all (here a directory in its place, as a failing disk
/// would refuse it): an I/O error, logged and counted, and `/health` says `degraded`.
#[test]
fn an_unreadable_chunk_file_degrades_health_not_answers() -> TestResult {
    let case = Case::start(&[]);
    let before = answers(case.port)?;
    let docs = documents(case.port);
    assert_eq!(case.health()["status"], "ok");
    for f in chunk_files(&case.data())? {
        std::fs::remove_file(&f)?;
        std::fs::create_dir(&f)?;
        std::fs::write(f.join("x"), b"in the way")?;
    }
    case.check(&before, &docs, "unreadable chunk files")?;
    let health = case.health();
    assert_eq!(health["status"], "degraded", "{health}");
    assert!(health["store"]["errors"].as_u64() > Some(0), "{health}");
    let (_, metrics) = http(case.port, "GET", "/metrics", ALPHA_KEY, None);
    assert!(
        metrics.lines().any(
            |l| l.starts_with("specrag_store_errors_total{tier=\"disk\"}") && !l.ends_with(" 0")
        ),
        "{metrics}"
    );
    Ok(())
}

/// The store's own files: `STORE` damaged while serving is found at the next start, where
/// the store is moved aside and reset (`--on-damaged-store reset`, the default) and `/health`
/// says so; with `refuse` the server does not start and says why. `LOCK` and `tmp/` deleted
/// while serving change nothing.
#[test]
fn the_store_files_damaged_reset_at_the_next_start() -> TestResult {
    let mut case = Case::start(&[]);
    let before = answers(case.port)?;
    let docs = documents(case.port);
    let data = case.data();
    std::fs::remove_file(data.join("kv/LOCK"))?;
    std::fs::remove_dir_all(data.join("kv/tmp"))?;
    let mut marker = std::fs::read(data.join("kv/STORE"))?;
    marker[0] ^= 0x20;
    std::fs::write(data.join("kv/STORE"), &marker)?;
    case.check(&before, &docs, "STORE damaged while serving")?;
    // With `refuse`, the next start fails naming the store and the way out.
    drop(case.server.take());
    let (_, models) = ingested();
    let out = Command::new(BIN)
        .args(models)
        .args([
            "serve",
            "--on-damaged-store",
            "refuse",
            "--addr",
            "127.0.0.1:1",
            "--data",
        ])
        .arg(&data)
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started on a damaged store");
    assert!(
        stderr.contains("only a cache") && stderr.contains("--on-damaged-store reset"),
        "{stderr}"
    );
    // With the default, it starts on an empty store and answers as before.
    case.restart();
    let health = case.health();
    assert_eq!(health["status"], "degraded", "{health}");
    assert_eq!(
        health["store"]["reset_at_startup"], "moved aside",
        "{health}"
    );
    case.check(&before, &docs, "a reset store")?;
    let moved = std::fs::read_dir(&data)?
        .filter_map(|e| e.ok())
        .any(|e| e.file_name().to_string_lossy().starts_with("kv.damaged-"));
    assert!(moved, "the damaged store was not kept aside");
    Ok(())
}

/// Redis' entries damaged (altered, truncated, deleted) while the local copies are gone too:
/// read through, found undecodable, dropped and recomputed.
#[test]
fn damaged_redis_entries_are_recomputed() -> TestResult {
    let redis_dir = tempfile::tempdir()?;
    let (_redis, redis_port) = redis_server(redis_dir.path());
    let url = format!("redis://127.0.0.1:{redis_port}");
    let case = Case::start(&["--kv-remote", &url]);
    // Every local chunk goes to Redis as it is read: the first round fills it.
    let before = answers(case.port)?;
    let docs = documents(case.port);
    let mut redis = std::net::TcpStream::connect(("127.0.0.1", redis_port))?;
    let mut damaged = 0;
    for (i, f) in chunk_files(&case.data())?.iter().enumerate() {
        let key = f.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
        let name = format!("specrag:kv:{key}");
        let command = match i % 3 {
            0 => vec!["SETRANGE".to_string(), name, "40".into(), "garbage".into()],
            1 => vec!["SET".into(), name, "SRKV truncated".into()],
            _ => vec!["DEL".into(), name],
        };
        let mut wire = format!("*{}\r\n", command.len());
        for part in &command {
            wire.push_str(&format!("${}\r\n{part}\r\n", part.len()));
        }
        redis.write_all(wire.as_bytes())?;
        let mut reply = [0u8; 64];
        let _ = redis.read(&mut reply)?;
        std::fs::remove_file(f)?;
        damaged += 1;
    }
    assert!(damaged > 0, "no chunk files");
    case.check(&before, &docs, "damaged Redis entries")
}

// ---------------------------------------------------------------------------------------
// The disk budget and the pins under faults (issue 57), through the library: a corpus on a
// disk that fills up, and budget evictions between the chunks of an ingestion.

mod budget_faults {
    use chunkstore::{BlobWriter, ChunkKey, ChunkStore, DiskStore, Eviction, MemoryStore};
    use gateway::corpus::{Corpus, Engines};
    use gateway::ingest::{ingest, ingest_until, IngestConfig, KvMode};
    use gateway::input::SourceDoc;
    use std::path::Path;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use target_engine::testing::{write_tiny_gguf, TinySpec};
    use target_engine::{Architecture, LoadOptions, Model};

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    /// A disk with `room` bytes left: the write that does not fit stops part way with
    /// ENOSPC, as `write(2)` does.
    struct FullDisk(AtomicU64);

    impl BlobWriter for FullDisk {
        fn write_new(&self, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
            let left = self.0.load(Ordering::SeqCst);
            if bytes.len() as u64 > left {
                std::fs::write(path, &bytes[..left as usize])?;
                self.0.store(0, Ordering::SeqCst);
                return Err(std::io::Error::from_raw_os_error(28));
            }
            self.0.fetch_sub(bytes.len() as u64, Ordering::SeqCst);
            std::fs::write(path, bytes)
        }
    }

    fn engines(dir: &Path) -> Result<Engines, Box<dyn std::error::Error>> {
        let target = dir.join("target.gguf");
        write_tiny_gguf(&target, &TinySpec::new(Architecture::Qwen2))?;
        let model = Model::load(&target, &LoadOptions::default())?;
        Ok(Engines::new(Arc::new(model), None)?)
    }

    /// A corpus in `dir` whose disk takes `room` more bytes, under a disk budget of `budget`.
    fn corpus(dir: &Path, room: u64, budget: u64) -> Result<Corpus, Box<dyn std::error::Error>> {
        let kv = DiskStore::open(&dir.join("kv"))?.with_writer(Arc::new(FullDisk(room.into())));
        let store = chunkstore::TieredStore::new(MemoryStore::new(1 << 30), kv)
            .with_budget(budget, Eviction::Lru)?;
        Ok(Corpus {
            dir: dir.to_path_buf(),
            index: retriever::Index::open(dir.join("index"))?,
            store,
            doclog: None,
            store_reset: None,
        })
    }

    fn doc(id: &str, n: usize) -> SourceDoc {
        let text = (0..n)
            .map(|i| format!("Paragraph {i} of {id}: the ant {i} sat in the tent near the attic."))
            .collect::<Vec<_>>()
            .join("\n\n");
        SourceDoc {
            id: id.into(),
            title: None,
            text,
            origin: format!("{id}.md"),
        }
    }

    fn cfg(collection: &str, kv: KvMode) -> IngestConfig {
        IngestConfig {
            collection: collection.into(),
            chunk_tokens: 24,
            batch_docs: 1,
            kv,
            ..IngestConfig::default()
        }
    }

    /// Every chunk the index holds of `collection`'s eagerly ingested documents has its KV
    /// on disk, pinned (outside the budget).
    fn assert_indexed_means_on_disk(corpus: &Corpus, collection: &str) -> TestResult {
        let budgeted = corpus.store.cached_keys();
        for d in corpus.index.documents(Some(collection))? {
            for c in corpus.index.chunks_of(collection, &d.doc_id)? {
                let key: ChunkKey = c.key.parse()?;
                assert!(
                    corpus.store.disk().contains(&key)?,
                    "{collection}/{}: an indexed chunk with no file",
                    d.doc_id
                );
                assert!(
                    !budgeted.contains(&key),
                    "{collection}/{}: indexed chunk budgeted",
                    d.doc_id
                );
            }
        }
        Ok(())
    }

    /// Regression (issue 57): on a full disk the write error was swallowed and ingestion
    /// reported success, indexing chunks whose KV was on no disk. Now the batch that cannot
    /// be written fails and is rolled back; what was committed before keeps its files, and
    /// query-time KV that cannot be written leaves no budget entry behind.
    #[test]
    fn a_full_disk_fails_the_batch_and_loses_no_pin() -> TestResult {
        let tmp = tempfile::tempdir()?;
        let engines = engines(tmp.path())?;
        // Measure one document's files on a disk with room, then give the real disk room
        // for it and a little more.
        let probe = corpus(&tmp.path().join("probe"), u64::MAX, 1 << 30)?;
        ingest(
            &probe,
            &engines,
            vec![doc("first", 4)],
            &cfg("alpha", KvMode::Eager),
            |_| {},
        )?;
        let one_doc = probe
            .store
            .disk()
            .keys()?
            .iter()
            .filter_map(|k| probe.store.disk().stored_bytes(k))
            .sum::<u64>();
        drop(probe);
        let corpus = corpus(&tmp.path().join("data"), one_doc + one_doc / 3, 1 << 30)?;
        ingest(
            &corpus,
            &engines,
            vec![doc("first", 4)],
            &cfg("alpha", KvMode::Eager),
            |_| {},
        )?;
        let second = ingest(
            &corpus,
            &engines,
            vec![doc("second", 8)],
            &cfg("alpha", KvMode::Eager),
            |_| {},
        );
        assert!(
            second.is_err(),
            "an ingestion onto a full disk reported success"
        );
        let ids: Vec<String> = corpus
            .index
            .documents(Some("alpha"))?
            .into_iter()
            .map(|d| d.doc_id)
            .collect();
        assert_eq!(ids, ["first"], "the failed batch was indexed");
        assert_indexed_means_on_disk(&corpus, "alpha")?;
        // Queries on the full disk: the passages' KV is served, never budgeted without a file.
        for i in 0..6 {
            engines.load(
                &corpus.store,
                "beta",
                &format!("A passage {i} a client sent, about tents."),
            )?;
        }
        for k in corpus.store.cached_keys() {
            assert!(
                corpus.store.disk().contains(&k)?,
                "a phantom budget entry {k}"
            );
        }
        assert_indexed_means_on_disk(&corpus, "alpha")?;
        Ok(())
    }

    /// Eviction racing an eager ingestion of the same text: a collection ingested lazily has
    /// its chunks' KV computed by queries (under the budget); then the same documents are
    /// ingested eagerly while, between every two chunks, other queries fill the budget and
    /// evict those very entries. Every chunk indexed at the end has its file, pinned.
    /// Before: an evicted entry's memory copy counted as stored, and it was indexed with no
    /// file.
    #[test]
    fn eviction_racing_an_eager_ingestion_of_the_same_text() -> TestResult {
        let tmp = tempfile::tempdir()?;
        let engines = engines(tmp.path())?;
        let corpus = corpus(&tmp.path().join("data"), u64::MAX, 0)?;
        let d = doc("shared", 6);
        ingest(
            &corpus,
            &engines,
            vec![d.clone()],
            &cfg("alpha", KvMode::Lazy),
            |_| {},
        )?;
        // A budget of a few chunks, reopened over the same directory.
        let chunks: Vec<String> = corpus
            .index
            .chunks_of("alpha", "shared")?
            .into_iter()
            .map(|c| c.text)
            .collect();
        drop(corpus);
        let corpus = corpus_with_budget(tmp.path(), &engines, &chunks)?;
        for text in &chunks {
            engines.load(&corpus.store, "alpha", text)?;
        }
        let mut n = 0;
        let mut evict = || {
            n += 1;
            for i in 0..3 {
                let text = format!("Query passage {n}.{i}: the thin ant ran in the sand.");
                engines.load(&corpus.store, "alpha", &text).map(|_| ()).ok();
            }
            false
        };
        ingest_until(
            &corpus,
            &engines,
            vec![d],
            &cfg("alpha", KvMode::Eager),
            |_| {},
            &mut evict,
        )?;
        assert!(n >= chunks.len(), "the hook ran between the chunks");
        assert_indexed_means_on_disk(&corpus, "alpha")
    }

    /// The corpus of `dir/data` reopened with a budget of about two of `chunks`' entries.
    fn corpus_with_budget(
        dir: &Path,
        engines: &Engines,
        chunks: &[String],
    ) -> Result<Corpus, Box<dyn std::error::Error>> {
        let mut bytes = 0;
        let probe = corpus(&dir.join("probe"), u64::MAX, 1 << 30)?;
        for text in chunks.iter().take(2) {
            let loaded = engines.load(&probe.store, "alpha", text)?;
            bytes += probe.store.disk().stored_bytes(&loaded.key).unwrap_or(0);
        }
        corpus(&dir.join("data"), u64::MAX, bytes)
    }
}
