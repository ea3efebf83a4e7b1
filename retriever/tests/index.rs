#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::sync::Arc;

use retriever::{
    chunk_document, ChunkParams, ChunkRecord, DocSummary, DocumentMeta, Index, IndexedChunk,
    RetrieverError,
};

/// Chunks `text` with the word tokenizer; keys are `key-{doc}-{position}`.
fn chunks(doc_id: &str, text: &str, max_tokens: usize) -> Vec<IndexedChunk> {
    chunk_document(doc_id, text, &common::words, &ChunkParams { max_tokens })
        .unwrap()
        .into_iter()
        .map(|chunk| IndexedChunk {
            key: format!("key-{doc_id}-{}", chunk.position),
            chunk,
        })
        .collect()
}

fn meta(id: &str, title: Option<&str>) -> DocumentMeta {
    DocumentMeta {
        id: id.to_string(),
        title: title.map(str::to_string),
    }
}

fn add(index: &Index, collection: &str, id: &str, text: &str) -> Vec<ChunkRecord> {
    index
        .add_document(collection, &meta(id, None), &chunks(id, text, 512))
        .unwrap()
}

fn hit_docs(index: &Index, collection: &str, query: &str) -> Vec<String> {
    index
        .search(collection, query, 10)
        .unwrap()
        .into_iter()
        .map(|h| h.record.doc_id)
        .collect()
}

fn corpus(index: &Index) {
    index
        .add_document(
            "wiki",
            &meta("fox", Some("Foxes")),
            &chunks(
                "fox",
                "The quick brown fox jumps.\n\nFoxes live in dens.",
                5,
            ),
        )
        .unwrap();
    add(
        index,
        "wiki",
        "dog",
        "A lazy dog sleeps all day in the sun.",
    );
    add(index, "wiki", "cat", "Cats chase mice; the fox watches.");
    index.commit().unwrap();
}

#[test]
fn search_finds_committed_chunks_with_their_records() {
    let index = Index::in_memory().unwrap();
    corpus(&index);
    let hits = index.search("wiki", "lazy dog", 10).unwrap();
    assert_eq!(hits.len(), 1);
    let r = &hits[0].record;
    assert!(hits[0].score > 0.0);
    assert_eq!(
        (
            r.doc_id.as_str(),
            r.collection.as_str(),
            r.position,
            r.tokens
        ),
        ("dog", "wiki", 0, 9)
    );
    assert_eq!(r.text, "A lazy dog sleeps all day in the sun.");
    assert_eq!(r.key, "key-dog-0");
    assert_eq!(r.title, None);
    assert_eq!(r.chunk_id.len(), 32);
}

#[test]
fn search_ranks_by_bm25_and_respects_top_k() {
    let index = Index::in_memory().unwrap();
    corpus(&index);
    // "fox" is in chunk 0 of `fox` and in `cat`; "Foxes" does not match (no stemming).
    let hits = index.search("wiki", "fox", 10).unwrap();
    assert!(hits.windows(2).all(|w| w[0].score >= w[1].score));
    let mut docs: Vec<_> = hits.iter().map(|h| h.record.doc_id.as_str()).collect();
    docs.sort();
    assert_eq!(docs, ["cat", "fox"]);
    // A chunk matching both words outranks one matching only the more common one.
    let hits = index.search("wiki", "fox quick", 10).unwrap();
    assert_eq!(hits[0].record.doc_id, "fox");
    assert_eq!(index.search("wiki", "fox", 1).unwrap().len(), 1);
}

#[test]
fn title_is_searched_too() {
    let index = Index::in_memory().unwrap();
    corpus(&index);
    let hits = index.search("wiki", "FOXES", 10).unwrap();
    // Both chunks of `fox` carry the title; "Foxes live in dens." also has the word.
    assert_eq!(hits.len(), 2);
    assert!(hits.iter().all(|h| h.record.doc_id == "fox"));
    assert!(hits
        .iter()
        .all(|h| h.record.title.as_deref() == Some("Foxes")));
}

#[test]
fn uncommitted_changes_are_not_searchable() {
    let index = Index::in_memory().unwrap();
    add(&index, "c", "d1", "hello world");
    assert!(index.search("c", "hello", 5).unwrap().is_empty());
    assert_eq!(index.num_chunks(), 0);
    index.commit().unwrap();
    assert_eq!(hit_docs(&index, "c", "hello"), ["d1"]);
    assert_eq!(index.num_chunks(), 1);
}

