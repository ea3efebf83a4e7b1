//! The pieces of a transformer block that are not weight products: norms, gated
//! activations, and attention over a sliding window. Each row's result is independent of the
//! other rows of its forward.

use crate::error::Result;
use crate::kv::KvCache;
use candle_core::{CpuStorage, Device, Storage, Tensor, D};
use kernels::AttentionShape;

/// RMSNorm of each `w.len()`-wide head of `x` (rows of heads, laid out one after another),
/// scaled by `w`; nothing without weights. Each head on its own, so a row's result never
/// depends on its batch.
pub(super) fn head_rms_norm(x: &mut [f32], w: Option<&[f32]>, eps: f64) {
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
pub(super) fn swiglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
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
pub(super) fn geglu(g: &Tensor, u: &Tensor) -> Result<Tensor> {
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
pub(super) fn windowed_attention(
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
pub(super) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (ms + eps)?.sqrt()?.recip()?;
    Ok(x.broadcast_mul(&inv)?.broadcast_mul(w)?)
}
