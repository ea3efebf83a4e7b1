//! The fused ops' launches on a CUDA GPU: the kernels compiled once by NVRTC, device
//! addresses of the caches, launch configurations.

use super::super::cache::DeviceCache;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaView, DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use candle_core::cuda_backend::CudaDType;
use candle_core::cuda_backend::WrapErr;
use candle_core::Tensor;
use candle_core::{CudaStorage, Layout, Shape, Storage};
use half::f16;
use std::sync::OnceLock;

use kernels::CUDA_SOURCE as SOURCE;
const ROWS: usize = 64;
const THREADS: u32 = 128;

/// The kernel's PTX, compiled once per process (NVRTC, for compute capability 8.0 and
/// up: the driver JIT-compiles it for the GPU at hand).
fn ptx() -> candle_core::Result<&'static str> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    let ptx = PTX.get_or_init(|| {
        let opts = CompileOptions {
            arch: Some("compute_80"),
            name: Some("kernels.cu".into()),
            ..Default::default()
        };
        // cudarc opens libnvrtc on first use and panics where it cannot.
        match std::panic::catch_unwind(|| compile_ptx_with_opts(SOURCE, opts)) {
            Ok(Ok(ptx)) => Ok(ptx.to_src()),
            Ok(Err(e)) => Err(format!(
                "NVRTC could not compile the attention kernel: {e:?}"
            )),
            Err(_) => Err("NVRTC (libnvrtc.so) did not load: put its folder on \
                           LD_LIBRARY_PATH (docs/gpu.md)"
                .into()),
        }
    });
    match ptx {
        Ok(p) => Ok(p),
        Err(e) => candle_core::bail!("{e}"),
    }
}

/// An attention kernel's output element: f32, or bf16 (the `_bf16` entry points).
pub(super) trait OutElement:
    CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr
{
    /// The entry point's name after the head size.
    const SUFFIX: &'static str;
}

impl OutElement for f32 {
    const SUFFIX: &'static str = "";
}

impl OutElement for half::bf16 {
    const SUFFIX: &'static str = "_bf16";
}

/// The kernel's FA_SHARED_BYTES: keys and values [64][hd + 8] in f16, 64 row positions
/// and a key count (a launch given less writes NaN rows and returns: the check at load fails
/// loudly).
fn shared_bytes(hd: usize) -> u32 {
    (2 * 2 * 64 * (hd + 8) + 4 * (ROWS + 1)) as u32
}

/// The elements `layout` covers, contiguous, starting 16-byte aligned (the kernel reads
/// 16 bytes at a time).
fn view<'a, T: CudaDType>(
    s: &'a CudaStorage,
    layout: &Layout,
    what: &str,
) -> candle_core::Result<CudaView<'a, T>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        candle_core::bail!("fused attention: {what} is not contiguous")
    };
    if start * std::mem::size_of::<T>() % 16 != 0 {
        candle_core::bail!("fused attention: {what} does not start 16-byte aligned")
    }
    Ok(s.as_cuda_slice::<T>()?.slice(start..end))
}

/// The device address of `t`'s first element (an f16 cache tensor, contiguous).
fn address(t: &Tensor) -> candle_core::Result<i64> {
    Ok(address_of::<f16>(t)? as i64)
}

/// The device address of a contiguous tensor's first element of type `T`.
pub(super) fn address_of<T: CudaDType>(t: &Tensor) -> candle_core::Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(c) = &*storage else {
        candle_core::bail!("a tensor the kernel reads or writes in place is not on the GPU")
    };
    if !layout.is_contiguous() {
        candle_core::bail!("a tensor the kernel reads or writes in place is not contiguous")
    }
    let slice = c.as_cuda_slice::<T>()?;
    let stream = c.device.cuda_stream();
    let (ptr, _record) = slice.device_ptr(&stream);
    Ok(ptr + (layout.start_offset() * std::mem::size_of::<T>()) as u64)
}

