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

use crate::config::{Architecture, ModelConfig};
use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;
use crate::tokenizer::Tokenizer;
use candle_core::quantized::{QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use kernels::{Rope, RopeVariant};
use std::borrow::Cow;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

pub mod batcher;
pub mod blend;
mod shift;
pub use batcher::{
    closed_loop, closed_loop_chunked, BatchOutcome, BatchRequest, ClosedLoop, ContinuousBatcher,
};
pub use blend::{BlendTimes, RagPrompt, Verified};

/// Score matrices of one attention call stay under this many f32 values (1 GiB): longer
/// passes attend in blocks of query rows.
const MAX_SCORES: usize = 1 << 28;

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

/// One transformer block's weights on the device.
struct Layer {
    attn_norm: Tensor,
    ffn_norm: Tensor,
    wq: QMatMul,
    wk: QMatMul,
    wv: QMatMul,
    wo: QMatMul,
    bias: Option<[Tensor; 3]>,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    gate: QMatMul,
    up: QMatMul,
    down: QMatMul,
}

/// A model's weights on a device.
pub struct DeviceModel {
    device: Device,
    config: ModelConfig,
    tokenizer: Tokenizer,
    rope: Rope,
    embed: Tensor,
    layers: Vec<Layer>,
    output_norm: Tensor,
    lm_head: QMatMul,
}

impl std::fmt::Debug for DeviceModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceModel")
            .field("device", &self.device)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// The KV cache on the device: per layer, K and V `(n_kv_head, capacity, head_dim)`, row `p`
/// of each head holding position `p`. Head-major, so attention reads a prefix of every head
/// in place (no copy per step).
#[derive(Debug, Clone)]
pub struct DeviceCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    capacity: usize,
}

