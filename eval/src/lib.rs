//! The evaluation harness behind `specrag-eval`: how much faster each KV-reuse method
//! answers and how much worse, the way SpecCache and CacheBlend report it.
//!
//! - [`datasets`]: seeded bridge-entity and needle cases, LongBench and query JSONL loaders.
//! - [`real`]: the committed real-text datasets (multi-hop QA, questions on the docs) by name.
//! - [`profiles`]: seeded multi-hop cases over long profiles, and lookups over alike records.
//! - [`method`]: the evaluation's catalogue of methods: the served ones and its own.
//! - [`selectors`]: its own selectors (ablations of `target_probe`, the oracle bound, the
//!   random floor) and the blend measurement, built from the engine's public pieces.
//! - [`plan`]: the method configurations, pairings and the quick / default budgets.
//! - [`forcing`]: what the evaluation varies on a query ([`forcing::Knobs`]) and teacher
//!   forcing over the prefill it kept.
//! - [`run`]: ingestion of each case and its answers through `gateway::pipeline`, scored
//!   against gold answers and full recompute.
//! - [`load`]: Poisson arrivals through the real HTTP server; throughput and goodput.
//! - [`report`]: summaries, the ρ = 1 identity check, the Markdown report and SVG charts.
//! - [`metrics`], [`plot`]: LongBench's scoring and dependency-free charts (pure functions).
//! - [`stats`]: paired bootstrap intervals, exact McNemar, Wilson intervals, logit KL / NLL.

pub mod datasets;
pub mod forcing;
pub mod load;
pub mod method;
pub mod metrics;
pub mod plan;
pub mod plot;
pub mod profiles;
pub mod real;
pub mod report;
pub mod run;
pub mod selectors;
pub mod stats;
pub mod study;
pub mod sysinfo;
