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

/// Where two `/rag/query` answers asked with `logprobs` of at least 2 first chose different
/// tokens: the token's index, the reused answer's token, full recompute's, and full
/// recompute's top-2 logprob gap there (None where either lacks the logprobs or they never
/// part).
pub fn first_split(
    reused: &serde_json::Value,
    full: &serde_json::Value,
) -> Option<(usize, String, String, f64)> {
    let (a, b) = (reused["logprobs"].as_array()?, full["logprobs"].as_array()?);
    let i = a
        .iter()
        .zip(b)
        .position(|(x, y)| x["token"] != y["token"])?;
    let top = b[i]["top_logprobs"].as_array()?;
    let gap = top.first()?["logprob"].as_f64()? - top.get(1)?["logprob"].as_f64()?;
    let tok = |v: &serde_json::Value| format!("{:?}", v["token"].as_str().unwrap_or_default());
    Some((i, tok(&a[i]), tok(&b[i]), gap))
}

/// The demo's verdict on the answer from stored KV against full recompute's (two `/rag/query`
/// answers): it compares the exact text, untrimmed, and the token counts the server reported,
/// and says only that (equal text and counts do not prove equal token ids). Where the answers
/// differ and carry their logprobs, it names the first token they part at and classes the
/// split by full recompute's own top-2 gap there: a near tie (under
/// [`crate::fidelity::NEAR_TIE_GAP`]) or a
/// confident split (a miss of the fidelity guard).
pub fn agreement(reused: &serde_json::Value, full: &serde_json::Value) -> String {
    let text = |v: &serde_json::Value| v["answer"].as_str().unwrap_or_default().to_string();
    let tokens = |v: &serde_json::Value| v["tokens"].as_u64().unwrap_or_default();
    let (a, b) = (text(reused), text(full));
    let (n, m) = (tokens(reused), tokens(full));
    if a == b && n == m {
        return format!(
            "  the answers are the same text, character for character, and both are {n} tokens"
        );
    } else if a == b {
        return format!(
            "  the answers are the same text, but {n} tokens against full recompute's {m}"
        );
    } else if a.trim() == b.trim() {
        return "  the answers differ only in white space at their ends".to_string();
    }
    let mut said = format!("  full recompute answered differently: {}", b.trim());
    if let Some((i, ours, theirs, gap)) = first_split(reused, full) {
        let near = crate::fidelity::NEAR_TIE_GAP;
        let class = if gap < f64::from(near) {
            format!(
                "a near tie of full recompute's own (under {near}: numerics treated as \
                 equal choose either way there)"
            )
        } else {
            "a confident split, which the fidelity guard missed (docs/fidelity-guard.md)".into()
        };
        said.push_str(&format!(
            "\n  they part at token {}: {ours} from the stored KV, {theirs} by full recompute, \
             which chose it by {gap:.3} logit over the next: {class}",
            i + 1
        ));
    }
    said
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

    /// Answers that carry their logprobs: the verdict names the first token they part at and
    /// classes the split by full recompute's own top-2 gap there.
    #[test]
    fn the_demo_classes_a_split_by_full_recomputes_own_gap() {
        let lp = |tok: &str, alt: &str, gap: f64| {
            json!({"token": tok, "logprob": -0.1,
                   "top_logprobs": [{"token": tok, "logprob": -0.1},
                                    {"token": alt, "logprob": -0.1 - gap}]})
        };
        let answer = |text: &str, lps: Vec<serde_json::Value>| json!({"answer": text, "tokens": lps.len(), "logprobs": lps});
        let reused = answer(
            " It ran.",
            vec![lp(" It", " The", 0.29), lp(" ran", ".", 3.0)],
        );
        let confident = answer(
            " The cat.",
            vec![lp(" The", " It", 0.366), lp(" cat", ".", 2.0)],
        );
        let said = agreement(&reused, &confident);
        assert!(
            said.contains(
                "part at token 1: \" It\" from the stored KV, \" The\" by full recompute"
            ) && said.contains("by 0.366 logit")
                && said.contains("a confident split"),
            "{said}"
        );
        let tie = answer(
            " The cat.",
            vec![lp(" The", " It", 0.05), lp(" cat", ".", 2.0)],
        );
        let said = agreement(&reused, &tie);
        assert!(
            said.contains("a near tie of full recompute's own"),
            "{said}"
        );
        // The same tokens throughout but other text: no split to name.
        let same_tokens = answer(
            " It ran!",
            vec![lp(" It", " The", 0.29), lp(" ran", ".", 3.0)],
        );
        let said = agreement(&reused, &same_tokens);
        assert_eq!(said, "  full recompute answered differently: It ran!");
    }
}
