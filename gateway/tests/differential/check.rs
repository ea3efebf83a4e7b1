//! The matrix walked and every promise checked for each combination of options.

use crate::case::{Opts, Outcome, Route, Runner, Sampling};
use gateway::fidelity::Fidelity;
use std::fmt::Write as _;

/// The option values a matrix combines, and which combinations it keeps.
pub struct Matrix {
    pub questions: usize,
    pub routes: Vec<Route>,
    pub fidelities: Vec<Fidelity>,
    pub specs: Vec<bool>,
    pub samplings: Vec<Sampling>,
    pub max_tokens: Vec<u64>,
    /// Whether a combination is run (every one on tiny models).
    pub keep: fn(&Opts) -> bool,
}

/// What walking a matrix found.
#[derive(Debug, Default)]
pub struct Report {
    /// Combinations of options run.
    pub cases: usize,
    /// One line per broken promise: the invariant, the options, what differed.
    pub failures: Vec<String>,
    /// Reused answers the guard moved to the full cache (not streamed), greedy and seeded.
    pub escalated: [usize; 2],
    /// Answers a stop string cut (not streamed).
    pub stop_cuts: usize,
    /// What the guard did, for the questions at the server's default method and ρ (`[0]`)
    /// and for those that force theirs (`[1]`).
    pub by_reuse: [Tally; 2],
    /// Requests sent (combinations, references, probes and repeats).
    pub requests: usize,
}

/// The combinations of one kind of question, and what the guard did on them.
#[derive(Debug, Default, Clone, Copy)]
pub struct Tally {
    /// Combinations run, streamed or not.
    pub cases: usize,
    /// Answers not streamed (each set of the other options once), and of them the
    /// `balanced` ones.
    pub answers: usize,
    pub balanced: usize,
    /// `balanced` answers (not streamed) where the guard took a second look.
    pub second_looks: usize,
    /// `balanced` answers (not streamed) the guard moved to the full cache, and of them
    /// those it moved after a second look.
    pub escalated: usize,
    pub looked_then_escalated: usize,
}

impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} combinations, {} answers not streamed, {} of them balanced: {} second looks, {} escalated ({} after a second look)",
            self.cases,
            self.answers,
            self.balanced,
            self.second_looks,
            self.escalated,
            self.looked_then_escalated
        )
    }
}

impl Report {
    fn fail(&mut self, invariant: &str, o: &Opts, detail: impl AsRef<str>) {
        self.failures
            .push(format!("({invariant}) {o}: {}", detail.as_ref()));
    }

    /// The failures, grouped by invariant, one per line.
    pub fn listing(&self) -> String {
        let mut sorted = self.failures.clone();
        sorted.sort();
        let mut out = String::new();
        for f in sorted {
            let _ = writeln!(out, "{f}");
        }
        out
    }
}

/// At most 100 characters of `s`, quoted.
fn short(s: &str) -> String {
    let cut: String = s.chars().take(100).collect();
    if cut.len() < s.len() {
        format!("{cut:?}...")
    } else {
        format!("{cut:?}")
    }
}

/// What `runner` answers `asked`, a request that checks a promise of `o` (its reference,
/// its probe, the same request again), or `None` after recording that it failed: a promise
/// that could not be checked is broken, never passed.
async fn ask_ok(
    runner: &mut Runner<'_>,
    o: &Opts,
    what: &str,
    asked: &Opts,
    r: &mut Report,
) -> Option<Outcome> {
    let got = runner.ask(asked).await;
    if got.status == 200 && got.error.is_empty() {
        return Some(got);
    }
    r.fail(
        "ref",
        o,
        format!(
            "{what} {asked} failed: status {}: {}",
            got.status,
            short(&got.error)
        ),
    );
    None
}

/// `text` cut before the first `stop`.
fn cut(text: &str, stop: &str) -> String {
    text.find(stop).map_or(text, |at| &text[..at]).to_string()
}

/// A stop string the answer `text` contains: a few characters from its middle (no U+FFFD),
/// so that the stopped request crosses the stop path.
pub fn stop_from(text: &str, len: usize) -> Option<String> {
    let chars: Vec<char> = text.chars().collect();
    for n in (1..=len).rev() {
        let starts = (chars.len() / 2..chars.len()).chain(0..chars.len() / 2);
        for i in starts {
            let Some(w) = chars.get(i..i + n) else {
                continue;
            };
            if !w.contains(&'\u{FFFD}') {
                return Some(w.iter().collect());
            }
        }
    }
    None
}

impl Matrix {
    /// Every combination of question, route, sampling, `max_tokens` and fidelity (not
    /// streamed, no drafting, no stop string): what the rest varies around.
    fn bases(&self) -> Vec<Opts> {
        let mut out = Vec::new();
        for question in 0..self.questions {
            for &route in &self.routes {
                for &sampling in &self.samplings {
                    for &max_tokens in &self.max_tokens {
                        for &fidelity in &self.fidelities {
                            out.push(Opts {
                                question,
                                route,
                                stream: false,
                                fidelity,
                                spec: false,
                                sampling,
                                max_tokens,
                                stop: None,
                                full: false,
                                run: 0,
                            });
                        }
                    }
                }
            }
        }
        out
    }
}

