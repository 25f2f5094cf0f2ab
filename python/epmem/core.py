"""Python objects over the C handles: each destroys itself (close(), `with`,
or garbage collection), and each keeps the objects it was made from alive.

The C library already keeps a device alive while anything made from it
lives, so destroying in any order is safe; the Python references exist so a
child never outlives memory a parent object owns on the Python side (a host
buffer, a log callback).

Arguments are checked before any C call: a size is a non-negative int, a
handle argument is the epmem object it names, a host buffer is at least as
long as the length given with it (TypeError / ValueError saying what was
expected). A host buffer registered with epmem (`Residency.register_weight`,
`register_host_range`, `CopyEngine.register`) is kept alive, and a resizable
one (bytearray, mmap) pinned against resizing, until it is unregistered.
"""

from __future__ import annotations

import atexit
import ctypes
import operator
import reprlib
import weakref
from ctypes import byref, c_float, c_size_t, c_uint32, c_uint64, c_void_p
from typing import Any, Callable, Iterable, Optional, Sequence, Tuple, Union

from . import _lib as L
from . import errors

U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1

#: Host memory: a buffer (bytes, bytearray, mmap, memoryview, numpy array,
#: ctypes object, CPU torch tensor) or a raw address (an int).
HostBuffer = Any
#: A device address: an int, or an object with `.ptr` (DeviceMemory, ArenaBlock).
DevicePtrLike = Union[int, "DeviceMemory", "ArenaBlock"]


def _l():
    return L.lib()


def _show(value: Any) -> str:
    return f"{type(value).__name__} {reprlib.repr(value)}" if value is not None else "None"


