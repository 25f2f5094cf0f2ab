//! Device and pinned-host arenas: exact best-fit sub-allocation in
//! O(log free ranges) per call (`suballoc`), with no driver call per
//! allocation or free in steady state.
//!
//! - [`DeviceArena`](crate::arena::DeviceArena): one VA reservation of `capacity` bytes, backed in
//!   chunks of whole granules of physical memory ([`crate::device::PhysMem`]:
//!   CUDA VMM on a GPU, memfd on the host device) that are committed the first
//!   time an allocation lands in them and then kept. cuMemCreate + map + set
//!   access cost ~50 µs per 2 MiB granule on the H200 (docs/BENCHMARKS.md,
//!   "KV: granule operations against the driver floor"), so
//!   the driver is paid once per chunk, never per allocation.
//! - [`PinnedArena`](crate::arena::PinnedArena): the same interface over page-locked host memory, in
//!   segments (pinned memory cannot be grown in place; cuMemHostAlloc of
//!   32 MiB costs 12.6 ms, so segments are kept too).
//!
//! Both hand out addresses (`u64`): a device address for the device arena, a
//! host address for the pinned arena. Both are used by the residency manager
//! and by the ONNX Runtime allocators. [`Arena::trim`](crate::arena::Arena::trim) gives unused chunks
//! back explicitly; nothing is given back implicitly.

mod device;
mod pinned;
pub(crate) mod source;
pub(crate) mod stream_order;
mod suballoc;

pub use device::DeviceArena;
pub use pinned::PinnedArena;

use crate::error::Result;

/// Sub-allocation unit and default alignment: 256 bytes, cuMemAlloc's alignment.
pub const DEFAULT_UNIT: usize = 256;

/// The largest arena capacity: the sub-allocator counts in `u32` units of
/// [`DEFAULT_UNIT`] bytes (1 TiB less 256 bytes).
pub const MAX_CAPACITY: usize = u32::MAX as usize * DEFAULT_UNIT;

/// How an arena is shaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaConfig {
    /// The bound on the arena, exactly: the device arena commits at most
    /// `capacity` rounded up to the device's granularity (physical memory
    /// comes in whole granules), and its live allocations (each rounded up
    /// to [`DEFAULT_UNIT`]) never exceed that either; the pinned arena
    /// commits at most `capacity` bytes. Beyond it an allocation is
    /// [`crate::EpmStatus::OutOfBudget`]. At most [`MAX_CAPACITY`].
    pub capacity: usize,
    /// Growth step in bytes; 0 = 16 granules (32 MiB on the H200). Rounded
    /// up to the granularity.
    pub chunk_bytes: usize,
    /// Most live allocations at once (a bound on the bookkeeping, checked per allocation).
    pub max_allocs: u32,
}

impl ArenaConfig {
    pub fn with_capacity(capacity: usize) -> Self {
        Self { capacity, chunk_bytes: 0, max_allocs: 64 * 1024 }
    }
}

crate::stats::declare_stats! {
    /// Counters of one arena. `driver_*_calls` count physical allocations
    /// and frees (cuMemCreate / cuMemHostAlloc and their releases) made by
    /// this arena; in steady state they do not move.
    pub struct ArenaStats;
    /// The fields of `EpmArenaStats` after `size`, in C order.
    const ARENA_C_FIELDS;
    {
        /// Physical allocations (cuMemCreate / cuMemHostAlloc) made by the arena.
        /// Flat in steady state.
        field driver_alloc_calls: u64,
        /// Physical frees made by the arena (only `epm_arena_trim` and destroy free).
        field driver_free_calls: u64,
        /// Address space held (device: the VA reservation; pinned: the segments).
        field reserved_bytes: u64,
        /// Physical bytes committed.
        field committed_bytes: u64,
        /// Bytes held by live allocations (rounding and alignment padding included).
        field in_use_bytes: u64,
        field peak_in_use_bytes: u64,
        field live_allocations: u64,
        field alloc_calls: u64,
        field free_calls: u64,
        /// 1 − largest free range / free bytes: 0 when free space is one range.
        field fragmentation: f64,
    }
}

/// What both arenas offer. Thread-safe; every call takes an internal lock.
pub trait Arena: Send + Sync + std::fmt::Debug {
    /// `bytes > 0` aligned to `align` (0 = [`DEFAULT_UNIT`]; a power of two).
    /// Commits a chunk if the range lands in uncommitted memory.
    fn alloc(&self, bytes: usize, align: usize) -> Result<u64>;
    /// Free an address returned by `alloc`. A foreign or already-freed
    /// address is [`crate::EpmStatus::InvalidArgument`], and so is one
    /// owned by a resident weight's block (it goes back through its read
    /// fence). The caller guarantees no queued work still uses it.
    fn free(&self, addr: u64) -> Result<()>;
    /// The size requested for a live allocation.
    fn size_of(&self, addr: u64) -> Option<usize>;
    /// Give back every chunk no live allocation touches; returns bytes given back.
    fn trim(&self) -> Result<usize>;
    fn stats(&self) -> ArenaStats;

    // Stream-ordered reuse (used by `stream_order`): memory freed while
    // work queued on a stream may still use it is freed under that stream's
    // tag (non-zero). Only allocations for the same tag see it, at once (the
    // stream runs its work in order); everyone else sees it after `untag`,
    // which the caller makes once the stream's work has completed. `trim`
    // never gives back memory that holds a tagged range.

    /// For the owner of `tag`: like `alloc` (default alignment), the best fit
    /// over the ranges freed with `tag` and the memory free for everyone
    /// (tag 0: only the latter).
    /// With `fresh` false, memory never used before (that would grow the
    /// footprint) is left out. `Ok(None)` when nothing fits; else the address
    /// and whether it came from `tag`'s ranges.
    fn alloc_tagged(&self, bytes: usize, tag: u64, fresh: bool) -> Result<Option<(u64, bool)>>;
    /// Like `free`, into the pool of `tag`.
    fn free_tagged(&self, addr: u64, tag: u64) -> Result<()>;
    /// Make every range of `tag` free for everyone; bytes released.
    fn untag(&self, tag: u64) -> usize;
    /// Tagged free memory now and the peak of bytes never free for everyone.
    fn tagged_stats(&self) -> TaggedStats;
}

/// What [`Arena::tagged_stats`] reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TaggedStats {
    /// Tagged free ranges (coalesced) now.
    pub ranges: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Peak of in-use plus tagged bytes (unit rounding included).
    pub peak_held_bytes: u64,
}

/// `capacity` checked against [`MAX_CAPACITY`], with a message that names
/// the argument and the limit in bytes.
fn check_capacity(capacity: usize) -> Result<()> {
    crate::ensure!(capacity > 0, InvalidArgument, "arena capacity_bytes is 0");
    crate::ensure!(
        capacity <= MAX_CAPACITY,
        InvalidArgument,
        "arena capacity_bytes {capacity} exceeds the limit of {MAX_CAPACITY} bytes"
    );
    Ok(())
}

/// Round `chunk` (0 = 16 granules) up to the granularity.
/// A chunk so large it overflows when rounded is an error, not a panic
/// (found by ffi-tests/test_misuse_mem.c: chunk_bytes = UINT64_MAX).
pub(crate) fn chunk_size(chunk: usize, granularity: usize) -> Result<usize> {
    let c = if chunk == 0 { 16 * granularity } else { chunk };
    c.checked_next_multiple_of(granularity).ok_or_else(|| {
        crate::error::Error::invalid_argument(format!(
            "arena chunk_bytes {chunk} is too large (rounded up to the granularity of {granularity} bytes it overflows)"
        ))
    })
}
