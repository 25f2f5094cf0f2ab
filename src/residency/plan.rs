//! Installing a plan ([`super::placement`]) and paging streamed units
//! through its ring ([`super::ring`]).

use std::time::Instant;

use super::WeightId;
use super::manager::State;
use super::placement::{self, Plan};
use super::registry::Loc;
use super::ring::{Ring, RingSlot, Span};
use crate::arena::Arena;
use crate::error::{Error, Result};
use crate::residency::{PolicyKind, ResidencyManager};

/// What a page-in into the ring did.
pub(super) enum RingPageIn {
    Done,
    /// A prefetch that would overwrite a weight not used yet, or one held.
    GaveUp,
    /// A demand page-in the ring cannot take now (an occupant it would
    /// overwrite is held): the caller holds more than the plan assumed.
    Blocked,
}

impl ResidencyManager {
    /// The plan the declared cycle wants now (units in cycle order), for
    /// weights given `budget` bytes.
    pub(super) fn wanted_plan(&self, st: &State, budget: usize) -> Result<Option<Plan>> {
        let cycle = st.plan.cycle();
        if !self.cfg.stream_plan || self.cfg.policy != PolicyKind::Cyclic || cycle.is_empty() || st.plan.ring_off() {
            return Ok(None);
        }
        let sizes: Vec<usize> = cycle.iter().map(|&u| st.reg.get(u).map(|e| e.dev_len())).collect::<Result<_>>()?;
        let hold = st.plan.hold();
        let whole = self.whole_plan(st, &sizes, budget, &hold);
        // Only for a caller seen over a whole cycle holding one unit at a
        // time: the first cycle after a declaration runs the whole-weight
        // plan, the next re-plans (one refill).
        if hold.width > 1 || !self.cfg.split_weights || !st.plan.single_holds_seen() {
            return Ok(whole);
        }
        // Per weight: streaming part of each weight needs a ring of one or
        // two tails instead of the largest weight streamed. Take it when it
        // streams fewer bytes than the whole-weight plan, or than
        // farthest-next-use alone (which streams about (total − budget) plus
        // one weight, for weights of about one size).
        let granule = self.dev.vmm_granularity();
        let aligns: Vec<usize> = cycle
            .iter()
            .zip(&sizes)
            .map(|(&u, &len)| {
                let e = st.reg.get(u)?;
                Ok(match &e.coded {
                    // Heads end on a frame (a tail decodes whole frames).
                    Some(k) if k.frames.len() > 1 => k.frames[0].desc.raw_len().next_multiple_of(granule),
                    Some(_) => len,
                    // A coalesced unit's members are small: streamed whole.
                    None if !e.members.is_empty() => len,
                    None => granule,
                })
            })
            .collect::<Result<_>>()?;
        // Compressed tails copy into the decode staging, not the ring: one
        // slot serves (each decode waits on the device for the read of the
        // tail before it), and its bytes go to heads. A raw tail's copy lands
        // in the ring itself: two slots, so it runs during the read before.
        let coded = cycle.iter().all(|&u| st.reg.get(u).is_ok_and(|e| e.coded.is_some()));
        let slots = if coded { 1 } else { 2 };
        let Some(split) = placement::split_plan(&sizes, &aligns, granule, budget, slots) else {
            return Ok(whole);
        };
        let other = whole.as_ref().map_or(placement::farthest_next_use_bytes(&sizes, budget), |p| p.streamed_bytes);
        Ok(if split.streamed_bytes < other { Some(split) } else { whole })
    }

    /// The whole-weight plan ([`placement::plan`]) for `sizes` (the cycle's
    /// units), or `None` where farthest-next-use alone is best.
    fn whole_plan(&self, st: &State, sizes: &[usize], budget: usize, hold: &placement::Hold) -> Option<Plan> {
        let (lo, hi) = (sizes.iter().min().copied().unwrap_or(0), sizes.iter().max().copied().unwrap_or(0));
        // Equal sizes (within the 25% an ordered reuse tolerates), acquired
        // around each weight: every victim's block takes the next weight,
        // nothing fragments, and farthest-next-use is Belady's optimum — keep
        // it. A caller holding several at once is not served by it (a held
        // window's weights all stay resident; farthest-next-use streamed
        // about twice (total − budget) with blocks of 7): that gets a plan.
        if hi <= lo + lo / 4 && st.plan.hold_width() == 1 {
            return None;
        }
        // Planned for the fewest bytes, whatever depth the caller asked for:
        // each weight of prefetch window the ring keeps room for is a weight
        // less of resident set, so about one weight more streamed per step
        // (with held blocks, nb/(nb − 1) of one). Around each weight the
        // window of one costs nothing (the ring holds the largest streamed
        // weight either way); with held blocks it is left out, and the next
        // block's copies land on the block just read, ordered behind its
        // reads on the device: the copy engine waits for one block's compute
        // (about 1% of a PCIe-bound decode step). Prefetches still run, into
        // ring bytes whose occupant was read already (`ring_page_in` gives
        // up otherwise), so depth buys overlap, never bytes.
        let window = if hold.width > 1 { 0 } else { 1 };
        placement::plan(sizes, budget, hold, window)
    }