def _int(value: Any, name: str, hi: int = U64_MAX, lo: int = 0) -> int:
    """`value` as an int in [lo, hi]; TypeError / ValueError naming `name`."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {_show(value)}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {_show(value)}") from None
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")
    return v


def _size(value: Any, name: str = "nbytes") -> int:
    """A size in bytes (size_t / uint64_t): a non-negative int below 2**64."""
    return _int(value, name)


def _u32(value: Any, name: str) -> int:
    return _int(value, name, U32_MAX)


def _expect(obj: Any, cls: type, name: str, optional: bool = False) -> Any:
    """`obj` if it is a `cls` (or None when `optional`); else a TypeError."""
    if (obj is None and optional) or isinstance(obj, cls):
        return obj
    raise TypeError(f"{name} must be an epmem.{cls.__name__}{' or None' if optional else ''}, got {_show(obj)}")


def _handle(obj: Any, cls: type, name: str) -> int:
    return _expect(obj, cls, name).handle


def _host(obj: Any, name: str, writable: bool = False) -> Tuple[int, Optional[int], Any]:
    """(address, size in bytes or None for a raw address, object that keeps
    the memory alive and, for a resizable buffer, pinned)."""
    if obj is None:
        raise TypeError(f"{name} must be a host buffer or an int address, got None")
    if isinstance(obj, bool):
        raise TypeError(f"{name} must be a host buffer or an int address, got {_show(obj)}")
    if isinstance(obj, int):
        return _int(obj, name), None, None
    if hasattr(obj, "data_ptr") and callable(obj.data_ptr):  # torch.Tensor
        dev = getattr(obj, "device", None)
        if getattr(dev, "type", "cpu") != "cpu":
            raise TypeError(f"{name} is a tensor on {dev}: pass a CPU tensor (host memory)")
        if not obj.is_contiguous():
            raise ValueError(f"{name} is a non-contiguous tensor: pass .contiguous()")
        return obj.data_ptr(), obj.element_size() * obj.numel(), obj
    ai = getattr(obj, "__array_interface__", None)
    if ai is not None:  # numpy
        if ai.get("strides") is not None:
            raise ValueError(f"{name} is a non-contiguous array: pass numpy.ascontiguousarray(...)")
        if writable and ai["data"][1]:
            raise TypeError(f"{name} is a read-only array: the destination must be writable")
        return ai["data"][0], int(obj.nbytes), obj
    if isinstance(obj, (ctypes._SimpleCData, ctypes.Array, ctypes.Structure, ctypes.Union)):
        return ctypes.addressof(obj), ctypes.sizeof(obj), obj
    if isinstance(obj, bytes):
        if writable:
            raise TypeError(f"{name} is bytes, which is immutable: the destination must be writable "
                            "(a bytearray, mmap, numpy array or CPU tensor)")
        keep = ctypes.c_char_p(obj)
        return ctypes.cast(keep, c_void_p).value, len(obj), keep
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError(f"{name} must be a host buffer (bytes, bytearray, mmap, memoryview, numpy array, "
                        f"ctypes object, CPU tensor) or an int address, got {_show(obj)}") from None
    if mv.readonly:
        # A copy would dangle once the call returns (epmem keeps reading
        # registered or in-flight sources), and stdlib Python cannot take the
        # address of a read-only buffer without one.
        raise TypeError(f"read-only {type(obj).__name__} buffer: pass bytes, a writable buffer "
                        "(bytearray, mmap), a numpy array, a CPU tensor or an int address")
    if not mv.c_contiguous:
        raise ValueError(f"{name} is a non-contiguous buffer")
    if mv.nbytes == 0:
        return 0, 0, None
    # The ctypes array holds a buffer export: while it lives, a bytearray or
    # mmap cannot be resized or closed (BufferError), so its memory stays put.
    arr = (ctypes.c_uint8 * mv.nbytes).from_buffer(mv.cast("B"))
    return ctypes.addressof(arr), mv.nbytes, arr


def _host_span(obj: Any, nbytes: Any, name: str, writable: bool = False) -> Tuple[int, int, Any]:
    """(address, nbytes, keep) for `nbytes` bytes of host `obj`: `nbytes`
    None means the whole buffer; more than the buffer holds is a ValueError.
    A raw int address cannot be checked: the caller vouches for its length."""
    p, size, keep = _host(obj, name, writable)
    if nbytes is None:
        if size is None:
            raise TypeError(f"{name} is a raw address: pass nbytes")
        return p, size, keep
    n = _size(nbytes)
    if size is not None and n > size:
        raise ValueError(f"nbytes {n} exceeds the {size} bytes of {name} ({type(obj).__name__})")
    return p, n, keep


def host_address(obj: HostBuffer) -> Tuple[Optional[int], Any]:
    """The address of host memory given as an int, a bytes/bytearray/memoryview,
    a numpy array, a ctypes object, or a CPU torch tensor; plus an object to
    keep alive during the call."""
    if obj is None:
        return None, None
    p, _, keep = _host(obj, "host buffer")
    return p, keep


def buffer_nbytes(obj: HostBuffer) -> int:
    """The size in bytes of a host buffer (not of an int address)."""
    _, size, _ = _host(obj, "host buffer")
    if size is None:
        raise TypeError("an int address has no size: pass nbytes")
    return size


def _dptr(x: Any, name: str = "device pointer", nbytes: Optional[int] = None) -> int:
    """A device address: an int or anything with `.ptr` (DeviceMemory,
    ArenaBlock); with `nbytes`, an object that knows its size must hold them."""
    if isinstance(x, Resource):
        if x.closed:
            raise ValueError(f"{name} is a closed {type(x).__name__}")
        size = getattr(x, "nbytes", None)
        if nbytes is not None and size is not None and nbytes > size:
            raise ValueError(f"nbytes {nbytes} exceeds the {size} bytes of {name} ({type(x).__name__})")
    if hasattr(x, "ptr") and not isinstance(x, (int, bool)):
        return _int(x.ptr, f"{name}.ptr")
    if isinstance(x, int) and not isinstance(x, bool):
        return _int(x, name)
    raise TypeError(f"{name} must be a device address (an int) or an object with .ptr "
                    f"(DeviceMemory, ArenaBlock), got {_show(x)}")


def _release_quietly(release: Callable[..., Any], args: tuple, _parents: tuple) -> None:
    # Run by the garbage collector or at interpreter exit: an exception
    # has nowhere to go. `_parents` is held here so every parent outlives
    # this release.
    try:
        release(*args)
    except Exception:
        pass


class Resource:
    """Something freed exactly once: by close(), by leaving a `with`, or when
    collected (also at interpreter exit, children before their parents, where
    errors are swallowed). Subclasses call `_track(release, *args)` once the
    C object exists; `release` and `args` must not refer to the object itself
    (a weakref.finalize callback that did would keep it alive forever)."""

    _what = "resource"
    _finalizer: Optional[weakref.finalize] = None

    def __init__(self, parents: Iterable[Any] = ()):
        self._parents = tuple(parents)

    def _track(self, release: Callable[..., Any], *args: Any) -> None:
        self._finalizer = weakref.finalize(self, _release_quietly, release, args, self._parents)

    @property
    def closed(self) -> bool:
        return self._finalizer is None or not self._finalizer.alive

    def _forget(self) -> Optional[Tuple[Callable[..., Any], tuple]]:
        """Mark closed without releasing; the release it would have made."""
        info = self._finalizer.detach() if self._finalizer is not None else None
        self._parents = ()
        if info is None:
            return None
        _, _, (release, args, _parents), _ = info
        return release, args

    def close(self) -> None:
        """Release now (errors are raised); closing twice is a no-op."""
        todo = self._forget()
        if todo is not None:
            release, args = todo
            release(*args)

    def _check_open(self) -> None:
        if self.closed:
            raise errors.InvalidHandle(3, "EPM_STATUS_INVALID_HANDLE", f"this {self._what} is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Handle(Resource):
    """An epmem handle. `destroy` is the C destroy function's name."""

    destroy: Optional[str] = None

    def __init__(self, ptr: int, parents: Iterable[Any] = ()):
        super().__init__(parents)
        self._ptr = ptr
        # Bound now: at interpreter exit module globals may already be gone.
        self._destroy_fn = getattr(_l(), self.destroy)
        self._track(self._destroy_fn, ptr)

    @property
    def handle(self) -> int:
        """The raw handle (an int) for calls into the C library."""
        self._check_open()
        return self._ptr

    def close(self) -> None:
        super().close()
        self._ptr = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else hex(self._ptr)
        return f"<epmem.{type(self).__name__} {state}>"


def _out_handle() -> c_void_p:
    return c_void_p()


def _stats(fn: Callable[..., Any], handle: int, struct_type: type) -> dict:
    s = L.new(struct_type)
    fn(handle, byref(s))
    return L.to_dict(s)


# Checks for config struct fields by their ctypes type: ctypes itself wraps a
# negative int into a huge unsigned one without a word.
_FIELD_CHECKS = {
    ctypes.c_uint8: lambda v, n: _int(v, n, 0xFF),
    ctypes.c_uint32: _u32,
    ctypes.c_uint64: _size,
    ctypes.c_size_t: _size,
}


def _config(struct_type: type, default_fn: Optional[Callable[..., Any]], fields: dict) -> Any:
    cfg = L.new(struct_type)
    if default_fn is not None:
        default_fn(byref(cfg))
    types = {n: t for n, t in struct_type._fields_ if n != "size"}
    for k, v in fields.items():
        if k not in types:
            raise TypeError(f"{struct_type.__name__} has no field {k!r} (fields: {sorted(types)})")
        check = _FIELD_CHECKS.get(types[k])
        setattr(cfg, k, check(v, k) if check is not None else v)
    return cfg


