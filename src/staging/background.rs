//! The background filler: one thread that runs staged copies for a caller
//! that must not spend its own time filling staging buffers.
//!
//! A staged copy costs the thread that issues it the whole fill (host
//! memcpy into pinned buffers, ~40–47 GB/s on the H200 with 12 fill
//! threads), because `htod` returns only once the last chunk is enqueued.
//! When that thread is also the one launching the model's kernels (a Python
//! decode loop prefetching the next weight in a release hook), the fill and
//! the launches take turns: on a decoder whose compute per token is not far
//! below its PCIe time, staged page-ins ran at half the speed of registered
//! ones. Here the prefetch is queued instead: [`BackgroundFill::htod_after`]
//! returns at once with a *pending* [`Fence`], this thread issues the copy
//! (as the calling thread of the engine's fill threads) and then sets the
//! fence's event. The caller's next `acquire` of that weight blocks only if
//! the fill has not been enqueued yet — the host stall is then the fill
//! falling behind, which is real and counted.
//!
//! Ordering. A copy into memory that earlier readers may still use is
//! ordered after an event recorded on the caller's order stream *when the
//! copy is queued* (so the waits the caller put on that stream before are the
//! ones that count), and the copy stream waits for it before the first
//! chunk. Nothing may make a stream wait on a pending fence: [`Fence`]'s
//! methods wait for the event to exist first.
//!
//! Lifetime. Jobs run in the order they were queued. [`BackgroundFill::drain`]
//! returns once every queued job has been enqueued (or has failed): before
//! a device synchronize is taken as proof that no copy touches some memory,
//! drain first, since a queued job is not on any stream yet. Dropping drains
//! and joins the thread. A job that panics sets its fence to an error
//! instead of leaving waiters blocked.
//!
//! Filling ahead. Between jobs this thread idles while the caller runs the
//! kernels and hooks that lead to the next job (a decode loop's next
//! `release`), and each job then starts with a fill no DMA overlaps. A job
//! may carry a [`Hint`]: the source the caller expects to queue next. With
//! `ahead_chunks` > 0, once a job is issued and no other is queued, this
//! thread fills the hinted source's first chunks
//! ([`CopyEngine::fill_ahead`]), checking for a new job before each chunk;
//! the next job of that source starts with them filled.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::engine::{AheadTicket, CopyEngine, Deferred, Fence, Order};
use crate::device::{DevicePtr, Event, HostRange, RawStream};
use crate::error::{Error, Result};

struct Job {
    dst: DevicePtr,
    src: HostRange,
    after: Option<Event>,
    done: Arc<Deferred>,
    next: Option<Hint>,
}

/// The source a caller expects its next staged copy to be from, with the
/// engine's ticket taken while that source was known to be readable
/// ([`CopyEngine::ahead_ticket`]); [`CopyEngine::forget_ahead`] cancels it.
#[derive(Debug, Clone, Copy)]
pub struct Hint {
    pub src: HostRange,
    pub ticket: AheadTicket,
}

/// Sets the job's fence to an error if the job ends without setting it (a
/// panic inside the copy), so no waiter blocks for ever.
struct SetOnExit(Arc<Deferred>);

impl Drop for SetOnExit {
    fn drop(&mut self) {
        if !self.0.is_set() {
            self.0.set(Err(Error::internal("a background page-in copy panicked")));
        }
    }
}

/// A thread issuing staged copies on a [`CopyEngine`]; see the module docs.
pub struct BackgroundFill {
    engine: Arc<CopyEngine>,
    tx: Mutex<Option<Sender<Job>>>,
    /// The fence of the last job queued (jobs complete in order).
    last: Mutex<Option<Arc<Deferred>>>,
    /// Nanoseconds the thread spent on jobs and filling ahead (not waiting).
    busy_ns: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for BackgroundFill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackgroundFill").finish_non_exhaustive()
    }
}

