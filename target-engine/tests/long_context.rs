//! Long-context drafters (issue 44): decoding from an approximate view of the cache (SpeCache's
//! top-k rows chosen on low-bit keys, a StreamingLLM window) and verified against full attention
//! gives full attention's greedy output token for token, however poor the view; a view that
//! sees every row answers as full attention does unverified; KIVI's quantized cache stays
//! within half a quantization step of the exact one.

mod common;

use target_engine::decode::sparse::{kl, log_softmax};
use target_engine::prelude::*;
use target_engine::testing::{write_tiny_gguf, TinySpec};
use target_engine::{
    kivi_cache, Architecture, AttentionView, ContextHead, LoadOptions, Model, Pick, RetrievalHead,
    SpeContextConfig, SpeContextView, TopKConfig, TopKView, ViewParams,
};

fn tiny() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, &TinySpec::new(Architecture::Qwen2)).expect("write");
    let m = Model::load(&path, &LoadOptions::default()).expect("load");
    (dir, m)
}

fn prompt(m: &Model, seed: usize) -> Vec<u32> {
    let text: String = (0..40)
        .map(|i| format!("w{} ", (i * 7 + seed * 13) % 23))
        .collect();
    m.tokenizer().encode(&text, false).ids
}

/// Verified drafting from `view` over a fresh prefill of `ids`: the generation and the cache
/// it leaves.
fn verified(
    m: &Model,
    ids: &[u32],
    view: &mut (dyn AttentionView + Send),
    max_tokens: usize,
) -> (target_engine::ViewGeneration, target_engine::KvCache) {
    let (mut cache, logits) = m.prefill(ids).expect("prefill");
    let params = ViewParams {
        max_tokens,
        ..ViewParams::default()
    };
    let got = m
        .view_verified_generate(&mut cache, &logits, view, &params)
        .expect("verified");
    (got, cache)
}

/// A view that sees little: two rows by score, a window of four, one sink, 2-bit keys.
fn poor() -> TopKView {
    TopKView::new(TopKConfig {
        bits: 2,
        group: 8,
        top_k: 2,
        window: 4,
        sink: 1,
        prefilter: 1,
        full_layers: 0,
    })
}

/// A view whose attention is noise: its drafts are mostly wrong (the tiny model is too
/// confident for a merely poor view to change its tokens), so verification must correct them.
struct Noise(rand::rngs::StdRng);

impl AttentionView for Noise {
    fn attend(
        &mut self,
        _layer: usize,
        q: &[f32],
        _positions: &[usize],
        _cache: &target_engine::KvCache,
        _shape: kernels::AttentionShape,
    ) -> target_engine::Result<Vec<f32>> {
        use rand::Rng;
        Ok(q.iter().map(|_| self.0.gen_range(-50.0..50.0)).collect())
    }
    fn invalidate_from(&mut self, _rows: usize) {}
    fn held_bytes(&self) -> usize {
        0
    }
    fn rows_read(&self) -> (u64, u64) {
        (0, 0)
    }
}

#[test]
fn verified_drafting_corrects_wrong_drafts() {
    use rand::SeedableRng;
    let (_d, m) = tiny();
    let (mut drafted, mut accepted) = (0, 0);
    for seed in 0..4 {
        let ids = prompt(&m, seed);
        let (mut full_cache, logits) = m.prefill(&ids).expect("prefill");
        let want = m
            .view_generate(&mut full_cache, &logits, None, 40)
            .expect("full attention");
        let mut noise = Noise(rand::rngs::StdRng::seed_from_u64(seed as u64));
        let (got, cache) = verified(&m, &ids, &mut noise, 40);
        assert_eq!(got.ids, want.ids, "prompt {seed}");
        assert_eq!(
            cache.k(1),
            full_cache.k(1),
            "prompt {seed}: rows rewritten exactly"
        );
        drafted += got.drafted;
        accepted += got.accepted;
    }
    assert!(
        accepted * 2 < drafted,
        "noise drafts must mostly be wrong ({accepted} of {drafted} accepted)"
    );
}

#[test]
fn verified_drafting_from_any_view_answers_as_full_attention() {
    let (_d, m) = tiny();
    for seed in 0..6 {
        let ids = prompt(&m, seed);
        let (mut full_cache, logits) = m.prefill(&ids).expect("prefill");
        let want = m
            .view_generate(&mut full_cache, &logits, None, 48)
            .expect("full attention");
        for mut view in [poor(), TopKView::new(TopKConfig::default())] {
            let (got, cache) = verified(&m, &ids, &mut view, 48);
            assert_eq!(got.ids, want.ids, "prompt {seed}, {:?}", view.config());
            assert_eq!(got.eos, want.eos);
            assert_eq!(cache.len(), full_cache.len(), "the same rows, all exact");
            for l in 0..cache.n_layer() {
                assert_eq!(cache.k(l), full_cache.k(l), "layer {l} keys");
                assert_eq!(cache.v(l), full_cache.v(l), "layer {l} values");
            }
            if view.config().top_k == 2 {
                let (read, all) = view.rows_read();
                assert!(
                    read < all,
                    "the poor view reads fewer rows ({read} of {all})"
                );
            }
        }
    }
}

