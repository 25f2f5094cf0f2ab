//! VA reservations as granule mapping tables, and windows onto them.
//!
//! A [`VaTable`] is one VA reservation whose granules are mapped one by one;
//! it knows which are mapped (one flag per granule, so a batch of 128 slots ×
//! 384 granules maps and unmaps in O(1) each, not by a scan of every mapping).
//! A [`Window`] is a granule-aligned piece of a table that one sequence owns:
//! a standalone sequence's window is its own whole table, a batch slot's
//! window is the slot's stride inside the batch's table. The sequence code
//! (prepare_append, copy-on-write, pin, teardown) only ever sees its window,
//! so slots and standalone sequences share every line of it.
//!
//! Dropping a table unmaps whatever is still mapped, then frees the VA
//! (teardown order: unmap → release handle → free VA; handles are released by
//! the granule pool, after the mappings that use them are gone).

use std::sync::{Arc, Mutex, MutexGuard};

use crate::device::{Access, Device, DevicePtr, PhysMem};
use crate::error::Result;

#[derive(Debug)]
pub(crate) struct VaTable {
    dev: Arc<dyn Device>,
    base: DevicePtr,
    granule: usize,
    mapped: Vec<bool>,
}

impl VaTable {
    /// Reserve `granules` granules of VA, nothing mapped.
    pub fn reserve(dev: &Arc<dyn Device>, granules: usize) -> Result<Self> {
        let g = dev.vmm_granularity();
        let bytes = granules.checked_mul(g).filter(|&b| b > 0 && b <= isize::MAX as usize).ok_or_else(|| {
            crate::Error::invalid_argument(format!("VA reservation of {granules} granules of {g} bytes"))
        })?;
        let base = dev.vmm_reserve(bytes, 0)?;
        Ok(Self { dev: dev.clone(), base, granule: g, mapped: vec![false; granules] })
    }

    fn check(&self, i: usize, want_mapped: bool) -> Result<DevicePtr> {
        match self.mapped.get(i) {
            Some(&m) if m == want_mapped => Ok(self.base + (i * self.granule) as u64),
            Some(_) => crate::bail!(
                InvalidState,
                "granule {i} of the reservation at {:#x} is {}",
                self.base,
                if want_mapped { "not mapped" } else { "already mapped" }
            ),
            None => crate::bail!(Internal, "granule {i} outside a reservation of {} granules", self.mapped.len()),
        }
    }

    /// Map one granule handle at granule `i` with `access`. All or nothing.
    pub fn map(&mut self, i: usize, phys: &PhysMem, access: Access) -> Result<()> {
        let va = self.check(i, false)?;
        self.dev.vmm_map(va, self.granule, phys.raw(), 0)?;
        if let Err(e) = self.dev.vmm_set_access(va, self.granule, access) {
            crate::device::objects::log_drop_error(
                "vmm_unmap after failed set_access",
                self.dev.vmm_unmap(va, self.granule),
            );
            return Err(e);
        }
        self.mapped[i] = true;
        Ok(())
    }

    pub fn unmap(&mut self, i: usize) -> Result<()> {
        let va = self.check(i, true)?;
        self.dev.vmm_unmap(va, self.granule)?;
        self.mapped[i] = false;
        Ok(())
    }

    pub fn set_access(&self, i: usize, access: Access) -> Result<()> {
        let va = self.check(i, true)?;
        self.dev.vmm_set_access(va, self.granule, access)
    }
}

impl Drop for VaTable {
    fn drop(&mut self) {
        for i in 0..self.mapped.len() {
            if self.mapped[i] {
                let va = self.base + (i * self.granule) as u64;
                crate::device::objects::log_drop_error("vmm_unmap", self.dev.vmm_unmap(va, self.granule));
            }
        }
        let len = self.mapped.len() * self.granule;
        crate::device::objects::log_drop_error("vmm_free_va", self.dev.vmm_free_va(self.base, len));
    }
}

/// Granules `[first, first + granules)` of a table, addressed from 0.
///
/// The table sits behind a mutex only so a batch and its slots can share it;
/// every call already holds the KV pool's `&mut`, so the lock is never contended.
#[derive(Debug)]
pub(crate) struct Window {
    table: Arc<Mutex<VaTable>>,
    first: usize,
    granules: usize,
    base: DevicePtr,
    granule: usize,
}

impl Window {
    /// A new reservation of `granules` granules, all of it this window's.
    pub fn reserve(dev: &Arc<dyn Device>, granules: usize) -> Result<Self> {
        Self::whole(Arc::new(Mutex::new(VaTable::reserve(dev, granules)?)))
    }

    /// The whole of `table`.
    pub fn whole(table: Arc<Mutex<VaTable>>) -> Result<Self> {
        let n = lock(&table).mapped.len();
        Self::part(&table, 0, n)
    }

    /// Granules `[first, first + granules)` of `table`.
    pub fn part(table: &Arc<Mutex<VaTable>>, first: usize, granules: usize) -> Result<Self> {
        let t = lock(table);
        crate::ensure!(
            granules > 0 && first.checked_add(granules).is_some_and(|e| e <= t.mapped.len()),
            Internal,
            "window [{first}, +{granules}) outside a reservation of {} granules",
            t.mapped.len()
        );
        let (base, granule) = (t.base + (first * t.granule) as u64, t.granule);
        drop(t);
        Ok(Self { table: table.clone(), first, granules, base, granule })
    }

    pub fn base(&self) -> DevicePtr {
        self.base
    }

    /// Bytes of VA in the window.
    pub fn len(&self) -> usize {
        self.granules * self.granule
    }

    fn at(&self, i: usize) -> Result<usize> {
        crate::ensure!(i < self.granules, Internal, "granule {i} outside a window of {} granules", self.granules);
        Ok(self.first + i)
    }

    pub fn map(&self, i: usize, phys: &PhysMem, access: Access) -> Result<()> {
        let i = self.at(i)?;
        lock(&self.table).map(i, phys, access)
    }

    pub fn unmap(&self, i: usize) -> Result<()> {
        let i = self.at(i)?;
        lock(&self.table).unmap(i)
    }

    pub fn set_access(&self, i: usize, access: Access) -> Result<()> {
        let i = self.at(i)?;
        lock(&self.table).set_access(i, access)
    }

    pub fn is_mapped(&self, i: usize) -> bool {
        self.at(i).is_ok_and(|i| lock(&self.table).mapped[i])
    }
}

fn lock(t: &Mutex<VaTable>) -> MutexGuard<'_, VaTable> {
    // Every mutation of the table is one flag after one driver call: a
    // poisoned table still describes the real mappings.
    t.lock().unwrap_or_else(|p| p.into_inner())
}
