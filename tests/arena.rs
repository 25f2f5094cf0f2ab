//! Device and pinned arenas on the device `EPM_DEVICE` names (host in CI,
//! CUDA on the GPU machine with EPM_DEVICE=cuda).

use std::collections::BTreeMap;
use std::sync::Arc;

use epmem::EpmStatus;
use epmem::arena::{Arena, ArenaConfig, DeviceArena, PinnedArena};
use epmem::device::{self, Device, DeviceKind, Stream};

fn dev() -> Arc<dyn Device> {
    device::open_from_env(0).expect("open device (EPM_DEVICE)")
}

fn cfg(dev: &Arc<dyn Device>, chunks: usize, chunk_granules: usize) -> ArenaConfig {
    let chunk = dev.vmm_granularity() * chunk_granules;
    ArenaConfig { capacity: chunks * chunk, chunk_bytes: chunk, max_allocs: 4096 }
}

/// Random alloc/free against a model of the live set: no two live blocks
/// overlap, every address is aligned, the counters match the model.
fn random_pattern(arena: &dyn Arena, seed: u64, ops: usize, max_size: u64) -> (u64, u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut live: BTreeMap<u64, usize> = BTreeMap::new();
    let (mut allocs, mut frees) = (0u64, 0u64);
    for _ in 0..ops {
        if live.is_empty() || rng.u64(..100) < 55 {
            let size = 1 + rng.u64(..max_size) as usize;
            let align = [0usize, 256, 4096, 65536][rng.u64(..4) as usize];
            match arena.alloc(size, align) {
                Ok(a) => {
                    assert_eq!(a % align.max(256) as u64, 0, "misaligned {a:#x} for align {align}");
                    if let Some((&p, &l)) = live.range(..=a).next_back() {
                        assert!(p + l as u64 <= a, "[{a:#x}, +{size}) overlaps [{p:#x}, +{l})");
                    }
                    if let Some((&n, _)) = live.range(a..).next() {
                        assert!(a + size as u64 <= n, "[{a:#x}, +{size}) overlaps the block at {n:#x}");
                    }
                    assert_eq!(arena.size_of(a), Some(size));
                    live.insert(a, size);
                    allocs += 1;
                }
                Err(e) => assert_eq!(e.status(), EpmStatus::OutOfBudget, "{e}"),
            }
        } else {
            let k = rng.u64(..live.len() as u64) as usize;
            let a = *live.keys().nth(k).unwrap();
            arena.free(a).unwrap();
            live.remove(&a);
            frees += 1;
        }
        let s = arena.stats();
        assert_eq!(s.live_allocations, live.len() as u64);
        let requested: u64 = live.values().map(|&l| l as u64).sum();
        assert!(s.in_use_bytes >= requested && s.in_use_bytes <= s.committed_bytes, "{s:?} vs requested {requested}");
    }
    for (a, _) in std::mem::take(&mut live) {
        arena.free(a).unwrap();
        frees += 1;
    }
    let s = arena.stats();
    assert_eq!((s.live_allocations, s.in_use_bytes), (0, 0), "{s:?}");
    (allocs, frees)
}

#[test]
fn device_arena_random_pattern_no_overlap_exact_counters_and_no_driver_calls_after_warmup() {
    let d = dev();
    let arena = DeviceArena::new(&d, cfg(&d, 8, 2)).unwrap();
    let max = (arena.chunk_bytes() / 3) as u64;
    let (a1, f1) = random_pattern(&arena, 7, 2000, max);
    let warm = arena.stats();
    let warm_driver = d.driver_counts();
    assert!(warm.driver_alloc_calls > 0 && warm.committed_bytes > 0, "{warm:?}");
    // The same pattern again lands on the same offsets (all frees coalesce
    // back to one range): no chunk is committed, no driver call is made.
    let (a2, f2) = random_pattern(&arena, 7, 2000, max);
    let s = arena.stats();
    assert_eq!(s.driver_alloc_calls, warm.driver_alloc_calls);
    assert_eq!(s.committed_bytes, warm.committed_bytes);
    assert_eq!(d.driver_counts(), warm_driver, "driver calls in steady state");
    assert_eq!(s.alloc_calls, a1 + a2);
    assert_eq!(s.free_calls, f1 + f2);
    assert_eq!(s.fragmentation, 0.0, "everything freed must coalesce: {s:?}");
}

