//! Speculative decoding (Leviathan et al., 2023) with a smaller model of the same vocabulary
//! as the drafter: the drafter proposes a few tokens greedily over its own cache of the prompt,
//! the target checks them all in one forward over its cache, keeps the agreeing prefix and
//! adds its own token after it. Greedy only: every kept token is the target's greedy token, so
//! the output equals [`Model::decode_watched`] over the same cache, token for token.
//!
//! Exactness rests on [`Model::forward_decode_path`]: the rows of one checking pass are
//! computed bit-identically to one-token decode steps (passes stay under
//! [`MAX_VERIFY_ROWS`](crate::verify::MAX_VERIFY_ROWS) rows), so the target's logits, and the
//! top-2 gaps the fidelity guard watches, are the ones plain decoding would have computed.

use crate::error::{EngineError, Result};
use crate::generate::{top2_gap, Emit, GenerateParams, Generation};
use crate::kv::KvCache;
use crate::model::Model;
use crate::sampling::argmax;
use crate::verify::MAX_VERIFY_ROWS;
use std::collections::VecDeque;
use std::time::Instant;

/// Longest draft one checking pass can take (the pass also feeds the token before it).
pub const MAX_DRAFT: usize = MAX_VERIFY_ROWS - 1;

/// The drafter stops proposing at a token it gives less probability than this (llama.cpp's
/// `--draft-p-min` default).
pub const MIN_DRAFT_PROB: f32 = 0.75;

/// The largest probability of the softmax of `logits` (0 for none).
pub fn top_probability(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return 0.0;
    }
    let sum: f32 = logits.iter().map(|&x| (x - max).exp()).sum();
    1.0 / sum
}

/// How a drafter's cache of the prompt comes to be, when it is built only once drafting
/// starts (after the first token is out, so it never delays it).
pub type DraftBuild<'a> = Box<dyn FnOnce() -> Result<(KvCache, Vec<f32>)> + 'a>;

/// The drafter's side: its model, its cache of the prompt (and of the tokens fed since),
/// and the logits after the cache's last row.
pub struct Drafter<'a> {
    pub model: &'a Model,
    build: Option<DraftBuild<'a>>,
    cache: KvCache,
    logits: Vec<f32>,
    /// Rows of the cache that hold the prompt.
    prompt_len: usize,
    /// The tokens fed after the prompt (committed ones, then proposals).
    fed: Vec<u32>,
    /// Committed tokens not yet fed.
    unfed: Vec<u32>,
}

impl std::fmt::Debug for Drafter<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Drafter")
            .field("model", &self.model.fingerprint())
            .field("built", &self.build.is_none())
            .field("cache_rows", &self.cache.len())
            .finish()
    }
}

impl<'a> Drafter<'a> {
    /// A drafter over `cache` (the prompt, as the drafter sees it) and its last logits.
    pub fn new(model: &'a Model, cache: KvCache, logits: Vec<f32>) -> Self {
        Self {
            model,
            build: None,
            prompt_len: cache.len(),
            cache,
            logits,
            fed: Vec::new(),
            unfed: Vec::new(),
        }
    }

    /// A drafter whose cache `build` makes at the first proposal.
    pub fn deferred(model: &'a Model, build: DraftBuild<'a>) -> Self {
        Self {
            build: Some(build),
            ..Self::new(model, model.new_cache(), Vec::new())
        }
    }

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

    /// Feeds the committed tokens not yet fed, then proposes `k` greedy tokens. The proposals
    /// but the last are fed too ([`Drafter::settle`] trims what was not committed).
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
            let d = argmax(&self.logits);
            drafts.push(d);
            feed = vec![d];
        }
        Ok(drafts)
    }

    /// `k` proposals after the `committed` tokens (none asked: nothing is built or fed).
    fn draft(&mut self, committed: &[u32], k: usize) -> Result<Vec<u32>> {
        if k == 0 {
            return Ok(Vec::new());
        }
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

/// The number of tokens drafted per round, adapted to the acceptance measured so far: it
/// grows by two after a round whose drafts were all accepted and shrinks by one after a miss,
/// within `min..=max`. The default keeps checking passes at 4 rows at most: on 2 cores a pass
/// of 4 rows costs 1.39x one decode step of Qwen-1.5B, of 5 rows 1.84x (the int8 kernels
/// unpack each weight group once per tile of up to 4 rows), and the 0.5B drafter's step 0.41x.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DraftLength {
    pub current: usize,
    pub min: usize,
    pub max: usize,
}

