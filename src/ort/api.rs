//! The host's `OrtApi` / `OrtEpApi`, read once per `CreateEpFactories` call
//! into typed function pointers, plus the few safe helpers the adapter needs
//! (statuses, key-value pairs, memory devices).
//!
//! Only slots that exist in the v23 table are read unconditionally; the
//! 1.24 slots (`CreateHardwareDevice`) are read only when the running ORT
//! says it is 1.24 or newer.

use std::ffi::{CStr, CString, c_char, c_void};

use super::abi::*;
use crate::error::{EpmStatus, Error, Result};

type StatusFn = unsafe extern "C" fn(OrtErrorCode, *const c_char) -> *mut OrtStatus;

/// Typed view of the host's API tables. `Copy`: it is only function pointers
/// into the ORT library, which outlives every object we hand to it.
#[derive(Clone, Copy)]
pub(crate) struct Api {
    /// The running ORT's minor version (31 for 1.31.x).
    pub version: u32,
    create_status: StatusFn,
    get_error_message: unsafe extern "C" fn(*const OrtStatus) -> *const c_char,
    pub release_status: unsafe extern "C" fn(*mut OrtStatus),
    release_memory_info: unsafe extern "C" fn(*mut OrtMemoryInfo),
    create_kvp: unsafe extern "C" fn(*mut *mut OrtKeyValuePairs),
    add_kvp: unsafe extern "C" fn(*mut OrtKeyValuePairs, *const c_char, *const c_char),
    get_kv: unsafe extern "C" fn(*const OrtKeyValuePairs, *const c_char) -> *const c_char,
    get_kvps:
        unsafe extern "C" fn(*const OrtKeyValuePairs, *mut *const *const c_char, *mut *const *const c_char, *mut usize),
    release_kvp: unsafe extern "C" fn(*mut OrtKeyValuePairs),
    pub hw_type: unsafe extern "C" fn(*const OrtHardwareDevice) -> OrtHardwareDeviceType,
    pub hw_vendor_id: unsafe extern "C" fn(*const OrtHardwareDevice) -> u32,
    hw_metadata: unsafe extern "C" fn(*const OrtHardwareDevice) -> *const OrtKeyValuePairs,
    get_tensor_mutable_data: unsafe extern "C" fn(*mut OrtValue, *mut *mut c_void) -> *mut OrtStatus,
    get_tensor_data: unsafe extern "C" fn(*const OrtValue, *mut *const c_void) -> *mut OrtStatus,
    get_tensor_size: unsafe extern "C" fn(*const OrtValue, *mut usize) -> *mut OrtStatus,
    #[allow(clippy::type_complexity)]
    create_memory_info_v2: unsafe extern "C" fn(
        *const c_char,
        OrtMemoryInfoDeviceType,
        u32,
        i32,
        OrtDeviceMemoryType,
        usize,
        OrtAllocatorType,
        *mut *mut OrtMemoryInfo,
    ) -> *mut OrtStatus,
    // OrtEpApi
    pub create_ep_device: unsafe extern "C" fn(
        *mut OrtEpFactory,
        *const OrtHardwareDevice,
        *const OrtKeyValuePairs,
        *const OrtKeyValuePairs,
        *mut *mut OrtEpDevice,
    ) -> *mut OrtStatus,
    pub release_ep_device: unsafe extern "C" fn(*mut OrtEpDevice),
    pub add_allocator_info: unsafe extern "C" fn(*mut OrtEpDevice, *const OrtMemoryInfo) -> *mut OrtStatus,
    memory_info_device: unsafe extern "C" fn(*const OrtMemoryInfo) -> *const OrtMemoryDevice,
    value_device: unsafe extern "C" fn(*const OrtValue) -> *const OrtMemoryDevice,
    md_type: unsafe extern "C" fn(*const OrtMemoryDevice) -> OrtMemoryInfoDeviceType,
    md_mem_type: unsafe extern "C" fn(*const OrtMemoryDevice) -> OrtDeviceMemoryType,
    md_vendor: unsafe extern "C" fn(*const OrtMemoryDevice) -> u32,
    md_id: unsafe extern "C" fn(*const OrtMemoryDevice) -> u32,
    #[allow(clippy::type_complexity)]
    pub create_hardware_device: Option<
        unsafe extern "C" fn(
            OrtHardwareDeviceType,
            u32,
            u32,
            *const c_char,
            *const OrtKeyValuePairs,
            *mut *mut OrtHardwareDevice,
        ) -> *mut OrtStatus,
    >,
    pub release_hardware_device: Option<unsafe extern "C" fn(*mut OrtHardwareDevice)>,
    pub logger_log_message: unsafe extern "C" fn(
        *const OrtLogger,
        OrtLoggingLevel,
        *const c_char,
        *const c_char,
        std::ffi::c_int,
        *const c_char,
    ) -> *mut OrtStatus,
    pub logger_get_severity: unsafe extern "C" fn(*const OrtLogger, *mut OrtLoggingLevel) -> *mut OrtStatus,
    pub sync_stream_get_handle: unsafe extern "C" fn(*mut OrtSyncStream) -> *mut c_void,
}

