//! Predictive lossless coding of f16 values (issue 43; docs/kv-coding.md has the method):
//! a predictor says where each value should be (a mean `mu` and a spread `sigma`), and an
//! entropy coder spends about `-log2 q(x)` bits on the true value `x` under the Gaussian
//! `q = N(mu, sigma)` discretized to the f16 values. The closer the prediction, the fewer bits;
//! a wrong one costs bits, never correctness: every one of the 65,536 bit patterns (NaN
//! payloads, infinities, -0, subnormals) keeps a nonzero probability, so decoding gives back
//! the exact bits.
//!
//! Each value is two symbols on constriction's ANS coder (a stack: encoded last to first,
//! decoded first to last):
//! - its *class*, sign and exponent field (64 symbols), under the Gaussian's mass over each
//!   class's value interval (a categorical model, with a small floor per class);
//! - its 10 mantissa bits, under the Gaussian in units of the class's ulp (constriction's leaky
//!   quantizer over 0..=1023), or uniform where the Gaussian is flat there or far away.
//!
//! Encoder and decoder must build identical models from `(mu, sigma)`: both are first snapped
//! to a grid by bit-level arithmetic (`sigma` to quarter octaves from its f32 bits, `mu` to
//! eighths of the snapped `sigma`), and the models of a grid point are computed by the same
//! code in the same order (no threads, no reductions of unknown order). The Gaussian's CDF is
//! the `probability` crate's, in f64: the same binary on the same platform gives the same
//! models; a store is read by the binary family that wrote it.
//!
//! The store's `predictive` codec ([`crate::Codec::Predictive`]) codes each layer with the
//! per-channel static model ([`Predictor::StaticChannel`]); a model-based predictor (the
//! speculator's KV mapped to the target's, as the source note does with a smaller model)
//! plugs in through [`encode`]/[`decode`] and a new predictor byte.

use std::collections::HashMap;

use constriction::stream::model::{
    DefaultContiguousCategoricalEntropyModel, DefaultLeakyQuantizer, DefaultUniformModel,
};
use constriction::stream::stack::DefaultAnsCoder;
use constriction::stream::{Decode, Encode};
use probability::distribution::{Distribution, Gaussian};

use crate::error::FormatError;
use half::f16;

/// Sign and exponent field of an f16: the class symbol.
const CLASSES: usize = 64;
/// Mass every class keeps whatever the prediction (an outlier's class costs ~20 bits).
const CLASS_FLOOR: f64 = 1e-6;
/// Beyond this many ulps of spread the mantissa is coded as uniform (10 bits).
const FLAT_ULPS: f64 = 400.0;
/// Quarter-octave steps of the snapped sigma, and eighths of it for the snapped mean.
const MU_STEPS: f64 = 8.0;
/// 2^(i/4) for i in 0..4.
const QUARTERS: [f64; 4] = [
    1.0,
    1.189_207_115_002_721,
    std::f64::consts::SQRT_2,
    1.681_792_830_507_429,
];

/// A prediction snapped to the grid both sides share.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    /// sigma = 2^(q_sigma / 4).
    q_sigma: i32,
    /// mu = q_mu * sigma / 8.
    q_mu: i64,
}

impl Key {
    /// Snaps `(mu, sigma)`: sigma to the quarter octave read from its f32 bits (exponent and
    /// the mantissa against the midpoints 2^(1/8), 2^(3/8), 2^(5/8), 2^(7/8)), mu to eighths
    /// of it. Non-finite or non-positive inputs snap to fixed points.
    fn new(mu: f32, sigma: f32) -> Self {
        let sigma = if sigma.is_finite() && sigma > 0.0 {
            sigma.max(f32::MIN_POSITIVE)
        } else if sigma.is_finite() {
            f32::MIN_POSITIVE
        } else {
            f32::MAX
        };
        let bits = sigma.to_bits();
        let exp = ((bits >> 23) & 0xff) as i32 - 127;
        let mant = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
        // Midpoints between quarter octaves, as f32 (the comparison is exact).
        const MIDS: [f32; 4] = [1.090_507_7, 1.296_839_6, 1.542_210_8, 1.834_008_1];
        let quarter = MIDS.iter().filter(|&&m| mant >= m).count() as i32;
        let q_sigma = (4 * exp + quarter).clamp(-100, 80);
        let snapped = sigma_of(q_sigma);
        let mu = if mu.is_finite() { f64::from(mu) } else { 0.0 };
        let q_mu = (mu * MU_STEPS / snapped).round().clamp(-1e12, 1e12) as i64;
        Self { q_sigma, q_mu }
    }

