//! `specrag-bench long`: decoding over long contexts of real chunks (issue 44). For each context
//! length, the chunks of an ingested collection (in index order, from a per-question offset)
//! fill the prompt, their stored KV is reused as is (ρ = 0: only the question is computed, the
//! decode phase is what is measured), and the same cache is decoded greedily by full attention,
//! then by each drafter verified against it (SpeCache's top-k view, the StreamingLLM window,
//! and with a speculator of the target's vocabulary SpeContext's view under both retrieval
//! heads: the speculator's embedding alone, and its layers over its own cache of the context
//! built from the chunks' stored speculator KV), checking that every verified answer is full attention's, token for token. With `--quality`
//! the drafters also answer unverified (agreement with full attention, teacher-forced KL), next
//! to a KIVI-only cache.

use crate::args::LongArgs;
use gateway::cli::{load_speculator, load_target, spinner, ModelArgs};
use gateway::corpus::{Corpus, Engines};
use serde::Serialize;
use std::sync::Arc;
use target_engine::decode::sparse::{kl, reborrow};
use target_engine::prelude::*;
use target_engine::{
    kivi_cache, AttentionView, ChunkKv, ContextHead, Drafter, FullReuse, GenerateParams, KvCache,
    Model, PromptLookup, RetrievalHead, SamplingParams, SelectInput, Selector, SpeContextConfig,
    SpeContextView, TopKConfig, TopKView, ViewParams,
};

/// Unverified quality of a drafter against full attention on the same cache.
#[derive(Debug, Clone, Serialize)]
pub struct Quality {
    /// The whole answer equals full attention's.
    pub identical: bool,
    /// Leading tokens equal to full attention's.
    pub common_prefix: usize,
    /// Mean teacher-forced KL(full || drafter) per token of full attention's answer (nats).
    pub kl: f64,
}

/// One drafter, verified (and unverified with `--quality`).
#[derive(Debug, Clone, Serialize)]
pub struct DrafterRow {
    pub drafter: String,
    pub ms_per_token: f64,
    /// Over full attention's ms per token in the same run.
    pub rel: f64,
    /// The verified answer equals full attention's, token for token.
    pub identical: bool,
    pub drafted: usize,
    pub accepted: usize,
    pub rounds: usize,
    /// Of the decode time, ms drafting and ms in verification passes.
    pub draft_ms: f64,
    pub verify_ms: f64,
    /// Bytes the drafter holds beside the cache (SpeCache: the low-bit keys; SpeContext: the
    /// retrieval head's keys or cache and the resident rows).
    pub held_bytes: usize,
    /// Cache rows a draft step read at full precision over the rows full attention reads.
    pub read_fraction: f64,
    /// Rows a view keeping its rows resident copied in (SpeContext's elastic loading) over
    /// the rows it attended.
    pub loaded_fraction: Option<f64>,
    pub unverified: Option<Quality>,
}

/// One context length and question.
#[derive(Debug, Clone, Serialize)]
pub struct LongPoint {
    pub context_tokens: usize,
    pub chunks: usize,
    pub question: String,
    pub answer_tokens: usize,
    pub full_ms_per_token: f64,
    /// The f32 KV the cache holds for the context (what full attention reads every step).
    pub full_kv_bytes: usize,
    pub drafters: Vec<DrafterRow>,
    /// KIVI-only (2-bit keys and values, whole cache), unverified.
    pub kivi2: Option<Quality>,
}

/// A drafter's view settings.
#[derive(Debug, Clone, Copy)]
enum Kind {
    TopK(TopKConfig),
    /// SpeContext; `contextual`: the retrieval head runs the speculator's layers over its
    /// cache of the context, otherwise the embedding alone.
    SpeContext {
        config: SpeContextConfig,
        contextual: bool,
    },
}

