//! KV prefix sharing on whatever device EPM_DEVICE names (host in CI, CUDA on
//! the H200): one page at N addresses, write protection, copy-on-write, the
//! dummy tail, lifetimes, admission and content-hash detection.

mod kv_util;

use epmem::EpmStatus;
use epmem::device::Stream;
use epmem::kv::{AdmitMode, KvConfig, KvPool, PrefixId, SeqId};
use kv_util::*;

const GIB: u64 = 1 << 30;

/// An origin sequence with `n` tokens written (pattern 1), pinned.
fn origin(a: &mut KvPool, s: &Stream, n: u64, max: u64) -> (SeqId, PrefixId, Vec<u8>) {
    let l = qwen14b();
    let seq = a.create_sequence(&l, max, AdmitMode::OnDemand).unwrap();
    a.prepare_append(seq, n, s.raw()).unwrap();
    let bytes = pattern(1, (n * l.bytes_per_token()) as usize);
    write(a.device(), s, a.sequence_info(seq).unwrap().base, &bytes).unwrap();
    let p = a.pin_prefix(seq, n, s.raw()).unwrap();
    (seq, p, bytes)
}

#[test]
fn one_granule_is_visible_at_n_addresses_and_charged_once() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(4 * GIB)).unwrap();
    let g = a.granule() as u64;
    // 10 tokens = 1,966,080 B: one partial granule, the whole prefix.
    let (o, p, bytes) = origin(&mut a, &s, 10, 64);
    let owned = a.stats().ledger.owned_bytes;
    assert_eq!(owned, 2 * g, "dummy + one prefix granule");
    let phys_before = d.live_counts().physical_handles;
    let sharers: Vec<SeqId> = (0..8).map(|_| a.commit_shared_prefix(p, 10, 64, AdmitMode::OnDemand).unwrap()).collect();
    // The Nth sharer costs 0 owned bytes and no physical handle.
    assert_eq!(a.stats().ledger.owned_bytes, owned);
    assert_eq!(d.live_counts().physical_handles, phys_before);
    let mut bases = vec![a.sequence_info(o).unwrap().base, a.prefix_info(p).unwrap().view_base];
    for &q in &sharers {
        let i = a.sequence_info(q).unwrap();
        assert_eq!((i.len_tokens, i.shared_granules, i.private_granules), (10, 1, 0));
        bases.push(i.base);
    }
    bases.sort();
    bases.dedup();
    assert_eq!(bases.len(), 10, "ten distinct addresses");
    for b in bases {
        assert_eq!(read(&d, &s, b, bytes.len()), bytes, "alias at {b:#x}");
    }
    assert_eq!(a.stats().mapped_bytes, 9 * g, "nine sequences map the granule");
}

#[test]
fn host_writes_into_a_shared_prefix_are_refused_and_not_sticky() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(4 * GIB)).unwrap();
    let (o, p, bytes) = origin(&mut a, &s, 12, 64);
    let q = a.commit_shared_prefix(p, 12, 64, AdmitMode::OnDemand).unwrap();
    let qb = a.sequence_info(q).unwrap().base;
    let junk = vec![0xEEu8; 4096];
    for target in [qb, a.sequence_info(o).unwrap().base, a.prefix_info(p).unwrap().view_base] {
        let e = write(&d, &s, target, &junk).unwrap_err();
        assert!(
            matches!(e.status(), EpmStatus::AccessDenied | EpmStatus::CudaError | EpmStatus::InvalidArgument),
            "write into a read-only prefix: {e}"
        );
    }
    // Not sticky: the same stream still works, and the shared bytes are intact.
    a.prepare_append(q, 1, s.raw()).unwrap();
    let tok = 12 * qwen14b().bytes_per_token();
    write(&d, &s, qb + tok, &junk).unwrap();
    assert_eq!(read(&d, &s, qb + tok, junk.len()), junk);
    assert_eq!(read(&d, &s, a.sequence_info(o).unwrap().base, bytes.len()), bytes);
}

