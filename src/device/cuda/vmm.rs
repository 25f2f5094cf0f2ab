//! VMM: physical handles (cuMemCreate), VA reservations, mappings, access.
//!
//! The tables mirror what the driver holds, so we can refuse what would
//! otherwise reach the GPU as a fault: a kernel or memset writing into a
//! read-only mapping raises error 700 and loses the context (measured on the
//! H200), so writes into our read-only ranges, and any access to our
//! unmapped or no-access granules, are `AccessDenied` before any driver call
//! (the same statuses as the host device).

use std::collections::{BTreeMap, HashMap};
use std::mem::{offset_of, size_of};

use cudarc::driver::sys;

use super::{CudaDevice, bump, lock};
use crate::device::{Access, DevicePtr, LiveCounts, RawPhys};
use crate::error::{EpmStatus, Error, Result};

// The driver reads these structs by layout; check cudarc's bindings against
// the CUDA headers (cuda.h, 12.x) so a binding change cannot go unnoticed.
const _: () = assert!(size_of::<sys::CUmemLocation_st>() == 8);
const _: () = assert!(size_of::<sys::CUmemAccessDesc_st>() == 12);
const _: () = assert!(offset_of!(sys::CUmemAccessDesc_st, flags) == 8);
const _: () = assert!(size_of::<sys::CUmemAllocationProp_st>() == 32);
const _: () = assert!(offset_of!(sys::CUmemAllocationProp_st, location) == 8);
const _: () = assert!(offset_of!(sys::CUmemAllocationProp_st, win32HandleMetaData) == 16);
const _: () = assert!(offset_of!(sys::CUmemAllocationProp_st, allocFlags) == 24);

fn location(dev: sys::CUdevice) -> sys::CUmemLocation {
    sys::CUmemLocation_st { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: dev }
}

