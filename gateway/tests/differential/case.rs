//! One request of the matrix: its options, its body on either route, and what came back.

use crate::stream::{self, Shown};
use axum::body::Body;
use axum::http::Request;
use gateway::fidelity::Fidelity;
use gateway::http::{app, AppState};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::fmt;
use tower::ServiceExt;

/// Which API a request goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    Rag,
    OpenAi,
}

/// How tokens are chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Sampling {
    Greedy,
    /// [`TEMPERATURE`] with [`SEED`].
    Seeded,
}

/// Temperature of seeded requests.
pub const TEMPERATURE: f64 = 0.9;
/// Seed of seeded requests.
pub const SEED: u64 = 7;

/// A question of a fixture, and how its answers reuse and draft.
#[derive(Debug, Clone, Copy)]
pub struct Question {
    pub text: &'static str,
    /// The method of its reused answers (`recompute_ratio` 0, so reuse differs most).
    pub method: &'static str,
    /// What drafts when `spec_decode` is on.
    pub spec_draft: &'static str,
}

/// The options of one request.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Opts {
    pub question: usize,
    pub route: Route,
    pub stream: bool,
    pub fidelity: Fidelity,
    pub spec: bool,
    pub sampling: Sampling,
    pub max_tokens: u64,
    /// One stop string (OpenAI only).
    pub stop: Option<String>,
    /// Full recompute (the reference answer) instead of the question's method.
    pub full: bool,
    /// Which run of the same request: a seeded request is asked twice.
    pub run: u8,
}

impl Opts {
    /// The same request, answered without streaming.
    pub fn plain(&self) -> Self {
        Self {
            stream: false,
            ..self.clone()
        }
    }

    /// What it is checked against: the same question, sampling, `max_tokens` and stop string
    /// answered by full recompute, unguarded, without drafting, not streamed.
    pub fn reference(&self) -> Self {
        Self {
            stream: false,
            fidelity: Fidelity::Fast,
            spec: false,
            full: true,
            run: 0,
            ..self.clone()
        }
    }

    fn body(&self, q: &Question, top_k: u64) -> Value {
        let method = if self.full {
            json!("full_recompute")
        } else {
            json!(q.method)
        };
        let mut rag = json!({
            "top_k": top_k,
            "method": method,
            "fidelity": self.fidelity,
            "spec_decode": self.spec,
        });
        if !self.full {
            rag["recompute_ratio"] = json!(0.0);
        }
        if self.spec {
            rag["spec_draft"] = json!(q.spec_draft);
        }
        let mut body = match self.route {
            Route::Rag => {
                rag["query"] = json!(q.text);
                rag["max_tokens"] = json!(self.max_tokens);
                rag["stream"] = json!(self.stream);
                rag
            }
            Route::OpenAi => {
                let mut chat = json!({
                    "model": "specrag",
                    "messages": [{"role": "user", "content": q.text}],
                    "max_tokens": self.max_tokens,
                    "stream": self.stream,
                    "specrag": rag,
                });
                if self.stream {
                    chat["stream_options"] = json!({"include_usage": true});
                }
                if let Some(stop) = &self.stop {
                    chat["stop"] = json!([stop]);
                }
                chat
            }
        };
        if self.sampling == Sampling::Seeded {
            body["temperature"] = json!(TEMPERATURE);
            body["seed"] = json!(SEED);
        }
        body
    }
}

impl fmt::Display for Opts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let route = match self.route {
            Route::Rag => "/rag/query",
            Route::OpenAi => "openai",
        };
        let sampling = match self.sampling {
            Sampling::Greedy => "greedy".to_string(),
            Sampling::Seeded => format!("temperature {TEMPERATURE} seed {SEED}"),
        };
        write!(
            f,
            "[q{} {route} stream={} fidelity={} spec_decode={} {sampling} max_tokens={}",
            self.question,
            self.stream,
            self.fidelity.name(),
            self.spec,
            self.max_tokens
        )?;
        if let Some(stop) = &self.stop {
            write!(f, " stop={stop:?}")?;
        }
        if self.full {
            write!(f, " method=full_recompute")?;
        }
        if self.run > 0 {
            write!(f, " run {}", self.run + 1)?;
        }
        write!(f, "]")
    }
}

