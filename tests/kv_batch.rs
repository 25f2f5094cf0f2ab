//! Batch reservations on whatever device EPM_DEVICE names (host in
//! CI, CUDA on the H200): slots at a fixed stride behind one base pointer,
//! each an ordinary sequence — own granules, a shared prefix charged once,
//! copy-on-write, the dummy tail — and slots joining and leaving while the
//! others keep their addresses and bytes.

mod kv_util;

use std::sync::Arc;

use epmem::EpmStatus;
use epmem::device::{Device, DeviceKind, Stream};
use epmem::kv::{AdmitMode, KvConfig, KvPool, SeqId, SlotChoice};
use kv_util::*;

const GIB: u64 = 1 << 30;

/// Physical device bytes in use as the device itself reports them: the
/// driver's free-memory figure on CUDA, the live physical handles on the
/// host device (whose mem_get_info is the machine's RAM).
fn device_used(d: &Arc<dyn Device>) -> i64 {
    match d.info().kind {
        DeviceKind::Cuda => {
            let (free, total) = d.mem_get_info().unwrap();
            (total - free) as i64
        }
        DeviceKind::Host => d.live_counts().physical_bytes as i64,
    }
}

/// The driver's free memory moves in its own units on CUDA (page tables,
/// allocator rounding); the host device counts exact bytes.
fn slack(d: &Arc<dyn Device>) -> i64 {
    match d.info().kind {
        DeviceKind::Cuda => 2 * d.vmm_granularity() as i64,
        DeviceKind::Host => 0,
    }
}

#[test]
fn slots_sit_at_a_fixed_stride_and_the_whole_range_reads_zeros() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(GIB)).unwrap();
    let g = a.granule() as u64;
    let l = qwen14b();
    let owned = a.stats().ledger.owned_bytes;
    let b = a.create_batch(&l, 40, 6).unwrap();
    let bi = a.batch_info(b).unwrap();
    assert_eq!(bi.slot_stride, (40 * 196_608u64).div_ceil(g) * g);
    assert_eq!((bi.max_slots, bi.max_tokens, bi.live_slots), (6, 40, 0));
    assert_eq!(bi.reserved_bytes, 6 * bi.slot_stride);
    assert_eq!(bi.base % g, 0, "the base is granule-aligned");
    assert_eq!(a.stats().ledger.owned_bytes, owned, "a batch charges nothing: the dummy is the pool's");
    // Every byte of the range is mapped and reads the zeroed dummy.
    assert!(read(&d, &s, bi.base, bi.reserved_bytes as usize).iter().all(|&x| x == 0));
    let q3 = a.take_slot(b, SlotChoice::Index(3), AdmitMode::OnDemand).unwrap();
    let q0 = a.take_slot(b, SlotChoice::Any, AdmitMode::OnDemand).unwrap();
    let q1 = a.take_slot(b, SlotChoice::Any, AdmitMode::OnDemand).unwrap();
    for (q, idx) in [(q3, 3u32), (q0, 0), (q1, 1)] {
        let si = a.slot_info(q).unwrap();
        assert_eq!((si.batch, si.index), (b, idx));
        assert_eq!(si.seq.base, bi.base + idx as u64 * bi.slot_stride);
        assert_eq!(si.seq.reserved_bytes, bi.slot_stride);
        assert_eq!((si.seq.len_tokens, si.committed_tokens), (0, 0));
        assert_eq!(a.slot_sequence(b, idx).unwrap(), Some(q));
    }
    assert_eq!(a.batch_info(b).unwrap().live_slots, 3);
    assert_eq!(a.slot_sequence(b, 2).unwrap(), None);
    // committed_tokens: one granule holds 10 whole qwen14b tokens.
    a.prepare_append(q0, 1, s.raw()).unwrap();
    let si = a.slot_info(q0).unwrap();
    assert_eq!((si.seq.len_tokens, si.committed_tokens), (1, g / 196_608));
    for q in [q0, q1, q3] {
        a.release_slot(q, s.raw()).unwrap();
    }
    a.destroy_batch(b).unwrap();
    assert_eq!(a.stats().ledger.owned_bytes, owned);
}

