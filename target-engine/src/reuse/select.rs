//! Choosing what to recompute: the [`Selector`] trait and the selectors that need only the
//! target model (the baselines, the measurement bounds and the query-aware `TargetProbe`).
//! SpecCache's selector lives in the `speculator` crate and plugs in through the same trait.
//!
//! Budget rule (every budgeted selector): the budget is `ceil(ρ × all chunk tokens)` and is
//! spent only on chunk tokens whose reused KV is not already exact: with chunks precomputed
//! after the template prefix, the first chunk's KV is exact and is never a candidate.

use crate::error::Result;
use crate::model::Model;
use crate::reuse::assembly::Assembly;
use crate::reuse::blend::Blend;
use crate::reuse::blend::BlendOutput;
use crate::reuse::chunk::{ChunkKv, PrecomputeMode, PrefixKv};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::time::Instant;

/// `ceil(ratio * n)` clamped to `0..=n` (ratio outside 0..=1 is clamped too).
pub fn budget(ratio: f64, n: usize) -> usize {
    ((ratio.clamp(0.0, 1.0) * n as f64).ceil() as usize).min(n)
}

/// What a selector sees: the model, the assembled prompt and the KV it will reuse.
#[derive(Debug)]
pub struct SelectInput<'a> {
    pub model: &'a Model,
    pub assembly: &'a Assembly,
    pub prefix: &'a PrefixKv,
    pub chunks: &'a [&'a ChunkKv],
    /// True when the first chunk was precomputed after this very prefix (its KV is then exact).
    pub first_chunk_exact: bool,
    /// ρ: the budget is `ceil(ratio * chunk tokens)` (ignored by the fixed methods).
    pub ratio: f64,
    /// Measure the blend's deviation signals (the evaluation's; off when serving).
    pub measure: bool,
}

impl<'a> SelectInput<'a> {
    /// Bundles the inputs; `first_chunk_exact` is derived from the first chunk's precompute mode.
    pub fn new(
        model: &'a Model,
        assembly: &'a Assembly,
        prefix: &'a PrefixKv,
        chunks: &'a [&'a ChunkKv],
        ratio: f64,
    ) -> Self {
        let first_chunk_exact = chunks.first().is_some_and(|c| {
            c.mode
                == PrecomputeMode::AfterPrefix {
                    prefix_hash: prefix.hash.clone(),
                }
                && assembly
                    .chunks()
                    .next()
                    .is_some_and(|s| s.ids.start == c.base_pos)
        });
        Self {
            model,
            assembly,
            prefix,
            chunks,
            first_chunk_exact,
            ratio,
            measure: false,
        }
    }

    /// True when the exact first chunk is left out of the candidates: always, unless the budget
    /// is larger than every inexact row (then the rest refreshes the exact chunk, whose stored
    /// f16 KV differs from a fresh prefill by rounding, so ρ = 1 stays identical to full
    /// prefill).
    pub fn skips_exact(&self) -> bool {
        let mut segs = self.assembly.chunks();
        let exact = segs.next().map_or(0, |s| s.ids.len());
        let n = self.assembly.chunk_positions().len();
        self.first_chunk_exact && budget(self.ratio, n) <= n - exact
    }

    /// Chunk positions worth recomputing: those whose reused KV is not exact (see
    /// [`SelectInput::skips_exact`]).
    pub fn candidates(&self) -> Vec<usize> {
        let mut segs = self.assembly.chunks();
        if self.skips_exact() {
            segs.next();
        }
        segs.flat_map(|s| s.ids.clone()).collect()
    }

    /// Tokens to recompute: `ceil(ρ × all chunk tokens)`, at most every candidate.
    pub fn spend(&self) -> usize {
        budget(self.ratio, self.assembly.chunk_positions().len()).min(self.candidates().len())
    }

    /// The fused cache of these inputs (prefix rows and rotated chunk rows).
    pub fn fused(&self) -> Result<crate::kv::KvCache> {
        self.model
            .fused_cache(self.assembly, self.prefix, self.chunks)
    }
}

/// A reuse method: picks the chunk positions to recompute, and runs the blended prefill.
pub trait Selector {
    /// Absolute positions of chunk tokens to recompute.
    fn select(&self, input: &SelectInput) -> Result<Vec<usize>>;
    /// The blended prefill of this method (by default: select, then recompute those tokens
    /// through every layer), with the selection's time in `select_ms`.
    fn prefill(&self, input: &SelectInput) -> Result<BlendOutput> {
        let t = Instant::now();
        let positions = self.select(input)?;
        let select_ms = t.elapsed().as_secs_f64() * 1e3;
        let mut out =
            input
                .model
                .blend_prefill(input.assembly, input.prefix, input.chunks, &positions)?;
        out.select_ms = select_ms;
        Ok(out)
    }
}

