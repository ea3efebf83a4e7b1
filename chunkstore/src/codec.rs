//! How a blob's K/V payload is stored on disk: `raw` f16, or `lossless` (the same f16 values,
//! bit for bit, in fewer bytes).
//!
//! `lossless` is Blosc's recipe for floating-point arrays: each layer's values are laid out
//! channel by channel (a channel's values over the chunk's tokens share a magnitude, K's
//! outlier channels most of all), split into a plane of high bytes (sign, exponent, two
//! mantissa bits: few distinct values) and a plane of low bytes (mantissa: close to random),
//! and the planes go through zstd. Only the high plane compresses; zstd stores incompressible
//! blocks as they are, so the low plane costs a copy.

use half::f16;

use crate::error::FormatError;

/// zstd's level for `lossless`: level 1 compresses the high-byte planes nearly as well as the
/// default level 3 and encodes faster; ingestion writes every chunk once.
const ZSTD_LEVEL: i32 = 1;

/// A payload codec, chosen per store (`--kv-codec`) and recorded in every blob's header, so a
/// store reads blobs of every codec whatever it writes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Codec {
    /// Little-endian f16 values, K of every layer then V of every layer (format version 1's
    /// only payload; blobs written before codecs existed read as this). The default: measured
    /// on real chunks, `lossless` saves ~5% and decodes ~4x slower (see docs/usage.md, *Ingest*).
    #[default]
    Raw,
    /// The same values, channel-major, byte planes, zstd: bit-identical after decoding.
    Lossless,
    /// Lossy, 8 bits per value as in KIVI: keys quantized per channel (over the chunk's
    /// tokens), values per token, each group with its own minimum and step. Never served as
    /// exact: a lossy codec is part of the chunk key.
    Int8,
    /// [`Codec::Int8`] with 4 bits per value (15 steps per group).
    Int4,
    /// The same values, bit for bit, entropy-coded under a prediction of each value
    /// ([`crate::predictive`]): today each channel's mean and spread over the chunk's tokens.
    Predictive,
    /// [`Codec::Int8`]'s values, its codes entropy-coded under each channel's code mean and
    /// spread (the source note's coding "on top of FP8"): decodes to exactly `int8`'s values.
    Int8Predictive,
}

impl Codec {
    /// Every codec, for `--help` texts and tests.
    pub const ALL: [Codec; 6] = [
        Codec::Raw,
        Codec::Lossless,
        Codec::Int8,
        Codec::Int4,
        Codec::Predictive,
        Codec::Int8Predictive,
    ];

    /// The tag in the blob header (the header field was the dtype tag: 1 = raw f16).
    pub fn tag(self) -> u16 {
        match self {
            Codec::Raw => 1,
            Codec::Lossless => 2,
            Codec::Int8 => 3,
            Codec::Int4 => 4,
            Codec::Predictive => 5,
            Codec::Int8Predictive => 6,
        }
    }

    /// Whether decoding gives back other values than were stored.
    pub fn is_lossy(self) -> bool {
        self.bits().is_some()
    }

    /// Bits per value of a low-bit codec.
    pub(crate) fn bits(self) -> Option<u32> {
        match self {
            Codec::Int8 | Codec::Int8Predictive => Some(8),
            Codec::Int4 => Some(4),
            Codec::Raw | Codec::Lossless | Codec::Predictive => None,
        }
    }

    /// The codec of a header tag.
    pub fn from_tag(tag: u16) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.tag() == tag)
    }

    /// The name `--kv-codec` takes.
    pub fn name(self) -> &'static str {
        match self {
            Codec::Raw => "raw",
            Codec::Lossless => "lossless",
            Codec::Int8 => "int8",
            Codec::Int4 => "int4",
            Codec::Predictive => "predictive",
            Codec::Int8Predictive => "int8-predictive",
        }
    }
}

impl std::fmt::Display for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Codec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|c| c.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|c| c.name()).collect();
                format!(
                    "unknown KV codec `{s}` (expected one of {})",
                    names.join(", ")
                )
            })
    }
}

