//! Byte-level BPE tokenizer built from a GGUF file's own metadata, matching llama.cpp.
//!
//! The pipeline is llama.cpp's: split the text on special tokens (user-defined tokens always,
//! control tokens such as `<|im_start|>` only when asked), split each plain fragment with the
//! pre-tokenizer regexes that `tokenizer.ggml.pre` names, map bytes to the GPT-2 byte alphabet,
//! and apply merges by rank (leftmost first on ties). Every token carries the byte range of the
//! input it came from, so callers can map between tokenizations by shared text.

use crate::error::{EngineError, Result};
use crate::gguf::{value_as_u64, GgufFile};
use crate::spm::Spm;
use candle_core::quantized::gguf_file::Value;
use fancy_regex::Regex;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};

/// What a vocabulary entry is, from `tokenizer.ggml.token_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenType {
    Normal,
    Unknown,
    /// Chat-control tokens (`<|im_start|>`): parsed from text only on request, never printed.
    Control,
    /// Added tokens that llama.cpp always parses from text and prints as-is.
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    fn from_code(code: u64) -> Self {
        match code {
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Normal,
        }
    }
}

/// Marks a byte the vocabulary has no symbol for.
const NO_TOKEN: u32 = u32::MAX;

/// Token ids with the byte range of the input text each one covers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Encoding {
    pub ids: Vec<u32>,
    /// `[start, end)` byte offsets into the UTF-8 input. A token holding part of a multi-byte
    /// character covers just the bytes it holds.
    pub offsets: Vec<(usize, usize)>,
}

impl Encoding {
    /// Offsets converted to character (Unicode scalar) indices of `text`; a token that covers
    /// part of a character is widened to the whole character.
    pub fn char_offsets(&self, text: &str) -> Vec<(usize, usize)> {
        // char_at[b] = index of the character that byte b belongs to.
        let mut char_at = Vec::with_capacity(text.len() + 1);
        for (ci, c) in text.chars().enumerate() {
            char_at.extend(std::iter::repeat_n(ci, c.len_utf8()));
        }
        let n_chars = char_at.last().map_or(0, |&c| c + 1);
        char_at.push(n_chars);
        self.offsets
            .iter()
            .map(|&(s, e)| {
                if e > s {
                    (char_at[s], char_at[e - 1] + 1)
                } else {
                    (char_at[s], char_at[s])
                }
            })
            .collect()
    }
}

/// Pre-tokenizer regexes by `tokenizer.ggml.pre`, as llama.cpp defines them, applied in order
/// (each splits the pieces the one before left); `None` for a pre-tokenizer not supported.
pub fn pre_tokenizer_patterns(pre: &str) -> Option<Vec<&'static str>> {
    const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    // llama.cpp runs GPT-2's pattern through a hand-written matcher that also takes a
    // whitespace run no other branch took, which is what the trailing `|\s+` says.
    const GPT2: &str =
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
    match pre {
        "qwen2" => Some(vec![QWEN2]),
        // Llama 3's: Qwen2's with digits in runs of up to three.
        "llama-bpe" | "llama3" => Some(vec![LLAMA3]),
        "smollm" | "starcoder" | "refact" => Some(vec![r"\p{N}", GPT2]),
        "gpt2" | "gpt-2" | "default" => Some(vec![GPT2]),
        _ => None,
    }
}

/// The lookahead tail both pre-tokenizer patterns end with: a whitespace run, less its last
/// character when more text follows (that character then starts the next piece).
const WHITESPACE_TAIL: &str = r"|\s+(?!\S)|\s+";

/// One pre-tokenizer pattern, compiled to run in linear time with no length limit.
///
/// fancy-regex runs a pattern with a lookaround in its backtracking VM, which pushes a stack
/// entry per repeated character and fails (`StackOverflow`) on a run of about a million
/// characters: a longer word or whitespace run made the rest of the fragment one piece. So a
/// pattern ending in [`WHITESPACE_TAIL`] is run without the lookahead, as `head|\s+` (plain
/// regex, which fancy-regex hands whole to the `regex` crate), and the lookahead is applied to
/// the match afterwards (see [`PreSplit::find`]).
#[derive(Debug, Clone)]
struct PreSplit {
    re: Regex,
    /// `\A(?:head)`, when `re` is `head|\s+`: whether a match came from the head.
    head: Option<Regex>,
}

impl PreSplit {
    fn new(pattern: &str) -> Result<Self> {
        let compile =
            |p: &str| Regex::new(p).map_err(|e| EngineError::Tokenizer(format!("regex {p}: {e}")));
        Ok(match pattern.strip_suffix(WHITESPACE_TAIL) {
            Some(head) => Self {
                re: compile(&format!(r"{head}|\s+"))?,
                head: Some(compile(&format!(r"\A(?:{head})"))?),
            },
            None => Self {
                re: compile(pattern)?,
                head: None,
            },
        })
    }

