//! Host memory (pinned allocations, registered ranges), plain device memory,
//! and the asynchronous copies between them.

use std::collections::BTreeMap;
use std::ffi::{c_uint, c_void};

use cudarc::driver::sys;

use super::driver::host_oom;
use super::{CudaDevice, bump, lock};
use crate::device::portable;
use crate::device::{DeviceKind, DevicePtr, LiveCounts, RawStream};
use crate::error::{EpmStatus, Error, Result};

/// Page-locked host ranges we own: start address → length (and, for
/// registrations, whether the caller declared the device only reads it).
#[derive(Debug, Default)]
pub(super) struct HostTables {
    pub(super) pinned: BTreeMap<usize, usize>,
    pub(super) registered: BTreeMap<usize, (usize, bool)>,
}

/// The range in `map` (start → len) that holds `[p, p+len)`, if any.
fn containing<V>(map: &BTreeMap<usize, V>, p: usize, len: usize, size: impl Fn(&V) -> usize) -> Option<usize> {
    let (&start, v) = map.range(..=p).next_back()?;
    let end = start.checked_add(size(v))?;
    (p.checked_add(len)? <= end).then_some(start)
}

/// Whether `[p, p+len)` overlaps any range in `map`.
fn overlaps<V>(map: &BTreeMap<usize, V>, p: usize, len: usize, size: impl Fn(&V) -> usize) -> bool {
    let end = p.saturating_add(len);
    map.range(..end).next_back().is_some_and(|(&s, v)| s.saturating_add(size(v)) > p)
}

impl HostTables {
    pub(super) fn is_page_locked(&self, p: usize, len: usize) -> bool {
        p != 0
            && (containing(&self.pinned, p, len, |&l| l).is_some()
                || containing(&self.registered, p, len, |&(l, _)| l).is_some())
    }
    fn overlaps_any(&self, p: usize, len: usize) -> bool {
        overlaps(&self.pinned, p, len, |&l| l) || overlaps(&self.registered, p, len, |&(l, _)| l)
    }
    /// Whether `[p, p+len)` overlaps a range registered read-only.
    fn overlaps_read_only(&self, p: usize, len: usize) -> bool {
        let end = p.saturating_add(len);
        // Registrations never overlap, so walking back from `end` can stop at
        // the first one that ends at or before `p`.
        self.registered.range(..end).rev().take_while(|(s, v)| **s + v.0 > p).any(|(_, v)| v.1)
    }
}

impl CudaDevice {
    pub(super) fn host_live_counts(&self, c: &mut LiveCounts) {
        let h = lock(&self.host);
        c.pinned_buffers = h.pinned.len() as u64;
        c.pinned_bytes = h.pinned.values().map(|&l| l as u64).sum();
        c.host_registrations = h.registered.len() as u64;
    }

    pub(super) fn cu_pinned_alloc(&self, bytes: usize) -> Result<*mut u8> {
        crate::ensure!(bytes > 0, InvalidArgument, "pinned allocation of 0 bytes");
        let _g = self.enter()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        bump(&self.counts.pinned_alloc);
        // Flags 0: cached, not write-combined. Write-combined memory makes CPU
        // reads and memcpy into it slow, and staging fills it with memcpy.
        // SAFETY: valid out-pointer; our context is current.
        unsafe { cu!(cuMemHostAlloc(&mut p, bytes, 0)) }.map_err(host_oom)?;
        lock(&self.host).pinned.insert(p as usize, bytes);
        Ok(p.cast())
    }

    /// # Safety
    /// See [`crate::device::Device::pinned_free`].
    pub(super) unsafe fn cu_pinned_free(&self, p: *mut u8) -> Result<()> {
        let _g = self.enter()?;
        // Claim the entry first (a second free of `p` is then an error, not a
        // double free) and call without holding the table lock.
        let len = lock(&self.host)
            .pinned
            .remove(&(p as usize))
            .ok_or_else(|| Error::invalid_argument(format!("{p:?} is not a pinned allocation of this device")))?;
        bump(&self.counts.pinned_free);
        // SAFETY: `p` came from cuMemHostAlloc (it was in our table) and the
        // caller guarantees no queued copy uses it.
        let r = unsafe { cu!(cuMemFreeHost(p.cast())) };
        if r.is_err() {
            lock(&self.host).pinned.insert(p as usize, len);
        }
        r
    }