#[test]
fn search_is_filtered_by_collection() {
    let index = Index::in_memory().unwrap();
    add(&index, "red", "same", "shared words about tantivy");
    add(&index, "blue", "same", "shared words about tantivy");
    add(&index, "blue", "other", "tantivy again");
    index.commit().unwrap();
    let red = index.search("red", "tantivy", 10).unwrap();
    assert_eq!(red.len(), 1);
    assert_eq!(red[0].record.collection, "red");
    let blue = index.search("blue", "tantivy", 10).unwrap();
    assert_eq!(blue.len(), 2);
    assert!(blue.iter().all(|h| h.record.collection == "blue"));
    assert!(index.search("green", "tantivy", 10).unwrap().is_empty());
    // Same document id in two collections: distinct chunk ids.
    assert_ne!(red[0].record.chunk_id, blue[0].record.chunk_id);
}

/// Scores of `query` over collection `pub`'s documents, by document id.
fn scores(index: &Index, query: &str) -> Vec<(String, f32)> {
    let mut hits: Vec<(String, f32)> = index
        .search("pub", query, 10)
        .unwrap()
        .into_iter()
        .map(|h| (h.record.doc_id, h.score))
        .collect();
    hits.sort_by(|a, b| a.0.cmp(&b.0));
    hits
}

#[test]
fn scores_use_only_the_collections_own_statistics() {
    // The same two documents, alone and next to another collection full of the query's words
    // (long documents, the word in every one, deletions): equal scores, so another tenant's
    // documents neither change this collection's ranking nor show through its scores.
    let public = [
        ("a", "merger talks with the bank went on all week"),
        (
            "b",
            "the bank closed early; merger talks resume on monday morning",
        ),
    ];
    let alone = Index::in_memory().unwrap();
    let shared = Index::in_memory().unwrap();
    for (id, text) in public {
        add(&alone, "pub", id, text);
        add(&shared, "pub", id, text);
    }
    for i in 0..40 {
        let filler = "merger ".repeat(1 + i % 7) + &"word ".repeat(30);
        add(
            &shared,
            "secret",
            &format!("s{i}"),
            &format!("bank merger {filler}"),
        );
    }
    alone.commit().unwrap();
    shared.commit().unwrap();
    shared.delete_document("secret", "s0").unwrap();
    add(&shared, "pub", "gone", "bank bank bank merger");
    shared.commit().unwrap();
    shared.delete_document("pub", "gone").unwrap();
    shared.commit().unwrap();
    for query in ["merger", "bank talks", "merger bank monday"] {
        let (a, s) = (scores(&alone, query), scores(&shared, query));
        assert_eq!(a.len(), 2, "{query}");
        assert_eq!(a.len(), s.len(), "{query}");
        for ((id_a, score_a), (id_s, score_s)) in a.iter().zip(&s) {
            assert_eq!(id_a, id_s);
            assert!(
                (score_a - score_s).abs() <= 1e-5 * score_a.abs(),
                "{query}: {id_a} scores {score_a} alone, {score_s} beside another collection"
            );
        }
    }
}

#[test]
fn query_syntax_cannot_escape_the_collection_filter() {
    let index = Index::in_memory().unwrap();
    add(&index, "private", "p", "secret plans");
    add(&index, "public", "q", "open plans");
    index.commit().unwrap();
    for q in [
        "collection:private secret plans",
        "plans OR collection:private",
        "*",
    ] {
        let hits = index.search("public", q, 10).unwrap();
        assert!(hits.iter().all(|h| h.record.collection == "public"), "{q}");
        assert!(hits.len() <= 1, "{q}");
    }
}

