//! Reading documents to ingest: files and folders (recursive) of `.txt`, `.md` and `.jsonl`
//! (`{"id","title"?,"text"}` per line). Every problem names its file (and line) and the rest of
//! the input goes on.

use serde::Deserialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// One document to ingest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceDoc {
    pub id: String,
    pub title: Option<String>,
    pub text: String,
    /// Where it came from: `file` or `file:line`.
    pub origin: String,
}

/// A document (or file) that could not be read, with the place and the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputProblem {
    pub origin: String,
    pub message: String,
}

impl std::fmt::Display for InputProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.origin, self.message)
    }
}

/// What reading the inputs produced.
#[derive(Debug, Default)]
pub struct Inputs {
    pub docs: Vec<SourceDoc>,
    pub problems: Vec<InputProblem>,
    /// Files inside folders that were skipped for their extension.
    pub skipped: usize,
}

/// A JSONL line. Unknown fields are ignored so files carrying metadata can be used as is.
#[derive(Debug, Deserialize)]
struct JsonDoc {
    id: serde_json::Value,
    #[serde(default)]
    title: Option<String>,
    text: String,
}

const EXTENSIONS: [&str; 3] = ["txt", "md", "jsonl"];

fn extension(path: &Path) -> Option<String> {
    path.extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase())
}

/// Every file under `paths`, folders walked recursively in name order.
fn collect_files(paths: &[PathBuf], out: &mut Inputs) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut stack: Vec<(PathBuf, bool)> = paths.iter().rev().map(|p| (p.clone(), true)).collect();
    while let Some((path, explicit)) = stack.pop() {
        let origin = path.display().to_string();
        // Inside folders, links are not followed (a link to a parent folder would loop).
        let meta = if explicit {
            std::fs::metadata(&path)
        } else {
            std::fs::symlink_metadata(&path)
        };
        let meta = match meta {
            Ok(m) => m,
            Err(e) => {
                out.problems.push(InputProblem {
                    origin,
                    message: format!("cannot read: {e}"),
                });
                continue;
            }
        };
        if !explicit && meta.is_symlink() && std::fs::metadata(&path).is_ok_and(|m| m.is_dir()) {
            // Followed, a link to a parent folder would loop: say so rather than skip it unseen.
            out.problems.push(InputProblem {
                origin,
                message: "a link to a folder, not followed inside a folder (give the folder \
                          itself as an argument)"
                    .into(),
            });
            continue;
        }
        if meta.is_dir() {
            let mut entries: Vec<PathBuf> = match std::fs::read_dir(&path) {
                Ok(rd) => rd.filter_map(|e| e.ok().map(|e| e.path())).collect(),
                Err(e) => {
                    out.problems.push(InputProblem {
                        origin,
                        message: format!("cannot list folder: {e}"),
                    });
                    continue;
                }
            };
            entries.sort();
            stack.extend(entries.into_iter().rev().map(|p| (p, false)));
        } else if extension(&path).is_some_and(|e| EXTENSIONS.contains(&e.as_str())) {
            files.push(path);
        } else if explicit {
            out.problems.push(InputProblem {
                origin,
                message: "unsupported file type (expected .txt, .md or .jsonl)".into(),
            });
        } else {
            out.skipped += 1;
        }
    }
    files
}

/// The first Markdown heading, if the text starts with one.
fn markdown_title(text: &str) -> Option<String> {
    let first = text.lines().find(|l| !l.trim().is_empty())?;
    let t = first.trim_start().strip_prefix('#')?;
    let t = t.trim_start_matches('#').trim();
    (!t.is_empty()).then(|| t.to_string())
}

/// Largest file read (a bound on memory whatever a path points at); larger: split it.
pub const MAX_FILE_BYTES: u64 = 1 << 30;

