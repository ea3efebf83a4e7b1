//! Blended prefill: reuse precomputed chunk KV, recompute a chosen subset of chunk tokens (plus
//! the question) through every layer against the fused cache, and hand back a cache ready for
//! ordinary decoding.
//!
//! The fused cache starts as: prefix rows (exact), then each chunk's rows rotated to their
//! place. The forward over the recomputed positions overwrites their rows layer by layer, so
//! at layer `l` a recomputed token attends to fresh rows of the other recomputed tokens and to
//! reused rows of the rest, causally by absolute position. Cost scales with the number of
//! recomputed tokens (attention aside).

use crate::engine::{Engine, ShiftGroup, ShiftRule};
use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::model::Model;
use crate::reuse::assembly::{Assembly, SegmentKind};
use crate::reuse::chunk::{ChunkKv, PrefixKv};
use candle_core::{Device, Tensor};

/// What a blended prefill returns.
#[derive(Debug)]
pub struct BlendOutput<C = KvCache> {
    /// The fused cache, every position `0..ids.len()` filled, ready for decode.
    pub cache: C,
    /// Logits of the last position.
    pub logits: Vec<f32>,
    /// Chunk positions that were recomputed.
    pub recomputed: Vec<usize>,
    /// Chunk tokens in the prompt.
    pub chunk_tokens: usize,
    /// Of the whole call, the time spent choosing what to recompute (milliseconds).
    pub select_ms: f64,
    /// What the blend saw of its own error, free per request (the fidelity guard's candidate
    /// signals; docs/fidelity-guard.md says which predict a changed answer).
    pub signals: BlendSignals,
    /// The candidates left to reuse, best first as the selector ranked them, for a second
    /// look that recomputes more ([`Blend::blend_prefill_on`] over this cache with the first
    /// of them); empty where the selector ranks nothing.
    pub reserve: Vec<usize>,
}

/// Per-request quantities a blended prefill knows without a full prefill. Each is 0 where it
/// does not apply (nothing recomputed, a selector without a probe) or was not measured: the
/// deviations need a copy of the recomputed rows, which only the evaluation makes.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BlendSignals {
    /// How far the recomputed tokens' fresh K moved from their reused K, over every layer:
    /// `sqrt(Σ|fresh - reused|² / Σ|reused|²)` (CacheBlend's deviation, as a ratio).
    pub deviation_k: f32,
    /// The same for V.
    pub deviation_v: f32,
    /// Of the question's probed attention mass on the candidate tokens, the share that falls
    /// on tokens left to reuse (a query-aware selector's; 0 for the others).
    pub uncovered: f32,
}

impl<C> BlendOutput<C> {
    /// Recomputed chunk tokens over all chunk tokens (what ρ counts).
    pub fn ratio(&self) -> f64 {
        if self.chunk_tokens == 0 {
            0.0
        } else {
            self.recomputed.len() as f64 / self.chunk_tokens as f64
        }
    }
}

/// Where CacheBlend compares fresh rows with reused ones: the layer, and K or V.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviationCheck {
    pub layer: usize,
    /// Compare V rows instead of K rows.
    pub by_value: bool,
}

/// Blended prefill on the model: the fused cache of reused rows, and the forward over the
/// recomputed positions and the question.
pub trait Blend {
    /// The fused cache before any recompute: exact prefix rows and rotated chunk rows.
    fn fused_cache(
        &self,
        asm: &Assembly,
        prefix: &PrefixKv,
        chunks: &[&ChunkKv],
    ) -> Result<KvCache>;

    /// Blended prefill recomputing the chunk tokens at `recompute` (absolute positions) and
    /// the question. If positional recovery failed its self-test at load, every chunk token is
    /// recomputed instead (logged once).
    fn blend_prefill(
        &self,
        asm: &Assembly,
        prefix: &PrefixKv,
        chunks: &[&ChunkKv],
        recompute: &[usize],
    ) -> Result<BlendOutput>;

    /// [`Blend::blend_prefill`] over a fused cache the caller already built (a selector that
    /// probed it first). Rows of the question in `cache` may hold anything: they are recomputed.
    fn blend_prefill_on(
        &self,
        asm: &Assembly,
        cache: KvCache,
        recompute: &[usize],
    ) -> Result<BlendOutput>;

