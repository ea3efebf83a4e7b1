//! How a model is loaded: the choices that decide which weights are kept and how they are
//! multiplied.

use candle_core::quantized::GgmlDType;

/// How a model is loaded.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Forwards over many rows run dense f32 GEMM (on weight panels dequantized on the fly,
    /// or on `dense_copies`); off, every forward runs on the quantized kernels.
    pub dense: bool,
    /// Keep dense f32 copies of the weights for those forwards instead of dequantizing panels
    /// (≈4x the file size in RAM for a few percent of prefill time; see docs/performance.md).
    pub dense_copies: bool,
    /// Forwards over at least this many rows use the dense weights.
    pub dense_min_rows: usize,
    /// Run a short forward at load so weight repacking does not land on the first request.
    pub warmup: bool,
    /// Re-quantize weights of a block format without a SIMD kernel here (Q5_1, Q4_0, ...) to
    /// Q8_0, for which candle has an AVX2 kernel; the rounding this adds is below 7% of the
    /// original quantization step.
    pub decode_q8: bool,
    /// Repack Q8_0, Q5_0 and Q4_1 weights at load for the int8 GEMM when the CPU has AVX-512
    /// VNNI or AVX2 ([`kernels::PackedMatrix`]); every product on them then runs on it.
    pub packed: bool,
    /// Also repack Q4_K and Q6_K weights (with `packed`) instead of running candle's k-quant
    /// kernels, which keep their own repacked copy beside the file's bytes: ~0.55x the 1.5B
    /// target's RSS, decode ~0.7x the time, prefill within noise (docs/performance.md).
    pub pack_k_quants: bool,
    /// Precision of the attention products: f32 (the default), or bf16 on CPUs with AVX-512
    /// BF16 (~1.5-2x faster attention at 8-bit mantissas; head dimensions other than 64 and
    /// 128 stay f32). The binaries set it from `--attention` / `SPECRAG_ATTENTION`.
    pub attention: kernels::AttentionPrecision,
    /// Re-quantize every projection and the embedding to this format at load (Q8_0, Q4_0,
    /// Q3_K, Q2_K, ...): the target's own weights at a lower bit width, a cheaper copy of it
    /// (issue 43's predictor (a)). The fingerprint says so, so its KV never passes for the
    /// file's. `None` (the default) keeps the file's formats.
    pub requantize: Option<GgmlDType>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            dense: true,
            dense_copies: false,
            dense_min_rows: 8,
            warmup: true,
            decode_q8: true,
            packed: true,
            pack_k_quants: true,
            attention: kernels::AttentionPrecision::F32,
            requantize: None,
        }
    }
}