# ---- device, streams, events -----------------------------------------------------

_SELECT = ("auto", "cuda", "host")


class Device(Handle):
    """An open device. `select`: "auto", "cuda", "host" (any case) or None
    (read EPM_DEVICE); `ordinal`: which GPU."""

    destroy = "epm_device_destroy"
    _what = "Device"

    def __init__(self, select: Optional[str] = None, ordinal: int = 0):
        if select is not None and not isinstance(select, str):
            hint = f"; for GPU {select} write Device(ordinal={select})" if isinstance(select, int) else ""
            raise TypeError(f"select must be 'auto', 'cuda', 'host' or None, got {_show(select)}{hint}")
        ordinal = _u32(ordinal, "ordinal")
        out = _out_handle()
        _l().epm_device_open_select(select.encode() if select is not None else None, ordinal, byref(out))
        super().__init__(out.value)
        self.ordinal = ordinal
        self._info = self.info()

    def info(self) -> dict:
        s = L.new(L.EpmDeviceInfo)
        _l().epm_device_get_info(self.handle, byref(s))
        d = L.to_dict(s)
        d["kind"] = {L.EPM_DEVICE_KIND_CUDA: "cuda", L.EPM_DEVICE_KIND_HOST: "host"}.get(s.kind, s.kind)
        return d

    @property
    def kind(self) -> str:
        """"cuda" or "host"."""
        return self._info["kind"]

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def mem_info(self) -> Tuple[int, int]:
        """(free_bytes, total_bytes)."""
        f, t = c_uint64(), c_uint64()
        _l().epm_device_mem_info(self.handle, byref(f), byref(t))
        return f.value, t.value

    def synchronize(self) -> None:
        _l().epm_device_synchronize(self.handle)

    def alloc(self, nbytes: int) -> DeviceMemory:
        """`epm_device_alloc`: a DeviceMemory freed on close/collection (or `free`)."""
        return DeviceMemory(self, nbytes)

    def free(self, mem: Union[DeviceMemory, int]) -> None:
        """Free what `alloc` returned (a DeviceMemory: the same as its close())
        or a raw address from `alloc_raw` (`epm_device_free`)."""
        if isinstance(mem, DeviceMemory):
            if mem.device is not self:
                raise ValueError(f"{mem!r} was allocated on another Device")
            mem.close()
            return
        _l().epm_device_free(self.handle, _dptr(mem, "mem"))

    def alloc_raw(self, nbytes: int) -> int:
        """`epm_device_alloc`: a raw address the caller frees with `free`."""
        nbytes = _size(nbytes)
        out = c_uint64()
        _l().epm_device_alloc(self.handle, nbytes, byref(out))
        return out.value

    def memcpy_htod(self, dst: DevicePtrLike, src: HostBuffer, nbytes: Optional[int] = None) -> None:
        """Copy `nbytes` (default: all of `src`) from host `src` to device `dst`."""
        p, n, keep = _host_span(src, nbytes, "src")
        _l().epm_memcpy_htod(self.handle, _dptr(dst, "dst", n), p, n)
        del keep

    def memcpy_dtoh(self, dst: HostBuffer, src: DevicePtrLike, nbytes: Optional[int] = None) -> None:
        """Copy `nbytes` (default: all of `dst`) from device `src` into writable host `dst`."""
        p, n, keep = _host_span(dst, nbytes, "dst", writable=True)
        _l().epm_memcpy_dtoh(self.handle, p, _dptr(src, "src", n), n)
        del keep

    def memcpy_htod_async(self, dst: DevicePtrLike, src: HostBuffer, nbytes: int, stream: Stream) -> None:
        """The caller keeps `src` alive and unmodified until the copy completes."""
        p, n, _ = _host_span(src, nbytes, "src")
        _l().epm_memcpy_htod_async(self.handle, _dptr(dst, "dst", n), p, n, _handle(stream, Stream, "stream"))

    def memcpy_dtoh_async(self, dst: HostBuffer, src: DevicePtrLike, nbytes: int, stream: Stream) -> None:
        """The caller keeps `dst` alive and untouched until the copy completes."""
        p, n, _ = _host_span(dst, nbytes, "dst", writable=True)
        _l().epm_memcpy_dtoh_async(self.handle, p, _dptr(src, "src", n), n, _handle(stream, Stream, "stream"))

    def memcpy_dtod_async(self, dst: DevicePtrLike, src: DevicePtrLike, nbytes: int, stream: Stream) -> None:
        n = _size(nbytes)
        _l().epm_memcpy_dtod_async(self.handle, _dptr(dst, "dst", n), _dptr(src, "src", n), n,
                                   _handle(stream, Stream, "stream"))

    def memset_d8_async(self, dst: DevicePtrLike, value: int, nbytes: int, stream: Stream) -> None:
        n = _size(nbytes)
        _l().epm_memset_d8_async(self.handle, _dptr(dst, "dst", n), _int(value, "value", 0xFF), n,
                                 _handle(stream, Stream, "stream"))

    def checksum_async(self, ptr: DevicePtrLike, nbytes: int, stream: Stream, out_dev_ptr: DevicePtrLike) -> None:
        """Testing build only (epmem.testing.checksum_async); else TestingUnavailable."""
        from . import testing
        testing.checksum_async(self, ptr, nbytes, stream, out_dev_ptr)

    def spin_async(self, micros: int, stream: Stream) -> None:
        """Testing build only (epmem.testing.spin_async); else TestingUnavailable."""
        from . import testing
        testing.spin_async(self, micros, stream)

    def stream(self) -> Stream:
        return Stream(self)

    def event(self, timing: bool = False) -> Event:
        return Event(self, timing)


