//! What a forward pass lets a strategy do to the cache at each layer: the one seam through
//! which a strategy corrects cached rows mid-pass without the forward knowing how (the
//! blended prefill's shift of reused rows in `reuse::shift`). Like [`crate::view`]'s
//! `AttentionView`, it lives in the core so the forward and the strategies both import it.

use crate::error::Result;
use crate::kv::KvCache;

/// Called by a hooked forward around each layer's cache write, before that layer's attention.
pub(crate) trait LayerHook {
    /// Layer `layer`'s new K (RoPE applied) and V rows of `positions` (rows of kv heads x head
    /// dim each, in the order of `positions`) are about to overwrite `cache`'s rows there.
    fn before_write(
        &mut self,
        layer: usize,
        positions: &[usize],
        k: &[f32],
        v: &[f32],
        cache: &KvCache,
    ) -> Result<()>;

    /// Layer `layer`'s new rows are written; its attention reads `cache` next.
    fn after_write(&mut self, layer: usize, cache: &mut KvCache) -> Result<()>;
}
