//! The model flags every command-line tool shares (`specrag`, `specrag-bench`): which GGUF
//! files load and how, and the loaders behind them (a spinner while a model loads).

use crate::models::Role;
use anyhow::Context;
use clap::{Args, ValueEnum};
use indicatif::ProgressBar;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use target_engine::Model;

/// Which GGUF files to load (any qwen2 or llama GGUF works).
#[derive(Args, Debug)]
pub struct ModelArgs {
    /// Which default models load when --target / --speculator are not given: `large` =
    /// Qwen2.5-Coder-0.5B -> Qwen2.5-Coder-1.5B (the default: on 80 record questions its
    /// answers with the default method are right 80% of the time against 49% for `small`),
    /// `small` = SmolLM2-135M -> Qwen2.5-Coder-0.5B (~2.5x faster, 0.6 instead of 1.4 GB of
    /// files)
    #[arg(
        long,
        global = true,
        env = "SPECRAG_PAIRING",
        value_enum,
        default_value_t = Pairing::Large
    )]
    pub pairing: Pairing,
    /// Target model GGUF file [default: $SPECRAG_MODELS/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf,
    /// with --pairing small qwen2.5-coder-0.5b-instruct-q4_k_m.gguf]
    #[arg(
        long,
        global = true,
        env = "SPECRAG_TARGET",
        visible_alias = "model",
        value_name = "PATH"
    )]
    pub target: Option<PathBuf>,
    /// Speculator model GGUF file [default: $SPECRAG_MODELS/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf,
    /// with --pairing small smollm2-135m-instruct-q4_1.gguf]
    #[arg(long, global = true, env = "SPECRAG_SPECULATOR", value_name = "PATH")]
    pub speculator: Option<PathBuf>,
    /// Run Q4_K/Q6_K weights on candle's kernels instead of specrag's packed int8 GEMM (the
    /// default with AVX-512 VNNI or AVX2). candle keeps its own repacked copy beside the file's bytes:
    /// 2.89 instead of 1.57 GB peak for the 1.5B target, decode ~1.4x the time, prefill within
    /// noise (docs/performance.md)
    #[arg(long, global = true, env = "SPECRAG_CANDLE_K_QUANTS")]
    pub candle_k_quants: bool,
    /// Precision of the attention products: `f32`, or `bf16` (CPUs with AVX-512 BF16 only,
    /// refused elsewhere): queries, keys, probabilities and values rounded to bfloat16 and
    /// accumulated in f32, in heads 64 or 128 wide (other heads stay f32); faster attention at
    /// a small cost in precision, both measured in docs/performance.md (*bf16 attention*). The
    /// precision is part of the model's fingerprint, which every stored chunk key holds: KV
    /// stored at one precision is never read at the other, so serving at another precision
    /// than the ingestion's recomputes every eagerly ingested chunk at its first retrieval
    /// (`specrag serve` warns at startup when it finds such KV). Ingest and serve at one precision
    #[arg(
        long,
        global = true,
        env = "SPECRAG_ATTENTION",
        value_enum,
        default_value = "f32"
    )]
    pub attention: Attention,
    /// Where the target runs for serve, ingest, query and demo: `cpu` (the CPU engine, the
    /// default: every method, the bit-exact reference), `cuda` or `cuda:N` (the device engine
    /// on a GPU, a `--features cuda` build: docs/gpu.md), or `candle-cpu` (the device engine on
    /// candle's CPU device: slow, for checking the device path without a GPU). The device
    /// engine runs target_probe_shift (the default), target_probe, target_probe_span, epic,
    /// prefix, full_reuse and full_recompute, the fidelity guard, verification and sampling;
    /// other methods, speculative and long-context drafting are refused on it. Chunk KV is
    /// stored per engine: ingest on the device you serve on
    #[arg(
        long,
        global = true,
        env = "SPECRAG_DEVICE",
        default_value = "cpu",
        value_name = "DEVICE",
        value_parser = parse_device_flag
    )]
    pub device: String,
    /// How the device engine keeps the target's weights: `bf16` (dequantized once at load,
    /// dense bf16 GEMMs with f32 accumulation: prefill at the tensor cores' pace) or
    /// `quantized` (the file's blocks: the least memory). Ignored with --device cpu
    #[arg(
        long,
        global = true,
        env = "SPECRAG_DEVICE_WEIGHTS",
        default_value = "bf16",
        value_name = "WEIGHTS",
        value_parser = parse_device_weights
    )]
    pub device_weights: target_engine::device::DeviceWeights,
    /// How the device engine attends: `auto` (the fused kernels on a GPU where they pass their
    /// check at load, else candle ops), `fused` (one kernel a layer: f16 products on tensor
    /// cores with f32 accumulation, no score matrix in memory; an error where its check
    /// fails) or `ops` (candle ops, f32 score matrices). Chunk KV is stored per attention:
    /// ingest with the one you serve with. Ignored with --device cpu
    #[arg(
        long,
        global = true,
        env = "SPECRAG_DEVICE_ATTENTION",
        value_enum,
        default_value = "auto",
        value_name = "ATTENTION"
    )]
    pub device_attention: DeviceAttentionFlag,
    /// Device memory that keeps recently placed chunk KV on the GPU (f16, least recently used
    /// out first), so a retrieved chunk held there is copied on the device instead of
    /// uploaded from host memory. 0 (the default) keeps none. Taken from the default
    /// --kv-memory-budget's share of the GPU. Ignored with --device cpu. A number with an
    /// optional unit: B, KB, MB, GB, TB or KiB, MiB, GiB, TiB
    #[arg(
        long,
        global = true,
        env = "SPECRAG_DEVICE_HOT_CHUNKS",
        default_value = "0",
        value_name = "SIZE",
        value_parser = parse_size
    )]
    pub device_hot_chunks: u64,
    /// Host memory, page-locked, that keeps recently placed chunk KV (f16, least recently
    /// used out first), so a retrieved chunk held there uploads at the bus's speed instead of
    /// through the driver's staging of ordinary memory. 0 (the default) keeps none. Locked
    /// host memory is not counted in --kv-memory-budget. Ignored with --device cpu. A
    /// number with an optional unit: B, KB, MB, GB, TB or KiB, MiB, GiB, TiB
    #[arg(
        long,
        global = true,
        env = "SPECRAG_DEVICE_PINNED_CHUNKS",
        default_value = "0",
        value_name = "SIZE",
        value_parser = parse_size
    )]
    pub device_pinned_chunks: u64,
}

