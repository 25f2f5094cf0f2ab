//! `EpmKvPool`, `EpmKvSeq`, `EpmKvPrefix`: the KV pool with prefix sharing.
//!
//! A KV pool owns a granule pool, a ledger with a budget and one read-only
//! dummy granule. A sequence is one token-major VA reservation; a prefix is a
//! pin on a sequence's first tokens, mapped read-only into new sequences at
//! offset 0 (the Nth sharer costs 0 owned bytes). docs/KV.md has the model.
//!
//! Lifetimes: a sequence or prefix handle keeps its pool alive, so C may
//! destroy handles in any order. Destroying a sequence handle destroys the
//! sequence; unpinning a prefix handle ends the handle (the prefix itself
//! lives on while sequences still share it). Any later use of either handle
//! is `EPM_STATUS_INVALID_HANDLE`.
//!
//! Threading: every function is safe from any thread; the calls on one pool
//! are serialized by a lock (prepare_append may hold it while the host waits
//! for the caller's stream, see `epm_kv_seq_prepare_append`).

use std::sync::{Mutex, MutexGuard};

use crate::device::{Device, RawStream, Stream};
use crate::ffi::device::EpmDevice;
pub use crate::ffi::kv_stats::EpmKvStats;
use crate::ffi::kv_stats::stats_to_c;
use crate::ffi::prelude::*;
use crate::ffi::stream::{EpmStream, same_device};
use crate::kv::{self, AdmitMode, KvConfig, KvLayout, KvPool, KvShape, Namespace, PrefixId, SeqId};

/// A KV pool: granule pool, ledger (budget) and dummy granule.
pub struct EpmKvPool {
    _opaque: [u8; 0],
}
/// A sequence: one token-major VA reservation.
pub struct EpmKvSeq {
    _opaque: [u8; 0],
}
/// A pinned shared prefix.
pub struct EpmKvPrefix {
    _opaque: [u8; 0],
}

/// What the pool handle holds.
pub struct PoolObj {
    dev: Arc<dyn Device>,
    pool: Mutex<KvPool>,
}
impl PoolObj {
    /// The pool, or INVALID_STATE once a call panicked while holding it: its
    /// books are updated step by step, so after a panic they may disagree
    /// with the mappings. Every handle of the pool (the pool's, its
    /// sequences', its prefixes') answers so from then on, not only the one
    /// whose call panicked (which the handle table poisons).
    pub(crate) fn lock(&self) -> Result<MutexGuard<'_, KvPool>> {
        self.pool.lock().map_err(|_| {
            Error::new(
                EpmStatus::InvalidState,
                "the KV pool is poisoned by an earlier panic inside a call using it \
                 (that call returned EPM_STATUS_PANIC); destroy its sequences, prefixes and pool",
            )
        })
    }
}

/// What a sequence handle holds: its pool and its id there.
pub struct SeqObj {
    pool: Arc<PoolObj>,
    id: SeqId,
}
impl Drop for SeqObj {
    fn drop(&mut self) {
        // Reached only if the handle was never destroyed explicitly (the
        // explicit path destroys first and this finds the id gone).
        // A poisoned pool is left alone: tearing down on inconsistent books
        // could unmap what another sequence still maps.
        if let Ok(mut a) = self.pool.lock() {
            let _ = a.destroy_sequence(self.id);
        }
    }
}

/// What a prefix handle holds: its pool and its id there.
pub struct PrefixObj {
    pool: Arc<PoolObj>,
    id: PrefixId,
}
impl Drop for PrefixObj {
    fn drop(&mut self) {
        if let Ok(mut a) = self.pool.lock() {
            let _ = a.unpin_prefix(self.id);
        }
    }
}

impl_handle!(EpmKvPool => PoolObj, tag = 0x40);
impl_handle!(EpmKvSeq => SeqObj, tag = 0x41);
impl_handle!(EpmKvPrefix => PrefixObj, tag = 0x42);

/// Promise a sequence's worst-case private granules at creation (refused
/// with OUT_OF_BUDGET if the ledger cannot hold them); appends never fail
/// for budget afterwards.
pub const EPM_KV_ADMIT_PROMISE: u32 = 0;
/// Promise nothing; `epm_kv_seq_prepare_append` may fail with OUT_OF_BUDGET.
pub const EPM_KV_ADMIT_ON_DEMAND: u32 = 1;

