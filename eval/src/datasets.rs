//! Evaluation cases, none downloaded at run time: a seeded generator of multi-hop "bridge
//! entity" questions (SpecCache's case study: band -> member -> record label), needle in a
//! haystack at chosen lengths and depths, a loader for LongBench-format JSONL, and a loader for
//! plain `{"query", "answers", "collection"?}` JSONL run against an ingested collection.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The name of the bridge-entity dataset ([`bridge_cases`]) in runs, records and reports.
/// Dataset names stay strings (files and `--datasets` add their own); code that picks a
/// dataset by name compares with these constants, never with a literal.
pub const BRIDGE: &str = "bridge";
/// The name of the needle-in-a-haystack dataset ([`needle_cases`]).
pub const NEEDLE: &str = "needle";

/// A document of a case (synthetic cases bring their own chunks as documents).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaseDoc {
    pub id: String,
    pub text: String,
}

/// One evaluation question.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Case {
    pub id: String,
    pub question: String,
    /// Accepted answers (the best match counts).
    pub answers: Vec<String>,
    /// Documents to ingest for this case (empty when it runs against `collection`).
    pub documents: Vec<CaseDoc>,
    /// Ids of the documents the answer needs (synthetic cases), for retrieval checks.
    pub gold: Vec<String>,
    /// Run against this already ingested collection instead of `documents`.
    pub collection: Option<String>,
}

/// A problem reading a dataset file, with its line.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: {message}")]
    Line {
        path: String,
        line: usize,
        message: String,
    },
}

const SYLLABLES: [&str; 24] = [
    "ka", "lo", "mer", "vin", "tas", "ro", "bel", "dun", "sa", "qui", "tor", "ela", "mar", "os",
    "fen", "ru", "lia", "gar", "no", "vel", "ith", "ba", "zel", "cor",
];

fn name(rng: &mut StdRng, parts: usize) -> String {
    let mut s: String = (0..parts)
        .map(|_| SYLLABLES[rng.gen_range(0..SYLLABLES.len())])
        .collect();
    if let Some(first) = s.get(..1) {
        s = first.to_uppercase() + &s[1..];
    }
    s
}

/// A name not produced before in this dataset (so facts never collide across cases).
fn fresh(rng: &mut StdRng, used: &mut std::collections::HashSet<String>, parts: usize) -> String {
    loop {
        let n = name(rng, parts);
        if used.insert(n.clone()) {
            return n;
        }
    }
}

/// Bridge templates: (first fact, second fact, question), with {a} the entity the question
/// names, {b} the bridge entity, {c} the answer, {y} a year.
const BRIDGES: [(&str, &str, &str); 4] = [
    (
        "{a} is a rock band formed in {y} in a harbour town. The lead singer of {a} is {b}, who also writes most of its songs.",
        "In {y2}, {b} signed a solo recording contract with the record label {c}, after years of touring.",
        "Which record label signed the lead singer of {a}?",
    ),
    (
        "The city of {a} elected a new mayor in {y}: {b}, a former engineer, won by a wide margin.",
        "{b} studied civil engineering at the University of {c} before moving south in {y2}.",
        "At which university did the mayor of {a} study?",
    ),
    (
        "The cargo ship {a} was launched in {y}. Her captain for the first twenty voyages was {b}.",
        "{b} was born and raised in the port of {c}, where the family ran a rope works until {y2}.",
        "In which port was the first captain of the ship {a} born?",
    ),
    (
        "{a} Instruments, a maker of telescopes, was founded in {y} by {b}.",
        "{b} later retired to the village of {c}, and the workshop there opened in {y2}.",
        "To which village did the founder of {a} Instruments retire?",
    ),
];

const FILLER: [&str; 12] = [
    "The archive recorded the northern canal with great care.",
    "A ferry captain traded two silver compasses near the bridge.",
    "The council measured the winter harvest before the flood.",
    "Every miller catalogued the salt ledger during the fair.",
    "The orchard rebuilt its stone wall after the storm of that year.",
    "An unusual comet was described by the observatory staff.",
    "Seventeen copper bells were repaired for the spring festival.",
    "The courier carried letters across the pass in four days.",
    "Local records mention a toll on the river for every barge.",
    "The guild kept its accounts in a blue leather book.",
    "A market opened on the square every second Tuesday.",
    "Travellers praised the inn for its bread and its quiet rooms.",
];

