//! Speculative decoding (Leviathan et al., 2023): a drafter proposes a few tokens (prompt
//! lookup, copying what followed the answer's last tokens where they occur in the prompt, or
//! a smaller model of the same vocabulary, greedily over its own cache of the prompt), the
//! target checks them all in one forward over its cache, keeps the agreeing prefix and adds its
//! own token after it. Greedy: every kept token is the target's greedy token, so the output
//! equals [`Generate::decode_watched`](crate::prelude::Generate::decode_watched) over the same cache, token for token. Sampled: the target
//! draws its own token at each drafted position with the seeded sampler, whose draw for an
//! answer's `i`-th token depends only on the seed, `i` and the logits
//! ([`Sampler::sample_at`]), and keeps a draft where the two agree: the output is again
//! `decode_watched`'s, token for token, for the same seed. (A draft is kept with the target's
//! probability of it, as under Leviathan et al.'s rule for a certain draft; a model drafter
//! samples with the same seed, so where its distribution is close to the target's its draws
//! coincide.)
//!
//! Exactness rests on [`Model::forward_decode_path`]: the rows of one checking pass are
//! computed bit-identically to one-token decode steps (passes stay under
//! [`MAX_VERIFY_ROWS`](crate::model::MAX_VERIFY_ROWS) rows), so the target's logits, and the
//! top-2 gaps the fidelity guard watches, are the ones plain decoding would have computed.

use crate::decode::draft::{top_probability, DraftLength, SpecDecodeStats, MIN_DRAFT_PROB};
use crate::decode::generate::{Chosen, Emit, GenerateParams, Generation, Pick, Prefilled};
use crate::decode::ms;
use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::model::Model;
use crate::model::MAX_VERIFY_ROWS;
use crate::sampling::{argmax, Sampler, SamplingParams};
use std::collections::VecDeque;
use std::time::Instant;

/// How a drafter's cache of the prompt comes to be, when it is built only once drafting
/// starts (after the first token is out, so it never delays it).
pub type DraftBuild<'a> = Box<dyn FnOnce() -> Result<(KvCache, Vec<f32>)> + 'a>;

/// Prompt lookup (Saxena, 2023; llama.cpp's `--lookup`): the tokens that followed the latest
/// earlier occurrence of the answer's last `n` tokens in the prompt or the answer so far, for
/// the longest `n` in `min_n..=max_n` that occurs. A RAG answer copies names, dates and
/// phrases from its passages, and such a draft costs no model pass.
///
/// How many tokens it proposes depends on `n` ([`PromptLookup::draft_len`]): a long match is a
/// copy under way, and copies go on. Over the 20 HotpotQA answers of
/// `scripts/spec_decode_bench.py`, from a match of 12+ tokens the next 16 tokens agreed with
/// the target 40% of the time (mean 10 agreeing), from a match of 2 in 7% (mean 3). A single
/// token is matched last, for one draft: a checking pass of 2 rows costs about one of 1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptLookup {
    context: Vec<u32>,
    pub min_n: usize,
    pub max_n: usize,
}

impl PromptLookup {
    /// Shortest n-gram matched by default.
    pub const MIN_N: usize = 1;
    /// Longest n-gram tried first by default.
    pub const MAX_N: usize = 16;
    /// Matches of at least this many tokens propose [`PromptLookup::LONG_DRAFT`] tokens.
    pub const LONG_MATCH: usize = 8;
    /// Drafts after a long match (a checking pass of 8 rows: one register tile).
    pub const LONG_DRAFT: usize = 7;
    /// Drafts after a match of 2 to `LONG_MATCH - 1` tokens.
    pub const SHORT_DRAFT: usize = 3;

    /// A lookup over `context` (the prompt's token ids).
    pub fn new(context: Vec<u32>) -> Self {
        Self {
            context,
            min_n: Self::MIN_N,
            max_n: Self::MAX_N,
        }
    }

    /// This lookup matching at least `n` tokens (a drafting model proposes where fewer match).
    pub fn with_min_n(mut self, n: usize) -> Self {
        self.min_n = n.max(1);
        self
    }

