//! `EpmKvBatch`: many KV sequences behind one base pointer.
//!
//! A batch is one VA reservation of `max_slots × slot_stride` bytes; slot `s`
//! starts at `base + s × slot_stride`. A slot, once taken, is an ordinary
//! `EpmKvSeq` whose reservation is that piece of the batch: every
//! `epm_kv_seq_*` function applies to it (prepare_append, get_info,
//! declare_tokens, and `epm_kv_prefix_pin` to share its prompt into other
//! slots). The whole range stays mapped for the batch's life — the pool's
//! zeroed dummy granule, read-only, wherever nothing is committed — so a
//! kernel or captured CUDA graph over the whole batch never faults, and a
//! slot's addresses never move when others join, leave or append.
//! docs/KV.md ("Batches") has the model and what a kernel may assume.
//!
//! Lifetimes: a batch handle and its slot handles keep the pool alive. A
//! batch cannot be destroyed while a slot is taken (INVALID_STATE).
//!
//! Threading: every function is safe from any thread; the calls on one pool
//! are serialized by its lock.

use crate::ffi::kv::for_batch::{
    admit, insert_seq, kv_namespace, layout, lock, prefix_of, raw_stream, seq_of, token_ids,
};
use crate::ffi::kv::{EpmKvLayout, EpmKvPool, EpmKvPrefix, EpmKvSeq, PoolObj};
use crate::ffi::prelude::*;
use crate::ffi::stream::EpmStream;
use crate::kv::{BatchId, SlotChoice};

/// A batch reservation: slots at a fixed stride behind one base pointer.
pub struct EpmKvBatch {
    _opaque: [u8; 0],
}

/// What a batch handle holds: its pool and its id there.
pub struct BatchObj {
    pool: Arc<PoolObj>,
    id: BatchId,
}
impl Drop for BatchObj {
    fn drop(&mut self) {
        // Reached when the handle goes without epm_kv_batch_destroy (which
        // destroys first, so this finds the id gone). With slots still taken
        // it fails, and the pool frees the batch when it goes.
        if let Ok(mut a) = lock(&self.pool) {
            let _ = a.destroy_batch(self.id);
        }
    }
}

impl_handle!(EpmKvBatch => BatchObj, tag = 0x43);

/// `slot` argument of the take functions: the lowest free slot.
pub const EPM_KV_BATCH_ANY_SLOT: u32 = 0xFFFF_FFFF;

fn choice(slot: u32) -> SlotChoice {
    if slot == EPM_KV_BATCH_ANY_SLOT { SlotChoice::Any } else { SlotChoice::Index(slot) }
}

/// A batch's layout descriptor, filled by `epm_kv_batch_get_desc`. K/V
/// element `i` of (slot, token, layer, kv, head) lives at
/// `base + slot*slot_stride + token*token_stride + layer*layer_stride +
///  kv*kv_stride + head*head_stride + i*elem_bytes` (kv = 0 for K, 1 for V).
///
/// Versioned by size: set `size = sizeof(EpmKvBatchDesc)`; the smallest size
/// accepted is `EPM_KV_BATCH_DESC_SIZE_V1`. Fields are only ever added at the end.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EpmKvBatchDesc {
    pub size: usize,
    /// Device address of slot 0, token 0 (a `CUdeviceptr` on CUDA); a
    /// multiple of `granule_bytes`.
    pub base: u64,
    /// Bytes from one slot to the next: max_tokens × token_stride rounded up
    /// to the granule (so every slot is granule-aligned).
    pub slot_stride: u64,
    pub max_slots: u32,
    pub layers: u32,
    /// Tokens per slot.
    pub max_tokens: u64,
    pub token_stride: u64,
    pub layer_stride: u64,
    /// Bytes from K to V of the same (layer, token, head).
    pub kv_stride: u64,
    pub head_stride: u64,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Bytes per element (2 for fp16/bf16).
    pub elem_bytes: u32,
    /// Slots taken now.
    pub live_slots: u32,
    pub granule_bytes: u64,
    /// max_slots × slot_stride: the range a kernel may read.
    pub reserved_bytes: u64,
}

/// `sizeof(EpmKvBatchDesc)` in its first published version (frozen).
pub const EPM_KV_BATCH_DESC_SIZE_V1: usize = 104;
versioned!(EpmKvBatchDesc, EPM_KV_BATCH_DESC_SIZE_V1);

