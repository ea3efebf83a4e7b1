//! The device path checked and timed in one run (docs/gpu.md): random-weight models of real
//! Qwen2.5 shapes written on the spot, then, for each form of device weights (`--weights`:
//! bf16, the file's matrices dequantized once; quantized, its blocks in place):
//! - parity: the device forward against the CPU engine on the same file (first-token logits, a
//!   greedy continuation), ρ = 1 blended prefill against full prefill on the device, and a
//!   verified answer decoded on a ρ = 0.15 cache against greedy decoding on the full cache;
//! - speed, per shape: 4 chunks x 512 tokens and a question, full prefill against
//!   target_probe@ρ and target_probe_shift@ρ, the served selectors' own code on the device
//!   engine (selection = KV load from host memory + probe + top-k, then the blend; again with
//!   the chunks' KV held in device memory, the hot-chunk tier, and in page-locked host
//!   memory, the pinned tier), decode
//!   alone and 1/4/16 requests decoded together, 1/4/16 closed-loop clients under continuous
//!   batching (tokens/s, TTFT p50/p95), device memory;
//!   then the other attention (`ops` where the fused kernel attends, as it does by default on
//!   a GPU; `SPECRAG_DEVICE_ATTENTION=ops|fused` picks the first) on the same prompt: full
//!   prefill, target_probe, and how far the first-token logits move;
//! - long context, last, at the first shape and weights: prefill of `--long` tokens and
//!   full-attention decode after it.
//!
//! ```text
//! gpu_check --out DIR [--device cuda] [--parity 1.5b] [--shapes 1.5b,7b] [--work DIR]
//!           [--chunk 512] [--chunks 4] [--ratio 0.15] [--runs 3] [--long 32768]
//!           [--format q8_0|q4_k] [--weights bf16,quantized]
//! ```
//! Writes DIR/gpu.json after every part (a timeout keeps what ran) and logs to stderr.
//! `--device cpu --parity small --shapes small` runs the same steps on a CPU in seconds.

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Instant;
use target_engine::device::{
    closed_loop_chunked, parse_device, BatchRequest, ChunkTier, DeviceAttention, DeviceModel,
    DeviceWeights,
};
use target_engine::testing::{write_tiny_gguf, TinySpec};
use target_engine::{
    argmax, blend_on, fused, verified_greedy, Assembly, ChunkKv, Engine, LoadOptions, Model,
    PrefixKv, Result, SegmentKind, SelectInput, Selector, TargetProbe,
};

struct Args {
    out: PathBuf,
    device: String,
    parity: String,
    shapes: Vec<String>,
    work: PathBuf,
    chunk: usize,
    chunks: usize,
    ratio: f64,
    runs: usize,
    /// Context length of the long-context part at the first shape (0: skipped).
    long: usize,
    /// The matrices' format: Q8_0 or Q4_K.
    format: target_engine::GgmlDType,
    /// How the device keeps the matrices, each form checked and timed in turn.
    weights: Vec<DeviceWeights>,
}

fn usage() -> ! {
    eprintln!(
        "usage: gpu_check --out DIR [--device cuda] [--parity 1.5b] [--shapes 1.5b,7b] \
         [--work DIR] [--chunk 512] [--chunks 4] [--ratio 0.15] [--runs 3] [--long 32768] [--format q8_0|q4_k] [--weights bf16,quantized]\n\
         shapes: small, 0.5b, 1.5b, 7b (Qwen2.5's); `none` skips the part"
    );
    std::process::exit(2)
}