/// Test hook: make [`Api::load`] panic, as a bug in it would.
#[cfg(test)]
pub(crate) static PANIC_IN_LOAD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Read slot `idx` of a function table as a typed function pointer.
///
/// # Safety
/// `table` points to a table with more than `idx` slots, and slot `idx` holds
/// a function of type `F` (or NULL, which is reported as an error).
unsafe fn slot<F: Copy>(table: *const c_void, idx: usize, what: &str) -> Result<F> {
    const { assert!(std::mem::size_of::<F>() == std::mem::size_of::<*const c_void>()) };
    // SAFETY: the caller guarantees the table is at least idx+1 slots long.
    let p = unsafe { *(table as *const *const c_void).add(idx) };
    crate::ensure!(
        !p.is_null(),
        Unsupported,
        "this ONNX Runtime has no {what} (slot {idx} is NULL)"
    );
    // SAFETY: F is a function-pointer type of pointer size (asserted above);
    // the caller guarantees the slot's signature.
    Ok(unsafe { std::mem::transmute_copy::<*const c_void, F>(&p) })
}

/// Parse "1.31.1" into 31.
pub(crate) fn parse_minor(version: &str) -> Option<u32> {
    let mut it = version.split('.');
    let major: u32 = it.next()?.trim().parse().ok()?;
    let minor: u32 = it.next()?.trim().parse().ok()?;
    (major == 1).then_some(minor)
}

