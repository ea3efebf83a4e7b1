//! Whether a prefill split in two (the first part's cache kept, the rest run after it) gives
//! the whole prefill's cache and logits bit for bit on `MODEL.gguf`, for several split points.
//!
//! `cargo run --release -p target-engine --example split_prefill -- MODEL.gguf [--prompt 600]`
use target_engine::{LoadOptions, Model};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[path = "common/flags.rs"]
mod flags;
use flags::number as arg;

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args.first().ok_or("usage: split_prefill MODEL.gguf")?;
    let prompt = arg(&args, "--prompt", 600)?;
    let model = Model::load(std::path::Path::new(path), &LoadOptions::default())?;
    println!("numerics: {}", model.numerics());
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../ARCHITECTURE.md"))?;
    let ids = model.tokenizer().encode(&text, false).ids;
    let ids = &ids[..prompt.min(ids.len())];
    let (whole_cache, whole) = model.prefill(ids)?;
    let max_diff =
        |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    for split in [1, 7, 64, ids.len() / 3, ids.len() - 1] {
        let (cache, logits) = target_engine::testing::prefill_in_pieces(&model, ids, &[split])?;
        let rows = (0..model.config().n_layer)
            .map(|l| {
                max_diff(cache.k(l), whole_cache.k(l)).max(max_diff(cache.v(l), whole_cache.v(l)))
            })
            .fold(0f32, f32::max);
        println!(
            "split at {split}: max |logit difference| {:e}, max |K/V difference| {rows:e}",
            max_diff(&logits, &whole)
        );
    }
    Ok(())
}
