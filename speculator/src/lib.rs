//! The speculative selector of specrag (SpecCache): a small model reads the assembled prompt in
//! its own tokenization, each chunk token is scored by the mean L2 norm of its deep-layer hidden
//! states, the top-K selection is completed into whole spans under a global budget, and the
//! result is mapped onto the target model's tokens by shared text.
//!
//! The one design choice a reader must know: the speculator never calls the target model and
//! never sees target token ids; the only bridge between the two is byte ranges of the assembled
//! text, which is why two different tokenizers work.

pub mod align;
pub mod importance;
pub mod span;

pub use align::{align, project_scores};
pub use importance::{importance, importance_after, mean_norms, LayerRange};
pub use span::{select, Selection, SpanParams};

use std::ops::Range;
use std::sync::Arc;
use target_engine::prelude::*;
use target_engine::{
    budget, Assembly, ChunkKv, KvCache, Model, PrecomputeMode, PrefixKv, Result, SegmentKind,
    SelectInput, Selector, Tokenizer,
};

/// The precompute mode of a chunk computed after `prefix`.
fn after(prefix: &PrefixKv) -> PrecomputeMode {
    PrecomputeMode::AfterPrefix {
        prefix_hash: prefix.hash.clone(),
    }
}

/// The `speccache` (and, without span completion, `speccache_nospan`) selector.
#[derive(Debug, Clone)]
pub struct SpecCache {
    pub speculator: Arc<Model>,
    pub params: SpanParams,
    pub layers: LayerRange,
}

impl SpecCache {
    /// SpecCache with the paper's defaults (τ_smooth 0.4, τ_cover 0.7, spans ≤ 16, last third).
    pub fn new(speculator: Arc<Model>) -> Self {
        Self {
            speculator,
            params: SpanParams::default(),
            layers: LayerRange::LastThird,
        }
    }
}

/// Byte range of every segment of the assembled text.
pub fn segment_bytes(asm: &Assembly) -> Vec<Range<usize>> {
    let mut byte_at: Vec<usize> = asm.text.char_indices().map(|(b, _)| b).collect();
    byte_at.push(asm.text.len());
    asm.segments
        .iter()
        .map(|s| byte_at[s.chars.start]..byte_at[s.chars.end])
        .collect()
}

/// Byte spans of the target tokens of the assembly (token bytes laid end to end per segment).
pub fn target_spans(asm: &Assembly, tok: &Tokenizer) -> Vec<Range<usize>> {
    let mut spans = vec![0..0; asm.ids.len()];
    for (seg, bytes) in asm.segments.iter().zip(segment_bytes(asm)) {
        let mut at = bytes.start;
        for p in seg.ids.clone() {
            let len = tok.token_bytes(asm.ids[p]).len();
            spans[p] = at..(at + len).min(bytes.end);
            at += len;
        }
    }
    spans
}

/// Where a SpecCache selection spent its time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SelectTimings {
    /// Speculator tokenization and forward (zero with ingestion-time scores).
    pub speculate_ms: f64,
    /// Top-K, spans and budget, then target token spans, overlap mapping and the target-side
    /// budget.
    pub align_ms: f64,
}

/// A chunk's speculator scores computed at ingestion, after the template prefix: valid for any
/// prompt in which the chunk directly follows that prefix, an approximation elsewhere (the
/// chunk then misses the documents before it, as its reused KV does).
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkScores {
    /// Fingerprint of the speculator that computed them.
    pub fingerprint: String,
    pub layers: LayerRange,
    /// Byte range of each speculator token within the chunk's segment text.
    pub offsets: Vec<Range<usize>>,
    /// Importance of each token (Eq. 1).
    pub values: Vec<f32>,
}

/// Speculator chunk tokens of an assembly: byte spans in the assembled text, scores, and the
/// chunk each belongs to.
#[derive(Debug, Clone, Default)]
pub struct ScoredTokens {
    pub spans: Vec<Range<usize>>,
    pub scores: Vec<f32>,
    pub chunk: Vec<usize>,
}

/// The speculator's tokenization of an assembled prompt.
struct SpecTokens {
    ids: Vec<u32>,
    /// Byte span of each token in the assembled text.
    spans: Vec<Range<usize>>,
    /// The chunk each token belongs to (`None`: prefix or question).
    chunk_of: Vec<Option<usize>>,
    /// Index of the question's first token.
    question_start: usize,
}