#[test]
fn copy_on_write_preserves_every_other_sharer() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(4 * GIB)).unwrap();
    let g = a.granule() as u64;
    let bpt = qwen14b().bytes_per_token();
    // 16 tokens end inside the second granule (3,145,728 B).
    let (o, p, bytes) = origin(&mut a, &s, 16, 64);
    let q1 = a.commit_shared_prefix(p, 16, 64, AdmitMode::OnDemand).unwrap();
    let q2 = a.commit_shared_prefix(p, 16, 64, AdmitMode::OnDemand).unwrap();
    let owned = a.stats().ledger.owned_bytes;
    a.prepare_append(q1, 2, s.raw()).unwrap();
    assert_eq!(a.stats().counters.cow_granules, 1);
    assert_eq!(a.stats().ledger.owned_bytes, owned + g, "one private copy of the boundary");
    let i1 = a.sequence_info(q1).unwrap();
    assert_eq!((i1.shared_granules, i1.private_granules), (1, 1));
    let mine = pattern(9, (2 * bpt) as usize);
    write(&d, &s, i1.base + 16 * bpt, &mine).unwrap();
    // q1 sees the prefix (copied) then its own tokens.
    assert_eq!(read(&d, &s, i1.base, bytes.len()), bytes);
    assert_eq!(read(&d, &s, i1.base + 16 * bpt, mine.len()), mine);
    // Everyone else still sees the original boundary granule, whole.
    let boundary = read(&d, &s, a.prefix_info(p).unwrap().view_base + g, g as usize);
    for other in [o, q2] {
        let b = a.sequence_info(other).unwrap().base;
        assert_eq!(read(&d, &s, b, bytes.len()), bytes);
        assert_eq!(read(&d, &s, b + g, g as usize), boundary);
    }
    // The origin diverges too: its boundary is shared now, so it copies as well.
    a.prepare_append(o, 1, s.raw()).unwrap();
    assert_eq!(a.stats().counters.cow_granules, 2);
    assert_eq!(read(&d, &s, a.sequence_info(q2).unwrap().base + g, g as usize), boundary);
}

#[test]
fn the_unused_tail_maps_the_zeroed_dummy_and_appends_inside_a_granule_are_free() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(GIB)).unwrap();
    let g = a.granule() as u64;
    let seq = a.create_sequence(&qwen14b(), 100, AdmitMode::OnDemand).unwrap();
    let info = a.sequence_info(seq).unwrap();
    assert_eq!(info.reserved_bytes, (100 * 196_608u64).div_ceil(g) * g);
    // A reader of the whole range (a captured graph) sees zeros, not a fault.
    assert!(read(&d, &s, info.base, info.reserved_bytes as usize).iter().all(|&b| b == 0));
    assert_eq!(a.stats().ledger.owned_bytes, g, "only the dummy is owned");
    a.prepare_append(seq, 1, s.raw()).unwrap();
    let before = d.driver_counts();
    let fences = a.stats().counters.stream_waits;
    a.prepare_append(seq, 9, s.raw()).unwrap(); // tokens 1..10 stay in granule 0
    assert_eq!(d.driver_counts(), before, "no driver call inside a private granule");
    assert_eq!(a.stats().counters.stream_waits, fences, "and no fence");
    a.prepare_append(seq, 1, s.raw()).unwrap(); // token 10 reaches granule 1
    assert_eq!(a.sequence_info(seq).unwrap().private_granules, 2);
    // The tail past the written tokens is still the dummy: zeros.
    let tail = info.base + 2 * g;
    assert!(read(&d, &s, tail, g as usize).iter().all(|&b| b == 0));
    // And it is read-only: a stray host write is refused.
    assert!(write(&d, &s, tail, &[1u8; 64]).is_err());
}

#[test]
fn destroyed_handles_and_bad_lengths_are_clean_errors() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(GIB)).unwrap();
    let l = qwen14b();
    let seq = a.create_sequence(&l, 32, AdmitMode::OnDemand).unwrap();
    let st = |r: epmem::Result<()>| r.unwrap_err().status();
    assert_eq!(st(a.prepare_append(seq, 33, s.raw())), EpmStatus::InvalidArgument);
    assert_eq!(st(a.pin_prefix(seq, 1, s.raw()).map(|_| ())), EpmStatus::InvalidArgument, "nothing written yet");
    a.prepare_append(seq, 32, s.raw()).unwrap();
    assert_eq!(st(a.prepare_append(seq, 1, s.raw())), EpmStatus::InvalidArgument);
    assert_eq!(st(a.pin_prefix(seq, 33, s.raw()).map(|_| ())), EpmStatus::InvalidArgument);
    let p = a.pin_prefix(seq, 20, s.raw()).unwrap();
    assert_eq!(st(a.commit_shared_prefix(p, 21, 64, AdmitMode::OnDemand).map(|_| ())), EpmStatus::InvalidArgument);
    assert_eq!(st(a.commit_shared_prefix(p, 20, 19, AdmitMode::OnDemand).map(|_| ())), EpmStatus::InvalidArgument);
    assert_eq!(st(a.create_sequence(&l, 0, AdmitMode::OnDemand).map(|_| ())), EpmStatus::InvalidArgument);
    assert_eq!(st(a.create_sequence(&l, u64::MAX / 2, AdmitMode::OnDemand).map(|_| ())), EpmStatus::InvalidArgument);
    a.destroy_sequence(seq).unwrap();
    assert_eq!(st(a.destroy_sequence(seq)), EpmStatus::InvalidHandle);
    assert_eq!(st(a.prepare_append(seq, 1, s.raw())), EpmStatus::InvalidHandle);
    assert_eq!(st(a.sequence_info(seq).map(|_| ())), EpmStatus::InvalidHandle);
    a.unpin_prefix(p).unwrap(); // no sharers left: freed now
    assert_eq!(st(a.unpin_prefix(p)), EpmStatus::InvalidHandle);
    assert_eq!(st(a.commit_shared_prefix(p, 1, 8, AdmitMode::OnDemand).map(|_| ())), EpmStatus::InvalidHandle);
    assert_eq!(a.stats().ledger.owned_bytes, a.granule() as u64, "back to the dummy alone");
}

