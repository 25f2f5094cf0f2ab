//! Stream-ordered reuse of freed memory: the layer between an ORT allocator
//! and its [`MemorySource`].
//!
//! ORT (1.23+) calls `OrtAllocator::AllocOnStream` with the stream the
//! kernel that needs the memory runs on, and `Free` as soon as the last
//! kernel using it is *queued* — its work may still be running. The
//! invariant kept here: memory freed while work is queued on stream S is
//! never handed to work on another stream (or to a stream-less `Alloc`)
//! before that work completes. A block freed on S stays *pending*, out of
//! the source; the next `AllocOnStream` on S itself may take it at once,
//! since S runs its work in order. It goes back to the source only after an
//! event recorded on S after its free has completed.
//!
//! The event is recorded in `Free` itself (one `cuEventRecord`, from a warm
//! pool of events: no driver allocation in steady state), while the stream is
//! certainly alive: ORT frees a block as soon as the last kernel using it is
//! queued on that stream. Recording later (lazily, at the next allocation)
//! would touch streams ORT may have destroyed in between — a session's
//! streams go with the session — and a driver call on a destroyed stream can
//! crash (seen on the H200 with onnxruntime-gpu 1.31: a second session
//! segfaulted in the lazy record on the first session's stream). An
//! allocation another stream makes only queries the oldest epoch of each
//! stream.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use super::source::{MemorySource, SourceStats};
use crate::device::{Device, RawEvent, RawStream};
use crate::error::Result;

/// A pending block is reused on its own stream only if it is at most this
/// many times the request: a huge block must not serve a tiny tensor while
/// the source could give an exact fit.
const REUSE_SLACK: usize = 2;

#[derive(Debug, Clone, Copy)]
struct Live {
    /// The stream the block was allocated on; None for `Alloc`/`Reserve`.
    stream: Option<RawStream>,
    /// Bytes this allocation accounts for (a reused block's whole size).
    bytes: usize,
}

#[derive(Debug, Clone, Copy)]
struct Block {
    addr: u64,
    bytes: usize,
}

/// Blocks freed on one stream before `event` was recorded there.
#[derive(Debug)]
struct Epoch {
    event: RawEvent,
    blocks: Vec<Block>,
}

#[derive(Debug, Default)]
struct StreamPending {
    /// Freed since the last event on this stream (no event covers them yet).
    open: Vec<Block>,
    /// Oldest first; events on one stream complete in order.
    sealed: VecDeque<Epoch>,
}

impl StreamPending {
    fn is_empty(&self) -> bool {
        self.open.is_empty() && self.sealed.is_empty()
    }
}

#[derive(Default)]
struct State {
    live: HashMap<u64, Live>,
    pending: HashMap<u64, (RawStream, StreamPending)>,
    pending_addrs: HashSet<u64>,
    idle_events: Vec<RawEvent>,
    stats: OrderStats,
}

