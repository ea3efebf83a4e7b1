//! What the road after assembly asks of the target's engine ([`Backend`]): the
//! [`target_engine::Engine`] passes with plain and verified decoding, the selector serving a
//! method, and the evaluation's hooks; and what a device target refuses ([`refused`]).
//! [`crate::target::Target`] holds the engine; the road dispatches on it once.

use super::{Experiment, Query};
use crate::error::{GatewayError, Result};
use crate::method::{Method, SelectorInputs};
use crate::target::Target;
use target_engine::device::DeviceModel;
use target_engine::prelude::*;
use target_engine::{BlendOutput, Engine, KvCache, Model, SelectInput, Selector};

/// What a query asks that this target cannot run, as the problem a client gets (422
/// naming the field, the method or option and the device); `None` where it runs.
pub(crate) fn refused(target: &Target, q: &Query) -> Option<GatewayError> {
    if target.cpu().is_some() {
        return None;
    }
    let device = target.device();
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
            format!(
                "long-context drafting runs on the CPU engine only; the target runs on {device}"
            ),
        ));
    }
    None
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