#[test]
fn device_arena_blocks_are_real_disjoint_memory() {
    let d = dev();
    let arena = DeviceArena::new(&d, cfg(&d, 4, 1)).unwrap();
    let s = Stream::new(&d).unwrap();
    let sizes = [1000usize, 65536, 3, 300_000, 4096, 777_777];
    let blocks: Vec<u64> = sizes.iter().map(|&n| arena.alloc(n, 0).unwrap()).collect();
    for (i, (&b, &n)) in blocks.iter().zip(&sizes).enumerate() {
        d.memset_d8_async(b, i as u8 + 1, n, s.raw()).unwrap();
    }
    for (i, (&b, &n)) in blocks.iter().zip(&sizes).enumerate() {
        let mut host = vec![0u8; n];
        // SAFETY: `host` is a live, exclusively owned buffer of n bytes and we
        // synchronize the stream before reading it.
        unsafe { d.memcpy_dtoh_async(host.as_mut_ptr(), b, n, s.raw()).unwrap() };
        s.synchronize().unwrap();
        assert!(host.iter().all(|&x| x == i as u8 + 1), "block {i} was overwritten by a neighbour");
    }
    for b in blocks {
        arena.free(b).unwrap();
    }
}

#[test]
fn device_arena_grows_by_chunks_reports_exhaustion_and_trims() {
    let d = dev();
    let c = cfg(&d, 4, 1);
    let arena = DeviceArena::new(&d, c).unwrap();
    let chunk = arena.chunk_bytes();
    assert_eq!(arena.stats().committed_bytes, 0, "nothing committed before the first allocation");
    let mut blocks = Vec::new();
    for i in 1..=4u64 {
        blocks.push(arena.alloc(chunk, 0).unwrap());
        let s = arena.stats();
        assert_eq!((s.committed_bytes, s.driver_alloc_calls), (i * chunk as u64, i), "{s:?}");
    }
    let e = arena.alloc(1, 0).unwrap_err();
    assert_eq!(e.status(), EpmStatus::OutOfBudget, "{e}");
    let e = arena.alloc(5 * chunk, 0).unwrap_err();
    assert_eq!(e.status(), EpmStatus::OutOfBudget, "{e}");
    assert_eq!(arena.free(blocks[0] + 256).unwrap_err().status(), EpmStatus::InvalidArgument);
    assert_eq!(arena.free(1).unwrap_err().status(), EpmStatus::InvalidArgument);
    arena.free(blocks[1]).unwrap();
    arena.free(blocks[3]).unwrap();
    assert_eq!(arena.free(blocks[3]).unwrap_err().status(), EpmStatus::InvalidArgument, "double free");
    assert_eq!(arena.trim().unwrap(), 2 * chunk);
    let s = arena.stats();
    assert_eq!((s.committed_bytes, s.driver_free_calls), (2 * chunk as u64, 2), "{s:?}");
    // A block spanning two chunks commits both again.
    let big = arena.alloc(chunk + 1, 0);
    assert!(big.is_err() || arena.stats().committed_bytes == 4 * chunk as u64);
    drop(arena);
    let live = d.live_counts();
    assert_eq!((live.mappings, live.va_reservations), (0, 0), "{live:?}");
}

#[test]
fn device_arena_rejects_bad_arguments() {
    let d = dev();
    let arena = DeviceArena::new(&d, cfg(&d, 2, 1)).unwrap();
    assert_eq!(arena.alloc(0, 0).unwrap_err().status(), EpmStatus::InvalidArgument);
    assert_eq!(arena.alloc(16, 3).unwrap_err().status(), EpmStatus::InvalidArgument);
    assert_eq!(arena.alloc(16, 4 * arena.chunk_bytes()).unwrap_err().status(), EpmStatus::InvalidArgument);
    assert!(DeviceArena::new(&d, ArenaConfig { capacity: 0, ..cfg(&d, 1, 1) }).is_err());
}

