//! Sharing namespaces (per-tenant cache salts) on whatever device EPM_DEVICE
//! names: identical prompts in two namespaces share nothing — neither by the
//! ledger nor by the driver's physical handles — while one namespace shares
//! as the unsalted calls do, and explicit sharing by prefix handle is
//! unaffected.

mod kv_util;

use epmem::EpmStatus;
use epmem::device::Stream;
use epmem::kv::batch::SlotChoice;
use epmem::kv::{AdmitMode, KvConfig, KvPool, Namespace, PrefixId, SeqId};
use kv_util::*;

const GIB: u64 = 1 << 30;

fn ns(s: &str) -> Namespace {
    Namespace::new(s.as_bytes()).unwrap()
}

/// A 40-token prompt (two whole 16-token hash blocks), prefilled with
/// pattern `seed` and pinned, in namespace `n`. Returns (sequence, prefix, bytes).
fn pinned(a: &mut KvPool, s: &Stream, n: &Namespace, prompt: &[u32], seed: u8) -> (SeqId, PrefixId, Vec<u8>) {
    let l = qwen14b();
    let (o, shared) = a.create_sequence_for_tokens_in(n, &l, 64, prompt, AdmitMode::OnDemand).unwrap();
    assert_eq!(shared, 0, "nothing pinned in {n:?} yet");
    a.prepare_append(o, prompt.len() as u64, s.raw()).unwrap();
    let bytes = pattern(seed, (prompt.len() as u64 * l.bytes_per_token()) as usize);
    write(a.device(), s, a.sequence_info(o).unwrap().base, &bytes).unwrap();
    let p = a.pin_prefix(o, prompt.len() as u64, s.raw()).unwrap();
    (o, p, bytes)
}

#[test]
fn two_namespaces_with_identical_tokens_share_nothing() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(GIB)).unwrap();
    let l = qwen14b();
    let g = a.granule() as u64;
    let prompt: Vec<u32> = (1000..1040).collect();
    let (ta, tb) = (ns("tenant-a"), ns("tenant-b"));
    let (_oa, pa, bytes_a) = pinned(&mut a, &s, &ta, &prompt, 3);

    // Tenant B sends the same prompt: no hit, no shared granule, zeros to read.
    let owned0 = a.stats().ledger.owned_bytes;
    let phys0 = d.live_counts().physical_handles;
    assert_eq!(a.find_prefix_in(&tb, &l, &prompt), None);
    assert_eq!(a.find_prefix(&l, &prompt), None, "the default namespace is a namespace too");
    let (qb, shared) = a.create_sequence_for_tokens_in(&tb, &l, 64, &prompt, AdmitMode::OnDemand).unwrap();
    assert_eq!(shared, 0);
    assert_eq!(a.stats().counters.hash_hits, 0);
    let info = a.sequence_info(qb).unwrap();
    assert_eq!((info.len_tokens, info.shared_granules), (0, 0));
    let n = bytes_a.len();
    assert_eq!(read(&d, &s, info.base, n), vec![0u8; n], "B reads the dummy, not A's KV");
    // B prefills its own copy: the ledger and the driver both see new granules.
    a.prepare_append(qb, 40, s.raw()).unwrap();
    let granules = (40 * l.bytes_per_token()).div_ceil(g);
    assert_eq!(a.stats().ledger.owned_bytes - owned0, granules * g);
    assert_eq!(d.live_counts().physical_handles - phys0, granules);
    assert_eq!(a.sequence_info(qb).unwrap().shared_granules, 0);

    // B pins its prompt: each namespace now finds its own prefix, never the other's.
    let pb = a.pin_prefix(qb, 40, s.raw()).unwrap();
    assert_ne!(pa, pb);
    assert_eq!(a.find_prefix_in(&ta, &l, &prompt), Some((pa, 32)));
    assert_eq!(a.find_prefix_in(&tb, &l, &prompt), Some((pb, 32)));
    assert_eq!(a.find_prefix(&l, &prompt), None);
    assert_eq!(a.find_prefix_in(&ns("tenant-c"), &l, &prompt), None);
}

