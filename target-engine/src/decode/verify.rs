//! Lossless decoding over a reused cache (VeriCache's draft-then-verify applied to selective
//! reuse): tokens are drafted greedily from the approximate (blended) cache while the full
//! prefill of the same prompt runs on another thread; once it is ready, the drafted tokens are
//! checked in one pass over the full cache, the longest agreeing prefix is kept and the first
//! disagreement is replaced by the full cache's own token. Every committed token is therefore
//! the full-recompute greedy token, and the output equals full recompute token for token.
//!
//! Exactness rests on [`Engine::rows`]: a verification pass over several drafted tokens
//! computes each row as the one-token decode step full recompute would take there, on the CPU
//! engine bit-identically ([`crate::Model::forward_decode_path`]; batches are capped at
//! [`MAX_VERIFY_ROWS`] to stay on that path). Written once for both engines.
//!
//! Once decoding goes on from the full cache (after the drafts were checked, or after the
//! fidelity guard's escalation), a [`Drafter`] may propose tokens there too: speculative
//! decoding over the full cache, each pass keeping only what the full cache would have chosen.

use crate::decode::draft::{DraftLength, SpecDecodeStats};
use crate::decode::generate::FilledCache;
use crate::decode::logprobs::TokenLogprobs;
use crate::decode::speculative::{DraftRoom, Drafter};
use crate::engine::Engine;
use crate::error::{EngineError, Result};
use crate::model::MAX_VERIFY_ROWS;
use crate::sampling::{argmax, Sampler};
use std::sync::mpsc;
use std::time::Instant;

/// How decoding goes on once the full cache is ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerifyMode {
    /// Verify the drafts once, then decode from the full cache (one token per step).
    FromFull,
    /// Keep drafting from the fused cache and verify every `n` drafted tokens in one pass
    /// (speculative decoding with the reused cache as the draft model).
    DraftEvery(usize),
}

impl std::fmt::Display for VerifyMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::FromFull => f.write_str("full"),
            Self::DraftEvery(n) => write!(f, "draft-every-{n}"),
        }
    }
}

impl std::str::FromStr for VerifyMode {
    type Err = String;

    /// `full` or `draft-every-N` (N in `1..MAX_VERIFY_ROWS`), as [`Display`](std::fmt::Display)
    /// writes them.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "full" => Ok(Self::FromFull),
            other => other
                .strip_prefix("draft-every-")
                .and_then(|n| n.parse().ok())
                .filter(|n| (1..MAX_VERIFY_ROWS).contains(n))
                .map(Self::DraftEvery)
                .ok_or_else(|| {
                    format!(
                        "expected `full` or `draft-every-N` with N in 1..={}, got `{other}`",
                        MAX_VERIFY_ROWS - 1
                    )
                }),
        }
    }
}

/// Settings of a verified generation (greedy only).
#[derive(Debug, Clone, Copy)]
pub struct VerifyParams {
    pub max_tokens: usize,
    pub mode: VerifyMode,
    /// Most tokens drafted while the full prefill runs (drafting shares the CPU with it).
    pub max_early_drafts: usize,
    /// Record each committed token's logprob and this many alternatives, from the full
    /// cache's row that chose it ([`VerifiedGeneration::logprobs`]); `None`: nothing.
    pub logprobs: Option<usize>,
}

impl Default for VerifyParams {
    fn default() -> Self {
        Self {
            max_tokens: 128,
            mode: VerifyMode::DraftEvery(8),
            max_early_drafts: 32,
            logprobs: None,
        }
    }
}

/// What a verified generation reports as it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VerifyEvent {
    /// A token drafted from the reused cache (not final).
    Draft { id: u32 },
    /// Tokens now final (accepted drafts and the correction, or full-cache decode steps).
    Commit { ids: Vec<u32> },
    /// The last `n` drafted tokens were wrong and are withdrawn.
    Retract { n: usize },
}

