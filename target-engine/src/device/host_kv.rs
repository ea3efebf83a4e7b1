//! Chunk KV in host memory (f16, as the chunk store keeps it): downloaded from a device cache,
//! and placed into one at any position with its RoPE recovered on the device.

use super::cache::{as_cached, DeviceCache};
use super::model::DeviceModel;
use crate::error::{EngineError, Result};
use candle_core::{DType, Tensor};
use std::ops::Range;

/// A chunk's KV rows in host memory, every layer, in f16 as the chunk store keeps them,
/// computed at positions `base..base + len`: `k` and `v` laid out `(layer, kv head, row,
/// head_dim)` as the device cache holds them, so a chunk moves in one copy each.
#[derive(Debug, Clone)]
pub struct HostKv {
    pub base: usize,
    pub len: usize,
    pub k: Vec<half::f16>,
    pub v: Vec<half::f16>,
}

impl DeviceModel {
    /// Rows `range` of `cache` copied to host memory in f16, as a chunk store keeps them.
    pub fn download(&self, cache: &DeviceCache, range: Range<usize>) -> Result<HostKv> {
        let get = |layers: &[Tensor]| -> Result<Vec<half::f16>> {
            if range.is_empty() {
                return Ok(Vec::new());
            }
            let rows = layers
                .iter()
                .map(|t| t.narrow(1, range.start, range.len()))
                .collect::<candle_core::Result<Vec<_>>>()?;
            Ok(Tensor::stack(&rows, 0)?
                .to_dtype(DType::F16)?
                .flatten_all()?
                .to_vec1::<half::f16>()?)
        };
        Ok(HostKv {
            base: range.start,
            len: range.len(),
            k: get(&cache.k)?,
            v: get(&cache.v)?,
        })
    }

    /// Writes `kv` into `cache` at positions `at..at + kv.len`: one upload each for K and V,
    /// K rotated by `at - kv.base` positions on the device (positional recovery), then a copy
    /// per layer into the cache.
    pub fn place(&self, cache: &mut DeviceCache, kv: &HostKv, at: usize) -> Result<()> {
        let c = &self.config;
        let row = c.kv_row();
        let size = c.n_layer * kv.len * row;
        if at + kv.len > cache.capacity || kv.k.len() != size || kv.v.len() != size {
            return Err(EngineError::InvalidInput(format!(
                "a chunk KV of {} rows ({} K values, {} V values) does not fit at {at} in a \
                 {}-layer cache of {} positions",
                kv.len,
                kv.k.len(),
                kv.v.len(),
                c.n_layer,
                cache.capacity
            )));
        }
        if kv.len == 0 {
            return Ok(());
        }
        let shape = (c.n_layer, c.n_kv_head, kv.len, c.head_dim);
        let up = |data: &[half::f16]| -> Result<Tensor> {
            Ok(Tensor::from_slice(data, shape, &self.device)?.to_dtype(DType::F32)?)
        };
        let delta = at as i64 - kv.base as i64;
        let mut k = up(&kv.k)?;
        if delta != 0 {
            // One angle for every row: one "token" whose heads are all the chunk's.
            let (cos, sin) = self.upload_table(&self.rope.table(&[delta]), 1)?;
            let heads = c.n_layer * kv.len * c.n_kv_head;
            let flat = k.reshape((1, heads, c.head_dim))?;
            // Rotated in f32, then rounded as every cache write is (the CPU's `place_chunk`).
            k = as_cached(&self.rotate(&flat, &cos, &sin)?.reshape(shape)?)?;
        }
        let v = up(&kv.v)?;
        for l in 0..c.n_layer {
            cache.k[l].slice_set(&k.get(l)?, 1, at)?;
            cache.v[l].slice_set(&v.get(l)?, 1, at)?;
        }
        Ok(())
    }
}
