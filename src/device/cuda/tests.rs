//! CUDA-specific tests. The first group runs everywhere (it checks the
//! no-driver path here, and the bad-ordinal path on a GPU machine). The
//! `#[ignore]`d group needs a GPU: run it with
//! `EPM_DEVICE=cuda <lib test binary> device::cuda --include-ignored --test-threads=1`.
//! (The generic behaviour is in the shared conformance suite; these cover
//! what only the CUDA implementation does.)

use crate::device::conformance::random_bytes;
use std::sync::Arc;

use cudarc::driver::sys;

use super::CudaDevice;
use crate::device::*;
use crate::error::EpmStatus;

fn libcuda_present() -> bool {
    // SAFETY: only tries to dlopen the candidate names.
    unsafe { sys::is_culib_present() }
}

#[test]
fn missing_driver_or_device_is_device_unavailable_not_a_panic() {
    if libcuda_present() {
        let e = CudaDevice::new(9999).unwrap_err();
        assert_eq!(e.status(), EpmStatus::DeviceUnavailable, "{e}");
        assert!(e.message().contains("9999") && e.message().contains("device(s)"), "{e}");
    } else {
        let e = CudaDevice::new(0).unwrap_err();
        assert_eq!(e.status(), EpmStatus::DeviceUnavailable, "{e}");
        assert!(e.message().contains("libcuda"), "{e}");
        // The outcome is cached: a second open answers the same, still no panic.
        assert_eq!(CudaDevice::new(1).unwrap_err(), e);
        let e = crate::device::open(DeviceSelect::Cuda, 0).unwrap_err();
        assert_eq!(e.status(), EpmStatus::DeviceUnavailable, "{e}");
    }
}

#[test]
fn auto_without_a_driver_falls_back_to_the_host_device() {
    if libcuda_present() {
        return; // covered by the GPU run: auto picks CUDA there
    }
    match crate::device::open(DeviceSelect::Auto, 0) {
        Ok(d) => assert_eq!(d.info().kind, DeviceKind::Host),
        // Until the host device lands, its own error is what auto reports.
        Err(e) => assert!(!e.message().contains("libcuda"), "auto must not fail on CUDA's absence: {e}"),
    }
}

