//! epmem's log records into ONNX Runtime's logger.
//!
//! When ORT loads the library, `CreateEpFactories` gets ORT's default logger;
//! records then go to it (`Logger_LogMessage`) at the severity it was
//! created with, unless the host set its own callback or `EPM_LOG` is set
//! (see `crate::ffi::log`). The logger belongs to ORT's environment, so it is
//! used only between the first `CreateEpFactories` that brought one and the
//! `ReleaseEpFactory` of the last such factory: objects that outlive their
//! factory (tensors released after unregistering) log to stderr/`EPM_LOG`.

use std::ffi::{c_char, c_void};
use std::sync::Mutex;

use super::abi::*;
use super::api::Api;
use crate::ffi::log::{EpmLogLevel, set_framework_sink};

/// ORT's logger and the one call we make on it.
struct Target {
    logger: *const OrtLogger,
    api: Api,
}

struct Attached {
    _target: Box<Target>,
    /// Factories that attached (several registrations share one environment).
    refs: usize,
}

// SAFETY: ORT's logger is thread-safe (ORT logs from every thread), and the
// pointer is only used while the environment that owns it is alive (see the
// module docs).
unsafe impl Send for Attached {}

static ATTACHED: Mutex<Option<Attached>> = Mutex::new(None);

fn attached() -> std::sync::MutexGuard<'static, Option<Attached>> {
    ATTACHED.lock().unwrap_or_else(|p| p.into_inner())
}

/// epmem's filter for ORT's severity (VERBOSE 0 … FATAL 4).
pub(crate) fn level_for(severity: OrtLoggingLevel) -> EpmLogLevel {
    match severity {
        s if s <= LOGGING_VERBOSE => EpmLogLevel::Trace,
        LOGGING_INFO => EpmLogLevel::Info,
        LOGGING_WARNING => EpmLogLevel::Warn,
        _ => EpmLogLevel::Error,
    }
}

/// ORT's severity for an epmem record.
pub(crate) fn severity_for(level: EpmLogLevel) -> OrtLoggingLevel {
    match level {
        EpmLogLevel::Off | EpmLogLevel::Error => LOGGING_ERROR,
        EpmLogLevel::Warn => LOGGING_WARNING,
        EpmLogLevel::Info => LOGGING_INFO,
        EpmLogLevel::Debug | EpmLogLevel::Trace => LOGGING_VERBOSE,
    }
}

unsafe extern "C" fn to_ort(user_data: *mut c_void, level: EpmLogLevel, message: *const c_char) {
    // SAFETY: user_data is the Target boxed in `attach`, alive until
    // `set_framework_sink(None)` has returned in `detach`.
    let t = unsafe { &*(user_data as *const Target) };
    // SAFETY: ORT's logger is alive (module docs); the strings are
    // NUL-terminated and ORT copies them. A failure to log is dropped: there
    // is nowhere left to report it.
    unsafe {
        let st = (t.api.o.Logger_LogMessage)(
            t.logger,
            severity_for(level),
            message,
            c"epmem".as_ptr(),
            0,
            c"epmem".as_ptr(),
        );
        if !st.is_null() {
            (t.api.o.ReleaseStatus)(st);
        }
    }
}

/// Route records to `logger` (NULL: nothing to do). True when this call
/// holds a reference that [`detach`] must drop.
pub(crate) fn attach(api: &Api, logger: *const OrtLogger) -> bool {
    if logger.is_null() {
        return false;
    }
    let mut g = attached();
    if let Some(a) = g.as_mut() {
        a.refs += 1;
        return true;
    }
    let mut severity: OrtLoggingLevel = LOGGING_WARNING;
    // SAFETY: ORT passed a live logger; on failure keep WARNING, ORT's default.
    let st = unsafe { (api.o.Logger_GetLoggingSeverityLevel)(logger, &mut severity) };
    if !st.is_null() {
        // SAFETY: a status ORT returned to us.
        unsafe { (api.o.ReleaseStatus)(st) };
        severity = LOGGING_WARNING;
    }
    let target = Box::new(Target { logger, api: *api });
    let ud = &*target as *const Target as *mut c_void;
    if !set_framework_sink(Some((to_ort, ud, level_for(severity)))) {
        return false;
    }
    *g = Some(Attached { _target: target, refs: 1 });
    true
}

/// Drop one reference taken by [`attach`]; the last one stops using ORT's logger.
pub(crate) fn detach() {
    let mut g = attached();
    let last = match g.as_mut() {
        Some(a) if a.refs > 1 => {
            a.refs -= 1;
            false
        }
        Some(_) => true,
        None => false,
    };
    if last {
        // Once this returns no record is being delivered to the Target.
        set_framework_sink(None);
        *g = None;
    }
}
