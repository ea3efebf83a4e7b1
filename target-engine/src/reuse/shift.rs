//! The default method's correction of reused rows (`target_probe_shift`): at every layer of a
//! blended prefill, each chunk's reused rows move as the chunk's recomputed rows (its picks)
//! were moved by recomputing: per kv head weighted by the softmax of the reused key's dot
//! products with the picks' keys, or by the picks' mean. It runs as a [`LayerHook`] on the
//! model's hooked forward, which knows nothing of it. `device/shift.rs` does the same on a
//! candle device.

use crate::error::Result;
use crate::hook::LayerHook;
use crate::kv::KvCache;
use crate::model::Model;
use candle_core::Tensor;

pub use crate::engine::{ShiftGroup, ShiftRule};

/// The reused rows a pass corrects, chunk by chunk, and how each estimates its move.
#[derive(Debug, Clone, Default)]
pub(crate) struct Shift {
    pub groups: Vec<ShiftGroup>,
    /// Each reused row moves as the picks whose keys it resembles (a softmax over key dot
    /// products per kv head) instead of by the picks' mean.
    pub by_similarity: bool,
}

/// How recomputing moved one group's picks at a layer (rows of kv heads x head dim each).
#[derive(Debug, Clone, Default)]
struct Moves {
    /// New minus cached K, RoPE undone.
    dk: Vec<f32>,
    /// New minus cached V.
    dv: Vec<f32>,
    /// The cached keys, RoPE undone (only when weighing by similarity).
    keys: Vec<f32>,
}

/// Each row of `keys` (unrotated, rows of `heads` x `d`) moved per kv head by the picks'
/// moves weighted by the softmax of its dot products with the picks' keys at `1/sqrt(d)`:
/// attention with the rows as queries, the picks' keys as keys and their moves as values.
/// Every row sees every pick (all queries at the last pick's position), and the kernels'
/// tiles run it on the pool instead of one scalar loop per row, head and pick.
fn similarity_moves(
    keys: &[f32],
    m: &Moves,
    heads: usize,
    d: usize,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let shape = kernels::AttentionShape {
        n_head: heads,
        n_kv_head: heads,
        head_dim: d,
    };
    let picks = m.keys.len() / (heads * d);
    let last = vec![picks.saturating_sub(1); keys.len() / (heads * d)];
    Ok((
        kernels::causal_attention(keys, &last, &m.keys, &m.dk, shape)?,
        kernels::causal_attention(keys, &last, &m.keys, &m.dv, shape)?,
    ))
}

impl Shift {
    /// Every layer for `ids` at `positions`, with each group's reused rows corrected at every
    /// layer by the deviation of its recomputed rows there; returns the residual rows after
    /// the last layer (not normed).
    pub(crate) fn forward(
        &self,
        model: &Model,
        ids: &[u32],
        positions: &[usize],
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let mut hook = ShiftHook {
            model,
            shift: self,
            moves: Vec::new(),
        };
        model.forward_hooked(ids, positions, cache, &mut hook)
    }
}

/// A [`Shift`] under way in a pass: the moves of each group's picks at the current layer,
/// taken before the layer's rows are written and applied after.
struct ShiftHook<'a> {
    model: &'a Model,
    shift: &'a Shift,
    moves: Vec<Moves>,
}

impl LayerHook for ShiftHook<'_> {
    fn before_write(
        &mut self,
        layer: usize,
        positions: &[usize],
        k: &[f32],
        v: &[f32],
        cache: &KvCache,
    ) -> Result<()> {
        self.moves = self.shift_moves(layer, positions, cache, k, v)?;
        Ok(())
    }

    fn after_write(&mut self, layer: usize, cache: &mut KvCache) -> Result<()> {
        self.apply_shift(layer, cache)
    }
}

