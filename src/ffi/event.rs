//! `EpmEvent`: a marker in a stream that other streams and the host can wait on.

use crate::device::Event;
use crate::ffi::device::EpmDevice;
use crate::ffi::prelude::*;
use crate::ffi::stream::{EpmStream, same_device};

/// An event: captures the work queued on a stream when it is recorded.
/// Keeps its device alive.
pub struct EpmEvent {
    _opaque: [u8; 0],
}
impl_handle!(EpmEvent => Event, tag = 0x03);

/// `epm_event_create` flag: the event can be used with `epm_event_elapsed_ms`.
pub const EPM_EVENT_TIMING: u32 = 1;

/// Create an event on `dev`. `flags` is 0 or `EPM_EVENT_TIMING`. An event
/// never recorded counts as completed.
///
/// Ownership: `*out` is a new handle the caller destroys with
/// `epm_event_destroy`. NULL: `dev` is INVALID_HANDLE, `out` is NULL_POINTER.
/// Errors: INVALID_ARGUMENT for unknown flag bits. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_event_create(dev: *mut EpmDevice, flags: u32, out: *mut *mut EpmEvent) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let out = try_out!(out);
        ensure!(flags & !EPM_EVENT_TIMING == 0, InvalidArgument, "unknown event flags {flags:#x}");
        let e = Event::new(&dev, flags & EPM_EVENT_TIMING != 0)?;
        out.set(handle::insert::<EpmEvent>(Arc::new(e))?);
        Ok(())
    }
}

/// Capture the work queued on `stream` so far; re-recording replaces the
/// previous capture.
///
/// NULL: either handle is INVALID_HANDLE. Errors: INVALID_ARGUMENT if they
/// belong to different devices. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_event_record(event: *mut EpmEvent, stream: *mut EpmStream) -> EpmStatus {
    ffi_boundary! {
        let event = try_handle!(event);
        let stream = try_handle!(stream);
        same_device(event.device(), stream.device(), "event and stream")?;
        event.record(&stream)
    }
}

/// Has the captured work completed? Never blocks.
///
/// Returns OK when it has (or the event was never recorded), NOT_READY when it
/// has not (the last error then says so; this is not a failure). NULL: `event`
/// is INVALID_HANDLE. Errors: device errors. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_event_query(event: *mut EpmEvent) -> EpmStatus {
    ffi_boundary! {
        let event = try_handle!(event);
        ensure!(event.query()?, NotReady, "the event's work has not completed yet");
        Ok(())
    }
}

/// Block the calling thread until the captured work has completed.
///
/// NULL: `event` is INVALID_HANDLE. Errors: device errors. Threading: safe
/// from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_event_synchronize(event: *mut EpmEvent) -> EpmStatus {
    ffi_boundary! {
        let event = try_handle!(event);
        event.synchronize()
    }
}

/// Milliseconds between the completions of `start` and `end`, both created
/// with `EPM_EVENT_TIMING` and recorded. Never blocks.
///
/// `*out_ms` is written only on success. NULL: handles are INVALID_HANDLE,
/// `out_ms` is NULL_POINTER. Errors: NOT_READY if either has not completed;
/// INVALID_ARGUMENT if they belong to different devices; device errors
/// (e.g. an event without timing). Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_event_elapsed_ms(start: *mut EpmEvent, end: *mut EpmEvent, out_ms: *mut f32) -> EpmStatus {
    ffi_boundary! {
        let start = try_handle!(start);
        let end = try_handle!(end);
        let out_ms = try_out!(out_ms);
        same_device(start.device(), end.device(), "start and end")?;
        out_ms.set(end.elapsed_since(&start)?);
        Ok(())
    }
}

/// Destroy an event handle.
///
/// NULL is a no-op returning OK. Errors: INVALID_HANDLE for a destroyed,
/// wrong-typed or garbage handle. Threading: safe from any thread; the handle
/// must not be used after this call.
#[unsafe(no_mangle)]
pub extern "C" fn epm_event_destroy(event: *mut EpmEvent) -> EpmStatus {
    ffi_boundary! { handle::destroy(event) }
}
