//! The streaming region of a plan ([`super::placement`]): one arena block
//! that streamed weights pass through in cycle order, each at the fixed
//! offset the plan gave it.
//!
//! Invariant (the ring's read fence): bytes of the ring are written by a
//! page-in only after every earlier occupant overlapping them was either
//! observed idle on the host or made to gate the manager's order stream on
//! the device ([`RingSlot::order_before`]) — and the copy is issued after that
//! stream. So an occupant's readers always finish before its bytes are
//! overwritten, and the host never waits for them. The ring's memory goes back
//! to the arena only after the device was synchronized ([`Ring`]'s drop).
//!
//! A split plan ([`super::placement::split_plan`]) streams weights' tails: its
//! ring is its own physical memory ([`SplitMem`]), mapped once as the ring and
//! again behind each split weight's own address range, after the weight's
//! head (resident memory of its own). A tail copied into its ring bytes is
//! then the end of a weight a kernel reads whole at one address. The
//! mappings are made when the plan is installed and never change while it
//! is: steady state makes no driver call.

use std::collections::VecDeque;
use std::sync::Arc;

use super::WeightId;
use super::placement::ALIGN;
use super::read_fence::DeviceBlock;
use crate::arena::DeviceArena;
use crate::device::{Access, Device, Event, PhysMem, Stream, VaRange};
use crate::error::Result;
use crate::staging::Fence;

/// The streaming region.
#[derive(Debug)]
pub(crate) struct Ring {
    dev: Arc<dyn Device>,
    block: Option<DeviceBlock>,
    /// A split plan's memory (then `block` is `None`).
    split: Option<SplitMem>,
    cap: usize,
    /// Occupants in placement order: (weight, offset, bytes).
    occ: VecDeque<(WeightId, usize, usize)>,
}

/// One split weight: `head` bytes of its own memory, then its tail mapped
/// onto the ring at `ring_off`; `len` bytes in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub head: usize,
    pub len: usize,
    pub ring_off: usize,
}

/// The memory of a split plan's ring. Field order is drop order: the
/// reservation (unmapping everything) before the physical memory.
#[derive(Debug)]
struct SplitMem {
    va: VaRange,
    _slots: Vec<PhysMem>,
    _heads: Vec<PhysMem>,
    /// Per span: the weight's address, and whether its head was copied.
    spans: Vec<(u64, bool)>,
    head_bytes: usize,
}

impl Ring {
    pub fn new(arena: &Arc<DeviceArena>, cap: usize) -> Result<Self> {
        Ok(Self {
            dev: arena.device().clone(),
            block: Some(DeviceBlock::alloc(arena, cap)?),
            split: None,
            cap,
            occ: VecDeque::new(),
        })
    }
    /// A split plan's ring of `cap` bytes (a multiple of the granularity)
    /// and the split weights' `spans`, in that order: one reservation holding
    /// the ring, then each weight's range (its length rounded up to the
    /// granularity); a physical allocation per granule of the ring and one
    /// per head. Heads and ring offsets must be multiples of the granularity.
    pub fn new_split(dev: &Arc<dyn Device>, cap: usize, spans: &[Span]) -> Result<Self> {
        let g = dev.vmm_granularity();
        let head_bytes: usize = spans.iter().map(|s| s.head).sum();
        for s in spans {
            let tail = s.len.next_multiple_of(g) - s.head;
            crate::ensure!(
                s.head % g == 0 && s.ring_off % g == 0 && s.head < s.len && s.ring_off + tail <= cap && cap % g == 0,
                Internal,
                "a split span {s:?} does not fit a ring of {cap} bytes in granules of {g}"
            );
        }
        // One handle per granule of the ring: a mapping starts at a
        // handle's offset 0 (CUDA maps no other), and a tail maps the
        // granules at its ring offset.
        let slots: Vec<PhysMem> = (0..cap / g).map(|_| PhysMem::new(dev, g)).collect::<Result<_>>()?;
        let va_len = cap + spans.iter().map(|s| s.len.next_multiple_of(g)).sum::<usize>();
        let mut va = VaRange::reserve(dev, va_len)?;
        let mut heads = Vec::with_capacity(spans.len());
        for (k, slot) in slots.iter().enumerate() {
            va.map(k * g, g, slot, 0, Access::ReadWrite)?;
        }
        let mut at = cap;
        let mut bases = Vec::with_capacity(spans.len());
        for s in spans {
            let rounded = s.len.next_multiple_of(g);
            if s.head > 0 {
                let h = PhysMem::new(dev, s.head)?;
                va.map(at, s.head, &h, 0, Access::ReadWrite)?;
                heads.push(h);
            }
            for k in 0..(rounded - s.head) / g {
                va.map(at + s.head + k * g, g, &slots[s.ring_off / g + k], 0, Access::ReadWrite)?;
            }
            bases.push((va.base() + at as u64, false));
            at += rounded;
        }
        Ok(Self {
            dev: dev.clone(),
            block: None,
            split: Some(SplitMem { va, _slots: slots, _heads: heads, spans: bases, head_bytes }),
            cap,
            occ: VecDeque::new(),
        })
    }
    /// The ring's bytes (the plan's `ring_bytes`).
    pub fn cap(&self) -> usize {
        self.cap
    }
    /// The bytes the ring holds of the budget: its own and the heads'.
    pub fn charged(&self) -> usize {
        self.cap + self.split.as_ref().map_or(0, |s| s.head_bytes)
    }
    /// Split weight `i`'s address (of [`Self::new_split`]'s spans) and
    /// whether its head was copied.
    pub fn span(&self, i: usize) -> Option<(u64, bool)> {
        self.split.as_ref()?.spans.get(i).copied()
    }
    /// Split weight `i`'s head is copied (or being copied, ordered before
    /// every later page-in of it: see `ring_page_in`).
    pub fn note_head_copied(&mut self, i: usize) {
        if let Some(s) = self.split.as_mut().and_then(|m| m.spans.get_mut(i)) {
            s.1 = true;
        }
    }
    fn base(&self) -> u64 {
        match (&self.block, &self.split) {
            (Some(b), _) => b.addr(),
            (None, Some(s)) => s.va.base(),
            (None, None) => 0,
        }
    }
    /// The occupants that bytes `off..off+len` would overwrite; `None` if
    /// they are outside the ring.
    pub fn spot(&self, off: usize, len: usize) -> Option<Vec<WeightId>> {
        let len = len.next_multiple_of(ALIGN);
        if off.checked_add(len)? > self.cap {
            return None;
        }
        Some(self.occ.iter().filter(|&&(_, o, l)| o < off + len && off < o + l).map(|&(w, _, _)| w).collect())
    }
    /// `w` now occupies `len` bytes at `off` (the caller vacated what [`Self::spot`] named).
    pub fn occupy(&mut self, w: WeightId, off: usize, len: usize) -> u64 {
        let len = len.next_multiple_of(ALIGN);
        self.occ.push_back((w, off, len));
        self.base() + off as u64
    }
    pub fn vacate(&mut self, w: WeightId) {
        self.occ.retain(|&(x, _, _)| x != w);
    }
}

