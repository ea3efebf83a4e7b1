//! The device engine's side of [`Engine`]: [`DeviceModel`]'s passes over a [`DeviceCache`].
//! Everything a served method builds from them (the fused cache, target_probe's selection,
//! the blend and its shift, verified decoding) is the code the CPU engine runs.

use super::{DeviceCache, DeviceModel};
use crate::config::ModelConfig;
use crate::engine::{Engine, ShiftGroup, ShiftRule, Step, StepEngine};
use crate::error::{EngineError, Result};
use crate::kv::{ChunkKv, KvCache, PrecomputeMode, PrefixKv};
use crate::tokenizer::Tokenizer;
use candle_core::DeviceLocation;
use std::ops::Range;

impl Engine for DeviceModel {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    fn device_name(&self) -> String {
        match self.device.location() {
            DeviceLocation::Cpu => "device:cpu".into(),
            DeviceLocation::Cuda { gpu_id } => format!("device:cuda:{gpu_id}"),
            other => format!("device:{other:?}"),
        }
    }

    /// Positional recovery on the device rotates by the CPU engine's tables (the same
    /// [`kernels::Rope`]); the suite holds the two to each other (`tests/device_model.rs`).
    fn rope_recovery_ok(&self) -> bool {
        true
    }

    fn empty_cache(&self, capacity: usize) -> Result<DeviceCache> {
        self.new_cache(capacity)
    }

    fn copy_cache(&self, cache: &DeviceCache) -> Result<DeviceCache> {
        cache.deep_copy()
    }

    fn cache_len(&self, cache: &DeviceCache) -> usize {
        cache.len()
    }

    fn truncate_cache(&self, cache: &mut DeviceCache, len: usize) {
        cache.truncate(len);
    }

    fn reserve_cache(&self, cache: &mut DeviceCache, additional: usize) -> Result<()> {
        cache.grow(cache.len() + additional)
    }

    fn cache_from(&self, prefix: &KvCache, len: usize, capacity: usize) -> Result<DeviceCache> {
        let c = &self.config;
        if len > prefix.len() || prefix.n_layer() != c.n_layer || prefix.row_len() != c.kv_row() {
            return Err(EngineError::InvalidInput(format!(
                "{len} rows asked of a {}-layer prefix cache of {} rows of {} values",
                prefix.n_layer(),
                prefix.len(),
                prefix.row_len()
            )));
        }
        let mut cache = self.new_cache(capacity.max(len))?;
        if len > 0 {
            let n = len * c.kv_row();
            for l in 0..c.n_layer {
                cache.set_rows(l, 0..len, &prefix.k(l)[..n], &prefix.v(l)[..n])?;
            }
        }
        Ok(cache)
    }

    fn place(&self, cache: &mut DeviceCache, chunk: &ChunkKv, at: usize) -> Result<()> {
        self.place_chunk_kv(cache, chunk, at)
    }

    fn prefix_of(&self, ids: &[u32]) -> Result<PrefixKv> {
        let c = &self.config;
        let mut host = KvCache::new(c);
        if !ids.is_empty() {
            let (cache, _) = self.prefill(ids, ids.len())?;
            let positions: Vec<usize> = (0..ids.len()).collect();
            for l in 0..c.n_layer {
                host.place_rows(
                    l,
                    &positions,
                    &cache.k_rows(l, 0..ids.len())?,
                    &cache.v_rows(l, 0..ids.len())?,
                );
            }
            host.mark_filled(&positions);
        }
        Ok(PrefixKv {
            ids: ids.to_vec(),
            cache: host,
            hash: PrefixKv::hash_of(&self.fingerprint, ids),
        })
    }

    fn chunk_kv(&self, ids: &[u32], prefix: Option<&PrefixKv>) -> Result<ChunkKv> {
        if ids.is_empty() {
            return Err(EngineError::InvalidInput(
                "cannot precompute an empty chunk".into(),
            ));
        }
        let (base, mode) = match prefix {
            Some(p) => (
                p.ids.len(),
                PrecomputeMode::AfterPrefix {
                    prefix_hash: p.hash.clone(),
                },
            ),
            None => (0, PrecomputeMode::Standalone),
        };
        let end = base + ids.len();
        let mut cache = match prefix {
            Some(p) => self.cache_from(&p.cache, base, end)?,
            None => self.new_cache(end)?,
        };
        let positions: Vec<usize> = (base..end).collect();
        self.forward(ids, &positions, &mut cache)?;
        let (k, v) = self.export_rows(&cache, base..end)?;
        Ok(ChunkKv {
            fingerprint: self.fingerprint.clone(),
            ids: ids.to_vec(),
            base_pos: base,
            mode,
            row: self.config.kv_row(),
            k,
            v,
        })
    }

    fn pass(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut DeviceCache,
        all: bool,
    ) -> Result<Vec<Vec<f32>>> {
        let hidden = self.forward(ids, positions, cache)?;
        match all {
            true => self.logits(&hidden),
            false => Ok(vec![self.last_logits(&hidden)?]),
        }
    }

    fn rows(&self, cache: &mut DeviceCache, ids: &[u32]) -> Result<Vec<Vec<f32>>> {
        let start = cache.len();
        let mut steps = [Step { ids, start, cache }];
        self.decode_steps(&mut steps)?
            .pop()
            .ok_or_else(|| EngineError::Internal("a decode step returned no rows".into()))
    }

    fn probe(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut DeviceCache,
        layers: Range<usize>,
    ) -> Result<Vec<f32>> {
        DeviceModel::probe(self, ids, positions, cache, layers)
    }

    fn shifted_pass(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut DeviceCache,
        groups: &[ShiftGroup],
        rule: ShiftRule,
    ) -> Result<Vec<f32>> {
        if rule != ShiftRule::Similar {
            return Err(EngineError::InvalidInput(format!(
                "the device engine shifts reused rows by key similarity only; the {rule:?} \
                 rule runs on the CPU engine (`--device cpu`)"
            )));
        }
        let shift = self.shift_plan(positions, groups)?;
        self.shifted_forward(ids, positions, cache, &shift)
    }
}