/// The `lossless` payload of `layers` (K of every layer, then V), each `tokens x row` values.
pub(crate) fn compress<'a>(layers: impl Iterator<Item = &'a [f16]>, row: usize) -> Vec<u8> {
    let mut planes = Vec::new();
    for layer in layers {
        shuffle_into(&mut planes, layer, row);
    }
    // Compressing a buffer into a Vec cannot fail but for allocation.
    zstd::bulk::compress(&planes, ZSTD_LEVEL).expect("zstd compresses any bytes")
}

/// Decodes a `lossless` payload of `n_layers` layers (K then V) of `tokens x row` values.
pub(crate) fn decompress(
    bytes: &[u8],
    n_layers: usize,
    tokens: usize,
    row: usize,
) -> Result<Vec<Vec<f16>>, FormatError> {
    let layer_values = tokens * row;
    let expected = n_layers * layer_values * 2;
    if layer_values == 0 {
        // Nothing was compressed but an empty frame.
        let planes = zstd::bulk::decompress(bytes, 0)
            .map_err(|e| FormatError::Codec(format!("lossless payload: {e}")))?;
        if !planes.is_empty() {
            return Err(FormatError::Codec("an empty payload holds bytes".into()));
        }
        return Ok(vec![Vec::new(); n_layers]);
    }
    // The capacity bounds the output: a payload that would inflate past it is refused.
    let planes = zstd::bulk::decompress(bytes, expected)
        .map_err(|e| FormatError::Codec(format!("lossless payload: {e}")))?;
    if planes.len() != expected {
        return Err(FormatError::Codec(format!(
            "lossless payload decodes to {} bytes, expected {expected}",
            planes.len()
        )));
    }
    Ok(planes
        .chunks_exact(layer_values * 2)
        .map(|p| unshuffle(p, tokens, row))
        .collect())
}

/// The payload bytes of a low-bit codec: per layer, 8 bytes of parameters per group and the
/// codes (`bits` per value, a layer's codes padded to whole bytes).
pub(crate) fn quantized_len(n_layers: usize, tokens: usize, row: usize, bits: u32) -> usize {
    let codes = (tokens * row * bits as usize).div_ceil(8);
    // K layers: one group per channel; V layers: one group per token.
    n_layers * (row * 8 + codes) + n_layers * (tokens * 8 + codes)
}

/// The low-bit payload of `k` then `v` layers (`tokens x row` each): K per channel, V per
/// token, each group stored as its minimum and step (f32) and `bits`-bit codes, rounded to
/// the nearest step.
pub(crate) fn quantize(
    k: &[Vec<f16>],
    v: &[Vec<f16>],
    tokens: usize,
    row: usize,
    bits: u32,
) -> Vec<u8> {
    let mut out = Vec::new();
    for layer in k {
        quantize_groups(&mut out, row, tokens, |g, i| layer[i * row + g], bits);
    }
    for layer in v {
        quantize_groups(&mut out, tokens, row, |g, i| layer[g * row + i], bits);
    }
    out
}

/// Appends `groups` groups of `len` values (`at(group, i)`): all parameters, then all codes.
fn quantize_groups(
    out: &mut Vec<u8>,
    groups: usize,
    len: usize,
    at: impl Fn(usize, usize) -> f16,
    bits: u32,
) {
    let top = ((1u32 << bits) - 1) as f32;
    let mut params = Vec::with_capacity(groups);
    for g in 0..groups {
        let (lo, hi) = (0..len)
            .map(|i| at(g, i).to_f32())
            .filter(|x| x.is_finite())
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), x| {
                (a.min(x), b.max(x))
            });
        let (lo, step) = if lo <= hi {
            (lo, (hi - lo) / top)
        } else {
            (0.0, 0.0)
        };
        out.extend_from_slice(&lo.to_le_bytes());
        out.extend_from_slice(&step.to_le_bytes());
        params.push((lo, step));
    }
    let mut pending: Option<u8> = None;
    for (g, &(lo, step)) in params.iter().enumerate() {
        for i in 0..len {
            let x = at(g, i).to_f32();
            // NaN (and a zero step) code as 0; `as` saturates.
            let q = if step > 0.0 {
                ((x - lo) / step).round().clamp(0.0, top) as u8
            } else {
                0
            };
            if bits == 8 {
                out.push(q);
            } else {
                match pending.take() {
                    None => pending = Some(q),
                    Some(first) => out.push(first | (q << 4)),
                }
            }
        }
    }
    if let Some(first) = pending {
        out.push(first);
    }
}

