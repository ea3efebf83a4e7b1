//! Rotary position embedding applied in place at explicit (possibly negative) positions.
//!
//! RoPE rotations compose: rotating a key computed at position `p` by `d` gives the key at
//! `p + d`. The same kernel therefore serves the forward pass (angle = position) and the
//! positional recovery of cached chunk keys (angle = position delta).

use crate::error::{shape_err, Result};
use candle_core::{Device, Tensor};

/// How the two halves of a rotated pair are laid out in a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeVariant {
    /// Pairs `(x[i], x[i + d/2])`: GPT-NeoX "rotate half", used by qwen2 GGUF files.
    RotateHalf,
    /// Pairs `(x[2i], x[2i + 1])`: the original RoPE, used by llama GGUF files (the converter
    /// permutes Q/K weights so that llama.cpp's "normal" rope applies).
    Interleaved,
}

/// Frequencies of one model's rotary embedding.
#[derive(Debug, Clone)]
pub struct Rope {
    variant: RopeVariant,
    head_dim: usize,
    inv_freq: Vec<f64>,
}

/// Cosines and sines for a list of positions, computed once and shared by every layer.
#[derive(Debug, Clone)]
pub struct RopeTable {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Number of positions in the table.
    pub fn len(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// True when the table holds no position.
    pub fn is_empty(&self) -> bool {
        self.cos.is_empty()
    }

    /// Cosines, `(positions, head_dim / 2)` row-major (a device uploads them).
    pub fn cos(&self) -> &[f32] {
        &self.cos
    }

    /// Sines, laid out as [`RopeTable::cos`].
    pub fn sin(&self) -> &[f32] {
        &self.sin
    }
}

impl Rope {
    /// Frequencies `base^(-2i/d)` for a head of `head_dim` (which must be even).
    pub fn new(variant: RopeVariant, head_dim: usize, base: f64) -> Result<Self> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(shape_err(
                "rope",
                format!("head_dim {head_dim} must be even and > 0"),
            ));
        }
        if !(base.is_finite() && base > 1.0) {
            return Err(shape_err(
                "rope",
                format!("base frequency {base} must be > 1"),
            ));
        }
        let half = head_dim / 2;
        let inv_freq = (0..half)
            .map(|i| base.powf(-2.0 * i as f64 / head_dim as f64))
            .collect();
        Ok(Self {
            variant,
            head_dim,
            inv_freq,
        })
    }

    /// Divides each pair's frequency by its factor (`head_dim / 2` of them): Llama 3.x's
    /// long-context scaling as GGUF files carry it (`rope_freqs.weight`, llama.cpp's
    /// `freq_factors`). Rotations still compose, so positional recovery is unchanged.
    pub fn with_freq_factors(mut self, factors: &[f32]) -> Result<Self> {
        if factors.len() != self.inv_freq.len() {
            return Err(shape_err(
                "rope",
                format!(
                    "{} frequency factors for a head of {} dimensions (want {})",
                    factors.len(),
                    self.head_dim,
                    self.inv_freq.len()
                ),
            ));
        }
        if let Some(bad) = factors.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
            return Err(shape_err(
                "rope",
                format!("frequency factor {bad} must be finite and > 0"),
            ));
        }
        for (f, &x) in self.inv_freq.iter_mut().zip(factors) {
            *f /= f64::from(x);
        }
        Ok(self)
    }

    /// The pair layout this rope uses.
    pub fn variant(&self) -> RopeVariant {
        self.variant
    }

    /// Head dimension the frequencies were built for.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Cosines and sines at each position (angles in f64, stored in f32).
    pub fn table(&self, positions: &[i64]) -> RopeTable {
        let half = self.head_dim / 2;
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &self.inv_freq {
                let a = p as f64 * f;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        RopeTable { half, cos, sin }
    }

    /// Rotates `x`, laid out `(rows, n_heads, head_dim)`, row `r` by the angles of table row `r`.
    pub fn apply(&self, table: &RopeTable, x: &mut [f32], n_heads: usize) -> Result<()> {
        let d = self.head_dim;
        let half = d / 2;
        let rows = table.len();
        if table.half != half || x.len() != rows * n_heads * d {
            return Err(shape_err(
                "rope",
                format!(
                    "x has {} values, expected {rows} rows x {n_heads} heads x {d}",
                    x.len()
                ),
            ));
        }
        for (r, row) in x.chunks_exact_mut(n_heads * d).enumerate() {
            let cos = &table.cos[r * half..(r + 1) * half];
            let sin = &table.sin[r * half..(r + 1) * half];
            for head in row.chunks_exact_mut(d) {
                match self.variant {
                    RopeVariant::RotateHalf => {
                        let (a, b) = head.split_at_mut(half);
                        for i in 0..half {
                            let (x0, x1) = (a[i], b[i]);
                            a[i] = x0 * cos[i] - x1 * sin[i];
                            b[i] = x0 * sin[i] + x1 * cos[i];
                        }
                    }
                    RopeVariant::Interleaved => {
                        for (i, pair) in head.chunks_exact_mut(2).enumerate() {
                            let (x0, x1) = (pair[0], pair[1]);
                            pair[0] = x0 * cos[i] - x1 * sin[i];
                            pair[1] = x0 * sin[i] + x1 * cos[i];
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Positional recovery: rotates row `r` of `x` (`(rows, n_heads, head_dim)`, keys computed
    /// at some position) by `deltas[r]` positions, so a key cached at `p` becomes the key at
    /// `p + delta` (rotations compose).
    pub fn rotate_by(&self, x: &mut [f32], n_heads: usize, deltas: &[i64]) -> Result<()> {
        if deltas.iter().all(|&d| d == 0) {
            return Ok(());
        }
        self.apply(&self.table(deltas), x, n_heads)
    }

    /// Reference built from candle primitives: returns the rotated copy of `x`
    /// (`(rows, n_heads, head_dim)`).
    pub fn apply_reference(&self, x: &Tensor, positions: &[i64]) -> Result<Tensor> {
        let (rows, _heads, d) = x.dims3()?;
        let half = d / 2;
        let dev = x.device();
        let pos: Vec<f64> = positions.iter().map(|&p| p as f64).collect();
        let pos = Tensor::from_vec(pos, (rows, 1), &Device::Cpu)?;
        let freq = Tensor::from_vec(self.inv_freq.clone(), (1, half), &Device::Cpu)?;
        let angles = pos.broadcast_mul(&freq)?;
        let cos = angles
            .cos()?
            .to_dtype(x.dtype())?
            .to_device(dev)?
            .unsqueeze(1)?;
        let sin = angles
            .sin()?
            .to_dtype(x.dtype())?
            .to_device(dev)?
            .unsqueeze(1)?;
        let out = match self.variant {
            RopeVariant::RotateHalf => {
                let a = x.narrow(2, 0, half)?;
                let b = x.narrow(2, half, half)?;
                let ra = (a.broadcast_mul(&cos)? - b.broadcast_mul(&sin)?)?;
                let rb = (a.broadcast_mul(&sin)? + b.broadcast_mul(&cos)?)?;
                Tensor::cat(&[ra, rb], 2)?
            }
            RopeVariant::Interleaved => {
                let (r, h, _) = x.dims3()?;
                let pairs = x.reshape((r, h, half, 2))?;
                let a = pairs.narrow(3, 0, 1)?.squeeze(3)?;
                let b = pairs.narrow(3, 1, 1)?.squeeze(3)?;
                let ra = (a.broadcast_mul(&cos)? - b.broadcast_mul(&sin)?)?;
                let rb = (a.broadcast_mul(&sin)? + b.broadcast_mul(&cos)?)?;
                Tensor::stack(&[ra, rb], 3)?.reshape((r, h, d))?
            }
        };
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
    }

    fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    #[test]
    fn kernel_matches_candle_reference_for_both_variants() -> Result<()> {
        for variant in [RopeVariant::RotateHalf, RopeVariant::Interleaved] {
            let rope = Rope::new(variant, 64, 1_000_000.0)?;
            let (rows, heads) = (7, 3);
            let positions: Vec<i64> = vec![0, 1, 5, 77, 1023, -3, 4096];
            let x = random(rows * heads * 64, 1);
            let mut got = x.clone();
            rope.apply(&rope.table(&positions), &mut got, heads)?;
            let xt = Tensor::from_vec(x, (rows, heads, 64), &Device::Cpu)?;
            let want = rope
                .apply_reference(&xt, &positions)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            assert!(max_abs_diff(&got, &want) < 1e-5, "{variant:?}");
        }
        Ok(())
    }

    #[test]
    fn rotations_compose_and_invert() -> Result<()> {
        for variant in [RopeVariant::RotateHalf, RopeVariant::Interleaved] {
            let rope = Rope::new(variant, 32, 10_000.0)?;
            let x = random(2 * 32, 2);
            let mut at_300 = x.clone();
            rope.apply(&rope.table(&[300, 300]), &mut at_300, 1)?;
            let mut stepwise = x.clone();
            rope.apply(&rope.table(&[100, 100]), &mut stepwise, 1)?;
            rope.apply(&rope.table(&[200, 200]), &mut stepwise, 1)?;
            assert!(max_abs_diff(&at_300, &stepwise) < 1e-4);
            rope.apply(&rope.table(&[-300, -300]), &mut stepwise, 1)?;
            assert!(max_abs_diff(&x, &stepwise) < 1e-4);
            // Rotation changes the vector (the test above is not vacuous).
            assert!(max_abs_diff(&x, &at_300) > 1e-2);
        }
        Ok(())
    }

    /// A factor f on pair i rotates it as a base frequency f times slower would: at position
    /// p, exactly the angle the unscaled rope gives at p / f. Pairs with factor 1 are unchanged.
    #[test]
    fn frequency_factors_slow_their_pairs_and_still_compose() -> Result<()> {
        let d = 8;
        let plain = Rope::new(RopeVariant::Interleaved, d, 10_000.0)?;
        let scaled = plain.clone().with_freq_factors(&[1.0, 1.0, 4.0, 8.0])?;
        let (a, b) = (plain.table(&[800]), scaled.table(&[800]));
        assert_eq!(a.cos[..2], b.cos[..2]);
        assert_eq!(plain.table(&[200]).cos[2], b.cos[2]);
        assert_eq!(plain.table(&[100]).sin[3], b.sin[3]);
        assert!((a.cos[3] - b.cos[3]).abs() > 1e-3);
        let x = random(d, 3);
        let mut at_300 = x.clone();
        scaled.apply(&scaled.table(&[300]), &mut at_300, 1)?;
        let mut stepwise = x;
        scaled.rotate_by(&mut stepwise, 1, &[100])?;
        scaled.rotate_by(&mut stepwise, 1, &[200])?;
        assert!(max_abs_diff(&at_300, &stepwise) < 1e-4);
        assert!(plain.clone().with_freq_factors(&[1.0; 3]).is_err());
        assert!(plain.with_freq_factors(&[1.0, 0.0, 1.0, 1.0]).is_err());
        Ok(())
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert!(Rope::new(RopeVariant::RotateHalf, 63, 1e4).is_err());
        assert!(Rope::new(RopeVariant::RotateHalf, 64, 0.5).is_err());
        let rope = Rope::new(RopeVariant::RotateHalf, 4, 1e4).expect("valid rope");
        let mut x = vec![0.0; 7];
        assert!(rope.apply(&rope.table(&[0, 1]), &mut x, 1).is_err());
    }
}
