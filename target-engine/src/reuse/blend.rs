//! Blended prefill: reuse precomputed chunk KV, recompute a chosen subset of chunk tokens (plus
//! the question) through every layer against the fused cache, and hand back a cache ready for
//! ordinary decoding.
//!
//! The fused cache starts as: prefix rows (exact), then each chunk's rows rotated to their
//! place. The forward over the recomputed positions overwrites their rows layer by layer, so
//! at layer `l` a recomputed token attends to fresh rows of the other recomputed tokens and to
//! reused rows of the rest, causally by absolute position. Cost scales with the number of
//! recomputed tokens (attention aside).

use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::model::Model;
use crate::reuse::assembly::{Assembly, SegmentKind};
use crate::reuse::chunk::Precompute;
use crate::reuse::chunk::{ChunkKv, PrefixKv};
use crate::reuse::shift::{Shift, ShiftGroup};
use candle_core::{Device, Tensor};

/// What a blended prefill returns.
#[derive(Debug)]
pub struct BlendOutput {
    /// The fused cache, every position `0..ids.len()` filled, ready for decode.
    pub cache: KvCache,
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
/// does not apply (nothing recomputed, a selector without a probe) or was not asked for (the
/// deviations: [`SelectInput::measure`](crate::SelectInput::measure)).
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

impl BlendOutput {
    /// Recomputed chunk tokens over all chunk tokens (what ρ counts).
    pub fn ratio(&self) -> f64 {
        if self.chunk_tokens == 0 {
            0.0
        } else {
            self.recomputed.len() as f64 / self.chunk_tokens as f64
        }
    }
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

    /// [`Blend::blend_prefill_on`], also measuring how far recomputing moved the recomputed
    /// rows ([`BlendSignals::deviation_k`], `deviation_v`) when `measure` is set: a copy of
    /// those rows over every layer, so only the evaluation asks for it.
    fn blend_prefill_measured(
        &self,
        asm: &Assembly,
        cache: KvCache,
        recompute: &[usize],
        measure: bool,
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
        check: (usize, bool),
    ) -> Result<BlendOutput>;

    /// Every candidate (and the question) through the first `shallow` layers, so the rows
    /// there are fresh for all of them; then only `picks` (candidates) and the question through
    /// the rest. A measurement (`probe_shallow`): fresh shallow rows for every reused token at
    /// `shallow / n_layer` of a full prefill's cost.
    fn blend_prefill_shallow(
        &self,
        asm: &Assembly,
        fused: &KvCache,
        candidates: &[usize],
        picks: &[usize],
        shallow: usize,
    ) -> Result<BlendOutput>;

    /// The blended prefill of `recompute` (and the question) over `cache`, where at every layer
    /// each chunk's candidates left to reuse are moved by the mean deviation (new minus reused,
    /// K with RoPE undone) its recomputed tokens showed at that layer, or with `by_similarity`
    /// by their moves weighted by how much each pick's key resembles the reused token's. A
    /// measurement (`probe_shift`) and a method (`target_probe_shift`): whether what the picks learn of the
    /// other chunks carries over to their neighbours, at no extra recompute.
    fn blend_prefill_shift(
        &self,
        asm: &Assembly,
        cache: KvCache,
        candidates: &[usize],
        recompute: &[usize],
        by_similarity: bool,
    ) -> Result<BlendOutput>;

    /// Blended prefill recomputing the chunk tokens at `recompute` only through the layers
    /// `from_layer..`, starting from the residual stream each had at `from_layer` within its own
    /// chunk (computed here from the chunk's stored KV; ingestion could store it instead), while
    /// the question runs every layer. Below `from_layer` those tokens keep their reused rows, so
    /// twice the tokens recomputed through the deeper half cost what ρ costs through all layers.
    /// A measurement (`probe_deep`): is breadth or depth what reuse is missing?
    fn blend_prefill_deep(
        &self,
        asm: &Assembly,
        cache: KvCache,
        stored: (&PrefixKv, &[&ChunkKv]),
        recompute: &[usize],
        from_layer: usize,
    ) -> Result<BlendOutput>;
}

impl Blend for Model {
    fn fused_cache(
        &self,
        asm: &Assembly,
        prefix: &PrefixKv,
        chunks: &[&ChunkKv],
    ) -> Result<KvCache> {
        let pr = asm.prefix_range();
        if asm.ids[pr.clone()] != prefix.ids[..] {
            return Err(EngineError::InvalidInput(
                "prefix KV does not match the assembled prefix".into(),
            ));
        }
        let mut cache = prefix.cache.clone();
        cache.truncate(pr.end);
        let segs: Vec<_> = asm.chunks().collect();
        if segs.len() != chunks.len() {
            return Err(EngineError::InvalidInput(format!(
                "{} chunk segments, {} chunk KVs",
                segs.len(),
                chunks.len()
            )));
        }
        for (seg, kv) in segs.iter().zip(chunks) {
            if asm.ids[seg.ids.clone()] != kv.ids[..] {
                return Err(EngineError::InvalidInput(format!(
                    "chunk KV ids differ from the assembled chunk at {:?}",
                    seg.ids
                )));
            }
            self.place_chunk(&mut cache, kv, seg.ids.start)?;
        }
        Ok(cache)
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
        self.blend_prefill_measured(asm, cache, recompute, false)
    }

