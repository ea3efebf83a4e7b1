//! SpeContext (docs/long-context.md) as a verified drafter: a small model of the
//! target's family is cut down to a *lightweight retrieval head* (its token embedding and one
//! layer's norm and Q/K projections; [`Model::embedding_qk`]) that keeps a key for every
//! context token and, before the target runs a decode step, scores the whole context with the
//! step's token and picks the rows every layer of the target then attends to ([`RetrievalHead`];
//! [`ContextHead`] puts the context behind the head instead: the small model's layers up to
//! the chosen one run for each step token over its own cache of the context):
//!
//! - head-level selection: each of the head's query heads scores every position, the softmax
//!   probabilities are reduced by their maximum over the query heads of a kv group (the paper's
//!   element-wise max for GQA), and the group's top-k rows, with a few sink rows and a recent
//!   window, are what the target's kv head of the same index attends to, in every layer;
//! - elastic loading ([`SpeContextView`]): each layer and kv head keeps the chosen rows in a
//!   resident buffer and a step loads only the rows that entered the set (the paper's
//!   `S_now - S_last`), into the slots of the rows that left it;
//! - adaptive memory ([`SpeContextConfig::for_budget`]): how many rows stay resident follows
//!   from a byte budget, the context length and the two models' shapes.
//!
//! The selection needs nothing of the step but its token, so it runs before the target's
//! layers (no per-layer scoring on the step's own query, which is what SpeCache's view pays).
//! Lossy on its own; [`ViewDecode::decode_view`](crate::prelude::ViewDecode::decode_view) checks every drafted token against full attention.

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::model::Model;
use crate::view::AttentionView;
use kernels::AttentionShape;
use rayon::prelude::*;
use std::sync::Arc;

/// How [`SpeContextView`] chooses and keeps rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeContextConfig {
    /// The retrieval model's layer whose norm and Q/K projections score the context.
    pub layer: usize,
    /// Rows chosen by the retrieval head per kv head (0: the window alone).
    pub top_k: usize,
    /// Most recent rows always attended.
    pub window: usize,
    /// First rows always attended (attention sinks).
    pub sink: usize,
}

impl Default for SpeContextConfig {
    fn default() -> Self {
        Self {
            layer: DEFAULT_LAYER,
            top_k: 1024,
            window: 128,
            sink: 4,
        }
    }
}

/// The embedding head's layer by default: the 0.5B speculator's layer whose embedding-only
/// choice caught the most of the 1.5B target's attention on 4k tokens of the docs (0.753; every
/// layer lies within 0.745-0.753, about what a window of as many rows catches;
/// docs/long-context.md, *SpeContext*).
pub const DEFAULT_LAYER: usize = 3;

/// The contextual head's layer by default ([`ContextHead`]): the 0.5B speculator's layer whose
/// own attention caught the most of the 1.5B target's on the same measurement (0.814).
pub const DEFAULT_CONTEXT_LAYER: usize = 14;

impl SpeContextConfig {
    /// Bytes resident for a context of `context` tokens: what the retrieval head holds
    /// (`head_bytes`: the embedding head's keys, or the contextual head's cache;
    /// [`RowScorer::bytes`]) and the rows every layer and kv head of the target keeps (f32 K
    /// and V).
    pub fn resident_bytes(&self, context: usize, target: &ModelConfig, head_bytes: u64) -> u64 {
        let kept = self
            .top_k
            .saturating_add(self.window)
            .saturating_add(self.sink);
        let rows = kept.min(context) as u64;
        head_bytes.saturating_add(rows.saturating_mul(row_bytes(target)))
    }

    /// The memory model: `top_k` as large as fits `budget` bytes resident at `context` tokens
    /// (what [`Self::resident_bytes`] counts), at most the context; 0 (the window alone) when
    /// not even the head, sinks and window fit.
    pub fn for_budget(
        mut self,
        budget: u64,
        context: usize,
        target: &ModelConfig,
        head_bytes: u64,
    ) -> Self {
        self.top_k = 0;
        let fixed = self.resident_bytes(context, target, head_bytes);
        let spare = budget.saturating_sub(fixed) / row_bytes(target).max(1);
        let room = context.saturating_sub(self.window.saturating_add(self.sink)) as u64;
        self.top_k = spare.min(room) as usize;
        self
    }
}

