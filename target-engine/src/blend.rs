//! Blended prefill: reuse precomputed chunk KV, recompute a chosen subset of chunk tokens (plus
//! the question) through every layer against the fused cache, and hand back a cache ready for
//! ordinary decoding.
//!
//! The fused cache starts as: prefix rows (exact), then each chunk's rows rotated to their
//! place. The forward over the recomputed positions overwrites their rows layer by layer, so
//! at layer `l` a recomputed token attends to fresh rows of the other recomputed tokens and to
//! reused rows of the rest, causally by absolute position. Cost scales with the number of
//! recomputed tokens (attention aside).

use crate::assembly::{Assembly, SegmentKind};
use crate::chunk::{ChunkKv, PrefixKv};
use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::model::Model;
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

impl Model {
    /// The fused cache before any recompute: exact prefix rows and rotated chunk rows.
    pub fn fused_cache(
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

    /// Blended prefill recomputing the chunk tokens at `recompute` (absolute positions) and
    /// the question. If positional recovery failed its self-test at load, every chunk token is
    /// recomputed instead (logged once).
    pub fn blend_prefill(
        &self,
        asm: &Assembly,
        prefix: &PrefixKv,
        chunks: &[&ChunkKv],
        recompute: &[usize],
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
        let mut cache = self.fused_cache(asm, prefix, chunks)?;
        let mut positions = recomputed.clone();
        positions.extend(asm.question_positions());
        positions.sort_unstable();
        let logits = if positions.is_empty() {
            return Err(EngineError::InvalidInput(
                "nothing to compute: the question segment is empty".into(),
            ));
        } else {
            let ids: Vec<u32> = positions.iter().map(|&p| asm.ids[p]).collect();
            let out = self.forward(&ids, &positions, &mut cache, false)?;
            self.last_logits(&out)?
        };
        Ok(BlendOutput {
            cache,
            logits,
            recomputed,
            chunk_tokens: chunk_pos.len(),
        })
    }

    /// CacheBlend: every chunk and question token runs through layers `0..=check_layer`; the
    /// `ceil(ratio * chunk tokens)` chunk tokens whose fresh K (or V) at the check layer deviates
    /// most from the reused one, plus the question, continue through the later layers.
    pub fn blend_prefill_cacheblend(
        &self,
        asm: &Assembly,
        prefix: &PrefixKv,
        chunks: &[&ChunkKv],
        ratio: f64,
        check_layer: usize,
        by_value: bool,
    ) -> Result<BlendOutput> {
        let n_layer = self.config().n_layer;
        if check_layer + 1 >= n_layer {
            return Err(EngineError::InvalidInput(format!(
                "check layer {check_layer} must be below {}",
                n_layer - 1
            )));
        }
        let fused = self.fused_cache(asm, prefix, chunks)?;
        let chunk_pos = asm.chunk_positions();
        let question = asm.question_positions();
        if question.is_empty() {
            return Err(EngineError::InvalidInput(
                "nothing to compute: the question segment is empty".into(),
            ));
        }
        let mut all = chunk_pos.clone();
        all.extend(&question);
        let ids: Vec<u32> = all.iter().map(|&p| asm.ids[p]).collect();
        let mut cache = fused.clone();
        let (h, _) = self.forward_layers(
            self.embed(&ids)?,
            &all,
            &mut cache,
            0..check_layer + 1,
            false,
        )?;
        let row = self.config().kv_row();
        let (fresh, reused) = if by_value {
            (cache.v(check_layer), fused.v(check_layer))
        } else {
            (cache.k(check_layer), fused.k(check_layer))
        };
        let mut scored: Vec<(f32, usize)> = chunk_pos
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
        let k = budget(ratio, chunk_pos.len());
        let mut recomputed: Vec<usize> = scored.iter().take(k).map(|s| s.1).collect();
        recomputed.sort_unstable();
        // Rows of `h` (ordered as `all`) that continue: the selected chunk tokens and the question.
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
        let (x, _) =
            self.forward_layers(h, &positions, &mut cache, check_layer + 1..n_layer, false)?;
        let (n, _) = x.dims2()?;
        let last = self.final_norm(&x.narrow(0, n - 1, 1)?)?;
        let mut logits = self.logits(&last)?.flatten_all()?.to_vec1::<f32>()?;
        logits.truncate(self.tokenizer().vocab_size());
        Ok(BlendOutput {
            cache,
            logits,
            recomputed,
            chunk_tokens: chunk_pos.len(),
        })
    }
}

/// `ceil(ratio * n)` clamped to `0..=n` (ratio outside 0..=1 is clamped too).
pub fn budget(ratio: f64, n: usize) -> usize {
    ((ratio.clamp(0.0, 1.0) * n as f64).ceil() as usize).min(n)
}

/// The reuse methods of the contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    FullRecompute,
    FullReuse,
    Prefix,
    Epic,
    CacheBlend,
}

impl Method {
    /// Name as in the API and CLI.
    pub fn name(&self) -> &'static str {
        match self {
            Self::FullRecompute => "full_recompute",
            Self::FullReuse => "full_reuse",
            Self::Prefix => "prefix",
            Self::Epic => "epic",
            Self::CacheBlend => "cacheblend",
        }
    }
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
    /// Budget: recompute at most `ceil(ratio * chunk tokens)` (ignored by the fixed methods).
    pub ratio: f64,
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
                == crate::chunk::PrecomputeMode::AfterPrefix {
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
        }
    }
}

