//! Attention as one kernel: `kernels/src/cuda/flash_attention.cu` (an online softmax on tensor
//! cores, no score matrix in memory), compiled at run time by NVRTC on the GPU, for any query
//! rows at any positions against the position-indexed cache. On candle's CPU device the same
//! op runs a plain f32 reference of the same contract, so the suite checks everything around
//! the kernel (layouts, positions, grouped heads, the switch) without a GPU; the kernel itself
//! is checked on the CPU by `kernels/tests/flash_attention_emulated.rs`.

use super::cache::{DeviceCache, CACHE_DTYPE};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType, Device, Layout, Shape, Tensor};

/// How the device engine attends (`SPECRAG_DEVICE_ATTENTION`, `gpu_check --attention`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceAttention {
    /// candle ops: f32 score matrices in blocks of query rows (the reference).
    Ops,
    /// One fused kernel per layer: f16 queries and probabilities, f32 accumulation.
    Fused,
}

impl DeviceAttention {
    /// Its name in flags and fingerprints.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ops => "ops",
            Self::Fused => "fused",
        }
    }

    /// `ops` or `fused`.
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim() {
            "ops" => Ok(Self::Ops),
            "fused" => Ok(Self::Fused),
            other => Err(EngineError::InvalidInput(format!(
                "device attention `{other}`: expected ops (candle ops, f32 scores) or fused \
                 (one kernel per layer)"
            ))),
        }
    }
}

/// Head sizes the kernel is built for (the CPU reference takes any).
pub(super) const FUSED_HEAD_DIMS: [usize; 2] = [64, 128];

/// Causal attention of `q` `(n, n_head, head_dim)` f32 over `k`, `v` `(n_kv_head, cap,
/// head_dim)` f16 (a layer's whole cache), row `i` reading cache rows `0..=pos[i]`; `(n,
/// n_head * head_dim)` in `out` (f32, or bf16: the output projection's bf16 input, each value
/// the f32 one rounded). Every tensor contiguous, `pos` u32 `(n)`, all on one device.
pub(super) fn fused_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    pos: &Tensor,
    out: DType,
) -> Result<Tensor> {
    let (n, n_head, head_dim) = q.dims3()?;
    let (n_kv_head, cap, kd) = k.dims3()?;
    if kd != head_dim || v.dims3()? != (n_kv_head, cap, head_dim) || pos.dims1()? != n {
        return Err(EngineError::Internal(format!(
            "fused attention: q {:?}, k {:?}, v {:?}, positions {:?}",
            q.dims(),
            k.dims(),
            v.dims(),
            pos.dims()
        )));
    }
    let kernel = !q.device().is_cpu();
    if n_kv_head == 0 || n_head % n_kv_head != 0 || kernel && !FUSED_HEAD_DIMS.contains(&head_dim) {
        return Err(EngineError::InvalidInput(format!(
            "fused attention: {n_head} heads over {n_kv_head} kv heads of size {head_dim} \
             (the kernel is built for sizes {FUSED_HEAD_DIMS:?})"
        )));
    }
    if n == 0 {
        return Ok(Tensor::zeros((0, n_head * head_dim), out, q.device())?);
    }
    let op = Fused {
        pos: pos.clone(),
        n_head,
        n_kv_head,
        head_dim,
        cap,
        bf16_out: out == DType::BF16,
    };
    let out = q.apply_op3_no_bwd(k, v, &op)?;
    Ok(out.reshape((n, n_head * head_dim))?)
}

