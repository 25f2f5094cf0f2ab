//! Counters of the staging pool and copy engine.
//!
//! The engine updates them with relaxed atomics on the hot path; readers get
//! a [`StagingStats`] snapshot. Times are kept in nanoseconds and reported in
//! milliseconds, like the seed's `fill_ms` / `htod_ms`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::pool::PoolStats;

/// A snapshot of one copy engine and its pool.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StagingStats {
    /// Pinned allocations (driver calls) made by the pool.
    pub pinned_alloc_calls: u64,
    /// Pinned frees (driver calls) made by the pool.
    pub pinned_free_calls: u64,
    /// Staging buffers served from the pool without allocating.
    pub pinned_reuses: u64,
    /// Bytes the pool retains now.
    pub retained_bytes: u64,
    /// Buffers the pool retains now.
    pub retained_buffers: u64,
    /// H2D copies (page-ins) of at least one byte, staged or direct.
    pub copies: u64,
    /// Copies that took the direct path: the source was page-locked, so no
    /// staging and no fill.
    pub bypassed: u64,
    /// Bytes copied host → device (both paths).
    pub htod_bytes: u64,
    /// Staging chunks filled and copied.
    pub chunks: u64,
    /// Host time spent filling staging buffers: wall time of each chunk's
    /// parallel fill, summed (the previous chunk's enqueue runs inside it).
    pub fill_ms: f64,
    /// Host time spent waiting for a staging slot's previous copy (the
    /// pipeline was DMA-bound); near zero when the fill is the bottleneck.
    pub slot_wait_ms: f64,
    /// Device time of copies, first DMA start to last DMA end per copy, read
    /// from timing events after completion (lags until copies complete).
    pub htod_ms: f64,
    /// Copies whose `htod_ms` has been read so far.
    pub timed_copies: u64,
    /// Bytes filled ahead of their copy ([`super::CopyEngine::fill_ahead`]),
    /// and how many of them a copy of that source then used (the rest were
    /// filled for a copy that came for another source, or were forgotten).
    pub ahead_bytes: u64,
    pub ahead_used_bytes: u64,
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
