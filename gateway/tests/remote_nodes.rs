//! Two `specrag serve` nodes on one real Redis (`--kv-remote`), tiny models: node A ingests
//! and computes the KV; node B ingests the same documents and finds every chunk's KV in Redis
//! (nothing recomputed), copies it to its own disk (an indexed chunk has its KV on disk), and
//! answers exactly as node A does. Redis going away mid-run costs misses only: queries keep answering from the
//! local tiers or by recomputing, and work again once it is back.

mod common;

use common::{redis_on, redis_server, tiny_server_with};
use serde_json::{json, Value};
use std::net::SocketAddr;

fn query(port: u16, q: &str) -> Value {
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let body = json!({"query": q, "method": "epic", "max_tokens": 8, "top_k": 3}).to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (status, text) = rt
        .block_on(gateway::client::request(
            addr,
            "POST",
            "/rag/query",
            Some(&body),
        ))
        .expect("the server answers");
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).expect("json")
}

#[test]
fn a_node_reuses_kv_another_node_computed_and_survives_redis_restarts() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let (redis, rport) = redis_server(tmp.path());
    let url = format!("redis://127.0.0.1:{rport}");
    let data_args = ["--kv-remote", url.as_str()];
    let (_a, port_a, _) = tiny_server_with(&tmp.path().join("a"), &data_args, &[]);
    let (_b, port_b, log_b) = tiny_server_with(&tmp.path().join("b"), &data_args, &[]);

    let q = "What does specrag store for each chunk?";
    let on_a = query(port_a, q);
    let on_b = query(port_b, q);
    let reuse = &on_b["reuse"];
    // B's ingestion took the KV from Redis onto its own disk (issue 57: indexed means on
    // disk), so its query reads it locally and recomputes nothing.
    assert_eq!(reuse["chunks_from_remote"], 0, "{on_b}");
    assert_eq!(reuse["chunks_recomputed"], 0, "{on_b}");
    assert_eq!(on_b["answer"], on_a["answer"]);
    assert_eq!(on_b["chunks"], on_a["chunks"]);
    let again = query(port_b, q);
    assert_eq!(again["reuse"]["chunks_from_remote"], 0, "{again}");
    assert_eq!(again["answer"], on_a["answer"]);

    // Redis goes away: a question over other chunks still answers (recomputed or local).
    drop(redis);
    let down = query(port_b, "How are blobs checked for damage on disk?");
    assert_eq!(down["reuse"]["chunks_from_remote"], 0, "{down}");
    // Back (empty, no persistence): node A's stored chunks are gone from Redis, so node B
    // recomputes what it lacks and writes it through; nothing corrupt is ever served.
    let _redis = redis_on(tmp.path(), rport);
    std::thread::sleep(std::time::Duration::from_millis(2100)); // the reconnect backoff
    let back = query(port_b, "Which tests start a real server?");
    assert_eq!(back["reuse"]["chunks_from_remote"], 0, "{back}");
    let same = query(port_b, q);
    assert_eq!(
        same["answer"],
        on_a["answer"],
        "{}",
        std::fs::read_to_string(&log_b).unwrap_or_default()
    );
}

fn http(port: u16, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let body = body.map(Value::to_string);
    let (status, text) = rt
        .block_on(gateway::client::request(
            addr,
            method,
            path,
            body.as_deref(),
        ))
        .expect("the server answers");
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// Polls `/health` of `port` until its document log position is `want` (never a sleep).
/// Waits until `collection` on the node at `port` lists `n` documents.
fn wait_listed(port: u16, collection: &str, n: usize) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let path = format!("/documents?collection={collection}");
    while http(port, "GET", &path, None).1["documents"]
        .as_array()
        .is_none_or(|d| d.len() != n)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "{collection} never listed {n} documents"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// How many chunk files the store in `kv` holds.
fn chunk_files(kv: &std::path::Path) -> usize {
    std::fs::read_dir(kv)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().len() == 2)
        .map(|shard| std::fs::read_dir(shard.path()).map_or(0, |d| d.count()))
        .sum()
}