fn invalid(msg: String) -> target_engine::EngineError {
    target_engine::EngineError::InvalidInput(msg)
}

impl SpecCache {
    /// The speculator's KV of the template prefix (the context chunks are scored after at
    /// ingestion). `text` is the prefix text; control tokens in it are parsed.
    pub fn prefix_state(&self, text: &str) -> Result<PrefixKv> {
        let ids = self.speculator.tokenizer().encode(text, true).ids;
        self.speculator.prefix_kv(&ids)
    }

    /// Scores one chunk segment (`text` as it appears in the prompt) after `prefix`.
    pub fn score_chunk(&self, prefix: &PrefixKv, text: &str) -> Result<ChunkScores> {
        Ok(self.score_chunk_with_kv(prefix, text, false)?.0)
    }

    /// [`SpecCache::score_chunk`], and with `keep_kv` the speculator's own KV of the chunk from
    /// the same pass (what `spec_attn` reads at query time: no second forward at ingestion).
    pub fn score_chunk_with_kv(
        &self,
        prefix: &PrefixKv,
        text: &str,
        keep_kv: bool,
    ) -> Result<(ChunkScores, Option<ChunkKv>)> {
        let m = &self.speculator;
        let enc = m.tokenizer().encode(text, false);
        if enc.ids.is_empty() {
            return Err(invalid("cannot score an empty chunk".into()));
        }
        let mut cache = prefix.cache.clone();
        let base = prefix.ids.len();
        let positions: Vec<usize> = (base..base + enc.ids.len()).collect();
        let out = m.forward(&enc.ids, &positions, &mut cache, true)?;
        let values = mean_norms(&out.layers, self.layers, enc.ids.len())?;
        let kv = keep_kv.then(|| m.chunk_rows(&cache, &enc.ids, base, after(prefix)));
        let scores = ChunkScores {
            fingerprint: m.fingerprint().to_string(),
            layers: self.layers,
            offsets: enc.offsets.into_iter().map(|(s, e)| s..e).collect(),
            values,
        };
        Ok((scores, kv))
    }

    /// The speculator's KV of one chunk segment after `prefix` (no scores): for chunks stored
    /// before `spec_attn` needed it.
    pub fn chunk_kv(&self, prefix: &PrefixKv, text: &str) -> Result<ChunkKv> {
        let ids = self.speculator.tokenizer().encode(text, false).ids;
        self.speculator.precompute(&ids, Some(prefix))
    }

    /// The speculator's tokens of `asm`, segment by segment (no token crosses a boundary):
    /// ids, byte spans in the assembled text, and the chunk (or `None`) of each, plus where the
    /// question segment starts.
    fn speculator_tokens(&self, asm: &Assembly) -> SpecTokens {
        let spec_tok = self.speculator.tokenizer();
        let (mut ids, mut spans, mut chunk_of) = (Vec::new(), Vec::new(), Vec::new());
        let mut question_start = None;
        for (seg, bytes) in asm.segments.iter().zip(segment_bytes(asm)) {
            let text = &asm.text[bytes.clone()];
            let special = !matches!(seg.kind, SegmentKind::Chunk(_));
            if seg.kind == SegmentKind::Question && question_start.is_none() {
                question_start = Some(ids.len());
            }
            let enc = spec_tok.encode(text, special);
            for (id, (s, e)) in enc.ids.into_iter().zip(enc.offsets) {
                ids.push(id);
                spans.push(bytes.start + s..bytes.start + e);
                chunk_of.push(match seg.kind {
                    SegmentKind::Chunk(i) => Some(i),
                    _ => None,
                });
            }
        }
        let question_start = question_start.unwrap_or(ids.len());
        SpecTokens {
            ids,
            spans,
            chunk_of,
            question_start,
        }
    }

    /// The chunk tokens of `scores` (one per speculator token) as [`ScoredTokens`].
    fn chunk_scores(
        spans: Vec<Range<usize>>,
        chunk_of: Vec<Option<usize>>,
        scores: &[f32],
    ) -> ScoredTokens {
        let mut out = ScoredTokens::default();
        for ((span, c), &v) in spans.into_iter().zip(chunk_of).zip(scores) {
            if let Some(c) = c {
                out.spans.push(span);
                out.scores.push(v);
                out.chunk.push(c);
            }
        }
        out
    }

