//! `OrtDataTransferImpl`: copies between plain CPU memory and epmem's device
//! and pinned memory, in every direction ORT asks for.
//!
//! Host → device goes through the staging pool and copy engine (one engine
//! per device, shared by the registration): a pageable source is filled into
//! pinned slots while earlier chunks are in DMA, a page-locked one (epmem's
//! pinned memory) is copied directly. Device → host, device → device and
//! host ↔ host are single copies.
//!
//! Every copy is complete when `CopyTensors` returns: copies are queued on
//! one stream per device (the engine's copies ordered into it by events), all
//! of a batch before the first wait, then each used stream is synchronized
//! once.
//!
//! ORT calls a plugin's `CopyTensors` where it would queue a copy on a compute
//! stream (`CopyTensorAsync`: a graph output fetched to CPU, a Memcpy node):
//! kernels queued there may still be writing the source (the GEMM computing
//! the logits) or reading the destination (a buffer the stream-ordered
//! allocator handed on). So a copy touching a device's memory is ordered
//! after that work first: after the stream ORT passes for it (an event
//! recorded there, waited on by ours), or, where ORT passes none (its plugin
//! data-transfer wrapper passes NULL), after everything queued on the device (one
//! context synchronization per call). Copying at once instead read outputs
//! before the kernels computing them had run.

use std::collections::HashMap;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::abi::*;
use super::api::MemoryDeviceDesc;
use super::factory::Factory;
use super::status_boundary;
use crate::device::{Device, Event, HostRange, RawStream, Stream};
use crate::error::Result;
use crate::staging::{CopyEngine, EngineConfig, Fence, PinnedStagingPool, PoolConfig};

/// Where one side of a copy lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// ORT's own CPU memory (not epmem's): a host pointer.
    Cpu,
    /// epmem pinned memory of device `i`: a host pointer.
    Pinned(usize),
    /// epmem device memory of device `i`: a device address.
    Device(usize),
}

impl Side {
    fn is_host(self) -> bool {
        matches!(self, Side::Cpu | Side::Pinned(_))
    }
}

/// Which side `desc` is, or None if it is memory epmem cannot address
/// (another vendor's device, a GPU ordinal we did not open).
pub(crate) fn classify(factory: &Factory, desc: &MemoryDeviceDesc) -> Option<Side> {
    match factory.device_for(&desc.kind) {
        Some(i) => match desc.mem_type {
            DEVICE_MEMORY_DEFAULT => Some(Side::Device(i)),
            DEVICE_MEMORY_HOST_ACCESSIBLE => Some(Side::Pinned(i)),
            _ => None,
        },
        None if desc.kind.device_type == MEMORY_INFO_DEVICE_CPU => Some(Side::Cpu),
        None => None,
    }
}

/// Whether we copy between `a` and `b`: both addressable, and at least one
/// of them epmem's (CPU↔CPU is ORT's own business).
pub(crate) fn can_copy(a: Option<Side>, b: Option<Side>) -> bool {
    matches!((a, b), (Some(x), Some(y)) if !(x == Side::Cpu && y == Side::Cpu))
}

/// What the data transfers did, reported in every allocator's stats (the
/// only statistics channel ORT has).
#[derive(Default)]
pub(crate) struct CopyCounters {
    pub htod: AtomicU64,
    pub dtoh: AtomicU64,
    pub dtod: AtomicU64,
    pub host: AtomicU64,
    pub bytes: AtomicU64,
}

impl CopyCounters {
    pub fn snapshot(&self) -> [(&'static str, u64); 5] {
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        [
            ("epmem.copies_htod", r(&self.htod)),
            ("epmem.copies_dtoh", r(&self.dtoh)),
            ("epmem.copies_dtod", r(&self.dtod)),
            ("epmem.copies_host", r(&self.host)),
            ("epmem.copied_bytes", r(&self.bytes)),
        ]
    }
}

/// One staging copy engine per device, shared by every data transfer of a
/// registration and made on the first host → device copy (it owns fill
/// threads and a few MiB of pinned slots, so sessions that never upload
/// pay nothing).
pub(crate) struct Engines(Vec<Mutex<Option<Arc<CopyEngine>>>>);

impl Engines {
    pub fn new(devices: usize) -> Self {
        Self((0..devices).map(|_| Mutex::new(None)).collect())
    }

