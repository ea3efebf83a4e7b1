//! The transformer forward pass (qwen2 and llama), written over candle ops with an external
//! KV cache, explicit positions, optional per-layer hidden states and a separate LM head.
//!
//! Every linear layer keeps only its quantized weights at the file's bit width (`Quant`). With
//! AVX-512 VNNI they are repacked for one int8 GEMM that serves every row count
//! ([`kernels::PackedMatrix`]; q/k/v and gate/up share one activation quantization). Without
//! it, few rows multiply the file's blocks with int8 activations ([`kernels::QMatrix`], or
//! candle's k-quant kernels), and many rows stay on int8 when every layer is a k-quant and
//! otherwise run dense f32 GEMM on weight panels dequantized into cache. Every pass runs on
//! the kernels' thread pool ([`kernels::in_pool`]). Dense f32 copies of the weights
//! (`LoadOptions::dense_copies`, ≈4x the file in RAM) are optional and no longer faster.
//! A row's result never depends on the other rows of its forward beyond f32 rounding in the
//! panels, and not at all on the int8 paths and in attention: the ρ = 1 blend identity needs
//! it. See docs/performance.md.

use crate::chat::ChatFormat;
use crate::config::{Architecture, ModelConfig};
use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;
use crate::kv::KvCache;
use crate::tokenizer::Tokenizer;
use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{CpuStorage, DType, Device, Module, Storage, Tensor, D};
use kernels::{AttentionShape, Isa, PackedMatrix, QMatrix, QType, Rope};
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Most rows one [`Model::forward_decode_path`] pass checks: verification and speculative
/// decoding cap their checking batches here, where every row is still bit-identical to a
/// one-token decode step.
pub const MAX_VERIFY_ROWS: usize = 16;

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
    /// VNNI ([`kernels::PackedMatrix`]); every product on them then runs on it.
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

/// `q` in `opts.requantize`'s format when one is asked for and its rows fit the format's
/// blocks; otherwise `q` as the file has it.
fn requantized(q: QTensor, opts: &LoadOptions) -> Result<QTensor> {
    match opts.requantize {
        Some(ty)
            if ty != q.dtype()
                && q.shape()
                    .dims()
                    .last()
                    .is_some_and(|c| c % ty.block_size() == 0) =>
        {
            Ok(QTensor::quantize(&q.dequantize(&Device::Cpu)?, ty)?)
        }
        _ => Ok(q),
    }
}

/// Splits a matrix into consecutive blocks of `rows` rows (a fused projection into its parts),
/// byte for byte: a row's quantized blocks are contiguous, so no value changes.
fn split_rows(q: &QTensor, rows: &[usize]) -> Result<Vec<QTensor>> {
    let (n, cols) = q.shape().dims2()?;
    let ty = q.dtype();
    if rows.iter().sum::<usize>() != n || !cols.is_multiple_of(ty.block_size()) {
        return Err(EngineError::InvalidInput(format!(
            "a {n}x{cols} matrix does not split into {rows:?} rows"
        )));
    }
    let row_bytes = cols / ty.block_size() * ty.type_size();
    let data = q.data()?;
    let mut start = 0;
    let mut parts = Vec::with_capacity(rows.len());
    for &r in rows {
        let bytes = data[start * row_bytes..(start + r) * row_bytes].to_vec();
        let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, ty)?;
        parts.push(QTensor::new(storage, (r, cols))?);
        start += r;
    }
    Ok(parts)
}

/// Q, K and V of layer `p`: three matrices, or the rows of a fused `attn_qkv` (Phi-3).
fn load_qkv(
    f: &mut GgufFile,
    p: &str,
    config: &ModelConfig,
    opts: &LoadOptions,
) -> Result<[Linear; 3]> {
    let bias = config.arch.qkv_bias();
    let fused = format!("{p}.attn_qkv.weight");
    if !f.has_tensor(&fused) {
        return Ok([
            Linear::load(f, &format!("{p}.attn_q"), bias, opts)?,
            Linear::load(f, &format!("{p}.attn_k"), bias, opts)?,
            Linear::load(f, &format!("{p}.attn_v"), bias, opts)?,
        ]);
    }
    let (qw, kv) = (config.q_width(), config.kv_row());
    let parts = split_rows(&f.tensor(&fused)?, &[qw, kv, kv])?;
    let mut lin = parts.into_iter().map(|q| Linear::new(q, None, opts));
    let mut next = || lin.next().expect("three parts");
    Ok([next()?, next()?, next()?])
}

/// Gate and up of layer `p`: two matrices, or the halves of a fused `ffn_up` (Phi-3: the
/// gate first, as llama.cpp's SwiGLU reads it).
fn load_gate_up(
    f: &mut GgufFile,
    p: &str,
    config: &ModelConfig,
    opts: &LoadOptions,
) -> Result<[Linear; 2]> {
    let gate = format!("{p}.ffn_gate");
    if f.has_tensor(&format!("{gate}.weight")) {
        return Ok([
            Linear::load(f, &gate, false, opts)?,
            Linear::load(f, &format!("{p}.ffn_up"), false, opts)?,
        ]);
    }
    let n = config.n_ff;
    let mut halves = split_rows(&f.tensor(&format!("{p}.ffn_up.weight"))?, &[n, n])?;
    let up = halves.pop().expect("two halves");
    let gate = halves.pop().expect("two halves");
    Ok([Linear::new(gate, None, opts)?, Linear::new(up, None, opts)?])
}

/// A norm's weights, dequantized to f32.
fn load_norm(f: &mut GgufFile, name: &str) -> Result<Tensor> {
    Ok(f.tensor(name)?
        .dequantize(&Device::Cpu)?
        .to_dtype(DType::F32)?)
}

/// Every transformer block's weights (`blk.N.*`), each projection in the forms `opts` asks for.
fn load_layers(f: &mut GgufFile, config: &ModelConfig, opts: &LoadOptions) -> Result<Vec<Layer>> {
    let mut layers = Vec::with_capacity(config.n_layer);
    for i in 0..config.n_layer {
        let p = format!("blk.{i}");
        let mut head_norm = |name: &str| -> Result<Option<Vec<f32>>> {
            if !config.arch.qk_norm() {
                return Ok(None);
            }
            let w = load_norm(f, &format!("{p}.{name}.weight"))?.to_vec1::<f32>()?;
            if w.len() != config.head_dim {
                return Err(EngineError::BadGguf {
                    path: f.path().to_path_buf(),
                    reason: format!(
                        "{p}.{name}.weight has {} values for heads of {}",
                        w.len(),
                        config.head_dim
                    ),
                });
            }
            Ok(Some(w))
        };
        let (q_norm, k_norm) = (head_norm("attn_q_norm")?, head_norm("attn_k_norm")?);
        let [wq, wk, wv] = load_qkv(f, &p, config, opts)?;
        let [gate, up] = load_gate_up(f, &p, config, opts)?;
        let post = |f: &mut GgufFile, name: &str| -> Result<Option<Tensor>> {
            if config.arch == Architecture::Gemma3 {
                Ok(Some(load_norm(f, &format!("{p}.{name}.weight"))?))
            } else {
                Ok(None)
            }
        };
        layers.push(Layer {
            q_norm,
            k_norm,
            post_attn_norm: post(f, "post_attention_norm")?,
            post_ffn_norm: post(f, "post_ffw_norm")?,
            attn_norm: load_norm(f, &format!("{p}.attn_norm.weight"))?,
            wq,
            wk,
            wv,
            wo: Linear::load(f, &format!("{p}.attn_output"), false, opts)?,
            ffn_norm: load_norm(f, &format!("{p}.ffn_norm.weight"))?,
            gate,
            up,
            down: Linear::load(f, &format!("{p}.ffn_down"), false, opts)?,
        });
    }
    Ok(layers)
}

/// The rotary embedding the file declares, with Llama 3.x's long-context scaling where the
/// file carries its per-pair frequency factors (`rope_freqs.weight`); and the sliding layers'
/// own, where the model has such layers.
pub(crate) fn load_rope(f: &mut GgufFile, config: &ModelConfig) -> Result<(Rope, Option<Rope>)> {
    let new = |base: f64| Rope::new(config.arch.rope_variant(), config.head_dim, base);
    let swa = config.swa.map(|s| new(s.rope_theta)).transpose()?;
    Ok((global_rope(f, new(config.rope_theta)?)?, swa))
}

