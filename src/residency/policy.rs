//! Eviction policies: which resident weight to give up first.
//!
//! Decode scans the layers cyclically. LRU evicts exactly the weight needed
//! soonest, so with a budget below the model size it hits 0% (each weight was
//! touched longest ago precisely when it is needed again). Knowing the cyclic
//! order, the optimum (Belady: evict the weight whose next use is farthest)
//! is computable online: right after weight `c` is used, the farthest next
//! use is `c` itself, then `c-1`, `c-2`, ... wrapping around — so most of
//! the resident set survives each step and the rest streams through one
//! rotating slot (hit rate (k−1)/(n−1) for k of n equal weights).
//! [`CyclicPolicy`] keeps resident weights ordered by cycle position and
//! walks them in that order: O(log n) per event.

use std::collections::{BTreeMap, HashMap};

use super::WeightId;
use crate::error::Result;

/// Which policy a manager uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// Least recently used (the seed's policy; kept for comparison).
    Lru,
    /// Farthest next use under the declared cyclic order; weights outside
    /// the order go first, least recently used first. The default.
    Cyclic,
}

/// An eviction policy. The manager tells it what is resident and what was
/// used; it answers with candidates in eviction order. The manager skips
/// candidates it cannot evict (in use, being paged in).
pub trait Policy: Send + std::fmt::Debug {
    /// `w` became resident.
    fn inserted(&mut self, w: WeightId);
    /// `w` is no longer resident.
    fn removed(&mut self, w: WeightId);
    /// `w` was used (a hit or the use after a page-in).
    fn accessed(&mut self, w: WeightId);
    /// Declare the cyclic order of a decode step (each weight at most once).
    fn set_cycle(&mut self, order: &[WeightId]) -> Result<()>;
    /// Resident weights, best victim first.
    fn candidates(&self) -> Box<dyn Iterator<Item = WeightId> + '_>;
    /// Accesses until `w` is next used, when the policy knows (a declared
    /// cycle): 1 for the weight after the last one used, n for the last one
    /// used itself. Prefetch never evicts a weight needed sooner than the
    /// one it brings in.
    fn distance(&self, _w: WeightId) -> Option<usize> {
        None
    }
}

/// Build a policy of `kind`.
pub fn new_policy(kind: PolicyKind) -> Box<dyn Policy> {
    match kind {
        PolicyKind::Lru => Box::new(LruPolicy::default()),
        PolicyKind::Cyclic => Box::new(CyclicPolicy::default()),
    }
}

/// Least recently used: resident weights ordered by last use.
#[derive(Debug, Default)]
pub struct LruPolicy {
    clock: u64,
    by_age: BTreeMap<u64, WeightId>,
    age: HashMap<WeightId, u64>,
}

impl LruPolicy {
    fn touch(&mut self, w: WeightId) {
        if let Some(old) = self.age.get(&w) {
            self.by_age.remove(old);
        }
        self.clock += 1;
        self.by_age.insert(self.clock, w);
        self.age.insert(w, self.clock);
    }
}

impl Policy for LruPolicy {
    fn inserted(&mut self, w: WeightId) {
        self.touch(w);
    }
    fn removed(&mut self, w: WeightId) {
        if let Some(a) = self.age.remove(&w) {
            self.by_age.remove(&a);
        }
    }
    fn accessed(&mut self, w: WeightId) {
        if self.age.contains_key(&w) {
            self.touch(w);
        }
    }
    fn set_cycle(&mut self, _order: &[WeightId]) -> Result<()> {
        Ok(())
    }
    fn candidates(&self) -> Box<dyn Iterator<Item = WeightId> + '_> {
        Box::new(self.by_age.values().copied())
    }
}

/// Farthest next use under a declared cyclic order. See the module docs.
#[derive(Debug, Default)]
pub struct CyclicPolicy {
    /// Cycle position of every declared weight.
    pos: HashMap<WeightId, usize>,
    /// Resident declared weights by position.
    resident: BTreeMap<usize, WeightId>,
    /// Resident weights outside the cycle: evicted first, in LRU order.
    others: LruPolicy,
    /// Position of the last declared weight used.
    cursor: usize,
}

impl Policy for CyclicPolicy {
    fn inserted(&mut self, w: WeightId) {
        match self.pos.get(&w) {
            Some(&p) => {
                self.resident.insert(p, w);
            }
            None => self.others.inserted(w),
        }
    }
    fn removed(&mut self, w: WeightId) {
        match self.pos.get(&w) {
            Some(p) => {
                self.resident.remove(p);
            }
            None => self.others.removed(w),
        }
    }
    fn accessed(&mut self, w: WeightId) {
        match self.pos.get(&w) {
            Some(&p) => self.cursor = p,
            None => self.others.accessed(w),
        }
    }
    fn set_cycle(&mut self, order: &[WeightId]) -> Result<()> {
        let mut pos = HashMap::with_capacity(order.len());
        for (i, &w) in order.iter().enumerate() {
            crate::ensure!(
                pos.insert(w, i).is_none(),
                InvalidArgument,
                "weight {} appears twice in the cyclic order (positions {} and {i})",
                w.0,
                pos[&w]
            );
        }
        // Re-file the resident set under the new order; the cursor starts
        // before position 0 (as if the last weight had just been used).
        let resident: Vec<WeightId> = self.resident.values().copied().chain(self.others.candidates()).collect();
        let cursor = order.len().saturating_sub(1);
        *self = CyclicPolicy { pos, cursor, ..Default::default() };
        for w in resident {
            self.inserted(w);
        }
        Ok(())
    }
    fn distance(&self, w: WeightId) -> Option<usize> {
        let n = self.pos.len();
        let p = *self.pos.get(&w)?;
        Some((p + n - self.cursor - 1) % n + 1)
    }
    fn candidates(&self) -> Box<dyn Iterator<Item = WeightId> + '_> {
        let c = self.cursor;
        // After using position c, next uses are c+1, c+2, ... so the
        // farthest is c itself, then c-1 ... 0, then n-1 ... c+1.
        Box::new(
            self.others
                .candidates()
                .chain(self.resident.range(..=c).rev().map(|(_, &w)| w))
                .chain(self.resident.range(c + 1..).rev().map(|(_, &w)| w)),
        )
    }
}
