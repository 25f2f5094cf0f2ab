//! The host's `OrtApi` / `OrtEpApi`, read once per `CreateEpFactories` call
//! into typed function pointers, plus the few safe helpers the adapter needs
//! (statuses, key-value pairs, memory devices).
//!
//! The tables are read by field name (`abi::OrtApi`, `abi::OrtEpApi`):
//! every field of the v23 tables is read unconditionally and checked
//! non-NULL once; the 1.24 fields (`CreateHardwareDevice`) only when the
//! running ORT says it is 1.24 or newer.

use std::ffi::{CStr, CString, c_char, c_void};

use super::abi::*;
use crate::error::{EpmStatus, Error, Result};

/// Turn a function-table field into a callable pointer, or say which one the
/// running ORT lacks.
fn need<F>(f: Option<F>, what: &str) -> Result<F> {
    f.ok_or_else(|| Error::new(EpmStatus::Unsupported, format!("this ONNX Runtime has no {what} (its slot is NULL)")))
}

/// Declares [`OrtFns`]: a copy of the `OrtApi` functions epmem calls, each
/// checked non-NULL once, when the table is read.
macro_rules! ort_fns {
    ($($name:ident),* $(,)?) => {
        /// The `OrtApi` functions epmem calls (ORT's own names).
        #[derive(Clone, Copy)]
        #[allow(non_snake_case)]
        pub(crate) struct OrtFns {
            $(pub $name: fns::$name,)*
        }
        impl OrtFns {
            /// # Safety
            /// `t` is the table `GetApi(23)` returned: every field through
            /// version 23 is there.
            unsafe fn read(t: *const OrtApi) -> Result<Self> {
                // SAFETY: per the caller; each read is one field of the table
                // through the raw pointer (no reference to the whole struct).
                Ok(Self { $($name: need(unsafe { (*t).$name }, stringify!($name))?,)* })
            }
        }
    };
}

ort_fns!(
    CreateStatus,
    GetErrorMessage,
    ReleaseStatus,
    ReleaseMemoryInfo,
    CreateKeyValuePairs,
    AddKeyValuePair,
    GetKeyValue,
    GetKeyValuePairs,
    ReleaseKeyValuePairs,
    HardwareDevice_Type,
    HardwareDevice_VendorId,
    HardwareDevice_Metadata,
    GetTensorMutableData,
    GetTensorData,
    GetTensorSizeInBytes,
    CreateMemoryInfo_V2,
    Logger_LogMessage,
    Logger_GetLoggingSeverityLevel,
    SyncStream_GetHandle,
    GetEpApi,
    // The compute path (GetCapability, Compile, Compute).
    GetSessionOptionsConfigEntries,
    Graph_GetNumNodes,
    Graph_GetNodes,
    Node_GetName,
    Node_GetOperatorType,
    Node_GetDomain,
    Node_GetNumInputs,
    Node_GetInputs,
    Node_GetNumOutputs,
    Node_GetOutputs,
    Node_GetAttributeByName,
    ReadOpAttr,
    GetValueInfoName,
    GetValueInfoTypeInfo,
    ValueInfo_IsConstantInitializer,
    ValueInfo_GetInitializerValue,
    CastTypeInfoToTensorInfo,
    GetTensorElementType,
    GetDimensionsCount,
    GetDimensions,
    GetTensorTypeAndShape,
    ReleaseTensorTypeAndShapeInfo,
    KernelContext_GetInputCount,
    KernelContext_GetInput,
    KernelContext_GetOutput,
    KernelContext_GetGPUComputeStream,
);

/// The `OrtEpApi` functions epmem calls (ORT's own names).
#[derive(Clone, Copy)]
#[allow(non_snake_case)]
pub(crate) struct EpFns {
    pub CreateEpDevice: ep_fns::CreateEpDevice,
    pub ReleaseEpDevice: ep_fns::ReleaseEpDevice,
    pub EpGraphSupportInfo_AddNodesToFuse: ep_fns::EpGraphSupportInfo_AddNodesToFuse,
    pub EpDevice_AddAllocatorInfo: ep_fns::EpDevice_AddAllocatorInfo,
    pub MemoryInfo_GetMemoryDevice: ep_fns::MemoryInfo_GetMemoryDevice,
    pub Value_GetMemoryDevice: ep_fns::Value_GetMemoryDevice,
    pub MemoryDevice_GetDeviceType: ep_fns::MemoryDevice_GetDeviceType,
    pub MemoryDevice_GetMemoryType: ep_fns::MemoryDevice_GetMemoryType,
    pub MemoryDevice_GetVendorId: ep_fns::MemoryDevice_GetVendorId,
    pub MemoryDevice_GetDeviceId: ep_fns::MemoryDevice_GetDeviceId,
    /// 1.24+; `None` on 1.23.
    pub CreateHardwareDevice: Option<ep_fns::CreateHardwareDevice>,
    /// 1.24+; `None` on 1.23.
    pub ReleaseHardwareDevice: Option<ep_fns::ReleaseHardwareDevice>,
}