/// Bytes one position's K and V take in every layer and kv head of `target` (f32).
fn row_bytes(target: &ModelConfig) -> u64 {
    (target.n_layer * target.n_kv_head * target.head_dim * 2 * 4) as u64
}

/// How many of `ids` (to be placed at `start..`) equal the tokens `known` already holds there.
fn common_prefix(known: &[u32], start: usize, ids: &[u32]) -> usize {
    known
        .get(start..)
        .unwrap_or(&[])
        .iter()
        .zip(ids)
        .take_while(|(a, b)| a == b)
        .count()
}

/// Tokens the retrieval head projects per call.
const BATCH: usize = 1024;

/// SpeContext's retrieval head: one layer's keys of every context token from its embedding,
/// and the step token's queries against them.
#[derive(Debug, Clone)]
pub struct RetrievalHead {
    model: Arc<Model>,
    layer: usize,
    /// Per kv head, `(positions, head_dim)` keys.
    keys: Vec<Vec<f32>>,
    /// Whether a position's key is known (a row fed without its token has none).
    known: Vec<bool>,
    /// The token at each position (`u32::MAX` where unknown).
    ids: Vec<u32>,
    /// The queries of the last steps (position, rotated query), newest last.
    queries: std::collections::VecDeque<(usize, Vec<f32>)>,
    /// Steps whose queries are averaged into the one that scores (1: the step's alone).
    recent: usize,
}

impl RetrievalHead {
    /// The head of `model`'s layer `layer`.
    pub fn new(model: Arc<Model>, layer: usize) -> Result<Self> {
        let c = model.config();
        if layer >= c.n_layer {
            return Err(EngineError::InvalidInput(format!(
                "retrieval layer {layer} is out of range: the model has {} layers",
                c.n_layer
            )));
        }
        let keys = vec![Vec::new(); c.n_kv_head];
        Ok(Self {
            model,
            layer,
            keys,
            known: Vec::new(),
            ids: Vec::new(),
            queries: std::collections::VecDeque::new(),
            recent: 1,
        })
    }

    /// The head scoring with the mean of the last `recent` steps' queries (at least 1): the
    /// embedding alone knows nothing of the context, the recent tokens together say more.
    pub fn with_recent(mut self, recent: usize) -> Self {
        self.recent = recent.max(1);
        self
    }

    /// The model the head is cut from.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Positions with a key slot (known or not).
    pub fn len(&self) -> usize {
        self.known.len()
    }

    /// Whether the head holds no keys.
    pub fn is_empty(&self) -> bool {
        self.known.is_empty()
    }

    /// Bytes of keys held.
    pub fn bytes(&self) -> usize {
        self.keys.iter().map(|k| k.len() * 4).sum()
    }

    /// Drops keys from `start` on; positions up to `start` without one become unknown.
    fn cut(&mut self, start: usize) {
        let d = self.model.config().head_dim;
        for k in &mut self.keys {
            k.resize(start * d, 0.0);
        }
        self.known.resize(start, false);
        self.ids.resize(start, u32::MAX);
        self.queries.retain(|(at, _)| *at < start);
    }

    /// Appends rows `(tokens, kv heads, head_dim)` of keys of tokens `ids`.
    fn push(&mut self, k: &[f32], ids: &[u32]) {
        let d = self.model.config().head_dim;
        let heads = self.keys.len();
        for (row, &id) in k.chunks_exact(heads * d).zip(ids) {
            for (g, key) in row.chunks_exact(d).enumerate() {
                self.keys[g].extend_from_slice(key);
            }
            self.known.push(true);
            self.ids.push(id);
        }
    }

