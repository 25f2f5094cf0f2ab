//! Bad input is an error, never a crash, and never poisons the device.

use std::sync::Arc;

use super::{assert_same, download, no_leaks, random_bytes, upload};
use crate::device::{
    Access, Device, DeviceBuffer, DeviceKind, Event, PhysMem, RawEvent, RawPhys, RawStream, Stream, VaRange,
};
use crate::error::{EpmStatus, Result};

/// A value no device hands out as a handle.
const BOGUS: u64 = 0x7fff_dead_beef_0001;
/// A device address no allocation is at: the first page is never mapped.
const NOWHERE: u64 = 0x10;

#[track_caller]
fn assert_err<T: std::fmt::Debug>(what: &str, r: Result<T>) {
    assert!(r.is_err(), "{what}: expected an error, got {r:?}");
}

#[track_caller]
fn assert_status<T: std::fmt::Debug>(dev: &Arc<dyn Device>, what: &str, r: Result<T>, status: EpmStatus) {
    match r {
        Ok(v) => panic!("{what}: expected an error, got Ok({v:?})"),
        Err(e) if dev.info().kind == DeviceKind::Host => assert_eq!(e.status(), status, "{what}: {e}"),
        Err(_) => {}
    }
}

/// The device still works: a round trip on a fresh stream is exact.
fn still_works(dev: &Arc<dyn Device>, what: &str) -> Result<()> {
    let s = Stream::new(dev)?;
    let b = DeviceBuffer::new(dev, 4099)?;
    let data = random_bytes(0xE0, 4099);
    upload(dev, &s, b.ptr(), &data)?;
    assert_same(&format!("a round trip after {what}"), &download(dev, &s, b.ptr(), 4099)?, &data);
    Ok(())
}

/// Unknown, destroyed and wrong-typed stream, event and physical handles are
/// errors (InvalidHandle on the host device), and the device keeps working.
pub fn bad_handles_are_errors(dev: &Arc<dyn Device>) -> Result<()> {
    no_leaks(dev, "bad_handles_are_errors", || {
        let live_s = Stream::new(dev)?;
        let live_e = Event::new(dev, false)?;
        let dead_s = dev.stream_create()?;
        dev.stream_destroy(dead_s)?;
        let dead_e = dev.event_create(true)?;
        dev.event_destroy(dead_e)?;
        let dead_p = dev.vmm_create(dev.vmm_granularity())?;
        dev.vmm_release(dead_p)?;
        let h = EpmStatus::InvalidHandle;

        let wrong_s = RawStream(live_e.raw().0);
        for (name, s) in [("bogus", RawStream(BOGUS)), ("destroyed", dead_s), ("event-as-stream", wrong_s)] {
            let what = |op: &str| format!("{op} on a {name} stream");
            assert_status(dev, &what("stream_synchronize"), dev.stream_synchronize(s), h);
            assert_status(dev, &what("stream_wait_event"), dev.stream_wait_event(s, live_e.raw()), h);
            assert_status(dev, &what("stream_native"), dev.stream_native(s), h);
            assert_status(dev, &what("event_record"), dev.event_record(live_e.raw(), s), h);
            assert_status(dev, &what("spin_async"), dev.spin_async(1, s), h);
            let b = DeviceBuffer::new(dev, 64)?;
            assert_status(dev, &what("memset"), dev.memset_d8_async(b.ptr(), 1, 64, s), h);
            let src = [0u8; 64];
            // SAFETY: `src` outlives the call, which is refused (bad stream) before any copy.
            assert_status(dev, &what("memcpy_htod"), unsafe { dev.memcpy_htod_async(b.ptr(), src.as_ptr(), 64, s) }, h);
            assert_status(dev, &what("stream_destroy"), dev.stream_destroy(s), h);
        }
        let wrong_e = RawEvent(live_s.raw().0);
        for (name, e) in [("bogus", RawEvent(BOGUS)), ("destroyed", dead_e), ("stream-as-event", wrong_e)] {
            let what = |op: &str| format!("{op} on a {name} event");
            assert_status(dev, &what("event_query"), dev.event_query(e), h);
            assert_status(dev, &what("event_synchronize"), dev.event_synchronize(e), h);
            assert_status(dev, &what("event_record"), dev.event_record(e, live_s.raw()), h);
            assert_status(dev, &what("stream_wait_event"), dev.stream_wait_event(live_s.raw(), e), h);
            assert_status(dev, &what("event_elapsed_ms"), dev.event_elapsed_ms(e, live_e.raw()), h);
            assert_status(dev, &what("event_destroy"), dev.event_destroy(e), h);
        }
        let g = dev.vmm_granularity();
        let va = VaRange::reserve(dev, g)?;
        for (name, p) in [("bogus", RawPhys(BOGUS)), ("released", dead_p)] {
            assert_status(dev, &format!("vmm_map of a {name} handle"), dev.vmm_map(va.base(), g, p, 0), h);
            assert_status(dev, &format!("vmm_release of a {name} handle"), dev.vmm_release(p), h);
        }
        // The live handles still work after all that.
        live_e.record(&live_s)?;
        live_s.synchronize()?;
        assert!(live_e.query()?, "a live event after bad-handle calls");
        drop(va);
        still_works(dev, "bad handles")
    })
}