    /// Scores every chunk token of `asm` with one speculator pass over the whole prompt, in the
    /// speculator's tokenization segment by segment (no token crosses a boundary).
    pub fn query_scores(&self, asm: &Assembly) -> Result<ScoredTokens> {
        let SpecTokens {
            ids,
            spans,
            chunk_of,
            ..
        } = self.speculator_tokens(asm);
        if ids.is_empty() {
            return Ok(ScoredTokens::default());
        }
        let scores = importance(&self.speculator, &ids, self.layers)?;
        Ok(Self::chunk_scores(spans, chunk_of, &scores))
    }

    /// `spec_attn` scores: the speculator reads everything before the question, then the
    /// question's pass measures its attention mass on every chunk token over the deeper half of
    /// the speculator's layers. Query-aware (the question sees the chunks), unlike the norms.
    pub fn attention_scores(&self, asm: &Assembly) -> Result<ScoredTokens> {
        let toks = self.speculator_tokens(asm);
        let q = toks.question_start;
        if q == 0 || q >= toks.ids.len() {
            return Ok(ScoredTokens::default());
        }
        let m = &self.speculator;
        let mut cache = m.new_cache();
        let before: Vec<usize> = (0..q).collect();
        m.forward(&toks.ids[..q], &before, &mut cache, false)?;
        self.question_attention(toks, &mut cache)
    }

    /// `spec_attn` scores over stored speculator KV: the speculator's cache is the template
    /// prefix's and each chunk's own KV (computed at ingestion, after the prefix) rotated into
    /// place, as the target's fused cache is; only the question runs, and its attention mass
    /// on every chunk token over the deeper half of the layers scores it. A query then costs a
    /// speculator pass over the question alone. `chunks` are in prompt order.
    pub fn attention_scores_stored(
        &self,
        asm: &Assembly,
        prefix: &PrefixKv,
        chunks: &[&ChunkKv],
    ) -> Result<ScoredTokens> {
        let toks = self.speculator_tokens(asm);
        let q = toks.question_start;
        if q == 0 || q >= toks.ids.len() {
            return Ok(ScoredTokens::default());
        }
        let mut cache = self.stored_cache(&toks, prefix, chunks)?;
        self.question_attention(toks, &mut cache)
    }

    /// The speculator as a drafter for speculative decoding: its cache of the whole prompt
    /// (the stored prefix and chunk KV placed as [`SpecCache::attention_scores_stored`] places
    /// them, then the question computed over them) and the logits after its last token.
    pub fn draft_state_stored(
        &self,
        asm: &Assembly,
        prefix: &PrefixKv,
        chunks: &[&ChunkKv],
    ) -> Result<(KvCache, Vec<f32>)> {
        let toks = self.speculator_tokens(asm);
        let q = toks.question_start;
        if q == 0 || q >= toks.ids.len() {
            return Err(invalid("the prompt has no question to draft after".into()));
        }
        let mut cache = self.stored_cache(&toks, prefix, chunks)?;
        let m = &self.speculator;
        let rows: Vec<usize> = (q..toks.ids.len()).collect();
        let out = m.forward(&toks.ids[q..], &rows, &mut cache, false)?;
        let logits = m.last_logits(&out)?;
        Ok((cache, logits))
    }

    /// The speculator's cache of everything before the question: the template prefix's KV
    /// and each chunk's stored KV rotated into place (`chunks` in prompt order).
    fn stored_cache(
        &self,
        toks: &SpecTokens,
        prefix: &PrefixKv,
        chunks: &[&ChunkKv],
    ) -> Result<KvCache> {
        let (ids, chunk_of, q) = (&toks.ids, &toks.chunk_of, toks.question_start);
        let m = &self.speculator;
        let p = prefix.ids.len();
        if ids.get(..p) != Some(&prefix.ids[..]) || chunk_of[..p].iter().any(Option::is_some) {
            return Err(invalid(
                "the speculator's prefix KV does not match the assembled prefix".into(),
            ));
        }
        let mut cache = prefix.cache.clone();
        cache.truncate(p);
        let mut pos = p;
        for (i, kv) in chunks.iter().enumerate() {
            let end = pos + kv.len();
            let fits = end <= q
                && ids[pos..end] == kv.ids[..]
                && chunk_of[pos..end].iter().all(|c| c.is_some());
            if !fits {
                return Err(invalid(format!(
                    "the speculator KV of chunk {i} does not match its place in the prompt"
                )));
            }
            m.place_chunk(&mut cache, kv, pos)?;
            pos = end;
        }
        if pos != q {
            return Err(invalid(format!(
                "{} speculator chunk KVs cover {} of the {} tokens before the question",
                chunks.len(),
                pos - p,
                q - p
            )));
        }
        Ok(cache)
    }

