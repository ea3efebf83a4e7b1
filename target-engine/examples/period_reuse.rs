//! Issue 39's "U. S." artifact on the real case that showed it (2wikimqa `07aae62e…`: "Who is
//! Empress Wang (Gaozong)'s mother-in-law?", its four retrieved passages in rank order, chunks
//! precomputed after the template prefix as the gateway stores them). Answers greedily from a
//! full prefill, from reused KV (nothing recomputed) and from `target_probe` at ρ, then
//! teacher-forces each answer under every cache and prints the steps where the caches' top
//! tokens differ, with the top two tokens and their logit margin.
//!
//! `cargo run --release -p target-engine --example period_reuse -- MODEL.gguf [--case ID]
//! [--passages 2,1,3,9] [--question Q] [--ratio 0.25] [--max-tokens 24] [--extra C:A-B] [--force 'A|B' [--candle]] [--show C]`
//! `--extra C:A-B[,…]` also recomputes offsets `A..B` of chunk `C` in the reuse configurations;
//! `--first 'SET;SET'` prints only the first answer token's top two with each such set added;
//! `--force 'A|B'` teacher-forces each answer start under every cache and decodes on from it
//! (`--candle`: the next token after it from candle-transformers' Qwen2 over the full prompt).
use target_engine::prelude::*;
use target_engine::{
    BlendOutput, ChunkKv, GenerateParams, KvCache, LoadOptions, Model, PrefixKv, RagTemplate,
    SelectInput, Selector, TargetProbe,
};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn arg<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

/// The passages of the case (`Passage N:` blocks of its LongBench context) and its question.
fn case(dataset: &str, id: &str) -> Res<(Vec<String>, String)> {
    let path = format!(
        "{}/../eval/data/{dataset}.jsonl",
        env!("CARGO_MANIFEST_DIR")
    );
    for line in std::fs::read_to_string(path)?.lines() {
        let v: serde_json::Value = serde_json::from_str(line)?;
        if !v["_id"].as_str().unwrap_or("").contains(id) {
            continue;
        }
        let mut passages: Vec<Vec<&str>> = Vec::new();
        for l in v["context"].as_str().unwrap_or("").lines() {
            if l.starts_with("Passage ") && l.trim_end().ends_with(':') {
                passages.push(Vec::new());
            } else if let Some(p) = passages.last_mut() {
                p.push(l);
            }
        }
        let q = v["input"].as_str().unwrap_or("").trim().to_string();
        let texts = passages.iter().map(|p| p.join("\n").trim().to_string());
        return Ok((texts.collect(), q));
    }
    Err(format!("no case {id}").into())
}

/// Per step of `answer` teacher-forced from (`cache`, `logits`): (top id, second id, margin,
/// logit of the answer's token minus the top logit).
fn force(
    m: &Model,
    mut cache: KvCache,
    mut logits: Vec<f32>,
    answer: &[u32],
) -> Res<Vec<(u32, u32, f32, f32)>> {
    let mut out = Vec::new();
    for &id in answer {
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.select_nth_unstable_by(1, |&a, &b| logits[b].total_cmp(&logits[a]));
        let (a, b) = if logits[order[0]] >= logits[order[1]] {
            (order[0], order[1])
        } else {
            (order[1], order[0])
        };
        out.push((
            a as u32,
            b as u32,
            logits[a] - logits[b],
            logits[id as usize] - logits[a],
        ));
        let pos = cache.len();
        let o = m.forward(&[id], &[pos], &mut cache, false)?;
        logits = m.last_logits(&o)?;
    }
    Ok(out)
}

struct Run {
    name: String,
    cache: KvCache,
    logits: Vec<f32>,
    ids: Vec<u32>,
}

fn decode(m: &Model, name: &str, out: BlendOutput, max_tokens: usize) -> Res<Run> {
    let params = GenerateParams {
        max_tokens,
        ..GenerateParams::default()
    };
    let g = m.decode_from(&mut out.cache.clone(), out.logits.clone(), 0.0, &params)?;
    println!(
        "{name:>14} ({} recomputed): {:?}",
        out.recomputed.len(),
        g.text
    );
    Ok(Run {
        name: name.into(),
        cache: out.cache,
        logits: out.logits,
        ids: g.ids,
    })
}

/// Chunk positions of `--extra C:A-B[,C:A-B...]` (offsets `A..B` of chunk `C`, clamped).
fn extra(asm: &target_engine::Assembly, spec: Option<&str>) -> Res<Vec<usize>> {
    let mut out = Vec::new();
    for s in spec.unwrap_or("").split(',').filter(|s| !s.is_empty()) {
        let (c, r) = s.split_once(':').ok_or("--extra C:A-B")?;
        let (a, b) = r.split_once('-').ok_or("--extra C:A-B")?;
        let seg = asm.chunks().nth(c.parse()?).ok_or("no such chunk")?;
        let (a, b): (usize, usize) = (a.parse()?, b.parse()?);
        out.extend((seg.ids.start + a).min(seg.ids.end)..(seg.ids.start + b).min(seg.ids.end));
    }
    Ok(out)
}

