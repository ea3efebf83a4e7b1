//! Cross-tokenizer alignment by shared text (SpecCache Eq. 7): a selected speculator token maps
//! to every target token whose byte span overlaps it.

use std::ops::Range;

/// Indices of `target` spans (sorted, non-overlapping) that overlap any of `selected` spans.
/// When both tokenizations are identical the mapping is the identity (fast path).
pub fn align(
    selected: &[Range<usize>],
    speculator: &[Range<usize>],
    target: &[Range<usize>],
) -> Vec<usize> {
    if speculator == target {
        let mut out: Vec<usize> = selected
            .iter()
            .filter_map(|s| target.binary_search_by_key(&s.start, |t| t.start).ok())
            .collect();
        out.sort_unstable();
        out.dedup();
        return out;
    }
    let mut out = Vec::new();
    for s in selected {
        if s.is_empty() {
            continue;
        }
        // First target span that ends after s.start.
        let mut i = target.partition_point(|t| t.end <= s.start);
        while i < target.len() && target[i].start < s.end {
            if !target[i].is_empty() {
                out.push(i);
            }
            i += 1;
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// Scores carried onto `target` spans (sorted, non-overlapping): each target token gets the
/// highest score among the `source` tokens overlapping it (NEG_INFINITY when none does).
pub fn project_scores(
    source: &[Range<usize>],
    scores: &[f32],
    target: &[Range<usize>],
) -> Vec<f32> {
    let mut out = vec![f32::NEG_INFINITY; target.len()];
    for (s, &v) in source.iter().zip(scores) {
        if s.is_empty() {
            continue;
        }
        let mut i = target.partition_point(|t| t.end <= s.start);
        while i < target.len() && target[i].start < s.end {
            out[i] = out[i].max(v);
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one selected span per case, on purpose
    fn overlap_by_hand() {
        // target: [0,3) [3,5) [5,9); speculator: [0,2) [2,6) [6,9)
        let target = vec![0..3, 3..5, 5..9];
        let spec = vec![0..2, 2..6, 6..9];
        assert_eq!(align(&[0..2], &spec, &target), vec![0]);
        assert_eq!(align(&[2..6], &spec, &target), vec![0, 1, 2]);
        assert_eq!(align(&[6..9], &spec, &target), vec![2]);
        assert_eq!(align(&[], &spec, &target), Vec::<usize>::new());
        // Touching is not overlapping.
        assert_eq!(align(&[3..3], &spec, &target), Vec::<usize>::new());
        // Identity fast path.
        assert_eq!(align(&[3..5, 0..3], &target, &target), vec![0, 1]);
    }

    #[test]
    fn projection_takes_the_best_overlapping_score() {
        let target = vec![0..3, 3..5, 5..9, 9..10];
        let spec = vec![0..2, 2..6, 6..9];
        let p = project_scores(&spec, &[1.0, 2.0, 0.5], &target);
        assert_eq!(&p[..3], &[2.0, 2.0, 2.0]);
        assert_eq!(p[3], f32::NEG_INFINITY);
    }
}
