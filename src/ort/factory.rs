//! `OrtEpFactory`: one per `CreateEpFactories` call, owning that
//! registration's devices and memory infos.
//!
//! State is per call, never global: registering the same library file under
//! two names gives two independent factories (ORT shares one `dlopen`
//! handle between them), and a duplicate registration that ORT rejects after
//! creating its factory releases exactly that factory.

use std::ffi::{CString, c_char};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::abi::*;
use super::allocator::Allocator;
use super::api::{Api, MemoryKind, OwnedMemoryInfo, cstring_lossy};
use super::claim::EpOptions;
use super::data_transfer::DataTransfer;
use super::data_transfer::{CopyCounters, Engines};
use super::device_match;
use super::ep::Ep;
use super::ep_devices::{HwHandle, get_supported_devices};
use super::options::AllocatorOptions;
use super::status_boundary;
use crate::arena::source::MemKind;
use crate::device::{self, Device, DeviceSelect};
use crate::error::Result;

/// Metadata key on our EpDevices carrying the device ordinal to `CreateEp`.
pub const META_ORDINAL: &str = "epmem.ordinal";
/// Metadata key: "cuda" or "host".
pub const META_DEVICE: &str = "epmem.device";

/// One epmem device and the memory infos it is registered with.
pub(crate) struct EpmDevice {
    pub dev: Arc<dyn Device>,
    pub kind: MemoryKind,
    pub default_info: OwnedMemoryInfo,
    pub pinned_info: OwnedMemoryInfo,
}

impl EpmDevice {
    pub fn label(&self) -> String {
        format!("{}:{}", self.dev.info().kind.name(), self.dev.info().ordinal)
    }
}

/// The factory ORT holds, shared (`Arc`) with every allocator, EP and data
/// transfer made from it: ORT may release those after the factory (a tensor
/// that outlives `UnregisterExecutionProviderLibrary` frees through its
/// allocator, and ORT then calls `ReleaseAllocator` through this struct), so
/// the struct ORT points at lives until the last of them is gone.
///
/// `base` first: ORT's `OrtEpFactory*` points here.
#[repr(C)]
pub(crate) struct Factory {
    base: OrtEpFactory,
    pub api: Api,
    pub ep_name: CString,
    vendor: CString,
    version: CString,
    pub devices: Vec<EpmDevice>,
    pub(crate) created_hw: Mutex<Vec<HwHandle>>,
    /// Copies made by this factory's data transfers (all of them).
    pub copies: CopyCounters,
    /// The staging copy engines of host → device copies, one per device.
    pub engines: Engines,
    /// This factory holds a reference on ORT's logger (`logging::attach`),
    /// dropped when ORT releases the factory.
    logs_to_ort: AtomicBool,
}

impl Factory {
    /// Index of our device whose memory is labelled `kind`.
    pub fn device_for(&self, kind: &MemoryKind) -> Option<usize> {
        self.devices.iter().position(|d| d.kind == *kind)
    }
}

impl Drop for Factory {
    fn drop(&mut self) {
        let hw = std::mem::take(&mut *self.created_hw.lock().unwrap_or_else(|e| e.into_inner()));
        if let Some(release) = self.api.e.ReleaseHardwareDevice {
            for h in hw {
                // SAFETY: we created h with CreateHardwareDevice; the EpDevices
                // that referred to it were released by ORT before the factory.
                unsafe { release(h.0) };
            }
        }
    }
}