    fn get(&self, i: usize, dev: &Arc<dyn Device>) -> Result<Arc<CopyEngine>> {
        let mut slot = self.0[i].lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = &*slot {
            return Ok(e.clone());
        }
        let pool = PinnedStagingPool::new(dev, PoolConfig::default())?;
        let e = Arc::new(CopyEngine::new(&pool, EngineConfig::default())?);
        *slot = Some(e.clone());
        Ok(e)
    }

    /// Staging counters summed over the devices, for allocator stats.
    pub fn snapshot(&self) -> [(&'static str, u64); 4] {
        let (mut staged, mut direct, mut allocs, mut reuses) = (0, 0, 0, 0);
        for e in self.0.iter().filter_map(|m| m.lock().unwrap_or_else(|e| e.into_inner()).clone()) {
            let s = e.stats();
            staged += s.copies - s.bypassed;
            direct += s.bypassed;
            allocs += s.pinned_alloc_calls;
            reuses += s.pinned_reuses;
        }
        [
            ("epmem.htod_staged", staged),
            ("epmem.htod_direct", direct),
            ("epmem.staging_pinned_allocs", allocs),
            ("epmem.staging_reuses", reuses),
        ]
    }
}

#[repr(C)]
pub(crate) struct DataTransfer {
    base: OrtDataTransferImpl,
    factory: Arc<Factory>,
    /// One stream per device, made on first use; the lock also serializes
    /// concurrent CopyTensors calls on this object.
    streams: Mutex<Vec<Option<Stream>>>,
    /// ORT's native streams adopted by device i, by (i, native handle); None
    /// where the device cannot adopt it (then the whole device is waited for).
    adopted: Mutex<HashMap<(usize, u64), Option<RawStream>>>,
    warned_unordered: AtomicBool,
    /// The first device copy's ordering was logged (INFO: which way ORT calls us).
    logged_order: AtomicBool,
}

/// Make `ours` wait (on the device) for the work queued on `theirs` so far.
/// The event is kept in `keep` until `ours` is synchronized.
pub(crate) fn order_after(
    dev: &Arc<dyn Device>,
    ours: RawStream,
    theirs: RawStream,
    keep: &mut Vec<Event>,
) -> Result<()> {
    let e = Event::new(dev, false)?;
    e.record_raw(theirs)?;
    dev.stream_wait_event(ours, e.raw())?;
    keep.push(e);
    Ok(())
}

impl DataTransfer {
    pub fn create(factory: Arc<Factory>) -> *mut OrtDataTransferImpl {
        let t = Box::new(DataTransfer {
            base: OrtDataTransferImpl {
                ort_version_supported: ORT_VERSION_SUPPORTED,
                Release: Some(release),
                CanCopy: Some(can_copy_fn),
                CopyTensors: Some(copy_tensors),
            },
            streams: Mutex::new((0..factory.devices.len()).map(|_| None).collect()),
            adopted: Mutex::new(HashMap::new()),
            warned_unordered: AtomicBool::new(false),
            logged_order: AtomicBool::new(false),
            factory,
        });
        Box::into_raw(t) as *mut OrtDataTransferImpl
    }

    /// Order device `i`'s copy stream after the work ORT queued on its
    /// stream `ort` so far. A stream the device cannot adopt (not in the
    /// primary context, or the host device) is waited for by synchronizing
    /// the device, with one warning.
    ///
    /// # Safety
    /// `ort` is a live `OrtSyncStream` ORT passed to `CopyTensors`.
    unsafe fn after_ort_stream(
        &self,
        streams: &mut [Option<Stream>],
        keep: &mut Vec<Event>,
        i: usize,
        ort: *mut OrtSyncStream,
    ) -> Result<()> {
        let dev = &self.factory.devices[i].dev;
        // SAFETY: per the caller.
        let native = unsafe { (self.factory.api.o.SyncStream_GetHandle)(ort) } as u64;
        let theirs = {
            let mut m = self.adopted.lock().unwrap_or_else(|p| p.into_inner());
            *m.entry((i, native)).or_insert_with(|| match dev.stream_wrap_native(native) {
                Ok(r) => Some(r),
                Err(e) => {
                    if !self.warned_unordered.swap(true, Ordering::Relaxed) {
                        log::warn!(
                            "epmem: {}: cannot order copies after ORT's stream {native:#x} ({e}); \
                             such copies wait for the whole device first",
                            self.factory.devices[i].label()
                        );
                    }
                    None
                }
            })
        };
        match theirs {
            Some(theirs) => {
                if streams[i].is_none() {
                    streams[i] = Some(Stream::new(dev)?);
                }
                let ours = streams[i].as_ref().map(Stream::raw).expect("created above");
                order_after(dev, ours, theirs, keep)
            }
            None => dev.synchronize(),
        }
    }

