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
// structs only grow at the end, so old callers keep working. The smallest
// `size` accepted is the struct's FIRST published size, frozen as an
// `EPM_*_SIZE_V1` constant in the header, never `size_of` today's struct:
// that would turn every appended field into INVALID_ARGUMENT for every
// binary built before it (docs/ABI.md, "What the ABI promises").

/// A versioned C struct: `#[repr(C)]`, a leading `size: usize`, and the
/// frozen size of its first published version. Implement it with
/// [`versioned!`], which also checks at compile time that the struct never
/// shrank below that size.
pub(crate) trait Versioned: Copy {
    /// The first published `sizeof`: the smallest `size` ever accepted.
    const SIZE_V1: usize;
}

/// A versioned struct C passes IN (read by [`read_versioned`]).
///
/// # Safety
/// Every bit pattern of every field is a valid value: integers, floats and
/// arrays of them only. A C caller can put any bytes in a struct, so a
/// `bool` or a Rust enum here would be undefined behaviour on the first bad
/// byte; such a field is declared as an integer (`u8`, `u32`) and validated
/// where it is converted (as `policy` and `register_sources` are).
pub(crate) unsafe trait VersionedInput: Versioned {}

/// `versioned!(EpmThing, EPM_THING_SIZE_V1)`; add `input` for a struct C
/// passes in (`versioned!(input EpmThingConfig, EPM_THING_CONFIG_SIZE_V1)`),
/// which asserts it holds no field whose bytes could be invalid.
macro_rules! versioned {
    ($t:ty, $v1:expr) => {
        impl $crate::ffi::args::Versioned for $t {
            const SIZE_V1: usize = $v1;
        }
        const _: () = {
            // Structs only grow, and start with `size_t size`.
            assert!(std::mem::size_of::<$t>() >= $v1);
            assert!($v1 >= std::mem::size_of::<usize>());
            assert!(std::mem::offset_of!($t, size) == 0);
        };
    };
    (input $t:ty, $v1:expr) => {
        $crate::ffi::args::versioned!($t, $v1);
        // SAFETY: reviewed per struct: integer and float fields only (the
        // trait's contract); `size` is usize.
        unsafe impl $crate::ffi::args::VersionedInput for $t {}
    };
}
pub(crate) use versioned;

/// The caller's declared `size`, checked against the first version's.
///
/// # Safety (of the C caller)
/// `p` is non-NULL and its leading `size_t` is readable.
fn declared_size<T: Versioned>(p: *const T, what: &str) -> Result<usize> {
    // SAFETY: non-NULL (both callers check); every versioned struct starts
    // with `size_t size`, which the caller promises is readable.
    let caller = unsafe { p.cast::<usize>().read_unaligned() };
    crate::ensure!(
        caller >= T::SIZE_V1,
        InvalidArgument,
        "{what}->size is {caller}; set it to sizeof the struct (at least {}, its first version's size)",
        T::SIZE_V1
    );
    Ok(caller)
}

/// Read a caller's versioned input struct: the fields it declared (by its
/// leading `size`, at least the first version's) over `defaults` for the
/// rest. Bytes past `size` are never read.
///
/// # Safety (of the C caller)
/// `p` is non-NULL (checked) and points to at least `size` readable bytes.
pub(crate) fn read_versioned<T: VersionedInput>(p: *const T, defaults: T, what: &str) -> Result<T> {
    crate::ensure!(!p.is_null(), NullPointer, "argument `{what}` is NULL");
    let caller = declared_size(p, what)?;
    let mut v = defaults;
    let n = caller.min(std::mem::size_of::<T>());
    // SAFETY: the caller's struct has `caller >= n` readable bytes; `v` is a
    // local of at least `n` bytes; they do not overlap. `T: VersionedInput`:
    // any bytes are a valid value of every field, so whatever C wrote there
    // (padding included) leaves `v` a valid `T`.
    unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), (&raw mut v).cast::<u8>(), n) };
    // SAFETY: `v` starts with a usize `size` field (repr(C), checked by `versioned!`).
    unsafe { (&raw mut v).cast::<usize>().write_unaligned(n) };
    Ok(v)
}