/// Runs the fused op on `device` for `config`'s heads (80 random rows at scattered positions
/// over a 192-row cache) against its CPU reference; an error where they differ by more than
/// f16 inputs explain, or where the kernel does not build or launch. On the CPU device the op
/// is the reference, so only the shapes are checked.
pub(super) fn self_check(device: &Device, config: &ModelConfig) -> Result<()> {
    let (nh, nkv, hd) = (config.n_head, config.n_kv_head, config.head_dim);
    let (n, cap) = (80usize, 192usize);
    let cpu = Device::Cpu;
    let pos: Vec<u32> = (0..n).map(|i| ((i * 37 + 11) % cap) as u32).collect();
    let pos = Tensor::from_vec(pos, n, &cpu)?;
    let q = Tensor::rand(-1f32, 1f32, (n, nh, hd), &cpu)?;
    let k = Tensor::rand(-1f32, 1f32, (nkv, cap, hd), &cpu)?.to_dtype(CACHE_DTYPE)?;
    let v = Tensor::rand(-1f32, 1f32, (nkv, cap, hd), &cpu)?.to_dtype(CACHE_DTYPE)?;
    let want = fused_attention(&q, &k, &v, &pos, DType::F32)?;
    if device.is_cpu() {
        return Ok(());
    }
    let on = |t: &Tensor| t.to_device(device);
    let mut diff = 0f32;
    // Both outputs: f32, and bf16 (within its rounding of values under 1).
    for out in [DType::F32, DType::BF16] {
        let got = fused_attention(&on(&q)?, &on(&k)?, &on(&v)?, &on(&pos)?, out)?
            .to_device(&cpu)?
            .to_dtype(DType::F32)?;
        diff = diff.max((got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?);
    }
    if diff.is_nan() || diff > SELF_CHECK_TOLERANCE {
        return Err(EngineError::Internal(format!(
            "the fused attention kernel differs from its reference by {diff} (bound \
             {SELF_CHECK_TOLERANCE}) at {nh} heads over {nkv} of size {hd}"
        )));
    }
    decode_self_check(device, config)
}

/// The batched decode kernel on `device` against the reference: three requests with caches
/// of their own sizes, each its row written and attended to, the longest over several key
/// ranges merged ([`decode_splits`]); the outputs and the written rows.
fn decode_self_check(device: &Device, config: &ModelConfig) -> Result<()> {
    let (nh, nkv, hd) = (config.n_head, config.n_kv_head, config.head_dim);
    let cpu = Device::Cpu;
    let (mut caches, mut want, mut rows) = (Vec::new(), Vec::new(), Vec::new());
    let positions = [5usize, 70, 400];
    let q = Tensor::rand(-1f32, 1f32, (3, nh, hd), &cpu)?;
    let k_new = Tensor::rand(-1f32, 1f32, (3, nkv, hd), &cpu)?;
    let v_new = Tensor::rand(-1f32, 1f32, (3, nkv, hd), &cpu)?;
    for (i, &p) in positions.iter().enumerate() {
        let cap = p + 1 + 3 * i;
        let k = Tensor::rand(-1f32, 1f32, (nkv, cap, hd), &cpu)?.to_dtype(CACHE_DTYPE)?;
        let v = Tensor::rand(-1f32, 1f32, (nkv, cap, hd), &cpu)?.to_dtype(CACHE_DTYPE)?;
        caches.push(DeviceCache {
            k: vec![k.to_device(device)?],
            v: vec![v.to_device(device)?],
            capacity: cap,
            len: p,
        });
        // The reference: the row written into a CPU copy, then attended to.
        let row =
            |t: &Tensor| -> Result<Tensor> { Ok(t.get(i)?.unsqueeze(1)?.to_dtype(CACHE_DTYPE)?) };
        let (kr, vr) = (row(&k_new)?, row(&v_new)?);
        let (k, v) = (
            k.slice_assign(&[0..nkv, p..p + 1, 0..hd], &kr)?,
            v.slice_assign(&[0..nkv, p..p + 1, 0..hd], &vr)?,
        );
        let pos = Tensor::new(&[p as u32], &cpu)?;
        want.push(fused_attention(
            &q.narrow(0, i, 1)?,
            &k,
            &v,
            &pos,
            DType::F32,
        )?);
        rows.push((kr, vr));
    }
    let Some(batch) = DecodeBatch::new(&caches, &positions)? else {
        return Ok(());
    };
    let on = |t: &Tensor| t.to_device(device);
    let flat = |t: &Tensor| -> Result<Tensor> { Ok(on(&t.flatten_from(1)?)?) };
    let want = Tensor::cat(&want, 0)?.flatten_from(1)?;
    let mut diff = 0f32;
    // Both outputs: f32, and bf16 (the step run again writes the same rows).
    for out in [DType::F32, DType::BF16] {
        let got = batch
            .attend(0, &flat(&q)?, &flat(&k_new)?, &flat(&v_new)?, out)?
            .to_device(&cpu)?
            .to_dtype(DType::F32)?;
        diff = diff.max((got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?);
    }
    for ((cache, &p), (kr, vr)) in caches.iter().zip(&positions).zip(&rows) {
        let written = |t: &Tensor, r: &Tensor| -> Result<f32> {
            let t = t
                .narrow(1, p, 1)?
                .to_device(&cpu)?
                .to_dtype(candle_core::DType::F32)?;
            Ok((t - r.to_dtype(candle_core::DType::F32)?)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?)
        };
        diff = diff
            .max(written(&cache.k[0], kr)?)
            .max(written(&cache.v[0], vr)?);
    }
    if diff <= SELF_CHECK_TOLERANCE {
        Ok(())
    } else {
        Err(EngineError::Internal(format!(
            "the batched decode kernel differs from its reference by {diff} (bound \
             {SELF_CHECK_TOLERANCE}) at {nh} heads over {nkv} of size {hd}"
        )))
    }
}

/// f16 queries and probabilities against f32 ones, on unit-range data: ~1e-3.
const SELF_CHECK_TOLERANCE: f32 = 1e-2;

/// One decode step of several requests, attention at every layer in one launch each
/// (`kernels/src/cuda/decode_attention.cu`): the requests' layer caches as device pointers,
/// uploaded once per step, with their capacities and row positions. Only on a GPU with the
/// fused attention on; elsewhere each request attends on its own (its cache written by
/// candle ops).
pub(super) struct DecodeBatch {
    /// `(layers, 2, requests)` device pointers (as i64): each request's K, then V cache.
    ptrs: Tensor,
    caps: Tensor,
    pos: Tensor,
    requests: usize,
    /// The most keys a request of the step attends to (its position + 1).
    longest: usize,
    head_dim: usize,
}

/// Blocks a decode launch should give the GPU: about two per SM of an H100/H200 (132 SMs).
const DECODE_TARGET_BLOCKS: usize = 256;
/// The fewest keys worth a block of their own (below, the merge costs more than it saves).
const DECODE_MIN_KEYS_PER_SPLIT: usize = 128;
/// The most ranges a request's keys are cut into (the merge reads them all).
const DECODE_MAX_SPLITS: usize = 64;

/// How many ranges the batched decode cuts each request's keys into, one block each, for
/// `requests` requests of `n_head` heads whose longest attends to `longest` keys: enough
/// blocks to fill the GPU where few requests and heads would leave most SMs idle over a long
/// cache (one request of the 7B shape has 28 blocks without), never a range under
/// [`DECODE_MIN_KEYS_PER_SPLIT`] keys; 1 (no merge) where the batch fills it already.
pub(super) fn decode_splits(requests: usize, n_head: usize, longest: usize) -> usize {
    let blocks = (requests * n_head).max(1);
    let for_the_gpu = DECODE_TARGET_BLOCKS.div_ceil(blocks);
    let for_the_keys = longest / DECODE_MIN_KEYS_PER_SPLIT;
    for_the_gpu.min(for_the_keys).clamp(1, DECODE_MAX_SPLITS)
}

impl DecodeBatch {
    /// The batch of `caches` stepping at `positions`, where the kernel runs (a CUDA device,
    /// head size 64 or 128); `None` elsewhere. It holds the caches' addresses, not the caches:
    /// build it and use it within one step, the caches neither grown nor dropped between.
    pub(super) fn new(caches: &[DeviceCache], positions: &[usize]) -> Result<Option<Self>> {
        let Some(first) = caches.first().and_then(|c| c.k.first()) else {
            return Ok(None);
        };
        if positions.len() != caches.len() {
            return Err(EngineError::Internal(format!(
                "batched decode: {} positions for {} caches",
                positions.len(),
                caches.len()
            )));
        }
        let (_, _, hd) = first.dims3()?;
        if first.device().is_cpu() || !FUSED_HEAD_DIMS.contains(&hd) {
            return Ok(None);
        }
        #[cfg(feature = "cuda")]
        {
            let [ptrs, caps, pos] = cuda::decode_tables(caches, positions)?;
            Ok(Some(Self {
                ptrs,
                caps,
                pos,
                requests: caches.len(),
                longest: positions.iter().max().map_or(1, |&p| p + 1),
                head_dim: hd,
            }))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = positions;
            Ok(None)
        }
    }

    /// Each request's row position `(requests)` u32, on the device.
    pub(super) fn positions(&self) -> &Tensor {
        &self.pos
    }

    /// Layer `layer` of the step: each request's new K and V rows (`k`, `v` `(requests,
    /// n_kv_head * head_dim)` f32) written into its cache as f16, and its query row (`q`
    /// `(requests, n_head * head_dim)` f32) attending to that cache up to the row; `(requests,
    /// n_head * head_dim)`. Each may be a column range of wider rows (the Q/K/V epilogue's
    /// rows mode), K and V of the same row stride. The output in `out`: f32, or bf16 (the
    /// output projection's input, the f32 values rounded).
    pub(super) fn attend(
        &self,
        layer: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: DType,
    ) -> Result<Tensor> {
        let (r, q_width) = q.dims2()?;
        let (rk, kv_width) = k.dims2()?;
        let hd = self.head_dim;
        let unit_columns = |t: &Tensor| t.stride().get(1) == Some(&1);
        // The kernel maps query head h to kv head h / (n_head / n_kv_head) unchecked.
        let grouped = kv_width > 0 && q_width > 0 && (q_width / hd).is_multiple_of(kv_width / hd);
        if r != self.requests
            || rk != r
            || q_width % hd != 0
            || kv_width % hd != 0
            || !grouped
            || v.dims2()? != (r, kv_width)
            || ![q, k, v].into_iter().all(unit_columns)
            || k.stride() != v.stride()
        {
            return Err(EngineError::Internal(format!(
                "batched decode: q {:?}, k {:?}, v {:?} for {} requests of head size {hd}",
                q.dims(),
                k.dims(),
                v.dims(),
                self.requests
            )));
        }
        let (n_head, n_kv_head) = (q_width / hd, kv_width / hd);
        let op = DecodeOp {
            ptrs: self.ptrs.get(layer)?,
            caps: self.caps.clone(),
            pos: self.pos.clone(),
            n_head,
            n_kv_head,
            head_dim: hd,
            splits: decode_splits(r, n_head, self.longest),
            bf16_out: out == DType::BF16,
        };
        Ok(q.apply_op3_no_bwd(k, v, &op)?.reshape((r, n_head * hd))?)
    }
}

/// [`DecodeBatch::attend`] at one layer, as a candle op on (q, k, v).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct DecodeOp {
    /// `(2, requests)`: this layer's K and V cache pointers.
    ptrs: Tensor,
    caps: Tensor,
    pos: Tensor,
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    /// Ranges each request's keys are cut into ([`decode_splits`]).
    splits: usize,
    /// The output as bf16 rather than f32.
    bf16_out: bool,
}

impl CustomOp3 for DecodeOp {
    fn name(&self) -> &'static str {
        "specrag-batched-decode-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("the batched decode kernel runs on a GPU only")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &Layout,
        ks: &candle_core::CudaStorage,
        kl: &Layout,
        vs: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let tables = [&self.ptrs, &self.caps, &self.pos];
        let dims = [self.n_head, self.n_kv_head, self.head_dim, self.splits];
        let inputs = [(qs, ql), (ks, kl), (vs, vl)];
        if self.bf16_out {
            cuda::launch_decode::<half::bf16>(tables, dims, inputs)
        } else {
            cuda::launch_decode::<f32>(tables, dims, inputs)
        }
    }
}

