//! Hyper-parameters of a model, read from GGUF metadata and validated.

use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;
use kernels::RopeVariant;

/// Model families the forward pass implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Qwen2 / Qwen2.5: biases on Q, K, V; rotate-half RoPE.
    Qwen2,
    /// Llama (and SmolLM2, Llama 3.x with its RoPE frequency factors): no biases; interleaved
    /// RoPE in GGUF layout.
    Llama,
    /// Qwen3: no biases; an RMSNorm over each head of Q and K before RoPE (`attn_q_norm`,
    /// `attn_k_norm`); rotate-half RoPE; a head dimension of its own (`attention.key_length`).
    Qwen3,
    /// Phi-3: Q, K and V in one matrix (`attn_qkv`), gate and up in one (`ffn_up`, the gate
    /// first); rotate-half RoPE; no biases.
    Phi3,
    /// Gemma 3: embeddings scaled by `sqrt(n_embd)`, per-head Q/K norms, norms after attention
    /// and after the FFN too, a GELU-gated FFN, and sliding-window attention on five layers of
    /// every six (their own RoPE base); rotate-half RoPE.
    Gemma3,
}

impl Architecture {
    /// Every architecture this engine runs, in the order `specrag models list` names them.
    pub const ALL: [Architecture; 5] = [
        Self::Qwen2,
        Self::Llama,
        Self::Qwen3,
        Self::Phi3,
        Self::Gemma3,
    ];

    /// The architecture a GGUF `general.architecture` string names, if this engine runs it.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.as_str() == name)
    }

    /// The supported `general.architecture` strings, comma-separated (for messages).
    pub fn supported() -> String {
        Self::ALL.map(|a| a.as_str()).join(", ")
    }

    /// Whether Q, K and V carry biases.
    pub fn qkv_bias(&self) -> bool {
        *self == Self::Qwen2
    }

    /// Whether each head of Q and K is RMS-normed before RoPE.
    pub fn qk_norm(&self) -> bool {
        matches!(self, Self::Qwen3 | Self::Gemma3)
    }

    /// The GGUF `general.architecture` string.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Qwen2 => "qwen2",
            Self::Llama => "llama",
            Self::Qwen3 => "qwen3",
            Self::Phi3 => "phi3",
            Self::Gemma3 => "gemma3",
        }
    }

    /// Pair layout of the rotary embedding, as llama.cpp applies it for this architecture.
    pub fn rope_variant(&self) -> RopeVariant {
        match self {
            Self::Qwen2 | Self::Qwen3 | Self::Phi3 | Self::Gemma3 => RopeVariant::RotateHalf,
            Self::Llama => RopeVariant::Interleaved,
        }
    }
}

/// Shape and constants of one transformer.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Architecture,
    /// `general.name`, or the file stem when absent.
    pub name: String,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rope_theta: f64,
    pub rms_eps: f64,
    pub context_length: usize,
    /// Sliding-window attention on some layers (Gemma 3), `None` where every layer attends to
    /// the whole context.
    pub swa: Option<SlidingWindow>,
}

/// Which layers attend only to their recent keys, and how.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlidingWindow {
    /// A query at position p attends to keys at `p - window + 1 ..= p`.
    pub window: usize,
    /// Every `pattern`-th layer (the last of each group) attends to everything; the others
    /// slide (`attention.sliding_window_pattern`, 6 for Gemma 3).
    pub pattern: usize,
    /// The RoPE base of the sliding layers (`rope.freq_base_swa`, 10000 for Gemma 3).
    pub rope_theta: f64,
}

impl SlidingWindow {
    /// Whether layer `l` slides (llama.cpp's `set_swa_pattern`).
    pub fn slides(&self, l: usize) -> bool {
        self.pattern == 0 || l % self.pattern < self.pattern - 1
    }
}

impl ModelConfig {
    /// Reads and validates the hyper-parameters; unsupported features are errors.
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let arch_name = f.string("general.architecture")?;
        let arch = Architecture::parse(arch_name).ok_or_else(|| EngineError::Unsupported {
            path: f.path().to_path_buf(),
            reason: format!(
                "architecture `{arch_name}` (`general.architecture`; supported: {})",
                Architecture::supported()
            ),
        })?;
        let a = arch_name;
        let key = |k: &str| format!("{a}.{k}");
        let n_embd = f.uint(&key("embedding_length"))? as usize;
        let n_head = f.uint(&key("attention.head_count"))? as usize;
        let n_kv_head = match f.get(&key("attention.head_count_kv")) {
            Some(_) => f.uint(&key("attention.head_count_kv"))? as usize,
            None => n_head,
        };
        let head_dim = head_dim(f, &key, n_embd, n_head)?;
        if n_head == 0 || n_kv_head == 0 || head_dim == 0 || !n_head.is_multiple_of(n_kv_head) {
            return Err(EngineError::Unsupported {
                path: f.path().to_path_buf(),
                reason: format!(
                    "{n_head} heads of {head_dim} dimensions, {n_kv_head} kv heads, embedding {n_embd}"
                ),
            });
        }
        if let Some(v) = f.get(&key("rope.dimension_count")) {
            let dims = crate::gguf::value_as_u64(v).unwrap_or(0) as usize;
            if dims != head_dim {
                return Err(EngineError::Unsupported {
                    path: f.path().to_path_buf(),
                    reason: format!("partial rotary embedding ({dims} of {head_dim} dims)"),
                });
            }
        }
        refuse_rope_scaling(f, &key)?;
        let vocab_size = f.array("tokenizer.ggml.tokens")?.len();
        let name = match f.string("general.name") {
            Ok(s) => s.to_string(),
            Err(_) => f
                .path()
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default(),
        };
        let rope_theta = match f.get(&key("rope.freq_base")) {
            Some(_) => f.float(&key("rope.freq_base"))?,
            None => 10_000.0,
        };
        Ok(Self {
            arch,
            name,
            n_layer: f.uint(&key("block_count"))? as usize,
            n_embd,
            n_ff: f.uint(&key("feed_forward_length"))? as usize,
            n_head,
            n_kv_head,
            head_dim,
            vocab_size,
            rope_theta,
            rms_eps: f.float(&key("attention.layer_norm_rms_epsilon"))?,
            context_length: f.uint(&key("context_length"))? as usize,
            swa: sliding_window(f, arch, &key)?,
        })
    }

    /// The sliding window of layer `l`, if it slides.
    pub fn window_of(&self, l: usize) -> Option<usize> {
        self.swa.filter(|s| s.slides(l)).map(|s| s.window)
    }

    /// Width of the attention's output (all query heads), the input of `attn_output`.
    pub fn q_width(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Values per cached row of one layer (all KV heads).
    pub fn kv_row(&self) -> usize {
        self.n_kv_head * self.head_dim
    }
}

