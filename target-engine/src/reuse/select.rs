//! Choosing what to recompute: the [`Selector`] trait and the served selectors that need only
//! the target model (the baselines and the query-aware `TargetProbe`). SpecCache's selector
//! lives in the `speculator` crate and the evaluation's own (ablations, bounds) in `eval`;
//! both plug in through the same trait, and the probe's pieces ([`TargetProbe::probe`],
//! [`top_k`], [`ProbeScores::annotate`]) are public for them.
//!
//! Budget rule (every budgeted selector): the budget is `ceil(ρ × all chunk tokens)` and is
//! spent only on chunk tokens whose reused KV is not already exact: with chunks precomputed
//! after the template prefix, the first chunk's KV is exact and is never a candidate.

use crate::engine::{Engine, ShiftRule};
use crate::error::Result;
use crate::kv::KvCache;
use crate::model::Model;
use crate::reuse::assembly::Assembly;
use crate::reuse::blend::Blend;
use crate::reuse::blend::{blend_on, blend_shift, fused, BlendOutput, DeviationCheck};
use crate::reuse::chunk::{ChunkKv, PrecomputeMode, PrefixKv};
use std::time::Instant;

/// `ceil(ratio * n)` clamped to `0..=n` (ratio outside 0..=1 is clamped too).
pub fn budget(ratio: f64, n: usize) -> usize {
    ((ratio.clamp(0.0, 1.0) * n as f64).ceil() as usize).min(n)
}

/// What a selector sees: the engine, the assembled prompt and the KV it will reuse.
#[derive(Debug)]
pub struct SelectInput<'a, E: Engine = Model> {
    pub model: &'a E,
    pub assembly: &'a Assembly,
    pub prefix: &'a PrefixKv,
    pub chunks: &'a [&'a ChunkKv],
    /// True when the first chunk was precomputed after this very prefix (its KV is then exact).
    pub first_chunk_exact: bool,
    /// ρ: the budget is `ceil(ratio * chunk tokens)` (ignored by the fixed methods).
    pub ratio: f64,
    /// Positions past the prompt the fused cache makes room for (the answer's; the CPU
    /// engine's cache grows without it, a device cache does not).
    pub room: usize,
}

