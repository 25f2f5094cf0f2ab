//! The raw level under [`super::CudaDevice`]: loading libcuda, turning a
//! `CUresult` into an [`Error`], and making the primary context current.
//!
//! cudarc's `driver::sys` panics in two places we must never reach: when
//! libcuda cannot be loaded, and when a symbol is missing from it. So before
//! the first real call we probe the library and every symbol we use, and a
//! process without a (recent enough) driver gets [`EpmStatus::DeviceUnavailable`].

use std::ffi::CStr;
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::error::{EpmStatus, Error, Result};

/// Call a `driver::sys` function and turn its `CUresult` into a [`Result`]
/// whose error names the call: `unsafe { cu!(cuMemAlloc_v2(&mut p, n)) }?`.
/// The caller supplies the `unsafe` block and its `// SAFETY:` line.
macro_rules! cu {
    ($f:ident ( $($arg:expr),* $(,)? )) => {
        $crate::device::cuda::driver::check(stringify!($f), ::cudarc::driver::sys::$f($($arg),*))
    };
}

/// Every driver entry point this module calls. Checked once before `cuInit`,
/// because cudarc panics on the first call to a missing symbol.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuGetErrorName",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceTotalMem_v2",
    "cuDeviceGetAttribute",
    "cuDeviceGetPCIBusId",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuMemGetInfo_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetAddressRange_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemsetD8Async",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuStreamGetCtx",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuModuleLoadDataEx",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
    "cuMemGetAllocationGranularity",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
];

/// Load libcuda, check its symbols and run `cuInit(0)`, once per process.
/// Every later call returns the first outcome.
pub(super) fn init() -> Result<()> {
    static INIT: OnceLock<Result<()>> = OnceLock::new();
    INIT.get_or_init(init_once).clone()
}

fn init_once() -> Result<()> {
    // SAFETY: only tries to dlopen the candidate library names; no symbol is called.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::new(
            EpmStatus::DeviceUnavailable,
            "no CUDA driver: libcuda.so could not be loaded (not installed, or not on the loader path)",
        ));
    }
    // SAFETY: the library is present (probed just above), so `culib` loads it
    // instead of panicking; `get` only looks a name up, nothing is called.
    let lib = unsafe { sys::culib() };
    let missing: Vec<&str> = REQUIRED_SYMBOLS
        .iter()
        .copied()
        // SAFETY: a symbol lookup; the pointer is never dereferenced or called.
        .filter(|name| unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_err())
        .collect();
    if !missing.is_empty() {
        return Err(Error::new(
            EpmStatus::DeviceUnavailable,
            format!("the CUDA driver is too old: libcuda lacks {}", missing.join(", ")),
        ));
    }
    // SAFETY: cuInit has no pointer arguments; the library and symbol exist.
    unsafe { cu!(cuInit(0)) }.map_err(|e| Error::new(EpmStatus::DeviceUnavailable, e.message().to_string()))
}

/// Whether a symbol exists in the loaded libcuda (for optional, newer entry points).
pub(super) fn has_symbol(name: &str) -> bool {
    // SAFETY: only called after `init` succeeded, so the library is loaded; a lookup only.
    unsafe { sys::culib().get::<*const ()>(name.as_bytes()) }.is_ok()
}

/// Turn a `CUresult` into `Ok(())` or an [`Error`] naming `call` and the result.
pub(crate) fn check(call: &str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(driver_error(call, r as u32, &error_name(r)))
}

/// The driver's name for a result (`CUDA_ERROR_ILLEGAL_ADDRESS`).
fn error_name(r: sys::CUresult) -> String {
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: `p` is a valid out-pointer; on success the driver points it at a
    // static NUL-terminated string.
    let ok = unsafe { sys::cuGetErrorName(r, &mut p) } == sys::CUresult::CUDA_SUCCESS;
    if ok && !p.is_null() {
        // SAFETY: checked non-null; the driver's error names are static C strings.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        "an unknown CUresult".to_string()
    }
}