impl DeviceCache {
    /// Positions the cache has room for.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Layer `layer`'s K rows of `range` (kv heads x head dim each), in host memory.
    pub fn k_rows(&self, layer: usize, range: Range<usize>) -> Result<Vec<f32>> {
        Ok(self.k[layer]
            .narrow(1, range.start, range.len())?
            .transpose(0, 1)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    /// Layer `layer`'s V rows of `range` (kv heads x head dim each), in host memory.
    pub fn v_rows(&self, layer: usize, range: Range<usize>) -> Result<Vec<f32>> {
        Ok(self.v[layer]
            .narrow(1, range.start, range.len())?
            .transpose(0, 1)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    /// Writes layer `layer`'s K and V rows `range` from host memory (kv heads x head dim
    /// each, as [`DeviceCache::k_rows`] reads them).
    pub fn set_rows(
        &mut self,
        layer: usize,
        range: Range<usize>,
        k: &[f32],
        v: &[f32],
    ) -> Result<()> {
        let (heads, len) = (self.k[0].dim(0)?, range.len());
        let d = self.k[0].dim(2)?;
        if layer >= self.k.len()
            || range.end > self.capacity
            || k.len() != len * heads * d
            || v.len() != k.len()
        {
            return Err(EngineError::InvalidInput(format!(
                "{} K and {} V values for rows {range:?} of layer {layer} ({} layers, {} rows of {heads} x {d})",
                k.len(),
                v.len(),
                self.k.len(),
                self.capacity
            )));
        }
        let device = self.k[layer].device().clone();
        let up = |x: &[f32]| -> Result<Tensor> {
            Ok(Tensor::from_slice(x, (len, heads, d), &device)?
                .transpose(0, 1)?
                .contiguous()?)
        };
        self.k[layer].slice_set(&as_cached(&up(k)?)?, 1, range.start)?;
        self.v[layer].slice_set(&as_cached(&up(v)?)?, 1, range.start)?;
        Ok(())
    }

    /// Copies rows `range` of `from` (a cache of the same model) into the same rows here.
    pub fn copy_rows(&mut self, from: &DeviceCache, range: Range<usize>) -> Result<()> {
        if range.is_empty() {
            return Ok(());
        }
        if range.end > self.capacity.min(from.capacity) || from.k.len() != self.k.len() {
            return Err(EngineError::InvalidInput(format!(
                "rows {range:?} of a {}-layer cache of {} into a {}-layer cache of {}",
                from.k.len(),
                from.capacity,
                self.k.len(),
                self.capacity
            )));
        }
        for (to, from) in self.k.iter().zip(&from.k).chain(self.v.iter().zip(&from.v)) {
            to.slice_set(
                &from.narrow(1, range.start, range.len())?.contiguous()?,
                1,
                range.start,
            )?;
        }
        Ok(())
    }

    /// A copy that shares nothing with this one (candle tensors are shared by clone).
    pub fn deep_copy(&self) -> Result<Self> {
        let copy = |t: &[Tensor]| {
            t.iter()
                .map(Tensor::copy)
                .collect::<candle_core::Result<_>>()
        };
        Ok(Self {
            k: copy(&self.k)?,
            v: copy(&self.v)?,
            capacity: self.capacity,
        })
    }
}

/// A chunk's KV rows in host memory, every layer, in f16 as the chunk store keeps them,
/// computed at positions `base..base + len`: `k` and `v` laid out `(layer, kv head, row,
/// head_dim)` as the device cache holds them, so a chunk moves in one copy each.
#[derive(Debug, Clone)]
pub struct HostKv {
    pub base: usize,
    pub len: usize,
    pub k: Vec<half::f16>,
    pub v: Vec<half::f16>,
}

/// One pass's per-row inputs, uploaded once and shared by every layer.
struct Pass {
    cos: Tensor,
    sin: Tensor,
    /// Cache row of each value of the rows' K/V `(n_kv_head, n, head_dim)` (the scatter's
    /// indexes).
    rows_at: Tensor,
    /// Rows `0..rows` of the cache are read.
    rows: usize,
    /// Attention in blocks of query rows, each reading only the cache rows below its last.
    blocks: Vec<Block>,
}

/// Query rows `start..start + len` of a pass: they read cache rows `0..rows`.
struct Block {
    start: usize,
    len: usize,
    rows: usize,
    /// 0 where a query may read a key, -1e30 where it may not `(len, rows)`: built once per
    /// pass where small, else per layer from `qpos`.
    bias: Option<Tensor>,
    qpos: Tensor,
}

/// Masks of one pass kept for every layer up to this many values (256 MiB).
const MAX_KEPT_BIAS: usize = 1 << 26;

/// `q` in `device` memory, block for block.
fn to_device(q: QTensor, device: &Device) -> Result<QTensor> {
    if device.is_cpu() {
        return Ok(q);
    }
    let storage = QStorage::from_data(Cow::Owned(q.data()?.into_owned()), device, q.dtype())?;
    Ok(QTensor::new(storage, q.shape().clone())?)
}

impl DeviceModel {
    /// Loads a qwen2, llama or qwen3 GGUF file onto `device`.
    pub fn load(path: &Path, device: &Device) -> Result<Self> {
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
        let (rope, _) = crate::weights::load_rope(&mut f, &config)?;
        let mut layers = Vec::with_capacity(config.n_layer);
        for l in 0..config.n_layer {
            layers.push(load_layer(&mut f, &config, device, l)?);
        }
        let embed_q = Arc::new(to_device(f.tensor("token_embd.weight")?, device)?);
        let embed = embed_q.dequantize(device)?.to_dtype(DType::F32)?;
        let lm_head = if f.has_tensor("output.weight") {
            matmul(&mut f, "output.weight", device)?
        } else {
            QMatMul::from_arc(embed_q)?
        };
        let output_norm = vector(&mut f, "output_norm.weight", device)?;
        Ok(Self {
            device: device.clone(),
            config,
            tokenizer,
            rope,
            embed,
            layers,
            output_norm,
            lm_head,
        })
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
                .map(|_| Ok(Tensor::zeros(shape, DType::F32, &self.device)?))
                .collect()
        };
        Ok(DeviceCache {
            k: zeros()?,
            v: zeros()?,
            capacity,
        })
    }

    /// Runs every layer for `ids` at `positions` (any order, any gaps), writing their K/V rows
    /// into `cache` and attending causally by position to every row of `cache` up to each
    /// query's position; returns the final-normed hidden rows `(n, n_embd)`.
    pub fn forward(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut DeviceCache,
    ) -> Result<Tensor> {
        let (x, _) = self.run(ids, positions, cache, 0..self.config.n_layer, (None, None))?;
        fused_rms_norm(&x, &self.output_norm, self.config.rms_eps)
    }

    /// One decode step of several requests in one forward: row `i` is token `ids[i]` at
    /// `positions[i]` of `caches[i]` (its cache filled below it). The projections and the FFN
    /// run once over all rows; each row attends to its own cache. Returns the final-normed
    /// hidden rows `(requests, n_embd)`.
    pub fn forward_batch(
        &self,
        ids: &[u32],
        positions: &[usize],
        caches: &mut [DeviceCache],
    ) -> Result<Tensor> {
        let c = &self.config;
        let n = ids.len();
        if n == 0 || positions.len() != n || caches.len() != n {
            return Err(EngineError::InvalidInput(format!(
                "{n} token ids, {} positions and {} caches",
                positions.len(),
                caches.len()
            )));
        }
        if let Some((i, _)) = positions
            .iter()
            .zip(caches.iter())
            .enumerate()
            .find(|(_, (&p, cache))| p >= cache.capacity || cache.k.len() != c.n_layer)
        {
            return Err(EngineError::InvalidInput(format!(
                "request {i}: position {} does not fit its cache",
                positions[i]
            )));
        }
        let angles: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
        let (cos, sin) = self.upload_table(&self.rope.table(&angles), n)?;
        let mut x = self.embed(ids)?;
        for l in 0..c.n_layer {
            let w = &self.layers[l];
            let h = fused_rms_norm(&x, &w.attn_norm, c.rms_eps)?;
            let (q, k, v) = self.qkv(w, &h, &cos, &sin)?;
            let mut outs = Vec::with_capacity(n);
            for (i, cache) in caches.iter_mut().enumerate() {
                let p = positions[i];
                let row = |t: &Tensor| -> Result<Tensor> {
                    Ok(t.narrow(0, i, 1)?.transpose(0, 1)?.contiguous()?)
                };
                cache.k[l].slice_set(&as_cached(&row(&k)?)?, 1, p)?;
                let v = v.reshape((n, c.n_kv_head, c.head_dim))?;
                cache.v[l].slice_set(&as_cached(&row(&v)?)?, 1, p)?;
                let keys = cache.k[l].narrow(1, 0, p + 1)?;
                let values = cache.v[l].narrow(1, 0, p + 1)?;
                outs.push(self.attend_one(&q.narrow(0, i, 1)?, &keys, &values)?);
            }
            let attn = Tensor::cat(&outs, 0)?;
            x = self.ffn(w, x, &attn)?;
        }
        fused_rms_norm(&x, &self.output_norm, c.rms_eps)
    }

    /// Token embeddings `(n, n_embd)` of `ids`, each checked against the vocabulary.
    fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        let vocab = self.config.vocab_size;
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(EngineError::InvalidInput(format!(
                "token id {bad} >= vocabulary size {vocab}"
            )));
        }
        Ok(self
            .embed
            .index_select(&Tensor::new(ids, &self.device)?, 0)?)
    }

    /// One query row `(1, n_head, head_dim)` against every row of `keys`/`values`
    /// `(n_kv_head, rows, head_dim)` (no mask: the row is the latest); `(1, n_head * head_dim)`.
    fn attend_one(&self, q: &Tensor, keys: &Tensor, values: &Tensor) -> Result<Tensor> {
        let (_, nh, hd) = q.dims3()?;
        let nkv = self.config.n_kv_head;
        let q = q.reshape((nkv, nh / nkv, hd))?;
        let s = (q.matmul(&keys.t()?)? * (1.0 / (hd as f64).sqrt()))?;
        let p = candle_nn::ops::softmax_last_dim(&s)?;
        Ok(p.matmul(values)?.reshape((1, nh * hd))?)
    }

    /// The attention mass the rows `ids` at `positions` pay to every cache row at the layers
    /// `probe`, summed over rows, heads and those layers: one value per position up to the
    /// highest of `positions` ([`crate::Model::forward_probe`]'s quantity). Only layers
    /// `0..probe.end` run; their K/V rows of `positions` are written.
    pub fn probe(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut DeviceCache,
        probe: Range<usize>,
    ) -> Result<Vec<f32>> {
        let end = probe.end.min(self.config.n_layer);
        let (_, mass) = self.run(ids, positions, cache, 0..end, (Some(probe), None))?;
        match mass {
            Some(m) => Ok(m.to_vec1::<f32>()?),
            None => Ok(Vec::new()),
        }
    }

    /// Logits `(rows, vocabulary)` of final-normed hidden rows, cut to the tokenizer's
    /// vocabulary.
    pub fn logits(&self, hidden: &Tensor) -> Result<Vec<Vec<f32>>> {
        let vocab = self.tokenizer.vocab_size();
        let mut rows = self.lm_head.forward(hidden)?.to_vec2::<f32>()?;
        rows.iter_mut().for_each(|r| r.truncate(vocab));
        Ok(rows)
    }

    /// Logits of the last of the hidden rows.
    pub fn last_logits(&self, hidden: &Tensor) -> Result<Vec<f32>> {
        let n = hidden.dim(0)?;
        let mut rows = self.logits(&hidden.narrow(0, n - 1, 1)?)?;
        rows.pop()
            .ok_or_else(|| EngineError::Internal("no logits row".into()))
    }

    /// Full prefill of `ids` at `0..n` into a fresh cache with room for `capacity` positions
    /// (at least `n`); returns the cache and the last position's logits.
    pub fn prefill(&self, ids: &[u32], capacity: usize) -> Result<(DeviceCache, Vec<f32>)> {
        let mut cache = self.new_cache(capacity.max(ids.len()))?;
        let positions: Vec<usize> = (0..ids.len()).collect();
        let hidden = self.forward(ids, &positions, &mut cache)?;
        let logits = self.last_logits(&hidden)?;
        Ok((cache, logits))
    }

    /// Greedy continuation of `n` tokens after a cache filled up to `len` whose next-token
    /// logits are `logits`; one row per step.
    pub fn greedy(
        &self,
        cache: &mut DeviceCache,
        len: usize,
        logits: &[f32],
        n: usize,
    ) -> Result<Vec<u32>> {
        self.decode(
            cache,
            (len, logits),
            n,
            &crate::Sampler::new(Default::default()),
        )
    }

    /// [`DeviceModel::greedy`] drawing each token with `sampler` (the answer's i-th token at
    /// index i, as the CPU engine draws it).
    pub fn decode(
        &self,
        cache: &mut DeviceCache,
        (len, logits): (usize, &[f32]),
        n: usize,
        sampler: &crate::Sampler,
    ) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(n);
        let mut next = sampler.sample_at(logits, 0);
        for i in 0..n {
            out.push(next);
            if i + 1 == n {
                break;
            }
            let hidden = self.forward(&[next], &[len + i], cache)?;
            next = sampler.sample_at(&self.last_logits(&hidden)?, i + 1);
        }
        Ok(out)
    }

