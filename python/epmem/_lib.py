"""ctypes declarations of include/epmem.h: every function once; the structs
read from the header itself.

Nothing here is compiled: the library is loaded with ctypes from
`epmem.get_library_path()`, and the struct layouts are parsed from the epmem.h
the wheel bundles (`header_path()`). tests/python/test_binding.py checks every
struct's size and field offsets against the header (by compiling a C program
generated from these classes) and that every `epm_*` function the header
declares has a line in FUNCTIONS below.

Adding a C function is one line in FUNCTIONS: (name, restype, argtypes).
A function whose restype is STATUS raises the EpmError subclass of its status
(see errors.py) instead of returning it.
"""

import ctypes
import os
import re
import threading
from ctypes import (
    CFUNCTYPE, POINTER, Structure, c_bool, c_char, c_char_p, c_double, c_float, c_int,
    c_size_t, c_uint8, c_uint32, c_uint64, c_void_p,
)

from . import errors

# ---- constants (checked against the header's #defines by the tests) ----------

EPM_DEVICE_NAME_LEN = 256
EPM_PCI_BUS_ID_LEN = 32
EPM_EVENT_TIMING = 1
EPM_KV_ADMIT_PROMISE = 0
EPM_KV_ADMIT_ON_DEMAND = 1
EPM_POLICY_CYCLIC = 0
EPM_POLICY_LRU = 1
EPM_REGISTER_WITHIN_MEMLOCK = 0
EPM_REGISTER_NEVER = 1
EPM_REGISTER_ALWAYS = 2
EPM_FILL_AHEAD_ALL_SLOTS = 0xFFFFFFFF
EPM_COPY_ENGINE_NO_TIMING = 1
EPM_COPY_ENGINE_NO_DIRECT = 2
EPM_COPY_ENGINE_NO_SPLIT_TAIL = 4
EPM_COPY_ENGINE_NO_STREAMING_STORES = 8
EPM_VERSION_MAJOR = 0
EPM_VERSION_MINOR = 1
EPM_VERSION_PATCH = 0
EPM_VERSION = (EPM_VERSION_MAJOR << 16) | (EPM_VERSION_MINOR << 8) | EPM_VERSION_PATCH
EPM_KV_BATCH_ANY_SLOT = 0xFFFFFFFF
EPM_KV_NAMESPACE_MAX_BYTES = 128  # the longest namespace of the *_ns functions
EPM_CODEC_DTYPE_BF16 = 1
EPM_CODEC_DTYPE_FP16 = 2
EPM_CODEC_DTYPE_OTHER = 3
EPM_CODEC_CODED = 1
EPM_CODEC_RAW_TOO_SMALL = 2
EPM_CODEC_RAW_NO_GAIN = 3
EPM_CODEC_RAW_UNSUPPORTED_DTYPE = 4
EPM_CODEC_DTYPE_ENCODED = 0
EPM_DECODE_STAGING_BUFFERS = 2

# The first published size of each versioned struct: the smallest `size`
# epmem accepts (never sizeof today's struct, which may have grown).
EPM_ARENA_CONFIG_SIZE_V1 = 32
EPM_ARENA_STATS_SIZE_V1 = 88
EPM_DEVICE_INFO_SIZE_V1 = 336
EPM_KV_LAYOUT_SIZE_V1 = 56
EPM_KV_STATS_SIZE_V1 = 176
EPM_KV_SEQ_INFO_SIZE_V1 = 112
EPM_KV_PREFIX_INFO_SIZE_V1 = 40
EPM_KV_ADMISSION_SIZE_V1 = 32
EPM_KV_REQUEST_COST_SIZE_V1 = 32
EPM_KV_BATCH_DESC_SIZE_V1 = 104
EPM_KV_BATCH_SLOT_INFO_SIZE_V1 = 72
EPM_RESIDENCY_CONFIG_SIZE_V1 = 72
EPM_RESIDENCY_STATS_SIZE_V1 = 288
EPM_COPY_ENGINE_CONFIG_SIZE_V1 = 32
EPM_STAGING_STATS_SIZE_V1 = 112
EPM_CODEC_OPTIONS_SIZE_V1 = 32
EPM_CODEC_INFO_SIZE_V1 = 64
EPM_COMPRESSED_WEIGHT_SIZE_V1 = 40

