//! Where an ORT allocator's memory comes from: epmem's arenas.
//!
//! [`MemorySource`] is the seam between the ORT adapter and epmem's memory
//! machinery: the allocator glue (`allocator.rs`) does accounting, limits and
//! stats; a source hands out and takes back address ranges. DEFAULT memory
//! comes from a [`DeviceArena`] (one VA reservation, committed in chunks of
//! granules), HOST_ACCESSIBLE memory from a [`PinnedArena`] (pinned
//! segments); neither makes a driver call per allocation in steady state.

use std::sync::Arc;

use crate::arena::{Arena, ArenaConfig, DeviceArena, PinnedArena};
use crate::device::Device;
use crate::error::Result;

/// Counters a source keeps about the memory it holds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct SourceStats {
    /// Physical bytes held from the driver now.
    pub committed_bytes: u64,
    /// Address space held (the device arena's VA reservation, the pinned segments).
    pub reserved_bytes: u64,
    /// Times the source went to the driver for more memory.
    pub extensions: u64,
    /// Times the source gave memory back to the driver.
    pub shrinks: u64,
    /// 1 − largest free range / free bytes.
    pub fragmentation: f64,
}

/// A provider of one kind of memory on one device.
pub(crate) trait MemorySource: Send + Sync {
    /// `bytes > 0` bytes; returns the address (a device address for device
    /// memory, a host address for pinned memory).
    fn alloc(&self, bytes: usize) -> Result<u64>;
    /// Give back an address from [`MemorySource::alloc`]. No queued work may
    /// still use it.
    fn free(&self, addr: u64) -> Result<()>;
    /// Return memory no allocation uses to the driver; bytes given back.
    fn trim(&self) -> Result<usize>;
    fn stats(&self) -> SourceStats;
    /// Short name for stats.
    fn name(&self) -> &'static str;
}

/// Which memory of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MemKind {
    /// Device memory (ORT's DEFAULT).
    Device,
    /// Page-locked host memory (ORT's HOST_ACCESSIBLE).
    Pinned,
}

/// An arena of `capacity` bytes for `kind` memory on `dev`. Nothing is
/// committed until the first allocation.
pub(crate) fn open(dev: &Arc<dyn Device>, kind: MemKind, capacity: u64) -> Result<Box<dyn MemorySource>> {
    let capacity = usize::try_from(capacity).unwrap_or(usize::MAX);
    let cfg = ArenaConfig::with_capacity(capacity);
    Ok(match kind {
        MemKind::Device => Box::new(ArenaSource {
            arena: DeviceArena::new(dev, cfg)?,
            name: "device_arena",
        }),
        MemKind::Pinned => Box::new(ArenaSource {
            arena: PinnedArena::new(dev, cfg)?,
            name: "pinned_arena",
        }),
    })
}

struct ArenaSource<A: Arena> {
    arena: A,
    name: &'static str,
}

impl<A: Arena> MemorySource for ArenaSource<A> {
    fn alloc(&self, bytes: usize) -> Result<u64> {
        self.arena.alloc(bytes, 0)
    }
    fn free(&self, addr: u64) -> Result<()> {
        self.arena.free(addr)
    }
    fn trim(&self) -> Result<usize> {
        self.arena.trim()
    }
    fn stats(&self) -> SourceStats {
        let s = self.arena.stats();
        SourceStats {
            committed_bytes: s.committed_bytes,
            reserved_bytes: s.reserved_bytes,
            extensions: s.driver_alloc_calls,
            shrinks: s.driver_free_calls,
            fragmentation: s.fragmentation,
        }
    }
    fn name(&self) -> &'static str {
        self.name
    }
}