/// The chunks (never the exact first one) where at least `fraction` of the tokens are among
/// `picked`: all their tokens.
fn dense_chunks(input: &SelectInput, picked: &[usize], fraction: f64) -> Vec<usize> {
    let skip = usize::from(input.first_chunk_exact);
    let mut out = Vec::new();
    for seg in input.assembly.chunks().skip(skip) {
        let n = picked.iter().filter(|p| seg.ids.contains(p)).count();
        if n as f64 >= fraction * seg.ids.len() as f64 {
            out.extend(seg.ids.clone());
        }
    }
    out
}

/// `--complete F`: `target_probe`, and `target_probe` with every chunk it picked at least `F`
/// of recomputed whole; both answers against full recompute's.
fn complete_rule(m: &Model, input: &SelectInput, fraction: f64, max_tokens: usize) -> Res<()> {
    let (asm, tok) = (input.assembly, m.tokenizer());
    let params = GenerateParams {
        max_tokens,
        ..GenerateParams::default()
    };
    let (mut cache, logits) = m.prefill(&asm.ids)?;
    let full = m.decode_from(&mut cache, logits, 0.0, &params)?;
    let picked = TargetProbe::default().prefill(input)?.recomputed;
    let mut completed = picked.clone();
    completed.extend(dense_chunks(input, &picked, fraction));
    completed.sort_unstable();
    completed.dedup();
    println!("full: {:?}", full.text);
    for (name, pos) in [("probe", &picked), ("completed", &completed)] {
        let mut out = m.blend_prefill(asm, input.prefix, input.chunks, pos)?;
        let g = m.decode_from(&mut out.cache, out.logits, 0.0, &params)?;
        let same = g.ids == full.ids;
        println!(
            "{name}: {} tokens, identical {same}: {:?}",
            pos.len(),
            g.text
        );
    }
    let _ = tok;
    Ok(())
}

/// `--first 'SET;SET'`: the first answer token's top two under reuse and under `target_probe`,
/// each with the chunk tokens of SET (an `--extra` list) recomputed too.
fn first_tokens(m: &Model, input: &SelectInput, picked: &[usize], sets: &str) -> Res<()> {
    let tok = m.tokenizer();
    let show = |id: u32| format!("{id}{:?}", tok.decode(&[id], false));
    for set in sets.split(';') {
        let more = extra(input.assembly, Some(set))?;
        for (name, base) in [("reuse", &[][..]), ("probe", picked)] {
            let mut pos = base.to_vec();
            pos.extend(&more);
            let out = m.blend_prefill(input.assembly, input.prefix, input.chunks, &pos)?;
            let (a, b, margin, _) = force(m, m.new_cache(), out.logits, &[0])?[0];
            println!(
                "{set:>24} {name}+{:>3}: {} > {} by {margin:.2}",
                more.len(),
                show(a),
                show(b)
            );
        }
    }
    Ok(())
}

