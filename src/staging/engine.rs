//! The copy engine: host → device page-ins that overlap the host fill with
//! the DMA, ordered for the consumer by an event, never by a host wait.
//!
//! A copy from pageable memory is cut into chunks. Each chunk is filled into
//! a pooled pinned staging buffer by the fill threads (the caller's thread is
//! one of them), then enqueued on the engine's copy stream; the next chunk is
//! filled while that one is in DMA, and the calling thread enqueues a chunk's
//! copy while the other fill threads are already filling the next one. N slots bound how many chunks are in
//! flight: the (N+1)th chunk waits for the oldest copy — proven complete by
//! its witness — and reuses its buffer through the pool.
//!
//! `htod` returns once the last chunk is *enqueued*: the fill (host work) is
//! done, the tail of the DMA is not. The returned [`Fence`] is already
//! recorded, so a compute stream can wait on it at once.
//!
//! A copy whose source is page-locked (pinned, or registered once with
//! [`HostRegistration`]) takes the direct path: one enqueue, no staging, no
//! fill, and `htod` returns without any host work.
//!
//! Chunk size. With fill rate f and PCIe rate p (~54 GB/s), a page-in cut
//! into n chunks takes about S/f + S/(n·p): the fill of everything plus the
//! DMA of the last chunk, so more chunks hide more of the DMA. But every chunk
//! also costs a hand-out to the fill threads, a pool round trip, one enqueue
//! and one event on the caller's thread (~10–20 µs), hidden only while the
//! other fill threads have enough of the chunk left to fill. The fill threads
//! claim shrinking pieces of a chunk (`transfer::fill`), so the caller, which
//! enqueues the previous chunk first, does not finish every chunk last.
//!
//! The defaults follow the tuning sweep of `bench_staging` (fill threads ×
//! chunks per page-in; docs/BENCHMARKS.md, "Staging: page-in bandwidth"),
//! which re-checks them on every run: `target_chunks` 4 within
//! [1 MiB, `chunk_bytes` = 16 MiB] (8 MiB chunks at 32 MiB, 8 chunks of
//! 16 MiB at 128 MiB) and 12 fill threads. Larger page-ins get more chunks
//! rather than larger slots, so the engine retains 3 × 16 = 48 MiB of pinned
//! memory. Three slots suffice: the DMA outruns the fill, so the third slot
//! only absorbs jitter.
//!
//! The last chunks of a page-in halve down to 1 MiB
//! ([`CopyEngine::next_chunk_len`]) so that only a short last DMA is exposed.
//! That is right for a copy on its own and wrong for copies issued back to
//! back, where the next fill overlaps the last DMA anyway: 86 MiB pageable
//! copies back to back reached 46.6 GB/s with the halving tail and 54.1 with
//! full chunks to the end (`EngineConfig::split_tail` false, which a
//! residency manager's engine uses; scripts/probe_pageable.py).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use super::pool::{PinnedStagingPool, PooledStaging};
use super::stats::{self, EngineCounters, StagingStats};
use crate::device::{Device, DevicePtr, Event, EventPool, HostRange, RawStream, Stream};
use crate::error::{Error, Result};
use crate::transfer::fill::{self, FillThreads, MAX_FILL_THREADS};
use crate::transfer::witness::{self, CopyTiming, InFlight, TryComplete};

pub use crate::transfer::pinning::HostRegistration;

/// Smallest chunk: below ~1 MiB a DMA stays far from the PCIe peak.
const MIN_CHUNK: usize = 1 << 20;
/// Most timing pairs awaiting completion; past it, new copies go untimed
/// rather than block or grow without bound (direct-path copies are enqueued
/// faster than they complete).
const MAX_PENDING_TIMINGS: usize = 256;
/// `htod` reads completed timings only once this many are waiting, so a copy
/// pays for reading them (two queries and an elapsed-time call each, a few
/// µs) once per batch instead of every time; `stats` and `synchronize` read
/// them all.
const TIMING_BATCH: usize = 32;

