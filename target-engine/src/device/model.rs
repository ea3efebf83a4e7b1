//! A model's weights on a device: loading them from the file, and the RoPE and row indexes
//! every pass uses.

use super::cache::DeviceCache;
use super::fused::DeviceAttention;
use super::hot::{ChunkTier, HotStats};
use crate::config::{Architecture, ModelConfig};
use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;
use crate::tokenizer::Tokenizer;
use candle_core::quantized::{QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use kernels::{Rope, RopeVariant};
use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

/// The most the fused kernels may move this model's logits from candle ops' at load, as a
/// share of the largest logit (at least [`FUSED_PASS_MIN_SCALE`]).
const FUSED_PASS_SHARE: f32 = 0.05;
const FUSED_PASS_MIN_SCALE: f32 = 10.0;

/// How the device keeps the weight matrices (`--device-weights`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceWeights {
    /// The file's quantized blocks, multiplied in place (llama.cpp's MMQ/MMVQ kernels on a
    /// GPU): the least memory.
    #[default]
    Quantized,
    /// Dequantized once at load to bf16, multiplied as dense bf16 GEMMs with f32 accumulation
    /// (cuBLAS on a GPU): twice Q8_0's memory, the tensor cores' pace on prefill.
    Bf16,
}

impl DeviceWeights {
    /// Its name in flags and fingerprints.
    pub fn name(self) -> &'static str {
        match self {
            Self::Quantized => "quantized",
            Self::Bf16 => "bf16",
        }
    }
}

impl std::str::FromStr for DeviceWeights {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "quantized" | "gguf" => Ok(Self::Quantized),
            "bf16" => Ok(Self::Bf16),
            other => Err(EngineError::InvalidInput(format!(
                "device weights `{other}`: expected quantized (the file's blocks) or bf16"
            ))),
        }
    }
}

/// A weight matrix on the device, as [`DeviceWeights`] says: `(out, in)`, applied to rows
/// `(n, in)` of f32 activations, giving f32 rows `(n, out)`.
pub(super) enum Proj {
    Quantized(QMatMul),
    /// bf16 `(out, in)`: the activations rounded to bf16, the product accumulated in f32.
    Bf16(Tensor),
}

impl candle_core::Module for Proj {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Self::Quantized(m) => m.forward(x),
            Self::Bf16(w) => x
                .to_dtype(DType::BF16)?
                .matmul(&w.t()?)?
                .to_dtype(DType::F32),
        }
    }
}

impl Proj {
    /// The product of bf16 rows `x` as bf16 (no cast back to f32: [`super::fused::add_bf16`]
    /// reads it); bf16 weights only.
    pub(super) fn forward_bf16(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Bf16(w) => Ok(x.to_dtype(DType::BF16)?.matmul(&w.t()?)?),
            Self::Quantized(_) => Err(EngineError::Internal(
                "a bf16 product of quantized weights".into(),
            )),
        }
    }
}

/// Matrices applied to the same rows: each on its own (quantized blocks), or stacked into one
/// bf16 matrix so the rows are rounded and multiplied once (one GEMM instead of several, each
/// with its two casts).
pub(super) enum Stack {
    Apart(Vec<Proj>),
    /// bf16 `(sum of outs, in)`, and each matrix's `out`.
    Bf16(Tensor, Vec<usize>),
}

impl Stack {
    /// `mats` kept as `weights` says: stacked when in bf16.
    fn of(mats: Vec<Proj>) -> Result<Self> {
        let dense: Option<Vec<&Tensor>> = mats
            .iter()
            .map(|m| match m {
                Proj::Bf16(w) => Some(w),
                Proj::Quantized(_) => None,
            })
            .collect();
        Ok(match dense {
            Some(ws) if ws.len() > 1 => {
                let outs = ws
                    .iter()
                    .map(|w| w.dim(0))
                    .collect::<candle_core::Result<_>>()?;
                Self::Bf16(Tensor::cat(&ws, 0)?, outs)
            }
            _ => Self::Apart(mats),
        })
    }

    /// Each matrix applied to the f32 rows `x` `(n, in)`: one `(n, out)` per matrix.
    pub(super) fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        match self {
            Self::Apart(mats) => mats
                .iter()
                .map(|m| Ok(candle_core::Module::forward(m, x)?))
                .collect(),
            Self::Bf16(w, outs) => {
                let y = x
                    .to_dtype(DType::BF16)?
                    .matmul(&w.t()?)?
                    .to_dtype(DType::F32)?;
                column_ranges(&y, outs)
            }
        }
    }
}

