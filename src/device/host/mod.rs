//! The host device: a [`Device`] with no GPU, real enough that the core's
//! tests mean something.
//!
//! - VMM is real ([`vmm`]): memfd granules, `PROT_NONE` reservations,
//!   `MAP_FIXED|MAP_SHARED` maps, `mprotect` access.
//! - "Device memory" is host memory; every device range is in one table
//!   ([`space`]) and every copy is checked against it, so a bad address or a
//!   write into a read-only mapping is an error, never a SIGSEGV.
//! - Streams are worker threads ([`stream`]), events sequence numbers ([`event`]).
//! - Pinned memory is mmap + best-effort mlock ([`pinned`]).

mod event;
mod pinned;
mod space;
mod stream;
mod sys;
mod vmm;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use self::event::EventShared;
use self::pinned::HostMem;
use self::space::{AddrSpace, Need};
use self::stream::{HostStream, MemOp, Op, StreamShared, lock};
use self::vmm::Phys;
use super::portable;
use super::*;

/// The H200's VMM granularity; the host device mimics it so sizes and
/// rounding in the core behave as they will on the GPU.
const DEFAULT_GRANULARITY: usize = 2 << 20;

/// Read `EPM_HOST_GRANULARITY` (bytes): a positive multiple of the page size.
fn granularity_from_env() -> Result<usize> {
    match std::env::var("EPM_HOST_GRANULARITY") {
        Err(std::env::VarError::NotPresent) => parse_granularity(None, sys::page_size()),
        Err(e) => Err(Error::new(EpmStatus::InvalidConfig, format!("EPM_HOST_GRANULARITY: {e}"))),
        Ok(v) => parse_granularity(Some(&v), sys::page_size()),
    }
}

fn parse_granularity(v: Option<&str>, page: usize) -> Result<usize> {
    let Some(v) = v else { return Ok(DEFAULT_GRANULARITY) };
    match v.trim().parse::<usize>() {
        Ok(g) if g > 0 && g.is_multiple_of(page) => Ok(g),
        _ => Err(Error::new(
            EpmStatus::InvalidConfig,
            format!("EPM_HOST_GRANULARITY={v:?} is not a positive multiple of the page size {page}"),
        )),
    }
}

/// Handle ids for streams, events and physical handles of every host device
/// come from one counter, so a handle of one kind (or of another device) is
/// never valid here, and small integers are never handles at all.
static NEXT_ID: AtomicU64 = AtomicU64::new(0x1_0000);

#[derive(Debug)]
pub struct HostDevice {
    info: DeviceInfo,
    space: Arc<RwLock<AddrSpace>>,
    phys: Mutex<HashMap<u64, Phys>>,
    streams: Mutex<HashMap<u64, HostStream>>,
    events: Mutex<HashMap<u64, Arc<EventShared>>>,
    host: Mutex<HostMem>,
    counts: Mutex<DriverCounts>,
    /// Names this instance in the process-wide portable table (two host
    /// devices at one ordinal are still two devices).
    instance: u64,
}

impl HostDevice {
    /// Open the host device. Any ordinal opens an independent host device.
    /// The granularity comes from `EPM_HOST_GRANULARITY` (default 2 MiB).
    pub fn new(ordinal: u32) -> Result<Self> {
        Self::with_granularity(ordinal, granularity_from_env()?)
    }

