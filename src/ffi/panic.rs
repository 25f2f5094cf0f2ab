//! The panic boundary: no Rust panic ever unwinds into C.
//!
//! Every exported function body is wrapped in [`ffi_boundary!`], in one of two
//! forms:
//!
//! ```ignore
//! // Fallible: the body is a `Result<()>`; the function returns EpmStatus.
//! ffi_boundary! {
//!     let dev = try_handle!(dev);
//!     let out = try_out!(out);
//!     out.set(dev.info().ordinal);
//!     Ok(())
//! }
//!
//! // Infallible: the body is a plain value of a type with a panic default
//! // (`PanicValue`): 0, false, or "" for C strings.
//! ffi_boundary! { -> u32 { version_number() } }
//! ```
//!
//! The fallible form clears the thread's last error on entry, records the
//! error on failure, and turns a caught panic into `EPM_STATUS_PANIC` with the
//! panic message. The infallible form leaves the last error alone unless it
//! catches a panic. Both install the logger on first use, and both poison
//! the handles a call looked up when it panicked (`handle::CallScope`).

use std::any::Any;
use std::ffi::c_char;
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::error::{EpmStatus, Error, Result};
use crate::ffi::status::{clear_last_error, set_last_error};

/// What an infallible exported function returns when its body panicked.
pub trait PanicValue {
    fn panic_value() -> Self;
}

macro_rules! zero_on_panic {
    ($($t:ty),*) => { $(impl PanicValue for $t { fn panic_value() -> Self { 0 as $t } })* };
}
zero_on_panic!(u8, u16, u32, u64, usize, i32, i64, f32, f64);

impl PanicValue for bool {
    fn panic_value() -> Self {
        false
    }
}

impl PanicValue for () {
    fn panic_value() -> Self {}
}

/// C strings returned by epmem are never NULL: a panic yields "".
impl PanicValue for *const c_char {
    fn panic_value() -> Self {
        c"".as_ptr()
    }
}

fn panic_error(payload: Box<dyn Any + Send>) -> Error {
    let what = if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(non-string panic payload)".to_owned()
    };
    // A payload of unknown type could panic in its own Drop: forget it rather
    // than risk that here. The string payloads of `panic!` cannot; dropping
    // them keeps a caught panic from leaking (LeakSanitizer saw it in
    // ffi-tests/test_poison.c).
    if payload.is::<&str>() || payload.is::<String>() {
        drop(payload);
    } else {
        std::mem::forget(payload);
    }
    log::error!("a panic was caught at the C boundary: {what}");
    Error::new(EpmStatus::Panic, format!("a Rust panic was caught at the C boundary: {what}"))
}

/// The one panic boundary of every surface epmem exports (the C API here,
/// the ONNX Runtime entry points in `crate::ort`): installs the logger, runs
/// `body`, and turns a caught panic into an [`EpmStatus::Panic`] error with
/// the panic message. Each surface then reports the error its own way.
/// A handle the body looked up before it panicked is poisoned: its object
/// may hold half-updated state, so later calls on it are refused.
pub(crate) fn catch<T>(body: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_value(body).unwrap_or_else(|payload| Err(panic_error(payload)))
}

/// [`catch`] for a body that returns a value: the panic payload on a panic.
fn catch_value<T>(body: impl FnOnce() -> T) -> std::thread::Result<T> {
    let scope = crate::ffi::handle::CallScope::enter();
    let result = catch_unwind(AssertUnwindSafe(|| {
        crate::ffi::log::ensure_installed();
        body()
    }));
    if result.is_err() {
        scope.poison_used();
    }
    result
}

/// The fallible form of the boundary; use [`ffi_boundary!`].
#[doc(hidden)]
pub fn status_boundary(body: impl FnOnce() -> Result<()>) -> EpmStatus {
    clear_last_error();
    match catch(body) {
        Ok(()) => EpmStatus::Ok,
        Err(e) => {
            set_last_error(&e);
            // An Error carrying Ok would read as success in C with a message set.
            if e.status() == EpmStatus::Ok { EpmStatus::Internal } else { e.status() }
        }
    }
}

/// The infallible form of the boundary; use [`ffi_boundary!`].
#[doc(hidden)]
pub fn value_boundary<T: PanicValue>(body: impl FnOnce() -> T) -> T {
    catch_value(body).unwrap_or_else(|payload| {
        set_last_error(&panic_error(payload));
        T::panic_value()
    })
}

/// Wrap the body of every `extern "C"` function. See the module docs.
macro_rules! ffi_boundary {
    (-> $t:ty { $($body:tt)* }) => {
        $crate::ffi::panic::value_boundary(|| -> $t { $($body)* })
    };
    ($($body:tt)*) => {
        $crate::ffi::panic::status_boundary(|| -> $crate::error::Result<()> { $($body)* })
    };
}
pub(crate) use ffi_boundary;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::status::epm_last_error_message;
    use std::ffi::CStr;

    fn last() -> String {
        // SAFETY: never NULL, valid until the next epm call on this thread.
        unsafe { CStr::from_ptr(epm_last_error_message()) }.to_string_lossy().into_owned()
    }

    #[test]
    fn panic_becomes_status_with_message() {
        let s = ffi_boundary! {
            if last().is_empty() { panic!("boom {}", 7) }
            Ok(())
        };
        assert_eq!(s, EpmStatus::Panic);
        assert!(last().contains("boom 7"), "{}", last());
    }

    #[test]
    fn error_sets_message_and_success_clears_it() {
        let s = ffi_boundary! { crate::bail!(InvalidArgument, "size {} is zero", 0) };
        assert_eq!(s, EpmStatus::InvalidArgument);
        assert_eq!(last(), "size 0 is zero");
        let s = ffi_boundary! { Ok(()) };
        assert_eq!(s, EpmStatus::Ok);
        assert_eq!(last(), "");
    }

    #[test]
    fn value_form_returns_default_on_panic_and_keeps_last_error_otherwise() {
        let s = ffi_boundary! { crate::bail!(NotReady, "pending") };
        assert_eq!(s, EpmStatus::NotReady);
        let v = ffi_boundary! { -> u64 { 41 + 1 } };
        assert_eq!(v, 42);
        assert!(last().contains("pending"), "value form must not clear: {}", last());
        let v = ffi_boundary! { -> u64 { if v == 42 { panic!("in value") } v } };
        assert_eq!(v, 0);
        assert!(last().contains("in value"));
        let p = ffi_boundary! { -> *const c_char { panic!("str") } };
        // SAFETY: the panic default is a static "".
        assert_eq!(unsafe { CStr::from_ptr(p) }, c"");
    }

    #[test]
    fn error_carrying_ok_is_not_success() {
        let s = ffi_boundary! { Err(Error::new(EpmStatus::Ok, "confused")) };
        assert_eq!(s, EpmStatus::Internal);
    }
}
