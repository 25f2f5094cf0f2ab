//! The sub-allocator both arenas share: exact best fit over a byte range
//! counted in `unit`s (the smallest free range that holds the request, the
//! lowest address among equals), with immediate coalescing of neighbours,
//! plus the bookkeeping an arena needs on top of it: which offsets are live
//! (so a free by address is checked, and a double free is an error, not
//! undefined allocator state), the bytes in use and their peak.
//!
//! Why exact best fit rather than a TLSF-style bin search (as the
//! offset-allocator crate does): a bin search rounds the request *up* to its bin and so
//! never finds a free range of exactly the requested size unless that size is
//! a bin boundary. ONNX Runtime frees and re-requests the same tensor sizes
//! layer after layer; a rounded search would skip those exact holes and cut
//! the requests from the untouched top of the arena, so the committed
//! footprint would climb above the bytes live. Exact best fit keeps an
//! ORT-like trace within a small factor of its live peak
//! (`arena::stream_order::tests::an_ort_like_trace_*`). Both structures
//! below are B-trees: O(log free ranges) per call, well
//! under a microsecond for the thousands of holes an arena has.
//!
//! A free range may carry a *tag* (non-zero): memory freed on a stream whose
//! queued work may still use it (`arena::stream_order`). A tagged range is
//! found only by [`SubAlloc::alloc_tagged`] with the same tag, coalesces only
//! with neighbours of its tag, and becomes free for everyone at
//! [`SubAlloc::untag`]. Tag 0 is free for everyone.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::error::Result;

/// One live sub-allocation.
#[derive(Clone, Copy)]
pub(crate) struct Live {
    /// First byte of the underlying range (before alignment padding).
    start: usize,
    /// Bytes the underlying range spans (padding and unit rounding included).
    span: usize,
    /// Bytes the caller asked for.
    pub requested: usize,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Live[{:#x}, +{}) req {}", self.start, self.span, self.requested)
    }
}

impl Live {
    /// The byte range `[start, start+span)` this allocation occupies.
    pub fn span(&self) -> (usize, usize) {
        (self.start, self.span)
    }
}

pub(crate) struct SubAlloc {
    unit: usize,
    capacity: usize,
    max_allocs: u32,
    /// Free ranges: start → (length, tag). Never two adjacent of one tag (frees coalesce).
    free_by_start: BTreeMap<usize, (usize, u64)>,
    /// The same ranges as (tag, length, start): best fit for a tag is the
    /// first at or after (tag, request, 0).
    free_by_len: BTreeSet<(u64, usize, usize)>,
    /// Untagged free bytes (free for everyone).
    free_bytes: usize,
    /// Free bytes in tagged ranges, and how many such ranges.
    tagged_bytes: usize,
    tagged_ranges: usize,
    /// Peak of in use + tagged: the bytes not free for everyone.
    peak_held: usize,
    live: HashMap<usize, Live>,
    in_use: usize,
    peak_in_use: usize,
}

impl std::fmt::Debug for SubAlloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubAlloc")
            .field("unit", &self.unit)
            .field("capacity", &self.capacity)
            .field("live", &self.live.len())
            .field("free_ranges", &self.free_by_start.len())
            .field("in_use", &self.in_use)
            .finish()
    }
}

impl SubAlloc {
    /// A range of `capacity` bytes (a multiple of `unit`, at most `u32::MAX` units).
    pub fn new(capacity: usize, unit: usize, max_allocs: u32) -> Result<Self> {
        crate::ensure!(
            unit.is_power_of_two() && capacity > 0 && capacity.is_multiple_of(unit),
            InvalidArgument,
            "arena capacity {capacity} is not a positive multiple of the unit {unit} (a power of two)"
        );
        let units = capacity / unit;
        crate::ensure!(
            units <= u32::MAX as usize,
            InvalidArgument,
            "arena capacity {capacity} exceeds {} units of {unit} bytes",
            u32::MAX
        );
        crate::ensure!(
            (16..(1 << 24)).contains(&max_allocs),
            InvalidArgument,
            "max_allocs {max_allocs} is outside [16, 2^24)"
        );
        let mut s = Self {
            unit,
            capacity,
            max_allocs,
            free_by_start: BTreeMap::new(),
            free_by_len: BTreeSet::new(),
            free_bytes: 0,
            tagged_bytes: 0,
            tagged_ranges: 0,
            peak_held: 0,
            live: HashMap::new(),
            in_use: 0,
            peak_in_use: 0,
        };
        s.insert_free(0, capacity, 0);
        Ok(s)
    }