EPM_STATUS_OK = 0

EPM_DEVICE_KIND_CUDA = 1
EPM_DEVICE_KIND_HOST = 2

EPM_LOG_LEVEL_OFF = 0
EPM_LOG_LEVEL_ERROR = 1
EPM_LOG_LEVEL_WARN = 2
EPM_LOG_LEVEL_INFO = 3
EPM_LOG_LEVEL_DEBUG = 4
EPM_LOG_LEVEL_TRACE = 5

# Names the tests compare with the header (enum values and #defines alike).
CONSTANTS = [n for n in list(globals()) if n.startswith("EPM_")]

# ---- scalar typedefs ------------------------------------------------------------

EpmDevicePtr = c_uint64
EpmWeightId = c_uint32
EpmHostRangeId = c_uint32
EpmLogCallback = CFUNCTYPE(None, c_void_p, c_int, c_char_p)

# Opaque handles travel as void*.
HANDLE = c_void_p
OUT_HANDLE = POINTER(c_void_p)


# ---- structs: read from the header, their one declaration ----------------------
#
# Each struct's ctypes layout is built from its `typedef struct EpmX { ... }`
# in epmem.h (generated from src/ffi), so a field added there needs no edit
# here. tests/python/test_binding.py compiles a C program that prints every
# sizeof/offsetof and compares them with these classes.


def header_path():
    """The epmem.h this package describes: $EPMEM_HEADER, else the copy the
    wheel bundles (epmem/include/epmem.h), else the source tree's
    include/epmem.h."""
    env = os.environ.get("EPMEM_HEADER")
    if env:
        return os.path.abspath(env)
    here = os.path.dirname(os.path.abspath(__file__))
    for p in (os.path.join(here, "include", "epmem.h"), os.path.join(here, "..", "..", "include", "epmem.h")):
        if os.path.isfile(p):
            return os.path.normpath(p)
    raise OSError(f"epmem: no epmem.h next to the package ({here}/include) or in a source tree; set EPMEM_HEADER")


# C field types of the header's structs and their ctypes.
C_TYPES = {
    "size_t": c_size_t, "uint64_t": c_uint64, "uint32_t": c_uint32, "uint8_t": c_uint8, "int": c_int,
    "double": c_double, "float": c_float, "bool": c_bool, "char": c_char,
    "EpmDevicePtr": EpmDevicePtr, "EpmWeightId": EpmWeightId, "EpmHostRangeId": EpmHostRangeId,
}