/// What the Q/K/V epilogue reads besides the product and where it writes (one layer of one
/// pass): the layer's K and V cache (or none: a batched decode's rows, each for its own
/// request's cache), each row's RoPE angles and position, the biases.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) struct Epilogue<'a> {
    pub(super) cache: Option<(&'a Tensor, &'a Tensor)>,
    pub(super) cos: &'a Tensor,
    pub(super) sin: &'a Tensor,
    pub(super) pos: &'a Tensor,
    pub(super) biases: Option<&'a [Tensor; 3]>,
    pub(super) n_head: usize,
    pub(super) n_kv_head: usize,
    pub(super) head_dim: usize,
    /// RoPE pairs `(2m, 2m + 1)` rather than `(m, m + head_dim / 2)`.
    pub(super) interleaved: bool,
}

impl Epilogue<'_> {
    /// The rows of the cache it writes (every position in range where it writes none).
    fn cache_rows(&self) -> Result<usize> {
        let Some((kc, vc)) = self.cache else {
            return Ok(i32::MAX as usize);
        };
        let (heads, cap, d) = kc.dims3()?;
        if (heads, d) != (self.n_kv_head, self.head_dim) || vc.dims3()? != (heads, cap, d) {
            return Err(EngineError::Internal(
                "qkv epilogue: the caches do not fit the heads".into(),
            ));
        }
        Ok(cap)
    }
}