    fn insert_free(&mut self, start: usize, len: usize, tag: u64) {
        self.free_by_start.insert(start, (len, tag));
        self.free_by_len.insert((tag, len, start));
        if tag == 0 {
            self.free_bytes += len;
        } else {
            self.tagged_bytes += len;
            self.tagged_ranges += 1;
        }
    }

    fn remove_free(&mut self, start: usize, len: usize, tag: u64) {
        self.free_by_start.remove(&start);
        self.free_by_len.remove(&(tag, len, start));
        if tag == 0 {
            self.free_bytes -= len;
        } else {
            self.tagged_bytes -= len;
            self.tagged_ranges -= 1;
        }
    }

    /// Insert a free range, merging it with free neighbours of the same tag.
    /// A tagged range also absorbs untagged neighbours (except the arena's
    /// top range): its owner may use them at once anyway, and one range is
    /// what lets it serve a request larger than either half. They become
    /// everyone's again with the tag ([`Self::untag`]).
    fn insert_coalescing(&mut self, mut start: usize, mut len: usize, tag: u64) {
        let cap = self.capacity;
        let absorbs = |ntag: u64, end: usize| ntag == tag || (tag != 0 && ntag == 0 && end != cap);
        if let Some((&p, &(plen, ptag))) = self.free_by_start.range(..start).next_back()
            && p + plen == start
            && absorbs(ptag, p + plen)
        {
            self.remove_free(p, plen, ptag);
            start = p;
            len += plen;
        }
        if let Some(&(nlen, ntag)) = self.free_by_start.get(&(start + len))
            && absorbs(ntag, start + len + nlen)
        {
            self.remove_free(start + len, nlen, ntag);
            len += nlen;
        }
        self.insert_free(start, len, tag);
    }

    fn note_held(&mut self) {
        self.peak_held = self.peak_held.max(self.in_use + self.tagged_bytes);
    }

    /// Allocate `bytes > 0` at an offset aligned to `align` (a power of two;
    /// alignments up to the unit are free, larger ones cost padding) from
    /// memory free for everyone. Returns the aligned offset.
    pub fn alloc(&mut self, bytes: usize, align: usize) -> Result<usize> {
        match self.alloc_in(bytes, align, 0, true)? {
            Ok(off) => Ok(off),
            Err(span) => crate::bail!(
                OutOfBudget,
                "arena of {} bytes has no free range of {span} bytes ({} bytes free, largest free range {} bytes{})",
                self.capacity,
                self.free_bytes,
                self.largest_free(),
                if self.tagged_bytes > 0 {
                    format!("; {} bytes wait for their stream's work", self.tagged_bytes)
                } else {
                    String::new()
                }
            ),
        }
    }

    /// For the owner of `tag`: the best fit over the ranges freed with `tag`
    /// and those free for everyone (tag 0: only the latter). With `fresh` false the arena's
    /// top range (the one reaching its end: memory never used, or given back)
    /// is left out, so the caller can first release completed tags and keep
    /// its footprint. `Ok(None)` when nothing fits; else the offset and
    /// whether it came from a range of `tag`.
    pub fn alloc_tagged(&mut self, bytes: usize, align: usize, tag: u64, fresh: bool) -> Result<Option<(usize, bool)>> {
        let before = self.tagged_bytes;
        Ok(self.alloc_in(bytes, align, tag, fresh)?.ok().map(|off| (off, self.tagged_bytes < before)))
    }