class DeviceMemory(Resource):
    """`nbytes` of device memory from `epm_device_alloc`; `.ptr` is its address."""

    _what = "DeviceMemory"

    def __init__(self, device: Device, nbytes: int):
        _expect(device, Device, "device")
        super().__init__((device,))
        self.device = device
        self.nbytes = _size(nbytes)
        self.ptr = device.alloc_raw(self.nbytes)
        self._track(_l().epm_device_free, device.handle, self.ptr)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.nbytes} bytes at {self.ptr:#x}"
        return f"<epmem.DeviceMemory {state}>"


class Stream(Handle):
    destroy = "epm_stream_destroy"
    _what = "Stream"

    def __init__(self, device: Device, _ptr: Optional[int] = None, _native_owner: Any = None):
        _expect(device, Device, "device")
        if _ptr is None:
            out = _out_handle()
            _l().epm_stream_create(device.handle, byref(out))
            _ptr = out.value
        super().__init__(_ptr, (device, _native_owner) if _native_owner is not None else (device,))
        self.device = device

    @classmethod
    def wrap_native(cls, device: Device, native: int, owner: Any = None) -> Stream:
        """Adopt a CUstream (an int). `owner` (e.g. a torch.cuda.Stream) is kept
        alive as long as this object: the native stream must outlive it."""
        native = _int(native, "native")
        out = _out_handle()
        _l().epm_stream_wrap_native(_handle(device, Device, "device"), c_void_p(native), byref(out))
        return cls(device, out.value, owner)

    def native(self) -> int:
        out = c_void_p()
        _l().epm_stream_native(self.handle, byref(out))
        return out.value or 0

    def synchronize(self) -> None:
        _l().epm_stream_synchronize(self.handle)

    def wait_event(self, event: Event) -> None:
        _l().epm_stream_wait_event(self.handle, _handle(event, Event, "event"))


class Event(Handle):
    destroy = "epm_event_destroy"
    _what = "Event"

    def __init__(self, device: Device, timing: bool = False):
        if not isinstance(timing, bool):
            raise TypeError(f"timing must be a bool, got {_show(timing)}")
        out = _out_handle()
        _l().epm_event_create(_handle(device, Device, "device"), L.EPM_EVENT_TIMING if timing else 0, byref(out))
        super().__init__(out.value, (device,))

    def record(self, stream: Stream) -> None:
        _l().epm_event_record(self.handle, _handle(stream, Stream, "stream"))

    def query(self) -> bool:
        """True when the captured work has completed (never blocks)."""
        try:
            _l().epm_event_query(self.handle)
            return True
        except errors.NotReady:
            return False

    def synchronize(self) -> None:
        _l().epm_event_synchronize(self.handle)

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to `end` (both timing events, recorded and completed)."""
        ms = c_float()
        _l().epm_event_elapsed_ms(self.handle, _handle(end, Event, "end"), byref(ms))
        return ms.value


# ---- arenas -----------------------------------------------------------------------

class Arena(Handle):
    """A device arena (`Arena.device`) or a pinned-host arena (`Arena.pinned`).
    `capacity_bytes` is its bound (include/epmem.h, EpmArenaConfig)."""

    destroy = "epm_arena_destroy"
    _what = "Arena"

    def __init__(self, device: Device, capacity_bytes: int, pinned: bool = False, **config: Any):
        _expect(device, Device, "device")
        cfg = _config(L.EpmArenaConfig, _l().epm_arena_config_default, dict(config, capacity_bytes=capacity_bytes))
        out = _out_handle()
        create = _l().epm_arena_create_pinned if pinned else _l().epm_arena_create_device
        create(device.handle, byref(cfg), byref(out))
        super().__init__(out.value, (device,))
        self.device = device
        self.pinned = bool(pinned)

    @classmethod
    def create_device(cls, device: Device, capacity_bytes: int, **config: Any) -> Arena:
        return cls(device, capacity_bytes, False, **config)

    @classmethod
    def create_pinned(cls, device: Device, capacity_bytes: int, **config: Any) -> Arena:
        return cls(device, capacity_bytes, True, **config)

    def alloc(self, nbytes: int, align: int = 0) -> int:
        """An address (int); free it with `free`."""
        nbytes, align = _size(nbytes), _size(align, "align")
        out = c_uint64()
        _l().epm_arena_alloc(self.handle, nbytes, align, byref(out))
        return out.value

    def free(self, addr: Union[int, ArenaBlock]) -> None:
        """Free an address from `alloc` (or an ArenaBlock of this arena: its close())."""
        if isinstance(addr, ArenaBlock):
            if addr.arena is not self:
                raise ValueError(f"{addr!r} belongs to another Arena")
            addr.close()
            return
        _l().epm_arena_free(self.handle, _int(addr, "addr"))

    def block(self, nbytes: int, align: int = 0) -> ArenaBlock:
        """An ArenaBlock: an allocation freed on close/collection."""
        return ArenaBlock(self, nbytes, align)

    def trim(self) -> int:
        out = c_uint64()
        _l().epm_arena_trim(self.handle, byref(out))
        return out.value

    def stats(self) -> dict:
        return _stats(_l().epm_arena_get_stats, self.handle, L.EpmArenaStats)


class ArenaBlock(Resource):
    _what = "ArenaBlock"

    def __init__(self, arena: Arena, nbytes: int, align: int = 0):
        _expect(arena, Arena, "arena")
        super().__init__((arena,))
        self.arena = arena
        self.nbytes = _size(nbytes)
        self.ptr = arena.alloc(self.nbytes, align)
        self._track(*self._releaser())

    def _releaser(self) -> Tuple[Callable[..., Any], ...]:
        """(function, *args) that frees this block; must not refer to self."""
        return _l().epm_arena_free, self.arena.handle, self.ptr

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.nbytes} bytes at {self.ptr:#x}"
        return f"<epmem.ArenaBlock {state}>"


# ---- residency --------------------------------------------------------------------

def _ids(ids: Any, name: str) -> Tuple[Any, int]:
    """A sequence of u32 ids as a ctypes array (None when empty) and its length."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints, got {_show(ids)}")
    vals = [_u32(v, f"{name}[{i}]") for i, v in enumerate(ids)]
    return ((c_uint32 * len(vals))(*vals) if vals else None), len(vals)


