//! The weight codec's C API: encode a bf16/fp16 weight into a compressed
//! buffer the caller keeps (format v1 or v2, docs/RESIDENCY.md "Compressed weights:
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
    /// Format version to write: 0 = the smaller of v1 and v2 (default), 1 =
    /// v1 only (for readers built before v2).
    pub format_version: u32,
    /// v2's escape code width in bits, 1–4 (writes v2); 0 = the width giving
    /// the smallest buffer, or v1 where that is smaller (default 0).
    pub k2: u32,
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
    /// Format v2: exponents in neither table, stored as bytes (0 in v1).
    pub escapes3: u64,
    /// Format v2: escape code width in bits (0 in v1 and when raw).
    pub k2: u32,
    /// Reserved, 0.
    pub reserved: u32,
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
        format_version: 0,
        k2: 0,
    }
}

fn options_of(options: *const EpmCodecOptions) -> Result<EncodeOptions> {
    let o = if options.is_null() {
        default_options()
    } else {
        read_versioned(options, default_options(), "EpmCodecOptions")?
    };
    ensure!(o.k <= 4, InvalidArgument, "EpmCodecOptions.k = {} is not 0 (choose) or 1–4", o.k);
    ensure!(o.k2 <= 4, InvalidArgument, "EpmCodecOptions.k2 = {} is not 0 (choose) or 1–4", o.k2);
    let k2 = match (o.format_version, o.k2) {
        (0, 0) => None,
        (1, 0) => Some(0),
        (0, k2) => Some(k2),
        (1, k2) => bail!(InvalidArgument, "EpmCodecOptions.k2 = {k2} needs format v2, but format_version is 1"),
        (v, _) => bail!(InvalidArgument, "EpmCodecOptions.format_version = {v} is not 0 (the smaller) or 1 (v1 only)"),
    };
    Ok(EncodeOptions {
        threads: o.threads as usize,
        max_ratio: if o.max_ratio == 0.0 { EncodeOptions::default().max_ratio } else { o.max_ratio },
        min_bytes: usize::try_from(o.min_bytes).unwrap_or(usize::MAX),
        k: (o.k != 0).then_some(o.k),
        k2,
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
        format_version: d.version() as u32,
        values: d.values() as u64,
        raw_bytes: d.raw_len() as u64,
        encoded_bytes: d.compressed_len() as u64,
        escapes: d.escapes() as u64,
        ratio: d.ratio(),
        escapes3: d.escapes3() as u64,
        k2: d.k2(),
        reserved: 0,
    }
}

fn info_of_plan(p: &Plan, dtype: Dtype, raw_bytes: usize) -> EpmCodecInfo {
    match (p.desc(), p.outcome()) {
        (Some(d), _) => info_of_desc(d),
        (None, Err(r)) => info_of_raw(r, dtype, raw_bytes),
        (None, Ok(_)) => info_of_raw(RawReason::UnsupportedDtype, dtype, raw_bytes),
    }
}

fn info_of_raw(reason: RawReason, dtype: Dtype, raw_bytes: usize) -> EpmCodecInfo {
    let (outcome, ratio) = match reason {
        RawReason::TooSmall { .. } => (EPM_CODEC_RAW_TOO_SMALL, 1.0),
        RawReason::NoGain { ratio, .. } => (EPM_CODEC_RAW_NO_GAIN, ratio),
        RawReason::UnsupportedDtype => (EPM_CODEC_RAW_UNSUPPORTED_DTYPE, 1.0),
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
    ensure!(a + len <= b || b + src.len() <= a, InvalidArgument, "`{what}` overlaps the source buffer");
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
/// format v1 or v2 buffer of exactly `len` bytes, with a message saying what
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

/// `EpmCompressedWeight::dtype`: `data` is already a compressed buffer
/// (format v1 or v2, from `epm_codec_encode`).
pub const EPM_CODEC_DTYPE_ENCODED: u32 = 0;

/// A weight for `epm_residency_register_compressed`. Set `size =
/// sizeof(EpmCompressedWeight)`; fields are only ever added at the end.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct EpmCompressedWeight {
    /// `sizeof(EpmCompressedWeight)` as the caller compiled it.
    pub size: usize,
    /// The weight's bytes: a compressed buffer (`dtype`
    /// `EPM_CODEC_DTYPE_ENCODED`) or raw little-endian values of `dtype`.
    pub data: *const c_void,
    pub bytes: usize,
    /// `EPM_CODEC_DTYPE_ENCODED`, or `EPM_CODEC_DTYPE_BF16`, `_FP16` or
    /// `_OTHER` for raw values the manager encodes (`_OTHER` stays raw).
    pub dtype: u32,
    /// 0.
    pub reserved: u32,
    /// Encoder options for raw values (NULL: the defaults, as
    /// `epm_codec_options_default`); ignored for a compressed buffer.
    pub options: *const EpmCodecOptions,
}

/// A residency manager's device staging for compressed page-ins is this many
/// times its run size (the largest compressed weight the plan streams, or with
/// no plan the largest registered, at most 64 MiB; larger weights page in a
/// run at a time), filled as a circle; docs/RESIDENCY.md.
pub const EPM_DECODE_STAGING_BUFFERS: u32 = 2;
const _: () = assert!(EPM_DECODE_STAGING_BUFFERS as usize == crate::residency::DECODE_STAGING_BUFFERS);

/// `sizeof(EpmCompressedWeight)` in its first published version. Frozen.
pub const EPM_COMPRESSED_WEIGHT_SIZE_V1: usize = 40;
versioned!(EpmCompressedWeight, EPM_COMPRESSED_WEIGHT_SIZE_V1);
// SAFETY: integer fields and raw pointers, for which every bit pattern is a
// valid value; the pointers are checked before use like any C argument.
unsafe impl crate::ffi::args::VersionedInput for EpmCompressedWeight {}

/// Register a weight whose host copy is compressed (docs/RESIDENCY.md,
/// "Streaming compressed weights"): its page-ins copy the compressed bytes
/// to device staging and decode them into the weight's device memory, ordered
/// on the device like a copy (the acquiring stream waits; the host does not).
/// The weight takes its decoded size of the budget; device staging for the
/// compressed bytes, two buffers sized by the largest compressed weight the
/// plan streams (with no plan: registered; at most 64 MiB, larger weights
/// page in a buffer at a time), is reserved out of the budget
/// (`EpmResidencyStats.decode_staging_bytes`).
///
/// `weight->dtype` `EPM_CODEC_DTYPE_ENCODED`: `data` is a compressed buffer,
/// validated (header, layout, CRC-32) and copied into page-locked memory
/// epmem owns. Otherwise `data` holds raw values that epmem encodes (on
/// `options->threads` threads) into page-locked memory it owns; when the
/// codec keeps the weight raw (`*out_info` outcome `EPM_CODEC_RAW_*`: too
/// small, no gain, another dtype), it is registered raw over `data`, exactly
/// as `epm_residency_register_weight`. `*out_info` (optional: NULL is
/// allowed; else set its `size` first) says which, with the ratio.
///
/// Ownership: a compressed weight's `data` is only read during the call; a
/// weight registered raw is read on page-ins until it is unregistered (keep
/// it allocated and unmodified until then). NULL: `res` INVALID_HANDLE,
/// `weight`, `weight->data` or `out_weight` NULL_POINTER. Errors:
/// INVALID_ARGUMENT for a corrupt or truncated buffer (the message says
/// what: checksum mismatch, truncated, bad magic, ...), 0 bytes, an odd
/// length of 16-bit values, an unknown `dtype`, nonzero `reserved`, bad
/// options or a too-small `size`; OUT_OF_BUDGET when the decoded weight and
/// the staging do not fit the budget; ALL_IN_USE when reserving staging
/// needs memory held by acquired weights. `*out_weight` and `*out_info` are
/// written only on success. Threading: safe from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn epm_residency_register_compressed(
    res: *mut crate::ffi::residency::EpmResidency,
    weight: *const EpmCompressedWeight,
    out_weight: *mut crate::ffi::residency::EpmWeightId,
    out_info: *mut EpmCodecInfo,
) -> EpmStatus {
    ffi_boundary! {
        let res = try_handle!(res);
        let empty = EpmCompressedWeight {
            size: 0,
            data: std::ptr::null(),
            bytes: 0,
            dtype: EPM_CODEC_DTYPE_ENCODED,
            reserved: 0,
            options: std::ptr::null(),
        };
        let w = read_versioned(weight, empty, "weight")?;
        let out = try_out!(out_weight);
        ensure!(w.reserved == 0, InvalidArgument, "EpmCompressedWeight.reserved is {}, not 0", w.reserved);
        let (id, info) = if w.dtype == EPM_CODEC_DTYPE_ENCODED {
            let data = host_bytes(w.data, w.bytes, "weight->data")?;
            let id = res.register_compressed(data)?;
            // Described from the manager's own validated copy's header.
            let desc = codec::parse_header(data)?;
            (id, info_of_desc(&desc))
        } else {
            let dtype = dtype_of(w.dtype)?;
            let opts = options_of(w.options)?;
            let (p, n) = crate::ffi::args::host_range(w.data, w.bytes, "weight->data")?;
            // SAFETY: the C caller guarantees `bytes` readable bytes at
            // `data` for the call, and, for a weight kept raw, until it is
            // unregistered (documented above); checked non-NULL, not wrapping.
            let range = unsafe { crate::device::HostRange::new(p, n) };
            let r = res.register_encoded(range, dtype, &opts)?;
            let info = match (r.desc, r.raw) {
                (Some(d), _) => info_of_desc(&d),
                (None, Some(reason)) => info_of_raw(reason, dtype, n),
                (None, None) => return Err(crate::error::Error::internal("registered with neither outcome")),
            };
            (r.id, info)
        };
        if !out_info.is_null() {
            let info_out = try_out!(out_info);
            if let Err(e) = write_versioned(info_out, info, "EpmCodecInfo") {
                // The weight is registered; a bad `out_info` must not leak it.
                let _ = res.unregister(id);
                return Err(e);
            }
        }
        out.set(id.0);
        Ok(())
    }
}
