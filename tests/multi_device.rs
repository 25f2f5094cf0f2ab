//! Several devices in one process. On the host device (CI) the
//! two devices are two separate host-device instances (ordinals 0 and 1);
//! with EPM_DEVICE=cuda they are cuda:0 and cuda:1, and every test prints
//! "skipped: 1 device" and passes when the machine has only one GPU.
//!
//! What is shown: one host copy of the weights registered once feeds the
//! residency managers of both devices (no second registration, no staging,
//! per-device budgets and stats, refcounted unregistration), and device 1's
//! allocations, page-ins and KV sequences never touch device 0's memory.

use std::io::Write as _;
use std::sync::Arc;

use epmem::EpmStatus;
use epmem::device::{self, Device, DeviceBuffer, DeviceKind, DeviceSelect, HostRange, Stream, checksum_host};
use epmem::kv::{AdmitMode, KvConfig, KvLayout, KvPool, KvShape};
use epmem::residency::{ResidencyConfig, ResidencyManager, WeightId};
use epmem::transfer::pinning::{HostRegistration, SharedHostRegistration};

/// Devices 0 and 1 of the kind EPM_DEVICE names, or None (after saying
/// "skipped: 1 device") when there is no second one.
fn two() -> Option<(Arc<dyn Device>, Arc<dyn Device>)> {
    let d0 = device::open_from_env(0).expect("open device 0 (EPM_DEVICE)");
    // `auto` must not pair cuda:0 with a host device 1: ask for d0's kind.
    let select = match d0.info().kind {
        DeviceKind::Cuda => DeviceSelect::Cuda,
        DeviceKind::Host => DeviceSelect::Host,
    };
    match device::open(select, 1) {
        Ok(d1) => Some((d0, d1)),
        Err(e) if e.status() == EpmStatus::DeviceUnavailable => {
            // Straight to the fd, past libtest's capture of eprintln!, so the
            // GPU log says why a test passed without running.
            let _ = writeln!(std::io::stderr(), "skipped: 1 device ({})", e.message());
            None
        }
        Err(e) => panic!("opening device 1: {e}"),
    }
}

/// Page-aligned weights of pseudo-random bytes inside one buffer.
struct Weights {
    buf: Vec<u8>,
    base: usize,
    sizes: Vec<usize>,
}

const PAGE: usize = 4096;

impl Weights {
    fn new(sizes: &[usize], seed: u64) -> Self {
        let total: usize = sizes.iter().map(|s| s.next_multiple_of(PAGE)).sum();
        let mut buf = vec![0u8; total + PAGE];
        fastrand::Rng::with_seed(seed).fill(&mut buf);
        let base = buf.as_ptr().align_offset(PAGE);
        Self { buf, base, sizes: sizes.to_vec() }
    }
    fn offset(&self, i: usize) -> usize {
        self.base + self.sizes[..i].iter().map(|s| s.next_multiple_of(PAGE)).sum::<usize>()
    }
    fn range(&self, i: usize) -> HostRange {
        // SAFETY: inside `buf`, which outlives every manager and registration
        // of these tests and is never written after construction.
        unsafe { HostRange::new(self.buf.as_ptr().add(self.offset(i)), self.sizes[i]) }
    }
    fn whole(&self) -> HostRange {
        let n = self.offset(self.sizes.len()) - self.base;
        // SAFETY: as in `range`.
        unsafe { HostRange::new(self.buf.as_ptr().add(self.base), n) }
    }
    fn checksum(&self, i: usize) -> u64 {
        let o = self.offset(i);
        checksum_host(&self.buf[o..o + self.sizes[i]])
    }
}

fn cfg(budget: usize) -> ResidencyConfig {
    let mut c = ResidencyConfig::with_budget(budget);
    c.pool.max_bytes = 16 << 20;
    c.engine.chunk_bytes = 1 << 20;
    c.engine.fill_threads = 1;
    c.coalesce_below_bytes = 0;
    c
}

/// `steps` decode steps on `m`, every weight checksummed on `d` against the host bytes.
fn decode(d: &Arc<dyn Device>, m: &ResidencyManager, w: &Weights, ids: &[WeightId], steps: usize) {
    let s = Stream::new(d).unwrap();
    let slots = DeviceBuffer::new(d, 8 * ids.len()).unwrap();
    for step in 0..steps {
        for (i, &id) in ids.iter().enumerate() {
            let p = m.acquire(id, s.raw()).unwrap();
            d.checksum_async(p, w.sizes[i], slots.ptr() + 8 * i as u64, s.raw()).unwrap();
            m.release(id, s.raw()).unwrap();
        }
        let mut got = vec![0u64; ids.len()];
        // SAFETY: `got` is ours and read only after the synchronize.
        unsafe { d.memcpy_dtoh_async(got.as_mut_ptr().cast(), slots.ptr(), 8 * ids.len(), s.raw()).unwrap() };
        s.synchronize().unwrap();
        for (i, &g) in got.iter().enumerate() {
            assert_eq!(g, w.checksum(i), "device {} step {step}: weight {i} not bit-exact", d.info().ordinal);
        }
    }
}

