//! The committed real-text datasets load with the shape the evaluation needs (no model): enough
//! questions, an answer to every one, passages as documents with the gold ones among them, and
//! every `repo_docs` answer still stated in the document it cites. Reads only this repository.

use eval::datasets::Case;
use eval::metrics::normalize_answer;
use eval::real;
use std::collections::HashSet;

fn check_common(name: &str, cases: &[Case], at_least: usize) {
    assert!(cases.len() >= at_least, "{name}: {} questions", cases.len());
    let ids: HashSet<&str> = cases.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids.len(), cases.len(), "{name}: case ids are distinct");
    for c in cases {
        assert!(
            c.answers.iter().all(|a| !a.trim().is_empty()) && !c.answers.is_empty(),
            "{name} {}: every answer non-empty",
            c.id
        );
        assert!(
            c.question.ends_with(real::SHORT_ANSWER),
            "{name} {}: asks for a short answer",
            c.id
        );
        assert!(!c.documents.is_empty(), "{name} {}: documents", c.id);
        assert!(
            c.documents.iter().all(|d| !d.text.trim().is_empty()),
            "{name} {}: no empty document",
            c.id
        );
        assert!(
            !c.gold.is_empty(),
            "{name} {}: names its gold documents",
            c.id
        );
        for g in &c.gold {
            assert!(
                c.documents.iter().any(|d| &d.id == g),
                "{name} {}: gold {g} is one of the documents",
                c.id
            );
        }
    }
}

#[test]
fn multi_hop_sets_have_their_passages() -> anyhow::Result<()> {
    // The seeded sample (150; MuSiQue 100), then every other usable record of the source
    // (eval/data/README.md).
    for (name, usable) in [("hotpotqa", 199), ("2wikimqa", 164), ("musique", 200)] {
        let cases = real::cases(name)?;
        check_common(name, &cases, 100);
        assert_eq!(cases.len(), usable, "{name}: the committed records");
        for c in &cases {
            assert!(c.collection.is_none(), "{name} {}: own collection", c.id);
            assert!(
                c.documents.len() >= 5,
                "{name} {}: {} passages",
                c.id,
                c.documents.len()
            );
            let doc_ids: HashSet<&str> = c.documents.iter().map(|d| d.id.as_str()).collect();
            assert_eq!(doc_ids.len(), c.documents.len(), "{name} {}", c.id);
            assert!(
                c.documents.iter().all(|d| !d.text.contains("\nPassage 1:")),
                "{name} {}: passages split",
                c.id
            );
        }
        let ds = real::dataset(name, Some(3), 32)?;
        assert_eq!((ds.cases.len(), ds.top_k, ds.chunk_tokens), (3, 4, 512));
    }
    Ok(())
}

#[test]
fn repo_docs_answers_are_stated_in_the_docs() -> anyhow::Result<()> {
    let cases = real::cases("repo_docs")?;
    check_common("repo_docs", &cases, 40);
    let docs = real::demo_docs(&real::repo_root())?;
    let ids: Vec<&str> = docs.iter().map(|d| d.id.as_str()).collect();
    assert!(
        ids.contains(&"README.md") && ids.contains(&"ARCHITECTURE.md") && ids.len() >= 3,
        "the demo corpus: {ids:?}"
    );
    for c in &cases {
        assert_eq!(c.collection.as_deref(), Some(real::DOCS_COLLECTION));
        assert_eq!(c.documents.len(), docs.len(), "{}: the whole corpus", c.id);
        let source = docs
            .iter()
            .find(|d| d.id == c.gold[0])
            .expect("the cited document");
        let text = normalize_answer(&source.text);
        assert!(
            c.answers
                .iter()
                .any(|a| text.contains(&normalize_answer(a))),
            "{}: {:?} is no longer stated in {} (update eval/data/repo_docs.jsonl)",
            c.id,
            c.answers,
            source.id
        );
    }
    Ok(())
}

#[test]
fn cacheblend_wikimqa_is_ten_untitled_passages_a_question() -> anyhow::Result<()> {
    // CacheBlend's 2WikiMultihopQA rows in LongBench's layout (eval/data/README.md): read by
    // `scripts/split_classes.py`, not by the study (the file names no gold passage).
    let file = real::data_dir().join("cacheblend_wikimqa.jsonl");
    let cases = eval::datasets::load_longbench_passages(&file)?;
    assert_eq!(cases.len(), 102, "the 70 sampled rows, then the other 32");
    let ids: HashSet<&str> = cases.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids.len(), cases.len(), "case ids are distinct");
    for c in &cases {
        assert!(c.id.starts_with("cacheblend_wikimqa-"), "{}", c.id);
        assert!(
            !c.answers.is_empty() && c.answers.iter().all(|a| !a.trim().is_empty()),
            "{}: answers",
            c.id
        );
        assert_eq!(c.documents.len(), 10, "{}: its ten passages", c.id);
        for d in &c.documents {
            let words = d.text.split_whitespace().count();
            assert!(
                (100..=500).contains(&words),
                "{}: a passage of {words} words, not CacheBlend's ~400",
                d.id
            );
            assert!(!d.text.contains("Passage "), "{}: passages split", d.id);
        }
        assert!(c.gold.is_empty(), "{}: no gold named", c.id);
    }
    Ok(())
}
