//! The server's metrics through the `metrics` facade, rendered by its Prometheus exporter (as
//! TGI does). Each server owns its recorder (no global one: tests run several servers in one
//! process), and `/metrics` renders it.

use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};
use std::time::Duration;

/// Latency buckets (seconds): CPU prefill of a few thousand tokens takes seconds to a minute.
const LATENCY_BUCKETS: [f64; 12] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
];
const RATIO_BUCKETS: [f64; 8] = [0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0];
/// Inter-token latency buckets (seconds): decode takes tens of milliseconds per token on CPU.
const TOKEN_BUCKETS: [f64; 10] = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.12, 0.2, 0.5, 1.0];
/// Queue wait buckets (seconds): from none to minutes behind an ingestion.
const QUEUE_BUCKETS: [f64; 10] = [0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0];

const REQUESTS: &str = "specrag_requests_total";
const TTFT: &str = "specrag_ttft_seconds";
const TOTAL: &str = "specrag_request_seconds";
const RATIO: &str = "specrag_recompute_ratio";
const CHUNKS: &str = "specrag_chunk_loads_total";
const TOKENS: &str = "specrag_tokens_generated_total";
const QUEUE_DEPTH: &str = "specrag_queue_depth";
const REJECTED: &str = "specrag_rejected_total";
const BODY_BYTES: &str = "specrag_body_bytes_in_flight";
const LOOKUPS: &str = "specrag_store_lookups_total";
const CORRUPT: &str = "specrag_store_corrupt_total";
const BYTES: &str = "specrag_store_bytes";
const STORE_ERRORS: &str = "specrag_store_errors_total";
const GUARD: &str = "specrag_guard_total";
const GUARD_PREFILL: &str = "specrag_guard_full_prefill_seconds";
const GUARD_WITHDRAWN: &str = "specrag_guard_withdrawn_tokens_total";
const GUARD_SECOND_LOOK: &str = "specrag_guard_second_looks_total";
const INTER_TOKEN: &str = "specrag_inter_token_latency_seconds";
const QUEUE_TIME: &str = "specrag_queue_time_seconds";
const SPEC_DECODE: &str = "specrag_spec_decode_tokens_total";
const LONG_CONTEXT: &str = "specrag_long_context_tokens_total";
const BATCH_PASSES: &str = "specrag_decode_passes_total";
const BATCH_STEPS: &str = "specrag_decode_steps_total";
const BATCH_SEATED: &str = "specrag_decoding_requests";
const PREFILL_TURNS: &str = "specrag_prefill_turns_total";
const KV_HELD: &str = "specrag_kv_bytes_held";
const DEVICE_MEMORY: &str = "specrag_device_memory_bytes";