    /// # Safety
    /// See [`crate::device::Device::host_register`].
    /// `portable`: [`crate::device::Device::host_register_portable`].
    pub(super) unsafe fn cu_host_register(
        &self,
        p: *mut u8,
        len: usize,
        read_only: bool,
        portable: bool,
    ) -> Result<()> {
        crate::ensure!(!p.is_null(), NullPointer, "host_register of a NULL pointer");
        crate::ensure!(len > 0, InvalidArgument, "host_register of 0 bytes");
        crate::ensure!(
            !lock(&self.host).overlaps_any(p as usize, len),
            InvalidState,
            "[{p:?}, +{len}) overlaps memory that is already page-locked by this device"
        );
        // Another device's portable registration already pins these bytes for
        // every context: registering them again would be refused by the
        // driver (HOST_MEMORY_ALREADY_REGISTERED); say why instead.
        crate::ensure!(
            !portable::overlaps(DeviceKind::Cuda, p as usize, len),
            InvalidState,
            "[{p:?}, +{len}) overlaps a portable registration made through another CUDA device"
        );
        // Registering 1 GiB takes ~40 ms: the table lock is not held meanwhile.
        // Two racing overlapping registrations are still refused, by the driver.
        let _g = self.enter()?;
        let want_ro = read_only && self.read_only_register;
        let base = if portable { sys::CU_MEMHOSTREGISTER_PORTABLE as c_uint } else { 0 };
        let flags = if want_ro { base | sys::CU_MEMHOSTREGISTER_READ_ONLY as c_uint } else { base };
        bump(&self.counts.host_register);
        // SAFETY: the caller guarantees `[p, p+len)` is mapped host memory for
        // as long as it stays registered.
        let mut r = unsafe { sys::cuMemHostRegister_v2(p.cast(), len, flags) };
        if want_ro && matches!(r, sys::CUresult::CUDA_ERROR_NOT_SUPPORTED | sys::CUresult::CUDA_ERROR_INVALID_VALUE) {
            log::info!(
                "epmem: cuMemHostRegister refused READ_ONLY for [{p:?}, +{len}) ({r:?}); registering read-write"
            );
            bump(&self.counts.host_register);
            // SAFETY: as above.
            r = unsafe { sys::cuMemHostRegister_v2(p.cast(), len, base) };
        }
        super::driver::check("cuMemHostRegister_v2", r).map_err(host_oom)?;
        if portable
            && let Err(e) = portable::insert(DeviceKind::Cuda, self.info.ordinal.into(), p as usize, len, read_only)
        {
            // Lost a race with another device's portable registration of the
            // same bytes (the driver allowed it from another context).
            // SAFETY: just registered by us; nothing has queued a copy yet.
            let _ = unsafe { cu!(cuMemHostUnregister(p.cast())) };
            return Err(e);
        }
        // Remember what the caller declared, not what the driver granted: a
        // D2H into it breaks the declaration either way and is refused.
        lock(&self.host).registered.insert(p as usize, (len, read_only));
        Ok(())
    }

    /// # Safety
    /// See [`crate::device::Device::host_unregister`].
    pub(super) unsafe fn cu_host_unregister(&self, p: *mut u8) -> Result<()> {
        let _g = self.enter()?;
        let entry = lock(&self.host).registered.remove(&(p as usize)).ok_or_else(|| {
            Error::invalid_argument(format!("{p:?} is not the start of a range registered with this device"))
        })?;
        // SAFETY: `p` starts a range we registered; the caller guarantees no
        // queued copy uses it.
        let r = unsafe { cu!(cuMemHostUnregister(p.cast())) };
        if r.is_err() {
            lock(&self.host).registered.insert(p as usize, entry);
        } else {
            portable::remove(DeviceKind::Cuda, self.info.ordinal.into(), p as usize);
        }
        r
    }