/// A file's text, or the problem that keeps it out (not a regular file, over
/// [`MAX_FILE_BYTES`], unreadable, or not UTF-8, with the line of the first bad byte). A
/// UTF-8 byte order mark is dropped.
fn read_utf8(file: &Path) -> Result<String, InputProblem> {
    let origin = file.display().to_string();
    let problem = |message: String| InputProblem {
        origin: origin.clone(),
        message,
    };
    let meta = std::fs::metadata(file).map_err(|e| problem(format!("cannot read: {e}")))?;
    // A FIFO would block the read for ever, a device (`/dev/zero`) never end.
    if !meta.is_file() {
        return Err(problem(
            "not a regular file (a FIFO, device or socket); give a file or a folder".into(),
        ));
    }
    let mut bytes = Vec::new();
    let read = std::fs::File::open(file).and_then(|f| {
        std::io::Read::read_to_end(&mut std::io::Read::take(f, MAX_FILE_BYTES + 1), &mut bytes)
    });
    read.map_err(|e| problem(format!("cannot read: {e}")))?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(problem(format!(
            "larger than {} MiB; split it into several files",
            MAX_FILE_BYTES >> 20
        )));
    }
    if bytes.starts_with(b"\xEF\xBB\xBF") {
        bytes.drain(..3);
    }
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let line = 1 + e.as_bytes()[..at].iter().filter(|&&b| b == b'\n').count();
        InputProblem {
            origin: format!("{origin}:{line}"),
            message: format!("not valid UTF-8 (byte {at}); convert the file to UTF-8"),
        }
    })
}

/// Reads every document under `paths`. Document ids of `.txt` / `.md` files are their paths
/// relative to the folder given (or the file name for a file given directly).
pub fn read_inputs(paths: &[PathBuf]) -> Inputs {
    let mut out = Inputs::default();
    let mut seen: HashMap<String, String> = HashMap::new();
    let files = collect_files(paths, &mut out);
    for file in files {
        let origin = file.display().to_string();
        let text = match read_utf8(&file) {
            Ok(t) => t,
            Err(problem) => {
                out.problems.push(problem);
                continue;
            }
        };
        let mut push = |doc: SourceDoc, out: &mut Inputs| {
            if let Some(first) = seen.get(&doc.id) {
                out.problems.push(InputProblem {
                    origin: doc.origin.clone(),
                    message: format!("duplicate document id `{}` (first seen at {first})", doc.id),
                });
            } else {
                seen.insert(doc.id.clone(), doc.origin.clone());
                out.docs.push(doc);
            }
        };
        if extension(&file).as_deref() == Some("jsonl") {
            if text.trim().is_empty() {
                out.problems.push(InputProblem {
                    origin,
                    message: "no documents (the file is empty)".into(),
                });
                continue;
            }
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let origin = format!("{origin}:{}", i + 1);
                match parse_json_line(line) {
                    Ok((id, title, text)) => push(
                        SourceDoc {
                            id,
                            title,
                            text,
                            origin,
                        },
                        &mut out,
                    ),
                    Err(message) => out.problems.push(InputProblem { origin, message }),
                }
            }
        } else {
            match text_document(paths, &file, origin, text) {
                Ok(doc) => push(doc, &mut out),
                Err(problem) => out.problems.push(problem),
            }
        }
    }
    out
}

/// A `.txt` / `.md` file's document: its id the path under the folder given, its title the
/// first Markdown heading or the file's stem.
fn text_document(
    roots: &[PathBuf],
    file: &Path,
    origin: String,
    text: String,
) -> Result<SourceDoc, InputProblem> {
    if text.trim().is_empty() {
        return Err(InputProblem {
            origin,
            message: "empty text".into(),
        });
    }
    let id = doc_id_for(roots, file);
    if let Some(why) = doc_id_problem(&id) {
        return Err(InputProblem {
            origin,
            message: format!(
                "its document id (the path under the folder given) {why}; \
                 ingest it from a folder nearer to it"
            ),
        });
    }
    let title = markdown_title(&text).or_else(|| {
        file.file_stem()
            .and_then(|s| s.to_str())
            .map(|s| s.to_string())
    });
    Ok(SourceDoc {
        id,
        title,
        text,
        origin,
    })
}

/// Longest document id, in characters, wherever a document gets one (`POST /documents`, a
/// JSONL line, a file's path under `specrag ingest`) and wherever one is named (`DELETE
/// /documents/{id}`): whatever is ingested can be deleted.
pub const MAX_DOC_ID_CHARS: usize = 512;

