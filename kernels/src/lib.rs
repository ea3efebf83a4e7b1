//! The few hot tensor ops of specrag, kept apart from any model or request logic.
//!
//! Each op works on plain `f32` row-major slices laid out as `(rows, heads, head_dim)` with rows
//! indexed by *absolute position*, and has a reference built from candle primitives next to it
//! that the tests compare against. The design choice a reader must know: positions are always
//! explicit, so the same attention kernel serves full prefill, decode, and forward over an
//! arbitrary subset of positions against a cache that already holds the others.
//!
//! CUDA versions will live behind the `cuda` feature; the default build needs no GPU.

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
