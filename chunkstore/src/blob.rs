//! The unit of storage: one chunk's per-layer K/V cache, as the target engine precomputed it.

use half::f16;

use crate::error::FormatError;

/// One chunk's precomputed KV cache.
///
/// Mirrors the engine's own type without depending on it; the gateway converts between them.
#[derive(Debug, Clone, PartialEq)]
pub struct KvBlob {
    /// Fingerprint of the model that computed the cache.
    pub fingerprint: String,
    /// The chunk's token ids.
    pub ids: Vec<u32>,
    /// Position of the first token when the cache was computed.
    pub base_pos: u32,
    /// Precompute mode, e.g. `standalone` or `after_prefix:<hash>`.
    pub mode: String,
    /// Values per token row (kv heads x head dim).
    pub row: u32,
    /// Keys, one `Vec` per layer of `ids.len() * row` values.
    pub k: Vec<Vec<f16>>,
    /// Values, one `Vec` per layer of `ids.len() * row` values.
    pub v: Vec<Vec<f16>>,
    /// Speculator importance scores computed at ingestion, if any.
    pub scores: Option<SpecScores>,
}

/// Importance scores the speculator model gave the chunk's own tokens at ingestion.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecScores {
    /// Fingerprint of the speculator model.
    pub fingerprint: String,
    /// Name of the layer range the hidden-state norms were averaged over.
    pub layers: String,
    /// Character offsets `[start, end)` of each speculator token within the chunk text.
    pub offsets: Vec<(u32, u32)>,
    /// One score per speculator token.
    pub values: Vec<f32>,
}

impl KvBlob {
    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// True for a chunk without tokens.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.k.len()
    }

    /// Bytes of the K and V payload of every layer (what dominates memory and disk use).
    pub fn payload_bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|l| l.len() * 2).sum()
    }

    /// Checks that the dimensions agree: as many V layers as K layers, every layer
    /// `len() * row` values, one score per score offset, and offsets that are ranges.
    pub fn validate(&self) -> Result<(), FormatError> {
        let shape = |msg: String| Err(FormatError::Shape(msg));
        if self.k.len() != self.v.len() {
            return shape(format!(
                "{} K layers but {} V layers",
                self.k.len(),
                self.v.len()
            ));
        }
        let expected = self.ids.len() as u64 * u64::from(self.row);
        for (name, layers) in [("K", &self.k), ("V", &self.v)] {
            for (i, layer) in layers.iter().enumerate() {
                if layer.len() as u64 != expected {
                    return shape(format!(
                        "{name} layer {i} holds {} values, expected {} tokens x row {} = {expected}",
                        layer.len(),
                        self.ids.len(),
                        self.row
                    ));
                }
            }
        }
        if let Some(scores) = &self.scores {
            if scores.offsets.len() != scores.values.len() {
                return shape(format!(
                    "{} score offsets but {} score values",
                    scores.offsets.len(),
                    scores.values.len()
                ));
            }
            if let Some((i, (s, e))) = scores.offsets.iter().enumerate().find(|(_, (s, e))| s > e) {
                return shape(format!("score offset {i} is [{s}, {e}): start after end"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob() -> KvBlob {
        KvBlob {
            fingerprint: "m".into(),
            ids: vec![1, 2],
            base_pos: 0,
            mode: "standalone".into(),
            row: 3,
            k: vec![vec![f16::ZERO; 6]; 2],
            v: vec![vec![f16::ZERO; 6]; 2],
            scores: Some(SpecScores {
                fingerprint: "s".into(),
                layers: "last_third".into(),
                offsets: vec![(0, 2), (2, 5)],
                values: vec![0.5, 1.5],
            }),
        }
    }

    #[test]
    fn consistent_blob_validates() -> Result<(), FormatError> {
        let b = blob();
        b.validate()?;
        assert_eq!(b.len(), 2);
        assert_eq!(b.n_layers(), 2);
        assert_eq!(b.payload_bytes(), 2 * 2 * 6 * 2);
        Ok(())
    }

    #[test]
    fn each_inconsistency_is_a_shape_error() {
        let mut cases = Vec::new();
        let mut b = blob();
        b.v.pop();
        cases.push(b);
        let mut b = blob();
        b.k[1].push(f16::ONE);
        cases.push(b);
        let mut b = blob();
        b.row = 2;
        cases.push(b);
        let mut b = blob();
        b.ids.push(3);
        cases.push(b);
        let mut b = blob();
        if let Some(s) = &mut b.scores {
            s.values.push(2.0);
        }
        cases.push(b);
        let mut b = blob();
        if let Some(s) = &mut b.scores {
            s.offsets[1] = (5, 2);
        }
        cases.push(b);
        for b in cases {
            assert!(
                matches!(b.validate(), Err(FormatError::Shape(_))),
                "{b:?} should be rejected"
            );
        }
    }
}