    /// Keys of `ids` at positions `start..`, replacing any from `start` on (rows already
    /// holding the same tokens are kept as they are).
    pub fn extend(&mut self, start: usize, ids: &[u32]) -> Result<()> {
        let same = common_prefix(&self.ids, start, ids);
        let (start, ids) = (start + same, &ids[same..]);
        self.cut(start);
        for (b, part) in ids.chunks(BATCH).enumerate() {
            let at = start + b * BATCH;
            let positions: Vec<usize> = (at..at + part.len()).collect();
            let (k, _) = self
                .model
                .embedding_qk(self.layer, part, &positions, false)?;
            self.push(&k, part);
        }
        Ok(())
    }

    /// Token `id` at `pos` (its key stored, replacing those from `pos` on): per kv head of
    /// the head, each position's importance `0..=pos`, the largest softmax probability among
    /// the group's query heads; positions without a known key get infinity (always kept).
    pub fn importance(&mut self, id: u32, pos: usize) -> Result<Vec<Vec<f32>>> {
        self.cut(pos);
        let (k, q) = self.model.embedding_qk(self.layer, &[id], &[pos], true)?;
        self.push(&k, &[id]);
        self.queries.push_back((pos, q.unwrap_or_default()));
        while self.queries.len() > self.recent {
            self.queries.pop_front();
        }
        let mut q = vec![0f32; self.queries[0].1.len()];
        for (_, x) in &self.queries {
            q.iter_mut().zip(x).for_each(|(a, &b)| *a += b);
        }
        let scale = 1.0 / self.queries.len() as f32;
        q.iter_mut().for_each(|a| *a *= scale);
        let c = self.model.config();
        let (d, per_group) = (c.head_dim, c.n_head / c.n_kv_head);
        let one = AttentionShape {
            n_head: 1,
            n_kv_head: 1,
            head_dim: d,
        };
        let probs = (0..c.n_head)
            .into_par_iter()
            .map(|h| {
                let keys = &self.keys[h / per_group];
                kernels::attention_mass(&q[h * d..(h + 1) * d], &[pos], keys, one)
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let mut out: Vec<Vec<f32>> = Vec::with_capacity(c.n_kv_head);
        for group in probs.chunks(per_group) {
            let mut m = group[0].clone();
            for p in &group[1..] {
                m.iter_mut().zip(p).for_each(|(a, &b)| *a = a.max(b));
            }
            for (x, &known) in m.iter_mut().zip(&self.known) {
                if !known {
                    *x = f32::INFINITY;
                }
            }
            out.push(m);
        }
        Ok(out)
    }
}

/// What chooses a step's rows: per kv head of the scorer, each position's importance.
pub trait RowScorer {
    /// Tokens `ids` at positions `start..` (several at once: a prompt, a checking pass's rows)
    /// enter the context, replacing any from `start` on.
    fn feed(&mut self, start: usize, ids: &[u32]) -> Result<()>;

    /// Token `id` at `pos` enters the context: each position's importance `0..=pos` per kv
    /// head of the scorer (infinity: always keep).
    fn importance(&mut self, id: u32, pos: usize) -> Result<Vec<Vec<f32>>>;

    /// Bytes held.
    fn bytes(&self) -> usize;
}

impl RowScorer for RetrievalHead {
    fn feed(&mut self, start: usize, ids: &[u32]) -> Result<()> {
        self.extend(start, ids)
    }

    fn importance(&mut self, id: u32, pos: usize) -> Result<Vec<Vec<f32>>> {
        RetrievalHead::importance(self, id, pos)
    }

    fn bytes(&self) -> usize {
        RetrievalHead::bytes(self)
    }
}

/// Per kv head, each row's largest softmax probability among the group's query heads, for
/// one query row `q` at `p` over keys `k` laid out `(rows, kv heads, head_dim)`.
pub fn group_max(q: &[f32], p: usize, k: &[f32], shape: AttentionShape) -> Result<Vec<Vec<f32>>> {
    let d = shape.head_dim;
    let rows = p + 1;
    let per_group = shape.n_head / shape.n_kv_head;
    let one = AttentionShape {
        n_head: 1,
        n_kv_head: 1,
        head_dim: d,
    };
    (0..shape.n_kv_head)
        .into_par_iter()
        .map(|g| {
            let mut kg = Vec::with_capacity(rows * d);
            for t in 0..rows {
                let at = (t * shape.n_kv_head + g) * d;
                kg.extend_from_slice(&k[at..at + d]);
            }
            let mut top = vec![0f32; rows];
            for j in 0..per_group {
                let h = g * per_group + j;
                let pr = kernels::attention_mass(&q[h * d..(h + 1) * d], &[p], &kg, one)?;
                top.iter_mut().zip(&pr).for_each(|(a, &b)| *a = a.max(b));
            }
            Ok(top)
        })
        .collect()
}

/// Full attention that keeps, at one layer, a one-row step's [`group_max`].
#[derive(Debug, Clone, Default)]
struct Grab {
    layer: usize,
    importance: Vec<Vec<f32>>,
}

impl AttentionView for Grab {
    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        positions: &[usize],
        cache: &KvCache,
        shape: AttentionShape,
    ) -> Result<Vec<f32>> {
        let rows = positions.iter().max().map_or(0, |&p| p + 1);
        let (k, v) = (cache.k_prefix(layer, rows), cache.v_prefix(layer, rows));
        if let (&[p], true) = (positions, layer == self.layer) {
            self.importance = group_max(q, p, k, shape)?;
        }
        Ok(kernels::causal_attention(q, positions, k, v, shape)?)
    }

    fn invalidate_from(&mut self, _rows: usize) {}

    fn held_bytes(&self) -> usize {
        0
    }

    fn rows_read(&self) -> (u64, u64) {
        (0, 0)
    }
}

/// A retrieval head with the context behind it: the speculator's layers up to `layer` run
/// every step token over the speculator's own cache of the context (the chunks' stored
/// speculator KV, reused as the target's is), and that layer's attention, max over each kv
/// group, is the importance. Measured on the demo docs it catches about half of what the
/// target's own top rows would over a window ([`RetrievalHead`], the embedding alone, catches
/// about what a wider window does); its cost is those layers' forward over the whole context.
#[derive(Debug, Clone)]
pub struct ContextHead {
    model: Arc<Model>,
    cache: KvCache,
    /// The token at each cache row.
    ids: Vec<u32>,
    grab: Grab,
    /// A step found rows never fed (warned once).
    gap_reported: bool,
}

impl ContextHead {
    /// The head of `model`'s layer `layer` over `cache`, the model's cache of the context
    /// `ids` (one per row).
    pub fn new(model: Arc<Model>, layer: usize, cache: KvCache, ids: &[u32]) -> Result<Self> {
        let c = model.config();
        if layer >= c.n_layer {
            return Err(EngineError::InvalidInput(format!(
                "retrieval layer {layer} is out of range: the model has {} layers",
                c.n_layer
            )));
        }
        if cache.n_layer() != c.n_layer
            || cache.row_len() != c.n_kv_head * c.head_dim
            || cache.len() != ids.len()
            || !cache.is_complete()
        {
            return Err(EngineError::InvalidInput(format!(
                "the retrieval head's cache is not its model's over the {} tokens given",
                ids.len()
            )));
        }
        Ok(Self {
            model,
            cache,
            ids: ids.to_vec(),
            gap_reported: false,
            grab: Grab {
                layer,
                importance: Vec::new(),
            },
        })
    }
}

impl RowScorer for ContextHead {
    fn feed(&mut self, start: usize, ids: &[u32]) -> Result<()> {
        let same = common_prefix(&self.ids, start, ids);
        let (start, ids) = (start + same, &ids[same..]);
        self.cache.truncate(start);
        self.ids.truncate(start);
        if ids.is_empty() || start > self.ids.len() {
            // Nothing new, or rows missing before it (never fed): nothing to compute on.
            return Ok(());
        }
        let positions: Vec<usize> = (start..start + ids.len()).collect();
        let layers = self.grab.layer + 1;
        self.grab.importance.clear();
        self.model
            .forward_view_layers(ids, &positions, &mut self.cache, &mut self.grab, layers)?;
        self.ids.extend_from_slice(ids);
        Ok(())
    }

