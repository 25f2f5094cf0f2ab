//! [`Device::decode_async`] is bit-exact and ordered like a copy, and refuses
//! bad arguments.

use std::sync::Arc;

use super::{assert_same, download, no_leaks, upload};
use crate::codec::{self, BLOCK_VALUES, Dtype, EncodeOptions, Encoded};
use crate::device::{Device, DeviceBuffer, Stream};
use crate::error::{EpmStatus, Result};

/// Encode anything of at least one value, at code width `k` and escape code
/// width `k2` (None: the best; `k2` Some(0): format v1).
fn encode(data: &[u8], dtype: Dtype, k: Option<u32>) -> Vec<u8> {
    encode2(data, dtype, k, None)
}
fn encode2(data: &[u8], dtype: Dtype, k: Option<u32>, k2: Option<u32>) -> Vec<u8> {
    let opts = EncodeOptions { threads: 2, max_ratio: 1e9, min_bytes: 0, k, k2 };
    match codec::encode(data, dtype, &opts) {
        Ok(Encoded::Coded(b)) => b,
        other => panic!("encoding {} bytes of {dtype:?}: {other:?}", data.len()),
    }
}

/// Values like a trained weight: a rough N(0, 0.02) (sum of uniforms) in bf16
/// or fp16, with an odd value of every kind sprinkled in (NaN, ±inf, −0,
/// subnormals), so blocks carry escapes.
pub fn weight_like(dtype: Dtype, n: usize, seed: u64) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let odd: [u16; 6] = match dtype {
        Dtype::Fp16 => [0x7E01, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x83FF],
        _ => [0x7FC1, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x807F],
    };
    (0..n)
        .flat_map(|_| {
            let v = if rng.u32(..1000) == 0 {
                odd[rng.usize(..odd.len())]
            } else {
                let x = ((0..4).map(|_| rng.f32()).sum::<f32>() - 2.0) * 0.035;
                match dtype {
                    Dtype::Fp16 => {
                        // Normal fp16 range only (|x| < 0.14): exponent from f32's.
                        let b = x.to_bits();
                        let e = ((b >> 23) & 0xFF) as i32 - 127 + 15;
                        if e <= 0 {
                            (b >> 16) as u16 & 0x8000
                        } else {
                            ((b >> 16) & 0x8000 | (e as u32) << 10 | (b >> 13) & 0x3FF) as u16
                        }
                    }
                    _ => (x.to_bits() >> 16) as u16,
                }
            };
            v.to_le_bytes()
        })
        .collect()
}

/// One decode through the device: H2D of the compressed bytes, the decode
/// and a D2H of the result queued back to back on one stream (the stream
/// alone orders them), into a destination with guard bytes behind it.
fn device_round_trip(dev: &Arc<dyn Device>, s: &Stream, data: &[u8], buf: &[u8], what: &str) -> Result<()> {
    const GUARD: u8 = 0xC5;
    const PAD: usize = 64;
    let desc = codec::parse(buf, 2)?;
    let src = DeviceBuffer::new(dev, buf.len())?;
    let dst = DeviceBuffer::new(dev, data.len() + PAD)?;
    dev.memset_d8_async(dst.ptr(), GUARD, data.len() + PAD, s.raw())?;
    let mut out = vec![0u8; data.len()];
    // SAFETY: `buf` and `out` outlive the queued copies (synchronized below)
    // and are not touched until then.
    let queued = unsafe {
        dev.memcpy_htod_async(src.ptr(), buf.as_ptr(), buf.len(), s.raw())
            .and_then(|()| dev.decode_async(src.ptr(), buf.len(), dst.ptr(), data.len(), &desc, s.raw()))
            .and_then(|()| dev.memcpy_dtoh_async(out.as_mut_ptr(), dst.ptr(), data.len(), s.raw()))
    };
    let sync = s.synchronize();
    queued.and(sync)?;
    assert_same(what, &out, data);
    let tail = download(dev, s, dst.ptr() + data.len() as u64, PAD)?;
    assert!(tail.iter().all(|&b| b == GUARD), "{what}: the decode wrote past its destination");
    Ok(())
}

