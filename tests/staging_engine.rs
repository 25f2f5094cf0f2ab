//! The copy engine: bit-exact page-ins through the staged and the direct
//! path, stream ordering by event, steady state without pinned allocations.
//! Runs on the device EPM_DEVICE names (host in CI, cuda on the GPU machine).

mod staging_util;

use std::sync::Arc;
use std::time::Duration;

use epmem::EpmStatus;
use epmem::device::HostRange;
use epmem::device::{Device, DeviceBuffer, Gate, Stream};
use epmem::staging::background::Hint;
use epmem::staging::{BackgroundFill, CopyEngine, EngineConfig, HostRegistration, PinnedStagingPool, PoolConfig};
use staging_util::{dev, first_diff, leak_range, random_bytes, read_back};

const MIB: usize = 1 << 20;
/// Opens a gate only on the failure path (a call that wrongly blocked on
/// the held stream); a passing test never waits for it.
const WATCHDOG: Duration = Duration::from_secs(60);

fn engine(d: &Arc<dyn Device>, cfg: EngineConfig) -> CopyEngine {
    let pool = PinnedStagingPool::new(d, PoolConfig::default()).unwrap();
    CopyEngine::new(&pool, cfg).unwrap()
}

fn small_engine(d: &Arc<dyn Device>) -> CopyEngine {
    // Small slots so modest test sizes still cross many chunks and slots.
    engine(d, EngineConfig { chunk_bytes: MIB, fill_threads: 4, ..EngineConfig::default() })
}

fn assert_same(got: &[u8], want: &[u8], what: &str) {
    if let Some(i) = first_diff(got, want) {
        panic!("{what}: first difference at byte {i} of {}", want.len());
    }
}

/// Chunks a staged copy of `n` bytes is cut into.
fn chunk_count(e: &CopyEngine, n: usize) -> usize {
    let (chunk, mut left, mut count) = (e.chunk_len(n), n, 0);
    while left > 0 {
        left -= e.next_chunk_len(chunk, left);
        count += 1;
    }
    count
}

#[test]
fn staged_copies_of_random_data_are_bit_exact() {
    let d = dev();
    let e = small_engine(&d);
    let s = Stream::new(&d).unwrap();
    let sizes = [1, 4095, MIB - 1, MIB, 3 * MIB + 4097, 9 * MIB + 13];
    let mut chunks = 0;
    for (i, &n) in sizes.iter().enumerate() {
        let src = random_bytes(n, i as u64 + 1);
        let dst = DeviceBuffer::new(&d, n).unwrap();
        let f = e.htod(dst.ptr(), leak_range(src.clone()), None).unwrap();
        assert!(!f.direct() && f.bytes() == n);
        f.make_wait(s.raw()).unwrap();
        assert_same(&read_back(&d, &s, dst.ptr(), n), &src, &format!("{n} bytes"));
        chunks += chunk_count(&e, n);
    }
    e.synchronize().unwrap();
    let st = e.stats();
    let total: usize = sizes.iter().sum();
    assert_eq!((st.copies, st.bypassed, st.htod_bytes), (sizes.len() as u64, 0, total as u64), "{st:?}");
    assert_eq!(st.chunks, chunks as u64);
    assert_eq!(st.timed_copies, st.copies, "every copy's time read after synchronize");
    assert!(st.fill_ms > 0.0 && st.htod_ms > 0.0, "{st:?}");
    assert!(st.pinned_alloc_calls <= e.config().slots as u64, "at most one allocation per slot: {st:?}");
}

#[test]
fn chunking_cuts_big_copies_into_many_slot_sized_pieces() {
    let d = dev();
    let e = engine(&d, EngineConfig::default());
    let c = e.config().chunk_bytes;
    assert_eq!(e.chunk_len(1), MIB, "never below 1 MiB");
    assert_eq!(e.chunk_len(32 * MIB), 8 * MIB, "32 MiB: 4 chunks");
    assert_eq!(e.chunk_len(8 * MIB), 2 * MIB, "8 MiB: 4 chunks");
    assert_eq!(e.chunk_len(128 * MIB), 16 * MIB, "128 MiB: 8 chunks of the 16 MiB slot");
    assert_eq!(e.chunk_len(1 << 30), c, "never above the slot size");
    let e8 = engine(&d, EngineConfig { target_chunks: 8, chunk_bytes: 32 * MIB, ..EngineConfig::default() });
    assert_eq!(e8.chunk_len(32 * MIB), 4 * MIB, "32 MiB in 8 chunks");
    // The tail halves down to 1 MiB: 7 x 16, then 8, 4, 2, 1, 1.
    let mut left = 128 * MIB;
    let mut seq = Vec::new();
    while left > 0 {
        let n = e.next_chunk_len(16 * MIB, left);
        seq.push(n / MIB);
        left -= n;
    }
    assert_eq!(seq, [16, 16, 16, 16, 16, 16, 16, 8, 4, 2, 1, 1]);
    assert_eq!(chunk_count(&e, 2 * MIB), 2, "small copies: 1 MiB chunks as before");
    assert_eq!(chunk_count(&e, 32 * MIB), 7, "32 MiB: 3 x 8 MiB, then 4, 2, 1, 1");
    assert_eq!(e.next_chunk_len(MIB, 3 * MIB + 5), MIB, "never above the chunk");
    assert_eq!(e.next_chunk_len(16 * MIB, 700), 700, "never past the end");
}

