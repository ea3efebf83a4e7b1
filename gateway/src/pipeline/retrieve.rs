//! The chunks a query reads: the passages it brings (cut as ingestion cuts documents), the
//! collection's best, or both, in the order they enter the prompt; and the refusal of a
//! prompt that does not fit the context.

use super::request::{ChunkOrder, Query};
use super::Pipeline;
use crate::error::{GatewayError, Result};

impl Pipeline {
    /// The chunks the prompt reads: the passages `q` brings, or the collection's `top_k` best
    /// (in document order when the options say so); and how many of them retrieval found.
    pub(super) fn hits(
        &self,
        q: &Query,
        order: ChunkOrder,
    ) -> Result<(Vec<retriever::Hit>, usize)> {
        let mut hits = if q.documents.is_empty() {
            self.corpus.index.search(&q.collection, &q.query, q.top_k)?
        } else {
            self.passage_hits(q)?
        };
        let mut found = if q.documents.is_empty() {
            hits.len()
        } else {
            0
        };
        if !q.documents.is_empty() && q.retrieve_too {
            let retrieved = self.corpus.index.search(&q.collection, &q.query, q.top_k)?;
            let read: std::collections::HashSet<String> =
                hits.iter().map(|h| h.record.key.clone()).collect();
            let before = hits.len();
            hits.extend(
                retrieved
                    .into_iter()
                    .filter(|h| !read.contains(&h.record.key)),
            );
            found = hits.len() - before;
        }
        arrange(&mut hits, order, !q.documents.is_empty());
        Ok((hits, found))
    }

    /// The chunks of the passages `q` brings, as retrieval hits in their order: each passage
    /// cut as ingestion cuts documents, so a passage sent again (in any order, beside any
    /// others) is the same chunks and its stored KV is found by content.
    fn passage_hits(&self, q: &Query) -> Result<Vec<retriever::Hit>> {
        let tok = self.engines.target.tokenizer();
        let encode = |text: &str| {
            let e = tok.encode(text, false);
            (e.ids, e.offsets)
        };
        let params = retriever::ChunkParams {
            max_tokens: crate::ingest::IngestConfig::default().chunk_tokens,
        };
        let mut hits = Vec::new();
        for (i, p) in q.documents.iter().enumerate() {
            let chunks = retriever::chunk_document(&p.id, &p.text, &encode, &params)
                .map_err(|e| GatewayError::bad("documents", format!("documents[{i}]: {e}")))?;
            for (position, c) in chunks.into_iter().enumerate() {
                let (_, ids) = self.engines.segment(&c.text);
                let key = self.engines.key(&q.collection, &ids);
                hits.push(retriever::Hit {
                    score: 0.0,
                    record: retriever::ChunkRecord {
                        chunk_id: key.to_string(),
                        doc_id: p.id.clone(),
                        collection: q.collection.clone(),
                        title: None,
                        text: c.text,
                        position,
                        key: key.to_string(),
                        tokens: c.ids.len(),
                    },
                });
            }
        }
        Ok(hits)
    }
}

/// Puts retrieval `hits` in `order` (see [`ChunkOrder`]); `passages`: the first hits are
/// passages a client sent, which keep their order.
fn arrange(hits: &mut [retriever::Hit], order: ChunkOrder, passages: bool) {
    match order {
        ChunkOrder::Rank => {}
        ChunkOrder::Document => hits.sort_by(|a, b| {
            (&a.record.doc_id, a.record.position).cmp(&(&b.record.doc_id, b.record.position))
        }),
        ChunkOrder::LongestFirst if !passages => {
            // The first of the longest, so that ties keep rank order.
            let longest = hits
                .iter()
                .enumerate()
                .rev()
                .max_by_key(|(_, h)| h.record.tokens)
                .map(|(i, _)| i);
            if let Some(i) = longest {
                hits[..=i].rotate_right(1);
            }
        }
        ChunkOrder::LongestFirst => {}
    }
}