#[test]
fn slots_read_and_write_only_their_own_granules() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(GIB)).unwrap();
    let g = a.granule() as u64;
    let l = qwen14b();
    let bpt = l.bytes_per_token();
    let b = a.create_batch(&l, 64, 5).unwrap();
    let bi = a.batch_info(b).unwrap();
    let lens = [7u64, 64, 0, 23, 11];
    let mut slots = Vec::new();
    for (i, &n) in lens.iter().enumerate() {
        if n == 0 {
            continue; // slot 2 stays free
        }
        let q = a.take_slot(b, SlotChoice::Index(i as u32), AdmitMode::OnDemand).unwrap();
        a.prepare_append(q, n, s.raw()).unwrap();
        let bytes = pattern(i as u8 + 10, (n * bpt) as usize);
        write(&d, &s, a.sequence_info(q).unwrap().base, &bytes).unwrap();
        slots.push((i, q, bytes));
    }
    let per = |n: u64| (n * bpt).div_ceil(g);
    assert_eq!(
        a.stats().ledger.owned_bytes,
        g + g * (per(7) + per(64) + per(23) + per(11)),
        "the dummy + each slot's own granules"
    );
    // Each slot reads its own bytes; its tail past the committed granules
    // reads zeros (the dummy); the free slot is all zeros.
    for (i, q, bytes) in &slots {
        let base = bi.base + *i as u64 * bi.slot_stride;
        assert_eq!(read(&d, &s, base, bytes.len()), *bytes, "slot {i}");
        let committed = (bytes.len() as u64).div_ceil(g) * g;
        let tail = read(&d, &s, base + committed, (bi.slot_stride - committed) as usize);
        assert!(tail.iter().all(|&x| x == 0), "slot {i}'s uncommitted tail is the dummy");
        assert_eq!(a.sequence_info(*q).unwrap().private_granules, committed / g);
    }
    assert!(read(&d, &s, bi.base + 2 * bi.slot_stride, bi.slot_stride as usize).iter().all(|&x| x == 0));
    // The dummy is read-only: a stray write past a slot's granules, or into
    // the free slot, is refused and changes nothing.
    let junk = vec![0xA5u8; 4096];
    let (i0, q0, _) = &slots[0];
    let past = bi.base + *i0 as u64 * bi.slot_stride + a.sequence_info(*q0).unwrap().private_granules * g;
    assert!(write(&d, &s, past, &junk).is_err());
    assert!(write(&d, &s, bi.base + 2 * bi.slot_stride, &junk).is_err());
    assert!(read(&d, &s, bi.base + 2 * bi.slot_stride, bi.slot_stride as usize).iter().all(|&x| x == 0));
    // Overwriting one slot's tokens leaves every other slot's bytes intact.
    let (i3, q3, _) = &slots[2];
    assert_eq!(*i3, 3);
    let other = pattern(99, (23 * bpt) as usize);
    write(&d, &s, a.sequence_info(*q3).unwrap().base, &other).unwrap();
    for (i, _, bytes) in &slots {
        let want = if *i == 3 { &other } else { bytes };
        assert_eq!(&read(&d, &s, bi.base + *i as u64 * bi.slot_stride, want.len()), want, "slot {i}");
    }
}

