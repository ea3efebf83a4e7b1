//! No import cycle between the gateway's modules (issue 40): `scripts/module-loops.py` lists
//! every `crate::`/`super::` dependency between the library's files and fails on a cycle.

#[test]
fn the_gateway_modules_import_one_way() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("python3")
        .arg(root.join("../scripts/module-loops.py"))
        .arg(root.join("src"))
        .output()
        .expect("python3 runs (scripts/setup-tests.sh needs it too)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(" 0 cycles"), "{stdout}");
}
