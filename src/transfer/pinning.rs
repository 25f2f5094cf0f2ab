//! Registering a pageable host range once (cuMemHostRegister, read-only), so
//! copies from it go straight to the device with no staging and no fill.
//!
//! Cost and payoff on the H200: registering takes ~2 ms per 32 MiB and
//! 39–45 ms per GiB (~25 GB/s, about two copies' worth); DMA from the
//! registered range then runs at the pinned peak, 55 GB/s, instead of the
//! ~35 GB/s a staged copy from pageable memory can reach.

use std::sync::Arc;

use crate::device::{Device, HostRange};
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
        crate::device::objects::log_drop_error("host_unregister", r);
    }
}

// ---- one registration shared by several devices -------------------------

/// One host range page-locked once (portable, read-only) and shared by the
/// residency managers of several devices of the same kind. It holds a
/// refcount: this handle and every [`Attachment`] keep the registration; the
/// bytes are unregistered when the last of them is dropped.
///
/// Counting: the registering device's `live_counts().host_registrations` and
/// `driver_counts().host_register_calls` go up by one; every other device's
/// stay unchanged however many managers attach — that is the "no second
/// registration" evidence. A manager that attaches adds the bytes to its
/// `attached_bytes`, not to its `registered_bytes`.
#[derive(Clone)]
pub struct SharedHostRegistration {
    inner: Arc<SharedInner>,
}

struct SharedInner {
    owner: Arc<dyn Device>,
    range: HostRange,
    /// Attachments made so far (every manager, every device).
    attaches: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for SharedHostRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedHostRegistration")
            .field("ptr", &self.inner.range.ptr())
            .field("len", &self.inner.range.len())
            .field("owner", &self.inner.owner.info().ordinal)
            .finish()
    }
}

impl SharedHostRegistration {
    /// Page-lock `range` once, through `dev`, for read-only access by every
    /// device of `dev`'s kind. Fails like [`HostRegistration::new`], and also
    /// when a device of that kind has already page-locked any of the bytes.
    pub fn new(dev: &Arc<dyn Device>, range: HostRange) -> Result<Self> {
        crate::ensure!(!range.is_empty(), InvalidArgument, "registering an empty host range");
        // SAFETY: as in `HostRegistration::new`: the creator of `range`
        // vouched it stays readable while used; the registration ends in
        // `SharedInner::drop`. Read-only: no device writes through it.
        unsafe { dev.host_register_portable(range.ptr() as *mut u8, range.len(), true)? };
        Ok(Self { inner: Arc::new(SharedInner { owner: dev.clone(), range, attaches: 0.into() }) })
    }

    pub fn range(&self) -> HostRange {
        self.inner.range
    }
    /// The device that made the registration.
    pub fn owner(&self) -> &Arc<dyn Device> {
        &self.inner.owner
    }
    /// Live holders: this handle's clones plus live attachments.
    pub fn holders(&self) -> usize {
        Arc::strong_count(&self.inner)
    }
    /// Attachments ever made.
    pub fn attaches(&self) -> u64 {
        self.inner.attaches.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Let `dev` use the registration (a device of the owner's kind; the
    /// owner itself included). The attachment keeps the bytes registered.
    pub fn attach(&self, dev: &Arc<dyn Device>) -> Result<Attachment> {
        let (k, o) = (dev.info().kind, self.inner.owner.info().kind);
        crate::ensure!(
            k == o,
            InvalidArgument,
            "a registration made through a {} device cannot feed a {} device",
            o.name(),
            k.name()
        );
        crate::ensure!(
            dev.host_is_page_locked(self.inner.range.ptr(), self.inner.range.len()),
            InvalidState,
            "{} device {} does not see the shared registration as page-locked",
            k.name(),
            dev.info().ordinal
        );
        self.inner.attaches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Attachment { reg: self.clone(), dev: dev.clone() })
    }
}

impl Drop for SharedInner {
    /// The last holder is gone: every attachment has synchronized its own
    /// device on the way out, so only the owner's queue can still read it.
    fn drop(&mut self) {
        if let Err(e) = self.owner.synchronize() {
            log::error!(
                "epmem: not unregistering shared host range {:p} (device synchronize failed: {e})",
                self.range.ptr()
            );
            return;
        }
        // SAFETY: the start of the range registered in `new`; no device that
        // attached has a queued copy left (each synchronized when detaching)
        // and the owner is idle.
        let r = unsafe { self.owner.host_unregister(self.range.ptr() as *mut u8) };
        crate::device::objects::log_drop_error("host_unregister", r);
    }
}

/// One device's use of a [`SharedHostRegistration`]; dropping it waits for
/// that device (a queued copy may still read the range) and releases one
/// reference.
#[derive(Debug)]
pub struct Attachment {
    reg: SharedHostRegistration,
    dev: Arc<dyn Device>,
}

impl Attachment {
    pub fn range(&self) -> HostRange {
        self.reg.range()
    }
    pub fn registration(&self) -> &SharedHostRegistration {
        &self.reg
    }
}

impl Drop for Attachment {
    fn drop(&mut self) {
        if let Err(e) = self.dev.synchronize() {
            // Keep the bytes registered for good rather than unregister under a copy.
            log::error!("epmem: leaking a shared host registration (device synchronize failed: {e})");
            std::mem::forget(self.reg.clone());
        }
    }
}