/// Rows of a product read by row stride: the elements from the first row's start, and the
/// stride (a column range of a wider product, or a whole contiguous matrix).
fn rows<'a>(s: &'a CudaStorage, layout: &Layout) -> candle_core::Result<(CudaView<'a, f32>, i32)> {
    rows_of::<f32>(s, layout)
}

/// A product's rows as the Q/K/V epilogue reads them, f32 or bf16 (its kernel by the dtype):
/// the first row's device address and the row stride.
fn product_rows(s: &CudaStorage, layout: &Layout) -> candle_core::Result<(u64, i32)> {
    let stream = s.device.cuda_stream();
    Ok(match s.dtype() {
        candle_core::DType::BF16 => {
            let (view, ld) = rows_of::<half::bf16>(s, layout)?;
            let ptr = view.device_ptr(&stream).0;
            (ptr, ld)
        }
        _ => {
            let (view, ld) = rows(s, layout)?;
            let ptr = view.device_ptr(&stream).0;
            (ptr, ld)
        }
    })
}

/// [`rows`] of elements of type `T`.
fn rows_of<'a, T: CudaDType>(
    s: &'a CudaStorage,
    layout: &Layout,
) -> candle_core::Result<(CudaView<'a, T>, i32)> {
    let (dims, stride) = (layout.dims(), layout.stride());
    if dims.len() != 2 || stride[1] != 1 {
        candle_core::bail!("a fused op's inputs must be matrices of unit column stride")
    }
    let slice = s.as_cuda_slice::<T>()?.slice(layout.start_offset()..);
    Ok((slice, stride[0] as i32))
}

/// The launch of a kernel run with one block a row: `rows` blocks of `shape` (threads, bytes
/// of shared memory).
fn per_row(rows: usize, shape: (u32, u32)) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (shape.0, 1, 1),
        shared_mem_bytes: shape.1,
    }
}

/// RMSNorm written as bf16 (`rms_norm_bf16`) over `inputs`: the f32 rows and the weight.
pub(super) fn launch_rms_bf16(
    eps: f32,
    inputs: [(&CudaStorage, &Layout); 2],
) -> candle_core::Result<(CudaStorage, Shape)> {
    let [(xs, xl), (ws, wl)] = inputs;
    let dev = xs.device.clone();
    let (x, w) = (view::<f32>(xs, xl, "x")?, view::<f32>(ws, wl, "w")?);
    let (rows, cols) = (xl.dims()[0], wl.dims()[0]);
    if xl.dims() != [rows, cols] {
        candle_core::bail!(
            "rms_norm_bf16: x {:?} against a weight of {cols}",
            xl.dims()
        )
    }
    let func = dev.get_or_load_custom_func("rms_norm_bf16", "specrag_flash_attention", ptx()?)?;
    let cfg = per_row(rows, (128, 128));
    // SAFETY: every element is written by the kernel (each row, once).
    let out = unsafe { dev.alloc::<half::bf16>(rows * cols)? };
    let cols_i = cols as i32;
    let mut b = func.builder();
    b.arg(&x).arg(&w).arg(&out).arg(&cols_i).arg(&eps);
    // SAFETY: the arguments match the kernel's signature.
    unsafe { b.launch(cfg) }.w()?;
    let out = CudaStorage::wrap_cuda_slice(out, dev);
    Ok((out, Shape::from((rows, cols))))
}