/// The server's metrics. Cheap to update from any thread.
pub struct Metrics {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
    /// The engine's decode batcher, read when `/metrics` is rendered.
    batcher: std::sync::OnceLock<std::sync::Arc<dyn target_engine::Batching>>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut b = PrometheusBuilder::new();
        for (name, buckets) in [
            (TTFT, &LATENCY_BUCKETS[..]),
            (TOTAL, &LATENCY_BUCKETS[..]),
            (RATIO, &RATIO_BUCKETS[..]),
            (INTER_TOKEN, &TOKEN_BUCKETS[..]),
            (QUEUE_TIME, &QUEUE_BUCKETS[..]),
            (GUARD_PREFILL, &LATENCY_BUCKETS[..]),
        ] {
            // Only fails for an empty bucket list.
            b = b
                .set_buckets_for_metric(Matcher::Full(name.into()), buckets)
                .unwrap_or_else(|_| PrometheusBuilder::new());
        }
        let recorder = b.build_recorder();
        let handle = recorder.handle();
        let m = Self {
            recorder,
            handle,
            batcher: std::sync::OnceLock::new(),
        };
        m.with(|| {
            use metrics::{describe_counter, describe_gauge, describe_histogram};
            describe_counter!(REQUESTS, "HTTP requests by route and status.");
            describe_histogram!(TTFT, "Time to first token by method.");
            describe_histogram!(TOTAL, "Total query latency by method.");
            describe_histogram!(RATIO, "Recomputed share of chunk tokens per query.");
            describe_counter!(CHUNKS, "Chunk KV loads by tier.");
            describe_counter!(TOKENS, "Generated tokens.");
            describe_gauge!(QUEUE_DEPTH, "Requests waiting for the engine.");
            describe_counter!(REJECTED, "Requests turned away, by reason.");
            describe_gauge!(
                BODY_BYTES,
                "Request body bytes held now, against --max-body-bytes-in-flight."
            );
            describe_counter!(LOOKUPS, "Chunk store lookups by tier and result.");
            describe_counter!(CORRUPT, "Stored blobs found damaged and dropped.");
            describe_gauge!(BYTES, "Bytes held by each store tier.");
            describe_guard();
            describe_counter!(
                STORE_ERRORS,
                "Chunk store operations that failed, by tier (answered as misses or skipped)."
            );
            describe_histogram!(
                INTER_TOKEN,
                "Mean time between generated tokens of each answer, by method."
            );
            describe_histogram!(QUEUE_TIME, "Time a job waited in the queue for the engine.");
            describe_counter!(
                SPEC_DECODE,
                "Speculative decoding's tokens: drafted by the speculator, and accepted by the \
                 target (accepted / drafted is the acceptance rate)."
            );
            describe_counter!(
                LONG_CONTEXT,
                "Long-context drafting's tokens: drafted from SpeCache's view of the cache, and \
                 accepted by full attention (accepted / drafted is the acceptance rate)."
            );
            // Families with a fixed label set are present from the start.
            for tier in ["memory", "disk", "remote", "recomputed"] {
                metrics::counter!(CHUNKS, "tier" => tier).increment(0);
            }
            for kind in ["drafted", "accepted"] {
                metrics::counter!(SPEC_DECODE, "kind" => kind).increment(0);
            }
            for reason in [
                "queue_full",
                "deadline",
                "connections",
                "body_timeout",
                "body_bytes",
            ] {
                metrics::counter!(REJECTED, "reason" => reason).increment(0);
            }
            metrics::gauge!(BODY_BYTES).set(0.0);
            metrics::counter!(TOKENS).increment(0);
            metrics::counter!(GUARD_WITHDRAWN).increment(0);
        });
        m
    }
}

/// The fidelity guard's families ([`Metrics::default`] describes the rest).
fn describe_guard() {
    use metrics::{describe_counter, describe_histogram};
    describe_counter!(
        GUARD,
        "Answers by fidelity and what the guard did (kept: answered from the reused \
         cache; loop, uncertain: moved to the full cache because the decode looped or a \
         token's margin fell below --guard-margin)."
    );
    describe_histogram!(
        GUARD_PREFILL,
        "The full prefill each escalated answer ran, by fidelity (0 when the \
         exact-context cache held it): what the guard added to requests' time; \
         _count is the number of escalations."
    );
    describe_counter!(
        GUARD_WITHDRAWN,
        "Tokens decoded from the reused cache, shown or held, that an escalation \
         withdrew because the full cache disagreed."
    );
    describe_counter!(
        GUARD_SECOND_LOOK,
        "Second looks the guard took at a doubted token (more chunk tokens \
         recomputed, the answer so far decoded again), by outcome: kept (the same \
         tokens chosen again, decoding went on from that cache), answered (it chose \
         otherwise and answered: --guard-look-answers) or escalated; skipped: \
         looks not taken because an escalation after one was estimated to cost more \
         than --guard-look-cost times full recompute's prefill."
    );
}

impl Metrics {
    fn with<R>(&self, f: impl FnOnce() -> R) -> R {
        metrics::with_local_recorder(&self.recorder, f)
    }

    /// One finished HTTP request.
    pub fn request(&self, route: &str, status: u16) {
        self.with(|| {
            metrics::counter!(REQUESTS, "route" => route.to_string(), "status" => status.to_string())
                .increment(1);
        });
    }