/// Idle fence events the engine keeps for reuse: more than the copies a
/// residency pipeline has in flight, so steady state creates none.
const EVENTS_KEPT: usize = 64;

/// Most fill threads by default (fewer on a machine with fewer CPUs).
/// include/epmem.h states it; tests/header.rs checks that it does.
pub const DEFAULT_FILL_THREADS: usize = 12;

/// How the engine stages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Staging slots in flight at once, 2..=4 (default 3).
    pub slots: usize,
    /// Capacity of one slot and the largest chunk, ≥ 1 MiB (default 16 MiB;
    /// see the module docs).
    pub chunk_bytes: usize,
    /// Cut a page-in into about this many chunks, 1..=256 (default 4; see
    /// the module docs), within [1 MiB, `chunk_bytes`].
    pub target_chunks: usize,
    /// Threads that fill a chunk, counting the caller's, 1..=64 (default 12,
    /// or the number of CPUs if fewer: oversubscribed fill threads spin
    /// against each other).
    pub fill_threads: usize,
    /// Record timing events around each copy for `htod_ms` (default true).
    pub timing: bool,
    /// Copy page-locked sources directly, without staging (default true).
    pub direct: bool,
    /// End a copy with chunks halving down to 1 MiB (default true), so the
    /// last DMA, which no fill overlaps, is short when copies come one at a
    /// time. False cuts every chunk full size: when the next copy follows at
    /// once (a residency manager's filler), its fill overlaps this copy's
    /// last DMA anyway, and the small chunks only add per-chunk costs.
    pub split_tail: bool,
    /// Fill copies shorter than this many bytes with streaming stores, longer
    /// ones with plain stores (default `transfer::fill::STREAM_BELOW`, 64 MiB,
    /// measured on copies issued one at a time; 0: plain stores always, C
    /// `EPM_COPY_ENGINE_NO_STREAMING_STORES`). A residency manager's engine
    /// uses [`crate::residency::RESIDENCY_STREAM_BELOW`].
    pub stream_below: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self {
            slots: 3,
            chunk_bytes: 16 << 20,
            target_chunks: 4,
            fill_threads: cpus.min(DEFAULT_FILL_THREADS),
            timing: true,
            direct: true,
            split_tail: true,
            stream_below: fill::STREAM_BELOW,
        }
    }
}

/// The completion of one `htod`: an event on the engine's copy stream,
/// recorded after the copy's last chunk — or, for a copy handed to the
/// engine's background filler ([`super::BackgroundFill`]), recorded once that
/// thread has enqueued it: until then the fence is *pending*, and every method
/// that needs the event first waits (on the host) for it to exist.
#[derive(Debug)]
pub struct Fence {
    dev: Arc<dyn Device>,
    event: FenceEvent,
    bytes: usize,
    direct: bool,
}

#[derive(Debug)]
enum FenceEvent {
    Recorded(Event),
    Deferred(Arc<Deferred>),
}

/// The event of a copy the background filler will enqueue, set exactly once
/// (an `Err` if the copy could not be issued). A stream must never wait on an
/// event before it is recorded (the wait would be a no-op), so waiters block
/// until it is set.
#[derive(Debug, Default)]
pub(super) struct Deferred {
    done: std::sync::OnceLock<Result<Event>>,
}

impl Deferred {
    pub(super) fn set(&self, r: Result<Event>) {
        if self.done.set(r).is_err() {
            log::error!("epmem: a deferred copy's fence was set twice");
        }
    }
    pub(super) fn is_set(&self) -> bool {
        self.done.get().is_some()
    }
    fn wait(&self) -> Result<&Event> {
        self.done.wait().as_ref().map_err(Clone::clone)
    }
    /// Block until set (whether the copy was issued is the fence's to report).
    pub(super) fn wait_set(&self) {
        self.done.wait();
    }
}