/// What the layer did, for `GetStats`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OrderStats {
    /// Allocations made on a stream (`AllocOnStream` with a stream).
    pub stream_allocs: u64,
    /// Of those, served by a pending block of the same stream.
    pub same_stream_reuses: u64,
    /// Frees of stream memory (each left the block pending).
    pub deferred_frees: u64,
    /// Blocks pending now.
    pub pending_blocks: u64,
    /// Events recorded (one per epoch; driver calls).
    pub events_recorded: u64,
    /// Events created (driver calls; pooled afterwards).
    pub events_created: u64,
    /// Times an allocation waited for pending work because the source was full.
    pub waits: u64,
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
        Self {
            dev,
            src,
            st: Mutex::new(State::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `bytes > 0` bytes for work on `stream` (None: usable by anything once
    /// returned). Returns the address and the bytes it accounts for.
    pub fn alloc(&self, bytes: usize, stream: Option<RawStream>) -> Result<(u64, usize)> {
        let mut g = self.lock();
        if let Some(s) = stream {
            g.stats.stream_allocs += 1;
            if let Some(hit) = self.take_same_stream(&mut g, s, bytes) {
                g.stats.same_stream_reuses += 1;
                g.live.insert(hit.addr, Live { stream, bytes: hit.bytes });
                return Ok((hit.addr, hit.bytes));
            }
        }
        if !g.pending_addrs.is_empty() {
            self.seal_all(&mut g)?;
            self.reclaim_completed(&mut g)?;
        }
        let addr = match self.src.alloc(bytes) {
            Ok(a) => a,
            Err(e) if g.pending_addrs.is_empty() => return Err(e),
            Err(_) => {
                // The source is full of pending blocks: wait for their work.
                g.stats.waits += 1;
                self.drain_all(&mut g)?;
                self.src.alloc(bytes)?
            }
        };
        g.live.insert(addr, Live { stream, bytes });
        Ok((addr, bytes))
    }

    /// Give back an allocation; returns the bytes it accounted for, or None
    /// for an address that is not live (foreign, or freed already). Records one
    /// driver call.
    pub fn free(&self, addr: u64) -> Result<Option<usize>> {
        let mut g = self.lock();
        let Some(l) = g.live.remove(&addr) else { return Ok(None) };
        let Some(s) = l.stream else {
            self.src.free(addr)?;
            return Ok(Some(l.bytes));
        };
        g.stats.deferred_frees += 1;
        g.pending_addrs.insert(addr);
        let entry = g.pending.entry(s.0).or_insert_with(|| (s, StreamPending::default()));
        entry.1.open.push(Block { addr, bytes: l.bytes });
        self.seal_stream(&mut g, s.0)?;
        Ok(Some(l.bytes))
    }

    /// Whether `addr` is a live allocation.
    #[cfg(test)]
    pub fn is_live(&self, addr: u64) -> bool {
        self.lock().live.contains_key(&addr)
    }

    /// Wait for the work still using pending blocks, return them all to the
    /// source, then give the source's unused memory back to the driver.
    /// Bytes given back.
    pub fn trim(&self) -> Result<usize> {
        let mut g = self.lock();
        self.drain_all(&mut g)?;
        self.src.trim()
    }

    /// Wait for the work still using pending blocks and return them all to
    /// the source (before the streams they were freed on are forgotten).
    pub fn drain(&self) -> Result<()> {
        let mut g = self.lock();
        self.drain_all(&mut g)
    }

    pub fn source_stats(&self) -> SourceStats {
        self.src.stats()
    }

    pub fn order_stats(&self) -> OrderStats {
        let g = self.lock();
        OrderStats {
            pending_blocks: g.pending_addrs.len() as u64,
            ..g.stats
        }
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

    /// Record one event on every stream with open blocks, sealing them into
    /// an epoch. A stream that cannot take an event any more (destroyed,
    /// perhaps with work still queued) is ordered against the whole device.
    fn seal_all(&self, g: &mut State) -> Result<()> {
        let streams: Vec<u64> = g
            .pending
            .iter()
            .filter(|(_, (_, p))| !p.open.is_empty())
            .map(|(k, _)| *k)
            .collect();
        for k in streams {
            self.seal_stream(g, k)?;
        }
        g.pending.retain(|_, (_, p)| !p.is_empty());
        Ok(())
    }

    /// Record an event on stream `k` sealing its open blocks into an epoch.
    /// A stream that refuses the event is ordered against the whole device.
    fn seal_stream(&self, g: &mut State, k: u64) -> Result<()> {
        if g.pending.get(&k).is_none_or(|(_, p)| p.open.is_empty()) {
            return Ok(());
        }
        let event = self.event(g)?;
        let (s, p) = g.pending.get_mut(&k).expect("checked above");
        let blocks = std::mem::take(&mut p.open);
        match self.dev.event_record(event, *s) {
            Ok(()) => {
                p.sealed.push_back(Epoch { event, blocks });
                g.stats.events_recorded += 1;
            }
            Err(e) => {
                log::debug!("epmem: recording on stream {} failed ({e}); synchronizing the device", s.0);
                g.idle_events.push(event);
                self.dev.synchronize()?;
                for b in blocks {
                    g.pending_addrs.remove(&b.addr);
                    self.src.free(b.addr)?;
                }
                if g.pending.get(&k).is_some_and(|(_, p)| p.is_empty()) {
                    g.pending.remove(&k);
                }
            }
        }
        Ok(())
    }

    /// Epochs whose event completed go back to the source; only the oldest
    /// of each stream needs a query (later ones complete later).
    fn reclaim_completed(&self, g: &mut State) -> Result<()> {
        let State {
            pending,
            pending_addrs,
            idle_events,
            ..
        } = g;
        for (_, p) in pending.values_mut() {
            while let Some(head) = p.sealed.front() {
                if !self.dev.event_query(head.event)? {
                    break;
                }
                let ep = p.sealed.pop_front().expect("front exists");
                idle_events.push(ep.event);
                for b in ep.blocks {
                    pending_addrs.remove(&b.addr);
                    self.src.free(b.addr)?;
                }
            }
        }
        pending.retain(|_, (_, p)| !p.is_empty());
        Ok(())
    }

    /// Wait for every pending block's work and return them all to the source.
    fn drain_all(&self, g: &mut State) -> Result<()> {
        self.seal_all(g)?;
        let pending = std::mem::take(&mut g.pending);
        for (_, (_, p)) in pending {
            for ep in p.sealed {
                self.dev.event_synchronize(ep.event)?;
                g.idle_events.push(ep.event);
                for b in ep.blocks {
                    g.pending_addrs.remove(&b.addr);
                    self.src.free(b.addr)?;
                }
            }
        }
        Ok(())
    }

    /// The smallest pending block of stream `s` (open or sealed) that fits
    /// `bytes` without wasting more than [`REUSE_SLACK`] times it.
    fn take_same_stream(&self, g: &mut State, s: RawStream, bytes: usize) -> Option<Block> {
        let (_, p) = g.pending.get_mut(&s.0)?;
        let fits = |b: &Block| b.bytes >= bytes && b.bytes <= bytes.saturating_mul(REUSE_SLACK);
        // Candidates as (size, epoch index or None for open, index in it).
        let mut best: Option<(usize, Option<usize>, usize)> = None;
        let mut consider = |size: usize, ep: Option<usize>, i: usize| {
            if best.is_none_or(|(bs, _, _)| size < bs) {
                best = Some((size, ep, i));
            }
        };
        for (i, b) in p.open.iter().enumerate().filter(|(_, b)| fits(b)) {
            consider(b.bytes, None, i);
        }
        for (e, ep) in p.sealed.iter().enumerate() {
            for (i, b) in ep.blocks.iter().enumerate().filter(|(_, b)| fits(b)) {
                consider(b.bytes, Some(e), i);
            }
        }
        let (_, ep, i) = best?;
        let b = match ep {
            None => p.open.swap_remove(i),
            Some(e) => {
                let blk = p.sealed[e].blocks.swap_remove(i);
                // An epoch left empty is dropped; its event goes back to the
                // pool (recording it again later is allowed at any time).
                if p.sealed[e].blocks.is_empty() {
                    let ep = p.sealed.remove(e).expect("index in range");
                    g.idle_events.push(ep.event);
                }
                blk
            }
        };
        if g.pending.get(&s.0).is_some_and(|(_, p)| p.is_empty()) {
            g.pending.remove(&s.0);
        }
        g.pending_addrs.remove(&b.addr);
        Some(b)
    }
}

impl Drop for StreamOrdered {
    fn drop(&mut self) {
        // The source's memory goes back to the driver when it drops: first
        // let the work still using pending blocks finish.
        let mut g = self.lock();
        if let Err(e) = self.drain_all(&mut g) {
            log::warn!("epmem: waiting for pending frees failed ({e}); synchronizing the device");
            crate::device::objects::log_drop_error("synchronize", self.dev.synchronize());
        }
        for e in g.idle_events.drain(..) {
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
        assert!(!dev.event_query(done).unwrap(), "the spin finished too early");
        assert_eq!(q, p, "stream order makes the block safe for its own stream");
        assert_eq!(bytes, MIB, "a reused block accounts for its whole size");
        // Too small a request does not take a block over twice its size.
        l.free(q).unwrap();
        let (t, _) = l.alloc(MIB / 4, Some(a)).unwrap();
        assert_ne!(t, p);
        let s = l.order_stats();
        assert_eq!((s.stream_allocs, s.same_stream_reuses, s.deferred_frees), (3, 1, 2));
        l.free(t).unwrap();
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
}
