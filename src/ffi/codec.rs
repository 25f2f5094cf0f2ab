//! The weight codec's C API: encode a bf16/fp16 weight into a compressed
//! buffer the caller keeps (format v1, docs/RESIDENCY.md "Compressed weights:
//! the format"), validate such a buffer, and decode it on the CPU.
//!
//! Encoding is a size query ([`epm_codec_plan`]) then [`epm_codec_encode`]
//! into a buffer of that size; a weight the codec keeps raw is reported as
//! such (`EpmCodecInfo::outcome`), never as an error. None of these functions
//! needs a device.

use crate::codec::{self, DecodeDesc, Dtype, EncodeOptions, Plan, RawReason};
use crate::ffi::prelude::*;

/// `dtype` of a bf16 weight.
pub const EPM_CODEC_DTYPE_BF16: u32 = 1;
/// `dtype` of an fp16 weight.
pub const EPM_CODEC_DTYPE_FP16: u32 = 2;
/// `dtype` of any other element type (fp32, fp8, int8, ...): always kept raw
/// with outcome `EPM_CODEC_RAW_UNSUPPORTED_DTYPE`.
pub const EPM_CODEC_DTYPE_OTHER: u32 = 3;

/// `outcome`: the weight is encoded; `encoded_bytes` is the buffer's length.
pub const EPM_CODEC_CODED: u32 = 1;
/// `outcome`: kept raw, smaller than `min_bytes`.
pub const EPM_CODEC_RAW_TOO_SMALL: u32 = 2;
/// `outcome`: kept raw, the best encoding (`ratio`) is not below `max_ratio`.
pub const EPM_CODEC_RAW_NO_GAIN: u32 = 3;
/// `outcome`: kept raw, a dtype the codec does not encode.
pub const EPM_CODEC_RAW_UNSUPPORTED_DTYPE: u32 = 4;

/// How to encode. Fill it with `epm_codec_options_default`, then change
/// fields. Fields are only ever added at the end.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EpmCodecOptions {
    /// `sizeof(EpmCodecOptions)` as the caller compiled it.
    pub size: usize,
    /// Encoder threads; 0 = one per available core (default 0).
    pub threads: u32,
    /// Exponent code width in bits, 1–4; 0 = the width giving the smallest
    /// buffer (default 0).
    pub k: u32,
    /// Encode only if compressed ÷ raw would be below this (default 0.9);
    /// 0 also means 0.9.
    pub max_ratio: f64,
    /// Weights of fewer raw bytes stay raw (default 1 MiB).
    pub min_bytes: u64,
}

/// What an encode did or would do, or what a compressed buffer holds.
/// Set `size = sizeof(EpmCodecInfo)` first. Fields are only ever added at
/// the end.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct EpmCodecInfo {
    /// In: `sizeof(EpmCodecInfo)`. Out: bytes filled.
    pub size: usize,
    /// `EPM_CODEC_CODED` or an `EPM_CODEC_RAW_*` reason.
    pub outcome: u32,
    /// `EPM_CODEC_DTYPE_*` of the weight.
    pub dtype: u32,
    /// Exponent code width in bits (0 when raw).
    pub k: u32,
    /// Compressed format version (1; 0 when raw).
    pub format_version: u32,
    /// Values in the weight.
    pub values: u64,
    /// Raw size in bytes.
    pub raw_bytes: u64,
    /// Length of the compressed buffer (0 when raw).
    pub encoded_bytes: u64,
    /// Exponents stored in the escape stream.
    pub escapes: u64,
    /// encoded ÷ raw; for `EPM_CODEC_RAW_NO_GAIN` the best ratio found;
    /// 1.0 otherwise when raw.
    pub ratio: f64,
}

/// `sizeof(EpmCodecOptions)` in its first published version. Frozen.
pub const EPM_CODEC_OPTIONS_SIZE_V1: usize = 32;
/// `sizeof(EpmCodecInfo)` in its first published version. Frozen.
pub const EPM_CODEC_INFO_SIZE_V1: usize = 64;
versioned!(input EpmCodecOptions, EPM_CODEC_OPTIONS_SIZE_V1);
versioned!(EpmCodecInfo, EPM_CODEC_INFO_SIZE_V1);

fn default_options() -> EpmCodecOptions {
    let d = EncodeOptions::default();
    EpmCodecOptions {
        size: std::mem::size_of::<EpmCodecOptions>(),
        threads: d.threads as u32,
        k: 0,
        max_ratio: d.max_ratio,
        min_bytes: d.min_bytes as u64,
    }
}

fn options_of(options: *const EpmCodecOptions) -> Result<EncodeOptions> {
    let o = if options.is_null() {
        default_options()
    } else {
        read_versioned(options, default_options(), "EpmCodecOptions")?
    };
    ensure!(o.k <= 4, InvalidArgument, "EpmCodecOptions.k = {} is not 0 (choose) or 1–4", o.k);
    Ok(EncodeOptions {
        threads: o.threads as usize,
        max_ratio: if o.max_ratio == 0.0 { EncodeOptions::default().max_ratio } else { o.max_ratio },
        min_bytes: usize::try_from(o.min_bytes).unwrap_or(usize::MAX),
        k: (o.k != 0).then_some(o.k),
    })
}

