//! Compressed weights through the residency manager, on the device
//! `EPM_DEVICE` names (host in CI, CUDA with EPM_DEVICE=cuda): registration
//! (validated, encoded, or kept raw), page-ins that copy the compressed bytes
//! and decode them on the device, bit-exact under eviction, ring plans,
//! prefetch and every policy, with the budget and stats as documented.

use std::sync::Arc;

use epmem::EpmStatus;
use epmem::codec::{self, Dtype, EncodeOptions, Encoded, RawReason};
use epmem::device::{self, Device, DeviceBuffer, Gate, HostRange, Stream, checksum_host};
use epmem::residency::placement::whole_weight_floor;
use epmem::residency::{
    DECODE_STAGING_BUFFERS, DECODE_STAGING_MIN_BYTES, PolicyKind, RegisterSources, ResidencyConfig, ResidencyManager,
    WeightId,
};

fn dev() -> Arc<dyn Device> {
    device::open_from_env(0).expect("open device (EPM_DEVICE)")
}

fn normal(rng: &mut fastrand::Rng) -> f32 {
    let (u, v) = (rng.f32().max(1e-7), rng.f32());
    (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
}

/// `n` values of N(0, 0.02) as bf16 or fp16 bytes.
fn weight(dtype: Dtype, n: usize, seed: u64) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut out = Vec::with_capacity(2 * n);
    for _ in 0..n {
        let x = 0.02 * normal(&mut rng);
        let v = match dtype {
            Dtype::Fp16 => f32_to_f16(x),
            _ => (x.to_bits() >> 16) as u16,
        };
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Round toward zero: any fp16 pattern will do, the codec is lossless.
fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let e = ((b >> 23) & 0xFF) as i32 - 127 + 15;
    let m = b & 0x7F_FFFF;
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        return sign | (((m | 0x80_0000) >> (14 - e)) as u16);
    }
    if e >= 31 {
        return sign | 0x7C00;
    }
    sign | ((e as u16) << 10) | (m >> 13) as u16
}

fn range(v: &[u8]) -> HostRange {
    // SAFETY: every Vec passed here outlives the managers of its test and is
    // not written while they live.
    unsafe { HostRange::new(v.as_ptr(), v.len()) }
}

/// Encode everything at least 1 KiB (the default 1 MiB would keep these
/// test-sized weights raw).
fn opts() -> EncodeOptions {
    EncodeOptions { min_bytes: 1024, ..EncodeOptions::default() }
}

fn cfg(budget: usize) -> ResidencyConfig {
    let mut c = ResidencyConfig::with_budget(budget);
    c.pool.max_bytes = 64 << 20;
    c.engine.chunk_bytes = 1 << 20;
    c.engine.fill_threads = 2;
    c
}

/// Acquire each of `ids` in order, read it back and release it: each must
/// be `data`'s bytes exactly.
fn read_all<V: AsRef<[u8]>>(
    m: &ResidencyManager,
    d: &Arc<dyn Device>,
    s: &Stream,
    ids: &[WeightId],
    data: &[V],
    what: &str,
) {
    for (i, &w) in ids.iter().enumerate() {
        let p = m.acquire(w, s.raw()).unwrap();
        let back = read_back(d, p, data[i].as_ref().len(), s);
        m.release(w, s.raw()).unwrap();
        assert!(back == data[i].as_ref(), "{what}: weight {i} is not bit-exact");
    }
}

/// Register each of `data` (bf16) compressed; each must encode.
fn register_coded<V: AsRef<[u8]>>(m: &ResidencyManager, data: &[V]) -> Vec<WeightId> {
    data.iter()
        .map(|v| {
            let r = m.register_encoded(range(v.as_ref()), Dtype::Bf16, &opts()).unwrap();
            assert_eq!(r.raw, None);
            r.id
        })
        .collect()
}

/// The device bytes at `p` (the stream waits for its queued work first).
fn read_back(d: &Arc<dyn Device>, p: u64, n: usize, s: &Stream) -> Vec<u8> {
    let mut out = vec![0u8; n];
    // SAFETY: `out` is an exclusively owned buffer of n bytes, read only after
    // the stream synchronizes.
    unsafe { d.memcpy_dtoh_async(out.as_mut_ptr(), p, n, s.raw()).unwrap() };
    s.synchronize().unwrap();
    out
}

#[test]
fn bf16_and_fp16_round_trip_bit_exact_through_the_manager() {
    let d = dev();
    let m = ResidencyManager::new(&d, cfg(8 << 20)).unwrap();
    let s = Stream::new(&d).unwrap();
    let mut raw_total = 0;
    let mut coded_total = 0;
    for (i, dtype) in [Dtype::Bf16, Dtype::Fp16, Dtype::Bf16, Dtype::Fp16].into_iter().enumerate() {
        // Odd lengths: a last block of 77 and of 1 value.
        let n = [3 * codec::BLOCK_VALUES + 77, 2 * codec::BLOCK_VALUES + 1, 40_000, 50_001][i];
        let data = weight(dtype, n, 10 + i as u64);
        let r = m.register_encoded(range(&data), dtype, &opts()).unwrap();
        assert_eq!(r.raw, None, "{dtype:?} weight {i} stayed raw");
        assert!(m.is_compressed(r.id).unwrap());
        assert_eq!(m.weight_len(r.id).unwrap(), data.len());
        assert!(r.host_bytes < data.len(), "{} compressed for {} raw", r.host_bytes, data.len());
        raw_total += data.len();
        coded_total += r.host_bytes;
        let p = m.acquire(r.id, s.raw()).unwrap();
        assert_eq!(p % 16, 0);
        let back = read_back(&d, p, data.len(), &s);
        m.release(r.id, s.raw()).unwrap();
        assert!(back == data, "{dtype:?} weight {i} of {n} values is not bit-exact on the device");
    }
    m.synchronize().unwrap();
    let st = m.stats();
    assert_eq!(st.compressed_weights, 4);
    assert_eq!(st.compressed_raw_bytes, raw_total as u64);
    assert_eq!(st.compressed_host_bytes, coded_total as u64);
    assert_eq!(st.decodes, 4);
    assert_eq!(st.decoded_bytes, raw_total as u64);
    assert_eq!(st.compressed_htod_bytes, coded_total as u64);
    assert_eq!(st.htod_bytes, coded_total as u64, "only compressed bytes crossed");
    assert!(st.decode_ms > 0.0, "decode time not measured: {st:?}");
    assert_eq!(st.staged_page_ins, 0, "a compressed weight's host copy is page-locked: {st:?}");
    // The staging: two buffers of the largest compressed weight, out of the budget.
    assert!(st.decode_staging_bytes >= (DECODE_STAGING_BUFFERS * coded_total / 4) as u64);
    assert_eq!(st.budget_bytes, 8 << 20);
}

