//! Fast invariants on tiny random-weight models written as GGUF files (no downloads).

use candle_core::quantized::gguf_file::Value;
use target_engine::prelude::*;
use target_engine::testing::{write_tiny_gguf, TinySpec};
use target_engine::{
    Architecture, EngineError, FinishReason, GenerateParams, LoadOptions, Model, SamplingParams,
};

fn tiny(arch: Architecture, opts: &LoadOptions) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, &TinySpec::new(arch)).expect("write tiny model");
    let m = Model::load(&path, opts).expect("load tiny model");
    (dir, m)
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

const ARCHS: [Architecture; 2] = [Architecture::Qwen2, Architecture::Llama];

#[test]
fn prefill_then_decode_equals_longer_prefill_on_each_weight_path() {
    for arch in ARCHS {
        for opts in [
            LoadOptions {
                dense_min_rows: 1,
                ..Default::default()
            },
            LoadOptions {
                dense: false,
                ..Default::default()
            },
        ] {
            let (_d, m) = tiny(arch, &opts);
            let ids: Vec<u32> = (0..40).map(|i| (i * 7 % 250) as u32).collect();
            let (mut cache, _) = m.prefill(&ids[..39]).expect("prefill");
            let out = m
                .forward(&ids[39..], &[39], &mut cache, false)
                .expect("decode");
            let stepped = m.last_logits(&out).expect("logits");
            let (full_cache, full) = m.prefill(&ids).expect("prefill");
            assert!(
                max_diff(&stepped, &full) < 1e-4,
                "{arch:?} dense={}",
                opts.dense
            );
            for l in 0..m.config().n_layer {
                assert!(max_diff(cache.k(l), full_cache.k(l)) < 1e-4);
                assert!(max_diff(cache.v(l), full_cache.v(l)) < 1e-4);
            }
        }
    }
}

#[test]
fn recomputing_a_subset_against_a_filled_cache_changes_nothing() {
    for arch in ARCHS {
        let (_d, m) = tiny(
            arch,
            &LoadOptions {
                dense_min_rows: 1,
                ..Default::default()
            },
        );
        let ids: Vec<u32> = (0..50).map(|i| (i * 13 % 256) as u32).collect();
        let (mut cache, full) = m.prefill(&ids).expect("prefill");
        let before = cache.clone();
        // Scattered positions, last one included: logits of the last row are the full ones.
        let pos = vec![3, 17, 18, 30, 49];
        let sub: Vec<u32> = pos.iter().map(|&p| ids[p]).collect();
        let out = m
            .forward(&sub, &pos, &mut cache, false)
            .expect("subset forward");
        let d = max_diff(&m.last_logits(&out).expect("logits"), &full);
        assert!(d < 1e-4, "{arch:?}: logits {d}");
        for l in 0..m.config().n_layer {
            // Cache rows are f16: where the f32 panels (off AVX-512 VNNI) round a row's last
            // bit by its batch, a stored value may land one f16 step away (2.4e-4 at 0.5-1
            // measured on a Zen 3), never more.
            let within = cache
                .k(l)
                .iter()
                .zip(before.k(l))
                .all(|(x, y)| (x - y).abs() <= x.abs().max(y.abs()) / 1024.0 + 1e-7);
            assert!(
                within,
                "{arch:?}: layer {l} K {}",
                max_diff(cache.k(l), before.k(l))
            );
        }
    }
}

