//! ONNX Runtime's plugin-EP ABI, declared by hand.
//!
//! No ORT headers ship with the wheel, and we build without ORT, so every
//! function table ORT reads from us (or we read from ORT) is declared here
//! as a `#[repr(C)]` struct of named fields in the order of ORT's public
//! headers (`onnxruntime_c_api.h`, `onnxruntime_ep_c_api.h`), each marked
//! with the API version that added it, and with its size and field offsets
//! asserted at compile time (x86-64). ORT's tables are append-only: a field
//! never moves once a version has shipped, so one declaration serves every
//! ORT from 1.23 on, as long as we read only fields of the version we asked
//! for (`GetApi(23)`) and tell ORT, through `ort_version_supported`, which
//! fields of our own tables exist (ORT never reads a newer one).
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
    OrtSyncStream,
    OrtSyncStreamImpl,
    OrtValueInfo,
    OrtTypeInfo,
    OrtTensorTypeAndShapeInfo,
    OrtOpAttr,
    OrtKernelContext,
    OrtNodeComputeContext,
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

/// `ONNXTensorElementDataType`: the element types the EP computes with.
pub type ONNXTensorElementDataType = c_int;
pub const TENSOR_ELEMENT_FLOAT: ONNXTensorElementDataType = 1;
pub const TENSOR_ELEMENT_FLOAT16: ONNXTensorElementDataType = 10;
pub const TENSOR_ELEMENT_BFLOAT16: ONNXTensorElementDataType = 16;

/// `OrtOpAttrType`.
pub type OrtOpAttrType = c_int;
pub const OP_ATTR_INT: OrtOpAttrType = 1;
pub const OP_ATTR_FLOAT: OrtOpAttrType = 3;

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
    // ---- 1.22
    /* 0 */ pub ort_version_supported: u32,
    /* 1 */ pub GetName: Option<unsafe extern "C" fn(this: *const OrtEp) -> *const c_char>,
    // ---- 1.23
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
    // ---- 1.24
    /* 13 */ pub GetKernelRegistry: Slot,
    /* 14 */ pub IsConcurrentRunSupported: Slot,
    // ---- 1.25
    /* 15 */ pub Sync: Slot,
    /* 16 */ pub CreateProfiler: Slot,
    // ---- 1.26: graph capture and GetAvailableResource; 1.27:
    // OnSessionInitializationEnd, GetDefaultMemoryDevice, ReleaseCapturedGraph.
    // Never read by ORT while `ort_version_supported` is 23; kept so the
    // struct has the size it has at 1.28.
    /* 17–24 */
    pub _v26_v27: [Slot; 8],
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
    assert!(offset_of!(OrtEp, CreateProfiler) == 16 * 8);
};

// ---- OrtNodeFusionOptions, OrtNodeComputeInfo (1.23; we fill, ORT reads) ---

/// Passed to `EpGraphSupportInfo_AddNodesToFuse`.
#[repr(C)]
pub struct OrtNodeFusionOptions {
    pub ort_version_supported: u32,
    /// The EP keeps its own copy of the constant initializers: ORT leaves them
    /// out of the fused node's inputs and may free its copies.
    pub drop_constant_initializers: bool,
}
const _: () = {
    assert!(size_of::<OrtNodeFusionOptions>() == 8);
    assert!(offset_of!(OrtNodeFusionOptions, drop_constant_initializers) == 4);
};

