//! `GetSupportedDevices`: the EpDevices ORT lists for epmem, one per epmem
//! device, each bound to a hardware device (see `device_match.rs` for the
//! rules) and carrying its two allocator memory infos.

use super::abi::*;
use super::api::cstring_lossy;
use super::device_match::{self, Binding, HwInfo, NVIDIA_VENDOR_ID};
use super::factory::{EpmDevice, Factory, META_DEVICE, META_ORDINAL, me};
use super::status_boundary;
use crate::error::Result;

/// A hardware device we created (ORT 1.24+).
pub(crate) struct HwHandle(pub(crate) *mut OrtHardwareDevice);
// SAFETY: an OrtHardwareDevice is immutable once created; we only release it.
unsafe impl Send for HwHandle {}

/// List one EpDevice per epmem device (ORT takes ownership of them).
pub(crate) unsafe extern "C" fn get_supported_devices(
    this: *mut OrtEpFactory,
    devices: *const *const OrtHardwareDevice,
    num_devices: usize,
    ep_devices: *mut *mut OrtEpDevice,
    max_ep_devices: usize,
    num_ep_devices: *mut usize,
) -> *mut OrtStatus {
    // SAFETY: ORT passes the factory we gave it.
    let f = unsafe { me(this) };
    let api = f.api;
    status_boundary(&api, "GetSupportedDevices", || {
        crate::ensure!(!num_ep_devices.is_null() && !ep_devices.is_null(), NullPointer, "an out-param is NULL");
        crate::ensure!(num_devices == 0 || !devices.is_null(), NullPointer, "the device list is NULL");
        // SAFETY: ORT passes `num_devices` live hardware devices.
        let hw: Vec<*const OrtHardwareDevice> = (0..num_devices).map(|i| unsafe { *devices.add(i) }).collect();
        let described: Vec<HwInfo> = hw
            .iter()
            // SAFETY: each is a live OrtHardwareDevice.
            .map(|&h| unsafe {
                let t = (api.o.HardwareDevice_Type)(h);
                HwInfo {
                    is_cpu: t == HARDWARE_DEVICE_CPU,
                    is_gpu: t == HARDWARE_DEVICE_GPU,
                    vendor_id: (api.o.HardwareDevice_VendorId)(h),
                    pci_bus_id: api.hw_metadata(h, "pci_bus_id"),
                }
            })
            .collect();
        let ours: Vec<_> = f.devices.iter().map(|d| d.dev.info()).collect();
        let plan = device_match::plan(&described, &ours, api.e.CreateHardwareDevice.is_some())?;

        let mut made: Vec<*mut OrtEpDevice> = Vec::new();
        let result = (|| -> Result<()> {
            for (d, b) in f.devices.iter().zip(plan) {
                if made.len() >= max_ep_devices {
                    log::warn!(
                        "epmem: ONNX Runtime takes at most {max_ep_devices} devices; {} not reported",
                        d.label()
                    );
                    continue;
                }
                let (hwp, how) = match b {
                    Binding::Existing(i) => (hw[i], "matched"),
                    Binding::CpuFallback(i) => (hw[i], "cpu-fallback"),
                    Binding::Create => (create_hw(f, d)?, "created"),
                };
                let info = d.dev.info();
                let meta = api.kvp_new(&[
                    (META_ORDINAL, info.ordinal.to_string()),
                    (META_DEVICE, info.kind.name().to_string()),
                    ("epmem.device_name", info.name.clone()),
                    ("epmem.hardware_binding", how.to_string()),
                ]);
                let mut epd: *mut OrtEpDevice = std::ptr::null_mut();
                // SAFETY: live factory, hardware device and metadata; ORT copies the metadata.
                let st = unsafe { (api.e.CreateEpDevice)(this, hwp, meta.as_ptr(), std::ptr::null(), &mut epd) };
                api.check(st, "CreateEpDevice")?;
                made.push(epd);
                // SAFETY: epd is live; the memory infos outlive it (the factory owns them).
                unsafe {
                    api.check(
                        (api.e.EpDevice_AddAllocatorInfo)(epd, d.default_info.as_ptr()),
                        "EpDevice_AddAllocatorInfo(DEFAULT)",
                    )?;
                    api.check(
                        (api.e.EpDevice_AddAllocatorInfo)(epd, d.pinned_info.as_ptr()),
                        "EpDevice_AddAllocatorInfo(HOST_ACCESSIBLE)",
                    )?;
                }
            }
            Ok(())
        })();
        match result {
            Ok(()) => {
                // SAFETY: ORT's array holds max_ep_devices entries; made.len() <= that.
                unsafe {
                    for (i, &e) in made.iter().enumerate() {
                        *ep_devices.add(i) = e;
                    }
                    *num_ep_devices = made.len();
                }
                Ok(())
            }
            Err(e) => {
                for epd in made {
                    // SAFETY: created above and not handed to ORT.
                    unsafe { (api.e.ReleaseEpDevice)(epd) };
                }
                Err(e)
            }
        }
    })
}

/// A hardware device for a GPU ORT's discovery did not find (ORT 1.24+).
fn create_hw(f: &Factory, d: &EpmDevice) -> Result<*const OrtHardwareDevice> {
    let api = f.api;
    let create =
        api.e.CreateHardwareDevice.ok_or_else(|| crate::error::Error::internal("CreateHardwareDevice is missing"))?;
    let info = d.dev.info();
    let bus = info.pci_bus_id.clone().unwrap_or_default();
    let meta = api.kvp_new(&[
        ("pci_bus_id", normalize_pci(&bus)),
        ("Discrete", "1".to_string()),
        ("epmem.created", "1".to_string()),
    ]);
    let vendor = cstring_lossy("NVIDIA");
    let mut out: *mut OrtHardwareDevice = std::ptr::null_mut();
    // SAFETY: plain ORT call; it copies the name and metadata.
    let st = unsafe {
        create(
            HARDWARE_DEVICE_GPU,
            NVIDIA_VENDOR_ID,
            pci_device_id(&bus).unwrap_or(0),
            vendor.as_ptr(),
            meta.as_ptr(),
            &mut out,
        )
    };
    api.check(st, "CreateHardwareDevice")?;
    f.created_hw.lock().unwrap_or_else(|e| e.into_inner()).push(HwHandle(out));
    Ok(out)
}

/// "00000000:65:00.0" → "0000:65:00.0", the form ORT's discovery uses.
fn normalize_pci(bus: &str) -> String {
    match device_match::parse_pci(bus) {
        Some((d, b, s, f)) => format!("{d:04x}:{b:02x}:{s:02x}.{f:x}"),
        None => bus.to_string(),
    }
}

/// The PCI device id from sysfs (0x2335 for an H200), if readable.
fn pci_device_id(bus: &str) -> Option<u32> {
    let text = std::fs::read_to_string(format!("/sys/bus/pci/devices/{}/device", normalize_pci(bus))).ok()?;
    u32::from_str_radix(text.trim().trim_start_matches("0x"), 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_ids_are_normalized_to_ort_form() {
        assert_eq!(normalize_pci("00000000:C5:00.0"), "0000:c5:00.0");
        assert_eq!(normalize_pci("garbage"), "garbage");
    }
}
