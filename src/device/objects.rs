//! The safe level of the device layer: objects that clean up on drop.
//!
//! Each object holds an `Arc<dyn Device>`, so the device outlives everything
//! made from it, whatever order the host frees things in. `Drop` never
//! panics: a failure while freeing is logged and otherwise ignored.

use std::sync::{Arc, Mutex};

use super::{Access, Device, DevicePtr, RawEvent, RawPhys, RawStream};
use crate::error::Result;

/// Log a failure in a destructor; never panic.
pub(crate) fn log_drop_error(what: &str, r: Result<()>) {
    if let Err(e) = r {
        log::warn!("epmem: {what} failed during cleanup: {e}");
    }
}

/// An owned stream.
#[derive(Debug)]
pub struct Stream {
    dev: Arc<dyn Device>,
    raw: RawStream,
}

impl Stream {
    pub fn new(dev: &Arc<dyn Device>) -> Result<Self> {
        Ok(Self { raw: dev.stream_create()?, dev: dev.clone() })
    }
    /// Adopt a stream the host created (a `CUstream` on CUDA); dropping the
    /// result only forgets it, the host still owns and destroys it.
    pub fn wrap_native(dev: &Arc<dyn Device>, native: u64) -> Result<Self> {
        Ok(Self { raw: dev.stream_wrap_native(native)?, dev: dev.clone() })
    }
    /// The native handle (`CUstream` on CUDA, 0 on the host device).
    pub fn native(&self) -> Result<u64> {
        self.dev.stream_native(self.raw)
    }
    pub fn raw(&self) -> RawStream {
        self.raw
    }
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.dev
    }
    pub fn synchronize(&self) -> Result<()> {
        self.dev.stream_synchronize(self.raw)
    }
    /// Work queued after this waits for `e`; the host does not wait.
    pub fn wait_event(&self, e: &Event) -> Result<()> {
        self.dev.stream_wait_event(self.raw, e.raw)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        log_drop_error("stream_destroy", self.dev.stream_destroy(self.raw));
    }
}

/// An owned event. One taken from an [`EventPool`] goes back to it when
/// dropped (while the pool has room) instead of being destroyed.
#[derive(Debug)]
pub struct Event {
    dev: Arc<dyn Device>,
    raw: RawEvent,
    home: Option<Arc<EventPool>>,
}

impl Event {
    pub fn new(dev: &Arc<dyn Device>, timing: bool) -> Result<Self> {
        Ok(Self { raw: dev.event_create(timing)?, dev: dev.clone(), home: None })
    }
    pub fn raw(&self) -> RawEvent {
        self.raw
    }
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.dev
    }
    /// Record on a raw stream (for streams the host owns).
    pub fn record_raw(&self, s: RawStream) -> Result<()> {
        self.dev.event_record(self.raw, s)
    }
    pub fn record(&self, s: &Stream) -> Result<()> {
        self.record_raw(s.raw)
    }
    /// Non-blocking: has the recorded work completed?
    pub fn query(&self) -> Result<bool> {
        self.dev.event_query(self.raw)
    }
    pub fn synchronize(&self) -> Result<()> {
        self.dev.event_synchronize(self.raw)
    }
    /// Non-blocking elapsed time from `start` to `self`; NotReady if either is pending.
    pub fn elapsed_since(&self, start: &Event) -> Result<f32> {
        self.dev.event_elapsed_ms(start.raw, self.raw)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Some(pool) = self.home.take()
            && pool.keep(self.raw)
        {
            return;
        }
        log_drop_error("event_destroy", self.dev.event_destroy(self.raw));
    }
}

/// Events (without timing) kept for reuse, so that an operation that fences
/// every call with a fresh event (a page-in's copy, its decode) creates and
/// destroys none in steady state: each is a driver call on CUDA, on the
/// thread that issues the work.
///
/// Reusing an event that may still be pending is sound: a stream that waits
/// on an event waits for the record made before the wait was issued
/// (`cuStreamWaitEvent`; the host device does the same), and whoever held
/// the dropped [`Event`] can no longer record, query or wait on it.
#[derive(Debug)]
pub struct EventPool {
    dev: Arc<dyn Device>,
    kept: Mutex<Vec<RawEvent>>,
    cap: usize,
}

