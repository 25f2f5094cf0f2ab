//! ONNX Runtime's plugin-EP ABI, declared by hand.
//!
//! No ORT headers ship with the wheel, and we build without ORT, so every
//! struct ORT reads from us (or we read from ORT) is declared here as
//! `#[repr(C)]` with its size and field offsets asserted at compile time
//! against `shared/ORT_PLUGIN_ABI.md` (x86-64, ORT 1.28 layout). All ORT
//! structs are append-only, so a table declared at v28 is read correctly by
//! ORT 1.23–1.31 as long as `ort_version_supported` tells ORT which slots
//! exist (ORT never reads a slot newer than that).
//!
//! Function-pointer slots are `Option<fn>`: `None` is the C NULL that ORT
//! tests for optional slots. Slots ORT would dereference unconditionally are
//! listed in `ORT_PLUGIN_ABI.md` and are always filled by this crate.

#![allow(non_snake_case, non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void};
use std::mem::{offset_of, size_of};

/// `OrtAllocator::version` from which ORT reads `Shrink`.
pub const ORT_ALLOCATOR_SHRINK_VERSION: u32 = 25;

/// The minimum ORT API version epmem needs (allocators, data transfer,
/// `CreateMemoryInfo_V2`, `CopyTensors` all arrived in 1.23).
pub const ORT_API_MIN: u32 = 23;
/// What we put in every `ort_version_supported`/`version` field: the
/// minimum, so ORT 1.23 (and newer) reads only slots that 1.23 defines.
pub const ORT_VERSION_SUPPORTED: u32 = ORT_API_MIN;

macro_rules! opaque {
    ($($name:ident),* $(,)?) => {
        $(
            /// Opaque ORT object, only ever handled by pointer.
            #[repr(C)]
            pub struct $name {
                _private: [u8; 0],
            }
        )*
    };
}

opaque!(
    OrtStatus,
    OrtApi,
    OrtEpApi,
    OrtLogger,
    OrtHardwareDevice,
    OrtEpDevice,
    OrtKeyValuePairs,
    OrtMemoryInfo,
    OrtMemoryDevice,
    OrtValue,
    OrtSessionOptions,
    OrtGraph,
    OrtNode,
    OrtEpGraphSupportInfo,
    OrtNodeComputeInfo,
    OrtSyncStream,
    OrtSyncStreamImpl,
);

/// A slot we never fill (reserved for a later ORT version, optional).
pub type Slot = Option<unsafe extern "C" fn()>;

// ---- enums (C `int`-sized) -------------------------------------------------

/// `OrtErrorCode`.
pub type OrtErrorCode = c_int;
pub const ORT_FAIL: OrtErrorCode = 1;
pub const ORT_INVALID_ARGUMENT: OrtErrorCode = 2;
pub const ORT_NOT_IMPLEMENTED: OrtErrorCode = 9;
pub const ORT_EP_FAIL: OrtErrorCode = 11;

/// `OrtMemoryInfoDeviceType`.
pub type OrtMemoryInfoDeviceType = c_int;
pub const MEMORY_INFO_DEVICE_CPU: OrtMemoryInfoDeviceType = 0;
pub const MEMORY_INFO_DEVICE_GPU: OrtMemoryInfoDeviceType = 1;

/// `OrtHardwareDeviceType`.
pub type OrtHardwareDeviceType = c_int;
pub const HARDWARE_DEVICE_CPU: OrtHardwareDeviceType = 0;
pub const HARDWARE_DEVICE_GPU: OrtHardwareDeviceType = 1;

/// `OrtDeviceMemoryType`.
pub type OrtDeviceMemoryType = c_int;
pub const DEVICE_MEMORY_DEFAULT: OrtDeviceMemoryType = 0;
pub const DEVICE_MEMORY_HOST_ACCESSIBLE: OrtDeviceMemoryType = 5;

/// `OrtLoggingLevel`.
pub type OrtLoggingLevel = c_int;
pub const LOGGING_VERBOSE: OrtLoggingLevel = 0;
pub const LOGGING_INFO: OrtLoggingLevel = 1;
pub const LOGGING_WARNING: OrtLoggingLevel = 2;
pub const LOGGING_ERROR: OrtLoggingLevel = 3;

/// `OrtAllocatorType`.
pub type OrtAllocatorType = c_int;
pub const ALLOCATOR_DEVICE: OrtAllocatorType = 0;

/// `OrtCompiledModelCompatibility`: 0 is `EP_NOT_APPLICABLE`.
pub type OrtCompiledModelCompatibility = c_int;
pub const COMPILED_MODEL_NOT_APPLICABLE: OrtCompiledModelCompatibility = 0;

// ---- entry point -----------------------------------------------------------

