//! Helpers shared by the HTTP test files.
#![allow(dead_code)] // each test file uses a different subset

use gateway::corpus::{Corpus, Engines};
use gateway::http::{AppState, ServerConfig};
use gateway::pipeline::{Pipeline, ScoreSource};
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
    tiny_server_with(dir, &[], serve_args)
}

/// [`tiny_server`] with `data_args` given to both `ingest` and `serve` (e.g. `--kv-remote`).
pub fn tiny_server_with(
    dir: &Path,
    data_args: &[&str],
    serve_args: &[&str],
) -> (Server, u16, std::path::PathBuf) {
    let model_args = tiny_models(dir);
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    run(Command::new(BIN)
        .args(&model_args)
        .arg("ingest")
        .args(data_args)
        .arg("--data")
        .arg(dir.join("data"))
        .arg(root.join("README.md"))
        .arg(root.join("ARCHITECTURE.md")));
    serve(dir, &model_args, data_args, serve_args)
}

/// Tiny random models in `dir/models`; the `--target`/`--speculator` arguments naming them.
pub fn tiny_models(dir: &Path) -> Vec<std::ffi::OsString> {
    let models = dir.join("models");
    run(Command::new(BIN).arg("tiny-models").arg(&models));
    vec![
        "--target".into(),
        models.join("target.gguf").into(),
        "--speculator".into(),
        models.join("speculator.gguf").into(),
    ]
}

/// `specrag serve` on the data directory `dir/data` (created empty if missing), on a free
/// loopback port: the server, its port and its log file.
pub fn serve(
    dir: &Path,
    model_args: &[std::ffi::OsString],
    data_args: &[&str],
    serve_args: &[&str],
) -> (Server, u16, std::path::PathBuf) {
    std::fs::create_dir_all(dir).expect("node directory");
    let port = free_port();
    let log = dir.join("server.log");
    let child = Command::new(BIN)
        .args(model_args)
        .args(["serve", "--timeout-secs", "60"])
        .args(serve_args)
        .args(data_args)
        .arg("--data")
        .arg(dir.join("data"))
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

/// A `redis-server` (Debian's package, installed by `scripts/setup-tests.sh`) on a free
/// loopback port with no persistence, killed when dropped; answers PING before this returns.
pub fn redis_server(dir: &Path) -> (Server, u16) {
    let port = free_port();
    (redis_on(dir, port), port)
}

/// [`redis_server`] on a given port (a restart).
pub fn redis_on(dir: &Path, port: u16) -> Server {
    assert!(
        Path::new("/usr/bin/redis-server").is_file(),
        "/usr/bin/redis-server is missing: run scripts/setup-tests.sh (the README's test command does)"
    );
    let child = Command::new("/usr/bin/redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ])
        .args(["--appendonly", "no", "--dir"])
        .arg(dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("redis-server starts");
    let server = Server(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            use std::io::{Read, Write};
            let mut buf = [0u8; 7];
            if s.write_all(b"PING\r\n").is_ok()
                && s.read_exact(&mut buf).is_ok()
                && &buf == b"+PONG\r\n"
            {
                return server;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("redis-server did not answer on port {port}");
}

/// Four short documents over the tiny models' vocabulary: what the tiny-model server tests
/// ingest.
pub const TINY_DOCS: [(&str, &str); 4] = [
    (
        "ants",
        "The thin ant ran in the sand and then the ant sat in the tent.",
    ),
    (
        "attic",
        "A hint: the antenna is in the attic near the tent, behind the tin.",
    ),
    (
        "anthem",
        "The anthem of the ant hill is sung at dawn by the thin ants.",
    ),
    (
        "tin",
        "The tin can in the attic holds ten thin nails and an antenna.",
    ),
];
