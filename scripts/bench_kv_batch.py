#!/usr/bin/env python3
"""bench_kv_batch: batched decode attention over an epmem KV batch vs the same
data in one dense torch tensor. GPU only.

    PYTHONPATH=python EPMEM_LIB=.carry/lib/libepmem.so python3 scripts/bench_kv_batch.py [--json PATH] [--iters N]
    PYTHONPATH=python EPMEM_LIB=target/release/libepmem.so python3 scripts/bench_kv_batch.py --dry-run

For B slots × T tokens (one layer, 8 KV heads × 128, bf16), every slot full:
one torch SDPA decode step (q [B, H, 1, D], a length mask) over
  - the batch view: epmem's batch range as one strided tensor (2 MiB VMM
    granules, slots at the batch's slot stride), and
  - dense: a contiguous torch tensor holding the same bytes;
timed with CUDA events (median of N after a warm-up), eager and as a replayed
CUDA graph. ratio = dense time / batch time; the target is >= 0.98 (the batch
view costs at most 2%). The ratio is what was measured, PASS or MISS.

--dry-run: no timing, no CUDA: one small configuration on epmem's host
device with CPU tensors, checking what the timed runs rely on (the batch view
and its dense copy hold the same bytes at different addresses, and the step
gives equal outputs over both). tests/python/test_kv_batch.py runs it.
"""

import argparse
import json
import os
import statistics
import sys

try:
    import epmem
except ImportError:  # run from a checkout without PYTHONPATH=python
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import epmem

HEADS, DIM = 8, 128
CONFIGS = [(16, 2048), (64, 2048), (128, 2048), (32, 8192)]


def backend(device_type="cuda"):
    """The SDPA kernel every timed and checked call uses: one kernel for both
    operands, so equal bytes in give equal bytes out, and the ratio compares
    addressing only. The memory-efficient kernel takes a boolean mask and a
    batch stride; torch's own choice may differ between calls (its priority
    list tries backends in turn), which would compare two kernels. CPU tensors
    (the dry run): None, torch's own CPU choice (no pinned kernel)."""
    from torch.nn.attention import SDPBackend
    return SDPBackend.EFFICIENT_ATTENTION if device_type == "cuda" else None


def step(kv, q, mask):
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    k = kv[:, :, 0, 0].permute(0, 2, 1, 3)
    v = kv[:, :, 0, 1].permute(0, 2, 1, 3)
    be = backend(q.device.type)
    if be is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with sdpa_kernel([be]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def timed(fn, iters):
    import torch
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(ts)


def graphed(fn):
    import torch
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=torch.cuda.current_stream()):
        fn()
    return g


class Config:
    """One batch of `b` full slots of `t` tokens, its view and a dense copy."""

    def __init__(self, torch, arena, layout, stream, b, t, tdev):
        import epmem.torch as et
        self.batch = arena.batch(layout, t, b)
        self.slots = [self.batch.take_slot(i, admit=epmem.EPM_KV_ADMIT_ON_DEMAND) for i in range(b)]
        for q in self.slots:
            q.prepare_append(t, stream)
        stream.synchronize()
        self.d = self.batch.desc_struct()
        self.view = et.kv_batch_tensor(self.batch, torch.bfloat16)
        self.view.copy_(torch.randn(self.view.shape, dtype=torch.bfloat16, device=tdev))
        # clone, not contiguous(): with slot_stride == T × token_stride the
        # view is already contiguous and contiguous() would return the batch itself.
        self.dense = self.view.clone(memory_format=torch.contiguous_format)
        self.q = torch.randn(b, HEADS, 1, DIM, dtype=torch.bfloat16, device=tdev)
        self.mask = torch.ones(b, 1, 1, t, dtype=torch.bool, device=tdev)

    def verify(self, torch):
        """What the timings compare must be the same bytes at other addresses."""
        if self.dense.data_ptr() == self.view.data_ptr() or not torch.equal(self.dense, self.view):
            raise AssertionError("the dense copy is not a copy of the batch view")
        a, b = step(self.view, self.q, self.mask), step(self.dense, self.q, self.mask)
        if not torch.equal(a, b):
            diff = float((a.float() - b.float()).abs().max())
            raise AssertionError(f"same data, same kernel ({backend(a.device.type)}): the outputs differ "
                                 f"(max |diff| {diff:.3g}; view strides {tuple(self.view.stride())}, "
                                 f"dense {tuple(self.dense.stride())})")

    def close(self, stream):
        self.view = self.dense = None
        for q in self.slots:
            q.release(stream)
        self.batch.close()


