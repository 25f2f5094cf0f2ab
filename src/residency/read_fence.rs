//! The read fence and its witness: proof that no queued work still touches a
//! resident weight's device memory before that memory is given back.
//!
//! A resident weight's memory is written by its page-in copy and read by
//! every kernel launched between `acquire` and `release`. Each of those is
//! ordered by an event: the page-in's completion [`Fence`], and one event per
//! `release` recorded on the releasing stream. A [`Fenced`] block owns the
//! memory together with those events; the only ways out are
//! [`Fenced::try_complete`] (never blocks) and [`Fenced::wait`], and both return
//! the block *inside* a [`ReadsDone`]: a move-only value whose constructor is
//! private to this module, called only after every event was observed
//! complete, and which owns the very block it vouches for. The memory goes
//! back to the arena through [`ReadsDone::free`] (or by dropping the
//! `ReadsDone`), so a witness for block A cannot free block B: there is no
//! witness apart from its block.
//!
//! A bare [`DeviceBlock`] has no such proof: its address may have been handed
//! to any stream. So its `Drop` never silently recycles the memory: it
//! synchronizes the whole device first (every stream of the context, the
//! only observation that covers work queued on streams it does not know),
//! and frees only if that succeeded; if it failed (a lost context), the
//! memory is leaked, and dropping never panics. The usual paths never get
//! there: a block filled by a page-in lives in a `Fenced`, and leaves it only
//! inside a `ReadsDone`. What does is a page-in that failed part-way (some
//! chunks of its copy may be queued): the synchronize is what makes that
//! safe. [`DeviceArena`]'s stats count these in `free_calls` like any free.
//! Nor can safe code free a block's memory by address: the arena marks a
//! block's allocation as owned, and its address-level `free` (the C and
//! ONNX Runtime path) refuses it with `InvalidArgument`.
//!
//! The refusals (forging, cloning, `Default`, freeing a bare block, taking
//! the block out) are compiled, with their error codes checked, by
//! `tests/compile_fail.rs`. Holding and moving a witness compiles:
//! ```
//! use epmem::residency::read_fence::ReadsDone;
//! fn pass(w: ReadsDone) -> (u64, ReadsDone) {
//!     (w.addr(), w)
//! }
//! ```
//! One exception keeps the host from waiting where the device can order the
//! work instead: a victim still being read can be handed straight to the
//! next page-in as a [`Reused`] block ([`Fenced::reuse_after`]). Its readers'
//! events are made to gate an order stream first, and the only thing a
//! `Reused` can do is be the destination of a copy issued after that stream
//! ([`Reused::fill`]), so the copy cannot start before the readers end. The
//! memory never passes through the arena while readers may be running.
//!
//! One more way a read may be fenced: not by an event of its own but by a
//! synchronize of the whole device ([`Fenced::note_unfenced_read`]). The
//! manager releases that way when every unit is resident, so nothing is
//! about to be evicted and an event per release would be spent work. Such a
//! block is never idle to a query and never completes without waiting:
//! [`Fenced::wait`], [`Fenced::reuse_after`] and dropping synchronize the
//! device (every stream of the context, the observation `DeviceBlock`'s drop
//! relies on too) before the witness is minted or the memory reused.

use std::fmt;
use std::sync::Arc;

use crate::arena::DeviceArena;
use crate::device::{Event, HostRange, RawStream, Stream};
use crate::error::Result;
use crate::staging::{Copier, Fence};

/// A block together with the proof that every event fencing it was observed
/// complete. Move-only; minted only in this module. Dropping it frees the
/// block, as [`ReadsDone::free`] does.
#[must_use = "a ReadsDone holds its block: free it"]
pub struct ReadsDone {
    block: DeviceBlock,
}

impl ReadsDone {
    /// Only this module mints witnesses, after observing `block`'s fences.
    fn mint(block: DeviceBlock) -> Self {
        ReadsDone { block }
    }
    /// The block's device address (no work may be queued on it any more).
    pub fn addr(&self) -> u64 {
        self.block.addr
    }
    pub fn len(&self) -> usize {
        self.block.len
    }
    pub fn is_empty(&self) -> bool {
        self.block.len == 0
    }
    /// Give the block's memory back to its arena (no driver call).
    pub fn free(self) {
        drop(self)
    }
}

impl Drop for ReadsDone {
    fn drop(&mut self) {
        if let Some(arena) = self.block.arena.take() {
            crate::device::objects::log_drop_error("device arena free", arena.free_owned(self.block.addr));
        }
    }
}

impl fmt::Debug for ReadsDone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ReadsDone({:?})", self.block)
    }
}