#[test]
fn one_registration_feeds_two_managers_and_is_unregistered_after_the_last() {
    let Some((d0, d1)) = two() else { return };
    let sizes: Vec<usize> = (0..8).map(|i| (256 << 10) * (1 + i % 3)).collect();
    let total: usize = sizes.iter().sum();
    let w = Weights::new(&sizes, 18);
    let (live0, live1) = (d0.live_counts().host_registrations, d1.live_counts().host_registrations);
    let calls1 = d1.driver_counts().host_register_calls;

    let reg = SharedHostRegistration::new(&d0, w.whole()).unwrap();
    assert_eq!(d0.live_counts().host_registrations, live0 + 1);
    assert!(d1.host_is_page_locked(w.range(3).ptr(), w.sizes[3]), "device 1 sees device 0's portable registration");
    // The same bytes cannot be page-locked a second time, by either device.
    for d in [&d0, &d1] {
        let e = HostRegistration::new(d, w.range(0)).unwrap_err();
        assert_eq!(e.status(), EpmStatus::InvalidState, "{e}");
        let e = SharedHostRegistration::new(d, w.whole()).unwrap_err();
        assert_eq!(e.status(), EpmStatus::InvalidState, "{e}");
    }

    // Per-device budgets: device 0 holds everything, device 1 half of it.
    let m0 = ResidencyManager::new(&d0, cfg(total)).unwrap();
    let m1 = ResidencyManager::new(&d1, cfg(total / 2)).unwrap();
    let r0 = m0.attach_host_registration(&reg).unwrap();
    let r1 = m1.attach_host_registration(&reg).unwrap();
    assert_eq!(reg.attaches(), 2);
    let ids0: Vec<_> = (0..sizes.len()).map(|i| m0.register(w.range(i)).unwrap()).collect();
    let ids1: Vec<_> = (0..sizes.len()).map(|i| m1.register(w.range(i)).unwrap()).collect();
    m0.declare_cycle(&ids0).unwrap();
    m1.declare_cycle(&ids1).unwrap();
    // Both devices stream at once from the same host bytes.
    std::thread::scope(|s| {
        s.spawn(|| decode(&d0, &m0, &w, &ids0, 3));
        s.spawn(|| decode(&d1, &m1, &w, &ids1, 3));
    });
    m0.synchronize().unwrap();
    m1.synchronize().unwrap();
    let (s0, s1) = (m0.stats(), m1.stats());
    for (name, s) in [("device 0", &s0), ("device 1", &s1)] {
        assert!(s.page_ins > 0, "{name}: {s:?}");
        assert_eq!(s.staged_page_ins, 0, "{name}: every page-in copies straight from the shared bytes");
        assert_eq!(s.bypassed_page_ins, s.page_ins, "{name}");
        assert_eq!((s.source_registrations, s.register_refusals, s.registered_bytes), (0, 0, 0), "{name}");
        assert_eq!(s.attached_bytes, w.whole().len() as u64, "{name}");
    }
    assert_eq!((s0.budget_bytes, s1.budget_bytes), (total as u64, (total / 2) as u64));
    assert!(s1.peak_resident_bytes <= (total / 2) as u64, "device 1 stays in its own budget");
    assert!(s1.evictions > 0 && s0.evictions == 0, "half a budget evicts, a whole one does not");
    // No second registration: device 1 registered nothing at all.
    assert_eq!(d1.driver_counts().host_register_calls, calls1, "device 1 called host_register");
    assert_eq!(d1.live_counts().host_registrations, live1);
    assert_eq!(d0.live_counts().host_registrations, live0 + 1, "one registration for both devices");

    // Refcounted: the handle and device 0's attachment go; device 1 still
    // copies directly; the bytes are unregistered only when it detaches.
    drop(reg);
    m0.unregister_host_range(r0).unwrap();
    assert!(d0.host_is_page_locked(w.range(0).ptr(), w.sizes[0]));
    decode(&d1, &m1, &w, &ids1, 1);
    assert_eq!(m1.stats().staged_page_ins, 0);
    assert_eq!(m0.stats().attached_bytes, 0);
    m1.unregister_host_range(r1).unwrap();
    assert!(!d0.host_is_page_locked(w.range(0).ptr(), w.sizes[0]), "unregistered after the last detach");
    assert!(!d1.host_is_page_locked(w.range(0).ptr(), w.sizes[0]));
    assert_eq!(d0.live_counts().host_registrations, live0);
    assert_eq!(m1.unregister_host_range(r1).unwrap_err().status(), EpmStatus::InvalidArgument);
}

