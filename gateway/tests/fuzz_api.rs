//! Fuzzes the HTTP API with schemathesis (installed from PyPI by `scripts/setup-tests.sh`)
//! against the OpenAPI document the server itself serves: any 5xx, or any response that does not
//! match the document, fails the test. The server is the real `specrag serve` binary on tiny
//! random-weight models, so hundreds of requests take seconds; the API surface, validation and
//! error paths are those of the default models.
//!
//! `SPECRAG_FUZZ_EXAMPLES` (default 40) sets schemathesis' examples per operation.

mod common;

use common::tiny_server;
use std::path::{Path, PathBuf};
use std::process::Command;

fn schemathesis() -> PathBuf {
    let exe = gateway::models::cache_dir().join("venv-schemathesis/bin/schemathesis");
    assert!(
        exe.is_file(),
        "{} is missing: run scripts/setup-tests.sh (the README's test command does)",
        exe.display()
    );
    exe
}

#[test]
fn api_matches_its_openapi_document_under_fuzzing() {
    let exe = schemathesis();
    let examples = std::env::var("SPECRAG_FUZZ_EXAMPLES").unwrap_or_else(|_| "40".into());
    let tmp = tempfile::tempdir().expect("temp dir");
    let (_server, port, log) = tiny_server(tmp.path(), &["--queue", "256"]);
    // schemathesis keeps state in its working directory: keep it out of the source tree.
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/schemathesis.toml");
    let out = Command::new(&exe)
        .current_dir(tmp.path())
        .arg("--config-file")
        .arg(&config)
        .args(["run", &format!("http://127.0.0.1:{port}/openapi.json")])
        .args([
            "--checks",
            "all",
            "--max-examples",
            &examples,
            "--seed",
            "1",
        ])
        .arg("--no-color")
        .output()
        .expect("schemathesis runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "schemathesis found failures:\n{stdout}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    // The summary names how many cases ran: a run that tested nothing must not pass.
    assert!(
        stdout.contains("passed"),
        "schemathesis reported no passed checks:\n{stdout}"
    );
}
