//! Generation from a prefilled cache, plain or speculative: how a query samples and stops,
//! the drafter its request asks for (prompt lookup, the speculator or both), long-context
//! drafting, and why an answer ended. Decoding and the fidelity guard's driving code use it.

use super::backend::Backend;
use super::request::{Piece, Query};
use super::Pipeline;
use crate::error::{GatewayError, Result};
use target_engine::prelude::*;
use target_engine::{
    Assembly, ChunkKv, Drafter, FinishReason, GenerateParams, Generation, KvCache, Pick,
    SamplingParams, SpecDecodeStats as SpecStats, TextStream, TokenLogprobs,
};

/// How `q` samples and stops.
pub(crate) fn generate_params(q: &Query) -> GenerateParams {
    GenerateParams {
        max_tokens: q.max_tokens,
        sampling: SamplingParams {
            temperature: q.temperature,
            top_p: q.top_p,
            seed: q.seed,
        },
        stop: q.stop.clone(),
        logprobs: q.logprobs,
    }
}

/// The logprobs of an answer's first `n` tokens (an answer a stop string cut keeps the
/// logprobs of the tokens it kept).
pub(crate) fn logprobs_of(mut all: Vec<TokenLogprobs>, n: usize) -> Vec<TokenLogprobs> {
    all.truncate(n);
    all
}

/// Where a decode starts: the prefilled cache, its last logits, and the drafter (if any)
/// that proposes tokens.
pub(crate) struct Decoding<'a, 'd, C> {
    pub(crate) cache: &'a mut C,
    pub(crate) logits: Vec<f32>,
    pub(crate) drafter: Option<&'a mut Drafter<'d>>,
}

/// Why an answer that went through a [`TextStream`] ended.
pub(crate) fn finish_reason(stream: &TextStream<'_>, cancelled: bool, eos: bool) -> FinishReason {
    if stream.stopped() {
        FinishReason::Stop
    } else if cancelled {
        FinishReason::Cancelled
    } else if eos {
        FinishReason::Eos
    } else {
        FinishReason::Length
    }
}

impl Pipeline {
    /// Whether `q`'s answer over a prompt of `prompt_tokens` drafts from the long-context
    /// view: greedy, not `verify` (which drafts from the blended cache against the full
    /// one), and the request's `long_context`, else the server's above its `min_tokens`.
    pub(super) fn long_context_for(&self, q: &Query, prompt_tokens: usize) -> bool {
        // The view is the CPU engine's (`backend::refused` names it for a device target).
        self.engines.target.cpu().is_some()
            && q.temperature == 0.0
            && !q.verify
            && q.long_context
                .unwrap_or(self.long_context.on && prompt_tokens >= self.long_context.min_tokens)
    }

    /// Greedy or sampled decoding from `from.cache` and its last `from.logits`, with
    /// `from.drafter` (if any) proposing tokens; `watch` is asked after every token (see
    /// [`Generate::decode_watched`]).
    pub(crate) fn decode_from<E: Backend>(
        &self,
        target: &E,
        q: &Query,
        from: Decoding<'_, '_, E::Cache>,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
        watch: &mut dyn FnMut(&[u32], Pick) -> bool,
    ) -> Result<(Generation, bool, SpecStats)> {
        let Decoding {
            cache,
            logits,
            drafter,
        } = from;
        let params = generate_params(q);
        let mut on_text = |t: &str| on_piece(Piece::Token(t));
        // Long-context and speculative drafting run on the CPU engine (a device target has no
        // drafter: `Pipeline::drafter`).
        let cpu = target.cpu().zip(crate::target::host_cache_mut(&mut *cache));
        let Some((target, cache)) = cpu else {
            let (g, e) = target.decode_watched(cache, logits, &params, &mut on_text, watch)?;
            return Ok((g, e, SpecStats::default()));
        };
        if self.long_context_for(q, cache.len()) {
            let mut view = target_engine::TopKView::new(self.long_context.view);
            let length = target_engine::ViewParams::default().length;
            let draft = target_engine::ViewDraft {
                params: &params,
                length,
                min_prob: 0.0,
            };
            return Ok(target.decode_view(
                target_engine::Prefilled { cache, logits },
                &mut view,
                draft,
                &mut on_text,
                watch,
            )?);
        }
        Ok(match drafter {
            Some(d) => {
                let from = target_engine::Prefilled { cache, logits };
                target.decode_speculative(from, d, &params, &mut on_text, watch)?
            }
            None => {
                let (g, e) = target.decode_watched(cache, logits, &params, &mut on_text, watch)?;
                (g, e, SpecStats::default())
            }
        })
    }

    /// The drafter for `q`, when speculative decoding is on for it (the request's
    /// `spec_decode`, else the server's), greedy or sampled: prompt lookup over the
    /// prompt's tokens and/or the speculator (when it shares the target's vocabulary), as
    /// `spec_draft` says. The speculator's cache (its stored KV of the chunks `texts`, stored
    /// now where missing, and a pass over the question) is built once it is first asked to
    /// draft, after the first token.
    pub(super) fn drafter<'a>(
        &'a self,
        q: &'a Query,
        asm: &'a Assembly,
        texts: &'a [&'a str],
    ) -> Option<Drafter<'a>> {
        if !q.spec_decode.unwrap_or(self.spec_decode) || self.engines.target.cpu().is_none() {
            return None;
        }
        let source = q.spec_draft.unwrap_or(self.spec_draft);
        let model = if source.uses_model() {
            self.model_drafter(q, asm, texts)
        } else {
            None
        };
        let lookup = source
            .uses_lookup()
            .then(|| target_engine::PromptLookup::new(asm.ids.clone()));
        match (model, lookup) {
            (Some(d), Some(l)) => Some(d.with_lookup(l)),
            (Some(d), None) => Some(d),
            (None, Some(l)) => Some(Drafter::lookup_only(l)),
            (None, None) => None,
        }
    }

    /// The speculator as a drafter over its stored chunk KV, when one of the target's
    /// vocabulary is loaded.
    fn model_drafter<'a>(
        &'a self,
        q: &'a Query,
        asm: &'a Assembly,
        texts: &'a [&'a str],
    ) -> Option<Drafter<'a>> {
        let spec = self.engines.spec.as_ref()?;
        let prefix = self.engines.spec_prefix.as_ref()?;
        if !self.engines.drafts {
            return None;
        }
        let build = move || -> target_engine::Result<(KvCache, Vec<f32>)> {
            let internal = |e: GatewayError| target_engine::EngineError::Caller(Box::new(e));
            let mut kvs = Vec::with_capacity(texts.len());
            for text in texts {
                let (kv, _) = self
                    .engines
                    .load_spec_kv(&self.corpus.store, &q.collection, text)
                    .map_err(internal)?
                    .ok_or_else(|| internal(GatewayError::Internal("no speculator".into())))?;
                kvs.push(kv);
            }
            let refs: Vec<&ChunkKv> = kvs.iter().collect();
            spec.draft_state_stored(asm, prefix, &refs)
                .map_err(|e| target_engine::EngineError::Caller(Box::new(e)))
        };
        Some(Drafter::deferred(&spec.speculator, Box::new(build)))
    }
}
