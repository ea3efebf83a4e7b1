//! Token importance from the speculator's hidden states (SpecCache Eq. 1): the mean L2 norm of a
//! token's hidden state over a range of deep layers. No LM head is run.

use candle_core::Tensor;
use target_engine::{Model, PrefixKv, Result};

/// Which layers the importance averages over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerRange {
    All,
    LastTwoThirds,
    /// The default (SpecCache).
    LastThird,
    Final,
}

impl LayerRange {
    /// Every range, in the order the ablation reports them.
    pub const ALL: [LayerRange; 4] = [
        LayerRange::All,
        LayerRange::LastTwoThirds,
        LayerRange::LastThird,
        LayerRange::Final,
    ];

    /// The name used on the command line and in reports.
    pub fn name(&self) -> &'static str {
        match self {
            Self::All => "all",
            Self::LastTwoThirds => "last_two_thirds",
            Self::LastThird => "last_third",
            Self::Final => "final",
        }
    }

    /// Parses a name of [`LayerRange::name`].
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.name() == s)
    }

    /// The layer indices for a model of `n_layer` layers.
    pub fn layers(&self, n_layer: usize) -> std::ops::Range<usize> {
        let start = match self {
            Self::All => 0,
            Self::LastTwoThirds => n_layer / 3,
            Self::LastThird => n_layer - n_layer / 3,
            Self::Final => n_layer.saturating_sub(1),
        };
        start.min(n_layer.saturating_sub(1))..n_layer
    }
}

/// Importance of every token of `ids` (positions `0..n`): mean over `range` of the L2 norm of
/// the residual stream after each layer.
pub fn importance(model: &Model, ids: &[u32], range: LayerRange) -> Result<Vec<f32>> {
    importance_after(model, None, ids, range)
}

/// Importance of `ids` placed after `prefix` (at positions `prefix.len()..`), attending to it.
/// Because attention is causal, this equals the scores the same tokens get inside any longer
/// text that starts with the prefix and them, which is what lets a chunk be scored at ingestion.
pub fn importance_after(
    model: &Model,
    prefix: Option<&PrefixKv>,
    ids: &[u32],
    range: LayerRange,
) -> Result<Vec<f32>> {
    let (mut cache, base) = match prefix {
        Some(p) => (p.cache.clone(), p.ids.len()),
        None => (model.new_cache(), 0),
    };
    let positions: Vec<usize> = (base..base + ids.len()).collect();
    let out = model.forward(ids, &positions, &mut cache, true)?;
    mean_norms(&out.layers, range, ids.len())
}

/// Mean L2 row norm over the layers of `range` (Eq. 1).
pub fn mean_norms(layers: &[Tensor], range: LayerRange, n: usize) -> Result<Vec<f32>> {
    let picked = range.layers(layers.len());
    let count = picked.len() as f32;
    let mut scores = vec![0f32; n];
    for l in picked {
        let norms = layers[l]
            .sqr()?
            .sum_keepdim(1)?
            .sqrt()?
            .flatten_all()?
            .to_vec1::<f32>()?;
        scores
            .iter_mut()
            .zip(norms)
            .for_each(|(s, n)| *s += n / count);
    }
    Ok(scores)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_ranges_for_30_layers() {
        assert_eq!(LayerRange::All.layers(30), 0..30);
        assert_eq!(LayerRange::LastTwoThirds.layers(30), 10..30);
        assert_eq!(LayerRange::LastThird.layers(30), 20..30);
        assert_eq!(LayerRange::Final.layers(30), 29..30);
        assert_eq!(LayerRange::LastThird.layers(2), 1..2);
    }
}
