//! Pointer arguments: early-return checks and out-params.
//!
//! Inside an `ffi_boundary!` body each macro returns an `Err` from the body,
//! so the function returns the status and the message names the argument:
//!
//! - `check_not_null!(p)` — `EPM_STATUS_NULL_POINTER` if `p` is NULL;
//! - `try_out!(out)` — checks an out-param and returns an [`OutParam`]; call
//!   `.set(v)` once, at the end, so out-params are written only on success;
//! - `try_str!(s)` — a NUL-terminated UTF-8 C string as `&str`;
//! - `try_host_range!(p, n)` — a host buffer argument: non-NULL, `n > 0`, no
//!   address overflow. Returns `(p as *const u8, n)` (not a slice: async
//!   copies read it later, and Rust must not assume it is immutable meanwhile).

use std::marker::PhantomData;

use crate::error::Result;

/// A checked, non-NULL out-param. Writing consumes it: at most one write.
pub struct OutParam<'a, T> {
    ptr: *mut T,
    _caller: PhantomData<&'a mut T>,
}

impl<T> OutParam<'_, T> {
    /// Check `ptr` (`what` names the argument in the message).
    pub fn new(ptr: *mut T, what: &str) -> Result<Self> {
        crate::ensure!(!ptr.is_null(), NullPointer, "argument `{what}` is NULL");
        Ok(Self { ptr, _caller: PhantomData })
    }
    /// Write the result. Call it last, after everything that can fail.
    pub fn set(self, value: T) {
        // SAFETY: non-NULL (checked in `new`); the C caller promises a valid,
        // aligned, writable `T` (documented on every function with an
        // out-param). `write` does not read or drop the old contents, which
        // may be uninitialized C memory.
        unsafe { self.ptr.write(value) }
    }
    /// The raw pointer, for partial writes of versioned structs.
    pub fn as_ptr(&self) -> *mut T {
        self.ptr
    }
}

/// Check an out-param; see the module docs.
macro_rules! try_out {
    ($p:ident) => {
        $crate::ffi::args::OutParam::new($p, stringify!($p))?
    };
}
pub(crate) use try_out;

/// Return `EPM_STATUS_NULL_POINTER` naming the argument if it is NULL.
macro_rules! check_not_null {
    ($p:ident) => {
        $crate::ensure!(!$p.is_null(), NullPointer, "argument `{}` is NULL", stringify!($p))
    };
}
pub(crate) use check_not_null;

/// Borrow a C string argument as `&str`.
///
/// # Safety
/// A non-NULL `p` is a NUL-terminated string that outlives `'a`.
pub unsafe fn c_str<'a>(p: *const std::ffi::c_char, what: &str) -> Result<&'a str> {
    crate::ensure!(!p.is_null(), NullPointer, "argument `{what}` is NULL");
    // SAFETY: non-NULL, and NUL-terminated and alive per this fn's contract.
    let s = unsafe { std::ffi::CStr::from_ptr(p) };
    s.to_str().map_err(|e| crate::error::Error::invalid_argument(format!("argument `{what}` is not UTF-8: {e}")))
}

macro_rules! try_str {
    ($p:ident) => {
        // SAFETY: every exported function taking a string documents that it
        // must be NUL-terminated and live for the duration of the call.
        unsafe { $crate::ffi::args::c_str($p, stringify!($p))? }
    };
}
pub(crate) use try_str;

/// Validate a host buffer argument (non-NULL, `len > 0`, no overflow).
pub fn host_range<T>(p: *const T, len: usize, what: &str) -> Result<(*const u8, usize)> {
    crate::ensure!(!p.is_null(), NullPointer, "argument `{what}` is NULL");
    crate::ensure!(len > 0, InvalidArgument, "`{what}`: size is 0");
    crate::ensure!(
        len <= isize::MAX as usize && (p as usize).checked_add(len).is_some(),
        InvalidArgument,
        "`{what}`: {len} bytes at {p:p} overflow the address space"
    );
    Ok((p.cast(), len))
}

macro_rules! try_host_range {
    ($p:ident, $len:expr) => {
        $crate::ffi::args::host_range($p, $len, stringify!($p))?
    };
}
pub(crate) use try_host_range;

/// Validate a device range `[p, p+len)`: `len > 0`, no overflow.
pub fn device_range(p: u64, len: usize, what: &str) -> Result<()> {
    crate::ensure!(len > 0, InvalidArgument, "`{what}`: size is 0");
    crate::ensure!(
        p.checked_add(len as u64).is_some(),
        InvalidArgument,
        "`{what}`: {len} bytes at device address {p:#x} overflow the address space"
    );
    Ok(())
}

