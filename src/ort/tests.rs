//! The entry points against a fake ORT API table: version negotiation and
//! the panic boundary, which the real-ORT tests (scripts/ort-test.sh) cannot
//! provoke. Everything else is tested against real onnxruntime wheels.

use std::ffi::{CStr, c_char, c_void};
use std::sync::Mutex;
use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};

use super::abi::*;
use super::api::Api;
use super::*;

/// The fake's tables are process-wide: one test at a time.
static LOCK: Mutex<()> = Mutex::new(());
static TABLE: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
static EP_TABLE: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
/// The newest API version the fake "ORT" offers.
static NEWEST: AtomicU32 = AtomicU32::new(0);

struct FakeStatus {
    code: OrtErrorCode,
    msg: String,
}

unsafe extern "C" fn create_status(code: OrtErrorCode, msg: *const c_char) -> *mut OrtStatus {
    // SAFETY: callers pass a NUL-terminated message.
    let msg = unsafe { CStr::from_ptr(msg) }.to_string_lossy().into_owned();
    Box::into_raw(Box::new(FakeStatus { code, msg })) as *mut OrtStatus
}
unsafe extern "C" fn never_called() {
    panic!("a slot the test does not expect was called");
}
unsafe extern "C" fn get_ep_api() -> *const OrtEpApi {
    EP_TABLE.load(Ordering::SeqCst) as *const OrtEpApi
}
unsafe extern "C" fn get_api(v: u32) -> *const OrtApi {
    if v <= NEWEST.load(Ordering::SeqCst) { TABLE.load(Ordering::SeqCst) as *const OrtApi } else { std::ptr::null() }
}
unsafe extern "C" fn version_string() -> *const c_char {
    c"1.22.1".as_ptr()
}

/// The index of a function-table field at byte offset `off`.
fn slot_of(off: usize) -> usize {
    off / std::mem::size_of::<usize>()
}

/// Install a fake ORT offering API `newest`; `with_ep_api` fills GetEpApi.
fn install(newest: u32, with_ep_api: bool) -> OrtApiBase {
    let mut t = vec![never_called as *const () as usize; 400];
    t[slot_of(std::mem::offset_of!(OrtApi, CreateStatus))] = create_status as *const () as usize;
    t[slot_of(std::mem::offset_of!(OrtApi, GetEpApi))] = if with_ep_api { get_ep_api as *const () as usize } else { 0 };
    let ep = vec![never_called as *const () as usize; 40];
    TABLE.store(Box::leak(t.into_boxed_slice()).as_mut_ptr() as *mut c_void, Ordering::SeqCst);
    EP_TABLE.store(Box::leak(ep.into_boxed_slice()).as_mut_ptr() as *mut c_void, Ordering::SeqCst);
    NEWEST.store(newest, Ordering::SeqCst);
    OrtApiBase { GetApi: get_api, GetVersionString: version_string }
}

fn take(st: *mut OrtStatus) -> FakeStatus {
    assert!(!st.is_null(), "expected an error status");
    // SAFETY: every status in these tests comes from the fake create_status.
    *unsafe { Box::from_raw(st as *mut FakeStatus) }
}

fn create(base: *const OrtApiBase) -> (*mut OrtStatus, usize) {
    let mut f: *mut OrtEpFactory = std::ptr::null_mut();
    let mut n = 99usize;
    // SAFETY: the arguments are what ORT would pass, with a fake API base.
    let st = unsafe { CreateEpFactories(c"epmem".as_ptr(), base, std::ptr::null(), &mut f, 4, &mut n) };
    (st, n)
}

#[test]
fn an_ort_older_than_1_23_gets_a_status_saying_so() {
    let _g = LOCK.lock().unwrap();
    let base = install(22, true);
    let (st, n) = create(&base);
    let s = take(st);
    assert_eq!(n, 0);
    assert_eq!(s.code, ORT_NOT_IMPLEMENTED);
    assert!(s.msg.contains("1.22.1") && s.msg.contains("1.23"), "{}", s.msg);
}

#[test]
fn a_missing_slot_is_an_error_not_a_crash() {
    let _g = LOCK.lock().unwrap();
    let base = install(23, false);
    let (st, n) = create(&base);
    let s = take(st);
    assert_eq!(n, 0);
    assert!(s.msg.contains("GetEpApi"), "{}", s.msg);
}

#[test]
fn no_api_base_reports_no_factories() {
    let _g = LOCK.lock().unwrap();
    let (st, n) = create(std::ptr::null());
    assert!(st.is_null());
    assert_eq!(n, 0);
}

