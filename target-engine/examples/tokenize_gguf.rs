//! Tokenizes each line of stdin (a JSON string per line) with a GGUF file's tokenizer alone,
//! without its weights (any architecture), printing the ids as a JSON array per line: for
//! checking a vocabulary against llama.cpp before its architecture runs.
//!
//! `cargo run --release -p target-engine --example tokenize_gguf -- MODEL.gguf < texts.jsonl`
use std::io::BufRead;
use target_engine::gguf::GgufFile;
use target_engine::Tokenizer;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: tokenize_gguf MODEL.gguf")?;
    let tok = Tokenizer::from_gguf(&GgufFile::open(std::path::Path::new(&path))?)?;
    for line in std::io::stdin().lock().lines() {
        let text: String = serde_json::from_str(&line?)?;
        println!("{}", serde_json::to_string(&tok.encode(&text, false).ids)?);
    }
    Ok(())
}