#[test]
fn a_prefix_shared_across_slots_is_one_physical_copy() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(4 * GIB)).unwrap();
    let g = a.granule() as u64;
    let l = qwen14b();
    let bpt = l.bytes_per_token();
    let b = a.create_batch(&l, 128, 9).unwrap();
    let bi = a.batch_info(b).unwrap();
    // The prompt is prefilled in slot 0 and pinned: 50 tokens, 5 granules.
    let origin = a.take_slot(b, SlotChoice::Index(0), AdmitMode::OnDemand).unwrap();
    let owned0 = a.stats().ledger.owned_bytes;
    let used0 = device_used(&d);
    a.prepare_append(origin, 50, s.raw()).unwrap();
    let prompt = pattern(1, (50 * bpt) as usize);
    write(&d, &s, bi.base, &prompt).unwrap();
    let k = (50 * bpt).div_ceil(g);
    let owned1 = a.stats().ledger.owned_bytes;
    let used1 = device_used(&d);
    assert_eq!(owned1 - owned0, k * g);
    assert!(
        ((used1 - used0) - (k * g) as i64).abs() <= slack(&d),
        "the device's figure moved {} for {} owned",
        used1 - used0,
        k * g
    );
    let p = a.pin_prefix(origin, 50, s.raw()).unwrap();
    let phys = d.live_counts().physical_handles;
    let sharers: Vec<SeqId> =
        (1..9).map(|_| a.take_shared_slot(b, SlotChoice::Any, p, 50, AdmitMode::OnDemand, s.raw()).unwrap()).collect();
    // Eight more slots map the prompt: the ledger and the device both see nothing new.
    assert_eq!(a.stats().ledger.owned_bytes, owned1, "the Nth sharer costs 0 owned bytes");
    assert_eq!(d.live_counts().physical_handles, phys, "and no physical handle");
    assert!((device_used(&d) - used1).abs() <= slack(&d), "device memory moved {}", device_used(&d) - used1);
    assert_eq!(a.stats().mapped_bytes, 9 * k * g, "what nine private copies would own");
    for (j, &q) in sharers.iter().enumerate() {
        let si = a.slot_info(q).unwrap();
        assert_eq!(si.index, j as u32 + 1);
        assert_eq!((si.seq.len_tokens, si.seq.shared_granules, si.seq.private_granules), (50, k, 0));
        assert_eq!(si.committed_tokens, (k * g / bpt).min(128));
        assert_eq!(read(&d, &s, si.seq.base, prompt.len()), prompt, "slot {}", si.index);
    }
    // The shared bytes are read-only in every slot.
    assert!(write(&d, &s, a.sequence_info(sharers[3]).unwrap().base, &[7u8; 256]).is_err());
    // Content-hash variant: a slot declaring the same prompt tokens finds it.
    let toks: Vec<u32> = (0..50).collect();
    a.declare_tokens(origin, &toks).unwrap();
    let p2 = a.pin_prefix(origin, 48, s.raw()).unwrap();
    a.release_slot(sharers[7], s.raw()).unwrap();
    let (q, shared) = a.take_slot_for_tokens(b, SlotChoice::Any, &toks, AdmitMode::OnDemand, s.raw()).unwrap();
    assert_eq!(shared, 48, "three whole 16-token blocks");
    assert_eq!(a.slot_info(q).unwrap().index, 8);
    assert_eq!(a.stats().ledger.owned_bytes, owned1);
    assert_eq!(read(&d, &s, a.sequence_info(q).unwrap().base, (48 * bpt) as usize), prompt[..(48 * bpt) as usize]);
    a.unpin_prefix(p2).unwrap();
    a.unpin_prefix(p).unwrap();
}

#[test]
fn copy_on_write_in_one_slot_leaves_the_others_intact() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(4 * GIB)).unwrap();
    let g = a.granule() as u64;
    let l = qwen14b();
    let bpt = l.bytes_per_token();
    let b = a.create_batch(&l, 64, 4).unwrap();
    // 16 tokens end inside granule 1: the boundary granule is shared.
    let o = a.take_slot(b, SlotChoice::Any, AdmitMode::OnDemand).unwrap();
    a.prepare_append(o, 16, s.raw()).unwrap();
    let prompt = pattern(4, (16 * bpt) as usize);
    write(&d, &s, a.sequence_info(o).unwrap().base, &prompt).unwrap();
    let p = a.pin_prefix(o, 16, s.raw()).unwrap();
    let q1 = a.take_shared_slot(b, SlotChoice::Any, p, 16, AdmitMode::OnDemand, s.raw()).unwrap();
    let q2 = a.take_shared_slot(b, SlotChoice::Any, p, 16, AdmitMode::OnDemand, s.raw()).unwrap();
    let owned = a.stats().ledger.owned_bytes;
    let base2 = a.sequence_info(q2).unwrap().base;
    let boundary = read(&d, &s, base2 + g, g as usize);
    a.prepare_append(q1, 3, s.raw()).unwrap();
    assert_eq!(a.stats().counters.cow_granules, 1);
    assert_eq!(a.stats().ledger.owned_bytes, owned + g, "one private copy of the boundary");
    let i1 = a.sequence_info(q1).unwrap();
    assert_eq!((i1.shared_granules, i1.private_granules), (1, 1));
    let mine = pattern(8, (3 * bpt) as usize);
    write(&d, &s, i1.base + 16 * bpt, &mine).unwrap();
    assert_eq!(read(&d, &s, i1.base, prompt.len()), prompt, "the copy holds the prefix");
    assert_eq!(read(&d, &s, i1.base + 16 * bpt, mine.len()), mine);
    for other in [o, q2] {
        let base = a.sequence_info(other).unwrap().base;
        assert_eq!(read(&d, &s, base, prompt.len()), prompt);
        assert_eq!(read(&d, &s, base + g, g as usize), boundary, "the shared boundary is untouched");
    }
}