impl Fence {
    /// The fence of work the caller queued itself (a device decode after a
    /// copy): `event` is already recorded after it.
    pub(crate) fn recorded(dev: &Arc<dyn Device>, event: Event, bytes: usize) -> Self {
        Fence { dev: dev.clone(), event: FenceEvent::Recorded(event), bytes, direct: false }
    }
    pub(super) fn deferred(dev: &Arc<dyn Device>, d: Arc<Deferred>, bytes: usize) -> Self {
        Fence { dev: dev.clone(), event: FenceEvent::Deferred(d), bytes, direct: false }
    }
    /// Whether the copy is still waiting to be enqueued by the background
    /// filler (its event does not exist yet). Never blocks.
    pub fn is_pending(&self) -> bool {
        matches!(&self.event, FenceEvent::Deferred(d) if !d.is_set())
    }
    /// Block the host until the copy is enqueued (at once for a copy that
    /// `htod` issued itself), and return its completion event; the error of a
    /// deferred copy that could not be issued.
    pub fn ready(&self) -> Result<&Event> {
        match &self.event {
            FenceEvent::Recorded(e) => Ok(e),
            FenceEvent::Deferred(d) => d.wait(),
        }
    }
    /// Non-blocking: has the copy completed? (A pending copy has not.)
    pub fn query(&self) -> Result<bool> {
        if self.is_pending() {
            return Ok(false);
        }
        self.ready()?.query()
    }
    /// Block the host until the copy completes (prefer [`Fence::make_wait`]).
    pub fn wait(&self) -> Result<()> {
        self.ready()?.synchronize()
    }
    /// Make work queued on `s` after this call wait for the copy. The host
    /// does not wait, except for a pending copy to be enqueued.
    pub fn make_wait(&self, s: RawStream) -> Result<()> {
        let e = self.ready()?;
        self.dev.stream_wait_event(s, e.raw())
    }
    /// The recorded event of a fence `htod` issued itself (`None`: pending).
    pub(super) fn into_event(self) -> Option<Event> {
        match self.event {
            FenceEvent::Recorded(e) => Some(e),
            FenceEvent::Deferred(_) => None,
        }
    }
    /// The device the copy runs on.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.dev
    }
    /// Bytes copied.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// Whether the copy took the direct path (no staging). Counted in the
    /// stats' `bypassed`, the published name of the direct-copy counter.
    pub fn direct(&self) -> bool {
        self.direct
    }
}

/// What a copy is ordered after.
#[derive(Clone, Copy)]
pub(super) enum Order<'a> {
    None,
    Stream(RawStream),
    After(&'a Event),
}

/// A filled staging chunk waiting to be enqueued.
struct Chunk {
    buf: PooledStaging,
    off: usize,
    len: usize,
}

/// Proof that a [`CopyEngine::fill_ahead`] is still wanted: taken with
/// [`CopyEngine::ahead_ticket`] while its source is known to be readable,
/// spent by [`CopyEngine::forget_ahead`] (after which no fill ahead taken
/// before it reads anything).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AheadTicket(u64);

struct State {
    stream: Stream,
    /// Chunk copies still owning their staging buffers, oldest first.
    ring: VecDeque<InFlight<PooledStaging>>,
    /// Records the caller's stream so the copy stream can wait on it.
    order: Event,
    /// Timing pairs of copies not yet read, oldest first.
    timings: VecDeque<CopyTiming>,
    /// Read pairs, reused so timing costs no event creation in steady state.
    spare_timings: Vec<CopyTiming>,
    /// The pool holds a buffer for every slot (see `stage`).
    reserved: bool,
    /// Chunks filled ahead for `ahead_src`, contiguous from its start, not
    /// enqueued (see `fill_ahead`).
    ahead: Vec<Chunk>,
    ahead_src: Option<HostRange>,
    /// Buffers on loan from the pool that no copy uses and no chunk fills
    /// (a fill ahead that no copy took): the next chunks fill them before
    /// any slot is taken. `ring + ahead + spares` never exceeds the slots.
    spares: Vec<PooledStaging>,
    /// An earlier copy's failure seen by a fill ahead, reported by the next copy.
    failed: Option<Error>,
}