impl Default for DraftLength {
    fn default() -> Self {
        Self {
            current: 2,
            min: 1,
            max: 3,
        }
    }
}

impl DraftLength {
    /// After a round where `accepted` of `drafted` proposals agreed with the target.
    pub fn update(&mut self, drafted: usize, accepted: usize) {
        let max = self.max.clamp(1, MAX_DRAFT);
        let min = self.min.clamp(1, max);
        self.current = if drafted > 0 && accepted == drafted {
            self.current + 2
        } else {
            self.current.saturating_sub(1)
        }
        .clamp(min, max);
    }
}

/// What speculative decoding did for one answer.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SpecDecodeStats {
    /// Tokens the drafter proposed.
    pub drafted: usize,
    /// Proposals the target agreed with.
    pub accepted: usize,
    /// Checking passes of the target.
    pub rounds: usize,
    /// The draft length at the end (it adapts to the acceptance).
    pub draft_len: usize,
    /// Time spent drafting and checking (ms).
    pub draft_ms: f64,
    pub verify_ms: f64,
    /// Why drafting stopped early (the drafter's cache could not be built, or a draft step
    /// failed): decoding went on one token per pass, the output unchanged.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub drafter_error: Option<String>,
}

impl SpecDecodeStats {
    /// Accepted over drafted (0 when nothing was drafted).
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

impl Model {
    /// [`Model::decode_watched`] (greedy) with `drafter` proposing tokens that this model checks
    /// in one pass: the same tokens, gaps, watch calls and text, in fewer target passes when
    /// the drafter guesses well. Sampled decoding is refused (the rejection rule is not built).
    pub fn decode_speculative(
        &self,
        (cache, logits): (&mut KvCache, Vec<f32>),
        drafter: &mut Drafter<'_>,
        params: &GenerateParams,
        on_text: &mut dyn FnMut(&str) -> bool,
        watch: &mut dyn FnMut(&[u32], f32) -> bool,
    ) -> Result<(Generation, bool, SpecDecodeStats)> {
        if params.sampling.temperature > 0.0 {
            return Err(EngineError::InvalidInput(
                "speculative decoding is greedy only (temperature 0)".into(),
            ));
        }
        let vocab = self.tokenizer().vocab_size();
        if drafter.model.tokenizer().vocab_size() != vocab {
            return Err(EngineError::InvalidInput(
                "the drafter's vocabulary differs from the target's".into(),
            ));
        }
        let mut emit = Emit::new(self.tokenizer(), params, on_text, watch);
        let mut stats = SpecDecodeStats::default();
        let mut len = DraftLength::default();
        let t0 = Instant::now();
        // Tokens the target has chosen but not yet handed out, each with its gap.
        let mut ready: VecDeque<(u32, f32)> =
            VecDeque::from([(argmax(&logits), top2_gap(&logits))]);
        while let Some((next, gap)) = ready.pop_front() {
            if emit.take(next, gap) {
                break;
            }
            if !ready.is_empty() {
                continue;
            }
            // One round: `next` and up to `k` drafts after it, checked in one pass.
            let room = params.max_tokens - emit.len();
            let mut k = len.current.min(room.saturating_sub(1));
            if stats.drafter_error.is_some() {
                k = 0;
            }
            let t = Instant::now();
            let drafts = match drafter.draft(emit.ids(), k) {
                Ok(d) => d,
                Err(e) => {
                    // The drafter only speeds decoding up: without it, one token per pass.
                    stats.drafter_error = Some(e.to_string());
                    Vec::new()
                }
            };
            stats.draft_ms += ms(t);
            let t = Instant::now();
            let mut feed = vec![next];
            feed.extend(&drafts);
            let base = cache.len();
            let rows = self.rows_logits(cache, &feed)?;
            let agree = drafts
                .iter()
                .zip(&rows)
                .take_while(|(d, r)| **d == argmax(r))
                .count();
            // Rows after a disagreement followed a wrong token.
            cache.truncate(base + 1 + agree);
            for (j, row) in rows.iter().enumerate().take(agree + 1) {
                let id = if j < agree { drafts[j] } else { argmax(row) };
                ready.push_back((id, top2_gap(row)));
            }
            stats.verify_ms += ms(t);
            stats.rounds += 1;
            stats.drafted += drafts.len();
            stats.accepted += agree;
            len.update(drafts.len(), agree);
        }
        stats.draft_len = len.current;
        let steps = emit.len().saturating_sub(1);
        let (g, watched) = emit.finish(ms(t0), steps);
        Ok((g, watched, stats))
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::DraftLength;

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
