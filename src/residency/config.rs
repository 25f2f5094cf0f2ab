//! How a residency manager is set up.

use super::PolicyKind;
use super::registry::RegisterSources;
use crate::staging::{EngineConfig, PoolConfig};

/// `fill_ahead_chunks` meaning "as many chunks as there are staging slots"
/// (the default): resolved to `engine.slots` when the manager is created, so
/// a caller that changes the slots never has to change it too.
pub const FILL_AHEAD_ALL_SLOTS: usize = u32::MAX as usize;

/// Staging slots of a residency manager's copy engine by default: one more
/// than a bare `EngineConfig`. On the H200 (scripts/probe_staged.py, small
/// shape, docs/BENCHMARKS.md) 4 slots filled ahead decoded faster than 3 from
/// staged sources at prefetch depth 1: 133 against 139 ms/token at a 25%
/// budget, 63 against 77 at 75%.
pub const RESIDENCY_STAGING_SLOTS: usize = 4;

/// A residency manager's engine fills staged copies shorter than this with
/// streaming stores, longer ones with plain stores (a bare engine: 64 MiB).
/// On the H200 (scripts/probe_pageable.py, 4 slots, full chunks to the end,
/// copies back to back, docs/BENCHMARKS.md) streaming stores won at 2 and 8
/// MiB (23.5 and 31 GB/s against 18 and 24-25 plain) and plain ones from 12
/// MiB up (12: 35.1 against 33.1; 16: 46.2 / 36.4; 32: 53-54 / 37-43).
pub const RESIDENCY_STREAM_BELOW: usize = 12 << 20;

/// Configuration of a [`super::ResidencyManager`].
#[derive(Debug, Clone, Copy)]
pub struct ResidencyConfig {
    /// Most bytes of weights resident at once.
    pub budget_bytes: usize,
    /// Eviction policy (default: cyclic farthest-next-use).
    pub policy: PolicyKind,
    /// When pageable sources are registered with the device (default: on
    /// first page-in within RLIMIT_MEMLOCK).
    pub register_sources: RegisterSources,
    /// Most weights paged in ahead of use (and not used yet) along the
    /// declared cycle (default 1). Each costs about one weight of budget in
    /// hits: the prefetched weight takes room that Belady's demand schedule
    /// would still use for a weight needed sooner. One suffices when misses
    /// are spread out; when they come in a run, a deeper window lets the
    /// run's copies start during the preceding hits' compute.
    pub prefetch_depth: usize,
    /// The host waits for every page-in to complete before `acquire`
    /// returns: the synchronous baseline, for comparison only (default false).
    pub sync_page_in: bool,
    /// Staged prefetches are filled on the calling thread (default false:
    /// a background thread fills them, so the
    /// thread that launches the kernels does not spend the fill; see
    /// `staging::background`). Demand page-ins are always issued by the caller.
    pub caller_fills: bool,
    /// With the background filler: between two staged prefetches, fill up to
    /// this many chunks of the next staged unit along the declared cycle
    /// ahead, while the filler would otherwise wait for the caller to queue
    /// it (`CopyEngine::fill_ahead`). At most `engine.slots`, or
    /// [`FILL_AHEAD_ALL_SLOTS`] (the default: every slot); 0 turns it off.
    /// On the H200 at prefetch depth 1 it took a staged decode from 157 to
    /// 133 ms/token (small shape, 25% budget; docs/BENCHMARKS.md).
    pub fill_ahead_chunks: usize,
    /// Weights smaller than this that are adjacent both in host memory and in
    /// the declared cycle are coalesced into one page-in of up to
    /// `coalesce_max_bytes` (copies of a few hundred KiB never reach the
    /// PCIe peak: 2 MiB gets 49 GB/s on the H200, 8 MiB+ 53–54). Default
    /// 1 MiB; 0 disables.
    pub coalesce_below_bytes: usize,
    /// Largest coalesced unit (default 8 MiB; never above budget / 8).
    pub coalesce_max_bytes: usize,
    /// With the cyclic policy and a declared cycle of mixed sizes (largest
    /// unit over 1.25 × the smallest) larger than the budget: plan a static
    /// resident set and a streaming region (see `residency::placement`).
    /// Default true; false leaves farthest-next-use alone in charge.
    pub stream_plan: bool,
    /// With a plan, for a caller that acquires around each weight: stream
    /// only part of weights (`residency::placement::split_plan`) when that
    /// streams fewer bytes than whole weights do. Default true.
    pub split_weights: bool,
    /// Growth step of the device arena in bytes (0: 16 granules).
    pub arena_chunk_bytes: usize,
    pub pool: PoolConfig,
    pub engine: EngineConfig,
}

impl ResidencyConfig {
    pub fn with_budget(budget_bytes: usize) -> Self {
        Self {
            budget_bytes,
            policy: PolicyKind::Cyclic,
            register_sources: RegisterSources::WithinMemlock,
            prefetch_depth: 1,
            sync_page_in: false,
            caller_fills: false,
            fill_ahead_chunks: FILL_AHEAD_ALL_SLOTS,
            coalesce_below_bytes: 1 << 20,
            coalesce_max_bytes: 8 << 20,
            stream_plan: true,
            split_weights: true,
            arena_chunk_bytes: 0,
            pool: PoolConfig::default(),
            // The filler issues staged copies back to back: see `split_tail`
            // and `RESIDENCY_STREAM_BELOW`.
            engine: EngineConfig {
                slots: RESIDENCY_STAGING_SLOTS,
                split_tail: false,
                stream_below: RESIDENCY_STREAM_BELOW,
                ..EngineConfig::default()
            },
        }
    }
    /// The unoptimized baseline the benchmarks compare against (the first
    /// design): LRU, synchronous page-ins, staged through the pool (no
    /// registration, no coalescing), one fill thread, no prefetch, nothing
    /// filled ahead, the engine's 3 slots.
    pub fn sync_lru_baseline(budget_bytes: usize) -> Self {
        let mut c = Self {
            policy: PolicyKind::Lru,
            register_sources: RegisterSources::Never,
            prefetch_depth: 0,
            sync_page_in: true,
            caller_fills: true,
            coalesce_below_bytes: 0,
            fill_ahead_chunks: 0,
            ..Self::with_budget(budget_bytes)
        };
        c.engine = EngineConfig { fill_threads: 1, ..EngineConfig::default() };
        c
    }
}