/// `rope` with the frequency factors the file carries, if any.
fn global_rope(f: &mut GgufFile, rope: Rope) -> Result<Rope> {
    if ["rope_factors_long.weight", "rope_factors_short.weight"]
        .iter()
        .any(|t| f.has_tensor(t))
    {
        return Err(EngineError::Unsupported {
            path: f.path().to_path_buf(),
            reason: "LongRoPE (`rope_factors_long`/`rope_factors_short`, Phi-3's 128k-context \
                     files) is not implemented; supported: Llama 3's `rope_freqs`"
                .into(),
        });
    }
    if !f.has_tensor("rope_freqs.weight") {
        return Ok(rope);
    }
    let factors = load_norm(f, "rope_freqs.weight")?.to_vec1::<f32>()?;
    Ok(rope.with_freq_factors(&factors)?)
}

/// The token embedding and the LM head (the same tensor when the file ties them).
fn load_embeddings(f: &mut GgufFile, opts: &LoadOptions) -> Result<(Arc<Quant>, Arc<Quant>)> {
    // A separate LM head leaves the embedding to lookups: no reason to repack it.
    let tied = !f.has_tensor("output.weight");
    let embed = Arc::new(Quant::new(
        requantized(f.tensor("token_embd.weight")?, opts)?,
        opts.decode_q8,
        opts.packed && tied,
        opts.pack_k_quants,
    )?);
    let lm_head = if tied {
        embed.clone()
    } else {
        Arc::new(Quant::new(
            requantized(f.tensor("output.weight")?, opts)?,
            opts.decode_q8,
            opts.packed,
            opts.pack_k_quants,
        )?)
    };
    Ok((embed, lm_head))
}

/// The attention head layout of a model.
fn shape_of(c: &ModelConfig) -> AttentionShape {
    AttentionShape {
        n_head: c.n_head,
        n_kv_head: c.n_kv_head,
        head_dim: c.head_dim,
    }
}

/// A loaded tensor's blocks, read in place by [`QMatrix`] (no copy).
struct TensorBytes(Arc<QTensor>);

impl AsRef<[u8]> for TensorBytes {
    fn as_ref(&self) -> &[u8] {
        match self.0.data() {
            Ok(Cow::Borrowed(b)) => b,
            // CPU storage always lends its bytes; anything else was refused at load.
            _ => &[],
        }
    }
}

/// Quantized weights and the ways of multiplying them.
///
/// With AVX-512 VNNI, Q8_0, Q5_0, Q4_1, Q4_K and Q6_K weights are repacked at load into a
/// [`PackedMatrix`] (the file's bit width, the original bytes dropped; the k-quants only with
/// `LoadOptions::pack_k_quants`): one int8 GEMM for every row count, each row's result
/// independent of the batch, 2-4x QMatrix for few rows and ~2x the f32 panels for many, on
/// a par with candle's k-quant GEMM (docs/performance.md). Otherwise few rows (decode, blended
/// prefill's small recompute, verification) multiply the blocks with int8 activations:
/// [`QMatrix`] for Q8_0, Q5_0 and Q4_1 (candle has only a scalar loop for the last two),
/// candle's kernels for the k-quants (Q4_K, Q6_K: the 1.5B target decodes 1.3x faster on them
/// than on QMatrix). Many rows run either the same int8 kernels (a model made only of packed
/// formats and k-quants) or dense f32 GEMM on panels of weight rows dequantized into cache
/// ([`QMatrix::matmul_dense`]), so no dense copy of the weights is kept (`Model::load` picks).
#[derive(Debug)]
struct Quant {
    /// `(rows, cols)`.
    dims: (usize, usize),
    /// The block format the weights are multiplied in (after any re-quantization).
    dtype: GgmlDType,
    weights: Weights,
}

#[derive(Debug)]
enum Weights {
    /// Repacked for the int8 GEMM.
    Packed(PackedMatrix),
    /// The file's blocks.
    File {
        tensor: Arc<QTensor>,
        /// The same bytes, for QMatrix's kernels (`None` for a format it does not know).
        blocks: Option<QMatrix>,
        candle: QMatMul,
        /// Few-row products on QMatrix's int8 kernels rather than on candle's.
        own_kernels: bool,
    },
}

impl Quant {
    /// Wraps `q`; re-quantizes a format without a SIMD kernel here to Q8_0 when `to_q8` is set;
    /// repacks it for the int8 GEMM when `pack` is set and the CPU and format allow.
    fn new(q: QTensor, to_q8: bool, pack: bool, pack_k_quants: bool) -> Result<Self> {
        let (rows, cols) = q.shape().dims2()?;
        // candle's formats without an AVX kernel that QMatrix does not take either.
        let slow = matches!(q.dtype(), GgmlDType::Q5_1 | GgmlDType::Q8_1);
        let q = if to_q8 && slow && cols.is_multiple_of(32) {
            QTensor::quantize(&q.dequantize(&Device::Cpu)?, GgmlDType::Q8_0)?
        } else {
            q
        };
        let ty = match q.dtype() {
            GgmlDType::Q8_0 => Some(QType::Q8_0),
            GgmlDType::Q5_0 => Some(QType::Q5_0),
            GgmlDType::Q4_1 => Some(QType::Q4_1),
            GgmlDType::Q4K => Some(QType::Q4K),
            GgmlDType::Q6K => Some(QType::Q6K),
            _ => None,
        };
        if !matches!(q.data()?, Cow::Borrowed(_)) {
            return Err(EngineError::Internal(
                "quantized weights are not in CPU memory".into(),
            ));
        }
        let tensor = Arc::new(q);
        let blocks = match ty {
            Some(ty) => Some(QMatrix::new(
                ty,
                rows,
                cols,
                Arc::new(TensorBytes(tensor.clone())),
            )?),
            None => None,
        };
        let k_quant = matches!(ty, Some(QType::Q4K | QType::Q6K));
        if pack && (pack_k_quants || !k_quant) && Isa::best() == Isa::Avx512Vnni {
            if let Some(p) = blocks.as_ref().and_then(QMatrix::pack) {
                return Ok(Self {
                    dims: (rows, cols),
                    dtype: tensor.dtype(),
                    weights: Weights::Packed(p),
                });
            }
        }
        Ok(Self {
            dims: (rows, cols),
            dtype: tensor.dtype(),
            weights: Weights::File {
                candle: QMatMul::from_arc(tensor.clone())?,
                own_kernels: matches!(ty, Some(QType::Q8_0 | QType::Q5_0 | QType::Q4_1)),
                tensor,
                blocks,
            },
        })
    }

    /// Whether the few-row kernel is also fast for many rows and exact per row: the packed
    /// GEMM, or candle's tiled k-quant GEMM.
    fn int8_for_many_rows(&self) -> bool {
        match &self.weights {
            Weights::Packed(_) => true,
            Weights::File {
                own_kernels,
                tensor,
                ..
            } => !own_kernels && matches!(tensor.dtype(), GgmlDType::Q4K | GgmlDType::Q6K),
        }
    }

    /// `(rows, cols)`.
    fn dims(&self) -> Result<(usize, usize)> {
        Ok(self.dims)
    }

    /// `kernel:format`: which kernel multiplies these weights, and their block format.
    fn form(&self) -> String {
        let kernel = match &self.weights {
            Weights::Packed(_) => "packed",
            Weights::File {
                own_kernels: true, ..
            } => "qmatrix",
            Weights::File { .. } => "candle",
        };
        format!("{kernel}:{:?}", self.dtype)
    }

    /// Rows `ids` of the matrix, dequantized: an embedding lookup `(ids.len(), cols)`.
    fn lookup(&self, ids: &[u32]) -> Result<Tensor> {
        let cols = self.dims.1;
        let rows = |get: &dyn Fn(usize) -> kernels::Result<Vec<f32>>| -> Result<Tensor> {
            let mut out = Vec::with_capacity(ids.len() * cols);
            for &id in ids {
                out.extend(get(id as usize)?);
            }
            Ok(Tensor::from_vec(out, (ids.len(), cols), &Device::Cpu)?)
        };
        match &self.weights {
            Weights::Packed(p) => rows(&|j| p.dequantize_rows(j..j + 1)),
            Weights::File {
                blocks: Some(m), ..
            } => rows(&|j| m.dequantize_rows(j..j + 1)),
            Weights::File { tensor, .. } => Ok(tensor.embedding(&Tensor::new(ids, &Device::Cpu)?)?),
        }
    }