    /// Copy `n` bytes from `src` to `dst`, queueing device copies on
    /// `streams` (synchronized by the caller).
    ///
    /// # Safety
    /// Host addresses are valid for `n` bytes (read for `src`, write for
    /// `dst`) until the streams are synchronized.
    unsafe fn copy(
        &self,
        streams: &mut [Option<Stream>],
        fences: &mut Vec<Fence>,
        (src_side, src): (Side, u64),
        (dst_side, dst): (Side, u64),
        n: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let devs = &self.factory.devices;
        let c = &self.factory.copies;
        c.bytes.fetch_add(n as u64, Ordering::Relaxed);
        let mut stream = |i: usize| -> Result<crate::device::RawStream> {
            if streams[i].is_none() {
                streams[i] = Some(Stream::new(&devs[i].dev)?);
            }
            Ok(streams[i].as_ref().map(Stream::raw).expect("created above"))
        };
        match (src_side, dst_side) {
            // Device addresses are validated by the device layer; host ranges
            // are the caller's promise (see `# Safety`).
            (s, d) if s.is_host() && d.is_host() => {
                c.host.fetch_add(1, Ordering::Relaxed);
                // SAFETY: both host ranges are valid for n bytes (caller).
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) }
            }
            (s, Side::Device(j)) if s.is_host() => {
                // Through the staging pool and copy engine: pageable sources
                // are filled into pinned slots, page-locked ones (our pinned
                // memory) go direct. The engine orders the copy after `stream`
                // and makes `stream` wait for it, so synchronizing `stream`
                // completes it.
                c.htod.fetch_add(1, Ordering::Relaxed);
                let engine = self.factory.engines.get(j, &devs[j].dev)?;
                // SAFETY: src is readable for n bytes until the streams are
                // synchronized, which waits for the engine's fence.
                let range = unsafe { HostRange::new(src as *const u8, n) };
                fences.push(engine.htod(dst, range, Some(stream(j)?))?);
            }
            (Side::Device(i), d) if d.is_host() => {
                c.dtoh.fetch_add(1, Ordering::Relaxed);
                // SAFETY: dst is writable for n bytes until the streams are synchronized.
                unsafe { devs[i].dev.memcpy_dtoh_async(dst as *mut u8, src, n, stream(i)?)? }
            }
            (Side::Device(i), Side::Device(j)) if i == j => {
                c.dtod.fetch_add(1, Ordering::Relaxed);
                devs[i].dev.memcpy_dtod_async(dst, src, n, stream(i)?)?
            }
            (Side::Device(i), Side::Device(j)) => {
                c.dtod.fetch_add(1, Ordering::Relaxed);
                // Different devices: bounce through host memory (no peer copy
                // in the device layer); rare, so simplicity wins.
                let mut bounce = vec![0u8; n];
                let (si, sj) = (stream(i)?, stream(j)?);
                // SAFETY: `bounce` is n writable bytes, untouched until the sync below.
                unsafe { devs[i].dev.memcpy_dtoh_async(bounce.as_mut_ptr(), src, n, si)? };
                devs[i].dev.stream_synchronize(si)?;
                // SAFETY: `bounce` outlives the copy: we synchronize before dropping it.
                unsafe { devs[j].dev.memcpy_htod_async(dst, bounce.as_ptr(), n, sj)? };
                devs[j].dev.stream_synchronize(sj)?;
            }
            _ => unreachable!("every host/device pair is covered above"),
        }
        Ok(())
    }
}

impl Drop for DataTransfer {
    fn drop(&mut self) {
        // Adopted streams are ORT's: forgetting them destroys nothing.
        for ((i, _), r) in self.adopted.get_mut().unwrap_or_else(|p| p.into_inner()).drain() {
            if let Some(r) = r {
                crate::device::objects::log_drop_error(
                    "forgetting an adopted stream",
                    self.factory.devices[i].dev.stream_destroy(r),
                );
            }
        }
    }
}