    /// CacheBlend: the `candidates` (chunk tokens whose reused KV is not exact) and the
    /// question run through layers `0..=check_layer`; the `k` candidates whose fresh K (or V)
    /// at the check layer deviates most from the reused one, plus the question, continue
    /// through the later layers.
    fn blend_prefill_cacheblend(
        &self,
        asm: &Assembly,
        fused: &KvCache,
        candidates: &[usize],
        k: usize,
        check: DeviationCheck,
    ) -> Result<BlendOutput>;

    /// A blend in two stages: the `candidates` and the question run layers `..through` over a
    /// copy of `fused` (their rows there fresh), then `choose`, given that cache, names the
    /// candidates that continue with the question through the remaining layers. CacheBlend
    /// chooses by deviation at its check layer; the evaluation's `probe_shallow` by its probe.
    fn blend_prefill_staged(
        &self,
        asm: &Assembly,
        fused: &KvCache,
        candidates: &[usize],
        through: usize,
        choose: &mut dyn FnMut(&KvCache) -> Vec<usize>,
    ) -> Result<BlendOutput>;

    /// The blended prefill of `recompute` (and the question) over `cache`, where at every layer
    /// each chunk's candidates left to reuse are moved as its recomputed tokens were moved
    /// there (new minus reused, K with RoPE undone), by the [`ShiftRule`]. The default method
    /// (`target_probe_shift`, [`ShiftRule::Similar`]): what the picks learn of the other
    /// chunks carries over to their neighbours at no extra recompute.
    fn blend_prefill_shift(
        &self,
        asm: &Assembly,
        cache: KvCache,
        candidates: &[usize],
        recompute: &[usize],
        rule: ShiftRule,
    ) -> Result<BlendOutput>;
}

impl Blend for Model {
    fn fused_cache(
        &self,
        asm: &Assembly,
        prefix: &PrefixKv,
        chunks: &[&ChunkKv],
    ) -> Result<KvCache> {
        fused(self, asm, prefix, chunks, 0)
    }

    fn blend_prefill(
        &self,
        asm: &Assembly,
        prefix: &PrefixKv,
        chunks: &[&ChunkKv],
        recompute: &[usize],
    ) -> Result<BlendOutput> {
        let cache = self.fused_cache(asm, prefix, chunks)?;
        self.blend_prefill_on(asm, cache, recompute)
    }

    fn blend_prefill_on(
        &self,
        asm: &Assembly,
        cache: KvCache,
        recompute: &[usize],
    ) -> Result<BlendOutput> {
        blend_on(self, asm, cache, recompute)
    }

    fn blend_prefill_cacheblend(
        &self,
        asm: &Assembly,
        fused: &KvCache,
        candidates: &[usize],
        k: usize,
        check: DeviationCheck,
    ) -> Result<BlendOutput> {
        let DeviationCheck {
            layer: check_layer,
            by_value,
        } = check;
        let n_layer = self.config().n_layer;
        if check_layer + 1 >= n_layer {
            return Err(EngineError::InvalidInput(format!(
                "check layer {check_layer} must be below {}",
                n_layer - 1
            )));
        }
        let row = self.config().kv_row();
        let mut choose = |cache: &KvCache| -> Vec<usize> {
            let (fresh, reused) = if by_value {
                (cache.v(check_layer), fused.v(check_layer))
            } else {
                (cache.k(check_layer), fused.k(check_layer))
            };
            let mut scored: Vec<(f32, usize)> = candidates
                .iter()
                .map(|&p| {
                    let d: f32 = fresh[p * row..(p + 1) * row]
                        .iter()
                        .zip(&reused[p * row..(p + 1) * row])
                        .map(|(a, b)| (a - b) * (a - b))
                        .sum();
                    (d, p)
                })
                .collect();
            scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            scored.iter().take(k).map(|s| s.1).collect()
        };
        self.blend_prefill_staged(asm, fused, candidates, check_layer + 1, &mut choose)
    }

