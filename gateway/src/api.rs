//! Wire types of the API: what clients send, with their validation into the pipeline's types
//! (the CLI builds the same wire type, so a flag and a JSON field are checked by one function),
//! and what the server answers (`Answer` and its parts, documents, problems).

use crate::error::{GatewayError, Result};
use crate::method::Method;
use crate::pipeline::Query;

use serde::{Deserialize, Serialize};

/// Longest accepted question, in characters.
pub const MAX_QUERY_CHARS: usize = 8 * 1024;
/// What a collection name may hold (also the OpenAPI pattern).
pub const COLLECTION_PATTERN: &str = r"^[A-Za-z0-9._-]{1,128}$";
/// Most chunks one query may retrieve (the prompt must also fit `max_context_tokens`).
pub const MAX_TOP_K: u32 = 256;
/// Most tokens one answer may generate.
pub const MAX_TOKENS: u32 = 1024;

/// Largest accepted seed (2^53 - 1: exact in every JSON implementation).
pub const MAX_SEED: u64 = (1 << 53) - 1;

/// Most passages one query may bring (`documents`, or found in an OpenAI request's
/// messages): as many as it may retrieve (`top_k`), so a retrieval pipeline's 20-100 chunks fit.
pub const MAX_QUERY_DOCUMENTS: usize = 256;
/// Most characters of all the passages one query brings together: 256 passages of 2,000
/// characters (the prompt's token budget, `max_context_tokens`, bounds them further).
pub const MAX_QUERY_DOCUMENTS_CHARS: usize = 512 * 1024;
/// Longest id of a passage a query brings.
pub const MAX_PASSAGE_ID_CHARS: usize = 256;

/// A passage the client retrieved itself (`documents` of `/rag/query`, `specrag.documents` of
/// the OpenAI route): read instead of retrieving, its chunks' KV reused by content.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PassageInput {
    /// The client's name for it (default `passage-<n>`, its place in the list from 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(min_length = 1, max_length = 256)]
    pub id: Option<String>,
    /// Its text, not only whitespace.
    #[schema(min_length = 1, pattern = r"\S")]
    pub text: String,
}

/// Checks the passages a query brings and names them.
pub fn validate_passages(
    field: &'static str,
    docs: &[PassageInput],
) -> Result<Vec<crate::pipeline::Passage>> {
    if docs.is_empty() {
        return Err(GatewayError::bad(
            field,
            "holds no passage; leave it out to retrieve from the collection",
        ));
    }
    if docs.len() > MAX_QUERY_DOCUMENTS {
        return Err(GatewayError::bad(
            field,
            format!(
                "holds {} passages; at most {MAX_QUERY_DOCUMENTS} are read per query",
                docs.len()
            ),
        ));
    }
    let chars: usize = docs.iter().map(|d| d.text.chars().count()).sum();
    if chars > MAX_QUERY_DOCUMENTS_CHARS {
        return Err(GatewayError::TooLarge {
            field,
            message: format!(
                "the passages hold {chars} characters; at most {MAX_QUERY_DOCUMENTS_CHARS} are \
                 read per query"
            ),
        });
    }
    docs.iter()
        .enumerate()
        .map(|(i, d)| {
            if d.text.trim().is_empty() {
                return Err(GatewayError::bad(
                    field,
                    format!("{field}[{i}] has no text"),
                ));
            }
            let id = d.id.clone().unwrap_or_else(|| format!("passage-{}", i + 1));
            if id.is_empty() || id.chars().count() > MAX_PASSAGE_ID_CHARS {
                return Err(GatewayError::bad(
                    field,
                    format!("{field}[{i}].id must be 1 to {MAX_PASSAGE_ID_CHARS} characters"),
                ));
            }
            Ok(crate::pipeline::Passage {
                id,
                text: d.text.clone(),
            })
        })
        .collect()
}

