//! SpecCache end to end on tiny models, and alignment between the two real tokenizers.

use speculator::{align, ChunkScores, IngestedSpecCache, SpanParams, SpecCache};
use std::sync::Arc;
use target_engine::gguf::GgufFile;
use target_engine::prelude::*;
use target_engine::testing::{write_tiny_gguf, TinySpec};
use target_engine::{
    Architecture, ChunkKv, LoadOptions, Model, RagTemplate, SelectInput, Selector, Tokenizer,
};

fn tiny(dir: &std::path::Path, arch: Architecture, seed: u64) -> Model {
    let path = dir.join(format!("{arch:?}-{seed}.gguf"));
    let mut spec = TinySpec::new(arch);
    spec.seed = seed;
    write_tiny_gguf(&path, &spec).expect("write");
    Model::load(
        &path,
        &LoadOptions {
            dense_min_rows: 1,
            ..Default::default()
        },
    )
    .expect("load")
}

const DOCS: [&str; 3] = [
    "the thin ant ran in the sand and then the ant sat 12345 times",
    "an ant and the other ant than the thing in a tin, naïve café",
    "a hint: the antenna is in the attic near the tent\n\n  fn main() {}",
];

#[test]
fn speccache_at_ratio_one_equals_full_prefill_and_respects_the_budget() {
    let dir = tempfile::tempdir().expect("tempdir");
    let target = tiny(dir.path(), Architecture::Qwen2, 1);
    let spec = Arc::new(tiny(dir.path(), Architecture::Llama, 2));
    let asm = RagTemplate::default().assemble(target.tokenizer(), &DOCS, "where is the antenna?");
    let prefix = target
        .prefix_kv(&asm.ids[asm.prefix_range()])
        .expect("prefix");
    let kvs: Vec<ChunkKv> = asm
        .chunks()
        .map(|s| {
            target
                .precompute(&asm.ids[s.ids.clone()], Some(&prefix))
                .expect("kv")
        })
        .collect();
    let refs: Vec<&ChunkKv> = kvs.iter().collect();
    let (_, full) = target.prefill(&asm.ids).expect("prefill");
    for complete_spans in [true, false] {
        let sel = SpecCache {
            params: SpanParams {
                complete_spans,
                ..Default::default()
            },
            ..SpecCache::new(spec.clone())
        };
        let all = SelectInput::new(&target, &asm, &prefix, &refs, 1.0);
        assert_eq!(
            sel.select(&all).expect("select"),
            asm.chunk_positions(),
            "ratio 1 selects every chunk token"
        );
        let out = sel.prefill(&all).expect("prefill");
        let d = out
            .logits
            .iter()
            .zip(&full)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(d < 1e-4, "{d}");
        for ratio in [0.0, 0.1, 0.15, 0.5] {
            let input = SelectInput::new(&target, &asm, &prefix, &refs, ratio);
            let picked = sel.select(&input).expect("select");
            let n = asm.chunk_positions().len();
            assert!(
                picked.len() <= target_engine::budget(ratio, n),
                "{ratio}: {} > budget",
                picked.len()
            );
            assert!(picked.iter().all(|p| asm.chunk_positions().contains(p)));
            assert_eq!(picked, sel.select(&input).expect("select"), "deterministic");
            if ratio > 0.0 {
                assert!(!picked.is_empty());
            }
        }
    }
}