/// The result of a verified generation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VerifiedGeneration {
    /// Committed ids (the full-recompute greedy output).
    pub ids: Vec<u32>,
    /// Tokens drafted from the reused cache.
    pub drafted: usize,
    /// Drafted tokens the full cache agreed with.
    pub accepted: usize,
    /// Tokens the full cache put in place of a wrong draft.
    pub corrected: usize,
    /// Verification passes.
    pub rounds: usize,
    /// When the full prefill was ready (ms from the call).
    pub full_ready_ms: f64,
    /// When the first token was committed (ms from the call).
    pub first_commit_ms: f64,
    /// True when generation ended with an end-of-generation token.
    pub eos: bool,
    /// True when the consumer stopped it.
    pub cancelled: bool,
    /// Speculative decoding from the full cache (a drafter given): what it drafted and kept.
    pub spec: SpecDecodeStats,
    /// Per committed token, its logprobs from the full cache's row that chose it, where
    /// asked (else empty).
    pub logprobs: Vec<TokenLogprobs>,
}

impl VerifiedGeneration {
    /// Commits `c`: its ids and, where recorded, their logprobs.
    fn commit(&mut self, c: &Committed) {
        self.ids.extend(&c.ids);
        self.logprobs.extend(c.logprobs.iter().cloned());
    }
}

/// Tokens the full cache committed in one check, with their logprobs where asked (then one
/// per token).
#[derive(Debug, Default)]
struct Committed {
    ids: Vec<u32>,
    logprobs: Vec<TokenLogprobs>,
}

impl Committed {
    fn truncate(&mut self, n: usize) {
        self.ids.truncate(n);
        self.logprobs.truncate(n);
    }

    /// Cut after the first end-of-generation token; true when there was one.
    fn end_at_eos(&mut self, tok: &crate::tokenizer::Tokenizer) -> bool {
        match self.ids.iter().position(|&t| tok.is_end_of_generation(t)) {
            Some(at) => {
                self.truncate(at + 1);
                true
            }
            None => false,
        }
    }
}

impl VerifiedGeneration {
    /// Mean number of drafted tokens accepted per verification pass.
    pub fn mean_accepted(&self) -> f64 {
        if self.rounds == 0 {
            0.0
        } else {
            self.accepted as f64 / self.rounds as f64
        }
    }
}

/// The draft side of a verification: the reused cache and its last logits, the drafts not
/// yet verified, and the last committed token when it is not yet fed to the draft cache.
struct Draft<C> {
    /// When the verified generation started (for `first_commit_ms`).
    t0: Instant,
    cache: C,
    logits: Vec<f32>,
    drafts: Vec<u32>,
    pending: Option<u32>,
    prompt_len: usize,
}

/// The full prefill as it arrives from its thread, checked against the prompt's length.
fn receive_full<E: Engine>(
    engine: &E,
    r: Option<Result<FilledCache<E::Cache>>>,
    prompt_len: usize,
    max_tokens: usize,
    logprobs: Option<usize>,
) -> Result<Full<E::Cache>> {
    let FilledCache { mut cache, logits } =
        r.ok_or_else(|| EngineError::Internal("the full prefill thread stopped".into()))??;
    let rows = engine.cache_len(&cache);
    if rows != prompt_len {
        return Err(EngineError::Internal(format!(
            "full prefill has {rows} rows, the draft {prompt_len}"
        )));
    }
    engine.reserve_cache(&mut cache, max_tokens + MAX_VERIFY_ROWS)?;
    Ok(Full::new(
        cache,
        &logits,
        Sampler::new(Default::default()),
        logprobs,
    ))
}

/// The full cache during verification. Its rows are exact up to its length; then either
/// `next` is the full cache's token for the next position, or `pending` is a committed token
/// not yet fed (exactly one of them is set). `pick` chooses the full cache's tokens: greedy,
/// or the seeded sampler's draw at each token's index in the answer.
struct Full<C> {
    cache: C,
    next: Option<u32>,
    /// The logprobs of `next`, where asked.
    next_logprobs: Option<TokenLogprobs>,
    pending: Option<u32>,
    pick: Sampler,
    /// Alternatives per committed token's logprobs; `None`: none recorded.
    logprobs: Option<usize>,
}

impl<C> Full<C> {
    /// The full cache filled through the prompt, its first token chosen from `logits`.
    fn new(cache: C, logits: &[f32], pick: Sampler, logprobs: Option<usize>) -> Self {
        let next = pick.sample_at(logits, 0);
        Self {
            next: Some(next),
            next_logprobs: logprobs.map(|k| TokenLogprobs::of(logits, next, k)),
            cache,
            pending: None,
            pick,
            logprobs,
        }
    }
}

