//! Copies, memset and the checksum kernel are bit-exact.

use std::sync::Arc;

use super::{HostBuf, assert_same, download, no_leaks, random_bytes, upload};
use crate::device::{Device, DeviceBuffer, Stream, checksum_host};
use crate::error::Result;

/// Sizes that catch off-by-ones and chunking bugs: a byte, one short of a
/// page, an odd size past 1 MiB, and a large copy.
pub const COPY_SIZES: [usize; 4] = [1, 4095, (1 << 20) + 3, 64 << 20];

/// H2D → D2D → D2H round trips are bit-exact on random data, from pinned and
/// pageable host memory, at odd device offsets, and touch nothing outside
/// their ranges.
pub fn copies_are_bit_exact(dev: &Arc<dyn Device>) -> Result<()> {
    no_leaks(dev, "copies_are_bit_exact", || {
        let s = Stream::new(dev)?;
        for (i, &n) in COPY_SIZES.iter().enumerate() {
            for pinned in [true, false] {
                round_trip(dev, &s, n, pinned, 0xC0FFEE + i as u64 * 2 + pinned as u64)?;
            }
        }
        Ok(())
    })
}

fn round_trip(dev: &Arc<dyn Device>, s: &Stream, n: usize, pinned: bool, seed: u64) -> Result<()> {
    // Odd offsets in both buffers, guard bytes on both sides of the D2D target.
    const PAD: usize = 8;
    const A_OFF: u64 = 3;
    const B_OFF: usize = 5;
    const GUARD: u8 = 0xAB;
    let what = format!("{n}-byte round trip from {} memory", if pinned { "pinned" } else { "pageable" });
    let a = DeviceBuffer::new(dev, n + PAD)?;
    let b = DeviceBuffer::new(dev, n + PAD)?;
    dev.memset_d8_async(b.ptr(), GUARD, n + PAD, s.raw())?;
    let mut src = HostBuf::new(dev, n, pinned)?;
    fastrand::Rng::with_seed(seed).fill(src.as_mut_slice());
    let mut dst = HostBuf::new(dev, n, pinned)?;
    let b_at = b.ptr() + B_OFF as u64;
    // Three copies queued back to back: the stream must order them.
    // SAFETY: `src` and `dst` outlive the copies (synchronized below) and
    // are not touched until then.
    let queued = unsafe {
        dev.memcpy_htod_async(a.ptr() + A_OFF, src.as_slice().as_ptr(), n, s.raw())
            .and_then(|()| dev.memcpy_dtod_async(b_at, a.ptr() + A_OFF, n, s.raw()))
            .and_then(|()| dev.memcpy_dtoh_async(dst.as_mut_slice().as_mut_ptr(), b_at, n, s.raw()))
    };
    let sync = s.synchronize();
    queued.and(sync)?;
    assert_same(&what, dst.as_slice(), src.as_slice());
    let whole = download(dev, s, b.ptr(), n + PAD)?;
    assert!(
        whole[..B_OFF].iter().chain(&whole[B_OFF + n..]).all(|&x| x == GUARD),
        "{what}: a D2D copy wrote outside its destination range"
    );
    Ok(())
}

/// memset writes exactly its range with exactly its value.
pub fn memset_is_exact(dev: &Arc<dyn Device>) -> Result<()> {
    no_leaks(dev, "memset_is_exact", || {
        let s = Stream::new(dev)?;
        for (i, &n) in [64usize, 4095, (1 << 20) + 3].iter().enumerate() {
            let b = DeviceBuffer::new(dev, n)?;
            let mut want = random_bytes(77 + i as u64, n);
            upload(dev, &s, b.ptr(), &want)?;
            let (lo, hi) = (7, n - 5);
            let value = 0x5A ^ i as u8;
            dev.memset_d8_async(b.ptr() + lo as u64, value, hi - lo, s.raw())?;
            want[lo..hi].fill(value);
            let got = download(dev, &s, b.ptr(), n)?;
            assert_same(&format!("memset of [{lo}, {hi}) in {n} bytes"), &got, &want);
        }
        Ok(())
    })
}

/// `checksum_async` equals [`checksum_host`] on random data, and tells
/// swapped words apart.
pub fn checksum_matches_host(dev: &Arc<dyn Device>) -> Result<()> {
    no_leaks(dev, "checksum_matches_host", || {
        let s = Stream::new(dev)?;
        let out = DeviceBuffer::new(dev, 8)?;
        for (i, &n) in [4usize, 4096, (1 << 20) + 4, 4 << 20].iter().enumerate() {
            let b = DeviceBuffer::new(dev, n)?;
            let data = random_bytes(0x5EED + i as u64, n);
            upload(dev, &s, b.ptr(), &data)?;
            dev.checksum_async(b.ptr(), n, out.ptr(), s.raw())?;
            let got = u64::from_le_bytes(download(dev, &s, out.ptr(), 8)?.try_into().unwrap_or_default());
            assert_eq!(got, checksum_host(&data), "checksum of {n} random bytes");
        }
        // Same words, swapped: a position-blind sum would match.
        let b = DeviceBuffer::new(dev, 8)?;
        upload(dev, &s, b.ptr(), &[2, 0, 0, 0, 1, 0, 0, 0])?;
        dev.checksum_async(b.ptr(), 8, out.ptr(), s.raw())?;
        let got = u64::from_le_bytes(download(dev, &s, out.ptr(), 8)?.try_into().unwrap_or_default());
        assert_eq!(got, 2 + 3, "checksum of words [2, 1]");
        Ok(())
    })
}
