//! Host-device behaviour the conformance suite cannot ask of CUDA: async
//! errors when a range changes under a queued copy, teardown with live
//! objects, small granularities, the granularity setting.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::device::conformance;

fn host(granularity: usize) -> Arc<dyn Device> {
    Arc::new(HostDevice::with_granularity(0, granularity).expect("host device"))
}

#[test]
fn granularity_setting_accepts_page_multiples_only() {
    assert_eq!(parse_granularity(None, 4096).unwrap(), 2 << 20);
    assert_eq!(parse_granularity(Some(" 65536 "), 4096).unwrap(), 65536);
    for bad in ["0", "1000", "4097", "-4096", "2M", ""] {
        let e = parse_granularity(Some(bad), 4096).unwrap_err();
        assert_eq!(e.status(), EpmStatus::InvalidConfig, "{bad:?}: {e}");
        assert!(e.message().contains("EPM_HOST_GRANULARITY"), "{e}");
    }
    assert_eq!(HostDevice::with_granularity(0, 100).unwrap_err().status(), EpmStatus::InvalidConfig);
}

#[test]
fn vmm_checks_pass_at_a_small_granularity() {
    let dev = host(16 * sys::page_size());
    conformance::granule_aliased_at_two_addresses(&dev).unwrap();
    conformance::readonly_postures_in_one_reservation(&dev).unwrap();
    conformance::live_and_driver_counts_are_exact(&dev).unwrap();
}

/// A range unmapped after a copy was queued (but before it ran) fails the
/// copy on the stream thread: synchronize reports it once, nothing faults.
#[test]
fn a_range_unmapped_under_a_queued_copy_is_an_async_error() {
    let dev = host(sys::page_size());
    let g = dev.vmm_granularity();
    let s = Stream::new(&dev).unwrap();
    let phys = PhysMem::new(&dev, g).unwrap();
    let mut r = VaRange::reserve(&dev, g).unwrap();
    r.map(0, g, &phys, 0, Access::ReadWrite).unwrap();
    let src = vec![9u8; g];
    dev.spin_async(50_000, s.raw()).unwrap();
    // SAFETY: `src` outlives the copy (the stream is synchronized below).
    unsafe { dev.memcpy_htod_async(r.base(), src.as_ptr(), g, s.raw()).unwrap() };
    r.unmap(0, g).unwrap();
    let e = s.synchronize().unwrap_err();
    assert_eq!(e.status(), EpmStatus::AccessDenied, "{e}");
    s.synchronize().expect("the async error is reported once");

    let b = DeviceBuffer::new(&dev, 4096).unwrap();
    let p = b.ptr();
    dev.spin_async(50_000, s.raw()).unwrap();
    dev.memset_d8_async(p, 1, 4096, s.raw()).unwrap();
    drop(b);
    assert_eq!(s.synchronize().unwrap_err().status(), EpmStatus::InvalidArgument);
}

#[test]
fn wait_on_a_never_recorded_event_and_a_destroyed_stream_are_fine() {
    let dev = host(2 << 20);
    let s = Stream::new(&dev).unwrap();
    let e = Event::new(&dev, false).unwrap();
    s.wait_event(&e).unwrap();
    {
        let other = Stream::new(&dev).unwrap();
        dev.spin_async(20_000, other.raw()).unwrap();
        e.record(&other).unwrap();
    }
    // The recording stream is gone but its work finished: the event completed.
    assert!(e.query().unwrap());
    s.wait_event(&e).unwrap();
    s.synchronize().unwrap();
}

