//! The encoder: two passes over the weight, each split by blocks over threads.
//!
//! Pass 1 ([`plan`]) takes an exponent histogram per thread chunk. The
//! totals choose k and the table; the per-chunk histograms then give each
//! chunk's escape count, so the whole layout (and where each chunk writes its
//! escapes) is known before pass 2 ([`Plan::encode_into`]) writes every
//! stream in place, each thread into its own disjoint slices.

use std::ops::Range;

use super::format::{self, BLOCK_VALUES, DecodeDesc, HEADER_LEN, Layout, MAX_K, TABLE_LEN};
use super::{Dtype, EncodeOptions, Encoded, RawReason};
use crate::error::{Error, Result};

/// A chunk of whole blocks one thread encodes.
#[derive(Debug, Clone)]
struct Chunk {
    blocks: Range<usize>,
    /// Escapes of the chunks before it: where its escapes start.
    escapes_before: usize,
    escapes: usize,
    /// Level-3 escapes (format v2; 0 in v1).
    escapes3: usize,
}

#[derive(Debug, Clone)]
enum Decision {
    /// `frames`: the weight's [`FRAME_VALUES`]-value ranges (the last may be
    /// shorter), each with its escape count and the escapes before it.
    Coded {
        desc: DecodeDesc,
        frames: Vec<Chunk>,
    },
    Raw(RawReason),
}

/// Values of a frame ([`Plan::encode_frames_into`]): 1024 blocks, 8 MiB of
/// bf16 or fp16. A page-in of a weight stored in frames copies as many whole
/// frames as fit a staging buffer in one DMA and decodes each with one
/// launch of 1024 thread blocks (a full wave on an H100 or H200).
pub const FRAME_VALUES: usize = 1024 * BLOCK_VALUES;

/// One frame of a weight stored in frames: a complete buffer (the weight's format) of
/// values `[raw_offset / 2, raw_offset / 2 + desc.values())` at byte `at` of
/// the framed buffer (a multiple of 16), `desc.compressed_len()` bytes long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame {
    pub at: usize,
    pub raw_offset: usize,
    pub desc: DecodeDesc,
}

impl Frame {
    /// Bytes of the frame's buffer.
    pub fn len(&self) -> usize {
        self.desc.compressed_len()
    }
    /// Never true: a frame holds at least one value.
    pub fn is_empty(&self) -> bool {
        self.desc.values() == 0
    }
}

/// Run `f` over `0..n` on at most `threads` scoped threads, results in order.
fn par_map<T: Send>(n: usize, threads: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let workers = threads.min(n).max(1);
    if workers == 1 {
        return (0..n).map(f).collect();
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let mut parts: Vec<Vec<(usize, T)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= n {
                            break out;
                        }
                        out.push((i, f(i)));
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    });
    let mut all: Vec<(usize, T)> = parts.iter_mut().flat_map(std::mem::take).collect();
    all.sort_by_key(|(i, _)| *i);
    all.into_iter().map(|(_, t)| t).collect()
}

/// The outcome of pass 1: whether and how a weight is encoded, and its size.
#[derive(Debug, Clone)]
pub struct Plan {
    decision: Decision,
    raw_len: usize,
    threads: usize,
}

impl Plan {
    /// `Ok(len)` of the encoded buffer, or why the weight stays raw.
    pub fn outcome(&self) -> std::result::Result<usize, RawReason> {
        match &self.decision {
            Decision::Coded { desc, .. } => Ok(desc.compressed_len()),
            Decision::Raw(r) => Err(*r),
        }
    }
    /// The description of the buffer [`Plan::encode_into`] writes.
    pub fn desc(&self) -> Option<&DecodeDesc> {
        match &self.decision {
            Decision::Coded { desc, .. } => Some(desc),
            Decision::Raw(_) => None,
        }
    }
    /// Compressed ÷ raw when encoded, 1.0 when raw.
    pub fn ratio(&self) -> f64 {
        self.desc().map_or(1.0, DecodeDesc::ratio)
    }

    /// Pass 2: write the encoded weight into `out[..len]` (`len` from
    /// [`Plan::outcome`]; `out` may be longer, the rest is untouched).
    /// `data` must be the bytes [`plan`] saw: a weight that changed in
    /// between is refused (its escape counts no longer match).
    pub fn encode_into(&self, data: &[u8], out: &mut [u8]) -> Result<usize> {
        let Decision::Coded { desc, frames } = &self.decision else {
            return Err(Error::invalid_state("encode_into on a plan that keeps the weight raw"));
        };
        self.check_data(data)?;
        let l = desc.layout;
        crate::ensure!(
            out.len() >= l.total_len,
            InvalidArgument,
            "encode: the output holds {} bytes, the encoded weight needs {}",
            out.len(),
            l.total_len
        );
        write_buffer(desc, &group(frames, self.threads), data, &mut out[..l.total_len], self.threads)?;
        Ok(l.total_len)
    }