/// # Safety
/// `this` is a transfer made by [`DataTransfer::create`].
unsafe fn me<'a>(this: *const OrtDataTransferImpl) -> &'a DataTransfer {
    // SAFETY: per the caller; `base` is the first field of a repr(C) struct.
    unsafe { &*(this as *const DataTransfer) }
}

unsafe extern "C" fn release(this: *mut OrtDataTransferImpl) {
    if !this.is_null() {
        super::value_boundary("OrtDataTransferImpl::Release", (), || {
            // SAFETY: ORT releases the transfer we gave it, once.
            drop(unsafe { Box::from_raw(this as *mut DataTransfer) })
        });
    }
}

unsafe extern "C" fn can_copy_fn(
    this: *const OrtDataTransferImpl,
    src: *const OrtMemoryDevice,
    dst: *const OrtMemoryDevice,
) -> bool {
    super::value_boundary("OrtDataTransferImpl::CanCopy", false, || {
        if src.is_null() || dst.is_null() {
            return false;
        }
        // SAFETY: ORT passes our transfer and two live memory devices.
        let (t, s, d) = unsafe {
            let t = me(this);
            (t, t.factory.api.memory_device(src), t.factory.api.memory_device(dst))
        };
        can_copy(classify(&t.factory, &s), classify(&t.factory, &d))
    })
}

