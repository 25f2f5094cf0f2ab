//! epmem: GPU memory machinery for LLM inference stacks, behind a C ABI.
//!
//! Layers (data flows down; nothing below imports anything above):
//! - [`ffi`]: the `epm_*` C functions — handles, status codes, panic boundary;
//! - core, safe Rust: [`staging`], [`residency`], [`arena`], [`kv`] (each
//!   keeps and reports its own counters, each stats struct declared once
//!   with [`stats`]' generator, which also gives its C mirror);
//! - [`transfer`]: host↔device copies — the copy witness, fill threads,
//!   page-locked host ranges;
//! - [`device`]: the only code that talks to hardware (CUDA or the host device).
//!
//! `unsafe` is allowed only in device/, transfer/, ffi/ and ort/: the core
//! modules below are `forbid(unsafe_code)`, tests/unsafe_rule.rs checks the
//! rule, and clippy (`make lint`, Cargo.toml's `[lints.clippy]`) the
//! `// SAFETY:` comment of every block.
//!
//! See README.md and docs/ for the C-level documentation.

// Modules that hold no C-visible types are hidden from cbindgen, so their
// public Rust constants and enums never leak into include/epmem.h.
/// cbindgen:ignore
#[forbid(unsafe_code)]
pub mod arena;
/// cbindgen:ignore
#[forbid(unsafe_code)]
pub mod codec;
/// cbindgen:ignore
pub mod device;
#[forbid(unsafe_code)]
pub mod error;
pub mod ffi;
/// cbindgen:ignore
#[forbid(unsafe_code)]
pub mod kv;
/// cbindgen:ignore
pub mod ort;
/// cbindgen:ignore
#[forbid(unsafe_code)]
pub mod residency;
/// cbindgen:ignore
#[forbid(unsafe_code)]
pub mod slab;
#[forbid(unsafe_code)]
pub mod staging;
/// cbindgen:ignore
#[forbid(unsafe_code)]
pub mod stats;
/// cbindgen:ignore
pub mod transfer;

pub use error::{EpmStatus, Error, Result};
