//! Passages found inside a prompt's own text: what a RAG application pastes into its messages
//! (LangChain's "stuff" chains join retrieved documents with blank lines into a system or user
//! message) is cut back into passages so their chunk KV is reused by content, like
//! `documents` sent explicitly.
//!
//! The rule is positional and cheap, with no separator strings: a text is cut into paragraphs
//! at blank lines; a paragraph of at least [`MIN_PASSAGE_CHARS`] characters is passage text,
//! and the short paragraphs before it (a title, a `Source:` line) belong to the same passage.
//! Short paragraphs before the first long one and after the last long one are instructions
//! and stay where the prompt recomputes them. A mistake either way costs speed, never
//! correctness: a short passage left as instructions is recomputed, and an instruction read as
//! a passage is still in the prompt, read from stored KV under the fidelity guard.

/// Shortest paragraph read as passage text: longer than a typical instruction ("Use the
/// following pieces of context to answer the question at the end." is 71), shorter than a
/// typical retrieved chunk (LangChain's default splitter cuts 1000 characters).
pub const MIN_PASSAGE_CHARS: usize = 200;

/// A text cut into the passages it holds and the rest, both in their order.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Split<'a> {
    /// Passage texts (paragraphs joined by a blank line).
    pub passages: Vec<String>,
    /// The paragraphs that are not passage text.
    pub rest: Vec<&'a str>,
}

impl Split<'_> {
    /// The rest as one text, paragraphs separated by a blank line.
    pub fn rest_text(&self) -> String {
        self.rest.join("\n\n")
    }
}

/// The paragraphs of `text`: runs of non-blank lines, each trimmed.
pub fn paragraphs(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start: Option<usize> = None;
    let mut end = 0;
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        if line.trim().is_empty() {
            if let Some(s) = start.take() {
                out.push(text[s..end].trim());
            }
        } else {
            start.get_or_insert(at);
            end = at + line.len();
        }
        at += line.len();
    }
    if let Some(s) = start {
        out.push(text[s..end].trim());
    }
    out
}

/// Cuts `text` into passages and the rest. With `keep_last`, the last paragraph is never
/// passage text (a user message's question, however long, stays the question).
pub fn split(text: &str, keep_last: bool) -> Split<'_> {
    let paras = paragraphs(text);
    let candidates = paras.len() - usize::from(keep_last && !paras.is_empty());
    let long = |p: &&str| p.chars().count() >= MIN_PASSAGE_CHARS;
    let Some(first) = paras[..candidates].iter().position(long) else {
        return Split {
            passages: Vec::new(),
            rest: paras,
        };
    };
    // `first` exists, so a last long paragraph does too.
    let last = paras[..candidates].iter().rposition(long).unwrap_or(first);
    // When every later passage (two at least) has the same number of short paragraphs before
    // it (a `Source: ...` line each), the first one has them too: found the same wherever it
    // is.
    let longs: Vec<usize> = (first..=last).filter(|&i| long(&paras[i])).collect();
    let heading = match longs
        .windows(2)
        .map(|w| w[1] - w[0] - 1)
        .collect::<Vec<_>>()[..]
    {
        [g, ref more @ ..] if g > 0 && !more.is_empty() && more.iter().all(|&m| m == g) => {
            g.min(first)
        }
        _ => 0,
    };
    let first = first - heading;
    let mut passages = Vec::new();
    let mut pending: Vec<&str> = Vec::new();
    for p in &paras[first..=last] {
        pending.push(p);
        if long(p) {
            passages.push(pending.join("\n\n"));
            pending.clear();
        }
    }
    let mut rest = paras[..first].to_vec();
    rest.extend_from_slice(&paras[last + 1..]);
    Split { passages, rest }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn long(tag: &str) -> String {
        format!("{tag} {}", "word ".repeat(MIN_PASSAGE_CHARS / 5))
    }

    #[test]
    fn paragraphs_are_cut_at_blank_lines_and_trimmed() {
        let text = "  one\nline two \n\n \t\nthree\r\n\r\nfour\n";
        assert_eq!(paragraphs(text), vec!["one\nline two", "three", "four"]);
        assert!(paragraphs("").is_empty());
        assert!(paragraphs("\n \n").is_empty());
    }

    #[test]
    fn long_paragraphs_are_passages_and_short_ones_around_them_instructions() {
        let (a, b) = (long("alpha"), long("beta"));
        let text = format!("Answer from the context below.\n\n{a}\n\nTitle B\n\n{b}\n\nBe brief.");
        let s = split(&text, false);
        assert_eq!(
            s.passages,
            vec![a.trim().to_string(), format!("Title B\n\n{}", b.trim())]
        );
        assert_eq!(s.rest, vec!["Answer from the context below.", "Be brief."]);
        assert_eq!(s.rest_text(), "Answer from the context below.\n\nBe brief.");
    }

    #[test]
    fn short_texts_hold_no_passage() {
        let s = split("Answer briefly.\n\nCite the passage.", false);
        assert!(s.passages.is_empty());
        assert_eq!(s.rest, vec!["Answer briefly.", "Cite the passage."]);
    }

    #[test]
    fn a_question_stays_the_question_however_long() {
        let q = long("why");
        assert!(split(&q, true).passages.is_empty());
        assert_eq!(split(&q, false).passages.len(), 1);
        let a = long("context");
        let text = format!("Context:\n\n{a}\n\n{q}");
        let s = split(&text, true);
        assert_eq!(s.passages, vec![a.trim().to_string()]);
        assert_eq!(s.rest, vec!["Context:", q.trim()]);
    }

    #[test]
    fn the_same_passages_are_found_whatever_their_order_and_separators() {
        let (a, b) = (long("alpha"), long("beta"));
        let one = split(&format!("{a}\n\n{b}"), false).passages;
        let two = split(&format!("Intro\n\n{b}\n \n\n{a}\n"), false).passages;
        assert_eq!(one, vec![two[1].clone(), two[0].clone()]);
    }
}
