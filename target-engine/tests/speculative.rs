//! Speculative decoding: with any drafter, the output equals plain greedy decoding over the
//! same cache token for token (ids, gaps, the watch's calls, text and finish), on tiny models
//! (a drafter that always agrees, one that rarely does) and on real prompts with the default
//! pairing's drafter (Qwen2.5-Coder-0.5B) drafting for itself over a reused cache.

mod common;

use target_engine::testing::{write_tiny_gguf, TinySpec};
use target_engine::{
    Architecture, ChunkKv, Drafter, GenerateParams, Generation, KvCache, LoadOptions, Model,
    PromptLookup, RagTemplate, SamplingParams, SelectInput, Selector, SpecDecodeStats, TargetProbe,
};

fn tiny(spec: TinySpec) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, &spec).expect("write");
    let m = Model::load(&path, &LoadOptions::default()).expect("load");
    (dir, m)
}

/// What a decode handed out: the generation, whether the watch stopped it, the text pieces
/// and every (ids so far, gap) the watch saw.
type Decoded = (Generation, bool, String, Vec<(usize, f32)>);

/// The text callback and the watch a decode is given, recording what they are shown (the watch
/// stops the decode at `stop_at` tokens; 0: never); returns `decode`'s result with the records.
fn recorded<R>(
    stop_at: usize,
    decode: impl FnOnce(
        &mut dyn FnMut(&str) -> bool,
        &mut dyn FnMut(&[u32], f32) -> bool,
    ) -> target_engine::Result<R>,
) -> (R, String, Vec<(usize, f32)>) {
    let (mut text, mut seen) = (String::new(), Vec::new());
    let r = decode(
        &mut |t| {
            text.push_str(t);
            true
        },
        &mut |ids, gap| {
            seen.push((ids.len(), gap));
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
        m.decode_speculative((&mut cache, logits), &mut d, params, on_text, watch)
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
    // A smaller model of another architecture with the same vocabulary.
    let (_b, other) = tiny(TinySpec {
        seed: 99,
        n_layer: 1,
        n_embd: 32,
        n_head: 2,
        n_kv_head: 1,
        ..TinySpec::new(Architecture::Llama)
    });
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
        m.decode_speculative((&mut cache, logits), &mut d, &params, on_text, watch)
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

#[test]
fn sampled_decoding_is_refused_rather_than_silently_greedy() {
    let (_a, m) = tiny(TinySpec::new(Architecture::Qwen2));
    let prompt = m.tokenizer().encode("the ant", false).ids;
    let (mut cache, logits) = m.prefill(&prompt).expect("prefill");
    let (c, l) = m.prefill(&prompt).expect("prefill");
    let params = GenerateParams {
        sampling: SamplingParams {
            temperature: 0.7,
            ..Default::default()
        },
        ..Default::default()
    };
    let err = m
        .decode_speculative(
            (&mut cache, logits),
            &mut Drafter::new(&m, c, l),
            &params,
            &mut |_| true,
            &mut |_, _| false,
        )
        .expect_err("sampling refused");
    assert!(err.to_string().contains("greedy"), "{err}");
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