    /// The first match of the original pattern in `hay` at or after byte `at`.
    fn find(&self, hay: &str, at: usize) -> Option<(usize, usize)> {
        // A runtime error (only possible for a pattern kept in the backtracking VM) ends the
        // search: the rest of the text is then kept as one piece rather than lost.
        let m = self.re.find_from_pos(hay, at).ok()??;
        let (s, e) = (m.start(), m.end());
        let Some(head) = &self.head else {
            return Some((s, e));
        };
        // `\s+` and `\s+(?!\S)|\s+` match at the same places, so `s` is right; a match of the
        // tail (no head branch matches at `s`) that is followed by more text and longer than
        // one character gives its last character back, as `\s+(?!\S)` does.
        let run = &hay[s..e];
        if e < hay.len() && run.starts_with(char::is_whitespace) {
            if let Some((last, _)) = run.char_indices().last().filter(|&(i, _)| i > 0) {
                if !matches!(head.find(&hay[s..]), Ok(Some(_))) {
                    return Some((s, s + last));
                }
            }
        }
        Some((s, e))
    }
}

/// GPT-2's reversible map from bytes to printable characters.
pub(crate) fn byte_alphabet() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        map[b as usize] = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\0')
        };
    }
    map
}

/// A byte-level BPE tokenizer (the GGUF `gpt2` tokenizer model).
#[derive(Debug, Clone)]
pub struct Tokenizer {
    pre_name: String,
    pre: Vec<PreSplit>,
    token_text: Vec<String>,
    token_bytes: Vec<Vec<u8>>,
    types: Vec<TokenType>,
    /// (left id, right id) -> (rank, merged id)
    merges: HashMap<(u32, u32), (u32, u32)>,
    byte_token: [u32; 256],
    /// Special tokens to split on, longest text first.
    specials: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    eog: HashSet<u32>,
    /// Llama 3's `ignore_merges`: a pre-tokenized piece that is a token of the vocabulary as a
    /// whole becomes that token without merging (its bytes -> id; llama.cpp does this for the
    /// `llama-bpe` pre-tokenizer). `None` for the others.
    whole_pieces: Option<HashMap<Vec<u8>, u32>>,
    /// A SentencePiece vocabulary's merging (`tokenizer.ggml.model` = `llama`); `None` for
    /// byte-level BPE.
    spm: Option<Spm>,
    /// Special tokens after which whitespace in the text is dropped when they are split out
    /// (llama.cpp's RSTRIP; it sets it for Phi-3 files by their name, see [`phi3_rstrip`]).
    rstrip: HashSet<u32>,
}

