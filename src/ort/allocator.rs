//! `OrtAllocator` over a [`MemorySource`](crate::arena::source::MemorySource): accounting, the byte limit, and
//! `GetStats` with ORT's keys plus epmem's.
//!
//! ORT creates several allocators at once (a shared one per memory type at
//! registration, then one per session), from any thread; each is
//! independent, and each keeps its factory alive so it may
//! be released after the library is unregistered.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::abi::*;
use super::factory::{EpmDevice, Factory};
use super::options::AllocatorOptions;
use crate::arena::source::{self, MemKind};
use crate::arena::stream_order::StreamOrdered;
use crate::device::{Device, RawStream};
use crate::error::Result;

/// Accounting for one allocator in ORT's terms (requested bytes; the
/// arena itself knows each allocation's size and rounds it up).
#[derive(Debug, Default)]
pub(crate) struct Book {
    pub limit: u64,
    pub in_use: u64,
    pub max_in_use: u64,
    pub total_allocated: u64,
    pub num_allocs: u64,
    pub num_reserves: u64,
    pub max_alloc_size: u64,
    pub failed_allocs: u64,
    pub frees: u64,
    /// Peak of the source's committed bytes (read whenever it grew).
    pub peak_committed: u64,
}

impl Book {
    pub fn new(limit: u64) -> Self {
        Self { limit, ..Self::default() }
    }
    /// Would `bytes` more stay within the limit?
    pub fn admits(&self, bytes: usize) -> bool {
        self.in_use.checked_add(bytes as u64).is_some_and(|n| n <= self.limit)
    }
    pub fn record(&mut self, bytes: usize, reserve: bool) {
        let b = bytes as u64;
        self.in_use += b;
        self.max_in_use = self.max_in_use.max(self.in_use);
        self.total_allocated += b;
        self.max_alloc_size = self.max_alloc_size.max(b);
        if reserve {
            self.num_reserves += 1;
        } else {
            self.num_allocs += 1;
        }
    }
    pub fn release(&mut self, bytes: usize) {
        self.in_use = self.in_use.saturating_sub(bytes as u64);
        self.frees += 1;
    }
    pub fn live(&self) -> u64 {
        (self.num_allocs + self.num_reserves).saturating_sub(self.frees)
    }
}

/// An epmem allocator as ORT sees it. `base` first: ORT's `OrtAllocator*`
/// is a pointer to this struct.
#[repr(C)]
pub(crate) struct Allocator {
    base: OrtAllocator,
    factory: Arc<Factory>,
    info: *const OrtMemoryInfo,
    device_label: String,
    kind: MemKind,
    dev: Arc<dyn Device>,
    /// The arena behind a stream-ordering layer (see `arena::stream_order`).
    mem: StreamOrdered,
    book: Mutex<Book>,
    /// ORT's native streams (`SyncStream_GetHandle`) adopted by the device,
    /// one driver call each the first time a stream is seen.
    streams: Mutex<HashMap<u64, RawStream>>,
    warned_unordered: AtomicBool,
}

impl Allocator {
    /// A new allocator for `kind` memory of `dev`, boxed for ORT.
    pub fn create(
        factory: Arc<Factory>,
        dev: &EpmDevice,
        kind: MemKind,
        opts: AllocatorOptions,
    ) -> Result<*mut OrtAllocator> {
        // The limit is also the arena's capacity: its VA reservation on the device.
        let default_limit = match kind {
            MemKind::Device => dev.dev.info().total_mem,
            MemKind::Pinned => physical_ram(),
        };
        let limit = opts.arena_bytes.unwrap_or(default_limit);
        let info = match kind {
            MemKind::Device => dev.default_info.as_ptr(),
            MemKind::Pinned => dev.pinned_info.as_ptr(),
        };
        let a = Box::new(Allocator {
            base: OrtAllocator {
                // Say 25 only to an ORT that knows Shrink; 23 otherwise.
                version: if factory.api.version >= ORT_ALLOCATOR_SHRINK_VERSION {
                    ORT_ALLOCATOR_SHRINK_VERSION
                } else {
                    ORT_VERSION_SUPPORTED
                },
                Alloc: Some(alloc),
                Free: Some(free),
                Info: Some(info_fn),
                Reserve: Some(reserve),
                GetStats: Some(get_stats),
                AllocOnStream: Some(alloc_on_stream),
                Shrink: Some(shrink),
            },
            factory,
            info,
            device_label: dev.label(),
            kind,
            dev: dev.dev.clone(),
            mem: StreamOrdered::new(dev.dev.clone(), source::open(&dev.dev, kind, limit)?),
            book: Mutex::new(Book::new(limit)),
            streams: Mutex::new(HashMap::new()),
            warned_unordered: AtomicBool::new(false),
        });
        Ok(Box::into_raw(a) as *mut OrtAllocator)
    }

