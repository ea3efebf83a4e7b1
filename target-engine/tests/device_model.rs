//! The device engine ([`target_engine::device`]) held to the CPU engine, run here on candle's
//! CPU device: the code a GPU runs in a `--features cuda` build, checked without a GPU. Tiny
//! random-weight models of each family the device path runs. What is built on the passes (the
//! fused cache, the served selectors, the blend and its shift, verified decoding) is one code
//! for both engines ([`target_engine::Engine`]); these tests run it on both.

use target_engine::device::{
    closed_loop, closed_loop_chunked, BatchRequest, ChunkTier, ContinuousBatcher, DeviceCache,
    DeviceModel,
};
use target_engine::testing::{family_specs, write_tiny_gguf, TinySpec};
use target_engine::{
    argmax, blend_on, blend_shift, fused, verified_greedy, Architecture, Assembly, ChunkKv, Engine,
    FullRecompute, FullReuse, LoadOptions, Model, PrefixCaching, PrefixKv, Sampler, SamplingParams,
    SegmentKind, SelectInput, Selector, ShiftRule, TargetProbe,
};

/// The families the device forward runs, as the llama.cpp fixtures write them.
fn specs() -> Vec<(&'static str, TinySpec)> {
    family_specs()
        .into_iter()
        .filter(|(_, s)| {
            matches!(
                s.arch,
                Architecture::Qwen2 | Architecture::Llama | Architecture::Qwen3
            ) && !s.sentencepiece
        })
        .collect()
}

fn load(spec: &TinySpec) -> (tempfile::TempDir, Model, DeviceModel) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, spec).expect("write");
    let cpu = Model::load(&path, &LoadOptions::default()).expect("cpu load");
    let dev = DeviceModel::load(&path, &candle_core::Device::Cpu).expect("device load");
    (dir, cpu, dev)
}

fn ids(n: usize, seed: u32, vocab: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97) >> 7) % (vocab as u32 - 8))
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// What a store holds for `asm` on `engine`: the prefix's exact KV and each chunk's KV
/// computed after the prefix (how ingestion stores it), each engine its own.
fn stored<E: Engine>(engine: &E, asm: &Assembly) -> (PrefixKv, Vec<ChunkKv>) {
    let prefix = engine
        .prefix_of(&asm.ids[asm.prefix_range()])
        .expect("prefix");
    let chunks = asm
        .chunks()
        .map(|s| {
            engine
                .chunk_kv(&asm.ids[s.ids.clone()], Some(&prefix))
                .expect("precompute")
        })
        .collect();
    (prefix, chunks)
}

/// A prompt of a 7-token prefix, three chunks of 23, 31 and 17 tokens and a 9-token question.
fn prompt(vocab: usize) -> Assembly {
    let mut asm = Assembly::default();
    asm.push(SegmentKind::Prefix, "", &ids(7, 1, vocab));
    for (i, (n, seed)) in [(23, 2), (31, 3), (17, 4)].into_iter().enumerate() {
        asm.push(SegmentKind::Chunk(i), "", &ids(n, seed, vocab));
    }
    asm.push(SegmentKind::Question, "", &ids(9, 5, vocab));
    asm
}

fn chunk_ranges(asm: &Assembly) -> Vec<std::ops::Range<usize>> {
    asm.chunks().map(|s| s.ids.clone()).collect()
}

/// How far the device's first-token logits may be from the CPU engine's: the tolerance the
/// family fixtures hold the CPU engine to against llama.cpp (both sides quantize activations
/// to int8, in blocks of their own).
const LOGIT: f32 = 0.15;

/// A greedy continuation may split from the CPU engine's only where the CPU engine's logits of
/// the two tokens are this close (the family fixtures' bound for decode steps).
const DECODE_NEAR_TIE: f32 = 0.25;

/// First-token logits and a greedy continuation on the device equal the CPU engine's up to the
/// difference between weight paths.
#[test]
fn device_forward_matches_the_cpu_engine() {
    for (name, spec) in specs() {
        let (_dir, cpu, dev) = load(&spec);
        let vocab = cpu.tokenizer().vocab_size();
        let prompt = ids(40, 9, vocab);
        let (mut cpu_cache, cpu_logits) = cpu.prefill(&prompt).expect("cpu prefill");
        let (mut dev_cache, dev_logits) = dev.prefill(&prompt, 64).expect("device prefill");
        let d = max_diff(&cpu_logits, &dev_logits);
        assert!(d < LOGIT, "{name}: first-token logits differ by {d}");
        let n = 8;
        let mut cpu_tokens = Vec::new();
        let mut steps = vec![cpu_logits.clone()];
        for i in 0..n {
            let next = argmax(&steps[i]);
            cpu_tokens.push(next);
            let out = cpu
                .forward(&[next], &[prompt.len() + i], &mut cpu_cache, false)
                .expect("cpu step");
            steps.push(cpu.last_logits(&out).expect("logits"));
        }
        let dev_tokens = dev
            .greedy(&mut dev_cache, prompt.len(), &dev_logits, n)
            .expect("device greedy");
        // Equal, or apart only from a step where the CPU engine's two candidates are a near-tie.
        if let Some(i) = (0..n).find(|&i| cpu_tokens[i] != dev_tokens[i]) {
            let l = &steps[i];
            let gap = l[cpu_tokens[i] as usize] - l[dev_tokens[i] as usize];
            assert!(
                gap < DECODE_NEAR_TIE,
                "{name}: greedy splits at step {i} by {gap}: {cpu_tokens:?} vs {dev_tokens:?}"
            );
        }
    }
}

