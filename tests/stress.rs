//! Eight threads for a bounded time (EPM_STRESS_SECS, default 2) share one
//! staging pool, one copy engine, one residency manager and one KV pool,
//! each doing random work with bit-exact checks:
//! - pool acquire → fill → copy → read back → retire, with every held
//!   buffer's address in a shared set (a buffer handed out twice fails);
//! - engine htod of pageable data, read back;
//! - residency acquire (and prefetch) on the thread's stream, the device copy
//!   compared with the host weight, release;
//! - KV create / append (writing the new tokens) / pin / commit_shared_prefix
//!   (the sharer's prefix compared with the pinned bytes) / destroy / unpin.
//!
//! Afterwards: the ledger equals the live granules (the dummy, every
//! sequence's private granules, every live prefix's granules) and the
//! device's physical bytes; the pool's buffers are all accounted for; each
//! device's live counts are zero at teardown. Each subsystem has its own
//! device, so the device's counts are that subsystem's alone.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use epmem::EpmStatus;
use epmem::device::{self, Device, DeviceBuffer, HostRange, LiveCounts, Stream};
use epmem::kv::{AdmitMode, KvConfig, KvLayout, KvPool, KvShape, PrefixId, SeqId};
use epmem::residency::{ResidencyConfig, ResidencyManager, WeightId};
use epmem::staging::{CopyEngine, EngineConfig, PinnedStagingPool, PoolConfig};
use epmem::transfer::witness;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const THREADS: u64 = 8;

use fastrand::Rng;

/// A uniform pick in `0..n`, taking `n = 0` as 1 (the cycles pick from lists
/// and lengths that may be empty).
fn below(r: &mut Rng, n: u64) -> u64 {
    r.u64(..n.max(1))
}

fn pattern(n: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; n];
    Rng::with_seed(seed).fill(&mut v);
    v
}

fn leak(v: Vec<u8>) -> HostRange {
    HostRange::from_static(Box::leak(v.into_boxed_slice()))
}

fn read(d: &Arc<dyn Device>, s: &Stream, src: u64, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    // SAFETY: `v` outlives the copy: the stream is synchronized before returning.
    unsafe { d.memcpy_dtoh_async(v.as_mut_ptr(), src, n, s.raw()).unwrap() };
    s.synchronize().unwrap();
    v
}

fn write(d: &Arc<dyn Device>, s: &Stream, dst: u64, bytes: &[u8]) {
    // SAFETY: `bytes` outlives the copy: the stream is synchronized before returning.
    unsafe { d.memcpy_htod_async(dst, bytes.as_ptr(), bytes.len(), s.raw()).unwrap() };
    s.synchronize().unwrap();
}

struct Staging {
    d: Arc<dyn Device>,
    pool: PinnedStagingPool,
    engine: CopyEngine,
    held: Mutex<HashSet<usize>>,
}

struct Residency {
    d: Arc<dyn Device>,
    res: ResidencyManager,
    ids: Vec<WeightId>,
    srcs: Vec<Vec<u8>>,
}

#[derive(Default)]
struct KvBook {
    /// Sequence → (owner thread, the bytes of its tokens so far).
    seqs: HashMap<SeqId, (u64, Vec<u8>)>,
    /// Live prefixes we pinned (pinned or not), with the bytes they hold.
    prefixes: HashMap<PrefixId, (bool, Vec<u8>)>,
}

struct Kv {
    d: Arc<dyn Device>,
    layout: KvLayout,
    arena: Mutex<(KvPool, KvBook)>,
}

#[derive(Default)]
struct Counts {
    pool: AtomicU64,
    engine: AtomicU64,
    residency: AtomicU64,
    all_in_use: AtomicU64,
    kv: AtomicU64,
    shares: AtomicU64,
}

fn pool_cycle(st: &Staging, s: &Stream, dst: &DeviceBuffer, r: &mut Rng) {
    let len = KIB * (1 + below(r, 2048)) as usize;
    let mut buf = st.pool.acquire(len).unwrap();
    let addr = buf.as_ptr() as usize;
    assert!(st.held.lock().unwrap().insert(addr), "staging buffer {addr:#x} handed out twice");
    let data = pattern(len, r.u64(..));
    buf[..len].copy_from_slice(&data);
    let done = witness::enqueue_htod(s, dst.ptr(), buf, len, None).unwrap().wait().unwrap();
    assert!(read(&st.d, s, dst.ptr(), len) == data, "pool copy of {len} bytes");
    assert!(st.held.lock().unwrap().remove(&addr));
    st.pool.release(done);
}