/// `split_tail` false (a residency manager's engine; C
/// `EPM_COPY_ENGINE_NO_SPLIT_TAIL`): full chunks to the end, so a copy that
/// the next one follows at once does not end in small chunks; the bytes are
/// the same, and chunks filled ahead are cut the same way and used.
#[test]
fn whole_tail_cuts_full_chunks_to_the_end_and_stays_bit_exact() {
    let d = dev();
    let whole = EngineConfig { split_tail: false, ..EngineConfig::default() };
    let e = engine(&d, whole);
    assert_eq!(chunk_count(&e, 32 * MIB), 4, "32 MiB: 4 x 8 MiB, no halving tail");
    assert_eq!(chunk_count(&e, 128 * MIB), 8, "128 MiB: 8 x 16 MiB");
    assert_eq!(e.next_chunk_len(16 * MIB, 6 * MIB + 5), 6 * MIB + 5, "the rest, when less than a chunk");
    assert_eq!(e.next_chunk_len(16 * MIB, 700), 700, "never past the end");
    assert_eq!(chunk_count(&engine(&d, EngineConfig::default()), 32 * MIB), 7, "the default still halves");
    let e =
        engine(&d, EngineConfig { chunk_bytes: MIB, fill_threads: 4, split_tail: false, ..EngineConfig::default() });
    let s = Stream::new(&d).unwrap();
    // Plain stores only (stream_below 0): the same bytes.
    let plain =
        engine(&d, EngineConfig { chunk_bytes: MIB, fill_threads: 4, stream_below: 0, ..EngineConfig::default() });
    for (i, n) in [4095, 5 * MIB + 7].into_iter().enumerate() {
        let src = random_bytes(n, i as u64 + 60);
        let dst = DeviceBuffer::new(&d, n).unwrap();
        plain.htod(dst.ptr(), leak_range(src.clone()), None).unwrap().make_wait(s.raw()).unwrap();
        assert_same(&read_back(&d, &s, dst.ptr(), n), &src, &format!("{n} bytes, plain stores"));
    }
    let sizes = [1, MIB - 1, 3 * MIB + 4097, 9 * MIB + 13];
    let mut chunks = 0;
    for (i, &n) in sizes.iter().enumerate() {
        let src = random_bytes(n, i as u64 + 40);
        let dst = DeviceBuffer::new(&d, n).unwrap();
        let f = e.htod(dst.ptr(), leak_range(src.clone()), None).unwrap();
        f.make_wait(s.raw()).unwrap();
        assert_same(&read_back(&d, &s, dst.ptr(), n), &src, &format!("{n} bytes, whole tail"));
        chunks += chunk_count(&e, n);
    }
    // Filled ahead with the same cut: every chunk is used, the bytes exact.
    let n = 3 * MIB + 4097;
    let src = random_bytes(n, 99);
    let range = leak_range(src.clone());
    e.fill_ahead(range, e.ahead_ticket(), 3, &mut || false);
    let dst = DeviceBuffer::new(&d, n).unwrap();
    e.htod(dst.ptr(), range, None).unwrap().make_wait(s.raw()).unwrap();
    assert_same(&read_back(&d, &s, dst.ptr(), n), &src, "filled ahead, whole tail");
    chunks += chunk_count(&e, n);
    e.synchronize().unwrap();
    let st = e.stats();
    assert_eq!(st.chunks, chunks as u64, "{st:?}");
    assert_eq!(st.ahead_used_bytes, 3 * MIB as u64, "the three full chunks filled ahead were used: {st:?}");
}