    /// Whether a free range of `tag` (non-zero) ends at `start`.
    fn own_range_below(&self, start: usize, tag: u64) -> bool {
        tag != 0
            && self
                .free_by_start
                .range(..start)
                .next_back()
                .is_some_and(|(&p, &(plen, ptag))| p + plen == start && ptag == tag)
    }

    /// The best fit for `span` in the ranges of `tag` (with `fresh` false,
    /// not the top range).
    fn best(&self, tag: u64, span: usize, fresh: bool) -> Option<(usize, usize, u64)> {
        self.free_by_len
            .range((tag, span, 0)..)
            .take_while(|r| r.0 == tag)
            .find(|&&(_, len, start)| fresh || start + len != self.capacity)
            .map(|&(t, len, start)| (len, start, t))
    }

    /// The offset, or `Err(span)` when no range holds the span: for tag 0 the
    /// untagged ranges, for another tag its own and the untagged ones.
    fn alloc_in(
        &mut self,
        bytes: usize,
        align: usize,
        tag: u64,
        fresh: bool,
    ) -> Result<std::result::Result<usize, usize>> {
        crate::ensure!(bytes > 0, InvalidArgument, "allocation of 0 bytes");
        crate::ensure!(
            align == 0 || align.is_power_of_two(),
            InvalidArgument,
            "alignment {align} is not a power of two"
        );
        let align = align.max(self.unit);
        let pad = align - self.unit;
        let span = bytes
            .checked_add(pad)
            .and_then(|b| b.checked_next_multiple_of(self.unit))
            .filter(|&b| b <= self.capacity)
            .ok_or_else(|| {
                crate::error::Error::new(
                    crate::error::EpmStatus::OutOfBudget,
                    format!("allocation of {bytes} bytes (align {align}) exceeds the arena capacity {}", self.capacity),
                )
            })?;
        if self.live.len() >= self.max_allocs as usize {
            crate::bail!(
                OutOfBudget,
                "arena holds its maximum of {} live allocations (raise max_allocs)",
                self.max_allocs
            );
        }
        let req_tag = tag;
        let own = if tag == 0 { None } else { self.best(tag, span, true) };
        let shared = self.best(0, span, fresh);
        // The smaller range wins (best fit over both), then the lower address.
        let Some((mut len, mut start, mut tag)) = own.into_iter().chain(shared).min() else {
            return Ok(Err(span));
        };
        if start + len == self.capacity && tag == 0 && self.own_range_below(start, req_tag) {
            // The top range is cut: if a range of the owner's tag ends where
            // it begins (a tagged range never absorbs the top), start there,
            // so the footprint grows by what is missing, not by the request.
            let (&p, &(plen, ptag)) = self.free_by_start.range(..start).next_back().expect("checked");
            self.remove_free(p, plen, ptag);
            self.remove_free(start, len, 0);
            self.insert_free(p, plen + len, 0);
            (start, len, tag) = (p, plen + len, 0);
        }
        self.remove_free(start, len, tag);
        if len > span {
            // The low end is used: allocations pack towards low addresses,
            // so the committed footprint follows the bytes in use.
            self.insert_free(start + span, len - span, tag);
        }
        let offset = start.next_multiple_of(align);
        self.live.insert(offset, Live { start, span, requested: bytes });
        self.in_use += span;
        self.peak_in_use = self.peak_in_use.max(self.in_use);
        self.note_held();
        Ok(Ok(offset))
    }

    /// Free the allocation at `offset`; returns what it was. Unknown offsets
    /// (never allocated, or already freed) are an error.
    pub fn free(&mut self, offset: usize) -> Result<Live> {
        self.free_as(offset, 0)
    }

    /// Free into the pool of `tag`: only [`Self::alloc_tagged`] with the same
    /// tag sees the range until [`Self::untag`].
    pub fn free_tagged(&mut self, offset: usize, tag: u64) -> Result<Live> {
        crate::ensure!(tag != 0, InvalidArgument, "tag 0 is the untagged pool");
        self.free_as(offset, tag)
    }