fn args() -> Args {
    let mut a = Args {
        out: PathBuf::new(),
        device: std::env::var("SPECRAG_DEVICE").unwrap_or_else(|_| "cuda".into()),
        parity: "1.5b".into(),
        shapes: vec!["1.5b".into(), "7b".into()],
        work: std::env::temp_dir().join("specrag-gpu-check"),
        chunk: 512,
        chunks: 4,
        ratio: 0.15,
        runs: 3,
        long: 32768,
        format: target_engine::GgmlDType::Q8_0,
        weights: vec![DeviceWeights::Bf16, DeviceWeights::Quantized],
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            // This file's own documentation, without its code fences.
            let doc: Vec<&str> = include_str!("gpu_check.rs")
                .lines()
                .map_while(|l| l.strip_prefix("//!"))
                .map(|l| l.strip_prefix(' ').unwrap_or(l))
                .filter(|l| !l.starts_with("```"))
                .collect();
            println!("{}", doc.join("\n"));
            std::process::exit(0);
        }
        let value = it.next().unwrap_or_else(|| usage());
        let num = |v: &str| v.parse::<f64>().unwrap_or_else(|_| usage());
        match flag.as_str() {
            "--out" => a.out = value.into(),
            "--device" => a.device = value,
            "--parity" => a.parity = value,
            "--shapes" if value == "none" => a.shapes.clear(),
            "--shapes" => a.shapes = value.split(',').map(str::to_string).collect(),
            "--work" => a.work = value.into(),
            "--chunk" => a.chunk = num(&value) as usize,
            "--chunks" => a.chunks = num(&value) as usize,
            "--ratio" => a.ratio = num(&value),
            "--runs" => a.runs = (num(&value) as usize).max(1),
            "--long" => a.long = num(&value) as usize,
            "--weights" => {
                a.weights = value
                    .split(',')
                    .map(|w| w.parse().unwrap_or_else(|_| usage()))
                    .collect()
            }
            "--format" => {
                a.format = match value.as_str() {
                    "q8_0" => target_engine::GgmlDType::Q8_0,
                    "q4_k" => target_engine::GgmlDType::Q4K,
                    _ => usage(),
                }
            }
            _ => usage(),
        }
    }
    if a.out.as_os_str().is_empty() {
        usage()
    }
    a
}

fn log(msg: &str) {
    eprintln!(
        "[gpu_check {:>7.1}s] {msg}",
        started().elapsed().as_secs_f64()
    );
}

fn started() -> &'static Instant {
    static T: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    T.get_or_init(Instant::now)
}

/// Device memory in use (the driver's view: what candle's pool holds), in MiB.
#[cfg(feature = "cuda")]
fn used_mib(device: &candle_core::Device) -> Option<f64> {
    let cuda = device.as_cuda_device().ok()?;
    let (free, total) = cuda.cuda_stream().context().mem_get_info().ok()?;
    Some((total - free) as f64 / (1u64 << 20) as f64)
}

#[cfg(not(feature = "cuda"))]
fn used_mib(_: &candle_core::Device) -> Option<f64> {
    None
}

fn write_shape(work: &Path, shape: &str, format: target_engine::GgmlDType) -> Result<PathBuf> {
    let mut spec = TinySpec::qwen2_shape(shape).unwrap_or_else(|| usage());
    spec.real_format = format;
    std::fs::create_dir_all(work)?;
    let path = work.join(format!("qwen2-{shape}-random.gguf"));
    let t = Instant::now();
    write_tiny_gguf(&path, &spec)?;
    let mib = std::fs::metadata(&path)?.len() as f64 / (1u64 << 20) as f64;
    log(&format!(
        "wrote {} ({mib:.0} MiB) in {:.1}s",
        path.display(),
        t.elapsed().as_secs_f64()
    ));
    Ok(path)
}

/// Deterministic token ids below `vocab`, distinct per `seed`.
fn ids(n: usize, seed: u32, vocab: usize) -> Vec<u32> {
    let top = vocab.saturating_sub(8).max(1) as u32;
    (0..n as u32)
        .map(|i| {
            (i.wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(40_503))
                >> 5)
                % top
        })
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

fn rag_prompt(
    vocab: usize,
    prefix: usize,
    chunk: usize,
    chunks: usize,
    question: usize,
) -> Assembly {
    let mut asm = Assembly::default();
    asm.push(SegmentKind::Prefix, "", &ids(prefix, 1, vocab));
    for c in 0..chunks {
        asm.push(SegmentKind::Chunk(c), "", &ids(chunk, 10 + c as u32, vocab));
    }
    asm.push(SegmentKind::Question, "", &ids(question, 2, vocab));
    asm
}

