//! `EpmResidency`: weights that live in host memory, paged into a VRAM
//! budget around each use.
//!
//! The loop a native inference stack runs around each layer:
//! ```c
//! epm_residency_acquire(res, w, stream, &dptr);   // stream waits for the page-in
//! launch_my_kernel(stream, dptr, ...);
//! epm_residency_release(res, w, stream);          // records the read fence
//! ```

use crate::device::HostRange;
use crate::ffi::device::EpmDevice;
use crate::ffi::memory::EpmDevicePtr;
use crate::ffi::mirror::config_in;
use crate::ffi::prelude::*;
pub use crate::ffi::residency_stats::EpmResidencyStats;
use crate::ffi::residency_stats::stats_to_c;
use crate::ffi::stream::{EpmStream, same_device};
use crate::residency::{HostRangeId, PolicyKind, RegisterSources, ResidencyConfig, ResidencyManager, WeightId};

/// A residency manager: a VRAM budget, its device arena, a staging pool and
/// copy engine, and the registered weights. Keeps its device alive.
pub struct EpmResidency {
    _opaque: [u8; 0],
}
impl_handle!(EpmResidency => ResidencyManager, tag = 0x20);

/// A registered weight, unique within its `EpmResidency` and never reused.
pub type EpmWeightId = u32;
/// A host range registered with `epm_residency_register_host_range`.
pub type EpmHostRangeId = u32;

/// `EpmResidencyConfig::policy`: farthest next use under the declared cycle
/// (Belady's choice for a decode step); weights outside the cycle go first,
/// least recently used first. The default.
pub const EPM_POLICY_CYCLIC: u32 = 0;

/// `EpmResidencyConfig::policy`: least recently used (hits ~0% on a cyclic
/// scan larger than the budget; kept for comparison).
pub const EPM_POLICY_LRU: u32 = 1;

/// `EpmResidencyConfig::fill_ahead_chunks`: fill as many chunks ahead as
/// there are staging slots (the default), whatever `staging_slots` is.
pub const EPM_FILL_AHEAD_ALL_SLOTS: u32 = u32::MAX;
const _: () = assert!(EPM_FILL_AHEAD_ALL_SLOTS as usize == crate::residency::FILL_AHEAD_ALL_SLOTS);

/// `EpmResidencyConfig::register_sources`: register a pageable weight's
/// source with the device on its first page-in while the registered bytes
/// stay within RLIMIT_MEMLOCK, so later page-ins copy it directly at the
/// pinned peak; stage it otherwise. The default.
pub const EPM_REGISTER_WITHIN_MEMLOCK: u32 = 0;
/// `EpmResidencyConfig::register_sources`: never register; stage every
/// pageable source through pinned buffers.
pub const EPM_REGISTER_NEVER: u32 = 1;
/// `EpmResidencyConfig::register_sources`: register on first page-in
/// whatever RLIMIT_MEMLOCK says (a refusal by the device still stages).
pub const EPM_REGISTER_ALWAYS: u32 = 2;

