//! Logging: the `log` facade, routed to stderr or to a host callback.
//!
//! epmem code logs with `log::warn!` etc. The logger is installed by the
//! first `epm_*` call (the panic boundary does it). By default records go to
//! stderr, filtered by `EPM_LOG` (error|warn|info|debug|trace|off; unset:
//! off). `epm_set_log_callback` routes them to the host instead.
//!
//! A framework that loaded epmem as a plugin (ONNX Runtime) may install a
//! *framework sink* ([`set_framework_sink`]): records go there while the host
//! has set no callback and `EPM_LOG` is unset. Precedence: host callback,
//! then `EPM_LOG` (stderr), then the framework sink.

use std::cell::Cell;
use std::ffi::{CString, c_char, c_void};
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Once, RwLock};

use log::{Level, LevelFilter, Log, Metadata, Record};

use crate::error::{EpmStatus, Result};
use crate::ffi::panic::ffi_boundary;

/// Severity of a log record, and the filter passed to `epm_set_log_callback`.
/// The values match the `EPM_LOG` names and never change.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EpmLogLevel {
    /// Nothing is logged (only meaningful as a filter).
    Off = 0,
    Error = 1,
    Warn = 2,
    Info = 3,
    Debug = 4,
    Trace = 5,
}

/// A host log sink. `message` is a NUL-terminated UTF-8 string valid only
/// during the call. Called from any epmem thread (including stream worker
/// threads), possibly concurrently: it must be thread-safe, must return, and
/// must not call `epm_*` functions.
pub type EpmLogCallback =
    Option<unsafe extern "C" fn(user_data: *mut c_void, level: EpmLogLevel, message: *const c_char)>;

#[derive(Clone, Copy)]
enum Sink {
    Stderr,
    Callback { cb: unsafe extern "C" fn(*mut c_void, EpmLogLevel, *const c_char), user_data: *mut c_void },
}

// SAFETY: the host promised (epm_set_log_callback's contract) that the
// callback and its user_data may be used from any thread.
unsafe impl Send for Sink {}
// SAFETY: as above.
unsafe impl Sync for Sink {}

struct State {
    sink: Sink,
    /// The host callback's filter (meaningful while `sink` is a callback).
    cb_level: LevelFilter,
    /// The `EPM_LOG` level, restored when the callback is removed.
    env_level: LevelFilter,
    /// Whether `EPM_LOG` is set at all: an explicit setting beats the framework sink.
    env_set: bool,
    /// The framework's sink and the level it asked for.
    framework: Option<(Sink, LevelFilter)>,
}

impl State {
    /// Where records go now, and the level that filters them.
    fn route(&self) -> (Sink, LevelFilter) {
        match (self.sink, self.framework) {
            (Sink::Callback { .. }, _) => (self.sink, self.cb_level),
            (Sink::Stderr, Some(fw)) if !self.env_set => fw,
            (Sink::Stderr, _) => (Sink::Stderr, self.env_level),
        }
    }
}

static STATE: RwLock<State> = RwLock::new(State {
    sink: Sink::Stderr,
    cb_level: LevelFilter::Off,
    env_level: LevelFilter::Off,
    env_set: false,
    framework: None,
});
static INSTALL: Once = Once::new();
static INSTALLED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Set while this thread runs the host callback: nested records are dropped
    /// (a callback that logs through epmem would otherwise re-enter the lock).
    static IN_CALLBACK: Cell<bool> = const { Cell::new(false) };
}

struct Logger;
static LOGGER: Logger = Logger;

fn level_from_env() -> LevelFilter {
    let Ok(v) = std::env::var("EPM_LOG") else { return LevelFilter::Off };
    match v.trim().to_ascii_lowercase().as_str() {
        "" | "off" | "0" => LevelFilter::Off,
        "error" => LevelFilter::Error,
        "warn" => LevelFilter::Warn,
        "info" => LevelFilter::Info,
        "debug" => LevelFilter::Debug,
        "trace" => LevelFilter::Trace,
        other => {
            // There is no call to fail here: say so once and keep the useful default.
            let _ = writeln!(
                std::io::stderr(),
                "epmem: EPM_LOG={other:?} is not one of error, warn, info, debug, trace, off; logging warnings"
            );
            LevelFilter::Warn
        }
    }
}

/// Install the logger once per process. Cheap after the first call.
pub(crate) fn ensure_installed() {
    INSTALL.call_once(|| {
        let level = level_from_env();
        let mut state = write_state();
        state.env_level = level;
        state.env_set = std::env::var_os("EPM_LOG").is_some();
        if log::set_logger(&LOGGER).is_ok() {
            log::set_max_level(state.route().1);
            INSTALLED.store(true, Ordering::Release);
        }
    });
}

fn installed() -> bool {
    ensure_installed();
    INSTALLED.load(Ordering::Acquire)
}

fn write_state() -> std::sync::RwLockWriteGuard<'static, State> {
    STATE.write().unwrap_or_else(|p| p.into_inner())
}

fn to_c_level(l: Level) -> EpmLogLevel {
    match l {
        Level::Error => EpmLogLevel::Error,
        Level::Warn => EpmLogLevel::Warn,
        Level::Info => EpmLogLevel::Info,
        Level::Debug => EpmLogLevel::Debug,
        Level::Trace => EpmLogLevel::Trace,
    }
}

fn filter_from_u32(v: u32) -> Result<LevelFilter> {
    Ok(match v {
        0 => LevelFilter::Off,
        1 => LevelFilter::Error,
        2 => LevelFilter::Warn,
        3 => LevelFilter::Info,
        4 => LevelFilter::Debug,
        5 => LevelFilter::Trace,
        _ => crate::bail!(InvalidArgument, "max_level {v} is not an EpmLogLevel (0..=5)"),
    })
}