    fn sigma(self) -> f64 {
        sigma_of(self.q_sigma)
    }

    fn mu(self) -> f64 {
        self.q_mu as f64 * self.sigma() / MU_STEPS
    }
}

/// 2^(q / 4), exactly the same on both sides (a power of two times a constant).
fn sigma_of(q: i32) -> f64 {
    let (octave, quarter) = (q.div_euclid(4), q.rem_euclid(4));
    QUARTERS[quarter as usize] * 2f64.powi(octave)
}

/// The interval of magnitudes of an f16 exponent field, `[lo, hi)`, and its ulp.
fn binade(e: u16) -> (f64, f64, f64) {
    match e {
        0 => (0.0, 2f64.powi(-14), 2f64.powi(-24)),
        31 => (65_520.0, f64::INFINITY, f64::INFINITY),
        e => {
            let e = i32::from(e);
            (2f64.powi(e - 15), 2f64.powi(e - 14), 2f64.powi(e - 25))
        }
    }
}

type ClassModel = DefaultContiguousCategoricalEntropyModel;

/// Most class models kept (~256 bytes each): per-value predictions meet many grid points.
const MAX_CACHED: usize = 1 << 16;

/// The models of the grid points met so far (a model depends only on its point).
#[derive(Default)]
struct Models {
    classes: HashMap<Key, ClassModel>,
}

impl Models {
    fn class_model(&mut self, key: Key) -> Result<&ClassModel, FormatError> {
        // A model is a function of its key: forgetting them bounds memory, changes nothing.
        if self.classes.len() >= MAX_CACHED && !self.classes.contains_key(&key) {
            self.classes.clear();
        }
        Ok(match self.classes.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => e.insert(class_model(key)?),
        })
    }
}

/// The Gaussian's mass over each class (sign, exponent field), floored.
fn class_model(key: Key) -> Result<ClassModel, FormatError> {
    let g = Gaussian::new(key.mu(), key.sigma());
    let mut probs = [0f64; CLASSES];
    for (c, p) in probs.iter_mut().enumerate() {
        let (lo, hi, _) = binade((c & 31) as u16);
        let mass = if c < 32 {
            g.distribution(hi) - g.distribution(lo)
        } else {
            g.distribution(-lo) - g.distribution(-hi)
        };
        *p = mass.max(0.0) + CLASS_FLOOR;
    }
    ClassModel::from_floating_point_probabilities_fast(&probs, None)
        .map_err(|()| FormatError::Codec("class model".into()))
}

/// Where the mantissa of class `c` is expected under `key`, in ulps from the class's lower
/// edge, and the spread in ulps; `None` where it is flat or far: uniform.
fn mantissa_gaussian(key: Key, c: usize) -> Option<(f64, f64)> {
    let (lo, _, ulp) = binade((c & 31) as u16);
    if !ulp.is_finite() {
        return None;
    }
    let mu = if c < 32 { key.mu() } else { -key.mu() };
    let (mean, std) = ((mu - lo) / ulp, key.sigma() / ulp);
    let inside = mean > -3.0 * std && mean < 1023.0 + 3.0 * std;
    (std < FLAT_ULPS && inside).then_some((mean, std.max(0.3)))
}

