//! How far a blended prefill is from the full one: per-layer KV cosine distance, KL divergence
//! of the next-token distribution, and greedy continuation agreement.

use crate::kv::KvCache;

/// `1 - cos(a, b)` over whole K (and V) of each layer, for the rows both caches hold.
pub fn layer_cosine_distance(fused: &KvCache, full: &KvCache) -> Vec<(f64, f64)> {
    let rows = fused.len().min(full.len());
    let row = fused.row_len();
    (0..fused.n_layer().min(full.n_layer()))
        .map(|l| {
            let k = cosine_distance(&fused.k(l)[..rows * row], &full.k(l)[..rows * row]);
            let v = cosine_distance(&fused.v(l)[..rows * row], &full.v(l)[..rows * row]);
            (k, v)
        })
        .collect()
}

/// `1 - a·b / (|a| |b|)`; 0 for identical directions (and for two zero vectors).
pub fn cosine_distance(a: &[f32], b: &[f32]) -> f64 {
    let (mut dot, mut na, mut nb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        dot += f64::from(x) * f64::from(y);
        na += f64::from(x) * f64::from(x);
        nb += f64::from(y) * f64::from(y);
    }
    if na == 0.0 && nb == 0.0 {
        return 0.0;
    }
    1.0 - dot / (na.sqrt() * nb.sqrt()).max(f64::MIN_POSITIVE)
}

/// `KL(p || q)` in nats between the softmax distributions of two logit vectors (`p` is the
/// reference, e.g. full prefill).
pub fn kl_divergence(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let log_softmax = |l: &[f32]| -> Vec<f64> {
        let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = l.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln() + max;
        l.iter().map(|&x| x as f64 - lse).collect()
    };
    let (lp, lq) = (log_softmax(p_logits), log_softmax(q_logits));
    lp.iter()
        .zip(&lq)
        .map(|(a, b)| a.exp() * (a - b))
        .sum::<f64>()
        .max(0.0)
}

/// Fraction of the reference continuation reproduced before the first disagreement.
pub fn greedy_agreement(reference: &[u32], other: &[u32]) -> f64 {
    if reference.is_empty() {
        return 1.0;
    }
    let same = reference
        .iter()
        .zip(other)
        .take_while(|(a, b)| a == b)
        .count();
    same as f64 / reference.len() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_values() {
        assert!(cosine_distance(&[1.0, 0.0], &[2.0, 0.0]).abs() < 1e-12);
        assert!((cosine_distance(&[1.0, 0.0], &[0.0, 1.0]) - 1.0).abs() < 1e-12);
        assert!((cosine_distance(&[1.0, 0.0], &[-1.0, 0.0]) - 2.0).abs() < 1e-12);
        assert!(kl_divergence(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]).abs() < 1e-12);
        // p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3).
        let want = 0.5 * (2f64).ln() + 0.5 * (2.0f64 / 3.0).ln();
        assert!((kl_divergence(&[0.0, 0.0], &[0.0, (3f32).ln()]) - want).abs() < 1e-6);
        assert_eq!(greedy_agreement(&[1, 2, 3, 4], &[1, 2, 9, 4]), 0.5);
        assert_eq!(greedy_agreement(&[1, 2], &[1, 2, 3]), 1.0);
    }
}
