//! Selection in the speculator's token space (SpecCache §3): top-K, span segmentation on
//! min-max normalized importance (Eq. 3), coverage completion (Eq. 5-6), and the global budget.

/// Settings of the selection.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpanParams {
    /// Boundary where the relative change of normalized importance reaches this (τ_smooth).
    pub tau_smooth: f64,
    /// A span whose share of initially selected tokens reaches this is added whole (τ_cover).
    pub tau_cover: f64,
    /// Longest span.
    pub max_span: usize,
    /// Complete spans at all (`speccache`) or not (`speccache_nospan`).
    pub complete_spans: bool,
}

impl Default for SpanParams {
    fn default() -> Self {
        Self {
            tau_smooth: 0.4,
            tau_cover: 0.7,
            max_span: 16,
            complete_spans: true,
        }
    }
}

/// `(x - min) / (max - min)`; all zeros when every score is equal (Eq. 3).
pub fn min_max_normalize(scores: &[f32]) -> Vec<f64> {
    let min = scores.iter().copied().fold(f32::INFINITY, f32::min) as f64;
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    if scores.is_empty() || max - min <= 0.0 {
        return vec![0.0; scores.len()];
    }
    scores
        .iter()
        .map(|&s| (s as f64 - min) / (max - min))
        .collect()
}

/// Relative change `δ_i = |Ĩ_{i+1} − Ĩ_i| / Ĩ_i`. When `Ĩ_i = 0` the relative change is
/// undefined: we take 0 if `Ĩ_{i+1}` is 0 too (flat) and infinity otherwise (any rise from the
/// minimum is a boundary).
pub fn relative_change(cur: f64, next: f64) -> f64 {
    if cur == 0.0 {
        if next == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (next - cur).abs() / cur
    }
}

/// Spans `[start, end)` over tokens `0..n`: a new span starts where `δ ≥ τ_smooth`, where the
/// segment changes, or when a span reaches `max_span` tokens.
pub fn segment_spans(normalized: &[f64], segment: &[usize], p: &SpanParams) -> Vec<(usize, usize)> {
    let n = normalized.len();
    let mut spans = Vec::new();
    let mut start = 0;
    for i in 0..n {
        let end_here = i + 1 == n
            || segment[i + 1] != segment[i]
            || i + 1 - start >= p.max_span.max(1)
            || relative_change(normalized[i], normalized[i + 1]) >= p.tau_smooth;
        if end_here {
            spans.push((start, i + 1));
            start = i + 1;
        }
    }
    spans
}

/// The result of a selection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    /// Selected token indices, ascending.
    pub tokens: Vec<usize>,
    /// Spans added whole by coverage completion (and kept).
    pub completed: Vec<(usize, usize)>,
}

