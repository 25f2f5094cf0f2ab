"""PyTorch integration: offload a model's weights through an epmem residency
manager, and hand epmem memory to torch as tensors without copies.

    import epmem.torch as et
    model.eval()
    h = et.offload(model, budget_bytes=8 << 30)   # decoder-layer linears to host RAM
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=32)
    print(h.stats()["htod_bytes"])
    h.remove()                                     # weights back on the GPU, hooks gone

What offload does per linear (granularity="linear", the default; "block"
hooks whole blocks instead): just before its kernel, the weight is acquired on
torch's *current* stream (wrapped with epm_stream_wrap_native), so the kernel
waits on the device for a page-in and the host never waits; just after, it is
released on the same stream: epmem evicts a weight only after the work queued
so far on that stream has completed. A plain nn.Linear gets a forward of
offload's own (acquire, F.linear on a tensor over epmem's memory, release; its
parameters stay on the host copy); other modules get a pre-hook that points
their parameters at the device copies and a post-hook that points them back.
torch's legacy default stream (handle 0) is adopted by the driver's name for
it, CU_STREAM_LEGACY. On the host device (EPM_DEVICE=host, CPU tensors) the
host waits for the page-ins (acquire_host), since CPU kernels run
synchronously.
See docs/PYTHON.md.
"""

import ctypes
import mmap
import warnings

import torch
from torch import nn

from . import _lib as L
from . import core, errors

PAGE = 4096
# Small weights are packed at this alignment (and registered with their
# padding) so that runs of them are exactly adjacent in host memory, which is
# what epmem's coalescing needs; large ones start on their own page.
SMALL_ALIGN = 256
SOURCES = ("registered", "staged", "pinned")
GRANULARITIES = ("block", "linear")
# Bytes beyond the budget that must be free on the device for offload() to
# leave torch's cache as it is (arena chunks round up; kernels' scratch).
CACHE_HEADROOM = 256 << 20


class OffloadError(RuntimeError):
    """offload() refused or a hook could not run; the module is left usable."""


def _itemsize(dtype):
    return getattr(dtype, "itemsize", None) or torch.empty((), dtype=dtype).element_size()


def _round_up(x, a):
    return (x + a - 1) // a * a


# ---- torch's streams as epmem streams ----------------------------------------------

# The driver's name for the legacy default stream (cuda.h's CU_STREAM_LEGACY):
# torch's default stream is handle 0, which epm_stream_wrap_native refuses
# (NULL), so it is adopted by this name. Work ordered on either is the same.
CU_STREAM_LEGACY = 0x1

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_native_stream(tdev):
    """torch's current stream on `tdev` as a CUstream int (0 for the legacy
    default stream); the private accessor skips making a Stream object per call."""
    if _raw_stream is not None:
        return _raw_stream(tdev.index)
    return torch.cuda.current_stream(tdev).cuda_stream


def adopt_stream(dev, tdev, native):
    """An epmem Stream over torch's stream `native` (0: the legacy default stream)."""
    if native == 0:
        return core.Stream.wrap_native(dev, CU_STREAM_LEGACY)
    # The torch Stream object is kept as the owner: the native stream outlives the adoption.
    return core.Stream.wrap_native(dev, native, owner=torch.cuda.current_stream(tdev))


class AdoptedStreams:
    """torch's streams adopted as epmem streams, once each, by native handle.

    Past `limit` adoptions the cache starts over, closing what it drops (the
    native streams are torch's; only the adoptions go), when `may_clear()`
    says nothing still uses them; until then it grows."""

    def __init__(self, dev, tdev, limit=64, may_clear=lambda: True):
        self.dev, self.tdev, self.limit, self.may_clear = dev, tdev, limit, may_clear
        self._cache = {}

    def __len__(self):
        return len(self._cache)

    def get(self, native):
        """The adoption of torch's stream `native`, and whether it was made by this call."""
        s = self._cache.get(native)
        if s is not None:
            return s, False
        if len(self._cache) >= self.limit and self.may_clear():
            self.close()
        s = adopt_stream(self.dev, self.tdev, native)
        self._cache[native] = s
        return s, True

    def close(self):
        for s in self._cache.values():
            s.close()
        self._cache.clear()


# ---- epmem memory as torch tensors -------------------------------------------------

_INT_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}


class _CudaArray:
    """A __cuda_array_interface__ (v3) over `ptr`; torch keeps it (and `owner`)
    alive as long as the tensor made from it. No "stream" key: ordering is the
    caller's (epmem acquires on the stream that will read)."""

    def __init__(self, ptr, shape, itemsize, strides, owner):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": _INT_TYPESTR[itemsize], "data": (int(ptr), False),
            "strides": None if strides is None else tuple(s * itemsize for s in strides), "version": 3,
        }


