//! The model's part of its cache identity: every load choice and CPU path that changes the
//! numbers a forward produces, described and hashed with the file's fingerprint.

use crate::weights::{Layer, Quant};
use candle_core::quantized::GgmlDType;

/// How forwards over many rows (a chunk's precompute, a prefill) multiply the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ManyRows {
    /// The same int8 kernels as few rows.
    Int8,
    /// Dense f32 GEMM on dequantized panels from this many rows on.
    DensePanels(usize),
    /// Dense f32 GEMM on dense copies of the weights from this many rows on.
    DenseCopies(usize),
}

/// Everything besides the file that changes the numbers a forward produces, hence the bytes
/// of stored KV: the model's part of its cache identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Numerics {
    pub(super) attention: &'static str,
    pub(super) requantize: Option<GgmlDType>,
    pub(super) many_rows: ManyRows,
    /// `kernel:format` of every weight matrix with its count, sorted.
    pub(super) weights: std::collections::BTreeMap<String, usize>,
}

impl Numerics {
    /// A stable, readable description (what [`Model::numerics`] shows).
    pub(super) fn describe(&self) -> String {
        let requantize = self
            .requantize
            .map_or_else(|| "none".to_string(), |ty| format!("requantized-{ty:?}"));
        let many_rows = match self.many_rows {
            ManyRows::Int8 => "int8".to_string(),
            ManyRows::DensePanels(n) => format!("dense-panels-from-{n}"),
            ManyRows::DenseCopies(n) => format!("dense-copies-from-{n}"),
        };
        let weights: Vec<String> = self
            .weights
            .iter()
            .map(|(form, n)| format!("{form}x{n}"))
            .collect();
        format!(
            "attention={};kv=f16;requantize={requantize};many_rows={many_rows};weights={}",
            self.attention,
            weights.join(",")
        )
    }
}

/// The kernel each weight matrix runs on and its format, counted.
pub(super) fn weight_forms(
    layers: &[Layer],
    embed: &Quant,
    lm_head: &Quant,
) -> std::collections::BTreeMap<String, usize> {
    let mut forms = std::collections::BTreeMap::new();
    let quants = layers
        .iter()
        .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down].map(|x| &x.quant))
        .chain([embed, lm_head]);
    for q in quants {
        *forms.entry(q.form()).or_insert(0) += 1;
    }
    forms
}

/// sha256 of the file's fingerprint and the numerics description, as 64 hex digits.
pub(crate) fn identity(file_fingerprint: &str, numerics: &str) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(b"specrag-model\0");
    for field in [file_fingerprint, numerics] {
        h.update((field.len() as u64).to_le_bytes());
        h.update(field.as_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (issue 57): every load choice that changes a forward's numbers changes the
    /// model's identity, bf16 attention included (this CPU may not load it, so the
    /// description is checked directly).
    #[test]
    fn every_numerics_choice_changes_the_identity() {
        let base = Numerics {
            attention: "f32",
            requantize: None,
            many_rows: ManyRows::DensePanels(8),
            weights: [("qmatrix:Q8_0".to_string(), 16)].into_iter().collect(),
        };
        let variants = [
            Numerics {
                attention: "bf16",
                ..base.clone()
            },
            Numerics {
                requantize: Some(GgmlDType::Q4_0),
                ..base.clone()
            },
            Numerics {
                many_rows: ManyRows::Int8,
                ..base.clone()
            },
            Numerics {
                many_rows: ManyRows::DenseCopies(8),
                ..base.clone()
            },
            Numerics {
                many_rows: ManyRows::DensePanels(9),
                ..base.clone()
            },
            Numerics {
                weights: [("packed:Q8_0".to_string(), 16)].into_iter().collect(),
                ..base.clone()
            },
            Numerics {
                weights: [("candle:Q6K".to_string(), 16)].into_iter().collect(),
                ..base.clone()
            },
        ];
        let id = |n: &Numerics| identity("file", &n.describe());
        for v in &variants {
            assert_ne!(id(&base), id(v), "{}", v.describe());
        }
        assert_ne!(
            identity("file", &base.describe()),
            identity("other", &base.describe())
        );
        assert_eq!(id(&base), id(&base.clone()));
        assert_eq!(id(&base).len(), 64);
    }
}
