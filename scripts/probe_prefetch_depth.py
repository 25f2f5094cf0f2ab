#!/usr/bin/env python3
"""Decode speed of one shape against the offload's prefetch depth and sources. A diagnostic.

Builds one shape of scripts/bench_torch.py on CUDA, times its resident batch-1
decode, then for each budget, sources and prefetch depth offloads it with
`epmem.torch.offload(model, budget, sources=..., prefetch_depth=...)` (the
rest defaults), warms it, and times two 16-token decodes on torch's default
stream. It also times, on the host, every acquire and release offload's
forward makes during one more decode (the library's host cost per token, the
rest being torch and Python), and keeps the residency stats of the run. With
--pad-us, each decode is timed again with that much GPU spin added to every
step: a step the host bounds keeps its time until the pad uses up the GPU's
idle time, a step the GPU bounds grows by the pad.

    EPM_DEVICE=cuda python3 scripts/probe_prefetch_depth.py --shape small --pcts 75,25 \\
        --depths 0,2,3,4,6 --sources registered,staged --pad-us 2000,5000 --json OUT.json

Depth 0 means the default (None). A probe, not a benchmark: one JSON line per
configuration on stdout, all of them in --json.
"""
import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_torch as bt  # noqa: E402
import torch  # noqa: E402
import epmem.torch as et  # noqa: E402

KEEP = ("page_ins", "prefetch_page_ins", "wasted_prefetches", "evictions", "eviction_waits", "htod_bytes",
        "compressed_htod_bytes", "decodes", "decode_ms", "stall_ms", "device_stall_ms", "host_stall_ms",
        "peak_resident_bytes", "decode_staging_bytes", "prefetch_depth", "sources", "granularity")


def timed_decode(model, st, prompt, dev):
    """One 16-token decode with offload's acquire/release timed on the host."""
    acc = {"acquire_s": 0.0, "release_s": 0.0, "acquire_calls": 0, "release_calls": 0}

    def timing(fn, name):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[name + "_s"] += time.perf_counter() - t
                acc[name + "_calls"] += 1
        return call

    st._acquire, st._release = timing(st._acquire, "acquire"), timing(st._release, "release")
    try:
        _, secs = bt.decode(model, prompt, 16, dev)
    finally:
        del st._acquire, st._release
    acc["calls"] = acc["acquire_calls"]
    return acc, secs


def padded_decode(model, prompt, steps, dev, cycles):
    """bt.decode's timed loop with `cycles` of GPU spin (torch.cuda._sleep) on
    torch's stream after each step: seconds of the `steps` steps."""
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        bt.sync(dev)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(nxt, past_key_values=cache, use_cache=True)
            cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            if cycles:
                torch.cuda._sleep(cycles)
        bt.sync(dev)
        return time.perf_counter() - t0


def spin_cycles_per_us(dev):
    """torch.cuda._sleep's cycles per microsecond, timed with CUDA events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    a.record()
    torch.cuda._sleep(10_000_000)
    b.record()
    torch.cuda.synchronize(dev)
    return 10_000_000 / (a.elapsed_time(b) * 1e3)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small", choices=sorted(bt.SHAPES))
    ap.add_argument("--pcts", default="75")
    ap.add_argument("--depths", default="0,2,3,4,6")
    ap.add_argument("--sources", default="registered")
    ap.add_argument("--pad-us", default="",
                    help="also time each configuration with this much GPU spin added to every step "
                         "(comma-separated microseconds, CUDA only): a step bound by the host keeps its time "
                         "until the pad exceeds the GPU's idle time; one bound by the GPU grows by the pad")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a smoke run (EPM_DEVICE=host)
    model = bt.make_model(a.shape, dev, torch.bfloat16, 32000, 0, 256)
    total = sum(m.weight.numel() * m.weight.element_size() for _, m in bt.offloaded_linears(model))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 32000, (1, 8), generator=g).to(dev)
    rows = []
    pads = [float(p) for p in a.pad_us.split(",") if p]
    if pads and dev.type != "cuda":
        sys.exit("probe_prefetch_depth: --pad-us needs CUDA")
    cycles_us = spin_cycles_per_us(dev) if pads else 0.0
    with torch.no_grad():
        bt.decode(model, prompt, 2, dev)
        ref, _ = bt.decode(model, prompt, 16, dev)
        resident = [bt.decode(model, prompt, 16, dev)[1] / 16 * 1e3 for _ in range(2)]
        resident_padded = {p: padded_decode(model, prompt, 16, dev, int(p * cycles_us)) / 16 * 1e3 for p in pads}
        print(json.dumps({"shape": a.shape, "resident_ms": resident, "resident_padded_ms": resident_padded}),
              flush=True)
        for pct in [int(p) for p in a.pcts.split(",") if p]:
            for sources in a.sources.split(","):
                for depth in [int(d) for d in a.depths.split(",") if d]:
                    h = et.offload(model, total * pct // 100, sources=sources, prefetch_depth=depth or None)
                    try:
                        bt.decode(model, prompt, 2, dev)
                        toks, _ = bt.decode(model, prompt, 16, dev)
                        ms = [bt.decode(model, prompt, 16, dev)[1] / 16 * 1e3 for _ in range(2)]
                        host, secs = timed_decode(model, model._epmem_offload, prompt, dev)
                        padded = {p: padded_decode(model, prompt, 16, dev, int(p * cycles_us)) / 16 * 1e3
                                  for p in pads}
                        s = h.stats()
                    finally:
                        h.remove()
                    row = {"pct": pct, "sources": sources, "depth": depth or "default", "ms_per_tok": ms,
                           "timed_ms_per_tok": secs / 16 * 1e3,
                           "acquire_us_per_call": host["acquire_s"] / max(host["calls"], 1) * 1e6,
                           "release_us_per_call": host["release_s"] / max(host["calls"], 1) * 1e6,
                           "library_ms_per_tok": (host["acquire_s"] + host["release_s"]) / 16 * 1e3,
                           "padded_ms_per_tok": padded,
                           "tokens_identical": toks == ref,
                           "stats": {k: s.get(k) for k in KEEP}}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    peak = None
    if dev.type == "cuda":  # the pinned H2D peak, for the floor
        buf = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
        dst = torch.empty_like(buf, device=dev)
        dst.copy_(buf, non_blocking=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(4):
            dst.copy_(buf, non_blocking=True)
        torch.cuda.synchronize()
        peak = 4 * buf.numel() / (time.perf_counter() - t)
    out = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "shape": a.shape, "total_bytes": total,
           "resident_ms": resident, "resident_padded_ms": resident_padded, "spin_cycles_per_us": cycles_us,
           "h2d_peak_bytes_per_s": peak, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