fn real_tokenizer(file: &str) -> Option<Tokenizer> {
    let mut dirs: Vec<std::path::PathBuf> = Vec::new();
    if let Ok(d) = std::env::var("SPECRAG_MODELS") {
        dirs.push(d.into());
    }
    dirs.push(std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"));
    if let Ok(c) = std::env::var("SPECRAG_CACHE") {
        dirs.push(std::path::PathBuf::from(c).join("models"));
    }
    if let Ok(h) = std::env::var("HOME") {
        dirs.push(std::path::PathBuf::from(h).join(".cache/specrag/models"));
    }
    let path = dirs.iter().map(|d| d.join(file)).find(|p| p.is_file())?;
    Some(Tokenizer::from_gguf(&GgufFile::open(&path).expect("open")).expect("tokenizer"))
}

/// SmolLM2 -> Qwen alignment on hard text: every target token is reached from the speculator
/// tokens that overlap it, and a single selected token maps exactly to the overlapping ones.
#[test]
fn alignment_between_the_real_tokenizers_on_hard_text() {
    let (Some(qwen), Some(smol)) = (
        real_tokenizer("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
        real_tokenizer("smollm2-135m-instruct-q4_1.gguf"),
    ) else {
        panic!("default models missing: run `specrag models fetch`");
    };
    let text = "Zürich 東京 Привет 🙂👍🏽 ß ﬁ\n\n\t  x = 3.14159e-9; // 1234567890\r\n    return f(n-1)  +  f(n-2)";
    let q = qwen.encode(text, false);
    let s = smol.encode(text, false);
    let spans =
        |e: &target_engine::Encoding| e.offsets.iter().map(|&(a, b)| a..b).collect::<Vec<_>>();
    let (qs, ss) = (spans(&q), spans(&s));
    assert_ne!(qs, ss, "the two tokenizers differ on this text");
    assert_eq!(
        align(&ss, &ss, &qs),
        (0..qs.len()).collect::<Vec<_>>(),
        "all speculator tokens cover all target tokens"
    );
    for one in &ss {
        let got = align(std::slice::from_ref(one), &ss, &qs);
        let want: Vec<usize> = (0..qs.len())
            .filter(|&i| qs[i].start < one.end && one.start < qs[i].end)
            .collect();
        assert_eq!(got, want);
        assert!(!got.is_empty());
    }
    // Identity fast path when both sides are the same tokenizer.
    assert_eq!(align(&qs[3..5], &qs, &qs), vec![3, 4]);
}

/// Causality makes ingestion-time scoring exact for the first chunk: scoring it after the
/// prefix gives the scores a full query-time pass gives it. Later chunks differ (they miss the
/// chunks before them) but keep their tokens.
#[test]
fn ingestion_scores_match_query_scores_for_the_first_chunk() {
    let dir = tempfile::tempdir().expect("tempdir");
    let target = tiny(dir.path(), Architecture::Qwen2, 1);
    let spec = SpecCache::new(Arc::new(tiny(dir.path(), Architecture::Llama, 3)));
    let asm = RagTemplate::default().assemble(target.tokenizer(), &DOCS, "where is the antenna?");
    let query = spec.query_scores(&asm).expect("query scores");
    let prefix = spec
        .prefix_state(asm.segment_text(&asm.segments[0]))
        .expect("prefix");
    let stored: Vec<ChunkScores> = asm
        .chunks()
        .map(|s| {
            spec.score_chunk(&prefix, asm.segment_text(s))
                .expect("score")
        })
        .collect();
    let refs: Vec<&ChunkScores> = stored.iter().collect();
    let laid = spec.ingested_scores(&asm, &refs).expect("lay");
    assert_eq!(laid.spans, query.spans, "same tokens in the same places");
    assert_eq!(laid.chunk, query.chunk);
    let first = query.chunk.iter().filter(|&&c| c == 0).count();
    for (a, b) in laid.scores[..first].iter().zip(&query.scores[..first]) {
        assert!((a - b).abs() <= 1e-3 * b.abs().max(1.0), "{a} vs {b}");
    }
    let later_differs = laid.scores[first..]
        .iter()
        .zip(&query.scores[first..])
        .any(|(a, b)| (a - b).abs() > 1e-3 * b.abs().max(1.0));
    assert!(later_differs, "later chunks miss their preceding context");

    // Through the selector: ratio 1 is still full prefill, and bad inputs are errors.
    let tprefix = target
        .prefix_kv(&asm.ids[asm.prefix_range()])
        .expect("prefix");
    let kvs: Vec<ChunkKv> = asm
        .chunks()
        .map(|s| {
            target
                .precompute(&asm.ids[s.ids.clone()], Some(&tprefix))
                .expect("kv")
        })
        .collect();
    let kv_refs: Vec<&ChunkKv> = kvs.iter().collect();
    let sel = IngestedSpecCache {
        spec: &spec,
        scores: refs.clone(),
    };
    let all = SelectInput::new(&target, &asm, &tprefix, &kv_refs, 1.0);
    assert_eq!(sel.select(&all).expect("select"), asm.chunk_positions());
    let some = SelectInput::new(&target, &asm, &tprefix, &kv_refs, 0.15);
    let picked = sel.select(&some).expect("select");
    assert!(!picked.is_empty());
    assert!(picked.len() <= target_engine::budget(0.15, asm.chunk_positions().len()));
    assert!(spec.ingested_scores(&asm, &refs[..2]).is_err(), "count");
    let mut foreign = stored[0].clone();
    foreign.fingerprint = "another model".into();
    let bad = vec![&foreign, refs[1], refs[2]];
    assert!(spec.ingested_scores(&asm, &bad).is_err(), "fingerprint");
}

#[test]
fn attention_scores_cover_the_same_chunk_tokens_as_the_norms_and_depend_on_the_question() {
    let dir = tempfile::tempdir().expect("tempdir");
    let target = tiny(dir.path(), Architecture::Qwen2, 1);
    let spec = SpecCache::new(Arc::new(tiny(dir.path(), Architecture::Llama, 2)));
    let t = RagTemplate::default();
    let a = t.assemble(target.tokenizer(), &DOCS, "where is the antenna?");
    let b = t.assemble(target.tokenizer(), &DOCS, "how many times did the ant sit?");
    let norms = spec.query_scores(&a).expect("norms");
    let attn = spec.attention_scores(&a).expect("attention");
    assert_eq!(attn.spans, norms.spans, "the same speculator chunk tokens");
    assert_eq!(attn.chunk, norms.chunk);
    assert!(attn.scores.iter().all(|&s| s.is_finite() && s >= 0.0));
    assert!(attn.scores.iter().any(|&s| s > 0.0));
    // Norms of chunk tokens cannot see the question (causal); attention is the question's.
    let other = spec.attention_scores(&b).expect("attention");
    assert_eq!(spec.query_scores(&b).expect("norms").scores, norms.scores);
    assert_ne!(other.scores, attn.scores);
}

/// The speculator's prefix KV and each chunk's stored KV (from the scoring pass) for `asm`.
fn stored_spec_kv(
    spec: &SpecCache,
    target: &Model,
    asm: &target_engine::Assembly,
) -> (target_engine::PrefixKv, Vec<ChunkKv>) {
    let (prefix_text, _) = RagTemplate::default().prefix(target.tokenizer());
    let prefix = spec.prefix_state(&prefix_text).expect("prefix");
    let kvs = asm
        .segments
        .iter()
        .zip(speculator::segment_bytes(asm))
        .filter(|(s, _)| matches!(s.kind, target_engine::SegmentKind::Chunk(_)))
        .map(|(_, bytes)| {
            let text = &asm.text[bytes];
            let (scores, kv) = spec
                .score_chunk_with_kv(&prefix, text, true)
                .expect("score");
            let kv = kv.expect("kept");
            assert_eq!(scores, spec.score_chunk(&prefix, text).expect("score"));
            assert_eq!(
                kv,
                spec.chunk_kv(&prefix, text).expect("kv"),
                "one pass, same KV"
            );
            kv
        })
        .collect();
    (prefix, kvs)
}

#[test]
fn stored_speculator_kv_gives_the_full_pass_attention_when_nothing_is_missing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let target = tiny(dir.path(), Architecture::Qwen2, 1);
    let spec = SpecCache::new(Arc::new(tiny(dir.path(), Architecture::Llama, 2)));
    let t = RagTemplate::default();
    // One chunk right after the prefix: its stored KV is exactly what the full pass computes
    // (up to f16 storage), so the question's attention must agree.
    let one = t.assemble(target.tokenizer(), &DOCS[..1], "where is the antenna?");
    let (prefix, kvs) = stored_spec_kv(&spec, &target, &one);
    let refs: Vec<&ChunkKv> = kvs.iter().collect();
    let stored = spec
        .attention_scores_stored(&one, &prefix, &refs)
        .expect("stored");
    let full = spec.attention_scores(&one).expect("full");
    assert_eq!(stored.spans, full.spans);
    let d = stored
        .scores
        .iter()
        .zip(&full.scores)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(d < 1e-3, "stored vs full attention mass differs by {d}");

    // Three chunks: the later ones miss the earlier ones (as reused target KV does), so the
    // scores differ, but cover the same tokens.
    let three = t.assemble(target.tokenizer(), &DOCS, "where is the antenna?");
    let (prefix, kvs) = stored_spec_kv(&spec, &target, &three);
    let refs: Vec<&ChunkKv> = kvs.iter().collect();
    let stored = spec
        .attention_scores_stored(&three, &prefix, &refs)
        .expect("stored");
    let full = spec.attention_scores(&three).expect("full");
    assert_eq!(stored.spans, full.spans);
    assert!(stored.scores.iter().all(|&s| s.is_finite() && s >= 0.0));
    assert_ne!(stored.scores, full.scores);

    // KV that does not fit the prompt is refused, never scored.
    let swapped = vec![refs[1], refs[0], refs[2]];
    assert!(spec
        .attention_scores_stored(&three, &prefix, &swapped)
        .is_err());
    assert!(spec
        .attention_scores_stored(&three, &prefix, &refs[..2])
        .is_err());
    let other_prefix = spec.prefix_state("another prefix").expect("prefix");
    assert!(spec
        .attention_scores_stored(&three, &other_prefix, &refs)
        .is_err());
}
