//! The tokenizer's fixtures (a tiny byte-level vocabulary, random texts) and its tests of
//! whole encodings; each part's own tests sit beside it.

use super::bpe::byte_alphabet;
use super::load::Parts;
use super::pre::{pre_tokenizer_patterns, PreSplit};
use super::{TokenType, Tokenizer};

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

/// A random text mixing merge-prone letters, other ASCII, multibyte characters, the
/// special tokens and long runs of one character or two alternating ones.
pub(crate) fn random_text(rng: &mut rand::rngs::StdRng) -> String {
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
fn merges_apply_by_rank_and_offsets_cover_the_text() {
    let t = tiny();
    let enc = t.encode("hello wo", false);
    let hello = t.token_id("hello").expect("in vocab");
    assert_eq!(enc.ids[0], hello);
    assert_eq!(enc.offsets, vec![(0, 5), (5, 7), (7, 8)]);
    assert_eq!(t.decode(&enc.ids, false), "hello wo");
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
