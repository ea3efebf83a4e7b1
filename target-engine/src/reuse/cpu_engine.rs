//! The CPU engine's side of [`Engine`]: [`Model`]'s forward passes, its probe, its shift hook
//! and its chunk KV ([`Precompute`]), over the growable host [`KvCache`].

use crate::config::ModelConfig;
use crate::engine::{Engine, ShiftGroup, ShiftRule};
use crate::error::{EngineError, Result};
use crate::kv::{ChunkKv, KvCache, PrefixKv};
use crate::model::Model;
use crate::reuse::chunk::Precompute;
use crate::reuse::shift::Shift;
use crate::tokenizer::Tokenizer;
use std::ops::Range;

impl Engine for Model {
    fn config(&self) -> &ModelConfig {
        Model::config(self)
    }

    fn tokenizer(&self) -> &Tokenizer {
        Model::tokenizer(self)
    }

    fn fingerprint(&self) -> &str {
        Model::fingerprint(self)
    }

    fn device_name(&self) -> String {
        "cpu".into()
    }

    fn rope_recovery_ok(&self) -> bool {
        Model::rope_recovery_ok(self)
    }

    fn empty_cache(&self, capacity: usize) -> Result<KvCache> {
        let mut cache = self.new_cache();
        cache.reserve(capacity);
        Ok(cache)
    }

    fn copy_cache(&self, cache: &KvCache) -> Result<KvCache> {
        Ok(cache.clone())
    }

    fn cache_len(&self, cache: &KvCache) -> usize {
        cache.len()
    }

    fn truncate_cache(&self, cache: &mut KvCache, len: usize) {
        cache.truncate(len);
    }

    fn reserve_cache(&self, cache: &mut KvCache, additional: usize) -> Result<()> {
        cache.reserve(additional);
        Ok(())
    }

    fn cache_from(&self, prefix: &KvCache, len: usize, capacity: usize) -> Result<KvCache> {
        if len > prefix.len() {
            return Err(EngineError::InvalidInput(format!(
                "{len} prefix rows asked of a cache of {}",
                prefix.len()
            )));
        }
        let mut cache = prefix.clone();
        cache.truncate(len);
        cache.reserve(capacity.saturating_sub(len));
        Ok(cache)
    }

    fn place(&self, cache: &mut KvCache, chunk: &ChunkKv, at: usize) -> Result<()> {
        self.place_chunk(cache, chunk, at)
    }

    fn prefix_of(&self, ids: &[u32]) -> Result<PrefixKv> {
        self.prefix_kv(ids)
    }

    fn chunk_kv(&self, ids: &[u32], prefix: Option<&PrefixKv>) -> Result<ChunkKv> {
        self.precompute(ids, prefix)
    }

    fn pass(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut KvCache,
        all: bool,
    ) -> Result<Vec<Vec<f32>>> {
        let out = self.forward(ids, positions, cache, false)?;
        if !all {
            return Ok(vec![self.last_logits(&out)?]);
        }
        let vocab = Model::tokenizer(self).vocab_size();
        let mut rows = self.logits(&out.hidden)?.to_vec2::<f32>()?;
        rows.iter_mut().for_each(|r| r.truncate(vocab));
        Ok(rows)
    }

    fn rows(&self, cache: &mut KvCache, ids: &[u32]) -> Result<Vec<Vec<f32>>> {
        self.rows_logits(cache, ids)
    }

    fn probe(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut KvCache,
        layers: Range<usize>,
    ) -> Result<Vec<f32>> {
        self.forward_probe(ids, positions, cache, layers)
    }

    fn shifted_pass(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut KvCache,
        groups: &[ShiftGroup],
        rule: ShiftRule,
    ) -> Result<Vec<f32>> {
        let shift = Shift {
            groups: groups.to_vec(),
            by_similarity: rule == ShiftRule::Similar,
        };
        let x = shift.forward(self, ids, positions, cache)?;
        self.residual_logits(&x)
    }
}