impl State {
    /// Chunks filled ahead stop being anyone's data: their buffers become spares.
    fn discard_ahead(&mut self) {
        self.ahead_src = None;
        let ahead = std::mem::take(&mut self.ahead);
        self.spares.extend(ahead.into_iter().map(|c| c.buf));
    }
}

/// A host → device copy engine with its own copy stream, staging slots and
/// fill threads. Thread-safe: concurrent `htod` calls are serialized.
pub struct CopyEngine {
    dev: Arc<dyn Device>,
    pool: PinnedStagingPool,
    cfg: EngineConfig,
    fill: FillThreads,
    state: Mutex<State>,
    counters: EngineCounters,
    /// The copies' fence events, reused (see [`EventPool`]).
    events: Arc<EventPool>,
    /// Bumped by `forget_ahead`; a fill ahead runs only under the ticket it
    /// was given (read and compared under the state lock).
    ahead_gen: AtomicU64,
}

impl std::fmt::Debug for CopyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyEngine").field("cfg", &self.cfg).finish()
    }
}

impl CopyEngine {
    /// An engine staging through `pool`. The pool must be able to retain
    /// every slot (`slots` buffers of `chunk_bytes`), or steady-state copies
    /// would allocate: that is an [`InvalidConfig`](crate::EpmStatus::InvalidConfig).
    pub fn new(pool: &PinnedStagingPool, cfg: EngineConfig) -> Result<Self> {
        crate::ensure!((2..=4).contains(&cfg.slots), InvalidConfig, "staging slots {} not in 2..=4", cfg.slots);
        crate::ensure!(
            cfg.chunk_bytes >= MIN_CHUNK,
            InvalidConfig,
            "chunk of {} bytes is below the 1 MiB minimum",
            cfg.chunk_bytes
        );
        crate::ensure!(
            (1..=256).contains(&cfg.target_chunks),
            InvalidConfig,
            "target chunks {} not in 1..=256",
            cfg.target_chunks
        );
        crate::ensure!(
            (1..=MAX_FILL_THREADS).contains(&cfg.fill_threads),
            InvalidConfig,
            "fill threads {} not in 1..={MAX_FILL_THREADS}",
            cfg.fill_threads
        );
        let pc = pool.config();
        crate::ensure!(
            cfg.slots <= pc.max_buffers && cfg.slots.saturating_mul(cfg.chunk_bytes) <= pc.max_bytes,
            InvalidConfig,
            "{} slots of {} bytes exceed the staging pool's bounds ({} buffers, {} bytes)",
            cfg.slots,
            cfg.chunk_bytes,
            pc.max_buffers,
            pc.max_bytes
        );
        let dev = pool.device().clone();
        let events = EventPool::new(&dev, EVENTS_KEPT);
        let state = State {
            stream: Stream::new(&dev)?,
            ring: VecDeque::with_capacity(cfg.slots),
            order: Event::new(&dev, false)?,
            timings: VecDeque::new(),
            spare_timings: Vec::new(),
            reserved: false,
            ahead: Vec::new(),
            ahead_src: None,
            spares: Vec::new(),
            failed: None,
        };
        Ok(Self {
            fill: FillThreads::new(cfg.fill_threads)?,
            dev,
            pool: pool.clone(),
            cfg,
            state: Mutex::new(state),
            counters: EngineCounters::default(),
            events,
            ahead_gen: AtomicU64::new(0),
        })
    }