fn admit_mode(v: u32) -> Result<AdmitMode> {
    match v {
        EPM_KV_ADMIT_PROMISE => Ok(AdmitMode::Promise),
        EPM_KV_ADMIT_ON_DEMAND => Ok(AdmitMode::OnDemand),
        other => {
            bail!(InvalidArgument, "admit mode {other} is not EPM_KV_ADMIT_PROMISE (0) or EPM_KV_ADMIT_ON_DEMAND (1)")
        }
    }
}

/// Where K and V of (layer, token, head) live, relative to a sequence's
/// base address: `token * token_stride + layer * layer_stride +
/// kv * kv_stride + head * head_stride + i * elem_bytes` (kv = 0 for K, 1 for
/// V; element i < head_dim). Token-major: a token's bytes of every layer lie
/// within one `token_stride`, so a prefix of all layers is one range.
///
/// Versioned by size: set `size = sizeof(EpmKvLayout)`. Fields are only ever
/// added at the end.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EpmKvLayout {
    pub size: usize,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Bytes per element (2 for fp16/bf16).
    pub elem_bytes: u32,
    /// Bytes per token in the reservation (layers × 2 × kv_heads × head_dim × elem_bytes when dense).
    pub token_stride: u64,
    pub layer_stride: u64,
    /// Bytes from K to V of the same (layer, token, head).
    pub kv_stride: u64,
    pub head_stride: u64,
}

/// `sizeof(EpmKvLayout)` in its first published version (epmem 0.1): the
/// smallest `size` ever accepted. Frozen; see docs/ABI.md.
pub const EPM_KV_LAYOUT_SIZE_V1: usize = 56;
/// `sizeof(EpmKvStats)` in its first published version. Frozen.
pub const EPM_KV_STATS_SIZE_V1: usize = 176;
/// `sizeof(EpmKvSeqInfo)` in its first published version. Frozen.
pub const EPM_KV_SEQ_INFO_SIZE_V1: usize = 112;
/// `sizeof(EpmKvPrefixInfo)` in its first published version. Frozen.
pub const EPM_KV_PREFIX_INFO_SIZE_V1: usize = 40;
/// `sizeof(EpmKvAdmission)` in its first published version. Frozen.
pub const EPM_KV_ADMISSION_SIZE_V1: usize = 32;
/// `sizeof(EpmKvRequestCost)` in its first published version. Frozen.
pub const EPM_KV_REQUEST_COST_SIZE_V1: usize = 32;
versioned!(input EpmKvLayout, EPM_KV_LAYOUT_SIZE_V1);
versioned!(EpmKvStats, EPM_KV_STATS_SIZE_V1);
versioned!(EpmKvSeqInfo, EPM_KV_SEQ_INFO_SIZE_V1);
versioned!(EpmKvPrefixInfo, EPM_KV_PREFIX_INFO_SIZE_V1);
versioned!(EpmKvAdmission, EPM_KV_ADMISSION_SIZE_V1);
versioned!(EpmKvRequestCost, EPM_KV_REQUEST_COST_SIZE_V1);

fn layout_to_c(l: &KvLayout) -> EpmKvLayout {
    EpmKvLayout {
        size: std::mem::size_of::<EpmKvLayout>(),
        layers: l.shape.layers,
        kv_heads: l.shape.kv_heads,
        head_dim: l.shape.head_dim,
        elem_bytes: l.shape.elem_bytes,
        token_stride: l.token_stride,
        layer_stride: l.layer_stride,
        kv_stride: l.kv_stride,
        head_stride: l.head_stride,
    }
}

/// Read and validate a caller's layout.
fn layout_from_c(p: *const EpmKvLayout) -> Result<KvLayout> {
    // Fields a later version appends default to 0 (absent) for an older
    // caller; every field of the first version is always present.
    let zero = EpmKvLayout {
        size: 0,
        layers: 0,
        kv_heads: 0,
        head_dim: 0,
        elem_bytes: 0,
        token_stride: 0,
        layer_stride: 0,
        kv_stride: 0,
        head_stride: 0,
    };
    let c = read_versioned(p, zero, "layout")?;
    let l = KvLayout {
        shape: KvShape { layers: c.layers, kv_heads: c.kv_heads, head_dim: c.head_dim, elem_bytes: c.elem_bytes },
        token_stride: c.token_stride,
        layer_stride: c.layer_stride,
        kv_stride: c.kv_stride,
        head_stride: c.head_stride,
    };
    l.validate()?;
    Ok(l)
}

