//! The C names that were renamed, kept as deprecated aliases until the next
//! major version (docs/ABI.md, "Names": what was renamed and why).
//!
//! Each old function stays an exported symbol with its old signature, so a
//! program linked against an earlier 0.x keeps running; it forwards to the
//! new function and has its contract. The header marks each one
//! `EPM_DEPRECATED(...)` (a GNU `deprecated` attribute, or nothing: define
//! `EPM_DEPRECATED(msg)` empty before including epmem.h to silence it), and
//! the old type names are typedefs of the new types (cbindgen.toml's
//! trailer). ffi-tests/test_misuse_deprecated.c builds a program with the old
//! names, runs it, and checks each old function fails on bad input exactly
//! as its new twin does. Delete this file, the trailer lines and that test at
//! 1.0.

use crate::ffi::device::EpmDevice;
use crate::ffi::kv::{EpmKvPool, EpmKvStats, epm_kv_pool_create, epm_kv_pool_destroy, epm_kv_pool_get_stats};
use crate::ffi::prelude::*;

/// Deprecated name of `epm_kv_pool_create` (the object was called a KV
/// arena, though it owns a granule pool and no `arena/` allocator); same
/// contract: creates a KV pool on `dev` with a budget of `budget_bytes`
/// physical bytes, `*out` a new handle to destroy with `epm_kv_pool_destroy`
/// (or `epm_kv_arena_destroy`). NULL: `dev` is INVALID_HANDLE, `out` is
/// NULL_POINTER. Errors: as `epm_kv_pool_create`.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[deprecated(note = "renamed epm_kv_pool_create")]
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_arena_create(dev: *mut EpmDevice, budget_bytes: u64, out: *mut *mut EpmKvPool) -> EpmStatus {
    epm_kv_pool_create(dev, budget_bytes, out)
}

/// Deprecated name of `epm_kv_pool_destroy`; same contract: releases the
/// pool handle (NULL is a no-op); sequences and prefixes still held keep the
/// pool alive.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[deprecated(note = "renamed epm_kv_pool_destroy")]
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_arena_destroy(arena: *mut EpmKvPool) -> EpmStatus {
    epm_kv_pool_destroy(arena)
}

/// Deprecated name of `epm_kv_pool_get_stats`; same contract: fills `*out`
/// (set `out->size` first). NULL: `arena` is INVALID_HANDLE, `out` is
/// NULL_POINTER. Errors: INVALID_ARGUMENT for a size below the first
/// version's.
///
/// Threading: safe from any thread; calls on one pool are serialized.
#[deprecated(note = "renamed epm_kv_pool_get_stats")]
#[unsafe(no_mangle)]
pub extern "C" fn epm_kv_arena_get_stats(arena: *mut EpmKvPool, out: *mut EpmKvStats) -> EpmStatus {
    epm_kv_pool_get_stats(arena, out)
}