    pub fn config(&self) -> EngineConfig {
        self.cfg
    }
    pub fn pool(&self) -> &PinnedStagingPool {
        &self.pool
    }
    /// The pool the engine's fence events come from; fences its callers
    /// record for the same page-ins (a decode's, a background fill's order)
    /// share it.
    pub fn events(&self) -> &Arc<EventPool> {
        &self.events
    }
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.dev
    }

    /// Register `src` read-only once so later copies from it take the direct
    /// path. Fails when the device refuses (e.g. the locked-memory limit);
    /// copies then keep staging.
    pub fn register(&self, src: HostRange) -> Result<HostRegistration> {
        HostRegistration::new(&self.dev, src)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic inside `htod` leaves at worst chunks in the ring, which the
        // next call reaps; the state stays consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Copy `src` to `[dst, dst + src.len())` on the device.
    ///
    /// With `stream`, the copy is ordered after the work already queued on
    /// it, and work queued on it afterwards waits for the copy — the
    /// semantics of an async memcpy on `stream` — with no host wait. Without
    /// it, order the consumer with [`Fence::make_wait`].
    ///
    /// The host waits only for back-pressure: a staged copy of more than
    /// `slots` chunks reuses a slot only once that slot's previous copy has
    /// completed, so behind a stalled copy stream it waits. A direct copy, or
    /// a staged one within the free slots, returns without waiting.
    ///
    /// `src` must stay readable and unmodified until the fence completes.
    pub fn htod(&self, dst: DevicePtr, src: HostRange, stream: Option<RawStream>) -> Result<Fence> {
        self.htod_ordered(dst, src, stream.map_or(Order::None, Order::Stream))
    }

    /// As [`Self::htod`], but the copy waits only for `after` (when given)
    /// and no stream is made to wait for the copy: one stream wait, for a
    /// caller that orders on an event it holds (the decode staging's reuse
    /// of bytes a decode read).
    pub fn htod_after_event(&self, dst: DevicePtr, src: HostRange, after: Option<&Event>) -> Result<Fence> {
        self.htod_ordered(dst, src, after.map_or(Order::None, Order::After))
    }

    /// Whether a copy from `src` would be staged (not direct).
    pub fn stages(&self, src: HostRange) -> bool {
        !src.is_empty() && !(self.cfg.direct && self.dev.host_is_page_locked(src.ptr(), src.len()))
    }

    /// `htod` ordered after `order`: nothing, a stream (both ways, as `htod`),
    /// or an event already recorded (the copy waits for it; nothing waits for
    /// the copy but through the fence).
    pub(super) fn htod_ordered(&self, dst: DevicePtr, src: HostRange, order: Order<'_>) -> Result<Fence> {
        let mut st = self.lock();
        if let Some(e) = st.failed.take() {
            return Err(e);
        }
        self.reap(&mut st, false)?;
        match order {
            Order::None => {}
            Order::Stream(s) => {
                st.order.record_raw(s)?;
                self.dev.stream_wait_event(st.stream.raw(), st.order.raw())?;
            }
            Order::After(e) => self.dev.stream_wait_event(st.stream.raw(), e.raw())?,
        }
        let direct = !self.stages(src) && !src.is_empty();
        let timing = if self.cfg.timing && !src.is_empty() { self.take_timing(&mut st)? } else { None };
        if direct {
            if let Some(t) = &timing {
                t.record_start(&st.stream)?;
            }
            witness::enqueue_htod_from_range(&st.stream, dst, src, None)?;
        } else {
            self.stage(&mut st, dst, src, timing.as_ref())?;
        }
        if let Some(t) = timing {
            t.record_end(&st.stream)?;
            st.timings.push_back(t);
        }
        let event = self.events.take()?;
        event.record(&st.stream)?;
        if let Order::Stream(s) = order {
            self.dev.stream_wait_event(s, event.raw())?;
        }
        if !src.is_empty() {
            stats::add(&self.counters.copies, 1);
            stats::add(&self.counters.htod_bytes, src.len() as u64);
            stats::add(&self.counters.bypassed, direct as u64);
        }
        Ok(Fence { dev: self.dev.clone(), event: FenceEvent::Recorded(event), bytes: src.len(), direct })
    }

    /// The chunk length for a copy of `len` bytes (see the module docs).
    pub fn chunk_len(&self, len: usize) -> usize {
        len.div_ceil(self.cfg.target_chunks).next_multiple_of(64 << 10).clamp(MIN_CHUNK, self.cfg.chunk_bytes)
    }

    /// The next chunk when `left` bytes of a copy cut into `chunk`-byte chunks
    /// remain: full chunks, then halving what is left down to 1 MiB. Only the
    /// last chunk's DMA is not overlapped with a fill, so a small last chunk
    /// shortens the exposed tail: at 128 MiB in 16 MiB chunks the last DMA is
    /// ~300 µs of a ~2.9 ms page-in, in 1 MiB ~20 µs, for 4 more chunks (12).
    /// Whether a copy of `len` bytes is filled with streaming stores: decided
    /// once for the whole page-in (`EngineConfig::stream_below`), and the
    /// same for its chunks filled ahead.
    fn streams(&self, len: usize) -> bool {
        len < self.cfg.stream_below
    }

    /// With `split_tail` false: full chunks to the end.
    pub fn next_chunk_len(&self, chunk: usize, left: usize) -> usize {
        if !self.cfg.split_tail {
            return chunk.max(MIN_CHUNK).min(left);
        }
        if left <= MIN_CHUNK {
            return left;
        }
        (left / 2).next_multiple_of(64 << 10).clamp(MIN_CHUNK, chunk.max(MIN_CHUNK)).min(left)
    }

    fn stage(&self, st: &mut State, dst: DevicePtr, src: HostRange, timing: Option<&CopyTiming>) -> Result<()> {
        // One buffer per slot, allocated at the first staged copy: loans never
        // exceed the slots, so from then on staging allocates nothing, however
        // the copies overlap (lazily, a run whose first copies overlapped less
        // allocated its last buffer later, in what should be steady state).
        self.reserve_slots(st)?;
        let chunk = self.chunk_len(src.len());
        let bytes = src.as_slice();
        let streaming = self.streams(bytes.len());
        // The chunk filled last, not yet enqueued: its copy is enqueued by the
        // calling thread while the fill threads fill the next chunk, so the
        // driver calls (copy, event: ~10 µs) cost no fill time.
        let mut filled: Option<Chunk> = None;
        let mut off = 0;
        // Chunks filled ahead for this very source are this copy's first
        // (cut the same way: `fill_ahead` uses `chunk_len` and
        // `next_chunk_len` on the same length); those filled for another
        // source are only buffers, filled again below.
        let ahead = if st.ahead_src == Some(src) {
            st.ahead_src = None;
            std::mem::take(&mut st.ahead)
        } else {
            st.discard_ahead();
            Vec::new()
        };
        let mut spares = std::mem::take(&mut st.spares);
        for c in ahead {
            off = c.off + c.len;
            stats::add(&self.counters.ahead_used_bytes, c.len as u64);
            if let Some(prev) = filled.replace(c) {
                self.enqueue(st, dst, prev, timing)?;
            }
        }
        while off < bytes.len() {
            let n = self.next_chunk_len(chunk, bytes.len() - off);
            let mut buf = match spares.pop() {
                Some(b) => b,
                None => self.slot(st, usize::from(filled.is_some()))?,
            };
            let prev = filled.take();
            let t0 = Instant::now();
            let enqueued =
                self.fill.copy_with_stores(&mut buf[..n], &bytes[off..off + n], streaming, || match prev {
                    Some(c) => self.enqueue(st, dst, c, timing),
                    None => Ok(()),
                })?;
            stats::add_time(&self.counters.fill_ns, t0.elapsed());
            enqueued?;
            filled = Some(Chunk { buf, off, len: n });
            off += n;
        }
        st.spares = spares;
        match filled {
            Some(c) => self.enqueue(st, dst, c, timing),
            None => Ok(()),
        }
    }

    /// A ticket for [`Self::fill_ahead`], valid until the next
    /// [`Self::forget_ahead`]. Take it while the source is known to stay
    /// readable (a registered weight, under the lock that unregisters it).
    pub fn ahead_ticket(&self) -> AheadTicket {
        AheadTicket(self.ahead_gen.load(Ordering::Acquire))
    }

    /// No fill ahead taken before this call reads its source from now on,
    /// and no chunk filled ahead so far is used as a copy's data: call it
    /// before a source may be freed or changed. Waits for a chunk being
    /// filled ahead (one chunk's fill, and at most one copy's completion)
    /// to finish. The buffers stay on loan for the next copies.
    pub fn forget_ahead(&self) {
        let mut st = self.lock();
        self.ahead_gen.fetch_add(1, Ordering::AcqRel);
        st.discard_ahead();
    }

    /// Fill up to `max_chunks` of the first chunks of a coming staged copy
    /// of `src` into staging buffers now, while the engine would otherwise
    /// idle; the next copy of exactly `src` enqueues them without filling
    /// them again, and a copy of anything else uses their buffers as its
    /// slots (nothing is recycled without its copy's witness: these buffers
    /// have no copy in flight). Returns once `max_chunks` (at most the
    /// slots) are filled or `src` ends, when `stop` returns true (it is
    /// asked before each chunk), or when the ticket was spent by
    /// [`Self::forget_ahead`]. When every slot is in flight it waits for the
    /// oldest copy, as a copy would.
    ///
    /// Holds the engine for one chunk at a time: a copy issued meanwhile
    /// waits for at most one chunk's fill and, when the slots are all in
    /// flight, the completion of the oldest. `src` must stay readable and
    /// unmodified until the ticket is spent — as for a copy, since these
    /// bytes become that copy's. A failure of an earlier copy seen while
    /// waiting for a slot is returned by the next copy.
    pub fn fill_ahead(&self, src: HostRange, ticket: AheadTicket, max_chunks: usize, stop: &mut dyn FnMut() -> bool) {
        if max_chunks == 0 || !self.stages(src) {
            return;
        }
        let chunk = self.chunk_len(src.len());
        let bytes = src.as_slice();
        let streaming = self.streams(bytes.len());
        loop {
            if stop() {
                return;
            }
            let mut st = self.lock();
            if ticket != self.ahead_ticket() || st.failed.is_some() {
                return;
            }
            if st.ahead_src != Some(src) {
                st.discard_ahead();
                st.ahead_src = Some(src);
            }
            let off = st.ahead.last().map_or(0, |c| c.off + c.len);
            if off >= bytes.len() || st.ahead.len() >= max_chunks.min(self.cfg.slots) {
                return;
            }
            let n = self.next_chunk_len(chunk, bytes.len() - off);
            let buf = match st.spares.pop() {
                Some(b) => Ok(b),
                None => {
                    let held = st.ahead.len();
                    self.reserve_slots(&mut st).and_then(|()| self.slot(&mut st, held))
                }
            };
            let mut buf = match buf {
                Ok(b) => b,
                Err(e) => {
                    log::warn!("epmem: filling ahead: {e} (reported by the next copy)");
                    st.failed = Some(e);
                    return;
                }
            };
            let t0 = Instant::now();
            match self.fill.copy_with_stores(&mut buf[..n], &bytes[off..off + n], streaming, || ()) {
                Ok(()) => {
                    stats::add_time(&self.counters.fill_ns, t0.elapsed());
                    stats::add(&self.counters.ahead_bytes, n as u64);
                    st.ahead.push(Chunk { buf, off, len: n });
                }
                Err(e) => {
                    // Only a length mismatch fails a fill: a bug, not the device.
                    log::error!("epmem: filling ahead: {e}");
                    st.spares.push(buf);
                    return;
                }
            }
        }
    }

    /// Once: the pool retains one buffer per slot (see `stage`).
    fn reserve_slots(&self, st: &mut State) -> Result<()> {
        if !st.reserved {
            self.pool.reserve(self.cfg.slots, self.cfg.chunk_bytes)?;
            st.reserved = true;
        }
        Ok(())
    }

    fn enqueue(&self, st: &mut State, dst: DevicePtr, c: Chunk, timing: Option<&CopyTiming>) -> Result<()> {
        // Start the clock at the first DMA, not before the first fill.
        if let (0, Some(t)) = (c.off, timing) {
            t.record_start(&st.stream)?;
        }
        let copy =
            witness::enqueue_htod_pooled(&st.stream, dst + c.off as u64, c.buf, c.len, None, Some(&self.events))?;
        st.ring.push_back(copy);
        stats::add(&self.counters.chunks, 1);
        Ok(())
    }

    /// A staging buffer for the next chunk. The engine holds at most `slots`
    /// buffers: those in flight, the `holding` ones filled but not yet
    /// enqueued, and this one. When that would be exceeded, wait for the
    /// oldest copy (back-pressure: the DMA is behind the fill) and retire its
    /// buffer with the witness the wait hands back.
    fn slot(&self, st: &mut State, holding: usize) -> Result<PooledStaging> {
        while st.ring.len() + holding + 1 > self.cfg.slots {
            let Some(oldest) = st.ring.pop_front() else { break };
            let t0 = Instant::now();
            let done = oldest.wait()?;
            stats::add_time(&self.counters.slot_wait_ns, t0.elapsed());
            done.retire();
        }
        self.pool.acquire(self.cfg.chunk_bytes)
    }

    /// Without blocking: retire the buffers of completed chunk copies and
    /// read the timings of completed copies (with `all` false, only once a
    /// batch of them is waiting).
    fn reap(&self, st: &mut State, all: bool) -> Result<()> {
        while let Some(f) = st.ring.pop_front() {
            match f.try_complete()? {
                TryComplete::Done(done) => done.retire(),
                TryComplete::Pending(f) => {
                    st.ring.push_front(f);
                    break;
                }
            }
        }
        if !all && st.timings.len() < TIMING_BATCH {
            return Ok(());
        }
        while let Some(t) = st.timings.front() {
            let Some(ms) = t.elapsed_ms()? else { break };
            stats::add(&self.counters.htod_ns, (f64::from(ms) * 1e6) as u64);
            stats::add(&self.counters.timed_copies, 1);
            if let Some(t) = st.timings.pop_front() {
                st.spare_timings.push(t);
            }
        }
        Ok(())
    }

    fn take_timing(&self, st: &mut State) -> Result<Option<CopyTiming>> {
        if st.timings.len() >= MAX_PENDING_TIMINGS {
            return Ok(None);
        }
        match st.spare_timings.pop() {
            Some(t) => Ok(Some(t)),
            None => CopyTiming::new(&self.dev).map(Some),
        }
    }

    /// Block until every copy enqueued so far has completed, then retire all
    /// staging buffers and read all timings.
    pub fn synchronize(&self) -> Result<()> {
        let mut st = self.lock();
        st.stream.synchronize()?;
        self.reap(&mut st, true)
    }

    /// Counters of this engine and its pool. Reads completed timings first
    /// when no copy is being issued (never blocks on the device).
    pub fn stats(&self) -> StagingStats {
        if let Ok(mut st) = self.state.try_lock()
            && let Err(e) = self.reap(&mut st, true)
        {
            log::warn!("epmem: copy engine stats: reaping completed copies failed: {e}");
        }
        self.counters.snapshot(self.pool.stats())
    }
}

impl Drop for CopyEngine {
    /// Wait for the copies still in flight and give their buffers back to the
    /// pool (an un-retired buffer would be freed, costing a re-allocation).
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        while let Some(f) = st.ring.pop_front() {
            match f.wait() {
                Ok(done) => done.retire(),
                Err(e) => log::error!("epmem: copy engine teardown: a staging copy failed: {e}"),
            }
        }
    }
}
