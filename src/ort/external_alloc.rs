//! Plain allocation functions for ORT's CUDA EP provider options
//! `gpu_external_alloc`, `gpu_external_free` and `gpu_external_empty_cache`
//! (each takes a function address, as a decimal string). With them the CUDA
//! EP takes its device memory from an epmem device arena where no
//! `session.use_env_allocators` route exists.
//!
//! The CUDA EP calls them without a device or a stream: they serve one
//! process-wide arena on the device `EPM_EXTERNAL_ORDINAL` (default 0) of the
//! kind `EPM_DEVICE` selects (a CUDA GPU if there is one, else the host
//! device), made on the first allocation. A free is immediate: the memory
//! may be handed out again at once, which is safe for what the CUDA EP queues
//! on one stream (the stream runs in order) but not across streams; prefer
//! `session.use_env_allocators=1` with the registered EP (stream-ordered,
//! docs/ORT.md) wherever the host can set it.

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use crate::arena::{Arena, ArenaConfig, DeviceArena};
use crate::device::{self, DeviceSelect};
use crate::error::Result;

static ARENA: Mutex<Option<Arc<DeviceArena>>> = Mutex::new(None);

fn arena() -> Result<Arc<DeviceArena>> {
    let mut g = ARENA.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(a) = g.as_ref() {
        return Ok(a.clone());
    }
    let ordinal: u32 = match std::env::var("EPM_EXTERNAL_ORDINAL") {
        Ok(v) => v.trim().parse().map_err(|_| {
            crate::error::Error::invalid_argument(format!("EPM_EXTERNAL_ORDINAL={v:?} is not a number"))
        })?,
        Err(_) => 0,
    };
    let select = DeviceSelect::from_env()?;
    let dev = device::open(select, if select == DeviceSelect::Host { 0 } else { ordinal })?;
    let total = dev.info().total_mem as usize;
    let a = Arc::new(DeviceArena::new(&dev, ArenaConfig::with_capacity(total))?);
    log::info!("epmem: external allocator for ORT's CUDA EP on {} (capacity {total} bytes)", dev.info().name);
    *g = Some(a.clone());
    Ok(a)
}

/// `gpu_external_alloc`: `size` bytes of device memory from epmem's arena
/// (256-byte aligned; a request of 0 bytes gets a distinct 1-byte block).
/// Returns NULL when the memory cannot be had (the reason is logged), which
/// ORT reports as out of memory. Thread-safe.
///
/// # Safety
/// Callable from any thread; the block must be released with
/// [`epm_ort_external_free`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn epm_ort_external_alloc(size: usize) -> *mut c_void {
    super::value_boundary("epm_ort_external_alloc", std::ptr::null_mut(), || {
        match arena().and_then(|a| a.alloc(size.max(1), 0)) {
            Ok(p) => p as *mut c_void,
            Err(e) => {
                log::warn!("epmem: external allocation of {size} bytes failed: {e}");
                std::ptr::null_mut()
            }
        }
    })
}

/// `gpu_external_free`: give back a block from [`epm_ort_external_alloc`]
/// (NULL is ignored). A pointer the arena did not hand out is logged and
/// ignored, never a crash. The memory may be reused at once: the caller must
/// not have work on another stream still reading it.
///
/// # Safety
/// `p` is NULL or a block from `epm_ort_external_alloc` not freed yet.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn epm_ort_external_free(p: *mut c_void) {
    if p.is_null() {
        return;
    }
    super::value_boundary("epm_ort_external_free", (), || {
        let a = ARENA.lock().unwrap_or_else(|g| g.into_inner()).clone();
        match a {
            Some(a) => {
                if let Err(e) = a.free(p as u64) {
                    log::warn!("epmem: external free of {p:?}: {e}");
                }
            }
            None => log::warn!("epmem: external free of {p:?} before any external allocation; ignored"),
        }
    })
}

/// `gpu_external_empty_cache`: give the arena's unused physical memory back
/// to the driver. Thread-safe; a no-op before the first allocation.
///
/// # Safety
/// None beyond calling it from any thread.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn epm_ort_external_empty_cache() {
    super::value_boundary("epm_ort_external_empty_cache", (), || {
        let a = ARENA.lock().unwrap_or_else(|g| g.into_inner()).clone();
        if let Some(a) = a
            && let Err(e) = a.trim()
        {
            log::warn!("epmem: external empty_cache: {e}");
        }
    })
}

/// Live blocks and committed bytes of the external arena (tests).
#[cfg(test)]
pub(crate) fn stats() -> Option<crate::arena::ArenaStats> {
    ARENA.lock().unwrap_or_else(|g| g.into_inner()).as_ref().map(|a| a.stats())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_write_free_reuse_and_bad_input() {
        // SAFETY: the functions' own contract: blocks freed once, by us.
        unsafe {
            let p = epm_ort_external_alloc(1 << 20);
            assert!(!p.is_null());
            let q = epm_ort_external_alloc(0);
            assert!(!q.is_null() && q != p);
            let live = stats().unwrap().live_allocations;
            epm_ort_external_free(p);
            epm_ort_external_free(q);
            assert_eq!(stats().unwrap().live_allocations, live - 2);
            // Foreign and repeated frees are logged, not fatal.
            epm_ort_external_free(p);
            let mut local = 0u8;
            epm_ort_external_free(&mut local as *mut u8 as *mut c_void);
            epm_ort_external_free(std::ptr::null_mut());
            // More than the device can hold is NULL.
            assert!(epm_ort_external_alloc(usize::MAX / 2).is_null());
            epm_ort_external_empty_cache();
            let r = epm_ort_external_alloc(4096);
            assert!(!r.is_null());
            epm_ort_external_free(r);
        }
    }
}