#[test]
fn an_encoded_buffer_registers_and_a_corrupt_or_truncated_one_is_refused() {
    let d = dev();
    let m = ResidencyManager::new(&d, cfg(4 << 20)).unwrap();
    let data = weight(Dtype::Bf16, 100_000, 3);
    let Encoded::Coded(buf) = codec::encode(&data, Dtype::Bf16, &opts()).unwrap() else {
        panic!("a normal bf16 weight stayed raw")
    };
    let mut bad = buf.clone();
    bad[buf.len() / 2] ^= 0x10;
    let e = m.register_compressed(&bad).unwrap_err();
    assert!(e.to_string().contains("checksum"), "{e}");
    let e = m.register_compressed(&buf[..buf.len() - 16]).unwrap_err();
    assert!(e.to_string().contains("truncated"), "{e}");
    let e = m.register_compressed(&data).unwrap_err();
    assert!(e.to_string().contains("magic") || e.to_string().contains("truncated"), "{e}");
    assert_eq!(m.stats().registered_weights, 0, "a refused buffer was registered");
    assert_eq!(codec::parse(&buf, 1).unwrap().version(), 2, "the encoder's choice for a normal bf16 weight");
    let id = m.register_compressed(&buf).unwrap();
    drop(buf); // the manager keeps its own copy
    let s = Stream::new(&d).unwrap();
    let p = m.acquire(id, s.raw()).unwrap();
    assert!(read_back(&d, p, data.len(), &s) == data);
    m.release(id, s.raw()).unwrap();
    m.unregister(id).unwrap();
    assert_eq!(m.stats().compressed_weights, 0);
    // A format-v1 buffer (what an older library wrote) registers and decodes the same.
    let Encoded::Coded(v1) = codec::encode(&data, Dtype::Bf16, &EncodeOptions { k2: Some(0), ..opts() }).unwrap()
    else {
        panic!("a normal bf16 weight stayed raw")
    };
    assert_eq!(codec::parse(&v1, 1).unwrap().version(), 1);
    let id = m.register_compressed(&v1).unwrap();
    let p = m.acquire(id, s.raw()).unwrap();
    assert!(read_back(&d, p, data.len(), &s) == data, "a v1 buffer read back differently");
    m.release(id, s.raw()).unwrap();
    m.unregister(id).unwrap();
}

#[test]
fn weights_the_codec_keeps_raw_are_registered_raw_and_say_why() {
    let d = dev();
    let m = ResidencyManager::new(&d, cfg(4 << 20)).unwrap();
    let mut random = vec![0u8; 200_000];
    fastrand::Rng::with_seed(5).fill(&mut random);
    let small = weight(Dtype::Bf16, 100, 6);
    let fp32 = weight(Dtype::Bf16, 60_000, 7);
    let cases = [(&random, Dtype::Bf16, "no gain"), (&small, Dtype::Bf16, "too small"), (&fp32, Dtype::Other, "dtype")];
    let s = Stream::new(&d).unwrap();
    for (data, dtype, what) in cases {
        let r = m.register_encoded(range(data), dtype, &opts()).unwrap();
        let ok = match (what, r.raw) {
            ("no gain", Some(RawReason::NoGain { .. })) => true,
            ("too small", Some(RawReason::TooSmall { .. })) => true,
            ("dtype", Some(RawReason::UnsupportedDtype)) => true,
            _ => false,
        };
        assert!(ok, "{what}: {:?}", r.raw);
        assert!(!m.is_compressed(r.id).unwrap());
        assert_eq!(r.host_bytes, data.len());
        let p = m.acquire(r.id, s.raw()).unwrap();
        assert!(read_back(&d, p, data.len(), &s) == **data, "{what}: raw weight not exact");
        m.release(r.id, s.raw()).unwrap();
    }
    let st = m.stats();
    assert_eq!((st.compressed_weights, st.decodes), (0, 0));
}

#[test]
fn the_budget_must_hold_the_largest_weight_beside_its_staging() {
    let d = dev();
    let data = weight(Dtype::Bf16, 200_000, 8); // 400,000 bytes raw, ~0.7 × compressed
    // The weight alone fits, not with two staging buffers of its compressed bytes.
    let m = ResidencyManager::new(&d, cfg(500_000)).unwrap();
    let e = m.register_encoded(range(&data), Dtype::Bf16, &opts()).unwrap_err();
    assert_eq!(e.status(), EpmStatus::OutOfBudget);
    assert!(e.to_string().contains("staging"), "{e}");
    assert_eq!(m.stats().registered_weights, 0);
    // A raw weight registered first makes a later compressed one refused too
    // when it is the largest that would not fit beside the staging.
    let m = ResidencyManager::new(&d, cfg(1 << 20)).unwrap();
    let big = vec![1u8; 900_000];
    m.register(range(&big)).unwrap();
    let e = m.register_encoded(range(&data), Dtype::Bf16, &opts()).unwrap_err();
    assert_eq!(e.status(), EpmStatus::OutOfBudget, "{e}");
    // And once staging is reserved, a raw weight must fit what is left.
    let m = ResidencyManager::new(&d, cfg(1 << 20)).unwrap();
    let r = m.register_encoded(range(&data), Dtype::Bf16, &opts()).unwrap();
    assert_eq!(r.raw, None);
    let staging = m.stats().decode_staging_bytes as usize;
    assert!(staging >= 2 * r.host_bytes);
    let too_big = vec![2u8; (1 << 20) - staging + 4096];
    let e = m.register(range(&too_big)).unwrap_err();
    assert_eq!(e.status(), EpmStatus::OutOfBudget);
    assert!(e.to_string().contains("decode staging"), "{e}");
}