/// Pinned device memory on `dev`, no exportable handle.
fn alloc_prop(dev: sys::CUdevice) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp_st {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: location(dev),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

fn access_desc(dev: sys::CUdevice, access: Access) -> sys::CUmemAccessDesc {
    let flags = match access {
        Access::ReadWrite => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        Access::ReadOnly => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
    };
    sys::CUmemAccessDesc_st { location: location(dev), flags }
}

/// The recommended granularity for pinned device memory on `dev`.
pub(super) fn granularity(dev: sys::CUdevice) -> Result<usize> {
    let prop = alloc_prop(dev);
    let mut g: usize = 0;
    let flag = sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED;
    // SAFETY: valid out-pointer and a fully initialized prop.
    unsafe { cu!(cuMemGetAllocationGranularity(&mut g, &prop, flag)) }?;
    crate::ensure!(g.is_power_of_two(), Internal, "the driver reports a VMM granularity of {g} bytes");
    Ok(g)
}

#[derive(Debug)]
struct Phys {
    handle: sys::CUmemGenericAllocationHandle,
    bytes: usize,
}

#[derive(Debug)]
struct Mapping {
    len: usize,
    /// Access per granule (None until set): set_access may cover part of a mapping.
    access: Vec<Option<Access>>,
}

#[derive(Debug, Default)]
struct Reservation {
    len: usize,
    /// Mapping start address → mapping.
    maps: BTreeMap<u64, Mapping>,
}

#[derive(Debug, Default)]
pub(super) struct VmmTables {
    phys: HashMap<u64, Phys>,
    res: BTreeMap<u64, Reservation>,
}

fn end(p: u64, n: usize) -> Option<u64> {
    p.checked_add(n as u64)
}

impl VmmTables {
    pub(super) fn live_counts(&self, c: &mut LiveCounts) {
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

    fn reservation_mut(&mut self, va: u64, n: usize) -> Option<&mut Reservation> {
        let (&base, r) = self.res.range_mut(..=va).next_back()?;
        (end(va, n)? <= base + r.len as u64).then_some(r)
    }

    /// Whether `[va, va+n)` overlaps any reservation.
    fn touches(&self, va: u64, n: usize) -> bool {
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
                Some(Access::ReadOnly) if write => crate::bail!(
                    AccessDenied,
                    "device write [{va:#x}, +{n}) refused: {a:#x} is mapped read-only"
                ),
                Some(_) => {}
            }
            a += g64;
        }
        Ok(true)
    }

    /// The mappings that exactly tile `[va, va+n)` (no gap, none cut).
    fn tiling(r: &Reservation, va: u64, n: usize) -> Option<Vec<(u64, usize)>> {
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

impl CudaDevice {
    fn aligned(&self, what: &str, va: u64, n: usize) -> Result<()> {
        let g = self.info.granularity;
        crate::ensure!(
            n > 0 && n.is_multiple_of(g) && va.is_multiple_of(g as u64),
            InvalidArgument,
            "{what} [{va:#x}, +{n}) is not a positive, granule-aligned range (granularity {g})"
        );
        Ok(())
    }

    /// `Ok(true)` if `[p, p+n)` lies in our VMM ranges with the access asked for.
    pub(super) fn vmm_allows(&self, p: DevicePtr, n: usize, write: bool) -> Result<bool> {
        lock(&self.vmm).check_access(p, n, write, self.info.granularity)
    }

    pub(super) fn cu_vmm_create(&self, bytes: usize) -> Result<RawPhys> {
        self.aligned("physical allocation", 0, bytes)?;
        let _g = self.enter()?;
        let prop = alloc_prop(self.dev);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        bump(&self.counts.vmm_create);
        // SAFETY: valid out-pointer and a fully initialized prop; flags must be 0.
        unsafe { cu!(cuMemCreate(&mut handle, bytes, &prop, 0)) }?;
        let id = self.new_id();
        lock(&self.vmm).phys.insert(id, Phys { handle, bytes });
        Ok(RawPhys(id))
    }

    pub(super) fn cu_vmm_release(&self, h: RawPhys) -> Result<()> {
        let _g = self.enter()?;
        let phys = lock(&self.vmm)
            .phys
            .remove(&h.0)
            .ok_or_else(|| Error::new(EpmStatus::InvalidHandle, format!("physical handle {} is not live on this device", h.0)))?;
        bump(&self.counts.vmm_release);
        // SAFETY: a handle from cuMemCreate, removed from the table so it is
        // released once; mappings of it keep the memory until unmapped.
        let r = unsafe { cu!(cuMemRelease(phys.handle)) };
        if r.is_err() {
            lock(&self.vmm).phys.insert(h.0, phys);
        }
        r
    }

    pub(super) fn cu_vmm_reserve(&self, bytes: usize, align: usize) -> Result<DevicePtr> {
        self.aligned("VA reservation", 0, bytes)?;
        let g = self.info.granularity;
        crate::ensure!(
            align == 0 || (align.is_power_of_two() && align.is_multiple_of(g)),
            InvalidArgument,
            "VA alignment {align} is not a power-of-two multiple of the granularity {g}"
        );
        let _g = self.enter()?;
        let mut va: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; no fixed address requested; flags must be 0.
        unsafe { cu!(cuMemAddressReserve(&mut va, bytes, align.max(g), 0, 0)) }?;
        lock(&self.vmm).res.insert(va, Reservation { len: bytes, maps: BTreeMap::new() });
        Ok(va)
    }

    pub(super) fn cu_vmm_free_va(&self, va: DevicePtr, bytes: usize) -> Result<()> {
        let _g = self.enter()?;
        let mut t = lock(&self.vmm);
        match t.res.get(&va) {
            None => crate::bail!(InvalidArgument, "{va:#x} is not the start of a VA reservation of this device"),
            Some(r) if r.len != bytes => {
                crate::bail!(InvalidArgument, "VA reservation {va:#x} is {} bytes, not {bytes}", r.len)
            }
            Some(r) if !r.maps.is_empty() => crate::bail!(
                InvalidState,
                "VA reservation {va:#x} still has {} mapping(s): unmap before freeing",
                r.maps.len()
            ),
            Some(_) => {}
        }
        // SAFETY: exactly a reservation of ours, with nothing mapped in it.
        unsafe { cu!(cuMemAddressFree(va, bytes)) }?;
        t.res.remove(&va);
        Ok(())
    }

    pub(super) fn cu_vmm_map(&self, va: DevicePtr, bytes: usize, h: RawPhys, offset: usize) -> Result<()> {
        self.aligned("mapping", va, bytes)?;
        let g = self.info.granularity;
        crate::ensure!(offset.is_multiple_of(g), InvalidArgument, "physical offset {offset} is not granule-aligned ({g})");
        let _g = self.enter()?;
        let mut t = lock(&self.vmm);
        let phys = t
            .phys
            .get(&h.0)
            .ok_or_else(|| Error::new(EpmStatus::InvalidHandle, format!("physical handle {} is not live on this device", h.0)))?;
        crate::ensure!(
            offset.checked_add(bytes).is_some_and(|e| e <= phys.bytes),
            InvalidArgument,
            "mapping [{offset}, +{bytes}) runs past the end of a {}-byte physical handle",
            phys.bytes
        );
        let handle = phys.handle;
        let r = t.reservation_mut(va, bytes).ok_or_else(|| {
            Error::invalid_argument(format!("[{va:#x}, +{bytes}) is not inside a VA reservation of this device"))
        })?;
        let e = va + bytes as u64;
        let clash = r.maps.range(..e).next_back().is_some_and(|(&s, m)| s + m.len as u64 > va);
        crate::ensure!(!clash, InvalidState, "[{va:#x}, +{bytes}) overlaps an existing mapping");
        bump(&self.counts.vmm_map);
        // SAFETY: an unmapped, granule-aligned range inside our reservation,
        // and a live handle with `offset + bytes` inside it; flags must be 0.
        unsafe { cu!(cuMemMap(va, bytes, offset, handle, 0)) }?;
        r.maps.insert(va, Mapping { len: bytes, access: vec![None; bytes / g] });
        Ok(())
    }

    pub(super) fn cu_vmm_unmap(&self, va: DevicePtr, bytes: usize) -> Result<()> {
        self.aligned("unmap", va, bytes)?;
        let _g = self.enter()?;
        let mut t = lock(&self.vmm);
        let r = t
            .reservation_mut(va, bytes)
            .ok_or_else(|| Error::invalid_argument(format!("[{va:#x}, +{bytes}) is not inside a VA reservation of this device")))?;
        let tiles = VmmTables::tiling(r, va, bytes).ok_or_else(|| {
            Error::invalid_argument(format!("[{va:#x}, +{bytes}) is not a union of whole mappings (cuMemUnmap cannot split one)"))
        })?;
        // One call per mapping, each exactly as mapped: the driver cannot unmap part of one.
        for (s, len) in tiles {
            bump(&self.counts.vmm_unmap);
            // SAFETY: exactly one live mapping of ours; the caller guarantees
            // no in-flight work touches it.
            unsafe { cu!(cuMemUnmap(s, len)) }?;
            r.maps.remove(&s);
        }
        Ok(())
    }

    pub(super) fn cu_vmm_set_access(&self, va: DevicePtr, bytes: usize, access: Access) -> Result<()> {
        self.aligned("set_access", va, bytes)?;
        let g = self.info.granularity;
        let _g = self.enter()?;
        let mut t = lock(&self.vmm);
        let r = t
            .reservation_mut(va, bytes)
            .ok_or_else(|| Error::invalid_argument(format!("[{va:#x}, +{bytes}) is not inside a VA reservation of this device")))?;
        let e = va + bytes as u64;
        let mut a = va;
        while a < e {
            crate::ensure!(
                r.maps.range(..=a).next_back().is_some_and(|(&s, m)| a < s + m.len as u64),
                InvalidArgument,
                "set_access [{va:#x}, +{bytes}): {a:#x} is not mapped"
            );
            a += g as u64;
        }
        let desc = access_desc(self.dev, access);
        bump(&self.counts.vmm_set_access);
        // SAFETY: a fully mapped range of ours and one initialized descriptor.
        unsafe { cu!(cuMemSetAccess(va, bytes, &desc, 1)) }?;
        let mut a = va;
        while a < e {
            if let Some((&s, m)) = r.maps.range_mut(..=a).next_back() {
                m.access[((a - s) / g as u64) as usize] = Some(access);
            }
            a += g as u64;
        }
        Ok(())
    }

    /// Teardown: unmap everything, release handles, free reservations; log failures.
    pub(super) fn vmm_teardown(&self) {
        let mut t = lock(&self.vmm);
        for (&base, r) in t.res.iter_mut() {
            for (&s, m) in std::mem::take(&mut r.maps).iter() {
                // SAFETY: a live mapping of ours; the device is being dropped, so
                // nothing of epmem's can still use it.
                if let Err(e) = unsafe { cu!(cuMemUnmap(s, m.len)) } {
                    log::warn!("epmem: unmapping [{s:#x}, +{}) in reservation {base:#x} at teardown: {e}", m.len);
                }
            }
        }
        for (_, p) in t.phys.drain() {
            // SAFETY: a live handle of ours, released once.
            if let Err(e) = unsafe { cu!(cuMemRelease(p.handle)) } {
                log::warn!("epmem: releasing a physical handle at teardown: {e}");
            }
        }
        for (base, r) in std::mem::take(&mut t.res) {
            // SAFETY: a reservation of ours, unmapped above.
            if let Err(e) = unsafe { cu!(cuMemAddressFree(base, r.len)) } {
                log::warn!("epmem: freeing VA reservation {base:#x} at teardown: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn descriptors_carry_the_device_and_the_protection() {
        let d = access_desc(3, Access::ReadOnly);
        assert_eq!(d.location.id, 3);
        assert_eq!(d.location.type_ as u32, 1);
        assert_eq!(d.flags as u32, 1);
        assert_eq!(access_desc(0, Access::ReadWrite).flags as u32, 3);
        let p = alloc_prop(2);
        assert_eq!((p.type_ as u32, p.requestedHandleTypes.0, p.location.id), (1, 0, 2));
    }
}