def parse_structs(text):
    """{name: [(field, ctype), ...]} of every `typedef struct EpmX { ... } EpmX;`
    in header `text`. Enum fields are C ints; array bounds are numbers or the
    header's #defines. A field of a type not in C_TYPES raises ValueError (a
    struct is read whole or not at all)."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    defines = {m.group(1): int(m.group(2), 0) for m in re.finditer(r"^#define (EPM_\w+) (0x[0-9A-Fa-f]+|\d+)\s*$", text, re.M)}
    out = {}
    for m in re.finditer(r"typedef struct (Epm\w+) \{(.*?)\} (\w+);", text, re.S):
        name, body = m.group(1), m.group(2)
        if m.group(3) != name:
            raise ValueError(f"typedef struct {name} {{...}} {m.group(3)}: names differ")
        fields = []
        for decl in (d.strip() for d in body.split(";")):
            if not decl:
                continue
            # A pointer field (any pointee, `const` or not) is a void pointer.
            p = re.fullmatch(r"(?:const )?[\w ]*?\w\s*\*\s*(\w+)", decl)
            if p:
                fields.append((p.group(1), c_void_p))
                continue
            f = re.fullmatch(r"(enum \w+|[\w ]*?\w)\s+(\w+)(?:\[(\w+)\])?", decl)
            if not f:
                raise ValueError(f"{name}: cannot read field `{decl}`")
            ctype, field, bound = f.groups()
            if ctype.startswith("enum "):
                t = c_int
            elif ctype in C_TYPES:
                t = C_TYPES[ctype]
            else:
                raise ValueError(f"{name}.{field}: C type `{ctype}` has no ctypes equivalent in C_TYPES")
            if bound is not None:
                n = int(bound) if bound.isdigit() else defines.get(bound)
                if n is None:
                    raise ValueError(f"{name}.{field}: array bound {bound} is not a #define of the header")
                t = t * n
            fields.append((field, t))
        out[name] = fields
    return out


with open(header_path(), encoding="utf-8") as _h:
    HEADER_STRUCTS = parse_structs(_h.read())


def header_struct(name):
    """A ctypes Structure class with the fields of `name` in the header."""
    if name not in HEADER_STRUCTS:
        raise ValueError(f"epmem: struct {name} is not in {header_path()}")
    return type(name, (Structure,), {"_fields_": HEADER_STRUCTS[name], "__module__": __name__})


EpmArenaConfig = header_struct("EpmArenaConfig")
EpmArenaStats = header_struct("EpmArenaStats")
EpmDeviceInfo = header_struct("EpmDeviceInfo")
EpmKvLayout = header_struct("EpmKvLayout")
EpmKvStats = header_struct("EpmKvStats")

_LAYOUT_FIELDS = [f for f in EpmKvLayout._fields_ if f[0] != "size"]


class EpmKvSeqInfo(header_struct("EpmKvSeqInfo")):
    # The layout's fields are flat (a versioned struct is never embedded by
    # value in another); `.layout` rebuilds an EpmKvLayout from them.

    @property
    def layout(self):
        return new(EpmKvLayout, **{n: getattr(self, n) for n, _ in _LAYOUT_FIELDS})


EpmKvPrefixInfo = header_struct("EpmKvPrefixInfo")
EpmKvAdmission = header_struct("EpmKvAdmission")
EpmKvRequestCost = header_struct("EpmKvRequestCost")
EpmKvBatchDesc = header_struct("EpmKvBatchDesc")
EpmKvBatchSlotInfo = header_struct("EpmKvBatchSlotInfo")


EpmResidencyConfig = header_struct("EpmResidencyConfig")
EpmResidencyStats = header_struct("EpmResidencyStats")


EpmStagingStats = header_struct("EpmStagingStats")
EpmCopyEngineConfig = header_struct("EpmCopyEngineConfig")


STRUCTS = [EpmArenaConfig, EpmArenaStats, EpmDeviceInfo, EpmKvLayout, EpmKvStats, EpmKvSeqInfo,
           EpmKvPrefixInfo, EpmKvAdmission, EpmKvRequestCost, EpmKvBatchDesc, EpmKvBatchSlotInfo,
           EpmResidencyConfig, EpmResidencyStats,
           EpmStagingStats, EpmCopyEngineConfig]

EpmCodecOptions = header_struct("EpmCodecOptions")
EpmCodecInfo = header_struct("EpmCodecInfo")

class EpmCompressedWeight(Structure):
    _fields_ = [("size", c_size_t), ("data", c_void_p), ("bytes", c_size_t), ("dtype", c_uint32),
                ("reserved", c_uint32), ("options", POINTER(EpmCodecOptions))]


STRUCTS += [EpmCodecOptions, EpmCodecInfo, EpmCompressedWeight]


def new(struct_type, **fields):
    """A zeroed struct with `size` set to its size, then `fields`."""
    s = struct_type()
    s.size = ctypes.sizeof(struct_type)
    for k, v in fields.items():
        setattr(s, k, v)
    return s


def to_dict(s):
    """A struct's fields (less `size`) as a dict; nested structs and char arrays converted."""
    out = {}
    for name, _ in s._fields_:
        if name == "size":
            continue
        v = getattr(s, name)
        if isinstance(v, Structure):
            v = to_dict(v)
        elif isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        out[name] = v
    return out


