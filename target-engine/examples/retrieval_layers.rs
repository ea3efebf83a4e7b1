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
//! SPECULATOR.gguf [--context 4096] [--steps 32] [--top-k 256] [--window 64] [--recent 1]`
//! [--contextual]` (`--recent N`: the heads score with the mean of the last N steps' queries;
//! `--contextual`: each layer's own attention as the speculator decodes the same tokens over
//! its full cache of the context, what a head with the context behind it would see)

use std::path::Path;
use std::sync::Arc;
use target_engine::decode::specontext::{choose_rows, group_max, map_heads};
use target_engine::prelude::*;
use target_engine::{AttentionView, KvCache, LoadOptions, Model, RetrievalHead, SpeContextConfig};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[path = "common/flags.rs"]
mod flags;
use flags::number as arg;

/// Full attention on the speculator that keeps, per layer and kv head, the rows its own
/// attention would choose at the step (max over the group's query heads): the contextual
/// head, the speculator's layers up to the chosen one run on its own cache.
struct Recorder {
    config: SpeContextConfig,
    /// Per layer, per speculator kv head: the importance of every row at this step.
    importance: Vec<Vec<Vec<f32>>>,
}

impl AttentionView for Recorder {
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
        if let &[p] = positions {
            if self.importance.len() <= layer {
                self.importance.resize(layer + 1, Vec::new());
            }
            self.importance[layer] = group_max(q, p, k, shape)?;
        }
        let _ = self.config;
        Ok(kernels::causal_attention(q, positions, k, v, shape)?)
    }

    fn invalidate_from(&mut self, _rows: usize) {}

    fn held_bytes(&self) -> usize {
        0
    }

    fn rows_read(&self) -> (u64, u64) {
        (0, 0)
    }
}

/// The speculator decoding the target's tokens on its own cache of the context.
struct Contextual {
    model: Arc<Model>,
    cache: KvCache,
    recorder: Recorder,
}

/// Full attention that records, per candidate head, the target's attention mass on the rows
/// the head chose for the step.
struct Probe {
    heads: Vec<RetrievalHead>,
    /// With `--contextual`: the speculator's own attention, layer by layer, instead.
    contextual: Option<Contextual>,
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
        if let Some(c) = self.contextual.as_mut() {
            c.model
                .forward_view(&[id], &[p], &mut c.cache, &mut c.recorder)?;
            for (l, imp) in c.recorder.importance.iter().enumerate() {
                self.sets[l] = map_heads(imp.clone(), n_kv)
                    .iter()
                    .map(|i| choose_rows(&self.config, i, p))
                    .collect();
            }
            return Ok(());
        }
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
        let candidates = self.sets.len();
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
            let wide = SpeContextConfig {
                top_k: 0,
                window: self.config.window + self.config.top_k,
                ..self.config
            };
            let window = choose_rows(&wide, &top, p);
            let fixed = choose_rows(
                &SpeContextConfig {
                    top_k: 0,
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
                self.mass[candidates + 2] += mass_on(pr, &fixed);
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
    let recent = arg(&args, "--recent", 1)?;
    let contextual = args.iter().any(|a| a == "--contextual");
    let config = SpeContextConfig {
        top_k: arg(&args, "--top-k", 256)?,
        window: arg(&args, "--window", 64)?,
        ..SpeContextConfig::default()
    };
    let target = Model::load(Path::new(tp), &LoadOptions::default())?;
    let spec = Arc::new(Model::load(Path::new(sp), &LoadOptions::default())?);
    let prompt = docs_prompt(&target, context)?;
    eprintln!("prefilling {} tokens", prompt.len());
    let (mut cache, logits) = target.prefill(&prompt)?;
    let layers = spec.config().n_layer;
    let mut heads = Vec::with_capacity(layers);
    for l in 0..layers {
        let mut h = RetrievalHead::new(spec.clone(), l)?.with_recent(recent);
        h.extend(0, &prompt)?;
        heads.push(h);
    }
    let contextual = if contextual {
        eprintln!("prefilling the speculator");
        let (cache, _) = spec.prefill(&prompt)?;
        heads.clear();
        Some(Contextual {
            model: spec.clone(),
            cache,
            recorder: Recorder {
                config,
                importance: Vec::new(),
            },
        })
    } else {
        None
    };
    let mut probe = Probe {
        heads,
        contextual,
        config,
        sets: vec![vec![Vec::new(); target.config().n_kv_head]; layers],
        mass: vec![0.0; layers + 3],
        samples: 0,
    };
    let g = target.view_generate(&mut cache, &logits, Some(&mut probe), steps)?;
    report(&probe, prompt.len(), g.ids.len());
    Ok(())
}

/// The first `context` tokens of ARCHITECTURE.md and docs/, and a question, as a chat prompt.
fn docs_prompt(target: &Model, context: usize) -> Res<Vec<u32>> {
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
    Ok(target_engine::chat_prompt(
        target,
        None,
        &format!("{body}{question}"),
    ))
}

/// The table: mean mass per candidate layer, the bound and the windows.
fn report(probe: &Probe, prompt: usize, decoded: usize) {
    let config = probe.config;
    let layers = probe.sets.len();
    println!(
        "{prompt} prompt tokens, {decoded} decoded; top_k {}, window {}, 4 sinks: mean attention mass per step, layer and query head on the chosen rows",
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
    println!(
        "| sinks and window of {} (no chosen rows) | {:.3} |",
        config.window,
        probe.mass[layers + 2] / n
    );
}
