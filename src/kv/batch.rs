//! Batch reservations: many sequences behind one base pointer.
//!
//! A batched decode kernel (FlashAttention, SDPA, vAttention's unmodified
//! kernels) takes one base pointer and a batch stride; sequences that are
//! separate reservations at unrelated addresses cannot be decoded in one call.
//! A batch is one VA reservation of `max_slots × slot_stride` bytes; slot `s`
//! is the window `[base + s·slot_stride, +slot_stride)`, and a sequence taken
//! into it is an ordinary [`super::sequence`] sequence whose reservation is
//! that window — prepare_append, copy-on-write, pinning, the ledger and
//! admission are the same code.
//!
//! The whole range is mapped for the batch's life: every granule of a free
//! slot, and of a taken slot past what it committed, maps the pool's zeroed
//! dummy read-only. So a captured CUDA graph over the whole batch never
//! touches unmapped memory, and a slot's addresses never move when others
//! join, leave or append. Releasing a slot maps the dummy back over its
//! granules (after a host wait for the caller's stream) and returns them to the pool.
//!
//! Teardown: slots first (unmap → dummy back → release), then the batch
//! (unmap the dummies → free VA).

use std::sync::{Arc, Mutex};

use super::id::{BatchId, PrefixId, SeqId};
use super::layout::KvLayout;
use super::namespace::Namespace;
use super::pool::{AdmitMode, KvPool};
use super::reservation::{VaTable, Window};
use super::sequence::{SeqInfo, Slot, reservation_bytes};
use crate::device::{Access, DevicePtr, RawStream};
use crate::error::Result;

#[derive(Debug)]
pub(crate) struct Batch {
    pub layout: KvLayout,
    pub max_tokens: u64,
    /// Granules per slot (the slot stride in granules).
    pub slot_granules: usize,
    pub table: Arc<Mutex<VaTable>>,
    pub base: DevicePtr,
    /// The sequence in each slot.
    pub slots: Vec<Option<SeqId>>,
}

impl Batch {
    /// Slot `idx`'s window; `granules` must be the batch's slot stride.
    pub fn window(&self, idx: u32, granules: usize) -> Result<Window> {
        crate::ensure!(
            granules == self.slot_granules,
            Internal,
            "KV batch slot of {granules} granules, not {}",
            self.slot_granules
        );
        Window::part(&self.table, idx as usize * granules, granules)
    }
}

/// A batch's layout descriptor, for the host's kernels: K/V of token `t` of
/// slot `s` live at `base + s·slot_stride + layout.offset(layer, kv, t, head)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchInfo {
    pub layout: KvLayout,
    /// Device address of slot 0, token 0; aligned to the granule.
    pub base: DevicePtr,
    /// Bytes from one slot to the next: max_tokens × token_stride rounded up
    /// to the granule.
    pub slot_stride: u64,
    pub max_slots: u32,
    pub max_tokens: u64,
    pub live_slots: u32,
    pub granule_bytes: u64,
    /// max_slots × slot_stride.
    pub reserved_bytes: u64,
}

/// One slot's state: the sequence's, plus where it sits in the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotInfo {
    pub seq: SeqInfo,
    pub batch: BatchId,
    pub index: u32,
    /// Leading tokens whose granules are all committed (shared or private):
    /// appends up to here change no mapping (no host wait, no driver call).
    pub committed_tokens: u64,
}

/// Which slot a take asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotChoice {
    /// The lowest free slot.
    Any,
    Index(u32),
}

