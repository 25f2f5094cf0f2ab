//! The device layer: the only code in epmem that talks to hardware.
//!
//! One [`Device`] trait, two implementations:
//! - [`cuda`]: the CUDA driver API through `cudarc` (dynamic loading; a process
//!   with no libcuda gets [`EpmStatus::DeviceUnavailable`], never a panic);
//! - [`host`]: a host "device" whose VMM is real (memfd + mmap + mprotect),
//!   whose streams are worker threads and whose events are sequence numbers.
//!
//! The trait is the raw level (like cudarc's `result` module): plain handles,
//! and `unsafe fn` wherever a host pointer crosses in. The safe level the core
//! uses is in [`objects`] (RAII streams, events, pinned buffers, device
//! buffers, physical granules, VA reservations); the copy witness, the fill
//! threads and host page-locking sit one layer up, in [`crate::transfer`]. Device addresses are plain integers ([`DevicePtr`]); both
//! implementations validate them, so a bad device address is an error, not
//! undefined behaviour.

use std::fmt;
use std::sync::Arc;

use crate::error::{EpmStatus, Error, Result};

// Test machinery (the conformance suite, fault injection): compiled only for
// tests and `--features testing` builds, never into the library `make
// install` ships.
#[cfg(any(test, feature = "testing"))]
pub mod conformance;
pub mod cuda;
#[cfg(any(test, feature = "testing"))]
pub mod fault;
pub mod gate;
pub mod host;
pub mod objects;
pub(crate) mod portable;
pub mod rlimit;

pub use gate::Gate;
pub use objects::*;

/// A device virtual address. On the host device it is a host address.
pub type DevicePtr = u64;

/// Which implementation a [`Device`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// An NVIDIA GPU through the CUDA driver API.
    Cuda,
    /// The host device (no GPU): memfd/mmap VMM, worker-thread streams.
    Host,
}

impl DeviceKind {
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cuda => "cuda",
            DeviceKind::Host => "host",
        }
    }
}

/// What `EPM_DEVICE` (or an explicit argument) asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSelect {
    /// CUDA if a driver and a device at the ordinal exist, else the host device.
    Auto,
    /// CUDA or an error.
    Cuda,
    /// The host device.
    Host,
}

impl DeviceSelect {
    /// Parse exactly `auto`, `cuda` or `host`, ASCII case-insensitive (`CUDA`
    /// is `cuda`). No aliases, no surrounding spaces, not empty: anything
    /// else is [`EpmStatus::InvalidConfig`] with a message naming the
    /// accepted values, so a typo never silently picks a device.
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "cuda" => Ok(Self::Cuda),
            "host" => Ok(Self::Host),
            _ => Err(Error::new(
                EpmStatus::InvalidConfig,
                format!("EPM_DEVICE={s:?} is not one of auto, cuda, host (case-insensitive)"),
            )),
        }
    }
    /// Read `EPM_DEVICE`; unset means `auto`.
    pub fn from_env() -> Result<Self> {
        match std::env::var("EPM_DEVICE") {
            Ok(v) => Self::parse(&v),
            Err(std::env::VarError::NotPresent) => Ok(Self::Auto),
            Err(e) => Err(Error::new(EpmStatus::InvalidConfig, format!("EPM_DEVICE: {e}"))),
        }
    }
}

/// Static facts about a device, read once when it is opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub kind: DeviceKind,
    pub ordinal: u32,
    /// e.g. "NVIDIA H200" or "host (memfd VMM)".
    pub name: String,
    /// Total device memory in bytes (host device: a nominal figure, physical RAM).
    pub total_mem: u64,
    /// VMM granularity in bytes (2 MiB on the H200; query it, never assume).
    pub granularity: usize,
    /// PCI bus id "dddd:bb:dd.f", when the device has one.
    pub pci_bus_id: Option<String>,
    /// (major, minor) compute capability; (0, 0) on the host device.
    pub compute_capability: (u32, u32),
    /// CUDA driver version as an integer (13000 = 13.0); 0 on the host device.
    pub driver_version: u32,
}

/// A stream handle, valid only on the device that created it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawStream(pub u64);
/// An event handle, valid only on the device that created it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawEvent(pub u64);
/// A physical memory handle (one or more granules), valid only on its device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RawPhys(pub u64);

/// Access of a mapped VA range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    ReadWrite,
    ReadOnly,
}