impl Api {
    /// Ask the host for API v23 and read every slot we use.
    ///
    /// # Safety
    /// `base` is the `OrtApiBase` ORT passed to `CreateEpFactories`.
    pub unsafe fn load(base: *const OrtApiBase) -> Result<Api> {
        crate::ensure!(!base.is_null(), NullPointer, "OrtApiBase is NULL");
        #[cfg(test)]
        if PANIC_IN_LOAD.load(std::sync::atomic::Ordering::SeqCst) {
            panic!("test: Api::load panicked");
        }
        // SAFETY: ORT passes a valid OrtApiBase.
        let base = unsafe { &*base };
        // SAFETY: plain ORT calls with no arguments / a version number.
        let (api, vstr) = unsafe { ((base.GetApi)(ORT_API_MIN), (base.GetVersionString)()) };
        // SAFETY: ORT returns a static NUL-terminated string (or NULL).
        let vstr = unsafe { lossy(vstr) };
        crate::ensure!(
            !api.is_null(),
            Unsupported,
            "ONNX Runtime {vstr} does not offer API version {ORT_API_MIN}; epmem needs ONNX Runtime 1.{ORT_API_MIN} or newer"
        );
        let version = parse_minor(&vstr).unwrap_or(ORT_API_MIN).max(ORT_API_MIN);
        let t = api as *const c_void;
        use api_slot as s;
        use ep_api_slot as e;
        // SAFETY: GetApi(23) succeeded, so the table has every v23 slot, and
        // each slot below has the signature documented in docs/ORT_ABI.md.
        unsafe {
            let get_ep_api: unsafe extern "C" fn() -> *const OrtEpApi = slot(t, s::GET_EP_API, "GetEpApi")?;
            let ep = get_ep_api() as *const c_void;
            crate::ensure!(!ep.is_null(), Unsupported, "ONNX Runtime {vstr} returned no OrtEpApi");
            let v24 = version >= 24;
            Ok(Api {
                version,
                create_status: slot(t, s::CREATE_STATUS, "CreateStatus")?,
                get_error_message: slot(t, s::GET_ERROR_MESSAGE, "GetErrorMessage")?,
                release_status: slot(t, s::RELEASE_STATUS, "ReleaseStatus")?,
                logger_log_message: slot(t, s::LOGGER_LOG_MESSAGE, "Logger_LogMessage")?,
                logger_get_severity: slot(
                    t,
                    s::LOGGER_GET_LOGGING_SEVERITY_LEVEL,
                    "Logger_GetLoggingSeverityLevel",
                )?,
                sync_stream_get_handle: slot(t, s::SYNC_STREAM_GET_HANDLE, "SyncStream_GetHandle")?,
                release_memory_info: slot(t, s::RELEASE_MEMORY_INFO, "ReleaseMemoryInfo")?,
                create_kvp: slot(t, s::CREATE_KEY_VALUE_PAIRS, "CreateKeyValuePairs")?,
                add_kvp: slot(t, s::ADD_KEY_VALUE_PAIR, "AddKeyValuePair")?,
                get_kv: slot(t, s::GET_KEY_VALUE, "GetKeyValue")?,
                get_kvps: slot(t, s::GET_KEY_VALUE_PAIRS, "GetKeyValuePairs")?,
                release_kvp: slot(t, s::RELEASE_KEY_VALUE_PAIRS, "ReleaseKeyValuePairs")?,
                hw_type: slot(t, s::HARDWARE_DEVICE_TYPE, "HardwareDevice_Type")?,
                hw_vendor_id: slot(t, s::HARDWARE_DEVICE_VENDOR_ID, "HardwareDevice_VendorId")?,
                hw_metadata: slot(t, s::HARDWARE_DEVICE_METADATA, "HardwareDevice_Metadata")?,
                get_tensor_mutable_data: slot(t, s::GET_TENSOR_MUTABLE_DATA, "GetTensorMutableData")?,
                get_tensor_data: slot(t, s::GET_TENSOR_DATA, "GetTensorData")?,
                get_tensor_size: slot(t, s::GET_TENSOR_SIZE_IN_BYTES, "GetTensorSizeInBytes")?,
                create_memory_info_v2: slot(t, s::CREATE_MEMORY_INFO_V2, "CreateMemoryInfo_V2")?,
                create_ep_device: slot(ep, e::CREATE_EP_DEVICE, "CreateEpDevice")?,
                release_ep_device: slot(ep, e::RELEASE_EP_DEVICE, "ReleaseEpDevice")?,
                add_allocator_info: slot(ep, e::EP_DEVICE_ADD_ALLOCATOR_INFO, "EpDevice_AddAllocatorInfo")?,
                memory_info_device: slot(ep, e::MEMORY_INFO_GET_MEMORY_DEVICE, "MemoryInfo_GetMemoryDevice")?,
                value_device: slot(ep, e::VALUE_GET_MEMORY_DEVICE, "Value_GetMemoryDevice")?,
                md_type: slot(ep, e::MEMORY_DEVICE_GET_DEVICE_TYPE, "MemoryDevice_GetDeviceType")?,
                md_mem_type: slot(ep, e::MEMORY_DEVICE_GET_MEMORY_TYPE, "MemoryDevice_GetMemoryType")?,
                md_vendor: slot(ep, e::MEMORY_DEVICE_GET_VENDOR_ID, "MemoryDevice_GetVendorId")?,
                md_id: slot(ep, e::MEMORY_DEVICE_GET_DEVICE_ID, "MemoryDevice_GetDeviceId")?,
                create_hardware_device: if v24 {
                    Some(slot(ep, e::CREATE_HARDWARE_DEVICE, "CreateHardwareDevice")?)
                } else {
                    None
                },
                release_hardware_device: if v24 {
                    Some(slot(ep, e::RELEASE_HARDWARE_DEVICE, "ReleaseHardwareDevice")?)
                } else {
                    None
                },
            })
        }
    }

    /// An `OrtStatus*` carrying `e`, made by the host (ORT frees it).
    pub fn status(&self, e: &Error) -> *mut OrtStatus {
        let code = match e.status() {
            EpmStatus::InvalidArgument
            | EpmStatus::NullPointer
            | EpmStatus::InvalidHandle
            | EpmStatus::InvalidConfig => ORT_INVALID_ARGUMENT,
            EpmStatus::Unsupported => ORT_NOT_IMPLEMENTED,
            EpmStatus::Panic | EpmStatus::Internal => ORT_FAIL,
            _ => ORT_EP_FAIL,
        };
        let msg = cstring_lossy(&format!("epmem: {} ({:?})", e.message(), e.status()));
        // SAFETY: CreateStatus copies the message.
        unsafe { (self.create_status)(code, msg.as_ptr()) }
    }