impl EpFns {
    /// # Safety
    /// `e` is the host's `OrtEpApi` of an ORT at least 1.`version` (≥ 23).
    unsafe fn read(e: *const OrtEpApi, version: u32) -> Result<Self> {
        // SAFETY: per the caller: the v23 fields are there, the v24 ones only
        // on 1.24+ (and read only then). Each read is one field through the
        // raw pointer.
        unsafe {
            let v24 = version >= 24;
            Ok(Self {
                CreateEpDevice: need((*e).CreateEpDevice, "CreateEpDevice")?,
                ReleaseEpDevice: need((*e).ReleaseEpDevice, "ReleaseEpDevice")?,
                EpGraphSupportInfo_AddNodesToFuse: need(
                    (*e).EpGraphSupportInfo_AddNodesToFuse,
                    "EpGraphSupportInfo_AddNodesToFuse",
                )?,
                EpDevice_AddAllocatorInfo: need((*e).EpDevice_AddAllocatorInfo, "EpDevice_AddAllocatorInfo")?,
                MemoryInfo_GetMemoryDevice: need((*e).MemoryInfo_GetMemoryDevice, "MemoryInfo_GetMemoryDevice")?,
                Value_GetMemoryDevice: need((*e).Value_GetMemoryDevice, "Value_GetMemoryDevice")?,
                MemoryDevice_GetDeviceType: need((*e).MemoryDevice_GetDeviceType, "MemoryDevice_GetDeviceType")?,
                MemoryDevice_GetMemoryType: need((*e).MemoryDevice_GetMemoryType, "MemoryDevice_GetMemoryType")?,
                MemoryDevice_GetVendorId: need((*e).MemoryDevice_GetVendorId, "MemoryDevice_GetVendorId")?,
                MemoryDevice_GetDeviceId: need((*e).MemoryDevice_GetDeviceId, "MemoryDevice_GetDeviceId")?,
                CreateHardwareDevice: if v24 {
                    Some(need((*e).CreateHardwareDevice, "CreateHardwareDevice")?)
                } else {
                    None
                },
                ReleaseHardwareDevice: if v24 {
                    Some(need((*e).ReleaseHardwareDevice, "ReleaseHardwareDevice")?)
                } else {
                    None
                },
            })
        }
    }
}

/// Typed view of the host's API tables. `Copy`: it is only function pointers
/// into the ORT library, which outlives every object we hand to it.
#[derive(Clone, Copy)]
pub(crate) struct Api {
    /// The running ORT's minor version (31 for 1.31.x).
    pub version: u32,
    pub o: OrtFns,
    pub e: EpFns,
}

