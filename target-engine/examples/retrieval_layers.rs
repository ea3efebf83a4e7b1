//! Which layer of the speculator makes the best SpeContext retrieval head for the target
//! (issue 44, "the Q/K projections of the layers that best match the target's attention
//! (measure which)"). The target prefills `--context` tokens of this repository's docs and a
//! question, then decodes `--steps` tokens greedily with full attention; at every step, layer
//! and query head, the attention mass the target puts on the rows a retrieval head would have
//! chosen (the same budget: `--top-k` rows by the head's score, 4 sinks, a `--window`) is
//! recorded for a head cut from each of the speculator's layers, next to the best any choice
//! of that budget could catch (the rows of the target's own largest probabilities, max over
//! the kv group) and the window alone.
//!
//! `cargo run --release -p target-engine --example retrieval_layers -- TARGET.gguf
//! SPECULATOR.gguf [--context 4096] [--steps 32] [--top-k 256] [--window 64]`

use std::path::Path;
use std::sync::Arc;
use target_engine::specontext::{choose_rows, map_heads};
use target_engine::{AttentionView, KvCache, LoadOptions, Model, RetrievalHead, SpeContextConfig};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn arg(args: &[String], name: &str, default: usize) -> Res<usize> {
    match args.iter().position(|a| a == name) {
        Some(i) => Ok(args
            .get(i + 1)
            .ok_or(format!("{name} needs a value"))?
            .parse()?),
        None => Ok(default),
    }
}

/// Full attention that records, per candidate head, the target's attention mass on the rows
/// the head chose for the step.
struct Probe {
    heads: Vec<RetrievalHead>,
    config: SpeContextConfig,
    /// Per candidate head, per target kv head: this step's chosen rows.
    sets: Vec<Vec<Vec<usize>>>,
    /// Captured mass per candidate head, then the oracle's and the window's.
    mass: Vec<f64>,
    samples: usize,
}

/// Mass of `probs` on `rows`.
fn mass_on(probs: &[f32], rows: &[usize]) -> f64 {
    rows.iter().map(|&t| f64::from(probs[t])).sum()
}

impl AttentionView for Probe {
    fn begin_step(&mut self, ids: &[u32], positions: &[usize]) -> target_engine::Result<()> {
        let (&[id], &[p]) = (ids, positions) else {
            return Ok(());
        };
        let n_kv = self.sets.first().map_or(0, Vec::len);
        for (h, head) in self.heads.iter_mut().enumerate() {
            let imp = map_heads(head.importance(id, p)?, n_kv);
            self.sets[h] = imp
                .iter()
                .map(|i| choose_rows(&self.config, i, p))
                .collect();
        }
        Ok(())
    }

    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        positions: &[usize],
        cache: &KvCache,
        shape: kernels::AttentionShape,
    ) -> target_engine::Result<Vec<f32>> {
        let rows = positions.iter().max().map_or(0, |&p| p + 1);
        let row = cache.row_len();
        let (k, v) = (&cache.k(layer)[..rows * row], &cache.v(layer)[..rows * row]);
        let out = kernels::causal_attention(q, positions, k, v, shape)?;
        let &[p] = positions else {
            return Ok(out);
        };
        let d = shape.head_dim;
        let per_group = shape.n_head / shape.n_kv_head;
        let one = kernels::AttentionShape {
            n_head: 1,
            n_kv_head: 1,
            head_dim: d,
        };
        let candidates = self.heads.len();
        for g in 0..shape.n_kv_head {
            let kg: Vec<f32> = (0..rows)
                .flat_map(|t| k[t * shape.n_kv_head * d + g * d..][..d].iter().copied())
                .collect();
            let probs: Vec<Vec<f32>> = (0..per_group)
                .map(|j| {
                    let h = g * per_group + j;
                    kernels::attention_mass(&q[h * d..(h + 1) * d], &[p], &kg, one)
                })
                .collect::<Result<_, _>>()?;
            let mut top = probs[0].clone();
            for pr in &probs[1..] {
                top.iter_mut().zip(pr).for_each(|(a, &b)| *a = a.max(b));
            }
            let oracle = choose_rows(&self.config, &top, p);
            let window = choose_rows(
                &SpeContextConfig {
                    top_k: 0,
                    window: self.config.window + self.config.top_k,
                    ..self.config
                },
                &top,
                p,
            );
            for pr in &probs {
                for c in 0..candidates {
                    self.mass[c] += mass_on(pr, &self.sets[c][g]);
                }
                self.mass[candidates] += mass_on(pr, &oracle);
                self.mass[candidates + 1] += mass_on(pr, &window);
                self.samples += 1;
            }
        }
        Ok(out)
    }

    fn invalidate_from(&mut self, _rows: usize) {}

    fn held_bytes(&self) -> usize {
        0
    }

    fn rows_read(&self) -> (u64, u64) {
        (0, 0)
    }
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(tp), Some(sp)) = (args.first(), args.get(1)) else {
        return Err("usage: retrieval_layers TARGET.gguf SPECULATOR.gguf [--context N]".into());
    };
    let (context, steps) = (arg(&args, "--context", 4096)?, arg(&args, "--steps", 32)?);
    let config = SpeContextConfig {
        top_k: arg(&args, "--top-k", 256)?,
        window: arg(&args, "--window", 64)?,
        ..SpeContextConfig::default()
    };
    let target = Model::load(Path::new(tp), &LoadOptions::default())?;
    let spec = Arc::new(Model::load(Path::new(sp), &LoadOptions::default())?);
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let mut text = std::fs::read_to_string(format!("{root}/ARCHITECTURE.md"))?;
    let mut docs: Vec<_> = std::fs::read_dir(format!("{root}/docs"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    for d in docs {
        text.push_str(&std::fs::read_to_string(d)?);
    }
    let question = "\n\nExplain in detail how a query is answered, step by step.";
    let body = target.tokenizer().encode(&text, false).ids;
    let body = target
        .tokenizer()
        .decode(&body[..context.min(body.len())], false);
    let prompt = target_engine::chat_prompt(target.tokenizer(), None, &format!("{body}{question}"));
    eprintln!("prefilling {} tokens", prompt.len());
    let (mut cache, logits) = target.prefill(&prompt)?;
    let layers = spec.config().n_layer;
    let mut heads = Vec::with_capacity(layers);
    for l in 0..layers {
        let mut h = RetrievalHead::new(spec.clone(), l)?;
        h.extend(0, &prompt)?;
        heads.push(h);
    }
    let mut probe = Probe {
        heads,
        config,
        sets: vec![vec![Vec::new(); target.config().n_kv_head]; layers],
        mass: vec![0.0; layers + 2],
        samples: 0,
    };
    let g = target.view_generate(&mut cache, &logits, Some(&mut probe), steps)?;
    println!(
        "{} prompt tokens, {} decoded; top_k {}, window {}, 4 sinks: mean attention mass per step, layer and query head on the chosen rows",
        prompt.len(),
        g.ids.len(),
        config.top_k,
        config.window
    );
    println!("| retrieval head | mass |\n|---|---:|");
    let n = probe.samples.max(1) as f64;
    for l in 0..layers {
        println!("| speculator layer {l} | {:.3} |", probe.mass[l] / n);
    }
    println!(
        "| the target's own top rows (bound) | {:.3} |",
        probe.mass[layers] / n
    );
    println!(
        "| window of {} alone | {:.3} |",
        config.top_k + config.window,
        probe.mass[layers + 1] / n
    );
    Ok(())
}