/// CUresult values after which the context is unusable: every later call in
/// the process fails the same way, so the device must be re-opened (in a new
/// process). A kernel store into a read-only VMM alias is one (700, measured).
const STICKY: &[u32] = &[
    4,   // DEINITIALIZED: the driver is shutting down
    214, // ECC_UNCORRECTABLE
    220, // NVLINK_UNCORRECTABLE
    226, // CONTAINED
    700, // ILLEGAL_ADDRESS
    702, // LAUNCH_TIMEOUT
    709, // CONTEXT_IS_DESTROYED
    710, // ASSERT
    714, // HARDWARE_STACK_ERROR
    715, // ILLEGAL_INSTRUCTION
    716, // MISALIGNED_ADDRESS
    717, // INVALID_ADDRESS_SPACE
    718, // INVALID_PC
    719, // LAUNCH_FAILED
    721, // TENSOR_MEMORY_LEAK
    911, // EXTERNAL_DEVICE
];

/// The [`EpmStatus`] for a failed CUresult `code`.
pub(crate) fn status_for(code: u32) -> EpmStatus {
    match code {
        c if STICKY.contains(&c) => EpmStatus::ContextLost,
        2 => EpmStatus::OutOfDeviceMemory,
        600 => EpmStatus::NotReady,
        // STUB_LIBRARY, DEVICE_UNAVAILABLE, NO_DEVICE, INVALID_DEVICE,
        // SYSTEM_NOT_READY, SYSTEM_DRIVER_MISMATCH, COMPAT_NOT_SUPPORTED_ON_DEVICE
        34 | 46 | 100 | 101 | 802 | 803 | 804 => EpmStatus::DeviceUnavailable,
        801 => EpmStatus::Unsupported,
        // Everything else, INVALID_VALUE (1) on a copy included, keeps the
        // driver's name in the message; the context stays usable.
        _ => EpmStatus::CudaError,
    }
}

/// The error for `call` failing with CUresult `code` named `name`.
pub(crate) fn driver_error(call: &str, code: u32, name: &str) -> Error {
    let status = status_for(code);
    let hint = if status == EpmStatus::ContextLost {
        "; the CUDA context is lost, re-open the device in a new process"
    } else {
        ""
    };
    Error::new(status, format!("{call} failed: {name} ({code}){hint}"))
}

/// Report out-of-memory from a host-memory call (cuMemHostAlloc,
/// cuMemHostRegister) as host memory, not device memory.
pub(super) fn host_oom(e: Error) -> Error {
    if e.status() == EpmStatus::OutOfDeviceMemory {
        Error::new(EpmStatus::OutOfHostMemory, e.message().to_string())
    } else {
        e
    }
}

/// Normalize `cuDeviceGetPCIBusId`'s text to lowercase "dddd:bb:dd.f".
/// The driver's domain width has varied (4 or 8 hex digits); we keep at
/// least 4 so ids compare equal with `lspci -D` and sysfs names.
pub(crate) fn normalize_pci_bus_id(raw: &str) -> Option<String> {
    let raw = raw.trim();
    let (domain, rest) = raw.split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (dev, func) = rest.split_once('.')?;
    let hex = |s: &str| u32::from_str_radix(s, 16).ok();
    let (d, b, v, f) = (hex(domain)?, hex(bus)?, hex(dev)?, hex(func)?);
    Some(format!("{d:04x}:{b:02x}:{v:02x}.{f:x}"))
}

/// A driver handle (pointer) that may cross threads: the driver API is thread
/// safe and these handles are plain identifiers to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Handle<T>(pub T);
// SAFETY: CUDA driver handles (CUcontext, CUstream, CUevent, CUmodule,
// CUfunction) may be used from any thread; we never dereference them.
unsafe impl<T> Send for Handle<T> {}
// SAFETY: as above; shared use only passes the value to the driver.
unsafe impl<T> Sync for Handle<T> {}

