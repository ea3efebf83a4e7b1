//! Long contexts, losslessly: drafters that decode from an approximate view of the cache, and a
//! verifier that checks their tokens against all of it (VeriCache's uniform interface for lossy
//! KV: any [`AttentionView`] is a drafter, and the output is the full cache's greedy output).
//!
//! - [`TopKView`] (SpeCache, docs/long-context.md): a low-bit copy of the keys
//!   ([`kernels::LowBitKeys`], KIVI's per-channel quantization) is scored against each decode
//!   step's query; the step attends exactly, at full precision, over the `top_k` best rows per
//!   kv head (the largest softmax probability among the group's query heads, SpeContext's max
//!   over a GQA group) plus a few sink rows and a recent window. With `top_k` 0 it is the
//!   StreamingLLM window (sink + recent rows), a baseline.
//!   SpeCache picks the next step's rows with a *speculative token* so that fetching them over
//!   PCIe overlaps the step's compute; here the full-precision rows sit in the same RAM, a
//!   fetch is the gather itself, and the step's own query picks its rows (the paper's
//!   "non-speculative fetching", slightly more accurate in its Table 4).
//! - [`kivi_cache`]: the whole cache quantized and dequantized (keys per channel, values per
//!   token), the KIVI-only baseline.
//!
//! [`ViewDecode::view_verified_generate`] drafts a few tokens from a view, then checks them in one
//! full-attention pass over the same cache ([`Model::forward_decode_path`], bit-identical to
//! one-token steps): the agreeing prefix is kept, the first disagreement replaced by the full
//! cache's token, the drafted rows rewritten exactly. The draft length adapts to acceptance.

use crate::decode::draft::{top_probability, DraftLength, SpecDecodeStats, MAX_DRAFT};
use crate::decode::generate::{
    Chosen, Emit, FinishReason, GenerateParams, Generation, Pick, Prefilled,
};
use crate::decode::ms;
use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::model::Model;
use crate::sampling::{argmax, SamplingParams};
use crate::view::AttentionView;
use kernels::{AttentionShape, LowBitKeys};
use rayon::prelude::*;
use std::collections::VecDeque;
use std::time::Instant;

/// How [`TopKView`] chooses the rows a step attends to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopKConfig {
    /// Bits per value of the low-bit keys (2 or 4).
    pub bits: u32,
    /// Positions per quantization block (KIVI's group along the tokens).
    pub group: usize,
    /// Rows chosen by score per kv head and layer (0: the window alone, StreamingLLM).
    pub top_k: usize,
    /// Most recent rows always attended.
    pub window: usize,
    /// First rows always attended (attention sinks).
    pub sink: usize,
    /// Score positions only in the `prefilter * top_k` positions' worth of blocks with the
    /// highest bound ([`LowBitKeys::block_bounds`]); 0 scores every position.
    pub prefilter: usize,
    /// The first layers attend to every row (Quest keeps its first two dense; on the demo
    /// corpus at 32k tokens two dense layers did not raise the acceptance: 0 by default).
    pub full_layers: usize,
}

impl Default for TopKConfig {
    fn default() -> Self {
        Self {
            bits: 4,
            group: 32,
            top_k: 1024,
            window: 128,
            sink: 4,
            prefilter: 4,
            full_layers: 0,
        }
    }
}

/// SpeCache's drafter view: top-k rows chosen on low-bit keys, attended exactly.
#[derive(Debug, Clone)]
pub struct TopKView {
    config: TopKConfig,
    keys: Vec<LowBitKeys>,
    read: u64,
    full: u64,
}

impl TopKView {
    /// A view choosing rows as `config` says.
    pub fn new(config: TopKConfig) -> Self {
        Self {
            config,
            keys: Vec::new(),
            read: 0,
            full: 0,
        }
    }

    /// The view's settings.
    pub fn config(&self) -> TopKConfig {
        self.config
    }

