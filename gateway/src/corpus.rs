//! A data directory (tantivy index + chunk KV store) and the models that fill and read it.
//!
//! Layout of `--data DIR`: `DIR/index/` (tantivy), `DIR/kv/` (one file per chunk). Chunk KV is addressed by
//! content ([`chunkstore::ChunkKey`] over the target's fingerprint, the collection, the
//! precompute mode with the template prefix hash, and the chunk's token ids), so a cache is never
//! reused across models, collections, texts or templates, and a chunk whose cache is missing or
//! was damaged is recomputed from the text the index holds and stored back.

use crate::error::{GatewayError, Result};

use crate::target::Target;
use chunkstore::{ChunkKey, ChunkStore, Found, KvBlob, Reach, SpecScores, TieredStore};
use half::f16;
use speculator::{ChunkScores, LayerRange, SpecCache};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use target_engine::{ChunkKv, Model, PrecomputeMode, PrefixKv, RagTemplate};

/// The target model, the optional speculator and what every request shares: the template and
/// the exact KV of its prefix for both models.
pub struct Engines {
    /// The target, on the CPU engine or a device (`--device`).
    pub target: Target,
    pub spec: Option<SpecCache>,
    pub template: RagTemplate,
    /// The target's template prefix KV (exact, shared by every request).
    pub prefix: PrefixKv,
    /// The speculator's template prefix KV (chunks are scored after it at ingestion).
    pub spec_prefix: Option<PrefixKv>,
    prefix_text: String,
    /// The store's codec when it is lossy (`int8`, `int4`): part of every chunk key, so lossy
    /// KV is never served where exact KV was stored, or the other way round.
    pub lossy_codec: Option<chunkstore::Codec>,
    /// The speculator shares the target's vocabulary, token for token, so it can draft for
    /// speculative decoding (false without a speculator).
    pub drafts: bool,
}

impl std::fmt::Debug for Engines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engines")
            .field("target", &self.target.fingerprint())
            .field(
                "speculator",
                &self.spec.as_ref().map(|s| s.speculator.fingerprint()),
            )
            .finish()
    }
}

/// Where a chunk's KV came from when it was loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    Memory,
    Disk,
    /// The remote tier shared by several nodes (`--kv-remote`); now also on disk and in memory.
    Remote,
    /// Missing or damaged in the store: computed now and stored back.
    Recomputed,
}

impl From<Found> for Tier {
    fn from(f: Found) -> Self {
        match f {
            Found::Memory => Self::Memory,
            Found::Disk => Self::Disk,
            Found::Remote => Self::Remote,
        }
    }
}

/// A chunk's KV and stored speculator scores, ready for assembly.
#[derive(Debug, Clone)]
pub struct LoadedChunk {
    pub kv: ChunkKv,
    pub scores: Option<ChunkScores>,
    pub tier: Tier,
    pub key: ChunkKey,
}

impl Engines {
    /// Builds the shared state: computes both template prefixes once.
    pub fn new(target: impl Into<Target>, speculator: Option<Arc<Model>>) -> Result<Self> {
        let target = target.into();
        // The prompt in the model file's own chat format (ChatML for a file without one).
        let template = RagTemplate::for_chat(target.chat());
        let (prefix_text, prefix_ids) = template.prefix(target.tokenizer());
        let prefix = target.prefix_of(&prefix_ids)?;
        let spec = speculator.map(SpecCache::new);
        let spec_prefix = match &spec {
            Some(s) => Some(s.prefix_state(&prefix_text)?),
            None => None,
        };
        let drafts = spec
            .as_ref()
            .is_some_and(|s| s.speculator.tokenizer().same_vocabulary(target.tokenizer()));
        Ok(Self {
            target,
            spec,
            template,
            prefix,
            spec_prefix,
            prefix_text,
            lossy_codec: None,
            drafts,
        })
    }

    /// The template prefix text.
    pub fn prefix_text(&self) -> &str {
        &self.prefix_text
    }