/// The GPU check's random models of real shapes (here the small one) load on both engines in
/// either format and agree on the first token's logits.
#[test]
fn real_shape_models_agree_in_both_formats() {
    for format in [
        target_engine::GgmlDType::Q8_0,
        target_engine::GgmlDType::Q4K,
    ] {
        let mut spec = TinySpec::qwen2_shape("small").expect("small shape");
        spec.real_format = format;
        let (_dir, cpu, dev) = load(&spec);
        assert_eq!(dev.config().n_embd, 256);
        let vocab = cpu.tokenizer().vocab_size();
        let prompt = ids(48, 3, vocab);
        let (_, want) = cpu.prefill(&prompt).expect("cpu prefill");
        let (_, got) = dev.prefill(&prompt, prompt.len()).expect("device prefill");
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = max_diff(&want, &got);
        assert!(scale > 1.0, "{format:?}: logits up to {scale}");
        assert!(d < LOGIT, "{format:?}: first-token logits differ by {d}");
    }
    assert!(TinySpec::qwen2_shape("13b").is_none());
}

/// The question's attention mass per position equals the CPU engine's probe on the same full
/// cache, and each probed row and head spends exactly one unit of it.
#[test]
fn device_probe_matches_the_cpu_engine() {
    for (name, spec) in specs() {
        let (_dir, cpu, dev) = load(&spec);
        let vocab = cpu.tokenizer().vocab_size();
        let context = ids(50, 11, vocab);
        let question = ids(6, 12, vocab);
        let positions: Vec<usize> = (50..56).collect();
        let (mut cpu_cache, _) = cpu.prefill(&context).expect("cpu prefill");
        let (mut dev_cache, _) = dev.prefill(&context, 64).expect("device prefill");
        let layers = 1..2;
        let want = cpu
            .forward_probe(&question, &positions, &mut cpu_cache, layers.clone())
            .expect("cpu probe");
        let got = dev
            .probe(&question, &positions, &mut dev_cache, layers)
            .expect("device probe");
        assert_eq!(got.len(), 56, "{name}");
        let total: f32 = got.iter().sum();
        let units = (question.len() * spec.n_head) as f32;
        assert!((total - units).abs() < 1e-3 * units, "{name}: mass {total}");
        let d = max_diff(&want, &got);
        let top = want.iter().fold(0f32, |m, x| m.max(*x));
        assert!(
            d < 0.05 * top,
            "{name}: probe differs by {d} (largest mass {top})"
        );
    }
}

/// ρ = 1 on the device (every chunk token recomputed over the fused cache) gives the full
/// prefill's logits; a chunk stored standalone and placed at position 0 behind an empty prefix
/// is the full prefill's own KV; chunk KV placed elsewhere gets the keys a forward at those
/// positions computes (layer 0 depends on nothing else).
#[test]
fn device_blend_identities() {
    for (name, spec) in specs() {
        let (_dir, cpu, dev) = load(&spec);
        let vocab = cpu.tokenizer().vocab_size();
        let p = prompt(vocab);
        let all = p.ids.clone();
        let (_, full) = dev.prefill(&all, all.len()).expect("prefill");
        let (prefix_kv, chunks) = stored(&dev, &p);
        let refs: Vec<&ChunkKv> = chunks.iter().collect();
        let cache = fused(&dev, &p, &prefix_kv, &refs, 0).expect("fused");
        let out = blend_on(&dev, &p, cache, &p.chunk_positions()).expect("blend");
        let scale = full.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = max_diff(&full, &out.logits);
        // Cache rows are f16 as stored; what is left is candle's products rounding a row
        // differently in another batch.
        assert!(
            d < 1e-2 * scale,
            "{name}: rho = 1 differs by {d} (scale {scale})"
        );

        // Placement: layer-0 keys of the second chunk, stored after the prefix and placed at
        // its offset.
        let range = chunk_ranges(&p)[1].clone();
        let placed = out.cache.k_rows(0, range.clone()).expect("rows");
        let positions: Vec<usize> = range.clone().collect();
        let direct = cpu
            .layer0_keys(&all[range.clone()], &positions)
            .expect("layer-0 keys");
        let kscale = direct.iter().fold(0f32, |m, x| m.max(x.abs()));
        // The blend rewrote the rows; place again into a fresh cache to read them.
        let fresh = fused(&dev, &p, &prefix_kv, &refs, 0).expect("fused");
        let placed_fresh = fresh.k_rows(0, range).expect("rows");
        let d = max_diff(&direct, &placed_fresh);
        assert!(d < 2e-2 * kscale, "{name}: placed keys differ by {d}");
        assert_ne!(
            placed, placed_fresh,
            "{name}: rho = 1 rewrites every chunk row"
        );

        // Empty prefix and one chunk stored standalone: the stored chunk is the prompt's own
        // exact KV.
        let mut one = Assembly::default();
        one.push(SegmentKind::Prefix, "", &[]);
        let first = &all[chunk_ranges(&p)[0].clone()];
        one.push(SegmentKind::Chunk(0), "", first);
        one.push(SegmentKind::Question, "", &all[p.question_positions()[0]..]);
        let (_, want) = dev.prefill(&one.ids, one.ids.len()).expect("prefill");
        let empty = dev.prefix_of(&[]).expect("empty prefix");
        let alone = dev.chunk_kv(first, None).expect("standalone");
        let cache = fused(&dev, &one, &empty, &[&alone], 0).expect("fused");
        let got = blend_on(&dev, &one, cache, &[]).expect("blend");
        let d = max_diff(&want, &got.logits);
        // The chunk's stored f16 rows are the rows a prefill keeps; what is left is candle's
        // products rounding a row differently in another batch.
        assert!(d < 1e-2 * scale, "{name}: exact first chunk differs by {d}");
    }
}

