//! Live and driver counters, pinned and registered host memory, device info.

use std::sync::Arc;

use super::{assert_same, download, no_leaks, random_bytes};
use crate::device::{
    Access, Device, DeviceBuffer, DeviceKind, Event, LiveCounts, PhysMem, PinnedBuffer, Stream, VaRange,
};
use crate::error::{EpmStatus, Result};

/// Every object moves its live count by exactly one (and its bytes by its
/// size); every driver-level call moves its counter by exactly one; dropping
/// everything returns the live counts to where they started.
pub fn live_and_driver_counts_are_exact(dev: &Arc<dyn Device>) -> Result<()> {
    let g = dev.vmm_granularity();
    let l0 = dev.live_counts();
    let d0 = dev.driver_counts();
    let want = |f: &dyn Fn(&mut LiveCounts)| {
        let mut w = l0;
        f(&mut w);
        w
    };
    {
        let s = Stream::new(dev)?;
        let e = Event::new(dev, true)?;
        let p = PinnedBuffer::new(dev, 8192)?;
        let b = DeviceBuffer::new(dev, 1 << 20)?;
        let (ph, ph2) = (PhysMem::new(dev, g)?, PhysMem::new(dev, g)?);
        let mut r = VaRange::reserve(dev, 2 * g)?;
        r.map(0, g, &ph, 0, Access::ReadWrite)?;
        r.map(g, g, &ph2, 0, Access::ReadOnly)?;
        let all = |c: &mut LiveCounts| {
            c.streams += 1;
            c.events += 1;
            c.pinned_buffers += 1;
            c.pinned_bytes += 8192;
            c.device_allocations += 1;
            c.device_bytes += 1 << 20;
            c.physical_handles += 2;
            c.physical_bytes += 2 * g as u64;
            c.va_reservations += 1;
        };
        assert_eq!(
            dev.live_counts(),
            want(&|c| {
                all(c);
                c.mappings += 2
            }),
            "live counts with one of everything"
        );
        r.unmap(g, g)?;
        assert_eq!(
            dev.live_counts(),
            want(&|c| {
                all(c);
                c.mappings += 1
            }),
            "live counts after one unmap"
        );

        // Steady-state work makes no driver-level calls.
        let before = dev.driver_counts();
        // SAFETY: `p` outlives the copy (synchronized next).
        unsafe { dev.memcpy_htod_async(b.ptr(), p.as_ptr(), p.len(), s.raw())? };
        dev.memcpy_dtod_async(r.base(), b.ptr(), 4096, s.raw())?;
        e.record(&s)?;
        s.synchronize()?;
        assert_eq!(dev.driver_counts(), before, "copies and events made driver-level calls");

        let d = dev.driver_counts();
        assert_eq!(d.pinned_alloc_calls - d0.pinned_alloc_calls, 1, "pinned_alloc_calls");
        assert_eq!(d.device_alloc_calls - d0.device_alloc_calls, 1, "device_alloc_calls");
        assert_eq!(d.vmm_create_calls - d0.vmm_create_calls, 2, "vmm_create_calls");
        assert_eq!(d.vmm_map_calls - d0.vmm_map_calls, 2, "vmm_map_calls");
        assert_eq!(d.vmm_set_access_calls - d0.vmm_set_access_calls, 2, "vmm_set_access_calls");
        assert_eq!(d.vmm_unmap_calls - d0.vmm_unmap_calls, 1, "vmm_unmap_calls");
    }
    dev.synchronize()?;
    assert_eq!(dev.live_counts(), l0, "live counts after dropping everything (leak)");
    let d = dev.driver_counts();
    assert_eq!(d.pinned_free_calls - d0.pinned_free_calls, 1, "pinned_free_calls");
    assert_eq!(d.device_free_calls - d0.device_free_calls, 1, "device_free_calls");
    assert_eq!(d.vmm_release_calls - d0.vmm_release_calls, 2, "vmm_release_calls");
    assert_eq!(d.vmm_unmap_calls - d0.vmm_unmap_calls, 2, "vmm_unmap_calls after drop");
    Ok(())
}

