"""Python objects over the C handles: each destroys itself (close(), `with`,
or garbage collection), and each keeps the objects it was made from alive.

The C library already keeps a device alive while anything made from it
lives, so destroying in any order is safe; the Python references exist so a
child never outlives memory a parent object owns on the Python side (a host
buffer, a log callback).
"""

import atexit
import ctypes
from ctypes import byref, c_float, c_size_t, c_uint32, c_uint64, c_void_p

from . import _lib as L
from . import errors


def _l():
    return L.lib()


def host_address(obj):
    """The address of host memory given as an int, a bytes/bytearray/memoryview,
    a numpy array, a ctypes object, or a CPU torch tensor; plus an object to
    keep alive during the call."""
    if obj is None:
        return None, None
    if isinstance(obj, int):
        return obj, None
    if hasattr(obj, "data_ptr") and callable(obj.data_ptr):  # torch.Tensor
        return obj.data_ptr(), obj
    ai = getattr(obj, "__array_interface__", None)
    if ai is not None:
        return ai["data"][0], obj
    if isinstance(obj, ctypes._SimpleCData) or isinstance(obj, (ctypes.Array, ctypes.Structure)):
        return ctypes.addressof(obj), obj
    if isinstance(obj, bytes):
        keep = ctypes.c_char_p(obj)
        return ctypes.cast(keep, c_void_p).value, keep
    mv = memoryview(obj)
    if mv.readonly:
        # A copy would dangle once the call returns (epmem keeps reading
        # registered or in-flight sources), and stdlib Python cannot take the
        # address of a read-only buffer without one.
        raise TypeError(f"read-only {type(obj).__name__} buffer: pass bytes, a writable buffer "
                        "(bytearray, mmap), a numpy array, a CPU tensor or an int address")
    arr = (ctypes.c_uint8 * mv.nbytes).from_buffer(mv.cast("B"))
    return ctypes.addressof(arr), arr


def buffer_nbytes(obj):
    if hasattr(obj, "nbytes"):
        return int(obj.nbytes)
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):
        return obj.element_size() * obj.numel()
    if isinstance(obj, (ctypes.Array, ctypes.Structure, ctypes._SimpleCData)):
        return ctypes.sizeof(obj)
    return memoryview(obj).nbytes