/// Why `id` cannot be a document id, if it cannot.
pub fn doc_id_problem(id: &str) -> Option<String> {
    if id.trim().is_empty() {
        return Some("must not be empty or only whitespace".into());
    }
    let chars = id.chars().count();
    (chars > MAX_DOC_ID_CHARS)
        .then(|| format!("must be at most {MAX_DOC_ID_CHARS} characters, got {chars}"))
}

/// `file` relative to the input folder that contains it, or its file name.
fn doc_id_for(roots: &[PathBuf], file: &Path) -> String {
    for root in roots {
        if root.is_dir() {
            if let Ok(rel) = file.strip_prefix(root) {
                return rel.to_string_lossy().replace('\\', "/");
            }
        }
    }
    file.file_name().map_or_else(
        || file.display().to_string(),
        |n| n.to_string_lossy().into(),
    )
}

/// Validates one JSONL line into (id, title, text); the error names the field at fault.
fn parse_json_line(line: &str) -> Result<(String, Option<String>, String), String> {
    let doc: JsonDoc = serde_json::from_str(line).map_err(|e| {
        format!("malformed JSON line ({e}); expected {{\"id\", \"title\"?, \"text\"}}")
    })?;
    let id = match doc.id {
        serde_json::Value::String(s) => s,
        serde_json::Value::Number(n) => n.to_string(),
        other => return Err(format!("field `id` must be a string, got {other}")),
    };
    if let Some(why) = doc_id_problem(&id) {
        return Err(format!("field `id` {why}"));
    }
    if doc.text.trim().is_empty() {
        return Err("field `text` is empty".into());
    }
    Ok((id, doc.title.filter(|t| !t.trim().is_empty()), doc.text))
}

