//! Formats v1 and v2 of a compressed weight: the header, the stream layout,
//! and the validation that stands between a buffer and any decoder.
//!
//! v2 differs from v1 only in how escaped exponents are stored: v1 keeps
//! each as a byte of the escape stream; v2 codes it again, as a k2-bit code
//! into a second table, and only the exponents outside both tables are
//! bytes (the level-3 stream, indexed per block like the escapes).
//!
//! ```text
//! offset  size  field
//!      0     4  magic "EPMZ"
//!      4     2  version (1 or 2)
//!      6     2  header length (128): the first stream starts here
//!      8     1  dtype (1 = bf16, 2 = fp16)
//!      9     1  k, the exponent code width in bits (1..=4)
//!     10     1  code width W = k + the dtype's extra raw bits (bf16 0, fp16 3)
//!     11     1  v1: reserved, 0; v2: k2, the escape code width (1..=4)
//!     12     4  values per block (4096)
//!     16     8  n, the number of values (1..=2^32-1)
//!     24     8  escapes, the number of escaped exponents
//!     32     8  offset of the block escape offsets
//!     40     8  offset of the code stream
//!     48     8  offset of the low-byte stream
//!     56     8  offset of the escape stream (v2: the k2-bit escape codes)
//!     64     8  total length of the buffer
//!     72    16  exponent table: 2^k-1 entries, the rest 0
//!     88    16  v1: reserved, 0; v2: escape table, 2^k2-1 entries, the rest 0
//!    104     8  v1: reserved, 0; v2: level-3 escapes (exponents in neither table)
//!    112     8  v1: reserved, 0; v2: offset of the level-3 stream
//!    120     4  reserved, 0
//!    124     4  CRC-32 (IEEE) of bytes [0, 124) followed by [128, total)
//! ```
//! Streams in order: the escape offsets (B + 1 u32 for B blocks), in v2 the
//! level-3 offsets (likewise), the codes, the low bytes, the escapes (v1: a
//! byte each; v2: a k2-bit code each, LSB first), in v2 the level-3 bytes.
//! All integers little-endian. Every stream starts at a multiple of 16 and
//! is zero-padded to one, so the total length is one too and a GPU block may
//! read whole 16-byte words of any stream without leaving the buffer.

use crate::error::{Error, Result};

use super::Dtype;

pub const MAGIC: [u8; 4] = *b"EPMZ";
/// The newest format version this library reads and writes (it reads v1 too).
pub const VERSION: u16 = 2;
pub const HEADER_LEN: usize = 128;
/// Values per block. A block is the unit a GPU thread block decodes alone
/// (128 threads × 32 values) and the unit of the escape index.
pub const BLOCK_VALUES: usize = 4096;
/// Stream alignment in bytes: the kernel's loads and stores are 16 bytes wide.
pub const ALIGN: usize = 16;
/// The largest exponent code width; its table has 15 entries. Also the
/// largest escape code width (v2's k2).
pub const MAX_K: u32 = 4;
pub const TABLE_LEN: usize = 16;
const CRC_AT: usize = 124;

pub(super) fn align(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

fn corrupt(msg: impl std::fmt::Display) -> Error {
    Error::invalid_argument(format!("compressed weight refused: {msg}"))
}

/// Where each stream lies, a pure function of (dtype, k, k2, n, escapes,
/// escapes3). In v1 (k2 = 0) the level-3 index and stream are empty:
/// `offsets3_off == codes_off`, `escapes3_off == total_len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Layout {
    pub blocks: usize,
    pub offsets_off: usize,
    pub offsets3_off: usize,
    pub codes_off: usize,
    pub codes_len: usize,
    pub lows_off: usize,
    pub escapes_off: usize,
    /// Bytes of the escape stream, less its padding.
    pub escapes_len: usize,
    pub escapes3_off: usize,
    pub total_len: usize,
}

impl Layout {
    pub fn new(dtype: Dtype, k: u32, k2: u32, n: usize, escapes: usize, escapes3: usize) -> Result<Self> {
        let w = dtype.extra_bits() + k;
        let blocks = n.div_ceil(BLOCK_VALUES);
        let offsets_off = HEADER_LEN;
        // One u32 per block plus the total: block j's escapes are [off[j], off[j+1]).
        let index_len = align((blocks + 1) * 4);
        let offsets3_off = offsets_off + index_len;
        let codes_off = offsets3_off + if k2 > 0 { index_len } else { 0 };
        let codes_len = (n * w as usize).div_ceil(8);
        let lows_off = codes_off + align(codes_len);
        let escapes_off = lows_off + align(n);
        let escapes_len = if k2 > 0 { (escapes * k2 as usize).div_ceil(8) } else { escapes };
        let escapes3_off = escapes_off + align(escapes_len);
        let total_len = escapes3_off + align(escapes3);
        Ok(Self {
            blocks,
            offsets_off,
            offsets3_off,
            codes_off,
            codes_len,
            lows_off,
            escapes_off,
            escapes_len,
            escapes3_off,
            total_len,
        })
    }
}

