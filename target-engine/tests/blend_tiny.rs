//! Invariants of chunk precompute, positional recovery and blended prefill on tiny models.

use target_engine::prelude::*;
use target_engine::testing::{
    family_specs, load_tiny, prefill_in_pieces, TinyRag, TinySpec, TINY_DOCS,
};
use target_engine::{
    blend_shift, budget, layer_span, ranked_rest, top_k, Architecture, CacheBlend, ChunkKv, Engine,
    Epic, FullRecompute, FullReuse, Model, PrefixCaching, RagTemplate, SelectInput, Selector,
    ShiftRule, TargetProbe,
};

fn tiny(arch: Architecture) -> (tempfile::TempDir, Model) {
    tiny_of(&TinySpec::new(arch))
}

fn tiny_of(spec: &TinySpec) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().expect("tempdir");
    let m = load_tiny(&dir.path().join("tiny.gguf"), spec).expect("load");
    (dir, m)
}

use target_engine::testing::max_abs_diff as max_diff;

const DOCS: [&str; 3] = TINY_DOCS;

fn setup(m: &Model) -> TinyRag {
    TinyRag::new(m).expect("setup")
}

/// The first document alone, its chunk precomputed after the prefix.
fn one_chunk_after_prefix(
    m: &Model,
) -> (target_engine::Assembly, target_engine::PrefixKv, ChunkKv) {
    let t = RagTemplate::default();
    let asm = t.assemble(m.tokenizer(), &DOCS[..1], "where is the antenna?");
    let prefix = m.prefix_kv(&asm.ids[asm.prefix_range()]).expect("prefix");
    let seg = asm.chunks().next().expect("one chunk").ids.clone();
    let kv = m
        .precompute(&asm.ids[seg], Some(&prefix))
        .expect("precompute");
    (asm, prefix, kv)
}

#[test]
fn recompute_everything_equals_full_prefill() {
    for (arch, spec) in family_specs() {
        let (_d, m) = tiny_of(&spec);
        assert!(
            m.rope_recovery_ok(),
            "{arch}: positional recovery's self-test"
        );
        let s = setup(&m);
        let (full_cache, full) = m.prefill(&s.asm.ids).expect("prefill");
        for chunks in [&s.standalone, &s.after_prefix] {
            let refs: Vec<&ChunkKv> = chunks.iter().collect();
            let all = s.asm.chunk_positions();
            let out = m
                .blend_prefill(&s.asm, &s.prefix, &refs, &all)
                .expect("blend");
            assert!((out.ratio() - 1.0).abs() < 1e-12);
            assert!(max_diff(&out.logits, &full) < 1e-4, "{arch}");
            for l in 0..m.config().n_layer {
                assert!(max_diff(out.cache.k(l), full_cache.k(l)) < 1e-4);
                assert!(max_diff(out.cache.v(l), full_cache.v(l)) < 1e-4);
            }
            let fused = m.fused_cache(&s.asm, &s.prefix, &refs).expect("fused");
            let check = target_engine::DeviationCheck {
                layer: 0,
                by_value: false,
            };
            let cb = m
                .blend_prefill_cacheblend(&s.asm, &fused, &all, all.len(), check)
                .expect("cacheblend");
            assert!(
                max_diff(&cb.logits, &full) < 1e-4,
                "{arch}: cacheblend at ratio 1 is full prefill"
            );
        }
    }
}

/// Whether a prefill run in pieces cut at `cuts` keeps the whole prefill's cache and logits
/// bit for bit on this CPU (it does wherever the kernels round a row the same in any batch:
/// int8 per row, and the dense f32 panels on this project's AVX-512 machines).
fn split_is_exact(m: &Model, ids: &[u32], cuts: &[usize]) -> bool {
    let (whole_cache, whole) = m.prefill(ids).expect("prefill");
    let (cache, last) = prefill_in_pieces(m, ids, cuts).expect("pieces");
    let exact = last == whole
        && (0..m.config().n_layer)
            .all(|l| cache.k(l) == whole_cache.k(l) && cache.v(l) == whole_cache.v(l));
    eprintln!("a prefill split at {cuts:?} is bit for bit on this CPU: {exact}");
    exact
}

