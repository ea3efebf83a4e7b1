//! The target model a server answers with, on the CPU engine or on the device engine
//! (`--device`): the [`Target`] the pipeline holds. The road after assembly is written once
//! against [`target_engine::Engine`] (prefill, chunk KV placed, the probe, the blend and its
//! shift, decode steps, verification) and what only the gateway asks of an engine
//! (`pipeline/backend.rs`).
//!
//! The CPU engine runs every method and every decoding option and stays the bit-exact
//! reference. The device engine runs the methods written once over the interface
//! ([`crate::method::Method::on_any_engine`]), the fidelity guard, verification and
//! sampling; a method or an option it cannot run (CacheBlend, the SpecCache methods,
//! speculative or long-context drafting, the evaluation's experiments) is refused naming the
//! method and the device, never run on the CPU instead.

use crate::error::{GatewayError, Result};
use std::path::Path;
use std::sync::Arc;
use target_engine::device::DeviceModel;
use target_engine::{
    ChatFormat, ChunkKv, Engine, KvCache, Model, ModelConfig, PrefixKv, Tokenizer,
};

/// The target model, on the CPU engine or on a device.
#[derive(Clone)]
pub enum Target {
    /// The CPU engine: every method, the reference.
    Cpu(Arc<Model>),
    /// The device engine (`--device cuda[:N]`; candle's CPU device in the suite).
    Device(Arc<DeviceModel>),
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} on {}", self.fingerprint(), self.device())
    }
}

impl From<Arc<Model>> for Target {
    fn from(m: Arc<Model>) -> Self {
        Self::Cpu(m)
    }
}

impl From<Arc<DeviceModel>> for Target {
    fn from(m: Arc<DeviceModel>) -> Self {
        Self::Device(m)
    }
}

impl Target {
    pub fn tokenizer(&self) -> &Tokenizer {
        match self {
            Self::Cpu(m) => m.tokenizer(),
            Self::Device(d) => d.tokenizer(),
        }
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            Self::Cpu(m) => m.config(),
            Self::Device(d) => d.config(),
        }
    }

    /// Bytes one token's KV takes in one of this engine's caches (f32 rows on the CPU engine,
    /// and their bf16 copy under `--attention bf16`; f16 on the device's).
    pub fn kv_bytes_per_token(&self) -> u64 {
        match self {
            Self::Cpu(m) => crate::admission::cpu_kv_bytes_per_token(m.config(), m.attention()),
            Self::Device(d) => crate::admission::kv_bytes_per_token_of(
                d.config(),
                target_engine::device::CACHE_DTYPE.size_in_bytes(),
            ),
        }
    }

    /// The identity of the KV this engine writes: the file's and the engine's numerics, so
    /// chunk KV stored by one engine is never read by the other.
    pub fn fingerprint(&self) -> &str {
        match self {
            Self::Cpu(m) => m.fingerprint(),
            Self::Device(d) => Engine::fingerprint(&**d),
        }
    }

    /// The GGUF file the target was loaded from.
    pub fn path(&self) -> &Path {
        match self {
            Self::Cpu(m) => m.path(),
            Self::Device(d) => d.path(),
        }
    }

    /// The chat format prompts are written in.
    pub fn chat(&self) -> &ChatFormat {
        match self {
            Self::Cpu(m) => m.chat(),
            Self::Device(d) => d.chat(),
        }
    }

    /// Where the target runs: `cpu` for the CPU engine, `device:cuda:N` for the device engine
    /// on a GPU, `device:cpu` for it on candle's CPU device (`--device candle-cpu`).
    pub fn device(&self) -> String {
        match self {
            Self::Cpu(_) => "cpu".into(),
            Self::Device(d) => Engine::device_name(&**d),
        }
    }

    /// The CPU engine, where the target runs on it.
    pub fn cpu(&self) -> Option<&Arc<Model>> {
        match self {
            Self::Cpu(m) => Some(m),
            Self::Device(_) => None,
        }
    }

    /// The CPU engine, or a problem saying that `what` runs on the CPU engine only.
    pub fn cpu_for(&self, what: &str) -> Result<&Arc<Model>> {
        self.cpu().ok_or_else(|| {
            GatewayError::Internal(format!(
                "{what} runs on the CPU engine only; this target runs on {}",
                self.device()
            ))
        })
    }

    /// A chunk's KV, precomputed after `prefix` (or alone).
    pub fn chunk_kv(&self, ids: &[u32], prefix: Option<&PrefixKv>) -> Result<ChunkKv> {
        Ok(match self {
            Self::Cpu(m) => Engine::chunk_kv(&**m, ids, prefix)?,
            Self::Device(d) => Engine::chunk_kv(&**d, ids, prefix)?,
        })
    }

    /// The exact KV of a template prefix.
    pub fn prefix_of(&self, ids: &[u32]) -> Result<PrefixKv> {
        Ok(match self {
            Self::Cpu(m) => Engine::prefix_of(&**m, ids)?,
            Self::Device(d) => Engine::prefix_of(&**d, ids)?,
        })
    }
}

/// `cache` as the CPU engine's, where it is one (an evaluation's trace keeps only those).
pub(crate) fn host_cache<C: 'static>(cache: &C) -> Option<&KvCache> {
    (cache as &dyn std::any::Any).downcast_ref::<KvCache>()
}

/// [`host_cache`], mutable.
pub(crate) fn host_cache_mut<C: 'static>(cache: &mut C) -> Option<&mut KvCache> {
    (cache as &mut dyn std::any::Any).downcast_mut::<KvCache>()
}
