//! Progress of long work on stderr. On a terminal, indicatif's live bar; anywhere else (a log
//! file, a pipe, a CI job) a redrawn bar never arrives, so a plain line is printed when the work
//! starts, at most every [`line_every`] while it runs and when it ends: done/total, the rate and
//! an ETA, as cargo and pip write to a log.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::json;
use std::io::IsTerminal as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Seconds between two progress lines where stderr is not a terminal: `SPECRAG_PROGRESS_SECS`,
/// else 10.
pub fn line_every() -> Duration {
    let secs = std::env::var("SPECRAG_PROGRESS_SECS")
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.0)
        .unwrap_or(10.0);
    Duration::from_secs_f64(secs)
}

/// When the next plain line is due; `None` where stderr is a terminal (the bar shows progress).
struct Clock {
    start: Instant,
    last: Option<Instant>,
    every: Duration,
}

impl Clock {
    fn for_stderr() -> Option<Self> {
        (!std::io::stderr().is_terminal()).then(|| Self {
            start: Instant::now(),
            last: None,
            every: line_every(),
        })
    }

    /// Whether a line is due now (always the first time); marks it printed.
    fn due(&mut self) -> bool {
        let now = Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < self.every)
        {
            return false;
        }
        self.last = Some(now);
        true
    }

    fn seconds(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }
}

