//! Registering a pageable host range once (cuMemHostRegister, read-only), so
//! copies from it go straight to the device with no staging and no fill.
//!
//! Cost and payoff on the H200: registering takes ~2 ms per 32 MiB and
//! 39–45 ms per GiB (~25 GB/s, about two copies' worth); DMA from the
//! registered range then runs at the pinned peak, 55 GB/s, instead of the
//! ~35 GB/s a staged copy from pageable memory can reach.

use std::sync::Arc;

use super::{Device, HostRange};
use crate::error::Result;

/// A host range registered read-only with the device, unregistered on drop.
pub struct HostRegistration {
    dev: Arc<dyn Device>,
    range: HostRange,
}

impl std::fmt::Debug for HostRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostRegistration").field("ptr", &self.range.ptr()).field("len", &self.range.len()).finish()
    }
}

impl HostRegistration {
    /// Page-lock `range` for read-only device access. Fails (status from the
    /// device) if it overlaps memory that is already page-locked, or when the
    /// locked-memory limit refuses it — the caller then stages instead.
    pub fn new(dev: &Arc<dyn Device>, range: HostRange) -> Result<Self> {
        crate::ensure!(!range.is_empty(), InvalidArgument, "registering an empty host range");
        // SAFETY: HostRange's creator vouched `[ptr, ptr+len)` stays readable
        // while it is used; the registration is a use and ends in `drop`.
        // Read-only: the device never writes through it, so the `*mut` cast
        // does not license a write to memory promised only readable.
        unsafe { dev.host_register(range.ptr() as *mut u8, range.len(), true)? };
        Ok(Self { dev: dev.clone(), range })
    }

    /// The registered range.
    pub fn range(&self) -> HostRange {
        self.range
    }
}

impl Drop for HostRegistration {
    /// Unregistering under a running copy is undefined behaviour on CUDA, and
    /// this object cannot know which streams still read the range, so it
    /// waits for the whole device first. Unregistration is a teardown-time
    /// event (once per weight file), so the full synchronize is affordable.
    fn drop(&mut self) {
        if let Err(e) = self.dev.synchronize() {
            log::error!("epmem: not unregistering host range {:p} (device synchronize failed: {e})", self.range.ptr());
            return;
        }
        // SAFETY: `ptr` is the start of the range registered in `new`, and
        // the device is idle, so no queued copy reads it.
        let r = unsafe { self.dev.host_unregister(self.range.ptr() as *mut u8) };
        super::objects::log_drop_error("host_unregister", r);
    }
}