/// An optional integer that JSON may spell `32` or `32.0` (JSON Schema counts both as
/// integers, so clients and generated clients send either).
pub(crate) fn de_opt_int<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<u64>, D::Error> {
    let v: Option<serde_json::Number> = Option::deserialize(d)?;
    let Some(n) = v else { return Ok(None) };
    if let Some(u) = n.as_u64() {
        return Ok(Some(u));
    }
    match n.as_f64() {
        Some(f) if f >= 0.0 && f.fract() == 0.0 && f <= MAX_SEED as f64 => Ok(Some(f as u64)),
        _ => Err(serde::de::Error::custom(format!(
            "expected a non-negative integer, got {n}"
        ))),
    }
}

/// `POST /rag/query` body.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"query": "How does specrag choose which tokens to recompute?", "top_k": 4, "method": "target_probe_shift", "recompute_ratio": 0.25, "max_tokens": 64}))]
pub struct QueryRequest {
    /// The question: 1 to 8192 characters, not only whitespace.
    #[schema(min_length = 1, max_length = 8192, pattern = r"\S")]
    pub query: String,
    /// Collection to retrieve from (default `default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(pattern = r"^[A-Za-z0-9._-]{1,128}$")]
    pub collection: Option<String>,
    /// Chunks to retrieve, 1 to 256 (default 4; the prompt must fit `max_context_tokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 256)]
    #[serde(deserialize_with = "de_opt_int")]
    pub top_k: Option<u64>,
    /// How the tokens to recompute are chosen (default `target_probe_shift`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Method>)]
    pub method: Option<String>,
    /// ρ, the share of chunk tokens to recompute, 0 to 1 (default: the server's `--ratio`, 0.25
    /// unless set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.0, maximum = 1.0)]
    pub recompute_ratio: Option<f64>,
    /// Most tokens to generate, 1 to 1024 (default 128).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 1024)]
    #[serde(deserialize_with = "de_opt_int")]
    pub max_tokens: Option<u64>,
    /// Sampling temperature, 0 (greedy, default) to 2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.0, maximum = 2.0)]
    pub temperature: Option<f32>,
    /// Seed of the sampler (same seed, same answer), 0 to 2^53 - 1.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "de_opt_int"
    )]
    #[schema(minimum = 0, maximum = 9007199254740991_u64)]
    pub seed: Option<u64>,
    /// Answer exactly as full recompute would, token for token: tokens are drafted from the
    /// reused cache while the full prefill runs, then verified against the full cache (the
    /// `verify` object of the answer says how many were accepted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<bool>,
    /// How much quality the answer may trade for speed (default: the server's
    /// `--fidelity`, `balanced` unless set): `fast` reuses as the method selects, unguarded;
    /// `balanced` guards the decode (a decode from the reused cache that chooses a token by a
    /// top-2 logit gap under the server's `--guard-margin` is decoded again with more chunk
    /// tokens recomputed and goes on where that chooses the same tokens; one that falls into
    /// a loop, or that this does not confirm, moves to the full cache and answers as full
    /// recompute; `reuse.guard` says what happened); `exact` is `verify: true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fidelity: Option<crate::fidelity::Fidelity>,
    /// Speculative decoding (default: the server's `--spec-decode`): a drafter (`spec_draft`)
    /// proposes tokens and the target checks several in one pass. The
    /// answer is unchanged, token for token (sampled: drawn from the same distribution, by
    /// the rejection rule); `verify` answers draft against the full cache and stay full
    /// recompute's. `spec_decode` in the answer says what was accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_decode: Option<bool>,
    /// What drafts with `spec_decode` (default: the server's `--spec-draft`, `lookup` unless
    /// set): `lookup` (prompt lookup, copying what followed the answer's last tokens in the
    /// prompt), `model` (the speculator) or `both` (lookup, then the speculator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_draft: Option<crate::pipeline::SpecDraft>,
    /// Long-context drafting (default: the server's `--long-context`, off unless set; then for
    /// prompts of at least `--long-context-min-tokens`): a greedy answer drafts from SpeCache's
    /// view of the cache (each step attends to the rows chosen on low-bit keys) and every round is checked
    /// in one full-attention pass; the answer is unchanged, token for token. `true` turns it
    /// on whatever the prompt's length, `false` off. `long_context` in the answer says what
    /// was accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub long_context: Option<bool>,
    /// Most tokens the prompt and the answer may take together (default and ceiling: the
    /// server's `--max-context-tokens`, at most the target's context length). A prompt that
    /// does not fit with `max_tokens` is refused (422, naming `top_k`).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "de_opt_int"
    )]
    #[schema(minimum = 1)]
    pub max_context_tokens: Option<u64>,
    /// Passages to answer from instead of retrieving (at most 256, 512 Ki characters in all):
    /// the question is answered over them, in this order, and each passage's chunks reuse
    /// the KV stored the last time the same text was read in the same collection (computed
    /// and stored now otherwise). `top_k` does not apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(min_items = 1, max_items = 256)]
    pub documents: Option<Vec<PassageInput>>,
    /// Answer with server-sent events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// Report each answer token's log-probability and this many most likely alternatives (0
    /// to 20) in the answer's `logprobs`, from the pass that chose the token, for every
    /// method, verified and speculative decoding included. Absent: none (no cost).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, maximum = 20)]
    #[serde(deserialize_with = "de_opt_int")]
    pub logprobs: Option<u64>,
}

