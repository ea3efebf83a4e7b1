//! The gateway's pipeline on both engines behind `target_engine::Engine`: the CPU engine and
//! the device engine (`--device`), the latter run here on candle's CPU device (what `--device
//! candle-cpu` serves with), over the same documents ingested eagerly by each. The road after
//! assembly (chunk KV load, the method's selector, the blend, the fidelity guard, verification)
//! is one code for both: the answers of a method agree between the engines up to near ties,
//! a verified answer on the device is the device's full recompute token for token, and what
//! the device cannot run is refused naming the method and the device.

use gateway::corpus::{Corpus, Engines};
use gateway::fidelity::Fidelity;
use gateway::pipeline::{Answer, Experiment, Method, Pipeline, Query, ScoreSource, Served};
use gateway::GatewayError;
use std::sync::Arc;
use target_engine::device::DeviceModel;
use target_engine::testing::{write_tiny_gguf, TinySpec};
use target_engine::{Architecture, LoadOptions, Model};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The largest top-2 logit gap of the CPU engine's at which the two engines may choose
/// differently: their logits differ by rounding (within 0.06 on these models,
/// target-engine/tests/device_model.rs), and the split rule of the fidelity target is 0.15.
const NEAR_TIE: f64 = 0.15;

/// Documents of this repository's kind: short passages with names and numbers to copy.
fn docs() -> Vec<gateway::input::SourceDoc> {
    let texts = [
        "The ingestion CLI cuts each document into chunks of 512 target tokens and stores \
         every chunk's KV after the template prefix.",
        "A query retrieves the top chunks with BM25, loads their KV from memory or disk, and \
         recomputes the tokens the probe picks before the question is read.",
        "The fidelity guard watches the top-2 gap of every answer token and escalates to the \
         full cache when a token is in doubt or a loop is seen.",
        "Verification drafts from the reused cache and checks every token against the full \
         prefill, so the answer equals full recompute token for token.",
    ];
    texts
        .iter()
        .enumerate()
        .map(|(i, t)| gateway::input::SourceDoc {
            id: format!("d{i}"),
            title: None,
            text: (*t).into(),
            origin: format!("d{i}"),
        })
        .collect()
}

/// A pipeline with `engines` over its own data directory under `dir`, the documents ingested
/// eagerly (chunk KV computed by the pipeline's engine).
fn pipeline(
    dir: &std::path::Path,
    engines: Engines,
) -> Result<Pipeline, Box<dyn std::error::Error>> {
    let corpus = Corpus::open(&dir.join("data"), 1 << 30)?;
    gateway::ingest::ingest(&corpus, &engines, docs(), &Default::default(), |_| {})?;
    Ok(Pipeline::new(engines, corpus, ScoreSource::Query))
}

/// The same tiny qwen2 file served by the CPU engine and by the device engine.
fn both(dir: &std::path::Path) -> Result<(Pipeline, Pipeline), Box<dyn std::error::Error>> {
    let path = dir.join("target.gguf");
    write_tiny_gguf(&path, &TinySpec::new(Architecture::Qwen2))?;
    let cpu = Engines::new(Arc::new(Model::load(&path, &LoadOptions::default())?), None)?;
    let device = DeviceModel::load(&path, &candle_core::Device::Cpu)?;
    let dev = Engines::new(Arc::new(device), None)?;
    std::fs::create_dir_all(dir.join("cpu"))?;
    std::fs::create_dir_all(dir.join("dev"))?;
    Ok((
        pipeline(&dir.join("cpu"), cpu)?,
        pipeline(&dir.join("dev"), dev)?,
    ))
}

fn query(text: &str, method: Method) -> Query {
    Query {
        query: text.into(),
        top_k: 3,
        max_tokens: 8,
        method,
        logprobs: Some(2),
        ..Default::default()
    }
}

/// The answer's tokens, as their bytes.
fn tokens(a: &Answer) -> Vec<Vec<u8>> {
    a.logprobs
        .as_ref()
        .map(|l| l.iter().map(|t| t.bytes.clone()).collect())
        .unwrap_or_default()
}