impl KvPool {
    /// A batch of `max_slots` slots of up to `max_tokens` tokens of `layout`,
    /// every granule mapping the dummy read-only. Charges nothing: the dummy
    /// is the pool's, already owned.
    pub fn create_batch(&mut self, layout: &KvLayout, max_tokens: u64, max_slots: u32) -> Result<BatchId> {
        layout.validate()?;
        let g = self.granule() as u64;
        crate::ensure!(
            max_slots > 0 && max_slots < u32::MAX,
            InvalidArgument,
            "KV batch: max_slots {max_slots} outside 1..{}",
            u32::MAX
        );
        let stride = reservation_bytes(layout, max_tokens, g)?;
        let total = stride.checked_mul(max_slots as u64).filter(|&b| b <= isize::MAX as u64).ok_or_else(|| {
            crate::Error::invalid_argument(format!("KV batch: {max_slots} slots × {stride} bytes overflows"))
        })?;
        let granules = (total / g) as usize;
        let mut table = VaTable::reserve(&self.dev, granules)?;
        let dummy = self.pool.phys(self.dummy)?;
        for i in 0..granules {
            // On failure the table's drop unmaps what was mapped and frees the VA.
            table.map(i, dummy, Access::ReadOnly)?;
        }
        let table = Arc::new(Mutex::new(table));
        let base = Window::whole(table.clone())?.base();
        Ok(self.batches.insert(Batch {
            layout: *layout,
            max_tokens,
            slot_granules: (stride / g) as usize,
            table,
            base,
            slots: vec![None; max_slots as usize],
        }))
    }

    /// Destroy a batch: unmap its dummy mappings and free its VA. Refused
    /// with InvalidState while a slot is taken (release them first).
    pub fn destroy_batch(&mut self, bid: BatchId) -> Result<()> {
        let b = self.batches.get(bid)?;
        let live = b.slots.iter().filter(|s| s.is_some()).count();
        crate::ensure!(live == 0, InvalidState, "KV batch {bid:#x} still has {live} taken slot(s): release them first");
        drop(self.batches.remove(bid)?);
        Ok(())
    }

    fn free_slot(&self, bid: BatchId, choice: SlotChoice) -> Result<u32> {
        let b = self.batches.get(bid)?;
        let n = b.slots.len();
        match choice {
            SlotChoice::Any => match b.slots.iter().position(Option::is_none) {
                Some(i) => Ok(i as u32),
                None => crate::bail!(AllInUse, "KV batch {bid:#x}: all {n} slots are taken"),
            },
            SlotChoice::Index(i) => {
                crate::ensure!((i as usize) < n, InvalidArgument, "KV batch {bid:#x}: slot {i} outside 0..{n}");
                crate::ensure!(b.slots[i as usize].is_none(), InvalidState, "KV batch {bid:#x}: slot {i} is taken");
                Ok(i)
            }
        }
    }

    /// Take a slot for a new, empty sequence (its granules map the dummy
    /// until prepare_append). No mapping changes, so no host wait.
    pub fn take_slot(&mut self, bid: BatchId, choice: SlotChoice, mode: AdmitMode) -> Result<SeqId> {
        let idx = self.free_slot(bid, choice)?;
        let (layout, max) = self.batch_shape(bid)?;
        self.build_in(&layout, max, None, mode, Some((bid, idx)))
    }

    /// Take a slot whose first `n_tokens` tokens map prefix `pid` read-only
    /// (as [`KvPool::commit_shared_prefix`]: no copy, no charge). The slot's
    /// dummy mappings are replaced, so the host waits for `stream` first: a
    /// captured graph over the whole batch may be reading them.
    pub fn take_shared_slot(
        &mut self,
        bid: BatchId,
        choice: SlotChoice,
        pid: PrefixId,
        n_tokens: u64,
        mode: AdmitMode,
        stream: RawStream,
    ) -> Result<SeqId> {
        let idx = self.free_slot(bid, choice)?;
        let (layout, max) = self.batch_shape(bid)?;
        let p = self.prefixes.get(pid)?;
        crate::ensure!(
            p.layout == layout,
            InvalidArgument,
            "KV prefix {pid:#x} has a different layout than batch {bid:#x}"
        );
        let tokens = p.tokens.get(..n_tokens as usize).map(<[u32]>::to_vec);
        self.wait_for_stream(stream)?;
        let seq = self.build_in(&layout, max, Some((pid, n_tokens)), mode, Some((bid, idx)))?;
        if let Some(t) = tokens {
            self.seqs.get_mut(seq)?.tokens = t;
        }
        Ok(seq)
    }