/// Token ids from C: NULL is allowed only with `n == 0`.
fn tokens<'a>(p: *const u32, n: usize) -> Result<&'a [u32]> {
    if n == 0 {
        return Ok(&[]);
    }
    ensure!(!p.is_null(), NullPointer, "argument `tokens` is NULL with n_tokens = {n}");
    ensure!(n <= isize::MAX as usize / 4, InvalidArgument, "n_tokens {n} is too large");
    // SAFETY: non-NULL; the caller promises `n` readable u32s for the call.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// The longest namespace the `*_ns` functions accept, in bytes.
pub const EPM_KV_NAMESPACE_MAX_BYTES: usize = 128;
const _: () = assert!(EPM_KV_NAMESPACE_MAX_BYTES == Namespace::MAX_BYTES);

/// A namespace from `(ns, ns_len)`: NULL with 0 is the default namespace.
fn namespace(ns: *const c_char, ns_len: usize) -> Result<Namespace> {
    if ns_len == 0 {
        return Ok(Namespace::default());
    }
    ensure!(!ns.is_null(), NullPointer, "argument `ns` is NULL with ns_len = {ns_len}");
    ensure!(
        ns_len <= EPM_KV_NAMESPACE_MAX_BYTES,
        InvalidArgument,
        "argument `ns_len` is {ns_len} bytes; a KV namespace is at most EPM_KV_NAMESPACE_MAX_BYTES ({EPM_KV_NAMESPACE_MAX_BYTES}) bytes"
    );
    // SAFETY: non-NULL; the caller promises `ns_len` readable bytes for the call
    // (at most EPM_KV_NAMESPACE_MAX_BYTES, checked above).
    let bytes = unsafe { std::slice::from_raw_parts(ns.cast::<u8>(), ns_len) };
    Namespace::new(bytes)
}

fn stream_of(pool: &PoolObj, stream: Arc<Stream>) -> Result<RawStream> {
    same_device(&pool.dev, stream.device(), "the pool and the stream")?;
    Ok(stream.raw())
}

/// Register a sequence the pool just made. If that fails, dropping `obj`
/// destroys the sequence again, so nothing leaks.
fn new_seq(pool: &Arc<PoolObj>, id: SeqId, out: OutParam<'_, *mut EpmKvSeq>) -> Result<()> {
    let obj = Arc::new(SeqObj { pool: pool.clone(), id });
    out.set(handle::insert::<EpmKvSeq>(obj)?);
    Ok(())
}

/// Fill `*out` with the dense token-major layout of a model:
/// [token][layer][K,V][head][head_dim]. E.g. qwen14b (48, 8, 128, 2) has
/// 196,608 bytes per token.
///
/// Versioned: set `out->size = sizeof(EpmKvLayout)` first; epmem writes at
/// most that many bytes and sets `out->size` to the number written.
/// NULL: `out` is NULL_POINTER. Errors: INVALID_ARGUMENT for a zero
/// dimension, an overflow, or `out->size` below `EPM_KV_LAYOUT_SIZE_V1`.
/// `*out` is written only on success. Threading: pure.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_layout_token_major(
    layers: u32,
    kv_heads: u32,
    head_dim: u32,
    elem_bytes: u32,
    out: *mut EpmKvLayout,
) -> EpmStatus {
    ffi_boundary! {
        let out = try_out!(out);
        let l = KvLayout::token_major(KvShape { layers, kv_heads, head_dim, elem_bytes })?;
        write_versioned(out, layout_to_c(&l), "out")
    }
}

/// Create a KV pool on `dev` with a budget of `budget_bytes` physical bytes.
/// The pool's dummy granule (one granule, zeroed) is charged to the budget,
/// so it must hold at least one granule.
///
/// Ownership: `*out` is a new handle; destroy it with `epm_kv_pool_destroy`.
/// It keeps `dev` alive. NULL: `dev` is INVALID_HANDLE, `out` is
/// NULL_POINTER. Errors: OUT_OF_BUDGET if the budget is below one granule;
/// device errors.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_pool_create(dev: *mut EpmDevice, budget_bytes: u64, out: *mut *mut EpmKvPool) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let out = try_out!(out);
        let pool = KvPool::new(&dev, KvConfig::new(budget_bytes))?;
        out.set(handle::insert::<EpmKvPool>(Arc::new(PoolObj { dev, pool: Mutex::new(pool) }))?);
        Ok(())
    }
}

/// Release the pool handle. NULL is a no-op. Sequences and prefixes still
/// held keep the pool alive; it is torn down (unmap → release → free VA)
/// when the last of them is destroyed. The caller guarantees no queued
/// kernel still touches its sequences by then.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_pool_destroy(pool: *mut EpmKvPool) -> EpmStatus {
    ffi_boundary! {
        handle::destroy(pool)
    }
}

