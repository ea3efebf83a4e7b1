//! Evaluation building blocks for `specrag-eval`: answer-quality metrics computed exactly as
//! LongBench computes them, and dependency-free SVG charts for the report.
//!
//! Both modules are pure functions over plain data (no model, no I/O), so the binary can score
//! and plot results it loaded from anywhere, and the numbers can be checked against LongBench's
//! Python scorer case by case.

pub mod datasets;
pub mod metrics;
pub mod plot;