#[repr(C)]
pub struct OrtApiBase {
    /// Returns NULL when `version` is newer than the running ORT.
    pub GetApi: unsafe extern "C" fn(version: u32) -> *const OrtApi,
    /// e.g. "1.31.1".
    pub GetVersionString: unsafe extern "C" fn() -> *const c_char,
}
const _: () = assert!(size_of::<OrtApiBase>() == 16);

// ---- OrtEpFactory (we implement; ORT reads) -------------------------------

#[repr(C)]
pub struct OrtEpFactory {
    /* 0 */ pub ort_version_supported: u32,
    /* 1 */
    pub GetName: Option<unsafe extern "C" fn(this: *const OrtEpFactory) -> *const c_char>,
    /* 2 */
    pub GetVendor: Option<unsafe extern "C" fn(this: *const OrtEpFactory) -> *const c_char>,
    /* 3 */
    pub GetSupportedDevices: Option<
        unsafe extern "C" fn(
            this: *mut OrtEpFactory,
            devices: *const *const OrtHardwareDevice,
            num_devices: usize,
            ep_devices: *mut *mut OrtEpDevice,
            max_ep_devices: usize,
            num_ep_devices: *mut usize,
        ) -> *mut OrtStatus,
    >,
    /* 4 */
    pub CreateEp: Option<
        unsafe extern "C" fn(
            this: *mut OrtEpFactory,
            devices: *const *const OrtHardwareDevice,
            ep_metadata: *const *const OrtKeyValuePairs,
            num_devices: usize,
            session_options: *const OrtSessionOptions,
            logger: *const OrtLogger,
            ep: *mut *mut OrtEp,
        ) -> *mut OrtStatus,
    >,
    /* 5 */
    pub ReleaseEp: Option<unsafe extern "C" fn(this: *mut OrtEpFactory, ep: *mut OrtEp)>,
    /* 6 */ pub GetVendorId: Option<unsafe extern "C" fn(this: *const OrtEpFactory) -> u32>,
    /* 7 */
    pub GetVersion: Option<unsafe extern "C" fn(this: *const OrtEpFactory) -> *const c_char>,
    /* 8 */
    pub ValidateCompiledModelCompatibilityInfo: Option<
        unsafe extern "C" fn(
            this: *mut OrtEpFactory,
            devices: *const *const OrtHardwareDevice,
            num_devices: usize,
            compatibility_info: *const c_char,
            out: *mut OrtCompiledModelCompatibility,
        ) -> *mut OrtStatus,
    >,
    /* 9 */
    pub CreateAllocator: Option<
        unsafe extern "C" fn(
            this: *mut OrtEpFactory,
            memory_info: *const OrtMemoryInfo,
            options: *const OrtKeyValuePairs,
            out: *mut *mut OrtAllocator,
        ) -> *mut OrtStatus,
    >,
    /* 10 */
    pub ReleaseAllocator: Option<unsafe extern "C" fn(this: *mut OrtEpFactory, allocator: *mut OrtAllocator)>,
    /* 11 */
    pub CreateDataTransfer:
        Option<unsafe extern "C" fn(this: *mut OrtEpFactory, out: *mut *mut OrtDataTransferImpl) -> *mut OrtStatus>,
    /* 12 */
    pub IsStreamAware: Option<unsafe extern "C" fn(this: *const OrtEpFactory) -> bool>,
    /* 13 */
    pub CreateSyncStreamForDevice: Option<
        unsafe extern "C" fn(
            this: *mut OrtEpFactory,
            memory_device: *const OrtMemoryDevice,
            stream_options: *const OrtKeyValuePairs,
            out: *mut *mut OrtSyncStreamImpl,
        ) -> *mut OrtStatus,
    >,
    /* 14 */ pub SetEnvironmentOptions: Slot,
    /* 15–17, 1.24, optional */ pub _v24: [Slot; 3],
    /* 18–19, 1.25, optional */ pub _v25: [Slot; 2],
    /* 20, 1.28, optional */ pub SelectBestModelCandidate: Slot,
}
const _: () = {
    assert!(size_of::<OrtEpFactory>() == 168);
    assert!(offset_of!(OrtEpFactory, GetName) == 8);
    assert!(offset_of!(OrtEpFactory, GetSupportedDevices) == 3 * 8);
    assert!(offset_of!(OrtEpFactory, CreateEp) == 4 * 8);
    assert!(offset_of!(OrtEpFactory, ReleaseEp) == 5 * 8);
    assert!(offset_of!(OrtEpFactory, GetVendorId) == 6 * 8);
    assert!(offset_of!(OrtEpFactory, GetVersion) == 7 * 8);
    assert!(offset_of!(OrtEpFactory, ValidateCompiledModelCompatibilityInfo) == 8 * 8);
    assert!(offset_of!(OrtEpFactory, CreateAllocator) == 9 * 8);
    assert!(offset_of!(OrtEpFactory, ReleaseAllocator) == 10 * 8);
    assert!(offset_of!(OrtEpFactory, CreateDataTransfer) == 11 * 8);
    assert!(offset_of!(OrtEpFactory, IsStreamAware) == 12 * 8);
    assert!(offset_of!(OrtEpFactory, CreateSyncStreamForDevice) == 13 * 8);
    assert!(offset_of!(OrtEpFactory, SetEnvironmentOptions) == 14 * 8);
    assert!(offset_of!(OrtEpFactory, SelectBestModelCandidate) == 20 * 8);
};