/// Fill `*out` with the pool's ledger and counters.
///
/// Set `out->size = sizeof(EpmKvStats)` first; epmem writes at most that many
/// bytes and sets `out->size` to the number written. NULL: `pool` is
/// INVALID_HANDLE, `out` is NULL_POINTER. Errors: INVALID_ARGUMENT for a size
/// below the first version's.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_pool_get_stats(pool: *mut EpmKvPool, out: *mut EpmKvStats) -> EpmStatus {
    ffi_boundary! {
        let pool = try_handle!(pool);
        let out = try_out!(out);
        let s = pool.lock()?.stats();
        let v = stats_to_c(&s);
        write_versioned(out, v, "EpmKvStats")
    }
}

/// Create a sequence of up to `max_tokens` tokens of `layout`. Its whole
/// reservation (max_tokens × token_stride, rounded up to the granule) maps
/// the pool's zeroed dummy granule read-only until `prepare_append`.
///
/// `admit`: EPM_KV_ADMIT_PROMISE or EPM_KV_ADMIT_ON_DEMAND. Ownership: `*out`
/// is a new handle; destroy it with `epm_kv_seq_destroy`. NULL: `pool` is
/// INVALID_HANDLE; `layout`, `out` are NULL_POINTER. Errors: INVALID_ARGUMENT
/// (max_tokens 0 or overflowing, a layout that is not token-major, a bad
/// admit mode); OUT_OF_BUDGET (PROMISE and the ledger cannot hold it).
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_seq_create(
    pool: *mut EpmKvPool,
    layout: *const EpmKvLayout,
    max_tokens: u64,
    admit: u32,
    out: *mut *mut EpmKvSeq,
) -> EpmStatus {
    ffi_boundary! {
        let pool = try_handle!(pool);
        let out = try_out!(out);
        let l = layout_from_c(layout)?;
        let mode = admit_mode(admit)?;
        let id = pool.lock()?.create_sequence(&l, max_tokens, mode)?;
        new_seq(&pool, id, out)
    }
}

/// Create a sequence that declares its prompt `tokens[0..n_tokens)`. If a
/// live prefix (pinned from a sequence that declared the same leading
/// tokens, compared in whole blocks of 16 tokens and then token by token)
/// exists, its longest match is shared read-only at offset 0, exactly as
/// `epm_kv_commit_shared_prefix`, and `*shared_tokens` says how many tokens
/// are already in the cache (skip their prefill). Otherwise it is a plain
/// sequence and `*shared_tokens` is 0.
///
/// NULL: `tokens` may be NULL only when `n_tokens` is 0; `shared_tokens` may
/// be NULL. Errors: as `epm_kv_seq_create`, plus INVALID_ARGUMENT if
/// `n_tokens > max_tokens`. Out-params are written only on success.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_seq_create_for_tokens(
    pool: *mut EpmKvPool,
    layout: *const EpmKvLayout,
    max_tokens: u64,
    tokens: *const u32,
    n_tokens: usize,
    admit: u32,
    out: *mut *mut EpmKvSeq,
    shared_tokens: *mut u64,
) -> EpmStatus {
    // The default namespace: the same checks, in the same order.
    epm_kv_seq_create_for_tokens_ns(
        pool,
        layout,
        max_tokens,
        std::ptr::null(),
        0,
        tokens,
        n_tokens,
        admit,
        out,
        shared_tokens,
    )
}