/// The drafters measured: name and view settings (SpeContext's with a speculator only).
fn drafters(a: &LongArgs, speculator: bool) -> Vec<(String, Kind)> {
    let specache = TopKConfig {
        bits: a.bits,
        top_k: a.top_k,
        window: a.window,
        prefilter: a.prefilter,
        full_layers: a.full_layers,
        ..TopKConfig::default()
    };
    // StreamingLLM: sink and window only, every layer, as many rows as SpeCache's exact ones.
    let window = TopKConfig {
        top_k: 0,
        window: a.top_k + a.window,
        full_layers: 0,
        ..specache
    };
    let mut out = vec![
        (
            format!("specache-{}bit-top{}", a.bits, a.top_k),
            Kind::TopK(specache),
        ),
        (format!("window-{}", window.window), Kind::TopK(window)),
    ];
    if speculator {
        // The rows kept: `--top-k`, or what the memory model fits in `--resident-mb`.
        let rows = a
            .resident_mb
            .map_or(format!("top{}", a.top_k), |mb| format!("resident{mb}MiB"));
        // Resolved against the speculator by `long_cmd`.
        let embed_layer = a
            .retrieval_layer
            .unwrap_or(target_engine::decode::specontext::DEFAULT_LAYER);
        let context_layer = a
            .context_layer
            .unwrap_or(target_engine::decode::specontext::DEFAULT_CONTEXT_LAYER);
        let spe = |layer| SpeContextConfig {
            layer,
            top_k: a.top_k,
            window: a.window,
            ..SpeContextConfig::default()
        };
        out.push((
            format!("specontext-embed-l{embed_layer}-{rows}"),
            Kind::SpeContext {
                config: spe(embed_layer),
                contextual: false,
            },
        ));
        out.push((
            format!("specontext-ctx-l{context_layer}-{rows}"),
            Kind::SpeContext {
                config: spe(context_layer),
                contextual: true,
            },
        ));
    }
    out.retain(|(name, _)| {
        a.drafter_names.is_empty() || a.drafter_names.iter().any(|p| name.starts_with(p.as_str()))
    });
    out
}

/// Speculative decoding's drafters over the same cache, for comparison (they draft tokens,
/// not views of the cache): prompt lookup over the prompt, and the speculator over its own
/// cache of the prompt (reused chunk KV); each round checked as the views' are.
fn token_rows(
    model: &Model,
    prompt: &Prompt,
    spec: Option<&Arc<Model>>,
    a: &LongArgs,
    full: &target_engine::ViewGeneration,
    progress: &dyn Fn(&str),
) -> anyhow::Result<Vec<DrafterRow>> {
    let wanted = |name: &str| {
        a.drafter_names.is_empty() || a.drafter_names.iter().any(|p| name.starts_with(p.as_str()))
    };
    // Name, drafter, bytes it holds (the speculator: its f32 cache of the prompt).
    let mut drafters: Vec<(&str, Drafter<'_>, usize)> = Vec::new();
    if wanted("lookup") {
        let lookup = PromptLookup::new(prompt.ids.clone()).with_min_n(a.lookup_min_n);
        drafters.push(("lookup", Drafter::lookup_only(lookup), 0));
    }
    if let (Some(s), Some((c, l)), true) = (spec, &prompt.spec, wanted("speculator")) {
        let bytes = c.len() * c.row_len() * 2 * 4 * c.n_layer();
        drafters.push(("speculator", Drafter::new(s, c.clone(), l.clone()), bytes));
    }
    let params = GenerateParams {
        max_tokens: a.max_tokens as usize,
        sampling: SamplingParams::default(),
        ..GenerateParams::default()
    };
    let mut rows = Vec::new();
    for (name, mut d, held_bytes) in drafters {
        progress(&format!("{name}, verified"));
        let mut c = prompt.cache.clone();
        let t = std::time::Instant::now();
        let from = target_engine::Prefilled {
            cache: &mut c,
            logits: prompt.logits.clone(),
        };
        let (g, _, stats) =
            model.decode_speculative(from, &mut d, &params, &mut |_| true, &mut |_, _| false)?;
        let ms = t.elapsed().as_secs_f64() * 1e3 / g.ids.len().max(1) as f64;
        rows.push(DrafterRow {
            drafter: name.to_string(),
            ms_per_token: ms,
            rel: ms / full.ms_per_token(),
            identical: g.ids == full.ids,
            drafted: stats.drafted,
            accepted: stats.accepted,
            rounds: stats.rounds,
            draft_ms: stats.draft_ms,
            verify_ms: stats.verify_ms,
            held_bytes,
            // Their draft steps read none of the target's cache.
            read_fraction: 0.0,
            loaded_fraction: None,
            unverified: None,
        });
    }
    Ok(rows)
}

/// What SpeContext's heads need of a case: the prompt's tokens, and the speculator with its
/// cache of the same prompt.
struct Ctx<'a> {
    prompt: &'a [u32],
    spec: Option<(&'a Arc<Model>, &'a KvCache)>,
}

