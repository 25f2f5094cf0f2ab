//! The device arena: one VA reservation, committed chunk by chunk.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use super::suballoc::SubAlloc;
use super::{Arena, ArenaConfig, ArenaStats, DEFAULT_UNIT, TaggedStats, chunk_size};
use crate::device::{Access, Device, PhysMem, VaRange};
use crate::error::Result;

#[derive(Debug)]
struct Inner {
    sub: SubAlloc,
    /// Physical memory of each chunk, `None` while uncommitted. Declared
    /// before `va` is irrelevant: teardown unmaps explicitly first.
    chunks: Vec<Option<PhysMem>>,
    /// Live allocations touching each chunk (trim gives back only zeros).
    users: Vec<u32>,
    va: VaRange,
    stats: ArenaStats,
    /// Offsets of live allocations owned by a residency `DeviceBlock`: they
    /// go back only through [`DeviceArena::free_owned`] (the block's
    /// `ReadsDone`, or its synchronizing drop), never by address.
    owned: HashSet<usize>,
}

/// Device memory for resident weights and ONNX Runtime tensors. See [`super`].
#[derive(Debug)]
pub struct DeviceArena {
    dev: Arc<dyn Device>,
    chunk: usize,
    inner: Mutex<Inner>,
}

impl DeviceArena {
    /// Reserve `cfg.capacity` bytes of VA rounded up to the granularity:
    /// that is the bound on what the arena commits and hands out. Chunks
    /// are `cfg.chunk_bytes` each, except the last, which ends at the bound
    /// (so a capacity below one chunk commits no more than it says).
    /// Nothing is committed until the first allocation.
    pub fn new(dev: &Arc<dyn Device>, cfg: ArenaConfig) -> Result<Self> {
        let granularity = dev.vmm_granularity();
        let chunk = chunk_size(cfg.chunk_bytes, granularity)?;
        super::check_capacity(cfg.capacity)?;
        // MAX_CAPACITY is a multiple of 256 and granularities are powers of
        // two: only a granularity above 256 can push the rounding past it.
        let capacity =
            cfg.capacity.checked_next_multiple_of(granularity).filter(|&c| c <= super::MAX_CAPACITY).ok_or_else(
                || {
                    crate::error::Error::invalid_argument(format!(
                        "device arena capacity_bytes {} rounded up to the granularity of {granularity} bytes \
                     exceeds the limit of {} bytes",
                        cfg.capacity,
                        super::MAX_CAPACITY
                    ))
                },
            )?;
        let sub = SubAlloc::new(capacity, DEFAULT_UNIT, cfg.max_allocs)?;
        let va = VaRange::reserve(dev, capacity)?;
        let n = capacity.div_ceil(chunk);
        let stats = ArenaStats { reserved_bytes: capacity as u64, ..Default::default() };
        Ok(Self {
            dev: dev.clone(),
            chunk,
            inner: Mutex::new(Inner {
                sub,
                chunks: (0..n).map(|_| None).collect(),
                users: vec![0; n],
                va,
                stats,
                owned: HashSet::new(),
            }),
        })
    }

