//! Token importance from the speculator's hidden states (SpecCache Eq. 1): the mean L2 norm of a
//! token's hidden state over a range of deep layers. No LM head is run.

use target_engine::{Model, Result};

/// Which layers the importance averages over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerRange {
    All,
    LastTwoThirds,
    /// The default (SpecCache).
    LastThird,
    Final,
}

impl LayerRange {
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
    let mut cache = model.new_cache();
    let positions: Vec<usize> = (0..ids.len()).collect();
    let out = model.forward(ids, &positions, &mut cache, true)?;
    let layers = range.layers(out.layers.len());
    let count = layers.len() as f32;
    let mut scores = vec![0f32; ids.len()];
    for l in layers {
        let norms = out.layers[l]
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
