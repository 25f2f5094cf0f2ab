//! Generational slots: an id that outlives its object is a clean
//! `InvalidHandle`, never a different object that reused the slot.

use crate::error::Result;

#[derive(Debug)]
pub struct Slab<T> {
    entries: Vec<(u32, Option<T>)>,
    free: Vec<u32>,
    live: usize,
    what: &'static str,
}

/// index in the low 32 bits, generation (≥ 1) in the high 32: 0 is never an id.
fn pack(index: u32, generation: u32) -> u64 {
    ((generation as u64) << 32) | index as u64
}

impl<T> Slab<T> {
    pub fn new(what: &'static str) -> Self {
        Self { entries: Vec::new(), free: Vec::new(), live: 0, what }
    }

    pub fn insert(&mut self, v: T) -> u64 {
        self.live += 1;
        match self.free.pop() {
            Some(i) => {
                let e = &mut self.entries[i as usize];
                e.0 = e.0.wrapping_add(1).max(1);
                e.1 = Some(v);
                pack(i, e.0)
            }
            None => {
                self.entries.push((1, Some(v)));
                pack((self.entries.len() - 1) as u32, 1)
            }
        }
    }

    fn locate(&self, id: u64) -> Result<usize> {
        let (i, generation) = ((id & 0xffff_ffff) as usize, (id >> 32) as u32);
        match self.entries.get(i) {
            Some((g, Some(_))) if *g == generation => Ok(i),
            _ => crate::bail!(InvalidHandle, "{} {id:#x} does not exist (destroyed or never created)", self.what),
        }
    }

    pub fn get(&self, id: u64) -> Result<&T> {
        let i = self.locate(id)?;
        Ok(self.entries[i].1.as_ref().expect("located entries are occupied"))
    }

    pub fn get_mut(&mut self, id: u64) -> Result<&mut T> {
        let i = self.locate(id)?;
        Ok(self.entries[i].1.as_mut().expect("located entries are occupied"))
    }

    pub fn remove(&mut self, id: u64) -> Result<T> {
        let i = self.locate(id)?;
        self.free.push(i as u32);
        self.live -= 1;
        Ok(self.entries[i].1.take().expect("located entries are occupied"))
    }

    pub fn len(&self) -> usize {
        self.live
    }

    /// Ids of every live entry.
    pub fn ids(&self) -> Vec<u64> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.1.is_some())
            .map(|(i, e)| pack(i as u32, e.0))
            .collect()
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
