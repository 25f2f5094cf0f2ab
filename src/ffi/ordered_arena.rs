//! `EpmOrderedArena`: a device arena whose frees are ordered after a
//! stream's work (the `arena::stream_order` layer), so a caller can free a
//! block as soon as its last use is *queued*, as ONNX Runtime and PyTorch do.
//!
//! A block freed on stream S is reused by the next allocation on S at once
//! (S runs its work in order) and by anything else only after the work
//! queued on S before the free has completed (an event recorded at the
//! free). The same layer serves PyTorch's pluggable allocator (`torch.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::arena::ArenaConfig;
use crate::arena::source::{self, MemKind};
use crate::arena::stream_order::StreamOrdered;
use crate::device::{Device, RawStream};
use crate::ffi::arena::{EpmArenaConfig, config_of};
use crate::ffi::device::EpmDevice;
use crate::ffi::prelude::*;
use crate::ffi::stream::{EpmStream, same_device};

/// A stream-ordered arena and the counters its front end keeps (what an
/// `EpmOrderedArena` handle holds).
pub struct OrderedArena {
    dev: Arc<dyn Device>,
    mem: StreamOrdered,
    alloc_ns: AtomicU64,
    free_ns: AtomicU64,
    failed_allocs: AtomicU64,
    peak_committed: AtomicU64,
}

impl OrderedArena {
    /// Device memory of `dev`, shaped by `cfg`.
    pub(crate) fn new(dev: &Arc<dyn Device>, cfg: ArenaConfig) -> Result<Self> {
        Ok(Self::over(dev, source::device_source(dev, cfg)?))
    }

    /// Device memory of `dev` the way ONNX Runtime's allocators take it:
    /// `capacity` bytes of VA, grown one granule at a time; with the
    /// single-stream fast path (`StreamOrdered::single_stream_fast_path`).
    pub(crate) fn granular_single_stream(dev: &Arc<dyn Device>, capacity: u64) -> Result<Self> {
        let mut a = Self::over(dev, source::open(dev, MemKind::Device, capacity)?);
        a.mem = a.mem.single_stream_fast_path();
        Ok(a)
    }

    fn over(dev: &Arc<dyn Device>, src: Box<dyn source::MemorySource>) -> Self {
        Self {
            dev: dev.clone(),
            mem: StreamOrdered::new(dev.clone(), src),
            alloc_ns: AtomicU64::new(0),
            free_ns: AtomicU64::new(0),
            failed_allocs: AtomicU64::new(0),
            peak_committed: AtomicU64::new(0),
        }
    }

    pub(crate) fn device(&self) -> &Arc<dyn Device> {
        &self.dev
    }