unsafe extern "C" fn copy_tensors(
    this: *mut OrtDataTransferImpl,
    src: *const *const OrtValue,
    dst: *mut *mut OrtValue,
    ort_streams: *mut *mut OrtSyncStream,
    n: usize,
) -> *mut OrtStatus {
    // SAFETY: ORT passes our transfer.
    let t = unsafe { me(this) };
    let api = t.factory.api;
    status_boundary(&api, "CopyTensors", || {
        crate::ensure!(n == 0 || (!src.is_null() && !dst.is_null()), NullPointer, "tensor arrays are NULL");
        let mut streams = t.streams.lock().unwrap_or_else(|e| e.into_inner());
        // Kept until the streams are synchronized (their events order the copies).
        let mut fences = Vec::new();
        let mut events = Vec::new();
        // Devices already synchronized in this call (copies with no stream).
        let mut synced = vec![false; t.factory.devices.len()];
        let mut result = Ok(());
        for i in 0..n {
            // SAFETY: ORT passes n live source and destination values.
            let (s, d) = unsafe { (api.tensor(*src.add(i), false), api.tensor(*dst.add(i), true)) };
            let step = s.and_then(|s| Ok((s, d?))).and_then(|(s, d)| {
                crate::ensure!(
                    s.bytes == d.bytes,
                    InvalidArgument,
                    "tensor {i}: source has {} bytes, destination {}",
                    s.bytes,
                    d.bytes
                );
                let side = |v: &super::api::TensorView| {
                    classify(&t.factory, &v.desc).ok_or_else(|| {
                        crate::error::Error::unsupported(format!(
                            "tensor {i}: epmem cannot address memory {:?}",
                            v.desc
                        ))
                    })
                };
                let (ss, ds) = (side(&s)?, side(&d)?);
                // SAFETY: ORT passes NULL or an array of n streams, each NULL
                // or live for the call.
                let ort = if ort_streams.is_null() { std::ptr::null_mut() } else { unsafe { *ort_streams.add(i) } };
                let mut devices: Vec<usize> = [ss, ds]
                    .iter()
                    .filter_map(|x| match *x {
                        Side::Device(k) | Side::Pinned(k) => Some(k),
                        Side::Cpu => None,
                    })
                    .collect();
                devices.dedup();
                if !devices.is_empty() && !t.logged_order.swap(true, Ordering::Relaxed) {
                    log::info!(
                        "epmem: data transfer: ORT {} for a copy of device memory; it is ordered after {}",
                        if ort.is_null() { "passes no stream" } else { "passes a stream" },
                        if ort.is_null() { "all work queued on the device" } else { "the work queued on that stream" }
                    );
                }
                if ort.is_null() {
                    for &k in &devices {
                        if !synced[k] {
                            t.factory.devices[k]
                                .dev
                                .synchronize()
                                .map_err(|e| e.context("waiting for the device's queued work before a copy"))?;
                            synced[k] = true;
                        }
                    }
                } else {
                    for &k in &devices {
                        // SAFETY: a live stream ORT passed for this copy.
                        unsafe { t.after_ort_stream(&mut streams, &mut events, k, ort) }?;
                        if ss.is_host() && ds.is_host() {
                            // A host copy (pinned memory) runs now, on this
                            // thread: wait here for ORT's queued work.
                            if let Some(st) = streams[k].as_ref() {
                                st.synchronize()?;
                            }
                        }
                    }
                }
                // SAFETY: ORT's tensors own their buffers for the whole call,
                // and we synchronize before returning.
                unsafe { t.copy(&mut streams, &mut fences, (ss, s.ptr), (ds, d.ptr), s.bytes) }
            });
            if let Err(e) = step {
                result = Err(e);
                break;
            }
        }
        // Always drain what was queued, even after an error: ORT may free
        // the buffers as soon as we return.
        for (i, s) in streams.iter().enumerate() {
            if let Some(Err(e)) = s.as_ref().map(Stream::synchronize) {
                let label = t.factory.devices[i].label();
                result = result.and(Err(e.context(format!("synchronizing {label}"))));
            }
        }
        result
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_need_an_epmem_side_and_an_addressable_other_side() {
        let (c, p, d0, d1) = (Some(Side::Cpu), Some(Side::Pinned(0)), Some(Side::Device(0)), Some(Side::Device(1)));
        for (a, b) in [(c, d0), (d0, c), (d0, d0), (d0, d1), (p, d0), (d0, p), (c, p), (p, c)] {
            assert!(can_copy(a, b), "{a:?} -> {b:?}");
        }
        assert!(!can_copy(c, c), "CPU to CPU is ORT's own copy");
        assert!(!can_copy(None, d0) && !can_copy(d0, None), "foreign memory is refused");
    }

    /// The bug class behind wrong fetched outputs: a copy queued on our
    /// stream while the producer's stream still has the write queued. On the
    /// host device streams are worker threads; a large copy keeps the
    /// producer busy, so a copy that is not ordered after it reads the old
    /// bytes (checked by `unordered_reads_can_be_stale` below, which shows the
    /// test can fail).
    fn produce_then_read(ordered: bool) -> (Vec<u8>, Vec<u8>) {
        use crate::device::{DeviceSelect, open};
        let dev = open(DeviceSelect::Host, 0).unwrap();
        let producer = Stream::new(&dev).unwrap();
        let ours = Stream::new(&dev).unwrap();
        const BIG: usize = 64 << 20;
        const N: usize = 4096;
        let (a, b, out) = (dev.mem_alloc(BIG).unwrap(), dev.mem_alloc(BIG).unwrap(), dev.mem_alloc(N).unwrap());
        let old = vec![0x11u8; N];
        let new = vec![0x77u8; N];
        // SAFETY: `old` and `new` outlive the synchronizations below.
        unsafe { dev.memcpy_htod_async(out, old.as_ptr(), N, producer.raw()).unwrap() };
        producer.synchronize().unwrap();
        // The producer: a long copy, then the write the reader must see.
        dev.memcpy_dtod_async(b, a, BIG, producer.raw()).unwrap();
        // SAFETY: as above.
        unsafe { dev.memcpy_htod_async(out, new.as_ptr(), N, producer.raw()).unwrap() };
        let mut keep = Vec::new();
        if ordered {
            order_after(&dev, ours.raw(), producer.raw(), &mut keep).unwrap();
        }
        let mut got = vec![0u8; N];
        // SAFETY: `got` outlives the synchronization just below.
        unsafe { dev.memcpy_dtoh_async(got.as_mut_ptr(), out, N, ours.raw()).unwrap() };
        ours.synchronize().unwrap();
        producer.synchronize().unwrap();
        drop(keep);
        for p in [a, b, out] {
            dev.mem_free(p).unwrap();
        }
        (got, new)
    }

    #[test]
    fn a_copy_ordered_after_the_producers_stream_reads_what_it_wrote() {
        for _ in 0..4 {
            let (got, want) = produce_then_read(true);
            assert!(got == want, "the ordered copy read bytes the producer had not written yet");
        }
    }

    #[test]
    fn unordered_reads_can_be_stale() {
        // Without the ordering the read races the producer's long copy: at
        // least one of a few tries reads the old bytes (it runs first on an
        // idle worker), so the ordered test above is not vacuous.
        let stale = (0..4).any(|_| {
            let (got, want) = produce_then_read(false);
            got != want
        });
        assert!(stale, "an unordered read never raced the producer: the ordering test proves nothing");
    }
}