/// Every cache row is an f16, as the chunk store keeps it, so a chunk precomputed after the
/// prefix and reused as is holds exactly the rows a whole prefill computes for it: reuse
/// without recompute is full prefill bit for bit wherever a prefill split at the same points
/// is. (Elsewhere a row rounded differently in another batch can move an f16 rounding by a
/// step, which the random tiny models' int8 activations can grow: the bound is relative,
/// 0.2% of the largest logit.)
#[test]
fn one_chunk_precomputed_after_the_prefix_reused_as_is_equals_full_prefill() {
    let (_d, m) = tiny(Architecture::Qwen2);
    let (asm, prefix, kv) = one_chunk_after_prefix(&m);
    let out = m.blend_prefill(&asm, &prefix, &[&kv], &[]).expect("blend");
    assert_eq!(out.recomputed.len(), 0);
    let (full_cache, full) = m.prefill(&asm.ids).expect("prefill");
    let chunk = asm.chunks().next().expect("one chunk").ids.clone();
    if split_is_exact(&m, &asm.ids, &[chunk.start, chunk.end]) {
        assert_eq!(out.logits, full);
        for l in 0..m.config().n_layer {
            assert_eq!(out.cache.k(l), full_cache.k(l), "K {l}");
            assert_eq!(out.cache.v(l), full_cache.v(l), "V {l}");
        }
    } else {
        let scale = full.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = max_diff(&out.logits, &full);
        assert!(d < 2e-3 * scale, "{d} of {scale}");
    }
}

/// An escalation's full prefill keeps a blended cache's prefix and first chunk (precomputed
/// after that prefix) and computes the rest: it is full prefill, over rows a prefill computed
/// and over the stored chunk alike (bit for bit wherever a prefill split at the same points
/// is; elsewhere within the ρ = 1 tests' 1e-4 over computed rows and a relative 3% over the
/// stored chunk, see above), whatever the blend had left in the rows it drops.
#[test]
fn a_prefill_after_the_stored_first_chunk_is_full_prefill() {
    for (arch, spec) in family_specs() {
        let (_d, m) = tiny_of(&spec);
        let s = setup(&m);
        let refs: Vec<&ChunkKv> = s.after_prefix.iter().collect();
        let (full_cache, full) = m.prefill(&s.asm.ids).expect("prefill");
        let first = s.asm.chunks().next().expect("a chunk").ids.clone();
        let kept = first.end;
        let mut exact = full_cache.clone();
        let logits = m
            .prefill_after(&mut exact, &s.asm.ids, kept)
            .expect("prefill after");
        assert!(
            max_diff(&logits, &full) < 1e-4,
            "{arch}: after rows a prefill computed"
        );
        for l in 0..m.config().n_layer {
            assert!(max_diff(exact.k(l), full_cache.k(l)) < 1e-4, "{arch}");
            assert!(max_diff(exact.v(l), full_cache.v(l)) < 1e-4, "{arch}");
        }
        let reused = m
            .blend_prefill(&s.asm, &s.prefix, &refs, &[])
            .expect("blend");
        let mut cache = reused.cache.clone();
        let logits = m
            .prefill_after(&mut cache, &s.asm.ids, kept)
            .expect("prefill after");
        assert_eq!(cache.len(), s.asm.ids.len(), "{arch}");
        let d = max_diff(&logits, &full);
        let rows = (0..m.config().n_layer)
            .map(|l| {
                max_diff(cache.k(l), full_cache.k(l)).max(max_diff(cache.v(l), full_cache.v(l)))
            })
            .fold(0f32, f32::max);
        if split_is_exact(&m, &s.asm.ids, &[first.start, kept]) {
            assert_eq!(d, 0.0, "{arch}: logits");
            assert_eq!(rows, 0.0, "{arch}: K and V rows");
        } else {
            let scale = full.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(d < 3e-2 * scale, "{arch}: {d} of {scale}");
            assert!(rows < 0.1, "{arch}: {rows}");
        }
        // Nothing to compute, or more kept rows than the cache holds: refused.
        let n = s.asm.ids.len();
        let mut c = reused.cache.clone();
        assert!(m.prefill_after(&mut c, &s.asm.ids, n).is_err(), "{arch}");
        let mut short = m.new_cache();
        assert!(
            m.prefill_after(&mut short, &s.asm.ids, 1).is_err(),
            "{arch}"
        );
    }
}