    /// How many tokens to propose after a match of `n` tokens. Chosen on the answers above
    /// with the measured cost of a checking pass by its rows (`examples/check_rows`); the
    /// neighbouring choices (6 or 8 after a long match, a long match from 6 or 10) came within
    /// 1% of the time per token.
    pub fn draft_len(n: usize) -> usize {
        match n {
            0 => 0,
            1 => 1,
            n if n < Self::LONG_MATCH => Self::SHORT_DRAFT,
            _ => Self::LONG_DRAFT,
        }
    }

    /// Up to `k` tokens (fewer as [`PromptLookup::draft_len`] says) after the latest earlier
    /// occurrence of the longest tail of the prompt followed by `committed` (none found: none).
    pub fn propose(&self, committed: &[u32], k: usize) -> Vec<u32> {
        self.propose_match(committed, k).0
    }

    /// [`PromptLookup::propose`] with the length of the match it followed (0: none).
    pub fn propose_match(&self, committed: &[u32], k: usize) -> (Vec<u32>, usize) {
        let len = self.context.len() + committed.len();
        let at = |i: usize| {
            if i < self.context.len() {
                self.context[i]
            } else {
                committed[i - self.context.len()]
            }
        };
        if k == 0 {
            return (Vec::new(), 0);
        }
        for n in (self.min_n.max(1)..=self.max_n).rev() {
            if n >= len {
                continue;
            }
            let tail = len - n;
            // Latest start `i < tail` whose n tokens equal the last n (the tail itself is not
            // a match: nothing follows it yet).
            let found = (0..tail)
                .rev()
                .find(|&i| (0..n).all(|j| at(i + j) == at(tail + j)));
            if let Some(i) = found {
                let take = k.min(Self::draft_len(n));
                return ((i + n..len).take(take).map(at).collect(), n);
            }
        }
        (Vec::new(), 0)
    }
}

/// Whether a prompt lookup draft is worth its rows, from what this answer's own checking
/// passes cost and how often its lookup drafts of each kind were kept.
///
/// A drafted token costs a row of the checking pass whether or not it is kept, and saves a
/// step of the target only if it and every draft before it are kept. Over a short prompt an
/// extra row costs little next to the step (the weights dominate, and a pass reads them once
/// for all its rows), so any draft pays. Over a long one each row computes its scores over
/// every position: at 32k tokens of the 1.5B target on 2 cores an extra row costs ~0.3 of a
/// step, and a single token matched in 32k tokens of prompt predicts the next much less often
/// than that, so plain prompt lookup decoded *slower* than no drafting there (1.07-1.30x).
///
/// The gate keeps the first `j` tokens of a proposal, where `j` counts the positions `i`
/// whose chance of being kept, `p^i` (each draft kept with probability `p`, the answer's
/// measured rate for drafts after a match of that length), is above the measured cost of a
/// row over a step. The costs are the fastest passes seen for each row count (other work on
/// the cores only ever slows a pass, so a slow outlier cannot switch drafting off; noise
/// errs towards drafting, lookup's old behaviour). Until both are measured (the first round
/// is a plain step) lookup drafts as it always did. It changes which tokens are drafted,
/// never the answer.
#[derive(Debug, Clone, Default)]
pub(crate) struct LookupGate {
    /// The fastest pass seen for each row count (index: rows), ms.
    fastest: [Option<f64>; MAX_VERIFY_ROWS + 1],
    /// Per kind of match (1 token, 2-7, 8 and more): drafts kept, and rounds that rejected one.
    kept: [usize; 3],
    rejected: [usize; 3],
}

impl LookupGate {
    fn class(n: usize) -> usize {
        match n {
            0 | 1 => 0,
            n if n < PromptLookup::LONG_MATCH => 1,
            _ => 2,
        }
    }

    /// A checking pass of `rows` rows took `ms`.
    pub(crate) fn passed(&mut self, rows: usize, ms: f64) {
        if let Some(f) = self.fastest.get_mut(rows.max(1)) {
            *f = Some(f.map_or(ms, |f| f.min(ms)));
        }
    }

