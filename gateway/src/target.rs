//! The target model a server answers with, on the CPU engine or on the device engine
//! (`--device`): the [`Target`] the pipeline holds, and the [`Backend`] every step after a
//! prompt is assembled is written once against: [`target_engine::Engine`] (prefill, chunk KV
//! placed, the probe, the blend and its shift, decode steps, verification), plus what only the
//! gateway asks of an engine (the selector serving a method, the evaluation's hooks).
//!
//! The CPU engine runs every method and every decoding option and stays the bit-exact
//! reference. The device engine runs the methods written once over the interface
//! ([`Method::on_any_engine`]), the fidelity guard, verification and sampling; a method or an
//! option it cannot run (CacheBlend, the SpecCache methods, speculative or long-context
//! drafting, the evaluation's experiments) is refused naming the method and the device, never
//! run on the CPU instead.

use crate::error::{GatewayError, Result};
use crate::method::{Method, SelectorInputs};
use crate::pipeline::{Experiment, Query};
use std::path::Path;
use std::sync::Arc;
use target_engine::device::DeviceModel;
use target_engine::prelude::*;
use target_engine::{
    BlendOutput, ChatFormat, ChunkKv, Engine, KvCache, Model, ModelConfig, PrefixKv, SelectInput,
    Selector, Tokenizer,
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
    /// The engine as the interface both implement.
    fn engine(&self) -> &dyn EngineInfo {
        match self {
            Self::Cpu(m) => &**m,
            Self::Device(d) => &**d,
        }
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        self.engine().info_tokenizer()
    }

    pub fn config(&self) -> &ModelConfig {
        self.engine().info_config()
    }

    /// The identity of the KV this engine writes: the file's and the engine's numerics, so
    /// chunk KV stored by one engine is never read by the other.
    pub fn fingerprint(&self) -> &str {
        self.engine().info_fingerprint()
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

    /// What a query asks that this target cannot run, as the problem a client gets (422
    /// naming the field, the method or option and the device); `None` where it runs.
    pub fn refuses(&self, q: &Query) -> Option<GatewayError> {
        if self.cpu().is_some() {
            return None;
        }
        let device = self.device();
        if !q.method.on_any_engine() {
            return Some(GatewayError::bad(
                "method",
                format!(
                    "`{}` runs on the CPU engine only and this server's target runs on {device}; \
                     ask for target_probe_shift (the default), target_probe, target_probe_span, \
                     epic, prefix, full_reuse or full_recompute",
                    q.method.name()
                ),
            ));
        }
        if q.spec_decode == Some(true) {
            return Some(GatewayError::bad(
                "spec_decode",
                format!(
                    "speculative decoding runs on the CPU engine only; the target runs on {device}"
                ),
            ));
        }
        if q.long_context == Some(true) {
            return Some(GatewayError::bad(
                "long_context",
                format!("long-context drafting runs on the CPU engine only; the target runs on {device}"),
            ));
        }
        None
    }
}

/// The three facts [`Target`] reads of either engine without naming its cache type.
trait EngineInfo {
    fn info_tokenizer(&self) -> &Tokenizer;
    fn info_config(&self) -> &ModelConfig;
    fn info_fingerprint(&self) -> &str;
}

impl<E: Engine> EngineInfo for E {
    fn info_tokenizer(&self) -> &Tokenizer {
        Engine::tokenizer(self)
    }
    fn info_config(&self) -> &ModelConfig {
        Engine::config(self)
    }
    fn info_fingerprint(&self) -> &str {
        Engine::fingerprint(self)
    }
}

/// An engine the pipeline's steps after assembly run on: [`Engine`] with plain and verified
/// decoding, and what the gateway adds (the selector of a method, the evaluation's hooks,
/// the CPU engine where only it serves).
pub(crate) trait Backend:
    Engine<Cache: 'static> + Generate + Verify + Sized + 'static
{
    /// The CPU engine, where this is it.
    fn cpu(&self) -> Option<&Model>;

    /// The selector that serves `method` for a query under `exp`: the method's own, or the
    /// evaluation's (the CPU engine only).
    fn selector<'a>(
        &'a self,
        query: &Query,
        exp: &'a dyn Experiment,
        method: Method,
        inputs: SelectorInputs<'a>,
    ) -> Result<Box<dyn Selector<Self> + 'a>>;

    /// [`Experiment::before_blend`] where the engine is the CPU's; nothing on the device.
    fn before_blend(
        exp: &dyn Experiment,
        input: &SelectInput<'_, Self>,
    ) -> target_engine::Result<Option<KvCache>>;

    /// [`Experiment::after_blend`] where the engine is the CPU's; nothing on the device.
    fn after_blend(
        exp: &dyn Experiment,
        before: Option<KvCache>,
        out: &mut BlendOutput<Self::Cache>,
    );
}

impl Backend for Model {
    fn cpu(&self) -> Option<&Model> {
        Some(self)
    }

    fn selector<'a>(
        &'a self,
        query: &Query,
        exp: &'a dyn Experiment,
        method: Method,
        inputs: SelectorInputs<'a>,
    ) -> Result<Box<dyn Selector<Self> + 'a>> {
        Ok(exp.selector(query, method.selector(inputs)))
    }

    fn before_blend(
        exp: &dyn Experiment,
        input: &SelectInput<'_, Self>,
    ) -> target_engine::Result<Option<KvCache>> {
        exp.before_blend(input)
    }

    fn after_blend(exp: &dyn Experiment, before: Option<KvCache>, out: &mut BlendOutput) {
        exp.after_blend(before, out);
    }
}

impl Backend for DeviceModel {
    fn cpu(&self) -> Option<&Model> {
        None
    }

    fn selector<'a>(
        &'a self,
        _: &Query,
        _: &'a dyn Experiment,
        method: Method,
        inputs: SelectorInputs<'a>,
    ) -> Result<Box<dyn Selector<Self> + 'a>> {
        method.engine_selector(inputs.epic_k).ok_or_else(|| {
            GatewayError::bad(
                "method",
                format!(
                    "`{}` runs on the CPU engine only; the target runs on {}",
                    method.name(),
                    Engine::device_name(self)
                ),
            )
        })
    }

    fn before_blend(
        _: &dyn Experiment,
        _: &SelectInput<'_, Self>,
    ) -> target_engine::Result<Option<KvCache>> {
        Ok(None)
    }

    fn after_blend(
        _: &dyn Experiment,
        _: Option<KvCache>,
        _: &mut BlendOutput<target_engine::device::DeviceCache>,
    ) {
    }
}

/// A query and the engine it runs on, as the steps after assembly hand them on.
pub(crate) struct On<'a, E> {
    pub(crate) target: &'a E,
    pub(crate) query: &'a Query,
}

impl<E> Clone for On<'_, E> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<E> Copy for On<'_, E> {}

/// `cache` as the CPU engine's, where it is one (the exact-context cache keeps only those).
pub(crate) fn host_cache<C: 'static>(cache: &C) -> Option<&KvCache> {
    (cache as &dyn std::any::Any).downcast_ref::<KvCache>()
}

/// [`host_cache`], mutable.
pub(crate) fn host_cache_mut<C: 'static>(cache: &mut C) -> Option<&mut KvCache> {
    (cache as &mut dyn std::any::Any).downcast_mut::<KvCache>()
}

/// A CPU engine's cache as engine `C`'s, where `C` is the CPU engine's.
pub(crate) fn as_cache<C: 'static>(cache: KvCache) -> Option<C> {
    let any: Box<dyn std::any::Any> = Box::new(cache);
    any.downcast::<C>().ok().map(|c| *c)
}