/// Encodes the f16 bit patterns `values`, value `i` predicted by `predict(i)` = (mu, sigma).
pub fn encode(
    values: &[u16],
    predict: impl Fn(usize) -> (f32, f32),
) -> Result<Vec<u8>, FormatError> {
    let mut models = Models::default();
    let quantizer = DefaultLeakyQuantizer::new(0..=1023i32);
    let uniform = DefaultUniformModel::new(1024);
    // Symbols are pushed last to first: the decoder pops them first to last.
    let keys: Vec<Key> = (0..values.len())
        .map(|i| {
            let (mu, sigma) = predict(i);
            Key::new(mu, sigma)
        })
        .collect();
    let mut coder = DefaultAnsCoder::new();
    let bad = |e| FormatError::Codec(format!("predictive encode: {e:?}"));
    for (i, &x) in values.iter().enumerate().rev() {
        let (c, m) = (usize::from(x >> 10), i32::from(x & 0x3ff));
        let key = keys[i];
        match mantissa_gaussian(key, c) {
            Some((mean, std)) => coder
                .encode_symbol(m, quantizer.quantize(Gaussian::new(mean, std)))
                .map_err(bad)?,
            None => coder.encode_symbol(m as usize, uniform).map_err(bad)?,
        }
        coder
            .encode_symbol(c, models.class_model(key)?)
            .map_err(bad)?;
    }
    into_bytes(coder, "predictive encode")
}

/// Decodes `n` values encoded by [`encode`] with the same predictions.
pub fn decode(
    bytes: &[u8],
    n: usize,
    predict: impl Fn(usize) -> (f32, f32),
) -> Result<Vec<u16>, FormatError> {
    let mut coder = coder_from(bytes, "predictive payload")?;
    let mut models = Models::default();
    let quantizer = DefaultLeakyQuantizer::new(0..=1023i32);
    let uniform = DefaultUniformModel::new(1024);
    let bad = |e| FormatError::Codec(format!("predictive payload: {e:?}"));
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let (mu, sigma) = predict(i);
        let key = Key::new(mu, sigma);
        let c = coder.decode_symbol(models.class_model(key)?).map_err(bad)?;
        let m = match mantissa_gaussian(key, c) {
            Some((mean, std)) => coder
                .decode_symbol(quantizer.quantize(Gaussian::new(mean, std)))
                .map_err(bad)? as u16,
            None => coder.decode_symbol(uniform).map_err(bad)? as u16,
        };
        out.push(((c as u16) << 10) | m);
    }
    if !coder.is_empty() {
        return Err(FormatError::Codec(
            "predictive payload holds more than its values".into(),
        ));
    }
    Ok(out)
}

/// The coder's words as little-endian bytes.
fn into_bytes(coder: DefaultAnsCoder, what: &str) -> Result<Vec<u8>, FormatError> {
    let words = coder
        .into_compressed()
        .map_err(|e| FormatError::Codec(format!("{what}: {e:?}")))?;
    Ok(words.iter().flat_map(|w| w.to_le_bytes()).collect())
}

/// A coder over the words `bytes` holds (whole little-endian u32s).
fn coder_from(bytes: &[u8], what: &str) -> Result<DefaultAnsCoder, FormatError> {
    if !bytes.len().is_multiple_of(4) {
        return Err(FormatError::Codec(format!("{what} is not whole words")));
    }
    let words: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
        .collect();
    DefaultAnsCoder::from_compressed(words)
        .map_err(|_| FormatError::Codec(format!("{what}: bad final word")))
}

/// Mass every code keeps whatever the prediction (an outlier code costs ~20 bits).
const CODE_FLOOR: f64 = 1e-6;

/// The categorical model of a code prediction (its Gaussian's mass over each code's interval,
/// the ends open, floored), built once per distinct prediction: a chunk's predictions are
/// per channel, so a layer meets a few hundred.
#[derive(Default)]
struct CodeModels(HashMap<(u64, u64), ClassModel>);