    /// The question's pass (tokens `question_start..`) over `cache`, which holds everything
    /// before it: its attention mass on every earlier token over the deeper half of the
    /// layers scores the chunk tokens.
    fn question_attention(&self, t: SpecTokens, cache: &mut KvCache) -> Result<ScoredTokens> {
        let m = &self.speculator;
        let (ids, q) = (&t.ids, t.question_start);
        let n = m.config().n_layer;
        let question: Vec<usize> = (q..ids.len()).collect();
        let mass = m.forward_probe(&ids[q..], &question, cache, n / 2..n)?;
        let scores: Vec<f32> = (0..ids.len())
            .map(|i| mass.get(i).copied().unwrap_or(0.0))
            .collect();
        Ok(Self::chunk_scores(t.spans, t.chunk_of, &scores))
    }

    /// Lays ingestion-time scores (one per chunk segment, in prompt order) onto `asm`.
    pub fn ingested_scores(&self, asm: &Assembly, scores: &[&ChunkScores]) -> Result<ScoredTokens> {
        let chunks: Vec<(usize, Range<usize>)> = asm
            .segments
            .iter()
            .zip(segment_bytes(asm))
            .filter_map(|(seg, bytes)| match seg.kind {
                SegmentKind::Chunk(i) => Some((i, bytes)),
                _ => None,
            })
            .collect();
        if chunks.len() != scores.len() {
            return Err(invalid(format!(
                "{} chunk score sets for {} chunks",
                scores.len(),
                chunks.len()
            )));
        }
        let mut out = ScoredTokens::default();
        for ((i, bytes), sc) in chunks.into_iter().zip(scores) {
            if sc.fingerprint != self.speculator.fingerprint() || sc.layers != self.layers {
                return Err(invalid(format!(
                    "scores of chunk {i} were computed by another speculator or layer range"
                )));
            }
            if sc.offsets.len() != sc.values.len()
                || sc
                    .offsets
                    .iter()
                    .any(|o| o.end > bytes.len() || o.start > o.end)
            {
                return Err(invalid(format!(
                    "scores of chunk {i} do not fit its text ({} bytes)",
                    bytes.len()
                )));
            }
            for (o, &v) in sc.offsets.iter().zip(&sc.values) {
                out.spans.push(bytes.start + o.start..bytes.start + o.end);
                out.scores.push(v);
                out.chunk.push(i);
            }
        }
        Ok(out)
    }