/// Dropping the device with objects still alive (raw handles leaked by a
/// careless host) joins the streams and frees the memory without panicking.
#[test]
fn teardown_with_live_objects_does_not_panic_or_hang() {
    let dev = HostDevice::with_granularity(0, 2 << 20).unwrap();
    let s = dev.stream_create().unwrap();
    let d = dev.mem_alloc(1 << 20).unwrap();
    let p = dev.pinned_alloc(1 << 20).unwrap();
    dev.spin_async(20_000, s).unwrap();
    // SAFETY: `p` is pinned memory the device frees only after joining the stream.
    unsafe { dev.memcpy_dtoh_async(p, d, 1 << 20, s).unwrap() };
    let h = dev.vmm_create(2 << 20).unwrap();
    let va = dev.vmm_reserve(4 << 20, 0).unwrap();
    dev.vmm_map(va, 2 << 20, h, 0).unwrap();
    dev.vmm_set_access(va, 2 << 20, Access::ReadOnly).unwrap();
    let e = dev.event_create(true).unwrap();
    dev.event_record(e, s).unwrap();
    let t = std::time::Instant::now();
    drop(dev);
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn registration_may_not_overlap_pinned_memory() {
    let dev = host(2 << 20);
    let p = dev.pinned_alloc(8192).unwrap();
    // SAFETY: refused before anything is recorded; `p` is live pinned memory.
    let e = unsafe { dev.host_register(p.add(4096), 100, false) }.unwrap_err();
    assert_eq!(e.status(), EpmStatus::InvalidState, "{e}");
    // SAFETY: `p` came from pinned_alloc and nothing uses it.
    unsafe { dev.pinned_free(p).unwrap() };
    // SAFETY: already freed: refused, nothing touched.
    assert_eq!(unsafe { dev.pinned_free(p) }.unwrap_err().status(), EpmStatus::InvalidArgument);
}

/// Many threads sharing one device, each with its own stream.
#[test]
fn concurrent_streams_from_many_threads() {
    let dev = host(2 << 20);
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let dev = dev.clone();
            std::thread::spawn(move || {
                let s = Stream::new(&dev).unwrap();
                for i in 0..20u64 {
                    let n = 1000 + (t * 20 + i) as usize * 97;
                    let data = conformance::random_bytes(t * 1000 + i, n);
                    let b = DeviceBuffer::new(&dev, n).unwrap();
                    let mut out = vec![0u8; n];
                    // SAFETY: `data` and `out` outlive the copies (synchronized next).
                    unsafe {
                        dev.memcpy_htod_async(b.ptr(), data.as_ptr(), n, s.raw()).unwrap();
                        dev.memcpy_dtoh_async(out.as_mut_ptr(), b.ptr(), n, s.raw()).unwrap();
                    }
                    s.synchronize().unwrap();
                    assert_eq!(out, data);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("worker thread");
    }
    assert_eq!(dev.live_counts(), LiveCounts::default());
}

/// Host pointers that point into device memory are checked like device
/// ranges, and a D2H destination registered read-only is refused: no copy
/// can make the stream thread fault.
#[test]
fn host_pointers_into_device_memory_or_read_only_registrations_are_checked() {
    let dev = host(sys::page_size());
    let g = dev.vmm_granularity();
    let s = Stream::new(&dev).unwrap();
    let b = DeviceBuffer::new(&dev, g).unwrap();
    let phys = PhysMem::new(&dev, g).unwrap();
    let mut r = VaRange::reserve(&dev, 2 * g).unwrap();
    r.map(0, g, &phys, 0, Access::ReadOnly).unwrap();
    let ro = std::ptr::with_exposed_provenance_mut::<u8>(r.base() as usize);
    let unmapped = std::ptr::with_exposed_provenance_mut::<u8>(r.base() as usize + g);
    // SAFETY: every call below is refused at enqueue; nothing is copied.
    unsafe {
        let e = dev.memcpy_dtoh_async(ro, b.ptr(), 64, s.raw()).unwrap_err();
        assert_eq!(e.status(), EpmStatus::AccessDenied, "D2H into a read-only VA: {e}");
        let e = dev.memcpy_htod_async(b.ptr(), unmapped, 64, s.raw()).unwrap_err();
        assert_eq!(e.status(), EpmStatus::AccessDenied, "H2D from an unmapped VA: {e}");
    }
    // A host pointer into read-write device memory is simply memory.
    let other = DeviceBuffer::new(&dev, 64).unwrap();
    let src = std::ptr::with_exposed_provenance::<u8>(other.ptr() as usize);
    dev.memset_d8_async(other.ptr(), 7, 64, s.raw()).unwrap();
    // SAFETY: `other` is live read-write memory for the whole copy (synchronized next).
    unsafe { dev.memcpy_htod_async(b.ptr(), src, 64, s.raw()).unwrap() };
    s.synchronize().unwrap();

    let mut page = vec![0u8; 3 * sys::page_size()];
    let p = page.as_mut_ptr();
    for read_only in [true, false] {
        // SAFETY: `page` outlives the registration and the copy (synchronized next).
        unsafe {
            dev.host_register(p, page.len(), read_only).unwrap();
            let r = dev.memcpy_dtoh_async(p.add(10), b.ptr(), 64, s.raw());
            s.synchronize().unwrap();
            dev.host_unregister(p).unwrap();
            match r {
                Err(e) => assert!(read_only && e.status() == EpmStatus::AccessDenied, "{e}"),
                Ok(()) => assert!(!read_only, "D2H into a read-only registration was accepted"),
            }
        }
    }
    assert!(page[10..74].iter().all(|&x| x == 7));
}

#[test]
fn handles_of_one_host_device_are_unknown_to_another() {
    let (a, b) = (host(2 << 20), host(2 << 20));
    let s = a.stream_create().unwrap();
    let e = a.event_create(false).unwrap();
    let p = a.vmm_create(2 << 20).unwrap();
    assert_eq!(b.stream_synchronize(s).unwrap_err().status(), EpmStatus::InvalidHandle);
    assert_eq!(b.event_query(e).unwrap_err().status(), EpmStatus::InvalidHandle);
    assert_eq!(b.vmm_release(p).unwrap_err().status(), EpmStatus::InvalidHandle);
    let buf = a.mem_alloc(64).unwrap();
    assert_eq!(b.mem_free(buf).unwrap_err().status(), EpmStatus::InvalidArgument);
    a.mem_free(buf).unwrap();
    a.vmm_release(p).unwrap();
    a.event_destroy(e).unwrap();
    a.stream_destroy(s).unwrap();
}

#[test]
fn zero_length_ops_are_no_ops_even_with_null_pointers() {
    let dev = host(2 << 20);
    let s = Stream::new(&dev).unwrap();
    let b = DeviceBuffer::new(&dev, 8).unwrap();
    dev.memset_d8_async(b.ptr(), 0xFF, 8, s.raw()).unwrap();
    // SAFETY: zero-length copies read and write nothing.
    unsafe {
        dev.memcpy_htod_async(b.ptr(), std::ptr::null(), 0, s.raw()).unwrap();
        dev.memcpy_dtoh_async(std::ptr::null_mut(), b.ptr(), 0, s.raw()).unwrap();
        assert_eq!(
            dev.memcpy_htod_async(b.ptr(), std::ptr::null(), 8, s.raw()).unwrap_err().status(),
            EpmStatus::NullPointer
        );
    }
    dev.memcpy_dtod_async(0, 0, 0, s.raw()).unwrap();
    dev.memset_d8_async(0, 1, 0, s.raw()).unwrap();
    dev.checksum_async(0, 0, b.ptr(), s.raw()).unwrap();
    s.synchronize().unwrap();
    let mut out = [1u8; 8];
    // SAFETY: `out` outlives the copy (synchronized next).
    unsafe { dev.memcpy_dtoh_async(out.as_mut_ptr(), b.ptr(), 8, s.raw()).unwrap() };
    s.synchronize().unwrap();
    assert_eq!(out, [0; 8], "the checksum of nothing is 0");
}
