//! The study's records: one row per case and configuration, the prompts, and the
//! append-only `study.jsonl` they live in (resumable, repaired after a torn last line).

use super::*;
use chunkstore::Codec;
use gateway::fidelity::GuardReport;
use gateway::pipeline::{Selected, Timings, VerifyStats};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};
use std::io::Write as _;
use std::path::Path;

/// How the study's first rows were stored (before rows named their codec).
pub(crate) fn raw_codec() -> String {
    Codec::Raw.name().into()
}

/// One answer of one configuration to one case, measured against full recompute's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StudyRecord {
    pub pairing: String,
    pub dataset: String,
    pub case: String,
    pub config: StudyConfig,
    pub label: String,
    pub answer: String,
    /// A gold answer is contained in the answer (normalized as LongBench does).
    pub correct: bool,
    /// The whole answer equals full recompute's.
    pub identical: bool,
    /// KL(full || this) of the first token's distribution.
    pub kl_first: f64,
    /// Mean over full recompute's answer tokens of KL(full || this), both teacher-forced.
    pub kl_tf: f64,
    /// Mean negative log-likelihood per token of the (first) gold answer.
    pub gold_nll: f64,
    pub ttft_ms: f64,
    pub timings: Timings,
    /// Recomputed chunk tokens over all chunk tokens.
    pub ratio: f64,
    pub selected: Vec<Selected>,
    /// How the run stored chunk KV (`--kv-codec`).
    #[serde(default = "raw_codec")]
    pub codec: String,
    /// With `--study-verify`: what the same query with `verify: true` drafted and accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<VerifyStats>,
    /// With `--study-verify`: the verified answer equals full recompute's (it must).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verified_identical: Option<bool>,
    /// With `--study-verify`: what speculative decoding drafted for the verified answer
    /// (prompt lookup and/or the speculator, checked against the full cache).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify_spec: Option<gateway::answer::SpecDecodeReport>,
    /// With `--study-verify`: how decoding went on once the full cache was ready
    /// (`--study-verify-mode`; rows written before it was recorded ran `full`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify_mode: Option<String>,
    /// What the fidelity guard did (configurations that are not `fast`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guard: Option<GuardReport>,
    /// The first token's top-2 probability margin after this configuration's prefill (for full
    /// recompute: how sure the reference is), a per-request signal for the guard.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub margin_first: Option<f64>,
    /// Per generated token decoded one by one, the top-2 logit gap it was chosen with (what
    /// the fidelity guard's margin watches); absent for verified or escalated answers and in
    /// rows written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub margins: Option<Vec<f32>>,
    /// Best token F1 of the answer against the gold answers (LongBench's normalization).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub f1: Option<f64>,
    /// What the prefill knew of its own error, and the first token's likeliest choices: the
    /// fidelity guard's candidate signals (`scripts/guard_signals.py` reads them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signals: Option<RecordSignals>,
    /// Where an answer whose tokens differ from full recompute's first leaves them, and how
    /// near full recompute itself was to the same choice there; absent for identical answers
    /// and in rows written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split: Option<Split>,
}

/// Where an answer first takes another token than full recompute's, seen from full
/// recompute's cache: its logit for its own choice minus its logit for this answer's (the
/// end of generation counts as a choice: the best of the end-of-generation tokens). Near 0,
/// full recompute's answer was itself nearly a tie there, one that any rounding (another
/// kernel, another device, f16 KV) can tip; [`NEAR_TIE`] is the project's bound for such
/// splits.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Split {
    /// The index of the first generated token that differs.
    pub at: usize,
    /// Full recompute's logit of its token minus its logit of this answer's, at `at`.
    pub gap: f32,
}

/// The logit gap under which two engines' greedy answers may split and still count as the
/// same computation: the bound the family fixtures and the GPU parity checks use.
pub const NEAR_TIE: f32 = gateway::fidelity::NEAR_TIE_GAP;

impl StudyRecord {
    /// Identical to full recompute's answer, or split from it only where full recompute's own
    /// choice was a near tie (its gap to this answer's token under [`NEAR_TIE`]).
    pub fn identical_or_near_tie(&self) -> bool {
        self.identical || self.split.is_some_and(|s| s.gap < NEAR_TIE)
    }
}