/// A collection name: 1 to 128 ASCII letters, digits, `-`, `_` and `.`.
pub fn validate_collection(field: &'static str, c: &str) -> Result<()> {
    if c.is_empty() || c.len() > 128 {
        return Err(GatewayError::bad(field, "must be 1 to 128 characters"));
    }
    if !c
        .chars()
        .all(|ch| ch.is_ascii_alphanumeric() || matches!(ch, '-' | '_' | '.'))
    {
        return Err(GatewayError::bad(
            field,
            format!("`{c}` may only contain ASCII letters, digits, `-`, `_` and `.`"),
        ));
    }
    Ok(())
}

/// `value` when it lies in `lo..=hi`, else a bad-input error naming `field`.
fn within<T: PartialOrd + std::fmt::Display>(
    field: &'static str,
    value: T,
    lo: T,
    hi: T,
) -> Result<T> {
    if lo <= value && value <= hi {
        Ok(value)
    } else {
        Err(GatewayError::bad(
            field,
            format!("must be {lo} to {hi}, got {value}"),
        ))
    }
}

/// The method a request names; an unknown name is refused, naming every method.
fn served_method(m: &str) -> Result<Method> {
    Method::parse(m).ok_or_else(|| {
        let names: Vec<&str> = Method::ALL.iter().map(|m| m.name()).collect();
        GatewayError::bad(
            "method",
            format!(
                "method `{m}` is unknown; expected one of {}",
                names.join(", ")
            ),
        )
    })
}

/// What a request that leaves a field out gets where the server sets it: `specrag serve
/// --fidelity` and `--ratio`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestDefaults {
    /// `fidelity` of a request that sends neither it nor `verify`.
    pub fidelity: crate::fidelity::Fidelity,
    /// `recompute_ratio` of a request that does not send it.
    pub recompute_ratio: f64,
}

impl Default for RequestDefaults {
    fn default() -> Self {
        Self {
            fidelity: crate::fidelity::Fidelity::default(),
            recompute_ratio: crate::pipeline::DEFAULT_RATIO,
        }
    }
}

impl QueryRequest {
    /// Checks every field and fills in the defaults (fidelity `balanced`, ρ 0.25).
    pub fn validate(&self) -> Result<Query> {
        self.validate_with(RequestDefaults::default())
    }

