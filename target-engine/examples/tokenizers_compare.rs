//! specrag's tokenizer against Hugging Face's `tokenizers` crate built from the same GGUF
//! vocabulary, both held to llama.cpp's token ids: agreement (texts whose ids are equal) and
//! speed (tokens per second, one thread, each text encoded alone as a server does).
//!
//! Reads JSON lines `{"text": ..., "ids": [...]}` on stdin (the ids llama.cpp gives the text
//! without BOS and without parsing special tokens; `scripts/tokenizer_agreement.py` writes
//! them) and prints one JSON line per engine.
//!
//! ```sh
//! cargo run --release -p target-engine --features hf-tokenizers --example tokenizers_compare \
//!     -- MODEL.gguf [--reps 3] < texts.jsonl
//! ```
//!
//! How the `tokenizers` side is built from the file (what a GGUF carries, in the form the
//! crate's `tokenizer.json` takes): `gpt2` vocabularies as a byte-level BPE with the file's
//! merges, the pre-tokenizer regexes llama.cpp uses for `tokenizer.ggml.pre` (the same ones
//! specrag uses) as isolating splits, then the byte-level mapping without its own regex, and
//! no Unicode normalization (llama.cpp applies none); SentencePiece (`llama`) vocabularies as a
//! BPE with byte fallback whose merges are derived from the piece scores (every split of a
//! piece into two pieces, ranked by the merged piece's score, as Hugging Face converts
//! SentencePiece models), spaces replaced by `▁` and the file's space prefix. Control and
//! user-defined tokens are added tokens; special tokens are encoded as plain text, as
//! llama.cpp does without special parsing.
use candle_core::quantized::gguf_file::Value;
use serde_json::{json, Value as Json};
use std::collections::HashMap;
use std::io::BufRead;
use std::path::Path;
use std::str::FromStr;
use std::time::Instant;
use target_engine::gguf::GgufFile;
use target_engine::tokenizer::pre_tokenizer_patterns;
use target_engine::Tokenizer;

type Res<T> = Result<T, Box<dyn std::error::Error>>;
type Encoder<'a> = Box<dyn Fn(&str) -> Vec<u32> + 'a>;

fn strings(f: &GgufFile, key: &str) -> Res<Vec<String>> {
    f.array(key)?
        .iter()
        .map(|v| match v {
            Value::String(s) => Ok(s.clone()),
            other => Err(format!("{key}: not a string: {other:?}").into()),
        })
        .collect()
}

fn numbers(f: &GgufFile, key: &str) -> Vec<f64> {
    match f.get(key) {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| match v {
                Value::F32(x) => f64::from(*x),
                Value::I32(x) => f64::from(*x),
                Value::U32(x) => f64::from(*x),
                _ => 0.0,
            })
            .collect(),
        _ => Vec::new(),
    }
}

fn flag(f: &GgufFile, key: &str, default: bool) -> bool {
    match f.get(key) {
        Some(Value::Bool(b)) => *b,
        _ => default,
    }
}

/// Control (3) and user-defined (4) tokens as `tokenizer.json` added tokens.
fn added_tokens(tokens: &[String], types: &[f64]) -> Vec<Json> {
    tokens
        .iter()
        .zip(types)
        .enumerate()
        .filter(|(_, (_, &t))| t == 3.0 || t == 4.0)
        .map(|(id, (content, &t))| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": t == 3.0})
        })
        .collect()
}

fn vocab_map(tokens: &[String]) -> serde_json::Map<String, Json> {
    tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect()
}

/// A byte-level BPE `tokenizer.json` from a `gpt2` GGUF vocabulary.
fn bpe_json(f: &GgufFile) -> Res<Json> {
    let tokens = strings(f, "tokenizer.ggml.tokens")?;
    let types = numbers(f, "tokenizer.ggml.token_type");
    let merges: Vec<Json> = strings(f, "tokenizer.ggml.merges")?
        .iter()
        .map(|m| {
            let (a, b) = m.split_once(' ').unwrap_or((m, ""));
            json!([a, b])
        })
        .collect();
    let pre = f.string("tokenizer.ggml.pre").unwrap_or("default");
    let patterns = pre_tokenizer_patterns(pre).ok_or(format!("pre-tokenizer `{pre}`"))?;
    let mut pre_tokenizers: Vec<Json> = patterns
        .iter()
        .map(|p| json!({"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": false}))
        .collect();
    pre_tokenizers.push(json!({"type": "ByteLevel", "add_prefix_space": false,
                               "trim_offsets": false, "use_regex": false}));
    Ok(json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added_tokens(&tokens, &types),
        "normalizer": null,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre_tokenizers},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": pre == "llama-bpe",
                  "vocab": vocab_map(&tokens), "merges": merges}
    }))
}

