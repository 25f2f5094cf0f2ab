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
    if v <= NEWEST.load(Ordering::SeqCst) {
        TABLE.load(Ordering::SeqCst) as *const OrtApi
    } else {
        std::ptr::null()
    }
}
unsafe extern "C" fn version_string() -> *const c_char {
    c"1.22.1".as_ptr()
}

/// Install a fake ORT offering API `newest`; `with_ep_api` fills GetEpApi.
fn install(newest: u32, with_ep_api: bool) -> OrtApiBase {
    let mut t = vec![never_called as *const () as usize; 400];
    t[api_slot::CREATE_STATUS] = create_status as *const () as usize;
    t[api_slot::GET_EP_API] = if with_ep_api {
        get_ep_api as *const () as usize
    } else {
        0
    };
    let ep = vec![never_called as *const () as usize; 40];
    TABLE.store(
        Box::leak(t.into_boxed_slice()).as_mut_ptr() as *mut c_void,
        Ordering::SeqCst,
    );
    EP_TABLE.store(
        Box::leak(ep.into_boxed_slice()).as_mut_ptr() as *mut c_void,
        Ordering::SeqCst,
    );
    NEWEST.store(newest, Ordering::SeqCst);
    OrtApiBase {
        GetApi: get_api,
        GetVersionString: version_string,
    }
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
    let s = take(status_boundary(&api, "Thing", || {
        crate::bail!(InvalidArgument, "bad size {}", 7)
    }));
    assert_eq!(s.code, ORT_INVALID_ARGUMENT);
    assert!(s.msg.contains("Thing: bad size 7"), "{}", s.msg);
    let s = take(status_boundary(&api, "Other", || panic!("boom {}", 3)));
    assert_eq!(s.code, ORT_FAIL);
    assert!(s.msg.contains("Other panicked: boom 3"), "{}", s.msg);
}
