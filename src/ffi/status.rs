//! Status codes at the boundary and the thread-local last error.
//!
//! A fallible `epm_*` function returns an [`EpmStatus`]; the detail goes to a
//! thread-local message that `epm_last_error_message()` returns. The panic
//! boundary (`ffi_boundary!`) clears the message when a status-returning call
//! starts and sets it when the call fails, so the message always describes the
//! most recent status-returning call on this thread ("" after a success).

use std::cell::RefCell;
use std::ffi::{CString, c_char, c_int};

use crate::error::{EpmStatus, Error};
use crate::ffi::panic::ffi_boundary;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Forget the last error (no allocation when there is none).
pub(crate) fn clear_last_error() {
    // try_with: during thread teardown the slot may be gone; nothing to clear then.
    let _ = LAST_ERROR.try_with(|m| {
        if !m.borrow().as_bytes().is_empty() {
            *m.borrow_mut() = CString::default();
        }
    });
}

/// Record `e` as this thread's last error.
pub(crate) fn set_last_error(e: &Error) {
    // A message with an interior NUL would be cut short in C; keep the rest visible.
    let text = CString::new(e.message().replace('\0', "\\0")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|m| *m.borrow_mut() = text);
}

/// The C spelling of a status, e.g. `c"EPM_STATUS_NULL_POINTER"`.
///
/// The match is exhaustive, so a new [`EpmStatus`] variant cannot be added
/// without a name; tests/header.rs checks every name against the header.
pub fn status_name(s: EpmStatus) -> &'static std::ffi::CStr {
    use EpmStatus::*;
    match s {
        Ok => c"EPM_STATUS_OK",
        InvalidArgument => c"EPM_STATUS_INVALID_ARGUMENT",
        NullPointer => c"EPM_STATUS_NULL_POINTER",
        InvalidHandle => c"EPM_STATUS_INVALID_HANDLE",
        InvalidState => c"EPM_STATUS_INVALID_STATE",
        Unsupported => c"EPM_STATUS_UNSUPPORTED",
        NotReady => c"EPM_STATUS_NOT_READY",
        InvalidConfig => c"EPM_STATUS_INVALID_CONFIG",
        OutOfHostMemory => c"EPM_STATUS_OUT_OF_HOST_MEMORY",
        OutOfDeviceMemory => c"EPM_STATUS_OUT_OF_DEVICE_MEMORY",
        OutOfBudget => c"EPM_STATUS_OUT_OF_BUDGET",
        AllInUse => c"EPM_STATUS_ALL_IN_USE",
        DeviceUnavailable => c"EPM_STATUS_DEVICE_UNAVAILABLE",
        CudaError => c"EPM_STATUS_CUDA_ERROR",
        AccessDenied => c"EPM_STATUS_ACCESS_DENIED",
        ContextLost => c"EPM_STATUS_CONTEXT_LOST",
        OsError => c"EPM_STATUS_OS_ERROR",
        Internal => c"EPM_STATUS_INTERNAL",
        Panic => c"EPM_STATUS_PANIC",
    }
}

/// Every status, for turning a C integer back into an [`EpmStatus`] without
/// transmuting a value Rust may not know.
pub const ALL_STATUSES: [EpmStatus; 19] = {
    use EpmStatus::*;
    [
        Ok,
        InvalidArgument,
        NullPointer,
        InvalidHandle,
        InvalidState,
        Unsupported,
        NotReady,
        InvalidConfig,
        OutOfHostMemory,
        OutOfDeviceMemory,
        OutOfBudget,
        AllInUse,
        DeviceUnavailable,
        CudaError,
        AccessDenied,
        ContextLost,
        OsError,
        Internal,
        Panic,
    ]
};

/// The status whose C value is `v`, if there is one.
pub fn status_from_int(v: c_int) -> Option<EpmStatus> {
    ALL_STATUSES.iter().copied().find(|s| *s as c_int == v)
}

/// The message of the most recent failed status-returning `epm_*` call on
/// this thread, e.g. "argument `out` is NULL" (`epm_status_name` names the
/// status itself).
///
/// Returns "" (never NULL) when that call succeeded or no call was made yet.
/// The string is owned by epmem and stays valid until the next `epm_*` call on
/// the same thread; copy it to keep it. Thread-safe: each thread has its own.
#[unsafe(no_mangle)]
pub extern "C" fn epm_last_error_message() -> *const c_char {
    ffi_boundary! { -> *const c_char {
        LAST_ERROR
            .try_with(|m| m.borrow().as_ptr())
            .unwrap_or(c"".as_ptr())
    }}
}

/// The C name of a status code, e.g. "EPM_STATUS_INVALID_HANDLE".
///
/// `status` is an `EpmStatus` value; an unknown value returns
/// "EPM_STATUS_UNKNOWN". The string is static: never NULL, never freed.
/// Thread-safe. Does not change the last error.
#[unsafe(no_mangle)]
pub extern "C" fn epm_status_name(status: c_int) -> *const c_char {
    ffi_boundary! { -> *const c_char {
        match status_from_int(status) {
            Some(s) => status_name(s).as_ptr(),
            None => c"EPM_STATUS_UNKNOWN".as_ptr(),
        }
    }}
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn last() -> String {
        // SAFETY: epm_last_error_message never returns NULL and the string
        // lives until the next epm call on this thread.
        unsafe { CStr::from_ptr(epm_last_error_message()) }.to_str().unwrap().to_owned()
    }

    #[test]
    fn last_error_is_set_then_cleared() {
        clear_last_error();
        assert_eq!(last(), "");
        set_last_error(&Error::new(EpmStatus::NullPointer, "argument `out` is NULL"));
        assert_eq!(last(), "argument `out` is NULL");
        clear_last_error();
        assert_eq!(last(), "");
    }

    #[test]
    fn last_error_survives_interior_nul() {
        set_last_error(&Error::new(EpmStatus::Internal, "a\0b"));
        assert_eq!(last(), "a\\0b");
    }

    #[test]
    fn last_error_is_per_thread() {
        set_last_error(&Error::new(EpmStatus::Internal, "here"));
        let other = std::thread::spawn(last).join().unwrap();
        assert_eq!(other, "");
        assert!(last().ends_with("here"));
    }

    #[test]
    fn status_names_round_trip_and_unknown_is_named() {
        for s in ALL_STATUSES {
            assert_eq!(status_from_int(s as c_int), Some(s));
            // SAFETY: static NUL-terminated strings.
            let n = unsafe { CStr::from_ptr(epm_status_name(s as c_int)) };
            assert_eq!(n, status_name(s));
        }
        // SAFETY: as above.
        let n = unsafe { CStr::from_ptr(epm_status_name(12345)) };
        assert_eq!(n, c"EPM_STATUS_UNKNOWN");
        assert_eq!(status_from_int(-1), None);
    }
}
