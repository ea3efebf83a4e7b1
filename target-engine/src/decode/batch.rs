//! Continuous batching of decode steps on the CPU engine: requests that decode at the same
//! time, each on its own thread, have their next tokens computed in one pass over the weights
//! ([`Model::decode_rows`]). A decode step reads every weight once whatever the number of rows
//! it carries, so on a memory-bound CPU `n` requests decode in little more than one's time.
//!
//! A request thread installs the server's [`DecodeBatcher`] with [`with_batcher`]; plain
//! decoding ([`crate::Generate::decode_watched`]) then takes a seat for as long as it decodes
//! and hands each step to the batcher. Requests join and leave between any two steps. The
//! first thread to ask for a step while no pass runs leads the next one: it waits until every
//! seated request has asked (or [`DecodeBatcher::window`] has passed, so a request busy
//! elsewhere, say streaming to a slow client, holds nobody up for longer), takes up to
//! `max_rows` waiting rows, runs them and hands each thread its logits and its cache back.
//! Rows do not interact, so an answer is the same token for token whichever requests it
//! shared its passes with. Without a batcher installed a step is [`Model::forward`] as before.

use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::model::Model;
use std::cell::RefCell;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Batches the decode steps of the threads that install it ([`with_batcher`]).
#[derive(Debug)]
pub struct DecodeBatcher {
    max_rows: usize,
    window: Duration,
    state: Mutex<State>,
    wake: Condvar,
}

/// What the batcher has done, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Passes over the weights run for decode steps.
    pub passes: u64,
    /// Rows (one request's step each) those passes carried.
    pub rows: u64,
    /// The most rows one pass carried.
    pub max_rows: usize,
    /// Requests decoding now.
    pub seated: usize,
}

#[derive(Debug, Default)]
struct State {
    /// Requests decoding now.
    seated: usize,
    /// Steps asked for and not yet taken into a pass.
    waiting: Vec<Row>,
    /// A thread is gathering or running a pass.
    leading: bool,
    /// Steps computed, waiting for their thread to take them.
    done: Vec<(u64, Result<Vec<f32>>, KvCache)>,
    next_ticket: u64,
    stats: BatchStats,
}

#[derive(Debug)]
struct Row {
    ticket: u64,
    /// The model's address: a pass carries the rows of one model.
    model: usize,
    id: u32,
    pos: usize,
    cache: KvCache,
}

impl DecodeBatcher {
    /// A batcher whose passes carry at most `max_rows` steps (at least 1), whose leader waits
    /// at most `window` for the seated requests to ask.
    pub fn new(max_rows: usize, window: Duration) -> Self {
        Self {
            max_rows: max_rows.max(1),
            window,
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
        }
    }

