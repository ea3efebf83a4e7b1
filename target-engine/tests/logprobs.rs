//! Each answer token's logprobs come from the row that chose it, whichever pass that was: a
//! plain decode step, a speculative pass, a verification pass over the full cache, or an
//! escalation's continuation. Greedy decoding from the full cache is the oracle: every exact
//! path returns its tokens and the same logprobs, bit for bit (verification and speculative
//! rows are computed on the decode path), and each token is its row's first alternative with
//! the top-2 gap the guard reads.

use target_engine::prelude::*;
use target_engine::testing::{write_tiny_gguf, TinyRag, TinySpec};
use target_engine::{
    Architecture, ChunkKv, Continuation, Drafter, FilledCache, FullReuse, GenerateParams,
    LoadOptions, Model, Prefilled, PromptLookup, Sampler, SelectInput, Selector, VerifyMode,
    VerifyParams,
};

const MAX: usize = 12;
const TOP: usize = 3;

/// The tiny model as served: decode steps and checking rows on the same int8 kernels on
/// every CPU (off AVX-512 VNNI a model loaded with `dense_min_rows: 1` would run its one-row
/// steps on f32 panels and its checking rows on int8, a different rounding).
fn tiny() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, &TinySpec::new(Architecture::Qwen2)).expect("write");
    let m = Model::load(&path, &LoadOptions::default()).expect("load");
    (dir, m)
}

fn params() -> GenerateParams {
    GenerateParams {
        max_tokens: MAX,
        logprobs: Some(TOP),
        ..Default::default()
    }
}

/// The blended cache of `s` reusing every chunk as stored (the approximate side).
fn reused(m: &Model, s: &TinyRag) -> FilledCache {
    let refs: Vec<&ChunkKv> = s.standalone.iter().collect();
    let input = SelectInput::new(m, &s.asm, &s.prefix, &refs, 0.0);
    let out = FullReuse.prefill(&input).expect("blend");
    FilledCache {
        cache: out.cache,
        logits: out.logits,
    }
}

/// Greedy decoding from the full prefill of `ids` with logprobs: the oracle. Checks that each
/// token is its row's most likely, with the top-2 gap the guard reads.
fn oracle(m: &Model, ids: &[u32]) -> target_engine::Generation {
    let (mut cache, logits) = m.prefill(ids).expect("prefill");
    let (plain, _) = m
        .decode_watched(&mut cache, logits, &params(), &mut |_| true, &mut |_, _| {
            false
        })
        .expect("decode");
    assert!(
        plain.ids.len() >= 2,
        "the oracle answer has tokens: {:?}",
        plain.ids
    );
    assert_eq!(plain.logprobs.len(), plain.ids.len());
    for (i, t) in plain.logprobs.iter().enumerate() {
        assert_eq!(t.chosen.id, plain.ids[i]);
        assert_eq!(t.top.len(), TOP);
        // Greedy: the token is its row's most likely, and the top-2 gap the guard reads is
        // the gap between the first two alternatives (a difference of logprobs is one of
        // logits, up to the rounding of the log-sum-exp).
        assert_eq!(t.top[0].id, t.chosen.id);
        assert_eq!(t.top[0].logprob, t.chosen.logprob);
        let gap = t.top[0].logprob - t.top[1].logprob;
        assert!(
            (gap - plain.margins[i]).abs() < 1e-4,
            "{gap} vs {}",
            plain.margins[i]
        );
        assert!(t.chosen.logprob <= 0.0);
    }
    plain
}

#[test]
fn every_exact_path_returns_full_recomputes_tokens_with_the_same_logprobs() {
    let (_d, m) = tiny();
    let s = TinyRag::new(&m).expect("setup");
    let ids = s.asm.ids.clone();
    let plain = oracle(&m, &ids);

    // Verification: drafts from the reused cache, every committed token chosen by a row of a
    // verification pass over the full cache.
    for mode in [VerifyMode::FromFull, VerifyMode::DraftEvery(4)] {
        let (tx, rx) = std::sync::mpsc::channel();
        tx.send(m.prefill(&ids).map(Into::into)).expect("send");
        let vp = VerifyParams {
            max_tokens: MAX,
            mode,
            logprobs: Some(TOP),
            ..Default::default()
        };
        let v = m
            .verified_generate_from(reused(&m, &s), rx, &vp, &mut |_| true, None)
            .expect("verify");
        assert_eq!(v.ids, plain.ids, "{mode}");
        assert_eq!(v.logprobs, plain.logprobs, "{mode}");
    }

    // The guard's escalation: what the reused cache decoded, checked and continued from the
    // full cache.
    let FilledCache { mut cache, logits } = reused(&m, &s);
    let (approx, _) = m
        .decode_watched(&mut cache, logits, &params(), &mut |_| true, &mut |_, _| {
            false
        })
        .expect("approx");
    let answer = Continuation {
        generated: &approx.ids,
        max_tokens: MAX,
        pick: Sampler::new(Default::default()),
        logprobs: Some(TOP),
    };
    let full = m.prefill(&ids).expect("prefill").into();
    let c = m
        .continue_exact(full, answer, &mut |_| true, None)
        .expect("continue");
    assert_eq!(c.ids, plain.ids);
    assert_eq!(c.logprobs, plain.logprobs);

    // Speculative decoding from the full cache: drafts by prompt lookup and by the model
    // itself, each round checked in one pass.
    let mut lookup = Drafter::lookup_only(PromptLookup::new(ids.clone()));
    let (dc, dl) = m.prefill(&ids).expect("prefill");
    let mut model = Drafter::new(&m, dc, dl).with_min_prob(0.0);
    for d in [&mut lookup, &mut model] {
        let (mut cache, logits) = m.prefill(&ids).expect("prefill");
        let (g, _, _) = m
            .decode_speculative(
                Prefilled {
                    cache: &mut cache,
                    logits,
                },
                d,
                &params(),
                &mut |_| true,
                &mut |_, _| false,
            )
            .expect("speculative");
        assert_eq!(g.ids, plain.ids);
        assert_eq!(g.logprobs, plain.logprobs);
    }
}

#[test]
fn logprobs_cost_nothing_unless_asked_and_follow_a_stop_string() {
    let (_d, m) = tiny();
    let s = TinyRag::new(&m).expect("setup");
    let (mut cache, logits) = m.prefill(&s.asm.ids).expect("prefill");
    let quiet = GenerateParams {
        max_tokens: MAX,
        ..Default::default()
    };
    let (g, _) = m
        .decode_watched(&mut cache, logits, &quiet, &mut |_| true, &mut |_, _| false)
        .expect("decode");
    assert!(g.logprobs.is_empty() && !g.ids.is_empty());
    // A stop string cuts the answer and its logprobs alike.
    let (mut cache, logits) = m.prefill(&s.asm.ids).expect("prefill");
    let (full, _) = m
        .decode_watched(
            &mut cache,
            logits.clone(),
            &params(),
            &mut |_| true,
            &mut |_, _| false,
        )
        .expect("decode");
    let tok = m.tokenizer();
    let piece = String::from_utf8_lossy(tok.token_bytes(full.ids[1])).into_owned();
    if !piece.trim().is_empty() {
        let (mut cache, logits) = m.prefill(&s.asm.ids).expect("prefill");
        let cut = GenerateParams {
            stop: vec![piece],
            ..params()
        };
        let (g, _) = m
            .decode_watched(&mut cache, logits, &cut, &mut |_| true, &mut |_, _| false)
            .expect("decode");
        assert_eq!(g.logprobs.len(), g.ids.len());
        assert_eq!(g.logprobs[..], full.logprobs[..g.ids.len()]);
    }
}