class Residency(Handle):
    """A residency manager: `Residency(dev, budget_bytes, policy=..., prefetch_depth=...)`;
    keyword arguments are EpmResidencyConfig fields.

    A host buffer given to `register_weight` / `register_host_range` is
    kept alive (and a bytearray or mmap kept from resizing) until it is
    unregistered or the manager is closed; an int address is the caller's
    to keep valid."""

    destroy = "epm_residency_destroy"
    _what = "Residency"

    def __init__(self, device: Device, budget_bytes: int, **config: Any):
        _expect(device, Device, "device")
        cfg = _config(L.EpmResidencyConfig, _l().epm_residency_config_default,
                      dict(config, budget_bytes=budget_bytes))
        out = _out_handle()
        _l().epm_residency_create(device.handle, byref(cfg), byref(out))
        # The registered buffers are parents: held until the manager is destroyed.
        self._weight_bufs: dict = {}
        self._range_bufs: dict = {}
        super().__init__(out.value, (device, self._weight_bufs, self._range_bufs))
        self.device = device
        self.config = L.to_dict(cfg)

    def close(self) -> None:
        super().close()
        # The manager no longer reads them.
        self._weight_bufs.clear()
        self._range_bufs.clear()

    def register_weight(self, host: HostBuffer, nbytes: Optional[int] = None) -> int:
        """A weight id for `nbytes` (default: all) of `host`, which must stay
        unmodified until unregistered or the manager is closed."""
        p, n, keep = _host_span(host, nbytes, "host")
        out = c_uint32()
        _l().epm_residency_register_weight(self.handle, p, n, byref(out))
        if keep is not None:
            self._weight_bufs[out.value] = keep
        return out.value

    def register_compressed(self, data: HostBuffer, dtype: Any = "encoded", nbytes: Optional[int] = None, *,
                            threads: int = 0, max_ratio: Optional[float] = None, min_bytes: Optional[int] = None,
                            k: int = 0, format_version: int = 0, k2: int = 0) -> Tuple[int, Any]:
        """Register a weight whose host copy is compressed; page-ins copy the
        compressed bytes and decode them on the device (docs/RESIDENCY.md,
        "Streaming compressed weights"). Returns (weight id, epmem.codec.CodecInfo).

        dtype "encoded" (default): `data` is a compressed buffer
        (`epmem.codec.encode`), validated and copied; a corrupt or truncated one
        raises InvalidArgument. "bf16"/"fp16"/"other" (or a torch dtype): `data`
        holds raw values the manager encodes into its own page-locked copy
        (threads, max_ratio, min_bytes, k, format_version, k2 as `epmem.codec.encode`). A weight the
        codec keeps raw (info.outcome "raw_*", e.g. smaller than min_bytes) is
        registered over `data`, which is then kept as `register_weight` keeps it."""
        from . import codec
        p, n, keep = _host_span(data, nbytes, "data")
        w = L.new(L.EpmCompressedWeight, data=p, bytes=n)
        if isinstance(dtype, str) and dtype == "encoded":
            w.dtype = L.EPM_CODEC_DTYPE_ENCODED
            opts = None
        else:
            w.dtype = codec._dtype(dtype)
            opts = codec._options(threads, max_ratio, min_bytes, k, format_version, k2)
            w.options = ctypes.pointer(opts)
        out = c_uint32()
        info = L.new(L.EpmCodecInfo)
        _l().epm_residency_register_compressed(self.handle, byref(w), byref(out), byref(info))
        result = codec._info(info)
        if not result.coded and keep is not None:
            self._weight_bufs[out.value] = keep
        return out.value, result

    def unregister_weight(self, weight: int) -> None:
        weight = _u32(weight, "weight")
        _l().epm_residency_unregister_weight(self.handle, weight)
        self._weight_bufs.pop(weight, None)

    def register_host_range(self, host: HostBuffer, nbytes: Optional[int] = None) -> int:
        """Register `nbytes` (default: all) of `host` as one range weights inside it page in from."""
        p, n, keep = _host_span(host, nbytes, "host")
        out = c_uint32()
        _l().epm_residency_register_host_range(self.handle, p, n, byref(out))
        if keep is not None:
            self._range_bufs[out.value] = keep
        return out.value

    def unregister_host_range(self, range_id: int) -> None:
        range_id = _u32(range_id, "range_id")
        _l().epm_residency_unregister_host_range(self.handle, range_id)
        self._range_bufs.pop(range_id, None)

    def declare_cycle(self, weights: Sequence[int]) -> None:
        arr, n = _ids(weights, "weights")
        _l().epm_residency_declare_cycle(self.handle, arr, n)

    def prefetch(self, weights: Sequence[int]) -> int:
        arr, n = _ids(weights, "weights")
        out = c_size_t()
        _l().epm_residency_prefetch(self.handle, arr, n, byref(out))
        return out.value

    def acquire(self, weight: int, stream: Stream) -> int:
        out = c_uint64()
        _l().epm_residency_acquire(self.handle, _u32(weight, "weight"), _handle(stream, Stream, "stream"),
                                   byref(out))
        return out.value

    def release(self, weight: int, stream: Stream) -> None:
        _l().epm_residency_release(self.handle, _u32(weight, "weight"), _handle(stream, Stream, "stream"))

    def acquire_host(self, weight: int) -> int:
        """As `acquire`, but the calling thread waits for the page-in: anything
        issued afterwards (a synchronous copy, any stream, a CPU kernel on the
        host device) sees the weight's bytes. End with `release_host`."""
        out = c_uint64()
        _l().epm_residency_acquire_host(self.handle, _u32(weight, "weight"), byref(out))
        return out.value

    def release_host(self, weight: int) -> None:
        """End a use begun by `acquire_host`; the caller's reads have completed."""
        _l().epm_residency_release_host(self.handle, _u32(weight, "weight"))

    def synchronize(self) -> None:
        _l().epm_residency_synchronize(self.handle)

    def stats(self) -> dict:
        return _stats(_l().epm_residency_get_stats, self.handle, L.EpmResidencyStats)


