//! The KV cache on the device, and how rows are rounded and addressed in it.

use crate::error::{EngineError, Result};
use candle_core::{DType, Tensor};
use std::ops::Range;

/// The KV cache on the device: per layer, K and V `(n_kv_head, capacity, head_dim)` in
/// [`CACHE_DTYPE`], row `p` of each head holding position `p`. Head-major, so attention reads a
/// prefix of every head in place (no copy per step).
#[derive(Debug, Clone)]
pub struct DeviceCache {
    pub(super) k: Vec<Tensor>,
    pub(super) v: Vec<Tensor>,
    pub(super) capacity: usize,
    /// Rows held: one past the highest position written since the last truncation. Rows past
    /// it may hold anything; a pass writes a row before any query reads it.
    pub(super) len: usize,
}

impl DeviceCache {
    /// A cache of no layers and no room: what stands where a cache was moved out.
    pub(crate) fn placeholder() -> Self {
        Self {
            k: Vec::new(),
            v: Vec::new(),
            capacity: 0,
            len: 0,
        }
    }

    /// Rows held: one past the highest position written (since the last [`DeviceCache::truncate`]).
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no position is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets the rows from `len` on (they are overwritten before they are read again).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Notes rows up to `end` as written.
    pub(super) fn wrote(&mut self, end: usize) {
        self.len = self.len.max(end);
    }

    /// Room for at least `capacity` positions: each layer's K and V copied into larger
    /// tensors where it has less (at least doubling, so a decode grows it rarely).
    pub fn grow(&mut self, capacity: usize) -> Result<()> {
        if capacity <= self.capacity || self.k.is_empty() {
            return Ok(());
        }
        let to = capacity.max(2 * self.capacity);
        let extend = |t: &Tensor| -> Result<Tensor> {
            let (heads, rows, d) = t.dims3()?;
            let pad = Tensor::zeros((heads, to - rows, d), t.dtype(), t.device())?;
            Ok(Tensor::cat(&[t, &pad], 1)?)
        };
        for t in self.k.iter_mut().chain(self.v.iter_mut()) {
            *t = extend(t)?;
        }
        self.capacity = to;
        Ok(())
    }

    /// Positions the cache has room for.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Layer `layer`'s K rows of `range` (kv heads x head dim each), in host memory.
    pub fn k_rows(&self, layer: usize, range: Range<usize>) -> Result<Vec<f32>> {
        Ok(self.k[layer]
            .narrow(1, range.start, range.len())?
            .transpose(0, 1)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    /// Layer `layer`'s V rows of `range` (kv heads x head dim each), in host memory.
    pub fn v_rows(&self, layer: usize, range: Range<usize>) -> Result<Vec<f32>> {
        Ok(self.v[layer]
            .narrow(1, range.start, range.len())?
            .transpose(0, 1)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    /// Writes layer `layer`'s K and V rows `range` from host memory (kv heads x head dim
    /// each, as [`DeviceCache::k_rows`] reads them).
    pub fn set_rows(
        &mut self,
        layer: usize,
        range: Range<usize>,
        k: &[f32],
        v: &[f32],
    ) -> Result<()> {
        let (heads, len) = (self.k[0].dim(0)?, range.len());
        let d = self.k[0].dim(2)?;
        if layer >= self.k.len()
            || range.end > self.capacity
            || k.len() != len * heads * d
            || v.len() != k.len()
        {
            return Err(EngineError::InvalidInput(format!(
                "{} K and {} V values for rows {range:?} of layer {layer} ({} layers, {} rows of {heads} x {d})",
                k.len(),
                v.len(),
                self.k.len(),
                self.capacity
            )));
        }
        let device = self.k[layer].device().clone();
        let up = |x: &[f32]| -> Result<Tensor> {
            Ok(Tensor::from_slice(x, (len, heads, d), &device)?
                .transpose(0, 1)?
                .contiguous()?)
        };
        self.k[layer].slice_set(&as_cached(&up(k)?)?, 1, range.start)?;
        self.v[layer].slice_set(&as_cached(&up(v)?)?, 1, range.start)?;
        self.wrote(range.end);
        Ok(())
    }

    /// Copies rows `range` of `from` (a cache of the same model) into the same rows here.
    pub fn copy_rows(&mut self, from: &DeviceCache, range: Range<usize>) -> Result<()> {
        if range.is_empty() {
            return Ok(());
        }
        if range.end > self.capacity.min(from.capacity) || from.k.len() != self.k.len() {
            return Err(EngineError::InvalidInput(format!(
                "rows {range:?} of a {}-layer cache of {} into a {}-layer cache of {}",
                from.k.len(),
                from.capacity,
                self.k.len(),
                self.capacity
            )));
        }
        for (to, from) in self.k.iter().zip(&from.k).chain(self.v.iter().zip(&from.v)) {
            to.slice_set(
                &from.narrow(1, range.start, range.len())?.contiguous()?,
                1,
                range.start,
            )?;
        }
        self.wrote(range.end);
        Ok(())
    }

    /// A copy that shares nothing with this one (candle tensors are shared by clone).
    pub fn deep_copy(&self) -> Result<Self> {
        let copy = |t: &[Tensor]| {
            t.iter()
                .map(Tensor::copy)
                .collect::<candle_core::Result<_>>()
        };
        Ok(Self {
            k: copy(&self.k)?,
            v: copy(&self.v)?,
            capacity: self.capacity,
            len: self.len,
        })
    }
}

/// What the device cache holds: f16, as the CPU engine's cache ([`crate::KvCache`]) rounds
/// its rows and the chunk store keeps them, so a GPU prefill keeps the rows a stored chunk
/// gives back; half the memory and the reads of f32.
pub const CACHE_DTYPE: DType = DType::F16;

/// K or V rows as a cache keeps them: every value rounded to the nearest f16.
pub(crate) fn as_cached(rows: &Tensor) -> Result<Tensor> {
    Ok(rows.to_dtype(CACHE_DTYPE)?)
}

/// Cache rows as f32, for the arithmetic done on them outside the fused kernel (candle ops'
/// attention, the shift, RoPE recovery).
pub(crate) fn as_f32(rows: &Tensor) -> Result<Tensor> {
    Ok(rows.to_dtype(DType::F32)?)
}