/// Runs the GPU tests below in a child process against `fake_libcuda.c`, a
/// fake driver that checks flags, struct fields and the current context:
/// the CUDA plumbing is exercised on every `cargo test`, GPU or not.
#[test]
fn fake_driver_runs_the_gpu_tests() {
    let dir = std::env::temp_dir().join(format!("epmem-fake-libcuda-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("fake_libcuda.c");
    std::fs::write(&src, include_str!("fake_libcuda.c")).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let built = std::process::Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(dir.join("libcuda.so"))
        .arg(&src)
        .status()
        .unwrap_or_else(|e| panic!("building the fake libcuda needs a C compiler ({cc}): {e}"));
    assert!(built.success(), "{cc} failed on fake_libcuda.c");
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["device::cuda::tests::gpu_", "--include-ignored", "--test-threads=1"])
        .env("LD_LIBRARY_PATH", &dir)
        .env("EPM_DEVICE", "cuda")
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let ran = stdout.lines().filter(|l| l.starts_with("test device::cuda::tests::gpu_") && l.ends_with(" ok")).count();
    assert!(ran >= 9, "only {ran} GPU tests ran on the fake driver:\n{stdout}");
}

// ---------------------------------------------------------------- GPU only

/// Hold `s` on `gate`; `false`, printed, where this driver or GPU has no
/// stream memory waits (the test is then skipped, never silently passed).
fn hold_or_skip(d: &Arc<dyn Device>, s: &Stream, gate: &Gate, test: &str) -> bool {
    match d.hold_async(s.raw(), gate) {
        Ok(()) => true,
        Err(e) if e.status() == EpmStatus::Unsupported => {
            eprintln!("SKIPPED {test}: {e}");
            false
        }
        Err(e) => panic!("hold_async: {e}"),
    }
}

/// Violations the fake libcuda saw (a flag freed while a stream still
/// waited on it, bad flags, …); 0 on a real driver, which has no such counter.
fn fake_violations() -> i32 {
    // SAFETY: a lookup by a NUL-terminated name in the already loaded
    // objects; called only if found, with the fake's signature `int (void)`.
    // libloading opens libcuda RTLD_LOCAL, so look in that object itself
    // (RTLD_NOLOAD: only if already loaded; a new handle to it, closed below).
    unsafe {
        let lib = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        if lib.is_null() {
            return 0;
        }
        let f = libc::dlsym(lib, c"fake_failures".as_ptr());
        let n = if f.is_null() { 0 } else { std::mem::transmute::<*mut libc::c_void, extern "C" fn() -> i32>(f)() };
        libc::dlclose(lib);
        n
    }
}

#[test]
#[ignore = "needs a CUDA GPU (EPM_DEVICE=cuda)"]
fn gpu_hold_is_a_device_wait_that_never_blocks_the_host() {
    let d = gpu();
    let s = Stream::new(&d).unwrap();
    let buf = DeviceBuffer::new(&d, 4096).unwrap();
    let before = fake_violations();
    // Three rounds: each later hold reclaims the flags of the earlier, opened
    // ones (the fake reports a flag freed while a wait on it was pending).
    for round in 0..3u8 {
        let gate = Gate::new();
        let wd = gate.watchdog(std::time::Duration::from_secs(20));
        if !hold_or_skip(&d, &s, &gate, "gpu_hold_is_a_device_wait_that_never_blocks_the_host") {
            return;
        }
        d.memset_d8_async(buf.ptr(), round + 1, 4096, s.raw()).unwrap();
        let e = Event::new(&d, false).unwrap();
        e.record(&s).unwrap();
        let t = std::time::Instant::now();
        for _ in 0..100 {
            assert!(!e.query().unwrap(), "round {round}: work behind a closed gate completed");
        }
        assert!(!wd.fired(), "round {round}: cuEventQuery blocked on the held stream");
        assert!(t.elapsed() < std::time::Duration::from_secs(5), "100 queries took {:?}", t.elapsed());
        if round == 1 {
            drop(gate); // dropping opens it; the flag outlives the handle
        } else {
            gate.open();
        }
        e.synchronize().unwrap();
        assert_eq!(read_back(&d, buf.ptr(), 4096, &s), vec![round + 1; 4096]);
        assert!(!wd.fired());
    }
    // Holds that overlap: `later` is opened while `first` still holds the
    // stream, so its wait has not passed; a hold on `other` then reclaims
    // and must keep both flags (the fake reports a closed gate's flag freed).
    let (first, later, other) = (Gate::new(), Gate::new(), Gate::new());
    let s2 = Stream::new(&d).unwrap();
    let wd = first.watchdog(std::time::Duration::from_secs(20));
    assert!(hold_or_skip(&d, &s, &first, "overlapping holds"));
    assert!(hold_or_skip(&d, &s, &later, "overlapping holds"));
    d.memset_d8_async(buf.ptr(), 9, 4096, s.raw()).unwrap();
    let e = Event::new(&d, false).unwrap();
    e.record(&s).unwrap();
    later.open();
    assert!(hold_or_skip(&d, &s2, &other, "overlapping holds"));
    assert!(!e.query().unwrap(), "work behind the first, closed gate completed");
    first.open();
    other.open();
    e.synchronize().unwrap();
    s2.synchronize().unwrap();
    assert!(!wd.fired());
    assert_eq!(read_back(&d, buf.ptr(), 4096, &s), vec![9; 4096]);
    // A hold on an already opened gate is a no-op.
    let open = Gate::new();
    open.open();
    d.hold_async(s.raw(), &open).unwrap();
    s.synchronize().unwrap();
    assert_eq!(fake_violations(), before, "the fake driver saw a violation (stderr says which)");
}

#[test]
#[ignore = "needs a CUDA GPU (EPM_DEVICE=cuda)"]
fn gpu_device_teardown_opens_a_closed_gate_before_freeing_its_flag() {
    let before = fake_violations();
    let gate = Gate::new();
    {
        let d = gpu();
        let s = Stream::new(&d).unwrap();
        if !hold_or_skip(&d, &s, &gate, "gpu_device_teardown_opens_a_closed_gate_before_freeing_its_flag") {
            return;
        }
        d.spin_async(1_000, s.raw()).unwrap();
        // The stream, then the device go with the gate still closed: the
        // teardown must open it (or its synchronize would hang) before it
        // frees the flag.
    }
    assert!(gate.shared().is_open(), "the device went with its gate still closed");
    // Nothing is written to the freed flag any more: the gate is open.
    gate.open();
    drop(gate);
    assert_eq!(fake_violations(), before, "the fake driver saw a violation (stderr says which)");
}

fn gpu() -> Arc<dyn Device> {
    let d = crate::device::open_from_env(0).expect("open the device EPM_DEVICE names");
    assert_eq!(d.info().kind, DeviceKind::Cuda, "run these tests with EPM_DEVICE=cuda on a GPU machine");
    d
}

fn read_back(d: &Arc<dyn Device>, src: DevicePtr, n: usize, s: &Stream) -> Vec<u8> {
    let mut out = vec![0u8; n];
    // SAFETY: `out` is n writable bytes, untouched until the synchronize below.
    unsafe { d.memcpy_dtoh_async(out.as_mut_ptr(), src, n, s.raw()) }.unwrap();
    s.synchronize().unwrap();
    out
}

#[test]
#[ignore = "needs a CUDA GPU (EPM_DEVICE=cuda)"]
fn gpu_info_is_plausible() {
    let d = gpu();
    let i = d.info();
    assert!(!i.name.is_empty());
    assert!(i.total_mem > 1 << 30, "{i:?}");
    assert!(i.granularity.is_power_of_two() && i.granularity >= 64 << 10, "{i:?}");
    assert!(i.compute_capability.0 >= 7, "{i:?}");
    assert!(i.driver_version >= 11000, "{i:?}");
    let pci = i.pci_bus_id.as_deref().expect("a PCI bus id");
    assert_eq!(crate::device::cuda::driver::normalize_pci_bus_id(pci).as_deref(), Some(pci));
    assert_eq!(pci, pci.to_ascii_lowercase());
    let (free, total) = d.mem_get_info().unwrap();
    assert!(free <= total && total > 0);
}

#[test]
#[ignore = "needs a CUDA GPU (EPM_DEVICE=cuda)"]
fn gpu_copies_and_checksum_agree_with_the_host() {
    let d = gpu();
    let s = Stream::new(&d).unwrap();
    let n = (8 << 20) + 12;
    let data = random_bytes(7, n);
    let mut pinned = PinnedBuffer::new(&d, n).unwrap();
    pinned.copy_from_slice(&data);
    assert!(d.host_is_page_locked(pinned.as_ptr(), n));
    let a = DeviceBuffer::new(&d, n).unwrap();
    let b = DeviceBuffer::new(&d, n).unwrap();
    let out = DeviceBuffer::new(&d, 8).unwrap();
    // SAFETY: `pinned` lives until after the synchronize in read_back.
    unsafe { d.memcpy_htod_async(a.ptr(), pinned.as_ptr(), n, s.raw()) }.unwrap();
    d.memcpy_dtod_async(b.ptr(), a.ptr(), n, s.raw()).unwrap();
    d.checksum_async(b.ptr(), n, out.ptr(), s.raw()).unwrap();
    assert_eq!(read_back(&d, b.ptr(), n, &s), data);
    assert_eq!(read_back(&d, out.ptr(), 8, &s), checksum_host(&data).to_le_bytes());

    d.memset_d8_async(b.ptr() + 4, 0xab, 8, s.raw()).unwrap();
    let mut expect = data.clone();
    expect[4..12].fill(0xab);
    d.checksum_async(b.ptr(), n, out.ptr(), s.raw()).unwrap();
    assert_eq!(read_back(&d, out.ptr(), 8, &s), checksum_host(&expect).to_le_bytes());

    d.checksum_async(b.ptr(), 0, out.ptr(), s.raw()).unwrap();
    assert_eq!(read_back(&d, out.ptr(), 8, &s), [0; 8]);
    let e = d.checksum_async(b.ptr() + 2, 8, out.ptr(), s.raw()).unwrap_err();
    assert_eq!(e.status(), EpmStatus::InvalidArgument, "{e}");
    let e = d.checksum_async(b.ptr(), n + 4, out.ptr(), s.raw()).unwrap_err();
    assert_eq!(e.status(), EpmStatus::InvalidArgument, "past the allocation: {e}");
    d.synchronize().expect("the context survived the refused launches");
}

#[test]
#[ignore = "needs a CUDA GPU (EPM_DEVICE=cuda)"]
fn gpu_elapsed_time_never_blocks() {
    let d = gpu();
    let s = Stream::new(&d).unwrap();
    let (start, end) = (Event::new(&d, true).unwrap(), Event::new(&d, true).unwrap());
    // The end is held behind a gate the test opens after its checks: pending
    // is certain however slow the host; an elapsed/query that blocked would
    // return only once the watchdog opened the gate, which the test sees.
    let gate = crate::device::Gate::new();
    let wd = gate.watchdog(std::time::Duration::from_secs(60));
    start.record(&s).unwrap();
    if !hold_or_skip(&d, &s, &gate, "gpu_elapsed_time_never_blocks") {
        return;
    }
    d.spin_async(20_000, s.raw()).unwrap();
    end.record(&s).unwrap();
    let e = end.elapsed_since(&start).unwrap_err();
    assert_eq!(e.status(), EpmStatus::NotReady, "{e}");
    assert!(!end.query().unwrap());
    assert!(!wd.fired(), "elapsed/query waited for the held stream");
    gate.open();
    end.synchronize().unwrap();
    let ms = end.elapsed_since(&start).unwrap();
    // The 20 ms spin lies between the events: a floor, not a ceiling.
    assert!((15.0..60_000.0).contains(&ms), "a 20 ms spin measured {ms} ms");
    let fence = Event::new(&d, false).unwrap();
    fence.record(&s).unwrap();
    fence.synchronize().unwrap();
    assert_eq!(end.elapsed_since(&fence).unwrap_err().status(), EpmStatus::InvalidArgument);
}

#[test]
#[ignore = "needs a CUDA GPU (EPM_DEVICE=cuda)"]
fn gpu_vmm_alias_read_only_and_exact_counts() {
    let d = gpu();
    let g = d.vmm_granularity();
    let s = Stream::new(&d).unwrap();
    let before = (d.live_counts(), d.driver_counts());
    let h = d.vmm_create(g).unwrap();
    let va = d.vmm_reserve(2 * g, 0).unwrap();
    let (rw, ro) = (va, va + g as u64);
    d.vmm_map(rw, g, h, 0).unwrap();
    d.vmm_map(ro, g, h, 0).unwrap();
    d.vmm_set_access(rw, g, Access::ReadWrite).unwrap();
    d.vmm_set_access(ro, g, Access::ReadOnly).unwrap();
    let data = random_bytes(3, g);
    // SAFETY: `data` lives until after the synchronize in read_back.
    unsafe { d.memcpy_htod_async(rw, data.as_ptr(), g, s.raw()) }.unwrap();
    assert_eq!(read_back(&d, ro, g, &s), data, "one granule, two addresses");

    // SAFETY: as above; the call is refused before any copy is queued.
    let e = unsafe { d.memcpy_htod_async(ro, data.as_ptr(), 64, s.raw()) }.unwrap_err();
    assert_eq!(e.status(), EpmStatus::AccessDenied, "{e}");
    assert_eq!(d.memset_d8_async(ro, 0, 64, s.raw()).unwrap_err().status(), EpmStatus::AccessDenied);
    assert_eq!(d.memcpy_dtod_async(ro, rw, 64, s.raw()).unwrap_err().status(), EpmStatus::AccessDenied);
    assert_eq!(d.checksum_async(rw, 64, ro, s.raw()).unwrap_err().status(), EpmStatus::AccessDenied);
    // A "host" pointer that is one of our device addresses is checked as one.
    // SAFETY: refused before any copy is queued.
    let e = unsafe { d.memcpy_dtoh_async(ro as usize as *mut u8, rw, 64, s.raw()) }.unwrap_err();
    assert_eq!(e.status(), EpmStatus::AccessDenied, "D2H into a read-only VA: {e}");
    d.synchronize().expect("refused writes must not lose the context");
    assert_eq!(read_back(&d, rw, g, &s), data, "data intact");
    d.checksum_async(ro, g, rw, s.raw()).expect("kernels may read a read-only alias");
    s.synchronize().unwrap();

    assert_eq!(d.vmm_free_va(va, 2 * g).unwrap_err().status(), EpmStatus::InvalidState);
    assert_eq!(d.vmm_unmap(va, g / 2).unwrap_err().status(), EpmStatus::InvalidArgument);
    d.vmm_release(h).unwrap();
    d.vmm_unmap(va, 2 * g).unwrap();
    d.vmm_free_va(va, 2 * g).unwrap();
    let after = (d.live_counts(), d.driver_counts());
    assert_eq!(after.0, before.0, "nothing left live");
    let (b, a) = (before.1, after.1);
    assert_eq!(
        (
            a.vmm_create_calls - b.vmm_create_calls,
            a.vmm_map_calls - b.vmm_map_calls,
            a.vmm_set_access_calls - b.vmm_set_access_calls,
            a.vmm_unmap_calls - b.vmm_unmap_calls,
            a.vmm_release_calls - b.vmm_release_calls,
        ),
        (1, 2, 2, 2, 1)
    );
}

#[test]
#[ignore = "needs a CUDA GPU (EPM_DEVICE=cuda)"]
fn gpu_unknown_handles_and_pointers_are_errors() {
    let d = gpu();
    assert_eq!(d.stream_synchronize(RawStream(u64::MAX)).unwrap_err().status(), EpmStatus::InvalidHandle);
    assert_eq!(d.event_query(RawEvent(u64::MAX)).unwrap_err().status(), EpmStatus::InvalidHandle);
    assert_eq!(d.vmm_release(RawPhys(u64::MAX)).unwrap_err().status(), EpmStatus::InvalidHandle);
    assert_eq!(d.mem_free(0x1000).unwrap_err().status(), EpmStatus::InvalidArgument);
    let mut x = 0u8;
    // SAFETY: `x` was never pinned; the call must refuse it without touching it.
    let freed = unsafe { d.pinned_free(&mut x) };
    assert_eq!(freed.unwrap_err().status(), EpmStatus::InvalidArgument);
    // SAFETY: as above.
    let unregistered = unsafe { d.host_unregister(&mut x) };
    assert_eq!(unregistered.unwrap_err().status(), EpmStatus::InvalidArgument);
    let s = d.stream_create().unwrap();
    d.stream_destroy(s).unwrap();
    assert_eq!(d.stream_destroy(s).unwrap_err().status(), EpmStatus::InvalidHandle, "stale handle");

    // A second device on the same GPU shares the context, not the handles.
    let other = CudaDevice::new(0).unwrap();
    let (s, e) = (d.stream_create().unwrap(), d.event_create(false).unwrap());
    assert_eq!(other.stream_synchronize(s).unwrap_err().status(), EpmStatus::InvalidHandle);
    assert_eq!(other.event_query(e).unwrap_err().status(), EpmStatus::InvalidHandle);
    assert_eq!(d.stream_synchronize(RawStream(e.0)).unwrap_err().status(), EpmStatus::InvalidHandle, "event as stream");
    d.stream_destroy(s).unwrap();
    d.event_destroy(e).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU (EPM_DEVICE=cuda)"]
fn gpu_registered_range_is_page_locked_and_copies() {
    let d = gpu();
    let s = Stream::new(&d).unwrap();
    let n = 4 << 20;
    let mut src = random_bytes(11, n);
    let calls = d.driver_counts().host_register_calls;
    // SAFETY: `src` stays alive and unmoved until unregistered below.
    unsafe { d.host_register(src.as_mut_ptr(), n, true) }.unwrap();
    let made = d.driver_counts().host_register_calls - calls;
    assert!((1..=2).contains(&made), "{made} register calls");
    assert!(d.host_is_page_locked(src.as_ptr(), n));
    assert!(!d.host_is_page_locked(src.as_ptr(), n + 1));
    // SAFETY: as above.
    let again = unsafe { d.host_register(src.as_mut_ptr(), 8, false) };
    assert_eq!(again.unwrap_err().status(), EpmStatus::InvalidState);
    let dst = DeviceBuffer::new(&d, n).unwrap();
    // SAFETY: `src` is readable until the synchronize in read_back.
    unsafe { d.memcpy_htod_async(dst.ptr(), src.as_ptr(), n, s.raw()) }.unwrap();
    assert_eq!(read_back(&d, dst.ptr(), n, &s), src);
    // SAFETY: refused before any copy is queued (declared read-only).
    let e = unsafe { d.memcpy_dtoh_async(src.as_mut_ptr().add(64), dst.ptr(), 64, s.raw()) }.unwrap_err();
    assert_eq!(e.status(), EpmStatus::AccessDenied, "D2H into a read-only registration: {e}");
    // SAFETY: registered above; the copy completed.
    unsafe { d.host_unregister(src.as_mut_ptr()) }.unwrap();
    assert!(!d.host_is_page_locked(src.as_ptr(), n));
}

#[test]
#[ignore = "needs a CUDA GPU (EPM_DEVICE=cuda)"]
fn gpu_adopted_native_streams_are_forgotten_not_destroyed() {
    let d = gpu();
    let s = Stream::new(&d).unwrap();
    let native = d.stream_native(s.raw()).unwrap();
    assert_ne!(native, 0);
    let adopted = d.stream_wrap_native(native).unwrap();
    let buf = DeviceBuffer::new(&d, 64).unwrap();
    d.memset_d8_async(buf.ptr(), 5, 64, adopted).unwrap();
    d.stream_destroy(adopted).unwrap();
    d.memset_d8_async(buf.ptr(), 6, 64, s.raw()).expect("the owner's stream still works");
    assert_eq!(read_back(&d, buf.ptr(), 64, &s), [6; 64]);
    let legacy = d.stream_wrap_native(0).expect("the legacy default stream can be adopted");
    d.stream_synchronize(legacy).unwrap();
    d.stream_destroy(legacy).unwrap();
    // By the driver's names (what epm_stream_wrap_native takes, NULL being refused there):
    // CU_STREAM_LEGACY and CU_STREAM_PER_THREAD order work like any stream.
    for (name, native) in [("CU_STREAM_LEGACY", 1u64), ("CU_STREAM_PER_THREAD", 2)] {
        let s = d.stream_wrap_native(native).unwrap_or_else(|e| panic!("{name} can be adopted: {e}"));
        d.memset_d8_async(buf.ptr(), native as u8 + 10, 64, s).unwrap();
        let ev = d.event_create(false).unwrap();
        d.event_record(ev, s).unwrap();
        d.stream_wait_event(s, ev).unwrap();
        d.stream_synchronize(s).unwrap();
        assert_eq!(read_back(&d, buf.ptr(), 64, &Stream::new(&d).unwrap()), [native as u8 + 10; 64], "{name}");
        d.event_destroy(ev).unwrap();
        d.stream_destroy(s).unwrap();
    }
}

#[test]
#[ignore = "needs a CUDA GPU (EPM_DEVICE=cuda)"]
fn gpu_calls_from_any_thread_leave_the_callers_context_alone() {
    let d = gpu();
    std::thread::spawn(move || {
        let p = d.mem_alloc(1 << 20).unwrap();
        d.mem_free(p).unwrap();
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        unsafe { cu!(cuCtxGetCurrent(&mut cur)) }.unwrap();
        assert!(cur.is_null(), "a fresh thread's current context was left changed");
    })
    .join()
    .unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU (EPM_DEVICE=cuda)"]
fn gpu_drop_frees_what_callers_leaked() {
    let keep = gpu(); // holds the primary context, so only explicit frees return memory
    let (free0, _) = keep.mem_get_info().unwrap();
    {
        let d = CudaDevice::new(0).unwrap();
        let _ = d.mem_alloc(1 << 30).unwrap();
        let _ = d.stream_create().unwrap();
        let _ = d.event_create(false).unwrap();
        let _ = d.pinned_alloc(1 << 20).unwrap();
        let h = d.vmm_create(d.vmm_granularity()).unwrap();
        let va = d.vmm_reserve(d.vmm_granularity(), 0).unwrap();
        d.vmm_map(va, d.vmm_granularity(), h, 0).unwrap();
        assert!(d.live_counts().device_bytes >= 1 << 30);
    }
    let (free1, _) = keep.mem_get_info().unwrap();
    assert!(free1 + (512 << 20) >= free0, "1 GiB leaked past drop: free {free0} -> {free1}");
}

#[test]
#[ignore = "needs a CUDA GPU (EPM_DEVICE=cuda)"]
fn gpu_decode_kernel_is_bit_exact_and_refuses_bad_arguments() {
    // On the fake driver this decodes with its C reader of the format, a
    // second implementation; on a GPU it runs codec.ptx.
    let d = gpu();
    let before = fake_violations();
    crate::device::conformance::decode_is_bit_exact(&d).unwrap();
    crate::device::conformance::decode_bad_arguments_are_refused(&d).unwrap();
    crate::device::conformance::decode_pieces_are_bit_exact(&d).unwrap();
    assert_eq!(fake_violations(), before, "the fake driver saw bad decode launches");
}