/// The fidelity guard's `extend` second look: chunk tokens recomputed in order from the first
/// row after the exact ones (the prefix and the first chunk, stored after it) are computed over
/// exact rows only, so they are the full prefill's rows, and an escalation's prefill after
/// them is full prefill (bit for bit wherever a prefill split at the same points is; elsewhere
/// within the bounds above). The same number of tokens further on are not: each row needs
/// every row before it exact.
#[test]
fn rows_recomputed_in_order_after_the_exact_ones_are_full_prefills() {
    for (arch, spec) in family_specs() {
        let (_d, m) = tiny_of(&spec);
        let s = setup(&m);
        let refs: Vec<&ChunkKv> = s.after_prefix.iter().collect();
        let (full_cache, full) = m.prefill(&s.asm.ids).expect("prefill");
        let mut segs = s.asm.chunks();
        let first = segs.next().expect("a chunk").ids.clone();
        let second = segs.next().expect("two chunks").ids.clone();
        let (kept, upto) = (first.end, second.start + second.len() / 2);
        assert_eq!(kept, second.start, "{arch}: chunks follow each other");
        let row = m.config().kv_row();
        let below = |c: &target_engine::KvCache, upto: usize| {
            (0..m.config().n_layer)
                .map(|l| {
                    let (k, v) = (&c.k(l)[..upto * row], &c.v(l)[..upto * row]);
                    let (fk, fv) = (
                        &full_cache.k(l)[..upto * row],
                        &full_cache.v(l)[..upto * row],
                    );
                    max_diff(k, fk).max(max_diff(v, fv))
                })
                .fold(0f32, f32::max)
        };
        let look = |picks: &[usize]| {
            let reused = m
                .blend_prefill(&s.asm, &s.prefix, &refs, &[])
                .expect("blend");
            m.blend_prefill_on(&s.asm, reused.cache, picks)
                .expect("look")
        };
        let ordered: Vec<usize> = (kept..upto).collect();
        let out = look(&ordered);
        let rows = below(&out.cache, upto);
        let mut cache = out.cache.clone();
        let logits = m
            .prefill_after(&mut cache, &s.asm.ids, upto)
            .expect("prefill after");
        let d = max_diff(&logits, &full);
        let all = below(&cache, s.asm.ids.len());
        if split_is_exact(&m, &s.asm.ids, &[first.start, kept, upto]) {
            assert_eq!(rows, 0.0, "{arch}: the look's rows");
            assert_eq!((d, all), (0.0, 0.0), "{arch}: the prefill after them");
        } else {
            let scale = full.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(rows < 0.1 && all < 0.1, "{arch}: {rows} {all}");
            assert!(d < 3e-2 * scale, "{arch}: {d} of {scale}");
        }
        let further: Vec<usize> = (upto..second.end).take(ordered.len()).collect();
        let out = look(&further);
        let moved = (0..m.config().n_layer)
            .map(|l| {
                let r = upto * row..(upto + further.len()) * row;
                max_diff(&out.cache.k(l)[r.clone()], &full_cache.k(l)[r])
            })
            .fold(0f32, f32::max);
        assert!(
            moved > 0.0,
            "{arch}: rows after approximate ones came out exact"
        );
    }
}

#[test]
fn every_reused_row_sits_at_its_position() {
    let (_d, m) = tiny(Architecture::Llama);
    let s = setup(&m);
    assert!(m.rope_recovery_ok());
    for chunks in [&s.standalone, &s.after_prefix] {
        let refs: Vec<&ChunkKv> = chunks.iter().collect();
        let fused = m.fused_cache(&s.asm, &s.prefix, &refs).expect("fused");
        let n = s.asm.chunk_positions().last().expect("chunks") + 1;
        assert_eq!(fused.len(), n);
        assert!(fused.is_complete());
        // Layer-0 keys depend only on token and position: the ground truth for every row.
        let pos: Vec<usize> = (0..n).collect();
        let want = m.layer0_keys(&s.asm.ids[..n], &pos).expect("keys");
        assert!(
            max_diff(fused.k(0), &want) < 1e-2,
            "{}",
            max_diff(fused.k(0), &want)
        );
        // A chunk placed one position off is detectably wrong (the check above can fail).
        let mut shifted = s.prefix.cache.clone();
        let first = s.asm.chunks().next().expect("chunk").ids.clone();
        m.place_chunk(&mut shifted, refs[0], first.start + 1)
            .expect("place");
        let row = m.config().kv_row();
        let got = &shifted.k(0)[(first.start + 1) * row..(first.start + 2) * row];
        assert!(max_diff(got, &want[first.start * row..(first.start + 1) * row]) > 1e-2);
    }
}

#[test]
fn rotated_standalone_chunk_equals_chunk_computed_in_place_at_layer_0() {
    for (arch, spec) in family_specs() {
        rotated_chunk_matches(arch, &tiny_of(&spec).1);
    }
}