impl Matrix {
    /// Whether some combination of `base` with a stop string is kept (only then is the
    /// answer a stop string is taken from asked for).
    fn keeps_a_stop(&self, base: &Opts) -> bool {
        self.specs.iter().any(|&spec| {
            [false, true].into_iter().any(|stream| {
                (self.keep)(&Opts {
                    spec,
                    stream,
                    stop: Some(String::new()),
                    ..base.clone()
                })
            })
        })
    }
}

/// Runs every kept combination of `m` through `runner` and checks the promises; stop
/// strings of `stop_len` characters, taken from the answer of the same options unstopped.
pub async fn walk(runner: &mut Runner<'_>, m: &Matrix, stop_len: usize) -> Report {
    let mut r = Report::default();
    for base in m.bases() {
        let mut stops = vec![None];
        if base.route == Route::OpenAi && m.keeps_a_stop(&base) {
            let from = m
                .specs
                .iter()
                .map(|&spec| Opts {
                    spec,
                    ..base.clone()
                })
                .find(|o| (m.keep)(o))
                .unwrap_or_else(|| base.clone());
            if let Some(got) = ask_ok(runner, &from, "the unstopped answer", &from, &mut r).await {
                match stop_from(&got.text, stop_len) {
                    Some(s) => stops.push(Some(s)),
                    None => r.fail("d", &from, "no stop string to take from the answer"),
                }
            }
        }
        for stop in stops {
            for &spec in &m.specs {
                for stream in [false, true] {
                    let o = Opts {
                        spec,
                        stream,
                        stop: stop.clone(),
                        ..base.clone()
                    };
                    if (m.keep)(&o) {
                        r.cases += 1;
                        r.by_reuse[reuse_kind(runner, &o)].cases += 1;
                        check(runner, m, &o, &mut r).await;
                    }
                }
            }
        }
    }
    r.requests = runner.requests();
    r
}

/// 0 for a combination whose question takes the server's default method and ρ, 1 for one
/// that forces its own.
fn reuse_kind(runner: &Runner<'_>, o: &Opts) -> usize {
    usize::from(runner.question(o.question).reuse.is_some())
}

/// Counts what the guard did on the answer `got` of `o` (not streamed).
fn tally(runner: &Runner<'_>, o: &Opts, got: &Outcome, r: &mut Report) {
    let t = &mut r.by_reuse[reuse_kind(runner, o)];
    t.answers += 1;
    if o.fidelity != Fidelity::Balanced {
        return;
    }
    t.balanced += 1;
    t.second_looks += usize::from(got.second_look);
    t.escalated += usize::from(got.escalated);
    t.looked_then_escalated += usize::from(got.second_look && got.escalated);
}

/// Every promise that applies to the combination `o`.
async fn check(runner: &mut Runner<'_>, m: &Matrix, o: &Opts, r: &mut Report) {
    let got = runner.ask(o).await;
    if got.status != 200 || !got.error.is_empty() {
        r.fail("http", o, format!("status {}: {}", got.status, got.error));
        return;
    }
    if let Some(stop) = &o.stop {
        if got.text.contains(stop.as_str()) {
            r.fail(
                "d",
                o,
                format!("the answer contains the stop string: {}", short(&got.text)),
            );
        }
    }
    if o.stream {
        streamed(runner, o, &got, r).await;
        return;
    }
    tally(runner, o, &got, r);
    as_full_recompute(runner, o, &got, r).await;
    unchanged(runner, m, o, &got, r).await;
    if let Some(stop) = &o.stop {
        stopped(runner, o, stop, &got, r).await;
    }
}

/// (b) An `exact` answer, and a `balanced` one the guard escalated, is full recompute's.
async fn as_full_recompute(runner: &mut Runner<'_>, o: &Opts, got: &Outcome, r: &mut Report) {
    if o.fidelity == Fidelity::Exact || (o.fidelity == Fidelity::Balanced && got.escalated) {
        if o.fidelity == Fidelity::Balanced {
            r.escalated[usize::from(o.sampling == Sampling::Seeded)] += 1;
        }
        let Some(full) = ask_ok(runner, o, "its reference", &o.reference(), r).await else {
            return;
        };
        if got.text != full.text {
            let what = if o.fidelity == Fidelity::Exact {
                "the exact answer"
            } else {
                "the escalated answer"
            };
            r.fail(
                "b",
                o,
                format!(
                    "{what} {} is not full recompute's {}",
                    short(&got.text),
                    short(&full.text)
                ),
            );
        }
    }
}