    fn check_data(&self, data: &[u8]) -> Result<()> {
        crate::ensure!(
            data.len() == self.raw_len,
            InvalidArgument,
            "encode: the weight is {} bytes, the plan was made for {}",
            data.len(),
            self.raw_len
        );
        Ok(())
    }

    /// The frames [`Plan::encode_frames_into`] writes: one per
    /// [`FRAME_VALUES`] values (the last may hold fewer), laid end to end,
    /// each a complete buffer of the weight's format, k and tables, with
    /// its own escapes. Empty when the plan keeps the weight raw.
    pub fn frames(&self) -> Vec<Frame> {
        let Decision::Coded { desc, frames } = &self.decision else { return Vec::new() };
        let mut at = 0;
        frames
            .iter()
            .map(|c| {
                let first = c.blocks.start * BLOCK_VALUES;
                let n = (c.blocks.end * BLOCK_VALUES).min(desc.n) - first;
                let layout = Layout::new(desc.dtype, desc.k, desc.k2, n, c.escapes, c.escapes3)
                    .expect("a frame's layout: k and n were validated for the whole weight");
                let f = Frame {
                    at,
                    raw_offset: first * 2,
                    desc: DecodeDesc { n, escapes: c.escapes, escapes3: c.escapes3, layout, ..*desc },
                };
                at += layout.total_len;
                f
            })
            .collect()
    }

    /// Bytes of the weight stored in frames ([`Plan::frames`]), or why it stays raw.
    pub fn framed_len(&self) -> std::result::Result<usize, RawReason> {
        self.outcome()?;
        Ok(self.frames().last().map_or(0, |f| f.at + f.len()))
    }

    /// Pass 2 for a weight stored in frames: write every frame of
    /// [`Plan::frames`] into `out` (at least [`Plan::framed_len`] bytes),
    /// frames spread over the plan's threads. Returns the frames.
    pub fn encode_frames_into(&self, data: &[u8], out: &mut [u8]) -> Result<Vec<Frame>> {
        let Decision::Coded { frames: chunks, .. } = &self.decision else {
            return Err(Error::invalid_state("encode_frames_into on a plan that keeps the weight raw"));
        };
        self.check_data(data)?;
        let frames = self.frames();
        let total = frames.last().map_or(0, |f| f.at + f.len());
        crate::ensure!(
            out.len() >= total,
            InvalidArgument,
            "encode: the output holds {} bytes, the weight in frames needs {total}",
            out.len()
        );
        let mut rest = &mut out[..total];
        let mut slots = Vec::with_capacity(frames.len());
        for f in &frames {
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(f.len());
            slots.push(std::sync::Mutex::new(mine));
            rest = tail;
        }
        let results = par_map(frames.len(), self.threads, |i| {
            let (f, c) = (&frames[i], &chunks[i]);
            let whole =
                Chunk { blocks: 0..c.blocks.len(), escapes_before: 0, escapes: c.escapes, escapes3: c.escapes3 };
            let src = &data[f.raw_offset..f.raw_offset + f.desc.raw_len()];
            let mut slot = slots[i].lock().unwrap_or_else(|p| p.into_inner());
            write_buffer(&f.desc, std::slice::from_ref(&whole), src, &mut slot, 1)
        });
        results.into_iter().collect::<Result<Vec<()>>>()?;
        Ok(frames)
    }
}