#[test]
fn a_different_token_at_one_position_changes_later_rows_only() {
    let (_d, m) = tiny(
        Architecture::Qwen2,
        &LoadOptions {
            dense_min_rows: 1,
            ..Default::default()
        },
    );
    let ids: Vec<u32> = (0..20).map(|i| (i * 5 % 256) as u32).collect();
    let (a, _) = m.prefill(&ids).expect("prefill");
    let mut other = ids.clone();
    other[10] = 200;
    let (b, _) = m.prefill(&other).expect("prefill");
    let row = m.config().kv_row();
    let l = m.config().n_layer - 1;
    assert!(
        max_diff(&a.k(l)[..10 * row], &b.k(l)[..10 * row]) < 1e-6,
        "causal: rows before 10 unchanged"
    );
    assert!(
        max_diff(&a.k(l)[10 * row..], &b.k(l)[10 * row..]) > 1e-3,
        "rows from 10 on change"
    );
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let (_d, m) = tiny(Architecture::Llama, &LoadOptions::default());
    let vocab = m.config().vocab_size as u32;
    let mut cache = m.new_cache();
    assert!(matches!(
        m.forward(&[vocab], &[0], &mut cache, false),
        Err(EngineError::InvalidInput(_))
    ));
    assert!(
        m.forward(&[1, 2], &[0], &mut cache, false).is_err(),
        "ids and positions differ in length"
    );
    assert!(m.forward(&[], &[], &mut cache, false).is_err());
    assert!(
        m.forward(&[1], &[5], &mut cache, false).is_err(),
        "hole below position 5"
    );
    assert!(m.generate(&[], &GenerateParams::default()).is_err());
}

#[test]
fn unsupported_files_are_clear_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cases: Vec<(Vec<(String, Value)>, &str)> = vec![
        (
            vec![(
                "qwen2.rope.scaling.type".into(),
                Value::String("yarn".into()),
            )],
            "rope scaling",
        ),
        (
            vec![("qwen2.rope.dimension_count".into(), Value::U32(8))],
            "partial rotary",
        ),
        (
            vec![(
                "tokenizer.ggml.pre".into(),
                Value::String("deepseek-llm".into()),
            )],
            "pre-tokenizer",
        ),
    ];
    for (extra, what) in cases {
        let path = dir.path().join("bad.gguf");
        let mut spec = TinySpec::new(Architecture::Qwen2);
        // Later entries win in the metadata map, so these override the defaults.
        spec.extra = extra;
        write_tiny_gguf(&path, &spec).expect("write");
        let err = Model::load(&path, &LoadOptions::default()).expect_err(what);
        assert!(err.is_bad_input(), "{what}: {err}");
        assert!(err.to_string().contains(what), "{what}: {err}");
    }
    let path = dir.path().join("missing.gguf");
    let err = Model::load(&path, &LoadOptions::default()).expect_err("missing");
    assert!(err.to_string().contains("specrag models fetch"), "{err}");
    std::fs::write(&path, b"not a gguf file").expect("write");
    assert!(matches!(
        Model::load(&path, &LoadOptions::default()),
        Err(EngineError::BadGguf { .. })
    ));
}

#[test]
fn generation_stops_at_max_tokens_stop_strings_and_is_seeded() {
    let (_d, m) = tiny(Architecture::Qwen2, &LoadOptions::default());
    let prompt = target_engine::chat_prompt(&m, Some("sys"), "the thin ant");
    let g = m
        .generate(
            &prompt,
            &GenerateParams {
                max_tokens: 5,
                ..Default::default()
            },
        )
        .expect("generate");
    assert!(g.ids.len() <= 5);
    if g.finish == FinishReason::Length {
        assert_eq!(g.ids.len(), 5);
    }
    let sampled = |seed| {
        let p = GenerateParams {
            max_tokens: 12,
            sampling: SamplingParams {
                temperature: 1.0,
                top_p: 0.95,
                seed,
            },
            ..Default::default()
        };
        m.generate(&prompt, &p).expect("generate").ids
    };
    assert_eq!(sampled(3), sampled(3), "same seed, same tokens");
    // A stop string taken from an unconstrained run cuts the text before it.
    let free = m
        .generate(
            &prompt,
            &GenerateParams {
                max_tokens: 12,
                ..Default::default()
            },
        )
        .expect("generate");
    if let Some(c) = free.text.chars().nth(2) {
        let stop = c.to_string();
        let g = m
            .generate(
                &prompt,
                &GenerateParams {
                    max_tokens: 12,
                    stop: vec![stop.clone()],
                    ..Default::default()
                },
            )
            .expect("generate");
        assert_eq!(g.finish, FinishReason::Stop);
        assert!(!g.text.contains(&stop));
        assert!(free.text.starts_with(&g.text));
    }
}

