//! Test machinery for C: small kernels the C tests and benchmarks use as
//! stand-in work (a checksum, a spin) and hooks that make a call panic, so
//! tests can prove the panic boundary and handle poisoning.
//!
//! Compiled only with the `testing` cargo feature (`#[cfg]` on its `mod`
//! line), declared in include/epmem_testing.h (generated from this file
//! alone by tests/header.rs), and absent from the library and header that
//! `make install` ships. The C tests link target/testing/release/, built with
//! `--features testing` (see the Makefile).

use crate::device::checksum_host;
use crate::ffi::args::device_range;
use crate::ffi::device::EpmDevice;
use crate::ffi::handle;
use crate::ffi::kv::EpmKvPool;
use crate::ffi::memory::EpmDevicePtr;
use crate::ffi::prelude::*;
use crate::ffi::residency::EpmResidency;
use crate::ffi::stream::{EpmStream, same_device};

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

/// Panic inside a call that uses `dev`: returns EPM_STATUS_PANIC, and `dev`
/// is poisoned from then on (every later call with it is INVALID_STATE;
/// `epm_device_destroy` still works). Test-only.
///
/// NULL: `dev` is INVALID_HANDLE (nothing panics). Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_testing_panic_device(dev: *mut EpmDevice) -> EpmStatus {
    ffi_boundary! {
        let _dev = try_handle!(dev);
        panic!("epm_testing_panic_device: a panic on purpose")
    }
}

/// Panic inside a call that uses `res` (poisoning it, as
/// `epm_testing_panic_device`). Test-only.
///
/// NULL: `res` is INVALID_HANDLE. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_testing_panic_residency(res: *mut EpmResidency) -> EpmStatus {
    ffi_boundary! {
        let _res = try_handle!(res);
        panic!("epm_testing_panic_residency: a panic on purpose")
    }
}

/// Panic while holding the lock of `pool`'s books: the pool handle is
/// poisoned, and so is the pool itself, so its sequences and prefixes
/// answer INVALID_STATE too. Test-only.
///
/// NULL: `pool` is INVALID_HANDLE. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_testing_panic_kv_pool(pool: *mut EpmKvPool) -> EpmStatus {
    ffi_boundary! {
        let pool = try_handle!(pool);
        let _books = pool.lock()?;
        panic!("epm_testing_panic_kv_pool: a panic on purpose, holding the pool's lock")
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
/// they control instead of a spin of N ms; on CUDA the hold is a stream
/// memory wait (cuStreamWaitValue32) on a flag opening sets, so queries and
/// elapsed times on the held stream never block the host.
///
/// Ownership: `*out` is a new handle the caller destroys with
/// `epm_gate_destroy`, which opens the gate first: a stream is never held
/// past its gate's handle. NULL: `dev`/`stream` are INVALID_HANDLE, `out` is
/// NULL_POINTER. Errors: INVALID_ARGUMENT for a stream of another device;
/// UNSUPPORTED where the CUDA driver or GPU has no stream memory waits.
/// Threading: safe from any thread; the gate may be opened from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_device_hold_async(
    dev: *mut EpmDevice,
    stream: *mut EpmStream,
    out: *mut *mut EpmGate,
) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let stream = try_handle!(stream);
        let out = try_out!(out);
        same_device(&dev, stream.device(), "dev and stream")?;
        let gate = std::sync::Arc::new(crate::device::Gate::new());
        dev.hold_async(stream.raw(), &gate)?;
        out.set(handle::insert::<EpmGate>(gate)?);
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