/// Counters of live device resources, for leak checks at teardown.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LiveCounts {
    pub streams: u64,
    pub events: u64,
    pub pinned_buffers: u64,
    pub pinned_bytes: u64,
    pub host_registrations: u64,
    pub device_allocations: u64,
    pub device_bytes: u64,
    pub physical_handles: u64,
    pub physical_bytes: u64,
    pub va_reservations: u64,
    pub mappings: u64,
}

/// Driver-call counters (monotonic), for "no driver call in steady state" checks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DriverCounts {
    pub pinned_alloc_calls: u64,
    pub pinned_free_calls: u64,
    pub host_register_calls: u64,
    pub device_alloc_calls: u64,
    pub device_free_calls: u64,
    pub vmm_create_calls: u64,
    pub vmm_release_calls: u64,
    pub vmm_map_calls: u64,
    pub vmm_unmap_calls: u64,
    pub vmm_set_access_calls: u64,
}

/// The hardware abstraction. One object per device ordinal, shared as
/// `Arc<dyn Device>`; every method may be called from any thread.
///
/// Errors: every fallible call returns [`Error`]; a CUDA failure carries the
/// call name and CUresult in its message, a sticky CUDA error maps to
/// [`EpmStatus::ContextLost`]. Nothing panics on bad input.
///
/// Handles ([`RawStream`], [`RawEvent`], [`RawPhys`]) and device addresses are
/// validated by both implementations: an unknown one is an error.
pub trait Device: Send + Sync + fmt::Debug {
    /// Static facts, read at open.
    fn info(&self) -> &DeviceInfo;
    /// (free, total) device memory in bytes.
    fn mem_get_info(&self) -> Result<(u64, u64)>;
    /// Block until all work on the device has completed.
    fn synchronize(&self) -> Result<()>;
    /// Live resource counts (leak checks).
    fn live_counts(&self) -> LiveCounts;
    /// Monotonic driver-call counts.
    fn driver_counts(&self) -> DriverCounts;

    // ---- streams -------------------------------------------------------
    /// A new non-blocking stream.
    fn stream_create(&self) -> Result<RawStream>;
    /// Adopt a stream the host created itself (a `CUstream` on CUDA), so
    /// epmem can order work against it. epmem never destroys it:
    /// [`Device::stream_destroy`] only forgets it. The host device has no
    /// native streams and returns [`EpmStatus::Unsupported`].
    fn stream_wrap_native(&self, native: u64) -> Result<RawStream>;
    /// The native handle (`CUstream` on CUDA, 0 on the host device), for the
    /// host to launch its own kernels on.
    fn stream_native(&self, s: RawStream) -> Result<u64>;
    /// Destroy a stream (or forget an adopted one). Work already queued still completes.
    fn stream_destroy(&self, s: RawStream) -> Result<()>;
    /// Block until all work queued on `s` has completed.
    fn stream_synchronize(&self, s: RawStream) -> Result<()>;
    /// Work queued on `s` after this call waits until `e`'s recorded work completes.
    /// The host does not wait.
    fn stream_wait_event(&self, s: RawStream, e: RawEvent) -> Result<()>;

    // ---- events --------------------------------------------------------
    /// A new event. `timing` events can be used with [`Device::event_elapsed_ms`].
    fn event_create(&self, timing: bool) -> Result<RawEvent>;
    fn event_destroy(&self, e: RawEvent) -> Result<()>;
    /// Capture the work queued on `s` so far.
    fn event_record(&self, e: RawEvent, s: RawStream) -> Result<()>;
    /// True when the captured work has completed (an event never recorded is complete).
    /// Never blocks.
    fn event_query(&self, e: RawEvent) -> Result<bool>;
    /// Block until the captured work has completed.
    fn event_synchronize(&self, e: RawEvent) -> Result<()>;
    /// Milliseconds between two completed timing events. Never blocks: if
    /// either has not completed, returns [`EpmStatus::NotReady`].
    fn event_elapsed_ms(&self, start: RawEvent, end: RawEvent) -> Result<f32>;