#[test]
fn a_released_slots_granules_return_to_the_pool() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(GIB)).unwrap();
    let g = a.granule() as u64;
    let l = qwen14b();
    let b = a.create_batch(&l, 64, 3).unwrap();
    let bi = a.batch_info(b).unwrap();
    let owned = a.stats().ledger.owned_bytes;
    let q = a.take_slot(b, SlotChoice::Index(1), AdmitMode::Promise).unwrap();
    assert_eq!(a.stats().ledger.promised_bytes, 6 * g, "64 tokens: 6 granules promised");
    a.prepare_append(q, 64, s.raw()).unwrap();
    write(&d, &s, bi.base + bi.slot_stride, &pattern(2, (64 * l.bytes_per_token()) as usize)).unwrap();
    assert_eq!(a.stats().ledger.owned_bytes, owned + 6 * g);
    let created = a.stats().pool.created;
    a.release_slot(q, s.raw()).unwrap();
    let st = a.stats();
    assert_eq!((st.ledger.owned_bytes, st.ledger.promised_bytes), (owned, 0), "credited on release");
    assert_eq!(st.pool.retained, 6, "the granules are retained for reuse");
    assert_eq!(st.sequences, 0);
    // The slot reads zeros again (the dummy, not the old bytes) and is read-only.
    assert!(read(&d, &s, bi.base + bi.slot_stride, bi.slot_stride as usize).iter().all(|&x| x == 0));
    assert!(write(&d, &s, bi.base + bi.slot_stride, &[1u8; 64]).is_err());
    assert_eq!(a.sequence_info(q).unwrap_err().status(), EpmStatus::InvalidHandle);
    // A new slot reuses those granules before any new handle is created.
    let q2 = a.take_slot(b, SlotChoice::Index(2), AdmitMode::OnDemand).unwrap();
    a.prepare_append(q2, 64, s.raw()).unwrap();
    assert_eq!(a.stats().pool.created, created);
    assert_eq!(a.stats().pool.reused, 6);
    // destroy_sequence on a slot is a release too (caller-fenced, like cuMemFree).
    a.destroy_sequence(q2).unwrap();
    assert_eq!(a.batch_info(b).unwrap().live_slots, 0);
    let live = d.live_counts();
    a.destroy_batch(b).unwrap();
    let after = d.live_counts();
    assert_eq!(after.va_reservations + 1, live.va_reservations, "the batch's VA is freed");
    assert_eq!(live.mappings - after.mappings, bi.reserved_bytes / g, "every dummy mapping is unmapped");
}