/// As `epm_kv_seq_create_for_tokens`, in the sharing namespace `ns[0..ns_len)`
/// (a per-tenant cache salt: opaque bytes, no NUL, at most
/// EPM_KV_NAMESPACE_MAX_BYTES). Only a prefix pinned from a sequence of the
/// same namespace is found and shared, and prefixes later pinned from the new
/// sequence are found only by lookups in it, so one tenant never learns from
/// its admission cost or time to first token that another sent the same
/// prompt. `ns_len` 0 is the default namespace, the one
/// `epm_kv_seq_create_for_tokens` uses. Explicit sharing
/// (`epm_kv_commit_shared_prefix`) ignores namespaces; its sequence joins
/// the prefix's.
///
/// NULL: `ns` may be NULL only when `ns_len` is 0 (else NULL_POINTER); as
/// `epm_kv_seq_create_for_tokens` otherwise. Errors: as
/// `epm_kv_seq_create_for_tokens`, plus INVALID_ARGUMENT for a namespace
/// longer than EPM_KV_NAMESPACE_MAX_BYTES or containing a NUL byte.
/// Out-params are written only on success.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_seq_create_for_tokens_ns(
    pool: *mut EpmKvPool,
    layout: *const EpmKvLayout,
    max_tokens: u64,
    ns: *const c_char,
    ns_len: usize,
    tokens: *const u32,
    n_tokens: usize,
    admit: u32,
    out: *mut *mut EpmKvSeq,
    shared_tokens: *mut u64,
) -> EpmStatus {
    ffi_boundary! {
        let pool = try_handle!(pool);
        let out = try_out!(out);
        let l = layout_from_c(layout)?;
        let mode = admit_mode(admit)?;
        let ns = namespace(ns, ns_len)?;
        let toks = self::tokens(tokens, n_tokens)?;
        let shared_out = if shared_tokens.is_null() { None } else { Some(try_out!(shared_tokens)) };
        let (id, shared) = pool.lock()?.create_sequence_for_tokens_in(&ns, &l, max_tokens, toks, mode)?;
        new_seq(&pool, id, out)?;
        if let Some(o) = shared_out {
            o.set(shared);
        }
        Ok(())
    }
}

/// Destroy a sequence: unmap its slots, drop its granule references (the
/// ledger is credited for granules nobody else maps), return its unused
/// promise, free its VA. NULL is a no-op; a destroyed handle is
/// INVALID_HANDLE. The caller guarantees no queued kernel still touches the
/// sequence (as with cuMemFree).
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_seq_destroy(seq: *mut EpmKvSeq) -> EpmStatus {
    ffi_boundary! {
        match handle::remove(seq)? {
            Some(obj) => {
                let r = obj.pool.lock()?.destroy_sequence(obj.id);
                drop(obj); // after the lock: its Drop finds the id gone
                r
            }
            None => Ok(()),
        }
    }
}

/// A sequence's layout and state, filled by `epm_kv_seq_get_info`.
/// Versioned by size: set `size = sizeof(EpmKvSeqInfo)`.
///
/// The layout's fields are copied in flat (the same names and meanings as
/// `EpmKvLayout`) rather than embedding an `EpmKvLayout`: a versioned struct
/// embedded by value would shift every later field when it grows. A field
/// added to `EpmKvLayout` later is appended here too.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EpmKvSeqInfo {
    pub size: usize,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub elem_bytes: u32,
    pub token_stride: u64,
    pub layer_stride: u64,
    pub kv_stride: u64,
    pub head_stride: u64,
    /// Device address of token 0 (a `CUdeviceptr` on CUDA).
    pub base: u64,
    pub max_tokens: u64,
    /// Tokens made writable so far (shared prefix tokens included).
    pub len_tokens: u64,
    /// VA reserved: max_tokens × token_stride rounded up to the granule.
    pub reserved_bytes: u64,
    pub shared_granules: u64,
    pub private_granules: u64,
    pub promised_granules: u64,
}

/// Fill `*out` with the sequence's layout descriptor, base address and state.
///
/// Set `out->size = sizeof(EpmKvSeqInfo)` first. NULL: `seq` is
/// INVALID_HANDLE, `out` is NULL_POINTER.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_seq_get_info(seq: *mut EpmKvSeq, out: *mut EpmKvSeqInfo) -> EpmStatus {
    ffi_boundary! {
        let seq = try_handle!(seq);
        let out = try_out!(out);
        let i = seq.pool.lock()?.sequence_info(seq.id)?;
        let l = &i.layout;
        let v = EpmKvSeqInfo {
            size: 0,
            layers: l.shape.layers,
            kv_heads: l.shape.kv_heads,
            head_dim: l.shape.head_dim,
            elem_bytes: l.shape.elem_bytes,
            token_stride: l.token_stride,
            layer_stride: l.layer_stride,
            kv_stride: l.kv_stride,
            head_stride: l.head_stride,
            base: i.base,
            max_tokens: i.max_tokens,
            len_tokens: i.len_tokens,
            reserved_bytes: i.reserved_bytes,
            shared_granules: i.shared_granules,
            private_granules: i.private_granules,
            promised_granules: i.promised_granules,
        };
        write_versioned(out, v, "EpmKvSeqInfo")
    }
}

