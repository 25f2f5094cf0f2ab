//! The bounded pool of pinned staging buffers.
//!
//! Why a pool: `cuMemHostAlloc`/`cuMemFreeHost` cost 610/257 µs at 2 MiB and
//! 12.6/3.5 ms at 32 MiB on the H200, and take the context lock; a 32 MiB
//! page-in that allocates and frees its staging buffer took 19.9 ms against
//! 2.2 ms pooled. Why bounded: pinned memory is unswappable host RAM, so the
//! pool never trades an unbounded amount of it for speed.
//!
//! Reuse is safe only after the buffer's copy has completed. The pool's one
//! way back in is [`PinnedStagingPool::release`] (or
//! [`CopyCompleted::retire`]), which takes the buffer *inside* the
//! [`CopyCompleted`] witness that only [`InFlight::wait`] /
//! [`InFlight::try_complete`] of that buffer's own copy produce (see
//! [`crate::transfer::witness`]): a witness is its buffer, so the proof of copy A
//! cannot retire buffer B. A [`PooledStaging`] alone has no way back: dropped
//! (un-retired), it is freed, never recycled.
//!
//! The refusals are compiled, with their error codes checked, by
//! `tests/compile_fail.rs`. The path that compiles — two buffers, A's copy
//! done, B's in flight:
//! ```
//! # use epmem::device::{self, DeviceBuffer, Stream};
//! # use epmem::transfer::witness;
//! # use epmem::staging::{PinnedStagingPool, PoolConfig};
//! # fn main() -> epmem::Result<()> {
//! # let dev = device::open_from_env(0)?;
//! # let stream = Stream::new(&dev)?;
//! # let dst = DeviceBuffer::new(&dev, 4096)?;
//! let pool = PinnedStagingPool::new(&dev, PoolConfig::default())?;
//! let (a, b) = (pool.acquire(4096)?, pool.acquire(4096)?);
//! let a_done = witness::enqueue_htod(&stream, dst.ptr(), a, 4096, None)?.wait()?;
//! let b_flight = witness::enqueue_htod(&stream, dst.ptr(), b, 4096, None)?;
//! pool.release(a_done);
//! let b_done = b_flight.wait()?;
//! pool.release(b_done);
//! assert_eq!(pool.stats().retained_buffers, 2);
//! # Ok(()) }
//! ```
//!
//! [`InFlight::wait`]: crate::transfer::witness::InFlight::wait
//! [`InFlight::try_complete`]: crate::transfer::witness::InFlight::try_complete

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::device::{Device, PinnedBuffer};
use crate::error::Result;
use crate::transfer::witness::{CopyCompleted, PinnedOwner, sealed};

/// Bounds on what the pool keeps between uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Most buffers retained (default 8).
    pub max_buffers: usize,
    /// Most bytes retained (default 512 MiB).
    pub max_bytes: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self { max_buffers: 8, max_bytes: 512 << 20 }
    }
}

/// Counters of one pool (monotonic except the two `retained_*`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Pinned allocations (driver calls) the pool made.
    pub pinned_alloc_calls: u64,
    /// Pinned frees (driver calls): returns that breached a bound, buffers
    /// dropped un-retired, trims.
    pub pinned_free_calls: u64,
    /// Acquires served from a retained buffer.
    pub pinned_reuses: u64,
    /// Bytes retained now.
    pub retained_bytes: u64,
    /// Buffers retained now.
    pub retained_buffers: u64,
}

#[derive(Debug, Default)]
struct FreeList {
    /// Sorted by capacity, ascending, so the smallest fit is a binary search.
    buffers: Vec<PinnedBuffer>,
    bytes: usize,
}

impl FreeList {
    /// Keep `buf` if the bounds allow (sorted in), else hand it back.
    fn try_keep(&mut self, cfg: PoolConfig, buf: PinnedBuffer) -> Option<PinnedBuffer> {
        if self.buffers.len() < cfg.max_buffers && self.bytes + buf.len() <= cfg.max_bytes {
            self.bytes += buf.len();
            let i = self.buffers.partition_point(|b| b.len() < buf.len());
            self.buffers.insert(i, buf);
            None
        } else {
            Some(buf)
        }
    }
}