    /// Make every range of `tag` free for everyone (coalescing with untagged
    /// neighbours). Returns the bytes released.
    pub fn untag(&mut self, tag: u64) -> usize {
        if tag == 0 {
            return 0;
        }
        let ranges: Vec<(usize, usize)> = self
            .free_by_len
            .range((tag, 0, 0)..=(tag, usize::MAX, usize::MAX))
            .map(|&(_, len, start)| (start, len))
            .collect();
        let mut bytes = 0;
        for (start, len) in ranges {
            self.remove_free(start, len, tag);
            self.insert_coalescing(start, len, 0);
            bytes += len;
        }
        bytes
    }

    fn free_as(&mut self, offset: usize, tag: u64) -> Result<Live> {
        let live = self.live.remove(&offset).ok_or_else(|| {
            crate::error::Error::invalid_argument(format!(
                "offset {offset:#x} is not a live allocation of this arena (double free or foreign pointer)"
            ))
        })?;
        self.insert_coalescing(live.start, live.span, tag);
        self.in_use -= live.span;
        Ok(live)
    }

    /// The largest range free for everyone.
    fn largest_free(&self) -> usize {
        self.free_by_len.range(..(1, 0, 0)).next_back().map_or(0, |&(_, len, _)| len)
    }
    /// (tagged free ranges, their bytes).
    pub fn tagged(&self) -> (usize, usize) {
        (self.tagged_ranges, self.tagged_bytes)
    }
    /// Peak of bytes in use plus tagged: what was never free for everyone at once.
    pub fn peak_held(&self) -> usize {
        self.peak_held
    }