#[test]
fn a_view_of_every_row_decodes_as_full_attention() {
    let (_d, m) = tiny();
    let ids = prompt(&m, 3);
    let (mut a, logits) = m.prefill(&ids).expect("prefill");
    let (mut b, _) = m.prefill(&ids).expect("prefill");
    let mut all = TopKView::new(TopKConfig {
        top_k: 4096,
        ..TopKConfig::default()
    });
    let full = m.view_generate(&mut a, &logits, None, 24).expect("full");
    let viewed = m
        .view_generate(&mut b, &logits, Some(&mut all), 24)
        .expect("view");
    assert_eq!(viewed.ids, full.ids);
    let (mut c, _) = m.prefill(&ids).expect("prefill");
    let (mut d, _) = m.prefill(&ids).expect("prefill");
    let p = m
        .view_log_probs(&mut c, &logits, &full.ids, None)
        .expect("full log-probs");
    let q = m
        .view_log_probs(&mut d, &logits, &full.ids, Some(&mut all))
        .expect("view log-probs");
    let worst = p.iter().zip(&q).map(|(p, q)| kl(p, q)).fold(0.0, f64::max);
    assert!(worst < 1e-6, "KL {worst}");
    let mut poor = poor();
    let (mut e, _) = m.prefill(&ids).expect("prefill");
    let r = m
        .view_log_probs(&mut e, &logits, &full.ids, Some(&mut poor))
        .expect("poor log-probs");
    // The tiny model puts nearly all mass on one token (KL ~0 either way): compare the
    // log-probabilities themselves.
    let moved = p
        .iter()
        .zip(&r)
        .flat_map(|(p, q)| p.iter().zip(q).map(|(a, b)| (a - b).abs()))
        .fold(0.0f32, f32::max);
    assert!(
        moved > 1e-3,
        "a poor view must change the log-probabilities ({moved})"
    );
    assert!((log_softmax(&[0.0, 0.0])[0] + std::f32::consts::LN_2).abs() < 1e-6);
}

#[test]
fn kivi_keeps_every_value_within_half_a_step_and_the_residual_exact() {
    let (_d, m) = tiny();
    let ids = prompt(&m, 1);
    let (cache, _) = m.prefill(&ids).expect("prefill");
    let c = m.config();
    let shape = kernels::AttentionShape {
        n_head: c.n_head,
        n_kv_head: c.n_kv_head,
        head_dim: c.head_dim,
    };
    let group = 16;
    let q = kivi_cache(&cache, shape, 4, group).expect("kivi");
    let whole = cache.len() / group * group;
    let row = cache.row_len();
    for l in 0..cache.n_layer() {
        let (k, qk) = (cache.k(l), q.k(l));
        let (v, qv) = (cache.v(l), q.v(l));
        assert_eq!(
            &k[whole * row..],
            &qk[whole * row..],
            "the residual stays exact"
        );
        assert_eq!(&v[whole * row..], &qv[whole * row..]);
        let span = |x: &[f32]| {
            x.iter().copied().fold(f32::MIN, f32::max) - x.iter().copied().fold(f32::MAX, f32::min)
        };
        let bound = (span(k).max(span(v))) / 15.0 / 2.0 + 1e-5;
        let worst = k[..whole * row]
            .iter()
            .zip(&qk[..whole * row])
            .chain(v[..whole * row].iter().zip(&qv[..whole * row]))
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        assert!(
            worst > 0.0 && worst <= bound,
            "layer {l}: {worst} vs {bound}"
        );
    }
}