impl Factory {
    /// Open the devices `EPM_DEVICE` selects and build a factory for them.
    pub fn create(api: Api, registered_name: &str, logs_to_ort: bool) -> Result<*mut OrtEpFactory> {
        crate::ensure!(!registered_name.is_empty(), InvalidArgument, "the registration name is empty");
        let devs = open_devices()?;
        log::info!(
            "epmem: ONNX Runtime API 1.{}: registering {registered_name:?} with {} device(s)",
            api.version,
            devs.len()
        );
        let mut devices = Vec::with_capacity(devs.len());
        for dev in devs {
            let info = dev.info();
            let kind = device_match::memory_kind(info);
            let tag = format!("epmem_{}{}", info.kind.name(), info.ordinal);
            devices.push(EpmDevice {
                default_info: api.memory_info(&tag, kind, DEVICE_MEMORY_DEFAULT)?,
                pinned_info: api.memory_info(&format!("{tag}_pinned"), kind, DEVICE_MEMORY_HOST_ACCESSIBLE)?,
                kind,
                dev,
            });
        }
        let n_devices = devices.len();
        let f = Arc::new(Factory {
            ep_name: cstring_lossy(registered_name),
            vendor: cstring_lossy("epmem"),
            version: cstring_lossy(env!("CARGO_PKG_VERSION")),
            devices,
            created_hw: Mutex::new(Vec::new()),
            copies: CopyCounters::default(),
            engines: Engines::new(n_devices),
            logs_to_ort: AtomicBool::new(logs_to_ort),
            base: OrtEpFactory {
                ort_version_supported: ORT_VERSION_SUPPORTED,
                GetName: Some(get_name),
                GetVendor: Some(get_vendor),
                GetSupportedDevices: Some(get_supported_devices),
                CreateEp: Some(create_ep),
                ReleaseEp: Some(release_ep),
                GetVendorId: Some(get_vendor_id),
                GetVersion: Some(get_version),
                ValidateCompiledModelCompatibilityInfo: Some(validate_compat),
                CreateAllocator: Some(create_allocator),
                ReleaseAllocator: Some(release_allocator),
                CreateDataTransfer: Some(create_data_transfer),
                IsStreamAware: Some(is_stream_aware),
                CreateSyncStreamForDevice: Some(create_sync_stream),
                SetEnvironmentOptions: None,
                _v24: [None; 3],
                _v25: [None; 2],
                SelectBestModelCandidate: None,
            },
            api,
        });
        Ok(Arc::into_raw(f) as *mut OrtEpFactory)
    }

    /// Drop ORT's reference (objects made from the factory keep theirs).
    ///
    /// # Safety
    /// `p` came from [`Factory::create`] and ORT does not use it afterwards.
    pub unsafe fn release(p: *mut OrtEpFactory) {
        // SAFETY: per the caller, p is the Arc we leaked in `create`.
        let f = unsafe { Arc::from_raw(p as *const Factory) };
        // After ReleaseEpFactory ORT's environment (and its logger) may go away.
        if f.logs_to_ort.swap(false, Ordering::AcqRel) {
            super::logging::detach();
        }
        drop(f);
    }

    /// A new reference for an object made from the factory ORT calls through.
    fn arc(&self) -> Arc<Factory> {
        // SAFETY: every &Factory ORT hands us is the Arc leaked in `create`,
        // still alive (ORT's own reference); we add one more.
        unsafe {
            Arc::increment_strong_count(self as *const Factory);
            Arc::from_raw(self as *const Factory)
        }
    }
}

/// `EPM_DEVICE=cuda`: every CUDA device (at least one). `host`: the host
/// device. `auto`: the CUDA devices if there are any, else the host device.
fn open_devices() -> Result<Vec<Arc<dyn Device>>> {
    let select = DeviceSelect::from_env()?;
    if select == DeviceSelect::Host {
        return Ok(vec![device::open(DeviceSelect::Host, 0)?]);
    }
    // The Device layer has no count call: open ordinals until one fails.
    let mut cuda = Vec::new();
    let mut last_err = None;
    for ordinal in 0..64 {
        match device::open(DeviceSelect::Cuda, ordinal) {
            Ok(d) => cuda.push(d),
            Err(e) => {
                last_err = Some(e);
                break;
            }
        }
    }
    if !cuda.is_empty() {
        return Ok(cuda);
    }
    match (select, last_err) {
        (DeviceSelect::Cuda, Some(e)) => Err(e.context("EPM_DEVICE=cuda but no CUDA device could be opened")),
        _ => {
            log::info!("epmem: no CUDA device; the ONNX Runtime EP reports the host device");
            Ok(vec![device::open(DeviceSelect::Host, 0)?])
        }
    }
}

