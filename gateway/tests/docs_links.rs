//! The README is a front door (issue 40): at most 15,000 characters, and every relative link in
//! it and in the other documents (and every `../` path written as code) resolves to a file of
//! this repository: a clone has nothing beside it, so no reference leaves the repository. The
//! README's figures are written in the documents it cites, and eval/study holds only the
//! records the documents cite, by topic and indexed.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The Markdown documents: README, ARCHITECTURE, CONTRIBUTING, everything under docs/ and the
/// measurement reports under eval/study/.
fn documents() -> Vec<PathBuf> {
    let root = root();
    let mut out: Vec<PathBuf> = ["README.md", "ARCHITECTURE.md", "CONTRIBUTING.md"]
        .iter()
        .map(|f| root.join(f))
        .collect();
    let mut dirs = vec![root.join("docs"), root.join("eval/study")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("the directory lists") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    out
}

/// The lines of markdown `text` outside fenced code blocks.
fn unfenced_lines(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|line| {
            if line.trim_start().starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}

/// The targets of the `[text](target)` links outside fenced code.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for mut rest in unfenced_lines(text) {
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    out
}

/// Inline code spans holding a relative path that starts with `../` (outside fenced code).
fn climbing_paths(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in unfenced_lines(text) {
        for (i, span) in line.split('`').enumerate() {
            let path_like = !span.contains(char::is_whitespace) && span.starts_with("../");
            if i % 2 == 1 && path_like {
                out.push(span.to_string());
            }
        }
    }
    out
}

#[test]
fn the_readme_is_a_front_door() {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README.md");
    assert!(
        readme.len() <= 10_000,
        "README.md is {} bytes; move details to docs/",
        readme.len()
    );
}

/// ARCHITECTURE.md is the map (issue 89): crates, the road of a request, where each concept
/// lives and how the structure is checked, not the history of how it got there.
#[test]
fn the_architecture_is_a_map() {
    let map = std::fs::metadata(root().join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    assert!(
        map.len() <= 15_000,
        "ARCHITECTURE.md is {} bytes; the map, not the history",
        map.len()
    );
}

/// Docs say what is true now (issue 58): performance by topic within 20 kB, no study records
/// over 1 MB under docs/ (they live in eval/study/), and no document or source file speaks of
/// work periods (the word is [`WORK_PERIOD`]); history is git's.
/// The word for a work period that no document or source file may use, spelled so that this
/// file does not use it either.
const WORK_PERIOD: &str = concat!("sit", "ting");

#[test]
fn the_docs_say_what_is_true_now() {
    let root = root();
    let perf = std::fs::metadata(root.join("docs/performance.md")).expect("performance.md");
    assert!(
        perf.len() <= 20_000,
        "docs/performance.md is {} bytes: current facts by topic, history in git",
        perf.len()
    );
    let guard = std::fs::metadata(root.join("docs/fidelity-guard.md")).expect("fidelity-guard.md");
    assert!(
        guard.len() <= 30_000,
        "docs/fidelity-guard.md is {} bytes: what the guard does now, by topic; the history of \
         its measurements is git's",
        guard.len()
    );
    let mut dirs = vec![root.join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("docs/ lists") {
            let path = entry.expect("an entry").path();
            let meta = std::fs::metadata(&path).expect("metadata");
            if meta.is_dir() {
                dirs.push(path);
            } else {
                assert!(
                    meta.len() <= 1 << 20,
                    "{} is {} bytes; records belong in eval/study/",
                    path.display(),
                    meta.len()
                );
            }
        }
    }
    // Every text file of the repository outside the datasets (eval/data holds Wikipedia text,
    // where the word is ordinary English).
    let mut dirs = vec![root.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("a directory lists") {
            let path = entry.expect("an entry").path();
            let rel = path.strip_prefix(&root).expect("under the root");
            let name = rel.to_string_lossy();
            let skip = name.starts_with('.')
                || [
                    "target",
                    "models",
                    "data",
                    "out",
                    "big",
                    "exp",
                    "eval-results",
                    "eval/data",
                ]
                .contains(&name.as_ref());
            let text_file = path.extension().is_some_and(|e| {
                ["md", "rs", "py", "sh", "toml", "html", "js"]
                    .contains(&e.to_str().unwrap_or_default())
            });
            if skip {
                continue;
            }
            if path.is_dir() {
                dirs.push(path);
            } else if let Some(text) = text_file
                .then(|| std::fs::read_to_string(&path).ok())
                .flatten()
            {
                assert!(
                    !text.to_lowercase().contains(WORK_PERIOD),
                    "{} speaks of work periods; say what is true now and its date",
                    rel.display()
                );
            }
        }
    }
}

#[test]
fn every_relative_link_resolves_inside_the_repository() {
    let root = root().canonicalize().expect("the repository");
    let mut broken = Vec::new();
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).expect("a document");
        // Links, and paths written as code that climb out of their folder (the README once
        // sent readers to a design brief beside the repository, which a clone lacks).
        for target in links(&text).into_iter().chain(climbing_paths(&text)) {
            let path = target.split('#').next().unwrap_or_default();
            if path.is_empty() || path.contains("://") || path.starts_with("mailto:") {
                continue;
            }
            let resolved = doc.parent().unwrap_or(&root).join(path).canonicalize();
            match resolved {
                Ok(p) if p.starts_with(&root) => {}
                _ => broken.push(format!("{}: {target}", doc.display())),
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// The study's records are curated (issue 89): at most [`STUDY_BYTES`] under eval/study/, in
/// folders by topic (nothing beside the index at the top), and every record is listed in the
/// index with the claim it backs, so nothing stays that no document needs; git keeps the rest.
const STUDY_BYTES: u64 = 5_000_000;

#[test]
fn the_study_records_are_few_by_topic_and_indexed() {
    let study = root().join("eval/study");
    let index = std::fs::read_to_string(study.join("README.md")).expect("eval/study/README.md");
    let mut total = 0;
    let mut loose = Vec::new();
    let mut unlisted = Vec::new();
    let mut dirs = vec![study.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("a directory lists") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            total += std::fs::metadata(&path).expect("metadata").len();
            let name = path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .to_string();
            if dir == study {
                if name != "README.md" {
                    loose.push(name);
                }
            } else if name != "README.md" && !index.contains(name.trim_end_matches(".jsonl.gz")) {
                unlisted.push(path.display().to_string());
            }
        }
    }
    assert!(
        total <= STUDY_BYTES,
        "eval/study holds {total} bytes; keep the records today's docs cite, git keeps the rest"
    );
    assert!(
        loose.is_empty(),
        "records outside a topic folder: {loose:?}"
    );
    assert!(
        unlisted.is_empty(),
        "records eval/study/README.md does not list: {unlisted:?}"
    );
}

/// Whether `token` is a figure: a decimal, a ratio (`1.21x`), a share (`95%`) or a range of
/// them (`0.24-0.26x`). Bare integers (counts, sizes, years) are too common to tell anything.
fn is_figure(token: &str) -> bool {
    let body = token.strip_suffix(['x', '%']).unwrap_or(token);
    let number = |s: &str| {
        let mut parts = s.split('.');
        let whole = parts.next().unwrap_or_default();
        let frac = parts.next();
        !whole.is_empty()
            && whole.bytes().all(|b| b.is_ascii_digit())
            && frac.is_none_or(|f| !f.is_empty() && f.bytes().all(|b| b.is_ascii_digit()))
            && parts.next().is_none()
    };
    let range = match body.split_once('-') {
        Some((a, b)) => number(a) && number(b),
        None => number(body),
    };
    range && (token.len() > body.len() || body.contains('.'))
}

/// The figures of `text`, as written (`0.24-0.26x`, `95%`, `0.38`).
fn figures(text: &str) -> Vec<&str> {
    text.split(|c: char| c.is_whitespace() || "()[]{}*,;:`\"'<>|~".contains(c))
        .map(|t| t.trim_end_matches('.'))
        .filter(|t| is_figure(t))
        .collect()
}

/// The figures of `paragraph` that none of `docs` (the texts it links) writes.
fn figures_missing_from<'a>(paragraph: &'a str, docs: &[String]) -> Vec<&'a str> {
    figures(paragraph)
        .into_iter()
        .filter(|f| !docs.iter().any(|d| figures(d).contains(f)))
        .collect()
}

/// The README's paragraphs (blank-line separated, outside fenced code) with the Markdown
/// documents of this repository they link.
fn readme_paragraphs_and_their_docs() -> Vec<(String, Vec<String>)> {
    let root = root();
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let text = unfenced_lines(&readme).join("\n");
    text.split("\n\n")
        .map(|paragraph| {
            let docs = links(paragraph)
                .iter()
                .map(|t| t.split('#').next().unwrap_or_default().to_string())
                .filter(|t| t.ends_with(".md") && !t.contains("://"))
                .map(|t| std::fs::read_to_string(root.join(&t)).unwrap_or_default())
                .collect();
            (paragraph.to_string(), docs)
        })
        .collect()
}

/// The README quotes figures from the docs (issue 89): each figure of a README paragraph that
/// links a document is written, as is, in one of the documents it links, so a figure changed
/// in one place only fails here.
#[test]
fn the_readmes_figures_are_the_docs_it_cites() {
    let mut checked = 0;
    let mut missing = Vec::new();
    for (paragraph, docs) in readme_paragraphs_and_their_docs() {
        if docs.is_empty() {
            continue;
        }
        checked += figures(&paragraph).len();
        for f in figures_missing_from(&paragraph, &docs) {
            let start: String = paragraph.chars().take(60).collect();
            missing.push(format!("{f} (in \"{start}…\")"));
        }
    }
    assert!(
        missing.is_empty(),
        "README figures that the documents their paragraph links do not write: {missing:?}"
    );
    // The README's llama-server and guard paragraphs alone quote more than this many.
    assert!(
        checked >= 10,
        "only {checked} figures checked: is the parser still reading them?"
    );
}

#[test]
fn a_figure_changed_on_one_side_is_seen() {
    let paragraph = "specrag answers in 0.24-0.26x its time, 95% the same, at 2 cores ([p](p.md)).";
    assert_eq!(figures(paragraph), ["0.24-0.26x", "95%"]);
    let same = ["a table: | 0.24-0.26x | 95% [90, 98] |".to_string()];
    assert!(figures_missing_from(paragraph, &same).is_empty());
    let changed = ["a table: | 0.24-0.27x | 95% [90, 98] |".to_string()];
    assert_eq!(figures_missing_from(paragraph, &changed), ["0.24-0.26x"]);
    for not_a_figure in [
        "2",
        "2-core",
        "Qwen2.5-Coder-1.5B",
        "1.5B",
        "8k-32k",
        "x",
        "v1.2.3",
    ] {
        assert!(!is_figure(not_a_figure), "{not_a_figure}");
    }
}
