//! Process setup shared by the `specrag` and `specrag-eval` binaries.

/// Allocator tuning, then logging to stderr filtered by `RUST_LOG` (default `warn`). Call it
/// first in `main`, before any thread is started.
///
/// Prefill allocates tens of megabytes per op; glibc serves each from a fresh mmap and returns
/// it on free, so every op pays page faults (~18% of prefill, see shared/PERFORMANCE.md).
/// Raising the mmap and trim thresholds keeps that memory in the heap for reuse.
pub fn init() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator parameters; it runs before any thread is started.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}