/// On a GPU, one launch (`kernels/src/cuda/qkv_epilogue.cu`) for what follows the Q/K/V
/// product `q`, `k`, `v` (rows, f32 or bf16; column ranges of one product or apart): the
/// biases, RoPE, Q back `(n, n_head, head_dim)`, K and V written into `e`'s cache at each
/// row's position as f16, as candle ops would (`DeviceModel::qkv`, `as_cached`, the
/// scatter). The caller keeps the cache alive and ungrown through the call. Without a cache,
/// each row back as `(n, (n_head + 2 n_kv_head) head_dim)` f32: Q, K and V, for
/// [`DecodeBatch::attend`].
pub(super) fn qkv_epilogue(q: &Tensor, k: &Tensor, v: &Tensor, e: &Epilogue<'_>) -> Result<Tensor> {
    let (n_kv_head, hd) = (e.n_kv_head, e.head_dim);
    let cap = e.cache_rows()?;
    if q.device().is_cpu() {
        return Err(EngineError::Internal(
            "the qkv epilogue runs on a GPU".into(),
        ));
    }
    // The kernel reads and writes by these shapes unchecked: check them here.
    let n = q.dim(0)?;
    let rows_of = |t: &Tensor, width: usize| t.dims2().is_ok_and(|d| d == (n, width));
    let (q_width, kv_width) = (e.n_head * hd, n_kv_head * hd);
    let widths = e.biases.is_none_or(|b| {
        [q_width, kv_width, kv_width]
            .iter()
            .zip(b)
            .all(|(&w, t)| t.dims1().is_ok_and(|d| d == w))
    });
    let table = |t: &Tensor| t.dims2().is_ok_and(|d| d == (n, hd / 2));
    // The kernel is picked by Q's element type and reads K and V as the same.
    let one_dtype = k.dtype() == q.dtype() && v.dtype() == q.dtype();
    if n == 0
        || hd % 2 != 0
        || !one_dtype
        || !rows_of(q, q_width)
        || !rows_of(k, kv_width)
        || !rows_of(v, kv_width)
        || !widths
        || !table(e.cos)
        || !table(e.sin)
        || e.pos.dims1().ok() != Some(n)
    {
        return Err(EngineError::Internal(format!(
            "qkv epilogue: q {:?} {:?}, k {:?} {:?}, v {:?} {:?}, cos {:?}, positions {:?} for {} \
             heads over {n_kv_head} of {hd}",
            q.dims(),
            q.dtype(),
            k.dims(),
            k.dtype(),
            v.dims(),
            v.dtype(),
            e.cos.dims(),
            e.pos.dims(),
            e.n_head
        )));
    }
    #[cfg(feature = "cuda")]
    {
        use half::f16;
        let bias = |i: usize| -> Result<u64> {
            Ok(match e.biases {
                Some(b) => cuda::address_of::<f32>(&b[i])?,
                None => 0,
            })
        };
        let (k_cache, v_cache) = match e.cache {
            Some((kc, vc)) => (cuda::address_of::<f16>(kc)?, cuda::address_of::<f16>(vc)?),
            None => (0, 0),
        };
        let op = EpilogueOp {
            tables: [e.cos.clone(), e.sin.clone(), e.pos.clone()],
            addresses: [bias(0)?, bias(1)?, bias(2)?, k_cache, v_cache],
            dims: [
                e.n_head,
                n_kv_head,
                hd,
                cap,
                usize::from(e.interleaved),
                usize::from(e.cache.is_none()),
            ],
        };
        Ok(q.apply_op3_no_bwd(k, v, &op)?)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (k, v, cap);
        Err(EngineError::Internal(
            "this build has no CUDA support".into(),
        ))
    }
}

