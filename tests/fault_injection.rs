//! Injected device faults at every call site: for each operation (pool
//! acquire, engine create/htod/register, arena create/alloc, residency
//! create/acquire/prefetch, compressed page-ins, KV pool create, sequence create, append, pin,
//! commit_shared_prefix, copy-on-write) and each fault kind, fail the 1st,
//! 2nd, ... call of that kind until the operation runs without reaching an
//! Nth call. After every failure: the operation returned the injected status,
//! the level counters (pool retained, arena in use, ledger owned/promised,
//! live sequences and prefixes) equal their values before the attempt, and
//! the device's live resources agree with them (nothing orphaned). At
//! teardown the device's live counts are all zero.
//!
//! Runs on the device EPM_DEVICE names (host in CI; `EPM_DEVICE=cuda` on a GPU).

use epmem::device::conformance::random_bytes;
use std::collections::BTreeMap;
use std::sync::Arc;

use epmem::arena::{Arena, ArenaConfig, DeviceArena, PinnedArena};
use epmem::device::fault::{FaultKind, FaultyDevice};
use epmem::device::{self, Device, DeviceBuffer, HostRange, LiveCounts, Stream};
use epmem::kv::{AdmitMode, KvConfig, KvLayout, KvPool, KvShape};
use epmem::residency::{RegisterSources, ResidencyConfig, ResidencyManager, WeightId};
use epmem::staging::{CopyEngine, EngineConfig, PinnedStagingPool, PoolConfig};
use epmem::{EpmStatus, Error, Result};

const MIB: usize = 1 << 20;

fn faulty() -> (Arc<FaultyDevice>, Arc<dyn Device>) {
    let inner = device::open_from_env(0).expect("open the device EPM_DEVICE names");
    let fd = Arc::new(FaultyDevice::new(inner));
    let d: Arc<dyn Device> = fd.clone();
    (fd, d)
}

fn injected_status(kind: FaultKind) -> EpmStatus {
    match kind {
        FaultKind::PinnedAlloc | FaultKind::HostRegister => EpmStatus::OutOfHostMemory,
        FaultKind::DeviceAlloc | FaultKind::VmmCreate => EpmStatus::OutOfDeviceMemory,
        _ => EpmStatus::CudaError,
    }
}

/// Faults injected per (operation, kind) that made the operation fail, and
/// that it absorbed (it still succeeded: e.g. a refused registration stages).
#[derive(Default)]
struct Matrix(BTreeMap<(&'static str, &'static str), (u64, u64)>);

impl Matrix {
    fn failed(&self, op: &str, kind: FaultKind) -> u64 {
        self.0.iter().find(|((o, k), _)| *o == op && *k == kind.name()).map_or(0, |(_, v)| v.0)
    }
    /// One line per operation: `kind failed/absorbed` for each kind that reached it.
    fn report(&self) {
        let mut ops: Vec<&str> = self.0.keys().map(|(o, _)| *o).collect();
        ops.dedup();
        for op in ops {
            let cells: Vec<String> = self
                .0
                .iter()
                .filter(|((o, _), v)| *o == op && (v.0 + v.1) > 0)
                .map(|((_, k), v)| format!("{k} {}/{}", v.0, v.1))
                .collect();
            eprintln!("faults {op}: {}", cells.join(", "));
        }
    }
    fn require(&self, op: &str, kinds: &[FaultKind]) {
        for &k in kinds {
            assert!(self.failed(op, k) > 0, "{op}: no {} fault ever reached it; matrix: {:?}", k.name(), self.0);
        }
    }
}