impl ShiftHook<'_> {
    /// Rows of keys at `at` (RoPE applied there) with RoPE undone.
    fn unrotated_keys(&self, layer: usize, keys: Vec<f32>, at: &[usize]) -> Result<Vec<f32>> {
        let mut keys = keys;
        let undo: Vec<i64> = at.iter().map(|&p| -(p as i64)).collect();
        self.model
            .rope_at(layer)
            .rotate_by(&mut keys, self.model.config().n_kv_head, &undo)?;
        Ok(keys)
    }

    /// Per group, how recomputing moves its picks at `layer`, taken before `new` overwrites
    /// their rows: `new - cached` for K (RoPE undone) and V, and, to weigh by similarity, the
    /// cached keys (RoPE undone).
    fn shift_moves(
        &self,
        layer: usize,
        positions: &[usize],
        cache: &KvCache,
        k: &[f32],
        v: &[f32],
    ) -> Result<Vec<Moves>> {
        let shift = self.shift;
        let row = cache.row_len();
        let mut out = Vec::with_capacity(shift.groups.len());
        for g in &shift.groups {
            if g.rows.is_empty() || g.targets.is_empty() {
                out.push(Moves::default());
                continue;
            }
            let (mut dk, mut dv, mut keys) = (Vec::new(), Vec::new(), Vec::new());
            let mut at = Vec::with_capacity(g.rows.len());
            for &i in &g.rows {
                let p = positions[i];
                let old_k = &cache.k(layer)[p * row..(p + 1) * row];
                let old_v = &cache.v(layer)[p * row..(p + 1) * row];
                dk.extend(
                    k[i * row..(i + 1) * row]
                        .iter()
                        .zip(old_k)
                        .map(|(a, b)| a - b),
                );
                dv.extend(
                    v[i * row..(i + 1) * row]
                        .iter()
                        .zip(old_v)
                        .map(|(a, b)| a - b),
                );
                if shift.by_similarity {
                    keys.extend_from_slice(old_k);
                }
                at.push(p);
            }
            out.push(Moves {
                dk: self.unrotated_keys(layer, dk, &at)?,
                dv,
                keys: match shift.by_similarity {
                    true => self.unrotated_keys(layer, keys, &at)?,
                    false => Vec::new(),
                },
            });
        }
        Ok(out)
    }

    /// Moves each group's reused rows at `layer` by its picks' moves (from
    /// [`ShiftHook::shift_moves`]): their mean, or per kv head their mean weighted by the softmax
    /// of the reused key's dot products with the picks' keys (scaled by `1/sqrt(head_dim)`);
    /// the K move rotated to each row's position.
    fn apply_shift(&self, layer: usize, cache: &mut KvCache) -> Result<()> {
        let (shift, moves) = (self.shift, &self.moves);
        let row = cache.row_len();
        let (heads, d) = (self.model.config().n_kv_head, self.model.config().head_dim);
        for (g, m) in shift.groups.iter().zip(moves) {
            if m.dk.is_empty() {
                continue;
            }
            let picks = m.dk.len() / row;
            let n = g.targets.len();
            let (mut dk, mut dv) = if shift.by_similarity {
                let old: Vec<f32> = g
                    .targets
                    .iter()
                    .flat_map(|&q| cache.k(layer)[q * row..(q + 1) * row].iter().copied())
                    .collect();
                let keys = self.unrotated_keys(layer, old, &g.targets)?;
                similarity_moves(&keys, m, heads, d)?
            } else {
                let mean = |x: &[f32]| -> Vec<f32> {
                    let mut out = vec![0.0f32; row];
                    for r in x.chunks_exact(row) {
                        out.iter_mut().zip(r).for_each(|(o, v)| *o += v);
                    }
                    out.iter_mut().for_each(|o| *o /= picks as f32);
                    out
                };
                (mean(&m.dk).repeat(n), mean(&m.dv).repeat(n))
            };
            let at: Vec<i64> = g.targets.iter().map(|&q| q as i64).collect();
            self.model.rope_at(layer).rotate_by(&mut dk, heads, &at)?;
            for (i, &q) in g.targets.iter().enumerate() {
                let cached_k = &cache.k(layer)[q * row..(q + 1) * row];
                let cached_v = &cache.v(layer)[q * row..(q + 1) * row];
                let r = i * row..(i + 1) * row;
                dk[r.clone()]
                    .iter_mut()
                    .zip(cached_k)
                    .for_each(|(o, c)| *o += c);
                dv[r].iter_mut().zip(cached_v).for_each(|(o, c)| *o += c);
            }
            cache.write(layer, &g.targets, &dk, &dv);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The moves weighed by key similarity through the attention kernel are the plain
    /// per-row, per-head softmax-weighted sums of the picks' moves.
    #[test]
    fn similarity_moves_are_the_softmax_weighted_picks_moves() -> Result<()> {
        let (heads, d, picks, n) = (2, 64, 5, 7);
        let row = heads * d;
        let keys: Vec<f32> = values(n * row, 11).iter().map(|x| 3.0 * x).collect();
        let m = Moves {
            dk: values(picks * row, 5),
            dv: values(picks * row, 9),
            keys: values(picks * row, 2).iter().map(|x| 3.0 * x).collect(),
        };
        let (dk, dv) = similarity_moves(&keys, &m, heads, d)?;
        let mut spread = 0.0f32;
        for t in 0..n {
            for h in 0..heads {
                let at = |x: &[f32], r: usize| x[r * row + h * d..r * row + (h + 1) * d].to_vec();
                let kt = at(&keys, t);
                let s: Vec<f32> = (0..picks)
                    .map(|p| {
                        let kp = at(&m.keys, p);
                        kt.iter().zip(&kp).map(|(a, b)| a * b).sum::<f32>() / (d as f32).sqrt()
                    })
                    .collect();
                let top = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = s.iter().map(|x| (x - top).exp()).collect();
                let sum: f32 = e.iter().sum();
                spread =
                    spread.max(e.iter().copied().fold(0.0, f32::max) / sum - 1.0 / picks as f32);
                for j in 0..d {
                    let want_k: f32 = (0..picks).map(|p| e[p] / sum * at(&m.dk, p)[j]).sum();
                    let want_v: f32 = (0..picks).map(|p| e[p] / sum * at(&m.dv, p)[j]).sum();
                    assert!((dk[t * row + h * d + j] - want_k).abs() < 1e-4);
                    assert!((dv[t * row + h * d + j] - want_v).abs() < 1e-4);
                }
            }
        }
        // The weights are far from uniform, so a mean would not pass the checks above.
        assert!(spread > 0.2, "{spread}");
        Ok(())
    }

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i + seed) * 7919 % 1000) as f32 / 500.0) - 1.0)
            .collect()
    }
}
