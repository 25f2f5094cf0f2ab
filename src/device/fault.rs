//! Fault injection: a [`Device`] wrapper that fails the Nth call of a chosen
//! kind, so tests can prove every call site cleans up after a device error.
//!
//! Use it from Rust tests with [`FaultyDevice::new`] and
//! [`FaultyDevice::fail_nth`], or from any process (C tests, the demo) with
//! `EPM_FAULT=kind:n[,kind:n...]`, which [`super::open`] honours: e.g.
//! `EPM_FAULT=map:3,copy:10` fails the 3rd map and the 10th copy. Counting
//! starts when the device is opened. An injected failure has the status the
//! real call would most plausibly give and a message starting "injected fault".
//!
//! Test machinery: this module exists only in test builds and in builds with
//! the `testing` cargo feature (every `cargo test` turns it on, and the C
//! tests link target/testing/); the default build, which `make install`
//! ships, ignores `EPM_FAULT`.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::*;

/// The kinds of device call a fault can target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// pinned_alloc
    PinnedAlloc,
    /// host_register
    HostRegister,
    /// mem_alloc
    DeviceAlloc,
    /// vmm_create
    VmmCreate,
    /// vmm_reserve
    Reserve,
    /// vmm_map
    Map,
    /// vmm_set_access
    SetAccess,
    /// any memcpy/memset/checksum/decode enqueue
    Copy,
    /// event_create / event_record
    Event,
    /// stream_create
    Stream,
}

impl FaultKind {
    pub const ALL: [FaultKind; 10] = [
        FaultKind::PinnedAlloc,
        FaultKind::HostRegister,
        FaultKind::DeviceAlloc,
        FaultKind::VmmCreate,
        FaultKind::Reserve,
        FaultKind::Map,
        FaultKind::SetAccess,
        FaultKind::Copy,
        FaultKind::Event,
        FaultKind::Stream,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::PinnedAlloc => "pinned_alloc",
            FaultKind::HostRegister => "host_register",
            FaultKind::DeviceAlloc => "device_alloc",
            FaultKind::VmmCreate => "vmm_create",
            FaultKind::Reserve => "reserve",
            FaultKind::Map => "map",
            FaultKind::SetAccess => "set_access",
            FaultKind::Copy => "copy",
            FaultKind::Event => "event",
            FaultKind::Stream => "stream",
        }
    }

    pub fn parse(s: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|k| k.name() == s).ok_or_else(|| {
            let names: Vec<_> = Self::ALL.iter().map(|k| k.name()).collect();
            Error::new(EpmStatus::InvalidConfig, format!("EPM_FAULT kind {s:?} is not one of {}", names.join(", ")))
        })
    }

    fn status(self) -> EpmStatus {
        match self {
            FaultKind::PinnedAlloc | FaultKind::HostRegister => EpmStatus::OutOfHostMemory,
            FaultKind::DeviceAlloc | FaultKind::VmmCreate => EpmStatus::OutOfDeviceMemory,
            _ => EpmStatus::CudaError,
        }
    }
}

/// A device that forwards to another and fails chosen calls.
#[derive(Debug)]
pub struct FaultyDevice {
    inner: Arc<dyn Device>,
    calls: [AtomicU64; 10],
    /// (kind, the 1-based call number that fails)
    plan: Mutex<Vec<(FaultKind, u64)>>,
    injected: AtomicU64,
    /// Stream-ordering calls by method: see [`FaultyDevice::ordering_calls`].
    ordering: [AtomicU64; 5],
}

/// Calls of the stream-ordering methods (each a driver call on CUDA), as
/// [`FaultyDevice::ordering_calls`] counts them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OrderingCalls {
    pub event_create: u64,
    pub event_record: u64,
    pub stream_wait_event: u64,
    pub event_query: u64,
    pub event_elapsed: u64,
}

impl FaultyDevice {
    pub fn new(inner: Arc<dyn Device>) -> Self {
        Self {
            inner,
            calls: Default::default(),
            plan: Mutex::new(Vec::new()),
            injected: AtomicU64::new(0),
            ordering: Default::default(),
        }
    }

    /// Parse `kind:n[,kind:n...]` (the `EPM_FAULT` syntax).
    pub fn parse_plan(spec: &str) -> Result<Vec<(FaultKind, u64)>> {
        spec.split(',')
            .filter(|p| !p.trim().is_empty())
            .map(|p| {
                let (k, n) = p.trim().split_once(':').ok_or_else(|| {
                    Error::new(EpmStatus::InvalidConfig, format!("EPM_FAULT entry {p:?} is not kind:n"))
                })?;
                let n: u64 = n.parse().ok().filter(|&n| n > 0).ok_or_else(|| {
                    Error::new(EpmStatus::InvalidConfig, format!("EPM_FAULT entry {p:?}: n must be a positive integer"))
                })?;
                Ok((FaultKind::parse(k)?, n))
            })
            .collect()
    }