/// Write the whole buffer of `desc` (exactly `out.len()` bytes) from `data`,
/// one thread per chunk (`chunks` cover the blocks in order, their blocks
/// counted from `data`'s first value).
fn write_buffer(desc: &DecodeDesc, chunks: &[Chunk], data: &[u8], out: &mut [u8], threads: usize) -> Result<()> {
    let l = desc.layout;
    let (header, rest) = out.split_at_mut(HEADER_LEN);
    format::write_header(desc, header);
    let (offsets, rest) = rest.split_at_mut(l.offsets3_off - l.offsets_off);
    let (offsets3, rest) = rest.split_at_mut(l.codes_off - l.offsets3_off);
    let (codes, rest) = rest.split_at_mut(l.lows_off - l.codes_off);
    let (lows, rest) = rest.split_at_mut(l.escapes_off - l.lows_off);
    let (escapes_out, escapes3) = rest.split_at_mut(l.escapes3_off - l.escapes_off);
    // Padding is zero; every other byte is written below.
    offsets[(l.blocks + 1) * 4..].fill(0);
    offsets3.fill(0);
    codes[l.codes_len..].fill(0);
    lows[desc.n..].fill(0);
    escapes_out.fill(0);
    escapes3.fill(0);
    offsets[l.blocks * 4..(l.blocks + 1) * 4].copy_from_slice(&(desc.escapes as u32).to_le_bytes());
    // v1 writes the escaped exponents as the escape stream; v2 codes them
    // again (`pack_escapes`) from this byte per escape.
    let mut v2_bytes = if desc.k2 > 0 { vec![0u8; desc.escapes] } else { Vec::new() };
    let escapes: &mut [u8] = if desc.k2 > 0 { &mut v2_bytes } else { escapes_out };

    let block_code_bytes = BLOCK_VALUES * desc.code_bits() as usize / 8;
    let lut = lookup(desc);
    // Carve each stream into the chunks' disjoint slices.
    let (mut offsets, mut codes, mut lows, mut escapes) =
        (&mut offsets[..l.blocks * 4], &mut codes[..l.codes_len], &mut lows[..desc.n], &mut escapes[..desc.escapes]);
    let mut jobs = Vec::with_capacity(chunks.len());
    for c in chunks {
        let nblocks = c.blocks.len();
        let values = (c.blocks.end * BLOCK_VALUES).min(desc.n) - c.blocks.start * BLOCK_VALUES;
        let (o, ro) = std::mem::take(&mut offsets).split_at_mut(nblocks * 4);
        let all_codes = std::mem::take(&mut codes);
        let at = (nblocks * block_code_bytes).min(all_codes.len());
        let (k, rk) = all_codes.split_at_mut(at);
        let (w, rw) = std::mem::take(&mut lows).split_at_mut(values);
        let all_escapes = std::mem::take(&mut escapes);
        crate::ensure!(
            c.escapes <= all_escapes.len(),
            InvalidArgument,
            "encode: the weight changed between planning and encoding"
        );
        let (e, re) = all_escapes.split_at_mut(c.escapes);
        (offsets, codes, lows, escapes) = (ro, rk, rw, re);
        let src = &data[c.blocks.start * BLOCK_VALUES * 2..][..values * 2];
        jobs.push((c, src, o, k, w, e));
    }
    if jobs.len() == 1 {
        let (c, src, o, k, w, e) = jobs.pop().expect("one job");
        encode_chunk(desc, &lut, c, src, o, k, w, e)?;
    } else {
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = jobs
                .into_iter()
                .map(|(c, src, o, k, w, e)| s.spawn(|| encode_chunk(desc, &lut, c, src, o, k, w, e)))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        });
        results.into_iter().collect::<Result<Vec<()>>>()?;
    }
    if desc.k2 > 0 {
        let (head, tail) = out.split_at_mut(l.escapes_off);
        let (codes2, bytes3) = tail.split_at_mut(l.escapes3_off - l.escapes_off);
        let (head, index3) = head.split_at_mut(l.offsets3_off);
        let index = &head[l.offsets_off..l.offsets_off + (l.blocks + 1) * 4];
        pack_escapes(desc, chunks, index, &v2_bytes, codes2, &mut index3[..(l.blocks + 1) * 4], bytes3)?;
    }
    format::store_checksum(out, threads);
    Ok(())
}

