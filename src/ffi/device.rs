//! `EpmDevice`: opening a device and asking what it is.

use std::ffi::c_char;

use crate::device::{self, Device, DeviceKind, DeviceSelect};
use crate::ffi::prelude::*;

/// An open device (a CUDA GPU or the host device). Streams, events and every
/// other object made from it keep it alive, so handles may be destroyed in any
/// order.
pub struct EpmDevice {
    _opaque: [u8; 0],
}
impl_handle!(EpmDevice => dyn Device, tag = 0x01);

/// Which implementation an `EpmDevice` is.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EpmDeviceKind {
    /// An NVIDIA GPU through the CUDA driver API.
    Cuda = 1,
    /// The host device: no GPU; "device memory" is host memory with a real
    /// memfd/mmap VMM, streams are worker threads.
    Host = 2,
}

/// Length of `EpmDeviceInfo::name`, including the terminating NUL.
pub const EPM_DEVICE_NAME_LEN: usize = 256;
/// Length of `EpmDeviceInfo::pci_bus_id`, including the terminating NUL.
pub const EPM_PCI_BUS_ID_LEN: usize = 32;

/// Static facts about a device, filled by `epm_device_get_info`.
///
/// Versioned by size: set `size = sizeof(EpmDeviceInfo)` before the call.
/// Fields are only ever added at the end.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EpmDeviceInfo {
    /// In: `sizeof(EpmDeviceInfo)` as the caller compiled it. Out: the number
    /// of bytes epmem filled (the smaller of that and its own size).
    pub size: usize,
    /// `EPM_DEVICE_KIND_CUDA` or `EPM_DEVICE_KIND_HOST`.
    pub kind: EpmDeviceKind,
    /// The ordinal the device was opened with.
    pub ordinal: u32,
    /// Total device memory in bytes (host device: physical RAM).
    pub total_memory: u64,
    /// VMM allocation granularity in bytes (2 MiB on the H200).
    pub granularity: u64,
    /// Compute capability (0.0 on the host device).
    pub compute_capability_major: u32,
    pub compute_capability_minor: u32,
    /// CUDA driver version, e.g. 13000 for 13.0 (0 on the host device).
    pub driver_version: u32,
    /// NUL-terminated UTF-8 name, e.g. "NVIDIA H200" (truncated to fit).
    pub name: [c_char; EPM_DEVICE_NAME_LEN],
    /// NUL-terminated PCI bus id "dddd:bb:dd.f"; "" when the device has none.
    pub pci_bus_id: [c_char; EPM_PCI_BUS_ID_LEN],
}

/// `sizeof(EpmDeviceInfo)` in its first published version (epmem 0.1): the
/// smallest `size` ever accepted. Frozen: it stays this number when fields
/// are appended (docs/ABI.md).
pub const EPM_DEVICE_INFO_SIZE_V1: usize = 336;
versioned!(EpmDeviceInfo, EPM_DEVICE_INFO_SIZE_V1);

fn fixed_str<const N: usize>(s: &str) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    // Truncate on a char boundary, leaving room for the NUL.
    let mut end = s.len().min(N - 1);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    for (o, b) in out.iter_mut().zip(s.as_bytes()[..end].iter()) {
        *o = *b as c_char;
    }
    out
}

fn info_of(dev: &dyn Device) -> EpmDeviceInfo {
    let i = dev.info();
    EpmDeviceInfo {
        size: std::mem::size_of::<EpmDeviceInfo>(),
        kind: match i.kind {
            DeviceKind::Cuda => EpmDeviceKind::Cuda,
            DeviceKind::Host => EpmDeviceKind::Host,
        },
        ordinal: i.ordinal,
        total_memory: i.total_mem,
        granularity: i.granularity as u64,
        compute_capability_major: i.compute_capability.0,
        compute_capability_minor: i.compute_capability.1,
        driver_version: i.driver_version,
        name: fixed_str(&i.name),
        pci_bus_id: fixed_str(i.pci_bus_id.as_deref().unwrap_or("")),
    }
}

fn open(select: DeviceSelect, ordinal: u32, out: OutParam<'_, *mut EpmDevice>) -> Result<()> {
    let dev = device::open(select, ordinal)?;
    out.set(handle::insert::<EpmDevice>(dev)?);
    Ok(())
}