    /// Greedy continuations of `n` tokens for several requests decoded together
    /// ([`DeviceModel::forward_batch`] per step): request `i`'s cache is filled up to
    /// `lens[i]` and its next-token logits are `logits[i]`.
    pub fn greedy_batch(
        &self,
        caches: &mut [DeviceCache],
        lens: &[usize],
        logits: &[Vec<f32>],
        n: usize,
    ) -> Result<Vec<Vec<u32>>> {
        let mut next: Vec<u32> = logits.iter().map(|l| crate::argmax(l)).collect();
        let mut out = vec![Vec::with_capacity(n); next.len()];
        for step in 0..n {
            out.iter_mut().zip(&next).for_each(|(o, &t)| o.push(t));
            if step + 1 == n {
                break;
            }
            let positions: Vec<usize> = lens.iter().map(|&l| l + step).collect();
            let hidden = self.forward_batch(&next, &positions, caches)?;
            next = self
                .logits(&hidden)?
                .iter()
                .map(|l| crate::argmax(l))
                .collect();
        }
        Ok(out)
    }

    /// Rows `range` of `cache` copied to host memory in f16, as a chunk store keeps them.
    pub fn download(&self, cache: &DeviceCache, range: Range<usize>) -> Result<HostKv> {
        let get = |layers: &[Tensor]| -> Result<Vec<half::f16>> {
            if range.is_empty() {
                return Ok(Vec::new());
            }
            let rows = layers
                .iter()
                .map(|t| t.narrow(1, range.start, range.len()))
                .collect::<candle_core::Result<Vec<_>>>()?;
            Ok(Tensor::stack(&rows, 0)?
                .to_dtype(DType::F16)?
                .flatten_all()?
                .to_vec1::<half::f16>()?)
        };
        Ok(HostKv {
            base: range.start,
            len: range.len(),
            k: get(&cache.k)?,
            v: get(&cache.v)?,
        })
    }

