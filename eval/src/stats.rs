//! Paired per-case statistics for comparing KV-reuse methods against a reference (full
//! recompute): percentile-bootstrap intervals, the exact McNemar test, Wilson intervals and
//! logit-level KL / NLL. Pure functions; nothing panics on empty input.
//!
//! Every bootstrap is seeded ([`StdRng::seed_from_u64`]), so a given seed and input give the
//! same interval on every run of the same build. Cases are resampled with replacement and, for
//! paired statistics, a case's two values always travel together.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Two-sided 95% normal quantile, `Φ⁻¹(0.975)`.
const Z95: f64 = 1.959_963_984_540_054;

/// A point estimate with a 95% interval; all three are NaN when the input admits none.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub struct Interval {
    /// The statistic on the full sample.
    pub estimate: f64,
    /// Lower bound of the interval.
    pub lo: f64,
    /// Upper bound of the interval.
    pub hi: f64,
}

impl Interval {
    /// Interval whose estimate and bounds are all NaN.
    pub fn nan() -> Self {
        Interval {
            estimate: f64::NAN,
            lo: f64::NAN,
            hi: f64::NAN,
        }
    }

    /// True when the whole interval lies strictly above or strictly below 0 (false if NaN).
    pub fn excludes_zero(&self) -> bool {
        self.lo > 0.0 || self.hi < 0.0
    }

    /// True when `lo <= v <= hi` (false if any is NaN).
    pub fn contains(&self, v: f64) -> bool {
        self.lo <= v && v <= self.hi
    }
}

/// Arithmetic mean of `x` at the given case indices.
fn mean_at(x: &[f64], idx: &[usize]) -> f64 {
    idx.iter().map(|&i| x[i]).sum::<f64>() / idx.len() as f64
}

/// Draws `resamples` index vectors of length `n` (with replacement) and evaluates `stat` on each.
fn resample_stats(
    n: usize,
    resamples: usize,
    seed: u64,
    mut stat: impl FnMut(&[usize]) -> Option<f64>,
) -> Vec<f64> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut idx = vec![0usize; n];
    let mut out = Vec::with_capacity(resamples);
    for _ in 0..resamples {
        for i in idx.iter_mut() {
            *i = rng.gen_range(0..n);
        }
        if let Some(s) = stat(&idx) {
            out.push(s);
        }
    }
    out
}

/// Type-7 (linear interpolation) quantile `q` of an ascending, non-empty slice.
fn quantile_sorted(sorted: &[f64], q: f64) -> f64 {
    let h = (sorted.len() - 1) as f64 * q;
    let lo = h.floor() as usize;
    let hi = (lo + 1).min(sorted.len() - 1);
    sorted[lo] + (h - lo as f64) * (sorted[hi] - sorted[lo])
}

/// Percentile 95% interval of bootstrap replicates; NaN bounds if none or any replicate is NaN.
fn percentile_interval(estimate: f64, mut stats: Vec<f64>) -> Interval {
    if stats.is_empty() || stats.iter().any(|s| s.is_nan()) {
        return Interval {
            estimate,
            lo: f64::NAN,
            hi: f64::NAN,
        };
    }
    stats.sort_by(f64::total_cmp);
    Interval {
        estimate,
        lo: quantile_sorted(&stats, 0.025),
        hi: quantile_sorted(&stats, 0.975),
    }
}

/// Percentile-bootstrap 95% CI of the mean; all-NaN if `x` is empty, NaN bounds if `resamples == 0`.
pub fn bootstrap_mean(x: &[f64], resamples: usize, seed: u64) -> Interval {
    if x.is_empty() {
        return Interval::nan();
    }
    let all: Vec<usize> = (0..x.len()).collect();
    let estimate = mean_at(x, &all);
    let stats = resample_stats(x.len(), resamples, seed, |idx| Some(mean_at(x, idx)));
    percentile_interval(estimate, stats)
}

/// Bootstrap 95% CI of mean(a_i − b_i), resampling cases in pairs; None if empty or lengths differ.
pub fn paired_bootstrap_diff(
    a: &[f64],
    b: &[f64],
    resamples: usize,
    seed: u64,
) -> Option<Interval> {
    if a.is_empty() || a.len() != b.len() {
        return None;
    }
    let d: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    Some(bootstrap_mean(&d, resamples, seed))
}

