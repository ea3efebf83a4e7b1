//! Fuzzes the HTTP API with schemathesis (installed from PyPI by `scripts/setup-tests.sh`)
//! against the OpenAPI document the server itself serves: any 5xx, or any response that does not
//! match the document, fails the test. The server is the real `specrag serve` binary on tiny
//! random-weight models, so hundreds of requests take seconds; the API surface, validation and
//! error paths are those of the default models.
//!
//! `SPECRAG_FUZZ_EXAMPLES` (default 40) sets schemathesis' examples per operation.

#![warn(clippy::too_many_lines, clippy::too_many_arguments)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_specrag");

/// Kills the server when the test ends, however it ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn schemathesis() -> PathBuf {
    let exe = gateway::models::cache_dir().join("venv-schemathesis/bin/schemathesis");
    assert!(
        exe.is_file(),
        "{} is missing: run scripts/setup-tests.sh (the README's test command does)",
        exe.display()
    );
    exe
}

fn run(cmd: &mut Command) {
    let out = cmd.output().expect("the specrag binary runs");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

fn wait_healthy(port: u16, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!(
        "the server did not listen within 30 s: {}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

#[test]
fn api_matches_its_openapi_document_under_fuzzing() {
    let exe = schemathesis();
    let examples = std::env::var("SPECRAG_FUZZ_EXAMPLES").unwrap_or_else(|_| "40".into());
    let tmp = tempfile::tempdir().expect("temp dir");
    let models = tmp.path().join("models");
    let data = tmp.path().join("data");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    run(Command::new(BIN).arg("tiny-models").arg(&models));
    let model_args = [
        "--target".into(),
        models.join("target.gguf"),
        "--speculator".into(),
        models.join("speculator.gguf"),
    ];
    run(Command::new(BIN)
        .args(&model_args)
        .arg("ingest")
        .arg("--data")
        .arg(&data)
        .arg(root.join("README.md"))
        .arg(root.join("ARCHITECTURE.md")));
    let port = free_port();
    let log = tmp.path().join("server.log");
    let child = Command::new(BIN)
        .args(&model_args)
        .args(["serve", "--queue", "256", "--timeout-secs", "60"])
        .arg("--data")
        .arg(&data)
        .arg("--addr")
        .arg(format!("127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("specrag serve starts");
    let _server = Server(child);
    wait_healthy(port, &log);
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