#[test]
fn slots_join_and_leave_while_the_others_keep_their_addresses_and_bytes() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(4 * GIB)).unwrap();
    let l = qwen14b();
    let bpt = l.bytes_per_token();
    let b = a.create_batch(&l, 48, 8).unwrap();
    let bi = a.batch_info(b).unwrap();
    let mut rng = Rng::with_seed(0x5eed_0014);
    // (slot index, sequence, bytes written so far)
    let mut live: Vec<(u32, SeqId, Vec<u8>)> = Vec::new();
    let mut seed = 20u8;
    for step in 0..80 {
        let r = below(&mut rng, 10);
        if (r < 4 || live.is_empty()) && live.len() < 8 {
            let q = a.take_slot(b, SlotChoice::Any, AdmitMode::OnDemand).unwrap();
            live.push((a.slot_info(q).unwrap().index, q, Vec::new()));
        } else if r < 6 {
            let (_, q, _) = live.swap_remove(below(&mut rng, live.len() as u64) as usize);
            a.release_slot(q, s.raw()).unwrap();
        } else {
            let k = below(&mut rng, live.len() as u64) as usize;
            let (_, q, bytes) = &mut live[k];
            let len = a.sequence_info(*q).unwrap().len_tokens;
            let n = below(&mut rng, 8).min(48 - len);
            a.prepare_append(*q, n, s.raw()).unwrap();
            seed = seed.wrapping_add(1);
            let more = pattern(seed, (n * bpt) as usize);
            write(&d, &s, a.sequence_info(*q).unwrap().base + len * bpt, &more).unwrap();
            bytes.extend(more);
        }
        // Every live slot is where its index says and holds what it was given;
        // every free slot reads zeros.
        for (idx, q, bytes) in &live {
            let base = a.sequence_info(*q).unwrap().base;
            assert_eq!(base, bi.base + *idx as u64 * bi.slot_stride, "step {step}");
            assert_eq!(&read(&d, &s, base, bytes.len()), bytes, "step {step}: slot {idx}");
        }
        // (The head of each granule: reading every byte of every free slot
        // at every step is minutes on a 2-core CI host.)
        let g = a.granule() as u64;
        for idx in 0..8u32 {
            if a.slot_sequence(b, idx).unwrap().is_none() {
                for k in 0..bi.slot_stride / g {
                    let z = read(&d, &s, bi.base + idx as u64 * bi.slot_stride + k * g, 4096);
                    assert!(z.iter().all(|&x| x == 0), "step {step}: free slot {idx}, granule {k}");
                }
            }
        }
        assert_eq!(a.batch_info(b).unwrap().live_slots as usize, live.len());
    }
    for (_, q, _) in live {
        a.release_slot(q, s.raw()).unwrap();
    }
    a.destroy_batch(b).unwrap();
    let st = a.stats();
    assert_eq!(st.ledger.owned_bytes, a.granule() as u64, "back to the dummy alone");
    assert_eq!(st.ledger.charges - st.ledger.credits, 1);
}

#[test]
fn misuse_is_a_status_with_a_message() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(GIB)).unwrap();
    let l = qwen14b();
    fn st<T: std::fmt::Debug>(r: epmem::Result<T>) -> EpmStatus {
        let e = r.unwrap_err();
        assert!(!e.message().is_empty());
        e.status()
    }
    assert_eq!(st(a.create_batch(&l, 0, 4)), EpmStatus::InvalidArgument);
    assert_eq!(st(a.create_batch(&l, 8, 0)), EpmStatus::InvalidArgument);
    assert_eq!(st(a.create_batch(&l, u64::MAX / 4, 4)), EpmStatus::InvalidArgument);
    assert_eq!(st(a.create_batch(&l, 1 << 20, u32::MAX - 1)), EpmStatus::InvalidArgument, "VA overflow");
    let b = a.create_batch(&l, 16, 2).unwrap();
    assert_eq!(st(a.take_slot(b, SlotChoice::Index(2), AdmitMode::OnDemand)), EpmStatus::InvalidArgument);
    let q0 = a.take_slot(b, SlotChoice::Index(0), AdmitMode::OnDemand).unwrap();
    assert_eq!(st(a.take_slot(b, SlotChoice::Index(0), AdmitMode::OnDemand)), EpmStatus::InvalidState);
    let q1 = a.take_slot(b, SlotChoice::Any, AdmitMode::OnDemand).unwrap();
    let e = a.take_slot(b, SlotChoice::Any, AdmitMode::OnDemand).unwrap_err();
    assert_eq!(e.status(), EpmStatus::AllInUse);
    assert!(e.message().contains("all 2 slots"), "{e}");
    // Append past max_tokens: refused, nothing changed.
    a.prepare_append(q0, 10, s.raw()).unwrap();
    assert_eq!(a.prepare_append(q0, 7, s.raw()).unwrap_err().status(), EpmStatus::InvalidArgument);
    assert_eq!(a.sequence_info(q0).unwrap().len_tokens, 10);
    // Destroying a batch with live slots is refused and leaves it whole.
    let e = a.destroy_batch(b).unwrap_err();
    assert_eq!(e.status(), EpmStatus::InvalidState);
    assert!(e.message().contains("2 taken slot"), "{e}");
    assert_eq!(a.slot_info(q0).unwrap().index, 0);
    // A plain sequence is not a slot.
    let plain = a.create_sequence(&l, 16, AdmitMode::OnDemand).unwrap();
    assert_eq!(a.release_slot(plain, s.raw()).unwrap_err().status(), EpmStatus::InvalidArgument);
    assert_eq!(a.slot_info(plain).unwrap_err().status(), EpmStatus::InvalidArgument);
    // A prefix of another layout cannot be shared into the batch.
    let small =
        epmem::kv::KvLayout::token_major(epmem::kv::KvShape { layers: 2, kv_heads: 2, head_dim: 64, elem_bytes: 2 })
            .unwrap();
    let other = a.create_sequence(&small, 16, AdmitMode::OnDemand).unwrap();
    a.prepare_append(other, 4, s.raw()).unwrap();
    let p = a.pin_prefix(other, 4, s.raw()).unwrap();
    a.release_slot(q1, s.raw()).unwrap();
    assert_eq!(
        st(a.take_shared_slot(b, SlotChoice::Any, p, 4, AdmitMode::OnDemand, s.raw())),
        EpmStatus::InvalidArgument
    );
    // A prefix longer than the batch's max_tokens.
    let long = a.create_sequence(&l, 64, AdmitMode::OnDemand).unwrap();
    a.prepare_append(long, 20, s.raw()).unwrap();
    let lp = a.pin_prefix(long, 20, s.raw()).unwrap();
    assert_eq!(
        st(a.take_shared_slot(b, SlotChoice::Any, lp, 20, AdmitMode::OnDemand, s.raw())),
        EpmStatus::InvalidArgument
    );
    assert_eq!(a.batch_info(b).unwrap().live_slots, 1, "failed takes leave the slot free");
    assert!(
        read(&d, &s, a.batch_info(b).unwrap().base + a.batch_info(b).unwrap().slot_stride, 4096)
            .iter()
            .all(|&x| x == 0)
    );
    // Admission: a RESERVE slot the ledger cannot hold is refused.
    let mut tight = KvPool::new(&d, KvConfig::new(3 * a.granule() as u64)).unwrap();
    let tb = tight.create_batch(&l, 64, 2).unwrap();
    assert_eq!(st(tight.take_slot(tb, SlotChoice::Any, AdmitMode::Promise)), EpmStatus::OutOfBudget);
    assert_eq!(tight.batch_info(tb).unwrap().live_slots, 0);
    // Stale ids.
    a.release_slot(q0, s.raw()).unwrap();
    assert_eq!(a.release_slot(q0, s.raw()).unwrap_err().status(), EpmStatus::InvalidHandle);
    a.destroy_batch(b).unwrap();
    assert_eq!(st(a.take_slot(b, SlotChoice::Any, AdmitMode::OnDemand)), EpmStatus::InvalidHandle);
    assert_eq!(a.destroy_batch(b).unwrap_err().status(), EpmStatus::InvalidHandle);
    assert_eq!(a.batch_info(b).unwrap_err().status(), EpmStatus::InvalidHandle);
}