    /// The precompute mode every stored chunk uses: after this template prefix.
    pub fn mode(&self) -> PrecomputeMode {
        PrecomputeMode::AfterPrefix {
            prefix_hash: self.prefix.hash.clone(),
        }
    }

    /// A chunk's text as it appears in the prompt, and its ids (the unit that is precomputed).
    pub fn segment(&self, chunk_text: &str) -> (String, Vec<u32>) {
        self.template.chunk(self.target.tokenizer(), chunk_text)
    }

    /// The store key of a chunk segment in `collection`.
    pub fn key(&self, collection: &str, segment_ids: &[u32]) -> ChunkKey {
        let mut mode = mode_string(&self.mode());
        if let Some(codec) = self.lossy_codec {
            mode = format!("{mode};kv={codec}");
        }
        ChunkKey::new(self.target.fingerprint(), collection, &mode, segment_ids)
    }

    /// Precomputes a chunk segment's KV after the prefix and, with a speculator, its scores.
    pub fn compute(&self, segment_text: &str, segment_ids: &[u32]) -> Result<KvBlob> {
        Ok(self.compute_with(segment_text, segment_ids, false)?.0)
    }

    /// [`Engines::compute`], and with `spec_kv` (and a speculator) the speculator's own KV of
    /// the chunk from its scoring pass, as a blob of its own (stored under
    /// [`Engines::spec_key`]).
    pub fn compute_with(
        &self,
        segment_text: &str,
        segment_ids: &[u32],
        spec_kv: bool,
    ) -> Result<(KvBlob, Option<KvBlob>)> {
        let kv = self.target.chunk_kv(segment_ids, Some(&self.prefix))?;
        let (scores, spec) = match (&self.spec, &self.spec_prefix) {
            (Some(s), Some(p)) => {
                let (scores, kv) = s.score_chunk_with_kv(p, segment_text, spec_kv)?;
                (Some(scores), kv.map(|kv| to_blob(kv, None)))
            }
            _ => (None, None),
        };
        Ok((to_blob(kv, scores), spec))
    }

    /// Where the speculator's KV of the chunk stored under `key` lives (`None` without a
    /// speculator). It is the chunk key's companion for this speculator and its prefix, so it
    /// is collected with the chunk, and another speculator never reads it.
    pub fn spec_key(&self, key: &ChunkKey) -> Option<ChunkKey> {
        let (spec, prefix) = (self.spec.as_ref()?, self.spec_prefix.as_ref()?);
        Some(key.companion(
            spec.speculator.fingerprint(),
            &format!("after_prefix:{}", prefix.hash),
        ))
    }

    /// The speculator's KV of the chunk with text `chunk_text` in `collection` (for
    /// `spec_attn`): from memory, from disk, or computed now and stored back (chunks ingested
    /// without `--speculator-kv`, or damaged entries). `None` without a speculator.
    pub fn load_spec_kv(
        &self,
        store: &TieredStore,
        collection: &str,
        chunk_text: &str,
    ) -> Result<Option<(ChunkKv, Tier)>> {
        let (Some(spec), Some(prefix)) = (&self.spec, &self.spec_prefix) else {
            return Ok(None);
        };
        let (text, ids) = self.segment(chunk_text);
        let Some(key) = self.spec_key(&self.key(collection, &ids)) else {
            return Ok(None);
        };
        let want = spec.speculator.tokenizer().encode(&text, false).ids;
        let stored = store
            .get_in(Some(collection), &key, Reach::Local)?
            .map(|(b, found)| (b, Tier::from(found)));
        if let Some((blob, tier)) = stored {
            store.touch(&key);
            let kv = from_blob(&blob)
                .map(|(kv, _)| kv)
                .filter(|kv| kv.ids == want && kv.fingerprint == spec.speculator.fingerprint());
            if let Some(kv) = kv {
                return Ok(Some((kv, tier)));
            }
            tracing::warn!(%key, "speculator KV entry holds another chunk; recomputing it");
        }
        let kv = spec.chunk_kv(prefix, &text)?;
        store.put_cached(collection, &key, Arc::new(to_blob(kv.clone(), None)))?;
        Ok(Some((kv, Tier::Recomputed)))
    }

