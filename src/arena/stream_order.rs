//! Stream-ordered reuse of freed memory: a layer over a [`MemorySource`],
//! in the manner of RMM's stream-ordered resources. Its front ends: ONNX
//! Runtime's allocators (`ort::allocator`), the C API's ordered arena
//! (`epm_ordered_arena_*`) and PyTorch's pluggable allocator
//! (`epm_torch_alloc` / `epm_torch_free`).
//!
//! ORT (1.23+) calls `OrtAllocator::AllocOnStream` with the stream the
//! kernel that needs the memory runs on, and `Free` as soon as the last
//! kernel using it is *queued* — its work may still be running. The
//! invariant kept here: memory freed while work is queued on stream S is
//! never handed to work on another stream (or to a stream-less `Alloc`)
//! before that work completes. A range freed on S goes back into the arena
//! at once, under S's *tag* ([`MemorySource::free_tagged`]): it coalesces
//! with S's other freed ranges, and the next `AllocOnStream` on S itself may
//! take any part of it at once, since S runs its work in order. Everyone
//! else sees S's ranges only after an event recorded on S after its latest
//! free has completed; then the whole tag is released
//! ([`MemorySource::untag`]) and merges with the free memory around it.
//!
//! Why tags in the arena rather than whole blocks held outside it (the first
//! design): a held block served its stream again only as a whole and only
//! for a request of at least half its size; every other request of the same
//! stream went to fresh memory while the blocks waited for their event. On an
//! ORT-like trace that held ~1.5x the live bytes
//! (`an_ort_like_trace_commits_within_a_small_factor_of_its_live_peak`).
//!
//! The event is recorded in `Free` itself (one `cuEventRecord` on the
//! stream's one event, re-recorded at every free: no driver allocation in
//! steady state), while the stream is certainly alive: ORT frees a block as
//! soon as the last kernel using it is queued on that stream. Recording later
//! (lazily, at the next allocation) would touch streams ORT may have
//! destroyed in between — a session's streams go with the session — and a
//! driver call on a destroyed stream can crash (seen on the H200 with
//! onnxruntime-gpu 1.31: a second session segfaulted in the lazy record on
//! the first session's stream). An allocation its own stream's ranges cannot
//! serve queries each tagged stream's event once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::ArenaStats;
use super::source::{MemorySource, SourceStats};
use crate::device::{Device, RawEvent, RawStream};
use crate::error::Result;

#[derive(Debug, Clone, Copy)]
struct Live {
    /// The stream the block was allocated on; None for `Alloc`/`Reserve`.
    stream: Option<RawStream>,
    /// Bytes the caller asked for (the floor counts these).
    requested: usize,
}

/// A stream with memory freed under its tag and not yet released.
#[derive(Debug, Clone, Copy)]
struct Tagged {
    stream: RawStream,
    tag: u64,
    /// Recorded on `stream` after its latest free.
    event: RawEvent,
}

#[derive(Default)]
struct State {
    live: HashMap<u64, Live>,
    /// Streams with tagged memory, by stream handle.
    tagged: HashMap<u64, Tagged>,
    /// Tags of streams seen, by stream handle (a tag is never reused for
    /// another stream while this layer lives).
    tags: HashMap<u64, u64>,
    idle_events: Vec<RawEvent>,
    stats: OrderStats,
    solo: Solo,
}

/// The single-stream fast path (opt-in, [`StreamOrdered::single_stream_fast_path`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Solo {
    /// Off: every stream free records an event.
    #[default]
    Off,
    /// On, no stream has allocated yet.
    Fresh,
    /// Every allocation so far was for this stream: a free on it is
    /// immediate (only work on this stream, which runs in order, can get the
    /// memory before the path is left, and leaving waits for it).
    One(RawStream),
}

/// What the layer did, for `GetStats`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OrderStats {
    /// Allocations made on a stream (`AllocOnStream` with a stream).
    pub stream_allocs: u64,
    /// Of those, served by memory freed on the same stream whose work may
    /// still be queued (a tagged range).
    pub same_stream_reuses: u64,
    /// Frees of stream memory (each freed under its stream's tag).
    pub deferred_frees: u64,
    /// Tagged free ranges now (coalesced), waiting for their stream's work.
    pub pending_blocks: u64,
    /// Events recorded (one per stream free; driver calls).
    pub events_recorded: u64,
    /// Events created (driver calls; pooled afterwards).
    pub events_created: u64,
    /// Times an allocation waited for pending work because the source was full.
    pub waits: u64,
    /// Bytes the caller asked for, summed over live allocations: the
    /// physical floor no allocator can go below on the same request stream.
    pub live_bytes: u64,
    /// Peak of `live_bytes` since the layer was made.
    pub peak_live_bytes: u64,
    /// Bytes of tagged free ranges now (freed on a stream, not yet free for everyone).
    pub pending_bytes: u64,
    /// Peak of the bytes not free for everyone: live allocations (as the
    /// arena rounds them) plus tagged ranges.
    pub peak_held_bytes: u64,
    /// Frees made at once, with no event, while one stream had all the
    /// allocations (the single-stream fast path).
    pub single_stream_frees: u64,
}