#[test]
fn releasing_a_slot_fences_queued_work_before_remapping() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(GIB)).unwrap();
    let g = a.granule();
    let b = a.create_batch(&qwen14b(), 20, 2).unwrap();
    let q = a.take_slot(b, SlotChoice::Index(1), AdmitMode::OnDemand).unwrap();
    a.prepare_append(q, 10, s.raw()).unwrap();
    let base = a.sequence_info(q).unwrap().base;
    write(&d, &s, base, &vec![0x3Cu8; g]).unwrap();
    // A read of the slot queued behind ~100 ms of work (a graph replay over
    // the batch, say): release_slot must not remap it before the read ran.
    let mut back = epmem::device::PinnedBuffer::new(&d, g).unwrap();
    back.fill(0);
    let fences = a.stats().counters.stream_waits;
    d.spin_async(100_000, s.raw()).unwrap();
    // SAFETY: `back` outlives the copy: the stream is synchronized below.
    unsafe { d.memcpy_dtoh_async(back.as_mut_ptr(), base, g, s.raw()).unwrap() };
    let t0 = std::time::Instant::now();
    a.release_slot(q, s.raw()).unwrap();
    let waited = t0.elapsed();
    s.synchronize().expect("the queued read ran against the old mapping");
    assert!(waited >= std::time::Duration::from_millis(50), "release_slot returned after {waited:?}");
    assert!(back.iter().all(|&x| x == 0x3C), "the read saw the slot's own bytes");
    assert_eq!(a.stats().counters.stream_waits, fences + 1);
    // Taking a slot with nothing to map changes no mapping: no fence.
    a.take_slot(b, SlotChoice::Any, AdmitMode::OnDemand).unwrap();
    assert_eq!(a.stats().counters.stream_waits, fences + 1);
}