/// What [`Verify::continue_exact`] goes on from: the tokens an approximate cache decoded, and
/// the limits the full cache decodes under.
#[derive(Debug, Clone, Copy)]
pub struct Continuation<'g> {
    /// The tokens decoded from the approximate cache, checked against the full cache.
    pub generated: &'g [u32],
    pub max_tokens: usize,
    /// How the full cache chooses its tokens (greedy, or the request's seeded sampler).
    pub pick: Sampler,
    /// Record each committed token's logprobs with this many alternatives
    /// ([`VerifiedGeneration::logprobs`]); `None`: nothing.
    pub logprobs: Option<usize>,
}

/// Verified decoding: drafts from a reused cache checked against the full prefill's, so the
/// answer is full recompute's token for token, on any [`Engine`].
pub trait Verify: Engine {
    /// Greedy generation whose output equals decoding from the full prefill of the same prompt,
    /// drafting from `draft` (the blended cache and its last logits) until `full` (the full
    /// prefill, run on its own thread) is ready. `on_event` returning `false` cancels.
    fn verified_generate(
        &self,
        draft: FilledCache<Self::Cache>,
        full: impl FnOnce() -> Result<FilledCache<Self::Cache>> + Send,
        params: &VerifyParams,
        on_event: &mut dyn FnMut(VerifyEvent) -> bool,
    ) -> Result<VerifiedGeneration>;

    /// [`Verify::verified_generate`] with the full prefill delivered on `rx` by the caller
    /// (started as early as the caller can, e.g. before the chunk KV is even loaded), and
    /// `drafter` (if any) proposing tokens once decoding goes on from the full cache
    /// ([`VerifyMode::FromFull`]): speculative decoding composed with verification, every
    /// committed token still the full cache's greedy choice.
    fn verified_generate_from(
        &self,
        draft: FilledCache<Self::Cache>,
        rx: mpsc::Receiver<Result<FilledCache<Self::Cache>>>,
        params: &VerifyParams,
        on_event: &mut dyn FnMut(VerifyEvent) -> bool,
        drafter: Option<&mut Drafter<'_>>,
    ) -> Result<VerifiedGeneration>;

    /// Decoding from the full cache that keeps what a decode from an approximate cache already
    /// produced, as far as the full cache agrees: `generated` is checked against the full
    /// prefill `full` in verification passes, the agreeing prefix kept, the rest withdrawn
    /// ([`VerifyEvent::Retract`]) and decoding goes on from the full cache ([`VerifyEvent::Commit`]
    /// carries only the tokens after the kept prefix). `pick` chooses the full cache's tokens
    /// (greedy, or seeded sampling whose draw depends only on a token's index and logits), so
    /// the output equals decoding from the full prefill with `pick`, token for token: the
    /// fidelity guard's way out of a reused cache. `drafter` (if any) proposes tokens for the
    /// decode from the full cache.
    fn continue_exact(
        &self,
        full: FilledCache<Self::Cache>,
        answer: Continuation<'_>,
        on_event: &mut dyn FnMut(VerifyEvent) -> bool,
        drafter: Option<&mut Drafter<'_>>,
    ) -> Result<VerifiedGeneration>;
}

impl<E: Engine> Verify for E {
    fn verified_generate(
        &self,
        draft: FilledCache<E::Cache>,
        full: impl FnOnce() -> Result<FilledCache<E::Cache>> + Send,
        params: &VerifyParams,
        on_event: &mut dyn FnMut(VerifyEvent) -> bool,
    ) -> Result<VerifiedGeneration> {
        std::thread::scope(|s| {
            let (tx, rx) = mpsc::channel();
            let stop = crate::stop::current();
            s.spawn(move || {
                let _ = tx.send(crate::stop::with_stop(stop, full));
            });
            self.verified_generate_from(draft, rx, params, on_event, None)
        })
    }

