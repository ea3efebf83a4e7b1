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

/// Query rows per tile: small enough that the score block stays in cache.
const TILE: usize = 32;

/// Head layout shared by queries and cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_head`).
    pub n_kv_head: usize,
    /// Dimension of one head.
    pub head_dim: usize,
}

impl AttentionShape {
    fn check(&self, q: &[f32], pos: &[usize], k: &[f32], v: &[f32]) -> Result<usize> {
        let Self {
            n_head,
            n_kv_head,
            head_dim,
        } = *self;
        if n_kv_head == 0 || n_head % n_kv_head != 0 || head_dim == 0 {
            return Err(shape_err(
                "attention",
                format!("{n_head} heads over {n_kv_head} kv heads"),
            ));
        }
        if q.len() != pos.len() * n_head * head_dim {
            return Err(shape_err(
                "attention",
                format!("q has {} values for {} rows", q.len(), pos.len()),
            ));
        }
        let row = n_kv_head * head_dim;
        if k.len() != v.len() || !k.len().is_multiple_of(row) {
            return Err(shape_err(
                "attention",
                "k and v must hold whole rows of equal count",
            ));
        }
        let n_ctx = k.len() / row;
        if let Some(&p) = pos.iter().max() {
            if p >= n_ctx {
                return Err(shape_err(
                    "attention",
                    format!("query at position {p} but cache has {n_ctx} rows"),
                ));
            }
        }
        Ok(n_ctx)
    }
}

/// Softmax probabilities of query rows `start..start + rows` of head `h` over cache rows
/// `0..kmax` (`kmax` = one past the furthest position of the tile), masked causally: a
/// `rows x kmax` block. One GEMM for the scores, then an in-place masked softmax.
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
        let max = live.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for s in live.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let inv = 1.0 / sum;
        live.iter_mut().for_each(|s| *s *= inv);
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

/// Computes `softmax(q kᵀ / sqrt(d)) v` causally by position; returns `(n_q, n_head, head_dim)`.
pub fn causal_attention(
    q: &[f32],
    pos: &[usize],
    k: &[f32],
    v: &[f32],
    shape: AttentionShape,
) -> Result<Vec<f32>> {
    shape.check(q, pos, k, v)?;
    let AttentionShape {
        n_head,
        n_kv_head,
        head_dim: d,
    } = shape;
    let group = n_head / n_kv_head;
    let n_q = pos.len();
    let tasks = tasks(n_head, n_q);
    let run = |&(h, t): &(usize, usize)| -> Vec<f32> {
        let start = t * TILE;
        let rows = TILE.min(n_q - start);
        let (scores, kmax) = tile_probs(q, pos, k, shape, h, start, rows);
        let g = h / group;
        let mut out = vec![0f32; rows * d];
        // SAFETY: `out` is rows x d, scores rows x kmax, v rows 0..kmax (< n_ctx) of head g.
        unsafe {
            gemm::gemm(
                rows,
                d,
                kmax,
                out.as_mut_ptr(),
                1,
                d as isize,
                false,
                scores.as_ptr(),
                1,
                kmax as isize,
                v.as_ptr().add(g * d),
                1,
                (n_kv_head * d) as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        out
    };
    // A decode step is a few microseconds of work per head: handing it to the thread pool
    // costs more than it saves and wakes threads that compete with candle's own matmul pool.
    let blocks: Vec<Vec<f32>> = if n_q >= TILE {
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
    Ok(out)
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
