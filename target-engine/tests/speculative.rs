//! Speculative decoding: with any drafter, the output equals plain greedy decoding over the
//! same cache token for token (ids, gaps, the watch's calls, text and finish), on tiny models
//! (a drafter that always agrees, one that rarely does) and on real prompts with the default
//! pairing's drafter (Qwen2.5-Coder-0.5B) drafting for itself over a reused cache. Sampled, the
//! sequences it draws follow the target's exact distribution (a chi-square test that a wrong
//! residual fails).

mod common;

use std::collections::HashMap;
use target_engine::prelude::*;

use target_engine::testing::{write_tiny_gguf, TinySpec};
use target_engine::{
    Architecture, ChunkKv, Drafter, GenerateParams, Generation, KvCache, LoadOptions, Model, Pick,
    PromptLookup, RagTemplate, SamplingParams, SelectInput, Selector, SpecDecodeStats, TargetProbe,
};

/// A smaller model of another architecture with the same vocabulary (random weights).
fn other_tiny() -> (tempfile::TempDir, Model) {
    tiny(TinySpec {
        seed: 99,
        n_layer: 1,
        n_embd: 32,
        n_head: 2,
        n_kv_head: 1,
        ..TinySpec::new(Architecture::Llama)
    })
}

fn tiny(spec: TinySpec) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, &spec).expect("write");
    let m = Model::load(&path, &LoadOptions::default()).expect("load");
    (dir, m)
}

/// What a decode handed out: the generation, whether the watch stopped it, the text pieces
/// and every (ids so far, pick) the watch saw.
type Decoded = (Generation, bool, String, Vec<(usize, Pick)>);

/// The text callback and the watch a decode is given, recording what they are shown (the watch
/// stops the decode at `stop_at` tokens; 0: never); returns `decode`'s result with the records.
fn recorded<R>(
    stop_at: usize,
    decode: impl FnOnce(
        &mut dyn FnMut(&str) -> bool,
        &mut dyn FnMut(&[u32], Pick) -> bool,
    ) -> target_engine::Result<R>,
) -> (R, String, Vec<(usize, Pick)>) {
    let (mut text, mut seen) = (String::new(), Vec::new());
    let r = decode(
        &mut |t| {
            text.push_str(t);
            true
        },
        &mut |ids, pick| {
            seen.push((ids.len(), pick));
            ids.len() == stop_at
        },
    )
    .expect("decode");
    (r, text, seen)
}

fn plain(m: &Model, prompt: &[u32], params: &GenerateParams, stop_at: usize) -> Decoded {
    let (mut cache, logits) = m.prefill(prompt).expect("prefill");
    let ((g, w), text, seen) = recorded(stop_at, |on_text, watch| {
        m.decode_watched(&mut cache, logits, params, on_text, watch)
    });
    (g, w, text, seen)
}

/// A drafting model over its cache of the prompt, proposing whatever probability it gives
/// (the tiny models' distributions are flat: the default floor would stop every draft).
fn model(drafter: (&Model, KvCache, Vec<f32>)) -> Drafter<'_> {
    Drafter::new(drafter.0, drafter.1, drafter.2).with_min_prob(0.0)
}

fn speculative(
    m: &Model,
    prompt: &[u32],
    drafter: (&Model, KvCache, Vec<f32>),
    params: &GenerateParams,
    stop_at: usize,
) -> (Decoded, SpecDecodeStats) {
    speculative_with(m, prompt, model(drafter), params, stop_at)
}

fn speculative_with(
    m: &Model,
    prompt: &[u32],
    mut d: Drafter<'_>,
    params: &GenerateParams,
    stop_at: usize,
) -> (Decoded, SpecDecodeStats) {
    let (mut cache, logits) = m.prefill(prompt).expect("prefill");
    let ((g, w, stats), text, seen) = recorded(stop_at, |on_text, watch| {
        m.decode_speculative(
            target_engine::Prefilled {
                cache: &mut cache,
                logits,
            },
            &mut d,
            params,
            on_text,
            watch,
        )
    });
    ((g, w, text, seen), stats)
}

