//! Answer-quality metrics exactly as LongBench scores them, plus the summary statistics and the
//! quality-aware goodput (SpecCache Eq. 8) the report needs.
//!
//! LongBench's `metrics.py` (THUDM/LongBench) is the reference:
//! - `qa_f1_score` ([`f1`]): SQuAD-style `normalize_answer`, whitespace tokens, multiset overlap.
//! - `rouge_score` ([`rouge_l`]): the `rouge-l` F of the `rouge` PyPI package 1.0.1, called on the
//!   raw strings (no lowercasing, no normalization). That package is *not* textbook ROUGE-L: it
//!   splits both texts into sentences at every `.`, computes a summary-level union LCS, and by
//!   default (`exclusive=True`) counts *distinct* words, so repeated words neither help nor hurt.
//!   [`rouge_l`] reproduces all of that, including its `+ 1e-8` in the F denominator, so scores
//!   are comparable with published LongBench tables; [`rouge_l_sentence`] is the textbook
//!   sentence-level ROUGE-L F1 for when that is what is wanted.
//!
//! Python's string semantics are followed where they matter: `str.split()` whitespace (Unicode
//! whitespace plus `\x1c`-`\x1f`), `string.punctuation` (the 32 ASCII punctuation characters),
//! and the Unicode `\b` of `re`. Known, documented gaps are in [`normalize_answer`] and
//! [`rouge_l`].

use std::collections::{HashMap, HashSet};

/// Whitespace as Python's `str.split()` sees it: Unicode `White_Space` plus the ASCII
/// information separators `\x1c`-`\x1f`, which Python also treats as whitespace.
fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// A `\w` character of Python's `re` on `str` patterns (`str.isalnum()` or `_`).
///
/// Rust's `is_alphanumeric` also admits the few combining marks Unicode lists as
/// `Other_Alphabetic` (e.g. Devanagari vowel signs), which Python does not; that only changes the
/// result when an article is glued to such a mark.
fn is_py_word(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Python's `str.split()` with no argument: runs of whitespace separate, no empty tokens.
fn py_split(s: &str) -> impl Iterator<Item = &str> {
    s.split(is_py_space).filter(|t| !t.is_empty())
}

/// `re.sub(r"\b(a|an|the)\b", " ", text)`: an article only matches as a whole maximal run of
/// word characters, so scanning the runs is equivalent to the regex.
fn remove_articles(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut run_start: Option<usize> = None;
    let flush = |out: &mut String, run: &str| {
        if matches!(run, "a" | "an" | "the") {
            out.push(' ');
        } else {
            out.push_str(run);
        }
    };
    for (i, c) in text.char_indices() {
        if is_py_word(c) {
            run_start.get_or_insert(i);
        } else {
            if let Some(start) = run_start.take() {
                flush(&mut out, &text[start..i]);
            }
            out.push(c);
        }
    }
    if let Some(start) = run_start {
        flush(&mut out, &text[start..]);
    }
    out
}

/// LongBench's `normalize_answer`: lowercase, drop ASCII punctuation, drop the articles
/// a/an/the as whole words, collapse whitespace to single spaces.
///
/// Non-ASCII letters and digits are kept, and so is non-ASCII punctuation (`—`, `€`), exactly as
/// `string.punctuation` would.
pub fn normalize_answer(s: &str) -> String {
    let no_punc: String = s
        .to_lowercase()
        .chars()
        .filter(|c| !c.is_ascii_punctuation())
        .collect();
    py_split(&remove_articles(&no_punc))
        .collect::<Vec<_>>()
        .join(" ")
}

/// LongBench's `qa_f1_score`: token F1 of the normalized texts, tokens counted as a multiset;
/// 0 when nothing overlaps (also when either side is empty after normalization).
pub fn f1(prediction: &str, gold: &str) -> f64 {
    let pred_norm = normalize_answer(prediction);
    let gold_norm = normalize_answer(gold);
    let pred: Vec<&str> = py_split(&pred_norm).collect();
    let gold: Vec<&str> = py_split(&gold_norm).collect();

    // `Counter(prediction) & Counter(ground_truth)`: each gold token can be matched once.
    let mut gold_counts: HashMap<&str, usize> = HashMap::new();
    for t in &gold {
        *gold_counts.entry(t).or_insert(0) += 1;
    }
    let mut same = 0usize;
    for t in &pred {
        if let Some(n) = gold_counts.get_mut(t) {
            if *n > 0 {
                *n -= 1;
                same += 1;
            }
        }
    }
    if same == 0 {
        return 0.0;
    }
    // Same operation order as the Python, so results agree to the last bit.
    let precision = same as f64 / pred.len() as f64;
    let recall = same as f64 / gold.len() as f64;
    (2.0 * precision * recall) / (precision + recall)
}

/// SQuAD-style exact match: 1.0 when the normalized texts are equal, else 0.0.
///
/// Two texts that both normalize to nothing (`""`, `"The."`) are equal, as in SQuAD.
pub fn exact_match(prediction: &str, gold: &str) -> f64 {
    if normalize_answer(prediction) == normalize_answer(gold) {
        1.0
    } else {
        0.0
    }
}

/// How the `rouge` package (1.0.1) cuts a text: split at every `.`, keep non-empty pieces, and
/// collapse each piece's whitespace. A whitespace-only piece (as after `"Hello. "`) survives as
/// an empty sentence, whose single word is `""`; that is the package's behaviour and it changes
/// scores, so it is kept.
fn rouge_sentences(text: &str) -> Vec<String> {
    text.split('.')
        .filter(|piece| !piece.is_empty())
        .map(|piece| py_split(piece).collect::<Vec<_>>().join(" "))
        .collect()
}

/// `str.split(" ")` of a sentence whose whitespace is already collapsed.
fn sentence_words(sentence: &str) -> Vec<&str> {
    sentence.split(' ').collect()
}

/// Length table of the longest common subsequence: `t[i][j]` = LCS of `x[..i]` and `y[..j]`.
fn lcs_table<T: PartialEq>(x: &[T], y: &[T]) -> Vec<Vec<u32>> {
    let mut t = vec![vec![0u32; y.len() + 1]; x.len() + 1];
    for i in 1..=x.len() {
        for j in 1..=y.len() {
            t[i][j] = if x[i - 1] == y[j - 1] {
                t[i - 1][j - 1] + 1
            } else {
                t[i - 1][j].max(t[i][j - 1])
            };
        }
    }
    t
}

/// The LCS the `rouge` package reconstructs (`_recon_lcs`), as its set of words. Which of several
/// equally long subsequences it walks back matters once words are deduplicated, so the tie rule
/// is copied: step up only when the cell above is strictly larger, else step left.
fn recon_lcs_words<'a>(x: &[&'a str], y: &[&'a str], out: &mut HashSet<&'a str>) {
    let t = lcs_table(x, y);
    let (mut i, mut j) = (x.len(), y.len());
    while i > 0 && j > 0 {
        if x[i - 1] == y[j - 1] {
            out.insert(x[i - 1]);
            i -= 1;
            j -= 1;
        } else if t[i - 1][j] > t[i][j - 1] {
            i -= 1;
        } else {
            j -= 1;
        }
    }
}