#[test]
fn direct_path_copies_registered_memory_without_staging() {
    let d = dev();
    let e = small_engine(&d);
    let s = Stream::new(&d).unwrap();
    let n = 5 * MIB + 123;
    let src = random_bytes(n, 77);
    let range = leak_range(src.clone());
    let reg = e.register(range).unwrap();
    assert!(d.host_is_page_locked(range.ptr(), range.len()));
    let dst = DeviceBuffer::new(&d, n).unwrap();
    let f = e.htod(dst.ptr(), range, None).unwrap();
    assert!(f.direct());
    f.make_wait(s.raw()).unwrap();
    assert_same(&read_back(&d, &s, dst.ptr(), n), &src, "direct path");
    // A sub-range of a registered range is page-locked too.
    let dst2 = DeviceBuffer::new(&d, MIB).unwrap();
    let f2 = e.htod(dst2.ptr(), range.slice(MIB, MIB).unwrap(), Some(s.raw())).unwrap();
    assert!(f2.direct());
    assert_same(&read_back(&d, &s, dst2.ptr(), MIB), &src[MIB..2 * MIB], "direct sub-range");
    let st = e.stats();
    assert_eq!((st.copies, st.bypassed, st.chunks, st.pinned_alloc_calls), (2, 2, 0, 0), "no staging, no fill: {st:?}");
    assert_eq!(st.fill_ms, 0.0);
    drop(reg);
    assert!(!d.host_is_page_locked(range.ptr(), range.len()), "unregistered on drop");
    // The same range, now pageable again, is staged.
    let f3 = e.htod(dst.ptr(), range, Some(s.raw())).unwrap();
    assert!(!f3.direct());
    assert_same(&read_back(&d, &s, dst.ptr(), n), &src, "staged after unregister");
}

#[test]
fn direct_path_can_be_switched_off() {
    let d = dev();
    let e = engine(&d, EngineConfig { chunk_bytes: MIB, direct: false, ..EngineConfig::default() });
    let range = leak_range(random_bytes(2 * MIB, 5));
    let _reg = e.register(range).unwrap();
    let dst = DeviceBuffer::new(&d, 2 * MIB).unwrap();
    let f = e.htod(dst.ptr(), range, None).unwrap();
    assert!(!f.direct());
    f.wait().unwrap();
}

/// The consumer stream is ordered after the copy by an event, and the copy
/// after the work already on the caller's stream — with no host wait: the
/// producer is held on a gate the test opens only after `htod` returned, so
/// the copy cannot have run when `htod` returns, and an `htod` that waited
/// on the producer would return only when the watchdog opened the gate.
/// (The copy fits in the engine's slots: 3 chunks of 1 MiB; a bigger one
/// would wait for a slot, by design.)
fn ordering_case(register: bool) {
    let d = dev();
    let e = small_engine(&d);
    let (producer, consumer) = (Stream::new(&d).unwrap(), Stream::new(&d).unwrap());
    let n = 2 * MIB + 5;
    let src = random_bytes(n, 99);
    let range = leak_range(src.clone());
    let _reg = register.then(|| e.register(range).unwrap());
    let dst = DeviceBuffer::new(&d, n).unwrap();
    d.memset_d8_async(dst.ptr(), 0, n, producer.raw()).unwrap();
    let gate = Gate::new();
    let wd = gate.watchdog(WATCHDOG);
    d.hold_async(producer.raw(), &gate).unwrap();
    let f = e.htod(dst.ptr(), range, Some(producer.raw())).unwrap();
    assert!(!wd.fired(), "htod waited for the producer's work (the watchdog had to open its gate)");
    assert_eq!(f.direct(), register);
    assert!(!f.query().unwrap(), "the copy cannot have run: it waits behind the producer's held work");
    f.make_wait(consumer.raw()).unwrap();
    gate.open();
    assert_same(&read_back(&d, &consumer, dst.ptr(), n), &src, "consumer after the fence");
    assert!(f.query().unwrap());
}

#[test]
fn a_stream_waiting_on_the_fence_sees_the_data_staged() {
    ordering_case(false);
}

#[test]
fn a_stream_waiting_on_the_fence_sees_the_data_direct() {
    ordering_case(true);
}

/// 7 chunks through 3 slots behind a held producer: no chunk copy can
/// complete until the gate opens, so `htod` can finish only by waiting for
/// slots, and only the watchdog opens the gate. It must have fired by the
/// time `htod` returns (an engine without back-pressure returns at once,
/// before it), and the 7 chunks used only the 3 slots' buffers.
#[test]
fn a_copy_bigger_than_the_slots_waits_for_slots_and_stays_exact() {
    let d = dev();
    let e = small_engine(&d);
    let producer = Stream::new(&d).unwrap();
    let n = 6 * MIB + 1; // 7 chunks through 3 slots
    let src = random_bytes(n, 1234);
    let dst = DeviceBuffer::new(&d, n).unwrap();
    let gate = Gate::new();
    let wd = gate.watchdog(std::time::Duration::from_millis(200));
    d.hold_async(producer.raw(), &gate).unwrap();
    let f = e.htod(dst.ptr(), leak_range(src.clone()), Some(producer.raw())).unwrap();
    assert!(wd.fired(), "a copy of 7 chunks through 3 slots returned while no chunk could complete");
    assert_same(&read_back(&d, &producer, dst.ptr(), n), &src, "through reused slots");
    assert!(f.query().unwrap());
    let st = e.stats();
    assert_eq!(st.chunks, 7);
    assert_eq!(st.pinned_alloc_calls, 3, "7 chunks reused the 3 slots' buffers: {st:?}");
    assert!(st.slot_wait_ms > 0.0, "{st:?}");
}

