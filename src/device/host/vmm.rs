//! Real VMM on the host: a physical handle is a memfd, a reservation a
//! `PROT_NONE` mapping, map is `mmap(MAP_FIXED|MAP_SHARED)` of the memfd (so
//! one granule mapped at N addresses is one set of pages), access is
//! `mprotect`, unmap puts `PROT_NONE` memory back so the reservation stays.
//!
//! Every operation makes its system calls first and updates the table only
//! on success, so a failure leaves the table describing the real mappings.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;

use super::space::{AddrSpace, Granule, Region, span};
use super::sys;
use crate::device::{Access, DevicePtr};
use crate::error::{EpmStatus, Error, Result};

/// A physical allocation. Dropping it closes the memfd; pages still mapped
/// stay alive until their last mapping goes (the kernel holds the file), the
/// same lifetime CUDA gives a released handle that is still mapped.
#[derive(Debug)]
pub(super) struct Phys {
    pub fd: OwnedFd,
    pub len: usize,
}

impl Phys {
    pub fn create(bytes: usize, granularity: usize) -> Result<Self> {
        crate::ensure!(
            bytes > 0 && bytes.is_multiple_of(granularity),
            InvalidArgument,
            "physical allocation of {bytes} bytes is not a positive multiple of the granularity {granularity}"
        );
        Ok(Self { fd: sys::memfd(bytes).map_err(as_device_oom)?, len: bytes })
    }
}

