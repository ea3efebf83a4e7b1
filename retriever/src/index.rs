//! The BM25 chunk index: one tantivy document per chunk, grouped by (collection, document).
//!
//! Durability: `add_document` and `delete_document` are queued in the writer and become visible
//! and durable together at the next [`Index::commit`], which tantivy makes atomic (a new
//! `meta.json` is swapped in). A crash before commit loses exactly the uncommitted changes and
//! leaves the last committed index intact.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tantivy::collector::{Count, DocSetCollector, TopDocs};
use tantivy::directory::MmapDirectory;
use tantivy::indexer::UserOperation;
use tantivy::query::{
    AllQuery, Bm25StatisticsProvider, BooleanQuery, ConstScoreQuery, EnableScoring, Occur, Query,
    TermQuery,
};
use tantivy::schema::{Field, IndexRecordOption, Schema, Value, FAST, STORED, STRING, TEXT};
use tantivy::tokenizer::TokenStream;
use tantivy::{
    DocAddress, DocSet, IndexReader, IndexWriter, ReloadPolicy, Searcher, TantivyDocument, Term,
    TERMINATED,
};
use tracing::{debug, info, warn};

use crate::chunk::Chunk;
use crate::error::{tantivy_err, Result, RetrieverError};

/// Indexing memory of the single writer thread; chunks are small, so segments stay small too.
const WRITER_MEMORY_BYTES: usize = 50_000_000;

/// Separates collection and document id in the `doc_key` field; collections may not contain it.
const KEY_SEP: char = '\u{1f}';

/// A document as the caller describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DocumentMeta {
    /// Id of the document, unique within its collection.
    pub id: String,
    /// Optional title, searched along with the text.
    pub title: Option<String>,
}

/// A chunk to index and the chunk-store key of its precomputed KV.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexedChunk {
    /// The chunk, as made by [`crate::chunk_document`].
    pub chunk: Chunk,
    /// Opaque key under which the caller stored the chunk's KV (e.g. its hex hash).
    pub key: String,
}

/// A chunk as stored in the index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRecord {
    /// Stable id of the chunk: a hash of collection, document id and position.
    pub chunk_id: String,
    /// Id of the document.
    pub doc_id: String,
    /// Collection of the document.
    pub collection: String,
    /// Title of the document, if it has one.
    pub title: Option<String>,
    /// Text of the chunk.
    pub text: String,
    /// Index of the chunk within its document.
    pub position: usize,
    /// Chunk-store key supplied by the caller at add time.
    pub key: String,
    /// Number of tokens of the chunk.
    pub tokens: usize,
}

/// A search result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Hit {
    /// BM25 score over title and text; higher is better.
    pub score: f32,
    /// The matching chunk.
    pub record: ChunkRecord,
}

/// One document of the index, summarized.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DocSummary {
    /// Collection of the document.
    pub collection: String,
    /// Id of the document.
    pub doc_id: String,
    /// Title of the document, if it has one.
    pub title: Option<String>,
    /// Number of chunks.
    pub chunks: usize,
    /// Total tokens over all chunks.
    pub tokens: usize,
}

#[derive(Clone, Copy)]
struct Fields {
    /// `{collection}\u{1f}{doc_id}`: the term that add (replace) and delete act on.
    doc_key: Field,
    doc_id: Field,
    chunk_id: Field,
    collection: Field,
    title: Field,
    text: Field,
    position: Field,
    key: Field,
    tokens: Field,
}

impl Fields {
    fn schema() -> (Schema, Fields) {
        let mut b = Schema::builder();
        let fields = Fields {
            doc_key: b.add_text_field("doc_key", STRING),
            doc_id: b.add_text_field("doc_id", STRING | STORED),
            chunk_id: b.add_text_field("chunk_id", STRING | STORED),
            collection: b.add_text_field("collection", STRING | STORED),
            title: b.add_text_field("title", TEXT | STORED),
            text: b.add_text_field("text", TEXT | STORED),
            position: b.add_u64_field("position", STORED | FAST),
            key: b.add_text_field("key", STRING | STORED),
            tokens: b.add_u64_field("tokens", STORED),
        };
        (b.build(), fields)
    }
}

