#!/usr/bin/env python3
"""Do host->device copies slow down after a process has offloaded and removed
a model, and does it depend on the stream that copies? A diagnostic for
docs/BENCHMARKS.md's "What else the runs of 2026-12-07 showed" (a process's later
offloads copy 2-6% slower than its first, beside compute more than alone).

In one process: 20 pinned buffers of 61 MiB (about a compressed small-shape
weight) copied to the device with torch, each copy timed with CUDA events,
alone and beside bf16 GEMMs running on another stream (the prefill's load);
on streams made before anything else, and on new streams made at each
measurement; from the buffers pinned at the start, and from buffers pinned
anew at each measurement (freed after it). Measured once before any offload,
then after each round of
epmem.torch.offload(model, 75%) -> decode -> prefill -> remove(). If torch's
own copies slow down after the rounds, the cause is in the process (driver,
device memory), not in epmem's streams or buffers; if only new streams are
slow, it is which copy engine a stream is given; if only the buffers pinned
anew are slow, it is where the driver's page-locked memory now comes from.
("fresh" is memory of the kind epmem's compressed host copies are:
cuMemHostAlloc'ed anew.) Two more variants copy as epmem's page-ins do:
"registered" from pageable buffers registered anew with
cudaHostRegister(PORTABLE | READ_ONLY) (how epmem page-locks raw registered
sources), and "arena" into a block of an epmem device arena made anew (VMM
memory, where epmem's slots and decode staging live); "cu_stream" on a
stream made anew with cuStreamCreate, as each epmem manager makes its copy
streams (torch.cuda.Stream() hands out streams of a pool made once), from
pinned buffers of its own (freed before the stream closes). If only
one of those slows down, the cause is there.

    EPM_DEVICE=cuda python3 scripts/probe_copy_streams.py --json copy_streams.json

A probe, not a benchmark of record.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_torch as bt  # noqa: E402
import torch  # noqa: E402

import epmem  # noqa: E402
import epmem.torch as et  # noqa: E402
from probe_prefill import percentile as pct  # noqa: E402
from probe_reoffload import gbs  # noqa: E402

MiB = 1 << 20
REGISTER_FLAGS = 0x1 | 0x8  # cudaHostRegisterPortable | cudaHostRegisterReadOnly, as epmem registers sources


def check(err, what):
    code = getattr(err, "value", err)
    if code != 0:
        raise SystemExit(f"{what} failed: cudaError {code}")


def copy_rates(srcs, dst, stream, load=None):
    """GB/s of each copy of `srcs` into `dst` on `stream` (CUDA events around
    each), with `load()` enqueued first on its own stream when given."""
    torch.cuda.synchronize()
    if load is not None:
        load()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(srcs) + 1)]
    with torch.cuda.stream(stream):
        ev[0].record(stream)
        for i, s in enumerate(srcs):
            dst.copy_(s, non_blocking=True)
            ev[i + 1].record(stream)
    torch.cuda.synchronize()
    return [s.numel() / (ev[i].elapsed_time(ev[i + 1]) / 1e3) / 1e9 for i, s in enumerate(srcs)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small", choices=[s for s in bt.SHAPES if s != "quick"])
    ap.add_argument("--pct", type=int, default=75)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--buffers", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    early = [torch.cuda.Stream(dev) for _ in range(2)]  # made before anything else
    size = 61 * MiB + 3 * 4096
    srcs = [torch.empty(size, dtype=torch.uint8, pin_memory=True).fill_(i) for i in range(a.buffers)]
    dst = torch.empty(size, dtype=torch.uint8, device=dev)
    load_stream = torch.cuda.Stream(dev)
    x = torch.randn(2048, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 11008, device=dev, dtype=torch.bfloat16)

    def gemms():
        with torch.cuda.stream(load_stream):
            for _ in range(200):  # ~0.3 ms each on an H100: longer than the copies
                x @ w

    model = bt.make_model(a.shape, dev, torch.bfloat16, 32000, 1234, 2048 + 64)
    lin = bt.offloaded_linears(model)
    off = sum(p.numel() * p.element_size() for _, m in lin for p in m.parameters(recurse=False))
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(1, 32000, (1, 2048), generator=g).to(dev)
    short = torch.randint(1, 32000, (1, 8), generator=g).to(dev)
    out = {"gpu": torch.cuda.get_device_name(dev), "shape": a.shape, "pct": a.pct, "measurements": []}

    empty_host = getattr(torch._C, "_host_emptyCache", None)
    if empty_host is None:
        print("this torch has no torch._C._host_emptyCache: no 'fresh' buffers (they would be reused)")

    cudart = torch.cuda.cudart()
    edev = epmem.Device("cuda")

    def measure(label):
        m = {"after": label}
        fresh = [torch.empty(size, dtype=torch.uint8, pin_memory=True).fill_(i) for i in range(a.buffers)] \
            if empty_host else []
        reg = [torch.full((size,), i, dtype=torch.uint8) for i in range(a.buffers)]
        for t in reg:
            check(cudart.cudaHostRegister(t.data_ptr(), size, REGISTER_FLAGS), "cudaHostRegister")
        if not all(t.is_pinned() for t in reg):
            raise SystemExit("torch does not see cudaHostRegister'd memory as pinned: its copies would be staged")
        # torch.cuda.Stream() hands out streams of a fixed pool; epmem's managers
        # create theirs (cuStreamCreate, non-blocking), which may land elsewhere
        cu_new = epmem.Stream(edev)
        cu_st = torch.cuda.ExternalStream(cu_new.native(), device=dev)
        arena = epmem.Arena.create_device(edev, 2 * size)
        block = arena.block(size)
        adst = torch.as_tensor(bt.CudaArray(block.ptr, (size,), "|u1"), device=dev)
        kinds = [("early", early[0], srcs, dst), ("new", torch.cuda.Stream(dev), srcs, dst)]
        kinds += [("fresh", early[1], fresh, dst)] if fresh else []
        # torch's host allocator records an event on each stream a pinned buffer
        # was copied on when the buffer is freed: the stream must outlive them,
        # so cu_stream copies from buffers of its own, freed before it closes
        cu_srcs = [torch.empty(size, dtype=torch.uint8, pin_memory=True).fill_(i) for i in range(a.buffers)]
        kinds += [("registered", early[1], reg, dst), ("arena", early[1], srcs, adst),
                  ("cu_stream", cu_st, cu_srcs, dst)]
        for name, st, bufs, d in kinds:
            copy_rates(bufs[:2], d, st)  # warm
            alone = copy_rates(bufs, d, st)
            beside = copy_rates(bufs, d, st, gemms)
            m[name] = {"alone_p50": pct(alone, 0.5), "beside_p10": pct(beside, 0.1),
                       "beside_p50": pct(beside, 0.5), "beside_p90": pct(beside, 0.9)}
        # copy_rates synchronized: nothing reads them any more (the loop's
        # names too: `bufs` would keep cu_srcs alive past the stream's close)
        del fresh, adst, cu_srcs, kinds, name, st, bufs, d
        torch.cuda.synchronize()  # the host allocator's events on cu_st are recorded: it may close
        block.close()
        arena.close()
        del cu_st
        cu_new.close()
        for t in reg:
            check(cudart.cudaHostUnregister(t.data_ptr()), "cudaHostUnregister")
        del reg
        torch.cuda.synchronize()
        if empty_host:
            # The fresh buffers go back to the driver, not to torch's host cache
            # (where the next measurement's would find them).
            empty_host()
        out["measurements"].append(m)
        print(f"{label:>10}: " + "; ".join(
            f"{k}: alone {v['alone_p50']:.2f}, beside GEMMs {v['beside_p10']:.2f}/{v['beside_p50']:.2f}/"
            f"{v['beside_p90']:.2f} GB/s" for k, v in m.items() if k != "after"), flush=True)

    measure("start")
    for r in range(a.rounds):
        h = et.offload(model, off * a.pct // 100)
        try:
            bt.decode(model, short, 4, dev)
            bt.prefill(model, prompt, dev, repeats=2)
            s = h.stats()
            bt.prefill(model, prompt, dev, repeats=1)
            s2 = h.stats()
            rate = gbs(s2["htod_bytes"] - s["htod_bytes"], s2["htod_ms"] - s["htod_ms"])
            print(f"   round {r + 1}: offload at {a.pct}%, one prefill's page-in copies {rate:.2f} GB/s", flush=True)
            out["measurements"].append({"round": r + 1, "prefill_htod_gbs": rate})
        finally:
            h.remove()
        measure(f"round {r + 1}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
