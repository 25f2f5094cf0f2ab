#!/usr/bin/env python3
"""bench_kv_batch: batched decode attention over an epmem KV batch vs the same
data in one dense torch tensor (issue 14, bench item 4). GPU only.

    EPMEM_LIB=.carry/lib/libepmem.so EPM_DEVICE=cuda python3 scripts/bench_kv_batch.py [--json PATH] [--iters N]

For B slots × T tokens (one layer, 8 KV heads × 128, bf16), every slot full:
one torch SDPA decode step (q [B, H, 1, D], a length mask) over
  - the batch view: epmem's batch range as one strided tensor (2 MiB VMM
    granules, slots at the batch's slot stride), and
  - dense: a contiguous torch tensor holding the same bytes;
timed with CUDA events (median of N after a warm-up), eager and as a replayed
CUDA graph. ratio = dense time / batch time; the target is >= 0.98 (the batch
view costs at most 2%). The ratio is what was measured, PASS or MISS.
"""

import argparse
import ctypes as C
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "gpu"))
import _epmkv as E  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HEADS, DIM = 8, 128
CONFIGS = [(16, 2048), (64, 2048), (128, 2048), (32, 8192)]


def step(kv, q, mask):
    k = kv[:, :, 0, 0].permute(0, 2, 1, 3)
    v = kv[:, :, 0, 1].permute(0, 2, 1, 3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def timed(fn, iters):
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
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=torch.cuda.current_stream()):
        fn()
    return g


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    lib = E.Lib()
    dev = lib.out("device_open", 0)
    ts = torch.cuda.Stream()
    torch.cuda.set_stream(ts)
    es = lib.out("stream_wrap_native", dev, C.c_void_p(ts.cuda_stream))
    arena = lib.out("kv_arena_create", dev, 32 << 30)
    lay = lib.layout(1, HEADS, DIM, 2)
    rows, scenarios = [], []
    print(f"## bench_kv_batch on {torch.cuda.get_device_name()} (torch {torch.__version__})\n")
    print("| slots | tokens | KV MiB | batch eager µs | dense eager µs | ratio | batch graph µs | dense graph µs | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b, t in CONFIGS:
        batch = lib.out("kv_batch_create", arena, C.byref(lay), t, b)
        seqs = [lib.out("kv_batch_take_slot", batch, i, E.EPM_KV_ADMIT_ON_DEMAND) for i in range(b)]
        for q in seqs:
            lib.kv_seq_prepare_append(q, t, es)
        d = lib.desc(batch)
        view = E.batch_view(torch, d)
        view.copy_(torch.randn(view.shape, dtype=torch.bfloat16, device="cuda"))
        # clone, not contiguous(): with slot_stride == T × token_stride the
        # view is already contiguous and contiguous() would return the batch itself.
        dense = view.clone(memory_format=torch.contiguous_format)
        assert dense.data_ptr() != view.data_ptr() and torch.equal(dense, view)
        q = torch.randn(b, HEADS, 1, DIM, dtype=torch.bfloat16, device="cuda")
        mask = torch.ones(b, 1, 1, t, dtype=torch.bool, device="cuda")
        out_b, out_d = step(view, q, mask), step(dense, q, mask)
        assert torch.equal(out_b, out_d), "same data, same kernel: the outputs must be equal"
        eb = timed(lambda: step(view, q, mask), args.iters)
        ed = timed(lambda: step(dense, q, mask), args.iters)
        gb, gd = graphed(lambda: step(view, q, mask)), graphed(lambda: step(dense, q, mask))
        rb = timed(gb.replay, args.iters)
        rd = timed(gd.replay, args.iters)
        mib = b * t * d.token_stride / 2**20
        print(f"| {b} | {t} | {mib:.0f} | {eb:.1f} | {ed:.1f} | {ed / eb:.3f} | {rb:.1f} | {rd:.1f} | {rd / rb:.3f} |")
        rows.append((b, t, ed / eb, rd / rb))
        for name, v in (("batch_eager", eb), ("dense_eager", ed), ("batch_graph", rb), ("dense_graph", rd)):
            scenarios.append({"group": "attention", "name": f"{name}/{b}x{t}", "unit": "us", "median": v})
        scenarios.append({"group": "ratio", "name": f"dense_over_batch_eager/{b}x{t}", "unit": "x", "median": ed / eb})
        scenarios.append({"group": "ratio", "name": f"dense_over_batch_graph/{b}x{t}", "unit": "x", "median": rd / rb})
        del gb, gd, view, dense, out_b, out_d
        torch.cuda.synchronize()
        for q in seqs:
            lib.kv_batch_release_slot(q, es)
        lib.kv_batch_destroy(batch)
    print()
    for b, t, re, rg in rows:
        v = lambda r: "PASS" if r >= 0.98 else "MISS"  # noqa: E731
        print(f"- target {b}x{t}: ratio dense/batch eager {re:.3f} ({v(re)}), graph {rg:.3f} ({v(rg)}); target >= 0.98")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "kv_batch", "device": torch.cuda.get_device_name(), "scenarios": scenarios}, f, indent=1)
    lib.kv_arena_destroy(arena)
    lib.stream_destroy(es)
    lib.device_destroy(dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
