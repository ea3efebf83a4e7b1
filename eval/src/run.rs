//! The runner: ingests each case's documents through the same path as `specrag ingest`, then
//! answers every case with every configuration through [`gateway::pipeline::Pipeline`] (the
//! code behind `specrag query` and the server), and scores each answer against the gold answers
//! and against full recompute's answer for the same case.

use crate::datasets::Case;
use crate::forcing::Knobs;
use crate::metrics;
use crate::plan::{Config, ConfigKey, PairingName};
use gateway::ingest::{IngestConfig, IngestEvent};
use gateway::input::SourceDoc;
use gateway::pipeline::{ChunkOrder, Pipeline, Query, Reuse, Timings, Traced};
use serde::{Deserialize, Serialize};
use target_engine::FinishReason;

/// A named set of cases and how they are retrieved and answered.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// `bridge`, `needle`, `longbench:<file>` or `queries:<file>`.
    pub name: String,
    pub cases: Vec<Case>,
    /// Chunks retrieved per question.
    pub top_k: usize,
    pub order: ChunkOrder,
    /// Most target tokens per chunk at ingestion.
    pub chunk_tokens: usize,
    pub max_tokens: usize,
}

/// One answer of one configuration to one case, scored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub pairing: PairingName,
    /// The dataset's name ([`Dataset::name`]).
    pub dataset: String,
    pub case: String,
    /// The configuration (written as its label).
    pub config: ConfigKey,
    pub answer: String,
    pub tokens: usize,
    pub finish_reason: FinishReason,
    /// Against the gold answers (best over the accepted answers).
    pub f1: f64,
    pub em: f64,
    pub rouge_l: f64,
    /// Against full recompute's answer for the same case.
    pub match_full: bool,
    pub rouge_l_full: f64,
    /// KL(full recompute || this) of the first token's distribution.
    pub kl_first: f64,
    /// Share of the gold documents among the retrieved chunks (cases that name them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gold_recall: Option<f64>,
    pub timings: Timings,
    pub reuse: Reuse,
}

/// What ingesting a dataset's cases did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct IngestInfo {
    pub pairing: String,
    pub dataset: String,
    pub documents: usize,
    pub chunks: usize,
    pub tokens: usize,
    pub seconds: f64,
}

/// The collection a case's documents go to.
pub fn collection_of(case: &Case) -> String {
    if let Some(c) = &case.collection {
        return c.clone();
    }
    let mut name: String = format!("eval-{}", case.id)
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    name.truncate(128);
    name
}

/// Ingests the documents of every case of `ds` (cases that run against an existing collection
/// bring none), each case into its own collection; cases that share a named collection and
/// bring its documents (`repo_docs`) ingest them once. `on_case` is called after each case.
pub fn ingest(
    pipeline: &Pipeline,
    pairing: &str,
    ds: &Dataset,
    on_case: &mut dyn FnMut(),
) -> anyhow::Result<IngestInfo> {
    let mut info = IngestInfo {
        pairing: pairing.into(),
        dataset: ds.name.clone(),
        ..Default::default()
    };
    let mut shared = std::collections::HashSet::new();
    for case in &ds.cases {
        let again = case
            .collection
            .as_ref()
            .is_some_and(|c| !shared.insert(c.clone()));
        if case.documents.is_empty() || again {
            on_case();
            continue;
        }
        let docs = case
            .documents
            .iter()
            .map(|d| SourceDoc {
                id: d.id.clone(),
                title: None,
                text: d.text.clone(),
                origin: format!("{}:{}", ds.name, case.id),
            })
            .collect();
        let cfg = IngestConfig {
            collection: collection_of(case),
            chunk_tokens: ds.chunk_tokens,
            batch_docs: 64,
            // spec_attn reads it; stored once here, so no timed query computes it.
            speculator_kv: pipeline.engines.spec.is_some(),
            ..Default::default()
        };
        let mut problems = Vec::new();
        let report =
            gateway::ingest::ingest(&pipeline.corpus, &pipeline.engines, docs, &cfg, |e| {
                if let IngestEvent::Problem(p) = e {
                    problems.push(p.to_string());
                }
            })?;
        on_case();
        if !problems.is_empty() {
            anyhow::bail!("case {}: {}", case.id, problems.join("; "));
        }
        info.documents += report.documents;
        info.chunks += report.chunks;
        info.tokens += report.tokens;
        info.seconds += report.seconds;
    }
    Ok(info)
}

