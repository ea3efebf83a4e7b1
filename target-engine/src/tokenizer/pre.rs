//! Pre-tokenizers: the regexes `tokenizer.ggml.pre` names, as llama.cpp defines them, that
//! split a fragment of text into the pieces byte-level BPE merges within.

use crate::error::{EngineError, Result};
use fancy_regex::Regex;

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
pub(super) struct PreSplit {
    re: Regex,
    /// `\A(?:head)`, when `re` is `head|\s+`: whether a match came from the head.
    head: Option<Regex>,
}

impl PreSplit {
    pub(super) fn new(pattern: &str) -> Result<Self> {
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

/// Splits `text[s..e]` with the pre-tokenizer regexes `pre`, in turn, keeping unmatched gaps.
pub(super) fn pieces(pre: &[PreSplit], text: &str, s: usize, e: usize) -> Vec<(usize, usize)> {
    let mut ranges = vec![(s, e)];
    for split in pre {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::{random_text, tiny};
    use crate::tokenizer::Tokenizer;

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
}