fn filler(rng: &mut StdRng, words: usize) -> String {
    let mut out = String::new();
    while out.split_whitespace().count() < words {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(FILLER[rng.gen_range(0..FILLER.len())]);
    }
    out
}

fn fill(t: &str, a: &str, b: &str, c: &str, y: u32, y2: u32) -> String {
    t.replace("{a}", a)
        .replace("{b}", b)
        .replace("{c}", c)
        .replace("{y2}", &y2.to_string())
        .replace("{y}", &y.to_string())
}

/// Settings of the bridge-entity generator.
#[derive(Debug, Clone, Copy)]
pub struct BridgeParams {
    pub cases: usize,
    /// Distractor chunks per case (bridge facts about other entities).
    pub distractors: usize,
    /// Filler words around each fact, so chunks have realistic length.
    pub filler_words: usize,
    pub seed: u64,
}

/// Multi-hop cases: the question names entity A; chunk 1 links A to B, chunk 2 links B to the
/// answer C; distractor chunks hold the same kind of facts about other entities. The two gold
/// chunks land at random places among the distractors, so the answer needs a link across
/// chunks that were precomputed apart.
pub fn bridge_cases(p: &BridgeParams) -> Vec<Case> {
    let mut rng = StdRng::seed_from_u64(p.seed);
    let mut used = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(p.cases);
    for i in 0..p.cases {
        let (t1, t2, tq) = BRIDGES[i % BRIDGES.len()];
        let mut docs = Vec::new();
        let fact = |rng: &mut StdRng, used: &mut std::collections::HashSet<String>, tag: &str| {
            let a = fresh(rng, used, 2);
            let b = format!("{} {}", fresh(rng, used, 2), fresh(rng, used, 2));
            let c = fresh(rng, used, 3);
            let y = rng.gen_range(1950..2015);
            let y2 = y + rng.gen_range(2..9);
            let pad = |rng: &mut StdRng| filler(rng, p.filler_words / 2);
            let one = format!("{} {} {}", pad(rng), fill(t1, &a, &b, &c, y, y2), pad(rng));
            let two = format!("{} {} {}", pad(rng), fill(t2, &a, &b, &c, y, y2), pad(rng));
            (
                a.clone(),
                c,
                [
                    CaseDoc {
                        id: format!("bridge{i}-{tag}-1"),
                        text: one,
                    },
                    CaseDoc {
                        id: format!("bridge{i}-{tag}-2"),
                        text: two,
                    },
                ],
            )
        };
        let (a, c, gold) = fact(&mut rng, &mut used, "gold");
        let gold_ids = gold.iter().map(|d| d.id.clone()).collect();
        docs.extend(gold);
        let mut k = 0;
        while docs.len() < 2 + p.distractors {
            let (_, _, pair) = fact(&mut rng, &mut used, &format!("d{k}"));
            k += 1;
            for d in pair {
                if docs.len() < 2 + p.distractors {
                    docs.push(d);
                }
            }
        }
        docs.shuffle(&mut rng);
        out.push(Case {
            id: format!("bridge-{i}"),
            // Asked for a short answer, as LongBench's prompts do, so F1 measures the fact.
            question: format!("{} Answer with the name only.", fill(tq, &a, "", "", 0, 0)),
            answers: vec![c],
            documents: docs,
            gold: gold_ids,
            collection: None,
        });
    }
    out
}

/// Settings of needle-in-a-haystack cases.
#[derive(Debug, Clone)]
pub struct NeedleParams {
    /// Haystack lengths in words.
    pub lengths: Vec<usize>,
    /// Needle depths, 0 (start) to 1 (end).
    pub depths: Vec<f64>,
    /// Words per haystack document (chunks are cut from these by the runner).
    pub doc_words: usize,
    pub seed: u64,
}