impl CodeModels {
    fn get(&mut self, prediction: (f32, f32)) -> Result<&ClassModel, FormatError> {
        let (mean, std) = prediction;
        let (mean, std) = code_gaussian(mean, std);
        if self.0.len() >= MAX_CACHED {
            self.0.clear();
        }
        Ok(match self.0.entry((mean.to_bits(), std.to_bits())) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let g = Gaussian::new(mean, std);
                let cdf = |q: i32| match q {
                    q if q < 0 => 0.0,
                    q if q > 255 => 1.0,
                    q => g.distribution(f64::from(q) + 0.5),
                };
                let probs: Vec<f64> = (0..=255)
                    .map(|q| (cdf(q) - cdf(q - 1)).max(0.0) + CODE_FLOOR)
                    .collect();
                e.insert(
                    ClassModel::from_floating_point_probabilities_fast(&probs, None)
                        .map_err(|()| FormatError::Codec("code model".into()))?,
                )
            }
        })
    }
}

/// The code model of each of `stats` (built once each; a chunk layer's predictions are per
/// channel, so its codes index these by channel instead of hashing a prediction per code).
fn code_models(stats: &[(f32, f32)]) -> Result<Vec<ClassModel>, FormatError> {
    let mut models = CodeModels::default();
    stats.iter().map(|&p| models.get(p).cloned()).collect()
}

/// Encodes 8-bit codes (a low-bit codec's, as the source note codes FP8 caches), code `i`
/// under the Gaussian `predict(i)` = (mean, std) in code units, discretized to 0..=255.
pub fn encode_codes(
    codes: &[u8],
    predict: impl Fn(usize) -> (f32, f32),
) -> Result<Vec<u8>, FormatError> {
    let mut models = CodeModels::default();
    let mut coder = DefaultAnsCoder::new();
    for (i, &q) in codes.iter().enumerate().rev() {
        coder
            .encode_symbol(usize::from(q), models.get(predict(i))?)
            .map_err(|e| FormatError::Codec(format!("predictive codes: {e:?}")))?;
    }
    into_bytes(coder, "predictive codes")
}

/// Decodes `n` codes encoded by [`encode_codes`] with the same predictions.
pub fn decode_codes(
    bytes: &[u8],
    n: usize,
    predict: impl Fn(usize) -> (f32, f32),
) -> Result<Vec<u8>, FormatError> {
    let mut coder = coder_from(bytes, "predictive codes")?;
    let mut models = CodeModels::default();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let q = coder
            .decode_symbol(models.get(predict(i))?)
            .map_err(|e| FormatError::Codec(format!("predictive codes: {e:?}")))?;
        out.push(q as u8);
    }
    if !coder.is_empty() {
        return Err(FormatError::Codec(
            "predictive codes hold more than their values".into(),
        ));
    }
    Ok(out)
}

/// A code prediction made safe: finite mean, spread at least 0.3 of a code.
fn code_gaussian(mean: f32, std: f32) -> (f64, f64) {
    let mean = if mean.is_finite() {
        f64::from(mean).clamp(-1e3, 1e3)
    } else {
        127.5
    };
    let std = if std.is_finite() {
        f64::from(std).clamp(0.3, 1e4)
    } else {
        1e4
    };
    (mean, std)
}

/// The predictor a `predictive` payload was coded with (its first byte).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Predictor {
    /// Each channel's mean and standard deviation over the chunk's tokens, stored with the
    /// payload (8 bytes per channel and layer): no model, the baseline a model must beat.
    StaticChannel = 0,
}

