//! The granule pool: physical granules with a reference count each.
//!
//! A reference is one mapping of the granule (a sequence slot or a prefix's
//! view) or the KV pool's hold on its dummy granule. The ledger is charged on a
//! granule's 0→1 transition and credited on 1→0 — physical bytes, once per
//! granule however many sequences map it.
//!
//! Released granules are retained (their physical handle is kept) and handed
//! out again before a new handle is created: cuMemCreate costs ~9–12 µs per
//! 2 MiB granule and cuMemRelease ~12–14 µs on the H200 (bench_kv,
//! docs/bench/h200-2026-12-01-run.json), so a steady decode
//! workload makes no create/release calls at all. Retention is bounded so
//! that owned + promised + retained bytes never exceed the budget: the pool
//! never holds more physical memory than the budget allows.

use std::sync::Arc;

use super::ledger::{Ledger, LedgerStats};
use crate::device::{Device, PhysMem};
use crate::error::Result;

/// A live granule (reference count ≥ 1). Only meaningful inside its pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GranuleId(pub(crate) u32);

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Physical handles created (cuMemCreate) / released to the driver.
    pub created: u64,
    pub released: u64,
    /// Acquisitions served from a retained handle.
    pub reused: u64,
    /// Handles kept for reuse right now.
    pub retained: u64,
}

#[derive(Debug)]
struct Slot {
    phys: Option<PhysMem>,
    refs: u32,
}

#[derive(Debug)]
pub struct GranulePool {
    dev: Arc<dyn Device>,
    granule: usize,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    retained: Vec<PhysMem>,
    ledger: Ledger,
    stats: PoolStats,
}

impl GranulePool {
    pub fn new(dev: &Arc<dyn Device>, budget: u64) -> Self {
        Self {
            granule: dev.vmm_granularity(),
            dev: dev.clone(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            retained: Vec::new(),
            ledger: Ledger::new(budget),
            stats: PoolStats::default(),
        }
    }

    pub fn granule(&self) -> usize {
        self.granule
    }

    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    pub fn ledger_mut(&mut self) -> &mut Ledger {
        &mut self.ledger
    }

    pub fn ledger_stats(&self) -> LedgerStats {
        self.ledger.stats()
    }

    pub fn stats(&self) -> PoolStats {
        PoolStats { retained: self.retained.len() as u64, ..self.stats }
    }

    /// A granule with one reference, charged to the ledger (from a sequence's
    /// promise when `from_promise`). Refused with OutOfBudget before any
    /// driver call if the ledger cannot hold it.
    pub fn acquire(&mut self, from_promise: bool) -> Result<GranuleId> {
        let g = self.granule as u64;
        if !self.ledger.can_charge(g, if from_promise { g } else { 0 }) {
            return Err(self.ledger.refuse("a granule", g));
        }
        let phys = match self.retained.pop() {
            Some(p) => {
                self.stats.reused += 1;
                p
            }
            None => {
                let p = PhysMem::new(&self.dev, self.granule)?;
                self.stats.created += 1;
                p
            }
        };
        let idx = match self.free_slots.pop() {
            Some(i) => i,
            None => {
                self.slots.push(Slot { phys: None, refs: 0 });
                (self.slots.len() - 1) as u32
            }
        };
        if let Err(e) = self.ledger.charge(idx, g, from_promise) {
            self.free_slots.push(idx);
            self.retained.push(phys);
            return Err(e);
        }
        self.slots[idx as usize] = Slot { phys: Some(phys), refs: 1 };
        Ok(GranuleId(idx))
    }

    fn slot(&self, id: GranuleId) -> Result<&Slot> {
        match self.slots.get(id.0 as usize) {
            Some(s) if s.refs > 0 => Ok(s),
            _ => crate::bail!(Internal, "granule pool: granule {} is not live", id.0),
        }
    }

    /// The physical handle of a live granule.
    pub fn phys(&self, id: GranuleId) -> Result<&PhysMem> {
        self.slot(id)?
            .phys
            .as_ref()
            .ok_or_else(|| crate::Error::internal(format!("granule pool: granule {} has no handle", id.0)))
    }

    pub fn refs(&self, id: GranuleId) -> u32 {
        self.slots.get(id.0 as usize).map_or(0, |s| s.refs)
    }

    /// One more reference (a new mapping). Never charges: the granule is live.
    pub fn add_ref(&mut self, id: GranuleId) -> Result<()> {
        self.slot(id)?;
        let s = &mut self.slots[id.0 as usize];
        s.refs = s.refs.checked_add(1).ok_or_else(|| crate::Error::internal("granule refcount overflow"))?;
        Ok(())
    }

    /// Drop a reference. The caller has already unmapped its mapping. On 1→0
    /// the granule is credited and its handle retained or released.
    pub fn release(&mut self, id: GranuleId) -> Result<()> {
        self.slot(id)?;
        let s = &mut self.slots[id.0 as usize];
        s.refs -= 1;
        if s.refs > 0 {
            return Ok(());
        }
        let phys = s.phys.take();
        self.free_slots.push(id.0);
        self.ledger.credit(id.0)?;
        if let Some(p) = phys {
            let held = self.ledger.stats();
            let retained_bytes = (self.retained.len() as u64 + 1) * self.granule as u64;
            if held.owned_bytes + held.promised_bytes + retained_bytes <= held.budget_bytes {
                self.retained.push(p);
            } else {
                drop(p);
                self.stats.released += 1;
            }
        }
        Ok(())
    }

    /// Release every retained handle to the driver; returns how many.
    pub fn trim(&mut self) -> u64 {
        let n = self.retained.len() as u64;
        self.retained.clear();
        self.stats.released += n;
        n
    }

    /// Keep retention within the budget after the promised axis grew.
    pub fn trim_to_budget(&mut self) {
        let held = self.ledger.stats();
        while !self.retained.is_empty()
            && held.owned_bytes + held.promised_bytes + (self.retained.len() * self.granule) as u64 > held.budget_bytes
        {
            self.retained.pop();
            self.stats.released += 1;
        }
    }
}