/// A [`MemorySource`] whose frees are ordered after the work of the stream
/// the memory was allocated on.
pub(crate) struct StreamOrdered {
    dev: Arc<dyn Device>,
    src: Box<dyn MemorySource>,
    st: Mutex<State>,
}

impl StreamOrdered {
    pub fn new(dev: Arc<dyn Device>, src: Box<dyn MemorySource>) -> Self {
        Self { dev, src, st: Mutex::new(State::default()) }
    }

    /// Frees on the only stream that has allocated are immediate, with no
    /// event recorded (PyTorch's default: one stream does everything); the
    /// first allocation for another stream, or for none, waits once for that
    /// stream's queued work and turns the fast path off for good.
    pub fn single_stream_fast_path(self) -> Self {
        self.lock().solo = Solo::Fresh;
        self
    }

    /// Leave the single-stream fast path: `only`'s queued work may still use
    /// memory freed at once; wait for it before anyone else can get that memory.
    fn leave_solo(&self, g: &mut State, only: RawStream) -> Result<()> {
        g.solo = Solo::Off;
        g.stats.waits += 1;
        if let Err(e) = self.dev.stream_synchronize(only) {
            log::debug!("epmem: synchronizing stream {} failed ({e}); synchronizing the device", only.0);
            self.dev.synchronize()?;
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `bytes > 0` bytes for work on `stream` (None: usable by anything once
    /// returned). Returns the address and the bytes it accounts for.
    pub fn alloc(&self, bytes: usize, stream: Option<RawStream>) -> Result<(u64, usize)> {
        let mut g = self.lock();
        match (g.solo, stream) {
            (Solo::Off, _) | (Solo::Fresh, None) => {}
            (Solo::Fresh, Some(s)) => g.solo = Solo::One(s),
            (Solo::One(only), Some(s)) if only == s => {}
            (Solo::One(only), _) => self.leave_solo(&mut g, only)?,
        }
        let own_tag = |g: &State| stream.and_then(|s| g.tagged.get(&s.0)).map_or(0, |t| t.tag);
        if stream.is_some() {
            g.stats.stream_allocs += 1;
        }
        // Memory already used before is preferred to fresh memory, in three
        // steps: the stream's own pending ranges and everyone's free memory
        // (best fit over both); the same after releasing the tags of streams
        // whose work completed (one event query each); and after waiting for
        // the stream's own work (its pending ranges then merge with the free
        // memory around them). Only then does the footprint grow. The wait
        // blocks the calling thread until its own stream catches up — never
        // for another stream's work — and happens only where the arena would
        // otherwise take new memory from the driver: in warm-up, or never.
        // Without it, whether a hole is still pending at the moment of a
        // growth would decide the footprint, which could creep after warm-up.
        let mut t = own_tag(&g);
        if let Some((addr, own)) = self.src.alloc_tagged(bytes, t, false)? {
            g.stats.same_stream_reuses += u64::from(own && t != 0);
            return Ok(self.note_live(&mut g, addr, stream, bytes));
        }
        if !g.tagged.is_empty() {
            self.reclaim_completed(&mut g)?;
            t = own_tag(&g);
            if let Some((addr, own)) = self.src.alloc_tagged(bytes, t, false)? {
                g.stats.same_stream_reuses += u64::from(own && t != 0);
                return Ok(self.note_live(&mut g, addr, stream, bytes));
            }
        }
        if let Some(own) = stream.and_then(|s| g.tagged.get(&s.0)).copied() {
            g.stats.waits += 1;
            self.dev.event_synchronize(own.event)?;
            g.tagged.remove(&own.stream.0);
            g.idle_events.push(own.event);
            self.src.untag(own.tag);
            if let Some((addr, _)) = self.src.alloc_tagged(bytes, 0, false)? {
                return Ok(self.note_live(&mut g, addr, stream, bytes));
            }
        }
        t = own_tag(&g);
        if t != 0
            && let Some((addr, own)) = self.src.alloc_tagged(bytes, t, true)?
        {
            g.stats.same_stream_reuses += u64::from(own);
            return Ok(self.note_live(&mut g, addr, stream, bytes));
        }
        let addr = match self.src.alloc(bytes) {
            Ok(a) => a,
            Err(e) if g.tagged.is_empty() => return Err(e),
            Err(_) => {
                // The source is full of tagged ranges: wait for their work.
                g.stats.waits += 1;
                self.drain_all(&mut g)?;
                self.src.alloc(bytes)?
            }
        };
        Ok(self.note_live(&mut g, addr, stream, bytes))
    }

    fn note_live(&self, g: &mut State, addr: u64, stream: Option<RawStream>, bytes: usize) -> (u64, usize) {
        g.live.insert(addr, Live { stream, requested: bytes });
        g.stats.live_bytes += bytes as u64;
        g.stats.peak_live_bytes = g.stats.peak_live_bytes.max(g.stats.live_bytes);
        (addr, bytes)
    }

    /// Give back an allocation; returns the bytes it accounted for, or None
    /// for an address that is not live (foreign, or freed already). A stream
    /// allocation records one event on its stream (one driver call).
    pub fn free(&self, addr: u64) -> Result<Option<usize>> {
        self.free_on(addr, None, None)
    }

    /// [`Self::free`] ordered after the work queued so far on `stream`
    /// (None: the stream the block was allocated on; a block allocated with
    /// no stream and freed with none is free for everyone at once). The
    /// caller has ordered every use of the block before that point of
    /// `stream`. With `expect_bytes`, a block of another requested size is
    /// refused (InvalidArgument) and stays live.
    pub fn free_on(&self, addr: u64, stream: Option<RawStream>, expect_bytes: Option<usize>) -> Result<Option<usize>> {
        let mut g = self.lock();
        if let (Some(want), Some(l)) = (expect_bytes, g.live.get(&addr)) {
            crate::ensure!(
                l.requested == want,
                InvalidArgument,
                "free of {addr:#x} says {want} bytes; it was allocated with {}",
                l.requested
            );
        }
        let Some(l) = g.live.remove(&addr) else { return Ok(None) };
        g.stats.live_bytes -= l.requested as u64;
        let Some(s) = stream.or(l.stream) else {
            self.src.free(addr)?;
            return Ok(Some(l.requested));
        };
        match g.solo {
            Solo::One(only) if only == s => {
                self.src.free(addr)?;
                g.stats.single_stream_frees += 1;
                return Ok(Some(l.requested));
            }
            Solo::One(only) => self.leave_solo(&mut g, only)?,
            Solo::Off | Solo::Fresh => {}
        }
        let next_tag = g.tags.len() as u64 + 1;
        let tag = *g.tags.entry(s.0).or_insert(next_tag);
        let event = match g.tagged.get(&s.0) {
            Some(t) => t.event,
            None => self.event(&mut g)?,
        };
        self.src.free_tagged(addr, tag)?;
        g.stats.deferred_frees += 1;
        match self.dev.event_record(event, s) {
            Ok(()) => {
                g.stats.events_recorded += 1;
                g.tagged.insert(s.0, Tagged { stream: s, tag, event });
            }
            Err(e) => {
                // A stream that cannot take an event any more (destroyed,
                // perhaps with work still queued) is ordered against the
                // whole device.
                log::debug!("epmem: recording on stream {} failed ({e}); synchronizing the device", s.0);
                g.tagged.remove(&s.0);
                g.idle_events.push(event);
                self.dev.synchronize()?;
                self.src.untag(tag);
            }
        }
        Ok(Some(l.requested))
    }

    /// Whether `addr` is a live allocation.
    #[cfg(test)]
    pub fn is_live(&self, addr: u64) -> bool {
        self.lock().live.contains_key(&addr)
    }

    /// Wait for the work still using tagged ranges, release them all, then
    /// give the source's unused memory back to the driver. Bytes given back.
    pub fn trim(&self) -> Result<usize> {
        let mut g = self.lock();
        self.drain_all(&mut g)?;
        self.src.trim()
    }

    /// Wait for the work still using tagged ranges and release them all
    /// (before the streams they were freed on are forgotten).
    pub fn drain(&self) -> Result<()> {
        let mut g = self.lock();
        self.drain_all(&mut g)
    }

    pub fn source_stats(&self) -> SourceStats {
        self.src.stats()
    }

    /// The counters of the arena under the layer.
    pub fn arena_stats(&self) -> ArenaStats {
        self.src.arena_stats()
    }

    /// The bytes requested for a live allocation; None if `addr` is not one.
    #[cfg(test)]
    pub fn requested(&self, addr: u64) -> Option<usize> {
        self.lock().live.get(&addr).map(|l| l.requested)
    }

    pub fn order_stats(&self) -> OrderStats {
        let g = self.lock();
        let t = self.src.tagged_stats();
        OrderStats { pending_blocks: t.ranges, pending_bytes: t.bytes, peak_held_bytes: t.peak_held_bytes, ..g.stats }
    }

    pub fn source_name(&self) -> &'static str {
        self.src.name()
    }

    fn event(&self, g: &mut State) -> Result<RawEvent> {
        match g.idle_events.pop() {
            Some(e) => Ok(e),
            None => {
                g.stats.events_created += 1;
                self.dev.event_create(false)
            }
        }
    }

    /// Release the tags of streams whose latest free's event has completed.
    fn reclaim_completed(&self, g: &mut State) -> Result<()> {
        let done: Vec<Tagged> = g.tagged.values().copied().collect();
        for t in done {
            if self.dev.event_query(t.event)? {
                g.tagged.remove(&t.stream.0);
                g.idle_events.push(t.event);
                self.src.untag(t.tag);
            }
        }
        Ok(())
    }

    /// Wait for the work of every tagged stream and release all tags; on the
    /// single-stream fast path, wait for that stream (its frees were at once).
    fn drain_all(&self, g: &mut State) -> Result<()> {
        if let Solo::One(only) = g.solo {
            self.dev.stream_synchronize(only)?;
        }
        let all: Vec<Tagged> = g.tagged.values().copied().collect();
        for t in all {
            self.dev.event_synchronize(t.event)?;
            g.tagged.remove(&t.stream.0);
            g.idle_events.push(t.event);
            self.src.untag(t.tag);
        }
        Ok(())
    }
}

impl Drop for StreamOrdered {
    fn drop(&mut self) {
        // The source's memory goes back to the driver when it drops: first
        // let the work still using tagged ranges finish.
        let mut g = self.lock();
        if let Err(e) = self.drain_all(&mut g) {
            log::warn!("epmem: waiting for pending frees failed ({e}); synchronizing the device");
            crate::device::objects::log_drop_error("synchronize", self.dev.synchronize());
        }
        let left: Vec<RawEvent> = g.tagged.drain().map(|(_, t)| t.event).collect();
        for e in g.idle_events.drain(..).chain(left) {
            crate::device::objects::log_drop_error("event_destroy", self.dev.event_destroy(e));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::source::{self, MemKind};
    use super::*;
    use crate::device::{self, DeviceSelect};

    fn layer(capacity: u64) -> (Arc<dyn Device>, StreamOrdered) {
        let dev = device::open(DeviceSelect::Host, 0).unwrap();
        let src = source::open(&dev, MemKind::Device, capacity).unwrap();
        (dev.clone(), StreamOrdered::new(dev, src))
    }

    const MIB: usize = 1 << 20;
    /// Long enough that the checks below (microseconds of host work) run
    /// while it is still queued even on a loaded CI host; each test asserts
    /// that it did, so a stall shows as a failure, never as a silent pass.
    const LONG_US: u32 = 1_000_000;

    #[test]
    fn a_block_freed_with_work_queued_is_not_given_to_another_stream_until_it_completes() {
        let (dev, l) = layer(64 * MIB as u64);
        let (a, b) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
        let (p, _) = l.alloc(MIB, Some(a)).unwrap();
        dev.spin_async(LONG_US, a).unwrap();
        let done = dev.event_create(false).unwrap();
        dev.event_record(done, a).unwrap();
        assert_eq!(l.free(p).unwrap(), Some(MIB));
        // The source alone would hand the same range straight back; the
        // layer must not while stream a still runs.
        let (q, _) = l.alloc(MIB, Some(b)).unwrap();
        let (r, _) = l.alloc(MIB, None).unwrap();
        let still_running = !dev.event_query(done).unwrap();
        assert!(still_running, "the spin finished before the checks: they proved nothing");
        assert_ne!(q, p, "stream b got memory stream a's queued work still uses");
        assert_ne!(r, p, "a stream-less Alloc got memory with work queued on it");
        assert_eq!(l.order_stats().pending_blocks, 1);
        // Once a's work completes the block is everyone's again (its event
        // was recorded after the spin, when b missed: wait for the stream).
        dev.stream_synchronize(a).unwrap();
        let (s, _) = l.alloc(MIB, None).unwrap();
        assert_eq!(l.order_stats().pending_blocks, 0);
        assert_eq!(s, p, "a completed block must return to the source");
        for x in [q, r, s] {
            l.free(x).unwrap();
        }
        dev.stream_synchronize(b).unwrap();
        for st in [a, b] {
            dev.stream_destroy(st).unwrap();
        }
        dev.event_destroy(done).unwrap();
    }

    #[test]
    fn the_same_stream_reuses_a_pending_block_at_once() {
        let (dev, l) = layer(64 * MIB as u64);
        let a = dev.stream_create().unwrap();
        let (p, _) = l.alloc(MIB, Some(a)).unwrap();
        dev.spin_async(LONG_US, a).unwrap();
        let done = dev.event_create(false).unwrap();
        dev.event_record(done, a).unwrap();
        l.free(p).unwrap();
        let (q, bytes) = l.alloc(MIB / 2 + 1, Some(a)).unwrap();
        assert_eq!(q, p, "stream order makes the block safe for its own stream");
        assert_eq!(bytes, MIB / 2 + 1, "a reuse accounts for what it asked, not the whole block");
        // The rest of the block stays with stream a: a request of any size
        // on a takes its next part, another stream gets none of it.
        let b = dev.stream_create().unwrap();
        let (u, _) = l.alloc(MIB / 4, Some(a)).unwrap();
        let (w, _) = l.alloc(MIB / 4, Some(b)).unwrap();
        assert!(!dev.event_query(done).unwrap(), "the spin finished too early: the checks proved nothing");
        assert!(u > p && u < p + MIB as u64, "the same stream reuses the block's rest: {u:#x}");
        assert!(w >= p + MIB as u64 || w + (MIB / 4) as u64 <= p, "stream b got stream a's pending memory");
        // Freed pieces coalesce under the stream's tag: the whole block is
        // again one range for stream a.
        l.free(q).unwrap();
        l.free(u).unwrap();
        assert_eq!(l.order_stats().pending_blocks, 1);
        let (t, _) = l.alloc(MIB, Some(a)).unwrap();
        assert_eq!(t, p);
        let s = l.order_stats();
        assert_eq!((s.stream_allocs, s.same_stream_reuses, s.deferred_frees), (5, 3, 3), "{s:?}");
        l.free(t).unwrap();
        l.free(w).unwrap();
        dev.stream_synchronize(b).unwrap();
        dev.stream_destroy(b).unwrap();
        dev.stream_synchronize(a).unwrap();
        dev.stream_destroy(a).unwrap();
        dev.event_destroy(done).unwrap();
    }

    #[test]
    fn a_full_source_waits_for_pending_work_instead_of_failing() {
        // 32 MiB: one chunk of the host arena (capacities round up to chunks).
        let (dev, l) = layer(32 * MIB as u64);
        let (a, b) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
        // Fill most of it, free on a busy stream, then ask on another stream
        // for more than is left.
        let (p, _) = l.alloc(20 * MIB, Some(a)).unwrap();
        dev.spin_async(LONG_US, a).unwrap();
        l.free(p).unwrap();
        let (q, _) = l.alloc(20 * MIB, Some(b)).unwrap();
        let s = l.order_stats();
        assert_eq!((s.waits, s.pending_blocks), (1, 0));
        assert_eq!(q, p, "after the wait the only free range is the old block");
        l.free(q).unwrap();
        dev.stream_synchronize(b).unwrap();
        for st in [a, b] {
            dev.stream_destroy(st).unwrap();
        }
    }

    #[test]
    fn steady_state_reuse_on_one_stream_allocates_nothing_from_the_driver() {
        let (dev, l) = layer(64 * MIB as u64);
        let a = dev.stream_create().unwrap();
        let before = dev.driver_counts();
        for _ in 0..50 {
            let (p, _) = l.alloc(4096, Some(a)).unwrap();
            let (q, _) = l.alloc(8192, Some(a)).unwrap();
            l.free(p).unwrap();
            l.free(q).unwrap();
        }
        let s = l.order_stats();
        assert_eq!((s.stream_allocs, s.same_stream_reuses, s.deferred_frees), (100, 98, 100));
        // Each free records one event (while its stream is alive); reuse hands
        // the emptied epoch's event back to the pool, so two events serve all.
        assert_eq!(s.events_recorded, 100, "one record per free: {s:?}");
        assert!(s.events_created <= 2, "events come from the pool: {s:?}");
        assert_eq!(dev.driver_counts().vmm_create_calls, before.vmm_create_calls + 1, "one chunk committed, once");
        dev.stream_synchronize(a).unwrap();
        dev.stream_destroy(a).unwrap();
    }

    #[test]
    fn events_are_pooled_and_frees_are_checked() {
        let (dev, l) = layer(64 * MIB as u64);
        let (a, b) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
        for i in 0..50 {
            // Free on a, then allocate a different size on b: every round
            // seals a's frees with one event, reclaimed once a is idle.
            let (p, _) = l.alloc(4096, Some(a)).unwrap();
            l.free(p).unwrap();
            let (q, _) = l.alloc(3 * 4096 + i, Some(b)).unwrap();
            l.free(q).unwrap();
            dev.stream_synchronize(a).unwrap();
            dev.stream_synchronize(b).unwrap();
        }
        let s = l.order_stats();
        assert!(s.events_recorded >= 50, "{s:?}");
        assert!(s.events_created <= 3, "events must come from a pool: {s:?}");
        assert_eq!(l.free(0xdead_0000).unwrap(), None, "a foreign address is refused");
        let (p, _) = l.alloc(4096, Some(a)).unwrap();
        assert!(l.is_live(p));
        l.free(p).unwrap();
        assert!(!l.is_live(p));
        assert_eq!(l.free(p).unwrap(), None, "a double free of a pending block is refused");
        for st in [a, b] {
            dev.stream_synchronize(st).unwrap();
            dev.stream_destroy(st).unwrap();
        }
    }

    #[test]
    fn a_free_ordered_on_a_held_stream_serves_that_stream_and_nobody_else_until_it_runs() {
        let (dev, l) = layer(64 * MIB as u64);
        let (a, b) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
        // Allocated with no stream, freed in order on a while a is held: the
        // gate, not a timer, keeps a's work queued during the checks.
        let gate = device::Gate::new();
        let wd = gate.watchdog(std::time::Duration::from_secs(60));
        let (p, _) = l.alloc(MIB, None).unwrap();
        dev.hold_async(a, &gate).unwrap();
        assert_eq!(l.free_on(p, Some(a), Some(MIB)).unwrap(), Some(MIB));
        let (q, _) = l.alloc(MIB, Some(b)).unwrap();
        let (r, _) = l.alloc(MIB, None).unwrap();
        assert!(q != p && r != p, "memory freed on a held stream went to another user");
        let (s, _) = l.alloc(MIB, Some(a)).unwrap();
        assert_eq!(s, p, "the stream the free was ordered on reuses the block at once");
        l.free_on(s, None, None).unwrap();
        assert_eq!(l.order_stats().pending_blocks, 1);
        gate.open();
        dev.stream_synchronize(a).unwrap();
        let (t, _) = l.alloc(MIB, Some(b)).unwrap();
        assert_eq!(t, p, "once a's work ran the block is everyone's");
        assert!(!wd.fired(), "the checks waited on the held stream");
        for x in [q, r, t] {
            l.free(x).unwrap();
        }
        for st in [a, b] {
            dev.stream_synchronize(st).unwrap();
            dev.stream_destroy(st).unwrap();
        }
    }

    #[test]
    fn on_the_single_stream_fast_path_frees_are_immediate_until_a_second_stream_waits_for_the_first() {
        let (dev, l) = layer(64 * MIB as u64);
        let l = l.single_stream_fast_path();
        let (a, b) = (dev.stream_create().unwrap(), dev.stream_create().unwrap());
        let gate = device::Gate::new();
        let wd = gate.watchdog(std::time::Duration::from_secs(60));
        let (p, _) = l.alloc(MIB, Some(a)).unwrap();
        dev.hold_async(a, &gate).unwrap();
        let done = dev.event_create(false).unwrap();
        dev.event_record(done, a).unwrap();
        l.free(p).unwrap();
        let (q, _) = l.alloc(MIB, Some(a)).unwrap();
        assert_eq!(q, p, "the only stream reuses its block at once");
        l.free(q).unwrap();
        let s = l.order_stats();
        assert_eq!((s.single_stream_frees, s.events_recorded, s.pending_blocks), (2, 0, 0), "{s:?}");
        // A second stream: its allocation must wait for a's queued work,
        // which may still use the block freed at once. Open the gate from
        // another thread only after this thread is committed to allocating.
        let opener = {
            let shared = gate.shared();
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(200));
                shared.set_open();
            })
        };
        let (r, _) = l.alloc(MIB, Some(b)).unwrap();
        assert!(dev.event_query(done).unwrap(), "stream b got memory before stream a's queued work ran");
        assert!(!wd.fired(), "the gate was opened by the watchdog, not the opener");
        opener.join().unwrap();
        // The fast path is off for good: frees are ordered by events again.
        let gate2 = device::Gate::new();
        let _wd2 = gate2.watchdog(std::time::Duration::from_secs(60));
        dev.hold_async(b, &gate2).unwrap();
        l.free(r).unwrap();
        let (t, _) = l.alloc(MIB, Some(a)).unwrap();
        assert!(t + MIB as u64 <= r || t >= r + MIB as u64, "a got b's block while b is held");
        let s = l.order_stats();
        assert_eq!((s.single_stream_frees, s.events_recorded, s.waits), (2, 1, 1), "{s:?}");
        gate2.open();
        l.free(t).unwrap();
        for st in [a, b] {
            dev.stream_synchronize(st).unwrap();
            dev.stream_destroy(st).unwrap();
        }
        dev.event_destroy(done).unwrap();
    }

    /// The sequence of tests/gpu/torch_allocator.py's `streams` case (sizes
    /// scaled down): after a trim and one footprint committed and freed on
    /// b, every held round gives a's freed block back to a at once and never
    /// to b. The GPU test asserts both; this is where the layout it relies
    /// on is checked without a GPU.
    #[test]
    fn after_a_reset_a_held_streams_freed_block_goes_back_to_it_at_once_round_after_round() {
        const BLK: usize = 4 * MIB;
        const OUT: usize = 16 << 10;
        let (dev, l) = layer(256 * MIB as u64);
        let l = l.single_stream_fast_path();
        let (d, a, b) = (dev.stream_create().unwrap(), dev.stream_create().unwrap(), dev.stream_create().unwrap());
        // Leave the fast path: d (PyTorch's default stream) first, then b.
        let (p, _) = l.alloc(1024, Some(d)).unwrap();
        l.free(p).unwrap();
        let (q, _) = l.alloc(1024, Some(b)).unwrap();
        l.free(q).unwrap();
        // An unheld round (the GPU test's warm-up of its kernels).
        let (x, _) = l.alloc(BLK, Some(a)).unwrap();
        let (y, _) = l.alloc(OUT, Some(a)).unwrap();
        l.free(x).unwrap();
        let (z, _) = l.alloc(BLK, Some(b)).unwrap();
        let (w, _) = l.alloc(BLK, Some(a)).unwrap();
        for st in [d, a, b] {
            dev.stream_synchronize(st).unwrap();
        }
        for m in [y, z, w] {
            l.free(m).unwrap();
        }
        // The reset: trim, then the footprint committed and freed on b.
        assert!(l.trim().unwrap() > 0);
        let (pre, _) = l.alloc(2 * BLK + 2 * MIB, Some(b)).unwrap();
        l.free(pre).unwrap();
        dev.stream_synchronize(b).unwrap();
        let grown = dev.driver_counts().vmm_create_calls;
        for round in 0..5 {
            let gate = device::Gate::new();
            let wd = gate.watchdog(std::time::Duration::from_secs(60));
            let (x, _) = l.alloc(BLK, Some(a)).unwrap();
            dev.hold_async(a, &gate).unwrap();
            let (y, _) = l.alloc(OUT, Some(a)).unwrap();
            l.free(x).unwrap();
            let (z, _) = l.alloc(BLK, Some(b)).unwrap();
            let reuses = l.order_stats().same_stream_reuses;
            let (w, _) = l.alloc(BLK, Some(a)).unwrap();
            assert!(z >= x + BLK as u64 || z + BLK as u64 <= x, "round {round}: b got a's block while a is held");
            assert_eq!(w, x, "round {round}: a did not take its freed block back at once");
            assert_eq!(l.order_stats().same_stream_reuses, reuses + 1, "round {round}");
            gate.open();
            assert!(!wd.fired(), "round {round}: the checks waited on the held stream");
            dev.stream_synchronize(a).unwrap();
            dev.stream_synchronize(b).unwrap();
            for m in [y, z, w] {
                l.free(m).unwrap();
            }
        }
        assert_eq!(dev.driver_counts().vmm_create_calls, grown, "the held rounds fit in the committed footprint");
        for st in [d, a, b] {
            dev.stream_synchronize(st).unwrap();
            dev.stream_destroy(st).unwrap();
        }
    }

    #[test]
    fn trim_on_the_single_stream_fast_path_waits_for_the_stream_first() {
        let (dev, l) = layer(64 * MIB as u64);
        let l = l.single_stream_fast_path();
        let a = dev.stream_create().unwrap();
        let gate = device::Gate::new();
        let wd = gate.watchdog(std::time::Duration::from_secs(60));
        let (p, _) = l.alloc(MIB, Some(a)).unwrap();
        dev.hold_async(a, &gate).unwrap();
        let done = dev.event_create(false).unwrap();
        dev.event_record(done, a).unwrap();
        l.free(p).unwrap();
        let opener = {
            let shared = gate.shared();
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(200));
                shared.set_open();
            })
        };
        assert!(l.trim().unwrap() > 0);
        assert!(dev.event_query(done).unwrap(), "memory went back to the driver with a's work still queued");
        assert!(!wd.fired());
        opener.join().unwrap();
        dev.stream_destroy(a).unwrap();
        dev.event_destroy(done).unwrap();
    }

    #[test]
    fn a_free_with_the_wrong_size_is_refused_and_the_block_stays_live() {
        let (_dev, l) = layer(64 * MIB as u64);
        let (p, _) = l.alloc(4096, None).unwrap();
        let e = l.free_on(p, None, Some(4097)).unwrap_err();
        assert_eq!(e.status(), crate::EpmStatus::InvalidArgument, "{e}");
        assert!(e.message().contains("4096"), "{e}");
        assert_eq!(l.requested(p), Some(4096), "a refused free leaves the block live");
        assert_eq!(l.free_on(p, None, Some(4096)).unwrap(), Some(4096));
        assert_eq!(l.requested(p), None);
        assert_eq!(l.free_on(p, None, Some(4096)).unwrap(), None, "a double free is refused");
    }

    /// Replays a request stream on one stream, counting the bytes live.
    struct Replay<'a> {
        l: &'a StreamOrdered,
        s: RawStream,
        sizes: HashMap<u64, usize>,
        live: u64,
        peak: u64,
        /// Microseconds of work queued on the stream before each pass: the
        /// GPU running behind the host, so frees wait for their event.
        lag_us: u32,
    }

    impl<'a> Replay<'a> {
        fn new(l: &'a StreamOrdered, s: RawStream, lag_us: u32) -> Self {
            Replay { l, s, sizes: HashMap::new(), live: 0, peak: 0, lag_us }
        }
        fn alloc(&mut self, bytes: usize) -> u64 {
            let (a, _) = self.l.alloc(bytes, Some(self.s)).unwrap();
            assert!(self.sizes.insert(a, bytes).is_none(), "{a:#x} handed out twice");
            self.live += bytes as u64;
            self.peak = self.peak.max(self.live);
            a
        }
        fn free(&mut self, a: u64) {
            let bytes = self.sizes.remove(&a).expect("live");
            assert!(self.l.free(a).unwrap().is_some());
            self.live -= bytes as u64;
        }

        /// The request stream ONNX Runtime's CUDA EP makes for one pass of a
        /// transformer block stack (shapes of tests/ort/gpu/make_transformer.py:
        /// 6 blocks, d_model 1024, 16 heads, ffn 4096): per block LayerNorm,
        /// Q/K/V and their transposes, the [b, h, t, t] scores and softmax (the
        /// working-set peak), context, projections, residual adds and the MLP,
        /// plus small tensors (LayerNorm statistics, shapes). ORT frees a
        /// tensor as soon as its last consumer is queued.
        fn pass(&mut self, b: usize, t: usize) {
            const D: usize = 1024;
            const H: usize = 16;
            let n = b * t;
            let act = n * D * 4;
            if self.lag_us > 0 {
                self.l.dev.spin_async(self.lag_us, self.s).unwrap();
            }
            let mut x = self.alloc(act);
            for _ in 0..6 {
                let stats = self.alloc(n * 8);
                let ln = self.alloc(act);
                let (q, k, v) = (self.alloc(act), self.alloc(act), self.alloc(act));
                self.free(ln);
                self.free(stats);
                let shape = self.alloc(64);
                let (qt, kt, vt) = (self.alloc(act), self.alloc(act), self.alloc(act));
                for a in [q, k, v, shape] {
                    self.free(a);
                }
                let scores = self.alloc(b * H * t * t * 4);
                self.free(kt);
                let probs = self.alloc(b * H * t * t * 4);
                self.free(scores);
                let ctx = self.alloc(act);
                for a in [probs, vt, qt] {
                    self.free(a);
                }
                let ctx_t = self.alloc(act);
                self.free(ctx);
                let proj = self.alloc(act);
                self.free(ctx_t);
                let x1 = self.alloc(act);
                self.free(proj);
                self.free(x);
                let stats2 = self.alloc(n * 8);
                let ln2 = self.alloc(act);
                self.free(stats2);
                let h1 = self.alloc(4 * act);
                self.free(ln2);
                let h2 = self.alloc(4 * act);
                self.free(h1);
                let m = self.alloc(act);
                self.free(h2);
                x = self.alloc(act);
                self.free(m);
                self.free(x1);
            }
            self.free(x);
            // The end of Run: ORT copies the output to the host, which waits for the stream.
            self.l.dev.stream_synchronize(self.s).unwrap();
        }
    }

    fn ort_like_trace(lag_us: u32) {
        // Device memory of an ORT allocator: the source ORT's env allocator
        // gets, behind the stream layer, on the host device.
        let (dev, l) = layer(64 << 30);
        let a = dev.stream_create().unwrap();
        let mut rng = fastrand::Rng::with_seed(2026);
        let trace: Vec<(usize, usize)> = (0..60).map(|_| (rng.usize(1..=16), rng.usize(1..=512))).collect();
        let mut r = Replay::new(&l, a, lag_us);
        for &(b, t) in &trace {
            r.pass(b, t);
        }
        // The measured pass: the same shapes again, no driver allocation.
        let (before, committed) = (dev.driver_counts().vmm_create_calls, l.source_stats().committed_bytes);
        let waits_warm = l.order_stats().waits;
        for &(b, t) in &trace {
            r.pass(b, t);
        }
        let grew = dev.driver_counts().vmm_create_calls - before;
        // Waiting for the stream's own work happens only where the arena
        // would grow: never once the footprint is warm (latency unchanged).
        assert_eq!(l.order_stats().waits, waits_warm, "waits after warm-up");
        let warm_committed = committed;
        let (live, peak) = (r.live, r.peak);
        let o = l.order_stats();
        assert_eq!(live, 0);
        assert_eq!(o.live_bytes, 0, "{o:?}");
        assert_eq!(o.peak_live_bytes, peak, "the layer's floor is the test's own count");
        assert!(o.same_stream_reuses > 0, "same-stream frees must be reused at once: {o:?}");
        let committed = l.source_stats().committed_bytes;
        let ratio = committed as f64 / peak as f64;
        eprintln!(
            "ort-like trace, lag {lag_us} us: peak live {} MiB, peak held {} MiB, committed {} MiB: {ratio:.3}x the floor; {o:?}",
            peak >> 20,
            o.peak_held_bytes >> 20,
            committed >> 20
        );
        assert_eq!(grew, 0, "driver allocations after warm-up ({} MiB)", (committed - warm_committed) >> 20);
        // Stated bound: within 1.35x of the bytes live at once. Measured
        // 1.27x with and without lag, the same as plain best fit with every
        // free immediate (no streams at all): the stream layer adds nothing,
        // the rest is placement. The design before (whole blocks held outside
        // the arena until their event, offset-allocator's rounded bin search,
        // 32 MiB chunks) committed 1.67-1.73x with no lag (this bound fails
        // it) and 1.24x with 3 ms of lag: its footprint depended on timing.
        assert!(ratio <= 1.35, "committed {committed} bytes = {ratio:.3}x the live peak {peak}: {o:?}");
        dev.stream_destroy(a).unwrap();
    }

    #[test]
    fn an_ort_like_trace_commits_within_a_small_factor_of_its_live_peak() {
        ort_like_trace(0);
    }

    #[test]
    fn an_ort_like_trace_with_the_stream_behind_commits_within_the_same_factor() {
        // 3 ms of queued work per pass: every free of the pass waits for its
        // event while the pass still allocates (as on a GPU behind the host).
        ort_like_trace(3_000);
    }

    #[test]
    #[ignore = "timing, run with --release --ignored"]
    fn ort_like_trace_timing() {
        let (dev, l) = layer(64 << 30);
        let a = dev.stream_create().unwrap();
        let mut r = Replay::new(&l, a, 0);
        let trace: Vec<(usize, usize)> = (0..60).map(|i| (1 + i % 16, 1 + (i * 37) % 512)).collect();
        for &(b, t) in &trace {
            r.pass(b, t);
        }
        let creates = dev.driver_counts().vmm_create_calls;
        let t0 = std::time::Instant::now();
        for _ in 0..5 {
            for &(b, t) in &trace {
                r.pass(b, t);
            }
        }
        let el = t0.elapsed();
        // 127 allocations per pass (6 blocks of 21, plus the input).
        let ops = 5 * trace.len() * 127;
        assert_eq!(l.order_stats().stream_allocs as usize, 6 * trace.len() * 127);
        assert_eq!(dev.driver_counts().vmm_create_calls, creates, "the timed passes must not grow the arena");
        assert_eq!(r.live, 0);
        // Host figures (release, 2-core CI machine): this design 1.9-2.6 us,
        // the block-holding design before it 4.0 us.
        eprintln!(
            "timing: {:.0} ns per alloc+free (incl. the host stream's event record)",
            el.as_nanos() as f64 / ops as f64
        );
        dev.stream_destroy(a).unwrap();
    }
}