    /// A plain step's cost and the least that a row past the first was seen to add, ms.
    fn costs(&self) -> (Option<f64>, Option<f64>) {
        let step = self.fastest[1];
        let row = step.and_then(|step| {
            (2..self.fastest.len())
                .filter_map(|r| Some((self.fastest[r]? - step).max(0.0) / (r - 1) as f64))
                .min_by(f64::total_cmp)
        });
        (step, row)
    }

    /// `agree` of a lookup proposal of `drafted` tokens after a match of `n` were kept.
    pub(crate) fn judged(&mut self, n: usize, drafted: usize, agree: usize) {
        let c = Self::class(n);
        self.kept[c] += agree;
        self.rejected[c] += usize::from(agree < drafted);
    }

    /// How many of `k` tokens proposed after a match of `n` are worth checking.
    pub(crate) fn keep(&self, n: usize, k: usize) -> usize {
        let (step, row) = self.costs();
        let Some(step) = step else {
            // The first round measures a plain step.
            return 0;
        };
        let Some(row) = row else {
            return k;
        };
        let c = Self::class(n);
        // Kept over kept-or-rejected, with one of each assumed (p = 0.5 before any data).
        let p = (self.kept[c] + 1) as f64 / (self.kept[c] + self.rejected[c] + 2) as f64;
        let cost = row / step.max(f64::MIN_POSITIVE);
        let mut chance = 1.0;
        (0..k)
            .take_while(|_| {
                chance *= p;
                chance > cost
            })
            .count()
    }
}

/// How many tokens a round may draft from each source. A lookup draft costs no model pass,
/// only rows of the checking pass (on 2 cores 2, 4 and 8 rows cost 1.0, 1.27 and 1.9x one),
/// so its length follows its match ([`PromptLookup::draft_len`]), cut where the answer's
/// [`LookupGate`] finds the rows cost more than they save; the model's length adapts
/// to its acceptance ([`DraftLength`]), each of its drafts costing a step of the drafting
/// model.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DraftRoom<'g> {
    pub(crate) lookup: usize,
    pub(crate) model: usize,
    /// Decides how much of a lookup proposal to check (none: all of it).
    pub(crate) gate: Option<&'g LookupGate>,
}

/// Where a round's drafts came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Lookup,
    Model,
}

/// A drafting model's side: the model, its cache of the prompt (and of the tokens fed since),
/// and the logits after the cache's last row.
struct ModelDraft<'a> {
    model: &'a Model,
    build: Option<DraftBuild<'a>>,
    cache: KvCache,
    logits: Vec<f32>,
    /// Rows of the cache that hold the prompt.
    prompt_len: usize,
    /// The tokens fed after the prompt (committed ones, then proposals).
    fed: Vec<u32>,
    /// Committed tokens not yet fed.
    unfed: Vec<u32>,
    /// Proposing stops at a token the model gives less probability than this.
    min_prob: f32,
    /// Sampled decoding: the model samples its proposals with the target's settings and seed
    /// (so its draws coincide with the target's where their distributions are close).
    sampler: Option<Sampler>,
}

/// One round's proposals: the tokens and where they came from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Proposal {
    pub(crate) ids: Vec<u32>,
    source: Source,
    /// A lookup proposal's match length (0 for the model's).
    matched: usize,
}

/// What proposes tokens for the target to check: prompt lookup, a smaller model of the same
/// vocabulary over its own cache of the prompt, or both (lookup first: a match costs nothing).
pub struct Drafter<'a> {
    model: Option<ModelDraft<'a>>,
    lookup: Option<PromptLookup>,
}

impl std::fmt::Debug for Drafter<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Drafter");
        if let Some(m) = &self.model {
            d.field("model", &m.model.fingerprint())
                .field("built", &m.build.is_none())
                .field("cache_rows", &m.cache.len());
        }
        d.field("lookup", &self.lookup.is_some()).finish()
    }
}

impl<'a> Drafter<'a> {
    /// A drafter over `cache` (the prompt, as the drafter sees it) and its last logits.
    pub fn new(model: &'a Model, cache: KvCache, logits: Vec<f32>) -> Self {
        Self {
            model: Some(ModelDraft {
                model,
                build: None,
                prompt_len: cache.len(),
                cache,
                logits,
                fed: Vec::new(),
                unfed: Vec::new(),
                min_prob: MIN_DRAFT_PROB,
                sampler: None,
            }),
            lookup: None,
        }
    }