/// Where two answers first choose different tokens, with `reference`'s top-2 gap there;
/// `None` where one is the other's prefix or they are equal.
fn split(reference: &Answer, other: &Answer) -> Option<(usize, f64)> {
    let (a, b) = (tokens(reference), tokens(other));
    let i = a.iter().zip(&b).position(|(x, y)| x != y)?;
    let top = &reference.logprobs.as_ref()?[i].top_logprobs;
    Some((i, top[0].logprob - top[1].logprob))
}

const QUESTIONS: [&str; 3] = [
    "how many target tokens are in a chunk?",
    "what does the fidelity guard watch?",
    "what does verification check every token against?",
];

/// Every method the device serves, run by the one road on both engines: the same chunks
/// retrieved, the same prompt, the same chunk tokens recomputed, and answers that split only
/// where the CPU engine's own top-2 gap is a near tie.
#[test]
fn a_methods_answers_agree_on_both_engines_up_to_near_ties() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (cpu, dev) = both(dir.path())?;
    assert_ne!(
        cpu.engines.target.fingerprint(),
        dev.engines.target.fingerprint(),
        "each engine stores its own chunk KV"
    );
    assert_eq!(dev.engines.target.device(), "device:cpu");
    let methods = [
        Method::TargetProbeShift,
        Method::TargetProbe,
        Method::TargetProbeSpan,
        Method::Epic,
        Method::Prefix,
        Method::FullReuse,
        Method::FullRecompute,
    ];
    let (mut answers, mut splits) = (0, Vec::new());
    for method in methods {
        for text in QUESTIONS {
            let q = Query {
                ratio: 0.25,
                ..query(text, method)
            };
            let a = cpu.query(&q, &mut |_| true)?;
            let b = dev.query(&q, &mut |_| true)?;
            let ids = |x: &Answer| x.chunks.iter().map(|c| c.id.clone()).collect::<Vec<_>>();
            assert_eq!(ids(&a), ids(&b), "{method} `{text}`: the same chunks");
            assert_eq!(a.prompt_tokens, b.prompt_tokens);
            assert_eq!(
                a.reuse.recomputed_tokens, b.reuse.recomputed_tokens,
                "{method} `{text}`: the same number of chunk tokens recomputed"
            );
            assert_eq!(
                b.reuse.chunks_recomputed, 0,
                "the device read its stored KV"
            );
            assert!(!tokens(&a).is_empty() && !tokens(&b).is_empty());
            answers += 1;
            if let Some((at, gap)) = split(&a, &b) {
                assert!(
                    gap < NEAR_TIE,
                    "{method} `{text}`: the engines split at token {at} where the CPU's top-2 \
                     gap is {gap:.3} (answers {:?} and {:?})",
                    a.answer,
                    b.answer
                );
                splits.push((method, at, gap));
            }
        }
    }
    eprintln!("{answers} answers per engine; near-tie splits: {splits:?}");
    Ok(())
}

/// Verification and the guard's escalation on the device end where they end on the CPU: the
/// device's full cache. A verified answer (any reusing method) is the device's full
/// recompute's, token for token, as is an `exact` one.
#[test]
fn verified_answers_on_the_device_are_its_full_recompute() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (_cpu, dev) = both(dir.path())?;
    for text in QUESTIONS {
        let full = dev.query(&query(text, Method::FullRecompute), &mut |_| true)?;
        for method in [Method::TargetProbeShift, Method::FullReuse] {
            let verified = Query {
                verify: true,
                ..query(text, method)
            };
            let v = dev.query(&verified, &mut |_| true)?;
            assert_eq!(
                (tokens(&v), &v.answer),
                (tokens(&full), &full.answer),
                "{method} `{text}` verified"
            );
            assert!(v.verify.is_some());
            let exact = Query {
                fidelity: Fidelity::Exact,
                ..query(text, method)
            };
            let e = dev.query(&exact, &mut |_| true)?;
            assert_eq!(e.answer, full.answer, "{method} `{text}` exact");
        }
    }
    Ok(())
}