# ---- functions --------------------------------------------------------------------

STATUS = "status"  # restype marker: c_int, raising on a non-OK status
P = POINTER
u32, u64, size_t, vp = c_uint32, c_uint64, c_size_t, c_void_p
H, OH = HANDLE, OUT_HANDLE

FUNCTIONS = [
    # arena
    ("epm_arena_config_default", STATUS, [P(EpmArenaConfig)]),
    ("epm_arena_create_device", STATUS, [H, P(EpmArenaConfig), OH]),
    ("epm_arena_create_pinned", STATUS, [H, P(EpmArenaConfig), OH]),
    ("epm_arena_alloc", STATUS, [H, size_t, size_t, P(u64)]),
    ("epm_arena_free", STATUS, [H, u64]),
    ("epm_arena_trim", STATUS, [H, P(u64)]),
    ("epm_arena_get_stats", STATUS, [H, P(EpmArenaStats)]),
    ("epm_arena_destroy", STATUS, [H]),
    # device
    ("epm_device_open", STATUS, [u32, OH]),
    ("epm_device_open_select", STATUS, [c_char_p, u32, OH]),
    ("epm_device_get_info", STATUS, [H, P(EpmDeviceInfo)]),
    ("epm_device_mem_info", STATUS, [H, P(u64), P(u64)]),
    ("epm_device_synchronize", STATUS, [H]),
    ("epm_device_destroy", STATUS, [H]),
    ("epm_device_alloc", STATUS, [H, size_t, P(EpmDevicePtr)]),
    ("epm_device_free", STATUS, [H, EpmDevicePtr]),
    ("epm_memcpy_htod", STATUS, [H, EpmDevicePtr, vp, size_t]),
    ("epm_memcpy_dtoh", STATUS, [H, vp, EpmDevicePtr, size_t]),
    ("epm_memcpy_htod_async", STATUS, [H, EpmDevicePtr, vp, size_t, H]),
    ("epm_memcpy_dtoh_async", STATUS, [H, vp, EpmDevicePtr, size_t, H]),
    ("epm_memcpy_dtod_async", STATUS, [H, EpmDevicePtr, EpmDevicePtr, size_t, H]),
    ("epm_memset_d8_async", STATUS, [H, EpmDevicePtr, c_uint8, size_t, H]),
    # events and streams
    ("epm_event_create", STATUS, [H, u32, OH]),
    ("epm_event_record", STATUS, [H, H]),
    ("epm_event_query", STATUS, [H]),
    ("epm_event_synchronize", STATUS, [H]),
    ("epm_event_elapsed_ms", STATUS, [H, H, P(c_float)]),
    ("epm_event_destroy", STATUS, [H]),
    ("epm_stream_create", STATUS, [H, OH]),
    ("epm_stream_wrap_native", STATUS, [H, vp, OH]),
    ("epm_stream_native", STATUS, [H, P(vp)]),
    ("epm_stream_synchronize", STATUS, [H]),
    ("epm_stream_wait_event", STATUS, [H, H]),
    ("epm_stream_destroy", STATUS, [H]),
    # kv
    ("epm_kv_layout_token_major", STATUS, [u32, u32, u32, u32, P(EpmKvLayout)]),
    ("epm_kv_pool_create", STATUS, [H, u64, OH]),
    ("epm_kv_pool_destroy", STATUS, [H]),
    ("epm_kv_pool_get_stats", STATUS, [H, P(EpmKvStats)]),
    ("epm_kv_seq_create", STATUS, [H, P(EpmKvLayout), u64, u32, OH]),
    ("epm_kv_seq_create_for_tokens", STATUS, [H, P(EpmKvLayout), u64, P(u32), size_t, u32, OH, P(u64)]),
    ("epm_kv_seq_destroy", STATUS, [H]),
    ("epm_kv_seq_get_info", STATUS, [H, P(EpmKvSeqInfo)]),
    ("epm_kv_seq_prepare_append", STATUS, [H, u64, H]),
    ("epm_kv_seq_declare_tokens", STATUS, [H, P(u32), size_t]),
    ("epm_kv_prefix_pin", STATUS, [H, u64, H, OH]),
    ("epm_kv_prefix_unpin", STATUS, [H]),
    ("epm_kv_prefix_get_info", STATUS, [H, P(EpmKvPrefixInfo)]),
    ("epm_kv_commit_shared_prefix", STATUS, [H, u64, u64, u32, OH]),
    ("epm_kv_find_prefix", STATUS, [H, P(EpmKvLayout), P(u32), size_t, P(u64)]),
    ("epm_kv_admissible", STATUS, [u64, u64, u64, P(EpmKvAdmission)]),
    ("epm_kv_request_cost", STATUS, [H, P(EpmKvLayout), u64, u64, P(EpmKvRequestCost)]),
    ("epm_kv_batch_create", STATUS, [H, P(EpmKvLayout), u64, u32, OH]),
    ("epm_kv_batch_destroy", STATUS, [H]),
    ("epm_kv_batch_get_desc", STATUS, [H, P(EpmKvBatchDesc)]),
    ("epm_kv_batch_take_slot", STATUS, [H, u32, u32, OH]),
    ("epm_kv_batch_take_shared_slot", STATUS, [H, u32, H, u64, u32, H, OH]),
    ("epm_kv_batch_take_slot_for_tokens", STATUS, [H, u32, P(u32), size_t, u32, H, OH, P(u64)]),
    ("epm_kv_batch_release_slot", STATUS, [H, H]),
    ("epm_kv_batch_slot_get_info", STATUS, [H, P(EpmKvBatchSlotInfo)]),
    # logging
    ("epm_set_log_callback", STATUS, [EpmLogCallback, vp, u32]),
    # residency
    ("epm_residency_config_default", STATUS, [P(EpmResidencyConfig)]),
    ("epm_residency_create", STATUS, [H, P(EpmResidencyConfig), OH]),
    ("epm_residency_destroy", STATUS, [H]),
    ("epm_residency_register_weight", STATUS, [H, vp, size_t, P(EpmWeightId)]),
    ("epm_residency_unregister_weight", STATUS, [H, EpmWeightId]),
    ("epm_residency_register_host_range", STATUS, [H, vp, size_t, P(EpmHostRangeId)]),
    ("epm_residency_unregister_host_range", STATUS, [H, EpmHostRangeId]),
    ("epm_residency_declare_cycle", STATUS, [H, P(EpmWeightId), size_t]),
    ("epm_residency_prefetch", STATUS, [H, P(EpmWeightId), size_t, P(size_t)]),
    ("epm_residency_acquire", STATUS, [H, EpmWeightId, H, P(EpmDevicePtr)]),
    ("epm_residency_release", STATUS, [H, EpmWeightId, H]),
    ("epm_residency_acquire_host", STATUS, [H, EpmWeightId, P(EpmDevicePtr)]),
    ("epm_residency_release_host", STATUS, [H, EpmWeightId]),
    ("epm_residency_synchronize", STATUS, [H]),
    ("epm_residency_get_stats", STATUS, [H, P(EpmResidencyStats)]),
    # one host registration shared by several devices (docs/RESIDENCY.md, "Several devices")
    ("epm_shared_host_registration_create", STATUS, [H, vp, size_t, OH]),
    ("epm_shared_host_registration_destroy", STATUS, [H]),
    ("epm_residency_attach_host_registration", STATUS, [H, H, P(EpmHostRangeId)]),
    # staging pool, copy engine, fences
    ("epm_staging_pool_create", STATUS, [H, size_t, size_t, OH]),
    ("epm_staging_pool_trim", STATUS, [H, P(size_t)]),
    ("epm_staging_pool_get_stats", STATUS, [H, P(EpmStagingStats)]),
    ("epm_staging_pool_destroy", STATUS, [H]),
    ("epm_copy_engine_config_default", STATUS, [P(EpmCopyEngineConfig)]),
    ("epm_copy_engine_create", STATUS, [H, P(EpmCopyEngineConfig), OH]),
    ("epm_copy_engine_htod", STATUS, [H, EpmDevicePtr, vp, size_t, H, OH]),
    ("epm_copy_engine_register", STATUS, [H, vp, size_t, OH]),
    ("epm_host_registration_destroy", STATUS, [H]),
    ("epm_copy_engine_synchronize", STATUS, [H]),
    ("epm_copy_engine_get_stats", STATUS, [H, P(EpmStagingStats)]),
    ("epm_copy_engine_destroy", STATUS, [H]),
    ("epm_fence_query", STATUS, [H]),
    ("epm_fence_wait", STATUS, [H]),
    ("epm_fence_stream_wait", STATUS, [H, H]),
    ("epm_fence_destroy", STATUS, [H]),
    # the weight codec (docs/RESIDENCY.md, "Compressed weights: the format")
    ("epm_codec_options_default", STATUS, [P(EpmCodecOptions)]),
    ("epm_codec_plan", STATUS, [vp, size_t, u32, P(EpmCodecOptions), P(EpmCodecInfo)]),
    ("epm_codec_encode", STATUS, [vp, size_t, u32, P(EpmCodecOptions), vp, size_t, P(EpmCodecInfo)]),
    ("epm_codec_validate", STATUS, [vp, size_t, P(EpmCodecInfo)]),
    ("epm_codec_decode", STATUS, [vp, size_t, vp, size_t, u32]),
    ("epm_residency_register_compressed", STATUS,
     [H, P(EpmCompressedWeight), P(EpmWeightId), P(EpmCodecInfo)]),
    # errors and version (never fail)
    ("epm_last_error_message", c_char_p, []),
    ("epm_status_name", c_char_p, [c_int]),
    ("epm_version", u32, []),
    ("epm_version_string", c_char_p, []),
]