/// Bad sizes and device addresses are errors (InvalidArgument on the host
/// device), VMM misuse is refused, and the device keeps working.
pub fn bad_device_addresses_are_errors(dev: &Arc<dyn Device>) -> Result<()> {
    no_leaks(dev, "bad_device_addresses_are_errors", || {
        let s = Stream::new(dev)?;
        let ia = EpmStatus::InvalidArgument;
        let b = DeviceBuffer::new(dev, 4096)?;
        let mut host = [0u8; 64];
        // SAFETY: `host` outlives the calls, all refused before any copy.
        unsafe {
            assert_status(
                dev,
                "H2D to an unknown address",
                dev.memcpy_htod_async(NOWHERE, host.as_ptr(), 64, s.raw()),
                ia,
            );
            assert_status(
                dev,
                "D2H from an unknown address",
                dev.memcpy_dtoh_async(host.as_mut_ptr(), NOWHERE, 64, s.raw()),
                ia,
            );
        }
        assert_status(dev, "D2D to an unknown address", dev.memcpy_dtod_async(NOWHERE, b.ptr(), 64, s.raw()), ia);
        assert_status(dev, "D2D from an unknown address", dev.memcpy_dtod_async(b.ptr(), NOWHERE, 64, s.raw()), ia);
        assert_status(dev, "memset of an unknown address", dev.memset_d8_async(NOWHERE, 0, 64, s.raw()), ia);
        assert_status(dev, "checksum of an unknown address", dev.checksum_async(NOWHERE, 64, b.ptr(), s.raw()), ia);
        assert_status(dev, "checksum into an unknown address", dev.checksum_async(b.ptr(), 64, NOWHERE, s.raw()), ia);
        assert_status(
            dev,
            "checksum of a length not a multiple of 4",
            dev.checksum_async(b.ptr(), 63, b.ptr() + 64, s.raw()),
            ia,
        );
        assert_status(dev, "mem_free of an unknown address", dev.mem_free(NOWHERE), ia);
        assert_status(dev, "mem_alloc of 0 bytes", dev.mem_alloc(0), ia);
        assert_status(dev, "pinned_alloc of 0 bytes", dev.pinned_alloc(0), ia);
        let p = dev.mem_alloc(256)?;
        dev.mem_free(p)?;
        assert_status(dev, "mem_free twice", dev.mem_free(p), ia);

        let g = dev.vmm_granularity();
        assert_status(dev, "vmm_create of 0 bytes", dev.vmm_create(0), ia);
        assert_status(dev, "vmm_create of granularity+1 bytes", dev.vmm_create(g + 1), ia);
        assert_status(dev, "vmm_reserve of granularity+1 bytes", dev.vmm_reserve(g + 1, 0), ia);
        assert_status(dev, "vmm_free_va of an unknown range", dev.vmm_free_va(NOWHERE, g), ia);
        let phys = PhysMem::new(dev, g)?;
        let mut r = VaRange::reserve(dev, 2 * g)?;
        assert_status(dev, "vmm_map outside any reservation", dev.vmm_map(NOWHERE, g, phys.raw(), 0), ia);
        assert_status(dev, "vmm_map at an unaligned VA", dev.vmm_map(r.base() + 4096, g, phys.raw(), 0), ia);
        assert_status(dev, "vmm_map past the handle's end", dev.vmm_map(r.base(), 2 * g, phys.raw(), 0), ia);
        assert_status(dev, "vmm_unmap of an unmapped range", dev.vmm_unmap(r.base(), g), ia);
        assert_status(
            dev,
            "vmm_set_access of an unmapped range",
            dev.vmm_set_access(r.base(), g, Access::ReadWrite),
            ia,
        );
        r.map(0, g, &phys, 0, Access::ReadWrite)?;
        assert_err("vmm_map over an existing mapping", dev.vmm_map(r.base(), g, phys.raw(), 0));
        assert_err("vmm_free_va of a reservation still mapped", dev.vmm_free_va(r.base(), 2 * g));
        assert_err("vmm_free_va with the wrong size", dev.vmm_free_va(r.base(), g));
        // SAFETY: `host` outlives the copy attempt.
        let into_mem_alloc = unsafe { dev.memcpy_htod_async(b.ptr() + 8192, host.as_ptr(), 64, s.raw()) };
        let sync = s.synchronize();
        assert!(into_mem_alloc.is_err() || sync.is_err(), "H2D far past the end of a device allocation was accepted");
        r.unmap(0, g)?;
        drop(r);
        still_works(dev, "bad addresses")
    })
}