    /// Fail the `n`th call (1-based, counted from now) of `kind`.
    pub fn fail_nth(&self, kind: FaultKind, n: u64) {
        let already = self.calls(kind);
        self.plan.lock().unwrap_or_else(|p| p.into_inner()).push((kind, already + n));
    }

    /// Forget every planned fault.
    pub fn clear(&self) {
        self.plan.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Calls of `kind` so far.
    pub fn calls(&self, kind: FaultKind) -> u64 {
        self.calls[kind as usize].load(Ordering::Relaxed)
    }

    /// Faults injected so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    /// Stream-ordering calls so far (events created, recorded, waited on by
    /// a stream, queried, timed), for tests that bound the driver calls an
    /// operation makes on the caller's thread.
    pub fn ordering_calls(&self) -> OrderingCalls {
        let n = |i: usize| self.ordering[i].load(Ordering::Relaxed);
        OrderingCalls {
            event_create: n(0),
            event_record: n(1),
            stream_wait_event: n(2),
            event_query: n(3),
            event_elapsed: n(4),
        }
    }

    fn count(&self, i: usize) {
        self.ordering[i].fetch_add(1, Ordering::Relaxed);
    }

    pub fn inner(&self) -> &Arc<dyn Device> {
        &self.inner
    }

    fn hit(&self, kind: FaultKind) -> Result<()> {
        let n = self.calls[kind as usize].fetch_add(1, Ordering::Relaxed) + 1;
        let mut plan = self.plan.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = plan.iter().position(|&(k, at)| k == kind && at == n) {
            plan.swap_remove(i);
            self.injected.fetch_add(1, Ordering::Relaxed);
            return Err(Error::new(kind.status(), format!("injected fault: {} call #{n}", kind.name())));
        }
        Ok(())
    }
}

impl Device for FaultyDevice {
    fn info(&self) -> &DeviceInfo {
        self.inner.info()
    }
    fn mem_get_info(&self) -> Result<(u64, u64)> {
        self.inner.mem_get_info()
    }
    fn synchronize(&self) -> Result<()> {
        self.inner.synchronize()
    }
    fn live_counts(&self) -> LiveCounts {
        self.inner.live_counts()
    }
    fn driver_counts(&self) -> DriverCounts {
        self.inner.driver_counts()
    }
    fn stream_create(&self) -> Result<RawStream> {
        self.hit(FaultKind::Stream)?;
        self.inner.stream_create()
    }
    fn stream_wrap_native(&self, native: u64) -> Result<RawStream> {
        self.inner.stream_wrap_native(native)
    }
    fn stream_native(&self, s: RawStream) -> Result<u64> {
        self.inner.stream_native(s)
    }
    fn stream_destroy(&self, s: RawStream) -> Result<()> {
        self.inner.stream_destroy(s)
    }
    fn stream_synchronize(&self, s: RawStream) -> Result<()> {
        self.inner.stream_synchronize(s)
    }
    fn stream_wait_event(&self, s: RawStream, e: RawEvent) -> Result<()> {
        self.count(2);
        self.hit(FaultKind::Event)?;
        self.inner.stream_wait_event(s, e)
    }
    fn event_create(&self, timing: bool) -> Result<RawEvent> {
        self.count(0);
        self.hit(FaultKind::Event)?;
        self.inner.event_create(timing)
    }
    fn event_destroy(&self, e: RawEvent) -> Result<()> {
        self.inner.event_destroy(e)
    }
    fn event_record(&self, e: RawEvent, s: RawStream) -> Result<()> {
        self.count(1);
        self.hit(FaultKind::Event)?;
        self.inner.event_record(e, s)
    }
    fn event_query(&self, e: RawEvent) -> Result<bool> {
        self.count(3);
        self.inner.event_query(e)
    }
    fn event_synchronize(&self, e: RawEvent) -> Result<()> {
        self.inner.event_synchronize(e)
    }
    fn event_elapsed_ms(&self, start: RawEvent, end: RawEvent) -> Result<f32> {
        self.count(4);
        self.inner.event_elapsed_ms(start, end)
    }
    fn pinned_alloc(&self, bytes: usize) -> Result<*mut u8> {
        self.hit(FaultKind::PinnedAlloc)?;
        self.inner.pinned_alloc(bytes)
    }
    unsafe fn pinned_free(&self, p: *mut u8) -> Result<()> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.pinned_free(p) }
    }
    unsafe fn host_register(&self, p: *mut u8, len: usize, read_only: bool) -> Result<()> {
        self.hit(FaultKind::HostRegister)?;
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.host_register(p, len, read_only) }
    }
    unsafe fn host_register_portable(&self, p: *mut u8, len: usize, read_only: bool) -> Result<()> {
        self.hit(FaultKind::HostRegister)?;
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.host_register_portable(p, len, read_only) }
    }
    unsafe fn host_unregister(&self, p: *mut u8) -> Result<()> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.host_unregister(p) }
    }
    fn host_is_page_locked(&self, p: *const u8, len: usize) -> bool {
        self.inner.host_is_page_locked(p, len)
    }
    fn mem_alloc(&self, bytes: usize) -> Result<DevicePtr> {
        self.hit(FaultKind::DeviceAlloc)?;
        self.inner.mem_alloc(bytes)
    }
    fn mem_free(&self, p: DevicePtr) -> Result<()> {
        self.inner.mem_free(p)
    }
    unsafe fn memcpy_htod_async(&self, dst: DevicePtr, src: *const u8, n: usize, s: RawStream) -> Result<()> {
        self.hit(FaultKind::Copy)?;
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.memcpy_htod_async(dst, src, n, s) }
    }
    unsafe fn memcpy_dtoh_async(&self, dst: *mut u8, src: DevicePtr, n: usize, s: RawStream) -> Result<()> {
        self.hit(FaultKind::Copy)?;
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.memcpy_dtoh_async(dst, src, n, s) }
    }
    fn memcpy_dtod_async(&self, dst: DevicePtr, src: DevicePtr, n: usize, s: RawStream) -> Result<()> {
        self.hit(FaultKind::Copy)?;
        self.inner.memcpy_dtod_async(dst, src, n, s)
    }
    fn memset_d8_async(&self, dst: DevicePtr, value: u8, n: usize, s: RawStream) -> Result<()> {
        self.hit(FaultKind::Copy)?;
        self.inner.memset_d8_async(dst, value, n, s)
    }
    fn checksum_async(&self, p: DevicePtr, n: usize, out: DevicePtr, s: RawStream) -> Result<()> {
        self.hit(FaultKind::Copy)?;
        self.inner.checksum_async(p, n, out, s)
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
        self.hit(FaultKind::Copy)?;
        self.inner.decode_async(src, src_len, dst, dst_len, desc, s)
    }
    fn decode_piece_async(
        &self,
        src: DevicePtr,
        dst: DevicePtr,
        piece: &crate::codec::DecodePiece,
        s: RawStream,
    ) -> Result<()> {
        self.hit(FaultKind::Copy)?;
        self.inner.decode_piece_async(src, dst, piece, s)
    }
    fn spin_async(&self, micros: u32, s: RawStream) -> Result<()> {
        self.inner.spin_async(micros, s)
    }
    fn hold_async(&self, s: RawStream, gate: &crate::device::Gate) -> Result<()> {
        self.inner.hold_async(s, gate)
    }
    fn vmm_granularity(&self) -> usize {
        self.inner.vmm_granularity()
    }
    fn vmm_create(&self, bytes: usize) -> Result<RawPhys> {
        self.hit(FaultKind::VmmCreate)?;
        self.inner.vmm_create(bytes)
    }
    fn vmm_release(&self, h: RawPhys) -> Result<()> {
        self.inner.vmm_release(h)
    }
    fn vmm_reserve(&self, bytes: usize, align: usize) -> Result<DevicePtr> {
        self.hit(FaultKind::Reserve)?;
        self.inner.vmm_reserve(bytes, align)
    }
    fn vmm_free_va(&self, va: DevicePtr, bytes: usize) -> Result<()> {
        self.inner.vmm_free_va(va, bytes)
    }
    fn vmm_map(&self, va: DevicePtr, bytes: usize, h: RawPhys, offset: usize) -> Result<()> {
        self.hit(FaultKind::Map)?;
        self.inner.vmm_map(va, bytes, h, offset)
    }
    fn vmm_unmap(&self, va: DevicePtr, bytes: usize) -> Result<()> {
        self.inner.vmm_unmap(va, bytes)
    }
    fn vmm_set_access(&self, va: DevicePtr, bytes: usize, access: Access) -> Result<()> {
        self.hit(FaultKind::SetAccess)?;
        self.inner.vmm_set_access(va, bytes, access)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_parses_and_rejects_bad_entries() {
        let p = FaultyDevice::parse_plan("map:3, copy:10").unwrap();
        assert_eq!(p, vec![(FaultKind::Map, 3), (FaultKind::Copy, 10)]);
        assert_eq!(FaultyDevice::parse_plan("warp:1").unwrap_err().status(), EpmStatus::InvalidConfig);
        assert_eq!(FaultyDevice::parse_plan("map").unwrap_err().status(), EpmStatus::InvalidConfig);
        assert_eq!(FaultyDevice::parse_plan("map:0").unwrap_err().status(), EpmStatus::InvalidConfig);
        assert!(FaultyDevice::parse_plan("").unwrap().is_empty());
    }
}