/// What ingestion stores for `p` on the device: the prefix's exact KV and each chunk's KV
/// computed after it, in host memory.
fn stored(dev: &DeviceModel, p: &Assembly) -> Result<(PrefixKv, Vec<ChunkKv>)> {
    let prefix = dev.prefix_of(&p.ids[p.prefix_range()])?;
    let chunks = p
        .chunks()
        .map(|s| dev.chunk_kv(&p.ids[s.ids.clone()], Some(&prefix)))
        .collect::<Result<_>>()?;
    Ok((prefix, chunks))
}

/// target_probe (with `shift`, target_probe_shift) at `ratio` on the device, the served
/// selector's own code: its whole blend, and of it the selection (KV load, probe, top-k).
fn timed_probe(
    dev: &DeviceModel,
    (p, prefix, chunks): (&Assembly, &PrefixKv, &[ChunkKv]),
    ratio: f64,
    shift: bool,
    room: usize,
) -> Result<(
    target_engine::BlendOutput<target_engine::device::DeviceCache>,
    f64,
)> {
    let refs: Vec<&ChunkKv> = chunks.iter().collect();
    let mut input = SelectInput::new(dev, p, prefix, &refs, ratio);
    input.room = room;
    let probe = TargetProbe {
        shift,
        ..TargetProbe::default()
    };
    dev.device().synchronize()?;
    let t = Instant::now();
    let out = probe.prefill(&input)?;
    dev.device().synchronize()?;
    Ok((out, ms_since(t)))
}

fn write_report(out: &Path, report: &Value) -> Result<()> {
    std::fs::create_dir_all(out)?;
    let text = serde_json::to_string_pretty(report)
        .map_err(|e| target_engine::EngineError::Internal(format!("report: {e}")))?;
    std::fs::write(out.join("gpu.json"), text)?;
    Ok(())
}

/// CPU engine against the device on one file: first-token logits and a greedy continuation.
fn forward_parity(cpu: &Model, dev: &DeviceModel) -> Result<Value> {
    let vocab = cpu.tokenizer().vocab_size();
    let prompt = ids(256, 7, vocab);
    let n = 16;
    let t = Instant::now();
    let (mut cc, cl) = cpu.prefill(&prompt)?;
    let cpu_prefill_ms = t.elapsed().as_secs_f64() * 1e3;
    let (mut dc, dl) = dev.prefill(&prompt, prompt.len() + n + 1)?;
    let mut cpu_tokens = Vec::new();
    let mut steps = vec![cl.clone()];
    for i in 0..n {
        let next = argmax(&steps[i]);
        cpu_tokens.push(next);
        let out = cpu.forward(&[next], &[prompt.len() + i], &mut cc, false)?;
        steps.push(cpu.last_logits(&out)?);
    }
    let dev_tokens = dev.greedy(&mut dc, prompt.len(), &dl, n)?;
    let split = (0..n).find(|&i| cpu_tokens[i] != dev_tokens[i]);
    let gap = split.map(|i| steps[i][cpu_tokens[i] as usize] - steps[i][dev_tokens[i] as usize]);
    let scale = cl.iter().fold(0f32, |m, x| m.max(x.abs()));
    let d = max_diff(&cl, &dl);
    log(&format!(
        "parity ({} weights): first-token logits max |cpu - device| {d:.4} (logits up to {scale:.1}); greedy split at {split:?} (gap {gap:?})",
        dev.weights().name()
    ));
    Ok(json!({
        "prompt_tokens": prompt.len(),
        "first_token_max_abs_diff": d,
        "logit_scale": scale,
        "first_token_argmax_equal": argmax(&cl) == argmax(&dl),
        "greedy_tokens": n,
        "greedy_split_at": split,
        "greedy_split_gap": gap,
        "greedy_ok": gap.is_none_or(|g| g < 0.15),
        "logits_ok": d < 0.15,
        "cpu_prefill_ms": cpu_prefill_ms,
    }))
}