// Versioned structs: every C struct the host reads or fills starts with a
// `size_t size` the caller sets to `sizeof` the struct it was compiled with;
// structs only grow at the end, so old callers keep working.

/// Read a caller's versioned input struct: the fields it declared (by its
/// leading `size`) over `defaults` for the rest.
///
/// # Safety (of the C caller)
/// `p` is non-NULL (checked) and points to at least `size` readable bytes.
pub(crate) fn read_versioned<T: Copy>(p: *const T, defaults: T, min_size: usize, what: &str) -> Result<T> {
    crate::ensure!(!p.is_null(), NullPointer, "argument `{what}` is NULL");
    // SAFETY: non-NULL; every versioned struct starts with `size_t size`,
    // which the caller promises is readable.
    let caller = unsafe { p.cast::<usize>().read_unaligned() };
    crate::ensure!(
        caller >= min_size,
        InvalidArgument,
        "{what}->size is {caller}; set it to sizeof the struct (at least {min_size})"
    );
    let mut v = defaults;
    let n = caller.min(std::mem::size_of::<T>());
    // SAFETY: the caller's struct has `caller >= n` readable bytes; `v` is a
    // local of at least `n` bytes; they do not overlap. Every field of these
    // structs is an integer or float, so any bytes are a valid value.
    unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), (&raw mut v).cast::<u8>(), n) };
    // SAFETY: `v` starts with a usize `size` field (repr(C)).
    unsafe { (&raw mut v).cast::<usize>().write_unaligned(n) };
    Ok(v)
}

/// Write a versioned output struct: at most the caller's declared `size`
/// bytes, with `size` set to the number written.
pub(crate) fn write_versioned<T: Copy>(out: OutParam<'_, T>, value: T, min_size: usize, what: &str) -> Result<()> {
    // SAFETY: `out` is non-NULL (OutParam) and the caller promises its
    // leading `size` field is readable.
    let caller = unsafe { out.as_ptr().cast::<usize>().read_unaligned() };
    crate::ensure!(
        caller >= min_size,
        InvalidArgument,
        "{what}->size is {caller}; set it to sizeof the struct (at least {min_size})"
    );
    let n = caller.min(std::mem::size_of::<T>());
    let mut v = value;
    // SAFETY: `v` starts with a usize `size` field (repr(C)).
    unsafe { (&raw mut v).cast::<usize>().write_unaligned(n) };
    // SAFETY: the caller's struct has `caller >= n` writable bytes; `v` is a
    // local of at least `n` bytes; they do not overlap.
    unsafe { std::ptr::copy_nonoverlapping((&raw const v).cast::<u8>(), out.as_ptr().cast::<u8>(), n) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::EpmStatus;

    #[test]
    fn out_param_rejects_null_naming_the_argument() {
        let out: *mut u32 = std::ptr::null_mut();
        let e = OutParam::new(out, "out_size").err().unwrap();
        assert_eq!(e.status(), EpmStatus::NullPointer);
        assert!(e.message().contains("`out_size`"), "{e}");
    }

    #[test]
    fn out_param_writes_once() {
        let mut v = 0u32;
        OutParam::new(&mut v, "v").unwrap().set(9);
        assert_eq!(v, 9);
    }

    #[test]
    fn ranges_reject_zero_null_and_overflow() {
        let b = [0u8; 4];
        assert!(host_range(b.as_ptr(), 4, "b").is_ok());
        assert_eq!(host_range(b.as_ptr(), 0, "b").unwrap_err().status(), EpmStatus::InvalidArgument);
        assert_eq!(host_range(std::ptr::null::<u8>(), 4, "b").unwrap_err().status(), EpmStatus::NullPointer);
        assert_eq!(host_range(b.as_ptr(), usize::MAX, "b").unwrap_err().status(), EpmStatus::InvalidArgument);
        assert!(device_range(0x1000, 16, "d").is_ok());
        assert_eq!(device_range(u64::MAX - 3, 16, "d").unwrap_err().status(), EpmStatus::InvalidArgument);
        assert_eq!(device_range(0x1000, 0, "d").unwrap_err().status(), EpmStatus::InvalidArgument);
    }

    #[test]
    fn c_str_checks_null_and_utf8() {
        // SAFETY: static or local NUL-terminated strings, or NULL.
        unsafe {
            assert_eq!(c_str(c"host".as_ptr(), "s").unwrap(), "host");
            assert_eq!(c_str(std::ptr::null(), "s").unwrap_err().status(), EpmStatus::NullPointer);
            let bad = [0xffu8 as std::ffi::c_char, 0];
            assert_eq!(c_str(bad.as_ptr(), "s").unwrap_err().status(), EpmStatus::InvalidArgument);
        }
    }
}