/// What a decoder needs of a compressed weight, read from a validated
/// header: the host parses it once (at registration), so a decode on the
/// device never reads the header back. Only [`parse`] makes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeDesc {
    pub(super) dtype: Dtype,
    pub(super) k: u32,
    /// The escape code width: 0 in format v1 (escapes are bytes).
    pub(super) k2: u32,
    pub(super) n: usize,
    pub(super) escapes: usize,
    /// Level-3 escapes (v2): exponents in neither table. 0 in v1.
    pub(super) escapes3: usize,
    pub(super) table: [u8; TABLE_LEN],
    pub(super) table2: [u8; TABLE_LEN],
    pub(super) layout: Layout,
}

impl DecodeDesc {
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }
    /// Exponent code width in bits.
    pub fn k(&self) -> u32 {
        self.k
    }
    /// Escape code width in bits (format v2); 0 in format v1.
    pub fn k2(&self) -> u32 {
        self.k2
    }
    /// The format version of the buffer: 1, or 2 when escapes are coded.
    pub fn version(&self) -> u16 {
        if self.k2 > 0 { 2 } else { 1 }
    }
    /// Bits per value in the code stream: `k` plus the dtype's extra raw bits.
    pub fn code_bits(&self) -> u32 {
        self.k + self.dtype.extra_bits()
    }
    pub fn values(&self) -> usize {
        self.n
    }
    pub fn escapes(&self) -> usize {
        self.escapes
    }
    /// Exponents stored as bytes in the level-3 stream (v2; 0 in v1).
    pub fn escapes3(&self) -> usize {
        self.escapes3
    }
    pub fn blocks(&self) -> usize {
        self.layout.blocks
    }
    /// The exponent table (entries past `2^k - 1` are 0).
    pub fn table(&self) -> [u8; TABLE_LEN] {
        self.table
    }
    /// The escape table (v2; entries past `2^k2 - 1` are 0, all 0 in v1).
    pub fn table2(&self) -> [u8; TABLE_LEN] {
        self.table2
    }
    /// Length of the compressed buffer, header included.
    pub fn compressed_len(&self) -> usize {
        self.layout.total_len
    }
    /// Length of the decoded tensor in bytes.
    pub fn raw_len(&self) -> usize {
        self.n * 2
    }
    /// Byte offsets of the (escape offsets, codes, low bytes, escapes,
    /// level-3 offsets, level-3 bytes) streams; in v1 the last two are empty
    /// (at the codes and at the end).
    pub fn stream_offsets(&self) -> [usize; 6] {
        let l = &self.layout;
        [l.offsets_off, l.codes_off, l.lows_off, l.escapes_off, l.offsets3_off, l.escapes3_off]
    }
    /// Refuse a buffer whose length is not this description's (`what`
    /// names the caller in the message).
    pub(super) fn check_buffer(&self, buf: &[u8], what: &str) -> Result<()> {
        crate::ensure!(
            buf.len() == self.layout.total_len,
            InvalidArgument,
            "{what}: the buffer is {} bytes, its header says {}",
            buf.len(),
            self.layout.total_len
        );
        Ok(())
    }
    /// Entry `j` (0..=blocks) of the escape index of `buf`, a buffer
    /// [`Self::check_buffer`] accepted: the escapes before block `j`.
    pub(super) fn escape_offset(&self, buf: &[u8], j: usize) -> usize {
        u32_at(buf, self.layout.offsets_off + 4 * j) as usize
    }
    /// Entry `j` of the level-3 index (v2; 0 in v1): level-3 escapes before block `j`.
    pub(super) fn escape3_offset(&self, buf: &[u8], j: usize) -> usize {
        if self.k2 == 0 {
            return 0;
        }
        u32_at(buf, self.layout.offsets3_off + 4 * j) as usize
    }
    /// compressed ÷ raw.
    pub fn ratio(&self) -> f64 {
        self.layout.total_len as f64 / self.raw_len() as f64
    }
    /// Check the lengths a decode was given against this description.
    pub fn check_lengths(&self, src_len: usize, dst_len: usize) -> Result<()> {
        crate::ensure!(
            src_len == self.layout.total_len,
            InvalidArgument,
            "decode: the compressed source is {src_len} bytes, its header says {}",
            self.layout.total_len
        );
        crate::ensure!(
            dst_len == self.raw_len(),
            InvalidArgument,
            "decode: the destination is {dst_len} bytes, the weight decodes to {}",
            self.raw_len()
        );
        Ok(())
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// Write the header of `desc` into `out[..HEADER_LEN]` (CRC field 0).
pub(super) fn write_header(desc: &DecodeDesc, out: &mut [u8]) {
    let l = &desc.layout;
    let h = &mut out[..HEADER_LEN];
    h.fill(0);
    h[0..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&desc.version().to_le_bytes());
    h[6..8].copy_from_slice(&(HEADER_LEN as u16).to_le_bytes());
    h[8] = desc.dtype.code();
    h[9] = desc.k as u8;
    h[10] = desc.code_bits() as u8;
    h[11] = desc.k2 as u8;
    h[12..16].copy_from_slice(&(BLOCK_VALUES as u32).to_le_bytes());
    for (at, v) in [
        (16, desc.n),
        (24, desc.escapes),
        (32, l.offsets_off),
        (40, l.codes_off),
        (48, l.lows_off),
        (56, l.escapes_off),
        (64, l.total_len),
    ] {
        h[at..at + 8].copy_from_slice(&(v as u64).to_le_bytes());
    }
    h[72..88].copy_from_slice(&desc.table);
    if desc.k2 > 0 {
        h[88..104].copy_from_slice(&desc.table2);
        h[104..112].copy_from_slice(&(desc.escapes3 as u64).to_le_bytes());
        h[112..120].copy_from_slice(&(l.escapes3_off as u64).to_le_bytes());
    }
}

/// CRC-32 of the buffer less its CRC field, on up to `threads` threads
/// (crc32fast combines the CRCs of consecutive pieces exactly).
pub(super) fn checksum(buf: &[u8], threads: usize) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&buf[..CRC_AT]);
    let rest = &buf[HEADER_LEN..];
    // Below 8 MiB a thread costs more than it saves (crc32fast: ~10 GB/s a core).
    let pieces = threads.clamp(1, rest.len() / (8 << 20) + 1);
    if pieces == 1 {
        h.update(rest);
        return h.finalize();
    }
    let chunk = rest.len().div_ceil(pieces);
    let parts: Vec<crc32fast::Hasher> = std::thread::scope(|s| {
        let jobs: Vec<_> = rest
            .chunks(chunk)
            .map(|c| {
                s.spawn(move || {
                    let mut p = crc32fast::Hasher::new();
                    p.update(c);
                    p
                })
            })
            .collect();
        jobs.into_iter().map(|j| j.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    });
    for p in parts {
        h.combine(&p);
    }
    h.finalize()
}

