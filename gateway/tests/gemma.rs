//! A second family served end to end: Gemma 3 270M (`specrag models fetch --model
//! gemma3-270m`, which the test setup runs) behind `/rag/query` and the OpenAI route, prompted
//! in Gemma's own turns (its file carries no chat template), with its sliding-window layers.
//! `exact` answers must be full recompute's token for token, as on every family.

use gateway::corpus::{Corpus, Engines};
use gateway::input::SourceDoc;
use gateway::pipeline::{Pipeline, ScoreSource};
use serde_json::{json, Value};
use std::sync::Arc;
use target_engine::{ChatSource, LoadOptions, Model};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const GEMMA: &str = "gemma-3-270m-q4_k_m.gguf";

fn gemma() -> Result<Arc<Model>, Box<dyn std::error::Error>> {
    let dir = std::env::var_os("SPECRAG_MODELS").map_or_else(
        || std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models"),
        std::path::PathBuf::from,
    );
    let path = dir.join(GEMMA);
    assert!(
        path.is_file(),
        "{} is missing: run scripts/setup-tests.sh (`specrag models fetch --model gemma3-270m`)",
        path.display()
    );
    Ok(Arc::new(Model::load(&path, &LoadOptions::default())?))
}

/// Three short documents of this repository's docs: quick to ingest on 2 cores.
fn docs() -> Vec<SourceDoc> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(root.join("docs/blend.md")).unwrap_or_default();
    text.split("\n\n")
        .filter(|p| p.len() > 300)
        .take(3)
        .enumerate()
        .map(|(i, p)| SourceDoc {
            id: format!("blend-{i}"),
            title: None,
            text: p.to_string(),
            origin: "docs/blend.md".into(),
        })
        .collect()
}

#[test]
fn gemma3_270m_answers_through_both_routes_in_its_own_turns() -> TestResult {
    let model = gemma()?;
    assert_eq!(model.chat().source, ChatSource::Family("gemma"));
    let dir = tempfile::tempdir()?;
    let corpus = Corpus::open(&dir.path().join("data"), 1 << 30)?;
    let engines = Engines::new(model, None)?;
    assert!(
        engines.prefix_text().starts_with("<start_of_turn>user\n"),
        "{:?}",
        engines.prefix_text()
    );
    let cfg = gateway::ingest::IngestConfig {
        collection: "gemma".into(),
        ..Default::default()
    };
    let report = gateway::ingest::ingest(&corpus, &engines, docs(), &cfg, |_| {})?;
    assert!(report.chunks >= 3, "{report:?}");
    let pipeline = Pipeline::new(engines, corpus, ScoreSource::Query);
    let state = gateway::http::AppState::new(Arc::new(pipeline), Default::default());
    let rt = gateway::http::runtime()?;
    rt.block_on(async {
        let addr = gateway::http::spawn_loopback(state).await?;
        let post = |path: &'static str, body: Value| async move {
            let (status, text) =
                gateway::client::request(addr, "POST", path, Some(&body.to_string())).await?;
            assert_eq!(status, 200, "{path}: {text}");
            Ok::<Value, Box<dyn std::error::Error>>(serde_json::from_str(&text)?)
        };
        let question = "What does a blended prefill recompute?";
        let ask = |method: &str, fidelity: &str| {
            json!({"query": question, "collection": "gemma", "top_k": 3, "max_tokens": 16,
                   "method": method, "fidelity": fidelity})
        };
        let full = post("/rag/query", ask("full_recompute", "balanced")).await?;
        let exact = post("/rag/query", ask("target_probe", "exact")).await?;
        let default = post("/rag/query", ask("target_probe", "balanced")).await?;
        eprintln!(
            "full recompute: {}\nexact: {}\ndefault: {} (guard {})",
            full["answer"], exact["answer"], default["answer"], default["reuse"]["guard"]
        );
        assert!(full["tokens"].as_u64().unwrap_or(0) > 0, "{full}");
        assert_eq!(
            exact["answer"], full["answer"],
            "exact is full recompute's answer"
        );
        assert!(
            default["reuse"]["recomputed_tokens"].as_u64()
                < full["reuse"]["recomputed_tokens"].as_u64()
        );
        let chat = json!({
            "model": "specrag",
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 16,
            "specrag": {"top_k": 3, "method": "full_recompute", "collection": "gemma"},
        });
        let v = post("/v1/chat/completions", chat).await?;
        assert_eq!(v["choices"][0]["message"]["content"], full["answer"]);
        Ok::<(), Box<dyn std::error::Error>>(())
    })?;
    Ok(())
}
