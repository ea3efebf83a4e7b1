//! The evaluation's own selectors, built from the engine's public pieces and handed to the
//! pipeline through [`Knobs`](crate::forcing::Knobs): the ablations of `target_probe` (each
//! changes one thing: how the probe scores, how it picks, or how the picks are recomputed), the
//! [`Oracle`] upper bound, the [`Random`] floor; and [`record_deviation`], how far a blend
//! moved the rows it recomputed. None of them is served.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::time::Instant;
use target_engine::prelude::*;
use target_engine::reuse::blend::question_of;
use target_engine::reuse::fidelity::kl_divergence;
use target_engine::{
    layer_span, top_k, Assembly, BlendOutput, ChunkKv, EngineError, KvCache, Model, PrecomputeMode,
    PrefixKv, Probe, ProbeScores, SelectInput, Selector, ShiftRule, TargetProbe,
};

type Result<T> = target_engine::Result<T>;

/// The share of a chunk's tokens the probe must pick for `probe_whole` to recompute it whole.
pub const PROBE_WHOLE_AT: f64 = 0.5;
/// The fraction of the depth from which `probe_deep` recomputes its picks.
pub const PROBE_DEEP_FROM: f64 = 0.5;
/// The fraction of the depth every reused token runs under `probe_shallow` (4 of 28 layers).
pub const PROBE_SHALLOW_ALL: f64 = 1.0 / 7.0;
/// Tokens on each side averaged by `probe_smooth` (A^3's average pool of 5).
pub const PROBE_SMOOTH: usize = 2;

/// An ablation of `target_probe`: its probe, picks and recompute, one of them changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ablation {
    /// Scores averaged over [`PROBE_SMOOTH`] tokens on each side, within the chunk (A^3).
    Smooth,
    /// Every layer probed, each normalized over the candidates before they are summed
    /// (ProphetKV's layer fusion).
    Fused,
    /// The budget split evenly across the inexact chunks, each recomputing its own best
    /// (QCFuse-style anchors).
    Anchors,
    /// A chunk of whose candidates the picks hold at least [`PROBE_WHOLE_AT`] is recomputed
    /// whole.
    Whole,
    /// The chunk with the most of the question's attention recomputed whole, the rest of the
    /// budget spent on the others.
    TopChunk,
    /// The picks recomputed only through the layers from [`PROBE_DEEP_FROM`] of the depth on,
    /// from their own chunk's residual stream there ([`blend_deep`]).
    Deep,
    /// Every candidate through the first [`PROBE_SHALLOW_ALL`] of the layers, then the picks
    /// through the rest ([`blend_shallow`]).
    Shallow,
    /// Each chunk's reused tokens moved by the mean move of its picks ([`ShiftRule::Mean`]).
    Shift,
}

impl Selector for Ablation {
    fn select(&self, input: &SelectInput) -> Result<Vec<usize>> {
        Ok(self.prefill(input)?.recomputed)
    }

    fn prefill(&self, input: &SelectInput) -> Result<BlendOutput> {
        let t = Instant::now();
        let (model, asm) = (input.model, input.assembly);
        let Probe { cache, mut scores } = match self {
            Self::Fused => fused_probe(input)?,
            _ => TargetProbe::default().probe(input)?,
        };
        if *self == Self::Smooth && scores.k > 0 {
            scores.mass = smooth_within_segments(asm, &scores.mass, PROBE_SMOOTH);
        }
        let picked = self.pick(asm, &scores);
        let select_ms = t.elapsed().as_secs_f64() * 1e3;
        let cands = &scores.candidates;
        let n_layer = model.config().n_layer as f64;
        // A model too shallow for the split (`probe_shallow` runs 4 of 28 layers) recomputes
        // the picks through every layer, as `target_probe` does.
        let from = (PROBE_DEEP_FROM * n_layer).round() as usize;
        let shallow = (PROBE_SHALLOW_ALL * n_layer).round() as usize;
        let out = match self {
            Self::Deep if from > 0 => {
                let stored = Stored {
                    prefix: input.prefix,
                    chunks: input.chunks,
                };
                blend_deep(model, asm, cache, stored, &picked, from)?
            }
            Self::Shallow if shallow > 0 => {
                blend_shallow(model, asm, &cache, cands, &picked, shallow)?
            }
            Self::Shift => {
                model.blend_prefill_shift(asm, cache, cands, &picked, ShiftRule::Mean)?
            }
            _ => model.blend_prefill_on(asm, cache, &picked)?,
        };
        Ok(scores.annotate(out, &picked, select_ms))
    }
}

