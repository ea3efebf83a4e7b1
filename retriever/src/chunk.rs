//! Splitting a document into chunks of at most `max_tokens` tokens of the caller's tokenizer.
//!
//! Chunks are exact, whitespace-trimmed substrings of the document, in order and without overlap.
//! Whole paragraphs are packed greedily; a paragraph too long on its own is split at sentence
//! ends and its sentences packed; a sentence too long on its own is cut between tokens. Every
//! candidate is counted by tokenizing it alone, because a tokenizer may merge or split
//! differently across a cut than inside the longer text.

use std::ops::Range;

use serde::Serialize;

use crate::error::{Result, RetrieverError};

/// The caller's tokenizer, as seen by the chunker.
///
/// `encode` returns the token ids of `text` and, for each token, its `[start, end)` byte range in
/// `text`. It should add no special tokens (BOS/EOS): the ids of a chunk are stored as its tokens.
/// Offsets may overlap or fall inside a UTF-8 character (byte-level tokens); such offsets are
/// simply never used as cut points.
pub trait TokenCount {
    /// Token ids of `text` and their byte ranges in `text`.
    fn encode(&self, text: &str) -> (Vec<u32>, Vec<(usize, usize)>);
}

impl<F> TokenCount for F
where
    F: Fn(&str) -> (Vec<u32>, Vec<(usize, usize)>),
{
    fn encode(&self, text: &str) -> (Vec<u32>, Vec<(usize, usize)>) {
        self(text)
    }
}

/// How documents are cut into chunks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkParams {
    /// Most tokens in one chunk (configured as `chunk_tokens`); must be at least 1.
    pub max_tokens: usize,
}

impl Default for ChunkParams {
    fn default() -> Self {
        Self { max_tokens: 512 }
    }
}

/// One chunk of a document: an exact substring and its tokens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Chunk {
    /// Id of the document the chunk comes from.
    pub doc_id: String,
    /// Index of the chunk within its document, from 0.
    pub position: usize,
    /// The chunk text, `document.chars()[start..end]`.
    pub text: String,
    /// Token ids of `text` tokenized on its own.
    pub ids: Vec<u32>,
    /// First character (Unicode scalar value) of the chunk in the document.
    pub start: usize,
    /// One past the last character of the chunk in the document.
    pub end: usize,
}

/// Splits `text` into chunks of 1 to `params.max_tokens` tokens each.
///
/// Errors: `EmptyText` when `text` has no non-whitespace character, `InvalidArgument` for
/// `chunk_tokens` when `max_tokens` is 0 or a single character needs more tokens than that, and
/// `Tokenizer` when `tok` returns offsets outside its input or no token for non-blank text.
pub fn chunk_document(
    doc_id: &str,
    text: &str,
    tok: &dyn TokenCount,
    params: &ChunkParams,
) -> Result<Vec<Chunk>> {
    if params.max_tokens == 0 {
        return Err(RetrieverError::InvalidArgument {
            field: "chunk_tokens",
            reason: "must be at least 1".into(),
        });
    }
    if text.trim().is_empty() {
        return Err(RetrieverError::EmptyText {
            doc_id: doc_id.to_string(),
        });
    }
    let chunker = Chunker {
        text,
        tok,
        max: params.max_tokens,
    };
    let mut pieces = Vec::new();
    chunker.pack(paragraphs(text), Level::Paragraph, &mut pieces)?;
    Ok(to_chunks(doc_id, text, pieces))
}

/// Token ids of a text and their byte ranges in it.
struct Encoded {
    ids: Vec<u32>,
    offsets: Vec<(usize, usize)>,
}

/// A finished piece: a trimmed byte range of the document and its token ids.
struct Piece {
    range: Range<usize>,
    ids: Vec<u32>,
}

#[derive(Clone, Copy)]
enum Level {
    Paragraph,
    Sentence,
}

struct Chunker<'a> {
    text: &'a str,
    tok: &'a dyn TokenCount,
    max: usize,
}