    fn verified_generate_from(
        &self,
        draft: FilledCache<E::Cache>,
        rx: mpsc::Receiver<Result<FilledCache<E::Cache>>>,
        params: &VerifyParams,
        on_event: &mut dyn FnMut(VerifyEvent) -> bool,
        mut drafter: Option<&mut Drafter<'_>>,
    ) -> Result<VerifiedGeneration> {
        let FilledCache { mut cache, logits } = draft;
        self.reserve_cache(&mut cache, params.max_tokens + MAX_VERIFY_ROWS)?;
        let t0 = Instant::now();
        let mut d = Draft {
            t0,
            prompt_len: self.cache_len(&cache),
            cache,
            logits,
            drafts: Vec::new(),
            pending: None,
        };
        let mut out = VerifiedGeneration::default();
        let mut full: Option<Full<E::Cache>> = None;
        while !out.eos && out.ids.len() < params.max_tokens {
            if full.is_none() {
                if let Ok(r) = rx.try_recv() {
                    full = Some(receive_full(
                        self,
                        Some(r),
                        d.prompt_len,
                        params.max_tokens,
                        params.logprobs,
                    )?);
                    out.full_ready_ms = ms(t0);
                }
            }
            if !verify_now(self, &d, full.is_some(), params, out.ids.len()) {
                let id = draft_next(self, &mut d)?;
                out.drafted += 1;
                if !on_event(VerifyEvent::Draft { id }) {
                    out.cancelled = true;
                    break;
                }
                continue;
            }
            let mut f = match full.take() {
                Some(f) => f,
                None => {
                    let f = receive_full(
                        self,
                        rx.recv().ok(),
                        d.prompt_len,
                        params.max_tokens,
                        params.logprobs,
                    )?;
                    out.full_ready_ms = ms(t0);
                    f
                }
            };
            verify_round(self, &mut f, &mut d, &mut out, params.max_tokens, on_event)?;
            if !out.cancelled && params.mode == VerifyMode::FromFull {
                let d = drafter.as_deref_mut();
                decode_full(self, &mut f, &mut out, params.max_tokens, d, on_event)?;
            }
            full = Some(f);
            if out.cancelled {
                break;
            }
        }
        Ok(out)
    }

    fn continue_exact(
        &self,
        full: FilledCache<E::Cache>,
        answer: Continuation<'_>,
        on_event: &mut dyn FnMut(VerifyEvent) -> bool,
        drafter: Option<&mut Drafter<'_>>,
    ) -> Result<VerifiedGeneration> {
        let FilledCache { mut cache, logits } = full;
        let Continuation {
            generated,
            max_tokens,
            pick,
            logprobs,
        } = answer;
        self.reserve_cache(&mut cache, max_tokens + MAX_VERIFY_ROWS)?;
        let t0 = Instant::now();
        let tok = Engine::tokenizer(self);
        let mut out = VerifiedGeneration::default();
        let mut f = Full::new(cache, &logits, pick, logprobs);
        let drafts = &generated[..generated.len().min(max_tokens)];
        let (mut commit, agreed) = verify_drafts(self, &mut f, drafts, 0)?;
        out.drafted = drafts.len();
        out.accepted = agreed;
        out.rounds = 1;
        out.corrected = usize::from(agreed < drafts.len());
        out.full_ready_ms = 0.0;
        let wrong = drafts.len() - agreed;
        if wrong > 0 && !on_event(VerifyEvent::Retract { n: wrong }) {
            out.cancelled = true;
            return Ok(out);
        }
        commit.truncate(max_tokens);
        out.eos = commit.end_at_eos(tok);
        out.commit(&commit);
        out.first_commit_ms = ms(t0);
        let fresh = out.ids[agreed.min(out.ids.len())..].to_vec();
        if !fresh.is_empty() && !on_event(VerifyEvent::Commit { ids: fresh }) {
            out.cancelled = true;
            return Ok(out);
        }
        decode_full(self, &mut f, &mut out, max_tokens, drafter, on_event)?;
        Ok(out)
    }
}