/// Bootstrap 95% CI of "gap closed" 1 − mean(method)/mean(reuse), pairs resampled together.
///
/// None when empty, lengths differ or mean(reuse_kl) is 0. Resamples whose reuse mean is 0 (the
/// ratio is undefined there) are skipped; the interval is over the remaining replicates.
pub fn bootstrap_ratio_gap(
    method_kl: &[f64],
    reuse_kl: &[f64],
    resamples: usize,
    seed: u64,
) -> Option<Interval> {
    if method_kl.is_empty() || method_kl.len() != reuse_kl.len() {
        return None;
    }
    let all: Vec<usize> = (0..method_kl.len()).collect();
    let gap = |idx: &[usize]| -> Option<f64> {
        let den = mean_at(reuse_kl, idx);
        (den != 0.0).then(|| 1.0 - mean_at(method_kl, idx) / den)
    };
    let estimate = gap(&all)?;
    let stats = resample_stats(method_kl.len(), resamples, seed, gap);
    Some(percentile_interval(estimate, stats))
}

/// Exact McNemar test result: discordant counts and the two-sided p-value.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub struct McNemar {
    /// Cases where `a` is right and `b` is wrong.
    pub b: usize,
    /// Cases where `a` is wrong and `b` is right.
    pub c: usize,
    /// Two-sided exact p-value, `min(1, 2·P(X ≤ min(b, c)))` with `X ~ Bin(b + c, 1/2)`.
    pub p_value: f64,
}

/// `ln P(X ≤ k)` for `X ~ Bin(n, 1/2)`, summed in log space (accurate for n in the tens of thousands).
fn ln_binom_half_cdf(n: usize, k: usize) -> f64 {
    let k = k.min(n);
    let ln_half_n = -(n as f64) * std::f64::consts::LN_2;
    // ln C(n, i) built incrementally: ln C(n, i) = ln C(n, i-1) + ln(n-i+1) - ln(i).
    let mut ln_c = 0.0f64;
    let mut terms = Vec::with_capacity(k + 1);
    terms.push(ln_half_n);
    for i in 1..=k {
        ln_c += ((n - i + 1) as f64).ln() - (i as f64).ln();
        terms.push(ln_c + ln_half_n);
    }
    let max = terms.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    max + terms.iter().map(|t| (t - max).exp()).sum::<f64>().ln()
}

/// Exact two-sided McNemar test of per-case correctness `a` vs `b`; None if empty or lengths differ.
pub fn mcnemar(a: &[bool], b: &[bool]) -> Option<McNemar> {
    if a.is_empty() || a.len() != b.len() {
        return None;
    }
    let nb = a.iter().zip(b).filter(|&(&x, &y)| x && !y).count();
    let nc = a.iter().zip(b).filter(|&(&x, &y)| !x && y).count();
    let n = nb + nc;
    let p_value = if n == 0 {
        1.0
    } else {
        (2.0 * ln_binom_half_cdf(n, nb.min(nc)).exp()).min(1.0)
    };
    Some(McNemar {
        b: nb,
        c: nc,
        p_value,
    })
}

/// KL(softmax(p) ‖ softmax(q)) in nats (f64, log-sum-exp); NaN if the lengths differ.
///
/// Delegates to [`target_engine::reuse::fidelity::kl_divergence`], the function `run` already uses for
/// `kl_first`, so the two can never disagree.
pub fn kl_from_logits(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    if p_logits.len() != q_logits.len() {
        return f64::NAN;
    }
    target_engine::reuse::fidelity::kl_divergence(p_logits, q_logits)
}

/// How sure a next-token distribution is: softmax probability of its most likely token minus
/// that of the second (0 for fewer than two logits). A per-request signal the fidelity guard
/// can read without a full prefill (issue 39).
pub fn top2_margin(logits: &[f32]) -> f64 {
    if logits.len() < 2 {
        return 0.0;
    }
    let max = logits
        .iter()
        .map(|&x| f64::from(x))
        .fold(f64::NEG_INFINITY, f64::max);
    let (mut first, mut second, mut sum) = (f64::NEG_INFINITY, f64::NEG_INFINITY, 0.0);
    for &x in logits {
        let x = f64::from(x);
        sum += (x - max).exp();
        if x > first {
            second = first;
            first = x;
        } else if x > second {
            second = x;
        }
    }
    ((first - max).exp() - (second - max).exp()) / sum
}