/// The 422 of a prompt (`prompt` tokens with `chunks` chunks, `retrieved` of them from the
/// collection) that does not fit `context` with the answer: naming the query when no chunk was
/// read, `documents` when the chunks are the client's own passages (`top_k` does not apply to
/// them), `messages` when they are passages found in an OpenAI request's messages and
/// retrieval added none, `top_k` otherwise.
pub(super) fn too_long(
    q: &Query,
    prompt: usize,
    chunks: usize,
    retrieved: usize,
    context: usize,
) -> GatewayError {
    let max_tokens = q.max_tokens;
    if q.retrieve_too && !q.documents.is_empty() && retrieved == 0 {
        GatewayError::bad(
            "messages",
            format!(
                "the prompt ({prompt} tokens with {chunks} chunks of the {} passages found in \
                 the messages) plus max_tokens ({max_tokens}) exceeds the context limit of \
                 {context} tokens (max_context_tokens); send fewer or shorter passages, or \
                 lower max_tokens",
                q.documents.len()
            ),
        )
    } else if chunks == 0 {
        GatewayError::bad(
            "query",
            format!(
                "the prompt ({prompt} tokens, the question and no chunk) plus max_tokens \
                 ({max_tokens}) exceeds the context limit of {context} tokens \
                 (max_context_tokens); shorten the query"
            ),
        )
    } else if !q.documents.is_empty() && !q.retrieve_too {
        GatewayError::bad(
            "documents",
            format!(
                "the prompt ({prompt} tokens with {chunks} passages) plus max_tokens \
                 ({max_tokens}) exceeds the context limit of {context} tokens \
                 (max_context_tokens); send fewer or shorter passages, or lower max_tokens"
            ),
        )
    } else {
        let passages = if q.retrieve_too && !q.documents.is_empty() {
            format!(
                ", {} of them passages found in the messages",
                chunks - retrieved
            )
        } else {
            String::new()
        };
        GatewayError::bad(
            "top_k",
            format!(
                "the prompt ({prompt} tokens with {chunks} chunks{passages}) plus max_tokens \
                 ({max_tokens}) exceeds the context limit of {context} tokens \
                 (max_context_tokens); lower top_k or max_tokens"
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::Passage;

    fn hit(doc: &str, position: usize, tokens: usize) -> retriever::Hit {
        retriever::Hit {
            score: 0.0,
            record: retriever::ChunkRecord {
                chunk_id: format!("{doc}/{position}"),
                doc_id: doc.into(),
                collection: "c".into(),
                title: None,
                text: String::new(),
                position,
                key: format!("{doc}/{position}"),
                tokens,
            },
        }
    }

    /// Issue 88: a prompt of passages pasted into the messages that did not fit named
    /// `specrag.top_k`, which the client never sent; it names the messages now.
    #[test]
    fn an_over_long_prompt_names_what_filled_it() {
        let passage = |i: usize| Passage {
            id: format!("messages[0]:{i}"),
            text: "x".into(),
        };
        let pasted = Query {
            documents: (1..=3).map(passage).collect(),
            retrieve_too: true,
            ..Query::default()
        };
        let field = |q: &Query, (chunks, retrieved): (usize, usize)| match too_long(
            q, 900, chunks, retrieved, 512,
        )
        .fault()
        {
            crate::error::Fault::BadInput(f) => f,
            other => panic!("{other:?}"),
        };
        assert_eq!(field(&pasted, (3, 0)), Some("messages"));
        assert_eq!(field(&pasted, (5, 2)), Some("top_k"));
        let sent = Query {
            retrieve_too: false,
            ..pasted.clone()
        };
        assert_eq!(field(&sent, (3, 0)), Some("documents"));
        assert_eq!(field(&Query::default(), (4, 4)), Some("top_k"));
        assert_eq!(field(&Query::default(), (0, 0)), Some("query"));
    }

    fn ids(hits: &[retriever::Hit]) -> Vec<&str> {
        hits.iter().map(|h| h.record.chunk_id.as_str()).collect()
    }

    #[test]
    fn longest_first_moves_the_longest_chunk_ahead_and_keeps_the_rest_ranked() {
        let ranked = vec![
            hit("a", 0, 90),
            hit("b", 3, 300),
            hit("c", 1, 120),
            hit("d", 0, 300),
        ];
        let mut hits = ranked.clone();
        arrange(&mut hits, ChunkOrder::LongestFirst, false);
        // b and d tie at 300 tokens: the better ranked one goes first.
        assert_eq!(ids(&hits), ["b/3", "a/0", "c/1", "d/0"]);
        let mut hits = ranked.clone();
        arrange(&mut hits, ChunkOrder::LongestFirst, true);
        assert_eq!(
            ids(&hits),
            ids(&ranked),
            "a client's passages keep their order"
        );
        let mut hits = ranked.clone();
        arrange(&mut hits, ChunkOrder::Rank, false);
        assert_eq!(ids(&hits), ids(&ranked));
        let mut hits = ranked;
        arrange(&mut hits, ChunkOrder::Document, false);
        assert_eq!(ids(&hits), ["a/0", "b/3", "c/1", "d/0"]);
        let mut none: Vec<retriever::Hit> = Vec::new();
        arrange(&mut none, ChunkOrder::LongestFirst, false);
        assert!(none.is_empty());
    }
}