/// A mix of compressed and raw weights (`sizes` in values; odd indexes raw).
struct Mix {
    data: Vec<Vec<u8>>,
    ids: Vec<WeightId>,
}

fn mix(m: &ResidencyManager, sizes: &[usize], seed: u64) -> Mix {
    let mut data = Vec::new();
    let mut ids = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let dtype = if i % 4 == 2 { Dtype::Fp16 } else { Dtype::Bf16 };
        let v = weight(dtype, n, seed + i as u64);
        data.push(v);
    }
    for (i, v) in data.iter().enumerate() {
        let dtype = if i % 4 == 2 { Dtype::Fp16 } else { Dtype::Bf16 };
        let id = if i % 3 == 1 {
            m.register(range(v)).unwrap()
        } else {
            let r = m.register_encoded(range(v), dtype, &opts()).unwrap();
            assert_eq!(r.raw, None);
            r.id
        };
        ids.push(id);
    }
    Mix { data, ids }
}

/// `steps` decode steps: acquire, a spin (the layer's compute, so reads are in
/// flight when the next page-ins are issued), a checksum on the device, release.
fn run(d: &Arc<dyn Device>, m: &ResidencyManager, x: &Mix, steps: usize, what: &str) {
    let s = Stream::new(d).unwrap();
    let slots = DeviceBuffer::new(d, 8 * x.ids.len()).unwrap();
    let want: Vec<u64> = x.data.iter().map(|v| checksum_host(v)).collect();
    for step in 0..steps {
        for (i, &id) in x.ids.iter().enumerate() {
            let p = m.acquire(id, s.raw()).unwrap();
            d.spin_async(50, s.raw()).unwrap();
            d.checksum_async(p, x.data[i].len(), slots.ptr() + 8 * i as u64, s.raw()).unwrap();
            m.release(id, s.raw()).unwrap();
        }
        let mut got = vec![0u64; x.ids.len()];
        // SAFETY: `got` is exclusively owned, 8 bytes per weight, read after
        // the stream synchronizes.
        unsafe { d.memcpy_dtoh_async(got.as_mut_ptr().cast(), slots.ptr(), 8 * x.ids.len(), s.raw()).unwrap() };
        s.synchronize().unwrap();
        for i in 0..x.ids.len() {
            assert_eq!(got[i], want[i], "{what}, step {step}: weight {i} is not bit-exact on the device");
        }
    }
}