# KV sharing namespaces (per-tenant cache salts, docs/KV.md "Namespaces"): the
# `*_ns` variants of the content lookups. `ns` is (bytes, length), no NUL.
FUNCTIONS += [
    ("epm_kv_seq_create_for_tokens_ns", STATUS,
     [H, P(EpmKvLayout), u64, c_char_p, size_t, P(u32), size_t, u32, OH, P(u64)]),
    ("epm_kv_find_prefix_ns", STATUS, [H, P(EpmKvLayout), c_char_p, size_t, P(u32), size_t, P(u64)]),
    ("epm_kv_batch_take_slot_for_tokens_ns", STATUS,
     [H, u32, c_char_p, size_t, P(u32), size_t, u32, H, OH, P(u64)]),
]

# include/epmem_testing.h: exported only by the testing build of the library
# (cargo build --features testing: target/testing/release/libepmem_testing.so,
# .carry/lib-testing/ on the GPU machine). Bound when the loaded library has
# them; `epmem.testing` raises TestingUnavailable otherwise.
TESTING_FUNCTIONS = [
    ("epm_device_checksum_async", STATUS, [H, EpmDevicePtr, size_t, H, EpmDevicePtr]),
    ("epm_checksum_host", u64, [vp, size_t]),
    ("epm_device_spin_async", STATUS, [H, u32, H]),
    ("epm_testing_panic_device", STATUS, [H]),
    ("epm_testing_panic_residency", STATUS, [H]),
    ("epm_testing_panic_kv_pool", STATUS, [H]),
    ("epm_device_hold_async", STATUS, [H, H, OH]),
    ("epm_gate_open", STATUS, [H]),
    ("epm_gate_destroy", STATUS, [H]),
]