    /// Loads the KV of a chunk with text `chunk_text` in `collection`: from memory, from disk,
    /// from the remote tier, or recomputed and stored back (a miss or a damaged blob). What
    /// it reads into memory or writes to disk counts in `collection`'s share of the memory
    /// tier and of the disk budget.
    pub fn load(
        &self,
        store: &TieredStore,
        collection: &str,
        chunk_text: &str,
    ) -> Result<LoadedChunk> {
        let (text, ids) = self.segment(chunk_text);
        self.load_segment(store, collection, &text, &ids)
    }

    /// [`Engines::load`] of a chunk already segmented (its text and ids as the assembled
    /// prompt holds them, so a request tokenizes each chunk once).
    pub fn load_segment(
        &self,
        store: &TieredStore,
        collection: &str,
        text: &str,
        ids: &[u32],
    ) -> Result<LoadedChunk> {
        let key = self.key(collection, ids);
        let (blob, tier) = match store.get_in(Some(collection), &key, Reach::Remote)? {
            Some((b, found)) => (b, Tier::from(found)),
            None => {
                let b = Arc::new(self.compute(text, ids)?);
                store.put_cached(collection, &key, b.clone())?;
                (b, Tier::Recomputed)
            }
        };
        store.touch(&key);
        let fits =
            |(kv, _): &(ChunkKv, _)| kv.ids == ids && kv.fingerprint == self.target.fingerprint();
        let (kv, scores, tier) = match from_blob(&blob).filter(fits) {
            Some((kv, scores)) => (kv, scores, tier),
            None => {
                // A blob stored under the wrong key (or with a mode this build does not
                // know): never serve it; recompute and replace it.
                tracing::warn!(%key, "chunk store entry holds another chunk; recomputing it");
                let fresh = Arc::new(self.compute(text, ids)?);
                store.put_cached(collection, &key, fresh.clone())?;
                let (kv, scores) = from_blob(&fresh).ok_or_else(|| {
                    GatewayError::Internal(format!("precompute mode `{}` unknown", fresh.mode))
                })?;
                (kv, scores, Tier::Recomputed)
            }
        };
        let scores = scores.filter(|s| {
            self.spec.as_ref().is_some_and(|spec| {
                s.fingerprint == spec.speculator.fingerprint() && s.layers == spec.layers
            })
        });
        Ok(LoadedChunk {
            kv,
            scores,
            tier,
            key,
        })
    }
}

/// How a precompute mode is named in store keys and blobs.
pub fn mode_string(mode: &PrecomputeMode) -> String {
    match mode {
        PrecomputeMode::Standalone => "standalone".into(),
        PrecomputeMode::AfterPrefix { prefix_hash } => format!("after_prefix:{prefix_hash}"),
    }
}

/// The mode [`mode_string`] named; `None` for a name it never writes.
pub fn parse_mode(s: &str) -> Option<PrecomputeMode> {
    match (s, s.strip_prefix("after_prefix:")) {
        ("standalone", _) => Some(PrecomputeMode::Standalone),
        (_, Some(h)) if !h.is_empty() => Some(PrecomputeMode::AfterPrefix {
            prefix_hash: h.to_string(),
        }),
        _ => None,
    }
}

/// The engine's chunk KV (and speculator scores) as a store blob.
pub fn to_blob(kv: ChunkKv, scores: Option<ChunkScores>) -> KvBlob {
    KvBlob {
        fingerprint: kv.fingerprint,
        mode: mode_string(&kv.mode),
        ids: kv.ids,
        base_pos: kv.base_pos as u32,
        row: kv.row as u32,
        k: kv.k,
        v: kv.v,
        scores: scores.map(|s| SpecScores {
            fingerprint: s.fingerprint,
            layers: s.layers.name().to_string(),
            offsets: s
                .offsets
                .iter()
                .map(|r| (r.start as u32, r.end as u32))
                .collect(),
            values: s.values,
        }),
    }
}

