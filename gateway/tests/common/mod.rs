//! Helpers shared by the HTTP test files.
#![allow(dead_code)] // each test file uses a different subset

use gateway::corpus::{Corpus, Engines};
use gateway::pipeline::{Pipeline, ScoreSource};
use gateway::server::{AppState, ServerConfig};
use std::sync::Arc;
use target_engine::testing::{write_tiny_gguf, TinySpec};
use target_engine::{Architecture, LoadOptions, Model};

/// Result of a test body.
pub type TestResult = Result<(), Box<dyn std::error::Error>>;

/// A server over an empty corpus on a tiny target (no speculator).
pub fn server(
    dir: &std::path::Path,
    config: ServerConfig,
) -> Result<AppState, Box<dyn std::error::Error>> {
    let target = dir.join("target.gguf");
    write_tiny_gguf(&target, &TinySpec::new(Architecture::Qwen2))?;
    let engines = Engines::new(
        Arc::new(Model::load(&target, &LoadOptions::default())?),
        None,
    )?;
    let corpus = Corpus::open(&dir.join("data"), 1 << 30)?;
    let pipeline = Arc::new(Pipeline::new(engines, corpus, ScoreSource::Query));
    Ok(AppState::new(pipeline, config))
}