/// How a residency manager is set up; versioned by `size`. Fill with
/// `epm_residency_config_default`, then set `budget_bytes`.
///
/// A residency manager's copy engine differs from a bare one's defaults
/// (`EpmCopyEngineConfig`) where its filler issues copies back to back: full
/// chunks to each copy's end (`EPM_COPY_ENGINE_NO_SPLIT_TAIL`'s cut), and
/// streaming stores only for copies below 12 MiB (a bare engine: 64 MiB).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EpmResidencyConfig {
    /// `sizeof(EpmResidencyConfig)` as the caller compiled it.
    pub size: usize,
    /// Most bytes of weights resident at once. Required (default 0).
    ///
    /// The device memory the manager holds can exceed it: resident weights
    /// live in a device arena that reserves `budget_bytes + budget_bytes / 8`
    /// plus two VMM granules of address space (slack for rounding and the
    /// holes uneven sizes leave), rounded up to whole chunks of 16 granules,
    /// and commits physical memory a chunk at a time only inside it. So the
    /// manager never holds more device memory than that reservation
    /// (`arena_reserved_bytes` in `EpmResidencyStats`): with 2 MiB granules
    /// (the H200, the host device) less than 1.125 × budget + 36 MiB, and a
    /// whole 32 MiB chunk even for a small budget. Staging buffers are pinned
    /// host memory (`staging_pool_bytes`), not device memory.
    /// tests/residency_budget.rs checks the bound.
    pub budget_bytes: u64,
    /// `EPM_POLICY_CYCLIC` (default) or `EPM_POLICY_LRU`.
    pub policy: u32,
    /// `EPM_REGISTER_WITHIN_MEMLOCK` (default), `EPM_REGISTER_NEVER` or `EPM_REGISTER_ALWAYS`.
    pub register_sources: u32,
    /// Most weights paged in ahead of use along the declared cycle (default 1).
    /// Each costs about one weight of budget in hits and lets one more
    /// page-in overlap compute.
    pub prefetch_depth: u32,
    /// Nonzero: the host waits for every page-in (the first, synchronous
    /// design; for comparison). Default 0.
    pub sync_page_in: u32,
    /// Staging slots in flight (2..=4; 0: 4, one more than a copy engine's
    /// default: faster from staged sources on the H200).
    pub staging_slots: u32,
    /// Threads filling staging buffers, counting the caller's (0: the copy
    /// engine's default, 12, or the number of CPUs if fewer).
    pub fill_threads: u32,
    /// Largest staging chunk in bytes (0: 16 MiB; at least 1 MiB).
    pub staging_chunk_bytes: u64,
    /// Most bytes the staging pool retains (0: 512 MiB).
    pub staging_pool_bytes: u64,
    /// Weights smaller than this, adjacent both in host memory and in the
    /// declared cycle, are coalesced into one page-in (copies of a few
    /// hundred KiB never reach the PCIe peak). Default 1 MiB; 0 disables.
    pub coalesce_below_bytes: u64,
    /// Largest coalesced unit (default 8 MiB; never above budget / 8).
    pub coalesce_max_bytes: u64,
    /// Nonzero: prefetches from staged (pageable, unregistered) sources are
    /// filled on the thread that calls `epm_residency_release`, as before
    /// this field existed. Zero: a background thread of the manager fills and
    /// enqueues them, so the calling thread (the one launching kernels) does
    /// not spend the fill, and an acquire waits only while that fill is
    /// behind (`background_waits`, `background_wait_ms`). Demand
    /// page-ins are always issued by the caller. Added after the v1 freeze:
    /// a caller passing the v1 size gets the default. Default 0.
    pub caller_fills: u32,
    /// Deprecated: only 1 (the default) is accepted; 0 is refused with
    /// EPM_STATUS_UNSUPPORTED. An acquire whose weight's background fill is
    /// not enqueued yet always waits for it on the host
    /// (`background_waits`): 0 (the acquiring stream waiting on the device
    /// for a fill not yet issued) deadlocks on CUDA, because driver calls
    /// the filler needs block while such a wait is pending
    /// (docs/RESIDENCY.md, "Why the host waits"). Kept for the struct's
    /// layout. Default 1 (the only value accepted).
    pub fill_waits_on_host: u32,
    /// With the background thread (`caller_fills` 0): between two staged
    /// prefetches, fill up to this many staging chunks of the next staged
    /// weight along the declared cycle while that thread would otherwise
    /// wait for the next `epm_residency_release` to queue it; the prefetch
    /// then starts with them filled (`fill_ahead_bytes`,
    /// `fill_ahead_used_bytes`). 0 turns it off; `EPM_FILL_AHEAD_ALL_SLOTS`
    /// fills as many chunks as there are staging slots; any other value at
    /// most `staging_slots`, else `EPM_STATUS_INVALID_CONFIG`. Added in the
    /// config's second growth (80 → 88 bytes): a caller passing an older size
    /// gets the default. Default `EPM_FILL_AHEAD_ALL_SLOTS` (on since it ran
    /// on the H200: a staged decode 157 → 133 ms/token at prefetch depth 1).
    pub fill_ahead_chunks: u32,
}