#[test]
fn streamed_pieces_add_up_to_the_text_and_a_false_return_cancels() {
    let (_d, m) = tiny(Architecture::Qwen2, &LoadOptions::default());
    let prompt = target_engine::chat_prompt(&m, None, "the thin ant");
    let params = GenerateParams {
        max_tokens: 16,
        ..Default::default()
    };
    let whole = m.generate(&prompt, &params).expect("generate");
    let (mut cache, logits) = m.prefill(&prompt).expect("prefill");
    let mut pieces = Vec::new();
    let g = m
        .decode_stream(&mut cache, logits, 0.0, &params, &mut |p| {
            pieces.push(p.to_string());
            true
        })
        .expect("stream");
    assert_eq!(g.ids, whole.ids);
    assert_eq!(pieces.concat(), whole.text);
    assert!(pieces.iter().all(|p| !p.is_empty()));
    if pieces.len() >= 2 {
        let (mut cache, logits) = m.prefill(&prompt).expect("prefill");
        let mut n = 0;
        let g = m
            .decode_stream(&mut cache, logits, 0.0, &params, &mut |_| {
                n += 1;
                n < 2
            })
            .expect("stream");
        assert_eq!(g.finish, FinishReason::Cancelled);
        assert_eq!(n, 2, "nothing is sent after a cancel");
    }
}

#[test]
fn chat_template_keeps_special_tokens_in_content_as_text() {
    let (_d, m) = tiny(Architecture::Qwen2, &LoadOptions::default());
    let tok = m.tokenizer();
    let start = tok.token_id("<|im_start|>").expect("special");
    let ids = target_engine::chat_prompt(&m, None, "a <|im_start|> b");
    assert_eq!(
        ids.iter().filter(|&&i| i == start).count(),
        2,
        "user header + assistant header only"
    );
    assert_eq!(ids[0], start);
    let raw = target_engine::raw_prompt(tok, "a <|im_start|> b");
    assert!(raw.contains(&start), "--raw parses special tokens");
}

#[test]
fn fingerprint_depends_on_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut prints = Vec::new();
    for seed in [1, 1, 2] {
        let path = dir.path().join(format!("m{seed}-{}.gguf", prints.len()));
        let mut spec = TinySpec::new(Architecture::Llama);
        spec.seed = seed;
        spec.n_ff = 128 + 32 * (seed as usize - 1);
        write_tiny_gguf(&path, &spec).expect("write");
        prints.push(
            Model::load(&path, &LoadOptions::default())
                .expect("load")
                .fingerprint()
                .to_string(),
        );
    }
    assert_eq!(prints[0], prints[1]);
    assert_ne!(prints[0], prints[2]);
    assert_eq!(prints[0].len(), 64);
}

/// Regression (issue 57): the fingerprint named the file alone, so KV precomputed under other
/// load choices (dense f32 panels or int8 kernels for many rows here; bf16 attention,
/// `--candle-k-quants` and a CPU without VNNI the same way) was stored under the same key and
/// served as this model's. Invariant: one fingerprint, one set of KV bytes.
#[test]
fn kv_computed_differently_never_shares_a_fingerprint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, &TinySpec::new(Architecture::Qwen2)).expect("write tiny model");
    let variants = [
        LoadOptions::default(),
        LoadOptions::default(),
        LoadOptions {
            dense: false,
            ..Default::default()
        },
        LoadOptions {
            dense_copies: true,
            ..Default::default()
        },
        LoadOptions {
            dense_min_rows: 64,
            ..Default::default()
        },
        LoadOptions {
            packed: false,
            pack_k_quants: false,
            ..Default::default()
        },
        LoadOptions {
            requantize: Some(target_engine::GgmlDType::Q8_0),
            ..Default::default()
        },
    ];
    let ids: Vec<u32> = (0..40).map(|i| (i * 13 % 250) as u32).collect();
    let runs: Vec<(String, String, Vec<u16>)> = variants
        .iter()
        .map(|opts| {
            let m = Model::load(&path, opts).expect("load");
            let kv = m.precompute(&ids, None).expect("precompute");
            let bits = kv.k.iter().chain(&kv.v).flatten().map(|x| x.to_bits());
            (
                m.fingerprint().to_string(),
                m.numerics().to_string(),
                bits.collect(),
            )
        })
        .collect();
    let mut differing = 0;
    for (i, a) in runs.iter().enumerate() {
        for b in &runs[i + 1..] {
            if a.2 != b.2 {
                differing += 1;
                assert_ne!(
                    a.0, b.0,
                    "different KV under one fingerprint: {} / {}",
                    a.1, b.1
                );
            }
            assert_eq!(a.0 == b.0, a.1 == b.1, "{} / {}", a.1, b.1);
        }
    }
    assert_eq!(runs[0].0, runs[1].0, "the same load, the same fingerprint");
    assert!(
        differing > 0,
        "no load choice changed the KV: the test proves nothing"
    );
}

