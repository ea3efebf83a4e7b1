//! Next-token choice: greedy, or seeded temperature / top-p sampling.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

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

/// A stateful sampler (its random stream advances with every token).
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
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

impl Sampler {
    /// A sampler seeded from `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        Self {
            params,
            rng: StdRng::seed_from_u64(params.seed),
        }
    }

    /// Picks the next token.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 || logits.is_empty() {
            return argmax(logits);
        }
        let probs = self.nucleus(logits);
        let kept: f32 = probs.iter().map(|p| p.1).sum();
        let mut r = self.rng.gen::<f32>() * kept;
        for &(id, p) in &probs {
            if r < p {
                return id;
            }
            r -= p;
        }
        probs.last().map_or(0, |p| p.0)
    }

    /// The tokens `sample` draws from, most probable first, with their probabilities
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

    /// The distribution [`Sampler::sample`] draws from, over the whole vocabulary (summing to
    /// 1; greedy: all of it on the argmax). Speculative decoding's rejection rule compares the
    /// target's and the drafter's.
    pub fn distribution(&self, logits: &[f32]) -> Vec<f32> {
        let mut dist = vec![0.0f32; logits.len()];
        if logits.is_empty() {
            return dist;
        }
        if self.params.temperature <= 0.0 {
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

    /// A token drawn in proportion to `weights` (not necessarily summing to 1; all zero: the
    /// argmax, i.e. the first).
    pub fn draw(&mut self, weights: &[f32]) -> u32 {
        let total: f64 = weights.iter().map(|&w| f64::from(w.max(0.0))).sum();
        if total <= 0.0 {
            return argmax(weights);
        }
        let mut r = self.rng.gen::<f64>() * total;
        let mut last = 0;
        for (i, &w) in weights.iter().enumerate() {
            let w = f64::from(w.max(0.0));
            if w > 0.0 {
                if r < w {
                    return i as u32;
                }
                r -= w;
                last = i;
            }
        }
        last as u32
    }

    /// A uniform draw from `[0, 1)` off this sampler's stream.
    pub fn uniform(&mut self) -> f64 {
        self.rng.gen::<f64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_first_maximum() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.0, 0.5, 0.2]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_top_p_restricts_support() {
        let logits = [1.0, 2.0, 0.5, 1.5, 0.0];
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            seed: 7,
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(params);
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(params);
            (0..50).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        assert!(
            a.iter().collect::<std::collections::HashSet<_>>().len() > 2,
            "samples vary"
        );
        // p(1) ≈ 0.41 and p(3) ≈ 0.25: top_p 0.5 keeps exactly these two.
        let mut s = Sampler::new(SamplingParams {
            top_p: 0.5,
            ..params
        });
        assert!((0..200).all(|_| matches!(s.sample(&logits), 1 | 3)));
    }

    #[test]
    fn the_distribution_is_the_one_sample_draws_from() {
        let logits = [1.0, 2.0, 0.5, 1.5, 0.0];
        let s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            seed: 1,
        });
        let d = s.distribution(&logits);
        // The nucleus of 1 and 3 (see above), renormalized.
        let e = (1.5f32 - 2.0).exp();
        assert!(
            (d[1] - 1.0 / (1.0 + e)).abs() < 1e-6 && (d[3] - e / (1.0 + e)).abs() < 1e-6,
            "{d:?}"
        );
        assert_eq!((d[0], d[2], d[4]), (0.0, 0.0, 0.0));
        let greedy = Sampler::new(SamplingParams::default()).distribution(&logits);
        assert_eq!(greedy, vec![0.0, 1.0, 0.0, 0.0, 0.0]);
        let mut s = Sampler::new(SamplingParams {
            seed: 5,
            ..Default::default()
        });
        let n = 20_000;
        let threes = (0..n)
            .filter(|_| s.draw(&[1.0, 0.0, 0.0, 3.0]) == 3)
            .count();
        assert!((threes as f64 / n as f64 - 0.75).abs() < 0.02, "{threes}");
        assert_eq!(s.draw(&[0.0, 0.0]), 0, "no weight: the first");
    }

    #[test]
    fn sampling_frequencies_follow_the_softmax() {
        let logits = [0.0f32, (3.0f32).ln()]; // probabilities 1/4, 3/4
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            seed: 1,
        });
        let n = 4000;
        let ones = (0..n).filter(|_| s.sample(&logits) == 1).count() as f64 / n as f64;
        // 4000 draws: standard error ≈ 0.007, so 0.03 is more than 4 sigma.
        assert!((ones - 0.75).abs() < 0.03, "{ones}");
    }
}