    /// Turn a status returned by an ORT call into a `Result`, freeing it.
    pub fn check(&self, st: *mut OrtStatus, call: &str) -> Result<()> {
        if st.is_null() {
            return Ok(());
        }
        // SAFETY: `st` is a live status ORT returned to us; we own it.
        let msg = unsafe {
            let m = (self.get_error_message)(st);
            let s = lossy(m);
            (self.release_status)(st);
            s
        };
        Err(Error::new(
            EpmStatus::Internal,
            format!("ONNX Runtime {call} failed: {msg}"),
        ))
    }

    // ---- key-value pairs -------------------------------------------------

    /// A new, owned key-value pair set filled from `pairs`.
    pub fn kvp_new(&self, pairs: &[(&str, String)]) -> KeyValues {
        let mut kv: *mut OrtKeyValuePairs = std::ptr::null_mut();
        // SAFETY: CreateKeyValuePairs writes a fresh object to `kv`.
        unsafe { (self.create_kvp)(&mut kv) };
        let out = KeyValues { api: *self, raw: kv };
        for (k, v) in pairs {
            out.add(k, v);
        }
        out
    }

    /// All entries of a key-value set ORT owns (empty for NULL).
    ///
    /// # Safety
    /// `kv` is NULL or a live `OrtKeyValuePairs`.
    pub unsafe fn kvp_entries(&self, kv: *const OrtKeyValuePairs) -> Vec<(String, String)> {
        if kv.is_null() {
            return Vec::new();
        }
        let (mut keys, mut vals, mut n) = (std::ptr::null(), std::ptr::null(), 0usize);
        // SAFETY: kv is live; ORT writes arrays it owns, valid while kv is.
        unsafe {
            (self.get_kvps)(kv, &mut keys, &mut vals, &mut n);
            (0..n).map(|i| (lossy(*keys.add(i)), lossy(*vals.add(i)))).collect()
        }
    }

    /// One value of a key-value set ORT owns.
    ///
    /// # Safety
    /// `kv` is NULL or a live `OrtKeyValuePairs`.
    pub unsafe fn kvp_get(&self, kv: *const OrtKeyValuePairs, key: &str) -> Option<String> {
        if kv.is_null() {
            return None;
        }
        let k = cstring_lossy(key);
        // SAFETY: kv is live; the returned string is owned by kv and
        // NUL-terminated.
        unsafe {
            let v = (self.get_kv)(kv, k.as_ptr());
            (!v.is_null()).then(|| lossy(v))
        }
    }

    /// Metadata of a hardware device ORT owns.
    ///
    /// # Safety
    /// `hw` is a live `OrtHardwareDevice`.
    pub unsafe fn hw_metadata(&self, hw: *const OrtHardwareDevice, key: &str) -> Option<String> {
        // SAFETY: per the caller; the metadata lives as long as the device.
        unsafe { self.kvp_get((self.hw_metadata)(hw), key) }
    }

    // ---- memory infos and devices ---------------------------------------

    /// A memory info made with `CreateMemoryInfo_V2` (the legacy way gives
    /// "Invalid memory type: -1" for pinned memory and broke the CUDA EP).
    pub fn memory_info(&self, name: &str, kind: MemoryKind, mem: OrtDeviceMemoryType) -> Result<OwnedMemoryInfo> {
        let n = cstring_lossy(name);
        let mut out: *mut OrtMemoryInfo = std::ptr::null_mut();
        // SAFETY: plain ORT call; ORT copies the name.
        let st = unsafe {
            (self.create_memory_info_v2)(
                n.as_ptr(),
                kind.device_type,
                kind.vendor_id,
                kind.device_id,
                mem,
                0,
                ALLOCATOR_DEVICE,
                &mut out,
            )
        };
        self.check(st, "CreateMemoryInfo_V2")?;
        Ok(OwnedMemoryInfo { api: *self, raw: out })
    }

    /// What a memory device is.
    ///
    /// # Safety
    /// `md` is a live `OrtMemoryDevice`.
    pub unsafe fn memory_device(&self, md: *const OrtMemoryDevice) -> MemoryDeviceDesc {
        // SAFETY: per the caller.
        unsafe {
            MemoryDeviceDesc {
                kind: MemoryKind {
                    device_type: (self.md_type)(md),
                    vendor_id: (self.md_vendor)(md),
                    device_id: (self.md_id)(md) as i32,
                },
                mem_type: (self.md_mem_type)(md),
            }
        }
    }

    /// The memory device of a memory info.
    ///
    /// # Safety
    /// `mi` is a live `OrtMemoryInfo`.
    pub unsafe fn memory_info_desc(&self, mi: *const OrtMemoryInfo) -> MemoryDeviceDesc {
        // SAFETY: per the caller; the memory device lives inside the info.
        unsafe { self.memory_device((self.memory_info_device)(mi)) }
    }

