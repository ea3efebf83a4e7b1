//! Generation on top of the forward pass: full prefill, incremental decode, sampling,
//! end-of-generation tokens and stop strings, and the prompt in the model's chat format.

use crate::decode::logprobs::TokenLogprobs;
use crate::decode::stream::{Flow, Shown, TextStream};
use crate::engine::Engine;
use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::model::Model;
use crate::sampling::{Sampler, SamplingParams};
use crate::tokenizer::Tokenizer;
use std::time::Instant;

/// Default system message of the chat template (the one llama.cpp's fixtures use).
pub const DEFAULT_SYSTEM: &str = "You are a helpful assistant.";

/// A prefilled cache to decode from, and the next-token logits of its last position.
pub struct Prefilled<'a> {
    /// The cache, filled through the prompt's last position.
    pub cache: &'a mut KvCache,
    /// The logits at the prompt's last position.
    pub logits: Vec<f32>,
}

/// A cache filled through a prompt and the logits at its last position, owned: what a
/// prefill returns and what verification drafts on or checks against.
#[derive(Debug, Clone)]
pub struct FilledCache<C = KvCache> {
    pub cache: C,
    pub logits: Vec<f32>,
}

impl<C> From<(C, Vec<f32>)> for FilledCache<C> {
    /// What [`Model::prefill`](crate::Model::prefill) returns.
    fn from(prefill: (C, Vec<f32>)) -> Self {
        Self {
            cache: prefill.0,
            logits: prefill.1,
        }
    }
}

/// Generation settings.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops when the text contains any of these; the stop string is cut off.
    pub stop: Vec<String>,
    /// Record each token's logprob and this many most likely alternatives
    /// ([`Generation::logprobs`]); `None`: record nothing (no cost).
    pub logprobs: Option<usize>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            max_tokens: 128,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            logprobs: None,
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-generation token was produced.
    Eos,
    /// A stop string appeared.
    Stop,
    /// `max_tokens` were produced.
    Length,
    /// The consumer of the stream stopped it.
    Cancelled,
}

/// The result of one generation.
#[derive(Debug, Clone)]
pub struct Generation {
    /// Generated ids (an end-of-generation token included when one ended it).
    pub ids: Vec<u32>,
    /// Generated text without control tokens, cut before a stop string.
    pub text: String,
    pub prefill_ms: f64,
    /// Mean time of one decode step (0 when nothing was decoded).
    pub decode_ms_per_token: f64,
    pub finish: FinishReason,
    /// Per generated token, the gap between the two largest logits of the distribution it
    /// was chosen from ([`top2_gap`]): how far the model was from choosing another token.
    /// Empty where the tokens were not decoded one by one (verification, escalation).
    pub margins: Vec<f32>,
    /// Per generated token, its logprob and the most likely tokens at its position, from
    /// the row that chose it, where [`GenerateParams::logprobs`] asked (else empty).
    pub logprobs: Vec<TokenLogprobs>,
}

/// What a watched token was chosen from (see [`Generate::decode_watched`]): the row's
/// [`top2_gap`], and its rival, the one of the row's two most likely tokens that was not
/// chosen (the runner-up under greedy decoding; `None` in a row of fewer than two).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pick {
    pub gap: f32,
    pub rival: Option<u32>,
}

impl Pick {
    /// The pick of `id` from `row`.
    pub fn of(id: u32, row: &[f32]) -> Self {
        let [(first, a), (second, b)] = top2(row);
        let rival = match (first, second) {
            (Some(f), Some(s)) => Some(if f as u32 == id { s } else { f } as u32),
            _ => None,
        };
        Self {
            gap: gap_between(a, b),
            rival,
        }
    }
}

/// A token on its way out and what it was chosen from: the row's top-2 gap and rival and,
/// where asked, the token's logprobs.
#[derive(Debug, Clone)]
pub(crate) struct Chosen {
    pub(crate) id: u32,
    pub(crate) pick: Pick,
    pub(crate) logprobs: Option<TokenLogprobs>,
}