    /// A drafter whose cache `build` makes at the first proposal.
    pub fn deferred(model: &'a Model, build: DraftBuild<'a>) -> Self {
        let mut d = Self::new(model, model.new_cache(), Vec::new());
        if let Some(m) = &mut d.model {
            m.build = Some(build);
        }
        d
    }

    /// A drafter with no model: prompt lookup only.
    pub fn lookup_only(lookup: PromptLookup) -> Self {
        Self {
            model: None,
            lookup: Some(lookup),
        }
    }

    /// This drafter trying `lookup` first, its model where the lookup finds no match of 2
    /// tokens or more (a single shared token predicts less than the model does).
    pub fn with_lookup(mut self, lookup: PromptLookup) -> Self {
        self.lookup = Some(lookup.with_min_n(2));
        self
    }

    /// The drafting model stops at a token it gives less probability than `p` (default
    /// [`MIN_DRAFT_PROB`]; 0: never).
    pub fn with_min_prob(mut self, p: f32) -> Self {
        if let Some(m) = &mut self.model {
            m.min_prob = p;
        }
        self
    }

    /// The drafting model's vocabulary size (none without a model).
    fn vocab_size(&self) -> Option<usize> {
        self.model
            .as_ref()
            .map(|m| m.model.tokenizer().vocab_size())
    }

    /// The drafting model samples its proposals as `params` says (temperature 0: greedy).
    fn sample_with(&mut self, params: SamplingParams) {
        if let Some(m) = &mut self.model {
            m.sampler = (params.temperature > 0.0).then(|| Sampler::new(params));
        }
    }

    /// Proposals after the `committed` tokens: up to `k.lookup` from prompt lookup, else up
    /// to `k.model` from the model (none asked: nothing is built or fed). A model that fails
    /// is dropped, its error kept in `stats` (drafting only speeds decoding up).
    pub(crate) fn draft(
        &mut self,
        committed: &[u32],
        k: DraftRoom,
        stats: &mut SpecDecodeStats,
    ) -> Proposal {
        let t = Instant::now();
        let p = self.propose(committed, k).unwrap_or_else(|e| {
            stats.drafter_error = Some(e.to_string());
            self.model = None;
            self.propose(committed, k).unwrap_or(Proposal {
                ids: Vec::new(),
                source: Source::Model,
                matched: 0,
            })
        });
        stats.draft_ms += ms(t);
        p
    }

    fn propose(&mut self, committed: &[u32], k: DraftRoom) -> Result<Proposal> {
        let none = |source| Proposal {
            ids: Vec::new(),
            source,
            matched: 0,
        };
        if k.lookup > 0 {
            if let Some(l) = &self.lookup {
                let (mut ids, matched) = l.propose_match(committed, k.lookup);
                if let Some(gate) = k.gate {
                    ids.truncate(gate.keep(matched, ids.len()));
                }
                if !ids.is_empty() {
                    return Ok(Proposal {
                        ids,
                        source: Source::Lookup,
                        matched,
                    });
                }
            }
        }
        match &mut self.model {
            Some(m) if k.model > 0 => {
                let ids = m.draft(committed, k.model)?;
                Ok(Proposal {
                    ids,
                    source: Source::Model,
                    matched: 0,
                })
            }
            _ => Ok(none(Source::Model)),
        }
    }
}