/// Only a GPU runs out: the host device's memfd commits lazily. Ignored
/// (and so reported as ignored) unless asked for: scripts/gpu-check.sh runs
/// the integration tests with `--include-ignored` and EPM_DEVICE=cuda.
#[test]
#[ignore = "needs a CUDA GPU (EPM_DEVICE=cuda; scripts/gpu-check.sh runs it)"]
fn device_arena_out_of_device_memory_on_cuda() {
    let d = dev();
    assert_eq!(
        d.info().kind,
        DeviceKind::Cuda,
        "this test needs EPM_DEVICE=cuda: the host device cannot run out of memory here"
    );
    let (_, total) = d.mem_get_info().unwrap();
    let arena = DeviceArena::new(&d, ArenaConfig::with_capacity(2 * total as usize)).unwrap();
    let e = arena.alloc(total as usize + arena.chunk_bytes(), 0).unwrap_err();
    assert_eq!(e.status(), EpmStatus::OutOfDeviceMemory, "{e}");
    assert_eq!(arena.stats().live_allocations, 0);
}

#[test]
fn pinned_arena_random_pattern_and_steady_state() {
    let d = dev();
    let arena = PinnedArena::new(&d, cfg(&d, 6, 1)).unwrap();
    let max = (d.vmm_granularity() / 3) as u64;
    random_pattern(&arena, 11, 1500, max);
    let warm = arena.stats();
    let warm_pinned = d.driver_counts().pinned_alloc_calls;
    random_pattern(&arena, 11, 1500, max);
    let s = arena.stats();
    assert_eq!(s.driver_alloc_calls, warm.driver_alloc_calls, "{s:?}");
    assert_eq!(d.driver_counts().pinned_alloc_calls, warm_pinned);
    assert!(d.host_is_page_locked(arena.alloc(100, 0).unwrap() as *const u8, 100));
}

#[test]
fn pinned_arena_big_requests_get_their_own_segment_and_budget_holds() {
    let d = dev();
    let g = d.vmm_granularity();
    let arena = PinnedArena::new(&d, ArenaConfig { capacity: 4 * g, chunk_bytes: g, max_allocs: 64 }).unwrap();
    let big = arena.alloc(2 * g + 1, 0).unwrap();
    let s = arena.stats();
    assert_eq!((s.committed_bytes, s.driver_alloc_calls), (3 * g as u64, 1), "{s:?}");
    // A small request fits in the big segment's tail: no new segment.
    let small = arena.alloc(100, 0).unwrap();
    assert_eq!(arena.stats().committed_bytes, 3 * g as u64);
    let third = arena.alloc(g, 0).unwrap();
    assert_eq!(arena.stats().committed_bytes, 4 * g as u64);
    let e = arena.alloc(g, 0).unwrap_err();
    assert_eq!(e.status(), EpmStatus::OutOfBudget, "{e}");
    arena.free(big).unwrap();
    arena.free(small).unwrap();
    assert_eq!(arena.trim().unwrap(), 3 * g);
    assert_eq!(arena.free(big).unwrap_err().status(), EpmStatus::InvalidArgument);
    arena.free(third).unwrap();
    let s = arena.stats();
    assert_eq!((s.driver_free_calls, s.live_allocations), (1, 0), "{s:?}");
}