impl Chosen {
    /// `id`, chosen from `row`, with the `k` alternatives [`GenerateParams::logprobs`] asks.
    pub(crate) fn from_row(id: u32, row: &[f32], k: Option<usize>) -> Self {
        Self {
            id,
            pick: Pick::of(id, row),
            logprobs: k.map(|k| TokenLogprobs::of(row, id, k)),
        }
    }
}

/// The gap between the largest and second largest logit (0 with fewer than two): the
/// smallest change to the logits that would make greedy decoding choose another token.
pub fn top2_gap(logits: &[f32]) -> f32 {
    let [(_, first), (_, second)] = top2(logits);
    gap_between(first, second)
}

/// The row's two largest logits, largest first, each with its index (`None` and -inf where
/// the row has no finite one; the first of equal logits comes first, as greedy chooses it).
fn top2(row: &[f32]) -> [(Option<usize>, f32); 2] {
    let (mut first, mut second) = ((None, f32::NEG_INFINITY), (None, f32::NEG_INFINITY));
    for (i, &x) in row.iter().enumerate() {
        if x > first.1 {
            second = first;
            first = (Some(i), x);
        } else if x > second.1 {
            second = (Some(i), x);
        }
    }
    [first, second]
}

/// `first - second`, or 0 unless both are finite.
fn gap_between(first: f32, second: f32) -> f32 {
    if second.is_finite() && first.is_finite() {
        first - second
    } else {
        0.0
    }
}

/// Prompt ids for one user turn in the model's chat format (its file's template, or ChatML):
/// role headers and control tokens are parsed as special tokens, message contents never are
/// (a document containing `<|im_start|>` stays text).
pub fn chat_prompt(model: &Model, system: Option<&str>, user: &str) -> Vec<u32> {
    model.chat().prompt(model.tokenizer(), system, user)
}

/// Ids of a raw prompt: special tokens parsed, BOS added when the model asks for it.
pub fn raw_prompt(tok: &Tokenizer, text: &str) -> Vec<u32> {
    let mut ids = Vec::new();
    if tok.add_bos() {
        ids.extend(tok.bos());
    }
    ids.extend(tok.encode(text, true).ids);
    ids
}

/// Plain decoding: greedy or sampled, one token per step, watched and streamed, on any
/// [`Engine`] (the CPU engine's steps batched with other requests' where the server installed
/// a batcher).
pub trait Generate: Engine {
    /// Prefills `prompt` and decodes up to `params.max_tokens` tokens.
    fn generate(&self, prompt: &[u32], params: &GenerateParams) -> Result<Generation>;

    /// Continues generation from a filled cache and the logits of its last position.
    fn decode_from(
        &self,
        cache: &mut Self::Cache,
        logits: Vec<f32>,
        prefill_ms: f64,
        params: &GenerateParams,
    ) -> Result<Generation>;

