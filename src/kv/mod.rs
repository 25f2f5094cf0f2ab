//! The KV-cache pool, with page-level prefix sharing.
//!
//! Per-sequence, token-major VA reservations backed by a pool of physical
//! granules (2 MiB on the H200). One granule can be mapped read-only into N
//! sequences, is charged once in the ledger, and is copied on write at the
//! divergence boundary. See docs/KV.md for the model and the C API.
//!
//! - [`granule`]: the pool of physical granules, refcounted, retained for reuse;
//! - [`ledger`]: the budget over physical bytes (owned and promised);
//! - [`layout`]: the stride descriptor kernels address K and V with;
//! - [`sequence`]: reservations, `prepare_append`, copy-on-write, the dummy tail;
//! - [`prefix`]: pinned prefixes, `commit_shared_prefix`, content-hash detection;
//! - [`hash`]: the block-chain hash and its index;
//! - [`id`]: the typed ids ([`SeqId`], [`PrefixId`], [`BatchId`]);
//! - [`namespace`]: sharing namespaces (per-tenant cache salts) for content lookups;
//! - [`admission`]: admissible-concurrency arithmetic;
//! - [`reservation`]: VA reservations as granule mapping tables, and windows;
//! - [`batch`]: batch reservations, many sequences at a fixed slot stride;
//! - [`pool`]: the object that ties them together ([`KvPool`]: it owns a
//!   granule pool, not an `arena/` allocator).

pub mod admission;
pub mod batch;
pub mod granule;
pub mod hash;
pub mod id;
pub mod layout;
pub mod ledger;
pub mod namespace;
pub mod pool;
pub mod prefix;
mod reservation;
pub mod sequence;
mod slab;

pub use admission::{Admission, RequestCost, admissible, request_cost};
pub use batch::{BatchInfo, SlotChoice, SlotInfo};
pub use granule::PoolStats;
pub use id::{BatchId, KvId, PrefixId, SeqId};
pub use layout::{Kv, KvLayout, KvShape};
pub use ledger::LedgerStats;
pub use namespace::Namespace;
pub use pool::{AdmitMode, KvConfig, KvCounters, KvPool, KvStats};
pub use prefix::PrefixInfo;
pub use sequence::SeqInfo;
