//! Generational KV ids (sequences, prefixes, batches): an id that outlives
//! its object is a clean `InvalidHandle`, never a different object that
//! reused the slot. The slots are the crate's one [`crate::slab::Slab`];
//! this adds the typed id ([`super::id`]) and the message naming what the id was.

use std::marker::PhantomData;

use super::id::KvId;
use crate::error::Result;
use crate::slab::Lookup;

#[derive(Debug)]
pub struct Slab<K, T> {
    slots: crate::slab::Slab<T>,
    id: PhantomData<K>,
}

/// index in the low 32 bits, generation (≥ 1) in the high 32: 0 is never an id.
fn pack<K: KvId>(index: u32, generation: u32) -> K {
    K::from_bits(((generation as u64) << 32) | index as u64)
}

fn unpack<K: KvId>(id: K) -> (u32, u32) {
    let id = id.bits();
    ((id & 0xffff_ffff) as u32, (id >> 32) as u32)
}

fn missing<K: KvId, V>(id: K) -> Result<V> {
    crate::bail!(InvalidHandle, "{} {id:#x} does not exist (destroyed or never created)", K::WHAT)
}

impl<K: KvId, T> Slab<K, T> {
    pub fn new() -> Self {
        Self { slots: crate::slab::Slab::new(u32::MAX, u32::MAX), id: PhantomData }
    }

    pub fn insert(&mut self, v: T) -> K {
        // 2^32 - 1 live sequences or prefixes would need far more memory
        // than their reservations can ever have.
        let (i, g) = self.slots.insert(v).unwrap_or_else(|_| panic!("2^32 live {} ids", K::WHAT));
        pack(i, g)
    }

    pub fn get(&self, id: K) -> Result<&T> {
        let (i, g) = unpack(id);
        match self.slots.get(i, g) {
            Lookup::Live(v) => Ok(v),
            _ => missing(id),
        }
    }

    pub fn get_mut(&mut self, id: K) -> Result<&mut T> {
        let (i, g) = unpack(id);
        match self.slots.get_mut(i, g) {
            Lookup::Live(v) => Ok(v),
            _ => missing(id),
        }
    }

    pub fn remove(&mut self, id: K) -> Result<T> {
        let (i, g) = unpack(id);
        match self.slots.remove(i, g) {
            Lookup::Live(v) => Ok(v),
            _ => missing(id),
        }
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Ids of every live entry.
    pub fn ids(&self) -> Vec<K> {
        self.slots.iter().map(|(i, g, _)| pack(i, g)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::SeqId;

    #[test]
    fn stale_ids_are_invalid_handles() {
        let mut s = Slab::<SeqId, i32>::new();
        let a = s.insert(1);
        s.remove(a).unwrap();
        let b = s.insert(2);
        assert_ne!(a, b);
        let e = s.get(a).unwrap_err();
        assert_eq!(e.status(), crate::EpmStatus::InvalidHandle);
        assert!(e.message().starts_with("KV sequence 0x"), "{}", e.message());
        assert_eq!(*s.get(b).unwrap(), 2);
        assert!(s.get(SeqId::from_bits(0)).is_err());
        assert_eq!(s.ids(), vec![b]);
    }
}