/// The served selectors are one code on both engines: on the same prompt, each engine with
/// the chunk KV it stored itself, every method recomputes the same chunk tokens (target_probe
/// picks by the question's attention, which the two engines compute alike up to rounding)
/// and the first-token logits agree within the engines' bound; ρ = 1 on the device is its
/// full prefill. KV stored by one engine is refused by the other.
#[test]
fn the_served_selectors_run_alike_on_both_engines() {
    const METHODS: [&str; 5] = [
        "full_recompute",
        "full_reuse",
        "prefix_caching",
        "target_probe",
        "target_probe_shift",
    ];
    for (name, spec) in specs() {
        let (_dir, cpu, dev) = load(&spec);
        let vocab = cpu.tokenizer().vocab_size();
        let p = prompt(vocab);
        let (cpu_prefix, cpu_chunks) = stored(&cpu, &p);
        let (dev_prefix, dev_chunks) = stored(&dev, &p);
        let cpu_refs: Vec<&ChunkKv> = cpu_chunks.iter().collect();
        let dev_refs: Vec<&ChunkKv> = dev_chunks.iter().collect();
        let (_, full) = dev.prefill(&p.ids, p.ids.len()).expect("prefill");
        for method in METHODS {
            for ratio in [0.25, 1.0] {
                let cpu_in = SelectInput::new(&cpu, &p, &cpu_prefix, &cpu_refs, ratio);
                let mut dev_in = SelectInput::new(&dev, &p, &dev_prefix, &dev_refs, ratio);
                dev_in.room = 4;
                assert!(cpu_in.first_chunk_exact && dev_in.first_chunk_exact);
                let want = served::<Model>(method).prefill(&cpu_in).expect("cpu");
                let got = served::<DeviceModel>(method)
                    .prefill(&dev_in)
                    .expect("device");
                let at = format!("{name} {method} @ {ratio}");
                alike(&at, &want, &got);
                if ratio == 1.0 && method != "full_reuse" {
                    // Every chunk token recomputed: the device's own full prefill.
                    let scale = full.iter().fold(0f32, |m, x| m.max(x.abs()));
                    let d = max_diff(&full, &got.logits);
                    assert!(d < 1e-2 * scale, "{at}: rho = 1 differs by {d}");
                }
            }
        }
        let err = fused(&dev, &p, &dev_prefix, &cpu_refs, 0)
            .expect_err("CPU KV on the device")
            .to_string();
        assert!(err.contains("another model or engine"), "{err}");
        assert!(fused(&cpu, &p, &cpu_prefix, &dev_refs, 0).is_err());
    }
}

/// The served selector named `method`, on engine `E`.
fn served<E: Engine>(method: &str) -> Box<dyn Selector<E>> {
    match method {
        "full_recompute" => Box::new(FullRecompute),
        "full_reuse" => Box::new(FullReuse),
        "prefix_caching" => Box::new(PrefixCaching),
        "target_probe" => Box::new(TargetProbe::default()),
        _ => Box::new(TargetProbe {
            shift: true,
            ..TargetProbe::default()
        }),
    }
}

/// A blend on the device against the CPU engine's: the same number of picks, at least 90% of
/// them shared (all were, on every family, when written), the same chunk tokens and reserve,
/// and first-token logits within the engines' bound.
fn alike<A, B>(
    at: &str,
    want: &target_engine::BlendOutput<A>,
    got: &target_engine::BlendOutput<B>,
) {
    let shared = got
        .recomputed
        .iter()
        .filter(|q| want.recomputed.contains(q))
        .count();
    let d = max_diff(&want.logits, &got.logits);
    eprintln!(
        "{at}: {shared} of {} picks shared, logits {d}",
        want.recomputed.len()
    );
    assert_eq!(got.recomputed.len(), want.recomputed.len(), "{at}");
    assert_eq!(got.chunk_tokens, want.chunk_tokens, "{at}");
    assert!(
        shared * 10 >= want.recomputed.len() * 9,
        "{at}: {shared} picks shared"
    );
    assert!(d < LOGIT, "{at}: logits differ by {d}");
    assert_eq!(got.reserve.is_empty(), want.reserve.is_empty(), "{at}");
}

/// A greedy answer decoded on a partly reused cache and verified against the full cache is
/// the full cache's greedy answer, on either engine, by the same code.
#[test]
fn verification_equals_full_recompute_on_both_engines() {
    fn check<E: Engine>(name: &str, engine: &E, p: &Assembly) {
        let all = &p.ids;
        let n = 12;
        let room = n + 1;
        let (mut reference, full) = engine.prefill_into(all, all.len() + room).expect("prefill");
        let want =
            target_engine::greedy(engine, &mut reference, all.len(), &full, n).expect("greedy");
        let (mut exact, _) = engine.prefill_into(all, all.len() + room).expect("prefill");
        let (prefix_kv, chunks) = stored(engine, p);
        let refs: Vec<&ChunkKv> = chunks.iter().collect();
        let mut input = SelectInput::new(engine, p, &prefix_kv, &refs, 0.15);
        input.room = room;
        let draft = TargetProbe::default().prefill(&input).expect("blend");
        assert_eq!(draft.recomputed.len(), input.spend(), "{name}");
        let mut draft_cache = draft.cache;
        let v = verified_greedy(
            engine,
            &mut exact,
            &full,
            &mut draft_cache,
            &draft.logits,
            all.len(),
            n,
            4,
        )
        .expect("verify");
        assert_eq!(v.tokens, want, "{name} on {}", engine.device_name());
        assert!(v.rounds >= n / 4, "{name}: {} rounds", v.rounds);
    }
    for (name, spec) in specs() {
        let (_dir, cpu, dev) = load(&spec);
        let p = prompt(cpu.tokenizer().vocab_size());
        check(name, &cpu, &p);
        check(name, &dev, &p);
    }
}