impl Ablation {
    /// The candidates this ablation recomputes, given the probe's scores.
    fn pick(&self, asm: &Assembly, scores: &ProbeScores) -> Vec<usize> {
        let (k, cands) = (scores.k, &scores.candidates);
        let score = |p: usize| scores.score(p);
        match (k, self) {
            (0, _) => Vec::new(),
            (k, Self::Anchors) => top_k_per_segment(asm, cands, &score, k),
            (k, Self::TopChunk) => whole_top_chunk(asm, cands, &score, k),
            (k, Self::Whole) => {
                widen_to_chunks(asm, cands, &top_k(asm, cands, score, k, 0), PROBE_WHOLE_AT)
            }
            (k, _) => top_k(asm, cands, score, k, 0),
        }
    }
}

/// The probe of [`Ablation::Fused`]: every layer's attention mass, each normalized over the
/// candidates ([`fuse_layers`]).
fn fused_probe(input: &SelectInput) -> Result<Probe> {
    let (model, asm) = (input.model, input.assembly);
    let mut cache = input.fused()?;
    let (k, candidates) = (input.spend(), input.candidates());
    let mass = if k == 0 {
        Vec::new()
    } else {
        let q_pos = asm.question_positions();
        let q_ids: Vec<u32> = q_pos.iter().map(|&p| asm.ids[p]).collect();
        let layers = layer_span(model, 0.0, 1.0);
        let per_layer = model.forward_probe_layers(&q_ids, &q_pos, &mut cache, layers)?;
        fuse_layers(&per_layer, &candidates)
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

/// The stored KV a deep blend reads each pick's own-chunk residual stream from.
#[derive(Debug, Clone, Copy)]
pub struct Stored<'a> {
    pub prefix: &'a PrefixKv,
    pub chunks: &'a [&'a ChunkKv],
}

/// Blended prefill recomputing the chunk tokens at `recompute` only through the layers
/// `from_layer..`, starting from the residual stream each had at `from_layer` within its own
/// chunk (computed here from the chunk's `stored` KV), while the question runs every layer.
/// Below `from_layer` those tokens keep their reused rows, so twice the tokens recomputed
/// through the deeper half cost what ρ costs through all layers. Is breadth or depth what
/// reuse is missing?
pub fn blend_deep(
    model: &Model,
    asm: &Assembly,
    mut cache: KvCache,
    stored: Stored<'_>,
    recompute: &[usize],
    from_layer: usize,
) -> Result<BlendOutput> {
    let n_layer = model.config().n_layer;
    if from_layer == 0 || from_layer >= n_layer {
        return Err(EngineError::InvalidInput(format!(
            "the first recomputed layer {from_layer} must be within 1..{n_layer}"
        )));
    }
    let chunk_pos = asm.chunk_positions();
    let question = question_of(asm)?;
    let mut recomputed = recompute.to_vec();
    recomputed.sort_unstable();
    recomputed.dedup();
    if let Some(&bad) = recomputed
        .iter()
        .find(|p| chunk_pos.binary_search(p).is_err())
    {
        return Err(EngineError::InvalidInput(format!(
            "position {bad} to recompute is not a chunk token"
        )));
    }
    let mut rows = own_chunk_hidden(model, asm, stored, &recomputed, from_layer)?;
    let qids: Vec<u32> = question.iter().map(|&p| asm.ids[p]).collect();
    let (xq, _) = model.forward_layers(
        model.embed(&qids)?,
        &question,
        &mut cache,
        0..from_layer,
        false,
    )?;
    rows.push(xq);
    let mut positions = recomputed.clone();
    positions.extend(&question);
    let (x, _) = model.forward_layers(
        candle_core::Tensor::cat(&rows, 0)?,
        &positions,
        &mut cache,
        from_layer..n_layer,
        false,
    )?;
    model.blend_output(&x, cache, recomputed, chunk_pos.len())
}

