//! SentencePiece tokenization as llama.cpp runs it for `tokenizer.ggml.model` = `llama`
//! vocabularies (Gemma, Phi-3, Llama 2, early Mistral): spaces written as `▁`, one symbol per
//! character, then the adjacent pair whose concatenation is a token with the highest score is
//! merged (the leftmost among equal scores) until none is; a symbol that is no token is written
//! as its bytes (`<0xXX>` tokens). Offsets stay those of the original text.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// What SentencePiece needs of a vocabulary.
#[derive(Debug, Clone)]
pub(crate) struct Spm {
    /// Token text (with `▁` for spaces) -> id.
    pub lookup: HashMap<String, u32>,
    pub scores: Vec<f32>,
    /// `<0xXX>` token of each byte (`u32::MAX` where the vocabulary has none).
    pub byte_token: [u32; 256],
    /// Whether text after the start or a special token gets a leading space
    /// (`tokenizer.ggml.add_space_prefix`).
    pub space_prefix: bool,
}

/// A run of characters being merged: byte range in the original text, its `▁`-escaped text,
/// and its neighbours (`usize::MAX` for none).
struct Symbol {
    start: usize,
    end: usize,
    text: String,
    prev: usize,
    next: usize,
    /// Absorbed by its left neighbour.
    gone: bool,
}

/// A candidate merge: higher score first, then the leftmost.
#[derive(PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Length of the merged text when the candidate was made: stale if the symbols changed.
    len: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then(other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

const NONE: usize = usize::MAX;

impl Spm {
    /// Tokenizes `text[range]`, appending to `ids` and their byte `offsets`; `prefix` puts a
    /// space before it (an empty range in the offsets).
    pub fn encode(
        &self,
        text: &str,
        range: std::ops::Range<usize>,
        prefix: bool,
        ids: &mut Vec<u32>,
        offsets: &mut Vec<(usize, usize)>,
    ) {
        let std::ops::Range { start: s, end: e } = range;
        let mut syms: Vec<Symbol> = Vec::with_capacity(e - s + 1);
        let mut push = |start: usize, end: usize, t: &str| {
            let i = syms.len();
            syms.push(Symbol {
                start,
                end,
                text: t.replace(' ', "\u{2581}"),
                prev: if i == 0 { NONE } else { i - 1 },
                next: i + 1,
                gone: false,
            });
        };
        if prefix && self.space_prefix {
            push(s, s, " ");
        }
        for (i, c) in text[s..e].char_indices() {
            let at = s + i;
            push(at, at + c.len_utf8(), &text[at..at + c.len_utf8()]);
        }
        let Some(last) = syms.last_mut() else {
            return;
        };
        last.next = NONE;
        let mut queue = BinaryHeap::new();
        for left in 1..syms.len() {
            self.candidate(&syms, left - 1, left, &mut queue);
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (b.left, b.right);
            if syms[l].gone || syms[r].gone || syms[l].text.len() + syms[r].text.len() != b.len {
                continue;
            }
            let right = std::mem::take(&mut syms[r].text);
            syms[r].gone = true;
            syms[l].text.push_str(&right);
            syms[l].end = syms[r].end;
            let after = syms[r].next;
            syms[l].next = after;
            if after != NONE {
                syms[after].prev = l;
            }
            if syms[l].prev != NONE {
                self.candidate(&syms, syms[l].prev, l, &mut queue);
            }
            if after != NONE {
                self.candidate(&syms, l, after, &mut queue);
            }
        }
        let mut i = 0;
        while i != NONE {
            let sym = &syms[i];
            if let Some(&id) = self.lookup.get(&sym.text) {
                ids.push(id);
                offsets.push((sym.start, sym.end));
            } else {
                // No token: the bytes of its (escaped) text, as llama.cpp writes them, each
                // placed at its byte of the original text where it has one.
                for (k, b) in sym.text.bytes().enumerate() {
                    let id = self.byte_token[b as usize];
                    if id != u32::MAX {
                        ids.push(id);
                        let at = (sym.start + k).min(sym.end);
                        offsets.push((at, (at + 1).min(sym.end)));
                    }
                }
            }
            i = sym.next;
        }
    }

    fn candidate(
        &self,
        syms: &[Symbol],
        left: usize,
        right: usize,
        queue: &mut BinaryHeap<Bigram>,
    ) {
        let (a, b) = (&syms[left].text, &syms[right].text);
        let mut joined = String::with_capacity(a.len() + b.len());
        joined.push_str(a);
        joined.push_str(b);
        if let Some(&id) = self.lookup.get(&joined) {
            queue.push(Bigram {
                score: self.scores.get(id as usize).copied().unwrap_or(0.0),
                left,
                right,
                len: joined.len(),
            });
        }
    }
}