/// SwiGLU written as bf16 over `inputs`: gate and up rows, f32 (`swiglu_bf16`) or the bf16
/// GEMM's output (`swiglu_bf16_in`).
pub(super) fn launch_swiglu_bf16(
    inputs: [(&CudaStorage, &Layout); 2],
) -> candle_core::Result<(CudaStorage, Shape)> {
    let [(gs, gl), (us, ul)] = inputs;
    let dev = gs.device.clone();
    let (n, cols) = (gl.dims()[0], gl.dims()[1]);
    // SAFETY: every element is written by the kernel (each row, once).
    let out = unsafe { dev.alloc::<half::bf16>(n * cols)? };
    let cols_i = cols as i32;
    let (kernel, bf16_in) = match gs.dtype() {
        candle_core::DType::BF16 => ("swiglu_bf16_in", true),
        _ => ("swiglu_bf16", false),
    };
    let func = dev.get_or_load_custom_func(kernel, "specrag_flash_attention", ptx()?)?;
    let cfg = per_row(n, (256, 0));
    let mut b = func.builder();
    if bf16_in {
        let ((g, ld_g), (u, ld_u)) = (
            rows_of::<half::bf16>(gs, gl)?,
            rows_of::<half::bf16>(us, ul)?,
        );
        b.arg(&g)
            .arg(&u)
            .arg(&ld_g)
            .arg(&ld_u)
            .arg(&out)
            .arg(&cols_i);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(cfg) }.w()?;
    } else {
        let ((g, ld_g), (u, ld_u)) = (rows(gs, gl)?, rows(us, ul)?);
        b.arg(&g)
            .arg(&u)
            .arg(&ld_g)
            .arg(&ld_u)
            .arg(&out)
            .arg(&cols_i);
        // SAFETY: the arguments match the kernel's signature.
        unsafe { b.launch(cfg) }.w()?;
    }
    let out = CudaStorage::wrap_cuda_slice(out, dev);
    Ok((out, Shape::from((n, cols))))
}

/// The f32 rows `x` plus the contiguous bf16 rows at `delta`, f32 out, and the sum's RMSNorm
/// by `w` written as bf16 over `delta` (`add_rms_norm_bf16`).
pub(super) fn launch_add_rms_bf16(
    delta: u64,
    eps: f32,
    inputs: [(&CudaStorage, &Layout); 2],
) -> candle_core::Result<(CudaStorage, Shape)> {
    let [(xs, xl), (ws, wl)] = inputs;
    let dev = xs.device.clone();
    let (x, w) = (view::<f32>(xs, xl, "x")?, view::<f32>(ws, wl, "w")?);
    let (n, cols) = (xl.dims()[0], wl.dims()[0]);
    if xl.dims() != [n, cols] {
        candle_core::bail!(
            "add_rms_norm_bf16: x {:?} against a weight of {cols}",
            xl.dims()
        )
    }
    let func =
        dev.get_or_load_custom_func("add_rms_norm_bf16", "specrag_flash_attention", ptx()?)?;
    let cfg = per_row(n, (128, 128));
    // SAFETY: every element is written by the kernel (each row, once).
    let out = unsafe { dev.alloc::<f32>(n * cols)? };
    let (cols_i, ld_d) = (cols as i32, cols as i32);
    let mut b = func.builder();
    b.arg(&x)
        .arg(&delta)
        .arg(&ld_d)
        .arg(&w)
        .arg(&out)
        .arg(&cols_i)
        .arg(&eps);
    // SAFETY: the arguments match the kernel's signature; `delta` is the address of a live
    // contiguous bf16 (n, cols) tensor the caller holds through the launch and owns alone.
    unsafe { b.launch(cfg) }.w()?;
    let out = CudaStorage::wrap_cuda_slice(out, dev);
    Ok((out, Shape::from((n, cols))))
}

/// The f32 rows `x` plus the bf16 rows `delta` (`add_bf16`, read by row stride), f32 out.
pub(super) fn launch_add_bf16(
    inputs: [(&CudaStorage, &Layout); 2],
) -> candle_core::Result<(CudaStorage, Shape)> {
    let [(xs, xl), (ds, dl)] = inputs;
    let dev = xs.device.clone();
    let x = view::<f32>(xs, xl, "x")?;
    let (d, ld_d) = rows_of::<half::bf16>(ds, dl)?;
    let (n, cols) = (xl.dims()[0], xl.dims()[1]);
    if dl.dims() != [n, cols] {
        candle_core::bail!("add_bf16: x {:?} and delta {:?}", xl.dims(), dl.dims())
    }
    let func = dev.get_or_load_custom_func("add_bf16", "specrag_flash_attention", ptx()?)?;
    let cfg = per_row(n, (256, 0));
    // SAFETY: every element is written by the kernel (each row, once).
    let out = unsafe { dev.alloc::<f32>(n * cols)? };
    let cols_i = cols as i32;
    let mut b = func.builder();
    b.arg(&x).arg(&d).arg(&ld_d).arg(&out).arg(&cols_i);
    // SAFETY: the arguments match the kernel's signature.
    unsafe { b.launch(cfg) }.w()?;
    let out = CudaStorage::wrap_cuda_slice(out, dev);
    Ok((out, Shape::from((n, cols))))
}

