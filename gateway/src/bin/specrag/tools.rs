//! The model commands that need no corpus: `models list`, `generate`, `tokenize` and the
//! hidden `tiny-models`.

use crate::args::{GenerateArgs, ModelArgs, TokenizeArgs};
use gateway::cli::load_target;
use gateway::models::{self, Role, DEFAULT_MODELS, OTHER_MODELS};
use serde_json::json;
use std::path::Path;
use target_engine::prelude::*;
use target_engine::{GenerateParams, SamplingParams};

/// `specrag tiny-models DIR`: tiny random-weight models for smoke tests.
pub fn tiny_models(dir: &Path) -> anyhow::Result<()> {
    use target_engine::testing::{write_tiny_gguf, TinySpec};
    use target_engine::Architecture;
    std::fs::create_dir_all(dir)?;
    write_tiny_gguf(
        &dir.join("target.gguf"),
        &TinySpec::new(Architecture::Qwen2),
    )?;
    let mut spec = TinySpec::new(Architecture::Llama);
    spec.seed = 5;
    write_tiny_gguf(&dir.join("speculator.gguf"), &spec)?;
    println!("{}", dir.display());
    Ok(())
}

/// What a default model is under each `--pairing`.
fn uses(role: Role) -> &'static str {
    match role {
        Role::LargeTarget => "target (default pairing)",
        Role::Target => "speculator (default), target (--pairing small)",
        Role::Speculator => "speculator (--pairing small)",
        Role::Other => "another family (--target; fetch --model)",
    }
}

/// `specrag models list`.
pub fn list_models() -> anyhow::Result<()> {
    let dir = models::models_dir();
    for m in DEFAULT_MODELS.iter().chain(OTHER_MODELS.iter()) {
        let p = dir.join(m.file);
        let state = if p.is_file() {
            "present"
        } else {
            "missing (run `specrag models fetch`)"
        };
        println!(
            "{:<47} {:<30} {:<8} {} {}",
            uses(m.role),
            m.name,
            format!("{}MB", m.size >> 20),
            p.display(),
            state
        );
    }
    println!(
        "\nAny GGUF file of these architectures runs (--target / --speculator): {}; prompts use \
         the file's own chat template (without one: Gemma's turns for gemma3, ChatML otherwise).",
        target_engine::Architecture::supported()
    );
    Ok(())
}

/// `specrag generate`.
pub fn generate(m: &ModelArgs, a: GenerateArgs) -> anyhow::Result<()> {
    let stop = crate::args::stop_strings(&a.stop)?;
    let model = load_target(m)?;
    let tok = model.tokenizer();
    let ids = if a.raw {
        target_engine::raw_prompt(tok, &a.prompt)
    } else {
        target_engine::chat_prompt(&model, Some(&a.system), &a.prompt)
    };
    if ids.is_empty() {
        anyhow::bail!("--prompt is empty");
    }
    let params = GenerateParams {
        max_tokens: a.max_tokens as usize,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_p: a.top_p,
            seed: a.seed,
        },
        stop,
        logprobs: None,
    };
    let g = model.generate(&ids, &params)?;
    if a.json {
        let v = json!({
            "ids": g.ids, "text": g.text, "prefill_ms": g.prefill_ms,
            "decode_ms_per_token": g.decode_ms_per_token, "finish_reason": g.finish,
        });
        println!("{v}");
    } else {
        println!("{}", g.text);
        eprintln!(
            "[{} prompt tokens, prefill {:.0} ms; {} tokens at {:.1} ms/token; finish: {:?}]",
            ids.len(),
            g.prefill_ms,
            g.ids.len(),
            g.decode_ms_per_token,
            g.finish
        );
    }
    Ok(())
}

/// `specrag tokenize`: the target's tokenizer only (no weights are loaded).
pub fn tokenize(m: &ModelArgs, a: TokenizeArgs) -> anyhow::Result<()> {
    let path = m.target_path()?;
    let f = target_engine::gguf::GgufFile::open(&path)?;
    let tok = target_engine::Tokenizer::from_gguf(&f)?;
    let enc = tok.encode(&a.text, a.special);
    let offsets = enc.char_offsets(&a.text);
    if a.json {
        println!("{}", json!({ "ids": enc.ids, "offsets": offsets }));
    } else {
        let chars: Vec<char> = a.text.chars().collect();
        for (id, (s, e)) in enc.ids.iter().zip(&offsets) {
            let piece: String = chars[*s..*e].iter().collect();
            println!("{id:>8}  [{s}, {e})  {piece:?}");
        }
    }
    Ok(())
}