# ---- staging pool, copy engine, fences -----------------------------------------------

class StagingPool(Handle):
    destroy = "epm_staging_pool_destroy"
    _what = "StagingPool"

    def __init__(self, device: Device, max_buffers: int = 0, max_bytes: int = 0):
        out = _out_handle()
        _l().epm_staging_pool_create(_handle(device, Device, "device"), _size(max_buffers, "max_buffers"),
                                     _size(max_bytes, "max_bytes"), byref(out))
        super().__init__(out.value, (device,))
        self.device = device

    def trim(self) -> int:
        out = c_size_t()
        _l().epm_staging_pool_trim(self.handle, byref(out))
        return out.value

    def stats(self) -> dict:
        return _stats(_l().epm_staging_pool_get_stats, self.handle, L.EpmStagingStats)


class CopyEngine(Handle):
    """`CopyEngine(pool, slots=..., chunk_bytes=..., flags=...)` (EpmCopyEngineConfig fields)."""

    destroy = "epm_copy_engine_destroy"
    _what = "CopyEngine"

    def __init__(self, pool: StagingPool, **config: Any):
        _expect(pool, StagingPool, "pool")
        cfg = _config(L.EpmCopyEngineConfig, _l().epm_copy_engine_config_default, config)
        out = _out_handle()
        _l().epm_copy_engine_create(pool.handle, byref(cfg), byref(out))
        super().__init__(out.value, (pool,))
        self.pool = pool

    def htod(self, dst: DevicePtrLike, src: HostBuffer, nbytes: Optional[int] = None,
             stream: Optional[Stream] = None, fence: bool = True) -> Optional[Fence]:
        """Copy host `src` to device `dst`; a Fence (or None with fence=False).
        Keep `src` valid and unmodified until the copy completes."""
        p, n, _ = _host_span(src, nbytes, "src")
        _expect(stream, Stream, "stream", optional=True)
        out = _out_handle() if fence else None
        _l().epm_copy_engine_htod(self.handle, _dptr(dst, "dst", n), p, n, stream.handle if stream else None,
                                  byref(out) if fence else None)
        return Fence(out.value, (self,)) if fence else None

    def register(self, host: HostBuffer, nbytes: Optional[int] = None) -> HostRegistration:
        """Register `nbytes` (default: all) of `host`; the registration keeps
        `host` alive (and unresizable) until it is closed."""
        p, n, keep = _host_span(host, nbytes, "host")
        out = _out_handle()
        _l().epm_copy_engine_register(self.handle, p, n, byref(out))
        return HostRegistration(out.value, (self, host, keep))

    def synchronize(self) -> None:
        _l().epm_copy_engine_synchronize(self.handle)

    def stats(self) -> dict:
        return _stats(_l().epm_copy_engine_get_stats, self.handle, L.EpmStagingStats)


class Fence(Handle):
    destroy = "epm_fence_destroy"
    _what = "Fence"

    def query(self) -> bool:
        try:
            _l().epm_fence_query(self.handle)
            return True
        except errors.NotReady:
            return False

    def wait(self) -> None:
        _l().epm_fence_wait(self.handle)

    def stream_wait(self, stream: Stream) -> None:
        _l().epm_fence_stream_wait(self.handle, _handle(stream, Stream, "stream"))


class HostRegistration(Handle):
    destroy = "epm_host_registration_destroy"
    _what = "HostRegistration"


# ---- KV ---------------------------------------------------------------------------------

def kv_layout_token_major(layers: int, kv_heads: int, head_dim: int, elem_bytes: int) -> Any:
    """The dense token-major EpmKvLayout of a model."""
    out = L.new(L.EpmKvLayout)
    _l().epm_kv_layout_token_major(_u32(layers, "layers"), _u32(kv_heads, "kv_heads"), _u32(head_dim, "head_dim"),
                                   _u32(elem_bytes, "elem_bytes"), byref(out))
    return out


def kv_admissible(budget_bytes: int, prefix_bytes: int, private_bytes: int) -> dict:
    out = L.new(L.EpmKvAdmission)
    _l().epm_kv_admissible(_size(budget_bytes, "budget_bytes"), _size(prefix_bytes, "prefix_bytes"),
                           _size(private_bytes, "private_bytes"), byref(out))
    return L.to_dict(out)


def _tokens(tokens: Any) -> Tuple[Any, int]:
    return _ids(tokens, "tokens")