#[test]
fn compressed_and_raw_mixes_stay_exact_under_eviction_plans_prefetch_and_policies() {
    let d = dev();
    // Uneven sizes (a ring plan under the cyclic policy) and equal ones
    // (farthest-next-use, ordered reuse of the victim's block).
    let uneven: Vec<usize> = (0..10).map(|i| 30_000 + 17_000 * (i % 4) + 14 * i).collect();
    let equal = vec![40_000usize; 10];
    for (shape, sizes) in [("uneven", &uneven), ("equal", &equal)] {
        let total: usize = sizes.iter().map(|n| 2 * n).sum();
        for policy in [PolicyKind::Cyclic, PolicyKind::Lru] {
            for depth in 1..=4 {
                for frac in [0.45, 0.7] {
                    let what = format!("{shape}, {policy:?}, depth {depth}, budget {frac}");
                    let mut c = cfg(0);
                    c.policy = policy;
                    c.prefetch_depth = depth;
                    c.coalesce_below_bytes = 0;
                    // Staging (two of the largest compressed weights) comes
                    // out of the budget: add it so `frac` is what weights get.
                    let largest = 2 * sizes.iter().max().unwrap();
                    c.budget_bytes = (total as f64 * frac) as usize + 2 * largest;
                    let m = ResidencyManager::new(&d, c).unwrap();
                    let x = mix(&m, sizes, 100);
                    m.declare_cycle(&x.ids).unwrap();
                    run(&d, &m, &x, 5, &what);
                    m.synchronize().unwrap();
                    let st = m.stats();
                    let ncoded = x.ids.iter().filter(|&&w| m.is_compressed(w).unwrap()).count() as u64;
                    assert!(st.evictions > 0 && st.decodes > 2 * ncoded, "{what}: {st:?}");
                    assert!(st.compressed_htod_bytes < st.decoded_bytes, "{what}: {st:?}");
                    assert!(st.peak_resident_bytes + st.decode_staging_bytes <= st.budget_bytes, "{what}: {st:?}");
                    if shape == "uneven" && policy == PolicyKind::Cyclic {
                        assert!(st.ring_page_ins > 0, "{what}: no ring: {st:?}");
                    }
                    if depth > 1 && policy == PolicyKind::Cyclic {
                        assert!(st.prefetch_page_ins > 0, "{what}: {st:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn decoded_bytes_match_the_weights_paged_in() {
    let d = dev();
    let sizes = vec![40_000usize; 6];
    let mut c = cfg(0);
    c.coalesce_below_bytes = 0;
    c.budget_bytes = 2 * 40_000 * 3 + 4 * 2 * 40_000;
    let m = ResidencyManager::new(&d, c).unwrap();
    let x = mix(&m, &sizes, 7);
    m.declare_cycle(&x.ids).unwrap();
    run(&d, &m, &x, 4, "equal sizes");
    m.synchronize().unwrap();
    let st = m.stats();
    let coded: Vec<usize> = (0..6).filter(|&i| m.is_compressed(x.ids[i]).unwrap()).collect();
    // Every decode wrote one whole weight of 80,000 bytes.
    assert_eq!(st.decoded_bytes, st.decodes * 80_000, "{st:?}");
    assert!(st.decodes > coded.len() as u64, "no weight was decoded twice: {st:?}");
    let host: u64 = st.compressed_host_bytes;
    assert_eq!(st.compressed_raw_bytes, 80_000 * coded.len() as u64);
    assert!(host < st.compressed_raw_bytes * 3 / 4, "host copies {host} of {} raw", st.compressed_raw_bytes);
    // Raw page-ins copied their 80,000 bytes, decodes their compressed ones.
    assert!(st.compressed_htod_bytes < st.decoded_bytes, "{st:?}");
    assert_eq!(st.htod_bytes, st.compressed_htod_bytes + 80_000 * (st.page_ins - st.decodes), "{st:?}");
}

#[test]
fn unregistering_and_registering_again_under_a_live_cycle_stays_exact() {
    let d = dev();
    let sizes: Vec<usize> = (0..8).map(|i| 20_000 + 9_000 * (i % 3)).collect();
    let mut c = cfg(0);
    c.coalesce_below_bytes = 0;
    c.budget_bytes = sizes.iter().sum::<usize>() + 8 * 38_000;
    let m = ResidencyManager::new(&d, c).unwrap();
    let mut x = mix(&m, &sizes, 40);
    m.declare_cycle(&x.ids).unwrap();
    run(&d, &m, &x, 3, "before");
    // Replace weight 0 (compressed) with new bytes.
    m.unregister(x.ids[0]).unwrap();
    x.data[0] = weight(Dtype::Bf16, sizes[0], 999);
    x.ids[0] = m.register_encoded(range(&x.data[0]), Dtype::Bf16, &opts()).unwrap().id;
    m.declare_cycle(&x.ids).unwrap();
    run(&d, &m, &x, 3, "after");
}

/// A compressed page-in into the block of a weight whose reader is still
/// held is ordered behind that reader on the device: the host does not wait
/// and the reader sees its weight, not the decode's output.
#[test]
fn a_decode_into_a_reused_block_waits_for_its_readers_on_the_device() {
    let d = dev();
    let a = weight(Dtype::Bf16, 100_000, 1);
    let b = weight(Dtype::Bf16, 100_000, 2);
    let mut c = cfg(0);
    c.prefetch_depth = 0;
    c.budget_bytes = a.len() + 2 * (a.len() * 3 / 4); // staging: two of ~0.7 × a
    let m = ResidencyManager::new(&d, c).unwrap();
    let ia = m.register_encoded(range(&a), Dtype::Bf16, &opts()).unwrap().id;
    let ib = m.register_encoded(range(&b), Dtype::Bf16, &opts()).unwrap().id;
    let staging = m.stats().decode_staging_bytes as usize;
    assert!(a.len() + staging <= c.budget_bytes && 2 * a.len() + staging > c.budget_bytes);
    let (s1, s2) = (Stream::new(&d).unwrap(), Stream::new(&d).unwrap());
    let slot = DeviceBuffer::new(&d, 16).unwrap();
    let pa = m.acquire(ia, s1.raw()).unwrap();
    let gate = Gate::new();
    let wd = gate.watchdog(std::time::Duration::from_secs(10));
    d.hold_async(s1.raw(), &gate).unwrap();
    d.checksum_async(pa, a.len(), slot.ptr(), s1.raw()).unwrap();
    m.release(ia, s1.raw()).unwrap();
    let pb = m.acquire(ib, s2.raw()).unwrap();
    assert!(!wd.fired(), "the host waited for A's held reader");
    d.checksum_async(pb, b.len(), slot.ptr() + 8, s2.raw()).unwrap();
    m.release(ib, s2.raw()).unwrap();
    gate.open();
    s1.synchronize().unwrap();
    let mut got = [0u64; 2];
    // SAFETY: `got` is exclusively owned, 16 bytes, read after the stream synchronizes.
    unsafe { d.memcpy_dtoh_async(got.as_mut_ptr().cast(), slot.ptr(), 16, s2.raw()).unwrap() };
    s2.synchronize().unwrap();
    assert_eq!(got[0], checksum_host(&a), "A was overwritten by B's decode under its reader");
    assert_eq!(got[1], checksum_host(&b), "B is not bit-exact");
    let st = m.stats();
    assert_eq!((st.evictions, st.ordered_reuses, st.eviction_waits, st.decodes), (1, 1, 0, 2), "{st:?}");
    assert_eq!(pa, pb, "B did not take A's block");
}

/// A copy or decode that fails while a compressed weight pages in (every
/// Nth enqueue, then every Nth event) is reported by `acquire` (the weight
/// is then not acquired) or absorbed by a prefetch; afterwards every weight
/// still reads back bit-exact and nothing is left acquired.
#[test]
fn failed_copies_and_decodes_are_reported_and_leave_the_weights_exact() {
    use epmem::device::fault::{FaultKind, FaultyDevice};
    let inner = dev();
    let fd = Arc::new(FaultyDevice::new(inner));
    let d: Arc<dyn Device> = fd.clone();
    let sizes = vec![30_000usize; 6];
    let mut reported = 0;
    for kind in [FaultKind::Copy, FaultKind::Event] {
        for nth in [1u64, 2, 3, 5, 8] {
            let mut c = cfg(0);
            c.coalesce_below_bytes = 0;
            c.budget_bytes = 2 * 30_000 * 3 + 4 * 2 * 30_000;
            let m = ResidencyManager::new(&d, c).unwrap();
            let x = mix(&m, &sizes, 70);
            m.declare_cycle(&x.ids).unwrap();
            let s = Stream::new(&d).unwrap();
            fd.fail_nth(kind, nth);
            let mut failed = 0;
            for _ in 0..2 {
                for &id in &x.ids {
                    match m.acquire(id, s.raw()) {
                        Ok(_) => {
                            // A release whose event fails is reported and
                            // leaves the weight acquired: release it again.
                            if let Err(e) = m.release(id, s.raw()) {
                                assert_eq!(e.status(), EpmStatus::CudaError, "{kind:?} #{nth}: {e}");
                                failed += 1;
                                m.release(id, s.raw()).unwrap();
                            }
                        }
                        Err(e) => {
                            assert_eq!(e.status(), EpmStatus::CudaError, "{kind:?} #{nth}: {e}");
                            failed += 1;
                        }
                    }
                }
            }
            fd.clear();
            s.synchronize().unwrap();
            assert!(failed <= 1, "{kind:?} #{nth}: {failed} acquires failed for one fault");
            reported += failed;
            run(&d, &m, &x, 2, &format!("after {kind:?} fault #{nth}"));
            drop(m);
        }
    }
    assert!(fd.injected() >= 10 && reported > 0, "{} faults injected, {reported} reported", fd.injected());
}

/// Three Llama-like blocks of one large weight and two small ones, all
/// compressed; the large ones alike and the small ones alike (same values),
/// so each kind has one compressed size.
struct Blocks {
    data: Vec<Vec<u8>>,
    ids: Vec<WeightId>,
    /// Compressed bytes of a large and of a small weight.
    coded: (usize, usize),
}

/// Values of a large and of a small weight: compressed (~0.7 × raw), a small
/// one is above the staging floor, a large one twice that.
const SMALL: usize = DECODE_STAGING_MIN_BYTES;
const LARGE: usize = 2 * SMALL;

fn blocks(m: &ResidencyManager) -> Blocks {
    let (large, small) = (weight(Dtype::Bf16, LARGE, 1), weight(Dtype::Bf16, SMALL, 2));
    let data: Vec<Vec<u8>> = (0..9).map(|i| if i % 3 == 0 { large.clone() } else { small.clone() }).collect();
    let mut ids = Vec::new();
    let mut coded = (0, 0);
    for (i, v) in data.iter().enumerate() {
        let r = m.register_encoded(range(v), Dtype::Bf16, &opts()).unwrap();
        assert_eq!(r.raw, None);
        if i % 3 == 0 {
            coded.0 = r.host_bytes
        } else {
            coded.1 = r.host_bytes
        }
        ids.push(r.id);
    }
    Blocks { data, ids, coded }
}

/// Under a declared cycle whose plan streams only small weights, the decode
/// staging is two of the largest compressed weight streamed (not of the
/// largest registered); the plan gets the budget that frees, so fewer bytes
/// stream per step than any plan could beside a staging of the largest
/// registered weight (the staging before the cycle is declared); the ledger
/// (resident + staging) stays within the budget. The large weights, planned
/// resident and larger than a staging buffer, page in in pieces, bit-exact,
/// at first fill and again after a re-plan evicted them; so does a compressed
/// weight outside the cycle.
#[test]
fn the_staging_holds_the_largest_streamed_weight_and_larger_ones_page_in_in_pieces() {
    let d = dev();
    let raw: Vec<usize> = (0..9).map(|i| 2 * if i % 3 == 0 { LARGE } else { SMALL }).collect();
    let mut c = cfg(0);
    c.coalesce_below_bytes = 0;
    // All large weights, a ring of one small and two small ones resident,
    // beside two buffers of a small weight's compressed bytes.
    c.budget_bytes = 3 * 2 * LARGE + 3 * 2 * SMALL + 2 * (2 * SMALL * 3 / 4);
    let m = ResidencyManager::new(&d, c).unwrap();
    let x = blocks(&m);
    let (cl, cs) = x.coded;
    let up = |n: usize| n.next_multiple_of(256);
    assert!(cs > DECODE_STAGING_MIN_BYTES && cl > up(cs), "compressed sizes {cl} and {cs}");
    // No plan yet: two of the largest compressed weight.
    assert_eq!(m.stats().decode_staging_bytes as usize, DECODE_STAGING_BUFFERS * up(cl));
    m.declare_cycle(&x.ids).unwrap();
    let st = m.stats();
    let (new, old) = (DECODE_STAGING_BUFFERS * up(cs), DECODE_STAGING_BUFFERS * up(cl));
    assert_eq!(st.decode_staging_bytes as usize, new, "staging not sized by the small streamed weights: {st:?}");
    assert!(st.ring_bytes > 0 && st.planned_resident_bytes > 0, "no plan: {st:?}");
    assert!(st.ring_bytes + st.planned_resident_bytes + st.decode_staging_bytes <= st.budget_bytes, "{st:?}");
    // What the plan streams: the whole-weight floor beside its staging, and
    // less than any schedule could beside the no-plan staging.
    let (floor_new, floor_old) =
        (whole_weight_floor(&raw, c.budget_bytes - new), whole_weight_floor(&raw, c.budget_bytes - old));
    assert!(
        floor_new < floor_old,
        "sizes chosen so the freed staging lets a small weight stay: {floor_new} {floor_old}"
    );
    // The large weights (planned resident) page in in pieces: each is
    // larger than a staging buffer.
    run(&d, &m, &x.as_mix(), 2, "first fill and warm-up");
    let warm = m.stats();
    let steps = 4;
    run(&d, &m, &x.as_mix(), steps, "steady state");
    m.synchronize().unwrap();
    let st = m.stats();
    let per_step = (st.decoded_bytes - warm.decoded_bytes) as usize / steps;
    assert!(per_step > 0, "nothing streamed: {st:?}");
    assert!(
        per_step <= floor_new + 256 * raw.len(),
        "{per_step} bytes per step > the whole-weight floor {floor_new} beside the staging of {new}: {st:?}"
    );
    assert!(
        per_step < floor_old,
        "{per_step} bytes per step, not below the floor {floor_old} beside the no-plan staging"
    );
    assert!(st.peak_resident_bytes + st.decode_staging_bytes <= st.budget_bytes, "ledger over budget: {st:?}");
    assert_eq!(st.decode_staging_bytes as usize, new);
    // A re-plan evicts everything: the large weights page in again, in pieces.
    let before = st.decodes;
    let mut rev = x.ids.clone();
    rev.reverse();
    m.declare_cycle(&rev).unwrap();
    assert!(x.ids.iter().all(|&w| !m.is_resident(w).unwrap()), "a re-plan kept weights resident");
    run(&d, &m, &x.as_mix(), 2, "after a re-plan");
    m.synchronize().unwrap();
    let st = m.stats();
    assert!(st.decodes >= before + 9, "{st:?}");
    assert_eq!(st.decode_staging_bytes as usize, new, "{st:?}");
    assert!(st.peak_resident_bytes + st.decode_staging_bytes <= st.budget_bytes, "ledger over budget: {st:?}");
    // A compressed weight outside the cycle, larger than a buffer, pages in
    // in pieces too, and registering it leaves the staging as it is.
    let extra = weight(Dtype::Bf16, LARGE + 77, 3);
    let r = m.register_encoded(range(&extra), Dtype::Bf16, &opts()).unwrap();
    assert!(r.host_bytes > up(cs), "{} compressed bytes fit a buffer of {}", r.host_bytes, up(cs));
    assert_eq!(m.stats().decode_staging_bytes as usize, new);
    let s = Stream::new(&d).unwrap();
    let p = m.acquire(r.id, s.raw()).unwrap();
    let back = read_back(&d, p, extra.len(), &s);
    m.release(r.id, s.raw()).unwrap();
    assert!(back == extra, "a weight paged in in pieces is not bit-exact");
}

impl Blocks {
    fn as_mix(&self) -> Mix {
        Mix { data: self.data.clone(), ids: self.ids.clone() }
    }
}

/// Copies a page-in of a weight stored in `frames` takes through staging
/// buffers of `cap` bytes when every frame fits one: consecutive frames
/// share a buffer (one copy) while their bytes fit.
fn frame_copies(frames: &[codec::Frame], cap: usize) -> usize {
    let (mut copies, mut start) = (0, None);
    for f in frames {
        assert!(f.len() <= cap, "a frame of {} bytes does not fit a buffer of {cap}", f.len());
        if start.is_none_or(|s| f.at + f.len() - s > cap) {
            copies += 1;
            start = Some(f.at);
        }
    }
    copies
}

/// A weight the manager encodes is stored in frames (`codec::FRAME_VALUES`
/// values each, a format-v1 buffer each); with a staging buffer that holds
/// it, a page-in is one copy of the compressed bytes and a decode per frame,
/// bit-exact, and its host copy is exactly its frames.
#[test]
fn a_weight_in_frames_pages_in_with_one_copy_when_a_buffer_holds_it() {
    let d = dev();
    let n = 5 * codec::FRAME_VALUES + 12_345;
    let data = weight(Dtype::Bf16, n, 21);
    let frames = codec::plan(&data, Dtype::Bf16, &opts()).unwrap().frames();
    assert_eq!(frames.len(), 6);
    let framed: usize = frames.iter().map(codec::Frame::len).sum();
    let m = ResidencyManager::new(&d, cfg(4 * data.len())).unwrap();
    let r = m.register_encoded(range(&data), Dtype::Bf16, &opts()).unwrap();
    assert_eq!(r.raw, None);
    assert_eq!(r.host_bytes, framed, "the host copy is not the frames end to end");
    let v1 = match codec::encode(&data, Dtype::Bf16, &opts()).unwrap() {
        Encoded::Coded(b) => b.len(),
        Encoded::Raw(why) => panic!("{why}"),
    };
    // Six headers and their streams' padding: well under 0.1% over one buffer.
    assert!(framed > v1 && (framed - v1) * 1000 < v1, "{framed} bytes in frames, {v1} as one buffer");
    let cap = m.stats().decode_staging_bytes as usize / DECODE_STAGING_BUFFERS;
    assert!(cap >= framed, "staging {cap} does not hold the weight's {framed} bytes");
    let before = m.stats();
    let s = Stream::new(&d).unwrap();
    let p = m.acquire(r.id, s.raw()).unwrap();
    let back = read_back(&d, p, data.len(), &s);
    m.release(r.id, s.raw()).unwrap();
    m.synchronize().unwrap();
    let st = m.stats();
    assert!(back == data, "a weight in frames is not bit-exact");
    assert_eq!((st.decodes - before.decodes, st.bypassed_page_ins - before.bypassed_page_ins), (1, 1), "{st:?}");
    assert_eq!((st.compressed_htod_bytes - before.compressed_htod_bytes) as usize, framed);
}

/// A buffer the caller encoded as one format-v1 buffer of several frames is
/// stored in frames (its streams sliced), exactly the bytes the manager's
/// own encoding gives, and pages in as one copy when a buffer holds it.
#[test]
fn a_pre_encoded_buffer_of_several_frames_is_stored_in_frames() {
    let d = dev();
    let n = 3 * codec::FRAME_VALUES + 999;
    let data = weight(Dtype::Bf16, n, 41);
    let v1 = match codec::encode(&data, Dtype::Bf16, &opts()).unwrap() {
        Encoded::Coded(b) => b,
        Encoded::Raw(why) => panic!("{why}"),
    };
    let framed = codec::plan(&data, Dtype::Bf16, &opts()).unwrap().framed_len().unwrap();
    let m = ResidencyManager::new(&d, cfg(4 * data.len())).unwrap();
    let id = m.register_compressed(&v1).unwrap();
    let st = m.stats();
    assert_eq!(st.compressed_host_bytes as usize, framed, "not stored in frames: {st:?}");
    let s = Stream::new(&d).unwrap();
    let p = m.acquire(id, s.raw()).unwrap();
    let back = read_back(&d, p, data.len(), &s);
    m.release(id, s.raw()).unwrap();
    m.synchronize().unwrap();
    assert!(back == data, "a reframed weight is not bit-exact");
    let after = m.stats();
    assert_eq!((after.decodes - st.decodes, after.bypassed_page_ins - st.bypassed_page_ins), (1, 1), "{after:?}");
}

/// Under a plan whose streamed weights are smaller than a resident one, the
/// staging holds a few frames: the resident weight's first page-in copies
/// runs of whole frames, one copy per buffer (not four per piece), and
/// stays bit-exact through first fill, steady state and a re-plan.
#[test]
fn frames_page_in_in_runs_through_a_staging_smaller_than_the_weight() {
    let d = dev();
    let fv = codec::FRAME_VALUES;
    let (wn, sn) = (5 * fv + 12_345, 5 * fv / 2);
    let (big, small) = (weight(Dtype::Bf16, wn, 31), weight(Dtype::Bf16, sn, 32));
    let data: Vec<&Vec<u8>> = (0..6).map(|i| if i % 3 == 0 { &big } else { &small }).collect();
    let big_frames = codec::plan(&big, Dtype::Bf16, &opts()).unwrap().frames();
    let small_framed = codec::plan(&small, Dtype::Bf16, &opts()).unwrap().framed_len().unwrap();
    // Room for both large weights, one small resident and a ring of one
    // small beside staging for the large ones (the plan made first), so the
    // small ones stream and the staging then shrinks to two of a small one's
    // compressed bytes.
    let big_framed: usize = big_frames.iter().map(codec::Frame::len).sum();
    let budget = 2 * big.len() + 2 * small.len() + 2 * big_framed + (1 << 20);
    let mut c = cfg(budget);
    c.coalesce_below_bytes = 0;
    // Whole weights: the copy oracle below is for whole page-ins.
    c.split_weights = false;
    let m = ResidencyManager::new(&d, c).unwrap();
    let ids = register_coded(&m, &data);
    m.declare_cycle(&ids).unwrap();
    let st = m.stats();
    let cap = st.decode_staging_bytes as usize / DECODE_STAGING_BUFFERS;
    assert_eq!(cap, small_framed.next_multiple_of(256), "staging not sized by the streamed small weights: {st:?}");
    assert!(st.ring_bytes > 0, "no plan: {st:?}");
    assert!(cap < big_framed && cap >= 2 * big_frames[0].len(), "staging {cap}: not the runs this test is for");
    let k = frame_copies(&big_frames, cap);
    assert!(k >= 2 && k < big_frames.len(), "{k} copies for {} frames", big_frames.len());
    let s = Stream::new(&d).unwrap();
    let step = |what: &str| read_all(&m, &d, &s, &ids, &data, what);
    let before = m.stats();
    step("first fill");
    m.synchronize().unwrap();
    let st = m.stats();
    let page_ins = (st.decodes - before.decodes) as usize;
    let copies = (st.bypassed_page_ins - before.bypassed_page_ins) as usize;
    // Both large weights paged in once, every other page-in a small
    // weight's. A run stages at most `cap` bytes of whole frames, so a large
    // weight takes at least k copies and a small one 1; where the staging
    // circle has less free it stages whole frames in at least half of `cap`
    // (or the rest of the weight), which bounds the copies from above.
    let small_frames = codec::plan(&small, Dtype::Bf16, &opts()).unwrap().frames();
    let most = |frames: &[codec::Frame]| {
        let (lo, hi) = frames.iter().map(codec::Frame::len).fold((usize::MAX, 0), |(a, b), l| (a.min(l), b.max(l)));
        let total: usize = frames.iter().map(codec::Frame::len).sum();
        total.div_ceil(lo.max((cap / 2).saturating_sub(hi))) + 1
    };
    assert!(page_ins >= 2, "{st:?}");
    let (lo, hi) = (2 * k + (page_ins - 2), 2 * most(&big_frames) + (page_ins - 2) * most(&small_frames));
    assert!(
        (lo..=hi).contains(&copies),
        "first fill: {copies} copies for {page_ins} page-ins, not in {lo}..={hi}: {st:?}"
    );
    for _ in 0..3 {
        step("steady state");
    }
    let mut rev = ids.clone();
    rev.reverse();
    m.declare_cycle(&rev).unwrap();
    step("after a re-plan");
    m.synchronize().unwrap();
    let st = m.stats();
    assert!(st.peak_resident_bytes + st.decode_staging_bytes <= st.budget_bytes, "ledger over budget: {st:?}");
}

/// Acquired around each weight, compressed weights split too: each keeps
/// whole frames resident (its head) and streams its last frames, decoded
/// into ring bytes mapped behind the weight's own address after its head.
/// Every acquire reads the whole weight back bit-exact at that address;
/// a step decodes fewer bytes than any schedule of whole weights can under
/// the same budget (the whole-weight floor); the ledger stays within it.
#[test]
fn compressed_weights_split_stream_their_tail_frames_bit_exact() {
    let d = dev();
    let fv = codec::FRAME_VALUES;
    let data: Vec<Vec<u8>> = (0..8).map(|i| weight(Dtype::Bf16, 4 * fv, 40 + i)).collect();
    let sizes: Vec<usize> = data.iter().map(Vec::len).collect();
    let total: usize = sizes.iter().sum();
    let budget = total * 7 / 8;
    let mut c = cfg(budget);
    c.coalesce_below_bytes = 0;
    let m = ResidencyManager::new(&d, c).unwrap();
    let ids = register_coded(&m, &data);
    m.declare_cycle(&ids).unwrap();
    let s = Stream::new(&d).unwrap();
    let step = |what: &str| read_all(&m, &d, &s, &ids, &data, what);
    step("first fill");
    step("warm");
    m.synchronize().unwrap();
    let a = m.stats();
    for _ in 0..2 {
        step("steady state");
    }
    m.synchronize().unwrap();
    let b = m.stats();
    assert!(b.ring_bytes > 0 && b.plans == a.plans, "no plan, or a re-plan in steady state: {b:?}");
    assert!(b.split_weights > 0 && b.split_head_bytes > 0, "the plan splits no weight: {b:?}");
    // Heads end on frames.
    assert_eq!(b.split_head_bytes as usize % (2 * fv), 0, "{b:?}");
    // Compressed tails are copied into the decode staging: the ring holds
    // one tail, not the two a raw split plan needs.
    let tail = sizes[0] - (b.split_head_bytes / b.split_weights) as usize;
    assert!(
        b.ring_bytes as usize >= tail && (b.ring_bytes as usize) < 2 * tail,
        "ring of more than one tail ({tail}): {b:?}"
    );
    let decoded = (b.decoded_bytes - a.decoded_bytes) as usize / 2;
    let room = budget - b.decode_staging_bytes as usize;
    let floor = whole_weight_floor(&sizes, room);
    assert!(decoded > 0 && decoded < floor, "decoded {decoded} bytes a step; the whole-weight floor is {floor}: {b:?}");
    // Only tails stream: each streamed page-in decodes less than a weight.
    let page_ins = (b.page_ins - a.page_ins) as usize / 2;
    assert!(page_ins > 0 && decoded < page_ins * sizes[0], "{page_ins} page-ins decoded {decoded} bytes: {b:?}");
    assert!(b.peak_resident_bytes + b.decode_staging_bytes <= b.budget_bytes, "ledger over budget: {b:?}");
    assert_eq!(b.eviction_waits - a.eviction_waits, 0, "{b:?}");
    // Every tail shares the one slot, so each page-in overwrites the tail
    // just released. Its copy goes into the staging, not the slot: the
    // release's prefetch issues it (only the decode waits for the read on
    // the device), never the next acquire.
    assert_eq!(b.prefetch_page_ins - a.prefetch_page_ins, b.page_ins - a.page_ins, "demand page-ins: {b:?}");
    assert_eq!(b.wasted_prefetches, a.wasted_prefetches, "{b:?}");
}

/// A steady-state decode step creates no events: every page-in's fences
/// (its copy's, its decode's) come from a pool that earlier page-ins gave
/// back, so no cuEventCreate/cuEventDestroy runs on the caller's thread per
/// streamed weight. Checked for a compressed split plan (every tail streamed
/// through the decode staging) and for a mix of raw and compressed weights
/// of uneven sizes (a ring plan, raw copies beside decodes) and for raw
/// weights from pageable sources (copies staged in chunks); each step
/// synchronizes, as a decode loop does at every token. The split plan's
/// page-ins also stay within six stream waits each.
#[test]
fn steady_state_page_ins_create_no_events() {
    use epmem::device::fault::FaultyDevice;
    let fd = Arc::new(FaultyDevice::new(dev()));
    let d: Arc<dyn Device> = fd.clone();
    let fv = codec::FRAME_VALUES;
    let split: Vec<Vec<u8>> = (0..8).map(|i| weight(Dtype::Bf16, 4 * fv, 60 + i)).collect();
    let uneven: Vec<usize> = (0..10).map(|i| 30_000 + 17_000 * (i % 4) + 14 * i).collect();
    let staged: Vec<usize> = (0..8).map(|i| (1 << 20) + 333_000 * (i % 3)).collect();
    for case in ["compressed split plan", "raw and compressed mix", "raw staged sources"] {
        let (m, x) = if case == "raw staged sources" {
            // Pageable sources never registered: each page-in is staged in
            // chunks, each chunk's copy fenced by an event.
            let total: usize = staged.iter().map(|n| 2 * n).sum();
            let mut c = cfg(total * 3 / 4);
            c.coalesce_below_bytes = 0;
            c.register_sources = RegisterSources::Never;
            let m = ResidencyManager::new(&d, c).unwrap();
            let data: Vec<Vec<u8>> =
                staged.iter().enumerate().map(|(i, &n)| weight(Dtype::Bf16, n, 80 + i as u64)).collect();
            let ids = data.iter().map(|v| m.register(range(v)).unwrap()).collect();
            (m, Mix { data, ids })
        } else if case == "compressed split plan" {
            let total: usize = split.iter().map(Vec::len).sum();
            let mut c = cfg(total * 7 / 8);
            c.coalesce_below_bytes = 0;
            let m = ResidencyManager::new(&d, c).unwrap();
            let ids = register_coded(&m, &split);
            (m, Mix { data: split.clone(), ids })
        } else {
            let total: usize = uneven.iter().map(|n| 2 * n).sum();
            let mut c = cfg(total / 2 + 4 * uneven.iter().max().unwrap());
            c.coalesce_below_bytes = 0;
            let m = ResidencyManager::new(&d, c).unwrap();
            let x = mix(&m, &uneven, 200);
            (m, x)
        };
        m.declare_cycle(&x.ids).unwrap();
        // Warm: the plan installed, and the pools as deep as the pipeline
        // (copy timings are read back in batches of 32 copies).
        run(&d, &m, &x, 16, case);
        let (calls, a) = (fd.ordering_calls(), m.stats());
        run(&d, &m, &x, 4, case);
        let (after, b) = (fd.ordering_calls(), m.stats());
        let page_ins = b.page_ins - a.page_ins;
        let decoded = b.decodes > a.decodes || case == "raw staged sources";
        let staged_ok = b.staged_page_ins > a.staged_page_ins || case != "raw staged sources";
        assert!(page_ins >= 4 && decoded && staged_ok, "{case}: not streamed as meant in steady state: {b:?}");
        assert_eq!(
            after.event_create - calls.event_create,
            0,
            "{case}: {page_ins} page-ins created events ({calls:?} before, {after:?} after)"
        );
        assert!(
            after.event_record > calls.event_record && after.stream_wait_event > calls.stream_wait_event,
            "{case}: the counter saw no fences: {after:?}"
        );
        // Each tail's page-in orders with at most six stream waits: the
        // acquiring stream's on the page-in, the order stream's on the slot's
        // last page-in and last read, the copy's on the staging bytes' last decode,
        // the decode's on the copy and on the order stream.
        if case == "compressed split plan" {
            let waits = after.stream_wait_event - calls.stream_wait_event;
            assert!(waits <= 6 * page_ins, "{case}: {waits} stream waits for {page_ins} page-ins");
        }
    }
}
