//! Coalescing: runs of small weights adjacent in the declared cycle and in
//! host memory become one unit — one block, one copy, evicted together.
//! Copies of a few hundred KiB never reach the PCIe peak (2 MiB: 49 GB/s on
//! the H200, 8 MiB and up: 53–54).

use super::WeightId;
use super::manager::State;
use crate::error::Result;
use crate::residency::ResidencyManager;

impl ResidencyManager {
    /// Set the policy's cycle over the units of `order` (weights), and the
    /// plan state's; `declared`: `order` is the order declared (otherwise a
    /// later `declare_cycle` of any order regroups).
    pub(super) fn set_cycle(st: &mut State, order: &[WeightId], declared: bool) -> Result<()> {
        let mut units = Vec::with_capacity(order.len());
        for &w in order {
            let u = st.reg.leader(w)?;
            if units.last() != Some(&u) {
                units.push(u);
            }
        }
        st.policy.set_cycle(&units)?;
        st.plan.set_cycle(units, if declared { order.to_vec() } else { Vec::new() });
        Ok(())
    }

    /// Coalesce runs of small weights adjacent in `order` and in host memory.
    pub(super) fn group(&self, st: &mut State, order: &[WeightId]) -> Result<()> {
        // A unit is evicted whole: keep it a small share of the budget so
        // the policy still chooses at a fine grain.
        let (below, max) = (self.cfg.coalesce_below_bytes, self.cfg.coalesce_max_bytes.min(self.cfg.budget_bytes / 8));
        if below == 0 {
            return Ok(());
        }
        let mut run: Vec<WeightId> = Vec::new();
        let mut unit: Option<crate::device::HostRange> = None;
        for &w in order.iter().chain(std::iter::once(&WeightId(u32::MAX))) {
            // (the sentinel id closes the last run)
            let range = st.reg.get(w).ok().filter(|e| {
                e.range.len() < below
                    && e.coded.is_none()
                    && !e.resident()
                    && e.users == 0
                    && e.reg.is_none()
                    && e.members.is_empty()
            });
            let range = range.map(|e| e.range);
            let joined = match (range, unit) {
                (Some(r), Some(u)) if u.len() + r.len() <= max => u.join(&r).ok(),
                _ => None,
            };
            if let Some(j) = joined {
                run.push(w);
                unit = Some(j);
                continue;
            }
            if let (true, Some(u)) = (run.len() > 1, unit) {
                self.make_group(st, &run, u)?;
            }
            run.clear();
            unit = range;
            if range.is_some() {
                run.push(w);
            }
        }
        Ok(())
    }

    pub(super) fn make_group(&self, st: &mut State, run: &[WeightId], unit: crate::device::HostRange) -> Result<()> {
        let leader = run[0];
        let base = unit.ptr() as usize;
        for &m in &run[1..] {
            let e = st.reg.get_mut(m)?;
            e.leader = leader;
            e.offset = e.range.ptr() as usize - base;
        }
        let e = st.reg.get_mut(leader)?;
        e.unit = unit;
        e.members = run[1..].to_vec();
        st.reg.note_grouped(run.len() - 1);
        st.c.coalesced_weights += run.len() as u64;
        Ok(())
    }

    /// Undo a coalesced unit (evicting it if resident).
    pub(super) fn ungroup(&self, st: &mut State, u: WeightId) -> Result<()> {
        let e = st.reg.get(u)?;
        if e.members.is_empty() {
            return Ok(());
        }
        crate::ensure!(e.users == 0, InvalidState, "weight {} (coalesced) is acquired: release it first", u.0);
        if e.resident() {
            self.evict(st, u)?;
        }
        let e = st.reg.get_mut(u)?;
        let members = std::mem::take(&mut e.members);
        e.unit = e.range;
        st.c.coalesced_weights -= members.len() as u64 + 1;
        st.reg.note_ungrouped(members.len());
        for m in members {
            let e = st.reg.get_mut(m)?;
            e.leader = m;
            e.offset = 0;
        }
        Ok(())
    }
}