/// Format v2: code the escaped exponents `bytes` (one per escape, in value
/// order, as the chunks wrote them) as k2-bit codes into `codes2`, the
/// exponents outside the escape table as bytes into `bytes3`, and write the
/// level-3 index (`index3`, per block of the escape `index`). One thread
/// per chunk, each into its own bit string, level-3 bytes and index
/// entries (a chunk's level-3 count is the plan's); the bit strings are then
/// laid end to end (a chunk's codes start at bit `escapes_before · k2`, not
/// a byte boundary in general), a copy of a few bits per escape.
fn pack_escapes(
    desc: &DecodeDesc,
    chunks: &[Chunk],
    index: &[u8],
    bytes: &[u8],
    codes2: &mut [u8],
    index3: &mut [u8],
    bytes3: &mut [u8],
) -> Result<()> {
    let changed = || Error::invalid_argument("encode: the weight changed between planning and encoding");
    let k2 = desc.k2;
    let esc2 = ((1u32 << k2) - 1) as u8;
    let mut lut = [esc2; 256];
    for (code, &e) in desc.table2[..esc2 as usize].iter().enumerate() {
        lut[e as usize] = code as u8;
    }
    let at =
        |j: usize| u32::from_le_bytes([index[4 * j], index[4 * j + 1], index[4 * j + 2], index[4 * j + 3]]) as usize;
    // Each chunk's disjoint share of the level-3 index and bytes.
    let (mut idx3, mut b3) = (&mut index3[..desc.layout.blocks * 4], &mut bytes3[..desc.escapes3]);
    let (mut s3_before, mut jobs) = (0usize, Vec::with_capacity(chunks.len()));
    for c in chunks {
        let (i, ri) = std::mem::take(&mut idx3).split_at_mut(c.blocks.len() * 4);
        let all = std::mem::take(&mut b3);
        let (b, rb) = all.split_at_mut(c.escapes3.min(all.len()));
        (idx3, b3) = (ri, rb);
        jobs.push((c, i, b, s3_before));
        s3_before += c.escapes3;
    }
    let pack = |(c, idx3, b3, s3_before): (&Chunk, &mut [u8], &mut [u8], usize)| -> Result<Vec<u8>> {
        let mut bits = vec![0u8; (c.escapes * k2 as usize).div_ceil(8) + 4];
        let (mut acc, mut nbits, mut pos, mut s) = (0u64, 0u32, 0usize, 0usize);
        for (n, j) in c.blocks.clone().enumerate() {
            idx3[4 * n..4 * n + 4].copy_from_slice(&((s3_before + s) as u32).to_le_bytes());
            let (a, b) = (at(j), at(j + 1));
            let mine = a.checked_sub(c.escapes_before).zip(b.checked_sub(c.escapes_before));
            let ours = mine.and_then(|(x, y)| bytes.get(c.escapes_before..)?.get(x..y)).ok_or_else(changed)?;
            for &e in ours {
                let code = lut[e as usize];
                if code == esc2 {
                    *b3.get_mut(s).ok_or_else(changed)? = e;
                    s += 1;
                }
                acc |= (code as u64) << nbits;
                nbits += k2;
                if nbits >= 32 {
                    bits.get_mut(pos..pos + 4).ok_or_else(changed)?.copy_from_slice(&(acc as u32).to_le_bytes());
                    (acc, nbits, pos) = (acc >> 32, nbits - 32, pos + 4);
                }
            }
        }
        crate::ensure!(s == c.escapes3, InvalidArgument, "encode: the weight changed between planning and encoding");
        let tail = nbits.div_ceil(8) as usize;
        bits[pos..pos + tail].copy_from_slice(&acc.to_le_bytes()[..tail]);
        Ok(bits)
    };
    let parts: Vec<Result<Vec<u8>>> = if jobs.len() == 1 {
        jobs.into_iter().map(pack).collect()
    } else {
        std::thread::scope(|sc| {
            let handles: Vec<_> = jobs.into_iter().map(|j| sc.spawn(|| pack(j))).collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
        })
    };
    let b = desc.layout.blocks;
    index3[4 * b..4 * b + 4].copy_from_slice(&(desc.escapes3 as u32).to_le_bytes());
    for (c, part) in chunks.iter().zip(parts) {
        or_bits(&part?, 0, c.escapes * k2 as usize, codes2, c.escapes_before * k2 as usize);
    }
    Ok(())
}

/// OR bits `[from, from + bits)` of the LSB-first bit string `src` into
/// `out` from its bit `at` (those bits of `out` are zero): v2's escape codes
/// are laid end to end at bit offsets that are not byte boundaries, both
/// when chunks are stitched and when a buffer is cut into frames.
fn or_bits(src: &[u8], from: usize, bits: usize, out: &mut [u8], at: usize) {
    let (sb, ss) = (from / 8, from % 8);
    let (db, ds) = (at / 8, (at % 8) as u32);
    for i in 0..bits.div_ceil(8) {
        let lo = src.get(sb + i).copied().unwrap_or(0) as u16;
        let hi = src.get(sb + i + 1).copied().unwrap_or(0) as u16;
        let mut v = ((lo | hi << 8) >> ss) as u8;
        let left = bits - 8 * i;
        if left < 8 {
            v &= (1u8 << left) - 1;
        }
        let w = (v as u16) << ds;
        out[db + i] |= w as u8;
        if w >> 8 != 0 {
            out[db + i + 1] |= (w >> 8) as u8;
        }
    }
}

/// exponent → code; the escape code for exponents outside the table.
fn lookup(desc: &DecodeDesc) -> [u8; 256] {
    let esc = ((1u32 << desc.k) - 1) as u8;
    let mut lut = [esc; 256];
    for (code, &e) in desc.table[..esc as usize].iter().enumerate() {
        lut[e as usize] = code as u8;
    }
    lut
}