#[test]
fn streamed_view_decoding_hands_out_what_plain_decoding_does() {
    use rand::SeedableRng;
    let (_d, m) = tiny();
    for (seed, stop_at) in [(0, 0), (1, 9), (2, 1)] {
        let ids = prompt(&m, seed);
        let params = target_engine::GenerateParams {
            max_tokens: 30,
            ..Default::default()
        };
        let run = |view: Option<&mut (dyn AttentionView + Send)>| {
            let (mut cache, logits) = m.prefill(&ids).expect("prefill");
            let (mut text, mut seen) = (String::new(), Vec::new());
            let mut on_text = |t: &str| {
                text.push_str(t);
                true
            };
            let mut watch = |ids: &[u32], pick: Pick| {
                assert_ne!(
                    pick.rival,
                    ids.last().copied(),
                    "the rival is another token"
                );
                seen.push((ids.len(), pick.gap));
                ids.len() == stop_at
            };
            let (g, stopped) = match view {
                Some(v) => {
                    let length = ViewParams::default().length;
                    let (g, s, _) = m
                        .decode_view(
                            target_engine::Prefilled {
                                cache: &mut cache,
                                logits,
                            },
                            v,
                            target_engine::ViewDraft {
                                params: &params,
                                length,
                                min_prob: 0.0,
                            },
                            &mut on_text,
                            &mut watch,
                        )
                        .expect("view");
                    (g, s)
                }
                None => m
                    .decode_watched(&mut cache, logits, &params, &mut on_text, &mut watch)
                    .expect("plain"),
            };
            (g.ids, g.finish, stopped, text, seen, cache.len())
        };
        let want = run(None);
        let mut noise = Noise(rand::rngs::StdRng::seed_from_u64(7));
        assert_eq!(run(Some(&mut noise)), want, "noise view, stop at {stop_at}");
        assert_eq!(run(Some(&mut poor())), want, "poor view, stop at {stop_at}");
    }
}

/// On the real Qwen-0.5B over ~1,500 tokens of this repository's architecture notes, a view
/// that attends to 64 rows per kv head (of ~1,500) drafts tokens full attention often
/// rejects, and the verified answer is still full attention's, token for token, with every
/// cache row equal to plain decoding's.
#[test]
fn on_a_real_model_verified_drafting_answers_as_full_attention() {
    let m = Model::load(
        &common::model_path(common::QWEN_05B),
        &LoadOptions::default(),
    )
    .expect("load");
    let prompt = architecture_prompt(&m);
    let mut view = TopKView::new(TopKConfig {
        top_k: 64,
        window: 32,
        prefilter: 2,
        ..TopKConfig::default()
    });
    let got = verified_as_plain(&m, &prompt, &mut view);
    let (read, all) = view.rows_read();
    assert!(read * 5 < all, "the view read {read} of {all} rows");
    assert!(
        got.accepted < got.drafted,
        "some drafts were wrong, so corrections were checked: {got:?}"
    );
}

/// ~1,500 tokens of the architecture notes and a question, as a chat prompt.
fn architecture_prompt(m: &Model) -> Vec<u32> {
    let notes = include_str!("../../ARCHITECTURE.md");
    let text: String = notes.chars().take(6000).collect();
    let prompt = target_engine::chat_prompt(
        m,
        None,
        &format!("{text}\n\nWhat does the kernels crate hold? Answer in detail."),
    );
    assert!(prompt.len() > 1000, "{} tokens", prompt.len());
    prompt
}

/// Verified drafting from `view` over `prompt`, 48 tokens, checked against plain decoding:
/// the same tokens and every cache row equal.
fn verified_as_plain(
    m: &Model,
    prompt: &[u32],
    view: &mut (dyn AttentionView + Send),
) -> target_engine::ViewGeneration {
    let (full_cache, logits) = m.prefill(prompt).expect("prefill");
    let mut plain = full_cache.clone();
    let want = m
        .view_generate(&mut plain, &logits, None, 48)
        .expect("full attention");
    let mut cache = full_cache;
    let params = ViewParams {
        max_tokens: 48,
        ..ViewParams::default()
    };
    let got = m
        .view_verified_generate(&mut cache, &logits, view, &params)
        .expect("verified");
    assert_eq!(got.ids, want.ids);
    assert_eq!(cache.len(), plain.len());
    for l in 0..cache.n_layer() {
        assert_eq!(cache.k(l), plain.k(l), "layer {l}");
        assert_eq!(cache.v(l), plain.v(l), "layer {l}");
    }
    got
}