/// Recompute every token: an ordinary full prefill (no stored KV is read).
#[derive(Debug, Clone, Copy)]
pub struct FullRecompute;
/// Recompute none: only the question is computed.
#[derive(Debug, Clone, Copy)]
pub struct FullReuse;
/// Keep the longest exact cached prefix, recompute everything after it (prefix caching).
#[derive(Debug, Clone, Copy)]
pub struct PrefixCaching;
/// Recompute the first `k` tokens of every chunk that is not exact (EPIC); `None` picks the
/// smallest `k` that spends the budget.
#[derive(Debug, Clone, Copy, Default)]
pub struct Epic {
    pub k: Option<usize>,
}
/// CacheBlend: candidates through layers `0..=check_layer`, then the tokens whose fresh K (or
/// V, with `by_value`) deviates most from the reused one continue through the later layers.
#[derive(Debug, Clone, Copy)]
pub struct CacheBlend {
    pub check_layer: usize,
    pub by_value: bool,
}
/// A seeded uniform choice among the candidates: the lower bound every selector must beat.
#[derive(Debug, Clone, Copy)]
pub struct Random {
    pub seed: u64,
}
/// Query-aware selection at the cost of one question pass: the question runs over the fused
/// (reused) cache, and the chunk tokens its deep layers attend to most are recomputed.
/// `window` > 0 recomputes `window` tokens on each side of every pick (within its chunk)
/// instead of scattered tokens.
#[derive(Debug, Clone, Copy)]
pub struct TargetProbe {
    /// First probed layer as a fraction of the depth (0.5: the deeper half).
    pub from_depth: f64,
    /// End of the probed layers as a fraction of the depth (1.0: the last layer). The probe
    /// pass stops there, so a probe that ends halfway costs half a question pass.
    pub to_depth: f64,
    pub window: usize,
    /// A^3's smoothing: a token's score is the mean over `smooth` tokens on each side of it
    /// (within its chunk) before the top-k, so picks follow relevant passages rather than
    /// isolated peaks (0: off).
    pub smooth: usize,
    /// ProphetKV's layer fusion: each probed layer's mass is normalized over the candidates
    /// before the layers are summed, so no single layer (or its attention sinks) dominates.
    pub per_layer: bool,
    /// QCFuse-style anchors: the budget is split evenly across the inexact chunks (a chunk
    /// shorter than its share gives the rest to the others) and each chunk recomputes its own
    /// best-scored tokens, instead of one global top-k that can crowd a chunk out.
    pub per_chunk: bool,
    /// Whole chunks where the probe concentrates: once the top-k picked at least this share of
    /// a chunk's candidates, the rest of that chunk is recomputed too (0: off). Its tokens
    /// left to reuse never saw the chunks before them, and the question reads that chunk most.
    pub whole_at: f64,
    /// The chunk holding the most of the question's attention is recomputed whole, and the
    /// rest of the budget (if any) goes to the top-k over the other chunks.
    pub whole_top: bool,
    /// Depth instead of breadth: the picked tokens are recomputed only through the layers from
    /// this fraction of the depth on, from their own chunk's residual stream there
    /// ([`Blend::blend_prefill_deep`]); 0: every layer.
    pub deep_from: f64,
    /// Every candidate through the first layers up to this fraction of the depth, so the
    /// shallow rows are fresh for all of them, then the picks through the rest
    /// ([`Blend::blend_prefill_shallow`]); 0: off.
    pub shallow_all: f64,
    /// At every layer of the blended prefill, each chunk's tokens left to reuse move by the
    /// mean deviation its picks showed there ([`Blend::blend_prefill_shift`]).
    pub shift: bool,
    /// [`TargetProbe::shift`] with each reused token moving as the picks whose keys it
    /// resembles (a softmax over key dot products per kv head) instead of by their mean.
    pub shift_similar: bool,
}
/// The measurement upper bound (never served): from a full prefill, the better (lower
/// first-token KL to the full prefill) of two choices: the tokens whose reused KV deviates
/// most from the true KV over the deep layers, and the tokens the full prefill's question
/// attends to most.
#[derive(Debug, Clone, Copy, Default)]
pub struct Oracle;

