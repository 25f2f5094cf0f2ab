"""A transformers KV cache whose keys and values live in epmem KV sequences.

    import epmem.kvcache as ek
    store = ek.KvStore(model.config, budget_bytes=4 << 30)          # one KV pool, the model's layout
    system = store.prefill_shared(model, system_ids)                 # prefilled once, pinned
    cache = store.request_from_prefix(system, tokens=prompt_ids)     # explicit: epm_kv_commit_shared_prefix
    # or: cache = store.request_for_tokens(prompt_ids)               # content hash: epm_kv_seq_create_for_tokens
    toks = ek.greedy(model, cache, prompt_ids[cache.get_seq_length():], steps=64)
    # or: model.generate(ids, **ek.cache_kwargs(model, cache), ...)
    cache.close()

`EpmCache` is a `transformers.Cache` whose layers (`EpmLayer`, a `CacheLayerMixin`)
return strided views of one epmem sequence in its token-major layout
([token][layer][K, V][head][head_dim]): layer l's keys are
`seq[:len, l, 0]` seen as [1, kv_heads, len, head_dim], so transformers' sdpa or
eager attention reads the sequence in place. Nothing is copied per step: the
new tokens' K/V are written once, straight into the sequence, after
`epm_kv_seq_prepare_append` made their granules private and writable on
torch's current stream (for a request that shares a prefix, the first append
copies the boundary granule on write). A kernel store into a read-only shared
granule would poison the CUDA context, so nothing here ever writes a token
that prepare_append did not make private.

Requests are batch 1 (one sequence per cache): sequences sit at unrelated
addresses, so a batched forward over several of them would need a copy.
See docs/KV.md ("Worked example: a transformers model on epmem sequences").
"""


import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import _lib as L
from . import core, errors
from .torch import AdoptedStreams, as_tensor, current_native_stream


class KvCacheError(RuntimeError):
    """A request the cache cannot serve; the sequence and its neighbours are unchanged."""


class ReservationExceeded(KvCacheError):
    """The tokens of a forward do not fit in the request's reservation (max_tokens)."""


class PrefixMismatch(KvCacheError):
    """A request's prompt diverges inside the shared prefix it asked to start from."""


class RequestClosed(KvCacheError):
    """The request's cache was closed (its sequence destroyed)."""


def _itemsize(dtype):
    return torch.empty((), dtype=dtype).element_size()


