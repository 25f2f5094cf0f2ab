// The typed KV ids: a program that compiles, and the cases
// tests/compile_fail.rs makes of it by replacing the `@slot` line. A
// sequence, a prefix and a batch id are three types, so an id of one kind
// where another is expected is a compile error (it cannot alias a live
// object of the other kind that happens to have the same bits).
use epmem::device::{self, Stream};
use epmem::kv::{AdmitMode, BatchId, KvConfig, KvLayout, KvPool, KvShape, PrefixId, SeqId, SlotChoice};

fn main() -> epmem::Result<()> {
    let dev = device::open_from_env(0)?;
    let stream = Stream::new(&dev)?;
    let layout = KvLayout::token_major(KvShape { layers: 2, kv_heads: 2, head_dim: 64, elem_bytes: 2 })?;
    let mut pool = KvPool::new(&dev, KvConfig::new(1 << 30))?;
    let seq: SeqId = pool.create_sequence(&layout, 64, AdmitMode::OnDemand)?;
    pool.prepare_append(seq, 16, stream.raw())?;
    let pid: PrefixId = pool.pin_prefix(seq, 16, stream.raw())?;
    let bid: BatchId = pool.create_batch(&layout, 64, 2)?;
    let slot: SeqId = pool.take_shared_slot(bid, SlotChoice::Any, pid, 16, AdmitMode::OnDemand, stream.raw())?;
    let note = (); // @slot
    pool.release_slot(slot, stream.raw())?;
    pool.destroy_batch(bid)?;
    pool.unpin_prefix(pid)?;
    pool.destroy_sequence(seq)?;
    let _ = note;
    Ok(())
}

// A prefix id is not a sequence id, nor the other way round.
// @case E0308 | expected `SeqId`, found `PrefixId` | let note = pool.destroy_sequence(pid);
// @case E0308 | expected `SeqId`, found `PrefixId` | let note = pool.prepare_append(pid, 1, stream.raw());
// @case E0308 | expected `PrefixId`, found `SeqId` | let note = pool.unpin_prefix(seq);
// @case E0308 | expected `PrefixId`, found `SeqId` | let note = pool.commit_shared_prefix(slot, 8, 64, AdmitMode::OnDemand);
// A batch id is neither.
// @case E0308 | expected `BatchId`, found `SeqId` | let note = pool.destroy_batch(slot);
// @case E0308 | expected `SeqId`, found `BatchId` | let note = pool.sequence_info(bid);
// @case E0308 | expected `PrefixId`, found `BatchId` | let note = pool.prefix_info(bid);
// A bare integer is no id, and one kind does not convert into another.
// @case E0308 | expected `SeqId`, found `u64` | let note = pool.destroy_sequence(pid.bits());
// @case E0277 | the trait bound `SeqId: From<PrefixId>` is not satisfied | let note: SeqId = pid.into();
// @case E0423 | cannot initialize a tuple struct which contains private fields | let note = SeqId(pid.bits());