/// Each channel's mean and standard deviation over the tokens of `layer` (`tokens x row`,
/// row-major), non-finite values left out; f64 sums in token order.
pub fn channel_stats(layer: &[f16], row: usize) -> Vec<(f32, f32)> {
    let tokens = layer.len().checked_div(row).unwrap_or(0);
    (0..row)
        .map(|c| {
            let (mut n, mut sum, mut sq) = (0usize, 0f64, 0f64);
            for t in 0..tokens {
                let v = f64::from(layer[t * row + c].to_f32());
                if v.is_finite() {
                    n += 1;
                    sum += v;
                    sq += v * v;
                }
            }
            let n = n.max(1) as f64;
            let mean = sum / n;
            let var = (sq / n - mean * mean).max(0.0);
            (mean as f32, var.sqrt() as f32)
        })
        .collect()
}

/// Appends `(mean, std)` pairs as little-endian f32s.
fn write_stats(out: &mut Vec<u8>, stats: &[(f32, f32)]) {
    for (m, s) in stats {
        out.extend_from_slice(&m.to_le_bytes());
        out.extend_from_slice(&s.to_le_bytes());
    }
}

/// A coded section's statistics, its coded bytes and what follows it.
type Section<'a> = (Vec<(f32, f32)>, &'a [u8], &'a [u8]);

/// A coded section of a payload: `n_stats` `(mean, std)` f32 pairs, the coded length (u64)
/// and the coded bytes; returns them and what follows (`None`: truncated).
fn read_section(bytes: &[u8], n_stats: usize) -> Option<Section<'_>> {
    let (head, tail) = bytes.split_at_checked(n_stats.checked_mul(8)?)?;
    let stats = head
        .chunks_exact(8)
        .map(|b| {
            (
                f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                f32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            )
        })
        .collect();
    let (len, tail) = tail.split_at_checked(8)?;
    let len = usize::try_from(u64::from_le_bytes(len.try_into().ok()?)).ok()?;
    let (coded, tail) = tail.split_at_checked(len)?;
    Some((stats, coded, tail))
}

/// The `predictive` payload of `layers` (K of every layer, then V), each `tokens x row`:
/// the predictor's byte, then per layer its channel statistics (mean and standard
/// deviation as f32, per channel), the coded length (u64) and the coded values.
pub(crate) fn compress<'a>(layers: impl Iterator<Item = &'a [f16]>, row: usize) -> Vec<u8> {
    let mut out = vec![Predictor::StaticChannel as u8];
    for layer in layers {
        let stats = channel_stats(layer, row);
        write_stats(&mut out, &stats);
        let bits: Vec<u16> = layer.iter().map(|v| v.to_bits()).collect();
        // The models always hold every symbol: encoding a finite stream cannot fail.
        let coded = encode(&bits, |i| stats[i % row]).expect("every value is encodable");
        out.extend_from_slice(&(coded.len() as u64).to_le_bytes());
        out.extend_from_slice(&coded);
    }
    out
}

/// Decodes a `predictive` payload of `n_layers` layers of `tokens x row` values.
pub(crate) fn decompress(
    bytes: &[u8],
    n_layers: usize,
    tokens: usize,
    row: usize,
) -> Result<Vec<Vec<f16>>, FormatError> {
    let short = || FormatError::Codec("predictive payload is truncated".into());
    let (&predictor, mut rest) = bytes.split_first().ok_or_else(short)?;
    if predictor != Predictor::StaticChannel as u8 {
        return Err(FormatError::Codec(format!(
            "predictive payload names predictor {predictor}, which this build does not know"
        )));
    }
    let mut layers = Vec::with_capacity(n_layers);
    for _ in 0..n_layers {
        let (stats, coded, tail) = read_section(rest, row).ok_or_else(short)?;
        let bits = decode(coded, tokens * row, |i| stats[i % row])?;
        layers.push(bits.into_iter().map(f16::from_bits).collect());
        rest = tail;
    }
    if !rest.is_empty() {
        return Err(FormatError::Codec(
            "predictive payload has trailing bytes".into(),
        ));
    }
    Ok(layers)
}

