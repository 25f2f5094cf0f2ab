//! PyTorch's pluggable CUDA allocator over epmem's stream-ordered device
//! arena: `epm_torch_alloc` / `epm_torch_free` have exactly the signatures
//! `torch.cuda.memory.CUDAPluggableAllocator` loads by name; the Python side
//! is `epmem.torch_allocator` (docs/ALLOCATOR.md).
//!
//! One arena per device ordinal, made on the first allocation there:
//! capacity `epm_torch_set_capacity` (else `EPM_TORCH_CAPACITY`, else the
//! device's total memory; virtual space only, physical memory is committed
//! as used), grown one VMM granule at a time (as ONNX Runtime's allocators
//! are: the smallest footprint; the driver is paid in warm-up only).
//! PyTorch frees a block with the stream it was allocated on, as soon as the
//! last kernel using it is queued: the free is ordered after that stream's
//! queued work (`arena::stream_order`). While one stream has made every
//! allocation (PyTorch's default stream alone, the common case) frees are
//! immediate with no event; the first allocation for a second stream waits
//! once for the first stream's queued work and orders frees from then on.

use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::device::{self, DeviceSelect, RawStream};
use crate::ffi::ordered_arena::{EpmOrderedArenaStats, OrderedArena};
use crate::ffi::prelude::*;

/// Device ordinals served: 0 to this, exclusive.
/// cbindgen:ignore
const MAX_DEVICES: usize = 64;

struct TorchDevice {
    arena: OrderedArena,
    /// PyTorch's native streams, adopted by the device on first sight (None:
    /// the device cannot adopt it, so its allocations are not stream-ordered).
    streams: Mutex<HashMap<u64, Option<RawStream>>>,
    warned_unordered: AtomicBool,
}

static DEVICES: [OnceLock<TorchDevice>; MAX_DEVICES] = [const { OnceLock::new() }; MAX_DEVICES];
/// The capacity set by `epm_torch_set_capacity` (0: none); also serializes
/// the creation of device arenas.
static CAPACITY: Mutex<u64> = Mutex::new(0);

fn ordinal(device: c_int) -> Result<usize> {
    usize::try_from(device).ok().filter(|&d| d < MAX_DEVICES).ok_or_else(|| {
        Error::invalid_argument(format!("device {device} is not a device ordinal (0 to {})", MAX_DEVICES - 1))
    })
}

/// `EPM_TORCH_CAPACITY`: bytes, or a number with a K/M/G/T suffix (powers of 1024).
fn capacity_from_env() -> Result<Option<u64>> {
    let Ok(v) = std::env::var("EPM_TORCH_CAPACITY") else { return Ok(None) };
    let t = v.trim();
    let digits = t.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let shift = match t[digits.len()..].to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        _ => bail!(InvalidConfig, "EPM_TORCH_CAPACITY={v:?}: a byte count, optionally with K, M, G or T"),
    };
    let n: u64 = digits.trim().parse().map_err(|_| {
        Error::new(EpmStatus::InvalidConfig, format!("EPM_TORCH_CAPACITY={v:?} is not a number of bytes"))
    })?;
    let bytes = n
        .checked_mul(1u64 << shift)
        .filter(|&b| b > 0)
        .ok_or_else(|| Error::new(EpmStatus::InvalidConfig, format!("EPM_TORCH_CAPACITY={v:?} is 0 or too large")))?;
    Ok(Some(bytes))
}

