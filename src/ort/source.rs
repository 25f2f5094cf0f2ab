//! Where an ORT allocator's memory comes from.
//!
//! [`MemorySource`] is the seam between the ORT adapter and epmem's memory
//! machinery: the allocator glue (`allocator.rs`) does accounting, limits and
//! stats; a source only hands out and takes back address ranges. Today the
//! sources are the device's plain allocation calls; the device and pinned
//! arenas (`src/arena/`) replace them here, and nowhere else.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::device::Device;
use crate::error::Result;

/// Counters a source keeps about the memory it holds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct SourceStats {
    /// Physical bytes held from the driver now.
    pub committed_bytes: u64,
    /// Address space held (an arena's reservation; the allocations themselves here).
    pub reserved_bytes: u64,
    /// Times the source went to the driver for more memory.
    pub extensions: u64,
    /// Times the source gave memory back to the driver.
    pub shrinks: u64,
    /// 1 − largest free range / free bytes (0 when nothing is held unused).
    pub fragmentation: f64,
}

/// A provider of one kind of memory on one device.
pub(crate) trait MemorySource: Send + Sync {
    /// `bytes > 0` bytes; returns the address (a device address for device
    /// memory, a host address for pinned memory).
    fn alloc(&self, bytes: usize) -> Result<u64>;
    /// Give back an address from [`MemorySource::alloc`]. No queued work may
    /// still use it.
    fn free(&self, addr: u64) -> Result<()>;
    /// Return memory no allocation uses to the driver; bytes given back.
    fn trim(&self) -> Result<usize>;
    fn stats(&self) -> SourceStats;
    /// Short name for stats ("device_alloc", "pinned_alloc", "arena").
    fn name(&self) -> &'static str;
}

/// Which memory of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MemKind {
    /// Device memory (ORT's DEFAULT).
    Device,
    /// Page-locked host memory (ORT's HOST_ACCESSIBLE).
    Pinned,
}

/// The source for `kind` memory on `dev`.
pub(crate) fn open(dev: &Arc<dyn Device>, kind: MemKind) -> Box<dyn MemorySource> {
    Box::new(DriverSource {
        dev: dev.clone(),
        kind,
        held: Mutex::new(Held::default()),
    })
}

#[derive(Default)]
struct Held {
    sizes: HashMap<u64, usize>,
    stats: SourceStats,
}

/// One driver allocation per request (cuMemAlloc / cuMemHostAlloc): correct
/// but a driver call per Alloc, which the arenas exist to remove.
struct DriverSource {
    dev: Arc<dyn Device>,
    kind: MemKind,
    held: Mutex<Held>,
}

impl MemorySource for DriverSource {
    fn alloc(&self, bytes: usize) -> Result<u64> {
        let addr = match self.kind {
            MemKind::Device => self.dev.mem_alloc(bytes)?,
            MemKind::Pinned => self.dev.pinned_alloc(bytes)? as u64,
        };
        let mut h = self.held.lock().unwrap_or_else(|e| e.into_inner());
        h.sizes.insert(addr, bytes);
        h.stats.committed_bytes += bytes as u64;
        h.stats.reserved_bytes += bytes as u64;
        h.stats.extensions += 1;
        Ok(addr)
    }

    fn free(&self, addr: u64) -> Result<()> {
        let mut h = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let Some(bytes) = h.sizes.remove(&addr) else {
            crate::bail!(InvalidArgument, "address {addr:#x} was not allocated by this source");
        };
        let r = match self.kind {
            MemKind::Device => self.dev.mem_free(addr),
            // SAFETY: addr came from pinned_alloc on this device (it is in
            // `sizes`) and is freed once (removed above); the allocator's
            // contract with ORT is that nothing uses it any more.
            MemKind::Pinned => unsafe { self.dev.pinned_free(addr as *mut u8) },
        };
        h.stats.committed_bytes -= bytes as u64;
        h.stats.reserved_bytes -= bytes as u64;
        h.stats.shrinks += 1;
        r
    }

    fn trim(&self) -> Result<usize> {
        // Every byte held is a live allocation: nothing to give back.
        Ok(0)
    }

    fn stats(&self) -> SourceStats {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).stats
    }

    fn name(&self) -> &'static str {
        match self.kind {
            MemKind::Device => "device_alloc",
            MemKind::Pinned => "pinned_alloc",
        }
    }
}