_TESTING_NAMES = frozenset(n for n, _, _ in TESTING_FUNCTIONS)


class _Lib:
    """The loaded library: each FUNCTIONS entry as an attribute (`lib.epm_device_open`)."""

    def __init__(self, path):
        self.path = path
        self.cdll = ctypes.CDLL(path)
        self.missing = []
        self.testing_missing = []
        for name, restype, argtypes in FUNCTIONS + TESTING_FUNCTIONS:
            try:
                fn = getattr(self.cdll, name)
            except AttributeError:
                # An older library (or, for TESTING_FUNCTIONS, the release
                # build): the binding stays usable for what it has; calling
                # the missing function raises AttributeError by name.
                (self.testing_missing if name in _TESTING_NAMES else self.missing).append(name)
                continue
            fn.argtypes = argtypes
            if restype is STATUS:
                fn.restype = c_int
                fn.errcheck = self._check
            else:
                fn.restype = restype
            setattr(self, name, fn)

    @property
    def has_testing(self):
        """Whether this is the testing build (every include/epmem_testing.h function)."""
        return not self.testing_missing

    def _check(self, result, func, args):
        if result != 0:
            # Read the message first: it is thread-local and valid until the
            # next epm_* call on this thread (epm_status_name does not reset it).
            msg = self.cdll.epm_last_error_message()
            name = self.cdll.epm_status_name(result)
            raise errors.from_status(result, name.decode() if name else "?",
                                     msg.decode("utf-8", "replace") if msg else "", func.__name__)
        return result