    /// [`Generate::decode_from`], calling `on_text` with each new piece of text as soon as it is
    /// complete (a token that ends inside a multi-byte character waits for the next one).
    /// Returning `false` from `on_text` stops generation (a client that went away); the
    /// generation then ends with [`FinishReason::Cancelled`].
    fn decode_stream(
        &self,
        cache: &mut Self::Cache,
        logits: Vec<f32>,
        prefill_ms: f64,
        params: &GenerateParams,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<Generation>;

    /// [`Generate::decode_stream`] that asks `watch` after every generated token whether to stop
    /// there, showing it the ids so far and the [`Pick`] the last one was (the [`top2_gap`] of
    /// its distribution and the rival it beat); when it says so, generation ends before that
    /// token's text is handed out and the second value is `true` (the caller takes over, e.g.
    /// the fidelity guard moving to the full cache). The ids include the token that made `watch` stop. The
    /// generation's `prefill_ms` is 0: the caller timed its prefill.
    fn decode_watched(
        &self,
        cache: &mut Self::Cache,
        logits: Vec<f32>,
        params: &GenerateParams,
        on_text: &mut dyn FnMut(&str) -> bool,
        watch: &mut dyn FnMut(&[u32], Pick) -> bool,
    ) -> Result<(Generation, bool)>;
}

impl<E: Engine + 'static> Generate for E
where
    E::Cache: 'static,
{
    fn generate(&self, prompt: &[u32], params: &GenerateParams) -> Result<Generation> {
        if prompt.is_empty() {
            return Err(EngineError::InvalidInput("prompt is empty".into()));
        }
        let t0 = Instant::now();
        let (mut cache, logits) = self.prefill_into(prompt, prompt.len())?;
        let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        self.decode_from(&mut cache, logits, prefill_ms, params)
    }

    fn decode_from(
        &self,
        cache: &mut E::Cache,
        logits: Vec<f32>,
        prefill_ms: f64,
        params: &GenerateParams,
    ) -> Result<Generation> {
        self.decode_stream(cache, logits, prefill_ms, params, &mut |_| true)
    }

    fn decode_stream(
        &self,
        cache: &mut E::Cache,
        logits: Vec<f32>,
        prefill_ms: f64,
        params: &GenerateParams,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<Generation> {
        let (mut g, _) = self.decode_watched(cache, logits, params, on_text, &mut |_, _| false)?;
        g.prefill_ms = prefill_ms;
        Ok(g)
    }

    fn decode_watched(
        &self,
        cache: &mut E::Cache,
        mut logits: Vec<f32>,
        params: &GenerateParams,
        on_text: &mut dyn FnMut(&str) -> bool,
        watch: &mut dyn FnMut(&[u32], Pick) -> bool,
    ) -> Result<(Generation, bool)> {
        let sampler = Sampler::new(params.sampling);
        let mut emit = Emit::new(Engine::tokenizer(self), params, on_text, watch);
        self.reserve_cache(cache, params.max_tokens)?;
        let t0 = Instant::now();
        let mut steps = 0usize;
        // Steps go through this thread's batcher, if the server installed one.
        let _seat = super::batch::seat_on(self);
        while !emit.ended() {
            let next = sampler.sample_at(&logits, emit.len());
            if emit.take(Chosen::from_row(next, &logits, params.logprobs)) {
                break;
            }
            logits = super::batch::step_on(self, next, cache)?;
            steps += 1;
        }
        Ok(emit.finish(t0.elapsed().as_secs_f64() * 1e3, steps))
    }
}

/// Tokens on their way out of a decode, one at a time and in order, whatever produced them (a
/// decode step, or a verified run of drafted tokens): the watch asked, then the end token, the
/// stop strings and `max_tokens` checked, and the text handed out.
pub(crate) struct Emit<'a> {
    tok: &'a Tokenizer,
    params: &'a GenerateParams,
    on_text: &'a mut dyn FnMut(&str) -> bool,
    watch: &'a mut dyn FnMut(&[u32], Pick) -> bool,
    ids: Vec<u32>,
    margins: Vec<f32>,
    logprobs: Vec<TokenLogprobs>,
    finish: FinishReason,
    out: TextStream<'a>,
    watched: bool,
    done: bool,
}

impl<'a> Emit<'a> {
    pub(crate) fn new(
        tok: &'a Tokenizer,
        params: &'a GenerateParams,
        on_text: &'a mut dyn FnMut(&str) -> bool,
        watch: &'a mut dyn FnMut(&[u32], Pick) -> bool,
    ) -> Self {
        Self {
            tok,
            params,
            on_text,
            watch,
            ids: Vec::new(),
            margins: Vec::new(),
            logprobs: Vec::new(),
            finish: FinishReason::Length,
            out: TextStream::new(tok, &params.stop),
            watched: false,
            done: params.max_tokens == 0,
        }
    }

    /// True once generation has ended (nothing more is taken).
    pub(crate) fn ended(&self) -> bool {
        self.done
    }

    /// Tokens taken so far.
    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }

