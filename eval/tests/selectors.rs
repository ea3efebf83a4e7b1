//! The evaluation's own selectors on tiny models: each ablation spends the budget on inexact
//! rows, changes only what it says, and at ρ = 1 is a full prefill; the deep and shallow
//! blends keep their invariants; the measurement changes no output.

use eval::method::Method;
use eval::selectors::{
    blend_deep, blend_shallow, even_shares, record_deviation, reused_rows, widen_to_chunks,
    Ablation, Oracle, Random, Stored,
};
use target_engine::prelude::*;
use target_engine::testing::{load_tiny, max_abs_diff as max_diff, TinyRag, TinySpec, TINY_DOCS};
use target_engine::{budget, Architecture, ChunkKv, Model, SelectInput, Selector, TargetProbe};

fn tiny_of(spec: &TinySpec) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = load_tiny(&dir.path().join("tiny.gguf"), spec).expect("load");
    (dir, m)
}

fn tiny() -> (tempfile::TempDir, Model) {
    tiny_of(&TinySpec::new(Architecture::Qwen2))
}

fn four_layers() -> (tempfile::TempDir, Model) {
    tiny_of(&TinySpec {
        n_layer: 4,
        ..TinySpec::new(Architecture::Qwen2)
    })
}

#[test]
fn every_own_selector_spends_rho_of_all_chunk_tokens_on_inexact_rows_only() {
    let (_d, m) = tiny();
    let s = TinyRag::new(&m).expect("setup");
    let after: Vec<&ChunkKv> = s.after_prefix.iter().collect();
    let input = SelectInput::new(&m, &s.asm, &s.prefix, &after, 0.3);
    assert!(input.first_chunk_exact && input.skips_exact());
    let candidates = input.candidates();
    let n_chunk = s.asm.chunk_positions().len();
    assert_eq!(input.spend(), budget(0.3, n_chunk).min(candidates.len()));
    // The ablations that only change how the probe scores or spreads its picks spend the
    // budget exactly; the bounds too.
    for m_ in [
        Method::ProbeSmooth,
        Method::ProbeFused,
        Method::ProbeAnchors,
        Method::ProbeDeep,
        Method::ProbeShallow,
        Method::ProbeShift,
        Method::Oracle,
        Method::Random,
    ] {
        let sel = m_.own_selector(3).expect("an own selector");
        let out = sel.prefill(&input).expect("an own selector's blend");
        assert_eq!(
            out.recomputed.len(),
            input.spend(),
            "{m_} spends the budget"
        );
        assert!(
            out.recomputed.iter().all(|p| candidates.contains(p)),
            "{m_} recomputes only inexact chunk rows"
        );
        assert_eq!(
            sel.select(&input).expect("selection"),
            out.recomputed,
            "{m_}"
        );
    }
    // Random is seeded.
    let r = |seed| Random { seed }.select(&input).expect("random");
    assert_eq!(r(3), r(3));
    assert_ne!(r(3), r(4));
}

