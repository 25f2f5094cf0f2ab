// A prefix id is not a sequence id, nor the other way round.
// Fails with E0308: expected `SeqId`, found `PrefixId`
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
    let note = pool.destroy_sequence(pid);
    pool.release_slot(slot, stream.raw())?;
    pool.destroy_batch(bid)?;
    pool.unpin_prefix(pid)?;
    pool.destroy_sequence(seq)?;
    let _ = note;
    Ok(())
}