    fn blend_prefill_staged(
        &self,
        asm: &Assembly,
        fused: &KvCache,
        candidates: &[usize],
        through: usize,
        choose: &mut dyn FnMut(&KvCache) -> Vec<usize>,
    ) -> Result<BlendOutput> {
        let n_layer = self.config().n_layer;
        let chunk_pos = asm.chunk_positions();
        let question = question_of(asm)?;
        let mut all = candidates.to_vec();
        all.extend(&question);
        let ids: Vec<u32> = all.iter().map(|&p| asm.ids[p]).collect();
        let mut cache = fused.clone();
        let (h, _) = self.forward_layers(self.embed(&ids)?, &all, &mut cache, 0..through, false)?;
        let mut recomputed = choose(&cache);
        recomputed.sort_unstable();
        recomputed.dedup();
        // Rows of `h` (ordered as `all`) that continue: the chosen chunk tokens and the question.
        let mut keep = vec![false; asm.ids.len()];
        recomputed
            .iter()
            .chain(&question)
            .for_each(|&p| keep[p] = true);
        let rows: Vec<u32> = all
            .iter()
            .enumerate()
            .filter(|(_, &p)| keep[p])
            .map(|(i, _)| i as u32)
            .collect();
        let positions: Vec<usize> = rows.iter().map(|&i| all[i as usize]).collect();
        let h = h.index_select(&Tensor::new(rows.as_slice(), &Device::Cpu)?, 0)?;
        let (x, _) = self.forward_layers(h, &positions, &mut cache, through..n_layer, false)?;
        self.blend_output(&x, cache, recomputed, chunk_pos.len())
    }

    fn blend_prefill_shift(
        &self,
        asm: &Assembly,
        cache: KvCache,
        candidates: &[usize],
        recompute: &[usize],
        rule: ShiftRule,
    ) -> Result<BlendOutput> {
        blend_shift(self, asm, cache, candidates, recompute, rule)
    }
}

/// The fused cache of a prompt on any engine, before any recompute: the prefix's exact rows,
/// then each chunk's stored rows rotated to its place, with room for `room` positions past
/// the prompt (the answer's).
pub fn fused<E: Engine>(
    engine: &E,
    asm: &Assembly,
    prefix: &PrefixKv,
    chunks: &[&ChunkKv],
    room: usize,
) -> Result<E::Cache> {
    let pr = asm.prefix_range();
    if asm.ids[pr.clone()] != prefix.ids[..] {
        return Err(EngineError::InvalidInput(
            "prefix KV does not match the assembled prefix".into(),
        ));
    }
    let segs: Vec<_> = asm.chunks().collect();
    if segs.len() != chunks.len() {
        return Err(EngineError::InvalidInput(format!(
            "{} chunk segments, {} chunk KVs",
            segs.len(),
            chunks.len()
        )));
    }
    let mut cache = engine.cache_from(&prefix.cache, pr.end, asm.ids.len() + room)?;
    for (seg, kv) in segs.iter().zip(chunks) {
        if asm.ids[seg.ids.clone()] != kv.ids[..] {
            return Err(EngineError::InvalidInput(format!(
                "chunk KV ids differ from the assembled chunk at {:?}",
                seg.ids
            )));
        }
        engine.place(&mut cache, kv, seg.ids.start)?;
    }
    Ok(cache)
}

/// The blended prefill on any engine over a fused `cache`: the chunk tokens at `recompute`
/// and the question run through every layer (their rows overwritten layer by layer). Where
/// positional recovery failed its self-test at load, every chunk token is recomputed.
pub fn blend_on<E: Engine>(
    engine: &E,
    asm: &Assembly,
    mut cache: E::Cache,
    recompute: &[usize],
) -> Result<BlendOutput<E::Cache>> {
    let chunk_pos = asm.chunk_positions();
    let mut is_chunk = vec![false; asm.ids.len()];
    chunk_pos.iter().for_each(|&p| is_chunk[p] = true);
    if let Some(&bad) = recompute
        .iter()
        .find(|&&p| p >= asm.ids.len() || !is_chunk[p])
    {
        return Err(EngineError::InvalidInput(format!(
            "position {bad} to recompute is not a chunk token"
        )));
    }
    let mut recomputed: Vec<usize> = if engine.rope_recovery_ok() {
        recompute.to_vec()
    } else {
        chunk_pos.clone()
    };
    recomputed.sort_unstable();
    recomputed.dedup();
    let mut positions = recomputed.clone();
    positions.extend(asm.question_positions());
    positions.sort_unstable();
    if positions.is_empty() {
        return Err(EngineError::InvalidInput(
            "nothing to compute: the question segment is empty".into(),
        ));
    }
    let ids: Vec<u32> = positions.iter().map(|&p| asm.ids[p]).collect();
    let logits = last_row(engine.pass(&ids, &positions, &mut cache, false)?)?;
    Ok(BlendOutput::of(cache, logits, recomputed, chunk_pos.len()))
}