/// Make the granules that tokens `[len, len + n_tokens)` fall in private and
/// read-write, so the caller's next kernel on `stream` may write them, and
/// advance `len`. Call it before launching the kernel that writes them.
///
/// A granule that is already private costs nothing (no driver call, no
/// wait). Otherwise the host waits for the work queued on `stream` so far
/// (mappings are not stream-ordered: a kernel still reading the old mapping
/// would fault), then maps a pooled granule read-write; a shared boundary
/// granule is copied on write by a D2D copy queued on `stream`, which the
/// caller's later kernels on `stream` are ordered after. Work on other
/// streams that touches the sequence must be ordered before `stream`.
///
/// NULL: `seq`, `stream` are INVALID_HANDLE. Errors: INVALID_ARGUMENT if
/// `len + n_tokens > max_tokens` or the stream is on another device;
/// OUT_OF_BUDGET (checked before any mapping changes) for an on-demand
/// sequence the ledger cannot hold; device errors. `n_tokens` 0 is a no-op.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_seq_prepare_append(seq: *mut EpmKvSeq, n_tokens: u64, stream: *mut EpmStream) -> EpmStatus {
    ffi_boundary! {
        let seq = try_handle!(seq);
        let stream = try_handle!(stream);
        let raw = stream_of(&seq.pool, stream)?;
        seq.pool.lock()?.prepare_append(seq.id, n_tokens, raw)
    }
}

/// Declare more of a sequence's token ids (appended to those declared at
/// creation), so a prefix later pinned from it can be found by content.
///
/// NULL: `tokens` may be NULL only when `n_tokens` is 0. Errors:
/// INVALID_ARGUMENT if the declared tokens would exceed max_tokens.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_seq_declare_tokens(seq: *mut EpmKvSeq, tokens: *const u32, n_tokens: usize) -> EpmStatus {
    ffi_boundary! {
        let seq = try_handle!(seq);
        let toks = self::tokens(tokens, n_tokens)?;
        seq.pool.lock()?.declare_tokens(seq.id, toks)
    }
}

/// Pin the first `n_tokens` tokens of `seq` (its full granules plus the
/// partial boundary granule) as a shared prefix. They turn read-only in
/// `seq` too, so its next append into the boundary granule copies it. The
/// host waits for `stream` first (access changes are not stream-ordered).
///
/// Ownership: `*out` is the pin; end it with `epm_kv_prefix_unpin`. A pinned
/// prefix is never reclaimed; it is freed when the pin and its last sharer
/// are gone. NULL: `seq`, `stream` are INVALID_HANDLE, `out` is NULL_POINTER.
/// Errors: INVALID_ARGUMENT if `n_tokens` is 0 or beyond the tokens prepared;
/// OUT_OF_BUDGET if `seq` was admitted with PROMISE, will copy its boundary
/// granule, and the ledger cannot promise that one more granule.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_prefix_pin(
    seq: *mut EpmKvSeq,
    n_tokens: u64,
    stream: *mut EpmStream,
    out: *mut *mut EpmKvPrefix,
) -> EpmStatus {
    ffi_boundary! {
        let seq = try_handle!(seq);
        let stream = try_handle!(stream);
        let out = try_out!(out);
        let raw = stream_of(&seq.pool, stream)?;
        let id = seq.pool.lock()?.pin_prefix(seq.id, n_tokens, raw)?;
        let obj = Arc::new(PrefixObj { pool: seq.pool.clone(), id });
        out.set(handle::insert::<EpmKvPrefix>(obj)?);
        Ok(())
    }
}

/// End a pin. The prefix is freed now if no sequence shares it, else with
/// its last sharer; the handle is invalid from now on. NULL is a no-op; an
/// unpinned handle is INVALID_HANDLE.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_prefix_unpin(prefix: *mut EpmKvPrefix) -> EpmStatus {
    ffi_boundary! {
        match handle::remove(prefix)? {
            Some(obj) => {
                let r = obj.pool.lock()?.unpin_prefix(obj.id);
                drop(obj); // after the lock: its Drop finds the id gone
                r
            }
            None => Ok(()),
        }
    }
}

/// A prefix's state, filled by `epm_kv_prefix_get_info`. Versioned by size.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EpmKvPrefixInfo {
    pub size: usize,
    pub n_tokens: u64,
    pub granules: u64,
    /// Sequences mapping the prefix (its origin included while it has not diverged past it).
    pub sharers: u32,
    pub pinned: bool,
    /// A read-only view of the prefix (token 0 at this device address).
    pub view_base: u64,
}

