//! Fake tokenizers shared by the integration tests.
#![allow(dead_code)]

/// One token per whitespace-separated word; the id is the word's length.
pub fn words(text: &str) -> (Vec<u32>, Vec<(usize, usize)>) {
    let mut ids = Vec::new();
    let mut offsets = Vec::new();
    let mut start = None;
    for (i, ch) in text.char_indices().chain([(text.len(), ' ')]) {
        match (ch.is_whitespace(), start) {
            (true, Some(s)) => {
                ids.push((i - s) as u32);
                offsets.push((s, i));
                start = None;
            }
            (false, None) => start = Some(i),
            _ => {}
        }
    }
    (ids, offsets)
}

/// One token per character (whitespace included); the id is the code point.
pub fn chars(text: &str) -> (Vec<u32>, Vec<(usize, usize)>) {
    text.char_indices()
        .map(|(i, ch)| (ch as u32, (i, i + ch.len_utf8())))
        .unzip()
}

/// One token per byte, like byte-level BPE without merges: offsets fall inside characters.
pub fn bytes(text: &str) -> (Vec<u32>, Vec<(usize, usize)>) {
    text.bytes()
        .enumerate()
        .map(|(i, b)| (u32::from(b), (i, i + 1)))
        .unzip()
}

/// One token per two characters counted from the start of the text, so a piece's tokens depend
/// on where it was cut: stands in for merges that differ across a cut.
pub fn pairs(text: &str) -> (Vec<u32>, Vec<(usize, usize)>) {
    let idx: Vec<(usize, char)> = text.char_indices().collect();
    idx.chunks(2)
        .map(|pair| {
            let (s, first) = pair[0];
            let (last_i, last) = pair[pair.len() - 1];
            (first as u32, (s, last_i + last.len_utf8()))
        })
        .unzip()
}

/// `words` after a BOS-like token (id 1, empty offset at 0), so joined text counts one token
/// fewer than its parts counted separately.
pub fn bos_words(text: &str) -> (Vec<u32>, Vec<(usize, usize)>) {
    let (ids, offsets) = words(text);
    (
        [1].into_iter().chain(ids).collect(),
        [(0, 0)].into_iter().chain(offsets).collect(),
    )
}
