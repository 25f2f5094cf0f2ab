//! The sub-allocator both arenas share: offset-allocator (a TLSF-style
//! two-level bitmap allocator, O(1) alloc and free) over a byte range counted
//! in `unit`s, plus the bookkeeping an arena needs on top of it: which offsets
//! are live (so a free by address is checked, and a double free is an error,
//! not undefined allocator state), the bytes in use and their peak.

use std::collections::HashMap;

use offset_allocator::{Allocation, Allocator};

use crate::error::Result;

/// One live sub-allocation.
#[derive(Clone, Copy)]
pub(crate) struct Live {
    alloc: Allocation,
    /// First byte of the underlying allocator range (before alignment padding).
    start: usize,
    /// Bytes the underlying allocator range spans (padding and unit rounding included).
    span: usize,
    /// Bytes the caller asked for.
    pub requested: usize,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Live[{:#x}, +{}) req {}", self.start, self.span, self.requested)
    }
}

impl Live {
    /// The byte range `[start, start+span)` this allocation occupies.
    pub fn span(&self) -> (usize, usize) {
        (self.start, self.span)
    }
}

pub(crate) struct SubAlloc {
    inner: Allocator,
    unit: usize,
    capacity: usize,
    max_allocs: u32,
    live: HashMap<usize, Live>,
    in_use: usize,
    peak_in_use: usize,
}

impl std::fmt::Debug for SubAlloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubAlloc")
            .field("unit", &self.unit)
            .field("capacity", &self.capacity)
            .field("live", &self.live.len())
            .field("in_use", &self.in_use)
            .finish()
    }
}

impl SubAlloc {
    /// A range of `capacity` bytes (a multiple of `unit`, at most `u32::MAX` units).
    pub fn new(capacity: usize, unit: usize, max_allocs: u32) -> Result<Self> {
        crate::ensure!(
            unit.is_power_of_two() && capacity > 0 && capacity % unit == 0,
            InvalidArgument,
            "arena capacity {capacity} is not a positive multiple of the unit {unit} (a power of two)"
        );
        let units = capacity / unit;
        crate::ensure!(
            units <= u32::MAX as usize,
            InvalidArgument,
            "arena capacity {capacity} exceeds {} units of {unit} bytes",
            u32::MAX
        );
        crate::ensure!(
            (16..(1 << 24)).contains(&max_allocs),
            InvalidArgument,
            "max_allocs {max_allocs} is outside [16, 2^24)"
        );
        Ok(Self {
            inner: Allocator::with_max_allocs(units as u32, max_allocs),
            unit,
            capacity,
            max_allocs,
            live: HashMap::new(),
            in_use: 0,
            peak_in_use: 0,
        })
    }

    /// Allocate `bytes > 0` at an offset aligned to `align` (a power of two;
    /// alignments up to the unit are free, larger ones cost padding).
    /// Returns the aligned offset.
    pub fn alloc(&mut self, bytes: usize, align: usize) -> Result<usize> {
        crate::ensure!(bytes > 0, InvalidArgument, "allocation of 0 bytes");
        crate::ensure!(
            align == 0 || align.is_power_of_two(),
            InvalidArgument,
            "alignment {align} is not a power of two"
        );
        let align = align.max(self.unit);
        let pad = align - self.unit;
        let span = bytes
            .checked_add(pad)
            .and_then(|b| b.checked_next_multiple_of(self.unit))
            .filter(|&b| b <= self.capacity)
            .ok_or_else(|| {
                crate::error::Error::new(
                    crate::error::EpmStatus::OutOfBudget,
                    format!(
                        "allocation of {bytes} bytes (align {align}) exceeds the arena capacity {}",
                        self.capacity
                    ),
                )
            })?;
        let Some(alloc) = self.inner.allocate((span / self.unit) as u32) else {
            let r = self.inner.storage_report();
            if self.live.len() + 1 >= self.max_allocs as usize {
                crate::bail!(
                    OutOfBudget,
                    "arena holds its maximum of {} live allocations (raise max_allocs)",
                    self.max_allocs
                );
            }
            crate::bail!(
                OutOfBudget,
                "arena of {} bytes has no free range of {span} bytes ({} bytes free, largest free range {} bytes)",
                self.capacity,
                r.total_free_space as usize * self.unit,
                r.largest_free_region as usize * self.unit
            );
        };
        let start = alloc.offset as usize * self.unit;
        let offset = start.next_multiple_of(align);
        self.live.insert(
            offset,
            Live {
                alloc,
                start,
                span,
                requested: bytes,
            },
        );
        self.in_use += span;
        self.peak_in_use = self.peak_in_use.max(self.in_use);
        Ok(offset)
    }