/// LongBench's `rouge_score`: the `rouge-l` F of `Rouge().get_scores([prediction],
/// [reference])` from the `rouge` package 1.0.1, on the raw texts (case-sensitive).
///
/// Summary-level ROUGE-L over `.`-separated sentences with distinct-word counting:
/// `m`/`n` = distinct words of reference/prediction, `llcs` = distinct words in the union of the
/// LCSs of every (reference sentence, prediction sentence) pair, `P = llcs/n`, `R = llcs/m`,
/// `F = 2PR/(P + R + 1e-8)`. 0 when either text has no sentence (empty, or only dots), where
/// the package raises and LongBench returns 0.
///
/// One gap: the package reconstructs the LCS recursively, so a single sentence pair longer than
/// about 990 words in total hits Python's recursion limit and LongBench scores it 0; here it is
/// scored normally.
pub fn rouge_l(prediction: &str, reference: &str) -> f64 {
    let hyp = rouge_sentences(prediction);
    let refs = rouge_sentences(reference);
    if hyp.is_empty() || refs.is_empty() {
        return 0.0;
    }
    let hyp_words: Vec<Vec<&str>> = hyp.iter().map(|s| sentence_words(s)).collect();
    let ref_words: Vec<Vec<&str>> = refs.iter().map(|s| sentence_words(s)).collect();
    let distinct = |sents: &[Vec<&str>]| sents.iter().flatten().collect::<HashSet<_>>().len();
    let m = distinct(&ref_words);
    let n = distinct(&hyp_words);

    let mut union = HashSet::new();
    for r in &ref_words {
        for h in &hyp_words {
            recon_lcs_words(r, h, &mut union);
        }
    }
    let llcs = union.len() as f64;
    let r_lcs = llcs / m as f64;
    let p_lcs = llcs / n as f64;
    2.0 * ((p_lcs * r_lcs) / (p_lcs + r_lcs + 1e-8))
}