/// A byte count: a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        other => {
            return Err(format!(
                "`{other}` is not a unit: B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
            ))
        }
    };
    match num.parse::<f64>() {
        Ok(n) if n.is_finite() && n >= 0.0 && n * (scale as f64) < 1.8e19 => {
            Ok((n * scale as f64).round() as u64)
        }
        _ => Err(format!("{s:?} is not a size such as 8GiB or 500MB")),
    }
}

/// `--device`: `cpu`, `cuda`, `cuda:N` or `candle-cpu`.
pub fn parse_device_flag(s: &str) -> Result<String, String> {
    let ok = matches!(s, "cpu" | "cuda" | "candle-cpu")
        || s.strip_prefix("cuda:")
            .is_some_and(|n| n.parse::<usize>().is_ok());
    if ok {
        Ok(s.to_string())
    } else {
        Err(format!("`{s}`: expected cpu, cuda, cuda:N or candle-cpu"))
    }
}

/// `--device-attention`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceAttentionFlag {
    /// The engine's choice: the fused kernels on a GPU where they pass their check.
    Auto,
    /// One kernel a layer; an error where its check fails.
    Fused,
    /// candle ops.
    Ops,
}

impl DeviceAttentionFlag {
    /// The attention it asks for; `None` leaves the engine's choice.
    pub fn asked(self) -> Option<target_engine::device::DeviceAttention> {
        use target_engine::device::DeviceAttention;
        match self {
            Self::Auto => None,
            Self::Fused => Some(DeviceAttention::Fused),
            Self::Ops => Some(DeviceAttention::Ops),
        }
    }
}

/// `--device-weights`: `bf16` or `quantized`.
pub fn parse_device_weights(s: &str) -> Result<target_engine::device::DeviceWeights, String> {
    s.parse()
        .map_err(|e: target_engine::EngineError| e.to_string())
}

/// `--attention`: the precision of the attention products.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attention {
    /// f32 products (the default, and what every measurement in docs/ used unless it says).
    F32,
    /// bfloat16 products accumulated in f32 (AVX-512 BF16 CPUs only).
    Bf16,
}

/// The default target/speculator pairs (docs/usage.md, *Models*).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pairing {
    /// Qwen2.5-Coder-0.5B -> Qwen2.5-Coder-1.5B.
    Large,
    /// SmolLM2-135M -> Qwen2.5-Coder-0.5B.
    Small,
}

impl ModelArgs {
    /// How every model a command loads is loaded: `--candle-k-quants` and `--attention`.
    pub fn load_options(&self) -> target_engine::LoadOptions {
        target_engine::LoadOptions {
            pack_k_quants: !self.candle_k_quants,
            attention: match self.attention {
                Attention::F32 => kernels::AttentionPrecision::F32,
                Attention::Bf16 => kernels::AttentionPrecision::Bf16,
            },
            ..target_engine::LoadOptions::default()
        }
    }