/// Runs the Q/K/V epilogue on `inputs` (the product's Q, K and V rows) with `tables` (each
/// row's cos, sin and position), `addresses` (the Q, K and V biases, 0 for none, and the
/// layer's K and V cache) and `dims` (heads, kv heads, head size, the cache's rows,
/// interleaved RoPE pairs as 0 or 1, rows mode as 0 or 1); Q `(n, heads, head size)` back,
/// or in rows mode each row's Q, K and V `(n, (heads + 2 kv heads) head size)`.
pub(super) fn launch_epilogue(
    tables: [&Tensor; 3],
    addresses: [u64; 5],
    dims: [usize; 6],
    inputs: [(&CudaStorage, &Layout); 3],
) -> candle_core::Result<(CudaStorage, Shape)> {
    let [n_head, n_kv_head, hd, cap, interleaved, rows_mode] = dims;
    let ld_out = if rows_mode == 1 {
        (n_head + 2 * n_kv_head) * hd
    } else {
        n_head * hd
    };
    let [(qs, ql), (ks, kl), (vs, vl)] = inputs;
    let dev = qs.device.clone();
    let n = ql.dims()[0];
    let [cos, sin, pos] = tables;
    let (cos_storage, cos_layout) = cos.storage_and_layout();
    let cos = small::<f32>(&cos_storage, cos_layout)?;
    let (sin_storage, sin_layout) = sin.storage_and_layout();
    let sin = small::<f32>(&sin_storage, sin_layout)?;
    let (pos_storage, pos_layout) = pos.storage_and_layout();
    let pos = small::<u32>(&pos_storage, pos_layout)?;
    let bf16_in = qs.dtype() == candle_core::DType::BF16;
    let name = if bf16_in {
        "qkv_epilogue_bf16"
    } else {
        "qkv_epilogue"
    };
    let func = dev.get_or_load_custom_func(name, "specrag_flash_attention", ptx()?)?;
    // SAFETY: every element is written by the kernel (each row's heads; NaN past the cache).
    let out = unsafe { dev.alloc::<f32>(n * ld_out)? };
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let [bq, bk, bv, k_cache, v_cache] = addresses;
    let (ld_out, rows_mode) = (ld_out as i32, rows_mode as i32);
    let ints = [n_head, n_kv_head, hd, cap, interleaved].map(|x| x as i32);
    let [(q, ld_q), (k, ld_k), (v, ld_v)] = [(qs, ql), (ks, kl), (vs, vl)];
    let (q, ld_q) = product_rows(q, ld_q)?;
    let (k, ld_k) = product_rows(k, ld_k)?;
    let (v, ld_v) = product_rows(v, ld_v)?;
    let mut b = func.builder();
    b.arg(&q).arg(&k).arg(&v).arg(&ld_q).arg(&ld_k).arg(&ld_v);
    b.arg(&bq)
        .arg(&bk)
        .arg(&bv)
        .arg(&cos)
        .arg(&sin)
        .arg(&pos)
        .arg(&out)
        .arg(&ld_out)
        .arg(&rows_mode);
    b.arg(&k_cache).arg(&v_cache);
    for x in &ints {
        b.arg(x);
    }
    // SAFETY: the arguments match the kernel's signature; the product's and the caches'
    // addresses are live tensors (the op's inputs, the layer's f16 caches of `cap` rows) held
    // by the caller through the launch.
    unsafe { b.launch(cfg) }.w()?;
    let out = CudaStorage::wrap_cuda_slice(out, dev);
    if rows_mode == 1 {
        Ok((out, Shape::from((n, ld_out as usize))))
    } else {
        Ok((out, Shape::from((n, n_head, hd))))
    }
}