    /// `x Wᵀ` for rows `x` `(n, cols)` on the few-row kernels: each row's result independent
    /// of the others.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (n, _) = x.dims2()?;
        let y = match &self.weights {
            Weights::Packed(p) => p.matmul(&x.flatten_all()?.to_vec1::<f32>()?, n)?,
            Weights::File {
                blocks: Some(m),
                own_kernels: true,
                ..
            } => m.matmul(&x.flatten_all()?.to_vec1::<f32>()?, n)?,
            Weights::File { .. } => return self.candle_forward(x),
        };
        Ok(Tensor::from_vec(y, (n, self.dims.0), &Device::Cpu)?)
    }

    /// `x Wᵀ` for many rows: the packed GEMM, dense f32 GEMM on dequantized panels, or
    /// candle's kernels for a format QMatrix does not know.
    fn forward_dense(&self, x: &Tensor) -> Result<Tensor> {
        let (n, _) = x.dims2()?;
        let y = match &self.weights {
            Weights::Packed(_) => return self.forward(x),
            Weights::File {
                blocks: Some(m), ..
            } => m.matmul_dense(&x.flatten_all()?.to_vec1::<f32>()?, n)?,
            Weights::File { .. } => return self.candle_forward(x),
        };
        Ok(Tensor::from_vec(y, (n, self.dims.0), &Device::Cpu)?)
    }

    /// candle's product, kept independent of the row count: its Q6_K kernel takes a compact
    /// path for one row and repacked tiles for more, which round differently (up to ~1e-5),
    /// so a single row runs as two. Without this a blend at ρ = 1 is not the full prefill and
    /// verification could disagree with one-token decode on a near tie. (The tiled path was
    /// also faster for one row in `examples/qmatmul`-style timing.)
    fn candle_forward(&self, x: &Tensor) -> Result<Tensor> {
        let Weights::File { tensor, candle, .. } = &self.weights else {
            return self.forward(x);
        };
        if tensor.dtype() == GgmlDType::Q6K && x.dims2()?.0 == 1 {
            let two = Tensor::cat(&[x, x], 0)?;
            return Ok(candle.forward(&two)?.narrow(0, 0, 1)?);
        }
        Ok(candle.forward(x)?)
    }
}

/// A linear layer `y = x Wᵀ (+ b)` with quantized and optional dense weights.
#[derive(Debug)]
struct Linear {
    quant: Quant,
    dense_t: Option<Tensor>,
    bias: Option<Tensor>,
}

impl Linear {
    fn load(f: &mut GgufFile, name: &str, bias: bool, opts: &LoadOptions) -> Result<Self> {
        let bias = if bias {
            Some(
                f.tensor(&format!("{name}.bias"))?
                    .dequantize(&Device::Cpu)?,
            )
        } else {
            None
        };
        Self::new(f.tensor(&format!("{name}.weight"))?, bias, opts)
    }

    /// A linear layer of weights `q` (as the file holds them) and an optional bias.
    fn new(q: QTensor, bias: Option<Tensor>, opts: &LoadOptions) -> Result<Self> {
        let q = requantized(q, opts)?;
        let dense_t = if opts.dense && opts.dense_copies {
            Some(q.dequantize(&Device::Cpu)?.t()?)
        } else {
            None
        };
        let quant = Quant::new(q, opts.decode_q8, opts.packed, opts.pack_k_quants)?;
        Ok(Self {
            quant,
            dense_t,
            bias,
        })
    }

    fn forward(&self, x: &Tensor, dense: bool) -> Result<Tensor> {
        let y = match (&self.dense_t, dense) {
            (Some(w), true) => x.matmul(w)?,
            (None, true) => self.quant.forward_dense(x)?,
            (_, false) => self.quant.forward(x)?,
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    /// `x Wᵢᵀ (+ bᵢ)` for several linears over the same rows (q/k/v, gate/up). On the packed
    /// weights the rows are quantized once and the products share one parallel loop, bit for
    /// bit the separate products; otherwise each runs alone.
    fn forward_many(ls: &[&Linear], x: &Tensor, dense: bool) -> Result<Vec<Tensor>> {
        let packed: Option<Vec<&PackedMatrix>> = ls
            .iter()
            .map(|l| match &l.quant.weights {
                Weights::Packed(p) if !(dense && l.dense_t.is_some()) => Some(p),
                _ => None,
            })
            .collect();
        let Some(mats) = packed else {
            return ls.iter().map(|l| l.forward(x, dense)).collect();
        };
        let (n, _) = x.dims2()?;
        let ys = PackedMatrix::matmul_many(&mats, &x.flatten_all()?.to_vec1::<f32>()?, n)?;
        ls.iter()
            .zip(ys)
            .map(|(l, y)| {
                let y = Tensor::from_vec(y, (n, l.quant.dims.0), &Device::Cpu)?;
                Ok(match &l.bias {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                })
            })
            .collect()
    }
}

#[derive(Debug)]
struct Layer {
    /// Per-head RMSNorm weights of Q and K (`head_dim` each), for architectures that have them.
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    attn_norm: Tensor,
    /// Norms of the attention's and the FFN's outputs before the residual add (Gemma 3).
    post_attn_norm: Option<Tensor>,
    post_ffn_norm: Option<Tensor>,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    ffn_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// How forwards over many rows (a chunk's precompute, a prefill) multiply the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ManyRows {
    /// The same int8 kernels as few rows.
    Int8,
    /// Dense f32 GEMM on dequantized panels from this many rows on.
    DensePanels(usize),
    /// Dense f32 GEMM on dense copies of the weights from this many rows on.
    DenseCopies(usize),
}

/// Everything besides the file that changes the numbers a forward produces, hence the bytes
/// of stored KV: the model's part of its cache identity.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Numerics {
    attention: &'static str,
    requantize: Option<GgmlDType>,
    many_rows: ManyRows,
    /// `kernel:format` of every weight matrix with its count, sorted.
    weights: std::collections::BTreeMap<String, usize>,
}

impl Numerics {
    /// A stable, readable description (what [`Model::numerics`] shows).
    fn describe(&self) -> String {
        let requantize = self
            .requantize
            .map_or_else(|| "none".to_string(), |ty| format!("requantized-{ty:?}"));
        let many_rows = match self.many_rows {
            ManyRows::Int8 => "int8".to_string(),
            ManyRows::DensePanels(n) => format!("dense-panels-from-{n}"),
            ManyRows::DenseCopies(n) => format!("dense-copies-from-{n}"),
        };
        let weights: Vec<String> = self
            .weights
            .iter()
            .map(|(form, n)| format!("{form}x{n}"))
            .collect();
        format!(
            "attention={};kv=f16;requantize={requantize};many_rows={many_rows};weights={}",
            self.attention,
            weights.join(",")
        )
    }
}

/// The kernel each weight matrix runs on and its format, counted.
fn weight_forms(
    layers: &[Layer],
    embed: &Quant,
    lm_head: &Quant,
) -> std::collections::BTreeMap<String, usize> {
    let mut forms = std::collections::BTreeMap::new();
    let quants = layers
        .iter()
        .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down].map(|x| &x.quant))
        .chain([embed, lm_head]);
    for q in quants {
        *forms.entry(q.form()).or_insert(0) += 1;
    }
    forms
}

