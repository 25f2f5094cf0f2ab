//! Staging: getting weights from host memory to the device fast, without
//! ever reusing a pinned buffer a DMA still reads.
//!
//! - [`pool`]: the bounded pool of pinned staging buffers; a buffer returns
//!   to it only with a [`CopyCompleted`](crate::transfer::witness::CopyCompleted)
//!   witness.
//! - [`engine`]: the copy engine — chunked, multi-threaded fill overlapped
//!   with the DMA through N slots; direct copies from page-locked sources;
//!   completion as a [`Fence`] (an event) that streams wait on.
//! - [`background`]: a thread that issues staged copies for a caller that
//!   must not spend its time filling (pending fences).
//! - [`stats`]: the counters both report.
//!
//! The witness itself and the in-flight ownership live in
//! [`crate::transfer::witness`]: only the device layer can observe that a copy
//! completed, so only it mints the proof.

pub mod background;
pub mod engine;
pub mod pool;
pub mod stats;

pub use background::{BackgroundFill, Copier};
pub use engine::{AheadTicket, CopyEngine, EngineConfig, Fence, HostRegistration};
pub use pool::{PinnedStagingPool, PoolConfig, PoolStats, PooledStaging};
pub use stats::StagingStats;