    /// [`QueryRequest::validate`] with the server's defaults.
    pub fn validate_with(&self, defaults: RequestDefaults) -> Result<Query> {
        use crate::fidelity::Fidelity;
        let d = Query::default();
        let query = self.query.trim();
        if query.is_empty() {
            return Err(GatewayError::bad("query", "must not be empty"));
        }
        let chars = self.query.chars().count();
        if chars > MAX_QUERY_CHARS {
            return Err(GatewayError::bad(
                "query",
                format!("is {chars} characters; at most {MAX_QUERY_CHARS} are accepted"),
            ));
        }
        let collection = self.collection.clone().unwrap_or(d.collection);
        validate_collection("collection", &collection)?;
        let top_k = self.top_k.unwrap_or(d.top_k as u64);
        let top_k = within("top_k", top_k, 1, MAX_TOP_K as u64)?;
        let method = match &self.method {
            None => d.method,
            Some(m) => served_method(m)?,
        };
        let ratio = self.recompute_ratio.unwrap_or(defaults.recompute_ratio);
        let ratio = within("recompute_ratio", ratio, 0.0, 1.0)?;
        let max_tokens = self.max_tokens.unwrap_or(d.max_tokens as u64);
        let max_tokens = within("max_tokens", max_tokens, 1, MAX_TOKENS as u64)?;
        let temperature = self.temperature.unwrap_or(d.temperature);
        let temperature = within("temperature", temperature, 0.0, 2.0)?;
        let seed = within("seed", self.seed.unwrap_or(0), 0, MAX_SEED)?;
        let verify = self.verify.unwrap_or(false);
        let fidelity = match (self.fidelity, verify) {
            (Some(f), true) if f != Fidelity::Exact => {
                return Err(GatewayError::bad(
                    "fidelity",
                    format!(
                        "`{}` contradicts `verify: true` (which is `exact`); send one of them",
                        f.name()
                    ),
                ))
            }
            (_, true) => Fidelity::Exact,
            (Some(f), false) => f,
            (None, false) => defaults.fidelity,
        };
        let documents = match &self.documents {
            Some(d) => validate_passages("documents", d)?,
            None => Vec::new(),
        };
        let max_context_tokens = match self.max_context_tokens {
            Some(m) => Some(within("max_context_tokens", m, 1, u64::from(u32::MAX))? as usize),
            None => None,
        };
        let top = target_engine::MAX_TOP_LOGPROBS as u64;
        let logprobs = match self.logprobs {
            Some(k) => Some(within("logprobs", k, 0, top)? as usize),
            None => None,
        };
        Ok(Query {
            query: query.to_string(),
            documents,
            collection,
            top_k: top_k as usize,
            method,
            ratio,
            max_tokens: max_tokens as usize,
            temperature,
            seed,
            verify: verify || fidelity == Fidelity::Exact,
            fidelity,
            spec_decode: self.spec_decode,
            spec_draft: self.spec_draft,
            long_context: self.long_context,
            max_context_tokens,
            logprobs,
            ..d
        })
    }
}

/// One document of `POST /documents`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DocumentIn {
    /// Document id, unique in its collection (1 to 512 characters, not only whitespace);
    /// re-sending it replaces the document.
    #[schema(min_length = 1, max_length = 512, pattern = r"\S")]
    pub id: String,
    /// Title, at most 512 characters (it is stored with every chunk of the document).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(max_length = 512)]
    pub title: Option<String>,
    /// The text (not only whitespace), at most 1 Mi characters; the texts of one request
    /// hold at most 2 Mi characters together (413 above either; more goes through
    /// `specrag ingest`).
    #[schema(min_length = 1, max_length = 1048576, pattern = r"\S")]
    pub text: String,
}

/// Most characters of a document title.
pub const MAX_TITLE_CHARS: usize = 512;
pub use crate::input::{doc_id_problem, MAX_DOC_ID_CHARS};
/// Most characters of all texts of one `POST /documents` together: ingestion costs engine
/// time in proportion (a character is at most one token), and every query waits behind it.
pub const MAX_DOCUMENTS_TEXT_CHARS: usize = 2 * 1024 * 1024;
/// Most characters of one document's text.
pub const MAX_DOCUMENT_TEXT_CHARS: usize = 1024 * 1024;