#[allow(clippy::too_many_arguments)]
fn encode_chunk(
    desc: &DecodeDesc,
    lut: &[u8; 256],
    chunk: &Chunk,
    src: &[u8],
    offsets: &mut [u8],
    codes: &mut [u8],
    lows: &mut [u8],
    escapes: &mut [u8],
) -> Result<()> {
    let block_code_bytes = BLOCK_VALUES * desc.code_bits() as usize / 8;
    let mut e = 0usize;
    let blocks = src.chunks(BLOCK_VALUES * 2).zip(lows.chunks_mut(BLOCK_VALUES));
    for (j, (block, lows)) in blocks.enumerate() {
        let first = (chunk.escapes_before + e) as u32;
        offsets[j * 4..j * 4 + 4].copy_from_slice(&first.to_le_bytes());
        let end = ((j + 1) * block_code_bytes).min(codes.len());
        let out = &mut codes[j * block_code_bytes..end];
        let fits = encode_block_dispatch(desc, lut, block, lows, out, escapes, &mut e);
        crate::ensure!(fits, InvalidArgument, "encode: the weight changed between planning and encoding");
    }
    crate::ensure!(e == escapes.len(), InvalidArgument, "encode: the weight changed between planning and encoding");
    Ok(())
}

/// Values per group: the 16 a GPU thread decodes, whose codes are `2·W`
/// whole bytes, so a group packs into one u128 and is stored at once.
const GROUP: usize = 16;

/// [`encode_block`] for this weight's dtype and k, as constants.
fn encode_block_dispatch(
    desc: &DecodeDesc,
    lut: &[u8; 256],
    block: &[u8],
    lows: &mut [u8],
    out: &mut [u8],
    escapes: &mut [u8],
    e: &mut usize,
) -> bool {
    macro_rules! go {
        ($($fp:literal $k:literal),*) => {
            match (desc.dtype == Dtype::Fp16, desc.k) {
                $(($fp, $k) => encode_block::<$fp, $k>(lut, block, lows, out, escapes, e),)*
                _ => unreachable!("k is 1..=4 (validated)"),
            }
        };
    }
    go!(false 1, false 2, false 3, false 4, true 1, true 2, true 3, true 4)
}

/// Encode one block; `false` if it has more escapes than `escapes` holds
/// (the weight changed after planning). Generic over the dtype and k so
/// every shift is a constant. Escapes go to a block-local buffer without a
/// branch (escapes are 2–13% of values in real weights: a branch on them
/// mispredicts), then are copied out, bounds-checked, once per block.
#[inline(always)]
fn encode_block<const FP16: bool, const K: u32>(
    lut: &[u8; 256],
    block: &[u8],
    lows: &mut [u8],
    out: &mut [u8],
    escapes: &mut [u8],
    e: &mut usize,
) -> bool {
    let dtype = if FP16 { Dtype::Fp16 } else { Dtype::Bf16 };
    let w = K + dtype.extra_bits();
    let esc = (1u8 << K) - 1;
    let gb = 2 * w as usize;
    let groups = block.len() / (2 * GROUP);
    let mut local = [0u8; BLOCK_VALUES];
    let mut n = 0usize;
    let whole = block.chunks_exact(2 * GROUP).zip(lows.chunks_exact_mut(GROUP)).zip(out.chunks_exact_mut(gb));
    for ((src, lo), dst) in whole.take(groups) {
        // Fixed-size views: the loop below then needs no bounds checks.
        let (Ok(src), Ok(lo)) = (<&[u8; 2 * GROUP]>::try_from(src), <&mut [u8; GROUP]>::try_from(lo)) else {
            unreachable!("chunks_exact yields whole groups")
        };
        let mut acc = 0u128;
        super::unroll16!(|i: usize| {
            let (exp, l, extra) = dtype.split(u16::from_le_bytes([src[2 * i], src[2 * i + 1]]));
            lo[i] = l;
            let c = lut[exp as usize];
            local[n & (BLOCK_VALUES - 1)] = exp;
            n += (c == esc) as usize;
            acc |= ((c as u128) | ((extra as u128) << K)) << (i as u32 * w);
        });
        dst.copy_from_slice(&acc.to_le_bytes()[..gb]);
    }
    // The last block's tail: fewer than a group, byte-aligned at its start.
    let (mut acc, mut nbits, mut pos) = (0u64, 0u32, groups * gb);
    for (i, pair) in block[groups * 2 * GROUP..].chunks_exact(2).enumerate() {
        let (exp, l, extra) = dtype.split(u16::from_le_bytes([pair[0], pair[1]]));
        lows[groups * GROUP + i] = l;
        let c = lut[exp as usize];
        local[n & (BLOCK_VALUES - 1)] = exp;
        n += (c == esc) as usize;
        acc |= ((c as u64) | ((extra as u64) << K)) << nbits;
        nbits += w;
        if nbits >= 32 {
            out[pos..pos + 4].copy_from_slice(&(acc as u32).to_le_bytes());
            (acc, nbits, pos) = (acc >> 32, nbits - 32, pos + 4);
        }
    }
    let tail = nbits.div_ceil(8) as usize;
    out[pos..pos + tail].copy_from_slice(&acc.to_le_bytes()[..tail]);
    debug_assert_eq!(pos + tail, out.len());
    // A block of all escapes wraps `n & (BLOCK_VALUES - 1)` to 0 at its very
    // end only, after its last write: `n` is still the true count.
    let Some(dst) = escapes.get_mut(*e..*e + n) else { return false };
    dst.copy_from_slice(&local[..n.min(BLOCK_VALUES)]);
    *e += n;
    true
}

