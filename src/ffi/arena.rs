//! `EpmArena`: the device arena (VMM, grown in granule chunks) and the
//! pinned-host arena, with O(log n) best-fit sub-allocation and no driver
//! call per allocation or free once warm.
//!
//! Also the helpers for versioned structs both this file and
//! `residency.rs` use: a caller's struct is read or written up to the `size`
//! it declares, never past it.

use crate::arena::{Arena, ArenaConfig, ArenaStats, DeviceArena, PinnedArena};
pub use crate::ffi::arena_stats::EpmArenaStats;
use crate::ffi::arena_stats::stats_to_c;
use crate::ffi::device::EpmDevice;
use crate::ffi::prelude::*;

/// A device arena or a pinned-host arena. Keeps its device alive; memory it
/// handed out stays valid until freed or until the arena is destroyed.
pub struct EpmArena {
    _opaque: [u8; 0],
}
impl_handle!(EpmArena => dyn Arena, tag = 0x30);

/// How an arena is shaped; versioned by `size`. Fill with
/// `epm_arena_config_default`, then change what you need.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EpmArenaConfig {
    /// `sizeof(EpmArenaConfig)` as the caller compiled it.
    pub size: usize,
    /// The arena's bound, exactly. A device arena reserves `capacity_bytes`
    /// rounded up to the device's granularity (`EpmDeviceInfo.granularity`:
    /// physical memory comes in whole granules) of virtual address space up
    /// front (cheap); it never commits more than that, and its live
    /// allocations (each rounded up to 256 bytes) never add up to more. A
    /// pinned arena never commits more than `capacity_bytes`. An allocation
    /// that would go past the bound is EPM_STATUS_OUT_OF_BUDGET. Required
    /// (no default); at most 2^40 - 256 bytes (1 TiB less 256 bytes).
    pub capacity_bytes: u64,
    /// Growth step: physical memory is committed (and kept) in chunks of this
    /// many bytes, rounded up to the device's granularity; a device arena's
    /// last chunk ends at its bound. 0: 16 granules (32 MiB on the H200).
    pub chunk_bytes: u64,
    /// Most live allocations (the sub-allocator's node table). 0: 65536.
    pub max_allocations: u32,
}

impl From<ArenaStats> for EpmArenaStats {
    fn from(s: ArenaStats) -> Self {
        stats_to_c(&s)
    }
}

/// `sizeof(EpmArenaConfig)` in its first published version (epmem 0.1):
/// the smallest `size` ever accepted. Frozen; see docs/ABI.md.
pub const EPM_ARENA_CONFIG_SIZE_V1: usize = 32;
/// `sizeof(EpmArenaStats)` in its first published version. Frozen.
pub const EPM_ARENA_STATS_SIZE_V1: usize = 88;
versioned!(input EpmArenaConfig, EPM_ARENA_CONFIG_SIZE_V1);
versioned!(EpmArenaStats, EPM_ARENA_STATS_SIZE_V1);

/// `max_allocations` when the config says 0 (stated in the header;
/// tests/header.rs checks that it is).
/// cbindgen:ignore
pub const DEFAULT_MAX_ALLOCATIONS: u32 = 64 * 1024;

fn default_config() -> EpmArenaConfig {
    EpmArenaConfig {
        size: std::mem::size_of::<EpmArenaConfig>(),
        capacity_bytes: 0,
        chunk_bytes: 0,
        max_allocations: 0,
    }
}

pub(crate) fn config_of(cfg: *const EpmArenaConfig) -> Result<ArenaConfig> {
    let c = read_versioned(cfg, default_config(), "cfg")?;
    ensure!(c.capacity_bytes > 0, InvalidArgument, "cfg->capacity_bytes is 0");
    let max = crate::arena::MAX_CAPACITY;
    let capacity = usize::try_from(c.capacity_bytes).ok().filter(|&n| n <= max).ok_or_else(|| {
        Error::invalid_argument(format!("cfg->capacity_bytes {} exceeds the limit of {max} bytes", c.capacity_bytes))
    })?;
    let chunk = usize::try_from(c.chunk_bytes).ok().filter(|&n| n <= max).ok_or_else(|| {
        Error::invalid_argument(format!("cfg->chunk_bytes {} exceeds the limit of {max} bytes", c.chunk_bytes))
    })?;
    let max_allocs = if c.max_allocations == 0 { DEFAULT_MAX_ALLOCATIONS } else { c.max_allocations };
    Ok(ArenaConfig { capacity, chunk_bytes: chunk, max_allocs })
}

/// Fill `*out` with the defaults (capacity 0: the caller must set it).
///
/// The caller sets `out->size = sizeof(EpmArenaConfig)` first. NULL: `out` is
/// NULL_POINTER. Errors: INVALID_ARGUMENT for a too-small `size`. Threading:
/// safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_arena_config_default(out: *mut EpmArenaConfig) -> EpmStatus {
    ffi_boundary! {
        let out = try_out!(out);
        write_versioned(out, default_config(), "out")
    }
}