    /// The rows kv head `g` of one query row at position `p` attends to, in position order.
    fn choose(&self, keys: &LowBitKeys, q: &[f32], p: usize, g: usize) -> Result<Vec<usize>> {
        let c = self.config;
        let n = p + 1;
        let sink_end = c.sink.min(n);
        let wstart = n.saturating_sub(c.window).max(sink_end);
        let qrows = keys.rows().min(wstart).max(sink_end);
        let mut chosen: Vec<usize> = (0..sink_end).collect();
        if c.top_k == 0 {
            chosen.extend(wstart..n);
            return Ok(chosen);
        }
        let candidates = qrows - sink_end;
        if candidates <= c.top_k {
            chosen.extend(sink_end..qrows);
        } else {
            let group = keys.group();
            let mut blocks: Vec<usize> = (sink_end / group..qrows.div_ceil(group)).collect();
            // Narrow the blocks by their bound first when scoring all would cost more.
            let keep = (c.prefilter * c.top_k).div_ceil(group);
            if c.prefilter > 0 && blocks.len() > keep {
                let bound = keys.block_bounds(q, g, &blocks)?;
                let mut order: Vec<usize> = (0..blocks.len()).collect();
                order.select_nth_unstable_by(keep - 1, |&a, &b| bound[b].total_cmp(&bound[a]));
                order.truncate(keep);
                order.sort_unstable();
                blocks = order.into_iter().map(|i| blocks[i]).collect();
            }
            let mut importance = Vec::new();
            keys.importance(q, g, &blocks, sink_end..qrows, &mut importance)?;
            let at = |i: usize| blocks[i / group] * group + i % group;
            let mut order: Vec<usize> = (0..importance.len())
                .filter(|&i| (sink_end..qrows).contains(&at(i)))
                .collect();
            let top = c.top_k.min(order.len());
            if top > 0 && top < order.len() {
                order.select_nth_unstable_by(top - 1, |&a, &b| {
                    importance[b].total_cmp(&importance[a])
                });
            }
            order.truncate(top);
            let mut picked: Vec<usize> = order.into_iter().map(at).collect();
            picked.sort_unstable();
            chosen.extend(picked);
        }
        chosen.extend(qrows..n);
        Ok(chosen)
    }

    /// Exact attention of kv head `g`'s query heads (one row, position `p`) over `rows`.
    fn attend_head(
        cache: &KvCache,
        layer: usize,
        q: &[f32],
        rows: &[usize],
        g: usize,
        shape: AttentionShape,
    ) -> Result<Vec<f32>> {
        let d = shape.head_dim;
        let heads = shape.n_head / shape.n_kv_head;
        let row = shape.n_kv_head * d;
        let (k, v) = (cache.k(layer), cache.v(layer));
        let mut kg = Vec::with_capacity(rows.len() * d);
        let mut vg = Vec::with_capacity(rows.len() * d);
        for &t in rows {
            kg.extend_from_slice(&k[t * row + g * d..t * row + (g + 1) * d]);
            vg.extend_from_slice(&v[t * row + g * d..t * row + (g + 1) * d]);
        }
        let one = AttentionShape {
            n_head: heads,
            n_kv_head: 1,
            head_dim: d,
        };
        let qg = &q[g * heads * d..(g + 1) * heads * d];
        Ok(kernels::causal_attention(
            qg,
            &[rows.len() - 1],
            &kg,
            &vg,
            one,
        )?)
    }
}

impl AttentionView for TopKView {
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        positions: &[usize],
        cache: &KvCache,
        shape: AttentionShape,
    ) -> Result<Vec<f32>> {
        if self.keys.is_empty() {
            self.keys = (0..cache.n_layer())
                .map(|_| LowBitKeys::new(shape, self.config.bits, self.config.group))
                .collect::<std::result::Result<_, _>>()?;
        }
        let rows = positions.iter().max().map_or(0, |&p| p + 1);
        if layer < self.config.full_layers {
            self.read += (positions.len() * rows * shape.n_kv_head) as u64;
            self.full += (positions.len() * rows * shape.n_kv_head) as u64;
            return Ok(kernels::causal_attention(
                q,
                positions,
                cache.k_prefix(layer, rows),
                cache.v_prefix(layer, rows),
                shape,
            )?);
        }
        if self.config.top_k > 0 {
            self.keys[layer].update(cache.k_prefix(layer, rows))?;
        }
        let (n_head, d) = (shape.n_head, shape.head_dim);
        let heads = n_head / shape.n_kv_head;
        let mut out = vec![0f32; positions.len() * n_head * d];
        for (i, &p) in positions.iter().enumerate() {
            let qi = &q[i * n_head * d..(i + 1) * n_head * d];
            let keys = &self.keys[layer];
            let per_head = (0..shape.n_kv_head)
                .into_par_iter()
                .map(|g| {
                    let chosen = self.choose(keys, qi, p, g)?;
                    let o = Self::attend_head(cache, layer, qi, &chosen, g, shape)?;
                    Ok((o, chosen.len()))
                })
                .collect::<Result<Vec<_>>>()?;
            for (g, (o, read)) in per_head.into_iter().enumerate() {
                let at = i * n_head * d + g * heads * d;
                out[at..at + heads * d].copy_from_slice(&o);
                self.read += read as u64;
                self.full += (p + 1) as u64;
            }
        }
        Ok(out)
    }

    fn invalidate_from(&mut self, rows: usize) {
        self.keys.iter_mut().for_each(|k| k.truncate(rows));
    }

    fn held_bytes(&self) -> usize {
        self.keys.iter().map(LowBitKeys::bytes).sum()
    }

    fn rows_read(&self) -> (u64, u64) {
        (self.read, self.full)
    }
}

