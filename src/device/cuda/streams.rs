//! Streams and events: tables of driver handles behind epmem ids.

use std::ffi::c_uint;

use cudarc::driver::sys;

use super::driver::Handle;
use super::{CudaDevice, lock};
use crate::device::{RawEvent, RawStream};
use crate::error::{EpmStatus, Error, Result};

#[derive(Debug, Clone, Copy)]
pub(super) struct StreamEntry {
    pub(super) raw: Handle<sys::CUstream>,
    /// False for a host stream adopted with `stream_wrap_native`: never destroyed by us.
    pub(super) owned: bool,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct EventEntry {
    pub(super) raw: Handle<sys::CUevent>,
    timing: bool,
    /// Recorded at least once (CUDA refuses elapsed time on a never-recorded event).
    recorded: bool,
}

impl CudaDevice {
    pub(super) fn stream(&self, s: RawStream) -> Result<Handle<sys::CUstream>> {
        lock(&self.streams).get(&s.0).map(|e| e.raw).ok_or_else(|| {
            Error::new(EpmStatus::InvalidHandle, format!("stream {} is not a live stream of this device", s.0))
        })
    }

    fn event(&self, e: RawEvent) -> Result<EventEntry> {
        lock(&self.events).get(&e.0).copied().ok_or_else(|| {
            Error::new(EpmStatus::InvalidHandle, format!("event {} is not a live event of this device", e.0))
        })
    }

    fn insert_stream(&self, raw: sys::CUstream, owned: bool) -> RawStream {
        let id = self.new_id();
        lock(&self.streams).insert(id, StreamEntry { raw: Handle(raw), owned });
        RawStream(id)
    }

    pub(super) fn cu_stream_create(&self) -> Result<RawStream> {
        let _g = self.enter()?;
        let mut s: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint;
        // SAFETY: valid out-pointer; our context is current.
        unsafe { cu!(cuStreamCreate(&mut s, flags)) }?;
        Ok(self.insert_stream(s, true))
    }

    pub(super) fn cu_stream_wrap_native(&self, native: u64) -> Result<RawStream> {
        let _g = self.enter()?;
        let s = native as usize as sys::CUstream;
        let mut owner: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `native` is the host's CUstream (0 and the legacy/per-thread
        // sentinels included); the driver only reads which context owns it.
        unsafe { cu!(cuStreamGetCtx(s, &mut owner)) }
            .map_err(|e| e.context(format!("adopting native stream {native:#x}")))?;
        crate::ensure!(
            owner == self.ctx.0,
            InvalidArgument,
            "native stream {native:#x} belongs to another CUDA context than cuda:{}'s primary context",
            self.info.ordinal
        );
        Ok(self.insert_stream(s, false))
    }

    pub(super) fn cu_stream_destroy(&self, s: RawStream) -> Result<()> {
        let entry = lock(&self.streams).remove(&s.0).ok_or_else(|| {
            Error::new(EpmStatus::InvalidHandle, format!("stream {} is not a live stream of this device", s.0))
        })?;
        if !entry.owned {
            return Ok(());
        }
        let _g = self.enter()?;
        // SAFETY: we created this stream and just removed it from the table,
        // so no other epmem call can reach it; queued work still completes.
        unsafe { cu!(cuStreamDestroy_v2(entry.raw.0)) }
    }

    pub(super) fn cu_stream_synchronize(&self, s: RawStream) -> Result<()> {
        let raw = self.stream(s)?;
        let _g = self.enter()?;
        // SAFETY: a live stream of our context.
        unsafe { cu!(cuStreamSynchronize(raw.0)) }
    }

    pub(super) fn cu_stream_wait_event(&self, s: RawStream, e: RawEvent) -> Result<()> {
        let (raw, ev) = (self.stream(s)?, self.event(e)?);
        let _g = self.enter()?;
        // SAFETY: a live stream and a live event of our context; flags must be 0.
        unsafe { cu!(cuStreamWaitEvent(raw.0, ev.raw.0, 0)) }
    }