impl Chunker<'_> {
    /// Tokenizes the document bytes `range`, checking the offsets the tokenizer returns.
    fn encode(&self, range: Range<usize>) -> Result<Encoded> {
        let slice = &self.text[range];
        let (ids, offsets) = self.tok.encode(slice);
        if ids.len() != offsets.len() {
            return Err(RetrieverError::Tokenizer {
                reason: format!(
                    "returned {} ids but {} offsets for one text",
                    ids.len(),
                    offsets.len()
                ),
            });
        }
        if let Some((i, &(s, e))) = offsets
            .iter()
            .enumerate()
            .find(|(_, &(s, e))| s > e || e > slice.len())
        {
            return Err(RetrieverError::Tokenizer {
                reason: format!(
                    "offset of token {i} is {s}..{e}, outside the {} bytes of its input",
                    slice.len()
                ),
            });
        }
        Ok(Encoded { ids, offsets })
    }

    /// Packs consecutive `units` (trimmed byte ranges) greedily into pieces of at most `max`
    /// tokens; a unit too long on its own is split one level further down.
    ///
    /// Re-tokenizing the growing piece after each unit would cost (units per piece) times the
    /// text; instead the sum of the units' own counts proposes how many fit, and the joined text
    /// is tokenized to confirm, backing off or reaching further one unit at a time. Joined counts
    /// are usually within a token or two of the sum, so this takes a few tokenizations a piece.
    fn pack(&self, units: Vec<Range<usize>>, level: Level, out: &mut Vec<Piece>) -> Result<()> {
        let alone = units
            .iter()
            .map(|u| self.encode(u.clone()))
            .collect::<Result<Vec<_>>>()?;
        let fits_alone = |j: usize| alone[j].ids.len() <= self.max;
        let mut i = 0;
        while i < units.len() {
            if !fits_alone(i) {
                let unit = units[i].clone();
                match level {
                    Level::Paragraph => {
                        let sentences = sentences(self.text, unit);
                        self.pack(sentences, Level::Sentence, out)?;
                    }
                    Level::Sentence => self.cut_tokens(unit, &alone[i].offsets, out)?,
                }
                i += 1;
                continue;
            }
            // Units i..end are the proposal.
            let mut end = i + 1;
            let mut sum = alone[i].ids.len();
            while end < units.len() && fits_alone(end) && sum + alone[end].ids.len() <= self.max {
                sum += alone[end].ids.len();
                end += 1;
            }
            let proposed = end;
            let mut piece = loop {
                if end == i + 1 {
                    break Piece {
                        range: units[i].clone(),
                        ids: alone[i].ids.clone(),
                    };
                }
                let range = units[i].start..units[end - 1].end;
                let ids = self.encode(range.clone())?.ids;
                if ids.len() <= self.max {
                    break Piece { range, ids };
                }
                end -= 1;
            };
            if end == proposed {
                // The joined text may count fewer tokens than the sum: take more while it fits.
                while end < units.len() && fits_alone(end) {
                    let range = units[i].start..units[end].end;
                    let ids = self.encode(range.clone())?.ids;
                    if ids.len() > self.max {
                        break;
                    }
                    piece = Piece { range, ids };
                    end += 1;
                }
            }
            self.push(piece, out)?;
            i = end;
        }
        Ok(())
    }

    fn push(&self, piece: Piece, out: &mut Vec<Piece>) -> Result<()> {
        if piece.ids.is_empty() {
            return Err(RetrieverError::Tokenizer {
                reason: format!(
                    "returned no token for the non-blank text {:?}",
                    &self.text[piece.range]
                ),
            });
        }
        out.push(piece);
        Ok(())
    }

    /// Cuts `unit` (whose tokens have `offsets`, relative to the unit) between tokens into pieces
    /// of at most `max` tokens each, never inside a UTF-8 character or a token.
    fn cut_tokens(
        &self,
        unit: Range<usize>,
        offsets: &[(usize, usize)],
        out: &mut Vec<Piece>,
    ) -> Result<()> {
        let base = unit.start;
        let slice = &self.text[unit.clone()];
        let n = offsets.len();
        // cuts[k] = Some(byte) when cutting at `byte` leaves tokens 0..k entirely before it and
        // tokens k.. entirely after it (offsets may overlap or be byte-level inside a character).
        let mut min_start_from = vec![slice.len(); n + 1];
        for k in (0..n).rev() {
            min_start_from[k] = min_start_from[k + 1].min(offsets[k].0);
        }
        let mut cuts: Vec<Option<usize>> = vec![None; n + 1];
        let mut max_end_before = 0;
        for k in 1..n {
            max_end_before = max_end_before.max(offsets[k - 1].1);
            let c = min_start_from[k];
            if max_end_before <= c && slice.is_char_boundary(c) {
                cuts[k] = Some(c);
            }
        }
        cuts[n] = Some(slice.len());

        let mut start = 0; // byte in `slice` where the current piece starts
        let mut first = 0; // first token of the current piece
        while first < n || start < slice.len() {
            let rest = slice[start..].trim_start();
            if rest.is_empty() {
                break;
            }
            start = slice.len() - rest.len();
            // Largest clean cut at most `max` tokens ahead whose re-tokenized piece fits.
            let mut accepted = None;
            let last = (first + self.max).min(n);
            for k in (first + 1..=last).rev() {
                let Some(c) = cuts[k] else { continue };
                if c <= start {
                    break;
                }
                let range = trim(slice, start..c);
                if range.is_empty() {
                    continue;
                }
                let ids = self.encode(base + range.start..base + range.end)?.ids;
                if !ids.is_empty() && ids.len() <= self.max {
                    accepted = Some((k, c, range, ids));
                    break;
                }
            }
            let (k, c, range, ids) = match accepted {
                Some(a) => a,
                None => {
                    // No usable token boundary: fall back to the longest prefix by characters.
                    let (c, range, ids) = self.longest_prefix(base, slice, start)?;
                    let k = (first..=n).find(|&k| min_start_from[k] >= c).unwrap_or(n);
                    (k, c, range, ids)
                }
            };
            out.push(Piece {
                range: base + range.start..base + range.end,
                ids,
            });
            first = k;
            start = c;
        }
        Ok(())
    }

    /// The longest prefix of `slice[start..]`, ending on a character boundary, that tokenizes
    /// alone to 1..=max tokens. Token count is close to monotone in the prefix length, so a binary
    /// search finds a good prefix; the result is checked, so a non-monotone tokenizer costs only
    /// chunk fill, never the limit.
    fn longest_prefix(
        &self,
        base: usize,
        slice: &str,
        start: usize,
    ) -> Result<(usize, Range<usize>, Vec<u32>)> {
        // Bound the search so a pathological tokenizer cannot make this quadratic in the text.
        let window = self.max.saturating_mul(16).saturating_add(16);
        let ends: Vec<usize> = slice[start..]
            .char_indices()
            .map(|(i, ch)| start + i + ch.len_utf8())
            .take(window)
            .collect();
        let fits = |end: usize| -> Result<Option<(Range<usize>, Vec<u32>)>> {
            let range = trim(slice, start..end);
            if range.is_empty() {
                return Ok(None);
            }
            let ids = self.encode(base + range.start..base + range.end)?.ids;
            Ok((!ids.is_empty() && ids.len() <= self.max).then_some((range, ids)))
        };
        let Some(&first_end) = ends.first() else {
            return Err(RetrieverError::Tokenizer {
                reason: "no text left to cut".into(),
            });
        };
        let Some(mut best) = fits(first_end)?.map(|(r, ids)| (first_end, r, ids)) else {
            let ch = &slice[start..first_end];
            let ids = self.encode(base + start..base + first_end)?.ids;
            if ids.is_empty() {
                return Err(RetrieverError::Tokenizer {
                    reason: format!("returned no token for the character {ch:?}"),
                });
            }
            return Err(RetrieverError::InvalidArgument {
                field: "chunk_tokens",
                reason: format!(
                    "the character {ch:?} at byte {} alone encodes to {} tokens, more than \
                     chunk_tokens = {}",
                    base + start,
                    ids.len(),
                    self.max
                ),
            });
        };
        let (mut lo, mut hi) = (1, ends.len()); // ends[..lo] known to fit
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match fits(ends[mid])? {
                Some((r, ids)) => {
                    best = (ends[mid], r, ids);
                    lo = mid + 1;
                }
                None => hi = mid,
            }
        }
        Ok(best)
    }
}