impl ModelDraft<'_> {
    /// Builds the cache of a deferred drafter (nothing when built already).
    fn ensure_built(&mut self) -> Result<()> {
        if let Some(build) = self.build.take() {
            let (cache, logits) = build()?;
            self.prompt_len = cache.len();
            self.cache = cache;
            self.logits = logits;
        }
        Ok(())
    }

    /// Feeds the committed tokens not yet fed, then proposes up to `k` tokens (greedy, or
    /// sampled at their indices in the answer), stopping where the model's top probability
    /// is under `min_prob`. The proposals but the last are fed too ([`ModelDraft::settle`]
    /// trims what was not committed).
    fn propose(&mut self, k: usize) -> Result<Vec<u32>> {
        let mut drafts = Vec::with_capacity(k);
        let mut feed = std::mem::take(&mut self.unfed);
        while drafts.len() < k {
            if !feed.is_empty() {
                let start = self.cache.len();
                let positions: Vec<usize> = (start..start + feed.len()).collect();
                let out = self
                    .model
                    .forward(&feed, &positions, &mut self.cache, false)?;
                self.logits = self.model.last_logits(&out)?;
                self.fed.append(&mut feed);
            }
            if self.min_prob > 0.0 && top_probability(&self.logits) < self.min_prob {
                break;
            }
            // Every token fed after the prompt is the answer's: the next is at that index.
            let d = match &self.sampler {
                Some(s) => s.sample_at(&self.logits, self.fed.len()),
                None => argmax(&self.logits),
            };
            drafts.push(d);
            feed = vec![d];
        }
        Ok(drafts)
    }

    fn draft(&mut self, committed: &[u32], k: usize) -> Result<Vec<u32>> {
        self.ensure_built()?;
        self.settle(committed);
        self.propose(k)
    }

    /// Brings the cache back to the prompt and the longest prefix of `committed` it holds;
    /// the rest of `committed` is fed at the next proposal.
    fn settle(&mut self, committed: &[u32]) {
        let keep = self
            .fed
            .iter()
            .zip(committed)
            .take_while(|(a, b)| a == b)
            .count();
        self.fed.truncate(keep);
        self.cache.truncate(self.prompt_len + keep);
        self.unfed = committed[keep..].to_vec();
    }
}

impl DraftRoom<'_> {
    /// Room for a round with `room` tokens left to generate (the round's first token is the
    /// target's, so drafts get one less).
    pub(crate) fn new(len: &DraftLength, room: usize) -> Self {
        Self {
            lookup: PromptLookup::LONG_DRAFT.min(room.saturating_sub(1)),
            model: len.current.min(room.saturating_sub(1)),
            gate: None,
        }
    }
}

impl SpecDecodeStats {
    /// Counts one checking pass over `p`, of which `agree` were kept; the model's rounds
    /// adapt its draft length `len`.
    pub(crate) fn record(&mut self, p: &Proposal, agree: usize, len: &mut DraftLength) {
        self.rounds += 1;
        self.drafted += p.ids.len();
        self.accepted += agree;
        match p.source {
            Source::Lookup => {
                self.lookup_drafted += p.ids.len();
                self.lookup_accepted += agree;
            }
            Source::Model => len.update(p.ids.len(), agree),
        }
    }
}

/// Speculative decoding: a drafter proposes, the model checks in one pass.
pub trait Speculate {
    /// [`Generate::decode_watched`](crate::prelude::Generate::decode_watched) with `drafter` proposing tokens that this model checks in one
    /// pass. Greedy: the same tokens, gaps, watch calls and text, in fewer target passes when
    /// the drafter guesses well. Sampled: the same tokens too for the same seed (see the
    /// module documentation).
    fn decode_speculative(
        &self,
        from: Prefilled<'_>,
        drafter: &mut Drafter<'_>,
        params: &GenerateParams,
        on_text: &mut dyn FnMut(&str) -> bool,
        watch: &mut dyn FnMut(&[u32], Pick) -> bool,
    ) -> Result<(Generation, bool, SpecDecodeStats)>;
}