#[test]
fn queries_with_special_characters_do_not_fail() {
    let index = Index::in_memory().unwrap();
    add(
        &index,
        "c",
        "d",
        "Rust (the language) is fast: AND safe - \"really\".",
    );
    index.commit().unwrap();
    for q in [
        "\"unterminated",
        "field:value",
        "(rust",
        "rust AND",
        "-rust",
        "AND OR NOT",
        "title:",
        "a:b:c",
        "[1 TO",
        "{x}",
        "rust^2",
        "safe~",
        "\\",
        "*?",
        "+ - && || ! ( ) { } [ ] ^ \" ~ * ? : \\ /",
        "日本語 😀",
    ] {
        index
            .search("c", q, 5)
            .unwrap_or_else(|e| panic!("query {q:?}: {e}"));
    }
    // Operators are plain words: "-rust" still finds rust, "AND" matches the word "and".
    assert_eq!(hit_docs(&index, "c", "-rust"), ["d"]);
    assert_eq!(hit_docs(&index, "c", "AND"), ["d"]);
    assert!(index.search("c", "?!", 5).unwrap().is_empty());
}

#[test]
fn empty_query_and_zero_top_k_are_errors_naming_the_field() {
    let index = Index::in_memory().unwrap();
    corpus(&index);
    for q in ["", "   \n"] {
        let err = index.search("wiki", q, 5).unwrap_err();
        assert!(
            matches!(err, RetrieverError::InvalidArgument { field: "query", .. }),
            "{err}"
        );
        assert!(err.is_bad_input());
    }
    let err = index.search("wiki", "fox", 0).unwrap_err();
    assert!(err.to_string().contains("top_k"), "{err}");
    let err = index.search("", "fox", 3).unwrap_err();
    assert!(err.to_string().contains("collection"), "{err}");
}

#[test]
fn huge_top_k_is_capped_not_allocated() {
    let index = Index::in_memory().unwrap();
    corpus(&index);
    assert_eq!(index.search("wiki", "fox", usize::MAX).unwrap().len(), 2);
}

#[test]
fn adding_a_document_again_replaces_all_its_chunks() {
    let index = Index::in_memory().unwrap();
    let first = add(&index, "c", "d", "old words here\n\nmore old words");
    assert!(first.is_empty(), "a new document replaces nothing");
    index.commit().unwrap();
    assert_eq!(index.chunks_of("c", "d").unwrap().len(), 1);

    let new_chunks = chunks("d", "fresh text", 512);
    let replaced = index
        .add_document("c", &meta("d", None), &new_chunks)
        .unwrap();
    assert_eq!(replaced.len(), 1);
    assert_eq!(replaced[0].text, "old words here\n\nmore old words");
    index.commit().unwrap();

    assert!(index.search("c", "old", 10).unwrap().is_empty());
    assert_eq!(hit_docs(&index, "c", "fresh"), ["d"]);
    let stored = index.chunks_of("c", "d").unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].text, "fresh text");
    assert_eq!(index.num_chunks(), 1);
    // Position-derived ids are stable across a replace.
    assert_eq!(stored[0].chunk_id, replaced[0].chunk_id);
}

#[test]
fn replacing_twice_before_commit_reports_the_pending_chunks() {
    let index = Index::in_memory().unwrap();
    add(&index, "c", "d", "version one");
    index.commit().unwrap();
    let replaced = add(&index, "c", "d", "version two");
    assert_eq!(replaced[0].text, "version one");
    let replaced = add(&index, "c", "d", "version three");
    assert_eq!(replaced[0].text, "version two");
    index.commit().unwrap();
    let stored = index.chunks_of("c", "d").unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].text, "version three");
}

#[test]
fn delete_returns_the_removed_records() {
    let index = Index::in_memory().unwrap();
    corpus(&index);
    let removed = index.delete_document("wiki", "fox").unwrap();
    let positions: Vec<usize> = removed.iter().map(|r| r.position).collect();
    assert_eq!(positions, [0, 1]);
    assert_eq!(removed[0].key, "key-fox-0");
    assert_eq!(removed[1].key, "key-fox-1");
    // Deleting again before commit removes nothing more.
    assert!(index.delete_document("wiki", "fox").unwrap().is_empty());
    index.commit().unwrap();
    assert!(index.chunks_of("wiki", "fox").unwrap().is_empty());
    assert_eq!(hit_docs(&index, "wiki", "fox"), ["cat"]);
    assert!(index.delete_document("wiki", "absent").unwrap().is_empty());
}

