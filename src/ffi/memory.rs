//! Plain device memory, copies, and the small built-in kernels that demos
//! and tests use (memset, checksum, spin).
//!
//! Device addresses are `EpmDevicePtr` integers; the device validates them,
//! so an address it did not hand out is an error, not a crash.

use crate::device::{Stream, checksum_host};
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
/// `src` is only read during the call (pageable memory is fine). NULL: `dev`
/// is INVALID_HANDLE, `src` NULL_POINTER. Errors: INVALID_ARGUMENT for 0 bytes
/// or a range that overflows; device errors for a bad `dst`. Threading: safe
/// from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_memcpy_htod(dev: *mut EpmDevice, dst: EpmDevicePtr, src: *const c_void, bytes: usize) -> EpmStatus {
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
/// an event after it and wait for that); page-locked memory copies fastest.
/// NULL: handles INVALID_HANDLE, `src` NULL_POINTER. Errors: INVALID_ARGUMENT
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
/// `dst` must stay writable and untouched until the copy completes. Errors
/// and NULL as `epm_memcpy_htod_async`. Threading: safe from any thread.
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

/// Queue a kernel that writes the 64-bit checksum of device bytes
/// `[ptr, ptr+bytes)` to the 8 device bytes at `out_dev_ptr`; the same value
/// `epm_checksum_host` computes on a host copy. `bytes` is a positive multiple of 4.
///
/// Errors: INVALID_ARGUMENT for a bad size or a stream of another device;
/// device errors for bad addresses. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_device_checksum_async(
    dev: *mut EpmDevice,
    ptr: EpmDevicePtr,
    bytes: usize,
    stream: *mut EpmStream,
    out_dev_ptr: EpmDevicePtr,
) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let stream = try_handle!(stream);
        same_device(&dev, stream.device(), "dev and stream")?;
        device_range(ptr, bytes, "ptr")?;
        ensure!(bytes.is_multiple_of(4), InvalidArgument, "checksum of {bytes} bytes: not a multiple of 4");
        device_range(out_dev_ptr, 8, "out_dev_ptr")?;
        dev.checksum_async(ptr, bytes, out_dev_ptr, stream.raw())
    }
}

/// The checksum `epm_device_checksum_async` computes, on host memory: the
/// wrapping sum over little-endian u32 words `w[i]` of `w[i] * (2*i + 1)`.
/// Trailing bytes beyond a multiple of 4 are ignored.
///
/// Returns 0 for NULL `data` or 0 bytes. Never fails; thread-safe; does not
/// change the last error.
#[unsafe(no_mangle)]
pub extern "C" fn epm_checksum_host(data: *const c_void, bytes: usize) -> u64 {
    ffi_boundary! { -> u64 {
        if data.is_null() || bytes == 0 || bytes > isize::MAX as usize {
            return 0;
        }
        // SAFETY: non-NULL, and the caller promises `bytes` readable bytes
        // that nobody writes during the call.
        let s = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), bytes) };
        checksum_host(s)
    }}
}

/// Queue a kernel that keeps `stream` busy for about `micros` microseconds:
/// stand-in "compute" for demos and overlap tests.
///
/// Errors: INVALID_ARGUMENT for a stream of another device. Threading: safe
/// from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_device_spin_async(dev: *mut EpmDevice, micros: u32, stream: *mut EpmStream) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let stream = try_handle!(stream);
        same_device(&dev, stream.device(), "dev and stream")?;
        dev.spin_async(micros, stream.raw())
    }
}

/// A gate a stream is held on (`epm_device_hold_async`): test machinery,
/// next to `epm_device_spin_async`.
pub struct EpmGate {
    _opaque: [u8; 0],
}
impl_handle!(EpmGate => crate::device::Gate, tag = 0x04);

/// Hold `stream`: work queued on it after this call runs only once the gate
/// returned in `*out` is opened (`epm_gate_open`) or destroyed. For tests
/// that must check something before queued work runs, ordered by an event
/// they control instead of a spin of N ms; on CUDA the hold is a host
/// function (cuLaunchHostFunc) that blocks the stream until opened.
///
/// Ownership: `*out` is a new handle the caller destroys with
/// `epm_gate_destroy`, which opens the gate first: a stream is never held
/// past its gate's handle. NULL: `dev`/`stream` are INVALID_HANDLE, `out` is
/// NULL_POINTER. Errors: INVALID_ARGUMENT for a stream of another device.
/// Threading: safe from any thread; the gate may be opened from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_device_hold_async(dev: *mut EpmDevice, stream: *mut EpmStream, out: *mut *mut EpmGate) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let stream = try_handle!(stream);
        let out = try_out!(out);
        same_device(&dev, stream.device(), "dev and stream")?;
        let gate = std::sync::Arc::new(crate::device::Gate::new());
        dev.hold_async(stream.raw(), &gate)?;
        out.set(handle::register::<EpmGate>(gate)?);
        Ok(())
    }
}

/// Open a gate: the streams held on it run on. Idempotent.
///
/// NULL: INVALID_HANDLE. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_gate_open(gate: *mut EpmGate) -> EpmStatus {
    ffi_boundary! {
        try_handle!(gate).open();
        Ok(())
    }
}

/// Destroy a gate handle, opening the gate if it is still closed.
///
/// NULL is a no-op returning OK. Errors: INVALID_HANDLE for a destroyed,
/// wrong-typed or garbage handle. Threading: safe from any thread; the
/// handle must not be used after this call.
#[unsafe(no_mangle)]
pub extern "C" fn epm_gate_destroy(gate: *mut EpmGate) -> EpmStatus {
    ffi_boundary! { handle::destroy(gate) }
}