/// Fail the 1st, 2nd, ... call of `kind` in `op` until `op` succeeds without
/// reaching one. `check` runs after each failure (invariants); `undo`
/// reverts an `op` that succeeded despite an absorbed fault.
#[allow(clippy::too_many_arguments)]
fn drive<S, T>(
    fd: &FaultyDevice,
    m: &mut Matrix,
    what: &'static str,
    kind: FaultKind,
    s: &mut S,
    mut op: impl FnMut(&mut S) -> Result<T>,
    mut check: impl FnMut(&mut S, &Error),
    mut undo: impl FnMut(&mut S, T),
) -> T {
    let entry = m.0.entry((what, kind.name())).or_default();
    for n in 1..=500 {
        fd.clear();
        let before = fd.injected();
        fd.fail_nth(kind, n);
        let r = op(s);
        let hit = fd.injected() > before;
        fd.clear();
        match r {
            Err(e) => {
                assert!(hit, "{what}: failed with no {} fault injected (call #{n}): {e:?}", kind.name());
                assert_eq!(e.status(), injected_status(kind), "{what}, {} #{n}: wrong status: {e:?}", kind.name());
                assert!(e.message().contains("injected fault"), "{what}: message lost the cause: {e:?}");
                check(s, &e);
                entry.0 += 1;
            }
            Ok(v) if hit => {
                entry.1 += 1;
                undo(s, v);
            }
            Ok(v) => return v,
        }
    }
    panic!("{what}: still failing after 500 injected {} faults", kind.name());
}

fn assert_no_leaks(fd: &FaultyDevice) {
    fd.inner().synchronize().unwrap();
    assert_eq!(fd.live_counts(), LiveCounts::default(), "device resources left at teardown");
}

/// Read device bytes through the inner device, so verification injects nothing.
fn read(fd: &FaultyDevice, s: &Stream, src: u64, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    // SAFETY: `v` outlives the copy: the stream is synchronized before returning.
    unsafe { fd.inner().memcpy_dtoh_async(v.as_mut_ptr(), src, n, s.raw()).unwrap() };
    s.synchronize().unwrap();
    v
}

#[test]
fn staging_pool_and_copy_engine() {
    let (fd, d) = faulty();
    let mut m = Matrix::default();
    {
        let src = random_bytes(1, 3 * MIB + 4096);
        let range = HostRange::from_static(Box::leak(src.clone().into_boxed_slice()));
        let dst = DeviceBuffer::new(&d, src.len()).unwrap();
        let s = Stream::new(&d).unwrap();
        let pool = PinnedStagingPool::new(&d, PoolConfig::default()).unwrap();
        let cfg = EngineConfig { slots: 2, chunk_bytes: MIB, target_chunks: 4, fill_threads: 2, ..Default::default() };
        // Every pinned buffer the pool ever allocated is retained, freed, or on loan.
        let conserved = |pool: &PinnedStagingPool, on_loan: u64| {
            let st = pool.stats();
            assert_eq!(st.pinned_alloc_calls - st.pinned_free_calls, st.retained_buffers + on_loan, "{st:?}");
            assert_eq!(fd.live_counts().pinned_buffers, st.retained_buffers + on_loan, "{st:?}");
        };
        for kind in FaultKind::ALL {
            let before = pool.stats();
            let buf = drive(
                &fd,
                &mut m,
                "pool acquire",
                kind,
                &mut (),
                |_| pool.acquire(2 * MIB),
                |_, _| {
                    let now = pool.stats();
                    assert_eq!(
                        (now.retained_buffers, now.retained_bytes),
                        (before.retained_buffers, before.retained_bytes)
                    );
                    conserved(&pool, 0);
                },
                |_, b| drop(b),
            );
            drop(buf); // un-retired: freed, never recycled
            conserved(&pool, 0);

            let live = fd.live_counts();
            let engine = drive(
                &fd,
                &mut m,
                "engine create",
                kind,
                &mut (),
                |_| CopyEngine::new(&pool, cfg),
                |_, _| {
                    conserved(&pool, 0);
                    let now = fd.live_counts();
                    assert_eq!((now.streams, now.events), (live.streams, live.events), "engine create left objects");
                },
                |_, e| drop(e),
            );
            let before = pool.stats();
            drive(
                &fd,
                &mut m,
                "engine htod",
                kind,
                &mut (),
                |_| engine.htod(dst.ptr(), range, Some(s.raw()))?.wait(),
                |_, _| {
                    engine.synchronize().unwrap();
                    conserved(&pool, 0);
                    assert!(pool.stats().retained_bytes <= (PoolConfig::default().max_bytes as u64));
                    let _ = before;
                },
                |_, ()| (),
            );
            s.synchronize().unwrap();
            assert!(read(&fd, &s, dst.ptr(), src.len()) == src, "engine htod: data after the faults ({})", kind.name());
            // Registration: a refused one leaves nothing registered.
            let page = Box::leak(vec![7u8; 3 * 4096].into_boxed_slice());
            let off = page.as_ptr().align_offset(4096);
            let reg_range = HostRange::from_static(&page[off..off + 4096]);
            let regs = fd.live_counts().host_registrations;
            let reg = drive(
                &fd,
                &mut m,
                "engine register",
                kind,
                &mut (),
                |_| engine.register(reg_range),
                |_, _| assert_eq!(fd.live_counts().host_registrations, regs),
                |_, r| drop(r),
            );
            drop(reg);
            drop(engine);
            conserved(&pool, 0);
        }
    }
    m.require("pool acquire", &[FaultKind::PinnedAlloc]);
    m.require("engine create", &[FaultKind::Stream, FaultKind::Event]);
    m.require("engine htod", &[FaultKind::Copy, FaultKind::Event, FaultKind::PinnedAlloc]);
    m.require("engine register", &[FaultKind::HostRegister]);
    m.report();
    assert_no_leaks(&fd);
}