/// One case per (length, depth): a code hidden in filler text at that depth.
pub fn needle_cases(p: &NeedleParams) -> Vec<Case> {
    let mut rng = StdRng::seed_from_u64(p.seed);
    let mut used = std::collections::HashSet::new();
    let mut out = Vec::new();
    for &len in &p.lengths {
        for &depth in &p.depths {
            let place = fresh(&mut rng, &mut used, 3);
            let code = rng.gen_range(1000..10000).to_string();
            let needle = format!("The secret code of the {place} archive is {code}.");
            let words: Vec<String> = filler(&mut rng, len)
                .split_whitespace()
                .map(str::to_string)
                .collect();
            // Insert at a sentence end near the depth.
            let target = ((words.len() as f64) * depth.clamp(0.0, 1.0)).round() as usize;
            let at = (target..words.len())
                .find(|&i| i == 0 || words[i - 1].ends_with('.'))
                .unwrap_or(words.len());
            let mut all = words[..at].to_vec();
            all.extend(needle.split_whitespace().map(str::to_string));
            all.extend_from_slice(&words[at..]);
            let doc_words = p.doc_words.max(1);
            let documents: Vec<CaseDoc> = all
                .chunks(doc_words)
                .enumerate()
                .map(|(j, w)| CaseDoc {
                    id: format!("needle-{len}-{depth}-{j}"),
                    text: w.join(" "),
                })
                .collect();
            let gold = documents
                .iter()
                .filter(|d| d.text.contains(&code))
                .map(|d| d.id.clone())
                .collect();
            out.push(Case {
                id: format!("needle-{len}-{depth}"),
                question: format!(
                    "What is the secret code of the {place} archive? Answer with the number only."
                ),
                answers: vec![code],
                documents,
                gold,
                collection: None,
            });
        }
    }
    out
}

fn read_lines(path: &Path) -> Result<Vec<(usize, String)>, DatasetError> {
    let text = std::fs::read_to_string(path).map_err(|source| DatasetError::Io {
        path: path.display().to_string(),
        source,
    })?;
    Ok(text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| (i + 1, l.to_string()))
        .collect())
}

/// A case needs an answer to be scored: without one every method would score 0.
fn has_answer(path: &str, line: usize, answers: &[String]) -> Result<(), DatasetError> {
    if answers.iter().all(|a| a.trim().is_empty()) {
        return Err(DatasetError::Line {
            path: path.into(),
            line,
            message: "`answers` holds no answer; every case needs one to be scored".into(),
        });
    }
    Ok(())
}

/// LongBench's JSONL (`input`, `context`, `answers`, `_id`?): the context becomes one document
/// (the runner chunks it by target tokens).
pub fn load_longbench(path: &Path) -> Result<Vec<Case>, DatasetError> {
    #[derive(Deserialize)]
    struct Line {
        input: String,
        context: String,
        answers: Vec<String>,
        #[serde(default, rename = "_id")]
        id: Option<String>,
    }
    let name = path.display().to_string();
    read_lines(path)?
        .into_iter()
        .map(|(n, l)| {
            let line: Line = serde_json::from_str(&l).map_err(|e| DatasetError::Line {
                path: name.clone(),
                line: n,
                message: format!("not a LongBench line ({e}); expected input, context, answers"),
            })?;
            has_answer(&name, n, &line.answers)?;
            let id = line.id.unwrap_or_else(|| format!("line{n}"));
            Ok(Case {
                documents: vec![CaseDoc {
                    id: format!("{id}-context"),
                    text: line.context,
                }],
                gold: Vec::new(),
                id,
                question: line.input,
                answers: line.answers,
                collection: None,
            })
        })
        .collect()
}