/// The blended prefill of `recompute` (and the question) over `cache` on any engine, where at
/// every layer each chunk's `candidates` left to reuse move as its recomputed tokens moved
/// there, by `rule` (the default method: [`ShiftRule::Similar`]).
pub fn blend_shift<E: Engine>(
    engine: &E,
    asm: &Assembly,
    mut cache: E::Cache,
    candidates: &[usize],
    recompute: &[usize],
    rule: ShiftRule,
) -> Result<BlendOutput<E::Cache>> {
    if !engine.rope_recovery_ok() {
        return blend_on(engine, asm, cache, recompute);
    }
    let n = asm.ids.len();
    let mut candidate = vec![false; n];
    candidates
        .iter()
        .filter(|&&p| p < n)
        .for_each(|&p| candidate[p] = true);
    if let Some(&bad) = recompute
        .iter()
        .find(|&&p| !candidate.get(p).copied().unwrap_or(false))
    {
        return Err(EngineError::InvalidInput(format!(
            "position {bad} to recompute is not a candidate"
        )));
    }
    let chunk_pos = asm.chunk_positions();
    let mut recomputed = recompute.to_vec();
    recomputed.sort_unstable();
    recomputed.dedup();
    let mut positions = recomputed.clone();
    positions.extend(question_of(asm)?);
    positions.sort_unstable();
    let mut picked = vec![false; n];
    recomputed.iter().for_each(|&p| picked[p] = true);
    let groups: Vec<ShiftGroup> = asm
        .chunks()
        .map(|seg| ShiftGroup {
            rows: (0..positions.len())
                .filter(|&i| seg.ids.contains(&positions[i]))
                .collect(),
            targets: seg
                .ids
                .clone()
                .filter(|&p| candidate[p] && !picked[p])
                .collect(),
        })
        .collect();
    let ids: Vec<u32> = positions.iter().map(|&p| asm.ids[p]).collect();
    let logits = engine.shifted_pass(&ids, &positions, &mut cache, &groups, rule)?;
    Ok(BlendOutput::of(cache, logits, recomputed, chunk_pos.len()))
}

/// The one row of a pass asked for its last row's logits.
fn last_row(rows: Vec<Vec<f32>>) -> Result<Vec<f32>> {
    rows.into_iter()
        .next_back()
        .ok_or_else(|| EngineError::Internal("a pass returned no logits".into()))
}

impl<C> BlendOutput<C> {
    /// A blend's output before selection annotates it: no selection time, no signals, no
    /// reserve.
    pub fn of(cache: C, logits: Vec<f32>, recomputed: Vec<usize>, chunk_tokens: usize) -> Self {
        Self {
            cache,
            logits,
            recomputed,
            chunk_tokens,
            select_ms: 0.0,
            signals: BlendSignals::default(),
            reserve: Vec::new(),
        }
    }
}

impl Model {
    /// A blend's output once its last pass left the residual rows `x` (the prompt's last
    /// position last): that row's logits, with `cache` and `recomputed` as they are. For a
    /// blend built from the forward's pieces ([`Model::forward_layers`]).
    pub fn blend_output(
        &self,
        x: &Tensor,
        cache: KvCache,
        recomputed: Vec<usize>,
        chunk_tokens: usize,
    ) -> Result<BlendOutput> {
        let logits = self.residual_logits(x)?;
        Ok(BlendOutput::of(cache, logits, recomputed, chunk_tokens))
    }

    /// The logits of the last of the residual rows `x` (not normed), cut to the vocabulary.
    pub(crate) fn residual_logits(&self, x: &Tensor) -> Result<Vec<f32>> {
        let (n, _) = x.dims2()?;
        let last = self.final_norm(&x.narrow(0, n - 1, 1)?)?;
        let mut logits = self.logits(&last)?.flatten_all()?.to_vec1::<f32>()?;
        logits.truncate(self.tokenizer().vocab_size());
        Ok(logits)
    }
}

/// The question's positions; a blend with no question has nothing to compute.
pub fn question_of(asm: &Assembly) -> Result<Vec<usize>> {
    let question = asm.question_positions();
    if question.is_empty() {
        return Err(EngineError::InvalidInput(
            "nothing to compute: the question segment is empty".into(),
        ));
    }
    Ok(question)
}

/// Segment kind of a position, for reports and tests.
pub fn kind_at(asm: &Assembly, pos: usize) -> Option<SegmentKind> {
    asm.segments
        .iter()
        .find(|s| s.ids.contains(&pos))
        .map(|s| s.kind)
}