/// One slot's state, filled by `epm_kv_batch_slot_get_info`. Versioned by
/// size: set `size = sizeof(EpmKvBatchSlotInfo)`; the smallest size accepted
/// is `EPM_KV_BATCH_SLOT_INFO_SIZE_V1`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EpmKvBatchSlotInfo {
    pub size: usize,
    /// Device address of the slot's token 0: the batch's base + slot × slot_stride.
    pub base: u64,
    /// Tokens made writable so far (shared prefix tokens included).
    pub len_tokens: u64,
    /// Leading tokens whose granules are committed (shared or private):
    /// appending up to here changes no mapping (no host wait, no driver call).
    pub committed_tokens: u64,
    pub max_tokens: u64,
    pub shared_granules: u64,
    pub private_granules: u64,
    pub promised_granules: u64,
    /// The slot's index in its batch.
    pub slot: u32,
    pub max_slots: u32,
}

/// `sizeof(EpmKvBatchSlotInfo)` in its first published version (frozen).
pub const EPM_KV_BATCH_SLOT_INFO_SIZE_V1: usize = 72;
versioned!(EpmKvBatchSlotInfo, EPM_KV_BATCH_SLOT_INFO_SIZE_V1);

/// Create a batch of `max_slots` slots of up to `max_tokens` tokens of
/// `layout` in `pool`. Its whole range (max_slots × slot_stride bytes) maps
/// the pool's zeroed dummy granule read-only until slots commit granules.
/// Charges nothing to the budget: slots are admitted as they are taken.
///
/// Ownership: `*out` is a new handle; destroy it with `epm_kv_batch_destroy`.
/// It keeps the pool alive. NULL: `pool` is INVALID_HANDLE; `layout`, `out`
/// are NULL_POINTER. Errors: INVALID_ARGUMENT (max_tokens or max_slots 0,
/// max_slots EPM_KV_BATCH_ANY_SLOT, a range that overflows, a layout that is
/// not token-major); device errors (VA exhausted).
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_batch_create(
    pool: *mut EpmKvPool,
    layout: *const EpmKvLayout,
    max_tokens: u64,
    max_slots: u32,
    out: *mut *mut EpmKvBatch,
) -> EpmStatus {
    ffi_boundary! {
        let pool = try_handle!(pool);
        let out = try_out!(out);
        let l = self::layout(layout)?;
        let id = lock(&pool)?.create_batch(&l, max_tokens, max_slots)?;
        let obj = Arc::new(BatchObj { pool: pool.clone(), id });
        out.set(handle::insert::<EpmKvBatch>(obj)?);
        Ok(())
    }
}

/// Destroy a batch: unmap its range and free its VA. Refused with
/// INVALID_STATE while any slot is taken (release them first); the handle
/// then stays valid. NULL is a no-op; a destroyed handle is INVALID_HANDLE.
/// The caller guarantees no queued kernel still reads the range.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_batch_destroy(batch: *mut EpmKvBatch) -> EpmStatus {
    ffi_boundary! {
        if batch.is_null() {
            return Ok(());
        }
        let b = try_handle!(batch);
        lock(&b.pool)?.destroy_batch(b.id)?;
        // Destroyed in the pool: the handle goes too (its Drop finds the id gone).
        drop(handle::remove(batch)?);
        Ok(())
    }
}

/// Fill `*out` with the batch's layout descriptor.
///
/// Set `out->size = sizeof(EpmKvBatchDesc)` first; epmem writes at most that
/// many bytes and sets `out->size` to the number written. NULL: `batch` is
/// INVALID_HANDLE, `out` is NULL_POINTER. Errors: INVALID_ARGUMENT for a size
/// below EPM_KV_BATCH_DESC_SIZE_V1.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_batch_get_desc(batch: *mut EpmKvBatch, out: *mut EpmKvBatchDesc) -> EpmStatus {
    ffi_boundary! {
        let b = try_handle!(batch);
        let out = try_out!(out);
        let i = lock(&b.pool)?.batch_info(b.id)?;
        let l = i.layout;
        let v = EpmKvBatchDesc {
            size: 0,
            base: i.base,
            slot_stride: i.slot_stride,
            max_slots: i.max_slots,
            layers: l.shape.layers,
            max_tokens: i.max_tokens,
            token_stride: l.token_stride,
            layer_stride: l.layer_stride,
            kv_stride: l.kv_stride,
            head_stride: l.head_stride,
            kv_heads: l.shape.kv_heads,
            head_dim: l.shape.head_dim,
            elem_bytes: l.shape.elem_bytes,
            live_slots: i.live_slots,
            granule_bytes: i.granule_bytes,
            reserved_bytes: i.reserved_bytes,
        };
        write_versioned(out, v, "EpmKvBatchDesc")
    }
}