/// The arena of `device` (made on first use).
fn device_arena(device: c_int) -> Result<&'static TorchDevice> {
    let d = ordinal(device)?;
    if let Some(t) = DEVICES[d].get() {
        return Ok(t);
    }
    let set = CAPACITY.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(t) = DEVICES[d].get() {
        return Ok(t);
    }
    // PyTorch's pointers are CUDA pointers: never fall back to the host
    // device as EPM_DEVICE=auto would. EPM_DEVICE=host is for tests only.
    let select = match DeviceSelect::from_env()? {
        DeviceSelect::Host => DeviceSelect::Host,
        _ => DeviceSelect::Cuda,
    };
    let dev = device::open(select, d as u32).map_err(|e| e.context(format!("opening device {d} for PyTorch")))?;
    let capacity = match (*set, capacity_from_env()?) {
        (0, None) => dev.info().total_mem,
        (0, Some(env)) => env,
        (api, _) => api,
    };
    let t = TorchDevice {
        arena: OrderedArena::granular_single_stream(&dev, capacity)?,
        streams: Mutex::new(HashMap::new()),
        warned_unordered: AtomicBool::new(false),
    };
    log::info!("epmem: PyTorch allocator on device {d} ({}): capacity {capacity} bytes", dev.info().name);
    Ok(DEVICES[d].get_or_init(|| t))
}

/// The arena of `device` if it has been made.
fn existing(device: c_int) -> Result<Option<&'static TorchDevice>> {
    Ok(DEVICES[ordinal(device)?].get())
}

impl TorchDevice {
    fn stream(&self, native: *mut c_void) -> Option<RawStream> {
        let key = native.expose_provenance() as u64;
        let mut m = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = m.get(&key) {
            return *s;
        }
        let adopted = match self.arena.device().stream_wrap_native(key) {
            Ok(s) => Some(s),
            Err(e) => {
                if !self.warned_unordered.swap(true, Ordering::Relaxed) {
                    log::warn!(
                        "epmem: PyTorch allocator: cannot order frees after stream {key:#x} ({e}); its allocations are freed at once"
                    );
                }
                None
            }
        };
        m.insert(key, adopted);
        adopted
    }
}

/// Allocate `size` bytes of device memory on CUDA device `device` for work
/// on `stream` (a `cudaStream_t`; NULL is the legacy default stream,
/// PyTorch's default, ordered like any other stream): the
/// allocation function of PyTorch's `CUDAPluggableAllocator`. `size` 0 gets
/// a distinct 1-byte block.
///
/// Returns the device pointer, or NULL on failure, with the reason in
/// `epm_last_error_message()` on this thread and logged (PyTorch takes no
/// status: it stores NULL as the tensor's data, so a failure here surfaces
/// later as a CUDA error in the kernel that uses it). Failures: `size`
/// negative, `device` not an ordinal (0 to 63) or no such device, the
/// capacity exhausted (OUT_OF_BUDGET), the GPU out of memory.
///
/// The first call for a device creates its arena (see
/// `epm_torch_set_capacity`). Memory freed on `stream` is reused by the next
/// allocation on `stream` at once and by other streams once `stream`'s work
/// queued before the free has completed. `stream` must be NULL or a live
/// stream of the device's primary context; on a device that cannot adopt it
/// (the host device) the allocation is not stream-ordered (a warning says
/// so once). Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_torch_alloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    let mut addr = 0u64;
    let status = ffi_boundary! {
        let bytes = usize::try_from(size).map_err(|_| Error::invalid_argument(format!("size {size} is negative")))?;
        let t = device_arena(device)?;
        // NULL is the legacy default stream, PyTorch's default: a stream
        // like any other (PyTorch's own streams do not synchronize with it).
        let s = t.stream(stream);
        addr = t.arena.alloc(bytes.max(1), s)
            .map_err(|e| e.context(format!("PyTorch allocation of {bytes} bytes on device {device}")))?;
        Ok(())
    };
    if status != EpmStatus::Ok {
        log::error!("epmem: epm_torch_alloc({size}, {device}): {}", last_message());
        return std::ptr::null_mut();
    }
    std::ptr::with_exposed_provenance_mut(addr as usize)
}

