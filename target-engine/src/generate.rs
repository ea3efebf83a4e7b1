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
        let (g, _) =
            self.decode_watched(cache, logits, prefill_ms, params, on_text, &mut |_| false)?;
        Ok(g)
    }

    /// [`Model::decode_stream`] that asks `watch` after every generated token whether to stop
    /// there; when it says so, generation ends before that token's text is handed out and the
    /// second value is `true` (the caller takes over, e.g. the fidelity guard moving to the
    /// full cache). The ids include the token that made `watch` stop.
    pub fn decode_watched(
        &self,
        cache: &mut KvCache,
        mut logits: Vec<f32>,
        prefill_ms: f64,
        params: &GenerateParams,
        on_text: &mut dyn FnMut(&str) -> bool,
        watch: &mut dyn FnMut(&[u32]) -> bool,
    ) -> Result<(Generation, bool)> {
        let mut watched = false;
        let tok = self.tokenizer();
        let mut sampler = Sampler::new(params.sampling);
        let mut ids = Vec::new();
        let mut finish = FinishReason::Length;
        let mut text = String::new();
        // Bytes of `text` already handed to `on_text`.
        let mut sent = 0usize;
        // Longest stop string: text within that distance of the end may still become one.
        let hold = params.stop.iter().map(|s| s.len()).max().unwrap_or(0);
        let t0 = Instant::now();
        let mut steps = 0usize;
        while ids.len() < params.max_tokens {
            let next = sampler.sample(&logits);
            ids.push(next);
            if tok.is_end_of_generation(next) {
                finish = FinishReason::Eos;
                break;
            }
            if watch(&ids) {
                watched = true;
                break;
            }
            text = tok.decode(&ids, false);
            if cut_at_stop(&mut text, &params.stop) {
                finish = FinishReason::Stop;
                break;
            }
            if !text.ends_with('\u{FFFD}') {
                let mut upto = text.len().saturating_sub(hold);
                while !text.is_char_boundary(upto) {
                    upto -= 1;
                }
                if upto > sent {
                    if !on_text(&text[sent..upto]) {
                        finish = FinishReason::Cancelled;
                        break;
                    }
                    sent = upto;
                }
            }
            if ids.len() == params.max_tokens {
                break;
            }
            let pos = cache.len();
            let out = self.forward(&[next], &[pos], cache, false)?;
            logits = self.last_logits(&out)?;
            steps += 1;
        }
        if finish == FinishReason::Eos {
            text = tok.decode(&ids, false);
        }
        if !watched
            && finish != FinishReason::Cancelled
            && text.len() > sent
            && text.is_char_boundary(sent)
        {
            on_text(&text[sent..]);
        }
        let decode_ms = t0.elapsed().as_secs_f64() * 1e3;
        let g = Generation {
            ids,
            text,
            prefill_ms,
            decode_ms_per_token: if steps > 0 {
                decode_ms / steps as f64
            } else {
                0.0
            },
            finish,
        };
        Ok((g, watched))
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
