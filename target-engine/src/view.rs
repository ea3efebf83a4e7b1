//! What a forward pass attends over when a drafter reads a view of the cache instead of every
//! row: the one seam between the model's forward and the decoding strategies that read less
//! (SpeCache's top-k view in `decode::sparse`, SpeContext's retrieval head in
//! `decode::specontext`).

use crate::error::Result;
use crate::kv::KvCache;
use kernels::AttentionShape;

/// Attention for a forward's query rows from a view of the cache (a drafter's), in place of
/// full attention over every row.
pub trait AttentionView {
    /// The attention output `(positions.len(), n_head, head_dim)` of queries `q` at
    /// `positions`, layer `layer`, over `cache` (whose rows at `positions` are already
    /// written for this layer).
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        positions: &[usize],
        cache: &KvCache,
        shape: AttentionShape,
    ) -> Result<Vec<f32>>;

    /// A forward pass of tokens `ids` at `positions` is about to run through the view: a view
    /// that chooses rows from the tokens themselves (SpeContext's retrieval head) does it here,
    /// before any layer. Nothing by default.
    fn begin_step(&mut self, ids: &[u32], positions: &[usize]) -> Result<()> {
        let _ = (ids, positions);
        Ok(())
    }

    /// A pass that did not run through the view wrote rows `start..` of the cache for tokens
    /// `ids` (a checking pass's kept rows). Nothing by default.
    fn rows_written(&mut self, start: usize, ids: &[u32]) -> Result<()> {
        let _ = (start, ids);
        Ok(())
    }

    /// Rows at or after `rows` were rewritten or dropped: forget anything derived from them.
    fn invalidate_from(&mut self, rows: usize);

    /// Bytes the view holds beside the cache.
    fn held_bytes(&self) -> usize;

    /// Cache rows read at full precision so far, summed over layers and kv heads, and the
    /// rows full attention would have read in the same calls.
    fn rows_read(&self) -> (u64, u64);

    /// Rows copied out of the cache into resident buffers so far, for a view that keeps its
    /// rows resident and loads only the ones that change (SpeContext's elastic loading).
    fn rows_loaded(&self) -> Option<u64> {
        None
    }
}
