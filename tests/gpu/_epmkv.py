"""Plain-ctypes bindings of epmem's KV arena and batch API (include/epmem.h),
for the GPU scripts tests/gpu/kv_batch_attention.py and scripts/bench_kv_batch.py.

Deliberately independent of the `epmem` Python package (written concurrently):
only ctypes and the C header's layout. The library is $EPMEM_LIB (default
.carry/lib/libepmem.so). Every failing call raises EpmError with the status
name and epm_last_error_message().
"""

import ctypes as C
import os

u32, u64, sz, vp = C.c_uint32, C.c_uint64, C.c_size_t, C.c_void_p

EPM_KV_ADMIT_RESERVE = 0
EPM_KV_ADMIT_ON_DEMAND = 1
EPM_KV_BATCH_ANY_SLOT = 0xFFFFFFFF
EPM_KV_BATCH_DESC_SIZE_V1 = 104
EPM_KV_BATCH_SLOT_INFO_SIZE_V1 = 72


class EpmError(RuntimeError):
    def __init__(self, call, status, name, msg):
        super().__init__(f"{call}: {name} ({status}): {msg}")
        self.status, self.name = status, name


class Versioned(C.Structure):
    def __init__(self):
        super().__init__()
        self.size = C.sizeof(self)


class KvLayout(Versioned):
    _fields_ = [("size", sz), ("layers", u32), ("kv_heads", u32), ("head_dim", u32), ("elem_bytes", u32),
                ("token_stride", u64), ("layer_stride", u64), ("kv_stride", u64), ("head_stride", u64)]


class KvStats(Versioned):
    _fields_ = [("size", sz)] + [(n, u64) for n in (
        "budget_bytes owned_bytes promised_bytes peak_owned_bytes owned_granules charges credits refusals "
        "granule_bytes pool_created pool_released pool_reused pool_retained sequences prefixes pinned_prefixes "
        "mapped_bytes cow_granules committed_granules fences hash_hits").split()]


class BatchDesc(Versioned):
    _fields_ = [("size", sz), ("base", u64), ("slot_stride", u64), ("max_slots", u32), ("layers", u32),
                ("max_tokens", u64), ("token_stride", u64), ("layer_stride", u64), ("kv_stride", u64),
                ("head_stride", u64), ("kv_heads", u32), ("head_dim", u32), ("elem_bytes", u32),
                ("live_slots", u32), ("granule_bytes", u64), ("reserved_bytes", u64)]


class SlotInfo(Versioned):
    _fields_ = [("size", sz), ("base", u64), ("len_tokens", u64), ("committed_tokens", u64), ("max_tokens", u64),
                ("shared_granules", u64), ("private_granules", u64), ("promised_granules", u64),
                ("slot", u32), ("max_slots", u32)]


assert C.sizeof(BatchDesc) == EPM_KV_BATCH_DESC_SIZE_V1
assert C.sizeof(SlotInfo) == EPM_KV_BATCH_SLOT_INFO_SIZE_V1

# name: argument types (every function returns EpmStatus)
_SIGS = {
    "epm_device_open": [u32, C.POINTER(vp)],
    "epm_device_destroy": [vp],
    "epm_stream_create": [vp, C.POINTER(vp)],
    "epm_stream_wrap_native": [vp, vp, C.POINTER(vp)],
    "epm_stream_destroy": [vp],
    "epm_kv_layout_token_major": [u32, u32, u32, u32, C.POINTER(KvLayout)],
    "epm_kv_arena_create": [vp, u64, C.POINTER(vp)],
    "epm_kv_arena_destroy": [vp],
    "epm_kv_arena_get_stats": [vp, C.POINTER(KvStats)],
    "epm_kv_seq_prepare_append": [vp, u64, vp],
    "epm_kv_seq_destroy": [vp],
    "epm_kv_prefix_pin": [vp, u64, vp, C.POINTER(vp)],
    "epm_kv_prefix_unpin": [vp],
    "epm_kv_batch_create": [vp, C.POINTER(KvLayout), u64, u32, C.POINTER(vp)],
    "epm_kv_batch_destroy": [vp],
    "epm_kv_batch_get_desc": [vp, C.POINTER(BatchDesc)],
    "epm_kv_batch_take_slot": [vp, u32, u32, C.POINTER(vp)],
    "epm_kv_batch_take_shared_slot": [vp, u32, vp, u64, u32, vp, C.POINTER(vp)],
    "epm_kv_batch_release_slot": [vp, vp],
    "epm_kv_batch_slot_get_info": [vp, C.POINTER(SlotInfo)],
}


class Lib:
    """The C functions as methods; each raises EpmError on a non-OK status."""

    def __init__(self, path=None):
        path = path or os.environ.get("EPMEM_LIB", ".carry/lib/libepmem.so")
        self.dll = C.CDLL(path)
        self.dll.epm_last_error_message.restype = C.c_char_p
        self.dll.epm_last_error_message.argtypes = []
        self.dll.epm_status_name.restype = C.c_char_p
        self.dll.epm_status_name.argtypes = [C.c_int]
        for name, args in _SIGS.items():
            f = getattr(self.dll, name)
            f.argtypes, f.restype = args, C.c_int

    def __getattr__(self, name):
        f = getattr(self.dll, "epm_" + name)

        def call(*args):
            st = f(*args)
            if st != 0:
                msg = self.dll.epm_last_error_message().decode(errors="replace")
                raise EpmError(name, st, self.dll.epm_status_name(st).decode(), msg)
        return call

    def out(self, name, *args):
        """Call a function whose last argument is a handle out-param; return the handle."""
        h = vp()
        getattr(self, name)(*args, C.byref(h))
        return h

    def stats(self, arena):
        s = KvStats()
        self.kv_arena_get_stats(arena, C.byref(s))
        return s

    def desc(self, batch):
        d = BatchDesc()
        self.kv_batch_get_desc(batch, C.byref(d))
        return d

    def slot_info(self, seq):
        i = SlotInfo()
        self.kv_batch_slot_get_info(seq, C.byref(i))
        return i

    def layout(self, layers, kv_heads, head_dim, elem_bytes):
        lay = KvLayout()
        self.kv_layout_token_major(layers, kv_heads, head_dim, elem_bytes, C.byref(lay))
        return lay


class CudaArray:
    """A device range as __cuda_array_interface__ (v3), strides in bytes."""

    def __init__(self, ptr, shape, strides, typestr="<i2"):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "strides": tuple(strides), "typestr": typestr,
            "data": (int(ptr), False), "version": 3,
        }


def batch_view(torch, d):
    """The whole batch as one bf16 tensor [max_slots, max_tokens, layers, 2, heads, head_dim]."""
    e = d.elem_bytes
    assert e == 2, "bf16 through an int16 view"
    shape = (d.max_slots, d.max_tokens, d.layers, 2, d.kv_heads, d.head_dim)
    strides = (d.slot_stride, d.token_stride, d.layer_stride, d.kv_stride, d.head_stride, e)
    t = torch.as_tensor(CudaArray(d.base, shape, strides), device="cuda")
    return t.view(torch.bfloat16)