    fn importance(&mut self, id: u32, pos: usize) -> Result<Vec<Vec<f32>>> {
        // A step repeated at the same row and token still needs its attention: refeed it.
        if self.ids.get(pos) == Some(&id) {
            self.ids.truncate(pos);
            self.cache.truncate(pos);
        }
        // Only this step's attention counts (a pass fed without a step leaves its own).
        self.grab.importance.clear();
        self.feed(pos, &[id])?;
        if self.grab.importance.is_empty() {
            // Rows before `pos` were never fed (a caller skipped `feed`): the head cannot
            // score, so every row is kept: exact, and as slow as full attention.
            if !self.gap_reported {
                self.gap_reported = true;
                tracing::warn!(
                    pos,
                    fed = self.ids.len(),
                    "contextual retrieval head missed rows: its view attends to every row"
                );
            }
            let n_kv = self.model.config().n_kv_head;
            return Ok(vec![vec![f32::INFINITY; pos + 1]; n_kv]);
        }
        Ok(std::mem::take(&mut self.grab.importance))
    }

    /// The whole cache it holds (every layer's rows, though only the first `layer + 1` are
    /// computed for the step tokens).
    fn bytes(&self) -> usize {
        self.cache.len() * self.cache.row_len() * 2 * 4 * self.cache.n_layer()
    }
}

/// The rows of the retrieval head's kv heads mapped onto `n_kv` target kv heads: the same
/// index when the counts agree, otherwise each target head takes the element-wise maximum of
/// the head's groups that cover its share.
pub fn map_heads(importance: Vec<Vec<f32>>, n_kv: usize) -> Vec<Vec<f32>> {
    let ns = importance.len();
    if ns == n_kv {
        return importance;
    }
    (0..n_kv)
        .map(|g| {
            let lo = g * ns / n_kv;
            let hi = ((g + 1) * ns / n_kv).max(lo + 1).min(ns);
            let mut m = importance[lo].clone();
            for other in &importance[lo + 1..hi] {
                m.iter_mut().zip(other).for_each(|(a, &b)| *a = a.max(b));
            }
            m
        })
        .collect()
}

/// The sorted rows a kv head attends to at position `p` (the step's own row included) given
/// each earlier row's importance: `config.sink` first rows, the `config.window` last, and the
/// `config.top_k` most important between them (rows without a known key always).
pub fn choose_rows(config: &SpeContextConfig, importance: &[f32], p: usize) -> Vec<usize> {
    let c = config;
    let n = p + 1;
    let sink_end = c.sink.min(n);
    // The step's own row is always attended.
    let wstart = n.saturating_sub(c.window.max(1)).max(sink_end);
    let mut out: Vec<usize> = (0..sink_end).collect();
    let mut order: Vec<usize> = (sink_end..wstart).collect();
    let top = c.top_k.min(order.len());
    if top < order.len() {
        if top > 0 {
            order.select_nth_unstable_by(top - 1, |&a, &b| importance[b].total_cmp(&importance[a]));
        }
        order.truncate(top);
        order.extend((sink_end..wstart).filter(|&t| importance[t] == f32::INFINITY));
        order.sort_unstable();
        order.dedup();
    }
    out.extend(order);
    out.extend(wstart..n);
    out
}

/// One layer and kv head's resident rows.
#[derive(Debug, Clone, Default)]
struct Buffer {
    k: Vec<f32>,
    v: Vec<f32>,
    /// The step whose loads the buffer holds (0: none yet).
    step: u64,
}

/// Positions resident per slot for one kv head, and the loads the current step needs.
#[derive(Debug, Clone, Default)]
struct Slots {
    /// The position each slot holds (`EMPTY`: none).
    at: Vec<usize>,
    /// The slot each position is in (`EMPTY`: none).
    of: Vec<usize>,
    /// This step's loads: (slot, position).
    pending: Vec<(usize, usize)>,
}

const EMPTY: usize = usize::MAX;

impl Slots {
    /// Makes `chosen` (sorted positions) the resident set: rows that left free their slots,
    /// rows that entered take them (appended when there are too few), and the last slots move
    /// into holes left over; every row placed is a pending load.
    fn choose(&mut self, chosen: &[usize]) {
        self.pending.clear();
        let top = chosen.last().map_or(0, |&p| p + 1).max(self.of.len());
        self.of.resize(top, EMPTY);
        let mut keep = vec![false; top];
        chosen.iter().for_each(|&p| keep[p] = true);
        let mut free: Vec<usize> = Vec::new();
        for (s, p) in self.at.iter_mut().enumerate() {
            if *p == EMPTY || !keep[*p] {
                if *p != EMPTY {
                    self.of[*p] = EMPTY;
                }
                *p = EMPTY;
                free.push(s);
            }
        }
        free.reverse();
        for &p in chosen {
            if self.of[p] != EMPTY {
                continue;
            }
            let s = free.pop().unwrap_or_else(|| {
                self.at.push(EMPTY);
                self.at.len() - 1
            });
            self.at[s] = p;
            self.of[p] = s;
            self.pending.push((s, p));
        }
        // Fill the holes left with the last slots, so the resident rows stay contiguous.
        free.sort_unstable();
        for hole in free {
            while self.at.last() == Some(&EMPTY) {
                self.at.pop();
            }
            if hole >= self.at.len() {
                break;
            }
            let last = self.at.len() - 1;
            let p = self.at[last];
            self.at.pop();
            self.at[hole] = p;
            self.of[p] = hole;
            self.pending.retain(|&(s, _)| s != last);
            self.pending.push((hole, p));
        }
    }