#[test]
fn a_destroyed_manager_detaches_and_the_bytes_can_be_registered_again() {
    let Some((d0, d1)) = two() else { return };
    let w = Weights::new(&[1 << 20], 7);
    let reg = SharedHostRegistration::new(&d1, w.whole()).unwrap();
    let m0 = ResidencyManager::new(&d0, cfg(2 << 20)).unwrap();
    m0.attach_host_registration(&reg).unwrap();
    assert_eq!(reg.holders(), 2);
    drop(reg);
    assert!(d0.host_is_page_locked(w.whole().ptr(), w.whole().len()), "the attachment keeps it");
    drop(m0);
    assert!(!d0.host_is_page_locked(w.whole().ptr(), w.whole().len()));
    // Nothing stale is left in the shared table: either device may register it now.
    let again = HostRegistration::new(&d0, w.whole()).unwrap();
    drop(again);
}

#[test]
fn device_1_allocations_page_ins_and_kv_never_touch_device_0() {
    let Some((d0, d1)) = two() else { return };
    let host = d0.info().kind == DeviceKind::Host;
    let before0 = d0.live_counts();
    let free0 = d0.mem_get_info().unwrap().0;

    // Plain allocations.
    let n = 64 << 20;
    let b1 = DeviceBuffer::new(&d1, n).unwrap();
    let b0 = DeviceBuffer::new(&d0, n).unwrap();
    let (a0, a1) = (b0.ptr(), b1.ptr());
    assert!(a1 + n as u64 <= a0 || a0 + n as u64 <= a1, "distinct address ranges");
    let s1 = Stream::new(&d1).unwrap();
    let s0 = Stream::new(&d0).unwrap();
    d1.memset_d8_async(a1, 0x11, n, s1.raw()).unwrap();
    d0.memset_d8_async(a0, 0x22, n, s0.raw()).unwrap();

    // Page-ins on device 1.
    let w = Weights::new(&[4 << 20, 4 << 20, 4 << 20], 3);
    let m1 = ResidencyManager::new(&d1, cfg(8 << 20)).unwrap();
    let ids: Vec<_> = (0..3).map(|i| m1.register(w.range(i)).unwrap()).collect();
    m1.declare_cycle(&ids).unwrap();
    decode(&d1, &m1, &w, &ids, 2);
    let p1 = m1.acquire(ids[0], s1.raw()).unwrap();

    // KV sequences on device 1.
    let layout = KvLayout::token_major(KvShape { layers: 4, kv_heads: 2, head_dim: 64, elem_bytes: 2 }).unwrap();
    let mut kv1 = KvPool::new(&d1, KvConfig::new(64 << 20)).unwrap();
    let seq = kv1.create_sequence(&layout, 4096, AdmitMode::OnDemand).unwrap();
    kv1.prepare_append(seq, 4096, s1.raw()).unwrap();
    let kv_base = kv1.sequence_info(seq).unwrap().base;
    let kv_bytes = (4096 * layout.bytes_per_token()) as usize;
    d1.memset_d8_async(kv_base, 0x33, kv_bytes, s1.raw()).unwrap();
    s1.synchronize().unwrap();
    s0.synchronize().unwrap();
    assert!(kv1.stats().ledger.owned_bytes > 0);

    // Device 0's ledgers did not move with device 1's work: only its own
    // buffer and stream are there.
    let after0 = d0.live_counts();
    assert_eq!(after0.device_allocations, before0.device_allocations + 1);
    assert_eq!(after0.device_bytes, before0.device_bytes + n as u64);
    assert_eq!(after0.physical_handles, before0.physical_handles, "device 1's arenas are not device 0's");
    assert_eq!(after0.physical_bytes, before0.physical_bytes);
    assert_eq!(after0.va_reservations, before0.va_reservations);
    assert_eq!(after0.mappings, before0.mappings);
    assert!(d1.live_counts().physical_handles > 0);
    // Device 0's bytes are intact.
    let mut back = vec![0u8; n];
    // SAFETY: `back` is ours and read after the synchronize.
    unsafe { d0.memcpy_dtoh_async(back.as_mut_ptr(), a0, n, s0.raw()).unwrap() };
    s0.synchronize().unwrap();
    assert!(back.iter().all(|&b| b == 0x22), "device 0's buffer was written by device 1's work");
    for (p, len, what) in [(a1, n, "buffer"), (p1, 4 << 20, "page-in"), (kv_base, kv_bytes, "KV sequence")] {
        assert!(p + len as u64 <= a0 || a0 + n as u64 <= p, "device 1's {what} overlaps device 0's buffer");
    }
    if host {
        // Each host device checks every copy against its own address space:
        // device 1's addresses are not device 0's memory, and back.
        for (d, s, p, what) in [
            (&d0, &s0, a1, "device 1's buffer"),
            (&d0, &s0, kv_base, "device 1's KV"),
            (&d1, &s1, a0, "device 0's buffer"),
        ] {
            let e = d.memset_d8_async(p, 0, 4096, s.raw()).unwrap_err();
            assert!(
                matches!(e.status(), EpmStatus::InvalidArgument | EpmStatus::AccessDenied),
                "{what} on the other device: {e}"
            );
        }
        // (The host device reports system RAM as free memory for every
        // instance, so the per-device ledgers above are its evidence.)
    } else {
        // CUDA: device 0's free memory did not drop by device 1's 64 MiB +
        // arenas; its own 64 MiB buffer is the only large change.
        let free0_after = d0.mem_get_info().unwrap().0;
        let drop0 = free0.saturating_sub(free0_after);
        assert!(drop0 < n as u64 + (32 << 20), "cuda:0 free memory fell {drop0} B: more than its own buffer");
    }
    m1.release(ids[0], s1.raw()).unwrap();
}

