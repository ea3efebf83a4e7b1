//! What `specrag demo` asks, shared with the test that holds its answer to full recompute's
//! (`gateway/tests/demo_question.rs`); its documents are [`crate::input::demo_paths`].

/// The question `specrag demo` asks (the README's first request).
pub const DEMO_QUESTION: &str =
    "How does specrag decide which tokens of the retrieved chunks to recompute?";

/// Most tokens of the demo's answers.
pub const DEMO_MAX_TOKENS: u32 = 96;

/// The `/rag/query` body `specrag demo` sends (its test sends the same).
pub fn demo_request(question: &str, method: &str, max_tokens: u32) -> serde_json::Value {
    serde_json::json!({
        "query": question, "collection": "demo", "method": method,
        "recompute_ratio": crate::pipeline::DEFAULT_RATIO, "max_tokens": max_tokens,
    })
}

/// The demo's documents under `root` (its README.md, ARCHITECTURE.md and docs/*.md) indexed
/// lazily (text and BM25 now, a chunk's KV at its first retrieval) into collection `demo` of a
/// store at `data`, as a pipeline answering with `target` (no speculator). Used by the test and
/// the example that ask the demo's question over the current docs; an unreadable document is
/// an error naming it.
pub fn lazy_pipeline(
    root: &std::path::Path,
    data: &std::path::Path,
    target: std::sync::Arc<target_engine::Model>,
) -> crate::error::Result<crate::pipeline::Pipeline> {
    let inputs = crate::input::read_inputs(&crate::input::demo_paths(root));
    if let Some(p) = inputs.problems.first() {
        return Err(crate::error::GatewayError::BadInput {
            field: "documents",
            message: p.to_string(),
        });
    }
    let corpus = crate::corpus::Corpus::open(data, 1 << 30)?;
    let engines = crate::corpus::Engines::new(target, None)?;
    let cfg = crate::ingest::IngestConfig {
        collection: "demo".into(),
        kv: crate::ingest::KvMode::Lazy,
        ..Default::default()
    };
    crate::ingest::ingest(&corpus, &engines, inputs.docs, &cfg, |_| {})?;
    Ok(crate::pipeline::Pipeline::new(
        engines,
        corpus,
        crate::pipeline::ScoreSource::Query,
    ))
}