    /// Free the allocation at `offset`; returns what it was. Unknown offsets
    /// (never allocated, or already freed) are an error.
    pub fn free(&mut self, offset: usize) -> Result<Live> {
        let live = self.live.remove(&offset).ok_or_else(|| {
            crate::error::Error::invalid_argument(format!(
                "offset {offset:#x} is not a live allocation of this arena (double free or foreign pointer)"
            ))
        })?;
        self.inner.free(live.alloc);
        self.in_use -= live.span;
        Ok(live)
    }

    pub fn get(&self, offset: usize) -> Option<&Live> {
        self.live.get(&offset)
    }
    pub fn live_count(&self) -> usize {
        self.live.len()
    }
    /// Bytes held by live allocations (unit rounding and alignment padding included).
    pub fn in_use(&self) -> usize {
        self.in_use
    }
    pub fn peak_in_use(&self) -> usize {
        self.peak_in_use
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// (free bytes, largest free range in bytes). The largest range is the
    /// allocator's bin floor: a request up to it is guaranteed to succeed.
    pub fn free_report(&self) -> (usize, usize) {
        let r = self.inner.storage_report();
        (
            r.total_free_space as usize * self.unit,
            r.largest_free_region as usize * self.unit,
        )
    }
    /// 1 − largest free range / free bytes: 0 when all free space is one
    /// range, towards 1 when it is scattered in small holes.
    pub fn fragmentation(&self) -> f64 {
        let (free, largest) = self.free_report();
        if free == 0 {
            0.0
        } else {
            1.0 - largest as f64 / free as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_allocations_do_not_overlap_and_account_exactly() {
        let mut a = SubAlloc::new(1 << 20, 256, 1024).unwrap();
        let x = a.alloc(100, 0).unwrap();
        let y = a.alloc(300, 4096).unwrap();
        assert_eq!(y % 4096, 0);
        assert!(x + 256 <= y || y + 300 <= x);
        assert_eq!(a.in_use(), 256 + (300usize + 4096 - 256).next_multiple_of(256));
        assert_eq!(a.free(x).unwrap().requested, 100);
        assert_eq!(
            a.free(x).unwrap_err().status(),
            crate::error::EpmStatus::InvalidArgument
        );
        a.free(y).unwrap();
        assert_eq!(a.in_use(), 0);
        assert_eq!(a.fragmentation(), 0.0);
    }

    #[test]
    fn exhaustion_is_out_of_budget() {
        let mut a = SubAlloc::new(4096, 256, 64).unwrap();
        assert_eq!(
            a.alloc(8192, 0).unwrap_err().status(),
            crate::error::EpmStatus::OutOfBudget
        );
        let x = a.alloc(4096, 0).unwrap();
        let e = a.alloc(1, 0).unwrap_err();
        assert_eq!(e.status(), crate::error::EpmStatus::OutOfBudget);
        assert!(e.message().contains("no free range"), "{e}");
        a.free(x).unwrap();
        a.alloc(4096, 0).unwrap();
    }

    #[test]
    fn bad_arguments_are_errors() {
        assert!(SubAlloc::new(1000, 256, 64).is_err());
        assert!(SubAlloc::new(4096, 100, 64).is_err());
        let mut a = SubAlloc::new(4096, 256, 64).unwrap();
        assert_eq!(
            a.alloc(0, 0).unwrap_err().status(),
            crate::error::EpmStatus::InvalidArgument
        );
        assert_eq!(
            a.alloc(8, 3).unwrap_err().status(),
            crate::error::EpmStatus::InvalidArgument
        );
    }
}
