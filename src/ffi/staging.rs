//! The staging pool and the copy engine, from C.
//!
//! What C gets, and what it does not: a pool (bounded pinned buffers), an
//! engine that pages host ranges in through it, and a fence per copy. C does
//! not get raw acquire/release of pooled buffers — the pool's safety rests on
//! the `CopyCompleted` witness, which only Rust's type system can carry; from
//! C, every staging buffer stays inside the engine, and the fence is the C
//! face of that proof.

use crate::device::HostRange;
use crate::ffi::device::EpmDevice;
use crate::ffi::memory::EpmDevicePtr;
use crate::ffi::mirror::config_in;
use crate::ffi::prelude::*;
pub use crate::ffi::staging_stats::EpmStagingStats;
use crate::ffi::staging_stats::stats_to_c;
use crate::ffi::stream::{EpmStream, same_device};
use crate::staging::{CopyEngine, EngineConfig, Fence, HostRegistration, PinnedStagingPool, PoolConfig, StagingStats};

/// A bounded pool of pinned staging buffers. Engines made from it share it;
/// it lives until the last of them and its own handle are destroyed.
pub struct EpmStagingPool {
    _opaque: [u8; 0],
}
impl_handle!(EpmStagingPool => PinnedStagingPool, tag = 0x10);

/// A host → device copy engine: its own copy stream, staging slots from a
/// pool, and fill threads.
pub struct EpmCopyEngine {
    _opaque: [u8; 0],
}
impl_handle!(EpmCopyEngine => CopyEngine, tag = 0x11);

/// The completion of one `epm_copy_engine_htod`: an event on the engine's
/// copy stream, recorded after the copy's last byte.
pub struct EpmFence {
    _opaque: [u8; 0],
}
impl_handle!(EpmFence => Fence, tag = 0x12);

/// A host range registered read-only with the device (copies from it skip
/// staging). Unregistered when destroyed.
pub struct EpmHostRegistration {
    _opaque: [u8; 0],
}
impl_handle!(EpmHostRegistration => HostRegistration, tag = 0x13);

/// `EpmCopyEngineConfig::flags`: do not record timing events (`htod_ms`
/// stays 0).
pub const EPM_COPY_ENGINE_NO_TIMING: u32 = 1;
/// `EpmCopyEngineConfig::flags`: stage every copy, even from page-locked memory.
pub const EPM_COPY_ENGINE_NO_DIRECT: u32 = 2;
/// `EpmCopyEngineConfig::flags`: cut every chunk full size to the end of a
/// copy instead of halving the last ones down to 1 MiB (for copies issued
/// back to back, whose next fill overlaps the last DMA anyway).
pub const EPM_COPY_ENGINE_NO_SPLIT_TAIL: u32 = 4;
/// `EpmCopyEngineConfig::flags`: fill with plain stores only (by default
/// copies shorter than 64 MiB are filled with streaming stores, which bypass
/// the cache; measured faster for copies issued one at a time).
pub const EPM_COPY_ENGINE_NO_STREAMING_STORES: u32 = 8;

/// How a copy engine stages. Fill it with `epm_copy_engine_config_default`,
/// then change what you need.
///
/// Versioned by size: set `size = sizeof(EpmCopyEngineConfig)` first. Fields
/// are only ever added at the end.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EpmCopyEngineConfig {
    /// `sizeof(EpmCopyEngineConfig)` as the caller compiled it.
    pub size: usize,
    /// Staging slots in flight at once, 2–4 (default 3).
    pub slots: u32,
    /// Threads that fill a slot, counting the calling thread, 1–64 (default 12,
    /// or the number of CPUs if fewer).
    pub fill_threads: u32,
    /// Capacity of one slot and the largest chunk, at least 1 MiB (default 16 MiB).
    pub chunk_bytes: u64,
    /// `EPM_COPY_ENGINE_*` bits (default 0).
    pub flags: u32,
    /// Cut a copy into about this many chunks (within 1 MiB and
    /// `chunk_bytes`), 1–256 (default 4): more chunks overlap more of the
    /// fill with the DMA, fewer cost fewer per-chunk driver calls.
    pub target_chunks: u32,
}