impl Tokenizer {
    /// Builds the tokenizer described by the file's `tokenizer.ggml.*` metadata (and, as
    /// llama.cpp does, the Phi-3 whitespace rule its `general.name` may call for).
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let mut t = Self::vocab_from_gguf(f)?;
        let name = match f.get("general.name") {
            Some(Value::String(s)) => Some(s.as_str()),
            _ => None,
        };
        t.rstrip = phi3_rstrip(name, &t.token_text, &t.specials);
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
            merges: HashMap::new(),
            byte_token,
            specials,
            bos,
            eos,
            add_bos,
            eog,
            whole_pieces: None,
            rstrip: HashSet::new(),
            spm: Some(Spm {
                lookup,
                scores,
                byte_token,
                space_prefix,
            }),
        })
    }

    /// The tokenizer of a vocabulary, its types and merges as a GGUF file lists them.
    fn build(p: Parts<'_>) -> Result<Self> {
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
            merges,
            byte_token,
            specials,
            bos: p.bos,
            eos: p.eos,
            add_bos: p.add_bos,
            eog,
            whole_pieces,
            spm: None,
            rstrip: HashSet::new(),
        })
    }

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
                            spm.encode(text, (s, e), after_special, &mut out.ids, &mut out.offsets)
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
        let mut frags = vec![Fragment::Text(0, text.len())];
        if text.is_empty() {
            return Vec::new();
        }
        for &id in &self.specials {
            if matches!(
                self.types[id as usize],
                TokenType::Control | TokenType::Unknown
            ) && !parse_special
            {
                continue;
            }
            let needle = self.token_text[id as usize].as_str();
            if !text.contains(needle) {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len());
            for f in frags {
                let Fragment::Text(s, e) = f else {
                    next.push(f);
                    continue;
                };
                let mut cur = s;
                let strip = self.rstrip.contains(&id);
                for (i, _) in text[s..e].match_indices(needle) {
                    let at = s + i;
                    if at < cur {
                        continue;
                    }
                    if at > cur {
                        next.push(Fragment::Text(cur, at));
                    }
                    next.push(Fragment::Special(id, at, at + needle.len()));
                    cur = at + needle.len();
                    if strip {
                        // C's isspace: space, \t, \n, \v, \f, \r.
                        let skip = text.as_bytes()[cur..e]
                            .iter()
                            .take_while(|b| matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r'))
                            .count();
                        cur += skip;
                    }
                }
                if cur < e {
                    next.push(Fragment::Text(cur, e));
                }
            }
            frags = next;
        }
        frags
    }

    /// Splits `text[s..e]` with the pre-tokenizer regexes, in turn, keeping unmatched gaps.
    fn pieces(&self, text: &str, s: usize, e: usize) -> Vec<(usize, usize)> {
        let mut ranges = vec![(s, e)];
        for split in &self.pre {
            let mut next = Vec::with_capacity(ranges.len() * 2);
            for (rs, re_end) in ranges {
                let hay = &text[rs..re_end];
                // `cur`: end of the last piece; `at`: where to search next.
                let (mut cur, mut at) = (0, 0);
                while at < hay.len() {
                    let Some((ms, me)) = split.find(hay, at) else {
                        break;
                    };
                    if ms > cur {
                        next.push((rs + cur, rs + ms));
                    }
                    if me > ms {
                        next.push((rs + ms, rs + me));
                        at = me;
                    } else {
                        // None of the patterns matches empty text; were one to, search on
                        // past it, as `find_iter` does.
                        at = me + hay[me..].chars().next().map_or(1, char::len_utf8);
                    }
                    cur = me;
                }
                if cur < hay.len() {
                    next.push((rs + cur, re_end));
                }
            }
            ranges = next;
        }
        ranges
    }

    fn encode_plain(&self, text: &str, s: usize, e: usize, out: &mut Encoding) {
        let bytes = text.as_bytes();
        for (ps, pe) in self.pieces(text, s, e) {
            if let Some(&id) = self
                .whole_pieces
                .as_ref()
                .and_then(|w| w.get(&bytes[ps..pe]))
            {
                out.ids.push(id);
                out.offsets.push((ps, pe));
                continue;
            }
            self.merge_piece(bytes, ps, pe, out);
        }
    }

    /// Byte-level BPE over one pre-tokenized piece `bytes[ps..pe]`, appending its tokens.
    ///
    /// Repeatedly merges the adjacent pair with the lowest merge rank, the leftmost one among
    /// equal ranks (equal ranks are occurrences of the same pair), exactly as llama.cpp's
    /// `llm_tokenizer_bpe` does. The symbols form a linked list over a `Vec` and candidate
    /// merges wait in a min-heap keyed by (rank, left position); an entry whose symbols changed
    /// since it was pushed is skipped when popped. Each merge pushes at most two entries, so a
    /// piece of n bytes costs O(n log n) instead of the O(n²) of rescanning every pair per merge.
    fn merge_piece(&self, bytes: &[u8], ps: usize, pe: usize, out: &mut Encoding) {
        let n = pe - ps;
        if n == 0 {
            return;
        }
        // Symbol i starts at byte ps + i and ends where the next live one starts: a symbol
        // absorbs its right neighbour on a merge, so live indices keep the piece's order.
        let mut syms: Vec<Symbol> = (0..n)
            .map(|i| Symbol {
                id: self.byte_token[bytes[ps + i] as usize],
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 == n { NONE } else { i + 1 },
            })
            .collect();
        let mut queue = BinaryHeap::with_capacity(n);
        for left in 0..n - 1 {
            self.push_candidate(&mut queue, &syms, left);
        }
        while let Some(Reverse(c)) = queue.pop() {
            let l = c.left;
            let r = syms[l].next;
            // Stale: the left symbol was absorbed (its `next` is reset) or absorbed its
            // neighbour (its id changed), or the right one grew (its id changed). Otherwise
            // `r` is still the neighbour the entry was pushed for.
            if r == NONE || syms[l].id != c.left_id || syms[r].id != c.right_id {
                continue;
            }
            let after = syms[r].next;
            syms[l].id = c.merged;
            syms[l].next = after;
            if after != NONE {
                syms[after].prev = l;
            }
            syms[r].next = NONE;
            if syms[l].prev != NONE {
                self.push_candidate(&mut queue, &syms, syms[l].prev);
            }
            if after != NONE {
                self.push_candidate(&mut queue, &syms, l);
            }
        }
        // Symbol 0 is never absorbed, so the list starts there.
        let mut i = 0;
        while i != NONE {
            let next = syms[i].next;
            if syms[i].id != NO_TOKEN {
                out.ids.push(syms[i].id);
                out.offsets
                    .push((ps + i, if next == NONE { pe } else { ps + next }));
            }
            i = next;
        }
    }

    /// Queues the merge of symbol `left` with its right neighbour, when the pair has one.
    fn push_candidate(
        &self,
        queue: &mut BinaryHeap<Reverse<Candidate>>,
        syms: &[Symbol],
        left: usize,
    ) {
        let (left_id, right_id) = (syms[left].id, syms[syms[left].next].id);
        if let Some(&(rank, merged)) = self.merges.get(&(left_id, right_id)) {
            queue.push(Reverse(Candidate {
                rank,
                left,
                left_id,
                right_id,
                merged,
            }));
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

enum Fragment {
    Text(usize, usize),
    Special(u32, usize, usize),
}

/// No neighbour, in [`Symbol`]'s links.
const NONE: usize = usize::MAX;

/// A token of a piece being merged, in a list linked by indices (see `merge_piece`).
struct Symbol {
    id: u32,
    prev: usize,
    /// [`NONE`] for the last symbol and for one absorbed by its left neighbour.
    next: usize,
}

/// A merge waiting in `merge_piece`'s queue. Fields compare in order, so the queue pops the
/// lowest rank first and, among equal ranks, the leftmost pair; the ids check that the pair is
/// still there when popped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Candidate {
    rank: u32,
    left: usize,
    left_id: u32,
    right_id: u32,
    merged: u32,
}

/// What a tokenizer is built from (a GGUF file's tokenizer metadata).
struct Parts<'a> {
    pre_name: String,
    pre: Vec<PreSplit>,
    tokens: Vec<String>,
    types: Vec<TokenType>,
    /// `"left right"` pairs, best first.
    merges: &'a [&'a str],
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
}