/// A reuse method: picks the chunk positions to recompute, and runs the blended prefill.
pub trait Selector {
    /// Method name as in the API.
    fn name(&self) -> &'static str;
    /// Absolute positions of chunk tokens to recompute.
    fn select(&self, input: &SelectInput) -> Result<Vec<usize>>;
    /// The blended prefill of this method (by default: select, then recompute those tokens
    /// through every layer).
    fn prefill(&self, input: &SelectInput) -> Result<BlendOutput> {
        let positions = self.select(input)?;
        input
            .model
            .blend_prefill(input.assembly, input.prefix, input.chunks, &positions)
    }
}

/// Recompute every chunk token (the reference).
#[derive(Debug, Clone, Copy)]
pub struct FullRecompute;
/// Recompute none: only the question is computed.
#[derive(Debug, Clone, Copy)]
pub struct FullReuse;
/// Keep the longest exact cached prefix, recompute everything after it (prefix caching).
#[derive(Debug, Clone, Copy)]
pub struct PrefixCaching;
/// Recompute the first `k` tokens of every chunk (EPIC).
#[derive(Debug, Clone, Copy)]
pub struct Epic {
    pub k: usize,
}
/// CacheBlend: every token through layers `0..=check_layer`, then the tokens whose fresh K (or
/// V, with `by_value`) deviates most from the reused one continue through the later layers.
#[derive(Debug, Clone, Copy)]
pub struct CacheBlend {
    pub check_layer: usize,
    pub by_value: bool,
}

impl Default for Epic {
    fn default() -> Self {
        Self { k: 16 }
    }
}

impl Default for CacheBlend {
    fn default() -> Self {
        Self {
            check_layer: 1,
            by_value: false,
        }
    }
}

impl Selector for FullRecompute {
    fn name(&self) -> &'static str {
        Method::FullRecompute.name()
    }
    fn select(&self, input: &SelectInput) -> Result<Vec<usize>> {
        Ok(input.assembly.chunk_positions())
    }
}

impl Selector for FullReuse {
    fn name(&self) -> &'static str {
        Method::FullReuse.name()
    }
    fn select(&self, _: &SelectInput) -> Result<Vec<usize>> {
        Ok(Vec::new())
    }
}

impl Selector for PrefixCaching {
    fn name(&self) -> &'static str {
        Method::Prefix.name()
    }
    fn select(&self, input: &SelectInput) -> Result<Vec<usize>> {
        let mut segs = input.assembly.chunks();
        if input.first_chunk_exact {
            segs.next();
        }
        Ok(segs.flat_map(|s| s.ids.clone()).collect())
    }
}

impl Epic {
    /// EPIC at a budget: the smallest `k` whose first-`k`-tokens-of-every-chunk selection
    /// reaches `budget` tokens (short chunks contribute all they have). It can exceed the
    /// budget by less than one token per chunk; ratio 1 recomputes every chunk token.
    pub fn for_budget(chunk_lens: &[usize], budget: usize) -> Self {
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
        Self { k: lo }
    }
}

impl Selector for Epic {
    fn name(&self) -> &'static str {
        Method::Epic.name()
    }
    fn select(&self, input: &SelectInput) -> Result<Vec<usize>> {
        Ok(input
            .assembly
            .chunks()
            .flat_map(|s| s.ids.start..s.ids.end.min(s.ids.start + self.k))
            .collect())
    }
}

impl Selector for CacheBlend {
    fn name(&self) -> &'static str {
        Method::CacheBlend.name()
    }
    fn select(&self, input: &SelectInput) -> Result<Vec<usize>> {
        Ok(self.prefill(input)?.recomputed)
    }
    /// Overridden: the tokens chosen continue from the check layer instead of starting over.
    /// The check layer is clamped below the last layer, so shallow models (2 layers) work.
    fn prefill(&self, input: &SelectInput) -> Result<BlendOutput> {
        let n_layer = input.model.config().n_layer;
        input.model.blend_prefill_cacheblend(
            input.assembly,
            input.prefix,
            input.chunks,
            input.ratio,
            self.check_layer.min(n_layer.saturating_sub(2)),
            self.by_value,
        )
    }
}

/// The selector of a method (`epic_k` for EPIC; CacheBlend with its defaults).
pub fn selector(method: Method, epic_k: usize) -> Box<dyn Selector + Send + Sync> {
    match method {
        Method::FullRecompute => Box::new(FullRecompute),
        Method::FullReuse => Box::new(FullReuse),
        Method::Prefix => Box::new(PrefixCaching),
        Method::Epic => Box::new(Epic { k: epic_k }),
        Method::CacheBlend => Box::new(CacheBlend::default()),
    }
}

/// Segment kind of a position, for reports and tests.
pub fn kind_at(asm: &Assembly, pos: usize) -> Option<SegmentKind> {
    asm.segments
        .iter()
        .find(|s| s.ids.contains(&pos))
        .map(|s| s.kind)
}
