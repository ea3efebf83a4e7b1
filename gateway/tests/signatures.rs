//! No function takes its arguments packed into a tuple (`(cache, logits): (&mut KvCache,
//! Vec<f32>)`) to get under the argument-count limit of `clippy.toml`: parts that belong
//! together travel as a struct whose fields name them, the rest as plain arguments. The scan
//! reads the source text of every crate's `src`: each `fn`'s parameter list, split at its
//! top-level commas, and a parameter whose pattern is a parenthesised tuple.

use std::path::{Path, PathBuf};

const CRATES: [&str; 7] = [
    "chunkstore",
    "eval",
    "gateway",
    "kernels",
    "retriever",
    "speculator",
    "target-engine",
];

/// Functions that still take a tuple, as `(file under the workspace root, fn name, why)`:
/// none today; an entry must say why its tuple cannot be a struct.
const ALLOWED: &[(&str, &str, &str)] = &[];

/// The `.rs` files under `dir`, sorted.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for p in paths {
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The names and 1-based lines of the functions in `text` with a parameter whose pattern is
/// a tuple.
fn tuple_parameters(text: &str) -> Vec<(String, usize)> {
    // Line comments out (doc comments quote signatures), line breaks kept for the numbers.
    let code: String = text
        .lines()
        .map(|l| {
            if l.trim_start().starts_with("//") {
                ""
            } else {
                l
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let bytes = code.as_bytes();
    let mut found = Vec::new();
    let mut at = 0;
    while let Some(i) = code[at..].find("fn ").map(|i| at + i) {
        at = i + 3;
        let word_before = i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        if word_before {
            continue;
        }
        let name: String = code[at..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            continue;
        }
        let Some(open) = parameters_open(&code, at + name.len()) else {
            continue;
        };
        let line = code[..i].matches('\n').count() + 1;
        if parameters(&code, open).iter().any(|p| is_tuple_pattern(p)) {
            found.push((name, line));
        }
    }
    found
}

/// Where the `(` of a function's parameters stands, after its name at `from` and any
/// generic parameters.
fn parameters_open(code: &str, from: usize) -> Option<usize> {
    let rest = &code[from..];
    let mut depth = 0i32;
    let mut prev = ' ';
    for (k, c) in rest.char_indices() {
        match c {
            '<' => depth += 1,
            '>' if prev != '-' => depth -= 1,
            '(' if depth == 0 => return Some(from + k),
            c if depth == 0 && !c.is_whitespace() => return None,
            _ => {}
        }
        prev = c;
    }
    None
}

/// The parameters of the list opening at `open`, split at its top-level commas.
fn parameters(code: &str, open: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut parens, mut angles) = (0i32, 0i32);
    let mut start = open + 1;
    let mut prev = ' ';
    for (k, c) in code[open..].char_indices() {
        let k = open + k;
        match c {
            '(' | '[' => parens += 1,
            ')' | ']' => {
                parens -= 1;
                if parens == 0 {
                    out.push(&code[start..k]);
                    return out;
                }
            }
            '<' => angles += 1,
            '>' if prev != '-' && prev != '=' => angles -= 1,
            ',' if parens == 1 && angles == 0 => {
                out.push(&code[start..k]);
                start = k + 1;
            }
            _ => {}
        }
        prev = c;
    }
    out
}

/// Whether a parameter's pattern is a tuple: it opens with `(`, holds a comma, and its
/// closing `)` is followed by the `:` of its type (not `()`, the unit a trait may ask for).
fn is_tuple_pattern(param: &str) -> bool {
    let p = param.trim_start();
    let p = p.strip_prefix("mut ").unwrap_or(p).trim_start();
    if !p.starts_with('(') {
        return false;
    }
    let (mut depth, mut comma) = (0, false);
    for (k, c) in p.char_indices() {
        match c {
            '(' => depth += 1,
            ',' if depth == 1 => comma = true,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return comma && p[k + 1..].trim_start().starts_with(':');
                }
            }
            _ => {}
        }
    }
    false
}

#[test]
fn no_function_packs_its_arguments_into_a_tuple() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut packed = Vec::new();
    let mut allowed_seen = Vec::new();
    for krate in CRATES {
        let mut files = Vec::new();
        rust_files(&root.join(krate).join("src"), &mut files);
        for file in files {
            let text = std::fs::read_to_string(&file).expect("a source file reads");
            let rel = file
                .strip_prefix(&root)
                .expect("under the root")
                .to_string_lossy()
                .replace('\\', "/");
            for (name, line) in tuple_parameters(&text) {
                match ALLOWED.iter().find(|(f, n, _)| *f == rel && *n == name) {
                    Some(a) => allowed_seen.push(*a),
                    None => packed.push(format!("{rel}:{line}: fn {name}")),
                }
            }
        }
    }
    assert!(
        packed.is_empty(),
        "functions that take a tuple of arguments; name the parts in a struct (or pass them \
         as plain arguments where the limit allows):\n{}",
        packed.join("\n")
    );
    let stale: Vec<_> = ALLOWED
        .iter()
        .filter(|a| !allowed_seen.contains(a))
        .collect();
    assert!(stale.is_empty(), "allowed but no longer found: {stale:?}");
}

/// The scan finds what it claims to: tuple patterns over one line or several, after generic
/// parameters with closures in them; not a tuple type, a closure's tuple, nor a doc comment.
#[test]
fn the_scan_sees_tuple_patterns_and_only_them() {
    let src = "\
/// fn quoted((a, b): (u8, u8)) {}
fn one((a, b): (u8, u8)) {}
pub(crate) fn several<T: Fn(u8) -> u8>(
    &self,
    f: T,
    (cache, mut logits): (&mut Vec<u8>, Vec<f32>),
) {}
fn typed(x: Result<u8, (u8, u8)>, y: (u8, u8)) -> (u8, u8) { let g = |(a, b): (u8, u8)| a; }
fn unit((): (), x: u8) {}
fn nested(x: Option<Box<dyn Fn((u8, u8)) -> u8>>, (p, q): (u8, u8)) {}
";
    let names: Vec<(String, usize)> = tuple_parameters(src);
    assert_eq!(
        names,
        vec![
            ("one".to_string(), 2),
            ("several".to_string(), 3),
            ("nested".to_string(), 10),
        ]
    );
}