/// −ln softmax(logits)[token] in nats (f64, log-sum-exp); NaN if `token` is out of range.
pub fn nll_from_logits(logits: &[f32], token: usize) -> f64 {
    let Some(&t) = logits.get(token) else {
        return f64::NAN;
    };
    let max = logits
        .iter()
        .map(|&x| f64::from(x))
        .fold(f64::NEG_INFINITY, f64::max);
    let lse = max
        + logits
            .iter()
            .map(|&x| (f64::from(x) - max).exp())
            .sum::<f64>()
            .ln();
    lse - f64::from(t)
}

/// 95% Wilson score interval of `successes / n` (estimate = raw proportion); all-NaN if
/// `n == 0` or `successes > n`.
pub fn wilson(successes: usize, n: usize) -> Interval {
    if n == 0 || successes > n {
        return Interval::nan();
    }
    let nf = n as f64;
    let p = successes as f64 / nf;
    let z2 = Z95 * Z95;
    let denom = 1.0 + z2 / nf;
    let center = (p + z2 / (2.0 * nf)) / denom;
    let half = Z95 / denom * (p * (1.0 - p) / nf + z2 / (4.0 * nf * nf)).sqrt();
    Interval {
        estimate: p,
        // Exactly 0 / 1 at the ends (the formula gives them up to rounding).
        lo: if successes == 0 {
            0.0
        } else {
            (center - half).clamp(0.0, 1.0)
        },
        hi: if successes == n {
            1.0
        } else {
            (center + half).clamp(0.0, 1.0)
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_top2_margin_is_the_gap_between_the_two_likeliest_tokens() {
        assert!((top2_margin(&[0.0, 0.0]) - 0.0).abs() < 1e-12);
        // softmax([ln 3, 0, 0]) = (0.6, 0.2, 0.2): margin 0.4, whatever the order.
        let l = [0.0, 3f32.ln(), 0.0];
        assert!((top2_margin(&l) - 0.4).abs() < 1e-6, "{}", top2_margin(&l));
        assert_eq!(top2_margin(&[1.0]), 0.0);
    }

    fn close(got: f64, want: f64, tol: f64) {
        assert!((got - want).abs() <= tol, "got {got}, want {want} ± {tol}");
    }

    #[test]
    fn bootstrap_of_a_constant_is_a_point() {
        let ci = bootstrap_mean(&[2.5; 50], 1000, 7);
        assert_eq!(
            ci,
            Interval {
                estimate: 2.5,
                lo: 2.5,
                hi: 2.5
            }
        );
        assert!(ci.excludes_zero());
    }

    #[test]
    fn bootstrap_mean_brackets_the_mean_and_handles_degenerate_input() {
        let x: Vec<f64> = (0..100).map(f64::from).collect();
        let ci = bootstrap_mean(&x, 2000, 1);
        close(ci.estimate, 49.5, 1e-12);
        assert!(ci.lo < 49.5 && 49.5 < ci.hi);
        // The standard error is ~2.9, so the 95% half-width should be near 5.7.
        assert!(ci.hi - ci.lo > 8.0 && ci.hi - ci.lo < 15.0, "{ci:?}");
        let empty = bootstrap_mean(&[], 100, 1);
        assert!(empty.estimate.is_nan() && empty.lo.is_nan() && empty.hi.is_nan());
        assert!(!empty.excludes_zero());
        let none = bootstrap_mean(&[1.0, 2.0], 0, 1);
        assert_eq!(none.estimate, 1.5);
        assert!(none.lo.is_nan() && none.hi.is_nan());
        assert!(bootstrap_mean(&[1.0, f64::NAN], 100, 1).lo.is_nan());
    }

    #[test]
    fn bootstrap_is_deterministic_by_seed() {
        let x: Vec<f64> = (0..37).map(|i| f64::from(i * i % 11)).collect();
        assert_eq!(bootstrap_mean(&x, 500, 42), bootstrap_mean(&x, 500, 42));
        assert_ne!(bootstrap_mean(&x, 500, 42), bootstrap_mean(&x, 500, 43));
        let y: Vec<f64> = x.iter().rev().copied().collect();
        assert_eq!(
            paired_bootstrap_diff(&x, &y, 500, 9),
            paired_bootstrap_diff(&x, &y, 500, 9)
        );
    }

    #[test]
    fn paired_diff_of_a_shifted_pair_excludes_zero_and_contains_the_shift() {
        let mut rng = StdRng::seed_from_u64(3);
        let b: Vec<f64> = (0..200).map(|_| rng.gen_range(0.0..10.0)).collect();
        let a: Vec<f64> = b
            .iter()
            .map(|x| x + 1.0 + rng.gen_range(-0.1..0.1))
            .collect();
        let ci = paired_bootstrap_diff(&a, &b, 2000, 11).expect("same length");
        assert!(ci.excludes_zero(), "{ci:?}");
        assert!(ci.contains(1.0), "{ci:?}");
        assert!(
            ci.hi - ci.lo < 0.05,
            "pairing should remove the between-case spread: {ci:?}"
        );
    }

    #[test]
    fn paired_diff_of_identical_vectors_is_zero() {
        let a: Vec<f64> = (0..30).map(|i| f64::from(i) * 0.37).collect();
        let ci = paired_bootstrap_diff(&a, &a, 1000, 5).expect("same length");
        assert_eq!(
            ci,
            Interval {
                estimate: 0.0,
                lo: 0.0,
                hi: 0.0
            }
        );
        assert!(!ci.excludes_zero());
        assert_eq!(paired_bootstrap_diff(&a, &a[1..], 100, 5), None);
        assert_eq!(paired_bootstrap_diff(&[], &[], 100, 5), None);
    }

    #[test]
    fn gap_closed_hand_values() {
        let reuse = [0.5, 0.1, 0.3, 0.0, 0.8, 0.2];
        let same = bootstrap_ratio_gap(&reuse, &reuse, 1000, 2).expect("defined");
        assert_eq!(
            same,
            Interval {
                estimate: 0.0,
                lo: 0.0,
                hi: 0.0
            }
        );
        let zero = bootstrap_ratio_gap(&[0.0; 6], &reuse, 1000, 2).expect("defined");
        assert_eq!(
            zero,
            Interval {
                estimate: 1.0,
                lo: 1.0,
                hi: 1.0
            }
        );
        let half: Vec<f64> = reuse.iter().map(|x| x / 2.0).collect();
        let h = bootstrap_ratio_gap(&half, &reuse, 1000, 2).expect("defined");
        close(h.estimate, 0.5, 1e-12);
        close(h.lo, 0.5, 1e-12);
        close(h.hi, 0.5, 1e-12);
        assert_eq!(bootstrap_ratio_gap(&[], &[], 100, 2), None);
        assert_eq!(bootstrap_ratio_gap(&[1.0], &[1.0, 2.0], 100, 2), None);
        assert_eq!(bootstrap_ratio_gap(&[1.0, 2.0], &[0.0, 0.0], 100, 2), None);
        // One nonzero reuse case out of two: resamples that miss it are skipped, not NaN.
        let skip = bootstrap_ratio_gap(&[0.0, 0.0], &[0.0, 1.0], 1000, 2).expect("defined");
        assert_eq!((skip.estimate, skip.lo, skip.hi), (1.0, 1.0, 1.0));
    }

    #[test]
    fn mcnemar_hand_values() {
        // b = 10, c = 2: p = 2 (1 + 12 + 66) / 2^12 = 79 / 2048.
        let mut a = vec![true; 10];
        let mut b = vec![false; 10];
        a.extend([false, false]);
        b.extend([true, true]);
        a.extend([true; 5]);
        b.extend([true; 5]);
        a.extend([false; 4]);
        b.extend([false; 4]);
        let m = mcnemar(&a, &b).expect("same length");
        assert_eq!((m.b, m.c), (10, 2));
        close(m.p_value, 79.0 / 2048.0, 1e-12);
        close(m.p_value, 0.0386, 1e-4);
        // Swapping the arms swaps b and c but not p.
        let s = mcnemar(&b, &a).expect("same length");
        assert_eq!((s.b, s.c), (2, 10));
        close(s.p_value, m.p_value, 1e-15);

        let eq = mcnemar(&[true, false, true, false], &[false, true, false, true]).expect("ok");
        assert_eq!((eq.b, eq.c, eq.p_value), (2, 2, 1.0));
        let none = mcnemar(&[true, false], &[true, false]).expect("ok");
        assert_eq!((none.b, none.c, none.p_value), (0, 0, 1.0));
        assert_eq!(mcnemar(&[], &[]), None);
        assert_eq!(mcnemar(&[true], &[true, false]), None);
    }

    #[test]
    fn mcnemar_is_exact_for_large_counts() {
        // n = 10,000 discordant pairs, 5,100 vs 4,900: exact p = 0.046585527704947 (Python, integers).
        let a: Vec<bool> = (0..10_000).map(|i| i < 5_100).collect();
        let b: Vec<bool> = a.iter().map(|x| !x).collect();
        let m = mcnemar(&a, &b).expect("same length");
        assert_eq!((m.b, m.c), (5_100, 4_900));
        close(m.p_value, 0.046_585_527_704_947_39, 1e-10);
        // The whole distribution sums to 1, and P(X ≤ k) + P(X ≤ n-k-1) = 1 by symmetry.
        close(ln_binom_half_cdf(10_000, 10_000).exp(), 1.0, 1e-10);
        let (lo, hi) = (
            ln_binom_half_cdf(10_000, 4_900).exp(),
            ln_binom_half_cdf(10_000, 5_099).exp(),
        );
        close(lo + hi, 1.0, 1e-10);
    }

    #[test]
    fn kl_hand_values() {
        assert!(kl_from_logits(&[1.0, -2.0, 3.5], &[1.0, -2.0, 3.5]).abs() < 1e-12);
        // Shifting all logits leaves the distribution unchanged.
        assert!(kl_from_logits(&[1.0, 2.0], &[101.0, 102.0]).abs() < 1e-9);
        // p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3).
        let want = 0.5 * 2f64.ln() + 0.5 * (2.0f64 / 3.0).ln();
        close(kl_from_logits(&[0.0, 0.0], &[0.0, 3f32.ln()]), want, 1e-6);
        let mut rng = StdRng::seed_from_u64(8);
        for _ in 0..50 {
            let p: Vec<f32> = (0..16).map(|_| rng.gen_range(-20.0..20.0)).collect();
            let q: Vec<f32> = (0..16).map(|_| rng.gen_range(-20.0..20.0)).collect();
            assert!(kl_from_logits(&p, &q) >= 0.0);
        }
        assert!(kl_from_logits(&[1.0, 2.0], &[1.0]).is_nan());
        // Large logits do not overflow.
        assert!(kl_from_logits(&[1000.0, 0.0], &[1000.0, 0.0]).abs() < 1e-12);
    }

    #[test]
    fn nll_hand_values() {
        // softmax(0, ln 3) = (1/4, 3/4).
        close(nll_from_logits(&[0.0, 3f32.ln()], 0), 4f64.ln(), 1e-6);
        close(
            nll_from_logits(&[0.0, 3f32.ln()], 1),
            (4.0f64 / 3.0).ln(),
            1e-6,
        );
        close(nll_from_logits(&[5.0; 8], 3), 8f64.ln(), 1e-12);
        close(nll_from_logits(&[1000.0, 0.0], 1), 1000.0, 1e-9);
        assert!(nll_from_logits(&[1.0, 2.0], 2).is_nan());
        assert!(nll_from_logits(&[], 0).is_nan());
    }

    #[test]
    fn wilson_known_values() {
        let z2 = Z95 * Z95;
        let zero = wilson(0, 10);
        assert_eq!((zero.estimate, zero.lo), (0.0, 0.0));
        close(zero.hi, z2 / (10.0 + z2), 1e-12);
        close(zero.hi, 0.2775, 1e-4);
        let half = wilson(5, 10);
        assert_eq!(half.estimate, 0.5);
        close(half.lo, 0.2366, 1e-4);
        close(half.hi, 0.7634, 1e-4);
        let all = wilson(10, 10);
        assert_eq!((all.estimate, all.hi), (1.0, 1.0));
        close(all.lo, 0.7225, 1e-4);
        assert!(wilson(0, 0).estimate.is_nan());
        assert!(wilson(11, 10).lo.is_nan());
    }
}
