//! The KV pool: one granule pool, one ledger, one dummy granule, and the
//! sequences and prefixes built from them.
//!
//! Sequence operations are in [`super::sequence`], prefix operations in
//! [`super::prefix`], batch operations in [`super::batch`]. The pool is
//! single-owner (`&mut self`); the C layer puts it behind a mutex.

use std::sync::Arc;

use super::batch::Batch;
use super::granule::{GranuleId, GranulePool, PoolStats};
use super::hash::PrefixIndex;
use super::id::{BatchId, PrefixId, SeqId};
use super::ledger::LedgerStats;
use super::prefix::Prefix;
use super::sequence::Sequence;
use super::slab::Slab;
use crate::device::{Access, Device, Event, RawStream, Stream, VaRange};
use crate::error::Result;

/// Pool configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvConfig {
    /// Physical bytes the pool may own (dummy granule included).
    pub budget_bytes: u64,
    /// Tokens per hashed block for content-hash prefix detection.
    pub hash_block_tokens: u32,
}

impl KvConfig {
    pub fn new(budget_bytes: u64) -> Self {
        Self { budget_bytes, hash_block_tokens: 16 }
    }
}

/// How a new sequence is admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdmitMode {
    /// Promise the sequence's worst-case private granules up front (refused
    /// with OutOfBudget if the ledger cannot hold them); `prepare_append`
    /// then never fails for budget. (C: `EPM_KV_ADMIT_PROMISE`; *promise*,
    /// not *reserve*: *reserve* is for VA reservations.)
    Promise,
    /// Promise nothing: granules are charged as `prepare_append` commits
    /// them, and that may fail with OutOfBudget.
    OnDemand,
}

/// Counters of the pool's own work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvCounters {
    /// Boundary granules copied on write.
    pub cow_granules: u64,
    /// Fresh granules committed by prepare_append (excluding COW).
    pub committed_granules: u64,
    /// Host waits on a caller's stream before a mapping change.
    /// (C: `EpmKvStats.fences`, a published name; docs/CONCEPTS.md.)
    pub stream_waits: u64,
    /// Sequences created with a prefix found by content hash.
    pub hash_hits: u64,
}

crate::stats::declare_stats! {
    /// Everything the pool can report.
    #[derive(Eq)]
    pub struct KvStats;
    /// The fields of `EpmKvStats` after `size`, in C order.
    const KV_C_FIELDS;
    {
        /// The ledger's snapshot (C: its fields, flattened below).
        rust_only ledger: LedgerStats,
        /// The granule pool's handles (C: `pool_*`).
        rust_only pool: PoolStats,
        /// The pool's own work (C: `cow_granules` to `hash_hits`).
        rust_only counters: KvCounters,
        /// Batches alive now (not in the C struct).
        rust_only batches: u64,
        /// The ledger's budget, owned bytes (physical, each granule once, the
        /// dummy included), bytes promised to admitted sequences, peak owned.
        c_only budget_bytes: u64 = ledger.budget_bytes,
        c_only owned_bytes: u64 = ledger.owned_bytes,
        c_only promised_bytes: u64 = ledger.promised_bytes,
        c_only peak_owned_bytes: u64 = ledger.peak_owned_bytes,
        c_only owned_granules: u64 = ledger.owned_granules,
        /// Granule 0→1 (charge) and 1→0 (credit) transitions; admissions and
        /// appends refused with OUT_OF_BUDGET.
        c_only charges: u64 = ledger.charges,
        c_only credits: u64 = ledger.credits,
        c_only refusals: u64 = ledger.refusals,
        field granule_bytes: u64,
        /// Physical handles created / released to the driver, acquisitions served
        /// from a retained handle, handles retained now.
        c_only pool_created: u64 = pool.created,
        c_only pool_released: u64 = pool.released,
        c_only pool_reused: u64 = pool.reused,
        c_only pool_retained: u64 = pool.retained,
        field sequences: u64,
        field prefixes: u64,
        field pinned_prefixes: u64,
        /// Granule bytes mapped read-write or read-only into sequences (the
        /// dummy excluded): what they would own without sharing.
        /// `mapped_bytes - owned_bytes` is roughly the saving.
        field mapped_bytes: u64,
        c_only cow_granules: u64 = counters.cow_granules,
        c_only committed_granules: u64 = counters.committed_granules,
        /// Host waits on a caller's stream before a mapping change (`stream_waits`
        /// in Rust; this published field keeps its first name, see docs/CONCEPTS.md).
        c_only fences: u64 = counters.stream_waits,
        /// Sequences that found a prefix by content hash.
        c_only hash_hits: u64 = counters.hash_hits,
    }
}