/// Several requests decoded in one forward per step give each request the tokens it gets
/// decoded alone.
#[test]
fn batched_decode_equals_each_request_alone() {
    for (name, spec) in specs() {
        let (_dir, cpu, dev) = load(&spec);
        let vocab = cpu.tokenizer().vocab_size();
        let prompts: Vec<Vec<u32>> = (0..3)
            .map(|i| ids(20 + 7 * i, 30 + i as u32, vocab))
            .collect();
        let n = 10;
        let mut alone = Vec::new();
        let (mut caches, mut firsts, mut lens) = (Vec::new(), Vec::new(), Vec::new());
        for p in &prompts {
            let (mut cache, logits) = dev.prefill(p, p.len() + n).expect("prefill");
            alone.push(dev.greedy(&mut cache, p.len(), &logits, n).expect("greedy"));
            let (cache, logits) = dev.prefill(p, p.len() + n).expect("prefill");
            caches.push(cache);
            firsts.push(logits);
            lens.push(p.len());
        }
        let together = dev
            .greedy_batch(&mut caches, &lens, &firsts, n)
            .expect("batch");
        assert_eq!(together, alone, "{name}");
        let err = dev
            .forward_batch(&[1, 2], &[3], &mut caches[..2])
            .expect_err("mismatched lengths")
            .to_string();
        assert!(err.contains("2 token ids, 1 positions"), "{err}");
    }
}

/// The server's batcher ([`target_engine::DecodeBatcher`], written once for both engines) on
/// the device engine: requests decoding on their own threads share passes and get, token for
/// token, what each gets decoded alone; a step of several tokens gets the rows of a forward.
#[test]
fn the_servers_batcher_runs_the_device_engine_as_each_request_alone() {
    use std::sync::{Arc, Barrier};
    use target_engine::DecodeBatcher;
    let (name, spec) = specs().remove(0);
    let (_dir, cpu, dev) = load(&spec);
    let vocab = cpu.tokenizer().vocab_size();
    let dev = Arc::new(dev);
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| ids(18 + 5 * i, 40 + i as u32, vocab))
        .collect();
    let n = 8;
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let (mut cache, logits) = dev.prefill(p, p.len() + n).expect("prefill");
            dev.greedy(&mut cache, p.len(), &logits, n).expect("greedy")
        })
        .collect();
    let batcher = Arc::new(DecodeBatcher::<target_engine::device::DeviceModel>::new(
        8,
        std::time::Duration::from_secs(2),
    ));
    let seated = Arc::new(Barrier::new(prompts.len()));
    let threads: Vec<_> = prompts
        .into_iter()
        .map(|p| {
            let (dev, b, seated) = (Arc::clone(&dev), Arc::clone(&batcher), Arc::clone(&seated));
            std::thread::spawn(move || {
                let (mut cache, logits) = dev.prefill(&p, p.len() + n).expect("prefill");
                let _seat = b.seat();
                seated.wait();
                let mut out = vec![argmax(&logits)];
                for i in 1..n {
                    let at = p.len() + i - 1;
                    let last = *out.last().expect("a token");
                    let rows = b.step(&*dev, &[last], at, &mut cache).expect("step");
                    out.push(argmax(&rows[0]));
                }
                out
            })
        })
        .collect();
    let together: Vec<Vec<u32>> = threads
        .into_iter()
        .map(|t| t.join().expect("no panic"))
        .collect();
    assert_eq!(together, alone, "{name}");
    let s = batcher.stats();
    assert_eq!((s.passes, s.max_steps), (n as u64 - 1, 3), "{name}: {s:?}");
    // A token and a draft after it (a verification check) run in a forward of their own.
    let (mut cache, _) = dev.prefill(&[1, 2, 3], 8).expect("prefill");
    let (mut alone, _) = dev.prefill(&[1, 2, 3], 8).expect("prefill");
    let rows = batcher
        .step(&*dev, &[4, 5], 3, &mut cache)
        .expect("two tokens");
    let want = dev
        .logits(&dev.forward(&[4, 5], &[3, 4], &mut alone).expect("forward"))
        .expect("logits");
    assert_eq!(rows, want, "{name}");
    assert_eq!(cache.len(), 5, "{name}");
}