/// The device side of a batched decode step: every layer's cache addresses `(layers, 2,
/// requests)` (i64), the caches' rows and the positions (u32), in three uploads.
pub(super) fn decode_tables(
    caches: &[DeviceCache],
    positions: &[usize],
) -> crate::error::Result<[Tensor; 3]> {
    let r = caches.len();
    let layers = caches[0].k.len();
    let device = caches[0].k[0].device().clone();
    let mut ptrs = Vec::with_capacity(layers * 2 * r);
    for l in 0..layers {
        for c in caches {
            ptrs.push(address(&c.k[l])?);
        }
        for c in caches {
            ptrs.push(address(&c.v[l])?);
        }
    }
    // Each cache's rows as its tensors hold them (every layer alike), the row inside them.
    let mut caps = Vec::with_capacity(r);
    for (i, (c, &p)) in caches.iter().zip(positions).enumerate() {
        let rows = c.k[0].dims3()?.1;
        let alike =
            c.k.iter()
                .chain(&c.v)
                .all(|t| t.dims3().is_ok_and(|d| d.1 == rows));
        if !alike || c.k.len() != layers || p >= rows {
            return Err(crate::error::EngineError::InvalidInput(format!(
                "batched decode: request {i}'s row {p} does not fit its cache of {rows} rows"
            )));
        }
        caps.push(rows as u32);
    }
    let pos: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
    Ok([
        Tensor::from_vec(ptrs, (layers, 2, r), &device)?,
        Tensor::from_vec(caps, r, &device)?,
        Tensor::from_vec(pos, r, &device)?,
    ])
}

/// A small tensor's contiguous device elements.
fn small<'a, T: CudaDType>(
    storage: &'a Storage,
    layout: &Layout,
) -> candle_core::Result<CudaView<'a, T>> {
    let Storage::Cuda(c) = storage else {
        candle_core::bail!("a kernel's table (positions, addresses) is not on the GPU")
    };
    let Some((a, b)) = layout.contiguous_offsets() else {
        candle_core::bail!("a kernel's table (positions, addresses) is not contiguous")
    };
    Ok(c.as_cuda_slice::<T>()?.slice(a..b))
}