#[test]
fn device_and_pinned_arenas() {
    let (fd, d) = faulty();
    let g = d.vmm_granularity();
    let mut m = Matrix::default();
    {
        for kind in FaultKind::ALL {
            let cfg = ArenaConfig { capacity: 16 * g, chunk_bytes: g, max_allocs: 1024 };
            let live = fd.live_counts();
            let arena = drive(
                &fd,
                &mut m,
                "arena create",
                kind,
                &mut (),
                |_| DeviceArena::new(&d, cfg),
                |_, _| assert_eq!(fd.live_counts(), live),
                |_, a| drop(a),
            );
            // A failed grow keeps the chunks it committed (reusable, no
            // driver call wasted) but nothing else: committed bytes are
            // exactly the device's physical bytes, each chunk mapped once.
            let consistent = |a: &DeviceArena| {
                let st = a.stats();
                let now = fd.live_counts();
                assert_eq!(now.physical_bytes, st.committed_bytes, "{st:?}");
                assert_eq!(now.mappings, st.committed_bytes / g as u64, "{st:?}");
            };
            let before = arena.stats();
            let addr = drive(
                &fd,
                &mut m,
                "arena alloc (grow 3 chunks)",
                kind,
                &mut (),
                |_| arena.alloc(3 * g - 512, 0),
                |_, _| {
                    let st = arena.stats();
                    assert_eq!((st.in_use_bytes, st.live_allocations), (before.in_use_bytes, before.live_allocations));
                    consistent(&arena);
                },
                |_, a| arena.free(a).unwrap(),
            );
            consistent(&arena);
            arena.free(addr).unwrap();
            arena.trim().unwrap();
            drop(arena);

            let pinned = PinnedArena::new(&d, cfg).unwrap();
            let addr = drive(
                &fd,
                &mut m,
                "pinned arena alloc",
                kind,
                &mut (),
                |_| pinned.alloc(g + 256, 0),
                |_, _| {
                    let st = pinned.stats();
                    assert_eq!((st.in_use_bytes, st.live_allocations, st.committed_bytes), (0, 0, 0), "{st:?}");
                    assert_eq!(fd.live_counts().pinned_buffers, 0);
                },
                |_, a| pinned.free(a).unwrap(),
            );
            pinned.free(addr).unwrap();
        }
    }
    m.require("arena create", &[FaultKind::Reserve]);
    m.require("arena alloc (grow 3 chunks)", &[FaultKind::VmmCreate, FaultKind::Map, FaultKind::SetAccess]);
    m.require("pinned arena alloc", &[FaultKind::PinnedAlloc]);
    m.report();
    assert_no_leaks(&fd);
}