    /// Before unit `w` is acquired: with nothing held, install a plan if one
    /// is due. Re-plans at the first moment nothing is held (sliding
    /// windows: the hold starts are not known yet), and again when the cycle
    /// wraps, on the hold starts seen over one whole cycle.
    pub(super) fn replan_if_idle(&self, st: &mut State, w: WeightId) -> Result<()> {
        if st.plan.replan_due(w) {
            self.install_plan(st)?;
        }
        Ok(())
    }

    /// Install the plan the cycle wants, with the decode staging it needs
    /// ([`Self::plan_with_staging`]; no unit may be held). A different plan
    /// or staging evicts everything first, waiting on the host: this happens
    /// on declare_cycle, when a caller first holds more units at once than
    /// the plan assumed, and when a registration needs more staging, never in
    /// steady state.
    pub(super) fn install_plan(&self, st: &mut State) -> Result<()> {
        st.plan.clear_replan();
        let (want, cap) = self.plan_with_staging(st)?;
        let same_staging = cap == st.ledger.staging_cap();
        if same_staging && want.as_ref().is_some_and(|p| st.plan.installed_as(p)) {
            return Ok(());
        }
        if same_staging && st.plan.plan().is_none() && want.is_none() {
            return Ok(());
        }
        let ids: Vec<WeightId> = st.reg.ids().collect();
        for w in ids {
            if st.reg.get(w)?.resident() {
                self.evict(st, w)?;
            }
        }
        Self::release_ring(st);
        if !same_staging {
            // Nothing is resident: the staging takes its bytes of the budget
            // before the ring and the resident set take theirs.
            self.set_staging(st, cap)?;
        }
        let Some(p) = want else { return Ok(()) };
        let made = if p.splits() {
            // Its own memory: the arena's chunks the evictions emptied go
            // back first, so the device holds the budget, not the budget
            // twice.
            self.arena.trim()?;
            let spans: Vec<Span> = st
                .plan
                .cycle()
                .iter()
                .enumerate()
                .filter(|&(i, _)| p.heads[i] > 0)
                .map(|(i, &u)| Ok(Span { head: p.heads[i], len: st.reg.get(u)?.dev_len(), ring_off: p.offsets[i] }))
                .collect::<Result<_>>()?;
            Ring::new_split(&self.dev, p.ring_bytes, &spans)
        } else {
            Ring::new(&self.arena, p.ring_bytes)
        };
        let ring = match made {
            Ok(r) => r,
            Err(e) => {
                log::warn!("epmem: no streaming region of {} bytes ({e}); farthest-next-use alone", p.ring_bytes);
                return Ok(());
            }
        };
        st.ledger.charge_ring(ring.charged());
        st.plan.install(p, ring);
        st.c.plans += 1;
        Ok(())
    }

    /// Page streamed unit `w` into the ring. Whatever it overwrites was
    /// released (or is idle): its bytes are handed on behind its readers by
    /// the order stream, so the host never waits.
    pub(super) fn ring_page_in(&self, st: &mut State, w: WeightId, demand: bool) -> Result<RingPageIn> {
        // A split unit's ring bytes are its tail's.
        let split = st.plan.split_of(w);
        let len = st.reg.get(w)?.dev_len() - split.map_or(0, |(head, _)| head);
        let spot = st.plan.ring_offset(w).and_then(|o| Some((o, st.plan.ring()?.spot(o, len)?)));
        let Some((off, victims)) = spot else {
            return Ok(if demand { RingPageIn::Blocked } else { RingPageIn::GaveUp });
        };
        for &v in &victims {
            let e = st.reg.get(v)?;
            // A prefetch overwrites the unit just released only when its
            // copy can run before that read ends (`shielded`: a background
            // fill, or a compressed copy into the decode staging): a
            // coalesced unit is acquired once per member in a row, and
            // otherwise the demand page-in of the next unit orders the same
            // copy behind the same read anyway.
            if e.users > 0 || (!demand && (e.prefetched || self.shielded(st, v, w))) {
                return Ok(if demand { RingPageIn::Blocked } else { RingPageIn::GaveUp });
            }
        }
        for &v in &victims {
            // Accounted gone first: if ordering fails, dropping the slot
            // waits for its readers on the host, and the ring stays consistent.
            let Some(slot) = Self::take_ring_slot(st, v)? else { continue };
            st.c.ordered_reuses += 1;
            let spent = slot.order_before(&st.order)?;
            st.spare.extend(spent);
        }
        self.maybe_register(st, w)?;
        let Some(ring) = st.plan.ring_mut() else {
            return Ok(RingPageIn::Blocked);
        };
        let addr = ring.occupy(w, off, len);
        // A split unit is read at its own address: its head, then its tail
        // mapped onto `addr`. Its first page-in under this plan copies the
        // head too; later ones, the tail. Those are ordered after the first
        // on the device: each lands on ring bytes whose last occupant was
        // handed on through the order stream (its page-in fence included)
        // or waited for, and this unit's earlier page-in was such an
        // occupant before this one could start.
        let (addr, from) = match split {
            Some((head, i)) => match ring.span(i) {
                Some((base, copied)) => (base, if copied { head } else { 0 }),
                None => {
                    ring.vacate(w);
                    return Err(Error::internal(format!("split unit {} has no span in the ring", w.0)));
                }
            },
            None => (addr, 0),
        };
        let fence = match self.copy_in(st, w, addr, from, true, demand) {
            Ok(f) => {
                if let (Some((_, i)), Some(ring)) = (split, st.plan.ring_mut()) {
                    ring.note_head_copied(i);
                }
                f
            }
            Err(e) => {
                if let Some(ring) = st.plan.ring_mut() {
                    ring.vacate(w);
                }
                return Err(e);
            }
        };
        if self.cfg.sync_page_in {
            let t = Instant::now();
            fence.wait()?;
            st.c.host_stall_ns += t.elapsed().as_nanos() as u64;
        }
        let e = st.reg.get_mut(w)?;
        debug_assert!(!e.resident(), "weight {} paged into the ring while resident", w.0);
        e.loc = Loc::Ring(RingSlot::new(addr, fence));
        e.prefetched = !demand;
        st.ledger.charge_ring_unit();
        st.c.ring_weights += 1;
        st.c.page_ins += 1;
        st.c.ring_page_ins += 1;
        st.c.prefetch_page_ins += !demand as u64;
        st.c.pending_prefetches += !demand as u64;
        Ok(RingPageIn::Done)
    }