/// Sampling with a seed on the device: the same seed, the same answer, through the guard.
#[test]
fn seeded_sampling_on_the_device_repeats() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (_cpu, dev) = both(dir.path())?;
    let q = Query {
        temperature: 0.8,
        seed: 7,
        ..query(QUESTIONS[1], Method::TargetProbeShift)
    };
    let a = dev.query(&q, &mut |_| true)?;
    let b = dev.query(&q, &mut |_| true)?;
    assert_eq!(tokens(&a), tokens(&b));
    assert_eq!(a.answer, b.answer);
    Ok(())
}

/// What the device engine cannot run is refused before any model work, naming the field, the
/// method or option and the device; it is never run on the CPU engine instead.
#[test]
fn the_device_refuses_what_runs_on_the_cpu_engine_only() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (cpu, dev) = both(dir.path())?;
    let refused = |q: &Query, exp: Option<&dyn Experiment>| -> (String, String) {
        let r = match exp {
            Some(e) => dev.query_with(q, e, &mut |_| true).map(|_| ()),
            None => dev.query(q, &mut |_| true).map(|_| ()),
        };
        match r {
            Err(GatewayError::BadInput { field, message }) => (field.to_string(), message),
            other => panic!("{q:?} was not refused on the device: {other:?}"),
        }
    };
    let (field, message) = refused(&query(QUESTIONS[0], Method::Cacheblend), None);
    assert_eq!(field, "method");
    assert!(
        message.contains("cacheblend") && message.contains("device:cpu"),
        "{message}"
    );
    let (field, message) = refused(&query(QUESTIONS[0], Method::Speccache), None);
    assert_eq!(field, "method");
    assert!(message.contains("speccache"), "{message}");
    for (q, want) in [
        (
            Query {
                spec_decode: Some(true),
                ..query(QUESTIONS[0], Method::TargetProbeShift)
            },
            "spec_decode",
        ),
        (
            Query {
                long_context: Some(true),
                ..query(QUESTIONS[0], Method::TargetProbeShift)
            },
            "long_context",
        ),
    ] {
        assert_eq!(refused(&q, None).0, want);
        // The CPU engine runs it.
        cpu.query(&q, &mut |_| true)?;
    }
    let q = query(QUESTIONS[0], Method::TargetProbeShift);
    assert_eq!(refused(&q, Some(&Served)).0, "device");
    Ok(())
}

/// The server's decode batcher batches the device engine's steps as it does the CPU engine's:
/// requests decoding side by side on the device go through one [`DecodeBatcher`] of the device
/// engine, and each answer is the one it gets alone.
///
/// [`DecodeBatcher`]: target_engine::DecodeBatcher
#[test]
fn device_answers_batched_together_equal_each_alone() -> TestResult {
    // Long enough answers that the requests decode side by side.
    let long = |t: &str| Query {
        max_tokens: 48,
        ..query(t, Method::TargetProbeShift)
    };
    let dir = tempfile::tempdir()?;
    let (_cpu, dev) = both(dir.path())?;
    let alone: Vec<Answer> = QUESTIONS
        .iter()
        .map(|t| dev.query(&long(t), &mut |_| true))
        .collect::<Result<_, _>>()?;
    let batcher = Arc::new(target_engine::DecodeBatcher::<DeviceModel>::new(
        QUESTIONS.len(),
        std::time::Duration::from_millis(500),
    ));
    let together: Vec<Answer> = std::thread::scope(|s| {
        let runs: Vec<_> = QUESTIONS
            .iter()
            .map(|t| {
                let (b, dev) = (Arc::clone(&batcher), &dev);
                s.spawn(move || {
                    target_engine::with_batcher(Some(b), || dev.query(&long(t), &mut |_| true))
                })
            })
            .collect();
        runs.into_iter()
            .map(|h| h.join().expect("a query thread"))
            .collect::<Result<_, _>>()
    })?;
    for ((a, b), t) in alone.iter().zip(&together).zip(QUESTIONS) {
        assert_eq!((tokens(a), &a.answer), (tokens(b), &b.answer), "`{t}`");
    }
    let stats = batcher.stats();
    assert!(
        stats.steps > 0,
        "the device's decode steps went through its batcher: {stats:?}"
    );
    eprintln!("device batcher: {stats:?}");
    Ok(())
}

