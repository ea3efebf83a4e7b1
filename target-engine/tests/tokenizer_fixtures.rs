//! The tokenizer against llama.cpp on every line of `tests/fixtures/tokenize.jsonl`.

mod common;

use target_engine::gguf::GgufFile;
use target_engine::Tokenizer;

#[test]
fn every_fixture_line_matches_llama_cpp() {
    let lines = common::fixture_lines("tokenize.jsonl");
    assert!(lines.len() >= 60, "fixture file looks truncated");
    let mut tokenizers = std::collections::HashMap::new();
    let mut failures = Vec::new();
    for line in &lines {
        let model = line["model"].as_str().expect("model");
        let tok = tokenizers.entry(model.to_string()).or_insert_with(|| {
            let f =
                GgufFile::open(&common::model_path(common::file_for(model))).expect("open gguf");
            Tokenizer::from_gguf(&f).expect("tokenizer")
        });
        let text = line["text"].as_str().expect("text");
        let special = line["special"].as_bool().expect("special");
        let want: Vec<u32> = line["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("id") as u32)
            .collect();
        let enc = tok.encode(text, special);
        if enc.ids != want {
            failures.push(format!(
                "{model} special={special} {text:?}\n  want {want:?}\n  got  {:?}",
                enc.ids
            ));
            continue;
        }
        // Offsets tile the text exactly and decoding gives the text back.
        let mut at = 0;
        for &(s, e) in &enc.offsets {
            assert_eq!(s, at, "{text:?}: offsets must be contiguous");
            assert!(e > s);
            at = e;
        }
        assert_eq!(at, text.len());
        assert_eq!(tok.decode(&enc.ids, true), text, "round trip of {text:?}");
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