#[test]
fn one_namespace_shares_as_the_unsalted_calls_do() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(GIB)).unwrap();
    let l = qwen14b();
    let prompt: Vec<u32> = (1000..1040).collect();
    let t = ns("tenant-a");
    let (_o, p, bytes) = pinned(&mut a, &s, &t, &prompt, 5);
    let owned0 = a.stats().ledger.owned_bytes;
    let phys0 = d.live_counts().physical_handles;
    let mut other = prompt[..35].to_vec();
    other.extend([7, 7, 7]);
    let (q, shared) = a.create_sequence_for_tokens_in(&t, &l, 64, &other, AdmitMode::OnDemand).unwrap();
    assert_eq!(shared, 32);
    assert_eq!(a.stats().counters.hash_hits, 1);
    assert_eq!(a.stats().ledger.owned_bytes, owned0, "the sharer costs 0 owned bytes");
    assert_eq!(d.live_counts().physical_handles, phys0, "and no physical handle");
    let n = (32 * l.bytes_per_token()) as usize;
    assert_eq!(read(&d, &s, a.sequence_info(q).unwrap().base, n), bytes[..n]);
    assert_eq!(a.find_prefix_in(&t, &l, &prompt), Some((p, 32)));
    // The unsalted calls are the default namespace's, unchanged.
    let (o2, p2, _) = pinned(&mut a, &s, &Namespace::default(), &prompt, 6);
    let (q2, shared) = a.create_sequence_for_tokens(&l, 64, &other, AdmitMode::OnDemand).unwrap();
    assert_eq!(shared, 32);
    assert_eq!(a.find_prefix(&l, &prompt), Some((p2, 32)));
    for id in [q, q2, o2] {
        a.destroy_sequence(id).unwrap();
    }
}

#[test]
fn batch_slots_share_only_within_their_namespace() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(GIB)).unwrap();
    let l = qwen14b();
    let b = a.create_batch(&l, 64, 4).unwrap();
    let prompt: Vec<u32> = (0..48).collect();
    let (ta, tb) = (ns("a"), ns("b"));
    let (o, shared) =
        a.take_slot_for_tokens_in(&ta, b, SlotChoice::Any, &prompt, AdmitMode::OnDemand, s.raw()).unwrap();
    assert_eq!(shared, 0);
    a.prepare_append(o, 48, s.raw()).unwrap();
    let p = a.pin_prefix(o, 48, s.raw()).unwrap();
    let owned0 = a.stats().ledger.owned_bytes;
    let (qb, shared) =
        a.take_slot_for_tokens_in(&tb, b, SlotChoice::Any, &prompt, AdmitMode::OnDemand, s.raw()).unwrap();
    assert_eq!(shared, 0, "another namespace's slot shares nothing");
    assert_eq!(a.sequence_info(qb).unwrap().shared_granules, 0);
    let (qa, shared) =
        a.take_slot_for_tokens_in(&ta, b, SlotChoice::Any, &prompt, AdmitMode::OnDemand, s.raw()).unwrap();
    assert_eq!(shared, 48);
    assert_eq!(a.stats().ledger.owned_bytes, owned0);
    assert_eq!(a.stats().counters.hash_hits, 1);
    for q in [qa, qb, o] {
        a.release_slot(q, s.raw()).unwrap();
    }
    a.unpin_prefix(p).unwrap();
}

#[test]
fn explicit_sharing_by_handle_ignores_namespaces_and_joins_the_prefix_s() {
    let d = dev();
    let s = Stream::new(&d).unwrap();
    let mut a = KvPool::new(&d, KvConfig::new(GIB)).unwrap();
    let l = qwen14b();
    let prompt: Vec<u32> = (0..32).collect();
    let t = ns("tenant-a");
    let (_o, p, bytes) = pinned(&mut a, &s, &t, &prompt, 9);
    // Whoever holds the prefix handle may commit it, as before.
    let q = a.commit_shared_prefix(p, 32, 64, AdmitMode::OnDemand).unwrap();
    assert_eq!(read(&d, &s, a.sequence_info(q).unwrap().base, bytes.len()), bytes);
    // A prefix pinned from that sequence belongs to the prefix's namespace.
    let mut longer = prompt.clone();
    longer.extend(100..116);
    a.declare_tokens(q, &longer[32..]).unwrap();
    a.prepare_append(q, 16, s.raw()).unwrap();
    let p2 = a.pin_prefix(q, 48, s.raw()).unwrap();
    assert_eq!(a.find_prefix_in(&t, &l, &longer), Some((p2, 48)));
    assert_eq!(a.find_prefix(&l, &longer), None);
}

#[test]
fn bad_namespaces_are_refused_with_a_message() {
    let e = Namespace::new(&[b'x'; Namespace::MAX_BYTES + 1]).unwrap_err();
    assert_eq!(e.status(), EpmStatus::InvalidArgument);
    assert!(e.message().contains("exceed the limit of 128 bytes"), "{}", e.message());
    let e = Namespace::new(b"a\0b").unwrap_err();
    assert_eq!(e.status(), EpmStatus::InvalidArgument);
    assert!(e.message().contains("NUL"), "{}", e.message());
}