/// `sizeof(EpmCopyEngineConfig)` in its first published version (epmem
/// 0.1): the smallest `size` ever accepted. Frozen; see docs/ABI.md.
pub const EPM_COPY_ENGINE_CONFIG_SIZE_V1: usize = 32;
/// `sizeof(EpmStagingStats)` in its first published version. Frozen.
pub const EPM_STAGING_STATS_SIZE_V1: usize = 112;
versioned!(input EpmCopyEngineConfig, EPM_COPY_ENGINE_CONFIG_SIZE_V1);
versioned!(EpmStagingStats, EPM_STAGING_STATS_SIZE_V1);

fn write_stats(out: OutParam<'_, EpmStagingStats>, s: StagingStats) -> Result<()> {
    write_versioned(out, stats_to_c(&s), "EpmStagingStats")
}

config_in! {
    fn default_config() -> EpmCopyEngineConfig;
    fn apply_config(c: &EpmCopyEngineConfig, r: &mut EngineConfig);
    defaults from EngineConfig::default();
    // Bits, each turning a default-on behaviour off: engine_config_of.
    manual { flags: 0 }
    copy { slots: slots, fill_threads: fill_threads, chunk_bytes: chunk_bytes, target_chunks: target_chunks }
    zero_default {}
    flag {}
    enums {}
}

fn engine_config_of(c: &EpmCopyEngineConfig) -> Result<EngineConfig> {
    let known = EPM_COPY_ENGINE_NO_TIMING
        | EPM_COPY_ENGINE_NO_DIRECT
        | EPM_COPY_ENGINE_NO_SPLIT_TAIL
        | EPM_COPY_ENGINE_NO_STREAMING_STORES;
    ensure!(c.flags & !known == 0, InvalidArgument, "unknown copy engine flags {:#x}", c.flags);
    let base = EngineConfig::default();
    let mut cfg = EngineConfig {
        timing: c.flags & EPM_COPY_ENGINE_NO_TIMING == 0,
        direct: c.flags & EPM_COPY_ENGINE_NO_DIRECT == 0,
        split_tail: c.flags & EPM_COPY_ENGINE_NO_SPLIT_TAIL == 0,
        stream_below: if c.flags & EPM_COPY_ENGINE_NO_STREAMING_STORES != 0 { 0 } else { base.stream_below },
        ..base
    };
    apply_config(c, &mut cfg)?;
    Ok(cfg)
}

/// Create a staging pool on `dev` that retains at most `max_buffers` buffers
/// and `max_bytes` bytes between uses (0 means the default: 8 buffers,
/// 512 MiB). A buffer whose return would breach a bound is freed.
///
/// Ownership: `*out` is a new handle; destroy it with
/// `epm_staging_pool_destroy` (engines made from it keep it alive). NULL: `dev`
/// is INVALID_HANDLE, `out` NULL_POINTER. Errors: none beyond those.
/// Threading: the pool is safe to share between threads.
#[unsafe(no_mangle)]
pub extern "C" fn epm_staging_pool_create(
    dev: *mut EpmDevice,
    max_buffers: usize,
    max_bytes: usize,
    out: *mut *mut EpmStagingPool,
) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let out = try_out!(out);
        let d = PoolConfig::default();
        let cfg = PoolConfig {
            max_buffers: if max_buffers == 0 { d.max_buffers } else { max_buffers },
            max_bytes: if max_bytes == 0 { d.max_bytes } else { max_bytes },
        };
        let pool = PinnedStagingPool::new(&dev, cfg)?;
        out.set(handle::insert::<EpmStagingPool>(Arc::new(pool))?);
        Ok(())
    }
}