    fn blend_prefill_measured(
        &self,
        asm: &Assembly,
        mut cache: KvCache,
        recompute: &[usize],
        measure: bool,
    ) -> Result<BlendOutput> {
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
        let mut recomputed: Vec<usize> = if self.rope_recovery_ok() {
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
        let before = measure.then(|| ReusedRows::copy(&cache, &recomputed));
        let out = self.forward(&ids, &positions, &mut cache, false)?;
        let logits = self.last_logits(&out)?;
        let (deviation_k, deviation_v) = before.map_or((0.0, 0.0), |b| b.deviation(&cache));
        Ok(BlendOutput {
            cache,
            logits,
            recomputed,
            chunk_tokens: chunk_pos.len(),
            select_ms: 0.0,
            signals: BlendSignals {
                deviation_k,
                deviation_v,
                uncovered: 0.0,
            },
            reserve: Vec::new(),
        })
    }

    fn blend_prefill_cacheblend(
        &self,
        asm: &Assembly,
        fused: &KvCache,
        candidates: &[usize],
        k: usize,
        check: (usize, bool),
    ) -> Result<BlendOutput> {
        let (check_layer, by_value) = check;
        let n_layer = self.config().n_layer;
        if check_layer + 1 >= n_layer {
            return Err(EngineError::InvalidInput(format!(
                "check layer {check_layer} must be below {}",
                n_layer - 1
            )));
        }
        let row = self.config().kv_row();
        let choose = |cache: &KvCache| -> Vec<usize> {
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
        self.blend_two_stage(asm, fused, candidates, check_layer + 1, choose)
    }

    fn blend_prefill_shallow(
        &self,
        asm: &Assembly,
        fused: &KvCache,
        candidates: &[usize],
        picks: &[usize],
        shallow: usize,
    ) -> Result<BlendOutput> {
        let n_layer = self.config().n_layer;
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
        self.blend_two_stage(asm, fused, candidates, shallow, |_| picks.to_vec())
    }

    fn blend_prefill_shift(
        &self,
        asm: &Assembly,
        mut cache: KvCache,
        candidates: &[usize],
        recompute: &[usize],
        by_similarity: bool,
    ) -> Result<BlendOutput> {
        if !self.rope_recovery_ok() {
            return self.blend_prefill_on(asm, cache, recompute);
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
        let mut picked = vec![false; asm.ids.len()];
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
        let shift = Shift {
            groups,
            by_similarity,
        };
        let x = shift.forward(self, &ids, &positions, &mut cache)?;
        self.blend_output(&x, cache, recomputed, chunk_pos.len())
    }

    fn blend_prefill_deep(
        &self,
        asm: &Assembly,
        mut cache: KvCache,
        stored: (&PrefixKv, &[&ChunkKv]),
        recompute: &[usize],
        from_layer: usize,
    ) -> Result<BlendOutput> {
        let n_layer = self.config().n_layer;
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
        let (prefix, chunks) = stored;
        let mut rows = self.own_chunk_hidden(asm, prefix, chunks, &recomputed, from_layer)?;
        let qids: Vec<u32> = question.iter().map(|&p| asm.ids[p]).collect();
        let (xq, _) = self.forward_layers(
            self.embed(&qids)?,
            &question,
            &mut cache,
            0..from_layer,
            false,
        )?;
        rows.push(xq);
        let mut positions = recomputed.clone();
        positions.extend(&question);
        let (x, _) = self.forward_layers(
            Tensor::cat(&rows, 0)?,
            &positions,
            &mut cache,
            from_layer..n_layer,
            false,
        )?;
        self.blend_output(&x, cache, recomputed, chunk_pos.len())
    }
}

impl Model {
    /// Two-stage blend: the `candidates` and the question run layers `..through` over a copy
    /// of `fused` (their rows there fresh), then `choose` (given that cache) names the
    /// candidates that continue with the question through the remaining layers.
    fn blend_two_stage(
        &self,
        asm: &Assembly,
        fused: &KvCache,
        candidates: &[usize],
        through: usize,
        choose: impl FnOnce(&KvCache) -> Vec<usize>,
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

    /// A blend's output once its last pass left the residual rows `x` (the prompt's last
    /// position last): that row's logits, with `cache` and `recomputed` as they are.
    fn blend_output(
        &self,
        x: &Tensor,
        cache: KvCache,
        recomputed: Vec<usize>,
        chunk_tokens: usize,
    ) -> Result<BlendOutput> {
        let (n, _) = x.dims2()?;
        let last = self.final_norm(&x.narrow(0, n - 1, 1)?)?;
        let mut logits = self.logits(&last)?.flatten_all()?.to_vec1::<f32>()?;
        logits.truncate(self.tokenizer().vocab_size());
        Ok(BlendOutput {
            cache,
            logits,
            recomputed,
            chunk_tokens,
            select_ms: 0.0,
            signals: BlendSignals::default(),
            reserve: Vec::new(),
        })
    }

    /// The residual stream at `from_layer` of the chunk tokens at `picked` (sorted absolute
    /// positions), each computed within its own chunk as ingestion computed the chunk: a pass
    /// of those tokens alone through layers `..from_layer` over the chunk's stored rows placed
    /// where they were computed (after the prefix, or alone). Rows in `picked` order.
    fn own_chunk_hidden(
        &self,
        asm: &Assembly,
        prefix: &PrefixKv,
        chunks: &[&ChunkKv],
        picked: &[usize],
        from_layer: usize,
    ) -> Result<Vec<Tensor>> {
        let mut out = Vec::new();
        for (seg, kv) in asm.chunks().zip(chunks) {
            let mine: Vec<usize> = picked
                .iter()
                .copied()
                .filter(|p| seg.ids.contains(p))
                .collect();
            if mine.is_empty() {
                continue;
            }
            let mut own = match kv.mode {
                crate::reuse::chunk::PrecomputeMode::AfterPrefix { .. } => {
                    let mut c = prefix.cache.clone();
                    c.truncate(kv.base_pos);
                    c
                }
                crate::reuse::chunk::PrecomputeMode::Standalone => self.new_cache(),
            };
            self.place_chunk(&mut own, kv, kv.base_pos)?;
            let pos: Vec<usize> = mine
                .iter()
                .map(|p| kv.base_pos + (p - seg.ids.start))
                .collect();
            let ids: Vec<u32> = mine.iter().map(|&p| asm.ids[p]).collect();
            let (x, _) =
                self.forward_layers(self.embed(&ids)?, &pos, &mut own, 0..from_layer, false)?;
            out.push(x);
        }
        Ok(out)
    }
}

/// The reused K and V rows of the positions a blend recomputes, every layer, kept to measure
/// how far recomputing moved them.
struct ReusedRows {
    positions: Vec<usize>,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl ReusedRows {
    fn copy(cache: &KvCache, positions: &[usize]) -> Self {
        let row = cache.row_len();
        let rows = |data: &[f32]| -> Vec<f32> {
            positions
                .iter()
                .flat_map(|&p| data[p * row..(p + 1) * row].iter().copied())
                .collect()
        };
        Self {
            positions: positions.to_vec(),
            k: (0..cache.n_layer()).map(|l| rows(cache.k(l))).collect(),
            v: (0..cache.n_layer()).map(|l| rows(cache.v(l))).collect(),
        }
    }

    /// `sqrt(Σ|fresh - reused|² / Σ|reused|²)` over every layer, for K and for V.
    fn deviation(&self, fresh: &KvCache) -> (f32, f32) {
        (
            self.ratio(&self.k, |l| fresh.k(l), fresh.row_len()),
            self.ratio(&self.v, |l| fresh.v(l), fresh.row_len()),
        )
    }

    fn ratio<'c>(&self, old: &[Vec<f32>], new: impl Fn(usize) -> &'c [f32], row: usize) -> f32 {
        let (mut diff, mut norm) = (0f64, 0f64);
        for (l, old) in old.iter().enumerate() {
            let data = new(l);
            for (i, &p) in self.positions.iter().enumerate() {
                let was = &old[i * row..(i + 1) * row];
                for (&a, &b) in data[p * row..(p + 1) * row].iter().zip(was) {
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
    }
}

/// The question's positions; a blend with no question has nothing to compute.
fn question_of(asm: &Assembly) -> Result<Vec<usize>> {
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