    pub(super) fn cu_mem_alloc(&self, bytes: usize) -> Result<DevicePtr> {
        crate::ensure!(bytes > 0, InvalidArgument, "device allocation of 0 bytes");
        let _g = self.enter()?;
        let mut p: sys::CUdeviceptr = 0;
        bump(&self.counts.device_alloc);
        // SAFETY: valid out-pointer; our context is current.
        unsafe { cu!(cuMemAlloc_v2(&mut p, bytes)) }?;
        lock(&self.device_mem).insert(p, bytes);
        Ok(p)
    }

    pub(super) fn cu_mem_free(&self, p: DevicePtr) -> Result<()> {
        let _g = self.enter()?;
        let len = lock(&self.device_mem)
            .remove(&p)
            .ok_or_else(|| Error::invalid_argument(format!("{p:#x} is not a device allocation of this device")))?;
        bump(&self.counts.device_free);
        // SAFETY: `p` came from cuMemAlloc (it was in our table); the caller
        // promises no queued work uses it.
        let r = unsafe { cu!(cuMemFree_v2(p)) };
        if r.is_err() {
            lock(&self.device_mem).insert(p, len);
        }
        r
    }

    /// Check the host side of a copy: a D2H destination registered read-only
    /// is refused (the caller declared the device only reads it), and a
    /// "host" pointer that is really one of our device addresses (UVA makes
    /// them look alike) is checked like the device range it is.
    fn check_host_side(&self, what: &str, p: usize, n: usize, write: bool) -> Result<()> {
        crate::ensure!(
            !(write
                && (lock(&self.host).overlaps_read_only(p, n) || portable::overlaps_read_only(DeviceKind::Cuda, p, n))),
            AccessDenied,
            "{what} [{p:#x}, +{n}) is host memory registered read-only"
        );
        let end = p.saturating_add(n) as u64;
        let in_alloc = lock(&self.device_mem).range(..end).next_back().is_some_and(|(&s, &l)| s + l as u64 > p as u64);
        if in_alloc || self.vmm_touches(p as u64, n) {
            self.check_device_range(what, p as u64, n, write)?;
        }
        Ok(())
    }

    /// Refuse a device range that is not usable memory, before the driver
    /// sees it: a copy engine or kernel (memset, D2D and the checksum may run
    /// as kernels) touching a bad address can fault, and GPU faults are
    /// sticky. Ours are judged by our tables; for memory we did not allocate
    /// (the host's own) the driver says which allocation holds the start.
    /// Our context must be current.
    pub(super) fn check_device_range(&self, what: &str, p: DevicePtr, n: usize, write: bool) -> Result<()> {
        if n == 0 || self.vmm_allows(p, n, write)? {
            return Ok(());
        }
        let Some(end) = p.checked_add(n as u64) else {
            return Err(bad_range(what, p, n));
        };
        let ours = lock(&self.device_mem).range(..=p).next_back().map(|(&s, &l)| (s, s + l as u64));
        if let Some((_, alloc_end)) = ours.filter(|&(_, e)| p < e) {
            return if end <= alloc_end { Ok(()) } else { Err(bad_range(what, p, n)) };
        }
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: valid out-pointers; the driver only looks the address up.
        unsafe { cu!(cuMemGetAddressRange_v2(&mut base, &mut size, p)) }
            .map_err(|e| bad_range(what, p, n).context(e.message()))?;
        if end > base + size as u64 {
            return Err(bad_range(what, p, n));
        }
        Ok(())
    }

    /// # Safety
    /// See [`crate::device::Device::memcpy_htod_async`].
    pub(super) unsafe fn cu_memcpy_htod(&self, dst: DevicePtr, src: *const u8, n: usize, s: RawStream) -> Result<()> {
        let stream = self.stream(s)?;
        if n == 0 {
            return Ok(());
        }
        crate::ensure!(!src.is_null(), NullPointer, "host → device copy from a NULL host pointer");
        let _g = self.enter()?;
        self.check_host_side("copy source", src as usize, n, false)?;
        self.check_device_range("copy destination", dst, n, true)?;
        // SAFETY: the caller keeps `[src, src+n)` readable until the copy
        // completes; the device range was checked above.
        unsafe { cu!(cuMemcpyHtoDAsync_v2(dst, src.cast(), n, stream.0)) }
    }

