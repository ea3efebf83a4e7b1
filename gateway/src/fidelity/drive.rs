//! The fidelity guard's driving code, beside its policy (`super`): the decode from the
//! reused cache watched token by token, the second look where it doubts a token, and the
//! escalation to the full cache where it sees a loop or the look does not confirm.

use super::{GuardReport, LookCost, LookRows};
use crate::answer::Timings;
use crate::error::Result;
use crate::pipeline::backend::{Backend, On};
use crate::pipeline::generate::{finish_reason, generate_params, Decoding};
use crate::pipeline::{ms, ContextCache, Piece, Pipeline, Query};
use std::time::Instant;
use target_engine::{
    Assembly, BlendOutput, Drafter, Flow, Generation, Pick, Shown, SpecDecodeStats as SpecStats,
    TextStream, TurnKind, VerifyEvent,
};

/// What the guarded decode starts from: the blend's output, the leading rows of its cache a
/// full prefill computes alike (`exact_rows`), which chunk tokens a second look recomputes,
/// the prompt, and when decoding started (for the time to first token a look or an
/// escalation adds to).
pub(crate) struct Reused<'a, C> {
    pub(crate) out: BlendOutput<C>,
    pub(crate) exact_rows: usize,
    pub(crate) look: LookRows,
    pub(crate) asm: &'a Assembly,
    pub(crate) started: Instant,
}

/// What the fidelity guard hands to [`Pipeline::escalate`]: the prompt, the tokens decoded
/// from the reused cache and the text of them the client holds, and the reused cache itself,
/// whose first `exact_rows` rows the full prefill keeps.
struct Escalation<'a, C> {
    prompt: &'a [u32],
    generated: &'a [u32],
    shown: &'a str,
    reused: C,
    exact_rows: usize,
}

/// What the guard's second look starts from: the prompt, the chunk tokens it recomputes, the
/// first decode (the doubted token last) and the text of it the client holds, the blended
/// cache it recomputes them on and the drafter that goes on serving.
struct SecondLook<'a, 'd, C> {
    asm: &'a Assembly,
    extra: &'a [usize],
    first: &'a Generation,
    sent: &'a str,
    cache: &'a mut C,
    drafter: Option<&'a mut Drafter<'d>>,
}

/// The first decode from the reused cache as it stands: the generation, the text the client
/// was sent and the drafts' rounds; a second look replaces the first two, and sets
/// `first_shown` where the first token waited for it.
struct FirstDecode<'a> {
    generation: &'a mut Generation,
    sent: &'a mut String,
    spec: &'a mut SpecStats,
    first_shown: &'a mut Option<Instant>,
}

/// Tokens a decode must choose again before the guard watches the rest (a second look's),
/// and where it records that one was not; `look`: the decode is a second look that answers
/// ([`GuardPolicy::look_answers`](super::GuardPolicy::look_answers)), held to that gap.
struct MustAgree<'a> {
    ids: &'a [u32],
    /// The top-2 gap the first decode chose the last of `ids` (the doubted token) by.
    doubted_gap: Option<f32>,
    disagreed: &'a mut bool,
    look: bool,
}

/// What the guard's second look needs of the blend: its cache and the drafter, the prompt,
/// which tokens it recomputes (`look`), the chunk tokens the selector ranked but left, the
/// leading rows an escalation keeps, how many chunk tokens there are, and when decoding
/// started (for what the request has spent when a look is costed).
struct LookAgain<'a, 'd, C> {
    cache: &'a mut C,
    drafter: Option<&'a mut Drafter<'d>>,
    asm: &'a Assembly,
    look: LookRows,
    reserve: Vec<usize>,
    exact_rows: usize,
    chunk_tokens: usize,
    /// Rows the blended prefill computed (recomputed chunk tokens and the question).
    blend_rows: usize,
    started: Instant,
    timings: &'a mut Timings,
}

