//! The forward passes on the device: arbitrary query rows attending by position to the cache
//! in bounded blocks, several requests' decode rows in one pass, the probe's attention mass,
//! the LM head and greedy decoding.

use super::cache::{as_cached, as_f32, DeviceCache};
use super::fused::{
    add_bf16, add_rms_norm_bf16, fused_attention, qkv_epilogue, rms_norm_bf16, swiglu_bf16,
    DecodeBatch, DeviceAttention, Epilogue,
};
use super::model::DeviceWeights;
use super::model::{DeviceModel, Layer};
use super::shift::DeviceShift;
use crate::error::{EngineError, Result};
use candle_core::{DType, Module, Tensor};
use std::ops::Range;

/// Score matrices of one attention call stay under this many f32 values (1 GiB): longer
/// passes attend in blocks of query rows.
const MAX_SCORES: usize = 1 << 28;

/// One pass's per-row inputs, uploaded once and shared by every layer.
struct Pass {
    cos: Tensor,
    sin: Tensor,
    /// Cache row of each value of the rows' K/V `(n_kv_head, n, head_dim)` (the scatter's
    /// indexes).
    rows_at: Tensor,
    /// Rows `0..rows` of the cache are read.
    rows: usize,
    /// Attention in blocks of query rows, each reading only the cache rows below its last
    /// (candle ops; none where the fused kernel attends and nothing is probed).
    blocks: Vec<Block>,
    /// Each row's position `(n)` u32, for the fused kernel.
    pos: Option<Tensor>,
    /// The layer the pass stops before.
    end: usize,
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

/// What a pass does besides the forward: the layers whose attention mass it sums
/// (`probe`), and the shift that moves each chunk's reused rows as its recomputed rows moved.
#[derive(Default)]
pub(super) struct PassHooks<'a> {
    pub(super) probe: Option<Range<usize>>,
    pub(super) shift: Option<&'a DeviceShift>,
}

/// The residual stream entering a block, and its RMSNorm by that block's attention norm
/// where the block before computed it with its last add (the bf16 steps).
struct Stream {
    x: Tensor,
    normed: Option<Tensor>,
}