/// SpeContext's view over the tiny model (its own layer 0 as the retrieval head): verified,
/// any setting answers as full attention with every cache row exact; one that keeps every row
/// resident answers as full attention unverified too, through its elastic loads.
#[test]
fn specontext_drafting_answers_as_full_attention() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, &TinySpec::new(Architecture::Qwen2)).expect("write");
    let m = std::sync::Arc::new(Model::load(&path, &LoadOptions::default()).expect("load"));
    let n_kv = m.config().n_kv_head;
    let poor = SpeContextConfig {
        layer: 1,
        top_k: 2,
        window: 3,
        sink: 1,
    };
    let all = SpeContextConfig {
        layer: 0,
        top_k: 4096,
        ..SpeContextConfig::default()
    };
    for seed in 0..4 {
        let ids = prompt(&m, seed);
        let (mut full_cache, logits) = m.prefill(&ids).expect("prefill");
        let want = m
            .view_generate(&mut full_cache, &logits, None, 40)
            .expect("full attention");
        for config in [poor, all] {
            let mut head = RetrievalHead::new(m.clone(), config.layer).expect("head");
            head.extend(0, &ids).expect("keys");
            let mut view = SpeContextView::new(Box::new(head), config, n_kv);
            let (got, cache) = verified(&m, &ids, &mut view, 40);
            assert_eq!(got.ids, want.ids, "prompt {seed}, {config:?}");
            for l in 0..cache.n_layer() {
                assert_eq!(cache.k(l), full_cache.k(l), "layer {l} keys");
                assert_eq!(cache.v(l), full_cache.v(l), "layer {l} values");
            }
            let (read, every) = view.rows_read();
            if config == poor {
                assert!(
                    read < every,
                    "the poor view reads fewer rows ({read} of {every})"
                );
                assert!(view.rows_loaded().is_some_and(|n| n > 0));
            }
        }
        // The contextual head: the model's own layer 0 over its cache of the prompt.
        let (own, _) = m.prefill(&ids).expect("prefill");
        let head = ContextHead::new(m.clone(), 0, own, &ids).expect("head");
        let mut view = SpeContextView::new(Box::new(head), poor, n_kv);
        let (got, _) = verified(&m, &ids, &mut view, 40);
        assert_eq!(got.ids, want.ids, "prompt {seed}, contextual head");
        let mut head = RetrievalHead::new(m.clone(), 0).expect("head");
        head.extend(0, &ids).expect("keys");
        let mut view = SpeContextView::new(Box::new(head), all, n_kv);
        let (mut c, _) = m.prefill(&ids).expect("prefill");
        let alone = m
            .view_generate(&mut c, &logits, Some(&mut view), 40)
            .expect("unverified");
        assert_eq!(alone.ids, want.ids, "prompt {seed}: every row resident");
    }
    let head = RetrievalHead::new(m.clone(), 2);
    assert!(head.is_err(), "the tiny model has two layers");
    let ids = prompt(&m, 0);
    let (own, _) = m.prefill(&ids).expect("prefill");
    assert!(ContextHead::new(m.clone(), 2, own.clone(), &ids).is_err());
    assert!(ContextHead::new(m.clone(), 0, own, &ids[1..]).is_err());
}

/// On the real Qwen-0.5B over ~1,500 tokens of the architecture notes, with a retrieval head
/// cut from its own layer 0 keeping 64 rows per kv head: verified, full attention's answer
/// token for token, the cache exact; elastic loading moves far fewer rows than attended.
#[test]
fn on_a_real_model_specontext_drafting_answers_as_full_attention() {
    let m = std::sync::Arc::new(
        Model::load(
            &common::model_path(common::QWEN_05B),
            &LoadOptions::default(),
        )
        .expect("load"),
    );
    let prompt = architecture_prompt(&m);
    let config = SpeContextConfig {
        layer: 0,
        top_k: 64,
        window: 32,
        sink: 4,
    };
    let mut head = RetrievalHead::new(m.clone(), config.layer).expect("head");
    head.extend(0, &prompt).expect("keys");
    let mut view = SpeContextView::new(Box::new(head), config, m.config().n_kv_head);
    verified_as_plain(&m, &prompt, &mut view);
    let (read, all) = view.rows_read();
    assert!(read * 5 < all, "the view read {read} of {all} rows");
    let loaded = view.rows_loaded().unwrap_or(u64::MAX);
    assert!(
        loaded * 2 < read,
        "elastic loading moved {loaded} rows for {read} attended"
    );
}

/// A contextual head asked to score past the rows it was fed cannot score: it keeps every
/// row (exact, never a panic), and scores again once asked at the row after its last.
#[test]
fn a_contextual_head_that_missed_rows_keeps_every_row() {
    use target_engine::RowScorer;
    let (_d, m) = tiny();
    let m = std::sync::Arc::new(m);
    let ids = prompt(&m, 2);
    let (own, _) = m.prefill(&ids).expect("prefill");
    let mut head = ContextHead::new(m.clone(), 1, own, &ids).expect("head");
    // A one-row pass fed without a step leaves attention behind; it must not leak.
    head.feed(ids.len(), &[9]).expect("feed");
    let far = ids.len() + 4;
    let imp = head.importance(5, far).expect("importance past a gap");
    assert_eq!(imp.len(), m.config().n_kv_head);
    assert!(imp
        .iter()
        .all(|v| v.len() == far + 1 && v.iter().all(|x| x.is_infinite())));
    let next = ids.len() + 1;
    let imp = head.importance(7, next).expect("importance");
    assert!(imp
        .iter()
        .all(|v| v.len() == next + 1 && v.iter().all(|x| x.is_finite())));
}
