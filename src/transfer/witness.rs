//! The copy fence and its witness: proof, checked by the compiler, that a
//! staging buffer's DMA has finished before the buffer is reused or freed.
//!
//! The invariant: a staging buffer is the source of an async H2D
//! copy and may not be reused or freed until that copy has *completed* — not
//! merely been enqueued. Two mechanisms hold it:
//!
//! 1. **Ownership.** [`enqueue_htod`] takes the buffer by value and returns an
//!    [`InFlight`] that owns it. `InFlight` has no `Deref`, no accessor and no
//!    way to release the buffer except [`InFlight::wait`] and
//!    [`InFlight::try_complete`], and both give it back only after the copy's
//!    event was observed complete.
//! 2. **The witness.** Those two calls hand the buffer back *inside* a
//!    [`CopyCompleted<T>`]: a move-only value whose constructor is private to
//!    this module and which owns the very buffer whose copy it witnesses.
//!    Returning a pooled buffer to the staging pool takes a
//!    `CopyCompleted<PooledStaging>` ([`crate::staging::PooledStaging`] alone
//!    has no way back), so the pool's reuse path is unreachable without proof.
//!
//! Why the witness owns its buffer instead of travelling beside it: a
//! free-standing proof ("some copy completed") fits any buffer, so the proof
//! of copy A could retire buffer B. Binding them at run time (an id compared
//! on retire) would turn a logic error into a run-time failure; binding them
//! by ownership makes the mismatch unwritable. There is no witness that is
//! not its buffer's: `CopyCompleted` gives the buffer out only by shared
//! reference ([`std::ops::Deref`]) or by [`CopyCompleted::into_buffer`],
//! which spends the proof.
//!
//! # What the compiler rejects
//!
//! The refusals (forging, cloning, `Default`, swapping another buffer in,
//! retiring a bare buffer or a buffer of another kind, touching a buffer in
//! flight) are compiled by `tests/compile_fail.rs`, which checks each error
//! code and the name it points at; every case there is one line away from a
//! program that compiles. The legitimate path compiles and runs (on the host
//! device in CI):
//! ```
//! # use epmem::device::{self, DeviceBuffer, PinnedBuffer, Stream};
//! # use epmem::transfer::witness::{self, CopyCompleted};
//! # fn main() -> epmem::Result<()> {
//! # let dev = device::open_from_env(0)?;
//! # let stream = Stream::new(&dev)?;
//! # let dst = DeviceBuffer::new(&dev, 4096)?;
//! let mut buf = PinnedBuffer::new(&dev, 4096)?;
//! buf.fill(7);
//! let in_flight = witness::enqueue_htod(&stream, dst.ptr(), buf, 4096, None)?;
//! let done: CopyCompleted<PinnedBuffer> = in_flight.wait()?;
//! assert_eq!(done[0], 7);
//! let buf: PinnedBuffer = done.into_buffer();
//! # drop(buf);
//! # Ok(()) }
//! ```

use std::fmt;
use std::sync::Arc;

use crate::device::{Device, DevicePtr, Event, EventPool, HostRange, PinnedBuffer, Stream};
use crate::error::Result;

/// A buffer together with the proof that the copy which last used it was
/// observed complete.
///
/// Move-only: no `Clone`, `Copy` or `Default`, and its only constructor is
/// private to this module, where it is called only after an event query
/// returned true or an event synchronize returned, with the buffer that
/// copy owned. The buffer is readable through `Deref`, never replaceable
/// (no `DerefMut`), so the proof cannot be moved onto another buffer.
#[must_use = "a CopyCompleted holds its buffer: retire it to the pool, or into_buffer() it"]
pub struct CopyCompleted<T: PinnedOwner> {
    proven: T,
}

impl<T: PinnedOwner> CopyCompleted<T> {
    /// Only this module mints witnesses, and only after observing completion
    /// of the copy that owned `buf`.
    fn mint(buf: T) -> Self {
        CopyCompleted { proven: buf }
    }
    /// The buffer, without the proof: what is left can be read, refilled and
    /// copied again, or dropped (a pooled one is then freed, not recycled).
    pub fn into_buffer(self) -> T {
        self.proven
    }
}

impl<T: PinnedOwner> std::ops::Deref for CopyCompleted<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.proven
    }
}

impl<T: PinnedOwner> fmt::Debug for CopyCompleted<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CopyCompleted({} bytes)", self.proven.pinned().len())
    }
}

pub(crate) mod sealed {
    /// Keeps [`super::PinnedOwner`] closed: only the crate decides what a
    /// copy may own, so every implementation owns (or is) its pinned buffer.
    pub trait Sealed {}
}

/// A value that owns page-locked memory a copy can read (H2D) or write
/// (D2H): a [`PinnedBuffer`], or a pooled staging buffer. Sealed.
pub trait PinnedOwner: sealed::Sealed + Send + 'static {
    /// The pinned memory this value owns.
    fn pinned(&self) -> &PinnedBuffer;
    /// The same, mutably.
    fn pinned_mut(&mut self) -> &mut PinnedBuffer;
}