#[test]
fn ablations_that_change_only_the_recompute_keep_the_probes_picks() {
    let (_d, m) = four_layers();
    let s = TinyRag::new(&m).expect("setup");
    let refs: Vec<&ChunkKv> = s.standalone.iter().collect();
    let input = SelectInput::new(&m, &s.asm, &s.prefix, &refs, 0.25);
    let probe = TargetProbe::default().prefill(&input).expect("probe");
    let shift = TargetProbe {
        shift: true,
        ..TargetProbe::default()
    }
    .prefill(&input)
    .expect("target_probe_shift");
    for a in [Ablation::Deep, Ablation::Shallow, Ablation::Shift] {
        let out = a.prefill(&input).expect("ablation");
        assert_eq!(out.recomputed, probe.recomputed, "{a:?}");
        let moved = max_diff(&out.logits, &probe.logits);
        if a == Ablation::Shallow {
            // Four layers: "every candidate through the first seventh of the layers" is layer
            // 0 alone, where a stored chunk's rotated rows are the rows computed in place, so
            // only rounding parts it from the probe: the probe's answer. The int8 activations
            // of the layers after it can turn a rounding into a quantization step: 0.014 on a
            // Zen 3 (AVX2) where the ablations that change the recompute move the logits by
            // 0.3.
            assert!(moved < 0.05, "{a:?}: {moved}");
        } else {
            assert!(moved > 1e-4, "{a:?}: {moved}");
        }
        // Same picks, same uncovered mass and reserve: the probe's.
        assert_eq!(out.signals.uncovered, probe.signals.uncovered, "{a:?}");
        assert_eq!(out.reserve, probe.reserve, "{a:?}");
    }
    // The mean move is not the served similarity-weighted one.
    let mean = Ablation::Shift.prefill(&input).expect("probe_shift");
    assert!(max_diff(&mean.logits, &shift.logits) > 1e-4);
    // The deep ablation is `blend_deep` over the probe's picks.
    let fused = m.fused_cache(&s.asm, &s.prefix, &refs).expect("fused");
    let stored = Stored {
        prefix: &s.prefix,
        chunks: &refs,
    };
    let half = m.config().n_layer / 2;
    let again = blend_deep(&m, &s.asm, fused, stored, &probe.recomputed, half).expect("deep");
    let deep = Ablation::Deep.prefill(&input).expect("probe_deep");
    assert_eq!(deep.logits, again.logits);
}

#[test]
fn whole_chunk_rules_recompute_whole_inexact_chunks_on_top_of_the_probes_picks() {
    let (_d, m) = tiny();
    let s = TinyRag::new(&m).expect("setup");
    let after: Vec<&ChunkKv> = s.after_prefix.iter().collect();
    let input = SelectInput::new(&m, &s.asm, &s.prefix, &after, 0.3);
    let candidates = input.candidates();
    let inexact: Vec<_> = s.asm.chunks().skip(1).map(|c| c.ids.clone()).collect();
    let plain = TargetProbe::default().select(&input).expect("probe");
    // Half of a chunk picked widens it: the rule applied to the plain picks.
    let whole = Ablation::Whole.prefill(&input).expect("whole");
    assert_eq!(
        whole.recomputed,
        widen_to_chunks(&s.asm, &candidates, &plain, 0.5)
    );
    for chunk in &inexact {
        let hit = plain.iter().filter(|p| chunk.contains(p)).count();
        let now = whole
            .recomputed
            .iter()
            .filter(|p| chunk.contains(p))
            .count();
        assert_eq!(
            now,
            if 2 * hit >= chunk.len() {
                chunk.len()
            } else {
                hit
            }
        );
    }
    // The top chunk whole: one inexact chunk entirely, only candidates, at least the budget
    // unless that chunk alone is larger.
    let top = Ablation::TopChunk.prefill(&input).expect("top chunk");
    assert!(top.recomputed.iter().all(|p| candidates.contains(p)));
    let full_chunks = inexact
        .iter()
        .filter(|c| (c.start..c.end).all(|p| top.recomputed.contains(&p)))
        .count();
    assert!(full_chunks >= 1, "{:?}", top.recomputed);
    assert!(top.recomputed.len() >= input.spend().min(candidates.len()));
}

#[test]
fn anchors_give_every_inexact_chunk_its_even_share_of_the_budget() {
    let (_d, m) = tiny();
    let s = TinyRag::new(&m).expect("setup");
    let after: Vec<&ChunkKv> = s.after_prefix.iter().collect();
    let input = SelectInput::new(&m, &s.asm, &s.prefix, &after, 0.3);
    assert!(input.skips_exact());
    let anchored = Ablation::Anchors.select(&input).expect("anchors");
    let inexact: Vec<_> = s.asm.chunks().skip(1).map(|c| c.ids.clone()).collect();
    let sizes: Vec<usize> = inexact.iter().map(|r| r.len()).collect();
    let per_chunk: Vec<usize> = inexact
        .iter()
        .map(|r| anchored.iter().filter(|p| r.contains(p)).count())
        .collect();
    assert_eq!(per_chunk, even_shares(&sizes, input.spend()));
}

