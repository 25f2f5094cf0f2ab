//! Plain device memory, copies and memset. (The checksum and spin kernels
//! tests use are test machinery: src/ffi/testing.rs, include/epmem_testing.h.)
//!
//! Device addresses are `EpmDevicePtr` integers; the device validates them,
//! so an address it did not hand out is an error, not a crash.

use crate::device::Stream;
use crate::ffi::args::device_range;
use crate::ffi::device::EpmDevice;
use crate::ffi::prelude::*;
use crate::ffi::stream::{EpmStream, same_device};

/// A device virtual address (on the host device, a host address). 0 is "none".
pub type EpmDevicePtr = u64;

/// Allocate `bytes` of device memory (`cuMemAlloc`).
///
/// Ownership: free `*out` with `epm_device_free` on the same device. NULL:
/// `dev` is INVALID_HANDLE, `out` is NULL_POINTER. Errors: INVALID_ARGUMENT
/// for 0 bytes; OUT_OF_DEVICE_MEMORY. `*out` is written only on success.
/// Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_device_alloc(dev: *mut EpmDevice, bytes: usize, out: *mut EpmDevicePtr) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let out = try_out!(out);
        ensure!(bytes > 0, InvalidArgument, "device allocation of 0 bytes");
        out.set(dev.mem_alloc(bytes)?);
        Ok(())
    }
}

/// Free memory from `epm_device_alloc`. `ptr == 0` is a no-op. The caller
/// guarantees no queued work still uses it (on CUDA this synchronizes like
/// `cuMemFree`).
///
/// Errors: INVALID_ARGUMENT (or a device error) for an address this device
/// did not allocate or already freed. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_device_free(dev: *mut EpmDevice, ptr: EpmDevicePtr) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        if ptr == 0 {
            return Ok(());
        }
        dev.mem_free(ptr)
    }
}

/// Copy `bytes` from host `src` to device `dst` and wait for it to complete.
///
/// Ordering: the copy runs on a stream of its own. It is not ordered after
/// work queued on any of your streams (nor after a page-in that
/// `epm_residency_acquire` queued for one), and work queued on your streams
/// may run concurrently with it: synchronize them first (docs/ABI.md,
/// "Synchronous calls and streams").
///
/// `src` is only read during the call (pageable memory is fine). NULL: `dev`
/// is INVALID_HANDLE, `src` NULL_POINTER. Errors: INVALID_ARGUMENT for 0 bytes
/// or a range that overflows; device errors for a bad `dst`. Threading: safe
/// from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_memcpy_htod(
    dev: *mut EpmDevice,
    dst: EpmDevicePtr,
    src: *const c_void,
    bytes: usize,
) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let (src, n) = try_host_range!(src, bytes);
        device_range(dst, n, "dst")?;
        let s = Stream::new(&dev)?;
        // SAFETY: `src` is n readable bytes (checked non-NULL; the caller
        // promises the rest) and we wait for the copy before returning.
        unsafe { dev.memcpy_htod_async(dst, src, n, s.raw())? };
        s.synchronize()
    }
}

/// Copy `bytes` from device `src` to host `dst` and wait for it to complete.
///
/// Ordering: as `epm_memcpy_htod`, the copy runs on a stream of its own and
/// is not ordered after work queued on your streams. Reading a weight right
/// after `epm_residency_acquire` can see stale bytes: use
/// `epm_residency_acquire_host` (which waits for the page-in) or synchronize
/// the stream first.
///
/// `dst` must be `bytes` writable bytes. NULL: `dev` is INVALID_HANDLE, `dst`
/// NULL_POINTER. Errors: as `epm_memcpy_htod`. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_memcpy_dtoh(dev: *mut EpmDevice, dst: *mut c_void, src: EpmDevicePtr, bytes: usize) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let (dst, n) = try_host_range!(dst, bytes);
        device_range(src, n, "src")?;
        let s = Stream::new(&dev)?;
        // SAFETY: `dst` is n writable bytes (the caller's promise) and we wait
        // for the copy before returning, so nothing else touches it meanwhile.
        unsafe { dev.memcpy_dtoh_async(dst.cast_mut(), src, n, s.raw())? };
        s.synchronize()
    }
}