pub(super) fn store_checksum(buf: &mut [u8], threads: usize) {
    let c = checksum(buf, threads);
    buf[CRC_AT..HEADER_LEN].copy_from_slice(&c.to_le_bytes());
}

/// Validate a whole compressed buffer (header fields, layout, escape index
/// and checksum) and describe it. A buffer that passes was written by the
/// encoder of this format version and not changed since, up to CRC-32's
/// chance of 2^-32 for a random corruption; decoders still bound every read.
pub fn parse(buf: &[u8], threads: usize) -> Result<DecodeDesc> {
    let desc = parse_header(buf)?;
    let l = &desc.layout;
    if buf.len() != l.total_len {
        return Err(corrupt(format!(
            "{} bytes given, the header says {} ({})",
            buf.len(),
            l.total_len,
            if buf.len() < l.total_len { "truncated" } else { "trailing bytes" }
        )));
    }
    let stored = u32_at(buf, CRC_AT);
    let actual = checksum(buf, threads);
    if stored != actual {
        return Err(corrupt(format!(
            "checksum mismatch (stored {stored:#010x}, computed {actual:#010x}): the buffer is corrupt"
        )));
    }
    // The escape index: starts at 0, never decreases, ends at the escape count.
    let offs = &buf[l.offsets_off..l.offsets_off + (l.blocks + 1) * 4];
    let mut prev = 0u32;
    for (j, w) in offs.chunks_exact(4).enumerate() {
        let o = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        let bad = (j == 0 && o != 0) || o < prev || (o as usize) > desc.escapes;
        if bad {
            return Err(corrupt(format!(
                "escape offset of block {j} is {o} after {prev} (of {} escapes)",
                desc.escapes
            )));
        }
        prev = o;
    }
    if prev as usize != desc.escapes {
        return Err(corrupt(format!("the escape index ends at {prev}, the header says {} escapes", desc.escapes)));
    }
    if desc.k2 > 0 {
        // The level-3 index likewise, and no block has more level-3 escapes than escapes.
        let mut prev3 = 0usize;
        for j in 0..=l.blocks {
            let o = desc.escape3_offset(buf, j);
            let bad = (j == 0 && o != 0)
                || o < prev3
                || o > desc.escapes3
                || (j > 0 && o - prev3 > desc.escape_offset(buf, j) - desc.escape_offset(buf, j - 1));
            if bad {
                return Err(corrupt(format!(
                    "level-3 offset of block {j} is {o} after {prev3} (of {} level-3 escapes)",
                    desc.escapes3
                )));
            }
            prev3 = o;
        }
        if prev3 != desc.escapes3 {
            return Err(corrupt(format!(
                "the level-3 index ends at {prev3}, the header says {} level-3 escapes",
                desc.escapes3
            )));
        }
    }
    Ok(desc)
}