/// Test hook: make [`Api::load`] panic, as a bug in it would.
#[cfg(test)]
pub(crate) static PANIC_IN_LOAD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

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
        // SAFETY: GetApi(23) succeeded, so the table has every v23 field.
        let o = unsafe { OrtFns::read(api) }?;
        // SAFETY: a plain ORT call.
        let ep = unsafe { (o.GetEpApi)() };
        crate::ensure!(!ep.is_null(), Unsupported, "ONNX Runtime {vstr} returned no OrtEpApi");
        // SAFETY: the EP API of an ORT of at least `version`.
        let e = unsafe { EpFns::read(ep, version) }?;
        Ok(Api { version, o, e })
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
        unsafe { (self.o.CreateStatus)(code, msg.as_ptr()) }
    }

    /// Turn a status returned by an ORT call into a `Result`, freeing it.
    pub fn check(&self, st: *mut OrtStatus, call: &str) -> Result<()> {
        if st.is_null() {
            return Ok(());
        }
        // SAFETY: `st` is a live status ORT returned to us; we own it.
        let msg = unsafe {
            let m = (self.o.GetErrorMessage)(st);
            let s = lossy(m);
            (self.o.ReleaseStatus)(st);
            s
        };
        Err(Error::new(EpmStatus::Internal, format!("ONNX Runtime {call} failed: {msg}")))
    }

    // ---- key-value pairs -------------------------------------------------

    /// A new, owned key-value pair set filled from `pairs`.
    pub fn kvp_new(&self, pairs: &[(&str, String)]) -> KeyValues {
        let mut kv: *mut OrtKeyValuePairs = std::ptr::null_mut();
        // SAFETY: CreateKeyValuePairs writes a fresh object to `kv`.
        unsafe { (self.o.CreateKeyValuePairs)(&mut kv) };
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
            (self.o.GetKeyValuePairs)(kv, &mut keys, &mut vals, &mut n);
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
            let v = (self.o.GetKeyValue)(kv, k.as_ptr());
            (!v.is_null()).then(|| lossy(v))
        }
    }

    /// Metadata of a hardware device ORT owns.
    ///
    /// # Safety
    /// `hw` is a live `OrtHardwareDevice`.
    pub unsafe fn hw_metadata(&self, hw: *const OrtHardwareDevice, key: &str) -> Option<String> {
        // SAFETY: per the caller; the metadata lives as long as the device.
        unsafe { self.kvp_get((self.o.HardwareDevice_Metadata)(hw), key) }
    }

    // ---- memory infos and devices ---------------------------------------

    /// A memory info made with `CreateMemoryInfo_V2` (the legacy way gives
    /// "Invalid memory type: -1" for pinned memory and broke the CUDA EP).
    pub fn memory_info(&self, name: &str, kind: MemoryKind, mem: OrtDeviceMemoryType) -> Result<OwnedMemoryInfo> {
        let n = cstring_lossy(name);
        let mut out: *mut OrtMemoryInfo = std::ptr::null_mut();
        // SAFETY: plain ORT call; ORT copies the name.
        let st = unsafe {
            (self.o.CreateMemoryInfo_V2)(
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
                    device_type: (self.e.MemoryDevice_GetDeviceType)(md),
                    vendor_id: (self.e.MemoryDevice_GetVendorId)(md),
                    device_id: (self.e.MemoryDevice_GetDeviceId)(md) as i32,
                },
                mem_type: (self.e.MemoryDevice_GetMemoryType)(md),
            }
        }
    }

    /// The memory device of a memory info.
    ///
    /// # Safety
    /// `mi` is a live `OrtMemoryInfo`.
    pub unsafe fn memory_info_desc(&self, mi: *const OrtMemoryInfo) -> MemoryDeviceDesc {
        // SAFETY: per the caller; the memory device lives inside the info.
        unsafe { self.memory_device((self.e.MemoryInfo_GetMemoryDevice)(mi)) }
    }

    /// The memory device, data pointer and byte size of a tensor.
    ///
    /// # Safety
    /// `v` is a live `OrtValue`.
    pub unsafe fn tensor(&self, v: *const OrtValue, mutable: bool) -> Result<TensorView> {
        // SAFETY: per the caller.
        unsafe {
            let md = (self.e.Value_GetMemoryDevice)(v);
            crate::ensure!(!md.is_null(), InvalidArgument, "an OrtValue to copy is not a tensor");
            let desc = self.memory_device(md);
            let mut bytes = 0usize;
            self.check((self.o.GetTensorSizeInBytes)(v, &mut bytes), "GetTensorSizeInBytes")?;
            let ptr = if mutable {
                let mut p: *mut c_void = std::ptr::null_mut();
                self.check((self.o.GetTensorMutableData)(v as *mut OrtValue, &mut p), "GetTensorMutableData")?;
                p as u64
            } else {
                let mut p: *const c_void = std::ptr::null();
                self.check((self.o.GetTensorData)(v, &mut p), "GetTensorData")?;
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
        unsafe { (self.api.o.AddKeyValuePair)(self.raw, k.as_ptr(), v.as_ptr()) };
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
        unsafe { (self.api.o.ReleaseKeyValuePairs)(self.raw) };
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
        unsafe { (self.api.o.ReleaseMemoryInfo)(self.raw) };
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