fn assert_same(a: &Decoded, b: &Decoded, what: &str) {
    assert_eq!(a.0.ids, b.0.ids, "{what}: ids");
    assert_eq!(a.0.margins, b.0.margins, "{what}: gaps, bit for bit");
    assert_eq!(a.0.text, b.0.text, "{what}: text");
    assert_eq!(a.0.finish, b.0.finish, "{what}: finish");
    assert_eq!(a.1, b.1, "{what}: watched");
    assert_eq!(a.2, b.2, "{what}: streamed text");
    assert_eq!(a.3, b.3, "{what}: the watch's calls");
}

#[test]
fn speculative_decoding_hands_out_exactly_what_plain_decoding_does() {
    let (_a, target) = tiny(TinySpec::new(Architecture::Qwen2));
    let (_b, other) = other_tiny();
    let prompt = target
        .tokenizer()
        .encode("the ant sat in the tent", false)
        .ids;
    let mut totals = [(0, 0); 2];
    for max_tokens in [0, 1, 2, 7, 40] {
        for stop_at in [0, 3] {
            let params = GenerateParams {
                max_tokens,
                ..Default::default()
            };
            let want = plain(&target, &prompt, &params, stop_at);
            // The target drafting for itself over the same cache: every proposal agrees.
            let (c, l) = target.prefill(&prompt).expect("prefill");
            let (got, s) = speculative(&target, &prompt, (&target, c, l), &params, stop_at);
            assert_same(
                &got,
                &want,
                &format!("self, {max_tokens} tokens, stop {stop_at}"),
            );
            assert_eq!(
                s.accepted, s.drafted,
                "a drafter equal to the target agrees"
            );
            totals[0].0 += s.accepted;
            totals[0].1 += s.drafted;
            // Another model (random weights, so it agrees only by chance; the tiny models all
            // settle on one token): the output is the target's all the same.
            let (c, l) = other.prefill(&prompt).expect("prefill");
            let (got, s) = speculative(&target, &prompt, (&other, c, l), &params, stop_at);
            assert_same(
                &got,
                &want,
                &format!("other, {max_tokens} tokens, stop {stop_at}"),
            );
            totals[1].0 += s.accepted;
            totals[1].1 += s.drafted;
            assert!(s.rounds <= got.0.ids.len(), "at most one pass per token");
        }
    }
    assert!(totals[0].1 > 20, "the self-drafter drafted {:?}", totals[0]);
    assert!(
        totals[1].1 > 20,
        "the other drafter drafted {:?}",
        totals[1]
    );
}

#[test]
fn prompt_lookup_drafts_change_nothing_but_the_passes() {
    let (_a, target) = tiny(TinySpec::new(Architecture::Qwen2));
    let prompt = target
        .tokenizer()
        .encode("the ant sat in the tent the ant sat in the tin", false)
        .ids;
    let (mut drafted, mut lookup) = (0, 0);
    for max_tokens in [1, 5, 30] {
        let params = GenerateParams {
            max_tokens,
            ..Default::default()
        };
        let want = plain(&target, &prompt, &params, 0);
        let only = Drafter::lookup_only(PromptLookup::new(prompt.clone()));
        let (got, s) = speculative_with(&target, &prompt, only, &params, 0);
        assert_same(&got, &want, &format!("lookup, {max_tokens} tokens"));
        assert_eq!(s.lookup_drafted, s.drafted, "only lookup drafted");
        drafted += s.drafted;
        // Lookup first, the model where it finds nothing.
        let (c, l) = target.prefill(&prompt).expect("prefill");
        let both = model((&target, c, l)).with_lookup(PromptLookup::new(prompt.clone()));
        let (got, s) = speculative_with(&target, &prompt, both, &params, 0);
        assert_same(&got, &want, &format!("both, {max_tokens} tokens"));
        assert!(s.lookup_drafted <= s.drafted && s.lookup_accepted <= s.accepted);
        assert_eq!(
            s.accepted, s.drafted,
            "both drafters agree with the target here"
        );
        lookup += s.lookup_drafted;
    }
    assert!(
        drafted > 0 && lookup > 0,
        "lookup drafted {drafted}, {lookup}"
    );
}