impl sealed::Sealed for PinnedBuffer {}
impl PinnedOwner for PinnedBuffer {
    fn pinned(&self) -> &PinnedBuffer {
        self
    }
    fn pinned_mut(&mut self) -> &mut PinnedBuffer {
        self
    }
}

/// A pair of timing events around one or more copies on a stream. Read with
/// [`CopyTiming::elapsed_ms`], which never blocks: the hot path must not
/// serialize on timing (the seed's `elapsed_ms` did exactly that).
#[derive(Debug)]
pub struct CopyTiming {
    start: Event,
    end: Event,
}

impl CopyTiming {
    pub fn new(dev: &std::sync::Arc<dyn Device>) -> Result<Self> {
        Ok(Self { start: Event::new(dev, true)?, end: Event::new(dev, true)? })
    }
    /// Mark the start on `s` (before the first timed copy is enqueued).
    pub fn record_start(&self, s: &Stream) -> Result<()> {
        self.start.record(s)
    }
    /// Mark the end on `s` (after the last timed copy is enqueued).
    pub fn record_end(&self, s: &Stream) -> Result<()> {
        self.end.record(s)
    }
    /// Device time from start to end, once the end has completed; `None`
    /// while it is still pending. Never blocks.
    pub fn elapsed_ms(&self) -> Result<Option<f32>> {
        if !self.end.query()? {
            return Ok(None);
        }
        self.end.elapsed_since(&self.start).map(Some)
    }
}

/// A copy in progress, owning its pinned buffer (the source of an H2D copy,
/// or the destination of a D2H one) until the copy's event is observed
/// complete. The only ways back to the buffer are
/// [`InFlight::wait`] and [`InFlight::try_complete`].
///
/// Dropping an `InFlight` blocks until the copy completes (it synchronizes the
/// event) and then drops the buffer — which, for a pooled buffer, frees it
/// rather than recycling it. Why block: freeing page-locked memory that the
/// DMA engine is still reading lets the allocator hand the pages to someone
/// else, whose writes would then land on the device mid-copy (silent
/// corruption); the driver does not promise that `cuMemFreeHost` waits for
/// pending copies. If the synchronize itself fails (a lost context), the
/// buffer is leaked and the error logged: without proof of completion,
/// leaking is the only safe choice, and dropping must not panic.
#[must_use = "dropping an InFlight blocks until the copy completes and frees its buffer; wait() or try_complete() instead"]
pub struct InFlight<T: PinnedOwner> {
    buf: Option<T>,
    done: Event,
    bytes: usize,
}

impl<T: PinnedOwner> fmt::Debug for InFlight<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlight").field("bytes", &self.bytes).field("event", &self.done.raw()).finish()
    }
}

/// The result of [`InFlight::try_complete`].
#[derive(Debug)]
pub enum TryComplete<T: PinnedOwner> {
    /// The copy completed: its buffer, inside its witness.
    Done(CopyCompleted<T>),
    /// Still running: the copy keeps its buffer.
    Pending(InFlight<T>),
}

impl<T: PinnedOwner> InFlight<T> {
    /// Bytes the copy moves.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Block until the copy completes; return the buffer inside its witness.
    ///
    /// On error (the device failed, e.g. a lost context) the buffer is not
    /// returned: `self` is dropped, which synchronizes again and leaks the
    /// buffer if that fails too.
    pub fn wait(mut self) -> Result<CopyCompleted<T>> {
        self.done.synchronize()?;
        Ok(CopyCompleted::mint(self.take_buf()))
    }

    /// Never blocks: the buffer inside its witness if the copy has completed,
    /// else `Pending(self)`. A failing query is an error (as in [`Self::wait`]).
    pub fn try_complete(mut self) -> Result<TryComplete<T>> {
        if self.done.query()? {
            Ok(TryComplete::Done(CopyCompleted::mint(self.take_buf())))
        } else {
            Ok(TryComplete::Pending(self))
        }
    }

    fn take_buf(&mut self) -> T {
        // `buf` is Some from construction until this call, which consumes
        // the InFlight (wait/try_complete take `self`), so it runs once.
        match self.buf.take() {
            Some(s) => s,
            None => unreachable!("InFlight buffer taken twice"),
        }
    }
}

impl<T: PinnedOwner> Drop for InFlight<T> {
    fn drop(&mut self) {
        let Some(buf) = self.buf.take() else { return };
        match self.done.synchronize() {
            Ok(()) => drop(buf),
            Err(e) => {
                log::error!(
                    "epmem: an in-flight copy of {} bytes could not be confirmed complete ({e}); \
                     leaking its staging buffer rather than freeing memory a DMA may still read",
                    self.bytes
                );
                std::mem::forget(buf);
            }
        }
    }
}

