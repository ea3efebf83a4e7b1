//! The engine thread: where model work is scheduled, behind a bounded queue. Handlers submit
//! jobs and wait on a channel; a full queue is refused at once (429), a job found past its
//! deadline is not started (504), and a query whose client went away or whose deadline passed
//! stops at its next token.
//!
//! Queries run on up to `max_batch` query threads at once, whose decode steps one
//! [`target_engine::DecodeBatcher`] runs together (one pass over the weights for every
//! request decoding) and whose prefills take turns, first come first served, beside those
//! passes; the engine thread hands a query to a free thread and takes the next job when one
//! is free. Ingestion, deletion and garbage sweeps run on the engine thread alone,
//! once the running queries have finished; the queries that arrive meanwhile run between
//! their chunks or slices, batched with each other.

use crate::error::GatewayError;
use crate::ingest::{IngestConfig, IngestReport};
use crate::input::{InputProblem, SourceDoc};
use crate::metrics::Metrics;
use crate::pipeline::{Answer, Piece, Pipeline, Query};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// What a running query reports.
#[derive(Debug)]
pub enum QueryEvent {
    /// A piece of the answer.
    Text(String),
    /// Verification: drafted text (not final), text now final, drafted tokens withdrawn.
    Draft(String),
    Commit(String),
    Retract(usize),
    /// The fidelity guard moved to the full cache: the text so far is this text.
    Replace(String),
    /// The finished answer.
    Done(Box<Answer>),
    /// The query failed or ran past its deadline.
    Failed(JobError),
}

/// Why a job did not produce a result.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error(transparent)]
    Gateway(#[from] GatewayError),
    /// The request's deadline passed (in the queue or while running).
    #[error("the request did not finish within its deadline")]
    Deadline,
}

/// Work for the engine thread.
#[derive(Debug)]
pub enum Job {
    Query {
        query: Query,
        deadline: Instant,
        events: mpsc::Sender<QueryEvent>,
    },
    /// Commits batch by batch; a client that leaves (its `reply` or `progress` receiver
    /// dropped) stops it at the next chunk, and queries waiting meanwhile run between chunks.
    Ingest {
        docs: Vec<SourceDoc>,
        cfg: IngestConfig,
        reply: oneshot::Sender<Result<(IngestReport, Vec<InputProblem>), JobError>>,
        /// Batches as they commit and skipped documents as they are found (for a streamed
        /// answer).
        progress: Option<mpsc::UnboundedSender<IngestProgress>>,
    },
    Delete {
        collection: String,
        id: String,
        /// The document log entry of another node this applies (`None`: a local deletion,
        /// appended to the shared document log where there is one).
        applying: Option<String>,
        reply: oneshot::Sender<Result<usize, JobError>>,
    },
}

/// How long a batched decode step waits for the other decoding requests to ask for theirs:
/// a small share of a step (tens of milliseconds on the CPU), so a request busy elsewhere (a
/// slow client, the guard's second look) holds the others up for at most this long.
pub const BATCH_WINDOW: Duration = Duration::from_millis(4);

/// Keys a garbage sweep removes before it lets waiting queries run.
pub const SWEEP_SLICE: usize = 64;

/// How long the engine waits for a job at a time while a garbage listing is under way, so it
/// notices the listing's end without a job arriving.
const LISTING_POLL: Duration = Duration::from_millis(200);

/// How long the engine waits idle for the next job before it returns freed memory to the
/// system (`process::release_free_memory`): longer than a closed-loop client takes to send
/// its next request, short beside the time a server sits idle.
const TRIM_AFTER_IDLE: Duration = Duration::from_millis(250);

/// What a running ingestion reports to a streaming client.
#[derive(Debug)]
pub enum IngestProgress {
    /// These documents are durable and searchable.
    Committed(Vec<String>),
    /// A document was skipped.
    Problem(InputProblem),
}