fn rotated_chunk_matches(arch: &str, m: &Model) {
    let ids: Vec<u32> = (0..12).map(|i| (i * 17 % 250) as u32).collect();
    let kv = m.precompute(&ids, None).expect("precompute");
    for offset in [1usize, 7, 300] {
        let lead: Vec<u32> = (0..offset).map(|i| (i % 200) as u32 + 3).collect();
        let mut cache = m.prefill(&lead).expect("lead").0;
        m.place_chunk(&mut cache, &kv, offset).expect("place");
        let mut all = lead.clone();
        all.extend(&ids);
        let (full, _) = m.prefill(&all).expect("prefill");
        let row = m.config().kv_row();
        let r = offset * row..(offset + ids.len()) * row;
        assert!(
            max_diff(&cache.k(0)[r.clone()], &full.k(0)[r.clone()]) < 1e-2,
            "{arch}: K at offset {offset}"
        );
        assert!(
            max_diff(&cache.v(0)[r.clone()], &full.v(0)[r]) < 1e-2,
            "{arch}: V at offset {offset}"
        );
    }
}

#[test]
fn selectors_pick_what_their_method_says() {
    let (_d, m) = tiny(Architecture::Qwen2);
    let s = setup(&m);
    let after: Vec<&ChunkKv> = s.after_prefix.iter().collect();
    let alone: Vec<&ChunkKv> = s.standalone.iter().collect();
    let input = SelectInput::new(&m, &s.asm, &s.prefix, &after, 0.15);
    assert!(
        input.first_chunk_exact,
        "precomputed after this prefix, at its place"
    );
    let chunks: Vec<_> = s.asm.chunks().map(|c| c.ids.clone()).collect();
    let sel = |x: &dyn Selector, i: &SelectInput| x.select(i).expect("select");
    assert_eq!(sel(&FullRecompute, &input), s.asm.chunk_positions());
    assert!(sel(&FullReuse, &input).is_empty());
    let prefix = sel(&PrefixCaching, &input);
    assert_eq!(
        prefix.first(),
        Some(&chunks[1].start),
        "first chunk is exact and kept"
    );
    let not_exact = SelectInput::new(&m, &s.asm, &s.prefix, &alone, 0.15);
    assert!(!not_exact.first_chunk_exact);
    assert_eq!(sel(&PrefixCaching, &not_exact), s.asm.chunk_positions());
    let epic = sel(&Epic { k: Some(4) }, &not_exact);
    assert_eq!(epic.len(), 4 * chunks.len());
    assert!(chunks
        .iter()
        .all(|c| epic.contains(&c.start) && epic.contains(&(c.start + 3))));
    assert_eq!(budget(0.15, 100), 15);
    assert_eq!(budget(0.151, 100), 16, "ceil");
    assert_eq!(budget(0.0, 100), 0);
    assert_eq!(budget(1.0, 7), 7);
    // CacheBlend spends exactly its budget and only on chunk tokens; its trait prefill is the
    // check-layer procedure.
    let cb_sel = CacheBlend {
        check_layer: 0,
        by_value: false,
    };
    let input = SelectInput::new(&m, &s.asm, &s.prefix, &alone, 0.25);
    let cb = cb_sel.prefill(&input).expect("cacheblend");
    assert_eq!(cb.recomputed.len(), budget(0.25, cb.chunk_tokens));
    assert_eq!(sel(&cb_sel, &input), cb.recomputed);
    // Every method's trait prefill at ratio 1 / full recompute agrees with full prefill.
    let (_, full) = m.prefill(&s.asm.ids).expect("prefill");
    let all = SelectInput::new(&m, &s.asm, &s.prefix, &alone, 1.0);
    // (The tiny model has 2 layers, so CacheBlend checks layer 0 instead of the default 1.)
    let methods: Vec<Box<dyn Selector>> = vec![
        Box::new(FullRecompute),
        Box::new(CacheBlend {
            check_layer: 0,
            by_value: true,
        }),
    ];
    for (i, method) in methods.iter().enumerate() {
        let out = method.prefill(&all).expect("prefill");
        assert!(max_diff(&out.logits, &full) < 1e-4, "selector {i}");
    }
    let chunk_pos = s.asm.chunk_positions();
    assert!(cb.recomputed.iter().all(|p| chunk_pos.contains(p)));
}

#[test]
fn mismatched_inputs_are_errors() {
    let (_d, m) = tiny(Architecture::Qwen2);
    let s = setup(&m);
    let refs: Vec<&ChunkKv> = s.standalone.iter().collect();
    let q = s.asm.question_positions()[0];
    assert!(
        m.blend_prefill(&s.asm, &s.prefix, &refs, &[q]).is_err(),
        "question is not a chunk token"
    );
    assert!(
        m.blend_prefill(&s.asm, &s.prefix, &refs[..2], &[]).is_err(),
        "missing chunk KV"
    );
    let swapped = vec![refs[1], refs[0], refs[2]];
    assert!(
        m.blend_prefill(&s.asm, &s.prefix, &swapped, &[]).is_err(),
        "ids differ"
    );
    let mut foreign = s.standalone[0].clone();
    foreign.fingerprint = "other".into();
    let foreign_refs = vec![&foreign, refs[1], refs[2]];
    assert!(
        m.blend_prefill(&s.asm, &s.prefix, &foreign_refs, &[])
            .is_err(),
        "other model"
    );
    assert!(m.precompute(&[], None).is_err());
}