/// [`qkv_epilogue`] as a candle op on the product's (q, k, v) rows.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct EpilogueOp {
    tables: [Tensor; 3],
    addresses: [u64; 5],
    /// Heads, kv heads, head size, the cache's rows, interleaved pairs, rows mode (0 or 1).
    dims: [usize; 6],
}

impl CustomOp3 for EpilogueOp {
    fn name(&self) -> &'static str {
        "specrag-qkv-epilogue"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("the qkv epilogue runs on a GPU only")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &Layout,
        ks: &candle_core::CudaStorage,
        kl: &Layout,
        vs: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let [cos, sin, pos] = &self.tables;
        cuda::launch_epilogue(
            [cos, sin, pos],
            self.addresses,
            self.dims,
            [(qs, ql), (ks, kl), (vs, vl)],
        )
    }
}

/// RMSNorm of `x` `(rows, cols)` f32 by `w` `(cols)`, written as bf16: the next bf16 GEMM's
/// input in one launch on a GPU (`norm_bf16.cu`), an op and a cast otherwise.
pub(super) fn rms_norm_bf16(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.contiguous()?;
    Ok(x.apply_op2_no_bwd(w, &RmsBf16 { eps: eps as f32 })?)
}

/// `silu(gate) * up` (rows of the same width, column ranges of one product or apart; f32, or
/// both the bf16 GEMM's output), written as bf16: the down projection's input in one launch
/// on a GPU (`norm_bf16.cu`).
pub(super) fn swiglu_bf16(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.dims2()? != up.dims2()? {
        return Err(EngineError::Internal(format!(
            "swiglu: gate {:?} and up {:?}",
            gate.dims(),
            up.dims()
        )));
    }
    Ok(gate.apply_op2_no_bwd(up, &SwigluBf16)?)
}