    /// The tokens taken so far.
    pub(crate) fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Takes the next token, with the [`top2_gap`] and logprobs of the distribution it was
    /// chosen from; true when generation ends with it.
    pub(crate) fn take(&mut self, chosen: Chosen) -> bool {
        if self.done {
            return true;
        }
        let Chosen { id, pick, logprobs } = chosen;
        self.ids.push(id);
        self.margins.push(pick.gap);
        self.logprobs.extend(logprobs);
        // Asked before the end is taken: ending the answer is a choice like any other.
        self.done = if (self.watch)(&self.ids, pick) {
            self.watched = true;
            true
        } else {
            let on_text = &mut *self.on_text;
            match self.out.commit(&[id], &mut |s| final_text(s, on_text)) {
                Flow::Stop => {
                    self.finish = FinishReason::Stop;
                    true
                }
                Flow::Cancel => {
                    self.finish = FinishReason::Cancelled;
                    true
                }
                Flow::Go if self.tok.is_end_of_generation(id) => {
                    self.finish = FinishReason::Eos;
                    true
                }
                Flow::Go => self.ids.len() == self.params.max_tokens,
            }
        };
        self.done
    }

    /// The generation (`prefill_ms` 0), and whether the watch stopped it.
    pub(crate) fn finish(mut self, decode_ms: f64, steps: usize) -> (Generation, bool) {
        if !self.watched {
            let on_text = &mut *self.on_text;
            if self.out.finish(&mut |s| final_text(s, on_text)) == Flow::Cancel {
                self.finish = FinishReason::Cancelled;
            }
        }
        if self.finish == FinishReason::Stop {
            // The tokens after the one that completed the stop string never happened.
            self.ids.truncate(self.out.ids().len());
            self.margins.truncate(self.ids.len());
            self.logprobs.truncate(self.ids.len());
        }
        let g = Generation {
            text: self.out.text(),
            ids: self.ids,
            prefill_ms: 0.0,
            decode_ms_per_token: if steps > 0 {
                decode_ms / steps as f64
            } else {
                0.0
            },
            finish: self.finish,
            margins: self.margins,
            logprobs: self.logprobs,
        };
        (g, self.watched)
    }
}

/// Hands final text to a consumer of final text only (what one token at a time produces:
/// never a draft, never a withdrawal).
fn final_text(s: Shown<'_>, on_text: &mut dyn FnMut(&str) -> bool) -> bool {
    match s {
        Shown::Final(t) => on_text(t),
        Shown::Draft(_) | Shown::Retract(_) | Shown::Replace(_) => {
            debug_assert!(false, "one token at a time shows only final text: {s:?}");
            true
        }
    }
}

/// Cuts `text` before the first occurrence of any non-empty string of `stop`; whether it did.
pub fn cut_at_stop(text: &mut String, stop: &[String]) -> bool {
    let at = stop
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()))
        .min();
    if let Some(at) = at {
        text.truncate(at);
    }
    at.is_some()
}

#[cfg(test)]
mod tests {
    use super::{top2_gap, Pick};

    #[test]
    fn the_top2_gap_is_what_separates_greedy_from_the_runner_up() {
        assert_eq!(top2_gap(&[1.0, 3.5, -2.0, 3.0]), 0.5);
        assert_eq!(top2_gap(&[2.0, 2.0]), 0.0);
        assert_eq!(top2_gap(&[5.0]), 0.0);
        assert_eq!(top2_gap(&[]), 0.0);
    }

    #[test]
    fn a_picks_rival_is_the_other_of_its_rows_top_two() {
        let row = [1.0, 3.5, -2.0, 3.0];
        assert_eq!(
            Pick::of(1, &row),
            Pick {
                gap: 0.5,
                rival: Some(3)
            },
            "greedy"
        );
        assert_eq!(
            Pick::of(3, &row).rival,
            Some(1),
            "sampled: the runner-up chosen"
        );
        assert_eq!(
            Pick::of(0, &row).rival,
            Some(1),
            "sampled outside the top two"
        );
        // A tie keeps the first of the two as the most likely, as greedy decoding does.
        assert_eq!(Pick::of(0, &[2.0, 2.0]).rival, Some(1));
        assert_eq!(
            Pick::of(0, &[5.0]),
            Pick {
                gap: 0.0,
                rival: None
            }
        );
    }
}
