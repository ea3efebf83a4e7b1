//! `target_probe_shift`'s per-layer step on the device: at every layer of a blended prefill,
//! each chunk's reused rows move as the chunk's recomputed rows (its picks) were moved by
//! recomputing, per kv head weighted by the softmax of the reused key's dot products with the
//! picks' keys (RoPE undone, scaled by `1/sqrt(head_dim)`). The CPU engine's step
//! (`reuse/shift.rs`, its reference) as batched matrix products over the kv heads, every
//! chunk in the same products (a mask keeps each chunk's rows to its own picks); which rows
//! move is decided once for both engines (`reuse::blend::blend_shift`).

use super::cache::{as_cached, as_f32, DeviceCache};
use super::model::DeviceModel;
use crate::error::{EngineError, Result};
use candle_core::Tensor;

/// The reused rows a device pass moves: every chunk's at once, each chunk's reused rows
/// weighing only its own picks.
pub(crate) struct DeviceShift {
    /// `None` where no chunk has both picks and reused rows.
    pub(crate) merged: Option<ShiftRows>,
}

/// Every live chunk's picks and reused rows, concatenated chunk after chunk, with everything
/// the per-layer step reads made on the device once per pass (every layer has the same
/// positions): no host work and no upload inside the layer loop, and one set of products per
/// layer whatever the number of chunks.
pub(crate) struct ShiftRows {
    /// Indices among the pass's rows of the recomputed tokens `(picks,)`.
    rows: Tensor,
    /// The positions of those tokens (`(picks,)` on the device).
    at: Tensor,
    /// Positions of the reused tokens, the rows moved (`(targets,)` on the device).
    targets: Tensor,
    /// The moved rows as scatter indexes `(n_kv_head, targets, head_dim)`.
    target_rows: Tensor,
    /// 0 where a reused row and a pick belong to the same chunk, -1e30 where not `(targets,
    /// picks)`: the softmax gives other chunks' picks no weight.
    same_chunk: Tensor,
    /// RoPE tables: undoing the picks' positions, undoing the targets', redoing the targets'.
    undo_at: Rotation,
    undo_targets: Rotation,
    redo_targets: Rotation,
}

/// A RoPE table on the device, one angle per row: `cos` and `sin` `(rows, head_dim / 2)`.
struct Rotation {
    cos: Tensor,
    sin: Tensor,
}

/// How recomputing moved the picks at a layer, kv-head-major `(n_kv_head, picks, head_dim)`:
/// K (RoPE undone), V, and the cached keys (RoPE undone) the weights compare with.
pub(crate) struct Moves {
    dk: Tensor,
    dv: Tensor,
    keys: Tensor,
}

impl DeviceModel {
    /// The device's form of a pass's shift groups ([`crate::engine::ShiftGroup`], built once
    /// for both engines by `reuse::blend::blend_shift`): the live groups' picks as row indices
    /// and positions, their targets, the chunk mask, and the RoPE tables and scatter indexes,
    /// uploaded once.
    pub(crate) fn shift_plan(
        &self,
        positions: &[usize],
        groups: &[crate::engine::ShiftGroup],
    ) -> Result<DeviceShift> {
        if let Some(&bad) = groups
            .iter()
            .flat_map(|g| &g.rows)
            .find(|&&i| i >= positions.len())
        {
            return Err(EngineError::InvalidInput(format!(
                "shift row {bad} of a pass of {} rows",
                positions.len()
            )));
        }
        let live: Vec<_> = groups
            .iter()
            .filter(|g| !g.rows.is_empty() && !g.targets.is_empty())
            .collect();
        if live.is_empty() {
            return Ok(DeviceShift { merged: None });
        }
        let rows: Vec<usize> = live.iter().flat_map(|g| g.rows.iter().copied()).collect();
        let at: Vec<usize> = rows.iter().map(|&i| positions[i]).collect();
        let targets: Vec<usize> = live
            .iter()
            .flat_map(|g| g.targets.iter().copied())
            .collect();
        let mut mask = vec![-1e30f32; targets.len() * rows.len()];
        let (mut t0, mut p0) = (0, 0);
        for g in &live {
            for t in t0..t0 + g.targets.len() {
                mask[t * rows.len() + p0..][..g.rows.len()].fill(0.0);
            }
            (t0, p0) = (t0 + g.targets.len(), p0 + g.rows.len());
        }
        let angles =
            |p: &[usize], sign: i64| -> Vec<i64> { p.iter().map(|&q| sign * q as i64).collect() };
        let index: Vec<u32> = rows.iter().map(|&i| i as u32).collect();
        Ok(DeviceShift {
            merged: Some(ShiftRows {
                rows: Tensor::from_vec(index, rows.len(), &self.device)?,
                at: self.positions_tensor(&at)?,
                targets: self.positions_tensor(&targets)?,
                target_rows: self.rows_index(&targets)?,
                same_chunk: Tensor::from_vec(mask, (targets.len(), rows.len()), &self.device)?,
                undo_at: self.table(&angles(&at, -1))?,
                undo_targets: self.table(&angles(&targets, -1))?,
                redo_targets: self.table(&angles(&targets, 1))?,
            }),
        })
    }