/// `POST /documents` body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"collection": "default", "documents": [{"id": "kv-caches", "title": "KV caches", "text": "A KV cache stores the keys and values of every token a transformer has read."}]}))]
pub struct DocumentsRequest {
    /// Collection to add to (default `default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(pattern = r"^[A-Za-z0-9._-]{1,128}$")]
    pub collection: Option<String>,
    /// Most target tokens per chunk, 16 to 4096 (default 512).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 16, maximum = 4096)]
    #[serde(deserialize_with = "de_opt_int")]
    pub chunk_tokens: Option<u64>,
    /// 1 to 1000 documents with distinct ids.
    #[schema(min_items = 1, max_items = 1000)]
    pub documents: Vec<DocumentIn>,
    /// `eager` (default): precompute every chunk's KV now; `lazy`: index the text only and
    /// compute a chunk's KV at its first retrieval, kept under the server's disk budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv: Option<crate::ingest::KvMode>,
}

/// Most documents in one `POST /documents`.
pub const MAX_DOCUMENTS: usize = 1000;

impl DocumentIn {
    /// Checks document `i` of a request on its own; returns its length in characters.
    fn check(&self, i: usize) -> Result<usize> {
        if self
            .title
            .as_ref()
            .is_some_and(|t| t.chars().count() > MAX_TITLE_CHARS)
        {
            return Err(GatewayError::bad(
                "documents[].title",
                format!("documents[{i}].title is longer than {MAX_TITLE_CHARS} characters"),
            ));
        }
        let chars = self.text.chars().count();
        if chars > MAX_DOCUMENT_TEXT_CHARS {
            return Err(GatewayError::TooLarge {
                field: "documents[].text",
                message: format!(
                    "documents[{i}].text holds {chars} characters; at most \
                     {MAX_DOCUMENT_TEXT_CHARS} per document (split it, or use `specrag ingest`)"
                ),
            });
        }
        if let Some(why) = doc_id_problem(&self.id) {
            return Err(GatewayError::bad(
                "documents[].id",
                format!("documents[{i}].id {why}"),
            ));
        }
        if self.text.trim().is_empty() {
            return Err(GatewayError::bad(
                "documents[].text",
                format!("documents[{i}].text (id `{}`) is empty", self.id),
            ));
        }
        Ok(chars)
    }
}

impl DocumentsRequest {
    /// Validates the request into documents and an ingestion config.
    /// Duplicate ids are not an error: the first one is ingested and the others come back as
    /// problems (the third element), as `specrag ingest` does.
    pub fn validate(
        &self,
    ) -> Result<(
        Vec<crate::input::SourceDoc>,
        crate::ingest::IngestConfig,
        Vec<crate::input::InputProblem>,
    )> {
        let collection = self.collection.clone().unwrap_or_else(|| "default".into());
        validate_collection("collection", &collection)?;
        let chunk_tokens = within("chunk_tokens", self.chunk_tokens.unwrap_or(512), 16, 4096)?;
        if self.documents.is_empty() || self.documents.len() > MAX_DOCUMENTS {
            return Err(GatewayError::bad(
                "documents",
                format!(
                    "must hold 1 to {MAX_DOCUMENTS} documents, got {}",
                    self.documents.len()
                ),
            ));
        }
        let mut seen = std::collections::HashSet::new();
        let mut problems = Vec::new();
        let mut docs = Vec::with_capacity(self.documents.len());
        let mut total_chars = 0usize;
        for (i, d) in self.documents.iter().enumerate() {
            total_chars += d.check(i)?;
            if total_chars > MAX_DOCUMENTS_TEXT_CHARS {
                return Err(GatewayError::TooLarge {
                    field: "documents[].text",
                    message: format!(
                        "the texts hold more than {MAX_DOCUMENTS_TEXT_CHARS} characters together \
                         (reached at documents[{i}]); send fewer per request or use `specrag ingest`"
                    ),
                });
            }
            if !seen.insert(d.id.as_str()) {
                problems.push(crate::input::InputProblem {
                    origin: format!("documents[{i}]"),
                    message: format!("duplicate document id `{}` (the first one was kept)", d.id),
                });
                continue;
            }
            docs.push(crate::input::SourceDoc {
                id: d.id.clone(),
                title: d.title.clone().filter(|t| !t.trim().is_empty()),
                text: d.text.clone(),
                origin: format!("documents[{i}]"),
            });
        }
        Ok((
            docs,
            crate::ingest::IngestConfig {
                collection,
                chunk_tokens: chunk_tokens as usize,
                kv: self.kv.unwrap_or_default(),
                ..Default::default()
            },
            problems,
        ))
    }
}