    /// Forgets positions at or after `rows` (rewritten in the cache).
    fn invalidate_from(&mut self, rows: usize) {
        for p in self.at.iter_mut() {
            if *p != EMPTY && *p >= rows {
                self.of[*p] = EMPTY;
                *p = EMPTY;
            }
        }
    }
}

/// SpeContext's drafter view: rows chosen once per step by a [`RowScorer`] (a
/// [`RetrievalHead`] or a [`ContextHead`]), kept resident per layer and kv head and loaded
/// elastically.
pub struct SpeContextView {
    head: Box<dyn RowScorer + Send>,
    config: SpeContextConfig,
    slots: Vec<Slots>,
    buffers: Vec<Buffer>,
    step: u64,
    /// This step has a selection (one-row steps begun through [`AttentionView::begin_step`]).
    active: bool,
    read: u64,
    full: u64,
    loaded: u64,
}

/// Which buffer a refresh brings up to date, and to what: the decode step, the layer, the kv
/// head `g`, and the position `p` the step writes.
#[derive(Clone, Copy)]
struct RefreshAt {
    step: u64,
    layer: usize,
    g: usize,
    p: usize,
}

impl SpeContextView {
    /// A view for a target with `n_kv_head` kv heads, rows chosen by `head`, which already
    /// holds the context before the first step ([`RowScorer::feed`]).
    pub fn new(
        head: Box<dyn RowScorer + Send>,
        config: SpeContextConfig,
        n_kv_head: usize,
    ) -> Self {
        Self {
            head,
            config,
            slots: vec![Slots::default(); n_kv_head],
            buffers: Vec::new(),
            step: 0,
            active: false,
            read: 0,
            full: 0,
            loaded: 0,
        }
    }

