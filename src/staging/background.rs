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

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use super::engine::{CopyEngine, Deferred, Fence, Order};
use crate::device::{DevicePtr, Event, HostRange, RawStream};
use crate::error::{Error, Result};

struct Job {
    dst: DevicePtr,
    src: HostRange,
    after: Option<Event>,
    done: Arc<Deferred>,
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
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for BackgroundFill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackgroundFill").finish_non_exhaustive()
    }
}

impl BackgroundFill {
    /// Start the thread.
    pub fn new(engine: &Arc<CopyEngine>) -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let e = engine.clone();
        let thread = std::thread::Builder::new()
            .name("epmem-fill".into())
            .spawn(move || run(&e, &rx))
            .map_err(|err| Error::internal(format!("starting the background fill thread: {err}")))?;
        Ok(Self {
            engine: engine.clone(),
            tx: Mutex::new(Some(tx)),
            last: Mutex::new(None),
            thread: Some(thread),
        })
    }

    /// Copy `src` to `dst`, ordered after the work queued on `order` so far
    /// (if given). A staged copy is queued for the thread and the fence comes
    /// back pending; a direct one (page-locked source, no fill) is issued
    /// here, as `htod` would. `src` must stay readable and unmodified until
    /// the fence completes — as for `htod`, but here that includes the fill.
    pub fn htod_after(&self, dst: DevicePtr, src: HostRange, order: Option<RawStream>) -> Result<Fence> {
        if !self.engine.stages(src) {
            return self.engine.htod(dst, src, order);
        }
        let after = match order {
            Some(s) => {
                let e = Event::new(self.engine.device(), false)?;
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
        tx.send(Job { dst, src, after, done: done.clone() })
            .map_err(|_| Error::internal("the background fill thread has stopped"))?;
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(done.clone());
        Ok(Fence::deferred(self.engine.device(), done, src.len()))
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
    Background(&'a BackgroundFill),
}

impl Copier<'_> {
    /// Copy `src` to `dst` after the work queued on `order` so far (if given).
    pub fn htod_after(&self, dst: DevicePtr, src: HostRange, order: Option<RawStream>) -> Result<Fence> {
        match self {
            Copier::Caller(e) => e.htod(dst, src, order),
            Copier::Background(b) => b.htod_after(dst, src, order),
        }
    }
}

fn run(engine: &CopyEngine, rx: &Receiver<Job>) {
    while let Ok(job) = rx.recv() {
        let guard = SetOnExit(job.done.clone());
        let order = job.after.as_ref().map_or(Order::None, Order::After);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            engine.htod_ordered(job.dst, job.src, order)
        }));
        match r {
            Ok(Ok(fence)) => match fence.into_event() {
                Some(e) => job.done.set(Ok(e)),
                None => job.done.set(Err(Error::internal("a background copy came back pending"))),
            },
            Ok(Err(e)) => job.done.set(Err(e)),
            Err(_) => {} // the guard sets the error
        }
        drop(guard);
    }
}