def as_tensor(ptr, shape, dtype, device, owner=None, strides=None):
    """A torch tensor over epmem memory at `ptr` (no copy).

    `device`: the epmem.Device the memory belongs to. On CUDA the tensor is a
    CUDA tensor (through the CUDA array interface; dtypes without a typestr,
    such as bfloat16, go through an integer view of the same width); on the host
    device it is a CPU tensor over the host-device mapping. `strides` are in
    elements. `owner` is kept alive as long as the tensor (e.g. the arena or
    block the memory comes from)."""
    shape = tuple(int(s) for s in shape)
    itemsize = _itemsize(dtype)
    if strides is None:
        extent = 1
        for s in shape:
            extent *= s
    else:
        extent = 1 + sum((n - 1) * st for n, st in zip(shape, strides)) if all(shape) else 0
    if device.is_cuda:
        if not torch.cuda.is_available():
            raise OffloadError("epmem's device is CUDA but this torch has no CUDA (a CPU-only build?)")
        t = torch.as_tensor(_CudaArray(ptr, shape, itemsize, strides, owner), device=f"cuda:{device.ordinal}")
        if t.data_ptr() != ptr:
            raise OffloadError("torch copied the CUDA array instead of wrapping it")
        return t.view(dtype)
    nbytes = extent * itemsize
    arr = (ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr)
    arr.owner = owner  # ctypes arrays take attributes: the buffer keeps the owner alive
    flat = torch.frombuffer(arr, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
    flat = flat.view(dtype)
    if strides is None:
        return flat.view(shape)
    return flat.as_strided(shape, strides)


def empty(arena, shape, dtype):
    """A tensor over a new allocation of `arena` (device or pinned), freed when
    the tensor is. Freeing first synchronizes the device (the arena needs no
    queued work to still use it), so this is for setup and tests, not hot loops."""
    numel = 1
    for s in shape:
        numel *= int(s)
    itemsize = _itemsize(dtype)
    block = _SyncedBlock(arena, max(numel * itemsize, 1))
    dev = arena.device
    if arena.pinned:
        # Pinned-arena addresses are host addresses on every device.
        arr = (ctypes.c_uint8 * block.nbytes).from_address(block.ptr)
        arr.owner = block
        return torch.frombuffer(arr, dtype=torch.uint8, count=numel * itemsize).view(dtype).view(tuple(shape))
    return as_tensor(block.ptr, shape, dtype, dev, owner=block)


class _SyncedBlock(core.ArenaBlock):
    """An ArenaBlock whose release first waits for the device (queued work
    may still read it)."""

    def _releaser(self):
        free, *args = super()._releaser()
        return _synced_free, self.arena.device, free, *args


def _synced_free(device, free, *args):
    try:
        device.synchronize()
    finally:
        free(*args)


def kv_seq_tensor(seq, dtype, tokens=None):
    """A KV sequence as a tensor view in its layout, no copy:
    [tokens, layers, 2 (K, V), kv_heads, head_dim], strides from EpmKvSeqInfo.

    `tokens` defaults to the tokens prepared so far (`len_tokens`). Write only
    tokens made private by `prepare_append`: a shared prefix and the tokens not
    prepared yet are mapped read-only (on the host device a write there is a
    segmentation fault, on CUDA a device fault)."""
    info = seq.info_struct()
    lay = info.layout
    itemsize = _itemsize(dtype)
    if itemsize != lay.elem_bytes:
        raise ValueError(f"dtype {dtype} has {itemsize} bytes per element; the layout has {lay.elem_bytes}")
    n = info.len_tokens if tokens is None else int(tokens)
    if n > info.max_tokens:
        raise ValueError(f"{n} tokens > the sequence's max_tokens {info.max_tokens}")
    strides = [lay.token_stride, lay.layer_stride, lay.kv_stride, lay.head_stride, lay.elem_bytes]
    if any(s % itemsize for s in strides):
        raise ValueError("layout strides are not multiples of the element size")
    shape = (n, lay.layers, 2, lay.kv_heads, lay.head_dim)
    return as_tensor(info.base, shape, dtype, seq.pool.device, owner=seq,
                     strides=[s // itemsize for s in strides])


def kv_batch_tensor(batch, dtype):
    """The whole range of a KvBatch as one tensor, no copy:
    [max_slots, max_tokens, layers, 2 (K, V), kv_heads, head_dim], strides from
    its EpmKvBatchDesc (`view[s]` is slot s, at `base + s * slot_stride`).

    The view never moves: slots joining, leaving or appending change what it
    reads (free slots and uncommitted granules read zeros; tokens past a
    slot's `len_tokens` are unspecified: mask by length), never its address,
    so a CUDA graph captured over it stays valid while the batch lives. On CUDA
    it is a CUDA tensor (bfloat16 through an int16 view); on the host device a
    CPU tensor. Write only tokens `prepare_append` made writable. The tensor
    keeps the batch object alive; do not close() the batch while it is used."""
    d = batch.desc_struct()
    itemsize = _itemsize(dtype)
    if itemsize != d.elem_bytes:
        raise ValueError(f"dtype {dtype} has {itemsize} bytes per element; the batch has {d.elem_bytes}")
    strides = [d.slot_stride, d.token_stride, d.layer_stride, d.kv_stride, d.head_stride, d.elem_bytes]
    if any(s % itemsize for s in strides):
        raise ValueError("batch strides are not multiples of the element size")
    shape = (d.max_slots, d.max_tokens, d.layers, 2, d.kv_heads, d.head_dim)
    return as_tensor(d.base, shape, dtype, batch.pool.device, owner=batch,
                     strides=[s // itemsize for s in strides])


# ---- offload -------------------------------------------------------------------------

class _Weight:
    __slots__ = ("param", "name", "shape", "dtype", "nbytes", "reg_bytes", "offset", "host", "id", "device",
                 "compressed")

    def __init__(self):
        self.id = None
        self.compressed = False


class _Unit:
    """What one pair of hooks acquires: a block's weights, or one module's."""

    __slots__ = ("module", "weights", "index", "acquired", "stream", "name", "skip_post", "forward")

    def __init__(self, module, name, index):
        self.module, self.name, self.index = module, name, index
        self.weights = []
        self.acquired = []
        self.stream = None
        self.skip_post = 0  # pre-hooks that raised: their always_call post-hook must not release
        self.forward = None  # the forward set on a plain nn.Linear instead of hooks (_linear_slots)


def _find_blocks(module):
    inner = getattr(module, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers):
        return list(layers), "model.layers"
    best = None
    for name, m in module.named_modules():
        if isinstance(m, nn.ModuleList) and len(m):
            size = sum(p.numel() * p.element_size() for p in m.parameters())
            if size and (best is None or size > best[0]):
                best = (size, name, m)
    if best is None:
        raise OffloadError(f"{type(module).__name__} has no nn.ModuleList of blocks with parameters: "
                           "pass blocks=[...] (the modules whose weights to offload, in forward order)")
    return list(best[2]), best[1]


def _is_default_include(_name, sub):
    return isinstance(sub, nn.Linear)


def _linear_slots(unit):
    """Where a unit's weights go in F.linear (weight index, bias index or None)
    when its module is a plain nn.Linear that offload() can run directly: its
    class keeps nn.Linear's forward, it is not parametrized, nothing replaced
    its forward already (accelerate's hooks do), and the unit's parameters are
    its weight and, if any, its bias. Else None: the unit gets hooks."""
    m = unit.module
    if type(m).forward is not nn.Linear.forward or "forward" in m.__dict__ or \
            getattr(m, "parametrizations", None) is not None:
        return None
    params = m.__dict__.get("_parameters", {})
    names = {}
    for i, w in enumerate(unit.weights):
        if w.param is params.get("weight"):
            names["weight"] = i
        elif w.param is params.get("bias"):
            names["bias"] = i
        else:
            return None
    if "weight" not in names or len(names) != len(unit.weights):
        return None
    return names["weight"], names.get("bias")


def offload(module, budget_bytes, *, blocks=None, include=None, sources="registered", granularity="linear",
            device=None, prefetch_depth=None, policy="cyclic", compress="auto", compress_options=None,
            **residency_config):
    """Offload the weights of `module`'s repeated blocks to host RAM and page them
    into a VRAM budget of `budget_bytes` through an epmem residency manager.

    blocks: the modules to offload, in forward order (default: `module.model.layers`,
        else the nn.ModuleList holding the most parameter bytes).
    include: `include(name, submodule) -> bool` picks the submodules inside a
        block whose parameters (weight, bias, ...) are offloaded (default: nn.Linear).
    sources: "registered" (default: pageable host memory page-locked with the
        device once, so page-ins copy directly), "staged" (pageable, every
        page-in staged through pinned buffers), or "pinned" (host memory from an
        epmem pinned arena).
    granularity: "linear" (default: one pair of hooks per included submodule,
        so each weight is acquired just before the kernel that reads it and
        released just after; the budget need only hold the largest weight, and
        the residency plan streams at most the whole-weight floor,
        docs/RESIDENCY.md) or "block" (a block's weights are acquired together:
        the budget must hold the largest block, and holding a block keeps its
        weights resident during its whole forward, which costs streamed bytes:
        at least (offloaded - budget) x blocks / (blocks - 1) per token).
        "block" falls back to "linear" when the budget cannot hold a block.
    device: an epmem.Device, or "cuda"/"host"/"auto" (default: EPM_DEVICE, on the
        ordinal of the module's CUDA device).
    prefetch_depth: page-ins queued ahead along the forward order (default: 2 for
        sources="staged", whose page-ins the background filler must fill first,
        and for compressed weights, whose copies a decode follows; 1 otherwise.
        On the H200 a staged decode at 75% budget took 63 ms/token at depth 1 and
        51 at depth 2 (docs/BENCHMARKS.md, "Staged decode variants"); compressed,
        the small shape at 75% took 41.1 ms/token at depth 1 and 27.8 at depth 2,
        and the other cells the same within 1%
        (docs/bench/h200-2026-12-02-bench_torch-compressed-gqa-small.json)).
        Under a split plan of compressed weights (what most budgets get) the
        ring holds one tail, so one page-in is ahead whatever the depth
        (docs/RESIDENCY.md, "Mixed sizes").
    policy ("cyclic" or "lru"), **residency_config: EpmResidencyConfig fields
        (e.g. fill_ahead_chunks, staging_slots, caller_fills).
    compress: "auto" (default: on when epmem's device is CUDA, where a page-in
        DMAs the compressed bytes, ~0.7 x raw for bf16, and a kernel decodes them
        far faster than PCIe carries them; off on the host device, where the
        decode runs on the CPU), True or False. When on, each bf16/fp16 weight
        is encoded losslessly into a page-locked host copy epmem owns (the raw
        host copy is given back to the OS: host RAM drops too) and decoded on
        the device at every page-in, bit-exact; weights the codec keeps raw
        (other dtypes, below compress_options["min_bytes"], default 1 MiB, or
        not compressing below 0.9 x) stream raw. Device staging for compressed
        bytes (two buffers, each the largest compressed weight that streams, at
        most 64 MiB) comes out of the budget. stats(): compressed_weights, host_weight_bytes (host RAM of the
        offloaded weights), compressed_htod_bytes, decodes, decode_ms.
    compress_options: dict of epmem.codec options (threads, max_ratio,
        min_bytes, k, format_version, k2) for the encoder.

    Returns an Offload handle (stats(), remove()). Refuses (OffloadError, with
    the module left as it was): a module in training mode, a parameter shared
    between blocks or with the rest of the model, CPU-only torch when epmem's
    device is CUDA, a budget smaller than the largest weight, no matching
    parameters, a module (or parameter) offloaded already, a device mismatch.
    """
    if sources not in SOURCES:
        raise ValueError(f"sources must be one of {SOURCES}, not {sources!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, not {granularity!r}")
    if policy not in ("cyclic", "lru"):
        raise ValueError(f"policy must be 'cyclic' or 'lru', not {policy!r}")
    if not (compress is True or compress is False or compress == "auto"):
        raise ValueError(f"compress must be 'auto', True or False, not {compress!r}")
    compress_options = dict(compress_options or {})
    known = ("threads", "max_ratio", "min_bytes", "k", "format_version", "k2")
    unknown = set(compress_options) - set(known)
    if unknown:
        raise ValueError(f"compress_options: unknown keys {sorted(unknown)} ({', '.join(known)})")
    if getattr(module, "_epmem_offload", None) is not None:
        raise OffloadError(f"{type(module).__name__} is offloaded already: remove() the first offload first "
                           "(epmem.torch.offload_of(module) finds it)")
    if module.training:
        raise OffloadError("offload() is for inference: the module is in training mode (call module.eval() "
                           "first; weights paged in are read-only copies, gradients would not reach them)")
    if not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive int, not {budget_bytes!r}")
    include = include or _is_default_include
    if blocks is None:
        blocks, blocks_name = _find_blocks(module)
    else:
        blocks, blocks_name = list(blocks), "blocks"

    # ---- choose the weights (nothing changes until every check has passed) ----
    # Parameters held by modules outside the blocks (tied embeddings, a shared head).
    in_blocks = {id(m) for blk in blocks for m in blk.modules()}
    outside = {}
    for mname, m in module.named_modules(remove_duplicate=False):
        if id(m) not in in_blocks:
            for pname, p in m.named_parameters(recurse=False):
                outside.setdefault(id(p), f"{mname}.{pname}" if mname else pname)
    chosen, seen, units_b, units_l = [], {}, [], []
    for bi, blk in enumerate(blocks):
        ub = _Unit(blk, f"{blocks_name}.{bi}", len(units_b))
        for sname, sub in blk.named_modules():
            if not include(sname, sub):
                continue
            ul = _Unit(sub, f"{blocks_name}.{bi}.{sname}", 0)
            for pname, p in sub.named_parameters(recurse=False):
                if p is None:
                    continue
                qual = f"{blocks_name}.{bi}.{sname}.{pname}".replace("..", ".")
                if id(p) in seen:
                    # (Within one block too: with granularity="linear" the other
                    # user would read the host copy.)
                    raise OffloadError(f"parameter {qual} is shared with {seen[id(p)][1]}: "
                                       "a shared parameter cannot be offloaded")
                if id(p) in outside:
                    raise OffloadError(f"parameter {qual} is also {outside[id(p)]} (tied/shared outside the "
                                       "blocks): a shared parameter cannot be offloaded")
                if getattr(p, "_epmem_offloaded", False):
                    raise OffloadError(f"parameter {qual} is offloaded already (by another offload())")
                w = _Weight()
                w.param, w.name, w.shape, w.dtype = p, qual, tuple(p.shape), p.dtype
                w.nbytes = p.numel() * p.element_size()
                w.device = p.device
                seen[id(p)] = (bi, qual)
                chosen.append(w)
                ub.weights.append(w)
                ul.weights.append(w)
            if ul.weights:
                units_l.append(ul)
        if ub.weights:
            units_b.append(ub)
    if not chosen:
        raise OffloadError(f"no parameters to offload: no submodule of the {len(blocks)} blocks matched "
                           f"({'nn.Linear' if include is _is_default_include else 'include'})")
    for w in chosen:
        if w.nbytes == 0:
            raise OffloadError(f"parameter {w.name} is empty")

    devices = {w.device for w in chosen}
    if len(devices) != 1:
        raise OffloadError(f"the offloaded parameters are on several devices ({sorted(map(str, devices))}): "
                           "move the module to one device first")
    tdev = devices.pop()
    if tdev.type not in ("cuda", "cpu"):
        raise OffloadError(f"the module's parameters are on {tdev}: offload() needs them on cuda or cpu")
    own_device = not isinstance(device, core.Device)
    if own_device:
        ordinal = tdev.index if tdev.type == "cuda" and tdev.index is not None else 0
        if tdev.type == "cuda" and tdev.index is None:
            ordinal = torch.cuda.current_device()
        dev = core.Device(device, ordinal)
    else:
        dev = device
    try:
        if dev.is_cuda and not torch.cuda.is_available():
            raise OffloadError("epmem's device is CUDA but this torch has no CUDA (a CPU-only build, or no GPU "
                               "visible to torch): install a CUDA torch, or use EPM_DEVICE=host with a CPU module")
        want = torch.device("cuda", dev.ordinal) if dev.is_cuda else torch.device("cpu")
        if tdev != want:
            raise OffloadError(f"device mismatch: the module's parameters are on {tdev} but epmem's device is "
                               f"{dev.kind} (ordinal {dev.ordinal}), which serves {want}: move the module there "
                               f"or open the matching epmem device (EPM_DEVICE)")
        # Registered lengths: small weights padded to SMALL_ALIGN, packed; large ones page-aligned.
        coalesce_below = residency_config.get("coalesce_below_bytes", None)
        cfg_defaults = L.new(L.EpmResidencyConfig)
        L.lib().epm_residency_config_default(ctypes.byref(cfg_defaults))
        small = cfg_defaults.coalesce_below_bytes if coalesce_below is None else coalesce_below
        off = 0
        for w in chosen:
            w.reg_bytes = _round_up(w.nbytes, SMALL_ALIGN)
            if w.reg_bytes >= small:
                off = _round_up(off, PAGE)
            w.offset = off
            off += w.reg_bytes
        total = _round_up(off, PAGE)
        largest = max(chosen, key=lambda x: x.reg_bytes)
        if budget_bytes < largest.reg_bytes:
            raise OffloadError(f"budget {budget_bytes} bytes is smaller than the largest weight, {largest.name} "
                               f"({largest.reg_bytes} bytes): raise the budget")
        largest_block = max(sum(w.reg_bytes for w in u.weights) for u in units_b)
        if granularity == "block" and budget_bytes < largest_block:
            granularity = "linear"  # a whole block could never be acquired at once
        units = units_b if granularity == "block" else units_l
        for i, u in enumerate(units):
            u.index = i
        compressing = dev.is_cuda if compress == "auto" else compress
        if prefetch_depth is None:
            # Two ahead where a page-in is more than one DMA: a staged copy
            # (the filler fills first) or a compressed one (a decode follows).
            prefetch_depth = 2 if sources == "staged" or compressing else 1
        st = _State(module, dev, own_device, tdev, chosen, units, budget_bytes, sources, granularity, total,
                    dict(residency_config, prefetch_depth=prefetch_depth,
                         policy=L.EPM_POLICY_CYCLIC if policy == "cyclic" else L.EPM_POLICY_LRU),
                    compress=compress_options if compressing else None)
    except BaseException:
        if own_device:
            dev.close()
        raise
    return Offload(st)


def offload_of(module):
    """The Offload handle of an offloaded module (e.g. when the one offload()
    returned was dropped), or None."""
    st = getattr(module, "_epmem_offload", None)
    return Offload(st) if isinstance(st, _State) and not st.removed else None


class _State:
    """Everything an offload owns; the hooks and the Offload handle share it."""

    def __init__(self, module, dev, own_device, tdev, weights, units, budget, sources, granularity, total, rcfg,
                 compress=None):
        self.module, self.dev, self.own_device, self.tdev = module, dev, own_device, tdev
        self.host_device = not dev.is_cuda
        self.compress = compress  # codec options when compressing, else None
        self.weights, self.units, self.budget = weights, units, budget
        self.sources, self.granularity, self.total = sources, granularity, total
        self.removed = False
        self.hooks = []
        self.cache = {}
        # (Never cleared while a unit holds weights: its release needs its stream.)
        self.wrapped = AdoptedStreams(dev, tdev, may_clear=lambda: not any(u.acquired for u in self.units))
        self.counters = {"hook_calls": 0, "legacy_stream_calls": 0, "wrapped_streams": 0}
        self.host_range = None
        self.host_range_error = None
        self.pinned_arena = self.pinned_block = None
        self.host_mmap = None
        self.res = self.private = None
        originals = [(w.param, w.param.data) for w in weights]
        try:
            self._setup(rcfg)
        except BaseException:
            for p, data in originals:  # put every weight back as it was
                p.data = data
                if hasattr(p, "_epmem_offloaded"):
                    del p._epmem_offloaded
            self._teardown()
            raise

    def _setup(self, rcfg):
        self.prefetch_depth = rcfg.get("prefetch_depth")
        dev = self.dev
        if self.sources == "pinned":
            g = dev.info()["granularity"]
            cap = _round_up(self.total, g) + g
            self.pinned_arena = core.Arena.create_pinned(dev, cap, chunk_bytes=cap)
            self.pinned_block = self.pinned_arena.block(self.total, PAGE)
            arr = (ctypes.c_uint8 * self.total).from_address(self.pinned_block.ptr)
            arr.owner = self.pinned_block
            self.host_buf = torch.frombuffer(arr, dtype=torch.uint8)
        else:
            # Anonymous mmap: page-aligned pageable memory, returned to the OS when dropped.
            self.host_mmap = mmap.mmap(-1, self.total)
            self.host_buf = torch.frombuffer(self.host_mmap, dtype=torch.uint8)
        self.host_ptr = self.host_buf.data_ptr()
        for w in self.weights:
            w.host = self.host_buf[w.offset:w.offset + w.nbytes].view(w.dtype).view(w.shape)
            w.host.copy_(w.param.data)
        rcfg["register_sources"] = L.EPM_REGISTER_WITHIN_MEMLOCK if self.sources == "registered" \
            else L.EPM_REGISTER_NEVER
        self.res = core.Residency(dev, self.budget, **rcfg)
        # The per-linear calls go straight to the library (the arguments are
        # checked here once: weight ids are the manager's, streams adopted).
        lib = L.lib()
        self._acq, self._rel, self._res_h = lib.epm_residency_acquire, lib.epm_residency_release, self.res.handle
        coded = self._register_compressed() if self.compress is not None else False
        # With weights compressed, the raw host copy is not page-locked as one
        # range (their pages went back to the OS); raw weights are registered
        # one by one on their first page-in instead (register_sources).
        if self.sources == "registered" and not coded:
            try:
                self.host_range = self.res.register_host_range(self.host_ptr, self.total)
            except errors.EpmError as e:
                # The device refused to page-lock the range (locked-memory limit,
                # overlap): page-ins stage instead. Said, not hidden.
                self.host_range_error = str(e)
                warnings.warn(f"epmem.torch.offload: could not register the host copy ({e}); "
                              "page-ins will be staged", RuntimeWarning, stacklevel=3)
        for w in self.weights:
            if w.id is None:
                w.id = self.res.register_weight(self.host_ptr + w.offset, w.reg_bytes)
        self.res.declare_cycle([w.id for u in self.units for w in u.weights])
        if not dev.is_cuda:
            self.private = core.Stream(dev)
        # Point the parameters at the host copy; the device copies go.
        for w in self.weights:
            w.param.data = w.host
            w.param._epmem_offloaded = True
        self.always_call = True
        for u in self.units:
            slots = _linear_slots(u)
            if slots is not None:
                u.module.forward = u.forward = self._linear_forward(u, *slots)
                continue
            self.hooks.append(u.module.register_forward_pre_hook(self._pre_hook(u)))
            try:
                self.hooks.append(u.module.register_forward_hook(self._post_hook(u), always_call=True))
            except TypeError:  # torch < 2.1: no post-hook when forward raises
                self.always_call = False
                self.hooks.append(u.module.register_forward_hook(self._post_hook(u)))
        self.module._epmem_offload = self
        if self.tdev.type == "cuda":
            self._return_cached(torch.cuda.mem_get_info(self.tdev)[0])

    def _return_cached(self, free):
        """The device copies just dropped sit in torch's cache. Give them back
        to the driver only where epmem's budget would not fit in the memory
        the driver has free (`free` bytes): emptying the cache otherwise buys
        nothing, and after two offload/remove cycles that emptied it, a third
        offload's page-in copies ran 5% slower on an H100 (docs/BENCHMARKS.md,
        "What else the runs of 2026-12-07 showed"). Returns whether it emptied."""
        if free < self.budget + CACHE_HEADROOM:
            torch.cuda.empty_cache()
            return True
        return False

    def _register_compressed(self):
        """Register each bf16/fp16 weight compressed; returns whether any was.
        The raw host pages of a compressed weight go back to the OS: its host
        copy is the manager's compressed buffer, and its parameter, between
        forwards, a placeholder of its shape (one element, expanded)."""
        any_coded = False
        for w in self.weights:
            if w.dtype not in (torch.bfloat16, torch.float16):
                continue
            wid, info = self.res.register_compressed(self.host_ptr + w.offset, w.dtype, w.nbytes, **self.compress)
            w.id = wid
            if not info.coded:
                continue  # registered raw over the host copy, as register_weight would
            any_coded = True
            w.compressed = True
            w.host = torch.zeros((), dtype=w.dtype).expand(w.shape)
            if self.host_mmap is not None:
                start = _round_up(w.offset, PAGE)
                end = (w.offset + w.nbytes) // PAGE * PAGE
                if end > start and hasattr(self.host_mmap, "madvise"):
                    self.host_mmap.madvise(mmap.MADV_DONTNEED, start, end - start)
        return any_coded

    def _decoded(self, w):
        """A compressed weight's values, read back from the device (decoded there)."""
        ptr = self.res.acquire_host(w.id)
        try:
            return self._device_tensor(ptr, w).clone()
        finally:
            self.res.release_host(w.id)

    # -- tensors over device memory, cached by address (the arena's VA lives as long as the manager)
    def _device_tensor(self, ptr, w):
        key = (ptr, w.shape, w.dtype)
        t = self.cache.get(key)
        if t is None:
            if len(self.cache) > 4 * len(self.weights) + 64:
                self.cache.clear()
            t = as_tensor(ptr, w.shape, w.dtype, self.dev, owner=self.res)
            self.cache[key] = t
        return t

    def _stream(self):
        """The epmem stream to acquire on: torch's current stream, adopted once."""
        if self.host_device:
            return self.private
        native = current_native_stream(self.tdev)
        if native == 0:
            self.counters["legacy_stream_calls"] += 1
        return self.wrapped_stream(native)

    def wrapped_stream(self, native):
        s, new = self.wrapped.get(native)
        if new:
            self.counters["wrapped_streams"] += 1
        return s

    def _enter(self, unit):
        """The checks before a unit's weights are acquired; its stream."""
        if self.removed:
            raise OffloadError("this offload was removed")
        if unit.acquired:
            raise OffloadError(f"{unit.name} entered again before its forward finished (re-entrant call)")
        if unit.module.training:
            raise OffloadError(f"{unit.name} is in training mode: offloaded weights are for inference "
                               "(call model.eval())")
        if torch.is_grad_enabled() and any(w.param.requires_grad for w in unit.weights):
            raise OffloadError(f"{unit.name}: grad is enabled and its offloaded weights require grad; "
                               "offloaded weights are for inference: run under torch.no_grad() or "
                               "torch.inference_mode(), or call requires_grad_(False)")
        stream = self._stream()
        self.counters["hook_calls"] += 1
        return stream

    def _acquire(self, unit, stream, swap):
        """Acquire every weight of `unit` on `stream`; their device tensors. With
        `swap` each parameter points at its device tensor until `_release`."""
        # On the host device the block's CPU kernels run now, on this
        # thread: the host must wait for each page-in (acquire_host),
        # where on CUDA only the stream waits, on the device.
        host = self.host_device
        tensors = []
        try:
            for w in unit.weights:
                if host:
                    ptr = self.res.acquire_host(w.id)
                else:
                    out = ctypes.c_uint64()
                    self._acq(self._res_h, w.id, stream.handle, ctypes.byref(out))
                    ptr = out.value
                unit.acquired.append(w)
                t = self._device_tensor(ptr, w)
                if swap:
                    w.param.data = t
                tensors.append(t)
        except BaseException as e:
            for w in unit.acquired:
                if swap:
                    w.param.data = w.host
                if host:
                    self.res.release_host(w.id)
                else:
                    self.res.release(w.id, stream)
            unit.acquired = []
            if isinstance(e, errors.AllInUse):
                raise OffloadError(f"{unit.name}: the budget cannot hold its weights at once with the ones "
                                   f"in use ({e.message}); raise the budget or use granularity='linear'") from e
            raise
        unit.stream = stream
        return tensors

    def _release(self, unit, swap):
        """Release what `_acquire` acquired, on its stream (every weight, even
        when one release fails: the first error is raised after)."""
        stream = unit.stream
        err = None
        for w in unit.acquired:
            if swap:
                w.param.data = w.host
            try:
                if not self.host_device:
                    self._rel(self._res_h, w.id, stream.handle)
                else:
                    self.res.release_host(w.id)  # the CPU kernels have returned
            except errors.EpmError as e:
                err = err or e
        unit.acquired = []
        if err is not None:
            raise err

    def _pre_hook(self, unit):
        def hook(mod, args):
            try:
                self._acquire(unit, self._enter(unit), swap=True)
            except BaseException:
                if self.always_call:
                    unit.skip_post += 1
                raise
        return hook

    def _post_hook(self, unit):
        def hook(_mod, _args, _out):
            if unit.skip_post:
                unit.skip_post -= 1
                return None
            if unit.acquired:
                self._release(unit, swap=True)
            return None
        return hook

    def _linear_forward(self, unit, wi, bi):
        """A plain nn.Linear's forward for `unit`: acquire, F.linear on the
        device tensors, release. Its parameters keep pointing at the host
        copies, and the module has no hooks, so torch calls it directly: about
        half the host time per linear of a hook pair that swaps
        `param.data` (docs/BENCHMARKS.md, "Small at 75% decodes at one of
        two speeds")."""
        linear = nn.functional.linear
        mod = unit.module

        def forward(input):
            ts = self._acquire(unit, self._enter(unit), swap=False)
            try:
                return linear(input, ts[wi], mod.bias if bi is None else ts[bi])
            finally:
                self._release(unit, swap=False)
        return forward

    def _teardown(self):
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for u in self.units:
            if u.forward is not None and u.module.__dict__.get("forward") is u.forward:
                del u.module.forward
            u.forward = None
        if getattr(self.module, "_epmem_offload", None) is self:
            del self.module._epmem_offload
        self.cache.clear()
        if self.res is not None:
            try:
                self.res.synchronize()
            finally:
                if self.host_range is not None:
                    self.res.unregister_host_range(self.host_range)
                    self.host_range = None
                self.res.close()
        self.wrapped.close()
        if self.private is not None:
            self.private.close()
        if self.own_device:
            self.dev.close()


class Offload:
    """What offload() returns: stats(), remove(), and a context manager (remove on exit)."""

    def __init__(self, state):
        self._st = state

    def _state(self):
        if self._st is None or self._st.removed:
            raise OffloadError("this offload was removed")
        return self._st

    @property
    def granularity(self):
        return self._state().granularity

    @property
    def sources(self):
        return self._state().sources

    @property
    def offloaded_bytes(self):
        return sum(w.nbytes for w in self._state().weights)

    def stats(self, synchronize=True):
        """The residency counters (EpmResidencyStats fields; `htod_bytes` is what
        was streamed) plus what offload() chose. synchronize=True waits for the
        page-ins first so the times are final."""
        st = self._state()
        if synchronize:
            st.res.synchronize()
        d = st.res.stats()
        d.update(st.counters)
        raw_host = sum(w.nbytes for w in st.weights if not w.compressed)
        d.update(offloaded_bytes=self.offloaded_bytes, weights=len(st.weights), units=len(st.units),
                 granularity=st.granularity, sources=st.sources, device=st.dev.kind,
                 prefetch_depth=st.prefetch_depth,
                 compress=st.compress is not None, host_weight_bytes=raw_host + d["compressed_host_bytes"],
                 host_range_registered=st.host_range is not None, host_range_error=st.host_range_error)
        return d

    def remove(self):
        """Put every weight back on its original device, unhook, free epmem's memory."""
        st = self._state()
        if any(u.acquired for u in st.units):
            raise OffloadError("remove() during a forward of an offloaded block")
        st.res.synchronize()
        for w in st.weights:
            if w.compressed:
                w.param.data = st._decoded(w).to(w.device)
            else:
                w.param.data = w.host.to(w.device, copy=True) if w.device.type != "cpu" else w.host.clone()
            w.host = None
            del w.param._epmem_offloaded
        st.removed = True
        st._teardown()
        st.host_buf = None
        st.pinned_block = st.pinned_arena = None
        self._st = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._st is not None:
            self.remove()

    def __repr__(self):
        if self._st is None:
            return "<epmem.torch.Offload removed>"
        return (f"<epmem.torch.Offload {len(self._st.weights)} weights, {self.offloaded_bytes} bytes, "
                f"budget {self._st.budget}, {self._st.sources}, {self._st.granularity}>")


def offloadable_bytes(module, blocks=None, include=None):
    """The bytes `offload(module, ..., blocks=blocks, include=include)` would move to
    host RAM (its handle's `offloaded_bytes`), without offloading anything: the
    parameters of the included submodules (default: every nn.Linear) of the
    repeated blocks (default: `module.model.layers`, else the nn.ModuleList holding
    the most parameter bytes), each counted once. Pick a budget from it: a budget of
    at least this much keeps every offloaded weight resident after the first
    forward; less pages weights in and out on every forward (at least the largest
    weight, and the largest block for granularity="block")."""
    include = include or _is_default_include
    blocks = _find_blocks(module)[0] if blocks is None else list(blocks)
    seen, total = set(), 0
    for blk in blocks:
        for sname, sub in blk.named_modules():
            if not include(sname, sub):
                continue
            for p in sub.parameters(recurse=False):
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    total += p.numel() * p.element_size()
    return total
