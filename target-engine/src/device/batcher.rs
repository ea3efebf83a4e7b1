//! Continuous batching on the device path: requests join a running batch when they arrive
//! (their prompt prefilled into a cache of their own) and leave it when their answer is done,
//! while the others keep decoding, one [`DeviceModel::forward_batch`] row per active request
//! per step. Greedy or seeded sampled answers ([`crate::Sampler`]: a token's draw depends on
//! the seed, its index and the logits only); each request's tokens are what it would get
//! decoded alone (`tests/device_model.rs` holds that on the CPU).

use super::{DeviceCache, DeviceModel};
use crate::engine::{Step, StepEngine};
use crate::error::{EngineError, Result};
use crate::sampling::{Sampler, SamplingParams};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// A prompt to answer with `max_new` tokens (at least 1), drawn as `sampling` says (the
/// default: greedy).
#[derive(Debug, Clone, PartialEq)]
pub struct BatchRequest {
    pub prompt: Vec<u32>,
    pub max_new: usize,
    pub sampling: SamplingParams,
}

impl BatchRequest {
    /// A greedy request.
    pub fn greedy(prompt: Vec<u32>, max_new: usize) -> Self {
        Self {
            prompt,
            max_new,
            sampling: SamplingParams::default(),
        }
    }
}

/// A finished request: its tokens and its times from submission.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchOutcome {
    /// The id [`ContinuousBatcher::submit`] returned.
    pub id: u64,
    pub tokens: Vec<u32>,
    /// Submission to the first token (queueing and the prefill included).
    pub ttft: Duration,
    /// Submission to the last token.
    pub total: Duration,
    /// The longest wait between two of its tokens (zero for a one-token answer): what other
    /// requests' prefills cost it while it was decoding.
    pub max_gap: Duration,
}

/// A request in the batch: its cache is filled below `len`, `next` is the token to feed.
#[derive(Debug)]
struct Active {
    id: u64,
    submitted: Instant,
    ttft: Duration,
    tokens: Vec<u32>,
    max_new: usize,
    len: usize,
    next: u32,
    sampler: Sampler,
    last_token: Instant,
    max_gap: Duration,
}

/// A request whose prompt is being prefilled a piece per step ([`ContinuousBatcher::with_prefill_chunk`]):
/// its cache holds the prompt's first `done` tokens.
struct Prefilling {
    id: u64,
    request: BatchRequest,
    submitted: Instant,
    cache: DeviceCache,
    done: usize,
}

/// The scheduler: a queue of submitted requests and the batch being decoded.
pub struct ContinuousBatcher<'a> {
    model: &'a DeviceModel,
    max_batch: usize,
    prefills_per_step: usize,
    next_id: u64,
    waiting: VecDeque<(u64, BatchRequest, Instant)>,
    prefilling: Option<Prefilling>,
    prefill_chunk: usize,
    active: Vec<Active>,
    caches: Vec<DeviceCache>,
    peak: usize,
}

impl<'a> ContinuousBatcher<'a> {
    /// A batcher decoding at most `max_batch` requests together and prefilling at most
    /// `prefills_per_step` arrivals before each decode step (so a burst of arrivals delays the
    /// running answers by a bounded amount); both at least 1.
    pub fn new(model: &'a DeviceModel, max_batch: usize, prefills_per_step: usize) -> Self {
        Self {
            model,
            max_batch: max_batch.max(1),
            prefills_per_step: prefills_per_step.max(1),
            next_id: 0,
            waiting: VecDeque::new(),
            prefilling: None,
            prefill_chunk: 0,
            active: Vec::new(),
            caches: Vec::new(),
            peak: 0,
        }
    }

    /// Prefills arrivals `tokens` prompt tokens per step (chunked prefill), one request at a
    /// time, instead of each whole before the next decode step: a long prompt then delays the
    /// running answers by a piece's forward per step rather than by its whole prefill, and
    /// takes more steps to its own first token. 0 (the default): whole prompts.
    pub fn with_prefill_chunk(mut self, tokens: usize) -> Self {
        self.prefill_chunk = tokens;
        self
    }

