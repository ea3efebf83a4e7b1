//! Special tokens: which tokens are split out of text before tokenizing (control tokens only
//! on request, user-defined always, as llama.cpp), the whitespace dropped after them for
//! Phi-3-named files, and which tokens end a generation.

use super::token::TokenType;
use std::collections::HashSet;

/// A fragment of the text: plain text to tokenize, or a special token split out.
pub(super) enum Fragment {
    Text(usize, usize),
    Special(u32, usize, usize),
}

/// The special tokens text is split on, and the whitespace rule after them.
#[derive(Debug, Clone)]
pub(super) struct Specials {
    /// Special tokens to split on, longest text first.
    pub(super) ids: Vec<u32>,
    /// Special tokens after which whitespace in the text is dropped when they are split out
    /// (llama.cpp's RSTRIP; it sets it for Phi-3 files by their name, see [`phi3_rstrip`]).
    pub(super) rstrip: HashSet<u32>,
}

impl Specials {
    /// `text` as plain fragments and special tokens, for a vocabulary of `tokens` and `types`.
    pub(super) fn split(
        &self,
        text: &str,
        parse_special: bool,
        tokens: &[String],
        types: &[TokenType],
    ) -> Vec<Fragment> {
        let mut frags = vec![Fragment::Text(0, text.len())];
        if text.is_empty() {
            return Vec::new();
        }
        for &id in &self.ids {
            if matches!(types[id as usize], TokenType::Control | TokenType::Unknown)
                && !parse_special
            {
                continue;
            }
            let needle = tokens[id as usize].as_str();
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
}

/// llama.cpp's rule for files whose `general.name` names Phi-3 (`phi-3` or `phi3`, any case,
/// whatever the architecture): every special token drops the whitespace after it, `</s>`
/// too, but `<unk>`, `<s>` and `<|endoftext|>` do not. Empty for other names.
pub(super) fn phi3_rstrip(name: Option<&str>, tokens: &[String], specials: &[u32]) -> HashSet<u32> {
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
pub(super) fn special_ids(tokens: &[String], types: &[TokenType]) -> Vec<u32> {
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
pub(super) fn end_of_generation(
    eos: Option<u32>,
    tokens: &[String],
    types: &[TokenType],
) -> HashSet<u32> {
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
mod tests {
    use crate::tokenizer::tests::tiny;

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
}