/// Every bf16 and fp16 bit pattern at every code width, in format v1 and in
/// v2 at every escape code width, and weight-like tensors of odd lengths (one
/// value, a block ± 1, several blocks and a tail), decode bit-exactly on the
/// device.
pub fn decode_is_bit_exact(dev: &Arc<dyn Device>) -> Result<()> {
    no_leaks(dev, "decode_is_bit_exact", || {
        let s = Stream::new(dev)?;
        let all: Vec<u8> = (0..=u16::MAX).flat_map(|v| v.to_le_bytes()).collect();
        // Shuffled, so a block mixes every exponent (many level-3 escapes a block).
        let mut shuffled: Vec<u16> = (0..=u16::MAX).collect();
        fastrand::Rng::with_seed(11).shuffle(&mut shuffled);
        let shuffled: Vec<u8> = shuffled.iter().flat_map(|v| v.to_le_bytes()).collect();
        for dtype in [Dtype::Bf16, Dtype::Fp16] {
            for k in 1..=4 {
                for k2 in 0..=4 {
                    let what = format!("all 65536 {} bit patterns, k={k}, k2={k2}", dtype.name());
                    device_round_trip(dev, &s, &all, &encode2(&all, dtype, Some(k), Some(k2)), &what)?;
                }
                let what = format!("all 65536 {} bit patterns shuffled, k={k}, k2=3", dtype.name());
                device_round_trip(dev, &s, &shuffled, &encode2(&shuffled, dtype, Some(k), Some(3)), &what)?;
            }
            let b = BLOCK_VALUES;
            for (i, n) in [1, 7, 16, 17, b - 1, b, b + 1, 3 * b + 17, (1 << 20) + 5].into_iter().enumerate() {
                let data = weight_like(dtype, n, 40 + i as u64);
                let what = format!("{n} weight-like {} values", dtype.name());
                device_round_trip(dev, &s, &data, &encode(&data, dtype, None), &what)?;
            }
        }
        Ok(())
    })
}

/// Lengths that disagree with the description, unaligned or overlapping
/// ranges and an unknown stream are refused at enqueue, before anything
/// runs; a refused decode leaves the destination untouched.
pub fn decode_bad_arguments_are_refused(dev: &Arc<dyn Device>) -> Result<()> {
    no_leaks(dev, "decode_bad_arguments_are_refused", || {
        let s = Stream::new(dev)?;
        let data = weight_like(Dtype::Bf16, BLOCK_VALUES + 3, 1);
        let buf = encode(&data, Dtype::Bf16, None);
        let desc = codec::parse(&buf, 1)?;
        let (n, m) = (buf.len(), data.len());
        let src = DeviceBuffer::new(dev, n + 64)?;
        let dst = DeviceBuffer::new(dev, m + 64)?;
        upload(dev, &s, src.ptr(), &buf)?;
        dev.memset_d8_async(dst.ptr(), 0x11, m + 64, s.raw())?;
        let (a, b) = (src.ptr(), dst.ptr());
        let cases: [(&str, u64, usize, u64, usize); 6] = [
            ("a short source", a, n - 16, b, m),
            ("a long destination", a, n, b, m + 2),
            ("an unaligned source", a + 8, n, b, m),
            ("an unaligned destination", a, n, b + 2, m),
            ("overlapping ranges", a, n, a + 16, m),
            ("a destination past its allocation", a, n, b + 64 + 16, m),
        ];
        for (what, sp, sl, dp, dl) in cases {
            let e = dev.decode_async(sp, sl, dp, dl, &desc, s.raw()).expect_err(what);
            assert_eq!(e.status(), EpmStatus::InvalidArgument, "{what}: {e}");
        }
        let e = dev.decode_async(a, n, b, m, &desc, crate::device::RawStream(0xDEAD)).expect_err("unknown stream");
        assert_eq!(e.status(), EpmStatus::InvalidHandle, "unknown stream: {e}");
        s.synchronize()?;
        assert!(download(dev, &s, dst.ptr(), m + 64)?.iter().all(|&x| x == 0x11), "a refused decode wrote");
        Ok(())
    })
}