    /// The view's settings.
    pub fn config(&self) -> SpeContextConfig {
        self.config
    }

    /// Brings `buf` (layer `at.layer`, kv head `at.g`) to step `at.step`: its pending loads,
    /// or every slot when it missed a step; the row at `at.p` is reloaded always (written
    /// this layer).
    fn refresh(
        buf: &mut Buffer,
        slots: &Slots,
        at: RefreshAt,
        cache: &KvCache,
        d: usize,
        row: usize,
    ) -> u64 {
        let RefreshAt { step, layer, g, p } = at;
        let n = slots.at.len();
        buf.k.resize(n * d, 0.0);
        buf.v.resize(n * d, 0.0);
        let (k, v) = (cache.k(layer), cache.v(layer));
        let mut load = |s: usize, t: usize| {
            buf.k[s * d..(s + 1) * d].copy_from_slice(&k[t * row + g * d..t * row + (g + 1) * d]);
            buf.v[s * d..(s + 1) * d].copy_from_slice(&v[t * row + g * d..t * row + (g + 1) * d]);
        };
        let mut loaded = 0u64;
        if buf.step + 1 == step {
            for &(s, t) in &slots.pending {
                load(s, t);
                loaded += 1;
            }
        } else if buf.step != step {
            for (s, &t) in slots.at.iter().enumerate().filter(|(_, &t)| t != EMPTY) {
                load(s, t);
                loaded += 1;
            }
        }
        if let Some(&s) = slots.of.get(p).filter(|&&s| s != EMPTY) {
            load(s, p);
        }
        buf.step = step;
        loaded
    }
}

impl AttentionView for SpeContextView {
    fn begin_step(&mut self, ids: &[u32], positions: &[usize]) -> Result<()> {
        let (&[id], &[p]) = (ids, positions) else {
            self.active = false;
            // Those rows are rewritten by this pass: none of them stays resident.
            if let Some(&first) = positions.iter().min() {
                self.invalidate_from(first);
            }
            if let (Some(&start), true) = (positions.first(), ids.len() == positions.len()) {
                self.head.feed(start, ids)?;
            }
            return Ok(());
        };
        let importance = self.head.importance(id, p)?;
        let per_head = map_heads(importance, self.slots.len());
        for (g, imp) in per_head.iter().enumerate() {
            let chosen = choose_rows(&self.config, imp, p);
            self.slots[g].choose(&chosen);
        }
        self.step += 1;
        self.active = true;
        Ok(())
    }

