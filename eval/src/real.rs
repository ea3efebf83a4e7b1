//! The real-text datasets committed under `eval/data/` (sources, licences and sampling in
//! `eval/data/README.md`), run by name (`--datasets`, `--study-datasets`):
//!
//! - `hotpotqa`, `2wikimqa`, `musique`: multi-hop QA over Wikipedia paragraphs in LongBench
//!   JSONL; each passage is a document of the case's own collection.
//! - `repo_docs`: questions about this repository's documentation, answered over the demo
//!   corpus (README.md, ARCHITECTURE.md, docs/*.md, read as `specrag demo` reads them) in one
//!   shared collection.
//!
//! All are retrieved as the server does by default: top 4 chunks by BM25 rank, chunks of at
//! most 512 target tokens.

use crate::datasets::{self, Case, CaseDoc};
use crate::run::Dataset;
use gateway::pipeline::ChunkOrder;
use std::path::{Path, PathBuf};

/// The names `--datasets` accepts.
pub const NAMES: [&str; 4] = ["hotpotqa", "2wikimqa", "musique", "repo_docs"];

/// Appended to every question, as the synthetic cases ask for a short answer: F1 against a
/// short gold answer measures the fact, not the phrasing around it.
pub const SHORT_ANSWER: &str = "Answer with a short phrase only.";

/// The server's defaults (`POST /rag/query` top_k, `specrag ingest --chunk-tokens`).
const TOP_K: usize = 4;
const CHUNK_TOKENS: usize = 512;

/// The collection `repo_docs` runs against.
pub const DOCS_COLLECTION: &str = "eval-repo_docs";

/// The repository this crate was built from.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// `eval/data/`.
pub fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data")
}

/// The demo corpus under `root`, as `specrag demo` lists it.
pub fn demo_paths(root: &Path) -> Vec<PathBuf> {
    gateway::input::demo_paths(root)
}

/// The demo corpus as documents, ids and texts as `specrag demo` ingests them.
pub fn demo_docs(root: &Path) -> anyhow::Result<Vec<CaseDoc>> {
    let inputs = gateway::input::read_inputs(&demo_paths(root));
    if let Some(p) = inputs.problems.first() {
        anyhow::bail!("reading the demo corpus: {}: {}", p.origin, p.message);
    }
    Ok(inputs
        .docs
        .into_iter()
        .map(|d| CaseDoc {
            id: d.id,
            text: d.text,
        })
        .collect())
}

/// The cases of dataset `name` (one of [`NAMES`]), questions ending with [`SHORT_ANSWER`].
pub fn cases(name: &str) -> anyhow::Result<Vec<Case>> {
    let file = data_dir().join(format!("{name}.jsonl"));
    let mut cases = match name {
        "hotpotqa" | "2wikimqa" | "musique" => datasets::load_longbench_passages(&file)?,
        "repo_docs" => {
            datasets::load_doc_questions(&file, &demo_docs(&repo_root())?, DOCS_COLLECTION)?
        }
        other => anyhow::bail!("unknown dataset `{other}` (one of {})", NAMES.join(", ")),
    };
    for c in &mut cases {
        c.question = format!("{} {SHORT_ANSWER}", c.question.trim_end());
    }
    Ok(cases)
}

/// Dataset `name` with at most `limit` cases, retrieved as the server does.
pub fn dataset(name: &str, limit: Option<usize>, max_tokens: usize) -> anyhow::Result<Dataset> {
    let mut cases = cases(name)?;
    if let Some(n) = limit {
        cases.truncate(n);
    }
    Ok(Dataset {
        name: name.into(),
        cases,
        top_k: TOP_K,
        // As the server reads retrieved chunks unless told otherwise.
        order: ChunkOrder::default(),
        chunk_tokens: CHUNK_TOKENS,
        max_tokens,
    })
}
