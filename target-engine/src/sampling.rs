//! Next-token choice: greedy, or seeded temperature / top-p sampling.

/// How the next token is picked from the logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Nucleus: keep the smallest set of tokens whose probability reaches this mass.
    pub top_p: f32,
    /// Seed of the sampler's random stream; the same seed gives the same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

/// A seeded sampler whose choice of an answer's `index`-th token depends only on the seed, the
/// index and the logits, never on what was drawn before: plain decoding, speculative decoding
/// (which checks a drafted token by drawing the target's own token at its index) and the
/// fidelity guard's continuation from the full cache (which checks the tokens already sampled
/// the same way) all give the same answer for the same seed wherever the logits agree.
#[derive(Debug, Clone, Copy)]
pub struct Sampler {
    params: SamplingParams,
}

/// Index of the largest value; the first one on ties (as llama.cpp's greedy sampler).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// SplitMix64's finalizer: a bijection of 64-bit values whose outputs look independent.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Sampler {
    /// A sampler seeded from `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        Self { params }
    }

    /// Whether this sampler draws at all (temperature above 0), or takes the argmax.
    pub fn is_sampled(&self) -> bool {
        self.params.temperature > 0.0
    }

    /// The uniform draw in `[0, 1)` for the answer's `index`-th token.
    pub fn uniform_at(&self, index: usize) -> f64 {
        let z = mix(mix(self.params.seed) ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The answer's `index`-th token from the logits before it: the argmax when greedy, else
    /// the inverse of the nucleus's cumulative distribution (most probable first) at
    /// [`Sampler::uniform_at`]`(index)`.
    pub fn sample_at(&self, logits: &[f32], index: usize) -> u32 {
        if !self.is_sampled() || logits.is_empty() {
            return argmax(logits);
        }
        let probs = self.nucleus(logits);
        let kept: f64 = probs.iter().map(|p| f64::from(p.1)).sum();
        let mut r = self.uniform_at(index) * kept;
        for &(id, p) in &probs {
            let p = f64::from(p);
            if r < p {
                return id;
            }
            r -= p;
        }
        probs.last().map_or(0, |p| p.0)
    }

    /// The tokens `sample_at` draws from, most probable first, with their probabilities
    /// (softmax of `logits / temperature`, cut to the top-p nucleus, not renormalized).
    fn nucleus(&self, logits: &[f32]) -> Vec<(u32, f32)> {
        let SamplingParams {
            temperature, top_p, ..
        } = self.params;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, ((l - max) / temperature).exp()))
            .collect();
        let total: f32 = probs.iter().map(|p| p.1).sum();
        probs.iter_mut().for_each(|p| p.1 /= total);
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut mass = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            mass += p.1;
            if mass >= top_p.clamp(0.0, 1.0) {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        probs
    }

    /// The distribution [`Sampler::sample_at`] draws from, over the whole vocabulary (summing
    /// to 1; greedy: all of it on the argmax).
    pub fn distribution(&self, logits: &[f32]) -> Vec<f32> {
        let mut dist = vec![0.0f32; logits.len()];
        if logits.is_empty() {
            return dist;
        }
        if !self.is_sampled() {
            dist[argmax(logits) as usize] = 1.0;
            return dist;
        }
        let probs = self.nucleus(logits);
        let kept: f32 = probs.iter().map(|p| p.1).sum();
        for (id, p) in probs {
            dist[id as usize] = p / kept;
        }
        dist
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampled(seed: u64, top_p: f32) -> Sampler {
        Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p,
            seed,
        })
    }

    #[test]
    fn greedy_takes_first_maximum() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        let s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample_at(&[0.0, 0.5, 0.2], 7), 1);
    }

    #[test]
    fn a_draw_depends_on_the_seed_and_the_index_not_on_earlier_draws() {
        let logits = [1.0, 2.0, 0.5, 1.5, 0.0];
        let s = sampled(7, 1.0);
        let a: Vec<u32> = (0..50).map(|i| s.sample_at(&logits, i)).collect();
        // The same indices in another order, after other draws: the same tokens.
        let b: Vec<u32> = (0..50)
            .rev()
            .map(|i| {
                let _ = s.sample_at(&[3.0, 0.0], i + 100);
                s.sample_at(&logits, i)
            })
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        assert_eq!(a, b);
        assert!(
            a.iter().collect::<std::collections::HashSet<_>>().len() > 2,
            "samples vary"
        );
        let other: Vec<u32> = (0..50)
            .map(|i| sampled(8, 1.0).sample_at(&logits, i))
            .collect();
        assert_ne!(a, other, "another seed, other samples");
        // p(1) ≈ 0.41 and p(3) ≈ 0.25: top_p 0.5 keeps exactly these two.
        let s = sampled(7, 0.5);
        assert!((0..200).all(|i| matches!(s.sample_at(&logits, i), 1 | 3)));
    }

    #[test]
    fn the_distribution_is_the_one_sample_at_draws_from() {
        let logits = [1.0, 2.0, 0.5, 1.5, 0.0];
        let d = sampled(1, 0.5).distribution(&logits);
        // The nucleus of 1 and 3 (see above), renormalized.
        let e = (1.5f32 - 2.0).exp();
        assert!(
            (d[1] - 1.0 / (1.0 + e)).abs() < 1e-6 && (d[3] - e / (1.0 + e)).abs() < 1e-6,
            "{d:?}"
        );
        assert_eq!((d[0], d[2], d[4]), (0.0, 0.0, 0.0));
        let greedy = Sampler::new(SamplingParams::default()).distribution(&logits);
        assert_eq!(greedy, vec![0.0, 1.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn sampling_frequencies_follow_the_softmax_over_indices_and_seeds() {
        let logits = [0.0f32, (3.0f32).ln()]; // probabilities 1/4, 3/4
        let n = 4000;
        let over_indices = (0..n)
            .filter(|&i| sampled(1, 1.0).sample_at(&logits, i) == 1)
            .count() as f64
            / n as f64;
        let over_seeds = (0..n as u64)
            .filter(|&seed| sampled(seed, 1.0).sample_at(&logits, 0) == 1)
            .count() as f64
            / n as f64;
        // 4000 draws: standard error ≈ 0.007, so 0.03 is more than 4 sigma.
        assert!((over_indices - 0.75).abs() < 0.03, "{over_indices}");
        assert!((over_seeds - 0.75).abs() < 0.03, "{over_seeds}");
    }
}
