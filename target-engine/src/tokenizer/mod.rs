//! Byte-level BPE tokenizer built from a GGUF file's own metadata, matching llama.cpp.
//!
//! The pipeline is llama.cpp's: split the text on special tokens (user-defined tokens always,
//! control tokens such as `<|im_start|>` only when asked), split each plain fragment with the
//! pre-tokenizer regexes that `tokenizer.ggml.pre` names, map bytes to the GPT-2 byte alphabet,
//! and apply merges by rank (leftmost first on ties). Every token carries the byte range of the
//! input it came from, so callers can map between tokenizations by shared text.
//!
//! By concept: what a token is (`token.rs`), the pre-tokenizers (`pre.rs`), byte-level BPE's
//! merging (`bpe.rs`), SentencePiece's (`spm.rs`), special tokens (`special.rs`), and building a
//! tokenizer from the file (`load.rs`).

mod bpe;
mod load;
mod pre;
mod special;
mod spm;
#[cfg(test)]
pub(crate) mod tests;
mod token;

pub(crate) use bpe::byte_alphabet;
pub use pre::pre_tokenizer_patterns;
pub use token::{Encoding, TokenType};

use bpe::Bpe;
use pre::PreSplit;
use special::{Fragment, Specials};
use spm::Spm;
use std::collections::HashSet;

/// A byte-level BPE tokenizer (the GGUF `gpt2` tokenizer model).
#[derive(Debug, Clone)]
pub struct Tokenizer {
    pre_name: String,
    pre: Vec<PreSplit>,
    token_text: Vec<String>,
    token_bytes: Vec<Vec<u8>>,
    types: Vec<TokenType>,
    /// Byte-level BPE's merging (empty for a SentencePiece vocabulary).
    bpe: Bpe,
    specials: Specials,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    eog: HashSet<u32>,
    /// A SentencePiece vocabulary's merging (`tokenizer.ggml.model` = `llama`); `None` for
    /// byte-level BPE.
    spm: Option<Spm>,
}

impl Tokenizer {
    /// Number of entries in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.token_text.len()
    }

    /// True when `other` has the same vocabulary, id for id (same size, same tokens and
    /// types): one model's token ids then mean the same text to the other, as speculative
    /// decoding's drafter and target need.
    pub fn same_vocabulary(&self, other: &Tokenizer) -> bool {
        self.token_text == other.token_text && self.types == other.types
    }

    /// The `tokenizer.ggml.pre` name this tokenizer splits text with.
    pub fn pre_tokenizer(&self) -> &str {
        &self.pre_name
    }

    /// Beginning-of-sequence token, when the model defines one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence token, when the model defines one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Whether llama.cpp prepends BOS to a prompt for this model.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// True for tokens that end generation (EOS, `<|im_end|>`, `<|endoftext|>`...).
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// The id of a token by its exact vocabulary text.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_text
            .iter()
            .position(|t| t == text)
            .map(|i| i as u32)
    }

    /// Encodes `text`; control tokens written in the text are parsed as such only when
    /// `parse_special` is true (user-defined added tokens always are, as in llama.cpp).
    pub fn encode(&self, text: &str, parse_special: bool) -> Encoding {
        let mut out = Encoding::default();
        // SentencePiece writes a space before text at the start and after a special token
        // (where the vocabulary asks for it), as llama.cpp does.
        let mut after_special = true;
        for frag in self.split_special(text, parse_special) {
            match frag {
                Fragment::Special(id, s, e) => {
                    out.ids.push(id);
                    out.offsets.push((s, e));
                    after_special = true;
                }
                Fragment::Text(s, e) => {
                    match &self.spm {
                        Some(spm) => {
                            spm.encode(text, s..e, after_special, &mut out.ids, &mut out.offsets)
                        }
                        None => self.encode_plain(text, s, e, &mut out),
                    }
                    after_special = false;
                }
            }
        }
        out
    }

    fn split_special(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        self.specials
            .split(text, parse_special, &self.token_text, &self.types)
    }

    /// Splits `text[s..e]` with the pre-tokenizer regexes, in turn, keeping unmatched gaps.
    fn pieces(&self, text: &str, s: usize, e: usize) -> Vec<(usize, usize)> {
        pre::pieces(&self.pre, text, s, e)
    }

    fn encode_plain(&self, text: &str, s: usize, e: usize, out: &mut Encoding) {
        let bytes = text.as_bytes();
        for (ps, pe) in self.pieces(text, s, e) {
            self.bpe.encode_piece(bytes, ps, pe, out);
        }
    }

    /// The bytes a token stands for (its text for special tokens).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.token_bytes
            .get(id as usize)
            .map_or(&[], |b| b.as_slice())
    }

    /// Decodes ids to text; control tokens are dropped unless `with_special`. Invalid UTF-8
    /// (a sequence cut inside a character) is replaced by U+FFFD.
    pub fn decode(&self, ids: &[u32], with_special: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            let ty = self
                .types
                .get(id as usize)
                .copied()
                .unwrap_or(TokenType::Unused);
            if ty == TokenType::Control && !with_special {
                continue;
            }
            bytes.extend_from_slice(self.token_bytes(id));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}
