//! The pinned staging pool and the fence witness, on whatever device
//! EPM_DEVICE names (host in CI; `EPM_DEVICE=cuda` on the GPU machine).

mod staging_util;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use epmem::device::{DeviceBuffer, Gate, Stream};
use epmem::staging::{PinnedStagingPool, PoolConfig, PooledStaging};
use epmem::transfer::witness::{self, CopyCompleted, TryComplete};
use staging_util::{dev, read_back};

const MIB: usize = 1 << 20;

/// One copy from `buf` into `dst`, waited on: the legitimate source of a witness.
fn copy_and_wait(s: &Stream, dst: &DeviceBuffer, buf: PooledStaging, len: usize) -> CopyCompleted<PooledStaging> {
    witness::enqueue_htod(s, dst.ptr(), buf, len, None).unwrap().wait().unwrap()
}

#[test]
fn regression_guard_64_same_size_cycles_allocate_once() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let dst = DeviceBuffer::new(&d, 8 * MIB).unwrap();
    let pool = PinnedStagingPool::new(&d, PoolConfig::default()).unwrap();
    let driver_before = d.driver_counts();
    for i in 0..64u8 {
        let mut buf = pool.acquire(8 * MIB).unwrap();
        buf[..8 * MIB].fill(i);
        let done = copy_and_wait(&s, &dst, buf, 8 * MIB);
        pool.release(done);
    }
    let st = pool.stats();
    assert_eq!((st.pinned_alloc_calls, st.pinned_reuses, st.pinned_free_calls), (1, 63, 0), "{st:?}");
    assert_eq!((st.retained_buffers, st.retained_bytes), (1, 8 * MIB as u64));
    // The device's own counter agrees: the pool cannot under-report.
    let driver = d.driver_counts();
    assert_eq!(driver.pinned_alloc_calls - driver_before.pinned_alloc_calls, 1);
    assert_eq!(driver.pinned_free_calls - driver_before.pinned_free_calls, 0);
    // And the last cycle's data really went through.
    assert!(read_back(&d, &s, dst.ptr(), 8 * MIB).iter().all(|&b| b == 63));
}

/// `reserve` (what a copy engine does at its first staged copy, one buffer
/// per slot) allocates only the buffers missing, of the size asked, within
/// the bounds; acquires are then served from them.
#[test]
fn reserve_allocates_only_what_is_missing_within_the_bounds() {
    let d = dev();
    let pool = PinnedStagingPool::new(&d, PoolConfig { max_buffers: 3, max_bytes: 64 * MIB }).unwrap();
    pool.reserve(2, MIB).unwrap();
    let st = pool.stats();
    assert_eq!((st.pinned_alloc_calls, st.retained_buffers, st.retained_bytes), (2, 2, 2 * MIB as u64), "{st:?}");
    // Already there (a larger buffer fits a smaller request): nothing new.
    pool.reserve(2, MIB).unwrap();
    pool.reserve(1, MIB / 2).unwrap();
    assert_eq!(pool.stats().pinned_alloc_calls, 2);
    // 4 MiB buffers: the 1 MiB ones do not count, and the 3-buffer bound stops it at one.
    pool.reserve(2, 4 * MIB).unwrap();
    let st = pool.stats();
    assert_eq!((st.pinned_alloc_calls, st.retained_buffers, st.retained_bytes), (3, 3, 6 * MIB as u64), "{st:?}");
    let a = pool.acquire(4 * MIB).unwrap();
    assert_eq!((a.capacity(), pool.stats().pinned_alloc_calls), (4 * MIB, 3), "served from the reserve");
    assert_eq!(pool.reserve(1, 0).unwrap_err().status(), epmem::EpmStatus::InvalidArgument);
    drop(a);
}

/// A reserve whose allocation fails returns the error and keeps what it had
/// allocated (never frees the retained buffers to retry, as an acquire does).
#[test]
fn a_failed_reserve_keeps_what_it_allocated() {
    use epmem::device::Device;
    use epmem::device::fault::{FaultKind, FaultyDevice};
    let fd = Arc::new(FaultyDevice::new(dev()));
    let d: Arc<dyn Device> = fd.clone();
    let pool = PinnedStagingPool::new(&d, PoolConfig::default()).unwrap();
    fd.fail_nth(FaultKind::PinnedAlloc, 2);
    let e = pool.reserve(3, MIB).unwrap_err();
    assert!(e.to_string().contains("injected"), "{e}");
    let st = pool.stats();
    assert_eq!((st.pinned_alloc_calls, st.retained_buffers, st.pinned_free_calls), (1, 1, 0), "{st:?}");
    pool.reserve(3, MIB).unwrap();
    assert_eq!((pool.stats().pinned_alloc_calls, pool.stats().retained_buffers), (3, 3));
}