#[derive(Debug)]
pub struct KvPool {
    pub(crate) dev: Arc<dyn Device>,
    pub(crate) config: KvConfig,
    pub(crate) pool: GranulePool,
    pub(crate) dummy: GranuleId,
    pub(crate) seqs: Slab<SeqId, Sequence>,
    pub(crate) prefixes: Slab<PrefixId, Prefix>,
    pub(crate) batches: Slab<BatchId, Batch>,
    pub(crate) index: PrefixIndex<PrefixId>,
    pub(crate) stream_wait_event: Event,
    pub(crate) counters: KvCounters,
}

impl KvPool {
    /// A new pool. Charges the dummy granule (one granule, physical bytes)
    /// to the budget, so the budget must hold at least one granule.
    pub fn new(dev: &Arc<dyn Device>, config: KvConfig) -> Result<Self> {
        crate::ensure!(config.hash_block_tokens > 0, InvalidArgument, "KV pool: hash_block_tokens is 0");
        let mut pool = GranulePool::new(dev, config.budget_bytes);
        let dummy = pool.acquire(false).map_err(|e| e.context("KV pool: the dummy granule"))?;
        let pool = Self {
            dev: dev.clone(),
            config,
            pool,
            dummy,
            seqs: Slab::new(),
            prefixes: Slab::new(),
            batches: Slab::new(),
            index: PrefixIndex::new(),
            stream_wait_event: Event::new(dev, false)?,
            counters: KvCounters::default(),
        };
        pool.zero_dummy()?;
        Ok(pool)
    }

    /// A reader of the unused tail sees zeros, not whatever the granule held
    /// before (it may be a recycled handle on the driver's side).
    fn zero_dummy(&self) -> Result<()> {
        let g = self.granule();
        let mut va = VaRange::reserve(&self.dev, g)?;
        va.map(0, g, self.pool.phys(self.dummy)?, 0, Access::ReadWrite)?;
        let s = Stream::new(&self.dev)?;
        self.dev.memset_d8_async(va.base(), 0, g, s.raw())?;
        s.synchronize()?;
        va.unmap(0, g)
    }

    pub fn device(&self) -> &Arc<dyn Device> {
        &self.dev
    }

    pub fn config(&self) -> KvConfig {
        self.config
    }

    /// The VMM granularity (queried from the device, never assumed).
    pub fn granule(&self) -> usize {
        self.pool.granule()
    }

    /// Wait until the work queued on `stream` so far has completed.
    ///
    /// The host must wait here: map, unmap and set-access are not
    /// stream-ordered — the driver applies them immediately — so the only way
    /// to know that no kernel (or captured-graph replay) queued on the
    /// caller's stream still reads the old mapping is to see that work
    /// complete. On the H200 a kernel touching an unmapped or read-only page
    /// is error 700 and kills the context; on the host device it is SIGSEGV.
    pub(crate) fn wait_for_stream(&mut self, stream: RawStream) -> Result<()> {
        self.stream_wait_event.record_raw(stream)?;
        self.stream_wait_event.synchronize()?;
        self.counters.stream_waits += 1;
        Ok(())
    }

    pub fn stats(&self) -> KvStats {
        let g = self.granule() as u64;
        let mut mapped = 0;
        for id in self.seqs.ids() {
            if let Ok(s) = self.seqs.get(id) {
                mapped += s.committed_slots() as u64 * g;
            }
        }
        let pinned = self.prefixes.ids().into_iter().filter(|&p| self.prefixes.get(p).is_ok_and(|p| p.pinned)).count();
        KvStats {
            ledger: self.pool.ledger_stats(),
            pool: self.pool.stats(),
            counters: self.counters,
            granule_bytes: g,
            sequences: self.seqs.len() as u64,
            prefixes: self.prefixes.len() as u64,
            pinned_prefixes: pinned as u64,
            batches: self.batches.len() as u64,
            mapped_bytes: mapped,
        }
    }

    /// Release every retained (unreferenced) granule handle to the driver.
    pub fn trim(&mut self) -> u64 {
        self.pool.trim()
    }

    /// Destroy everything in the pool, returning the first error. The caller
    /// guarantees that no work in flight touches any sequence.
    pub fn clear(&mut self) -> Result<()> {
        let mut first = Ok(());
        for id in self.seqs.ids() {
            let r = self.destroy_sequence(id);
            if first.is_ok() {
                first = r;
            }
        }
        for id in self.prefixes.ids() {
            let r = self.destroy_prefix(id);
            if first.is_ok() {
                first = r;
            }
        }
        // After their slots' sequences: unmap the dummies, free the VA.
        for id in self.batches.ids() {
            let r = self.destroy_batch(id);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

impl Drop for KvPool {
    fn drop(&mut self) {
        crate::device::objects::log_drop_error("KV pool teardown", self.clear());
        crate::device::objects::log_drop_error("KV pool: release dummy", self.pool.release(self.dummy));
    }
}