/// The demo corpus under `root` (`specrag demo`'s default documents, also the evaluation's
/// `repo_docs`): README.md, ARCHITECTURE.md and docs/*.md, sorted.
pub fn demo_paths(root: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut paths = vec![root.join("README.md"), root.join("ARCHITECTURE.md")];
    if let Ok(dir) = std::fs::read_dir(root.join("docs")) {
        let mut md: Vec<std::path::PathBuf> = dir
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "md"))
            .collect();
        md.sort();
        paths.extend(md);
    }
    paths
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A document id is at most `MAX_DOC_ID_CHARS` characters however it is given (a JSONL
    /// line counted bytes, a file's path was not checked), so `DELETE /documents/{id}`, which
    /// takes that many, reaches every document ingested.
    #[test]
    fn document_ids_are_held_to_one_limit_in_characters() -> Result<(), Box<dyn std::error::Error>>
    {
        let dir = tempfile::tempdir()?;
        let root = dir.path().join("corpus");
        let deep = root.join("d".repeat(200)).join("e".repeat(200));
        std::fs::create_dir_all(&deep)?;
        std::fs::write(deep.join(format!("{}.md", "f".repeat(120))), "Deep text.")?;
        std::fs::write(root.join("near.md"), "Near text.")?;
        let wide = "é".repeat(MAX_DOC_ID_CHARS); // 1024 bytes, 512 characters
        let long = "x".repeat(MAX_DOC_ID_CHARS + 1);
        std::fs::write(
            root.join("ids.jsonl"),
            format!("{{\"id\":\"{wide}\",\"text\":\"a\"}}\n{{\"id\":\"{long}\",\"text\":\"b\"}}\n"),
        )?;
        let inputs = read_inputs(std::slice::from_ref(&root));
        let ids: Vec<&str> = inputs.docs.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, [wide.as_str(), "near.md"]);
        let problems: Vec<String> = inputs.problems.iter().map(|p| p.to_string()).collect();
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(
            problems[0].contains("ingest it from a folder nearer to it")
                && problems[0].contains("at most 512 characters, got 525"),
            "{problems:?}"
        );
        assert!(
            problems[1].contains("ids.jsonl:2: field `id` must be at most 512 characters, got 513"),
            "{problems:?}"
        );
        Ok(())
    }

    #[test]
    fn every_bad_input_is_named_and_the_rest_goes_on() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let root = dir.path().join("corpus");
        std::fs::create_dir_all(root.join("sub"))?;
        std::fs::write(root.join("a.md"), "# Alpha\n\nText of a.")?;
        std::fs::write(root.join("sub/b.txt"), "Text of b.")?;
        std::fs::write(root.join("empty.txt"), "  \n")?;
        std::fs::write(root.join("bin.txt"), b"ok\n\xff\xfe")?;
        std::fs::write(root.join("image.png"), b"\x89PNG")?;
        std::fs::write(
            root.join("docs.jsonl"),
            concat!(
                "{\"id\":\"j1\",\"title\":\"J\",\"text\":\"one\"}\n",
                "\n",
                "{\"id\":\"j2\",\"text\":\"two\",\"lang\":\"en\"}\n",
                "{not json}\n",
                "{\"id\":\"j3\",\"text\":\"\"}\n",
                "{\"title\":\"no id\",\"text\":\"x\"}\n",
                "{\"id\":\"j1\",\"text\":\"dup\"}\n",
                "{\"id\":7,\"text\":\"numeric id\"}\n",
            ),
        )?;
        let inputs = read_inputs(std::slice::from_ref(&root));
        let ids: Vec<&str> = inputs.docs.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["a.md", "j1", "j2", "7", "sub/b.txt"]);
        assert_eq!(inputs.docs[0].title.as_deref(), Some("Alpha"));
        assert_eq!(inputs.skipped, 1, "the png");
        let problems: Vec<String> = inputs.problems.iter().map(|p| p.to_string()).collect();
        let has = |needle: &str| problems.iter().any(|p| p.contains(needle));
        assert!(has("bin.txt:2: not valid UTF-8"), "{problems:?}");
        assert!(has("empty.txt: empty text"), "{problems:?}");
        assert!(has("docs.jsonl:4: malformed JSON line"), "{problems:?}");
        assert!(has("docs.jsonl:5: field `text` is empty"), "{problems:?}");
        assert!(
            has("docs.jsonl:6: malformed JSON line (missing field `id`"),
            "{problems:?}"
        );
        assert!(
            has("docs.jsonl:7: duplicate document id `j1` (first seen at"),
            "{problems:?}"
        );
        assert_eq!(problems.len(), 6, "{problems:?}");
        // An explicit file of another type is a problem, a missing path too.
        let inputs = read_inputs(&[root.join("image.png"), root.join("missing.txt")]);
        assert!(inputs.docs.is_empty());
        assert_eq!(inputs.problems.len(), 2);
        Ok(())
    }

    /// Paths that would hang or exhaust a reader are named, never read: a FIFO (blocks for
    /// ever), a device (never ends); a link to a folder inside a folder is named, not skipped
    /// unseen; a byte order mark is dropped; an empty `.jsonl` is a problem.
    #[cfg(unix)]
    #[test]
    fn special_files_and_linked_folders_are_named_not_read(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let root = dir.path().join("corpus");
        let other = dir.path().join("other");
        std::fs::create_dir_all(&root)?;
        std::fs::create_dir_all(&other)?;
        std::fs::write(other.join("c.md"), "Text of c.")?;
        std::fs::write(root.join("bom.txt"), b"\xEF\xBB\xBFText after a BOM.")?;
        std::fs::write(root.join("none.jsonl"), "\n")?;
        std::os::unix::fs::symlink(&other, root.join("linked"))?;
        std::os::unix::fs::symlink("/dev/zero", root.join("zero.md"))?;
        let fifo = root.join("pipe.md");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status()?;
        assert!(made.success());
        let inputs = read_inputs(std::slice::from_ref(&root));
        let ids: Vec<&str> = inputs.docs.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["bom.txt"]);
        assert_eq!(inputs.docs[0].text, "Text after a BOM.");
        let problems: Vec<String> = inputs.problems.iter().map(|p| p.to_string()).collect();
        let has = |needle: &str| problems.iter().any(|p| p.contains(needle));
        assert!(has("linked: a link to a folder"), "{problems:?}");
        assert!(has("zero.md: not a regular file"), "{problems:?}");
        assert!(has("pipe.md: not a regular file"), "{problems:?}");
        assert!(has("none.jsonl: no documents"), "{problems:?}");
        assert_eq!(problems.len(), 4, "{problems:?}");
        // Given as an argument, the linked folder is read.
        let inputs = read_inputs(&[root.join("linked")]);
        assert_eq!(inputs.docs.len(), 1);
        Ok(())
    }
}
