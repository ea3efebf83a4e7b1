//! Generation on top of the forward pass: full prefill, incremental decode, sampling,
//! end-of-generation tokens and stop strings, and the ChatML template of the instruct models.

use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::model::Model;
use crate::sampling::{Sampler, SamplingParams};
use crate::tokenizer::Tokenizer;
use std::time::Instant;

/// Default system message of the chat template (the one llama.cpp's fixtures use).
pub const DEFAULT_SYSTEM: &str = "You are a helpful assistant.";

/// Generation settings.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops when the text contains any of these; the stop string is cut off.
    pub stop: Vec<String>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            max_tokens: 128,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
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
}

/// The gap between the largest and second largest logit (0 with fewer than two): the
/// smallest change to the logits that would make greedy decoding choose another token.
pub fn top2_gap(logits: &[f32]) -> f32 {
    let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in logits {
        if x > first {
            second = first;
            first = x;
        } else if x > second {
            second = x;
        }
    }
    if second.is_finite() && first.is_finite() {
        first - second
    } else {
        0.0
    }
}

/// ChatML prompt ids for one user turn: role headers and control tokens are parsed as
/// special tokens, message contents never are (a document containing `<|im_start|>` stays text).
pub fn chat_prompt(tok: &Tokenizer, system: Option<&str>, user: &str) -> Vec<u32> {
    let mut ids = Vec::new();
    if tok.add_bos() {
        ids.extend(tok.bos());
    }
    let mut turn = |role: &str, content: &str| {
        ids.extend(tok.encode(&format!("<|im_start|>{role}\n"), true).ids);
        ids.extend(tok.encode(content, false).ids);
        ids.extend(tok.encode("<|im_end|>\n", true).ids);
    };
    if let Some(s) = system {
        turn("system", s);
    }
    turn("user", user);
    ids.extend(tok.encode("<|im_start|>assistant\n", true).ids);
    ids
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

impl Model {
    /// Prefills `prompt` and decodes up to `params.max_tokens` tokens.
    pub fn generate(&self, prompt: &[u32], params: &GenerateParams) -> Result<Generation> {
        if prompt.is_empty() {
            return Err(EngineError::InvalidInput("prompt is empty".into()));
        }
        let t0 = Instant::now();
        let (mut cache, logits) = self.prefill(prompt)?;
        let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        self.decode_from(&mut cache, logits, prefill_ms, params)
    }

    /// Continues generation from a filled cache and the logits of its last position.
    pub fn decode_from(
        &self,
        cache: &mut KvCache,
        logits: Vec<f32>,
        prefill_ms: f64,
        params: &GenerateParams,
    ) -> Result<Generation> {
        self.decode_stream(cache, logits, prefill_ms, params, &mut |_| true)
    }

    /// [`Model::decode_from`], calling `on_text` with each new piece of text as soon as it is
    /// complete (a token that ends inside a multi-byte character waits for the next one).
    /// Returning `false` from `on_text` stops generation (a client that went away); the
    /// generation then ends with [`FinishReason::Cancelled`].
    pub fn decode_stream(
        &self,
        cache: &mut KvCache,
        logits: Vec<f32>,
        prefill_ms: f64,
        params: &GenerateParams,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<Generation> {
        let (mut g, _) = self.decode_watched(cache, logits, params, on_text, &mut |_, _| false)?;
        g.prefill_ms = prefill_ms;
        Ok(g)
    }

    /// [`Model::decode_stream`] that asks `watch` after every generated token whether to stop
    /// there, showing it the ids so far and the [`top2_gap`] of the distribution the last one
    /// was chosen from; when it says so, generation ends before that token's text is handed
    /// out and the second value is `true` (the caller takes over, e.g. the fidelity guard
    /// moving to the full cache). The ids include the token that made `watch` stop. The
    /// generation's `prefill_ms` is 0: the caller timed its prefill.
    pub fn decode_watched(
        &self,
        cache: &mut KvCache,
        mut logits: Vec<f32>,
        params: &GenerateParams,
        on_text: &mut dyn FnMut(&str) -> bool,
        watch: &mut dyn FnMut(&[u32], f32) -> bool,
    ) -> Result<(Generation, bool)> {
        let mut watched = false;
        let tok = self.tokenizer();
        let mut sampler = Sampler::new(params.sampling);
        let mut ids = Vec::new();
        let mut margins = Vec::new();
        let mut finish = FinishReason::Length;
        let mut out = Streamed::new(&params.stop);
        let t0 = Instant::now();
        let mut steps = 0usize;
        while ids.len() < params.max_tokens {
            let next = sampler.sample(&logits);
            ids.push(next);
            margins.push(top2_gap(&logits));
            // Asked before the end is taken: ending the answer is a choice like any other.
            if watch(&ids, margins[margins.len() - 1]) {
                watched = true;
                break;
            }
            if tok.is_end_of_generation(next) {
                finish = FinishReason::Eos;
                break;
            }
            if let Some(end) = out.update(tok.decode(&ids, false), &params.stop, on_text) {
                finish = end;
                break;
            }
            if ids.len() == params.max_tokens {
                break;
            }
            let pos = cache.len();
            let forward = self.forward(&[next], &[pos], cache, false)?;
            logits = self.last_logits(&forward)?;
            steps += 1;
        }
        if finish == FinishReason::Eos {
            out.text = tok.decode(&ids, false);
        }
        if !watched && finish != FinishReason::Cancelled {
            out.flush(on_text);
        }
        let text = out.text;
        let decode_ms = t0.elapsed().as_secs_f64() * 1e3;
        let g = Generation {
            ids,
            text,
            prefill_ms: 0.0,
            decode_ms_per_token: if steps > 0 {
                decode_ms / steps as f64
            } else {
                0.0
            },
            finish,
            margins,
        };
        Ok((g, watched))
    }
}

/// A generation's text as it is handed out: held back while it may still become a stop string
/// or ends inside a character, and cut at a stop string.
struct Streamed {
    text: String,
    /// Bytes of `text` already handed out.
    sent: usize,
    /// Longest stop string: text within that distance of the end may still become one.
    hold: usize,
}

impl Streamed {
    fn new(stop: &[String]) -> Self {
        Self {
            text: String::new(),
            sent: 0,
            hold: stop.iter().map(|s| s.len()).max().unwrap_or(0),
        }
    }

    /// Takes the text after a new token and hands out what is final; `Stop` when the text
    /// reached a stop string (cut before it), `Cancelled` when the consumer said stop.
    fn update(
        &mut self,
        text: String,
        stop: &[String],
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Option<FinishReason> {
        self.text = text;
        if cut_at_stop(&mut self.text, stop) {
            return Some(FinishReason::Stop);
        }
        if self.text.ends_with('\u{FFFD}') {
            return None;
        }
        let mut upto = self.text.len().saturating_sub(self.hold);
        while !self.text.is_char_boundary(upto) {
            upto -= 1;
        }
        if upto > self.sent {
            if !on_text(&self.text[self.sent..upto]) {
                return Some(FinishReason::Cancelled);
            }
            self.sent = upto;
        }
        None
    }

    /// Hands out the rest.
    fn flush(&self, on_text: &mut dyn FnMut(&str) -> bool) {
        if self.text.len() > self.sent && self.text.is_char_boundary(self.sent) {
            on_text(&self.text[self.sent..]);
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
    use super::top2_gap;

    #[test]
    fn the_top2_gap_is_what_separates_greedy_from_the_runner_up() {
        assert_eq!(top2_gap(&[1.0, 3.5, -2.0, 3.0]), 0.5);
        assert_eq!(top2_gap(&[2.0, 2.0]), 0.0);
        assert_eq!(top2_gap(&[5.0]), 0.0);
        assert_eq!(top2_gap(&[]), 0.0);
    }
}