    pub fn get(&self, offset: usize) -> Option<&Live> {
        self.live.get(&offset)
    }
    pub fn live_count(&self) -> usize {
        self.live.len()
    }
    /// Bytes held by live allocations (unit rounding and alignment padding included).
    pub fn in_use(&self) -> usize {
        self.in_use
    }
    pub fn peak_in_use(&self) -> usize {
        self.peak_in_use
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// (free bytes, largest free range in bytes), counting only memory free
    /// for everyone. A request up to the largest range (alignment padding
    /// included) succeeds.
    pub fn free_report(&self) -> (usize, usize) {
        (self.free_bytes, self.largest_free())
    }
    /// 1 − largest free range / free bytes: 0 when all free space is one
    /// range, towards 1 when it is scattered in small holes.
    pub fn fragmentation(&self) -> f64 {
        let (free, largest) = self.free_report();
        if free == 0 { 0.0 } else { 1.0 - largest as f64 / free as f64 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_allocations_do_not_overlap_and_account_exactly() {
        let mut a = SubAlloc::new(1 << 20, 256, 1024).unwrap();
        let x = a.alloc(100, 0).unwrap();
        let y = a.alloc(300, 4096).unwrap();
        assert_eq!(y % 4096, 0);
        assert!(x + 256 <= y || y + 300 <= x);
        assert_eq!(a.in_use(), 256 + (300usize + 4096 - 256).next_multiple_of(256));
        assert_eq!(a.free(x).unwrap().requested, 100);
        assert_eq!(a.free(x).unwrap_err().status(), crate::error::EpmStatus::InvalidArgument);
        a.free(y).unwrap();
        assert_eq!(a.in_use(), 0);
        assert_eq!(a.fragmentation(), 0.0);
    }

    #[test]
    fn exhaustion_is_out_of_budget() {
        let mut a = SubAlloc::new(4096, 256, 64).unwrap();
        assert_eq!(a.alloc(8192, 0).unwrap_err().status(), crate::error::EpmStatus::OutOfBudget);
        let x = a.alloc(4096, 0).unwrap();
        let e = a.alloc(1, 0).unwrap_err();
        assert_eq!(e.status(), crate::error::EpmStatus::OutOfBudget);
        assert!(e.message().contains("no free range"), "{e}");
        a.free(x).unwrap();
        a.alloc(4096, 0).unwrap();
    }

    #[test]
    fn bad_arguments_are_errors() {
        assert!(SubAlloc::new(1000, 256, 64).is_err());
        assert!(SubAlloc::new(4096, 100, 64).is_err());
        let mut a = SubAlloc::new(4096, 256, 64).unwrap();
        assert_eq!(a.alloc(0, 0).unwrap_err().status(), crate::error::EpmStatus::InvalidArgument);
        assert_eq!(a.alloc(8, 3).unwrap_err().status(), crate::error::EpmStatus::InvalidArgument);
    }

    #[test]
    fn best_fit_takes_the_exact_hole_a_bin_search_would_skip() {
        let mut a = SubAlloc::new(1 << 20, 256, 1024).unwrap();
        // Holes of 3328 and 4096 bytes between live blocks; a 3328-byte
        // request must land in its exact hole, not cut the larger one.
        let x = a.alloc(3328, 0).unwrap();
        let _k1 = a.alloc(256, 0).unwrap();
        let y = a.alloc(4096, 0).unwrap();
        let _k2 = a.alloc(256, 0).unwrap();
        a.free(y).unwrap();
        a.free(x).unwrap();
        assert_eq!(a.alloc(3328, 0).unwrap(), x);
        assert_eq!(a.alloc(4096, 0).unwrap(), y);
    }

    #[test]
    fn tagged_ranges_serve_only_their_owner_until_untagged() {
        let mut a = SubAlloc::new(1 << 20, 256, 1024).unwrap();
        let p = a.alloc(4096, 0).unwrap();
        let q = a.alloc(4096, 0).unwrap();
        let _guard = a.alloc(256, 0).unwrap();
        a.free_tagged(p, 7).unwrap();
        a.free_tagged(q, 7).unwrap();
        assert_eq!(a.tagged(), (1, 8192), "a tag's neighbours coalesce");
        // Everyone else cuts fresh memory; another tag too.
        let r = a.alloc(4096, 0).unwrap();
        assert!(r >= q + 4096);
        let (o, own) = a.alloc_tagged(4096, 0, 9, true).unwrap().unwrap();
        assert!(!own && o >= q + 4096, "tag 9 got tag 7's memory");
        // The owner gets its own range back, a piece of it at a time.
        assert_eq!(a.alloc_tagged(2048, 0, 7, false).unwrap(), Some((p, true)));
        assert_eq!(a.tagged(), (1, 6144));
        // Without fresh memory the owner is refused what only the top holds.
        assert_eq!(a.alloc_tagged(1 << 19, 0, 7, false).unwrap(), None);
        a.free_tagged(p, 7).unwrap();
        assert_eq!(a.untag(7), 8192);
        assert_eq!(a.tagged(), (0, 0));
        assert_eq!(a.alloc(8192, 0).unwrap(), p, "untagged, the range is everyone's");
        assert!(a.peak_held() >= 8192 + 256 + 4096 * 2);
        assert_eq!(a.free_tagged(12345, 7).unwrap_err().status(), crate::error::EpmStatus::InvalidArgument);
        // Tag 0 is the shared pool alone.
        assert_eq!(a.alloc_tagged(16, 0, 0, true).unwrap().map(|(_, own)| own), Some(false));
    }

    #[test]
    fn an_owner_grows_from_its_range_below_the_top() {
        let mut a = SubAlloc::new(1 << 20, 256, 1024).unwrap();
        let _low = a.alloc(256, 0).unwrap();
        let p = a.alloc(4096, 0).unwrap();
        a.free_tagged(p, 3).unwrap();
        // 8 KiB do not fit in the 4 KiB tagged range; it borders the top, so
        // the allocation starts there instead of above it.
        let (x, own) = a.alloc_tagged(8192, 0, 3, true).unwrap().unwrap();
        assert_eq!((x, own), (p, true));
        assert_eq!(a.tagged(), (0, 0));
        a.free(x).unwrap();
        assert_eq!(a.fragmentation(), 0.0);
    }
}