/// The residual stream at `from_layer` of the chunk tokens at `picked` (sorted absolute
/// positions), each computed within its own chunk as ingestion computed the chunk: a pass of
/// those tokens alone through layers `..from_layer` over the chunk's stored rows placed where
/// they were computed (after the prefix, or alone). Rows in `picked` order.
fn own_chunk_hidden(
    model: &Model,
    asm: &Assembly,
    stored: Stored<'_>,
    picked: &[usize],
    from_layer: usize,
) -> Result<Vec<candle_core::Tensor>> {
    let mut out = Vec::new();
    for (seg, kv) in asm.chunks().zip(stored.chunks) {
        let mine: Vec<usize> = picked
            .iter()
            .copied()
            .filter(|p| seg.ids.contains(p))
            .collect();
        if mine.is_empty() {
            continue;
        }
        let mut own = match kv.mode {
            PrecomputeMode::AfterPrefix { .. } => {
                let mut c = stored.prefix.cache.clone();
                c.truncate(kv.base_pos);
                c
            }
            PrecomputeMode::Standalone => model.new_cache(),
        };
        model.place_chunk(&mut own, kv, kv.base_pos)?;
        let pos: Vec<usize> = mine
            .iter()
            .map(|p| kv.base_pos + (p - seg.ids.start))
            .collect();
        let ids: Vec<u32> = mine.iter().map(|&p| asm.ids[p]).collect();
        let (x, _) =
            model.forward_layers(model.embed(&ids)?, &pos, &mut own, 0..from_layer, false)?;
        out.push(x);
    }
    Ok(out)
}

/// Every candidate (and the question) through the first `shallow` layers, so the rows there
/// are fresh for all of them; then only `picks` (candidates) and the question through the
/// rest: fresh shallow rows for every reused token at `shallow / n_layer` of a full
/// prefill's cost.
pub fn blend_shallow(
    model: &Model,
    asm: &Assembly,
    fused: &KvCache,
    candidates: &[usize],
    picks: &[usize],
    shallow: usize,
) -> Result<BlendOutput> {
    let n_layer = model.config().n_layer;
    if shallow == 0 || shallow >= n_layer {
        return Err(EngineError::InvalidInput(format!(
            "the layers every candidate runs ({shallow}) must be within 1..{n_layer}"
        )));
    }
    if let Some(&bad) = picks.iter().find(|p| !candidates.contains(p)) {
        return Err(EngineError::InvalidInput(format!(
            "pick {bad} is not a candidate"
        )));
    }
    model.blend_prefill_staged(asm, fused, candidates, shallow, &mut |_| picks.to_vec())
}

/// A seeded uniform choice among the candidates: the floor every selector must beat.
#[derive(Debug, Clone, Copy)]
pub struct Random {
    pub seed: u64,
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

/// The upper bound, from a full prefill: the better (lower first-token KL to the full
/// prefill) of two choices: the tokens whose reused KV deviates most from the true KV over the
/// deep layers, and the tokens the full prefill's question attends to most.
#[derive(Debug, Clone, Copy, Default)]
pub struct Oracle;

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
        let layers = layer_span(model, 2.0 / 3.0, 1.0);
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
        let q_pos = asm.question_positions();
        let q_ids: Vec<u32> = q_pos.iter().map(|&p| asm.ids[p]).collect();
        let mass = model.forward_probe(&q_ids, &q_pos, &mut full, layer_span(model, 0.5, 1.0))?;
        let by_attn = top_k(asm, &cands, |p| mass.get(p).copied().unwrap_or(0.0), k, 0);
        let select_ms = t.elapsed().as_secs_f64() * 1e3;
        let a = model.blend_prefill_on(asm, fused.clone(), &by_kv)?;
        let b = model.blend_prefill_on(asm, fused, &by_attn)?;
        let kl = |o: &BlendOutput| kl_divergence(&full_logits, &o.logits);
        let mut best = if kl(&b) < kl(&a) { b } else { a };
        best.select_ms = select_ms;
        Ok(best)
    }
}

