//! The CUDA device: the driver API through cudarc's `driver::sys`, loaded at
//! run time.
//!
//! Layout: [`driver`] (loading, error mapping, context guard), [`streams`]
//! (streams and events), [`memory`] (pinned, registered and device memory,
//! copies), [`vmm`] (physical handles, reservations, mappings), [`kernels`]
//! (the two built-in PTX kernels), [`codec`] (the decode kernel of
//! compressed weights), [`hold`] (the test gate's stream wait),
//! [`teardown`] (Drop).
//!
//! Every driver object we hand out is kept in a table (id → handle), so an
//! unknown or stale handle is [`EpmStatus::InvalidHandle`] instead of a
//! driver crash, and [`Device::live_counts`] is exact.

#[macro_use]
mod driver;
mod codec;
mod hold;
mod kernels;
mod memory;
mod streams;
mod teardown;
mod vmm;

use std::collections::{BTreeMap, HashMap};
use std::ffi::{CStr, c_char, c_int};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use cudarc::driver::sys;

use super::*;
use driver::{CtxGuard, Handle};

/// Monotonic driver-call counters, one per [`DriverCounts`] field.
#[derive(Default)]
struct Counters {
    pinned_alloc: AtomicU64,
    pinned_free: AtomicU64,
    host_register: AtomicU64,
    device_alloc: AtomicU64,
    device_free: AtomicU64,
    vmm_create: AtomicU64,
    vmm_release: AtomicU64,
    vmm_map: AtomicU64,
    vmm_unmap: AtomicU64,
    vmm_set_access: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Lock a table. A poisoned lock (a panic while held) still guards
/// consistent data here: every table update is a single insert or remove.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// An NVIDIA GPU, through its primary context.
pub struct CudaDevice {
    info: DeviceInfo,
    dev: sys::CUdevice,
    ctx: Handle<sys::CUcontext>,
    /// The device honours CU_MEMHOSTREGISTER_READ_ONLY.
    read_only_register: bool,
    /// Multiprocessor count, sizes the checksum grid.
    sm_count: u32,
    counts: Counters,
    streams: Mutex<HashMap<u64, streams::StreamEntry>>,
    events: Mutex<HashMap<u64, streams::EventEntry>>,
    host: Mutex<memory::HostTables>,
    device_mem: Mutex<BTreeMap<u64, usize>>,
    vmm: Mutex<vmm::VmmTables>,
    kernels: Mutex<Option<kernels::Kernels>>,
    /// The codec module, loaded at the first decode (see `codec`).
    codec: Mutex<Option<codec::CodecKernel>>,
    /// Flags of `hold_async`, kept until their wait has passed (see `hold`).
    gates: Mutex<Vec<hold::HeldGate>>,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice").field("info", &self.info).finish_non_exhaustive()
    }
}

impl CudaDevice {
    /// Open CUDA device `ordinal` (its primary context).
    ///
    /// No libcuda, a driver without the entry points we use, no GPU, or an
    /// ordinal past the device count: [`EpmStatus::DeviceUnavailable`] with the
    /// reason. Never panics.
    pub fn new(ordinal: u32) -> Result<Self> {
        driver::init()?;
        let mut count: c_int = 0;
        // SAFETY: valid out-pointer; cuInit succeeded.
        unsafe { cu!(cuDeviceGetCount(&mut count)) }?;
        crate::ensure!(
            (ordinal as i64) < count as i64,
            DeviceUnavailable,
            "CUDA device ordinal {ordinal} does not exist: the driver reports {count} device(s)"
        );
        let mut dev: sys::CUdevice = 0;
        // SAFETY: valid out-pointer; the ordinal is below the device count.
        unsafe { cu!(cuDeviceGet(&mut dev, ordinal as c_int)) }?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer and device; released in Drop or below on failure.
        unsafe { cu!(cuDevicePrimaryCtxRetain(&mut ctx, dev)) }?;
        match Self::with_context(ordinal, dev, ctx) {
            Ok(d) => Ok(d),
            Err(e) => {
                // SAFETY: balances the retain above; nothing was created in the context.
                if let Err(r) = unsafe { cu!(cuDevicePrimaryCtxRelease_v2(dev)) } {
                    log::warn!("epmem: releasing the primary context after a failed open: {r}");
                }
                Err(e)
            }
        }
    }

