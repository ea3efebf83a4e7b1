//! Steps 1 and 2: each chunk's KV (memory, disk or recomputed) loaded beside the
//! speculator's pass over the prompt, then the method's selector and the blended prefill.

use super::backend::Backend;
use super::experiment::Run;
use super::request::{Query, ScoreSource};
use super::{ms, Pipeline};
use crate::answer::Timings;
use crate::corpus::LoadedChunk;
use crate::error::{GatewayError, Result};
use crate::method::{Method, SelectorInputs, SpecScores};
use speculator::{ChunkScores, LayerRange, ScoredTokens};
use std::time::Instant;
use target_engine::{Assembly, BlendOutput, ChunkKv, Engine, SelectInput};

/// The leading rows of a blended prefill's cache that a full prefill computes alike (cache
/// rows are f16, as stored KV is): the template prefix and the first chunk, where that chunk
/// was precomputed after the same prefix at its place and the blend left every row of it as
/// stored (none recomputed or moved; [`SelectInput::skips_exact`]). 0 otherwise: an
/// escalation then computes every row.
pub(super) fn exact_rows<E: Engine>(input: &SelectInput<'_, E>, recomputed: &[usize]) -> usize {
    match input.assembly.chunks().next() {
        Some(first) if input.skips_exact() && !recomputed.iter().any(|p| first.ids.contains(p)) => {
            first.ids.end
        }
        _ => 0,
    }
}

/// What step 2 hands on: the blend's output, how many of its leading rows a full prefill
/// computes alike ([`exact_rows`]), and the time the experiment's hooks took (off the
/// query's clock).
pub(super) struct Blended<C> {
    pub(super) out: BlendOutput<C>,
    pub(super) exact_rows: usize,
    pub(super) experiment_ms: f64,
}

/// What step 1 hands to step 2: each chunk's KV, and the speculator's scores where the
/// method asked for a query-time pass.
pub(super) struct KvLoaded<'a> {
    pub(super) loaded: &'a [LoadedChunk],
    pub(super) scored: Option<ScoredTokens>,
}

impl Pipeline {
    /// True when `q` decodes from a full prefill and reads no chunk KV (full recompute, or
    /// sampling with verification: exact samples come from the full cache).
    fn reads_no_kv(q: &Query) -> bool {
        q.method.is_full() || (q.verify && q.temperature > 0.0)
    }