/// Pinned memory and registered ranges are page-locked exactly where they
/// are; copies from both are exact; overlapping registrations and unknown
/// unregistrations are errors.
pub fn pinned_and_registered_host_memory(dev: &Arc<dyn Device>) -> Result<()> {
    no_leaks(dev, "pinned_and_registered_host_memory", || {
        let s = Stream::new(dev)?;
        let n = 1 << 20;
        let l0 = dev.live_counts();
        let mut pinned = PinnedBuffer::new(dev, n)?;
        pinned.copy_from_slice(&random_bytes(0x91, n));
        assert!(dev.host_is_page_locked(pinned.as_ptr(), n), "a pinned buffer is not page-locked");
        // SAFETY: inside the pinned buffer.
        assert!(dev.host_is_page_locked(unsafe { pinned.as_ptr().add(10) }, 100), "inside a pinned buffer");
        let l1 = dev.live_counts();
        assert_eq!(
            (l1.pinned_buffers, l1.pinned_bytes),
            (l0.pinned_buffers + 1, l0.pinned_bytes + n as u64),
            "pinned counts"
        );

        // A pageable range, registered in its middle so its ends stay
        // pageable. Aligned to 64 KiB so no page is half registered.
        const ALIGN: usize = 64 << 10;
        let mut pageable = random_bytes(0x92, 3 * n + ALIGN);
        let off = n + pageable[n..].as_ptr().align_offset(ALIGN);
        let mid = pageable[off..].as_mut_ptr();
        // SAFETY: both are inside `pageable`: `off - ALIGN >= 0` and `off + n + 64 <= 3n + ALIGN`.
        let (before_mid, after_mid) = unsafe { (mid.sub(ALIGN), mid.add(n)) };
        assert!(!dev.host_is_page_locked(mid, n), "pageable memory reported page-locked");
        for read_only in [false, true] {
            // SAFETY: `pageable` outlives the registration (unregistered below).
            unsafe { dev.host_register(mid, n, read_only)? };
            assert_eq!(dev.live_counts().host_registrations, l0.host_registrations + 1, "host_registrations");
            assert!(dev.host_is_page_locked(mid, n), "a registered range (read_only={read_only})");
            // SAFETY: inside the registered range.
            assert!(dev.host_is_page_locked(unsafe { mid.add(n / 2) }, 64), "inside a registered range");
            assert!(!dev.host_is_page_locked(before_mid, 64), "memory before a registered range");
            assert!(!dev.host_is_page_locked(after_mid, 64), "memory after a registered range");
            // SAFETY: overlapping registrations must be refused without touching anything.
            let twice = unsafe { dev.host_register(mid.wrapping_add(8192), 8192, read_only) };
            assert!(twice.is_err(), "registering inside a registered range was accepted");
            // Copy straight from the registered range (the bypass path).
            let b = DeviceBuffer::new(dev, n)?;
            // SAFETY: the registered range outlives the copy (synchronized next).
            unsafe { dev.memcpy_htod_async(b.ptr(), mid, n, s.raw())? };
            s.synchronize()?;
            assert_same("a copy from a registered range", &download(dev, &s, b.ptr(), n)?, &pageable[off..off + n]);
            // SAFETY: registered above; the copy from it has completed.
            unsafe { dev.host_unregister(mid)? };
            assert!(!dev.host_is_page_locked(mid, n), "an unregistered range is still page-locked");
        }
        // SAFETY: `mid` is no longer registered: the call must fail and change nothing.
        let unknown = unsafe { dev.host_unregister(mid) };
        assert!(unknown.is_err(), "unregistering an unregistered pointer was accepted");
        if dev.info().kind == DeviceKind::Host {
            assert_eq!(unknown.map_err(|e| e.status()), Err(EpmStatus::InvalidArgument));
        }

        // Pinned memory round trip.
        let b = DeviceBuffer::new(dev, n)?;
        // SAFETY: `pinned` outlives the copy (synchronized next).
        unsafe { dev.memcpy_htod_async(b.ptr(), pinned.as_ptr(), n, s.raw())? };
        s.synchronize()?;
        assert_same("a copy from pinned memory", &download(dev, &s, b.ptr(), n)?, &pinned);
        let p = pinned.as_ptr();
        drop(pinned);
        assert!(!dev.host_is_page_locked(p, 1), "a freed pinned buffer is still page-locked");
        Ok(())
    })
}

/// Info and memory figures are consistent.
pub fn info_is_consistent(dev: &Arc<dyn Device>) -> Result<()> {
    let i = dev.info();
    assert!(!i.name.is_empty(), "device name is empty");
    assert!(i.granularity > 0 && i.granularity.is_multiple_of(4096), "granularity {}", i.granularity);
    assert_eq!(dev.vmm_granularity(), i.granularity, "vmm_granularity() and info().granularity differ");
    let (free, total) = dev.mem_get_info()?;
    assert!(total > 0 && free <= total, "mem_get_info: free {free}, total {total}");
    match i.kind {
        DeviceKind::Host => {
            assert_eq!(dev.stream_wrap_native(1).map_err(|e| e.status()), Err(EpmStatus::Unsupported));
            let s = Stream::new(dev)?;
            assert_eq!(dev.stream_native(s.raw())?, 0, "host streams have no native handle");
        }
        DeviceKind::Cuda => {
            assert!(i.compute_capability.0 > 0 && i.driver_version > 0, "CUDA info: {i:?}");
            let s = Stream::new(dev)?;
            assert_ne!(dev.stream_native(s.raw())?, 0, "a CUDA stream has a native CUstream");
        }
    }
    Ok(())
}