/// Fill `*out` with the prefix's state. Set `out->size` first. NULL:
/// `prefix` is INVALID_HANDLE, `out` is NULL_POINTER.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_prefix_get_info(prefix: *mut EpmKvPrefix, out: *mut EpmKvPrefixInfo) -> EpmStatus {
    ffi_boundary! {
        let prefix = try_handle!(prefix);
        let out = try_out!(out);
        let i = prefix.pool.lock()?.prefix_info(prefix.id)?;
        let v = EpmKvPrefixInfo {
            size: 0,
            n_tokens: i.n_tokens,
            granules: i.granules,
            sharers: i.sharers,
            pinned: i.pinned,
            view_base: i.view_base,
        };
        write_versioned(out, v, "EpmKvPrefixInfo")
    }
}

/// Create a sequence of up to `max_tokens` tokens whose first `n_tokens`
/// tokens map the prefix read-only at offset 0: no copy, and the ledger
/// charges nothing (the Nth sharer costs 0 owned bytes). The rest maps the
/// dummy. The sequence's `len` starts at `n_tokens`.
///
/// Ownership: `*out` is a new sequence handle. NULL: `prefix` is
/// INVALID_HANDLE, `out` is NULL_POINTER. Errors: INVALID_ARGUMENT if
/// `n_tokens` is 0 or beyond the prefix, or `max_tokens < n_tokens`;
/// OUT_OF_BUDGET (PROMISE) if the ledger cannot promise its private granules.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_commit_shared_prefix(
    prefix: *mut EpmKvPrefix,
    n_tokens: u64,
    max_tokens: u64,
    admit: u32,
    out: *mut *mut EpmKvSeq,
) -> EpmStatus {
    ffi_boundary! {
        let prefix = try_handle!(prefix);
        let out = try_out!(out);
        let mode = admit_mode(admit)?;
        let id = prefix.pool.lock()?.commit_shared_prefix(prefix.id, n_tokens, max_tokens, mode)?;
        new_seq(&prefix.pool, id, out)
    }
}

/// How many leading tokens of `tokens` a live prefix of `layout` already
/// holds (whole 16-token blocks, confirmed token by token); 0 if none.
///
/// NULL: `tokens` may be NULL only when `n_tokens` is 0; `out` is
/// NULL_POINTER. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_find_prefix(
    pool: *mut EpmKvPool,
    layout: *const EpmKvLayout,
    tokens: *const u32,
    n_tokens: usize,
    out: *mut u64,
) -> EpmStatus {
    // The default namespace: the same checks, in the same order.
    epm_kv_find_prefix_ns(pool, layout, std::ptr::null(), 0, tokens, n_tokens, out)
}

/// As `epm_kv_find_prefix`, among the prefixes of namespace `ns[0..ns_len)`
/// only (see `epm_kv_seq_create_for_tokens_ns`; `ns_len` 0 is the default
/// namespace).
///
/// NULL: `ns` may be NULL only when `ns_len` is 0, `tokens` only when
/// `n_tokens` is 0; `out` is NULL_POINTER. Errors: INVALID_ARGUMENT for a
/// namespace longer than EPM_KV_NAMESPACE_MAX_BYTES or containing NUL.
/// Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_find_prefix_ns(
    pool: *mut EpmKvPool,
    layout: *const EpmKvLayout,
    ns: *const c_char,
    ns_len: usize,
    tokens: *const u32,
    n_tokens: usize,
    out: *mut u64,
) -> EpmStatus {
    ffi_boundary! {
        let pool = try_handle!(pool);
        let out = try_out!(out);
        let l = layout_from_c(layout)?;
        let ns = namespace(ns, ns_len)?;
        let toks = self::tokens(tokens, n_tokens)?;
        let found = pool.lock()?.find_prefix_in(&ns, &l, toks).map_or(0, |(_, m)| m);
        out.set(found);
        Ok(())
    }
}

/// Admissible concurrency, filled by `epm_kv_admissible`. Versioned by size.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EpmKvAdmission {
    pub size: usize,
    /// floor(B / (P + Q)): every request holds its own copy of the prefix.
    pub without_sharing: u64,
    /// floor((B − P) / Q): one physical prefix plus Q private bytes per request.
    pub with_sharing: u64,
    /// 1 + floor((B − P) / Q), a common shorthand that admits one more than
    /// fits (kept so callers can compare). Rust calls it
    /// `over_admitting_formula`; this published field keeps its first name
    /// (docs/CONCEPTS.md).
    pub seed_formula: u64,
}

