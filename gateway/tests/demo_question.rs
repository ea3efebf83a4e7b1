//! The README's demo question with the default target (Qwen2.5-Coder-1.5B) and the default
//! method: the default (`balanced`) must answer exactly as full recompute does.
//!
//! - Over the repository's current docs, as `specrag demo` asks it (lazy ingestion of README.md,
//!   ARCHITECTURE.md and docs/*.md, the same HTTP request), so a docs edit that breaks a
//!   newcomer's first answer fails here (issue 59; run on request: its outcome depends on the
//!   CPU's kernel path).
//! - Over the four chunks BM25 retrieved on 2026-11-26 (frozen in `fixtures/demo_question.json`,
//!   in retrieval order), where unguarded reuse sent the answer into one off-topic sentence said
//!   twice (issue 39): a regression case.
//!
//! Real-model tests: the default target must be in `$SPECRAG_MODELS` (`scripts/setup-tests.sh`
//! fetches it). Each takes one to a few minutes on 2 cores.

use gateway::corpus::{Corpus, Engines};
use gateway::fidelity::Fidelity;
use gateway::input::SourceDoc;
use gateway::pipeline::{ChunkOrder, Experiment, Method, Pipeline, Query, ScoreSource};
use std::sync::Arc;
use target_engine::{LoadOptions, Model};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const TARGET: &str = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf";

fn default_target() -> Result<Arc<Model>, Box<dyn std::error::Error>> {
    // `$SPECRAG_MODELS`, else the workspace's `models/` (where setup links the models).
    let dir = std::env::var_os("SPECRAG_MODELS").map_or_else(
        || std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models"),
        std::path::PathBuf::from,
    );
    let path = dir.join(TARGET);
    assert!(
        path.is_file(),
        "{} is missing: run scripts/setup-tests.sh (the README's test command does)",
        path.display()
    );
    Ok(Arc::new(Model::load(&path, &LoadOptions::default())?))
}

/// The demo's question over today's docs meets the fidelity target: the default's answer is
/// full recompute's, or parts from it only where full recompute chose by a near tie (its own
/// top-2 gap under `NEAR_TIE_GAP`; over the docs of 2026-12-07 on a Zen 3, `using` for `based`
/// at the 13th token, past the guard's phrasing horizon, by 0.014). Out of the default run
/// because its outcome depends on the CPU: CPUs without AVX-512 VNNI or AVX2 multiply the
/// target's weights on other kernels, so a gap may fall on the other side of the guard's margin there
/// (eval/study/guard/demo-question.md). Run it after a docs edit: `cargo test --release -p
/// gateway --test demo_question -- --ignored`.
#[test]
#[ignore = "depends on the CPU's kernel path; run after a docs edit (issue 59)"]
fn the_demo_question_over_the_current_docs_is_answered_as_full_recompute_answers_it() -> TestResult
{
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = tempfile::tempdir()?;
    let pipeline =
        gateway::demo::lazy_pipeline(&root, &dir.path().join("data"), default_target()?)?;
    let state = gateway::http::AppState::new(Arc::new(pipeline), Default::default());
    let rt = gateway::http::runtime()?;
    let answers = rt.block_on(async {
        let addr = gateway::http::spawn_loopback(state).await?;
        let mut out = Vec::new();
        for method in [Query::default().method.name(), "full_recompute"] {
            let body = gateway::demo::demo_request(
                gateway::demo::DEMO_QUESTION,
                method,
                gateway::demo::DEMO_MAX_TOKENS,
            );
            let mut body = body;
            body["logprobs"] = serde_json::json!(2);
            let (status, text) =
                gateway::client::request(addr, "POST", "/rag/query", Some(&body.to_string()))
                    .await?;
            assert_eq!(status, 200, "{text}");
            out.push(serde_json::from_str::<serde_json::Value>(&text)?);
        }
        Ok::<_, Box<dyn std::error::Error>>(out)
    })?;
    let (default, full) = (&answers[0], &answers[1]);
    eprintln!(
        "sources: {}\nfull recompute: {}\ndefault: {} (guard {})",
        full["chunks"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| format!("{}#{}", c["doc_id"], c["position"]))
            .collect::<Vec<_>>()
            .join(", "),
        full["answer"],
        default["answer"],
        default["reuse"]["guard"]
    );
    assert_eq!(
        default["chunks"], full["chunks"],
        "both asks retrieve the same chunks"
    );
    // The fidelity target: the same answer, or a split where full recompute itself chose by
    // a near tie (numerics treated as equal choose either way there).
    if default["answer"] != full["answer"] {
        let (at, ours, theirs, gap) =
            gateway::demo::first_split(default, full).ok_or("answers without logprobs")?;
        assert!(
            gap < f64::from(gateway::fidelity::NEAR_TIE_GAP),
            "the demo's default answer parts from full recompute's at token {} ({ours} for \
             {theirs}), which full recompute chose by {gap:.3} logit: a confident split",
            at + 1
        );
    }
    Ok(())
}