/// How ORT runs a compiled (fused) node: `CreateState` once per session,
/// `Compute` per run, `ReleaseState` at the end.
#[repr(C)]
pub struct OrtNodeComputeInfo {
    pub ort_version_supported: u32,
    pub CreateState: Option<
        unsafe extern "C" fn(
            this: *mut OrtNodeComputeInfo,
            ctx: *mut OrtNodeComputeContext,
            state: *mut *mut c_void,
        ) -> *mut OrtStatus,
    >,
    pub Compute: Option<
        unsafe extern "C" fn(
            this: *mut OrtNodeComputeInfo,
            state: *mut c_void,
            ctx: *mut OrtKernelContext,
        ) -> *mut OrtStatus,
    >,
    pub ReleaseState: Option<unsafe extern "C" fn(this: *mut OrtNodeComputeInfo, state: *mut c_void)>,
}
const _: () = {
    assert!(size_of::<OrtNodeComputeInfo>() == 32);
    assert!(offset_of!(OrtNodeComputeInfo, CreateState) == 8);
    assert!(offset_of!(OrtNodeComputeInfo, Compute) == 16);
    assert!(offset_of!(OrtNodeComputeInfo, ReleaseState) == 24);
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

// ---- OrtEpApi (ORT implements; `OrtApi::GetEpApi`) -------------------------

/// Signatures of the `OrtEpApi` functions epmem calls, by field name.
pub mod ep_fns {
    use super::*;
    pub type CreateEpDevice = unsafe extern "C" fn(
        factory: *mut OrtEpFactory,
        hardware_device: *const OrtHardwareDevice,
        ep_metadata: *const OrtKeyValuePairs,
        ep_options: *const OrtKeyValuePairs,
        out: *mut *mut OrtEpDevice,
    ) -> *mut OrtStatus;
    pub type ReleaseEpDevice = unsafe extern "C" fn(device: *mut OrtEpDevice);
    pub type EpGraphSupportInfo_AddNodesToFuse = unsafe extern "C" fn(
        info: *mut OrtEpGraphSupportInfo,
        nodes: *const *const OrtNode,
        n: usize,
        options: *const OrtNodeFusionOptions,
    ) -> *mut OrtStatus;
    pub type EpGraphSupportInfo_AddSingleNode =
        unsafe extern "C" fn(info: *mut OrtEpGraphSupportInfo, node: *const OrtNode) -> *mut OrtStatus;
    pub type NodeComputeContext_NodeName = unsafe extern "C" fn(ctx: *const OrtNodeComputeContext) -> *const c_char;
    pub type EpDevice_AddAllocatorInfo =
        unsafe extern "C" fn(device: *mut OrtEpDevice, info: *const OrtMemoryInfo) -> *mut OrtStatus;
    pub type MemoryInfo_GetMemoryDevice = unsafe extern "C" fn(info: *const OrtMemoryInfo) -> *const OrtMemoryDevice;
    pub type Value_GetMemoryDevice = unsafe extern "C" fn(value: *const OrtValue) -> *const OrtMemoryDevice;
    pub type MemoryDevice_GetDeviceType = unsafe extern "C" fn(md: *const OrtMemoryDevice) -> OrtMemoryInfoDeviceType;
    pub type MemoryDevice_GetMemoryType = unsafe extern "C" fn(md: *const OrtMemoryDevice) -> OrtDeviceMemoryType;
    pub type MemoryDevice_GetVendorId = unsafe extern "C" fn(md: *const OrtMemoryDevice) -> u32;
    pub type MemoryDevice_GetDeviceId = unsafe extern "C" fn(md: *const OrtMemoryDevice) -> u32;
    pub type CreateHardwareDevice = unsafe extern "C" fn(
        ty: OrtHardwareDeviceType,
        vendor_id: u32,
        device_id: u32,
        vendor_name: *const c_char,
        metadata: *const OrtKeyValuePairs,
        out: *mut *mut OrtHardwareDevice,
    ) -> *mut OrtStatus;
    pub type ReleaseHardwareDevice = unsafe extern "C" fn(device: *mut OrtHardwareDevice);
}

#[repr(C)]
pub struct OrtEpApi {
    // ---- 1.22
    /* 0 */ pub CreateEpDevice: Option<ep_fns::CreateEpDevice>,
    /* 1 */ pub ReleaseEpDevice: Option<ep_fns::ReleaseEpDevice>,
    // ---- 1.23
    /* 2 */
    pub EpGraphSupportInfo_AddNodesToFuse: Option<ep_fns::EpGraphSupportInfo_AddNodesToFuse>,
    /* 3 */ pub EpGraphSupportInfo_AddSingleNode: Option<ep_fns::EpGraphSupportInfo_AddSingleNode>,
    /* 4 */ pub NodeComputeContext_NodeName: Option<ep_fns::NodeComputeContext_NodeName>,
    /* 5 */ pub EpDevice_AddAllocatorInfo: Option<ep_fns::EpDevice_AddAllocatorInfo>,
    /* 6 */ pub MemoryInfo_GetMemoryDevice: Option<ep_fns::MemoryInfo_GetMemoryDevice>,
    /* 7 */ pub Value_GetMemoryDevice: Option<ep_fns::Value_GetMemoryDevice>,
    /* 8 */ pub MemoryDevice_AreEqual: Slot,
    /* 9 */ pub MemoryDevice_GetDeviceType: Option<ep_fns::MemoryDevice_GetDeviceType>,
    /* 10 */ pub MemoryDevice_GetMemoryType: Option<ep_fns::MemoryDevice_GetMemoryType>,
    /* 11 */ pub MemoryDevice_GetVendorId: Option<ep_fns::MemoryDevice_GetVendorId>,
    /* 12 */ pub MemoryDevice_GetDeviceId: Option<ep_fns::MemoryDevice_GetDeviceId>,
    /* 13 */ pub SyncStream_GetImpl: Slot,
    /* 14 */ pub SyncStream_GetSyncId: Slot,
    /* 15 */ pub GetSyncIdForLastWaitOnSyncStream: Slot,
    // ---- 1.24 (read only when the running ORT is 1.24 or newer)
    /* 16 */
    pub CreateHardwareDevice: Option<ep_fns::CreateHardwareDevice>,
    /* 17 */ pub ReleaseHardwareDevice: Option<ep_fns::ReleaseHardwareDevice>,
}
/// Bytes of `OrtEpApi` at 1.23 (`GetApi(23)`'s table is at least this long).
pub const ORT_EP_API_V23_BYTES: usize = 16 * 8;
const _: () = {
    assert!(size_of::<OrtEpApi>() == 18 * 8);
    assert!(offset_of!(OrtEpApi, EpGraphSupportInfo_AddNodesToFuse) == 2 * 8);
    assert!(offset_of!(OrtEpApi, NodeComputeContext_NodeName) == 4 * 8);
    assert!(offset_of!(OrtEpApi, EpDevice_AddAllocatorInfo) == 5 * 8);
    assert!(offset_of!(OrtEpApi, MemoryDevice_GetDeviceId) == 12 * 8);
    assert!(offset_of!(OrtEpApi, GetSyncIdForLastWaitOnSyncStream) + 8 == ORT_EP_API_V23_BYTES);
    assert!(offset_of!(OrtEpApi, CreateHardwareDevice) == 16 * 8);
    assert!(offset_of!(OrtEpApi, ReleaseHardwareDevice) == 17 * 8);
};

// ---- OrtApi (ORT implements; `OrtApiBase::GetApi(23)`) --------------------
//
// Every field through the end of version 23 (ORT 1.23), in ORT's order. The
// functions epmem calls are typed; the others are `Slot`s that are never read.
// Fields added after 1.23 are not declared: epmem asks for API 23, and a
// table handed out for 23 need not have them.

/// Signatures of the `OrtApi` functions epmem calls, by field name.
pub mod fns {
    use super::*;
    pub type CreateStatus = unsafe extern "C" fn(code: OrtErrorCode, msg: *const c_char) -> *mut OrtStatus;
    pub type GetErrorCode = unsafe extern "C" fn(status: *const OrtStatus) -> OrtErrorCode;
    pub type GetErrorMessage = unsafe extern "C" fn(status: *const OrtStatus) -> *const c_char;
    pub type GetTensorMutableData = unsafe extern "C" fn(value: *mut OrtValue, out: *mut *mut c_void) -> *mut OrtStatus;
    pub type CastTypeInfoToTensorInfo = unsafe extern "C" fn(
        type_info: *const OrtTypeInfo,
        out: *mut *const OrtTensorTypeAndShapeInfo,
    ) -> *mut OrtStatus;
    pub type GetTensorElementType = unsafe extern "C" fn(
        info: *const OrtTensorTypeAndShapeInfo,
        out: *mut ONNXTensorElementDataType,
    ) -> *mut OrtStatus;
    pub type GetDimensionsCount =
        unsafe extern "C" fn(info: *const OrtTensorTypeAndShapeInfo, out: *mut usize) -> *mut OrtStatus;
    pub type GetDimensions =
        unsafe extern "C" fn(info: *const OrtTensorTypeAndShapeInfo, dims: *mut i64, n: usize) -> *mut OrtStatus;
    pub type GetTensorTypeAndShape =
        unsafe extern "C" fn(value: *const OrtValue, out: *mut *mut OrtTensorTypeAndShapeInfo) -> *mut OrtStatus;
    pub type KernelContext_GetInputCount =
        unsafe extern "C" fn(ctx: *const OrtKernelContext, out: *mut usize) -> *mut OrtStatus;
    pub type KernelContext_GetOutputCount =
        unsafe extern "C" fn(ctx: *const OrtKernelContext, out: *mut usize) -> *mut OrtStatus;
    pub type KernelContext_GetInput =
        unsafe extern "C" fn(ctx: *const OrtKernelContext, index: usize, out: *mut *const OrtValue) -> *mut OrtStatus;
    pub type KernelContext_GetOutput = unsafe extern "C" fn(
        ctx: *mut OrtKernelContext,
        index: usize,
        dims: *const i64,
        n: usize,
        out: *mut *mut OrtValue,
    ) -> *mut OrtStatus;
    pub type ReleaseStatus = unsafe extern "C" fn(status: *mut OrtStatus);
    pub type ReleaseMemoryInfo = unsafe extern "C" fn(info: *mut OrtMemoryInfo);
    pub type ReleaseTensorTypeAndShapeInfo = unsafe extern "C" fn(info: *mut OrtTensorTypeAndShapeInfo);
    pub type KernelContext_GetGPUComputeStream =
        unsafe extern "C" fn(ctx: *const OrtKernelContext, out: *mut *mut c_void) -> *mut OrtStatus;
    pub type Logger_LogMessage = unsafe extern "C" fn(
        logger: *const OrtLogger,
        severity: OrtLoggingLevel,
        message: *const c_char,
        file: *const c_char,
        line: c_int,
        func: *const c_char,
    ) -> *mut OrtStatus;
    pub type Logger_GetLoggingSeverityLevel =
        unsafe extern "C" fn(logger: *const OrtLogger, out: *mut OrtLoggingLevel) -> *mut OrtStatus;
    pub type ReadOpAttr = unsafe extern "C" fn(
        attr: *const OrtOpAttr,
        ty: OrtOpAttrType,
        data: *mut c_void,
        len: usize,
        out: *mut usize,
    ) -> *mut OrtStatus;
    pub type GetValueInfoName =
        unsafe extern "C" fn(info: *const OrtValueInfo, out: *mut *const c_char) -> *mut OrtStatus;
    pub type GetValueInfoTypeInfo =
        unsafe extern "C" fn(info: *const OrtValueInfo, out: *mut *const OrtTypeInfo) -> *mut OrtStatus;
    pub type CreateKeyValuePairs = unsafe extern "C" fn(out: *mut *mut OrtKeyValuePairs);
    pub type AddKeyValuePair =
        unsafe extern "C" fn(kvps: *mut OrtKeyValuePairs, key: *const c_char, value: *const c_char);
    pub type GetKeyValue = unsafe extern "C" fn(kvps: *const OrtKeyValuePairs, key: *const c_char) -> *const c_char;
    pub type GetKeyValuePairs = unsafe extern "C" fn(
        kvps: *const OrtKeyValuePairs,
        keys: *mut *const *const c_char,
        values: *mut *const *const c_char,
        n: *mut usize,
    );
    pub type ReleaseKeyValuePairs = unsafe extern "C" fn(kvps: *mut OrtKeyValuePairs);
    pub type HardwareDevice_Type = unsafe extern "C" fn(device: *const OrtHardwareDevice) -> OrtHardwareDeviceType;
    pub type HardwareDevice_VendorId = unsafe extern "C" fn(device: *const OrtHardwareDevice) -> u32;
    pub type HardwareDevice_Metadata =
        unsafe extern "C" fn(device: *const OrtHardwareDevice) -> *const OrtKeyValuePairs;
    pub type GetEpApi = unsafe extern "C" fn() -> *const OrtEpApi;
    pub type GetTensorSizeInBytes = unsafe extern "C" fn(value: *const OrtValue, out: *mut usize) -> *mut OrtStatus;
    pub type CreateMemoryInfo_V2 = unsafe extern "C" fn(
        name: *const c_char,
        device_type: OrtMemoryInfoDeviceType,
        vendor_id: u32,
        device_id: i32,
        mem_type: OrtDeviceMemoryType,
        alignment: usize,
        allocator_type: OrtAllocatorType,
        out: *mut *mut OrtMemoryInfo,
    ) -> *mut OrtStatus;
    pub type ValueInfo_GetInitializerValue =
        unsafe extern "C" fn(info: *const OrtValueInfo, out: *mut *const OrtValue) -> *mut OrtStatus;
    pub type ValueInfo_IsConstantInitializer =
        unsafe extern "C" fn(info: *const OrtValueInfo, out: *mut bool) -> *mut OrtStatus;
    pub type Graph_GetNumInitializers = unsafe extern "C" fn(graph: *const OrtGraph, out: *mut usize) -> *mut OrtStatus;
    pub type Graph_GetInitializers =
        unsafe extern "C" fn(graph: *const OrtGraph, out: *mut *const OrtValueInfo, n: usize) -> *mut OrtStatus;
    pub type Graph_GetNumNodes = unsafe extern "C" fn(graph: *const OrtGraph, out: *mut usize) -> *mut OrtStatus;
    pub type Graph_GetNodes =
        unsafe extern "C" fn(graph: *const OrtGraph, out: *mut *const OrtNode, n: usize) -> *mut OrtStatus;
    pub type Node_GetName = unsafe extern "C" fn(node: *const OrtNode, out: *mut *const c_char) -> *mut OrtStatus;
    pub type Node_GetOperatorType =
        unsafe extern "C" fn(node: *const OrtNode, out: *mut *const c_char) -> *mut OrtStatus;
    pub type Node_GetDomain = unsafe extern "C" fn(node: *const OrtNode, out: *mut *const c_char) -> *mut OrtStatus;
    pub type Node_GetNumInputs = unsafe extern "C" fn(node: *const OrtNode, out: *mut usize) -> *mut OrtStatus;
    pub type Node_GetInputs =
        unsafe extern "C" fn(node: *const OrtNode, out: *mut *const OrtValueInfo, n: usize) -> *mut OrtStatus;
    pub type Node_GetNumOutputs = unsafe extern "C" fn(node: *const OrtNode, out: *mut usize) -> *mut OrtStatus;
    pub type Node_GetOutputs =
        unsafe extern "C" fn(node: *const OrtNode, out: *mut *const OrtValueInfo, n: usize) -> *mut OrtStatus;
    pub type Node_GetAttributeByName =
        unsafe extern "C" fn(node: *const OrtNode, name: *const c_char, out: *mut *const OrtOpAttr) -> *mut OrtStatus;
    pub type GetTensorData = unsafe extern "C" fn(value: *const OrtValue, out: *mut *const c_void) -> *mut OrtStatus;
    pub type GetSessionOptionsConfigEntries =
        unsafe extern "C" fn(options: *const OrtSessionOptions, out: *mut *mut OrtKeyValuePairs) -> *mut OrtStatus;
    pub type SyncStream_GetHandle = unsafe extern "C" fn(stream: *mut OrtSyncStream) -> *mut c_void;
}

#[repr(C)]
pub struct OrtApi {
    // ---- 1.1 (the first API) ------------------------------
    /* 0 */
    pub CreateStatus: Option<fns::CreateStatus>,
    /* 1 */ pub GetErrorCode: Option<fns::GetErrorCode>,
    /* 2 */ pub GetErrorMessage: Option<fns::GetErrorMessage>,
    /* 3 */ pub CreateEnv: Slot,
    /* 4 */ pub CreateEnvWithCustomLogger: Slot,
    /* 5 */ pub EnableTelemetryEvents: Slot,
    /* 6 */ pub DisableTelemetryEvents: Slot,
    /* 7 */ pub CreateSession: Slot,
    /* 8 */ pub CreateSessionFromArray: Slot,
    /* 9 */ pub Run: Slot,
    /* 10 */ pub CreateSessionOptions: Slot,
    /* 11 */ pub SetOptimizedModelFilePath: Slot,
    /* 12 */ pub CloneSessionOptions: Slot,
    /* 13 */ pub SetSessionExecutionMode: Slot,
    /* 14 */ pub EnableProfiling: Slot,
    /* 15 */ pub DisableProfiling: Slot,
    /* 16 */ pub EnableMemPattern: Slot,
    /* 17 */ pub DisableMemPattern: Slot,
    /* 18 */ pub EnableCpuMemArena: Slot,
    /* 19 */ pub DisableCpuMemArena: Slot,
    /* 20 */ pub SetSessionLogId: Slot,
    /* 21 */ pub SetSessionLogVerbosityLevel: Slot,
    /* 22 */ pub SetSessionLogSeverityLevel: Slot,
    /* 23 */ pub SetSessionGraphOptimizationLevel: Slot,
    /* 24 */ pub SetIntraOpNumThreads: Slot,
    /* 25 */ pub SetInterOpNumThreads: Slot,
    /* 26 */ pub CreateCustomOpDomain: Slot,
    /* 27 */ pub CustomOpDomain_Add: Slot,
    /* 28 */ pub AddCustomOpDomain: Slot,
    /* 29 */ pub RegisterCustomOpsLibrary: Slot,
    /* 30 */ pub SessionGetInputCount: Slot,
    /* 31 */ pub SessionGetOutputCount: Slot,
    /* 32 */ pub SessionGetOverridableInitializerCount: Slot,
    /* 33 */ pub SessionGetInputTypeInfo: Slot,
    /* 34 */ pub SessionGetOutputTypeInfo: Slot,
    /* 35 */ pub SessionGetOverridableInitializerTypeInfo: Slot,
    /* 36 */ pub SessionGetInputName: Slot,
    /* 37 */ pub SessionGetOutputName: Slot,
    /* 38 */ pub SessionGetOverridableInitializerName: Slot,
    /* 39 */ pub CreateRunOptions: Slot,
    /* 40 */ pub RunOptionsSetRunLogVerbosityLevel: Slot,
    /* 41 */ pub RunOptionsSetRunLogSeverityLevel: Slot,
    /* 42 */ pub RunOptionsSetRunTag: Slot,
    /* 43 */ pub RunOptionsGetRunLogVerbosityLevel: Slot,
    /* 44 */ pub RunOptionsGetRunLogSeverityLevel: Slot,
    /* 45 */ pub RunOptionsGetRunTag: Slot,
    /* 46 */ pub RunOptionsSetTerminate: Slot,
    /* 47 */ pub RunOptionsUnsetTerminate: Slot,
    /* 48 */ pub CreateTensorAsOrtValue: Slot,
    /* 49 */ pub CreateTensorWithDataAsOrtValue: Slot,
    /* 50 */ pub IsTensor: Slot,
    /* 51 */ pub GetTensorMutableData: Option<fns::GetTensorMutableData>,
    /* 52 */ pub FillStringTensor: Slot,
    /* 53 */ pub GetStringTensorDataLength: Slot,
    /* 54 */ pub GetStringTensorContent: Slot,
    /* 55 */ pub CastTypeInfoToTensorInfo: Option<fns::CastTypeInfoToTensorInfo>,
    /* 56 */ pub GetOnnxTypeFromTypeInfo: Slot,
    /* 57 */ pub CreateTensorTypeAndShapeInfo: Slot,
    /* 58 */ pub SetTensorElementType: Slot,
    /* 59 */ pub SetDimensions: Slot,
    /* 60 */ pub GetTensorElementType: Option<fns::GetTensorElementType>,
    /* 61 */ pub GetDimensionsCount: Option<fns::GetDimensionsCount>,
    /* 62 */ pub GetDimensions: Option<fns::GetDimensions>,
    /* 63 */ pub GetSymbolicDimensions: Slot,
    /* 64 */ pub GetTensorShapeElementCount: Slot,
    /* 65 */ pub GetTensorTypeAndShape: Option<fns::GetTensorTypeAndShape>,
    /* 66 */ pub GetTypeInfo: Slot,
    /* 67 */ pub GetValueType: Slot,
    /* 68 */ pub CreateMemoryInfo: Slot,
    /* 69 */ pub CreateCpuMemoryInfo: Slot,
    /* 70 */ pub CompareMemoryInfo: Slot,
    /* 71 */ pub MemoryInfoGetName: Slot,
    /* 72 */ pub MemoryInfoGetId: Slot,
    /* 73 */ pub MemoryInfoGetMemType: Slot,
    /* 74 */ pub MemoryInfoGetType: Slot,
    /* 75 */ pub AllocatorAlloc: Slot,
    /* 76 */ pub AllocatorFree: Slot,
    /* 77 */ pub AllocatorGetInfo: Slot,
    /* 78 */ pub GetAllocatorWithDefaultOptions: Slot,
    /* 79 */ pub AddFreeDimensionOverride: Slot,
    /* 80 */ pub GetValue: Slot,
    /* 81 */ pub GetValueCount: Slot,
    /* 82 */ pub CreateValue: Slot,
    /* 83 */ pub CreateOpaqueValue: Slot,
    /* 84 */ pub GetOpaqueValue: Slot,
    /* 85 */ pub KernelInfoGetAttribute_float: Slot,
    /* 86 */ pub KernelInfoGetAttribute_int64: Slot,
    /* 87 */ pub KernelInfoGetAttribute_string: Slot,
    /* 88 */ pub KernelContext_GetInputCount: Option<fns::KernelContext_GetInputCount>,
    /* 89 */ pub KernelContext_GetOutputCount: Option<fns::KernelContext_GetOutputCount>,
    /* 90 */ pub KernelContext_GetInput: Option<fns::KernelContext_GetInput>,
    /* 91 */ pub KernelContext_GetOutput: Option<fns::KernelContext_GetOutput>,
    /* 92 */ pub ReleaseEnv: Slot,
    /* 93 */ pub ReleaseStatus: Option<fns::ReleaseStatus>,
    /* 94 */ pub ReleaseMemoryInfo: Option<fns::ReleaseMemoryInfo>,
    /* 95 */ pub ReleaseSession: Slot,
    /* 96 */ pub ReleaseValue: Slot,
    /* 97 */ pub ReleaseRunOptions: Slot,
    /* 98 */ pub ReleaseTypeInfo: Slot,
    /* 99 */ pub ReleaseTensorTypeAndShapeInfo: Option<fns::ReleaseTensorTypeAndShapeInfo>,
    /* 100 */ pub ReleaseSessionOptions: Slot,
    /* 101 */ pub ReleaseCustomOpDomain: Slot,
    // ---- added in 1.2 ----------------------------------------
    /* 102 */
    pub GetDenotationFromTypeInfo: Slot,
    /* 103 */ pub CastTypeInfoToMapTypeInfo: Slot,
    /* 104 */ pub CastTypeInfoToSequenceTypeInfo: Slot,
    /* 105 */ pub GetMapKeyType: Slot,
    /* 106 */ pub GetMapValueType: Slot,
    /* 107 */ pub GetSequenceElementType: Slot,
    /* 108 */ pub ReleaseMapTypeInfo: Slot,
    /* 109 */ pub ReleaseSequenceTypeInfo: Slot,
    /* 110 */ pub SessionEndProfiling: Slot,
    /* 111 */ pub SessionGetModelMetadata: Slot,
    /* 112 */ pub ModelMetadataGetProducerName: Slot,
    /* 113 */ pub ModelMetadataGetGraphName: Slot,
    /* 114 */ pub ModelMetadataGetDomain: Slot,
    /* 115 */ pub ModelMetadataGetDescription: Slot,
    /* 116 */ pub ModelMetadataLookupCustomMetadataMap: Slot,
    /* 117 */ pub ModelMetadataGetVersion: Slot,
    /* 118 */ pub ReleaseModelMetadata: Slot,
    // ---- added in 1.3 ----------------------------------------
    /* 119 */
    pub CreateEnvWithGlobalThreadPools: Slot,
    /* 120 */ pub DisablePerSessionThreads: Slot,
    /* 121 */ pub CreateThreadingOptions: Slot,
    /* 122 */ pub ReleaseThreadingOptions: Slot,
    /* 123 */ pub ModelMetadataGetCustomMetadataMapKeys: Slot,
    /* 124 */ pub AddFreeDimensionOverrideByName: Slot,
    // ---- added in 1.4 ----------------------------------------
    /* 125 */ pub GetAvailableProviders: Slot,
    /* 126 */ pub ReleaseAvailableProviders: Slot,
    // ---- added in 1.5 ----------------------------------------
    /* 127 */
    pub GetStringTensorElementLength: Slot,
    /* 128 */ pub GetStringTensorElement: Slot,
    /* 129 */ pub FillStringTensorElement: Slot,
    /* 130 */ pub AddSessionConfigEntry: Slot,
    /* 131 */ pub CreateAllocator: Slot,
    /* 132 */ pub ReleaseAllocator: Slot,
    /* 133 */ pub RunWithBinding: Slot,
    /* 134 */ pub CreateIoBinding: Slot,
    /* 135 */ pub ReleaseIoBinding: Slot,
    /* 136 */ pub BindInput: Slot,
    /* 137 */ pub BindOutput: Slot,
    /* 138 */ pub BindOutputToDevice: Slot,
    /* 139 */ pub GetBoundOutputNames: Slot,
    /* 140 */ pub GetBoundOutputValues: Slot,
    /* 141 */ pub ClearBoundInputs: Slot,
    /* 142 */ pub ClearBoundOutputs: Slot,
    /* 143 */ pub TensorAt: Slot,
    /* 144 */ pub CreateAndRegisterAllocator: Slot,
    /* 145 */ pub SetLanguageProjection: Slot,
    /* 146 */ pub SessionGetProfilingStartTimeNs: Slot,
    /* 147 */ pub SetGlobalIntraOpNumThreads: Slot,
    /* 148 */ pub SetGlobalInterOpNumThreads: Slot,
    /* 149 */ pub SetGlobalSpinControl: Slot,
    // ---- added in 1.6 ----------------------------------------
    /* 150 */ pub AddInitializer: Slot,
    /* 151 */ pub CreateEnvWithCustomLoggerAndGlobalThreadPools: Slot,
    /* 152 */ pub SessionOptionsAppendExecutionProvider_CUDA: Slot,
    /* 153 */ pub SessionOptionsAppendExecutionProvider_ROCM: Slot,
    /* 154 */ pub SessionOptionsAppendExecutionProvider_OpenVINO: Slot,
    /* 155 */ pub SetGlobalDenormalAsZero: Slot,
    /* 156 */ pub CreateArenaCfg: Slot,
    /* 157 */ pub ReleaseArenaCfg: Slot,
    // ---- added in 1.7 ----------------------------------------
    /* 158 */
    pub ModelMetadataGetGraphDescription: Slot,
    /* 159 */ pub SessionOptionsAppendExecutionProvider_TensorRT: Slot,
    /* 160 */ pub SetCurrentGpuDeviceId: Slot,
    /* 161 */ pub GetCurrentGpuDeviceId: Slot,
    // ---- added in 1.8 ----------------------------------------
    /* 162 */
    pub KernelInfoGetAttributeArray_float: Slot,
    /* 163 */ pub KernelInfoGetAttributeArray_int64: Slot,
    /* 164 */ pub CreateArenaCfgV2: Slot,
    /* 165 */ pub AddRunConfigEntry: Slot,
    /* 166 */ pub CreatePrepackedWeightsContainer: Slot,
    /* 167 */ pub ReleasePrepackedWeightsContainer: Slot,
    /* 168 */ pub CreateSessionWithPrepackedWeightsContainer: Slot,
    /* 169 */ pub CreateSessionFromArrayWithPrepackedWeightsContainer: Slot,
    // ---- added in 1.9 ----------------------------------------
    /* 170 */
    pub SessionOptionsAppendExecutionProvider_TensorRT_V2: Slot,
    /* 171 */ pub CreateTensorRTProviderOptions: Slot,
    /* 172 */ pub UpdateTensorRTProviderOptions: Slot,
    /* 173 */ pub GetTensorRTProviderOptionsAsString: Slot,
    /* 174 */ pub ReleaseTensorRTProviderOptions: Slot,
    /* 175 */ pub EnableOrtCustomOps: Slot,
    /* 176 */ pub RegisterAllocator: Slot,
    /* 177 */ pub UnregisterAllocator: Slot,
    /* 178 */ pub IsSparseTensor: Slot,
    /* 179 */ pub CreateSparseTensorAsOrtValue: Slot,
    /* 180 */ pub FillSparseTensorCoo: Slot,
    /* 181 */ pub FillSparseTensorCsr: Slot,
    /* 182 */ pub FillSparseTensorBlockSparse: Slot,
    /* 183 */ pub CreateSparseTensorWithValuesAsOrtValue: Slot,
    /* 184 */ pub UseCooIndices: Slot,
    /* 185 */ pub UseCsrIndices: Slot,
    /* 186 */ pub UseBlockSparseIndices: Slot,
    /* 187 */ pub GetSparseTensorFormat: Slot,
    /* 188 */ pub GetSparseTensorValuesTypeAndShape: Slot,
    /* 189 */ pub GetSparseTensorValues: Slot,
    /* 190 */ pub GetSparseTensorIndicesTypeShape: Slot,
    /* 191 */ pub GetSparseTensorIndices: Slot,
    // ---- added in 1.10 ----------------------------------------
    /* 192 */ pub HasValue: Slot,
    /* 193 */ pub KernelContext_GetGPUComputeStream: Option<fns::KernelContext_GetGPUComputeStream>,
    /* 194 */ pub GetTensorMemoryInfo: Slot,
    /* 195 */ pub GetExecutionProviderApi: Slot,
    /* 196 */ pub SessionOptionsSetCustomCreateThreadFn: Slot,
    /* 197 */ pub SessionOptionsSetCustomThreadCreationOptions: Slot,
    /* 198 */ pub SessionOptionsSetCustomJoinThreadFn: Slot,
    /* 199 */ pub SetGlobalCustomCreateThreadFn: Slot,
    /* 200 */ pub SetGlobalCustomThreadCreationOptions: Slot,
    /* 201 */ pub SetGlobalCustomJoinThreadFn: Slot,
    /* 202 */ pub SynchronizeBoundInputs: Slot,
    /* 203 */ pub SynchronizeBoundOutputs: Slot,
    // ---- added in 1.11 ----------------------------------------
    /* 204 */
    pub SessionOptionsAppendExecutionProvider_CUDA_V2: Slot,
    /* 205 */ pub CreateCUDAProviderOptions: Slot,
    /* 206 */ pub UpdateCUDAProviderOptions: Slot,
    /* 207 */ pub GetCUDAProviderOptionsAsString: Slot,
    /* 208 */ pub ReleaseCUDAProviderOptions: Slot,
    /* 209 */ pub SessionOptionsAppendExecutionProvider_MIGraphX: Slot,
    // ---- added in 1.12 ----------------------------------------
    /* 210 */
    pub AddExternalInitializers: Slot,
    /* 211 */ pub CreateOpAttr: Slot,
    /* 212 */ pub ReleaseOpAttr: Slot,
    /* 213 */ pub CreateOp: Slot,
    /* 214 */ pub InvokeOp: Slot,
    /* 215 */ pub ReleaseOp: Slot,
    /* 216 */ pub SessionOptionsAppendExecutionProvider: Slot,
    /* 217 */ pub CopyKernelInfo: Slot,
    /* 218 */ pub ReleaseKernelInfo: Slot,
    // ---- added in 1.13 ----------------------------------------
    /* 219 */ pub GetTrainingApi: Slot,
    /* 220 */ pub SessionOptionsAppendExecutionProvider_CANN: Slot,
    /* 221 */ pub CreateCANNProviderOptions: Slot,
    /* 222 */ pub UpdateCANNProviderOptions: Slot,
    /* 223 */ pub GetCANNProviderOptionsAsString: Slot,
    /* 224 */ pub ReleaseCANNProviderOptions: Slot,
    // ---- added in 1.14 ----------------------------------------
    /* 225 */
    pub MemoryInfoGetDeviceType: Slot,
    /* 226 */ pub UpdateEnvWithCustomLogLevel: Slot,
    /* 227 */ pub SetGlobalIntraOpThreadAffinity: Slot,
    /* 228 */ pub RegisterCustomOpsLibrary_V2: Slot,
    /* 229 */ pub RegisterCustomOpsUsingFunction: Slot,
    /* 230 */ pub KernelInfo_GetInputCount: Slot,
    /* 231 */ pub KernelInfo_GetOutputCount: Slot,
    /* 232 */ pub KernelInfo_GetInputName: Slot,
    /* 233 */ pub KernelInfo_GetOutputName: Slot,
    /* 234 */ pub KernelInfo_GetInputTypeInfo: Slot,
    /* 235 */ pub KernelInfo_GetOutputTypeInfo: Slot,
    /* 236 */ pub KernelInfoGetAttribute_tensor: Slot,
    /* 237 */ pub HasSessionConfigEntry: Slot,
    /* 238 */ pub GetSessionConfigEntry: Slot,
    // ---- added in 1.15 ----------------------------------------
    /* 239 */
    pub SessionOptionsAppendExecutionProvider_Dnnl: Slot,
    /* 240 */ pub CreateDnnlProviderOptions: Slot,
    /* 241 */ pub UpdateDnnlProviderOptions: Slot,
    /* 242 */ pub GetDnnlProviderOptionsAsString: Slot,
    /* 243 */ pub ReleaseDnnlProviderOptions: Slot,
    /* 244 */ pub KernelInfo_GetNodeName: Slot,
    /* 245 */ pub KernelInfo_GetLogger: Slot,
    /* 246 */ pub KernelContext_GetLogger: Slot,
    /* 247 */ pub Logger_LogMessage: Option<fns::Logger_LogMessage>,
    /* 248 */ pub Logger_GetLoggingSeverityLevel: Option<fns::Logger_GetLoggingSeverityLevel>,
    /* 249 */ pub KernelInfoGetConstantInput_tensor: Slot,
    /* 250 */ pub CastTypeInfoToOptionalTypeInfo: Slot,
    /* 251 */ pub GetOptionalContainedTypeInfo: Slot,
    /* 252 */ pub GetResizedStringTensorElementBuffer: Slot,
    /* 253 */ pub KernelContext_GetAllocator: Slot,
    /* 254 */ pub GetBuildInfoString: Slot,
    // ---- added in 1.16 ----------------------------------------
    /* 255 */
    pub CreateROCMProviderOptions: Slot,
    /* 256 */ pub UpdateROCMProviderOptions: Slot,
    /* 257 */ pub GetROCMProviderOptionsAsString: Slot,
    /* 258 */ pub ReleaseROCMProviderOptions: Slot,
    /* 259 */ pub CreateAndRegisterAllocatorV2: Slot,
    /* 260 */ pub RunAsync: Slot,
    /* 261 */ pub UpdateTensorRTProviderOptionsWithValue: Slot,
    /* 262 */ pub GetTensorRTProviderOptionsByName: Slot,
    /* 263 */ pub UpdateCUDAProviderOptionsWithValue: Slot,
    /* 264 */ pub GetCUDAProviderOptionsByName: Slot,
    /* 265 */ pub KernelContext_GetResource: Slot,
    // ---- added in 1.17 ----------------------------------------
    /* 266 */
    pub SetUserLoggingFunction: Slot,
    /* 267 */ pub ShapeInferContext_GetInputCount: Slot,
    /* 268 */ pub ShapeInferContext_GetInputTypeShape: Slot,
    /* 269 */ pub ShapeInferContext_GetAttribute: Slot,
    /* 270 */ pub ShapeInferContext_SetOutputTypeShape: Slot,
    /* 271 */ pub SetSymbolicDimensions: Slot,
    /* 272 */ pub ReadOpAttr: Option<fns::ReadOpAttr>,
    /* 273 */ pub SetDeterministicCompute: Slot,
    /* 274 */ pub KernelContext_ParallelFor: Slot,
    /* 275 */ pub SessionOptionsAppendExecutionProvider_OpenVINO_V2: Slot,
    // ---- added in 1.18 ----------------------------------------
    /* 276 */
    pub SessionOptionsAppendExecutionProvider_VitisAI: Slot,
    /* 277 */ pub KernelContext_GetScratchBuffer: Slot,
    /* 278 */ pub KernelInfoGetAllocator: Slot,
    /* 279 */ pub AddExternalInitializersFromFilesInMemory: Slot,
    // ---- added in 1.20 ----------------------------------------
    /* 280 */ pub CreateLoraAdapter: Slot,
    /* 281 */ pub CreateLoraAdapterFromArray: Slot,
    /* 282 */ pub ReleaseLoraAdapter: Slot,
    /* 283 */ pub RunOptionsAddActiveLoraAdapter: Slot,
    /* 284 */ pub SetEpDynamicOptions: Slot,
    // ---- added in 1.22 ----------------------------------------
    /* 285 */ pub ReleaseValueInfo: Slot,
    /* 286 */ pub ReleaseNode: Slot,
    /* 287 */ pub ReleaseGraph: Slot,
    /* 288 */ pub ReleaseModel: Slot,
    /* 289 */ pub GetValueInfoName: Option<fns::GetValueInfoName>,
    /* 290 */ pub GetValueInfoTypeInfo: Option<fns::GetValueInfoTypeInfo>,
    /* 291 */ pub GetModelEditorApi: Slot,
    /* 292 */ pub CreateTensorWithDataAndDeleterAsOrtValue: Slot,
    /* 293 */ pub SessionOptionsSetLoadCancellationFlag: Slot,
    /* 294 */ pub GetCompileApi: Slot,
    /* 295 */ pub CreateKeyValuePairs: Option<fns::CreateKeyValuePairs>,
    /* 296 */ pub AddKeyValuePair: Option<fns::AddKeyValuePair>,
    /* 297 */ pub GetKeyValue: Option<fns::GetKeyValue>,
    /* 298 */ pub GetKeyValuePairs: Option<fns::GetKeyValuePairs>,
    /* 299 */ pub RemoveKeyValuePair: Slot,
    /* 300 */ pub ReleaseKeyValuePairs: Option<fns::ReleaseKeyValuePairs>,
    /* 301 */ pub RegisterExecutionProviderLibrary: Slot,
    /* 302 */ pub UnregisterExecutionProviderLibrary: Slot,
    /* 303 */ pub GetEpDevices: Slot,
    /* 304 */ pub SessionOptionsAppendExecutionProvider_V2: Slot,
    /* 305 */ pub SessionOptionsSetEpSelectionPolicy: Slot,
    /* 306 */ pub SessionOptionsSetEpSelectionPolicyDelegate: Slot,
    /* 307 */ pub HardwareDevice_Type: Option<fns::HardwareDevice_Type>,
    /* 308 */ pub HardwareDevice_VendorId: Option<fns::HardwareDevice_VendorId>,
    /* 309 */ pub HardwareDevice_Vendor: Slot,
    /* 310 */ pub HardwareDevice_DeviceId: Slot,
    /* 311 */ pub HardwareDevice_Metadata: Option<fns::HardwareDevice_Metadata>,
    /* 312 */ pub EpDevice_EpName: Slot,
    /* 313 */ pub EpDevice_EpVendor: Slot,
    /* 314 */ pub EpDevice_EpMetadata: Slot,
    /* 315 */ pub EpDevice_EpOptions: Slot,
    /* 316 */ pub EpDevice_Device: Slot,
    /* 317 */ pub GetEpApi: Option<fns::GetEpApi>,
    // ---- added in 1.23 ----------------------------------------
    /* 318 */
    pub GetTensorSizeInBytes: Option<fns::GetTensorSizeInBytes>,
    /* 319 */ pub AllocatorGetStats: Slot,
    /* 320 */ pub CreateMemoryInfo_V2: Option<fns::CreateMemoryInfo_V2>,
    /* 321 */ pub MemoryInfoGetDeviceMemType: Slot,
    /* 322 */ pub MemoryInfoGetVendorId: Slot,
    /* 323 */ pub ValueInfo_GetValueProducer: Slot,
    /* 324 */ pub ValueInfo_GetValueNumConsumers: Slot,
    /* 325 */ pub ValueInfo_GetValueConsumers: Slot,
    /* 326 */ pub ValueInfo_GetInitializerValue: Option<fns::ValueInfo_GetInitializerValue>,
    /* 327 */ pub ValueInfo_GetExternalInitializerInfo: Slot,
    /* 328 */ pub ValueInfo_IsRequiredGraphInput: Slot,
    /* 329 */ pub ValueInfo_IsOptionalGraphInput: Slot,
    /* 330 */ pub ValueInfo_IsGraphOutput: Slot,
    /* 331 */ pub ValueInfo_IsConstantInitializer: Option<fns::ValueInfo_IsConstantInitializer>,
    /* 332 */ pub ValueInfo_IsFromOuterScope: Slot,
    /* 333 */ pub Graph_GetName: Slot,
    /* 334 */ pub Graph_GetModelPath: Slot,
    /* 335 */ pub Graph_GetOnnxIRVersion: Slot,
    /* 336 */ pub Graph_GetNumOperatorSets: Slot,
    /* 337 */ pub Graph_GetOperatorSets: Slot,
    /* 338 */ pub Graph_GetNumInputs: Slot,
    /* 339 */ pub Graph_GetInputs: Slot,
    /* 340 */ pub Graph_GetNumOutputs: Slot,
    /* 341 */ pub Graph_GetOutputs: Slot,
    /* 342 */ pub Graph_GetNumInitializers: Option<fns::Graph_GetNumInitializers>,
    /* 343 */ pub Graph_GetInitializers: Option<fns::Graph_GetInitializers>,
    /* 344 */ pub Graph_GetNumNodes: Option<fns::Graph_GetNumNodes>,
    /* 345 */ pub Graph_GetNodes: Option<fns::Graph_GetNodes>,
    /* 346 */ pub Graph_GetParentNode: Slot,
    /* 347 */ pub Graph_GetGraphView: Slot,
    /* 348 */ pub Node_GetId: Slot,
    /* 349 */ pub Node_GetName: Option<fns::Node_GetName>,
    /* 350 */ pub Node_GetOperatorType: Option<fns::Node_GetOperatorType>,
    /* 351 */ pub Node_GetDomain: Option<fns::Node_GetDomain>,
    /* 352 */ pub Node_GetSinceVersion: Slot,
    /* 353 */ pub Node_GetNumInputs: Option<fns::Node_GetNumInputs>,
    /* 354 */ pub Node_GetInputs: Option<fns::Node_GetInputs>,
    /* 355 */ pub Node_GetNumOutputs: Option<fns::Node_GetNumOutputs>,
    /* 356 */ pub Node_GetOutputs: Option<fns::Node_GetOutputs>,
    /* 357 */ pub Node_GetNumImplicitInputs: Slot,
    /* 358 */ pub Node_GetImplicitInputs: Slot,
    /* 359 */ pub Node_GetNumAttributes: Slot,
    /* 360 */ pub Node_GetAttributes: Slot,
    /* 361 */ pub Node_GetAttributeByName: Option<fns::Node_GetAttributeByName>,
    /* 362 */ pub OpAttr_GetTensorAttributeAsOrtValue: Slot,
    /* 363 */ pub OpAttr_GetType: Slot,
    /* 364 */ pub OpAttr_GetName: Slot,
    /* 365 */ pub Node_GetNumSubgraphs: Slot,
    /* 366 */ pub Node_GetSubgraphs: Slot,
    /* 367 */ pub Node_GetGraph: Slot,
    /* 368 */ pub Node_GetEpName: Slot,
    /* 369 */ pub ReleaseExternalInitializerInfo: Slot,
    /* 370 */ pub ExternalInitializerInfo_GetFilePath: Slot,
    /* 371 */ pub ExternalInitializerInfo_GetFileOffset: Slot,
    /* 372 */ pub ExternalInitializerInfo_GetByteSize: Slot,
    /* 373 */ pub GetRunConfigEntry: Slot,
    /* 374 */ pub EpDevice_MemoryInfo: Slot,
    /* 375 */ pub CreateSharedAllocator: Slot,
    /* 376 */ pub GetSharedAllocator: Slot,
    /* 377 */ pub ReleaseSharedAllocator: Slot,
    /* 378 */ pub GetTensorData: Option<fns::GetTensorData>,
    /* 379 */ pub GetSessionOptionsConfigEntries: Option<fns::GetSessionOptionsConfigEntries>,
    /* 380 */ pub SessionGetMemoryInfoForInputs: Slot,
    /* 381 */ pub SessionGetMemoryInfoForOutputs: Slot,
    /* 382 */ pub SessionGetEpDeviceForInputs: Slot,
    /* 383 */ pub CreateSyncStreamForEpDevice: Slot,
    /* 384 */ pub SyncStream_GetHandle: Option<fns::SyncStream_GetHandle>,
    /* 385 */ pub ReleaseSyncStream: Slot,
    /* 386 */ pub CopyTensors: Slot,
    /* 387 */ pub Graph_GetModelMetadata: Slot,
    /* 388 */ pub GetModelCompatibilityForEpDevices: Slot,
    /* 389 */ pub CreateExternalInitializerInfo: Slot,
}
const _: () = {
    assert!(size_of::<OrtApi>() == 390 * 8);
    // ORT's own compile-time checks of where each version ends (onnxruntime_c_api.cc).
    assert!(offset_of!(OrtApi, ReleaseCustomOpDomain) == 101 * 8);
    assert!(offset_of!(OrtApi, ReleaseModelMetadata) == 118 * 8);
    assert!(offset_of!(OrtApi, AddFreeDimensionOverrideByName) == 124 * 8);
    assert!(offset_of!(OrtApi, ReleaseAvailableProviders) == 126 * 8);
    assert!(offset_of!(OrtApi, SetGlobalSpinControl) == 149 * 8);
    assert!(offset_of!(OrtApi, ReleaseArenaCfg) == 157 * 8);
    assert!(offset_of!(OrtApi, GetCurrentGpuDeviceId) == 161 * 8);
    assert!(offset_of!(OrtApi, CreateSessionFromArrayWithPrepackedWeightsContainer) == 169 * 8);
    assert!(offset_of!(OrtApi, GetSparseTensorIndices) == 191 * 8);
    assert!(offset_of!(OrtApi, SynchronizeBoundOutputs) == 203 * 8);
    assert!(offset_of!(OrtApi, SessionOptionsAppendExecutionProvider_MIGraphX) == 209 * 8);
    assert!(offset_of!(OrtApi, ReleaseKernelInfo) == 218 * 8);
    assert!(offset_of!(OrtApi, ReleaseCANNProviderOptions) == 224 * 8);
    assert!(offset_of!(OrtApi, GetSessionConfigEntry) == 238 * 8);
    assert!(offset_of!(OrtApi, GetBuildInfoString) == 254 * 8);
    assert!(offset_of!(OrtApi, KernelContext_GetResource) == 265 * 8);
    assert!(offset_of!(OrtApi, SessionOptionsAppendExecutionProvider_OpenVINO_V2) == 275 * 8);
    assert!(offset_of!(OrtApi, AddExternalInitializersFromFilesInMemory) == 279 * 8);
    assert!(offset_of!(OrtApi, SetEpDynamicOptions) == 284 * 8);
    assert!(offset_of!(OrtApi, GetEpApi) == 317 * 8);
    assert!(offset_of!(OrtApi, CreateExternalInitializerInfo) == 389 * 8);
    // Slots also read off the shipped wheels (docs/ORT_ABI.md).
    assert!(offset_of!(OrtApi, GetTensorMutableData) == 51 * 8);
    assert!(offset_of!(OrtApi, ReleaseStatus) == 93 * 8);
    assert!(offset_of!(OrtApi, Logger_LogMessage) == 247 * 8);
    assert!(offset_of!(OrtApi, CreateKeyValuePairs) == 295 * 8);
    assert!(offset_of!(OrtApi, HardwareDevice_Type) == 307 * 8);
    assert!(offset_of!(OrtApi, GetTensorSizeInBytes) == 318 * 8);
    assert!(offset_of!(OrtApi, CreateMemoryInfo_V2) == 320 * 8);
    assert!(offset_of!(OrtApi, GetTensorData) == 378 * 8);
    assert!(offset_of!(OrtApi, SyncStream_GetHandle) == 384 * 8);
    assert!(offset_of!(OrtApi, CopyTensors) == 386 * 8);
};