/// The query of `case` under `config`.
pub fn query(ds: &Dataset, case: &Case, config: &Config) -> (Query, Knobs) {
    let knobs = Knobs {
        order: ds.order,
        ..config.knobs()
    };
    let q = Query {
        query: case.question.clone(),
        collection: collection_of(case),
        top_k: ds.top_k,
        method: config.method.query_method(),
        ratio: config.ratio,
        max_tokens: ds.max_tokens,
        temperature: 0.0,
        seed: 0,
        verify: false,
        // Selectors are measured as they select: the fidelity guard would answer some cases
        // from the full cache.
        fidelity: gateway::fidelity::Fidelity::Fast,
        ..Default::default()
    };
    (q, knobs)
}

/// Answers `case` with every configuration; `configs[0]` must be full recompute (the
/// reference). `on_done` is called after each answer with the configuration's label.
pub fn run_case(
    pipeline: &Pipeline,
    pairing: PairingName,
    ds: &Dataset,
    case: &Case,
    configs: &[Config],
    on_done: &mut dyn FnMut(&str),
) -> anyhow::Result<Vec<Record>> {
    let first = configs
        .first()
        .filter(|c| c.is_reference())
        .ok_or_else(|| anyhow::anyhow!("the first configuration must be full_recompute"))?;
    let reference = answer(pipeline, ds, case, first)?;
    on_done(&first.label());
    if reference.answer.chunks.is_empty() {
        anyhow::bail!(
            "case {} retrieved no chunk from collection `{}`: wrong collection or data \
             directory? (an answer without context would look perfectly faithful)",
            case.id,
            collection_of(case)
        );
    }
    // Full recompute loads no chunk KV: load it now, untimed, so the first reusing
    // configuration does not pay the disk (or a recompute) that the later ones skip.
    let collection = collection_of(case);
    for c in &reference.answer.chunks {
        pipeline
            .engines
            .load(&pipeline.corpus.store, &collection, &c.text)
            .map_err(|e| anyhow::anyhow!("case {}: loading chunk KV: {e}", case.id))?;
    }
    let mut out = vec![score(pairing, ds, case, first, &reference, &reference)];
    for config in &configs[1..] {
        let t = answer(pipeline, ds, case, config)?;
        out.push(score(pairing, ds, case, config, &t, &reference));
        on_done(&config.label());
    }
    Ok(out)
}

fn answer(
    pipeline: &Pipeline,
    ds: &Dataset,
    case: &Case,
    config: &Config,
) -> anyhow::Result<Traced> {
    let (q, knobs) = query(ds, case, config);
    pipeline
        .query_with(&q, &knobs, &mut |_| true)
        .map_err(|e| anyhow::anyhow!("case {} with {}: {e}", case.id, config.key()))
}

/// Scores `t` against the gold answers and the reference answer.
pub fn score(
    pairing: PairingName,
    ds: &Dataset,
    case: &Case,
    config: &Config,
    t: &Traced,
    reference: &Traced,
) -> Record {
    let a = &t.answer;
    let gold_recall = (!case.gold.is_empty()).then(|| {
        let found = case
            .gold
            .iter()
            .filter(|g| a.chunks.iter().any(|c| &c.doc_id == *g))
            .count();
        found as f64 / case.gold.len() as f64
    });
    Record {
        pairing,
        dataset: ds.name.clone(),
        case: case.id.clone(),
        config: config.key(),
        answer: a.answer.clone(),
        tokens: a.tokens,
        finish_reason: a.finish_reason,
        f1: metrics::best_f1(&a.answer, &case.answers),
        em: metrics::best_em(&a.answer, &case.answers),
        rouge_l: metrics::best_rouge_l(&a.answer, &case.answers),
        match_full: a.answer == reference.answer.answer,
        rouge_l_full: metrics::rouge_l(&a.answer, &reference.answer.answer),
        kl_first: target_engine::reuse::fidelity::kl_divergence(
            &reference.first_logits,
            &t.first_logits,
        ),
        gold_recall,
        timings: a.timings,
        reuse: a.reuse,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collections_are_valid_names() {
        let case = Case {
            id: "needle-300-0.5 x/y".into(),
            question: String::new(),
            answers: vec![],
            documents: vec![],
            gold: vec![],
            collection: None,
        };
        let c = collection_of(&case);
        assert_eq!(c, "eval-needle-300-0.5-x-y");
        let long = Case {
            id: "z".repeat(300),
            ..case.clone()
        };
        assert_eq!(collection_of(&long).len(), 128);
        let given = Case {
            collection: Some("docs".into()),
            ..case
        };
        assert_eq!(collection_of(&given), "docs");
    }
}
