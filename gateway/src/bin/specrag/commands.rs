//! The corpus commands: `ingest`, `query`, `serve` and `demo`.

use crate::answer_stream::{AnswerPrinter, Output};
use crate::args::{DemoArgs, IngestArgs, ModelArgs, QueryArgs, ServeArgs};
use crate::progress::IngestProgress;
use crate::{open_pipeline, EXIT_PARTIAL};
use anyhow::Context;
use gateway::corpus::DEFAULT_MEMORY_BYTES;
use gateway::ingest::{IngestConfig, IngestReport};
use gateway::pipeline::{Answer, Piece, ScoreSource};
use serde_json::json;
use std::sync::Arc;

/// Memory tier of an ingestion run (blobs are written through to disk).
const INGEST_MEMORY_BYTES: u64 = 256 << 20;

/// `specrag ingest`.
pub fn ingest(m: &ModelArgs, a: IngestArgs) -> anyhow::Result<()> {
    let inputs = gateway::input::read_inputs(&a.paths);
    let p = open_pipeline(
        m,
        &a.data.data,
        &a.data.store_options(),
        INGEST_MEMORY_BYTES,
        !a.no_spec_scores,
        ScoreSource::Query,
    )?;
    let mut progress = IngestProgress::new(a.json, a.kv == gateway::ingest::KvMode::Lazy);
    for problem in &inputs.problems {
        progress.problem(&problem.origin, &problem.message);
    }
    let chars = inputs.docs.iter().map(|d| d.text.chars().count()).sum();
    progress.started(inputs.docs.len(), chars);
    let cfg = IngestConfig {
        collection: a.collection.clone(),
        chunk_tokens: a.chunk_tokens as usize,
        batch_docs: a.batch_docs as usize,
        speculator_kv: a.speculator_kv,
        kv: a.kv,
        ..Default::default()
    };
    let report = gateway::ingest::ingest(&p.corpus, &p.engines, inputs.docs, &cfg, |e| {
        progress.on_event(e)
    });
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            progress.finish();
            if a.json {
                // The run's last line says how it ended, as `POST /documents` streams it.
                println!("{}", error_line(&e));
            }
            return Err(e.into());
        }
    };
    progress.finish();
    let problems = progress.problems;
    if a.json {
        let mut v = serde_json::to_value(&report)?;
        v["event"] = json!("summary");
        v["problems"] = json!(problems);
        println!("{v}");
    } else {
        print_ingest_summary(&report);
        if problems > 0 {
            eprintln!("{problems} inputs skipped (see above)");
        }
    }
    if problems > 0 {
        std::process::exit(EXIT_PARTIAL);
    }
    Ok(())
}

/// The `{"event":"error"}` line a `--json` ingestion ends with when it fails: the status and
/// field an HTTP ingestion would answer, and what failed (naming the document in flight).
fn error_line(e: &gateway::GatewayError) -> serde_json::Value {
    use gateway::error::Fault;
    let (status, field) = match e.fault() {
        Fault::BadInput(f) => (422, f),
        Fault::TooLarge(f) => (413, Some(f)),
        Fault::NotFound => (404, None),
        Fault::Unavailable => (503, None),
        Fault::Internal => (500, None),
    };
    let mut v = json!({"event": "error", "status": status, "detail": e.to_string()});
    if let Some(f) = field {
        v["field"] = json!(f);
    }
    v
}

fn print_ingest_summary(report: &IngestReport) {
    println!(
        "ingested {} documents into `{}`: {} chunks, {} tokens ({} chunks already stored, {} left for their first query), {:.1} MB of KV in {:.1} s ({:.2} chunks/s, {:.0} tokens/s)",
        report.documents,
        report.collection,
        report.chunks,
        report.tokens,
        report.reused_chunks,
        report.deferred_chunks,
        report.kv_bytes as f64 / 1e6,
        report.seconds,
        report.chunks_per_s,
        report.tokens_per_s
    );
    if report.speculator_kv_bytes > 0 {
        println!(
            "speculator KV stored: {:.1} MB",
            report.speculator_kv_bytes as f64 / 1e6
        );
    }
    println!(
        "KV per 512-token chunk: {:.1} MB; {} orphan blobs removed; the store grew by {:.1} MB",
        report.kv_bytes_per_512_tokens as f64 / 1e6,
        report.garbage_removed,
        report.kv_stored_bytes as f64 / 1e6
    );
    if let Some(l) = report.load {
        println!(
            "load one chunk: {:.3} ms from memory, {:.1} ms from disk (decode + checksum)",
            l.memory_ms, l.disk_ms
        );
    }
}

