//! What a token is: a vocabulary entry's type, and the ids and byte ranges an encoding gives.

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
    pub(super) fn from_code(code: u64) -> Self {
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
pub(super) const NO_TOKEN: u32 = u32::MAX;

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