/// On the device alone, by the code the CPU engine runs: ρ = 1 against full prefill, and
/// verification of a target_probe@0.15 draft against full recompute.
fn reuse_parity(dev: &DeviceModel) -> Result<Value> {
    let vocab = dev.tokenizer().vocab_size();
    let p = rag_prompt(vocab, 16, 64, 4, 16);
    let all = p.ids.clone();
    let n = 24;
    let cap = all.len() + n + 1;
    let (mut reference, full) = dev.prefill(&all, cap)?;
    // Greedy on the full cache one row per step, with each step's top-2 gap.
    let (mut want, mut gaps, mut logits) = (Vec::new(), Vec::new(), full.clone());
    for i in 0..n {
        let next = argmax(&logits);
        want.push(next);
        gaps.push(target_engine::decode::generate::top2_gap(&logits));
        if i + 1 < n {
            let h = dev.forward(&[next], &[all.len() + i], &mut reference)?;
            logits = dev.last_logits(&h)?;
        }
    }
    let (prefix, chunks) = stored(dev, &p)?;
    let refs: Vec<&ChunkKv> = chunks.iter().collect();
    let cache = fused(dev, &p, &prefix, &refs, n + 1)?;
    let rho1 = blend_on(dev, &p, cache, &p.chunk_positions())?.logits;
    let d1 = max_diff(&full, &rho1);
    let (mut exact, _) = dev.prefill(&all, cap)?;
    let (draft, _) = timed_probe(dev, (&p, &prefix, &chunks), 0.15, false, n + 1)?;
    let mut draft_cache = draft.cache;
    let v = verified_greedy(
        dev,
        &mut exact,
        &full,
        &mut draft_cache,
        &draft.logits,
        all.len(),
        n,
        4,
    )?;
    let split = (0..n).find(|&i| v.tokens[i] != want[i]);
    // Checking rows run several to a pass: at a near tie of the full cache's own (a top-2 gap
    // under 0.15, the bound the fidelity target treats as equal) they may choose the other.
    let split_gap = split.map(|i| gaps[i]);
    log(&format!(
        "parity: rho = 1 blend vs full prefill max diff {d1:.2e}; verified answer == full recompute's: {} (split at {split:?}, the full cache's top-2 gap there {split_gap:?}; {} of {n} drafted tokens accepted, {} rounds, {} tokens recomputed)",
        split.is_none(),
        v.accepted,
        v.rounds,
        draft.recomputed.len()
    ));
    Ok(json!({
        "rho1_max_abs_diff": d1,
        "rho1_argmax_equal": argmax(&full) == argmax(&rho1),
        "verify_tokens": n,
        "verify_equal": split.is_none(),
        "verify_split_at": split,
        "verify_split_gap": split_gap,
        "verify_ok": split_gap.is_none_or(|g| g < 0.15),
        "verify_accepted": v.accepted,
        "verify_rounds": v.rounds,
    }))
}