/// A fresh view of `kind` for a target with `n_kv` kv heads, sized by the memory model when
/// `resident` (bytes) is set.
fn view_for(
    kind: Kind,
    ctx: &Ctx<'_>,
    target: &Model,
    resident: Option<u64>,
) -> anyhow::Result<Box<dyn AttentionView + Send>> {
    let (mut config, contextual) = match kind {
        Kind::TopK(c) => return Ok(Box::new(TopKView::new(c))),
        Kind::SpeContext { config, contextual } => (config, contextual),
    };
    let (spec, spec_cache) = ctx
        .spec
        .ok_or_else(|| anyhow::anyhow!("SpeContext needs the speculator"))?;
    let head: Box<dyn target_engine::RowScorer + Send> = if contextual {
        Box::new(ContextHead::new(
            spec.clone(),
            config.layer,
            spec_cache.clone(),
            ctx.prompt,
        )?)
    } else {
        let mut h = RetrievalHead::new(spec.clone(), config.layer)?;
        h.extend(0, ctx.prompt)?;
        Box::new(h)
    };
    if let Some(budget) = resident {
        let held = head.bytes() as u64;
        config = config.for_budget(budget, ctx.prompt.len(), target.config(), held);
    }
    Ok(Box::new(SpeContextView::new(
        head,
        config,
        target.config().n_kv_head,
    )))
}

/// Where contexts come from: a collection's chunk texts, their KV in the corpus's store.
struct Source<'a> {
    corpus: &'a Corpus,
    collection: &'a str,
    texts: &'a [String],
}

/// What one case measured: full attention's ms per token and answer, each drafter, KIVI.
struct Measured {
    full_ms: f64,
    ids: Vec<u32>,
    drafters: Vec<DrafterRow>,
    kivi2: Option<Quality>,
}

/// The prompt's cache: chunks of the source from `offset` on (wrapping) until the assembled
/// prompt reaches `tokens`, their stored KV reused, the question computed.
fn context(
    engines: &Engines,
    src: &Source<'_>,
    tokens: usize,
    offset: usize,
    question: &str,
) -> anyhow::Result<Prompt> {
    let Source {
        corpus,
        collection,
        texts,
    } = *src;
    let tok = engines.target.tokenizer();
    let mut chosen: Vec<&str> = Vec::new();
    let mut kvs: Vec<ChunkKv> = Vec::new();
    let mut asm = engines.template.assemble(tok, &[], question);
    while asm.ids.len() < tokens && chosen.len() < texts.len() {
        let text = &texts[(offset + chosen.len()) % texts.len()];
        let loaded = engines.load(&corpus.store, collection, text)?;
        chosen.push(text);
        kvs.push(loaded.kv);
        asm = engines.template.assemble(tok, &chosen, question);
    }
    anyhow::ensure!(
        asm.ids.len() >= tokens * 9 / 10,
        "the collection holds {} tokens of chunks, fewer than the {tokens} asked for",
        asm.ids.len()
    );
    let refs: Vec<&ChunkKv> = kvs.iter().collect();
    let target = engines.target.cpu_for("the long-context bench")?;
    let input = SelectInput::new(&**target, &asm, &engines.prefix, &refs, 0.0);
    let out = FullReuse.prefill(&input)?;
    // The speculator's cache of the same prompt, its stored chunk KV reused the same way.
    let spec = match (&engines.spec, &engines.spec_prefix, engines.drafts) {
        (Some(s), Some(prefix), true) => {
            let mut skv = Vec::with_capacity(chosen.len());
            for text in &chosen {
                if let Some((kv, _)) = engines.load_spec_kv(&corpus.store, collection, text)? {
                    skv.push(kv);
                }
            }
            let refs: Vec<&ChunkKv> = skv.iter().collect();
            let input = SelectInput::new(&*s.speculator, &asm, prefix, &refs, 0.0);
            let out = FullReuse.prefill(&input)?;
            Some((out.cache, out.logits))
        }
        _ => None,
    };
    Ok(Prompt {
        cache: out.cache,
        logits: out.logits,
        chunks: chosen.len(),
        ids: asm.ids,
        spec,
    })
}

/// A case's prompt: the target's cache and last logits, the chunks it holds, its tokens, and
/// the speculator's cache of it (with a speculator of the target's vocabulary).
struct Prompt {
    cache: KvCache,
    logits: Vec<f32>,
    chunks: usize,
    ids: Vec<u32>,
    spec: Option<(KvCache, Vec<f32>)>,
}