/// The writer and the records it holds that are not committed yet.
struct Writer {
    inner: IndexWriter,
    /// Chunks of each `doc_key` touched since the last commit, as they will be after it (empty
    /// for a deleted document): deletes and replaces report them, since a searcher cannot.
    pending: HashMap<String, Vec<ChunkRecord>>,
}

/// A BM25 index of chunks, by collection and document, over tantivy.
///
/// Changes are durable and visible to searches only after [`Index::commit`]. Safe to share
/// between threads behind an `Arc`: searches run in parallel, writes take an internal lock.
pub struct Index {
    index: tantivy::Index,
    reader: IndexReader,
    fields: Fields,
    writer: Mutex<Writer>,
    /// Commits since this index was opened ([`Index::commits`]).
    commits: std::sync::atomic::AtomicU64,
}

impl Index {
    /// Opens the index in `dir`, creating the directory and an empty index if needed.
    ///
    /// Only one `Index` may be open on a directory at a time (tantivy's writer lock).
    pub fn open(dir: impl AsRef<Path>) -> Result<Index> {
        let path = dir.as_ref();
        let dir_err = |reason: String| RetrieverError::Directory {
            path: PathBuf::from(path),
            reason,
        };
        std::fs::create_dir_all(path).map_err(|e| dir_err(format!("cannot create: {e}")))?;
        let mmap = MmapDirectory::open(path).map_err(|e| dir_err(e.to_string()))?;
        let (schema, fields) = Fields::schema();
        let index = tantivy::Index::open_or_create(mmap, schema).map_err(|e| match e {
            tantivy::TantivyError::SchemaError(_) => dir_err(
                "holds an index with a different schema (another program or version of \
                 specrag); use a new directory"
                    .into(),
            ),
            e => dir_err(e.to_string()),
        })?;
        // tantivy does not check its files' checksums as it reads them; a damaged segment
        // would give wrong results or a panic later, so it is refused here, at startup.
        let damaged = index
            .validate_checksum()
            .map_err(|e| dir_err(format!("cannot check the index files: {e}")))?;
        if !damaged.is_empty() {
            let mut names: Vec<String> = damaged.iter().map(|p| p.display().to_string()).collect();
            names.sort();
            return Err(dir_err(format!(
                "index files fail their checksum ({}): the index is damaged; move the \
                 directory away and ingest the documents again (stored KV is reused)",
                names.join(", ")
            )));
        }
        let this = Self::with_index(index, fields).map_err(|e| match e {
            RetrieverError::Tantivy {
                source: tantivy::TantivyError::LockFailure(..),
                ..
            } => dir_err(
                "is in use: another specrag process (a server or an ingestion) holds its index \
                 for writing, and one writer at a time may; stop that one or use another --data \
                 directory (a directory on a read-only file system cannot be opened either)"
                    .into(),
            ),
            RetrieverError::Tantivy { action, source } => {
                dir_err(format!("cannot {action}: {source}"))
            }
            e => e,
        })?;
        info!(dir = %path.display(), chunks = this.num_chunks(), "opened retriever index");
        Ok(this)
    }

    /// An index held in memory only, for tests and throwaway use.
    pub fn in_memory() -> Result<Index> {
        let (schema, fields) = Fields::schema();
        Self::with_index(tantivy::Index::create_in_ram(schema), fields)
    }

    fn with_index(index: tantivy::Index, fields: Fields) -> Result<Index> {
        let inner = index
            .writer_with_num_threads(1, WRITER_MEMORY_BYTES)
            .map_err(tantivy_err("open writer"))?;
        // Manual: the reader is reloaded by `commit`, so no file watcher thread is needed.
        let reader = index
            .reader_builder()
            .reload_policy(ReloadPolicy::Manual)
            .try_into()
            .map_err(tantivy_err("open reader"))?;
        Ok(Index {
            index,
            reader,
            fields,
            writer: Mutex::new(Writer {
                inner,
                pending: HashMap::new(),
            }),
            commits: std::sync::atomic::AtomicU64::new(0),
        })
    }