    /// # Safety
    /// See [`crate::device::Device::memcpy_dtoh_async`].
    pub(super) unsafe fn cu_memcpy_dtoh(&self, dst: *mut u8, src: DevicePtr, n: usize, s: RawStream) -> Result<()> {
        let stream = self.stream(s)?;
        if n == 0 {
            return Ok(());
        }
        crate::ensure!(!dst.is_null(), NullPointer, "device → host copy into a NULL host pointer");
        let _g = self.enter()?;
        self.check_host_side("copy destination", dst as usize, n, true)?;
        self.check_device_range("copy source", src, n, false)?;
        // SAFETY: the caller keeps `[dst, dst+n)` writable and untouched until
        // the copy completes; the device range was checked above.
        unsafe { cu!(cuMemcpyDtoHAsync_v2(dst.cast(), src, n, stream.0)) }
    }

    pub(super) fn cu_memcpy_dtod(&self, dst: DevicePtr, src: DevicePtr, n: usize, s: RawStream) -> Result<()> {
        let stream = self.stream(s)?;
        if n == 0 {
            return Ok(());
        }
        let _g = self.enter()?;
        self.check_device_range("copy source", src, n, false)?;
        self.check_device_range("copy destination", dst, n, true)?;
        // SAFETY: device ranges checked above.
        unsafe { cu!(cuMemcpyDtoDAsync_v2(dst, src, n, stream.0)) }
    }

    pub(super) fn cu_memset_d8(&self, dst: DevicePtr, value: u8, n: usize, s: RawStream) -> Result<()> {
        let stream = self.stream(s)?;
        if n == 0 {
            return Ok(());
        }
        let _g = self.enter()?;
        self.check_device_range("memset destination", dst, n, true)?;
        // SAFETY: a device range checked above.
        unsafe { cu!(cuMemsetD8Async(dst, value, n, stream.0)) }
    }
}

/// Status for a device range we know is not usable (kept here so messages agree).
pub(super) fn bad_range(what: &str, p: DevicePtr, n: usize) -> Error {
    Error::new(EpmStatus::InvalidArgument, format!("{what} [{p:#x}, +{n}) is not device memory this device can use"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_locked_lookup_is_exact() {
        let mut t = HostTables::default();
        t.pinned.insert(0x1000, 0x100);
        t.registered.insert(0x8000, (0x2000, true));
        assert!(t.is_page_locked(0x1000, 0x100));
        assert!(t.is_page_locked(0x1080, 0x10));
        assert!(!t.is_page_locked(0x1080, 0x81), "runs past the end");
        assert!(!t.is_page_locked(0xfff, 2), "starts before");
        assert!(t.is_page_locked(0x9fff, 1));
        assert!(!t.is_page_locked(0xa000, 1));
        assert!(!t.is_page_locked(0, 0));
        assert!(!t.is_page_locked(usize::MAX, 2), "overflow is not a hit");
    }

    #[test]
    fn overlap_detects_every_touching_case() {
        let mut t = HostTables::default();
        t.registered.insert(0x8000, (0x1000, false));
        t.registered.insert(0x20000, (0x1000, true));
        assert!(!t.overlaps_read_only(0x8000, 0x1000));
        assert!(t.overlaps_read_only(0x1ffff, 2));
        assert!(t.overlaps_read_only(0x8000, 0x20000));
        assert!(!t.overlaps_read_only(0x21000, 0x10));
        assert!(t.overlaps_any(0x7fff, 2));
        assert!(t.overlaps_any(0x8fff, 10));
        assert!(t.overlaps_any(0x7000, 0x3000));
        assert!(!t.overlaps_any(0x7000, 0x1000));
        assert!(!t.overlaps_any(0x9000, 0x1000));
    }
}