#[test]
fn residency_acquire_and_prefetch() {
    let (fd, d) = faulty();
    let mut m = Matrix::default();
    {
        let s = Stream::new(&d).unwrap();
        let sizes = [MIB + 4096, 2 * MIB, 3 * MIB / 2, MIB];
        let srcs: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &n)| random_bytes(10 + i as u64, n)).collect();
        // Without and with a streaming plan (these sizes are mixed): the
        // plan allocates its ring at declare_cycle, so arena-growth faults on
        // acquire are the first pass's; the second covers the ring's paths.
        for (kind, plan) in FaultKind::ALL.into_iter().flat_map(|k| [(k, false), (k, true)]) {
            let mut cfg = ResidencyConfig::with_budget(4 * MIB);
            cfg.stream_plan = plan;
            cfg.register_sources = RegisterSources::Always;
            cfg.engine =
                EngineConfig { slots: 2, chunk_bytes: MIB, target_chunks: 2, fill_threads: 2, ..Default::default() };
            let live = fd.live_counts();
            let res = drive(
                &fd,
                &mut m,
                "residency create",
                kind,
                &mut (),
                |_| ResidencyManager::new(&d, cfg),
                |_, _| assert_eq!(fd.live_counts(), live),
                |_, r| drop(r),
            );
            let ids: Vec<WeightId> = srcs
                .iter()
                .map(|v| res.register(HostRange::from_static(Box::leak(v.clone().into_boxed_slice()))).unwrap())
                .collect();
            res.declare_cycle(&ids).unwrap();
            // Resident weights are exactly the arena's live blocks, and no
            // weight is left acquired by a failed acquire.
            let consistent = |res: &ResidencyManager, w: WeightId| {
                let st = res.stats();
                // (A plan's streaming region is one block holding `ring_weights`.)
                let ring = st.resident_weights - st.ring_weights + u64::from(st.ring_bytes > 0);
                assert_eq!(st.arena.live_allocations, ring, "{st:?}");
                assert_eq!(fd.live_counts().physical_bytes, st.arena.committed_bytes, "{st:?}");
                assert_eq!(
                    res.release(w, s.raw()).unwrap_err().status(),
                    EpmStatus::InvalidState,
                    "a failed acquire left {w:?} acquired"
                );
            };
            for round in 0..2 {
                for (i, &w) in ids.iter().enumerate() {
                    let p = drive(
                        &fd,
                        &mut m,
                        "residency acquire",
                        kind,
                        &mut (),
                        |_| res.acquire(w, s.raw()),
                        |_, _| consistent(&res, w),
                        |_, _| res.release(w, s.raw()).unwrap(),
                    );
                    assert!(
                        read(&fd, &s, p, sizes[i]) == srcs[i],
                        "weight {i} round {round} after {} faults",
                        kind.name()
                    );
                    // A failed release leaves the weight acquired (released exactly once in the end).
                    drive(
                        &fd,
                        &mut m,
                        "residency release (prefetches)",
                        kind,
                        &mut (),
                        |_| res.release(w, s.raw()),
                        |_, _| {
                            let st = res.stats();
                            let blocks = st.resident_weights - st.ring_weights + u64::from(st.ring_bytes > 0);
                            assert_eq!(blocks, st.arena.live_allocations)
                        },
                        // Absorbed (a failed prefetch after the release): acquire again to retry.
                        |_, ()| {
                            res.acquire(w, s.raw()).unwrap();
                        },
                    );
                }
            }
            let next = [ids[0], ids[1]];
            drive(
                &fd,
                &mut m,
                "residency prefetch",
                kind,
                &mut (),
                |_| res.prefetch(&next),
                |_, _| consistent(&res, ids[0]),
                |_, _| (),
            );
            for (i, &w) in next.iter().enumerate() {
                let p = res.acquire(w, s.raw()).unwrap();
                assert!(read(&fd, &s, p, sizes[i]) == srcs[i], "prefetched weight {i} after {} faults", kind.name());
                res.release(w, s.raw()).unwrap();
            }
            res.synchronize().unwrap();
            drop(res);
        }
    }
    m.require("residency create", &[FaultKind::Reserve, FaultKind::Stream, FaultKind::Event]);
    m.require("residency acquire", &[FaultKind::Copy, FaultKind::Event, FaultKind::VmmCreate, FaultKind::Map]);
    m.report();
    assert_no_leaks(&fd);
}