/// `1h 02m`, `4m 05s`, `12s`.
pub fn duration_text(secs: f64) -> String {
    if !secs.is_finite() || secs < 0.0 {
        return "unknown".into();
    }
    let s = secs.round() as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m {:02}s", s / 60, s % 60),
        _ => format!("{}h {:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// The time left at `rate` units per second for `remaining` units.
pub fn eta(remaining: f64, rate: f64) -> String {
    if remaining <= 0.0 {
        return "0s".into();
    }
    if rate <= 0.0 {
        return "unknown".into();
    }
    duration_text(remaining / rate)
}

/// The line an ingestion starts with.
fn started_text(documents: usize, chars: usize) -> String {
    format!(
        "ingest: {documents} documents read ({:.1} M characters); chunking and tokenizing them",
        chars as f64 / 1e6
    )
}

/// Above this estimate, ingestion suggests `--kv lazy`.
const LONG_INGEST_SECS: f64 = 300.0;

/// The one progress printer of an ingestion (`specrag ingest` and `specrag demo`): a bar of
/// chunks on a terminal, plain lines elsewhere, or with `json` one line per committed batch and
/// per problem on stdout.
pub struct IngestProgress {
    bar: ProgressBar,
    json: bool,
    lines: Option<Clock>,
    /// Inputs skipped so far.
    pub problems: usize,
    chunks: (usize, usize),
    tokens: (usize, usize),
    /// Chunks and tokens of the plan whose KV was stored before the run (not work to do).
    stored: (usize, usize),
    /// Tokens whose KV was computed by this run (not found stored), and the seconds that took.
    computed: usize,
    computing_secs: f64,
    last_chunk: Option<Instant>,
    estimated: bool,
    lazy: bool,
    /// Documents committed so far (their batches survive whatever happens next).
    committed: usize,
}

impl IngestProgress {
    /// `lazy`: the run indexes text only (`--kv lazy`), so there is nothing to estimate.
    pub fn new(json: bool, lazy: bool) -> Self {
        Self {
            bar: ProgressBar::hidden(),
            json,
            lines: if json { None } else { Clock::for_stderr() },
            problems: 0,
            chunks: (0, 0),
            tokens: (0, 0),
            stored: (0, 0),
            computed: 0,
            computing_secs: 0.0,
            last_chunk: None,
            estimated: false,
            lazy,
            committed: 0,
        }
    }

    /// Says what was read, before the documents are chunked and tokenized (which takes a
    /// while on a large corpus, before the first chunk line).
    pub fn started(&self, documents: usize, chars: usize) {
        if !self.json {
            let text = started_text(documents, chars);
            self.bar.suspend(|| eprintln!("{text}"));
        }
    }

    /// Reports an input that was skipped.
    pub fn problem(&mut self, origin: &str, message: &str) {
        self.problems += 1;
        if self.json {
            println!(
                "{}",
                json!({"event": "problem", "origin": origin, "message": message})
            );
        } else {
            self.bar
                .suspend(|| eprintln!("skipped {origin}: {message}"));
        }
    }

    pub fn on_event(&mut self, e: gateway::ingest::IngestEvent) {
        use gateway::ingest::IngestEvent;
        match e {
            IngestEvent::Planned {
                chunks,
                tokens,
                stored_chunks,
                stored_tokens,
            } => {
                self.chunks.1 = chunks;
                self.tokens.1 = tokens;
                self.stored = (stored_chunks, stored_tokens);
                self.last_chunk = Some(Instant::now());
                if self.json {
                    return;
                }
                if self.lines.is_some() {
                    self.line("planned");
                } else {
                    self.bar.set_draw_target(ProgressDrawTarget::stderr());
                }
                self.bar.set_length(chunks as u64);
                self.bar.set_style(
                    ProgressStyle::with_template(
                        "{bar:40} {pos}/{len} chunks  {per_sec}  ETA {eta}  {msg}",
                    )
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
                );
            }
            IngestEvent::Chunk { cached, tokens } => {
                let now = Instant::now();
                if !cached && !self.lazy {
                    self.computed += tokens;
                    if let Some(t) = self.last_chunk {
                        self.computing_secs += now.duration_since(t).as_secs_f64();
                    }
                }
                self.last_chunk = Some(now);
                self.chunks.0 += 1;
                self.tokens.0 += tokens;
                self.bar.inc(1);
                if !self.json && !self.estimated && self.computed > 0 {
                    self.estimated = true;
                    self.estimate();
                }
                if self.lines.as_mut().is_some_and(Clock::due) {
                    self.line("");
                }
            }
            IngestEvent::Committed { documents } => {
                self.committed += documents.len();
                if self.json {
                    println!("{}", json!({"event": "committed", "documents": documents}));
                } else {
                    self.bar
                        .set_message(format!("{} documents committed", self.committed));
                }
            }
            IngestEvent::Problem(p) => self.problem(&p.origin, &p.message),
        }
    }

    /// Tokens per second of KV computed so far.
    fn rate(&self) -> f64 {
        if self.computing_secs > 0.0 {
            self.computed as f64 / self.computing_secs
        } else {
            0.0
        }
    }

    /// Tokens whose KV is still to compute: the plan's, less those stored before the run and
    /// those computed since.
    fn left_to_compute(&self) -> usize {
        self.tokens
            .1
            .saturating_sub(self.stored.1)
            .saturating_sub(self.computed)
    }

    /// After the first computed chunk: what the rest of the run will take at this machine's
    /// rate, and the way out when that is long.
    fn estimate_text(&self) -> String {
        let rate = self.rate();
        let left = self.left_to_compute() as f64;
        let secs = if rate > 0.0 { left / rate } else { 0.0 };
        let mut text = format!(
            "ingest: {} tokens in {} chunks to precompute",
            self.tokens.1.saturating_sub(self.stored.1),
            self.chunks.1.saturating_sub(self.stored.0),
        );
        if self.stored.0 > 0 {
            text.push_str(&format!(
                " ({} chunks of {} tokens have their KV stored already)",
                self.stored.0, self.stored.1
            ));
        }
        text.push_str(&format!(
            "; at {rate:.0} tokens/s (this machine, first chunk) about {} more",
            duration_text(secs)
        ));
        if secs > LONG_INGEST_SECS {
            text.push_str(
                "; `--kv lazy` indexes the text in seconds and computes a chunk's KV when a query first retrieves it",
            );
        }
        text
    }

    fn estimate(&self) {
        let text = self.estimate_text();
        self.bar.suspend(|| eprintln!("{text}"));
    }

    /// One plain line: where the run is, its rate and what is left.
    fn line(&self, state: &str) {
        let Some(clock) = &self.lines else { return };
        eprintln!("{}", self.line_text(state, clock.seconds()));
    }

    /// [`IngestProgress::line`]'s text, `secs` into the run.
    fn line_text(&self, state: &str, secs: f64) -> String {
        let pct = if self.tokens.1 > 0 {
            100.0 * self.tokens.0 as f64 / self.tokens.1 as f64
        } else {
            100.0
        };
        let rate = self.rate();
        let tail = match state {
            "" if self.lazy => " (indexing; KV at first retrieval)".to_string(),
            "" => format!(
                ", {rate:.0} tokens/s, ETA {}",
                eta(self.left_to_compute() as f64, rate)
            ),
            s => format!(" ({s})"),
        };
        format!(
            "ingest: {}/{} chunks, {}/{} tokens ({pct:.0}%), {} documents committed, {} \
             elapsed{tail}",
            self.chunks.0,
            self.chunks.1,
            self.tokens.0,
            self.tokens.1,
            self.committed,
            duration_text(secs),
        )
    }

    pub fn finish(&self) {
        if self.lines.is_some() && self.chunks.1 > 0 {
            self.line("done");
        }
        self.bar.finish_and_clear();
    }
}

/// A byte counter (a model file being verified or assembled): a bar on a terminal, plain lines
/// elsewhere.
pub struct ByteMeter {
    bar: ProgressBar,
    label: String,
    total: u64,
    lines: Option<Mutex<(Clock, u64)>>,
}

impl ByteMeter {
    pub fn new(total: u64, label: String) -> Self {
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template(
                "{msg:40} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        bar.set_message(label.clone());
        Self {
            bar,
            label,
            total,
            lines: Clock::for_stderr().map(|c| Mutex::new((c, 0))),
        }
    }

    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
        if let Some(m) = &self.lines {
            let mut g = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            g.1 += n;
            let done = g.1;
            if g.0.due() {
                self.line(&g.0, done, false);
            }
        }
    }

    fn line(&self, clock: &Clock, done: u64, end: bool) {
        let secs = clock.seconds();
        let rate = if secs > 0.0 { done as f64 / secs } else { 0.0 };
        let mb = |b: u64| b as f64 / 1e6;
        let tail = if end {
            format!(" in {}", duration_text(secs))
        } else {
            format!(
                ", {:.0} MB/s, ETA {}",
                rate / 1e6,
                eta(self.total.saturating_sub(done) as f64, rate)
            )
        };
        eprintln!(
            "{}: {:.0}/{:.0} MB{tail}",
            self.label,
            mb(done),
            mb(self.total)
        );
    }

    pub fn finish(&self) {
        if let Some(m) = &self.lines {
            let g = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            self.line(&g.0, g.1, true);
        }
        self.bar.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_a_person_writes_them() {
        assert_eq!(duration_text(0.4), "0s");
        assert_eq!(duration_text(59.4), "59s");
        assert_eq!(duration_text(245.0), "4m 05s");
        assert_eq!(duration_text(3720.0), "1h 02m");
        assert_eq!(duration_text(f64::NAN), "unknown");
        assert_eq!(eta(100.0, 0.0), "unknown");
        assert_eq!(eta(0.0, 0.0), "0s");
        assert_eq!(eta(500.0, 50.0), "10s");
    }

    #[test]
    fn chunks_stored_before_the_run_are_not_counted_as_work_left() {
        // Issue 88: 800 stored tokens of 1000 were estimated as still to compute.
        use gateway::ingest::IngestEvent::{Chunk, Planned};
        let mut p = IngestProgress::new(true, false);
        p.on_event(Planned {
            chunks: 10,
            tokens: 1000,
            stored_chunks: 8,
            stored_tokens: 800,
        });
        for _ in 0..3 {
            p.on_event(Chunk {
                cached: true,
                tokens: 100,
            });
        }
        p.on_event(Chunk {
            cached: false,
            tokens: 100,
        });
        assert_eq!(p.left_to_compute(), 100);
        let text = p.estimate_text();
        assert!(
            text.starts_with("ingest: 200 tokens in 2 chunks to precompute (8 chunks of 800 tokens have their KV stored already)"),
            "{text}"
        );
    }

    /// The committed count is the run's, not the last batch's (the bar showed "16 documents
    /// committed" all run long), and plain lines carry it.
    #[test]
    fn committed_documents_add_up_over_the_batches() {
        use gateway::ingest::IngestEvent::{Committed, Planned};
        let mut p = IngestProgress::new(false, true);
        p.on_event(Planned {
            chunks: 40,
            tokens: 4000,
            stored_chunks: 0,
            stored_tokens: 0,
        });
        for batch in [16, 16, 3] {
            p.on_event(Committed {
                documents: (0..batch).map(|i| format!("d{i}")).collect(),
            });
        }
        assert_eq!(p.committed, 35);
        let line = p.line_text("", 75.0);
        assert!(
            line.contains(", 35 documents committed, 1m 15s elapsed"),
            "{line}"
        );
    }

    #[test]
    fn the_first_line_says_what_was_read() {
        assert_eq!(
            started_text(1200, 3_456_789),
            "ingest: 1200 documents read (3.5 M characters); chunking and tokenizing them"
        );
    }

    #[test]
    fn a_line_is_due_first_then_not_before_the_interval() {
        let mut c = Clock {
            start: Instant::now(),
            last: None,
            every: Duration::from_secs(3600),
        };
        assert!(c.due());
        assert!(!c.due());
        c.every = Duration::ZERO;
        assert!(c.due());
    }
}