impl EventPool {
    /// A pool that keeps at most `cap` idle events.
    pub fn new(dev: &Arc<dyn Device>, cap: usize) -> Arc<Self> {
        Arc::new(Self { dev: dev.clone(), kept: Mutex::new(Vec::new()), cap })
    }
    /// An idle event of the pool, or a new one; it returns to the pool when dropped.
    pub fn take(self: &Arc<Self>) -> Result<Event> {
        let kept = self.kept.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let raw = match kept {
            Some(raw) => raw,
            None => self.dev.event_create(false)?,
        };
        Ok(Event { dev: self.dev.clone(), raw, home: Some(self.clone()) })
    }
    /// Idle events kept now.
    pub fn idle(&self) -> usize {
        self.kept.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
    /// Keep `raw` if there is room (false: the caller destroys it).
    fn keep(&self, raw: RawEvent) -> bool {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() >= self.cap {
            return false;
        }
        kept.push(raw);
        true
    }
}

impl Drop for EventPool {
    fn drop(&mut self) {
        let kept = std::mem::take(self.kept.get_mut().unwrap_or_else(|p| p.into_inner()));
        for raw in kept {
            log_drop_error("event_destroy", self.dev.event_destroy(raw));
        }
    }
}

/// Page-locked host memory, owned. Derefs to a byte slice.
///
/// It is not `Clone`; a copy reading from it takes it by value (see
/// [`crate::transfer::witness`]), so the buffer cannot be touched while a DMA reads it.
pub struct PinnedBuffer {
    dev: Arc<dyn Device>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain page-locked host memory owned by this value;
// moving it to another thread moves exclusive ownership with it.
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for PinnedBuffer {}

impl std::fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer").field("ptr", &self.ptr).field("len", &self.len).finish()
    }
}

impl PinnedBuffer {
    /// Allocate `len > 0` bytes of page-locked memory (one driver call).
    pub fn new(dev: &Arc<dyn Device>, len: usize) -> Result<Self> {
        crate::ensure!(len > 0, InvalidArgument, "pinned allocation of 0 bytes");
        let ptr = dev.pinned_alloc(len)?;
        Ok(Self { dev: dev.clone(), ptr, len })
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.dev
    }
    /// The buffer as a [`HostRange`], for copies. The range is valid while
    /// the buffer lives and is not written: the crate code that takes it (the
    /// residency manager's compressed weights) keeps the buffer alive and
    /// unchanged until every copy from the range has completed.
    pub(crate) fn range(&self) -> HostRange {
        // SAFETY: `ptr` is a live allocation of `len` bytes owned by self;
        // the caller keeps self alive and unwritten while the range is used
        // (see above).
        unsafe { HostRange::new(self.ptr, self.len) }
    }
}

