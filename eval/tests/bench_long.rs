//! `specrag-bench long` end to end on tiny random models: every drafter (SpeCache, the window,
//! SpeContext's two heads, prompt lookup, the speculator) decodes the long prompt verified and
//! answers as full attention, token for token; SpeContext's numbers say what it held and
//! loaded; out-of-range layers are refused by flag name before any work.

use gateway::corpus::{Corpus, Engines};
use gateway::ingest::{ingest, IngestConfig};
use gateway::input::SourceDoc;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use target_engine::testing::{write_tiny_gguf, TinySpec};
use target_engine::{Architecture, LoadOptions, Model};

type TestResult = Result<(), Box<dyn std::error::Error>>;

const BIN: &str = env!("CARGO_BIN_EXE_specrag-bench");

/// Tiny models (a qwen2 target, a llama speculator, as `specrag tiny-models` writes them) and
/// 24 short notes ingested into `notes` as `specrag ingest` does: the model arguments and the
/// data dir.
fn ingested(dir: &Path) -> Result<(Vec<std::ffi::OsString>, PathBuf), Box<dyn std::error::Error>> {
    let (target, speculator) = (dir.join("target.gguf"), dir.join("speculator.gguf"));
    write_tiny_gguf(&target, &TinySpec::new(Architecture::Qwen2))?;
    let mut spec = TinySpec::new(Architecture::Llama);
    spec.seed = 5;
    write_tiny_gguf(&speculator, &spec)?;
    let load = |p: &Path| Model::load(p, &LoadOptions::default()).map(Arc::new);
    let engines = Engines::new(load(&target)?, Some(load(&speculator)?))?;
    let data = dir.join("data");
    let corpus = Corpus::open(&data, 1 << 30)?;
    let docs = (0..24)
        .map(|i| SourceDoc {
            id: format!("note{i:02}.md"),
            title: None,
            text: format!(
                "# Note {i}\n\nThe ant {i} ran in the sand near the tent, then sat in the attic \
                 and ate {} thin mints. The hat of note {i} is in the tin.\n",
                i * 7
            ),
            origin: format!("note{i:02}.md"),
        })
        .collect();
    let cfg = IngestConfig {
        collection: "notes".into(),
        ..Default::default()
    };
    ingest(&corpus, &engines, docs, &cfg, |_| {})?;
    let models = vec![
        "--target".into(),
        target.into(),
        "--speculator".into(),
        speculator.into(),
    ];
    Ok((models, data))
}

/// `bench long` over a 300-token context of the notes, 12 answer tokens, with `extra` flags.
fn bench(models: &[std::ffi::OsString], data: &Path, extra: &[&str]) -> std::io::Result<Output> {
    Command::new(BIN)
        .args(models)
        .args(["long", "--data"])
        .arg(data)
        .args([
            "--collection",
            "notes",
            "--contexts",
            "300",
            "--max-tokens",
            "12",
        ])
        .args([
            "--question",
            "Where is the hat?",
            "--top-k",
            "8",
            "--window",
            "4",
        ])
        .args(extra)
        .env("RUST_LOG", "error")
        .output()
}

#[test]
fn every_drafter_answers_as_full_attention() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (models, data) = ingested(dir.path())?;
    let out = bench(
        &models,
        &data,
        &["--json", "--retrieval-layer", "0", "--context-layer", "1"],
    )?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let point: serde_json::Value = serde_json::from_str(String::from_utf8(out.stdout)?.trim())?;
    let drafters = point["drafters"].as_array().ok_or("no drafters")?;
    let names: Vec<&str> = drafters
        .iter()
        .filter_map(|d| d["drafter"].as_str())
        .collect();
    for want in [
        "specache",
        "window",
        "specontext-embed-l0",
        "specontext-ctx-l1",
        "lookup",
        "speculator",
    ] {
        assert!(
            names.iter().any(|n| n.starts_with(want)),
            "{want} missing from {names:?}"
        );
    }
    for d in drafters {
        assert_eq!(d["identical"], true, "{d}");
        if d["drafter"]
            .as_str()
            .is_some_and(|n| n.starts_with("specontext"))
        {
            assert!(d["held_bytes"].as_u64().is_some_and(|b| b > 0), "{d}");
            assert!(d["loaded_fraction"].as_f64().is_some(), "{d}");
        }
    }
    Ok(())
}

/// The memory model names its budget; the default layers fit a small speculator; a layer past
/// the speculator's is refused by its flag's name.
#[test]
fn specontext_flags_are_checked_and_named() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (models, data) = ingested(dir.path())?;
    let flags = [
        "--json",
        "--drafter",
        "specontext-embed",
        "--resident-mb",
        "1",
    ];
    let out = bench(&models, &data, &flags)?;
    assert!(out.status.success());
    let point: serde_json::Value = serde_json::from_str(String::from_utf8(out.stdout)?.trim())?;
    assert_eq!(
        point["drafters"][0]["drafter"], "specontext-embed-l1-resident1MiB",
        "the default layer clamped to the tiny speculator's last"
    );
    let out = bench(&models, &data, &["--context-layer", "9"])?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--context-layer 9"), "{err}");
    Ok(())
}