    /// A demand page-in found no room: the ring's bytes and the planned
    /// residents' are all taken, and what holds them is acquired. With one
    /// caller that means it holds more than the budget allows; with callers
    /// walking the cycle concurrently (two decoders on one manager) a unit
    /// paged in beside the ring while another caller held its spot takes a
    /// planned resident's bytes, and the next demand for that resident finds
    /// them held — though the ring itself may hold nothing acquired. Then the
    /// ring goes (its occupants waited for on the host, the device
    /// synchronized: never in steady state), and page-ins go through the
    /// arena by farthest-next-use alone until a new cycle is declared: a ring
    /// laid out for one walker would block again. Returns whether it went;
    /// a ring with an acquired occupant stays.
    pub(super) fn drop_ring(&self, st: &mut State) -> Result<bool> {
        let Some(streamed) = st.plan.streamed() else {
            return Ok(false);
        };
        let mut occupants = Vec::new();
        for &v in streamed {
            // A unit unregistered under the plan (the cycle changed while
            // another was held) left the device when it went.
            let Ok(e) = st.reg.get(v) else { continue };
            if e.loc.is_ring() {
                if e.users > 0 {
                    return Ok(false);
                }
                occupants.push(v);
            }
        }
        for v in occupants {
            self.evict_slot(st, v)?;
        }
        Self::release_ring(st);
        st.plan.turn_ring_off();
        st.c.dropped_rings += 1;
        log::info!("epmem: callers walk the cycle concurrently; streaming without a ring until a cycle is declared");
        Ok(true)
    }

    /// Give the ring back (its occupants already evicted) and forget the
    /// plan. The ring's drop synchronizes the device, so queued background
    /// copies are put onto a stream first.
    fn release_ring(st: &mut State) {
        if let Some(f) = st.fill.as_ref() {
            f.drain();
        }
        if let Some(r) = st.plan.release() {
            st.ledger.credit_ring(r.charged());
        }
    }

    /// Evict streamed unit `v` on the host's side (unregister, re-plan):
    /// waits for its readers.
    pub(super) fn evict_slot(&self, st: &mut State, v: WeightId) -> Result<()> {
        let Some(mut slot) = Self::take_ring_slot(st, v)? else {
            return Ok(());
        };
        let spent_early = slot.prune()?;
        st.spare.extend(spent_early);
        let pending = !slot.page_in_done()? || slot.pending() > 0;
        let t = Instant::now();
        let spent = slot.wait()?;
        if pending {
            st.c.eviction_waits += 1;
            st.c.host_stall_ns += t.elapsed().as_nanos() as u64;
        }
        st.spare.extend(spent);
        st.policy.removed(v);
        Ok(())
    }

    /// Take streamed unit `v`'s ring slot out of the books (a prefetch never
    /// read counts as wasted, its ring bytes are vacated, one eviction); the
    /// caller then hands the slot's bytes on or waits for its readers.
    fn take_ring_slot(st: &mut State, v: WeightId) -> Result<Option<RingSlot>> {
        let e = st.reg.get_mut(v)?;
        let Some(slot) = e.loc.take_ring() else {
            return Ok(None);
        };
        if std::mem::take(&mut e.prefetched) {
            st.c.pending_prefetches -= 1;
            st.c.wasted_prefetches += 1;
        }
        if let Some(r) = st.plan.ring_mut() {
            r.vacate(v);
        }
        st.ledger.credit_ring_unit();
        st.c.ring_weights -= 1;
        st.c.evictions += 1;
        Ok(Some(slot))
    }
}
