//! `specrag`: the command-line entry point. `args` holds every command and flag; each command
//! is one function (`commands` for the corpus commands, `tools` for models, generation and
//! tokenization, `bench` and `overlap` for the measurements, `fetch` for the default models).
//! They share [`open_pipeline`] and `progress` (bars on a terminal, plain lines in a log).

mod args;
mod bench;
mod commands;
mod fetch;
mod long;
mod overlap;
mod progress;
mod tools;

use anyhow::Context;
use args::{BenchCmd, Cli, Cmd, ModelArgs, ModelsCmd};
use clap::Parser;
use gateway::corpus::{Corpus, Engines};
use gateway::pipeline::{Pipeline, ScoreSource};
use indicatif::ProgressBar;
use std::path::Path;
use std::sync::Arc;
use target_engine::Model;

/// Exit code of a run that skipped some inputs.
const EXIT_PARTIAL: i32 = 3;

fn main() {
    gateway::process::init();
    let cli = Cli::parse();
    if !cli.models.load_options().attention.supported() {
        eprintln!("error: --attention bf16 needs a CPU with AVX-512 BF16; this one has none");
        std::process::exit(2);
    }
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        // 2 when the caller is at fault (as clap's usage errors), 1 for internal faults.
        let caller = gateway::Fault::of_chain(e.as_ref()) != gateway::Fault::Internal;
        std::process::exit(if caller { 2 } else { 1 });
    }
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
        Cmd::Models(ModelsCmd::Fetch { skip_large }) => fetch::fetch_defaults(skip_large),
        Cmd::Models(ModelsCmd::List) => tools::list_models(),
        Cmd::Generate(a) => tools::generate(m, a),
        Cmd::Tokenize(a) => tools::tokenize(m, a),
        Cmd::Bench(BenchCmd::Blend(a)) => bench::blend_cmd(m, a),
        Cmd::Bench(BenchCmd::Long(a)) => long::long_cmd(m, a),
        Cmd::Bench(BenchCmd::Overlap(a)) => overlap::overlap_cmd(m, a),
        Cmd::Bench(BenchCmd::Prefill(a)) => bench::prefill_cmd(m, a),
    }
}

/// Loads one model with a spinner, as the model flags say (`--candle-k-quants`,
/// `--attention`).
fn load(path: &Path, m: &ModelArgs) -> anyhow::Result<Model> {
    let spinner = spinner(format!("loading {}", path.display()));
    let opts = m.load_options();
    let m = Model::load(path, &opts).with_context(|| format!("loading {}", path.display()))?;
    gateway::process::release_free_memory();
    spinner.finish_and_clear();
    Ok(m)
}

/// A spinner on stderr that ticks on its own.
fn spinner(message: String) -> ProgressBar {
    let bar = ProgressBar::new_spinner();
    bar.set_message(message);
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    bar
}

/// The target the flags (or the default) name.
fn load_target(m: &ModelArgs) -> anyhow::Result<Model> {
    load(&m.target_path()?, m)
}

/// The speculator the flags (or defaults) name.
fn load_speculator(m: &ModelArgs) -> anyhow::Result<Model> {
    load(&m.speculator_path()?, m)
}

/// The target and the speculator the flags (or defaults) name.
fn load_pair(m: &ModelArgs) -> anyhow::Result<(Model, Arc<Model>)> {
    let target = load_target(m)?;
    let spec = load_speculator(m)?;
    Ok((target, Arc::new(spec)))
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
    let engines = if with_speculator {
        let (target, spec) = load_pair(m)?;
        Engines::new(Arc::new(target), Some(spec))?
    } else {
        Engines::new(Arc::new(load_target(m)?), None)?
    };
    let corpus = Corpus::open_with(data, memory_bytes, store)
        .with_context(|| format!("opening data directory {}", data.display()))?;
    Ok(Pipeline::new(engines, corpus, scores))
}
