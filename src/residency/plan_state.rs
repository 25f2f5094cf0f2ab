//! The declared cycle and the streaming plan's bookkeeping: what the manager
//! knows about the order weights are used in and how the caller holds them,
//! and the plan installed for that.
//!
//! Owns: the cycle (page-in units in declared order) and each unit's
//! position in it; the order last passed to `declare_cycle`; the holds seen
//! (units acquired now, the most at once, where the current hold began, the
//! cycle positions where holds began and what they are worth to the
//! planner); whether a new plan is due; and the streaming state — no plan,
//! a plan with its ring and the units it streams, or the ring dropped until
//! a cycle is declared again.
//!
//! Invariant ([`PlanState::check`]): the positions index the cycle exactly
//! (each unit's position is its index, so no unit appears twice); there is
//! one hold-start flag per position; the units held now are at most the
//! most seen at once, and an installed plan assumed no wider hold than that;
//! an installed plan's ring is its `ring_bytes`, each of its positions is
//! either resident (no ring offset) or streamed at an offset inside the
//! ring, and its streamed units are as many as its streamed positions (at
//! least one). A plan is by cycle position and may outlive the cycle it was
//! made for (a cycle declared or shrunk while units are held): a new plan is
//! then due, installed at the next moment nothing is held.
//!
//! Who mutates it: only the methods below, called by the manager — hold and
//! release accounting from `acquire`/`release` ([`PlanState::note_hold`],
//! [`PlanState::note_release`]), the cycle from `set_cycle` (`declare_cycle`,
//! `unregister`), a plan from `install_plan`, a blocked ring page-in from
//! `page_in`, and the dropped ring from `drop_ring`. What it agrees with
//! outside itself (the ledger charges the ring's bytes, ring occupants are
//! streamed units, `held` counts the units acquired) is checked by
//! `State::check`.

use std::collections::{HashMap, HashSet};

use super::WeightId;
use super::placement::{Hold, Plan};
use super::ring::Ring;

/// What the recorded hold starts are worth to the planner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Starts {
    /// Not yet recorded over a whole cycle at the widest hold.
    Partial,
    /// Recorded over a whole cycle since the widest hold was first seen: a
    /// plan may assume holds begin only there (a block hook's blocks).
    Seen,
    /// A plan on the starts was blocked by a held weight: holds are not
    /// aligned as observed, so every later plan assumes sliding windows
    /// (for the manager's life).
    Sliding,
}

/// The streaming state.
#[derive(Debug)]
#[allow(clippy::large_enum_variant, reason = "one per manager, replaced only when a plan is installed or dropped")]
enum Streaming {
    /// No plan: farthest-next-use alone.
    Unplanned,
    /// A plan, its streaming region, and the units it streams (those at its
    /// streamed positions of the cycle it was made for), with the splits of
    /// the split ones as installed: (head bytes, span index in the ring,
    /// ring offset). Keyed by unit, not by position: a split unit's memory
    /// is mapped for it, and stays its own until the plan goes, even when
    /// the cycle changes under the plan.
    Planned { plan: Plan, ring: Ring, streamed: HashSet<WeightId>, splits: HashMap<WeightId, (usize, usize, usize)> },
    /// Callers walk the cycle concurrently: the ring was dropped, and no plan
    /// is made again until a new cycle is declared.
    RingOff,
}

#[derive(Debug)]
pub(super) struct PlanState {
    /// The declared cycle (units) and each unit's position in it.
    cycle: Vec<WeightId>,
    cycle_pos: HashMap<WeightId, usize>,
    /// The order last passed to `declare_cycle` (cleared when a weight leaves it).
    declared: Vec<WeightId>,
    streaming: Streaming,
    /// Units acquired and not released, and the most seen at once.
    held: usize,
    max_held: usize,
    /// Where the current hold began (a cycle position; meaningful while `held > 0`).
    hold_began: usize,
    /// Cycle positions where a hold began (nothing held before the acquire):
    /// a block hook's block starts.
    starts: Vec<bool>,
    starts_state: Starts,
    /// A (new) plan is due at the next moment no unit is held.
    replan: bool,
}

impl Default for PlanState {
    fn default() -> Self {
        Self {
            cycle: Vec::new(),
            cycle_pos: HashMap::new(),
            declared: Vec::new(),
            streaming: Streaming::Unplanned,
            held: 0,
            max_held: 0,
            hold_began: 0,
            starts: Vec::new(),
            starts_state: Starts::Partial,
            replan: false,
        }
    }
}

