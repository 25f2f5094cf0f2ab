//! Where stream-ordered allocators get their memory: epmem's arenas behind
//! one trait.
//!
//! [`MemorySource`] is the seam between an allocator front end (ONNX
//! Runtime's `OrtAllocator` in `ort::allocator`, the C API's ordered arena,
//! PyTorch's pluggable allocator) and the arenas: the front end does its
//! accounting and limits; a source hands out and takes back address ranges,
//! with the tags [`super::stream_order::StreamOrdered`] needs. Device memory
//! comes from a [`DeviceArena`] (one VA reservation, committed granule by
//! granule), pinned host memory from a [`PinnedArena`] (pinned segments);
//! neither makes a driver call per allocation in steady state.

use std::sync::Arc;

use crate::arena::{Arena, ArenaConfig, ArenaStats, DeviceArena, PinnedArena, TaggedStats};
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
    /// The arena's own counters (in use, peak, live allocations, driver calls).
    fn arena_stats(&self) -> ArenaStats;
    /// For the owner of `tag`: best fit over its ranges and everyone's (see
    /// [`Arena::alloc_tagged`]).
    fn alloc_tagged(&self, bytes: usize, tag: u64, fresh: bool) -> Result<Option<(u64, bool)>>;
    /// Free under `tag`: only `alloc_tagged(.., tag)` sees it until `untag`.
    fn free_tagged(&self, addr: u64, tag: u64) -> Result<()>;
    /// Make `tag`'s memory free for everyone; bytes released.
    fn untag(&self, tag: u64) -> usize;
    fn tagged_stats(&self) -> TaggedStats;
    /// Short name for stats.
    fn name(&self) -> &'static str;
}

/// Which memory of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MemKind {
    /// Device memory (ORT's DEFAULT, PyTorch's CUDA tensors).
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
        // Device memory grows one VMM granule (2 MiB on the H200) at a time,
        // not the arena's default 16: ORT's working set is a few large
        // tensors whose ends rarely fill a 32 MiB chunk, and every chunk
        // touched stays committed. The extra driver calls are paid in warm-up
        // only (steady state makes none either way).
        MemKind::Device => Box::new(ArenaSource {
            arena: DeviceArena::new(dev, ArenaConfig { chunk_bytes: dev.vmm_granularity(), ..cfg })?,
            name: "device_arena",
        }),
        MemKind::Pinned => Box::new(ArenaSource { arena: PinnedArena::new(dev, cfg)?, name: "pinned_arena" }),
    })
}

/// Device memory from a [`DeviceArena`] shaped exactly by `cfg` (its chunk
/// of 0 meaning the arena's default, 16 granules).
pub(crate) fn device_source(dev: &Arc<dyn Device>, cfg: ArenaConfig) -> Result<Box<dyn MemorySource>> {
    Ok(Box::new(ArenaSource { arena: DeviceArena::new(dev, cfg)?, name: "device_arena" }))
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
    fn arena_stats(&self) -> ArenaStats {
        self.arena.stats()
    }
    fn name(&self) -> &'static str {
        self.name
    }
    fn alloc_tagged(&self, bytes: usize, tag: u64, fresh: bool) -> Result<Option<(u64, bool)>> {
        self.arena.alloc_tagged(bytes, tag, fresh)
    }
    fn free_tagged(&self, addr: u64, tag: u64) -> Result<()> {
        self.arena.free_tagged(addr, tag)
    }
    fn untag(&self, tag: u64) -> usize {
        self.arena.untag(tag)
    }
    fn tagged_stats(&self) -> TaggedStats {
        self.arena.tagged_stats()
    }
}
