//! `specrag`: the command-line entry point. `args` holds every command and flag; each command
//! is one function (`commands` for the corpus commands, `tools` for models, generation and
//! tokenization, `fetch` for the default models); the measurements are `specrag-bench`'s
//! (eval). The model flags and loaders are `gateway::cli`'s, shared with it.
//! They share [`open_pipeline`] and `progress` (bars on a terminal, plain lines in a log);
//! `answer_stream` prints `query`'s answer (drawn as it streams on a terminal, written once
//! final elsewhere); `foreign_kv` tells `serve` when the stored KV is another model's.

mod answer_stream;
mod args;
mod commands;
mod fetch;
mod foreign_kv;
mod progress;
mod tools;

use anyhow::Context;
use args::{Cli, Cmd, ModelsCmd};
use clap::Parser;
use gateway::cli::{load_served_target, load_speculator, ModelArgs};
use gateway::corpus::{Corpus, Engines};
use gateway::pipeline::{Pipeline, ScoreSource};
use std::path::Path;
use std::sync::Arc;

/// Exit code of a run that skipped some inputs.
const EXIT_PARTIAL: i32 = 3;

fn main() {
    gateway::process::init();
    let cli = Cli::parse();
    gateway::cli::refuse_unsupported_attention(&cli.models);
    gateway::cli::exit_on_error(run(cli));
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let m = &cli.models;
    match cli.command {
        Cmd::Demo(a) => commands::demo(m, a),
        Cmd::Serve(a) => commands::serve(m, a),
        Cmd::Query(a) => commands::query(m, a),
        Cmd::Ingest(a) => commands::ingest(m, a),
        Cmd::Openapi => {
            println!("{}", gateway::http::openapi_json_text());
            Ok(())
        }
        Cmd::TinyModels { dir } => tools::tiny_models(&dir),
        Cmd::Models(ModelsCmd::Fetch { skip_large, model }) => {
            fetch::fetch_defaults(skip_large, model.as_deref())
        }
        Cmd::Models(ModelsCmd::List) => tools::list_models(),
        Cmd::Generate(a) => tools::generate(m, a),
        Cmd::Tokenize(a) => tools::tokenize(m, a),
    }
}

/// What every corpus command opens: the models (the speculator unless `with_speculator` is
/// false), then the data directory with a memory tier of `memory_bytes`.
fn open_pipeline(
    m: &ModelArgs,
    data: &Path,
    store: &gateway::corpus::StoreOptions,
    memory_bytes: u64,
    with_speculator: bool,
    scores: ScoreSource,
) -> anyhow::Result<Pipeline> {
    let target = load_served_target(m)?;
    // What the speculator serves (the SpecCache methods, its drafts) runs on the CPU engine
    // only: a device target loads none.
    let spec = if with_speculator && target.cpu().is_some() {
        Some(Arc::new(load_speculator(m)?))
    } else {
        None
    };
    let engines = Engines::new(target, spec)?;
    let corpus = Corpus::open_with(data, memory_bytes, store)
        .with_context(|| format!("opening data directory {}", data.display()))?;
    Ok(Pipeline::new(engines, corpus, scores))
}