/// "Device memory" is host memory here, but the core must see the status
/// a GPU would give when it runs out.
fn as_device_oom(e: Error) -> Error {
    if e.status() == EpmStatus::OutOfHostMemory { Error::new(EpmStatus::OutOfDeviceMemory, e.message()) } else { e }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

impl AddrSpace {
    /// Check that `[va, va+bytes)` is a non-empty granule-aligned range inside
    /// one reservation; returns (reservation start, first granule, granule count).
    fn granule_range(&self, va: DevicePtr, bytes: usize) -> Result<(usize, usize, usize)> {
        let g = self.granularity;
        crate::ensure!(
            bytes > 0 && bytes.is_multiple_of(g),
            InvalidArgument,
            "size {bytes} is not a positive multiple of the granularity {g}"
        );
        let (a, end) = span(va, bytes)?;
        let (start, region) = self.region_of(a, end)?;
        crate::ensure!(
            matches!(region, Region::Reservation { .. }),
            InvalidArgument,
            "{va:#x} is device memory from mem_alloc, not a VA reservation"
        );
        crate::ensure!((a - start) % g == 0, InvalidArgument, "{va:#x} is not granule-aligned in its reservation");
        Ok((start, (a - start) / g, bytes / g))
    }

    fn granules_mut(&mut self, start: usize) -> Result<&mut BTreeMap<usize, Granule>> {
        match self.regions.get_mut(&start) {
            Some(Region::Reservation { granules, .. }) => Ok(granules),
            _ => Err(Error::internal("reservation vanished")),
        }
    }

    /// Plain device memory: private anonymous read-write pages.
    pub fn alloc(&mut self, bytes: usize) -> Result<DevicePtr> {
        crate::ensure!(bytes > 0, InvalidArgument, "device allocation of 0 bytes");
        let p = sys::map_anon(bytes, libc::PROT_READ | libc::PROT_WRITE, false).map_err(as_device_oom)?;
        self.regions.insert(p, Region::Alloc { len: bytes });
        Ok(p as DevicePtr)
    }

    pub fn free(&mut self, p: DevicePtr) -> Result<()> {
        let a = usize::try_from(p).unwrap_or(usize::MAX);
        let len = match self.regions.get(&a) {
            Some(Region::Alloc { len }) => *len,
            _ => crate::bail!(InvalidArgument, "{p:#x} is not a live device allocation"),
        };
        // SAFETY: the table says we own this allocation; the caller guarantees
        // no queued work uses it, and queued work re-checks the table anyway.
        unsafe { sys::unmap(a, len)? };
        self.regions.remove(&a);
        Ok(())
    }

    pub fn reserve(&mut self, bytes: usize, align: usize) -> Result<DevicePtr> {
        let g = self.granularity;
        crate::ensure!(
            bytes > 0 && bytes.is_multiple_of(g),
            InvalidArgument,
            "reservation of {bytes} bytes is not a positive multiple of the granularity {g}"
        );
        crate::ensure!(
            align == 0 || align.is_power_of_two(),
            InvalidArgument,
            "alignment {align} is not a power of two"
        );
        let align = if align == 0 { g } else { align / gcd(align, g) * g };
        let va = sys::reserve_aligned(bytes, align)?;
        self.regions.insert(va, Region::Reservation { len: bytes, granules: BTreeMap::new() });
        Ok(va as DevicePtr)
    }

    pub fn free_va(&mut self, va: DevicePtr, bytes: usize) -> Result<()> {
        let a = usize::try_from(va).unwrap_or(usize::MAX);
        match self.regions.get(&a) {
            Some(Region::Reservation { len, granules }) if *len == bytes => {
                crate::ensure!(
                    granules.is_empty(),
                    InvalidState,
                    "reservation {va:#x} still has {} mapped granules",
                    granules.len()
                );
            }
            _ => crate::bail!(InvalidArgument, "{va:#x}+{bytes} is not a live VA reservation"),
        }
        // SAFETY: an unmapped reservation we own; nothing can use PROT_NONE memory.
        unsafe { sys::unmap(a, bytes)? };
        self.regions.remove(&a);
        Ok(())
    }

    pub fn map(&mut self, va: DevicePtr, bytes: usize, phys_id: u64, phys: &Phys, offset: usize) -> Result<()> {
        let g = self.granularity;
        let (start, first, count) = self.granule_range(va, bytes)?;
        crate::ensure!(
            offset.is_multiple_of(g) && offset.checked_add(bytes).is_some_and(|e| e <= phys.len),
            InvalidArgument,
            "physical range [{offset}, +{bytes}) is not granule-aligned inside a handle of {} bytes",
            phys.len
        );
        let granules = self.granules_mut(start)?;
        crate::ensure!(
            granules.range(first..first + count).next().is_none(),
            InvalidState,
            "{va:#x}+{bytes} overlaps an existing mapping"
        );
        // SAFETY: the range is inside a reservation we own and none of it is mapped.
        unsafe { sys::map_shared_fixed(va as usize, bytes, &phys.fd, offset)? };
        for idx in first..first + count {
            granules.insert(idx, Granule { map_first: first, map_count: count, phys: phys_id, access: None });
        }
        self.mappings += 1;
        Ok(())
    }

    pub fn unmap(&mut self, va: DevicePtr, bytes: usize) -> Result<()> {
        let (start, first, count) = self.granule_range(va, bytes)?;
        let granules = self.granules_mut(start)?;
        let mut whole_maps = 0;
        for idx in first..first + count {
            let Some(gr) = granules.get(&idx) else {
                crate::bail!(InvalidArgument, "{va:#x}+{bytes}: granule {idx} of the reservation is not mapped");
            };
            crate::ensure!(
                gr.map_first >= first && gr.map_first + gr.map_count <= first + count,
                InvalidArgument,
                "{va:#x}+{bytes} cuts through a mapping (unmap whole vmm_map ranges)"
            );
            if gr.map_first == idx {
                whole_maps += 1;
            }
        }
        // SAFETY: inside our reservation; the caller guarantees no in-flight
        // work touches it (and queued work re-checks the table under the lock we hold).
        unsafe { sys::map_none_fixed(va as usize, bytes)? };
        for idx in first..first + count {
            granules.remove(&idx);
        }
        self.mappings -= whole_maps;
        Ok(())
    }

    pub fn set_access(&mut self, va: DevicePtr, bytes: usize, access: Access) -> Result<()> {
        let (start, first, count) = self.granule_range(va, bytes)?;
        let granules = self.granules_mut(start)?;
        crate::ensure!(
            (first..first + count).all(|i| granules.contains_key(&i)),
            InvalidArgument,
            "{va:#x}+{bytes} is not entirely mapped"
        );
        let prot = match access {
            Access::ReadWrite => libc::PROT_READ | libc::PROT_WRITE,
            Access::ReadOnly => libc::PROT_READ,
        };
        // SAFETY: mapped granules of our reservation; the write lock we hold
        // keeps every queued copy out while the protection changes.
        unsafe { sys::protect(va as usize, bytes, prot)? };
        for idx in first..first + count {
            if let Some(gr) = granules.get_mut(&idx) {
                gr.access = Some(access);
            }
        }
        Ok(())
    }

    /// Unmap everything still mapped and free every region (device teardown).
    pub fn release_all(&mut self) {
        for (start, r) in std::mem::take(&mut self.regions) {
            // SAFETY: teardown: the streams are joined, nothing uses device memory any more.
            if let Err(e) = unsafe { sys::unmap(start, r.len()) } {
                log::warn!("epmem: host device teardown: {e}");
            }
        }
        self.mappings = 0;
    }
}