/// Why a job was not queued.
#[derive(Debug)]
pub enum SubmitError {
    /// The queue is full (429).
    Busy,
    /// The engine thread is gone (500).
    Stopped,
    /// A query the loaded models cannot serve ([`Pipeline::check`]).
    Refused(GatewayError),
}

/// A cheap, cloneable handle to the engine thread.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    /// The engine's pipeline, which checks a query before it is queued.
    pipeline: Arc<Pipeline>,
    tx: SyncSender<(Job, Instant)>,
    depth: Arc<AtomicUsize>,
    capacity: usize,
}

impl EngineHandle {
    /// Queues `job`, or says the queue is full. A query is checked first
    /// ([`Pipeline::check`]), so the queue holds only queries the engine can serve and the
    /// engine thread does not check them again.
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        if let Job::Query { query, .. } = &job {
            self.pipeline.check(query).map_err(SubmitError::Refused)?;
        }
        self.depth.fetch_add(1, Ordering::SeqCst);
        match self.tx.try_send((job, Instant::now())) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.depth.fetch_sub(1, Ordering::SeqCst);
                Err(match e {
                    TrySendError::Full(_) => SubmitError::Busy,
                    TrySendError::Disconnected(_) => SubmitError::Stopped,
                })
            }
        }
    }

    /// Jobs waiting (not yet started).
    pub fn depth(&self) -> usize {
        self.depth.load(Ordering::SeqCst)
    }

    /// Most jobs that can wait.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

/// How many queries run at once (their decode steps batched) and the order their prefills
/// take turns in.
#[derive(Debug, Clone, Copy)]
pub struct Batching {
    pub max: usize,
    pub order: target_engine::PrefillOrder,
    /// Rows of an escalation's full prefill run per turn (0: all in one turn).
    pub piece: usize,
}

/// Starts the engine thread over `pipeline` with room for `capacity` waiting jobs, running
/// queries as `batching` says; a first full garbage collection is listed at once, off the
/// engine thread.
pub fn start(
    pipeline: Arc<Pipeline>,
    capacity: usize,
    batching: Batching,
    metrics: Arc<Metrics>,
) -> EngineHandle {
    let (tx, rx) = sync_channel::<(Job, Instant)>(capacity.max(1));
    let depth = Arc::new(AtomicUsize::new(0));
    let handle_pipeline = Arc::clone(&pipeline);
    let d = depth.clone();
    std::thread::Builder::new()
        .name("specrag-engine".into())
        .spawn(move || {
            let mut engine = Engine {
                pipeline: &pipeline,
                shared: Arc::clone(&pipeline),
                metrics: &metrics,
                workers: Workers::new(batching, Arc::clone(&pipeline), Arc::clone(&metrics)),
                rx: &rx,
                depth: &d,
                deferred: VecDeque::new(),
                capacity: capacity.max(1),
                listing: None,
            };
            engine.want_sweep();
            // A job is taken off the queue only once a query thread is free, so what waits
            // stays in the queue, counted and bounded.
            while let Some((job, queued)) = {
                engine.workers.wait_for_room();
                engine.next_job()
            } {
                d.fetch_sub(1, Ordering::SeqCst);
                metrics.queued(queued.elapsed());
                guarded(|| engine.run(job, queued));
            }
        })
        .map_or_else(
            |e| tracing::error!("cannot start the engine thread: {e}"),
            |_| (),
        );
    EngineHandle {
        pipeline: handle_pipeline,
        tx,
        depth,
        capacity: capacity.max(1),
    }
}

/// Garbage listed by a collector thread, and how many commits the index had seen then.
struct Listing {
    keys: Vec<chunkstore::ChunkKey>,
    commits: u64,
}

/// How long the engine waits for a reader that does not take its events (a stalled stream)
/// before treating the client as gone.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// Sends `event`, waiting at most `timeout` for room; false when the reader is gone or
/// stalled, so a client that stops reading can never park the engine thread.
fn send_within(events: &mpsc::Sender<QueryEvent>, event: QueryEvent, timeout: Duration) -> bool {
    let until = Instant::now() + timeout;
    let mut event = event;
    loop {
        match events.try_send(event) {
            Ok(()) => return true,
            Err(mpsc::error::TrySendError::Closed(_)) => return false,
            Err(mpsc::error::TrySendError::Full(e)) => {
                if Instant::now() >= until {
                    tracing::warn!("a client stopped reading its stream; dropping it");
                    return false;
                }
                event = e;
                std::thread::sleep(Duration::from_millis(2));
            }
        }
    }
}