/// Unverified answer and teacher-forced KL of `view` (`None` with `cache` already KIVI's).
fn quality(
    model: &Model,
    cache: &KvCache,
    logits: &[f32],
    reference: &(Vec<u32>, Vec<Vec<f32>>),
    mut view: Option<&mut (dyn AttentionView + Send)>,
) -> anyhow::Result<Quality> {
    let (ids, full_lp) = reference;
    let mut c = cache.clone();
    let got = model.view_generate(&mut c, logits, reborrow(&mut view), ids.len())?;
    drop(c);
    if let Some(v) = view.as_deref_mut() {
        v.invalidate_from(0);
    }
    let mut c = cache.clone();
    let lp = model.view_log_probs(&mut c, logits, ids, reborrow(&mut view))?;
    let kls: Vec<f64> = full_lp.iter().zip(&lp).map(|(p, q)| kl(p, q)).collect();
    Ok(Quality {
        identical: got.ids == *ids,
        common_prefix: got.ids.iter().zip(ids).take_while(|(a, b)| a == b).count(),
        kl: kls.iter().sum::<f64>() / kls.len().max(1) as f64,
    })
}

/// Full attention, then every drafter verified (and unverified with `--quality`).
fn measure(
    model: &Model,
    prompt: &Prompt,
    spec: Option<&Arc<Model>>,
    a: &LongArgs,
    progress: &dyn Fn(&str),
) -> anyhow::Result<Measured> {
    let (cache, logits) = (&prompt.cache, &prompt.logits[..]);
    let ctx = Ctx {
        prompt: &prompt.ids,
        spec: spec.zip(prompt.spec.as_ref().map(|(c, _)| c)),
    };
    let resident = a.resident_mb.map(|mb| mb.saturating_mul(1 << 20));
    progress("full attention");
    let mut c = cache.clone();
    let full = model.view_generate(&mut c, logits, None, a.max_tokens as usize)?;
    drop(c);
    let reference = if a.quality {
        progress("full attention, teacher-forced");
        let mut c = cache.clone();
        let lp = model.view_log_probs(&mut c, logits, &full.ids, None)?;
        Some((full.ids.clone(), lp))
    } else {
        None
    };
    let mut rows = Vec::new();
    for (name, kind) in drafters(a, ctx.spec.is_some()) {
        progress(&format!("{name}, verified"));
        let mut view = view_for(kind, &ctx, model, resident)?;
        let mut c = cache.clone();
        let params = ViewParams {
            max_tokens: a.max_tokens as usize,
            min_prob: a.min_prob,
            ..ViewParams::default()
        };
        let g = model.view_verified_generate(&mut c, logits, view.as_mut(), &params)?;
        drop(c);
        let (read, all) = view.rows_read();
        let loaded_fraction = view.rows_loaded().map(|n| n as f64 / read.max(1) as f64);
        let held_bytes = view.held_bytes();
        let unverified = match &reference {
            Some(r) => {
                progress(&format!("{name}, unverified"));
                let mut v = view_for(kind, &ctx, model, resident)?;
                Some(quality(model, cache, logits, r, Some(v.as_mut()))?)
            }
            None => None,
        };
        rows.push(DrafterRow {
            drafter: name,
            ms_per_token: g.ms_per_token(),
            rel: g.ms_per_token() / full.ms_per_token(),
            identical: g.ids == full.ids,
            drafted: g.drafted,
            accepted: g.accepted,
            rounds: g.rounds,
            draft_ms: g.draft_ms,
            verify_ms: g.verify_ms,
            held_bytes,
            read_fraction: read as f64 / all.max(1) as f64,
            loaded_fraction,
            unverified,
        });
    }
    rows.extend(token_rows(model, prompt, spec, a, &full, progress)?);
    let kivi2 = match &reference {
        Some(r) => {
            progress("KIVI 2-bit, unverified");
            let c = model.config();
            let shape = kernels::AttentionShape {
                n_head: c.n_head,
                n_kv_head: c.n_kv_head,
                head_dim: c.head_dim,
            };
            let kc = kivi_cache(cache, shape, 2, 32)?;
            Some(quality(model, &kc, logits, r, None)?)
        }
        None => None,
    };
    Ok(Measured {
        full_ms: full.ms_per_token(),
        ids: full.ids,
        drafters: rows,
        kivi2,
    })
}