#[test]
fn delete_of_an_uncommitted_add_reports_its_chunks() {
    let index = Index::in_memory().unwrap();
    add(&index, "c", "d", "not yet committed");
    let removed = index.delete_document("c", "d").unwrap();
    assert_eq!(removed.len(), 1);
    assert_eq!(removed[0].key, "key-d-0");
    index.commit().unwrap();
    assert_eq!(index.num_chunks(), 0);
}

#[test]
fn delete_touches_only_its_collection() {
    let index = Index::in_memory().unwrap();
    add(&index, "a", "d", "same text");
    add(&index, "b", "d", "same text");
    index.commit().unwrap();
    assert_eq!(index.delete_document("a", "d").unwrap().len(), 1);
    index.commit().unwrap();
    assert_eq!(index.collections().unwrap(), [("b".to_string(), 1)]);
}

#[test]
fn documents_collections_and_chunks_are_listed() {
    let index = Index::in_memory().unwrap();
    corpus(&index);
    add(&index, "other", "solo", "one chunk only");
    index.commit().unwrap();

    let docs = index.documents(None).unwrap();
    let summary =
        |collection: &str, doc_id: &str, title: Option<&str>, chunks, tokens| DocSummary {
            collection: collection.into(),
            doc_id: doc_id.into(),
            title: title.map(str::to_string),
            chunks,
            tokens,
        };
    assert_eq!(
        docs,
        [
            summary("other", "solo", None, 1, 3),
            summary("wiki", "cat", None, 1, 6),
            summary("wiki", "dog", None, 1, 9),
            summary("wiki", "fox", Some("Foxes"), 2, 9),
        ]
    );
    assert_eq!(index.documents(Some("other")).unwrap(), docs[..1]);
    assert!(index.documents(Some("none")).unwrap().is_empty());
    assert_eq!(
        index.collections().unwrap(),
        [("other".to_string(), 1), ("wiki".to_string(), 4)]
    );
    assert_eq!(index.num_chunks(), 5);

    let fox = index.chunks_of("wiki", "fox").unwrap();
    assert_eq!(
        fox.iter().map(|r| r.text.as_str()).collect::<Vec<_>>(),
        ["The quick brown fox jumps.", "Foxes live in dens."]
    );
    assert!(index.chunks_of("wiki", "nope").unwrap().is_empty());
}

#[test]
fn emptied_collection_is_not_listed() {
    let index = Index::in_memory().unwrap();
    add(&index, "gone", "d", "bye");
    add(&index, "kept", "d", "hi");
    index.commit().unwrap();
    assert_eq!(index.collection_chunks("gone").unwrap(), 1);
    index.delete_document("gone", "d").unwrap();
    index.commit().unwrap();
    assert_eq!(index.collections().unwrap(), [("kept".to_string(), 1)]);
    assert_eq!(index.collection_chunks("gone").unwrap(), 0);
    assert_eq!(index.collection_chunks("kept").unwrap(), 1);
    assert_eq!(index.collection_chunks("never").unwrap(), 0);
    for (c, has) in [("gone", false), ("kept", true), ("never", false)] {
        assert_eq!(index.has_collection(c).unwrap(), has, "{c}");
    }
}

#[test]
fn bad_adds_are_rejected_naming_the_field() {
    let index = Index::in_memory().unwrap();
    let good = chunks("d", "text", 512);
    let cases: Vec<(&str, DocumentMeta, Vec<IndexedChunk>, &str)> = vec![
        ("", meta("d", None), good.clone(), "collection"),
        ("a\u{1f}b", meta("d", None), good.clone(), "collection"),
        ("c", meta("", None), chunks("", "text", 512), "id"),
        ("c", meta("d", None), Vec::new(), "chunks"),
        ("c", meta("other", None), good.clone(), "chunks"),
        (
            "c",
            meta("d", None),
            vec![IndexedChunk {
                key: String::new(),
                chunk: good[0].chunk.clone(),
            }],
            "chunks",
        ),
        (
            "c",
            meta("d", None),
            vec![good[0].clone(), good[0].clone()],
            "chunks",
        ),
    ];
    for (collection, doc, chunks, field) in cases {
        let err = index.add_document(collection, &doc, &chunks).unwrap_err();
        match &err {
            RetrieverError::InvalidArgument { field: f, .. } => assert_eq!(*f, field, "{err}"),
            other => panic!("expected InvalidArgument({field}), got {other}"),
        }
    }
    index.commit().unwrap();
    assert_eq!(index.num_chunks(), 0);
}

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