/// Textbook sentence-level ROUGE-L F1 (Lin 2004, β = 1) over whitespace tokens of the raw texts:
/// `P = lcs/len(prediction)`, `R = lcs/len(reference)`, `F = 2PR/(P + R)`; 0 when either side
/// has no tokens or nothing is shared. Not what LongBench reports; see [`rouge_l`].
pub fn rouge_l_sentence(prediction: &str, reference: &str) -> f64 {
    let pred: Vec<&str> = py_split(prediction).collect();
    let reference: Vec<&str> = py_split(reference).collect();
    if pred.is_empty() || reference.is_empty() {
        return 0.0;
    }
    let lcs = f64::from(lcs_table(&pred, &reference)[pred.len()][reference.len()]);
    if lcs == 0.0 {
        return 0.0;
    }
    let precision = lcs / pred.len() as f64;
    let recall = lcs / reference.len() as f64;
    2.0 * precision * recall / (precision + recall)
}

/// Best score over several gold answers, as LongBench's scorer does (`max`, starting at 0).
fn best(prediction: &str, golds: &[String], metric: fn(&str, &str) -> f64) -> f64 {
    golds
        .iter()
        .map(|g| metric(prediction, g))
        .fold(0.0, f64::max)
}

/// [`f1`] against the best-matching gold answer; 0 when there is none.
pub fn best_f1(prediction: &str, golds: &[String]) -> f64 {
    best(prediction, golds, f1)
}

/// [`exact_match`] against the best-matching gold answer; 0 when there is none.
pub fn best_em(prediction: &str, golds: &[String]) -> f64 {
    best(prediction, golds, exact_match)
}

/// [`rouge_l`] (LongBench's) against the best-matching reference; 0 when there is none.
pub fn best_rouge_l(prediction: &str, golds: &[String]) -> f64 {
    best(prediction, golds, rouge_l)
}

/// Median (mean of the two middle values for an even count); 0 for an empty slice.
///
/// Sorted with `total_cmp`, so NaNs never panic: positive NaNs sort last, negative ones first.
pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut sorted = v.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    }
}

/// Arithmetic mean; 0 for an empty slice.
pub fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.iter().sum::<f64>() / v.len() as f64
}

/// What one served request produced: its answer quality and how long it took.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestOutcome {
    /// Task score of the answer (F1 or ROUGE-L, in [0, 1]).
    pub score: f64,
    /// End-to-end latency of the request in seconds.
    pub latency_s: f64,
}

/// Quality-aware goodput, SpecCache Eq. 8: `(1/H) · Σ 1[score_q ≥ γ]` in valid requests per
/// second, where `H = duration_s` is the wall-clock time taken to serve all the outcomes.
///
/// Latency is deliberately not a condition here: Eq. 8 folds speed in through `H` alone (every
/// request finished within it). See [`goodput_within`] for the DistServe-style variant that also
/// demands a latency SLO. A NaN score never counts; a duration that is not a positive finite
/// number gives 0 rather than an infinite rate.
pub fn goodput(outcomes: &[RequestOutcome], gamma: f64, duration_s: f64) -> f64 {
    rate(
        outcomes.iter().filter(|o| o.score >= gamma).count(),
        duration_s,
    )
}

/// [`goodput`] where a request must also finish within `latency_slo_s` seconds to count
/// (DistServe's latency SLO combined with SpecCache's quality threshold).
pub fn goodput_within(
    outcomes: &[RequestOutcome],
    gamma: f64,
    latency_slo_s: f64,
    duration_s: f64,
) -> f64 {
    let valid = outcomes
        .iter()
        .filter(|o| o.score >= gamma && o.latency_s <= latency_slo_s)
        .count();
    rate(valid, duration_s)
}

