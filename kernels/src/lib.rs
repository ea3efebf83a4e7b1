//! The few hot tensor ops of specrag, kept apart from any model or request logic.
//!
//! Each op works on plain `f32` row-major slices laid out as `(rows, heads, head_dim)` with rows
//! indexed by *absolute position*, and has a reference built from candle primitives next to it
//! that the tests compare against. The design choice a reader must know: positions are always
//! explicit, so the same attention kernel serves full prefill, decode, and forward over an
//! arbitrary subset of positions against a cache that already holds the others.
//!
//! The GPU's own kernels are CUDA C source ([`CUDA_SOURCE`], `src/cuda/`), compiled at run
//! time by the device engine (NVRTC) and run on the CPU by `tests/flash_attention_emulated.rs`;
//! the default build needs no GPU and no CUDA toolkit.

/// The run-time CUDA kernels as one program: `common.cuh`, then every kernel (attention of any
/// rows against a position-indexed f16 cache; a batched decode step, split over long caches;
/// each writing f32 or bf16; RMSNorm, SwiGLU and the residual adds around the bf16 GEMMs; the
/// Q/K/V product's epilogue into the cache or into rows), the order
/// `scripts/gpu/nvrtc_check.py` compiles them in on the build machine.
pub const CUDA_SOURCE: &str = concat!(
    include_str!("cuda/common.cuh"),
    "\n",
    include_str!("cuda/decode_attention.cu"),
    "\n",
    include_str!("cuda/flash_attention.cu"),
    "\n",
    include_str!("cuda/norm_bf16.cu"),
    "\n",
    include_str!("cuda/qkv_epilogue.cu"),
);

pub mod attention;
pub mod error;
pub mod ffn;
pub mod lowbit;
pub mod quant;
pub mod rope;

pub use attention::{
    attention_mass, attention_mass_reference, causal_attention, causal_attention_packed,
    causal_attention_reference, causal_attention_with, AttentionPrecision, AttentionShape, Bf16Kv,
};
pub use error::{KernelError, Result};
pub use ffn::swiglu;
pub use lowbit::LowBitKeys;
pub use quant::{Isa, PackedMatrix, QMatrix, QType};
pub use rope::{Rope, RopeTable, RopeVariant};

/// Runs `f` on a worker of the thread pool the kernels' parallel loops use (inline when already
/// on one). Started from another thread, every parallel loop is handed to the pool and waited
/// for, ~10-25 µs each (measured here); a decode step runs hundreds of them. Started on a
/// worker, a loop begins where it is and the other worker steals half.
pub fn in_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        f()
    } else {
        rayon::scope(|_| f())
    }
}