/// The cache as KIVI would hold it (`bits` per value): keys quantized per channel over blocks
/// of `group` positions, values per position over groups of `group` channels, each block's
/// values replaced by their dequantized ones; the rows after the last whole block stay exact
/// (KIVI's full-precision residual). Rows written later (the answer's) are exact.
pub fn kivi_cache(
    cache: &KvCache,
    shape: AttentionShape,
    bits: u32,
    group: usize,
) -> Result<KvCache> {
    let mut out = cache.clone();
    let row = cache.row_len();
    let levels = ((1u32 << bits) - 1) as f32;
    for layer in 0..cache.n_layer() {
        let mut keys = LowBitKeys::new(shape, bits, group)?;
        keys.update(cache.k(layer))?;
        let whole = keys.rows();
        let positions: Vec<usize> = (0..whole).collect();
        let mut k = Vec::with_capacity(whole * row);
        for t in 0..whole {
            for g in 0..shape.n_kv_head {
                k.extend(keys.dequantize(t, g));
            }
        }
        let mut v = cache.v(layer)[..whole * row].to_vec();
        for values in v.chunks_mut(group.min(row).max(1)) {
            let (lo, hi) = values
                .iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &x| {
                    (a.min(x), b.max(x))
                });
            let step = if hi > lo { (hi - lo) / levels } else { 0.0 };
            for x in values.iter_mut() {
                if step > 0.0 {
                    *x = lo + step * ((*x - lo) / step).round().clamp(0.0, levels);
                }
            }
        }
        out.set_rows(layer, &positions, &k, &v)?;
    }
    Ok(out)
}

/// Settings of [`ViewDecode::view_verified_generate`].
#[derive(Debug, Clone, Copy)]
pub struct ViewParams {
    pub max_tokens: usize,
    /// Drafts per round: starts at `current`, grows by 2 after a round wholly accepted, shrinks
    /// by 1 after a miss, within `min..=max` (`max` at most [`MAX_DRAFT`]).
    pub length: DraftLength,
    /// A round ends early (is verified now) after a draft the view gave less probability than
    /// this: the divergence signal.
    pub min_prob: f32,
}

impl Default for ViewParams {
    fn default() -> Self {
        Self {
            max_tokens: 128,
            length: DraftLength {
                current: 4,
                min: 1,
                max: MAX_DRAFT,
            },
            min_prob: 0.0,
        }
    }
}

/// What a generation over a view did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ViewGeneration {
    /// The committed ids (verified: full attention's greedy output).
    pub ids: Vec<u32>,
    /// Tokens drafted from the view.
    pub drafted: usize,
    /// Drafts full attention agreed with.
    pub accepted: usize,
    /// Verification passes.
    pub rounds: usize,
    /// True when the answer ended with an end-of-generation token.
    pub eos: bool,
    /// Decode time (ms), from the prompt's logits to the last token.
    pub decode_ms: f64,
    /// Of it, drafting from the view and verification passes (verified generation only).
    pub draft_ms: f64,
    pub verify_ms: f64,
}

impl ViewGeneration {
    /// Drafts accepted over drafts made.
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// Decode ms per committed token.
    pub fn ms_per_token(&self) -> f64 {
        self.decode_ms / self.ids.len().max(1) as f64
    }
}

/// Decoding through an approximate view of the cache (SpeCache's and SpeContext's drafts),
/// verified against full attention or not.
pub trait ViewDecode {
    /// Greedy decoding whose output equals full attention's over `cache` (whose last logits
    /// are `logits`), token for token, with tokens drafted from `view` and checked in one
    /// full-attention pass per round ([`ViewDecode::decode_view`] without text or watch).
    fn view_verified_generate(
        &self,
        cache: &mut KvCache,
        logits: &[f32],
        view: &mut (dyn AttentionView + Send),
        params: &ViewParams,
    ) -> Result<ViewGeneration>;

