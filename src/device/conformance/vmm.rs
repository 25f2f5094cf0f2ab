//! VMM: aliasing, physical offsets, read-only mappings, handle lifetime.

use std::sync::Arc;

use super::{assert_same, assert_write_refused, download, no_leaks, random_bytes, upload};
use crate::device::{Access, Device, DeviceBuffer, DeviceKind, PhysMem, Stream, VaRange, checksum_host};
use crate::error::{EpmStatus, Result};

/// One physical granule mapped at two VAs of two reservations reads the same
/// through both, whichever side is written. A handle mapped with an offset
/// maps the right granules.
pub fn granule_aliased_at_two_addresses(dev: &Arc<dyn Device>) -> Result<()> {
    no_leaks(dev, "granule_aliased_at_two_addresses", || {
        let g = dev.vmm_granularity();
        let s = Stream::new(dev)?;
        let phys = PhysMem::new(dev, g)?;
        let mut r1 = VaRange::reserve(dev, g)?;
        let mut r2 = VaRange::reserve(dev, 2 * g)?;
        r1.map(0, g, &phys, 0, Access::ReadWrite)?;
        r2.map(g, g, &phys, 0, Access::ReadWrite)?;
        let (va1, va2) = (r1.base(), r2.base() + g as u64);
        assert_ne!(va1, va2, "two reservations returned the same VA");

        let data = random_bytes(0xA1, g);
        upload(dev, &s, va1, &data)?;
        assert_same("granule written via VA 1, read via VA 2", &download(dev, &s, va2, g)?, &data);
        let part = random_bytes(0xA2, g / 2);
        upload(dev, &s, va2 + (g / 4) as u64, &part)?;
        assert_same("granule written via VA 2, read via VA 1", &download(dev, &s, va1 + (g / 4) as u64, g / 2)?, &part);

        if dev.info().kind == DeviceKind::Host {
            // On the host device a device address is a host address: both
            // views must be one page, not two copies kept in sync.
            // SAFETY: both VAs are mapped read-write (above) for the whole
            // granule, and no copy is in flight (the stream is synchronized).
            let (x, y) = unsafe {
                let p1 = std::ptr::with_exposed_provenance_mut::<u8>(va1 as usize);
                p1.write_volatile(0x3C);
                (p1.read_volatile(), std::ptr::with_exposed_provenance::<u8>(va2 as usize).read_volatile())
            };
            assert_eq!((x, y), (0x3C, 0x3C), "a store through one VA is not visible through the other");
        }

        // Two handles mapped in swapped order in one reservation, read back
        // through a straight one; a non-zero handle offset is refused on
        // every device (CUDA answers NOT_SUPPORTED).
        let (pa, pb) = (PhysMem::new(dev, g)?, PhysMem::new(dev, g)?);
        let mut swapped = VaRange::reserve(dev, 2 * g)?;
        swapped.map(0, g, &pb, 0, Access::ReadWrite)?;
        swapped.map(g, g, &pa, 0, Access::ReadWrite)?;
        let mut straight = VaRange::reserve(dev, 2 * g)?;
        straight.map(0, g, &pa, 0, Access::ReadOnly)?;
        straight.map(g, g, &pb, 0, Access::ReadOnly)?;
        let both = random_bytes(0xA3, 2 * g);
        upload(dev, &s, swapped.base(), &both)?;
        let mut want = both[g..].to_vec();
        want.extend_from_slice(&both[..g]);
        let phys2 = PhysMem::new(dev, 2 * g)?;
        let mut off = VaRange::reserve(dev, g)?;
        let e = off.map(0, g, &phys2, g, Access::ReadWrite).unwrap_err();
        assert_eq!(e.status(), EpmStatus::Unsupported, "map at a handle offset: {e}");
        assert_same("two handles mapped in swapped order", &download(dev, &s, straight.base(), 2 * g)?, &want);
        Ok(())
    })
}

