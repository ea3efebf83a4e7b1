//! `specrag-eval`: quality, fidelity and latency of every reuse method, and goodput under
//! Poisson load through the real server. Writes `results.json`, `report.md` and SVG charts to
//! `--out`.

use clap::Parser;
use eval::plan::PairingName;
use std::path::PathBuf;

mod cli;
mod default_run;
mod study_cmd;

/// Evaluate every KV-reuse method: quality against gold answers, fidelity to full recompute,
/// TTFT and its parts, and goodput under Poisson arrivals through the real server.
///
/// Cases: seeded multi-hop "bridge entity" questions (the answer needs a link across two
/// chunks among distractors) and needle-in-a-haystack at several lengths and depths, generated
/// here (nothing is downloaded); add LongBench-format JSONL with --longbench and your own
/// `{"query","answers","collection"?}` JSONL against an ingested data directory with --queries.
///
/// Methods: full_recompute (the reference), full_reuse, prefix, EPIC (k = 16, 32 and at each
/// ρ), CacheBlend, SpecCache, SpecCache without spans and target_probe (the server's) at ρ in
/// {0.10, 0.15, 0.20, 0.25}, SpecCache's layer-range ablation and ingestion-time scores;
/// pairings SmolLM2 -> Qwen-0.5B (`small`) and Qwen-0.5B -> Qwen-1.5B (`large`, fewer cases
/// and ρ = 0.15 only). The fidelity study (--study) is the larger, paired evaluation.
///
/// The default run takes ~30 minutes on 2 cores; --quick (~1.5 minutes) is the smoke run CI
/// executes. The exit code is 1 when a ρ = 1 configuration did not answer exactly as full
/// recompute (the report is written first), 2 on an error.
#[derive(Parser, Debug)]
#[command(name = "specrag-eval", version)]
struct Args {
    /// Folder for results.json, report.md and the SVG charts (created if missing).
    #[arg(long, value_name = "DIR", default_value = "eval-results")]
    out: PathBuf,
    /// How the chunk KV of the run is stored (`raw`, `lossless`, `int8`, `int4`): run once
    /// per codec to measure what the lossy ones cost against exact storage. In a --study, the
    /// rows of a non-raw run are labelled `method@ρ+codec` and the report pairs each with the
    /// same method on raw storage (resume the same --out once per codec).
    #[arg(long, value_name = "CODEC", default_value = "raw")]
    kv_codec: chunkstore::Codec,
    /// Run nothing: rewrite report.md and the charts in --out from this results.json (of any
    /// earlier run), e.g. after a change to the report's layout. With --study: write study.md
    /// in --out from this study.jsonl (several runs' files may be concatenated into one).
    #[arg(long, value_name = "FILE")]
    render: Option<PathBuf>,
    /// The smoke run: 3 synthetic cases, every method at ρ = 0.15, the ρ = 1 identity check, a
    /// short load test; small pairing only.
    #[arg(long)]
    quick: bool,
    /// Pairings to run: `small` (SmolLM2 -> Qwen-0.5B), `large` (Qwen-0.5B -> Qwen-1.5B).
    /// [default: small,large; with --quick: small]
    #[arg(long, value_delimiter = ',', value_name = "NAMES", value_enum)]
    pairings: Vec<PairingName>,
    /// Seed of the synthetic cases and the arrival times.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Data directory the cases are ingested into, one subfolder per pairing (`small`,
    /// `large`) [default: a temporary one, removed after].
    #[arg(long, value_name = "DIR")]
    data: Option<PathBuf>,
    /// Leave out the generated bridge and needle cases (run only --datasets / --longbench /
    /// --queries).
    #[arg(long)]
    no_synthetic: bool,
    /// Skip the Poisson load test.
    #[arg(long)]
    no_load: bool,
    /// LongBench-format JSONL (`input`, `context`, `answers`, `_id`?); repeatable. Each context
    /// is ingested as one document, chunked by --chunk-tokens, and the top --top-k chunks are
    /// read in document order.
    #[arg(long, value_name = "FILE")]
    longbench: Vec<PathBuf>,
    /// Real-text datasets committed in eval/data (eval/data/README.md): `hotpotqa`,
    /// `2wikimqa`, `musique` (multi-hop QA, each passage a document) and `repo_docs` (questions on this
    /// repository's docs, over the demo corpus). Retrieved as the server does (top 4 by BM25,
    /// 512-token chunks); --limit caps each, --max-tokens bounds the answers.
    #[arg(long, value_delimiter = ',', value_name = "NAMES",
          value_parser = clap::builder::PossibleValuesParser::new(eval::real::NAMES))]
    datasets: Vec<String>,
    /// `{"query","answers","collection"?}` JSONL, run against --queries-data.
    #[arg(long, value_name = "FILE", requires = "queries_data")]
    queries: Option<PathBuf>,
    /// Data directory (from `specrag ingest`) the --queries run against.
    #[arg(long, value_name = "DIR")]
    queries_data: Option<PathBuf>,
    /// Collection of --queries lines that name none.
    #[arg(long, default_value = "default")]
    collection: String,
    /// At most this many cases of each --longbench / --queries file.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    limit: Option<u32>,
    /// Chunks retrieved per question of --longbench / --queries.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=64))]
    top_k: u16,
    /// Most target tokens per chunk when ingesting --longbench contexts.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(16..=4096))]
    chunk_tokens: u32,
    /// Most generated tokens per answer of --longbench / --queries.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=1024))]
    max_tokens: u32,
    /// Target of the small pairing [default: $SPECRAG_MODELS/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf]
    #[arg(long, env = "SPECRAG_TARGET", value_name = "PATH")]
    target: Option<PathBuf>,
    /// Speculator of the small pairing [default: $SPECRAG_MODELS/smollm2-135m-instruct-q4_1.gguf]
    #[arg(long, env = "SPECRAG_SPECULATOR", value_name = "PATH")]
    speculator: Option<PathBuf>,
    /// The fidelity study instead of the default run: profile and record cases; the bounds
    /// (oracle, random), the default and the baselines at ρ = 0.15 on every case, the other
    /// methods and a ρ sweep on the first --sweep-cases,
    /// paired against full recompute; appends to <out>/study.jsonl a case at a time and
    /// writes <out>/study.md. --pairings defaults to small here.
    #[arg(long)]
    study: bool,
    /// Continue the study.jsonl in --out (cases already answered are skipped).
    #[arg(long, requires = "study")]
    resume: bool,
    /// Study cases per dataset with the small pairing.
    #[arg(long, default_value_t = 200, requires = "study")]
    study_cases: usize,
    /// Study cases per dataset with the large pairing.
    #[arg(long, default_value_t = 60, requires = "study")]
    study_large_cases: usize,
    /// Study cases (the first of each dataset) that also run the ρ sweep.
    #[arg(long, default_value_t = 40, requires = "study")]
    sweep_cases: usize,
    /// Run only these study configurations (labels such as `target_probe@0.15,epic@0.15`; full
    /// recompute, the reference, always runs) [default: all]. Those outside the main set (the
    /// sweep's) still run on the first --sweep-cases cases only.
    #[arg(long, value_delimiter = ',', requires = "study")]
    study_configs: Vec<String>,
    /// Run only these study datasets: `profiles`, `records` (synthetic) and the real-text
    /// `hotpotqa`, `2wikimqa`, `musique`, `repo_docs` (see --datasets; at most --study-cases of
    /// each)
    /// [default: profiles, records].
    #[arg(long, value_delimiter = ',', requires = "study")]
    study_datasets: Vec<String>,
    /// The configuration the study report compares with every baseline, head to head.
    #[arg(long, default_value = "target_probe@0.15", requires = "study")]
    study_best: String,
    /// Ask every study configuration (but full recompute and the bounds) once more with
    /// `verify: true`: the report gains the drafts' acceptance per configuration and checks
    /// that every verified answer equals full recompute's (costs one full prefill per case).
    #[arg(long, requires = "study")]
    study_verify: bool,
    /// How `--study-verify` decodes once the full cache is ready, as the server's
    /// `--verify-mode`: `full` (the server's default) drafts only while the full prefill runs,
    /// so how many drafts are checked depends on the machine's speed; `draft-every-N` keeps
    /// drafting N tokens ahead to the end, so acceptance covers the whole answer.
    #[arg(long, default_value = "full", requires = "study_verify")]
    study_verify_mode: target_engine::VerifyMode,
    /// Skip the first N cases of every study dataset (a held-out slice: calibrate the guard
    /// on the first cases, confirm it on the next).
    #[arg(long, default_value_t = 0, requires = "study")]
    study_skip: usize,
    /// In which order retrieved chunks enter the study's prompts (datasets read in document
    /// order keep it): `rank` (best BM25 score first) or `longest-first` (the chunk with the
    /// most tokens first, the rest by rank) [default: each dataset's own: the server's
    /// default, longest-first, for the real-text sets; rank for the synthetic ones].
    #[arg(long, value_enum, requires = "study")]
    study_order: Option<gateway::pipeline::ChunkOrder>,
    /// The fidelity guard's margin for `:balanced` study configurations (as `specrag serve
    /// --guard-margin`) [default: each method's own].
    #[arg(long)]
    guard_margin: Option<f32>,
    /// The fidelity guard's horizon for `:balanced` study configurations (as `specrag serve
    /// --guard-horizon`).
    #[arg(long, default_value_t = gateway::fidelity::DEFAULT_GUARD_HORIZON)]
    guard_horizon: usize,
    /// The fidelity guard's phrasing horizon for `:balanced` study configurations (as
    /// `specrag serve --guard-phrasing-horizon`).
    #[arg(long, default_value_t = gateway::fidelity::DEFAULT_GUARD_PHRASING_HORIZON)]
    guard_phrasing_horizon: usize,
    /// The fidelity guard's second look for `:balanced` study configurations (as `specrag
    /// serve --guard-second-look`; 0: escalate at once).
    #[arg(long, default_value_t = gateway::fidelity::DEFAULT_GUARD_SECOND_LOOK)]
    guard_second_look: f64,
    /// The gap a second look must choose the doubted token by for `:balanced` study
    /// configurations (as `specrag serve --guard-confirm-gap`).
    #[arg(long, default_value_t = gateway::fidelity::DEFAULT_GUARD_CONFIRM_GAP)]
    guard_confirm_gap: f32,
    /// The most a second look may narrow the doubted token's gap and keep it for `:balanced`
    /// study configurations (as `specrag serve --guard-look-narrowing`).
    #[arg(long, default_value_t = gateway::fidelity::DEFAULT_GUARD_LOOK_NARROWING)]
    guard_look_narrowing: f32,
    /// The most second looks a request takes under the guard (`:balanced`) in study
    /// configurations (as `specrag serve --guard-looks`).
    #[arg(long, default_value_t = gateway::fidelity::DEFAULT_GUARD_LOOKS,
          value_parser = clap::value_parser!(u32).range(1..))]
    guard_looks: u32,
    /// Which chunk tokens the second look recomputes for `:balanced` study configurations
    /// that do not name one (as `specrag serve --guard-look`).
    #[arg(long, value_enum, default_value_t = gateway::fidelity::LookRows::default())]
    guard_look: gateway::fidelity::LookRows,
    /// The estimated cost of an escalation after a second look above which `:balanced`
    /// study configurations escalate at once (as `specrag serve --guard-look-cost`).
    #[arg(long, default_value_t = gateway::fidelity::DEFAULT_GUARD_LOOK_COST)]
    guard_look_cost: f64,
    /// Run nothing: print the fidelity guard's operating curve (identity with full recompute,
    /// escalations, TTFT and cost ÷ full recompute's per margin threshold, per dataset) from
    /// this study.jsonl's rows of --guard-curve-label, watching --guard-horizon tokens (a
    /// `.gz` file is read as is: the committed records under eval/study/).
    #[arg(long, value_name = "FILE")]
    guard_curve: Option<PathBuf>,
    /// The reused (`fast`) configuration --guard-curve guards.
    #[arg(long, default_value = "target_probe_shift@0.25")]
    guard_curve_label: String,
    /// Target of the large pairing (its speculator is the small pairing's target)
    /// [default: $SPECRAG_MODELS/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf]
    #[arg(long, value_name = "PATH")]
    large_target: Option<PathBuf>,
}

fn main() {
    gateway::process::init();
    if let Err(e) = gateway::process::attention_from_env() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
    let args = Args::parse();
    let run = if let Some(from) = &args.guard_curve {
        study_cmd::guard_curve(from, &args.guard_curve_label, args.guard_horizon)
    } else if args.study {
        match &args.render {
            Some(from) => study_cmd::render(from, &args.out, &args.study_best),
            None => study_cmd::run(&args),
        }
    } else {
        default_run::run_all(args)
    };
    match run {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    }
}
