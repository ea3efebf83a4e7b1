//! Building a tokenizer from a GGUF file's `tokenizer.ggml.*` metadata: a byte-level BPE
//! vocabulary with its merges and pre-tokenizer, or a SentencePiece one with its scores.

use super::bpe::{byte_alphabet, merge_ranks, token_bytes, Bpe};
use super::pre::{pre_tokenizer_patterns, PreSplit};
use super::special::{end_of_generation, phi3_rstrip, special_ids, Specials};
use super::spm::Spm;
use super::token::{TokenType, NO_TOKEN};
use super::Tokenizer;
use crate::error::{EngineError, Result};
use crate::gguf::{value_as_u64, GgufFile};
use candle_core::quantized::gguf_file::Value;
use std::collections::{HashMap, HashSet};

impl Tokenizer {
    /// Builds the tokenizer described by the file's `tokenizer.ggml.*` metadata (and, as
    /// llama.cpp does, the Phi-3 whitespace rule its `general.name` may call for).
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let mut t = Self::vocab_from_gguf(f)?;
        let name = match f.get("general.name") {
            Some(Value::String(s)) => Some(s.as_str()),
            _ => None,
        };
        t.specials.rstrip = phi3_rstrip(name, &t.token_text, &t.specials.ids);
        Ok(t)
    }

    fn vocab_from_gguf(f: &GgufFile) -> Result<Self> {
        let model = f.string("tokenizer.ggml.model")?;
        let opt_id = |key: &str| f.get(key).and_then(value_as_u64).map(|x| x as u32);
        match model {
            "gpt2" => {}
            "llama" => return Self::spm_from_gguf(f),
            _ => {
                return Err(EngineError::Unsupported {
                    path: f.path().to_path_buf(),
                    reason: format!(
                        "tokenizer model `{model}` (`tokenizer.ggml.model`; supported: gpt2 \
                         byte-level BPE, llama SentencePiece)"
                    ),
                })
            }
        }
        let pre_name = f
            .string("tokenizer.ggml.pre")
            .unwrap_or("default")
            .to_string();
        let patterns =
            pre_tokenizer_patterns(&pre_name).ok_or_else(|| EngineError::Unsupported {
                path: f.path().to_path_buf(),
                reason: format!(
                    "pre-tokenizer `{pre_name}` (supported: qwen2, llama-bpe, smollm, gpt2)"
                ),
            })?;
        let pre = patterns
            .iter()
            .map(|p| PreSplit::new(p))
            .collect::<Result<Vec<_>>>()?;
        let (tokens, types) = read_vocab(f)?;
        let merge_list: Vec<&str> = match f.get("tokenizer.ggml.merges") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.as_str()),
                    other => Err(EngineError::Tokenizer(format!(
                        "merge entry is not a string: {other:?}"
                    ))),
                })
                .collect::<Result<_>>()?,
            _ => {
                return Err(EngineError::Tokenizer(
                    "tokenizer.ggml.merges is missing".into(),
                ))
            }
        };
        let add_bos = flag(f, "tokenizer.ggml.add_bos_token", false);
        Self::build(Parts {
            pre_name,
            pre,
            tokens,
            types,
            merges: &merge_list,
            bos: opt_id("tokenizer.ggml.bos_token_id"),
            eos: opt_id("tokenizer.ggml.eos_token_id"),
            add_bos,
        })
    }

    /// A SentencePiece vocabulary (`tokenizer.ggml.model` = `llama`) from the file.
    fn spm_from_gguf(f: &GgufFile) -> Result<Self> {
        let opt_id = |key: &str| f.get(key).and_then(value_as_u64).map(|x| x as u32);
        let (tokens, types) = read_vocab(f)?;
        let scores: Vec<f32> = match f.get("tokenizer.ggml.scores") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::F32(x) => *x,
                    _ => 0.0,
                })
                .collect(),
            _ => vec![0.0; tokens.len()],
        };
        Self::build_spm(
            tokens,
            types,
            scores,
            flag(f, "tokenizer.ggml.add_space_prefix", true),
            [
                opt_id("tokenizer.ggml.bos_token_id"),
                opt_id("tokenizer.ggml.eos_token_id"),
            ],
            flag(f, "tokenizer.ggml.add_bos_token", true),
        )
    }

    /// A SentencePiece tokenizer (llama.cpp's `llama` vocabulary type): `▁` for spaces, pieces
    /// merged by score, `<0xXX>` tokens for bytes no piece covers.
    fn build_spm(
        tokens: Vec<String>,
        types: Vec<TokenType>,
        scores: Vec<f32>,
        space_prefix: bool,
        [bos, eos]: [Option<u32>; 2],
        add_bos: bool,
    ) -> Result<Self> {
        if scores.len() != tokens.len() {
            return Err(EngineError::Tokenizer(format!(
                "{} scores for {} tokens",
                scores.len(),
                tokens.len()
            )));
        }
        let lookup: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let mut byte_token = [NO_TOKEN; 256];
        for (b, slot) in byte_token.iter_mut().enumerate() {
            if let Some(&id) = lookup.get(&format!("<0x{b:02X}>")) {
                *slot = id;
            }
        }
        let token_bytes = tokens
            .iter()
            .zip(&types)
            .map(|(t, ty)| match ty {
                TokenType::Byte => {
                    u8::from_str_radix(t.trim_start_matches("<0x").trim_end_matches('>'), 16)
                        .map_or_else(|_| t.as_bytes().to_vec(), |b| vec![b])
                }
                TokenType::Control => t.as_bytes().to_vec(),
                _ => t.replace('\u{2581}', " ").into_bytes(),
            })
            .collect();
        let specials = special_ids(&tokens, &types);
        let eog = end_of_generation(eos, &tokens, &types);
        Ok(Self {
            pre_name: "sentencepiece".into(),
            pre: Vec::new(),
            token_text: tokens,
            token_bytes,
            types,
            bpe: Bpe {
                merges: HashMap::new(),
                byte_token,
                whole_pieces: None,
            },
            specials: Specials {
                ids: specials,
                rstrip: HashSet::new(),
            },
            bos,
            eos,
            add_bos,
            eog,
            spm: Some(Spm {
                lookup,
                scores,
                byte_token,
                space_prefix,
            }),
        })
    }

    /// The tokenizer of a vocabulary, its types and merges as a GGUF file lists them.
    pub(super) fn build(p: Parts<'_>) -> Result<Self> {
        let alphabet = byte_alphabet();
        let vocab: HashMap<&str, u32> = p
            .tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.as_str(), i as u32))
            .collect();
        // Some vocabularies (SmolLM2) lack a few control bytes; like llama.cpp, such bytes are
        // dropped from the output.
        let mut byte_token = [NO_TOKEN; 256];
        for (b, c) in alphabet.iter().enumerate() {
            if let Some(&id) = vocab.get(c.to_string().as_str()) {
                byte_token[b] = id;
            }
        }
        if byte_token.iter().filter(|&&t| t == NO_TOKEN).count() > 32 {
            return Err(EngineError::Tokenizer(
                "vocabulary is not byte-level: most byte symbols are missing".into(),
            ));
        }
        let merges = merge_ranks(&vocab, p.merges)?;
        let token_bytes = token_bytes(&alphabet, &p.tokens, &p.types);
        let specials = special_ids(&p.tokens, &p.types);
        let eog = end_of_generation(p.eos, &p.tokens, &p.types);
        let whole_pieces = matches!(p.pre_name.as_str(), "llama-bpe" | "llama3").then(|| {
            (0..p.tokens.len())
                .filter(|&i| p.types[i] == TokenType::Normal)
                .map(|i| (token_bytes[i].clone(), i as u32))
                .collect()
        });
        Ok(Self {
            pre_name: p.pre_name,
            pre: p.pre,
            token_text: p.tokens,
            token_bytes,
            types: p.types,
            bpe: Bpe {
                merges,
                byte_token,
                whole_pieces,
            },
            specials: Specials {
                ids: specials,
                rstrip: HashSet::new(),
            },
            bos: p.bos,
            eos: p.eos,
            add_bos: p.add_bos,
            eog,
            spm: None,
        })
    }
}