// ---- OrtEp (we implement; ORT reads) ---------------------------------------

#[repr(C)]
pub struct OrtEp {
    /* 0 */ pub ort_version_supported: u32,
    /* 1 */ pub GetName: Option<unsafe extern "C" fn(this: *const OrtEp) -> *const c_char>,
    /* 2 */
    pub GetCapability: Option<
        unsafe extern "C" fn(
            this: *mut OrtEp,
            graph: *const OrtGraph,
            info: *mut OrtEpGraphSupportInfo,
        ) -> *mut OrtStatus,
    >,
    /* 3 */
    pub Compile: Option<
        unsafe extern "C" fn(
            this: *mut OrtEp,
            graphs: *const *const OrtGraph,
            fused_nodes: *const *const OrtNode,
            count: usize,
            node_compute_infos: *mut *mut OrtNodeComputeInfo,
            ep_context_nodes: *mut *mut OrtNode,
        ) -> *mut OrtStatus,
    >,
    /* 4 */
    pub ReleaseNodeComputeInfos:
        Option<unsafe extern "C" fn(this: *mut OrtEp, infos: *mut *mut OrtNodeComputeInfo, count: usize)>,
    /* 5 */ pub GetPreferredDataLayout: Slot,
    /* 6 */ pub ShouldConvertDataLayoutForOp: Slot,
    /* 7 */ pub SetDynamicOptions: Slot,
    /* 8 */ pub OnRunStart: Slot,
    /* 9 */ pub OnRunEnd: Slot,
    /* 10: NULL means "use the factory's CreateAllocator" */ pub CreateAllocator: Slot,
    /* 11 */ pub CreateSyncStreamForDevice: Slot,
    /* 12 */ pub GetCompiledModelCompatibilityInfo: Slot,
    /* 13, 1.24 */ pub GetKernelRegistry: Slot,
    /* 14–24, later versions, optional */ pub _later: [Slot; 11],
}
const _: () = {
    assert!(size_of::<OrtEp>() == 200);
    assert!(offset_of!(OrtEp, GetName) == 8);
    assert!(offset_of!(OrtEp, GetCapability) == 2 * 8);
    assert!(offset_of!(OrtEp, Compile) == 3 * 8);
    assert!(offset_of!(OrtEp, ReleaseNodeComputeInfos) == 4 * 8);
    assert!(offset_of!(OrtEp, CreateAllocator) == 10 * 8);
    assert!(offset_of!(OrtEp, CreateSyncStreamForDevice) == 11 * 8);
    assert!(offset_of!(OrtEp, GetCompiledModelCompatibilityInfo) == 12 * 8);
    assert!(offset_of!(OrtEp, GetKernelRegistry) == 13 * 8);
};

// ---- OrtAllocator (we implement; ORT and users call) ----------------------

#[repr(C)]
pub struct OrtAllocator {
    pub version: u32,
    /// Failure is reported only by returning NULL.
    pub Alloc: Option<unsafe extern "C" fn(this: *mut OrtAllocator, size: usize) -> *mut c_void>,
    pub Free: Option<unsafe extern "C" fn(this: *mut OrtAllocator, p: *mut c_void)>,
    pub Info: Option<unsafe extern "C" fn(this: *const OrtAllocator) -> *const OrtMemoryInfo>,
    /// 1.18.
    pub Reserve: Option<unsafe extern "C" fn(this: *mut OrtAllocator, size: usize) -> *mut c_void>,
    /// 1.23, optional; ORT takes ownership of `*out`.
    pub GetStats:
        Option<unsafe extern "C" fn(this: *const OrtAllocator, out: *mut *mut OrtKeyValuePairs) -> *mut OrtStatus>,
    /// 1.23, optional.
    pub AllocOnStream:
        Option<unsafe extern "C" fn(this: *mut OrtAllocator, size: usize, stream: *mut OrtSyncStream) -> *mut c_void>,
    /// 1.25, optional: give unused memory back. Read only when `version >= 25`.
    pub Shrink: Option<unsafe extern "C" fn(this: *mut OrtAllocator) -> *mut OrtStatus>,
}
const _: () = {
    assert!(size_of::<OrtAllocator>() == 64);
    assert!(offset_of!(OrtAllocator, Alloc) == 8);
    assert!(offset_of!(OrtAllocator, Free) == 16);
    assert!(offset_of!(OrtAllocator, Info) == 24);
    assert!(offset_of!(OrtAllocator, Reserve) == 32);
    assert!(offset_of!(OrtAllocator, GetStats) == 40);
    assert!(offset_of!(OrtAllocator, AllocOnStream) == 48);
    assert!(offset_of!(OrtAllocator, Shrink) == 56);
};

