//! Counters of the staging pool and copy engine.
//!
//! The engine updates them with relaxed atomics on the hot path; readers get
//! a [`StagingStats`] snapshot. Times are kept in nanoseconds and reported in
//! milliseconds, like the seed's `fill_ms` / `htod_ms`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::pool::PoolStats;

crate::stats::declare_stats! {
    /// A snapshot of one copy engine and its pool.
    pub struct StagingStats;
    /// The fields of `EpmStagingStats` after `size`, in C order.
    const STAGING_C_FIELDS;
    {
        /// Pinned allocations (driver calls) made by the pool.
        field pinned_alloc_calls: u64,
        /// Pinned frees (driver calls) made by the pool.
        field pinned_free_calls: u64,
        /// Staging buffers served by reuse (no allocation).
        field pinned_reuses: u64,
        /// Bytes the pool retains now.
        field retained_bytes: u64,
        /// Buffers the pool retains now.
        field retained_buffers: u64,
        /// Copies of at least one byte (staged or direct).
        field copies: u64,
        /// Copies that took the direct path (page-locked source: no staging,
        /// no fill).
        field bypassed: u64,
        /// Bytes copied host → device (both paths).
        field htod_bytes: u64,
        /// Staging chunks filled and copied.
        field chunks: u64,
        /// Host milliseconds spent filling staging buffers: wall time of each
        /// chunk's parallel fill, summed (the previous chunk's enqueue runs
        /// inside it).
        field fill_ms: f64,
        /// Host milliseconds spent waiting for a staging slot's previous copy
        /// (DMA-bound); near zero when the fill is the bottleneck.
        field slot_wait_ms: f64,
        /// Device milliseconds of copies, first DMA start to last DMA end per
        /// copy, read from timing events after they completed (lags until then).
        field htod_ms: f64,
        /// Copies whose `htod_ms` has been read so far.
        field timed_copies: u64,
        /// Bytes filled ahead of their copy ([`super::CopyEngine::fill_ahead`]),
        /// and how many of them a copy of that source then used (the rest were
        /// filled for a copy that came for another source, or were forgotten).
        /// Only a residency manager's filler fills ahead, and
        /// `EpmResidencyStats` reports it: a C copy engine never does.
        rust_only ahead_bytes: u64,
        rust_only ahead_used_bytes: u64,
    }
}

#[derive(Debug, Default)]
pub(crate) struct EngineCounters {
    pub copies: AtomicU64,
    pub bypassed: AtomicU64,
    pub htod_bytes: AtomicU64,
    pub chunks: AtomicU64,
    pub fill_ns: AtomicU64,
    pub slot_wait_ns: AtomicU64,
    pub htod_ns: AtomicU64,
    pub timed_copies: AtomicU64,
    pub ahead_bytes: AtomicU64,
    pub ahead_used_bytes: AtomicU64,
}

pub(crate) fn add(c: &AtomicU64, v: u64) {
    c.fetch_add(v, Ordering::Relaxed);
}

pub(crate) fn add_time(c: &AtomicU64, d: Duration) {
    add(c, u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
}

fn ms(c: &AtomicU64) -> f64 {
    c.load(Ordering::Relaxed) as f64 / 1e6
}

impl EngineCounters {
    pub fn snapshot(&self, pool: PoolStats) -> StagingStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StagingStats {
            pinned_alloc_calls: pool.pinned_alloc_calls,
            pinned_free_calls: pool.pinned_free_calls,
            pinned_reuses: pool.pinned_reuses,
            retained_bytes: pool.retained_bytes,
            retained_buffers: pool.retained_buffers,
            copies: get(&self.copies),
            bypassed: get(&self.bypassed),
            htod_bytes: get(&self.htod_bytes),
            chunks: get(&self.chunks),
            fill_ms: ms(&self.fill_ns),
            slot_wait_ms: ms(&self.slot_wait_ns),
            htod_ms: ms(&self.htod_ns),
            timed_copies: get(&self.timed_copies),
            ahead_bytes: get(&self.ahead_bytes),
            ahead_used_bytes: get(&self.ahead_used_bytes),
        }
    }
}