impl PlanState {
    // ---- the cycle ------------------------------------------------------

    /// The declared cycle's units, in order.
    pub fn cycle(&self) -> &[WeightId] {
        &self.cycle
    }
    /// Unit `w`'s position in the cycle.
    pub fn pos(&self, w: WeightId) -> Option<usize> {
        self.cycle_pos.get(&w).copied()
    }
    /// The order last declared (empty once a weight left it).
    pub fn declared(&self) -> &[WeightId] {
        &self.declared
    }
    /// A new cycle of `units` (distinct), declared as `declared` (empty when
    /// it was not declared as such). The hold starts are recorded afresh; a
    /// plan is by cycle position, so a new one is due; a dropped ring may be
    /// planned again.
    pub fn set_cycle(&mut self, units: Vec<WeightId>, declared: Vec<WeightId>) {
        self.cycle_pos = units.iter().enumerate().map(|(i, &w)| (w, i)).collect();
        self.starts = vec![false; units.len()];
        if self.starts_state == Starts::Seen {
            self.starts_state = Starts::Partial;
        }
        self.replan = true;
        if matches!(self.streaming, Streaming::RingOff) {
            self.streaming = Streaming::Unplanned;
        }
        self.cycle = units;
        self.declared = declared;
    }

    // ---- holds ----------------------------------------------------------

    /// Units acquired now.
    pub fn held(&self) -> usize {
        self.held
    }
    /// Unit `w` went from idle to acquired: count the hold, record where a
    /// hold began (a block hook's block starts) and the widest hold, and ask
    /// for a plan when the hold outgrows the ring's.
    pub fn note_hold(&mut self, w: WeightId) {
        self.held += 1;
        let p = self.pos(w);
        if self.held == 1 {
            self.hold_began = p.unwrap_or(0);
            if let Some(s) = p.and_then(|p| self.starts.get_mut(p)) {
                *s = true;
            }
        }
        if self.held > self.max_held {
            // Starts recorded for narrower holds do not describe this one.
            self.max_held = self.held;
            self.starts.iter_mut().for_each(|s| *s = false);
            if let Some(s) = self.starts.get_mut(self.hold_began) {
                *s = true;
            }
            if self.starts_state == Starts::Seen {
                self.starts_state = Starts::Partial;
            }
        }
        // The plan's ring holds `width` units at once: a caller holding
        // more (a whole block) gets a plan for that at the next idle moment.
        if self.plan().is_some_and(|p| self.held > p.hold.width) {
            self.replan = true;
        }
    }
    /// A unit went from acquired to idle.
    pub fn note_release(&mut self) {
        self.held -= 1;
    }
    /// The widest hold a plan must serve (at least one unit).
    pub fn hold_width(&self) -> usize {
        self.max_held.max(1)
    }
    /// How the caller holds units, as a plan made now assumes: the widest
    /// hold, and block-aligned windows once the starts were seen over a
    /// whole cycle (sliding windows otherwise).
    pub fn hold(&self) -> Hold {
        let width = self.hold_width();
        let starts = (width > 1 && self.starts_state == Starts::Seen).then(|| self.starts.clone());
        Hold { width, starts }
    }

    // ---- when to plan ---------------------------------------------------

    /// Before unit `w` is acquired: whether a plan is to be installed now.
    /// Only with nothing held; when the cycle wraps, the starts recorded so
    /// far cover a whole cycle, and a hold wider than one unit wants a plan
    /// on them.
    pub fn replan_due(&mut self, w: WeightId) -> bool {
        if self.held != 0 {
            return false;
        }
        if self.starts_state == Starts::Partial && self.pos(w) == Some(0) {
            self.starts_state = Starts::Seen;
            // Holds seen over a whole cycle: wider ones get a plan on their
            // starts, single ones may get one that splits weights (an
            // unchanged plan is kept as installed, nothing evicted).
            self.replan = true;
        }
        self.replan
    }
    /// Whether the caller was seen, over a whole cycle, to hold one unit at
    /// a time: a plan may then split weights (its ring holds two tails, so
    /// a caller that holds two units would find its own tail in the way).
    pub fn single_holds_seen(&self) -> bool {
        self.max_held <= 1 && self.starts_state != Starts::Partial
    }
    /// A plan is due at the next moment nothing is held.
    pub fn request_replan(&mut self) {
        self.replan = true;
    }
    /// A plan is being made now: none is due any more.
    pub fn clear_replan(&mut self) {
        self.replan = false;
    }
    /// A demand page-in found its ring spot held: the caller holds more
    /// units at once than the plan assumed. Re-plan once nothing is held,
    /// on sliding windows from now on if the plan assumed block starts.
    pub fn note_blocked(&mut self) {
        self.replan = true;
        if self.plan().is_some_and(|p| p.hold.starts.is_some()) {
            self.starts_state = Starts::Sliding;
        }
    }