def dry_run():
    import torch
    with epmem.Device("host") as dev, dev.stream() as s:
        arena = epmem.KvPool(dev, 1 << 30)
        layout = epmem.kv_layout_token_major(1, HEADS, DIM, 2)
        b, t = 4, 512
        c = Config(torch, arena, layout, s, b, t, torch.device("cpu"))
        c.verify(torch)
        d = c.d
        ok = (c.view.data_ptr() == d.base and c.view.shape[:2] == (b, t)
              and arena.stats()["owned_bytes"] >= b * t * d.token_stride)
        c.close(s)
        ok = ok and arena.stats()["sequences"] == 0
        arena.close()
    print(f"bench_kv_batch: dry run {b}x{t} on the host device: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--dry-run", action="store_true",
                    help="no timing: check the setup on the host device with CPU tensors")
    args = ap.parse_args(argv)
    if args.dry_run:
        return dry_run()
    import torch
    if not torch.cuda.is_available():
        print("bench_kv_batch: no CUDA device for torch (--dry-run checks the setup on the host device)")
        return 1
    dev = epmem.Device("cuda")
    ts = torch.cuda.Stream()
    torch.cuda.set_stream(ts)
    es = epmem.Stream.wrap_native(dev, ts.cuda_stream, owner=ts)
    arena = epmem.KvPool(dev, 32 << 30)
    lay = epmem.kv_layout_token_major(1, HEADS, DIM, 2)
    rows, scenarios = [], []
    print(f"## bench_kv_batch on {torch.cuda.get_device_name()} (torch {torch.__version__})\n")
    print("| slots | tokens | KV MiB | batch eager µs | dense eager µs | ratio | batch graph µs | dense graph µs | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    failures = []
    for b, t in CONFIGS:
        c = Config(torch, arena, lay, es, b, t, torch.device("cuda"))
        try:
            c.verify(torch)
        except AssertionError as e:
            print(f"| {b} | {t} | - | FAILED: {e} |")
            failures.append(f"{b}x{t}: {e}")
            c.close(es)
            continue
        view, dense, q, mask = c.view, c.dense, c.q, c.mask
        eb = timed(lambda: step(view, q, mask), args.iters)
        ed = timed(lambda: step(dense, q, mask), args.iters)
        gb, gd = graphed(lambda: step(view, q, mask)), graphed(lambda: step(dense, q, mask))
        rb = timed(gb.replay, args.iters)
        rd = timed(gd.replay, args.iters)
        mib = b * t * c.d.token_stride / 2**20
        print(f"| {b} | {t} | {mib:.0f} | {eb:.1f} | {ed:.1f} | {ed / eb:.3f} | {rb:.1f} | {rd:.1f} | {rd / rb:.3f} |")
        rows.append((b, t, ed / eb, rd / rb))
        for name, v in (("batch_eager", eb), ("dense_eager", ed), ("batch_graph", rb), ("dense_graph", rd)):
            scenarios.append({"group": "attention", "name": f"{name}/{b}x{t}", "unit": "us", "median": v})
        scenarios.append({"group": "ratio", "name": f"dense_over_batch_eager/{b}x{t}", "unit": "x", "median": ed / eb})
        scenarios.append({"group": "ratio", "name": f"dense_over_batch_graph/{b}x{t}", "unit": "x", "median": rd / rb})
        del gb, gd, view, dense
        torch.cuda.synchronize()
        c.close(es)
    print()
    for b, t, re, rg in rows:
        v = lambda r: "PASS" if r >= 0.98 else "MISS"  # noqa: E731
        print(f"- target {b}x{t}: ratio dense/batch eager {re:.3f} ({v(re)}), graph {rg:.3f} ({v(rg)}); target >= 0.98")
    print(f"- SDPA backend: {backend()} for every call (both operands)")
    for f in failures:
        print(f"- FAILED {f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "kv_batch", "device": torch.cuda.get_device_name(), "backend": str(backend()),
                       "failures": failures, "scenarios": scenarios}, f, indent=1)
    arena.close()
    es.close()
    dev.close()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