#[test]
fn epic_for_budget_spends_at_least_the_budget_and_reaches_every_token_at_ratio_one() {
    use target_engine::Epic;
    assert_eq!(Epic::k_for_budget(&[10, 3, 7], 20), 10);
    assert_eq!(Epic::k_for_budget(&[10, 3, 7], 9), 3);
    assert_eq!(Epic::k_for_budget(&[10, 3, 7], 10), 4); // 4 + 3 + 4 = 11 >= 10
    assert_eq!(Epic::k_for_budget(&[10, 3, 7], 0), 0);
    assert_eq!(Epic::k_for_budget(&[], 5), 0);
}

#[test]
fn budgeted_selectors_spend_rho_of_all_chunk_tokens_on_inexact_rows_only() {
    let (_d, m) = tiny(Architecture::Qwen2);
    let s = setup(&m);
    let after: Vec<&ChunkKv> = s.after_prefix.iter().collect();
    let input = SelectInput::new(&m, &s.asm, &s.prefix, &after, 0.3);
    assert!(input.first_chunk_exact && input.skips_exact());
    let first = s.asm.chunks().next().expect("a chunk").ids.clone();
    let n_chunk = s.asm.chunk_positions().len();
    let candidates = input.candidates();
    assert_eq!(candidates.len(), n_chunk - first.len());
    assert_eq!(input.spend(), budget(0.3, n_chunk).min(candidates.len()));
    let cb = CacheBlend {
        check_layer: 0,
        by_value: false,
    };
    let selectors: Vec<(&str, Box<dyn Selector>)> = vec![
        ("cacheblend", Box::new(cb)),
        ("target_probe", Box::new(TargetProbe::default())),
        (
            "target_probe_window",
            Box::new(TargetProbe {
                window: 2,
                ..TargetProbe::default()
            }),
        ),
        (
            "target_probe_shallow",
            Box::new(TargetProbe {
                from_depth: 0.0,
                to_depth: 0.5,
                ..TargetProbe::default()
            }),
        ),
        (
            "target_probe_shift",
            Box::new(TargetProbe {
                shift: true,
                ..TargetProbe::default()
            }),
        ),
        (
            "target_probe_shift in two rounds",
            Box::new(TargetProbe {
                shift: true,
                first_round: 0.5,
                ..TargetProbe::default()
            }),
        ),
    ];
    for (name, sel) in &selectors {
        let out = sel.prefill(&input).expect(name);
        assert_eq!(
            out.recomputed.len(),
            input.spend(),
            "{name} spends the budget"
        );
        assert!(
            out.recomputed.iter().all(|p| candidates.contains(p)),
            "{name} recomputes only inexact chunk rows"
        );
        assert_eq!(sel.select(&input).expect(name), out.recomputed, "{name}");
    }
    // EPIC at the budget skips the exact chunk and spends about the budget.
    let epic = Epic::default().select(&input).expect("epic");
    assert!(epic.iter().all(|p| !first.contains(p)));
    assert!(epic.len() >= input.spend());
    // A budget beyond every inexact row refreshes the exact chunk too (ρ = 1 is full prefill).
    let one = SelectInput::new(&m, &s.asm, &s.prefix, &after, 1.0);
    assert!(!one.skips_exact());
    assert_eq!(one.candidates(), s.asm.chunk_positions());
}

#[test]
fn the_probe_at_ratio_one_equals_full_prefill() {
    let (_d, m) = tiny(Architecture::Qwen2);
    let s = setup(&m);
    let after: Vec<&ChunkKv> = s.after_prefix.iter().collect();
    let (_, full) = m.prefill(&s.asm.ids).expect("prefill");
    let all = SelectInput::new(&m, &s.asm, &s.prefix, &after, 1.0);
    let selectors: Vec<Box<dyn Selector>> = vec![
        Box::new(TargetProbe::default()),
        Box::new(TargetProbe {
            shift: true,
            ..TargetProbe::default()
        }),
        // Two rounds would leave the first round's rows computed over stale ones: at ρ = 1
        // every row is recomputed in one.
        Box::new(TargetProbe {
            shift: true,
            first_round: 0.5,
            ..TargetProbe::default()
        }),
    ];
    for (i, sel) in selectors.iter().enumerate() {
        let out = sel.prefill(&all).expect("prefill");
        assert_eq!(out.recomputed, s.asm.chunk_positions());
        assert!(max_diff(&out.logits, &full) < 1e-4, "selector {i}");
    }
}