impl Default for CacheBlend {
    fn default() -> Self {
        Self {
            check_layer: 1,
            by_value: false,
        }
    }
}

impl Default for TargetProbe {
    fn default() -> Self {
        Self {
            from_depth: 0.5,
            to_depth: 1.0,
            window: 0,
            smooth: 0,
            per_layer: false,
            per_chunk: false,
            whole_at: 0.0,
            whole_top: false,
            deep_from: 0.0,
            shallow_all: 0.0,
            shift: false,
            shift_similar: false,
        }
    }
}

impl Selector for FullRecompute {
    fn select(&self, input: &SelectInput) -> Result<Vec<usize>> {
        Ok(input.assembly.chunk_positions())
    }
    fn prefill(&self, input: &SelectInput) -> Result<BlendOutput> {
        let (cache, logits) = input.model.prefill(&input.assembly.ids)?;
        let recomputed = input.assembly.chunk_positions();
        Ok(BlendOutput {
            cache,
            logits,
            chunk_tokens: recomputed.len(),
            recomputed,
            select_ms: 0.0,
            signals: Default::default(),
            reserve: Vec::new(),
        })
    }
}

impl Selector for FullReuse {
    fn select(&self, _: &SelectInput) -> Result<Vec<usize>> {
        Ok(Vec::new())
    }
}

impl Selector for PrefixCaching {
    fn select(&self, input: &SelectInput) -> Result<Vec<usize>> {
        Ok(input.candidates())
    }
}

impl Epic {
    /// EPIC at a budget: the smallest `k` whose first-`k`-tokens-of-every-chunk selection
    /// reaches `budget` tokens (short chunks contribute all they have). It can exceed the
    /// budget by less than one token per chunk; ratio 1 recomputes every chunk token.
    pub fn k_for_budget(chunk_lens: &[usize], budget: usize) -> usize {
        let spent = |k: usize| chunk_lens.iter().map(|&n| n.min(k)).sum::<usize>();
        let max = chunk_lens.iter().copied().max().unwrap_or(0);
        let (mut lo, mut hi) = (0usize, max);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if spent(mid) >= budget {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        lo
    }
}

impl Selector for Epic {
    fn select(&self, input: &SelectInput) -> Result<Vec<usize>> {
        let skip = usize::from(input.skips_exact());
        let segs: Vec<_> = input.assembly.chunks().skip(skip).collect();
        let k = self.k.unwrap_or_else(|| {
            let lens: Vec<usize> = segs.iter().map(|s| s.ids.len()).collect();
            Self::k_for_budget(&lens, input.spend())
        });
        Ok(segs
            .iter()
            .flat_map(|s| s.ids.start..s.ids.end.min(s.ids.start + k))
            .collect())
    }
}

impl Selector for CacheBlend {
    fn select(&self, input: &SelectInput) -> Result<Vec<usize>> {
        Ok(self.prefill(input)?.recomputed)
    }
    /// Overridden: the tokens chosen continue from the check layer instead of starting over.
    /// The check layer is clamped below the last layer, so shallow models (2 layers) work.
    fn prefill(&self, input: &SelectInput) -> Result<BlendOutput> {
        let n_layer = input.model.config().n_layer;
        let fused = input.fused()?;
        input.model.blend_prefill_cacheblend(
            input.assembly,
            &fused,
            &input.candidates(),
            input.spend(),
            (
                self.check_layer.min(n_layer.saturating_sub(2)),
                self.by_value,
            ),
        )
    }
}

impl Selector for Random {
    fn select(&self, input: &SelectInput) -> Result<Vec<usize>> {
        let mut c = input.candidates();
        let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed);
        c.shuffle(&mut rng);
        c.truncate(input.spend());
        c.sort_unstable();
        Ok(c)
    }
}