#[test]
fn committed_chunks_survive_reopen() {
    let dir = tempdir();
    {
        let index = Index::open(dir.path()).unwrap();
        corpus(&index);
    }
    let index = Index::open(dir.path()).unwrap();
    assert_eq!(index.num_chunks(), 4);
    assert_eq!(hit_docs(&index, "wiki", "lazy"), ["dog"]);
    assert_eq!(index.chunks_of("wiki", "fox").unwrap()[1].key, "key-fox-1");
}

#[test]
fn uncommitted_changes_are_lost_on_drop_and_the_index_stays_consistent() {
    let dir = tempdir();
    {
        let index = Index::open(dir.path()).unwrap();
        add(&index, "c", "kept", "committed words");
        index.commit().unwrap();
        add(&index, "c", "lost", "uncommitted words");
        index.delete_document("c", "kept").unwrap();
        // Dropped without commit, as in a crash.
    }
    let index = Index::open(dir.path()).unwrap();
    assert_eq!(hit_docs(&index, "c", "words"), ["kept"]);
    assert!(index.chunks_of("c", "lost").unwrap().is_empty());
    assert_eq!(index.num_chunks(), 1);
    // Still writable after the lost batch.
    add(&index, "c", "later", "later words");
    index.commit().unwrap();
    assert_eq!(index.num_chunks(), 2);
}

#[test]
fn a_flipped_byte_in_any_index_file_is_a_startup_error_or_harmless() {
    let original = tempdir();
    {
        let index = Index::open(original.path()).unwrap();
        corpus(&index);
        add(&index, "wiki", "owl", "Owls hunt at night; the fox sleeps.");
        index.commit().unwrap();
    }
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(original.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(files.len() > 3, "{files:?}");
    let (mut refused, mut opened) = (0, 0);
    for file in &files {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        if name.ends_with(".lock") {
            continue;
        }
        let len = std::fs::metadata(file).unwrap().len() as usize;
        for offset in [0, len / 3, len / 2, len.saturating_sub(9), len - 1] {
            let copy = tempdir();
            for f in &files {
                std::fs::copy(f, copy.path().join(f.file_name().unwrap())).unwrap();
            }
            let damaged = copy.path().join(&name);
            let mut bytes = std::fs::read(&damaged).unwrap();
            bytes[offset] ^= 0x5a;
            std::fs::write(&damaged, &bytes).unwrap();
            let what = format!("byte {offset} of {name}");
            let result = std::panic::catch_unwind(|| {
                Index::open(copy.path()).map(|index| {
                    // Searching an index that opened must not panic either.
                    let _ = index.search("wiki", "fox owls night", 4);
                    let _ = index.documents(None);
                })
            });
            match result {
                Err(_) => panic!("{what}: opening or searching panicked"),
                Ok(Err(e)) => {
                    let message = e.to_string();
                    assert!(
                        message.contains(&copy.path().display().to_string()),
                        "{what}: the error does not name the directory: {message}"
                    );
                    refused += 1;
                }
                Ok(Ok(())) => opened += 1,
            }
        }
    }
    eprintln!("{refused} refused, {opened} opened");
    assert!(refused > 0, "no damage was detected");
}

#[test]
fn open_creates_missing_directories() {
    let dir = tempdir();
    let nested = dir.path().join("a/b/index");
    let index = Index::open(&nested).unwrap();
    corpus(&index);
    assert!(Path::new(&nested).join("meta.json").exists());
}

#[test]
fn second_open_of_the_same_directory_is_an_error_naming_it() {
    let dir = tempdir();
    let _first = Index::open(dir.path()).unwrap();
    let err = match Index::open(dir.path()) {
        Ok(_) => panic!("a second writer on the same directory must be refused"),
        Err(e) => e,
    };
    assert!(matches!(err, RetrieverError::Directory { .. }), "{err}");
    assert!(err.to_string().contains(&dir.path().display().to_string()));
}

#[test]
fn opening_a_file_as_index_directory_is_an_error() {
    let dir = tempdir();
    let file = dir.path().join("file");
    std::fs::write(&file, b"not a directory").unwrap();
    let err = match Index::open(&file) {
        Ok(_) => panic!("a file is not an index directory"),
        Err(e) => e,
    };
    assert!(matches!(err, RetrieverError::Directory { .. }), "{err}");
}

#[test]
fn index_is_shared_between_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Index>();

    let index = Arc::new(Index::in_memory().unwrap());
    corpus(&index);
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let index = Arc::clone(&index);
            std::thread::spawn(move || {
                let id = format!("t{i}");
                add(&index, "threads", &id, &format!("thread number {i}"));
                index.search("wiki", "dog", 3).unwrap().len()
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), 1);
    }
    index.commit().unwrap();
    assert_eq!(index.search("threads", "thread", 10).unwrap().len(), 4);
}