/// Requests that join a running batch and leave it at different steps (continuous batching)
/// get each the tokens it gets decoded alone, whatever else was in the batch with it.
#[test]
fn continuous_batching_gives_each_request_its_answer_alone() {
    let Some((name, spec)) = specs().into_iter().next() else {
        panic!("no device family");
    };
    let (_dir, cpu, dev) = load(&spec);
    let vocab = cpu.tokenizer().vocab_size();
    // Client 1 samples (a seed per request), the others decode greedily.
    let request = |client: usize, k: usize| BatchRequest {
        prompt: ids(9 + 5 * client + 3 * k, (10 * client + k) as u32 + 40, vocab),
        max_new: 1 + (3 * client + 5 * k) % 9,
        sampling: SamplingParams {
            temperature: if client == 1 { 0.9 } else { 0.0 },
            top_p: 0.95,
            seed: 7 + k as u64,
        },
    };
    let alone = |r: &BatchRequest| decode_alone(&dev, r);
    // Three clients, three requests each, answers of 1 to 9 tokens: requests join while
    // others decode and leave before them.
    let run = closed_loop(&dev, 3, 3, request).expect("closed loop");
    assert_eq!(run.outcomes.len(), 9, "{name}");
    assert_eq!(
        run.peak_batch, 3,
        "{name}: every client's request in the batch at once"
    );
    let mut seen = std::collections::HashMap::<usize, usize>::new();
    for (client, o) in &run.outcomes {
        let k = seen.entry(*client).or_default();
        let r = request(*client, *k);
        *k += 1;
        assert_eq!(
            o.tokens.len(),
            r.max_new,
            "{name}: client {client} request {}",
            *k - 1
        );
        assert_eq!(
            o.tokens,
            alone(&r),
            "{name}: client {client} request {}",
            *k - 1
        );
        assert!(o.ttft <= o.total);
    }
    assert!(run.tokens_per_s() > 0.0 && run.ttft_ms(0.5) <= run.ttft_ms(0.95));
    // A batch capped below the arrivals queues the rest; bad requests are refused by name.
    let mut b = ContinuousBatcher::new(&dev, 2, 4);
    for c in 0..4 {
        b.submit(request(c, 1)).expect("submit");
    }
    let mut finished = Vec::new();
    while b.pending() > 0 {
        finished.extend(b.step().expect("step"));
    }
    assert_eq!(b.peak_batch(), 2);
    finished.sort_by_key(|o| o.id);
    for (c, o) in finished.iter().enumerate() {
        assert_eq!(
            o.tokens,
            alone(&request(c, 1)),
            "{name}: capped batch, request {c}"
        );
    }
    let empty = BatchRequest::greedy(vec![], 3);
    assert!(b
        .submit(empty)
        .expect_err("empty")
        .to_string()
        .contains("empty prompt"));
    let none = BatchRequest::greedy(vec![1], 0);
    assert!(b
        .submit(none)
        .expect_err("zero")
        .to_string()
        .contains("max_new"));
}

/// Chunked prefill: arrivals are prefilled a piece per step while the batch decodes, and each
/// request still gets the tokens it gets alone.
#[test]
fn chunked_prefill_gives_each_request_its_answer_alone_a_piece_per_step() {
    let Some((name, spec)) = specs().into_iter().next() else {
        panic!("no device family");
    };
    let (_dir, cpu, dev) = load(&spec);
    let vocab = cpu.tokenizer().vocab_size();
    let request = |client: usize, k: usize| {
        BatchRequest::greedy(
            ids(7 + 6 * client + 2 * k, (10 * client + k) as u32 + 70, vocab),
            1 + (2 * client + 3 * k) % 7,
        )
    };
    let run = closed_loop_chunked(&dev, 3, 3, 4, request).expect("closed loop");
    assert_eq!(run.outcomes.len(), 9, "{name}");
    let mut seen = std::collections::HashMap::<usize, usize>::new();
    for (client, o) in &run.outcomes {
        let k = seen.entry(*client).or_default();
        assert_eq!(
            o.tokens,
            decode_alone(&dev, &request(*client, *k)),
            "{name}"
        );
        *k += 1;
    }
    assert!(run.max_gap_ms(1.0) >= run.max_gap_ms(0.5));
    // A 10-token prompt in pieces of 4: its only token comes with the third step.
    let mut b = ContinuousBatcher::new(&dev, 2, 1).with_prefill_chunk(4);
    b.submit(BatchRequest::greedy(ids(10, 5, vocab), 1))
        .expect("submit");
    let steps: Vec<usize> = (0..3).map(|_| b.step().expect("step").len()).collect();
    assert_eq!(steps, [0, 0, 1], "{name}");
    assert_eq!(b.pending(), 0);
}

/// A request decoded by itself on the device: greedy, or drawn as its sampling says.
fn decode_alone(dev: &DeviceModel, r: &BatchRequest) -> Vec<u32> {
    let (mut cache, logits) = dev
        .prefill(&r.prompt, r.prompt.len() + r.max_new)
        .expect("prefill");
    let sampler = Sampler::new(r.sampling);
    dev.decode(&mut cache, r.prompt.len(), &logits, r.max_new, &sampler)
        .expect("decode")
}

/// Sampled on the device: the seed decides the tokens (the i-th drawn at index i, as the CPU
/// engine draws it), and temperature 0 is the greedy answer.
#[test]
fn device_sampling_follows_the_seed_and_temperature_zero_is_greedy() {
    let Some((name, spec)) = specs().into_iter().next() else {
        panic!("no device family");
    };
    let (_dir, cpu, dev) = load(&spec);
    let prompt = ids(17, 3, cpu.tokenizer().vocab_size());
    let sampled = |seed| BatchRequest {
        prompt: prompt.clone(),
        max_new: 6,
        sampling: SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            seed,
        },
    };
    assert_eq!(
        decode_alone(&dev, &sampled(5)),
        decode_alone(&dev, &sampled(5)),
        "{name}: one seed, one answer"
    );
    assert!(
        (0..8).any(|s| decode_alone(&dev, &sampled(s)) != decode_alone(&dev, &sampled(s + 100))),
        "{name}: the seed changes what is drawn"
    );
    let (mut cache, logits) = dev.prefill(&prompt, prompt.len() + 6).expect("prefill");
    assert_eq!(
        decode_alone(&dev, &BatchRequest::greedy(prompt.clone(), 6)),
        dev.greedy(&mut cache, prompt.len(), &logits, 6)
            .expect("greedy"),
        "{name}"
    );
}