/// The `k` candidates of highest `score` (ties: earlier first); with `window` > 0, every pick
/// brings the `window` candidates on each side within its segment, picks taken in score order
/// while they fit in `k`.
pub fn top_k(
    asm: &Assembly,
    candidates: &[usize],
    score: impl Fn(usize) -> f32,
    k: usize,
    window: usize,
) -> Vec<usize> {
    let mut order = candidates.to_vec();
    order.sort_by(|&a, &b| score(b).total_cmp(&score(a)).then(a.cmp(&b)));
    let mut chosen = vec![false; asm.ids.len()];
    let mut is_cand = vec![false; asm.ids.len()];
    candidates.iter().for_each(|&p| is_cand[p] = true);
    let mut n = 0;
    for &p in &order {
        if n >= k {
            break;
        }
        let seg = asm.segments.iter().find(|s| s.ids.contains(&p));
        let (lo, hi) = seg.map_or((p, p + 1), |s| {
            (
                p.saturating_sub(window).max(s.ids.start),
                (p + window + 1).min(s.ids.end),
            )
        });
        // The pick first, then its neighbours nearest-first, while the budget lasts.
        let mut around: Vec<usize> = (lo..hi).collect();
        around.sort_by_key(|&q| q.abs_diff(p));
        for q in around {
            if n < k && is_cand[q] && !chosen[q] {
                chosen[q] = true;
                n += 1;
            }
        }
    }
    (0..asm.ids.len()).filter(|&p| chosen[p]).collect()
}

/// The `candidates` not in `picked`, highest `score` first (ties: earlier first): what a
/// second look recomputes next.
pub fn ranked_rest(
    candidates: &[usize],
    picked: &[usize],
    score: impl Fn(usize) -> f32,
) -> Vec<usize> {
    let end = candidates.iter().chain(picked).max().map_or(0, |&p| p + 1);
    let mut taken = vec![false; end];
    picked.iter().for_each(|&p| taken[p] = true);
    let mut rest: Vec<usize> = candidates.iter().copied().filter(|&p| !taken[p]).collect();
    rest.sort_by(|&a, &b| score(b).total_cmp(&score(a)).then(a.cmp(&b)));
    rest
}

/// Layers `from_depth × n_layer .. n_layer` (at least the last one).
fn deep_layers(model: &Model, from_depth: f64) -> std::ops::Range<usize> {
    layer_span(model, from_depth, 1.0)
}

/// Layers `from × n_layer .. to × n_layer`, at least one (fractions clamped to 0..=1).
fn layer_span(model: &Model, from: f64, to: f64) -> std::ops::Range<usize> {
    let n = model.config().n_layer;
    let at = |f: f64| (f.clamp(0.0, 1.0) * n as f64) as usize;
    let start = at(from).min(n - 1);
    start..at(to).clamp(start + 1, n)
}

/// The question's attention mass per position over `cache`, at `layers`.
fn question_attention(
    model: &Model,
    asm: &Assembly,
    cache: &mut crate::kv::KvCache,
    layers: std::ops::Range<usize>,
) -> Result<Vec<f32>> {
    let q_pos = asm.question_positions();
    let q_ids: Vec<u32> = q_pos.iter().map(|&p| asm.ids[p]).collect();
    model.forward_probe(&q_ids, &q_pos, cache, layers)
}

impl TargetProbe {
    /// The question's score of every position: its attention mass over `layers` (fused as
    /// [`TargetProbe::per_layer`] says), then smoothed as [`TargetProbe::smooth`] says.
    fn scores(
        &self,
        model: &Model,
        asm: &Assembly,
        cache: &mut crate::kv::KvCache,
        candidates: &[usize],
    ) -> Result<Vec<f32>> {
        let layers = layer_span(model, self.from_depth, self.to_depth);
        let mass = if self.per_layer {
            let q_pos = asm.question_positions();
            let q_ids: Vec<u32> = q_pos.iter().map(|&p| asm.ids[p]).collect();
            let per_layer = model.forward_probe_layers(&q_ids, &q_pos, cache, layers)?;
            fuse_layers(&per_layer, candidates)
        } else {
            question_attention(model, asm, cache, layers)?
        };
        Ok(match self.smooth {
            0 => mass,
            r => smooth_within_segments(asm, &mass, r),
        })
    }
}

/// Each layer's mass divided by its sum over `candidates` (a layer with none is skipped),
/// summed over the layers in order.
fn fuse_layers(per_layer: &[Vec<f32>], candidates: &[usize]) -> Vec<f32> {
    let rows = per_layer.first().map_or(0, Vec::len);
    let mut fused = vec![0.0f32; rows];
    for layer in per_layer {
        let total: f32 = candidates.iter().filter_map(|&p| layer.get(p)).sum();
        if total > 0.0 {
            for &p in candidates {
                if let (Some(f), Some(m)) = (fused.get_mut(p), layer.get(p)) {
                    *f += m / total;
                }
            }
        }
    }
    fused
}

