"""epmem's stream-ordered device arena as PyTorch's CUDA allocator.

    import epmem.torch_allocator as eta
    eta.use_as_allocator()            # first thing: before any CUDA work
    import torch
    x = torch.empty(1 << 20, device="cuda")   # from epmem's arena
    eta.stats()                       # in use, committed, peaks, driver calls
    eta.empty_cache()                 # give unused memory back to the driver

PyTorch loads `epm_torch_alloc` / `epm_torch_free` from the library through
`torch.cuda.memory.CUDAPluggableAllocator`. What PyTorch does not forward to a
pluggable allocator is done here: `stats()` for `torch.cuda.memory_stats()`
(which raises under a pluggable allocator), `empty_cache()` for
`torch.cuda.empty_cache()` (a no-op under one). See docs/ALLOCATOR.md for
`record_stream` and `torch.backends.cudnn.benchmark`.
"""

import os
from ctypes import byref, c_uint64

from . import _lib as L

_installed = None


class AllocatorTooLate(RuntimeError):
    """PyTorch's CUDA allocator is already initialized in this process."""


def use_as_allocator(capacity_bytes=None):
    """Make epmem PyTorch's CUDA allocator for this process.

    Call it before the first CUDA allocation (before anything initializes
    CUDA in PyTorch: a tensor on "cuda", `torch.cuda.init()`,
    `torch.cuda.current_device()`, ...). `capacity_bytes`: the most each
    device's arena may commit (default: `EPM_TORCH_CAPACITY`, else the
    device's total memory). Idempotent once installed (a different capacity
    then raises). Raises `AllocatorTooLate` when CUDA is already
    initialized, RuntimeError when PyTorch has no CUDA."""
    global _installed
    import torch

    if _installed is not None:
        if capacity_bytes is not None and capacity_bytes != _installed:
            raise AllocatorTooLate(f"epmem is already PyTorch's allocator (capacity {_installed or 'default'}); "
                                   "the capacity is fixed once installed")
        return
    if not torch.cuda.is_available():
        raise RuntimeError(f"PyTorch {torch.__version__} has no CUDA device (torch.cuda.is_available() is "
                           "False): there is no CUDA allocator to replace")
    if os.environ.get("EPM_DEVICE", "").strip().lower() == "host":
        raise RuntimeError("EPM_DEVICE=host: PyTorch's CUDA tensors need CUDA memory; unset EPM_DEVICE "
                           "(or set it to cuda) to use epmem as PyTorch's allocator")
    if torch.cuda.is_initialized():
        raise AllocatorTooLate(
            "PyTorch has initialized CUDA in this process already, and with it its own CUDA allocator; "
            "call epmem.torch_allocator.use_as_allocator() before any CUDA tensor or torch.cuda call")
    if capacity_bytes is not None:
        L.lib().epm_torch_set_capacity(int(capacity_bytes))
    alloc = torch.cuda.memory.CUDAPluggableAllocator(L.library_path(), "epm_torch_alloc", "epm_torch_free")
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as e:
        raise AllocatorTooLate(f"PyTorch refused to change its CUDA allocator: {e}") from e
    _installed = int(capacity_bytes or 0)


def is_installed():
    """Whether `use_as_allocator` installed epmem in this process."""
    return _installed is not None


def _device(device):
    if device is None:
        import torch
        return torch.cuda.current_device()
    if hasattr(device, "index"):  # torch.device
        return 0 if device.index is None else device.index
    return int(device)


def stats(device=None):
    """epmem's counters for `device` (default: the current CUDA device), as a
    dict: live_bytes / peak_live_bytes (what tensors asked for),
    in_use_bytes (rounded), committed_bytes / peak_committed_bytes (physical
    memory held, PyTorch's "reserved"), driver_alloc_calls, alloc_ns /
    free_ns (time inside the allocator), stream counters. Raises
    `epmem.InvalidState` before the first allocation on `device`."""
    s = L.new(L.EpmOrderedArenaStats)
    L.lib().epm_torch_get_stats(_device(device), byref(s))
    return L.to_dict(s)


def empty_cache(device=-1):
    """Give memory no tensor uses back to the driver (what
    `torch.cuda.empty_cache()` does for PyTorch's own allocator); waits for
    the streams with pending frees first. `device` -1: every device. Bytes
    given back."""
    out = c_uint64()
    L.lib().epm_torch_trim(-1 if device == -1 else _device(device), byref(out))
    return out.value