/// Compressed weights (bf16, a streaming plan, a staging smaller than two
/// of them): every fault in an acquire's page-in — a copy into the staging
/// circle, a decode launch, an event — fails that acquire with the injected
/// status and leaves nothing acquired; the next acquire of every weight
/// still reads it bit-exact, and the ledger stays within the budget. (On the
/// host device decodes finish fast enough that a copy ordered wrongly behind
/// a decode would still read right: the staging circle's bookkeeping is
/// checked by `decode::tests`.)
#[test]
fn residency_compressed_page_ins() {
    let (fd, d) = faulty();
    let mut m = Matrix::default();
    {
        let s = Stream::new(&d).unwrap();
        // bf16 values of about ±0.02: their exponents compress to ~0.7.
        let bf16 = |seed: u64, n: usize| -> Vec<u8> {
            let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            (0..n / 2)
                .flat_map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let v = ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.04;
                    ((v.to_bits() >> 16) as u16).to_le_bytes()
                })
                .collect()
        };
        let sizes = [MIB + 4096, 2 * MIB, 3 * MIB / 2, MIB];
        let srcs: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(i, &n)| bf16(30 + i as u64, n)).collect();
        for kind in FaultKind::ALL {
            let res = ResidencyManager::new(&d, ResidencyConfig::with_budget(6 * MIB)).unwrap();
            let ids: Vec<WeightId> = srcs
                .iter()
                .map(|v| {
                    let r = HostRange::from_static(Box::leak(v.clone().into_boxed_slice()));
                    let reg = res.register_encoded(r, epmem::codec::Dtype::Bf16, &Default::default()).unwrap();
                    assert_eq!(reg.raw, None, "weight stored raw: {reg:?}");
                    reg.id
                })
                .collect();
            res.declare_cycle(&ids).unwrap();
            for round in 0..3 {
                for (i, &w) in ids.iter().enumerate() {
                    let p = drive(
                        &fd,
                        &mut m,
                        "residency compressed acquire",
                        kind,
                        &mut (),
                        |_| res.acquire(w, s.raw()),
                        |_, _| {
                            assert_eq!(
                                res.release(w, s.raw()).unwrap_err().status(),
                                EpmStatus::InvalidState,
                                "a failed acquire left {w:?} acquired"
                            )
                        },
                        |_, _| res.release(w, s.raw()).unwrap(),
                    );
                    assert!(
                        read(&fd, &s, p, sizes[i]) == srcs[i],
                        "compressed weight {i} round {round} after {} faults",
                        kind.name()
                    );
                    res.release(w, s.raw()).unwrap();
                }
            }
            let st = res.stats();
            assert!(st.compressed_weights == 4 && st.decodes > 0, "{st:?}");
            assert!(st.peak_resident_bytes + st.decode_staging_bytes <= st.budget_bytes, "ledger over budget: {st:?}");
            res.synchronize().unwrap();
            drop(res);
        }
    }
    m.require("residency compressed acquire", &[FaultKind::Copy, FaultKind::Event]);
    m.report();
    assert_no_leaks(&fd);
}