fn dtype_of(dtype: u32) -> Result<Dtype> {
    match dtype {
        EPM_CODEC_DTYPE_BF16 => Ok(Dtype::Bf16),
        EPM_CODEC_DTYPE_FP16 => Ok(Dtype::Fp16),
        EPM_CODEC_DTYPE_OTHER => Ok(Dtype::Other),
        other => bail!(
            InvalidArgument,
            "dtype {other} is not EPM_CODEC_DTYPE_BF16 (1), EPM_CODEC_DTYPE_FP16 (2) or EPM_CODEC_DTYPE_OTHER (3)"
        ),
    }
}

fn dtype_code(d: Dtype) -> u32 {
    match d {
        Dtype::Bf16 => EPM_CODEC_DTYPE_BF16,
        Dtype::Fp16 => EPM_CODEC_DTYPE_FP16,
        Dtype::Other => EPM_CODEC_DTYPE_OTHER,
    }
}

fn info_of_desc(d: &DecodeDesc) -> EpmCodecInfo {
    EpmCodecInfo {
        size: std::mem::size_of::<EpmCodecInfo>(),
        outcome: EPM_CODEC_CODED,
        dtype: dtype_code(d.dtype()),
        k: d.k(),
        format_version: codec::VERSION as u32,
        values: d.values() as u64,
        raw_bytes: d.raw_len() as u64,
        encoded_bytes: d.compressed_len() as u64,
        escapes: d.escapes() as u64,
        ratio: d.ratio(),
    }
}

fn info_of_plan(p: &Plan, dtype: Dtype, raw_bytes: usize) -> EpmCodecInfo {
    if let Some(d) = p.desc() {
        return info_of_desc(d);
    }
    let (outcome, ratio) = match p.outcome() {
        Err(RawReason::TooSmall { .. }) => (EPM_CODEC_RAW_TOO_SMALL, 1.0),
        Err(RawReason::NoGain { ratio, .. }) => (EPM_CODEC_RAW_NO_GAIN, ratio),
        _ => (EPM_CODEC_RAW_UNSUPPORTED_DTYPE, 1.0),
    };
    let values = if dtype == Dtype::Other { 0 } else { raw_bytes as u64 / 2 };
    EpmCodecInfo {
        size: std::mem::size_of::<EpmCodecInfo>(),
        outcome,
        dtype: dtype_code(dtype),
        values,
        raw_bytes: raw_bytes as u64,
        ratio,
        ..Default::default()
    }
}

/// Borrow `[p, p+len)` as bytes (validated non-NULL, non-empty, no overflow).
fn host_bytes<'a>(p: *const c_void, len: usize, what: &str) -> Result<&'a [u8]> {
    let (p, len) = crate::ffi::args::host_range(p, len, what)?;
    // SAFETY: the C caller guarantees `len` readable bytes at `p` for the
    // call (each function's contract); checked non-NULL and not wrapping.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// Borrow `[p, p+len)` as writable bytes, refusing any overlap with `src`.
fn host_bytes_mut<'a>(p: *mut c_void, len: usize, src: &[u8], what: &str) -> Result<&'a mut [u8]> {
    let (q, len) = crate::ffi::args::host_range(p.cast_const(), len, what)?;
    let (a, b) = (q as usize, src.as_ptr() as usize);
    ensure!(
        a + len <= b || b + src.len() <= a,
        InvalidArgument,
        "`{what}` overlaps the source buffer"
    );
    // SAFETY: the C caller guarantees `len` writable bytes at `p`, not
    // otherwise accessed during the call; checked non-NULL, not wrapping,
    // and disjoint from `src`, so the two slices do not alias.
    Ok(unsafe { std::slice::from_raw_parts_mut(q.cast_mut(), len) })
}

/// Fill `*out` with the default encoder options (threads 0 = all cores,
/// k 0 = best, max_ratio 0.9, min_bytes 1 MiB).
///
/// Set `out->size = sizeof(EpmCodecOptions)` first. NULL: `out` is
/// NULL_POINTER. Errors: INVALID_ARGUMENT for a too-small `out->size`.
/// Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_codec_options_default(out: *mut EpmCodecOptions) -> EpmStatus {
    ffi_boundary! {
        let out = try_out!(out);
        write_versioned(out, default_options(), "EpmCodecOptions")
    }
}

