//! A range of whole blocks of a compressed weight, decodable on its own: how
//! a weight whose compressed bytes exceed a device staging buffer is paged
//! in, one piece at a time.
//!
//! A piece of blocks `[first, end)` is *staged* as the parts of the streams
//! those blocks read, each at a 16-byte-aligned offset of one buffer:
//!
//! ```text
//! staged offset  part
//!             0  escape offsets first..=end (u32 each, absolute escape indexes), padded to 16
//!            s1  codes of the blocks (the stream's padding after the weight's last block)
//!            s2  low bytes of the blocks (likewise)
//!            s3  escape bytes [B & !15, align16(B')): v1, B = E = offset[first],
//!                B' = E' = offset[end]; v2, B = E·k2/8, B' = ceil(E'·k2/8)
//!            s4  v2: level-3 offsets first..=end (absolute), padded to 16
//!            s5  v2: level-3 bytes [T & !15, align16(T')), T, T' = level-3 offset[first], [end]
//! ```
//!
//! Every part is one contiguous range of the compressed buffer, so a piece
//! is staged by (at most) six copies (four in v1, whose last two parts are
//! empty). The offsets stay absolute: a decoder reads escape `i` at
//! `escapes_part + i − (E & !15)` (v2: its code at bit `i·k2` of
//! `escapes_part − (B & !15)`). The whole weight is also a piece
//! ([`DecodeDesc::whole`]): the buffer as it is, header included, staged by
//! one copy.

use super::format::{ALIGN, BLOCK_VALUES, DecodeDesc, align};
use crate::error::{Error, Result};

/// Blocks `[first, end)` of a compressed weight as staged for one decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodePiece {
    desc: DecodeDesc,
    first: usize,
    end: usize,
    /// The byte of the escape stream the staged escapes start at (a
    /// multiple of 16; in v1 also the escape index of the first staged
    /// escape), and one past the piece's last escape (an escape index).
    esc_base: usize,
    esc_end: usize,
    /// Likewise for the level-3 bytes (v2; 0 and 0 in v1).
    esc3_base: usize,
    esc3_end: usize,
    /// (escape offsets, codes, low bytes, escapes, level-3 offsets, level-3
    /// bytes): where each part lies in the staged bytes, where it starts in
    /// the compressed buffer, its bytes.
    staged: [usize; 6],
    src: [usize; 6],
    lens: [usize; 6],
    staged_len: usize,
    whole: bool,
}

impl DecodeDesc {
    /// The whole weight as one piece: the compressed buffer as it is.
    pub fn whole(&self) -> DecodePiece {
        let l = &self.layout;
        let staged = self.stream_offsets();
        let ends = [l.offsets3_off, l.lows_off, l.escapes_off, l.escapes3_off, l.codes_off, l.total_len];
        let lens = [0, 1, 2, 3, 4, 5].map(|i| ends[i] - staged[i]);
        DecodePiece {
            desc: *self,
            first: 0,
            end: l.blocks,
            esc_base: 0,
            esc_end: self.escapes,
            esc3_base: 0,
            esc3_end: self.escapes3,
            staged,
            src: staged,
            lens,
            staged_len: l.total_len,
            whole: true,
        }
    }

    /// Blocks `[first, end)` of the weight whose validated compressed buffer
    /// is `buf` (the escape offsets are read from it).
    pub fn piece(&self, buf: &[u8], first: usize, end: usize) -> Result<DecodePiece> {
        let l = &self.layout;
        self.check_buffer(buf, "decode piece")?;
        crate::ensure!(
            first < end && end <= l.blocks,
            InvalidArgument,
            "decode piece: blocks {first}..{end} are not a non-empty range of the weight's {}",
            l.blocks
        );
        let (e0, e1) = (self.escape_offset(buf, first), self.escape_offset(buf, end));
        crate::ensure!(
            e0 <= e1 && e1 <= self.escapes,
            InvalidArgument,
            "decode piece: the escape index of blocks {first}..{end} runs {e0}..{e1} (of {} escapes)",
            self.escapes
        );
        let (s0, s1) = (self.escape3_offset(buf, first), self.escape3_offset(buf, end));
        crate::ensure!(
            s0 <= s1 && s1 <= self.escapes3,
            InvalidArgument,
            "decode piece: the level-3 index of blocks {first}..{end} runs {s0}..{s1} (of {} level-3 escapes)",
            self.escapes3
        );
        let cb = BLOCK_VALUES * self.code_bits() as usize / 8;
        let last = end == l.blocks;
        // The escape stream's bytes: v1 a byte an escape, v2 k2 bits.
        let k2 = self.k2 as usize;
        let (b0, b1) = if k2 > 0 { (e0 * k2 / 8, (e1 * k2).div_ceil(8)) } else { (e0, e1) };
        let esc_base = b0 & !(ALIGN - 1);
        let esc3_base = s0 & !(ALIGN - 1);
        let v2 = k2 > 0;
        let src = [
            l.offsets_off + 4 * first,
            l.codes_off + first * cb,
            l.lows_off + first * BLOCK_VALUES,
            l.escapes_off + esc_base,
            l.offsets3_off + if v2 { 4 * first } else { 0 },
            l.escapes3_off + esc3_base,
        ];
        let lens = [
            4 * (end - first + 1),
            if last { align(l.codes_len) - first * cb } else { (end - first) * cb },
            if last { align(self.n) - first * BLOCK_VALUES } else { (end - first) * BLOCK_VALUES },
            align(b1) - esc_base,
            if v2 { 4 * (end - first + 1) } else { 0 },
            if v2 { align(s1) - esc3_base } else { 0 },
        ];
        let mut staged = [0usize; 6];
        for i in 1..6 {
            staged[i] = staged[i - 1] + align(lens[i - 1]);
        }
        Ok(DecodePiece {
            desc: *self,
            first,
            end,
            esc_base,
            esc_end: e1,
            esc3_base,
            esc3_end: s1,
            staged,
            src,
            lens,
            staged_len: staged[5] + lens[5],
            whole: false,
        })
    }