/// `specrag query`.
pub fn query(m: &ModelArgs, a: QueryArgs) -> anyhow::Result<()> {
    let mut q = gateway::api::QueryRequest {
        query: a.query.clone(),
        collection: Some(a.collection.clone()),
        top_k: Some(a.top_k.into()),
        method: Some(a.method.name().into()),
        recompute_ratio: Some(a.ratio),
        max_tokens: Some(a.max_tokens.into()),
        temperature: Some(a.temperature),
        seed: Some(a.seed),
        verify: Some(a.verify),
        fidelity: (!a.verify).then_some(a.fidelity),
        spec_decode: None,
        spec_draft: None,
        long_context: None,
        max_context_tokens: None,
        documents: None,
        stream: None,
        logprobs: a.logprobs,
    }
    .validate()?;
    q.stop = a.stop_strings()?;
    let mut pipeline = open_pipeline(
        m,
        &a.data.data,
        &a.data.store_options(),
        DEFAULT_MEMORY_BYTES,
        true,
        a.spec_scores,
    )?;
    pipeline.verify_mode = a.verify_mode;
    pipeline.guard = a.guard.policy();
    pipeline.spec_decode = a.spec_decode.on();
    pipeline.chunk_order = a.chunk_order;
    pipeline.spec_draft = a.spec_draft;
    a.long_context.apply(&mut pipeline)?;
    if a.json {
        let answer = pipeline.query(&q, &mut |_| true)?;
        println!("{}", serde_json::to_string(&answer)?);
        return Ok(());
    }
    // What stands, only: drawn as it streams on a terminal, written once it is final elsewhere.
    let mut printer = AnswerPrinter::new(std::io::stdout().lock(), Output::stdout());
    let mut failed = None;
    let answer = pipeline.query(&q, &mut |piece| match printer.apply(piece) {
        Ok(()) => true,
        // stdout closed (`| head`): stop generating.
        Err(e) => {
            failed = Some(e);
            false
        }
    })?;
    if let Some(e) = failed {
        return Err(e).context("writing the answer to stdout");
    }
    // The answer object is what `--json` prints; the stream applied is the same text.
    if printer.text() != answer.answer {
        printer.apply(Piece::Replace(&answer.answer))?;
    }
    drop(printer.finish().context("writing the answer to stdout")?);
    print_answer_stats(&answer);
    Ok(())
}

fn print_answer_stats(answer: &Answer) {
    let t = &answer.timings;
    let r = &answer.reuse;
    eprintln!(
        "[{} chunks ({} memory, {} disk, {} recomputed); {} of {} chunk tokens recomputed ({:.3}); \
         retrieve {:.0} ms, kv load {:.0} ms, speculate {:.0} ms, align {:.1} ms, prefill {:.0} ms, \
         TTFT {:.0} ms, decode {:.0} ms ({} tokens), total {:.0} ms]",
        answer.chunks.len(), r.chunks_from_memory, r.chunks_from_disk, r.chunks_recomputed,
        r.recomputed_tokens, r.chunk_tokens, r.ratio, t.retrieve_ms, t.kv_load_ms,
        t.speculate_ms, t.align_ms, t.prefill_ms, t.ttft_ms, t.decode_ms, answer.tokens, t.total_ms
    );
    if r.guard.escalated {
        // Said after the answer, not inside it: what the escalation withdrew is not printed.
        eprintln!("[fidelity guard: escalated to the full cache; the answer is full recompute's]");
    }
}

