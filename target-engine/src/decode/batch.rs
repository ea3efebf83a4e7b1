//! Continuous batching of decode steps: requests that decode at the same time, each on its own
//! thread, have their next rows computed in one pass over the weights
//! ([`Model::decode_rows`]). A decode step reads every weight once whatever the number of rows
//! it carries, so on a memory-bound CPU four requests decode 2.1-2.6x the tokens/s of one
//! (docs/performance.md, *Requests batched*).
//!
//! A request thread installs the server's [`DecodeBatcher`] with [`with_batcher`]; plain and
//! speculative decoding ([`crate::Generate::decode_watched`],
//! [`crate::decode::speculative::Speculate`]) then take a seat for as long as they decode and
//! hand each step (a token, or a token and the drafts after it) to the batcher. Requests join
//! and leave between any two steps. The first thread to ask while no pass runs leads the next
//! one: it waits until every seated request has asked (or [`DecodeBatcher::window`] has
//! passed, so a request busy elsewhere, say streaming to a slow client, holds nobody up for
//! longer), takes up to `max_steps` waiting steps, runs them and hands each thread its logits
//! and its cache back. Rows do not interact, so an answer is the same token for token
//! whichever requests it shared its passes with. Without a batcher installed a step runs alone
//! as before.
//!
//! The batcher is written once for both engines ([`StepEngine`]): the CPU engine ([`Model`],
//! whose steps may carry drafts) and the device engine ([`crate::device::DeviceModel`], one
//! token per request and step). A thread installs it as a [`Batching`], which knows no engine:
//! a request's steps go through it where it is the batcher of that request's engine.
//!
//! Prefills take turns: a request thread waits for its turn ([`DecodeBatcher::take_turn`],
//! in the batcher's [`PrefillOrder`]: by default first prefills before the guard's looks and
//! escalations) before its model work and gives it up when it starts decoding
//! (or ends), so one prefill at a time shares the cores with the batched decode passes. Four
//! prefills side by side would each take four times as long and every first token would come
//! late; in turn, the first comes after one prefill.

use crate::engine::Engine;
use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::model::Model;
use std::any::Any;
use std::cell::RefCell;

use super::turns::Turns;
pub use super::turns::{PrefillOrder, TurnKind, WorkTurns, MAX_OVERTAKEN};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use crate::engine::{Step, StepEngine};

impl StepEngine for Model {
    type Cache = KvCache;

    fn placeholder(&self) -> KvCache {
        KvCache::with_shape(0, 0)
    }

    /// [`Model::decode_rows`]; each step's tokens go at the end of its cache.
    fn decode_steps(&self, steps: &mut [Step<'_, KvCache>]) -> Result<Vec<Vec<Vec<f32>>>> {
        if let Some(s) = steps.iter().find(|s| s.start != s.cache.len()) {
            return Err(EngineError::InvalidInput(format!(
                "a step at position {} of a cache of {} rows: steps go at a cache's end",
                s.start,
                s.cache.len()
            )));
        }
        let mut rows: Vec<(&[u32], &mut KvCache)> =
            steps.iter_mut().map(|s| (s.ids, &mut *s.cache)).collect();
        self.decode_rows(&mut rows)
    }
}

/// Batches the decode steps of the threads that share it: on the CPU engine those that
/// install it ([`with_batcher`]); on any engine, threads calling [`DecodeBatcher::step`].
#[derive(Debug)]
pub struct DecodeBatcher<E: StepEngine = Model> {
    max_steps: usize,
    window: Duration,
    order: PrefillOrder,
    /// Rows of prefill work begun while decoding run per turn (0: all in one).
    piece: usize,
    state: Mutex<State<E::Cache>>,
    wake: Condvar,
}

/// What the batcher has done, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Passes over the weights run for decode steps.
    pub passes: u64,
    /// Steps (one request's each) those passes carried.
    pub steps: u64,
    /// Token rows those steps carried (more than steps where drafts were checked).
    pub rows: u64,
    /// The most steps one pass carried.
    pub max_steps: usize,
    /// Requests decoding now.
    pub seated: usize,
    /// Prefill turns given (a request's first prefill, a second look, each piece of an
    /// escalation's full prefill).
    pub prefill_turns: u64,
    /// Of those, turns for the guard's second looks ([`TurnKind::Look`]).
    pub look_turns: u64,
    /// Of those, turns for escalations' full prefills ([`TurnKind::Escalation`]).
    pub escalation_turns: u64,
}

