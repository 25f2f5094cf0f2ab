//! Weight residency: weights live in host memory; a manager keeps a VRAM
//! budget and pages them in on demand and ahead of demand.
//!
//! - [`manager`]: acquire/release, eviction, prefetch along a declared cycle;
//! - [`registry`]: registered weights and host-range registrations;
//! - [`policy`]: LRU and the cyclic farthest-next-use policy;
//! - [`sim`]: trace replay and Belady's optimum, for tests and benchmarks;
//! - [`read_fence`]: the read fence and its `ReadsDone` witness;
//! - [`stats`]: the counters.

mod coalesce;
pub mod config;
mod decode;
mod evict;
mod ledger;
pub mod manager;
mod page_in;
pub mod placement;
mod plan;
mod plan_state;
pub mod policy;
pub mod read_fence;
pub mod registry;
mod ring;
pub mod sim;
pub mod stats;

/// A registered weight's identity (stable for the manager's lifetime, never reused).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WeightId(pub u32);

pub use config::{FILL_AHEAD_ALL_SLOTS, RESIDENCY_STAGING_SLOTS, RESIDENCY_STREAM_BELOW, ResidencyConfig};
pub use decode::{DECODE_STAGING_BUFFERS, DECODE_STAGING_MAX_BYTES, DECODE_STAGING_MIN_BYTES, Registered};
pub use manager::ResidencyManager;
pub use placement::Hold;
pub use policy::{CyclicPolicy, LruPolicy, Policy, PolicyKind, new_policy};
pub use registry::{HostRangeId, RegisterSources};
pub use stats::ResidencyStats;