/// The first staged copy reserves a buffer for every slot, so however later
/// copies overlap (here: one chunk first, then seven through three slots
/// behind a held stream, the most a copy can have on loan) staging allocates
/// nothing more. Lazily, the first copy allocated one buffer and the second
/// two more: a steady state measured after a short warm-up could still see
/// an allocation (the residency bench's smoke test did, about one run in 8).
#[test]
fn the_first_staged_copy_reserves_every_slot() {
    let d = dev();
    let e = small_engine(&d);
    let slots = e.config().slots as u64;
    let dst = DeviceBuffer::new(&d, 8 * MIB).unwrap();
    let small = random_bytes(64 << 10, 5);
    e.htod(dst.ptr(), leak_range(small.clone()), None).unwrap().wait().unwrap();
    assert_eq!(e.stats().pinned_alloc_calls, slots, "one buffer per slot at the first staged copy");
    let producer = Stream::new(&d).unwrap();
    let gate = Gate::new();
    let wd = gate.watchdog(std::time::Duration::from_millis(200));
    d.hold_async(producer.raw(), &gate).unwrap();
    let n = 6 * MIB + 1;
    let src = random_bytes(n, 6);
    e.htod(dst.ptr(), leak_range(src.clone()), Some(producer.raw())).unwrap();
    assert!(wd.fired());
    assert_same(&read_back(&d, &producer, dst.ptr(), n), &src, "through the reserved slots");
    e.synchronize().unwrap();
    let st = e.stats();
    assert_eq!(st.pinned_alloc_calls, slots, "no allocation after the reserve: {st:?}");
    assert_eq!(st.retained_buffers, slots, "{st:?}");
}

#[test]
fn steady_state_makes_no_pinned_allocations() {
    let d = dev();
    let e = small_engine(&d);
    let sizes = [MIB / 2, 3 * MIB, 7 * MIB + 1, 64 << 10];
    let dst = DeviceBuffer::new(&d, 8 * MIB).unwrap();
    let srcs: Vec<_> = sizes.iter().map(|&n| leak_range(random_bytes(n, n as u64))).collect();
    for r in &srcs {
        e.htod(dst.ptr(), *r, None).unwrap();
    }
    e.synchronize().unwrap();
    let (warm, driver_warm) = (e.stats(), d.driver_counts());
    for _ in 0..10 {
        for r in &srcs {
            e.htod(dst.ptr(), *r, None).unwrap();
        }
    }
    e.synchronize().unwrap();
    let st = e.stats();
    assert_eq!(st.pinned_alloc_calls, warm.pinned_alloc_calls, "{st:?}");
    assert_eq!(st.pinned_free_calls, warm.pinned_free_calls);
    assert_eq!(d.driver_counts().pinned_alloc_calls, driver_warm.pinned_alloc_calls, "device agrees");
    assert!(st.pinned_reuses > warm.pinned_reuses);
    assert_eq!(st.retained_buffers, e.config().slots as u64, "after synchronize every slot is back in the pool");
}

