//! Step 3, decoding: from the blended cache under the fidelity guard
//! (`crate::fidelity::drive`), or drafted from it and verified against the full prefill of
//! the same prompt, which runs beside the earlier steps.

use super::backend::{Backend, On};
use super::context_cache::ContextCache;
use super::generate::finish_reason;
use super::request::{Piece, Query};
use super::{ms, Pipeline};
use crate::answer::{Timings, VerifyStats};
use crate::error::Result;
use crate::fidelity::drive::Reused;
use crate::fidelity::{GuardReport, LookRows};
use std::sync::Arc;
use std::time::Instant;
use target_engine::{
    Assembly, BlendOutput, FilledCache, Flow, Shown, SpecDecodeStats as SpecStats, TextStream,
    VerifyEvent, VerifyMode, VerifyParams,
};

/// The full prefill of a verified request, running since the request started.
pub(super) struct FullPrefill<C> {
    rx: std::sync::mpsc::Receiver<target_engine::Result<FilledCache<C>>>,
    hit: bool,
    ms: Arc<std::sync::Mutex<f64>>,
}

/// What decoding starts from: the prefill's output, the verification's full prefill when the
/// request verifies, and the assembled prompt (for an escalation's full prefill) with its
/// chunks' texts (for a drafter's stored KV).
pub(super) struct DecodeInput<'a, C> {
    pub(super) out: BlendOutput<C>,
    /// Leading rows of `out.cache` a full prefill computes alike
    /// ([`exact_rows`](super::blend::exact_rows)).
    pub(super) exact_rows: usize,
    /// Which chunk tokens a second look recomputes.
    pub(super) look: LookRows,
    pub(super) full_prefill: Option<FullPrefill<C>>,
    pub(super) asm: &'a Assembly,
    pub(super) texts: &'a [&'a str],
}

/// What decoding produced besides the answer's tokens.
pub(super) struct Decoded {
    pub(super) g: target_engine::Generation,
    pub(super) verify: Option<VerifyStats>,
    pub(super) guard: GuardReport,
    pub(super) spec: Option<crate::answer::SpecDecodeReport>,
    /// Long-context drafting's rounds, when it drafted this answer.
    pub(super) long: Option<crate::answer::SpecDecodeReport>,
}

