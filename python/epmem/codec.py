"""Lossless compression of bf16 and fp16 weights (epmem's codec, formats v1 and v2).

    import epmem.codec as codec
    buf, info = codec.encode(weight_bytes, "bf16")   # buf is None when kept raw
    info.ratio, info.outcome                         # e.g. 0.68, "coded"
    codec.validate(buf).raw_bytes                    # checksum and layout checked
    assert codec.decode(buf) == weight_bytes         # bit-exact, on the CPU

Inputs are any bytes-like object (bytes, bytearray, memoryview, array.array,
a contiguous numpy array or torch CPU tensor's buffer) holding little-endian
values; outputs are `bytes`. A weight the codec keeps raw is not an error:
`encode` returns `(None, info)` with `info.outcome` saying why
("raw_too_small", "raw_no_gain", "raw_unsupported_dtype"). Bad input raises
the `epmem.EpmError` subclass of its status, with epmem's message.
The format is documented in docs/RESIDENCY.md, "Compressed weights: the format".
"""

import ctypes
from dataclasses import dataclass

from . import _lib

DTYPES = {
    "bf16": _lib.EPM_CODEC_DTYPE_BF16, "bfloat16": _lib.EPM_CODEC_DTYPE_BF16,
    "fp16": _lib.EPM_CODEC_DTYPE_FP16, "float16": _lib.EPM_CODEC_DTYPE_FP16,
    "other": _lib.EPM_CODEC_DTYPE_OTHER,
}
_DTYPE_NAMES = {_lib.EPM_CODEC_DTYPE_BF16: "bf16", _lib.EPM_CODEC_DTYPE_FP16: "fp16",
                _lib.EPM_CODEC_DTYPE_OTHER: "other"}
_OUTCOMES = {_lib.EPM_CODEC_CODED: "coded", _lib.EPM_CODEC_RAW_TOO_SMALL: "raw_too_small",
             _lib.EPM_CODEC_RAW_NO_GAIN: "raw_no_gain",
             _lib.EPM_CODEC_RAW_UNSUPPORTED_DTYPE: "raw_unsupported_dtype"}


@dataclass(frozen=True)
class CodecInfo:
    """What an encode did (or would do), or what a compressed buffer holds."""
    outcome: str          # "coded" or a "raw_*" reason
    dtype: str            # "bf16", "fp16" or "other"
    k: int                # exponent code width in bits (0 when raw)
    format_version: int   # 1 or 2 (0 when raw)
    values: int
    raw_bytes: int
    encoded_bytes: int    # 0 when raw
    escapes: int
    ratio: float          # encoded / raw; for raw_no_gain the best found; 1.0 otherwise when raw
    k2: int = 0           # format v2: escape code width in bits (0 in v1 and when raw)
    escapes3: int = 0     # format v2: exponents in neither table, stored as bytes

    @property
    def coded(self):
        return self.outcome == "coded"


def _info(c):
    return CodecInfo(outcome=_OUTCOMES.get(c.outcome, f"unknown({c.outcome})"),
                     dtype=_DTYPE_NAMES.get(c.dtype, f"unknown({c.dtype})"), k=c.k,
                     format_version=c.format_version, values=c.values, raw_bytes=c.raw_bytes,
                     encoded_bytes=c.encoded_bytes, escapes=c.escapes, ratio=c.ratio,
                     k2=c.k2, escapes3=c.escapes3)


def _dtype(dtype):
    if isinstance(dtype, int):
        return dtype
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        raise ValueError(f"epmem.codec: dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def _address(data):
    """(address, length, keepalive) of a bytes-like object, without a copy
    where ctypes allows one (bytes, writable buffers)."""
    if isinstance(data, bytes):
        return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value, len(data), data
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise ValueError("epmem.codec: the buffer is not contiguous")
    mv = mv.cast("B")
    if mv.readonly:
        b = mv.tobytes()
        return ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value, len(b), b
    arr = (ctypes.c_char * len(mv)).from_buffer(mv)
    return ctypes.addressof(arr), len(mv), (arr, mv)


def _options(threads, max_ratio, min_bytes, k, format_version=0, k2=0):
    o = _lib.new(_lib.EpmCodecOptions)
    _lib.lib().epm_codec_options_default(ctypes.byref(o))
    o.threads, o.k, o.format_version, o.k2 = threads, k, format_version, k2
    if max_ratio is not None:
        o.max_ratio = max_ratio
    if min_bytes is not None:
        o.min_bytes = min_bytes
    return o


def plan(data, dtype, *, threads=0, max_ratio=None, min_bytes=None, k=0, format_version=0, k2=0):
    """What `encode` would do, without encoding: a CodecInfo (encoded_bytes is
    the size of the buffer it would return)."""
    addr, n, _keep = _address(data)
    info = _lib.new(_lib.EpmCodecInfo)
    o = _options(threads, max_ratio, min_bytes, k, format_version, k2)
    _lib.lib().epm_codec_plan(addr, n, _dtype(dtype), ctypes.byref(o), ctypes.byref(info))
    return _info(info)


def encode(data, dtype, *, threads=0, max_ratio=None, min_bytes=None, k=0, format_version=0, k2=0):
    """Encode a weight: `(bytes, CodecInfo)`, or `(None, CodecInfo)` when the
    codec keeps it raw (`info.outcome` says why). `max_ratio` (default 0.9)
    and `min_bytes` (default 1 MiB) are the thresholds below which a weight is
    worth encoding; `k` forces the exponent code width (0 = the best);
    `format_version=1` writes format v1 only (for readers built before v2),
    `k2` forces v2's escape code width (0 = the best, or v1 where smaller)."""
    addr, n, _keep = _address(data)
    lib = _lib.lib()
    o = _options(threads, max_ratio, min_bytes, k, format_version, k2)
    info = _lib.new(_lib.EpmCodecInfo)
    dt = _dtype(dtype)
    lib.epm_codec_plan(addr, n, dt, ctypes.byref(o), ctypes.byref(info))
    if info.outcome != _lib.EPM_CODEC_CODED:
        return None, _info(info)
    out = ctypes.create_string_buffer(info.encoded_bytes)
    lib.epm_codec_encode(addr, n, dt, ctypes.byref(o), out, info.encoded_bytes, ctypes.byref(info))
    return out.raw[:info.encoded_bytes], _info(info)


def validate(buf):
    """Check a compressed buffer (layout, escape index, CRC-32) and describe it."""
    addr, n, _keep = _address(buf)
    info = _lib.new(_lib.EpmCodecInfo)
    _lib.lib().epm_codec_validate(addr, n, ctypes.byref(info))
    return _info(info)


def decode(buf, *, threads=0):
    """Validate and decode a compressed buffer on the CPU: the raw weight as bytes."""
    info = validate(buf)
    addr, n, _keep = _address(buf)
    out = ctypes.create_string_buffer(info.raw_bytes)
    _lib.lib().epm_codec_decode(addr, n, out, info.raw_bytes, threads)
    return out.raw[:info.raw_bytes]