/// The mean of `score` over `radius` positions on each side, within each segment of `asm`
/// (positions outside every segment keep their score).
fn smooth_within_segments(asm: &Assembly, score: &[f32], radius: usize) -> Vec<f32> {
    let mut out = score.to_vec();
    for seg in &asm.segments {
        let (lo, hi) = (seg.ids.start, seg.ids.end.min(score.len()));
        for (p, o) in out.iter_mut().enumerate().take(hi).skip(lo) {
            let (a, b) = (p.saturating_sub(radius).max(lo), (p + radius + 1).min(hi));
            *o = score[a..b].iter().sum::<f32>() / (b - a) as f32;
        }
    }
    out
}

/// `k` split across groups of the given sizes as evenly as their sizes allow: the smallest
/// groups take their share first, so what a short group cannot use goes to the others. The
/// shares sum to `min(k, total size)`.
pub fn even_shares(sizes: &[usize], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| sizes[i]);
    let mut shares = vec![0; sizes.len()];
    let mut left = k;
    for (done, &i) in order.iter().enumerate() {
        let groups_left = sizes.len() - done;
        shares[i] = sizes[i].min(left.div_ceil(groups_left));
        left -= shares[i];
    }
    shares
}

/// The candidates of each segment scored apart, each segment's share of `k` given by
/// [`even_shares`].
fn top_k_per_segment(
    asm: &Assembly,
    candidates: &[usize],
    score: &dyn Fn(usize) -> f32,
    k: usize,
    window: usize,
) -> Vec<usize> {
    let groups = candidates_by_segment(asm, candidates);
    let sizes: Vec<usize> = groups.iter().map(Vec::len).collect();
    let mut picked: Vec<usize> = groups
        .iter()
        .zip(even_shares(&sizes, k))
        .flat_map(|(g, share)| top_k(asm, g, score, share, window))
        .collect();
    picked.sort_unstable();
    picked
}

/// The candidates of each segment, segments without candidates left out.
fn candidates_by_segment(asm: &Assembly, candidates: &[usize]) -> Vec<Vec<usize>> {
    asm.segments
        .iter()
        .map(|s| {
            candidates
                .iter()
                .copied()
                .filter(|p| s.ids.contains(p))
                .collect::<Vec<_>>()
        })
        .filter(|g| !g.is_empty())
        .collect()
}