impl BackgroundFill {
    /// Start the thread. Between jobs it fills up to `ahead_chunks` chunks
    /// of a job's [`Hint`] ahead (0: never; see the module docs).
    pub fn new(engine: &Arc<CopyEngine>, ahead_chunks: usize) -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let e = engine.clone();
        let busy_ns = Arc::new(AtomicU64::new(0));
        let busy = busy_ns.clone();
        let thread = std::thread::Builder::new()
            .name("epmem-fill".into())
            .spawn(move || run(&e, &rx, ahead_chunks, &busy))
            .map_err(|err| Error::internal(format!("starting the background fill thread: {err}")))?;
        Ok(Self {
            engine: engine.clone(),
            tx: Mutex::new(Some(tx)),
            last: Mutex::new(None),
            busy_ns,
            thread: Some(thread),
        })
    }

    /// Copy `src` to `dst`, ordered after the work queued on `order` so far
    /// (if given). A staged copy is queued for the thread and the fence comes
    /// back pending; a direct one (page-locked source, no fill) is issued
    /// here, as `htod` would. `src` must stay readable and unmodified until
    /// the fence completes — as for `htod`, but here that includes the fill.
    /// `next`, if given, is the source the caller expects to queue next.
    pub fn htod_after(
        &self,
        dst: DevicePtr,
        src: HostRange,
        order: Option<RawStream>,
        next: Option<Hint>,
    ) -> Result<Fence> {
        if !self.engine.stages(src) {
            return self.engine.htod(dst, src, order);
        }
        let after = match order {
            Some(s) => {
                let e = self.engine.events().take()?;
                e.record_raw(s)?;
                Some(e)
            }
            None => None,
        };
        let done = Arc::new(Deferred::default());
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        let Some(tx) = tx.as_ref() else {
            return Err(Error::internal("the background fill thread has stopped"));
        };
        tx.send(Job { dst, src, after, done: done.clone(), next })
            .map_err(|_| Error::internal("the background fill thread has stopped"))?;
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(done.clone());
        Ok(Fence::deferred(self.engine.device(), done, src.len()))
    }

    /// Time the thread has spent issuing copies and filling ahead (the rest
    /// of its life it waited for work).
    pub fn busy(&self) -> Duration {
        Duration::from_nanos(self.busy_ns.load(Ordering::Relaxed))
    }

    /// Block until every copy queued so far has been enqueued on the copy
    /// stream (or failed). Its completion is still the fences' business.
    pub fn drain(&self) {
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(d) = last {
            d.wait_set();
        }
    }
}

impl Drop for BackgroundFill {
    fn drop(&mut self) {
        // Closing the channel ends the thread after the jobs already queued.
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            log::error!("epmem: the background fill thread panicked");
        }
    }
}

/// Who issues a page-in copy: the engine on the calling thread, or the
/// background filler's thread.
#[derive(Debug, Clone, Copy)]
pub enum Copier<'a> {
    Caller(&'a CopyEngine),
    /// The filler, with the source expected after this copy (if any).
    Background(&'a BackgroundFill, Option<Hint>),
}

impl Copier<'_> {
    /// Copy `src` to `dst` after the work queued on `order` so far (if given).
    pub fn htod_after(&self, dst: DevicePtr, src: HostRange, order: Option<RawStream>) -> Result<Fence> {
        match self {
            Copier::Caller(e) => e.htod(dst, src, order),
            Copier::Background(b, next) => b.htod_after(dst, src, order, *next),
        }
    }
}

fn run(engine: &CopyEngine, rx: &Receiver<Job>, ahead_chunks: usize, busy_ns: &AtomicU64) {
    let add_busy = |t0: Instant| {
        busy_ns.fetch_add(u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    };
    // A job that arrived while filling ahead, taken before the next `recv`.
    let mut queued: Option<Job> = None;
    loop {
        let job = match queued.take() {
            Some(j) => j,
            None => match rx.recv() {
                Ok(j) => j,
                Err(_) => return,
            },
        };
        let next = job.next;
        let t0 = Instant::now();
        let guard = SetOnExit(job.done.clone());
        let order = job.after.as_ref().map_or(Order::None, Order::After);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| engine.htod_ordered(job.dst, job.src, order)));
        match r {
            Ok(Ok(fence)) => match fence.into_event() {
                Some(e) => job.done.set(Ok(e)),
                None => job.done.set(Err(Error::internal("a background copy came back pending"))),
            },
            Ok(Err(e)) => job.done.set(Err(e)),
            Err(_) => {} // the guard sets the error
        }
        drop(guard);
        add_busy(t0);
        if let Some(h) = next.filter(|_| ahead_chunks > 0) {
            let t0 = Instant::now();
            let mut stop = || match rx.try_recv() {
                Ok(j) => {
                    queued = Some(j);
                    true
                }
                Err(TryRecvError::Empty) => false,
                Err(TryRecvError::Disconnected) => true,
            };
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                engine.fill_ahead(h.src, h.ticket, ahead_chunks, &mut stop)
            }));
            if r.is_err() {
                log::error!("epmem: filling ahead panicked; the next copy fills as usual");
            }
            add_busy(t0);
        }
    }
}