    /// Take back ownership of an allocator made by [`Allocator::create`].
    ///
    /// # Safety
    /// `p` came from `create` and is not used afterwards.
    pub unsafe fn destroy(p: *mut OrtAllocator) {
        // SAFETY: per the caller, p is a Box<Allocator> we leaked.
        drop(unsafe { Box::from_raw(p as *mut Allocator) });
    }

    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The device's handle for ORT's stream, adopted on first sight. None
    /// when the device cannot adopt it (the host device has no native
    /// streams): the allocation is then not stream-ordered, as before 1.23.
    fn stream_for(&self, stream: *mut OrtSyncStream) -> Option<RawStream> {
        // SAFETY: ORT passes a live OrtSyncStream (its own Stream object).
        let native = unsafe { (self.factory.api.o.SyncStream_GetHandle)(stream) } as u64;
        let mut m = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = m.get(&native) {
            return Some(*r);
        }
        match self.dev.stream_wrap_native(native) {
            Ok(r) => {
                m.insert(native, r);
                Some(r)
            }
            Err(e) => {
                if !self.warned_unordered.swap(true, Ordering::Relaxed) {
                    log::warn!(
                        "epmem: {} {:?} allocator: cannot order frees after ORT's stream {native:#x} ({e}); its allocations are not stream-ordered",
                        self.device_label,
                        self.kind
                    );
                }
                None
            }
        }
    }

    fn allocate(&self, size: usize, reserve: bool, stream: Option<RawStream>) -> *mut c_void {
        // ORT may ask for 0 bytes; a distinct non-NULL pointer is what it expects.
        let bytes = size.max(1);
        let mut book = self.book();
        if !book.admits(bytes) {
            book.failed_allocs += 1;
            log::warn!(
                "epmem: {} {:?} allocator: {bytes} bytes would exceed its limit of {} ({} in use)",
                self.device_label,
                self.kind,
                book.limit,
                book.in_use
            );
            return std::ptr::null_mut();
        }
        // Device-wide counters (atomics): any arena growth during this call
        // is reported, so a host can count driver allocations from ORT's log.
        let creates_before = self.dev.driver_counts().vmm_create_calls;
        match self.mem.alloc(bytes, stream) {
            Ok((addr, accounted)) => {
                book.record(accounted, reserve);
                let grew = self.dev.driver_counts().vmm_create_calls - creates_before;
                if grew > 0 {
                    book.peak_committed = book.peak_committed.max(self.mem.source_stats().committed_bytes);
                    log::info!(
                        "epmem: {} {:?} allocator: arena grew ({grew} physical allocation(s) from the driver) for {bytes} bytes",
                        self.device_label,
                        self.kind
                    );
                }
                addr as *mut c_void
            }
            Err(e) => {
                book.failed_allocs += 1;
                log::warn!("epmem: {} {:?} allocation of {bytes} bytes failed: {e}", self.device_label, self.kind);
                std::ptr::null_mut()
            }
        }
    }

    fn deallocate(&self, p: *mut c_void) {
        if p.is_null() {
            return;
        }
        let addr = p as u64;
        let mut book = self.book();
        match self.mem.free(addr) {
            Ok(Some(bytes)) => book.release(bytes),
            Ok(None) => log::warn!(
                "epmem: {} {:?} allocator: Free of {addr:#x}, which it did not allocate (or freed already); ignored",
                self.device_label,
                self.kind
            ),
            Err(e) => log::warn!("epmem: freeing {addr:#x} failed: {e}"),
        }
    }