#[test]
fn a_failed_driver_call_never_leaves_a_slot_unmapped_or_the_ledger_wrong() {
    use epmem::device::fault::{FaultKind, FaultyDevice};
    let inner = dev();
    let l = qwen14b();
    let bpt = l.bytes_per_token();
    let baseline = inner.live_counts();
    let mut injected = 0;
    for kind in [FaultKind::Map, FaultKind::SetAccess, FaultKind::VmmCreate, FaultKind::Copy] {
        for n in 1..=4 {
            let fd = Arc::new(FaultyDevice::new(inner.clone()));
            let d: Arc<dyn Device> = fd.clone();
            let s = Stream::new(&d).unwrap();
            let mut a = KvPool::new(&d, KvConfig::new(GIB)).unwrap();
            let g = a.granule() as u64;
            let b = a.create_batch(&l, 32, 4).unwrap();
            let bi = a.batch_info(b).unwrap();
            let o = a.take_slot(b, SlotChoice::Index(0), AdmitMode::OnDemand).unwrap();
            a.prepare_append(o, 16, s.raw()).unwrap();
            let prompt = pattern(6, (16 * bpt) as usize);
            write(&d, &s, bi.base, &prompt).unwrap();
            let p = a.pin_prefix(o, 16, s.raw()).unwrap();
            let mut live = vec![o];
            fd.fail_nth(kind, n);
            // Each step may absorb the fault; a failing step must leave the batch whole.
            let r = a.take_shared_slot(b, SlotChoice::Any, p, 16, AdmitMode::OnDemand, s.raw());
            if let Ok(q) = r {
                live.push(q);
                let _ = a.prepare_append(q, 2, s.raw()); // COW of the boundary
            }
            let _ = a.prepare_append(o, 20, s.raw()); // the origin's COW + a fresh granule
            if live.len() > 1 {
                let _ = a.release_slot(live[1], s.raw());
            }
            injected += fd.injected();
            fd.clear();
            let live: Vec<SeqId> = (0..4).filter_map(|i| a.slot_sequence(b, i).unwrap()).collect();
            let what = format!("{} fault at call {n}", kind.name());
            // The whole range is mapped and reads back: the prompt where it is
            // shared, zeros in every free slot.
            for idx in 0..4u32 {
                let base = bi.base + idx as u64 * bi.slot_stride;
                match a.slot_sequence(b, idx).unwrap() {
                    Some(q) => {
                        let len = a.sequence_info(q).unwrap().len_tokens.min(16);
                        let n = (len * bpt) as usize;
                        assert_eq!(read(&d, &s, base, n), prompt[..n], "{what}: slot {idx}");
                    }
                    None => {
                        for k in 0..bi.slot_stride / g {
                            assert!(
                                read(&d, &s, base + k * g, 4096).iter().all(|&x| x == 0),
                                "{what}: free slot {idx}"
                            );
                        }
                    }
                }
            }
            let private: u64 = live.iter().map(|&q| a.sequence_info(q).unwrap().private_granules).sum();
            let pinned = a.prefix_info(p).unwrap().granules;
            assert_eq!(a.stats().ledger.owned_bytes, g * (1 + pinned + private), "{what}: the ledger");
            // And everything still works, then tears down to nothing.
            let q = a.take_shared_slot(b, SlotChoice::Any, p, 16, AdmitMode::OnDemand, s.raw()).unwrap();
            a.prepare_append(q, 1, s.raw()).unwrap();
            for q in a
                .batch_info(b)
                .map(|_| (0..4).filter_map(|i| a.slot_sequence(b, i).unwrap()).collect::<Vec<_>>())
                .unwrap()
            {
                a.release_slot(q, s.raw()).unwrap();
            }
            a.unpin_prefix(p).unwrap();
            a.destroy_batch(b).unwrap();
            assert_eq!(a.stats().ledger.owned_bytes, g, "{what}");
            drop(a);
            drop(s);
        }
    }
    assert!(injected >= 8, "only {injected} faults were injected: the steps did not reach the driver calls");
    let after = inner.live_counts();
    assert_eq!(
        (after.va_reservations, after.mappings, after.physical_handles),
        (baseline.va_reservations, baseline.mappings, baseline.physical_handles)
    );
}
