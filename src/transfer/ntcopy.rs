//! The fill's memcpy: pageable → pinned with non-temporal (streaming) stores.
//!
//! A plain memcpy into the staging buffer reads each destination line before
//! writing it (read-for-ownership), so host memory carries three transfers per
//! byte — source read, destination read, destination write — while the DMA
//! reads the previous slot over the same memory bus. glibc switches to
//! streaming stores only for copies above a large threshold, and the fill
//! hands its threads pieces of 64 KiB–1 MiB, so it never does. Streaming
//! stores skip the destination read: two transfers per byte instead of three.
//! The destination is about to be read by the DMA engine, not by this CPU, so
//! bypassing the cache costs nothing.
//!
//! `EPM_FILL_NT=0` turns them off (plain `copy_nonoverlapping`), for A/B runs.

use std::sync::OnceLock;

/// Whether the fill uses streaming stores (default yes; `EPM_FILL_NT=0` says no).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("EPM_FILL_NT").map_or(true, |v| v.trim() != "0"))
}

/// Copy `n` bytes from `src` to `dst`, with streaming stores where enabled.
/// The stores are fenced before returning, so whoever learns of the copy's end
/// through a later atomic (and then starts a DMA) sees all of it.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`: `src` readable and `dst` writable for
/// `n` bytes, the two ranges do not overlap.
pub unsafe fn copy(dst: *mut u8, src: *const u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if enabled() && n >= 256 {
        // SAFETY: the caller's contract is exactly stream_copy's.
        unsafe { stream_copy(dst, src, n) };
        return;
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, n) };
}

/// SSE2 (baseline on x86-64): align the destination to 16 bytes, stream 64
/// bytes per iteration, copy the tail plainly, then `sfence`.
///
/// # Safety
/// As [`copy`].
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(dst: *mut u8, src: *const u8, n: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let head = dst.align_offset(16).min(n);
    // SAFETY: the first `head` bytes are inside both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let mut i = head;
    while i + 64 <= n {
        // SAFETY: [i, i+64) is inside both ranges; dst+i is 16-byte aligned
        // (head aligned it and i advances by 64); loads are unaligned-safe.
        unsafe {
            let s = src.add(i) as *const __m128i;
            let d = dst.add(i) as *mut __m128i;
            let a = _mm_loadu_si128(s);
            let b = _mm_loadu_si128(s.add(1));
            let c = _mm_loadu_si128(s.add(2));
            let e = _mm_loadu_si128(s.add(3));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        i += 64;
    }
    // SAFETY: the tail [i, n) is inside both ranges; the fence orders the
    // weakly-ordered streaming stores before anything this thread does next.
    unsafe {
        std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i);
        _mm_sfence();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::conformance::random_bytes;

    #[test]
    fn streaming_copy_is_exact_at_every_alignment_and_length() {
        let src = random_bytes(9, 8192 + 64);
        for len in [0usize, 1, 15, 63, 64, 255, 256, 257, 1000, 4096, 8191] {
            for (so, d_off) in [(0usize, 0usize), (1, 0), (0, 1), (3, 7), (17, 15)] {
                let mut dst = vec![0xEEu8; len + 64];
                // SAFETY: both ranges are inside their vectors and distinct.
                unsafe { stream_or_plain(dst.as_mut_ptr().add(d_off), src.as_ptr().add(so), len) };
                assert_eq!(&dst[d_off..d_off + len], &src[so..so + len], "len {len} src+{so} dst+{d_off}");
                assert!(dst[..d_off].iter().all(|&b| b == 0xEE), "wrote before the range");
                assert!(dst[d_off + len..].iter().all(|&b| b == 0xEE), "wrote past the range");
            }
        }
    }

    /// The streaming path regardless of `EPM_FILL_NT` (tests run in one process).
    unsafe fn stream_or_plain(dst: *mut u8, src: *const u8, n: usize) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded contract.
        unsafe {
            stream_copy(dst, src, n)
        };
        #[cfg(not(target_arch = "x86_64"))]
        // SAFETY: forwarded contract.
        unsafe {
            copy(dst, src, n)
        };
    }
}
