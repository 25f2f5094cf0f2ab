//! Generational slots: the one implementation behind the C handle tables
//! (ffi::handle) and the KV pool's sequence/prefix/batch ids (kv::slab).
//!
//! An id is (slot, generation). Removing an entry bumps its slot's
//! generation, so an id that outlives its entry is [`Lookup::Stale`], never
//! a different entry that reused the slot. Freed slots are reused
//! oldest-first: a stale id could only alias a live one after its slot had
//! been reused `max_generation` times, and FIFO reuse spreads churn over
//! every free slot instead of cycling one (which is why this is not
//! `slotmap`, whose free list is LIFO; and `slotmap::SlotMap::new` is not
//! `const`, which the per-type static handle tables need).

use std::collections::VecDeque;

/// What an id refers to.
#[derive(Debug, PartialEq, Eq)]
pub enum Lookup<T> {
    Live(T),
    /// The slot exists but holds another generation (or nothing): the id's
    /// entry was removed.
    Stale,
    /// No such slot was ever handed out.
    Unknown,
}

#[derive(Debug)]
pub struct Slab<V> {
    slots: Vec<(u32, Option<V>)>,
    free: VecDeque<u32>,
    live: usize,
    max_slots: u32,
    max_generation: u32,
}

impl<V> Slab<V> {
    /// Slots `0..max_slots`; generations `1..=max_generation` (0 is never
    /// live, so a packed id of 0 is never valid).
    pub const fn new(max_slots: u32, max_generation: u32) -> Self {
        Self { slots: Vec::new(), free: VecDeque::new(), live: 0, max_slots, max_generation }
    }

    /// Store `v`; its (slot, generation), or `Err(v)` when every slot is live.
    pub fn insert(&mut self, v: V) -> std::result::Result<(u32, u32), V> {
        let slot = match self.free.pop_front() {
            Some(i) => i,
            None if self.slots.len() < self.max_slots as usize => {
                self.slots.push((1, None));
                (self.slots.len() - 1) as u32
            }
            None => return Err(v),
        };
        let e = &mut self.slots[slot as usize];
        e.1 = Some(v);
        self.live += 1;
        Ok((slot, e.0))
    }

    pub fn get(&self, slot: u32, generation: u32) -> Lookup<&V> {
        match self.slots.get(slot as usize) {
            Some((g, Some(v))) if *g == generation => Lookup::Live(v),
            Some(_) => Lookup::Stale,
            None => Lookup::Unknown,
        }
    }

    pub fn get_mut(&mut self, slot: u32, generation: u32) -> Lookup<&mut V> {
        match self.slots.get_mut(slot as usize) {
            Some((g, Some(v))) if *g == generation => Lookup::Live(v),
            Some(_) => Lookup::Stale,
            None => Lookup::Unknown,
        }
    }

    pub fn remove(&mut self, slot: u32, generation: u32) -> Lookup<V> {
        let max = self.max_generation;
        match self.slots.get_mut(slot as usize) {
            Some((g, v @ Some(_))) if *g == generation => {
                *g = if *g >= max { 1 } else { *g + 1 };
                self.free.push_back(slot);
                self.live -= 1;
                Lookup::Live(v.take().expect("matched Some"))
            }
            Some(_) => Lookup::Stale,
            None => Lookup::Unknown,
        }
    }

    /// Live entries.
    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// (slot, generation, entry) of every live entry, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, u32, &V)> {
        self.slots.iter().enumerate().filter_map(|(i, (g, v))| v.as_ref().map(|v| (i as u32, *g, v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removed_ids_are_stale_and_slots_are_reused_oldest_first() {
        let mut s = Slab::new(3, 2);
        let a = s.insert('a').unwrap();
        let b = s.insert('b').unwrap();
        assert_eq!(s.remove(a.0, a.1), Lookup::Live('a'));
        assert_eq!(s.remove(a.0, a.1), Lookup::Stale);
        assert_eq!(s.remove(b.0, b.1), Lookup::Live('b'));
        // a's slot was freed first, so it is reused first, a generation on.
        let c = s.insert('c').unwrap();
        assert_eq!(c, (a.0, a.1 + 1));
        assert_eq!(s.get(a.0, a.1), Lookup::Stale);
        assert_eq!(s.get(7, 1), Lookup::Unknown);
        let d = s.insert('d').unwrap();
        assert_eq!(d.0, b.0);
        s.insert('e').unwrap();
        assert_eq!(s.insert('f'), Err('f'), "max_slots live");
        // The generation wraps to 1 after max_generation, never to 0.
        assert_eq!(s.remove(c.0, c.1), Lookup::Live('c'));
        assert_eq!(s.insert('g').unwrap(), (a.0, 1));
        assert_eq!(s.len(), 3);
        assert_eq!(s.iter().map(|(_, _, v)| *v).collect::<String>(), "gde");
    }
}