/// sha256 of the file's fingerprint and the numerics description, as 64 hex digits.
fn identity(file_fingerprint: &str, numerics: &str) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(b"specrag-model\0");
    for field in [file_fingerprint, numerics] {
        h.update((field.len() as u64).to_le_bytes());
        h.update(field.as_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// What a forward returns.
#[derive(Debug)]
pub struct ForwardOutput {
    /// Final-normed hidden states `(n, n_embd)`, ready for [`Model::logits`].
    pub hidden: Tensor,
    /// Residual stream after each layer `(n, n_embd)`, when requested.
    pub layers: Vec<Tensor>,
}

/// A loaded model: weights, tokenizer and identity. Holds no per-request state.
#[derive(Debug)]
pub struct Model {
    config: ModelConfig,
    tokenizer: Tokenizer,
    chat: ChatFormat,
    fingerprint: String,
    numerics: String,
    path: PathBuf,
    rope: Rope,
    /// The sliding layers' RoPE (their own base), where the model has such layers.
    rope_swa: Option<Rope>,
    embed: Arc<Quant>,
    layers: Vec<Layer>,
    output_norm: Tensor,
    lm_head: Arc<Quant>,
    dense_min_rows: usize,
    has_dense: bool,
    rope_ok: bool,
    /// Attention runs on bf16 products (the load option, where the CPU and head size allow).
    bf16_attention: bool,
}

impl Model {
    /// The precision its attention runs at (bf16 only where the load option asked for it and
    /// the CPU and head size allow).
    pub fn attention(&self) -> kernels::AttentionPrecision {
        if self.bf16_attention {
            kernels::AttentionPrecision::Bf16
        } else {
            kernels::AttentionPrecision::F32
        }
    }

    /// Loads a qwen2 or llama GGUF file.
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Self> {
        if !opts.attention.supported() {
            return Err(EngineError::InvalidInput(format!(
                "attention precision {:?} needs a CPU with AVX-512 BF16; this one has none",
                opts.attention
            )));
        }
        let mut f = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&f)?;
        let tokenizer = Tokenizer::from_gguf(&f)?;
        let chat = ChatFormat::for_tokenizer(&tokenizer, f.chat_template(), config.arch);
        let file_fingerprint = f.fingerprint();
        let (rope, rope_swa) = load_rope(&mut f, &config)?;
        let layers = load_layers(&mut f, &config, opts)?;
        let (embed, lm_head) = load_embeddings(&mut f, opts)?;
        let output_norm = load_norm(&mut f, "output_norm.weight")?;
        // Many-row forwards stay on int8 when every layer's format has a tiled int8 kernel
        // that is exact per row (the k-quants): ~2x the f32 panels' prefill speed on the 1.5B
        // target. A model with any other format keeps f32 panels for all of them, because
        // mixing the two breaks the ρ = 1 identity: panel GEMM rounds a row differently in a
        // different batch (~1e-6), and the int8 activation rounding downstream turns that
        // into whole quantization steps (first-token KL 2.9e-4 on the 0.5B target).
        let int8_everywhere = layers.iter().all(|l| {
            [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down]
                .iter()
                .all(|x| x.quant.int8_for_many_rows())
        });
        let (vocab, dim) = embed.dims()?;
        if dim != config.n_embd || vocab < tokenizer.vocab_size() {
            return Err(EngineError::BadGguf {
                path: path.to_path_buf(),
                reason: format!(
                    "token_embd is {vocab}x{dim}, expected {}x{}",
                    tokenizer.vocab_size(),
                    config.n_embd
                ),
            });
        }
        let bf16_attention = opts.attention == kernels::AttentionPrecision::Bf16
            && kernels::Bf16Kv::handles(shape_of(&config));
        let has_dense = opts.dense && !int8_everywhere;
        let numerics = Numerics {
            attention: if bf16_attention { "bf16" } else { "f32" },
            requantize: opts.requantize,
            many_rows: match (has_dense, opts.dense_copies) {
                (false, _) => ManyRows::Int8,
                (true, false) => ManyRows::DensePanels(opts.dense_min_rows.max(1)),
                (true, true) => ManyRows::DenseCopies(opts.dense_min_rows.max(1)),
            },
            weights: weight_forms(&layers, &embed, &lm_head),
        }
        .describe();
        let fingerprint = identity(&file_fingerprint, &numerics);
        let model = Self {
            config,
            tokenizer,
            chat,
            fingerprint,
            numerics,
            path: path.to_path_buf(),
            rope,
            rope_swa,
            embed,
            layers,
            output_norm,
            lm_head,
            dense_min_rows: opts.dense_min_rows.max(1),
            has_dense,
            rope_ok: false,
            bf16_attention,
        };
        let mut model = model;
        model.rope_ok = model.rope_self_test()?;
        if !model.rope_ok {
            tracing::warn!(
                "positional recovery failed its self-test for {}: blended prefill will recompute every chunk token",
                path.display()
            );
        }
        if opts.warmup {
            model.warmup()?;
        }
        Ok(model)
    }

    /// Layer-0 keys (after RoPE) of `ids` at `positions`: they depend on nothing but the token
    /// and its position, which makes them the ground truth for positional recovery.
    pub fn layer0_keys(&self, ids: &[u32], positions: &[usize]) -> Result<Vec<f32>> {
        let c = &self.config;
        let x = self.embed(ids)?;
        let layer = &self.layers[0];
        let h = rms_norm(&x, &layer.attn_norm, c.rms_eps)?;
        let dense = self.has_dense && ids.len() >= self.dense_min_rows;
        let mut k = layer
            .wk
            .forward(&h, dense)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        head_rms_norm(&mut k, layer.k_norm.as_deref(), c.rms_eps);
        let rope = self.rope_at(0);
        let table = rope.table(&positions.iter().map(|&p| p as i64).collect::<Vec<_>>());
        rope.apply(&table, &mut k, c.n_kv_head)?;
        Ok(k)
    }

    /// LMCache-style check at load: layer-0 keys computed at offset 0 and rotated by 1000
    /// positions (through f16, as stored) must equal the keys computed at offset 1000.
    fn rope_self_test(&self) -> Result<bool> {
        let ids: Vec<u32> = (0..4u32)
            .map(|i| (i * 37 + 11) % self.config.vocab_size as u32)
            .collect();
        let at0 = self.layer0_keys(&ids, &[0, 1, 2, 3])?;
        let want = self.layer0_keys(&ids, &[1000, 1001, 1002, 1003])?;
        let mut got: Vec<f32> = at0
            .iter()
            .map(|&x| half::f16::from_f32(x).to_f32())
            .collect();
        self.rope_at(0)
            .rotate_by(&mut got, self.config.n_kv_head, &[1000; 4])?;
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        let err = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        Ok(err <= 2e-3 * scale)
    }

    /// Whether positional recovery passed its self-test at load (blending is refused if not).
    pub fn rope_recovery_ok(&self) -> bool {
        self.rope_ok
    }

    /// Whether forwards over many rows run dense f32 GEMM (dequantized panels or copies);
    /// `false` when every weight has an int8 kernel exact per row (packed formats and
    /// k-quants), which then serves every row count.
    pub fn dense_forwards(&self) -> bool {
        self.has_dense
    }

    /// Runs both weight paths once so one-time repacking happens now.
    fn warmup(&self) -> Result<()> {
        let n = self.dense_min_rows.max(2);
        let ids = vec![0u32; n];
        let pos: Vec<usize> = (0..n).collect();
        let mut cache = KvCache::new(&self.config);
        let out = self.forward(&ids, &pos, &mut cache, false)?;
        self.logits(&out.hidden.narrow(0, n - 1, 1)?)?;
        let out = self.forward(&[0], &[n], &mut cache, false)?;
        self.logits(&out.hidden)?;
        Ok(())
    }

    /// The chat format prompts are written in: the file's template, or ChatML.
    pub fn chat(&self) -> &ChatFormat {
        &self.chat
    }

    /// Hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The tokenizer built from this file.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The identity every cache of this model is bound to (stored chunk KV, prefix hashes,
    /// speculator scores): sha256 of the file's metadata and tensor table and of
    /// [`Model::numerics`], the load choices that change the numbers a forward produces. Two
    /// models with the same fingerprint write the same KV bytes for the same input.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The load choices (and the CPU paths they led to) that change this model's numbers:
    /// attention precision, re-quantized weights, how many-row products run, and which
    /// kernel each weight matrix multiplies on (repacked int8 with AVX-512 VNNI, QMatrix,
    /// candle's k-quant kernels), e.g. `attention=f32;kv=f16;requantize=none;many_rows=int8;weights=packed:Q8_0x168`.
    pub fn numerics(&self) -> &str {
        &self.numerics
    }

    /// Path the model was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The model's rotary embedding (of its layers that attend to everything).
    pub fn rope(&self) -> &Rope {
        &self.rope
    }

    /// Layer `l`'s rotary embedding: a sliding layer's has its own base (Gemma 3).
    pub fn rope_at(&self, l: usize) -> &Rope {
        match &self.rope_swa {
            Some(r) if self.config.window_of(l).is_some() => r,
            _ => &self.rope,
        }
    }

    /// A fresh, empty cache for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(&self.config)
    }

    /// Runs every layer for `ids` at `positions`, writing their K/V rows into `cache` and
    /// attending causally (by position) over everything the cache holds below each query.
    /// Rows already in the cache at other positions are read, never changed.
    pub fn forward(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut KvCache,
        collect_layers: bool,
    ) -> Result<ForwardOutput> {
        let x = self.embed(ids)?;
        let (x, layers) =
            self.forward_layers(x, positions, cache, 0..self.config.n_layer, collect_layers)?;
        let hidden = rms_norm(&x, &self.output_norm, self.config.rms_eps)?;
        Ok(ForwardOutput { hidden, layers })
    }

    /// Token embeddings `(n, n_embd)`: the input of layer 0.
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        let vocab = self.config.vocab_size;
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(EngineError::InvalidInput(format!(
                "token id {bad} >= vocabulary size {vocab}"
            )));
        }
        if ids.is_empty() {
            return Err(EngineError::InvalidInput("no token ids".into()));
        }
        let x = self.embed.lookup(ids)?;
        if self.config.arch == Architecture::Gemma3 {
            return Ok((x * f64::from((self.config.n_embd as f32).sqrt()))?);
        }
        Ok(x)
    }

    /// Layer `layer`'s keys (and with `queries` its queries) of tokens `ids` at `positions`,
    /// computed from their embeddings alone: the layer's norm and Q/K projections on the token
    /// embedding, no layer before it, RoPE applied. SpeContext's lightweight retrieval head
    /// (SpeContext, docs/long-context.md), run on a small model of the target's family: what a
    /// token at a position looks for and offers, without the context. Returns `(k, q)`, rows
    /// laid out `(tokens, heads, head_dim)`.
    pub fn embedding_qk(
        &self,
        layer: usize,
        ids: &[u32],
        positions: &[usize],
        queries: bool,
    ) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
        let l = self.layers.get(layer).ok_or_else(|| {
            EngineError::InvalidInput(format!(
                "layer {layer} is out of range: the model has {}",
                self.config.n_layer
            ))
        })?;
        if ids.len() != positions.len() {
            return Err(EngineError::InvalidInput(format!(
                "{} token ids at {} positions",
                ids.len(),
                positions.len()
            )));
        }
        let h = rms_norm(&self.embed(ids)?, &l.attn_norm, self.config.rms_eps)?;
        let dense = self.has_dense && ids.len() >= self.dense_min_rows;
        let rope = self.rope_at(layer);
        let table = rope.table(&positions.iter().map(|&p| p as i64).collect::<Vec<_>>());
        let rotated = |lin: &Linear, norm: Option<&[f32]>, heads: usize| -> Result<Vec<f32>> {
            let mut x = lin.forward(&h, dense)?.flatten_all()?.to_vec1::<f32>()?;
            head_rms_norm(&mut x, norm, self.config.rms_eps);
            rope.apply(&table, &mut x, heads)?;
            Ok(x)
        };
        let k = rotated(&l.wk, l.k_norm.as_deref(), self.config.n_kv_head)?;
        let q = if queries {
            Some(rotated(&l.wq, l.q_norm.as_deref(), self.config.n_head)?)
        } else {
            None
        };
        Ok((k, q))
    }

    /// Runs `layers` (a sub-range of the model's layers) for residual-stream rows `x`
    /// `(n, n_embd)` at `positions`, writing their K/V rows at those layers; returns the
    /// residual stream after the last layer run (not normed) and, on request, after each one.
    /// Rows count as computed in the cache once the last layer has run for them.
    pub fn forward_layers(
        &self,
        x: Tensor,
        positions: &[usize],
        cache: &mut KvCache,
        layers: std::ops::Range<usize>,
        collect_layers: bool,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let pass = Pass {
            collect_layers,
            allow_dense: true,
            probe: None,
            view: None,
            shift: None,
        };
        self.forward_layers_with(x, positions, cache, layers, pass)
    }

    /// The first `layers` layers of a decode-path forward of `ids` at `positions` through
    /// `view` (one-row steps of a model used only up to a layer, as SpeContext's contextual
    /// retrieval head is): the rows count as computed, but only the layers run hold them, so
    /// such a cache serves this call alone.
    pub fn forward_view_layers(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut KvCache,
        view: &mut (dyn crate::view::AttentionView + Send),
        layers: usize,
    ) -> Result<()> {
        view.begin_step(ids, positions)?;
        let x = self.embed(ids)?;
        let pass = Pass {
            collect_layers: false,
            allow_dense: false,
            probe: None,
            view: Some(view),
            shift: None,
        };
        let end = layers.min(self.config.n_layer);
        self.forward_layers_with(x, positions, cache, 0..end, pass)?;
        cache.mark_filled(positions);
        Ok(())
    }

    /// How much attention the rows `ids` at `positions` pay to every cache row at the layers
    /// `probe`: the attention mass summed over rows, heads and those layers, one value per
    /// position `0..max(positions)+1`. Only layers `0..probe.end` run (their K/V rows of
    /// `positions` are written; the rows do not count as computed). Query-aware selection
    /// reads this: the question's pass over the reused cache tells which chunk tokens it uses.
    pub fn forward_probe(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut KvCache,
        probe: std::ops::Range<usize>,
    ) -> Result<Vec<f32>> {
        let per_layer = self.forward_probe_layers(ids, positions, cache, probe)?;
        let rows = per_layer.first().map_or(0, Vec::len);
        let mut mass = vec![0.0f32; rows];
        for layer in &per_layer {
            mass.iter_mut().zip(layer).for_each(|(a, b)| *a += b);
        }
        Ok(mass)
    }

    /// [`Model::forward_probe`] with each probed layer's mass kept apart (in layer order), for
    /// selectors that weigh the layers before summing them.
    pub fn forward_probe_layers(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut KvCache,
        probe: std::ops::Range<usize>,
    ) -> Result<Vec<Vec<f32>>> {
        let x = self.embed(ids)?;
        let mut mass = Vec::new();
        let end = probe.end.min(self.config.n_layer);
        let pass = Pass {
            collect_layers: false,
            allow_dense: true,
            probe: Some((probe, &mut mass)),
            view: None,
            shift: None,
        };
        self.forward_layers_with(x, positions, cache, 0..end, pass)?;
        Ok(mass)
    }

    /// [`Model::forward`] on the weights decode uses (quantized, never the dense copies),
    /// whatever the number of rows. Rows do not interact on that path, so each row's logits are
    /// bit-identical to a one-token decode step at its position: what lossless verification of
    /// several drafted tokens in one pass needs.
    pub fn forward_decode_path(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut KvCache,
    ) -> Result<ForwardOutput> {
        self.forward_decode_with(ids, positions, cache, None)
    }

    /// [`Model::forward_decode_path`] whose attention comes from `view` (an approximate view
    /// of the cache: a long-context drafter's, see [`crate::decode::sparse`]); the rows' K/V are
    /// written to `cache` as usual.
    pub fn forward_view(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut KvCache,
        view: &mut (dyn crate::view::AttentionView + Send),
    ) -> Result<ForwardOutput> {
        self.forward_decode_with(ids, positions, cache, Some(view))
    }

    pub(crate) fn forward_decode_with(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut KvCache,
        mut view: Option<&mut (dyn crate::view::AttentionView + Send)>,
    ) -> Result<ForwardOutput> {
        if let Some(v) = view.as_deref_mut() {
            v.begin_step(ids, positions)?;
        }
        let x = self.embed(ids)?;
        let pass = Pass {
            collect_layers: false,
            allow_dense: false,
            probe: None,
            view,
            shift: None,
        };
        let (x, layers) =
            self.forward_layers_with(x, positions, cache, 0..self.config.n_layer, pass)?;
        let hidden = rms_norm(&x, &self.output_norm, self.config.rms_eps)?;
        Ok(ForwardOutput { hidden, layers })
    }

    /// Every layer for `ids` at `positions`, with each group's reused rows corrected at every
    /// layer by the deviation of its recomputed rows there ([`Shift`]); returns the residual
    /// rows after the last layer (not normed).
    pub(crate) fn forward_shifted(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut KvCache,
        shift: &Shift,
    ) -> Result<Tensor> {
        let pass = Pass {
            collect_layers: false,
            allow_dense: true,
            probe: None,
            view: None,
            shift: Some(shift),
        };
        let x = self.embed(ids)?;
        let (x, _) = self.forward_layers_with(x, positions, cache, 0..self.config.n_layer, pass)?;
        Ok(x)
    }

    /// Rows of keys at `at` (RoPE applied there) with RoPE undone.
    fn unrotated_keys(&self, layer: usize, keys: Vec<f32>, at: &[usize]) -> Result<Vec<f32>> {
        let mut keys = keys;
        let undo: Vec<i64> = at.iter().map(|&p| -(p as i64)).collect();
        self.rope_at(layer)
            .rotate_by(&mut keys, self.config.n_kv_head, &undo)?;
        Ok(keys)
    }

    /// Per group, how recomputing moves its picks at `layer`, taken before `new` overwrites
    /// their rows: `new - cached` for K (RoPE undone) and V, and, to weigh by similarity, the
    /// cached keys (RoPE undone).
    fn shift_moves(
        &self,
        layer: usize,
        shift: &Shift,
        positions: &[usize],
        cache: &KvCache,
        (k, v): (&[f32], &[f32]),
    ) -> Result<Vec<Moves>> {
        let row = cache.row_len();
        let mut out = Vec::with_capacity(shift.groups.len());
        for g in &shift.groups {
            if g.rows.is_empty() || g.targets.is_empty() {
                out.push(Moves::default());
                continue;
            }
            let (mut dk, mut dv, mut keys) = (Vec::new(), Vec::new(), Vec::new());
            let mut at = Vec::with_capacity(g.rows.len());
            for &i in &g.rows {
                let p = positions[i];
                let old_k = &cache.k(layer)[p * row..(p + 1) * row];
                let old_v = &cache.v(layer)[p * row..(p + 1) * row];
                dk.extend(
                    k[i * row..(i + 1) * row]
                        .iter()
                        .zip(old_k)
                        .map(|(a, b)| a - b),
                );
                dv.extend(
                    v[i * row..(i + 1) * row]
                        .iter()
                        .zip(old_v)
                        .map(|(a, b)| a - b),
                );
                if shift.by_similarity {
                    keys.extend_from_slice(old_k);
                }
                at.push(p);
            }
            out.push(Moves {
                dk: self.unrotated_keys(layer, dk, &at)?,
                dv,
                keys: match shift.by_similarity {
                    true => self.unrotated_keys(layer, keys, &at)?,
                    false => Vec::new(),
                },
            });
        }
        Ok(out)
    }

    /// Moves each group's reused rows at `layer` by its picks' moves (from
    /// [`Model::shift_moves`]): their mean, or per kv head their mean weighted by the softmax
    /// of the reused key's dot products with the picks' keys (scaled by `1/sqrt(head_dim)`);
    /// the K move rotated to each row's position.
    fn apply_shift(
        &self,
        layer: usize,
        shift: &Shift,
        moves: &[Moves],
        cache: &mut KvCache,
    ) -> Result<()> {
        let row = cache.row_len();
        let (heads, d) = (self.config.n_kv_head, self.config.head_dim);
        for (g, m) in shift.groups.iter().zip(moves) {
            if m.dk.is_empty() {
                continue;
            }
            let picks = m.dk.len() / row;
            let n = g.targets.len();
            let (mut dk, mut dv) = if shift.by_similarity {
                let old: Vec<f32> = g
                    .targets
                    .iter()
                    .flat_map(|&q| cache.k(layer)[q * row..(q + 1) * row].iter().copied())
                    .collect();
                let keys = self.unrotated_keys(layer, old, &g.targets)?;
                similarity_moves(&keys, m, heads, d)?
            } else {
                let mean = |x: &[f32]| -> Vec<f32> {
                    let mut out = vec![0.0f32; row];
                    for r in x.chunks_exact(row) {
                        out.iter_mut().zip(r).for_each(|(o, v)| *o += v);
                    }
                    out.iter_mut().for_each(|o| *o /= picks as f32);
                    out
                };
                (mean(&m.dk).repeat(n), mean(&m.dv).repeat(n))
            };
            let at: Vec<i64> = g.targets.iter().map(|&q| q as i64).collect();
            self.rope_at(layer).rotate_by(&mut dk, heads, &at)?;
            for (i, &q) in g.targets.iter().enumerate() {
                let cached_k = &cache.k(layer)[q * row..(q + 1) * row];
                let cached_v = &cache.v(layer)[q * row..(q + 1) * row];
                let r = i * row..(i + 1) * row;
                dk[r.clone()]
                    .iter_mut()
                    .zip(cached_k)
                    .for_each(|(o, c)| *o += c);
                dv[r].iter_mut().zip(cached_v).for_each(|(o, c)| *o += c);
            }
            cache.write(layer, &g.targets, &dk, &dv);
        }
        Ok(())
    }

    /// The layers of a pass, run on the kernels' thread pool (see [`kernels::in_pool`]) with
    /// this thread's stop condition.
    fn forward_layers_with(
        &self,
        x: Tensor,
        positions: &[usize],
        cache: &mut KvCache,
        layers: std::ops::Range<usize>,
        pass: Pass<'_>,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let stop = crate::stop::current();
        kernels::in_pool(|| {
            crate::stop::with_stop(stop, || self.run_layers(x, positions, cache, layers, pass))
        })
    }

    fn run_layers(
        &self,
        mut x: Tensor,
        positions: &[usize],
        cache: &mut KvCache,
        layers: std::ops::Range<usize>,
        pass: Pass<'_>,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let Pass {
            collect_layers,
            allow_dense,
            mut probe,
            mut view,
            shift,
        } = pass;
        let c = &self.config;
        let n = self.check_pass(&x, positions, cache, &layers)?;
        cache.prepare(positions)?;
        let rows = positions.iter().max().map_or(0, |&p| p + 1);
        let dense = allow_dense && self.has_dense && n >= self.dense_min_rows;
        let angles: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
        let table = self.rope.table(&angles);
        let table_swa = self.rope_swa.as_ref().map(|r| r.table(&angles));
        let shape = shape_of(c);
        let mut collected = Vec::new();
        let finishes = layers.end == c.n_layer;
        for l in layers {
            crate::stop::check()?;
            let layer = &self.layers[l];
            let h = rms_norm(&x, &layer.attn_norm, c.rms_eps)?;
            let qkv = Linear::forward_many(&[&layer.wq, &layer.wk, &layer.wv], &h, dense)?;
            let flat = |t: &Tensor| -> Result<Vec<f32>> { Ok(t.flatten_all()?.to_vec1::<f32>()?) };
            let (mut q, mut k, v) = (flat(&qkv[0])?, flat(&qkv[1])?, flat(&qkv[2])?);
            head_rms_norm(&mut q, layer.q_norm.as_deref(), c.rms_eps);
            head_rms_norm(&mut k, layer.k_norm.as_deref(), c.rms_eps);
            let table = match &table_swa {
                Some(t) if c.window_of(l).is_some() => t,
                _ => &table,
            };
            self.rope_at(l).apply(table, &mut q, c.n_head)?;
            self.rope_at(l).apply(table, &mut k, c.n_kv_head)?;
            let moves = match shift {
                Some(sh) => self.shift_moves(l, sh, positions, cache, (&k, &v))?,
                None => Vec::new(),
            };
            cache.write(l, positions, &k, &v);
            if let Some(sh) = shift {
                self.apply_shift(l, sh, &moves, cache)?;
            }
            if let Some((probe_layers, mass)) = probe.as_mut() {
                if probe_layers.contains(&l) {
                    let mut m =
                        kernels::attention_mass(&q, positions, cache.k_prefix(l, rows), shape)?;
                    m.resize(rows, 0.0);
                    mass.push(m);
                }
            }
            let attn = if let Some(window) = c.window_of(l) {
                // A sliding layer reads few keys: exact, whatever a drafter's view would read.
                windowed_attention(&q, positions, cache, l, shape, window)?
            } else if let Some(view) = view.as_mut() {
                view.attend(l, &q, positions, cache, shape)?
            } else if self.bf16_attention {
                kernels::causal_attention_packed(&q, positions, cache.bf16(l, rows, shape))?
            } else {
                kernels::causal_attention(
                    &q,
                    positions,
                    cache.k_prefix(l, rows),
                    cache.v_prefix(l, rows),
                    shape,
                )?
            };
            let attn = Tensor::from_vec(attn, (n, c.q_width()), &Device::Cpu)?;
            x = self.after_attention(layer, x, &attn, dense)?;
            if collect_layers {
                collected.push(x.clone());
            }
        }
        if finishes {
            cache.mark_filled(positions);
        }
        Ok((x, collected))
    }

    /// Refuses a pass whose rows, positions, layers or cache do not fit this model; returns the
    /// number of rows.
    fn check_pass(
        &self,
        x: &Tensor,
        positions: &[usize],
        cache: &KvCache,
        layers: &std::ops::Range<usize>,
    ) -> Result<usize> {
        let c = &self.config;
        let (n, width) = x.dims2()?;
        if n == 0 || positions.len() != n || width != c.n_embd {
            return Err(EngineError::InvalidInput(format!(
                "{n} rows of width {width} for {} positions",
                positions.len()
            )));
        }
        if layers.start > layers.end || layers.end > c.n_layer {
            return Err(EngineError::InvalidInput(format!(
                "layers {layers:?} of {}",
                c.n_layer
            )));
        }
        if cache.n_layer() != c.n_layer || cache.row_len() != c.kv_row() {
            return Err(EngineError::InvalidInput(
                "cache was made for another model".into(),
            ));
        }
        Ok(n)
    }

    /// A layer after its attention: the output projection (normed first where the family
    /// does, Gemma 3) added to the residual stream `x`, then the gated FFN the same way.
    fn after_attention(
        &self,
        layer: &Layer,
        x: Tensor,
        attn: &Tensor,
        dense: bool,
    ) -> Result<Tensor> {
        let eps = self.config.rms_eps;
        let post = |y: Tensor, norm: &Option<Tensor>| -> Result<Tensor> {
            match norm {
                Some(w) => rms_norm(&y, w, eps),
                None => Ok(y),
            }
        };
        let x = (x + post(layer.wo.forward(attn, dense)?, &layer.post_attn_norm)?)?;
        let h = rms_norm(&x, &layer.ffn_norm, eps)?;
        let gu = Linear::forward_many(&[&layer.gate, &layer.up], &h, dense)?;
        let act = if self.config.arch == Architecture::Gemma3 {
            geglu(&gu[0], &gu[1])?
        } else {
            swiglu(&gu[0], &gu[1])?
        };
        Ok((&x + post(layer.down.forward(&act, dense)?, &layer.post_ffn_norm)?)?)
    }

    /// Final RMSNorm of residual-stream rows (what [`Model::logits`] expects).
    pub fn final_norm(&self, x: &Tensor) -> Result<Tensor> {
        rms_norm(x, &self.output_norm, self.config.rms_eps)
    }

    /// The LM head: logits `(m, vocab)` for final-normed hidden rows `(m, n_embd)`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.lm_head.forward(hidden)
    }

    /// Logits of the last row of a forward, as a plain vector.
    pub fn last_logits(&self, out: &ForwardOutput) -> Result<Vec<f32>> {
        let (n, _) = out.hidden.dims2()?;
        let logits = self.logits(&out.hidden.narrow(0, n - 1, 1)?)?;
        let mut v = logits.flatten_all()?.to_vec1::<f32>()?;
        v.truncate(self.tokenizer.vocab_size());
        Ok(v)
    }

    /// Feeds `ids` to `cache` on the decode path (each row bit-identical to a one-token step);
    /// returns the logits after each, cut to the vocabulary.
    pub(crate) fn rows_logits(&self, cache: &mut KvCache, ids: &[u32]) -> Result<Vec<Vec<f32>>> {
        let vocab = self.tokenizer().vocab_size();
        let start = cache.len();
        let positions: Vec<usize> = (start..start + ids.len()).collect();
        let out = self.forward_decode_path(ids, &positions, cache)?;
        let mut logits = self.logits(&out.hidden)?.to_vec2::<f32>()?;
        logits.iter_mut().for_each(|row| row.truncate(vocab));
        Ok(logits)
    }

    /// Full prefill of `ids` at positions `0..n` into a fresh cache; returns the cache and
    /// the logits of the last position.
    pub fn prefill(&self, ids: &[u32]) -> Result<(KvCache, Vec<f32>)> {
        let mut cache = self.new_cache();
        let positions: Vec<usize> = (0..ids.len()).collect();
        let out = self.forward(ids, &positions, &mut cache, false)?;
        Ok((cache, self.last_logits(&out)?))
    }

    /// The full prefill of `ids` over a `cache` whose rows `0..start` already hold the KV of
    /// `ids[..start]` as a prefill computes it (a stored exact prefix): rows from `start` on
    /// are dropped and computed, attending to the kept ones; returns the last position's
    /// logits. The result is [`Model::prefill`]'s up to the kept rows' own rounding.
    pub fn prefill_after(
        &self,
        cache: &mut KvCache,
        ids: &[u32],
        start: usize,
    ) -> Result<Vec<f32>> {
        if start >= ids.len() || start > cache.len() {
            return Err(EngineError::InvalidInput(format!(
                "prefill after {start} kept rows: the prompt has {} tokens and the cache {} rows",
                ids.len(),
                cache.len()
            )));
        }
        cache.truncate(start);
        let positions: Vec<usize> = (start..ids.len()).collect();
        let out = self.forward(&ids[start..], &positions, cache, false)?;
        self.last_logits(&out)
    }
}

