//! Two `specrag serve` nodes on one real Redis (`--kv-remote`), tiny models: node A ingests
//! and computes the KV; node B ingests the same documents and finds every chunk's KV in Redis
//! (nothing recomputed), and its queries read it from the remote tier and answer exactly as
//! node A does. Redis going away mid-run costs misses only: queries keep answering from the
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
    assert!(reuse["chunks_from_remote"].as_u64() > Some(0), "{on_b}");
    assert_eq!(reuse["chunks_recomputed"], 0, "{on_b}");
    assert_eq!(on_b["answer"], on_a["answer"]);
    assert_eq!(on_b["chunks"], on_a["chunks"]);
    // Read through: the second time the chunks are local.
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