/// A weight decoded piece by piece ([`Device::decode_piece_async`]): each
/// piece's parts copied into one of two staging buffers, alternating, and
/// decoded into its offset of the destination, all queued on one stream; the
/// whole destination must come out bit-exact with nothing written past it.
/// Caps from one block a piece up to most of the weight; weights whose blocks
/// carry many escapes (every bit pattern at k=1) and a partial last block.
pub fn decode_pieces_are_bit_exact(dev: &Arc<dyn Device>) -> Result<()> {
    const GUARD: u8 = 0x3A;
    const PAD: usize = 64;
    no_leaks(dev, "decode_pieces_are_bit_exact", || {
        let s = Stream::new(dev)?;
        let all: Vec<u8> = (0..=u16::MAX).flat_map(|v| v.to_le_bytes()).collect();
        let b = BLOCK_VALUES;
        let cases: Vec<(String, Vec<u8>, Dtype, Option<u32>, Option<u32>)> = vec![
            ("all bf16 bit patterns, k=1, v1".into(), all.clone(), Dtype::Bf16, Some(1), Some(0)),
            ("all bf16 bit patterns, k=1, k2=3".into(), all.clone(), Dtype::Bf16, Some(1), Some(3)),
            ("all fp16 bit patterns, k=3, v1".into(), all.clone(), Dtype::Fp16, Some(3), Some(0)),
            ("all fp16 bit patterns, k=2, k2=1".into(), all, Dtype::Fp16, Some(2), Some(1)),
            (
                "weight-like bf16, 9 blocks + 77".into(),
                weight_like(Dtype::Bf16, 9 * b + 77, 5),
                Dtype::Bf16,
                None,
                None,
            ),
            ("weight-like fp16, 6 blocks + 1".into(), weight_like(Dtype::Fp16, 6 * b + 1, 6), Dtype::Fp16, None, None),
            (
                "weight-like bf16 v2, 7 blocks + 5".into(),
                weight_like(Dtype::Bf16, 7 * b + 5, 7),
                Dtype::Bf16,
                Some(2),
                Some(3),
            ),
        ];
        for (name, data, dtype, k, k2) in cases {
            let buf = encode2(&data, dtype, k, k2);
            let desc = codec::parse(&buf, 2)?;
            // The most any one block stages in (blocks differ by their escapes).
            let mut one = 0;
            for j in 0..desc.blocks() {
                one = one.max(desc.piece(&buf, j, j + 1)?.staged_len());
            }
            for cap in [one, 2 * one + 16, buf.len() / 3, buf.len() / 2] {
                let what = format!("{name}, staging of {cap} bytes");
                let stage = [DeviceBuffer::new(dev, cap)?, DeviceBuffer::new(dev, cap)?];
                let dst = DeviceBuffer::new(dev, data.len() + PAD)?;
                dev.memset_d8_async(dst.ptr(), GUARD, data.len() + PAD, s.raw())?;
                let (mut at, mut n) = (0, 0);
                while at < desc.blocks() {
                    let p = desc.piece_within(&buf, at, cap)?;
                    assert!(!p.is_whole() && p.staged_len() <= cap, "{what}: {p:?}");
                    let to = stage[n % 2].ptr();
                    for (from, off, len) in p.copies() {
                        // SAFETY: `buf` outlives the queued copy (the stream
                        // synchronizes below before it is dropped).
                        unsafe { dev.memcpy_htod_async(to + off as u64, buf[from..].as_ptr(), len, s.raw())? };
                    }
                    dev.decode_piece_async(to, dst.ptr() + p.raw_offset() as u64, &p, s.raw())?;
                    at = p.end_block();
                    n += 1;
                }
                assert!(n >= 2, "{what}: {n} piece(s)");
                let out = download(dev, &s, dst.ptr(), data.len() + PAD)?;
                assert_same(&what, &out[..data.len()], &data);
                assert!(out[data.len()..].iter().all(|&x| x == GUARD), "{what}: a piece wrote past the weight");
            }
            // A buffer that fits the weight gives the whole buffer, one copy.
            let p = desc.piece_within(&buf, 0, buf.len())?;
            assert!(p.is_whole() && p.copies().count() == 1 && p.copied_bytes() == buf.len());
            // Not even one block fits: refused.
            let first = desc.piece(&buf, 0, 1)?.staged_len();
            let e = desc.piece_within(&buf, 0, first - 16).expect_err("a staging smaller than one block");
            assert_eq!(e.status(), EpmStatus::InvalidArgument, "{e}");
        }
        // A misaligned staging address or overlapping ranges are refused.
        let data = weight_like(Dtype::Bf16, 3 * b, 9);
        let buf = encode(&data, Dtype::Bf16, None);
        let desc = codec::parse(&buf, 1)?;
        let p = desc.piece(&buf, 1, 3)?;
        let src = DeviceBuffer::new(dev, p.staged_len() + 64)?;
        let e = dev.decode_piece_async(src.ptr() + 8, src.ptr() + 4096 * 1024, &p, s.raw()).expect_err("unaligned");
        assert_eq!(e.status(), EpmStatus::InvalidArgument, "{e}");
        let e = dev.decode_piece_async(src.ptr(), src.ptr() + 16, &p, s.raw()).expect_err("overlap");
        assert_eq!(e.status(), EpmStatus::InvalidArgument, "{e}");
        s.synchronize()?;
        Ok(())
    })
}