    /// Writes `kv` into `cache` at positions `at..at + kv.len`: one upload each for K and V,
    /// K rotated by `at - kv.base` positions on the device (positional recovery), then a copy
    /// per layer into the cache.
    pub fn place(&self, cache: &mut DeviceCache, kv: &HostKv, at: usize) -> Result<()> {
        let c = &self.config;
        let row = c.kv_row();
        let size = c.n_layer * kv.len * row;
        if at + kv.len > cache.capacity || kv.k.len() != size || kv.v.len() != size {
            return Err(EngineError::InvalidInput(format!(
                "a chunk KV of {} rows ({} K values, {} V values) does not fit at {at} in a \
                 {}-layer cache of {} positions",
                kv.len,
                kv.k.len(),
                kv.v.len(),
                c.n_layer,
                cache.capacity
            )));
        }
        if kv.len == 0 {
            return Ok(());
        }
        let shape = (c.n_layer, c.n_kv_head, kv.len, c.head_dim);
        let up = |data: &[half::f16]| -> Result<Tensor> {
            Ok(Tensor::from_slice(data, shape, &self.device)?.to_dtype(DType::F32)?)
        };
        let delta = at as i64 - kv.base as i64;
        let mut k = up(&kv.k)?;
        if delta != 0 {
            // One angle for every row: one "token" whose heads are all the chunk's.
            let (cos, sin) = self.upload_table(&self.rope.table(&[delta]), 1)?;
            let heads = c.n_layer * kv.len * c.n_kv_head;
            let flat = k.reshape((1, heads, c.head_dim))?;
            // Rotated in f32, then rounded as every cache write is (the CPU's `place_chunk`).
            k = as_cached(&self.rotate(&flat, &cos, &sin)?.reshape(shape)?)?;
        }
        let v = up(&kv.v)?;
        for l in 0..c.n_layer {
            cache.k[l].slice_set(&k.get(l)?, 1, at)?;
            cache.v[l].slice_set(&v.get(l)?, 1, at)?;
        }
        Ok(())
    }

