//! What a checking pass of speculative decoding costs by its number of rows: one pass of
//! [`Model::forward_decode_path`] and the LM head over 1..=8 rows after a prefill of
//! `--prompt` tokens (this repository's ARCHITECTURE.md), best of `--rounds`, the row counts
//! interleaved within each round so that the machine's drift hits them alike. Prints ms and
//! the ratio to one row (the cost model of docs/performance.md's speculative decoding).
//!
//! `cargo run --release -p target-engine --example check_rows -- MODEL.gguf [--prompt 660]
//! [--rounds 6] [--max-rows 8] [--only R]`
use std::time::Instant;
use target_engine::{LoadOptions, Model};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[path = "common/flags.rs"]
mod flags;
use flags::number as arg;

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args
        .first()
        .ok_or("usage: check_rows MODEL.gguf [--prompt N]")?;
    let (prompt, rounds, max_rows) = (
        arg(&args, "--prompt", 660)?,
        arg(&args, "--rounds", 6)?,
        arg(&args, "--max-rows", 8)?,
    );
    // `--only R`: time R rows alone (for a profiler), still printing the table's line.
    let only = arg(&args, "--only", 0)?;
    let model = Model::load(std::path::Path::new(path), &LoadOptions::default())?;
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../ARCHITECTURE.md"))?;
    let ids = model.tokenizer().encode(&text, false).ids;
    let ids = &ids[..prompt.min(ids.len().saturating_sub(max_rows))];
    let t = Instant::now();
    let (mut cache, _) = model.prefill(ids)?;
    let prefill_ms = t.elapsed().as_secs_f64() * 1e3;
    let next = &ids[..max_rows];
    let mut best = vec![f64::INFINITY; max_rows + 1];
    let mut head = best.clone();
    for _ in 0..rounds {
        for rows in 1..=max_rows {
            if only != 0 && rows != only && rows != 1 {
                continue;
            }
            let positions: Vec<usize> = (ids.len()..ids.len() + rows).collect();
            let t = Instant::now();
            let out = model.forward_decode_path(&next[..rows], &positions, &mut cache)?;
            let t_head = Instant::now();
            let logits = model.logits(&out.hidden)?.to_vec2::<f32>()?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            head[rows] = head[rows].min(t_head.elapsed().as_secs_f64() * 1e3);
            std::hint::black_box(logits);
            // As decoding drops rejected rows: the cache keeps its capacity.
            cache.truncate(ids.len());
            best[rows] = best[rows].min(ms);
        }
    }
    println!(
        "{} prompt tokens (prefill {prefill_ms:.0} ms), best of {rounds}",
        ids.len()
    );
    println!("rows | ms | x one row | of which the LM head (ms)");
    for rows in (1..=max_rows).filter(|&r| best[r].is_finite()) {
        let (ms, x) = (best[rows], best[rows] / best[1]);
        println!("{rows} | {ms:.1} | {x:.2} | {:.1}", head[rows]);
    }
    Ok(())
}