#[test]
fn every_own_selector_at_ratio_one_equals_full_prefill() {
    let (_d, m) = tiny();
    let s = TinyRag::new(&m).expect("setup");
    let after: Vec<&ChunkKv> = s.after_prefix.iter().collect();
    let (_, full) = m.prefill(&s.asm.ids).expect("prefill");
    let all = SelectInput::new(&m, &s.asm, &s.prefix, &after, 1.0);
    let own: Vec<Method> = Method::ALL
        .into_iter()
        .filter(|m| m.served().is_none())
        .collect();
    for m_ in own {
        let out = m_
            .own_selector(1)
            .expect("own")
            .prefill(&all)
            .expect("prefill");
        assert_eq!(out.recomputed, s.asm.chunk_positions(), "{m_}");
        // Deep recomputes each pick from its own chunk's residual stream below the split,
        // so even at ρ = 1 the rows there are the reused ones: not a full prefill.
        if m_ != Method::ProbeDeep {
            let d = max_diff(&out.logits, &full);
            assert!(d < 1e-4, "{m_}: ρ = 1 differs from full prefill by {d}");
        }
    }
    let oracle = Oracle.prefill(&all).expect("oracle");
    assert!(max_diff(&oracle.logits, &full) < 1e-4);
}

/// The measurement reports how far recomputing moved the recomputed rows and changes no
/// output; a query that read no chunk KV measures nothing.
#[test]
fn measuring_the_blend_reports_its_deviation_and_changes_nothing() {
    let (_d, m) = tiny();
    let s = TinyRag::new(&m).expect("setup");
    let refs: Vec<&ChunkKv> = s.standalone.iter().collect();
    let input = SelectInput::new(&m, &s.asm, &s.prefix, &refs, 0.3);
    let plain = TargetProbe::default().prefill(&input).expect("blend");
    let before = reused_rows(&input).expect("fused").expect("chunk KV read");
    let mut measured = TargetProbe::default().prefill(&input).expect("blend");
    record_deviation(&before, &mut measured);
    assert_eq!(plain.signals.deviation_k, 0.0);
    assert!(measured.signals.deviation_k > 0.0 && measured.signals.deviation_v > 0.0);
    assert_eq!(plain.logits, measured.logits);
    assert_eq!(plain.signals.uncovered, measured.signals.uncovered);
    // Nothing recomputed: nothing moved.
    let none = SelectInput::new(&m, &s.asm, &s.prefix, &refs, 0.0);
    let mut idle = TargetProbe::default().prefill(&none).expect("blend");
    record_deviation(&before, &mut idle);
    assert_eq!(
        (idle.signals.deviation_k, idle.signals.deviation_v),
        (0.0, 0.0)
    );
    // Full recompute reads no chunk KV: nothing is kept to measure against.
    let no_kv = SelectInput::new(&m, &s.asm, &s.prefix, &[], 1.0);
    assert!(reused_rows(&no_kv).expect("no copy").is_none());
}