#[derive(Debug)]
struct Shared {
    dev: Arc<dyn Device>,
    cfg: PoolConfig,
    free: Mutex<FreeList>,
    alloc_calls: AtomicU64,
    free_calls: AtomicU64,
    reuses: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, FreeList> {
        // The critical sections below only move buffers between a Vec and a
        // local; a panic cannot leave the list half-updated, so poison is moot.
        self.free.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A bounded free-list of pinned buffers. Cheap to clone (a handle);
/// thread-safe; no driver call is made while its lock is held.
#[derive(Debug, Clone)]
pub struct PinnedStagingPool {
    shared: Arc<Shared>,
}

impl PinnedStagingPool {
    pub fn new(dev: &Arc<dyn Device>, cfg: PoolConfig) -> Result<Self> {
        crate::ensure!(
            cfg.max_buffers > 0 && cfg.max_bytes > 0,
            InvalidArgument,
            "staging pool bounds must be positive (max_buffers {}, max_bytes {})",
            cfg.max_buffers,
            cfg.max_bytes
        );
        let shared = Shared {
            dev: dev.clone(),
            cfg,
            free: Mutex::new(FreeList::default()),
            alloc_calls: AtomicU64::new(0),
            free_calls: AtomicU64::new(0),
            reuses: AtomicU64::new(0),
        };
        Ok(Self { shared: Arc::new(shared) })
    }

    pub fn config(&self) -> PoolConfig {
        self.shared.cfg
    }

    pub fn device(&self) -> &Arc<dyn Device> {
        &self.shared.dev
    }

    /// A buffer of at least `len` bytes: the smallest retained one that fits,
    /// else a fresh allocation of exactly `len`.
    ///
    /// If the allocation fails (e.g. the locked-memory limit), the retained
    /// buffers are freed and the allocation tried once more.
    pub fn acquire(&self, len: usize) -> Result<PooledStaging> {
        crate::ensure!(len > 0, InvalidArgument, "staging buffer of 0 bytes");
        let reused = {
            let mut free = self.shared.lock();
            let i = free.buffers.partition_point(|b| b.len() < len);
            if i < free.buffers.len() {
                let b = free.buffers.remove(i);
                free.bytes -= b.len();
                Some(b)
            } else {
                None
            }
        };
        let buf = match reused {
            Some(b) => {
                self.shared.reuses.fetch_add(1, Ordering::Relaxed);
                b
            }
            None => self.allocate(len)?,
        };
        Ok(PooledStaging { buf: Some(buf), pool: self.shared.clone() })
    }

    /// Counts successful allocations only, as the device's driver counts do,
    /// so `alloc_calls - free_calls` is always the buffers retained or on
    /// loan (tests/fault_injection.rs checks it after injected failures).
    fn allocate(&self, len: usize) -> Result<PinnedBuffer> {
        let buf = match PinnedBuffer::new(&self.shared.dev, len) {
            Ok(b) => b,
            Err(e) => {
                if self.trim() == 0 {
                    return Err(e);
                }
                log::info!("epmem: pinned allocation of {len} bytes failed ({e}); freed the staging pool and retried");
                PinnedBuffer::new(&self.shared.dev, len)?
            }
        };
        self.shared.alloc_calls.fetch_add(1, Ordering::Relaxed);
        Ok(buf)
    }

    /// Retain at least `n` buffers of at least `len` bytes, allocating the
    /// missing ones now (the bounds permitting): a user whose loans never
    /// exceed `n` buffers of `len` then allocates nothing after this call,
    /// however its copies happen to overlap. On an allocation failure the
    /// buffers allocated so far stay retained and the error is returned.
    pub fn reserve(&self, n: usize, len: usize) -> Result<()> {
        crate::ensure!(len > 0, InvalidArgument, "staging buffer of 0 bytes");
        let cfg = self.shared.cfg;
        loop {
            let missing = {
                let free = self.shared.lock();
                let fitting = free.buffers.len() - free.buffers.partition_point(|b| b.len() < len);
                n > fitting && free.buffers.len() < cfg.max_buffers && free.bytes + len <= cfg.max_bytes
            };
            if !missing {
                return Ok(());
            }
            // Not `allocate`: its fallback frees the retained buffers, the
            // very ones this call is for.
            let buf = PinnedBuffer::new(&self.shared.dev, len)?;
            self.shared.alloc_calls.fetch_add(1, Ordering::Relaxed);
            let rejected = self.shared.lock().try_keep(cfg, buf);
            if let Some(buf) = rejected {
                // Another thread filled the pool meanwhile: nothing missing.
                self.shared.free_calls.fetch_add(1, Ordering::Relaxed);
                drop(buf);
                return Ok(());
            }
        }
    }

    /// Free every retained buffer; returns how many were freed.
    pub fn trim(&self) -> usize {
        let taken = {
            let mut free = self.shared.lock();
            free.bytes = 0;
            std::mem::take(&mut free.buffers)
        };
        let n = taken.len();
        self.shared.free_calls.fetch_add(n as u64, Ordering::Relaxed);
        drop(taken); // the driver frees happen here, outside the lock
        n
    }

    /// Return a buffer whose last copy completed — the buffer inside that
    /// copy's witness. The buffer goes back to the pool it came from (a
    /// buffer is never moved between pools); if keeping it would breach a
    /// bound, it is freed instead (outside the pool's lock).
    pub fn release(&self, done: CopyCompleted<PooledStaging>) {
        done.retire();
    }

    pub fn stats(&self) -> PoolStats {
        let (retained_bytes, retained_buffers) = {
            let free = self.shared.lock();
            (free.bytes as u64, free.buffers.len() as u64)
        };
        PoolStats {
            pinned_alloc_calls: self.shared.alloc_calls.load(Ordering::Relaxed),
            pinned_free_calls: self.shared.free_calls.load(Ordering::Relaxed),
            pinned_reuses: self.shared.reuses.load(Ordering::Relaxed),
            retained_bytes,
            retained_buffers,
        }
    }
}

/// A staging buffer on loan from a [`PinnedStagingPool`]. Derefs to its bytes
/// (its whole capacity, which may exceed the length asked for).
///
/// It goes back to the pool only inside the witness of the copy that last
/// used it ([`PinnedStagingPool::release`], [`CopyCompleted::retire`]).
/// Dropped any other way, it is freed.
pub struct PooledStaging {
    /// Some until retiring or drop takes it.
    buf: Option<PinnedBuffer>,
    pool: Arc<Shared>,
}

impl std::fmt::Debug for PooledStaging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PooledStaging").field("buf", &self.buf).finish()
    }
}