/// SpeContext's layers in `a`: as asked (checked against the speculator `s`), or the
/// defaults within its layers.
fn resolve_layers(a: &mut LongArgs, s: &Model) -> anyhow::Result<()> {
    let last = s.config().n_layer.saturating_sub(1);
    let mut layers = (0, 0);
    for (flag, asked, default, out) in [
        (
            "--retrieval-layer",
            a.retrieval_layer,
            target_engine::decode::specontext::DEFAULT_LAYER,
            &mut layers.0,
        ),
        (
            "--context-layer",
            a.context_layer,
            target_engine::decode::specontext::DEFAULT_CONTEXT_LAYER,
            &mut layers.1,
        ),
    ] {
        if let Some(l) = asked {
            anyhow::ensure!(
                l <= last,
                "{flag} {l}: the speculator has layers 0..={last} ({})",
                s.path().display()
            );
        }
        *out = asked.unwrap_or(default.min(last));
    }
    (a.retrieval_layer, a.context_layer) = (Some(layers.0), Some(layers.1));
    Ok(())
}

/// `specrag-bench long`.
pub fn long_cmd(m: &ModelArgs, mut a: LongArgs) -> anyhow::Result<()> {
    let model = Arc::new(load_target(m)?);
    // SpeContext's retrieval heads are cut from the speculator (`--no-speculator`: none).
    let spec = if a.no_speculator {
        None
    } else {
        Some(Arc::new(load_speculator(m)?))
    };
    let corpus = Corpus::open(&a.data, 64 << 20)?;
    let engines = Engines::new(model.clone(), spec.clone())?;
    if spec.is_some() && !engines.drafts {
        tracing::warn!("the speculator's vocabulary is not the target's: no SpeContext drafter");
    }
    if let Some(s) = &spec {
        resolve_layers(&mut a, s)?;
    }
    let mut texts = Vec::new();
    for doc in corpus.index.documents(Some(&a.collection))? {
        for c in corpus.index.chunks_of(&a.collection, &doc.doc_id)? {
            texts.push(c.text);
        }
    }
    anyhow::ensure!(
        !texts.is_empty(),
        "collection `{}` in {} has no chunks (ingest documents first: `specrag ingest DIR --data {} --collection {}`)",
        a.collection,
        a.data.display(),
        a.data.display(),
        a.collection
    );
    let src = Source {
        corpus: &corpus,
        collection: &a.collection,
        texts: &texts,
    };
    let bar = spinner(String::new());
    for &tokens in &a.contexts {
        for (qi, question) in a.questions.iter().enumerate() {
            let say = |s: &str| bar.set_message(format!("{tokens} tokens, question {qi}: {s}"));
            say("loading chunks");
            let offset = qi * texts.len() / a.questions.len().max(1);
            let prompt = context(&engines, &src, tokens as usize, offset, question)?;
            let m = measure(&model, &prompt, spec.as_ref(), &a, &say)?;
            let (cache, chunks) = (&prompt.cache, prompt.chunks);
            let point = LongPoint {
                context_tokens: cache.len(),
                chunks,
                question: question.clone(),
                answer_tokens: m.ids.len(),
                full_ms_per_token: m.full_ms,
                full_kv_bytes: cache.len() * cache.row_len() * 2 * 4 * cache.n_layer(),
                drafters: m.drafters,
                kivi2: m.kivi2,
            };
            bar.suspend(|| print_point(&point, a.json));
        }
    }
    bar.finish_and_clear();
    Ok(())
}

fn print_point(p: &LongPoint, json: bool) {
    if json {
        if let Ok(s) = serde_json::to_string(p) {
            println!("{s}");
        }
        return;
    }
    println!(
        "{} tokens ({} chunks), {} answer tokens: full attention {:.1} ms/token, {:.0} MB of f32 KV",
        p.context_tokens,
        p.chunks,
        p.answer_tokens,
        p.full_ms_per_token,
        p.full_kv_bytes as f64 / 1e6
    );
    let q = |q: &Option<Quality>| {
        q.as_ref().map_or(String::from("-"), |q| {
            format!(
                "same={} prefix={} KL={:.4}",
                q.identical, q.common_prefix, q.kl
            )
        })
    };
    for r in &p.drafters {
        println!(
            "  {:<30} {:>7.1} ms/token ({:.2}x)  identical={}  accepted {}/{} in {} rounds \
             (draft {:.0} ms, verify {:.0} ms)  held {:.0} MB  read {:.3}{}  unverified: {}",
            r.drafter,
            r.ms_per_token,
            r.rel,
            r.identical,
            r.accepted,
            r.drafted,
            r.rounds,
            r.draft_ms,
            r.verify_ms,
            r.held_bytes as f64 / 1e6,
            r.read_fraction,
            r.loaded_fraction
                .map_or(String::new(), |f| format!(" (loaded {f:.3} of it)")),
            q(&r.unverified)
        );
    }
    if p.kivi2.is_some() {
        println!("  {:<30} unverified: {}", "kivi-2bit", q(&p.kivi2));
    }
}
