//! The web page at `/` in headless Chromium (Debian's `chromium` and `chromium-driver`, driven
//! by selenium from PyPI; `scripts/setup-tests.sh` installs them) against the real server on
//! tiny models: a question with "compare" on streams two answers with sources and TTFT bars; on
//! a server with keys the page asks for one first. The screenshot lands in
//! `$CARGO_TARGET_DIR/ci/web.png` (`target/ci/web.png`), which `.ci/run` names.

mod common;

use common::tiny_server;
use std::path::{Path, PathBuf};
use std::process::Command;

fn python() -> PathBuf {
    let python = gateway::models::cache_dir().join("venv-web/bin/python");
    assert!(
        python.is_file() && Path::new("/usr/bin/chromedriver").is_file(),
        "{} or /usr/bin/chromedriver is missing: run scripts/setup-tests.sh (the README's test \
         command does)",
        python.display()
    );
    python
}

fn drive(serve_args: &[&str], key: Option<&str>, shot: &Path) {
    let python = python();
    let tmp = tempfile::tempdir().expect("temp dir");
    let (_server, port, log) = tiny_server(tmp.path(), serve_args);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/web_page.py");
    let mut cmd = Command::new(&python);
    cmd.arg(&script)
        .arg(format!("http://127.0.0.1:{port}/"))
        .arg(shot);
    cmd.args(key);
    let out = cmd.output().expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.trim_end().ends_with("ok"),
        "the page test failed:\n{stdout}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(&log).unwrap_or_default()
    );
}

#[test]
fn the_web_page_streams_answers_sources_and_a_comparison_in_chromium() {
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"),
        PathBuf::from,
    );
    let dir = target.join("ci");
    std::fs::create_dir_all(&dir).expect("target/ci");
    let shot = dir.join("web.png");
    let _ = std::fs::remove_file(&shot);
    drive(&[], None, &shot);
    assert!(
        std::fs::metadata(&shot).is_ok_and(|m| m.len() > 10_000),
        "no screenshot at {}",
        shot.display()
    );
    let keyed = tempfile::tempdir().expect("temp dir");
    drive(
        &["--api-key", "sk-web"],
        Some("sk-web"),
        &keyed.path().join("keyed.png"),
    );
}