impl Stack {
    /// [`Stack::forward`] as bf16 (no cast back to f32), stacked bf16 weights only.
    pub(super) fn forward_bf16(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let Self::Bf16(w, outs) = self else {
            return Err(EngineError::Internal(
                "a bf16 product of matrices kept apart".into(),
            ));
        };
        column_ranges(&x.to_dtype(DType::BF16)?.matmul(&w.t()?)?, outs)
    }
}

/// The consecutive column ranges of `y` `(n, sum of outs)`, `outs` wide each (views).
fn column_ranges(y: &Tensor, outs: &[usize]) -> Result<Vec<Tensor>> {
    let mut at = 0;
    outs.iter()
        .map(|&o| {
            at += o;
            Ok(y.narrow(1, at - o, o)?)
        })
        .collect()
}

/// One transformer block's weights on the device.
pub(super) struct Layer {
    pub(super) attn_norm: Tensor,
    pub(super) ffn_norm: Tensor,
    /// Q, K and V.
    pub(super) qkv: Stack,
    pub(super) wo: Proj,
    pub(super) bias: Option<[Tensor; 3]>,
    pub(super) q_norm: Option<Tensor>,
    pub(super) k_norm: Option<Tensor>,
    /// The FFN's gate and up.
    pub(super) gate_up: Stack,
    pub(super) down: Proj,
}

/// A model's weights on a device.
pub struct DeviceModel {
    pub(super) device: Device,
    pub(super) config: ModelConfig,
    pub(super) tokenizer: Tokenizer,
    pub(super) rope: Rope,
    pub(super) embed: Tensor,
    pub(super) layers: Vec<Layer>,
    pub(super) output_norm: Tensor,
    pub(super) lm_head: Proj,
    /// How the weight matrices are kept.
    pub(super) weights: DeviceWeights,
    /// The identity of the KV it writes: the file's and the device's numerics.
    pub(super) fingerprint: String,
    /// The file's own identity, which `fingerprint` extends.
    pub(super) file_fingerprint: String,
    /// How attention runs ([`DeviceModel::set_attention`]).
    pub(super) attention: DeviceAttention,
    /// Chunk KV kept in device memory ([`DeviceModel::set_hot_chunks`]).
    pub(super) hot: std::sync::Mutex<super::hot::HotChunks>,
    /// Chunk KV kept in page-locked host memory ([`DeviceModel::set_pinned_chunks`]).
    pub(super) pinned: std::sync::Mutex<super::pinned::PinnedChunks>,
    /// The chat format prompts are written in, as [`crate::Model::chat`] reads it.
    pub(super) chat: crate::chat::ChatFormat,
    /// The GGUF file it was loaded from.
    pub(super) path: std::path::PathBuf,
    /// Tests only: the GPU's bf16 steps run on the CPU device as their CPU references.
    pub(super) gpu_steps_on_cpu: bool,
}

impl std::fmt::Debug for DeviceModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceModel")
            .field("device", &self.device)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// A device's memory in bytes: in use and in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    pub used: u64,
    pub total: u64,
}

#[cfg(feature = "cuda")]
fn device_memory(device: &Device) -> Option<DeviceMemory> {
    let cuda = device.as_cuda_device().ok()?;
    let (free, total) = cuda.cuda_stream().context().mem_get_info().ok()?;
    Some(DeviceMemory {
        used: total.saturating_sub(free) as u64,
        total: total as u64,
    })
}

#[cfg(not(feature = "cuda"))]
fn device_memory(_: &Device) -> Option<DeviceMemory> {
    None
}

/// `q` in `device` memory, block for block.
fn to_device(q: QTensor, device: &Device) -> Result<QTensor> {
    if device.is_cpu() {
        return Ok(q);
    }
    let storage = QStorage::from_data(Cow::Owned(q.data()?.into_owned()), device, q.dtype())?;
    Ok(QTensor::new(storage, q.shape().clone())?)
}

impl DeviceModel {
    /// Loads a qwen2, llama or qwen3 GGUF file onto `device`, its matrices as quantized
    /// blocks.
    pub fn load(path: &Path, device: &Device) -> Result<Self> {
        Self::load_with(path, device, DeviceWeights::Quantized)
    }

