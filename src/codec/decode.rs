//! The CPU decoder (the host device's decode and a reference for the kernel).

use super::Dtype;
use super::format::{self, BLOCK_VALUES, DecodeDesc};
use super::piece::DecodePiece;
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
    decode_piece(&desc.whole(), src, out, threads)
}

/// Decode `piece` from its staged bytes `src` (laid out as
/// [`DecodePiece::copies`] stage them) into `out`, its decoded bytes. The
/// reads are bounded like [`decode_with`]'s.
pub fn decode_piece(piece: &DecodePiece, src: &[u8], out: &mut [u8], threads: usize) -> Result<()> {
    piece.check_lengths(src.len(), out.len())?;
    let desc = piece.desc();
    let [o0, o1, o2, o3, o4, o5] = piece.staged_offsets();
    let (first, blocks, values) = (piece.first_block(), piece.blocks(), piece.values());
    let block_code_bytes = BLOCK_VALUES * desc.code_bits() as usize / 8;
    // The codes and low bytes of these blocks, less the stream's padding.
    let codes_len = (values * desc.code_bits() as usize).div_ceil(8);
    let offsets = &src[o0..o0 + (blocks + 1) * 4];
    let codes = &src[o1..o1 + codes_len];
    let lows = &src[o2..o2 + values];
    let base = piece.escape_base();
    let k2 = desc.k2 as usize;
    // v1: a byte per escape; v2: k2 bits per escape, from byte `base` of the stream.
    let esc_bytes = if k2 > 0 { (piece.escape_end() * k2).div_ceil(8) } else { piece.escape_end() };
    let escapes = &src[o3..o3 + (esc_bytes - base)];
    let (offsets3, escapes3, base3) = if k2 > 0 {
        (&src[o4..o4 + (blocks + 1) * 4], &src[o5..o5 + (piece.escape3_end() - piece.escape3_base())], {
            piece.escape3_base()
        })
    } else {
        (&src[o4..o4], &src[o5..o5], 0)
    };
    let threads = threads.clamp(1, out.len() / MIN_BYTES_PER_THREAD + 1).min(blocks);
    let run = |first_local: usize, out: &mut [u8]| -> Result<()> {
        let word = |s: &[u8], j: usize| u32::from_le_bytes([s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3]]);
        let mut local = [0u8; BLOCK_VALUES];
        for (i, o) in out.chunks_mut(BLOCK_VALUES * 2).enumerate() {
            let j = first_local + i;
            let bad = || bad_index(first + j);
            let c = &codes[j * block_code_bytes..((j + 1) * block_code_bytes).min(codes.len())];
            let w = &lows[j * BLOCK_VALUES..][..o.len() / 2];
            if k2 == 0 {
                let off = |j: usize| (word(offsets, j) as usize).checked_sub(base);
                let esc = off(j).zip(off(j + 1)).and_then(|(a, b)| escapes.get(a..b)).ok_or_else(bad)?;
                decode_block(desc, c, w, esc, o).map_err(|()| bad())?;
            } else {
                // v2: the block's escaped exponents from their codes (and
                // level-3 bytes) first, then the v1 block decode over them.
                let (a, b) = (word(offsets, j) as usize, word(offsets, j + 1) as usize);
                let (s0, s1) = (word(offsets3, j) as usize, word(offsets3, j + 1) as usize);
                let n = b.checked_sub(a).filter(|&n| n <= BLOCK_VALUES).ok_or_else(bad)?;
                let mut level3 = s0
                    .checked_sub(base3)
                    .zip(s1.checked_sub(base3))
                    .and_then(|(x, y)| escapes3.get(x..y))
                    .ok_or_else(bad)?
                    .iter();
                let esc2 = (1u32 << k2) - 1;
                for (r, slot) in (a..b).zip(local.iter_mut()) {
                    let bit = (r * k2).checked_sub(base * 8).ok_or_else(bad)?;
                    let lo = *escapes.get(bit / 8).ok_or_else(bad)? as u32;
                    let hi = escapes.get(bit / 8 + 1).copied().unwrap_or(0) as u32;
                    let code = ((lo | hi << 8) >> (bit % 8)) & esc2;
                    *slot = if code == esc2 { *level3.next().ok_or_else(bad)? } else { desc.table2[code as usize] };
                }
                if level3.next().is_some() {
                    return Err(bad());
                }
                decode_block(desc, c, w, &local[..n], o).map_err(|()| bad())?;
            }
        }
        Ok(())
    };
    if threads <= 1 {
        return run(0, out);
    }
    let per = blocks.div_ceil(threads);
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
fn decode_block(
    desc: &DecodeDesc,
    codes: &[u8],
    lows: &[u8],
    escapes: &[u8],
    out: &mut [u8],
) -> std::result::Result<(), ()> {
    macro_rules! go {
        ($($fp:literal $k:literal),*) => {
            match (desc.dtype == Dtype::Fp16, desc.k) {
                $(($fp, $k) => decode_block_as::<$fp, $k>(&desc.table, codes, lows, escapes, out),)*
                _ => Err(()),
            }
        };
    }
    go!(false 1, false 2, false 3, false 4, true 1, true 2, true 3, true 4)
}

