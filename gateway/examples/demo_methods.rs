//! The demo question (`specrag demo`'s) over the repository's current docs, answered by
//! several methods and fidelities on the same retrieved chunks, to see which of them answers
//! as full recompute does.
//!
//! `cargo run --release -p gateway --example demo_methods -- [--question Q] [--max-tokens N]
//! [--top-k K] [METHOD[:FIDELITY]...]` (default: `full_recompute target_probe:fast
//! target_probe:balanced`). Needs the default target in `$SPECRAG_MODELS` or `models/`.
//! Prints one JSON line per answer: the method, fidelity, answer, whether it equals full
//! recompute's (the first method given must be `full_recompute` for that), time to first
//! token, total time, tokens recomputed and the guard's report.

use gateway::fidelity::Fidelity;
use gateway::pipeline::{Method, Query};
use std::sync::Arc;
use target_engine::{LoadOptions, Model};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> Res<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut take = |flag: &str| -> Option<String> {
        let i = args.iter().position(|a| a == flag)?;
        args.remove(i);
        (i < args.len()).then(|| args.remove(i))
    };
    let question = take("--question").unwrap_or_else(|| gateway::demo::DEMO_QUESTION.into());
    let max_tokens: usize = take("--max-tokens")
        .map_or(Ok(gateway::demo::DEMO_MAX_TOKENS as usize), |s| {
            s.parse().map_err(|e| format!("--max-tokens {s}: {e}"))
        })?;
    let top_k: Option<usize> = take("--top-k")
        .map(|s| s.parse().map_err(|e| format!("--top-k {s}: {e}")))
        .transpose()?;
    if args.is_empty() {
        args = [
            "full_recompute",
            "target_probe:fast",
            "target_probe:balanced",
        ]
        .map(String::from)
        .to_vec();
    }
    let asks: Vec<(Method, Fidelity)> = args
        .iter()
        .map(|a| {
            let (m, f) = a.split_once(':').unwrap_or((a, "balanced"));
            let method = Method::parse(m).ok_or_else(|| format!("unknown method {m}"))?;
            let fidelity = Fidelity::parse(f).ok_or_else(|| format!("unknown fidelity {f}"))?;
            Ok((method, fidelity))
        })
        .collect::<Res<_>>()?;

    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = std::env::var_os("SPECRAG_MODELS")
        .map_or_else(|| root.join("models"), std::path::PathBuf::from);
    let target = Arc::new(Model::load(
        &dir.join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
        &LoadOptions::default(),
    )?);
    let data = tempfile::tempdir()?;
    let pipeline = gateway::demo::lazy_pipeline(&root, &data.path().join("data"), target)?;
    let mut full: Option<String> = None;
    for (method, fidelity) in asks {
        let mut q = Query {
            query: question.clone(),
            collection: "demo".into(),
            method,
            max_tokens,
            fidelity,
            ..Default::default()
        };
        if let Some(k) = top_k {
            q.top_k = k;
        }
        let a = pipeline.query(&q, &mut |_| true)?;
        if method == Method::FullRecompute && full.is_none() {
            full = Some(a.answer.clone());
        }
        let line = serde_json::json!({
            "method": method.name(),
            "fidelity": fidelity.name(),
            "answer": a.answer,
            "identical": full.as_ref().map(|f| *f == a.answer),
            "ttft_ms": a.timings.ttft_ms,
            "total_ms": a.timings.total_ms,
            "recomputed": a.reuse.recomputed_tokens,
            "chunks": a.chunks.iter().map(|c| format!("{}#{}", c.doc_id, c.position)).collect::<Vec<_>>(),
            "guard": a.reuse.guard,
        });
        println!("{line}");
    }
    Ok(())
}
