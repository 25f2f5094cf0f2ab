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
//! Device-side waits. Where the device has stream values
//! ([`Device::stream_values`]: CUDA's 64-bit stream memory operations), the
//! copy stream also writes the job's number to a device word after each
//! copy, and a stream that must wait for a copy not yet enqueued waits on
//! the device for that number ([`Fence::make_wait`]) instead of the host
//! waiting for the fill. Then the caller's thread never waits for a fill: it
//! launches the model's next kernels while the filler works, and the filler
//! always has the next copy queued. (On the H200 with the host waiting, the
//! filler sat idle while the caller ran each layer's hooks between its fill
//! and the next: staged ran at 0.52–0.88 × registered, docs/BENCHMARKS.md.)
//! Jobs run in order on the one copy stream, so one word with increasing
//! numbers serves them all. A job that fails still writes its number, so no
//! stream waits for ever; the kernels already queued behind it then read
//! whatever the memory held, so the failure is kept and reported by the
//! caller's next call ([`BackgroundFill::take_failure`]) — as CUDA reports an
//! asynchronous error at the next call — besides the fence's own error.
//! The word is freed only after a device synchronize: a stream may still be
//! about to wait on it.
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

use super::engine::{CopyEngine, Deferred, Fence, Order, Signal};
use crate::device::{Device, DevicePtr, Event, HostRange, PinnedBuffer, RawStream, Stream};
use crate::error::{Error, Result};

struct Job {
    dst: DevicePtr,
    src: HostRange,
    after: Option<Event>,
    done: Arc<Deferred>,
    signal: Option<Signal>,
}

/// The word jobs' numbers are written to: pinned host memory, which the
/// device addresses directly (so a manager holds no device memory beyond its
/// arena). Freed after a device synchronize (a stream may still be about to
/// wait on it), leaked if that fails.
#[derive(Debug)]
struct Word {
    dev: Arc<dyn Device>,
    buf: Option<PinnedBuffer>,
}

impl Word {
    fn new(dev: &Arc<dyn Device>) -> Result<Self> {
        let mut buf = PinnedBuffer::new(dev, 8)?;
        // Zeroed before any stream knows the word; never touched by the host after.
        buf.fill(0);
        let w = Self { dev: dev.clone(), buf: Some(buf) };
        // A driver that refuses the word must say so now, not on a job's
        // signal (a refused signal would leave its waiters waiting).
        let s = Stream::new(dev)?;
        dev.stream_write_value(s.raw(), w.addr(), 0)?;
        dev.stream_wait_value(s.raw(), w.addr(), 0)?;
        s.synchronize()?;
        Ok(w)
    }
    fn addr(&self) -> DevicePtr {
        self.buf.as_ref().map_or(0, |b| b.as_ptr() as DevicePtr)
    }
}

impl Drop for Word {
    fn drop(&mut self) {
        let Some(buf) = self.buf.take() else { return };
        if let Err(e) = self.dev.synchronize() {
            log::error!("epmem: leaking the background filler's signal word: the device could not be synchronized ({e})");
            std::mem::forget(buf);
        }
    }
}

/// The queue's sending end and the number of the last job queued.
struct Queue {
    tx: Option<Sender<Job>>,
    queued: u64,
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
    queue: Mutex<Queue>,
    /// The fence of the last job queued (jobs complete in order).
    last: Mutex<Option<Arc<Deferred>>>,
    /// Device-side waits: the word jobs signal (see the module docs).
    word: Option<Arc<Word>>,
    /// The first failure of a job a stream may have waited for on the device.
    failure: Arc<Mutex<Option<Error>>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for BackgroundFill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackgroundFill").finish_non_exhaustive()
    }
}

impl BackgroundFill {
    /// Start the thread. With `device_waits` and a device that has stream
    /// values, pending fences are waited for on the device (module docs).
    pub fn new(engine: &Arc<CopyEngine>, device_waits: bool) -> Result<Self> {
        let dev = engine.device();
        let word = if device_waits && dev.stream_values() {
            match Word::new(dev) {
                Ok(w) => Some(Arc::new(w)),
                Err(e) => {
                    log::warn!("epmem: background fills are waited for on the host: the device refused a stream value ({e})");
                    None
                }
            }
        } else {
            None
        };
        let (tx, rx) = mpsc::channel::<Job>();
        let failure = Arc::new(Mutex::new(None));
        let (e, f, w) = (engine.clone(), failure.clone(), word.clone());
        let thread = std::thread::Builder::new()
            .name("epmem-fill".into())
            .spawn(move || {
                // Owns a handle on the word so it outlives the last signal.
                let _word = w;
                run(&e, &rx, &f)
            })
            .map_err(|err| Error::internal(format!("starting the background fill thread: {err}")))?;
        Ok(Self {
            engine: engine.clone(),
            queue: Mutex::new(Queue { tx: Some(tx), queued: 0 }),
            last: Mutex::new(None),
            word,
            failure,
            thread: Some(thread),
        })
    }