/// The passages of a LongBench multi-document context ("Passage 1:\n<title>\n<text>\n
/// Passage 2:\n..."), each without its header line; a context without headers is one passage.
pub fn split_passages(context: &str) -> Vec<String> {
    let is_header = |l: &str| {
        l.strip_prefix("Passage ")
            .and_then(|r| r.strip_suffix(':'))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    let mut out: Vec<Vec<&str>> = Vec::new();
    for line in context.lines() {
        if is_header(line.trim_end()) {
            out.push(Vec::new());
        } else if let Some(last) = out.last_mut() {
            last.push(line);
        } else {
            out.push(vec![line]);
        }
    }
    out.into_iter()
        .map(|p| p.join("\n").trim().to_string())
        .filter(|p| !p.is_empty())
        .collect()
}

/// LongBench JSONL of a multi-document QA task (`input`, `context`, `answers`, `_id`?,
/// `supporting`?): each passage of the context becomes a document `<id>-p<n>` (its first line,
/// the title, stays in its text), retrieved like any document. `supporting` (titles of the
/// passages the answer needs, an addition of `scripts/convert_multihop.py`) names the gold
/// documents; `supporting_passages` (their 1-based numbers), where present, instead.
pub fn load_longbench_passages(path: &Path) -> Result<Vec<Case>, DatasetError> {
    #[derive(Deserialize)]
    struct Line {
        input: String,
        context: String,
        answers: Vec<String>,
        #[serde(default, rename = "_id")]
        id: Option<String>,
        #[serde(default)]
        supporting: Vec<String>,
        /// The gold passages by 1-based number, where titles do not tell them apart (MuSiQue's
        /// distractors often share a supporting paragraph's title); preferred over `supporting`.
        #[serde(default)]
        supporting_passages: Vec<usize>,
    }
    let name = path.display().to_string();
    read_lines(path)?
        .into_iter()
        .map(|(n, l)| {
            let line: Line = serde_json::from_str(&l).map_err(|e| DatasetError::Line {
                path: name.clone(),
                line: n,
                message: format!("not a LongBench line ({e}); expected input, context, answers"),
            })?;
            has_answer(&name, n, &line.answers)?;
            let id = line.id.unwrap_or_else(|| format!("line{n}"));
            let documents: Vec<CaseDoc> = split_passages(&line.context)
                .into_iter()
                .enumerate()
                .map(|(i, text)| CaseDoc {
                    id: format!("{id}-p{}", i + 1),
                    text,
                })
                .collect();
            if documents.is_empty() {
                return Err(DatasetError::Line {
                    path: name.clone(),
                    line: n,
                    message: "`context` holds no passage".into(),
                });
            }
            if let Some(&bad) = line
                .supporting_passages
                .iter()
                .find(|&&i| i == 0 || i > documents.len())
            {
                return Err(DatasetError::Line {
                    path: name.clone(),
                    line: n,
                    message: format!(
                        "`supporting_passages` names passage {bad}, not one of 1..={}",
                        documents.len()
                    ),
                });
            }
            let gold = documents
                .iter()
                .enumerate()
                .filter(|(i, d)| {
                    if line.supporting_passages.is_empty() {
                        let title = d.text.lines().next().unwrap_or("").trim();
                        line.supporting.iter().any(|s| s.trim() == title)
                    } else {
                        line.supporting_passages.contains(&(i + 1))
                    }
                })
                .map(|(_, d)| d.id.clone())
                .collect();
            Ok(Case {
                documents,
                gold,
                id,
                question: line.input,
                answers: line.answers,
                collection: None,
            })
        })
        .collect()
}

/// Questions about a shared set of documents (`input`, `answers`, `_id`, `source`?: the id of
/// the document that states the answer): every case carries `docs` and runs against the one
/// collection `collection`, which the runner ingests once.
pub fn load_doc_questions(
    path: &Path,
    docs: &[CaseDoc],
    collection: &str,
) -> Result<Vec<Case>, DatasetError> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Line {
        input: String,
        answers: Vec<String>,
        #[serde(rename = "_id")]
        id: String,
        #[serde(default)]
        source: Option<String>,
    }
    let name = path.display().to_string();
    read_lines(path)?
        .into_iter()
        .map(|(n, l)| {
            let bad = |message: String| DatasetError::Line {
                path: name.clone(),
                line: n,
                message,
            };
            let line: Line = serde_json::from_str(&l).map_err(|e| {
                bad(format!(
                    "{e}; expected {{\"_id\", \"input\", \"answers\", \"source\"?}}"
                ))
            })?;
            has_answer(&name, n, &line.answers)?;
            if let Some(s) = &line.source {
                if !docs.iter().any(|d| &d.id == s) {
                    return Err(bad(format!("`source` {s} is not one of the documents")));
                }
            }
            Ok(Case {
                id: line.id,
                question: line.input,
                answers: line.answers,
                documents: docs.to_vec(),
                gold: line.source.into_iter().collect(),
                collection: Some(collection.into()),
            })
        })
        .collect()
}