/// Decodes a low-bit payload of `n_layers` K and `n_layers` V layers of `tokens x row`.
#[allow(clippy::type_complexity)]
pub(crate) fn dequantize(
    bytes: &[u8],
    n_layers: usize,
    tokens: usize,
    row: usize,
    bits: u32,
) -> Result<(Vec<Vec<f16>>, Vec<Vec<f16>>), FormatError> {
    let want = quantized_len(n_layers, tokens, row, bits);
    if bytes.len() != want {
        return Err(FormatError::Codec(format!(
            "int{bits} payload holds {} bytes, expected {want}",
            bytes.len()
        )));
    }
    let mut pos = 0;
    let mut layer = |groups: usize, len: usize, per_channel: bool| {
        let params: Vec<(f32, f32)> = (0..groups)
            .map(|g| {
                let p = &bytes[pos + g * 8..pos + g * 8 + 8];
                (
                    f32::from_le_bytes([p[0], p[1], p[2], p[3]]),
                    f32::from_le_bytes([p[4], p[5], p[6], p[7]]),
                )
            })
            .collect();
        pos += groups * 8;
        let n = groups * len;
        let codes = &bytes[pos..pos + (n * bits as usize).div_ceil(8)];
        pos += codes.len();
        let mut out = vec![f16::ZERO; n];
        for (j, &(lo, step)) in params.iter().enumerate() {
            for i in 0..len {
                let idx = j * len + i;
                let q = if bits == 8 {
                    codes[idx]
                } else {
                    (codes[idx / 2] >> (4 * (idx % 2))) & 0x0f
                };
                let x = f16::from_f32(lo + f32::from(q) * step);
                // K groups are channels (values over tokens), V groups are tokens.
                let (t, c) = if per_channel { (i, j) } else { (j, i) };
                out[t * row + c] = x;
            }
        }
        out
    };
    let k = (0..n_layers).map(|_| layer(row, tokens, true)).collect();
    let v = (0..n_layers).map(|_| layer(tokens, row, false)).collect();
    Ok((k, v))
}

/// Appends one layer's values channel-major as a high-byte plane, then a low-byte plane.
fn shuffle_into(out: &mut Vec<u8>, layer: &[f16], row: usize) {
    let n = layer.len();
    let start = out.len();
    out.resize(start + 2 * n, 0);
    let (hi, lo) = out[start..].split_at_mut(n);
    let tokens = n.checked_div(row).unwrap_or(0);
    for (t, values) in layer.chunks_exact(row.max(1)).enumerate() {
        for (c, x) in values.iter().enumerate() {
            let [l, h] = x.to_le_bytes();
            hi[c * tokens + t] = h;
            lo[c * tokens + t] = l;
        }
    }
}