/// `picked` plus every candidate of each segment in which `picked` holds at least `at` of the
/// segment's candidates (sorted, no duplicates).
pub fn widen_to_chunks(
    asm: &Assembly,
    candidates: &[usize],
    picked: &[usize],
    at: f64,
) -> Vec<usize> {
    let mut out: Vec<usize> = picked.to_vec();
    for group in candidates_by_segment(asm, candidates) {
        let hit = group
            .iter()
            .filter(|p| picked.binary_search(p).is_ok())
            .count();
        if hit as f64 >= at * group.len() as f64 {
            out.extend(group);
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// Every candidate of the segment with the largest total `score`, then the top-k of the other
/// segments' candidates for what is left of `k` (nothing when that segment alone exceeds it).
fn whole_top_chunk(
    asm: &Assembly,
    candidates: &[usize],
    score: &dyn Fn(usize) -> f32,
    k: usize,
    window: usize,
) -> Vec<usize> {
    let groups = candidates_by_segment(asm, candidates);
    let mass = |g: &Vec<usize>| g.iter().map(|&p| score(p)).sum::<f32>();
    let Some(top) = groups.iter().max_by(|a, b| mass(a).total_cmp(&mass(b))) else {
        return Vec::new();
    };
    let rest: Vec<usize> = candidates
        .iter()
        .copied()
        .filter(|p| top.binary_search(p).is_err())
        .collect();
    let mut picked = top_k(asm, &rest, score, k.saturating_sub(top.len()), window);
    picked.extend(top);
    picked.sort_unstable();
    picked
}

impl Selector for TargetProbe {
    fn select(&self, input: &SelectInput) -> Result<Vec<usize>> {
        Ok(self.prefill(input)?.recomputed)
    }
    /// Overridden: the probe's fused cache is the one the blended prefill then continues on.
    fn prefill(&self, input: &SelectInput) -> Result<BlendOutput> {
        let t = Instant::now();
        let (model, asm) = (input.model, input.assembly);
        let mut cache = input.fused()?;
        let mut reserve = Vec::new();
        let (picked, uncovered) = match input.spend() {
            0 => (Vec::new(), 0.0),
            k => {
                let candidates = input.candidates();
                let mass = self.scores(model, asm, &mut cache, &candidates)?;
                let score = |p: usize| mass.get(p).copied().unwrap_or(0.0);
                let picked = if self.whole_top {
                    whole_top_chunk(asm, &candidates, &score, k, self.window)
                } else if self.per_chunk {
                    top_k_per_segment(asm, &candidates, &score, k, self.window)
                } else {
                    top_k(asm, &candidates, score, k, self.window)
                };
                let picked = match self.whole_at {
                    at if at > 0.0 => widen_to_chunks(asm, &candidates, &picked, at),
                    _ => picked,
                };
                let total: f32 = candidates.iter().map(|&p| score(p)).sum();
                let covered: f32 = picked.iter().map(|&p| score(p)).sum();
                let uncovered = if total > 0.0 {
                    (1.0 - covered / total).max(0.0)
                } else {
                    0.0
                };
                reserve = ranked_rest(&candidates, &picked, score);
                (picked, uncovered)
            }
        };
        let select_ms = t.elapsed().as_secs_f64() * 1e3;
        let n_layer = model.config().n_layer as f64;
        let from = (self.deep_from * n_layer).round() as usize;
        let shallow = (self.shallow_all * n_layer).round() as usize;
        let mut out = if shallow > 0 {
            let candidates = input.candidates();
            model.blend_prefill_shallow(asm, &cache, &candidates, &picked, shallow)?
        } else if self.shift || self.shift_similar {
            let candidates = input.candidates();
            model.blend_prefill_shift(asm, cache, &candidates, &picked, self.shift_similar)?
        } else if from > 0 {
            let stored = (input.prefix, input.chunks);
            model.blend_prefill_deep(asm, cache, stored, &picked, from)?
        } else {
            model.blend_prefill_measured(asm, cache, &picked, input.measure)?
        };
        out.select_ms = select_ms;
        out.signals.uncovered = uncovered;
        out.reserve = reserve;
        Ok(out)
    }
}

impl Selector for Oracle {
    fn select(&self, input: &SelectInput) -> Result<Vec<usize>> {
        Ok(self.prefill(input)?.recomputed)
    }
    fn prefill(&self, input: &SelectInput) -> Result<BlendOutput> {
        let t = Instant::now();
        let (model, asm) = (input.model, input.assembly);
        let (mut full, full_logits) = model.prefill(&asm.ids)?;
        let fused = input.fused()?;
        let (k, cands) = (input.spend(), input.candidates());
        let layers = deep_layers(model, 2.0 / 3.0);
        let row = model.config().kv_row();
        let deviation = |p: usize| -> f32 {
            layers
                .clone()
                .map(|l| {
                    let d = |a: &[f32], b: &[f32]| -> f32 {
                        a[p * row..(p + 1) * row]
                            .iter()
                            .zip(&b[p * row..(p + 1) * row])
                            .map(|(x, y)| (x - y) * (x - y))
                            .sum()
                    };
                    d(full.k(l), fused.k(l)) + d(full.v(l), fused.v(l))
                })
                .sum()
        };
        let by_kv = top_k(asm, &cands, deviation, k, 0);
        let mass = question_attention(model, asm, &mut full, deep_layers(model, 0.5))?;
        let by_attn = top_k(asm, &cands, |p| mass.get(p).copied().unwrap_or(0.0), k, 0);
        let select_ms = t.elapsed().as_secs_f64() * 1e3;
        let a = model.blend_prefill_on(asm, fused.clone(), &by_kv)?;
        let b = model.blend_prefill_on(asm, fused, &by_attn)?;
        let kl = |o: &BlendOutput| crate::reuse::fidelity::kl_divergence(&full_logits, &o.logits);
        let mut best = if kl(&b) < kl(&a) { b } else { a };
        best.select_ms = select_ms;
        Ok(best)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reserve_is_what_the_top_k_left_best_first() {
        let score = |p: usize| [0.1, 0.9, 0.5, 0.5, 0.7, 0.0][p];
        assert_eq!(
            ranked_rest(&[0, 1, 2, 3, 4, 5], &[1, 4], score),
            vec![2, 3, 0, 5]
        );
        assert!(ranked_rest(&[2, 3], &[2, 3], score).is_empty());
    }

    #[test]
    fn even_shares_give_what_short_groups_cannot_use_to_the_others() {
        assert_eq!(even_shares(&[10, 10, 10], 9), vec![3, 3, 3]);
        assert_eq!(even_shares(&[10, 10, 10], 10), vec![4, 3, 3]);
        assert_eq!(even_shares(&[1, 10, 10], 9), vec![1, 4, 4]);
        assert_eq!(even_shares(&[2, 3], 9), vec![2, 3]);
        assert_eq!(even_shares(&[], 4), Vec::<usize>::new());
        assert_eq!(even_shares(&[5, 5], 0), vec![0, 0]);
    }

    #[test]
    fn layer_fusion_weighs_each_layer_by_its_mass_on_the_candidates() {
        // Layer 0 puts 9 units on a sink (position 0) and splits 1 between the candidates;
        // layer 1 prefers position 2. Normalized, the sink does not count.
        let layers = vec![vec![9.0, 0.75, 0.25], vec![0.0, 1.0, 3.0]];
        let fused = fuse_layers(&layers, &[1, 2]);
        assert_eq!(fused, vec![0.0, 1.0, 1.0]);
    }

    /// Three chunks of 4, 2 and 4 tokens (positions 0-3, 4-5, 6-9).
    fn three_chunks() -> Assembly {
        use crate::reuse::assembly::SegmentKind;
        let mut asm = Assembly::default();
        asm.push(SegmentKind::Chunk(0), "abcd", &[1, 2, 3, 4]);
        asm.push(SegmentKind::Chunk(1), "ef", &[5, 6]);
        asm.push(SegmentKind::Chunk(2), "ghij", &[7, 8, 9, 10]);
        asm
    }

    #[test]
    fn a_chunk_the_probe_picked_half_of_is_recomputed_whole() {
        let asm = three_chunks();
        let cands: Vec<usize> = (0..10).collect();
        // Half of chunk 0 (2 of 4) and one token of chunk 2 (1 of 4): chunk 0 widens only.
        assert_eq!(
            widen_to_chunks(&asm, &cands, &[1, 3, 8], 0.5),
            vec![0, 1, 2, 3, 8]
        );
        // A higher bar leaves the picks as they were; chunk 1 (1 of 2) reaches 0.5.
        assert_eq!(
            widen_to_chunks(&asm, &cands, &[1, 3, 8], 0.75),
            vec![1, 3, 8]
        );
        assert_eq!(widen_to_chunks(&asm, &cands, &[4], 0.5), vec![4, 5]);
        // Non-candidates (an exact first chunk) are never added.
        let later: Vec<usize> = (4..10).collect();
        assert_eq!(
            widen_to_chunks(&asm, &later, &[6, 7], 0.5),
            (6..10).collect::<Vec<_>>()
        );
    }

    #[test]
    fn the_chunk_with_the_most_attention_is_recomputed_whole_and_the_rest_of_the_budget_spent_elsewhere(
    ) {
        let asm = three_chunks();
        let cands: Vec<usize> = (0..10).collect();
        // Chunk 2 holds the most mass (0.5 + 4 × 0.3), though position 1 is the single best.
        let mass = [0.0, 0.9, 0.0, 0.0, 0.2, 0.1, 0.5, 0.3, 0.3, 0.3];
        let score = |p: usize| mass[p];
        assert_eq!(
            whole_top_chunk(&asm, &cands, &score, 6, 0),
            vec![1, 4, 6, 7, 8, 9]
        );
        // A budget smaller than that chunk still recomputes it whole, and nothing else.
        assert_eq!(
            whole_top_chunk(&asm, &cands, &score, 2, 0),
            vec![6, 7, 8, 9]
        );
        assert_eq!(
            whole_top_chunk(&asm, &[], &score, 2, 0),
            Vec::<usize>::new()
        );
    }

    #[test]
    fn smoothing_averages_neighbours_within_a_segment_only() {
        use crate::reuse::assembly::SegmentKind;
        let mut asm = Assembly::default();
        asm.push(SegmentKind::Chunk(0), "abc", &[1, 2, 3]);
        asm.push(SegmentKind::Chunk(1), "de", &[4, 5]);
        let s = smooth_within_segments(&asm, &[3.0, 0.0, 0.0, 6.0, 0.0], 1);
        // Position 2 does not see position 3 across the chunk boundary.
        assert_eq!(s, vec![1.5, 1.0, 0.0, 3.0, 3.0]);
    }
}
