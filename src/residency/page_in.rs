//! Page-ins: making room, choosing the source path (registering a pageable
//! source on first use where allowed), issuing the copy, and prefetching
//! along the declared cycle.

use std::time::Instant;

use super::WeightId;
use super::manager::{Need, Room, State};
use super::plan::RingPageIn;
use super::read_fence::Fenced;
use super::registry::{Loc, RegState, RegisterSources};
use crate::error::Result;
use crate::residency::ResidencyManager;

impl ResidencyManager {
    /// Page `w` in, for the reason `need` gives (a prefetch gives up,
    /// Ok(false), rather than evict what it may not).
    pub(super) fn page_in(&self, st: &mut State, w: WeightId, need: Need) -> Result<bool> {
        let demand = need.demand();
        if st.plan.streams(w) {
            match self.ring_page_in(st, w, demand)? {
                RingPageIn::Done => return Ok(true),
                RingPageIn::GaveUp => return Ok(false),
                // Held occupants: this caller holds more units at once than
                // the plan assumed. Page in through the arena this time (the
                // budget still holds: resident units make room) and re-plan
                // once nothing is held.
                // Holds not aligned as assumed fall back to sliding windows.
                RingPageIn::Blocked => st.plan.note_blocked(),
            }
        }
        let len = st.reg.get(w)?.dev_len();
        let reused = match self.make_room(st, w, len, need)? {
            Room::No => return Ok(false),
            Room::Reuse(r) => Some(r),
            Room::Fits => None,
        };
        self.maybe_register(st, w)?;
        let range = st.reg.get(w)?.unit;
        let fenced = match reused {
            Some(r) if st.reg.get(w)?.coded.is_some() => {
                let order = st.order.raw();
                r.fill_with(len, |dst| self.compressed_in(st, w, dst, 0, Some(order)))?
            }
            Some(r) => {
                let order = st.order.raw();
                r.fill(self.copier(st, w, demand)?, range, order)?
            }
            None => {
                let block = self.alloc_block(st, w, len, need)?;
                let Some(block) = block else { return Ok(false) };
                let fence = self.copy_in(st, w, block.addr(), 0, false, demand)?;
                Fenced::new(block, fence)
            }
        };
        if self.cfg.sync_page_in {
            if let Some(f) = fenced.page_in() {
                let t = Instant::now();
                f.wait()?;
                st.c.host_stall_ns += t.elapsed().as_nanos() as u64;
            }
        }
        let e = st.reg.get_mut(w)?;
        debug_assert!(!e.resident(), "weight {} paged in while resident", w.0);
        e.loc = Loc::Block(fenced);
        e.prefetched = !demand;
        st.ledger.charge_block(len);
        st.policy.inserted(w);
        st.c.page_ins += 1;
        st.c.prefetch_page_ins += !demand as u64;
        st.c.pending_prefetches += !demand as u64;
        Ok(true)
    }

    /// Register `w`'s pageable source on its first page-in, per the config.
    pub(super) fn maybe_register(&self, st: &mut State, w: WeightId) -> Result<()> {
        let (range, state) = {
            let e = st.reg.get(w)?;
            (e.unit, e.reg_state)
        };
        if state != RegState::Untried
            || self.cfg.register_sources == RegisterSources::Never
            || self.dev.host_is_page_locked(range.ptr(), range.len())
        {
            return Ok(());
        }
        let within = match (self.cfg.register_sources, st.memlock) {
            (RegisterSources::WithinMemlock, Some(limit)) => st.c.registered_bytes + range.len() as u64 <= limit,
            _ => true,
        };
        let result = if within { Some(self.engine.register(range)) } else { None };
        let e = st.reg.get_mut(w)?;
        match result {
            Some(Ok(r)) => {
                e.reg = Some(r);
                e.reg_bytes = range.len();
                e.reg_state = RegState::Registered;
                st.c.source_registrations += 1;
                st.c.registered_bytes += range.len() as u64;
            }
            Some(Err(err)) => {
                log::info!("epmem: staging weight {} (registering its source failed: {err})", w.0);
                e.reg_state = RegState::Refused;
                st.c.register_refusals += 1;
            }
            None => {
                e.reg_state = RegState::Refused;
                st.c.register_refusals += 1;
            }
        }
        Ok(())
    }

    /// Keep up to `prefetch_depth` weights ahead of `w` in the cycle paged in
    /// and not yet used: walk forward past resident weights to the next
    /// missing ones. Skipping resident weights matters: Belady's resident
    /// set is a run of the cycle, so misses come in runs, and the copies of
    /// the next run must start while the hit run computes.
    ///
    /// Only the first unit of the window may evict ([`Need::Prefetch`]);
    /// the rest go only where nothing has to leave for them (free budget, or
    /// ring bytes whose occupant was read already), so a deeper window
    /// overlaps more but never copies a byte the depth-1 schedule would not.
    pub(super) fn prefetch_ahead(&self, st: &mut State, w: WeightId) -> Result<()> {
        // Every unit on the device (a budget that holds them all, after the
        // first pass): nothing to page in, and no walk over the cycle on
        // each release.
        if st.all_resident() {
            return Ok(());
        }
        let Some(p) = st.plan.pos(w) else { return Ok(()) };
        let n = st.plan.cycle().len();
        let mut ahead = 0;
        // Positions hold units (leaders), so `x` below is a leader.
        for k in 1..n {
            if ahead >= self.cfg.prefetch_depth {
                break;
            }
            let x = st.plan.cycle()[(p + k) % n];
            let e = st.reg.get(x)?;
            if !e.resident() {
                let need = if ahead == 0 { Need::Prefetch } else { Need::PrefetchIntoFree };
                if !self.page_in(st, x, need)? {
                    break;
                }
                ahead += 1;
            } else if e.prefetched {
                ahead += 1;
            }
        }
        Ok(())
    }
}