/// `sizeof(EpmResidencyConfig)` in its first published version (epmem
/// 0.1): the smallest `size` ever accepted. Frozen; see docs/ABI.md.
pub const EPM_RESIDENCY_CONFIG_SIZE_V1: usize = 72;
/// `sizeof(EpmResidencyStats)` in its first published version. Frozen.
pub const EPM_RESIDENCY_STATS_SIZE_V1: usize = 288;
versioned!(input EpmResidencyConfig, EPM_RESIDENCY_CONFIG_SIZE_V1);
versioned!(EpmResidencyStats, EPM_RESIDENCY_STATS_SIZE_V1);

config_in! {
    fn default_config() -> EpmResidencyConfig;
    fn apply_config(c: &EpmResidencyConfig, r: &mut ResidencyConfig);
    defaults from ResidencyConfig::with_budget(0);
    // Required: config_of checks it and builds the core config from it.
    manual { budget_bytes: 0, fill_waits_on_host: 1 }
    copy {
        prefetch_depth: prefetch_depth,
        coalesce_below_bytes: coalesce_below_bytes,
        coalesce_max_bytes: coalesce_max_bytes,
        fill_ahead_chunks: fill_ahead_chunks,
    }
    zero_default {
        staging_slots: engine.slots,
        fill_threads: engine.fill_threads,
        staging_chunk_bytes: engine.chunk_bytes,
        staging_pool_bytes: pool.max_bytes,
    }
    flag { sync_page_in: sync_page_in, caller_fills: caller_fills }
    enums {
        policy: policy { EPM_POLICY_CYCLIC => PolicyKind::Cyclic, EPM_POLICY_LRU => PolicyKind::Lru },
        register_sources: register_sources {
            EPM_REGISTER_WITHIN_MEMLOCK => RegisterSources::WithinMemlock,
            EPM_REGISTER_NEVER => RegisterSources::Never,
            EPM_REGISTER_ALWAYS => RegisterSources::Always,
        },
    }
}

fn config_of(p: *const EpmResidencyConfig) -> Result<ResidencyConfig> {
    let c = read_versioned(p, default_config(), "cfg")?;
    ensure!(c.budget_bytes > 0, InvalidArgument, "cfg->budget_bytes is 0");
    ensure!(
        c.fill_waits_on_host != 0,
        Unsupported,
        "cfg->fill_waits_on_host must be 1: a stream waiting on the device for a background fill not yet issued \
         deadlocks on CUDA (driver calls the filler needs block while such a wait is pending; docs/RESIDENCY.md)"
    );
    let mut r = ResidencyConfig::with_budget(
        usize::try_from(c.budget_bytes)
            .map_err(|_| Error::invalid_argument(format!("cfg->budget_bytes {} is too large", c.budget_bytes)))?,
    );
    apply_config(&c, &mut r)?;
    Ok(r)
}

/// Fill `*out` with the defaults (budget 0: the caller must set it).
///
/// The caller sets `out->size = sizeof(EpmResidencyConfig)` first. NULL:
/// `out` is NULL_POINTER. Errors: INVALID_ARGUMENT for a too-small `size`.
/// Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_residency_config_default(out: *mut EpmResidencyConfig) -> EpmStatus {
    ffi_boundary! {
        let out = try_out!(out);
        write_versioned(out, default_config(), "out")
    }
}

/// Create a residency manager on `dev` with `*cfg`.
///
/// Ownership: destroy `*out` with `epm_residency_destroy`. NULL: `dev` is
/// INVALID_HANDLE, `cfg`/`out` NULL_POINTER. Errors: INVALID_ARGUMENT /
/// INVALID_CONFIG for a bad field (budget 0, unknown policy, staging bounds),
/// device errors. Threading: safe from any thread; the manager is thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn epm_residency_create(
    dev: *mut EpmDevice,
    cfg: *const EpmResidencyConfig,
    out: *mut *mut EpmResidency,
) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let cfg = config_of(cfg)?;
        let out = try_out!(out);
        let m = ResidencyManager::new(&dev, cfg)?;
        out.set(handle::insert::<EpmResidency>(Arc::new(m))?);
        Ok(())
    }
}