/// `range` of `s` without leading and trailing whitespace.
fn trim(s: &str, range: Range<usize>) -> Range<usize> {
    let piece = &s[range.clone()];
    let lead = piece.len() - piece.trim_start().len();
    let trail = piece.len() - piece.trim_end().len();
    if lead == piece.len() {
        return range.start..range.start;
    }
    range.start + lead..range.end - trail
}

/// Byte ranges of the paragraphs of `text`: runs of lines that are not blank, trimmed.
fn paragraphs(text: &str) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut para_start: Option<usize> = None;
    let mut pos = 0;
    for line in text.split_inclusive('\n') {
        let blank = line.trim().is_empty();
        match (blank, para_start) {
            (true, Some(s)) => {
                out.push(trim(text, s..pos));
                para_start = None;
            }
            (false, None) => para_start = Some(pos),
            _ => {}
        }
        pos += line.len();
    }
    if let Some(s) = para_start {
        out.push(trim(text, s..text.len()));
    }
    out
}

/// Byte ranges (in `text`) of the sentences of the paragraph `para`: ends after `.`, `!` or `?`
/// followed by whitespace, and at every line break; trimmed, blanks dropped.
fn sentences(text: &str, para: Range<usize>) -> Vec<Range<usize>> {
    let slice = &text[para.clone()];
    let mut out = Vec::new();
    let mut start = 0;
    let mut chars = slice.char_indices().peekable();
    while let Some((i, ch)) = chars.next() {
        let end = match ch {
            '\n' => Some(i),
            '.' | '!' | '?' => match chars.peek() {
                Some(&(_, next)) if next.is_whitespace() => Some(i + ch.len_utf8()),
                _ => None,
            },
            _ => None,
        };
        if let Some(end) = end {
            let r = trim(slice, start..end);
            if !r.is_empty() {
                out.push(para.start + r.start..para.start + r.end);
            }
            start = end;
        }
    }
    let r = trim(slice, start..slice.len());
    if !r.is_empty() {
        out.push(para.start + r.start..para.start + r.end);
    }
    out
}

