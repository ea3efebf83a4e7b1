//! No import cycle between the modules of any crate of the workspace (issues 40 and 58):
//! `scripts/module-loops.py` lists every `crate::`/`super::` dependency between a library's
//! files and fails on a cycle.

const CRATES: [&str; 7] = [
    "chunkstore",
    "eval",
    "gateway",
    "kernels",
    "retriever",
    "speculator",
    "target-engine",
];

#[test]
fn every_crates_modules_import_one_way() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for krate in CRATES {
        let out = std::process::Command::new("python3")
            .arg(root.join("scripts/module-loops.py"))
            .arg(root.join(krate).join("src"))
            .output()
            .expect("python3 runs (scripts/setup-tests.sh needs it too)");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{krate}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains(" 0 cycles"), "{krate}: {stdout}");
    }
}