impl Log for Logger {
    fn enabled(&self, m: &Metadata) -> bool {
        m.level() <= log::max_level()
    }

    fn log(&self, r: &Record) {
        if !self.enabled(r.metadata()) || IN_CALLBACK.try_with(Cell::get).unwrap_or(true) {
            return;
        }
        let state = STATE.read().unwrap_or_else(|p| p.into_inner());
        match state.route().0 {
            Sink::Stderr => {
                let _ = writeln!(std::io::stderr(), "[epmem {} {}] {}", r.level(), r.target(), r.args());
            }
            Sink::Callback { cb, user_data } => {
                let text = CString::new(r.args().to_string().replace('\0', "\\0")).unwrap_or_default();
                IN_CALLBACK.with(|f| f.set(true));
                // SAFETY: the host (or framework) installed `cb` with `user_data`
                // and promised both stay valid until the callback is replaced;
                // holding the read lock keeps epm_set_log_callback and
                // set_framework_sink from returning meanwhile.
                unsafe { cb(user_data, to_c_level(r.level()), text.as_ptr()) };
                IN_CALLBACK.with(|f| f.set(false));
            }
        }
    }

    fn flush(&self) {}
}

/// Route epmem's log records to `callback` (or, with NULL, back to stderr
/// filtered by `EPM_LOG`).
///
/// `max_level` is an `EpmLogLevel` value: records above it are not produced.
/// `callback` receives `user_data` unchanged. It may be called from any epmem
/// thread, concurrently, until this function returns after replacing it; so
/// `user_data` must stay valid until then. The callback must not call `epm_*`
/// functions (records it would cause are dropped; this function returns
/// `EPM_STATUS_INVALID_STATE` when called from inside it).
///
/// Errors: `EPM_STATUS_INVALID_ARGUMENT` for a `max_level` above
/// `EPM_LOG_LEVEL_TRACE`; `EPM_STATUS_INVALID_STATE` if another logger owns
/// this process's `log` facade (only possible when epmem is linked as a Rust
/// library into a program that installed its own). Thread-safe.
#[unsafe(no_mangle)]
pub extern "C" fn epm_set_log_callback(callback: EpmLogCallback, user_data: *mut c_void, max_level: u32) -> EpmStatus {
    ffi_boundary! {
        let level = filter_from_u32(max_level)?;
        crate::ensure!(
            !IN_CALLBACK.try_with(Cell::get).unwrap_or(false),
            InvalidState,
            "epm_set_log_callback called from inside the log callback"
        );
        crate::ensure!(installed(), InvalidState, "another logger owns the log facade in this process");
        let mut state = write_state();
        match callback {
            Some(cb) => {
                state.sink = Sink::Callback { cb, user_data };
                state.cb_level = level;
            }
            None => state.sink = Sink::Stderr,
        }
        log::set_max_level(state.route().1);
        Ok(())
    }
}

/// A framework's log sink (ONNX Runtime's logger when epmem is loaded as its
/// plugin), used while no host callback is set and `EPM_LOG` is unset; `None`
/// removes it. The callback follows [`EpmLogCallback`]'s contract; once this
/// returns after removing it, it is not called again. Returns false if
/// another logger owns the `log` facade.
pub(crate) fn set_framework_sink(
    sink: Option<(unsafe extern "C" fn(*mut c_void, EpmLogLevel, *const c_char), *mut c_void, EpmLogLevel)>,
) -> bool {
    if !installed() {
        return false;
    }
    let mut state = write_state();
    state.framework = sink.map(|(cb, user_data, level)| {
        let filter = filter_from_u32(level as u32).unwrap_or(LevelFilter::Off);
        (Sink::Callback { cb, user_data }, filter)
    });
    log::set_max_level(state.route().1);
    true
}

/// Tests that change the process-wide routing hold this (they run in parallel).
#[cfg(test)]
pub(crate) static TEST_ROUTING: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    static SEEN: Mutex<Vec<(EpmLogLevel, String)>> = Mutex::new(Vec::new());

    unsafe extern "C" fn record(user_data: *mut c_void, level: EpmLogLevel, message: *const c_char) {
        assert_eq!(user_data as usize, 0x5eed);
        // SAFETY: epmem passes a NUL-terminated string valid during the call.
        let m = unsafe { std::ffi::CStr::from_ptr(message) }.to_string_lossy().into_owned();
        SEEN.lock().unwrap().push((level, m));
    }

    #[test]
    fn callback_receives_records_up_to_max_level_and_null_restores() {
        let _g = TEST_ROUTING.lock().unwrap_or_else(|p| p.into_inner());
        let ud = std::ptr::without_provenance_mut(0x5eed);
        assert_eq!(epm_set_log_callback(Some(record), ud, EpmLogLevel::Info as u32), EpmStatus::Ok);
        log::info!("ffi-log-test info {}", 1);
        log::debug!("ffi-log-test debug");
        assert_eq!(epm_set_log_callback(None, std::ptr::null_mut(), 0), EpmStatus::Ok);
        log::info!("ffi-log-test after");
        let seen = SEEN.lock().unwrap();
        let ours: Vec<_> = seen.iter().filter(|(_, m)| m.starts_with("ffi-log-test")).collect();
        assert_eq!(ours.len(), 1, "{ours:?}");
        assert_eq!(ours[0].0, EpmLogLevel::Info);
        assert_eq!(ours[0].1, "ffi-log-test info 1");
    }

    #[test]
    fn bad_max_level_is_invalid_argument() {
        assert_eq!(epm_set_log_callback(None, std::ptr::null_mut(), 6), EpmStatus::InvalidArgument);
    }
}
