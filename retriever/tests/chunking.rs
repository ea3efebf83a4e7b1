#![allow(clippy::unwrap_used)]

mod common;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use retriever::{chunk_document, Chunk, ChunkParams, RetrieverError, TokenCount};

type Encode = fn(&str) -> (Vec<u32>, Vec<(usize, usize)>);

fn chunk(text: &str, tok: Encode, max_tokens: usize) -> Vec<Chunk> {
    let chunks = chunk_document("doc", text, &tok, &ChunkParams { max_tokens }).unwrap();
    check_invariants(text, &chunks, tok, max_tokens);
    chunks
}

fn texts(chunks: &[Chunk]) -> Vec<&str> {
    chunks.iter().map(|c| c.text.as_str()).collect()
}

/// Every promise of `chunk_document` about its output.
fn check_invariants(text: &str, chunks: &[Chunk], tok: Encode, max: usize) {
    let chars: Vec<char> = text.chars().collect();
    assert!(!chunks.is_empty());
    let mut covered_to = 0;
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!(c.position, i);
        assert_eq!(c.doc_id, "doc");
        assert!(
            !c.ids.is_empty() && c.ids.len() <= max,
            "chunk {i} has {} tokens, limit {max}: {:?}",
            c.ids.len(),
            c.text
        );
        assert_eq!(
            c.ids,
            tok(&c.text).0,
            "chunk {i} ids are not its own tokens"
        );
        assert!(c.start < c.end && c.end <= chars.len());
        let by_chars: String = chars[c.start..c.end].iter().collect();
        assert_eq!(c.text, by_chars, "chunk {i} offsets do not match its text");
        assert_eq!(c.text.trim(), c.text, "chunk {i} is not trimmed");
        assert!(c.start >= covered_to, "chunk {i} overlaps the previous one");
        assert!(
            chars[covered_to..c.start]
                .iter()
                .all(|ch| ch.is_whitespace()),
            "non-whitespace text before chunk {i} is in no chunk"
        );
        covered_to = c.end;
    }
    assert!(chars[covered_to..].iter().all(|ch| ch.is_whitespace()));
}

#[test]
fn whole_paragraphs_are_packed_greedily() {
    let text = "a b c\n\nd e\n\n\n  f g h i\n";
    let chunks = chunk(text, common::words, 6);
    assert_eq!(texts(&chunks), ["a b c\n\nd e", "f g h i"]);
    assert_eq!((chunks[1].start, chunks[1].end), (15, 22));
}

#[test]
fn short_document_is_one_chunk() {
    let chunks = chunk("  Just one line.  ", common::words, 512);
    assert_eq!(texts(&chunks), ["Just one line."]);
    assert_eq!((chunks[0].start, chunks[0].end), (2, 16));
    assert_eq!(chunks[0].ids, vec![4, 3, 5]);
}

#[test]
fn packing_uses_the_joined_count_when_it_is_below_the_sum_of_parts() {
    // Alone each paragraph is 3 tokens (BOS + 2 words); two joined are 5, not 6.
    let chunks = chunk("a b\n\nc d\n\ne f", common::bos_words, 5);
    assert_eq!(texts(&chunks), ["a b\n\nc d", "e f"]);
}

#[test]
fn long_paragraph_is_split_at_sentence_ends() {
    let text = "One two three. Four five six! Seven eight nine? Ten\n\nEleven.";
    let chunks = chunk(text, common::words, 6);
    assert_eq!(
        texts(&chunks),
        [
            "One two three. Four five six!",
            "Seven eight nine? Ten",
            "Eleven."
        ]
    );
}

#[test]
fn line_breaks_end_sentences_and_decimal_points_do_not() {
    let text = "pi is 3.14 today\nand e is 2.72";
    let chunks = chunk(text, common::words, 4);
    assert_eq!(texts(&chunks), ["pi is 3.14 today", "and e is 2.72"]);
}

#[test]
fn long_sentence_is_cut_between_words() {
    let text = "w1 w2 w3 w4 w5 w6 w7";
    let chunks = chunk(text, common::words, 3);
    assert_eq!(texts(&chunks), ["w1 w2 w3", "w4 w5 w6", "w7"]);
}

#[test]
fn run_without_spaces_is_cut_between_tokens() {
    let text = "x".repeat(25);
    let chunks = chunk(&text, common::chars, 10);
    let lens: Vec<usize> = chunks.iter().map(|c| c.text.len()).collect();
    assert_eq!(lens, [10, 10, 5]);
    assert_eq!((chunks[2].start, chunks[2].end), (20, 25));
}

#[test]
fn multibyte_text_keeps_offsets_in_characters() {
    let text = "Café déjà vu. 日本語のテキストです! 😀🎉 emoji\n\nÉté 日本 🚀🚀🚀🚀🚀";
    for max in 1..12 {
        chunk(text, common::chars, max);
        chunk(text, common::pairs, max);
        chunk(text, common::words, max);
    }
    let chunks = chunk(text, common::chars, 5);
    let chars: Vec<char> = text.chars().collect();
    let rebuilt: String = chars[chunks[0].start..chunks[0].end].iter().collect();
    assert_eq!(rebuilt, "Café");
}

#[test]
fn byte_level_tokens_never_cut_inside_a_character() {
    let text = "é日😀日é😀😀x";
    for max in 4..10 {
        let chunks = chunk(text, common::bytes, max);
        assert!(chunks.iter().all(|c| c.ids.len() <= max));
    }
    let chunks = chunk(text, common::bytes, 4);
    // "日é" and "😀x" would be 5 bytes: over the limit.
    assert_eq!(
        texts(&chunks),
        ["é", "日", "😀", "日", "é", "😀", "😀", "x"]
    );
}