#[test]
fn kv_create_append_pin_share_cow() {
    let (fd, d) = faulty();
    let g = d.vmm_granularity() as u64;
    // 48 KiB per token: a granule boundary falls inside a prefix.
    let l = KvLayout::token_major(KvShape { layers: 12, kv_heads: 2, head_dim: 512, elem_bytes: 2 }).unwrap();
    let tpg = g / l.bytes_per_token();
    let mut m = Matrix::default();
    {
        let s = Stream::new(&d).unwrap();
        for kind in FaultKind::ALL {
            let live = fd.live_counts();
            let mut a = drive(
                &fd,
                &mut m,
                "kv pool create",
                kind,
                &mut (),
                |_| KvPool::new(&d, KvConfig::new(64 * g)),
                |_, _| assert_eq!(fd.live_counts(), live),
                |_, a| drop(a),
            );
            // The ledger and the device agree, and the snapshot taken before
            // the attempt still holds.
            // (Granules given back by a failed step may stay retained for
            // reuse, so retained handles are checked against the device, not
            // against the snapshot.)
            type Snap = (u64, u64, u64, u64, u64, u64);
            let snap = |a: &KvPool| -> Snap {
                let st = a.stats();
                let lc = fd.live_counts();
                assert_eq!(lc.physical_bytes, st.ledger.owned_bytes + st.pool.retained * g, "{st:?}");
                assert_eq!(st.ledger.charges - st.ledger.credits, st.ledger.owned_granules);
                (
                    st.ledger.owned_bytes,
                    st.ledger.promised_bytes,
                    st.sequences,
                    st.prefixes,
                    lc.va_reservations,
                    lc.mappings,
                )
            };
            macro_rules! step {
                ($what:expr, $op:expr, $undo:expr) => {{
                    let before = snap(&a);
                    drive(
                        &fd,
                        &mut m,
                        $what,
                        kind,
                        &mut a,
                        $op,
                        |a, _| assert_eq!(snap(a), before, "{} after a {} fault", $what, kind.name()),
                        $undo,
                    )
                }};
            }
            let origin = step!("kv seq create", |a| a.create_sequence(&l, 4 * tpg, AdmitMode::Promise), |a, id| a
                .destroy_sequence(id)
                .unwrap());
            // Two appends of one new granule each, so a failure is all or nothing.
            let n = tpg + tpg / 2;
            step!("kv prepare_append", |a| a.prepare_append(origin, tpg / 2, s.raw()), |_, ()| panic!(
                "an append absorbed a fault"
            ));
            step!("kv prepare_append", |a| a.prepare_append(origin, n - tpg / 2, s.raw()), |_, ()| panic!(
                "an append absorbed a fault"
            ));
            let base = a.sequence_info(origin).unwrap().base;
            let bytes = (n * l.bytes_per_token()) as usize;
            let data = random_bytes(40 + kind as u64, bytes);
            // SAFETY: `data` outlives the copy: the stream is synchronized below.
            unsafe { fd.inner().memcpy_htod_async(base, data.as_ptr(), bytes, s.raw()).unwrap() };
            s.synchronize().unwrap();
            let pin = step!("kv prefix pin", |a| a.pin_prefix(origin, n, s.raw()), |a, p| a.unpin_prefix(p).unwrap());
            let sharer = step!(
                "kv commit_shared_prefix",
                |a| a.commit_shared_prefix(pin, n, 3 * tpg, AdmitMode::OnDemand),
                |a, id| a.destroy_sequence(id).unwrap()
            );
            // A failed copy-on-write event is absorbed: the host waits for the copy instead.
            step!("kv append with COW", |a| a.prepare_append(sharer, 4, s.raw()), |_, ()| ());
            // The copied boundary granule holds the prefix's bytes, not garbage.
            let sb = a.sequence_info(sharer).unwrap().base;
            assert!(read(&fd, &s, sb, bytes) == data, "sharer's prefix after COW with {} faults", kind.name());
            let hashed = step!(
                "kv create_for_tokens",
                |a| a.create_sequence_for_tokens(&l, 2 * tpg, &[1, 2, 3], AdmitMode::OnDemand).map(|r| r.0),
                |a, id| a.destroy_sequence(id).unwrap()
            );
            assert!(a.sequence_info(sharer).unwrap().len_tokens >= n + 4);
            a.destroy_sequence(hashed).unwrap();
            a.destroy_sequence(origin).unwrap();
            a.unpin_prefix(pin).unwrap();
            a.destroy_sequence(sharer).unwrap();
            assert_eq!(a.stats().ledger.owned_bytes, g, "only the dummy is owned");
            a.trim();
            drop(a);
            assert_eq!(fd.live_counts(), live, "kv pool teardown after {} faults", kind.name());
        }
    }
    m.require("kv pool create", &[FaultKind::VmmCreate, FaultKind::Reserve, FaultKind::Map, FaultKind::Copy]);
    m.require("kv seq create", &[FaultKind::Reserve, FaultKind::Map]);
    m.require("kv prepare_append", &[FaultKind::VmmCreate, FaultKind::Map, FaultKind::SetAccess]);
    m.require("kv prefix pin", &[FaultKind::SetAccess]);
    m.require("kv commit_shared_prefix", &[FaultKind::Reserve, FaultKind::Map]);
    m.require("kv append with COW", &[FaultKind::Copy, FaultKind::VmmCreate, FaultKind::Map]);
    m.report();
    assert_no_leaks(&fd);
}
