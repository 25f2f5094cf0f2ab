//! [`Device::hold_async`](crate::device::Device::hold_async) on CUDA: a
//! stream memory wait (`cuStreamWaitValue32`) for a 4-byte flag in mapped
//! pinned memory that opening the [`Gate`](crate::device::Gate) sets to 1.
//!
//! Why not a host function: one that blocks the stream also blocks
//! `cuEventQuery` and `cuEventElapsedTime` on the H200's driver, which is
//! exactly what the gated tests must observe as "pending". A memory wait is
//! done by the GPU's front end; the host's driver calls stay non-blocking.
//!
//! The flag's memory outlives the gate's handle: the stream may still be
//! waiting when the gate is dropped. Each hold keeps its flag and an event
//! recorded right after the wait; a flag is freed once its gate is open and
//! that event completed (checked, never waited for, at the next hold), or at
//! teardown after opening every gate and synchronizing the context.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;

use super::driver::Handle;
use super::{CudaDevice, lock};
use crate::device::RawStream;
use crate::device::gate::GateShared;
use crate::error::{EpmStatus, Error, Result};

/// The optional entry points of the hold (checked before the first call:
/// cudarc panics on a missing symbol).
const HOLD_SYMBOLS: &[&str] = &["cuStreamWaitValue32_v2", "cuMemHostGetDevicePointer_v2"];

/// One hold: its flag (host address of a cuMemHostAlloc'ed word) and the
/// event recorded behind the wait.
pub(super) struct HeldGate {
    gate: Arc<GateShared>,
    flag: usize,
    passed: Handle<sys::CUevent>,
}

impl CudaDevice {
    pub(super) fn cu_hold(&self, s: RawStream, gate: &crate::device::Gate) -> Result<()> {
        let stream = self.stream(s)?;
        if let Some(missing) = HOLD_SYMBOLS.iter().find(|n| !super::driver::has_symbol(n)) {
            return Err(Error::new(
                EpmStatus::Unsupported,
                format!("holding a stream needs stream memory operations; this libcuda lacks {missing}"),
            ));
        }
        let _g = self.enter()?;
        // Load the test kernels now, not behind the hold: loading a module
        // (PTX JIT, code memory) can wait for the device, so a spin queued
        // after the hold would block the host until the gate opened (seen on
        // the H200: query/elapsed "blocked until the watchdog opened the gate").
        if let Err(e) = self.kernels() {
            log::debug!("epmem: cuda:{} loading the built-in kernels before a hold: {e}", self.info.ordinal);
        }
        self.reclaim_holds();
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer, our context is current; freed in
        // `free_hold` once the wait has passed (or at once below on failure).
        unsafe { cu!(cuMemHostAlloc(&mut host, 4, sys::CU_MEMHOSTALLOC_DEVICEMAP)) }?;
        // SAFETY: a fresh allocation of 4 bytes, page-aligned; nothing else sees it yet.
        unsafe { host.cast::<u32>().write_volatile(0) };
        let mut dptr: sys::CUdeviceptr = 0;
        let mut passed: sys::CUevent = std::ptr::null_mut();
        // SAFETY: valid out-pointers; `host` is a mapped allocation of our
        // context; event flags 2 = CU_EVENT_DISABLE_TIMING.
        let made = unsafe { cu!(cuMemHostGetDevicePointer_v2(&mut dptr, host, 0)) }
            .and_then(|()| unsafe { cu!(cuEventCreate(&mut passed, 2)) });
        if let Err(e) = made {
            // SAFETY: our allocation, not attached or waited on: freed once.
            let _ = unsafe { cu!(cuMemFreeHost(host)) };
            return Err(e);
        }
        let entry = HeldGate { gate: gate.shared(), flag: host as usize, passed: Handle(passed) };
        // SAFETY: the word stays allocated until the gate is open (see
        // `reclaim_holds` and teardown, which opens every gate first).
        if !unsafe { entry.gate.attach(host.cast()) } {
            // Already open: nothing to wait for. Kept for the reclaim path
            // (its event was never recorded, so it reads as passed): freeing
            // it here could wait behind another stream's hold.
            lock(&self.gates).push(entry);
            return Ok(());
        }
        // From here the entry is kept whatever happens: the gate may write
        // the flag until it is open, so only the reclaim path frees it.
        // SAFETY: a live stream of our context and a device-mapped address;
        // flags 0 = CU_STREAM_WAIT_VALUE_GEQ.
        let waited = unsafe { sys::cuStreamWaitValue32_v2(stream.0, dptr, 1, 0) };
        let r = if waited == sys::CUresult::CUDA_ERROR_NOT_SUPPORTED {
            Err(Error::new(
                EpmStatus::Unsupported,
                format!(
                    "cuda:{} does not support stream memory waits (cuStreamWaitValue32): cannot hold a stream",
                    self.info.ordinal
                ),
            ))
        } else {
            // SAFETY: our event and stream; recorded behind the wait.
            super::driver::check("cuStreamWaitValue32_v2", waited)
                .and_then(|()| unsafe { cu!(cuEventRecord(passed, stream.0)) })
        };
        lock(&self.gates).push(entry);
        r
    }

    /// Free the flags of past holds once every hold's gate is open and its
    /// wait has passed; while any stream is still held, free nothing:
    /// cuMemFreeHost synchronizes the device, so it would block the host
    /// behind that hold. Never blocks. Caller holds the context guard.
    fn reclaim_holds(&self) {
        let done: Vec<HeldGate> = {
            let mut gates = lock(&self.gates);
            let all_passed = gates.iter().all(|h| {
                // SAFETY: our event (live until `free_hold`); the context is current.
                h.gate.is_open() && unsafe { sys::cuEventQuery(h.passed.0) } == sys::CUresult::CUDA_SUCCESS
            });
            if !all_passed {
                return;
            }
            std::mem::take(&mut *gates)
        };
        for h in done {
            self.free_hold(h);
        }
    }

    /// Destroy a hold's event and free its flag. Only for a hold whose gate
    /// is open and whose wait has passed (or was never queued).
    fn free_hold(&self, h: HeldGate) {
        // SAFETY: our event and allocation, freed once (`h` is consumed).
        if let Err(e) = unsafe { cu!(cuEventDestroy_v2(h.passed.0)) } {
            log::warn!("epmem: cuda:{} freeing a gate's event: {e}", self.info.ordinal);
        }
        // SAFETY: as above.
        if let Err(e) = unsafe { cu!(cuMemFreeHost(h.flag as *mut c_void)) } {
            log::warn!("epmem: cuda:{} freeing a gate's flag: {e}", self.info.ordinal);
        }
    }

    /// At teardown: open every gate still closed (so no wait is left and no
    /// gate writes a flag after it is freed), then, after the caller's
    /// context synchronize, free them all. Returns whether there were any.
    pub(super) fn open_all_holds(&self) -> bool {
        let gates = lock(&self.gates);
        for h in gates.iter() {
            h.gate.set_open();
        }
        !gates.is_empty()
    }

    /// After [`open_all_holds`](Self::open_all_holds) and a context synchronize.
    pub(super) fn free_all_holds(&self) {
        for h in std::mem::take(&mut *lock(&self.gates)) {
            self.free_hold(h);
        }
    }
}