    fn upload_table(&self, table: &kernels::RopeTable, n: usize) -> Result<(Tensor, Tensor)> {
        let half = self.config.head_dim / 2;
        let t =
            |v: &[f32]| -> Result<Tensor> { Ok(Tensor::from_slice(v, (n, half), &self.device)?) };
        Ok((t(table.cos())?, t(table.sin())?))
    }

    /// RoPE of `x` `(n, heads, head_dim)` by the angles `cos`/`sin` `(n, head_dim / 2)`, in
    /// the model's pair layout: rotate-half as one fused kernel (candle-nn's `rope_thd`), the
    /// interleaved pairs as the CPU kernel's arithmetic, op for op.
    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
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
    fn rows_index(&self, positions: &[usize]) -> Result<Tensor> {
        let (n, nkv, hd) = (positions.len(), self.config.n_kv_head, self.config.head_dim);
        let at: Vec<u32> = positions
            .iter()
            .flat_map(|&p| std::iter::repeat_n(p as u32, hd))
            .collect();
        let at = Tensor::from_vec(at, (1, n, hd), &self.device)?;
        Ok(at.broadcast_as((nkv, n, hd))?.contiguous()?)
    }

    fn pass(&self, positions: &[usize], cache: &DeviceCache) -> Result<Pass> {
        let n = positions.len();
        let rows = positions.iter().max().map_or(0, |&p| p + 1);
        if rows > cache.capacity {
            return Err(EngineError::InvalidInput(format!(
                "position {} is beyond the cache's {} positions",
                rows - 1,
                cache.capacity
            )));
        }
        let angles: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
        let (cos, sin) = self.upload_table(&self.rope.table(&angles), n)?;
        Ok(Pass {
            cos,
            sin,
            rows_at: self.rows_index(positions)?,
            rows,
            blocks: self.blocks(positions, rows)?,
        })
    }