    /// One INFO line with the figures that place this allocator against the
    /// physical floor (the peak of bytes live at once). Logged when the
    /// allocator is released, so a host without `AllocatorGetStats` (ORT's
    /// Python API has none) reads them from ORT's log; `scripts/bench_ort.py`
    /// parses it.
    fn log_footprint(&self, when: &str) {
        let (b, s, o) = (self.book(), self.mem.source_stats(), self.mem.order_stats());
        log::info!(
            "epmem: {} {:?} allocator footprint at {when}: peak_live_bytes={} peak_held_bytes={} peak_committed_bytes={} \
             committed_bytes={} max_in_use={} num_allocs={} stream_allocs={} same_stream_reuses={} deferred_frees={} \
             stream_waits={} driver_allocs={}",
            self.device_label,
            self.kind,
            o.peak_live_bytes,
            o.peak_held_bytes,
            b.peak_committed.max(s.committed_bytes),
            s.committed_bytes,
            b.max_in_use,
            b.num_allocs + b.num_reserves,
            o.stream_allocs,
            o.same_stream_reuses,
            o.deferred_frees,
            o.waits,
            s.extensions
        );
    }

    fn stats(&self) -> Vec<(&'static str, String)> {
        let b = self.book();
        let s = self.mem.source_stats();
        let o = self.mem.order_stats();
        let mut v = vec![
            ("Limit", b.limit.to_string()),
            ("InUse", b.in_use.to_string()),
            ("TotalAllocated", b.total_allocated.to_string()),
            ("MaxInUse", b.max_in_use.to_string()),
            ("NumAllocs", b.num_allocs.to_string()),
            ("NumReserves", b.num_reserves.to_string()),
            ("NumArenaExtensions", s.extensions.to_string()),
            ("NumArenaShrinkages", s.shrinks.to_string()),
            ("MaxAllocSize", b.max_alloc_size.to_string()),
            ("epmem.device", self.device_label.clone()),
            (
                "epmem.memory",
                match self.kind {
                    MemKind::Device => "device",
                    MemKind::Pinned => "pinned",
                }
                .to_string(),
            ),
            ("epmem.source", self.mem.source_name().to_string()),
            ("epmem.committed_bytes", s.committed_bytes.to_string()),
            ("epmem.reserved_bytes", s.reserved_bytes.to_string()),
            ("epmem.fragmentation", format!("{:.4}", s.fragmentation)),
            ("epmem.live_allocations", b.live().to_string()),
            ("epmem.frees", b.frees.to_string()),
            ("epmem.failed_allocs", b.failed_allocs.to_string()),
            ("epmem.stream_allocs", o.stream_allocs.to_string()),
            ("epmem.same_stream_reuses", o.same_stream_reuses.to_string()),
            ("epmem.deferred_frees", o.deferred_frees.to_string()),
            ("epmem.pending_blocks", o.pending_blocks.to_string()),
            ("epmem.stream_events_recorded", o.events_recorded.to_string()),
            ("epmem.stream_events_created", o.events_created.to_string()),
            ("epmem.stream_waits", o.waits.to_string()),
            ("epmem.live_bytes", o.live_bytes.to_string()),
            ("epmem.peak_live_bytes", o.peak_live_bytes.to_string()),
            ("epmem.pending_bytes", o.pending_bytes.to_string()),
            ("epmem.peak_held_bytes", o.peak_held_bytes.to_string()),
            ("epmem.peak_committed_bytes", b.peak_committed.max(s.committed_bytes).to_string()),
        ];
        v.extend(self.factory.copies.snapshot().iter().map(|&(k, n)| (k, n.to_string())));
        v.extend(self.factory.engines.snapshot().iter().map(|&(k, n)| (k, n.to_string())));
        v
    }
}

impl Drop for Allocator {
    fn drop(&mut self) {
        // ORT frees every tensor before releasing the allocator; if it did
        // not, the arena's memory goes with the arena all the same.
        let live = self.book().live();
        if live > 0 {
            log::warn!("epmem: {} {:?} allocator released with {live} allocations live", self.device_label, self.kind);
        }
        let used = {
            let b = self.book();
            b.num_allocs + b.num_reserves > 0
        };
        if used {
            self.log_footprint("release");
        }
        // Pending frees are sealed with events on their streams: do it while
        // the adopted streams are still known to the device.
        if let Err(e) = self.mem.drain() {
            log::warn!("epmem: {} {:?} allocator: waiting for pending frees failed: {e}", self.device_label, self.kind);
        }
        // Adopted streams are ORT's: forgetting them destroys nothing.
        let streams = std::mem::take(&mut *self.streams.lock().unwrap_or_else(|p| p.into_inner()));
        for (_, r) in streams {
            crate::device::objects::log_drop_error("forgetting an adopted stream", self.dev.stream_destroy(r));
        }
    }
}