/// The fixed header alone (no checksum): enough to size buffers.
pub fn parse_header(buf: &[u8]) -> Result<DecodeDesc> {
    if buf.len() < HEADER_LEN {
        return Err(corrupt(format!("{} bytes is shorter than the {HEADER_LEN}-byte header (truncated)", buf.len())));
    }
    if buf[0..4] != MAGIC {
        return Err(corrupt(format!("bad magic {:02x?} (not an epmem compressed weight)", &buf[0..4])));
    }
    let version = u16_at(buf, 4);
    if !(1..=VERSION).contains(&version) {
        return Err(corrupt(format!("format version {version}; this library reads versions 1 to {VERSION}")));
    }
    let header_len = u16_at(buf, 6) as usize;
    if header_len != HEADER_LEN {
        return Err(corrupt(format!("header length {header_len}, version {version} has {HEADER_LEN}")));
    }
    let dtype = Dtype::from_code(buf[8]).ok_or_else(|| corrupt(format!("unknown dtype code {}", buf[8])))?;
    let k = buf[9] as u32;
    if !(1..=MAX_K).contains(&k) {
        return Err(corrupt(format!("exponent code width {k} is not in 1..={MAX_K}")));
    }
    if buf[10] as u32 != k + dtype.extra_bits() {
        return Err(corrupt(format!("code width {} does not match k {k} for {}", buf[10], dtype.name())));
    }
    let block = u32_at(buf, 12) as usize;
    if block != BLOCK_VALUES {
        return Err(corrupt(format!("{block} values per block; version {version} has {BLOCK_VALUES}")));
    }
    let k2 = if version == 2 { buf[11] as u32 } else { 0 };
    if version == 2 && !(1..=MAX_K).contains(&k2) {
        return Err(corrupt(format!("escape code width {k2} is not in 1..={MAX_K}")));
    }
    let n = u64_at(buf, 16);
    let escapes = u64_at(buf, 24);
    if n == 0 || n > u32::MAX as u64 || escapes > n {
        return Err(corrupt(format!(
            "{n} values with {escapes} escapes (values must be 1..=2^32-1, escapes at most values)"
        )));
    }
    let escapes3 = if k2 > 0 { u64_at(buf, 104) } else { 0 };
    if escapes3 > escapes {
        return Err(corrupt(format!("{escapes3} level-3 escapes of {escapes} escapes")));
    }
    let (n, escapes, escapes3) = (n as usize, escapes as usize, escapes3 as usize);
    let layout = Layout::new(dtype, k, k2, n, escapes, escapes3)?;
    let mut stored = vec![u64_at(buf, 32), u64_at(buf, 40), u64_at(buf, 48), u64_at(buf, 56), u64_at(buf, 64)];
    let mut want = vec![layout.offsets_off, layout.codes_off, layout.lows_off, layout.escapes_off, layout.total_len];
    if k2 > 0 {
        stored.push(u64_at(buf, 112));
        want.push(layout.escapes3_off);
    }
    let want: Vec<u64> = want.into_iter().map(|v| v as u64).collect();
    if stored != want {
        return Err(corrupt(format!(
            "stream offsets {stored:?} do not match the layout of version {version} {want:?}"
        )));
    }
    let mut table = [0u8; TABLE_LEN];
    table.copy_from_slice(&buf[72..88]);
    let mut table2 = [0u8; TABLE_LEN];
    let used = (1usize << k) - 1;
    let used2 = if k2 > 0 { (1usize << k2) - 1 } else { 0 };
    let reserved_from = if k2 > 0 {
        table2.copy_from_slice(&buf[88..104]);
        120
    } else {
        88
    };
    let nonzero = table[used..].iter().any(|&b| b != 0)
        || table2[used2..].iter().any(|&b| b != 0)
        || (k2 == 0 && buf[11] != 0)
        || buf[reserved_from..CRC_AT].iter().any(|&b| b != 0);
    if nonzero {
        return Err(corrupt("reserved header bytes are not zero"));
    }
    if let Some(&e) = table[..used].iter().chain(&table2[..used2]).find(|&&e| e as u32 >= 1 << dtype.exponent_bits()) {
        return Err(corrupt(format!(
            "table exponent {e} does not fit {}'s {} exponent bits",
            dtype.name(),
            dtype.exponent_bits()
        )));
    }
    Ok(DecodeDesc { dtype, k, k2, n, escapes, escapes3, table, table2, layout })
}
