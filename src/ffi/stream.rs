//! `EpmStream`: an ordered queue of device work.

use crate::device::Stream;
use crate::ffi::device::EpmDevice;
use crate::ffi::event::EpmEvent;
use crate::ffi::prelude::*;

/// A stream: work queued on it runs in order. Keeps its device alive.
pub struct EpmStream {
    _opaque: [u8; 0],
}
impl_handle!(EpmStream => Stream, tag = 0x02);

/// Check that an object made on `a` may be used with one made on `b`.
pub(crate) fn same_device(
    a: &Arc<dyn crate::device::Device>,
    b: &Arc<dyn crate::device::Device>,
    what: &str,
) -> Result<()> {
    ensure!(Arc::ptr_eq(a, b), InvalidArgument, "{what} belong to different devices");
    Ok(())
}

/// Create a stream on `dev` (non-blocking with respect to other streams).
///
/// Ownership: `*out` is a new handle the caller destroys with
/// `epm_stream_destroy`. NULL: `dev` is INVALID_HANDLE, `out` is NULL_POINTER.
/// Errors: device errors. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_stream_create(dev: *mut EpmDevice, out: *mut *mut EpmStream) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let out = try_out!(out);
        let s = Stream::new(&dev)?;
        out.set(handle::insert::<EpmStream>(Arc::new(s))?);
        Ok(())
    }
}

/// Adopt a stream the host created itself (a `CUstream`, passed as `void*`)
/// so epmem can order its work against the host's kernels.
///
/// Ownership: the host keeps owning `native` and must keep it alive until
/// `epm_stream_destroy` of `*out`, which only forgets it. The legacy default
/// stream (what a NULL `CUstream` means to the driver) is adopted by its
/// explicit name `CU_STREAM_LEGACY` (`(void*)0x1`), the per-thread default
/// stream by `CU_STREAM_PER_THREAD` (`(void*)0x2`). NULL: `native` is
/// NULL_POINTER (NULL reads as a missing argument, not as a stream). Errors:
/// UNSUPPORTED on the host device (it has no native streams). Threading:
/// safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_stream_wrap_native(
    dev: *mut EpmDevice,
    native: *mut c_void,
    out: *mut *mut EpmStream,
) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        check_not_null!(native);
        let out = try_out!(out);
        let s = Stream::wrap_native(&dev, native.expose_provenance() as u64)?;
        out.set(handle::insert::<EpmStream>(Arc::new(s))?);
        Ok(())
    }
}

/// The native handle of a stream (`CUstream` on CUDA; NULL on the host
/// device), for launching the host's own kernels on it.
///
/// The native stream belongs to the `EpmStream` (or to the host, if adopted):
/// do not destroy it. `*out` is written only on success. NULL: `stream` is
/// INVALID_HANDLE, `out` is NULL_POINTER. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_stream_native(stream: *mut EpmStream, out: *mut *mut c_void) -> EpmStatus {
    ffi_boundary! {
        let stream = try_handle!(stream);
        let out = try_out!(out);
        let native = stream.native()?;
        out.set(std::ptr::with_exposed_provenance_mut(native as usize));
        Ok(())
    }
}

/// Block the calling thread until all work queued on `stream` has completed.
///
/// NULL: `stream` is INVALID_HANDLE. Errors: device errors, including a
/// failed copy queued earlier. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_stream_synchronize(stream: *mut EpmStream) -> EpmStatus {
    ffi_boundary! {
        let stream = try_handle!(stream);
        stream.synchronize()
    }
}

/// Make work queued on `stream` after this call wait until the work captured
/// by `event` (its last `epm_event_record`) has completed. The calling thread
/// does not wait.
///
/// NULL: either handle is INVALID_HANDLE. Errors: INVALID_ARGUMENT if they
/// belong to different devices. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_stream_wait_event(stream: *mut EpmStream, event: *mut EpmEvent) -> EpmStatus {
    ffi_boundary! {
        let stream = try_handle!(stream);
        let event = try_handle!(event);
        same_device(stream.device(), event.device(), "stream and event")?;
        stream.wait_event(&event)
    }
}

/// Destroy a stream handle. Work already queued still completes; an adopted
/// native stream is only forgotten.
///
/// NULL is a no-op returning OK. Errors: INVALID_HANDLE for a destroyed,
/// wrong-typed or garbage handle. Threading: safe from any thread; the handle
/// must not be used after this call.
#[unsafe(no_mangle)]
pub extern "C" fn epm_stream_destroy(stream: *mut EpmStream) -> EpmStatus {
    ffi_boundary! { handle::destroy(stream) }
}
