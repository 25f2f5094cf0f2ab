//! Page-locked host memory of the host device: pinned allocations (mmap +
//! a best-effort mlock) and registered ranges, tracked exactly so
//! `host_is_page_locked` answers for the whole range asked about.

use std::collections::BTreeMap;

use super::sys;
use crate::error::Result;

#[derive(Debug, Default)]
pub(super) struct HostMem {
    /// Pinned allocations: start → (mapped length, requested length).
    pub pinned: BTreeMap<usize, (usize, usize)>,
    /// Registered ranges: start → (length, registered read-only).
    pub registered: BTreeMap<usize, (usize, bool)>,
    /// mlock refusals (RLIMIT_MEMLOCK): the memory is still usable, just not locked.
    pub mlock_failures: u64,
}

/// Whether `[p, p+len)` overlaps an interval of `map` (start → length in `len_of`).
/// Intervals in `map` are disjoint, so only the last one starting before the
/// end can overlap (anything earlier ends before it starts).
fn overlaps<V>(map: &BTreeMap<usize, V>, p: usize, end: usize, len_of: impl Fn(&V) -> usize) -> bool {
    map.range(..end).next_back().is_some_and(|(&s, v)| s + len_of(v) > p)
}

fn contains<V>(map: &BTreeMap<usize, V>, p: usize, end: usize, len_of: impl Fn(&V) -> usize) -> bool {
    map.range(..=p).next_back().is_some_and(|(&s, v)| end <= s + len_of(v) && p < s + len_of(v))
}

impl HostMem {
    pub fn alloc(&mut self, bytes: usize) -> Result<usize> {
        crate::ensure!(bytes > 0, InvalidArgument, "pinned allocation of 0 bytes");
        let len = bytes.next_multiple_of(sys::page_size());
        let p = sys::map_anon(len, libc::PROT_READ | libc::PROT_WRITE, false)?;
        if !sys::try_lock(p, len) {
            self.mlock_failures += 1;
        }
        self.pinned.insert(p, (len, bytes));
        Ok(p)
    }

    pub fn free(&mut self, p: usize) -> Result<()> {
        let Some(&(len, _)) = self.pinned.get(&p) else {
            crate::bail!(InvalidArgument, "{p:#x} is not a live pinned allocation");
        };
        // SAFETY: our allocation; the caller guarantees nothing uses it any more.
        unsafe { sys::unmap(p, len)? };
        self.pinned.remove(&p);
        Ok(())
    }

    pub fn register(&mut self, p: usize, len: usize, read_only: bool) -> Result<()> {
        crate::ensure!(p != 0, NullPointer, "host_register of a NULL pointer");
        crate::ensure!(len > 0, InvalidArgument, "host_register of 0 bytes");
        let end = p.checked_add(len).ok_or_else(|| crate::Error::invalid_argument("host range wraps around"))?;
        crate::ensure!(
            !overlaps(&self.registered, p, end, |&(l, _)| l) && !overlaps(&self.pinned, p, end, |&(l, _)| l),
            InvalidState,
            "host range {p:#x}+{len} overlaps memory that is already page-locked"
        );
        self.registered.insert(p, (len, read_only));
        Ok(())
    }

    pub fn unregister(&mut self, p: usize) -> Result<()> {
        crate::ensure!(
            self.registered.remove(&p).is_some(),
            InvalidArgument,
            "{p:#x} is not the start of a registered host range"
        );
        Ok(())
    }

    pub fn is_page_locked(&self, p: usize, len: usize) -> bool {
        let end = p.saturating_add(len.max(1));
        contains(&self.registered, p, end, |&(l, _)| l) || contains(&self.pinned, p, end, |&(_, req)| req)
    }

    /// Whether `[p, end)` overlaps a range registered read-only: the device
    /// may read it but not write it (a D2H destination there is refused).
    pub fn overlaps_read_only(&self, p: usize, end: usize) -> bool {
        // Registrations are disjoint: walk back from the end while they still reach `p`.
        self.registered.range(..end).rev().take_while(|&(&s, &(l, _))| s + l > p).any(|(_, &(_, ro))| ro)
    }

    pub fn pinned_bytes(&self) -> u64 {
        self.pinned.values().map(|&(_, req)| req as u64).sum()
    }

    /// Free every pinned allocation still live (device teardown).
    pub fn release_all(&mut self) {
        for (p, (len, _)) in std::mem::take(&mut self.pinned) {
            // SAFETY: teardown: the streams are joined, nothing copies from it.
            if let Err(e) = unsafe { sys::unmap(p, len) } {
                log::warn!("epmem: host device teardown: {e}");
            }
        }
    }
}