impl<C> LookAgain<'_, '_, C> {
    /// What the request has spent so far and would spend, should a look recomputing
    /// `look_rows` chunk tokens run and the request escalate after it.
    fn cost(&self, look_rows: usize) -> LookCost {
        let t = &self.timings;
        LookCost {
            spent_ms: t.kv_load_ms
                + t.speculate_ms
                + t.align_ms
                + t.prefill_ms
                + self.started.elapsed().as_secs_f64() * 1e3,
            blend_ms: t.prefill_ms,
            blend_rows: self.blend_rows,
            prompt_rows: self.asm.ids.len(),
            exact_rows: self.exact_rows,
            question_rows: self.asm.question_positions().len(),
            look_rows,
            look_kept: self.look == LookRows::Extend && self.exact_rows > 0,
        }
    }
}

impl Pipeline {
    /// Decoding from the blended cache of `reused`, watched by the fidelity guard where `q` is
    /// guarded ([`Query::guarded`]): where it doubts a token, a second look; where it sees a
    /// loop, or the look does not confirm, the escalation to the full cache. One drafter
    /// (`drafter`) serves all three. Returns the answer's generation, what the guard
    /// measured and decided, and the drafts' rounds; `timings.ttft_ms` gains what a look or
    /// an escalation delayed the first token by.
    pub(crate) fn decode_reused<E: Backend>(
        &self,
        on: On<'_, E>,
        reused: Reused<'_, E::Cache>,
        mut drafter: Option<&mut Drafter<'_>>,
        timings: &mut Timings,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<(Generation, GuardReport, SpecStats)> {
        let q = on.query;
        let Reused {
            out,
            exact_rows,
            look,
            asm,
            started,
        } = reused;
        let mut report = GuardReport {
            fidelity: q.runs_at(),
            ..Default::default()
        };
        let mut cache = out.cache;
        let from = Decoding {
            cache: &mut cache,
            logits: out.logits,
            drafter: drafter.as_deref_mut(),
        };
        let (mut g, mut spec, mut sent) = self.decode_guarded(on, from, &mut report, on_piece)?;
        self.note_margins(q, &g, &mut report);
        let look = LookAgain {
            cache: &mut cache,
            drafter: drafter.as_deref_mut(),
            asm,
            look,
            reserve: out.reserve,
            exact_rows,
            chunk_tokens: out.chunk_tokens,
            blend_rows: out.recomputed.len() + asm.question_positions().len(),
            started,
            timings: &mut *timings,
        };
        // When the answer's first token that stands was shown, where a look or an escalation
        // held it back past the first decode.
        let mut first_shown = None;
        let decoded = FirstDecode {
            generation: &mut g,
            sent: &mut sent,
            spec: &mut spec,
            first_shown: &mut first_shown,
        };
        let exact_rows = self.look_again_if_doubted(on, look, decoded, &mut report, on_piece)?;
        g.prefill_ms = timings.prefill_ms;
        if report.escalated {
            let nothing_shown = sent.is_empty();
            let moved = Escalation {
                prompt: &asm.ids,
                generated: &g.ids,
                shown: &sent,
                reused: cache,
                exact_rows,
            };
            let (full, ready, more) = self.escalate(on, moved, drafter, &mut report, on_piece)?;
            spec.merge(&more);
            g = full;
            // Nothing shown yet, or every token shown withdrawn: the answer's first token
            // stands once the full cache has checked or chosen it.
            if let Some(r) = ready.filter(|_| nothing_shown || report.kept_tokens == 0) {
                first_shown = Some(r);
            }
        }
        if let Some(at) = first_shown {
            timings.ttft_ms += at.duration_since(started).as_secs_f64() * 1e3;
        }
        Ok((g, report, spec))
    }

    /// What the guard saw of the first decode (`g`): the smallest top-2 gap, and for
    /// `balanced` requests the margin it was held to (methods that reuse nothing: none).
    fn note_margins(&self, q: &Query, g: &Generation, report: &mut GuardReport) {
        if !q.method.is_full() {
            report.min_margin = g.margins.iter().copied().reduce(f32::min);
            if q.guarded() {
                report.margin = Some(self.guard.margin_for(q.method));
            }
        }
    }

    /// The guard's second look ([`Pipeline::second_look`]) where it doubted a token of the
    /// first decode (`decoded`), on `look.cache`, and another for each later doubt after a
    /// look that kept its doubted token, while [`GuardPolicy::looks_again`] allows:
    /// `decoded` becomes what decoding goes on with, its `first_shown` the look's end where
    /// the doubted token was the first and the look kept it. Nothing where
    /// the guard did not doubt a token or the look has nothing left to recompute. Returns the
    /// leading rows of `look.cache` a full prefill computes alike: `look.exact_rows`, and the
    /// looks' own where they extended them ([`LookRows::Extend`]).
    ///
    /// [`GuardPolicy::looks_again`]: super::GuardPolicy::looks_again
    fn look_again_if_doubted<E: Backend>(
        &self,
        on: On<'_, E>,
        mut look: LookAgain<'_, '_, E::Cache>,
        decoded: FirstDecode<'_>,
        report: &mut GuardReport,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<usize> {
        let FirstDecode {
            generation: g,
            sent,
            spec,
            first_shown,
        } = decoded;
        loop {
            let extra = self.second_look_picks(report, &look);
            if extra.is_empty() {
                return Ok(look.exact_rows);
            }
            if !self.guard.affords_look(&look.cost(extra.len())) {
                // An escalation after the look would cost more than the bound allows:
                // escalate now, from the rows already exact.
                report.second_look_skipped |= report.second_looks == 0;
                return Ok(look.exact_rows);
            }
            let exact_rows = match look.look {
                LookRows::Extend if look.exact_rows > 0 => {
                    // The picks run in order from the first row not exact: each is computed
                    // over rows that are.
                    let run = extra
                        .iter()
                        .zip(look.exact_rows..)
                        .take_while(|(p, want)| **p == *want)
                        .count();
                    look.exact_rows + run
                }
                _ => look.exact_rows,
            };
            let second = SecondLook {
                asm: look.asm,
                extra: &extra,
                first: g,
                sent,
                cache: &mut *look.cache,
                drafter: look.drafter.as_deref_mut(),
            };
            let (g2, sent2, more, ready) = self.second_look(on, second, report, on_piece)?;
            spec.merge(&more);
            if g.ids.len() == 1 && (!report.escalated || g2.ids.len() > 1) {
                // The doubted token was the first and the look kept it (or answered): it was
                // shown after the look, whatever a later doubt does.
                *first_shown = Some(ready);
            }
            // The look kept the doubted token and doubted a later one (a loop, or a look
            // that chose otherwise, leaves the first decode's tokens as they were).
            let later_doubt = report.escalated
                && report.uncertain
                && !report.second_look_answered
                && g2.ids.len() > g.ids.len();
            (*g, *sent) = (g2, sent2);
            look.exact_rows = exact_rows;
            // Another look extends the exact rows again; where none are, it would recompute
            // the same chunk tokens.
            if !(later_doubt && exact_rows > 0 && self.guard.looks_again(report.second_looks)) {
                return Ok(exact_rows);
            }
        }
    }

    /// The chunk tokens a second look recomputes for a request the guard just stopped
    /// (`report`), the policy's share of the chunk tokens, where the guard doubted a token
    /// (not a loop); none otherwise. [`LookRows::Ranked`]: the first of the selector's reserve
    /// (best first) at or after the exact rows (rows an escalation keeps as full prefill's
    /// stay as they are). [`LookRows::Extend`]: the chunk tokens from the first row not exact
    /// on, in order. None for either where the selector ranked nothing it left.
    fn second_look_picks<C>(
        &self,
        report: &GuardReport,
        look: &LookAgain<'_, '_, C>,
    ) -> Vec<usize> {
        if !report.escalated || !report.uncertain || self.guard.second_look <= 0.0 {
            return Vec::new();
        }
        let budget =
            target_engine::reuse::select::budget(self.guard.second_look, look.chunk_tokens);
        let exact = look.exact_rows;
        match look.look {
            LookRows::Ranked => look
                .reserve
                .iter()
                .copied()
                .filter(|&p| p >= exact)
                .take(budget)
                .collect(),
            // Only where the selector ranked what it left, as for ranked picks: the same
            // requests take a look under either kind.
            LookRows::Extend if look.reserve.is_empty() => Vec::new(),
            LookRows::Extend => look
                .asm
                .chunk_positions()
                .into_iter()
                .filter(|&p| p >= exact)
                .take(budget)
                .collect(),
        }
    }

    /// The guard's second look: `look.extra` chunk tokens recomputed on top of the blend in
    /// `look.cache` (the question with them), then decoding restarted from that cache under the
    /// guard with one more rule: each of the tokens the first decode chose (`look.first`, the
    /// doubted one last) must be chosen again, the doubted one by at least the policy's
    /// [`confirm_gap`](super::GuardPolicy::confirm_gap). The text the client holds
    /// (`look.sent`) is not sent twice. Where every one is chosen again, decoding goes on
    /// from there and `report.escalated` is cleared; where one is not, the request escalates
    /// with the first decode's tokens and text; where the guard stops the decode later, with
    /// this one's. A look that answers ([`GuardPolicy::look_answers`]) is not held to the first
    /// decode's tokens: its own go on, each held to that gap, and where they part from the
    /// first decode's the client's text is replaced (`Resync`).
    /// Returns the generation and the text the client holds, and when the recompute was done.
    ///
    /// [`GuardPolicy::look_answers`]: super::GuardPolicy::look_answers
    fn second_look<E: Backend>(
        &self,
        on: On<'_, E>,
        look: SecondLook<'_, '_, E::Cache>,
        report: &mut GuardReport,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<(Generation, String, SpecStats, Instant)> {
        let target = on.target;
        let SecondLook {
            asm,
            extra,
            first,
            sent,
            cache,
            drafter,
        } = look;
        let t = Instant::now();
        let mut blended = std::mem::replace(cache, target.placeholder());
        target.truncate_cache(&mut blended, asm.ids.len());
        // Prefill work: after the prefills waiting, not beside one (`--max-batch`); at the
        // first token, prefill before it, where the request's first prefill stood in line.
        let recompute = || target_engine::blend_on(target, asm, blended, extra);
        let out = if first.ids.len() == 1 {
            target_engine::in_first_token_turn(recompute)
        } else {
            target_engine::in_prefill_turn(TurnKind::Look, recompute)
        }?;
        let ready = Instant::now();
        report.second_look = true;
        report.second_looks += 1;
        report.second_look_tokens += extra.len();
        report.second_look_ms += ms(t);
        *report = GuardReport {
            loop_detected: false,
            uncertain: false,
            escalated: false,
            ..*report
        };
        *cache = out.cache;
        // The client holds `sent`: text the look decodes again is not sent twice, and text it
        // decodes otherwise replaces what the client holds.
        let mut held = Resync::new(sent);
        let mut forward = |p: Piece<'_>| held.forward(p, on_piece);
        let mut disagreed = false;
        let from = Decoding {
            cache,
            logits: out.logits,
            drafter,
        };
        // A look that answers is held to its own gap, not to the first decode's tokens.
        let answers = self.guard.look_answers.is_some();
        let agree = MustAgree {
            ids: if answers { &[] } else { &first.ids },
            // Only where every token was decoded one by one (the gaps line up with the ids).
            doubted_gap: (first.margins.len() == first.ids.len())
                .then(|| first.margins.last().copied())
                .flatten(),
            disagreed: &mut disagreed,
            look: answers,
        };
        let (g, spec, _) = self.decode_watched_as(on, from, report, agree, &mut forward)?;
        if disagreed {
            report.escalated = true;
            report.uncertain = true;
            return Ok((first.clone(), sent.to_string(), spec, ready));
        }
        let parted = first
            .ids
            .iter()
            .zip(&g.ids)
            .take_while(|(a, b)| a == b)
            .count();
        if answers && parted == first.ids.len() {
            report.second_look_gap = g.margins.get(parted.saturating_sub(1)).copied();
        }
        if !report.escalated && parted < first.ids.len() {
            report.second_look_answered = true;
            report.withdrawn_tokens = first.ids.len() - parted;
            // The client may hold more of the first decode's text than the look's answer.
            held.finish(on_piece);
        }
        Ok((g, held.held, spec, ready))
    }

    /// [`Pipeline::decode_from`] under the fidelity guard (not for full recompute, which
    /// decodes from the full cache already, nor `exact`): `report` says whether it stopped
    /// the decode to escalate, and why. Also returns the text the client was sent (what it
    /// holds should the guard move the request to the full cache).
    fn decode_guarded<E: Backend>(
        &self,
        on: On<'_, E>,
        from: Decoding<'_, '_, E::Cache>,
        report: &mut GuardReport,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<(Generation, SpecStats, String)> {
        let mut disagreed = false;
        let agree = MustAgree {
            ids: &[],
            doubted_gap: None,
            disagreed: &mut disagreed,
            look: false,
        };
        self.decode_watched_as(on, from, report, agree, on_piece)
    }

    /// [`Pipeline::decode_guarded`] where the first `must.ids.len()` tokens must be those ids
    /// (a second look's; not held to the margin, the last held to the confirm gap): the
    /// decode stops at the first that is not, setting `must.disagreed`. The rest are held to
    /// the guard.
    fn decode_watched_as<E: Backend>(
        &self,
        on: On<'_, E>,
        from: Decoding<'_, '_, E::Cache>,
        report: &mut GuardReport,
        must: MustAgree<'_>,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<(Generation, SpecStats, String)> {
        let On { target, query: q } = on;
        let MustAgree {
            ids: agree,
            doubted_gap,
            disagreed,
            look,
        } = must;
        let guarded = q.guarded();
        let tok = target.tokenizer();
        let detector = target_engine::LoopDetector::default();
        let policy = self.guard;
        let (mut looped, mut uncertain) = (false, false);
        let mut look_gap = None;
        let mut watch = |ids: &[u32], pick: Pick| {
            let gap = pick.gap;
            if let Some(&want) = agree.get(ids.len() - 1) {
                // The doubted token (the last to agree on) must be chosen decidedly.
                let doubted = ids.len() == agree.len();
                let same = ids.last() == Some(&want);
                if doubted && same {
                    look_gap = Some(gap);
                }
                *disagreed = !same || (doubted && !policy.confirms(doubted_gap, gap));
                return *disagreed;
            }
            looped = guarded && detector.fires(ids);
            uncertain = guarded
                && if look {
                    policy.doubts_look(ids.len(), gap)
                } else {
                    policy.doubts(q.method, ids.len(), gap)
                }
                && ids.last().is_some_and(|&id| {
                    let rival = pick.rival.map(|r| tok.token_bytes(r));
                    policy.watches(ids.len(), tok.token_bytes(id), rival)
                });
            looped || uncertain
        };
        let mut sent = String::new();
        let mut track = |p: Piece<'_>| {
            if let Piece::Token(t) = p {
                sent.push_str(t);
            }
            on_piece(p)
        };
        let (g, escalate, spec) = self.decode_from(target, q, from, &mut track, &mut watch)?;
        if !agree.is_empty() {
            report.second_look_gap = look_gap;
        }
        if escalate {
            report.loop_detected = looped;
            report.uncertain = uncertain && !looped;
            report.escalated = true;
        }
        Ok((g, spec, sent))
    }

    /// The full cache of `prompt` and its last logits for an escalation: the exact-context
    /// cache's copy, else the full prefill over the `reused` cache's first `exact` rows (those
    /// a full prefill computes alike), else a full prefill; the time it took and the rows it
    /// kept go into `report`.
    fn full_cache<E: Backend>(
        &self,
        on: On<'_, E>,
        prompt: &[u32],
        mut reused: E::Cache,
        exact: usize,
        report: &mut GuardReport,
    ) -> Result<(E::Cache, Vec<f32>)> {
        let On { target, query: q } = on;
        let t = Instant::now();
        let key = ContextCache::key(target.fingerprint(), &q.collection, prompt);
        // A full cache over stored rows is kept apart: `exact` requests take only true ones.
        let kept_key = ContextCache::key_after_stored(&key, exact);
        let hit = self
            .contexts
            .get(&key)
            .or_else(|| self.contexts.get(&kept_key));
        Ok(match hit {
            Some(c) => c,
            None if exact > 0 && exact < prompt.len() => {
                let logits = prefill_in_pieces(target, &mut reused, prompt, exact)?;
                report.full_prefill_ms = ms(t);
                report.full_prefill_kept_rows = exact;
                self.contexts.keep(kept_key, &reused, &logits);
                (reused, logits)
            }
            None => {
                drop(reused);
                let mut cache = target.empty_cache(prompt.len() + q.max_tokens)?;
                let logits = prefill_in_pieces(target, &mut cache, prompt, 0)?;
                report.full_prefill_ms = ms(t);
                self.contexts.keep(key, &cache, &logits);
                (cache, logits)
            }
        })
    }

    /// The fidelity guard's way out: the full prefill of `prompt` (or the context cache's
    /// copy), the tokens decoded so far checked against it, the agreeing prefix kept and
    /// decoding continued from the full cache. The full prefill keeps the reused cache's
    /// first `exact_rows` (the template prefix and the first chunk, precomputed after it:
    /// `exact_rows` in `pipeline/blend.rs`) and computes the rest, so it costs what full recompute's would less
    /// that chunk. The full cache's tokens are chosen as a plain decode from it would choose
    /// them (greedy, or the seeded sampler's draw at each index), so the answer is full
    /// recompute's, token for token, for the same seed (`exact` requests never take such a
    /// cache all the same). The client, which holds `shown` of the text of `generated`, sees
    /// the kept prefix extended, or replaced where text it holds was withdrawn. Also returns
    /// when the full cache was ready.
    fn escalate<E: Backend>(
        &self,
        on: On<'_, E>,
        moved: Escalation<'_, E::Cache>,
        drafter: Option<&mut Drafter<'_>>,
        report: &mut GuardReport,
        on_piece: &mut dyn FnMut(Piece<'_>) -> bool,
    ) -> Result<(Generation, Option<Instant>, SpecStats)> {
        let On { target, query: q } = on;
        let Escalation {
            prompt,
            generated,
            shown,
            reused,
            exact_rows: exact,
        } = moved;
        let tok = target.tokenizer();
        let (cache, logits) = self.full_cache(on, prompt, reused, exact, report)?;
        let ready = Some(Instant::now());
        let checked = generated.len().min(q.max_tokens);
        let mut stream = TextStream::resume(tok, &q.stop, generated, shown);
        let mut show = |s: Shown<'_>| match s {
            Shown::Final(t) => on_piece(Piece::Token(t)),
            Shown::Replace(t) => on_piece(Piece::Replace(t)),
            // Only final tokens come in below.
            Shown::Draft(_) | Shown::Retract(_) => true,
        };
        let pick = target_engine::Sampler::new(generate_params(q).sampling);
        let vg = target.continue_exact(
            target_engine::FilledCache { cache, logits },
            target_engine::Continuation {
                generated,
                max_tokens: q.max_tokens,
                pick,
                logprobs: q.logprobs,
            },
            &mut |e| {
                let flow = match e {
                    VerifyEvent::Retract { n } => stream.keep(checked - n, &mut show),
                    VerifyEvent::Commit { ids } => stream.commit(&ids, &mut show),
                    VerifyEvent::Draft { .. } => Flow::Go,
                };
                flow == Flow::Go
            },
            drafter,
        )?;
        // Also when nothing was withdrawn and nothing added: the text held back until now.
        let flow = stream.finish(&mut show);
        report.kept_tokens = vg.accepted;
        report.withdrawn_tokens = vg.drafted - vg.accepted;
        let g = Generation {
            text: stream.text(),
            ids: stream.ids().to_vec(),
            prefill_ms: 0.0,
            decode_ms_per_token: 0.0,
            finish: finish_reason(&stream, vg.cancelled || flow == Flow::Cancel, vg.eos),
            margins: Vec::new(),
            logprobs: crate::pipeline::generate::logprobs_of(vg.logprobs, stream.ids().len()),
        };
        Ok((g, ready, vg.spec))
    }
}

/// The text a client holds, kept in step with a decode that says it again, or otherwise: a
/// second look's. Text the client holds already is not sent again; text that extends it is
/// sent as a token; text that parts from it replaces it.
struct Resync {
    /// What the client holds.
    held: String,
    /// What the decode has said so far.
    said: String,
}

impl Resync {
    fn new(held: &str) -> Self {
        Self {
            held: held.to_string(),
            said: String::new(),
        }
    }

    /// The decode's piece `p`, passed on as what the client lacks; false where the client
    /// cancelled.
    fn forward(&mut self, p: Piece<'_>, on_piece: &mut dyn FnMut(Piece<'_>) -> bool) -> bool {
        match p {
            Piece::Token(t) => self.said.push_str(t),
            Piece::Replace(t) => t.clone_into(&mut self.said),
            p => return on_piece(p),
        }
        if self.held.starts_with(&self.said) {
            return true;
        }
        self.finish(on_piece)
    }

    /// Sends what the client lacks of the decode's text, or the text itself where the client
    /// holds other text (more of it included).
    fn finish(&mut self, on_piece: &mut dyn FnMut(Piece<'_>) -> bool) -> bool {
        if self.said == self.held {
            return true;
        }
        let ok = match self.said.strip_prefix(self.held.as_str()) {
            Some(rest) => on_piece(Piece::Token(rest)),
            None => on_piece(Piece::Replace(&self.said)),
        };
        self.held.clone_from(&self.said);
        ok
    }
}

/// The full prefill of `prompt` over `cache`, whose rows `0..start` hold what a prefill
/// computes: the rows after them in the pieces the batcher asks for
/// ([`target_engine::prefill_pieces`]), each in a prefill turn of its own, so a request
/// waiting for its first prefill goes between them rather than after the whole (twice at
/// most, over all the pieces; an escalation begun later waits for all of them). A row does
/// not depend on where a pass began, so the cache is the one pass's (bit for bit on the CPU
/// engine: `an_escalation_in_pieces_answers_as_in_one` in gateway/tests/server.rs). Returns
/// the last row's logits.
fn prefill_in_pieces<E: Backend>(
    target: &E,
    cache: &mut E::Cache,
    prompt: &[u32],
    start: usize,
) -> Result<Vec<f32>> {
    let mut logits = Vec::new();
    // The pieces are overtaken at most twice in all, not each, and keep the first's place.
    let mut work = target_engine::WorkTurns::default();
    for piece in target_engine::prefill_pieces(start..prompt.len()) {
        logits = target_engine::in_prefill_turn_of(TurnKind::Escalation, &mut work, || {
            target.prefill_from(cache, &prompt[..piece.end], piece.start)
        })?;
    }
    Ok(logits)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the client is sent for each piece a look decodes, from text it holds already.
    fn sent_for(held: &str, said: &[&str]) -> (Vec<String>, String) {
        let mut out = Vec::new();
        let mut r = Resync::new(held);
        let mut record = |p: Piece<'_>| {
            out.push(match p {
                Piece::Token(t) => format!("token {t}"),
                Piece::Replace(t) => format!("replace {t}"),
                _ => "other".to_string(),
            });
            true
        };
        for t in said {
            assert!(r.forward(Piece::Token(t), &mut record));
        }
        r.finish(&mut record);
        (out, r.held)
    }

    #[test]
    fn a_look_sends_only_what_the_client_lacks_and_replaces_what_parts() {
        // Said again, then more: only the rest is sent.
        let (out, held) = sent_for("The old", &["The", " old", " show"]);
        assert_eq!(out, ["token  show"]);
        assert_eq!(held, "The old show");
        // Parted within the held text: the look's text replaces it, and goes on as tokens.
        let (out, held) = sent_for("The old", &["The", " new", " one"]);
        assert_eq!(out, ["replace The new", "token  one"]);
        assert_eq!(held, "The new one");
        // Ended short of what the client holds: replaced at the end.
        let (out, held) = sent_for("The old show", &["The"]);
        assert_eq!(out, ["replace The"]);
        assert_eq!(held, "The");
        // The same text: nothing sent.
        let (out, _) = sent_for("Naples", &["N", "aples"]);
        assert!(out.is_empty(), "{out:?}");
    }
}