/// Device ranges that start inside an allocation or mapping but run past its
/// end (or into an unmapped granule) are errors. Separate from the checks
/// above because a device that failed to validate these could fault.
pub fn straddling_device_ranges_are_errors(dev: &Arc<dyn Device>) -> Result<()> {
    no_leaks(dev, "straddling_device_ranges_are_errors", || {
        let s = Stream::new(dev)?;
        let b = DeviceBuffer::new(dev, 4096)?;
        let src = random_bytes(0xF0, 64);
        let mut dst = [0u8; 64];
        let end = b.ptr() + 4096 - 32;
        // SAFETY: `src`/`dst` outlive the calls, which the device must refuse.
        let (w, r) = unsafe {
            (
                dev.memcpy_htod_async(end, src.as_ptr(), 64, s.raw()),
                dev.memcpy_dtoh_async(dst.as_mut_ptr(), end, 64, s.raw()),
            )
        };
        let sync = s.synchronize();
        assert!((w.is_err() && r.is_err()) || sync.is_err(), "copies across the end of an allocation: {w:?} {r:?}");
        assert_err("memset across the end of an allocation", dev.memset_d8_async(end, 0, 64, s.raw()));

        let g = dev.vmm_granularity();
        let phys = PhysMem::new(dev, g)?;
        let mut r2 = VaRange::reserve(dev, 2 * g)?;
        r2.map(0, g, &phys, 0, Access::ReadWrite)?;
        let edge = r2.base() + g as u64 - 32;
        // SAFETY: as above.
        let into_unmapped = unsafe { dev.memcpy_htod_async(edge, src.as_ptr(), 64, s.raw()) };
        let sync = s.synchronize();
        assert!(into_unmapped.is_err() || sync.is_err(), "H2D running into an unmapped granule was accepted");
        assert_err("D2D running into an unmapped granule", dev.memcpy_dtod_async(b.ptr(), edge, 64, s.raw()));
        s.synchronize()?;
        drop(r2);
        still_works(dev, "straddling ranges")
    })
}