/// How one pass over a range of layers runs.
struct Pass<'a> {
    /// Return the residual stream after every layer.
    collect_layers: bool,
    /// Use the dense weight copies for many rows (off on the decode path).
    allow_dense: bool,
    /// Layers whose attention mass to record (one vector per layer), and where.
    probe: Option<(std::ops::Range<usize>, &'a mut Vec<Vec<f32>>)>,
    /// Attention from an approximate view of the cache instead of all of it (a drafter's).
    view: Option<&'a mut (dyn crate::view::AttentionView + Send)>,
    /// Reused rows corrected at every layer by what recomputing moved their group's rows.
    shift: Option<&'a Shift>,
}

/// The reused rows a pass corrects, chunk by chunk, and how each estimates its move.
#[derive(Debug, Clone, Default)]
pub(crate) struct Shift {
    pub groups: Vec<ShiftGroup>,
    /// Each reused row moves as the picks whose keys it resembles (a softmax over key dot
    /// products per kv head) instead of by the picks' mean.
    pub by_similarity: bool,
}

/// How recomputing moved one group's picks at a layer (rows of kv heads x head dim each).
#[derive(Debug, Clone, Default)]
struct Moves {
    /// New minus cached K, RoPE undone.
    dk: Vec<f32>,
    /// New minus cached V.
    dv: Vec<f32>,
    /// The cached keys, RoPE undone (only when weighing by similarity).
    keys: Vec<f32>,
}