_loaded = None
_lock = threading.Lock()


def library_path():
    env = os.environ.get("EPMEM_LIB")
    if env:
        return os.path.abspath(env)
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib", "libepmem.so")


def lib():
    """The library, loaded on first use from `library_path()`."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                path = library_path()
                if not os.path.isfile(path):
                    raise OSError(f"epmem: no library at {path} (build the wheel with `make wheel`, "
                                  "or set EPMEM_LIB to a libepmem.so)")
                _loaded = _Lib(path)
    return _loaded


# ---- the stream-ordered arena and PyTorch's allocator (src/ffi/ordered_arena.rs, torch.rs) ----

EPM_ORDERED_ARENA_STATS_SIZE_V1 = 216
CONSTANTS.append("EPM_ORDERED_ARENA_STATS_SIZE_V1")


EpmOrderedArenaStats = header_struct("EpmOrderedArenaStats")

STRUCTS.append(EpmOrderedArenaStats)

FUNCTIONS += [
    ("epm_ordered_arena_create", STATUS, [H, P(EpmArenaConfig), OH]),
    ("epm_ordered_arena_alloc", STATUS, [H, size_t, H, P(u64)]),
    ("epm_ordered_arena_free", STATUS, [H, u64, H]),
    ("epm_ordered_arena_trim", STATUS, [H, P(u64)]),
    ("epm_ordered_arena_get_stats", STATUS, [H, P(EpmOrderedArenaStats)]),
    ("epm_ordered_arena_destroy", STATUS, [H]),
    # PyTorch's CUDAPluggableAllocator functions: no status (NULL / nothing
    # freed on failure, the reason in epm_last_error_message()).
    ("epm_torch_alloc", vp, [ctypes.c_ssize_t, c_int, vp]),
    ("epm_torch_free", None, [vp, ctypes.c_ssize_t, c_int, vp]),
    ("epm_torch_set_capacity", STATUS, [u64]),
    ("epm_torch_get_stats", STATUS, [c_int, P(EpmOrderedArenaStats)]),
    ("epm_torch_trim", STATUS, [c_int, P(u64)]),
]