/// Admission counts a device request's KV at the device cache's f16 (half the CPU engine's
/// f32 per token): a request over `--kv-memory-budget` is refused before any model work with
/// a 503 naming the budget, and one that fits runs.
#[test]
fn a_device_request_over_the_kv_budget_is_refused_before_model_work() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (cpu, mut dev) = both(dir.path())?;
    let q = query(QUESTIONS[0], Method::TargetProbeShift);
    let (on_cpu, on_dev) = (cpu.kv_need(&q, 100), dev.kv_need(&q, 100));
    assert_eq!(on_dev.target_per_token * 2, on_cpu.target_per_token);
    dev.kv_memory_budget = 1 << 10;
    match dev.query(&q, &mut |_| true) {
        Err(e) => {
            assert_eq!(e.fault(), gateway::Fault::Unavailable, "{e}");
            assert!(e.to_string().contains("--kv-memory-budget"), "{e}");
        }
        Ok(a) => panic!("a request over the budget was answered: {:?}", a.answer),
    }
    assert_eq!(dev.kv_held.held(), 0, "nothing is held after a refusal");
    dev.kv_memory_budget = 1 << 30;
    dev.query(&q, &mut |_| true)?;
    Ok(())
}

/// `--device-attention fused` on candle's CPU device (the fused ops' f32 reference): the road
/// answers as with candle ops, and the two attentions' chunk KV are stored apart.
#[test]
fn the_fused_attention_answers_as_candle_ops_on_the_road() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (_cpu, ops) = both(dir.path())?;
    let path = dir.path().join("target.gguf");
    let mut model = DeviceModel::load(&path, &candle_core::Device::Cpu)?;
    model.set_attention(target_engine::device::DeviceAttention::Fused)?;
    std::fs::create_dir_all(dir.path().join("fused"))?;
    let fused = pipeline(
        &dir.path().join("fused"),
        Engines::new(Arc::new(model), None)?,
    )?;
    assert_ne!(
        ops.engines.target.fingerprint(),
        fused.engines.target.fingerprint()
    );
    for method in [Method::TargetProbeShift, Method::FullRecompute] {
        for t in QUESTIONS {
            let (a, b) = (
                ops.query(&query(t, method), &mut |_| true)?,
                fused.query(&query(t, method), &mut |_| true)?,
            );
            if let Some((i, gap)) = split(&a, &b) {
                assert!(gap < NEAR_TIE, "`{t}` {method:?}: split at {i} by {gap}");
            }
        }
    }
    Ok(())
}

/// `--device-hot-chunks`: chunk KV kept in device memory is placed from there on its next
/// retrieval, and the answer is the one an upload from host memory gives.
#[test]
fn hot_chunks_kept_on_the_device_answer_as_uploads_do() -> TestResult {
    let dir = tempfile::tempdir()?;
    let (_cpu, dev) = both(dir.path())?;
    let path = dir.path().join("target.gguf");
    let hot = DeviceModel::load(&path, &candle_core::Device::Cpu)?;
    hot.set_hot_chunks(64 << 20);
    std::fs::create_dir_all(dir.path().join("hot"))?;
    let hot = pipeline(&dir.path().join("hot"), Engines::new(Arc::new(hot), None)?)?;
    let stats = || match &hot.engines.target {
        gateway::target::Target::Device(d) => d.hot_chunks(),
        gateway::target::Target::Cpu(_) => unreachable!("a device pipeline"),
    };
    for text in QUESTIONS {
        let q = query(text, Method::TargetProbeShift);
        let uploaded = dev.query(&q, &mut |_| true)?;
        for _ in 0..2 {
            let a = hot.query(&q, &mut |_| true)?;
            assert_eq!(
                (tokens(&a), &a.answer),
                (tokens(&uploaded), &uploaded.answer)
            );
        }
    }
    let s = stats();
    assert!(
        s.hits > 0 && s.held > 0,
        "repeated chunks came from device memory: {s:?}"
    );
    Ok(())
}
