//! Prometheus text exposition of the server's counters, written by hand: a few counters,
//! gauges and fixed-bucket histograms do not need a metrics framework.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

/// Latency buckets (seconds): CPU prefill of a few thousand tokens takes seconds to a minute.
const LATENCY_BUCKETS: [f64; 12] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
];
const RATIO_BUCKETS: [f64; 8] = [0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0];

#[derive(Debug, Clone, Default)]
struct Histogram {
    /// Cumulative counts per bucket bound, then +Inf.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, bounds: &[f64], v: f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; bounds.len()];
        }
        for (c, b) in self.counts.iter_mut().zip(bounds) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn write(&self, out: &mut String, name: &str, labels: &str, bounds: &[f64]) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (c, b) in self.counts.iter().zip(bounds) {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {c}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            self.count
        );
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braces} {}", self.count);
    }
}

#[derive(Debug, Default)]
struct Inner {
    requests: BTreeMap<(String, u16), u64>,
    ttft: BTreeMap<String, Histogram>,
    total: BTreeMap<String, Histogram>,
    ratio: Histogram,
    chunks: BTreeMap<&'static str, u64>,
    tokens: u64,
    rejected_busy: u64,
    timeouts: u64,
}

/// The server's metrics. Cheap to update from any thread.
#[derive(Debug, Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Metrics {
    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        // A panic while holding the lock cannot leave the counters inconsistent in a way
        // that matters more than losing them, so a poisoned lock is used as is.
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }

    /// One finished HTTP request.
    pub fn request(&self, route: &str, status: u16) {
        self.with(|m| *m.requests.entry((route.to_string(), status)).or_default() += 1);
    }

    /// One answered query.
    pub fn answer(&self, a: &crate::pipeline::Answer) {
        self.with(|m| {
            let method = a.method.name().to_string();
            m.ttft
                .entry(method.clone())
                .or_default()
                .observe(&LATENCY_BUCKETS, a.timings.ttft_ms / 1e3);
            m.total
                .entry(method)
                .or_default()
                .observe(&LATENCY_BUCKETS, a.timings.total_ms / 1e3);
            if a.reuse.chunk_tokens > 0 {
                m.ratio.observe(&RATIO_BUCKETS, a.reuse.ratio);
            }
            *m.chunks.entry("memory").or_default() += a.reuse.chunks_from_memory as u64;
            *m.chunks.entry("disk").or_default() += a.reuse.chunks_from_disk as u64;
            *m.chunks.entry("recomputed").or_default() += a.reuse.chunks_recomputed as u64;
            m.tokens += a.tokens as u64;
        });
    }

    /// A request turned away because the queue was full.
    pub fn busy(&self) {
        self.with(|m| m.rejected_busy += 1);
    }

    /// A request that ran past its deadline.
    pub fn timeout(&self) {
        self.with(|m| m.timeouts += 1);
    }

    /// The exposition text; `queue_depth` and the store statistics are read by the caller.
    pub fn render(&self, queue_depth: usize, store: &chunkstore::StoreStats) -> String {
        self.with(|m| {
            let mut o = String::new();
            o.push_str("# HELP specrag_requests_total HTTP requests by route and status.\n");
            o.push_str("# TYPE specrag_requests_total counter\n");
            for ((route, status), n) in &m.requests {
                let _ = writeln!(
                    o,
                    "specrag_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
                );
            }
            o.push_str("# HELP specrag_ttft_seconds Time to first token by method.\n");
            o.push_str("# TYPE specrag_ttft_seconds histogram\n");
            for (method, h) in &m.ttft {
                h.write(
                    &mut o,
                    "specrag_ttft_seconds",
                    &format!("method=\"{method}\""),
                    &LATENCY_BUCKETS,
                );
            }
            o.push_str("# HELP specrag_request_seconds Total query latency by method.\n");
            o.push_str("# TYPE specrag_request_seconds histogram\n");
            for (method, h) in &m.total {
                h.write(
                    &mut o,
                    "specrag_request_seconds",
                    &format!("method=\"{method}\""),
                    &LATENCY_BUCKETS,
                );
            }
            o.push_str(
                "# HELP specrag_recompute_ratio Recomputed share of chunk tokens per query.\n",
            );
            o.push_str("# TYPE specrag_recompute_ratio histogram\n");
            m.ratio
                .write(&mut o, "specrag_recompute_ratio", "", &RATIO_BUCKETS);
            o.push_str("# HELP specrag_chunk_loads_total Chunk KV loads by tier.\n");
            o.push_str("# TYPE specrag_chunk_loads_total counter\n");
            for tier in ["memory", "disk", "recomputed"] {
                let n = m.chunks.get(tier).copied().unwrap_or(0);
                let _ = writeln!(o, "specrag_chunk_loads_total{{tier=\"{tier}\"}} {n}");
            }
            o.push_str("# HELP specrag_tokens_generated_total Generated tokens.\n");
            o.push_str("# TYPE specrag_tokens_generated_total counter\n");
            let _ = writeln!(o, "specrag_tokens_generated_total {}", m.tokens);
            o.push_str("# HELP specrag_queue_depth Requests waiting for the engine.\n");
            o.push_str("# TYPE specrag_queue_depth gauge\n");
            let _ = writeln!(o, "specrag_queue_depth {queue_depth}");
            o.push_str("# HELP specrag_rejected_total Requests turned away, by reason.\n");
            o.push_str("# TYPE specrag_rejected_total counter\n");
            let _ = writeln!(
                o,
                "specrag_rejected_total{{reason=\"queue_full\"}} {}",
                m.rejected_busy
            );
            let _ = writeln!(
                o,
                "specrag_rejected_total{{reason=\"deadline\"}} {}",
                m.timeouts
            );
            write_store(&mut o, store);
            o
        })
    }
}

