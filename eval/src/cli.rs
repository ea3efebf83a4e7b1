//! What both of `specrag-eval`'s runs (the default run and `--study`) use: loading a model as
//! the environment says, a file's name for reports, and a progress bar.

use anyhow::Context as _;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::path::Path;
use std::sync::Arc;
use target_engine::{LoadOptions, Model};

pub(crate) fn load_model(path: &Path) -> anyhow::Result<Arc<Model>> {
    eprintln!("loading {}", path.display());
    // SPECRAG_ATTENTION, checked at startup.
    let opts = LoadOptions {
        attention: gateway::process::attention_from_env().map_err(anyhow::Error::msg)?,
        ..LoadOptions::default()
    };
    let m = Model::load(path, &opts).with_context(|| format!("loading {}", path.display()))?;
    Ok(Arc::new(m))
}

pub(crate) fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| p.display().to_string())
}

pub(crate) fn bar(len: u64, prefix: &str) -> ProgressBar {
    let b = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    b.set_style(
        ProgressStyle::with_template(
            "{prefix:>16} [{bar:30}] {pos}/{len} {msg:32!} {elapsed_precise} ETA {eta}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    b.set_prefix(prefix.to_string());
    b
}