    /// Queues `request`; its id comes back in its [`BatchOutcome`].
    pub fn submit(&mut self, request: BatchRequest) -> Result<u64> {
        if request.prompt.is_empty() {
            return Err(EngineError::InvalidInput("an empty prompt".into()));
        }
        if request.max_new == 0 {
            return Err(EngineError::InvalidInput(
                "max_new must be at least 1".into(),
            ));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.push_back((id, request, Instant::now()));
        Ok(id)
    }

    /// Requests queued, being prefilled or being decoded.
    pub fn pending(&self) -> usize {
        self.waiting.len() + usize::from(self.prefilling.is_some()) + self.active.len()
    }

    /// The most requests that were in the batch together.
    pub fn peak_batch(&self) -> usize {
        self.peak
    }

    /// One scheduling step: admits arrivals (prefill, first token; with a prefill chunk, one
    /// piece of one arrival's prompt), then decodes one token for every request admitted
    /// before; returns the requests that finished.
    pub fn step(&mut self) -> Result<Vec<BatchOutcome>> {
        let mut done = Vec::new();
        let decoding = self.active.len();
        if self.prefill_chunk > 0 {
            self.prefill_piece(&mut done)?;
        } else {
            let mut admitted = 0;
            while admitted < self.prefills_per_step && self.active.len() < self.max_batch {
                let Some((id, req, submitted)) = self.waiting.pop_front() else {
                    break;
                };
                admitted += 1;
                let capacity = req.prompt.len() + req.max_new;
                let (cache, logits) = self.model.prefill(&req.prompt, capacity)?;
                let prefilled = Prefilled {
                    cache,
                    logits: &logits,
                };
                self.admit(id, req, submitted, prefilled, &mut done);
            }
        }
        self.peak = self.peak.max(self.active.len());
        if decoding > 0 {
            let ids: Vec<u32> = self.active[..decoding].iter().map(|a| a.next).collect();
            let positions: Vec<usize> = self.active[..decoding].iter().map(|a| a.len).collect();
            let hidden =
                self.model
                    .forward_batch(&ids, &positions, &mut self.caches[..decoding])?;
            for (a, logits) in self.active.iter_mut().zip(self.model.logits(&hidden)?) {
                a.len += 1;
                a.next = a.sampler.sample_at(&logits, a.tokens.len());
                a.tokens.push(a.next);
                a.max_gap = a.max_gap.max(a.last_token.elapsed());
                a.last_token = Instant::now();
            }
            // Finished requests leave; the order of the others does not matter.
            let mut i = 0;
            while i < self.active.len() {
                if self.active[i].tokens.len() >= self.active[i].max_new {
                    self.caches.swap_remove(i);
                    done.push(finish(self.active.swap_remove(i)));
                } else {
                    i += 1;
                }
            }
        }
        Ok(done)
    }
}

/// A request's prompt prefilled: its cache and the logits of its last position.
struct Prefilled<'a> {
    cache: DeviceCache,
    logits: &'a [f32],
}

impl ContinuousBatcher<'_> {
    /// A prefilled request's first token: it joins the batch, or is done already.
    fn admit(
        &mut self,
        id: u64,
        req: BatchRequest,
        submitted: Instant,
        prefilled: Prefilled<'_>,
        done: &mut Vec<BatchOutcome>,
    ) {
        let Prefilled { cache, logits } = prefilled;
        let sampler = Sampler::new(req.sampling);
        let first = sampler.sample_at(logits, 0);
        let a = Active {
            id,
            submitted,
            ttft: submitted.elapsed(),
            tokens: vec![first],
            max_new: req.max_new,
            len: req.prompt.len(),
            next: first,
            sampler,
            last_token: Instant::now(),
            max_gap: Duration::ZERO,
        };
        if a.max_new == 1 {
            done.push(finish(a));
        } else {
            self.active.push(a);
            self.caches.push(cache);
        }
    }

    /// Chunked prefill: the next piece of the arrival being prefilled (taking the next one
    /// from the queue when there is room in the batch); its last piece admits it.
    fn prefill_piece(&mut self, done: &mut Vec<BatchOutcome>) -> Result<()> {
        if self.prefilling.is_none() && self.active.len() < self.max_batch {
            if let Some((id, request, submitted)) = self.waiting.pop_front() {
                let capacity = request.prompt.len() + request.max_new;
                self.prefilling = Some(Prefilling {
                    id,
                    cache: self.model.new_cache(capacity)?,
                    request,
                    submitted,
                    done: 0,
                });
            }
        }
        let Some(p) = self.prefilling.as_mut() else {
            return Ok(());
        };
        let end = (p.done + self.prefill_chunk).min(p.request.prompt.len());
        let positions: Vec<usize> = (p.done..end).collect();
        let hidden =
            self.model
                .forward(&p.request.prompt[p.done..end], &positions, &mut p.cache)?;
        p.done = end;
        if end == p.request.prompt.len() {
            let logits = self.model.last_logits(&hidden)?;
            if let Some(p) = self.prefilling.take() {
                let prefilled = Prefilled {
                    cache: p.cache,
                    logits: &logits,
                };
                self.admit(p.id, p.request, p.submitted, prefilled, done);
            }
        }
        Ok(())
    }
}

fn finish(a: Active) -> BatchOutcome {
    BatchOutcome {
        id: a.id,
        tokens: a.tokens,
        ttft: a.ttft,
        total: a.submitted.elapsed(),
        max_gap: a.max_gap,
    }
}

/// What a closed-loop run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct ClosedLoop {
    /// Every request, in the order they finished, with the client that sent it.
    pub outcomes: Vec<(usize, BatchOutcome)>,
    pub wall: Duration,
    /// The largest batch decoded together.
    pub peak_batch: usize,
}

impl ClosedLoop {
    /// Generated tokens per second over the run.
    pub fn tokens_per_s(&self) -> f64 {
        let n: usize = self.outcomes.iter().map(|(_, o)| o.tokens.len()).sum();
        n as f64 / self.wall.as_secs_f64().max(1e-9)
    }