/// What `POST /documents` did.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct IngestResponse {
    pub collection: String,
    pub documents: usize,
    pub chunks: usize,
    pub tokens: usize,
    /// Chunks whose KV was already stored.
    pub reused_chunks: usize,
    pub kv_bytes: u64,
    pub seconds: f64,
    /// Documents that could not be ingested, each with the reason.
    pub problems: Vec<String>,
}

/// One document as listed by `GET /documents`.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DocumentInfo {
    pub collection: String,
    pub id: String,
    pub title: Option<String>,
    pub chunks: usize,
    pub tokens: usize,
}

/// `GET /documents` answer.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DocumentList {
    pub documents: Vec<DocumentInfo>,
}

/// `DELETE /documents/{id}` answer.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Deleted {
    pub collection: String,
    pub id: String,
    /// Chunks removed from the index (their KV is dropped unless another document uses it).
    pub chunks: usize,
}

/// A model as `/health` reports it.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ModelInfo {
    pub name: String,
    /// The model file (shown to admin keys, or when the server has no keys).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// sha256 of the GGUF file's metadata and tensor table and of every load choice that changes the model's numbers (attention precision, re-quantization, the kernels its weights run on): stored KV is bound to it.
    pub fingerprint: String,
    /// Where the target runs: `cpu` (the CPU engine) or `device:cuda:N` (`--device`); absent for
    /// the speculator, which runs on the CPU engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
}

/// A collection as `/health` reports it.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CollectionInfo {
    pub name: String,
    pub chunks: usize,
}

/// `GET /health` answer.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Health {
    /// `ok`, or `degraded` when the chunk store failed within the last
    /// [`STORE_DEGRADED_SECS`] seconds or was reset at startup (answers still come: failed
    /// store operations cost recomputes; `store` says more).
    pub status: String,
    /// The chunk KV store's condition.
    pub store: StoreHealth,
    pub target: ModelInfo,
    pub speculator: Option<ModelInfo>,
    pub collections: Vec<CollectionInfo>,
    /// Requests waiting for the engine.
    pub queue_depth: usize,
    pub queue_capacity: usize,
    /// With `--kv-remote`: the last document log entry this node has applied (`0-0`: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_position: Option<String>,
    /// With `--kv-remote`: entries of other nodes this process passed over after failing
    /// every try (their documents are missing here until written again; the log says why).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_failed: Option<u64>,
    /// With `--kv-remote`: what in the Redis' configuration, read at start, can lose the
    /// document log or refuse its appends (an eviction policy that can evict it, no
    /// append-only file); absent when nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_warnings: Option<Vec<String>>,
}

/// How long after a chunk store failure `/health` says `degraded`.
pub const STORE_DEGRADED_SECS: u64 = 300;

/// The chunk KV store's condition in `/health`.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct StoreHealth {
    /// `ok`, or `degraded` (a failure within the last 300 seconds, or a reset at startup).
    pub status: String,
    /// Store operations that failed since startup (each answered as a miss or skipped, and
    /// logged with its chunk key).
    pub errors: u64,
    /// Seconds since the last failure, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error_secs: Option<u64>,
    /// Set when the store could not be opened at startup and was reset
    /// (`--on-damaged-store reset`): where the damaged one was moved (admin keys see the
    /// path; others `moved aside`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_at_startup: Option<String>,
}

