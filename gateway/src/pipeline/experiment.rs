//! The evaluation's hook into the pipeline: an [`Experiment`] varies what a request cannot
//! ask, and a [`Traced`] answer hands back what the evaluation compares. A served query
//! ([`Served`], [`Pipeline::query`]) builds none of the trace: the road is generic over its
//! [`Outcome`], and a bare [`Answer`] keeps nothing.

use super::request::{ChunkOrder, Query, ScoreSource};
use super::Pipeline;
use crate::answer::Answer;
use crate::fidelity::LookRows;
use serde::{Deserialize, Serialize};
use speculator::LayerRange;
use target_engine::{
    Assembly, BlendOutput, BlendSignals, Generation, KvCache, SelectInput, Selector,
};

/// A query and the experiment it runs under ([`Served`] for a served query), as the road's
/// steps take them.
#[derive(Clone, Copy)]
pub(super) struct Run<'a> {
    pub(super) query: &'a Query,
    pub(super) exp: &'a dyn Experiment,
}

/// What the evaluation varies beyond what a request can ask, an interface the evaluation
/// implements ([`Pipeline::query_with`]); a served query is [`Served`], every default.
pub trait Experiment {
    /// In which order the retrieved chunks enter the prompt; `None`: the pipeline's
    /// (`--chunk-order`).
    fn order(&self) -> Option<ChunkOrder> {
        None
    }
    /// EPIC with this many recomputed tokens at the start of every chunk, instead of the `k`
    /// that spends the ρ budget.
    fn epic_k(&self) -> Option<usize> {
        None
    }
    /// SpecCache's layer range (the ablation); `None` keeps the speculator's.
    fn layers(&self) -> Option<LayerRange> {
        None
    }
    /// Where SpecCache's scores come from; `None` keeps the pipeline's setting.
    fn score_source(&self) -> Option<ScoreSource> {
        None
    }
    /// Hand back the prefill's cache in [`Traced::prefill`] (for teacher forcing).
    fn keep_prefill(&self) -> bool {
        false
    }
    /// The selector that runs the query's blend, given the one its method serves with: that
    /// one (a served query's), or the evaluation's own (an ablation, a bound).
    fn selector<'a>(
        &'a self,
        query: &Query,
        served: Box<dyn Selector + 'a>,
    ) -> Box<dyn Selector + 'a> {
        let _ = query;
        served
    }
    /// Called with the blend's inputs before its prefill, off the query's clock: what the
    /// experiment keeps of them for [`Experiment::after_blend`] (the reused rows, to measure
    /// the blend's deviation signals into [`Traced::signals`]); a served query keeps nothing.
    fn before_blend(&self, input: &SelectInput<'_>) -> target_engine::Result<Option<KvCache>> {
        let _ = input;
        Ok(None)
    }
    /// Called with the blend's output after its prefill, off the query's clock, with what
    /// [`Experiment::before_blend`] kept.
    fn after_blend(&self, before: Option<KvCache>, out: &mut BlendOutput) {
        let _ = (before, out);
    }
    /// Which chunk tokens the guard's second look recomputes; `None`: the pipeline's
    /// ([`GuardPolicy::look`](crate::fidelity::GuardPolicy::look)).
    fn look(&self) -> Option<LookRows> {
        None
    }
}

/// A served query: no experiment.
#[derive(Debug, Clone, Copy, Default)]
pub struct Served;

impl Experiment for Served {}

/// An answer with what the evaluation compares beyond the text.
#[derive(Debug, Clone)]
pub struct Traced {
    pub answer: Answer,
    /// The target's logits for the first generated token (after the blended or full prefill).
    pub first_logits: Vec<f32>,
    /// The generated token ids.
    pub ids: Vec<u32>,
    /// The prompt's token ids (template, chunks, question), what a full prefill reads.
    pub prompt_ids: Vec<u32>,
    /// The prefill's cache before decoding, where the experiment keeps it
    /// ([`Experiment::keep_prefill`]).
    pub prefill: Option<KvCache>,
    /// The chunk tokens the method recomputed.
    pub selected: Vec<Selected>,
    /// Where each chunk lies among the prompt's ids, in prompt order ([`Selected::chunk`]
    /// indexes it).
    pub chunks: Vec<std::ops::Range<usize>>,
    /// Per generated token decoded one by one, the top-2 logit gap it was chosen with
    /// ([`target_engine::decode::generate::top2_gap`]); empty for verified or escalated answers.
    pub margins: Vec<f32>,
    /// What the blended prefill knew of its own error (zeros for full recompute).
    pub signals: BlendSignals,
}