/// Decide how `src` (`src_len` bytes of little-endian `dtype` values) would
/// be encoded, without encoding it: `*out` gets the outcome and, when
/// `EPM_CODEC_CODED`, `encoded_bytes`, the buffer size `epm_codec_encode`
/// needs. Reads the weight once (an exponent histogram, on `threads` threads).
///
/// `options` NULL means the defaults. Ownership: everything is only read
/// during the call. NULL: `src` or `out` is NULL_POINTER. Errors:
/// INVALID_ARGUMENT for `src_len` 0 or odd for a 16-bit dtype, an unknown
/// `dtype`, options out of range or a too-small `size`; UNSUPPORTED for more
/// than 2^32 − 1 values. A weight kept raw is not an error. `*out` is written
/// only on success. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_codec_plan(
    src: *const c_void,
    src_len: usize,
    dtype: u32,
    options: *const EpmCodecOptions,
    out: *mut EpmCodecInfo,
) -> EpmStatus {
    ffi_boundary! {
        let out = try_out!(out);
        let data = host_bytes(src, src_len, "src")?;
        let dtype = dtype_of(dtype)?;
        let p = codec::plan(data, dtype, &options_of(options)?)?;
        write_versioned(out, info_of_plan(&p, dtype, data.len()), "EpmCodecInfo")
    }
}

/// Encode `src` (`src_len` bytes of little-endian `dtype` values) into
/// `dst`, a buffer of `dst_capacity` bytes the caller owns and keeps: the
/// compressed weight is `dst[0, out->encoded_bytes)`. When the codec keeps
/// the weight raw (`out->outcome` is an `EPM_CODEC_RAW_*` reason), nothing is
/// written to `dst`, which may then be NULL, and the call succeeds.
///
/// Size `dst` with `epm_codec_plan` on the same options (the same `src`
/// gives the same size). Ownership: `src` and `options` are only read, `dst`
/// only written, during the call; `src` and `dst` must not overlap. NULL:
/// `src`, `out`, or `dst` of a weight that is encoded, is NULL_POINTER.
/// Errors: those of `epm_codec_plan`; INVALID_ARGUMENT when `dst_capacity` is
/// below the encoded size (the message gives it), when `dst` overlaps `src`,
/// or when `src` changed during the call. `*out` is written only on success.
/// Threading: safe from any thread; runs `options->threads` threads.
#[unsafe(no_mangle)]
pub extern "C" fn epm_codec_encode(
    src: *const c_void,
    src_len: usize,
    dtype: u32,
    options: *const EpmCodecOptions,
    dst: *mut c_void,
    dst_capacity: usize,
    out: *mut EpmCodecInfo,
) -> EpmStatus {
    ffi_boundary! {
        let out = try_out!(out);
        let data = host_bytes(src, src_len, "src")?;
        let dtype = dtype_of(dtype)?;
        let p = codec::plan(data, dtype, &options_of(options)?)?;
        if let Ok(len) = p.outcome() {
            check_not_null!(dst);
            ensure!(
                dst_capacity >= len,
                InvalidArgument,
                "dst holds {dst_capacity} bytes; the encoded weight needs {len}"
            );
            let buf = host_bytes_mut(dst, len, data, "dst")?;
            p.encode_into(data, buf)?;
        }
        write_versioned(out, info_of_plan(&p, dtype, data.len()), "EpmCodecInfo")
    }
}

/// Validate a compressed weight: magic, format version, header fields,
/// stream layout, escape index and CRC-32 over the whole buffer. On success
/// `*out` describes it (`outcome` EPM_CODEC_CODED, `raw_bytes`, `ratio`, ...).
///
/// Ownership: `buf` is only read during the call. NULL: `buf` or `out` is
/// NULL_POINTER. Errors: INVALID_ARGUMENT for anything that is not an intact
/// format v1 buffer of exactly `len` bytes, with a message saying what
/// (truncated, checksum mismatch, unknown version, ...). `*out` is written
/// only on success. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_codec_validate(buf: *const c_void, len: usize, out: *mut EpmCodecInfo) -> EpmStatus {
    ffi_boundary! {
        let out = try_out!(out);
        let bytes = host_bytes(buf, len, "buf")?;
        let desc = codec::parse(bytes, 0)?;
        write_versioned(out, info_of_desc(&desc), "EpmCodecInfo")
    }
}

/// Validate `buf` (as `epm_codec_validate`) and decode it on the CPU into
/// `dst`, which must be exactly the raw size (`raw_bytes`). `threads`: 0 =
/// one per available core.
///
/// Ownership: `buf` is only read and `dst` only written during the call; they
/// must not overlap. NULL: `buf` or `dst` is NULL_POINTER. Errors:
/// INVALID_ARGUMENT for a buffer `epm_codec_validate` refuses, a `dst_len`
/// other than the raw size, or overlapping buffers; `dst` is then left
/// unwritten. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_codec_decode(
    buf: *const c_void,
    len: usize,
    dst: *mut c_void,
    dst_len: usize,
    threads: u32,
) -> EpmStatus {
    ffi_boundary! {
        let bytes = host_bytes(buf, len, "buf")?;
        check_not_null!(dst);
        let threads = EncodeOptions { threads: threads as usize, ..Default::default() }.thread_count();
        let desc = codec::parse(bytes, threads)?;
        desc.check_lengths(bytes.len(), dst_len)?;
        let out = host_bytes_mut(dst, dst_len, bytes, "dst")?;
        codec::decode_with(&desc, bytes, out, threads)
    }
}