#[test]
fn a_stop_condition_ends_a_forward_pass_at_the_next_layer() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use target_engine::{stop, EngineError};
    let (_d, m) = tiny(Architecture::Qwen2, &LoadOptions::default());
    let n_layer = m.config().n_layer;
    assert!(n_layer >= 2);
    let ids: Vec<u32> = (1..40).collect();
    // Counts the checks; turns true after the first layer.
    let checks = Arc::new(AtomicUsize::new(0));
    let c = checks.clone();
    let after_one: stop::StopFn = Arc::new(move || c.fetch_add(1, Ordering::SeqCst) >= 1);
    let r = stop::with_stop(Some(after_one), || m.prefill(&ids));
    assert!(matches!(r, Err(EngineError::Stopped)), "{r:?}");
    assert_eq!(
        checks.load(Ordering::SeqCst),
        2,
        "stopped at the second layer's check"
    );
    // A condition that never fires is checked once per layer and changes nothing.
    let checks = Arc::new(AtomicUsize::new(0));
    let c = checks.clone();
    let never: stop::StopFn = Arc::new(move || {
        c.fetch_add(1, Ordering::SeqCst);
        false
    });
    let (_, watched) = stop::with_stop(Some(never), || m.prefill(&ids)).expect("prefill");
    let (_, plain) = m.prefill(&ids).expect("prefill");
    assert_eq!(checks.load(Ordering::SeqCst), n_layer);
    assert_eq!(watched, plain);
}

/// A model loaded with its weights requantized (issue 43's predictor (a)) says so in its
/// fingerprint, and its KV is close to the file's but not the same: a prediction, not a copy.
#[test]
fn requantized_weights_give_nearby_kv_under_another_fingerprint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, &TinySpec::new(Architecture::Qwen2)).expect("write tiny model");
    let file = Model::load(&path, &LoadOptions::default()).expect("load");
    let opts = LoadOptions {
        requantize: Some(target_engine::GgmlDType::Q4_0),
        ..LoadOptions::default()
    };
    let low = Model::load(&path, &opts).expect("load requantized");
    assert_ne!(file.fingerprint(), low.fingerprint());
    assert!(low.numerics().contains("requantize=requantized-Q4_0"));
    let ids: Vec<u32> = (0..40).map(|i| (i * 11 % 250) as u32).collect();
    let (a, b) = (
        file.precompute(&ids, None).expect("precompute"),
        low.precompute(&ids, None).expect("precompute"),
    );
    let (mut err, mut norm) = (0f64, 0f64);
    for (x, y) in a.k.iter().flatten().zip(b.k.iter().flatten()) {
        let (x, y) = (f64::from(x.to_f32()), f64::from(y.to_f32()));
        err += (x - y).powi(2);
        norm += x * x;
    }
    let rel = (err / norm).sqrt();
    assert!(rel > 0.0, "requantized weights must change the keys");
    assert!(rel < 0.5, "the keys stay close: relative error {rel}");
}
