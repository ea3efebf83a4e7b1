//! The official `openai` Python client (installed from PyPI by `scripts/setup-tests.sh`)
//! against the real `specrag serve` on tiny models: a plain completion, a streamed one, a
//! conversation, RAG options through `extra_body`, a bad request and a wrong key, each raising
//! or answering what the client documents (gateway/tests/openai_client.py).

mod common;

use common::tiny_server;
use std::path::Path;
use std::process::Command;

#[test]
fn the_official_openai_client_works_against_the_server() {
    let python = gateway::models::cache_dir().join("venv-openai/bin/python");
    assert!(
        python.is_file(),
        "{} is missing: run scripts/setup-tests.sh (the README's test command does)",
        python.display()
    );
    let tmp = tempfile::tempdir().expect("temp dir");
    let (_server, port, log) = tiny_server(tmp.path(), &["--api-key", "sk-test"]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let out = Command::new(&python)
        .arg(&script)
        .arg(format!("http://127.0.0.1:{port}/v1"))
        .arg("sk-test")
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.trim_end().ends_with("ok"),
        "the openai client failed:\n{stdout}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(&log).unwrap_or_default()
    );
}
