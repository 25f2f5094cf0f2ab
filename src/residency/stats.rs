//! The residency counters (the seed's, plus what the policy and the arena add).
//!
//! Hit accounting is comparable with Belady's optimum: an acquire is a hit
//! when the weight's data was already on the device from an earlier use; a
//! weight paged in for this use — on demand or by prefetch — is a miss, even
//! when the prefetch hid its cost. How well prefetch hides misses shows in
//! `stall_ms`, not in `hit_rate`.

use std::collections::VecDeque;

use crate::arena::ArenaStats;
use crate::device::{Event, RawStream};
use crate::error::Result;

/// A snapshot of one residency manager.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ResidencyStats {
    pub acquires: u64,
    /// Acquires whose data was resident from an earlier use.
    pub hits: u64,
    /// hits / acquires (0 before the first acquire).
    pub hit_rate: f64,
    /// Copies of a weight to the device (demand and prefetch).
    pub page_ins: u64,
    /// Of `page_ins`, issued ahead of use by prefetch.
    pub prefetch_page_ins: u64,
    /// Prefetched weights not acquired yet.
    pub pending_prefetches: u64,
    /// Prefetched weights evicted before any use (wasted copies).
    pub wasted_prefetches: u64,
    pub evictions: u64,
    /// Evictions that had to wait on the host for the victim's read fence.
    pub eviction_waits: u64,
    /// Evictions whose block went straight to the next page-in, its copy
    /// ordered on the device behind the victim's readers (no host wait).
    pub ordered_reuses: u64,
    /// Weights coalesced into multi-weight units (one page-in each unit). A
    /// member acquired after its unit was paged in for another member
    /// counts as a hit.
    pub coalesced_weights: u64,
    /// Page-ins copied straight from page-locked or registered memory.
    pub bypassed_page_ins: u64,
    /// Page-ins staged through pinned buffers.
    pub staged_page_ins: u64,
    /// Weight sources registered on first page-in, and refusals (limit or device).
    pub source_registrations: u64,
    pub register_refusals: u64,
    /// Bytes registered by the manager (per-weight and whole ranges).
    pub registered_bytes: u64,
    /// Bytes of shared registrations attached (registered once, elsewhere).
    pub attached_bytes: u64,
    pub htod_bytes: u64,
    /// Staging pool driver allocations and reuses.
    pub pinned_alloc_calls: u64,
    pub pinned_reuses: u64,
    /// Host time filling staging buffers.
    pub fill_ms: f64,
    /// Device time of page-in copies (read from events after completion).
    pub htod_ms: f64,
    /// Time work waited on a page-in: `device_stall_ms + host_stall_ms`.
    pub stall_ms: f64,
    /// Time a compute stream sat waiting for a page-in (timing events around the wait).
    pub device_stall_ms: f64,
    /// Time the host blocked: synchronous page-ins, eviction waits.
    pub host_stall_ms: f64,
    pub resident_bytes: u64,
    pub peak_resident_bytes: u64,
    pub resident_weights: u64,
    pub registered_weights: u64,
    pub budget_bytes: u64,
    /// Bytes of the streaming region of the active plan (0: no plan); they
    /// count in `resident_bytes`.
    pub ring_bytes: u64,
    /// Bytes the active plan keeps resident for good.
    pub planned_resident_bytes: u64,
    /// Page-ins into the streaming region (each ordered on the device behind
    /// the readers of what it overwrites; also counted in `ordered_reuses`
    /// per occupant overwritten).
    pub ring_page_ins: u64,
    /// Of `resident_weights`, those in the streaming region (all in one
    /// arena block: the others are one arena block each).
    pub ring_weights: u64,
    /// Plans installed (declare_cycle, or a caller found holding more
    /// weights at once than the plan assumed).
    pub plans: u64,
    /// Rings dropped because callers walk the cycle concurrently (see
    /// `ResidencyManager::acquire`): from then on, until a cycle is
    /// declared, no plan; page-ins go through the arena alone.
    pub dropped_rings: u64,
    /// Prefetches from staged sources issued by the background filler
    /// (`ResidencyConfig::caller_fills` false), the acquires that found one
    /// not yet enqueued and waited for it on the host, and that wait's time
    /// (the fill falling behind; not in `host_stall_ms`, which counts the
    /// waits a plan or policy causes).
    pub background_page_ins: u64,
    pub background_waits: u64,
    pub background_wait_ms: f64,
    /// Bytes the background filler filled ahead of their prefetch
    /// (`ResidencyConfig::fill_ahead_chunks`), and how many of them that
    /// prefetch used (the rest went to a prefetch of another unit, or were
    /// forgotten by an unregister).
    pub fill_ahead_bytes: u64,
    pub fill_ahead_used_bytes: u64,
    /// Host time the copy engine waited for a staging slot's previous copy
    /// (every staged copy, whichever thread issued it), and the time the
    /// background filler spent issuing its copies and filling ahead: with
    /// `fill_ms`, what the filler did; the rest of the wall time it idled,
    /// waiting for the caller to queue the next copy.
    pub slot_wait_ms: f64,
    pub background_busy_ms: f64,
    /// Compressed weights registered, their host copies' bytes (the
    /// compressed buffers, page-locked, owned by the manager) and their
    /// decoded bytes (what the same weights take raw).
    pub compressed_weights: u64,
    pub compressed_host_bytes: u64,
    pub compressed_raw_bytes: u64,
    /// Device staging for compressed bytes, reserved out of the budget
    /// (`DECODE_STAGING_BUFFERS` × the largest compressed weight).
    pub decode_staging_bytes: u64,
    /// Compressed bytes copied to the device (also in `htod_bytes`), the
    /// bytes their decodes wrote, the decodes, and their device time
    /// (timing events around each decode, read once complete).
    pub compressed_htod_bytes: u64,
    pub decoded_bytes: u64,
    pub decodes: u64,
    pub decode_ms: f64,
    /// The device arena holding resident weights.
    pub arena: ArenaStats,
}