fn engine_cycle(st: &Staging, s: &Stream, dst: &DeviceBuffer, r: &mut Rng) {
    let len = KIB * (1 + below(r, 3 * 1024)) as usize;
    let data = pattern(len, r.u64(..));
    let range = leak(data.clone());
    st.engine.htod(dst.ptr(), range, Some(s.raw())).unwrap().wait().unwrap();
    assert!(read(&st.d, s, dst.ptr(), len) == data, "engine copy of {len} bytes");
}

fn residency_cycle(rs: &Residency, s: &Stream, r: &mut Rng, c: &Counts) {
    let i = below(r, rs.ids.len() as u64) as usize;
    if below(r, 4) == 0 {
        let j = (i + 1) % rs.ids.len();
        rs.res.prefetch(&[rs.ids[i], rs.ids[j]]).unwrap();
    }
    match rs.res.acquire(rs.ids[i], s.raw()) {
        Ok(p) => {
            let got = read(&rs.d, s, p, rs.srcs[i].len());
            assert!(got == rs.srcs[i], "weight {i}: device copy differs from the host weight");
            rs.res.release(rs.ids[i], s.raw()).unwrap();
        }
        // Eight threads may hold more than the budget at once: a clean refusal.
        Err(e) if e.status() == EpmStatus::AllInUse => {
            c.all_in_use.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => panic!("residency acquire: {e:?}"),
    }
}

fn kv_cycle(kv: &Kv, s: &Stream, me: u64, r: &mut Rng, c: &Counts) {
    let bpt = kv.layout.bytes_per_token() as usize;
    let mut g = kv.arena.lock().unwrap();
    let (a, book) = &mut *g;
    let mine: Vec<SeqId> = book.seqs.iter().filter(|(_, (o, _))| *o == me).map(|(id, _)| *id).collect();
    fn pick<T: Copy>(r: &mut Rng, v: &[T]) -> T {
        v[below(r, v.len() as u64) as usize]
    }
    match below(r, 6) {
        0 if mine.len() < 3 => {
            let id = a.create_sequence(&kv.layout, 8 + below(r, 120), AdmitMode::OnDemand).unwrap();
            book.seqs.insert(id, (me, Vec::new()));
        }
        1 | 2 if !mine.is_empty() => {
            let id = pick(r, &mine);
            let info = a.sequence_info(id).unwrap();
            let n = below(r, info.max_tokens - info.len_tokens + 1).min(24);
            match a.prepare_append(id, n, s.raw()) {
                Ok(()) => {}
                Err(e) if e.status() == EpmStatus::OutOfBudget => return,
                Err(e) => panic!("prepare_append: {e:?}"),
            }
            if n == 0 {
                return;
            }
            let data = pattern(n as usize * bpt, r.u64(..));
            write(&kv.d, s, info.base + info.len_tokens * bpt as u64, &data);
            book.seqs.get_mut(&id).unwrap().1.extend_from_slice(&data);
        }
        3 if !mine.is_empty() => {
            let id = pick(r, &mine);
            let info = a.sequence_info(id).unwrap();
            // Pin only sequences that share nothing, so prefixes never overlap
            // and the ledger check below can count their granules once.
            if info.len_tokens == 0 || info.shared_granules > 0 {
                return;
            }
            let n = 1 + below(r, info.len_tokens);
            let pid = a.pin_prefix(id, n, s.raw()).unwrap();
            let bytes = book.seqs[&id].1[..n as usize * bpt].to_vec();
            book.prefixes.insert(pid, (true, bytes));
        }
        4 => {
            let pinned: Vec<PrefixId> = book.prefixes.iter().filter(|(_, (p, _))| *p).map(|(id, _)| *id).collect();
            if pinned.is_empty() {
                return;
            }
            let pid = pick(r, &pinned);
            if below(r, 3) == 0 {
                a.unpin_prefix(pid).unwrap();
                book.prefixes.get_mut(&pid).unwrap().0 = false;
            } else if mine.len() < 3 {
                let pn = a.prefix_info(pid).unwrap().n_tokens;
                let n = 1 + below(r, pn);
                match a.commit_shared_prefix(pid, n, n + below(r, 64), AdmitMode::OnDemand) {
                    Ok(id) => {
                        let want = book.prefixes[&pid].1[..n as usize * bpt].to_vec();
                        let base = a.sequence_info(id).unwrap().base;
                        assert!(read(&kv.d, s, base, want.len()) == want, "a sharer sees other bytes than the prefix");
                        book.seqs.insert(id, (me, want));
                        c.shares.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) if e.status() == EpmStatus::OutOfBudget => {}
                    Err(e) => panic!("commit_shared_prefix: {e:?}"),
                }
            }
        }
        5 if !mine.is_empty() => {
            let id = pick(r, &mine);
            let info = a.sequence_info(id).unwrap();
            let want = &book.seqs[&id].1;
            assert!(read(&kv.d, s, info.base, want.len()) == *want, "sequence {id:#x} lost its bytes");
            a.destroy_sequence(id).unwrap();
            book.seqs.remove(&id);
        }
        _ => return,
    }
    c.kv.fetch_add(1, Ordering::Relaxed);
    book.prefixes.retain(|&pid, _| a.prefix_info(pid).is_ok());
}

/// The ledger equals the live granules, and the device's physical bytes.
fn check_ledger(kv: &Kv, a: &KvPool, book: &KvBook) {
    let st = a.stats();
    let g = st.granule_bytes;
    let private: u64 = book.seqs.keys().map(|&id| a.sequence_info(id).unwrap().private_granules).sum();
    let prefix: u64 = book.prefixes.keys().map(|&pid| a.prefix_info(pid).unwrap().granules).sum();
    assert_eq!(st.ledger.owned_granules, 1 + private + prefix, "ledger vs live granules: {st:?}");
    assert_eq!(st.ledger.owned_bytes, st.ledger.owned_granules * g);
    assert_eq!(st.ledger.charges - st.ledger.credits, st.ledger.owned_granules);
    assert_eq!(kv.d.live_counts().physical_bytes, st.ledger.owned_bytes + st.pool.retained * g, "{st:?}");
    assert_eq!(st.sequences, book.seqs.len() as u64);
}

#[test]
fn eight_threads_share_pool_engine_residency_and_kv() {
    let secs: f64 = std::env::var("EPM_STRESS_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(2.0);
    let open = || device::open_from_env(0).expect("open the device EPM_DEVICE names");
    let (ds, dr, dk) = (open(), open(), open());
    {
        let pool = PinnedStagingPool::new(&ds, PoolConfig::default()).unwrap();
        let cfg = EngineConfig { slots: 3, chunk_bytes: MIB, target_chunks: 4, fill_threads: 2, ..Default::default() };
        let engine = CopyEngine::new(&pool, cfg).unwrap();
        let st = Staging { d: ds.clone(), pool, engine, held: Mutex::new(HashSet::new()) };

        let srcs: Vec<Vec<u8>> = (0..16).map(|i| pattern(64 * KIB + 4096 * i, 100 + i as u64)).collect();
        let mut rc = ResidencyConfig::with_budget(THREADS as usize * 128 * KIB + 256 * KIB);
        rc.engine = cfg;
        let res = ResidencyManager::new(&dr, rc).unwrap();
        let ids: Vec<WeightId> = srcs.iter().map(|v| res.register(leak(v.clone())).unwrap()).collect();
        res.declare_cycle(&ids).unwrap();
        let rs = Residency { d: dr.clone(), res, ids, srcs };

        let g = dk.vmm_granularity() as u64;
        // 64 KiB per token: a granule holds 32 (2 MiB) and prefixes end mid-granule.
        let layout = KvLayout::token_major(KvShape { layers: 8, kv_heads: 4, head_dim: 512, elem_bytes: 2 }).unwrap();
        let arena = KvPool::new(&dk, KvConfig::new(48 * g)).unwrap();
        let kv = Kv { d: dk.clone(), layout, arena: Mutex::new((arena, KvBook::default())) };

        let counts = Counts::default();
        let deadline = Instant::now() + Duration::from_secs_f64(secs);
        let hard_stop = Instant::now() + Duration::from_secs_f64(5.0 * secs);
        std::thread::scope(|sc| {
            for t in 0..THREADS {
                let (st, rs, kv, counts) = (&st, &rs, &kv, &counts);
                sc.spawn(move || {
                    let mut r = Rng::with_seed(0x5eed ^ ((t + 1) * 0x1234_5678_9abc));
                    let ss = Stream::new(&st.d).unwrap();
                    let sr = Stream::new(&rs.d).unwrap();
                    let sk = Stream::new(&kv.d).unwrap();
                    let dst = DeviceBuffer::new(&st.d, 3 * MIB).unwrap();
                    // Past the deadline only while some kind of work has not
                    // run yet (a slow machine, valgrind), up to 5x as long.
                    let ran = |c: &AtomicU64| c.load(Ordering::Relaxed) > 0;
                    let all_ran = || [&counts.pool, &counts.engine, &counts.residency, &counts.kv].into_iter().all(ran);
                    while Instant::now() < deadline || (!all_ran() && Instant::now() < hard_stop) {
                        match below(&mut r, 4) {
                            0 => {
                                pool_cycle(st, &ss, &dst, &mut r);
                                counts.pool.fetch_add(1, Ordering::Relaxed);
                            }
                            1 => {
                                engine_cycle(st, &ss, &dst, &mut r);
                                counts.engine.fetch_add(1, Ordering::Relaxed);
                            }
                            2 => {
                                residency_cycle(rs, &sr, &mut r, counts);
                                counts.residency.fetch_add(1, Ordering::Relaxed);
                            }
                            _ => kv_cycle(kv, &sk, t, &mut r, counts),
                        }
                    }
                });
            }
        });
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        eprintln!(
            "stress {secs} s: pool {} engine {} residency {} (all-in-use {}) kv {} (shares {})",
            n(&counts.pool),
            n(&counts.engine),
            n(&counts.residency),
            n(&counts.all_in_use),
            n(&counts.kv),
            n(&counts.shares)
        );
        for (what, c) in
            [("pool", &counts.pool), ("engine", &counts.engine), ("residency", &counts.residency), ("kv", &counts.kv)]
        {
            assert!(n(c) > 0, "no {what} work ran");
        }

        // Every pinned buffer is retained or was freed; none is held.
        st.engine.synchronize().unwrap();
        assert!(st.held.lock().unwrap().is_empty());
        let ps = st.pool.stats();
        assert_eq!(ps.pinned_alloc_calls - ps.pinned_free_calls, ps.retained_buffers, "{ps:?}");
        assert_eq!(ds.live_counts().pinned_buffers, ps.retained_buffers, "{ps:?}");
        // Residency: nothing left acquired, every weight still bit-exact.
        rs.res.synchronize().unwrap();
        let s = Stream::new(&dr).unwrap();
        for (i, &w) in rs.ids.iter().enumerate() {
            let p = rs.res.acquire(w, s.raw()).unwrap();
            assert!(read(&dr, &s, p, rs.srcs[i].len()) == rs.srcs[i], "weight {i} after the run");
            rs.res.release(w, s.raw()).unwrap();
        }
        let rst = rs.res.stats();
        // One arena block per resident weight; a plan's streaming region is
        // one block holding `ring_weights`.
        let blocks = rst.resident_weights - rst.ring_weights + u64::from(rst.ring_bytes > 0);
        assert_eq!(rst.arena.live_allocations, blocks, "{rst:?}");
        // KV: the ledger equals the live granules; every sequence kept its bytes.
        let sk = Stream::new(&dk).unwrap();
        let mut g = kv.arena.lock().unwrap();
        let (a, book) = &mut *g;
        check_ledger(&kv, a, book);
        for (&id, (_, want)) in &book.seqs {
            let base = a.sequence_info(id).unwrap().base;
            assert!(read(&dk, &sk, base, want.len()) == *want, "sequence {id:#x} after the run");
        }
        for (&pid, (_, want)) in &book.prefixes {
            let v = a.prefix_info(pid).unwrap().view_base;
            assert!(read(&dk, &sk, v, want.len()) == *want, "prefix {pid:#x} after the run");
        }
        a.clear().unwrap();
        assert_eq!(a.stats().ledger.owned_bytes, a.granule() as u64, "only the dummy is owned");
    }
    for d in [ds, dr, dk] {
        d.synchronize().unwrap();
        assert_eq!(d.live_counts(), LiveCounts::default(), "device resources left at teardown");
    }
}
