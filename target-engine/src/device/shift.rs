//! `target_probe_shift`'s per-layer step on the device: at every layer of a blended prefill,
//! each chunk's reused rows move as the chunk's recomputed rows (its picks) were moved by
//! recomputing, per kv head weighted by the softmax of the reused key's dot products with the
//! picks' keys (RoPE undone, scaled by `1/sqrt(head_dim)`). The CPU engine's step
//! (`reuse/shift.rs`, its reference) as batched matrix products over the kv heads; which rows
//! move is decided once for both engines (`reuse::blend::blend_shift`).

use super::cache::{as_cached, DeviceCache};
use super::model::DeviceModel;
use crate::error::{EngineError, Result};
use candle_core::Tensor;

/// The reused rows a device pass moves, chunk by chunk.
pub(crate) struct DeviceShift {
    pub(crate) groups: Vec<ShiftGroup>,
}

/// One chunk: its picks among the pass's rows and its reused positions, with everything
/// the per-layer step reads made on the device once per pass (every layer has the same
/// positions): no host work and no upload inside the layer loop.
pub(crate) struct ShiftGroup {
    /// Indices among the pass's rows of the chunk's recomputed tokens `(picks,)`.
    pub(crate) rows: Tensor,
    /// The positions of those tokens (`(picks,)` on the device).
    at: Tensor,
    /// Positions of the chunk's reused tokens, the rows moved (`(targets,)` on the device).
    targets: Tensor,
    /// The moved rows as scatter indexes `(n_kv_head, targets, head_dim)`.
    target_rows: Tensor,
    /// RoPE tables: undoing the picks' positions, undoing the targets', redoing the targets'.
    undo_at: Rotation,
    undo_targets: Rotation,
    redo_targets: Rotation,
    /// Whether the group moves anything (it has picks and targets).
    live: bool,
}

/// A RoPE table on the device, one angle per row: `cos` and `sin` `(rows, head_dim / 2)`.
struct Rotation {
    cos: Tensor,
    sin: Tensor,
}

/// How recomputing moved one group's picks at a layer, kv-head-major `(n_kv_head, picks,
/// head_dim)`: K (RoPE undone), V, and the cached keys (RoPE undone) the weights compare with.
pub(crate) struct Moves {
    dk: Tensor,
    dv: Tensor,
    keys: Tensor,
}

impl DeviceModel {
    /// The device's form of a pass's shift groups ([`crate::engine::ShiftGroup`], built once
    /// for both engines by `reuse::blend::blend_shift`): each group's picks as row indices and
    /// positions, its targets, and the RoPE tables and scatter indexes of both, uploaded once.
    pub(crate) fn shift_plan(
        &self,
        positions: &[usize],
        groups: &[crate::engine::ShiftGroup],
    ) -> Result<DeviceShift> {
        let mut out = Vec::with_capacity(groups.len());
        for g in groups {
            if let Some(&bad) = g.rows.iter().find(|&&i| i >= positions.len()) {
                return Err(EngineError::InvalidInput(format!(
                    "shift row {bad} of a pass of {} rows",
                    positions.len()
                )));
            }
            let at: Vec<usize> = g.rows.iter().map(|&i| positions[i]).collect();
            let rows: Vec<u32> = g.rows.iter().map(|&i| i as u32).collect();
            let angles = |p: &[usize], sign: i64| -> Vec<i64> {
                p.iter().map(|&q| sign * q as i64).collect()
            };
            out.push(ShiftGroup {
                rows: Tensor::from_vec(rows, g.rows.len(), &self.device)?,
                at: self.positions_tensor(&at)?,
                targets: self.positions_tensor(&g.targets)?,
                target_rows: self.rows_index(&g.targets)?,
                undo_at: self.table(&angles(&at, -1))?,
                undo_targets: self.table(&angles(&g.targets, -1))?,
                redo_targets: self.table(&angles(&g.targets, 1))?,
                live: !at.is_empty() && !g.targets.is_empty(),
            });
        }
        Ok(DeviceShift { groups: out })
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

    /// Per group, how the pass's new rows `k` and `v` (kv-head-major, every row of the pass)
    /// move its picks at `layer`, taken before they overwrite the cache.
    pub(crate) fn shift_moves(
        &self,
        layer: usize,
        shift: &DeviceShift,
        cache: &DeviceCache,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Vec<Option<Moves>>> {
        let mut out = Vec::with_capacity(shift.groups.len());
        for g in &shift.groups {
            if !g.live {
                out.push(None);
                continue;
            }
            let old_k = cache.k[layer].index_select(&g.at, 1)?;
            let old_v = cache.v[layer].index_select(&g.at, 1)?;
            let new_k = k.index_select(&g.rows, 1)?;
            let new_v = v.index_select(&g.rows, 1)?;
            out.push(Some(Moves {
                dk: self.rotate_rows(&(new_k - &old_k)?, &g.undo_at)?,
                dv: (new_v - old_v)?,
                keys: self.rotate_rows(&old_k, &g.undo_at)?,
            }));
        }
        Ok(out)
    }

    /// Moves each group's reused rows at `layer` by its picks' moves weighted by key
    /// similarity (the K move rotated to each row's position).
    pub(crate) fn apply_shift(
        &self,
        layer: usize,
        shift: &DeviceShift,
        moves: &[Option<Moves>],
        cache: &mut DeviceCache,
    ) -> Result<()> {
        if moves.len() != shift.groups.len() {
            return Err(EngineError::InvalidInput(format!(
                "{} moves for {} groups",
                moves.len(),
                shift.groups.len()
            )));
        }
        let scale = 1.0 / (self.config.head_dim as f64).sqrt();
        for (g, m) in shift.groups.iter().zip(moves) {
            let Some(m) = m else { continue };
            let old_k = cache.k[layer].index_select(&g.targets, 1)?;
            let old_v = cache.v[layer].index_select(&g.targets, 1)?;
            let keys = self.rotate_rows(&old_k, &g.undo_targets)?;
            let scores = (keys.matmul(&m.keys.transpose(1, 2)?.contiguous()?)? * scale)?;
            let w = candle_nn::ops::softmax_last_dim(&scores)?;
            let dk = self.rotate_rows(&w.matmul(&m.dk)?, &g.redo_targets)?;
            let dv = w.matmul(&m.dv)?;
            let (k, v) = (as_cached(&(old_k + dk)?)?, as_cached(&(old_v + dv)?)?);
            cache.k[layer].scatter_set(&g.target_rows, &k.contiguous()?, 1)?;
            cache.v[layer].scatter_set(&g.target_rows, &v.contiguous()?, 1)?;
        }
        Ok(())
    }
}
