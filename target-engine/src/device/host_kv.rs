//! Chunk KV between host memory and a device cache, in the chunk store's layout
//! ([`ChunkKv`]: per layer, rows of kv heads x head dim in f16): a cache's rows read back, and
//! a chunk's rows placed into a cache at any position with their RoPE recovered on the device.

use super::cache::{as_cached, as_f32, DeviceCache};
use super::hot::{Key, Resident};
use super::model::DeviceModel;
use super::pinned::{HostKv, Staged};
use crate::error::{EngineError, Result};
use crate::kv::ChunkKv;
use candle_core::{DType, Tensor};
use half::f16;
use std::ops::Range;
use std::sync::Arc;

/// Per layer, rows of kv heads x head dim in f16: a chunk's K or V as the store keeps it.
type Layers = Vec<Vec<f16>>;

impl DeviceModel {
    /// Rows `range` of `cache`, per layer, K then V, in host memory in f16 (rows of kv heads
    /// x head dim): what a chunk store keeps.
    pub(super) fn export_rows(
        &self,
        cache: &DeviceCache,
        range: Range<usize>,
    ) -> Result<(Layers, Layers)> {
        if range.end > cache.capacity {
            return Err(EngineError::InvalidInput(format!(
                "rows {range:?} of a cache of {} positions",
                cache.capacity
            )));
        }
        let get = |layers: &[Tensor]| -> Result<Layers> {
            layers
                .iter()
                .map(|t| {
                    if range.is_empty() {
                        return Ok(Vec::new());
                    }
                    Ok(t.narrow(1, range.start, range.len())?
                        .transpose(0, 1)?
                        .to_dtype(DType::F16)?
                        .flatten_all()?
                        .to_vec1::<f16>()?)
                })
                .collect()
        };
        Ok((get(&cache.k)?, get(&cache.v)?))
    }

    /// Writes `chunk` into `cache` at positions `at..at + chunk.len()`: one upload each for K
    /// and V, K rotated by `at - chunk.base_pos` positions on the device (positional recovery)
    /// and rounded as every cache row is (the CPU's `place_chunk`), then a copy per layer.
    pub(super) fn place_chunk_kv(
        &self,
        cache: &mut DeviceCache,
        chunk: &ChunkKv,
        at: usize,
    ) -> Result<()> {
        let c = &self.config;
        let (row, n) = (c.kv_row(), chunk.len());
        if chunk.fingerprint != self.fingerprint {
            return Err(EngineError::InvalidInput(
                "chunk KV was computed by another model or engine".into(),
            ));
        }
        let shaped = |layers: &[Vec<f16>]| {
            layers.len() == c.n_layer && layers.iter().all(|l| l.len() == n * row)
        };
        if chunk.row != row || !shaped(&chunk.k) || !shaped(&chunk.v) {
            return Err(EngineError::InvalidInput(
                "chunk KV has the wrong shape for this model".into(),
            ));
        }
        if at + n > cache.capacity {
            return Err(EngineError::InvalidInput(format!(
                "a chunk of {n} rows does not fit at {at} in a cache of {} positions",
                cache.capacity
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let resident = self.resident(chunk)?;
        // f16 `(layer, row, kv head, head_dim)` as stored, laid out as the cache holds it.
        let lay = |t: &Tensor| -> Result<Tensor> { Ok(t.transpose(1, 2)?.contiguous()?) };
        let shape = (c.n_layer, c.n_kv_head, n, c.head_dim);
        let delta = at as i64 - chunk.base_pos as i64;
        let mut k = lay(&resident.k)?;
        if delta != 0 {
            // One angle for every row: one "token" whose heads are all the chunk's.
            let (cos, sin) = self.upload_table(&self.rope.table(&[delta]), 1)?;
            let heads = c.n_layer * n * c.n_kv_head;
            let flat = as_f32(&k)?.reshape((1, heads, c.head_dim))?;
            k = as_cached(&self.rotate(&flat, &cos, &sin)?.reshape(shape)?)?;
        }
        let v = lay(&resident.v)?;
        for l in 0..c.n_layer {
            cache.k[l].slice_set(&k.get(l)?, 1, at)?;
            cache.v[l].slice_set(&v.get(l)?, 1, at)?;
        }
        cache.wrote(at + n);
        Ok(())
    }

    /// `chunk`'s K and V on the device, f16 `(layer, row, kv head, head_dim)`: from the
    /// hot-chunk tier where it holds them, else uploaded (one copy each, from the pinned tier
    /// where that is on) and offered to it.
    fn resident(&self, chunk: &ChunkKv) -> Result<Resident> {
        let c = &self.config;
        let key = Key::of(chunk);
        if let Some(kv) = self.hot_lock().get(&key) {
            return Ok(kv);
        }
        let shape = (c.n_layer, chunk.len(), c.n_kv_head, c.head_dim);
        let kv = match self.staged(chunk, &key)? {
            Some(s) => Resident {
                k: s.k.upload(shape, &self.device)?,
                v: s.v.upload(shape, &self.device)?,
            },
            None => {
                let up = |layers: &[Vec<f16>]| -> Result<Tensor> {
                    Ok(Tensor::from_vec(layers.concat(), shape, &self.device)?)
                };
                Resident {
                    k: up(&chunk.k)?,
                    v: up(&chunk.v)?,
                }
            }
        };
        self.hot_lock().put(key, kv.clone(), chunk.bytes() as u64);
        Ok(kv)
    }

    /// `chunk`'s K and V in page-locked host memory where that tier is on: as it holds them,
    /// else copied there now (the one host copy an upload makes anyway) and kept.
    fn staged(&self, chunk: &ChunkKv, key: &Key) -> Result<Option<Arc<Staged>>> {
        {
            let mut tier = self.pinned_lock();
            if tier.budget() == 0 {
                return Ok(None);
            }
            if let Some(s) = tier.get(key) {
                return Ok(Some(s));
            }
        }
        let s = Arc::new(Staged {
            k: HostKv::stage(&chunk.k, &self.device)?,
            v: HostKv::stage(&chunk.v, &self.device)?,
        });
        self.pinned_lock()
            .put(key.clone(), s.clone(), chunk.bytes() as u64);
        Ok(Some(s))
    }
}
