//! What every drafting strategy shares (speculative decoding's drafters, verification's and
//! the long-context views'): how long a draft may be, how the draft length adapts, and what a
//! drafted answer reports.

use crate::model::MAX_VERIFY_ROWS;

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
    /// Of `drafted` and `accepted`, those prompt lookup proposed (the rest came from the
    /// drafting model).
    #[serde(default)]
    pub lookup_drafted: usize,
    #[serde(default)]
    pub lookup_accepted: usize,
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
    /// Adds what `other` counted (a decode continued elsewhere, e.g. after an escalation).
    pub fn merge(&mut self, other: &SpecDecodeStats) {
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        self.lookup_drafted += other.lookup_drafted;
        self.lookup_accepted += other.lookup_accepted;
        self.rounds += other.rounds;
        self.draft_len = other.draft_len;
        self.draft_ms += other.draft_ms;
        self.verify_ms += other.verify_ms;
        if other.drafter_error.is_some() {
            self.drafter_error.clone_from(&other.drafter_error);
        }
    }
}