/// Take slot `slot` (or the lowest free one: EPM_KV_BATCH_ANY_SLOT) for a
/// new, empty sequence of the batch's layout and max_tokens. Its granules
/// keep mapping the dummy until `epm_kv_seq_prepare_append`; nothing is
/// remapped here, so nothing waits.
///
/// `admit`: EPM_KV_ADMIT_PROMISE or EPM_KV_ADMIT_ON_DEMAND, as for
/// `epm_kv_seq_create`. Ownership: `*out` is a new sequence handle; give the
/// slot back with `epm_kv_batch_release_slot` (or `epm_kv_seq_destroy`).
/// NULL: `batch` is INVALID_HANDLE, `out` is NULL_POINTER. Errors:
/// INVALID_ARGUMENT (slot ≥ max_slots, bad admit mode), INVALID_STATE (the
/// slot is taken), ALL_IN_USE (EPM_KV_BATCH_ANY_SLOT and every slot is
/// taken), OUT_OF_BUDGET (PROMISE and the ledger cannot hold it).
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_batch_take_slot(
    batch: *mut EpmKvBatch,
    slot: u32,
    admit: u32,
    out: *mut *mut EpmKvSeq,
) -> EpmStatus {
    ffi_boundary! {
        let b = try_handle!(batch);
        let out = try_out!(out);
        let mode = self::admit(admit)?;
        let id = lock(&b.pool)?.take_slot(b.id, choice(slot), mode)?;
        insert_seq(&b.pool, id, out)
    }
}

/// Take slot `slot` (or EPM_KV_BATCH_ANY_SLOT) for a sequence whose first
/// `n_tokens` tokens map `prefix` read-only at the slot's start: no copy,
/// and the ledger charges nothing (as `epm_kv_commit_shared_prefix`). The
/// slot's `len` starts at `n_tokens`; its first append into the prefix's
/// boundary granule copies it.
///
/// The slot's dummy mappings are replaced, and a kernel or graph queued on
/// `stream` may be reading them: the host waits for `stream` first. Work on
/// other streams that reads the batch must be ordered before `stream`.
///
/// NULL: `batch`, `prefix`, `stream` are INVALID_HANDLE; `out` is
/// NULL_POINTER. Errors: as `epm_kv_batch_take_slot`, plus INVALID_ARGUMENT
/// if the prefix is of another pool or layout, `n_tokens` is 0 or beyond the
/// prefix or the batch's max_tokens, or the stream is on another device.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_batch_take_shared_slot(
    batch: *mut EpmKvBatch,
    slot: u32,
    prefix: *mut EpmKvPrefix,
    n_tokens: u64,
    admit: u32,
    stream: *mut EpmStream,
    out: *mut *mut EpmKvSeq,
) -> EpmStatus {
    ffi_boundary! {
        let b = try_handle!(batch);
        let prefix = try_handle!(prefix);
        let stream = try_handle!(stream);
        let out = try_out!(out);
        let mode = self::admit(admit)?;
        let (ppool, pid) = prefix_of(&prefix);
        ensure!(Arc::ptr_eq(ppool, &b.pool), InvalidArgument, "the prefix belongs to another KV pool than the batch");
        let raw = raw_stream(&b.pool, stream)?;
        let id = lock(&b.pool)?.take_shared_slot(b.id, choice(slot), pid, n_tokens, mode, raw)?;
        insert_seq(&b.pool, id, out)
    }
}

/// Take slot `slot` (or EPM_KV_BATCH_ANY_SLOT) for a sequence that declares
/// its prompt `tokens[0..n_tokens)`: if a live prefix of the pool begins
/// with the same tokens (whole 16-token blocks, confirmed token by token),
/// its longest match is shared as `epm_kv_batch_take_shared_slot` and
/// `*shared_tokens` says how many tokens are already in the cache (skip their
/// prefill); otherwise the slot is empty and `*shared_tokens` is 0.
///
/// NULL: `tokens` may be NULL only when `n_tokens` is 0; `shared_tokens` may
/// be NULL; `stream` is INVALID_HANDLE. Errors: as
/// `epm_kv_batch_take_shared_slot`, plus INVALID_ARGUMENT if `n_tokens`
/// exceeds the batch's max_tokens. Out-params are written only on success.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_batch_take_slot_for_tokens(
    batch: *mut EpmKvBatch,
    slot: u32,
    tokens: *const u32,
    n_tokens: usize,
    admit: u32,
    stream: *mut EpmStream,
    out: *mut *mut EpmKvSeq,
    shared_tokens: *mut u64,
) -> EpmStatus {
    // The default namespace: the same checks, in the same order.
    epm_kv_batch_take_slot_for_tokens_ns(
        batch,
        slot,
        std::ptr::null(),
        0,
        tokens,
        n_tokens,
        admit,
        stream,
        out,
        shared_tokens,
    )
}

