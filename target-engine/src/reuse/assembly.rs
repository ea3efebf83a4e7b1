//! The assembled RAG prompt: template prefix + chunks + question, tracked as segments with
//! token and character boundaries. A chunk's ids are exactly the ids it was precomputed with;
//! nothing is re-tokenized across a segment boundary.

use crate::chat::ChatFormat;
use crate::model::Model;
use crate::tokenizer::Tokenizer;
use std::ops::Range;

/// What a segment of the prompt is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentKind {
    /// The template prefix, identical for every request (exact, cached once).
    Prefix,
    /// Retrieved chunk `i` (reused KV).
    Chunk(usize),
    /// The question and the answer prefix (always computed).
    Question,
}

/// One segment: its token range in `Assembly::ids` and character range in `Assembly::text`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub kind: SegmentKind,
    pub ids: Range<usize>,
    pub chars: Range<usize>,
}

/// A prompt built from segments.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Assembly {
    pub ids: Vec<u32>,
    pub text: String,
    pub segments: Vec<Segment>,
}

impl Assembly {
    /// Appends a segment of `text` tokenized as `ids`.
    pub fn push(&mut self, kind: SegmentKind, text: &str, ids: &[u32]) {
        let (i0, c0) = (self.ids.len(), self.text.chars().count());
        self.ids.extend_from_slice(ids);
        self.text.push_str(text);
        self.segments.push(Segment {
            kind,
            ids: i0..self.ids.len(),
            chars: c0..c0 + text.chars().count(),
        });
    }

    /// The text of `seg` (one of this assembly's segments).
    pub fn segment_text(&self, seg: &Segment) -> &str {
        let byte = |c: usize| {
            self.text
                .char_indices()
                .nth(c)
                .map_or(self.text.len(), |(b, _)| b)
        };
        &self.text[byte(seg.chars.start)..byte(seg.chars.end)]
    }

    /// Token positions of every chunk token, in order.
    pub fn chunk_positions(&self) -> Vec<usize> {
        self.positions(|k| matches!(k, SegmentKind::Chunk(_)))
    }

    /// Token positions of the question segment.
    pub fn question_positions(&self) -> Vec<usize> {
        self.positions(|k| k == SegmentKind::Question)
    }

    /// The token range of the prefix (empty when there is none).
    pub fn prefix_range(&self) -> Range<usize> {
        self.segments
            .iter()
            .find(|s| s.kind == SegmentKind::Prefix)
            .map_or(0..0, |s| s.ids.clone())
    }

    /// Chunk segments in order.
    pub fn chunks(&self) -> impl Iterator<Item = &Segment> {
        self.segments
            .iter()
            .filter(|s| matches!(s.kind, SegmentKind::Chunk(_)))
    }

    /// The text and token ids of `seg` as the prompt holds them (a chunk's segment text and
    /// ids are what its stored KV is keyed by: no second tokenization needed).
    pub fn segment(&self, seg: &Segment) -> (String, &[u32]) {
        let text = self
            .text
            .chars()
            .skip(seg.chars.start)
            .take(seg.chars.len())
            .collect();
        (text, &self.ids[seg.ids.clone()])
    }

    fn positions(&self, keep: impl Fn(SegmentKind) -> bool) -> Vec<usize> {
        self.segments
            .iter()
            .filter(|s| keep(s.kind))
            .flat_map(|s| s.ids.clone())
            .collect()
    }
}

/// The RAG prompt in a chat format: a system turn and the start of the user turn as the
/// prefix, each chunk as a document, then the question, the end of the user turn and the
/// generation prompt. The user turn's content is the documents and the question, so the whole
/// prompt is what the chat template renders for that system text and that content.
#[derive(Debug, Clone)]
pub struct RagTemplate {
    pub system: String,
    pub chat: ChatFormat,
}

impl Default for RagTemplate {
    /// ChatML (for a model, [`RagTemplate::for_model`]).
    fn default() -> Self {
        Self {
            system: "Answer the question using the documents.".into(),
            chat: ChatFormat::chatml(),
        }
    }
}

impl RagTemplate {
    /// The template in `model`'s chat format (its file's template, or ChatML).
    pub fn for_model(model: &Model) -> Self {
        Self::for_chat(model.chat())
    }

    /// The template in the chat format `chat` (the device engine's, which reads the file's
    /// template as [`Model::chat`] does).
    pub fn for_chat(chat: &crate::chat::ChatFormat) -> Self {
        Self {
            chat: chat.clone(),
            ..Self::default()
        }
    }

    /// Prefix text and ids (control tokens parsed, system message as plain text).
    pub fn prefix(&self, tok: &Tokenizer) -> (String, Vec<u32>) {
        let [head, tail, _] = &self.chat.with_system;
        let mut ids = self.chat.head_ids(tok, true);
        ids.extend(tok.encode(&self.system, false).ids);
        ids.extend(tok.encode(tail, true).ids);
        (format!("{head}{}{tail}", self.system), ids)
    }

    /// A chunk as it appears in the prompt (the unit that is precomputed).
    pub fn chunk(&self, tok: &Tokenizer, text: &str) -> (String, Vec<u32>) {
        let t = format!("Document: {}\n\n", text.trim());
        let ids = tok.encode(&t, false).ids;
        (t, ids)
    }

    /// The question segment: the question as plain text, then the assistant header.
    pub fn question(&self, tok: &Tokenizer, question: &str) -> (String, Vec<u32>) {
        self.question_with_context(tok, "", question)
    }

    /// The question segment with `context` (a client's instructions and earlier turns, as
    /// plain text: control tokens in it are not parsed) before the question. It sits after the
    /// chunks, so it never changes the prefix that chunk KV was precomputed after.
    pub fn question_with_context(
        &self,
        tok: &Tokenizer,
        context: &str,
        question: &str,
    ) -> (String, Vec<u32>) {
        let tail = self.chat.post(true);
        let context = context.trim();
        let text = if context.is_empty() {
            format!("Question: {}", question.trim())
        } else {
            format!("{context}\n\nQuestion: {}", question.trim())
        };
        let mut ids = tok.encode(&text, false).ids;
        ids.extend(tok.encode(tail, true).ids);
        (format!("{text}{tail}"), ids)
    }

    /// Assembles prefix, chunk texts and question.
    pub fn assemble(&self, tok: &Tokenizer, chunks: &[&str], question: &str) -> Assembly {
        self.assemble_with_context(tok, chunks, "", question)
    }

    /// [`RagTemplate::assemble`] with `context` before the question
    /// ([`RagTemplate::question_with_context`]).
    pub fn assemble_with_context(
        &self,
        tok: &Tokenizer,
        chunks: &[&str],
        context: &str,
        question: &str,
    ) -> Assembly {
        let mut a = Assembly::default();
        let (t, ids) = self.prefix(tok);
        a.push(SegmentKind::Prefix, &t, &ids);
        for (i, c) in chunks.iter().enumerate() {
            let (t, ids) = self.chunk(tok, c);
            a.push(SegmentKind::Chunk(i), &t, &ids);
        }
        let (t, ids) = self.question_with_context(tok, context, question);
        a.push(SegmentKind::Question, &t, &ids);
        a
    }
}
