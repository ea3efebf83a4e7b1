//! Throughput and goodput under Poisson arrivals, through the real HTTP server: the same
//! router, engine queue and pipeline `specrag serve` runs, on a loopback socket. Each request
//! is a case's question; its answer is scored against the gold answers, and SpecCache's Eq. 8
//! counts the requests whose score reaches γ per second of the whole run.

use crate::datasets::Case;
use crate::metrics::{self, RequestOutcome};
use crate::plan::PairingName;
use crate::run::{collection_of, Dataset};
use gateway::http::{AppState, ServerConfig};
use gateway::pipeline::{Answer, Method, Pipeline};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One (method, arrival rate) run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadPoint {
    pub pairing: PairingName,
    pub method: Method,
    pub ratio: f64,
    /// The rate as a multiple of full recompute's service rate.
    pub factor: f64,
    pub rate_rps: f64,
    pub requests: usize,
    /// Answered 200.
    pub ok: usize,
    /// Refused with 429 (queue full).
    pub rejected: usize,
    /// Any other status or a transport error.
    pub failed: usize,
    /// From the first arrival to the last response.
    pub duration_s: f64,
    pub throughput_rps: f64,
    /// SpecCache Eq. 8: answers with score ≥ γ per second.
    pub goodput_rps: f64,
    pub gamma: f64,
    pub mean_score: f64,
    /// Client-side latency of answered requests, from the scheduled arrival (queueing
    /// included).
    pub latency_p50_s: f64,
    pub latency_p90_s: f64,
    /// Server-side time to first token of answered requests (queueing excluded).
    pub ttft_p50_ms: f64,
}

impl LoadPoint {
    /// The method as reports name it: `full_recompute`, or `method@ratio`.
    pub fn label(&self) -> String {
        if self.method == Method::FullRecompute {
            self.method.name().to_string()
        } else {
            format!("{}@{:.2}", self.method, self.ratio)
        }
    }
}

/// `n` arrival times (seconds from the start) of a Poisson process of `rate` per second: the
/// first at 0, then exponential gaps with mean `1 / rate`.
pub fn poisson_arrivals(n: usize, rate: f64, seed: u64) -> Vec<f64> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                // Inverse CDF; 1 - u lies in (0, 1], so the log is finite.
                let u: f64 = rng.gen();
                t += -(1.0 - u).ln() / rate;
            }
            t
        })
        .collect()
}

/// The p-quantile (nearest rank) of `v`; 0 for an empty slice.
pub fn quantile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

/// What to send: a method at a ratio, at each rate.
#[derive(Debug, Clone)]
pub struct LoadPlan {
    pub pairing: PairingName,
    pub methods: Vec<(Method, f64)>,
    /// (factor, rate in requests per second).
    pub rates: Vec<(f64, f64)>,
    pub requests: usize,
    pub gamma: f64,
    pub seed: u64,
}

struct Sent {
    status: Option<u16>,
    latency_s: f64,
    end: Instant,
    answer: Option<Answer>,
    case: usize,
}

/// Runs every (method, rate) of `plan` against a server over `pipeline`, with the questions of
/// `ds` in turn. `on_point` is called after each run.
pub fn run(
    pipeline: Arc<Pipeline>,
    ds: &Dataset,
    plan: &LoadPlan,
    on_point: &mut dyn FnMut(&LoadPoint),
) -> anyhow::Result<Vec<LoadPoint>> {
    if ds.cases.is_empty() {
        anyhow::bail!("the load test needs at least one case");
    }
    let state = AppState::new(pipeline, ServerConfig::default());
    gateway::http::runtime()?.block_on(async move {
        let addr = gateway::http::spawn_loopback(state).await?;
        let mut out = Vec::new();
        for &(method, ratio) in &plan.methods {
            for (ri, &(factor, rate)) in plan.rates.iter().enumerate() {
                // Every method sees the same arrival times at a given rate (common random
                // numbers), so methods are compared on identical traffic.
                let arrivals = poisson_arrivals(plan.requests, rate, plan.seed ^ ri as u64);
                let start = Instant::now();
                let mut tasks = Vec::new();
                for (i, &at) in arrivals.iter().enumerate() {
                    let case_ix = i % ds.cases.len();
                    let case = &ds.cases[case_ix];
                    let body = serde_json::json!({
                        "query": case.question,
                        "collection": collection_of(case),
                        "top_k": ds.top_k,
                        "method": method.name(),
                        "recompute_ratio": ratio,
                        "max_tokens": ds.max_tokens,
                    })
                    .to_string();
                    let when = start + Duration::from_secs_f64(at);
                    tasks.push(tokio::spawn(async move {
                        tokio::time::sleep_until(when.into()).await;
                        let r =
                            gateway::client::request(addr, "POST", "/rag/query", Some(&body)).await;
                        let end = Instant::now();
                        let (status, answer) = match r {
                            Ok((s, text)) => (Some(s), serde_json::from_str::<Answer>(&text).ok()),
                            Err(_) => (None, None),
                        };
                        Sent {
                            status,
                            // From the scheduled arrival: a late timer wake-up counts as delay.
                            latency_s: (end - when).as_secs_f64(),
                            end,
                            answer,
                            case: case_ix,
                        }
                    }));
                }
                let mut sent = Vec::new();
                for t in tasks {
                    sent.push(t.await?);
                }
                let arm = Arm {
                    method,
                    ratio,
                    factor,
                    rate,
                };
                let point = summarize(plan, arm, start, &sent, &ds.cases);
                on_point(&point);
                out.push(point);
            }
        }
        anyhow::Ok(out)
    })
}