    // ---- host memory ---------------------------------------------------
    /// Page-locked host memory (never write-combined), `bytes > 0`.
    fn pinned_alloc(&self, bytes: usize) -> Result<*mut u8>;
    /// Free memory from [`Device::pinned_alloc`].
    ///
    /// # Safety
    /// `p` came from `pinned_alloc` on this device, is not freed yet, and no
    /// queued copy still reads or writes it.
    unsafe fn pinned_free(&self, p: *mut u8) -> Result<()>;
    /// Page-lock an existing host range so copies from it need no staging.
    /// `read_only`: the device will only read it (cuMemHostRegister READ_ONLY).
    ///
    /// # Safety
    /// `[p, p+len)` is valid, mapped host memory for as long as it stays registered.
    unsafe fn host_register(&self, p: *mut u8, len: usize, read_only: bool) -> Result<()>;
    /// [`Device::host_register`], portable: every device of this kind in the
    /// process sees the range as page-locked and copies from it directly
    /// (CUDA: `CU_MEMHOSTREGISTER_PORTABLE`). Undone by `host_unregister` on
    /// this device. Used through [`crate::transfer::pinning::SharedHostRegistration`].
    ///
    /// # Safety
    /// As for [`Device::host_register`].
    unsafe fn host_register_portable(&self, p: *mut u8, len: usize, read_only: bool) -> Result<()>;
    /// Undo [`Device::host_register`].
    ///
    /// # Safety
    /// `p` is the start of a registered range and no queued copy uses it.
    unsafe fn host_unregister(&self, p: *mut u8) -> Result<()>;
    /// Whether `p` lies in page-locked memory known to the driver (a pinned
    /// allocation or a registered range). Never fails: unknown means false.
    fn host_is_page_locked(&self, p: *const u8, len: usize) -> bool;

    // ---- device memory -------------------------------------------------
    /// Plain device memory (cuMemAlloc), `bytes > 0`.
    fn mem_alloc(&self, bytes: usize) -> Result<DevicePtr>;
    /// Free memory from [`Device::mem_alloc`]. The caller guarantees no queued
    /// work still uses it (on CUDA this synchronizes like cuMemFree).
    fn mem_free(&self, p: DevicePtr) -> Result<()>;

    // ---- copies (asynchronous, ordered on the stream) ------------------
    /// Host → device.
    ///
    /// # Safety
    /// `[src, src+n)` is readable host memory until the copy completes.
    unsafe fn memcpy_htod_async(&self, dst: DevicePtr, src: *const u8, n: usize, s: RawStream) -> Result<()>;
    /// Device → host.
    ///
    /// # Safety
    /// `[dst, dst+n)` is writable host memory, not otherwise accessed, until the copy completes.
    unsafe fn memcpy_dtoh_async(&self, dst: *mut u8, src: DevicePtr, n: usize, s: RawStream) -> Result<()>;
    /// Device → device.
    fn memcpy_dtod_async(&self, dst: DevicePtr, src: DevicePtr, n: usize, s: RawStream) -> Result<()>;
    /// Fill device memory with a byte.
    fn memset_d8_async(&self, dst: DevicePtr, value: u8, n: usize, s: RawStream) -> Result<()>;

    // ---- device-side helpers (small built-in kernels) ------------------
    /// Write the 64-bit position-weighted checksum of `[p, p+n)` to the
    /// device address `out` (8 bytes). `n` is a multiple of 4. The checksum is
    /// `sum over u32 words w[i] of (w[i] as u64) * (2*i + 1)`, wrapping: order
    /// independent to compute, position sensitive. See [`checksum_host`].
    fn checksum_async(&self, p: DevicePtr, n: usize, out: DevicePtr, s: RawStream) -> Result<()>;
    /// A kernel that keeps the stream busy for about `micros` microseconds
    /// (the fixed "compute" of benchmarks and overlap tests).
    fn spin_async(&self, micros: u32, s: RawStream) -> Result<()>;
    /// Hold `s`: work queued on it after this call runs only once `gate` is
    /// opened (or dropped). For tests that must order a check before queued
    /// work by an event, not by a wall-clock spin. See [`gate`].
    fn hold_async(&self, s: RawStream, gate: &Gate) -> Result<()>;
    /// Decode the compressed weight at `[src, src+src_len)` (format v1 or v2 of
    /// [`crate::codec`], described by `desc`, which the host parsed from the
    /// same bytes, so nothing is read back) into `[dst, dst+dst_len)`, ordered
    /// on `s` like a copy: work queued on `s` before it (the H2D of the
    /// compressed bytes) completes first, work after it sees the decoded weight.
    /// `src_len` and `dst_len` must be the compressed and raw lengths `desc`
    /// gives, both addresses 16-byte aligned, the ranges disjoint
    /// ([`check_decode`]); a corrupt source gives wrong values or an error,
    /// never a read or write outside the two ranges. CUDA runs a kernel of the
    /// built-in codec PTX; the host device runs [`crate::codec::decode_with`]
    /// on the stream's worker.
    fn decode_async(
        &self,
        src: DevicePtr,
        src_len: usize,
        dst: DevicePtr,
        dst_len: usize,
        desc: &crate::codec::DecodeDesc,
        s: RawStream,
    ) -> Result<()>;
    /// Decode blocks of a compressed weight ([`crate::codec::DecodePiece`]:
    /// the parts of its streams staged at `src`, `piece.staged_len()` bytes)
    /// into `[dst, dst + piece.raw_len())`, the piece's share of the weight's
    /// memory; ordered on `s` like [`Device::decode_async`], which is this
    /// call on [`crate::codec::DecodeDesc::whole`]. Both addresses 16-byte
    /// aligned, the ranges disjoint ([`check_piece`]). The piece was cut from
    /// a validated buffer ([`crate::codec::DecodeDesc::piece`]); the CUDA
    /// kernel bounds its escape reads above by the piece's last escape, the
    /// host decoder every read (a corrupt staged escape index gives an error
    /// there).
    fn decode_piece_async(
        &self,
        src: DevicePtr,
        dst: DevicePtr,
        piece: &crate::codec::DecodePiece,
        s: RawStream,
    ) -> Result<()>;