/// As `epm_kv_batch_take_slot_for_tokens`, in the sharing namespace
/// `ns[0..ns_len)` (see `epm_kv_seq_create_for_tokens_ns`): only a prefix
/// pinned from a sequence of the same namespace is shared, and prefixes
/// pinned from the new slot are found only by lookups in it. `ns_len` 0 is
/// the default namespace.
///
/// NULL: `ns` may be NULL only when `ns_len` is 0 (else NULL_POINTER); as
/// `epm_kv_batch_take_slot_for_tokens` otherwise. Errors: as
/// `epm_kv_batch_take_slot_for_tokens`, plus INVALID_ARGUMENT for a
/// namespace longer than EPM_KV_NAMESPACE_MAX_BYTES or containing a NUL
/// byte. Out-params are written only on success.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_batch_take_slot_for_tokens_ns(
    batch: *mut EpmKvBatch,
    slot: u32,
    ns: *const c_char,
    ns_len: usize,
    tokens: *const u32,
    n_tokens: usize,
    admit: u32,
    stream: *mut EpmStream,
    out: *mut *mut EpmKvSeq,
    shared_tokens: *mut u64,
) -> EpmStatus {
    ffi_boundary! {
        let b = try_handle!(batch);
        let stream = try_handle!(stream);
        let out = try_out!(out);
        let mode = self::admit(admit)?;
        let ns = kv_namespace(ns, ns_len)?;
        let toks = token_ids(tokens, n_tokens)?;
        let shared_out = if shared_tokens.is_null() { None } else { Some(try_out!(shared_tokens)) };
        let raw = raw_stream(&b.pool, stream)?;
        let (id, shared) = lock(&b.pool)?.take_slot_for_tokens_in(&ns, b.id, choice(slot), toks, mode, raw)?;
        insert_seq(&b.pool, id, out)?;
        if let Some(o) = shared_out {
            o.set(shared);
        }
        Ok(())
    }
}

/// Give a slot back to its batch: the host waits for `stream` (a kernel or
/// graph queued there may still read the slot), the dummy is mapped back
/// over the slot's granules, the granules return to the pool (the ledger is
/// credited for those nobody else maps) and the unused promise is returned.
/// The slot reads zeros again and may be taken by a new sequence; every other
/// slot keeps its addresses and bytes. The handle is invalid from now on.
///
/// A slot that committed nothing releases without waiting. NULL: `seq`,
/// `stream` are INVALID_HANDLE. Errors: INVALID_ARGUMENT if `seq` is not a
/// batch slot or the stream is on another device; a destroyed handle is
/// INVALID_HANDLE. (`epm_kv_seq_destroy` also releases a slot, without the
/// wait: like cuMemFree, the caller then guarantees nothing queued reads it.)
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_batch_release_slot(seq: *mut EpmKvSeq, stream: *mut EpmStream) -> EpmStatus {
    ffi_boundary! {
        let s = try_handle!(seq);
        let stream = try_handle!(stream);
        let (pool, id) = seq_of(&s);
        let raw = raw_stream(pool, stream)?;
        let r = lock(pool)?.release_slot(id, raw);
        // Once the pool has let the sequence go (released, or a device error
        // part-way through its teardown) the handle goes too; a refusal
        // (not a slot, a failed wait) leaves both usable.
        if lock(pool).is_ok_and(|a| a.sequence_info(id).is_err()) {
            drop(handle::remove(seq)?);
        }
        r
    }
}

/// Fill `*out` with a slot's state and index.
///
/// Set `out->size = sizeof(EpmKvBatchSlotInfo)` first. NULL: `seq` is
/// INVALID_HANDLE, `out` is NULL_POINTER. Errors: INVALID_ARGUMENT if `seq`
/// is not a batch slot, or for a size below EPM_KV_BATCH_SLOT_INFO_SIZE_V1.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_batch_slot_get_info(seq: *mut EpmKvSeq, out: *mut EpmKvBatchSlotInfo) -> EpmStatus {
    ffi_boundary! {
        let s = try_handle!(seq);
        let out = try_out!(out);
        let (pool, id) = seq_of(&s);
        let a = lock(pool)?;
        let i = a.slot_info(id)?;
        let max_slots = a.batch_info(i.batch)?.max_slots;
        drop(a);
        let v = EpmKvBatchSlotInfo {
            size: 0,
            base: i.seq.base,
            len_tokens: i.seq.len_tokens,
            committed_tokens: i.committed_tokens,
            max_tokens: i.seq.max_tokens,
            shared_granules: i.seq.shared_granules,
            private_granules: i.seq.private_granules,
            promised_granules: i.seq.promised_granules,
            slot: i.index,
            max_slots,
        };
        write_versioned(out, v, "EpmKvBatchSlotInfo")
    }
}
