//! The transfer layer: moving bytes between host memory and a device, above
//! the hardware and below the core. It owns what every copy path shares and
//! no device implementation needs:
//! - [`witness`]: the copy witness (`CopyCompleted<T>` owning its buffer,
//!   `InFlight`), minted only here, so a pinned buffer is reused or freed
//!   only after its copy was observed complete;
//! - [`fill`]: persistent fill threads (pageable → pinned memcpy);
//! - [`ntcopy`]: the fill's streaming-store memcpy;
//! - [`pinning`]: page-locking host ranges once (cuMemHostRegister), one
//!   range shared by several devices (PORTABLE).
//!
//! It imports only [`crate::device`] and [`crate::error`]; the core
//! (staging, residency) and the FFI sit above it. Like the device layer it
//! holds `unsafe`: each module here is where a host pointer's lifetime is
//! tied to an asynchronous copy (the witness, the page-lock), or where one
//! buffer is split across threads (the fill), and a safe API over the device
//! trait's raw level is exactly what it exists to give. Every block carries a
//! `// SAFETY:` comment (clippy's `undocumented_unsafe_blocks`, `make lint`).

pub mod fill;
pub mod ntcopy;
pub mod pinning;
pub mod witness;