impl PooledStaging {
    /// Bytes usable in this buffer.
    pub fn capacity(&self) -> usize {
        self.pinned().len()
    }
}

impl CopyCompleted<PooledStaging> {
    /// Return the buffer to its pool: the witness is the proof that its last
    /// copy completed, and is spent here (one completed copy, one return).
    /// If keeping it would breach a bound of the pool, it is freed instead
    /// (outside the pool's lock).
    pub fn retire(self) {
        let mut staging = self.into_buffer();
        let Some(buf) = staging.buf.take() else { return };
        let pool = &staging.pool;
        let rejected = pool.lock().try_keep(pool.cfg, buf);
        if let Some(buf) = rejected {
            pool.free_calls.fetch_add(1, Ordering::Relaxed);
            drop(buf);
        }
    }
}

impl sealed::Sealed for PooledStaging {}
impl PinnedOwner for PooledStaging {
    fn pinned(&self) -> &PinnedBuffer {
        match &self.buf {
            Some(b) => b,
            // `buf` is None only inside `retire`/`drop`, which consume it.
            None => unreachable!("PooledStaging used after retire"),
        }
    }
    fn pinned_mut(&mut self) -> &mut PinnedBuffer {
        match &mut self.buf {
            Some(b) => b,
            None => unreachable!("PooledStaging used after retire"),
        }
    }
}

impl std::ops::Deref for PooledStaging {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.pinned()
    }
}

impl std::ops::DerefMut for PooledStaging {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.pinned_mut()
    }
}

impl Drop for PooledStaging {
    /// Not retired: its last copy is unproven, so the buffer is freed, never
    /// recycled. Costs a re-allocation later, which `pinned_alloc_calls`
    /// makes visible. Never panics (a failed free is logged by PinnedBuffer).
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            self.pool.free_calls.fetch_add(1, Ordering::Relaxed);
            drop(buf);
        }
    }
}