    /// The piece that starts at block `first` and stages in at most `cap`
    /// bytes, as many blocks as fit: the whole weight when `first` is 0 and
    /// the buffer fits. Refused when not even one block fits `cap`.
    pub fn piece_within(&self, buf: &[u8], first: usize, cap: usize) -> Result<DecodePiece> {
        if first == 0 && self.layout.total_len <= cap {
            return Ok(self.whole());
        }
        let one = self.piece(buf, first, first + 1)?;
        crate::ensure!(
            one.staged_len <= cap,
            InvalidArgument,
            "decode piece: block {first} stages in {} bytes, more than a staging buffer of {cap}",
            one.staged_len
        );
        // The staged length grows with `end`: the last end that fits.
        let (mut lo, mut hi) = (first + 1, self.layout.blocks);
        let mut best = one;
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            let p = self.piece(buf, first, mid)?;
            if p.staged_len <= cap {
                (lo, best) = (mid, p);
            } else {
                hi = mid - 1;
            }
        }
        Ok(best)
    }
}

impl DecodePiece {
    /// The weight this is a piece of.
    pub fn desc(&self) -> &DecodeDesc {
        &self.desc
    }
    /// Its blocks: `[first_block, end_block)`.
    pub fn first_block(&self) -> usize {
        self.first
    }
    pub fn end_block(&self) -> usize {
        self.end
    }
    pub fn blocks(&self) -> usize {
        self.end - self.first
    }
    /// Values it decodes.
    pub fn values(&self) -> usize {
        (self.desc.n - self.first * BLOCK_VALUES).min(self.blocks() * BLOCK_VALUES)
    }
    /// Where its output starts in the decoded weight, in bytes.
    pub fn raw_offset(&self) -> usize {
        self.first * BLOCK_VALUES * 2
    }
    /// Bytes it decodes to.
    pub fn raw_len(&self) -> usize {
        self.values() * 2
    }
    /// Bytes of its staged copy.
    pub fn staged_len(&self) -> usize {
        self.staged_len
    }
    /// Offsets of the (escape offsets, codes, low bytes, escapes, level-3
    /// offsets, level-3 bytes) parts in the staged bytes, each a multiple
    /// of 16 (the last two are empty in v1).
    pub fn staged_offsets(&self) -> [usize; 6] {
        self.staged
    }
    /// The byte of the escape stream its staged escapes start at (in v1
    /// also the absolute escape index of the first staged escape).
    pub fn escape_base(&self) -> usize {
        self.esc_base
    }
    /// One past the absolute index of its last escape.
    pub fn escape_end(&self) -> usize {
        self.esc_end
    }
    /// The absolute level-3 index of its first staged level-3 byte (v2).
    pub fn escape3_base(&self) -> usize {
        self.esc3_base
    }
    /// One past the absolute index of its last level-3 escape (v2; 0 in v1).
    pub fn escape3_end(&self) -> usize {
        self.esc3_end
    }
    /// Whether it is the whole buffer, header included ([`DecodeDesc::whole`]).
    pub fn is_whole(&self) -> bool {
        self.whole
    }
    /// The copies that stage it: (offset in the compressed buffer, offset in
    /// the staged bytes, bytes), empty parts left out.
    pub fn copies(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        let whole = self.whole.then_some((0, 0, self.staged_len));
        let parts = (0..6).filter(move |_| !self.whole).map(|i| (self.src[i], self.staged[i], self.lens[i]));
        whole.into_iter().chain(parts).filter(|c| c.2 > 0)
    }
    /// Bytes its copies move.
    pub fn copied_bytes(&self) -> usize {
        self.copies().map(|c| c.2).sum()
    }
    /// Check the lengths a decode of this piece was given.
    pub fn check_lengths(&self, src_len: usize, dst_len: usize) -> Result<()> {
        if src_len != self.staged_len || dst_len != self.raw_len() {
            return Err(Error::invalid_argument(format!(
                "decode: blocks {}..{} stage in {} bytes and decode to {}; given {src_len} and {dst_len}",
                self.first,
                self.end,
                self.staged_len,
                self.raw_len()
            )));
        }
        Ok(())
    }
}