/// A batcher as a thread installs it ([`with_batcher`]), whatever its engine: seats, prefill
/// turns and what it has done. The decode steps of a request on engine `E` go through it where
/// it is a [`DecodeBatcher<E>`], and run alone otherwise.
pub trait Batching: Send + Sync + std::fmt::Debug {
    /// Itself, as the trait object a thread holds.
    fn into_dyn(self: Arc<Self>) -> Arc<dyn Batching>;
    /// Itself, to be found as the [`DecodeBatcher`] of an engine.
    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync>;
    /// Counts one more request as decoding.
    fn take_seat(&self);
    /// Counts one request fewer as decoding (a pass's leader need not wait for it).
    fn leave_seat(&self);
    /// Waits for a prefill turn for work of `kind` whose earlier turns left `work`; what its
    /// next turn carries, once the turn is held. [`EngineError::Stopped`] when the thread's
    /// stop condition says so meanwhile.
    fn wait_turn(&self, kind: TurnKind, work: WorkTurns) -> Result<WorkTurns>;
    /// Passes the turn on to the next ticket not given up.
    fn pass_turn(&self);
    /// What the batcher has done so far.
    fn stats(&self) -> BatchStats;
    /// Rows of prefill work begun while decoding that one turn runs (0: all of it):
    /// [`prefill_pieces`].
    fn prefill_piece(&self) -> usize;
}

