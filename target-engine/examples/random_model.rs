//! Random-weight GGUF files of real Qwen2.5 shapes, for timing the served path where no real
//! weights can be fetched (the GPU machine of `scripts/gpu/serve_check.sh`): the weights are
//! noise, the shapes, the tokenizer and so the prompts' lengths are the real ones.
//!
//! ```text
//! random_model --shape 0.5b|1.5b|7b|small [--format q8_0|q4_k] [--tokenizer FILE] --out FILE
//! random_model --extract-tokenizer SRC --out FILE
//! ```
//! `--tokenizer` takes a GGUF file (a real model, or what `--extract-tokenizer` wrote: its
//! `tokenizer.*` entries alone, a few MB) whose vocabulary, merges, special ids and chat
//! template the model carries; without it the model has the tests' tiny vocabulary.

use std::path::PathBuf;
use std::time::Instant;
use target_engine::testing::{write_tiny_gguf, write_tokenizer_gguf, TinySpec};

fn usage() -> ! {
    eprintln!(
        "usage: random_model --shape 0.5b|1.5b|7b|small [--format q8_0|q4_k] [--tokenizer FILE] --out FILE\n       random_model --extract-tokenizer SRC --out FILE"
    );
    std::process::exit(2);
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut shape, mut out, mut tokenizer, mut extract) = (None, None, None, None);
    let mut format = target_engine::GgmlDType::Q8_0;
    while let Some(flag) = args.next() {
        if flag == "--help" || flag == "-h" {
            usage();
        }
        let value = args.next().unwrap_or_else(|| usage());
        match flag.as_str() {
            "--shape" => shape = Some(value),
            "--out" => out = Some(PathBuf::from(value)),
            "--tokenizer" => tokenizer = Some(PathBuf::from(value)),
            "--extract-tokenizer" => extract = Some(PathBuf::from(value)),
            "--format" => {
                format = match value.as_str() {
                    "q8_0" => target_engine::GgmlDType::Q8_0,
                    "q4_k" => target_engine::GgmlDType::Q4K,
                    _ => usage(),
                }
            }
            _ => usage(),
        }
    }
    let out = out.unwrap_or_else(|| usage());
    let t = Instant::now();
    let written = match (extract, shape) {
        (Some(src), None) => write_tokenizer_gguf(&src, &out),
        (None, Some(shape)) => {
            let mut spec = TinySpec::qwen2_shape(&shape).unwrap_or_else(|| usage());
            spec.real_format = format;
            spec.tokenizer_from = tokenizer;
            write_tiny_gguf(&out, &spec)
        }
        _ => usage(),
    };
    if let Err(e) = written {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
    let mib = std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0) as f64 / (1u64 << 20) as f64;
    eprintln!(
        "wrote {} ({mib:.0} MiB) in {:.1}s",
        out.display(),
        t.elapsed().as_secs_f64()
    );
}