/// Makes `ctx` current on this thread for the guard's lifetime and restores
/// the thread's previous context afterwards.
///
/// C hosts call from any thread, and a host thread may have another device's
/// context current (multi-GPU, or the runtime API's device). Leaving ours
/// current would silently redirect the host's next runtime call, so we
/// restore. The common case, ours already current, costs one
/// `cuCtxGetCurrent` (a thread-local read in the driver) and no switch.
pub(super) struct CtxGuard {
    restore: Option<sys::CUcontext>,
}

impl CtxGuard {
    pub(super) fn enter(ctx: sys::CUcontext) -> Result<Self> {
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `cur` is a valid out-pointer.
        unsafe { cu!(cuCtxGetCurrent(&mut cur)) }?;
        if cur == ctx {
            return Ok(Self { restore: None });
        }
        // SAFETY: `ctx` is our retained primary context, alive while the device is.
        unsafe { cu!(cuCtxSetCurrent(ctx)) }?;
        Ok(Self { restore: Some(cur) })
    }
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if let Some(prev) = self.restore {
            // SAFETY: `prev` was current on this thread a moment ago (or null,
            // which unbinds); restoring it is what the host expects.
            if let Err(e) = unsafe { cu!(cuCtxSetCurrent(prev)) } {
                log::warn!("epmem: restoring the caller's CUDA context failed: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sticky_errors_mean_context_lost() {
        for code in [700, 709, 714, 715, 716, 719] {
            let e = driver_error("cuStreamSynchronize", code, "CUDA_ERROR_X");
            assert_eq!(e.status(), EpmStatus::ContextLost, "{code}");
            assert!(e.message().contains("context is lost"), "{e}");
        }
    }

    #[test]
    fn error_names_the_call_and_the_result() {
        let e = driver_error("cuMemcpyHtoDAsync_v2", 1, "CUDA_ERROR_INVALID_VALUE");
        assert_eq!(e.status(), EpmStatus::CudaError);
        assert_eq!(e.message(), "cuMemcpyHtoDAsync_v2 failed: CUDA_ERROR_INVALID_VALUE (1)");
    }

    #[test]
    fn resource_and_availability_codes_map_to_their_statuses() {
        assert_eq!(status_for(2), EpmStatus::OutOfDeviceMemory);
        assert_eq!(status_for(600), EpmStatus::NotReady);
        assert_eq!(status_for(100), EpmStatus::DeviceUnavailable);
        assert_eq!(status_for(34), EpmStatus::DeviceUnavailable);
        assert_eq!(status_for(801), EpmStatus::Unsupported);
        assert_eq!(status_for(400), EpmStatus::CudaError);
        assert_eq!(status_for(12345), EpmStatus::CudaError);
    }

    #[test]
    fn host_calls_report_host_oom() {
        let e = host_oom(driver_error("cuMemHostAlloc", 2, "CUDA_ERROR_OUT_OF_MEMORY"));
        assert_eq!(e.status(), EpmStatus::OutOfHostMemory);
        assert!(e.message().starts_with("cuMemHostAlloc failed"), "{e}");
        let e = host_oom(driver_error("cuMemHostAlloc", 1, "CUDA_ERROR_INVALID_VALUE"));
        assert_eq!(e.status(), EpmStatus::CudaError);
    }

    #[test]
    fn pci_bus_ids_are_normalized() {
        assert_eq!(normalize_pci_bus_id("0000:19:00.0").as_deref(), Some("0000:19:00.0"));
        assert_eq!(normalize_pci_bus_id("00000000:9A:00.0\n").as_deref(), Some("0000:9a:00.0"));
        assert_eq!(normalize_pci_bus_id("0001:0B:1F.7").as_deref(), Some("0001:0b:1f.7"));
        assert_eq!(normalize_pci_bus_id("garbage"), None);
        assert_eq!(normalize_pci_bus_id("0000:zz:00.0"), None);
    }
}