    /// [`Generate::decode_watched`](crate::prelude::Generate::decode_watched) (greedy) with each round's tokens drafted from `view`, the
    /// target over the same cache attending through it, and checked in one full-attention
    /// pass ([`Model::forward_decode_path`], rows bit-identical to one-token steps): the
    /// agreeing drafts and the full cache's own next token are handed out, with the gaps
    /// full attention computed for them, so the text, the watch's calls and the cache left
    /// behind are plain decoding's. `draft` holds the starting draft length and the divergence
    /// signal (a draft below that probability ends the round).
    fn decode_view(
        &self,
        from: Prefilled<'_>,
        view: &mut (dyn AttentionView + Send),
        draft: ViewDraft<'_>,
        on_text: &mut dyn FnMut(&str) -> bool,
        watch: &mut dyn FnMut(&[u32], Pick) -> bool,
    ) -> Result<(Generation, bool, SpecDecodeStats)>;

    /// Greedy decoding with every step from `view` (`None`: full attention), unverified: the
    /// drafter's own answer, for measuring what it loses.
    fn view_generate(
        &self,
        cache: &mut KvCache,
        logits: &[f32],
        view: Option<&mut (dyn AttentionView + Send)>,
        max_tokens: usize,
    ) -> Result<ViewGeneration>;

    /// Teacher forcing: the log-probabilities before each of `ids` (the first from `logits`,
    /// the rest after feeding the ids before it through `view`, `None`: full attention).
    fn view_log_probs(
        &self,
        cache: &mut KvCache,
        logits: &[f32],
        ids: &[u32],
        view: Option<&mut (dyn AttentionView + Send)>,
    ) -> Result<Vec<Vec<f32>>>;
}

/// How [`ViewDecode::decode_view`] drafts: the answer's sampling (greedy only) and stopping,
/// the starting draft length, and the probability below which a draft ends its round.
pub struct ViewDraft<'a> {
    /// How the answer is sampled and stopped.
    pub params: &'a GenerateParams,
    /// The starting draft length.
    pub length: DraftLength,
    /// A draft the view gave less probability than this ends its round (is verified now).
    pub min_prob: f32,
}

impl ViewDecode for Model {
    fn view_verified_generate(
        &self,
        cache: &mut KvCache,
        logits: &[f32],
        view: &mut (dyn AttentionView + Send),
        params: &ViewParams,
    ) -> Result<ViewGeneration> {
        let t0 = Instant::now();
        let gen = GenerateParams {
            max_tokens: params.max_tokens,
            sampling: SamplingParams::default(),
            ..GenerateParams::default()
        };
        let from = Prefilled {
            cache,
            logits: logits.to_vec(),
        };
        let draft = ViewDraft {
            params: &gen,
            length: params.length,
            min_prob: params.min_prob,
        };
        let (g, _, stats) =
            self.decode_view(from, view, draft, &mut |_| true, &mut |_, _| false)?;
        Ok(ViewGeneration {
            eos: g.finish == FinishReason::Eos,
            ids: g.ids,
            drafted: stats.drafted,
            accepted: stats.accepted,
            rounds: stats.rounds,
            decode_ms: t0.elapsed().as_secs_f64() * 1e3,
            draft_ms: stats.draft_ms,
            verify_ms: stats.verify_ms,
        })
    }

    fn decode_view(
        &self,
        from: Prefilled<'_>,
        view: &mut (dyn AttentionView + Send),
        draft: ViewDraft<'_>,
        on_text: &mut dyn FnMut(&str) -> bool,
        watch: &mut dyn FnMut(&[u32], Pick) -> bool,
    ) -> Result<(Generation, bool, SpecDecodeStats)> {
        let Prefilled { cache, logits } = from;
        let ViewDraft {
            params,
            length: mut len,
            min_prob,
        } = draft;
        if params.sampling.temperature > 0.0 {
            return Err(EngineError::InvalidInput(
                "drafting from a view of the cache is greedy only".into(),
            ));
        }
        let mut emit = Emit::new(self.tokenizer(), params, on_text, watch);
        let mut stats = SpecDecodeStats::default();
        cache.reserve(params.max_tokens + MAX_DRAFT + 1);
        let t0 = Instant::now();
        let prompt_len = cache.len();
        let k = params.logprobs;
        let mut ready: VecDeque<Chosen> =
            VecDeque::from([Chosen::from_row(argmax(&logits), &logits, k)]);
        while let Some(c) = ready.pop_front() {
            let next = c.id;
            if emit.take(c) {
                break;
            }
            if !ready.is_empty() {
                continue;
            }
            let base = cache.len();
            let room = len
                .current
                .min(params.max_tokens.saturating_sub(emit.len()));
            let t = Instant::now();
            let drafts = draft_round(self, cache, next, view, room.max(1), min_prob)?;
            stats.draft_ms += ms(t);
            let t = Instant::now();
            cache.truncate(base);
            view.invalidate_from(base);
            let mut feed = vec![next];
            feed.extend(&drafts);
            let rows = self.rows_logits(cache, &feed)?;
            let agree = drafts
                .iter()
                .zip(&rows)
                .take_while(|(d, r)| **d == argmax(r))
                .count();
            let mut ids = drafts[..agree].to_vec();
            ids.push(argmax(&rows[agree]));
            // Rows after a disagreement followed a wrong token.
            cache.truncate(base + 1 + agree);
            view.rows_written(base, &feed[..1 + agree])?;
            ready.extend(
                ids.into_iter()
                    .zip(&rows)
                    .map(|(id, r)| Chosen::from_row(id, r, k)),
            );
            stats.verify_ms += ms(t);
            stats.drafted += drafts.len();
            stats.accepted += agree;
            stats.rounds += 1;
            len.update(drafts.len(), agree);
        }
        stats.draft_len = len.current;
        let steps = emit.len().saturating_sub(1);
        // As plain decoding leaves it: every token handed out but the last one fed.
        cache.truncate(prompt_len + steps);
        view.invalidate_from(cache.len());
        let (g, watched) = emit.finish(ms(t0), steps);
        Ok((g, watched, stats))
    }