/// Enqueue an H2D copy of the first `len` bytes of `src` to `dst` on `stream`
/// and record the copy's completion event. With `timing`, its start and end
/// are recorded around the copy.
///
/// Returns immediately; the copy owns `src` until it completes. On error the
/// buffer is dropped — after synchronizing the stream if the copy had already
/// been enqueued.
pub fn enqueue_htod<T: PinnedOwner>(
    stream: &Stream,
    dst: DevicePtr,
    src: T,
    len: usize,
    timing: Option<&CopyTiming>,
) -> Result<InFlight<T>> {
    enqueue_htod_pooled(stream, dst, src, len, timing, None)
}

/// As [`enqueue_htod`], with the completion event taken from `events` (when
/// given): a copy engine that enqueues a copy per staging chunk then creates
/// no event per chunk in steady state.
pub fn enqueue_htod_pooled<T: PinnedOwner>(
    stream: &Stream,
    dst: DevicePtr,
    src: T,
    len: usize,
    timing: Option<&CopyTiming>,
    events: Option<&Arc<EventPool>>,
) -> Result<InFlight<T>> {
    let (ptr, cap) = (src.pinned().as_ptr(), src.pinned().len());
    crate::ensure!(len <= cap, InvalidArgument, "copy of {len} bytes from a pinned buffer of {cap} bytes");
    enqueue(stream, src, len, timing, events, |dev| {
        // SAFETY: `[ptr, ptr+len)` lies inside the pinned allocation `src`
        // owns. `src` moves into the returned InFlight (or, on a later error,
        // is dropped only after the stream synchronizes), and InFlight gives
        // no access to it until its event is observed complete, so the memory
        // stays allocated and unwritten until the DMA has read it.
        unsafe { dev.memcpy_htod_async(dst, ptr, len, stream.raw()) }
    })
}

/// Enqueue a D2H copy of `len` bytes from `src` into the start of `dst` on
/// `stream`. The copy owns `dst` until it completes, so its bytes can be
/// read only after [`InFlight::wait`] / [`InFlight::try_complete`].
pub fn enqueue_dtoh<T: PinnedOwner>(
    stream: &Stream,
    mut dst: T,
    src: DevicePtr,
    len: usize,
    timing: Option<&CopyTiming>,
) -> Result<InFlight<T>> {
    let (ptr, cap) = (dst.pinned_mut().as_mut_ptr(), dst.pinned().len());
    crate::ensure!(len <= cap, InvalidArgument, "copy of {len} bytes into a pinned buffer of {cap} bytes");
    enqueue(stream, dst, len, timing, None, |dev| {
        // SAFETY: `[ptr, ptr+len)` lies inside the pinned allocation `dst`
        // owns exclusively (taken by value, `&mut` when the pointer was made),
        // and nothing can read or free it until the copy's event completes
        // (see the htod case).
        unsafe { dev.memcpy_dtoh_async(ptr, src, len, stream.raw()) }
    })
}

/// The shared part of both directions: timing, the copy, the event, and the
/// error path that must not free a buffer a queued copy may still use.
fn enqueue<T: PinnedOwner>(
    stream: &Stream,
    buf: T,
    len: usize,
    timing: Option<&CopyTiming>,
    events: Option<&Arc<EventPool>>,
    copy: impl FnOnce(&std::sync::Arc<dyn Device>) -> Result<()>,
) -> Result<InFlight<T>> {
    let done = match events {
        Some(pool) => pool.take()?,
        None => Event::new(stream.device(), false)?,
    };
    if let Some(t) = timing {
        t.record_start(stream)?;
    }
    if len > 0 {
        copy(stream.device())?;
    }
    let recorded = match timing {
        Some(t) => t.record_end(stream).and_then(|()| done.record(stream)),
        None => done.record(stream),
    };
    if let Err(e) = recorded {
        // The copy may be queued with no event to observe it: wait for the
        // whole stream before the buffer can be dropped.
        if let Err(e2) = stream.synchronize() {
            log::error!(
                "epmem: leaking a pinned buffer: copy enqueued, event not recorded ({e}), stream sync failed ({e2})"
            );
            std::mem::forget(buf);
        }
        return Err(e);
    }
    Ok(InFlight { buf: Some(buf), done, bytes: len })
}

/// Enqueue an H2D copy straight from a host range (no staging): the direct
/// path, for ranges that are page-locked (pinned, or registered once). From
/// pageable memory it still works, at the driver's pageable-copy speed.
///
/// The range's creator promised it stays readable and unmodified while it is
/// used; a copy is a use until `after` (or any later event on `stream`) has
/// completed. `after`, when given, is recorded after the copy.
pub fn enqueue_htod_from_range(stream: &Stream, dst: DevicePtr, src: HostRange, after: Option<&Event>) -> Result<()> {
    if !src.is_empty() {
        // SAFETY: HostRange's contract (see `HostRange::new`): its creator
        // vouches the range stays readable and unmodified while used, and the
        // C API documents that the range must live until the copy's fence.
        unsafe { stream.device().memcpy_htod_async(dst, src.ptr(), src.len(), stream.raw())? };
    }
    match after {
        Some(e) => e.record(stream),
        None => Ok(()),
    }
}
