//! A query's one road: checked, retrieved and assembled, admitted, then its chunk KV loaded
//! and blended (`blend.rs`) and its answer decoded (`decode.rs`).

use super::backend::Backend;
use super::decode::{DecodeInput, Decoded, FullPrefill};
use super::experiment::{Experiment, Outcome, Run, Served, Traced};
use super::request::{Piece, Query};
use super::retrieve::too_long;
use super::{ms, Pipeline};
use crate::answer::{Answer, ChunkRef, Reuse, Timings, TokenLogprob};
use crate::corpus::Tier;
use crate::error::{GatewayError, Result};
use crate::fidelity::Fidelity;
use crate::target::Target;
use std::time::Instant;
use target_engine::Assembly;

impl Pipeline {
    /// Checks what the loaded models decide about a query: the one place a query is checked
    /// beyond its fields. The engine's queue takes only queries it passed
    /// ([`EngineHandle::submit`](crate::engine::EngineHandle::submit) runs it), and
    /// [`Pipeline::query`] and [`Pipeline::query_with`] run it for callers that do not queue.
    pub fn check(&self, q: &Query) -> Result<()> {
        // What the target's engine cannot run is refused, never run on another engine.
        if let Some(refused) = super::backend::refused(&self.engines.target, q) {
            return Err(refused);
        }
        // A query that would retrieve from a collection holding nothing (a name mistyped, or
        // not ingested yet) is refused, not answered from no context at all. With passages of
        // its own the collection only scopes their stored KV, and may be new.
        if q.documents.is_empty() && !self.corpus.index.has_collection(&q.collection)? {
            return Err(GatewayError::NotFound(format!(
                "no collection `{}`: nothing is ingested into it (specrag ingest --collection {0}, \
                 or POST /documents), and the request sends no passages of its own",
                q.collection
            )));
        }
        if q.method.uses_speculator() && self.engines.spec.is_none() {
            return Err(GatewayError::bad(
                "method",
                format!(
                    "`{}` needs a speculator model and none is loaded",
                    q.method.name()
                ),
            ));
        }
        if let Some(m) = q.max_context_tokens {
            if m > self.max_context_tokens {
                return Err(GatewayError::bad(
                    "max_context_tokens",
                    format!(
                        "{m} is above this server's limit of {} tokens (--max-context-tokens)",
                        self.max_context_tokens
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The KV `q` will hold at once with a prompt of `prompt` tokens: the reused cache and
    /// the chunk KV it is built from (one cache for full recompute), a full cache beside them
    /// where the guard may escalate or the answer is verified, the drafter's cache when
    /// speculative decoding runs.
    pub fn kv_need(&self, q: &Query, prompt: usize) -> crate::admission::Need {
        let full_too = !q.method.is_full() && q.runs_at() != Fidelity::Fast;
        let caches = if q.method.is_full() { 1 } else { 2 } + u64::from(full_too);
        let drafter = match &self.engines.spec {
            Some(spec) if q.spec_decode.unwrap_or(self.spec_decode) => {
                crate::admission::cpu_kv_bytes_per_token(
                    spec.speculator.config(),
                    spec.speculator.attention(),
                )
            }
            _ => 0,
        };
        crate::admission::Need {
            tokens: (prompt + q.max_tokens) as u64,
            caches,
            target_per_token: self.engines.target.kv_bytes_per_token(),
            drafter_per_token: drafter,
        }
    }

    /// Answers `q`, streaming pieces to `on_piece` (return `false` to cancel).
    pub fn query(&self, q: &Query, on_piece: &mut dyn FnMut(Piece<'_>) -> bool) -> Result<Answer> {
        self.check(q)?;
        self.road(q, &Served, on_piece)
    }

    /// [`Pipeline::query`] for a query [`Pipeline::check`] passed already (the engine's: its
    /// queue takes no other).
    pub(crate) fn query_checked(
        &self,
        q: &Query,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<Answer> {
        self.road(q, &Served, on_piece)
    }

    /// [`Pipeline::query`] under an evaluation's experiment, also returning what the
    /// evaluation compares (the first token's logits, the recomputed tokens, ...).
    pub fn query_with(
        &self,
        q: &Query,
        exp: &dyn Experiment,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<Traced> {
        self.check(q)?;
        if self.engines.target.cpu().is_none() {
            return Err(GatewayError::bad(
                "device",
                format!(
                    "an evaluation's experiment runs on the CPU engine only; the target runs on {}",
                    self.engines.target.device()
                ),
            ));
        }
        self.road(q, exp, on_piece)
    }

    /// The road on the target's engine: [`Pipeline::road_on`] with the CPU engine or the
    /// device's, chosen once here.
    fn road<O: Outcome>(
        &self,
        q: &Query,
        exp: &dyn Experiment,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<O> {
        match &self.engines.target {
            Target::Cpu(m) => self.road_on(&**m, q, exp, on_piece),
            Target::Device(d) => self.road_on(&**d, q, exp, on_piece),
        }
    }

    /// Retrieval and assembly, the prompt held to the context limit and the request's KV to
    /// the memory budget, then the steps on `target`: the full prefill a verified request
    /// checks against started beside the rest, and [`Pipeline::answer`].
    fn road_on<E: Backend, O: Outcome>(
        &self,
        target: &E,
        q: &Query,
        exp: &dyn Experiment,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<O> {
        let t0 = Instant::now();
        let mut timings = Timings::default();
        let (hits, retrieved) = self.hits(q, exp.order().unwrap_or(self.chunk_order))?;
        timings.retrieve_ms = ms(t0);
        let texts: Vec<&str> = hits.iter().map(|h| h.record.text.as_str()).collect();
        let asm = self.engines.template.assemble_with_context(
            self.engines.target.tokenizer(),
            &texts,
            &q.context,
            &q.query,
        );
        let context = q
            .max_context_tokens
            .unwrap_or(self.max_context_tokens)
            .min(self.max_context_tokens);
        if asm.ids.len() + q.max_tokens > context {
            return Err(too_long(q, asm.ids.len(), hits.len(), retrieved, context));
        }
        let _kv = self
            .kv_held
            .reserve(&self.kv_need(q, asm.ids.len()), self.kv_memory_budget)?;
        let prompt = Prompt {
            hits,
            asm: &asm,
            t0,
            timings,
        };
        self.with_full_prefill(target, q, &asm, |full| {
            self.answer(target, Run { query: q, exp }, prompt, on_piece, full)
        })
    }

    /// Everything after retrieval and assembly: KV load beside the speculator's pass, the
    /// method's selector and blended prefill, then decoding (or verification).
    fn answer<E: Backend, O: Outcome>(
        &self,
        target: &E,
        run: Run<'_>,
        prompt: Prompt<'_>,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
        full_prefill: Option<FullPrefill<E::Cache>>,
    ) -> Result<O> {
        let Run { query: q, exp } = run;
        let Prompt {
            hits,
            asm,
            t0,
            mut timings,
        } = prompt;
        let texts: Vec<&str> = hits.iter().map(|h| h.record.text.as_str()).collect();
        let (loaded, scored) = self.load_and_score(run, &texts, asm, &mut timings)?;
        let mut reuse = reuse_of(&loaded);
        let super::blend::Blended {
            out,
            exact_rows,
            experiment_ms,
        } = self.blend(
            target,
            run,
            asm,
            super::blend::KvLoaded {
                loaded: &loaded,
                scored,
            },
            &mut timings,
        )?;
        timings.ttft_ms = ms(t0) - experiment_ms;
        reuse.chunk_tokens = out.chunk_tokens;
        reuse.recomputed_tokens = out.recomputed.len();
        reuse.ratio = out.ratio();
        let kept = O::keep(self, exp, asm, &out);
        let td = Instant::now();
        let input = DecodeInput {
            out,
            exact_rows,
            look: exp.look().unwrap_or(self.guard.look),
            full_prefill,
            asm,
            texts: &texts,
        };
        let Decoded {
            mut g,
            verify,
            guard,
            spec,
            long,
        } = self.decode(target, q, input, &mut timings, on_piece)?;
        reuse.guard = guard;
        timings.decode_ms = ms(td);
        timings.total_ms = ms(t0) - experiment_ms;
        let answer = Answer {
            answer: std::mem::take(&mut g.text),
            method: q.method,
            finish_reason: g.finish,
            tokens: g.ids.len(),
            prompt_tokens: asm.ids.len(),
            chunks: hits
                .into_iter()
                .map(|h| ChunkRef {
                    id: h.record.chunk_id,
                    doc_id: h.record.doc_id,
                    title: h.record.title,
                    score: h.score,
                    position: h.record.position,
                    tokens: h.record.tokens,
                    text: h.record.text,
                })
                .collect(),
            timings,
            reuse,
            verify,
            spec_decode: spec,
            long_context: long,
            logprobs: q.logprobs.map(|_| {
                let tok = self.engines.target.tokenizer();
                g.logprobs
                    .iter()
                    .map(|t| TokenLogprob::of(tok, t))
                    .collect()
            }),
        };
        Ok(O::finish(kept, answer, g))
    }
}

/// Where the chunks' KV came from, counted per tier.
fn reuse_of(loaded: &[crate::corpus::LoadedChunk]) -> Reuse {
    let mut reuse = Reuse::default();
    for l in loaded {
        match l.tier {
            Tier::Memory => reuse.chunks_from_memory += 1,
            Tier::Disk => reuse.chunks_from_disk += 1,
            Tier::Remote => reuse.chunks_from_remote += 1,
            Tier::Recomputed => reuse.chunks_recomputed += 1,
        }
    }
    reuse
}

/// What retrieval and assembly hand to the steps after them: the chunks read, the prompt,
/// when the request started and the timings so far.
struct Prompt<'a> {
    hits: Vec<retriever::Hit>,
    asm: &'a Assembly,
    t0: Instant,
    timings: Timings,
}