impl Drop for Ring {
    /// Occupants handed on by device ordering may still be read: synchronize
    /// the device before the memory goes back (a re-plan or teardown, never in
    /// steady state). If that fails the memory is leaked, never reused early.
    fn drop(&mut self) {
        let (block, split) = (self.block.take(), self.split.take());
        if block.is_none() && split.is_none() {
            return;
        }
        if let Err(e) = self.dev.synchronize() {
            log::error!("epmem: leaking the streaming region: the device could not be synchronized ({e})");
            std::mem::forget(block);
            std::mem::forget(split);
            return;
        }
        drop(split);
        drop(block);
    }
}

/// A streamed weight's place in the ring, with the events fencing it: its
/// page-in and one per release.
#[derive(Debug)]
pub(crate) struct RingSlot {
    addr: u64,
    page_in: Option<Fence>,
    events: Vec<Event>,
}

impl RingSlot {
    pub fn new(addr: u64, page_in: Fence) -> Self {
        Self { addr, page_in: Some(page_in), events: Vec::new() }
    }
    pub fn addr(&self) -> u64 {
        self.addr
    }
    pub fn page_in(&self) -> Option<&Fence> {
        self.page_in.as_ref()
    }
    pub fn page_in_done(&mut self) -> Result<bool> {
        super::read_fence::page_in_done(&mut self.page_in)
    }
    /// Release events not yet observed complete (after [`Self::prune`]).
    pub fn pending(&self) -> usize {
        self.events.len()
    }
    pub fn push(&mut self, e: Event) {
        self.events.push(e);
    }
    /// Events observed complete, for reuse. Never blocks.
    pub fn prune(&mut self) -> Result<Vec<Event>> {
        super::read_fence::prune_events(&mut self.events)
    }
    /// Give the bytes up to a later page-in: `order` waits (on the device)
    /// for the page-in and every read. Returns the events (their waits are
    /// captured, so they may be recorded again).
    pub fn order_before(mut self, order: &Stream) -> Result<Vec<Event>> {
        if let Some(f) = self.page_in.take() {
            f.make_wait(order.raw())?;
        }
        for e in &self.events {
            order.wait_event(e)?;
        }
        Ok(std::mem::take(&mut self.events))
    }
    /// Give the bytes up after waiting on the host (unregistering, re-planning).
    pub fn wait(mut self) -> Result<Vec<Event>> {
        if let Some(f) = self.page_in.take() {
            f.wait()?;
        }
        for e in &self.events {
            e.synchronize()?;
        }
        Ok(std::mem::take(&mut self.events))
    }
}

impl Drop for RingSlot {
    fn drop(&mut self) {
        if let Some(Err(e)) = self.page_in.as_ref().map(|f| f.wait()) {
            log::error!("epmem: a streamed page-in could not be observed ({e})");
        }
        for e in &self.events {
            if let Err(err) = e.synchronize() {
                log::error!("epmem: a streamed weight's read fence could not be observed ({err})");
            }
        }
    }
}