fn wait_position(port: u16, want: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let (_, h) = http(port, "GET", "/health", None);
        if h["log_position"] == want {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "stuck at {h}, want {want}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Makes the Redis at `url` evict any key when full.
fn evict_any_key(url: &str) {
    let mut redis = redis::Client::open(url)
        .and_then(|c| c.get_connection())
        .expect("redis");
    for (name, value) in [("maxmemory", "256mb"), ("maxmemory-policy", "allkeys-lru")] {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg(name)
            .arg(value)
            .query(&mut redis)
            .expect("CONFIG SET");
    }
}

/// Node B started after [`evict_any_key`], node A before: B reads that and says so; both say
/// the log does not survive a Redis restart (the test's Redis keeps no AOF).
fn log_warnings_name_the_settings(port_a: u16, port_b: u16) {
    let warnings = |port| http(port, "GET", "/health", None).1["log_warnings"].to_string();
    let (on_a, on_b) = (warnings(port_a), warnings(port_b));
    assert!(
        on_a.contains("appendonly yes") && !on_a.contains("allkeys"),
        "{on_a}"
    );
    assert!(
        on_b.contains("allkeys-lru") && on_b.contains("appendonly yes"),
        "{on_b}"
    );
}

#[test]
fn documents_ingested_on_one_node_reach_every_node_through_the_log() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let (_redis, rport) = redis_server(tmp.path());
    let url = format!("redis://127.0.0.1:{rport}");
    let data_args = ["--kv-remote", url.as_str()];
    let models = common::tiny_models(tmp.path());
    let (_a, port_a, _) = common::serve(&tmp.path().join("a"), &models, &data_args, &[]);
    evict_any_key(&url);
    let (_b, port_b, _) = common::serve(&tmp.path().join("b"), &models, &data_args, &[]);
    log_warnings_name_the_settings(port_a, port_b);
    let docs = json!({"documents": [
        {"id": "ants", "text": "The thin ant ran in the sand and then the ant sat in the tent."},
        {"id": "attic", "text": "A hint: the antenna is in the attic near the tent, behind the tin."},
    ]});
    let (status, body) = http(port_a, "POST", "/documents", Some(&docs));
    assert_eq!(status, 200, "{body}");
    // A's own entry is applied (passed over) by A, and B catches up with it.
    let (_, h) = http(port_a, "GET", "/health", None);
    let mut pos = h["log_position"].as_str().unwrap_or("0-0").to_string();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while pos == "0-0" {
        assert!(
            std::time::Instant::now() < deadline,
            "A never saw its own entry"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
        pos = http(port_a, "GET", "/health", None).1["log_position"]
            .as_str()
            .unwrap_or("0-0")
            .to_string();
    }
    wait_position(port_b, &pos);
    let ask = |port| query(port, "where is the antenna?");
    let (on_a, on_b) = (ask(port_a), ask(port_b));
    assert_eq!(on_b["answer"], on_a["answer"]);
    // B applied the entry with A's KV, copied from Redis to its disk: nothing recomputed.
    assert_eq!(on_b["reuse"]["chunks_recomputed"], 0, "{on_b}");

    // Regression (issue 57): a lazily ingested batch reached followers as eager, and they
    // precomputed and pinned the whole collection. B ingests it lazily too: no KV written.
    let files_b = chunk_files(&tmp.path().join("b/data/kv"));
    let lazy = json!({"collection": "lazy", "kv": "lazy", "documents": [
        {"id": "tents", "text": "The tent stands in the sand; the ant sits in the tent at night."},
    ]});
    let (status, body) = http(port_a, "POST", "/documents", Some(&lazy));
    assert_eq!(status, 200, "{body}");
    wait_listed(port_b, "lazy", 1);
    assert_eq!(
        chunk_files(&tmp.path().join("b/data/kv")),
        files_b,
        "B computed KV for a batch ingested lazily"
    );

    // A deletion travels the same way.
    let (status, body) = http(port_a, "DELETE", "/documents/ants?collection=default", None);
    assert_eq!(status, 200, "{body}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let (_, list) = http(port_b, "GET", "/documents?collection=default", None);
        let ids: Vec<&str> = list["documents"]
            .as_array()
            .map(|d| d.iter().filter_map(|d| d["id"].as_str()).collect())
            .unwrap_or_default();
        if ids == ["attic"] {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "B still lists {ids:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }

    // A node started later with an empty data directory catches up from the log.
    let (_c, port_c, _) = common::serve(&tmp.path().join("c"), &models, &data_args, &[]);
    let (_, h) = http(port_a, "GET", "/health", None);
    wait_position(port_c, h["log_position"].as_str().unwrap_or(""));
    let (_, list) = http(port_c, "GET", "/documents?collection=default", None);
    assert_eq!(
        list["documents"].as_array().map(Vec::len),
        Some(1),
        "{list}"
    );
    // Every entry applied, none passed over.
    for port in [port_b, port_c] {
        let (_, h) = http(port, "GET", "/health", None);
        assert_eq!(h["log_failed"], 0, "{h}");
    }
}