/// One chunk's reused rows, corrected at every layer of a pass by the mean deviation the
/// chunk's recomputed rows showed at that layer (`probe_shift`, a measurement: whether what
/// the picks learn of the other chunks carries over to the tokens left to reuse).
#[derive(Debug, Clone, Default)]
pub(crate) struct ShiftGroup {
    /// Indices, among the pass's rows, of the chunk's recomputed tokens.
    pub rows: Vec<usize>,
    /// Positions of the chunk's reused tokens, the rows corrected.
    pub targets: Vec<usize>,
}

/// Each row of `keys` (unrotated, rows of `heads` x `d`) moved per kv head by the picks'
/// moves weighted by the softmax of its dot products with the picks' keys at `1/sqrt(d)`:
/// attention with the rows as queries, the picks' keys as keys and their moves as values.
/// Every row sees every pick (all queries at the last pick's position), and the kernels'
/// tiles run it on the pool instead of one scalar loop per row, head and pick.
fn similarity_moves(
    keys: &[f32],
    m: &Moves,
    heads: usize,
    d: usize,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let shape = kernels::AttentionShape {
        n_head: heads,
        n_kv_head: heads,
        head_dim: d,
    };
    let picks = m.keys.len() / (heads * d);
    let last = vec![picks.saturating_sub(1); keys.len() / (heads * d)];
    Ok((
        kernels::causal_attention(keys, &last, &m.keys, &m.dk, shape)?,
        kernels::causal_attention(keys, &last, &m.keys, &m.dv, shape)?,
    ))
}