fn report(m: &Model, runs: &[Run]) -> Res<()> {
    let tok = m.tokenizer();
    let show = |id: u32| format!("{id}{:?}", tok.decode(&[id], false));
    for answer in runs {
        println!("-- teacher-forcing the answer of {}", answer.name);
        let per: Vec<_> = runs
            .iter()
            .map(|r| force(m, r.cache.clone(), r.logits.clone(), &answer.ids))
            .collect::<Res<_>>()?;
        for (i, &id) in answer.ids.iter().enumerate() {
            let differ = per.iter().any(|p| p[i].0 != per[0][i].0);
            let close = per.iter().any(|p| p[i].2 < 1.0);
            if !differ && !close {
                continue;
            }
            print!("step {i:>2} forced {:<14}", show(id));
            for (r, p) in runs.iter().zip(&per) {
                let (a, b, margin, _) = p[i];
                print!(" | {}: {} > {} by {margin:.2}", r.name, show(a), show(b));
            }
            println!();
        }
    }
    Ok(())
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = args.first().ok_or("usage: period_reuse MODEL.gguf")?;
    let dataset = arg(&args, "--dataset").unwrap_or("2wikimqa");
    let (passages, q) = case(dataset, arg(&args, "--case").unwrap_or("07aae62e"))?;
    let order: Vec<usize> = arg(&args, "--passages")
        .unwrap_or("2,1,3,9")
        .split(',')
        .map(|s| s.parse::<usize>().map(|n| n - 1))
        .collect::<Result<_, _>>()?;
    let question = arg(&args, "--question").map_or_else(
        || format!("{q} Answer with a short phrase only."),
        String::from,
    );
    let ratio: f64 = arg(&args, "--ratio").map_or(Ok(0.25), str::parse)?;
    let max_tokens: usize = arg(&args, "--max-tokens").map_or(Ok(24), str::parse)?;
    let m = Model::load(model.as_ref(), &LoadOptions::default())?;
    let tok = m.tokenizer();
    let docs: Vec<&str> = order.iter().map(|&i| passages[i].as_str()).collect();
    let asm = RagTemplate::default().assemble(tok, &docs, &question);
    let prefix: PrefixKv = m.prefix_kv(&asm.ids[asm.prefix_range()])?;
    let kvs: Vec<ChunkKv> = asm
        .chunks()
        .map(|s| m.precompute(&asm.ids[s.ids.clone()], Some(&prefix)))
        .collect::<Result<_, _>>()?;
    let refs: Vec<&ChunkKv> = kvs.iter().collect();
    println!("{} tokens; question {question:?}", asm.ids.len());
    let more = extra(&asm, arg(&args, "--extra"))?;
    if let Some(sets) = arg(&args, "--first") {
        let input = SelectInput::new(&m, &asm, &prefix, &refs, ratio);
        let picked = TargetProbe::default().prefill(&input)?.recomputed;
        return first_tokens(&m, &input, &picked, sets);
    }
    if let Some(f) = arg(&args, "--complete") {
        let input = SelectInput::new(&m, &asm, &prefix, &refs, ratio);
        return complete_rule(&m, &input, f.parse()?, max_tokens);
    }
    if let Some(seg) = arg(&args, "--show").and_then(|c| asm.chunks().nth(c.parse().ok()?)) {
        let toks = asm.ids[seg.ids.clone()].iter().enumerate();
        let shown: Vec<String> = toks
            .map(|(i, &id)| format!("{i}:{id}{:?}", tok.decode(&[id], false)))
            .collect();
        println!("chunk tokens: {}", shown.join(" "));
    }
    let (cache, logits) = m.prefill(&asm.ids)?;
    let full = BlendOutput {
        cache,
        logits,
        recomputed: asm.chunk_positions(),
        chunk_tokens: 0,
        select_ms: 0.0,
        signals: Default::default(),
        reserve: Vec::new(),
    };
    let mut runs = vec![decode(&m, "full", full, max_tokens)?];
    let reuse = m.blend_prefill(&asm, &prefix, &refs, &more)?;
    runs.push(decode(&m, "reuse", reuse, max_tokens)?);
    let input = SelectInput::new(&m, &asm, &prefix, &refs, ratio);
    let mut picked = TargetProbe::default().prefill(&input)?.recomputed;
    picked.extend(&more);
    let probe = m.blend_prefill(&asm, &prefix, &refs, &picked)?;
    runs.push(decode(&m, "probe", probe, max_tokens)?);
    report(&m, &runs)?;
    if let Some(f) = arg(&args, "--force") {
        for text in f.split('|') {
            continue_after(&m, &runs, text, max_tokens)?;
            if args.iter().any(|a| a == "--candle") {
                let mut ids = asm.ids.clone();
                ids.extend(tok.encode(text, false).ids);
                let l = candle_next(model, &ids)?;
                let (a, b, margin, _) = force(&m, m.new_cache(), l, &[0])?[0];
                let show = |id: u32| format!("{id}{:?}", tok.decode(&[id], false));
                println!("candle: {} > {} by {margin:.2}", show(a), show(b));
            }
        }
    }
    Ok(())
}

/// The next-token logits after `ids` from candle-transformers' own quantized Qwen2 (an
/// implementation independent of this engine), one full prefill.
fn candle_next(path: &str, ids: &[u32]) -> Res<Vec<f32>> {
    use candle_core::{Device, Tensor};
    let mut reader = std::fs::File::open(path)?;
    let content = candle_core::quantized::gguf_file::Content::read(&mut reader)?;
    let mut m = candle_transformers::models::quantized_qwen2::ModelWeights::from_gguf(
        content,
        &mut reader,
        &Device::Cpu,
    )?;
    let x = Tensor::new(ids, &Device::Cpu)?.unsqueeze(0)?;
    Ok(m.forward(&x, 0)?.flatten_all()?.to_vec1::<f32>()?)
}

/// Teacher-forces `text` (the start of an answer) under every cache, then decodes greedily: what
/// each cache writes after that start, and the margin of its first free token.
fn continue_after(m: &Model, runs: &[Run], text: &str, max_tokens: usize) -> Res<()> {
    let ids = m.tokenizer().encode(text, false).ids;
    let params = GenerateParams {
        max_tokens,
        ..GenerateParams::default()
    };
    println!("-- after {text:?} {ids:?}");
    for r in runs {
        let mut cache = r.cache.clone();
        let mut logits = r.logits.clone();
        for &id in &ids {
            let pos = cache.len();
            let o = m.forward(&[id], &[pos], &mut cache, false)?;
            logits = m.last_logits(&o)?;
        }
        let first = force(m, cache.clone(), logits.clone(), &[0])?[0];
        let g = m.decode_from(&mut cache, logits, 0.0, &params)?;
        let show = |id: u32| format!("{id}{:?}", m.tokenizer().decode(&[id], false));
        println!(
            "{:>6}: {:?} (first {} > {} by {:.2})",
            r.name,
            g.text,
            show(first.0),
            show(first.1),
            first.2
        );
    }
    Ok(())
}