/// Open device `ordinal` of the kind `EPM_DEVICE` names (auto|cuda|host;
/// unset means auto: CUDA if a driver and a GPU at `ordinal` exist, else the
/// host device, and the choice is logged at info level).
///
/// Ownership: on success `*out` is a new handle the caller destroys with
/// `epm_device_destroy`. Opening the same ordinal twice gives two independent
/// handles. NULL: `out` is NULL_POINTER. Threading: safe from any thread.
/// Errors: INVALID_CONFIG for an `EPM_DEVICE` other than auto, cuda or host
/// (the same rules as `epm_device_open_select`'s `select`); DEVICE_UNAVAILABLE when
/// `EPM_DEVICE=cuda` and there is no driver or no GPU at `ordinal`.
#[unsafe(no_mangle)]
pub extern "C" fn epm_device_open(ordinal: u32, out: *mut *mut EpmDevice) -> EpmStatus {
    ffi_boundary! {
        let out = try_out!(out);
        open(DeviceSelect::from_env()?, ordinal, out)
    }
}

/// Open device `ordinal` of the kind `select` names: exactly "auto", "cuda"
/// or "host", ASCII case-insensitive ("CUDA" is "cuda"); no aliases, no
/// spaces, not "". NULL means "read EPM_DEVICE", as `epm_device_open`.
///
/// Ownership: as `epm_device_open`; `select` is only read during the call.
/// Errors: INVALID_CONFIG for any other `select` (or `EPM_DEVICE` when
/// `select` is NULL); DEVICE_UNAVAILABLE as `epm_device_open`;
/// INVALID_ARGUMENT if `select` is not UTF-8. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_device_open_select(select: *const c_char, ordinal: u32, out: *mut *mut EpmDevice) -> EpmStatus {
    ffi_boundary! {
        let out = try_out!(out);
        let choice = if select.is_null() {
            DeviceSelect::from_env()?
        } else {
            let s = try_str!(select);
            DeviceSelect::parse(s).map_err(|_| {
                Error::new(
                    EpmStatus::InvalidConfig,
                    format!("select={s:?} is not one of \"auto\", \"cuda\", \"host\" (case-insensitive)"),
                )
            })?
        };
        open(choice, ordinal, out)
    }
}

/// Fill `*out` with the device's static facts.
///
/// The caller sets `out->size = sizeof(EpmDeviceInfo)` first; epmem fills
/// that many bytes at most and sets `out->size` to the number it filled
/// (a newer header's extra fields stay untouched). NULL: `dev` is
/// INVALID_HANDLE, `out` is NULL_POINTER. Errors: INVALID_ARGUMENT when
/// `out->size` is smaller than the first version of the struct. `*out` is
/// written only on success. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_device_get_info(dev: *mut EpmDevice, out: *mut EpmDeviceInfo) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let out = try_out!(out);
        write_versioned(out, info_of(&*dev), "out")
    }
}

/// Free and total device memory in bytes (`cuMemGetInfo`; on the host device,
/// available and total physical RAM).
///
/// NULL: `dev` is INVALID_HANDLE, `free_bytes`/`total_bytes` are
/// NULL_POINTER. Both are written only on success. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_device_mem_info(dev: *mut EpmDevice, free_bytes: *mut u64, total_bytes: *mut u64) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        let free_bytes = try_out!(free_bytes);
        let total_bytes = try_out!(total_bytes);
        let (free, total) = dev.mem_get_info()?;
        free_bytes.set(free);
        total_bytes.set(total);
        Ok(())
    }
}

/// Block until all work queued on every stream of the device has completed.
///
/// NULL: `dev` is INVALID_HANDLE. Errors: device errors (CUDA_ERROR,
/// CONTEXT_LOST). Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_device_synchronize(dev: *mut EpmDevice) -> EpmStatus {
    ffi_boundary! {
        let dev = try_handle!(dev);
        dev.synchronize()
    }
}

/// Destroy a device handle. The device itself closes when the last object
/// made from it (stream, event, ...) is destroyed too.
///
/// NULL is a no-op returning OK. Errors: INVALID_HANDLE for a destroyed,
/// wrong-typed or garbage handle (nothing is freed then). Threading: safe
/// from any thread, but the handle must not be used after this call.
#[unsafe(no_mangle)]
pub extern "C" fn epm_device_destroy(dev: *mut EpmDevice) -> EpmStatus {
    ffi_boundary! { handle::destroy(dev) }
}
