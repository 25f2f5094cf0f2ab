//! Eviction: making room under the budget, choosing victims, and giving
//! memory back only behind its readers (host-observed with `ReadsDone`, or
//! device-ordered into the next page-in with `Reused`).

use std::time::Instant;

use super::WeightId;
use super::manager::{Need, Room, State};
use super::read_fence::{DeviceBlock, TryReadsDone};
use crate::error::{EpmStatus, Error, Result};
use crate::residency::ResidencyManager;

impl ResidencyManager {
    /// A fresh arena block of `len` bytes, evicting more while the arena has
    /// the bytes but not in one range. `None`: a prefetch that gives up.
    pub(super) fn alloc_block(
        &self,
        st: &mut State,
        w: WeightId,
        len: usize,
        need: Need,
    ) -> Result<Option<DeviceBlock>> {
        let demand = need.demand();
        Ok(Some(loop {
            match DeviceBlock::alloc(&self.arena, len) {
                Ok(b) => break b,
                // The arena has the bytes but not in one range: evict more.
                Err(e) if e.status() == EpmStatus::OutOfBudget => match self.victim(st, w, need) {
                    Some(v) => self.evict(st, v)?,
                    None if demand && self.drop_ring(st)? => {}
                    None if demand => return Err(self.all_in_use(st, w, len)),
                    None => return Ok(None),
                },
                Err(e) => return Err(e),
            }
        }))
    }

    /// Evict until `len` more bytes fit the budget. When the last victim
    /// needed is still being read and its block fits `len` (without wasting
    /// more than a quarter of it), hand its block to this page-in, ordered
    /// on the device behind the readers, instead of waiting on the host.
    pub(super) fn make_room(&self, st: &mut State, w: WeightId, len: usize, need: Need) -> Result<Room> {
        let demand = need.demand();
        while st.ledger.resident_bytes() + len > self.budget(st) {
            let Some(v) = self.victim(st, w, need) else {
                if demand && self.drop_ring(st)? {
                    continue;
                }
                return if demand { Err(self.all_in_use(st, w, len)) } else { Ok(Room::No) };
            };
            let e = st.reg.get(v)?;
            let vlen = e.dev_len();
            let reusable =
                e.loc.block().is_some_and(|b| (len..=len + len / 4).contains(&b.len()) && !b.is_idle().unwrap_or(true));
            if reusable && !self.cfg.sync_page_in && st.ledger.resident_bytes() - vlen + len <= self.budget(st) {
                let e = st.reg.get_mut(v)?;
                let Some(fenced) = e.loc.take_block() else { continue };
                if std::mem::take(&mut e.prefetched) {
                    st.c.pending_prefetches -= 1;
                    st.c.wasted_prefetches += 1;
                }
                // Reads fenced only by a device synchronize (released while
                // every unit was resident) make the host wait here: count it.
                let unfenced = fenced.has_unfenced_reads();
                let t = Instant::now();
                let reused = fenced.reuse_after(&st.order)?;
                if unfenced {
                    st.c.eviction_waits += 1;
                    st.c.host_stall_ns += t.elapsed().as_nanos() as u64;
                }
                self.forget(st, v, vlen);
                st.c.ordered_reuses += 1;
                return Ok(Room::Reuse(reused));
            }
            self.evict(st, v)?;
        }
        Ok(Room::Fits)
    }

    /// The policy's best victim that is not acquired and is not `target`;
    /// for a prefetch, only one needed later than `target`; none for a
    /// prefetch that may not evict.
    ///
    /// A prefetch takes the policy's first choice or nothing: when that is
    /// the unit just released, which it must leave alone (`shielded`), the
    /// next acquire's demand page-in takes it instead, ordered behind its
    /// read. Taking the second choice would keep one more unit live than
    /// the demand schedule does, a unit of streamed bytes per step.
    pub(super) fn victim(&self, st: &State, target: WeightId, need: Need) -> Option<WeightId> {
        if need == Need::PrefetchIntoFree {
            return None;
        }
        let limit = if need.demand() { None } else { st.policy.distance(target) };
        let v = st.policy.candidates().find(|&v| {
            v != target
                && st.reg.get(v).is_ok_and(|e| e.users == 0 && e.loc.is_block())
                && match (limit, st.policy.distance(v)) {
                    (Some(t), Some(d)) => d > t,
                    _ => true,
                }
        })?;
        (!self.shielded(st, v, target)).then_some(v)
    }

    /// Evict `v`: its memory goes back to the arena only with a [`ReadsDone`]
    /// witness, waiting on the host if its readers are still running.
    ///
    /// [`ReadsDone`]: super::read_fence::ReadsDone
    pub(super) fn evict(&self, st: &mut State, v: WeightId) -> Result<()> {
        if st.reg.get(v)?.loc.is_ring() {
            return self.evict_slot(st, v);
        }
        let e = st.reg.get_mut(v)?;
        // The budget was charged the unit's bytes; a reused block may be up
        // to a quarter longer (charging its length undercounted the budget).
        let len = e.dev_len();
        let Some(fenced) = e.loc.take_block() else { return Ok(()) };
        if std::mem::take(&mut e.prefetched) {
            st.c.pending_prefetches -= 1;
            st.c.wasted_prefetches += 1;
        }
        let (done, spent) = match fenced.try_complete()? {
            TryReadsDone::Done(d, s) => (d, s),
            TryReadsDone::Pending(f) => {
                st.c.eviction_waits += 1;
                let t = Instant::now();
                let r = f.wait()?;
                st.c.host_stall_ns += t.elapsed().as_nanos() as u64;
                r
            }
        };
        done.free();
        st.spare.extend(spent);
        self.forget(st, v, len);
        Ok(())
    }

    /// Account `v` (`len` bytes) as no longer resident.
    pub(super) fn forget(&self, st: &mut State, v: WeightId, len: usize) {
        st.ledger.credit_block(len);
        st.policy.removed(v);
        st.c.evictions += 1;
    }

    pub(super) fn all_in_use(&self, st: &State, w: WeightId, len: usize) -> Error {
        let (mut held, mut held_bytes) = (0, 0);
        for v in st.reg.ids() {
            if let Ok(e) = st.reg.get(v)
                && e.users > 0
                && v != w
            {
                held += 1;
                held_bytes += e.dev_len();
            }
        }
        let ring = st.plan.ring().map_or(String::new(), |r| format!(", {} of them the streaming region", r.cap()));
        Error::new(
            EpmStatus::AllInUse,
            format!(
                "weight {} ({len} bytes) does not fit: {} of {} budget bytes are resident ({} weights{ring}) \
                 and what could make room is acquired and not released ({held} weights, {held_bytes} bytes); \
                 release weights or raise the budget",
                w.0,
                st.ledger.resident_bytes(),
                self.budget(st),
                st.ledger.resident_weights()
            ),
        )
    }
}