/// RMSNorm of each `w.len()`-wide head of `x` (rows of heads, laid out one after another),
/// scaled by `w`; nothing without weights. Each head on its own, so a row's result never
/// depends on its batch.
fn head_rms_norm(x: &mut [f32], w: Option<&[f32]>, eps: f64) {
    let Some(w) = w else { return };
    for head in x.chunks_exact_mut(w.len()) {
        let mean = head
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            / w.len() as f64;
        let scale = (1.0 / (mean + eps).sqrt()) as f32;
        head.iter_mut()
            .zip(w)
            .for_each(|(v, g)| *v = *v * scale * g);
    }
}

/// `silu(g) · u`: [`kernels::swiglu`] (on the kernels' pool, bit for bit candle's ops) for
/// contiguous f32 tensors of one shape, candle's ops otherwise.
fn swiglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    if g.dims() == u.dims() {
        let (gs, gl) = g.storage_and_layout();
        let (us, ul) = u.storage_and_layout();
        if let (
            Storage::Cpu(CpuStorage::F32(gv)),
            Storage::Cpu(CpuStorage::F32(uv)),
            Some((g0, g1)),
            Some((u0, u1)),
        ) = (&*gs, &*us, gl.contiguous_offsets(), ul.contiguous_offsets())
        {
            let out = kernels::swiglu(&gv[g0..g1], &uv[u0..u1]);
            return Ok(Tensor::from_vec(out, g.dims(), g.device())?);
        }
    }
    Ok((g.silu()? * u)?)
}

/// `gelu(g) · u` with GELU's tanh approximation (as llama.cpp's GEGLU computes it).
fn geglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let (gv, uv) = (
        g.flatten_all()?.to_vec1::<f32>()?,
        u.flatten_all()?.to_vec1::<f32>()?,
    );
    let out = gv
        .iter()
        .zip(&uv)
        .map(|(&x, &y)| {
            0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x)).tanh()) * y
        })
        .collect();
    Ok(Tensor::from_vec(out, g.dims(), &Device::Cpu)?)
}

