//! The paths users bring their own data through, on tiny random-weight models (plumbing, not
//! quality): a LongBench-format file, then a query file against the data directory that run
//! left behind, and a bad line named before any model loads.

use eval::plan::ConfigKey;
use eval::report::Results;
use std::path::Path;
use std::process::{Command, Output};
use target_engine::testing::{write_tiny_gguf, TinySpec};
use target_engine::Architecture;

fn eval_cmd(models: &Path, args: &[&str]) -> std::io::Result<Output> {
    Command::new(env!("CARGO_BIN_EXE_specrag-eval"))
        .arg("--target")
        .arg(models.join("target.gguf"))
        .arg("--speculator")
        .arg(models.join("spec.gguf"))
        .args([
            "--quick",
            "--no-synthetic",
            "--no-load",
            "--max-tokens",
            "6",
        ])
        .args(args)
        .output()
}

fn results(dir: &Path) -> Result<Results, Box<dyn std::error::Error>> {
    Ok(serde_json::from_str(&std::fs::read_to_string(
        dir.join("results.json"),
    )?)?)
}

#[allow(
    clippy::too_many_lines,
    reason = "one end-to-end run over user files checked as a whole; split tests would each pay for the models and the run"
)]
#[test]
fn longbench_and_query_files_run_end_to_end() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    write_tiny_gguf(&d.join("target.gguf"), &TinySpec::new(Architecture::Qwen2))?;
    let mut s = TinySpec::new(Architecture::Llama);
    s.seed = 5;
    write_tiny_gguf(&d.join("spec.gguf"), &s)?;
    let context = "The lighthouse keeper logged every ship. ".repeat(12)
        + "The keeper's name was Orlen Vask. "
        + &"Storms came in winter and the lamp burned oil. ".repeat(12);
    let lb = d.join("lb.jsonl");
    std::fs::write(
        &lb,
        format!(
            "{}\n{}\n",
            serde_json::json!({"input": "Who kept the lighthouse?", "context": context,
                "answers": ["Orlen Vask"], "_id": "lh1", "length": 120}),
            serde_json::json!({"input": "What did the lamp burn?", "context": context,
                "answers": ["oil"], "_id": "lh2"}),
        ),
    )?;
    let data = d.join("data");
    let out = d.join("out1");
    let o = eval_cmd(
        d,
        &[
            "--longbench",
            lb.to_str().ok_or("path")?,
            "--chunk-tokens",
            "32",
            "--top-k",
            "4",
            "--data",
            data.to_str().ok_or("path")?,
            "--out",
            out.to_str().ok_or("path")?,
        ],
    )?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r = results(&out)?;
    let configs = r.configs[0].1.len();
    assert_eq!(r.records.len(), 2 * configs);
    assert!(r.records.iter().all(|x| x.dataset == "longbench:lb.jsonl"));
    // Each context was chunked (32 tokens) and the top 4 chunks read: the prompt holds 4 chunks
    // (each segment also carries the template's separator tokens).
    let full = r
        .records
        .iter()
        .find(|x| x.case == "lh1" && x.config == ConfigKey::full_recompute())
        .ok_or("no reference answer")?;
    assert!(
        full.reuse.chunk_tokens > 4 * 20 && full.reuse.chunk_tokens <= 4 * (32 + 16),
        "{:?} {:?}",
        full.reuse,
        r.ingest
    );
    assert!(r.ingest[0].chunks > 4, "{:?}", r.ingest);
    assert_eq!(r.identity.len(), 4);
    assert!(r.identity_holds(), "{:?}", r.identity);

    // --render rebuilds the same report from results.json, without models or a run.
    let out3 = d.join("out3");
    let o = Command::new(env!("CARGO_BIN_EXE_specrag-eval"))
        .arg("--render")
        .arg(out.join("results.json"))
        .arg("--out")
        .arg(&out3)
        .output()?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        std::fs::read_to_string(out3.join("report.md"))?,
        std::fs::read_to_string(out.join("report.md"))?
    );

    // The same chunks, asked through a query file against the data directory left behind.
    let q = d.join("q.jsonl");
    std::fs::write(
        &q,
        "{\"query\": \"Who kept the lighthouse?\", \"answers\": [\"Orlen Vask\"], \"collection\": \"eval-lh1\"}\n",
    )?;
    let out2 = d.join("out2");
    let o = eval_cmd(
        d,
        &[
            "--queries",
            q.to_str().ok_or("path")?,
            "--top-k",
            "4",
            "--queries-data",
            data.join("small").to_str().ok_or("path")?,
            "--out",
            out2.to_str().ok_or("path")?,
        ],
    )?;
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r2 = results(&out2)?;
    assert!(r2.records.iter().all(|x| x.dataset == "queries:q.jsonl"));
    let full2 = r2
        .records
        .iter()
        .find(|x| x.config == ConfigKey::full_recompute())
        .ok_or("no reference answer")?;
    assert_eq!(
        full2.reuse.chunk_tokens, full.reuse.chunk_tokens,
        "the query file retrieves the chunks the LongBench run ingested"
    );
    assert!(
        r2.records
            .iter()
            .all(|x| x.reuse.chunks_recomputed == 0 && x.reuse.chunks_from_disk == 0),
        "chunk KV comes from the stored data, loaded before the first timed reuse"
    );
    assert!(r2.records.iter().any(|x| x.reuse.chunks_from_memory > 0));

    // A data directory without an index is refused before any model loads.
    let o = eval_cmd(
        d,
        &[
            "--queries",
            q.to_str().ok_or("path")?,
            "--queries-data",
            d.join("nowhere").to_str().ok_or("path")?,
        ],
    )?;
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("no index there"), "{err}");

    // A bad line is named with file:line, exit code 2, before any model is loaded.
    std::fs::write(
        &lb,
        "{\"input\": \"q\", \"context\": \"c\", \"answers\": [\"a\"]}\n{\"input\": 3}\n",
    )?;
    let o = eval_cmd(d, &["--longbench", lb.to_str().ok_or("path")?])?;
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("lb.jsonl:2:"), "{err}");
    assert!(!err.contains("loading"), "no model was loaded: {err}");
    Ok(())
}
