//! `specrag-bench`'s command line: the model flags (`gateway::cli::ModelArgs`, as `specrag`'s)
//! and one subcommand per measurement.

use clap::{Args, Parser, Subcommand, ValueEnum};
use gateway::cli::ModelArgs;
use std::path::PathBuf;

/// specrag-bench: speed measurements of specrag's engine (prefill and decode, blended
/// prefill against full prefill, long-context decoding) and the selectors' overlap.
#[derive(Parser, Debug)]
#[command(version, long_about = None)]
pub struct Cli {
    #[command(flatten)]
    pub models: ModelArgs,
    #[command(subcommand)]
    pub command: BenchCmd,
}

#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// Prefill tokens/s at several lengths and decode ms/token, for the target and the
    /// speculator (one JSON object per model and line with --json).
    Prefill(PrefillArgs),
    /// Blended prefill vs full prefill on the target: 4 chunks x 512 tokens and a question,
    /// every baseline selector at each ratio, chunk KV precomputed after the prefix and
    /// standalone; times relative to full prefill in the same run, plus KL from full prefill.
    Blend(BlendArgs),
    /// Jaccard overlap of the top chunk tokens chosen by the speculator's deep layers, the
    /// target's deep layers and the target's first layer (SpecCache Fig. 3), per prompt and on
    /// average. Run it once per pairing, e.g. `--target models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
    /// --speculator models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf` for the in-family pairing.
    Overlap(OverlapArgs),
    /// Decoding over long contexts of real chunks (an ingested collection's stored KV, reused
    /// as is): ms per token of full attention, and of each long-context drafter verified
    /// against it (SpeCache: top-k rows chosen on low-bit keys; a StreamingLLM window), with
    /// the check that every verified answer is full attention's, token for token. `--quality`
    /// adds the drafters' unverified answers and teacher-forced KL, and KIVI 2-bit alone.
    /// Example: `specrag-bench long --data DATA --contexts 8192,16384,32000 --quality`.
    Long(LongArgs),
    /// Decode steps of several requests in one pass over the target's weights (what
    /// `specrag serve --max-batch` runs): time per pass and tokens/s for each number of
    /// requests, against one request alone in the same run, and whether every request's
    /// logits were its own alone. Example: `specrag-bench batch --requests 1,2,4,8`.
    Batch(BatchArgs),
}

#[derive(Args, Debug)]
pub struct BatchArgs {
    /// Numbers of requests decoding together (the first is the baseline; put 1 first).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8", value_parser = clap::value_parser!(u32).range(1..=64))]
    pub requests: Vec<u32>,
    /// Context tokens every request decodes after (this repository's docs).
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u32).range(1..=32768))]
    pub context: u32,
    /// Decode steps per measurement (the median pass is reported).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub steps: u64,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct PrefillArgs {
    /// Prompt lengths in tokens.
    #[arg(long, value_delimiter = ',', default_value = "256,512,1024,2048", value_parser = clap::value_parser!(u32).range(1..))]
    pub lengths: Vec<u32>,
    /// Runs per length (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Decode steps after a 512-token prefill (the median is reported).
    #[arg(long, default_value_t = 32)]
    pub decode_steps: usize,
    /// Only the target model.
    #[arg(long)]
    pub target_only: bool,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

/// Where the chunk KV of `bench blend` is precomputed.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
#[value(rename_all = "snake_case")]
pub enum BenchMode {
    /// After the template prefix (what `specrag ingest` stores; the first chunk is exact).
    AfterPrefix,
    /// Each chunk alone from position 0 (every chunk inexact).
    Standalone,
}

impl BenchMode {
    /// The name reports print.
    pub fn name(self) -> &'static str {
        match self {
            Self::AfterPrefix => "after_prefix",
            Self::Standalone => "standalone",
        }
    }
}