fn rate(count: usize, duration_s: f64) -> f64 {
    if duration_s.is_finite() && duration_s > 0.0 {
        count as f64 / duration_s
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `rouge` package's F: `2PR / (P + R + 1e-8)`.
    fn pkg_f(p: f64, r: f64) -> f64 {
        2.0 * ((p * r) / (p + r + 1e-8))
    }

    fn golds(g: &[&str]) -> Vec<String> {
        g.iter().map(|s| s.to_string()).collect()
    }

    fn assert_close(got: f64, want: f64) {
        assert!((got - want).abs() < 1e-12, "got {got}, want {want}");
    }

    // Expected values below were worked out by hand and agree with LongBench's metrics.py
    // running on the `rouge` 1.0.1 package (values in comments are its `repr`).

    #[test]
    fn normalize_lowercases_and_drops_punctuation_and_articles() {
        assert_eq!(normalize_answer("The Cat's  hat!"), "cats hat");
        assert_eq!(normalize_answer("An apple a day"), "apple day");
        // Articles only as whole words; punctuation goes before articles are looked for.
        assert_eq!(normalize_answer("theatre another"), "theatre another");
        assert_eq!(normalize_answer("a. b a_b A.B."), "b ab ab");
    }

    #[test]
    fn normalize_keeps_unicode_letters_and_non_ascii_punctuation() {
        assert_eq!(normalize_answer("Café Über-Straße"), "café überstraße");
        assert_eq!(normalize_answer("ĐÀ NẴNG the\u{a0}city"), "đà nẵng city");
        assert_eq!(normalize_answer("東京 the 2"), "東京 2");
        // `—` and `€` are not in string.punctuation, but `\b` still separates them from "the".
        assert_eq!(
            normalize_answer("the—end theatre another"),
            "—end theatre another"
        );
        assert_eq!(normalize_answer("the€ an"), "€");
    }

    #[test]
    fn normalize_uses_python_whitespace() {
        assert_eq!(normalize_answer(""), "");
        assert_eq!(normalize_answer("  \t\n "), "");
        // Python's str.split() also splits at the information separators \x1c-\x1f.
        assert_eq!(normalize_answer("x\u{1c}the\u{1f}y"), "x y");
    }

    #[test]
    fn f1_counts_overlap_on_normalized_tokens() {
        // "cat sat" vs "cat sat on mat": P = 1, R = 1/2.
        assert_close(f1("the cat sat", "cat sat on the mat"), 2.0 / 3.0);
        assert_close(f1("Paris!", "paris"), 1.0);
        assert_close(
            f1("police kill the gunman", "police killed the gunman"),
            2.0 / 3.0,
        );
        assert_eq!(f1("london", "paris"), 0.0);
    }

    #[test]
    fn f1_counts_duplicate_tokens_as_a_multiset() {
        // One "cat" in the gold can match only one of three: P = 1/3, R = 1/2, F = 0.4.
        assert_close(f1("cat cat cat", "cat dog"), 0.4);
        // Two and two: P = 1, R = 2/3, F = 0.8.
        assert_close(f1("cat cat", "cat cat dog"), 0.8);
        // P = 1/3, R = 1.
        assert_close(f1("cat cat cat", "cat"), 0.5);
    }

    #[test]
    fn f1_is_zero_for_empty_sides() {
        assert_eq!(f1("", "paris"), 0.0);
        assert_eq!(f1("paris", ""), 0.0);
        assert_eq!(f1("", ""), 0.0);
        // Both normalize to nothing: F1 0 (no overlap), EM 1 (equal strings).
        assert_eq!(f1("The.", "a"), 0.0);
        assert_eq!(exact_match("The.", "a"), 1.0);
    }

    #[test]
    fn exact_match_compares_normalized_text() {
        assert_eq!(exact_match("The Eiffel Tower.", "eiffel   tower"), 1.0);
        assert_eq!(exact_match("Eiffel Towers", "eiffel tower"), 0.0);
        assert_eq!(exact_match("", ""), 1.0);
        assert_eq!(exact_match("x", ""), 0.0);
    }

    #[test]
    fn rouge_l_on_lins_gunman_example() {
        let s1 = "police killed the gunman";
        // LCS "police the gunman": P = R = 3/4.  (0.749999995)
        assert_close(rouge_l("police kill the gunman", s1), pkg_f(0.75, 0.75));
        // LCS "the gunman": P = R = 1/2.  (0.4999999950000001)
        assert_close(rouge_l("the gunman kill police", s1), pkg_f(0.5, 0.5));
        // Identical text scores just under 1 because of the package's 1e-8.  (0.999999995)
        assert_close(rouge_l(s1, s1), pkg_f(1.0, 1.0));
        // The textbook F has no epsilon.
        assert_close(rouge_l_sentence("police kill the gunman", s1), 0.75);
        assert_close(rouge_l_sentence("the gunman kill police", s1), 0.5);
        assert_close(rouge_l_sentence(s1, s1), 1.0);
    }

    #[test]
    fn rouge_l_counts_distinct_words_like_the_rouge_package() {
        // Package: one distinct word on each side, all of it shared.  (0.999999995)
        assert_close(rouge_l("cat cat cat", "cat"), pkg_f(1.0, 1.0));
        // Textbook: LCS 1, P = 1/3, R = 1.
        assert_close(rouge_l_sentence("cat cat cat", "cat"), 0.5);
        // "the cat sat" vs "cat sat on the mat": 3 and 5 distinct words, LCS "cat sat".
        // (0.49999999531250006)
        assert_close(
            rouge_l("the cat sat", "cat sat on the mat"),
            pkg_f(2.0 / 3.0, 2.0 / 5.0),
        );
    }

    #[test]
    fn rouge_l_follows_the_packages_lcs_tie_rule() {
        // Reference [a b a], prediction [a a b]: the walk back picks "a a" (not "a b"), one
        // distinct word of two.  (0.4999999950000001)
        assert_close(rouge_l("a a b", "a b a"), pkg_f(0.5, 0.5));
    }

    #[test]
    fn rouge_l_is_summary_level_over_dot_separated_sentences() {
        // Sentences "a b" and "c d" each match part of "c d a b"; the union covers all 4.
        assert_close(rouge_l("a b. c d", "c d a b"), pkg_f(1.0, 1.0));
        // As one token sequence the LCS is only "c d".
        assert_close(rouge_l_sentence("a b. c d", "c d a b"), 0.5);
        // A trailing ". " leaves an empty sentence whose word "" counts: P = 1/2.  (0.66666666222)
        assert_close(rouge_l("Hello. ", "Hello"), pkg_f(0.5, 1.0));
        assert_close(rouge_l("Hello.", "Hello"), pkg_f(1.0, 1.0));
        // \x1c splits words like a space does in Python: P = 2/3, R = 1.  (0.7999999952000001)
        assert_close(rouge_l("x\u{1c}the\u{1c}y", "x y"), pkg_f(2.0 / 3.0, 1.0));
    }

    #[test]
    fn rouge_l_is_case_sensitive_and_zero_without_sentences() {
        assert_eq!(rouge_l("Paris", "paris"), 0.0);
        assert_eq!(rouge_l("", "x"), 0.0);
        assert_eq!(rouge_l("x", ""), 0.0);
        assert_eq!(rouge_l("...", "x"), 0.0);
        assert_eq!(rouge_l("   ", "x"), 0.0);
        assert_eq!(rouge_l_sentence("", "x"), 0.0);
        assert_eq!(rouge_l_sentence("y", "x"), 0.0);
    }

    #[test]
    fn best_takes_the_max_over_golds() {
        let g = golds(&["Berlin", "the capital paris france", "Paris"]);
        assert_close(best_f1("Paris", &g), 1.0);
        assert_eq!(best_em("paris.", &g), 1.0);
        assert_close(best_rouge_l("Paris", &g), pkg_f(1.0, 1.0));

        let g = golds(&["paris france", "london"]);
        assert_close(best_f1("Paris", &g), 2.0 / 3.0);
        assert_eq!(best_em("Paris", &g), 0.0);
        // ROUGE is case-sensitive in LongBench: "Paris" shares nothing with either.
        assert_eq!(best_rouge_l("Paris", &g), 0.0);
    }

    #[test]
    fn best_of_no_golds_is_zero() {
        assert_eq!(best_f1("x", &[]), 0.0);
        assert_eq!(best_em("", &[]), 0.0);
        assert_eq!(best_rouge_l("x", &[]), 0.0);
    }

    #[test]
    fn median_and_mean() {
        assert_eq!(median(&[]), 0.0);
        assert_eq!(mean(&[]), 0.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(mean(&[1.0, 2.0, 6.0]), 3.0);
        // NaN sorts last and does not panic.
        assert_eq!(median(&[f64::NAN, 1.0, 2.0]), 2.0);
        assert!(mean(&[f64::NAN, 1.0]).is_nan());
    }

    #[test]
    fn goodput_counts_requests_meeting_the_quality_threshold() {
        let out = [
            RequestOutcome {
                score: 0.9,
                latency_s: 0.5,
            },
            RequestOutcome {
                score: 0.4,
                latency_s: 0.2,
            },
            RequestOutcome {
                score: 0.4000001,
                latency_s: 3.0,
            },
            RequestOutcome {
                score: f64::NAN,
                latency_s: 0.1,
            },
            RequestOutcome {
                score: 0.0,
                latency_s: 0.1,
            },
        ];
        // Scores >= 0.4 (the threshold itself counts): 3 valid requests over 2 s.
        assert_close(goodput(&out, 0.4, 2.0), 1.5);
        assert_close(goodput(&out, 0.95, 2.0), 0.0);
        // With a 1 s latency SLO the 3 s request drops out.
        assert_close(goodput_within(&out, 0.4, 1.0, 2.0), 1.0);
        assert_eq!(goodput(&out, 0.4, 0.0), 0.0);
        assert_eq!(goodput(&out, 0.4, f64::NAN), 0.0);
        assert_eq!(goodput(&[], 0.4, 1.0), 0.0);
    }
}