    /// The `q` quantile (0-1, nearest rank) of the requests' time to first token, in ms.
    pub fn ttft_ms(&self, q: f64) -> f64 {
        self.quantile_ms(q, |o| o.ttft)
    }

    /// The `q` quantile of the requests' longest wait between two of their tokens, in ms.
    pub fn max_gap_ms(&self, q: f64) -> f64 {
        self.quantile_ms(q, |o| o.max_gap)
    }

    fn quantile_ms(&self, q: f64, of: impl Fn(&BatchOutcome) -> Duration) -> f64 {
        let mut v: Vec<f64> = self
            .outcomes
            .iter()
            .map(|(_, o)| of(o).as_secs_f64() * 1e3)
            .collect();
        if v.is_empty() {
            return f64::NAN;
        }
        v.sort_by(f64::total_cmp);
        let rank = ((q.clamp(0.0, 1.0) * v.len() as f64).ceil() as usize).clamp(1, v.len());
        v[rank - 1]
    }
}

/// `clients` clients, each sending the requests `request(client, k)` for k = 0.. one after
/// another (the next as soon as its previous answer is done) until it has sent
/// `per_client`, served by one [`ContinuousBatcher`] (`max_batch` = `clients`, one prefill
/// per step).
pub fn closed_loop(
    model: &DeviceModel,
    clients: usize,
    per_client: usize,
    request: impl FnMut(usize, usize) -> BatchRequest,
) -> Result<ClosedLoop> {
    closed_loop_chunked(model, clients, per_client, 0, request)
}

/// [`closed_loop`] with prompts prefilled `prefill_chunk` tokens per step
/// ([`ContinuousBatcher::with_prefill_chunk`]; 0: whole).
pub fn closed_loop_chunked(
    model: &DeviceModel,
    clients: usize,
    per_client: usize,
    prefill_chunk: usize,
    mut request: impl FnMut(usize, usize) -> BatchRequest,
) -> Result<ClosedLoop> {
    let mut b = ContinuousBatcher::new(model, clients, 1).with_prefill_chunk(prefill_chunk);
    let mut owner = std::collections::HashMap::new();
    let mut sent = vec![0usize; clients];
    let start = Instant::now();
    for (c, n) in sent.iter_mut().enumerate() {
        if per_client > 0 {
            owner.insert(b.submit(request(c, 0))?, c);
            *n = 1;
        }
    }
    let mut outcomes = Vec::new();
    while b.pending() > 0 {
        let finished = b.step()?;
        for o in finished {
            let c = owner.remove(&o.id).unwrap_or(0);
            if sent[c] < per_client {
                owner.insert(b.submit(request(c, sent[c]))?, c);
                sent[c] += 1;
            }
            outcomes.push((c, o));
        }
    }
    Ok(ClosedLoop {
        outcomes,
        wall: start.elapsed(),
        peak_batch: b.peak_batch(),
    })
}

/// The server's batcher ([`crate::DecodeBatcher`]) on the device engine: the one-token steps
/// of a pass in one [`DeviceModel::forward_batch`]; a step of several tokens (a token and the
/// drafts after it, for verification) in a forward of its own.
impl StepEngine for DeviceModel {
    type Cache = DeviceCache;

    fn placeholder(&self) -> DeviceCache {
        DeviceCache::placeholder()
    }

    fn decode_steps(&self, steps: &mut [Step<'_, DeviceCache>]) -> Result<Vec<Vec<Vec<f32>>>> {
        if let Some(s) = steps.iter().find(|s| s.ids.is_empty()) {
            return Err(EngineError::InvalidInput(format!(
                "a decode step without tokens at position {}",
                s.start
            )));
        }
        let mut out: Vec<Vec<Vec<f32>>> = vec![Vec::new(); steps.len()];
        let single: Vec<usize> = (0..steps.len())
            .filter(|&i| steps[i].ids.len() == 1)
            .collect();
        if !single.is_empty() {
            let ids: Vec<u32> = single.iter().map(|&i| steps[i].ids[0]).collect();
            let positions: Vec<usize> = single.iter().map(|&i| steps[i].start).collect();
            let mut caches: Vec<DeviceCache> = single
                .iter()
                .map(|&i| std::mem::replace(&mut *steps[i].cache, DeviceCache::placeholder()))
                .collect();
            let hidden = self.forward_batch(&ids, &positions, &mut caches);
            for (&i, c) in single.iter().zip(caches) {
                *steps[i].cache = c;
            }
            for (&i, row) in single.iter().zip(self.logits(&hidden?)?) {
                out[i] = vec![row];
            }
        }
        for (i, s) in steps.iter_mut().enumerate() {
            if s.ids.len() > 1 {
                let positions: Vec<usize> = (s.start..s.start + s.ids.len()).collect();
                let hidden = self.forward(s.ids, &positions, s.cache)?;
                out[i] = self.logits(&hidden)?;
            }
        }
        Ok(out)
    }
}