/// Plain counters, updated under the manager's lock.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Counters {
    pub acquires: u64,
    pub hits: u64,
    pub page_ins: u64,
    pub prefetch_page_ins: u64,
    pub pending_prefetches: u64,
    pub wasted_prefetches: u64,
    pub evictions: u64,
    pub eviction_waits: u64,
    pub ordered_reuses: u64,
    pub coalesced_weights: u64,
    pub source_registrations: u64,
    pub register_refusals: u64,
    pub registered_bytes: u64,
    pub attached_bytes: u64,
    pub host_stall_ns: u64,
    pub device_stall_ms: f64,
    pub ring_page_ins: u64,
    pub plans: u64,
    pub dropped_rings: u64,
    pub background_page_ins: u64,
    pub background_waits: u64,
    pub background_wait_ns: u64,
    pub ring_weights: u64,
    pub compressed_weights: u64,
    pub compressed_host_bytes: u64,
    pub compressed_raw_bytes: u64,
    pub compressed_htod_bytes: u64,
    pub decoded_bytes: u64,
    pub decodes: u64,
    pub decode_ms: f64,
}

/// Most stall measurements awaiting completion; beyond it, waits go untimed
/// rather than grow without bound.
const MAX_PENDING: usize = 1024;

/// Pairs of timing events around stream waits, read once complete (never
/// blocking), and reused so timing costs no event creation in steady state.
#[derive(Debug, Default)]
pub(crate) struct StallTimer {
    pending: VecDeque<(Event, Event)>,
    spare: Vec<(Event, Event)>,
}

impl StallTimer {
    /// Record around `wait`, which makes `s` wait on something.
    pub fn around(
        &mut self,
        dev: &std::sync::Arc<dyn crate::device::Device>,
        s: RawStream,
        wait: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        if self.pending.len() >= MAX_PENDING {
            return wait();
        }
        let (a, b) = match self.spare.pop() {
            Some(p) => p,
            None => (Event::new(dev, true)?, Event::new(dev, true)?),
        };
        a.record_raw(s)?;
        wait()?;
        b.record_raw(s)?;
        self.pending.push_back((a, b));
        Ok(())
    }
    /// Milliseconds of the waits that have completed since the last call.
    pub fn harvest(&mut self) -> Result<f64> {
        let mut ms = 0.0;
        while let Some((a, b)) = self.pending.front() {
            if !b.query()? {
                break;
            }
            ms += b.elapsed_since(a)? as f64;
            if let Some(p) = self.pending.pop_front() {
                self.spare.push(p);
            }
        }
        Ok(ms)
    }
}
