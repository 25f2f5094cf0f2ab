#!/usr/bin/env python3
"""Diagnostic: epmem's copy engine copying pageable memory to the device with
nothing else running, as one large copy and as a sequence of weight-sized copies
(the small shape's block: q, k, v, o of 32 MiB, gate, up, down of 86 MiB) from
distinct, cold sources, one synchronize at the end. Says whether the staged
rows' fill rate in bench_torch is lost at copy boundaries (the engine) or to
what runs beside it (the model).

    EPM_DEVICE=cuda python3 scripts/probe_pageable.py [--total-mib 4096] [--slots 3,4] [--fill-threads 0,16]
        [--target-chunks 0,2] [--tails split,whole] [--stores default,plain]
        [--extra-mib 2,8]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import torch  # noqa: E402

import epmem  # noqa: E402

MiB = 1 << 20
ap = argparse.ArgumentParser()
ap.add_argument("--total-mib", type=int, default=4096)
ap.add_argument("--slots", default="3,4")
ap.add_argument("--fill-threads", default="0", help="comma list; 0 = the engine's default")
ap.add_argument("--target-chunks", default="0", help="comma list of target_chunks; 0 = the engine's default (4)")
ap.add_argument("--stores", default="default", help="comma list: default (streaming below 64 MiB), plain "
                "(EPM_COPY_ENGINE_NO_STREAMING_STORES)")
ap.add_argument("--extra-mib", default="", help="comma list of more copy sizes in MiB (e.g. 2,8: a 1B model's "
                "k/v and q)")
ap.add_argument("--tails", default="split,whole", help="split: the last chunks halve (the engine default); "
                "whole: EPM_COPY_ENGINE_NO_SPLIT_TAIL")
a = ap.parse_args()

block = [32 * MiB] * 4 + [86 * MiB] * 3
sizes = {"one copy": [a.total_mib * MiB], "32 MiB copies": [32 * MiB] * (a.total_mib // 32),
         "86 MiB copies": [86 * MiB] * (a.total_mib // 86),
         "block mix": block * max(1, (a.total_mib * MiB) // sum(block))}
for m in [int(x) for x in a.extra_mib.split(",") if x]:
    sizes[f"{m} MiB copies"] = [m * MiB] * (a.total_mib // m)
sizes = {k: v for k, v in sizes.items() if v}  # --total-mib below a pattern's copy size drops it
total = max(sum(v) for v in sizes.values())
src = torch.empty(total, dtype=torch.uint8)
src.fill_(3)
with epmem.Device() as dev, dev.alloc(total) as dst, epmem.StagingPool(dev) as pool:
    for slots in [int(x) for x in a.slots.split(",")]:
        for ft, tail, tc, stores in [(int(x), t, int(c), w) for x in a.fill_threads.split(",")
                                     for t in a.tails.split(",") for c in a.target_chunks.split(",")
                                     for w in a.stores.split(",")]:
            cfg = {"slots": slots, "flags": (epmem.EPM_COPY_ENGINE_NO_SPLIT_TAIL if tail == "whole" else 0)
                   | (epmem.EPM_COPY_ENGINE_NO_STREAMING_STORES if stores == "plain" else 0)}
            if tc:
                cfg["target_chunks"] = tc
            if ft:
                cfg["fill_threads"] = ft
            with epmem.CopyEngine(pool, **cfg) as eng:
                for name, seq in sizes.items():
                    best = 0.0
                    for rep in range(3):
                        t0 = time.perf_counter()
                        off = 0
                        for n in seq:
                            eng.htod(dst.ptr + off, src[off:off + n], n, fence=False)
                            off += n
                        eng.synchronize()
                        secs = time.perf_counter() - t0
                        if rep:
                            best = max(best, off / secs)
                    st = eng.stats()
                    print(f"slots {slots} fill_threads {ft or 'default'} target_chunks {tc or 'default'} tail {tail} stores {stores} {name}: {best / 1e9:.1f} GB/s "
                          f"({len(seq)} copies, {off / MiB:.0f} MiB; engine totals: fill {st['fill_ms']:.0f} ms, "
                          f"slot waits {st['slot_wait_ms']:.0f} ms, bypassed {st['bypassed']})", flush=True)