/// What the device path does not run is refused by name, and an unknown device is an error.
#[test]
fn device_refusals_name_what_is_missing() {
    let (_, spec) = family_specs()
        .into_iter()
        .find(|(_, s)| s.arch == Architecture::Phi3)
        .expect("phi3");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, &spec).expect("write");
    let err = DeviceModel::load(&path, &candle_core::Device::Cpu)
        .expect_err("phi3 is CPU-only")
        .to_string();
    assert!(
        err.contains("phi3") && err.contains("--device cpu"),
        "{err}"
    );
    let err = target_engine::device::parse_device("tpu")
        .expect_err("tpu")
        .to_string();
    assert!(err.contains("cpu, cuda or cuda:N"), "{err}");
    assert!(target_engine::device::parse_device("cpu").is_ok());
    if !cfg!(feature = "cuda") {
        let err = target_engine::device::parse_device("cuda:0")
            .expect_err("no cuda")
            .to_string();
        assert!(err.contains("--features cuda"), "{err}");
    }
}

/// `cache` with every chunk row of `p` moved by a deviation constant per chunk and layer (K
/// before RoPE).
fn moved_per_chunk_and_layer(cpu: &Model, p: &Assembly, cache: &DeviceCache) -> DeviceCache {
    let (row, heads) = (cpu.config().kv_row(), cpu.config().n_kv_head);
    let mut moved = cache.deep_copy().expect("copy");
    for (c, range) in chunk_ranges(p).into_iter().enumerate() {
        let at: Vec<i64> = range.clone().map(|q| q as i64).collect();
        for l in 0..cpu.config().n_layer {
            let ck: Vec<f32> = (0..row)
                .map(|i| 0.4 * ((i + 7 * c + 3 * l) as f32).sin())
                .collect();
            let cv: Vec<f32> = (0..row)
                .map(|i| 0.4 * ((2 * i + 5 * c + l) as f32).cos())
                .collect();
            let mut dk = ck.repeat(range.len());
            cpu.rope_at(l)
                .rotate_by(&mut dk, heads, &at)
                .expect("rotate");
            let k: Vec<f32> = cache
                .k_rows(l, range.clone())
                .expect("k")
                .iter()
                .zip(&dk)
                .map(|(a, b)| a + b)
                .collect();
            let v: Vec<f32> = cache
                .v_rows(l, range.clone())
                .expect("v")
                .iter()
                .zip(cv.iter().cycle())
                .map(|(a, b)| a + b)
                .collect();
            moved.set_rows(l, range.clone(), &k, &v).expect("set rows");
        }
    }
    moved
}

/// `target_probe_shift`'s blend on the device (the shared `blend_shift` over the device's
/// per-layer step): a deviation of every reused chunk row that is constant per chunk and layer
/// (K before RoPE) is removed by one recomputed token per chunk up to the cache's f16
/// rounding of the moved rows, as on the CPU engine (`blend_tiny.rs`), where a plain blend
/// keeps it; a chunk without a pick keeps its rows. The rounding is within two f16 steps at
/// layer 0; the random tiny models' int8 activations grow it to ~0.4% of the rows' scale at
/// layer 1 and ~3% of the plain blend's logit error (observed). The CPU engine's other rule
/// (the picks' mean) is refused by name.
#[test]
fn device_shift_removes_a_constant_deviation_per_chunk_and_layer() {
    for (name, spec) in specs() {
        let (_dir, cpu, dev) = load(&spec);
        let vocab = cpu.tokenizer().vocab_size();
        let p = prompt(vocab);
        let all = p.ids.clone();
        let candidates = p.chunk_positions();
        let (full_cache, full) = dev.prefill(&all, all.len()).expect("prefill");
        let moved = moved_per_chunk_and_layer(&cpu, &p, &full_cache);
        let picks: Vec<usize> = chunk_ranges(&p)
            .iter()
            .map(|r| r.start + r.len() / 2)
            .collect();
        let scale = full.iter().fold(0f32, |m, x| m.max(x.abs()));
        let copy = || moved.deep_copy().expect("copy");
        let plain = blend_on(&dev, &p, copy(), &picks).expect("blend");
        let shift = |cache, picks: &[usize]| {
            blend_shift(&dev, &p, cache, &candidates, picks, ShiftRule::Similar)
                .expect("shifted blend")
        };
        let shifted = shift(copy(), &picks);
        let (d_plain, d_shift) = (
            max_diff(&plain.logits, &full),
            max_diff(&shifted.logits, &full),
        );
        eprintln!("{name}: plain {d_plain}, shifted {d_shift} (scale {scale})");
        assert!(
            d_plain > 0.05 * scale,
            "{name}: the deviation moves a plain blend ({d_plain})"
        );
        assert!(
            d_shift < d_plain / 8.0,
            "{name}: shifted differs by {d_shift}"
        );
        // Two f16 roundings at layer 0 (the moved rows, the shifted rows: within two steps of
        // the largest value's binade), 1% of the scale past it.
        let bound = |l: usize, scale: f32| {
            if l == 0 {
                scale.max(1.0) / 512.0
            } else {
                scale.max(1.0) / 100.0
            }
        };
        for l in 0..cpu.config().n_layer {
            for r in chunk_ranges(&p) {
                let want = full_cache.k_rows(l, r.clone()).expect("k");
                let got = shifted.cache.k_rows(l, r.clone()).expect("k");
                let kscale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
                assert!(max_diff(&want, &got) < bound(l, kscale), "{name}: K {l}");
                let want = full_cache.v_rows(l, r.clone()).expect("v");
                let got = shifted.cache.v_rows(l, r).expect("v");
                let vscale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
                assert!(max_diff(&want, &got) < bound(l, vscale), "{name}: V {l}");
            }
        }
        // The last chunk without a pick keeps its moved rows.
        let partial = shift(copy(), &picks[..picks.len() - 1]);
        let last = chunk_ranges(&p).last().cloned().expect("chunks");
        let kept = moved.k_rows(0, last.clone()).expect("k");
        assert_eq!(partial.cache.k_rows(0, last).expect("k"), kept, "{name}");
        let err = blend_shift(&dev, &p, copy(), &candidates, &picks, ShiftRule::Mean)
            .expect_err("the mean rule")
            .to_string();
        assert!(
            err.contains("Mean") && err.contains("--device cpu"),
            "{err}"
        );
    }
}