#[test]
fn smallest_fit_is_handed_out_and_larger_requests_allocate() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let dst = DeviceBuffer::new(&d, 4096).unwrap();
    let pool = PinnedStagingPool::new(&d, PoolConfig::default()).unwrap();
    let bufs: Vec<_> = [4 * MIB, MIB, 2 * MIB].iter().map(|&n| pool.acquire(n).unwrap()).collect();
    for b in bufs {
        let w = copy_and_wait(&s, &dst, b, 4096);
        pool.release(w);
    }
    assert_eq!(pool.stats().retained_buffers, 3);
    let b = pool.acquire(MIB + 1).unwrap();
    assert_eq!(b.capacity(), 2 * MIB, "smallest retained buffer that fits");
    let c = pool.acquire(MIB).unwrap();
    assert_eq!(c.capacity(), MIB, "exact fit");
    let e = pool.acquire(5 * MIB).unwrap();
    assert_eq!(e.capacity(), 5 * MIB, "larger than any retained: fresh allocation");
    let st = pool.stats();
    assert_eq!((st.pinned_alloc_calls, st.pinned_reuses), (4, 2), "{st:?}");
    assert_eq!((st.retained_buffers, st.retained_bytes), (1, 4 * MIB as u64));
    assert_eq!(pool.acquire(0).unwrap_err().status(), epmem::EpmStatus::InvalidArgument);
}

#[test]
fn buffer_bound_frees_the_return_that_would_breach_it() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let dst = DeviceBuffer::new(&d, 4096).unwrap();
    let pool = PinnedStagingPool::new(&d, PoolConfig { max_buffers: 2, max_bytes: 512 * MIB }).unwrap();
    let frees_before = d.driver_counts().pinned_free_calls;
    let bufs: Vec<_> = (0..3).map(|_| pool.acquire(MIB).unwrap()).collect();
    for b in bufs {
        let w = copy_and_wait(&s, &dst, b, 4096);
        pool.release(w);
    }
    let st = pool.stats();
    assert_eq!((st.retained_buffers, st.pinned_free_calls), (2, 1), "{st:?}");
    assert_eq!(d.driver_counts().pinned_free_calls - frees_before, 1);
}

#[test]
fn byte_bound_frees_the_return_that_would_breach_it() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let dst = DeviceBuffer::new(&d, 4096).unwrap();
    let pool = PinnedStagingPool::new(&d, PoolConfig { max_buffers: 8, max_bytes: 3 * MIB }).unwrap();
    let (a, b, c) = (pool.acquire(2 * MIB).unwrap(), pool.acquire(2 * MIB).unwrap(), pool.acquire(MIB).unwrap());
    for buf in [a, b, c] {
        let w = copy_and_wait(&s, &dst, buf, 4096);
        pool.release(w);
    }
    let st = pool.stats();
    // 2 MiB kept, the second 2 MiB would make 4 > 3: freed; 1 MiB fits (3 MiB).
    assert_eq!((st.retained_buffers, st.retained_bytes, st.pinned_free_calls), (2, 3 * MIB as u64, 1), "{st:?}");
    // A single buffer larger than the byte bound is never retained.
    let big = pool.acquire(4 * MIB).unwrap();
    let w = copy_and_wait(&s, &dst, big, 4096);
    pool.release(w);
    assert_eq!(pool.stats().retained_bytes, 3 * MIB as u64);
    assert_eq!(pool.trim(), 2);
    assert_eq!(pool.stats().retained_buffers, 0);
}

#[test]
fn dropping_an_unretired_buffer_frees_it_and_never_recycles() {
    let d = dev();
    let pool = PinnedStagingPool::new(&d, PoolConfig::default()).unwrap();
    let live_before = d.live_counts().pinned_buffers;
    let b = pool.acquire(MIB).unwrap();
    assert_eq!(d.live_counts().pinned_buffers, live_before + 1);
    drop(b);
    let st = pool.stats();
    assert_eq!((st.retained_buffers, st.pinned_free_calls), (0, 1), "{st:?}");
    assert_eq!(d.live_counts().pinned_buffers, live_before, "freed, not kept");
    let _b = pool.acquire(MIB).unwrap();
    assert_eq!(pool.stats().pinned_alloc_calls, 2, "a dropped buffer is not reused");
}