#[test]
fn a_probe_that_stops_early_measures_the_same_layers_as_a_whole_pass() {
    let (_d, m) = tiny(Architecture::Qwen2);
    let s = setup(&m);
    let refs: Vec<&ChunkKv> = s.after_prefix.iter().collect();
    let fused = m.fused_cache(&s.asm, &s.prefix, &refs).expect("fused");
    let pos = s.asm.question_positions();
    let ids: Vec<u32> = pos.iter().map(|&p| s.asm.ids[p]).collect();
    let n = m.config().n_layer;
    assert!(n >= 2, "the tiny model has {n} layers");
    let probe = |layers: std::ops::Range<usize>| {
        m.forward_probe(&ids, &pos, &mut fused.clone(), layers)
            .expect("probe")
    };
    // Layers 0..1 from a pass that stops after layer 0, plus layers 1..n, equal all layers.
    let (low, high, all) = (probe(0..1), probe(1..n), probe(0..n));
    // Kept apart per layer, the layers sum to the same mass, bit for bit.
    let layers = m
        .forward_probe_layers(&ids, &pos, &mut fused.clone(), 0..n)
        .expect("probe layers");
    assert_eq!(layers.len(), n);
    assert_eq!(layers[0], low);
    let summed = layers.iter().fold(vec![0.0f32; all.len()], |acc, l| {
        acc.iter().zip(l).map(|(a, b)| a + b).collect()
    });
    assert_eq!(summed, all);
    assert_eq!(all.len(), *pos.last().expect("a question") + 1);
    let sum: Vec<f32> = low.iter().zip(&high).map(|(a, b)| a + b).collect();
    assert!(max_diff(&sum, &all) < 1e-4, "{}", max_diff(&sum, &all));
    // Each layer's mass is the question rows' attention: one unit per row and head.
    let heads = m.config().n_head as f32;
    let total: f32 = low.iter().sum();
    assert!((total - pos.len() as f32 * heads).abs() < 1e-2, "{total}");
}

#[test]
fn top_k_windows_stay_in_their_segment_and_within_budget() {
    let (_d, m) = tiny(Architecture::Qwen2);
    let s = setup(&m);
    let cands = s.asm.chunk_positions();
    let segs: Vec<_> = s.asm.chunks().map(|c| c.ids.clone()).collect();
    // The best-scored token is the first of chunk 1: its window may not reach into chunk 0.
    let best = segs[1].start;
    let picked = top_k(&s.asm, &cands, |p| if p == best { 1.0 } else { 0.0 }, 3, 2);
    assert_eq!(picked, vec![best, best + 1, best + 2]);
    let scattered = top_k(&s.asm, &cands, |p| p as f32, 3, 0);
    let n = cands.len();
    assert_eq!(scattered, cands[n - 3..].to_vec(), "highest scores win");
}

/// A chunk's segment read back from the assembled prompt is what tokenizing it alone gives:
/// what lets a request key and load stored KV without tokenizing the chunk again.
#[test]
fn an_assembled_segment_is_the_chunk_tokenized_alone() {
    let (_d, m) = tiny(Architecture::Qwen2);
    let t = RagTemplate::default();
    let docs = ["naïve ant: ünïcode in a tin", DOCS[1], "  the tent  "];
    let asm = t.assemble_with_context(m.tokenizer(), &docs, "earlier turns", "where?");
    let segs: Vec<_> = asm.chunks().collect();
    assert_eq!(segs.len(), docs.len());
    for (seg, doc) in segs.into_iter().zip(docs) {
        let (text, ids) = asm.segment(seg);
        let (want_text, want_ids) = t.chunk(m.tokenizer(), doc);
        assert_eq!(text, want_text);
        assert_eq!(ids, &want_ids[..]);
    }
}