def _layout(layout: Any) -> Any:
    return byref(_expect(layout, L.EpmKvLayout, "layout"))


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

    def __init__(self, device: Device, budget_bytes: int):
        out = _out_handle()
        _l().epm_kv_pool_create(_handle(device, Device, "device"), _size(budget_bytes, "budget_bytes"), byref(out))
        super().__init__(out.value, (device,))
        self.device = device

    def stats(self) -> dict:
        return _stats(_l().epm_kv_pool_get_stats, self.handle, L.EpmKvStats)

    def seq(self, layout: Any, max_tokens: int, admit: int = L.EPM_KV_ADMIT_PROMISE) -> KvSeq:
        out = _out_handle()
        _l().epm_kv_seq_create(self.handle, _layout(layout), _size(max_tokens, "max_tokens"), _u32(admit, "admit"),
                               byref(out))
        return KvSeq(out.value, self)

    def seq_for_tokens(self, layout: Any, max_tokens: int, tokens: Sequence[int],
                       admit: int = L.EPM_KV_ADMIT_PROMISE, namespace: Any = None) -> Tuple[KvSeq, int]:
        """(KvSeq, shared_tokens): shares the longest live prefix of `tokens`
        pinned in the same `namespace` (kv_namespace(); None: the default one)."""
        ns = kv_namespace(namespace)
        arr, n = _tokens(tokens)
        out, shared = _out_handle(), c_uint64()
        lay, mt, ad = _layout(layout), _size(max_tokens, "max_tokens"), _u32(admit, "admit")
        if ns:
            _l().epm_kv_seq_create_for_tokens_ns(self.handle, lay, mt, ns, len(ns), arr, n, ad, byref(out),
                                                 byref(shared))
        else:
            _l().epm_kv_seq_create_for_tokens(self.handle, lay, mt, arr, n, ad, byref(out), byref(shared))
        return KvSeq(out.value, self), shared.value

    def find_prefix(self, layout: Any, tokens: Sequence[int], namespace: Any = None) -> int:
        """Tokens of `tokens` a live prefix of `namespace` already holds (0 if none)."""
        ns = kv_namespace(namespace)
        arr, n = _tokens(tokens)
        out = c_uint64()
        if ns:
            _l().epm_kv_find_prefix_ns(self.handle, _layout(layout), ns, len(ns), arr, n, byref(out))
        else:
            _l().epm_kv_find_prefix(self.handle, _layout(layout), arr, n, byref(out))
        return out.value

    def request_cost(self, layout: Any, prefix_tokens: int, max_tokens: int) -> dict:
        out = L.new(L.EpmKvRequestCost)
        _l().epm_kv_request_cost(self.handle, _layout(layout), _size(prefix_tokens, "prefix_tokens"),
                                 _size(max_tokens, "max_tokens"), byref(out))
        return L.to_dict(out)

    def batch(self, layout: Any, max_tokens: int, max_slots: int) -> KvBatch:
        """A KvBatch of `max_slots` slots of up to `max_tokens` tokens of `layout`."""
        return KvBatch(self, layout, max_tokens, max_slots)