/// Free every buffer the pool retains; `*out_freed` (may be NULL) receives
/// how many. Buffers on loan to engines are unaffected.
///
/// NULL: `pool` is INVALID_HANDLE. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_staging_pool_trim(pool: *mut EpmStagingPool, out_freed: *mut usize) -> EpmStatus {
    ffi_boundary! {
        let pool = try_handle!(pool);
        let n = pool.trim();
        if !out_freed.is_null() {
            try_out!(out_freed).set(n);
        }
        Ok(())
    }
}

/// Fill `*out` with the pool's counters (the engine fields are 0).
///
/// Set `out->size = sizeof(EpmStagingStats)` first. NULL: `pool` is
/// INVALID_HANDLE, `out` NULL_POINTER. Errors: INVALID_ARGUMENT if `out->size`
/// is smaller than the first version of the struct. Threading: safe from any
/// thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_staging_pool_get_stats(pool: *mut EpmStagingPool, out: *mut EpmStagingStats) -> EpmStatus {
    ffi_boundary! {
        let pool = try_handle!(pool);
        let p = pool.stats();
        let s = StagingStats {
            pinned_alloc_calls: p.pinned_alloc_calls,
            pinned_free_calls: p.pinned_free_calls,
            pinned_reuses: p.pinned_reuses,
            retained_bytes: p.retained_bytes,
            retained_buffers: p.retained_buffers,
            ..StagingStats::default()
        };
        write_stats(try_out!(out), s)
    }
}

/// Destroy a pool handle. Retained buffers are freed once no engine uses the
/// pool any more.
///
/// NULL is a no-op returning OK. Errors: INVALID_HANDLE for a destroyed,
/// wrong-typed or garbage handle. Threading: the handle must not be used after.
#[unsafe(no_mangle)]
pub extern "C" fn epm_staging_pool_destroy(pool: *mut EpmStagingPool) -> EpmStatus {
    ffi_boundary! { handle::destroy(pool) }
}

/// Fill `*out` with the default engine configuration.
///
/// Set `out->size = sizeof(EpmCopyEngineConfig)` first. NULL: `out` is
/// NULL_POINTER. Errors: INVALID_ARGUMENT for a too-small `out->size`.
/// Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_copy_engine_config_default(out: *mut EpmCopyEngineConfig) -> EpmStatus {
    ffi_boundary! {
        let out = try_out!(out);
        write_versioned(out, default_config(), "EpmCopyEngineConfig")
    }
}

/// Create a copy engine staging through `pool`. `config` NULL means the
/// defaults.
///
/// Ownership: `*out` is a new handle; destroy it with
/// `epm_copy_engine_destroy`. `config` is only read during the call. NULL:
/// `pool` is INVALID_HANDLE, `out` NULL_POINTER. Errors: INVALID_CONFIG for
/// values out of range, or when the pool's bounds cannot retain every slot
/// (steady-state copies would allocate); INVALID_ARGUMENT for unknown flags or
/// a too-small `config->size`; device errors. Threading: the engine is safe to
/// share; concurrent copies on one engine are serialized.
// The config is an input struct read through a raw pointer; its validity is
// the C caller's documented contract, as for every pointer argument here.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
#[unsafe(no_mangle)]
pub extern "C" fn epm_copy_engine_create(
    pool: *mut EpmStagingPool,
    config: *const EpmCopyEngineConfig,
    out: *mut *mut EpmCopyEngine,
) -> EpmStatus {
    ffi_boundary! {
        let pool = try_handle!(pool);
        let out = try_out!(out);
        let c = if config.is_null() {
            default_config()
        } else {
            read_versioned(config, default_config(), "EpmCopyEngineConfig")?
        };
        let cfg = engine_config_of(&c)?;
        let engine = CopyEngine::new(&pool, cfg)?;
        out.set(handle::insert::<EpmCopyEngine>(Arc::new(engine))?);
        Ok(())
    }
}

