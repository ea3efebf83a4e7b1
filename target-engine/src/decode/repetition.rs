//! A decode that has fallen into a loop: the last `n` generated tokens already occurred, as a
//! contiguous run, earlier in the same generation.
//!
//! Reused KV sometimes sends a small model into the degenerate repetition full recompute does
//! not produce (issue 39: the README's demo question answered with one off-topic sentence
//! twice). A long repeated run is the cheap, exact signal of it: the guard watches for one and
//! hands the request to the full cache when it fires. Short repeats ("the document states
//! that") are ordinary text, so `n` is long.

/// Default length of a repeated run that counts as a loop, in tokens.
pub const DEFAULT_LOOP_TOKENS: usize = 12;

/// Fires when the last `n` tokens of a generation already occurred earlier in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopDetector {
    /// Length of the repeated run, in tokens (at least 1).
    pub n: usize,
}

impl Default for LoopDetector {
    fn default() -> Self {
        Self {
            n: DEFAULT_LOOP_TOKENS,
        }
    }
}

impl LoopDetector {
    /// Whether `ids` (a generation so far) ends with a run of `n` tokens that also occurs
    /// earlier in it (overlapping occurrences count: `a a a …` is a loop).
    pub fn fires(&self, ids: &[u32]) -> bool {
        let n = self.n.max(1);
        if ids.len() <= n {
            return false;
        }
        let tail = &ids[ids.len() - n..];
        ids[..ids.len() - 1].windows(n).any(|w| w == tail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_run_fires_and_ordinary_text_does_not() {
        let d = LoopDetector { n: 3 };
        assert!(!d.fires(&[]));
        assert!(!d.fires(&[1, 2, 3]));
        assert!(!d.fires(&[1, 2, 3, 4, 5, 6, 1, 2]), "a shorter repeat");
        assert!(d.fires(&[1, 2, 3, 4, 5, 1, 2, 3]));
        assert!(d.fires(&[7, 7, 7, 7]), "overlapping occurrences");
        assert!(!d.fires(&[7, 7, 7]), "the run itself is not a repeat");
        assert!(!d.fires(&[1, 2, 3, 9, 1, 2, 4]), "a different last token");
    }

    #[test]
    fn it_fires_at_the_first_token_that_completes_the_repeat() {
        let d = LoopDetector { n: 4 };
        let sentence = [10, 11, 12, 13, 14, 15];
        let ids: Vec<u32> = sentence.iter().chain(&sentence).copied().collect();
        let first = (1..=ids.len()).find(|&k| d.fires(&ids[..k]));
        assert_eq!(first, Some(sentence.len() + 4));
    }
}
