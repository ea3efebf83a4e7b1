//! Chunking of documents by target tokens and BM25 retrieval over a tantivy index, with
//! document add, replace and delete per collection.
//!
//! Status: not implemented yet (issue 5). The crate exists so the workspace has its final shape;
//! it exports nothing.