/// `x` `(rows, cols)` f32 plus `delta` `(rows, cols)` bf16 (a bf16 GEMM's output, any row
/// stride), f32: the residual add without the product's cast to f32, one launch on a GPU
/// (`norm_bf16.cu`), each sum the f32 sum.
pub(super) fn add_bf16(x: &Tensor, delta: &Tensor) -> Result<Tensor> {
    if x.dims2()? != delta.dims2()? {
        return Err(EngineError::Internal(format!(
            "add_bf16: x {:?} and delta {:?}",
            x.dims(),
            delta.dims()
        )));
    }
    Ok(x.contiguous()?.apply_op2_no_bwd(delta, &AddBf16)?)
}

/// The residual add and the RMSNorm after it: `x` `(rows, cols)` f32 plus `delta` (a bf16
/// GEMM's output, contiguous, taken: on a GPU its buffer receives the norm), then the sum's
/// RMSNorm by `w` `(cols)` as bf16; (the sum, the norm). On a GPU one launch
/// (`add_rms_norm_bf16`, the same values as the two ops apart); elsewhere [`add_bf16`] then
/// [`rms_norm_bf16`].
pub(super) fn add_rms_norm_bf16(
    x: &Tensor,
    delta: Tensor,
    w: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let (rows, cols) = x.dims2()?;
    if delta.dims2()? != (rows, cols)
        || w.dims1()? != cols
        || delta.dtype() != candle_core::DType::BF16
        || !delta.is_contiguous()
    {
        return Err(EngineError::Internal(format!(
            "add_rms_norm_bf16: x {:?}, delta {:?} ({:?}), w {:?}",
            x.dims(),
            delta.dims(),
            delta.dtype(),
            w.dims()
        )));
    }
    if x.device().is_cpu() {
        let sum = add_bf16(x, &delta)?;
        let norm = rms_norm_bf16(&sum, w, eps)?;
        return Ok((sum, norm));
    }
    #[cfg(feature = "cuda")]
    {
        let op = AddRmsBf16 {
            delta: cuda::address_of::<half::bf16>(&delta)?,
            eps: eps as f32,
        };
        let sum = x.contiguous()?.apply_op2_no_bwd(w, &op)?;
        // The kernel wrote the norm over `delta`'s own elements.
        Ok((sum, delta))
    }
    #[cfg(not(feature = "cuda"))]
    Err(EngineError::Internal(
        "this build has no CUDA support".into(),
    ))
}

/// [`add_rms_norm_bf16`] on a GPU, as a candle op on (x, w) giving the sum; the norm is
/// written at `delta`'s address.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct AddRmsBf16 {
    delta: u64,
    eps: f32,
}

impl CustomOp2 for AddRmsBf16 {
    fn name(&self) -> &'static str {
        "specrag-add-rms-norm-bf16"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("add_rms_norm_bf16 runs as one op on a GPU only")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::launch_add_rms_bf16(self.delta, self.eps, [(xs, xl), (ws, wl)])
    }
}

struct AddBf16;

impl CustomOp2 for AddBf16 {
    fn name(&self) -> &'static str {
        "specrag-add-bf16"
    }

    /// The reference: each f32 value plus the bf16 value, in f32.
    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ds: &CpuStorage,
        dl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(x), CpuStorage::BF16(d)) = (xs, ds) else {
            candle_core::bail!("add_bf16: x must be f32 and delta bf16")
        };
        let x = contiguous(x, xl, "x")?;
        let (rows, cols) = (xl.dims()[0], xl.dims()[1]);
        let mut out = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            let dr = row(d, dl, r)?;
            out.extend(
                x[r * cols..][..cols]
                    .iter()
                    .zip(dr)
                    .map(|(a, b)| a + b.to_f32()),
            );
        }
        Ok((CpuStorage::F32(out), Shape::from((rows, cols))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ds: &candle_core::CudaStorage,
        dl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::launch_add_bf16([(xs, xl), (ds, dl)])
    }
}

struct RmsBf16 {
    eps: f32,
}

/// Row `r` of a matrix laid out by `layout` (any row stride, unit column stride).
fn row<'a, T>(data: &'a [T], layout: &Layout, r: usize) -> candle_core::Result<&'a [T]> {
    let (dims, stride) = (layout.dims(), layout.stride());
    if dims.len() != 2 || stride[1] != 1 {
        candle_core::bail!("expected a matrix of unit column stride")
    }
    Ok(&data[layout.start_offset() + r * stride[0]..][..dims[1]])
}

