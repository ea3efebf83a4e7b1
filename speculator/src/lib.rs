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

pub use align::align;
pub use importance::{importance, LayerRange};
pub use span::{select, Selection, SpanParams};

use std::ops::Range;
use std::sync::Arc;
use target_engine::{
    budget, Assembly, Model, Result, SegmentKind, SelectInput, Selector, Tokenizer,
};

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
    /// Speculator tokenization, forward and span selection.
    pub speculate_ms: f64,
    /// Target token spans, overlap mapping and the target-side budget.
    pub align_ms: f64,
}

impl SpecCache {
    /// `select`, also reporting where the time went.
    pub fn select_timed(&self, input: &SelectInput) -> Result<(Vec<usize>, SelectTimings)> {
        let t0 = std::time::Instant::now();
        let asm = input.assembly;
        let spec_tok = self.speculator.tokenizer();
        // The speculator's tokenization, segment by segment, so no token crosses a boundary.
        let mut ids = Vec::new();
        let mut spans = Vec::new();
        let mut chunk_of = Vec::new();
        for (seg, bytes) in asm.segments.iter().zip(segment_bytes(asm)) {
            let text = &asm.text[bytes.clone()];
            let special = !matches!(seg.kind, SegmentKind::Chunk(_));
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
        let target = target_spans(asm, input.model.tokenizer());
        let chunk_pos = asm.chunk_positions();
        let target_budget = budget(input.ratio, chunk_pos.len());
        if ids.is_empty() || target_budget == 0 {
            return Ok((Vec::new(), SelectTimings::default()));
        }
        let scores = importance(&self.speculator, &ids, self.layers)?;
        let chunk_tokens: Vec<usize> = (0..ids.len()).filter(|&i| chunk_of[i].is_some()).collect();
        let chunk_scores: Vec<f32> = chunk_tokens.iter().map(|&i| scores[i]).collect();
        let segment: Vec<usize> = chunk_tokens
            .iter()
            .map(|&i| chunk_of[i].unwrap_or(0))
            .collect();
        let spec_budget = budget(input.ratio, chunk_tokens.len());
        let sel = select(&chunk_scores, &segment, spec_budget, &self.params);
        let speculate_ms = t0.elapsed().as_secs_f64() * 1e3;
        let t1 = std::time::Instant::now();
        let selected: Vec<Range<usize>> = sel
            .tokens
            .iter()
            .map(|&j| spans[chunk_tokens[j]].clone())
            .collect();
        // Only chunk tokens of the target are candidates.
        let chunk_spans: Vec<Range<usize>> = chunk_pos.iter().map(|&p| target[p].clone()).collect();
        let spec_chunk_spans: Vec<Range<usize>> =
            chunk_tokens.iter().map(|&i| spans[i].clone()).collect();
        let mut mapped: Vec<usize> = align(&selected, &spec_chunk_spans, &chunk_spans)
            .into_iter()
            .map(|k| chunk_pos[k])
            .collect();
        if mapped.len() > target_budget {
            // Token boundaries differ, so the mapped set can exceed the budget: keep the target
            // tokens whose best overlapping speculator token scores highest.
            let score_of = |p: usize| {
                let t = &target[p];
                sel.tokens
                    .iter()
                    .map(|&j| (&spans[chunk_tokens[j]], chunk_scores[j]))
                    .filter(|(s, _)| s.start < t.end && t.start < s.end)
                    .map(|(_, v)| v)
                    .fold(f32::NEG_INFINITY, f32::max)
            };
            mapped.sort_by(|&a, &b| score_of(b).total_cmp(&score_of(a)).then(a.cmp(&b)));
            mapped.truncate(target_budget);
            mapped.sort_unstable();
        }
        let align_ms = t1.elapsed().as_secs_f64() * 1e3;
        Ok((
            mapped,
            SelectTimings {
                speculate_ms,
                align_ms,
            },
        ))
    }
}

impl Selector for SpecCache {
    fn name(&self) -> &'static str {
        if self.params.complete_spans {
            "speccache"
        } else {
            "speccache_nospan"
        }
    }

    fn select(&self, input: &SelectInput) -> Result<Vec<usize>> {
        Ok(self.select_timed(input)?.0)
    }
}