    /// Step 1: each chunk's KV (memory, disk or recompute) and, side by side, the speculator's
    /// query-time pass when the method needs one. Records `kv_load_ms` and `speculate_ms`.
    pub(super) fn load_and_score(
        &self,
        run: Run<'_>,
        texts: &[&str],
        asm: &Assembly,
        timings: &mut Timings,
    ) -> Result<(Vec<LoadedChunk>, Option<ScoredTokens>)> {
        let Run { query: q, exp } = run;
        let need_kv = !Self::reads_no_kv(q);
        let score_source = exp.score_source().unwrap_or(self.score_source);
        let layers = exp.layers();
        // spec_attn's scores depend on the question: never stored, always a query-time pass
        // (over the stored speculator chunk KV, or for spec_attn_full over the whole prompt).
        let scores = q.method.spec_scores();
        let query_time_scores = need_kv
            && match scores {
                Some(SpecScores::Norms) => score_source == ScoreSource::Query,
                Some(_) => true,
                None => false,
            };
        let (loaded, scored) = std::thread::scope(|s| {
            let spec = query_time_scores.then(|| {
                let stop = target_engine::stop::current();
                s.spawn(move || -> Result<(ScoredTokens, f64)> {
                    target_engine::stop::with_stop(stop, || {
                        let t = Instant::now();
                        let spec = self.speculator(layers)?;
                        let toks = match scores {
                            Some(SpecScores::StoredAttention) => {
                                self.stored_attention(&spec, q, texts, asm)?
                            }
                            Some(SpecScores::PromptAttention) => spec.attention_scores(asm)?,
                            _ => spec.query_scores(asm)?,
                        };
                        Ok((toks, ms(t)))
                    })
                })
            });
            let t = Instant::now();
            let loaded: Result<Vec<LoadedChunk>> = if need_kv {
                // Each chunk's segment as the prompt holds it: tokenized once, by assembly.
                asm.chunks()
                    .map(|seg| {
                        let (text, ids) = asm.segment(seg);
                        let store = &self.corpus.store;
                        self.engines.load_segment(store, &q.collection, &text, ids)
                    })
                    .collect()
            } else {
                Ok(Vec::new())
            };
            let load_ms = ms(t);
            let scored = spec.map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(GatewayError::Internal("the speculator panicked".into()))
                })
            });
            (loaded.map(|l| (l, load_ms)), scored.transpose())
        });
        let (loaded, load_ms) = loaded?;
        timings.kv_load_ms = load_ms;
        let scored = scored?.map(|(toks, spec_ms)| {
            timings.speculate_ms = spec_ms;
            toks
        });
        Ok((loaded, scored))
    }

    /// Step 2 on `target`: the method's selector over the loaded KV, and its blended prefill
    /// (or the full prefill). Records `align_ms` (selection) and `prefill_ms`.
    pub(super) fn blend<E: Backend>(
        &self,
        target: &E,
        run: Run<'_>,
        asm: &Assembly,
        kv: KvLoaded<'_>,
        timings: &mut Timings,
    ) -> Result<Blended<E::Cache>> {
        let Run { query: q, exp } = run;
        let KvLoaded { loaded, mut scored } = kv;
        let method = if Self::reads_no_kv(q) {
            Method::FullRecompute
        } else {
            q.method
        };
        let spec = if method.uses_speculator() {
            let mut spec = self.speculator(exp.layers())?;
            spec.params.complete_spans = method.completes_spans();
            if scored.is_none() {
                scored = Some(self.ingest_scores(&spec, asm, loaded, timings)?);
            }
            Some(spec)
        } else {
            None
        };
        let inputs = SelectorInputs {
            spec: spec.as_ref(),
            scores: scored,
            epic_k: exp.epic_k(),
        };
        let selector = target.selector(q, exp, method, inputs)?;
        let kvs: Vec<&ChunkKv> = loaded.iter().map(|l| &l.kv).collect();
        let mut input = SelectInput::new(target, asm, &self.engines.prefix, &kvs, q.ratio);
        // Room for the answer in the fused cache: a device cache is sized once where it can.
        input.room = q.max_tokens;
        if self.engines.lossy_codec.is_some() {
            // Stored lossily, even the chunk precomputed after this very prefix is not exact:
            // it competes for the budget like the others.
            input.first_chunk_exact = false;
        }
        let before_ms = Instant::now();
        let before = E::before_blend(exp, &input)?;
        let mut experiment_ms = ms(before_ms);
        let t = Instant::now();
        let mut out = selector.prefill(&input)?;
        timings.align_ms = out.select_ms;
        timings.prefill_ms = ms(t) - out.select_ms;
        let after_ms = Instant::now();
        E::after_blend(exp, before, &mut out);
        experiment_ms += ms(after_ms);
        let exact_rows = exact_rows(&input, &out.recomputed);
        Ok(Blended {
            out,
            exact_rows,
            experiment_ms,
        })
    }

    /// The SpecCache selector (over `layers`, where the experiment sets them).
    fn speculator(&self, layers: Option<LayerRange>) -> Result<speculator::SpecCache> {
        let mut spec = self
            .engines
            .spec
            .clone()
            .ok_or_else(|| GatewayError::bad("method", "no speculator model is loaded"))?;
        if let Some(layers) = layers {
            spec.layers = layers;
        }
        Ok(spec)
    }

    /// `spec_attn`'s scores: the speculator's stored KV of every chunk (computed and stored
    /// now where missing), then its question pass over them.
    fn stored_attention(
        &self,
        spec: &speculator::SpecCache,
        q: &Query,
        texts: &[&str],
        asm: &Assembly,
    ) -> Result<ScoredTokens> {
        let prefix = self
            .engines
            .spec_prefix
            .as_ref()
            .ok_or_else(|| GatewayError::bad("method", "no speculator model is loaded"))?;
        let mut kvs = Vec::with_capacity(texts.len());
        for text in texts {
            let (kv, _) = self
                .engines
                .load_spec_kv(&self.corpus.store, &q.collection, text)?
                .ok_or_else(|| GatewayError::bad("method", "no speculator model is loaded"))?;
            kvs.push(kv);
        }
        let refs: Vec<&ChunkKv> = kvs.iter().collect();
        Ok(spec.attention_scores_stored(asm, prefix, &refs)?)
    }

    /// SpecCache scores from ingestion; chunks stored without scores (or by another
    /// speculator) are scored now with a query-time pass instead.
    fn ingest_scores(
        &self,
        sel: &speculator::SpecCache,
        asm: &Assembly,
        loaded: &[LoadedChunk],
        timings: &mut Timings,
    ) -> Result<ScoredTokens> {
        let stored: Option<Vec<&ChunkScores>> = loaded
            .iter()
            .map(|l| l.scores.as_ref().filter(|s| s.layers == sel.layers))
            .collect();
        match stored {
            Some(s) => Ok(sel.ingested_scores(asm, &s)?),
            None => {
                let t = Instant::now();
                let toks = sel.query_scores(asm)?;
                timings.speculate_ms = ms(t);
                Ok(toks)
            }
        }
    }
}