/// A host-initiated H2D copy into a read-only mapping is refused; the error
/// is not sticky (later copies succeed) and the data stays intact.
pub fn readonly_write_is_refused_and_non_sticky(dev: &Arc<dyn Device>) -> Result<()> {
    no_leaks(dev, "readonly_write_is_refused_and_non_sticky", || {
        let g = dev.vmm_granularity();
        let s = Stream::new(dev)?;
        let phys = PhysMem::new(dev, g)?;
        let mut rw = VaRange::reserve(dev, g)?;
        let mut ro = VaRange::reserve(dev, g)?;
        rw.map(0, g, &phys, 0, Access::ReadWrite)?;
        ro.map(0, g, &phys, 0, Access::ReadOnly)?;
        let pattern = random_bytes(0xB0, g);
        upload(dev, &s, rw.base(), &pattern)?;

        let junk = random_bytes(0xB1, 4096);
        for at in [0, g / 2 + 1, g - 4096] {
            // SAFETY: `junk` outlives the copy (the stream is synchronized next).
            let enq = unsafe { dev.memcpy_htod_async(ro.base() + at as u64, junk.as_ptr(), junk.len(), s.raw()) };
            let sync = s.synchronize();
            assert_write_refused(dev, &format!("H2D into a read-only mapping at offset {at}"), enq, sync);
        }
        if dev.info().kind == DeviceKind::Host {
            // Device-initiated writes are refused too on the host device (on
            // CUDA a kernel store into a read-only mapping loses the context).
            let src = DeviceBuffer::new(dev, 4096)?;
            let e = dev.memcpy_dtod_async(ro.base(), src.ptr(), 4096, s.raw()).expect_err("D2D into read-only");
            assert_eq!(e.status(), EpmStatus::AccessDenied, "{e}");
            let e = dev.memset_d8_async(ro.base() + 1, 0, 10, s.raw()).expect_err("memset into read-only");
            assert_eq!(e.status(), EpmStatus::AccessDenied, "{e}");
        }
        dev.synchronize()?;
        assert_same("read-only granule after refused writes (via RO)", &download(dev, &s, ro.base(), g)?, &pattern);
        assert_same("read-only granule after refused writes (via RW)", &download(dev, &s, rw.base(), g)?, &pattern);
        // Not sticky: the same stream and device keep working.
        let fresh = DeviceBuffer::new(dev, 12345)?;
        let data = random_bytes(0xB2, 12345);
        upload(dev, &s, fresh.ptr(), &data)?;
        assert_same("a copy after a refused write", &download(dev, &s, fresh.ptr(), data.len())?, &data);
        upload(dev, &s, rw.base() + 8, &data)?;
        assert_same(
            "a read-only view of a granule written via RW",
            &download(dev, &s, ro.base() + 8, data.len())?,
            &data,
        );
        Ok(())
    })
}

