#!/usr/bin/env python3
"""Batched decode attention over an epmem KV batch, on CUDA through torch (issue 14).

    EPMEM_LIB=.carry/lib/libepmem.so EPM_DEVICE=cuda python3 tests/gpu/kv_batch_attention.py

Plain ctypes against libepmem.so (tests/gpu/_epmkv.py), not the epmem package.
A batch of 24 slots, 20 live with different lengths (7 of them sharing a
300-token prompt pinned from slot 0, some diverging by copy-on-write), is
wrapped as ONE bf16 tensor [max_slots, max_tokens, layers, 2, heads, head_dim]
through __cuda_array_interface__ (an int16 view). Checked:
  - the batch view equals a dense plain tensor holding the same tokens
    (every slot reads only its own data; free slots and tails read zeros);
  - the prompt is one physical copy: the ledger and cudaMemGetInfo both stay
    flat while six slots map it;
  - one SDPA call per layer over the batch view, with a length mask, equals
    the same call over the plain tensor, and each row equals that sequence's
    own call over a plain [1, ...] tensor (same kernel, same data: exact), and
    is close to attention over exactly its own tokens;
  - a CUDA graph captured over the batch step replays correctly while slots
    append (crossing granules, copying on write), leave and join.
Prints "N passed, N failed"; exits 1 on any failure.
"""

import ctypes as C
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _epmkv as E  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

LAYERS, HEADS, DIM, T = 2, 8, 128, 1024  # 8 KiB per token: 256 tokens per 2 MiB granule
MAX_SLOTS, P = 24, 300  # P crosses the first granule: its boundary granule is shared, then copied
BF = torch.bfloat16

results = []


def check(name, ok, detail=""):
    results.append(bool(ok))
    print(("PASS " if ok else "FAIL ") + name + (f" ({detail})" if detail else ""), flush=True)


def attention(kv, q, mask):
    """One SDPA call per layer over every slot: kv [S,T,L,2,H,D], q [S,L,H,1,D], mask [S,1,1,T]."""
    outs = []
    for layer in range(kv.shape[2]):
        k = kv[:, :, layer, 0].permute(0, 2, 1, 3)
        v = kv[:, :, layer, 1].permute(0, 2, 1, 3)
        outs.append(F.scaled_dot_product_attention(q[:, layer], k, v, attn_mask=mask))
    return torch.stack(outs, 1)