/// Admissible concurrency for a budget `budget_bytes`, a shared prefix of
/// `prefix_bytes` and `private_bytes` per request (pure arithmetic; use
/// `epm_kv_request_cost` for granule-rounded P and Q of a layout).
///
/// Set `out->size` first. NULL: `out` is NULL_POINTER. A `private_bytes` of
/// 0 saturates to UINT64_MAX.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_admissible(
    budget_bytes: u64,
    prefix_bytes: u64,
    private_bytes: u64,
    out: *mut EpmKvAdmission,
) -> EpmStatus {
    ffi_boundary! {
        let out = try_out!(out);
        let a = kv::admissible(budget_bytes, prefix_bytes, private_bytes);
        let v = EpmKvAdmission { size: 0, without_sharing: a.without_sharing, with_sharing: a.with_sharing, seed_formula: a.over_admitting_formula };
        write_versioned(out, v, "EpmKvAdmission")
    }
}

/// Granule-rounded physical cost of a request, filled by `epm_kv_request_cost`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EpmKvRequestCost {
    pub size: usize,
    /// Granule bytes of the shared prefix (full granules plus the boundary): P.
    pub prefix_bytes: u64,
    /// Granule bytes one sharer owns, its boundary copy included: Q.
    pub private_bytes: u64,
    /// Granule bytes of the same request without sharing.
    pub unshared_bytes: u64,
}

/// The physical cost of a request of `max_tokens` tokens of `layout` whose
/// first `prefix_tokens` are shared, on this pool's granule.
///
/// Set `out->size` first. NULL: `pool` is INVALID_HANDLE; `layout`, `out`
/// are NULL_POINTER. Errors: INVALID_ARGUMENT if `prefix_tokens >
/// max_tokens` or the request's bytes overflow 64 bits.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_request_cost(
    pool: *mut EpmKvPool,
    layout: *const EpmKvLayout,
    prefix_tokens: u64,
    max_tokens: u64,
    out: *mut EpmKvRequestCost,
) -> EpmStatus {
    ffi_boundary! {
        let pool = try_handle!(pool);
        let out = try_out!(out);
        let l = layout_from_c(layout)?;
        let g = pool.dev.vmm_granularity() as u64;
        // Refused rather than saturated: granule rounding of a saturated
        // byte count wraps to 0 (test_misuse_kv.c found max_tokens = UINT64_MAX
        // reported as costing nothing).
        ensure!(prefix_tokens <= max_tokens, InvalidArgument, "prefix_tokens {prefix_tokens} > max_tokens {max_tokens}");
        ensure!(
            max_tokens.checked_mul(l.bytes_per_token()).and_then(|b| b.checked_next_multiple_of(g)).is_some(),
            InvalidArgument,
            "{max_tokens} tokens of {} bytes overflow 64 bits",
            l.bytes_per_token()
        );
        let c = kv::request_cost(&l, g, prefix_tokens, max_tokens);
        let v = EpmKvRequestCost { size: 0, prefix_bytes: c.prefix_bytes, private_bytes: c.private_bytes, unshared_bytes: c.unshared_bytes };
        write_versioned(out, v, "EpmKvRequestCost")
    }
}

/// What `src/ffi/kv_batch.rs` shares with this file: a batch slot is an
/// `EpmKvSeq`, so the batch functions build and read sequence handles.
pub(crate) mod for_batch {
    use super::*;

    pub(crate) fn lock(a: &PoolObj) -> Result<MutexGuard<'_, KvPool>> {
        a.lock()
    }
    pub(crate) fn seq_of(s: &SeqObj) -> (&Arc<PoolObj>, SeqId) {
        (&s.pool, s.id)
    }
    pub(crate) fn prefix_of(p: &PrefixObj) -> (&Arc<PoolObj>, PrefixId) {
        (&p.pool, p.id)
    }
    pub(crate) fn layout(p: *const EpmKvLayout) -> Result<KvLayout> {
        layout_from_c(p)
    }
    pub(crate) fn admit(v: u32) -> Result<AdmitMode> {
        admit_mode(v)
    }
    pub(crate) fn token_ids<'a>(p: *const u32, n: usize) -> Result<&'a [u32]> {
        tokens(p, n)
    }
    pub(crate) fn kv_namespace(ns: *const c_char, ns_len: usize) -> Result<Namespace> {
        namespace(ns, ns_len)
    }
    pub(crate) fn raw_stream(a: &PoolObj, s: Arc<Stream>) -> Result<RawStream> {
        stream_of(a, s)
    }
    pub(crate) fn insert_seq(a: &Arc<PoolObj>, id: SeqId, out: OutParam<'_, *mut EpmKvSeq>) -> Result<()> {
        new_seq(a, id, out)
    }
}