/// Destroy a residency manager: waits for its page-ins and read fences,
/// frees its device memory and unregisters the sources it registered.
///
/// NULL is a no-op. Errors: INVALID_HANDLE. Threading: the handle must not
/// be used after this call (a call already running on another thread
/// finishes first).
#[unsafe(no_mangle)]
pub extern "C" fn epm_residency_destroy(res: *mut EpmResidency) -> EpmStatus {
    ffi_boundary! { handle::destroy(res) }
}

/// Register a weight: `bytes` at `host` (pageable or page-locked).
///
/// Ownership: epmem reads `[host, host+bytes)` on page-ins until the weight
/// is unregistered (or the manager destroyed); the caller keeps it allocated
/// and unmodified until then. Weights that start on their own page can have
/// their sources registered individually (see `register_sources`).
/// NULL: `host`/`out_weight` NULL_POINTER. Errors: INVALID_ARGUMENT for 0
/// bytes, OUT_OF_BUDGET for a weight larger than the budget. `*out_weight`
/// is written only on success. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_residency_register_weight(
    res: *mut EpmResidency,
    host: *const c_void,
    bytes: usize,
    out_weight: *mut EpmWeightId,
) -> EpmStatus {
    ffi_boundary! {
        let res = try_handle!(res);
        let (p, n) = try_host_range!(host, bytes);
        let out = try_out!(out_weight);
        // SAFETY: the C caller keeps the range readable and unmodified while
        // it is registered (documented above).
        let range = unsafe { HostRange::new(p, n) };
        out.set(res.register(range)?.0);
        Ok(())
    }
}

/// Unregister a weight. It must not be acquired; if resident, waits for its
/// fences and frees its device memory. It leaves the declared cycle.
///
/// Errors: INVALID_ARGUMENT for an unknown weight; INVALID_STATE while it is
/// acquired, or while a weight coalesced with it into one page-in is (the
/// message names the coalesced weights). Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_residency_unregister_weight(res: *mut EpmResidency, weight: EpmWeightId) -> EpmStatus {
    ffi_boundary! {
        let res = try_handle!(res);
        res.unregister(WeightId(weight))
    }
}

/// Register a whole host range once (page-lock it, read-only), so every
/// weight inside it is copied directly with no staging. Registering costs
/// ~40 ms per GiB on the H200, repaid within a few decode steps.
///
/// Ownership: the range must stay allocated until
/// `epm_residency_unregister_host_range` (or destroy). NULL: `host`/`out_range`
/// NULL_POINTER. Errors: INVALID_ARGUMENT for 0 bytes; the device's error when
/// it refuses (overlap with page-locked memory, locked-memory limit).
/// Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_residency_register_host_range(
    res: *mut EpmResidency,
    host: *const c_void,
    bytes: usize,
    out_range: *mut EpmHostRangeId,
) -> EpmStatus {
    ffi_boundary! {
        let res = try_handle!(res);
        let (p, n) = try_host_range!(host, bytes);
        let out = try_out!(out_range);
        // SAFETY: the C caller keeps the range allocated while registered.
        let range = unsafe { HostRange::new(p, n) };
        out.set(res.register_host_range(range)?.0);
        Ok(())
    }
}

/// Unregister a host range (synchronizes the device first). Weights inside
/// it stay registered and are staged from then on.
///
/// Errors: INVALID_ARGUMENT for an unknown or already unregistered id.
///
/// Threading: safe from any thread; the manager is thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn epm_residency_unregister_host_range(res: *mut EpmResidency, range: EpmHostRangeId) -> EpmStatus {
    ffi_boundary! {
        let res = try_handle!(res);
        res.unregister_host_range(HostRangeId(range))
    }
}