#[test]
fn character_needing_more_tokens_than_the_limit_is_an_error() {
    let err = chunk_document(
        "doc",
        "ab😀",
        &common::bytes,
        &ChunkParams { max_tokens: 3 },
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            RetrieverError::InvalidArgument {
                field: "chunk_tokens",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("chunk_tokens"));
}

#[test]
fn empty_or_blank_text_is_an_error() {
    for text in ["", " ", "\n\n\t \r\n"] {
        let err = chunk_document("d1", text, &common::words, &ChunkParams::default()).unwrap_err();
        assert!(matches!(err, RetrieverError::EmptyText { ref doc_id } if doc_id == "d1"));
        assert!(err.is_bad_input());
    }
}

#[test]
fn zero_max_tokens_is_an_error_naming_chunk_tokens() {
    let err =
        chunk_document("d", "text", &common::words, &ChunkParams { max_tokens: 0 }).unwrap_err();
    assert!(err.to_string().contains("chunk_tokens"), "{err}");
}

#[test]
fn default_limit_is_512() {
    assert_eq!(ChunkParams::default().max_tokens, 512);
}

#[test]
fn closures_and_trait_objects_are_tokenizers() {
    let vocab_offset = 1000;
    let tok = move |text: &str| {
        let (ids, offsets) = common::words(text);
        (ids.into_iter().map(|i| i + vocab_offset).collect(), offsets)
    };
    let as_dyn: &dyn TokenCount = &tok;
    let chunks = chunk_document("d", "ab cde", as_dyn, &ChunkParams::default()).unwrap();
    assert_eq!(chunks[0].ids, vec![1002, 1003]);
}

#[test]
fn tokenizer_offsets_out_of_range_are_an_error() {
    let bad = |text: &str| (vec![1], vec![(0, text.len() + 1)]);
    let err = chunk_document("d", "abc", &bad, &ChunkParams::default()).unwrap_err();
    assert!(matches!(err, RetrieverError::Tokenizer { .. }), "{err}");
    assert!(!err.is_bad_input());

    let mismatched = |_: &str| (vec![1, 2], vec![(0, 1)]);
    let err = chunk_document("d", "abc", &mismatched, &ChunkParams::default()).unwrap_err();
    assert!(matches!(err, RetrieverError::Tokenizer { .. }), "{err}");
}

#[test]
fn tokenizer_returning_no_tokens_is_an_error() {
    let nothing = |_: &str| (Vec::new(), Vec::new());
    let err = chunk_document("d", "abc", &nothing, &ChunkParams::default()).unwrap_err();
    assert!(matches!(err, RetrieverError::Tokenizer { .. }), "{err}");
}

#[test]
fn tokenizer_whose_counts_change_across_cuts_still_respects_the_limit() {
    // `pairs` tokenizes a piece differently from the same span inside the whole text.
    let text = "abcdefghijklmnopqrstuvwxyz ".repeat(7);
    for max in 1..9 {
        chunk(&text, common::pairs, max);
    }
}

/// Random documents of words, multi-byte characters, punctuation, line breaks, blank lines and
/// long runs without spaces; the invariants hold for every tokenizer and limit.
#[test]
fn invariants_hold_on_seeded_random_documents() {
    const PIECES: &[&str] = &[
        "the",
        "retrieval",
        "é",
        "déjà",
        "日本語",
        "😀",
        "🎉🎉",
        "x",
        "naïve",
        "Ωμέγα",
        "a.b",
        "3.14",
        "(paren)",
        "\"quote\"",
    ];
    const SEPARATORS: &[&str] = &[
        " ", " ", " ", ". ", "! ", "? ", "\n", "\n\n", "\n \n", "\t", "",
    ];
    let tokenizers: [(Encode, usize); 5] = [
        (common::words, 1),
        (common::bos_words, 2),
        (common::chars, 1),
        (common::pairs, 1),
        (common::bytes, 4),
    ];
    let mut rng = StdRng::seed_from_u64(0x5eed);
    for round in 0..300 {
        let len = rng.gen_range(1..120);
        let mut text = String::new();
        if rng.gen_bool(0.2) {
            text.push_str("  \n");
        }
        for _ in 0..len {
            text.push_str(PIECES[rng.gen_range(0..PIECES.len())]);
            text.push_str(SEPARATORS[rng.gen_range(0..SEPARATORS.len())]);
        }
        if text.trim().is_empty() {
            continue;
        }
        let (tok, min_max) = tokenizers[round % tokenizers.len()];
        let max = rng.gen_range(min_max..min_max + 40);
        let chunks = chunk_document("doc", &text, &tok, &ChunkParams { max_tokens: max })
            .unwrap_or_else(|e| panic!("round {round}, max {max}, text {text:?}: {e}"));
        check_invariants(&text, &chunks, tok, max);
    }
}

#[test]
fn tokenizer_without_usable_offsets_falls_back_to_character_cuts() {
    // Every token claims the whole input, so no token boundary is a clean cut.
    let opaque: Encode = |text| {
        let n = text.chars().count();
        (vec![7; n], vec![(0, text.len()); n])
    };
    let text = "abcdéfghij日本語klmnop";
    for max in 1..8 {
        chunk(text, opaque, max);
    }
    assert_eq!(
        texts(&chunk(text, opaque, 7)),
        ["abcdéfg", "hij日本語k", "lmnop"]
    );
}

#[test]
fn crlf_blank_lines_separate_paragraphs() {
    let chunks = chunk("a b\r\n\r\nc d\r\n", common::words, 2);
    assert_eq!(texts(&chunks), ["a b", "c d"]);
}