impl CustomOp2 for RmsBf16 {
    fn name(&self) -> &'static str {
        "specrag-rms-norm-bf16"
    }

    /// The reference: f32 mean of squares, `x * w / sqrt(mean + eps)`, rounded to bf16.
    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(x), CpuStorage::F32(w)) = (xs, ws) else {
            candle_core::bail!("rms_norm_bf16: x and w must be f32")
        };
        let w = contiguous(w, wl, "w")?;
        let (rows, cols) = (xl.dims()[0], w.len());
        let mut out = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            let xr = row(x, xl, r)?;
            let mean = xr.iter().map(|v| v * v).sum::<f32>() / cols as f32;
            let inv = 1.0 / (mean + self.eps).sqrt();
            out.extend(
                xr.iter()
                    .zip(w)
                    .map(|(v, g)| half::bf16::from_f32(v * inv * g)),
            );
        }
        Ok((CpuStorage::BF16(out), Shape::from((rows, cols))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::launch_rms_bf16(self.eps, [(xs, xl), (ws, wl)])
    }
}

struct SwigluBf16;

impl CustomOp2 for SwigluBf16 {
    fn name(&self) -> &'static str {
        "specrag-swiglu-bf16"
    }

    /// The reference: `gate / (1 + exp(-gate)) * up` in f32, rounded to bf16.
    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, cols) = (gl.dims()[0], gl.dims()[1]);
        let widen = |s: &CpuStorage, l: &Layout, r: usize| -> candle_core::Result<Vec<f32>> {
            Ok(match s {
                CpuStorage::F32(v) => row(v, l, r)?.to_vec(),
                CpuStorage::BF16(v) => row(v, l, r)?.iter().map(|x| x.to_f32()).collect(),
                _ => candle_core::bail!("swiglu_bf16: gate and up must be f32 or bf16"),
            })
        };
        let mut out = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            let (gr, ur) = (widen(gs, gl, r)?, widen(us, ul, r)?);
            out.extend(
                gr.iter()
                    .zip(&ur)
                    .map(|(a, b)| half::bf16::from_f32(a / (1.0 + (-a).exp()) * b)),
            );
        }
        Ok((CpuStorage::BF16(out), Shape::from((rows, cols))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        us: &candle_core::CudaStorage,
        ul: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::launch_swiglu_bf16([(gs, gl), (us, ul)])
    }
}

struct Fused {
    pos: Tensor,
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    cap: usize,
    /// The output as bf16 rather than f32.
    bf16_out: bool,
}

fn contiguous<'a, T>(data: &'a [T], layout: &Layout, what: &str) -> candle_core::Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => candle_core::bail!("fused attention: {what} is not contiguous"),
    }
}