impl<'a, E: Engine> SelectInput<'a, E> {
    /// Bundles the inputs; `first_chunk_exact` is derived from the first chunk's precompute mode.
    pub fn new(
        model: &'a E,
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
            room: 0,
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

    /// The fused cache of these inputs (prefix rows and rotated chunk rows), with room for
    /// [`SelectInput::room`] more positions.
    pub fn fused(&self) -> Result<E::Cache> {
        fused(
            self.model,
            self.assembly,
            self.prefix,
            self.chunks,
            self.room,
        )
    }
}

/// A reuse method: picks the chunk positions to recompute, and runs the blended prefill. The
/// served ones run on any [`Engine`]; a selector that needs the CPU engine's insides
/// (CacheBlend's staged pass, the evaluation's ablations) implements it for [`Model`] only.
pub trait Selector<E: Engine = Model> {
    /// Absolute positions of chunk tokens to recompute.
    fn select(&self, input: &SelectInput<'_, E>) -> Result<Vec<usize>>;
    /// The blended prefill of this method (by default: select, then recompute those tokens
    /// through every layer), with the selection's time in `select_ms`.
    fn prefill(&self, input: &SelectInput<'_, E>) -> Result<BlendOutput<E::Cache>> {
        let t = Instant::now();
        let positions = self.select(input)?;
        let select_ms = t.elapsed().as_secs_f64() * 1e3;
        let mut out = blend_on(input.model, input.assembly, input.fused()?, &positions)?;
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
/// Query-aware selection at the cost of one question pass: the question runs over the fused
/// (reused) cache, and the chunk tokens its deep layers attend to most are recomputed.
/// `window` > 0 recomputes `window` tokens on each side of every pick (within its chunk)
/// instead of scattered tokens. With `first_round` < 1 the budget is spent in two rounds:
/// that share of it as above, then the question probes again over the cache those picks left
/// and the rest goes where it attends now.
#[derive(Debug, Clone, Copy)]
pub struct TargetProbe {
    /// First probed layer as a fraction of the depth (0.5: the deeper half).
    pub from_depth: f64,
    /// End of the probed layers as a fraction of the depth (1.0: the last layer). The probe
    /// pass stops there, so a probe that ends halfway costs half a question pass.
    pub to_depth: f64,
    pub window: usize,
    /// At every layer of the blended prefill, each chunk's tokens left to reuse move as the
    /// picks whose keys they resemble were moved by recomputing
    /// ([`Blend::blend_prefill_shift`] with [`ShiftRule::Similar`]).
    pub shift: bool,
    /// The share of the budget picked by the first probe (1: one round). The rest is picked
    /// by a second probe over the cache the first round's blend left, and recomputed over it:
    /// where the first picks' fresh rows move the question's attention (a second hop of a
    /// multi-hop question), the rest follows. Costs a probe, a pass of the question rows and
    /// (with `shift`) a shift of the reused rows more than one round, the same chunk rows.
    /// Measurement-only (the evaluation's `probe_shift_twice`): it answered as full recompute
    /// no more often than one round on questions it was not chosen on (docs/evaluation.md),
    /// so the served methods use 1.
    pub first_round: f64,
}
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
            shift: false,
            first_round: 1.0,
        }
    }
}

impl<E: Engine> Selector<E> for FullRecompute {
    fn select(&self, input: &SelectInput<'_, E>) -> Result<Vec<usize>> {
        Ok(input.assembly.chunk_positions())
    }
    fn prefill(&self, input: &SelectInput<'_, E>) -> Result<BlendOutput<E::Cache>> {
        let ids = &input.assembly.ids;
        let (cache, logits) = input.model.prefill_into(ids, ids.len() + input.room)?;
        let recomputed = input.assembly.chunk_positions();
        let n = recomputed.len();
        Ok(BlendOutput::of(cache, logits, recomputed, n))
    }
}

impl<E: Engine> Selector<E> for FullReuse {
    fn select(&self, _: &SelectInput<'_, E>) -> Result<Vec<usize>> {
        Ok(Vec::new())
    }
}

impl<E: Engine> Selector<E> for PrefixCaching {
    fn select(&self, input: &SelectInput<'_, E>) -> Result<Vec<usize>> {
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

impl<E: Engine> Selector<E> for Epic {
    fn select(&self, input: &SelectInput<'_, E>) -> Result<Vec<usize>> {
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
            DeviationCheck {
                layer: self.check_layer.min(n_layer.saturating_sub(2)),
                by_value: self.by_value,
            },
        )
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

/// Of the question's mass on the `candidates`, the share that falls on those not `picked`
/// ([`BlendSignals::uncovered`](crate::BlendSignals::uncovered); 0 when there is no mass).
pub fn uncovered(candidates: &[usize], picked: &[usize], score: impl Fn(usize) -> f32) -> f32 {
    let total: f32 = candidates.iter().map(|&p| score(p)).sum();
    let covered: f32 = picked.iter().map(|&p| score(p)).sum();
    if total > 0.0 {
        (1.0 - covered / total).max(0.0)
    } else {
        0.0
    }
}

/// Layers `from × n_layer .. to × n_layer`, at least one (fractions clamped to 0..=1).
pub fn layer_span<E: Engine>(model: &E, from: f64, to: f64) -> std::ops::Range<usize> {
    let n = model.config().n_layer;
    let at = |f: f64| (f.clamp(0.0, 1.0) * n as f64) as usize;
    let start = at(from).min(n - 1);
    start..at(to).clamp(start + 1, n)
}

/// What the question's probe saw: the fused cache it ran over (the blended prefill continues
/// on it) and its scores.
#[derive(Debug)]
pub struct Probe<C = KvCache> {
    pub cache: C,
    pub scores: ProbeScores,
}

/// The candidates, the question's attention mass per position and the budget.
#[derive(Debug, Clone, Default)]
pub struct ProbeScores {
    pub candidates: Vec<usize>,
    /// Attention mass per position of the prompt (empty when the budget is 0: no probe ran).
    pub mass: Vec<f32>,
    /// Tokens to recompute ([`SelectInput::spend`]).
    pub k: usize,
}

impl ProbeScores {
    /// The question's mass at position `p` (0 past the probed rows).
    pub fn score(&self, p: usize) -> f32 {
        self.mass.get(p).copied().unwrap_or(0.0)
    }

    /// `out` with what the probe knows of the picks it recomputed: the share of mass left
    /// uncovered, the candidates left to reuse best first, and `select_ms`.
    pub fn annotate<C>(
        &self,
        mut out: BlendOutput<C>,
        picked: &[usize],
        select_ms: f64,
    ) -> BlendOutput<C> {
        out.select_ms = select_ms;
        if self.k > 0 {
            out.signals.uncovered = uncovered(&self.candidates, picked, |p| self.score(p));
            out.reserve = ranked_rest(&self.candidates, picked, |p| self.score(p));
        }
        out
    }
}

impl TargetProbe {
    /// One round's blended prefill over `cache`: `picked` recomputed, and with `shift` the
    /// rest of `candidates` moved as the picks they resemble.
    fn blend<E: Engine>(
        &self,
        model: &E,
        asm: &Assembly,
        cache: E::Cache,
        candidates: &[usize],
        picked: &[usize],
    ) -> Result<BlendOutput<E::Cache>> {
        if self.shift {
            blend_shift(model, asm, cache, candidates, picked, ShiftRule::Similar)
        } else {
            blend_on(model, asm, cache, picked)
        }
    }

    /// The question's attention mass over `cache` at the probed layers, per position.
    fn question_mass<E: Engine>(
        &self,
        model: &E,
        asm: &Assembly,
        cache: &mut E::Cache,
    ) -> Result<Vec<f32>> {
        let layers = layer_span(model, self.from_depth, self.to_depth);
        let q_pos = asm.question_positions();
        let q_ids: Vec<u32> = q_pos.iter().map(|&p| asm.ids[p]).collect();
        model.probe(&q_ids, &q_pos, cache, layers)
    }

    /// The fused cache of `input` and the question's attention mass over it at the probed
    /// layers (no pass when the budget is 0).
    pub fn probe<E: Engine>(&self, input: &SelectInput<'_, E>) -> Result<Probe<E::Cache>> {
        let (model, asm) = (input.model, input.assembly);
        let mut cache = input.fused()?;
        let k = input.spend();
        let candidates = input.candidates();
        let mass = if k == 0 {
            Vec::new()
        } else {
            self.question_mass(model, asm, &mut cache)?
        };
        Ok(Probe {
            cache,
            scores: ProbeScores {
                candidates,
                mass,
                k,
            },
        })
    }
}

impl<E: Engine> Selector<E> for TargetProbe {
    fn select(&self, input: &SelectInput<'_, E>) -> Result<Vec<usize>> {
        Ok(self.prefill(input)?.recomputed)
    }
    /// Overridden: the probe's fused cache is the one the blended prefill then continues on.
    fn prefill(&self, input: &SelectInput<'_, E>) -> Result<BlendOutput<E::Cache>> {
        let t = Instant::now();
        let (model, asm) = (input.model, input.assembly);
        let Probe { cache, scores } = self.probe(input)?;
        let k = scores.k;
        let first = self.first_round.clamp(0.0, 1.0);
        let k1 = ((k as f64) * first).round() as usize;
        let candidates = &scores.candidates;
        // One round unless both rounds have picks to make, and where the budget covers every
        // candidate (ρ = 1): recomputed together, each row is the full prefill's, where the
        // first of two rounds would have read stale rows.
        if k1 == 0 || k1 >= k || k >= candidates.len() || !model.rope_recovery_ok() {
            let picked = match k {
                0 => Vec::new(),
                k => top_k(asm, candidates, |p| scores.score(p), k, self.window),
            };
            let select_ms = t.elapsed().as_secs_f64() * 1e3;
            let out = self.blend(model, asm, cache, candidates, &picked)?;
            return Ok(scores.annotate(out, &picked, select_ms));
        }
        // Two rounds: the first share of the budget where the question attends over the
        // reused cache, then the rest where it attends over the cache that blend left.
        let first = top_k(asm, candidates, |p| scores.score(p), k1, self.window);
        let mut select_ms = t.elapsed().as_secs_f64() * 1e3;
        let mut cache = self.blend(model, asm, cache, candidates, &first)?.cache;
        let t2 = Instant::now();
        let mut taken = vec![false; asm.ids.len()];
        first.iter().for_each(|&p| taken[p] = true);
        let rest: Vec<usize> = candidates.iter().copied().filter(|&p| !taken[p]).collect();
        let again = ProbeScores {
            candidates: rest,
            mass: self.question_mass(model, asm, &mut cache)?,
            k: k - first.len(),
        };
        let second = top_k(
            asm,
            &again.candidates,
            |p| again.score(p),
            again.k,
            self.window,
        );
        select_ms += t2.elapsed().as_secs_f64() * 1e3;
        let mut out = self.blend(model, asm, cache, &again.candidates, &second)?;
        let mut picked = first;
        picked.extend(&second);
        picked.sort_unstable();
        out.recomputed.clone_from(&picked);
        let mut out = scores.annotate(out, &picked, select_ms);
        // A look recomputes next what the question attends to over the second round's cache.
        out.reserve = ranked_rest(&again.candidates, &second, |p| again.score(p));
        Ok(out)
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
}