    /// The attention blocks of a pass over `positions` reading at most `rows` cache rows.
    fn blocks(&self, positions: &[usize], rows: usize) -> Result<Vec<Block>> {
        let n = positions.len();
        let size = (MAX_SCORES / (self.config.n_head * rows).max(1)).clamp(1, n);
        let keep = n * rows <= MAX_KEPT_BIAS;
        let kpos = Tensor::arange(0u32, rows as u32, &self.device)?.reshape((1, rows))?;
        let mut blocks = Vec::new();
        for start in (0..n).step_by(size) {
            let len = size.min(n - start);
            let here = &positions[start..start + len];
            let top = here.iter().max().map_or(1, |&p| p + 1);
            let qpos: Vec<u32> = here.iter().map(|&p| p as u32).collect();
            let qpos = Tensor::from_vec(qpos, (len, 1), &self.device)?;
            let bias = if keep {
                Some(mask(&kpos.narrow(1, 0, top)?, &qpos)?)
            } else {
                None
            };
            blocks.push(Block {
                start,
                len,
                rows: top,
                bias,
                qpos,
            });
        }
        Ok(blocks)
    }

    /// Layers `layers` over the rows `ids` at `positions`; the residual stream after the last
    /// and, with `probe`, the attention mass of the probed layers; with `shift`, each chunk's
    /// reused rows moved at every layer as its recomputed rows were (`shift.rs`).
    fn run(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut DeviceCache,
        layers: Range<usize>,
        (probe, shift): (Option<Range<usize>>, Option<&shift::DeviceShift>),
    ) -> Result<(Tensor, Option<Tensor>)> {
        let c = &self.config;
        if ids.is_empty() || ids.len() != positions.len() {
            return Err(EngineError::InvalidInput(format!(
                "{} token ids at {} positions",
                ids.len(),
                positions.len()
            )));
        }
        if cache.k.len() != c.n_layer || layers.end > c.n_layer {
            return Err(EngineError::InvalidInput(
                "cache or layers do not fit this model".into(),
            ));
        }
        let pass = self.pass(positions, cache)?;
        let mut x = self.embed(ids)?;
        let mut mass = None;
        for l in layers {
            let probed = probe.as_ref().is_some_and(|p| p.contains(&l));
            let (y, m) = self.layer(l, x, &pass, cache, (probed, shift))?;
            x = y;
            if let Some(m) = m {
                mass = Some(match mass {
                    None => m,
                    Some(acc) => (acc + m)?,
                });
            }
        }
        Ok((x, mass))
    }

