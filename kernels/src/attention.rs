//! Causal attention of arbitrary query rows against a position-indexed KV cache.
//!
//! Query `i` sits at absolute position `pos[i]` and attends cache rows `0..=pos[i]`. Queries are
//! processed in tiles; each (head, tile) pair is one GEMM for the scores, an in-place masked
//! softmax and one GEMM for the output, so no `(n, n)` mask is ever materialized and the cost of
//! a tile scales with the furthest position in it. This is what makes both full prefill and the
//! subset recompute of blended prefill one code path.

use crate::error::{shape_err, Result};
use candle_core::{DType, Device, Tensor, D};
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod avx512;
mod bf16;
#[cfg(target_arch = "x86_64")]
mod simd;
mod tile;
pub use bf16::Bf16Kv;
#[cfg(target_arch = "x86_64")]
use simd::tile_fma;
pub(crate) use tile::exp_nonpositive;
pub use tile::AttentionShape;
use tile::{fma_available, softmax_in_place, Portable, Tile};

/// Query rows per tile: small enough that the score block stays in cache.
const TILE: usize = 32;

/// Keys times heads times rows from which a call with fewer rows than a tile (a decode step)
/// still runs its heads on the thread pool.
const PARALLEL_KEYS: usize = 2048;

/// Softmax probabilities of query rows `start..start + rows` of head `h` over cache rows
/// `0..kmax` (`kmax` = one past the furthest position of the tile), masked causally: a
/// `rows x kmax` block. One GEMM for the scores, then an in-place masked softmax.
#[allow(
    clippy::too_many_lines,
    clippy::too_many_arguments,
    reason = "one tile of the masked softmax: GEMM, mask and normalisation share their row buffers; split, each part would re-walk the tile"
)]
fn tile_probs(
    q: &[f32],
    pos: &[usize],
    k: &[f32],
    shape: AttentionShape,
    h: usize,
    start: usize,
    rows: usize,
) -> (Vec<f32>, usize) {
    let AttentionShape {
        n_head,
        n_kv_head,
        head_dim: d,
    } = shape;
    let scale = 1.0 / (d as f32).sqrt();
    let tile_pos = &pos[start..start + rows];
    let kmax = tile_pos.iter().max().map_or(0, |&p| p + 1);
    let g = h / (n_head / n_kv_head);
    let mut scores = vec![0f32; rows * kmax];
    // SAFETY: every pointer/stride pair below stays inside its slice: q rows
    // start..start+rows of head h, cache rows 0..kmax (< n_ctx, checked by the caller) of head g.
    unsafe {
        gemm::gemm(
            rows,
            kmax,
            d,
            scores.as_mut_ptr(),
            1,
            kmax as isize,
            false,
            q.as_ptr().add((start * n_head + h) * d),
            1,
            (n_head * d) as isize,
            k.as_ptr().add(g * d),
            (n_kv_head * d) as isize,
            1,
            0.0,
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
    for (row, &p) in scores.chunks_exact_mut(kmax).zip(tile_pos) {
        let (live, masked) = row.split_at_mut(p + 1);
        softmax_in_place(live);
        masked.fill(0.0);
    }
    (scores, kmax)
}

/// Every (head, tile) pair of `n_q` query rows: the unit of parallel work.
fn tasks(n_head: usize, n_q: usize) -> Vec<(usize, usize)> {
    let n_tiles = n_q.div_ceil(TILE);
    (0..n_head)
        .flat_map(|h| (0..n_tiles).map(move |t| (h, t)))
        .collect()
}

/// Precision of the attention products (the softmax is f32 either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionPrecision {
    /// f32 products (the default; within 1e-4 of the textbook reference in the tests).
    #[default]
    F32,
    /// Queries, keys, probabilities and values rounded to bfloat16, products accumulated in
    /// f32 (AVX-512 BF16 only): ~2x the f32 rate at 8-bit mantissas. Head dimensions other
    /// than 64 and 128 stay f32.
    Bf16,
}

impl AttentionPrecision {
    /// Whether this CPU runs `self` (f32 runs everywhere; bf16 needs AVX-512 BF16).
    pub fn supported(self) -> bool {
        match self {
            Self::F32 => true,
            Self::Bf16 => bf16::available(),
        }
    }
}

/// Computes `softmax(q kᵀ / sqrt(d)) v` causally by position in f32; returns
/// `(n_q, n_head, head_dim)`. [`causal_attention_with`] chooses the precision.
///
/// A row's result is bit-for-bit the same whichever other rows share the call: blended
/// prefill recomputes a subset of a full prefill's rows, and with int8 activations downstream
/// (activation rounding turns a last-bit difference into a whole quantization step) any
/// dependence on the batch would show up in the logits. So the products are written out here
/// in a fixed order (BLAS-style GEMM picks its blocking and edge kernels from the tile's
/// shape): each score is a 16-lane dot product with a fixed reduction, and each output row
/// accumulates its keys in position order. Rows are grouped only to share loads; a row's
/// masked keys contribute exact zeros.
pub fn causal_attention(
    q: &[f32],
    pos: &[usize],
    k: &[f32],
    v: &[f32],
    shape: AttentionShape,
) -> Result<Vec<f32>> {
    causal_attention_with(q, pos, k, v, shape, AttentionPrecision::F32)
}

/// [`causal_attention`] at a given precision (bf16 where the CPU lacks it, or for head
/// dimensions other than 64 and 128, runs f32). bf16 packs the cache for this call; a caller
/// that keeps a [`Bf16Kv`] beside its cache calls [`causal_attention_packed`] instead.
pub fn causal_attention_with(
    q: &[f32],
    pos: &[usize],
    k: &[f32],
    v: &[f32],
    shape: AttentionShape,
    precision: AttentionPrecision,
) -> Result<Vec<f32>> {
    shape.check(q, pos, k, v)?;
    if precision == AttentionPrecision::Bf16 && Bf16Kv::handles(shape) {
        let mut kv = Bf16Kv::new(shape);
        kv.update(k, v, pos.iter().max().map_or(0, |&p| p + 1));
        return causal_attention_packed(q, pos, &kv);
    }
    let group = shape.n_head / shape.n_kv_head;
    if group > 1 && pos.len() * group <= GQA_ROWS {
        return Ok(grouped(q, pos, shape, |q, pos, shape| {
            f32_tiles(q, pos, k, v, shape)
        }));
    }
    Ok(f32_tiles(q, pos, k, v, shape))
}

/// Query rows x heads up to which a call runs the heads of each kv head's group as rows of
/// one tile ([`grouped`]): decode steps and verification passes.
const GQA_ROWS: usize = 128;

/// Runs `attend` with the query heads of each kv head's group as rows of a single head: row
/// `i * group + j` of kv head `g` is query head `g * group + j` of row `i`, at `pos[i]`. A tile
/// of such rows reads its kv head's keys and values once for all of the group's heads (per
/// head, a long context's keys and values are read again for each of them, from memory once
/// they outgrow the cache: 6 times for the 1.5B target). A row's result does not depend on the
/// rows beside it, so the output is bit for bit the per-head one.
fn grouped(
    q: &[f32],
    pos: &[usize],
    shape: AttentionShape,
    attend: impl FnOnce(&[f32], &[usize], AttentionShape) -> Vec<f32>,
) -> Vec<f32> {
    let AttentionShape {
        n_head,
        n_kv_head,
        head_dim: d,
    } = shape;
    let group = n_head / n_kv_head;
    let n = pos.len();
    let mut q2 = vec![0f32; n * n_head * d];
    let mut pos2 = Vec::with_capacity(n * group);
    for (i, &p) in pos.iter().enumerate() {
        for j in 0..group {
            pos2.push(p);
            for g in 0..n_kv_head {
                let src = (i * n_head + g * group + j) * d;
                let dst = ((i * group + j) * n_kv_head + g) * d;
                q2[dst..dst + d].copy_from_slice(&q[src..src + d]);
            }
        }
    }
    let one = AttentionShape {
        n_head: n_kv_head,
        n_kv_head,
        head_dim: d,
    };
    let o2 = attend(&q2, &pos2, one);
    let mut out = vec![0f32; n * n_head * d];
    for i in 0..n {
        for j in 0..group {
            for g in 0..n_kv_head {
                let src = ((i * group + j) * n_kv_head + g) * d;
                let dst = (i * n_head + g * group + j) * d;
                out[dst..dst + d].copy_from_slice(&o2[src..src + d]);
            }
        }
    }
    out
}

/// [`causal_attention`]'s f32 tiles on the widest path this CPU runs.
fn f32_tiles(q: &[f32], pos: &[usize], k: &[f32], v: &[f32], shape: AttentionShape) -> Vec<f32> {
    let d = shape.head_dim;
    let fma = fma_available();
    #[cfg(target_arch = "x86_64")]
    let wide = avx512::available() && avx512::handles(d);
    run_tiles(pos, shape, |h, start, rows, out| {
        let tile = Tile {
            q,
            pos,
            k,
            v,
            shape,
            h,
            start,
            rows,
        };
        #[cfg(target_arch = "x86_64")]
        if wide {
            // SAFETY: the CPU has AVX-512F, AVX2 and FMA, `d` is handled, positions checked.
            unsafe { avx512::tile(&tile, out) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if fma {
            // SAFETY: the CPU has AVX2 and FMA (checked by `fma_available`).
            unsafe { tile_fma(&tile, out) };
            return;
        }
        let _ = fma;
        tile.compute::<Portable>(out);
    })
}

/// [`causal_attention`] at bf16 precision against a packed mirror of the cache (its first
/// `kv.rows()` rows); a row's result is bit for bit [`causal_attention_with`]'s at
/// [`AttentionPrecision::Bf16`].
pub fn causal_attention_packed(q: &[f32], pos: &[usize], kv: &Bf16Kv) -> Result<Vec<f32>> {
    let shape = kv.shape();
    let (n_head, d) = (shape.n_head, shape.head_dim);
    if !Bf16Kv::handles(shape) {
        return Err(crate::error::KernelError::Unsupported(format!(
            "bf16 attention needs AVX-512 BF16 and a head dimension of 64 or 128 (got {d})"
        )));
    }
    if q.len() != pos.len() * n_head * d {
        return Err(shape_err(
            "attention",
            format!("q has {} values for {} rows", q.len(), pos.len()),
        ));
    }
    if let Some(&p) = pos.iter().max() {
        if p >= kv.rows() {
            return Err(shape_err(
                "attention",
                format!("query at position {p} but cache has {} rows", kv.rows()),
            ));
        }
    }
    let group = n_head / shape.n_kv_head;
    if group > 1 && pos.len() * group <= GQA_ROWS {
        // Query head `g` of the grouped call is kv head `g` ([`grouped`]).
        return Ok(grouped(q, pos, shape, |q, pos, one| {
            packed_tiles(q, pos, one, kv, 1)
        }));
    }
    Ok(packed_tiles(q, pos, shape, kv, group))
}

/// [`causal_attention_packed`]'s tiles, query head `h` reading kv head `h / group`.
fn packed_tiles(
    q: &[f32],
    pos: &[usize],
    shape: AttentionShape,
    kv: &Bf16Kv,
    group: usize,
) -> Vec<f32> {
    run_tiles(pos, shape, |h, start, rows, out| {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512 BF16 and `d` is handled (`Bf16Kv::handles`); the mirror
        // holds every position of the call (checked by the caller).
        unsafe {
            bf16::tile(
                q,
                &pos[start..start + rows],
                shape,
                h,
                start,
                kv.head(h / group),
                out,
            )
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (h, start, rows, out, group, kv);
    })
}

/// Runs `tile(h, start, rows, out)` for every (head, tile) pair of the call, on the thread
/// pool when the call is big enough, and assembles the `(n_q, n_head, d)` output.
fn run_tiles(
    pos: &[usize],
    shape: AttentionShape,
    tile: impl Fn(usize, usize, usize, &mut [f32]) + Sync,
) -> Vec<f32> {
    let (n_head, d) = (shape.n_head, shape.head_dim);
    let n_q = pos.len();
    let tasks = tasks(n_head, n_q);
    let run = |&(h, t): &(usize, usize)| -> Vec<f32> {
        let start = t * TILE;
        let rows = TILE.min(n_q - start);
        let mut out = vec![0f32; rows * d];
        tile(h, start, rows, &mut out);
        out
    };
    // A decode step over a short context is a few microseconds of work per head: handing it
    // to the thread pool costs more than it saves. Over a long one it streams the layer's
    // whole KV, which two cores read faster than one (SmolLM2's decode after 512 tokens:
    // ~12 -> ~11 ms/token; the 0.5B and 1.5B within noise).
    // The work is keys x heads x rows: a grouped decode step (`grouped`) has 2 heads of 6 rows
    // where the per-head one had 12 heads of 1.
    let keys = pos.iter().max().map_or(0, |&p| p + 1);
    let blocks: Vec<Vec<f32>> = if n_q >= TILE || keys * n_head * n_q >= PARALLEL_KEYS {
        tasks.par_iter().map(run).collect()
    } else {
        tasks.iter().map(run).collect()
    };
    let mut out = vec![0f32; n_q * n_head * d];
    for (&(h, t), block) in tasks.iter().zip(&blocks) {
        for (r, src) in block.chunks_exact(d).enumerate() {
            let i = t * TILE + r;
            out[(i * n_head + h) * d..(i * n_head + h + 1) * d].copy_from_slice(src);
        }
    }
    out
}

/// Attention mass each cache row receives: the softmax probabilities of every query row and
/// head summed per key position, `n_ctx` values (each query row contributes `n_head` in all).
/// What query-aware selection reads: how much the question looks at each chunk token.
pub fn attention_mass(
    q: &[f32],
    pos: &[usize],
    k: &[f32],
    shape: AttentionShape,
) -> Result<Vec<f32>> {
    shape.check(q, pos, k, k)?;
    let n_ctx = k.len() / (shape.n_kv_head * shape.head_dim);
    let n_q = pos.len();
    let sums: Vec<Vec<f32>> = tasks(shape.n_head, n_q)
        .par_iter()
        .map(|&(h, t)| {
            let start = t * TILE;
            let rows = TILE.min(n_q - start);
            let (probs, kmax) = tile_probs(q, pos, k, shape, h, start, rows);
            let mut sum = vec![0f32; kmax];
            for row in probs.chunks_exact(kmax) {
                sum.iter_mut().zip(row).for_each(|(s, p)| *s += p);
            }
            sum
        })
        .collect();
    let mut mass = vec![0f32; n_ctx];
    for s in sums {
        mass.iter_mut().zip(&s).for_each(|(m, x)| *m += x);
    }
    Ok(mass)
}

/// Reference of [`attention_mass`] built from candle primitives (full probability matrix).
pub fn attention_mass_reference(
    q: &[f32],
    pos: &[usize],
    k: &[f32],
    shape: AttentionShape,
) -> Result<Vec<f32>> {
    let n_ctx = shape.check(q, pos, k, k)?;
    let probs = reference_probs(q, pos, k, shape, n_ctx)?;
    Ok(probs.sum(0)?.sum(0)?.to_vec1::<f32>()?)
}

/// Reference built from candle primitives (full score matrix, explicit mask, softmax).
pub fn causal_attention_reference(
    q: &[f32],
    pos: &[usize],
    k: &[f32],
    v: &[f32],
    shape: AttentionShape,
) -> Result<Vec<f32>> {
    let n_ctx = shape.check(q, pos, k, v)?;
    let probs = reference_probs(q, pos, k, shape, n_ctx)?;
    let out = probs
        .matmul(&per_query_head(v, shape, n_ctx)?)?
        .transpose(0, 1)?
        .contiguous()?
        .to_dtype(DType::F32)?;
    Ok(out.flatten_all()?.to_vec1::<f32>()?)
}

/// Cache rows `(n_ctx, n_kv_head, d)` repeated for the query heads of each group:
/// `(n_head, n_ctx, d)`.
fn per_query_head(t: &[f32], shape: AttentionShape, n_ctx: usize) -> Result<Tensor> {
    let AttentionShape {
        n_head,
        n_kv_head,
        head_dim: d,
    } = shape;
    Ok(
        Tensor::from_slice(t, (n_ctx, n_kv_head, 1, d), &Device::Cpu)?
            .broadcast_as((n_ctx, n_kv_head, n_head / n_kv_head, d))?
            .reshape((n_ctx, n_head, d))?
            .transpose(0, 1)?
            .contiguous()?,
    )
}

/// Causally masked softmax probabilities `(n_head, n_q, n_ctx)` from candle primitives.
fn reference_probs(
    q: &[f32],
    pos: &[usize],
    k: &[f32],
    shape: AttentionShape,
    n_ctx: usize,
) -> Result<Tensor> {
    let (n_head, d) = (shape.n_head, shape.head_dim);
    let dev = Device::Cpu;
    let n_q = pos.len();
    let q = Tensor::from_slice(q, (n_q, n_head, d), &dev)?
        .transpose(0, 1)?
        .contiguous()?;
    let k = per_query_head(k, shape, n_ctx)?;
    let scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?;
    let mask: Vec<u8> = pos
        .iter()
        .flat_map(|&p| (0..n_ctx).map(move |j| u8::from(j <= p)))
        .collect();
    let mask = Tensor::from_vec(mask, (1, n_q, n_ctx), &dev)?.broadcast_as(scores.shape())?;
    let neg = Tensor::full(f32::NEG_INFINITY, scores.shape(), &dev)?;
    let scores = mask.where_cond(&scores, &neg)?;
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    #[test]
    fn grouped_query_heads_attend_bit_for_bit_as_one_head_at_a_time() {
        let mut rng = StdRng::seed_from_u64(44);
        for (n_head, n_kv_head, head_dim) in [(12, 2, 128), (14, 2, 64), (4, 2, 64), (6, 3, 32)] {
            let shape = AttentionShape {
                n_head,
                n_kv_head,
                head_dim,
            };
            let ctx = 700;
            let k = random(ctx * n_kv_head * head_dim, &mut rng);
            let v = random(ctx * n_kv_head * head_dim, &mut rng);
            for rows in [1, 3, 16] {
                let pos: Vec<usize> = (0..rows).map(|i| ctx - rows + i).collect();
                let q = random(rows * n_head * head_dim, &mut rng);
                assert!(rows * (n_head / n_kv_head) <= GQA_ROWS);
                let per_head = f32_tiles(&q, &pos, &k, &v, shape);
                let grouped = causal_attention(&q, &pos, &k, &v, shape).expect("attention");
                assert_eq!(grouped, per_head, "{shape:?}, {rows} rows");
            }
        }
    }

    #[test]
    fn grouped_query_heads_attend_bit_for_bit_at_bf16_too() {
        let mut rng = StdRng::seed_from_u64(45);
        for (n_head, n_kv_head, head_dim) in [(12, 2, 128), (14, 2, 64)] {
            let shape = AttentionShape {
                n_head,
                n_kv_head,
                head_dim,
            };
            if !Bf16Kv::handles(shape) {
                eprintln!("skipped: no AVX-512 BF16 on this CPU");
                return;
            }
            let ctx = 700;
            let k = random(ctx * n_kv_head * head_dim, &mut rng);
            let v = random(ctx * n_kv_head * head_dim, &mut rng);
            let mut kv = Bf16Kv::new(shape);
            kv.update(&k, &v, ctx);
            for rows in [1, 3, 16] {
                let pos: Vec<usize> = (0..rows).map(|i| ctx - rows + i).collect();
                let q = random(rows * n_head * head_dim, &mut rng);
                let per_head = packed_tiles(&q, &pos, shape, &kv, n_head / n_kv_head);
                let grouped = causal_attention_packed(&q, &pos, &kv).expect("attention");
                assert_eq!(grouped, per_head, "{shape:?}, {rows} rows");
            }
        }
    }

    fn random(n: usize, rng: &mut StdRng) -> Vec<f32> {
        (0..n).map(|_| rng.gen_range(-2.0f32..2.0)).collect()
    }

    fn check(shape: AttentionShape, n_ctx: usize, pos: &[usize], seed: u64) -> Result<()> {
        let mut rng = StdRng::seed_from_u64(seed);
        let q = random(pos.len() * shape.n_head * shape.head_dim, &mut rng);
        let k = random(n_ctx * shape.n_kv_head * shape.head_dim, &mut rng);
        let v = random(n_ctx * shape.n_kv_head * shape.head_dim, &mut rng);
        let got = causal_attention(&q, pos, &k, &v, shape)?;
        let want = causal_attention_reference(&q, pos, &k, &v, shape)?;
        let err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err < 1e-4, "max abs diff {err}");
        Ok(())
    }

    #[test]
    fn full_prefill_matches_reference_with_gqa() -> Result<()> {
        let shape = AttentionShape {
            n_head: 6,
            n_kv_head: 2,
            head_dim: 16,
        };
        let pos: Vec<usize> = (0..75).collect();
        check(shape, 75, &pos, 1)
    }

    #[test]
    fn subset_of_rows_against_longer_cache_matches_reference() -> Result<()> {
        let shape = AttentionShape {
            n_head: 4,
            n_kv_head: 4,
            head_dim: 8,
        };
        // Non-contiguous query positions spread over tiles, as in blended prefill.
        let pos = vec![0, 3, 4, 40, 41, 77, 90, 99];
        check(shape, 100, &pos, 2)?;
        // A single decode row at the end of the cache.
        check(shape, 100, &[99], 3)
    }

    #[test]
    fn attention_mass_matches_reference_and_sums_to_rows_times_heads() -> Result<()> {
        let shape = AttentionShape {
            n_head: 6,
            n_kv_head: 2,
            head_dim: 8,
        };
        let mut rng = StdRng::seed_from_u64(4);
        // Question-like rows at the end of a long cache, spread over two tiles.
        let pos: Vec<usize> = (60..100).collect();
        let q = random(pos.len() * shape.n_head * shape.head_dim, &mut rng);
        let k = random(100 * shape.n_kv_head * shape.head_dim, &mut rng);
        let got = attention_mass(&q, &pos, &k, shape)?;
        let want = attention_mass_reference(&q, &pos, &k, shape)?;
        assert_eq!(got.len(), 100);
        let err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(err < 1e-4, "max abs diff {err}");
        let total: f32 = got.iter().sum();
        assert!((total - (pos.len() * shape.n_head) as f32).abs() < 1e-2);
        Ok(())
    }

    /// A row's output must not depend on the rows computed with it (blended prefill vs full
    /// prefill): bit for bit, alone, in a short batch and in a long one.
    #[test]
    fn a_row_is_bit_identical_whatever_rows_share_the_call() -> Result<()> {
        rows_do_not_depend_on_their_batch(AttentionPrecision::F32, 64)
    }

    #[test]
    fn a_bf16_row_is_bit_identical_whatever_rows_share_the_call() -> Result<()> {
        if !Bf16Kv::handles(SHAPE_64) {
            eprintln!("skipped: no AVX-512 BF16 on this CPU");
            return Ok(());
        }
        rows_do_not_depend_on_their_batch(AttentionPrecision::Bf16, 64)?;
        rows_do_not_depend_on_their_batch(AttentionPrecision::Bf16, 128)
    }

    const SHAPE_64: AttentionShape = AttentionShape {
        n_head: 4,
        n_kv_head: 2,
        head_dim: 64,
    };

    fn rows_do_not_depend_on_their_batch(precision: AttentionPrecision, d: usize) -> Result<()> {
        let shape = AttentionShape {
            head_dim: d,
            ..SHAPE_64
        };
        let causal_attention = |q: &[f32], pos: &[usize], k: &[f32], v: &[f32], shape| {
            causal_attention_with(q, pos, k, v, shape, precision)
        };
        let n_ctx = 300;
        let mut rng = StdRng::seed_from_u64(7);
        let row = shape.n_kv_head * shape.head_dim;
        let (k, v) = (random(n_ctx * row, &mut rng), random(n_ctx * row, &mut rng));
        let all: Vec<usize> = (0..n_ctx).collect();
        let q = random(n_ctx * shape.n_head * shape.head_dim, &mut rng);
        let full = causal_attention(&q, &all, &k, &v, shape)?;
        let width = shape.n_head * shape.head_dim;
        for subset in [
            vec![5, 250, 299],
            (100..300).step_by(3).collect(),
            vec![250],
        ] {
            let qs: Vec<f32> = subset
                .iter()
                .flat_map(|&p| q[p * width..(p + 1) * width].to_vec())
                .collect();
            let got = causal_attention(&qs, &subset, &k, &v, shape)?;
            for (r, &p) in subset.iter().enumerate() {
                assert_eq!(
                    got[r * width..(r + 1) * width],
                    full[p * width..(p + 1) * width],
                    "row at position {p} in a batch of {}",
                    subset.len()
                );
            }
        }
        Ok(())
    }

    /// The 512-bit tile is the AVX2 tile with wider registers: equal bit for bit, for both
    /// head sizes it takes, odd row counts, scattered positions, a lone decode row and rows
    /// whose positions are not whole blocks of 8 keys.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_tiles_equal_avx2_tiles_bit_for_bit() {
        if !(avx512::available() && fma_available()) {
            eprintln!("skipped: this CPU has no AVX-512");
            return;
        }
        let mut rng = StdRng::seed_from_u64(11);
        for (n_head, n_kv_head, head_dim) in [(4, 2, 64), (2, 1, 128)] {
            let shape = AttentionShape {
                n_head,
                n_kv_head,
                head_dim,
            };
            let n_ctx = 150;
            let row = n_kv_head * head_dim;
            let (k, v) = (random(n_ctx * row, &mut rng), random(n_ctx * row, &mut rng));
            let positions: [Vec<usize>; 4] = [
                (0..n_ctx).collect(),
                vec![0, 3, 4, 9, 40, 41, 77, 90, 99, 149, 7],
                vec![149],
                (5..40).step_by(2).collect(),
            ];
            for pos in &positions {
                let q = random(pos.len() * n_head * head_dim, &mut rng);
                for h in 0..n_head {
                    for start in (0..pos.len()).step_by(TILE) {
                        let tile = Tile {
                            q: &q,
                            pos,
                            k: &k,
                            v: &v,
                            shape,
                            h,
                            start,
                            rows: TILE.min(pos.len() - start),
                        };
                        let mut wide = vec![0f32; tile.rows * head_dim];
                        let mut narrow = vec![f32::NAN; tile.rows * head_dim];
                        // SAFETY: features checked above; positions lie inside the cache.
                        unsafe {
                            avx512::tile(&tile, &mut wide);
                            tile_fma(&tile, &mut narrow);
                        }
                        assert!(
                            wide.iter()
                                .zip(&narrow)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "d {head_dim}, head {h}, rows from {start} of {pos:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even_as_the_half_crate_does() {
        let mut rng = StdRng::seed_from_u64(11);
        let edges = [
            0.0f32,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
            1.0 + f32::EPSILON * 64.0, // halfway between two bf16 values: ties to even
            1.0 + f32::EPSILON * 192.0,
        ];
        let random = (0..100_000).map(|_| f32::from_bits(rng.gen::<u32>()));
        for x in edges.into_iter().chain(random) {
            let want = half::bf16::from_f32(x);
            let got = bf16::bf16(x);
            if x.is_nan() {
                assert!(half::bf16::from_bits(got).is_nan(), "{x:e}");
            } else {
                assert_eq!(got, want.to_bits(), "{x:e}");
            }
        }
    }

    #[test]
    fn bf16_attention_is_near_the_reference_and_not_the_f32_result() -> Result<()> {
        if !Bf16Kv::handles(SHAPE_64) {
            eprintln!("skipped: no AVX-512 BF16 on this CPU");
            return Ok(());
        }
        for d in [64, 128] {
            let shape = AttentionShape {
                n_head: 6,
                n_kv_head: 2,
                head_dim: d,
            };
            let mut rng = StdRng::seed_from_u64(d as u64);
            let n_ctx = 150;
            let pos: Vec<usize> = (0..n_ctx).collect();
            let q = random(n_ctx * shape.n_head * d, &mut rng);
            let k = random(n_ctx * shape.n_kv_head * d, &mut rng);
            let v = random(n_ctx * shape.n_kv_head * d, &mut rng);
            let bf = causal_attention_with(&q, &pos, &k, &v, shape, AttentionPrecision::Bf16)?;
            let want = causal_attention_reference(&q, &pos, &k, &v, shape)?;
            let err = bf
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            // Values in [-2, 2]: rounding v alone moves an output by up to ~2^-8.
            assert!(err < 3e-2, "d = {d}: max abs diff {err}");
            assert!(err > 1e-5, "d = {d}: bf16 gave the f32 result (diff {err})");
        }
        Ok(())
    }

    #[test]
    fn a_mirror_updated_row_by_row_equals_one_packed_at_once() -> Result<()> {
        if !Bf16Kv::handles(SHAPE_64) {
            eprintln!("skipped: no AVX-512 BF16 on this CPU");
            return Ok(());
        }
        let shape = SHAPE_64;
        let (row, width) = (
            shape.n_kv_head * shape.head_dim,
            shape.n_head * shape.head_dim,
        );
        let mut rng = StdRng::seed_from_u64(5);
        let n = 70;
        let (mut k, mut v) = (random(n * row, &mut rng), random(n * row, &mut rng));
        let q = random(n * width, &mut rng);
        // Prefill 40 rows, then decode one row at a time, with rows 35..45 rewritten halfway
        // (a blend overwriting reused rows) and a truncation back to 60.
        let mut mirror = Bf16Kv::new(shape);
        mirror.update(&k[..40 * row], &v[..40 * row], 40);
        for p in 40..n {
            if p == 50 {
                k[35 * row..45 * row].iter_mut().for_each(|x| *x *= -0.5);
                mirror.invalidate_from(35);
            }
            if p == 65 {
                mirror.invalidate_from(60);
                mirror.update(&k[..60 * row], &v[..60 * row], 60);
            }
            mirror.update(&k[..(p + 1) * row], &v[..(p + 1) * row], p + 1);
            let step = causal_attention_packed(&q[p * width..(p + 1) * width], &[p], &mirror)?;
            let fresh = causal_attention_with(
                &q[p * width..(p + 1) * width],
                &[p],
                &k[..(p + 1) * row],
                &v[..(p + 1) * row],
                shape,
                AttentionPrecision::Bf16,
            )?;
            assert_eq!(step, fresh, "decode step at position {p}");
        }
        v[..row].iter_mut().for_each(|x| *x += 1.0);
        mirror.invalidate_from(0);
        mirror.update(&k, &v, n);
        let pos: Vec<usize> = (0..n).collect();
        let all = causal_attention_with(&q, &pos, &k, &v, shape, AttentionPrecision::Bf16)?;
        assert_eq!(causal_attention_packed(&q, &pos, &mirror)?, all);
        // Past the mirror's rows is an error, not a read out of bounds.
        assert!(causal_attention_packed(&q[..width], &[n], &mirror).is_err());
        Ok(())
    }

    #[test]
    fn exp_is_within_a_few_ulp_of_libm_and_zero_far_below() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -87.0 * i as f32 / 200_000.0;
            let (got, want) = (exp_nonpositive(x) as f64, (x as f64).exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(
            worst < 3.0 * f32::EPSILON as f64,
            "max relative error {worst:e}"
        );
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-88.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpositive(f32::NAN), 0.0);
    }

    #[test]
    fn query_past_cache_is_an_error() {
        let shape = AttentionShape {
            n_head: 1,
            n_kv_head: 1,
            head_dim: 2,
        };
        let r = causal_attention(&[0.0; 2], &[5], &[0.0; 4], &[0.0; 4], shape);
        assert!(r.is_err());
    }
}