/// What a tokenizer is built from (a GGUF file's tokenizer metadata).
pub(super) struct Parts<'a> {
    pub(super) pre_name: String,
    pub(super) pre: Vec<PreSplit>,
    pub(super) tokens: Vec<String>,
    pub(super) types: Vec<TokenType>,
    /// `"left right"` pairs, best first.
    pub(super) merges: &'a [&'a str],
    pub(super) bos: Option<u32>,
    pub(super) eos: Option<u32>,
    pub(super) add_bos: bool,
}

/// A boolean `key` of the file, `default` when absent.
fn flag(f: &GgufFile, key: &str, default: bool) -> bool {
    match f.get(key) {
        Some(Value::Bool(b)) => *b,
        _ => default,
    }
}

/// The vocabulary's tokens and their types, as the file lists them.
fn read_vocab(f: &GgufFile) -> Result<(Vec<String>, Vec<TokenType>)> {
    let tokens: Vec<String> = f
        .array("tokenizer.ggml.tokens")?
        .iter()
        .map(|v| match v {
            Value::String(s) => Ok(s.clone()),
            other => Err(EngineError::Tokenizer(format!(
                "token entry is not a string: {other:?}"
            ))),
        })
        .collect::<Result<_>>()?;
    let types: Vec<TokenType> = match f.get("tokenizer.ggml.token_type") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| TokenType::from_code(value_as_u64(v).unwrap_or(1)))
            .collect(),
        _ => vec![TokenType::Normal; tokens.len()],
    };
    if types.len() != tokens.len() {
        return Err(EngineError::Tokenizer(format!(
            "{} token types for {} tokens",
            types.len(),
            tokens.len()
        )));
    }
    Ok((tokens, types))
}