    fn view_generate(
        &self,
        cache: &mut KvCache,
        logits: &[f32],
        mut view: Option<&mut (dyn AttentionView + Send)>,
        max_tokens: usize,
    ) -> Result<ViewGeneration> {
        cache.reserve(max_tokens);
        let t0 = Instant::now();
        let mut g = ViewGeneration::default();
        let mut next = argmax(logits);
        while g.ids.len() < max_tokens {
            g.ids.push(next);
            if self.tokenizer().is_end_of_generation(next) {
                g.eos = true;
                break;
            }
            if g.ids.len() == max_tokens {
                break;
            }
            let pos = cache.len();
            let out = self.forward_decode_with(&[next], &[pos], cache, reborrow(&mut view))?;
            next = argmax(&self.last_logits(&out)?);
        }
        g.decode_ms = t0.elapsed().as_secs_f64() * 1e3;
        Ok(g)
    }

    fn view_log_probs(
        &self,
        cache: &mut KvCache,
        logits: &[f32],
        ids: &[u32],
        mut view: Option<&mut (dyn AttentionView + Send)>,
    ) -> Result<Vec<Vec<f32>>> {
        let mut out = vec![log_softmax(logits)];
        for &id in ids.iter().take(ids.len().saturating_sub(1)) {
            let pos = cache.len();
            let f = self.forward_decode_with(&[id], &[pos], cache, reborrow(&mut view))?;
            out.push(log_softmax(&self.last_logits(&f)?));
        }
        Ok(out)
    }
}

/// Up to `room` tokens drafted from `view` after `next` (fed at `cache.len()`), ending
/// early at an end token or a draft below `min_prob`.
fn draft_round(
    model: &Model,
    cache: &mut KvCache,
    next: u32,
    view: &mut (dyn AttentionView + Send),
    room: usize,
    min_prob: f32,
) -> Result<Vec<u32>> {
    let mut drafts = Vec::with_capacity(room);
    let mut tok = next;
    while drafts.len() < room.min(MAX_DRAFT) {
        let pos = cache.len();
        let out = model.forward_view(&[tok], &[pos], cache, view)?;
        let l = model.last_logits(&out)?;
        tok = argmax(&l);
        drafts.push(tok);
        if model.tokenizer().is_end_of_generation(tok) || top_probability(&l) < min_prob {
            break;
        }
    }
    Ok(drafts)
}

/// A shorter-lived borrow of an optional view (an `Option` does not coerce by itself).
pub fn reborrow<'a>(
    view: &'a mut Option<&mut (dyn AttentionView + Send)>,
) -> Option<&'a mut (dyn AttentionView + Send)> {
    match view {
        Some(v) => Some(&mut **v),
        None => None,
    }
}

/// `log softmax(logits)`.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|&x| (x - max).exp()).sum::<f32>().ln();
    logits.iter().map(|&x| x - lse).collect()
}

/// `KL(p || q)` of two log-probability vectors (nats).
pub fn kl(p: &[f32], q: &[f32]) -> f64 {
    p.iter()
        .zip(q)
        .map(|(&a, &b)| f64::from(a.exp()) * f64::from(a - b))
        .sum()
}
