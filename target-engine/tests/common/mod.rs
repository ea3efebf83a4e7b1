//! Shared helpers of the real-model tests: where the default models are and the fixtures.
#![allow(dead_code)]

use std::path::PathBuf;

/// File names of the default models, as `specrag models fetch` stores them.
pub const QWEN_05B: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
pub const SMOLLM2: &str = "smollm2-135m-instruct-q4_1.gguf";
pub const QWEN_15B: &str = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf";

/// Fixture model name -> file name.
pub fn file_for(fixture_model: &str) -> &'static str {
    match fixture_model {
        "qwen2.5-coder-0.5b-instruct" => QWEN_05B,
        "smollm2-135m-instruct" => SMOLLM2,
        "qwen2.5-coder-1.5b-instruct" => QWEN_15B,
        other => panic!("fixture names unknown model {other}"),
    }
}

/// Path of a default model: `$SPECRAG_MODELS`, else `<workspace>/models`, else the download
/// cache. A missing model fails the test with the command that fetches it: these tests are
/// part of the normal suite and must not pass by skipping.
pub fn model_path(file: &str) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut dirs = Vec::new();
    if let Ok(d) = std::env::var("SPECRAG_MODELS") {
        dirs.push(PathBuf::from(d));
    }
    dirs.push(root.join("models"));
    if let Ok(cache) = std::env::var("SPECRAG_CACHE") {
        dirs.push(PathBuf::from(cache).join("models"));
    }
    if let Ok(home) = std::env::var("HOME") {
        dirs.push(PathBuf::from(home).join(".cache/specrag/models"));
    }
    for d in &dirs {
        let p = d.join(file);
        if p.is_file() {
            return p;
        }
    }
    panic!("model {file} not found in {dirs:?}; run `scripts/setup-tests.sh` (`specrag models fetch`, and `--model gemma3-270m` for Gemma 3)");
}

/// Lines of a llama.cpp reference file in `tests/fixtures` (see its README).
pub fn fixture_lines(name: &str) -> Vec<serde_json::Value> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let text =
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("cannot read {}: {e}", p.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("fixture line is JSON"))
        .collect()
}