    // ---- VMM -----------------------------------------------------------
    /// Physical allocation granularity in bytes.
    fn vmm_granularity(&self) -> usize;
    /// New physical memory of `bytes` (a multiple of the granularity).
    fn vmm_create(&self, bytes: usize) -> Result<RawPhys>;
    /// Release a physical handle. Mappings of it keep the memory alive until unmapped.
    fn vmm_release(&self, h: RawPhys) -> Result<()>;
    /// Reserve `bytes` of VA (a multiple of the granularity), aligned to `align` (0 = granularity).
    fn vmm_reserve(&self, bytes: usize, align: usize) -> Result<DevicePtr>;
    /// Free a VA reservation; it must be fully unmapped.
    fn vmm_free_va(&self, va: DevicePtr, bytes: usize) -> Result<()>;
    /// Map `bytes` of physical handle `h` starting at `offset` to `va`
    /// (inside a reservation, not yet mapped). Access starts as none: call
    /// [`Device::vmm_set_access`]. `offset` must be 0: the H200's driver
    /// answers CUDA_ERROR_NOT_SUPPORTED to any other (measured 2026-11-30), so
    /// both devices refuse it with [`EpmStatus::Unsupported`]; to place
    /// granules independently, make one handle per granule.
    fn vmm_map(&self, va: DevicePtr, bytes: usize, h: RawPhys, offset: usize) -> Result<()>;
    /// Unmap `[va, va+bytes)`. The caller guarantees no in-flight work touches it.
    fn vmm_unmap(&self, va: DevicePtr, bytes: usize) -> Result<()>;
    /// Set the access of a mapped range.
    fn vmm_set_access(&self, va: DevicePtr, bytes: usize, access: Access) -> Result<()>;
}

/// The one rule about `vmm_map` offsets both devices share (see [`Device::vmm_map`]).
pub(crate) fn check_map_offset(offset: usize) -> Result<()> {
    crate::ensure!(
        offset == 0,
        Unsupported,
        "vmm_map at handle offset {offset}: only offset 0 is supported (CUDA refuses others); use one handle per granule"
    );
    Ok(())
}

/// The argument rules of [`Device::decode_async`] both devices share.
pub fn check_decode(
    src: DevicePtr,
    src_len: usize,
    dst: DevicePtr,
    dst_len: usize,
    desc: &crate::codec::DecodeDesc,
) -> Result<()> {
    desc.check_lengths(src_len, dst_len)?;
    check_piece(src, dst, &desc.whole())
}

/// The argument rules of [`Device::decode_piece_async`] both devices share.
pub fn check_piece(src: DevicePtr, dst: DevicePtr, piece: &crate::codec::DecodePiece) -> Result<()> {
    let (src_len, dst_len) = (piece.staged_len(), piece.raw_len());
    let align = crate::codec::ALIGN as u64;
    crate::ensure!(
        src.is_multiple_of(align) && dst.is_multiple_of(align),
        InvalidArgument,
        "decode: source {src:#x} and destination {dst:#x} must both be {align}-byte aligned"
    );
    let (src_end, dst_end) = (src.checked_add(src_len as u64), dst.checked_add(dst_len as u64));
    let (Some(src_end), Some(dst_end)) = (src_end, dst_end) else {
        return Err(Error::invalid_argument("decode: a range wraps around the address space"));
    };
    crate::ensure!(
        src_end <= dst || dst_end <= src,
        InvalidArgument,
        "decode: source {src:#x}+{src_len} and destination {dst:#x}+{dst_len} overlap"
    );
    Ok(())
}