#[test]
fn concurrent_callers_each_get_their_own_bytes() {
    let d = dev();
    let e = Arc::new(small_engine(&d));
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let (d, e) = (d.clone(), e.clone());
            std::thread::spawn(move || {
                let s = Stream::new(&d).unwrap();
                for i in 0..4 {
                    let n = MIB + t * 4096 + i;
                    let src = random_bytes(n, (t * 10 + i) as u64);
                    let dst = DeviceBuffer::new(&d, n).unwrap();
                    e.htod(dst.ptr(), leak_range(src.clone()), Some(s.raw())).unwrap();
                    assert_same(&read_back(&d, &s, dst.ptr(), n), &src, "concurrent caller");
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    assert_eq!(e.stats().copies, 16);
}

#[test]
fn empty_copies_complete_and_bad_input_is_an_error() {
    let d = dev();
    let e = small_engine(&d);
    let dst = DeviceBuffer::new(&d, MIB).unwrap();
    let f = e.htod(dst.ptr(), leak_range(Vec::new()), None).unwrap();
    f.wait().unwrap();
    assert!(f.query().unwrap() && f.bytes() == 0);
    assert_eq!(e.stats().copies, 0);
    // A device address nobody allocated: an error, not a crash; the engine
    // keeps working afterwards.
    assert!(e.htod(0x10, leak_range(vec![1u8; 4096]), None).is_err());
    let src = random_bytes(MIB, 3);
    let s = Stream::new(&d).unwrap();
    e.htod(dst.ptr(), leak_range(src.clone()), Some(s.raw())).unwrap();
    assert_same(&read_back(&d, &s, dst.ptr(), MIB), &src, "after an error");
}

#[test]
fn configurations_outside_the_bounds_are_rejected() {
    let d = dev();
    let pool = PinnedStagingPool::new(&d, PoolConfig { max_buffers: 8, max_bytes: 16 * MIB }).unwrap();
    let bad = |cfg: EngineConfig| CopyEngine::new(&pool, cfg).unwrap_err().status();
    let ok = EngineConfig { chunk_bytes: 4 * MIB, ..EngineConfig::default() };
    assert!(CopyEngine::new(&pool, ok).is_ok());
    assert_eq!(bad(EngineConfig { slots: 1, ..ok }), EpmStatus::InvalidConfig);
    assert_eq!(bad(EngineConfig { slots: 5, ..ok }), EpmStatus::InvalidConfig);
    assert_eq!(bad(EngineConfig { chunk_bytes: MIB / 2, ..ok }), EpmStatus::InvalidConfig);
    assert_eq!(bad(EngineConfig { chunk_bytes: 8 * MIB, ..ok }), EpmStatus::InvalidConfig, "3 x 8 MiB > 16 MiB pool");
    assert_eq!(bad(EngineConfig { target_chunks: 0, ..ok }), EpmStatus::InvalidConfig);
    assert_eq!(bad(EngineConfig { fill_threads: 0, ..ok }), EpmStatus::InvalidConfig);
    assert_eq!(bad(EngineConfig { fill_threads: 65, ..ok }), EpmStatus::InvalidConfig);
}

// ---- the background filler (staging::background) --------------------------

fn background(d: &Arc<dyn Device>) -> (Arc<CopyEngine>, BackgroundFill) {
    let e = Arc::new(small_engine(d));
    let b = BackgroundFill::new(&e, 0).unwrap();
    (e, b)
}

#[test]
fn a_background_copy_is_pending_until_the_filler_enqueues_it_then_bit_exact() {
    let d = dev();
    let (e, bg) = background(&d);
    let held = Stream::new(&d).unwrap();
    let gate = Gate::new();
    let wd = gate.watchdog(WATCHDOG);
    d.hold_async(held.raw(), &gate).unwrap();
    // Ordered after the held stream, the first copy's DMA cannot start, so its
    // fill stops at the fourth of eight 1 MiB chunks (3 slots): the filler is
    // stuck in that job, the second job waits behind it, and neither fence has
    // an event yet.
    let (n1, n2) = (8 * MIB, 3 * MIB + 5);
    let (src1, src2) = (random_bytes(n1, 71), random_bytes(n2, 72));
    let (dst1, dst2) = (DeviceBuffer::new(&d, n1).unwrap(), DeviceBuffer::new(&d, n2).unwrap());
    let f1 = bg.htod_after(dst1.ptr(), leak_range(src1.clone()), Some(held.raw()), None).unwrap();
    let f2 = bg.htod_after(dst2.ptr(), leak_range(src2.clone()), None, None).unwrap();
    // Wait (for progress, not for time) until the filler is as far into the
    // first job as the slots let it go: `slots - 1` chunks enqueued, the next
    // filled and waiting for a slot the held stream keeps busy.
    let stuck_at = e.config().slots as u64 - 1;
    let t0 = std::time::Instant::now();
    while e.stats().chunks < stuck_at {
        assert!(t0.elapsed() < WATCHDOG, "the filler never started the first copy: {:?}", e.stats());
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(f1.is_pending() && f2.is_pending(), "the copies were enqueued past a held stream");
    assert_eq!(e.stats().chunks, stuck_at, "chunks enqueued past the slots of a held stream");
    assert!(!f1.query().unwrap() && !f2.query().unwrap(), "a pending copy is not complete");
    assert!(!f1.direct() && f1.bytes() == n1);
    gate.open();
    // make_wait waits (on the host) for the event to exist: a stream never
    // waits on an event not yet recorded.
    let s = Stream::new(&d).unwrap();
    f2.make_wait(s.raw()).unwrap();
    f1.make_wait(s.raw()).unwrap();
    assert!(!f1.is_pending() && !f2.is_pending());
    assert_same(&read_back(&d, &s, dst1.ptr(), n1), &src1, "first background copy");
    assert_same(&read_back(&d, &s, dst2.ptr(), n2), &src2, "second background copy");
    bg.drain();
    e.synchronize().unwrap();
    assert!(!wd.fired(), "the watchdog opened the gate: something waited on the held stream");
    let st = e.stats();
    assert_eq!((st.copies, st.htod_bytes), (2, (n1 + n2) as u64), "{st:?}");
}

#[test]
fn dropping_the_filler_issues_every_queued_copy_first() {
    let d = dev();
    let (e, bg) = background(&d);
    let n = 2 * MIB + 77;
    let jobs: Vec<_> = (0..6)
        .map(|i| {
            let src = random_bytes(n, 100 + i);
            let dst = DeviceBuffer::new(&d, n).unwrap();
            let f = bg.htod_after(dst.ptr(), leak_range(src.clone()), None, None).unwrap();
            (src, dst, f)
        })
        .collect();
    drop(bg);
    let s = Stream::new(&d).unwrap();
    for (i, (src, dst, f)) in jobs.iter().enumerate() {
        assert!(!f.is_pending(), "copy {i} still pending after the filler was dropped");
        f.make_wait(s.raw()).unwrap();
        assert_same(&read_back(&d, &s, dst.ptr(), n), src, &format!("copy {i}"));
    }
    assert_eq!(e.stats().copies, 6);
}

#[test]
fn a_background_copy_that_fails_reports_the_error_on_its_fence_and_the_filler_goes_on() {
    use epmem::device::fault::{FaultKind, FaultyDevice};
    let inner = dev();
    let fd = Arc::new(FaultyDevice::new(inner));
    let d: Arc<dyn Device> = fd.clone();
    let (_e, bg) = background(&d);
    let n = 3 * MIB;
    let (src, dst) = (random_bytes(n, 9), DeviceBuffer::new(&d, n).unwrap());
    fd.fail_nth(FaultKind::Copy, 2);
    let bad = bg.htod_after(dst.ptr(), leak_range(src.clone()), None, None).unwrap();
    let s = Stream::new(&d).unwrap();
    let err = bad.make_wait(s.raw()).unwrap_err();
    assert!(err.to_string().contains("injected fault"), "{err}");
    // The same error from every way of observing the fence.
    assert!(bad.ready().is_err() && bad.wait().is_err() && bad.query().is_err());
    d.synchronize().unwrap();
    let good = bg.htod_after(dst.ptr(), leak_range(src.clone()), None, None).unwrap();
    good.make_wait(s.raw()).unwrap();
    assert_same(&read_back(&d, &s, dst.ptr(), n), &src, "the copy after a failed one");
}

#[test]
fn a_page_locked_source_is_copied_directly_not_queued() {
    let d = dev();
    let (_e, bg) = background(&d);
    let n = 2 * MIB;
    let src = random_bytes(n, 5);
    let range = leak_range(src.clone());
    let reg = HostRegistration::new(&d, range).unwrap();
    let dst = DeviceBuffer::new(&d, n).unwrap();
    let f = bg.htod_after(dst.ptr(), range, None, None).unwrap();
    assert!(f.direct() && !f.is_pending(), "a registered source needs no fill, so no queue");
    let s = Stream::new(&d).unwrap();
    f.make_wait(s.raw()).unwrap();
    assert_same(&read_back(&d, &s, dst.ptr(), n), &src, "direct copy");
    f.wait().unwrap();
    drop(reg);
}

// ---- filling ahead (CopyEngine::fill_ahead) ----------------------------------

/// Bytes in the first `k` chunks of a staged copy of `n` bytes.
fn first_chunks_bytes(e: &CopyEngine, n: usize, k: usize) -> usize {
    let (chunk, mut left, mut bytes) = (e.chunk_len(n), n, 0);
    for _ in 0..k {
        if left == 0 {
            break;
        }
        let c = e.next_chunk_len(chunk, left);
        left -= c;
        bytes += c;
    }
    bytes
}

#[test]
fn chunks_filled_ahead_start_the_next_copy_of_that_source_bit_exact() {
    let d = dev();
    let e = small_engine(&d);
    let s = Stream::new(&d).unwrap();
    let n = 5 * MIB + 3;
    let src = random_bytes(n, 41);
    let range = leak_range(src.clone());
    e.fill_ahead(range, e.ahead_ticket(), 2, &mut || false);
    let filled = first_chunks_bytes(&e, n, 2);
    let st = e.stats();
    assert_eq!((st.ahead_bytes, st.ahead_used_bytes, st.copies), (filled as u64, 0, 0), "{st:?}");
    // Asking again fills nothing more: two chunks are there.
    e.fill_ahead(range, e.ahead_ticket(), 2, &mut || false);
    assert_eq!(e.stats().ahead_bytes, filled as u64);
    let dst = DeviceBuffer::new(&d, n).unwrap();
    let f = e.htod(dst.ptr(), range, None).unwrap();
    f.make_wait(s.raw()).unwrap();
    assert_same(&read_back(&d, &s, dst.ptr(), n), &src, "a copy that started from chunks filled ahead");
    e.synchronize().unwrap();
    let st = e.stats();
    assert_eq!(st.ahead_used_bytes, filled as u64, "the copy filled its first chunks again: {st:?}");
    assert_eq!(st.chunks as usize, chunk_count(&e, n), "every chunk, filled ahead or not, is copied once: {st:?}");
    // No more buffers than slots, whichever way they were filled.
    assert!(st.pinned_alloc_calls as usize <= e.config().slots, "{st:?}");
    // A second copy of the same source fills everything itself.
    let f = e.htod(dst.ptr(), range, None).unwrap();
    f.make_wait(s.raw()).unwrap();
    assert_same(&read_back(&d, &s, dst.ptr(), n), &src, "the next copy");
    assert_eq!(e.stats().ahead_used_bytes, filled as u64);
}

#[test]
fn chunks_filled_ahead_for_another_source_are_only_buffers() {
    let d = dev();
    let e = small_engine(&d);
    let s = Stream::new(&d).unwrap();
    let n = 4 * MIB;
    let (a, b) = (random_bytes(n, 42), random_bytes(n, 43));
    let (ra, rb) = (leak_range(a.clone()), leak_range(b.clone()));
    // Every slot filled ahead with A's bytes, then a copy of B of the same
    // length: it must fill all of B (and use A's buffers as its slots).
    e.fill_ahead(ra, e.ahead_ticket(), e.config().slots, &mut || false);
    assert_eq!(e.stats().ahead_bytes as usize, first_chunks_bytes(&e, n, e.config().slots));
    let dst = DeviceBuffer::new(&d, n).unwrap();
    e.htod(dst.ptr(), rb, None).unwrap().make_wait(s.raw()).unwrap();
    assert_same(&read_back(&d, &s, dst.ptr(), n), &b, "a copy of B after A was filled ahead");
    e.synchronize().unwrap();
    // A's chunks are gone with that copy: a copy of A now fills A itself.
    e.htod(dst.ptr(), ra, None).unwrap().make_wait(s.raw()).unwrap();
    assert_same(&read_back(&d, &s, dst.ptr(), n), &a, "A after B");
    e.synchronize().unwrap();
    let st = e.stats();
    assert_eq!(st.ahead_used_bytes, 0, "{st:?}");
    assert!(st.pinned_alloc_calls as usize <= e.config().slots, "buffers filled ahead were not reused: {st:?}");
    assert_eq!(st.pinned_free_calls, 0, "a buffer filled ahead was freed instead of reused: {st:?}");
}

#[test]
fn forgetting_ahead_discards_the_filled_bytes_and_spends_the_ticket() {
    let d = dev();
    let e = small_engine(&d);
    let s = Stream::new(&d).unwrap();
    let n = 3 * MIB + 5;
    let bytes: &'static mut [u8] = Box::leak(random_bytes(n, 44).into_boxed_slice());
    // SAFETY: `bytes` is leaked, so always readable; this test changes it
    // only after `forget_ahead`, with no copy of it in flight.
    let range = unsafe { HostRange::new(bytes.as_ptr(), n) };
    let ticket = e.ahead_ticket();
    e.fill_ahead(range, ticket, 2, &mut || false);
    let filled = e.stats().ahead_bytes;
    assert!(filled > 0);
    e.forget_ahead();
    // The source may now change (a weight unregistered, its memory reused).
    bytes.iter_mut().for_each(|b| *b = b.wrapping_add(1));
    let want = bytes.to_vec();
    // The spent ticket fills nothing.
    e.fill_ahead(range, ticket, 2, &mut || false);
    assert_eq!(e.stats().ahead_bytes, filled, "a fill ahead ran on a spent ticket");
    let dst = DeviceBuffer::new(&d, n).unwrap();
    e.htod(dst.ptr(), range, None).unwrap().make_wait(s.raw()).unwrap();
    assert_same(&read_back(&d, &s, dst.ptr(), n), &want, "a copy after forget_ahead read the old bytes");
    e.synchronize().unwrap();
    let st = e.stats();
    assert_eq!(st.ahead_used_bytes, 0, "{st:?}");
    assert_eq!(st.pinned_free_calls, 0, "forgotten chunks' buffers were freed instead of reused: {st:?}");
}

#[test]
fn filling_ahead_stops_when_asked_and_skips_what_needs_no_fill() {
    let d = dev();
    let e = small_engine(&d);
    let n = 6 * MIB;
    let range = leak_range(random_bytes(n, 45));
    // `stop` is asked before each chunk: false once, then true.
    let mut asked = 0;
    e.fill_ahead(range, e.ahead_ticket(), 3, &mut || {
        asked += 1;
        asked > 1
    });
    assert_eq!((asked, e.stats().ahead_bytes as usize), (2, first_chunks_bytes(&e, n, 1)));
    // Zero chunks, an empty source, a page-locked source: nothing filled.
    let before = e.stats().ahead_bytes;
    e.fill_ahead(range, e.ahead_ticket(), 0, &mut || false);
    e.fill_ahead(leak_range(Vec::new()), e.ahead_ticket(), 2, &mut || false);
    let locked = leak_range(random_bytes(2 * MIB, 46));
    let reg = HostRegistration::new(&d, locked).unwrap();
    e.fill_ahead(locked, e.ahead_ticket(), 2, &mut || false);
    assert_eq!(e.stats().ahead_bytes, before);
    drop(reg);
}

#[test]
fn the_filler_fills_the_hinted_source_ahead_between_jobs() {
    let d = dev();
    let e = Arc::new(small_engine(&d));
    let bg = BackgroundFill::new(&e, 2).unwrap();
    let n = 4 * MIB + 9;
    let (a, b) = (random_bytes(n, 47), random_bytes(n, 48));
    let (ra, rb) = (leak_range(a.clone()), leak_range(b.clone()));
    let (da, db) = (DeviceBuffer::new(&d, n).unwrap(), DeviceBuffer::new(&d, n).unwrap());
    let s = Stream::new(&d).unwrap();
    let hint = Hint { src: rb, ticket: e.ahead_ticket() };
    let fa = bg.htod_after(da.ptr(), ra, None, Some(hint)).unwrap();
    fa.make_wait(s.raw()).unwrap();
    // Nothing else is queued, so the filler fills B's first two chunks next.
    let want = first_chunks_bytes(&e, n, 2) as u64;
    let t0 = std::time::Instant::now();
    while e.stats().ahead_bytes < want {
        assert!(t0.elapsed() < WATCHDOG, "the idle filler did not fill ahead: {:?}", e.stats());
        std::thread::sleep(Duration::from_millis(2));
    }
    let fb = bg.htod_after(db.ptr(), rb, None, None).unwrap();
    fb.make_wait(s.raw()).unwrap();
    assert_same(&read_back(&d, &s, da.ptr(), n), &a, "the hinting copy");
    assert_same(&read_back(&d, &s, db.ptr(), n), &b, "the hinted copy");
    bg.drain();
    e.synchronize().unwrap();
    let st = e.stats();
    assert_eq!((st.ahead_bytes, st.ahead_used_bytes), (want, want), "{st:?}");
    // A filler made with 0 chunks ahead ignores hints.
    let e0 = Arc::new(small_engine(&d));
    let bg0 = BackgroundFill::new(&e0, 0).unwrap();
    let f = bg0.htod_after(da.ptr(), ra, None, Some(Hint { src: rb, ticket: e0.ahead_ticket() })).unwrap();
    f.make_wait(s.raw()).unwrap();
    // Dropping the filler joins its thread after everything it would do
    // between jobs (filling ahead included): nothing can come later.
    drop(bg0);
    assert_eq!(e0.stats().ahead_bytes, 0);
}

#[test]
fn a_failure_while_filling_ahead_is_reported_by_the_next_copy() {
    use epmem::device::fault::{FaultKind, FaultyDevice};
    let fd = Arc::new(FaultyDevice::new(dev()));
    let d: Arc<dyn Device> = fd.clone();
    let e = small_engine(&d);
    let n = 3 * MIB;
    let src = random_bytes(n, 49);
    let range = leak_range(src.clone());
    // The first fill ahead reserves the slots' pinned buffers: make that fail.
    fd.fail_nth(FaultKind::PinnedAlloc, 1);
    e.fill_ahead(range, e.ahead_ticket(), 2, &mut || false);
    assert_eq!(e.stats().ahead_bytes, 0);
    let dst = DeviceBuffer::new(&d, n).unwrap();
    let err = e.htod(dst.ptr(), range, None).unwrap_err();
    assert!(err.to_string().contains("injected fault"), "{err}");
    // Reported once; the next copy reserves again and lands bit-exact.
    let s = Stream::new(&d).unwrap();
    e.htod(dst.ptr(), range, None).unwrap().make_wait(s.raw()).unwrap();
    assert_same(&read_back(&d, &s, dst.ptr(), n), &src, "the copy after the reported failure");
}