/// The mean and standard deviation of 8-bit codes laid out `groups x len` (group-major): per
/// group (`by_group`) or per position within the groups, as f32 (f64 sums in order).
pub fn code_stats(codes: &[u8], groups: usize, len: usize, by_group: bool) -> Vec<(f32, f32)> {
    let n = if by_group { groups } else { len };
    (0..n)
        .map(|j| {
            let at = |i: usize| {
                if by_group {
                    codes[j * len + i]
                } else {
                    codes[i * len + j]
                }
            };
            let count = if by_group { len } else { groups };
            let (mut sum, mut sq) = (0f64, 0f64);
            for i in 0..count {
                let q = f64::from(at(i));
                sum += q;
                sq += q * q;
            }
            let n = count.max(1) as f64;
            let mean = sum / n;
            ((mean) as f32, (sq / n - mean * mean).max(0.0).sqrt() as f32)
        })
        .collect()
}

/// Layers of an int8 payload ([`crate::Codec::Int8`]: K layers grouped per channel, then V
/// layers grouped per token), as `(groups, len, by_group)`: the codes' statistics run over
/// each channel either way.
fn int8_layers(n_layer: usize, tokens: usize, row: usize) -> Vec<(usize, usize, bool)> {
    let k = (0..n_layer).map(|_| (row, tokens, true));
    k.chain((0..n_layer).map(|_| (tokens, row, false)))
        .collect()
}

/// The `int8-predictive` payload: an int8 payload (the source note's "on top of FP8") whose
/// codes are entropy-coded, per layer: the group parameters as they were, each channel's
/// code mean and standard deviation (f32 pairs), the coded length (u64) and the codes coded
/// under those Gaussians ([`encode_codes`]). Decodes to the same int8 payload, byte for byte.
pub(crate) fn compress_int8(int8: &[u8], n_layer: usize, tokens: usize, row: usize) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = int8;
    for (groups, len, by_group) in int8_layers(n_layer, tokens, row) {
        let (params, tail) = rest.split_at(groups * 8);
        let (codes, tail) = tail.split_at(groups * len);
        rest = tail;
        let stats = code_stats(codes, groups, len, by_group);
        out.extend_from_slice(params);
        write_stats(&mut out, &stats);
        // Every code keeps a nonzero probability: encoding cannot fail.
        let models = code_models(&stats).expect("code models of finite statistics");
        let which = |i: usize| if by_group { i / len } else { i % len };
        let mut coder = DefaultAnsCoder::new();
        for (i, &q) in codes.iter().enumerate().rev() {
            coder
                .encode_symbol(usize::from(q), &models[which(i)])
                .expect("every code is encodable");
        }
        let coded = into_bytes(coder, "int8-predictive").expect("a finished coder's words");
        out.extend_from_slice(&(coded.len() as u64).to_le_bytes());
        out.extend_from_slice(&coded);
    }
    out
}