/// Physical RAM in bytes: the default limit of pinned memory.
fn physical_ram() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    if pages > 0 && page > 0 { pages as u64 * page as u64 } else { u64::MAX }
}

/// # Safety
/// `this` is an `OrtAllocator*` made by [`Allocator::create`].
unsafe fn me<'a>(this: *const OrtAllocator) -> &'a Allocator {
    // SAFETY: per the caller; `base` is the first field of a repr(C) struct.
    unsafe { &*(this as *const Allocator) }
}

unsafe extern "C" fn alloc(this: *mut OrtAllocator, size: usize) -> *mut c_void {
    super::value_boundary("OrtAllocator::Alloc", std::ptr::null_mut(), || {
        // SAFETY: ORT passes the allocator it got from us.
        unsafe { me(this) }.allocate(size, false, None)
    })
}

unsafe extern "C" fn reserve(this: *mut OrtAllocator, size: usize) -> *mut c_void {
    super::value_boundary("OrtAllocator::Reserve", std::ptr::null_mut(), || {
        // SAFETY: as in `alloc`.
        unsafe { me(this) }.allocate(size, true, None)
    })
}

/// ORT (1.23+) calls this for any allocator that has it, with the stream of
/// the kernel that will use the memory (NULL: none). Frees of such memory are
/// ordered after that stream's work (see `arena::stream_order`).
unsafe extern "C" fn alloc_on_stream(this: *mut OrtAllocator, size: usize, stream: *mut OrtSyncStream) -> *mut c_void {
    super::value_boundary("OrtAllocator::AllocOnStream", std::ptr::null_mut(), || {
        // SAFETY: as in `alloc`.
        let a = unsafe { me(this) };
        let s = if stream.is_null() { None } else { a.stream_for(stream) };
        a.allocate(size, false, s)
    })
}

unsafe extern "C" fn free(this: *mut OrtAllocator, p: *mut c_void) {
    // SAFETY: as in `alloc`.
    super::value_boundary("OrtAllocator::Free", (), || unsafe { me(this) }.deallocate(p));
}

unsafe extern "C" fn info_fn(this: *const OrtAllocator) -> *const OrtMemoryInfo {
    // SAFETY: as in `alloc`; reading a field cannot panic.
    unsafe { me(this) }.info
}

unsafe extern "C" fn get_stats(this: *const OrtAllocator, out: *mut *mut OrtKeyValuePairs) -> *mut OrtStatus {
    // SAFETY: as in `alloc`.
    let a = unsafe { me(this) };
    super::status_boundary(&a.factory.api, "OrtAllocator::GetStats", || {
        crate::ensure!(!out.is_null(), NullPointer, "GetStats: out is NULL");
        let kv = a.factory.api.kvp_new(&[]);
        for (k, v) in a.stats() {
            kv.add(k, &v);
        }
        // SAFETY: out is non-NULL; ORT takes ownership of the pairs.
        unsafe { *out = kv.into_raw() };
        Ok(())
    })
}

unsafe extern "C" fn shrink(this: *mut OrtAllocator) -> *mut OrtStatus {
    // SAFETY: as in `alloc`.
    let a = unsafe { me(this) };
    super::status_boundary(&a.factory.api, "OrtAllocator::Shrink", || {
        a.log_footprint("Shrink");
        let given = a.mem.trim()?;
        log::debug!("epmem: {} {:?} allocator gave back {given} bytes", a.device_label, a.kind);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn book_tracks_ort_counters_and_the_limit() {
        let mut b = Book::new(1000);
        assert!(b.admits(1000));
        assert!(!b.admits(1001));
        b.record(600, false);
        b.record(300, true);
        assert!(!b.admits(101));
        assert!(b.admits(100));
        assert_eq!((b.in_use, b.num_allocs, b.num_reserves, b.max_alloc_size), (900, 1, 1, 600));
        b.release(600);
        b.record(50, false);
        assert_eq!((b.in_use, b.max_in_use, b.total_allocated, b.frees, b.live()), (350, 900, 950, 1, 2));
    }

    #[test]
    fn book_limit_never_overflows() {
        let mut b = Book::new(u64::MAX);
        b.record(usize::MAX, false);
        assert!(!b.admits(usize::MAX), "u64 overflow must read as over the limit");
    }
}
