//! The forward pass on a candle device: a CUDA GPU in a `--features cuda` build, or the CPU,
//! where the suite holds it to [`crate::Model`] (`tests/device_model.rs`). Everything here is
//! candle tensor ops (candle's CUDA kernels: llama.cpp's quantized MMQ/MMVQ matmuls, cuBLAS for
//! attention), so the code the GPU runs is the code the CPU tests run.
//!
//! What it covers: weights on the device (the file's quantized blocks; the embedding
//! dequantized), an external KV cache on the device indexed by absolute position, causal
//! attention of arbitrary query rows against it (prefill, decode, subset recompute, several
//! verification rows), the question's attention mass per position (what `target_probe`
//! selects with), chunk KV loaded from host memory (f16, as the store keeps it) with its RoPE
//! position recovery, and the blended prefill over the fused cache. qwen2, llama (Llama 3's
//! RoPE factors included) and qwen3; the other families run on the CPU engine only.
//!
//! docs/gpu.md says how to build it without a GPU and what one script checks on a GPU.
//!
//! By job: the weights on the device and their loading (`model.rs`), the cache (`cache.rs`),
//! the forward passes and greedy decoding (`forward.rs`), attention as one kernel
//! (`fused.rs`), chunk KV to and from host memory
//! (`host_kv.rs`) and the hot chunks kept on the device (`hot.rs`), the shift's per-layer step
//! (`shift.rs`), the engine interface (`engine.rs`), and batching (`batcher.rs`).

use crate::error::{EngineError, Result};
use candle_core::Device;

pub mod batcher;
mod cache;
mod engine;
mod forward;
mod fused;
mod host_kv;
mod hot;
mod model;
mod pinned;
mod shift;
pub use batcher::{
    closed_loop, closed_loop_chunked, BatchOutcome, BatchRequest, ClosedLoop, ContinuousBatcher,
};
pub use cache::{DeviceCache, CACHE_DTYPE};
pub use fused::DeviceAttention;
pub use hot::{ChunkTier, HotStats};
pub use model::{DeviceMemory, DeviceModel, DeviceWeights};

/// The device `spec` names: `cpu`, `cuda` (GPU 0) or `cuda:N`.
pub fn parse_device(spec: &str) -> Result<Device> {
    match spec.trim() {
        "cpu" => Ok(Device::Cpu),
        "cuda" => cuda_device(0),
        s => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => cuda_device(n),
            _ => Err(EngineError::InvalidInput(format!(
                "device `{s}`: expected cpu, cuda or cuda:N"
            ))),
        },
    }
}

#[cfg(feature = "cuda")]
fn cuda_device(n: usize) -> Result<Device> {
    // cudarc opens the driver and cuBLAS/cuRAND on first use and panics where one is missing
    // (its message, printed above, lists the names it tried).
    match std::panic::catch_unwind(|| Device::new_cuda(n)) {
        Ok(device) => Ok(device?),
        Err(_) => Err(EngineError::InvalidInput(format!(
            "cannot open CUDA device {n}: the driver (libcuda.so.1), cuBLAS, cuBLASLt or cuRAND \
             did not load; put their folders on LD_LIBRARY_PATH (docs/gpu.md)"
        ))),
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(_: usize) -> Result<Device> {
    Err(EngineError::InvalidInput(
        "this build has no CUDA support: build with `--features cuda` (scripts/gpu/build.sh, \
         docs/gpu.md)"
            .into(),
    ))
}
