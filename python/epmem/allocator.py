"""A stream-ordered device arena from Python (`epm_ordered_arena_*`).

    import epmem
    from epmem.allocator import OrderedArena
    with epmem.Device() as dev, OrderedArena(dev, 1 << 30) as arena:
        s = epmem.Stream(dev)
        p = arena.alloc(4096, s)      # a device address (int) for work on s
        ...                           # queue work using p on s
        arena.free(p, s)              # at once: reused on s now, elsewhere once s's work ran

A block freed on stream S is reused by the next allocation on S at once (S
runs its work in order) and by other streams, or stream-less allocations,
only once the work queued on S before the free has completed. See
docs/ALLOCATOR.md; PyTorch's allocator over the same layer is
`epmem.torch_allocator`.
"""

from ctypes import byref, c_uint64

from . import _lib as L
from . import core


class OrderedArena(core.Handle):
    """A device arena whose frees are ordered after a stream's work.

    `capacity_bytes` is required (virtual space reserved; physical memory is
    committed as used); `chunk_bytes` (0: 16 granules) and `max_allocations`
    (0: 65536) shape it as `epmem.Arena` does."""

    destroy = "epm_ordered_arena_destroy"
    _what = "OrderedArena"

    def __init__(self, device, capacity_bytes, **config):
        cfg = core._config(L.EpmArenaConfig, L.lib().epm_arena_config_default,
                           dict(config, capacity_bytes=capacity_bytes))
        out = core._out_handle()
        L.lib().epm_ordered_arena_create(device.handle, byref(cfg), byref(out))
        super().__init__(out.value, (device,))
        self.device = device

    def alloc(self, nbytes, stream=None):
        """A device address (int) of `nbytes` for work on `stream` (an
        epmem.Stream, or None for no stream in particular)."""
        out = c_uint64()
        L.lib().epm_ordered_arena_alloc(self.handle, nbytes, _stream(stream), byref(out))
        return out.value

    def free(self, addr, stream=None):
        """Free `addr` in order after the work queued so far on `stream`
        (None: the stream it was allocated on). Does not block."""
        L.lib().epm_ordered_arena_free(self.handle, addr, _stream(stream))

    def trim(self):
        """Wait for the work still using freed blocks, give unused memory back;
        bytes given back."""
        out = c_uint64()
        L.lib().epm_ordered_arena_trim(self.handle, byref(out))
        return out.value

    def stats(self):
        """The counters of EpmOrderedArenaStats as a dict."""
        return core._stats(L.lib().epm_ordered_arena_get_stats, self.handle, L.EpmOrderedArenaStats)


def _stream(stream):
    return None if stream is None else stream.handle
