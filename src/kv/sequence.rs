//! Sequence reservations: one contiguous, token-major VA range per sequence.
//!
//! Every granule-sized slot of a live reservation is always mapped to one of:
//! - the pool's dummy granule, read-only (the unused tail: a captured graph
//!   that reads the whole range never touches unmapped memory);
//! - a shared prefix granule, read-only;
//! - a private granule, read-write.
//!
//! `prepare_append` turns the slots the next tokens will be written to into
//! private ones *before* any kernel writes them, because a kernel store into a
//! read-only mapping is error 700 and poisons the whole CUDA context
//! (measured on the H200). A shared boundary granule is copied on write.

use super::granule::{GranuleId, GranulePool};
use super::id::{BatchId, PrefixId, SeqId};
use super::layout::{KvLayout, round_up};
use super::namespace::Namespace;
use super::pool::{AdmitMode, KvPool};
use super::reservation::Window;
use crate::device::{Access, DevicePtr, Event, RawStream};
use crate::error::Result;

/// What a slot of a reservation maps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    Dummy,
    Shared(GranuleId),
    Private(GranuleId),
}

#[derive(Debug)]
pub(crate) struct Sequence {
    pub layout: KvLayout,
    pub max_tokens: u64,
    /// Tokens made writable so far (prefix tokens included).
    pub len: u64,
    /// The reservation: the sequence's own, or its slot of a batch.
    pub va: Window,
    /// The mapping table: what each granule of `va` maps.
    pub slots: Vec<Slot>,
    /// (batch, slot index) when `va` is a slot of a batch: the batch owns the
    /// VA and the dummy mappings, which stay when the sequence goes.
    pub batch: Option<(BatchId, u32)>,
    /// The prefix whose view backs this sequence's shared slots (the source
    /// of their copy-on-write), if any.
    pub prefix: Option<PrefixId>,
    /// Declared token ids (content-hash detection).
    pub tokens: Vec<u32>,
    /// Where prefixes pinned from this sequence can be found by content
    /// (that of the prefix it was created from, else the caller's).
    pub namespace: Namespace,
    /// Granules promised to this sequence and not yet committed.
    pub promise: u64,
    /// Recorded after the last COW copy: the copy reads a prefix's view, so
    /// the view must not go away before it completes.
    pub cow_done: Option<Event>,
}

/// A sequence's layout descriptor and state, for the host's kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqInfo {
    pub layout: KvLayout,
    /// Device address of token 0; K/V offsets from [`KvLayout::offset`].
    pub base: DevicePtr,
    pub max_tokens: u64,
    pub len_tokens: u64,
    /// Bytes of VA reserved (max_tokens × bytes per token, rounded up to the granule).
    pub reserved_bytes: u64,
    pub shared_granules: u64,
    pub private_granules: u64,
    pub promised_granules: u64,
}

impl Sequence {
    pub fn committed_slots(&self) -> usize {
        self.slots.iter().filter(|s| !matches!(s, Slot::Dummy)).count()
    }

    pub fn shared_slots(&self) -> usize {
        self.slots.iter().filter(|s| matches!(s, Slot::Shared(_))).count()
    }

    /// Slots covering tokens `[from, to)`.
    pub fn slot_range(&self, from: u64, to: u64, granule: u64) -> std::ops::Range<usize> {
        let bpt = self.layout.bytes_per_token();
        let first = (from * bpt / granule) as usize;
        let end = (to * bpt).div_ceil(granule) as usize;
        first..end.max(first)
    }

    /// Wait for the last COW copy (before a prefix view it read may go away).
    pub fn wait_cow(&mut self) -> Result<()> {
        match self.cow_done.take() {
            Some(e) => e.synchronize(),
            None => Ok(()),
        }
    }

    /// Map `gid` at slot `i` with `access`, counting the mapping as a reference.
    pub fn map_slot(
        &mut self,
        pool: &mut GranulePool,
        i: usize,
        gid: GranuleId,
        access: Access,
        own_ref: bool,
    ) -> Result<()> {
        self.va.map(i, pool.phys(gid)?, access)?;
        if own_ref {
            pool.add_ref(gid)?;
        }
        Ok(())
    }
}

/// Map the dummy back at granule `i` of a batch slot. The batch's range must
/// stay mapped for kernels that read all of it, so a refused map is tried once
/// more before the error is returned; a hole that remains is repaired by the
/// next take of the slot (`build_in` maps the dummy wherever nothing is).
fn map_dummy(pool: &GranulePool, dummy: GranuleId, va: &Window, i: usize) -> Result<()> {
    let p = pool.phys(dummy)?;
    va.map(i, p, Access::ReadOnly).or_else(|e| {
        log::warn!("epmem: KV batch: mapping the dummy back failed ({e}); retrying once");
        va.map(i, p, Access::ReadOnly)
    })
}

