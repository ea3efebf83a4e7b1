//! `POST /documents` under load and limits, on tiny random models: token budgets refused with
//! 413 before model work, progress streamed as JSON lines, and queries answered between the
//! chunks of a long ingestion.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use chunkstore::ChunkStore;
use gateway::http::{app, AppState, ServerConfig};
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;
use tower::ServiceExt;

mod common;

use common::{server, TestResult};

fn documents(n: usize, words: usize) -> Value {
    let docs: Vec<Value> = (0..n)
        .map(|i| {
            let text = (0..words)
                .map(|w| format!("ant{} tent{}", (i + w) % 17, w % 5))
                .collect::<Vec<_>>()
                .join(" ");
            json!({"id": format!("d{i}"), "text": text})
        })
        .collect();
    json!({"collection": "c", "chunk_tokens": 16, "documents": docs})
}

fn post(path: &str, body: &Value, ndjson: bool) -> Request<Body> {
    let mut req = Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap_or_default();
    if ndjson {
        req.headers_mut().insert(
            "accept",
            "application/x-ndjson"
                .parse()
                .unwrap_or_else(|_| unreachable!()),
        );
    }
    req
}

async fn send(s: &AppState, req: Request<Body>) -> (StatusCode, Value) {
    let resp = app(s.clone())
        .oneshot(req)
        .await
        .unwrap_or_else(|e| match e {});
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap_or_default();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_budgets_answer_413_naming_the_field_before_model_work() -> TestResult {
    let dir = tempfile::tempdir()?;
    let s = server(
        dir.path(),
        ServerConfig {
            max_request_tokens: 50,
            max_collection_tokens: 200,
            ..Default::default()
        },
    )?;
    let (status, p) = send(&s, post("/documents", &documents(4, 40), false)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{p}");
    assert_eq!(p["field"], "documents");
    assert!(
        p["detail"]
            .as_str()
            .unwrap_or("")
            .contains("--max-request-tokens"),
        "{p}"
    );
    assert_eq!(
        s.pipeline.corpus.store.stats().entries,
        0,
        "no KV was computed"
    );
    // Within the request budget, up to the collection's.
    let mut fills = 0;
    loop {
        let mut body = documents(1, 2);
        body["documents"][0]["id"] = json!(format!("fill{fills}"));
        let (status, p) = send(&s, post("/documents", &body, false)).await;
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            assert_eq!(p["field"], "collection", "{p}");
            assert!(p["detail"]
                .as_str()
                .unwrap_or("")
                .contains("--max-collection-tokens"));
            break;
        }
        assert_eq!(status, StatusCode::OK, "{p}");
        fills += 1;
        assert!(fills < 100, "the collection budget never applied");
    }
    assert!(fills > 1);
    let listed = s.pipeline.corpus.index.documents(Some("c"))?;
    let held: usize = listed.iter().map(|d| d.tokens).sum();
    assert!(held <= 200, "{held}");
    Ok(())
}

/// Reads an NDJSON body to its end, line by line.
async fn read_lines(body: Body) -> Result<Vec<Value>, String> {
    let mut stream = body.into_data_stream();
    let mut buf = Vec::new();
    let mut lines = Vec::new();
    while let Some(chunk) = stream.next().await {
        buf.extend_from_slice(&chunk.map_err(|e| e.to_string())?);
        while let Some(end) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=end).collect();
            lines.push(serde_json::from_slice(&line).map_err(|e| e.to_string())?);
        }
    }
    assert!(buf.is_empty(), "a line without its newline");
    Ok(lines)
}

