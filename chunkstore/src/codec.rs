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
    /// on real chunks, `lossless` saves ~5% and decodes ~4x slower (see the README).
    #[default]
    Raw,
    /// The same values, channel-major, byte planes, zstd: bit-identical after decoding.
    Lossless,
}

impl Codec {
    /// Every codec, for `--help` texts and tests.
    pub const ALL: [Codec; 2] = [Codec::Raw, Codec::Lossless];

    /// The tag in the blob header (the header field was the dtype tag: 1 = raw f16).
    pub fn tag(self) -> u16 {
        match self {
            Codec::Raw => 1,
            Codec::Lossless => 2,
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
                format!("unknown KV codec `{s}` (expected {})", names.join(" or "))
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