    /// `bytes > 0` for work on `stream` (None: for anything, once freed).
    pub(crate) fn alloc(&self, bytes: usize, stream: Option<RawStream>) -> Result<u64> {
        let t0 = Instant::now();
        let grew_before = self.dev.driver_counts().vmm_create_calls;
        let r = if bytes == 0 {
            Err(Error::invalid_argument("an allocation of 0 bytes"))
        } else {
            self.mem.alloc(bytes, stream).map(|(addr, _)| addr)
        };
        if r.is_err() {
            self.failed_allocs.fetch_add(1, Ordering::Relaxed);
        } else if self.dev.driver_counts().vmm_create_calls != grew_before {
            // The device-wide count moved: this arena (or another on the
            // device) grew. Committed memory only falls in trim, so reading
            // it when something grew keeps the peak exact.
            let c = self.mem.source_stats().committed_bytes;
            self.peak_committed.fetch_max(c, Ordering::Relaxed);
        }
        self.alloc_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    /// Free `addr`, ordered after `stream`'s queued work (None: the stream it
    /// was allocated on). `expect_bytes`: the size the caller believes it has.
    pub(crate) fn free(&self, addr: u64, stream: Option<RawStream>, expect_bytes: Option<usize>) -> Result<()> {
        let t0 = Instant::now();
        let r = self.mem.free_on(addr, stream, expect_bytes);
        self.free_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        match r? {
            Some(_) => Ok(()),
            None => bail!(
                InvalidArgument,
                "address {addr:#x} is not a live allocation of this arena (foreign, or freed already)"
            ),
        }
    }

    /// Wait for the work still using freed blocks, then give every unused
    /// chunk back to the driver; bytes given back.
    pub(crate) fn trim(&self) -> Result<usize> {
        self.mem.trim()
    }

    pub(crate) fn stats(&self) -> EpmOrderedArenaStats {
        let a = self.mem.arena_stats();
        let o = self.mem.order_stats();
        EpmOrderedArenaStats {
            size: std::mem::size_of::<EpmOrderedArenaStats>(),
            driver_alloc_calls: a.driver_alloc_calls,
            driver_free_calls: a.driver_free_calls,
            reserved_bytes: a.reserved_bytes,
            committed_bytes: a.committed_bytes,
            peak_committed_bytes: self.peak_committed.load(Ordering::Relaxed).max(a.committed_bytes),
            in_use_bytes: a.in_use_bytes,
            peak_in_use_bytes: a.peak_in_use_bytes,
            live_allocations: a.live_allocations,
            live_bytes: o.live_bytes,
            peak_live_bytes: o.peak_live_bytes,
            alloc_calls: a.alloc_calls,
            free_calls: a.free_calls,
            failed_allocs: self.failed_allocs.load(Ordering::Relaxed),
            stream_allocs: o.stream_allocs,
            same_stream_reuses: o.same_stream_reuses,
            stream_frees: o.deferred_frees,
            pending_ranges: o.pending_blocks,
            pending_bytes: o.pending_bytes,
            peak_held_bytes: o.peak_held_bytes,
            events_recorded: o.events_recorded,
            single_stream_frees: o.single_stream_frees,
            events_created: o.events_created,
            stream_waits: o.waits,
            alloc_ns: self.alloc_ns.load(Ordering::Relaxed),
            free_ns: self.free_ns.load(Ordering::Relaxed),
            fragmentation: a.fragmentation,
        }
    }
}

/// A device arena whose frees are ordered after a stream's work. Keeps its
/// device alive; memory it handed out stays valid until freed or until the
/// arena is destroyed.
pub struct EpmOrderedArena {
    _opaque: [u8; 0],
}
impl_handle!(EpmOrderedArena => OrderedArena, tag = 0x31);

/// Counters of a stream-ordered arena (`epm_ordered_arena_get_stats`) and
/// of PyTorch's allocator on a device (`epm_torch_get_stats`); versioned by
/// `size`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct EpmOrderedArenaStats {
    /// In: `sizeof(EpmOrderedArenaStats)`. Out: bytes filled.
    pub size: usize,
    /// Physical allocations (cuMemCreate) made by the arena: flat once warm.
    pub driver_alloc_calls: u64,
    /// Physical frees (only trim and destroy free).
    pub driver_free_calls: u64,
    /// Virtual address space reserved (the capacity, rounded to chunks).
    pub reserved_bytes: u64,
    /// Physical bytes committed now.
    pub committed_bytes: u64,
    /// Peak of `committed_bytes`.
    pub peak_committed_bytes: u64,
    /// Bytes held by live allocations (unit rounding included).
    pub in_use_bytes: u64,
    pub peak_in_use_bytes: u64,
    pub live_allocations: u64,
    /// Bytes the callers asked for, summed over live allocations.
    pub live_bytes: u64,
    /// Peak of `live_bytes`: the floor no allocator can go below.
    pub peak_live_bytes: u64,
    /// Allocations and frees served by the arena.
    pub alloc_calls: u64,
    pub free_calls: u64,
    /// Allocations refused (out of capacity, a device error, bad input).
    pub failed_allocs: u64,
    /// Allocations made for a stream.
    pub stream_allocs: u64,
    /// Of those, served by memory freed on the same stream whose work may
    /// still be queued.
    pub same_stream_reuses: u64,
    /// Frees ordered after a stream's work.
    pub stream_frees: u64,
    /// Freed ranges (coalesced) waiting for their stream's work now, and their bytes.
    pub pending_ranges: u64,
    pub pending_bytes: u64,
    /// Peak of the bytes not free for everyone: live plus pending.
    pub peak_held_bytes: u64,
    /// Events recorded at stream frees (one driver call each, no allocation).
    pub events_recorded: u64,
    /// Frees made at once while one stream had made every allocation (the
    /// PyTorch allocator's single-stream fast path: no event recorded).
    pub single_stream_frees: u64,
    /// Events created (pooled: a handful per stream, ever).
    pub events_created: u64,
    /// Times an allocation waited for a stream's work instead of growing.
    pub stream_waits: u64,
    /// Nanoseconds spent inside the allocation and free calls.
    pub alloc_ns: u64,
    pub free_ns: u64,
    /// 1 − largest free range / free bytes: 0 when free space is one range.
    pub fragmentation: f64,
}

/// `sizeof(EpmOrderedArenaStats)` in its first published version. Frozen.
pub const EPM_ORDERED_ARENA_STATS_SIZE_V1: usize = 216;
versioned!(EpmOrderedArenaStats, EPM_ORDERED_ARENA_STATS_SIZE_V1);

/// The stream behind an optional `EpmStream*`, checked to be of `dev`.
fn stream_of(dev: &Arc<dyn Device>, stream: *mut EpmStream) -> Result<Option<RawStream>> {
    if stream.is_null() {
        return Ok(None);
    }
    let s = try_handle!(stream);
    same_device(dev, s.device(), "the arena and `stream`")?;
    Ok(Some(s.raw()))
}

