//! Generational KV ids (sequences, prefixes, batches): an id that outlives
//! its object is a clean `InvalidHandle`, never a different object that
//! reused the slot. The slots are the crate's one [`crate::slab::Slab`];
//! this adds the u64 id and the message naming what the id was.

use crate::error::Result;
use crate::slab::Lookup;

#[derive(Debug)]
pub struct Slab<T> {
    slots: crate::slab::Slab<T>,
    what: &'static str,
}

/// index in the low 32 bits, generation (≥ 1) in the high 32: 0 is never an id.
fn pack(index: u32, generation: u32) -> u64 {
    ((generation as u64) << 32) | index as u64
}

fn unpack(id: u64) -> (u32, u32) {
    ((id & 0xffff_ffff) as u32, (id >> 32) as u32)
}

fn missing<V>(what: &str, id: u64) -> Result<V> {
    crate::bail!(InvalidHandle, "{what} {id:#x} does not exist (destroyed or never created)")
}

impl<T> Slab<T> {
    pub fn new(what: &'static str) -> Self {
        Self { slots: crate::slab::Slab::new(u32::MAX, u32::MAX), what }
    }

    pub fn insert(&mut self, v: T) -> u64 {
        // 2^32 - 1 live sequences or prefixes would need far more memory
        // than their reservations can ever have.
        let (i, g) = self.slots.insert(v).unwrap_or_else(|_| panic!("2^32 live {} ids", self.what));
        pack(i, g)
    }


    pub fn get(&self, id: u64) -> Result<&T> {
        let (i, g) = unpack(id);
        match self.slots.get(i, g) {
            Lookup::Live(v) => Ok(v),
            _ => missing(self.what, id),
        }
    }

    pub fn get_mut(&mut self, id: u64) -> Result<&mut T> {
        let (i, g) = unpack(id);
        match self.slots.get_mut(i, g) {
            Lookup::Live(v) => Ok(v),
            _ => missing(self.what, id),
        }
    }

    pub fn remove(&mut self, id: u64) -> Result<T> {
        let (i, g) = unpack(id);
        match self.slots.remove(i, g) {
            Lookup::Live(v) => Ok(v),
            _ => missing(self.what, id),
        }
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Ids of every live entry.
    pub fn ids(&self) -> Vec<u64> {
        self.slots.iter().map(|(i, g, _)| pack(i, g)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_ids_are_invalid_handles() {
        let mut s = Slab::new("thing");
        let a = s.insert(1);
        s.remove(a).unwrap();
        let b = s.insert(2);
        assert_ne!(a, b);
        assert_eq!(s.get(a).unwrap_err().status(), crate::EpmStatus::InvalidHandle);
        assert_eq!(*s.get(b).unwrap(), 2);
        assert!(s.get(0).is_err());
        assert_eq!(s.ids(), vec![b]);
    }
}
