//! A GGUF file's weights as the CPU forward multiplies them: each transformer block's
//! matrices and norms read from `blk.N.*` ([`Layer`]), the embedding and LM head, and the
//! rotary embedding the file declares. How they are loaded is [`LoadOptions`].
//!
//! Every linear layer keeps only its quantized weights at the file's bit width (`Quant`). With
//! AVX-512 VNNI or AVX2 they are repacked for one int8 GEMM that serves every row count
//! ([`kernels::PackedMatrix`]; q/k/v and gate/up share one activation quantization; both ISAs
//! give the same values). Without either (or with `packed` off), few rows multiply the file's
//! blocks with int8 activations ([`kernels::QMatrix`], or candle's k-quant kernels), and many
//! rows stay on int8 when every layer is a k-quant and otherwise run dense f32 GEMM on weight
//! panels dequantized into cache. Dense f32 copies of
//! the weights (`LoadOptions::dense_copies`, ≈4x the file in RAM) are optional and no longer
//! faster. See docs/performance.md.

mod linear;
mod options;
mod quant;

pub(crate) use linear::Linear;
pub use options::LoadOptions;
pub(crate) use quant::Quant;

use crate::config::{Architecture, ModelConfig};
use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;
use candle_core::quantized::{QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use kernels::Rope;
use quant::requantized;
use std::borrow::Cow;
use std::sync::Arc;

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
pub(crate) fn load_norm(f: &mut GgufFile, name: &str) -> Result<Tensor> {
    Ok(f.tensor(name)?
        .dequantize(&Device::Cpu)?
        .to_dtype(DType::F32)?)
}

/// Every transformer block's weights (`blk.N.*`), each projection in the forms `opts` asks for.
pub(crate) fn load_layers(
    f: &mut GgufFile,
    config: &ModelConfig,
    opts: &LoadOptions,
) -> Result<Vec<Layer>> {
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
pub(crate) fn load_embeddings(
    f: &mut GgufFile,
    opts: &LoadOptions,
) -> Result<(Arc<Quant>, Arc<Quant>)> {
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

/// One transformer block's weights.
#[derive(Debug)]
pub(crate) struct Layer {
    /// Per-head RMSNorm weights of Q and K (`head_dim` each), for architectures that have them.
    pub(crate) q_norm: Option<Vec<f32>>,
    pub(crate) k_norm: Option<Vec<f32>>,
    pub(crate) attn_norm: Tensor,
    /// Norms of the attention's and the FFN's outputs before the residual add (Gemma 3).
    pub(crate) post_attn_norm: Option<Tensor>,
    pub(crate) post_ffn_norm: Option<Tensor>,
    pub(crate) wq: Linear,
    pub(crate) wk: Linear,
    pub(crate) wv: Linear,
    pub(crate) wo: Linear,
    pub(crate) ffn_norm: Tensor,
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}