/// The merges as `(left, right) -> (rank, merged id)`; pairs naming tokens the vocabulary
/// lacks are skipped, and the first rank of a pair listed twice wins.
fn merge_ranks(
    vocab: &HashMap<&str, u32>,
    merge_list: &[&str],
) -> Result<HashMap<(u32, u32), (u32, u32)>> {
    let mut merges = HashMap::with_capacity(merge_list.len());
    for (rank, m) in merge_list.iter().enumerate() {
        let Some((l, r)) = m.split_once(' ') else {
            return Err(EngineError::Tokenizer(format!(
                "merge {rank} `{m}` has no space"
            )));
        };
        if let (Some(&li), Some(&ri), Some(&mi)) = (
            vocab.get(l),
            vocab.get(r),
            vocab.get(format!("{l}{r}").as_str()),
        ) {
            merges.entry((li, ri)).or_insert((rank as u32, mi));
        }
    }
    Ok(merges)
}

/// The bytes each token stands for: byte-level symbols mapped back through `alphabet` for
/// ordinary tokens, the text itself for control and user-defined ones.
fn token_bytes(alphabet: &[char], tokens: &[String], types: &[TokenType]) -> Vec<Vec<u8>> {
    let inverse: HashMap<char, u8> = alphabet
        .iter()
        .enumerate()
        .map(|(b, &c)| (c, b as u8))
        .collect();
    tokens
        .iter()
        .zip(types)
        .map(|(t, ty)| match ty {
            TokenType::Normal | TokenType::Byte | TokenType::Unknown => t
                .chars()
                .flat_map(|c| match inverse.get(&c) {
                    Some(&b) => vec![b],
                    None => c.to_string().into_bytes(),
                })
                .collect(),
            _ => t.as_bytes().to_vec(),
        })
        .collect()
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

/// llama.cpp's rule for files whose `general.name` names Phi-3 (`phi-3` or `phi3`, any case,
/// whatever the architecture): every special token drops the whitespace after it, `</s>`
/// too, but `<unk>`, `<s>` and `<|endoftext|>` do not. Empty for other names.
fn phi3_rstrip(name: Option<&str>, tokens: &[String], specials: &[u32]) -> HashSet<u32> {
    let name = name.unwrap_or("").to_lowercase();
    if !(name.contains("phi-3") || name.contains("phi3")) {
        return HashSet::new();
    }
    let id = |t: &str| tokens.iter().position(|x| x == t).map(|i| i as u32);
    let mut set: HashSet<u32> = specials.iter().copied().collect();
    set.extend(id("</s>"));
    for t in ["<unk>", "<s>", "<|endoftext|>"] {
        if let Some(i) = id(t) {
            set.remove(&i);
        }
    }
    set
}

/// Tokens split out of text before tokenizing, longest text first: control, user-defined and
/// unknown (`<unk>`), as llama.cpp's partition does (control and unknown only when special
/// tokens are parsed).
fn special_ids(tokens: &[String], types: &[TokenType]) -> Vec<u32> {
    let mut specials: Vec<u32> = (0..tokens.len() as u32)
        .filter(|&i| {
            matches!(
                types[i as usize],
                TokenType::Control | TokenType::UserDefined | TokenType::Unknown
            ) && !tokens[i as usize].is_empty()
        })
        .collect();
    specials.sort_by_key(|&i| std::cmp::Reverse(tokens[i as usize].len()));
    specials
}

/// The tokens that end a generation: the EOS token and the control tokens chat templates end
/// a turn with.
fn end_of_generation(eos: Option<u32>, tokens: &[String], types: &[TokenType]) -> HashSet<u32> {
    const END_OF_GENERATION: [&str; 6] = [
        "<|im_end|>",
        "<|endoftext|>",
        "<|eot_id|>",
        "<|end|>",
        "<end_of_turn>",
        "<|end_of_text|>",
    ];
    let mut eog: HashSet<u32> = eos.into_iter().collect();
    for (i, t) in tokens.iter().enumerate() {
        if END_OF_GENERATION.contains(&t.as_str()) && types[i] == TokenType::Control {
            eog.insert(i as u32);
        }
    }
    eog
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A tiny vocabulary: the 256 byte symbols, a few merges and two specials.
    pub(crate) fn tiny() -> Tokenizer {
        let alphabet = byte_alphabet();
        let mut tokens: Vec<String> = alphabet.iter().map(|c| c.to_string()).collect();
        let mut types = vec![TokenType::Normal; 256];
        let space = alphabet[b' ' as usize];
        for t in [
            "he",
            "ll",
            "llo",
            "hello",
            &format!("{space}w"),
            "<|im_start|>",
            "<tool>",
        ] {
            tokens.push(t.to_string());
        }
        types.extend([TokenType::Normal; 5]);
        types.push(TokenType::Control);
        types.push(TokenType::UserDefined);
        let merges = ["h e", "l l", "ll o", "he llo", &format!("{space} w")];
        let pre = vec![
            PreSplit::new(pre_tokenizer_patterns("qwen2").expect("known")[0]).expect("valid regex"),
        ];
        Tokenizer::build(Parts {
            pre_name: "qwen2".into(),
            pre,
            tokens,
            types,
            merges: &merges,
            bos: None,
            eos: None,
            add_bos: false,
        })
        .expect("tiny tokenizer builds")
    }

    /// Llama 3's pre-tokenizer: digits in runs of up to three, and a piece that is a token as a
    /// whole taken as that token though no merge leads to it (`ignore_merges`).
    #[test]
    fn llama_bpe_keeps_whole_pieces_and_splits_digits_by_three() {
        let base = tiny();
        let mut tokens = base.token_text.clone();
        let mut types = base.types.clone();
        tokens.push("wor".into());
        types.push(TokenType::Normal);
        let merges = ["h e", "l l", "ll o", "he llo"];
        let build = |pre: &str| {
            let patterns = pre_tokenizer_patterns(pre).expect("known");
            Tokenizer::build(Parts {
                pre_name: pre.into(),
                pre: patterns
                    .iter()
                    .map(|p| PreSplit::new(p).expect("regex"))
                    .collect(),
                tokens: tokens.clone(),
                types: types.clone(),
                merges: &merges,
                bos: None,
                eos: None,
                add_bos: false,
            })
            .expect("builds")
        };
        let wor = tokens.len() as u32 - 1;
        let (llama3, qwen2) = (build("llama-bpe"), build("qwen2"));
        assert_eq!(llama3.encode("wor", false).ids, [wor]);
        assert_eq!(
            qwen2.encode("wor", false).ids.len(),
            3,
            "bytes: no merge reaches it"
        );
        assert_eq!(
            llama3.encode("hello", false).ids,
            qwen2.encode("hello", false).ids
        );
        assert_eq!(llama3.pieces("1234567", 0, 7), [(0, 3), (3, 6), (6, 7)]);
        assert_eq!(qwen2.pieces("1234567", 0, 7).len(), 7);
    }

    /// The merge loop as first written: rescan every adjacent pair for the best merge, then
    /// `Vec::remove` the absorbed symbol; O(n²) per piece. The reference `merge_piece` must
    /// agree with.
    fn encode_quadratic(t: &Tokenizer, text: &str, parse_special: bool) -> Encoding {
        let mut out = Encoding::default();
        let bytes = text.as_bytes();
        for frag in t.split_special(text, parse_special) {
            let (s, e) = match frag {
                Fragment::Special(id, s, e) => {
                    out.ids.push(id);
                    out.offsets.push((s, e));
                    continue;
                }
                Fragment::Text(s, e) => (s, e),
            };
            for (ps, pe) in t.pieces(text, s, e) {
                // Symbols: (token id, start byte, end byte).
                let mut syms: Vec<(u32, usize, usize)> = (ps..pe)
                    .map(|i| (t.byte_token[bytes[i] as usize], i, i + 1))
                    .collect();
                loop {
                    let best = syms
                        .windows(2)
                        .enumerate()
                        .filter_map(|(i, w)| {
                            t.merges
                                .get(&(w[0].0, w[1].0))
                                .map(|&(rank, id)| (rank, i, id))
                        })
                        .min_by_key(|&(rank, i, _)| (rank, i));
                    let Some((_, i, id)) = best else { break };
                    syms[i] = (id, syms[i].1, syms[i + 1].2);
                    syms.remove(i + 1);
                }
                for (id, a, b) in syms.into_iter().filter(|s| s.0 != NO_TOKEN) {
                    out.ids.push(id);
                    out.offsets.push((a, b));
                }
            }
        }
        out
    }

    /// A byte-level vocabulary over `a`, `b`, `c` whose merges overlap heavily (`a a`, `aa a`,
    /// `a aa`, ...), so merge order and ties decide the result.
    fn overlapping() -> Tokenizer {
        use rand::{Rng, SeedableRng};
        let alphabet = byte_alphabet();
        let mut tokens: Vec<String> = alphabet.iter().map(|c| c.to_string()).collect();
        let mut merges = Vec::new();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut known: HashSet<String> = tokens.iter().cloned().collect();
        let mut pool: Vec<String> = ["a", "b", "c"].iter().map(|s| s.to_string()).collect();
        while merges.len() < 60 {
            let l = pool[rng.gen_range(0..pool.len())].clone();
            let r = pool[rng.gen_range(0..pool.len())].clone();
            let m = format!("{l}{r}");
            if m.len() > 6 || merges.contains(&format!("{l} {r}")) {
                continue;
            }
            merges.push(format!("{l} {r}"));
            if known.insert(m.clone()) {
                tokens.push(m.clone());
                pool.push(m);
            }
        }
        let types = vec![TokenType::Normal; tokens.len()];
        let merges: Vec<&str> = merges.iter().map(String::as_str).collect();
        let pre = vec![
            PreSplit::new(pre_tokenizer_patterns("qwen2").expect("known")[0]).expect("valid regex"),
        ];
        Tokenizer::build(Parts {
            pre_name: "qwen2".into(),
            pre,
            tokens,
            types,
            merges: &merges,
            bos: None,
            eos: None,
            add_bos: false,
        })
        .expect("overlapping tokenizer builds")
    }

    /// A random text mixing merge-prone letters, other ASCII, multibyte characters, the
    /// special tokens and long runs of one character or two alternating ones.
    fn random_text(rng: &mut rand::rngs::StdRng) -> String {
        use rand::Rng;
        const ATOMS: [&str; 36] = [
            "h",
            "e",
            "l",
            "o",
            "w",
            " ",
            "a",
            "b",
            "c",
            "Z",
            "7",
            "42",
            ".",
            ",",
            "'s",
            "!?",
            "\n",
            "\t",
            "é",
            "中",
            "🦀",
            "<|im_start|>",
            "<tool>",
            "  ",
            "\r\n",
            "\u{a0}",
            "\u{3000}",
            "'",
            "'S",
            "'re",
            "'LL",
            "d",
            "²",
            "٣",
            "Ω",
            "\r",
        ];
        let mut s = String::new();
        let parts = rng.gen_range(0..12);
        for _ in 0..parts {
            match rng.gen_range(0..4) {
                0 => {
                    let unit = ATOMS[rng.gen_range(0..ATOMS.len())];
                    s.push_str(&unit.repeat(rng.gen_range(1..200)));
                }
                1 => {
                    let (x, y) = (
                        ATOMS[rng.gen_range(0..ATOMS.len())],
                        ATOMS[rng.gen_range(0..ATOMS.len())],
                    );
                    for _ in 0..rng.gen_range(1..100) {
                        s.push_str(x);
                        s.push_str(y);
                    }
                }
                _ => {
                    for _ in 0..rng.gen_range(1..30) {
                        s.push_str(ATOMS[rng.gen_range(0..ATOMS.len())]);
                    }
                }
            }
        }
        s
    }

    #[test]
    fn linked_list_merge_matches_the_quadratic_reference() {
        use rand::SeedableRng;
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed);
        for t in [tiny(), overlapping()] {
            for case in 0..600 {
                let text = random_text(&mut rng);
                for special in [false, true] {
                    let want = encode_quadratic(&t, &text, special);
                    let got = t.encode(&text, special);
                    assert_eq!(got, want, "case {case} special={special}: {text:?}");
                }
            }
        }
    }

    /// `pieces` as first written: the pre-tokenizer patterns as llama.cpp writes them, run by
    /// fancy-regex's backtracking VM (fine for texts far below a million characters).
    fn pieces_fancy(patterns: &[Regex], text: &str) -> Vec<(usize, usize)> {
        let mut ranges = vec![(0, text.len())];
        for re in patterns {
            let mut next = Vec::new();
            for (rs, re_end) in ranges {
                let hay = &text[rs..re_end];
                let mut cur = 0;
                for m in re.find_iter(hay) {
                    let m = m.expect("no backtracking limit on short texts");
                    if m.start() > cur {
                        next.push((rs + cur, rs + m.start()));
                    }
                    if m.end() > m.start() {
                        next.push((rs + m.start(), rs + m.end()));
                    }
                    cur = m.end();
                }
                if cur < hay.len() {
                    next.push((rs + cur, re_end));
                }
            }
            ranges = next;
        }
        ranges
    }

    /// A tokenizer that only pre-tokenizes, with the patterns `pre` names.
    fn splitter(pre: &str) -> Tokenizer {
        let mut t = tiny();
        t.pre = pre_tokenizer_patterns(pre)
            .expect("known")
            .iter()
            .map(|p| PreSplit::new(p).expect("valid regex"))
            .collect();
        t
    }

    #[test]
    fn linear_pre_tokenizer_matches_the_lookahead_patterns() {
        use rand::SeedableRng;
        let mut rng = rand::rngs::StdRng::seed_from_u64(0xcafe);
        let fixed = [
            "   x",
            "  \n x",
            "\n\n  ",
            "a  \t\n\n b",
            " \u{a0}\u{3000}x",
            "x \r\n  y",
            " ",
            "  ",
        ];
        for pre in ["qwen2", "gpt2", "smollm"] {
            let t = splitter(pre);
            let patterns: Vec<Regex> = pre_tokenizer_patterns(pre)
                .expect("known")
                .iter()
                .map(|p| Regex::new(p).expect("valid regex"))
                .collect();
            let texts = fixed
                .iter()
                .map(|s| s.to_string())
                .chain((0..1500).map(|_| random_text(&mut rng)));
            for text in texts {
                assert_eq!(
                    t.pieces(&text, 0, text.len()),
                    pieces_fancy(&patterns, &text),
                    "{pre}: {text:?}"
                );
            }
        }
    }

    /// Regression: fancy-regex's VM overflows its stack on a match of about a million
    /// characters, and everything from there to the end of the fragment became one piece.
    #[test]
    fn runs_of_millions_of_characters_still_split_like_the_pattern() {
        let (short, long) = (8, 1 << 21);
        for pre in ["qwen2", "gpt2", "smollm"] {
            let t = splitter(pre);
            let patterns: Vec<Regex> = pre_tokenizer_patterns(pre)
                .expect("known")
                .iter()
                .map(|p| Regex::new(p).expect("valid regex"))
                .collect();
            for (unit, tail) in [
                ("x", " yz"),
                (" ", "yz"),
                ("\t", "yz"),
                ("\n", "  yz"),
                (" \n", "yz"),
                (".", " yz"),
                ("é", "!"),
                ("7", "a"),
            ] {
                // The pieces of the long run are those of a short one, stretched: only the
                // first and last characters of a run can start a piece.
                let w = unit.len();
                let stretch = |o: usize| if o <= w { o } else { o + (long - short) * w };
                let small = unit.repeat(short) + tail;
                let want: Vec<(usize, usize)> = pieces_fancy(&patterns, &small)
                    .into_iter()
                    .map(|(s, e)| (stretch(s), stretch(e)))
                    .collect();
                let text = unit.repeat(long) + tail;
                if unit == "7" && pre != "gpt2" {
                    // Every digit is a piece for these patterns.
                    assert_eq!(t.pieces(&text, 0, text.len()).len(), long + 1);
                    continue;
                }
                assert_eq!(t.pieces(&text, 0, text.len()), want, "{pre} {unit:?}");
            }
        }
    }

    /// Checks that `enc` decodes back to `text` and its offsets tile it.
    fn assert_covers(t: &Tokenizer, enc: &Encoding, text: &str) {
        assert_eq!(enc.ids.len(), enc.offsets.len());
        let mut at = 0;
        for &(s, e) in &enc.offsets {
            assert_eq!(s, at, "offsets must be contiguous");
            assert!(e > s);
            at = e;
        }
        assert_eq!(at, text.len());
        assert!(t.decode(&enc.ids, true) == text, "round trip");
    }

    /// Regression: one long word used to cost O(n²) (a 32k-character word took 13 s, a MiB
    /// one hours), since every merge rescanned all pairs and shifted the symbol vector.
    #[test]
    fn one_long_word_tokenizes_in_near_linear_time() {
        let t = tiny();
        let ll = t.token_id("ll").expect("in vocab");
        let word = "l".repeat(200_000);
        let enc = t.encode(&word, false);
        assert_covers(&t, &enc, &word);
        assert_eq!(enc.ids, vec![ll; 100_000]);
        let hello = "hello".repeat(40_000);
        let enc = t.encode(&hello, false);
        assert_covers(&t, &enc, &hello);
        assert_eq!(enc.ids.len(), 40_000);
        let crabs = "🦀".repeat(200_000);
        let enc = t.encode(&crabs, false);
        assert_covers(&t, &enc, &crabs);
        assert_eq!(enc.ids.len(), 800_000, "no merges: one token per byte");
        let t = overlapping();
        let word: String = "abcab".repeat(40_000);
        let enc = t.encode(&word, false);
        assert_covers(&t, &enc, &word);
    }

    /// Timings of one long word, new merge vs the quadratic reference (which is skipped where
    /// it would take minutes), with the tiny vocabulary and, when present, the real ones; and
    /// of the pre-tokenizer on long runs. Run with
    /// `cargo test --release -p target-engine --lib tokenizer::tests::long_input_timings -- --ignored --nocapture`.
    #[test]
    #[ignore = "benchmark: prints timings"]
    fn long_input_timings() {
        use std::time::Instant;
        let secs = |f: &mut dyn FnMut()| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        };
        let models = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models");
        let mut toks = vec![("tiny", tiny(), "l")];
        for (name, file) in [
            ("qwen2.5", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
            ("smollm2", "smollm2-135m-instruct-q4_1.gguf"),
        ] {
            let path = models.join(file);
            if path.is_file() {
                let f = crate::gguf::GgufFile::open(&path).expect("open gguf");
                toks.push((name, Tokenizer::from_gguf(&f).expect("tokenizer"), "a"));
            }
        }
        for (name, t, unit) in &toks {
            for n in [16_000, 32_000, 256_000, 1 << 20] {
                let word = unit.repeat(n);
                let mut new = Encoding::default();
                let new_s = secs(&mut || new = t.encode(&word, false));
                assert_covers(t, &new, &word);
                let old = if n <= 32_000 {
                    let mut old = Encoding::default();
                    let old_s = secs(&mut || old = encode_quadratic(t, &word, false));
                    assert_eq!(old, new);
                    format!("{old_s:9.3} s")
                } else {
                    "  skipped".to_string()
                };
                println!(
                    "{name:8} {unit:?} x {n:8}: old {old}  new {new_s:7.4} s  ({} tokens)",
                    new.ids.len()
                );
            }
            let runs = [
                ("letters", "x".repeat(1 << 20)),
                ("spaces", " ".repeat(1 << 20)),
                ("spaces+x", " ".repeat(1 << 20) + "x"),
                ("newlines", "\n".repeat(1 << 20)),
                ("space-newline", " \n".repeat(1 << 19)),
                ("digits", "7".repeat(1 << 20)),
                ("punct", ".".repeat(1 << 20)),
                ("emoji", "🦀".repeat(1 << 18)),
                ("words", "ab ".repeat(1 << 18)),
            ];
            for (what, text) in runs {
                let mut n = 0;
                let s = secs(&mut || n = t.pieces(&text, 0, text.len()).len());
                println!("{name:8} pieces of 1 MiB {what:14}: {s:7.4} s, {n} pieces");
            }
            let doc = "<|im_start|>user\nhi <tool> there\n".repeat(1 << 15);
            let n_special = t.specials.len();
            let s = secs(&mut || drop(t.split_special(&doc, true)));
            println!("{name:8} split_special 1 MiB, {n_special} specials: {s:7.4} s");
        }
    }

    #[test]
    fn merges_apply_by_rank_and_offsets_cover_the_text() {
        let t = tiny();
        let enc = t.encode("hello wo", false);
        let hello = t.token_id("hello").expect("in vocab");
        assert_eq!(enc.ids[0], hello);
        assert_eq!(enc.offsets, vec![(0, 5), (5, 7), (7, 8)]);
        assert_eq!(t.decode(&enc.ids, false), "hello wo");
    }

    #[test]
    fn control_tokens_are_parsed_only_on_request_user_defined_always() {
        let t = tiny();
        let start = t.token_id("<|im_start|>").expect("in vocab");
        let tool = t.token_id("<tool>").expect("in vocab");
        let plain = t.encode("<|im_start|>x<tool>", false);
        assert!(!plain.ids.contains(&start));
        assert!(plain.ids.contains(&tool));
        let special = t.encode("<|im_start|>x<tool>", true);
        assert_eq!(special.ids[0], start);
        assert_eq!(special.offsets[0], (0, 12));
        assert_eq!(t.decode(&special.ids, false), "x<tool>");
        assert_eq!(t.decode(&special.ids, true), "<|im_start|>x<tool>");
    }

    #[test]
    fn multibyte_characters_round_trip_and_char_offsets_widen() {
        let t = tiny();
        let text = "é東";
        let enc = t.encode(text, false);
        assert_eq!(enc.ids.len(), 5, "no merges: one token per byte");
        assert_eq!(t.decode(&enc.ids, false), text);
        assert_eq!(
            enc.char_offsets(text),
            vec![(0, 1), (0, 1), (1, 2), (1, 2), (1, 2)]
        );
        assert!(t.encode("", true).ids.is_empty());
    }
}
