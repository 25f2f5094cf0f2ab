//! The ONNX Runtime plugin execution provider.
//!
//! `libepmem.so` exports `CreateEpFactories` / `ReleaseEpFactory`, so a stock
//! ONNX Runtime (1.23 or newer, the PyPI CPU wheel included) can load it with
//! `RegisterExecutionProviderLibrary`. The EP is a memory provider: it
//! reports epmem's devices, registers a DEFAULT (device memory) and a
//! HOST_ACCESSIBLE (pinned) allocator for each, copies tensors to and from
//! them, and claims no nodes. See docs/ORT.md.
//!
//! Nothing here unwinds into ORT: every entry point runs inside the one
//! panic boundary the C API uses too (`crate::ffi::panic::catch`), and
//! errors become `OrtStatus*` made by the host's own `CreateStatus`. Log
//! records go to ORT's logger while ORT has the library loaded (`logging`).

use std::ffi::{CStr, c_char};

use crate::error::{Error, Result};
use crate::ffi::panic::catch;

mod abi;
mod allocator;
mod api;
mod claim;
mod data_transfer;
mod device_match;
mod ep;
mod ep_devices;
mod external_alloc;
mod factory;
mod gemm_cuda;
mod gemm_host;
mod graph;
mod logging;
mod options;
mod streaming;
#[cfg(test)]
mod tests;

use abi::{OrtApiBase, OrtEpFactory, OrtLogger, OrtStatus};
use api::Api;
use factory::Factory;

/// Run `f` inside the panic boundary, turning an error or a panic into an
/// `OrtStatus*` (NULL = success).
pub(crate) fn status_boundary(api: &Api, what: &str, f: impl FnOnce() -> Result<()>) -> *mut OrtStatus {
    match catch(f) {
        Ok(()) => std::ptr::null_mut(),
        Err(e) => api.status(&e.context(what)),
    }
}

/// Run `f` inside the panic boundary where ORT takes no status (`Alloc`,
/// `Free`, releases): an error or panic is logged and `fallback` returned.
pub(crate) fn value_boundary<T>(what: &str, fallback: T, f: impl FnOnce() -> T) -> T {
    match catch(|| Ok(f())) {
        Ok(v) => v,
        Err(e) => {
            log::error!("epmem: {what}: {e}");
            fallback
        }
    }
}

/// Report `e` when the API we need is unavailable (an ORT older than 1.23):
/// `CreateStatus` has been slot 0 of every API version since 1, so ask for
/// version 1 just to say why we cannot load. With no API base at all there
/// is no way to make a status: log it and report no factories.
///
/// # Safety
/// `base` is NULL or ORT's `OrtApiBase`.
unsafe fn status_without_api(base: *const OrtApiBase, e: &Error) -> *mut OrtStatus {
    log::error!("epmem: CreateEpFactories: {e}");
    if base.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: per the caller; GetApi(1) is the oldest table, whose slot 0 is
    // CreateStatus(OrtErrorCode, const char*).
    unsafe {
        let v1 = ((*base).GetApi)(1);
        if v1.is_null() {
            return std::ptr::null_mut();
        }
        let slot0 = *(v1 as *const *const std::ffi::c_void);
        if slot0.is_null() {
            return std::ptr::null_mut();
        }
        let create: unsafe extern "C" fn(abi::OrtErrorCode, *const c_char) -> *mut OrtStatus =
            std::mem::transmute(slot0);
        let msg = api::cstring_lossy(&format!("epmem: {} ({:?})", e.message(), e.status()));
        create(abi::ORT_NOT_IMPLEMENTED, msg.as_ptr())
    }
}

/// Make the library non-unloadable once ORT has loaded it: allocators and
/// tensors made by it may be released after `UnregisterExecutionProviderLibrary`
/// (which `dlclose`s us), and the device layer may have threads running.
fn pin_library() {
    // SAFETY: dladdr on one of our own functions, then dlopen of the file it
    // names with RTLD_NOLOAD (never loads anything new, only adds a
    // reference) and RTLD_NODELETE (never unmapped afterwards).
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(CreateEpFactories as *const libc::c_void, &mut info) != 0 && !info.dli_fname.is_null() {
            let h = libc::dlopen(info.dli_fname, libc::RTLD_NOW | libc::RTLD_NOLOAD | libc::RTLD_NODELETE);
            if h.is_null() {
                log::warn!("epmem: could not pin {:?} in memory", CStr::from_ptr(info.dli_fname));
            }
        }
    }
}

/// ORT's entry point: create this registration's factory.
///
/// `*num_factories` is 0 until a factory is made, whatever fails (written
/// first). Errors, including a panic while reading ORT's API, are an
/// `OrtStatus` made by ORT's `CreateStatus`; only when ORT offers no API at
/// all to make one (`api_base` NULL, or `GetApi(1)` NULL) is NULL returned,
/// with 0 factories, and the reason logged.
///
/// # Safety
/// Called by ONNX Runtime with the arguments its plugin-EP ABI documents.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn CreateEpFactories(
    registered_name: *const c_char,
    api_base: *const OrtApiBase,
    default_logger: *const OrtLogger,
    factories: *mut *mut OrtEpFactory,
    max_factories: usize,
    num_factories: *mut usize,
) -> *mut OrtStatus {
    if !num_factories.is_null() {
        // SAFETY: non-NULL out-param. Written before anything can fail, so
        // no path reports factories it did not make.
        unsafe { *num_factories = 0 };
    }
    let api = match catch(|| {
        // SAFETY: ORT passes its OrtApiBase.
        unsafe { Api::load(api_base) }
    }) {
        Ok(api) => api,
        // SAFETY: ORT passes its OrtApiBase (or NULL, handled inside).
        Err(e) => return unsafe { status_without_api(api_base, &e.context("CreateEpFactories")) },
    };
    status_boundary(&api, "CreateEpFactories", || {
        crate::ensure!(!factories.is_null() && !num_factories.is_null(), NullPointer, "an out-param is NULL");
        crate::ensure!(max_factories >= 1, InvalidArgument, "ONNX Runtime allows no factories");
        crate::ensure!(!registered_name.is_null(), NullPointer, "registered_name is NULL");
        // SAFETY: ORT passes a NUL-terminated name.
        let name = unsafe { CStr::from_ptr(registered_name) }.to_string_lossy().into_owned();
        pin_library();
        let logs_to_ort = logging::attach(&api, default_logger);
        let f = match Factory::create(api, &name, logs_to_ort) {
            Ok(f) => f,
            Err(e) => {
                if logs_to_ort {
                    logging::detach();
                }
                return Err(e);
            }
        };
        // SAFETY: non-NULL out-params with room for at least one factory.
        unsafe {
            *factories = f;
            *num_factories = 1;
        }
        Ok(())
    })
}

/// ORT's entry point: release a factory made by [`CreateEpFactories`].
///
/// # Safety
/// `factory` came from `CreateEpFactories` and is not used afterwards.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ReleaseEpFactory(factory: *mut OrtEpFactory) -> *mut OrtStatus {
    if !factory.is_null() {
        // SAFETY: per the caller. Objects made by the factory keep its shared
        // state alive, so they may outlive it.
        value_boundary("ReleaseEpFactory", (), || unsafe { Factory::release(factory) });
    }
    std::ptr::null_mut()
}