/// An error, as `application/problem+json` (RFC 9457).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[schema(example = json!({"type": "about:blank", "title": "Unprocessable Entity", "status": 422, "detail": "invalid `top_k`: must be 1 to 256, got 0", "field": "top_k"}))]
pub struct Problem {
    #[serde(rename = "type")]
    pub kind: String,
    pub title: String,
    pub status: u16,
    pub detail: String,
    /// The request field at fault, when one is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(r: &QueryRequest) -> Option<&'static str> {
        match r.validate() {
            Err(GatewayError::BadInput { field, .. }) => Some(field),
            _ => None,
        }
    }

    /// Every method the type names is served: the API refuses none of them, and refuses an
    /// unknown name (the evaluation's `oracle` among them) listing every method.
    #[test]
    fn every_method_is_served_and_an_unknown_one_is_refused_naming_them_all() {
        for m in Method::ALL {
            assert_eq!(served_method(m.name()).ok(), Some(*m));
        }
        for name in ["oracle", "probe_deep", "nope"] {
            match served_method(name) {
                Err(GatewayError::BadInput { field, message }) => {
                    assert_eq!(field, "method");
                    assert!(
                        message.contains(&format!("`{name}` is unknown")),
                        "{message}"
                    );
                    assert!(Method::ALL.iter().all(|m| message.contains(m.name())));
                }
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_servers_defaults_fill_only_the_fields_a_request_leaves_out() -> Result<()> {
        use crate::fidelity::Fidelity;
        let server = RequestDefaults {
            fidelity: Fidelity::Fast,
            recompute_ratio: 0.35,
        };
        let bare = QueryRequest {
            query: "q".into(),
            ..Default::default()
        };
        let q = bare.validate_with(server)?;
        assert_eq!((q.ratio, q.fidelity), (0.35, Fidelity::Fast));
        let q = bare.validate()?;
        assert_eq!(
            (q.ratio, q.fidelity),
            (crate::pipeline::DEFAULT_RATIO, Fidelity::Balanced)
        );
        let own = QueryRequest {
            recompute_ratio: Some(0.1),
            fidelity: Some(Fidelity::Exact),
            ..bare.clone()
        };
        let q = own.validate_with(server)?;
        assert_eq!((q.ratio, q.fidelity), (0.1, Fidelity::Exact));
        let out_of_range = QueryRequest {
            recompute_ratio: Some(1.5),
            ..bare
        };
        assert!(matches!(
            out_of_range.validate_with(server),
            Err(GatewayError::BadInput {
                field: "recompute_ratio",
                ..
            })
        ));
        Ok(())
    }

    #[test]
    fn every_collection_pattern_in_the_openapi_document_is_the_one_constant() {
        // utoipa takes only literals in attributes: this keeps the copies equal.
        let doc = crate::http::openapi_json_text();
        let copies = doc.matches("A-Za-z0-9._-").count();
        let exact = doc
            .matches(&COLLECTION_PATTERN.replace('\\', "\\\\"))
            .count();
        assert!(copies >= 3, "collection patterns in the document: {copies}");
        assert_eq!(
            copies, exact,
            "a collection pattern differs from COLLECTION_PATTERN"
        );
        for name in ["a", "docs-1.v2_x", &"c".repeat(128)] {
            assert!(validate_collection("c", name).is_ok(), "{name}");
        }
        for name in ["", "a/b", "é", &"c".repeat(129)] {
            assert!(validate_collection("c", name).is_err(), "{name}");
        }
    }

    #[test]
    fn document_titles_and_total_text_are_bounded() {
        let doc = |title: Option<String>, text: String| DocumentIn {
            id: "d".into(),
            title,
            text,
        };
        let req = |documents| DocumentsRequest {
            collection: None,
            chunk_tokens: None,
            documents,
            kv: None,
        };
        let field = |r: DocumentsRequest| match r.validate() {
            Err(GatewayError::BadInput { field, .. } | GatewayError::TooLarge { field, .. }) => {
                Some(field)
            }
            _ => None,
        };
        let long_title = Some("t".repeat(MAX_TITLE_CHARS + 1));
        assert_eq!(
            field(req(vec![doc(long_title, "x".into())])),
            Some("documents[].title")
        );
        assert_eq!(
            field(req(vec![doc(
                Some("t".repeat(MAX_TITLE_CHARS)),
                "x".into()
            )])),
            None
        );
        let half = "é".repeat(MAX_DOCUMENTS_TEXT_CHARS / 2);
        let mut two = vec![doc(None, half.clone()), doc(None, half.clone())];
        two[1].id = "e".into();
        assert_eq!(
            field(req(two.clone())),
            None,
            "exactly the limit, counted in characters"
        );
        two[1].text.push('!');
        assert_eq!(field(req(two.clone())), Some("documents[].text"));
        two[1].text = "x".into();
        two[0].text.push('!');
        assert!(
            matches!(req(two).validate(), Err(GatewayError::TooLarge { message, .. }) if message.contains("per document")),
            "one document over its own limit"
        );
    }

    #[test]
    fn every_limit_names_its_field() {
        let ok = QueryRequest {
            query: "what?".into(),
            ..Default::default()
        };
        let q = ok.validate().expect("valid");
        assert_eq!((q.top_k, q.max_tokens, q.ratio), (4, 128, 0.25));
        assert_eq!(q.method, Method::TargetProbeShift);
        let with = |change: fn(&mut QueryRequest)| {
            let mut r = ok.clone();
            change(&mut r);
            r
        };
        let cases: Vec<(QueryRequest, &str)> = vec![
            (with(|r| r.query = "  ".into()), "query"),
            (with(|r| r.query = "x".repeat(8193)), "query"),
            (with(|r| r.top_k = Some(0)), "top_k"),
            (with(|r| r.top_k = Some(257)), "top_k"),
            (
                with(|r| r.max_context_tokens = Some(0)),
                "max_context_tokens",
            ),
            (with(|r| r.method = Some("magic".into())), "method"),
            (with(|r| r.recompute_ratio = Some(1.5)), "recompute_ratio"),
            (
                with(|r| r.recompute_ratio = Some(f64::NAN)),
                "recompute_ratio",
            ),
            (with(|r| r.max_tokens = Some(0)), "max_tokens"),
            (with(|r| r.max_tokens = Some(1025)), "max_tokens"),
            (with(|r| r.temperature = Some(2.5)), "temperature"),
            (with(|r| r.seed = Some(MAX_SEED + 1)), "seed"),
            (with(|r| r.collection = Some("a b".into())), "collection"),
            (with(|r| r.collection = Some(String::new())), "collection"),
        ];
        for (r, field) in cases {
            assert_eq!(field_of(&r), Some(field), "{r:?}");
        }
        assert_eq!(
            QueryRequest {
                query: "x".repeat(8192),
                ..Default::default()
            }
            .validate()
            .map(|q| q.query.len())
            .ok(),
            Some(8192)
        );
    }

    /// Every integer field takes JSON's `32.0` as `32` (generated clients send either),
    /// `max_context_tokens` too.
    #[test]
    fn integer_fields_take_whole_floats() -> Result<()> {
        let q: QueryRequest = serde_json::from_str(
            r#"{"query":"q","top_k":4.0,"max_tokens":32.0,"seed":7.0,"logprobs":2.0,
                "max_context_tokens":4096.0}"#,
        )
        .map_err(|e| GatewayError::bad("body", e.to_string()))?;
        assert_eq!(
            (
                q.top_k,
                q.max_tokens,
                q.seed,
                q.logprobs,
                q.max_context_tokens
            ),
            (Some(4), Some(32), Some(7), Some(2), Some(4096))
        );
        let e = serde_json::from_str::<QueryRequest>(r#"{"query":"q","max_context_tokens":1.5}"#)
            .expect_err("a fraction");
        assert!(e.to_string().contains("non-negative integer"), "{e}");
        Ok(())
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let e = serde_json::from_str::<QueryRequest>(r#"{"query":"q","topk":3}"#)
            .expect_err("unknown field");
        assert!(e.to_string().contains("unknown field `topk`"), "{e}");
    }
}