impl CustomOp3 for Fused {
    fn name(&self) -> &'static str {
        "specrag-fused-attention"
    }

    /// The reference: each row's scores over its prefix in f32, softmax, the weighted values.
    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (q, k, v) = match (qs, ks, vs) {
            (CpuStorage::F32(q), CpuStorage::F16(k), CpuStorage::F16(v)) => (
                contiguous(q, ql, "q")?,
                contiguous(k, kl, "k")?,
                contiguous(v, vl, "v")?,
            ),
            _ => candle_core::bail!("fused attention: q must be f32, k and v f16"),
        };
        let pos = self.pos.to_vec1::<u32>()?;
        let (nh, hd, cap) = (self.n_head, self.head_dim, self.cap);
        let group = nh / self.n_kv_head;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = vec![0f32; pos.len() * nh * hd];
        for (i, &p) in pos.iter().enumerate() {
            let keys = (p as usize + 1).min(cap);
            for h in 0..nh {
                let qi = &q[(i * nh + h) * hd..][..hd];
                let base = (h / group) * cap * hd;
                let scores: Vec<f32> = (0..keys)
                    .map(|j| {
                        let kj = &k[base + j * hd..][..hd];
                        qi.iter().zip(kj).map(|(a, b)| a * b.to_f32()).sum::<f32>() * scale
                    })
                    .collect();
                let top = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let weights: Vec<f32> = scores.iter().map(|s| (s - top).exp()).collect();
                let total: f32 = weights.iter().sum();
                let o = &mut out[(i * nh + h) * hd..][..hd];
                for (j, w) in weights.iter().enumerate() {
                    let vj = &v[base + j * hd..][..hd];
                    for (od, vd) in o.iter_mut().zip(vj) {
                        *od += w / total * vd.to_f32();
                    }
                }
            }
        }
        let shape = Shape::from((pos.len(), nh, hd));
        if self.bf16_out {
            let out = out.into_iter().map(half::bf16::from_f32).collect();
            return Ok((CpuStorage::BF16(out), shape));
        }
        Ok((CpuStorage::F32(out), shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        qs: &candle_core::CudaStorage,
        ql: &Layout,
        ks: &candle_core::CudaStorage,
        kl: &Layout,
        vs: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let dims = [self.n_head, self.n_kv_head, self.head_dim, self.cap];
        let inputs = [(qs, ql), (ks, kl), (vs, vl)];
        if self.bf16_out {
            cuda::launch::<half::bf16>(&self.pos, dims, inputs)
        } else {
            cuda::launch::<f32>(&self.pos, dims, inputs)
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda;

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    /// One request of the 7B shape (28 heads) over 2,096 keys gets ~256 blocks; 16 requests
    /// fill the GPU without splitting; a short cache is never cut below 128 keys a range; a
    /// 32k cache of the 1.5B shape (12 heads) is cut into 22 ranges, never more than 64.
    #[test]
    fn decode_splits_fill_the_gpu_without_ranges_too_short() {
        assert_eq!(decode_splits(1, 28, 2096), 10);
        assert_eq!(decode_splits(16, 28, 2096), 1);
        assert_eq!(decode_splits(1, 28, 300), 2);
        assert_eq!(decode_splits(1, 28, 100), 1);
        assert_eq!(decode_splits(1, 12, 32768), 22);
        assert_eq!(decode_splits(1, 1, 1 << 20), DECODE_MAX_SPLITS);
        assert_eq!(decode_splits(0, 0, 0), 1);
    }

    /// The largest difference in units of bf16's last place at each value.
    fn ulps(got: &Tensor, want: &Tensor) -> Result<f32> {
        let flat = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
        };
        let (g, w) = (flat(got)?, flat(want)?);
        Ok(g.iter()
            .zip(&w)
            .map(|(a, b)| (a - b).abs() / (b.abs() * 2f32.powi(-7)).max(1e-6))
            .fold(0f32, f32::max))
    }

    /// The CPU references of the GPU's bf16 ops are candle's ops then a cast, within a
    /// last-place rounding; SwiGLU reads gate and up as column ranges of one product, f32 or
    /// bf16; a bf16 product added to the residual is candle's cast and add exactly.
    #[test]
    fn bf16_writing_ops_are_candles_ops_rounded() -> Result<()> {
        let cpu = Device::Cpu;
        let x = (Tensor::rand(-1f32, 1f32, (5, 96), &cpu)? * 4.0)?;
        let w = Tensor::rand(-2f32, 2f32, 96, &cpu)?;
        let got = rms_norm_bf16(&x, &w, 1e-6)?;
        assert_eq!(got.dtype(), DType::BF16);
        let want = candle_nn::ops::rms_norm(&x, &w, 1e-6)?;
        let off = ulps(&got, &want)?;
        assert!(off <= 1.0, "rms: {off}");
        let prod = (Tensor::rand(-1f32, 1f32, (4, 128), &cpu)? * 5.0)?;
        let (gate, up) = (prod.narrow(1, 0, 64)?, prod.narrow(1, 64, 64)?);
        let got = swiglu_bf16(&gate, &up)?;
        let off = ulps(&got, &(gate.silu()? * &up)?)?;
        assert!(off <= 1.0, "swiglu: {off}");
        assert!(swiglu_bf16(&gate, &prod).is_err(), "mismatched widths");
        let prod16 = prod.to_dtype(DType::BF16)?;
        let (g16, u16) = (prod16.narrow(1, 0, 64)?, prod16.narrow(1, 64, 64)?);
        let got = swiglu_bf16(&g16, &u16)?;
        let widened = |t: &Tensor| t.to_dtype(DType::F32);
        let off = ulps(&got, &(widened(&g16)?.silu()? * widened(&u16)?)?)?;
        assert!(off <= 1.0, "swiglu of bf16: {off}");
        let x = Tensor::rand(-1f32, 1f32, (4, 64), &cpu)?;
        let got = add_bf16(&x, &u16)?;
        let want = (&x + widened(&u16)?)?;
        let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0, "add_bf16");
        assert!(add_bf16(&x, &prod16).is_err(), "mismatched widths");
        Ok(())
    }
}
