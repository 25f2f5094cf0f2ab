//! The pinned-host arena: page-locked segments, each sub-allocated.
//!
//! Pinned memory cannot be grown in place, so each growth is a new segment
//! (one cuMemHostAlloc) with its own sub-allocator. A request larger than a
//! segment gets a segment of its own size. Allocation tries the segment that
//! served last, then the others (each check is O(1) against the allocator's
//! largest free range), so the cost is O(segments) only when one fills up.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use super::suballoc::SubAlloc;
use super::{Arena, ArenaConfig, ArenaStats, DEFAULT_UNIT, TaggedStats, chunk_size};
use crate::device::{Device, PinnedBuffer};
use crate::error::Result;

#[derive(Debug)]
struct Segment {
    buf: PinnedBuffer,
    sub: SubAlloc,
}

impl Segment {
    fn base(&self) -> u64 {
        self.buf.as_ptr() as u64
    }
}

#[derive(Debug)]
struct Inner {
    /// Segments by base address, so a free finds its segment in O(log n).
    segs: BTreeMap<u64, Segment>,
    last: Option<u64>,
    committed: usize,
    in_use: usize,
    peak_in_use: usize,
    /// Bytes in tagged free ranges (see [`Arena::alloc_tagged`]) and the
    /// peak of in use + tagged.
    tagged: usize,
    peak_held: usize,
    stats: ArenaStats,
}

impl Inner {
    fn note_held(&mut self) {
        self.peak_held = self.peak_held.max(self.in_use + self.tagged);
    }

    /// The segment holding `addr`.
    fn seg_of(&mut self, addr: u64) -> Result<&mut Segment> {
        self.segs
            .range_mut(..=addr)
            .next_back()
            .map(|(_, s)| s)
            .filter(|s| addr < s.base() + s.sub.capacity() as u64)
            .ok_or_else(|| {
                crate::error::Error::invalid_argument(format!("address {addr:#x} is not inside this pinned arena"))
            })
    }

    fn free_as(&mut self, addr: u64, tag: u64) -> Result<()> {
        let seg = self.seg_of(addr)?;
        let off = (addr - seg.base()) as usize;
        let live = if tag == 0 { seg.sub.free(off)? } else { seg.sub.free_tagged(off, tag)? };
        let span = live.span().1;
        self.in_use -= span;
        if tag != 0 {
            self.tagged += span;
        }
        self.stats.free_calls += 1;
        Ok(())
    }
}

/// Page-locked host memory for staging and ONNX Runtime's host-accessible
/// allocator. See [`super`].
#[derive(Debug)]
pub struct PinnedArena {
    dev: Arc<dyn Device>,
    chunk: usize,
    capacity: usize,
    max_allocs: u32,
    inner: Mutex<Inner>,
}