/// A store blob as the engine's chunk KV and scores (scores with an unknown layer range are
/// dropped: they are recomputed at query time instead). `None` when the blob names a
/// precompute mode this build does not know: such KV is never served.
pub fn from_blob(blob: &KvBlob) -> Option<(ChunkKv, Option<ChunkScores>)> {
    let copy = |layers: &[Vec<f16>]| layers.to_vec();
    let kv = ChunkKv {
        fingerprint: blob.fingerprint.clone(),
        ids: blob.ids.clone(),
        base_pos: blob.base_pos as usize,
        mode: parse_mode(&blob.mode)?,
        row: blob.row as usize,
        k: copy(&blob.k),
        v: copy(&blob.v),
    };
    let scores = blob.scores.as_ref().and_then(|s| {
        Some(ChunkScores {
            fingerprint: s.fingerprint.clone(),
            layers: LayerRange::parse(&s.layers)?,
            offsets: s
                .offsets
                .iter()
                .map(|&(a, b)| a as usize..b as usize)
                .collect(),
            values: s.values.clone(),
        })
    });
    Some((kv, scores))
}

/// An open data directory.
pub struct Corpus {
    pub dir: PathBuf,
    pub index: retriever::Index,
    pub store: TieredStore,
    /// The document log shared with other nodes (with `--kv-remote`).
    pub doclog: Option<Arc<crate::doclog::DocLog>>,
    /// Where a damaged chunk store went when this corpus was opened
    /// ([`OnDamagedStore::Reset`]); `/health` reports it.
    pub store_reset: Option<PathBuf>,
}

impl std::fmt::Debug for Corpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Corpus").field("dir", &self.dir).finish()
    }
}

/// The default disk budget of KV computed while answering: 8 GiB (~300k tokens of the
/// default 1.5B target's f16 KV).
pub const DEFAULT_DISK_BUDGET: u64 = 8 << 30;

/// How the chunk store writes, where its remote tier is, and what happens to a damaged one.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    pub codec: chunkstore::Codec,
    /// The disk byte budget of KV computed while answering (passages clients send, chunks
    /// ingested with lazy KV, entries read through the remote tier) and what evicts it;
    /// ingested KV is not counted.
    pub disk_budget: u64,
    pub eviction: chunkstore::Eviction,
    /// How many tenants the disk budget and the memory tier are divided among: each
    /// collection keeps up to either divided by it, whatever other collections store
    /// ([`chunkstore::shares`]).
    pub tenants: u32,
    pub remote: Option<RemoteOptions>,
    pub on_damaged: OnDamagedStore,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            codec: chunkstore::Codec::default(),
            disk_budget: DEFAULT_DISK_BUDGET,
            eviction: chunkstore::Eviction::default(),
            tenants: chunkstore::shares::DEFAULT_TENANTS,
            remote: None,
            on_damaged: OnDamagedStore::default(),
        }
    }
}

/// What opening a data directory does with a chunk store that is damaged (its `STORE` file
/// unreadable, or an earlier sled-layout store that sled cannot read).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum OnDamagedStore {
    /// Move it aside (`kv.damaged-<unix seconds>`), start an empty one and recompute chunk KV
    /// as queries need it: the store is a cache.
    #[default]
    Reset,
    /// Refuse to start, explaining the choice (to inspect the store first).
    Refuse,
}

/// A Redis/Valkey remote tier shared by several nodes.
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    /// `redis://host:port[/db]`.
    pub url: String,
    /// Prefix of every key (several deployments can share one Redis).
    pub prefix: String,
    /// Entries expire after this long (`None`: Redis' own eviction policy decides).
    pub ttl: Option<std::time::Duration>,
}