    fn writer(&self) -> MutexGuard<'_, Writer> {
        // A panic while the lock was held cannot leave tantivy's writer half-updated (its
        // operations are queued whole), so the index stays usable.
        self.writer.lock().unwrap_or_else(|poisoned| {
            warn!("retriever index writer lock was poisoned by a panic; continuing");
            poisoned.into_inner()
        })
    }

    /// Replaces all chunks of document `doc.id` in `collection` with `chunks`.
    ///
    /// Returns the chunks it replaces (none for a new document), so the caller can drop KV that
    /// no new chunk uses. Takes effect at the next [`Index::commit`].
    pub fn add_document(
        &self,
        collection: &str,
        doc: &DocumentMeta,
        chunks: &[IndexedChunk],
    ) -> Result<Vec<ChunkRecord>> {
        check_collection(collection)?;
        check_doc_id(&doc.id)?;
        if chunks.is_empty() {
            return Err(RetrieverError::InvalidArgument {
                field: "chunks",
                reason: format!(
                    "document `{}` has no chunks; delete it instead of adding it empty",
                    doc.id
                ),
            });
        }
        let mut records = Vec::with_capacity(chunks.len());
        for (i, c) in chunks.iter().enumerate() {
            check_chunk(i, c, &doc.id, records.last())?;
            records.push(ChunkRecord {
                chunk_id: chunk_id(collection, &doc.id, c.chunk.position),
                doc_id: doc.id.clone(),
                collection: collection.to_string(),
                title: doc.title.clone(),
                text: c.chunk.text.clone(),
                position: c.chunk.position,
                key: c.key.clone(),
                tokens: c.chunk.ids.len(),
            });
        }
        let doc_key = doc_key(collection, &doc.id);
        let mut ops = Vec::with_capacity(records.len() + 1);
        ops.push(UserOperation::Delete(Term::from_field_text(
            self.fields.doc_key,
            &doc_key,
        )));
        ops.extend(
            records
                .iter()
                .map(|r| UserOperation::Add(self.to_doc(&doc_key, r))),
        );

        let mut w = self.writer();
        let replaced = self.live_chunks(&w, &doc_key)?;
        // One group: the delete and the adds get contiguous opstamps and land together.
        w.inner.run(ops).map_err(tantivy_err("add document"))?;
        w.pending.insert(doc_key, records);
        Ok(replaced)
    }

    /// Deletes document `doc_id` of `collection` and returns its chunks (none if it was absent).
    ///
    /// Takes effect at the next [`Index::commit`].
    pub fn delete_document(&self, collection: &str, doc_id: &str) -> Result<Vec<ChunkRecord>> {
        check_collection(collection)?;
        let doc_key = doc_key(collection, doc_id);
        let mut w = self.writer();
        let removed = self.live_chunks(&w, &doc_key)?;
        w.inner
            .delete_term(Term::from_field_text(self.fields.doc_key, &doc_key));
        w.pending.insert(doc_key, Vec::new());
        Ok(removed)
    }

    /// Makes all adds and deletes so far durable (atomically) and visible to searches.
    pub fn commit(&self) -> Result<()> {
        let mut w = self.writer();
        let opstamp = w.inner.commit().map_err(tantivy_err("commit"))?;
        w.pending.clear();
        self.reader.reload().map_err(tantivy_err("reload reader"))?;
        self.commits
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        debug!(
            opstamp,
            chunks = self.num_chunks(),
            "retriever index committed"
        );
        Ok(())
    }

    /// The `top_k` chunks of `collection` that best match `query` (BM25 over title and text).
    ///
    /// `query` is plain text, not query syntax: it is tokenized like the indexed text and any
    /// word may match, so quotes, colons, `AND` or `-` are just words or punctuation.
    pub fn search(&self, collection: &str, query: &str, top_k: usize) -> Result<Vec<Hit>> {
        check_collection(collection)?;
        if query.trim().is_empty() {
            return Err(RetrieverError::InvalidArgument {
                field: "query",
                reason: "is empty; send at least one word".into(),
            });
        }
        if top_k == 0 {
            return Err(RetrieverError::InvalidArgument {
                field: "top_k",
                reason: "must be at least 1".into(),
            });
        }
        let words = self.query_words(query)?;
        let searcher = self.reader.searcher();
        let stats = CollectionStats {
            searcher: &searcher,
            filter: self.collection_query(collection),
        };
        // TopDocs allocates for its limit, so never ask for more than there are chunks.
        let in_scope = stats
            .total_num_docs()
            .map_err(tantivy_err("count collection"))?;
        let limit = top_k.min(usize::try_from(in_scope).unwrap_or(usize::MAX));
        if words.is_empty() || limit == 0 {
            return Ok(Vec::new());
        }
        let mut any_word: Vec<(Occur, Box<dyn Query>)> = Vec::with_capacity(words.len() * 2);
        for word in &words {
            for field in [self.fields.title, self.fields.text] {
                let term = Term::from_field_text(field, word);
                any_word.push((
                    Occur::Should,
                    Box::new(TermQuery::new(term, IndexRecordOption::WithFreqs)),
                ));
            }
        }
        // The collection filter scores 0 so scores are plain BM25 of the words.
        let in_collection = ConstScoreQuery::new(Box::new(self.collection_query(collection)), 0.0);
        let query = BooleanQuery::new(vec![
            (Occur::Must, Box::new(in_collection) as Box<dyn Query>),
            (Occur::Must, Box::new(BooleanQuery::new(any_word))),
        ]);
        // BM25 statistics of this collection only: scores neither depend on nor reveal what
        // other collections hold.
        let top = searcher
            .search_with_statistics_provider(
                &query,
                &TopDocs::with_limit(limit).order_by_score(),
                &stats,
            )
            .map_err(tantivy_err("search"))?;
        top.into_iter()
            .map(|(score, address)| {
                let doc: TantivyDocument =
                    searcher.doc(address).map_err(tantivy_err("read hit"))?;
                Ok(Hit {
                    score,
                    record: self.to_record(&doc)?,
                })
            })
            .collect()
    }

    /// Committed documents, of one collection or of all, ordered by collection and id.
    ///
    /// Reads every stored chunk in scope (its text is dropped as it is read); holds a summary
    /// per document.
    pub fn documents(&self, collection: Option<&str>) -> Result<Vec<DocSummary>> {
        let query: Box<dyn Query> = match collection {
            Some(c) => {
                check_collection(c)?;
                Box::new(self.collection_query(c))
            }
            None => Box::new(AllQuery),
        };
        let searcher = self.reader.searcher();
        let mut addresses: Vec<DocAddress> = searcher
            .search(&*query, &DocSetCollector)
            .map_err(tantivy_err("list chunks"))?
            .into_iter()
            .collect();
        // Reading in address order keeps store blocks in cache. Each chunk is folded into its
        // document's summary as it is read: what is held grows with the documents, not with
        // their text.
        addresses.sort();
        let f = &self.fields;
        let mut docs: BTreeMap<(String, String), DocSummary> = BTreeMap::new();
        for address in addresses {
            let doc: TantivyDocument = searcher.doc(address).map_err(tantivy_err("read chunk"))?;
            let key = (
                str_field(&doc, f.collection, "collection")?,
                str_field(&doc, f.doc_id, "doc_id")?,
            );
            let tokens = num_field(&doc, f.tokens, "tokens")?;
            let summary = match docs.entry(key) {
                std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::btree_map::Entry::Vacant(e) => {
                    let (collection, doc_id) = e.key().clone();
                    e.insert(DocSummary {
                        collection,
                        doc_id,
                        title: doc
                            .get_first(f.title)
                            .and_then(|v| v.as_str())
                            .map(str::to_string),
                        chunks: 0,
                        tokens: 0,
                    })
                }
            };
            summary.chunks += 1;
            summary.tokens += tokens;
        }
        Ok(docs.into_values().collect())
    }

    /// Committed chunks of document `doc_id` in `collection`, by position (empty if absent).
    pub fn chunks_of(&self, collection: &str, doc_id: &str) -> Result<Vec<ChunkRecord>> {
        check_collection(collection)?;
        self.committed_chunks(&doc_key(collection, doc_id))
    }

    /// Committed collections with their number of chunks, ordered by name.
    pub fn collections(&self) -> Result<Vec<(String, usize)>> {
        let searcher = self.reader.searcher();
        // Term dictionaries still list collections whose chunks are all deleted, so each name
        // is confirmed by counting its live chunks.
        let mut names = BTreeSet::new();
        for segment in searcher.segment_readers() {
            let inverted = segment
                .inverted_index(self.fields.collection)
                .map_err(tantivy_err("read collections"))?;
            let mut terms = inverted
                .terms()
                .stream()
                .map_err(|e| tantivy_err("read collections")(e.into()))?;
            while terms.advance() {
                names.insert(String::from_utf8_lossy(terms.key()).into_owned());
            }
        }
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            let count = searcher
                .search(&self.collection_query(&name), &Count)
                .map_err(tantivy_err("count collection"))?;
            if count > 0 {
                out.push((name, count));
            }
        }
        Ok(out)
    }

    /// Committed chunks of `collection` (0 for a collection nothing was ingested into).
    pub fn collection_chunks(&self, collection: &str) -> Result<usize> {
        check_collection(collection)?;
        self.reader
            .searcher()
            .search(&self.collection_query(collection), &Count)
            .map_err(tantivy_err("count collection"))
    }

    /// Whether `collection` holds a committed chunk: the term's document frequency per
    /// segment, without visiting its postings unless a segment with deletions is all that
    /// names it (a check every query makes; [`Index::collection_chunks`] counts).
    pub fn has_collection(&self, collection: &str) -> Result<bool> {
        check_collection(collection)?;
        let searcher = self.reader.searcher();
        let term = Term::from_field_text(self.fields.collection, collection);
        let mut maybe = false;
        for segment in searcher.segment_readers() {
            let freq = segment
                .inverted_index(self.fields.collection)
                .map_err(tantivy_err("read collections"))?
                .doc_freq(&term)
                .map_err(|e| tantivy_err("read collections")(e.into()))?;
            if freq > 0 {
                if segment.num_deleted_docs() == 0 {
                    return Ok(true);
                }
                maybe = true;
            }
        }
        Ok(maybe && self.collection_chunks(collection)? > 0)
    }

    /// Chunk-store keys of every committed chunk, in one pass over the stored records.
    pub fn all_keys(&self) -> Result<std::collections::HashSet<String>> {
        Ok(self
            .records_matching(&AllQuery)?
            .into_iter()
            .map(|r| r.key)
            .collect())
    }

    /// How many commits this index has seen since it was opened: a reader that listed
    /// something and acts on it later knows whether the index changed meanwhile.
    pub fn commits(&self) -> u64 {
        self.commits.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Whether some committed chunk refers to the chunk-store key `key` (one term lookup, not
    /// a pass over the records: what incremental garbage collection asks per key).
    pub fn refers(&self, key: &str) -> Result<bool> {
        let term = Term::from_field_text(self.fields.key, key);
        let n = self
            .reader
            .searcher()
            .search(&TermQuery::new(term, IndexRecordOption::Basic), &Count)
            .map_err(tantivy_err("look up a chunk key"))?;
        Ok(n > 0)
    }

    /// Drops every add and delete since the last commit (after a failed batch), so a later
    /// commit cannot publish half of it.
    pub fn rollback(&self) -> Result<()> {
        let mut w = self.writer();
        w.inner.rollback().map_err(tantivy_err("rollback"))?;
        w.pending.clear();
        Ok(())
    }

    /// Number of committed chunks over all collections.
    pub fn num_chunks(&self) -> usize {
        usize::try_from(self.reader.searcher().num_docs()).unwrap_or(usize::MAX)
    }

    /// Chunks of `doc_key` as they will be after the next commit.
    fn live_chunks(&self, w: &Writer, doc_key: &str) -> Result<Vec<ChunkRecord>> {
        match w.pending.get(doc_key) {
            Some(records) => Ok(records.clone()),
            None => self.committed_chunks(doc_key),
        }
    }

    fn committed_chunks(&self, doc_key: &str) -> Result<Vec<ChunkRecord>> {
        let term = Term::from_field_text(self.fields.doc_key, doc_key);
        let mut records = self.records_matching(&TermQuery::new(term, IndexRecordOption::Basic))?;
        records.sort_by_key(|r| r.position);
        Ok(records)
    }

    fn records_matching(&self, query: &dyn Query) -> Result<Vec<ChunkRecord>> {
        let searcher = self.reader.searcher();
        let addresses = searcher
            .search(query, &DocSetCollector)
            .map_err(tantivy_err("list chunks"))?;
        // Reading in address order keeps store blocks in cache.
        let mut addresses: Vec<DocAddress> = addresses.into_iter().collect();
        addresses.sort();
        addresses
            .into_iter()
            .map(|address| {
                let doc: TantivyDocument =
                    searcher.doc(address).map_err(tantivy_err("read chunk"))?;
                self.to_record(&doc)
            })
            .collect()
    }

    fn collection_query(&self, collection: &str) -> TermQuery {
        let term = Term::from_field_text(self.fields.collection, collection);
        TermQuery::new(term, IndexRecordOption::Basic)
    }

    /// Distinct words of `query`, made exactly as the text field's analyzer makes index terms.
    fn query_words(&self, query: &str) -> Result<Vec<String>> {
        let mut analyzer = self
            .index
            .tokenizer_for_field(self.fields.text)
            .map_err(tantivy_err("tokenize query"))?;
        let mut stream = analyzer.token_stream(query);
        let mut seen = BTreeSet::new();
        let mut words = Vec::new();
        while stream.advance() {
            let word = &stream.token().text;
            if seen.insert(word.clone()) {
                words.push(word.clone());
            }
        }
        Ok(words)
    }

    fn to_doc(&self, doc_key: &str, r: &ChunkRecord) -> TantivyDocument {
        let f = &self.fields;
        let mut doc = TantivyDocument::default();
        doc.add_text(f.doc_key, doc_key);
        doc.add_text(f.doc_id, &r.doc_id);
        doc.add_text(f.chunk_id, &r.chunk_id);
        doc.add_text(f.collection, &r.collection);
        if let Some(title) = &r.title {
            doc.add_text(f.title, title);
        }
        doc.add_text(f.text, &r.text);
        doc.add_u64(f.position, r.position as u64);
        doc.add_text(f.key, &r.key);
        doc.add_u64(f.tokens, r.tokens as u64);
        doc
    }

    fn to_record(&self, doc: &TantivyDocument) -> Result<ChunkRecord> {
        let f = &self.fields;
        Ok(ChunkRecord {
            chunk_id: str_field(doc, f.chunk_id, "chunk_id")?,
            doc_id: str_field(doc, f.doc_id, "doc_id")?,
            collection: str_field(doc, f.collection, "collection")?,
            title: doc
                .get_first(f.title)
                .and_then(|v| v.as_str())
                .map(str::to_string),
            text: str_field(doc, f.text, "text")?,
            position: num_field(doc, f.position, "position")?,
            key: str_field(doc, f.key, "key")?,
            tokens: num_field(doc, f.tokens, "tokens")?,
        })
    }
}

/// A stored string field of a chunk (`name` for the error where it is missing).
fn str_field(doc: &TantivyDocument, field: Field, name: &'static str) -> Result<String> {
    doc.get_first(field)
        .and_then(|v| v.as_str())
        .map(str::to_string)
        .ok_or(RetrieverError::CorruptRecord {
            field: name,
            expected: "string",
        })
}

/// A stored number field of a chunk (`name` for the error where it is missing).
fn num_field(doc: &TantivyDocument, field: Field, name: &'static str) -> Result<usize> {
    doc.get_first(field)
        .and_then(|v| v.as_u64())
        .and_then(|n| usize::try_from(n).ok())
        .ok_or(RetrieverError::CorruptRecord {
            field: name,
            expected: "u64",
        })
}

/// BM25 statistics (document count, field lengths, document frequencies) over the live chunks
/// of one collection. tantivy's own are index-wide, which would let one tenant's documents
/// change another's ranking and let scores reveal how often a word occurs elsewhere.
struct CollectionStats<'a> {
    searcher: &'a Searcher,
    /// Matches the collection's chunks.
    filter: TermQuery,
}

