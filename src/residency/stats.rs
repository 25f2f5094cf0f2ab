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

crate::stats::declare_stats! {
    /// A snapshot of one residency manager.
    pub struct ResidencyStats;
    /// Plain counters, updated under the manager's lock.
    pub(crate) struct Counters;
    /// The fields of `EpmResidencyStats` after `size`, in C order.
    const RESIDENCY_C_FIELDS;
    {
        counter acquires: u64,
        /// Acquires whose data was resident from an earlier use (a weight
        /// paged in for this use, even by prefetch, is a miss), so `hit_rate`
        /// compares with Belady's optimum.
        counter hits: u64,
        /// hits / acquires (0 before the first acquire).
        field hit_rate: f64,
        /// Copies of a weight to the device (demand and prefetch).
        counter page_ins: u64,
        /// Of `page_ins`, issued ahead of use by prefetch.
        counter prefetch_page_ins: u64,
        /// Prefetched weights not acquired yet.
        counter pending_prefetches: u64,
        /// Prefetched weights evicted before any use (wasted copies).
        counter wasted_prefetches: u64,
        counter evictions: u64,
        /// Evictions whose victim was still being read and whose block could
        /// not be handed on (see `ordered_reuses`), so the host waited for its
        /// read fence.
        counter eviction_waits: u64,
        /// Page-ins copied straight from page-locked or registered memory.
        field bypassed_page_ins: u64,
        /// Page-ins staged through pinned buffers.
        field staged_page_ins: u64,
        /// Weight sources registered on first page-in, and refusals (limit or device).
        counter source_registrations: u64,
        counter register_refusals: u64,
        /// Bytes registered by the manager (per-weight and whole ranges).
        counter registered_bytes: u64,
        field htod_bytes: u64,
        /// Pinned allocations by the staging pool (flat in steady state), and reuses.
        field pinned_alloc_calls: u64,
        field pinned_reuses: u64,
        /// Host time filling staging buffers.
        field fill_ms: f64,
        /// Device time of page-in copies (read from events after completion).
        field htod_ms: f64,
        /// Time work waited on page-ins: `device_stall_ms + host_stall_ms`.
        field stall_ms: f64,
        /// Time compute streams sat waiting for a page-in (timing events around the wait).
        counter device_stall_ms: f64,
        /// Time the host blocked (synchronous page-ins, eviction waits).
        field host_stall_ms: f64,
        field resident_bytes: u64,
        field peak_resident_bytes: u64,
        field resident_weights: u64,
        field registered_weights: u64,
        field budget_bytes: u64,
        /// The device arena holding resident weights.
        rust_only arena: ArenaStats,
        /// The device arena holding resident weights (see `EpmArenaStats`).
        c_only arena_driver_alloc_calls: u64 = arena.driver_alloc_calls,
        c_only arena_driver_free_calls: u64 = arena.driver_free_calls,
        c_only arena_reserved_bytes: u64 = arena.reserved_bytes,
        c_only arena_committed_bytes: u64 = arena.committed_bytes,
        c_only arena_in_use_bytes: u64 = arena.in_use_bytes,
        c_only arena_fragmentation: f64 = arena.fragmentation,
        /// Weights coalesced into multi-weight units (one page-in each unit).
        /// A member acquired after its unit was paged in for another member
        /// counts as a hit.
        counter coalesced_weights: u64,
        /// Evictions whose block went straight to the next page-in, the copy
        /// ordered on the device behind the victim's readers (no host wait).
        counter ordered_reuses: u64,
        /// Bytes of shared host registrations this manager attached
        /// (`epm_residency_attach_host_registration`): page-locked once, by
        /// another call, and not counted in `registered_bytes`. (epmem 0.2)
        counter attached_bytes: u64,
        /// Prefetches from staged sources filled by the manager's background
        /// thread (see the config's `caller_fills`).
        counter background_page_ins: u64,
        /// Acquires that found their weight's background fill not yet
        /// enqueued and waited for it on the host, and the time they waited
        /// (the fill falling behind the caller; not counted in
        /// `host_stall_ms`, which counts the waits a plan or policy causes).
        counter background_waits: u64,
        field background_wait_ms: f64,
        /// Bytes the background thread filled into staging buffers ahead of
        /// their prefetch (the config's `fill_ahead_chunks`), and how many of
        /// them that prefetch then used without filling them again (the rest
        /// were filled for a unit that was not prefetched next, or forgotten
        /// by an unregister).
        field fill_ahead_bytes: u64,
        field fill_ahead_used_bytes: u64,
        /// Host time waiting for a staging slot's previous copy to complete
        /// (the DMA behind the fill), over every staged page-in; and the time
        /// the background thread spent issuing its page-ins and filling
        /// ahead. With `fill_ms`, they split that thread's time: the rest of
        /// the wall time it waited for the next release to queue work.
        field slot_wait_ms: f64,
        field background_busy_ms: f64,
        /// Weights registered compressed (`epm_residency_register_compressed`),
        /// their host copies' bytes (the compressed buffers, page-locked and
        /// owned by the manager) and their decoded bytes: host RAM of the
        /// compressed weights ÷ raw is `compressed_host_bytes /
        /// compressed_raw_bytes`.
        counter compressed_weights: u64,
        counter compressed_host_bytes: u64,
        counter compressed_raw_bytes: u64,
        /// Device staging for compressed bytes, reserved out of `budget_bytes`:
        /// `EPM_DECODE_STAGING_BUFFERS` × the largest compressed weight the plan
        /// streams (at most 64 MiB; larger weights page in a run at a time),
        /// docs/RESIDENCY.md "Streaming compressed weights".
        field decode_staging_bytes: u64,
        /// Compressed bytes copied to the device (also counted in
        /// `htod_bytes`), the bytes their decodes wrote, the decodes, and
        /// their device time (timing events around each decode, read once
        /// complete).
        counter compressed_htod_bytes: u64,
        counter decoded_bytes: u64,
        counter decodes: u64,
        counter decode_ms: f64,
        /// Bytes of the streaming region of the active plan (0: no plan);
        /// they count in `resident_bytes`.
        field ring_bytes: u64,
        /// Bytes the active plan keeps resident for good.
        field planned_resident_bytes: u64,
        /// Page-ins into the streaming region (each ordered on the device
        /// behind the readers of what it overwrites; also counted in
        /// `ordered_reuses` per occupant overwritten).
        counter ring_page_ins: u64,
        /// Of `resident_weights`, those in the streaming region (all in one
        /// arena block: the others are one arena block each).
        counter ring_weights: u64,
        /// Plans installed (a cycle declared, or a caller found holding more
        /// weights at once than the plan assumed).
        counter plans: u64,
        /// Rings dropped because callers walk the cycle concurrently: from
        /// then on, until a cycle is declared, no plan; page-ins go through
        /// the arena alone.
        counter dropped_rings: u64,
        /// Weights the active plan splits: a head resident for good, a tail
        /// streamed through the ring behind the weight's own address
        /// (docs/RESIDENCY.md "Split weights"). 0: none, or no plan.
        field split_weights: u64,
        /// Bytes of those heads (in `planned_resident_bytes` and in
        /// `resident_bytes`).
        field split_head_bytes: u64,
        /// Host time blocked, in nanoseconds (`host_stall_ms` in the snapshot).
        raw host_stall_ns: u64,
        /// Background waits' time, in nanoseconds (`background_wait_ms`).
        raw background_wait_ns: u64,
    }
}