/// Default size of the in-memory chunk tier (payload bytes).
pub const DEFAULT_MEMORY_BYTES: u64 = 2 << 30;

impl Corpus {
    /// Opens (or creates) `dir`. Only one process can hold a data directory at a time.
    pub fn open(dir: &Path, memory_bytes: u64) -> Result<Self> {
        Self::open_with(dir, memory_bytes, &StoreOptions::default())
    }

    /// [`Corpus::open`] writing chunk KV with `opts.codec` (blobs of every codec stay
    /// readable), over the remote tier `opts.remote` if set.
    pub fn open_with(dir: &Path, memory_bytes: u64, opts: &StoreOptions) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(|source| GatewayError::Io {
            context: format!("creating data directory {}", dir.display()),
            source,
        })?;
        let index = retriever::Index::open(dir.join("index"))?;
        let kv = dir.join("kv");
        let (store, store_reset) = match opts.on_damaged {
            OnDamagedStore::Reset => TieredStore::open_or_reset(&kv, memory_bytes, opts.codec)?,
            OnDamagedStore::Refuse => match TieredStore::open_with(&kv, memory_bytes, opts.codec) {
                Ok(store) => (store, None),
                Err(chunkstore::StoreError::Damaged { path, reason }) => {
                    return Err(GatewayError::Internal(format!(
                        "the chunk KV store at {} is damaged ({reason}); it is only a cache of \
                         recomputable KV, so starting with `--on-damaged-store reset` (the \
                         default) moves it aside and recomputes chunk KV as queries need it; \
                         deleting the directory does the same. The index is not affected.",
                        path.display()
                    )))
                }
                Err(e) => return Err(e.into()),
            },
        };
        let mut store = store
            .with_tenants(opts.tenants)
            .with_budget(opts.disk_budget, opts.eviction)?;
        let mut doclog = None;
        if let Some(r) = &opts.remote {
            let log = crate::doclog::DocLog::open(&r.url, &r.prefix, dir)?;
            log.check_config(r.ttl);
            doclog = Some(Arc::new(log));
            let remote = chunkstore::RemoteStore::new(&r.url, &r.prefix, r.ttl)
                .map_err(|e| GatewayError::bad("kv_remote", e.to_string()))?
                .with_codec(opts.codec);
            store = store.with_remote(remote);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            index,
            store,
            doclog,
            store_reset,
        })
    }

    /// Every store key some indexed chunk refers to.
    pub fn referenced_keys(&self) -> Result<HashSet<String>> {
        Ok(self.index.all_keys()?)
    }

    /// Deletes blobs no indexed chunk refers to (left by a crash or an interrupted ingestion
    /// between storing a chunk and committing the index, by replaced or deleted documents, or
    /// by another model or template), then flushes. KV stored at query time under the disk
    /// budget (passages clients sent, lazily computed chunks) is kept: the budget evicts it.
    /// A full pass over the index's records and the store's files: offline (`specrag
    /// ingest`), or in the server split into [`Corpus::garbage_candidates`] on a thread of its
    /// own and [`Corpus::remove_garbage`] in slices between queries.
    pub fn collect_garbage(&self, engines: &Engines) -> Result<usize> {
        let candidates = self.garbage_candidates(engines)?;
        let removed = self.remove_garbage(&candidates)?;
        self.store.flush()?;
        Ok(removed)
    }

    /// The stored keys that neither an indexed chunk, the disk budget, nor an indexed chunk's
    /// speculator companion ([`Engines::spec_key`]) refers to now. Reads only: safe beside
    /// queries on another thread. The store is a cache, so a store that cannot list its keys
    /// yields none (logged) rather than failing the caller.
    pub fn garbage_candidates(&self, engines: &Engines) -> Result<Vec<ChunkKey>> {
        // Files first, references second: a blob stored after the listing is not a candidate,
        // and one indexed after it is found referenced.
        let keys = match self.store.keys() {
            Ok(keys) => keys,
            Err(e) => {
                tracing::warn!("skipping the chunk store's garbage collection: {e}");
                return Ok(Vec::new());
            }
        };
        let mut referenced = self.referenced_keys()?;
        referenced.extend(self.store.cached_keys().iter().map(ToString::to_string));
        let companions: Vec<String> = referenced
            .iter()
            .filter_map(|k| k.parse::<ChunkKey>().ok())
            .filter_map(|k| engines.spec_key(&k))
            .map(|k| k.to_string())
            .collect();
        referenced.extend(companions);
        Ok(keys
            .into_iter()
            .filter(|k| !referenced.contains(&k.to_string()))
            .collect())
    }

    /// Removes the `candidates` ([`Corpus::garbage_candidates`]) that are still garbage: not
    /// referenced by an indexed chunk (one index lookup each) nor budgeted. The caller makes
    /// sure no ingestion committed since the candidates were listed (a speculator companion
    /// cannot be checked by itself). Returns how many were removed.
    pub fn remove_garbage(&self, candidates: &[ChunkKey]) -> Result<usize> {
        let budgeted = |k: &ChunkKey| self.store.budget().is_some_and(|b| b.contains(k));
        let mut removed = 0;
        for key in candidates {
            if budgeted(key) || self.index.refers(&key.to_string())? {
                continue;
            }
            // Never fails: a removal the disk refuses is logged and retried next time.
            self.store.remove(key)?;
            removed += 1;
        }
        Ok(removed)
    }

    /// After the chunks of `left` (store keys) left the index (a document deleted or
    /// replaced, committed): their KV and speculator companions go, budgeted or not, unless an
    /// indexed chunk still refers to them. One index lookup per key, so an ingestion or a
    /// deletion costs what it touched, never a pass over the whole index or store (that is
    /// [`Corpus::collect_garbage`]'s job). Returns how many blobs were removed.
    pub fn collect_left(&self, engines: &Engines, left: &[String]) -> Result<usize> {
        let mut seen = HashSet::new();
        let mut removed = 0;
        for k in left {
            if !seen.insert(k.as_str()) || self.index.refers(k)? {
                continue;
            }
            let Ok(key) = k.parse::<ChunkKey>() else {
                continue;
            };
            for key in std::iter::once(key).chain(engines.spec_key(&key)) {
                if self.store.disk().contains(&key).unwrap_or(false) {
                    removed += 1;
                }
                self.store.remove(&key)?;
            }
        }
        if removed > 0 {
            self.store.flush()?;
        }
        Ok(removed)
    }
}