// ---- OrtDataTransferImpl (we implement; ORT calls) -------------------------

#[repr(C)]
pub struct OrtDataTransferImpl {
    pub ort_version_supported: u32,
    pub Release: Option<unsafe extern "C" fn(this: *mut OrtDataTransferImpl)>,
    pub CanCopy: Option<
        unsafe extern "C" fn(
            this: *const OrtDataTransferImpl,
            src: *const OrtMemoryDevice,
            dst: *const OrtMemoryDevice,
        ) -> bool,
    >,
    /// `streams` is NULL when the EP is not stream aware (ours is not).
    pub CopyTensors: Option<
        unsafe extern "C" fn(
            this: *mut OrtDataTransferImpl,
            src: *const *const OrtValue,
            dst: *mut *mut OrtValue,
            streams: *mut *mut OrtSyncStream,
            n: usize,
        ) -> *mut OrtStatus,
    >,
}
const _: () = {
    assert!(size_of::<OrtDataTransferImpl>() == 32);
    assert!(offset_of!(OrtDataTransferImpl, Release) == 8);
    assert!(offset_of!(OrtDataTransferImpl, CanCopy) == 16);
    assert!(offset_of!(OrtDataTransferImpl, CopyTensors) == 24);
};

/// Slot indices in the host's `OrtApi` table (valid from v23 on; the table
/// is append-only, so they never move). Declared as indices rather than a
/// 390-field struct: we read only these, and only after `GetApi(23)`
/// proved the table is at least that long.
pub mod api_slot {
    pub const CREATE_STATUS: usize = 0;
    pub const GET_ERROR_MESSAGE: usize = 2;
    pub const GET_TENSOR_MUTABLE_DATA: usize = 51;
    pub const RELEASE_STATUS: usize = 93;
    pub const RELEASE_MEMORY_INFO: usize = 94;
    pub const CREATE_KEY_VALUE_PAIRS: usize = 295;
    pub const ADD_KEY_VALUE_PAIR: usize = 296;
    pub const GET_KEY_VALUE: usize = 297;
    pub const GET_KEY_VALUE_PAIRS: usize = 298;
    pub const RELEASE_KEY_VALUE_PAIRS: usize = 300;
    pub const LOGGER_LOG_MESSAGE: usize = 247;
    pub const LOGGER_GET_LOGGING_SEVERITY_LEVEL: usize = 248;
    /// `void* SyncStream_GetHandle(OrtSyncStream*)`: the native stream
    /// (`cudaStream_t` for the CUDA EP's streams), 1.23.
    pub const SYNC_STREAM_GET_HANDLE: usize = 384;
    pub const HARDWARE_DEVICE_TYPE: usize = 307;
    pub const HARDWARE_DEVICE_VENDOR_ID: usize = 308;
    pub const HARDWARE_DEVICE_METADATA: usize = 311;
    pub const GET_EP_API: usize = 317;
    pub const GET_TENSOR_SIZE_IN_BYTES: usize = 318;
    pub const CREATE_MEMORY_INFO_V2: usize = 320;
    pub const GET_TENSOR_DATA: usize = 378;
}

/// Slot indices in the host's `OrtEpApi` table.
pub mod ep_api_slot {
    pub const CREATE_EP_DEVICE: usize = 0;
    pub const RELEASE_EP_DEVICE: usize = 1;
    pub const EP_DEVICE_ADD_ALLOCATOR_INFO: usize = 5;
    pub const MEMORY_INFO_GET_MEMORY_DEVICE: usize = 6;
    pub const VALUE_GET_MEMORY_DEVICE: usize = 7;
    pub const MEMORY_DEVICE_GET_DEVICE_TYPE: usize = 9;
    pub const MEMORY_DEVICE_GET_MEMORY_TYPE: usize = 10;
    pub const MEMORY_DEVICE_GET_VENDOR_ID: usize = 11;
    pub const MEMORY_DEVICE_GET_DEVICE_ID: usize = 12;
    /// 1.24+.
    pub const CREATE_HARDWARE_DEVICE: usize = 16;
    /// 1.24+.
    pub const RELEASE_HARDWARE_DEVICE: usize = 17;
}
