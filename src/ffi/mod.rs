//! The C ABI: every `epm_*` function, and the conventions they share.
//!
//! One file per C concept (`device.rs`, `stream.rs`, `event.rs`, `memory.rs`,
//! later `residency.rs`, `kv.rs`, ...), and the shared machinery in one place:
//! - [`panic`]: `ffi_boundary!`, around every exported function body;
//! - [`status`]: `EpmStatus` at the boundary, the thread-local last error;
//! - [`args`]: NULL checks and out-params (`try_out!`, `check_not_null!`,
//!   `try_str!`, `try_host_range!`);
//! - [`handle`]: opaque, generation-checked handles (`impl_handle!`,
//!   `try_handle!`, `handle::insert` / `handle::destroy`);
//! - [`log`]: the `log` facade to stderr (`EPM_LOG`) or a host callback;
//! - [`version`]: `epm_version()` and the version macros.
//!
//! docs/ABI.md is the C-side description. An exported function looks like
//! this (copy it):
//!
//! ```ignore
//! use crate::ffi::prelude::*;
//!
//! /// Frob a thing `n` times and return how many frobs it has had.
//! ///
//! /// Ownership: borrows `thing`. NULL: `thing` is INVALID_HANDLE, `out` is
//! /// NULL_POINTER. Threading: safe from any thread. Errors: INVALID_ARGUMENT
//! /// if `n` is 0. `*out` is written only on success.
//! #[unsafe(no_mangle)]
//! pub extern "C" fn epm_thing_frob(thing: *mut EpmThing, n: u32, out: *mut u64) -> EpmStatus {
//!     ffi_boundary! {
//!         let thing = try_handle!(thing);
//!         let out = try_out!(out);
//!         ensure!(n > 0, InvalidArgument, "n is 0");
//!         out.set(thing.frob(n)?);
//!         Ok(())
//!     }
//! }
//! ```
//!
//! The header is generated from this folder (and `EpmStatus` in error.rs)
//! only: declare every C type and constant here, next to its functions.
//!
//! Input enums cross as integers (`u32`), never as Rust enums: C can pass any
//! value, and an out-of-range Rust enum is undefined behaviour.

// These functions are the C ABI: their pointer contracts are documented for
// C callers in the header, and Rust code calls them only in tests. Marking
// them `unsafe fn` would change nothing for C and only add noise.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

pub mod arena;
pub mod arena_stats;
pub mod args;
pub mod device;
pub mod event;
pub mod handle;
pub mod kv;
pub mod kv_batch;
pub mod kv_stats;
pub mod log;
pub mod memory;
pub mod mirror;
pub mod panic;
pub mod residency;
pub mod residency_stats;
pub mod shared_reg;
pub mod staging;
pub mod staging_stats;
pub mod status;
pub mod stream;
// PyTorch's pluggable allocator and the stream-ordered arena under it.
pub mod ordered_arena;
pub mod torch;
// Test machinery, never in the default build (include/epmem_testing.h).
#[cfg(feature = "testing")]
pub mod testing;
pub mod version;
// The weight codec's encoder and validator (src/codec).
pub mod codec;

pub use crate::error::EpmStatus;

/// Everything an `src/ffi/<concept>.rs` file needs: `use crate::ffi::prelude::*;`.
#[allow(unused_imports)]
pub(crate) mod prelude {
    pub(crate) use super::args::{
        OutParam, check_not_null, read_versioned, try_host_range, try_out, try_str, versioned, write_versioned,
    };
    pub(crate) use super::handle::{self, Handle, impl_handle, try_handle};
    pub(crate) use super::panic::ffi_boundary;
    pub use crate::error::{EpmStatus, Error, Result};
    pub(crate) use crate::{bail, ensure};
    pub use std::ffi::{c_char, c_void};
    pub use std::sync::Arc;
}
