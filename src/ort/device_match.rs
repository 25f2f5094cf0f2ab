//! How epmem's devices appear to ONNX Runtime: which `OrtHardwareDevice`
//! each one binds to, and which memory device its memory is labelled with.
//!
//! Pure logic (no ORT calls), so the rules are unit-tested here.

use super::abi::{MEMORY_INFO_DEVICE_CPU, MEMORY_INFO_DEVICE_GPU};
use super::api::MemoryKind;
use crate::device::{DeviceInfo, DeviceKind};
use crate::error::Result;

/// PCI vendor id of NVIDIA: the vendor of CUDA device memory.
pub const NVIDIA_VENDOR_ID: u32 = 0x10DE;

/// The vendor id on memory of the host device ("EPM" in ASCII). Larger than
/// any 16-bit PCI vendor id, so it can never collide with real hardware,
/// and it keeps epmem's host memory distinct from ORT's own CPU memory
/// (vendor 0) while staying honest that it is CPU memory.
pub const EPMEM_HOST_VENDOR_ID: u32 = 0x0045_504D;

/// The memory device epmem's memory on `info` is labelled with.
///
/// CUDA: a GPU at the CUDA ordinal, vendor NVIDIA — the same label ORT's
/// CUDA EP uses, because the pointers are the same kind of pointer.
/// Host device: CPU memory (it is host memory), vendor [`EPMEM_HOST_VENDOR_ID`].
pub fn memory_kind(info: &DeviceInfo) -> MemoryKind {
    match info.kind {
        DeviceKind::Cuda => MemoryKind {
            device_type: MEMORY_INFO_DEVICE_GPU,
            vendor_id: NVIDIA_VENDOR_ID,
            device_id: info.ordinal as i32,
        },
        DeviceKind::Host => MemoryKind {
            device_type: MEMORY_INFO_DEVICE_CPU,
            vendor_id: EPMEM_HOST_VENDOR_ID,
            device_id: info.ordinal as i32,
        },
    }
}

/// What ORT says about one of its hardware devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HwInfo {
    pub is_cpu: bool,
    pub is_gpu: bool,
    pub vendor_id: u32,
    /// The `pci_bus_id` metadata ORT's discovery adds ("0000:65:00.0").
    pub pci_bus_id: Option<String>,
}

/// Which hardware device an epmem device is reported on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binding {
    /// ORT's own hardware device at this index (a GPU matched by PCI bus id,
    /// or the CPU for the host device).
    Existing(usize),
    /// A hardware device we create with `CreateHardwareDevice` (ORT 1.24+)
    /// because ORT's discovery did not find this GPU.
    Create,
    /// ORT 1.23 cannot create devices: the EpDevice hangs off ORT's CPU
    /// hardware device (at this index) while its memory infos still say GPU.
    CpuFallback(usize),
}

/// Bind each of `ours` (in order) to a hardware device.
pub fn plan(hw: &[HwInfo], ours: &[&DeviceInfo], can_create: bool) -> Result<Vec<Binding>> {
    let cpu = hw.iter().position(|h| h.is_cpu);
    let mut used = vec![false; hw.len()];
    let mut out = Vec::with_capacity(ours.len());
    for d in ours {
        let b = match d.kind {
            DeviceKind::Host => Binding::Existing(cpu.ok_or_else(no_cpu)?),
            DeviceKind::Cuda => {
                let want = d.pci_bus_id.as_deref().and_then(parse_pci);
                let found = want.and_then(|w| {
                    hw.iter().enumerate().position(|(i, h)| {
                        !used[i]
                            && h.is_gpu
                            && h.vendor_id == NVIDIA_VENDOR_ID
                            && h.pci_bus_id.as_deref().and_then(parse_pci) == Some(w)
                    })
                });
                match (found, can_create) {
                    (Some(i), _) => {
                        used[i] = true;
                        Binding::Existing(i)
                    }
                    (None, true) => Binding::Create,
                    (None, false) => Binding::CpuFallback(cpu.ok_or_else(no_cpu)?),
                }
            }
        };
        out.push(b);
    }
    Ok(out)
}

fn no_cpu() -> crate::error::Error {
    crate::error::Error::unsupported("ONNX Runtime reported no CPU hardware device to attach the epmem device to")
}

