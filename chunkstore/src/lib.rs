//! Storage of precomputed chunk KV caches: a versioned, checksummed blob format, an in-memory
//! tier (moka, weighted by bytes) over an on-disk tier (sled), and hit/miss statistics.
//!
//! Status: not implemented yet (issue 5). The crate exists so the workspace has its final shape;
//! it exports nothing.