/// Plain decoding (`Generate`: sampling, stop strings, logprobs, the watch) and verified
/// decoding (`Verify`) are one code for both engines: on the device, a greedy generation is
/// the device's own greedy continuation and splits from the CPU engine's only at a near-tie of
/// the CPU's; a verified answer drafted on a target_probe@0.15 cache, and the guard's
/// continuation of a reused answer on the full cache (`continue_exact`), are the device full
/// cache's greedy answer token for token; the device cache grows past its first capacity.
#[test]
fn plain_and_verified_decoding_run_alike_on_both_engines() {
    use target_engine::prelude::{Generate, Verify};
    use target_engine::{Continuation, FilledCache, GenerateParams, VerifyParams};
    for (name, spec) in specs() {
        let (_dir, cpu, dev) = load(&spec);
        let p = prompt(cpu.tokenizer().vocab_size());
        let n = 12;
        let params = GenerateParams {
            max_tokens: n,
            logprobs: Some(2),
            ..GenerateParams::default()
        };
        let on_cpu = cpu.generate(&p.ids, &params).expect("cpu generate");
        let on_dev = dev.generate(&p.ids, &params).expect("device generate");
        let (mut cache, logits) = dev.prefill_into(&p.ids, p.ids.len()).expect("prefill");
        let alone =
            target_engine::greedy(&dev, &mut cache, p.ids.len(), &logits, n).expect("greedy");
        assert_eq!(on_dev.ids, alone[..on_dev.ids.len()], "{name}");
        assert_eq!(on_dev.logprobs.len(), on_dev.ids.len(), "{name}");
        if let Some(i) =
            (0..on_cpu.ids.len().min(on_dev.ids.len())).find(|&i| on_cpu.ids[i] != on_dev.ids[i])
        {
            let gap = on_cpu.margins[i];
            assert!(
                gap < DECODE_NEAR_TIE,
                "{name}: split at {i} with a gap of {gap}"
            );
        }

        // Verified on the device: drafted on a reused cache, committed from the full one.
        let (prefix, chunks) = stored(&dev, &p);
        let refs: Vec<&ChunkKv> = chunks.iter().collect();
        let input = SelectInput::new(&dev, &p, &prefix, &refs, 0.15);
        let draft = TargetProbe::default().prefill(&input).expect("blend");
        let draft = FilledCache {
            cache: draft.cache,
            logits: draft.logits,
        };
        let full = || dev.prefill_into(&p.ids, p.ids.len()).map(FilledCache::from);
        let verify = VerifyParams {
            max_tokens: n,
            ..VerifyParams::default()
        };
        let v = dev
            .verified_generate(draft.clone(), full, &verify, &mut |_| true)
            .expect("verified");
        assert_eq!(v.ids, alone[..v.ids.len()], "{name}: verified");
        assert!(v.rounds >= 1, "{name}");

        // The guard's way out: the reused cache's answer kept as far as the full cache agrees.
        let mut reused = dev.copy_cache(&draft.cache).expect("copy");
        let guessed = target_engine::greedy(&dev, &mut reused, p.ids.len(), &draft.logits, n)
            .expect("greedy on the reused cache");
        let answer = Continuation {
            generated: &guessed,
            max_tokens: n,
            pick: Sampler::new(SamplingParams::default()),
            logprobs: None,
        };
        let exact = full().expect("full");
        let c = dev
            .continue_exact(exact, answer, &mut |_| true, None)
            .expect("continue");
        assert_eq!(c.ids, alone[..c.ids.len()], "{name}: continued");
    }
}

