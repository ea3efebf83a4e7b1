//! The evaluation's side of a query: its [`Knobs`] (what it varies beyond a request, the
//! [`Experiment`] the pipeline asks) and teacher forcing over the prefill's cache it kept.

use crate::method::Method;
use crate::selectors::{record_deviation, reused_rows};
use gateway::pipeline::{ChunkOrder, Experiment, Query, ScoreSource, Traced};
use speculator::LayerRange;
use target_engine::{BlendOutput, KvCache, Model, SelectInput, Selector};

/// What the evaluation sets on a query that a request cannot.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Knobs {
    /// The method the evaluation runs: where it is one of the evaluation's own (an ablation,
    /// a bound), its selector replaces the query's ([`Method::own_selector`]).
    pub method: Option<Method>,
    pub order: ChunkOrder,
    pub epic_k: Option<usize>,
    pub layers: Option<LayerRange>,
    pub score_source: Option<ScoreSource>,
    /// Keep the prefill's cache for [`teacher_force`].
    pub keep_prefill: bool,
    /// Measure the blend's deviation signals (the fidelity study records them).
    pub blend_signals: bool,
    /// Which chunk tokens the guard's second look recomputes (`None`: the pipeline's).
    pub look: Option<gateway::fidelity::LookRows>,
}

impl Experiment for Knobs {
    fn order(&self) -> Option<ChunkOrder> {
        Some(self.order)
    }
    fn epic_k(&self) -> Option<usize> {
        self.epic_k
    }
    fn layers(&self) -> Option<LayerRange> {
        self.layers
    }
    fn score_source(&self) -> Option<ScoreSource> {
        self.score_source
    }
    fn keep_prefill(&self) -> bool {
        self.keep_prefill
    }
    fn selector<'a>(&'a self, q: &Query, served: Box<dyn Selector + 'a>) -> Box<dyn Selector + 'a> {
        match self.method.and_then(|m| m.own_selector(q.seed)) {
            Some(own) => own,
            None => served,
        }
    }
    fn before_blend(&self, input: &SelectInput<'_>) -> target_engine::Result<Option<KvCache>> {
        match self.blend_signals {
            true => reused_rows(input),
            false => Ok(None),
        }
    }
    fn after_blend(&self, before: Option<KvCache>, out: &mut BlendOutput) {
        if let Some(before) = before {
            record_deviation(&before, out);
        }
    }
    fn look(&self) -> Option<gateway::fidelity::LookRows> {
        self.look
    }
}

/// Next-token logits before each token of `seq` after `t`'s prefill (untimed): the first are
/// the prefill's own, the rest from one forward of `seq[..len-1]` over a copy of the cache
/// `t` kept ([`Knobs::keep_prefill`]).
pub fn teacher_force(target: &Model, t: &Traced, seq: &[u32]) -> anyhow::Result<Vec<Vec<f32>>> {
    let mut out = vec![t.first_logits.clone()];
    if seq.len() < 2 {
        return Ok(out);
    }
    let mut cache = t.prefill.clone().ok_or_else(|| {
        anyhow::anyhow!("teacher forcing needs the prefill's cache (keep_prefill)")
    })?;
    let feed = &seq[..seq.len() - 1];
    let start = t.prompt_ids.len();
    let positions: Vec<usize> = (start..start + feed.len()).collect();
    let f = target.forward(feed, &positions, &mut cache, false)?;
    let logits = target.logits(&f.hidden)?.to_vec2::<f32>()?;
    let vocab = target.tokenizer().vocab_size();
    out.extend(logits.into_iter().map(|mut row| {
        row.truncate(vocab);
        row
    }));
    Ok(out)
}