#[test]
fn the_frozen_demo_chunks_are_answered_as_full_recompute_answers_them() -> TestResult {
    let fixture: serde_json::Value =
        serde_json::from_str(include_str!("fixtures/demo_question.json"))?;
    let question = fixture["question"].as_str().ok_or("question")?.to_string();
    let chunks = fixture["chunks"].as_array().ok_or("chunks")?;
    let target = default_target()?;
    let dir = tempfile::tempdir()?;
    let corpus = Corpus::open(&dir.path().join("data"), 1 << 30)?;
    let engines = Engines::new(target, None)?;
    // One document per retrieved chunk, named so that document order is retrieval order.
    let docs: Vec<SourceDoc> = chunks
        .iter()
        .enumerate()
        .map(|(i, c)| SourceDoc {
            id: format!("{i}-{}", c["doc_id"].as_str().unwrap_or_default()),
            title: None,
            text: c["text"].as_str().unwrap_or_default().to_string(),
            origin: "fixtures/demo_question.json".into(),
        })
        .collect();
    let cfg = gateway::ingest::IngestConfig {
        collection: "demo".into(),
        ..Default::default()
    };
    let report = gateway::ingest::ingest(&corpus, &engines, docs, &cfg, |_| {})?;
    assert_eq!(
        report.chunks,
        chunks.len(),
        "each fixture chunk stays one chunk"
    );
    let pipeline = Pipeline::new(engines, corpus, ScoreSource::Query);
    let ask = |method: Method, fidelity: Fidelity| {
        let q = Query {
            query: question.clone(),
            collection: "demo".into(),
            top_k: chunks.len(),
            method,
            max_tokens: 96,
            fidelity,
            ..Default::default()
        };
        pipeline
            .query_with(&q, &InDocumentOrder, &mut |_| true)
            .map(|t| t.answer)
    };
    let full = ask(Method::FullRecompute, Fidelity::Balanced)?;
    let default = ask(Query::default().method, Fidelity::default())?;
    let fast = ask(Query::default().method, Fidelity::Fast)?;
    eprintln!(
        "full recompute: {:?}\ndefault: {:?} (guard {:?})\nunguarded: {:?}",
        full.answer, default.answer, default.reuse.guard, fast.answer
    );
    let texts: Vec<&str> = full.chunks.iter().map(|c| c.text.as_str()).collect();
    let fixed: Vec<&str> = chunks.iter().filter_map(|c| c["text"].as_str()).collect();
    assert_eq!(
        texts, fixed,
        "the prompt holds the fixture's chunks in its order"
    );
    assert_eq!(
        default.answer, full.answer,
        "the default answer differs from full recompute's"
    );
    Ok(())
}

/// The frozen chunks read in the order they were frozen in.
struct InDocumentOrder;

impl Experiment for InDocumentOrder {
    fn order(&self) -> Option<ChunkOrder> {
        Some(ChunkOrder::Document)
    }
}