    /// The default roles of the target and the speculator under `--pairing`.
    fn roles(&self) -> (Role, Role) {
        match self.pairing {
            Pairing::Large => (Role::LargeTarget, Role::Target),
            Pairing::Small => (Role::Target, Role::Speculator),
        }
    }

    /// The target's file: `--target`, else the pairing's default.
    pub fn target_path(&self) -> anyhow::Result<PathBuf> {
        crate::models::resolve_for(self.target.as_deref(), self.roles().0, "--target")
    }

    /// The speculator's file: `--speculator`, else the pairing's default.
    pub fn speculator_path(&self) -> anyhow::Result<PathBuf> {
        crate::models::resolve_for(self.speculator.as_deref(), self.roles().1, "--speculator")
    }
}

/// Loads one model with a spinner, as the model flags say (`--candle-k-quants`,
/// `--attention`).
pub fn load(path: &Path, m: &ModelArgs) -> anyhow::Result<Model> {
    let spinner = spinner(format!("loading {}", path.display()));
    let opts = m.load_options();
    let m = Model::load(path, &opts).with_context(|| format!("loading {}", path.display()))?;
    crate::process::release_free_memory();
    spinner.finish_and_clear();
    Ok(m)
}

/// A spinner on stderr that ticks on its own.
pub fn spinner(message: String) -> ProgressBar {
    let bar = ProgressBar::new_spinner();
    bar.set_message(message);
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    bar
}

/// The target the flags (or the default) name, on the CPU engine: for the commands that run
/// on it only, which refuse another `--device` rather than ignore it.
pub fn load_target(m: &ModelArgs) -> anyhow::Result<Model> {
    if m.device != "cpu" {
        anyhow::bail!(
            "--device {}: this command runs on the CPU engine; --device applies to serve, \
             ingest, query and demo",
            m.device
        );
    }
    load(&m.target_path()?, m)
}

/// The target serve, ingest, query and demo answer with: on the CPU engine, or with
/// `--device` on the device engine (its weights as `--device-weights` says).
pub fn load_served_target(m: &ModelArgs) -> anyhow::Result<crate::target::Target> {
    if m.device == "cpu" {
        return Ok(crate::target::Target::Cpu(Arc::new(load_target(m)?)));
    }
    let path = m.target_path()?;
    let spec = if m.device == "candle-cpu" {
        "cpu"
    } else {
        &m.device
    };
    let device = target_engine::device::parse_device(spec)?;
    let spinner = spinner(format!(
        "loading {} onto {} ({} weights)",
        path.display(),
        m.device,
        m.device_weights.name()
    ));
    let mut model = target_engine::device::DeviceModel::load_with(&path, &device, m.device_weights)
        .with_context(|| format!("loading {} onto {}", path.display(), m.device))?;
    if let Some(attention) = m.device_attention.asked() {
        model
            .set_attention(attention)
            .with_context(|| format!("--device-attention {}", attention.name()))?;
    }
    use target_engine::device::ChunkTier;
    model.set_chunk_tier(ChunkTier::Device, m.device_hot_chunks);
    model.set_chunk_tier(ChunkTier::Pinned, m.device_pinned_chunks);
    crate::process::release_free_memory();
    spinner.finish_and_clear();
    Ok(crate::target::Target::Device(Arc::new(model)))
}

/// The speculator the flags (or defaults) name.
pub fn load_speculator(m: &ModelArgs) -> anyhow::Result<Model> {
    load(&m.speculator_path()?, m)
}

/// The target and the speculator the flags (or defaults) name.
pub fn load_pair(m: &ModelArgs) -> anyhow::Result<(Model, Arc<Model>)> {
    let target = load_target(m)?;
    let spec = load_speculator(m)?;
    Ok((target, Arc::new(spec)))
}

/// Refuses `--attention bf16` on a CPU without AVX-512 BF16 before any work (exit 2).
pub fn refuse_unsupported_attention(m: &ModelArgs) {
    if !m.load_options().attention.supported() {
        eprintln!("error: --attention bf16 needs a CPU with AVX-512 BF16; this one has none");
        std::process::exit(2);
    }
}

/// Ends a command-line tool on `r`: an error is printed with its causes and exits 2 when the
/// caller is at fault (as clap's usage errors), 1 for internal faults.
pub fn exit_on_error(r: anyhow::Result<()>) {
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        let caller = crate::Fault::of_chain(e.as_ref()) != crate::Fault::Internal;
        std::process::exit(if caller { 2 } else { 1 });
    }
}