/// The inverse of [`shuffle_into`] for one layer's `2 * tokens * row` plane bytes.
fn unshuffle(planes: &[u8], tokens: usize, row: usize) -> Vec<f16> {
    let n = tokens * row;
    let (hi, lo) = planes.split_at(n);
    let mut out = vec![f16::ZERO; n];
    for (t, values) in out.chunks_exact_mut(row.max(1)).enumerate() {
        for (c, x) in values.iter_mut().enumerate() {
            *x = f16::from_le_bytes([lo[c * tokens + t], hi[c * tokens + t]]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bit_pattern_survives_including_nan_payloads_and_negative_zero() {
        // All 65536 f16 bit patterns as a 512-token x 128-wide layer, twice (K and V).
        let values: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let packed = compress([&values[..], &values[..]].into_iter(), 128);
        let back = decompress(&packed, 2, 512, 128).expect("decodes");
        for layer in &back {
            let bits: Vec<u16> = layer.iter().map(|x| x.to_bits()).collect();
            let want: Vec<u16> = values.iter().map(|x| x.to_bits()).collect();
            assert_eq!(bits, want);
        }
    }

    #[test]
    fn smooth_channels_compress_and_a_wrong_shape_is_refused() {
        // Each channel holds values of one magnitude, as K's channels do.
        let (tokens, row) = (256, 64);
        let layer: Vec<f16> = (0..tokens * row)
            .map(|i| {
                let (t, c) = (i / row, i % row);
                f16::from_f32((1 + c) as f32 * (1.0 + (t as f32 * 0.37).sin() * 0.1))
            })
            .collect();
        let packed = compress(std::iter::once(&layer[..]), row);
        assert!(
            packed.len() * 10 < layer.len() * 2 * 8,
            "{} bytes for {} raw",
            packed.len(),
            layer.len() * 2
        );
        assert_eq!(
            decompress(&packed, 1, tokens, row).expect("decodes")[0],
            layer
        );
        assert!(decompress(&packed, 1, tokens, row + 1).is_err());
        assert!(decompress(&packed, 2, tokens, row).is_err());
        assert!(decompress(&packed[..packed.len() - 1], 1, tokens, row).is_err());
    }

    #[test]
    fn low_bit_codecs_stay_within_half_a_step_of_every_value() {
        let (tokens, row) = (37, 24);
        let layer = |seed: usize| -> Vec<f16> {
            (0..tokens * row)
                .map(|i| {
                    let (t, c) = (i / row, i % row);
                    // Channel scales that differ by 100x, as K's outlier channels do.
                    let scale = if c % 7 == 0 { 20.0 } else { 0.2 };
                    f16::from_f32(scale * ((t * 31 + c * 17 + seed) as f32 * 0.37).sin())
                })
                .collect()
        };
        let k = vec![layer(1), layer(2)];
        let v = vec![layer(3), layer(4)];
        for codec in [Codec::Int8, Codec::Int4] {
            let bits = codec.bits().expect("low-bit");
            let packed = quantize(&k, &v, tokens, row, bits);
            assert_eq!(packed.len(), quantized_len(2, tokens, row, bits));
            let (k2, v2) = dequantize(&packed, 2, tokens, row, bits).expect("decodes");
            let top = ((1u32 << bits) - 1) as f32;
            // K per channel: the error bound is half of that channel's step.
            for (a, b) in k.iter().zip(&k2) {
                for c in 0..row {
                    let col: Vec<f32> = (0..tokens).map(|t| a[t * row + c].to_f32()).collect();
                    let span = col.iter().cloned().fold(f32::MIN, f32::max)
                        - col.iter().cloned().fold(f32::MAX, f32::min);
                    for t in 0..tokens {
                        let err = (a[t * row + c].to_f32() - b[t * row + c].to_f32()).abs();
                        assert!(
                            err <= span / top / 2.0 * 1.01 + 1e-2,
                            "{codec} K {err} > {span}/{top}/2"
                        );
                    }
                }
            }
            // V per token.
            for (a, b) in v.iter().zip(&v2) {
                for t in 0..tokens {
                    let r = &a[t * row..(t + 1) * row];
                    let span = r.iter().map(|x| x.to_f32()).fold(f32::MIN, f32::max)
                        - r.iter().map(|x| x.to_f32()).fold(f32::MAX, f32::min);
                    for c in 0..row {
                        let err = (a[t * row + c].to_f32() - b[t * row + c].to_f32()).abs();
                        assert!(err <= span / top / 2.0 * 1.01 + 1e-2, "{codec} V {err}");
                    }
                }
            }
            assert!(dequantize(&packed[1..], 2, tokens, row, bits).is_err());
            assert!(codec.is_lossy());
        }
        assert!(!Codec::Raw.is_lossy() && !Codec::Lossless.is_lossy());
    }

    #[test]
    fn names_and_tags_round_trip() {
        for c in Codec::ALL {
            assert_eq!(c.name().parse::<Codec>(), Ok(c));
            assert_eq!(Codec::from_tag(c.tag()), Some(c));
        }
        assert_eq!(
            Codec::from_tag(1),
            Some(Codec::Raw),
            "old blobs read as raw"
        );
        assert!("zip".parse::<Codec>().is_err());
        assert_eq!(Codec::from_tag(0), None);
    }
}