#[test]
fn records_serialize_to_json() {
    let index = Index::in_memory().unwrap();
    corpus(&index);
    let hit = &index.search("wiki", "lazy", 1).unwrap()[0];
    let json = serde_json::to_value(hit).unwrap();
    assert_eq!(json["record"]["doc_id"], "dog");
    assert_eq!(json["record"]["key"], "key-dog-0");
    assert!(json["score"].as_f64().unwrap() > 0.0);
    let back: ChunkRecord = serde_json::from_value(json["record"].clone()).unwrap();
    assert_eq!(back, hit.record);
}

#[test]
fn directory_holding_another_schema_is_an_error_naming_it() {
    let dir = tempdir();
    let mut schema = tantivy::schema::Schema::builder();
    schema.add_text_field("something_else", tantivy::schema::TEXT);
    tantivy::Index::create_in_dir(dir.path(), schema.build()).unwrap();
    let err = match Index::open(dir.path()) {
        Ok(_) => panic!("an index with another schema must be refused"),
        Err(e) => e,
    };
    assert!(matches!(err, RetrieverError::Directory { .. }), "{err}");
    assert!(err.to_string().contains("different schema"), "{err}");
}

#[test]
fn rollback_drops_uncommitted_changes_and_all_keys_lists_committed_ones() {
    let index = Index::in_memory().unwrap();
    let tok = common::words;
    let chunks = |doc: &str, text: &str, key: &str| -> Vec<IndexedChunk> {
        chunk_document(doc, text, &tok, &ChunkParams::default())
            .unwrap()
            .into_iter()
            .map(|chunk| IndexedChunk {
                chunk,
                key: key.to_string(),
            })
            .collect()
    };
    let meta = |id: &str| DocumentMeta {
        id: id.to_string(),
        title: None,
    };
    index
        .add_document("c", &meta("a"), &chunks("a", "alpha text", "k1"))
        .unwrap();
    index.commit().unwrap();
    index
        .add_document("c", &meta("b"), &chunks("b", "beta text", "k2"))
        .unwrap();
    index.delete_document("c", "a").unwrap();
    index.rollback().unwrap();
    index.commit().unwrap();
    assert_eq!(
        index.chunks_of("c", "a").unwrap().len(),
        1,
        "delete rolled back"
    );
    assert!(
        index.chunks_of("c", "b").unwrap().is_empty(),
        "add rolled back"
    );
    let keys = index.all_keys().unwrap();
    assert_eq!(keys.into_iter().collect::<Vec<_>>(), vec!["k1".to_string()]);
    // One lookup answers what the pass over every record answers, for one key.
    assert!(index.refers("k1").unwrap());
    assert!(!index.refers("k2").unwrap(), "rolled back");
    index.delete_document("c", "a").unwrap();
    assert!(index.refers("k1").unwrap(), "not committed yet");
    index.commit().unwrap();
    assert!(!index.refers("k1").unwrap());
}

#[test]
fn a_directory_in_use_is_refused_saying_so() {
    let dir = tempfile::tempdir().unwrap();
    let first = Index::open(dir.path()).unwrap();
    let err = Index::open(dir.path()).err().map(|e| e.to_string());
    assert!(
        err.as_deref().is_some_and(
            |e| e.contains("is in use") && e.contains(&dir.path().display().to_string())
        ),
        "{err:?}"
    );
    drop(first);
    assert!(Index::open(dir.path()).is_ok(), "free again once closed");
}