    /// One answered query.
    pub fn answer(&self, a: &crate::answer::Answer) {
        self.with(|| {
            let method = a.method.name();
            metrics::histogram!(TTFT, "method" => method).record(a.timings.ttft_ms / 1e3);
            metrics::histogram!(TOTAL, "method" => method).record(a.timings.total_ms / 1e3);
            if a.tokens > 1 {
                metrics::histogram!(INTER_TOKEN, "method" => method)
                    .record(a.timings.decode_ms / 1e3 / (a.tokens - 1) as f64);
            }
            if a.reuse.chunk_tokens > 0 {
                metrics::histogram!(RATIO).record(a.reuse.ratio);
            }
            for (tier, n) in [
                ("memory", a.reuse.chunks_from_memory),
                ("disk", a.reuse.chunks_from_disk),
                ("remote", a.reuse.chunks_from_remote),
                ("recomputed", a.reuse.chunks_recomputed),
            ] {
                metrics::counter!(CHUNKS, "tier" => tier).increment(n as u64);
            }
            metrics::counter!(TOKENS).increment(a.tokens as u64);
            let g = a.reuse.guard;
            let outcome = match (g.escalated, g.loop_detected) {
                (false, _) => "kept",
                (true, true) => "loop",
                (true, false) => "uncertain",
            };
            metrics::counter!(GUARD, "fidelity" => g.fidelity.name(), "outcome" => outcome)
                .increment(1);
            if g.second_look || g.second_look_skipped {
                let outcome = match (g.second_look_skipped, g.escalated) {
                    (true, _) => "skipped",
                    (false, true) => "escalated",
                    (false, false) if g.second_look_answered => "answered",
                    (false, false) => "kept",
                };
                metrics::counter!(GUARD_SECOND_LOOK, "outcome" => outcome).increment(1);
            }
            if g.escalated {
                metrics::histogram!(GUARD_PREFILL, "fidelity" => g.fidelity.name())
                    .record(g.full_prefill_ms / 1e3);
                metrics::counter!(GUARD_WITHDRAWN).increment(g.withdrawn_tokens as u64);
            }
            if let Some(s) = &a.spec_decode {
                metrics::counter!(SPEC_DECODE, "kind" => "drafted").increment(s.drafted as u64);
                metrics::counter!(SPEC_DECODE, "kind" => "accepted").increment(s.accepted as u64);
            }
            if let Some(s) = &a.long_context {
                metrics::counter!(LONG_CONTEXT, "kind" => "drafted").increment(s.drafted as u64);
                metrics::counter!(LONG_CONTEXT, "kind" => "accepted").increment(s.accepted as u64);
            }
        });
    }

    /// The engine's decode batcher, whose passes `/metrics` reports from now on.
    pub fn set_batcher(&self, batcher: std::sync::Arc<dyn target_engine::Batching>) {
        if self.batcher.set(batcher).is_ok() {
            self.with(|| {
                use metrics::{describe_counter, describe_gauge};
                describe_counter!(
                    BATCH_PASSES,
                    "Decode passes over the target's weights (each carries one step of every \
                     request decoding then: steps_total / passes_total is the mean batch)."
                );
                describe_counter!(
                    BATCH_STEPS,
                    "Decode steps run: a request's token, or its token and the drafts checked \
                     with it."
                );
                describe_gauge!(BATCH_SEATED, "Requests decoding now.");
                describe_counter!(
                    PREFILL_TURNS,
                    "Prefill turns given, by what they were for: a request's first prefill, \
                     the guard's second look, or an escalation's full prefill (a turn each \
                     piece: --prefill-piece)."
                );
            });
        }
    }

    /// The KV bytes the running requests hold (admission's ledger), against `budget`.
    pub fn kv_held(&self, held: u64, budget: u64) {
        self.with(|| {
            metrics::describe_gauge!(
                KV_HELD,
                "KV bytes reserved by running requests (held) and the --kv-memory-budget."
            );
            metrics::gauge!(KV_HELD, "kind" => "held").set(held as f64);
            metrics::gauge!(KV_HELD, "kind" => "budget").set(budget as f64);
        });
    }

    /// The target device's memory (`--device cuda`), as its driver reports it.
    pub fn device_memory(&self, used: u64, total: u64) {
        self.with(|| {
            metrics::describe_gauge!(
                DEVICE_MEMORY,
                "Memory of the target's GPU (--device): in use by every process, and in all."
            );
            metrics::gauge!(DEVICE_MEMORY, "kind" => "used").set(used as f64);
            metrics::gauge!(DEVICE_MEMORY, "kind" => "total").set(total as f64);
        });
    }

    /// A job that waited `wait` in the queue before the engine took it.
    pub fn queued(&self, wait: Duration) {
        self.with(|| metrics::histogram!(QUEUE_TIME).record(wait.as_secs_f64()));
    }

    /// A request turned away because the queue was full.
    pub fn busy(&self) {
        self.with(|| metrics::counter!(REJECTED, "reason" => "queue_full").increment(1));
    }

    /// A connection refused at the connection cap.
    pub fn connection_refused(&self) {
        self.with(|| metrics::counter!(REJECTED, "reason" => "connections").increment(1));
    }