/// Turns ordered byte-range pieces into chunks with character offsets.
fn to_chunks(doc_id: &str, text: &str, pieces: Vec<Piece>) -> Vec<Chunk> {
    let mut chunks = Vec::with_capacity(pieces.len());
    let (mut byte, mut chars) = (0, 0);
    for (position, piece) in pieces.into_iter().enumerate() {
        let start = chars + text[byte..piece.range.start].chars().count();
        let chunk_text = &text[piece.range.clone()];
        let end = start + chunk_text.chars().count();
        (byte, chars) = (piece.range.end, end);
        chunks.push(Chunk {
            doc_id: doc_id.to_string(),
            position,
            text: chunk_text.to_string(),
            ids: piece.ids,
            start,
            end,
        });
    }
    chunks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut<'a>(text: &'a str, ranges: &[Range<usize>]) -> Vec<&'a str> {
        ranges.iter().map(|r| &text[r.clone()]).collect()
    }

    #[test]
    fn trim_of_blank_range_is_empty() {
        assert!(trim("a   b", 1..4).is_empty());
        assert_eq!(trim(" é ", 0..4), 1..3);
    }

    #[test]
    fn paragraphs_are_separated_by_blank_lines_only() {
        let text = "\n one\n two \n\n \t\nthree\r\n\r\nfour";
        assert_eq!(cut(text, &paragraphs(text)), ["one\n two", "three", "four"]);
    }

    #[test]
    fn sentences_end_at_punctuation_before_whitespace_and_at_line_breaks() {
        let text = "Hi! Is it 3.14? Yes.Really...  Done\nnext line";
        let all = 0..text.len();
        assert_eq!(
            cut(text, &sentences(text, all)),
            ["Hi!", "Is it 3.14?", "Yes.Really...", "Done", "next line"]
        );
    }

    #[test]
    fn sentences_keep_document_offsets() {
        let text = "xx é. b";
        let ranges = sentences(text, 3..text.len());
        assert_eq!(cut(text, &ranges), ["é.", "b"]);
    }
}