    /// The most steps one pass carries.
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// How long a pass's leader waits for the seated requests to ask.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// What the batcher has done so far.
    pub fn stats(&self) -> BatchStats {
        let st = self.lock();
        BatchStats {
            seated: st.seated,
            ..st.stats
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while the lock was held cannot leave the state half-changed: every change
        // under it is a push, a removal or a counter.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts the caller as decoding until the seat is dropped.
    pub fn seat(self: &Arc<Self>) -> Seat {
        self.lock().seated += 1;
        Seat(Arc::clone(self))
    }

    /// The logits after token `id` at position `pos` of `cache` (its K/V rows written there),
    /// computed in a pass shared with the other requests asking meanwhile.
    pub fn step(
        &self,
        model: &Model,
        id: u32,
        pos: usize,
        cache: &mut KvCache,
    ) -> Result<Vec<f32>> {
        crate::stop::check()?;
        let me = model as *const Model as usize;
        let mut st = self.lock();
        let ticket = st.next_ticket;
        st.next_ticket += 1;
        let own = std::mem::replace(cache, KvCache::with_shape(0, 0));
        st.waiting.push(Row {
            ticket,
            model: me,
            id,
            pos,
            cache: own,
        });
        self.wake.notify_all();
        loop {
            if let Some(i) = st.done.iter().position(|d| d.0 == ticket) {
                let (_, logits, own) = st.done.swap_remove(i);
                *cache = own;
                return logits;
            }
            if st.leading {
                st = self.wake.wait(st).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            st.leading = true;
            st = self.gather(st, me);
            let mut rows = take_rows(&mut st.waiting, me, self.max_rows);
            drop(st);
            let results = run_pass(model, &mut rows);
            st = self.lock();
            st.stats.passes += 1;
            st.stats.rows += rows.len() as u64;
            st.stats.max_rows = st.stats.max_rows.max(rows.len());
            for (row, logits) in rows.into_iter().zip(results) {
                st.done.push((row.ticket, logits, row.cache));
            }
            st.leading = false;
            self.wake.notify_all();
        }
    }

    /// Waits (the lock released meanwhile) until every seated request has a step of model
    /// `me` waiting, `max_rows` are waiting, or the window has passed.
    fn gather<'a>(&self, mut st: MutexGuard<'a, State>, me: usize) -> MutexGuard<'a, State> {
        let until = Instant::now() + self.window;
        loop {
            let ready = st.waiting.iter().filter(|r| r.model == me).count();
            let now = Instant::now();
            if ready >= st.seated.max(1) || ready >= self.max_rows || now >= until {
                return st;
            }
            st = self
                .wake
                .wait_timeout(st, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// Up to `max` waiting rows of model `me`, oldest first.
fn take_rows(waiting: &mut Vec<Row>, me: usize, max: usize) -> Vec<Row> {
    let mut taken = Vec::new();
    let mut i = 0;
    while i < waiting.len() && taken.len() < max {
        if waiting[i].model == me {
            taken.push(waiting.remove(i));
        } else {
            i += 1;
        }
    }
    taken
}

/// One pass over `rows`, with no stop condition (each request checks its own between steps:
/// one request leaving must not fail the others' step). A pass that fails is run again row by
/// row, so each request gets its own error; a panic becomes an error for every row.
fn run_pass(model: &Model, rows: &mut [Row]) -> Vec<Result<Vec<f32>>> {
    let pass = |rows: &mut [Row]| -> Result<Vec<Vec<f32>>> {
        let mut refs: Vec<(u32, usize, &mut KvCache)> = rows
            .iter_mut()
            .map(|r| (r.id, r.pos, &mut r.cache))
            .collect();
        let run = std::panic::AssertUnwindSafe(|| {
            crate::stop::with_stop(None, || model.decode_rows(&mut refs))
        });
        std::panic::catch_unwind(run).unwrap_or_else(|_| {
            Err(EngineError::Internal(
                "a batched decode step panicked".into(),
            ))
        })
    };
    match pass(rows) {
        Ok(all) => all.into_iter().map(Ok).collect(),
        Err(e) if rows.len() == 1 => vec![Err(e)],
        Err(_) => rows
            .iter_mut()
            .map(|r| pass(std::slice::from_mut(r)).map(|mut v| v.remove(0)))
            .collect(),
    }
}

/// A request counted as decoding ([`DecodeBatcher::seat`]) until dropped.
#[derive(Debug)]
pub struct Seat(Arc<DecodeBatcher>);

impl Drop for Seat {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.seated = st.seated.saturating_sub(1);
        // A leader waiting for this request to ask need not wait any more.
        self.0.wake.notify_all();
    }
}

thread_local! {
    static BATCHER: RefCell<Option<Arc<DecodeBatcher>>> = const { RefCell::new(None) };
}

/// Puts the previous batcher back when dropped (also when `f` panics).
struct Restore(Option<Arc<DecodeBatcher>>);

impl Drop for Restore {
    fn drop(&mut self) {
        let prev = self.0.take();
        BATCHER.with(|b| *b.borrow_mut() = prev);
    }
}

/// Runs `f` with `batcher` batching this thread's decode steps (`None`: each step alone).
pub fn with_batcher<R>(batcher: Option<Arc<DecodeBatcher>>, f: impl FnOnce() -> R) -> R {
    let _restore = Restore(BATCHER.with(|b| b.replace(batcher)));
    f()
}

/// A seat at this thread's batcher, if one is installed.
pub(crate) fn seat() -> Option<Seat> {
    BATCHER.with(|b| b.borrow().as_ref().map(DecodeBatcher::seat))
}

/// One decode step: through this thread's batcher, or [`Model::forward`] alone.
pub(crate) fn step(model: &Model, id: u32, pos: usize, cache: &mut KvCache) -> Result<Vec<f32>> {
    let batcher = BATCHER.with(|b| b.borrow().clone());
    match batcher {
        Some(b) => b.step(model, id, pos, cache),
        None => {
            let forward = model.forward(&[id], &[pos], cache, false)?;
            model.last_logits(&forward)
        }
    }
}