/// One run of the load test: a method at a ratio, offered `rate` requests/s (`factor` x the
/// measured capacity).
struct Arm {
    method: Method,
    ratio: f64,
    factor: f64,
    rate: f64,
}

fn summarize(
    plan: &LoadPlan,
    arm: Arm,
    start: Instant,
    sent: &[Sent],
    cases: &[Case],
) -> LoadPoint {
    let Arm {
        method,
        ratio,
        factor,
        rate,
    } = arm;
    let end = sent.iter().map(|s| s.end).max().unwrap_or(start);
    let duration_s = (end - start).as_secs_f64();
    let mut outcomes = Vec::new();
    let mut ttfts = Vec::new();
    for s in sent {
        if let (Some(200), Some(a)) = (s.status, &s.answer) {
            outcomes.push(RequestOutcome {
                score: metrics::best_f1(&a.answer, &cases[s.case].answers),
                latency_s: s.latency_s,
            });
            ttfts.push(a.timings.ttft_ms);
        }
    }
    let latencies: Vec<f64> = outcomes.iter().map(|o| o.latency_s).collect();
    let scores: Vec<f64> = outcomes.iter().map(|o| o.score).collect();
    let rejected = sent.iter().filter(|s| s.status == Some(429)).count();
    LoadPoint {
        pairing: plan.pairing,
        method,
        ratio,
        factor,
        rate_rps: rate,
        requests: sent.len(),
        ok: outcomes.len(),
        rejected,
        failed: sent.len() - outcomes.len() - rejected,
        duration_s,
        throughput_rps: if duration_s > 0.0 {
            outcomes.len() as f64 / duration_s
        } else {
            0.0
        },
        goodput_rps: metrics::goodput(&outcomes, plan.gamma, duration_s),
        gamma: plan.gamma,
        mean_score: metrics::mean(&scores),
        latency_p50_s: quantile(&latencies, 0.5),
        latency_p90_s: quantile(&latencies, 0.9),
        ttft_p50_ms: metrics::median(&ttfts),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisson_gaps_have_the_rate_and_are_seeded() {
        let a = poisson_arrivals(20_000, 4.0, 9);
        assert_eq!(a, poisson_arrivals(20_000, 4.0, 9));
        assert_ne!(a, poisson_arrivals(20_000, 4.0, 10));
        assert_eq!(a[0], 0.0);
        assert!(a.windows(2).all(|w| w[1] >= w[0]));
        let mean_gap = a[a.len() - 1] / (a.len() - 1) as f64;
        assert!((mean_gap - 0.25).abs() < 0.01, "mean gap {mean_gap}");
        // Exponential gaps: the standard deviation equals the mean.
        let gaps: Vec<f64> = a.windows(2).map(|w| w[1] - w[0]).collect();
        let var = gaps.iter().map(|g| (g - mean_gap).powi(2)).sum::<f64>() / gaps.len() as f64;
        assert!((var.sqrt() - 0.25).abs() < 0.015, "sd {}", var.sqrt());
    }

    #[test]
    fn quantiles_by_nearest_rank() {
        let v = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(quantile(&v, 0.5), 3.0);
        assert_eq!(quantile(&v, 0.9), 5.0);
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }
}