/// Write a versioned output struct: `min(size, sizeof today's struct)` bytes
/// and never one past the caller's `size`, with `size` set to the number
/// written (so a newer caller can tell which fields an older library filled).
pub(crate) fn write_versioned<T: Versioned>(out: OutParam<'_, T>, value: T, what: &str) -> Result<()> {
    let caller = declared_size(out.as_ptr(), what)?;
    let n = caller.min(std::mem::size_of::<T>());
    let mut v = value;
    // SAFETY: `v` starts with a usize `size` field (repr(C), checked by `versioned!`).
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

    /// A struct as it looks after a field was appended: version 1 was `size`
    /// and `a` (16 bytes); `b` came later. (A test type, not an FFI struct.)
    #[repr(C)]
    #[derive(Debug, Clone, Copy, PartialEq)]
    struct Grown {
        size: usize,
        a: u32,
        b: u64,
    }
    versioned!(input Grown, 16);

    fn grown_defaults() -> Grown {
        Grown { size: 0, a: 1, b: 2 }
    }

    #[test]
    fn an_old_caller_is_read_up_to_its_size_and_defaulted_after() {
        // What a caller built against version 1 passes: 16 bytes, then
        // memory that is not its struct (0xEE would be read as `b` if the
        // library read past `size`).
        #[repr(C)]
        struct V1Caller {
            size: usize,
            a: u32,
            _pad: u32,
            beyond: [u8; 8],
        }
        let c = V1Caller { size: 16, a: 40, _pad: 0, beyond: [0xEE; 8] };
        let v = read_versioned((&raw const c).cast::<Grown>(), grown_defaults(), "cfg").unwrap();
        assert_eq!(v, Grown { size: 16, a: 40, b: 2 });
        // A current caller: every field is its own.
        let cur = Grown { size: std::mem::size_of::<Grown>(), a: 5, b: 6 };
        assert_eq!(read_versioned(&cur, grown_defaults(), "cfg").unwrap(), Grown { size: 24, a: 5, b: 6 });
        // Below the first version: refused, naming the frozen minimum, not
        // size_of today's struct.
        let short = V1Caller { size: 15, a: 40, _pad: 0, beyond: [0; 8] };
        let e = read_versioned((&raw const short).cast::<Grown>(), grown_defaults(), "cfg").unwrap_err();
        assert_eq!(e.status(), EpmStatus::InvalidArgument);
        assert!(e.message().contains("at least 16"), "{e}");
        assert_eq!(
            read_versioned(std::ptr::null::<Grown>(), grown_defaults(), "cfg").unwrap_err().status(),
            EpmStatus::NullPointer
        );
    }

    #[test]
    fn writes_stop_at_the_callers_size() {
        // Sizes from the first version's to beyond today's: exactly
        // min(size, today's) bytes are written, the guard bytes after them
        // never, and `size` says how many.
        for size in [16usize, 20, 24, 40] {
            let mut buf = [0xA5u8; 48];
            buf[..8].copy_from_slice(&size.to_ne_bytes());
            let out = OutParam::new(buf.as_mut_ptr().cast::<Grown>(), "out").unwrap();
            write_versioned(out, Grown { size: 0, a: 0x0102_0304, b: u64::MAX }, "out").unwrap();
            let n = size.min(24);
            assert_eq!(usize::from_ne_bytes(buf[..8].try_into().unwrap()), n, "size {size}");
            assert_eq!(u32::from_ne_bytes(buf[8..12].try_into().unwrap()), 0x0102_0304);
            assert!(buf[n..].iter().all(|&b| b == 0xA5), "size {size}: wrote past {n}: {buf:?}");
        }
        let mut buf = [0xA5u8; 48];
        buf[..8].copy_from_slice(&15usize.to_ne_bytes());
        let out = OutParam::new(buf.as_mut_ptr().cast::<Grown>(), "out").unwrap();
        let e = write_versioned(out, grown_defaults(), "out").unwrap_err();
        assert_eq!(e.status(), EpmStatus::InvalidArgument);
        assert!(buf[8..].iter().all(|&b| b == 0xA5), "a refused write wrote");
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
