//! Dropping a [`CudaDevice`]: free what callers leaked, then release the
//! primary context. Never panics; every failure is logged.
//!
//! Safe objects ([`crate::device::Stream`], [`crate::device::PinnedBuffer`], …)
//! hold an `Arc` to the device, so they are all gone by now; what remains was
//! created through the raw trait and never freed. The primary context may
//! outlive us (the host's runtime retains it too), so leaks are freed
//! explicitly instead of trusting context destruction.

use super::{CudaDevice, lock};
use crate::device::{Device, LiveCounts};

impl CudaDevice {
    fn free_leftovers(&self, live: &LiveCounts) {
        // Waiting first means no queued copy or kernel still uses what is
        // freed below. It also waits for the host's own work in the shared
        // primary context, so it is skipped when there is nothing to free.
        let held = self.open_all_holds();
        if held || *live != LiveCounts::default() || lock(&self.kernels).is_some() || lock(&self.codec).is_some() {
            // SAFETY: no arguments; our context is current (caller holds the guard).
            if let Err(e) = unsafe { cu!(cuCtxSynchronize()) } {
                log::warn!("epmem: synchronizing cuda:{} at teardown: {e}", self.info.ordinal);
            }
        }
        self.free_all_holds();
        if let Some(k) = lock(&self.kernels).take() {
            // SAFETY: our module; no launch can be pending after the synchronize.
            log_err("cuModuleUnload", unsafe { cu!(cuModuleUnload(k.module.0)) });
        }
        if let Some(k) = lock(&self.codec).take() {
            // SAFETY: our module; no launch can be pending after the synchronize.
            log_err("cuModuleUnload", unsafe { cu!(cuModuleUnload(k.module.0)) });
        }
        for (_, e) in lock(&self.events).drain() {
            // SAFETY: our event, destroyed once (drained from the table).
            log_err("cuEventDestroy", unsafe { cu!(cuEventDestroy_v2(e.raw.0)) });
        }
        for (_, s) in lock(&self.streams).drain().filter(|(_, s)| s.owned) {
            // SAFETY: a stream we created, destroyed once; adopted ones are skipped.
            log_err("cuStreamDestroy", unsafe { cu!(cuStreamDestroy_v2(s.raw.0)) });
        }
        self.vmm_teardown();
        for (p, _) in std::mem::take(&mut *lock(&self.device_mem)) {
            // SAFETY: our allocation, freed once.
            log_err("cuMemFree", unsafe { cu!(cuMemFree_v2(p)) });
        }
        let host = std::mem::take(&mut *lock(&self.host));
        for (p, _) in host.registered {
            // SAFETY: a range we registered, unregistered once.
            log_err("cuMemHostUnregister", unsafe { cu!(cuMemHostUnregister(p as *mut _)) });
        }
        for (p, _) in host.pinned {
            // SAFETY: our pinned allocation, freed once.
            log_err("cuMemFreeHost", unsafe { cu!(cuMemFreeHost(p as *mut _)) });
        }
    }
}

fn log_err(what: &str, r: crate::error::Result<()>) {
    if let Err(e) = r {
        log::warn!("epmem: {what} at teardown: {e}");
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let live = self.live_counts();
        if live != LiveCounts::default() {
            log::warn!("epmem: cuda:{} dropped with live resources, freeing them: {live:?}", self.info.ordinal);
        }
        match self.enter() {
            Ok(_guard) => self.free_leftovers(&live),
            Err(e) => log::warn!("epmem: cuda:{} teardown cannot make its context current: {e}", self.info.ordinal),
        }
        // SAFETY: balances the cuDevicePrimaryCtxRetain in `new`; the guard
        // above has restored the caller's context.
        log_err("cuDevicePrimaryCtxRelease", unsafe { cu!(cuDevicePrimaryCtxRelease_v2(self.dev)) });
    }
}