/// Most stall measurements awaiting completion; beyond it, waits go untimed
/// rather than grow without bound.
const MAX_PENDING: usize = 1024;

/// `acquire` reads completed measurements only once this many are pending:
/// one query per acquire otherwise, per timer, mostly of events not yet
/// complete. (`stats` and `synchronize` read all.)
pub(crate) const HARVEST_BATCH: usize = 32;

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
    /// As [`Self::harvest`] once at least `batch` measurements are pending
    /// (else 0, and no driver call): a caller on a hot path reads them in
    /// batches.
    pub fn harvest_batch(&mut self, batch: usize) -> Result<f64> {
        if self.pending.len() < batch {
            return Ok(0.0);
        }
        self.harvest()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::fault::FaultyDevice;
    use crate::device::{self, Device, DeviceSelect, Stream};
    use std::sync::Arc;

    /// Below the batch, `harvest_batch` reads nothing and makes no driver
    /// call; at the batch it reads every completed measurement, as
    /// `harvest` does, and their pairs are reused by the next waits.
    #[test]
    fn harvest_batch_queries_nothing_below_the_batch() {
        let fd = Arc::new(FaultyDevice::new(device::open(DeviceSelect::Host, 0).unwrap()));
        let d: Arc<dyn Device> = fd.clone();
        let s = Stream::new(&d).unwrap();
        let mut t = StallTimer::default();
        for _ in 0..3 {
            t.around(&d, s.raw(), || Ok(())).unwrap();
        }
        s.synchronize().unwrap();
        let before = fd.ordering_calls();
        assert_eq!(t.harvest_batch(4).unwrap(), 0.0);
        assert_eq!(fd.ordering_calls(), before, "a harvest below the batch made driver calls");
        t.around(&d, s.raw(), || Ok(())).unwrap();
        s.synchronize().unwrap();
        let ms = t.harvest_batch(4).unwrap();
        let after = fd.ordering_calls();
        assert!(ms >= 0.0 && t.pending.is_empty() && t.spare.len() == 4, "not all read: {} pending", t.pending.len());
        assert_eq!(after.event_elapsed - before.event_elapsed, 4, "{after:?}");
        let created = after.event_create;
        t.around(&d, s.raw(), || Ok(())).unwrap();
        assert_eq!(fd.ordering_calls().event_create, created, "the read pairs are not reused");
    }
}