/// `cache` with every chunk's rows (`segs`, positions) moved by a constant of its own at each
/// layer (K before RoPE): a deviation the shift can learn from any one recomputed token.
fn moved_per_chunk_and_layer(
    m: &Model,
    cache: &target_engine::KvCache,
    segs: &[Vec<usize>],
) -> target_engine::KvCache {
    let (row, heads) = (m.config().kv_row(), m.config().n_kv_head);
    let mut fused = cache.clone();
    for (c, pos) in segs.iter().enumerate() {
        for l in 0..m.config().n_layer {
            let ck: Vec<f32> = (0..row)
                .map(|i| 0.4 * ((i + 7 * c + 3 * l) as f32).sin())
                .collect();
            let cv: Vec<f32> = (0..row)
                .map(|i| 0.4 * ((2 * i + 5 * c + l) as f32).cos())
                .collect();
            let mut k = ck.repeat(pos.len());
            let at: Vec<i64> = pos.iter().map(|&p| p as i64).collect();
            m.rope_at(l).rotate_by(&mut k, heads, &at).expect("rotate");
            let mut v = Vec::new();
            for (i, &p) in pos.iter().enumerate() {
                let old_k = &fused.k(l)[p * row..(p + 1) * row];
                k[i * row..(i + 1) * row]
                    .iter_mut()
                    .zip(old_k)
                    .for_each(|(d, o)| *d += o);
                let old_v = &fused.v(l)[p * row..(p + 1) * row];
                v.extend(old_v.iter().zip(&cv).map(|(o, d)| o + d));
            }
            fused.set_rows(l, pos, &k, &v).expect("set rows");
        }
    }
    fused
}

/// `got`'s rows are `want`'s up to two f16 roundings at layer 0 (the moved rows, the shifted
/// rows: within two steps of the largest value's binade), and 2.5% of the scale past it.
fn rows_within_f16_roundings(got: &target_engine::KvCache, want: &target_engine::KvCache) {
    let scale = |c: &[f32]| c.iter().fold(1f32, |m, x| m.max(x.abs()));
    for l in 0..want.n_layer() {
        let bound = |s: f32| if l == 0 { s / 512.0 } else { s / 40.0 };
        let k = max_diff(got.k(l), want.k(l));
        let v = max_diff(got.v(l), want.v(l));
        let (bk, bv) = (bound(scale(want.k(l))), bound(scale(want.v(l))));
        assert!(
            k < bk && v < bv,
            "layer {l}: K {k} (bound {bk}), V {v} (bound {bv})"
        );
    }
}

#[test]
fn a_constant_deviation_per_chunk_and_layer_is_removed_by_one_pick_per_chunk() {
    let (_d, m) = tiny_of(&TinySpec {
        n_layer: 4,
        ..TinySpec::new(Architecture::Qwen2)
    });
    let s = setup(&m);
    let (full_cache, full) = m.prefill(&s.asm.ids).expect("prefill");
    let row = m.config().kv_row();
    let segs: Vec<Vec<usize>> = s.asm.chunks().map(|c| c.ids.clone().collect()).collect();
    let fused = moved_per_chunk_and_layer(&m, &full_cache, &segs);
    let all = s.asm.chunk_positions();
    let picks: Vec<usize> = segs.iter().map(|p| p[p.len() / 2]).collect();
    let plain = m
        .blend_prefill_on(&s.asm, fused.clone(), &picks)
        .expect("plain blend");
    let shifted = m
        .blend_prefill_shift(&s.asm, fused.clone(), &all, &picks, ShiftRule::Mean)
        .expect("shifted blend");
    assert_eq!(shifted.recomputed, picks);
    assert!(
        max_diff(&plain.logits, &full) > 1e-2,
        "the deviation moves an ordinary blend's logits"
    );
    // The deviation goes, up to the cache's f16 rounding of the moved rows: one f16 step
    // (~0.002 at these rows' magnitude ~2) at layer 0, which the random tiny model's int8
    // activations grow to ~0.015 by layer 3 and ~0.1 in the logits (observed), against ~1.9
    // for the plain blend.
    let moved = max_diff(&plain.logits, &full);
    let left = max_diff(&shifted.logits, &full);
    assert!(left < moved / 8.0, "{left} of {moved}");
    rows_within_f16_roundings(&shifted.cache, &full_cache);
    // A chunk without a pick keeps its rows; with every candidate picked it is a plain blend.
    let no_last: Vec<usize> = picks[..picks.len() - 1].to_vec();
    let partial = m
        .blend_prefill_shift(&s.asm, fused.clone(), &all, &no_last, ShiftRule::Mean)
        .expect("shifted blend");
    let last = segs.last().expect("a chunk")[0];
    let at = |c: &[f32]| c[last * row..(last + 1) * row].to_vec();
    assert_eq!(at(partial.cache.k(2)), at(fused.k(2)));
    // Weighted by key similarity, moves that are all the same are that move too (two picks
    // per chunk, so the weights matter), and the weights do change a real blend.
    let two: Vec<usize> = segs
        .iter()
        .flat_map(|p| [p[p.len() / 3], p[2 * p.len() / 3]])
        .collect();
    let similar = m
        .blend_prefill_shift(&s.asm, fused.clone(), &all, &two, ShiftRule::Similar)
        .expect("shifted blend");
    let left = max_diff(&similar.logits, &full);
    assert!(left < moved / 8.0, "{left} of {moved}");
    let every = m
        .blend_prefill_shift(&s.asm, fused.clone(), &all, &all, ShiftRule::Mean)
        .expect("shifted blend");
    let reference = m
        .blend_prefill_on(&s.asm, fused.clone(), &all)
        .expect("plain blend");
    assert_eq!(every.logits, reference.logits);
    let e = m
        .blend_prefill_shift(&s.asm, fused.clone(), &all, &[0], ShiftRule::Mean)
        .expect_err("a prefix position")
        .to_string();
    assert!(e.contains("not a candidate"), "{e}");
    // The selector keeps target_probe's picks.
    let refs: Vec<&ChunkKv> = s.standalone.iter().collect();
    let input = SelectInput::new(&m, &s.asm, &s.prefix, &refs, 0.25);
    let probe = TargetProbe::default().prefill(&input).expect("probe");
    let similar = TargetProbe {
        shift: true,
        ..TargetProbe::default()
    }
    .prefill(&input)
    .expect("target_probe_shift");
    assert_eq!(similar.recomputed, probe.recomputed);
    assert!(max_diff(&similar.logits, &probe.logits) > 1e-4);
    // The mean rule moves the same rows differently.
    let refs: Vec<&ChunkKv> = s.standalone.iter().collect();
    let fused = || m.fused_cache(&s.asm, &s.prefix, &refs).expect("fused");
    let cands = input.candidates();
    let rule = |r| {
        m.blend_prefill_shift(&s.asm, fused(), &cands, &probe.recomputed, r)
            .expect("shift")
    };
    let (mean, sim) = (rule(ShiftRule::Mean), rule(ShiftRule::Similar));
    assert!(max_diff(&mean.logits, &sim.logits) > 1e-4);
}