class KvSeq(Handle):
    destroy = "epm_kv_seq_destroy"
    _what = "KvSeq"

    def __init__(self, ptr: int, pool: KvPool):
        super().__init__(ptr, (pool,))
        self.pool = pool

    def info_struct(self) -> Any:
        out = L.new(L.EpmKvSeqInfo)
        _l().epm_kv_seq_get_info(self.handle, byref(out))
        return out

    def info(self) -> dict:
        s = self.info_struct()
        d = L.to_dict(s)
        d["layout"] = L.to_dict(s.layout)  # the name from before the fields were flat
        return d

    def prepare_append(self, n_tokens: int, stream: Stream) -> None:
        _l().epm_kv_seq_prepare_append(self.handle, _size(n_tokens, "n_tokens"), _handle(stream, Stream, "stream"))

    def declare_tokens(self, tokens: Sequence[int]) -> None:
        arr, n = _tokens(tokens)
        _l().epm_kv_seq_declare_tokens(self.handle, arr, n)

    def pin(self, n_tokens: int, stream: Stream) -> KvPrefix:
        out = _out_handle()
        _l().epm_kv_prefix_pin(self.handle, _size(n_tokens, "n_tokens"), _handle(stream, Stream, "stream"),
                               byref(out))
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

    def __init__(self, pool: KvPool, layout: Any, max_tokens: int, max_slots: int):
        out = _out_handle()
        _l().epm_kv_batch_create(_handle(pool, KvPool, "pool"), _layout(layout), _size(max_tokens, "max_tokens"),
                                 _u32(max_slots, "max_slots"), byref(out))
        super().__init__(out.value, (pool,))
        self.pool = pool
        self.layout = L.new(L.EpmKvLayout, **{n: getattr(layout, n) for n, _ in L._LAYOUT_FIELDS})

    def close(self) -> None:
        # Unlike other handles, destroying a batch can be refused (slots
        # taken) and the handle then stays valid: only mark it closed once
        # the C call has succeeded.
        if not self.closed:
            self._destroy_fn(self._ptr)
            self._forget()
            self._ptr = None

    def desc_struct(self) -> Any:
        """The EpmKvBatchDesc (base, slot_stride, strides, counts)."""
        out = L.new(L.EpmKvBatchDesc)
        _l().epm_kv_batch_get_desc(self.handle, byref(out))
        return out

    def desc(self) -> dict:
        return L.to_dict(self.desc_struct())

    def take_slot(self, slot: int = L.EPM_KV_BATCH_ANY_SLOT, admit: int = L.EPM_KV_ADMIT_PROMISE) -> KvSlot:
        """A new empty sequence in `slot` (default: the lowest free one). Never waits."""
        out = _out_handle()
        _l().epm_kv_batch_take_slot(self.handle, _u32(slot, "slot"), _u32(admit, "admit"), byref(out))
        return KvSlot(out.value, self)

    def take_shared_slot(self, prefix: KvPrefix, n_tokens: int, stream: Stream,
                         slot: int = L.EPM_KV_BATCH_ANY_SLOT, admit: int = L.EPM_KV_ADMIT_PROMISE) -> KvSlot:
        """A sequence whose first `n_tokens` map `prefix` (a KvPrefix) read-only;
        the host first waits for `stream` (queued work may read the slot)."""
        out = _out_handle()
        _l().epm_kv_batch_take_shared_slot(self.handle, _u32(slot, "slot"), _handle(prefix, KvPrefix, "prefix"),
                                           _size(n_tokens, "n_tokens"), _u32(admit, "admit"),
                                           _handle(stream, Stream, "stream"), byref(out))
        return KvSlot(out.value, self)

    def take_slot_for_tokens(self, tokens: Sequence[int], stream: Stream, slot: int = L.EPM_KV_BATCH_ANY_SLOT,
                             admit: int = L.EPM_KV_ADMIT_PROMISE, namespace: Any = None) -> Tuple[KvSlot, int]:
        """(KvSlot, shared_tokens): shares the longest live prefix of `tokens`
        pinned in the same `namespace` (skip the prefill of the first
        `shared_tokens`), else an empty slot."""
        ns = kv_namespace(namespace)
        arr, n = _tokens(tokens)
        out, shared = _out_handle(), c_uint64()
        sl, ad, st = _u32(slot, "slot"), _u32(admit, "admit"), _handle(stream, Stream, "stream")
        if ns:
            _l().epm_kv_batch_take_slot_for_tokens_ns(self.handle, sl, ns, len(ns), arr, n, ad, st, byref(out),
                                                      byref(shared))
        else:
            _l().epm_kv_batch_take_slot_for_tokens(self.handle, sl, arr, n, ad, st, byref(out), byref(shared))
        return KvSlot(out.value, self), shared.value

    def release_slot(self, slot: KvSlot, stream: Stream) -> None:
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

    def __init__(self, ptr: int, batch: KvBatch):
        # Parents: the pool, and the batch (it cannot be destroyed while a slot is taken).
        Handle.__init__(self, ptr, (batch.pool, batch))
        self.pool = batch.pool
        self.batch = batch
        self.slot = self.slot_info_struct().slot

    def slot_info_struct(self) -> Any:
        out = L.new(L.EpmKvBatchSlotInfo)
        _l().epm_kv_batch_slot_get_info(self.handle, byref(out))
        return out

    def slot_info(self) -> dict:
        return L.to_dict(self.slot_info_struct())

    def release(self, stream: Stream) -> None:
        """`epm_kv_batch_release_slot`: the host waits for `stream`, the slot
        reads zeros again and this object is closed."""
        _l().epm_kv_batch_release_slot(self.handle, _handle(stream, Stream, "stream"))
        # The C handle is gone whether or not Python still references it.
        self._forget()
        self._ptr = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"slot {self.slot}"
        return f"<epmem.KvSlot {state}>"


class KvPrefix(Handle):
    """A pin on a shared prefix; close() (or unpin()) ends the pin."""

    destroy = "epm_kv_prefix_unpin"
    _what = "KvPrefix"

    def __init__(self, ptr: int, pool: KvPool):
        super().__init__(ptr, (pool,))
        self.pool = pool

    def unpin(self) -> None:
        self.close()

    def info(self) -> dict:
        out = L.new(L.EpmKvPrefixInfo)
        _l().epm_kv_prefix_get_info(self.handle, byref(out))
        return L.to_dict(out)

    def commit(self, n_tokens: int, max_tokens: int, admit: int = L.EPM_KV_ADMIT_PROMISE) -> KvSeq:
        """A new sequence whose first `n_tokens` map this prefix read-only."""
        out = _out_handle()
        _l().epm_kv_commit_shared_prefix(self.handle, _size(n_tokens, "n_tokens"), _size(max_tokens, "max_tokens"),
                                         _u32(admit, "admit"), byref(out))
        return KvSeq(out.value, self.pool)


# ---- logging, version, errors ------------------------------------------------------------

_log_callback = None  # the CFUNCTYPE object must outlive its registration


def set_log_callback(fn: Optional[Callable[[int, str], None]], max_level: int = L.EPM_LOG_LEVEL_INFO) -> None:
    """Route epmem's log records to `fn(level: int, message: str)` (None: back to
    stderr). `fn` runs on epmem's threads: it must be quick, thread-safe, and
    must not call epmem. Reset to stderr at interpreter exit."""
    global _log_callback
    max_level = _u32(max_level, "max_level")
    if fn is not None and not callable(fn):
        raise TypeError(f"fn must be a callable fn(level, message) or None, got {_show(fn)}")
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


def version() -> int:
    return _l().epm_version()


def version_string() -> str:
    return _l().epm_version_string().decode()


def status_name(status: int) -> str:
    return _l().epm_status_name(_int(status, "status", (1 << 31) - 1, -(1 << 31))).decode()


def last_error_message() -> str:
    return _l().epm_last_error_message().decode("utf-8", "replace")


def checksum_host(data: HostBuffer, nbytes: Optional[int] = None) -> int:
    """Testing build only (epmem.testing.checksum_host); else TestingUnavailable."""
    from . import testing
    return testing.checksum_host(data, nbytes)