impl Pipeline {
    /// Step 3: decoding from the prefill's cache under the fidelity guard, or drafting and
    /// verification against the full cache; with speculative decoding on, one drafter
    /// proposes tokens for the whole answer.
    pub(super) fn decode<E: Backend>(
        &self,
        target: &E,
        q: &Query,
        input: DecodeInput<'_, E::Cache>,
        timings: &mut Timings,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<Decoded> {
        let started = Instant::now();
        let DecodeInput {
            out,
            exact_rows,
            look,
            full_prefill,
            asm,
            texts,
        } = input;
        let long = self.long_context_for(q, asm.ids.len());
        // The blended cache's decode, verification and escalation share the drafter (none
        // where long-context drafting replaces it).
        let mut drafter = self.drafter(q, asm, texts).filter(|_| !long);
        let spec_of = |d: &Option<_>, s: SpecStats| d.as_ref().map(|_: &_| s.into());
        if let Some(full) = full_prefill {
            let (g, mut stats, spec) = self.verify(
                On { target, query: q },
                out,
                full,
                drafter.as_mut(),
                on_piece,
            )?;
            stats.first_commit_ms += timings.ttft_ms;
            return Ok(Decoded {
                g,
                verify: Some(stats),
                guard: GuardReport {
                    fidelity: q.runs_at(),
                    ..Default::default()
                },
                spec: spec_of(&drafter, spec),
                long: None,
            });
        }
        let reused = Reused {
            out,
            exact_rows,
            look,
            asm,
            started,
        };
        let (g, guard, spec) = self.decode_reused(
            On { target, query: q },
            reused,
            drafter.as_mut(),
            timings,
            on_piece,
        )?;
        // Verified, but sampled or under full recompute: decoded from the full prefill.
        let verify = q.verify.then(|| VerifyStats {
            full_prefill_ms: timings.prefill_ms,
            first_commit_ms: timings.ttft_ms,
            ..Default::default()
        });
        Ok(Decoded {
            g,
            verify,
            guard,
            long: long.then(|| spec.clone().into()),
            spec: spec_of(&drafter, spec),
        })
    }

    /// Runs `then` with the full prefill of a verified request (greedy, a method that reuses:
    /// full recompute decodes from a full prefill already, its answer the exact one), started
    /// now on another thread beside KV load, speculation and the blend, or taken from the
    /// exact-context cache; with none for every other request.
    pub(super) fn with_full_prefill<E: Backend, R>(
        &self,
        target: &E,
        q: &Query,
        asm: &Assembly,
        then: impl FnOnce(Option<FullPrefill<E::Cache>>) -> R,
    ) -> R {
        if !(q.verify && q.temperature == 0.0 && !q.method.is_full()) {
            return then(None);
        }
        let key = ContextCache::key(target.fingerprint(), &q.collection, &asm.ids);
        let cached = self.contexts.get::<E::Cache>(&key);
        let hit = cached.is_some();
        let full_ms = Arc::new(std::sync::Mutex::new(0.0));
        std::thread::scope(|s| {
            let (tx, rx) = std::sync::mpsc::channel();
            match cached {
                Some((cache, logits)) => {
                    let _ = tx.send(Ok(FilledCache { cache, logits }));
                }
                None => {
                    let (ids, ms_out, contexts) = (&asm.ids, full_ms.clone(), &self.contexts);
                    let stop = target_engine::stop::current();
                    s.spawn(move || {
                        let t = Instant::now();
                        let room = ids.len() + q.max_tokens;
                        let r =
                            target_engine::stop::with_stop(stop, || target.prefill_into(ids, room));
                        *ms_out.lock().unwrap_or_else(|p| p.into_inner()) = ms(t);
                        if let Ok((cache, logits)) = &r {
                            contexts.keep(key, cache, logits);
                        }
                        let _ = tx.send(r.map(FilledCache::from));
                    });
                }
            }
            then(Some(FullPrefill {
                rx,
                hit,
                ms: full_ms,
            }))
        })
    }

    /// Greedy decoding from the blended output `draft`, verified against the full cache of the
    /// same prompt, which `full` delivers (computed on another thread since the request
    /// started, or taken from the exact-context cache).
    fn verify<E: Backend>(
        &self,
        on: On<'_, E>,
        draft: BlendOutput<E::Cache>,
        full: FullPrefill<E::Cache>,
        drafter: Option<&mut target_engine::Drafter<'_>>,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<(target_engine::Generation, VerifyStats, SpecStats)> {
        let On { target, query: q } = on;
        let (max_tokens, stop) = (q.max_tokens, &q.stop);
        let tok = target.tokenizer();
        let hit = full.hit;
        let params = VerifyParams {
            max_tokens,
            mode: if hit {
                VerifyMode::FromFull
            } else {
                self.verify_mode
            },
            logprobs: q.logprobs,
            ..Default::default()
        };
        // Drafts, commits and withdrawals reach the client through one text stream: stop
        // strings end the answer, characters split across tokens are shown whole.
        let mut stream = TextStream::new(tok, stop);
        let mut show = |s: Shown<'_>| match s {
            Shown::Final(t) => on_piece(Piece::Commit(t)),
            Shown::Draft(t) => on_piece(Piece::Draft(t)),
            Shown::Retract(n) => on_piece(Piece::Retract(n)),
            Shown::Replace(t) => on_piece(Piece::Replace(t)),
        };
        let g = target.verified_generate_from(
            FilledCache {
                cache: draft.cache,
                logits: draft.logits,
            },
            full.rx,
            &params,
            &mut |e| {
                let flow = match e {
                    VerifyEvent::Draft { id } => stream.draft(id, &mut show),
                    VerifyEvent::Commit { ids } => stream.commit(&ids, &mut show),
                    VerifyEvent::Retract { n } => stream.retract(n, &mut show),
                };
                flow == Flow::Go
            },
            drafter,
        )?;
        let flow = stream.finish(&mut show);
        let finish = finish_reason(&stream, g.cancelled || flow == Flow::Cancel, g.eos);
        let stats = VerifyStats {
            drafted: g.drafted,
            accepted: g.accepted,
            corrected: g.corrected,
            rounds: g.rounds,
            mean_accepted: g.mean_accepted(),
            first_commit_ms: g.first_commit_ms,
            full_prefill_ms: *full.ms.lock().unwrap_or_else(|p| p.into_inner()),
            context_cache_hit: hit,
        };
        let generation = target_engine::Generation {
            text: stream.text(),
            ids: stream.ids().to_vec(),
            prefill_ms: 0.0,
            decode_ms_per_token: 0.0,
            finish,
            margins: Vec::new(),
            // One per committed token; the stream's stop strings may have cut the answer.
            logprobs: super::generate::logprobs_of(g.logprobs, stream.ids().len()),
        };
        Ok((generation, stats, g.spec))
    }
}