impl DeviceModel {
    /// Runs every layer for `ids` at `positions` (any order, any gaps), writing their K/V rows
    /// into `cache` and attending causally by position to every row of `cache` up to each
    /// query's position; returns the final-normed hidden rows `(n, n_embd)`.
    pub fn forward(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut DeviceCache,
    ) -> Result<Tensor> {
        let (x, _) = self.run(
            ids,
            positions,
            cache,
            0..self.config.n_layer,
            PassHooks::default(),
        )?;
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
        // On a GPU with the fused kernels, one launch a layer writes every request's row and
        // attends; else each request attends on its own.
        let batch = match self.attention {
            DeviceAttention::Fused => DecodeBatch::new(caches, positions)?,
            DeviceAttention::Ops => None,
        };
        let fused_pos = match (&batch, self.attention) {
            (None, DeviceAttention::Fused) => positions
                .iter()
                .map(|&p| Ok(Tensor::new(&[p as u32], &self.device)?))
                .collect::<Result<Vec<_>>>()?,
            _ => Vec::new(),
        };
        if batch.is_some() {
            for (cache, &p) in caches.iter_mut().zip(positions) {
                cache.wrote(p + 1);
            }
        }
        let mut normed = None;
        for l in 0..c.n_layer {
            let w = &self.layers[l];
            let h = match normed.take() {
                Some(h) => h,
                None => self.gemm_norm(&x, &w.attn_norm)?,
            };
            let next = self.layers.get(l + 1).map(|w| &w.attn_norm);
            if let Some(b) = &batch {
                let attn = self.decode_attend(b, l, &h, [&cos, &sin])?;
                Stream { x, normed } = self.ffn(w, x, &attn, next)?;
                continue;
            }
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
                cache.wrote(p + 1);
                let qi = q.narrow(0, i, 1)?;
                if let Some(pos) = fused_pos.get(i) {
                    let qi = qi.contiguous()?;
                    let out = self.attention_out();
                    outs.push(fused_attention(&qi, &cache.k[l], &cache.v[l], pos, out)?);
                    continue;
                }
                let keys = cache.k[l].narrow(1, 0, p + 1)?;
                let values = cache.v[l].narrow(1, 0, p + 1)?;
                outs.push(self.attend_one(&qi, &keys, &values)?);
            }
            let attn = Tensor::cat(&outs, 0)?;
            Stream { x, normed } = self.ffn(w, x, &attn, next)?;
        }
        fused_rms_norm(&x, &self.output_norm, c.rms_eps)
    }

    /// Every layer for `ids` at `positions` with `shift` applied at each; the last row's
    /// logits.
    pub(crate) fn shifted_forward(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut DeviceCache,
        shift: &DeviceShift,
    ) -> Result<Vec<f32>> {
        let hooks = PassHooks {
            probe: None,
            shift: Some(shift),
        };
        let (x, _) = self.run(ids, positions, cache, 0..self.config.n_layer, hooks)?;
        let hidden = fused_rms_norm(&x, &self.output_norm, self.config.rms_eps)?;
        self.last_logits(&hidden)
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
        let s = (q.matmul(&as_f32(keys)?.t()?)? * (1.0 / (hd as f64).sqrt()))?;
        let p = candle_nn::ops::softmax_last_dim(&s)?;
        Ok(p.matmul(&as_f32(values)?)?.reshape((1, nh * hd))?)
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
        let hooks = PassHooks {
            probe: Some(probe),
            shift: None,
        };
        let (_, mass) = self.run(ids, positions, cache, 0..end, hooks)?;
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
            len,
            logits,
            n,
            &crate::Sampler::new(Default::default()),
        )
    }

    /// [`DeviceModel::greedy`] drawing each token with `sampler` (the answer's i-th token at
    /// index i, as the CPU engine draws it).
    pub fn decode(
        &self,
        cache: &mut DeviceCache,
        len: usize,
        logits: &[f32],
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

    /// The per-row inputs of a pass over `positions`; with `probed`, the blocks candle ops
    /// attend in even where the fused kernel attends (the probe reads their probabilities).
    fn pass(&self, positions: &[usize], cache: &DeviceCache, probed: bool) -> Result<Pass> {
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
        let fused = self.attention == DeviceAttention::Fused;
        let pos = if fused {
            let pos: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
            Some(Tensor::from_vec(pos, n, &self.device)?)
        } else {
            None
        };
        Ok(Pass {
            cos,
            sin,
            rows_at: self.rows_index(positions)?,
            rows,
            blocks: if fused && !probed {
                Vec::new()
            } else {
                self.blocks(positions, rows)?
            },
            pos,
            end: self.config.n_layer,
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
    /// and, with `hooks.probe`, the attention mass of the probed layers; with `hooks.shift`,
    /// each chunk's reused rows moved at every layer as its recomputed rows were (`shift.rs`).
    pub(super) fn run(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut DeviceCache,
        layers: Range<usize>,
        hooks: PassHooks<'_>,
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
        let mut pass = self.pass(positions, cache, hooks.probe.is_some())?;
        pass.end = layers.end;
        let mut x = Stream {
            x: self.embed(ids)?,
            normed: None,
        };
        cache.wrote(positions.iter().max().map_or(0, |&p| p + 1));
        let mut mass = None;
        for l in layers {
            let (y, m) = self.layer(l, x, &pass, cache, &hooks)?;
            x = y;
            if let Some(m) = m {
                mass = Some(match mass {
                    None => m,
                    Some(acc) => (acc + m)?,
                });
            }
        }
        Ok((x.x, mass))
    }

    /// One block: attention (its K/V rows written to the cache first), then the FFN; the
    /// attention mass too where `hooks` probe layer `l`.
    fn layer(
        &self,
        l: usize,
        x: Stream,
        pass: &Pass,
        cache: &mut DeviceCache,
        hooks: &PassHooks<'_>,
    ) -> Result<(Stream, Option<Tensor>)> {
        let probed = hooks.probe.as_ref().is_some_and(|p| p.contains(&l));
        let shift = hooks.shift;
        let c = &self.config;
        let w = &self.layers[l];
        let Stream { x, normed } = x;
        let n = x.dim(0)?;
        let h = match normed {
            Some(h) => h,
            None => self.gemm_norm(&x, &w.attn_norm)?,
        };
        // On a GPU with the fused attention, and nothing needing K and V apart (the shift
        // reads them, Q/K norms come before RoPE), one launch follows the product.
        let q = match &pass.pos {
            Some(_)
                if !self.device.is_cpu()
                    && shift.is_none()
                    && w.q_norm.is_none()
                    && w.k_norm.is_none() =>
            {
                self.qkv_into_cache(w, &h, pass, cache, l)?
            }
            _ => {
                let (q, k, v) = self.qkv(w, &h, &pass.cos, &pass.sin)?;
                let head_major = |t: Tensor| -> Result<Tensor> {
                    let t = t.reshape((n, c.n_kv_head, c.head_dim))?;
                    Ok(t.transpose(0, 1)?.contiguous()?)
                };
                let (k, v) = (head_major(k)?, head_major(v)?);
                let moves = match shift {
                    Some(s) => Some(self.shift_moves(l, s, cache, &k, &v)?),
                    None => None,
                };
                cache.k[l].scatter_set(&pass.rows_at, &as_cached(&k)?, 1)?;
                cache.v[l].scatter_set(&pass.rows_at, &as_cached(&v)?, 1)?;
                if let (Some(s), Some(m)) = (shift, moves) {
                    self.apply_shift(l, s, &m, cache)?;
                }
                q
            }
        };
        let (attn, mass) = match &pass.pos {
            Some(pos) if !probed => {
                let q = q.contiguous()?;
                let out = self.attention_out();
                (
                    fused_attention(&q, &cache.k[l], &cache.v[l], pos, out)?,
                    None,
                )
            }
            _ => {
                let keys = cache.k[l].narrow(1, 0, pass.rows)?;
                let values = cache.v[l].narrow(1, 0, pass.rows)?;
                self.attend_ops(&q, &keys, &values, pass, probed)?
            }
        };
        let next = (l + 1 < pass.end).then(|| &self.layers[l + 1].attn_norm);
        Ok((self.ffn(w, x, &attn, next)?, mass))
    }

    /// Layer `l`'s attention in a batched decode step on the GPU (`b`) for the normed rows
    /// `h` with their RoPE tables `rope` (cos, sin): the Q/K/V product, then (no Q/K norm)
    /// one launch for the biases and RoPE writing each row's Q, K and V, and one for the
    /// attention that writes each request's K/V row into its cache; `(n, n_head * head_dim)`.
    fn decode_attend(
        &self,
        b: &DecodeBatch,
        l: usize,
        h: &Tensor,
        rope: [&Tensor; 2],
    ) -> Result<Tensor> {
        let c = &self.config;
        let w = &self.layers[l];
        if w.q_norm.is_some() || w.k_norm.is_some() {
            let (q, k, v) = self.qkv(w, h, rope[0], rope[1])?;
            return b.attend(
                l,
                &q.flatten_from(1)?,
                &k.flatten_from(1)?,
                &v.contiguous()?,
                self.attention_out(),
            );
        }
        let [q, k, v] = self.qkv_product(w, h)?;
        let e = self.epilogue(w, None, rope, b.positions());
        let rows = qkv_epilogue(&q, &k, &v, &e)?;
        let (qw, kw) = (c.n_head * c.head_dim, c.n_kv_head * c.head_dim);
        b.attend(
            l,
            &rows.narrow(1, 0, qw)?,
            &rows.narrow(1, qw, kw)?,
            &rows.narrow(1, qw + kw, kw)?,
            self.attention_out(),
        )
    }

    /// The Q/K/V product of normed rows `h` for [`qkv_epilogue`]: bf16 as the GEMM writes it
    /// where the bf16 steps run (the epilogue reads it without a cast), else f32.
    fn qkv_product(&self, w: &Layer, h: &Tensor) -> Result<[Tensor; 3]> {
        let product = if self.bf16_inputs() {
            w.qkv.forward_bf16(h)?
        } else {
            w.qkv.forward(h)?
        };
        product
            .try_into()
            .map_err(|_| EngineError::Internal("q, k and v: not three products".into()))
    }

    /// Q `(n, n_head, head_dim)` of normed rows `h`, their K and V written into layer `l` of
    /// `cache` at the pass's positions: the Q/K/V product, then one launch for the biases,
    /// RoPE and the cache write ([`qkv_epilogue`], on a GPU).
    fn qkv_into_cache(
        &self,
        w: &Layer,
        h: &Tensor,
        pass: &Pass,
        cache: &DeviceCache,
        l: usize,
    ) -> Result<Tensor> {
        let pos = pass
            .pos
            .as_ref()
            .ok_or_else(|| EngineError::Internal("a fused pass without positions".into()))?;
        let [q, k, v] = self.qkv_product(w, h)?;
        let cache = Some((&cache.k[l], &cache.v[l]));
        let e = self.epilogue(w, cache, [&pass.cos, &pass.sin], pos);
        qkv_epilogue(&q, &k, &v, &e)
    }

    /// What [`qkv_epilogue`] needs of layer `w` beyond the product: the cache it writes (none:
    /// a batched decode's rows), the rows' RoPE tables `rope` (cos, sin) and positions `pos`.
    fn epilogue<'a>(
        &self,
        w: &'a Layer,
        cache: Option<(&'a Tensor, &'a Tensor)>,
        rope: [&'a Tensor; 2],
        pos: &'a Tensor,
    ) -> Epilogue<'a> {
        let c = &self.config;
        Epilogue {
            cache,
            cos: rope[0],
            sin: rope[1],
            pos,
            biases: w.bias.as_ref(),
            n_head: c.n_head,
            n_kv_head: c.n_kv_head,
            head_dim: c.head_dim,
            interleaved: self.rope.variant() == kernels::RopeVariant::Interleaved,
        }
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
        let [mut q, mut k, mut v]: [Tensor; 3] = w
            .qkv
            .forward(h)?
            .try_into()
            .map_err(|_| EngineError::Internal("q, k and v: not three products".into()))?;
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

    /// Whether the steps around the bf16 GEMMs run as bf16 kernels (`norm_bf16.cu`: their
    /// inputs written, their outputs read, in bf16): on a GPU, with bf16 weights and the fused
    /// kernels on; on the CPU device, their CPU references where a test asks
    /// ([`DeviceModel::set_gpu_steps_on_cpu`]).
    fn bf16_inputs(&self) -> bool {
        (!self.device.is_cpu() || self.gpu_steps_on_cpu)
            && self.weights == DeviceWeights::Bf16
            && self.attention == DeviceAttention::Fused
    }

    /// What the fused attention writes: bf16 where the output projection takes it as it is
    /// ([`DeviceModel::bf16_inputs`]), else f32.
    fn attention_out(&self) -> DType {
        if self.bf16_inputs() {
            DType::BF16
        } else {
            DType::F32
        }
    }

    /// Runs the GPU's bf16 steps on the CPU device, as their CPU references (tests: the
    /// wiring a GPU runs, checked where no GPU is).
    #[cfg(test)]
    pub(crate) fn set_gpu_steps_on_cpu(&mut self, on: bool) {
        self.gpu_steps_on_cpu = on;
    }

    /// RMSNorm of the residual rows `x` by `w` before a GEMM: bf16 where
    /// [`DeviceModel::bf16_inputs`], else f32 (the GEMM rounds it as it multiplies).
    fn gemm_norm(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        if self.bf16_inputs() {
            rms_norm_bf16(x, w, self.config.rms_eps)
        } else {
            fused_rms_norm(x, w, self.config.rms_eps)
        }
    }

    /// The rest of a block after attention: the output projection added to the residual
    /// stream `x`, then the gated FFN the same way; where the bf16 steps run and `next` (the
    /// next block's attention norm) is given, that block's normed input too.
    fn ffn(&self, w: &Layer, x: Tensor, attn: &Tensor, next: Option<&Tensor>) -> Result<Stream> {
        if self.bf16_inputs() {
            return self.ffn_bf16(w, &x, attn, next);
        }
        let x = (x + w.wo.forward(attn)?)?;
        let h = self.gemm_norm(&x, &w.ffn_norm)?;
        let [gate, up]: [Tensor; 2] = w
            .gate_up
            .forward(&h)?
            .try_into()
            .map_err(|_| EngineError::Internal("gate and up: not two products".into()))?;
        Ok(Stream {
            x: (x + w.down.forward(&(gate.silu()? * up)?)?)?,
            normed: None,
        })
    }

    /// [`DeviceModel::ffn`] where [`DeviceModel::bf16_inputs`]: each GEMM's bf16 output read
    /// as it is, each residual add fused with the RMSNorm after it (the FFN's, and the next
    /// block's attention norm): 7 launches, that norm included, where candle ops take 12.
    fn ffn_bf16(
        &self,
        w: &Layer,
        x: &Tensor,
        attn: &Tensor,
        next: Option<&Tensor>,
    ) -> Result<Stream> {
        let eps = self.config.rms_eps;
        let (x, h) = add_rms_norm_bf16(x, w.wo.forward_bf16(attn)?, &w.ffn_norm, eps)?;
        let [gate, up]: [Tensor; 2] = w
            .gate_up
            .forward_bf16(&h)?
            .try_into()
            .map_err(|_| EngineError::Internal("gate and up: not two products".into()))?;
        let act = swiglu_bf16(&gate, &up)?;
        let down = w.down.forward_bf16(&act)?;
        Ok(match next {
            Some(norm) => {
                let (x, h) = add_rms_norm_bf16(&x, down, norm, eps)?;
                Stream { x, normed: Some(h) }
            }
            None => Stream {
                x: add_bf16(&x, &down)?,
                normed: None,
            },
        })
    }

    /// Causal attention of `q` `(n, n_head, head_dim)` over the cache's first rows of every
    /// head `(n_kv_head, rows, head_dim)` (views, read in place): a
    /// query at position p reads rows `0..=p`. Each block of query rows reads only the rows
    /// below its last query and keeps its score matrix bounded. With `probed`, also the
    /// probabilities summed per key row `(rows)`.
    fn attend_ops(
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
        let (k, v) = (&as_f32(keys)?, &as_f32(values)?);
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
pub(super) fn fused_rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(candle_nn::ops::rms_norm(&x.contiguous()?, w, eps as f32)?)
}

#[cfg(test)]
mod tests {
    use super::super::model::{DeviceModel, DeviceWeights};
    use super::DeviceAttention;
    use crate::testing::{family_specs, write_tiny_gguf};
    use crate::Architecture;

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
    }

    /// The GPU's bf16 steps (norms and SwiGLU written in bf16, the GEMMs' bf16 output read
    /// as it is, each residual add fused with the next block's norm, attention written in
    /// bf16) wired as a GPU runs them, on the CPU device through their references: a prefill
    /// and a batched decode step answer as the f32 steps on the same bf16 weights, which round
    /// every GEMM's input to bf16 too (equal here, bounded at 1% of the logits' scale for
    /// sums taken in another order). A norm carried with another block's weight is off by 5%.
    #[test]
    fn the_bf16_steps_answer_as_the_f32_steps_on_the_cpu_device() {
        let cpu = candle_core::Device::Cpu;
        let (name, spec) = family_specs()
            .into_iter()
            .find(|(_, s)| s.arch == Architecture::Qwen2 && !s.sentencepiece)
            .expect("a Qwen2 spec");
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tiny.gguf");
        write_tiny_gguf(&path, &spec).expect("write");
        let load = |steps: bool| {
            let mut m = DeviceModel::load_with(&path, &cpu, DeviceWeights::Bf16).expect("load");
            m.set_attention(DeviceAttention::Fused).expect("fused");
            m.set_gpu_steps_on_cpu(steps);
            m
        };
        let (f32_steps, bf16_steps) = (load(false), load(true));
        let vocab = f32_steps.tokenizer().vocab_size() as u32;
        let prompt: Vec<u32> = (0..40u32).map(|i| (i * 37 + 5) % (vocab - 8)).collect();
        let (ca, la) = f32_steps.prefill(&prompt, 48).expect("prefill");
        let (cb, lb) = bf16_steps.prefill(&prompt, 48).expect("prefill");
        let scale = la.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(scale > 0.5, "{name}: degenerate logits up to {scale}");
        let d = max_diff(&la, &lb);
        assert!(
            d < 0.01 * scale,
            "{name}: prefill logits differ by {d} of {scale}"
        );
        // Two requests' decode rows in one forward (each attends to its own cache).
        let (ca2, _) = f32_steps.prefill(&prompt[..20], 48).expect("prefill");
        let (cb2, _) = bf16_steps.prefill(&prompt[..20], 48).expect("prefill");
        let step = |m: &DeviceModel, c: &mut Vec<super::DeviceCache>| {
            let h = m.forward_batch(&[7, 9], &[40, 20], c).expect("batch");
            m.logits(&h).expect("logits")
        };
        let (mut a, mut b) = (vec![ca, ca2], vec![cb, cb2]);
        let (sa, sb) = (step(&f32_steps, &mut a), step(&bf16_steps, &mut b));
        for (x, y) in sa.iter().zip(&sb) {
            let d = max_diff(x, y);
            assert!(
                d < 0.01 * scale,
                "{name}: decode logits differ by {d} of {scale}"
            );
        }
    }
}
