//! VMM: physical handles (cuMemCreate), VA reservations, mappings, access.
//!
//! The tables mirror what the driver holds, so we can refuse what would
//! otherwise reach the GPU as a fault: a kernel or memset writing into a
//! read-only mapping raises error 700 and loses the context (measured on the
//! H200), so writes into our read-only ranges, and any access to our
//! unmapped or no-access granules, are `AccessDenied` before any driver call
//! (the same statuses as the host device).

use std::collections::BTreeMap;
use std::mem::{offset_of, size_of};

use cudarc::driver::sys;

mod tables;

use super::{CudaDevice, bump, lock};
use crate::device::{Access, DevicePtr, RawPhys};
use crate::error::{EpmStatus, Error, Result};
pub(super) use tables::VmmTables;
use tables::{Mapping, Phys, Reservation};

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

    /// Whether `[p, p+n)` overlaps any of our VA reservations.
    pub(super) fn vmm_touches(&self, p: DevicePtr, n: usize) -> bool {
        lock(&self.vmm).touches(p, n)
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
        let phys = lock(&self.vmm).phys.remove(&h.0).ok_or_else(|| {
            Error::new(EpmStatus::InvalidHandle, format!("physical handle {} is not live on this device", h.0))
        })?;
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
        crate::ensure!(
            offset.is_multiple_of(g),
            InvalidArgument,
            "physical offset {offset} is not granule-aligned ({g})"
        );
        let _g = self.enter()?;
        let mut t = lock(&self.vmm);
        let phys = t.phys.get(&h.0).ok_or_else(|| {
            Error::new(EpmStatus::InvalidHandle, format!("physical handle {} is not live on this device", h.0))
        })?;
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
        let r = t.reservation_mut(va, bytes).ok_or_else(|| {
            Error::invalid_argument(format!("[{va:#x}, +{bytes}) is not inside a VA reservation of this device"))
        })?;
        let tiles = VmmTables::tiling(r, va, bytes).ok_or_else(|| {
            Error::invalid_argument(format!(
                "[{va:#x}, +{bytes}) is not a union of whole mappings (cuMemUnmap cannot split one)"
            ))
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
        let r = t.reservation_mut(va, bytes).ok_or_else(|| {
            Error::invalid_argument(format!("[{va:#x}, +{bytes}) is not inside a VA reservation of this device"))
        })?;
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