/// The int8 payload an `int8-predictive` payload of `n_layer` layers of `tokens x row` holds.
pub(crate) fn decompress_int8(
    bytes: &[u8],
    n_layer: usize,
    tokens: usize,
    row: usize,
) -> Result<Vec<u8>, FormatError> {
    let short = || FormatError::Codec("int8-predictive payload is truncated".into());
    let mut out = Vec::new();
    let mut rest = bytes;
    for (groups, len, by_group) in int8_layers(n_layer, tokens, row) {
        let n_stats = if by_group { groups } else { len };
        let (params, tail) = rest.split_at_checked(groups * 8).ok_or_else(short)?;
        let (stats, coded, tail) = read_section(tail, n_stats).ok_or_else(short)?;
        let models = code_models(&stats)?;
        let which = |i: usize| if by_group { i / len } else { i % len };
        let mut coder = coder_from(coded, "int8-predictive codes")?;
        out.extend_from_slice(params);
        for i in 0..groups * len {
            let q = coder
                .decode_symbol(&models[which(i)])
                .map_err(|e| FormatError::Codec(format!("int8-predictive codes: {e:?}")))?;
            out.push(q as u8);
        }
        if !coder.is_empty() {
            return Err(FormatError::Codec(
                "int8-predictive codes hold more than their values".into(),
            ));
        }
        rest = tail;
    }
    if !rest.is_empty() {
        return Err(FormatError::Codec(
            "int8-predictive payload has trailing bytes".into(),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn every_bit_pattern_survives_under_any_prediction() {
        let all: Vec<u16> = (0..=u16::MAX).collect();
        for (mu, sigma) in [
            (0.0f32, 1.0f32),
            (1000.0, 0.001),
            (-3.5, 1e-9),
            (f32::NAN, f32::INFINITY),
            (1e30, -1.0),
        ] {
            let bytes = encode(&all, |_| (mu, sigma)).expect("encode");
            let back = decode(&bytes, all.len(), |_| (mu, sigma)).expect("decode");
            assert!(back == all, "({mu}, {sigma})");
        }
    }

    #[test]
    fn more_grid_points_than_the_cache_holds_still_round_trip() {
        let n = MAX_CACHED + 5_000;
        let mu = |i: usize| i as f32 * 0.01;
        let bits: Vec<u16> = (0..n)
            .map(|i| f16::from_f32(mu(i) + 0.003).to_bits())
            .collect();
        let bytes = encode(&bits, |i| (mu(i), 0.002)).expect("encode");
        assert_eq!(decode(&bytes, n, |i| (mu(i), 0.002)).expect("decode"), bits);
    }

    #[test]
    fn codes_round_trip_and_a_narrow_channel_costs_few_bits() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let codes: Vec<u8> = (0..10_000)
            .map(|i: usize| {
                if i.is_multiple_of(2) {
                    rng.gen_range(120..136)
                } else {
                    rng.gen()
                }
            })
            .collect();
        let predict = |i: usize| {
            if i.is_multiple_of(2) {
                (127.5f32, 4.6f32)
            } else {
                (127.5, 74.0)
            }
        };
        let bytes = encode_codes(&codes, predict).expect("encode");
        assert_eq!(
            decode_codes(&bytes, codes.len(), predict).expect("decode"),
            codes
        );
        // Half the codes within 16 values (~4 bits), half uniform (~8): about 6 bits a code.
        let bits = bytes.len() as f64 * 8.0 / codes.len() as f64;
        assert!((5.5..7.0).contains(&bits), "{bits}");
        for odd in [(f32::NAN, f32::NAN), (1e9, -1.0)] {
            let b = encode_codes(&codes, |_| odd).expect("encode");
            assert_eq!(
                decode_codes(&b, codes.len(), |_| odd).expect("decode"),
                codes
            );
        }
    }

    #[test]
    fn a_close_prediction_costs_fewer_bits_and_a_wrong_one_is_refused() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let x: Vec<f32> = (0..20_000).map(|_| rng.gen_range(-4.0f32..4.0)).collect();
        let bits: Vec<u16> = x.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        // Predictions within ~1% of each value, then none (a wide static model).
        let noisy: Vec<f32> = x
            .iter()
            .map(|&v| v + 0.01 * rng.gen_range(-1.0f32..1.0))
            .collect();
        let close = encode(&bits, |i| (noisy[i], 0.006)).expect("encode");
        let wide = encode(&bits, |_| (0.0, 2.3)).expect("encode");
        let per = |b: &[u8]| b.len() as f64 * 8.0 / bits.len() as f64;
        assert!(per(&close) < 9.5, "close: {} bits/value", per(&close));
        assert!(per(&wide) > per(&close) + 2.0, "wide: {}", per(&wide));
        assert_eq!(
            decode(&close, bits.len(), |i| (noisy[i], 0.006)).expect("decode"),
            bits
        );
        // Another prediction decodes to other values or fails; never silently the same.
        let other = decode(&close, bits.len(), |_| (0.0, 2.3));
        assert!(other.map_or(true, |v| v != bits));
        assert!(decode(&close[..close.len() - 1], bits.len(), |i| (noisy[i], 0.006)).is_err());
    }
}