/// Times to read one stored chunk back, from each tier (for the ingest summary).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct LoadTimes {
    pub memory_ms: f64,
    pub disk_ms: f64,
}

/// Measures reading `key` from the memory and the disk tier (decode and checksum included).
pub fn load_times(store: &TieredStore, key: &ChunkKey) -> Result<Option<LoadTimes>> {
    let t = Instant::now();
    if store.disk().get(key)?.is_none() {
        return Ok(None);
    }
    let disk_ms = t.elapsed().as_secs_f64() * 1e3;
    let t = Instant::now();
    let in_memory = store.memory().get(key)?.is_some();
    let memory_ms = t.elapsed().as_secs_f64() * 1e3;
    Ok(in_memory.then_some(LoadTimes { memory_ms, disk_ms }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precompute_modes_round_trip_and_unknown_names_are_refused() {
        for mode in [
            PrecomputeMode::Standalone,
            PrecomputeMode::AfterPrefix {
                prefix_hash: "ab12".into(),
            },
        ] {
            assert_eq!(parse_mode(&mode_string(&mode)), Some(mode));
        }
        // Before: anything unknown silently became `standalone`.
        for bad in [
            "",
            "after_prefix:",
            "after_prefix",
            "standalone2",
            "sliding",
        ] {
            assert_eq!(parse_mode(bad), None, "{bad:?}");
        }
    }
}