/// Queue a copy of `bytes` from host `src` to device `dst` on `stream`.
///
/// `src` must stay readable and unmodified until the copy completes (record
/// an event after it and wait for that). Ordering with the calling thread:
/// from page-locked memory (a pinned arena, a host registration) the call
/// only queues the copy; from pageable memory the CUDA driver stages the
/// bytes through its own pinned buffers and may make the call wait until
/// `stream` has run its earlier work, so queuing behind a stream that waits
/// on something this thread does later can deadlock. Page-locked memory is
/// also the fast path. NULL: handles INVALID_HANDLE, `src` NULL_POINTER. Errors: INVALID_ARGUMENT
/// for 0 bytes, overflow, or a stream of another device. Threading: safe
/// from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_memcpy_htod_async(
    dev: *mut EpmDevice,
    dst: EpmDevicePtr,
    src: *const c_void,
    bytes: usize,
    stream: *mut EpmStream,
) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let stream = try_handle!(stream);
        same_device(&dev, stream.device(), "dev and stream")?;
        let (src, n) = try_host_range!(src, bytes);
        device_range(dst, n, "dst")?;
        // SAFETY: the caller keeps `src` readable until the copy completes
        // (this function's documented contract).
        unsafe { dev.memcpy_htod_async(dst, src, n, stream.raw()) }
    }
}

/// Queue a copy of `bytes` from device `src` to host `dst` on `stream`.
///
/// `dst` must stay writable and untouched until the copy completes. Into
/// pageable memory the CUDA driver returns only after the copy is done (it
/// waits for `stream`'s earlier work); into page-locked memory the call only
/// queues it. Errors and NULL as `epm_memcpy_htod_async`. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_memcpy_dtoh_async(
    dev: *mut EpmDevice,
    dst: *mut c_void,
    src: EpmDevicePtr,
    bytes: usize,
    stream: *mut EpmStream,
) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let stream = try_handle!(stream);
        same_device(&dev, stream.device(), "dev and stream")?;
        let (dst, n) = try_host_range!(dst, bytes);
        device_range(src, n, "src")?;
        // SAFETY: the caller keeps `dst` writable and otherwise untouched until
        // the copy completes (this function's documented contract).
        unsafe { dev.memcpy_dtoh_async(dst.cast_mut(), src, n, stream.raw()) }
    }
}

/// Queue a device-to-device copy of `bytes` on `stream`.
///
/// Errors: INVALID_ARGUMENT for 0 bytes, overflow, or a stream of another
/// device; device errors for bad addresses. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_memcpy_dtod_async(
    dev: *mut EpmDevice,
    dst: EpmDevicePtr,
    src: EpmDevicePtr,
    bytes: usize,
    stream: *mut EpmStream,
) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let stream = try_handle!(stream);
        same_device(&dev, stream.device(), "dev and stream")?;
        device_range(dst, bytes, "dst")?;
        device_range(src, bytes, "src")?;
        dev.memcpy_dtod_async(dst, src, bytes, stream.raw())
    }
}

/// Queue a fill of `bytes` of device memory at `dst` with `value` on `stream`.
///
/// Errors: as `epm_memcpy_dtod_async`. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_memset_d8_async(
    dev: *mut EpmDevice,
    dst: EpmDevicePtr,
    value: u8,
    bytes: usize,
    stream: *mut EpmStream,
) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let stream = try_handle!(stream);
        same_device(&dev, stream.device(), "dev and stream")?;
        device_range(dst, bytes, "dst")?;
        dev.memset_d8_async(dst, value, bytes, stream.raw())
    }
}
