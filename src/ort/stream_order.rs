//! Stream-ordered reuse of freed memory: the layer between an ORT allocator
//! and its [`MemorySource`].
//!
//! ORT (1.23+) calls `OrtAllocator::AllocOnStream` with the stream the
//! kernel that needs the memory runs on, and `Free` as soon as the last
//! kernel using it is *queued* — its work may still be running. The
//! invariant kept here: memory freed while work is queued on stream S is
//! never handed to work on another stream (or to a stream-less `Alloc`)
//! before that work completes. At `Free` an event is recorded on S and the
//! block stays *pending*, out of the source, until the event completes; the
//! next `AllocOnStream` on S itself may take a pending block of S at once,
//! since S runs its work in order. Plain `Alloc` and other streams only see
//! the source, which holds no pending block.
//!
//! Cost in steady state: one event record per `Free` of a stream block and
//! one event query per stream with pending blocks per allocation; events
//! come from a pool, so no driver allocation happens once it is warm.

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

#[derive(Debug)]
struct Pending {
    addr: u64,
    bytes: usize,
    event: RawEvent,
}

#[derive(Default)]
struct State {
    live: HashMap<u64, Live>,
    /// Per stream, in free order (events on one stream complete in order).
    pending: HashMap<u64, VecDeque<Pending>>,
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
    /// Frees that recorded an event and left the block pending.
    pub deferred_frees: u64,
    /// Blocks pending now.
    pub pending_blocks: u64,
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
        self.reclaim_completed(&mut g)?;
        if let Some(s) = stream {
            g.stats.stream_allocs += 1;
            if let Some(hit) = take_same_stream(&mut g, s, bytes) {
                g.idle_events.push(hit.event);
                g.stats.same_stream_reuses += 1;
                g.live.insert(hit.addr, Live { stream, bytes: hit.bytes });
                return Ok((hit.addr, hit.bytes));
            }
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
    /// for an address that is not live (foreign, or freed already).
    pub fn free(&self, addr: u64) -> Result<Option<usize>> {
        let mut g = self.lock();
        let Some(l) = g.live.remove(&addr) else { return Ok(None) };
        let Some(s) = l.stream else {
            self.src.free(addr)?;
            return Ok(Some(l.bytes));
        };
        let event = match g.idle_events.pop() {
            Some(e) => e,
            None => {
                g.stats.events_created += 1;
                self.dev.event_create(false)?
            }
        };
        if let Err(e) = self.dev.event_record(event, s) {
            // The stream is gone (destroyed with work maybe still queued):
            // nothing to order against but the whole device.
            log::debug!("epmem: recording a free on stream {} failed ({e}); synchronizing the device", s.0);
            g.idle_events.push(event);
            self.dev.synchronize()?;
            self.src.free(addr)?;
            return Ok(Some(l.bytes));
        }
        g.stats.deferred_frees += 1;
        g.pending_addrs.insert(addr);
        g.pending.entry(s.0).or_default().push_back(Pending {
            addr,
            bytes: l.bytes,
            event,
        });
        Ok(Some(l.bytes))
    }

    /// Whether `addr` is a live allocation.
    #[cfg(test)]
    pub fn is_live(&self, addr: u64) -> bool {
        self.lock().live.contains_key(&addr)
    }

    /// Return completed pending blocks to the source, then give the source's
    /// unused memory back to the driver. Bytes given back.
    pub fn trim(&self) -> Result<usize> {
        let mut g = self.lock();
        self.reclaim_completed(&mut g)?;
        self.src.trim()
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

    /// Pending blocks whose event completed go back to the source; only the
    /// head of each stream's queue needs a query (later ones complete later).
    fn reclaim_completed(&self, g: &mut State) -> Result<()> {
        let State {
            pending,
            pending_addrs,
            idle_events,
            ..
        } = g;
        for q in pending.values_mut() {
            while let Some(head) = q.front() {
                if !self.dev.event_query(head.event)? {
                    break;
                }
                let p = q.pop_front().expect("front exists");
                pending_addrs.remove(&p.addr);
                idle_events.push(p.event);
                self.src.free(p.addr)?;
            }
        }
        pending.retain(|_, q| !q.is_empty());
        Ok(())
    }

    /// Wait for every pending block's work and return them all to the source.
    fn drain_all(&self, g: &mut State) -> Result<()> {
        let pending = std::mem::take(&mut g.pending);
        for (_, q) in pending {
            for p in q {
                self.dev.event_synchronize(p.event)?;
                g.pending_addrs.remove(&p.addr);
                g.idle_events.push(p.event);
                self.src.free(p.addr)?;
            }
        }
        Ok(())
    }
}

/// The smallest pending block of stream `s` that fits `bytes` without
/// wasting more than [`REUSE_SLACK`] times it.
fn take_same_stream(g: &mut State, s: RawStream, bytes: usize) -> Option<Pending> {
    let q = g.pending.get_mut(&s.0)?;
    let best = q
        .iter()
        .enumerate()
        .filter(|(_, p)| p.bytes >= bytes && p.bytes <= bytes.saturating_mul(REUSE_SLACK))
        .min_by_key(|(_, p)| p.bytes)
        .map(|(i, _)| i)?;
    let p = q.remove(best)?;
    g.pending_addrs.remove(&p.addr);
    Some(p)
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
        l.free(q).unwrap();
        l.free(r).unwrap();
        // Once a's work completes the block is everyone's again (the free's
        // own event is the last thing queued on a: wait for the stream).
        dev.stream_synchronize(a).unwrap();
        dev.stream_synchronize(b).unwrap();
        let (s, _) = l.alloc(MIB, None).unwrap();
        assert_eq!(l.order_stats().pending_blocks, 0);
        assert_eq!(s, p, "a completed block must return to the source");
        l.free(s).unwrap();
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
        dev.spin_async(50_000, a).unwrap();
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
    fn events_are_pooled_and_frees_are_checked() {
        let (dev, l) = layer(64 * MIB as u64);
        let a = dev.stream_create().unwrap();
        for _ in 0..50 {
            let (p, _) = l.alloc(4096, Some(a)).unwrap();
            l.free(p).unwrap();
            dev.stream_synchronize(a).unwrap();
        }
        let s = l.order_stats();
        assert!(s.events_created <= 2, "events must come from a pool: {s:?}");
        assert_eq!(s.deferred_frees, 50);
        assert_eq!(l.free(0xdead_0000).unwrap(), None, "a foreign address is refused");
        let (p, _) = l.alloc(4096, Some(a)).unwrap();
        assert!(l.is_live(p));
        l.free(p).unwrap();
        assert!(!l.is_live(p));
        assert_eq!(l.free(p).unwrap(), None, "a double free of a pending block is refused");
        dev.stream_synchronize(a).unwrap();
        dev.stream_destroy(a).unwrap();
    }
}