/// Declare the cyclic order of a decode step (`n` weights, each at most
/// once). The cyclic policy evicts by it and `release` prefetches along it.
/// Small weights adjacent in host memory and in `order` are coalesced into
/// one page-in (see `coalesce_below_bytes`). Declaring again replaces it
/// (undoing the previous coalescing, which evicts the coalesced weights);
/// `n == 0` clears it.
///
/// NULL: `order` may be NULL only when `n == 0`. Errors: INVALID_ARGUMENT for
/// an unknown or repeated weight; INVALID_STATE while a weight that the
/// previous declaration coalesced with others is acquired (the message names
/// the coalesced weights; nothing changes then). Weights that are not
/// coalesced may stay acquired. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_residency_declare_cycle(
    res: *mut EpmResidency,
    order: *const EpmWeightId,
    n: usize,
) -> EpmStatus {
    ffi_boundary! {
        let res = try_handle!(res);
        let ids = weight_list(order, n)?;
        res.declare_cycle(&ids)
    }
}

/// Page in `weights` (in order) ahead of use, as far as the budget allows
/// without evicting anything needed sooner; never waits for a copy. Writes
/// how many page-ins were issued to `*out_issued` (which may be NULL).
///
/// Errors: INVALID_ARGUMENT for an unknown weight. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_residency_prefetch(
    res: *mut EpmResidency,
    weights: *const EpmWeightId,
    n: usize,
    out_issued: *mut usize,
) -> EpmStatus {
    ffi_boundary! {
        let res = try_handle!(res);
        let ids = weight_list(weights, n)?;
        let issued = res.prefetch(&ids)?;
        if !out_issued.is_null() {
            try_out!(out_issued).set(issued);
        }
        Ok(())
    }
}

/// Make `weight` usable by work queued on `stream` from now on and write its
/// device address to `*out_ptr`. On a miss the page-in is issued and
/// `stream` waits for it on the device; on a hit the host never waits. The
/// address stays valid until the matching `epm_residency_release` (and for
/// the work queued on `stream` before it).
///
/// Ordering: only work queued on `stream` after this call is ordered after
/// the page-in. A synchronous call (`epm_memcpy_dtoh`, `epm_memcpy_htod`)
/// runs on a stream of its own and is NOT: right after this call it may
/// read the bytes the block held before. To use the weight from the host,
/// call `epm_residency_acquire_host` instead (or synchronize `stream` first).
///
/// NULL: `res`/`stream` INVALID_HANDLE, `out_ptr` NULL_POINTER. Errors:
/// INVALID_ARGUMENT (unknown weight, stream of another device), ALL_IN_USE
/// when making room would evict a weight that is acquired and not released.
/// `*out_ptr` is written only on success. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_residency_acquire(
    res: *mut EpmResidency,
    weight: EpmWeightId,
    stream: *mut EpmStream,
    out_ptr: *mut EpmDevicePtr,
) -> EpmStatus {
    ffi_boundary! {
        let res = try_handle!(res);
        let stream = try_handle!(stream);
        let out = try_out!(out_ptr);
        same_device(res.device(), stream.device(), "the residency manager and the stream")?;
        out.set(res.acquire(WeightId(weight), stream.raw())?);
        Ok(())
    }
}

/// Make `weight` usable from the host, for synchronous calls such as
/// `epm_memcpy_dtoh`, and write its device address to `*out_ptr`: as
/// `epm_residency_acquire`, but the calling thread waits until the page-in
/// (if any) has completed, so everything issued after this returns (on any
/// stream, or synchronously) sees the weight's bytes. End the use with
/// `epm_residency_release_host` (or `epm_residency_release` on a stream).
///
/// NULL: `res` INVALID_HANDLE, `out_ptr` NULL_POINTER. Errors: as
/// `epm_residency_acquire`, plus device errors of the page-in (the weight is
/// then not acquired). `*out_ptr` is written only on success. Threading:
/// safe from any thread; only the calling thread waits.
#[unsafe(no_mangle)]
pub extern "C" fn epm_residency_acquire_host(
    res: *mut EpmResidency,
    weight: EpmWeightId,
    out_ptr: *mut EpmDevicePtr,
) -> EpmStatus {
    ffi_boundary! {
        let res = try_handle!(res);
        let out = try_out!(out_ptr);
        let addr = res.acquire_host(WeightId(weight))?;
        out.set(addr);
        Ok(())
    }
}