fn parity(path: &Path, device: &candle_core::Device, weights: DeviceWeights) -> Result<Value> {
    let t = Instant::now();
    let cpu = Model::load(path, &LoadOptions::default())?;
    log(&format!(
        "CPU engine loaded in {:.1}s",
        t.elapsed().as_secs_f64()
    ));
    let t = Instant::now();
    let dev = DeviceModel::load_with(path, device, weights)?;
    log(&format!(
        "device model loaded in {:.1}s",
        t.elapsed().as_secs_f64()
    ));
    let forward = forward_parity(&cpu, &dev)?;
    drop(cpu);
    let reuse = reuse_parity(&dev)?;
    Ok(json!({ "forward": forward, "reuse": reuse }))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Greedy decode after a full prefill of `ids`, one row per step: tokens per second.
fn decode_rate(dev: &DeviceModel, ids: &[u32], cap: usize) -> Result<f64> {
    let (mut cache, logits) = dev.prefill(ids, cap)?;
    dev.device().synchronize()?;
    let steps = 32;
    let t = Instant::now();
    dev.greedy(&mut cache, ids.len(), &logits, steps)?;
    dev.device().synchronize()?;
    Ok((steps - 1) as f64 / t.elapsed().as_secs_f64())
}

/// Decode of 1, 4 and 16 requests together (one forward per step, each request its own
/// 512-token prompt): tokens per second over all requests and milliseconds per step.
fn batching(dev: &DeviceModel) -> Result<Value> {
    let vocab = dev.tokenizer().vocab_size();
    let steps = 32;
    let mut out = serde_json::Map::new();
    for batch in [1usize, 4, 16] {
        let (mut caches, mut firsts, mut lens) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..batch {
            let p = ids(512, 200 + r as u32, vocab);
            let (cache, logits) = dev.prefill(&p, p.len() + steps + 1)?;
            caches.push(cache);
            firsts.push(logits);
            lens.push(p.len());
        }
        dev.device().synchronize()?;
        let t = Instant::now();
        dev.greedy_batch(&mut caches, &lens, &firsts, steps)?;
        dev.device().synchronize()?;
        let s = t.elapsed().as_secs_f64();
        let step_ms = s * 1e3 / (steps - 1) as f64;
        let tps = (batch * (steps - 1)) as f64 / s;
        log(&format!(
            "batched decode: {batch} requests, {step_ms:.1} ms per step, {tps:.0} tokens/s"
        ));
        out.insert(
            batch.to_string(),
            json!({ "ms_per_step": step_ms, "tokens_per_s": tps }),
        );
    }
    Ok(Value::Object(out))
}

/// Continuous batching with 1, 4 and 16 closed-loop clients, each sending two requests one
/// after the other (a 512-token prompt, 48-79 greedy tokens, so requests join and leave a
/// running batch): generated tokens/s over the run and the requests' TTFT p50/p95 from
/// submission (queueing and prefill included).
fn continuous(dev: &DeviceModel) -> Result<Value> {
    let vocab = dev.tokenizer().vocab_size();
    let mut out = serde_json::Map::new();
    // Whole prompts at 1/4/16 clients, then 16 clients with prompts prefilled 128 tokens per
    // step (chunked prefill): the decoding requests' longest wait between tokens against the
    // arrivals' time to first token.
    for (clients, chunk) in [(1usize, 0usize), (4, 0), (16, 0), (16, 128)] {
        let run = closed_loop_chunked(dev, clients, 2, chunk, |c, k| {
            BatchRequest::greedy(
                ids(512, 300 + (c * 2 + k) as u32, vocab),
                48 + (c * 7 + k * 13) % 32,
            )
        })?;
        let (p50, p95, tps) = (run.ttft_ms(0.5), run.ttft_ms(0.95), run.tokens_per_s());
        let (gap50, gap95) = (run.max_gap_ms(0.5), run.max_gap_ms(0.95));
        log(&format!(
            "continuous batching: {clients} clients, prefill chunk {chunk} (0: whole), {} requests, peak batch {}, {tps:.0} tokens/s, TTFT p50 {p50:.1} ms p95 {p95:.1} ms, longest gap between tokens p50 {gap50:.1} ms p95 {gap95:.1} ms",
            run.outcomes.len(),
            run.peak_batch
        ));
        let key = if chunk == 0 {
            clients.to_string()
        } else {
            format!("{clients}_chunk{chunk}")
        };
        out.insert(
            key,
            json!({
                "requests": run.outcomes.len(),
                "peak_batch": run.peak_batch,
                "prefill_chunk": chunk,
                "tokens_per_s": tps,
                "ttft_p50_ms": p50,
                "ttft_p95_ms": p95,
                "max_gap_p50_ms": gap50,
                "max_gap_p95_ms": gap95,
                "wall_s": run.wall.as_secs_f64(),
            }),
        );
    }
    Ok(Value::Object(out))
}

/// The decode measurements: one request after `ids` (tokens/s), a static batch, continuous
/// batching.
fn decode_parts(dev: &DeviceModel, ids: &[u32], cap: usize) -> Result<(f64, Value, Value)> {
    Ok((
        decode_rate(dev, ids, cap)?,
        batching(dev)?,
        continuous(dev)?,
    ))
}

/// Prefill of `tokens` tokens, then full-attention decode after them.
fn long_context(
    path: &Path,
    device: &candle_core::Device,
    tokens: usize,
    weights: DeviceWeights,
) -> Result<Value> {
    let dev = DeviceModel::load_with(path, device, weights)?;
    let ids = ids(tokens, 99, dev.tokenizer().vocab_size());
    device.synchronize()?;
    let t = Instant::now();
    let (mut cache, logits) = dev.prefill(&ids, tokens + 40)?;
    device.synchronize()?;
    let prefill_s = t.elapsed().as_secs_f64();
    let steps = 32;
    let t = Instant::now();
    dev.greedy(&mut cache, tokens, &logits, steps)?;
    device.synchronize()?;
    let ms_per_token = t.elapsed().as_secs_f64() * 1e3 / (steps - 1) as f64;
    log(&format!(
        "long context: {tokens} tokens prefilled in {prefill_s:.2}s; decode {ms_per_token:.2} ms/token (full attention); memory {:?} MiB",
        used_mib(device)
    ));
    Ok(json!({
        "tokens": tokens,
        "prefill_s": prefill_s,
        "decode_ms_per_token": ms_per_token,
        "memory_mib": used_mib(device),
    }))
}

/// `runs` timed blends of `target_probe` and of `target_probe_shift`: per run the whole
/// blend, its selection (KV load, probe, top-k), the KV load alone (the fused cache built
/// once more, timed by itself) and the shifted blend (ms); and the tokens recomputed.
fn blend_runs(
    dev: &DeviceModel,
    stored: (&Assembly, &PrefixKv, &[ChunkKv]),
    ratio: f64,
    room: usize,
    runs: usize,
) -> Result<([Vec<f64>; 4], usize)> {
    let (p, prefix, chunks) = stored;
    let refs: Vec<&ChunkKv> = chunks.iter().collect();
    let mut out: [Vec<f64>; 4] = Default::default();
    let mut recomputed = 0;
    for _ in 0..runs {
        let (blend, total) = timed_probe(dev, stored, ratio, false, room)?;
        out[0].push(total);
        out[1].push(blend.select_ms);
        let t = Instant::now();
        fused(dev, p, prefix, &refs, room)?;
        dev.device().synchronize()?;
        out[2].push(ms_since(t));
        out[3].push(timed_probe(dev, stored, ratio, true, room)?.1);
        recomputed = blend.recomputed.len();
    }
    Ok((out, recomputed))
}

/// `runs` blends of target_probe and target_probe_shift with the chunks' KV held in `tier`
/// (after one blend to fill it; the other tier off): medians in ms, the KV load alone, and
/// how the tier served.
fn tier_runs(
    dev: &DeviceModel,
    kv: (&Assembly, &PrefixKv, &[ChunkKv]),
    (ratio, runs): (f64, usize),
    tier: ChunkTier,
) -> Result<Value> {
    dev.set_chunk_tier(tier, kv.2.iter().map(|c| c.bytes() as u64).sum());
    timed_probe(dev, kv, ratio, true, 64)?;
    let ([total, _, load, shift], _) = blend_runs(dev, kv, ratio, 64, runs)?;
    let stats = dev.chunk_tier(tier);
    dev.set_chunk_tier(tier, 0);
    Ok(json!({
        "target_probe_ms": median(total),
        "target_probe_shift_ms": median(shift),
        "kv_load_ms": median(load),
        "hits": stats.hits,
        "misses": stats.misses,
    }))
}

/// `runs` full prefills of `ids`, each timed alone (ms).
fn full_prefills(dev: &DeviceModel, ids: &[u32], cap: usize, runs: usize) -> Result<Vec<f64>> {
    let mut full = Vec::new();
    for _ in 0..runs {
        dev.device().synchronize()?;
        let t = Instant::now();
        dev.prefill(ids, cap)?;
        dev.device().synchronize()?;
        full.push(ms_since(t));
    }
    Ok(full)
}

/// The blends' times with the chunk KV in each tier, for the log.
fn tiers_note(hot: &Value, pinned: &Value) -> String {
    let ms = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    format!(
        "chunk KV on the device: {:.1} and {:.1} ms; in pinned host memory: {:.1} and {:.1} ms",
        ms(hot, "target_probe_ms"),
        ms(hot, "target_probe_shift_ms"),
        ms(pinned, "target_probe_ms"),
        ms(pinned, "target_probe_shift_ms"),
    )
}

/// The other attention (fused kernel or candle ops) on the same prompt, then back: its full
/// prefill and target_probe blend (ms, medians of `runs`, the chunks stored again since KV is
/// keyed by the attention that computed it) and how far the full prefill's first-token
/// logits move.
fn attention_compare(dev: &mut DeviceModel, p: &Assembly, cap: usize, a: &Args) -> Result<Value> {
    let here = dev.attention();
    let other = match here {
        DeviceAttention::Fused => DeviceAttention::Ops,
        DeviceAttention::Ops => DeviceAttention::Fused,
    };
    let (_, mine) = dev.prefill(&p.ids, cap)?;
    if let Err(e) = dev.set_attention(other) {
        log(&format!("{} attention is not available: {e}", other.name()));
        return Ok(json!({ "attention": other.name(), "error": e.to_string() }));
    }
    let (_, theirs) = dev.prefill(&p.ids, cap)?;
    let (prefix, chunks) = stored(dev, p)?;
    let kv = (p, &prefix, chunks.as_slice());
    timed_probe(dev, kv, a.ratio, false, 64)?;
    let (mut full, mut probe) = (Vec::new(), Vec::new());
    for _ in 0..a.runs {
        dev.device().synchronize()?;
        let t = Instant::now();
        dev.prefill(&p.ids, cap)?;
        dev.device().synchronize()?;
        full.push(ms_since(t));
        probe.push(timed_probe(dev, kv, a.ratio, false, 64)?.1);
    }
    dev.set_attention(here)?;
    let d = max_diff(&mine, &theirs);
    let (full, probe) = (median(full), median(probe));
    log(&format!(
        "{} attention instead of {}: full prefill {full:.1} ms, target_probe@{} {probe:.1} ms; first-token logits move by {d:.4}",
        other.name(),
        here.name(),
        a.ratio
    ));
    Ok(json!({
        "attention": other.name(),
        "full_prefill_ms": full,
        "target_probe_ms": probe,
        "first_token_max_abs_diff": d,
    }))
}

fn speed(
    path: &Path,
    device: &candle_core::Device,
    a: &Args,
    weights: DeviceWeights,
) -> Result<Value> {
    let base = used_mib(device);
    let t = Instant::now();
    let mut dev = DeviceModel::load_with(path, device, weights)?;
    let load_s = t.elapsed().as_secs_f64();
    let weights = used_mib(device);
    let vocab = dev.tokenizer().vocab_size();
    let p = rag_prompt(vocab, 16, a.chunk, a.chunks, 32);
    let all = p.ids.clone();
    let cap = all.len() + 64;
    // Warm-up (kernel loading, cuBLAS handles), then what ingestion stores.
    dev.prefill(&all, cap)?;
    let t = Instant::now();
    let (prefix, chunks) = stored(&dev, &p)?;
    let precompute_ms = ms_since(t) / a.chunks as f64;
    let kv = (&p, &prefix, chunks.as_slice());
    timed_probe(&dev, kv, a.ratio, false, 64)?;
    timed_probe(&dev, kv, a.ratio, true, 64)?;
    let full = full_prefills(&dev, &all, cap, a.runs)?;
    let peak_full = used_mib(device);
    let ([total, select, load, shift], recomputed) = blend_runs(&dev, kv, a.ratio, 64, a.runs)?;
    let prefill: Vec<f64> = total.iter().zip(&select).map(|(t, s)| t - s).collect();
    let (hot, pinned) = (
        tier_runs(&dev, kv, (a.ratio, a.runs), ChunkTier::Device)?,
        tier_runs(&dev, kv, (a.ratio, a.runs), ChunkTier::Pinned)?,
    );
    let peak_blend = used_mib(device);
    let (decode_tps, batched, continuous) = decode_parts(&dev, &all, cap)?;
    let compare = attention_compare(&mut dev, &p, cap, a)?;
    let (full_ms, probe_ms, shift_ms) = (median(full), median(total), median(shift));
    log(&format!(
        "{} ({} weights, {} attention): {} tokens; full prefill {full_ms:.1} ms, target_probe@{} {probe_ms:.1} ms ({:.2}x; selection {:.1} of which KV load {:.1}, prefill {:.1}), target_probe_shift {shift_ms:.1} ms ({}); decode {decode_tps:.1} tok/s; memory {peak_blend:?} MiB",
        path.display(),
        dev.weights().name(),
        dev.attention().name(),
        all.len(),
        a.ratio,
        full_ms / probe_ms,
        median(select.clone()),
        median(load.clone()),
        median(prefill.clone()),
        tiers_note(&hot, &pinned),
    ));
    Ok(json!({
        "prompt_tokens": all.len(),
        "attention": dev.attention().name(),
        "other_attention": compare,
        "chunks": a.chunks,
        "chunk_tokens": a.chunk,
        "ratio": a.ratio,
        "recomputed_tokens": recomputed,
        "load_s": load_s,
        "precompute_ms_per_chunk": precompute_ms,
        "full_prefill_ms": full_ms,
        "target_probe_ms": probe_ms,
        "target_probe_parts_ms": {
            "selection": median(select),
            "kv_load": median(load),
            "prefill": median(prefill),
        },
        "ttft_speedup": full_ms / probe_ms,
        "target_probe_shift_ms": shift_ms,
        "chunk_kv_on_device": hot,
        "chunk_kv_pinned": pinned,
        "escalated_worst_ms": probe_ms + full_ms,
        "decode_tokens_per_s": decode_tps,
        "batched_decode": batched,
        "continuous_batching": continuous,
        "memory_mib": {
            "before_load": base,
            "weights_loaded": weights,
            "after_full_prefills": peak_full,
            "after_blends": peak_blend,
        },
    }))
}

fn run(a: &Args, report: &mut Value) -> Result<()> {
    write_report(&a.out, report)?;
    let device = parse_device(&a.device)?;
    report["device"] = json!(format!("{device:?}"));
    write_report(&a.out, report)?;
    // Each part on its own: one that fails is recorded and the next still runs.
    let mut failed = 0;
    if a.parity != "none" {
        let path = write_shape(&a.work, &a.parity, a.format)?;
        for &w in &a.weights {
            report["parity"][w.name()] = parity(&path, &device, w).unwrap_or_else(|e| {
                failed += 1;
                log(&format!("parity ({} weights) failed: {e}", w.name()));
                json!({ "error": e.to_string() })
            });
            write_report(&a.out, report)?;
        }
        report["parity"]["shape"] = json!(a.parity);
        write_report(&a.out, report)?;
        std::fs::remove_file(&path)?;
    }
    for shape in &a.shapes {
        let path = write_shape(&a.work, shape, a.format)?;
        for &w in &a.weights {
            report["speed"][shape][w.name()] = speed(&path, &device, a, w).unwrap_or_else(|e| {
                failed += 1;
                log(&format!(
                    "speed at {shape} ({} weights) failed: {e}",
                    w.name()
                ));
                json!({ "error": e.to_string() })
            });
            write_report(&a.out, report)?;
        }
        if a.long == 0 || Some(shape) != a.shapes.first() {
            std::fs::remove_file(&path)?;
        }
    }
    // Last: the longest part, at the first shape.
    if let (true, Some(shape)) = (a.long > 0, a.shapes.first()) {
        let path = a.work.join(format!("qwen2-{shape}-random.gguf"));
        let w = a.weights.first().copied().unwrap_or_default();
        report["long_context"] = long_context(&path, &device, a.long, w).unwrap_or_else(|e| {
            failed += 1;
            log(&format!("long context failed: {e}"));
            json!({ "error": e.to_string() })
        });
        report["long_context"]["shape"] = json!(shape);
        report["long_context"]["weights"] = json!(w.name());
        write_report(&a.out, report)?;
        std::fs::remove_file(&path)?;
    }
    if failed > 0 {
        return Err(target_engine::EngineError::Internal(format!(
            "{failed} part(s) failed; gpu.json has their errors"
        )));
    }
    Ok(())
}

fn main() {
    started();
    let a = args();
    let mut report = json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "cuda_build": cfg!(feature = "cuda"),
        "format": format!("{:?}", a.format),
    });
    let result = run(&a, &mut report);
    report["seconds"] = json!(started().elapsed().as_secs_f64());
    if let Err(e) = &result {
        log(&format!("error: {e}"));
        report["error"] = json!(e.to_string());
    }
    if let Err(e) = write_report(&a.out, &report) {
        log(&format!("cannot write the report: {e}"));
    }
    if result.is_err() {
        std::process::exit(1);
    }
}
