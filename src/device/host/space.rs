//! The host device's address space: every device range (plain allocations
//! and VMM reservations with their mapped granules) and the access check
//! every copy, memset and checksum goes through.
//!
//! Copies check their ranges twice: at enqueue (so the caller gets the
//! error) and again on the stream thread under the read lock, which mapping
//! changes take for writing. So a range cannot be unmapped or made read-only
//! in the middle of a copy, and no bad address ever reaches a `memcpy`: the
//! host device never SIGSEGVs on a bad device address.

use std::collections::BTreeMap;

use crate::device::{Access, DevicePtr};
use crate::error::{EpmStatus, Error, Result};

/// What an operation does to a device range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Need {
    Read,
    Write,
}

/// One granule of a reservation that is mapped.
#[derive(Debug, Clone, Copy)]
pub(super) struct Granule {
    /// First granule index and granule count of the `vmm_map` call that
    /// mapped it: unmaps must cover whole mappings, as on CUDA.
    pub map_first: usize,
    pub map_count: usize,
    /// The physical handle it maps (for error messages).
    pub phys: u64,
    /// None until `vmm_set_access`.
    pub access: Option<Access>,
}

#[derive(Debug)]
pub(super) enum Region {
    /// `mem_alloc`: always read-write.
    Alloc { len: usize },
    /// `vmm_reserve`: mapped granules by index; absent means unmapped.
    Reservation { len: usize, granules: BTreeMap<usize, Granule> },
}

impl Region {
    pub fn len(&self) -> usize {
        match self {
            Region::Alloc { len } | Region::Reservation { len, .. } => *len,
        }
    }
}

#[derive(Debug)]
pub(super) struct AddrSpace {
    pub granularity: usize,
    /// Regions by start address; they never overlap (the kernel placed them).
    pub regions: BTreeMap<usize, Region>,
    /// Live `vmm_map` mappings (not granules).
    pub mappings: u64,
}

/// `[addr, addr+n)` as host addresses, or an error if it wraps.
pub(super) fn span(addr: DevicePtr, n: usize) -> Result<(usize, usize)> {
    let a =
        usize::try_from(addr).map_err(|_| Error::invalid_argument(format!("device address {addr:#x} out of range")))?;
    let end =
        a.checked_add(n).ok_or_else(|| Error::invalid_argument(format!("device range {addr:#x}+{n} wraps around")))?;
    Ok((a, end))
}

impl AddrSpace {
    pub fn new(granularity: usize) -> Self {
        Self { granularity, regions: BTreeMap::new(), mappings: 0 }
    }

    /// The region containing `[a, end)` entirely, with its start.
    pub fn region_of(&self, a: usize, end: usize) -> Result<(usize, &Region)> {
        match self.regions.range(..=a).next_back() {
            Some((&start, r)) if end <= start + r.len() && a < start + r.len() => Ok((start, r)),
            _ => Err(Error::invalid_argument(format!(
                "device range {a:#x}..{end:#x} is not inside one device allocation or reservation"
            ))),
        }
    }

    /// Whether `[addr, addr+n)` may be read (or written) by a device operation
    /// right now. Unknown addresses are `InvalidArgument`; unmapped, no-access
    /// or (for writes) read-only VMM granules are `AccessDenied`.
    pub fn check(&self, addr: DevicePtr, n: usize, need: Need) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let (a, end) = span(addr, n)?;
        let (start, region) = self.region_of(a, end)?;
        let Region::Reservation { granules, .. } = region else {
            return Ok(());
        };
        let g = self.granularity;
        for idx in (a - start) / g..=(end - 1 - start) / g {
            let at = start + idx * g;
            match granules.get(&idx).and_then(|gr| gr.access.map(|acc| (gr, acc))) {
                None => {
                    return Err(Error::new(
                        EpmStatus::AccessDenied,
                        format!("device range {a:#x}..{end:#x}: granule at {at:#x} is unmapped or has no access"),
                    ));
                }
                Some((gr, Access::ReadOnly)) if need == Need::Write => {
                    return Err(Error::new(
                        EpmStatus::AccessDenied,
                        format!(
                            "device range {a:#x}..{end:#x}: granule at {at:#x} (physical handle {}) is mapped read-only",
                            gr.phys
                        ),
                    ));
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    /// Whether `[a, end)` overlaps any device region (a host pointer that
    /// points into device memory is then checked as a device range).
    pub fn touches(&self, a: usize, end: usize) -> bool {
        self.regions.range(..end).next_back().is_some_and(|(&start, r)| start + r.len() > a)
    }

    /// Counts for `live_counts`: (allocations, allocated bytes, reservations).
    pub fn counts(&self) -> (u64, u64, u64) {
        let mut out = (0, 0, 0);
        for r in self.regions.values() {
            match r {
                Region::Alloc { len } => {
                    out.0 += 1;
                    out.1 += *len as u64;
                }
                Region::Reservation { .. } => out.2 += 1,
            }
        }
        out
    }
}