/// The reused rows a blend starts from, kept to measure how far it moved them
/// ([`record_deviation`]): the fused cache of `input`, or `None` where the query read no chunk
/// KV (full recompute). The copy is the evaluation's cost, taken off the query's clock
/// ([`Experiment::before_blend`](gateway::pipeline::Experiment::before_blend)).
pub fn reused_rows(input: &SelectInput) -> Result<Option<KvCache>> {
    let read_kv = input.chunks.len() == input.assembly.chunks().count();
    read_kv.then(|| input.fused()).transpose()
}

/// How far the blend `out` moved the rows it recomputed from `before` (what
/// [`reused_rows`] kept), into its [`BlendSignals`](target_engine::BlendSignals):
/// `sqrt(Σ|fresh - reused|² / Σ|reused|²)` over every layer, for K and for V.
pub fn record_deviation(before: &KvCache, out: &mut BlendOutput) {
    let ratio = |k: bool| -> f32 {
        let row = before.row_len();
        let (mut diff, mut norm) = (0f64, 0f64);
        for l in 0..before.n_layer() {
            let (new, old) = if k {
                (out.cache.k(l), before.k(l))
            } else {
                (out.cache.v(l), before.v(l))
            };
            for &p in &out.recomputed {
                let span = p * row..(p + 1) * row;
                for (&a, &b) in new[span.clone()].iter().zip(&old[span]) {
                    diff += f64::from(a - b) * f64::from(a - b);
                    norm += f64::from(b) * f64::from(b);
                }
            }
        }
        if norm > 0.0 {
            (diff / norm).sqrt() as f32
        } else {
            0.0
        }
    };
    out.signals.deviation_k = ratio(true);
    out.signals.deviation_v = ratio(false);
}

/// Each layer's mass divided by its sum over `candidates` (a layer with none is skipped),
/// summed over the layers in order.
pub fn fuse_layers(per_layer: &[Vec<f32>], candidates: &[usize]) -> Vec<f32> {
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
pub fn smooth_within_segments(asm: &Assembly, score: &[f32], radius: usize) -> Vec<f32> {
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
) -> Vec<usize> {
    let groups = candidates_by_segment(asm, candidates);
    let sizes: Vec<usize> = groups.iter().map(Vec::len).collect();
    let mut picked: Vec<usize> = groups
        .iter()
        .zip(even_shares(&sizes, k))
        .flat_map(|(g, share)| top_k(asm, g, score, share, 0))
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
pub fn whole_top_chunk(
    asm: &Assembly,
    candidates: &[usize],
    score: &dyn Fn(usize) -> f32,
    k: usize,
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
    let mut picked = top_k(asm, &rest, score, k.saturating_sub(top.len()), 0);
    picked.extend(top);
    picked.sort_unstable();
    picked
}

#[cfg(test)]
mod tests {
    use super::*;

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
        use target_engine::SegmentKind;
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
            whole_top_chunk(&asm, &cands, &score, 6),
            vec![1, 4, 6, 7, 8, 9]
        );
        // A budget smaller than that chunk still recomputes it whole, and nothing else.
        assert_eq!(whole_top_chunk(&asm, &cands, &score, 2), vec![6, 7, 8, 9]);
        assert_eq!(whole_top_chunk(&asm, &[], &score, 2), Vec::<usize>::new());
    }

    #[test]
    fn smoothing_averages_neighbours_within_a_segment_only() {
        use target_engine::SegmentKind;
        let mut asm = Assembly::default();
        asm.push(SegmentKind::Chunk(0), "abc", &[1, 2, 3]);
        asm.push(SegmentKind::Chunk(1), "de", &[4, 5]);
        let s = smooth_within_segments(&asm, &[3.0, 0.0, 0.0, 6.0, 0.0], 1);
        // Position 2 does not see position 3 across the chunk boundary.
        assert_eq!(s, vec![1.5, 1.0, 0.0, 3.0, 3.0]);
    }
}