#[derive(Args, Debug)]
pub struct BlendArgs {
    /// Number of chunks.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub chunks: u32,
    /// Tokens per chunk.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub chunk_tokens: u32,
    /// Recompute ratios for the budgeted selectors (each in 0..=1).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0.05,0.10,0.15,0.25,0.40",
        value_parser = parse_ratio
    )]
    pub ratios: Vec<f64>,
    /// Runs per measurement (median reported).
    #[arg(long, default_value_t = 1)]
    pub reps: usize,
    /// Chunk KV precompute modes to measure.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "after_prefix,standalone",
        value_enum
    )]
    pub modes: Vec<BenchMode>,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct LongArgs {
    /// Data directory of an ingested collection (`specrag ingest ... --data DIR`).
    #[arg(long)]
    pub data: PathBuf,
    /// Collection whose chunks fill the contexts.
    #[arg(long, default_value = "default")]
    pub collection: String,
    /// Context lengths in tokens (each at most the target's context length minus the answer).
    #[arg(long, value_delimiter = ',', default_value = "8192,16384,32000", value_parser = clap::value_parser!(u32).range(64..))]
    pub contexts: Vec<u32>,
    /// Questions (one context per question and length, chunks taken from a different offset
    /// for each).
    #[arg(
        long = "question",
        default_values_t = [
            String::from("Summarize what these documents say about storing chunk KV."),
            String::from("Which command ingests documents, and what does it report?"),
        ]
    )]
    pub questions: Vec<String>,
    /// Greedy answer tokens per case.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub max_tokens: u64,
    /// SpeCache: rows chosen per kv head and layer.
    #[arg(long, default_value_t = 1024)]
    pub top_k: usize,
    /// SpeCache: recent rows always attended.
    #[arg(long, default_value_t = 128)]
    pub window: usize,
    /// SpeCache: bits per value of the low-bit keys (2 or 4).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(2..=4))]
    pub bits: u32,
    /// SpeCache: score positions only in the blocks (32 positions each) whose bound is among
    /// the best `prefilter * top_k` positions' worth; 0 scores every position.
    #[arg(long, default_value_t = 4)]
    pub prefilter: usize,
    /// SpeCache: the first layers attend to every row (measured: no gain at 32k).
    #[arg(long, default_value_t = 0)]
    pub full_layers: usize,
    /// A round ends (is verified) after a draft the drafter gave less probability than this.
    #[arg(long, default_value_t = 0.0)]
    pub min_prob: f32,
    /// SpeContext, embedding head: the speculator's layer whose norm and Q/K projections
    /// score the context from the token embedding alone [default: 3, the best measured for
    /// the 0.5B speculator, or the speculator's last layer if it has fewer].
    #[arg(long)]
    pub retrieval_layer: Option<usize>,
    /// SpeContext, contextual head: the speculator's layer whose attention (its layers up
    /// to it run on its own cache of the context) chooses the rows [default: 14, or the
    /// speculator's last layer if it has fewer].
    #[arg(long)]
    pub context_layer: Option<usize>,
    /// SpeContext's memory model: rows resident per kv head (its `top_k`) sized to this many
    /// MiB for each context (the retrieval head's keys included) instead of `--top-k`.
    #[arg(long)]
    pub resident_mb: Option<u64>,
    /// Prompt lookup's shortest match that drafts (the `lookup` row).
    #[arg(long, default_value_t = target_engine::PromptLookup::MIN_N, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=16))]
    pub lookup_min_n: usize,
    /// Leave SpeContext out (no speculator loaded).
    #[arg(long)]
    pub no_speculator: bool,
    /// Measure only the drafters whose name starts with this (repeatable: `specache`,
    /// `window`, `specontext`, `specontext-ctx`, ...); all of them by default.
    #[arg(long = "drafter")]
    pub drafter_names: Vec<String>,
    /// Also measure unverified quality (answers and teacher-forced KL), with KIVI 2-bit.
    #[arg(long)]
    pub quality: bool,
    /// One JSON object per case and line.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct OverlapArgs {
    /// Number of prompts (each: chunks of the project's documentation and a question).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub prompts: u32,
    /// Chunks per prompt.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    pub chunks: u32,
    /// Maximum tokens per chunk.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    pub chunk_tokens: u32,
    /// Fraction of chunk tokens in each top set (0 < f <= 1).
    #[arg(long, default_value_t = 0.2, value_parser = parse_top_fraction)]
    pub top: f64,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

/// `s` as a number in the range `ok` accepts; the error names `what` and `range`.
fn number_in(s: &str, ok: impl Fn(f64) -> bool, what: &str, range: &str) -> Result<f64, String> {
    let x: f64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if ok(x) {
        Ok(x)
    } else {
        Err(format!("{what} must lie in {range}, got {x}"))
    }
}

/// A share of tokens in `0..=1`.
fn parse_ratio(s: &str) -> Result<f64, String> {
    number_in(s, |r| (0.0..=1.0).contains(&r), "a ratio", "0..=1")
}

/// A fraction in `(0, 1]`.
fn parse_top_fraction(s: &str) -> Result<f64, String> {
    number_in(s, |r| r > 0.0 && r <= 1.0, "the fraction", "(0, 1]")
}