/// A server whose request token budget lets a long ingestion through.
fn roomy_server(dir: &std::path::Path) -> Result<AppState, Box<dyn std::error::Error>> {
    server(
        dir,
        ServerConfig {
            max_request_tokens: 1 << 22,
            ..Default::default()
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ndjson_progress_and_queries_between_chunks_of_a_long_ingestion() -> TestResult {
    let dir = tempfile::tempdir()?;
    let s = roomy_server(dir.path())?;
    // Something to query first.
    let (status, p) = send(&s, post("/documents", &documents(3, 10), false)).await;
    assert_eq!(status, StatusCode::OK, "{p}");
    let mut body = documents(600, 60);
    body["documents"][0]["id"] = json!("d1"); // a duplicate id: a problem line
    let resp = app(s.clone())
        .oneshot(post("/documents", &body, true))
        .await
        .unwrap_or_else(|e| match e {});
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        resp.headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("application/x-ndjson")
    );
    let started = Instant::now();
    let ingest = tokio::spawn(read_lines(resp.into_body()));
    // Queries sent while the ingestion runs are answered between its chunks.
    let mut answered = Vec::new();
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let q = json!({"query": "ant3 tent1", "collection": "c", "max_tokens": 2});
        let (status, a) = send(&s, post("/rag/query", &q, false)).await;
        assert_eq!(status, StatusCode::OK, "{a}");
        answered.push((started.elapsed(), ingest.is_finished()));
    }
    let lines = ingest.await??;
    let ingest_took = started.elapsed();
    assert!(
        answered.iter().all(|(_, finished)| !finished),
        "the ingestion ended before the queries: make it longer ({ingest_took:?}, {answered:?})"
    );
    eprintln!("ingestion {ingest_took:?}; queries answered at {answered:?}");
    // Lines: the problem, committed batches covering every document once, then the summary.
    assert_eq!(lines[0]["event"], "problem", "{}", lines[0]);
    let last = lines.last().ok_or("no lines")?;
    assert_eq!(last["event"], "summary", "{last}");
    assert_eq!(last["documents"], 599);
    let committed: Vec<&str> = lines
        .iter()
        .filter(|l| l["event"] == "committed")
        .flat_map(|l| l["documents"].as_array().into_iter().flatten())
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(committed.len(), 599);
    assert!(lines.iter().filter(|l| l["event"] == "committed").count() > 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streaming_client_that_leaves_stops_the_ingestion_keeping_what_it_was_told() -> TestResult
{
    let dir = tempfile::tempdir()?;
    let s = roomy_server(dir.path())?;
    let resp = app(s.clone())
        .oneshot(post("/documents", &documents(300, 60), true))
        .await
        .unwrap_or_else(|e| match e {});
    let mut stream = resp.into_body().into_data_stream();
    let mut buf = Vec::new();
    let mut told = Vec::new();
    while told.is_empty() {
        let chunk = stream.next().await.ok_or("ended early")??;
        buf.extend_from_slice(&chunk);
        while let Some(end) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=end).collect();
            let v: Value = serde_json::from_slice(&line)?;
            if v["event"] == "committed" {
                for d in v["documents"].as_array().ok_or("documents")? {
                    told.push(d.as_str().ok_or("id")?.to_string());
                }
            }
        }
    }
    drop(stream); // the client leaves
                  // The engine stops at the next chunk and is free: a query is answered promptly.
    let t = Instant::now();
    let q = json!({"query": "ant3", "collection": "c", "max_tokens": 1});
    let (status, a) = send(&s, post("/rag/query", &q, false)).await;
    assert_eq!(status, StatusCode::OK, "{a}");
    let listed: Vec<String> = s
        .pipeline
        .corpus
        .index
        .documents(Some("c"))?
        .into_iter()
        .map(|d| d.doc_id)
        .collect();
    for id in &told {
        assert!(
            listed.contains(id),
            "{id} was reported committed but is gone"
        );
    }
    assert!(
        listed.len() < 300,
        "the ingestion ran to its end after the client left"
    );
    eprintln!(
        "{} told, {} committed, query after {:?}",
        told.len(),
        listed.len(),
        t.elapsed()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_mib_word_and_an_8192_emoji_query_are_settled_within_seconds() -> TestResult {
    let dir = tempfile::tempdir()?;
    let s = server(dir.path(), ServerConfig::default())?;
    let (status, p) = send(&s, post("/documents", &documents(3, 10), false)).await;
    assert_eq!(status, StatusCode::OK, "{p}");
    let entries = s.pipeline.corpus.store.stats().entries;
    // One word of 1 Mi letters: within the character limit, refused by the token budget
    // after tokenizing, before any model work.
    let word: String = (0..1 << 20)
        .map(|i: u32| char::from(b'a' + (i.wrapping_mul(2_654_435_761) >> 27) as u8 % 26))
        .collect();
    let t = Instant::now();
    let body = json!({"documents": [{"id": "word", "text": word}]});
    let (status, p) = send(&s, post("/documents", &body, false)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{p}");
    assert_eq!(p["field"], "documents", "{p}");
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    eprintln!("1 Mi-letter word refused in {:?}", t.elapsed());
    // One character more is over the text limit itself.
    let body = json!({"documents": [{"id": "word", "text": format!("{word}b")}]});
    let (status, p) = send(&s, post("/documents", &body, false)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{p}");
    assert_eq!(p["field"], "documents[].text", "{p}");
    assert_eq!(
        s.pipeline.corpus.store.stats().entries,
        entries,
        "no KV computed"
    );
    // A query of 8192 emoji is answered or refused (naming the field) within seconds.
    let t = Instant::now();
    let q = json!({"query": "😀".repeat(8192), "collection": "c", "max_tokens": 4});
    let (status, a) = send(&s, post("/rag/query", &q, false)).await;
    assert!(
        status == StatusCode::OK
            || (status == StatusCode::UNPROCESSABLE_ENTITY && a["field"] == "query"),
        "{status}: {a}"
    );
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    eprintln!("8192-emoji query: {status} in {:?}", t.elapsed());
    Ok(())
}
