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