    pub(super) fn cu_event_create(&self, timing: bool) -> Result<RawEvent> {
        let _g = self.enter()?;
        // Timing costs a timestamp per record; fences (most events) skip it.
        let flags =
            if timing { sys::CUevent_flags::CU_EVENT_DEFAULT } else { sys::CUevent_flags::CU_EVENT_DISABLE_TIMING };
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: valid out-pointer; our context is current.
        unsafe { cu!(cuEventCreate(&mut ev, flags as c_uint)) }?;
        let id = self.new_id();
        lock(&self.events).insert(id, EventEntry { raw: Handle(ev), timing, recorded: false });
        Ok(RawEvent(id))
    }

    pub(super) fn cu_event_destroy(&self, e: RawEvent) -> Result<()> {
        let entry = lock(&self.events).remove(&e.0).ok_or_else(|| {
            Error::new(EpmStatus::InvalidHandle, format!("event {} is not a live event of this device", e.0))
        })?;
        let _g = self.enter()?;
        // SAFETY: our event, removed from the table so no epmem call can reach it.
        unsafe { cu!(cuEventDestroy_v2(entry.raw.0)) }
    }

    pub(super) fn cu_event_record(&self, e: RawEvent, s: RawStream) -> Result<()> {
        let (ev, raw) = (self.event(e)?, self.stream(s)?);
        let _g = self.enter()?;
        // SAFETY: a live event and a live stream of our context.
        unsafe { cu!(cuEventRecord(ev.raw.0, raw.0)) }?;
        if let Some(entry) = lock(&self.events).get_mut(&e.0) {
            entry.recorded = true;
        }
        Ok(())
    }

    /// `Ok(true)` complete, `Ok(false)` pending; never blocks.
    fn query_raw(&self, ev: Handle<sys::CUevent>) -> Result<bool> {
        // SAFETY: a live event of our context (caller holds the context guard).
        let r = unsafe { sys::cuEventQuery(ev.0) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        super::driver::check("cuEventQuery", r)?;
        Ok(true)
    }

    pub(super) fn cu_event_query(&self, e: RawEvent) -> Result<bool> {
        let ev = self.event(e)?;
        let _g = self.enter()?;
        self.query_raw(ev.raw)
    }

    pub(super) fn cu_event_synchronize(&self, e: RawEvent) -> Result<()> {
        let ev = self.event(e)?;
        let _g = self.enter()?;
        // SAFETY: a live event of our context.
        unsafe { cu!(cuEventSynchronize(ev.raw.0)) }
    }

    pub(super) fn cu_event_elapsed_ms(&self, start: RawEvent, end: RawEvent) -> Result<f32> {
        let (a, b) = (self.event(start)?, self.event(end)?);
        crate::ensure!(
            a.timing && b.timing,
            InvalidArgument,
            "elapsed time needs two timing events (created with timing = true)"
        );
        crate::ensure!(a.recorded && b.recorded, InvalidState, "elapsed time needs two recorded events");
        let _g = self.enter()?;
        // cuEventElapsedTime on a pending event would fail, and callers on the
        // hot path must never wait: ask first, answer NotReady.
        if !self.query_raw(a.raw)? || !self.query_raw(b.raw)? {
            return Err(Error::not_ready("a timing event has not completed yet"));
        }
        let mut ms: f32 = 0.0;
        match elapsed_time_version() {
            // SAFETY: valid out-pointer; two completed timing events of our context.
            Some(2) => unsafe { cu!(cuEventElapsedTime_v2(&mut ms, a.raw.0, b.raw.0)) }?,
            // SAFETY: as above (drivers before 12.8 have only the first version).
            Some(_) => unsafe { cu!(cuEventElapsedTime(&mut ms, a.raw.0, b.raw.0)) }?,
            None => crate::bail!(Unsupported, "this CUDA driver exports no cuEventElapsedTime"),
        }
        Ok(ms)
    }
}

/// Which cuEventElapsedTime the driver has (2 from CUDA 12.8 on), looked up
/// once: cudarc panics when called through a missing symbol.
fn elapsed_time_version() -> Option<u8> {
    static V: std::sync::OnceLock<Option<u8>> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        if super::driver::has_symbol("cuEventElapsedTime_v2") {
            Some(2)
        } else if super::driver::has_symbol("cuEventElapsedTime") {
            Some(1)
        } else {
            None
        }
    })
}