#[test]
fn a_drafting_model_stops_at_a_proposal_under_its_probability_floor() {
    let (_a, m) = tiny(TinySpec::new(Architecture::Qwen2));
    let prompt = m.tokenizer().encode("the ant sat", false).ids;
    let params = GenerateParams {
        max_tokens: 12,
        ..Default::default()
    };
    let want = plain(&m, &prompt, &params, 0);
    // No probability reaches 1.5: nothing is ever proposed, and the answer is the same.
    let (c, l) = m.prefill(&prompt).expect("prefill");
    let d = Drafter::new(&m, c, l).with_min_prob(1.5);
    let (got, s) = speculative_with(&m, &prompt, d, &params, 0);
    assert_same(&got, &want, "floor above every probability");
    let passes = want.0.ids.len() - 1;
    assert_eq!(
        (s.drafted, s.rounds),
        (0, passes),
        "one pass per token after the first"
    );
    let (c, l) = m.prefill(&prompt).expect("prefill");
    let (_, s) = speculative(&m, &prompt, (&m, c, l), &params, 0);
    assert!(s.drafted > 0, "without a floor the same model drafts");
}

#[test]
fn a_drafter_that_cannot_be_built_costs_speed_not_the_answer() {
    let (_a, m) = tiny(TinySpec::new(Architecture::Qwen2));
    let prompt = m.tokenizer().encode("the ant sat", false).ids;
    let params = GenerateParams {
        max_tokens: 12,
        ..Default::default()
    };
    let want = plain(&m, &prompt, &params, 0);
    let (mut cache, logits) = m.prefill(&prompt).expect("prefill");
    let mut built = false;
    let mut d = Drafter::deferred(
        &m,
        Box::new(|| {
            built = true;
            Err(target_engine::EngineError::InvalidInput(
                "no stored KV".into(),
            ))
        }),
    );
    let ((g, w, stats), text, seen) = recorded(0, |on_text, watch| {
        m.decode_speculative(
            target_engine::Prefilled {
                cache: &mut cache,
                logits,
            },
            &mut d,
            &params,
            on_text,
            watch,
        )
    });
    drop(d);
    assert!(built, "the drafter was built once drafting started");
    assert_same(&(g, w, text, seen), &want, "without a drafter");
    assert_eq!(stats.drafted, 0);
    assert_eq!(
        stats.drafter_error.as_deref(),
        Some("invalid input: no stored KV")
    );
}

/// Sampled decoding at a temperature and nucleus that keep a few tokens per step.
fn sampled(seed: u64, max_tokens: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        sampling: SamplingParams {
            temperature: SAMPLE_T,
            top_p: SAMPLE_TOP_P,
            seed,
        },
        ..Default::default()
    }
}

/// The tiny models put nearly all mass on one token at temperature 1: a high temperature and a
/// narrow nucleus leave ~24k possible 3-token sequences, ~100 of them likely enough to count.
const SAMPLE_T: f32 = 8.0;
const SAMPLE_TOP_P: f32 = 0.4;

/// The exact probability of every sequence of `n` tokens the target samples after `prompt`
/// (enumerated over each step's nucleus; a sequence ends early at an end token).
fn exact_sequences(m: &Model, prompt: &[u32], n: usize) -> HashMap<Vec<u32>, f64> {
    let s = target_engine::Sampler::new(sampled(0, n).sampling);
    let (cache, logits) = m.prefill(prompt).expect("prefill");
    let mut out = HashMap::new();
    let mut stack = vec![(Vec::new(), 1.0f64, cache, logits)];
    while let Some((seq, prob, cache, logits)) = stack.pop() {
        let ended = seq
            .last()
            .is_some_and(|&t| m.tokenizer().is_end_of_generation(t));
        if seq.len() == n || ended {
            out.insert(seq, prob);
            continue;
        }
        for (id, p) in s.distribution(&logits).into_iter().enumerate() {
            if p <= 0.0 {
                continue;
            }
            let mut c = cache.clone();
            let pos = c.len();
            let f = m
                .forward(&[id as u32], &[pos], &mut c, false)
                .expect("step");
            let l = m.last_logits(&f).expect("logits");
            let mut next = seq.clone();
            next.push(id as u32);
            stack.push((next, prob * f64::from(p), c, l));
        }
    }
    out
}