/// Values per group: 16, whose codes are `2·W` whole bytes (one u128).
const GROUP: usize = 16;

/// Generic over the dtype and k so every shift is a constant. The block's
/// escapes are read from a local copy without a branch (a branch on 2–13%
/// escapes mispredicts); the count is checked once, at the end.
#[inline(always)]
fn decode_block_as<const FP16: bool, const K: u32>(
    table: &[u8; 16],
    codes: &[u8],
    lows: &[u8],
    escapes: &[u8],
    out: &mut [u8],
) -> std::result::Result<(), ()> {
    let dtype = if FP16 { Dtype::Fp16 } else { Dtype::Bf16 };
    let w = K + dtype.extra_bits();
    let esc = (1u32 << K) - 1;
    let mask = (1u32 << w) - 1;
    let gb = 2 * w as usize;
    if escapes.len() > BLOCK_VALUES {
        return Err(());
    }
    let mut local = [0u8; BLOCK_VALUES];
    local[..escapes.len()].copy_from_slice(escapes);
    let mut e = 0usize;
    let groups = (out.len() / 2) / GROUP;
    let whole = out.chunks_exact_mut(2 * GROUP).zip(lows.chunks_exact(GROUP)).zip(codes.chunks_exact(gb));
    for ((o, lo), c) in whole.take(groups) {
        // Fixed-size views: the loop below then needs no bounds checks.
        let (Ok(o), Ok(lo)) = (<&mut [u8; 2 * GROUP]>::try_from(o), <&[u8; GROUP]>::try_from(lo)) else {
            unreachable!("chunks_exact yields whole groups")
        };
        let mut word = [0u8; 16];
        word[..gb].copy_from_slice(c);
        let acc = u128::from_le_bytes(word);
        super::unroll16!(|i: usize| {
            let c = (acc >> (i as u32 * w)) as u32 & mask;
            let code = c & esc;
            let escaped = code == esc;
            let exp = if escaped { local[e & (BLOCK_VALUES - 1)] } else { table[code as usize] };
            e += escaped as usize;
            let v = dtype.join(exp, lo[i], (c >> K) as u8);
            o[2 * i..2 * i + 2].copy_from_slice(&v.to_le_bytes());
        });
    }
    // The tail: fewer than a group, byte-aligned at its start.
    let (mut acc, mut nbits, mut pos) = (0u64, 0u32, groups * gb);
    let tail_out = &mut out[groups * 2 * GROUP..];
    for (o, &low) in tail_out.chunks_exact_mut(2).zip(&lows[groups * GROUP..]) {
        if nbits < w {
            let mut word = [0u8; 4];
            let avail = codes.len().saturating_sub(pos).min(4);
            word[..avail].copy_from_slice(&codes[pos..pos + avail]);
            acc |= (u32::from_le_bytes(word) as u64) << nbits;
            (nbits, pos) = (nbits + 32, pos + 4);
        }
        let c = (acc as u32) & mask;
        (acc, nbits) = (acc >> w, nbits - w);
        let code = c & esc;
        let escaped = code == esc;
        let exp = if escaped { local[e & (BLOCK_VALUES - 1)] } else { table[code as usize] };
        e += escaped as usize;
        o.copy_from_slice(&dtype.join(exp, low, (c >> K) as u8).to_le_bytes());
    }
    if e == escapes.len() { Ok(()) } else { Err(()) }
}
