//! Process setup shared by the `specrag` and `specrag-eval` binaries.

/// candle's setting of its worker pool's busy-wait length.
const SPIN_LIMIT_VAR: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";
/// Measured best on both default targets (see [`init`]).
const DEFAULT_SPIN_LIMIT: &str = "1000";

/// Allocator tuning, then logging to stderr filtered by `RUST_LOG` (default `warn`). Call it
/// first in `main`, before any thread is started.
///
/// Prefill allocates tens of megabytes per op; glibc serves each from a fresh mmap and returns
/// it on free, so every op pays page faults (~18% of prefill, measured).
/// Raising the mmap and trim thresholds keeps that memory in the heap for reuse. Those
/// thresholds hold for glibc's main arena only: a thread pool worker allocates from an arena of
/// its own, whose heaps are at most 64 MB, so a bigger buffer (the 1.5B's gate/up output at
/// 2048 rows: 73 MB) was a fresh mmap each time once the forward ran on the pool (its
/// 2048-token prefill 16 -> 19 s). One arena for the process keeps every allocation in the
/// tuned heap; the engine allocates per op, not per value, so the shared lock costs nothing
/// measurable.
///
/// candle's k-quant kernels run on its own thread pool, whose idle workers spin 25,000 times
/// before sleeping. On a target that mixes them with QMatrix's formats (Qwen-0.5B: `ffn_down`
/// only) that spin takes a core from the next layer's kernels after every candle op: decode
/// ran at 39.5 ms/token against 32 with a limit of 1000, which leaves the 1.5B (all k-quants)
/// unchanged (docs/performance.md). `CANDLE_BARRIER_POOL_SPIN_LIMIT` set by the user wins.
pub fn init() {
    if std::env::var_os(SPIN_LIMIT_VAR).is_none() {
        // Before any thread is started (candle's pool reads it when it starts).
        std::env::set_var(SPIN_LIMIT_VAR, DEFAULT_SPIN_LIMIT);
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; it runs before any thread is started.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        // Colour for a terminal only: a log file or a pipe gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// The environment variable choosing the attention's precision (`f32`, the default, or `bf16`).
pub const ATTENTION_VAR: &str = "SPECRAG_ATTENTION";

/// The attention precision [`ATTENTION_VAR`] names: `f32` (the default) or `bf16` (AVX-512
/// BF16 products, ~1.5-2x faster attention at 8-bit mantissas; docs/performance.md), for the
/// binaries to put into the `LoadOptions` of every model they load. An error names the variable
/// and what it accepts, or that this CPU cannot run bf16.
pub fn attention_from_env() -> Result<kernels::AttentionPrecision, String> {
    let p = match std::env::var(ATTENTION_VAR).as_deref() {
        Err(_) | Ok("" | "f32") => kernels::AttentionPrecision::F32,
        Ok("bf16") => kernels::AttentionPrecision::Bf16,
        Ok(other) => {
            return Err(format!(
                "{ATTENTION_VAR}: expected `f32` or `bf16`, got `{other}`"
            ))
        }
    };
    if !p.supported() {
        return Err(format!(
            "{ATTENTION_VAR}={p:?} needs a CPU with AVX-512 BF16; this one has none"
        ));
    }
    Ok(p)
}

/// Returns the heap's free pages to the system. Loading a model frees what it read from the
/// file once the weights are repacked, and with the trim threshold raised in [`init`] glibc
/// would keep those pages resident for good; call it after the models are loaded.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let t = std::time::Instant::now();
        // SAFETY: malloc_trim only returns free heap pages to the system.
        let released = unsafe { libc::malloc_trim(0) } != 0;
        tracing::debug!(
            released,
            ms = t.elapsed().as_secs_f64() * 1e3,
            "malloc_trim"
        );
    }
}