impl Bm25StatisticsProvider for CollectionStats<'_> {
    /// The sum of the field's lengths over the collection's live chunks, as tantivy stores
    /// them (field norms: exact up to 40 tokens, a close approximation above).
    fn total_num_tokens(&self, field: Field) -> tantivy::Result<u64> {
        let weight = self
            .filter
            .weight(EnableScoring::disabled_from_searcher(self.searcher))?;
        let mut total = 0u64;
        for segment in self.searcher.segment_readers() {
            let norms = segment.get_fieldnorms_reader(field)?;
            let alive = segment.alive_bitset();
            let mut docs = weight.scorer(segment, 1.0)?;
            let mut doc = docs.doc();
            while doc != TERMINATED {
                if alive.is_none_or(|a| a.is_alive(doc)) {
                    total += u64::from(norms.fieldnorm(doc));
                }
                doc = docs.advance();
            }
        }
        Ok(total)
    }

    fn total_num_docs(&self) -> tantivy::Result<u64> {
        Ok(self.searcher.search(&self.filter, &Count)? as u64)
    }

    fn doc_freq(&self, term: &Term) -> tantivy::Result<u64> {
        let both = BooleanQuery::new(vec![
            (Occur::Must, Box::new(self.filter.clone()) as Box<dyn Query>),
            (
                Occur::Must,
                Box::new(TermQuery::new(term.clone(), IndexRecordOption::Basic)),
            ),
        ]);
        Ok(self.searcher.search(&both, &Count)? as u64)
    }
}