impl Speculate for Model {
    fn decode_speculative(
        &self,
        from: Prefilled<'_>,
        drafter: &mut Drafter<'_>,
        params: &GenerateParams,
        on_text: &mut dyn FnMut(&str) -> bool,
        watch: &mut dyn FnMut(&[u32], Pick) -> bool,
    ) -> Result<(Generation, bool, SpecDecodeStats)> {
        let Prefilled { cache, logits } = from;
        let vocab = self.tokenizer().vocab_size();
        if drafter.vocab_size().is_some_and(|v| v != vocab) {
            return Err(EngineError::InvalidInput(
                "the drafter's vocabulary differs from the target's".into(),
            ));
        }
        let sampler = Sampler::new(params.sampling);
        drafter.sample_with(params.sampling);
        let mut emit = Emit::new(self.tokenizer(), params, on_text, watch);
        let mut stats = SpecDecodeStats::default();
        let mut len = DraftLength::default();
        let mut gate = LookupGate::default();
        // The answer's rows and a checking pass's beyond it.
        cache.reserve(params.max_tokens + MAX_VERIFY_ROWS);
        // Checking passes go through this thread's batcher, if the server installed one.
        let _seat = super::batch::seat();
        let t0 = Instant::now();
        // Tokens the target has chosen but not yet handed out, each with its row's evidence.
        let k = params.logprobs;
        let mut ready: VecDeque<Chosen> =
            VecDeque::from([Chosen::from_row(sampler.sample_at(&logits, 0), &logits, k)]);
        while let Some(c) = ready.pop_front() {
            let next = c.id;
            if emit.take(c) {
                break;
            }
            if !ready.is_empty() {
                continue;
            }
            // One round: `next` and the drafts after it, checked in one pass.
            let mut room = DraftRoom::new(&len, params.max_tokens - emit.len());
            if drafter.model.is_none() {
                room.gate = Some(&gate);
            }
            let p = drafter.draft(emit.ids(), room, &mut stats);
            let t = Instant::now();
            let mut feed = vec![next];
            feed.extend(&p.ids);
            let base = cache.len();
            let rows = super::batch::rows(self, &feed, cache)?;
            // rows[j] comes before the answer's token at index `emit.len() + j`: the target's
            // own choice there is what plain decoding would take; drafts stand where it agrees.
            let at = emit.len();
            let chosen: Vec<u32> = rows
                .iter()
                .enumerate()
                .map(|(j, r)| sampler.sample_at(r, at + j))
                .collect();
            let agree = p
                .ids
                .iter()
                .zip(&chosen)
                .take_while(|(d, c)| d == c)
                .count();
            let ids = chosen[..=agree].to_vec();
            // Rows after a disagreement followed a wrong token.
            cache.truncate(base + 1 + agree);
            ready.extend(
                ids.into_iter()
                    .zip(&rows)
                    .map(|(id, r)| Chosen::from_row(id, r, k)),
            );
            let pass_ms = ms(t);
            gate.passed(feed.len(), pass_ms);
            if p.source == Source::Lookup {
                gate.judged(p.matched, p.ids.len(), agree);
            }
            stats.verify_ms += pass_ms;
            stats.record(&p, agree, &mut len);
        }
        stats.draft_len = len.current;
        let steps = emit.len().saturating_sub(1);
        let (g, watched) = emit.finish(ms(t0), steps);
        Ok((g, watched, stats))
    }
}

#[cfg(test)]
mod tests {
    use super::{DraftLength, LookupGate, PromptLookup};

    #[test]
    fn prompt_lookup_copies_what_followed_the_latest_longest_match() {
        // Prompt: 1 2 3 4 5 | 9 2 3 7 8 ; the answer so far ends in 2 3.
        let l = PromptLookup::new(vec![1, 2, 3, 4, 5, 9, 2, 3, 7, 8]);
        assert_eq!(
            l.propose(&[2, 3], 3),
            vec![7, 8, 2],
            "the latest `2 3` wins"
        );
        // `1 2 3` is longer than the later `2 3`: the longest n-gram wins.
        assert_eq!(l.propose(&[1, 2, 3], 2), vec![4, 5]);
        // What follows may run into the answer itself; a short match proposes 3.
        assert_eq!(l.propose(&[9, 2], 6), vec![3, 7, 8]);
        // One shared token proposes one; below a lookup's shortest n-gram, none.
        assert_eq!(l.propose(&[6, 5], 3), vec![9]);
        assert!(l.clone().with_min_n(2).propose(&[6, 5], 3).is_empty());
        assert!(l.propose(&[42, 43], 3).is_empty());
        assert!(l.propose(&[2, 3], 0).is_empty());
        // Repeats inside the answer count too.
        let l = PromptLookup::new(vec![]);
        assert_eq!(l.propose(&[5, 6, 1, 5, 6], 2), vec![1, 5]);
        assert!(l.propose(&[5], 2).is_empty());
        assert!(l.propose(&[], 2).is_empty());
        // A long match is a copy under way: it proposes more, up to the end of the answer
        // and within `k`.
        let passage: Vec<u32> = (100..120).collect();
        let l = PromptLookup::new(passage.clone());
        let copied = &passage[..PromptLookup::LONG_MATCH];
        let want = &passage[PromptLookup::LONG_MATCH..][..PromptLookup::LONG_DRAFT];
        assert_eq!(l.propose(copied, 16), want);
        assert_eq!(l.propose(copied, 2), &want[..2]);
        assert_eq!(
            l.propose(&copied[..PromptLookup::LONG_MATCH - 1], 16).len(),
            PromptLookup::SHORT_DRAFT
        );
    }

