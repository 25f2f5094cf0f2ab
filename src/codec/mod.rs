//! Lossless compression of bf16 and fp16 weights, decodable on a GPU at
//! memory speed (formats v1 and v2, documented in docs/RESIDENCY.md).
//!
//! A 16-bit float splits into its exponent and the rest. The rest (bf16:
//! sign and 7 mantissa bits, exactly one byte; fp16: sign and 10 mantissa
//! bits) is close to random and is stored raw. The exponent carries 2–2.8
//! bits of information in a trained or initialised weight, so it becomes a
//! fixed k-bit code (k = 1..=4, chosen per weight for the smallest size)
//! into a table of the weight's 2^k − 1 most frequent exponents; the last
//! code is an escape whose exponent is stored raw in an escape stream.
//! Format v2 codes the escapes again: a k2-bit code into a table of the
//! next 2^k2 − 1 most frequent exponents, and only the rest as bytes (for
//! N(0, 0.02) bf16: k = 2, k2 = 3, 0.678 × against v1's 0.699 ×).
//!
//! Fixed-width codes, not Huffman: every value's code sits at a known bit
//! position, so a GPU thread block decodes its 4096-value block with no
//! serial dependency (an escape's position is a block prefix sum, and each
//! block's first escape is indexed). The cost is ratio: v1 gives 0.70 ×
//! for bf16 normal weights, v2 0.68 ×, Huffman's 0.68 × (issue figures).
//!
//! A weight stays raw (the encoder says why, [`RawReason`]) when it is
//! smaller than [`EncodeOptions::min_bytes`], does not reach
//! [`EncodeOptions::max_ratio`], or is of a dtype the codec does not know.
//!
//! [`encode`] and [`decode`] run on several threads; [`parse`] validates a
//! buffer (checksum included) and yields the [`DecodeDesc`] a device decode
//! needs ([`crate::device::Device::decode_async`]).

mod decode;
mod encode;
mod format;
mod piece;

pub use decode::{decode, decode_piece, decode_with};
pub use encode::{FRAME_VALUES, Frame, Plan, encode, frames_of, plan, reframe};
pub use format::{ALIGN, BLOCK_VALUES, DecodeDesc, HEADER_LEN, MAGIC, VERSION, parse, parse_header};
pub use piece::DecodePiece;

/// `$f(0); $f(1); ... $f(15);`: the 16 values of a group with constant
/// indexes, so shifts and offsets are immediates (a rolled loop of variable
/// shifts ran at ~0.5 GB/s).
macro_rules! unroll16 {
    ($f:expr) => {{
        let mut f = $f;
        f(0);
        f(1);
        f(2);
        f(3);
        f(4);
        f(5);
        f(6);
        f(7);
        f(8);
        f(9);
        f(10);
        f(11);
        f(12);
        f(13);
        f(14);
        f(15);
    }};
}
pub(crate) use unroll16;

/// Element types, as the encoder is told them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    Bf16,
    Fp16,
    /// Any other element type (fp32, fp8, int8, int4, ...): never encoded,
    /// always [`RawReason::UnsupportedDtype`].
    Other,
}

