//! The evidence an answer carries for each of its tokens: the token's log-probability under
//! the distribution it was chosen from, and the most likely tokens there (OpenAI's `logprobs`
//! and `top_logprobs`). Computed from the very logits row that chose the token, in whichever
//! pass chose it (a decode step, a speculative or verification pass), and only when asked.

/// Most alternatives a token may carry (OpenAI's limit for `top_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A token and its log-probability at one position.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Logprob {
    pub id: u32,
    pub logprob: f32,
}

/// The chosen token at one position of an answer and the `k` most likely tokens there, most
/// likely first (ties: the lower id first).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenLogprobs {
    pub chosen: Logprob,
    pub top: Vec<Logprob>,
}

impl TokenLogprobs {
    /// The token `id` chosen from `logits`, with the `k` most likely tokens (`k` is capped at
    /// [`MAX_TOP_LOGPROBS`] and at the vocabulary). Log-probabilities are the log-softmax of
    /// the row, summed in f64; a row with no finite logit gives `-inf` for every token.
    pub fn of(logits: &[f32], id: u32, k: usize) -> Self {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = if max.is_finite() {
            let sum: f64 = logits.iter().map(|&x| f64::from(x - max).exp()).sum();
            f64::from(max) + sum.ln()
        } else {
            f64::INFINITY
        };
        let at = |i: u32| Logprob {
            id: i,
            logprob: logits
                .get(i as usize)
                .map_or(f32::NEG_INFINITY, |&x| (f64::from(x) - lse) as f32),
        };
        Self {
            chosen: at(id),
            top: top_ids(logits, k.min(MAX_TOP_LOGPROBS))
                .into_iter()
                .map(at)
                .collect(),
        }
    }
}

/// The ids of the `k` largest logits, largest first (ties: the lower id first).
fn top_ids(logits: &[f32], k: usize) -> Vec<u32> {
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    if k == 0 {
        return Vec::new();
    }
    for (i, &x) in logits.iter().enumerate() {
        if best.len() == k && best.last().is_some_and(|&(y, _)| x <= y) {
            continue;
        }
        // After every kept logit that is at least as large (earlier ids win ties).
        let at = best.partition_point(|&(y, _)| y >= x);
        best.insert(at, (x, i as u32));
        best.truncate(k);
    }
    best.into_iter().map(|(_, i)| i).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_the_log_softmax_of_the_row_and_the_top_is_sorted() {
        let row = [1.0f32, 3.0, -2.0, 3.0, 0.5];
        let t = TokenLogprobs::of(&row, 1, 3);
        let sum: f64 = row.iter().map(|&x| f64::from(x).exp()).sum();
        let want = 3.0 - sum.ln();
        assert!((f64::from(t.chosen.logprob) - want).abs() < 1e-6);
        let ids: Vec<u32> = t.top.iter().map(|l| l.id).collect();
        assert_eq!(
            ids,
            vec![1, 3, 0],
            "largest first, the lower id first on a tie"
        );
        // Differences of logprobs are differences of logits: the top-2 gap survives.
        assert!((t.top[0].logprob - t.top[2].logprob - 2.0).abs() < 1e-6);
        let total: f64 = row
            .iter()
            .enumerate()
            .map(|(i, _)| f64::from(TokenLogprobs::of(&row, i as u32, 0).chosen.logprob).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6, "{total}");
    }

    #[test]
    fn the_top_is_capped_and_odd_rows_give_no_panic() {
        let row: Vec<f32> = (0..50).map(|i| i as f32).collect();
        assert_eq!(TokenLogprobs::of(&row, 0, 99).top.len(), MAX_TOP_LOGPROBS);
        assert_eq!(TokenLogprobs::of(&row, 0, 0).top, Vec::new());
        assert_eq!(TokenLogprobs::of(&[2.0], 0, 5).top.len(), 1);
        assert_eq!(TokenLogprobs::of(&[2.0], 0, 5).chosen.logprob, 0.0);
        let none = TokenLogprobs::of(&[], 3, 2);
        assert_eq!(none.chosen.logprob, f32::NEG_INFINITY);
        assert!(none.top.is_empty());
        let masked = TokenLogprobs::of(&[f32::NEG_INFINITY; 3], 1, 2);
        assert_eq!(masked.chosen.logprob, f32::NEG_INFINITY);
    }
}