/// `specrag serve`.
pub fn serve(m: &ModelArgs, a: ServeArgs) -> anyhow::Result<()> {
    // A key list that is set but empty would silently open every route: refuse it.
    for var in ["SPECRAG_API_KEYS", "SPECRAG_ADMIN_KEYS"] {
        if std::env::var_os(var).is_some_and(|v| v.to_string_lossy().trim().is_empty()) {
            anyhow::bail!(
                "{var} is set but holds no key: unset it to serve without authentication, \
                 or give KEY[=COLLECTIONS] entries separated by `;`"
            );
        }
    }
    let mut pipeline = open_pipeline(
        m,
        &a.data.data,
        &a.data.store_options(),
        a.memory_mb << 20,
        true,
        a.spec_scores,
    )?;
    warn_of_foreign_kv(&pipeline);
    pipeline.verify_mode = a.verify_mode;
    pipeline.guard = a.guard.policy();
    pipeline.spec_decode = a.spec_decode.on();
    pipeline.chunk_order = a.chunk_order;
    pipeline.spec_draft = a.spec_draft;
    a.long_context.apply(&mut pipeline)?;
    let mut api_keys = a.api_keys;
    api_keys.extend(a.admin_keys);
    let config = gateway::http::ServerConfig {
        api_keys,
        queue_capacity: a.queue as usize,
        max_batch: a.max_batch as usize,
        prefill_order: a.prefill_order,
        prefill_piece: a.prefill_piece,
        request_timeout: std::time::Duration::from_secs(a.timeout_secs),
        max_request_tokens: usize::try_from(a.max_request_tokens)?,
        max_collection_tokens: usize::try_from(a.max_collection_tokens)?,
        max_connections: a.max_connections as usize,
        header_read_timeout: std::time::Duration::from_secs(a.header_timeout_secs),
        body_timeout: std::time::Duration::from_secs(a.body_timeout_secs),
        max_body_bytes_in_flight: usize::try_from(a.max_body_bytes_in_flight)?,
        fidelity: a.fidelity,
        recompute_ratio: a.ratio,
        speculator_kv: a.speculator_kv,
    };
    let state = gateway::http::AppState::new(Arc::new(pipeline), config);
    if let Some(log) = state.pipeline.corpus.doclog.clone() {
        gateway::replication::follow(state.engine.clone(), log);
    }
    let defaults = state.config.request_defaults();
    gateway::http::runtime()?.block_on(async move {
        let listener = tokio::net::TcpListener::bind(a.addr)
            .await
            .with_context(|| format!("binding {}", a.addr))?;
        eprintln!(
            "specrag listening on http://{} (API docs at /docs); requests that do not say get \
             fidelity {} and recompute ratio {}",
            listener.local_addr()?,
            defaults.fidelity.name(),
            defaults.recompute_ratio
        );
        gateway::http::serve_on(state, listener).await?;
        anyhow::Ok(())
    })
}

/// Says on stderr when the stored chunk KV was computed by the target loaded otherwise (at
/// another `--attention`, say): it is never read, so every eager chunk would be recomputed
/// without a word. The look is advice: where it fails, serving goes on.
fn warn_of_foreign_kv(pipeline: &gateway::pipeline::Pipeline) {
    let target = &pipeline.engines.target;
    let attention = match target.cpu().map(|m| m.attention()) {
        Some(kernels::AttentionPrecision::F32) => "f32",
        Some(kernels::AttentionPrecision::Bf16) => "bf16",
        // KV computed on a device is its own: another --device reads none of it.
        None => "the device engine's",
    };
    match crate::foreign_kv::look(&pipeline.corpus, target.fingerprint()) {
        Ok(found) => {
            if let Some(w) = crate::foreign_kv::warning(&found, target.fingerprint(), attention) {
                eprintln!("{w}");
            }
        }
        Err(e) => tracing::warn!("could not look at the stored chunk KV's fingerprints: {e}"),
    }
}

/// `specrag demo`: index the documents (their KV computed when a query first retrieves a chunk,
/// unless `--kv eager`), serve on loopback, ask the question over HTTP, then ask it again from the
/// stored KV and by full recompute, and print what reuse bought.
pub fn demo(m: &ModelArgs, a: DemoArgs) -> anyhow::Result<()> {
    let paths = if a.paths.is_empty() {
        gateway::input::demo_paths(std::path::Path::new("."))
    } else {
        a.paths.clone()
    };
    if let Some(missing) = paths.iter().find(|p| !p.exists()) {
        anyhow::bail!(
            "{} not found: run `specrag demo` from the repository root, or pass the documents to ingest",
            missing.display()
        );
    }
    let pipeline = open_pipeline(
        m,
        &a.data,
        &gateway::corpus::StoreOptions::default(),
        DEFAULT_MEMORY_BYTES,
        true,
        ScoreSource::Query,
    )?;
    let inputs = gateway::input::read_inputs(&paths);
    let lazy = a.kv == gateway::ingest::KvMode::Lazy;
    let mut progress = IngestProgress::new(false, lazy);
    for p in &inputs.problems {
        progress.problem(&p.origin, &p.message);
    }
    let cfg = IngestConfig {
        collection: "demo".into(),
        kv: a.kv,
        ..Default::default()
    };
    eprintln!(
        "[1/4] {} {} documents into {} (collection `demo`{})",
        if lazy { "indexing" } else { "ingesting" },
        inputs.docs.len(),
        a.data.display(),
        if lazy {
            "; a chunk's KV is computed when a query first retrieves it"
        } else {
            ""
        }
    );
    let report = gateway::ingest::ingest(
        &pipeline.corpus,
        &pipeline.engines,
        inputs.docs,
        &cfg,
        |e| progress.on_event(e),
    )?;
    progress.finish();
    eprintln!(
        "      {} chunks, {} tokens ({} with KV stored already) in {:.1} s",
        report.chunks, report.tokens, report.reused_chunks, report.seconds
    );
    let state = gateway::http::AppState::new(Arc::new(pipeline), Default::default());
    gateway::http::runtime()?.block_on(ask_demo_question(state, a))
}