impl std::ops::Deref for PinnedBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` is a live allocation of `len` bytes owned by self; no
        // copy can be writing it because copies take the buffer by value.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for PinnedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // SAFETY: we own the allocation; copies own the buffer while in flight,
        // so none can be reading it when it is dropped here.
        log_drop_error("pinned_free", unsafe { self.dev.pinned_free(self.ptr) });
    }
}

/// A host range the caller vouches for: readable for as long as this value
/// (and anything made from it) lives. Made only by `unsafe` code (the FFI
/// layer, tests), used safely by the core.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HostRange {
    ptr: *const u8,
    len: usize,
}

// SAFETY: a HostRange is a promise of readability by its creator; it is only
// read, never written, through this type.
unsafe impl Send for HostRange {}
// SAFETY: as above.
unsafe impl Sync for HostRange {}

impl HostRange {
    /// # Safety
    /// `[ptr, ptr+len)` must stay readable and unmodified by others while any
    /// copy of this value is used.
    pub unsafe fn new(ptr: *const u8, len: usize) -> Self {
        Self { ptr, len }
    }
    /// A range over a slice that lives for the whole program.
    pub fn from_static(s: &'static [u8]) -> Self {
        Self { ptr: s.as_ptr(), len: s.len() }
    }
    pub fn ptr(&self) -> *const u8 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// A sub-range. Errors if out of bounds.
    pub fn slice(&self, offset: usize, len: usize) -> Result<HostRange> {
        crate::ensure!(
            offset.checked_add(len).is_some_and(|end| end <= self.len),
            InvalidArgument,
            "sub-range [{offset}, +{len}) outside a host range of {} bytes",
            self.len
        );
        // SAFETY: inside the range the creator vouched for.
        Ok(unsafe { HostRange::new(self.ptr.add(offset), len) })
    }
    /// The range covering `self` and then `next`, which must start exactly
    /// where `self` ends (the residency manager copies adjacent small
    /// weights as one). Errors otherwise.
    pub fn join(&self, next: &HostRange) -> Result<HostRange> {
        crate::ensure!(
            self.ptr.wrapping_add(self.len) == next.ptr && self.len.checked_add(next.len).is_some(),
            InvalidArgument,
            "host ranges {:p}+{} and {:p}+{} are not adjacent",
            self.ptr,
            self.len,
            next.ptr,
            next.len
        );
        // SAFETY: both halves were vouched for by their creators and they are
        // adjacent, so the union is exactly the memory they vouched for.
        Ok(unsafe { HostRange::new(self.ptr, self.len + next.len) })
    }
    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the creator of this range promised it readable (see `new`).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// Plain device memory (cuMemAlloc), owned.
#[derive(Debug)]
pub struct DeviceBuffer {
    dev: Arc<dyn Device>,
    ptr: DevicePtr,
    len: usize,
}

impl DeviceBuffer {
    pub fn new(dev: &Arc<dyn Device>, len: usize) -> Result<Self> {
        crate::ensure!(len > 0, InvalidArgument, "device allocation of 0 bytes");
        Ok(Self { ptr: dev.mem_alloc(len)?, dev: dev.clone(), len })
    }
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        log_drop_error("mem_free", self.dev.mem_free(self.ptr));
    }
}

/// A physical memory handle (VMM), owned. Released on drop; memory stays
/// alive while mapped.
#[derive(Debug)]
pub struct PhysMem {
    dev: Arc<dyn Device>,
    raw: RawPhys,
    len: usize,
}

impl PhysMem {
    pub fn new(dev: &Arc<dyn Device>, len: usize) -> Result<Self> {
        Ok(Self { raw: dev.vmm_create(len)?, dev: dev.clone(), len })
    }
    pub fn raw(&self) -> RawPhys {
        self.raw
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for PhysMem {
    fn drop(&mut self) {
        log_drop_error("vmm_release", self.dev.vmm_release(self.raw));
    }
}

/// A VA reservation, owned. On drop, whatever is still mapped is unmapped,
/// then the VA is freed (teardown order: unmap → release handle → free VA;
/// handles are released by their own owners).
#[derive(Debug)]
pub struct VaRange {
    dev: Arc<dyn Device>,
    base: DevicePtr,
    len: usize,
    /// Mapped sub-ranges (offset, len), so drop can unmap them.
    mapped: Vec<(usize, usize)>,
}

impl VaRange {
    /// Reserve `len` bytes (rounded up to the granularity by the caller's choice: must be a multiple).
    pub fn reserve(dev: &Arc<dyn Device>, len: usize) -> Result<Self> {
        let g = dev.vmm_granularity();
        crate::ensure!(
            len > 0 && len % g == 0,
            InvalidArgument,
            "VA reservation of {len} bytes is not a positive multiple of the granularity {g}"
        );
        Ok(Self { base: dev.vmm_reserve(len, 0)?, dev: dev.clone(), len, mapped: Vec::new() })
    }
    pub fn base(&self) -> DevicePtr {
        self.base
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.dev
    }
    fn check(&self, offset: usize, len: usize) -> Result<()> {
        let g = self.dev.vmm_granularity();
        crate::ensure!(
            len > 0 && offset % g == 0 && len % g == 0 && offset.checked_add(len).is_some_and(|e| e <= self.len),
            InvalidArgument,
            "range [{offset}, +{len}) is not granule-aligned inside a reservation of {} bytes",
            self.len
        );
        Ok(())
    }
    /// Map `len` bytes of `phys` (from `phys_offset`) at `offset`, with `access`.
    pub fn map(&mut self, offset: usize, len: usize, phys: &PhysMem, phys_offset: usize, access: Access) -> Result<()> {
        self.check(offset, len)?;
        crate::ensure!(
            self.mapped.iter().all(|&(o, l)| offset + len <= o || o + l <= offset),
            InvalidState,
            "range [{offset}, +{len}) overlaps an existing mapping"
        );
        let va = self.base + offset as u64;
        self.dev.vmm_map(va, len, phys.raw(), phys_offset)?;
        if let Err(e) = self.dev.vmm_set_access(va, len, access) {
            log_drop_error("vmm_unmap after failed set_access", self.dev.vmm_unmap(va, len));
            return Err(e);
        }
        self.mapped.push((offset, len));
        Ok(())
    }
    /// Change the access of a mapped range.
    pub fn set_access(&self, offset: usize, len: usize, access: Access) -> Result<()> {
        self.check(offset, len)?;
        self.dev.vmm_set_access(self.base + offset as u64, len, access)
    }
    /// Unmap exactly a range previously passed to [`VaRange::map`].
    pub fn unmap(&mut self, offset: usize, len: usize) -> Result<()> {
        let i = self.mapped.iter().position(|&m| m == (offset, len)).ok_or_else(|| {
            crate::error::Error::invalid_state(format!("range [{offset}, +{len}) is not a mapping of this reservation"))
        })?;
        self.dev.vmm_unmap(self.base + offset as u64, len)?;
        self.mapped.swap_remove(i);
        Ok(())
    }
    /// Whether `[offset, offset+len)` is exactly one current mapping.
    pub fn is_mapped(&self, offset: usize, len: usize) -> bool {
        self.mapped.contains(&(offset, len))
    }
}

impl Drop for VaRange {
    fn drop(&mut self) {
        for (o, l) in self.mapped.drain(..) {
            log_drop_error("vmm_unmap", self.dev.vmm_unmap(self.base + o as u64, l));
        }
        log_drop_error("vmm_free_va", self.dev.vmm_free_va(self.base, self.len));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{self, DeviceSelect};

    /// Taken events come back to the pool when dropped (up to its cap; the
    /// rest are destroyed), are reused before any is created, and the pool
    /// destroys what it keeps when it goes: nothing leaks.
    #[test]
    fn an_event_pool_reuses_up_to_its_cap_and_leaks_nothing() {
        let d = device::open(DeviceSelect::Host, 0).unwrap();
        let base = d.live_counts().events;
        let pool = EventPool::new(&d, 2);
        let s = Stream::new(&d).unwrap();
        let taken: Vec<Event> = (0..3).map(|_| pool.take().unwrap()).collect();
        for e in &taken {
            e.record(&s).unwrap();
        }
        let raws: Vec<RawEvent> = taken.iter().map(Event::raw).collect();
        assert_eq!(d.live_counts().events, base + 3);
        drop(taken);
        assert_eq!(pool.idle(), 2, "kept up to the cap");
        assert_eq!(d.live_counts().events, base + 2, "the one over the cap is destroyed");
        let again = (pool.take().unwrap(), pool.take().unwrap());
        assert!(raws.contains(&again.0.raw()) && raws.contains(&again.1.raw()), "kept events are reused");
        assert_eq!(d.live_counts().events, base + 2, "reuse creates nothing");
        let third = pool.take().unwrap();
        assert_eq!(d.live_counts().events, base + 3, "an empty pool creates");
        s.synchronize().unwrap();
        drop((again, third));
        drop(pool);
        assert_eq!(d.live_counts().events, base, "the pool destroys what it kept");
    }
}