#[test]
fn deep_recompute_continues_each_pick_from_its_own_chunks_residual_stream() {
    // Four layers: a pick's rows at the first recomputed layer depend on its residual stream
    // there alone (its own chunk's), so only the layers after it can change.
    let (_d, m) = four_layers();
    let n_layer = m.config().n_layer;
    let half = n_layer / 2;
    // One chunk after the prefix: its own context is the whole context, so every chunk token
    // recomputed through the deeper half from its own residual stream is the full prefill,
    // up to the rounding of the residual stream at the split (below).
    let one = TinyRag::of(&m, &TINY_DOCS[..1]).expect("one chunk");
    let (asm, prefix) = (&one.asm, &one.prefix);
    let kv = &one.after_prefix[0];
    let (_, full) = m.prefill(&asm.ids).expect("prefill");
    let scale = full.iter().fold(0f32, |m, v| m.max(v.abs()));
    let all = asm.chunk_positions();
    let fused = m.fused_cache(asm, prefix, &[kv]).expect("fused");
    let chunks = [kv];
    let stored = Stored {
        prefix,
        chunks: &chunks,
    };
    let out = blend_deep(&m, asm, fused, stored, &all, half).expect("deep");
    assert_eq!(out.recomputed, all);
    // Two passes where the full prefill runs one: the residual stream's int8 rounding at the
    // split (0.30% of the largest logit on AVX-512 VNNI kernels, under 0.2% on AVX2, measured
    // with f32 cache rows); a pick continued from the wrong stream is off by whole logits.
    let d = max_diff(&out.logits, &full);
    assert!(d < 5e-3 * scale, "{d} of {scale}");
    // Three chunks, nothing picked: the question alone, its layers split in two passes, is
    // the ordinary blend with nothing recomputed.
    let s = TinyRag::new(&m).expect("setup");
    let refs: Vec<&ChunkKv> = s.standalone.iter().collect();
    let fused = m.fused_cache(&s.asm, &s.prefix, &refs).expect("fused");
    let plain = m
        .blend_prefill_on(&s.asm, fused.clone(), &[])
        .expect("blend");
    let stored = Stored {
        prefix: &s.prefix,
        chunks: &refs,
    };
    let none = blend_deep(&m, &s.asm, fused.clone(), stored, &[], half).expect("deep");
    assert!(max_diff(&none.logits, &plain.logits) < 1e-5);
    // Picks change the answer's logits, differently from recomputing them through every layer.
    let picks: Vec<usize> = s.asm.chunk_positions().into_iter().step_by(3).collect();
    let deep = blend_deep(&m, &s.asm, fused.clone(), stored, &picks, half).expect("deep");
    let through = m
        .blend_prefill_on(&s.asm, fused.clone(), &picks)
        .expect("blend");
    assert!(max_diff(&deep.logits, &plain.logits) > 1e-4);
    assert!(max_diff(&deep.logits, &through.logits) > 1e-4);
    for bad in [0, n_layer] {
        let e = blend_deep(&m, &s.asm, fused.clone(), stored, &picks, bad)
            .expect_err("layer out of range")
            .to_string();
        assert!(e.contains("must be within"), "{e}");
    }
    let e = blend_deep(&m, &s.asm, fused.clone(), stored, &[0], half)
        .expect_err("a prefix position")
        .to_string();
    assert!(e.contains("not a chunk token"), "{e}");
}

#[test]
fn shallow_refresh_gives_every_reused_token_full_prefills_rows_below_the_split() {
    let (_d, m) = four_layers();
    let s = TinyRag::new(&m).expect("setup");
    let refs: Vec<&ChunkKv> = s.standalone.iter().collect();
    let fused = m.fused_cache(&s.asm, &s.prefix, &refs).expect("fused");
    let (full_cache, full) = m.prefill(&s.asm.ids).expect("prefill");
    let all = s.asm.chunk_positions();
    let picks: Vec<usize> = all.iter().copied().step_by(4).collect();
    let out = blend_shallow(&m, &s.asm, &fused, &all, &picks, 2).expect("shallow");
    assert_eq!(out.recomputed, picks);
    // Below the split every row is the full prefill's; above it only the picks were rewritten.
    for l in 0..2 {
        assert!(
            max_diff(out.cache.k(l), full_cache.k(l)) < 1e-4,
            "layer {l}"
        );
        assert!(
            max_diff(out.cache.v(l), full_cache.v(l)) < 1e-4,
            "layer {l}"
        );
    }
    let row = m.config().kv_row();
    let unpicked = all.iter().find(|p| !picks.contains(p)).expect("one left");
    let at = |c: &[f32]| c[unpicked * row..(unpicked + 1) * row].to_vec();
    assert_eq!(at(out.cache.k(3)), at(fused.k(3)));
    // Everything continuing is the full prefill.
    let every = blend_shallow(&m, &s.asm, &fused, &all, &all, 2).expect("shallow");
    assert!(max_diff(&every.logits, &full) < 1e-4);
    for (shallow, picks, what) in [
        (0, &picks, "must be within"),
        (4, &picks, "must be within"),
        (2, &vec![0], "not a candidate"),
    ] {
        let e = blend_shallow(&m, &s.asm, &fused, &all, picks, shallow)
            .expect_err("refused")
            .to_string();
        assert!(e.contains(what), "{e}");
    }
}