/// Runs the batched decode kernel on `inputs` (q, the new K and the new V rows) with
/// `tables` (a layer's `(2, requests)` cache addresses, the caches' rows, the positions) for
/// `dims` (heads, kv heads, head size, the ranges each request's keys are cut into: above 1,
/// a second launch merges them).
pub(super) fn launch_decode<T: OutElement>(
    tables: [&Tensor; 3],
    dims: [usize; 4],
    inputs: [(&CudaStorage, &Layout); 3],
) -> candle_core::Result<(CudaStorage, Shape)> {
    let [n_head, n_kv_head, hd, splits] = dims;
    let [ptr_table, cap_table, pos_table] = tables;
    let [(qs, ql), (ks, kl), (vs, vl)] = inputs;
    let dev = qs.device.clone();
    let (q, ld_q) = rows_of::<f32>(qs, ql)?;
    let ((k, ld_k), (v, ld_v)) = (rows_of::<f32>(ks, kl)?, rows_of::<f32>(vs, vl)?);
    if ld_k != ld_v {
        candle_core::bail!("batched decode: K rows of stride {ld_k}, V rows of {ld_v}")
    }
    let (ptr_storage, ptr_layout) = ptr_table.storage_and_layout();
    let ptrs = small::<i64>(&ptr_storage, ptr_layout)?;
    let r = ptrs.len() / 2;
    let (k_ptrs, v_ptrs) = (ptrs.slice(..r), ptrs.slice(r..));
    let (cap_storage, cap_layout) = cap_table.storage_and_layout();
    let caps = small::<u32>(&cap_storage, cap_layout)?;
    let (pos_storage, pos_layout) = pos_table.storage_and_layout();
    let pos = small::<u32>(&pos_storage, pos_layout)?;
    let func = dev.get_or_load_custom_func(
        &format!("decode_attention_{hd}{}", T::SUFFIX),
        "specrag_flash_attention",
        ptx()?,
    )?;
    // SAFETY: every element is written by the kernel (each request's heads, once), or by
    // the merge from every split's part, each written by its block.
    let out = unsafe { dev.alloc::<T>(r * n_head * hd)? };
    let part_len = if splits > 1 {
        r * n_head * splits * (hd + 2)
    } else {
        1
    };
    // SAFETY: with several splits every part is written by its block before the merge reads
    // it; with one, the kernel never touches it.
    let part = unsafe { dev.alloc::<f32>(part_len)? };
    let cfg = LaunchConfig {
        grid_dim: (r as u32, n_head as u32, splits as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: (4 * 4 * (2 + hd)) as u32,
    };
    let (nh, nkv, n_splits) = (n_head as i32, n_kv_head as i32, splits as i32);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut b = func.builder();
    b.arg(&q).arg(&k).arg(&v).arg(&k_ptrs).arg(&v_ptrs);
    b.arg(&caps)
        .arg(&pos)
        .arg(&out)
        .arg(&part)
        .arg(&ld_q)
        .arg(&ld_k);
    b.arg(&nh).arg(&nkv).arg(&n_splits).arg(&scale);
    // SAFETY: the arguments match the kernel's signature; the pointers are live caches
    // of this step (held by the caller), each with room for its row.
    unsafe { b.launch(cfg) }.w()?;
    if splits > 1 {
        let merge = dev.get_or_load_custom_func(
            &format!("decode_merge_{hd}{}", T::SUFFIX),
            "specrag_flash_attention",
            ptx()?,
        )?;
        let cfg = LaunchConfig {
            grid_dim: (r as u32, n_head as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = merge.builder();
        b.arg(&part).arg(&out).arg(&nh).arg(&n_splits);
        // SAFETY: `part` holds every split of every request's heads, written above on the
        // same stream; `out` has a row for each.
        unsafe { b.launch(cfg) }.w()?;
    }
    let out = CudaStorage::wrap_cuda_slice(out, dev);
    Ok((out, Shape::from((r, n_head, hd))))
}

/// Runs the attention kernel on `inputs` (q, k and v with their layouts) for the rows at
/// `positions` and `dims` (heads, kv heads, head size, the cache's rows).
pub(super) fn launch<T: OutElement>(
    positions: &Tensor,
    dims: [usize; 4],
    inputs: [(&CudaStorage, &Layout); 3],
) -> candle_core::Result<(CudaStorage, Shape)> {
    let [n_head, n_kv_head, hd, cap] = dims;
    let [(qs, ql), (ks, kl), (vs, vl)] = inputs;
    let dev = qs.device.clone();
    let q = view::<f32>(qs, ql, "q")?;
    let (k, v) = (view::<f16>(ks, kl, "k")?, view::<f16>(vs, vl, "v")?);
    let (pos_storage, pos_layout) = positions.storage_and_layout();
    let pos = small::<u32>(&pos_storage, pos_layout)?;
    let n = pos.len();
    let func = dev.get_or_load_custom_func(
        &format!("flash_attention_{hd}{}", T::SUFFIX),
        "specrag_flash_attention",
        ptx()?,
    )?;
    // SAFETY: every element is written by the kernel (each row of each head, once).
    let out = unsafe { dev.alloc::<T>(n * n_head * hd)? };
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(ROWS) as u32, n_head as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared_bytes(hd),
    };
    let (n_i, nh, nkv, cap) = (n as i32, n_head as i32, n_kv_head as i32, cap as i32);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut b = func.builder();
    b.arg(&q).arg(&k).arg(&v).arg(&pos).arg(&out);
    b.arg(&n_i).arg(&nh).arg(&nkv).arg(&cap).arg(&scale);
    // SAFETY: the arguments match the kernel's signature, and the grid covers its rows.
    unsafe { b.launch(cfg) }.w()?;
    let out = CudaStorage::wrap_cuda_slice(out, dev);
    Ok((out, Shape::from((n, n_head, hd))))
}
