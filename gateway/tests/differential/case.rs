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
    /// The method and `recompute_ratio` its reused answers send; `None`: the request leaves
    /// them (and `fidelity` where it is `balanced`) out, so the server's defaults apply, the
    /// road most requests take.
    pub reuse: Option<(&'static str, f64)>,
    /// What drafts when `spec_decode` is on.
    pub spec_draft: &'static str,
}

impl Question {
    /// A question whose reused answers take the server's default method and ρ.
    pub const fn default_reuse(text: &'static str, spec_draft: &'static str) -> Self {
        Self {
            text,
            reuse: None,
            spec_draft,
        }
    }

    /// A question whose reused answers take `method` at `ratio` (0: reuse differs most).
    pub const fn forced(
        text: &'static str,
        method: &'static str,
        ratio: f64,
        spec_draft: &'static str,
    ) -> Self {
        Self {
            text,
            reuse: Some((method, ratio)),
            spec_draft,
        }
    }
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
        let mut rag = json!({
            "top_k": top_k,
            "spec_decode": self.spec,
        });
        match (self.full, q.reuse) {
            (true, _) => rag["method"] = json!("full_recompute"),
            (false, Some((method, ratio))) => {
                rag["method"] = json!(method);
                rag["recompute_ratio"] = json!(ratio);
            }
            (false, None) => {}
        }
        if self.full || q.reuse.is_some() || self.fidelity != Fidelity::Balanced {
            rag["fidelity"] = json!(self.fidelity);
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
    /// The fidelity guard took a second look (`reuse.guard.second_look`).
    pub second_look: bool,
    /// Streamed: the stream as its client saw it.
    pub shown: Option<Shown>,
    /// Streamed `/rag/query`: the `done` event's answer.
    pub done_answer: Option<String>,
}

/// Sends requests to one server, each request once (a request asked again, by the same
/// options or by other options that make the same body, such as the full-recompute reference
/// of two questions of one text, is answered from what came back the first time).
pub struct Runner<'a> {
    state: &'a AppState,
    questions: &'a [Question],
    top_k: u64,
    /// By run, route and body.
    seen: HashMap<(u8, Route, String), Outcome>,
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

    /// Question `i` of the fixture.
    pub fn question(&self, i: usize) -> &Question {
        &self.questions[i]
    }

    /// Answers `o` with `got` from now on instead of asking the server (the harness's own
    /// tests: a failure the server would not give).
    pub fn answer_with(&mut self, o: &Opts, got: Outcome) {
        let key = self.key(o);
        self.seen.insert(key, got);
    }

    /// What tells `o`'s request apart: its run, route and body.
    fn key(&self, o: &Opts) -> (u8, Route, String) {
        let body = o.body(&self.questions[o.question], self.top_k).to_string();
        (o.run, o.route, body)
    }

    /// Requests sent so far.
    pub fn requests(&self) -> usize {
        self.seen.len()
    }

    /// What `o` answers.
    pub async fn ask(&mut self, o: &Opts) -> Outcome {
        let key = self.key(o);
        if let Some(got) = self.seen.get(&key) {
            return got.clone();
        }
        let got = self.send(o, &key.2).await;
        self.seen.insert(key, got.clone());
        got
    }

    async fn send(&self, o: &Opts, body: &str) -> Outcome {
        let path = match o.route {
            Route::Rag => "/rag/query",
            Route::OpenAi => "/v1/chat/completions",
        };
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
                    second_look: last["reuse"]["guard"]["second_look"] == true,
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
                    second_look: last["specrag"]["reuse"]["guard"]["second_look"] == true,
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
        second_look: rag["reuse"]["guard"]["second_look"] == true,
        ..Default::default()
    }
}
