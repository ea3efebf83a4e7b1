//! The forward passes of a [`Model`]: the entry points (full, decode-path, through a view,
//! probing, hooked, first layers only), the loop over layers they share, and the LM head.

use super::ops::{geglu, head_rms_norm, rms_norm, swiglu, windowed_attention};
use super::{shape_of, ForwardOutput, Model};
use crate::config::Architecture;
use crate::error::{EngineError, Result};
use crate::hook::LayerHook;
use crate::kv::KvCache;
use crate::view::AttentionView;
use crate::weights::{Layer, Linear};
use candle_core::{Device, Tensor};

impl Model {
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
            hook: None,
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
        view: &mut (dyn AttentionView + Send),
        layers: usize,
    ) -> Result<()> {
        view.begin_step(ids, positions)?;
        let x = self.embed(ids)?;
        let pass = Pass {
            collect_layers: false,
            allow_dense: false,
            probe: None,
            view: Some(view),
            hook: None,
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
            hook: None,
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
        view: &mut (dyn AttentionView + Send),
    ) -> Result<ForwardOutput> {
        self.forward_decode_with(ids, positions, cache, Some(view))
    }

    pub(crate) fn forward_decode_with(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut KvCache,
        mut view: Option<&mut (dyn AttentionView + Send)>,
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
            hook: None,
        };
        let (x, layers) =
            self.forward_layers_with(x, positions, cache, 0..self.config.n_layer, pass)?;
        let hidden = rms_norm(&x, &self.output_norm, self.config.rms_eps)?;
        Ok(ForwardOutput { hidden, layers })
    }
    /// Every layer for `ids` at `positions` with `hook` called around each layer's cache
    /// write (a strategy that corrects cached rows mid-pass: the blended prefill's shift of
    /// reused rows, `reuse::shift`); returns the residual rows after the last layer (not
    /// normed).
    pub(crate) fn forward_hooked(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut KvCache,
        hook: &mut (dyn LayerHook + Send),
    ) -> Result<Tensor> {
        let pass = Pass {
            collect_layers: false,
            allow_dense: true,
            probe: None,
            view: None,
            hook: Some(hook),
        };
        let x = self.embed(ids)?;
        let (x, _) = self.forward_layers_with(x, positions, cache, 0..self.config.n_layer, pass)?;
        Ok(x)
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
            crate::stop::with_stop(stop, || {
                self.run_layers(x, &mut [Segment { positions, cache }], layers, pass)
            })
        })
    }

    /// Decode-path rows of several caches in one pass over the weights: `steps[i].0` are tokens
    /// fed at the end of cache `steps[i].1` (one decode step, or a token and the drafts after
    /// it). The projections, the FFN and the LM head run once over all rows; each cache's
    /// rows attend over that cache only. Returns, per cache, the logits after each of its
    /// tokens, cut to the vocabulary.
    ///
    /// Rows do not interact on the decode path, so each cache's logits are bit-identical to
    /// [`Model::forward_decode_path`] of its tokens alone, which for one token is
    /// [`Model::forward`]'s step unless the model was loaded with `dense_min_rows: 1`:
    /// batching requests changes no answer. A pass of one row runs as [`Model::forward`].
    /// Runs on the kernels' pool with this thread's stop condition.
    pub fn decode_rows(&self, steps: &mut [(&[u32], &mut KvCache)]) -> Result<Vec<Vec<Vec<f32>>>> {
        let ids: Vec<u32> = steps.iter().flat_map(|s| s.0.iter().copied()).collect();
        if ids.is_empty() || steps.iter().any(|s| s.0.is_empty()) {
            return Err(EngineError::InvalidInput(
                "a decode step without tokens".into(),
            ));
        }
        let positions: Vec<Vec<usize>> = steps
            .iter()
            .map(|s| (s.1.len()..s.1.len() + s.0.len()).collect())
            .collect();
        let x = self.embed(&ids)?;
        let mut segments: Vec<Segment<'_>> = steps
            .iter_mut()
            .zip(&positions)
            .map(|(s, p)| Segment {
                positions: p,
                cache: &mut *s.1,
            })
            .collect();
        let pass = Pass {
            collect_layers: false,
            allow_dense: ids.len() == 1,
            probe: None,
            view: None,
            hook: None,
        };
        let stop = crate::stop::current();
        let (x, _) = kernels::in_pool(|| {
            crate::stop::with_stop(stop, || {
                self.run_layers(x, &mut segments, 0..self.config.n_layer, pass)
            })
        })?;
        let hidden = rms_norm(&x, &self.output_norm, self.config.rms_eps)?;
        let vocab = self.tokenizer.vocab_size();
        let mut logits = self.logits(&hidden)?.to_vec2::<f32>()?.into_iter();
        Ok(steps
            .iter()
            .map(|s| {
                (&mut logits)
                    .take(s.0.len())
                    .map(|mut row| {
                        row.truncate(vocab);
                        row
                    })
                    .collect()
            })
            .collect())
    }

    /// The layers for residual rows `x`, laid out segment after segment: each segment's rows
    /// are at its positions in its own cache. The products run once over all rows; the cache
    /// writes, the hook, the probe and the attention run per segment (a hook, a probe or a
    /// view needs the pass to have one segment).
    fn run_layers(
        &self,
        mut x: Tensor,
        segments: &mut [Segment<'_>],
        layers: std::ops::Range<usize>,
        mut pass: Pass<'_>,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let one_cache = pass.probe.is_none() && pass.view.is_none() && pass.hook.is_none();
        if segments.len() != 1 && !one_cache {
            return Err(EngineError::InvalidInput(
                "a probe, a view or a hook runs over one cache".into(),
            ));
        }
        let c = &self.config;
        let positions: Vec<usize> = segments
            .iter()
            .flat_map(|s| s.positions.iter().copied())
            .collect();
        let n = self.check_rows(&x, &positions, &layers)?;
        for s in segments.iter_mut() {
            self.check_cache(s.cache)?;
            s.cache.prepare(s.positions)?;
        }
        let dense = pass.allow_dense && self.has_dense && n >= self.dense_min_rows;
        let angles: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
        let table = self.rope.table(&angles);
        let table_swa = self.rope_swa.as_ref().map(|r| r.table(&angles));
        let (q_row, kv_row) = (c.q_width(), c.kv_row());
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
            let mut attn = Vec::with_capacity(n * q_row);
            let mut start = 0;
            for s in segments.iter_mut() {
                let end = start + s.positions.len();
                let rows = Rows {
                    q: &q[start * q_row..end * q_row],
                    k: &k[start * kv_row..end * kv_row],
                    v: &v[start * kv_row..end * kv_row],
                };
                start = end;
                attn.extend(self.attend_segment(l, rows, s, &mut pass)?);
            }
            let attn = Tensor::from_vec(attn, (n, q_row), &Device::Cpu)?;
            x = self.after_attention(layer, x, &attn, dense)?;
            if pass.collect_layers {
                collected.push(x.clone());
            }
        }
        if finishes {
            for s in segments.iter_mut() {
                s.cache.mark_filled(s.positions);
            }
        }
        Ok((x, collected))
    }

    /// Layer `l` for one segment's rows: their K/V written to its cache (with the pass's hook
    /// around the write), the probe's attention mass recorded, and their attention (a sliding
    /// window, the pass's view, bf16 or f32) returned.
    fn attend_segment(
        &self,
        l: usize,
        rows: Rows<'_>,
        seg: &mut Segment<'_>,
        pass: &mut Pass<'_>,
    ) -> Result<Vec<f32>> {
        let (positions, cache) = (seg.positions, &mut *seg.cache);
        let Rows { q, k, v } = rows;
        let shape = shape_of(&self.config);
        let upto = positions.iter().max().map_or(0, |&p| p + 1);
        if let Some(h) = pass.hook.as_deref_mut() {
            h.before_write(l, positions, k, v, cache)?;
        }
        cache.write(l, positions, k, v);
        if let Some(h) = pass.hook.as_deref_mut() {
            h.after_write(l, cache)?;
        }
        if let Some((probe_layers, mass)) = pass.probe.as_mut() {
            if probe_layers.contains(&l) {
                let mut m = kernels::attention_mass(q, positions, cache.k_prefix(l, upto), shape)?;
                m.resize(upto, 0.0);
                mass.push(m);
            }
        }
        Ok(if let Some(window) = self.config.window_of(l) {
            // A sliding layer reads few keys: exact, whatever a drafter's view would read.
            windowed_attention(q, positions, cache, l, shape, window)?
        } else if let Some(view) = pass.view.as_mut() {
            view.attend(l, q, positions, cache, shape)?
        } else if self.bf16_attention {
            kernels::causal_attention_packed(q, positions, cache.bf16(l, upto, shape))?
        } else {
            kernels::causal_attention(
                q,
                positions,
                cache.k_prefix(l, upto),
                cache.v_prefix(l, upto),
                shape,
            )?
        })
    }

    /// Refuses a pass whose rows, positions or layers do not fit this model; returns the
    /// number of rows.
    fn check_rows(
        &self,
        x: &Tensor,
        positions: &[usize],
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
        Ok(n)
    }

    /// Refuses a cache made for another model.
    fn check_cache(&self, cache: &KvCache) -> Result<()> {
        let c = &self.config;
        if cache.n_layer() != c.n_layer || cache.row_len() != c.kv_row() {
            return Err(EngineError::InvalidInput(
                "cache was made for another model".into(),
            ));
        }
        Ok(())
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

/// One segment's queries, keys and values at a layer.
struct Rows<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
}

/// Rows of a pass that live in one cache, at these positions.
struct Segment<'a> {
    positions: &'a [usize],
    cache: &'a mut KvCache,
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
    view: Option<&'a mut (dyn AttentionView + Send)>,
    /// Called around each layer's cache write (the blended prefill's shift of reused rows).
    hook: Option<&'a mut (dyn LayerHook + Send)>,
}