/// Whether the drafts go to verification now: the draft ended (room used up or an end
/// token), or enough were drafted for the mode (before the full cache is ready: the early
/// drafts' cap).
fn verify_now<E: Engine>(
    model: &E,
    d: &Draft<E::Cache>,
    full_ready: bool,
    params: &VerifyParams,
    done: usize,
) -> bool {
    let room = params.max_tokens - done;
    let tok = Engine::tokenizer(model);
    let ended = d.drafts.len() >= room
        || d.drafts
            .last()
            .is_some_and(|&t| tok.is_end_of_generation(t));
    ended
        || match (full_ready, params.mode) {
            (false, _) => d.drafts.len() >= params.max_early_drafts,
            (true, VerifyMode::FromFull) => true,
            (true, VerifyMode::DraftEvery(n)) => d.drafts.len() >= n.clamp(1, MAX_VERIFY_ROWS - 1),
        }
}

/// One draft step from the reused cache: feeds the pending committed token (or the last
/// draft) and drafts the next greedy token.
fn draft_next<E: Engine>(model: &E, d: &mut Draft<E::Cache>) -> Result<u32> {
    if let Some(p) = d.pending.take() {
        d.logits = step(model, &mut d.cache, p)?;
    } else if let Some(&last) = d.drafts.last() {
        d.logits = step(model, &mut d.cache, last)?;
    }
    let id = argmax(&d.logits);
    d.drafts.push(id);
    Ok(id)
}

/// One verification round: the drafts checked against the full cache, the agreeing prefix
/// and the correction committed, the wrong drafts retracted, and the draft cache brought
/// back to the committed tokens. Sets `out.cancelled` when the consumer says stop.
fn verify_round<E: Engine>(
    model: &E,
    f: &mut Full<E::Cache>,
    d: &mut Draft<E::Cache>,
    out: &mut VerifiedGeneration,
    max_tokens: usize,
    on_event: &mut dyn FnMut(VerifyEvent) -> bool,
) -> Result<()> {
    let tok = Engine::tokenizer(model);
    let room = max_tokens - out.ids.len();
    let (mut commit, agreed) = verify_drafts(model, f, &d.drafts, out.ids.len())?;
    let wrong = d.drafts.len() - agreed;
    out.rounds += usize::from(!d.drafts.is_empty());
    out.accepted += agreed;
    out.corrected += usize::from(wrong > 0);
    if wrong > 0 && !on_event(VerifyEvent::Retract { n: wrong }) {
        out.cancelled = true;
        return Ok(());
    }
    commit.truncate(room);
    if commit.end_at_eos(tok) {
        out.eos = true;
    }
    if out.ids.is_empty() && !commit.ids.is_empty() {
        out.first_commit_ms = ms(d.t0);
    }
    out.commit(&commit);
    if !on_event(VerifyEvent::Commit { ids: commit.ids }) {
        out.cancelled = true;
        return Ok(());
    }
    // The draft cache keeps the prompt and every committed token but the last, which is
    // fed at the next draft step. (Rows of accepted drafts were computed against the
    // reused cache: fine for drafting, never for committing.)
    let need = d.prompt_len + out.ids.len() - 1;
    model.truncate_cache(&mut d.cache, need);
    while model.cache_len(&d.cache) < need {
        // The last draft had not been fed yet (all drafts agreed).
        let j = model.cache_len(&d.cache) - d.prompt_len;
        step(model, &mut d.cache, out.ids[j])?;
    }
    d.pending = out.ids.last().copied();
    d.drafts.clear();
    Ok(())
}

/// Decoding from the full cache until an end token or `max_tokens`, committing as it goes:
/// one token per pass, or with a drafter the agreeing prefix of its proposals and the full
/// cache's own token after it, all checked in one pass.
fn decode_full<E: Engine>(
    model: &E,
    f: &mut Full<E::Cache>,
    out: &mut VerifiedGeneration,
    max_tokens: usize,
    mut drafter: Option<&mut Drafter<'_>>,
    on_event: &mut dyn FnMut(VerifyEvent) -> bool,
) -> Result<()> {
    let tok = Engine::tokenizer(model);
    let mut len = DraftLength::default();
    while !out.eos && out.ids.len() < max_tokens {
        let room = max_tokens - out.ids.len();
        // The last committed token is pending in the full cache: proposals follow it.
        let p = match drafter.as_deref_mut() {
            Some(d) if !out.ids.is_empty() => {
                Some(d.draft(&out.ids, DraftRoom::new(&len, room), &mut out.spec))
            }
            _ => None,
        };
        let t = Instant::now();
        let drafts = p.as_ref().map_or(&[][..], |p| &p.ids[..]);
        let (mut commit, agreed) = verify_drafts(model, f, drafts, out.ids.len())?;
        if let Some(p) = &p {
            out.spec.verify_ms += ms(t);
            out.spec.record(p, agreed, &mut len);
        }
        commit.truncate(room);
        if commit.ids.is_empty() {
            break;
        }
        if commit.end_at_eos(tok) {
            out.eos = true;
        }
        out.commit(&commit);
        if !on_event(VerifyEvent::Commit { ids: commit.ids }) {
            out.cancelled = true;
            break;
        }
    }
    out.spec.draft_len = len.current;
    Ok(())
}

