//! Hyper-parameters of a model, read from GGUF metadata and validated.

use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;
use kernels::RopeVariant;

/// Model families the forward pass implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Qwen2 / Qwen2.5: biases on Q, K, V; rotate-half RoPE.
    Qwen2,
    /// Llama (and SmolLM2): no biases; interleaved RoPE in GGUF layout.
    Llama,
}

impl Architecture {
    /// Every architecture this engine runs, in the order `specrag models list` names them.
    pub const ALL: [Architecture; 2] = [Self::Qwen2, Self::Llama];

    /// The architecture a GGUF `general.architecture` string names, if this engine runs it.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.as_str() == name)
    }

    /// The supported `general.architecture` strings, comma-separated (for messages).
    pub fn supported() -> String {
        Self::ALL.map(|a| a.as_str()).join(", ")
    }

    /// The GGUF `general.architecture` string.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Qwen2 => "qwen2",
            Self::Llama => "llama",
        }
    }

    /// Pair layout of the rotary embedding, as llama.cpp applies it for this architecture.
    pub fn rope_variant(&self) -> RopeVariant {
        match self {
            Self::Qwen2 => RopeVariant::RotateHalf,
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
        if n_head == 0
            || n_kv_head == 0
            || !n_head.is_multiple_of(n_kv_head)
            || !n_embd.is_multiple_of(n_head)
        {
            return Err(EngineError::Unsupported {
                path: f.path().to_path_buf(),
                reason: format!("{n_head} heads, {n_kv_head} kv heads, embedding {n_embd}"),
            });
        }
        let head_dim = n_embd / n_head;
        if let Some(v) = f.get(&key("rope.dimension_count")) {
            let dims = crate::gguf::value_as_u64(v).unwrap_or(0) as usize;
            if dims != head_dim {
                return Err(EngineError::Unsupported {
                    path: f.path().to_path_buf(),
                    reason: format!("partial rotary embedding ({dims} of {head_dim} dims)"),
                });
            }
        }
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
        })
    }

    /// Values per cached row of one layer (all KV heads).
    pub fn kv_row(&self) -> usize {
        self.n_kv_head * self.head_dim
    }
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
        assert_eq!(Architecture::parse("gemma3"), None);
        assert_eq!(Architecture::supported(), "qwen2, llama");
    }
}
