//! Lossless verification: the verified output equals the full-recompute greedy output token for
//! token, on tiny models (both modes, a corrupted draft cache) and on 20 real prompts with the
//! default target at ρ = 0 and 0.15, also with a drafter proposing tokens over the full cache.

mod common;

use target_engine::prelude::*;
use target_engine::testing::{write_tiny_gguf, TinySpec};
use target_engine::{
    Architecture, ChunkKv, Continuation, Drafter, Epic, GenerateParams, KvCache, LoadOptions,
    Model, PromptLookup, RagTemplate, Sampler, SamplingParams, SelectInput, Selector, VerifyEvent,
    VerifyMode, VerifyParams,
};

fn greedy() -> Sampler {
    Sampler::new(SamplingParams::default())
}

/// Greedy output of full recompute: full prefill, then one-token decode steps.
fn reference(m: &Model, ids: &[u32], max_tokens: usize) -> Vec<u32> {
    m.generate(
        ids,
        &GenerateParams {
            max_tokens,
            ..Default::default()
        },
    )
    .expect("generate")
    .ids
}

struct Case {
    asm: target_engine::Assembly,
    prefix: target_engine::PrefixKv,
    kvs: Vec<ChunkKv>,
}

fn case(m: &Model, docs: &[&str], question: &str) -> Case {
    let asm = RagTemplate::default().assemble(m.tokenizer(), docs, question);
    let prefix = m.prefix_kv(&asm.ids[asm.prefix_range()]).expect("prefix");
    let kvs = asm
        .chunks()
        .map(|s| {
            m.precompute(&asm.ids[s.ids.clone()], Some(&prefix))
                .expect("kv")
        })
        .collect();
    Case { asm, prefix, kvs }
}

/// The blended cache at ratio `ratio` (EPIC at the budget: deterministic and cheap).
fn draft(m: &Model, c: &Case, ratio: f64) -> (KvCache, Vec<f32>) {
    let refs: Vec<&ChunkKv> = c.kvs.iter().collect();
    let input = SelectInput::new(m, &c.asm, &c.prefix, &refs, ratio);
    let out = Epic::default().prefill(&input).expect("blend");
    (out.cache, out.logits)
}

fn verified(
    m: &Model,
    c: &Case,
    d: (KvCache, Vec<f32>),
    params: &VerifyParams,
) -> (target_engine::VerifiedGeneration, Vec<VerifyEvent>) {
    let mut events = Vec::new();
    let ids = c.asm.ids.clone();
    let g = m
        .verified_generate(
            d.into(),
            || m.prefill(&ids).map(Into::into),
            params,
            &mut |e| {
                events.push(e);
                true
            },
        )
        .expect("verify");
    (g, events)
}

/// [`verified`] with `drafter` proposing tokens once decoding goes on from the full cache
/// (which is ready from the start here).
fn verified_drafting(
    m: &Model,
    c: &Case,
    d: (KvCache, Vec<f32>),
    params: &VerifyParams,
    drafter: &mut Drafter<'_>,
) -> (target_engine::VerifiedGeneration, Vec<VerifyEvent>) {
    let mut events = Vec::new();
    let (tx, rx) = std::sync::mpsc::channel();
    tx.send(m.prefill(&c.asm.ids).map(Into::into))
        .expect("send");
    let g = m
        .verified_generate_from(
            d.into(),
            rx,
            params,
            &mut |e| {
                events.push(e);
                true
            },
            Some(drafter),
        )
        .expect("verify");
    (g, events)
}