/// Attention of layer `l` where a query at position p reads only keys `p - window + 1 ..= p`:
/// rows whose window reaches back to position 0 in one call, each other row on its own slice
/// of the cache (in parallel), every row exactly what causal attention over its window gives.
fn windowed_attention(
    q: &[f32],
    positions: &[usize],
    cache: &KvCache,
    l: usize,
    shape: AttentionShape,
    window: usize,
) -> Result<Vec<f32>> {
    use rayon::prelude::*;
    let qrow = shape.n_head * shape.head_dim;
    let row = shape.n_kv_head * shape.head_dim;
    let rows = positions.iter().max().map_or(0, |&p| p + 1);
    let (k, v) = (cache.k_prefix(l, rows), cache.v_prefix(l, rows));
    let mut out = vec![0f32; q.len()];
    let near: Vec<usize> = (0..positions.len())
        .filter(|&i| positions[i] < window)
        .collect();
    if !near.is_empty() {
        let nq: Vec<f32> = near
            .iter()
            .flat_map(|&i| q[i * qrow..(i + 1) * qrow].iter().copied())
            .collect();
        let np: Vec<usize> = near.iter().map(|&i| positions[i]).collect();
        let top = np.iter().max().map_or(0, |&p| p + 1);
        let o = kernels::causal_attention(&nq, &np, &k[..top * row], &v[..top * row], shape)?;
        for (j, &i) in near.iter().enumerate() {
            out[i * qrow..(i + 1) * qrow].copy_from_slice(&o[j * qrow..(j + 1) * qrow]);
        }
    }
    let far: Vec<(usize, Vec<f32>)> = (0..positions.len())
        .into_par_iter()
        .filter(|&i| positions[i] >= window)
        .map(|i| {
            let (p, lo) = (positions[i], positions[i] + 1 - window);
            let ks = &k[lo * row..(p + 1) * row];
            let vs = &v[lo * row..(p + 1) * row];
            kernels::causal_attention(&q[i * qrow..(i + 1) * qrow], &[p - lo], ks, vs, shape)
                .map(|o| (i, o))
        })
        .collect::<std::result::Result<_, _>>()?;
    for (i, o) in far {
        out[i * qrow..(i + 1) * qrow].copy_from_slice(&o);
    }
    Ok(out)
}

/// `x / sqrt(mean(x²) + eps) * w` over the last dimension.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (ms + eps)?.sqrt()?.recip()?;
    Ok(x.broadcast_mul(&inv)?.broadcast_mul(w)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (issue 57): every load choice that changes a forward's numbers changes the
    /// model's identity, bf16 attention included (this CPU may not load it, so the
    /// description is checked directly).
    #[test]
    fn every_numerics_choice_changes_the_identity() {
        let base = Numerics {
            attention: "f32",
            requantize: None,
            many_rows: ManyRows::DensePanels(8),
            weights: [("qmatrix:Q8_0".to_string(), 16)].into_iter().collect(),
        };
        let variants = [
            Numerics {
                attention: "bf16",
                ..base.clone()
            },
            Numerics {
                requantize: Some(GgmlDType::Q4_0),
                ..base.clone()
            },
            Numerics {
                many_rows: ManyRows::Int8,
                ..base.clone()
            },
            Numerics {
                many_rows: ManyRows::DenseCopies(8),
                ..base.clone()
            },
            Numerics {
                many_rows: ManyRows::DensePanels(9),
                ..base.clone()
            },
            Numerics {
                weights: [("packed:Q8_0".to_string(), 16)].into_iter().collect(),
                ..base.clone()
            },
            Numerics {
                weights: [("candle:Q6K".to_string(), 16)].into_iter().collect(),
                ..base.clone()
            },
        ];
        let id = |n: &Numerics| identity("file", &n.describe());
        for v in &variants {
            assert_ne!(id(&base), id(v), "{}", v.describe());
        }
        assert_ne!(
            identity("file", &base.describe()),
            identity("other", &base.describe())
        );
        assert_eq!(id(&base), id(&base.clone()));
        assert_eq!(id(&base).len(), 64);
    }

    /// The moves weighed by key similarity through the attention kernel are the plain
    /// per-row, per-head softmax-weighted sums of the picks' moves.
    #[test]
    fn similarity_moves_are_the_softmax_weighted_picks_moves() -> Result<()> {
        let (heads, d, picks, n) = (2, 64, 5, 7);
        let row = heads * d;
        let keys: Vec<f32> = values(n * row, 11).iter().map(|x| 3.0 * x).collect();
        let m = Moves {
            dk: values(picks * row, 5),
            dv: values(picks * row, 9),
            keys: values(picks * row, 2).iter().map(|x| 3.0 * x).collect(),
        };
        let (dk, dv) = similarity_moves(&keys, &m, heads, d)?;
        let mut spread = 0.0f32;
        for t in 0..n {
            for h in 0..heads {
                let at = |x: &[f32], r: usize| x[r * row + h * d..r * row + (h + 1) * d].to_vec();
                let kt = at(&keys, t);
                let s: Vec<f32> = (0..picks)
                    .map(|p| {
                        let kp = at(&m.keys, p);
                        kt.iter().zip(&kp).map(|(a, b)| a * b).sum::<f32>() / (d as f32).sqrt()
                    })
                    .collect();
                let top = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = s.iter().map(|x| (x - top).exp()).collect();
                let sum: f32 = e.iter().sum();
                spread =
                    spread.max(e.iter().copied().fold(0.0, f32::max) / sum - 1.0 / picks as f32);
                for j in 0..d {
                    let want_k: f32 = (0..picks).map(|p| e[p] / sum * at(&m.dk, p)[j]).sum();
                    let want_v: f32 = (0..picks).map(|p| e[p] / sum * at(&m.dv, p)[j]).sum();
                    assert!((dk[t * row + h * d + j] - want_k).abs() < 1e-4);
                    assert!((dv[t * row + h * d + j] - want_v).abs() < 1e-4);
                }
            }
        }
        // The weights are far from uniform, so a mean would not pass the checks above.
        assert!(spread > 0.2, "{spread}");
        Ok(())
    }

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i + seed) * 7919 % 1000) as f32 / 500.0) - 1.0)
            .collect()
    }

    /// A row's product must not depend on which other rows share the call, within each path
    /// (few rows: exactly; many rows: up to f32 rounding): the ρ = 1 blend identity and
    /// verification rely on it.
    #[test]
    fn each_format_gives_a_row_the_same_result_in_any_batch() -> Result<()> {
        let (rows, cols) = (64, 512);
        let w = Tensor::from_vec(values(rows * cols, 0), (rows, cols), &Device::Cpu)?;
        let x = Tensor::from_vec(values(400 * cols, 3), (400, cols), &Device::Cpu)?;
        let x = &x;
        let formats = [
            GgmlDType::Q8_0,
            GgmlDType::Q5_0,
            GgmlDType::Q4_1,
            GgmlDType::Q4K,
            GgmlDType::Q6K,
            GgmlDType::Q5_1,
        ];
        // Repacked (where the CPU allows) and as in the file.
        for (g, pack) in formats.into_iter().flat_map(|g| [(g, true), (g, false)]) {
            let q = Quant::new(QTensor::quantize(&w, g)?, true, pack, pack)?;
            if pack {
                // The packed matrix dequantizes to the file's weights.
                let file = Quant::new(QTensor::quantize(&w, g)?, true, false, false)?;
                let ids = [0, 17, 63];
                assert_eq!(
                    q.lookup(&ids)?.to_vec2::<f32>()?,
                    file.lookup(&ids)?.to_vec2::<f32>()?,
                    "{g:?}"
                );
            }
            // Every row of a batch of n against the same row of the largest batch.
            let check = |sizes: &[usize], dense: bool| -> Result<()> {
                let run = |n: usize| -> Result<Vec<Vec<f32>>> {
                    let x = x.narrow(0, 0, n)?;
                    let y = if dense {
                        q.forward_dense(&x)?
                    } else {
                        q.forward(&x)?
                    };
                    Ok(y.to_vec2::<f32>()?)
                };
                let reference = run(*sizes.last().expect("sizes"))?;
                let scale = reference.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
                for &n in sizes {
                    for (r, (y, want)) in run(n)?.iter().zip(&reference).enumerate() {
                        let d = y
                            .iter()
                            .zip(want)
                            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                        // Few rows exactly; many rows up to f32 rounding (dense GEMM's
                        // blocking follows the batch; int8 activation rounding may not).
                        let tol = if dense { 1e-6 * scale } else { 0.0 };
                        assert!(
                            d <= tol,
                            "{g:?}: row {r} of {n} differs by {d} (scale {scale}, dense {dense})"
                        );
                    }
                }
                Ok(())
            };
            check(&[1, 2, 3, 5, 7, 40, 129, 400], false)?;
            check(&[8, 9, 13, 17, 40], true)?;
        }
        Ok(())
    }
}