    /// The RoPE table of `angles` on the device.
    fn table(&self, angles: &[i64]) -> Result<Rotation> {
        let (cos, sin) = self.upload_table(&self.rope.table(angles), angles.len())?;
        Ok(Rotation { cos, sin })
    }

    /// `x` `(n_kv_head, n, head_dim)` rotated row by row by `table` (one angle per row).
    fn rotate_rows(&self, x: &Tensor, table: &Rotation) -> Result<Tensor> {
        let t = x.transpose(0, 1)?.contiguous()?;
        Ok(self
            .rotate(&t, &table.cos, &table.sin)?
            .transpose(0, 1)?
            .contiguous()?)
    }

    fn positions_tensor(&self, positions: &[usize]) -> Result<Tensor> {
        let at: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        Ok(Tensor::from_vec(at, positions.len(), &self.device)?)
    }

    /// How the pass's new rows `k` and `v` (kv-head-major, every row of the pass) move the
    /// picks at `layer`, taken before they overwrite the cache.
    pub(crate) fn shift_moves(
        &self,
        layer: usize,
        shift: &DeviceShift,
        cache: &DeviceCache,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Option<Moves>> {
        let Some(g) = &shift.merged else {
            return Ok(None);
        };
        let old_k = as_f32(&cache.k[layer].index_select(&g.at, 1)?)?;
        let old_v = as_f32(&cache.v[layer].index_select(&g.at, 1)?)?;
        let new_k = k.index_select(&g.rows, 1)?;
        let new_v = v.index_select(&g.rows, 1)?;
        Ok(Some(Moves {
            dk: self.rotate_rows(&(new_k - &old_k)?, &g.undo_at)?,
            dv: (new_v - old_v)?,
            keys: self.rotate_rows(&old_k, &g.undo_at)?,
        }))
    }

    /// Moves every reused row at `layer` by its own chunk's picks' moves weighted by key
    /// similarity (the K move rotated to each row's position).
    pub(crate) fn apply_shift(
        &self,
        layer: usize,
        shift: &DeviceShift,
        moves: &Option<Moves>,
        cache: &mut DeviceCache,
    ) -> Result<()> {
        let (Some(g), Some(m)) = (&shift.merged, moves) else {
            return Ok(());
        };
        let scale = 1.0 / (self.config.head_dim as f64).sqrt();
        let old_k = as_f32(&cache.k[layer].index_select(&g.targets, 1)?)?;
        let old_v = as_f32(&cache.v[layer].index_select(&g.targets, 1)?)?;
        let keys = self.rotate_rows(&old_k, &g.undo_targets)?;
        let scores = (keys.matmul(&m.keys.transpose(1, 2)?.contiguous()?)? * scale)?;
        let w = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&g.same_chunk)?)?;
        let dk = self.rotate_rows(&w.matmul(&m.dk)?, &g.redo_targets)?;
        let dv = w.matmul(&m.dv)?;
        let (k, v) = (as_cached(&(old_k + dk)?)?, as_cached(&(old_v + dv)?)?);
        cache.k[layer].scatter_set(&g.target_rows, &k.contiguous()?, 1)?;
        cache.v[layer].scatter_set(&g.target_rows, &v.contiguous()?, 1)?;
        Ok(())
    }
}