impl Dtype {
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Other => "an unsupported dtype",
        }
    }
    /// The dtype byte of the header.
    pub(crate) fn code(self) -> u8 {
        match self {
            Dtype::Bf16 => 1,
            Dtype::Fp16 => 2,
            Dtype::Other => 0,
        }
    }
    pub(crate) fn from_code(c: u8) -> Option<Self> {
        match c {
            1 => Some(Dtype::Bf16),
            2 => Some(Dtype::Fp16),
            _ => None,
        }
    }
    pub(crate) fn exponent_bits(self) -> u32 {
        match self {
            Dtype::Bf16 => 8,
            Dtype::Fp16 => 5,
            Dtype::Other => 0,
        }
    }
    /// Raw bits that ride in the code stream beside the exponent code: fp16
    /// keeps its sign and top two mantissa bits there (its low byte is the
    /// low 8 mantissa bits); bf16's sign and mantissa fill the low byte.
    pub(crate) fn extra_bits(self) -> u32 {
        match self {
            Dtype::Fp16 => 3,
            _ => 0,
        }
    }
    /// (exponent, low byte, extra bits) of a value.
    #[inline(always)]
    pub(crate) fn split(self, v: u16) -> (u8, u8, u8) {
        match self {
            Dtype::Fp16 => ((v >> 10) as u8 & 0x1F, v as u8, ((v >> 13) as u8 & 0x4) | ((v >> 8) as u8 & 0x3)),
            _ => ((v >> 7) as u8, ((v >> 8) as u8 & 0x80) | (v as u8 & 0x7F), 0),
        }
    }
    /// The inverse of [`Dtype::split`].
    #[inline(always)]
    pub(crate) fn join(self, exp: u8, low: u8, extra: u8) -> u16 {
        match self {
            Dtype::Fp16 => {
                ((extra as u16 & 0x4) << 13) | ((exp as u16 & 0x1F) << 10) | ((extra as u16 & 0x3) << 8) | low as u16
            }
            _ => ((low as u16 & 0x80) << 8) | ((exp as u16) << 7) | (low as u16 & 0x7F),
        }
    }
}

/// How to encode. `Default` gives the documented defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EncodeOptions {
    /// Worker threads; 0 = one per available core.
    pub threads: usize,
    /// Encode only if compressed ÷ raw is below this (default 0.9): a weight
    /// that saves less is not worth a decode.
    pub max_ratio: f64,
    /// Weights smaller than this many raw bytes stay raw (default 1 MiB): a
    /// decode launch (~5 µs) costs more than PCIe time saved below it (30% of
    /// 1 MiB at 53 GB/s is 6 µs).
    pub min_bytes: usize,
    /// Exponent code width in bits (1..=4); `None` (the default) picks the
    /// width that gives the smallest buffer.
    pub k: Option<u32>,
    /// Escape code width in bits: `Some(0)` writes format v1 (escaped
    /// exponents as bytes), `Some(1..=4)` format v2 with that width; `None`
    /// (the default) picks, with `k`, the smallest buffer (v1 on a tie).
    pub k2: Option<u32>,
}

impl Default for EncodeOptions {
    fn default() -> Self {
        Self { threads: 0, max_ratio: 0.9, min_bytes: 1 << 20, k: None, k2: None }
    }
}

impl EncodeOptions {
    pub(crate) fn thread_count(&self) -> usize {
        match self.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            // More threads than this only cost their stacks.
            t => t.min(256),
        }
    }
}

/// Why a weight stays raw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RawReason {
    /// Fewer raw bytes than [`EncodeOptions::min_bytes`] (or none at all).
    TooSmall { bytes: usize, min_bytes: usize },
    /// The best encoding would be `ratio` × raw, not below `max_ratio`.
    NoGain { ratio: f64, max_ratio: f64 },
    /// The codec encodes bf16 and fp16 only.
    UnsupportedDtype,
}

impl std::fmt::Display for RawReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            RawReason::TooSmall { bytes, min_bytes } => {
                write!(f, "stored raw: {bytes} bytes is below the {min_bytes}-byte minimum worth encoding")
            }
            RawReason::NoGain { ratio, max_ratio } => {
                write!(f, "stored raw: it compresses only to {ratio:.3} × (threshold {max_ratio:.3} ×)")
            }
            RawReason::UnsupportedDtype => write!(f, "stored raw: the codec encodes bf16 and fp16 only"),
        }
    }
}

/// The result of [`encode`].
#[derive(Debug, Clone, PartialEq)]
pub enum Encoded {
    /// A format v1 or v2 buffer.
    Coded(Vec<u8>),
    /// Not encoded: keep the raw bytes.
    Raw(RawReason),
}