/// 8 threads allocate and free on one arena at once: no two live blocks ever
/// overlap, nothing is lost, and the counters add up at the end.
fn concurrent(arena: &dyn Arena) {
    let live: std::sync::Mutex<BTreeMap<u64, usize>> = std::sync::Mutex::new(BTreeMap::new());
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let live = &live;
            s.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(0x9e37 + t);
                let mut mine = Vec::new();
                for _ in 0..400 {
                    if mine.is_empty() || rng.u64(..100) < 55 {
                        let size = 1 + rng.u64(..64 << 10) as usize;
                        let Ok(a) = arena.alloc(size, 0) else { continue };
                        let mut l = live.lock().unwrap();
                        if let Some((&p, &n)) = l.range(..=a).next_back() {
                            assert!(p + n as u64 <= a, "thread {t}: [{a:#x}, +{size}) overlaps [{p:#x}, +{n})");
                        }
                        if let Some((&n, _)) = l.range(a..).next() {
                            assert!(a + size as u64 <= n, "thread {t}: [{a:#x}, +{size}) overlaps {n:#x}");
                        }
                        l.insert(a, size);
                        mine.push(a);
                    } else {
                        let a = mine.swap_remove(rng.u64(..mine.len() as u64) as usize);
                        live.lock().unwrap().remove(&a);
                        arena.free(a).unwrap();
                    }
                }
                for a in mine {
                    live.lock().unwrap().remove(&a);
                    arena.free(a).unwrap();
                }
            });
        }
    });
    let s = arena.stats();
    assert_eq!((s.live_allocations, s.in_use_bytes), (0, 0), "{s:?}");
    assert_eq!(s.alloc_calls, s.free_calls, "{s:?}");
}

#[test]
fn arenas_are_thread_safe() {
    let d = dev();
    concurrent(&DeviceArena::new(&d, cfg(&d, 16, 2)).unwrap());
    concurrent(&PinnedArena::new(&d, cfg(&d, 16, 2)).unwrap());
}

const MIB: usize = 1 << 20;

/// `capacity` is the bound: an 8 MiB arena with the default 32 MiB chunks
/// refuses 16 MiB and then 12 MiB (it once handed out both from one chunk),
/// fills to exactly 8 MiB, and commits no more than 8 MiB.
#[test]
fn device_arena_capacity_below_a_chunk_is_the_bound() {
    let d = dev();
    let g = d.vmm_granularity();
    let arena = DeviceArena::new(&d, ArenaConfig::with_capacity(8 * MIB)).unwrap();
    let bound = (8 * MIB).next_multiple_of(g) as u64;
    assert!(arena.chunk_bytes() > 8 * MIB, "the default chunk must exceed the capacity for this test");
    for n in [16 * MIB, 12 * MIB, 8 * MIB + 1] {
        let e = arena.alloc(n, 0).unwrap_err();
        assert_eq!(e.status(), EpmStatus::OutOfBudget, "{n} bytes: {e}");
        assert!(e.message().contains("capacity"), "{e}");
    }
    let a = arena.alloc(6 * MIB, 0).unwrap();
    assert_eq!(arena.alloc(4 * MIB, 0).unwrap_err().status(), EpmStatus::OutOfBudget);
    let b = arena.alloc(2 * MIB, 0).unwrap();
    let s = arena.stats();
    assert_eq!(s.in_use_bytes, 8 * MIB as u64, "{s:?}");
    assert!(s.committed_bytes <= bound && s.reserved_bytes <= bound, "{s:?} over {bound}");
    assert_eq!(arena.alloc(1, 0).unwrap_err().status(), EpmStatus::OutOfBudget);
    arena.free(a).unwrap();
    arena.free(b).unwrap();
    assert_eq!(arena.trim().unwrap() as u64, s.committed_bytes);
    assert_eq!(arena.stats().committed_bytes, 0);
}