/// Pass 1: decide whether and how to encode `data` (little-endian values of
/// `dtype`). Errors only on bad input (an odd byte count for a 16-bit dtype,
/// more than 2^32 − 1 values, a bad option); every reason to keep a weight
/// raw is an `Ok` plan saying so.
pub fn plan(data: &[u8], dtype: Dtype, opts: &EncodeOptions) -> Result<Plan> {
    crate::ensure!(
        opts.max_ratio.is_finite() && opts.max_ratio > 0.0,
        InvalidArgument,
        "encode: max_ratio {} is not a positive number",
        opts.max_ratio
    );
    if let Some(k) = opts.k {
        crate::ensure!((1..=MAX_K).contains(&k), InvalidArgument, "encode: code width k={k} is not in 1..={MAX_K}");
    }
    if let Some(k2) = opts.k2 {
        crate::ensure!(
            k2 <= MAX_K,
            InvalidArgument,
            "encode: escape code width k2={k2} is not in 0..={MAX_K} (0: format v1)"
        );
    }
    let threads = opts.thread_count();
    let raw = |r| Ok(Plan { decision: Decision::Raw(r), raw_len: data.len(), threads });
    if dtype == Dtype::Other {
        return raw(RawReason::UnsupportedDtype);
    }
    crate::ensure!(
        data.len().is_multiple_of(2),
        InvalidArgument,
        "encode: {} bytes is not a whole number of 2-byte {} values",
        data.len(),
        dtype.name()
    );
    if data.is_empty() || data.len() < opts.min_bytes {
        return raw(RawReason::TooSmall { bytes: data.len(), min_bytes: opts.min_bytes });
    }
    let n = data.len() / 2;
    crate::ensure!(
        n <= u32::MAX as usize,
        Unsupported,
        "encode: {n} values is more than the format's 2^32 - 1 per weight; split the weight"
    );
    let blocks = n.div_ceil(BLOCK_VALUES);
    // One histogram per frame: the totals choose k and the table, and each
    // frame's own counts give its escapes (for a weight stored in frames,
    // and for the threads' shares of a whole buffer).
    const FB: usize = FRAME_VALUES / BLOCK_VALUES;
    let ranges: Vec<Range<usize>> = (0..blocks.div_ceil(FB)).map(|i| i * FB..((i + 1) * FB).min(blocks)).collect();
    let hists: Vec<[u64; 256]> = par_map(ranges.len(), threads, |i| {
        let r = &ranges[i];
        histogram(dtype, &data[r.start * BLOCK_VALUES * 2..(r.end * BLOCK_VALUES * 2).min(data.len())])
    });
    let mut total = [0u64; 256];
    for h in &hists {
        for (t, c) in total.iter_mut().zip(h) {
            *t += c;
        }
    }
    // Exponents by descending count (ties: the smaller exponent), for the table.
    let mut order: Vec<usize> = (0..256).filter(|&e| total[e] > 0).collect();
    order.sort_by_key(|&e| (std::cmp::Reverse(total[e]), e));
    // (layout, k, k2, escapes, level-3 escapes) of the smallest buffer; v1
    // (k2 = 0) wins ties.
    let mut best: Option<(Layout, u32, u32, usize, usize)> = None;
    for k in opts.k.map_or(1..=MAX_K, |k| k..=k) {
        let used = ((1usize << k) - 1).min(order.len());
        let covered: u64 = order[..used].iter().map(|&e| total[e]).sum();
        let escapes = n - covered as usize;
        for k2 in opts.k2.map_or(0..=MAX_K, |k2| k2..=k2) {
            let used2 = if k2 > 0 { ((1usize << k2) - 1).min(order.len() - used) } else { 0 };
            let covered2: u64 = order[used..used + used2].iter().map(|&e| total[e]).sum();
            let escapes3 = if k2 > 0 { escapes - covered2 as usize } else { 0 };
            let layout = Layout::new(dtype, k, k2, n, escapes, escapes3)?;
            if best.is_none_or(|(b, ..)| layout.total_len < b.total_len) {
                best = Some((layout, k, k2, escapes, escapes3));
            }
        }
    }
    let Some((layout, k, k2, escapes, escapes3)) = best else {
        return Err(Error::internal("encode: no code width considered"));
    };
    let ratio = layout.total_len as f64 / data.len() as f64;
    if ratio >= opts.max_ratio {
        return raw(RawReason::NoGain { ratio, max_ratio: opts.max_ratio });
    }
    let used = ((1usize << k) - 1).min(order.len());
    let used2 = if k2 > 0 { ((1usize << k2) - 1).min(order.len() - used) } else { 0 };
    let mut table = [0u8; TABLE_LEN];
    for (t, &e) in table.iter_mut().zip(&order[..used]) {
        *t = e as u8;
    }
    let mut table2 = [0u8; TABLE_LEN];
    for (t, &e) in table2.iter_mut().zip(&order[used..used + used2]) {
        *t = e as u8;
    }
    let mut before = 0;
    let frames = ranges
        .into_iter()
        .zip(&hists)
        .map(|(blocks, h)| {
            let values: u64 = h.iter().sum();
            let covered: u64 = order[..used].iter().map(|&e| h[e]).sum();
            let covered2: u64 = order[used..used + used2].iter().map(|&e| h[e]).sum();
            let escapes = (values - covered) as usize;
            let escapes3 = if k2 > 0 { escapes - covered2 as usize } else { 0 };
            let c = Chunk { blocks, escapes_before: before, escapes, escapes3 };
            before += c.escapes;
            c
        })
        .collect();
    let desc = DecodeDesc { dtype, k, k2, n, escapes, escapes3, table, table2, layout };
    Ok(Plan { decision: Decision::Coded { desc, frames }, raw_len: data.len(), threads })
}