    /// The memory device, data pointer and byte size of a tensor.
    ///
    /// # Safety
    /// `v` is a live `OrtValue`.
    pub unsafe fn tensor(&self, v: *const OrtValue, mutable: bool) -> Result<TensorView> {
        // SAFETY: per the caller.
        unsafe {
            let md = (self.value_device)(v);
            crate::ensure!(!md.is_null(), InvalidArgument, "an OrtValue to copy is not a tensor");
            let desc = self.memory_device(md);
            let mut bytes = 0usize;
            self.check((self.get_tensor_size)(v, &mut bytes), "GetTensorSizeInBytes")?;
            let ptr = if mutable {
                let mut p: *mut c_void = std::ptr::null_mut();
                self.check(
                    (self.get_tensor_mutable_data)(v as *mut OrtValue, &mut p),
                    "GetTensorMutableData",
                )?;
                p as u64
            } else {
                let mut p: *const c_void = std::ptr::null();
                self.check((self.get_tensor_data)(v, &mut p), "GetTensorData")?;
                p as u64
            };
            Ok(TensorView { desc, ptr, bytes })
        }
    }
}

/// The device part of an ORT memory device (type, vendor, id).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MemoryKind {
    pub device_type: OrtMemoryInfoDeviceType,
    pub vendor_id: u32,
    pub device_id: i32,
}

/// A memory device: which device, and DEFAULT or HOST_ACCESSIBLE memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MemoryDeviceDesc {
    pub kind: MemoryKind,
    pub mem_type: OrtDeviceMemoryType,
}

/// A tensor's placement, address and size.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TensorView {
    pub desc: MemoryDeviceDesc,
    pub ptr: u64,
    pub bytes: usize,
}

/// An `OrtKeyValuePairs` we created; released on drop unless handed to ORT.
pub(crate) struct KeyValues {
    api: Api,
    raw: *mut OrtKeyValuePairs,
}

impl KeyValues {
    pub fn add(&self, key: &str, value: &str) {
        let (k, v) = (cstring_lossy(key), cstring_lossy(value));
        // SAFETY: raw is live; ORT copies both strings.
        unsafe { (self.api.add_kvp)(self.raw, k.as_ptr(), v.as_ptr()) };
    }
    pub fn as_ptr(&self) -> *const OrtKeyValuePairs {
        self.raw
    }
    /// Give ownership to ORT (e.g. `OrtAllocator::GetStats`).
    pub fn into_raw(self) -> *mut OrtKeyValuePairs {
        let raw = self.raw;
        std::mem::forget(self);
        raw
    }
}

impl Drop for KeyValues {
    fn drop(&mut self) {
        // SAFETY: we own raw and nothing else refers to it.
        unsafe { (self.api.release_kvp)(self.raw) };
    }
}

/// An `OrtMemoryInfo` we created. ORT keeps raw pointers to the ones we
/// register on an `OrtEpDevice`, so the factory keeps these alive until the
/// last object made from it is released.
pub(crate) struct OwnedMemoryInfo {
    api: Api,
    raw: *mut OrtMemoryInfo,
}

// SAFETY: an OrtMemoryInfo is immutable once created and ORT itself reads it
// from any thread; we only hand out its address and release it once.
unsafe impl Send for OwnedMemoryInfo {}
// SAFETY: as above.
unsafe impl Sync for OwnedMemoryInfo {}

impl OwnedMemoryInfo {
    pub fn as_ptr(&self) -> *const OrtMemoryInfo {
        self.raw
    }
}

impl Drop for OwnedMemoryInfo {
    fn drop(&mut self) {
        // SAFETY: we own raw; everyone who borrowed it holds our Arc.
        unsafe { (self.api.release_memory_info)(self.raw) };
    }
}

pub(crate) fn cstring_lossy(s: &str) -> CString {
    CString::new(s.replace('\0', "?")).unwrap_or_default()
}

/// # Safety
/// `p` is NULL or a NUL-terminated string.
unsafe fn lossy(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: per the caller.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ort_versions() {
        assert_eq!(parse_minor("1.23.2"), Some(23));
        assert_eq!(parse_minor("1.31.1"), Some(31));
        assert_eq!(parse_minor("1.32.0-dev"), Some(32));
        assert_eq!(parse_minor("2.0.0"), None);
        assert_eq!(parse_minor("garbage"), None);
    }
}