/// Create a device arena on `dev`: reserves `cfg->capacity_bytes` (rounded
/// up to the device's granularity) of virtual address space; physical memory
/// is committed chunk by chunk on first use and kept, never past that bound.
/// Addresses it returns are `EpmDevicePtr`s, 256-byte aligned by default.
///
/// Ownership: destroy `*out` with `epm_arena_destroy`. NULL: `dev` is
/// INVALID_HANDLE, `cfg`/`out` NULL_POINTER. Errors: INVALID_ARGUMENT (zero
/// or too large a capacity or chunk, bad `size`), device errors. Threading:
/// safe from any thread; the arena itself is thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn epm_arena_create_device(
    dev: *mut EpmDevice,
    cfg: *const EpmArenaConfig,
    out: *mut *mut EpmArena,
) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let cfg = config_of(cfg)?;
        let out = try_out!(out);
        let arena: Arc<dyn Arena> = Arc::new(DeviceArena::new(&dev, cfg)?);
        out.set(handle::insert::<EpmArena>(arena)?);
        Ok(())
    }
}

/// Create a pinned-host arena on `dev`: page-locked host memory in segments
/// of `cfg->chunk_bytes` (a larger request gets a segment of its own), up to
/// `cfg->capacity_bytes` in all (a segment is cut short at that bound).
/// Addresses it returns are host addresses (cast with `(void *)(uintptr_t)addr`).
///
/// Ownership, NULL, errors, threading: as `epm_arena_create_device`.
#[unsafe(no_mangle)]
pub extern "C" fn epm_arena_create_pinned(
    dev: *mut EpmDevice,
    cfg: *const EpmArenaConfig,
    out: *mut *mut EpmArena,
) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let cfg = config_of(cfg)?;
        let out = try_out!(out);
        let arena: Arc<dyn Arena> = Arc::new(PinnedArena::new(&dev, cfg)?);
        out.set(handle::insert::<EpmArena>(arena)?);
        Ok(())
    }
}

/// Allocate `bytes` aligned to `align` (0: 256; a power of two up to the
/// chunk size) and write the address to `*out_addr`.
///
/// NULL: `arena` is INVALID_HANDLE, `out_addr` NULL_POINTER. Errors:
/// INVALID_ARGUMENT (0 bytes, bad alignment), OUT_OF_BUDGET (the capacity or
/// the allocation count is exhausted), OUT_OF_DEVICE_MEMORY /
/// OUT_OF_HOST_MEMORY when growing fails. `*out_addr` is written only on
/// success. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_arena_alloc(arena: *mut EpmArena, bytes: usize, align: usize, out_addr: *mut u64) -> EpmStatus {
    ffi_boundary! {
        let arena = try_handle!(arena);
        let out = try_out!(out_addr);
        out.set(arena.alloc(bytes, align)?);
        Ok(())
    }
}

/// Free an address from `epm_arena_alloc` on this arena. `addr == 0` is a
/// no-op. The caller guarantees no queued work still uses it (record an
/// event after the last use and wait on it, or synchronize).
///
/// Errors: INVALID_ARGUMENT for an address this arena did not hand out or
/// already freed. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_arena_free(arena: *mut EpmArena, addr: u64) -> EpmStatus {
    ffi_boundary! {
        let arena = try_handle!(arena);
        if addr == 0 {
            return Ok(());
        }
        arena.free(addr)
    }
}

/// Give back every chunk (segment) that no live allocation touches; writes
/// the bytes given back to `*out_bytes` (which may be NULL). Nothing is ever
/// given back implicitly.
///
/// Errors: device errors. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_arena_trim(arena: *mut EpmArena, out_bytes: *mut u64) -> EpmStatus {
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
/// `out->size = sizeof(EpmArenaStats)` first; epmem fills at most that many
/// bytes and writes back how many.
///
/// NULL: `arena` is INVALID_HANDLE, `out` NULL_POINTER. Errors:
/// INVALID_ARGUMENT for a too-small `size`. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_arena_get_stats(arena: *mut EpmArena, out: *mut EpmArenaStats) -> EpmStatus {
    ffi_boundary! {
        let arena = try_handle!(arena);
        let out = try_out!(out);
        write_versioned(out, EpmArenaStats::from(arena.stats()), "out")
    }
}

/// Destroy an arena handle. Its memory is given back once no other holder
/// (e.g. an ONNX Runtime allocator) uses the arena; every address it handed
/// out becomes invalid then.
///
/// NULL is a no-op. Errors: INVALID_HANDLE for a destroyed or wrong-typed
/// handle. Threading: the handle must not be used after this call.
#[unsafe(no_mangle)]
pub extern "C" fn epm_arena_destroy(arena: *mut EpmArena) -> EpmStatus {
    ffi_boundary! { handle::destroy(arena) }
}