/// One decode step on `cache`: feeds `id` at the next position, returns the logits.
fn step<E: Engine>(model: &E, cache: &mut E::Cache, id: u32) -> Result<Vec<f32>> {
    let pos = model.cache_len(cache);
    model
        .pass(&[id], &[pos], cache, false)?
        .pop()
        .ok_or_else(|| EngineError::Internal("a pass returned no logits".into()))
}

/// Checks `drafts` (the answer's tokens from index `start` on) against the full cache:
/// returns the committed tokens (the agreeing drafts, then the full cache's own token at
/// the first disagreement or after the last draft) and how many drafts agreed. The last
/// committed token is left pending.
fn verify_drafts<E: Engine>(
    model: &E,
    f: &mut Full<E::Cache>,
    drafts: &[u32],
    start: usize,
) -> Result<(Committed, usize)> {
    let mut committed = Committed::default();
    let mut i = 0;
    loop {
        let pending = f.pending.take();
        let mut feed: Vec<u32> = pending.into_iter().collect();
        let take = (drafts.len() - i).min(MAX_VERIFY_ROWS - feed.len());
        feed.extend(&drafts[i..i + take]);
        let base = model.cache_len(&f.cache);
        // preds[j]: the full cache's token where drafts[i + j] stands (j <= take), the
        // answer's token at index start + i + j.
        let mut preds: Vec<u32> = f.next.take().into_iter().collect();
        // The logprobs of each pred, where asked (the first's kept from its own row).
        let mut evidence: Vec<TokenLogprobs> = f.next_logprobs.take().into_iter().collect();
        if !feed.is_empty() {
            let first = start + i + preds.len();
            let rows = model.rows(&mut f.cache, &feed)?;
            for (j, r) in rows.iter().enumerate() {
                let id = f.pick.sample_at(r, first + j);
                preds.push(id);
                evidence.extend(f.logprobs.map(|k| TokenLogprobs::of(r, id, k)));
            }
        }
        if preds.len() != take + 1 {
            return Err(EngineError::Internal(
                "verification lost track of the full cache".into(),
            ));
        }
        let agree = (0..take).take_while(|&j| drafts[i + j] == preds[j]).count();
        committed.ids.extend(&drafts[i..i + agree]);
        let mut evidence = evidence.into_iter();
        committed.logprobs.extend(evidence.by_ref().take(agree));
        let t_logprobs = evidence.next();
        // Rows after a disagreement followed a wrong token: drop them.
        model.truncate_cache(&mut f.cache, base + usize::from(pending.is_some()) + agree);
        let t = preds[agree];
        i += agree;
        if agree < take || i == drafts.len() {
            committed.ids.push(t);
            committed.logprobs.extend(t_logprobs);
            f.pending = Some(t);
            return Ok((committed, i));
        }
        f.next = Some(t);
        f.next_logprobs = t_logprobs;
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verify_modes_read_back_what_they_write() {
        for m in [
            VerifyMode::FromFull,
            VerifyMode::DraftEvery(1),
            VerifyMode::DraftEvery(15),
        ] {
            assert_eq!(m.to_string().parse::<VerifyMode>(), Ok(m));
        }
        for bad in [
            "draft-every-0",
            "draft-every-16",
            "draft-every-",
            "fast",
            "",
        ] {
            let Err(e) = bad.parse::<VerifyMode>() else {
                panic!("`{bad}` parsed");
            };
            assert!(e.contains("draft-every-N") && e.contains(bad), "{e}");
        }
    }
}