/// Copy `len` bytes from host `src` to device `dst` through the engine, and
/// return at once with a fence; the copy completes asynchronously.
///
/// From pageable memory the copy is staged: `src` is read (by the calling
/// thread and the engine's fill threads) before this returns, while earlier
/// chunks are already in DMA. From page-locked memory (pinned, or registered
/// with `epm_copy_engine_register` or by the host itself) it is copied
/// directly and read asynchronously. Either way, keep `src` valid and
/// unmodified until the fence completes.
///
/// `stream` (may be NULL): the copy is ordered after the work already queued
/// on it, and work queued on it afterwards waits for the copy — like an async
/// memcpy on `stream`, with no host wait. Without it, use
/// `epm_fence_stream_wait`.
///
/// Ownership: `*out` (may be NULL if no fence is wanted) is a new handle;
/// destroy it with `epm_fence_destroy`. NULL: `engine` is INVALID_HANDLE,
/// `src` NULL_POINTER. Errors: INVALID_ARGUMENT for `len` 0, an overflowing
/// range, or a stream of another device; device errors for a bad `dst` (the
/// engine stays usable). Threading: safe from any thread; copies on one
/// engine are serialized. A copy larger than the engine's free slots waits
/// for slots (back-pressure).
#[unsafe(no_mangle)]
pub extern "C" fn epm_copy_engine_htod(
    engine: *mut EpmCopyEngine,
    dst: EpmDevicePtr,
    src: *const c_void,
    len: usize,
    stream: *mut EpmStream,
    out: *mut *mut EpmFence,
) -> EpmStatus {
    ffi_boundary! {
        let engine = try_handle!(engine);
        let (p, n) = try_host_range!(src, len);
        crate::ffi::args::device_range(dst, n, "dst")?;
        let stream = if stream.is_null() { None } else { Some(try_handle!(stream)) };
        if let Some(s) = &stream {
            same_device(engine.device(), s.device(), "engine and stream")?;
        }
        // SAFETY: `src` is non-NULL and non-overflowing (checked above); the
        // caller promises `n` readable bytes that stay valid and unmodified
        // until the fence completes, which is HostRange's contract.
        let range = unsafe { HostRange::new(p, n) };
        let fence = engine.htod(dst, range, stream.as_ref().map(|s| s.raw()))?;
        if !out.is_null() {
            try_out!(out).set(handle::insert::<EpmFence>(Arc::new(fence))?);
        }
        Ok(())
    }
}

/// Page-lock `[ptr, ptr+len)` read-only with the device, so later copies from
/// it take the direct path (no staging, ~55 GB/s on the H200 against ~35 from
/// pageable memory; registering costs ~40 ms per GiB, once).
///
/// Ownership: `*out` is a new handle; `epm_host_registration_destroy`
/// unregisters (it first waits for the whole device, so no copy still reads
/// the range). The range must stay valid until then. NULL: `engine` is
/// INVALID_HANDLE, `ptr`/`out` NULL_POINTER. Errors: INVALID_ARGUMENT for `len`
/// 0; INVALID_STATE or a device error if the range overlaps page-locked
/// memory or the locked-memory limit refuses it (copies then keep staging).
/// Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_copy_engine_register(
    engine: *mut EpmCopyEngine,
    ptr: *const c_void,
    len: usize,
    out: *mut *mut EpmHostRegistration,
) -> EpmStatus {
    ffi_boundary! {
        let engine = try_handle!(engine);
        let (p, n) = try_host_range!(ptr, len);
        let out = try_out!(out);
        // SAFETY: non-NULL, non-overflowing; the caller promises the range
        // stays readable until the registration is destroyed.
        let range = unsafe { HostRange::new(p, n) };
        out.set(handle::insert::<EpmHostRegistration>(Arc::new(engine.register(range)?))?);
        Ok(())
    }
}