/// Slots of `max_tokens` tokens of `layout` at granule `g`, or an error naming the overflow.
pub(crate) fn reservation_bytes(layout: &KvLayout, max_tokens: u64, g: u64) -> Result<u64> {
    crate::ensure!(max_tokens > 0, InvalidArgument, "KV sequence: max_tokens is 0");
    max_tokens
        .checked_mul(layout.bytes_per_token())
        .and_then(|b| round_up(b, g))
        .filter(|&b| b <= isize::MAX as u64)
        .ok_or_else(|| {
            crate::Error::invalid_argument(format!(
                "KV sequence: {max_tokens} tokens × {} bytes overflows",
                layout.bytes_per_token()
            ))
        })
}

impl KvPool {
    /// Reserve a sequence of up to `max_tokens` tokens of `layout`. Every slot
    /// maps the dummy granule read-only; nothing is charged to the ledger but
    /// the promise of [`AdmitMode::Promise`].
    pub fn create_sequence(&mut self, layout: &KvLayout, max_tokens: u64, mode: AdmitMode) -> Result<SeqId> {
        self.build_sequence(layout, max_tokens, None, mode)
    }

    /// Build a sequence whose first `shared.1` tokens map prefix `shared.0`.
    pub(crate) fn build_sequence(
        &mut self,
        layout: &KvLayout,
        max_tokens: u64,
        shared: Option<(PrefixId, u64)>,
        mode: AdmitMode,
    ) -> Result<SeqId> {
        self.build_in(layout, max_tokens, shared, mode, None)
    }

    /// Build a sequence in its own reservation (`slot` None) or in slot
    /// `slot.1` of batch `slot.0`, whose window is already mapped (the dummy,
    /// or whatever a failed teardown left: repaired here). Mapping the prefix
    /// into a batch slot replaces dummy mappings a queued kernel may read:
    /// the caller waits for the stream first.
    pub(crate) fn build_in(
        &mut self,
        layout: &KvLayout,
        max_tokens: u64,
        shared: Option<(PrefixId, u64)>,
        mode: AdmitMode,
        slot: Option<(BatchId, u32)>,
    ) -> Result<SeqId> {
        layout.validate()?;
        let g = self.granule() as u64;
        let bytes = reservation_bytes(layout, max_tokens, g)?;
        let total = (bytes / g) as usize;
        let namespace = match shared {
            Some((pid, _)) => self.prefixes.get(pid)?.namespace.clone(),
            None => Namespace::default(),
        };
        let (shared_granules, n_tokens) = match shared {
            Some((pid, n)) => {
                let p = self.prefixes.get(pid)?;
                crate::ensure!(
                    p.layout == *layout,
                    InvalidArgument,
                    "KV prefix {pid:#x} has a different layout than the new sequence"
                );
                crate::ensure!(
                    n > 0 && n <= p.n_tokens && n <= max_tokens,
                    InvalidArgument,
                    "KV prefix: {n} shared tokens outside 1..={} (prefix) and max_tokens {max_tokens}",
                    p.n_tokens
                );
                let k = (n * layout.bytes_per_token()).div_ceil(g) as usize;
                (p.granules[..k].to_vec(), n)
            }
            None => (Vec::new(), 0),
        };
        // Worst-case private need: every slot past the prefix's full granules
        // (the boundary is copied on write), or nothing if it cannot append.
        let full = (n_tokens * layout.bytes_per_token() / g) as usize;
        let need = match mode {
            AdmitMode::OnDemand => 0,
            AdmitMode::Promise if max_tokens == n_tokens => total - shared_granules.len(),
            AdmitMode::Promise => total - full,
        } as u64;
        self.pool.ledger_mut().promise(need * g)?;
        self.pool.trim_to_budget();
        let va = match slot {
            None => Window::reserve(&self.dev, total),
            Some((bid, idx)) => self.batches.get(bid).and_then(|b| b.window(idx, total)),
        };
        let mut seq = Sequence {
            layout: *layout,
            max_tokens,
            len: n_tokens,
            va: match va {
                Ok(v) => v,
                Err(e) => {
                    self.pool.ledger_mut().unpromise(need * g)?;
                    return Err(e);
                }
            },
            slots: Vec::with_capacity(total),
            batch: slot,
            prefix: shared.map(|(pid, _)| pid),
            tokens: Vec::new(),
            namespace,
            promise: need,
            cow_done: None,
        };
        let dummy = self.dummy;
        let mapped = (|| {
            for i in 0..total {
                match shared_granules.get(i) {
                    Some(&gid) => {
                        if seq.va.is_mapped(i) {
                            seq.va.unmap(i)?; // a batch slot's dummy
                        }
                        if let Err(e) = seq.map_slot(&mut self.pool, i, gid, Access::ReadOnly, true) {
                            if seq.batch.is_some() {
                                map_dummy(&self.pool, dummy, &seq.va, i)?;
                            }
                            return Err(e);
                        }
                        seq.slots.push(Slot::Shared(gid));
                    }
                    None => {
                        if !seq.va.is_mapped(i) {
                            seq.map_slot(&mut self.pool, i, dummy, Access::ReadOnly, false)?;
                        }
                        seq.slots.push(Slot::Dummy);
                    }
                }
            }
            Ok(())
        })();
        if let Err(e) = mapped {
            seq.prefix = None;
            let _ = self.teardown(seq);
            return Err(e);
        }
        if let Some((pid, _)) = shared {
            self.prefixes.get_mut(pid)?.sharers += 1;
        }
        let id = self.seqs.insert(seq);
        if let Some((bid, idx)) = slot {
            self.batches.get_mut(bid)?.slots[idx as usize] = Some(id);
        }
        Ok(id)
    }