/// (c) Drafting changes nothing, and a seeded request answers the same twice.
async fn unchanged(runner: &mut Runner<'_>, m: &Matrix, o: &Opts, got: &Outcome, r: &mut Report) {
    if o.spec {
        let off = Opts {
            spec: false,
            ..o.clone()
        };
        if (m.keep)(&off) {
            let plain = ask_ok(runner, o, "the same without drafting", &off, r).await;
            if let Some(plain) = plain.filter(|p| p.text != got.text) {
                r.fail(
                    "c",
                    o,
                    format!(
                        "with spec_decode {} but without {}",
                        short(&got.text),
                        short(&plain.text)
                    ),
                );
            }
        }
    }
    if o.sampling == Sampling::Seeded {
        let twice = Opts {
            run: 1,
            ..o.clone()
        };
        let again = ask_ok(runner, o, "the same again", &twice, r).await;
        if let Some(again) = again.filter(|a| a.text != got.text) {
            r.fail(
                "c",
                o,
                format!(
                    "the same seeded request answered {} then {}",
                    short(&got.text),
                    short(&again.text)
                ),
            );
        }
    }
}

/// A streamed combination: what its client shows is the answer, with the same usage and
/// finish, no U+FFFD the answer lacks, and at no moment its stop string.
async fn streamed(runner: &mut Runner<'_>, o: &Opts, got: &Outcome, r: &mut Report) {
    let Some(shown) = &got.shown else {
        r.fail("a", o, "no stream to read");
        return;
    };
    for e in &shown.errors {
        r.fail("a", o, e);
    }
    if let Some(stop) = &o.stop {
        for leak in shown.stop_leaks(stop) {
            r.fail("d", o, format!("the stream showed the stop string: {leak}"));
        }
    }
    if let Some(done) = &got.done_answer {
        if *done != shown.text {
            r.fail(
                "a",
                o,
                format!(
                    "the stream shows {} but its `done` event answers {}",
                    short(&shown.text),
                    short(done)
                ),
            );
        }
    }
    let plain = ask_ok(runner, o, "the same not streamed", &o.plain(), r).await;
    if let Some(plain) = &plain {
        if plain.text != got.text {
            r.fail(
                "a",
                o,
                format!(
                    "streamed {} but answered {}",
                    short(&got.text),
                    short(&plain.text)
                ),
            );
        }
        if (plain.tokens, &plain.finish) != (got.tokens, &got.finish) {
            r.fail(
                "a",
                o,
                format!(
                    "streamed {:?} tokens, finish {:?}, but answered {:?} tokens, finish {:?}",
                    got.tokens, got.finish, plain.tokens, plain.finish
                ),
            );
        }
    }
    // The answer: the `done` event's, else the non-streamed one.
    let answer = match (&got.done_answer, &plain) {
        (Some(done), _) => done.as_str(),
        (None, Some(plain)) => plain.text.as_str(),
        (None, None) => shown.text.as_str(),
    };
    let bad = shown.replacement_chars(answer);
    if let Some(first) = bad.first() {
        r.fail(
            "e",
            o,
            format!(
                "U+FFFD streamed in {} pieces where the answer {} has none, the first {first}",
                bad.len(),
                short(answer)
            ),
        );
    }
}

/// A stop string cut the answer at the token that completed it, `usage` counts the tokens up
/// to that one, and `finish_reason` is `stop`. The count is checked by asking the same request
/// without the stop string for as many tokens (its text must reach the stop string) and for
/// one fewer (its text must not).
async fn stopped(runner: &mut Runner<'_>, o: &Opts, stop: &str, got: &Outcome, r: &mut Report) {
    let Some(n) = got.tokens.filter(|&n| n > 0) else {
        r.fail("d", o, format!("no token count: {:?}", got.tokens));
        return;
    };
    let probe = |max_tokens| Opts {
        stop: None,
        max_tokens,
        ..o.clone()
    };
    let Some(upto) = ask_ok(runner, o, "its probe", &probe(n), r).await else {
        return;
    };
    if upto.text.contains(stop) {
        r.stop_cuts += 1;
        if got.finish.as_deref() != Some("stop") {
            r.fail(
                "d",
                o,
                format!(
                    "finish_reason {:?} though the stop string cut the answer",
                    got.finish
                ),
            );
        }
        if cut(&upto.text, stop) != got.text {
            r.fail(
                "d",
                o,
                format!(
                    "answered {} but the first {n} tokens without the stop string read {}",
                    short(&got.text),
                    short(&upto.text)
                ),
            );
        }
        let before = match n {
            1 => None,
            _ => ask_ok(runner, o, "its probe", &probe(n - 1), r).await,
        };
        if let Some(before) = before {
            if before.text.contains(stop) && cut(&before.text, stop) == got.text {
                r.fail(
                    "d",
                    o,
                    format!(
                        "usage counts {n} tokens but the stop string was reached by token {}",
                        n - 1
                    ),
                );
            }
        }
    } else if got.finish.as_deref() == Some("stop") && upto.finish.as_deref() == Some("length") {
        r.fail(
            "d",
            o,
            format!(
                "finish_reason stop after {n} tokens, but those tokens ({}) neither end the text nor reach the stop string (answered {})",
                short(&upto.text),
                short(&got.text)
            ),
        );
    }
}