/// Free a pointer from `epm_torch_alloc`: the free function of PyTorch's
/// `CUDAPluggableAllocator`. `size`, `device` and `stream` are those of the
/// allocation (PyTorch passes them back); the free is ordered after the work
/// queued so far on the stream the block was allocated on. NULL `ptr` is a
/// no-op.
///
/// Cannot report a status: on bad input (a negative or wrong `size`, an
/// unknown `device`, a pointer this allocator did not hand out or freed
/// already) nothing is freed, the reason is in `epm_last_error_message()` on
/// this thread and logged. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_torch_free(ptr: *mut c_void, size: isize, device: c_int, stream: *mut c_void) {
    let _ = stream;
    if ptr.is_null() {
        crate::ffi::status::clear_last_error();
        return;
    }
    let status = ffi_boundary! {
        let bytes = usize::try_from(size).map_err(|_| Error::invalid_argument(format!("size {size} is negative")))?;
        let t = existing(device)?.ok_or_else(|| {
            Error::invalid_argument(format!("device {device} has no PyTorch allocations: {ptr:p} is not one of its blocks"))
        })?;
        t.arena.free(ptr.expose_provenance() as u64, None, Some(bytes.max(1)))
            .map_err(|e| e.context(format!("PyTorch free on device {device}")))
    };
    if status != EpmStatus::Ok {
        log::error!("epmem: epm_torch_free({ptr:p}, {size}, {device}): {}", last_message());
    }
}

fn last_message() -> String {
    // SAFETY: epm_last_error_message never returns NULL; the string is
    // valid until the next epm call on this thread, and is copied at once.
    unsafe { std::ffi::CStr::from_ptr(crate::ffi::status::epm_last_error_message()) }.to_string_lossy().into_owned()
}

/// Set the capacity (bytes of virtual address space, the most the arena
/// may commit) of every device arena the PyTorch allocator creates from now
/// on; 0 restores the default (`EPM_TORCH_CAPACITY`, else the device's total
/// memory). Call it before the first CUDA allocation.
///
/// Errors: INVALID_STATE once any device arena exists (its capacity is
/// fixed: the message names the device). Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_torch_set_capacity(capacity_bytes: u64) -> EpmStatus {
    ffi_boundary! {
        let mut set = CAPACITY.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = DEVICES.iter().position(|d| d.get().is_some()) {
            bail!(InvalidState, "the PyTorch allocator already has an arena on device {d}: set the capacity before the first CUDA allocation");
        }
        *set = capacity_bytes;
        Ok(())
    }
}

/// Fill `*out` with the counters of the PyTorch allocator's arena on
/// `device` (the caller sets `out->size = sizeof(EpmOrderedArenaStats)`).
///
/// NULL: `out` is NULL_POINTER. Errors: INVALID_ARGUMENT for a bad ordinal
/// or too small a `size`; INVALID_STATE when nothing was allocated on
/// `device` yet (no arena). Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_torch_get_stats(device: c_int, out: *mut EpmOrderedArenaStats) -> EpmStatus {
    ffi_boundary! {
        let out = try_out!(out);
        let t = existing(device)?
            .ok_or_else(|| Error::new(EpmStatus::InvalidState, format!("the PyTorch allocator has no arena on device {device} yet")))?;
        write_versioned(out, t.arena.stats(), "out")
    }
}

/// Give memory no tensor uses back to the driver (`torch.cuda.empty_cache`'s
/// job, which PyTorch does not forward to a pluggable allocator): waits for
/// the work still using freed blocks, then releases every unused chunk.
/// `device` -1: every device with an arena. Writes the bytes given back to
/// `*out_bytes` (may be NULL).
///
/// Blocks until the streams with pending frees have run their queued work.
/// Errors: INVALID_ARGUMENT for a bad ordinal; device errors. A device with
/// no arena gives back 0. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_torch_trim(device: c_int, out_bytes: *mut u64) -> EpmStatus {
    ffi_boundary! {
        let mut given = 0u64;
        if device == -1 {
            for t in DEVICES.iter().filter_map(|d| d.get()) {
                given += t.arena.trim()? as u64;
            }
        } else if let Some(t) = existing(device)? {
            given = t.arena.trim()? as u64;
        }
        if !out_bytes.is_null() {
            try_out!(out_bytes).set(given);
        }
        Ok(())
    }
}