#[test]
fn a_prefix_lives_until_the_pin_and_the_last_sharer_are_gone() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(GIB)).unwrap();
    let g = a.granule() as u64;
    let (o, p, bytes) = origin(&mut a, &s, 30, 64); // 30 tokens: 3 granules
    let q = a.commit_shared_prefix(p, 30, 64, AdmitMode::OnDemand).unwrap();
    a.destroy_sequence(o).unwrap();
    assert_eq!(a.stats().ledger.owned_bytes, 4 * g, "the prefix outlives its origin");
    a.unpin_prefix(p).unwrap();
    assert!(a.prefix_info(p).is_ok(), "a sharer keeps the unpinned prefix");
    assert_eq!(read(&d, &s, a.sequence_info(q).unwrap().base, bytes.len()), bytes);
    a.destroy_sequence(q).unwrap();
    assert_eq!(a.prefix_info(p).unwrap_err().status(), EpmStatus::InvalidHandle);
    assert_eq!(a.stats().ledger.owned_bytes, g);
    let l = a.stats().ledger;
    assert_eq!(l.charges - l.credits, 1, "every charge but the dummy's credited");
    // Released granules are retained and reused before new handles are made.
    let created = a.stats().pool.created;
    let seq = a.create_sequence(&qwen14b(), 30, AdmitMode::OnDemand).unwrap();
    a.prepare_append(seq, 30, s.raw()).unwrap();
    assert_eq!(a.stats().pool.created, created);
    assert_eq!(a.stats().pool.reused, 3);
}

#[test]
fn admission_refuses_what_the_ledger_cannot_hold() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let g = d.vmm_granularity() as u64;
    let l = qwen14b();
    // Budget: dummy + 6 granules. A 64-token sequence needs 6 granules.
    let mut a = KvPool::new(&d, KvConfig::new(7 * g)).unwrap();
    let first = a.create_sequence(&l, 64, AdmitMode::Promise).unwrap();
    let e = a.create_sequence(&l, 64, AdmitMode::Promise).unwrap_err();
    assert_eq!(e.status(), EpmStatus::OutOfBudget, "{e}");
    // The admitted sequence can always reach max_tokens.
    a.prepare_append(first, 64, s.raw()).unwrap();
    assert_eq!(a.stats().ledger.promised_bytes, 0);
    a.destroy_sequence(first).unwrap();
    // On-demand sequences are refused at the granule that does not fit, before
    // any mapping changes.
    let od = a.create_sequence(&l, 128, AdmitMode::OnDemand).unwrap();
    a.prepare_append(od, 64, s.raw()).unwrap();
    let e = a.prepare_append(od, 11, s.raw()).unwrap_err();
    assert_eq!(e.status(), EpmStatus::OutOfBudget);
    assert_eq!(a.sequence_info(od).unwrap().len_tokens, 64);
    assert!(a.stats().ledger.refusals >= 2);
}