    /// A request whose body did not arrive within `--body-timeout-secs`.
    pub fn body_timeout(&self) {
        self.with(|| metrics::counter!(REJECTED, "reason" => "body_timeout").increment(1));
    }

    /// A request whose body did not fit the bytes in flight (`--max-body-bytes-in-flight`).
    pub fn body_budget_refused(&self) {
        self.with(|| metrics::counter!(REJECTED, "reason" => "body_bytes").increment(1));
    }

    /// The request body bytes held now (read when `/metrics` is rendered).
    pub fn body_bytes_in_flight(&self, bytes: usize) {
        self.with(|| metrics::gauge!(BODY_BYTES).set(bytes as f64));
    }

    /// A request that ran past its deadline.
    pub fn timeout(&self) {
        self.with(|| metrics::counter!(REJECTED, "reason" => "deadline").increment(1));
    }

    /// The exposition text; `queue_depth` and the store statistics are read by the caller.
    pub fn render(&self, queue_depth: usize, store: &chunkstore::StoreStats) -> String {
        self.with(|| {
            metrics::gauge!(QUEUE_DEPTH).set(queue_depth as f64);
            for (tier, result, n) in [
                ("memory", "hit", store.memory_hits),
                ("memory", "miss", store.memory_misses),
                ("disk", "hit", store.disk_hits),
                ("disk", "miss", store.disk_misses),
            ] {
                metrics::counter!(LOOKUPS, "tier" => tier, "result" => result).absolute(n);
            }
            metrics::counter!(CORRUPT).absolute(store.corrupt);
            metrics::counter!(STORE_ERRORS, "tier" => "disk").absolute(store.errors);
            metrics::counter!(STORE_ERRORS, "tier" => "remote").absolute(store.remote_errors);
            metrics::gauge!(BYTES, "tier" => "memory").set(store.memory_bytes as f64);
            metrics::gauge!(BYTES, "tier" => "disk").set(store.disk_bytes as f64);
            if let Some(b) = self.batcher.get() {
                let s = b.stats();
                metrics::counter!(BATCH_PASSES).absolute(s.passes);
                metrics::counter!(BATCH_STEPS).absolute(s.steps);
                metrics::gauge!(BATCH_SEATED).set(s.seated as f64);
                let first = s.prefill_turns - s.look_turns - s.escalation_turns;
                for (kind, n) in [
                    (target_engine::TurnKind::First, first),
                    (target_engine::TurnKind::Look, s.look_turns),
                    (target_engine::TurnKind::Escalation, s.escalation_turns),
                ] {
                    metrics::counter!(PREFILL_TURNS, "kind" => kind.name()).absolute(n);
                }
            }
        });
        self.handle.render()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    /// Per family: its TYPE, the label names of its samples (without `le`) and, for
    /// histograms, the bucket bounds.
    fn families(text: &str) -> BTreeMap<String, (String, BTreeSet<String>, Vec<String>)> {
        let mut out: BTreeMap<String, (String, BTreeSet<String>, Vec<String>)> = BTreeMap::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
                out.entry(name.into()).or_default().0 = kind.into();
                continue;
            }
            if line.starts_with('#') || line.is_empty() {
                continue;
            }
            let series = line.split(' ').next().unwrap_or("");
            let (name, labels) = series.split_once('{').unwrap_or((series, ""));
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| out.contains_key(*f)))
                .unwrap_or(name);
            let entry = out.entry(family.into()).or_default();
            for pair in labels
                .trim_end_matches('}')
                .split(',')
                .filter(|p| !p.is_empty())
            {
                let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                if k == "le" {
                    let v = v.trim_matches('"').to_string();
                    if !entry.2.contains(&v) {
                        entry.2.push(v);
                    }
                } else {
                    entry.1.insert(k.into());
                }
            }
        }
        out
    }

    fn answer(tokens: usize) -> crate::answer::Answer {
        serde_json::from_value(serde_json::json!({
            "answer": "x", "method": "epic", "finish_reason": "eos", "tokens": tokens,
            "chunks": [], "timings": {"retrieve_ms": 1.0, "kv_load_ms": 1.0, "speculate_ms": 0.0,
            "align_ms": 1.0, "prefill_ms": 300.0, "ttft_ms": 303.0, "decode_ms": 90.0,
            "total_ms": 393.0}, "reuse": {"chunk_tokens": 100, "recomputed_tokens": 15,
            "ratio": 0.15, "chunks_from_memory": 1, "chunks_from_disk": 2, "chunks_recomputed": 0},
            "spec_decode": {"drafted": 10, "accepted": 7, "acceptance": 0.7, "rounds": 3,
            "draft_len": 5, "draft_ms": 1.0, "verify_ms": 2.0},
        }))
        .expect("an answer")
    }

    #[test]
    fn speculative_decoding_counts_drafted_and_accepted_tokens() {
        let m = Metrics::default();
        m.answer(&answer(4));
        m.answer(&answer(4));
        let text = m.render(0, &chunkstore::StoreStats::default());
        for (kind, n) in [("drafted", 20), ("accepted", 14)] {
            let line = format!("specrag_spec_decode_tokens_total{{kind=\"{kind}\"}} {n}");
            assert!(text.contains(&line), "{line} in {text}");
        }
    }

    /// The families, types, labels and buckets of the hand-written exposition this replaced
    /// (2026-11-23), plus the two histograms added with the exporter, the store's error
    /// counter, the guard's outcomes (2026-11-26) and its withdrawn tokens (its full-prefill
    /// histogram appears with the first escalation, checked in tests/server.rs).
    #[test]
    fn families_types_labels_and_buckets_are_those_of_before_plus_two() {
        let m = Metrics::default();
        for status in [200, 200, 422] {
            m.request("/rag/query", status);
        }
        m.answer(&answer(4));
        m.queued(Duration::from_millis(3));
        m.busy();
        let text = m.render(2, &chunkstore::StoreStats::default());
        let buckets = |b: &[f64]| -> Vec<String> {
            b.iter()
                .map(|b| b.to_string())
                .chain(["+Inf".to_string()])
                .collect()
        };
        let latency = buckets(&LATENCY_BUCKETS[..]);
        let ratio: Vec<String> = ["0", "0.05", "0.1", "0.15", "0.2", "0.3", "0.5", "1", "+Inf"]
            .map(String::from)
            .to_vec();
        let set = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
        let want: BTreeMap<String, (String, BTreeSet<String>, Vec<String>)> = [
            (REQUESTS, "counter", set(&["route", "status"]), vec![]),
            (TTFT, "histogram", set(&["method"]), latency.clone()),
            (TOTAL, "histogram", set(&["method"]), latency),
            (RATIO, "histogram", set(&[]), ratio),
            (CHUNKS, "counter", set(&["tier"]), vec![]),
            (TOKENS, "counter", set(&[]), vec![]),
            (QUEUE_DEPTH, "gauge", set(&[]), vec![]),
            (REJECTED, "counter", set(&["reason"]), vec![]),
            (BODY_BYTES, "gauge", set(&[]), vec![]),
            (LOOKUPS, "counter", set(&["tier", "result"]), vec![]),
            (CORRUPT, "counter", set(&[]), vec![]),
            (STORE_ERRORS, "counter", set(&["tier"]), vec![]),
            (GUARD, "counter", set(&["fidelity", "outcome"]), vec![]),
            (GUARD_WITHDRAWN, "counter", set(&[]), vec![]),
            (SPEC_DECODE, "counter", set(&["kind"]), vec![]),
            (BYTES, "gauge", set(&["tier"]), vec![]),
            (
                INTER_TOKEN,
                "histogram",
                set(&["method"]),
                buckets(&TOKEN_BUCKETS[..]),
            ),
            (
                QUEUE_TIME,
                "histogram",
                set(&[]),
                buckets(&QUEUE_BUCKETS[..]),
            ),
        ]
        .into_iter()
        .map(|(n, t, l, b)| (n.to_string(), (t.to_string(), l, b)))
        .collect();
        assert_eq!(families(&text), want, "{text}");
        assert!(text.contains("specrag_requests_total{route=\"/rag/query\",status=\"200\"} 2"));
        assert!(text.contains("specrag_requests_total{route=\"/rag/query\",status=\"422\"} 1"));
        assert!(text.contains("specrag_queue_depth 2"));
        assert!(
            text.contains("specrag_rejected_total{reason=\"queue_full\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("specrag_chunk_loads_total{tier=\"disk\"} 2"),
            "{text}"
        );
        // 90 ms of decode over 3 gaps: 0.03 s, in the 0.04 bucket and not the 0.02 one.
        assert!(
            text.contains(
                "specrag_inter_token_latency_seconds_bucket{method=\"epic\",le=\"0.02\"} 0"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "specrag_inter_token_latency_seconds_bucket{method=\"epic\",le=\"0.04\"} 1"
            ),
            "{text}"
        );
    }
}