/// End a host use of `weight` begun by `epm_residency_acquire_host`. The
/// caller's host-side reads (synchronous calls) have returned, so no fence
/// is needed on any of the caller's streams; work the caller queued on a
/// stream with the address must have completed (or use
/// `epm_residency_release` on that stream instead).
///
/// NULL: `res` INVALID_HANDLE. Errors: INVALID_ARGUMENT for an unknown
/// weight, INVALID_STATE when released more often than acquired.
/// Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_residency_release_host(res: *mut EpmResidency, weight: EpmWeightId) -> EpmStatus {
    ffi_boundary! {
        let res = try_handle!(res);
        res.release_host(WeightId(weight))
    }
}

/// End a use of `weight` on `stream`: records the read fence. The weight
/// stays resident and is evicted only after the work queued on `stream` so
/// far has completed. Then issues the next prefetches along the declared
/// cycle; a prefetch from a staged source is handed to the manager's
/// background thread (see `EpmResidencyConfig.caller_fills`), so this call
/// does not spend the fill.
///
/// Errors: INVALID_ARGUMENT (unknown weight, other device), INVALID_STATE
/// when released more often than acquired. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_residency_release(
    res: *mut EpmResidency,
    weight: EpmWeightId,
    stream: *mut EpmStream,
) -> EpmStatus {
    ffi_boundary! {
        let res = try_handle!(res);
        let stream = try_handle!(stream);
        same_device(res.device(), stream.device(), "the residency manager and the stream")?;
        res.release(WeightId(weight), stream.raw())
    }
}

/// Wait for every page-in and the whole device, so the stats are final.
///
/// Errors: device errors. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_residency_synchronize(res: *mut EpmResidency) -> EpmStatus {
    ffi_boundary! {
        let res = try_handle!(res);
        res.synchronize()
    }
}

/// Fill `*out` with the counters. The caller sets
/// `out->size = sizeof(EpmResidencyStats)` first; epmem fills at most that
/// many bytes and writes back how many.
///
/// NULL: `res` INVALID_HANDLE, `out` NULL_POINTER. Errors: INVALID_ARGUMENT
/// for a too-small `size`. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_residency_get_stats(res: *mut EpmResidency, out: *mut EpmResidencyStats) -> EpmStatus {
    ffi_boundary! {
        let res = try_handle!(res);
        let out = try_out!(out);
        let v = stats_to_c(&res.stats());
        write_versioned(out, v, "out")
    }
}

/// A C array of weight ids (NULL allowed only when empty).
fn weight_list(p: *const EpmWeightId, n: usize) -> Result<Vec<WeightId>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    ensure!(!p.is_null(), NullPointer, "a list of {n} weights is NULL");
    ensure!(n <= u32::MAX as usize, InvalidArgument, "a list of {n} weights is too long");
    // SAFETY: non-NULL; the C caller promises `n` readable ids for the call.
    let ids = unsafe { std::slice::from_raw_parts(p, n) };
    Ok(ids.iter().map(|&w| WeightId(w)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device-side wait for a background fill not yet issued deadlocked on
    /// the H200 (docs/RESIDENCY.md, "Why the host waits"): the config that
    /// asks for it is refused, clearly, and the default is accepted.
    #[test]
    fn device_side_fill_waits_are_refused() {
        let mut c = default_config();
        c.budget_bytes = 1 << 20;
        assert_eq!(c.fill_waits_on_host, 1);
        c.fill_waits_on_host = 0;
        let e = config_of(&c).unwrap_err();
        assert_eq!(e.status(), EpmStatus::Unsupported, "{e}");
        assert!(e.message().contains("fill_waits_on_host") && e.message().contains("deadlock"), "{e}");
        c.fill_waits_on_host = 1;
        config_of(&c).unwrap();
    }
}
