//! `specrag bench long` end to end on tiny random models: every drafter (SpeCache, the window,
//! SpeContext's two heads, prompt lookup, the speculator) decodes the long prompt verified and
//! answers as full attention, token for token; SpeContext's numbers say what it held and
//! loaded; out-of-range layers are refused by flag name before any work.

mod common;

use common::{run, tiny_models, TestResult, BIN};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Tiny models and 24 short notes ingested into `notes`: the model arguments and data dir.
fn ingested(dir: &Path) -> Result<(Vec<std::ffi::OsString>, PathBuf), Box<dyn std::error::Error>> {
    let models = tiny_models(dir);
    let docs = dir.join("docs");
    std::fs::create_dir_all(&docs)?;
    for i in 0..24 {
        let text = format!(
            "# Note {i}\n\nThe ant {i} ran in the sand near the tent, then sat in the attic \
             and ate {} thin mints. The hat of note {i} is in the tin.\n",
            i * 7
        );
        std::fs::write(docs.join(format!("note{i:02}.md")), text)?;
    }
    let data = dir.join("data");
    run(Command::new(BIN)
        .args(&models)
        .arg("ingest")
        .arg(&docs)
        .arg("--data")
        .arg(&data)
        .args(["--collection", "notes"])
        .env("RUST_LOG", "error"));
    Ok((models, data))
}

/// `bench long` over a 300-token context of the notes, 12 answer tokens, with `extra` flags.
fn bench(models: &[std::ffi::OsString], data: &Path, extra: &[&str]) -> std::io::Result<Output> {
    Command::new(BIN)
        .args(models)
        .args(["bench", "long", "--data"])
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