    fn with_context(ordinal: u32, dev: sys::CUdevice, ctx: sys::CUcontext) -> Result<Self> {
        let _g = CtxGuard::enter(ctx)?;
        let attr = |a: sys::CUdevice_attribute| -> Result<i32> {
            let mut v: c_int = 0;
            // SAFETY: valid out-pointer and device.
            unsafe { cu!(cuDeviceGetAttribute(&mut v, a, dev)) }?;
            Ok(v)
        };
        use sys::CUdevice_attribute as A;
        crate::ensure!(
            attr(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)? != 0,
            DeviceUnavailable,
            "CUDA device {ordinal} does not support virtual memory management (cuMemCreate/cuMemMap), which epmem needs"
        );
        let mut name: [c_char; 256] = [0; 256];
        // SAFETY: the buffer holds `len` bytes; the driver NUL-terminates within it.
        unsafe { cu!(cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, dev)) }?;
        // SAFETY: NUL-terminated by the driver (and the buffer was zeroed).
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
        let mut total: usize = 0;
        // SAFETY: valid out-pointer and device.
        unsafe { cu!(cuDeviceTotalMem_v2(&mut total, dev)) }?;
        let mut version: c_int = 0;
        // SAFETY: valid out-pointer.
        unsafe { cu!(cuDriverGetVersion(&mut version)) }?;
        let mut pci: [c_char; 64] = [0; 64];
        // SAFETY: the buffer holds `len` bytes; the driver NUL-terminates within it.
        let pci_bus_id = match unsafe { cu!(cuDeviceGetPCIBusId(pci.as_mut_ptr(), pci.len() as c_int, dev)) } {
            // SAFETY: NUL-terminated by the driver (and the buffer was zeroed).
            Ok(()) => driver::normalize_pci_bus_id(&unsafe { CStr::from_ptr(pci.as_ptr()) }.to_string_lossy()),
            Err(e) => {
                log::warn!("epmem: cuda:{ordinal} has no PCI bus id: {e}");
                None
            }
        };
        let granularity = vmm::granularity(dev)?;
        let info = DeviceInfo {
            kind: DeviceKind::Cuda,
            ordinal,
            name,
            total_mem: total as u64,
            granularity,
            pci_bus_id,
            compute_capability: (
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? as u32,
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? as u32,
            ),
            driver_version: version as u32,
        };
        let read_only_register = attr(A::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED)? != 0;
        if !read_only_register {
            log::info!("epmem: cuda:{ordinal} cannot register host memory read-only; registrations will be read-write");
        }
        Ok(Self {
            info,
            dev,
            ctx: Handle(ctx),
            read_only_register,
            sm_count: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as u32,
            counts: Counters::default(),
            streams: Mutex::default(),
            events: Mutex::default(),
            host: Mutex::default(),
            device_mem: Mutex::default(),
            vmm: Mutex::default(),
            kernels: Mutex::default(),
            codec: Mutex::default(),
            gates: Mutex::default(),
        })
    }

    /// Make our context current on the calling thread until the guard drops.
    fn enter(&self) -> Result<CtxGuard> {
        CtxGuard::enter(self.ctx.0)
    }

    /// A fresh id for a table entry: never 0, never reused, and unique across
    /// every CudaDevice in the process, so a handle of one device (or one
    /// kind) passed to another is InvalidHandle, never a different object.
    fn new_id(&self) -> u64 {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        NEXT_ID.fetch_add(1, Ordering::Relaxed)
    }
}