    /// One block: attention (its K/V rows written to the cache first), then the FFN.
    fn layer(
        &self,
        l: usize,
        x: Tensor,
        pass: &Pass,
        cache: &mut DeviceCache,
        (probed, shift): (bool, Option<&shift::DeviceShift>),
    ) -> Result<(Tensor, Option<Tensor>)> {
        let c = &self.config;
        let w = &self.layers[l];
        let n = x.dim(0)?;
        let h = fused_rms_norm(&x, &w.attn_norm, c.rms_eps)?;
        let (q, k, v) = self.qkv(w, &h, &pass.cos, &pass.sin)?;
        let head_major = |t: Tensor| -> Result<Tensor> {
            let t = t.reshape((n, c.n_kv_head, c.head_dim))?;
            Ok(t.transpose(0, 1)?.contiguous()?)
        };
        let (k, v) = (head_major(k)?, head_major(v)?);
        let moves = match shift {
            Some(s) => Some(self.shift_moves(l, s, cache, (&k, &v))?),
            None => None,
        };
        cache.k[l].scatter_set(&pass.rows_at, &as_cached(&k)?, 1)?;
        cache.v[l].scatter_set(&pass.rows_at, &as_cached(&v)?, 1)?;
        if let (Some(s), Some(m)) = (shift, moves) {
            self.apply_shift(l, s, &m, cache)?;
        }
        let keys = cache.k[l].narrow(1, 0, pass.rows)?;
        let values = cache.v[l].narrow(1, 0, pass.rows)?;
        let (attn, mass) = self.attention(&q, &keys, &values, pass, probed)?;
        Ok((self.ffn(w, x, &attn)?, mass))
    }

    /// Q `(n, n_head, head_dim)` and K `(n, n_kv_head, head_dim)` (biased, head-normed where
    /// the family does, rotated) and V `(n, kv_row)` of normed rows `h`.
    fn qkv(
        &self,
        w: &Layer,
        h: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let c = &self.config;
        let n = h.dim(0)?;
        let (mut q, mut k, mut v) = (w.wq.forward(h)?, w.wk.forward(h)?, w.wv.forward(h)?);
        if let Some([bq, bk, bv]) = &w.bias {
            q = q.broadcast_add(bq)?;
            k = k.broadcast_add(bk)?;
            v = v.broadcast_add(bv)?;
        }
        let heads = |t: Tensor, h: usize, norm: &Option<Tensor>| -> Result<Tensor> {
            let t = t.reshape((n, h, c.head_dim))?;
            let t = match norm {
                Some(w) => fused_rms_norm(&t, w, c.rms_eps)?,
                None => t,
            };
            self.rotate(&t, cos, sin)
        };
        let q = heads(q, c.n_head, &w.q_norm)?;
        let k = heads(k, c.n_kv_head, &w.k_norm)?;
        Ok((q, k, v))
    }

    /// The rest of a block after attention: the output projection added to the residual
    /// stream `x`, then the gated FFN the same way.
    fn ffn(&self, w: &Layer, x: Tensor, attn: &Tensor) -> Result<Tensor> {
        let x = (x + w.wo.forward(attn)?)?;
        let h = fused_rms_norm(&x, &w.ffn_norm, self.config.rms_eps)?;
        let act = (w.gate.forward(&h)?.silu()? * w.up.forward(&h)?)?;
        Ok((x + w.down.forward(&act)?)?)
    }