    fn attend(
        &mut self,
        layer: usize,
        q: &[f32],
        positions: &[usize],
        cache: &KvCache,
        shape: AttentionShape,
    ) -> Result<Vec<f32>> {
        let (n_kv, d) = (shape.n_kv_head, shape.head_dim);
        let rows = positions.iter().max().map_or(0, |&p| p + 1);
        let (&[p], true) = (positions, self.active && self.slots.len() == n_kv) else {
            self.read += (positions.len() * rows * n_kv) as u64;
            self.full += (positions.len() * rows * n_kv) as u64;
            return Ok(kernels::causal_attention(
                q,
                positions,
                cache.k_prefix(layer, rows),
                cache.v_prefix(layer, rows),
                shape,
            )?);
        };
        if self.buffers.len() < cache.n_layer() * n_kv {
            self.buffers = vec![Buffer::default(); cache.n_layer() * n_kv];
        }
        let heads = shape.n_head / n_kv;
        let one = AttentionShape {
            n_head: heads,
            n_kv_head: 1,
            head_dim: d,
        };
        let row = n_kv * d;
        let step = self.step;
        let slots = &self.slots;
        let results = self.buffers[layer * n_kv..(layer + 1) * n_kv]
            .par_iter_mut()
            .enumerate()
            .map(|(g, buf)| {
                let at = RefreshAt { step, layer, g, p };
                let loaded = Self::refresh(buf, &slots[g], at, cache, d, row);
                let n = slots[g].at.len();
                let qg = &q[g * heads * d..(g + 1) * heads * d];
                let o = kernels::causal_attention(qg, &[n - 1], &buf.k, &buf.v, one)?;
                Ok((o, n, loaded))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut out = Vec::with_capacity(shape.n_head * d);
        for (o, n, loaded) in results {
            out.extend(o);
            self.read += n as u64;
            self.full += rows as u64;
            self.loaded += loaded;
        }
        Ok(out)
    }

    fn rows_written(&mut self, start: usize, ids: &[u32]) -> Result<()> {
        self.head.feed(start, ids)
    }

    fn invalidate_from(&mut self, rows: usize) {
        self.slots.iter_mut().for_each(|s| s.invalidate_from(rows));
    }

    fn held_bytes(&self) -> usize {
        self.head.bytes()
            + self
                .buffers
                .iter()
                .map(|b| (b.k.capacity() + b.v.capacity()) * 4)
                .sum::<usize>()
    }

    fn rows_read(&self) -> (u64, u64) {
        (self.read, self.full)
    }

    /// Elastic loading's traffic, summed over layers and kv heads.
    fn rows_loaded(&self) -> Option<u64> {
        Some(self.loaded)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Elastic loading keeps exactly the chosen rows resident, contiguous, and the pending
    /// loads alone bring a buffer that held the previous set to the new one.
    #[test]
    fn slots_hold_the_chosen_rows_after_loading_only_the_difference() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut slots = Slots::default();
        // What a buffer holds per slot, maintained by pending loads only.
        let mut buffer: Vec<usize> = Vec::new();
        let (mut loads, mut chosen_total) = (0usize, 0usize);
        let mut n: usize = 50;
        for step in 0..400 {
            n += rng.gen_range(0..3);
            if step % 37 == 0 {
                // A verification pass rewrote the rows from here on.
                let from = n.saturating_sub(rng.gen_range(0..6));
                slots.invalidate_from(from);
                buffer
                    .iter_mut()
                    .filter(|p| **p >= from)
                    .for_each(|p| *p = EMPTY);
            }
            let mut chosen: Vec<usize> = (0..n).filter(|_| rng.gen_bool(0.3)).collect();
            // Sets that change little step to step, as decoding's do.
            if step % 2 == 1 {
                chosen = slots.at.iter().copied().filter(|&p| p != EMPTY).collect();
                chosen.sort_unstable();
                chosen.push(n);
                n += 1;
            }
            slots.choose(&chosen);
            buffer.resize(slots.at.len(), EMPTY);
            for &(s, p) in &slots.pending {
                buffer[s] = p;
            }
            loads += slots.pending.len();
            chosen_total += chosen.len();
            let mut resident = buffer.clone();
            resident.sort_unstable();
            assert_eq!(resident, chosen, "step {step}");
            assert_eq!(buffer, slots.at, "step {step}");
            for (s, &p) in slots.at.iter().enumerate() {
                assert_eq!(slots.of[p], s);
            }
        }
        assert!(
            loads * 2 < chosen_total,
            "loading the difference moves less than the sets ({loads} of {chosen_total} rows)"
        );
    }

    #[test]
    fn the_memory_model_fills_the_budget_and_no_more() {
        // The default pairing's shapes: the 1.5B target, the 0.5B speculator as the head.
        let shape = |n_layer, n_kv_head, head_dim| ModelConfig {
            arch: crate::Architecture::Qwen2,
            name: String::new(),
            n_layer,
            n_embd: 0,
            n_ff: 0,
            n_head: 0,
            n_kv_head,
            head_dim,
            vocab_size: 0,
            rope_theta: 0.0,
            rms_eps: 0.0,
            context_length: 32_768,
            swa: None,
        };
        let target = shape(28, 2, 128);
        let base = SpeContextConfig::default();
        for (budget, context) in [
            (1u64 << 20, 4000usize),
            (1 << 24, 32_000),
            (1 << 30, 500),
            (10, 9000),
        ] {
            // The embedding head's keys: 2 kv heads x 64 values x f32 per position.
            let head = (context * 2 * 64 * 4) as u64;
            let c = base.for_budget(budget, context, &target, head);
            let used = c.resident_bytes(context, &target, head);
            let room = context.saturating_sub(base.window + base.sink);
            if c.top_k > 0 {
                assert!(used <= budget, "{budget} bytes at {context}: {used}");
            }
            let more = SpeContextConfig {
                top_k: c.top_k + 1,
                ..c
            };
            assert!(
                c.top_k == room || more.resident_bytes(context, &target, head) > budget,
                "{budget} bytes at {context}: top_k {} leaves room",
                c.top_k
            );
        }
    }
}