/// Unregister a host range (after waiting for the device to go idle).
///
/// NULL is a no-op returning OK. Errors: INVALID_HANDLE for a destroyed,
/// wrong-typed or garbage handle. Threading: the handle must not be used after.
#[unsafe(no_mangle)]
pub extern "C" fn epm_host_registration_destroy(reg: *mut EpmHostRegistration) -> EpmStatus {
    ffi_boundary! { handle::destroy(reg) }
}

/// Block until every copy issued on the engine so far has completed, and
/// return all staging buffers to the pool.
///
/// NULL: `engine` is INVALID_HANDLE. Errors: device errors of a failed copy.
/// Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_copy_engine_synchronize(engine: *mut EpmCopyEngine) -> EpmStatus {
    ffi_boundary! {
        let engine = try_handle!(engine);
        engine.synchronize()
    }
}

/// Fill `*out` with the engine's and its pool's counters. Never blocks on
/// the device (timings of copies still running are not counted yet).
///
/// Set `out->size = sizeof(EpmStagingStats)` first. NULL: `engine` is
/// INVALID_HANDLE, `out` NULL_POINTER. Errors: INVALID_ARGUMENT for a
/// too-small `out->size`. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_copy_engine_get_stats(engine: *mut EpmCopyEngine, out: *mut EpmStagingStats) -> EpmStatus {
    ffi_boundary! {
        let engine = try_handle!(engine);
        let out = try_out!(out);
        write_stats(out, engine.stats())
    }
}

/// Destroy an engine handle. Copies still in flight complete first (the
/// call waits for them) and their buffers return to the pool.
///
/// NULL is a no-op returning OK. Errors: INVALID_HANDLE for a destroyed,
/// wrong-typed or garbage handle. Threading: the handle must not be used after.
#[unsafe(no_mangle)]
pub extern "C" fn epm_copy_engine_destroy(engine: *mut EpmCopyEngine) -> EpmStatus {
    ffi_boundary! { handle::destroy(engine) }
}

/// Has the copy completed? Never blocks.
///
/// Returns OK when it has, NOT_READY when not (not a failure). NULL: `fence`
/// is INVALID_HANDLE. Errors: device errors. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_fence_query(fence: *mut EpmFence) -> EpmStatus {
    ffi_boundary! {
        let fence = try_handle!(fence);
        ensure!(fence.query()?, NotReady, "the copy has not completed yet");
        Ok(())
    }
}

/// Block the calling thread until the copy completes. Prefer
/// `epm_fence_stream_wait`, which orders a stream without blocking.
///
/// NULL: `fence` is INVALID_HANDLE. Errors: device errors. Threading: safe
/// from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_fence_wait(fence: *mut EpmFence) -> EpmStatus {
    ffi_boundary! {
        let fence = try_handle!(fence);
        fence.wait()
    }
}

/// Make work queued on `stream` after this call wait for the copy. The
/// calling thread does not wait.
///
/// NULL: either handle is INVALID_HANDLE. Errors: INVALID_ARGUMENT if they
/// belong to different devices. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_fence_stream_wait(fence: *mut EpmFence, stream: *mut EpmStream) -> EpmStatus {
    ffi_boundary! {
        let fence = try_handle!(fence);
        let stream = try_handle!(stream);
        same_device(fence.device(), stream.device(), "fence and stream")?;
        fence.make_wait(stream.raw())
    }
}

/// Destroy a fence handle. The copy is unaffected (it still completes, and
/// streams already waiting on it still wait).
///
/// NULL is a no-op returning OK. Errors: INVALID_HANDLE for a destroyed,
/// wrong-typed or garbage handle. Threading: the handle must not be used after.
#[unsafe(no_mangle)]
pub extern "C" fn epm_fence_destroy(fence: *mut EpmFence) -> EpmStatus {
    ffi_boundary! { handle::destroy(fence) }
}
