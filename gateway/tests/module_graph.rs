//! No import cycle between the modules of any crate's library (issues 40, 58 and 89):
//! `scripts/module-loops.py` lists the dependencies between a library's files that it can see
//! in the source text (`crate::`/`super::` paths, grouped and glob imports, a parent naming its
//! children's items; not a macro's expansion, a type reached through a re-export, or a path
//! written without `crate::`/`super::` to a module that is not a direct child) and fails on a
//! cycle. `test_script_sees_grouped_imports_and_parent_child_loops` holds the script to that.

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

/// The script sees what it claims to: a child importing its parent's items with a grouped
/// import or a glob, while the parent calls into the child, is a cycle; a child importing a
/// leaf sibling is not.
#[test]
fn test_script_sees_grouped_imports_and_parent_child_loops() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let run = |files: &[(&str, &str)]| -> String {
        let dir = tempfile::tempdir().expect("temp dir");
        for (path, text) in files {
            let p = dir.path().join(path);
            std::fs::create_dir_all(p.parent().expect("parent")).expect("dir");
            std::fs::write(p, text).expect("write");
        }
        let out = std::process::Command::new("python3")
            .arg(root.join("scripts/module-loops.py"))
            .arg(dir.path())
            .output()
            .expect("python3 runs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let parent = "mod kid;\npub fn run() { kid::go() }\npub struct Shape;\n";
    for import in [
        "use super::{Shape, run};",
        "use super::*;",
        "use super::Shape;",
    ] {
        let out = run(&[
            ("lib.rs", "mod a;"),
            ("a.rs", parent),
            ("a/kid.rs", &format!("{import}\npub fn go() {{}}\n")),
        ]);
        assert!(out.contains("cycle: a -> a::kid -> a"), "{import}: {out}");
    }
    let out = run(&[
        ("lib.rs", "mod a;"),
        ("a.rs", "mod kid;\nmod leaf;\npub fn run() { kid::go() }\n"),
        ("a/leaf.rs", "pub struct Shape;\n"),
        (
            "a/kid.rs",
            "use super::leaf::Shape;\npub fn go() { let _ = Shape; }\n",
        ),
    ]);
    assert!(out.contains(" 0 cycles"), "{out}");
}
