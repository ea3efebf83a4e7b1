//! Issue 39: under reuse, decimals in a passage ("3.8 million", "81.4") came back as "3. 8".
//! One suspect was tokenization: a chunk is tokenized alone (`RagTemplate::chunk`) and its ids
//! are what is precomputed and reused, while a normal prompt would be tokenized whole. These
//! tests pin that for the Qwen tokenizers (the default target's) the assembled ids around
//! decimals, at a chunk's start, middle and end, are exactly the whole prompt's tokenization,
//! and that each chunk's ids decode to its text, so neither reuse nor full recompute ever sees
//! a decimal tokenized differently from the text.

mod common;

use target_engine::gguf::GgufFile;
use target_engine::{RagTemplate, SegmentKind, Tokenizer};

const CHUNKS: [&str; 4] = [
    "According to the 2020 census, the metropolitan area had a population of 3.8 million.",
    "81.4 square kilometres is the area of the reservoir; the dam is 142.0 metres high",
    "She ran the 100 metres in 11.27 seconds (a record), 0.3 s faster than in 2018: 11.57",
    "Growth was 3.8%. 81.4 percent voted. The median age was 38.6 years.\n\nIt rose to 3.9.",
];

fn tokenizer(file: &str) -> Tokenizer {
    let f = GgufFile::open(&common::model_path(file)).expect("open gguf");
    Tokenizer::from_gguf(&f).expect("tokenizer")
}

#[test]
fn decimals_in_chunks_tokenize_as_in_the_whole_prompt() {
    for file in [common::QWEN_05B, common::QWEN_15B] {
        let tok = tokenizer(file);
        let t = RagTemplate::default();
        let asm = t.assemble(&tok, &CHUNKS, "What was the population in 2020?");
        // The whole prompt tokenized at once (control tokens parsed, as the template does).
        let whole = tok.encode(&asm.text, true).ids;
        assert_eq!(
            asm.ids, whole,
            "{file}: assembled ids differ from the whole prompt's tokenization"
        );
        for seg in &asm.segments {
            if let SegmentKind::Chunk(i) = seg.kind {
                let ids = &asm.ids[seg.ids.clone()];
                assert_eq!(
                    tok.decode(ids, false),
                    asm.segment_text(seg),
                    "{file}: chunk {i} does not decode to its text"
                );
                // Each decimal of the chunk is its digits and "." as separate tokens, no space.
                let pieces: Vec<String> = ids.iter().map(|&id| tok.decode(&[id], false)).collect();
                for w in pieces.windows(3) {
                    if w[1] == "." && w[0].ends_with(|c: char| c.is_ascii_digit()) {
                        assert!(
                            !w[2].starts_with(' ')
                                || !w[2].trim_start().starts_with(|c: char| c.is_ascii_digit()),
                            "{file}: chunk {i} has a spaced decimal: {w:?}"
                        );
                    }
                }
            }
        }
    }
}