impl<E: StepEngine + std::fmt::Debug + 'static> Batching for DecodeBatcher<E>
where
    E::Cache: 'static,
{
    fn into_dyn(self: Arc<Self>) -> Arc<dyn Batching> {
        self
    }

    fn into_any(self: Arc<Self>) -> Arc<dyn Any + Send + Sync> {
        self
    }

    fn take_seat(&self) {
        self.lock().seated += 1;
    }

    fn leave_seat(&self) {
        let mut st = self.lock();
        st.seated = st.seated.saturating_sub(1);
        self.wake.notify_all();
    }

    fn wait_turn(&self, kind: TurnKind, work: WorkTurns) -> Result<WorkTurns> {
        let mut st = self.lock();
        let ticket = st.turns.enqueue(kind, work);
        let work = loop {
            if let Some(n) = st.turns.try_take(ticket, self.order) {
                break n;
            }
            if crate::stop::check().is_err() {
                st.turns.drop_ticket(ticket);
                self.wake.notify_all();
                return Err(EngineError::Stopped);
            }
            st = self
                .wake
                .wait_timeout(st, TURN_POLL)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        st.stats.prefill_turns += 1;
        match kind {
            TurnKind::First => {}
            TurnKind::Look | TurnKind::FirstLook => st.stats.look_turns += 1,
            TurnKind::Escalation => st.stats.escalation_turns += 1,
        }
        Ok(work)
    }

    fn pass_turn(&self) {
        self.lock().turns.release();
        self.wake.notify_all();
    }

    fn stats(&self) -> BatchStats {
        DecodeBatcher::stats(self)
    }

    fn prefill_piece(&self) -> usize {
        self.piece
    }
}

/// Takes a prefill turn at `batcher` for this thread (held until it starts decoding or its
/// [`with_batcher`] scope ends). A [`TurnKind::First`] turn's place in line is kept for the
/// scope, for a look at the first token ([`in_first_token_turn`]).
pub fn take_turn_at(batcher: &Arc<dyn Batching>, kind: TurnKind) -> Result<()> {
    let work = take_turn_after(batcher, kind, WorkTurns::default())?;
    if kind == TurnKind::First {
        FIRST.with(|f| f.set(Some(work)));
    }
    Ok(())
}

/// [`take_turn_at`] for work whose earlier turns left `work`; what its next turn carries.
fn take_turn_after(
    batcher: &Arc<dyn Batching>,
    kind: TurnKind,
    work: WorkTurns,
) -> Result<WorkTurns> {
    let next = batcher.wait_turn(kind, work)?;
    TURN.with(|t| t.borrow_mut().replace(Turn(Arc::clone(batcher))));
    Ok(next)
}

#[derive(Debug)]
struct State<C> {
    /// Requests decoding now.
    seated: usize,
    /// Steps asked for and not yet taken into a pass.
    waiting: Vec<Row<C>>,
    /// A thread is gathering or running a pass.
    leading: bool,
    /// Steps computed, waiting for their thread to take them.
    done: Vec<Finished<C>>,
    next_ticket: u64,
    /// Prefill turns: who holds one, who waits.
    turns: Turns,
    stats: BatchStats,
}

impl<C> Default for State<C> {
    fn default() -> Self {
        Self {
            seated: 0,
            waiting: Vec::new(),
            leading: false,
            done: Vec::new(),
            next_ticket: 0,
            turns: Turns::default(),
            stats: BatchStats::default(),
        }
    }
}

/// A step computed: its ticket, its logits (or why not) and its cache, back for its thread.
type Finished<C> = (u64, Result<Vec<Vec<f32>>>, C);

#[derive(Debug)]
struct Row<C> {
    ticket: u64,
    /// The engine's address: a pass carries the rows of one model.
    model: usize,
    ids: Vec<u32>,
    start: usize,
    cache: C,
}

impl<E: StepEngine> DecodeBatcher<E> {
    /// A batcher whose passes carry at most `max_steps` steps (at least 1), whose leader waits
    /// at most `window` for the seated requests to ask.
    pub fn new(max_steps: usize, window: Duration) -> Self {
        Self {
            max_steps: max_steps.max(1),
            window,
            order: PrefillOrder::default(),
            piece: 0,
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
        }
    }

    /// The batcher with prefill turns given in `order`.
    pub fn with_prefill_order(mut self, order: PrefillOrder) -> Self {
        self.order = order;
        self
    }

    /// The order prefill turns go in.
    pub fn prefill_order(&self) -> PrefillOrder {
        self.order
    }

    /// The batcher with prefill work begun while decoding (an escalation's full prefill) run
    /// `rows` at a time, each piece in a turn of its own, so that prefills waiting meanwhile
    /// go between the pieces rather than after the whole (0: in one turn).
    pub fn with_prefill_piece(mut self, rows: usize) -> Self {
        self.piece = rows;
        self
    }

    /// The most steps one pass carries.
    pub fn max_steps(&self) -> usize {
        self.max_steps
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

    fn lock(&self) -> MutexGuard<'_, State<E::Cache>> {
        // A panic while the lock was held cannot leave the state half-changed: every change
        // under it is a push, a removal or a counter.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts the caller as decoding until the seat is dropped.
    pub fn seat(self: &Arc<Self>) -> Seat<E> {
        self.lock().seated += 1;
        Seat(Arc::clone(self))
    }

    /// The logits after each of `ids` fed at positions `start..` of `cache` (their K/V rows
    /// written there), computed in a pass of `engine` shared with the other requests asking
    /// meanwhile.
    pub fn step(
        &self,
        engine: &E,
        ids: &[u32],
        start: usize,
        cache: &mut E::Cache,
    ) -> Result<Vec<Vec<f32>>> {
        crate::stop::check()?;
        let me = engine as *const E as usize;
        let mut st = self.lock();
        let ticket = st.next_ticket;
        st.next_ticket += 1;
        let own = std::mem::replace(cache, engine.placeholder());
        st.waiting.push(Row {
            ticket,
            model: me,
            ids: ids.to_vec(),
            start,
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
            let mut rows = take_rows(&mut st.waiting, me, self.max_steps);
            drop(st);
            let results = run_pass(engine, &mut rows);
            st = self.lock();
            st.stats.passes += 1;
            st.stats.steps += rows.len() as u64;
            st.stats.rows += rows.iter().map(|r| r.ids.len() as u64).sum::<u64>();
            st.stats.max_steps = st.stats.max_steps.max(rows.len());
            for (row, logits) in rows.into_iter().zip(results) {
                st.done.push((row.ticket, logits, row.cache));
            }
            st.leading = false;
            self.wake.notify_all();
        }
    }

    /// Waits (the lock released meanwhile) until every seated request has a step of model
    /// `me` waiting, `max_steps` are waiting, or the window has passed.
    fn gather<'a>(
        &self,
        mut st: MutexGuard<'a, State<E::Cache>>,
        me: usize,
    ) -> MutexGuard<'a, State<E::Cache>> {
        let until = Instant::now() + self.window;
        loop {
            let ready = st.waiting.iter().filter(|r| r.model == me).count();
            let now = Instant::now();
            if ready >= st.seated.max(1) || ready >= self.max_steps || now >= until {
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

impl<E: StepEngine + std::fmt::Debug + 'static> DecodeBatcher<E>
where
    E::Cache: 'static,
{
    /// Waits for this thread's turn at its first prefill (in the batcher's [`PrefillOrder`]),
    /// which it holds until it takes a decoding seat or [`with_batcher`]'s scope ends. Fails
    /// with [`EngineError::Stopped`] when this thread's stop condition says so while waiting
    /// (the turn is then given up).
    pub fn take_turn(self: &Arc<Self>) -> Result<()> {
        self.take_turn_for(TurnKind::First)
    }

    /// [`DecodeBatcher::take_turn`] for work of `kind`.
    pub fn take_turn_for(self: &Arc<Self>, kind: TurnKind) -> Result<()> {
        take_turn_at(&Arc::clone(self).into_dyn(), kind)
    }
}

/// How often a thread waiting for its prefill turn checks its stop condition.
const TURN_POLL: Duration = Duration::from_millis(20);

/// A prefill turn held by this thread; passed on when dropped.
#[derive(Debug)]
struct Turn(Arc<dyn Batching>);

impl Drop for Turn {
    fn drop(&mut self) {
        self.0.pass_turn();
    }
}

/// Gives up this thread's prefill turn, if it holds one.
fn end_turn() {
    let turn = TURN.with(|t| t.borrow_mut().take());
    drop(turn);
}

/// Up to `max` waiting rows of model `me`, oldest first.
fn take_rows<C>(waiting: &mut Vec<Row<C>>, me: usize, max: usize) -> Vec<Row<C>> {
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
fn run_pass<E: StepEngine>(engine: &E, rows: &mut [Row<E::Cache>]) -> Vec<Result<Vec<Vec<f32>>>> {
    let pass = |rows: &mut [Row<E::Cache>]| -> Result<Vec<Vec<Vec<f32>>>> {
        let mut steps: Vec<Step<'_, E::Cache>> = rows
            .iter_mut()
            .map(|r| Step {
                ids: &r.ids,
                start: r.start,
                cache: &mut r.cache,
            })
            .collect();
        let run = std::panic::AssertUnwindSafe(|| {
            crate::stop::with_stop(None, || engine.decode_steps(&mut steps))
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
            .map(|r| pass(std::slice::from_mut(r))?.pop().ok_or_else(no_row))
            .collect(),
    }
}

/// A request counted as decoding ([`DecodeBatcher::seat`]) until dropped.
#[derive(Debug)]
pub struct Seat<E: StepEngine = Model>(Arc<DecodeBatcher<E>>);

impl<E: StepEngine> Drop for Seat<E> {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.seated = st.seated.saturating_sub(1);
        // A leader waiting for this request to ask need not wait any more.
        self.0.wake.notify_all();
    }
}

thread_local! {
    static BATCHER: RefCell<Option<Arc<dyn Batching>>> = const { RefCell::new(None) };
    static TURN: RefCell<Option<Turn>> = const { RefCell::new(None) };
    /// Seats this thread holds at its installed batcher.
    static SEATED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    /// Where this thread's request's first prefill stood in line ([`take_turn_at`] with
    /// [`TurnKind::First`]), which a look at its first token keeps.
    static FIRST: std::cell::Cell<Option<WorkTurns>> = const { std::cell::Cell::new(None) };
}

/// A seat this thread took at its installed batcher ([`seat`]).
#[derive(Debug)]
pub(crate) struct LocalSeat(Arc<dyn Batching>);

impl Drop for LocalSeat {
    fn drop(&mut self) {
        self.0.leave_seat();
        SEATED.with(|n| n.set(n.get().saturating_sub(1)));
    }
}

/// A seated request doing other work (a prefill in its turn): not counted as decoding until
/// dropped, so the passes of the others do not wait for it.
struct StepAside(Arc<dyn Batching>);

impl StepAside {
    fn new(b: Arc<dyn Batching>) -> Self {
        b.leave_seat();
        Self(b)
    }
}

impl Drop for StepAside {
    fn drop(&mut self) {
        self.0.take_seat();
    }
}

/// Puts the previous batcher back when dropped (also when `f` panics), giving up a prefill
/// turn taken in the scope.
struct Restore(Option<Arc<dyn Batching>>);

impl Drop for Restore {
    fn drop(&mut self) {
        end_turn();
        FIRST.with(|f| f.set(None));
        let prev = self.0.take();
        BATCHER.with(|b| *b.borrow_mut() = prev);
    }
}

/// Runs `f` with `batcher` batching this thread's decode steps (`None`: each step alone): the
/// steps of requests on the engine it batches ([`DecodeBatcher<E>`]) share passes, and take
/// its prefill turns.
pub fn with_batcher<B: Batching + ?Sized, R>(batcher: Option<Arc<B>>, f: impl FnOnce() -> R) -> R {
    let batcher = batcher.map(Batching::into_dyn);
    let _restore = Restore(BATCHER.with(|b| b.replace(batcher)));
    f()
}

/// A seat at this thread's batcher, if one is installed; the thread's prefill turn, if it
/// holds one, passes to the next request.
pub(crate) fn seat() -> Option<LocalSeat> {
    end_turn();
    let b = installed()?;
    b.take_seat();
    SEATED.with(|n| n.set(n.get() + 1));
    Some(LocalSeat(b))
}

/// `rows` cut into the pieces this thread's batcher runs prefill work begun while decoding in
/// ([`DecodeBatcher::with_prefill_piece`]), in order: each `in_prefill_turn` of its own. One
/// piece where there is no batcher or it cuts nothing. A remainder under half a piece joins
/// the piece before it: no turn is spent on a few rows, and no piece is so short that a CPU
/// kernel chosen by row count computes it otherwise.
pub fn prefill_pieces(rows: std::ops::Range<usize>) -> Vec<std::ops::Range<usize>> {
    let piece = installed().map_or(0, |b| b.prefill_piece());
    if piece == 0 || rows.len() <= piece {
        return vec![rows];
    }
    let mut out: Vec<_> = (rows.start..rows.end)
        .step_by(piece)
        .map(|s| s..(s + piece).min(rows.end))
        .collect();
    if out.len() > 1 && out.last().is_some_and(|r| r.len() < piece.div_ceil(2)) {
        if let (Some(last), Some(before)) = (out.pop(), out.last_mut()) {
            before.end = last.end;
        }
    }
    out
}

/// Runs `f`, prefill work begun while decoding (the guard's second look or its escalation's
/// full prefill), in a prefill turn of `kind` at this thread's batcher, so it runs after the
/// prefills already waiting (as the batcher's [`PrefillOrder`] orders `kind`) rather than
/// beside one; a decoding request steps aside meanwhile, so the others' passes do not wait
/// for it. Without a batcher, or with a turn held already, runs `f` at once.
pub fn in_prefill_turn<R>(kind: TurnKind, f: impl FnOnce() -> Result<R>) -> Result<R> {
    in_prefill_turn_of(kind, &mut WorkTurns::default(), f)
}

/// [`in_prefill_turn`] for the guard's second look at a request's first token: prefill work
/// before that token, as the request's first prefill was, so it goes as a first prefill does
/// and where that prefill stood in line ([`TurnKind::FirstLook`]), ahead of requests that
/// came after it. With four clients on 2 cores a request whose first token was doubted waited
/// behind the first prefills of the three others for its look (docs/performance.md). A
/// [`TurnKind::Look`] turn where this thread took no first turn.
pub fn in_first_token_turn<R>(f: impl FnOnce() -> Result<R>) -> Result<R> {
    match FIRST.with(std::cell::Cell::get) {
        Some(mut work) => in_prefill_turn_of(TurnKind::FirstLook, &mut work, f),
        None => in_prefill_turn(TurnKind::Look, f),
    }
}

/// [`in_prefill_turn`] for one of several turns of the same work (the pieces of an
/// escalation's full prefill: [`prefill_pieces`]): `work` carries how often its turns were
/// overtaken so far, so the work in all, not each turn, is overtaken at most
/// [`MAX_OVERTAKEN`] times, and the place in line of its first turn, which each later one
/// keeps (work begun after it does not go between its pieces unless the order puts it
/// first).
pub fn in_prefill_turn_of<R>(
    kind: TurnKind,
    work: &mut WorkTurns,
    f: impl FnOnce() -> Result<R>,
) -> Result<R> {
    let held = TURN.with(|t| t.borrow().is_some());
    match installed() {
        Some(b) if !held => {
            let _aside =
                (SEATED.with(std::cell::Cell::get) > 0).then(|| StepAside::new(Arc::clone(&b)));
            *work = take_turn_after(&b, kind, *work)?;
            let out = f();
            end_turn();
            out
        }
        _ => f(),
    }
}

fn installed() -> Option<Arc<dyn Batching>> {
    BATCHER.with(|b| b.borrow().clone())
}

/// This thread's batcher, where it batches engine `E`'s steps.
fn installed_for<E: StepEngine + 'static>() -> Option<Arc<DecodeBatcher<E>>>
where
    E::Cache: 'static,
{
    installed()?.into_any().downcast::<DecodeBatcher<E>>().ok()
}

/// One decode step of token `id` at the end of `cache`: through this thread's batcher, or
/// [`Model::forward`] alone.
pub(crate) fn step(model: &Model, id: u32, cache: &mut KvCache) -> Result<Vec<f32>> {
    match installed_for::<Model>() {
        Some(b) => {
            let start = cache.len();
            b.step(model, &[id], start, cache)?.pop().ok_or_else(no_row)
        }
        None => {
            let pos = cache.len();
            let forward = model.forward(&[id], &[pos], cache, false)?;
            model.last_logits(&forward)
        }
    }
}

/// Decode-path rows of `ids` at the end of `cache` (a token and the drafts after it): through
/// this thread's batcher, or [`Model::rows_logits`] alone.
pub(crate) fn rows(model: &Model, ids: &[u32], cache: &mut KvCache) -> Result<Vec<Vec<f32>>> {
    match installed_for::<Model>() {
        Some(b) => {
            let start = cache.len();
            b.step(model, ids, start, cache)
        }
        None => model.rows_logits(cache, ids),
    }
}

/// `engine` as the CPU engine with `cache` as its cache, where it is one: the thread's batcher
/// batches the CPU engine's steps.
fn as_cpu<'a, E: Engine + 'static>(
    engine: &'a E,
    cache: &'a mut E::Cache,
) -> Option<(&'a Model, &'a mut KvCache)>
where
    E::Cache: 'static,
{
    let model = (engine as &dyn Any).downcast_ref::<Model>()?;
    let cache = (cache as &mut dyn Any).downcast_mut::<KvCache>()?;
    Some((model, cache))
}

/// [`seat`] for a request decoding on `engine`: a seat at this thread's batcher where it
/// batches that engine's steps, none otherwise.
pub(crate) fn seat_on<E: Engine + 'static>(_engine: &E) -> Option<LocalSeat>
where
    E::Cache: 'static,
{
    installed_for::<E>()?;
    seat()
}

/// One decode step of token `id` at the end of `cache` on any engine: through this thread's
/// batcher where it batches that engine (the CPU engine's as [`step`] runs it), else in a pass
/// of its own.
pub(crate) fn step_on<E: Engine + 'static>(
    engine: &E,
    id: u32,
    cache: &mut E::Cache,
) -> Result<Vec<f32>>
where
    E::Cache: 'static,
{
    if let Some((model, cache)) = as_cpu(engine, cache) {
        return step(model, id, cache);
    }
    if let Some(b) = installed_for::<E>() {
        let start = engine.cache_len(cache);
        return b
            .step(engine, &[id], start, cache)?
            .pop()
            .ok_or_else(no_row);
    }
    engine.rows(cache, &[id])?.pop().ok_or_else(no_row)
}

fn no_row() -> EngineError {
    EngineError::Internal("a batched decode step returned no row".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The order in which a request's look at its first token (or, with `first_token` false,
    /// at a later token) and two requests that came after its first prefill get their turns,
    /// all queued while a fourth holds the turn.
    fn turns_after_a_look(first_token: bool) -> Vec<&'static str> {
        let b = Arc::new(DecodeBatcher::<Model>::new(4, Duration::from_millis(20)));
        let order = Arc::new(Mutex::new(Vec::new()));
        let took = |name: &'static str, order: &Arc<Mutex<Vec<_>>>| {
            order.lock().expect("order").push(name);
            Ok(())
        };
        with_batcher(Some(Arc::clone(&b)), || {
            b.take_turn().expect("a turn");
            // Decoding begins: the turn passes on.
            end_turn();
            let holder = {
                let b = Arc::clone(&b);
                std::thread::spawn(move || {
                    with_batcher(Some(Arc::clone(&b)), || {
                        b.take_turn().expect("a turn");
                        std::thread::sleep(Duration::from_millis(400));
                    })
                })
            };
            std::thread::sleep(Duration::from_millis(50));
            let later: Vec<_> = ["second", "third"]
                .into_iter()
                .map(|name| {
                    std::thread::sleep(Duration::from_millis(20));
                    let (b, order) = (Arc::clone(&b), Arc::clone(&order));
                    std::thread::spawn(move || {
                        with_batcher(Some(Arc::clone(&b)), || {
                            b.take_turn().expect("a turn");
                            took(name, &order)
                        })
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(100));
            if first_token {
                in_first_token_turn(|| took("look", &order)).expect("its turn");
            } else {
                in_prefill_turn(TurnKind::Look, || took("look", &order)).expect("its turn");
            }
            for t in later {
                t.join().expect("no panic").expect("a turn");
            }
            holder.join().expect("no panic");
        });
        Arc::try_unwrap(order)
            .expect("every thread joined")
            .into_inner()
            .expect("order")
    }

    #[test]
    fn a_look_at_the_first_token_goes_before_requests_that_came_after() {
        assert_eq!(turns_after_a_look(true), ["look", "second", "third"]);
        // A look at a later token waits behind first prefills (the default order).
        assert_eq!(turns_after_a_look(false), ["second", "third", "look"]);
    }
}
