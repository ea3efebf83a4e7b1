//! Whether the chunk KV the index refers to was computed by the target as loaded now. Every
//! chunk key binds the target's fingerprint, which covers the GGUF file and every load choice
//! that changes its numbers (`--attention`, `--candle-k-quants`, the CPU's int8 kernel path):
//! KV stored under another fingerprint is never read, and each such chunk is recomputed at its
//! first retrieval. Served so by mistake, every eagerly ingested chunk costs a prefill without
//! an error anywhere, so `serve` looks at a few stored blobs at startup and says so.

use chunkstore::{ChunkKey, ChunkStore as _};
use gateway::corpus::Corpus;

/// Stored blobs read at most: enough to tell, few enough to read at startup.
const SAMPLE: usize = 4;
/// Indexed chunks looked up at most (a lazily ingested collection has no blob for most).
const LOOKUPS: usize = 256;

/// What a look at the stored KV of indexed chunks found.
#[derive(Debug, PartialEq, Eq)]
pub struct ForeignKv {
    /// Blobs of indexed chunks read.
    pub checked: usize,
    /// Of them, computed by a model of another fingerprint.
    pub foreign: usize,
    /// The first such fingerprint.
    pub other: Option<String>,
}

/// Reads up to [`SAMPLE`] stored blobs of indexed chunks and compares the fingerprint each
/// was computed under with `fingerprint` (the target's now).
pub fn look(corpus: &Corpus, fingerprint: &str) -> gateway::Result<ForeignKv> {
    let mut found = ForeignKv {
        checked: 0,
        foreign: 0,
        other: None,
    };
    let keys = corpus.index.all_keys()?;
    let keys = keys.iter().filter_map(|k| k.parse::<ChunkKey>().ok());
    for key in keys.take(LOOKUPS) {
        if found.checked == SAMPLE {
            break;
        }
        // Lazily ingested chunks no query has retrieved yet have no blob.
        let Some(blob) = corpus.store.disk().get(&key)? else {
            continue;
        };
        found.checked += 1;
        if blob.fingerprint != fingerprint {
            found.foreign += 1;
            found.other.get_or_insert_with(|| blob.fingerprint.clone());
        }
    }
    Ok(found)
}

/// The startup warning where [`look`] found KV of another fingerprint; `attention` is the
/// precision the target runs at now.
pub fn warning(found: &ForeignKv, fingerprint: &str, attention: &str) -> Option<String> {
    let other = found.other.as_deref().filter(|_| found.foreign > 0)?;
    let short = |f: &str| f.chars().take(12).collect::<String>();
    Some(format!(
        "warning: {} of {} stored chunk KV blobs looked at were computed by a target loaded \
         otherwise than this one (fingerprint {}…, this one's {}…): at another --attention \
         precision (this run: {attention}), with another --candle-k-quants, on a CPU with \
         other int8 kernels, on another --device, or from another file. Such KV is never read: every eagerly \
         ingested chunk is recomputed at its first retrieval. Serve with the settings the \
         collections were ingested with, or ingest them again.",
        found.foreign,
        found.checked,
        short(other),
        short(fingerprint),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use gateway::corpus::Engines;
    use gateway::ingest::{IngestConfig, KvMode};
    use gateway::input::SourceDoc;
    use std::sync::Arc;
    use target_engine::testing::{write_tiny_gguf, TinySpec};

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    fn ingest(corpus: &Corpus, engines: &Engines, collection: &str, kv: KvMode) -> TestResult {
        let docs = vec![SourceDoc {
            id: "a".into(),
            title: None,
            text: "The ant ran in the sand near the tent.".into(),
            origin: "a".into(),
        }];
        let cfg = IngestConfig {
            collection: collection.into(),
            kv,
            ..Default::default()
        };
        gateway::ingest::ingest(corpus, engines, docs, &cfg, |_| {})?;
        Ok(())
    }

    #[test]
    fn serve_names_stored_kv_of_another_model_identity_such_as_another_attention() -> TestResult {
        // Issue 88: serving at another --attention than the ingestion recomputed every eager
        // chunk silently.
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("target.gguf");
        write_tiny_gguf(&path, &TinySpec::new(target_engine::Architecture::Qwen2))?;
        let model = target_engine::Model::load(&path, &Default::default())?;
        let engines = Engines::new(Arc::new(model), None)?;
        let corpus = Corpus::open(&dir.path().join("data"), 1 << 20)?;
        ingest(&corpus, &engines, "lazy", KvMode::Lazy)?;
        let nothing = look(&corpus, "any")?;
        assert_eq!(nothing.checked, 0, "a lazy chunk has no KV to look at");
        assert_eq!(warning(&nothing, "any", "f32"), None);

        ingest(&corpus, &engines, "eager", KvMode::Eager)?;
        let ours = engines.target.fingerprint();
        let same = look(&corpus, ours)?;
        assert_eq!((same.checked, same.foreign), (1, 0));
        assert_eq!(warning(&same, ours, "f32"), None);
        // The fingerprint a target loaded at the other precision has.
        let other = look(&corpus, "0123456789abcdef")?;
        assert_eq!((other.checked, other.foreign), (1, 1));
        let w = warning(&other, "0123456789abcdef", "bf16").ok_or("no warning")?;
        assert!(w.contains("--attention precision (this run: bf16)"), "{w}");
        assert!(w.contains(&ours[..12]) && w.contains("recomputed"), "{w}");
        Ok(())
    }
}
