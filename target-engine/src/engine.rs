//! The one interface the served path asks a target model through, whatever runs it: the CPU
//! engine ([`crate::Model`], the bit-exact reference) or the device engine
//! ([`crate::device::DeviceModel`], candle ops on a CUDA GPU or on the CPU). Prefill, chunk
//! precompute, chunk KV placed into a cache (KV import) and read out of one (export), the
//! question's probe, the blended pass with its shift, every row's logits for verification, and
//! batched decode steps ([`StepEngine`]).
//!
//! What is built from these is written once, generic over [`Engine`]: the fused cache, the
//! served selectors and the blended prefill (`reuse`), plain decoding (`decode::generate`),
//! verified decoding and the guard's `continue_exact` (`decode::verify`, `decode::checked`),
//! the decode batcher (`decode::batch`). A backend implements only the passes; where it
//! cannot run one, it returns an error naming it.

use crate::config::ModelConfig;
use crate::error::Result;
use crate::kv::{ChunkKv, KvCache, PrefixKv};
use crate::tokenizer::Tokenizer;
use std::ops::Range;

/// A target model's passes over an external cache of its own kind.
pub trait Engine: StepEngine + Send {
    /// Hyper-parameters.
    fn config(&self) -> &ModelConfig;
    /// The tokenizer built from the file.
    fn tokenizer(&self) -> &Tokenizer;
    /// The identity of the KV this engine writes: chunk KV carries it, and an engine refuses
    /// KV of another (the CPU engine's [`crate::Model::fingerprint`]; the device engine's
    /// names the device's numerics too).
    fn fingerprint(&self) -> &str;
    /// Where it runs: `cpu`, or the device engine's `device:cpu` / `device:cuda:N`.
    fn device_name(&self) -> String;
    /// Whether chunk KV may be moved to another position (positional recovery passed its
    /// self-test at load); a blend recomputes every chunk token where it may not.
    fn rope_recovery_ok(&self) -> bool;
    /// An empty cache with room for `capacity` positions (the CPU engine's grows past it).
    fn empty_cache(&self, capacity: usize) -> Result<Self::Cache>;
    /// A copy of `cache` that a pass may write without touching the original.
    fn copy_cache(&self, cache: &Self::Cache) -> Result<Self::Cache>;
    /// Rows `cache` holds: one past the highest position written.
    fn cache_len(&self, cache: &Self::Cache) -> usize;
    /// Forgets the rows of `cache` from `len` on.
    fn truncate_cache(&self, cache: &mut Self::Cache, len: usize);
    /// Room in `cache` for `additional` rows past those it holds.
    fn reserve_cache(&self, cache: &mut Self::Cache, additional: usize) -> Result<()>;
    /// A cache holding rows `0..len` of `prefix` exactly, with room for `capacity` positions.
    fn cache_from(&self, prefix: &KvCache, len: usize, capacity: usize) -> Result<Self::Cache>;
    /// KV import: `chunk`'s rows written at positions `at..`, K rotated from the position it
    /// was computed at to its place (positional recovery), rounded as every cache row is.
    fn place(&self, cache: &mut Self::Cache, chunk: &ChunkKv, at: usize) -> Result<()>;
    /// The template prefix's exact KV, computed once (its rows in host memory).
    fn prefix_of(&self, ids: &[u32]) -> Result<PrefixKv>;
    /// Chunk precompute (KV export): `ids`' KV computed alone or after `prefix`, in host
    /// memory in the chunk store's layout.
    fn chunk_kv(&self, ids: &[u32], prefix: Option<&PrefixKv>) -> Result<ChunkKv>;
    /// Every layer for `ids` at `positions` (sorted, any gaps), their rows written into
    /// `cache`, each attending causally by position to what the cache holds; the logits of
    /// every row (`all`) or of the last, cut to the vocabulary.
    fn pass(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut Self::Cache,
        all: bool,
    ) -> Result<Vec<Vec<f32>>>;
    /// Decode-path rows of `ids` fed at the end of `cache` (a token and the drafts after it):
    /// what verification checks drafts with. On the CPU engine each row's logits are, bit for
    /// bit, those of the one-token decode step at its position; on the device engine they come
    /// from one forward over the rows, equal to one-token steps up to the rounding of a
    /// several-row product (a verified answer may then split from one-token greedy decoding
    /// only at a near tie). Runs alone, outside any batcher.
    fn rows(&self, cache: &mut Self::Cache, ids: &[u32]) -> Result<Vec<Vec<f32>>>;
    /// The question's probe: the attention mass `ids` at `positions` pay to every position
    /// at `layers`, summed over rows, heads and those layers, one value per position up to
    /// the highest of `positions`. Only layers `0..layers.end` run; their rows are written.
    fn probe(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut Self::Cache,
        layers: Range<usize>,
    ) -> Result<Vec<f32>>;
    /// [`Engine::pass`] where at every layer each group's reused rows move as its picks
    /// moved there (`target_probe_shift`, by `rule`); the last row's logits.
    fn shifted_pass(
        &self,
        ids: &[u32],
        positions: &[usize],
        cache: &mut Self::Cache,
        groups: &[ShiftGroup],
        rule: ShiftRule,
    ) -> Result<Vec<f32>>;

