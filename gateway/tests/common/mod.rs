//! Helpers shared by the HTTP test files.
#![allow(dead_code)] // each test file uses a different subset

use gateway::corpus::{Corpus, Engines};
use gateway::pipeline::{Pipeline, ScoreSource};
use gateway::server::{AppState, ServerConfig};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};
use target_engine::testing::{write_tiny_gguf, TinySpec};
use target_engine::{Architecture, LoadOptions, Model};

/// Result of a test body.
pub type TestResult = Result<(), Box<dyn std::error::Error>>;

/// A server over an empty corpus on a tiny target (no speculator).
pub fn server(
    dir: &std::path::Path,
    config: ServerConfig,
) -> Result<AppState, Box<dyn std::error::Error>> {
    let target = dir.join("target.gguf");
    write_tiny_gguf(&target, &TinySpec::new(Architecture::Qwen2))?;
    let engines = Engines::new(
        Arc::new(Model::load(&target, &LoadOptions::default())?),
        None,
    )?;
    let corpus = Corpus::open(&dir.join("data"), 1 << 30)?;
    let pipeline = Arc::new(Pipeline::new(engines, corpus, ScoreSource::Query));
    Ok(AppState::new(pipeline, config))
}

/// The `specrag` binary of this build.
pub const BIN: &str = env!("CARGO_BIN_EXE_specrag");

/// Kills the server when the test ends, however it ends.
pub struct Server(pub Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn run(cmd: &mut Command) {
    let out = cmd.output().expect("the specrag binary runs");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

pub fn wait_healthy(port: u16, log: &Path) {
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

/// `specrag serve` (the real binary) on tiny random models over this repository's README and
/// ARCHITECTURE.md, on a free loopback port: the server (killed when dropped), its port and
/// its log file. `serve_args` come after `serve`.
pub fn tiny_server(dir: &Path, serve_args: &[&str]) -> (Server, u16, std::path::PathBuf) {
    let models = dir.join("models");
    let data = dir.join("data");
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
    let log = dir.join("server.log");
    let child = Command::new(BIN)
        .args(&model_args)
        .args(["serve", "--timeout-secs", "60"])
        .args(serve_args)
        .arg("--data")
        .arg(&data)
        .arg("--addr")
        .arg(format!("127.0.0.1:{port}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("specrag serve starts");
    let server = Server(child);
    wait_healthy(port, &log);
    (server, port, log)
}