/// Device-arena memory holding one resident weight. Not `Clone`.
///
/// The way back to the arena is through a [`Fenced`] and its [`ReadsDone`].
/// Dropped bare, it synchronizes the device before freeing, or leaks if that
/// fails (see the module docs): never a silent recycle.
pub struct DeviceBlock {
    /// `None` once the memory went back (through a `ReadsDone`).
    arena: Option<Arc<DeviceArena>>,
    addr: u64,
    len: usize,
}

impl fmt::Debug for DeviceBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceBlock[{:#x}, +{})", self.addr, self.len)
    }
}

impl DeviceBlock {
    /// Allocate `len` bytes from `arena`.
    pub fn alloc(arena: &Arc<DeviceArena>, len: usize) -> Result<Self> {
        Ok(Self { addr: arena.alloc_owned(len, 0)?, arena: Some(arena.clone()), len })
    }
    pub fn addr(&self) -> u64 {
        self.addr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl DeviceBlock {
    /// Keep the memory allocated for good (it may still be in use by work
    /// nobody can observe any more); the arena handle is let go.
    fn leak(mut self) {
        self.arena = None;
    }
}

impl Drop for DeviceBlock {
    fn drop(&mut self) {
        let Some(arena) = self.arena.take() else { return };
        match arena.device().synchronize() {
            Ok(()) => crate::device::objects::log_drop_error("device arena free", arena.free_owned(self.addr)),
            Err(e) => log::error!(
                "epmem: leaking {self:?}: dropped without a read fence, and the device synchronize \
                 that would prove it idle failed ({e})"
            ),
        }
    }
}

/// A block together with the events that fence work on it: the page-in
/// copy's fence, then one event per release (the reads).
#[derive(Debug)]
pub struct Fenced {
    block: Option<DeviceBlock>,
    page_in: Option<Fence>,
    events: Vec<Event>,
    /// Reads released without an event: only a synchronize of the whole
    /// device observes them complete.
    unfenced_reads: bool,
}

/// Whether the page-in fenced by `slot` has completed (never blocks);
/// forgets the fence once it has. Shared by resident blocks and ring slots.
pub(super) fn page_in_done(slot: &mut Option<Fence>) -> Result<bool> {
    if let Some(f) = slot {
        if !f.query()? {
            return Ok(false);
        }
        *slot = None;
    }
    Ok(true)
}

/// Take the events observed complete out of `events` (for reuse); never
/// blocks. Shared by resident blocks and ring slots.
pub(super) fn prune_events(events: &mut Vec<Event>) -> Result<Vec<Event>> {
    let mut done = Vec::new();
    let mut i = 0;
    while i < events.len() {
        if events[i].query()? {
            done.push(events.swap_remove(i));
        } else {
            i += 1;
        }
    }
    Ok(done)
}

/// The result of [`Fenced::try_complete`].
#[derive(Debug)]
pub enum TryReadsDone {
    /// Every event completed: the block inside its witness, and the spent events (for reuse).
    Done(ReadsDone, Vec<Event>),
    /// Still running.
    Pending(Fenced),
}

impl Fenced {
    /// `block` with the fence of the page-in copy just queued into it.
    pub fn new(block: DeviceBlock, page_in: Fence) -> Self {
        Self { block: Some(block), page_in: Some(page_in), events: Vec::new(), unfenced_reads: false }
    }
    /// Fence one more use by a synchronize of the whole device instead of an
    /// event (see the module docs).
    pub fn note_unfenced_read(&mut self) {
        self.unfenced_reads = true;
    }
    /// Reads only a synchronize of the device observes: when the block
    /// leaves, the device is synchronized first.
    pub fn has_unfenced_reads(&self) -> bool {
        self.unfenced_reads
    }
    /// Synchronize the device if reads are fenced only that way, and forget
    /// them: everything queued so far has completed.
    fn settle_unfenced(&mut self) -> Result<()> {
        if self.unfenced_reads {
            if let Some(b) = self.block.as_ref().and_then(|b| b.arena.as_ref()) {
                b.device().synchronize()?;
            }
            self.unfenced_reads = false;
        }
        Ok(())
    }
    /// The page-in's fence, until it is observed complete.
    pub fn page_in(&self) -> Option<&Fence> {
        self.page_in.as_ref()
    }
    /// Whether the page-in copy has completed (never blocks; forgets the
    /// fence once it has).
    pub fn page_in_done(&mut self) -> Result<bool> {
        page_in_done(&mut self.page_in)
    }
    /// The device address (valid for work ordered after the fences' streams
    /// as the manager arranges).
    pub fn addr(&self) -> u64 {
        self.block.as_ref().map_or(0, |b| b.addr)
    }
    pub fn len(&self) -> usize {
        self.block.as_ref().map_or(0, |b| b.len)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Fence one more use (an event already recorded after it).
    pub fn push(&mut self, e: Event) {
        self.events.push(e);
    }
    /// Whether the page-in and every read have completed. Never blocks and
    /// changes nothing (a choice between victims, not a completion).
    pub fn is_idle(&self) -> Result<bool> {
        if self.unfenced_reads {
            return Ok(false);
        }
        if let Some(f) = &self.page_in {
            if !f.query()? {
                return Ok(false);
            }
        }
        for e in &self.events {
            if !e.query()? {
                return Ok(false);
            }
        }
        Ok(true)
    }
    /// Release events not yet observed complete.
    pub fn pending_reads(&self) -> usize {
        self.events.len() + self.unfenced_reads as usize
    }
    /// Drop events observed complete (returned for reuse), so a long-resident
    /// weight does not accumulate one per release. Never blocks.
    pub fn prune(&mut self) -> Result<Vec<Event>> {
        prune_events(&mut self.events)
    }
    /// Never blocks: the block and its witness if every event completed.
    pub fn try_complete(mut self) -> Result<TryReadsDone> {
        let spent = self.prune()?;
        if self.events.is_empty() && !self.unfenced_reads && self.page_in_done()? {
            Ok(TryReadsDone::Done(ReadsDone::mint(self.take()), spent))
        } else {
            // Completed events are spent either way; keep only the pending ones.
            drop(spent);
            Ok(TryReadsDone::Pending(self))
        }
    }
    /// Block until every event completes; the block inside its witness, and the spent events.
    pub fn wait(mut self) -> Result<(ReadsDone, Vec<Event>)> {
        self.settle_unfenced()?;
        if let Some(f) = self.page_in.take() {
            f.wait()?;
        }
        for e in &self.events {
            e.synchronize()?;
        }
        let events = std::mem::take(&mut self.events);
        Ok((ReadsDone::mint(self.take()), events))
    }
    fn take(&mut self) -> DeviceBlock {
        match self.block.take() {
            Some(b) => b,
            None => unreachable!("Fenced block taken twice"),
        }
    }
}

impl Fenced {
    /// Hand this block to the next page-in without waiting on the host:
    /// `order` is made to wait (on the device) for the page-in and every
    /// read, and the block comes back as a [`Reused`], which can only be
    /// filled by a copy ordered after `order`.
    pub fn reuse_after(mut self, order: &Stream) -> Result<Reused> {
        // Reads with no event cannot gate `order`: the host observes them.
        self.settle_unfenced()?;
        if let Some(f) = &self.page_in {
            f.make_wait(order.raw())?;
        }
        for e in &self.events {
            order.wait_event(e)?;
        }
        let (page_in, events) = (self.page_in.take(), std::mem::take(&mut self.events));
        Ok(Reused { block: Some(self.take()), page_in, events })
    }
}

/// A resident block whose readers may still be running, on its way to the
/// next weight. See the module docs.
#[derive(Debug)]
pub struct Reused {
    block: Option<DeviceBlock>,
    /// Kept so that dropping an unfilled `Reused` can wait for them.
    page_in: Option<Fence>,
    events: Vec<Event>,
}

impl Reused {
    pub fn len(&self) -> usize {
        self.block.as_ref().map_or(0, |b| b.len)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copy `src` (at most the block's length) into the block with `copier`,
    /// ordered after `order` — the stream [`Fenced::reuse_after`] made wait
    /// for the block's readers.
    pub fn fill(self, copier: Copier<'_>, src: HostRange, order: RawStream) -> Result<Fenced> {
        self.fill_with(src.len(), |dst| copier.htod_after(dst, src, Some(order)))
    }

    /// Write `len` bytes (at most the block's length) into the block with
    /// `issue`, which gets the block's address and must queue its writes
    /// after the stream [`Fenced::reuse_after`] made wait for the block's
    /// readers, returning their fence (a compressed page-in: a copy into
    /// staging, which need not wait, then a decode into the block after
    /// that stream).
    pub fn fill_with(mut self, len: usize, issue: impl FnOnce(u64) -> Result<Fence>) -> Result<Fenced> {
        crate::ensure!(
            len <= self.len(),
            InvalidArgument,
            "a page-in of {} bytes into a reused block of {}",
            len,
            self.len()
        );
        let block = match self.block.take() {
            Some(b) => b,
            None => unreachable!("Reused filled twice"),
        };
        match issue(block.addr()) {
            Ok(fence) => Ok(Fenced::new(block, fence)),
            Err(e) => {
                // Nothing was queued into the block: it goes back through
                // the usual waits (Fenced's drop) with the readers' fences.
                drop(Fenced {
                    block: Some(block),
                    page_in: self.page_in.take(),
                    events: std::mem::take(&mut self.events),
                    unfenced_reads: false,
                });
                Err(e)
            }
        }
    }
}

impl Drop for Reused {
    /// Unfilled: wait for the readers before the memory goes back, as Fenced does.
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            drop(Fenced {
                block: Some(block),
                page_in: self.page_in.take(),
                events: std::mem::take(&mut self.events),
                unfenced_reads: false,
            });
        }
    }
}

impl Drop for Fenced {
    /// Waits for the fences, then frees; if a wait fails (lost context) the
    /// memory is leaked rather than handed to a new weight a kernel may
    /// still read, and dropping never panics.
    fn drop(&mut self) {
        if let Err(err) = self.settle_unfenced() {
            if let Some(block) = self.block.take() {
                log::error!("epmem: leaking {block:?}: its reads could not be observed ({err})");
                block.leak();
            }
            return;
        }
        let Some(block) = self.block.take() else { return };
        if let Some(Err(err)) = self.page_in.as_ref().map(|f| f.wait()) {
            log::error!("epmem: leaking {block:?}: its page-in could not be observed ({err})");
            block.leak();
            return;
        }
        for e in &self.events {
            if let Err(err) = e.synchronize() {
                log::error!("epmem: leaking {block:?}: its read fence could not be observed ({err})");
                block.leak();
                return;
            }
        }
        ReadsDone::mint(block).free();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::arena::{Arena, ArenaConfig};
    use crate::device::{self, DeviceSelect, Gate};
    use crate::staging::{CopyEngine, EngineConfig, PinnedStagingPool, PoolConfig};

    fn setup() -> (Arc<dyn device::Device>, Arc<DeviceArena>) {
        let d = device::open(DeviceSelect::Host, 0).unwrap();
        let arena = Arc::new(DeviceArena::new(&d, ArenaConfig::with_capacity(64 << 20)).unwrap());
        (d, arena)
    }

    #[test]
    fn a_bare_block_dropped_waits_for_the_device_before_freeing() {
        let (d, arena) = setup();
        let block = DeviceBlock::alloc(&arena, 4096).unwrap();
        let s = Stream::new(&d).unwrap();
        // Work on the block is held; only the watchdog opens the gate, so a
        // drop that synchronizes returns after it fired, one that recycled
        // at once would return before.
        let gate = Gate::new();
        let wd = gate.watchdog(Duration::from_millis(100));
        d.hold_async(s.raw(), &gate).unwrap();
        d.memset_d8_async(block.addr(), 7, 4096, s.raw()).unwrap();
        drop(block);
        assert!(wd.fired(), "a bare block went back to the arena while work queued on it was held");
        assert_eq!(arena.stats().live_allocations, 0, "freed after the synchronize");
    }

    #[test]
    fn a_witness_frees_its_own_block_and_no_other() {
        let (d, arena) = setup();
        let pool = PinnedStagingPool::new(&d, PoolConfig::default()).unwrap();
        let engine = CopyEngine::new(&pool, EngineConfig { fill_threads: 1, ..EngineConfig::default() }).unwrap();
        let (a, b) = (DeviceBlock::alloc(&arena, 4096).unwrap(), DeviceBlock::alloc(&arena, 4096).unwrap());
        let (a_addr, b_addr) = (a.addr(), b.addr());
        let src = HostRange::from_static(&[5u8; 4096]);
        let fenced = Fenced::new(a, engine.htod(a_addr, src, None).unwrap());
        let (done, _spent) = fenced.wait().unwrap();
        assert_eq!(done.addr(), a_addr);
        done.free();
        assert_eq!(arena.size_of(a_addr), None, "A's witness freed A");
        assert_eq!(arena.size_of(b_addr), Some(4096), "and left B alone");
        // Nor can B be freed by address behind its fence.
        assert_eq!(arena.free(b_addr).unwrap_err().status(), crate::EpmStatus::InvalidArgument);
        assert_eq!(arena.size_of(b_addr), Some(4096));
        // A fenced block dropped waits for its fences, then frees through its witness.
        let fenced_b = Fenced::new(b, engine.htod(b_addr, src, None).unwrap());
        drop(fenced_b);
        assert_eq!(arena.stats().live_allocations, 0);
    }
}