/// What one request answered.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub status: u16,
    /// The body when the status is not 200.
    pub error: String,
    /// The answer's text; streamed, the text the stream showed.
    pub text: String,
    /// `tokens` (`/rag/query`) or `usage.completion_tokens` (OpenAI).
    pub tokens: Option<u64>,
    pub finish: Option<String>,
    /// The fidelity guard moved the answer to the full cache.
    pub escalated: bool,
    /// Streamed: the stream as its client saw it.
    pub shown: Option<Shown>,
    /// Streamed `/rag/query`: the `done` event's answer.
    pub done_answer: Option<String>,
}

/// Sends requests to one server, each set of options once (a repeated question is answered
/// from what came back the first time).
pub struct Runner<'a> {
    state: &'a AppState,
    questions: &'a [Question],
    top_k: u64,
    seen: HashMap<Opts, Outcome>,
}

impl<'a> Runner<'a> {
    pub fn new(state: &'a AppState, questions: &'a [Question], top_k: u64) -> Self {
        Self {
            state,
            questions,
            top_k,
            seen: HashMap::new(),
        }
    }

    /// Requests sent so far.
    pub fn requests(&self) -> usize {
        self.seen.len()
    }

    /// What `o` answers.
    pub async fn ask(&mut self, o: &Opts) -> Outcome {
        if let Some(got) = self.seen.get(o) {
            return got.clone();
        }
        let got = self.send(o).await;
        self.seen.insert(o.clone(), got.clone());
        got
    }

    async fn send(&self, o: &Opts) -> Outcome {
        let path = match o.route {
            Route::Rag => "/rag/query",
            Route::OpenAi => "/v1/chat/completions",
        };
        let body = o.body(&self.questions[o.question], self.top_k);
        let req = Request::post(path)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .unwrap_or_default();
        let resp = app(self.state.clone())
            .oneshot(req)
            .await
            .unwrap_or_else(|e| match e {});
        let status = resp.status().as_u16();
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap_or_default();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        if status != 200 {
            return Outcome {
                status,
                error: text,
                ..Default::default()
            };
        }
        match (o.route, o.stream) {
            (route, false) => answered(route, &text),
            (Route::Rag, true) => {
                let shown = stream::rag(&text);
                let last = shown.last.clone().unwrap_or_default();
                Outcome {
                    status,
                    text: shown.text.clone(),
                    tokens: last["tokens"].as_u64(),
                    finish: last["finish_reason"].as_str().map(str::to_string),
                    escalated: last["reuse"]["guard"]["escalated"] == true,
                    done_answer: last["answer"].as_str().map(str::to_string),
                    shown: Some(shown),
                    ..Default::default()
                }
            }
            (Route::OpenAi, true) => {
                let shown = stream::openai(&text);
                let last = shown.last.clone().unwrap_or_default();
                Outcome {
                    status,
                    text: shown.text.clone(),
                    tokens: last["usage"]["completion_tokens"].as_u64(),
                    finish: last["choices"][0]["finish_reason"]
                        .as_str()
                        .map(str::to_string),
                    escalated: last["specrag"]["reuse"]["guard"]["escalated"] == true,
                    shown: Some(shown),
                    ..Default::default()
                }
            }
        }
    }
}

/// A non-streamed answer of `route`.
fn answered(route: Route, body: &str) -> Outcome {
    let v: Value = match serde_json::from_str(body) {
        Ok(v) => v,
        Err(e) => {
            return Outcome {
                error: format!("unreadable answer ({e}): {body}"),
                ..Default::default()
            }
        }
    };
    let (text, tokens, finish, rag) = match route {
        Route::Rag => (&v["answer"], &v["tokens"], &v["finish_reason"], &v),
        Route::OpenAi => (
            &v["choices"][0]["message"]["content"],
            &v["usage"]["completion_tokens"],
            &v["choices"][0]["finish_reason"],
            &v["specrag"],
        ),
    };
    Outcome {
        status: 200,
        text: text.as_str().unwrap_or_default().to_string(),
        tokens: tokens.as_u64(),
        finish: finish.as_str().map(str::to_string),
        escalated: rag["reuse"]["guard"]["escalated"] == true,
        ..Default::default()
    }
}
