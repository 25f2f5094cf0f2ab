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

use std::collections::VecDeque;
use std::sync::Arc;

use super::WeightId;
use super::placement::ALIGN;
use super::read_fence::DeviceBlock;
use crate::arena::DeviceArena;
use crate::device::{Device, Event, Stream};
use crate::error::Result;
use crate::staging::Fence;

/// The streaming region.
#[derive(Debug)]
pub(crate) struct Ring {
    dev: Arc<dyn Device>,
    block: Option<DeviceBlock>,
    cap: usize,
    /// Occupants in placement order: (weight, offset, bytes).
    occ: VecDeque<(WeightId, usize, usize)>,
}

impl Ring {
    pub fn new(arena: &Arc<DeviceArena>, cap: usize) -> Result<Self> {
        Ok(Self {
            dev: arena.device().clone(),
            block: Some(DeviceBlock::alloc(arena, cap)?),
            cap,
            occ: VecDeque::new(),
        })
    }
    pub fn cap(&self) -> usize {
        self.cap
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
        self.block.as_ref().map_or(0, |b| b.addr()) + off as u64
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
        let Some(block) = self.block.take() else {
            return;
        };
        if let Err(e) = self.dev.synchronize() {
            log::error!("epmem: leaking the streaming region {block:?}: the device could not be synchronized ({e})");
            std::mem::forget(block);
            return;
        }
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