    /// Whether pending fences are waited for on the device.
    pub fn waits_on_device(&self) -> bool {
        self.word.is_some()
    }

    /// Whether a queued job is not enqueued yet. With device-side waits, a
    /// copy issued onto the copy stream while one is would jump the queue,
    /// and that can deadlock: a stream waits on the device for queued job J,
    /// an event recorded behind that wait orders a copy issued now, and that
    /// copy sits on the copy stream ahead of J. So while this is true every
    /// copy of the engine's user must go through [`Self::htod_after`]: then
    /// the copy stream runs copies in the order they were issued, and each
    /// waits only on work issued before it.
    pub fn pending(&self) -> bool {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).as_ref().is_some_and(|d| !d.is_set())
    }

    /// The first failure of a copy that a stream may already have waited for
    /// on the device (work queued behind it read unfilled memory), once.
    pub fn take_failure(&self) -> Option<Error> {
        self.failure.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Copy `src` to `dst`, ordered after the work queued on `order` so far
    /// (if given). A staged copy is queued for the thread and the fence comes
    /// back pending; a direct one (page-locked source, no fill) is issued
    /// here, as `htod` would. `src` must stay readable and unmodified until
    /// the fence completes — as for `htod`, but here that includes the fill.
    pub fn htod_after(&self, dst: DevicePtr, src: HostRange, order: Option<RawStream>) -> Result<Fence> {
        // A direct copy issued here would go onto the copy stream ahead of
        // the jobs still queued: with device-side waits that can deadlock
        // (see `pending`), so then it queues behind them.
        if !self.engine.stages(src) && !(self.waits_on_device() && self.pending()) {
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
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        let value = q.queued + 1;
        let signal = self.word.as_ref().map(|w| Signal { addr: w.addr(), value });
        let Some(tx) = q.tx.as_ref() else {
            return Err(Error::internal("the background fill thread has stopped"));
        };
        tx.send(Job { dst, src, after, done: done.clone(), signal })
            .map_err(|_| Error::internal("the background fill thread has stopped"))?;
        // Numbered under the queue's lock: jobs are sent, run and signalled
        // in this order.
        q.queued = value;
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(done.clone());
        Ok(Fence::deferred(self.engine.device(), done, signal, src.len()))
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
        self.queue.lock().unwrap_or_else(|p| p.into_inner()).tx.take();
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

fn run(engine: &CopyEngine, rx: &Receiver<Job>, failure: &Mutex<Option<Error>>) {
    while let Ok(job) = rx.recv() {
        let guard = SetOnExit(job.done.clone());
        let order = job.after.as_ref().map_or(Order::None, Order::After);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            engine.htod_signalled(job.dst, job.src, order, job.signal)
        }));
        let failed = match r {
            Ok(Ok(fence)) => match fence.into_event() {
                Some(e) => {
                    job.done.set(Ok(e));
                    None
                }
                None => Some(Error::internal("a background copy came back pending")),
            },
            Ok(Err(e)) => Some(e),
            Err(_) => Some(Error::internal("a background page-in copy panicked")),
        };
        if let Some(e) = failed {
            if let Some(sig) = job.signal
                && let Err(w) = engine.signal(sig)
            {
                // Releases the streams waiting for this job (the copy stream
                // runs it after whatever of the copy was enqueued).
                log::error!("epmem: a failed background copy could not release its waiters: {w}");
            }
            let message = format!(
                "a background page-in copy failed after a stream was made to wait for it on the device \
                 (work queued behind that wait read unfilled memory): {}",
                e.message()
            );
            let status = e.status();
            job.done.set(Err(e));
            // Only a wait that began before the error was set saw no error:
            // that caller hears of it here.
            if job.done.device_waited() {
                failure.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(Error::new(status, message));
            }
        }
        drop(guard);
    }
}