/// # Safety
/// `this` is a factory made by [`Factory::create`].
pub(crate) unsafe fn me<'a>(this: *const OrtEpFactory) -> &'a Factory {
    // SAFETY: per the caller; `base` is the first field of a repr(C) struct.
    unsafe { &*(this as *const Factory) }
}

unsafe extern "C" fn get_name(this: *const OrtEpFactory) -> *const c_char {
    // SAFETY: ORT passes the factory we gave it.
    unsafe { me(this) }.ep_name.as_ptr()
}

unsafe extern "C" fn get_vendor(this: *const OrtEpFactory) -> *const c_char {
    // SAFETY: as above.
    unsafe { me(this) }.vendor.as_ptr()
}

unsafe extern "C" fn get_vendor_id(_this: *const OrtEpFactory) -> u32 {
    // epmem is not a hardware vendor: 0, as ORT's own CPU EP reports.
    0
}

unsafe extern "C" fn get_version(this: *const OrtEpFactory) -> *const c_char {
    // SAFETY: as above.
    unsafe { me(this) }.version.as_ptr()
}

unsafe extern "C" fn is_stream_aware(_this: *const OrtEpFactory) -> bool {
    // Deliberately false, also on CUDA. This flag is about the *EP's* streams
    // (its nodes and copies), not about allocation: ORT's allocator adapter
    // calls AllocOnStream on any OrtAllocator that has it, whatever the
    // factory says, and that is how epmem's allocators see the CUDA EP's
    // streams. A stream-aware factory makes ORT register a create-stream
    // function for the GPU device type in every session that lists epmem's
    // EP (PluginExecutionProvider::RegisterStreamHandlers); the registry
    // keeps the first registration, so a session with epmem's EP and the
    // CUDA EP could hand the CUDA EP's kernels a plugin stream where they
    // expect a CudaStream. epmem's GEMMs run on the stream ORT gives their
    // nodes (the CUDA EP's), and its copies complete before CopyTensors
    // returns, ordered after the work queued before them (data_transfer).
    false
}

unsafe extern "C" fn create_sync_stream(
    this: *mut OrtEpFactory,
    _md: *const OrtMemoryDevice,
    _opts: *const OrtKeyValuePairs,
    out: *mut *mut OrtSyncStreamImpl,
) -> *mut OrtStatus {
    // SAFETY: as above.
    let f = unsafe { me(this) };
    status_boundary(&f.api, "CreateSyncStreamForDevice", || {
        crate::ensure!(!out.is_null(), NullPointer, "out is NULL");
        // SAFETY: non-NULL out-param; NULL means "not stream aware".
        unsafe { *out = std::ptr::null_mut() };
        Ok(())
    })
}

unsafe extern "C" fn validate_compat(
    this: *mut OrtEpFactory,
    _devices: *const *const OrtHardwareDevice,
    _n: usize,
    _info: *const c_char,
    out: *mut OrtCompiledModelCompatibility,
) -> *mut OrtStatus {
    // SAFETY: as above.
    let f = unsafe { me(this) };
    status_boundary(&f.api, "ValidateCompiledModelCompatibilityInfo", || {
        crate::ensure!(!out.is_null(), NullPointer, "out is NULL");
        // SAFETY: non-NULL out-param. epmem never compiles models.
        unsafe { *out = COMPILED_MODEL_NOT_APPLICABLE };
        Ok(())
    })
}