#[test]
fn eight_threads_lose_and_duplicate_nothing() {
    const THREADS: usize = 8;
    const CYCLES: usize = 60;
    let d = dev();
    let cfg = PoolConfig { max_buffers: 4, max_bytes: 512 * MIB };
    let pool = PinnedStagingPool::new(&d, cfg).unwrap();
    let live: Arc<Mutex<HashSet<usize>>> = Arc::default();
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (d, pool, live) = (d.clone(), pool.clone(), live.clone());
            std::thread::spawn(move || {
                let s = Stream::new(&d).unwrap();
                let dst = DeviceBuffer::new(&d, 4096).unwrap();
                for i in 0..CYCLES {
                    let len = [64 << 10, 256 << 10, MIB][(t + i) % 3];
                    let mut buf = pool.acquire(len).unwrap();
                    let addr = buf.as_ptr() as usize;
                    assert!(live.lock().unwrap().insert(addr), "buffer {addr:#x} handed to two holders");
                    buf[..4096].fill(t as u8);
                    let w = copy_and_wait(&s, &dst, buf, 4096);
                    assert!(w[..4096].iter().all(|&b| b == t as u8), "another thread wrote our buffer");
                    assert!(live.lock().unwrap().remove(&addr));
                    pool.release(w);
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    let st = pool.stats();
    assert_eq!(st.pinned_alloc_calls + st.pinned_reuses, (THREADS * CYCLES) as u64, "every acquire counted once");
    assert_eq!(
        st.pinned_alloc_calls,
        st.retained_buffers + st.pinned_free_calls,
        "every allocation accounted for: {st:?}"
    );
    assert!(st.retained_buffers <= cfg.max_buffers as u64);
    let held: HashSet<usize> = (0..st.retained_buffers).map(|_| pool.acquire(1).unwrap().as_ptr() as usize).collect();
    assert_eq!(held.len() as u64, st.retained_buffers, "retained buffers are distinct");
}

#[test]
fn try_complete_is_pending_while_the_copy_waits_behind_work() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let dst = DeviceBuffer::new(&d, 4096).unwrap();
    let pool = PinnedStagingPool::new(&d, PoolConfig::default()).unwrap();
    // The copy sits behind a gate only this test opens: pending is certain,
    // however slow the host.
    let gate = Gate::new();
    d.hold_async(s.raw(), &gate).unwrap();
    let f = witness::enqueue_htod(&s, dst.ptr(), pool.acquire(4096).unwrap(), 4096, None).unwrap();
    let f = match f.try_complete().unwrap() {
        TryComplete::Pending(f) => f,
        TryComplete::Done(..) => panic!("copy reported complete while held behind a closed gate"),
    };
    let f = match f.try_complete().unwrap() {
        TryComplete::Pending(f) => f,
        TryComplete::Done(..) => panic!("copy reported complete while held behind a closed gate"),
    };
    assert_eq!(pool.stats().retained_buffers, 0, "the copy still owns its buffer");
    gate.open();
    s.synchronize().unwrap();
    let done = match f.try_complete().unwrap() {
        TryComplete::Done(w) => w,
        TryComplete::Pending(_) => panic!("copy still pending after its stream synchronized"),
    };
    pool.release(done);
    assert_eq!(pool.stats().retained_buffers, 1);
}

#[test]
fn dropping_an_in_flight_copy_waits_for_it_then_frees_the_buffer() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let dst = DeviceBuffer::new(&d, 4096).unwrap();
    let pool = PinnedStagingPool::new(&d, PoolConfig::default()).unwrap();
    let live_before = d.live_counts().pinned_buffers;
    // Only the watchdog opens the gate, so a drop that waits for the copy
    // returns after it fired; one that freed at once would return before.
    let gate = Gate::new();
    let wd = gate.watchdog(Duration::from_millis(100));
    d.hold_async(s.raw(), &gate).unwrap();
    let f = witness::enqueue_htod(&s, dst.ptr(), pool.acquire(4096).unwrap(), 4096, None).unwrap();
    drop(f);
    assert!(wd.fired(), "dropping the in-flight copy returned while the copy was held");
    let st = pool.stats();
    assert_eq!((st.retained_buffers, st.pinned_free_calls), (0, 1), "freed, never recycled: {st:?}");
    assert_eq!(d.live_counts().pinned_buffers, live_before);
}

#[test]
fn a_buffer_goes_back_to_the_pool_it_came_from() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let dst = DeviceBuffer::new(&d, 4096).unwrap();
    let (a, b) = (
        PinnedStagingPool::new(&d, PoolConfig::default()).unwrap(),
        PinnedStagingPool::new(&d, PoolConfig::default()).unwrap(),
    );
    let done = copy_and_wait(&s, &dst, a.acquire(4096).unwrap(), 4096);
    b.release(done);
    assert_eq!((a.stats().retained_buffers, b.stats().retained_buffers), (1, 0));
}

#[test]
fn a_witness_spent_with_into_buffer_leaves_a_buffer_that_is_freed_not_recycled() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let dst = DeviceBuffer::new(&d, 4096).unwrap();
    let pool = PinnedStagingPool::new(&d, PoolConfig::default()).unwrap();
    let buf = copy_and_wait(&s, &dst, pool.acquire(4096).unwrap(), 4096).into_buffer();
    drop(buf);
    let st = pool.stats();
    assert_eq!((st.retained_buffers, st.pinned_free_calls), (0, 1), "{st:?}");
}
