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
    let (_, whole) = model.prefill(ids)?;
    for split in [1, 7, 64, ids.len() / 3, ids.len() - 1] {
        let mut cache = model.new_cache();
        let first: Vec<usize> = (0..split).collect();
        model.forward(&ids[..split], &first, &mut cache, false)?;
        let rest: Vec<usize> = (split..ids.len()).collect();
        let out = model.forward(&ids[split..], &rest, &mut cache, false)?;
        let logits = model.last_logits(&out)?;
        let d = logits
            .iter()
            .zip(&whole)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        println!("split at {split}: max |logit difference| {d:e}");
    }
    Ok(())
}
