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

/// The demo's verdict on the answer from stored KV against full recompute's (two `/rag/query`
/// answers): it compares the exact text, untrimmed, and the token counts the server reported,
/// and says only that (equal text and counts do not prove equal token ids).
pub fn agreement(reused: &serde_json::Value, full: &serde_json::Value) -> String {
    let text = |v: &serde_json::Value| v["answer"].as_str().unwrap_or_default().to_string();
    let tokens = |v: &serde_json::Value| v["tokens"].as_u64().unwrap_or_default();
    let (a, b) = (text(reused), text(full));
    let (n, m) = (tokens(reused), tokens(full));
    if a == b && n == m {
        format!("  the answers are the same text, character for character, and both are {n} tokens")
    } else if a == b {
        format!("  the answers are the same text, but {n} tokens against full recompute's {m}")
    } else if a.trim() == b.trim() {
        "  the answers differ only in white space at their ends".to_string()
    } else {
        format!("  full recompute answered differently: {}", b.trim())
    }
}

#[cfg(test)]
mod tests {
    use super::agreement;
    use serde_json::json;

    #[test]
    fn the_demo_says_the_answers_agree_only_as_far_as_it_compared_them() {
        // Issue 88: it said "token for token" after comparing trimmed text.
        let a = |text: &str, tokens: u64| json!({"answer": text, "tokens": tokens});
        let same = agreement(&a(" The cat.", 3), &a(" The cat.", 3));
        assert!(
            same.contains("same text, character for character"),
            "{same}"
        );
        assert!(same.contains("3 tokens") && !same.contains("token for token"));
        let spaced = agreement(&a(" The cat.", 3), &a(" The cat.\n", 4));
        assert!(spaced.contains("differ only in white space"), "{spaced}");
        let split = agreement(&a("The cat.", 3), &a("The cat.", 4));
        assert!(
            split.contains("3 tokens against full recompute's 4"),
            "{split}"
        );
        let other = agreement(&a("The cat.", 3), &a("A dog.", 3));
        assert_eq!(other, "  full recompute answered differently: A dog.");
    }
}
