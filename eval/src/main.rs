//! `specrag-eval`: quality, fidelity and latency of every reuse method (issue 7).
//!
//! Status: not implemented yet. The binary says so and exits with an error rather than print
//! numbers it did not measure.

fn main() {
    eprintln!("specrag-eval: the evaluation harness is not implemented yet (see issue 7)");
    std::process::exit(2);
}