    /// Causal attention of `q` `(n, n_head, head_dim)` over the cache's first rows of every
    /// head `(n_kv_head, rows, head_dim)` (views, read in place): a
    /// query at position p reads rows `0..=p`. Each block of query rows reads only the rows
    /// below its last query and keeps its score matrix bounded. With `probed`, also the
    /// probabilities summed per key row `(rows)`.
    fn attention(
        &self,
        q: &Tensor,
        keys: &Tensor,
        values: &Tensor,
        pass: &Pass,
        probed: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let c = &self.config;
        let (n, nh, hd) = q.dims3()?;
        let (nkv, rows) = (c.n_kv_head, keys.dim(1)?);
        let g = nh / nkv;
        let (k, v) = (keys, values);
        let scale = 1.0 / (hd as f64).sqrt();
        let (mut outs, mut mass) = (Vec::new(), None);
        for b in &pass.blocks {
            let (m, top) = (b.len, b.rows);
            let bias = match &b.bias {
                Some(bias) => bias.clone(),
                None => {
                    let kpos = Tensor::arange(0u32, top as u32, &self.device)?;
                    mask(&kpos.reshape((1, top))?, &b.qpos)?
                }
            };
            let qb = q.narrow(0, b.start, m)?.transpose(0, 1)?.contiguous()?;
            let qb = qb.reshape((nkv, g * m, hd))?;
            let kt = k.narrow(1, 0, top)?.t()?;
            let s = (qb.matmul(&kt)? * scale)?.reshape((nkv, g, m, top))?;
            let p = candle_nn::ops::softmax_last_dim(&s.broadcast_add(&bias)?)?;
            if probed {
                let here = p.sum((0, 1, 2))?.pad_with_zeros(0, 0, rows - top)?;
                mass = Some(match mass {
                    None => here,
                    Some(acc) => (acc + here)?,
                });
            }
            let o = p
                .reshape((nkv, g * m, top))?
                .matmul(&v.narrow(1, 0, top)?)?;
            outs.push(o.reshape((nh, m, hd))?.transpose(0, 1)?.contiguous()?);
        }
        let out = Tensor::cat(&outs, 0)?.reshape((n, nh * hd))?;
        Ok((out, mass))
    }
}

/// 0 where key position `kpos` `(1, rows)` may be read by query position `qpos` `(m, 1)`
/// (key <= query), -1e30 where not: `(m, rows)`.
fn mask(kpos: &Tensor, qpos: &Tensor) -> Result<Tensor> {
    Ok(((kpos.broadcast_le(qpos)?.to_dtype(DType::F32)? - 1.0)? * 1e30)?)
}

/// RMSNorm over the last dimension as one kernel (candle-nn's), for contiguous rows.
fn fused_rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(candle_nn::ops::rms_norm(&x.contiguous()?, w, eps as f32)?)
}

fn matmul(f: &mut GgufFile, name: &str, device: &Device) -> Result<QMatMul> {
    Ok(QMatMul::from_arc(Arc::new(to_device(
        f.tensor(name)?,
        device,
    )?))?)
}

fn vector(f: &mut GgufFile, name: &str, device: &Device) -> Result<Tensor> {
    Ok(f.tensor(name)?
        .dequantize(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .to_device(device)?)
}

fn load_layer(f: &mut GgufFile, c: &ModelConfig, device: &Device, l: usize) -> Result<Layer> {
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
        wq: matmul(f, &p("attn_q.weight"), device)?,
        wk: matmul(f, &p("attn_k.weight"), device)?,
        wv: matmul(f, &p("attn_v.weight"), device)?,
        wo: matmul(f, &p("attn_output.weight"), device)?,
        bias,
        q_norm,
        k_norm,
        gate: matmul(f, &p("ffn_gate.weight"), device)?,
        up: matmul(f, &p("ffn_up.weight"), device)?,
        down: matmul(f, &p("ffn_down.weight"), device)?,
    })
}

/// K or V rows as a cache keeps them: every value rounded to the nearest f16, as the CPU
/// engine's cache ([`crate::KvCache`]) and the chunk store hold them, so a GPU prefill keeps
/// the rows a stored chunk gives back.
pub(crate) fn as_cached(rows: &Tensor) -> Result<Tensor> {
    Ok(rows.to_dtype(DType::F16)?.to_dtype(DType::F32)?)
}