    /// Make the slots that tokens `[len, len + n_tokens)` fall in private and
    /// read-write, so the caller's next kernel on `stream` can write them.
    ///
    /// Only a slot that is not yet private costs anything: the host waits
    /// for the work queued on `stream`, and then, per slot,
    /// unmaps the dummy or shared granule, maps a pooled granule read-write,
    /// and for a shared boundary granule enqueues a 1-granule D2D copy on
    /// `stream` (copy-on-write). The copy needs no host wait: the caller's
    /// kernels on `stream` are ordered after it. Appending inside a granule
    /// that is already private is bookkeeping only — no driver call.
    ///
    /// Errors: `n_tokens` past `max_tokens` is InvalidArgument; a ledger that
    /// cannot hold the new granules is OutOfBudget, checked before any
    /// mapping changes.
    pub fn prepare_append(&mut self, seq_id: SeqId, n_tokens: u64, stream: RawStream) -> Result<()> {
        let g = self.granule() as u64;
        let seq = self.seqs.get(seq_id)?;
        crate::ensure!(
            n_tokens <= seq.max_tokens - seq.len,
            InvalidArgument,
            "KV sequence {seq_id:#x}: appending {n_tokens} tokens to {} of at most {}",
            seq.len,
            seq.max_tokens
        );
        if n_tokens == 0 {
            return Ok(());
        }
        let work: Vec<usize> = seq
            .slot_range(seq.len, seq.len + n_tokens, g)
            .filter(|&i| !matches!(seq.slots[i], Slot::Private(_)))
            .collect();
        if work.is_empty() {
            self.seqs.get_mut(seq_id)?.len += n_tokens;
            return Ok(());
        }
        let fresh = work.len() as u64;
        let from_promise = fresh.min(seq.promise);
        let prefix = seq.prefix;
        if !self.pool.ledger().can_charge(fresh * g, from_promise * g) {
            return Err(self.pool.ledger_mut().refuse("a KV append", fresh * g));
        }
        self.wait_for_stream(stream)?;
        let view_base = match prefix {
            Some(pid) => Some(self.prefixes.get(pid)?.view.base()),
            None => None,
        };
        let seq = self.seqs.get_mut(seq_id)?;
        let mut copied = false;
        for i in work {
            let old = seq.slots[i];
            let off = i * g as usize;
            let from_promise = seq.promise > 0;
            let gid = self.pool.acquire(from_promise)?;
            if from_promise {
                seq.promise -= 1;
            }
            // A failed step gives the granule back and restores the promise,
            // so a PROMISE sequence keeps its guarantee (tests/fault_injection.rs).
            let give_back = |pool: &mut GranulePool, seq: &mut Sequence| -> Result<()> {
                pool.release(gid)?;
                if from_promise {
                    pool.ledger_mut().promise(g)?;
                    seq.promise += 1;
                }
                Ok(())
            };
            let back = match old {
                Slot::Shared(o) => o,
                _ => self.dummy,
            };
            if let Err(e) = seq.va.unmap(i) {
                give_back(&mut self.pool, seq)?;
                return Err(e);
            }
            if let Err(e) = seq.map_slot(&mut self.pool, i, gid, Access::ReadWrite, false) {
                // Put the old mapping back so the slot is never left unmapped.
                seq.map_slot(&mut self.pool, i, back, Access::ReadOnly, false)?;
                give_back(&mut self.pool, seq)?;
                return Err(e);
            }
            if let Slot::Shared(_) = old {
                let Some(src) = view_base else {
                    crate::bail!(Internal, "KV sequence {seq_id:#x}: shared slot without a prefix view");
                };
                // The prefix view keeps `o` mapped and referenced while this
                // sequence stays linked, so the copy's source stays valid. The
                // slot turns private only once its copy is queued: a failed
                // copy must not leave an uncopied private granule behind.
                let r = self.dev.memcpy_dtod_async(seq.va.base() + off as u64, src + off as u64, g as usize, stream);
                if let Err(e) = r {
                    seq.va.unmap(i)?;
                    seq.map_slot(&mut self.pool, i, back, Access::ReadOnly, false)?;
                    give_back(&mut self.pool, seq)?;
                    return Err(e);
                }
            }
            seq.slots[i] = Slot::Private(gid);
            match old {
                Slot::Shared(o) => {
                    self.pool.release(o)?;
                    self.counters.cow_granules += 1;
                    copied = true;
                }
                Slot::Dummy => self.counters.committed_granules += 1,
                Slot::Private(_) => crate::bail!(Internal, "KV sequence: private slot in the work list"),
            }
        }
        if copied {
            let e = match seq.cow_done.take() {
                Some(e) => Ok(e),
                None => Event::new(&self.dev, false),
            };
            if let Err(err) = e.and_then(|e| e.record_raw(stream).map(|()| seq.cow_done = Some(e))) {
                // Without its event nothing could wait for the copies before
                // the prefix view goes away: wait for them here instead, and
                // keep the append (its copies are done).
                log::warn!("epmem: KV copy-on-write event failed ({err}); waited for the copies on the host");
                self.dev.stream_synchronize(stream)?;
            }
        }
        seq.len += n_tokens;
        if seq.prefix.is_some() && seq.shared_slots() == 0 {
            self.unlink(seq_id)?;
        }
        Ok(())
    }