/// The committed stream reconstructed from the events equals the returned ids.
fn committed_from(events: &[VerifyEvent]) -> Vec<u32> {
    events
        .iter()
        .filter_map(|e| match e {
            VerifyEvent::Commit { ids } => Some(ids.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

fn tiny() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, &TinySpec::new(Architecture::Qwen2)).expect("write");
    let m = Model::load(&path, &LoadOptions::default()).expect("load");
    (dir, m)
}

/// Two short chunks and a question about one of them, on the tiny model.
fn antenna_case(m: &Model) -> Case {
    case(
        m,
        &[
            "the thin ant ran in the sand",
            "a hint: the antenna is in the attic",
        ],
        "where is the antenna?",
    )
}

#[test]
fn verified_output_equals_full_recompute_on_a_tiny_model_in_both_modes() {
    let (_d, m) = tiny();
    let c = antenna_case(&m);
    let want = reference(&m, &c.asm.ids, 40);
    for mode in [
        VerifyMode::FromFull,
        VerifyMode::DraftEvery(4),
        VerifyMode::DraftEvery(15),
    ] {
        for ratio in [0.0, 0.15, 1.0] {
            let params = VerifyParams {
                logprobs: None,
                max_tokens: 40,
                mode,
                max_early_drafts: 6,
            };
            let (g, events) = verified(&m, &c, draft(&m, &c, ratio), &params);
            assert_eq!(g.ids, want, "{mode:?} at ratio {ratio}");
            assert_eq!(committed_from(&events), g.ids);
            assert_eq!(
                g.drafted,
                g.accepted
                    + events
                        .iter()
                        .map(|e| match e {
                            VerifyEvent::Retract { n } => *n,
                            _ => 0,
                        })
                        .sum::<usize>()
                    + pending_drafts(&events),
                "{mode:?}: every draft is accepted or retracted"
            );
        }
    }
    // Speculative decoding from the full cache: prompt lookup, then the model drafting over
    // the blended cache (close to the full one, not equal).
    let params = VerifyParams {
        logprobs: None,
        max_tokens: 40,
        mode: VerifyMode::FromFull,
        max_early_drafts: 6,
    };
    let mut lookup = Drafter::lookup_only(PromptLookup::new(c.asm.ids.clone()));
    let (g, events) = verified_drafting(&m, &c, draft(&m, &c, 0.0), &params, &mut lookup);
    assert_eq!(g.ids, want, "with prompt lookup");
    assert_eq!(committed_from(&events), g.ids);
    let (cache, logits) = draft(&m, &c, 0.15);
    let mut model = Drafter::new(&m, cache, logits).with_min_prob(0.0);
    let (g, _) = verified_drafting(&m, &c, draft(&m, &c, 0.15), &params, &mut model);
    assert_eq!(g.ids, want, "with the model drafting");
    assert!(
        g.spec.drafted > 0 && g.spec.rounds < want.len(),
        "drafts saved passes: {:?}",
        g.spec
    );
}

/// Verification's exactness on every family the engine runs (Qwen3's head norms and own head
/// width, Llama 3's RoPE factors included): from a blended draft at ρ 0 and 0.15, the
/// verified output is full recompute's greedy output.
#[test]
fn verified_output_equals_full_recompute_on_every_family() {
    for (name, spec) in target_engine::testing::family_specs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tiny.gguf");
        write_tiny_gguf(&path, &spec).expect("write");
        let m = Model::load(&path, &LoadOptions::default()).expect("load");
        let c = antenna_case(&m);
        let want = reference(&m, &c.asm.ids, 24);
        let params = VerifyParams {
            logprobs: None,
            max_tokens: 24,
            mode: VerifyMode::FromFull,
            max_early_drafts: 6,
        };
        for ratio in [0.0, 0.15] {
            let (g, events) = verified(&m, &c, draft(&m, &c, ratio), &params);
            assert_eq!(g.ids, want, "{name} at ratio {ratio}");
            assert_eq!(committed_from(&events), g.ids, "{name}");
        }
    }
}

/// The fidelity guard's continuation: whatever was decoded before (the full output's own
/// prefix, a prefix that goes wrong, unrelated tokens, more than `max_tokens`), the result
/// equals full recompute's greedy output, the agreeing prefix is kept, the rest withdrawn.
#[test]
fn continuing_from_the_full_cache_equals_full_recompute_whatever_came_before() {
    let (_d, m) = tiny();
    let c = antenna_case(&m);
    let max = 40;
    let want = reference(&m, &c.asm.ids, max);
    let wrong = |t: u32| (t + 1) % 200;
    let mut diverging = want[..5].to_vec();
    diverging.extend(want[5..12].iter().map(|&t| wrong(t)));
    let mut too_long = want.clone();
    too_long.extend([1, 2, 3]);
    let cases: Vec<(Vec<u32>, usize)> = vec![
        (Vec::new(), 0),
        (want[..10].to_vec(), 10),
        (diverging, 5),
        (want.iter().map(|&t| wrong(t)).take(8).collect(), 0),
        (too_long, max),
    ];
    for (generated, agreeing) in cases {
        let mut events = Vec::new();
        let full = m.prefill(&c.asm.ids).expect("prefill");
        let g = m
            .continue_exact(
                full.into(),
                Continuation {
                    logprobs: None,
                    generated: &generated,
                    max_tokens: max,
                    pick: greedy(),
                },
                &mut |e| {
                    events.push(e);
                    true
                },
                None,
            )
            .expect("continue");
        assert_eq!(g.ids, want, "after {generated:?}");
        // A drafter proposing for the decode after the kept prefix changes nothing.
        let full = m.prefill(&c.asm.ids).expect("prefill");
        let (cache, logits) = m.prefill(&c.asm.ids).expect("prefill");
        let mut d = Drafter::new(&m, cache, logits).with_min_prob(0.0);
        let drafted = m
            .continue_exact(
                full.into(),
                Continuation {
                    logprobs: None,
                    generated: &generated,
                    max_tokens: max,
                    pick: greedy(),
                },
                &mut |_| true,
                Some(&mut d),
            )
            .expect("continue");
        assert_eq!(drafted.ids, want, "drafting, after {generated:?}");
        assert_eq!(
            drafted.spec.accepted, drafted.spec.drafted,
            "a self-drafter agrees"
        );
        assert_eq!(g.accepted, agreeing, "after {generated:?}");
        let withdrawn: usize = events
            .iter()
            .map(|e| match e {
                VerifyEvent::Retract { n } => *n,
                _ => 0,
            })
            .sum();
        assert_eq!(withdrawn, generated.len().min(max) - agreeing);
        // The kept prefix plus what was committed is the whole output.
        let mut stream = want[..agreeing].to_vec();
        stream.extend(committed_from(&events));
        assert_eq!(stream, want, "after {generated:?}");
    }
}

/// The guard's continuation of a sampled answer (issue 57): the tokens sampled from a reused
/// cache are checked against the full cache's own draws at the same indices with the same
/// seed, the agreeing prefix kept, and the result is the full cache's sample for that seed,
/// the one a plain sampled decode from the full prefill gives.
#[test]
fn a_sampled_continuation_is_full_recomputes_sample_for_the_seed() {
    let (_d, m) = tiny();
    let c = antenna_case(&m);
    let max = 24;
    let (mut kept_some, mut withdrew_some) = (false, false);
    for seed in 0..12u64 {
        let params = GenerateParams {
            max_tokens: max,
            sampling: SamplingParams {
                temperature: 8.0,
                top_p: 0.4,
                seed,
            },
            ..Default::default()
        };
        let want = m.generate(&c.asm.ids, &params).expect("full").ids;
        // Sampled from the blended cache (close to the full one, not equal).
        let (mut cache, logits) = draft(&m, &c, 0.0);
        let (approx, _) = m
            .decode_watched(&mut cache, logits, &params, &mut |_| true, &mut |_, _| {
                false
            })
            .expect("approx");
        let got = m
            .continue_exact(
                m.prefill(&c.asm.ids).expect("prefill").into(),
                Continuation {
                    logprobs: None,
                    generated: &approx.ids,
                    max_tokens: max,
                    pick: Sampler::new(params.sampling),
                },
                &mut |_| true,
                None,
            )
            .expect("continue");
        assert_eq!(got.ids, want, "seed {seed}");
        kept_some |= got.accepted > 0;
        withdrew_some |= got.accepted < approx.ids.len().min(max);
    }
    assert!(kept_some, "some sampled tokens were kept");
    assert!(withdrew_some, "the case crosses a withdrawal");
}

#[test]
fn verified_output_equals_full_recompute_with_bf16_attention() {
    if !kernels::AttentionPrecision::Bf16.supported() {
        eprintln!("skipped: no AVX-512 BF16 on this CPU");
        return;
    }
    // Heads of 64 (the bf16 path's size): 256 wide, 4 heads.
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny64.gguf");
    let spec = TinySpec {
        n_embd: 256,
        ..TinySpec::new(Architecture::Qwen2)
    };
    write_tiny_gguf(&path, &spec).expect("write");
    let load = |attention| {
        Model::load(
            &path,
            &LoadOptions {
                attention,
                ..LoadOptions::default()
            },
        )
        .expect("load")
    };
    let (m, f32_model) = (
        load(kernels::AttentionPrecision::Bf16),
        load(kernels::AttentionPrecision::F32),
    );
    let c = antenna_case(&m);
    let (_, bf16_logits) = m.prefill(&c.asm.ids).expect("prefill");
    let (_, f32_logits) = f32_model.prefill(&c.asm.ids).expect("prefill");
    let diff = bf16_logits
        .iter()
        .zip(&f32_logits)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let scale = f32_logits.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(diff > 0.0, "the bf16 model ran f32 attention");
    assert!(
        diff < 0.05 * scale,
        "bf16 logits {diff} from f32's (of {scale})"
    );
    // Decode steps and verification passes read the incrementally packed mirror; prefill
    // and blends repack what they write: the verified output is still full recompute's.
    let want = reference(&m, &c.asm.ids, 30);
    for mode in [VerifyMode::FromFull, VerifyMode::DraftEvery(4)] {
        for ratio in [0.0, 0.15, 1.0] {
            let params = VerifyParams {
                logprobs: None,
                max_tokens: 30,
                mode,
                max_early_drafts: 6,
            };
            let (g, _) = verified(&m, &c, draft(&m, &c, ratio), &params);
            assert_eq!(g.ids, want, "{mode:?} at ratio {ratio}");
        }
    }
}

/// Drafts neither accepted nor retracted (cut by the end of generation).
fn pending_drafts(events: &[VerifyEvent]) -> usize {
    let last_verdict = events
        .iter()
        .rposition(|e| !matches!(e, VerifyEvent::Draft { .. }))
        .map_or(0, |i| i + 1);
    events[last_verdict..].len()
}

#[test]
fn a_corrupted_draft_cache_still_yields_the_exact_output() {
    let (_d, m) = tiny();
    let c = case(&m, &["the thin ant ran in the sand"], "what ran?");
    let want = reference(&m, &c.asm.ids, 24);
    let (mut cache, mut logits) = draft(&m, &c, 0.0);
    // Garbage in every reused row and in the logits the first draft comes from.
    let positions: Vec<usize> = (0..cache.len()).collect();
    let n = positions.len() * cache.row_len();
    for l in 0..m.config().n_layer {
        cache
            .set_rows(l, &positions, &vec![3.0; n], &vec![-2.0; n])
            .expect("corrupt");
    }
    logits
        .iter_mut()
        .enumerate()
        .for_each(|(i, x)| *x = (i % 7) as f32);
    for mode in [VerifyMode::FromFull, VerifyMode::DraftEvery(5)] {
        let params = VerifyParams {
            logprobs: None,
            max_tokens: 24,
            mode,
            max_early_drafts: 8,
        };
        let (g, _) = verified(&m, &c, (cache.clone(), logits.clone()), &params);
        assert_eq!(g.ids, want, "{mode:?}");
        assert!(g.corrected >= 1, "the garbage drafts were corrected");
    }
}

#[test]
fn verified_output_equals_full_recompute_on_20_real_prompts() {
    let m = Model::load(
        &common::model_path(common::QWEN_05B),
        &LoadOptions::default(),
    )
    .expect("load");
    const FACTS: [&str; 10] = [
        "The Oskel bridge was rebuilt in 1847 by the guild of Varn after the spring flood.",
        "Lady Imra keeps the salt ledger in the northern archive, next to two silver compasses.",
        "The observatory on Tarn hill recorded an unusual comet during the winter fair.",
        "Every miller in Dunmere pays the river toll in copper bells, seventeen a season.",
        "The ferry captain Odo Brask repaired the canal locks without telling the council.",
        "Our chemist distilled a blue dye from the orchard's late plums in 1851.",
        "A courier named Selka carried the forgotten treaty across the pass in four days.",
        "The council of Varn meets on the first day of every month in the old mill.",
        "Seventeen copper bells hang in the tower of Dunmere, the largest cast in 1790.",
        "The northern canal freezes for six weeks each year, closing the ferry route.",
    ];
    const QUESTIONS: [&str; 10] = [
        "Who rebuilt the Oskel bridge?",
        "Where is the salt ledger kept?",
        "What did the observatory record?",
        "How do millers pay the river toll?",
        "Who repaired the canal locks?",
        "What did the chemist make?",
        "Who carried the treaty?",
        "When does the council meet?",
        "How many bells hang in the tower?",
        "Why does the ferry route close?",
    ];
    let (mut accepted, mut drafted, mut looked_up) = (0, 0, 0);
    for p in 0..20 {
        let docs: Vec<&str> = (0..3).map(|j| FACTS[(p + 3 * j) % 10]).collect();
        let c = case(&m, &docs, QUESTIONS[p % 10]);
        let want = reference(&m, &c.asm.ids, 16);
        for ratio in [0.0, 0.15] {
            let mode = if p % 2 == 0 {
                VerifyMode::FromFull
            } else {
                VerifyMode::DraftEvery(6)
            };
            let params = VerifyParams {
                logprobs: None,
                max_tokens: 16,
                mode,
                max_early_drafts: 8,
            };
            let (g, events) = verified(&m, &c, draft(&m, &c, ratio), &params);
            assert_eq!(
                g.ids,
                want,
                "prompt {p} at ratio {ratio} ({mode:?}): {:?} vs {:?}",
                m.tokenizer().decode(&g.ids, false),
                m.tokenizer().decode(&want, false)
            );
            assert_eq!(committed_from(&events), g.ids);
            accepted += g.accepted;
            drafted += g.drafted;
        }
        // Composed with speculative decoding (prompt lookup over the full cache).
        let params = VerifyParams {
            logprobs: None,
            max_tokens: 16,
            mode: VerifyMode::FromFull,
            max_early_drafts: 8,
        };
        let mut lookup = Drafter::lookup_only(PromptLookup::new(c.asm.ids.clone()));
        let (g, _) = verified_drafting(&m, &c, draft(&m, &c, 0.0), &params, &mut lookup);
        assert_eq!(g.ids, want, "prompt {p} with prompt lookup drafting");
        looked_up += g.spec.accepted;
    }
    eprintln!(
        "real prompts: {accepted} of {drafted} drafted tokens accepted; lookup kept {looked_up}"
    );
    assert!(drafted > 0);
    assert!(looked_up > 0, "prompt lookup drafted for the full cache");
}