/// Create a stream-ordered device arena on `dev`, shaped by `cfg` as
/// `epm_arena_create_device` is (capacity required; chunk 0: 16 granules).
///
/// Ownership: destroy `*out` with `epm_ordered_arena_destroy`. NULL: `dev` is
/// INVALID_HANDLE, `cfg`/`out` NULL_POINTER. Errors: INVALID_ARGUMENT (zero
/// capacity, bad `size`), device errors. `*out` is written only on success.
/// Threading: safe from any thread; the arena itself is thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn epm_ordered_arena_create(
    dev: *mut EpmDevice,
    cfg: *const EpmArenaConfig,
    out: *mut *mut EpmOrderedArena,
) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let cfg = config_of(cfg)?;
        let out = try_out!(out);
        let arena = Arc::new(OrderedArena::new(&dev, cfg)?);
        out.set(handle::insert::<EpmOrderedArena>(arena)?);
        Ok(())
    }
}

/// Allocate `bytes` (256-byte aligned) for work queued on `stream` and
/// write the device address to `*out_addr`. `stream` may be NULL: memory for
/// no stream in particular (freed without a stream, it is everyone's at once).
///
/// Memory freed on `stream` earlier is reused at once, even while the work
/// that used it is still queued; memory freed on another stream only once
/// that stream's work queued before the free has completed. Before growing,
/// an allocation on `stream` may wait for `stream`'s own queued work (never
/// another stream's), which happens only while the arena is still growing.
///
/// NULL: `arena` and a non-NULL bad `stream` are INVALID_HANDLE, `out_addr`
/// NULL_POINTER. Errors: INVALID_ARGUMENT (0 bytes, a stream of another
/// device), OUT_OF_BUDGET (capacity or allocation count exhausted),
/// OUT_OF_DEVICE_MEMORY when growing fails. `*out_addr` is written only on
/// success. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_ordered_arena_alloc(
    arena: *mut EpmOrderedArena,
    bytes: usize,
    stream: *mut EpmStream,
    out_addr: *mut u64,
) -> EpmStatus {
    ffi_boundary! {
        let arena = try_handle!(arena);
        let s = stream_of(arena.device(), stream)?;
        let out = try_out!(out_addr);
        out.set(arena.alloc(bytes, s)?);
        Ok(())
    }
}

/// Free `addr` in stream order: the block is reused by work on `stream` at
/// once, and by anything else once the work queued on `stream` so far has
/// completed. NULL `stream`: the stream the block was allocated on (a block
/// allocated and freed with no stream is everyone's at once: the caller
/// guarantees no queued work uses it). `addr == 0` is a no-op.
///
/// The caller orders every use of the block before this point of `stream`
/// (queued on it, or on a stream `stream` waits for). Does not block.
///
/// NULL: `arena` and a non-NULL bad `stream` are INVALID_HANDLE. Errors:
/// INVALID_ARGUMENT for an address this arena did not hand out or already
/// freed, or a stream of another device (nothing is freed then). Threading:
/// safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_ordered_arena_free(arena: *mut EpmOrderedArena, addr: u64, stream: *mut EpmStream) -> EpmStatus {
    ffi_boundary! {
        let arena = try_handle!(arena);
        let s = stream_of(arena.device(), stream)?;
        if addr == 0 {
            return Ok(());
        }
        arena.free(addr, s, None)
    }
}

/// Wait for the work still using freed blocks (their streams' events), then
/// give every chunk no live allocation touches back to the driver; writes the
/// bytes given back to `*out_bytes` (which may be NULL).
///
/// Blocks the calling thread until those streams' queued work completes.
/// NULL: `arena` is INVALID_HANDLE. Errors: device errors. Threading: safe
/// from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_ordered_arena_trim(arena: *mut EpmOrderedArena, out_bytes: *mut u64) -> EpmStatus {
    ffi_boundary! {
        let arena = try_handle!(arena);
        let given = arena.trim()? as u64;
        if !out_bytes.is_null() {
            try_out!(out_bytes).set(given);
        }
        Ok(())
    }
}

/// Fill `*out` with the arena's counters. The caller sets
/// `out->size = sizeof(EpmOrderedArenaStats)` first; epmem fills at most that
/// many bytes and writes back how many.
///
/// NULL: `arena` is INVALID_HANDLE, `out` NULL_POINTER. Errors:
/// INVALID_ARGUMENT for a too-small `size`. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_ordered_arena_get_stats(
    arena: *mut EpmOrderedArena,
    out: *mut EpmOrderedArenaStats,
) -> EpmStatus {
    ffi_boundary! {
        let arena = try_handle!(arena);
        let out = try_out!(out);
        write_versioned(out, arena.stats(), "out")
    }
}

/// Destroy an ordered arena: waits for the work still using freed blocks,
/// then gives all its memory back; every address it handed out becomes
/// invalid.
///
/// NULL is a no-op. Errors: INVALID_HANDLE for a destroyed or wrong-typed
/// handle. Threading: the handle must not be used after this call.
#[unsafe(no_mangle)]
pub extern "C" fn epm_ordered_arena_destroy(arena: *mut EpmOrderedArena) -> EpmStatus {
    ffi_boundary! { handle::destroy(arena) }
}