    pub fn device(&self) -> &Arc<dyn Device> {
        &self.dev
    }
    /// The growth step in bytes.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk
    }
    pub fn capacity(&self) -> usize {
        self.lock().sub.capacity()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves counters possibly stale but
        // memory state consistent (every mutation is completed before the
        // next fallible call), so keep going.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes of chunk `c`: a whole chunk, or the rest of the capacity for
    /// the last one (a multiple of the granularity either way).
    fn chunk_len(&self, g: &Inner, c: usize) -> usize {
        self.chunk.min(g.sub.capacity() - c * self.chunk)
    }

    /// Chunk indices `[first, last]` covered by a byte span.
    fn chunk_span(&self, start: usize, len: usize) -> std::ops::RangeInclusive<usize> {
        start / self.chunk..=(start + len - 1) / self.chunk
    }

    fn commit(&self, g: &mut Inner, c: usize) -> Result<()> {
        if g.chunks[c].is_some() {
            return Ok(());
        }
        let len = self.chunk_len(g, c);
        let phys = PhysMem::new(&self.dev, len)?;
        g.stats.driver_alloc_calls += 1;
        g.va.map(c * self.chunk, len, &phys, 0, Access::ReadWrite)?;
        g.chunks[c] = Some(phys);
        g.stats.committed_bytes += len as u64;
        Ok(())
    }

    /// An allocation owned by a typed handle (a residency `DeviceBlock`):
    /// [`Arena::free`] by address refuses it, so safe code cannot recycle a
    /// block's memory behind its read fence; [`Self::free_owned`] frees it.
    pub(crate) fn alloc_owned(&self, bytes: usize, align: usize) -> Result<u64> {
        self.alloc_marked(bytes, align, true)
    }

    /// Free an allocation made by [`Self::alloc_owned`].
    pub(crate) fn free_owned(&self, addr: u64) -> Result<()> {
        let mut g = self.lock();
        let g = &mut *g;
        let off = addr.checked_sub(g.va.base()).map(|o| o as usize);
        crate::ensure!(
            off.is_some_and(|o| g.owned.remove(&o)),
            InvalidArgument,
            "address {addr:#x} is not an owned allocation of this device arena"
        );
        self.free_locked(g, addr)
    }

    fn free_locked(&self, g: &mut Inner, addr: u64) -> Result<()> {
        self.free_locked_as(g, addr, 0)
    }

    fn free_locked_as(&self, g: &mut Inner, addr: u64, tag: u64) -> Result<()> {
        let base = g.va.base();
        crate::ensure!(
            addr >= base && addr < base + g.sub.capacity() as u64,
            InvalidArgument,
            "address {addr:#x} is not inside this device arena"
        );
        let off = (addr - base) as usize;
        let live = if tag == 0 { g.sub.free(off)? } else { g.sub.free_tagged(off, tag)? };
        let (start, span) = live.span();
        for c in self.chunk_span(start, span) {
            g.users[c] -= 1;
        }
        g.stats.free_calls += 1;
        Ok(())
    }

    /// `owned`: the allocation is marked as a typed handle's (see `alloc_owned`)
    /// under the same lock, so no address-level free can slip in between.
    fn alloc_marked(&self, bytes: usize, align: usize, owned: bool) -> Result<u64> {
        self.alloc_from(bytes, align, owned, 0, true)?
            .map(|(a, _)| a)
            .ok_or_else(|| crate::error::Error::internal("untagged allocation came back empty"))
    }

    /// From the untagged pool (`tag` 0: an error when nothing fits) or only
    /// from ranges of `tag` (`None` when nothing fits).
    fn alloc_from(
        &self,
        bytes: usize,
        align: usize,
        owned: bool,
        tag: u64,
        fresh: bool,
    ) -> Result<Option<(u64, bool)>> {
        crate::ensure!(
            align <= self.chunk,
            InvalidArgument,
            "alignment {align} exceeds the arena's chunk of {} bytes",
            self.chunk
        );
        let mut g = self.lock();
        let g = &mut *g;
        let (off, own) = match tag {
            0 if fresh => (g.sub.alloc(bytes, align)?, false),
            t => match g.sub.alloc_tagged(bytes, align, t, fresh)? {
                Some(hit) => hit,
                None => return Ok(None),
            },
        };
        let (start, span) = g.sub.get(off).map(|l| l.span()).unwrap_or((off, bytes));
        let chunks = self.chunk_span(start, span);
        for c in chunks.clone() {
            if let Err(e) = self.commit(g, c) {
                // Leave chunks committed so far: they are reusable, and
                // giving them back here would cost driver calls for nothing.
                let _ = g.sub.free(off);
                return Err(e.context(format!("growing the device arena for {bytes} bytes")));
            }
        }
        for c in chunks {
            g.users[c] += 1;
        }
        g.stats.alloc_calls += 1;
        if owned {
            g.owned.insert(off);
        }
        Ok(Some((g.va.base() + off as u64, own)))
    }

    /// Give back chunk `c` if committed; the bytes given back.
    fn decommit(&self, g: &mut Inner, c: usize) -> Result<usize> {
        if g.chunks[c].is_none() {
            return Ok(0);
        }
        let len = self.chunk_len(g, c);
        g.va.unmap(c * self.chunk, len)?;
        drop(g.chunks[c].take());
        g.stats.driver_free_calls += 1;
        g.stats.committed_bytes -= len as u64;
        Ok(len)
    }
}

impl Arena for DeviceArena {
    fn alloc(&self, bytes: usize, align: usize) -> Result<u64> {
        self.alloc_marked(bytes, align, false)
    }

    fn free(&self, addr: u64) -> Result<()> {
        self.free_tagged(addr, 0)
    }

    fn alloc_tagged(&self, bytes: usize, tag: u64, fresh: bool) -> Result<Option<(u64, bool)>> {
        self.alloc_from(bytes, 0, false, tag, fresh)
    }

    fn untag(&self, tag: u64) -> usize {
        self.lock().sub.untag(tag)
    }

    fn tagged_stats(&self) -> TaggedStats {
        let g = self.lock();
        let (ranges, bytes) = g.sub.tagged();
        TaggedStats { ranges: ranges as u64, bytes: bytes as u64, peak_held_bytes: g.sub.peak_held() as u64 }
    }

    fn free_tagged(&self, addr: u64, tag: u64) -> Result<()> {
        let mut g = self.lock();
        let g = &mut *g;
        if let Some(off) = addr.checked_sub(g.va.base()) {
            crate::ensure!(
                !g.owned.contains(&(off as usize)),
                InvalidArgument,
                "address {addr:#x} belongs to a resident weight's block: it goes back through its read \
                 fence (ReadsDone), not by address"
            );
        }
        self.free_locked_as(g, addr, tag)
    }

    fn size_of(&self, addr: u64) -> Option<usize> {
        let g = self.lock();
        let off = addr.checked_sub(g.va.base())? as usize;
        g.sub.get(off).map(|l| l.requested)
    }

    fn trim(&self) -> Result<usize> {
        let mut g = self.lock();
        let g = &mut *g;
        // A tagged range is free in the chunk count but may still be read by
        // queued work: its owner must untag (after that work) first.
        crate::ensure!(
            g.sub.tagged().1 == 0,
            InvalidArgument,
            "device arena trim with {} bytes still waiting for their stream's work",
            g.sub.tagged().1
        );
        let mut given = 0;
        for c in 0..g.chunks.len() {
            if g.users[c] == 0 && g.chunks[c].is_some() {
                given += self.decommit(g, c)?;
            }
        }
        Ok(given)
    }

    fn stats(&self) -> ArenaStats {
        let g = self.lock();
        ArenaStats {
            in_use_bytes: g.sub.in_use() as u64,
            peak_in_use_bytes: g.sub.peak_in_use() as u64,
            live_allocations: g.sub.live_count() as u64,
            fragmentation: g.sub.fragmentation(),
            ..g.stats
        }
    }
}

impl Drop for DeviceArena {
    fn drop(&mut self) {
        // Teardown order: unmap → release handle → free VA (the VaRange drops last).
        let mut g = self.lock();
        let g = &mut *g;
        for c in 0..g.chunks.len() {
            if let Err(e) = self.decommit(g, c) {
                log::warn!("epmem: device arena teardown: {e}");
            }
        }
    }
}
