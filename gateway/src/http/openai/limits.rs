//! The OpenAI route's limits and the model ids it answers to: what the request reader and the
//! model list share (a leaf, so neither imports the route's parent module).

use crate::http::state::AppState;

/// Most characters of the system messages and earlier turns together: they are recomputed on
/// every request (~4k tokens).
pub const MAX_CONTEXT_CHARS: usize = 16 * 1024;
/// Most messages in one request.
pub const MAX_MESSAGES: usize = 256;
/// Most stop strings (OpenAI's limit) and their longest length.
pub const MAX_STOPS: usize = 4;
pub const MAX_STOP_CHARS: usize = 64;
/// The model id every server lists besides its target's file name.
pub const MODEL_ALIAS: &str = "specrag";

/// The model ids this server answers to: its target's file name and [`MODEL_ALIAS`].
pub(crate) fn model_ids(state: &AppState) -> Vec<String> {
    let target = &state.pipeline.engines.target;
    let stem = target
        .path()
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| target.config().name.clone());
    vec![stem, MODEL_ALIAS.into()]
}