/// "dddd:bb:dd.f" (any hex width, any case) → (domain, bus, device, function).
pub fn parse_pci(s: &str) -> Option<(u32, u32, u32, u32)> {
    let s = s.trim();
    let (rest, func) = s.rsplit_once('.')?;
    let mut parts = rest.split(':');
    let (a, b, c) = (parts.next()?, parts.next()?, parts.next());
    let (dom, bus, dev) = match c {
        Some(c) => (a, b, c),
        None => ("0", a, b),
    };
    if parts.next().is_some() {
        return None;
    }
    let h = |x: &str| u32::from_str_radix(x, 16).ok();
    Some((h(dom)?, h(bus)?, h(dev)?, h(func)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(kind: DeviceKind, ordinal: u32, pci: Option<&str>) -> DeviceInfo {
        DeviceInfo {
            kind,
            ordinal,
            name: "x".into(),
            total_mem: 1 << 30,
            granularity: 2 << 20,
            pci_bus_id: pci.map(str::to_string),
            compute_capability: (0, 0),
            driver_version: 0,
        }
    }
    fn hw(cpu: bool, vendor: u32, pci: Option<&str>) -> HwInfo {
        HwInfo { is_cpu: cpu, is_gpu: !cpu, vendor_id: vendor, pci_bus_id: pci.map(str::to_string) }
    }

    #[test]
    fn pci_ids_compare_by_value() {
        assert_eq!(parse_pci("0000:65:00.0"), Some((0, 0x65, 0, 0)));
        assert_eq!(parse_pci("00000000:C5:00.1"), Some((0, 0xc5, 0, 1)));
        assert_eq!(parse_pci("c5:00.1"), Some((0, 0xc5, 0, 1)));
        assert_eq!(parse_pci("card0"), None);
        assert_eq!(parse_pci("0:1:2:3.0"), None);
    }

    #[test]
    fn gpus_match_by_pci_bus_id_not_by_order() {
        let hws =
            [hw(true, 0x8086, None), hw(false, 0x10DE, Some("0000:c5:00.0")), hw(false, 0x10DE, Some("0000:65:00.0"))];
        let a = info(DeviceKind::Cuda, 0, Some("00000000:65:00.0"));
        let b = info(DeviceKind::Cuda, 1, Some("00000000:C5:00.0"));
        assert_eq!(plan(&hws, &[&a, &b], true).unwrap(), vec![Binding::Existing(2), Binding::Existing(1)]);
    }

    /// Two GPUs of one host: ORT lists the GPU of ordinal 1
    /// first. Each of our per-ordinal devices must land on the hardware
    /// device with its own bus id, in either order we list ours, and two
    /// GPUs differing only in PCI domain are not confused.
    #[test]
    fn two_gpus_listed_in_swapped_order_match_their_own_ordinals() {
        let hws = [
            hw(false, 0x10DE, Some("0000:c5:00.0")), // cuda:1
            hw(true, 0x8086, None),
            hw(false, 0x10DE, Some("0000:65:00.0")), // cuda:0
        ];
        let d0 = info(DeviceKind::Cuda, 0, Some("00000000:65:00.0"));
        let d1 = info(DeviceKind::Cuda, 1, Some("00000000:C5:00.0"));
        assert_eq!(plan(&hws, &[&d0, &d1], true).unwrap(), vec![Binding::Existing(2), Binding::Existing(0)]);
        assert_eq!(plan(&hws, &[&d1, &d0], false).unwrap(), vec![Binding::Existing(0), Binding::Existing(2)]);
        let hws = [hw(false, 0x10DE, Some("0001:65:00.0")), hw(false, 0x10DE, Some("0000:65:00.0")), hw(true, 0, None)];
        assert_eq!(plan(&hws, &[&d0], true).unwrap(), vec![Binding::Existing(1)], "domain 1 is another GPU");
        // A second device claiming the same bus id does not steal the first's binding.
        let twin = info(DeviceKind::Cuda, 1, Some("0000:65:00.0"));
        assert_eq!(plan(&hws, &[&d0, &twin], true).unwrap(), vec![Binding::Existing(1), Binding::Create]);
    }

    #[test]
    fn unmatched_gpu_is_created_on_124_and_hangs_off_the_cpu_on_123() {
        // A BMC graphics card satisfied ORT's DRM scan; the H200 is missing.
        let hws = [hw(false, 0x1A03, Some("0000:02:00.0")), hw(true, 0x8086, None)];
        let g = info(DeviceKind::Cuda, 0, Some("0000:65:00.0"));
        assert_eq!(plan(&hws, &[&g], true).unwrap(), vec![Binding::Create]);
        assert_eq!(plan(&hws, &[&g], false).unwrap(), vec![Binding::CpuFallback(1)]);
    }

    #[test]
    fn host_device_binds_to_the_cpu_and_is_labelled_cpu_memory() {
        let hws = [hw(false, 0x10DE, None), hw(true, 0x1022, None)];
        let h = info(DeviceKind::Host, 0, None);
        assert_eq!(plan(&hws, &[&h], true).unwrap(), vec![Binding::Existing(1)]);
        let k = memory_kind(&h);
        assert_eq!(k.device_type, MEMORY_INFO_DEVICE_CPU);
        assert_ne!(k.vendor_id, 0, "must not alias ORT's own CPU memory");
        assert!(k.vendor_id > 0xFFFF, "must not be a PCI vendor id");
        assert_eq!(memory_kind(&info(DeviceKind::Cuda, 3, None)).device_type, MEMORY_INFO_DEVICE_GPU);
        assert_eq!(memory_kind(&info(DeviceKind::Cuda, 3, None)).device_id, 3);
    }

    #[test]
    fn no_cpu_device_is_an_error_not_a_panic() {
        let h = info(DeviceKind::Host, 0, None);
        assert!(plan(&[], &[&h], true).is_err());
        let g = info(DeviceKind::Cuda, 0, None);
        assert!(plan(&[], &[&g], false).is_err());
    }
}
