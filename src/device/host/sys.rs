//! The libc calls the host device makes, each turned into a `Result` that
//! names the call and errno. Nothing else in `host/` calls libc for memory.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::error::{Error, Result};

/// The OS page size (4 KiB when sysconf cannot say).
pub(super) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

/// (available, total) physical RAM in bytes.
pub(super) fn ram() -> Result<(u64, u64)> {
    // SAFETY: sysinfo writes only into the struct we pass; zeroed is a valid value of it.
    let mut si: libc::sysinfo = unsafe { std::mem::zeroed() };
    // SAFETY: `si` is a valid, writable sysinfo struct.
    if unsafe { libc::sysinfo(&mut si) } != 0 {
        return Err(Error::last_os_error("sysinfo"));
    }
    let unit = si.mem_unit.max(1) as u64;
    Ok(((si.freeram as u64 + si.bufferram as u64) * unit, si.totalram as u64 * unit))
}

/// Fresh private anonymous memory of `len` bytes with protection `prot`.
/// `PROT_NONE` reservations pass `noreserve` so they cost no commit charge.
pub(super) fn map_anon(len: usize, prot: i32, noreserve: bool) -> Result<usize> {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | if noreserve { libc::MAP_NORESERVE } else { 0 };
    // Linux answers ENOMEM for such a length, valgrind EINVAL: say out of
    // memory either way, so the status does not depend on who runs us.
    if len > isize::MAX as usize {
        return Err(Error::new(
            crate::error::EpmStatus::OutOfHostMemory,
            format!("mmap({len} bytes, anonymous): larger than the address space"),
        ));
    }
    // SAFETY: a non-fixed anonymous mapping touches no existing memory.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, -1, 0) };
    if p == libc::MAP_FAILED {
        return Err(Error::last_os_error(&format!("mmap({len} bytes, anonymous)")));
    }
    Ok(p as usize)
}

/// `len` bytes of `PROT_NONE` address space aligned to `align` (a power-of-two
/// multiple of the page size): over-map, then trim both ends.
pub(super) fn reserve_aligned(len: usize, align: usize) -> Result<usize> {
    let span = len
        .checked_add(align)
        .ok_or_else(|| Error::invalid_argument(format!("reservation of {len} bytes aligned to {align} overflows")))?;
    let raw = map_anon(span, libc::PROT_NONE, true)?;
    let start = raw.next_multiple_of(align);
    let head = start - raw;
    let tail = span - head - len;
    // SAFETY: head and tail are parts of the mapping just made, outside the kept range.
    unsafe {
        if head > 0 {
            unmap(raw, head)?;
        }
        if tail > 0 {
            unmap(start + len, tail)?;
        }
    }
    Ok(start)
}

/// Map `len` bytes of `fd` from `offset` at `addr`, shared, with no access.
///
/// # Safety
/// `[addr, addr+len)` belongs to the caller (a reservation it owns) and
/// nothing else uses the memory it replaces.
pub(super) unsafe fn map_shared_fixed(addr: usize, len: usize, fd: &OwnedFd, offset: usize) -> Result<()> {
    let flags = libc::MAP_SHARED | libc::MAP_FIXED;
    // SAFETY: the caller owns the range; MAP_FIXED replaces only it.
    let p = unsafe {
        libc::mmap(addr as *mut libc::c_void, len, libc::PROT_NONE, flags, fd.as_raw_fd(), offset as libc::off_t)
    };
    if p == libc::MAP_FAILED {
        return Err(Error::last_os_error("mmap(MAP_FIXED|MAP_SHARED, memfd)"));
    }
    Ok(())
}

/// Replace `[addr, addr+len)` with fresh `PROT_NONE` anonymous memory, so a
/// reservation stays reserved after its physical memory is unmapped.
///
/// # Safety
/// As [`map_shared_fixed`].
pub(super) unsafe fn map_none_fixed(addr: usize, len: usize) -> Result<()> {
    let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED;
    // SAFETY: the caller owns the range; MAP_FIXED replaces only it.
    let p = unsafe { libc::mmap(addr as *mut libc::c_void, len, libc::PROT_NONE, flags, -1, 0) };
    if p == libc::MAP_FAILED {
        return Err(Error::last_os_error("mmap(MAP_FIXED, PROT_NONE)"));
    }
    Ok(())
}

/// Change the protection of `[addr, addr+len)`.
///
/// # Safety
/// The caller owns the range and no one relies on its current protection.
pub(super) unsafe fn protect(addr: usize, len: usize, prot: i32) -> Result<()> {
    // SAFETY: the caller owns the range.
    if unsafe { libc::mprotect(addr as *mut libc::c_void, len, prot) } != 0 {
        return Err(Error::last_os_error("mprotect"));
    }
    Ok(())
}

/// Unmap `[addr, addr+len)`.
///
/// # Safety
/// The caller owns the range and nothing uses it any more.
pub(super) unsafe fn unmap(addr: usize, len: usize) -> Result<()> {
    // SAFETY: the caller owns the range and has stopped using it.
    if unsafe { libc::munmap(addr as *mut libc::c_void, len) } != 0 {
        return Err(Error::last_os_error("munmap"));
    }
    Ok(())
}

/// Try to page-lock `[addr, addr+len)`; false when the locked-memory limit
/// (or anything else) refuses. Unlocking is implicit in `munmap`.
pub(super) fn try_lock(addr: usize, len: usize) -> bool {
    // SAFETY: mlock changes no memory contents; the range is the caller's mapping.
    unsafe { libc::mlock(addr as *const libc::c_void, len) == 0 }
}

/// An anonymous memory file of `len` bytes: one physical allocation that can
/// be mapped at many addresses (each mapping shares its pages).
pub(super) fn memfd(len: usize) -> Result<OwnedFd> {
    // SAFETY: the name is a NUL-terminated literal.
    let fd = unsafe { libc::memfd_create(c"epmem-granule".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::last_os_error("memfd_create"));
    }
    // SAFETY: memfd_create returned a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on our own descriptor.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(Error::last_os_error(&format!("ftruncate(memfd, {len})")));
    }
    Ok(fd)
}