/// A recomputed chunk token: which chunk of the prompt, where in it, and its text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Selected {
    /// The chunk's place in the prompt (0 = first).
    pub chunk: usize,
    /// Token offset within the chunk.
    pub offset: usize,
    pub text: String,
}

/// What a query's road returns: a served [`Answer`], which keeps nothing else, or an
/// evaluation's [`Traced`], which keeps what only an evaluation reads (a copy of the first
/// token's logits, the recomputed tokens' texts, the prefill's cache where asked).
pub(crate) trait Outcome: Sized {
    /// What is kept of the prefill before decoding moves its cache on.
    type Kept;
    /// Keeps what the outcome needs of the prefill `out` of the prompt `asm`.
    fn keep<C: 'static>(
        p: &Pipeline,
        exp: &dyn Experiment,
        asm: &Assembly,
        out: &BlendOutput<C>,
    ) -> Self::Kept;
    /// The outcome of `answer`, decoded as `g`.
    fn finish(kept: Self::Kept, answer: Answer, g: Generation) -> Self;
}

impl Outcome for Answer {
    type Kept = ();

    fn keep<C: 'static>(_: &Pipeline, _: &dyn Experiment, _: &Assembly, _: &BlendOutput<C>) {}

    fn finish((): (), answer: Answer, _: Generation) -> Self {
        answer
    }
}

/// What a [`Traced`] keeps of the prefill.
pub(crate) struct PrefillTrace {
    first_logits: Vec<f32>,
    prompt_ids: Vec<u32>,
    prefill: Option<KvCache>,
    selected: Vec<Selected>,
    chunks: Vec<std::ops::Range<usize>>,
    signals: BlendSignals,
}

impl Outcome for Traced {
    type Kept = PrefillTrace;

    fn keep<C: 'static>(
        p: &Pipeline,
        exp: &dyn Experiment,
        asm: &Assembly,
        out: &BlendOutput<C>,
    ) -> PrefillTrace {
        PrefillTrace {
            first_logits: out.logits.clone(),
            prompt_ids: asm.ids.clone(),
            // Experiments run on the CPU engine only (`Pipeline::query_with`).
            prefill: exp
                .keep_prefill()
                .then(|| crate::target::host_cache(&out.cache).cloned())
                .flatten(),
            selected: p.selected(asm, &out.recomputed),
            chunks: asm.chunks().map(|s| s.ids.clone()).collect(),
            signals: out.signals,
        }
    }

    fn finish(kept: PrefillTrace, answer: Answer, g: Generation) -> Self {
        Traced {
            answer,
            first_logits: kept.first_logits,
            ids: g.ids,
            prompt_ids: kept.prompt_ids,
            prefill: kept.prefill,
            selected: kept.selected,
            chunks: kept.chunks,
            margins: g.margins,
            signals: kept.signals,
        }
    }
}

impl Pipeline {
    /// Where each recomputed position sits among the prompt's chunks.
    fn selected(&self, asm: &Assembly, recomputed: &[usize]) -> Vec<Selected> {
        let tok = self.engines.target.tokenizer();
        let chunks: Vec<std::ops::Range<usize>> = asm.chunks().map(|s| s.ids.clone()).collect();
        recomputed
            .iter()
            .filter_map(|&p| {
                let chunk = chunks.iter().position(|r| r.contains(&p))?;
                Some(Selected {
                    chunk,
                    offset: p - chunks[chunk].start,
                    text: String::from_utf8_lossy(tok.token_bytes(asm.ids[p])).into_owned(),
                })
            })
            .collect()
    }
}