/// [`target_engine::BlendSignals`] of one answer, and its first token's distribution at the
/// top (so two configurations of a case can be compared offline).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordSignals {
    pub deviation_k: f32,
    pub deviation_v: f32,
    pub uncovered: f32,
    /// The first token's [`FIRST_TOP`] likeliest ids with their log-probabilities.
    pub first_top: Vec<(u32, f32)>,
    /// Where the answer's first word is copied from ([`CopySignals`]); null where none of its
    /// first tokens is a word found in a chunk, absent in rows written before it was.
    #[serde(default)]
    pub copy: Option<CopySignals>,
}

/// Where an answer's first word (the first of its first [`COPY_WORDS`] words with three
/// letters or more that a chunk holds, as the chunk's tokens spell it) is found in the prompt's
/// chunks, and how much of the KV around it is fresh: the candidate signal "the answer copies
/// from KV the blend left stale" for confident entity flips, which the top-2 gap does not see.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CopySignals {
    /// The word looked up, and its index among the answer's words.
    pub word: String,
    pub at: usize,
    /// How many times, and in how many chunks, the prompt's chunks hold it.
    pub occurrences: usize,
    pub chunks: usize,
    /// Over its occurrences, the most and the least of the chunk tokens within
    /// [`COPY_WINDOW`] positions of one that are fresh (recomputed by the blend, or exact as
    /// the first chunk is), the occurrence included.
    pub near_max: f32,
    pub near_min: f32,
    /// The fresh share of the chunk holding the freshest occurrence.
    pub chunk_share: f32,
}

/// How many of an answer's first words [`CopySignals`] looks at.
pub const COPY_WORDS: usize = 3;
/// The positions on each side of an occurrence [`CopySignals`] counts.
pub const COPY_WINDOW: usize = 8;

impl CopySignals {
    /// The signals of `word` (the answer's word `at`), spelled in the prompt as any of
    /// `spellings` (token id sequences), over a prompt `prompt` whose chunks lie at `chunks`,
    /// of which the positions `fresh` are fresh; `None` where no chunk holds it.
    pub fn new(
        word: &str,
        at: usize,
        spellings: &[Vec<u32>],
        prompt: &[u32],
        chunks: &[std::ops::Range<usize>],
        fresh: &std::collections::HashSet<usize>,
    ) -> Option<Self> {
        let mut hits: Vec<(usize, usize)> = Vec::new();
        for (c, r) in chunks.iter().enumerate() {
            for p in r.clone() {
                let here = |s: &Vec<u32>| {
                    !s.is_empty() && p + s.len() <= r.end && prompt.get(p..p + s.len()) == Some(s)
                };
                if spellings.iter().any(here) {
                    hits.push((c, p));
                }
            }
        }
        let share = |r: std::ops::Range<usize>| -> f32 {
            let n = r.len().max(1);
            r.filter(|p| fresh.contains(p)).count() as f32 / n as f32
        };
        let near: Vec<(usize, f32)> = hits
            .iter()
            .map(|&(c, p)| {
                let r = &chunks[c];
                let lo = p.saturating_sub(COPY_WINDOW).max(r.start);
                let hi = (p + COPY_WINDOW + 1).min(r.end);
                (c, share(lo..hi))
            })
            .collect();
        let best = near.iter().copied().max_by(|a, b| a.1.total_cmp(&b.1))?;
        let mut held: Vec<usize> = hits.iter().map(|&(c, _)| c).collect();
        held.dedup();
        Some(Self {
            word: word.to_string(),
            at,
            occurrences: hits.len(),
            chunks: held.len(),
            near_max: best.1,
            near_min: near.iter().map(|n| n.1).fold(f32::INFINITY, f32::min),
            chunk_share: share(chunks[best.0].clone()),
        })
    }
}

/// How many of the first token's likeliest choices a record keeps.
pub const FIRST_TOP: usize = 16;

impl RecordSignals {
    pub fn new(s: &target_engine::BlendSignals, first_logits: &[f32]) -> Self {
        let max = first_logits
            .iter()
            .copied()
            .fold(f32::NEG_INFINITY, f32::max);
        let lse = first_logits
            .iter()
            .map(|&x| f64::from(x - max).exp())
            .sum::<f64>()
            .ln() as f32
            + max;
        let mut order: Vec<u32> = (0..first_logits.len() as u32).collect();
        order.sort_by(|&a, &b| first_logits[b as usize].total_cmp(&first_logits[a as usize]));
        order.truncate(FIRST_TOP);
        Self {
            deviation_k: s.deviation_k,
            deviation_v: s.deviation_v,
            uncovered: s.uncovered,
            first_top: order
                .into_iter()
                .map(|i| (i, first_logits[i as usize] - lse))
                .collect(),
            copy: None,
        }
    }
}