/// Three postures in one reservation (RO, RW, RO): reads span all three,
/// writes land only in the RW granule, access can be flipped and back, and
/// a read-only granule feeds D2D copies and the checksum kernel.
pub fn readonly_postures_in_one_reservation(dev: &Arc<dyn Device>) -> Result<()> {
    no_leaks(dev, "readonly_postures_in_one_reservation", || {
        let g = dev.vmm_granularity();
        let s = Stream::new(dev)?;
        let phys = [PhysMem::new(dev, g)?, PhysMem::new(dev, g)?, PhysMem::new(dev, g)?];
        let mut r = VaRange::reserve(dev, 3 * g)?;
        for (i, p) in phys.iter().enumerate() {
            r.map(i * g, g, p, 0, Access::ReadWrite)?;
        }
        let mut want = random_bytes(0xC0, 3 * g);
        upload(dev, &s, r.base(), &want)?;
        r.set_access(0, g, Access::ReadOnly)?;
        r.set_access(2 * g, g, Access::ReadOnly)?;
        assert_same("a read across RO, RW, RO granules", &download(dev, &s, r.base(), 3 * g)?, &want);

        let mid = random_bytes(0xC1, g);
        upload(dev, &s, r.base() + g as u64, &mid)?;
        want[g..2 * g].copy_from_slice(&mid);
        for (what, at, n) in [("granule 0", 100, 1000), ("granule 2", 2 * g + 3, 5000)] {
            let junk = random_bytes(0xC2, n);
            // SAFETY: `junk` outlives the copy (synchronized next).
            let enq = unsafe { dev.memcpy_htod_async(r.base() + at as u64, junk.as_ptr(), n, s.raw()) };
            let sync = s.synchronize();
            assert_write_refused(dev, &format!("H2D into read-only {what}"), enq, sync);
        }
        if dev.info().kind == DeviceKind::Host {
            let junk = random_bytes(0xC3, 64);
            // SAFETY: `junk` outlives the copy attempt (refused at enqueue on the host device).
            let e = unsafe { dev.memcpy_htod_async(r.base() + (2 * g - 32) as u64, junk.as_ptr(), 64, s.raw()) }
                .expect_err("a write spanning RW and RO granules");
            assert_eq!(e.status(), EpmStatus::AccessDenied, "{e}");
        }
        assert_same("RO, RW, RO after writes", &download(dev, &s, r.base(), 3 * g)?, &want);

        // Flip granule 0 to RW, write, flip back.
        r.set_access(0, g, Access::ReadWrite)?;
        let first = random_bytes(0xC4, 4096);
        upload(dev, &s, r.base(), &first)?;
        want[..4096].copy_from_slice(&first);
        r.set_access(0, g, Access::ReadOnly)?;

        // Read-only memory is a fine source for D2D and the checksum kernel.
        let copy = DeviceBuffer::new(dev, 3 * g)?;
        dev.memcpy_dtod_async(copy.ptr(), r.base(), 3 * g, s.raw())?;
        assert_same("D2D out of RO, RW, RO", &download(dev, &s, copy.ptr(), 3 * g)?, &want);
        let out = DeviceBuffer::new(dev, 8)?;
        dev.checksum_async(r.base() + 2 * g as u64, g, out.ptr(), s.raw())?;
        let sum = u64::from_le_bytes(download(dev, &s, out.ptr(), 8)?.try_into().unwrap_or_default());
        assert_eq!(sum, checksum_host(&want[2 * g..]), "checksum of a read-only granule");

        if dev.info().kind == DeviceKind::Host {
            host_mapping_without_access_is_refused(dev, &s)?;
        }
        Ok(())
    })
}

/// Host device: a granule mapped but never given access can be neither read nor written.
fn host_mapping_without_access_is_refused(dev: &Arc<dyn Device>, s: &Stream) -> Result<()> {
    let g = dev.vmm_granularity();
    let phys = PhysMem::new(dev, g)?;
    let va = dev.vmm_reserve(g, 0)?;
    dev.vmm_map(va, g, phys.raw(), 0)?;
    let mut buf = [0u8; 16];
    // SAFETY: `buf` outlives the copy attempts, which are refused at enqueue.
    let (w, r) = unsafe {
        (dev.memcpy_htod_async(va, buf.as_ptr(), 16, s.raw()), dev.memcpy_dtoh_async(buf.as_mut_ptr(), va, 16, s.raw()))
    };
    let sync = s.synchronize();
    dev.vmm_unmap(va, g)?;
    dev.vmm_free_va(va, g)?;
    sync?;
    for (what, r) in [("write", w), ("read", r)] {
        let e = r.expect_err(what);
        assert_eq!(e.status(), EpmStatus::AccessDenied, "{what} of a mapping with no access: {e}");
    }
    Ok(())
}

/// Releasing a physical handle that is still mapped keeps its memory alive
/// until it is unmapped.
pub fn released_handle_stays_alive_while_mapped(dev: &Arc<dyn Device>) -> Result<()> {
    no_leaks(dev, "released_handle_stays_alive_while_mapped", || {
        let g = dev.vmm_granularity();
        let s = Stream::new(dev)?;
        let phys = PhysMem::new(dev, g)?;
        let mut r = VaRange::reserve(dev, g)?;
        r.map(0, g, &phys, 0, Access::ReadWrite)?;
        let data = random_bytes(0xD0, g);
        upload(dev, &s, r.base(), &data)?;
        drop(phys);
        assert_same("a mapping of a released handle", &download(dev, &s, r.base(), g)?, &data);
        let more = random_bytes(0xD1, 4096);
        upload(dev, &s, r.base() + 4096, &more)?;
        assert_same("a write into a mapping of a released handle", &download(dev, &s, r.base() + 4096, 4096)?, &more);
        r.unmap(0, g)?;
        Ok(())
    })
}