impl PinnedArena {
    /// Nothing is allocated until the first request.
    pub fn new(dev: &Arc<dyn Device>, cfg: ArenaConfig) -> Result<Self> {
        super::check_capacity(cfg.capacity)?;
        let chunk = chunk_size(cfg.chunk_bytes, dev.vmm_granularity())?;
        Ok(Self {
            dev: dev.clone(),
            chunk,
            capacity: cfg.capacity,
            max_allocs: cfg.max_allocs,
            inner: Mutex::new(Inner {
                segs: BTreeMap::new(),
                last: None,
                committed: 0,
                in_use: 0,
                peak_in_use: 0,
                tagged: 0,
                peak_held: 0,
                stats: ArenaStats::default(),
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn try_segment(seg: &mut Segment, bytes: usize, align: usize) -> Option<u64> {
        let need = bytes
            .saturating_add(align.saturating_sub(DEFAULT_UNIT))
            .checked_next_multiple_of(DEFAULT_UNIT)
            .unwrap_or(usize::MAX);
        if seg.sub.free_report().1 < need {
            return None;
        }
        seg.sub.alloc(bytes, align).ok().map(|off| seg.base() + off as u64)
    }
}

impl Arena for PinnedArena {
    fn alloc(&self, bytes: usize, align: usize) -> Result<u64> {
        crate::ensure!(bytes > 0, InvalidArgument, "allocation of 0 bytes");
        crate::ensure!(
            align == 0 || (align.is_power_of_two() && align <= self.chunk),
            InvalidArgument,
            "alignment {align} is not a power of two up to the segment size {}",
            self.chunk
        );
        let align = align.max(DEFAULT_UNIT);
        let mut g = self.lock();
        let g = &mut *g;
        let mut found = None;
        if let Some(seg) = g.last.and_then(|b| g.segs.get_mut(&b)) {
            found = Self::try_segment(seg, bytes, align);
        }
        if found.is_none() {
            found = g.segs.values_mut().find_map(|s| Self::try_segment(s, bytes, align));
        }
        let addr = match found {
            Some(a) => a,
            None => {
                // Saturating: a request near usize::MAX must be refused for
                // budget, not wrap to a small segment (test_misuse_mem.c).
                let need = bytes
                    .saturating_add(align - DEFAULT_UNIT)
                    .checked_next_multiple_of(DEFAULT_UNIT)
                    .unwrap_or(usize::MAX);
                // Segments are sub-allocated in whole units.
                let left = (self.capacity - g.committed) / DEFAULT_UNIT * DEFAULT_UNIT;
                crate::ensure!(
                    need <= left,
                    OutOfBudget,
                    "pinned arena: {bytes} bytes need a segment of {need} bytes, but {} of its capacity_bytes {} \
                     are committed ({left} left)",
                    g.committed,
                    self.capacity
                );
                // A whole number of chunks, cut to what is left of the
                // capacity: the arena commits at most `capacity` bytes.
                let size = need.next_multiple_of(self.chunk).min(left);
                let buf = PinnedBuffer::new(&self.dev, size)
                    .map_err(|e| e.context(format!("growing the pinned arena by {size} bytes")))?;
                g.stats.driver_alloc_calls += 1;
                let mut seg = Segment { buf, sub: SubAlloc::new(size, DEFAULT_UNIT, self.max_allocs)? };
                let a = Self::try_segment(&mut seg, bytes, align).ok_or_else(|| {
                    crate::error::Error::internal("a fresh pinned segment refused its first allocation")
                })?;
                g.committed += size;
                g.segs.insert(seg.base(), seg);
                a
            }
        };
        g.last = g.segs.range(..=addr).next_back().map(|(b, _)| *b);
        g.stats.alloc_calls += 1;
        let span = g
            .segs
            .range(..=addr)
            .next_back()
            .and_then(|(b, s)| s.sub.get((addr - b) as usize))
            .map_or(0, |l| l.span().1);
        g.in_use += span;
        g.peak_in_use = g.peak_in_use.max(g.in_use);
        g.note_held();
        Ok(addr)
    }

    fn free(&self, addr: u64) -> Result<()> {
        self.lock().free_as(addr, 0)
    }

    fn alloc_tagged(&self, bytes: usize, tag: u64, fresh: bool) -> Result<Option<(u64, bool)>> {
        {
            let mut g = self.lock();
            let g = &mut *g;
            // Segments are committed whole: any range in them is not fresh.
            for seg in g.segs.values_mut() {
                if let Some((off, own)) = seg.sub.alloc_tagged(bytes, DEFAULT_UNIT, tag, true)? {
                    let span = seg.sub.get(off).map_or(0, |l| l.span().1);
                    let addr = seg.base() + off as u64;
                    g.in_use += span;
                    if own {
                        g.tagged -= span;
                    }
                    g.peak_in_use = g.peak_in_use.max(g.in_use);
                    g.note_held();
                    g.stats.alloc_calls += 1;
                    return Ok(Some((addr, own)));
                }
            }
        }
        // A new segment is fresh memory.
        if fresh { self.alloc(bytes, 0).map(|a| Some((a, false))) } else { Ok(None) }
    }

    fn free_tagged(&self, addr: u64, tag: u64) -> Result<()> {
        crate::ensure!(tag != 0, InvalidArgument, "tag 0 is the untagged pool");
        self.lock().free_as(addr, tag)
    }

    fn untag(&self, tag: u64) -> usize {
        let mut g = self.lock();
        let released: usize = g.segs.values_mut().map(|s| s.sub.untag(tag)).sum();
        g.tagged -= released;
        released
    }

    fn tagged_stats(&self) -> TaggedStats {
        let g = self.lock();
        let (ranges, bytes) = g.segs.values().map(|s| s.sub.tagged()).fold((0, 0), |(r, b), (sr, sb)| (r + sr, b + sb));
        TaggedStats { ranges: ranges as u64, bytes: bytes as u64, peak_held_bytes: g.peak_held as u64 }
    }

    fn size_of(&self, addr: u64) -> Option<usize> {
        let g = self.lock();
        let (base, seg) = g.segs.range(..=addr).next_back()?;
        seg.sub.get((addr - base) as usize).map(|l| l.requested)
    }

    fn trim(&self) -> Result<usize> {
        let mut g = self.lock();
        let empty: Vec<u64> = g
            .segs
            .iter()
            // A segment with tagged ranges may still be read by queued work.
            .filter(|(_, s)| s.sub.live_count() == 0 && s.sub.tagged().1 == 0)
            .map(|(b, _)| *b)
            .collect();
        let mut given = 0;
        for b in empty {
            if let Some(seg) = g.segs.remove(&b) {
                given += seg.sub.capacity();
                drop(seg); // frees the pinned memory (one driver call)
                g.stats.driver_free_calls += 1;
            }
        }
        g.committed -= given;
        if g.last.is_some_and(|b| !g.segs.contains_key(&b)) {
            g.last = None;
        }
        Ok(given)
    }

    fn stats(&self) -> ArenaStats {
        let g = self.lock();
        let (free, largest) =
            g.segs.values().map(|s| s.sub.free_report()).fold((0, 0), |(f, l), (sf, sl)| (f + sf, l.max(sl)));
        ArenaStats {
            reserved_bytes: g.committed as u64,
            committed_bytes: g.committed as u64,
            in_use_bytes: g.in_use as u64,
            peak_in_use_bytes: g.peak_in_use as u64,
            live_allocations: g.segs.values().map(|s| s.sub.live_count() as u64).sum(),
            fragmentation: if free == 0 { 0.0 } else { 1.0 - largest as f64 / free as f64 },
            ..g.stats
        }
    }
}