    /// The gate holds lookup back for the first round (it measures a plain step), then lets a
    /// proposal through as far as each draft's chance of being kept beats a row's cost: over
    /// a short prompt (cheap rows) single-token matches draft, over a long one (rows at ~0.3
    /// of a step) they stop once they are seldom kept, while long matches that keep being
    /// copied go on drafting.
    #[test]
    fn the_lookup_gate_checks_only_the_drafts_that_pay_for_their_rows() {
        let mut g = LookupGate::default();
        assert_eq!(g.keep(1, 1), 0, "the first round is a plain step");
        g.passed(1, 100.0);
        assert_eq!(g.keep(9, 7), 7, "no row cost measured yet: everything");
        // Cheap rows: a 2-row pass costs 10% more than a step.
        let mut cheap = g.clone();
        cheap.passed(2, 110.0);
        assert_eq!(cheap.keep(1, 1), 1);
        assert_eq!(
            cheap.keep(9, 7),
            3,
            "0.5, 0.25, 0.125 beat 0.1; 0.0625 does not"
        );
        // Expensive rows: each costs 0.31 of a step.
        g.passed(3, 162.0);
        for _ in 0..5 {
            g.judged(1, 1, 0);
        }
        for _ in 0..3 {
            g.judged(9, 7, 7);
        }
        assert_eq!(g.keep(1, 1), 0, "kept 0 of 5: p = 1/7");
        assert_eq!(
            g.keep(3, 3),
            1,
            "no data on medium matches: p = 0.5 beats 0.31 once"
        );
        assert_eq!(g.keep(9, 7), 7, "long matches kept 21 of 21");
        // Passes slowed by other work change nothing: the fastest ones are the costs.
        g.passed(1, 400.0);
        g.passed(2, 900.0);
        assert_eq!(g.keep(1, 1), 0);
        assert_eq!(g.keep(3, 3), 1);
        // A faster pass of 2 rows shows a row is cheaper than thought: 0.25 beats 0.2.
        g.passed(2, 120.0);
        assert_eq!(g.keep(3, 3), 2);
    }

    #[test]
    fn the_draft_length_grows_while_accepted_and_shrinks_after_a_miss() {
        let mut l = DraftLength {
            current: 4,
            min: 1,
            max: 8,
        };
        l.update(4, 4);
        assert_eq!(l.current, 6);
        l.update(6, 6);
        l.update(8, 8);
        assert_eq!(l.current, 8, "capped at max");
        l.update(8, 3);
        assert_eq!(l.current, 7);
        for _ in 0..10 {
            l.update(2, 0);
        }
        assert_eq!(l.current, 1, "never below min");
        l.update(0, 0);
        assert_eq!(l.current, 1);
    }

    #[test]
    fn the_top_probability_is_the_softmax_maximum() {
        let p = super::top_probability(&[0.0, 0.0, 0.0, 0.0]);
        assert!((p - 0.25).abs() < 1e-6, "{p}");
        let p = super::top_probability(&[10.0, 0.0]);
        assert!((p - 1.0 / (1.0 + (-10f32).exp())).abs() < 1e-6, "{p}");
        assert_eq!(super::top_probability(&[]), 0.0);
    }
}
