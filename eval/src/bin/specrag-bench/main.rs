//! `specrag-bench`: the measurements behind docs/performance.md and docs/long-context.md,
//! apart from the `specrag` binary an operator runs. `bench` times prefill, decode and the
//! blended prefill against full prefill; `batch` what batching decode steps buys; `long` decodes over long contexts of stored chunk KV
//! with each long-context drafter; `overlap` compares the selectors' picks (SpecCache Fig. 3).

mod args;
mod batch;
mod bench;
mod long;
mod overlap;

use args::{BenchCmd, Cli};
use clap::Parser;

fn main() {
    gateway::process::init();
    let cli = Cli::parse();
    gateway::cli::refuse_unsupported_attention(&cli.models);
    let m = &cli.models;
    gateway::cli::exit_on_error(match cli.command {
        BenchCmd::Batch(a) => batch::batch_cmd(m, a),
        BenchCmd::Blend(a) => bench::blend_cmd(m, a),
        BenchCmd::Long(a) => long::long_cmd(m, a),
        BenchCmd::Overlap(a) => overlap::overlap_cmd(m, a),
        BenchCmd::Prefill(a) => bench::prefill_cmd(m, a),
    });
}