    /// [`DeviceModel::load`] with the matrices kept as `weights` says.
    pub fn load_with(path: &Path, device: &Device, weights: DeviceWeights) -> Result<Self> {
        let mut f = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&f)?;
        if !matches!(
            config.arch,
            Architecture::Qwen2 | Architecture::Llama | Architecture::Qwen3
        ) || config.swa.is_some()
        {
            return Err(EngineError::Unsupported {
                path: path.to_path_buf(),
                reason: format!(
                    "the device forward runs qwen2, llama and qwen3 (no sliding windows); `{}` \
                     runs on the CPU engine (`--device cpu`)",
                    config.arch.as_str()
                ),
            });
        }
        let tokenizer = Tokenizer::from_gguf(&f)?;
        let chat =
            crate::chat::ChatFormat::for_tokenizer(&tokenizer, f.chat_template(), config.arch);
        let file_fingerprint = f.fingerprint();
        let (rope, _) = crate::weights::load_rope(&mut f, &config)?;
        let mut layers = Vec::with_capacity(config.n_layer);
        for l in 0..config.n_layer {
            layers.push(load_layer(&mut f, &config, device, weights, l)?);
        }
        let embed_q = Arc::new(to_device(f.tensor("token_embd.weight")?, device)?);
        let embed = embed_q.dequantize(device)?.to_dtype(DType::F32)?;
        let lm_head = if f.has_tensor("output.weight") {
            matmul(&mut f, "output.weight", device, weights)?
        } else {
            proj(embed_q, device, weights)?
        };
        let output_norm = vector(&mut f, "output_norm.weight", device)?;
        let mut model = Self {
            device: device.clone(),
            config,
            tokenizer,
            rope,
            embed,
            layers,
            output_norm,
            lm_head,
            weights,
            fingerprint: String::new(),
            file_fingerprint,
            attention: DeviceAttention::Ops,
            hot: Default::default(),
            pinned: Default::default(),
            chat,
            path: path.to_path_buf(),
            gpu_steps_on_cpu: false,
        };
        model.set_default_attention()?;
        Ok(model)
    }

    /// The attention `SPECRAG_DEVICE_ATTENTION` names (`ops` or `fused`), else (`auto` or
    /// unset) the fused kernel on a GPU where it is built for the head size and passes its
    /// check, else candle ops.
    fn set_default_attention(&mut self) -> Result<()> {
        match std::env::var("SPECRAG_DEVICE_ATTENTION") {
            Ok(name) if name.trim() != "auto" => {
                return self.set_attention(DeviceAttention::parse(&name)?)
            }
            _ => {}
        }
        let fits = super::fused::FUSED_HEAD_DIMS.contains(&self.config.head_dim);
        if self.device.is_cpu() || !fits {
            return self.set_attention(DeviceAttention::Ops);
        }
        if let Err(e) = self.set_attention(DeviceAttention::Fused) {
            tracing::warn!("fused attention is off: {e}; attending with candle ops");
            self.set_attention(DeviceAttention::Ops)?;
        }
        Ok(())
    }

    /// Attends as `attention` says from now on. The fused kernels are first run against their
    /// reference on the CPU (random rows at scattered positions, this model's heads), then
    /// this model's passes with them against candle ops, and refused where they differ. The fingerprint names the attention: chunk KV computed
    /// with the other is refused, as any other engine's.
    pub fn set_attention(&mut self, attention: DeviceAttention) -> Result<()> {
        if attention == DeviceAttention::Fused {
            super::fused::self_check(&self.device, &self.config)?;
            self.check_fused_passes()?;
        }
        self.attention = attention;
        let numerics = format!(
            "engine=device;device={};weights={};embedding=f32;kv=f16;attention={}",
            if self.device.is_cpu() { "cpu" } else { "cuda" },
            self.weights.name(),
            match attention {
                DeviceAttention::Ops => "f32",
                DeviceAttention::Fused => "fused-f16",
            }
        );
        self.fingerprint = crate::model::identity(&self.file_fingerprint, &numerics);
        Ok(())
    }

    /// This model's own passes with the fused kernels (attention, the Q/K/V epilogue, the
    /// batched decode step) against candle ops: two prefills' last logits, then one decode
    /// step of both requests side by side on the same next tokens. A wiring fault (a stride,
    /// a bias, the RoPE layout) moves logits by a share of their scale; f16 queries and
    /// probabilities, amplified by the rounding of activations, by far less.
    fn check_fused_passes(&mut self) -> Result<()> {
        let vocab = self
            .config
            .vocab_size
            .min(self.tokenizer.vocab_size())
            .max(9) as u32;
        let ids = |seed: u32, n: u32| -> Vec<u32> {
            (0..n)
                .map(|i| (i * 7919 + seed * 104_729) % (vocab - 8))
                .collect()
        };
        let (a, b) = (ids(1, 24), ids(2, 17));
        let passes = |m: &Self| -> Result<Vec<Vec<f32>>> {
            let (ca, la) = m.prefill(&a, 32)?;
            let (cb, lb) = m.prefill(&b, 32)?;
            let mut caches = [ca, cb];
            // Fixed next tokens: each attention's own argmax may differ at a near tie.
            let next = [ids(3, 1)[0], ids(4, 1)[0]];
            let hidden = m.forward_batch(&next, &[a.len(), b.len()], &mut caches)?;
            let mut out = vec![la, lb];
            out.extend(m.logits(&hidden)?);
            Ok(out)
        };
        let before = self.attention;
        self.attention = DeviceAttention::Ops;
        let want = passes(self);
        self.attention = DeviceAttention::Fused;
        let got = passes(self);
        self.attention = before;
        let (want, got) = (want?, got?);
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            let scale = w.iter().fold(FUSED_PASS_MIN_SCALE, |m, x| m.max(x.abs()));
            let diff = w.iter().zip(g).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            let bound = FUSED_PASS_SHARE * scale;
            if diff.is_nan() || diff > bound {
                return Err(EngineError::Internal(format!(
                    "this model's passes with the fused kernels differ from candle ops' by \
                     {diff} in logits up to {scale} (pass {i}; bound {bound})"
                )));
            }
        }
        Ok(())
    }

    /// How attention runs.
    pub fn attention(&self) -> DeviceAttention {
        self.attention
    }

    /// The device's memory as the driver reports it (every process's use counts): `None`
    /// where it reports none (candle's CPU device, a build without `cuda`).
    pub fn memory(&self) -> Option<DeviceMemory> {
        device_memory(&self.device)
    }

    /// The GGUF file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The chat format prompts are written in: the file's template, or ChatML.
    pub fn chat(&self) -> &crate::chat::ChatFormat {
        &self.chat
    }

    /// Keeps up to `bytes` of recently placed chunk KV in device memory (f16, least recently
    /// used out first): placing a chunk held there copies it on the device instead of
    /// uploading it. 0 (the default) turns the tier off and empties it.
    pub fn set_hot_chunks(&self, bytes: u64) {
        self.set_chunk_tier(ChunkTier::Device, bytes);
    }

    /// What the hot-chunk tier holds and how it served.
    pub fn hot_chunks(&self) -> HotStats {
        self.chunk_tier(ChunkTier::Device)
    }

    /// Keeps up to `bytes` of recently placed chunk KV in `tier` (f16, least recently used
    /// out first); 0 (the default) turns it off and empties it. [`ChunkTier`] says what each
    /// saves; a chunk in both is placed from device memory.
    pub fn set_chunk_tier(&self, tier: ChunkTier, bytes: u64) {
        match tier {
            ChunkTier::Device => self.hot_lock().set_budget(bytes),
            ChunkTier::Pinned => self.pinned_lock().set_budget(bytes),
        }
    }

    /// What `tier` holds and how it served.
    pub fn chunk_tier(&self, tier: ChunkTier) -> HotStats {
        match tier {
            ChunkTier::Device => self.hot_lock().stats(),
            ChunkTier::Pinned => self.pinned_lock().stats(),
        }
    }

    pub(super) fn pinned_lock(&self) -> std::sync::MutexGuard<'_, super::pinned::PinnedChunks> {
        self.pinned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn hot_lock(&self) -> std::sync::MutexGuard<'_, super::hot::HotChunks> {
        self.hot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How its weight matrices are kept.
    pub fn weights(&self) -> DeviceWeights {
        self.weights
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The tokenizer built from the file.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// An empty cache with room for `capacity` positions.
    pub fn new_cache(&self, capacity: usize) -> Result<DeviceCache> {
        let c = &self.config;
        let shape = (c.n_kv_head, capacity, c.head_dim);
        let zeros = || -> Result<Vec<Tensor>> {
            (0..c.n_layer)
                .map(|_| {
                    Ok(Tensor::zeros(
                        shape,
                        super::cache::CACHE_DTYPE,
                        &self.device,
                    )?)
                })
                .collect()
        };
        Ok(DeviceCache {
            k: zeros()?,
            v: zeros()?,
            capacity,
            len: 0,
        })
    }

    pub(super) fn upload_table(
        &self,
        table: &kernels::RopeTable,
        n: usize,
    ) -> Result<(Tensor, Tensor)> {
        let half = self.config.head_dim / 2;
        let t =
            |v: &[f32]| -> Result<Tensor> { Ok(Tensor::from_slice(v, (n, half), &self.device)?) };
        Ok((t(table.cos())?, t(table.sin())?))
    }

    /// RoPE of `x` `(n, heads, head_dim)` by the angles `cos`/`sin` `(n, head_dim / 2)`, in
    /// the model's pair layout: rotate-half as one fused kernel (candle-nn's `rope_thd`), the
    /// interleaved pairs as the CPU kernel's arithmetic, op for op.
    pub(super) fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (n, heads, d) = x.dims3()?;
        let half = d / 2;
        Ok(match self.rope.variant() {
            RopeVariant::RotateHalf => {
                let x = x.contiguous()?.reshape((1, n, heads, d))?;
                candle_nn::rotary_emb::rope_thd(&x, cos, sin)?.reshape((n, heads, d))?
            }
            RopeVariant::Interleaved => {
                let (cos, sin) = (cos.unsqueeze(1)?, sin.unsqueeze(1)?);
                let (cos, sin) = (&cos, &sin);
                let pairs = x.reshape((n, heads, half, 2))?;
                let a = pairs.narrow(3, 0, 1)?.squeeze(3)?;
                let b = pairs.narrow(3, 1, 1)?.squeeze(3)?;
                let ra = (a.broadcast_mul(cos)? - b.broadcast_mul(sin)?)?;
                let rb = (a.broadcast_mul(sin)? + b.broadcast_mul(cos)?)?;
                Tensor::stack(&[ra, rb], 3)?.reshape((n, heads, d))?
            }
        })
    }

    /// The cache rows of `positions` as scatter indexes `(n_kv_head, n, head_dim)`.
    pub(super) fn rows_index(&self, positions: &[usize]) -> Result<Tensor> {
        let (n, nkv, hd) = (positions.len(), self.config.n_kv_head, self.config.head_dim);
        let at: Vec<u32> = positions
            .iter()
            .flat_map(|&p| std::iter::repeat_n(p as u32, hd))
            .collect();
        let at = Tensor::from_vec(at, (1, n, hd), &self.device)?;
        Ok(at.broadcast_as((nkv, n, hd))?.contiguous()?)
    }
}