/// A capacity that is not a whole number of chunks or granules: the last
/// chunk ends at the capacity rounded up to the granularity, and filling the
/// arena commits exactly that.
#[test]
fn device_arena_last_chunk_ends_at_the_capacity() {
    let d = dev();
    let g = d.vmm_granularity();
    let chunk = 4 * g;
    let capacity = 2 * chunk + g + 1; // rounds up to 2 chunks + 2 granules
    let bound = capacity.next_multiple_of(g);
    let arena = DeviceArena::new(&d, ArenaConfig { capacity, chunk_bytes: chunk, max_allocs: 64 }).unwrap();
    assert_eq!(arena.capacity(), bound);
    assert_eq!(arena.stats().reserved_bytes, bound as u64);
    let blocks: Vec<u64> = (0..bound / g).map(|_| arena.alloc(g, 0).unwrap()).collect();
    let s = arena.stats();
    assert_eq!((s.committed_bytes, s.driver_alloc_calls), (bound as u64, 3), "{s:?}");
    assert_eq!(arena.alloc(256, 0).unwrap_err().status(), EpmStatus::OutOfBudget);
    // The last (short) chunk is real memory, and it is given back whole.
    let last = *blocks.last().unwrap();
    let st = Stream::new(&d).unwrap();
    d.memset_d8_async(last, 0x3c, g, st.raw()).unwrap();
    let mut host = vec![0u8; g];
    // SAFETY: `host` is a live, exclusively owned buffer of g bytes, read
    // only after the stream is synchronized.
    unsafe { d.memcpy_dtoh_async(host.as_mut_ptr(), last, g, st.raw()).unwrap() };
    st.synchronize().unwrap();
    assert!(host.iter().all(|&x| x == 0x3c));
    for b in blocks {
        arena.free(b).unwrap();
    }
    assert_eq!(arena.trim().unwrap(), bound);
    let s = arena.stats();
    assert_eq!((s.committed_bytes, s.driver_free_calls), (0, 3), "{s:?}");
    drop(arena);
    let live = d.live_counts();
    assert_eq!((live.mappings, live.va_reservations), (0, 0), "{live:?}");
}

/// The pinned arena's bound is `capacity` itself: below one chunk it still
/// serves up to the capacity (a segment cut short), and never commits more.
#[test]
fn pinned_arena_capacity_below_a_chunk_is_the_bound() {
    let d = dev();
    let arena = PinnedArena::new(&d, ArenaConfig::with_capacity(8 * MIB)).unwrap();
    for n in [16 * MIB, 12 * MIB, 8 * MIB + 1] {
        let e = arena.alloc(n, 0).unwrap_err();
        assert_eq!(e.status(), EpmStatus::OutOfBudget, "{n} bytes: {e}");
        assert!(e.message().contains("capacity"), "{e}");
    }
    let a = arena.alloc(6 * MIB, 0).unwrap();
    assert_eq!(arena.stats().committed_bytes, 8 * MIB as u64, "one segment cut to the capacity");
    assert_eq!(arena.alloc(4 * MIB, 0).unwrap_err().status(), EpmStatus::OutOfBudget);
    let b = arena.alloc(2 * MIB, 0).unwrap();
    let s = arena.stats();
    assert_eq!((s.in_use_bytes, s.committed_bytes), (8 * MIB as u64, 8 * MIB as u64), "{s:?}");
    arena.free(a).unwrap();
    arena.free(b).unwrap();
    // 40 MiB with 32 MiB chunks: a whole chunk, then the 8 MiB left.
    let arena = PinnedArena::new(&d, ArenaConfig::with_capacity(40 * MIB)).unwrap();
    let chunk = 16 * d.vmm_granularity();
    assert_eq!(chunk, 32 * MIB, "the test assumes 2 MiB granules (H200, host device)");
    let a = arena.alloc(30 * MIB, 0).unwrap();
    let b = arena.alloc(20 * MIB, 0).unwrap_err();
    assert_eq!(b.status(), EpmStatus::OutOfBudget, "{b}");
    let c = arena.alloc(8 * MIB, 0).unwrap();
    assert_eq!(arena.stats().committed_bytes, 40 * MIB as u64);
    arena.free(a).unwrap();
    arena.free(c).unwrap();
}

#[test]
fn arena_capacity_past_the_limit_names_it_in_bytes() {
    let d = dev();
    let max = epmem::arena::MAX_CAPACITY;
    assert_eq!(max, (1usize << 40) - 256);
    for e in [
        DeviceArena::new(&d, ArenaConfig::with_capacity(max + 1)).unwrap_err(),
        PinnedArena::new(&d, ArenaConfig::with_capacity(usize::MAX)).unwrap_err(),
    ] {
        assert_eq!(e.status(), EpmStatus::InvalidArgument, "{e}");
        let m = e.message();
        assert!(m.contains("capacity_bytes") && m.contains(&format!("limit of {max} bytes")), "{e}");
    }
}