/// Consecutive frames merged into at most `n` chunks of about equal blocks
/// (one thread each when a whole buffer is encoded).
fn group(frames: &[Chunk], n: usize) -> Vec<Chunk> {
    let n = n.min(frames.len()).max(1);
    (0..n)
        .filter_map(|i| {
            let part = &frames[frames.len() * i / n..frames.len() * (i + 1) / n];
            let (first, last) = (part.first()?, part.last()?);
            Some(Chunk {
                blocks: first.blocks.start..last.blocks.end,
                escapes_before: first.escapes_before,
                escapes: part.iter().map(|c| c.escapes).sum(),
                escapes3: part.iter().map(|c| c.escapes3).sum(),
            })
        })
        .collect()
}

/// Exponent counts; four interleaved tables so consecutive equal exponents
/// do not serialise on one counter.
fn histogram(dtype: Dtype, bytes: &[u8]) -> [u64; 256] {
    let mut h = [[0u32; 256]; 4];
    let mut out = [0u64; 256];
    // u32 counters are flushed before they can overflow.
    for part in bytes.chunks(4 << 30) {
        let mut quads = part.chunks_exact(8);
        for q in &mut quads {
            for (i, t) in h.iter_mut().enumerate() {
                let v = u16::from_le_bytes([q[2 * i], q[2 * i + 1]]);
                t[dtype.split(v).0 as usize] += 1;
            }
        }
        for pair in quads.remainder().chunks_exact(2) {
            h[0][dtype.split(u16::from_le_bytes([pair[0], pair[1]])).0 as usize] += 1;
        }
        for t in &mut h {
            for (o, c) in out.iter_mut().zip(t.iter_mut()) {
                *o += *c as u64;
                *c = 0;
            }
        }
    }
    out
}

/// Encode a weight in one call: [`plan`] then [`Plan::encode_into`].
pub fn encode(data: &[u8], dtype: Dtype, opts: &EncodeOptions) -> Result<Encoded> {
    let p = plan(data, dtype, opts)?;
    match p.outcome() {
        Err(r) => Ok(Encoded::Raw(r)),
        Ok(len) => {
            let mut out = vec![0u8; len];
            p.encode_into(data, &mut out)?;
            Ok(Encoded::Coded(out))
        }
    }
}