#[test]
fn sharing_admits_more_requests_on_the_same_budget() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let g = d.vmm_granularity() as u64;
    let l = qwen14b();
    // 64-token prefix (6 granules) + 64 private tokens (6 granules) per request.
    let budget = g + 48 * g;
    let count = |share: bool| {
        let mut a = KvPool::new(&d, KvConfig::new(budget)).unwrap();
        let o = a.create_sequence(&l, 128, AdmitMode::Promise).unwrap();
        a.prepare_append(o, 64, s.raw()).unwrap();
        let p = a.pin_prefix(o, 64, s.raw()).unwrap();
        let mut n = 1;
        loop {
            let r = if share {
                a.commit_shared_prefix(p, 64, 128, AdmitMode::Promise)
            } else {
                a.create_sequence(&l, 128, AdmitMode::Promise)
            };
            match r {
                Ok(_) => n += 1,
                Err(e) => {
                    assert_eq!(e.status(), EpmStatus::OutOfBudget);
                    break n;
                }
            }
        }
    };
    let cost = epmem::kv::request_cost(&l, g, 64, 128);
    let arith = epmem::kv::admissible(budget - g, cost.prefix_bytes, cost.private_bytes);
    assert_eq!(count(false), arith.without_sharing as i32);
    assert_eq!(count(true), arith.with_sharing as i32);
    assert_eq!((count(false), count(true)), (4, 7));
}

#[test]
fn declared_tokens_find_an_existing_prefix_by_content() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(GIB)).unwrap();
    let l = qwen14b();
    let prompt: Vec<u32> = (1000..1040).collect(); // 40 tokens, 2 full hash blocks of 16 + 8
    let (o, shared) = a.create_sequence_for_tokens(&l, 64, &prompt, AdmitMode::OnDemand).unwrap();
    assert_eq!(shared, 0, "nothing to share yet");
    a.prepare_append(o, 40, s.raw()).unwrap();
    let bytes = pattern(3, (40 * l.bytes_per_token()) as usize);
    write(&d, &s, a.sequence_info(o).unwrap().base, &bytes).unwrap();
    let p = a.pin_prefix(o, 40, s.raw()).unwrap();
    // Same system prompt, different question: the 32 tokens of whole blocks are found.
    let mut other = prompt[..35].to_vec();
    other.extend([7, 7, 7]);
    let (q, shared) = a.create_sequence_for_tokens(&l, 64, &other, AdmitMode::OnDemand).unwrap();
    assert_eq!(shared, 32);
    assert_eq!(a.stats().counters.hash_hits, 1);
    let n = (32 * l.bytes_per_token()) as usize;
    assert_eq!(read(&d, &s, a.sequence_info(q).unwrap().base, n), bytes[..n]);
    assert_eq!(a.find_prefix(&l, &prompt), Some((p, 32)));
    // A different first block shares nothing; neither does another layout.
    let mut diff = prompt.clone();
    diff[0] = 1;
    assert_eq!(a.find_prefix(&l, &diff), None);
    let small =
        epmem::kv::KvLayout::token_major(epmem::kv::KvShape { layers: 24, kv_heads: 2, head_dim: 64, elem_bytes: 2 })
            .unwrap();
    assert_eq!(a.find_prefix(&small, &prompt), None);
    // Gone with its last sharer and pin: nothing is found any more.
    a.destroy_sequence(q).unwrap();
    a.destroy_sequence(o).unwrap();
    a.unpin_prefix(p).unwrap();
    assert_eq!(a.find_prefix(&l, &prompt), None);
}

#[test]
fn prepare_append_fences_queued_work_before_remapping() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(GIB)).unwrap();
    let g = a.granule();
    let seq = a.create_sequence(&qwen14b(), 64, AdmitMode::OnDemand).unwrap();
    let base = a.sequence_info(seq).unwrap().base;
    // Queue a read of the dummy tail behind ~100 ms of work. prepare_append
    // must not unmap the tail before that read has run.
    // The destination is pinned: a D2H copy into pageable memory makes the
    // CUDA driver block the host until the copy is done (seen on the H200),
    // which would hide whether prepare_append itself waited.
    let mut tail = epmem::device::PinnedBuffer::new(&d, g).unwrap();
    tail.fill(0xFF);
    d.spin_async(100_000, s.raw()).unwrap();
    // SAFETY: `tail` outlives the copy: the stream is synchronized below.
    unsafe { d.memcpy_dtoh_async(tail.as_mut_ptr(), base, g, s.raw()).unwrap() };
    let t0 = std::time::Instant::now();
    a.prepare_append(seq, 64, s.raw()).unwrap();
    let waited = t0.elapsed();
    s.synchronize().expect("the queued read ran against the old mapping");
    assert!(waited >= std::time::Duration::from_millis(50), "prepare_append returned after {waited:?}");
    assert!(tail.iter().all(|&b| b == 0), "the read saw the zeroed dummy");
    assert_eq!(a.stats().counters.stream_waits, 1);
}