unsafe extern "C" fn create_ep(
    this: *mut OrtEpFactory,
    _devices: *const *const OrtHardwareDevice,
    ep_metadata: *const *const OrtKeyValuePairs,
    num_devices: usize,
    session_options: *const OrtSessionOptions,
    _logger: *const OrtLogger,
    out: *mut *mut OrtEp,
) -> *mut OrtStatus {
    // SAFETY: as above.
    let f = unsafe { me(this) };
    let api = f.api;
    status_boundary(&api, "CreateEp", || {
        crate::ensure!(!out.is_null(), NullPointer, "out is NULL");
        crate::ensure!(num_devices > 0 && !ep_metadata.is_null(), InvalidArgument, "CreateEp was given no devices");
        let mut first = None;
        for i in 0..num_devices {
            // SAFETY: ORT passes one metadata set per device (our own, from CreateEpDevice).
            let v = unsafe { api.kvp_get(*ep_metadata.add(i), META_ORDINAL) };
            let o: u32 = v.as_deref().and_then(|s| s.parse().ok()).ok_or_else(|| {
                crate::error::Error::invalid_argument(format!("device {i} has no {META_ORDINAL} metadata"))
            })?;
            let idx = f.devices.iter().position(|d| d.dev.info().ordinal == o);
            crate::ensure!(idx.is_some(), InvalidArgument, "device ordinal {o} is not one of this factory's devices");
            first = first.or(idx);
        }
        // SAFETY: ORT's session options (or NULL) for this session.
        let entries = unsafe { api.session_config_entries(session_options) }?;
        let opts = EpOptions::parse(&f.ep_name.to_string_lossy(), &entries)?;
        // The EP computes on the first device it is given (a session adds one).
        // SAFETY: non-NULL out-param.
        unsafe { *out = Ep::create(f.arc(), first.unwrap_or(0), opts) };
        Ok(())
    })
}

unsafe extern "C" fn release_ep(_this: *mut OrtEpFactory, ep: *mut OrtEp) {
    if !ep.is_null() {
        // SAFETY: ep came from our CreateEp.
        super::value_boundary("ReleaseEp", (), || unsafe { Ep::destroy(ep) });
    }
}

unsafe extern "C" fn create_allocator(
    this: *mut OrtEpFactory,
    memory_info: *const OrtMemoryInfo,
    options: *const OrtKeyValuePairs,
    out: *mut *mut OrtAllocator,
) -> *mut OrtStatus {
    // SAFETY: as above.
    let f = unsafe { me(this) };
    let api = f.api;
    status_boundary(&api, "CreateAllocator", || {
        crate::ensure!(!out.is_null(), NullPointer, "out is NULL");
        crate::ensure!(!memory_info.is_null(), InvalidArgument, "CreateAllocator needs a memory info");
        // SAFETY: ORT passes live objects.
        let (desc, entries) = unsafe { (api.memory_info_desc(memory_info), api.kvp_entries(options)) };
        let idx = f.device_for(&desc.kind).ok_or_else(|| {
            crate::error::Error::invalid_argument(format!("memory info {desc:?} is not an epmem device"))
        })?;
        let kind = match desc.mem_type {
            DEVICE_MEMORY_DEFAULT => MemKind::Device,
            DEVICE_MEMORY_HOST_ACCESSIBLE => MemKind::Pinned,
            m => crate::bail!(InvalidArgument, "memory type {m} is neither DEFAULT nor HOST_ACCESSIBLE"),
        };
        let opts = AllocatorOptions::parse(&entries)?;
        let a = Allocator::create(f.arc(), &f.devices[idx], kind, opts)?;
        // SAFETY: non-NULL out-param; ORT owns the allocator until ReleaseAllocator.
        unsafe { *out = a };
        Ok(())
    })
}

unsafe extern "C" fn release_allocator(_this: *mut OrtEpFactory, a: *mut OrtAllocator) {
    if !a.is_null() {
        // SAFETY: a came from our CreateAllocator.
        super::value_boundary("ReleaseAllocator", (), || unsafe { Allocator::destroy(a) });
    }
}

unsafe extern "C" fn create_data_transfer(
    this: *mut OrtEpFactory,
    out: *mut *mut OrtDataTransferImpl,
) -> *mut OrtStatus {
    // SAFETY: as above.
    let f = unsafe { me(this) };
    status_boundary(&f.api, "CreateDataTransfer", || {
        crate::ensure!(!out.is_null(), NullPointer, "out is NULL");
        // SAFETY: non-NULL out-param; ORT calls Release on it.
        unsafe { *out = DataTransfer::create(f.arc()) };
        Ok(())
    })
}