    // ---- the plan and its ring ------------------------------------------

    /// The installed plan.
    pub fn plan(&self) -> Option<&Plan> {
        match &self.streaming {
            Streaming::Planned { plan, .. } => Some(plan),
            _ => None,
        }
    }
    /// The installed plan's streaming region.
    pub fn ring(&self) -> Option<&Ring> {
        match &self.streaming {
            Streaming::Planned { ring, .. } => Some(ring),
            _ => None,
        }
    }
    pub fn ring_mut(&mut self) -> Option<&mut Ring> {
        match &mut self.streaming {
            Streaming::Planned { ring, .. } => Some(ring),
            _ => None,
        }
    }
    /// The units the installed plan streams; `None` without a plan.
    pub fn streamed(&self) -> Option<&HashSet<WeightId>> {
        match &self.streaming {
            Streaming::Planned { streamed, .. } => Some(streamed),
            _ => None,
        }
    }
    /// Whether unit `w` streams through the installed plan's ring.
    pub fn streams(&self, w: WeightId) -> bool {
        match &self.streaming {
            Streaming::Planned { streamed, .. } => streamed.contains(&w),
            _ => false,
        }
    }
    /// Unit `w`'s offset in the ring: its cycle position's in the plan (a
    /// split unit's: its tail's, mapped behind its address at install).
    pub fn ring_offset(&self, w: WeightId) -> Option<usize> {
        if let Streaming::Planned { splits, .. } = &self.streaming
            && let Some(&(_, _, off)) = splits.get(&w)
        {
            return Some(off);
        }
        self.plan()?.offsets.get(self.pos(w)?).copied()
    }
    /// Streamed unit `w`'s split under the installed plan: its head's bytes
    /// and its index among the ring's spans. `None` when it streams whole or
    /// is not streamed.
    pub fn split_of(&self, w: WeightId) -> Option<(usize, usize)> {
        match &self.streaming {
            Streaming::Planned { splits, .. } => splits.get(&w).map(|&(head, span, _)| (head, span)),
            _ => None,
        }
    }
    /// The ring was dropped: no plan until a cycle is declared.
    pub fn ring_off(&self) -> bool {
        matches!(self.streaming, Streaming::RingOff)
    }
    /// Whether `plan` over the current cycle is the installed plan with the
    /// same units streamed: a re-declared order (a rotation, say) can give an
    /// equal plan by positions that streams other units.
    pub fn installed_as(&self, plan: &Plan) -> bool {
        match &self.streaming {
            Streaming::Planned { plan: p, streamed, .. } => {
                p == plan
                    && self.cycle.len() == plan.resident.len()
                    && self.cycle.iter().zip(&plan.resident).all(|(u, r)| *r != streamed.contains(u))
            }
            _ => false,
        }
    }
    /// Install `plan` (made for the current cycle) with its `ring`, replacing
    /// no plan: the caller released the last one ([`Self::release`]) and
    /// charges the ring's bytes.
    pub fn install(&mut self, plan: Plan, ring: Ring) {
        debug_assert!(matches!(self.streaming, Streaming::Unplanned), "a plan installed over {:?}", self.streaming);
        let streamed = self.cycle.iter().zip(&plan.resident).filter(|(_, r)| !**r).map(|(&u, _)| u).collect();
        let splits = self
            .cycle
            .iter()
            .zip(plan.heads.iter().zip(&plan.offsets))
            .filter(|(_, (h, _))| **h > 0)
            .enumerate()
            .map(|(span, (&u, (&head, &off)))| (u, (head, span, off)))
            .collect();
        self.streaming = Streaming::Planned { plan, ring, streamed, splits };
    }
    /// Forget the plan and hand its ring back to the caller, who credits its
    /// bytes and drops it (which synchronizes the device). A dropped ring
    /// stays dropped.
    pub fn release(&mut self) -> Option<Ring> {
        if !matches!(self.streaming, Streaming::Planned { .. }) {
            return None;
        }
        match std::mem::replace(&mut self.streaming, Streaming::Unplanned) {
            Streaming::Planned { ring, .. } => Some(ring),
            _ => None,
        }
    }
    /// The ring was dropped (after [`Self::release`]): callers walk the cycle
    /// concurrently, and no plan is made until a cycle is declared.
    pub fn turn_ring_off(&mut self) {
        debug_assert!(!matches!(self.streaming, Streaming::Planned { .. }), "the ring turned off before its release");
        self.streaming = Streaming::RingOff;
    }

