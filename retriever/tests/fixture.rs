//! A small index committed in `tests/fixtures/index-v1` guards the on-disk format: a change to
//! the schema (or to tantivy's format) makes existing indexes unopenable, and this test says so
//! before users do.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};

use retriever::{chunk_document, ChunkParams, DocumentMeta, Index, IndexedChunk};

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/index-v1")
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

#[test]
fn committed_fixture_index_opens_and_answers() {
    // Opening takes a lock file and may clean up files, so work on a copy.
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture_dir(), dir.path());
    let index = Index::open(dir.path()).unwrap();
    assert_eq!(index.num_chunks(), 3);
    let hits = index.search("fixtures", "retrieval", 5).unwrap();
    assert_eq!(hits.len(), 1);
    let r = &hits[0].record;
    assert_eq!((r.doc_id.as_str(), r.position), ("guide", 1));
    assert_eq!(r.title.as_deref(), Some("Guide"));
    assert_eq!(r.key, "kv-guide-1");
    assert_eq!(r.tokens, 4);
    assert_eq!(r.chunk_id, "429ea3336979c7c5d79973daba7dd76a");

    // Chunk ids are derived the same way today: re-adding the document keeps them.
    let replaced = index
        .add_document("fixtures", &guide_meta(), &guide_chunks())
        .unwrap();
    index.commit().unwrap();
    let now = index.chunks_of("fixtures", "guide").unwrap();
    assert_eq!(replaced.len(), 3);
    assert_eq!(replaced, now);
}

fn guide_meta() -> DocumentMeta {
    DocumentMeta {
        id: "guide".into(),
        title: Some("Guide".into()),
    }
}

fn guide_chunks() -> Vec<IndexedChunk> {
    let text = "Chunks are cut by tokens.\n\nBM25 retrieval finds them.\n\nThe end.";
    chunk_document(
        "guide",
        text,
        &common::words,
        &ChunkParams { max_tokens: 5 },
    )
    .unwrap()
    .into_iter()
    .map(|chunk| IndexedChunk {
        key: format!("kv-guide-{}", chunk.position),
        chunk,
    })
    .collect()
}

/// Rewrites the fixture. Run on purpose only, when the format is meant to change (and bump the
/// directory's version): `cargo test --release -p retriever --test fixture -- --ignored`.
#[test]
#[ignore = "rewrites tests/fixtures/index-v1"]
fn write_fixture_index() {
    let dir = fixture_dir();
    let _ = std::fs::remove_dir_all(&dir);
    let index = Index::open(&dir).unwrap();
    index
        .add_document("fixtures", &guide_meta(), &guide_chunks())
        .unwrap();
    index.commit().unwrap();
    drop(index);
    // Lock files are made on open; the fixture does not need them.
    for lock in [".tantivy-meta.lock", ".tantivy-writer.lock"] {
        let _ = std::fs::remove_file(dir.join(lock));
    }
}
