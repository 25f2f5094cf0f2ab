//! epmem: GPU memory machinery for LLM inference stacks, behind a C ABI.
//!
//! Layers (data flows down; nothing below imports anything above):
//! - [`ffi`]: the `epm_*` C functions — handles, status codes, panic boundary;
//! - core, safe Rust: staging, residency, arena, kv, stats;
//! - [`device`]: the only code that talks to hardware (CUDA or the host device).
//!
//! See README.md and docs/ for the C-level documentation.

// Modules that hold no C-visible types are hidden from cbindgen, so their
// public Rust constants and enums never leak into include/epmem.h.
/// cbindgen:ignore
pub mod arena;
/// cbindgen:ignore
pub mod device;
pub mod error;
pub mod ffi;
/// cbindgen:ignore
pub mod kv;
/// cbindgen:ignore
pub mod ort;
/// cbindgen:ignore
pub mod residency;
/// cbindgen:ignore
pub mod slab;
pub mod staging;

pub use error::{EpmStatus, Error, Result};
