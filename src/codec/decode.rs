//! The CPU decoder (the host device's decode and a reference for the kernel).

use super::Dtype;
use super::format::{self, BLOCK_VALUES, DecodeDesc};
use crate::error::{Error, Result};

/// Below this many output bytes one thread decodes alone: a thread costs
/// tens of microseconds to start, ~1 MiB of decoding.
const MIN_BYTES_PER_THREAD: usize = 1 << 20;

/// Validate `buf` ([`format::parse`], checksum included) and decode it
/// into `out`, which must be exactly the raw length. `threads`: 0 = one
/// per available core.
pub fn decode(buf: &[u8], out: &mut [u8], threads: usize) -> Result<DecodeDesc> {
    let threads = super::EncodeOptions { threads, ..Default::default() }.thread_count();
    let desc = format::parse(buf, threads)?;
    decode_with(&desc, buf, out, threads)?;
    Ok(desc)
}

/// Decode `src`, described by `desc` (from [`format::parse`] of the same
/// bytes), into `out`. Does not re-check the checksum; every read is still
/// bounded, and an escape index that disagrees with the codes is an error,
/// so bytes changed since validation give an error or wrong values, never
/// a read outside `src`.
pub fn decode_with(desc: &DecodeDesc, src: &[u8], out: &mut [u8], threads: usize) -> Result<()> {
    desc.check_lengths(src.len(), out.len())?;
    let l = desc.layout;
    let offsets = &src[l.offsets_off..l.offsets_off + (l.blocks + 1) * 4];
    let codes = &src[l.codes_off..l.codes_off + l.codes_len];
    let lows = &src[l.lows_off..l.lows_off + desc.n];
    let escapes = &src[l.escapes_off..l.escapes_off + desc.escapes];
    let threads = threads.clamp(1, out.len() / MIN_BYTES_PER_THREAD + 1).min(l.blocks);
    let block_code_bytes = BLOCK_VALUES * desc.code_bits() as usize / 8;
    let run = |first_block: usize, out: &mut [u8]| -> Result<()> {
        for (i, o) in out.chunks_mut(BLOCK_VALUES * 2).enumerate() {
            let j = first_block + i;
            let off = |j: usize| u32::from_le_bytes([offsets[4 * j], offsets[4 * j + 1], offsets[4 * j + 2], offsets[4 * j + 3]]) as usize;
            let esc = escapes.get(off(j)..off(j + 1)).ok_or_else(|| bad_index(j))?;
            let c = &codes[j * block_code_bytes..((j + 1) * block_code_bytes).min(codes.len())];
            let w = &lows[j * BLOCK_VALUES..][..o.len() / 2];
            decode_block(desc, c, w, esc, o).map_err(|()| bad_index(j))?;
        }
        Ok(())
    };
    if threads <= 1 {
        return run(0, out);
    }
    let per = l.blocks.div_ceil(threads);
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let handles: Vec<_> = out
            .chunks_mut(per * BLOCK_VALUES * 2)
            .enumerate()
            .map(|(t, o)| {
                let run = &run;
                s.spawn(move || run(t * per, o))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    });
    results.into_iter().collect()
}

fn bad_index(block: usize) -> Error {
    Error::invalid_argument(format!(
        "decode: block {block}'s escapes disagree with the escape index (the buffer changed after validation)"
    ))
}

/// Decode one block; `Err` if its codes use more or fewer escapes than the
/// index gives it.
fn decode_block(desc: &DecodeDesc, codes: &[u8], lows: &[u8], escapes: &[u8], out: &mut [u8]) -> std::result::Result<(), ()> {
    let (dtype, k, w) = (desc.dtype, desc.k, desc.code_bits());
    let esc = (1u64 << k) - 1;
    let mask = (1u64 << w) - 1;
    let (mut acc, mut nbits, mut pos, mut e) = (0u64, 0u32, 0usize, 0usize);
    for (o, &low) in out.chunks_exact_mut(2).zip(lows) {
        if nbits < w {
            let mut word = [0u8; 4];
            let avail = codes.len().saturating_sub(pos).min(4);
            word[..avail].copy_from_slice(&codes[pos..pos + avail]);
            acc |= (u32::from_le_bytes(word) as u64) << nbits;
            (nbits, pos) = (nbits + 32, pos + 4);
        }
        let c = acc & mask;
        (acc, nbits) = (acc >> w, nbits - w);
        let code = c & esc;
        let exp = if code == esc {
            let x = *escapes.get(e).ok_or(())?;
            e += 1;
            x
        } else {
            desc.table[code as usize]
        };
        let v = join(dtype, exp, low, (c >> k) as u8);
        o.copy_from_slice(&v.to_le_bytes());
    }
    if e == escapes.len() { Ok(()) } else { Err(()) }
}

#[inline(always)]
fn join(dtype: Dtype, exp: u8, low: u8, extra: u8) -> u16 {
    dtype.join(exp, low, extra)
}