/// Runs on one GPU too (two instances of device 0, as two processes'
/// libraries or two frameworks in one process would open it): the driver
/// accepts PORTABLE|READ_ONLY, the second instance sees the bytes as
/// page-locked and copies from them bit-exactly, neither instance may
/// register them again, and after the last holder nothing stays registered.
#[test]
fn a_portable_registration_serves_a_second_instance_of_the_same_device() {
    let a = device::open_from_env(0).expect("open device 0");
    let select = if a.info().kind == DeviceKind::Cuda { DeviceSelect::Cuda } else { DeviceSelect::Host };
    let b = device::open(select, 0).expect("open device 0 again");
    let w = Weights::new(&[3 << 20], 11);
    let whole = w.whole();
    let (la, calls_b) = (a.live_counts().host_registrations, b.driver_counts().host_register_calls);
    let reg = SharedHostRegistration::new(&a, whole).unwrap();
    assert!(b.host_is_page_locked(whole.ptr(), whole.len()));
    assert!(!b.host_is_page_locked(whole.ptr(), whole.len() + PAGE), "past the end is not page-locked");
    for d in [&a, &b] {
        assert_eq!(HostRegistration::new(d, whole).unwrap_err().status(), EpmStatus::InvalidState);
    }
    let s = Stream::new(&b).unwrap();
    let buf = DeviceBuffer::new(&b, whole.len()).unwrap();
    let out = DeviceBuffer::new(&b, 8).unwrap();
    // SAFETY: the registered range outlives the copy (synchronized below).
    unsafe { b.memcpy_htod_async(buf.ptr(), whole.ptr(), whole.len(), s.raw()).unwrap() };
    b.checksum_async(buf.ptr(), w.sizes[0], out.ptr(), s.raw()).unwrap();
    let mut sum = 0u64;
    // SAFETY: `sum` is ours and read after the synchronize.
    unsafe { b.memcpy_dtoh_async((&mut sum as *mut u64).cast(), out.ptr(), 8, s.raw()).unwrap() };
    s.synchronize().unwrap();
    assert_eq!(sum, w.checksum(0), "a copy from the shared registration by the second instance");
    let m = ResidencyManager::new(&b, cfg(4 << 20)).unwrap();
    m.attach_host_registration(&reg).unwrap();
    let id = m.register(w.range(0)).unwrap();
    m.acquire(id, s.raw()).unwrap();
    m.release(id, s.raw()).unwrap();
    m.synchronize().unwrap();
    let st = m.stats();
    assert_eq!((st.bypassed_page_ins, st.staged_page_ins, st.source_registrations), (1, 0, 0), "{st:?}");
    assert_eq!(b.driver_counts().host_register_calls, calls_b, "the second instance registered nothing");
    drop(reg);
    drop(m);
    assert_eq!(a.live_counts().host_registrations, la);
    assert!(!b.host_is_page_locked(whole.ptr(), whole.len()));
}