    /// Take a slot that declares `tokens` (its prompt): the longest live
    /// prefix that begins with them is shared, as
    /// [`KvPool::create_sequence_for_tokens`]. Returns (sequence, tokens
    /// already in the cache). The default namespace: see
    /// [`KvPool::take_slot_for_tokens_in`].
    pub fn take_slot_for_tokens(
        &mut self,
        bid: BatchId,
        choice: SlotChoice,
        tokens: &[u32],
        mode: AdmitMode,
        stream: RawStream,
    ) -> Result<(SeqId, u64)> {
        self.take_slot_for_tokens_in(&Namespace::default(), bid, choice, tokens, mode, stream)
    }

    /// As [`KvPool::take_slot_for_tokens`] in namespace `ns` (as
    /// [`KvPool::create_sequence_for_tokens_in`]).
    pub fn take_slot_for_tokens_in(
        &mut self,
        ns: &Namespace,
        bid: BatchId,
        choice: SlotChoice,
        tokens: &[u32],
        mode: AdmitMode,
        stream: RawStream,
    ) -> Result<(SeqId, u64)> {
        let (layout, max) = self.batch_shape(bid)?;
        crate::ensure!(
            tokens.len() as u64 <= max,
            InvalidArgument,
            "KV batch slot: {} declared tokens exceed max_tokens {max}",
            tokens.len()
        );
        let (seq, shared) = match self.find_prefix_in(ns, &layout, tokens) {
            Some((pid, m)) => {
                let s = self.take_shared_slot(bid, choice, pid, m, mode, stream)?;
                self.counters.hash_hits += 1;
                (s, m)
            }
            None => (self.take_slot(bid, choice, mode)?, 0),
        };
        let s = self.seqs.get_mut(seq)?;
        s.tokens = tokens.to_vec();
        s.namespace = ns.clone();
        Ok((seq, shared))
    }

    /// Release a slot: wait for `stream` (a graph over the whole batch may still
    /// read the slot), map the dummy back over its granules, return them to
    /// the pool (credited on their last mapping) and the slot to the batch.
    /// InvalidArgument if `seq` is not a batch slot.
    pub fn release_slot(&mut self, seq: SeqId, stream: RawStream) -> Result<()> {
        let s = self.seqs.get(seq)?;
        crate::ensure!(s.batch.is_some(), InvalidArgument, "KV sequence {seq:#x} is not a slot of a batch");
        if s.committed_slots() > 0 {
            self.wait_for_stream(stream)?;
        }
        self.destroy_sequence(seq)
    }

    fn batch_shape(&self, bid: BatchId) -> Result<(KvLayout, u64)> {
        let b = self.batches.get(bid)?;
        Ok((b.layout, b.max_tokens))
    }

    pub fn batch_info(&self, bid: BatchId) -> Result<BatchInfo> {
        let b = self.batches.get(bid)?;
        let g = self.granule() as u64;
        let stride = b.slot_granules as u64 * g;
        Ok(BatchInfo {
            layout: b.layout,
            base: b.base,
            slot_stride: stride,
            max_slots: b.slots.len() as u32,
            max_tokens: b.max_tokens,
            live_slots: b.slots.iter().filter(|s| s.is_some()).count() as u32,
            granule_bytes: g,
            reserved_bytes: stride * b.slots.len() as u64,
        })
    }

    /// The sequence in slot `idx` of a batch, if any.
    pub fn slot_sequence(&self, bid: BatchId, idx: u32) -> Result<Option<SeqId>> {
        let b = self.batches.get(bid)?;
        match b.slots.get(idx as usize) {
            Some(s) => Ok(*s),
            None => crate::bail!(InvalidArgument, "KV batch {bid:#x}: slot {idx} outside 0..{}", b.slots.len()),
        }
    }

    /// A slot's state. InvalidArgument if `seq` is not a batch slot.
    pub fn slot_info(&self, seq: SeqId) -> Result<SlotInfo> {
        let s = self.seqs.get(seq)?;
        let Some((batch, index)) = s.batch else {
            crate::bail!(InvalidArgument, "KV sequence {seq:#x} is not a slot of a batch");
        };
        let g = self.granule() as u64;
        let lead = s.slots.iter().take_while(|x| !matches!(x, Slot::Dummy)).count() as u64;
        let committed_tokens = (lead * g / s.layout.bytes_per_token()).min(s.max_tokens);
        Ok(SlotInfo { seq: self.sequence_info(seq)?, batch, index, committed_tokens })
    }
}