class Resource:
    """Something freed exactly once: by close(), by leaving a `with`, or when
    collected (also at interpreter exit, where errors are swallowed)."""

    _what = "resource"

    def __init__(self, parents=()):
        self._parents = tuple(parents)
        self._open = True

    def _release(self):
        raise NotImplementedError

    @property
    def closed(self):
        return not self._open

    def close(self):
        if self._open:
            self._open = False
            self._release()
            self._parents = ()

    def _check_open(self):
        if not self._open:
            raise errors.InvalidHandle(3, "EPM_STATUS_INVALID_HANDLE", f"this {self._what} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Handle(Resource):
    """An epmem handle. `destroy` is the C destroy function's name."""

    destroy = None

    def __init__(self, ptr, parents=()):
        super().__init__(parents)
        self._ptr = ptr
        # Bound now: at interpreter exit module globals may already be gone.
        self._destroy_fn = getattr(_l(), self.destroy)

    @property
    def handle(self):
        """The raw handle (an int) for calls into the C library."""
        self._check_open()
        return self._ptr

    def _release(self):
        p, self._ptr = self._ptr, None
        self._destroy_fn(p)

    def __repr__(self):
        state = "closed" if self.closed else hex(self._ptr)
        return f"<epmem.{type(self).__name__} {state}>"


def _out_handle():
    return c_void_p()


def _stats(fn, handle, struct_type):
    s = L.new(struct_type)
    fn(handle, byref(s))
    return L.to_dict(s)


def _config(struct_type, default_fn, fields):
    cfg = L.new(struct_type)
    if default_fn is not None:
        default_fn(byref(cfg))
    known = {n for n, _ in struct_type._fields_} - {"size"}
    for k, v in fields.items():
        if k not in known:
            raise TypeError(f"{struct_type.__name__} has no field {k!r} (fields: {sorted(known)})")
        setattr(cfg, k, v)
    return cfg


# ---- device, streams, events -----------------------------------------------------

class Device(Handle):
    """An open device. `select`: "auto", "cuda", "host" or None (read EPM_DEVICE)."""

    destroy = "epm_device_destroy"
    _what = "Device"

    def __init__(self, select=None, ordinal=0):
        out = _out_handle()
        _l().epm_device_open_select(select.encode() if select is not None else None, ordinal, byref(out))
        super().__init__(out.value)
        self.ordinal = ordinal
        self._info = self.info()

    def info(self):
        s = L.new(L.EpmDeviceInfo)
        _l().epm_device_get_info(self.handle, byref(s))
        d = L.to_dict(s)
        d["kind"] = {L.EPM_DEVICE_KIND_CUDA: "cuda", L.EPM_DEVICE_KIND_HOST: "host"}.get(s.kind, s.kind)
        return d

    @property
    def kind(self):
        """"cuda" or "host"."""
        return self._info["kind"]

    @property
    def is_cuda(self):
        return self.kind == "cuda"

    def mem_info(self):
        """(free_bytes, total_bytes)."""
        f, t = c_uint64(), c_uint64()
        _l().epm_device_mem_info(self.handle, byref(f), byref(t))
        return f.value, t.value

    def synchronize(self):
        _l().epm_device_synchronize(self.handle)

    def alloc(self, nbytes):
        """`epm_device_alloc`: a DeviceMemory freed on close/collection."""
        return DeviceMemory(self, nbytes)

    def free(self, ptr):
        """`epm_device_free` of a raw address (from `alloc_raw`)."""
        _l().epm_device_free(self.handle, ptr)

    def alloc_raw(self, nbytes):
        out = c_uint64()
        _l().epm_device_alloc(self.handle, nbytes, byref(out))
        return out.value

    def memcpy_htod(self, dst, src, nbytes=None):
        p, keep = host_address(src)
        _l().epm_memcpy_htod(self.handle, _dptr(dst), p, buffer_nbytes(src) if nbytes is None else nbytes)
        del keep

    def memcpy_dtoh(self, dst, src, nbytes=None):
        p, keep = host_address(dst)
        _l().epm_memcpy_dtoh(self.handle, p, _dptr(src), buffer_nbytes(dst) if nbytes is None else nbytes)
        del keep

    def memcpy_htod_async(self, dst, src, nbytes, stream):
        """The caller keeps `src` alive and unmodified until the copy completes."""
        p, _ = host_address(src)
        _l().epm_memcpy_htod_async(self.handle, _dptr(dst), p, nbytes, stream.handle)

    def memcpy_dtoh_async(self, dst, src, nbytes, stream):
        """The caller keeps `dst` alive and untouched until the copy completes."""
        p, _ = host_address(dst)
        _l().epm_memcpy_dtoh_async(self.handle, p, _dptr(src), nbytes, stream.handle)

    def memcpy_dtod_async(self, dst, src, nbytes, stream):
        _l().epm_memcpy_dtod_async(self.handle, _dptr(dst), _dptr(src), nbytes, stream.handle)

    def memset_d8_async(self, dst, value, nbytes, stream):
        _l().epm_memset_d8_async(self.handle, _dptr(dst), value, nbytes, stream.handle)

    def checksum_async(self, ptr, nbytes, stream, out_dev_ptr):
        """Testing build only (epmem.testing.checksum_async); else TestingUnavailable."""
        from . import testing
        testing.checksum_async(self, ptr, nbytes, stream, out_dev_ptr)

    def spin_async(self, micros, stream):
        """Testing build only (epmem.testing.spin_async); else TestingUnavailable."""
        from . import testing
        testing.spin_async(self, micros, stream)

    def stream(self):
        return Stream(self)

    def event(self, timing=False):
        return Event(self, timing)


def _dptr(x):
    """A device address: an int or anything with `.ptr` (DeviceMemory, ArenaBlock)."""
    return x if isinstance(x, int) else int(x.ptr)


class DeviceMemory(Resource):
    """`bytes` of device memory from `epm_device_alloc`; `.ptr` is its address."""

    _what = "DeviceMemory"

    def __init__(self, device, nbytes):
        super().__init__((device,))
        self.device = device
        self.nbytes = nbytes
        self.ptr = device.alloc_raw(nbytes)
        self._free = _l().epm_device_free
        self._dev_handle = device.handle

    def _release(self):
        self._free(self._dev_handle, self.ptr)


class Stream(Handle):
    destroy = "epm_stream_destroy"
    _what = "Stream"

    def __init__(self, device, _ptr=None, _native_owner=None):
        if _ptr is None:
            out = _out_handle()
            _l().epm_stream_create(device.handle, byref(out))
            _ptr = out.value
        super().__init__(_ptr, (device, _native_owner) if _native_owner is not None else (device,))
        self.device = device

    @classmethod
    def wrap_native(cls, device, native, owner=None):
        """Adopt a CUstream (an int). `owner` (e.g. a torch.cuda.Stream) is kept
        alive as long as this object: the native stream must outlive it."""
        out = _out_handle()
        _l().epm_stream_wrap_native(device.handle, c_void_p(native), byref(out))
        return cls(device, out.value, owner)

    def native(self):
        out = c_void_p()
        _l().epm_stream_native(self.handle, byref(out))
        return out.value or 0

    def synchronize(self):
        _l().epm_stream_synchronize(self.handle)

    def wait_event(self, event):
        _l().epm_stream_wait_event(self.handle, event.handle)


class Event(Handle):
    destroy = "epm_event_destroy"
    _what = "Event"

    def __init__(self, device, timing=False):
        out = _out_handle()
        _l().epm_event_create(device.handle, L.EPM_EVENT_TIMING if timing else 0, byref(out))
        super().__init__(out.value, (device,))

    def record(self, stream):
        _l().epm_event_record(self.handle, stream.handle)

    def query(self):
        """True when the captured work has completed (never blocks)."""
        try:
            _l().epm_event_query(self.handle)
            return True
        except errors.NotReady:
            return False

    def synchronize(self):
        _l().epm_event_synchronize(self.handle)

    def elapsed_ms(self, end):
        """Milliseconds from this event to `end` (both timing events, recorded and completed)."""
        ms = c_float()
        _l().epm_event_elapsed_ms(self.handle, end.handle, byref(ms))
        return ms.value


# ---- arenas -----------------------------------------------------------------------

class Arena(Handle):
    """A device arena (`Arena.device`) or a pinned-host arena (`Arena.pinned`)."""

    destroy = "epm_arena_destroy"
    _what = "Arena"

    def __init__(self, device, capacity_bytes, pinned=False, **config):
        cfg = _config(L.EpmArenaConfig, _l().epm_arena_config_default, dict(config, capacity_bytes=capacity_bytes))
        out = _out_handle()
        create = _l().epm_arena_create_pinned if pinned else _l().epm_arena_create_device
        create(device.handle, byref(cfg), byref(out))
        super().__init__(out.value, (device,))
        self.device = device
        self.pinned = pinned

    @classmethod
    def create_device(cls, device, capacity_bytes, **config):
        return cls(device, capacity_bytes, False, **config)

    @classmethod
    def create_pinned(cls, device, capacity_bytes, **config):
        return cls(device, capacity_bytes, True, **config)

    def alloc(self, nbytes, align=0):
        """An address (int); free it with `free`."""
        out = c_uint64()
        _l().epm_arena_alloc(self.handle, nbytes, align, byref(out))
        return out.value

    def free(self, addr):
        _l().epm_arena_free(self.handle, addr)

    def block(self, nbytes, align=0):
        """An ArenaBlock: an allocation freed on close/collection."""
        return ArenaBlock(self, nbytes, align)

    def trim(self):
        out = c_uint64()
        _l().epm_arena_trim(self.handle, byref(out))
        return out.value

    def stats(self):
        return _stats(_l().epm_arena_get_stats, self.handle, L.EpmArenaStats)


class ArenaBlock(Resource):
    _what = "ArenaBlock"

    def __init__(self, arena, nbytes, align=0):
        super().__init__((arena,))
        self.arena = arena
        self.nbytes = nbytes
        self.ptr = arena.alloc(nbytes, align)
        self._free = _l().epm_arena_free
        self._arena_handle = arena.handle

    def _release(self):
        self._free(self._arena_handle, self.ptr)


# ---- residency --------------------------------------------------------------------

class Residency(Handle):
    """A residency manager: `Residency(dev, budget_bytes, policy=..., prefetch_depth=...)`;
    keyword arguments are EpmResidencyConfig fields."""

    destroy = "epm_residency_destroy"
    _what = "Residency"

    def __init__(self, device, budget_bytes, **config):
        cfg = _config(L.EpmResidencyConfig, _l().epm_residency_config_default,
                      dict(config, budget_bytes=budget_bytes))
        out = _out_handle()
        _l().epm_residency_create(device.handle, byref(cfg), byref(out))
        super().__init__(out.value, (device,))
        self.device = device
        self.config = L.to_dict(cfg)

    def register_weight(self, host, nbytes):
        """A weight id. `host` (an address or buffer) must stay allocated and
        unmodified until unregistered or the manager is closed."""
        p, _ = host_address(host)
        out = c_uint32()
        _l().epm_residency_register_weight(self.handle, p, nbytes, byref(out))
        return out.value

    def unregister_weight(self, weight):
        _l().epm_residency_unregister_weight(self.handle, weight)

    def register_host_range(self, host, nbytes):
        p, _ = host_address(host)
        out = c_uint32()
        _l().epm_residency_register_host_range(self.handle, p, nbytes, byref(out))
        return out.value

    def unregister_host_range(self, range_id):
        _l().epm_residency_unregister_host_range(self.handle, range_id)

    def declare_cycle(self, weights):
        arr = (c_uint32 * len(weights))(*weights)
        _l().epm_residency_declare_cycle(self.handle, arr if weights else None, len(weights))

    def prefetch(self, weights):
        arr = (c_uint32 * len(weights))(*weights)
        out = c_size_t()
        _l().epm_residency_prefetch(self.handle, arr if weights else None, len(weights), byref(out))
        return out.value

    def acquire(self, weight, stream):
        out = c_uint64()
        _l().epm_residency_acquire(self.handle, weight, stream.handle, byref(out))
        return out.value

    def release(self, weight, stream):
        _l().epm_residency_release(self.handle, weight, stream.handle)

    def acquire_host(self, weight):
        """As `acquire`, but the calling thread waits for the page-in: anything
        issued afterwards (a synchronous copy, any stream, a CPU kernel on the
        host device) sees the weight's bytes. End with `release_host`."""
        out = c_uint64()
        _l().epm_residency_acquire_host(self.handle, weight, byref(out))
        return out.value

    def release_host(self, weight):
        """End a use begun by `acquire_host`; the caller's reads have completed."""
        _l().epm_residency_release_host(self.handle, weight)

    def synchronize(self):
        _l().epm_residency_synchronize(self.handle)

    def stats(self):
        return _stats(_l().epm_residency_get_stats, self.handle, L.EpmResidencyStats)


# ---- staging pool, copy engine, fences -----------------------------------------------

class StagingPool(Handle):
    destroy = "epm_staging_pool_destroy"
    _what = "StagingPool"

    def __init__(self, device, max_buffers=0, max_bytes=0):
        out = _out_handle()
        _l().epm_staging_pool_create(device.handle, max_buffers, max_bytes, byref(out))
        super().__init__(out.value, (device,))
        self.device = device

    def trim(self):
        out = c_size_t()
        _l().epm_staging_pool_trim(self.handle, byref(out))
        return out.value

    def stats(self):
        return _stats(_l().epm_staging_pool_get_stats, self.handle, L.EpmStagingStats)


class CopyEngine(Handle):
    """`CopyEngine(pool, slots=..., chunk_bytes=..., flags=...)` (EpmCopyEngineConfig fields)."""

    destroy = "epm_copy_engine_destroy"
    _what = "CopyEngine"

    def __init__(self, pool, **config):
        cfg = _config(L.EpmCopyEngineConfig, _l().epm_copy_engine_config_default, config)
        out = _out_handle()
        _l().epm_copy_engine_create(pool.handle, byref(cfg), byref(out))
        super().__init__(out.value, (pool,))
        self.pool = pool

    def htod(self, dst, src, nbytes=None, stream=None, fence=True):
        """Copy host `src` to device `dst`; a Fence (or None with fence=False).
        Keep `src` valid and unmodified until the copy completes."""
        p, _ = host_address(src)
        n = buffer_nbytes(src) if nbytes is None else nbytes
        out = _out_handle() if fence else None
        _l().epm_copy_engine_htod(self.handle, _dptr(dst), p, n, stream.handle if stream else None,
                                  byref(out) if fence else None)
        return Fence(out.value, (self,)) if fence else None

    def register(self, host, nbytes):
        p, _ = host_address(host)
        out = _out_handle()
        _l().epm_copy_engine_register(self.handle, p, nbytes, byref(out))
        return HostRegistration(out.value, (self, host))

    def synchronize(self):
        _l().epm_copy_engine_synchronize(self.handle)

    def stats(self):
        return _stats(_l().epm_copy_engine_get_stats, self.handle, L.EpmStagingStats)


class Fence(Handle):
    destroy = "epm_fence_destroy"
    _what = "Fence"

    def query(self):
        try:
            _l().epm_fence_query(self.handle)
            return True
        except errors.NotReady:
            return False

    def wait(self):
        _l().epm_fence_wait(self.handle)

    def stream_wait(self, stream):
        _l().epm_fence_stream_wait(self.handle, stream.handle)


class HostRegistration(Handle):
    destroy = "epm_host_registration_destroy"
    _what = "HostRegistration"


# ---- KV ---------------------------------------------------------------------------------

def kv_layout_token_major(layers, kv_heads, head_dim, elem_bytes):
    """The dense token-major EpmKvLayout of a model."""
    out = L.new(L.EpmKvLayout)
    _l().epm_kv_layout_token_major(layers, kv_heads, head_dim, elem_bytes, byref(out))
    return out


def kv_admissible(budget_bytes, prefix_bytes, private_bytes):
    out = L.new(L.EpmKvAdmission)
    _l().epm_kv_admissible(budget_bytes, prefix_bytes, private_bytes, byref(out))
    return L.to_dict(out)


def _tokens(tokens):
    tokens = list(tokens)
    return (c_uint32 * len(tokens))(*tokens) if tokens else None, len(tokens)


def kv_namespace(namespace):
    """The bytes of a KV sharing namespace (docs/KV.md, "Namespaces"): a str
    (UTF-8) or bytes of at most EPM_KV_NAMESPACE_MAX_BYTES, without NUL; None
    or empty is the default namespace (b"")."""
    if namespace is None:
        return b""
    if isinstance(namespace, str):
        b = namespace.encode("utf-8")
    elif isinstance(namespace, (bytes, bytearray, memoryview)):
        b = bytes(namespace)
    else:
        raise TypeError(f"namespace must be a str, bytes or None, not {type(namespace).__name__}")
    if len(b) > L.EPM_KV_NAMESPACE_MAX_BYTES:
        raise ValueError(f"namespace of {len(b)} bytes exceeds the limit of "
                         f"{L.EPM_KV_NAMESPACE_MAX_BYTES} bytes (EPM_KV_NAMESPACE_MAX_BYTES)")
    if b"\0" in b:
        raise ValueError(f"namespace contains a NUL byte at offset {b.index(0)}")
    return b


class KvPool(Handle):
    destroy = "epm_kv_pool_destroy"
    _what = "KvPool"

    def __init__(self, device, budget_bytes):
        out = _out_handle()
        _l().epm_kv_pool_create(device.handle, budget_bytes, byref(out))
        super().__init__(out.value, (device,))
        self.device = device

    def stats(self):
        return _stats(_l().epm_kv_pool_get_stats, self.handle, L.EpmKvStats)

    def seq(self, layout, max_tokens, admit=L.EPM_KV_ADMIT_PROMISE):
        out = _out_handle()
        _l().epm_kv_seq_create(self.handle, byref(layout), max_tokens, admit, byref(out))
        return KvSeq(out.value, self)

    def seq_for_tokens(self, layout, max_tokens, tokens, admit=L.EPM_KV_ADMIT_PROMISE, namespace=None):
        """(KvSeq, shared_tokens): shares the longest live prefix of `tokens`
        pinned in the same `namespace` (kv_namespace(); None: the default one)."""
        ns = kv_namespace(namespace)
        arr, n = _tokens(tokens)
        out, shared = _out_handle(), c_uint64()
        if ns:
            _l().epm_kv_seq_create_for_tokens_ns(self.handle, byref(layout), max_tokens, ns, len(ns), arr, n,
                                                 admit, byref(out), byref(shared))
        else:
            _l().epm_kv_seq_create_for_tokens(self.handle, byref(layout), max_tokens, arr, n, admit,
                                              byref(out), byref(shared))
        return KvSeq(out.value, self), shared.value

    def find_prefix(self, layout, tokens, namespace=None):
        """Tokens of `tokens` a live prefix of `namespace` already holds (0 if none)."""
        ns = kv_namespace(namespace)
        arr, n = _tokens(tokens)
        out = c_uint64()
        if ns:
            _l().epm_kv_find_prefix_ns(self.handle, byref(layout), ns, len(ns), arr, n, byref(out))
        else:
            _l().epm_kv_find_prefix(self.handle, byref(layout), arr, n, byref(out))
        return out.value

    def request_cost(self, layout, prefix_tokens, max_tokens):
        out = L.new(L.EpmKvRequestCost)
        _l().epm_kv_request_cost(self.handle, byref(layout), prefix_tokens, max_tokens, byref(out))
        return L.to_dict(out)

    def batch(self, layout, max_tokens, max_slots):
        """A KvBatch of `max_slots` slots of up to `max_tokens` tokens of `layout`."""
        return KvBatch(self, layout, max_tokens, max_slots)


# The old name (C: EpmKvArena, epm_kv_arena_*), kept until the next major version.
KvArena = KvPool


class KvSeq(Handle):
    destroy = "epm_kv_seq_destroy"
    _what = "KvSeq"

    def __init__(self, ptr, pool):
        super().__init__(ptr, (pool,))
        self.pool = pool

    arena = property(lambda self: self.pool, doc="Deprecated name of `pool` (the KvPool).")

    def info_struct(self):
        out = L.new(L.EpmKvSeqInfo)
        _l().epm_kv_seq_get_info(self.handle, byref(out))
        return out

    def info(self):
        s = self.info_struct()
        d = L.to_dict(s)
        d["layout"] = L.to_dict(s.layout)  # the name from before the fields were flat
        return d

    def prepare_append(self, n_tokens, stream):
        _l().epm_kv_seq_prepare_append(self.handle, n_tokens, stream.handle)

    def declare_tokens(self, tokens):
        arr, n = _tokens(tokens)
        _l().epm_kv_seq_declare_tokens(self.handle, arr, n)

    def pin(self, n_tokens, stream):
        out = _out_handle()
        _l().epm_kv_prefix_pin(self.handle, n_tokens, stream.handle, byref(out))
        return KvPrefix(out.value, self.pool)


class KvBatch(Handle):
    """`epm_kv_batch_create`: `max_slots` sequences behind one base pointer
    (docs/KV.md, "Batches"). Slots are KvSlot objects (KvSeq subclasses); the
    whole range is always mapped (free slots and uncommitted granules read
    zeros) and a slot's addresses never move while the batch lives.

    close() is refused (InvalidState, the batch stays open) while a slot is
    taken: release or close the slots first."""

    destroy = "epm_kv_batch_destroy"
    _what = "KvBatch"
    arena = property(lambda self: self.pool, doc="Deprecated name of `pool` (the KvPool).")

    def __init__(self, pool, layout, max_tokens, max_slots):
        out = _out_handle()
        _l().epm_kv_batch_create(pool.handle, byref(layout), max_tokens, max_slots, byref(out))
        super().__init__(out.value, (pool,))
        self.pool = pool
        self.layout = L.new(L.EpmKvLayout, **{n: getattr(layout, n) for n, _ in L._LAYOUT_FIELDS})

    def close(self):
        # Unlike other handles, destroying a batch can be refused (slots
        # taken) and the handle then stays valid: only mark it closed once
        # the C call has succeeded.
        if self._open:
            self._destroy_fn(self._ptr)
            self._open = False
            self._ptr = None
            self._parents = ()

    def desc_struct(self):
        """The EpmKvBatchDesc (base, slot_stride, strides, counts)."""
        out = L.new(L.EpmKvBatchDesc)
        _l().epm_kv_batch_get_desc(self.handle, byref(out))
        return out

    def desc(self):
        return L.to_dict(self.desc_struct())

    def take_slot(self, slot=L.EPM_KV_BATCH_ANY_SLOT, admit=L.EPM_KV_ADMIT_PROMISE):
        """A new empty sequence in `slot` (default: the lowest free one). Never waits."""
        out = _out_handle()
        _l().epm_kv_batch_take_slot(self.handle, slot, admit, byref(out))
        return KvSlot(out.value, self)

    def take_shared_slot(self, prefix, n_tokens, stream, slot=L.EPM_KV_BATCH_ANY_SLOT,
                         admit=L.EPM_KV_ADMIT_PROMISE):
        """A sequence whose first `n_tokens` map `prefix` (a KvPrefix) read-only;
        the host first waits for `stream` (queued work may read the slot)."""
        out = _out_handle()
        _l().epm_kv_batch_take_shared_slot(self.handle, slot, prefix.handle, n_tokens, admit, stream.handle,
                                           byref(out))
        return KvSlot(out.value, self)

    def take_slot_for_tokens(self, tokens, stream, slot=L.EPM_KV_BATCH_ANY_SLOT, admit=L.EPM_KV_ADMIT_PROMISE,
                             namespace=None):
        """(KvSlot, shared_tokens): shares the longest live prefix of `tokens`
        pinned in the same `namespace` (skip the prefill of the first
        `shared_tokens`), else an empty slot."""
        ns = kv_namespace(namespace)
        arr, n = _tokens(tokens)
        out, shared = _out_handle(), c_uint64()
        if ns:
            _l().epm_kv_batch_take_slot_for_tokens_ns(self.handle, slot, ns, len(ns), arr, n, admit, stream.handle,
                                                      byref(out), byref(shared))
        else:
            _l().epm_kv_batch_take_slot_for_tokens(self.handle, slot, arr, n, admit, stream.handle, byref(out),
                                                   byref(shared))
        return KvSlot(out.value, self), shared.value

    def release_slot(self, slot, stream):
        """`slot.release(stream)`."""
        if getattr(slot, "batch", None) is not self:
            raise errors.InvalidArgument(1, "EPM_STATUS_INVALID_ARGUMENT", f"{slot!r} is not a slot of {self!r}")
        slot.release(stream)


class KvSlot(KvSeq):
    """A slot of a KvBatch: a sequence (every KvSeq method applies) whose
    reservation is the slot's window. release(stream) gives it back after
    `stream`'s queued work; close() (or collection) releases it without that
    wait (epm_kv_seq_destroy: nothing queued may still read it)."""

    _what = "KvSlot"

    def __init__(self, ptr, batch):
        super().__init__(ptr, batch.pool)
        self._parents = (batch.pool, batch)
        self.batch = batch
        self.slot = self.slot_info_struct().slot

    def slot_info_struct(self):
        out = L.new(L.EpmKvBatchSlotInfo)
        _l().epm_kv_batch_slot_get_info(self.handle, byref(out))
        return out

    def slot_info(self):
        return L.to_dict(self.slot_info_struct())

    def release(self, stream):
        """`epm_kv_batch_release_slot`: the host waits for `stream`, the slot
        reads zeros again and this object is closed."""
        _l().epm_kv_batch_release_slot(self.handle, stream.handle)
        # The C handle is gone whether or not Python still references it.
        self._open = False
        self._ptr = None
        self._parents = ()

    def __repr__(self):
        state = "closed" if self.closed else f"slot {self.slot}"
        return f"<epmem.KvSlot {state}>"


class KvPrefix(Handle):
    """A pin on a shared prefix; close() (or unpin()) ends the pin."""

    destroy = "epm_kv_prefix_unpin"
    _what = "KvPrefix"

    def __init__(self, ptr, pool):
        super().__init__(ptr, (pool,))
        self.pool = pool

    arena = property(lambda self: self.pool, doc="Deprecated name of `pool` (the KvPool).")

    def unpin(self):
        self.close()

    def info(self):
        out = L.new(L.EpmKvPrefixInfo)
        _l().epm_kv_prefix_get_info(self.handle, byref(out))
        return L.to_dict(out)

    def commit(self, n_tokens, max_tokens, admit=L.EPM_KV_ADMIT_PROMISE):
        """A new sequence whose first `n_tokens` map this prefix read-only."""
        out = _out_handle()
        _l().epm_kv_commit_shared_prefix(self.handle, n_tokens, max_tokens, admit, byref(out))
        return KvSeq(out.value, self.pool)


# ---- logging, version, errors ------------------------------------------------------------

_log_callback = None  # the CFUNCTYPE object must outlive its registration


def set_log_callback(fn, max_level=L.EPM_LOG_LEVEL_INFO):
    """Route epmem's log records to `fn(level: int, message: str)` (None: back to
    stderr). `fn` runs on epmem's threads: it must be quick, thread-safe, and
    must not call epmem. Reset to stderr at interpreter exit."""
    global _log_callback
    if fn is None:
        _l().epm_set_log_callback(L.EpmLogCallback(), None, max_level)
        _log_callback = None
        return

    def trampoline(_user, level, message):
        try:
            fn(level, message.decode("utf-8", "replace"))
        except Exception:
            pass  # an exception cannot cross into epmem's thread

    cb = L.EpmLogCallback(trampoline)
    _l().epm_set_log_callback(cb, None, max_level)
    _log_callback = cb


@atexit.register
def _reset_log_callback():
    # epmem threads may log after Python is finalized: never into a dead callback.
    if _log_callback is not None and L._loaded is not None:
        try:
            L._loaded.epm_set_log_callback(L.EpmLogCallback(), None, L.EPM_LOG_LEVEL_WARN)
        except Exception:
            pass


def version():
    return _l().epm_version()


def version_string():
    return _l().epm_version_string().decode()


def status_name(status):
    return _l().epm_status_name(status).decode()


def last_error_message():
    return _l().epm_last_error_message().decode("utf-8", "replace")


def checksum_host(data, nbytes=None):
    """Testing build only (epmem.testing.checksum_host); else TestingUnavailable."""
    from . import testing
    return testing.checksum_host(data, nbytes)