def model_kv_shape(config):
    """(layers, kv_heads, head_dim) of a Llama-style transformers config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers, kv_heads, head_dim


def seq_info(seq):
    """epm_kv_seq_get_info of a core.KvSeq as a dict (the header's flat EpmKvSeqInfo)."""
    return seq.info()


def seq_tensor(seq, dtype, device, tokens=None):
    """A sequence as [tokens, layers, 2 (K, V), kv_heads, head_dim] over its memory, no
    copy (default: the whole reservation, max_tokens). Write only tokens that
    prepare_append made private."""
    i = seq_info(seq)
    size = _itemsize(dtype)
    if size != i["elem_bytes"]:
        raise ValueError(f"dtype {dtype} has {size} bytes per element; the layout has {i['elem_bytes']}")
    n = i["max_tokens"] if tokens is None else int(tokens)
    strides = [i["token_stride"], i["layer_stride"], i["kv_stride"], i["head_stride"], size]
    if any(s % size for s in strides):
        raise ValueError("layout strides are not multiples of the element size")
    shape = (n, i["layers"], 2, i["kv_heads"], i["head_dim"])
    return as_tensor(i["base"], shape, dtype, device, owner=seq, strides=[s // size for s in strides])


class _Streams:
    """Runs an epmem call that orders device work on a stream, on torch's current stream.

    CUDA: torch's current stream is adopted (epm_stream_wrap_native, cached per
    stream; the legacy default stream, handle 0, by the driver's name for it,
    CU_STREAM_LEGACY), so the COW copy is ordered before the next kernel and the
    fence covers the kernels queued before. Host device: CPU kernels run
    synchronously, so the host waits for the call's copies."""

    def __init__(self, dev):
        self.dev = dev
        self._private = None
        self.wrapped = None
        if dev.is_cuda:
            self.tdev = torch.device("cuda", dev.ordinal)
            # Each call's use of its stream ends with the call: clearing is always safe.
            self.wrapped = AdoptedStreams(dev, self.tdev)

    @property
    def private(self):
        """An epmem stream of the store's own: the host device's, made on first use."""
        if self._private is None:
            self._private = self.dev.stream()
        return self._private

    def run(self, fn):
        if not self.dev.is_cuda:
            r = fn(self.private)
            self.private.synchronize()
            return r
        return fn(self.wrapped.get(current_native_stream(self.tdev))[0])

    def quiesce(self):
        """Before a sequence is destroyed: no queued kernel may still read or write it."""
        if self.dev.is_cuda:
            torch.cuda.synchronize(self.tdev)
        else:
            self.private.synchronize()


class KvStore:
    """One epmem KV pool with the layout of a transformers model.

    `config`: a Llama-style config (num_hidden_layers, num_key_value_heads, head_dim or
    hidden_size / num_attention_heads). `budget_bytes`: the pool's ledger budget of
    physical granules. `max_tokens`: the default reservation of a request. `dtype`: the
    cache's dtype (the model's). `device`: an epmem.Device (default: EPM_DEVICE)."""

    def __init__(self, config, budget_bytes, max_tokens=4096, dtype=torch.bfloat16, device=None):
        self.layers, self.kv_heads, self.head_dim = model_kv_shape(config)
        self.dtype = dtype
        self.max_tokens = int(max_tokens)
        self.device = device if device is not None else core.Device()
        self.pool = core.KvPool(self.device, budget_bytes)
        self.layout = core.kv_layout_token_major(self.layers, self.kv_heads, self.head_dim, _itemsize(dtype))
        self.streams = _Streams(self.device)

    @property
    def arena(self):
        """Deprecated name of `pool` (the KvPool)."""
        return self.pool

    @property
    def token_bytes(self):
        return self.layout.token_stride

    def stats(self):
        """The KV pool's ledger and granule figures (EpmKvStats as a dict)."""
        return self.pool.stats()

    def request(self, max_tokens=None, admit=L.EPM_KV_ADMIT_PROMISE):
        """An empty request (epm_kv_seq_create): the model prefills all of it."""
        seq = self.pool.seq(self.layout, max_tokens or self.max_tokens, admit)
        return EpmCache(self, seq, 0)

    def request_for_tokens(self, tokens, max_tokens=None, admit=L.EPM_KV_ADMIT_PROMISE, namespace=None):
        """A request that declares its prompt (epm_kv_seq_create_for_tokens): it maps
        the longest pinned prefix of `tokens` (whole 16-token blocks, token ids
        confirmed) read-only and starts at that length (`cache.shared_tokens`, also
        `get_seq_length()`); the model prefills only `tokens[shared:]`.

        `namespace` (a tenant's cache salt, str or bytes; None: the default one):
        only prefixes pinned from requests of the same namespace are found, and a
        prefix pinned from this request is found only by them (docs/KV.md,
        "Namespaces")."""
        tokens = _token_list(tokens)
        seq, shared = self.pool.seq_for_tokens(self.layout, max_tokens or self.max_tokens, tokens, admit,
                                               namespace=namespace)
        return EpmCache(self, seq, shared)

    def request_from_prefix(self, prefix, tokens=None, n_tokens=None, max_tokens=None,
                            admit=L.EPM_KV_ADMIT_PROMISE):
        """A request that starts from a shared prompt explicitly
        (epm_kv_commit_shared_prefix): its first `n_tokens` (default: the whole prefix)
        map the prefix read-only. With `tokens` (the request's whole prompt) the shared
        part is checked first: a prompt that diverges inside it raises PrefixMismatch
        (with the position) and nothing is created. Shorter prompts share only their
        own length."""
        n = prefix.n_tokens if n_tokens is None else int(n_tokens)
        if n > prefix.n_tokens:
            raise PrefixMismatch(f"{n} shared tokens asked for; the prefix holds {prefix.n_tokens}")
        if tokens is not None:
            if prefix.tokens is None:
                raise PrefixMismatch("this prefix was pinned without its token ids (pin(..., tokens=)): "
                                     "the prompt cannot be checked against it")
            tokens = _token_list(tokens)
            n = min(n, len(tokens))
            for i in range(n):
                if tokens[i] != prefix.tokens[i]:
                    raise PrefixMismatch(f"the prompt diverges from the shared prefix at token {i} "
                                         f"(id {tokens[i]}, the prefix has {prefix.tokens[i]}) inside its "
                                         f"{prefix.n_tokens} tokens: start it with request_for_tokens() to "
                                         f"share the part that matches, or ask for n_tokens={i}")
        seq = prefix.handle.commit(n, max_tokens or self.max_tokens, admit)
        return EpmCache(self, seq, n)

    def pin(self, cache, n_tokens=None, tokens=None):
        """Pin the first `n_tokens` of a request as a shared prefix (epm_kv_prefix_pin, on
        torch's current stream: the pin waits for the writes queued before it). The
        origin's granules turn read-only; its next append copies the boundary granule."""
        cache._check_open()
        n = cache.get_seq_length() if n_tokens is None else int(n_tokens)
        handle = self.streams.run(lambda s: cache.seq.pin(n, s))
        return SharedPrefix(handle, None if tokens is None else _token_list(tokens)[:n], n, cache)

    def prefill_shared(self, model, tokens, max_tokens=None, namespace=None):
        """Prefill `tokens` (a system prompt) once into a new sequence that declares them
        (so later requests of the same `namespace` find it by content hash too), pin all
        of them, and return the SharedPrefix. Its origin request stays open
        (`prefix.origin`) until closed."""
        tokens = _token_list(tokens)
        origin = self.request_for_tokens(tokens, max_tokens or max(self.max_tokens, len(tokens)),
                                         namespace=namespace)
        rest = tokens[origin.shared_tokens:]
        if rest:
            forward(model, origin, rest)
        return self.pin(origin, len(tokens), tokens)

    def close(self):
        self.streams.quiesce()
        self.pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SharedPrefix:
    """A pinned prefix: `handle` (core.KvPrefix), its `tokens`, `n_tokens`, and the
    request it was pinned from (`origin`; may be closed: the prefix outlives it)."""

    def __init__(self, handle, tokens, n_tokens, origin):
        self.handle = handle
        self.tokens = tokens
        self.n_tokens = n_tokens
        self.origin = origin

    def info(self):
        return self.handle.info()

    def unpin(self):
        """End the pin: the prefix is freed at once if nobody shares it, else with its last sharer."""
        self.handle.unpin()


class EpmLayer(CacheLayerMixin):
    """One decoder layer's K/V: strided views of the request's epmem sequence."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache, index, n_tokens):
        # CacheLayerMixin.__init__ would set keys/values, which are views here.
        self.cache = cache
        self.index = index
        self.n = n_tokens
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states):
        pass

    def _kv(self, kv, end):
        # [tokens, kv_heads, head_dim] -> [1, kv_heads, tokens, head_dim]: a view, no copy.
        return self.cache._view[:end, self.index, kv].permute(1, 0, 2).unsqueeze(0)

    @property
    def keys(self):
        return self._kv(0, self.n) if self.cache._view is not None else None

    @property
    def values(self):
        return self._kv(1, self.n) if self.cache._view is not None else None

    def update(self, key_states, value_states, *args, **kwargs):
        c = self.cache
        c._check_open()
        if key_states.shape[0] != 1:
            raise KvCacheError(f"an EpmCache holds one request: batch {key_states.shape[0]}")
        if key_states.dtype != c.store.dtype or value_states.dtype != c.store.dtype:
            raise KvCacheError(f"K/V of dtype {key_states.dtype}; the cache holds {c.store.dtype}")
        n = key_states.shape[-2]
        start, end = self.n, self.n + n
        if end > c.prepared:
            c._prepare(self.index, end)
        view = c._view
        # The only writes into the sequence: tokens [start, end) of this layer, private
        # and read-write since _prepare (prepare_append on this stream).
        view[start:end, self.index, 0].copy_(key_states[0].transpose(0, 1))
        view[start:end, self.index, 1].copy_(value_states[0].transpose(0, 1))
        self.n = end
        return self._kv(0, end), self._kv(1, end)

    def get_mask_sizes(self, query_length):
        return self.n + query_length, 0

    def get_seq_length(self):
        return self.n

    def get_max_length(self):
        return self.cache.max_tokens

    def reset(self):
        raise KvCacheError("an EpmCache cannot be reset in place (shared granules are read-only): "
                           "close it and start a new request")

    def reorder_cache(self, beam_idx):
        raise KvCacheError("an EpmCache holds one request: no beam reordering")

    def offload(self):
        pass

    def prefetch(self):
        pass


class EpmCache(Cache):
    """A transformers Cache over one epmem KV sequence (one request, batch 1).

    `shared_tokens`: how many leading tokens map a shared prefix (read-only, charged
    once); the model is run only on the tokens after them. `close()` destroys the
    sequence (after the device finished with it); the cache is unusable afterwards
    (RequestClosed)."""

    def __init__(self, store, seq, shared_tokens):
        self.store = store
        self.seq = seq
        self.shared_tokens = int(shared_tokens)
        info = seq_info(seq)
        self.max_tokens = info["max_tokens"]
        self.prepared = info["len_tokens"]
        if self.prepared != self.shared_tokens:
            raise KvCacheError(f"a new sequence holds {self.prepared} tokens, expected {self.shared_tokens}")
        self._view = seq_tensor(seq, store.dtype, store.device)
        super().__init__(layers=[EpmLayer(self, i, self.shared_tokens) for i in range(store.layers)])

    def _check_open(self):
        if self.seq is None:
            raise RequestClosed("this request's cache is closed")

    def _prepare(self, layer, end):
        # Layer 0 of a forward prepares every layer's tokens at once (one
        # prepare_append per step: a granule holds all layers of its tokens).
        lens = {l.n for l in self.layers}
        if layer != 0 or len(lens) != 1:
            raise KvCacheError(f"layer {layer} wrote past the prepared tokens (layers hold {sorted(lens)} "
                               "tokens: an earlier forward failed midway); close this request")
        if end > self.max_tokens:
            raise ReservationExceeded(f"the forward needs {end} tokens; this request's reservation holds "
                                      f"{self.max_tokens} (max_tokens): nothing was written")
        n = end - self.prepared
        try:
            self.store.streams.run(lambda s: self.seq.prepare_append(n, s))
        except errors.InvalidArgument as e:
            raise ReservationExceeded(f"prepare_append refused {n} tokens: {e.message}") from e
        self.prepared = end

    def info(self):
        self._check_open()
        return seq_info(self.seq)

    def close(self):
        if self.seq is not None:
            self.store.streams.quiesce()
            seq, self.seq, self._view = self.seq, None, None
            seq.close()

    @property
    def closed(self):
        return self.seq is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _token_list(tokens):
    if isinstance(tokens, torch.Tensor):
        return [int(t) for t in tokens.reshape(-1).tolist()]
    return [int(t) for t in tokens]


def _device_of(model):
    return next(model.parameters()).device


_CACHE_KWARG = {}


def cache_kwarg(model):
    """The keyword a model's forward (and generate) takes its Cache by: `cache` where
    the forward names it so (transformers 5.24 on, where `past_key_values` is
    deprecated and goes in 5.40), else `past_key_values` (5.23 and older, which take
    no `cache` and would pass one silently through **kwargs, unused)."""
    fwd = type(model).forward
    name = _CACHE_KWARG.get(fwd)
    if name is None:
        params = inspect.signature(fwd).parameters  # follows the deprecation wrapper's __wrapped__
        name = "cache" if "cache" in params else "past_key_values"
        _CACHE_KWARG[fwd] = name
    return name


def cache_kwargs(model, cache):
    """`{cache_kwarg(model): cache}`: `model(ids, **cache_kwargs(model, c))`,
    `model.generate(ids, **cache_kwargs(model, c), ...)`."""
    return {cache_kwarg(model): cache}


def forward(model, cache, tokens):
    """Run the model on `tokens` (the ones not yet in `cache`) and return the logits of the last."""
    ids = torch.tensor([_token_list(tokens)], device=_device_of(model))
    with torch.no_grad():
        out = model(ids, use_cache=True, **cache_kwargs(model, cache))
    return out.logits[:, -1]


def greedy(model, cache, tokens, steps):
    """Greedy decode: prefill `tokens` (those not in `cache` yet), then `steps` tokens,
    each fed back. Works with any transformers Cache (EpmCache or DynamicCache)."""
    logits = forward(model, cache, tokens)
    out = []
    for i in range(steps):
        nxt = int(logits.float().argmax(-1).item())
        out.append(nxt)
        if i + 1 < steps:
            logits = forward(model, cache, [nxt])
    return out


class Decode:
    """One request's greedy decode, one token per `step()`, so that many requests can
    be interleaved (each step of each request is its own batch-1 forward). `cache`: any
    transformers Cache; `prompt`: the tokens not in it yet."""

    def __init__(self, model, cache, prompt):
        self.model = model
        self.cache = cache
        self.prompt = _token_list(prompt)
        self.tokens = []
        self._logits = None

    def prefill(self):
        self._logits = forward(self.model, self.cache, self.prompt)

    def step(self):
        """Pick the next token from the last logits and feed it back."""
        if self._logits is None:
            self.prefill()
        nxt = int(self._logits.float().argmax(-1).item())
        self._logits = forward(self.model, self.cache, [nxt])
        self.tokens.append(nxt)
        return nxt