/// A case's prompt as the target reads it in a full prefill (template, chunks, question), so
/// that another engine can be timed on the same token ids
/// (`scripts/compare_ttft_llamacpp.py`); one line per case in `<out>/prompts.jsonl`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptRecord {
    pub pairing: String,
    pub dataset: String,
    pub case: String,
    /// The target model's file name.
    pub target: String,
    pub ids: Vec<u32>,
}

/// Cases of `path` (a study.jsonl) already answered by every label of `labels`, per
/// (pairing, dataset, case).
pub fn done_cases(records: &[StudyRecord], labels: &[String]) -> HashSet<(String, String, String)> {
    let mut have: BTreeMap<(String, String, String), HashSet<&str>> = BTreeMap::new();
    for r in records {
        have.entry((r.pairing.clone(), r.dataset.clone(), r.case.clone()))
            .or_default()
            .insert(&r.label);
    }
    have.into_iter()
        .filter(|(_, got)| labels.iter().all(|l| got.contains(l.as_str())))
        .map(|(k, _)| k)
        .collect()
}

/// Reads a study.jsonl (missing file: nothing yet). A torn last line (a run killed while
/// writing) is dropped; any other bad line is an error naming it.
pub fn read_records(path: &Path) -> anyhow::Result<Vec<StudyRecord>> {
    read_jsonl(path)
}

/// The lines of a JSON-lines file of `T` (see [`read_records`]); a name ending in `.gz` is
/// read through gzip (the committed records under eval/study/ are kept so).
pub fn read_jsonl<T: serde::de::DeserializeOwned>(path: &Path) -> anyhow::Result<Vec<T>> {
    let text = match read_text(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(anyhow::anyhow!("reading {}: {e}", path.display())),
    };
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut out = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        match serde_json::from_str(line) {
            Ok(r) => out.push(r),
            Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => break,
            Err(e) => anyhow::bail!("{}:{}: {e}", path.display(), i + 1),
        }
    }
    Ok(out)
}

/// The text of `path`, gunzipped when its name ends in `.gz`.
fn read_text(path: &Path) -> std::io::Result<String> {
    if path.extension().is_some_and(|e| e == "gz") {
        let mut text = String::new();
        std::io::Read::read_to_string(
            &mut flate2::read::GzDecoder::new(std::fs::File::open(path)?),
            &mut text,
        )?;
        Ok(text)
    } else {
        std::fs::read_to_string(path)
    }
}

/// Cuts a torn last line (a run killed while writing) off a study.jsonl, so appends start on
/// a fresh line. A missing file is fine.
pub fn repair(path: &Path) -> anyhow::Result<()> {
    let Ok(bytes) = std::fs::read(path) else {
        return Ok(());
    };
    if bytes.is_empty() || bytes.ends_with(b"\n") {
        return Ok(());
    }
    let keep = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| anyhow::anyhow!("opening {}: {e}", path.display()))?;
    f.set_len(keep as u64)?;
    f.sync_data()?;
    Ok(())
}

/// Appends the records of one case (or any JSON lines) and flushes them to disk.
pub fn append<T: Serialize>(path: &Path, records: &[T]) -> anyhow::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| anyhow::anyhow!("opening {}: {e}", path.display()))?;
    let mut buf = String::new();
    for r in records {
        buf.push_str(&serde_json::to_string(r)?);
        buf.push('\n');
    }
    f.write_all(buf.as_bytes())?;
    f.sync_data()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::read_jsonl;
    use std::io::Write;

    #[test]
    fn gzipped_records_read_as_the_plain_file_and_drop_a_torn_last_line(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let text = "{\"a\": 1}\n{\"a\": 2}\n{\"a\": 3";
        let plain = dir.path().join("study.jsonl");
        std::fs::write(&plain, text)?;
        let packed = dir.path().join("study.jsonl.gz");
        let mut gz = flate2::write::GzEncoder::new(
            std::fs::File::create(&packed)?,
            flate2::Compression::default(),
        );
        gz.write_all(text.as_bytes())?;
        gz.finish()?;
        let a: Vec<serde_json::Value> = read_jsonl(&plain)?;
        let b: Vec<serde_json::Value> = read_jsonl(&packed)?;
        assert_eq!(a.len(), 2);
        assert_eq!(a, b);
        // Not gzip at all: an error naming the file, not a panic or an empty read.
        let fake = dir.path().join("fake.jsonl.gz");
        std::fs::write(&fake, text)?;
        let err = read_jsonl::<serde_json::Value>(&fake)
            .err()
            .map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("fake.jsonl.gz")));
        Ok(())
    }
}
