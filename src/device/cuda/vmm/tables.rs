//! The VMM tables: what the driver holds (physical handles, reservations,
//! mappings and the access of every granule), kept so that device accesses
//! can be judged before they reach the GPU.

use std::collections::{BTreeMap, HashMap};

use cudarc::driver::sys;

use crate::device::{Access, LiveCounts};
use crate::error::Result;

#[derive(Debug)]
pub(super) struct Phys {
    pub(super) handle: sys::CUmemGenericAllocationHandle,
    pub(super) bytes: usize,
}

#[derive(Debug)]
pub(super) struct Mapping {
    pub(super) len: usize,
    /// Access per granule (None until set): set_access may cover part of a mapping.
    pub(super) access: Vec<Option<Access>>,
}

#[derive(Debug, Default)]
pub(super) struct Reservation {
    pub(super) len: usize,
    /// Mapping start address → mapping.
    pub(super) maps: BTreeMap<u64, Mapping>,
}

#[derive(Debug, Default)]
pub(in crate::device::cuda) struct VmmTables {
    pub(super) phys: HashMap<u64, Phys>,
    pub(super) res: BTreeMap<u64, Reservation>,
}

fn end(p: u64, n: usize) -> Option<u64> {
    p.checked_add(n as u64)
}

impl VmmTables {
    pub(in crate::device::cuda) fn live_counts(&self, c: &mut LiveCounts) {
        c.physical_handles = self.phys.len() as u64;
        c.physical_bytes = self.phys.values().map(|p| p.bytes as u64).sum();
        c.va_reservations = self.res.len() as u64;
        c.mappings = self.res.values().map(|r| r.maps.len() as u64).sum();
    }

    /// The reservation holding all of `[va, va+n)`.
    fn reservation(&self, va: u64, n: usize) -> Option<(u64, &Reservation)> {
        let (&base, r) = self.res.range(..=va).next_back()?;
        (end(va, n)? <= base + r.len as u64).then_some((base, r))
    }

    pub(super) fn reservation_mut(&mut self, va: u64, n: usize) -> Option<&mut Reservation> {
        let (&base, r) = self.res.range_mut(..=va).next_back()?;
        (end(va, n)? <= base + r.len as u64).then_some(r)
    }

    /// Whether `[va, va+n)` overlaps any reservation.
    pub(super) fn touches(&self, va: u64, n: usize) -> bool {
        let e = end(va, n).unwrap_or(u64::MAX);
        self.res.range(..e).next_back().is_some_and(|(&b, r)| b + r.len as u64 > va)
    }

    /// Access of the granule at `a`, `None` when unmapped or no access set.
    fn access_at(r: &Reservation, a: u64, g: usize) -> Option<Access> {
        let (&start, m) = r.maps.range(..=a).next_back()?;
        if a >= start + m.len as u64 {
            return None;
        }
        m.access[((a - start) / g as u64) as usize]
    }

    /// May `[va, va+n)` be read (`write = false`) or written by the device?
    /// `Ok(false)`: the range touches none of our reservations (not ours to
    /// judge); `Ok(true)`: ours and allowed; errors say why not.
    pub(super) fn check_access(&self, va: u64, n: usize, write: bool, g: usize) -> Result<bool> {
        if n == 0 || !self.touches(va, n) {
            return Ok(false);
        }
        let what = if write { "write" } else { "read" };
        let Some((_, r)) = self.reservation(va, n) else {
            crate::bail!(InvalidArgument, "device {what} [{va:#x}, +{n}) crosses the edge of a VA reservation");
        };
        let g64 = g as u64;
        let mut a = va - va % g64;
        let last = va + n as u64;
        while a < last {
            match Self::access_at(r, a, g) {
                None => crate::bail!(
                    AccessDenied,
                    "device {what} [{va:#x}, +{n}) refused: the granule at {a:#x} is unmapped or has no access"
                ),
                Some(Access::ReadOnly) if write => {
                    crate::bail!(AccessDenied, "device write [{va:#x}, +{n}) refused: {a:#x} is mapped read-only")
                }
                Some(_) => {}
            }
            a += g64;
        }
        Ok(true)
    }

    /// The mappings that exactly tile `[va, va+n)` (no gap, none cut).
    pub(super) fn tiling(r: &Reservation, va: u64, n: usize) -> Option<Vec<(u64, usize)>> {
        let e = end(va, n)?;
        let mut at = va;
        let mut out = Vec::new();
        for (&s, m) in r.maps.range(va..e) {
            if s != at {
                return None;
            }
            at = s + m.len as u64;
            out.push((s, m.len));
        }
        (at == e && !out.is_empty()).then_some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::EpmStatus;

    const G: usize = 0x20_0000;

    fn tables() -> VmmTables {
        // One 8-granule reservation at 0x1000_0000: granules 0-1 mapped RW,
        // 2 mapped RO, 3 mapped with no access, 4-7 unmapped.
        let mut t = VmmTables::default();
        let base = 0x1000_0000u64;
        let mut r = Reservation { len: 8 * G, maps: BTreeMap::new() };
        r.maps.insert(base, Mapping { len: 2 * G, access: vec![Some(Access::ReadWrite); 2] });
        r.maps.insert(base + 2 * G as u64, Mapping { len: G, access: vec![Some(Access::ReadOnly)] });
        r.maps.insert(base + 3 * G as u64, Mapping { len: G, access: vec![None] });
        t.res.insert(base, r);
        t
    }

    #[test]
    fn writes_into_read_only_granules_are_denied() {
        let t = tables();
        let b = 0x1000_0000u64;
        assert!(t.check_access(b, 2 * G, true, G).unwrap());
        assert!(t.check_access(b + 2 * G as u64, G, false, G).unwrap());
        let e = t.check_access(b + G as u64 + 8, G, true, G).unwrap_err();
        assert_eq!(e.status(), EpmStatus::AccessDenied, "{e}");
        assert_eq!(t.check_access(b + 3 * G as u64, 4, false, G).unwrap_err().status(), EpmStatus::AccessDenied);
        assert_eq!(t.check_access(b + 5 * G as u64, 4, false, G).unwrap_err().status(), EpmStatus::AccessDenied);
    }

    #[test]
    fn foreign_ranges_are_not_judged() {
        let t = tables();
        assert!(!t.check_access(0x2000_0000, 64, true, G).unwrap());
        assert!(!t.check_access(0x1000_0000 - 64, 64, true, G).unwrap());
        let e = t.check_access(0x1000_0000 - 64, 128, true, G).unwrap_err();
        assert!(e.message().contains("edge of a VA reservation"), "{e}");
    }

    #[test]
    fn unmap_needs_whole_adjacent_mappings() {
        let t = tables();
        let b = 0x1000_0000u64;
        let r = &t.res[&b];
        assert_eq!(VmmTables::tiling(r, b, 3 * G), Some(vec![(b, 2 * G), (b + 2 * G as u64, G)]));
        assert_eq!(VmmTables::tiling(r, b, G), None, "cuts a mapping");
        assert_eq!(VmmTables::tiling(r, b + 2 * G as u64, 3 * G), None, "runs into unmapped VA");
        assert_eq!(VmmTables::tiling(r, b + 4 * G as u64, G), None, "nothing mapped");
    }

    #[test]
    fn live_counts_follow_the_tables() {
        let mut t = tables();
        t.phys.insert(7, Phys { handle: 1, bytes: 4 * G });
        let mut c = LiveCounts::default();
        t.live_counts(&mut c);
        assert_eq!((c.physical_handles, c.physical_bytes, c.va_reservations, c.mappings), (1, 4 * G as u64, 1, 3));
    }
}