fn doc_key(collection: &str, doc_id: &str) -> String {
    format!("{collection}{KEY_SEP}{doc_id}")
}

/// A stable id for a chunk that no choice of names can make collide: the first 128 bits of
/// sha256 over the length-prefixed collection and document id and the position.
fn chunk_id(collection: &str, doc_id: &str, position: usize) -> String {
    let mut h = Sha256::new();
    for part in [collection, doc_id] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    h.update((position as u64).to_le_bytes());
    h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn check_collection(collection: &str) -> Result<()> {
    if collection.is_empty() {
        return Err(RetrieverError::InvalidArgument {
            field: "collection",
            reason: "is empty; name a collection".into(),
        });
    }
    if collection.contains(KEY_SEP) {
        return Err(RetrieverError::InvalidArgument {
            field: "collection",
            reason: "contains the control character U+001F; use printable characters".into(),
        });
    }
    Ok(())
}

fn check_doc_id(id: &str) -> Result<()> {
    if id.is_empty() {
        return Err(RetrieverError::InvalidArgument {
            field: "id",
            reason: "document id is empty; give each document a non-empty id".into(),
        });
    }
    Ok(())
}

fn check_chunk(
    i: usize,
    c: &IndexedChunk,
    doc_id: &str,
    previous: Option<&ChunkRecord>,
) -> Result<()> {
    let bad = |reason: String| RetrieverError::InvalidArgument {
        field: "chunks",
        reason: format!("chunk {i}: {reason}"),
    };
    if c.chunk.doc_id != doc_id {
        return Err(bad(format!(
            "belongs to document `{}`, not `{doc_id}`",
            c.chunk.doc_id
        )));
    }
    if c.key.is_empty() {
        return Err(bad("has an empty chunk-store key".into()));
    }
    if let Some(prev) = previous {
        if c.chunk.position <= prev.position {
            return Err(bad(format!(
                "position {} does not follow position {}; positions must increase",
                c.chunk.position, prev.position
            )));
        }
    }
    Ok(())
}