/// `{"query", "answers", "collection"?}` JSONL, run against an ingested collection.
pub fn load_queries(path: &Path, default_collection: &str) -> Result<Vec<Case>, DatasetError> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Line {
        query: String,
        answers: Vec<String>,
        #[serde(default)]
        collection: Option<String>,
    }
    let name = path.display().to_string();
    read_lines(path)?
        .into_iter()
        .map(|(n, l)| {
            let line: Line = serde_json::from_str(&l).map_err(|e| DatasetError::Line {
                path: name.clone(),
                line: n,
                message: format!("{e}; expected {{\"query\", \"answers\", \"collection\"?}}"),
            })?;
            has_answer(&name, n, &line.answers)?;
            if line.query.trim().is_empty() {
                return Err(DatasetError::Line {
                    path: name.clone(),
                    line: n,
                    message: "`query` is empty".into(),
                });
            }
            Ok(Case {
                id: format!("q{n}"),
                question: line.query,
                answers: line.answers,
                documents: Vec::new(),
                gold: Vec::new(),
                collection: Some(line.collection.unwrap_or_else(|| default_collection.into())),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whole-word containment (names can be substrings of other names).
    fn has_word(text: &str, w: &str) -> bool {
        text.split(|c: char| !c.is_alphanumeric()).any(|x| x == w)
    }

    fn bridge() -> Vec<Case> {
        bridge_cases(&BridgeParams {
            cases: 8,
            distractors: 4,
            filler_words: 60,
            seed: 3,
        })
    }

    #[test]
    fn bridge_cases_need_both_gold_chunks_and_are_seeded() {
        let cases = bridge();
        assert_eq!(cases, bridge(), "same seed, same cases");
        assert_ne!(
            cases,
            bridge_cases(&BridgeParams {
                seed: 4,
                ..BridgeParams {
                    cases: 8,
                    distractors: 4,
                    filler_words: 60,
                    seed: 3
                }
            })
        );
        for c in &cases {
            assert_eq!(c.documents.len(), 6);
            assert_eq!(c.gold.len(), 2);
            let answer = &c.answers[0];
            let with_answer: Vec<&CaseDoc> = c
                .documents
                .iter()
                .filter(|d| has_word(&d.text, answer))
                .collect();
            assert_eq!(with_answer.len(), 1, "the answer is in one chunk only");
            assert_eq!(with_answer[0].id, c.gold[1], "the second hop holds it");
            // The question's entity is only in the first gold chunk: a link is needed.
            let entity = c
                .question
                .split_whitespace()
                .map(|w| w.trim_end_matches(['?', '.']))
                .find(|w| {
                    w.chars().next().is_some_and(char::is_uppercase)
                        && c.documents.iter().any(|d| has_word(&d.text, w))
                        && !["Which", "At", "In", "To", "Instruments", "Answer"].contains(w)
                })
                .expect("question names an entity");
            let holders: Vec<&str> = c
                .documents
                .iter()
                .filter(|d| has_word(&d.text, entity))
                .map(|d| d.id.as_str())
                .collect();
            assert_eq!(holders, vec![c.gold[0].as_str()], "{entity} in {}", c.id);
            assert!(c.documents[0].text.split_whitespace().count() >= 60);
        }
    }

    #[test]
    fn needles_sit_at_their_depth() {
        let cases = needle_cases(&NeedleParams {
            lengths: vec![300, 1200],
            depths: vec![0.0, 0.5, 1.0],
            doc_words: 100,
            seed: 1,
        });
        assert_eq!(cases.len(), 6);
        for c in &cases {
            assert_eq!(c.gold.len(), 1, "{}", c.id);
            let pos = c
                .documents
                .iter()
                .position(|d| d.id == c.gold[0])
                .expect("gold doc") as f64;
            let depth: f64 =
                c.id.rsplit('-')
                    .next()
                    .and_then(|d| d.parse().ok())
                    .expect("depth");
            let rel = pos / (c.documents.len() - 1).max(1) as f64;
            assert!((rel - depth).abs() <= 0.35, "{}: at {rel}", c.id);
        }
    }

    #[test]
    fn longbench_passages_become_documents() -> Result<(), Box<dyn std::error::Error>> {
        assert_eq!(
            split_passages("Passage 1:\nA\nfirst.\nPassage 2:\nB\nsecond.\n\nPassage x:\nstill B"),
            vec!["A\nfirst.", "B\nsecond.\n\nPassage x:\nstill B"]
        );
        assert_eq!(
            split_passages("no headers\nat all"),
            vec!["no headers\nat all"]
        );
        let dir = tempfile::tempdir()?;
        let lb = dir.path().join("lb.jsonl");
        std::fs::write(
            &lb,
            "{\"input\":\"q?\",\"context\":\"Passage 1:\\nA\\none\\nPassage 2:\\nB\\ntwo\",\"answers\":[\"a\"],\"_id\":\"x\",\"supporting\":[\"B\"]}\n",
        )?;
        let c = &load_longbench_passages(&lb)?[0];
        let ids: Vec<&str> = c.documents.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["x-p1", "x-p2"]);
        assert_eq!(c.gold, ["x-p2"]);
        // Two passages share the gold title: the numbers say which one is gold.
        std::fs::write(
            &lb,
            "{\"input\":\"q?\",\"context\":\"Passage 1:\\nB\\none\\nPassage 2:\\nB\\ntwo\",\"answers\":[\"a\"],\"_id\":\"x\",\"supporting\":[\"B\"],\"supporting_passages\":[2]}\n",
        )?;
        assert_eq!(load_longbench_passages(&lb)?[0].gold, ["x-p2"]);
        std::fs::write(
            &lb,
            "{\"input\":\"q?\",\"context\":\"Passage 1:\\nB\\none\",\"answers\":[\"a\"],\"supporting_passages\":[2]}\n",
        )?;
        let err = load_longbench_passages(&lb).expect_err("passage 2 of 1");
        assert!(
            err.to_string()
                .contains("`supporting_passages` names passage 2"),
            "{err}"
        );
        std::fs::write(
            &lb,
            "{\"input\":\"q\",\"context\":\" \",\"answers\":[\"a\"]}\n",
        )?;
        let err = load_longbench_passages(&lb).expect_err("no passage");
        assert!(err.to_string().contains("lb.jsonl:1: `context`"), "{err}");
        let docs = [CaseDoc {
            id: "README.md".into(),
            text: "t".into(),
        }];
        let q = dir.path().join("q.jsonl");
        std::fs::write(
            &q,
            "{\"_id\":\"d1\",\"input\":\"q?\",\"answers\":[\"a\"],\"source\":\"README.md\"}\n{\"_id\":\"d2\",\"input\":\"q?\",\"answers\":[\"a\"],\"source\":\"nope.md\"}\n",
        )?;
        let err = load_doc_questions(&q, &docs, "c").expect_err("unknown source");
        assert!(err.to_string().contains("q.jsonl:2: `source`"), "{err}");
        std::fs::write(
            &q,
            "{\"_id\":\"d1\",\"input\":\"q?\",\"answers\":[\"a\"],\"source\":\"README.md\"}\n",
        )?;
        let c = &load_doc_questions(&q, &docs, "c")?[0];
        assert_eq!(
            (c.gold.clone(), c.collection.as_deref()),
            (vec!["README.md".to_string()], Some("c"))
        );
        Ok(())
    }

    #[test]
    fn loaders_name_the_bad_line() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let lb = dir.path().join("lb.jsonl");
        std::fs::write(
            &lb,
            "{\"input\":\"q?\",\"context\":\"ctx\",\"answers\":[\"a\"],\"_id\":\"x1\",\"length\":3}\n\n{\"input\":\"q\"}\n",
        )?;
        let err = load_longbench(&lb).expect_err("line 3 lacks context");
        assert!(err.to_string().contains("lb.jsonl:3:"), "{err}");
        std::fs::write(
            &lb,
            "{\"input\":\"q?\",\"context\":\"ctx\",\"answers\":[\"a\"],\"_id\":\"x1\"}\n",
        )?;
        let cases = load_longbench(&lb)?;
        assert_eq!(cases[0].id, "x1");
        assert_eq!(cases[0].documents[0].text, "ctx");
        let q = dir.path().join("q.jsonl");
        std::fs::write(
            &q,
            "{\"query\":\"who?\",\"answers\":[\"me\"]}\n{\"query\":\"x\",\"answer\":[]}\n",
        )?;
        let err = load_queries(&q, "demo").expect_err("unknown field");
        assert!(err.to_string().contains("q.jsonl:2:"), "{err}");
        std::fs::write(&q, "{\"query\":\"who?\",\"answers\":[]}\n")?;
        let err = load_queries(&q, "demo").expect_err("no answer");
        assert!(err.to_string().contains("q.jsonl:1: `answers`"), "{err}");
        std::fs::write(
            &lb,
            "{\"input\":\"q\",\"context\":\"c\",\"answers\":[\" \"]}\n",
        )?;
        let err = load_longbench(&lb).expect_err("blank answer");
        assert!(err.to_string().contains("lb.jsonl:1: `answers`"), "{err}");
        std::fs::write(
            &q,
            "{\"query\":\"who?\",\"answers\":[\"me\"],\"collection\":\"c\"}\n",
        )?;
        assert_eq!(
            load_queries(&q, "demo")?[0].collection.as_deref(),
            Some("c")
        );
        Ok(())
    }
}