/// Pearson's chi-square of `counts` against `exact` (sequences under 5 expected draws pooled
/// into one cell) and its 99.95% critical value (Wilson-Hilferty).
fn chi_square(counts: &HashMap<Vec<u32>, usize>, exact: &HashMap<Vec<u32>, f64>) -> (f64, f64) {
    let n: usize = counts.values().sum();
    let n = n as f64;
    let (mut stat, mut cells) = (0.0, 0usize);
    let (mut pooled_obs, mut pooled_exp) = (0.0, 0.0);
    for (seq, &p) in exact {
        let obs = counts.get(seq).copied().unwrap_or(0) as f64;
        if n * p < 5.0 {
            pooled_obs += obs;
            pooled_exp += n * p;
        } else {
            stat += (obs - n * p).powi(2) / (n * p);
            cells += 1;
        }
    }
    // Sequences the target never samples: any count of them is a failure.
    let impossible: usize = counts
        .iter()
        .filter(|(s, _)| !exact.contains_key(*s))
        .map(|(_, c)| c)
        .sum();
    pooled_obs += impossible as f64;
    if pooled_exp > 0.0 {
        stat += (pooled_obs - pooled_exp).powi(2) / pooled_exp.max(1e-9);
        cells += 1;
    } else if pooled_obs > 0.0 {
        stat = f64::INFINITY;
    }
    let df = (cells.max(2) - 1) as f64;
    let z = 3.29;
    let crit = df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3);
    (stat, crit)
}

#[test]
fn sampled_speculative_decoding_samples_the_targets_distribution() {
    let (_a, target) = tiny(TinySpec::new(Architecture::Qwen2));
    let (_b, other) = other_tiny();
    let tok = target.tokenizer();
    let prompt = tok.encode("the ant sat in the tent", false).ids;
    const N: u64 = 3000;
    const LEN: usize = 3;
    let exact = exact_sequences(&target, &prompt, LEN);
    let (tc, tl) = target.prefill(&prompt).expect("prefill");
    let (oc, ol) = other.prefill(&prompt).expect("prefill");
    let mut counts: [HashMap<Vec<u32>, usize>; 3] = Default::default();
    let (mut drafted, mut accepted, mut rejected) = (0, 0, 0);
    for seed in 0..N {
        let params = sampled(seed, LEN);
        // The other model drafting (sampled from its own distribution), lookup first.
        let mut d =
            model((&other, oc.clone(), ol.clone())).with_lookup(PromptLookup::new(prompt.clone()));
        let mut cache = tc.clone();
        let (g, _, s) = target
            .decode_speculative(
                target_engine::Prefilled {
                    cache: &mut cache,
                    logits: tl.clone(),
                },
                &mut d,
                &params,
                &mut |_| true,
                &mut |_, _| false,
            )
            .expect("decode");
        drafted += s.drafted;
        accepted += s.accepted;
        rejected += s.drafted - s.accepted;
        let spec_ids = g.ids.clone();
        *counts[0].entry(g.ids).or_default() += 1;
        // Plain sampling of the target, and of the drafter: the test's own sanity and power.
        let mut cache = tc.clone();
        let (g, _) = target
            .decode_watched(
                &mut cache,
                tl.clone(),
                &params,
                &mut |_| true,
                &mut |_, _| false,
            )
            .expect("plain");
        // The seeded sampler's draw depends on the token's index, not on the passes taken:
        // speculative decoding gives plain decoding's sample (issue 57).
        assert_eq!(spec_ids, g.ids, "seed {seed}: speculative vs plain sample");
        *counts[1].entry(g.ids).or_default() += 1;
        let mut cache = oc.clone();
        let (g, _) = other
            .decode_watched(
                &mut cache,
                ol.clone(),
                &params,
                &mut |_| true,
                &mut |_, _| false,
            )
            .expect("drafter");
        *counts[2].entry(g.ids).or_default() += 1;
    }
    check_chi_square(&counts, &exact, (drafted, accepted, rejected));
}