/// The frames of a weight given as one validated buffer (`buf`,
/// described by `desc` from [`super::parse`]): what [`reframe`] writes.
/// Escape counts come from the buffer's escape index.
pub fn frames_of(desc: &DecodeDesc, buf: &[u8]) -> Result<Vec<Frame>> {
    let l = &desc.layout;
    desc.check_buffer(buf, "reframe")?;
    let off = |j: usize| desc.escape_offset(buf, j);
    const FB: usize = FRAME_VALUES / BLOCK_VALUES;
    let mut frames = Vec::with_capacity(l.blocks.div_ceil(FB));
    let mut at = 0;
    for b0 in (0..l.blocks).step_by(FB) {
        let b1 = (b0 + FB).min(l.blocks);
        let (e0, e1) = (off(b0), off(b1));
        crate::ensure!(
            e0 <= e1 && e1 <= desc.escapes,
            InvalidArgument,
            "reframe: the escape index of blocks {b0}..{b1} runs {e0}..{e1} (of {} escapes)",
            desc.escapes
        );
        let (s0, s1) = (desc.escape3_offset(buf, b0), desc.escape3_offset(buf, b1));
        crate::ensure!(
            s0 <= s1 && s1 <= desc.escapes3,
            InvalidArgument,
            "reframe: the level-3 index of blocks {b0}..{b1} runs {s0}..{s1} (of {} level-3 escapes)",
            desc.escapes3
        );
        let n = (b1 * BLOCK_VALUES).min(desc.n) - b0 * BLOCK_VALUES;
        let layout = Layout::new(desc.dtype, desc.k, desc.k2, n, e1 - e0, s1 - s0)?;
        frames.push(Frame {
            at,
            raw_offset: b0 * BLOCK_VALUES * 2,
            desc: DecodeDesc { n, escapes: e1 - e0, escapes3: s1 - s0, layout, ..*desc },
        });
        at += layout.total_len;
    }
    Ok(frames)
}

/// Rewrite a validated buffer as the `frames` [`frames_of`] gave
/// for it, end to end in `out` (their total length): each frame's streams
/// are slices of the buffer's, its escape index rebased to start at 0, with
/// its own header and checksum. Decoding the frames gives the buffer's values.
pub fn reframe(desc: &DecodeDesc, buf: &[u8], frames: &[Frame], out: &mut [u8]) -> Result<()> {
    let l = &desc.layout;
    desc.check_buffer(buf, "reframe")?;
    let total = frames.last().map_or(0, |f| f.at + f.len());
    crate::ensure!(out.len() == total, InvalidArgument, "reframe: {} bytes out for frames of {total}", out.len());
    let cb = BLOCK_VALUES * desc.code_bits() as usize / 8;
    for f in frames {
        let (b0, fl) = (f.raw_offset / (2 * BLOCK_VALUES), &f.desc.layout);
        let o = &mut out[f.at..f.at + fl.total_len];
        o.fill(0);
        format::write_header(&f.desc, o);
        let e0 = desc.escape_offset(buf, b0);
        for j in 0..=fl.blocks {
            let v = desc
                .escape_offset(buf, b0 + j)
                .checked_sub(e0)
                .ok_or_else(|| Error::invalid_argument("reframe: the escape index decreases"))?;
            o[fl.offsets_off + 4 * j..fl.offsets_off + 4 * j + 4].copy_from_slice(&(v as u32).to_le_bytes());
        }
        let first = b0 * BLOCK_VALUES;
        o[fl.codes_off..fl.codes_off + fl.codes_len]
            .copy_from_slice(&buf[l.codes_off + b0 * cb..l.codes_off + b0 * cb + fl.codes_len]);
        o[fl.lows_off..fl.lows_off + f.desc.n].copy_from_slice(&buf[l.lows_off + first..l.lows_off + first + f.desc.n]);
        if desc.k2 == 0 {
            o[fl.escapes_off..fl.escapes_off + f.desc.escapes]
                .copy_from_slice(&buf[l.escapes_off + e0..l.escapes_off + e0 + f.desc.escapes]);
        } else {
            let s0 = desc.escape3_offset(buf, b0);
            for j in 0..=fl.blocks {
                let v = desc
                    .escape3_offset(buf, b0 + j)
                    .checked_sub(s0)
                    .ok_or_else(|| Error::invalid_argument("reframe: the level-3 index decreases"))?;
                o[fl.offsets3_off + 4 * j..fl.offsets3_off + 4 * j + 4].copy_from_slice(&(v as u32).to_le_bytes());
            }
            // The frame's escape codes: bits [e0·k2, e1·k2) of the buffer's, from bit 0.
            let k2 = desc.k2 as usize;
            let src = &buf[l.escapes_off..l.escapes_off + l.escapes_len];
            or_bits(src, e0 * k2, f.desc.escapes * k2, &mut o[fl.escapes_off..fl.escapes_off + fl.escapes_len], 0);
            o[fl.escapes3_off..fl.escapes3_off + f.desc.escapes3]
                .copy_from_slice(&buf[l.escapes3_off + s0..l.escapes3_off + s0 + f.desc.escapes3]);
        }
        format::store_checksum(o, 1);
    }
    Ok(())
}