class World:
    def __init__(self, lib):
        self.lib = lib
        self.dev = lib.out("device_open", 0)
        self.ts = torch.cuda.Stream()
        torch.cuda.set_stream(self.ts)
        self.es = lib.out("stream_wrap_native", self.dev, C.c_void_p(self.ts.cuda_stream))
        self.arena = lib.out("kv_arena_create", self.dev, 8 << 30)
        lay = lib.layout(LAYERS, HEADS, DIM, 2)
        self.batch = lib.out("kv_batch_create", self.arena, C.byref(lay), T, MAX_SLOTS)
        self.d = lib.desc(self.batch)
        self.g = self.d.granule_bytes
        self.view = E.batch_view(torch, self.d)
        self.plain = torch.zeros(MAX_SLOTS, T, LAYERS, 2, HEADS, DIM, dtype=BF, device="cuda")
        self.seqs = [None] * MAX_SLOTS
        self.lens = [0] * MAX_SLOTS
        self.prefix = None
        self.prompt = None

    def take(self, shared=False):
        lib = self.lib
        if shared:
            q = lib.out("kv_batch_take_shared_slot", self.batch, E.EPM_KV_BATCH_ANY_SLOT, self.prefix, P,
                        E.EPM_KV_ADMIT_ON_DEMAND, self.es)
        else:
            q = lib.out("kv_batch_take_slot", self.batch, E.EPM_KV_BATCH_ANY_SLOT, E.EPM_KV_ADMIT_ON_DEMAND)
        s = lib.slot_info(q).slot
        assert self.seqs[s] is None, f"slot {s} handed out twice"
        self.seqs[s], self.lens[s] = q, (P if shared else 0)
        if shared:
            self.plain[s, :P].copy_(self.prompt)
        return s

    def append(self, s, data):
        n, old = data.shape[0], self.lens[s]
        if n == 0:
            return
        self.lib.kv_seq_prepare_append(self.seqs[s], n, self.es)
        committed = self.lib.slot_info(self.seqs[s]).committed_tokens
        # A granule fresh from the pool holds its last user's bytes (or
        # uninitialized memory): zero what lies past the tokens, so masked
        # positions hold finite values like the plain tensor's zeros.
        self.view[s, old:committed].zero_()
        self.view[s, old:old + n].copy_(data)
        self.plain[s, old:old + n].copy_(data)
        self.lens[s] = old + n

    def release(self, s):
        self.lib.kv_batch_release_slot(self.seqs[s], self.es)
        self.seqs[s], self.lens[s] = None, 0
        self.plain[s].zero_()

    def live(self):
        return [s for s in range(MAX_SLOTS) if self.seqs[s] is not None]

    def mask(self):
        m = torch.zeros(MAX_SLOTS, 1, 1, T, dtype=torch.bool)
        for s in range(MAX_SLOTS):
            m[s, 0, 0, :max(self.lens[s], 1)] = True  # a free slot attends to one zero token, not to nothing
        return m.cuda()

    def owned_expected(self):
        priv = sum(self.lib.slot_info(self.seqs[s]).private_granules for s in self.live())
        pinned = -(-P * self.d.token_stride // self.g) if self.prefix is not None else 0
        return self.g * (1 + pinned + priv)


def tokens(n):
    return torch.randn(n, LAYERS, 2, HEADS, DIM, dtype=BF, device="cuda")


def pick_backend(w, q, mask):
    for b in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel([b]):
                attention(w.view, q, mask)
            torch.cuda.synchronize()
            return b
        except RuntimeError as e:
            print(f"note: SDPA backend {b} refused: {e}", flush=True)
    raise RuntimeError("no SDPA backend accepted the batch view")


def run():
    torch.manual_seed(14)
    lib = E.Lib()
    w = World(lib)
    d, g = w.d, w.g
    check("descriptor: granule-aligned base and stride, room for max_tokens",
          d.base % g == 0 and d.slot_stride % g == 0 and d.slot_stride >= T * d.token_stride
          and d.max_slots == MAX_SLOTS and d.reserved_bytes == MAX_SLOTS * d.slot_stride,
          f"base {d.base:#x}, slot stride {d.slot_stride}")
    check("a new batch reads zeros everywhere", bool((w.view == 0).all()))

    # Slot 0 prefills the prompt and pins it; six slots map it.
    s0 = w.take()
    w.prompt = tokens(P)
    w.append(s0, w.prompt)
    w.prefix = lib.out("kv_prefix_pin", w.seqs[s0], P, w.es)
    torch.cuda.synchronize()
    owned0, free0 = lib.stats(w.arena).owned_bytes, torch.cuda.mem_get_info()[0]
    sharers = []
    for _ in range(6):
        q = lib.out("kv_batch_take_shared_slot", w.batch, E.EPM_KV_BATCH_ANY_SLOT, w.prefix, P,
                    E.EPM_KV_ADMIT_ON_DEMAND, w.es)
        sharers.append(q)
    owned1, free1 = lib.stats(w.arena).owned_bytes, torch.cuda.mem_get_info()[0]
    check("six more slots map the prompt for 0 owned bytes", owned1 == owned0, f"{owned0} -> {owned1}")
    check("and the driver's free memory agrees", abs(free0 - free1) <= 2 * g, f"moved {free0 - free1} bytes")
    for q in sharers:
        s = lib.slot_info(q).slot
        w.seqs[s], w.lens[s] = q, P
        w.plain[s, :P].copy_(w.prompt)
    # Four sharers and the origin diverge (copy-on-write of the boundary granule).
    for s in w.live()[:5]:
        w.append(s, tokens(1 + 37 * s))
    # Thirteen independent slots of varied lengths, around granule edges too.
    for n in (37, 64, 100, 255, 256, 257, 511, 512, 700, 900, 960, 1000, 3):
        w.append(w.take(), tokens(n))
    live = w.live()
    check(f"{len(live)} live slots (>= 16) of {len(set(w.lens[s] for s in live))} lengths", len(live) >= 16)
    torch.cuda.synchronize()
    check("the ledger charges the prompt once", lib.stats(w.arena).owned_bytes == w.owned_expected(),
          f"owned {lib.stats(w.arena).owned_bytes}, expected {w.owned_expected()}")
    check("the batch view equals the plain tensor (own data only, zeros elsewhere)", torch.equal(w.view, w.plain))

    q = torch.randn(MAX_SLOTS, LAYERS, HEADS, 1, DIM, dtype=BF, device="cuda")
    mask = w.mask()
    backend = pick_backend(w, q, mask)
    print(f"SDPA backend: {backend}", flush=True)
    with sdpa_kernel([backend]):
        out_view = attention(w.view, q, mask)
        out_plain = attention(w.plain, q, mask)
        check("batched SDPA over the batch view == over the plain tensor", torch.equal(out_view, out_plain))
        exact, close, worst = True, True, 0.0
        for s in live:
            one = attention(w.plain[s:s + 1], q[s:s + 1], mask[s:s + 1])
            exact &= torch.equal(one, out_view[s:s + 1])
            n = w.lens[s]
            own = []
            for layer in range(LAYERS):
                k = w.plain[s:s + 1, :n, layer, 0].permute(0, 2, 1, 3)
                v = w.plain[s:s + 1, :n, layer, 1].permute(0, 2, 1, 3)
                own.append(F.scaled_dot_product_attention(q[s:s + 1, layer], k, v))
            own = torch.stack(own, 1)
            diff = (own.float() - out_view[s:s + 1].float()).abs().max().item()
            worst = max(worst, diff)
            close &= torch.allclose(own.float(), out_view[s:s + 1].float(), atol=2e-2, rtol=2e-2)
        if backend == SDPBackend.EFFICIENT_ATTENTION:
            check("each row == that sequence's own call over a plain [1, ...] tensor (exact)", exact)
        else:
            check("each row == that sequence's own call (math backend: batch-size dependent, not asserted exact)",
                  True, f"exact: {exact}")
        check("each row is close to attention over exactly its own tokens", close, f"max |diff| {worst:.3g}")

        # Capture one batched decode step over the whole batch, then mutate.
        sq, sm = q.clone(), mask.clone()
        for _ in range(2):
            attention(w.view, sq, sm)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=w.ts):
            sout = attention(w.view, sq, sm)
        torch.cuda.synchronize()
        rng = torch.Generator().manual_seed(7)
        for step in range(8):
            what = []
            for s in w.live():  # every live slot decodes one token; some cross a granule
                w.append(s, tokens(1 if w.lens[s] < T - 1 else 0))
            what.append("append")
            if step in (2, 5):
                for s in (w.live()[1], w.live()[-1]):
                    w.release(s)
                what.append("2 leave")
            if step in (3, 6):
                w.append(w.take(shared=True), tokens(5))
                w.append(w.take(), tokens(int(torch.randint(1, 600, (1,), generator=rng))))
                what.append("2 join")
            if step == 4:
                w.release(s0)  # the origin leaves; the pinned prompt lives on
                what.append("origin leaves")
            sq.copy_(torch.randn(MAX_SLOTS, LAYERS, HEADS, 1, DIM, dtype=BF, device="cuda"))
            sm.copy_(w.mask())
            graph.replay()
            want = attention(w.plain, sq, sm)
            torch.cuda.synchronize()
            live = w.live()
            ok = torch.equal(sout[live], want[live]) and torch.equal(w.view, w.plain)
            check(f"graph replay {step} after {', '.join(what)}: {len(live)} live slots", ok)
        del graph, sout
    check("owned bytes after the churn match the slots' granules", lib.stats(w.arena).owned_bytes == w.owned_expected())

    # Teardown: slots, pin, batch; only the dummy stays owned.
    torch.cuda.synchronize()
    del w.view
    for s in w.live():
        w.release(s)
    lib.kv_prefix_unpin(w.prefix)
    lib.kv_batch_destroy(w.batch)
    st = lib.stats(w.arena)
    check("teardown returns every granule", st.owned_bytes == g and st.sequences == 0, f"owned {st.owned_bytes}")
    lib.kv_arena_destroy(w.arena)
    lib.stream_destroy(w.es)
    lib.device_destroy(w.dev)


def main():
    if not torch.cuda.is_available():
        print("kv_batch_attention: no CUDA device for torch")
        print("0 passed, 1 failed")
        return 1
    try:
        run()
    except Exception:  # a crash is a failure with its traceback, not a silent exit
        traceback.print_exc()
        results.append(False)
    passed = sum(results)
    print(f"{passed} passed, {len(results) - passed} failed")
    return 0 if results and all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
