//! Weight residency: weights live in host memory; a manager keeps a VRAM
//! budget and pages them in on demand and ahead of demand.

pub mod policy;
pub mod sim;

/// A registered weight's identity (stable for the manager's lifetime, never reused).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WeightId(pub u32);

pub use policy::{new_policy, CyclicPolicy, LruPolicy, Policy, PolicyKind};