/// The file's matrix `name` on the device, kept as `weights` says.
fn matmul(f: &mut GgufFile, name: &str, device: &Device, weights: DeviceWeights) -> Result<Proj> {
    proj(
        Arc::new(to_device(f.tensor(name)?, device)?),
        device,
        weights,
    )
}

/// A quantized matrix already on the device, kept as `weights` says (dequantized there).
fn proj(q: Arc<QTensor>, device: &Device, weights: DeviceWeights) -> Result<Proj> {
    Ok(match weights {
        DeviceWeights::Quantized => Proj::Quantized(QMatMul::from_arc(q)?),
        DeviceWeights::Bf16 => Proj::Bf16(q.dequantize(device)?.to_dtype(DType::BF16)?),
    })
}

fn vector(f: &mut GgufFile, name: &str, device: &Device) -> Result<Tensor> {
    Ok(f.tensor(name)?
        .dequantize(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .to_device(device)?)
}

fn load_layer(
    f: &mut GgufFile,
    c: &ModelConfig,
    device: &Device,
    weights: DeviceWeights,
    l: usize,
) -> Result<Layer> {
    let p = |name: &str| format!("blk.{l}.{name}");
    let bias = if c.arch.qkv_bias() {
        Some([
            vector(f, &p("attn_q.bias"), device)?,
            vector(f, &p("attn_k.bias"), device)?,
            vector(f, &p("attn_v.bias"), device)?,
        ])
    } else {
        None
    };
    let (q_norm, k_norm) = if c.arch.qk_norm() {
        (
            Some(vector(f, &p("attn_q_norm.weight"), device)?),
            Some(vector(f, &p("attn_k_norm.weight"), device)?),
        )
    } else {
        (None, None)
    };
    Ok(Layer {
        attn_norm: vector(f, &p("attn_norm.weight"), device)?,
        ffn_norm: vector(f, &p("ffn_norm.weight"), device)?,
        qkv: Stack::of(vec![
            matmul(f, &p("attn_q.weight"), device, weights)?,
            matmul(f, &p("attn_k.weight"), device, weights)?,
            matmul(f, &p("attn_v.weight"), device, weights)?,
        ])?,
        wo: matmul(f, &p("attn_output.weight"), device, weights)?,
        bias,
        q_norm,
        k_norm,
        gate_up: Stack::of(vec![
            matmul(f, &p("ffn_gate.weight"), device, weights)?,
            matmul(f, &p("ffn_up.weight"), device, weights)?,
        ])?,
        down: matmul(f, &p("ffn_down.weight"), device, weights)?,
    })
}