/// Selects at most `budget` of the `scores.len()` chunk tokens: the top `budget` by score
/// (ties: earlier first), then coverage completion within the budget. Candidate spans (share of
/// selected tokens ≥ τ_cover) are taken in order of mean importance; a span is completed only
/// if the lowest-importance selected tokens outside every completed span can make room for it,
/// so the total never exceeds the budget and completed spans stay whole.
pub fn select(scores: &[f32], segment: &[usize], budget: usize, p: &SpanParams) -> Selection {
    let n = scores.len();
    let budget = budget.min(n);
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut chosen = vec![false; n];
    order.iter().take(budget).for_each(|&i| chosen[i] = true);
    let mut completed = Vec::new();
    if p.complete_spans && budget > 0 {
        let spans = segment_spans(&min_max_normalize(scores), segment, p);
        let mean = |&(s, e): &(usize, usize)| {
            scores[s..e].iter().map(|&x| f64::from(x)).sum::<f64>() / (e - s) as f64
        };
        let mut candidates: Vec<(usize, usize)> = spans
            .into_iter()
            .filter(|&(s, e)| {
                let covered = (s..e).filter(|&i| chosen[i]).count();
                covered < e - s && covered as f64 / (e - s) as f64 >= p.tau_cover
            })
            .collect();
        candidates.sort_by(|a, b| mean(b).total_cmp(&mean(a)).then(a.0.cmp(&b.0)));
        let mut locked = vec![false; n];
        for (s, e) in candidates {
            let extra = (s..e).filter(|&i| !chosen[i]).count();
            // Lowest-importance selected tokens that may make room: not locked, not in this span.
            let victims: Vec<usize> = order
                .iter()
                .rev()
                .copied()
                .filter(|&i| chosen[i] && !locked[i] && !(s..e).contains(&i))
                .take(extra)
                .collect();
            if victims.len() < extra {
                continue;
            }
            victims.iter().for_each(|&i| chosen[i] = false);
            (s..e).for_each(|i| {
                chosen[i] = true;
                locked[i] = true;
            });
            completed.push((s, e));
        }
        completed.sort_unstable();
    }
    Selection {
        tokens: (0..n).filter(|&i| chosen[i]).collect(),
        completed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalization_and_relative_change_by_hand() {
        assert_eq!(min_max_normalize(&[2.0, 4.0, 3.0]), vec![0.0, 1.0, 0.5]);
        assert_eq!(
            min_max_normalize(&[5.0, 5.0]),
            vec![0.0, 0.0],
            "constant scores"
        );
        assert!(min_max_normalize(&[]).is_empty());
        assert!((relative_change(0.5, 0.7) - 0.4).abs() < 1e-12);
        assert!(
            (relative_change(0.5, 0.3) - 0.4).abs() < 1e-12,
            "falls count like rises"
        );
        assert_eq!(relative_change(0.0, 0.0), 0.0);
        assert_eq!(relative_change(0.0, 0.1), f64::INFINITY);
    }

    #[test]
    fn spans_break_on_change_segment_and_length() {
        let p = SpanParams {
            max_span: 3,
            ..Default::default()
        };
        // normalized: 1.0 0.9 0.85 | 0.2 (drop of 76% > 40%) 0.22 ...
        let norm = [1.0, 0.9, 0.85, 0.2, 0.22, 0.21, 0.2];
        let seg = [0, 0, 0, 0, 0, 1, 1];
        assert_eq!(segment_spans(&norm, &seg, &p), vec![(0, 3), (3, 5), (5, 7)]);
        // max_span cuts a flat run; a single token is its own span.
        let flat = [0.5; 7];
        assert_eq!(
            segment_spans(&flat, &[0; 7], &p),
            vec![(0, 3), (3, 6), (6, 7)]
        );
        assert_eq!(segment_spans(&[0.3], &[0], &p), vec![(0, 1)]);
    }

    #[test]
    fn top_k_with_ties_and_edge_ratios() {
        let p = SpanParams {
            complete_spans: false,
            ..Default::default()
        };
        let scores = [1.0, 3.0, 3.0, 2.0, 0.5];
        assert_eq!(select(&scores, &[0; 5], 2, &p).tokens, vec![1, 2]);
        assert_eq!(select(&scores, &[0; 5], 3, &p).tokens, vec![1, 2, 3]);
        let ties = [1.0; 4];
        assert_eq!(
            select(&ties, &[0; 4], 2, &p).tokens,
            vec![0, 1],
            "ties: earlier first"
        );
        assert!(
            select(&scores, &[0; 5], 0, &SpanParams::default())
                .tokens
                .is_empty(),
            "ratio 0"
        );
        assert_eq!(
            select(&scores, &[0; 5], 5, &SpanParams::default()).tokens,
            vec![0, 1, 2, 3, 4],
            "ratio 1"
        );
        assert_eq!(
            select(&[7.0], &[0], 1, &SpanParams::default()).tokens,
            vec![0],
            "one-token chunk"
        );
    }

    #[test]
    fn coverage_completes_a_span_within_the_budget() {
        // normalized: 1, .9, .8, .75 | 0 ... 0 | .022: spans (0,4), (4,9), (9,10).
        let scores = [10.0, 9.1, 8.2, 7.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.2];
        let seg = [0; 10];
        let p = SpanParams::default();
        // Budget 3 picks 0,1,2 (3/4 of span 0..4 ≥ 0.7) but completing it needs a 4th slot and
        // no selected token outside the span can give it up: the span stays incomplete.
        let s = select(&scores, &seg, 3, &p);
        assert_eq!(s.tokens, vec![0, 1, 2]);
        assert!(s.completed.is_empty());
        // With a stray top token at 8 (budget 4: 0,1,2,8), completing 0..4 evicts it.
        let scores2 = [10.0, 9.1, 8.2, 7.75, 1.0, 1.0, 1.0, 1.0, 8.0, 1.2];
        let s2 = select(&scores2, &seg, 4, &p);
        assert_eq!(s2.tokens, vec![0, 1, 2, 3]);
        assert_eq!(s2.completed, vec![(0, 4)]);
        // Without span completion the stray token stays.
        let nospan = SpanParams {
            complete_spans: false,
            ..p
        };
        assert_eq!(select(&scores2, &seg, 4, &nospan).tokens, vec![0, 1, 2, 8]);
        // A span at a segment boundary never crosses it.
        let seg3 = [0, 0, 1, 1, 1, 1, 1, 1, 1, 1];
        let spans = segment_spans(&min_max_normalize(&scores), &seg3, &p);
        assert!(spans.iter().all(|&(s, e)| seg3[s] == seg3[e - 1]));
        assert_eq!(spans[0], (0, 2));
    }

    #[test]
    fn budget_trims_the_lowest_token_outside_spans() {
        // normalized (tau_smooth 0.5): 1, .9875, .5 | 0, 0 | .99375 | 0 → spans (0,3) (3,5) (5,6) (6,7).
        let scores = [9.0, 8.9, 5.0, 1.0, 1.0, 8.95, 1.0];
        let p = SpanParams {
            tau_cover: 0.6,
            tau_smooth: 0.5,
            ..Default::default()
        };
        // Top 3 = {0, 5, 1}; span (0,3) is 2/3 covered → completed by evicting 5.
        let s = select(&scores, &[0; 7], 3, &p);
        assert_eq!(s.tokens, vec![0, 1, 2]);
        assert_eq!(s.completed, vec![(0, 3)]);
    }

    #[test]
    fn deterministic() {
        let scores: Vec<f32> = (0..200).map(|i| ((i * 37 % 101) as f32).sin()).collect();
        let seg: Vec<usize> = (0..200).map(|i| i / 50).collect();
        let a = select(&scores, &seg, 30, &SpanParams::default());
        let b = select(&scores, &seg, 30, &SpanParams::default());
        assert_eq!(a, b);
        assert!(a.tokens.len() <= 30);
    }
}