/// The checksum [`Device::checksum_async`] computes, on the host.
pub fn checksum_host(bytes: &[u8]) -> u64 {
    let mut sum: u64 = 0;
    for (i, w) in bytes.chunks_exact(4).enumerate() {
        let w = u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as u64;
        sum = sum.wrapping_add(w.wrapping_mul(2 * i as u64 + 1));
    }
    sum
}

/// Open a device: `select` picks the implementation, `ordinal` the device.
///
/// `Auto` tries CUDA (driver present and a device at `ordinal`), else the host
/// device, and logs which it chose and why.
pub fn open(select: DeviceSelect, ordinal: u32) -> Result<Arc<dyn Device>> {
    #[cfg(not(feature = "testing"))]
    {
        if std::env::var_os("EPM_FAULT").is_some() {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| {
                log::warn!(
                    "epmem: EPM_FAULT is ignored: fault injection exists only in builds with the `testing` feature"
                )
            });
        }
        open_plain(select, ordinal)
    }
    #[cfg(feature = "testing")]
    open_with_faults(select, ordinal)
}

/// [`open`] honouring `EPM_FAULT` (testing builds only; see [`fault`]).
#[cfg(feature = "testing")]
fn open_with_faults(select: DeviceSelect, ordinal: u32) -> Result<Arc<dyn Device>> {
    // Parse EPM_FAULT before opening anything, so a bad value opens nothing.
    let faults = match std::env::var("EPM_FAULT") {
        Ok(spec) => Some(fault::FaultyDevice::parse_plan(&spec)?),
        Err(_) => None,
    };
    let dev = open_plain(select, ordinal)?;
    Ok(match faults {
        Some(plan) if !plan.is_empty() => {
            log::warn!("epmem: EPM_FAULT is set: injecting {plan:?}");
            let f = fault::FaultyDevice::new(dev);
            for (kind, n) in plan {
                f.fail_nth(kind, n);
            }
            Arc::new(f)
        }
        _ => dev,
    })
}

fn open_plain(select: DeviceSelect, ordinal: u32) -> Result<Arc<dyn Device>> {
    match select {
        DeviceSelect::Host => Ok(Arc::new(host::HostDevice::new(ordinal)?)),
        DeviceSelect::Cuda => Ok(Arc::new(cuda::CudaDevice::new(ordinal)?)),
        DeviceSelect::Auto => match cuda::CudaDevice::new(ordinal) {
            Ok(d) => {
                log::info!("epmem: EPM_DEVICE=auto chose cuda:{ordinal} ({})", d.info().name);
                Ok(Arc::new(d))
            }
            Err(e) => {
                log::info!("epmem: EPM_DEVICE=auto chose the host device (CUDA unavailable: {})", e.message());
                Ok(Arc::new(host::HostDevice::new(ordinal)?))
            }
        },
    }
}

/// Open the device `EPM_DEVICE` names at `ordinal`.
pub fn open_from_env(ordinal: u32) -> Result<Arc<dyn Device>> {
    open(DeviceSelect::from_env()?, ordinal)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn select_parses_known_values_and_rejects_others() {
        assert_eq!(DeviceSelect::parse("AUTO").unwrap(), DeviceSelect::Auto);
        assert_eq!(DeviceSelect::parse("cuda").unwrap(), DeviceSelect::Cuda);
        assert_eq!(DeviceSelect::parse("Host").unwrap(), DeviceSelect::Host);
        for bad in ["tpu", "gpu", "cpu", "", " host ", "cuda0", "hos"] {
            let e = DeviceSelect::parse(bad).unwrap_err();
            assert_eq!(e.status(), EpmStatus::InvalidConfig, "{bad:?}");
            assert!(e.message().contains(&format!("{bad:?}")) && e.message().contains("auto, cuda, host"), "{e}");
        }
    }

    #[test]
    fn checksum_is_position_sensitive() {
        let a = [1u8, 0, 0, 0, 2, 0, 0, 0];
        let b = [2u8, 0, 0, 0, 1, 0, 0, 0];
        assert_eq!(checksum_host(&a), 1 + 2 * 3);
        assert_eq!(checksum_host(&b), 2 + 3);
        assert_ne!(checksum_host(&a), checksum_host(&b));
    }
}