    /// Full prefill of `ids` at `0..n` into a fresh cache with room for `capacity` positions;
    /// the cache and the last position's logits.
    fn prefill_into(&self, ids: &[u32], capacity: usize) -> Result<(Self::Cache, Vec<f32>)> {
        let mut cache = self.empty_cache(capacity.max(ids.len()))?;
        let positions: Vec<usize> = (0..ids.len()).collect();
        let logits = self.pass(ids, &positions, &mut cache, false)?;
        let last = logits.into_iter().next_back().ok_or_else(|| {
            crate::error::EngineError::InvalidInput("nothing to prefill: no tokens".into())
        })?;
        Ok((cache, last))
    }

    /// The full prefill of `ids` over a `cache` whose rows `0..start` already hold the KV of
    /// `ids[..start]` as a prefill computes it (an exact prefix kept from a blend): rows from
    /// `start` on are dropped and computed, attending to the kept ones; the last position's
    /// logits. The fidelity guard's escalation, which keeps the rows a full prefill computes
    /// alike.
    fn prefill_from(&self, cache: &mut Self::Cache, ids: &[u32], start: usize) -> Result<Vec<f32>> {
        if start >= ids.len() || start > self.cache_len(cache) {
            return Err(crate::error::EngineError::InvalidInput(format!(
                "prefill after {start} kept rows: the prompt has {} tokens and the cache {} rows",
                ids.len(),
                self.cache_len(cache)
            )));
        }
        self.truncate_cache(cache, start);
        let positions: Vec<usize> = (start..ids.len()).collect();
        let logits = self.pass(&ids[start..], &positions, cache, false)?;
        logits.into_iter().next_back().ok_or_else(|| {
            crate::error::EngineError::InvalidInput("nothing to prefill: no tokens".into())
        })
    }
}

/// How a reused row estimates its move from its chunk's picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShiftRule {
    /// As the picks whose keys it resembles: a softmax over key dot products per kv head (the
    /// default method, `target_probe_shift`).
    Similar,
    /// By the picks' mean move (the evaluation's `probe_shift`).
    Mean,
}

/// One chunk's reused rows, corrected at every layer of a pass as the chunk's recomputed rows
/// were moved at that layer (by the [`ShiftRule`]).
#[derive(Debug, Clone, Default)]
pub struct ShiftGroup {
    /// Indices, among the pass's rows, of the chunk's recomputed tokens.
    pub rows: Vec<usize>,
    /// Positions of the chunk's reused tokens, the rows corrected.
    pub targets: Vec<usize>,
}

/// What a [`crate::DecodeBatcher`] runs its passes on: one pass over several requests' steps.
pub trait StepEngine: Sync {
    /// A request's cache, moved into the pass and back.
    type Cache: Send + std::fmt::Debug;
    /// What stands where a cache was moved out while its step is in a pass (never read).
    fn placeholder(&self) -> Self::Cache;
    /// One pass over every step: each step's tokens at positions `start..` of its cache;
    /// per step, the logits after each of its tokens, cut to the vocabulary. Each step's
    /// logits must be what it gets alone.
    fn decode_steps(&self, steps: &mut [Step<'_, Self::Cache>]) -> Result<Vec<Vec<Vec<f32>>>>;
}

/// One request's part of a pass: `ids` fed at positions `start..` of `cache`.
#[derive(Debug)]
pub struct Step<'a, C> {
    pub ids: &'a [u32],
    pub start: usize,
    pub cache: &'a mut C,
}