/// Runs `f`, logging a panic instead of ending the engine thread: a panic in one job must not
/// take the engine down for every later request; the job's channels are dropped, which its
/// handler reports as a 500.
fn guarded(f: impl FnOnce()) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
        tracing::error!("a job panicked on the engine thread; continuing");
    }
}

/// The engine thread's state.
struct Engine<'a> {
    pipeline: &'a Pipeline,
    /// The same pipeline, for a collector thread to list garbage on.
    shared: Arc<Pipeline>,
    /// The garbage listing under way on a collector thread, if any.
    listing: Option<std::sync::mpsc::Receiver<Listing>>,
    metrics: &'a Metrics,
    /// The query threads.
    workers: Workers,
    rx: &'a std::sync::mpsc::Receiver<(Job, Instant)>,
    depth: &'a AtomicUsize,
    /// Jobs taken off the queue during an ingestion (to reach the queries behind them) that
    /// run after it, in order; still counted in `depth`.
    deferred: VecDeque<(Job, Instant)>,
    /// At most this many jobs are deferred, so the queue bound still holds (twice over).
    capacity: usize,
}

impl Engine<'_> {
    /// The next job: a deferred one, else one from the queue; while idle, a finished garbage
    /// listing is swept first. `None` once every handle is gone.
    fn next_job(&mut self) -> Option<(Job, Instant)> {
        use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
        let mut released = false;
        loop {
            if let Some(job) = self.deferred.pop_front() {
                return Some(job);
            }
            match self.rx.try_recv() {
                Ok(job) => return Some(job),
                Err(TryRecvError::Disconnected) => return None,
                Err(TryRecvError::Empty) => {}
            }
            if let Some(done) = self.listing.as_ref().map(|l| l.try_recv()) {
                match done {
                    Ok(listing) => {
                        self.listing = None;
                        self.sweep(listing);
                        continue;
                    }
                    Err(TryRecvError::Disconnected) => self.listing = None,
                    Err(TryRecvError::Empty) => {}
                }
            }
            // Idle: hand the last job's freed buffers back to the system (the allocator
            // keeps them otherwise, see process::init), once, not at every poll for a listing,
            // and only when no job comes within TRIM_AFTER_IDLE: the trim takes 10-20 ms after
            // a request, which a client's next request would otherwise wait behind.
            if !released {
                match self.rx.recv_timeout(TRIM_AFTER_IDLE) {
                    Ok(job) => return Some(job),
                    Err(RecvTimeoutError::Disconnected) => return None,
                    Err(RecvTimeoutError::Timeout) => {}
                }
                crate::process::release_free_memory();
                released = true;
                continue;
            }
            if self.listing.is_none() {
                return self.rx.recv().ok();
            }
            match self.rx.recv_timeout(LISTING_POLL) {
                Ok(job) => return Some(job),
                Err(RecvTimeoutError::Disconnected) => return None,
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
    }

    /// Lists garbage on a collector thread (unless a listing is under way): the pass over
    /// every chunk record and every KV file runs there, beside queries, not before them.
    fn want_sweep(&mut self) {
        if self.listing.is_some() {
            return;
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let p = Arc::clone(&self.shared);
        let spawned = std::thread::Builder::new()
            .name("specrag-gc".into())
            .spawn(move || {
                let commits = p.corpus.index.commits();
                match p.corpus.garbage_candidates(&p.engines) {
                    Ok(keys) => {
                        let _ = tx.send(Listing { keys, commits });
                    }
                    Err(e) => tracing::warn!("garbage collection skipped: {e}"),
                }
            });
        match spawned {
            Ok(_) => self.listing = Some(rx),
            Err(e) => tracing::warn!("garbage collection skipped: no thread: {e}"),
        }
    }

    /// Removes a listing's garbage in slices of [`SWEEP_SLICE`] keys, running the queries
    /// that arrive meanwhile between slices. A listing the index outran (a commit since: a
    /// speculator companion it names may belong to a chunk indexed since) is listed again.
    fn sweep(&mut self, listing: Listing) {
        let Listing { keys, commits } = listing;
        self.workers.drain();
        let corpus = &self.pipeline.corpus;
        let mut removed = 0;
        for slice in keys.chunks(SWEEP_SLICE) {
            if corpus.index.commits() != commits {
                self.want_sweep();
                break;
            }
            match corpus.remove_garbage(slice) {
                Ok(n) => removed += n,
                Err(e) => {
                    tracing::warn!("garbage collection stopped: {e}");
                    break;
                }
            }
            self.serve_waiting_queries();
        }
        if removed > 0 {
            if let Err(e) = chunkstore::ChunkStore::flush(&corpus.store) {
                tracing::warn!("flushing after garbage collection: {e}");
            }
            tracing::info!(removed, "removed chunk KV no indexed chunk refers to");
        }
    }

    /// Runs `job`, queued at `queued`.
    fn run(&mut self, job: Job, queued: Instant) {
        if !matches!(job, Job::Query { .. }) {
            self.workers.drain();
        }
        match job {
            Job::Ingest {
                docs,
                cfg,
                reply,
                progress,
            } => self.ingest(docs, &cfg, reply, progress),
            Job::Query {
                query,
                deadline,
                events,
            } => self.workers.dispatch(query, deadline, events, queued),
            Job::Delete {
                collection,
                id,
                applying,
                reply,
            } => {
                let out = crate::ingest::delete_document(
                    &self.pipeline.corpus,
                    &self.pipeline.engines,
                    &collection,
                    &id,
                    applying.as_deref(),
                )
                .map_err(JobError::from);
                let _ = reply.send(out);
            }
        }
    }

    /// Runs the queries waiting in the queue now (batched with each other) and waits for them
    /// to finish; other jobs wait in `deferred` until the running ingestion ends (while there
    /// is room).
    fn serve_waiting_queries(&mut self) {
        while self.deferred.len() < self.capacity {
            let Ok((job, queued)) = self.rx.try_recv() else {
                break;
            };
            match job {
                Job::Query {
                    query,
                    deadline,
                    events,
                } => {
                    self.depth.fetch_sub(1, Ordering::SeqCst);
                    self.metrics.queued(queued.elapsed());
                    self.workers.dispatch(query, deadline, events, queued);
                }
                job => self.deferred.push_back((job, queued)),
            }
        }
        self.workers.drain();
    }

    fn ingest(
        &mut self,
        docs: Vec<SourceDoc>,
        cfg: &IngestConfig,
        reply: oneshot::Sender<Result<(IngestReport, Vec<InputProblem>), JobError>>,
        progress: Option<mpsc::UnboundedSender<IngestProgress>>,
    ) {
        let gone = |reply: &oneshot::Sender<_>| {
            reply.is_closed() || progress.as_ref().is_some_and(|p| p.is_closed())
        };
        if gone(&reply) {
            return;
        }
        let mut problems = Vec::new();
        let (pipeline, report_to) = (self.pipeline, progress.clone());
        let out = crate::ingest::ingest_until(
            &pipeline.corpus,
            &pipeline.engines,
            docs,
            cfg,
            |e| match e {
                crate::ingest::IngestEvent::Problem(p) => {
                    if let Some(tx) = &report_to {
                        let _ = tx.send(IngestProgress::Problem(p.clone()));
                    }
                    problems.push(p);
                }
                crate::ingest::IngestEvent::Committed { documents } => {
                    if let Some(tx) = &report_to {
                        let _ = tx.send(IngestProgress::Committed(documents));
                    }
                }
                _ => {}
            },
            // Between chunks: queries that arrived meanwhile wait at most one chunk's
            // precompute, and a client that went away stops the work, so queries do not wait
            // for documents nobody will be told about.
            &mut || {
                self.serve_waiting_queries();
                gone(&reply)
            },
        );
        if out.is_err() {
            // A batch rolled back leaves blobs no chunk refers to.
            self.want_sweep();
        }
        let _ = reply.send(out.map(|r| (r, problems)).map_err(JobError::from));
    }
}

/// The query threads: at most `max` queries run at once, each on its own thread with the
/// shared decode batcher installed.
struct Workers {
    max: usize,
    /// Queries running now.
    running: Arc<(std::sync::Mutex<usize>, std::sync::Condvar)>,
    batcher: Arc<dyn target_engine::Batching>,
    pipeline: Arc<Pipeline>,
    metrics: Arc<Metrics>,
}

impl Workers {
    fn new(batching: Batching, pipeline: Arc<Pipeline>, metrics: Arc<Metrics>) -> Self {
        let max = batching.max.max(1);
        // The batcher of the target's engine: its requests' decode steps share passes.
        let batcher: Arc<dyn target_engine::Batching> = match &pipeline.engines.target {
            crate::target::Target::Cpu(_) => Arc::new(
                target_engine::DecodeBatcher::<target_engine::Model>::new(max, BATCH_WINDOW)
                    .with_prefill_order(batching.order)
                    .with_prefill_piece(batching.piece),
            ),
            crate::target::Target::Device(_) => Arc::new(
                target_engine::DecodeBatcher::<target_engine::device::DeviceModel>::new(
                    max,
                    BATCH_WINDOW,
                )
                .with_prefill_order(batching.order)
                .with_prefill_piece(batching.piece),
            ),
        };
        metrics.set_batcher(Arc::clone(&batcher));
        Self {
            max,
            running: Arc::new((std::sync::Mutex::new(0), std::sync::Condvar::new())),
            batcher,
            pipeline,
            metrics,
        }
    }

    /// Waits until fewer than `at_most` queries run.
    fn wait_below(&self, at_most: usize) {
        let (count, freed) = &*self.running;
        let mut n = count.lock().unwrap_or_else(|e| e.into_inner());
        while *n >= at_most {
            n = freed.wait(n).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Waits until no query runs.
    fn drain(&self) {
        self.wait_below(1);
    }

    /// Waits until another query can start.
    fn wait_for_room(&self) {
        self.wait_below(self.max);
    }

    /// Runs the query on a thread of its own once one of the `max` is free (so the queue, not
    /// the threads, holds what waits).
    fn dispatch(
        &self,
        query: Query,
        deadline: Instant,
        events: mpsc::Sender<QueryEvent>,
        queued: Instant,
    ) {
        self.wait_for_room();
        let (count, _) = &*self.running;
        *count.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        let done = Done(Arc::clone(&self.running));
        let (pipeline, metrics) = (Arc::clone(&self.pipeline), Arc::clone(&self.metrics));
        let batcher = Arc::clone(&self.batcher);
        let job = move || {
            let _done = done;
            guarded(|| {
                target_engine::with_batcher(Some(Arc::clone(&batcher)), || {
                    run_query(
                        &pipeline,
                        &metrics,
                        Asked {
                            query: &query,
                            deadline,
                            queued,
                        },
                        &events,
                        Some(&batcher),
                    )
                })
            });
        };
        // Where no thread can be had the job is dropped with its channel, which its handler
        // reports as a 500 (as for a panic), and its slot is freed.
        let spawned = std::thread::Builder::new()
            .name("specrag-query".into())
            .spawn(job);
        if let Err(e) = spawned {
            tracing::error!("cannot start a query thread: {e}; the query is dropped");
        }
    }
}

/// Counts a query as finished when dropped (also when it panicked).
struct Done(Arc<(std::sync::Mutex<usize>, std::sync::Condvar)>);

impl Drop for Done {
    fn drop(&mut self) {
        let (count, freed) = &*self.0;
        let mut n = count.lock().unwrap_or_else(|e| e.into_inner());
        *n = n.saturating_sub(1);
        freed.notify_all();
    }
}

/// A query as the engine runs it: when it must be done by and when it was queued.
struct Asked<'a> {
    query: &'a Query,
    deadline: Instant,
    queued: Instant,
}

/// Runs one query (checked when it was queued: [`EngineHandle::submit`]), reporting through
/// `events`; a query found past its deadline is not started, and a late or abandoned one
/// stops within one layer. Its answer's times count from when it was queued: `queue_ms` is
/// the wait in the queue and for its first prefill turn, and `ttft_ms`, `total_ms` and
/// verification's `first_commit_ms` include it, as a client measures them.
fn run_query(
    pipeline: &Pipeline,
    metrics: &Metrics,
    asked: Asked<'_>,
    events: &mpsc::Sender<QueryEvent>,
    turns: Option<&Arc<dyn target_engine::Batching>>,
) {
    let Asked {
        query,
        deadline,
        queued,
    } = asked;
    if events.is_closed() {
        return;
    }
    if Instant::now() > deadline {
        metrics.timeout();
        let _ = send_within(events, QueryEvent::Failed(JobError::Deadline), SEND_TIMEOUT);
        return;
    }
    let mut late = false;
    let mut waited = Duration::ZERO;
    // Checked before every layer of every forward pass this query runs (its threads
    // included), so a late or abandoned query frees the engine within one layer.
    let watched = events.clone();
    let stop: target_engine::stop::StopFn =
        Arc::new(move || Instant::now() > deadline || watched.is_closed());
    let result = target_engine::stop::with_stop(Some(stop), || {
        // Prefills take turns; the turn passes on when this query starts decoding.
        if let Some(b) = turns {
            target_engine::take_turn_at(b, target_engine::TurnKind::First)?;
        }
        waited = queued.elapsed();
        pipeline.query_checked(query, &mut |piece| {
            if Instant::now() > deadline {
                late = true;
                return false;
            }
            let event = match piece {
                Piece::Token(t) => QueryEvent::Text(t.to_string()),
                Piece::Draft(t) => QueryEvent::Draft(t.to_string()),
                Piece::Commit(t) => QueryEvent::Commit(t.to_string()),
                Piece::Retract(n) => QueryEvent::Retract(n),
                Piece::Replace(t) => QueryEvent::Replace(t.to_string()),
            };
            send_within(events, event, SEND_TIMEOUT)
        })
    });
    let stopped = matches!(
        result,
        Err(GatewayError::Engine(target_engine::EngineError::Stopped))
    );
    let event = match result {
        _ if stopped && Instant::now() <= deadline => return, // the client left
        Err(_) if stopped => {
            metrics.timeout();
            QueryEvent::Failed(JobError::Deadline)
        }
        Ok(_) if late || Instant::now() > deadline => {
            metrics.timeout();
            QueryEvent::Failed(JobError::Deadline)
        }
        Ok(mut answer) => {
            answer.add_wait(waited);
            metrics.answer(&answer);
            QueryEvent::Done(Box::new(answer))
        }
        Err(e) => QueryEvent::Failed(e.into()),
    };
    let _ = send_within(events, event, SEND_TIMEOUT);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stalled_reader_is_given_up_after_the_timeout() {
        let (tx, mut rx) = mpsc::channel(1);
        let wait = Duration::from_millis(50);
        assert!(send_within(&tx, QueryEvent::Retract(1), wait));
        let t = Instant::now();
        assert!(
            !send_within(&tx, QueryEvent::Retract(2), wait),
            "full and unread"
        );
        assert!(t.elapsed() >= wait);
        assert!(matches!(rx.try_recv(), Ok(QueryEvent::Retract(1))));
        assert!(send_within(&tx, QueryEvent::Retract(3), wait), "room again");
        drop(rx);
        assert!(
            !send_within(&tx, QueryEvent::Retract(4), wait),
            "reader gone"
        );
    }
}