fn check_chi_square(
    counts: &[HashMap<Vec<u32>, usize>; 3],
    exact: &HashMap<Vec<u32>, f64>,
    (drafted, accepted, rejected): (usize, usize, usize),
) {
    let [spec, plain, drafter] = [0, 1, 2].map(|i| chi_square(&counts[i], exact));
    eprintln!(
        "{} sequences possible; chi2 (stat, 99.95% crit): speculative {spec:?}, plain {plain:?}, \
         drafter alone {drafter:?}; drafted {drafted}, accepted {accepted}",
        exact.len()
    );
    assert!(
        spec.0 < spec.1,
        "speculative samples follow the target: {spec:?}"
    );
    assert!(
        plain.0 < plain.1,
        "plain samples follow the target: {plain:?}"
    );
    assert!(
        drafter.0 > drafter.1,
        "the drafter's own samples do not (the test can tell): {drafter:?}"
    );
    assert!(
        accepted > 0 && rejected > 0,
        "drafts were both kept and rejected: {accepted} of {drafted}"
    );
}

#[test]
fn a_real_drafter_over_a_reused_cache_leaves_the_answer_unchanged() {
    let m = Model::load(
        &common::model_path(common::QWEN_05B),
        &LoadOptions::default(),
    )
    .expect("load");
    const DOCS: [&str; 3] = [
        "The Oskel bridge was rebuilt in 1847 by the guild of Varn after the spring flood.",
        "Lady Imra keeps the salt ledger in the northern archive, next to two silver compasses.",
        "Seventeen copper bells hang in the tower of Dunmere, the largest cast in 1790.",
    ];
    const QUESTIONS: [&str; 3] = [
        "Who rebuilt the Oskel bridge, and when?",
        "Where is the salt ledger kept? Describe the archive.",
        "How many bells hang in the tower of Dunmere?",
    ];
    let (mut drafted, mut accepted, mut looked_up) = (0, 0, 0);
    for q in QUESTIONS {
        let asm = RagTemplate::default().assemble(m.tokenizer(), &DOCS, q);
        let prefix = m.prefix_kv(&asm.ids[asm.prefix_range()]).expect("prefix");
        let kvs: Vec<ChunkKv> = asm
            .chunks()
            .map(|s| {
                m.precompute(&asm.ids[s.ids.clone()], Some(&prefix))
                    .expect("kv")
            })
            .collect();
        let refs: Vec<&ChunkKv> = kvs.iter().collect();
        let params = GenerateParams {
            max_tokens: 48,
            ..Default::default()
        };
        // The target decodes from the full prefill; the drafter (the same weights) reads the
        // reused cache, as a drafter reading stored chunk KV does: close, not equal.
        let want = plain(&m, &asm.ids, &params, 0);
        let blended = TargetProbe::default()
            .prefill(&SelectInput::new(&m, &asm, &prefix, &refs, 0.0))
            .expect("blend");
        let (got, s) = speculative(
            &m,
            &asm.ids,
            (&m, blended.cache, blended.logits),
            &params,
            0,
        );
        assert_same(&got, &want, q);
        drafted += s.drafted;
        accepted += s.accepted;
        // Prompt lookup over the same prompt: the answer copies names and dates from it.
        let only = Drafter::lookup_only(PromptLookup::new(asm.ids.clone()));
        let (got, s) = speculative_with(&m, &asm.ids, only, &params, 0);
        assert_same(&got, &want, &format!("{q} (lookup)"));
        looked_up += s.lookup_accepted;
    }
    eprintln!("real prompts: {accepted} of {drafted} drafted tokens accepted, lookup {looked_up}");
    assert!(looked_up > 0, "prompt lookup guessed some tokens");
    assert!(accepted > 0, "the drafter guessed some tokens");
    assert!(
        accepted < drafted,
        "and missed some, which the target corrected"
    );
}
