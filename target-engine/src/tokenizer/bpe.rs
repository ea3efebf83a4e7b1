//! Byte-level BPE (the GGUF `gpt2` tokenizer model): GPT-2's byte alphabet, the merges by
//! rank, and the merging of one pre-tokenized piece, as llama.cpp's `llm_tokenizer_bpe` does.

use super::token::{Encoding, TokenType, NO_TOKEN};
use crate::error::{EngineError, Result};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

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

/// What byte-level BPE merges a piece with.
#[derive(Debug, Clone)]
pub(super) struct Bpe {
    /// (left id, right id) -> (rank, merged id)
    pub(super) merges: HashMap<(u32, u32), (u32, u32)>,
    pub(super) byte_token: [u32; 256],
    /// Llama 3's `ignore_merges`: a pre-tokenized piece that is a token of the vocabulary as a
    /// whole becomes that token without merging (its bytes -> id; llama.cpp does this for the
    /// `llama-bpe` pre-tokenizer). `None` for the others.
    pub(super) whole_pieces: Option<HashMap<Vec<u8>, u32>>,
}

impl Bpe {
    /// Appends the tokens of one pre-tokenized piece `bytes[ps..pe]`: the piece's own token
    /// where whole pieces are taken and it is one, its merged bytes otherwise.
    pub(super) fn encode_piece(&self, bytes: &[u8], ps: usize, pe: usize, out: &mut Encoding) {
        if let Some(&id) = self
            .whole_pieces
            .as_ref()
            .and_then(|w| w.get(&bytes[ps..pe]))
        {
            out.ids.push(id);
            out.offsets.push((ps, pe));
            return;
        }
        self.merge_piece(bytes, ps, pe, out);
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

/// The merges as `(left, right) -> (rank, merged id)`; pairs naming tokens the vocabulary
/// lacks are skipped, and the first rank of a pair listed twice wins.
pub(super) fn merge_ranks(
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
pub(super) fn token_bytes(
    alphabet: &[char],
    tokens: &[String],
    types: &[TokenType],
) -> Vec<Vec<u8>> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::load::Parts;
    use crate::tokenizer::pre::{pre_tokenizer_patterns, PreSplit};
    use crate::tokenizer::special::Fragment;
    use crate::tokenizer::tests::{random_text, tiny};
    use crate::tokenizer::Tokenizer;
    use std::collections::HashSet;

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
                    .map(|i| (t.bpe.byte_token[bytes[i] as usize], i, i + 1))
                    .collect();
                loop {
                    let best = syms
                        .windows(2)
                        .enumerate()
                        .filter_map(|(i, w)| {
                            t.bpe
                                .merges
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
    /// `cargo test --release -p target-engine --lib tokenizer::bpe::tests::long_input_timings -- --ignored --nocapture`.
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
            let n_special = t.specials.ids.len();
            let s = secs(&mut || drop(t.split_special(&doc, true)));
            println!("{name:8} split_special 1 MiB, {n_special} specials: {s:7.4} s");
        }
    }
}