#[test]
fn the_boundary_turns_errors_and_panics_into_statuses() {
    let _g = LOCK.lock().unwrap();
    let base = install(23, true);
    // SAFETY: a complete fake table (every slot non-NULL).
    let api = unsafe { Api::load(&base) }.unwrap();
    assert!(status_boundary(&api, "ok", || Ok(())).is_null());
    let s = take(status_boundary(&api, "Thing", || crate::bail!(InvalidArgument, "bad size {}", 7)));
    assert_eq!(s.code, ORT_INVALID_ARGUMENT);
    assert!(s.msg.contains("Thing: bad size 7"), "{}", s.msg);
    let s = take(status_boundary(&api, "Other", || panic!("boom {}", 3)));
    assert_eq!(s.code, ORT_FAIL);
    assert!(s.msg.contains("Other: ") && s.msg.contains("panic") && s.msg.contains("boom 3"), "{}", s.msg);
    assert!(s.msg.contains("(Panic)"), "{}", s.msg);
}

#[test]
fn a_panic_while_loading_the_api_is_an_error_status_with_no_factories() {
    let _g = LOCK.lock().unwrap();
    let base = install(23, true);
    super::api::PANIC_IN_LOAD.store(true, Ordering::SeqCst);
    let (st, n) = create(&base);
    super::api::PANIC_IN_LOAD.store(false, Ordering::SeqCst);
    let s = take(st);
    assert_eq!(n, 0, "num_factories must be written");
    assert!(s.msg.contains("Api::load panicked"), "{}", s.msg);
}

unsafe extern "C" fn get_no_api(_v: u32) -> *const OrtApi {
    std::ptr::null()
}

#[test]
fn an_api_base_offering_no_api_reports_no_factories() {
    let _g = LOCK.lock().unwrap();
    let base = OrtApiBase { GetApi: get_no_api, GetVersionString: version_string };
    let (st, n) = create(&base);
    assert!(st.is_null(), "no CreateStatus to make an error with");
    assert_eq!(n, 0);
}

#[test]
fn a_late_failure_still_writes_zero_factories() {
    let _g = LOCK.lock().unwrap();
    let base = install(23, true);
    let mut f: *mut OrtEpFactory = std::ptr::null_mut();
    let mut n = 99usize;
    // SAFETY: as in `create`, with a NULL name (refused after the API loaded).
    let st = unsafe { CreateEpFactories(std::ptr::null(), &base, std::ptr::null(), &mut f, 4, &mut n) };
    let s = take(st);
    assert_eq!(n, 0);
    assert!(s.msg.contains("registered_name"), "{}", s.msg);
}

// ---- ORT's logger -------------------------------------------------------

static LOGGED: Mutex<Vec<(OrtLoggingLevel, String)>> = Mutex::new(Vec::new());
const FAKE_LOGGER: usize = 0x10ce;

unsafe extern "C" fn fake_log_message(
    logger: *const OrtLogger,
    sev: OrtLoggingLevel,
    msg: *const c_char,
    _file: *const c_char,
    _line: std::ffi::c_int,
    _func: *const c_char,
) -> *mut OrtStatus {
    assert_eq!(logger as usize, FAKE_LOGGER);
    // SAFETY: epmem passes a NUL-terminated message.
    let m = unsafe { CStr::from_ptr(msg) }.to_string_lossy().into_owned();
    LOGGED.lock().unwrap_or_else(|p| p.into_inner()).push((sev, m));
    std::ptr::null_mut()
}
unsafe extern "C" fn fake_severity(_logger: *const OrtLogger, out: *mut OrtLoggingLevel) -> *mut OrtStatus {
    // SAFETY: epmem passes a valid out-param.
    unsafe { *out = LOGGING_INFO };
    std::ptr::null_mut()
}

#[test]
fn records_go_to_orts_logger_while_a_factory_holds_it() {
    let _g = LOCK.lock().unwrap();
    let _r = crate::ffi::log::TEST_ROUTING.lock().unwrap_or_else(|p| p.into_inner());
    let base = install(23, true);
    // SAFETY: the fake table installed above.
    unsafe {
        let t = TABLE.load(Ordering::SeqCst) as *mut usize;
        *t.add(slot_of(std::mem::offset_of!(OrtApi, Logger_LogMessage))) = fake_log_message as *const () as usize;
        *t.add(slot_of(std::mem::offset_of!(OrtApi, Logger_GetLoggingSeverityLevel))) =
            fake_severity as *const () as usize;
    }
    // SAFETY: a complete fake table.
    let api = unsafe { Api::load(&base) }.unwrap();
    let ours = || -> Vec<(OrtLoggingLevel, String)> {
        LOGGED
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, m)| m.starts_with("ort-log-test"))
            .cloned()
            .collect()
    };
    assert!(super::logging::attach(&api, FAKE_LOGGER as *const OrtLogger));
    log::info!("ort-log-test info");
    log::debug!("ort-log-test debug (below ORT's INFO)");
    log::warn!("ort-log-test warn");
    super::logging::detach();
    log::warn!("ort-log-test after detach");
    let env_set = std::env::var_os("EPM_LOG").is_some();
    if env_set {
        // EPM_LOG set explicitly wins: records go to stderr, not to ORT.
        assert!(ours().is_empty(), "{:?}", ours());
    } else {
        assert_eq!(
            ours(),
            vec![(LOGGING_INFO, "ort-log-test info".to_string()), (LOGGING_WARNING, "ort-log-test warn".to_string())]
        );
    }
}