/// The bf16 weight path (`DeviceWeights::Bf16`: the file's matrices dequantized once, dense
/// bf16 products accumulated in f32) agrees with the CPU engine on the same file as the
/// quantized path does: first-token logits within the Q8_0 bound, greedy continuations equal
/// up to a CPU near-tie, the reuse invariants kept (ρ = 1 is the full prefill). Its KV is its
/// own (another fingerprint).
#[test]
fn bf16_device_weights_agree_with_the_cpu_engine() {
    use target_engine::device::DeviceWeights;
    for (name, spec) in specs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tiny.gguf");
        write_tiny_gguf(&path, &spec).expect("write");
        let cpu = Model::load(&path, &LoadOptions::default()).expect("cpu load");
        let dev = DeviceModel::load_with(&path, &candle_core::Device::Cpu, DeviceWeights::Bf16)
            .expect("bf16 load");
        let quantized = DeviceModel::load(&path, &candle_core::Device::Cpu).expect("load");
        assert_eq!(dev.weights(), DeviceWeights::Bf16);
        assert_ne!(Engine::fingerprint(&dev), Engine::fingerprint(&quantized));
        let vocab = cpu.tokenizer().vocab_size();
        let p = prompt(vocab);
        let (_, want) = cpu.prefill(&p.ids).expect("cpu prefill");
        let (_, got) = dev.prefill(&p.ids, p.ids.len()).expect("bf16 prefill");
        let d = max_diff(&want, &got);
        eprintln!("{name}: bf16 first-token logits within {d}");
        assert!(d < LOGIT, "{name}: bf16 first-token logits differ by {d}");
        let (prefix, chunks) = stored(&dev, &p);
        let refs: Vec<&ChunkKv> = chunks.iter().collect();
        let cache = fused(&dev, &p, &prefix, &refs, 0).expect("fused");
        let rho1 = blend_on(&dev, &p, cache, &p.chunk_positions()).expect("rho = 1");
        let scale = got.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = max_diff(&got, &rho1.logits);
        assert!(d < 1e-2 * scale, "{name}: bf16 rho = 1 differs by {d}");
        let n = 8;
        let params = target_engine::GenerateParams {
            max_tokens: n,
            ..Default::default()
        };
        use target_engine::prelude::Generate;
        let on_cpu = cpu.generate(&p.ids, &params).expect("cpu");
        let on_dev = dev.generate(&p.ids, &params).expect("bf16");
        if let Some(i) =
            (0..on_cpu.ids.len().min(on_dev.ids.len())).find(|&i| on_cpu.ids[i] != on_dev.ids[i])
        {
            let gap = on_cpu.margins[i];
            assert!(gap < DECODE_NEAR_TIE, "{name}: bf16 splits at {i} by {gap}");
        }
    }
    assert!("fp8".parse::<DeviceWeights>().is_err());
    assert_eq!(
        "bf16".parse::<DeviceWeights>().ok(),
        Some(DeviceWeights::Bf16)
    );
}

/// Every layer's K and V rows `0..len` of `cache`: what placing chunk KV wrote.
fn chunk_rows(cache: &DeviceCache, n_layer: usize, len: usize) -> Vec<Vec<f32>> {
    (0..n_layer)
        .flat_map(|l| {
            [
                cache.k_rows(l, 0..len).expect("k"),
                cache.v_rows(l, 0..len).expect("v"),
            ]
        })
        .collect()
}

/// Chunk KV placed once stays in `tier` under its byte budget, least recently used out first;
/// a chunk placed from there gives the cache rows an upload gives, bit for bit; with both
/// tiers on, device memory serves first.
fn tier_places_chunks_as_uploads(tier: ChunkTier) {
    let (name, spec) = specs().remove(0);
    let (_dir, cpu, dev) = load(&spec);
    let p = prompt(cpu.tokenizer().vocab_size());
    let (prefix, chunks) = stored(&dev, &p);
    let refs: Vec<&ChunkKv> = chunks.iter().collect();
    let rows = |cache: &DeviceCache| chunk_rows(cache, cpu.config().n_layer, p.ids.len() - 9);
    let place = || rows(&fused(&dev, &p, &prefix, &refs, 0).expect("fused"));
    let uploaded = place();
    assert_eq!(dev.chunk_tier(tier).chunks, 0, "{name}: off by default");
    let all: u64 = chunks.iter().map(|c| c.bytes() as u64).sum();
    dev.set_chunk_tier(tier, all);
    let first = place();
    let s = dev.chunk_tier(tier);
    assert_eq!((s.chunks, s.held, s.misses), (3, all, 3), "{name}: {s:?}");
    let again = place();
    assert_eq!(dev.chunk_tier(tier).hits, s.hits + 3, "{name}");
    assert_eq!(first, uploaded, "{name}: placed after an upload");
    assert_eq!(again, uploaded, "{name}: placed from the tier");
    if tier == ChunkTier::Pinned {
        dev.set_hot_chunks(all);
        place();
        let before = dev.chunk_tier(ChunkTier::Pinned).hits;
        assert_eq!(place(), uploaded, "{name}: from device memory");
        assert_eq!(
            dev.chunk_tier(ChunkTier::Pinned).hits,
            before,
            "{name}: device memory first"
        );
        dev.set_hot_chunks(0);
    }
    // Room for the two placed last: the first placed (least recently used) goes, though the
    // last is the smallest (23, 31 and 17 tokens).
    let sizes: Vec<u64> = chunks.iter().map(|c| c.bytes() as u64).collect();
    dev.set_chunk_tier(tier, sizes[1] + sizes[2]);
    let s = dev.chunk_tier(tier);
    assert_eq!(
        (s.chunks, s.held),
        (2, sizes[1] + sizes[2]),
        "{name}: {s:?}"
    );
    dev.set_chunk_tier(tier, 1);
    assert_eq!(
        dev.chunk_tier(tier).held,
        0,
        "{name}: a chunk larger than the budget is not kept"
    );
    assert_eq!(place(), uploaded, "{name}: nothing kept");
    assert_eq!(dev.chunk_tier(tier).chunks, 0, "{name}");
}

/// The hot-chunk tier, in device memory.
#[test]
fn hot_chunks_are_placed_from_device_memory_as_from_host() {
    tier_places_chunks_as_uploads(ChunkTier::Device);
}

/// The pinned tier, in page-locked host memory (on the CPU device, ordinary memory: all but
/// the copy itself is checked).
#[test]
fn pinned_chunks_are_placed_as_uploads_are() {
    tier_places_chunks_as_uploads(ChunkTier::Pinned);
}