    /// Panics if the invariant in the module docs does not hold.
    // Called after every mutation in debug builds only (and by tests).
    #[cfg_attr(not(debug_assertions), allow(dead_code))]
    pub fn check(&self) {
        assert_eq!(self.cycle_pos.len(), self.cycle.len(), "cycle positions do not index the cycle");
        for (i, w) in self.cycle.iter().enumerate() {
            assert_eq!(self.cycle_pos.get(w), Some(&i), "cycle position of weight {} is not its index", w.0);
        }
        assert_eq!(self.starts.len(), self.cycle.len(), "hold starts are not one per cycle position");
        assert!(self.held <= self.max_held, "held {} > max_held {}", self.held, self.max_held);
        if let Streaming::Planned { plan, ring, streamed, splits } = &self.streaming {
            assert!(
                plan.hold.width <= self.hold_width(),
                "a plan for holds of {} units; at most {} held at once",
                plan.hold.width,
                self.hold_width()
            );
            assert_eq!(ring.cap(), plan.ring_bytes, "the ring is not the plan's");
            assert_eq!(plan.heads.len(), plan.resident.len(), "heads are not one per planned position");
            let split_positions = plan.heads.iter().zip(&plan.resident).filter(|(h, r)| **h > 0 && !**r).count();
            assert_eq!(splits.len(), split_positions, "split units are not the plan's split positions");
            for (w, &(head, span, off)) in splits {
                assert!(streamed.contains(w), "split unit {} is not streamed", w.0);
                assert!(
                    head > 0 && off < plan.ring_bytes && ring.span(span).is_some(),
                    "split unit {} has no span",
                    w.0
                );
            }
            assert_eq!(plan.offsets.len(), plan.resident.len(), "ring offsets are not one per planned position");
            for (p, (&r, &off)) in plan.resident.iter().zip(&plan.offsets).enumerate() {
                assert!(
                    if r { off == usize::MAX } else { off < plan.ring_bytes },
                    "planned position {p} (resident: {r}) at ring offset {off} of {}",
                    plan.ring_bytes
                );
            }
            let positions = plan.resident.iter().filter(|&&r| !r).count();
            assert!(
                positions > 0 && streamed.len() == positions,
                "{} streamed units for {positions} streamed positions",
                streamed.len()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::arena::{ArenaConfig, DeviceArena};
    use crate::device::{self, DeviceSelect};
    use crate::residency::placement;

    fn cycle(n: u32) -> Vec<WeightId> {
        (0..n).map(WeightId).collect()
    }

    /// A plan state over four units of mixed sizes with a plan installed
    /// (its ring in a host-device arena, kept alive beside it).
    fn planned() -> (PlanState, Arc<DeviceArena>) {
        let d = device::open(DeviceSelect::Host, 0).unwrap();
        let arena = Arc::new(DeviceArena::new(&d, ArenaConfig::with_capacity(64 << 20)).unwrap());
        let sizes = [3 << 20, 1 << 20, 2 << 20, 1 << 20];
        let p = placement::plan(&sizes, 4 << 20, &Hold::ONE, 1).expect("mixed sizes over the budget get a plan");
        let ring = Ring::new(&arena, p.ring_bytes).unwrap();
        let mut s = PlanState::default();
        s.set_cycle(cycle(4), cycle(4));
        s.install(p, ring);
        (s, arena)
    }

    #[test]
    fn an_installed_plan_keeps_the_invariant_until_released() {
        let (mut s, _arena) = planned();
        s.check();
        let streamed: Vec<WeightId> = cycle(4).into_iter().filter(|&w| s.streams(w)).collect();
        assert!(!streamed.is_empty());
        for w in cycle(4) {
            assert_eq!(s.ring_offset(w).is_some_and(|o| o != usize::MAX), s.streams(w), "weight {}", w.0);
        }
        assert!(s.release().is_some());
        s.turn_ring_off();
        s.check();
        assert!(s.ring_off() && s.plan().is_none());
        assert!(s.release().is_none(), "a dropped ring stays dropped");
        assert!(s.ring_off());
        s.set_cycle(cycle(3), Vec::new());
        assert!(!s.ring_off(), "a new cycle may be planned again");
    }

    #[test]
    #[should_panic(expected = "streamed units for")]
    fn streamed_units_that_are_not_the_plans_fail_the_check() {
        let (mut s, _arena) = planned();
        if let Streaming::Planned { streamed, .. } = &mut s.streaming {
            streamed.insert(WeightId(99));
        }
        s.check();
    }

    #[test]
    #[should_panic(expected = "the ring is not the plan's")]
    fn a_ring_of_another_size_fails_the_check() {
        let (mut s, _arena) = planned();
        if let Streaming::Planned { plan, .. } = &mut s.streaming {
            plan.ring_bytes += placement::ALIGN;
        }
        s.check();
    }

    #[test]
    #[should_panic(expected = "a plan for holds of 2 units")]
    fn a_plan_for_wider_holds_than_seen_fails_the_check() {
        let (mut s, _arena) = planned();
        if let Streaming::Planned { plan, .. } = &mut s.streaming {
            plan.hold.width = 2;
        }
        s.check();
    }

    #[test]
    fn holds_and_cycles_keep_the_invariant() {
        let mut s = PlanState::default();
        s.set_cycle(cycle(4), cycle(4));
        s.check();
        assert!(s.replan_due(WeightId(0)), "a new cycle wants a plan");
        s.clear_replan();
        for w in [1, 2, 3] {
            s.note_hold(WeightId(w));
            s.check();
        }
        assert_eq!((s.held(), s.hold_width()), (3, 3));
        for _ in 0..3 {
            s.note_release();
        }
        // Idle at the wrap: the starts (position 1) cover a cycle, and a
        // hold of three wants a plan on them.
        assert!(!s.replan_due(WeightId(2)));
        assert!(s.replan_due(WeightId(0)));
        assert_eq!(s.hold(), Hold { width: 3, starts: Some(vec![false, true, false, false]) });
        s.set_cycle(cycle(2), Vec::new());
        s.check();
        assert!(s.declared().is_empty());
        assert_eq!(s.hold(), Hold { width: 3, starts: None }, "a new cycle's starts are not seen yet");
    }

    #[test]
    fn a_blocked_plan_on_block_starts_means_sliding_windows_for_good() {
        let (mut s, _arena) = planned();
        let starts = vec![true, false, true, false];
        if let Streaming::Planned { plan, .. } = &mut s.streaming {
            plan.hold = Hold { width: 1, starts: Some(starts.clone()) };
        }
        for w in [0, 1] {
            s.note_hold(WeightId(w));
        }
        s.note_release();
        s.note_release();
        s.note_blocked();
        assert!(s.replan_due(WeightId(0)), "a blocked page-in asks for a plan");
        assert_eq!(s.hold(), Hold { width: 2, starts: None });
        // Neither a new cycle nor a whole cycle of starts undoes it.
        s.set_cycle(cycle(4), cycle(4));
        s.note_hold(WeightId(2));
        s.note_release();
        assert!(s.replan_due(WeightId(0)));
        assert_eq!(s.hold(), Hold { width: 2, starts: None });
    }

    #[test]
    #[should_panic(expected = "cycle position of weight 1 is not its index")]
    fn a_position_that_is_not_the_index_fails_the_check() {
        let mut s = PlanState::default();
        s.set_cycle(cycle(3), Vec::new());
        s.cycle_pos.insert(WeightId(1), 2);
        s.check();
    }

    #[test]
    #[should_panic(expected = "hold starts are not one per cycle position")]
    fn starts_of_another_cycle_fail_the_check() {
        let mut s = PlanState::default();
        s.set_cycle(cycle(3), Vec::new());
        s.starts.push(false);
        s.check();
    }

    #[test]
    #[should_panic(expected = "held 2 > max_held 1")]
    fn more_held_than_the_widest_hold_fails_the_check() {
        let mut s = PlanState::default();
        s.note_hold(WeightId(0));
        s.held += 1;
        s.check();
    }
}
