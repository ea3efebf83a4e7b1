//! Reusing precomputed chunk KV: the RAG prompt's layout ([`assembly`]), a chunk's KV computed
//! once ([`chunk`]), the selectors that choose which reused tokens the target recomputes
//! ([`select`]), the blended prefill that fuses reused and recomputed rows ([`blend`]), the
//! default method's per-layer correction of the rows it reuses (`shift`), and the signals that
//! measure how far reuse moved the model ([`fidelity`]).

pub mod assembly;
pub mod blend;
pub mod chunk;
mod cpu_engine;
pub mod fidelity;
pub mod select;
pub mod shift;