impl Device for CudaDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }
    fn mem_get_info(&self) -> Result<(u64, u64)> {
        let _g = self.enter()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers; our context is current.
        unsafe { cu!(cuMemGetInfo_v2(&mut free, &mut total)) }?;
        Ok((free as u64, total as u64))
    }
    fn synchronize(&self) -> Result<()> {
        let _g = self.enter()?;
        // SAFETY: no arguments; our context is current.
        unsafe { cu!(cuCtxSynchronize()) }
    }
    fn live_counts(&self) -> LiveCounts {
        let mut c = LiveCounts {
            streams: lock(&self.streams).len() as u64,
            events: lock(&self.events).len() as u64,
            ..Default::default()
        };
        self.host_live_counts(&mut c);
        {
            let mem = lock(&self.device_mem);
            c.device_allocations = mem.len() as u64;
            c.device_bytes = mem.values().map(|&b| b as u64).sum();
        }
        lock(&self.vmm).live_counts(&mut c);
        c
    }
    fn driver_counts(&self) -> DriverCounts {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let c = &self.counts;
        DriverCounts {
            pinned_alloc_calls: r(&c.pinned_alloc),
            pinned_free_calls: r(&c.pinned_free),
            host_register_calls: r(&c.host_register),
            device_alloc_calls: r(&c.device_alloc),
            device_free_calls: r(&c.device_free),
            vmm_create_calls: r(&c.vmm_create),
            vmm_release_calls: r(&c.vmm_release),
            vmm_map_calls: r(&c.vmm_map),
            vmm_unmap_calls: r(&c.vmm_unmap),
            vmm_set_access_calls: r(&c.vmm_set_access),
        }
    }

    fn stream_create(&self) -> Result<RawStream> {
        self.cu_stream_create()
    }
    fn stream_wrap_native(&self, native: u64) -> Result<RawStream> {
        self.cu_stream_wrap_native(native)
    }
    fn stream_native(&self, s: RawStream) -> Result<u64> {
        Ok(self.stream(s)?.0 as u64)
    }
    fn stream_destroy(&self, s: RawStream) -> Result<()> {
        self.cu_stream_destroy(s)
    }
    fn stream_synchronize(&self, s: RawStream) -> Result<()> {
        self.cu_stream_synchronize(s)
    }
    fn stream_wait_event(&self, s: RawStream, e: RawEvent) -> Result<()> {
        self.cu_stream_wait_event(s, e)
    }

    fn event_create(&self, timing: bool) -> Result<RawEvent> {
        self.cu_event_create(timing)
    }
    fn event_destroy(&self, e: RawEvent) -> Result<()> {
        self.cu_event_destroy(e)
    }
    fn event_record(&self, e: RawEvent, s: RawStream) -> Result<()> {
        self.cu_event_record(e, s)
    }
    fn event_query(&self, e: RawEvent) -> Result<bool> {
        self.cu_event_query(e)
    }
    fn event_synchronize(&self, e: RawEvent) -> Result<()> {
        self.cu_event_synchronize(e)
    }
    fn event_elapsed_ms(&self, start: RawEvent, end: RawEvent) -> Result<f32> {
        self.cu_event_elapsed_ms(start, end)
    }

    fn pinned_alloc(&self, bytes: usize) -> Result<*mut u8> {
        self.cu_pinned_alloc(bytes)
    }
    unsafe fn pinned_free(&self, p: *mut u8) -> Result<()> {
        // SAFETY: forwarded contract (see the trait).
        unsafe { self.cu_pinned_free(p) }
    }
    unsafe fn host_register(&self, p: *mut u8, len: usize, read_only: bool) -> Result<()> {
        // SAFETY: forwarded contract (see the trait).
        unsafe { self.cu_host_register(p, len, read_only, false) }
    }
    unsafe fn host_register_portable(&self, p: *mut u8, len: usize, read_only: bool) -> Result<()> {
        // SAFETY: forwarded contract (see the trait).
        unsafe { self.cu_host_register(p, len, read_only, true) }
    }
    unsafe fn host_unregister(&self, p: *mut u8) -> Result<()> {
        // SAFETY: forwarded contract (see the trait).
        unsafe { self.cu_host_unregister(p) }
    }
    fn host_is_page_locked(&self, p: *const u8, len: usize) -> bool {
        lock(&self.host).is_page_locked(p as usize, len)
            || crate::device::portable::contains(DeviceKind::Cuda, p as usize, len)
    }

    fn mem_alloc(&self, bytes: usize) -> Result<DevicePtr> {
        self.cu_mem_alloc(bytes)
    }
    fn mem_free(&self, p: DevicePtr) -> Result<()> {
        self.cu_mem_free(p)
    }

    unsafe fn memcpy_htod_async(&self, dst: DevicePtr, src: *const u8, n: usize, s: RawStream) -> Result<()> {
        // SAFETY: forwarded contract (see the trait).
        unsafe { self.cu_memcpy_htod(dst, src, n, s) }
    }
    unsafe fn memcpy_dtoh_async(&self, dst: *mut u8, src: DevicePtr, n: usize, s: RawStream) -> Result<()> {
        // SAFETY: forwarded contract (see the trait).
        unsafe { self.cu_memcpy_dtoh(dst, src, n, s) }
    }
    fn memcpy_dtod_async(&self, dst: DevicePtr, src: DevicePtr, n: usize, s: RawStream) -> Result<()> {
        self.cu_memcpy_dtod(dst, src, n, s)
    }
    fn memset_d8_async(&self, dst: DevicePtr, value: u8, n: usize, s: RawStream) -> Result<()> {
        self.cu_memset_d8(dst, value, n, s)
    }

    fn checksum_async(&self, p: DevicePtr, n: usize, out: DevicePtr, s: RawStream) -> Result<()> {
        self.cu_checksum(p, n, out, s)
    }
    fn decode_async(
        &self,
        src: DevicePtr,
        src_len: usize,
        dst: DevicePtr,
        dst_len: usize,
        desc: &crate::codec::DecodeDesc,
        s: RawStream,
    ) -> Result<()> {
        check_decode(src, src_len, dst, dst_len, desc)?;
        self.cu_decode(src, dst, &desc.whole(), s)
    }
    fn decode_piece_async(
        &self,
        src: DevicePtr,
        dst: DevicePtr,
        piece: &crate::codec::DecodePiece,
        s: RawStream,
    ) -> Result<()> {
        self.cu_decode(src, dst, piece, s)
    }
    fn spin_async(&self, micros: u32, s: RawStream) -> Result<()> {
        self.cu_spin(micros, s)
    }
    fn hold_async(&self, s: RawStream, gate: &crate::device::Gate) -> Result<()> {
        self.cu_hold(s, gate)
    }

    fn vmm_granularity(&self) -> usize {
        self.info.granularity
    }
    fn vmm_create(&self, bytes: usize) -> Result<RawPhys> {
        self.cu_vmm_create(bytes)
    }
    fn vmm_release(&self, h: RawPhys) -> Result<()> {
        self.cu_vmm_release(h)
    }
    fn vmm_reserve(&self, bytes: usize, align: usize) -> Result<DevicePtr> {
        self.cu_vmm_reserve(bytes, align)
    }
    fn vmm_free_va(&self, va: DevicePtr, bytes: usize) -> Result<()> {
        self.cu_vmm_free_va(va, bytes)
    }
    fn vmm_map(&self, va: DevicePtr, bytes: usize, h: RawPhys, offset: usize) -> Result<()> {
        crate::device::check_map_offset(offset)?;
        self.cu_vmm_map(va, bytes, h, offset)
    }
    fn vmm_unmap(&self, va: DevicePtr, bytes: usize) -> Result<()> {
        self.cu_vmm_unmap(va, bytes)
    }
    fn vmm_set_access(&self, va: DevicePtr, bytes: usize, access: Access) -> Result<()> {
        self.cu_vmm_set_access(va, bytes, access)
    }
}

#[cfg(test)]
mod tests;