    /// Destroy a sequence: unmap every slot, drop its granule references
    /// (crediting the ledger on 1→0), return its unused promise, free its VA.
    /// The caller guarantees no queued kernel still touches it (like cuMemFree).
    pub fn destroy_sequence(&mut self, seq_id: SeqId) -> Result<()> {
        self.unlink(seq_id)?;
        let seq = self.seqs.remove(seq_id)?;
        let slot = seq.batch;
        let r = self.teardown(seq);
        if let Some((bid, idx)) = slot
            && let Ok(b) = self.batches.get_mut(bid)
        {
            b.slots[idx as usize] = None;
        }
        r
    }

    /// Unmap → release → free VA, then return the promise. Best effort: every
    /// step runs, the first error is returned. A batch slot's granules map the
    /// dummy again instead (the batch's whole range stays mapped, and the VA
    /// is the batch's to free).
    fn teardown(&mut self, mut seq: Sequence) -> Result<()> {
        let g = self.granule();
        let mut first = seq.wait_cow();
        let mut keep = |r: Result<()>| {
            if first.is_ok() {
                first = r;
            }
        };
        let in_batch = seq.batch.is_some();
        for (i, slot) in seq.slots.iter().enumerate() {
            match *slot {
                Slot::Dummy if in_batch => {}
                Slot::Dummy => keep(seq.va.unmap(i)),
                Slot::Shared(gid) | Slot::Private(gid) => {
                    keep(seq.va.unmap(i));
                    if in_batch {
                        keep(map_dummy(&self.pool, self.dummy, &seq.va, i));
                    }
                    keep(self.pool.release(gid));
                }
            }
        }
        keep(self.pool.ledger_mut().unpromise(seq.promise * g as u64));
        drop(seq.va);
        first
    }

    /// Detach a sequence from its prefix; the prefix dies if that was its
    /// last sharer and it is not pinned.
    pub(crate) fn unlink(&mut self, seq_id: SeqId) -> Result<()> {
        let seq = self.seqs.get_mut(seq_id)?;
        let Some(pid) = seq.prefix else { return Ok(()) };
        seq.wait_cow()?;
        seq.prefix = None;
        let p = self.prefixes.get_mut(pid)?;
        crate::ensure!(p.sharers > 0, Internal, "KV prefix {pid:#x}: sharer count underflow");
        p.sharers -= 1;
        if p.sharers == 0 && !p.pinned {
            self.destroy_prefix(pid)?;
        }
        Ok(())
    }

    /// The layout descriptor and state of a sequence.
    pub fn sequence_info(&self, seq_id: SeqId) -> Result<SeqInfo> {
        let s = self.seqs.get(seq_id)?;
        let shared = s.shared_slots() as u64;
        Ok(SeqInfo {
            layout: s.layout,
            base: s.va.base(),
            max_tokens: s.max_tokens,
            len_tokens: s.len,
            reserved_bytes: s.va.len() as u64,
            shared_granules: shared,
            private_granules: s.committed_slots() as u64 - shared,
            promised_granules: s.promise,
        })
    }
}