/// One demo request over HTTP; the answer's JSON. `compared`: the answer is compared with
/// another, so it carries each token's logprob and the next most likely token's (where two
/// answers part, full recompute's own top-2 gap classes the split).
async fn demo_ask(
    addr: std::net::SocketAddr,
    a: &DemoArgs,
    method: &str,
    compared: bool,
) -> anyhow::Result<serde_json::Value> {
    let mut body = gateway::demo::demo_request(&a.question, method, a.max_tokens);
    if compared {
        body["logprobs"] = serde_json::json!(2);
    }
    let body = body.to_string();
    let (status, text) = gateway::client::request(addr, "POST", "/rag/query", Some(&body)).await?;
    if status != 200 {
        anyhow::bail!("the server answered {status}: {text}");
    }
    Ok(serde_json::from_str(&text)?)
}

/// What one demo request cost and where its chunks' KV came from.
fn demo_line(label: &str, v: &serde_json::Value) -> String {
    let t = &v["timings"];
    let r = &v["reuse"];
    let secs = |k: &str| t[k].as_f64().unwrap_or_default() / 1e3;
    let n = |k: &str| r[k].as_u64().unwrap_or_default();
    let guard = &r["guard"];
    let escalated = guard["escalated"].as_bool().unwrap_or_default();
    let mut line = format!(
        "  {label:<34} time to first token {:>6.1} s, whole answer {:>6.1} s",
        secs("ttft_ms"),
        secs("total_ms")
    );
    if v["method"] != "full_recompute" {
        line.push_str(&format!(
            "; chunks' KV: {} computed now, {} stored",
            n("chunks_recomputed"),
            n("chunks_from_memory") + n("chunks_from_disk") + n("chunks_from_remote")
        ));
        if escalated {
            line.push_str("; the guard escalated to full recompute");
        }
    }
    line
}

/// The demo's question over HTTP to a loopback server three times (reuse computing the chunks'
/// KV, reuse from stored KV, full recompute), the answer and the comparison printed.
async fn ask_demo_question(state: gateway::http::AppState, a: DemoArgs) -> anyhow::Result<()> {
    let addr = gateway::http::spawn_loopback(state).await?;
    eprintln!("[2/4] server listening on http://{addr} (API docs at http://{addr}/docs)");
    let method = a.method.name();
    let body = gateway::demo::demo_request(&a.question, method, a.max_tokens);
    eprintln!(
        "[3/4] curl -s http://{addr}/rag/query -H 'content-type: application/json' -d '{body}'"
    );
    let first = demo_ask(addr, &a, method, false).await?;
    println!("Q: {}", a.question);
    println!("A: {}", first["answer"].as_str().unwrap_or_default().trim());
    println!("sources:");
    for c in first["chunks"].as_array().into_iter().flatten() {
        println!(
            "  {} #{} (BM25 {:.2})",
            c["doc_id"].as_str().unwrap_or_default(),
            c["position"],
            c["score"].as_f64().unwrap_or_default()
        );
    }
    eprintln!("[4/4] the same question from the stored KV, and by full recompute");
    let again = demo_ask(addr, &a, method, true).await?;
    let full = demo_ask(addr, &a, "full_recompute", true).await?;
    println!(
        "what reuse bought ({method}, ρ {}):",
        gateway::pipeline::DEFAULT_RATIO
    );
    println!("{}", demo_line("first ask (KV computed as needed)", &first));
    println!("{}", demo_line("asked again (KV stored)", &again));
    println!("{}", demo_line("full recompute", &full));
    println!("{}", gateway::demo::agreement(&again, &full));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::error_line;
    use gateway::GatewayError;

    #[test]
    fn a_failed_json_ingestion_ends_with_an_error_line_naming_the_document() {
        let e = GatewayError::Internal("disk full".into()).in_document("docs/a.md");
        let v = error_line(&e);
        assert_eq!(v["event"], "error");
        assert_eq!(v["status"], 500);
        assert_eq!(
            v["detail"],
            "while ingesting docs/a.md: internal error: disk full"
        );
        assert!(v.get("field").is_none());
        let big = GatewayError::TooLarge {
            field: "documents",
            message: "over the budget".into(),
        }
        .in_document("b.jsonl:3");
        let v = error_line(&big);
        assert_eq!(
            (v["status"].as_u64(), v["field"].as_str()),
            (Some(413), Some("documents"))
        );
    }
}