/// The width of an attention head: `n_embd / n_head` unless the file says otherwise
/// (`attention.key_length`, as Qwen3 files do); 0 when neither gives one.
fn head_dim(
    f: &GgufFile,
    key: &dyn Fn(&str) -> String,
    n_embd: usize,
    n_head: usize,
) -> Result<usize> {
    let declared = |k: &str| f.get(&key(k)).and_then(crate::gguf::value_as_u64);
    Ok(
        match (
            declared("attention.key_length"),
            declared("attention.value_length"),
        ) {
            (Some(k), Some(v)) if k != v => {
                return Err(EngineError::Unsupported {
                    path: f.path().to_path_buf(),
                    reason: format!("key heads of {k} and value heads of {v} dimensions"),
                })
            }
            (Some(k), _) | (None, Some(k)) => k as usize,
            (None, None) if n_head > 0 && n_embd.is_multiple_of(n_head) => n_embd / n_head,
            (None, None) => 0,
        },
    )
}

/// Gemma 3's sliding window (the only architecture here that applies one: llama.cpp too ignores
/// the key for Llama, Mistral and Phi-3 files). Final-logit soft-capping (Gemma 2's) is refused.
fn sliding_window(
    f: &GgufFile,
    arch: Architecture,
    key: &dyn Fn(&str) -> String,
) -> Result<Option<SlidingWindow>> {
    let num = |k: &str| f.get(&key(k)).and_then(crate::gguf::value_as_u64);
    if let Some(cap) = f.get(&key("final_logit_softcapping")) {
        if !matches!(cap, candle_core::quantized::gguf_file::Value::F32(x) if *x == 0.0) {
            return Err(EngineError::Unsupported {
                path: f.path().to_path_buf(),
                reason: format!(
                    "final-logit soft-capping (`{}`)",
                    key("final_logit_softcapping")
                ),
            });
        }
    }
    if arch != Architecture::Gemma3 {
        return Ok(None);
    }
    let window = match num("attention.sliding_window") {
        Some(w) if w > 0 => w as usize,
        _ => return Ok(None),
    };
    let rope_theta = match f.get(&key("rope.freq_base_swa")) {
        Some(_) => f.float(&key("rope.freq_base_swa"))?,
        None => 10_000.0,
    };
    let pattern_key = key("attention.sliding_window_pattern");
    let pattern = match f.get(&pattern_key) {
        None => 6,
        Some(v) => crate::gguf::value_as_u64(v).ok_or_else(|| EngineError::Unsupported {
            path: f.path().to_path_buf(),
            reason: format!("a per-layer sliding-window pattern (`{pattern_key}` as a list)"),
        })? as usize,
    };
    Ok(Some(SlidingWindow {
        window,
        pattern,
        rope_theta,
    }))
}

/// Refuses RoPE scaling declared in the metadata (linear, yarn: not implemented). Llama 3.x's
/// scaling comes as frequency factors beside the weights instead, which the model applies.
fn refuse_rope_scaling(f: &GgufFile, key: &dyn Fn(&str) -> String) -> Result<()> {
    for scaling in [key("rope.scaling.type"), key("rope.scaling.factor")] {
        let active = match f.get(&scaling) {
            None => false,
            Some(candle_core::quantized::gguf_file::Value::String(s)) => s != "none",
            Some(candle_core::quantized::gguf_file::Value::F32(x)) => *x != 1.0 && *x != 0.0,
            Some(_) => true,
        };
        if active {
            return Err(EngineError::Unsupported {
                path: f.path().to_path_buf(),
                reason: format!("rope scaling (`{scaling}`) is not implemented"),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Architecture;

    #[test]
    fn every_architecture_is_named_and_parsed_back() {
        for a in Architecture::ALL {
            assert_eq!(Architecture::parse(a.as_str()), Some(a));
            assert!(Architecture::supported().contains(a.as_str()));
        }
        assert_eq!(Architecture::parse("gemma2"), None);
        assert_eq!(
            Architecture::supported(),
            "qwen2, llama, qwen3, phi3, gemma3"
        );
    }
}