/// A SentencePiece (`llama`) GGUF vocabulary as a BPE with byte fallback: merges from scores.
fn spm_json(f: &GgufFile) -> Res<Json> {
    let tokens = strings(f, "tokenizer.ggml.tokens")?;
    let types = numbers(f, "tokenizer.ggml.token_type");
    let scores = numbers(f, "tokenizer.ggml.scores");
    let id: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    // Every split of a normal piece into two pieces of the vocabulary is a merge; the merged
    // piece's score ranks it (higher first), then the pieces' ids, as Hugging Face's converter.
    let mut merges: Vec<(f64, usize, usize, usize)> = Vec::new();
    for (i, piece) in tokens.iter().enumerate() {
        if types.get(i).copied().unwrap_or(1.0) != 1.0 {
            continue;
        }
        for (cut, _) in piece.char_indices().skip(1) {
            let (a, b) = piece.split_at(cut);
            if let (Some(&ia), Some(&ib)) = (id.get(a), id.get(b)) {
                merges.push((scores.get(i).copied().unwrap_or(0.0), i, ia, ib));
            }
        }
    }
    merges.sort_by(|x, y| y.0.total_cmp(&x.0).then((x.2, x.3).cmp(&(y.2, y.3))));
    let merges: Vec<Json> = merges
        .iter()
        .map(|&(_, _, a, b)| json!([tokens[a], tokens[b]]))
        .collect();
    let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"});
    let normalizer = if flag(f, "tokenizer.ggml.add_space_prefix", true) {
        json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, replace]})
    } else {
        replace
    };
    let unk = types
        .iter()
        .position(|&t| t == 2.0)
        .map(|i| tokens[i].clone());
    Ok(json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added_tokens(&tokens, &types),
        "normalizer": normalizer,
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": unk,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab_map(&tokens), "merges": merges}
    }))
}

/// Texts agreeing with llama.cpp, tokens, and the best of `reps` timed passes.
fn measure(
    cases: &[(String, Vec<u32>)],
    reps: usize,
    encode: &dyn Fn(&str) -> Vec<u32>,
) -> (usize, usize, Option<usize>, f64) {
    let mut agree = 0;
    let mut first_diff = None;
    let mut tokens = 0;
    for (i, (text, ids)) in cases.iter().enumerate() {
        let got = encode(text);
        tokens += got.len();
        if &got == ids {
            agree += 1;
        } else if first_diff.is_none() {
            first_diff = Some(i);
        }
    }
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        for (text, _) in cases {
            std::hint::black_box(encode(text));
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    (agree, tokens, first_diff, best)
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args
        .first()
        .ok_or("usage: tokenizers_compare MODEL.gguf [--reps N]")?;
    let reps = match args.iter().position(|a| a == "--reps") {
        Some(i) => args.get(i + 1).ok_or("--reps needs a number")?.parse()?,
        None => 3,
    };
    let mut cases = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let v: Json = serde_json::from_str(&line?)?;
        let text = v["text"].as_str().ok_or("a line without text")?.to_string();
        let ids: Vec<u32> = serde_json::from_value(v["ids"].clone())?;
        cases.push((text, ids));
    }
    let gguf = GgufFile::open(Path::new(path))?;
    let t = Instant::now();
    let ours = Tokenizer::from_gguf(&gguf)?;
    let ours_load = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let spec = match gguf.string("tokenizer.ggml.model")? {
        "gpt2" => bpe_json(&gguf)?,
        "llama" => spm_json(&gguf)?,
        other => return Err(format!("tokenizer model `{other}`").into()),
    };
    let mut hf = tokenizers::Tokenizer::from_str(&spec.to_string()).map_err(|e| e.to_string())?;
    hf.set_encode_special_tokens(true);
    let hf_load = t.elapsed().as_secs_f64();
    let engines: [(&str, f64, Encoder); 2] = [
        (
            "specrag",
            ours_load,
            Box::new(|s: &str| ours.encode(s, false).ids),
        ),
        (
            "tokenizers",
            hf_load,
            Box::new(|s: &str| {
                hf.encode(s, false)
                    .map(|e| e.get_ids().to_vec())
                    .unwrap_or_default()
            }),
        ),
    ];
    for (name, load_s, encode) in &engines {
        let (agree, tokens, first_diff, secs) = measure(&cases, reps, encode.as_ref());
        let sample = first_diff.map(|i| {
            let (text, ids) = &cases[i];
            json!({"text": text.chars().take(120).collect::<String>(), "llama_cpp": ids.iter().take(24).collect::<Vec<_>>(),
                   "got": encode(text).into_iter().take(24).collect::<Vec<_>>()})
        });
        println!(
            "{}",
            json!({"engine": name, "model": path, "texts": cases.len(), "agree": agree,
                   "tokens": tokens, "seconds": secs, "tokens_per_s": tokens as f64 / secs,
                   "load_s": load_s, "first_difference": sample})
        );
    }
    Ok(())
}