    /// Open with an explicit granularity (a positive multiple of the page size).
    pub fn with_granularity(ordinal: u32, granularity: usize) -> Result<Self> {
        let page = sys::page_size();
        crate::ensure!(
            granularity > 0 && granularity.is_multiple_of(page),
            InvalidConfig,
            "granularity {granularity} is not a positive multiple of the page size {page}"
        );
        let (_, total) = sys::ram()?;
        let info = DeviceInfo {
            kind: DeviceKind::Host,
            ordinal,
            name: "host (memfd VMM)".into(),
            total_mem: total,
            granularity,
            pci_bus_id: None,
            compute_capability: (0, 0),
            driver_version: 0,
        };
        Ok(Self {
            info,
            space: Arc::new(RwLock::new(AddrSpace::new(granularity))),
            phys: Mutex::default(),
            streams: Mutex::default(),
            events: Mutex::default(),
            host: Mutex::default(),
            counts: Mutex::default(),
            instance: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// Pinned allocations whose mlock was refused (they work, unlocked).
    pub fn mlock_failures(&self) -> u64 {
        lock(&self.host).mlock_failures
    }

    fn id(&self) -> u64 {
        NEXT_ID.fetch_add(1, Ordering::Relaxed)
    }
    fn count(&self, f: impl FnOnce(&mut DriverCounts)) {
        f(&mut lock(&self.counts));
    }
    fn read(&self) -> RwLockReadGuard<'_, AddrSpace> {
        self.space.read().unwrap_or_else(|e| e.into_inner())
    }
    fn write(&self) -> RwLockWriteGuard<'_, AddrSpace> {
        self.space.write().unwrap_or_else(|e| e.into_inner())
    }
    fn stream(&self, s: RawStream) -> Result<Arc<StreamShared>> {
        lock(&self.streams)
            .get(&s.0)
            .map(|st| st.shared.clone())
            .ok_or_else(|| Error::new(EpmStatus::InvalidHandle, format!("unknown stream handle {:#x}", s.0)))
    }
    fn event(&self, e: RawEvent) -> Result<Arc<EventShared>> {
        lock(&self.events)
            .get(&e.0)
            .cloned()
            .ok_or_else(|| Error::new(EpmStatus::InvalidHandle, format!("unknown event handle {:#x}", e.0)))
    }

    /// Check the device ranges now, then queue `op` to run on `s` (where they
    /// are checked again). `host` is the host side of an H2D/D2H copy: if it
    /// points into device memory it is checked like a device range (so even a
    /// confused caller cannot make the stream thread fault), and a D2H
    /// destination in a read-only registration is refused.
    fn enqueue_mem(
        &self,
        s: RawStream,
        op: MemOp,
        mut checks: Vec<(DevicePtr, usize, Need)>,
        host: Option<(usize, usize, Need)>,
    ) -> Result<()> {
        let stream = self.stream(s)?;
        if let Some((p, n, need)) = host.filter(|&(_, n, _)| n > 0) {
            let end = p.checked_add(n).ok_or_else(|| Error::invalid_argument("host range wraps around"))?;
            crate::ensure!(
                need == Need::Read
                    || !(lock(&self.host).overlaps_read_only(p, end)
                        || portable::overlaps_read_only(DeviceKind::Host, p, n)),
                AccessDenied,
                "D2H destination {p:#x}+{n} is host memory registered read-only"
            );
            if self.read().touches(p, end) {
                checks.push((p as DevicePtr, n, need));
            }
        }
        {
            let sp = self.read();
            for &(addr, n, need) in &checks {
                sp.check(addr, n, need)?;
            }
        }
        stream.push(Op::Mem { op, checks })?;
        Ok(())
    }
}

impl HostDevice {
    /// Register in this device's table; a portable registration also goes
    /// into the process-wide table every host device consults, as CUDA's
    /// PORTABLE flag makes a range pinned for every context.
    ///
    /// # Safety
    /// As for [`Device::host_register`].
    unsafe fn register(&self, p: *mut u8, len: usize, read_only: bool, portable: bool) -> Result<()> {
        let a = p.expose_provenance();
        // Bytes another host device registered portably are already pinned
        // for this one too: a second registration is refused, as CUDA does.
        crate::ensure!(
            a == 0 || len == 0 || !portable::overlaps(DeviceKind::Host, a, len),
            InvalidState,
            "host range {a:#x}+{len} overlaps a portable registration made through another host device"
        );
        let mut host = lock(&self.host);
        host.register(a, len, read_only)?;
        if portable && let Err(e) = portable::insert(DeviceKind::Host, self.instance, a, len, read_only) {
            host.unregister(a)?;
            return Err(e);
        }
        drop(host);
        self.count(|c| c.host_register_calls += 1);
        Ok(())
    }
}

impl Drop for HostDevice {
    fn drop(&mut self) {
        // Streams first: joining them lets queued copies finish before the
        // memory they touch goes away.
        let streams = std::mem::take(&mut *lock(&self.streams));
        drop(streams);
        self.write().release_all();
        let mut host = lock(&self.host);
        // A registration outliving its device (a leak upstream) must not keep
        // claiming the bytes for every other host device.
        for &p in host.registered.keys() {
            portable::remove(DeviceKind::Host, self.instance, p);
        }
        host.release_all();
    }
}

fn host_addr(p: *const u8, n: usize, what: &str) -> Result<usize> {
    crate::ensure!(!p.is_null() || n == 0, NullPointer, "{what} host pointer is NULL");
    Ok(p.expose_provenance())
}

impl Device for HostDevice {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }
    fn mem_get_info(&self) -> Result<(u64, u64)> {
        sys::ram()
    }
    fn synchronize(&self) -> Result<()> {
        let all: Vec<_> = lock(&self.streams).values().map(|s| s.shared.clone()).collect();
        let mut first_err = None;
        for s in all {
            if let Err(e) = s.synchronize() {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
    fn live_counts(&self) -> LiveCounts {
        let (device_allocations, device_bytes, va_reservations, mappings) = {
            let sp = self.read();
            let (a, b, r) = sp.counts();
            (a, b, r, sp.mappings)
        };
        let (physical_handles, physical_bytes) = {
            let ph = lock(&self.phys);
            (ph.len() as u64, ph.values().map(|p| p.len as u64).sum())
        };
        let host = lock(&self.host);
        LiveCounts {
            streams: lock(&self.streams).len() as u64,
            events: lock(&self.events).len() as u64,
            pinned_buffers: host.pinned.len() as u64,
            pinned_bytes: host.pinned_bytes(),
            host_registrations: host.registered.len() as u64,
            device_allocations,
            device_bytes,
            physical_handles,
            physical_bytes,
            va_reservations,
            mappings,
        }
    }
    fn driver_counts(&self) -> DriverCounts {
        *lock(&self.counts)
    }

    // ---- streams -------------------------------------------------------
    fn stream_create(&self) -> Result<RawStream> {
        let id = self.id();
        let st = HostStream::spawn(id, self.space.clone())?;
        lock(&self.streams).insert(id, st);
        Ok(RawStream(id))
    }
    fn stream_wrap_native(&self, _native: u64) -> Result<RawStream> {
        Err(Error::unsupported("the host device has no native streams to adopt"))
    }
    fn stream_native(&self, s: RawStream) -> Result<u64> {
        self.stream(s).map(|_| 0)
    }
    fn stream_destroy(&self, s: RawStream) -> Result<()> {
        let st = lock(&self.streams)
            .remove(&s.0)
            .ok_or_else(|| Error::new(EpmStatus::InvalidHandle, format!("unknown stream handle {:#x}", s.0)))?;
        // Joins the worker outside the table lock: queued work finishes first.
        drop(st);
        Ok(())
    }
    fn stream_synchronize(&self, s: RawStream) -> Result<()> {
        self.stream(s)?.synchronize()
    }
    fn stream_wait_event(&self, s: RawStream, e: RawEvent) -> Result<()> {
        let stream = self.stream(s)?;
        if let Some((on, seq)) = self.event(e)?.pending() {
            stream.push(Op::Wait { on, seq })?;
        }
        Ok(())
    }

    // ---- events --------------------------------------------------------
    fn event_create(&self, timing: bool) -> Result<RawEvent> {
        let id = self.id();
        lock(&self.events).insert(id, Arc::new(EventShared::new(timing)));
        Ok(RawEvent(id))
    }
    fn event_destroy(&self, e: RawEvent) -> Result<()> {
        lock(&self.events)
            .remove(&e.0)
            .map(|_| ())
            .ok_or_else(|| Error::new(EpmStatus::InvalidHandle, format!("unknown event handle {:#x}", e.0)))
    }
    fn event_record(&self, e: RawEvent, s: RawStream) -> Result<()> {
        let stream = self.stream(s)?;
        self.event(e)?.record(&stream)
    }
    fn event_query(&self, e: RawEvent) -> Result<bool> {
        Ok(self.event(e)?.pending().is_none())
    }
    fn event_synchronize(&self, e: RawEvent) -> Result<()> {
        self.event(e)?.synchronize();
        Ok(())
    }
    fn event_elapsed_ms(&self, start: RawEvent, end: RawEvent) -> Result<f32> {
        let (a, b) = (self.event(start)?.completed_at()?, self.event(end)?.completed_at()?);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let v = if b >= a { ms(b - a) } else { -ms(a - b) };
        Ok(v as f32)
    }

    // ---- host memory ---------------------------------------------------
    fn pinned_alloc(&self, bytes: usize) -> Result<*mut u8> {
        let p = lock(&self.host).alloc(bytes)?;
        self.count(|c| c.pinned_alloc_calls += 1);
        Ok(std::ptr::with_exposed_provenance_mut(p))
    }
    unsafe fn pinned_free(&self, p: *mut u8) -> Result<()> {
        lock(&self.host).free(p.expose_provenance())?;
        self.count(|c| c.pinned_free_calls += 1);
        Ok(())
    }
    unsafe fn host_register(&self, p: *mut u8, len: usize, read_only: bool) -> Result<()> {
        // SAFETY: forwarded contract (see the trait).
        unsafe { self.register(p, len, read_only, false) }
    }
    unsafe fn host_register_portable(&self, p: *mut u8, len: usize, read_only: bool) -> Result<()> {
        // SAFETY: forwarded contract (see the trait).
        unsafe { self.register(p, len, read_only, true) }
    }
    unsafe fn host_unregister(&self, p: *mut u8) -> Result<()> {
        let a = p.expose_provenance();
        lock(&self.host).unregister(a)?;
        portable::remove(DeviceKind::Host, self.instance, a);
        Ok(())
    }
    fn host_is_page_locked(&self, p: *const u8, len: usize) -> bool {
        let a = p.expose_provenance();
        !p.is_null() && (lock(&self.host).is_page_locked(a, len) || portable::contains(DeviceKind::Host, a, len))
    }

    // ---- device memory -------------------------------------------------
    fn mem_alloc(&self, bytes: usize) -> Result<DevicePtr> {
        let p = self.write().alloc(bytes)?;
        self.count(|c| c.device_alloc_calls += 1);
        Ok(p)
    }
    fn mem_free(&self, p: DevicePtr) -> Result<()> {
        self.write().free(p)?;
        self.count(|c| c.device_free_calls += 1);
        Ok(())
    }

    // ---- copies --------------------------------------------------------
    unsafe fn memcpy_htod_async(&self, dst: DevicePtr, src: *const u8, n: usize, s: RawStream) -> Result<()> {
        let src = host_addr(src, n, "source")?;
        let op = MemOp::Copy { dst: dst as usize, src, n };
        self.enqueue_mem(s, op, vec![(dst, n, Need::Write)], Some((src, n, Need::Read)))
    }
    unsafe fn memcpy_dtoh_async(&self, dst: *mut u8, src: DevicePtr, n: usize, s: RawStream) -> Result<()> {
        let dst = host_addr(dst, n, "destination")?;
        let op = MemOp::Copy { dst, src: src as usize, n };
        self.enqueue_mem(s, op, vec![(src, n, Need::Read)], Some((dst, n, Need::Write)))
    }
    fn memcpy_dtod_async(&self, dst: DevicePtr, src: DevicePtr, n: usize, s: RawStream) -> Result<()> {
        let op = MemOp::Copy { dst: dst as usize, src: src as usize, n };
        self.enqueue_mem(s, op, vec![(src, n, Need::Read), (dst, n, Need::Write)], None)
    }
    fn memset_d8_async(&self, dst: DevicePtr, value: u8, n: usize, s: RawStream) -> Result<()> {
        let op = MemOp::Fill { dst: dst as usize, value, n };
        self.enqueue_mem(s, op, vec![(dst, n, Need::Write)], None)
    }
    fn checksum_async(&self, p: DevicePtr, n: usize, out: DevicePtr, s: RawStream) -> Result<()> {
        crate::ensure!(n.is_multiple_of(4), InvalidArgument, "checksum length {n} is not a multiple of 4");
        let op = MemOp::Checksum { p: p as usize, n, out: out as usize };
        self.enqueue_mem(s, op, vec![(p, n, Need::Read), (out, 8, Need::Write)], None)
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
        self.decode_piece_async(src, dst, &desc.whole(), s)
    }
    fn decode_piece_async(
        &self,
        src: DevicePtr,
        dst: DevicePtr,
        piece: &crate::codec::DecodePiece,
        s: RawStream,
    ) -> Result<()> {
        check_piece(src, dst, piece)?;
        let (src_len, dst_len) = (piece.staged_len(), piece.raw_len());
        let op = MemOp::Decode { src: src as usize, src_len, dst: dst as usize, dst_len, piece: Box::new(*piece) };
        self.enqueue_mem(s, op, vec![(src, src_len, Need::Read), (dst, dst_len, Need::Write)], None)
    }
    fn spin_async(&self, micros: u32, s: RawStream) -> Result<()> {
        self.stream(s)?.push(Op::Spin(Duration::from_micros(micros.into())))?;
        Ok(())
    }
    fn hold_async(&self, s: RawStream, gate: &crate::device::Gate) -> Result<()> {
        self.stream(s)?.push(Op::Hold(gate.shared()))?;
        Ok(())
    }

    // ---- VMM -----------------------------------------------------------
    fn vmm_granularity(&self) -> usize {
        self.info.granularity
    }
    fn vmm_create(&self, bytes: usize) -> Result<RawPhys> {
        let p = Phys::create(bytes, self.info.granularity)?;
        let id = self.id();
        lock(&self.phys).insert(id, p);
        self.count(|c| c.vmm_create_calls += 1);
        Ok(RawPhys(id))
    }
    fn vmm_release(&self, h: RawPhys) -> Result<()> {
        // Closing the memfd leaves mapped pages alive until their last unmap.
        lock(&self.phys)
            .remove(&h.0)
            .ok_or_else(|| Error::new(EpmStatus::InvalidHandle, format!("unknown physical handle {:#x}", h.0)))?;
        self.count(|c| c.vmm_release_calls += 1);
        Ok(())
    }
    fn vmm_reserve(&self, bytes: usize, align: usize) -> Result<DevicePtr> {
        self.write().reserve(bytes, align)
    }
    fn vmm_free_va(&self, va: DevicePtr, bytes: usize) -> Result<()> {
        self.write().free_va(va, bytes)
    }
    fn vmm_map(&self, va: DevicePtr, bytes: usize, h: RawPhys, offset: usize) -> Result<()> {
        super::check_map_offset(offset)?;
        // Lock order everywhere: phys table, then address space.
        let phys = lock(&self.phys);
        let p = phys
            .get(&h.0)
            .ok_or_else(|| Error::new(EpmStatus::InvalidHandle, format!("unknown physical handle {:#x}", h.0)))?;
        self.write().map(va, bytes, h.0, p, offset)?;
        self.count(|c| c.vmm_map_calls += 1);
        Ok(())
    }
    fn vmm_unmap(&self, va: DevicePtr, bytes: usize) -> Result<()> {
        self.write().unmap(va, bytes)?;
        self.count(|c| c.vmm_unmap_calls += 1);
        Ok(())
    }
    fn vmm_set_access(&self, va: DevicePtr, bytes: usize, access: Access) -> Result<()> {
        self.write().set_access(va, bytes, access)?;
        self.count(|c| c.vmm_set_access_calls += 1);
        Ok(())
    }
}
