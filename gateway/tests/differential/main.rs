//! The differential harness (issue 57): every promise a request makes, checked over a matrix
//! of request options, so a promise that holds on one path and breaks on another is found.
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
//!   that completed the stop string, and `finish_reason` is `stop`;
//! - (e) no streamed piece shows U+FFFD where the answer has none.
//!
//! The tiny random-weight models run the whole matrix with a guard margin of 1.0, so
//! that most reused answers escalate; the default 0.5B target runs a few combinations (it must
//! be in `$SPECRAG_MODELS`, else `./models`: `scripts/setup-tests.sh` fetches it).

mod case;
mod check;
#[path = "../common/mod.rs"]
mod common;
mod stream;

use case::{Opts, Question, Route, Runner, Sampling};
use check::{walk, Matrix, Report};
use common::TINY_DOCS;
use gateway::corpus::{Corpus, Engines};
use gateway::fidelity::{Fidelity, GuardPolicy};
use gateway::http::{AppState, ServerConfig};
use gateway::input::SourceDoc;
use gateway::pipeline::{Pipeline, ScoreSource};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;
use target_engine::testing::{write_tiny_gguf, TinySpec};
use target_engine::{Architecture, LoadOptions, Model};

type TestResult = Result<(), Box<dyn std::error::Error>>;
/// A target and, maybe, a speculator.
type Models = (Arc<Model>, Option<Arc<Model>>);

/// A pipeline over `docs` (ingested into `dir/data`) with `target` and `spec`, its guard
/// escalating below `margin`, behind an HTTP state.
fn server(
    dir: &Path,
    (target, spec): Models,
    docs: &[(&str, &str)],
    margin: f32,
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
    pipeline.guard = GuardPolicy {
        margin: Some(margin),
        ..GuardPolicy::default()
    };
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
        "{what}: {} combinations, {} requests in {:.1} s; reused answers escalated: {} greedy, {} seeded; answers cut by a stop string: {}; broken promises: {}",
        report.cases,
        report.requests,
        t.elapsed().as_secs_f64(),
        report.escalated[0],
        report.escalated[1],
        report.stop_cuts,
        report.failures.len()
    );
    eprint!("{}", report.listing());
    report
}

const TINY_QUESTIONS: [Question; 2] = [
    Question {
        text: "the thin ant?",
        method: "target_probe_shift",
        spec_draft: "lookup",
    },
    Question {
        text: "what is in the tin?",
        method: "cacheblend",
        spec_draft: "both",
    },
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
    // A margin of 1.0 (the methods' own are 0.3-0.5): most reused answers escalate (at their first token or
    // later, for a doubt or a loop), some do not.
    let state = server(dir.path(), tiny_models(dir.path())?, &TINY_DOCS, 1.0)?;
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
    assert!(
        report.failures.is_empty(),
        "{} broken promises over {} combinations:\n{}",
        report.failures.len(),
        report.cases,
        report.listing()
    );
    Ok(())
}

const REAL_DOCS: [(&str, &str); 3] = [
    (
        "heron",
        "Heron is a small key-value store written in Rust. It listens on port 7411 by default \
         and keeps its data in a single append-only log file called heron.log.",
    ),
    (
        "heron-config",
        "Heron reads its settings from heron.toml. The `compaction_interval` setting says how \
         often the log is rewritten without deleted keys; it defaults to ten minutes.",
    ),
    (
        "heron-clients",
        "Clients talk to Heron over a plain TCP protocol: a GET line reads a key and a PUT line \
         writes one. There are client libraries for Python and Go.",
    ),
];

const REAL_QUESTIONS: [Question; 1] = [Question {
    text: "Which port does Heron listen on, and where does it keep its data?",
    method: "target_probe_shift",
    spec_draft: "lookup",
}];

/// The default target (no speculator: prompt lookup drafts), over a few combinations: both
/// routes streamed or not, greedy `balanced` and `exact`, seeded `balanced` (and without
/// drafting, not streamed), a stop string on greedy `balanced`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_models_keep_every_promise_over_a_few_options() -> TestResult {
    let file = gateway::models::DefaultModel::of(gateway::models::Role::Target).file;
    let models = std::env::var_os("SPECRAG_MODELS").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../models"),
        std::path::PathBuf::from,
    );
    let path = models.join(file);
    assert!(
        path.is_file(),
        "{} is missing: run scripts/setup-tests.sh (the README's test command does)",
        path.display()
    );
    let target = Arc::new(Model::load(&path, &LoadOptions::default())?);
    let dir = tempfile::tempdir()?;
    let state = server(dir.path(), (target, None), &REAL_DOCS, 1.0)?;
    let m = Matrix {
        questions: REAL_QUESTIONS.len(),
        routes: vec![Route::Rag, Route::OpenAi],
        fidelities: vec![Fidelity::Balanced, Fidelity::Exact],
        specs: vec![false, true],
        samplings: vec![Sampling::Greedy, Sampling::Seeded],
        max_tokens: vec![10],
        keep: |o: &Opts| {
            let greedy = o.sampling == Sampling::Greedy;
            let balanced = o.fidelity == Fidelity::Balanced;
            let spec_off = !greedy && balanced && !o.stream && o.stop.is_none();
            let stop = o.stop.is_none() || (greedy && balanced);
            (o.spec || spec_off) && (greedy || balanced) && stop
        },
    };
    let report = run("default models", &state, &REAL_QUESTIONS, &m, 3).await;
    assert!(report.cases >= 10, "{} combinations", report.cases);
    assert!(
        report.failures.is_empty(),
        "{} broken promises over {} combinations:\n{}",
        report.failures.len(),
        report.cases,
        report.listing()
    );
    Ok(())
}