/// `target_probe_shift` in two rounds is what it says: target_probe's top half of the budget
/// blended with the shift, then a second probe over that cache, whose top picks among the rest
/// are blended over it; the logits are that second blend's, the look's reserve the rest in the
/// second probe's order, and one round's picks differ from the union.
#[test]
fn two_rounds_spend_half_the_budget_then_probe_again_over_the_blend() {
    let (_d, m) = tiny(Architecture::Qwen2);
    let s = setup(&m);
    let refs: Vec<&ChunkKv> = s.standalone.iter().collect();
    let input = SelectInput::new(&m, &s.asm, &s.prefix, &refs, 0.3);
    let (k, cands) = (input.spend(), input.candidates());
    let probe = |first_round| TargetProbe {
        shift: true,
        first_round,
        ..TargetProbe::default()
    };
    let two = probe(0.5).prefill(&input).expect("two rounds");
    // By hand: round one, the second probe, round two.
    let first_probe = probe(0.5).probe(&input).expect("probe");
    let sc = &first_probe.scores;
    let k1 = (k as f64 * 0.5).round() as usize;
    let first = top_k(&s.asm, &cands, |p| sc.score(p), k1, 0);
    let one = blend_shift(
        &m,
        &s.asm,
        first_probe.cache,
        &cands,
        &first,
        ShiftRule::Similar,
    )
    .expect("round one");
    let mut cache = one.cache;
    let rest: Vec<usize> = cands
        .iter()
        .copied()
        .filter(|p| !first.contains(p))
        .collect();
    let q_pos = s.asm.question_positions();
    let q_ids: Vec<u32> = q_pos.iter().map(|&p| s.asm.ids[p]).collect();
    let layers = layer_span(&m, 0.5, 1.0);
    let mass = m
        .probe(&q_ids, &q_pos, &mut cache, layers)
        .expect("probe again");
    let score = |p: usize| mass.get(p).copied().unwrap_or(0.0);
    let second = top_k(&s.asm, &rest, score, k - k1, 0);
    let by_hand =
        blend_shift(&m, &s.asm, cache, &rest, &second, ShiftRule::Similar).expect("round two");
    let mut union = [first.clone(), second.clone()].concat();
    union.sort_unstable();
    assert_eq!(two.recomputed, union);
    assert_eq!(two.recomputed.len(), k);
    assert_eq!(two.logits, by_hand.logits, "the second round's logits");
    assert_eq!(
        two.reserve,
        ranked_rest(&rest, &second, score),
        "the look's reserve: the rest as the second probe ranks it"
    );
    // The second probe moved: one round's picks are not the two rounds'.
    let single = probe(1.0).prefill(&input).expect("one round");
    assert_eq!(single.recomputed.len(), k);
    assert_ne!(single.recomputed, two.recomputed);
}