/// The chunk store's families of the exposition text.
fn write_store(o: &mut String, store: &chunkstore::StoreStats) {
    o.push_str("# HELP specrag_store_lookups_total Chunk store lookups by tier and result.\n");
    o.push_str("# TYPE specrag_store_lookups_total counter\n");
    for (tier, result, n) in [
        ("memory", "hit", store.memory_hits),
        ("memory", "miss", store.memory_misses),
        ("disk", "hit", store.disk_hits),
        ("disk", "miss", store.disk_misses),
    ] {
        let _ = writeln!(
            o,
            "specrag_store_lookups_total{{tier=\"{tier}\",result=\"{result}\"}} {n}"
        );
    }
    o.push_str("# HELP specrag_store_corrupt_total Stored blobs found damaged and dropped.\n");
    o.push_str("# TYPE specrag_store_corrupt_total counter\n");
    let _ = writeln!(o, "specrag_store_corrupt_total {}", store.corrupt);
    o.push_str("# HELP specrag_store_bytes Bytes held by each store tier.\n");
    o.push_str("# TYPE specrag_store_bytes gauge\n");
    let _ = writeln!(
        o,
        "specrag_store_bytes{{tier=\"memory\"}} {}",
        store.memory_bytes
    );
    let _ = writeln!(
        o,
        "specrag_store_bytes{{tier=\"disk\"}} {}",
        store.disk_bytes
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_and_counters_labelled() {
        let m = Metrics::default();
        m.request("/rag/query", 200);
        m.request("/rag/query", 200);
        m.request("/rag/query", 422);
        let mut h = Histogram::default();
        h.observe(&[1.0, 2.0], 0.5);
        h.observe(&[1.0, 2.0], 1.5);
        h.observe(&[1.0, 2.0], 9.0);
        assert_eq!(h.counts, vec![1, 2]);
        let mut out = String::new();
        h.write(&mut out, "x", "", &[1.0, 2.0]);
        assert!(out.contains("x_bucket{le=\"+Inf\"} 3"), "{out}");
        assert!(out.contains("x_sum 11"), "{out}");
        let text = m.render(2, &chunkstore::StoreStats::default());
        assert!(text.contains("specrag_requests_total{route=\"/rag/query\",status=\"200\"} 2"));
        assert!(text.contains("specrag_requests_total{route=\"/rag/query\",status=\"422\"} 1"));
        assert!(text.contains("specrag_queue_depth 2"));
    }
}