    /// Top-K, spans and budget over scored speculator tokens, then the mapping onto the
    /// target's chunk tokens under the target budget. Returns assembled-prompt positions.
    /// Tokens of a chunk whose reused KV is exact are never candidates, and the budget is
    /// `ceil(ρ × all chunk tokens)` on both sides.
    pub fn select_scored(&self, input: &SelectInput, toks: &ScoredTokens) -> Vec<usize> {
        let asm = input.assembly;
        let target_budget = input.spend();
        let exact_chunk = input
            .skips_exact()
            .then(|| {
                asm.segments.iter().find_map(|s| match s.kind {
                    SegmentKind::Chunk(i) => Some(i),
                    _ => None,
                })
            })
            .flatten();
        let keep: Vec<usize> = (0..toks.scores.len())
            .filter(|&j| Some(toks.chunk[j]) != exact_chunk)
            .collect();
        if keep.is_empty() || target_budget == 0 {
            return Vec::new();
        }
        let scores: Vec<f32> = keep.iter().map(|&j| toks.scores[j]).collect();
        let chunk_of: Vec<usize> = keep.iter().map(|&j| toks.chunk[j]).collect();
        let spans: Vec<Range<usize>> = keep.iter().map(|&j| toks.spans[j].clone()).collect();
        let spec_budget = budget(input.ratio, toks.scores.len()).min(keep.len());
        let sel = select(&scores, &chunk_of, spec_budget, &self.params);
        let target = target_spans(asm, input.model.tokenizer());
        let candidates = input.candidates();
        let cand_spans: Vec<Range<usize>> = candidates.iter().map(|&p| target[p].clone()).collect();
        // Selection units: each completed span whole, each other selected token alone; a unit
        // scores as its best token. Units are mapped onto target tokens and taken best first
        // while they fit, so a span is kept or dropped whole, never stripped of its fill-ins.
        let mut in_span = vec![false; scores.len()];
        let mut units: Vec<(f32, Vec<usize>)> = sel
            .completed
            .iter()
            .map(|&(a, b)| {
                (a..b).for_each(|j| in_span[j] = true);
                let best = scores[a..b]
                    .iter()
                    .copied()
                    .fold(f32::NEG_INFINITY, f32::max);
                (best, (a..b).collect())
            })
            .collect();
        units.extend(
            sel.tokens
                .iter()
                .filter(|&&j| !in_span[j])
                .map(|&j| (scores[j], vec![j])),
        );
        units.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1[0].cmp(&b.1[0])));
        let mut chosen = vec![false; candidates.len()];
        let mut n = 0;
        for (_, members) in units {
            let sel_spans: Vec<Range<usize>> = members.iter().map(|&j| spans[j].clone()).collect();
            let new: Vec<usize> = align(&sel_spans, &spans, &cand_spans)
                .into_iter()
                .filter(|&k| !chosen[k])
                .collect();
            if n + new.len() <= target_budget {
                n += new.len();
                new.into_iter().for_each(|k| chosen[k] = true);
            }
        }
        (0..candidates.len())
            .filter(|&k| chosen[k])
            .map(|k| candidates[k])
            .collect()
    }

    /// `select`, also reporting where the time went.
    pub fn select_timed(&self, input: &SelectInput) -> Result<(Vec<usize>, SelectTimings)> {
        if input.spend() == 0 {
            return Ok((Vec::new(), SelectTimings::default()));
        }
        let t0 = std::time::Instant::now();
        let toks = self.query_scores(input.assembly)?;
        let speculate_ms = t0.elapsed().as_secs_f64() * 1e3;
        let t1 = std::time::Instant::now();
        let picked = self.select_scored(input, &toks);
        Ok((
            picked,
            SelectTimings {
                speculate_ms,
                align_ms: t1.elapsed().as_secs_f64() * 1e3,
            },
        ))
    }

    /// Selection from ingestion-time scores (no speculator pass at query time).
    pub fn select_ingested(
        &self,
        input: &SelectInput,
        scores: &[&ChunkScores],
    ) -> Result<(Vec<usize>, SelectTimings)> {
        let t0 = std::time::Instant::now();
        let toks = self.ingested_scores(input.assembly, scores)?;
        let picked = self.select_scored(input, &toks);
        Ok((
            picked,
            SelectTimings {
                speculate_ms: 0.0,
                align_ms: t0.elapsed().as_secs_f64() * 1e3,
            },
        ))
    }
}

impl Selector for SpecCache {
    fn select(&self, input: &SelectInput) -> Result<Vec<usize>> {
        Ok(self.select_timed(input)?.0)
    }
}

/// SpecCache over scores computed beforehand (a query-time pass run beside the KV load, or
/// the scores stored at ingestion laid onto the prompt): the selector a request uses.
#[derive(Debug, Clone)]
pub struct ScoredSpecCache<'a> {
    pub spec: &'a SpecCache,
    pub scores: ScoredTokens,
}

impl Selector for ScoredSpecCache<'_> {
    fn select(&self, input: &SelectInput) -> Result<Vec<usize>> {
        Ok(self.spec.select_scored(input, &self.scores))
    }
}

/// SpecCache over scores stored at ingestion, one set per chunk of the prompt in order.
#[derive(Debug, Clone)]
pub struct IngestedSpecCache<'a> {
    pub spec: &'a SpecCache,
    pub scores: Vec<&'a ChunkScores>,
}

impl Selector for IngestedSpecCache<'_> {
    fn select(&self, input: &SelectInput) -> Result<Vec<usize>> {
        Ok(self.spec.select_ingested(input, &self.scores)?.0)
    }
}
