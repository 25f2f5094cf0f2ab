#!/usr/bin/env python3
"""Diagnostic (not a benchmark of record): staged page-ins under variants of
prefetch depth and who fills, on bench_torch's shapes, through
epmem.torch.offload. Prints one line per row (and --json).

A variant is sources:prefetch_depth:caller_fills[:fill_threads[:chunk_MiB[:slots[:fill_ahead_chunks]]]]
(0 for fill_threads or slots: the default), e.g. staged:1:0:0:16:3:2.
Compression is off in every row (compress=False): a compressed weight streams
from the library's own page-locked copy, so "staged" would not stage it.

    EPM_DEVICE=cuda python3 scripts/probe_staged.py --shape small --budgets 25,75
    EPM_DEVICE=host python3 scripts/probe_staged.py --quick     # seconds, tiny model (a smoke run)
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_torch as bt  # noqa: E402
import torch  # noqa: E402

import epmem  # noqa: E402
import epmem.torch as et  # noqa: E402

PER_TOKEN = ("fill_ms", "slot_wait_ms", "background_busy_ms", "background_wait_ms", "htod_ms", "device_stall_ms",
             "host_stall_ms")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small", choices=[s for s in bt.SHAPES if s != "quick"])
    ap.add_argument("--budgets", default="25,75")
    ap.add_argument("--variants", default="registered:1:0,staged:1:0,staged:2:0,staged:3:0,staged:1:1,staged:2:1")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="bench_torch's tiny shape, 4 tokens (host device ok)")
    ap.add_argument("--json")
    a = ap.parse_args()
    shape = "quick" if a.quick else a.shape
    tokens = 4 if a.quick else a.tokens
    with epmem.Device() as d:
        kind = d.kind
    dev = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    if dev.type == "cpu" and not a.quick:
        sys.exit("probe_staged: no CUDA device (EPM_DEVICE=host): only --quick runs on the host device")
    model = bt.make_model(shape, dev, torch.bfloat16, 512 if a.quick else 32000, 1234, 256)
    off = sum(p.numel() * p.element_size() for _, m in bt.offloaded_linears(model) for p in m.parameters())
    prompt = torch.randint(1, 500, (1, 8), generator=torch.Generator().manual_seed(3)).to(dev)
    bt.decode(model, prompt, 2, dev)
    ref, _ = bt.decode(model, prompt, tokens, dev)
    out = []
    for pct in [int(x) for x in a.budgets.split(",")]:
        budget = off * pct // 100
        for v in a.variants.split(","):
            src, depth, caller, *ft = v.split(":")
            extra = {"caller_fills": int(caller)}
            if ft and int(ft[0]):
                extra["fill_threads"] = int(ft[0])
            if len(ft) > 1:
                extra["staging_chunk_bytes"] = int(ft[1]) << 20
            if len(ft) > 2 and int(ft[2]):
                extra["staging_slots"] = int(ft[2])
            if len(ft) > 3:
                extra["fill_ahead_chunks"] = int(ft[3])
            h = et.offload(model, budget, sources=src, prefetch_depth=int(depth), compress=False, **extra)
            try:
                bt.decode(model, prompt, 2, dev)  # the cycle, the plan, the first page-ins
                s0 = h.stats()
                toks, secs = bt.decode(model, prompt, tokens, dev)
                s1 = h.stats()
            finally:
                h.remove()
            # decode() runs one prompt forward and `tokens` steps: passes per token.
            passes = (tokens + 1) / tokens
            per = {k: (s1[k] - s0[k]) / tokens for k in PER_TOKEN}
            row = dict(pct=pct, variant=v, ms_per_token=secs / tokens * 1e3, same=toks == ref,
                       mib_per_pass=(s1["htod_bytes"] - s0["htod_bytes"]) / tokens / passes / 2**20,
                       staged_page_ins=s1["staged_page_ins"] - s0["staged_page_ins"],
                       background_waits=s1["background_waits"] - s0["background_waits"],
                       fill_ahead_mib=(s1["fill_ahead_bytes"] - s0["fill_ahead_bytes"]) / tokens / 2**20,
                       fill_ahead_used_mib=(s1["fill_ahead_used_bytes"] - s0["fill_ahead_used_bytes"]) / tokens / 2**20,
                       **{f"{k}_per_token": x for k, x in per.items()})
            out.append(row)
            print(f"{pct}% {v}: {row['ms_per_token']:.1f} ms/token, {row['mib_per_pass']:.0f} MiB/pass, "
                  + ", ".join(f"{k} {x:.1f}" for k, x in per.items())
                  + f" ms/token, staged page-ins {row['staged_page_ins']}, bg waits {row['background_waits']}, "
                  f"ahead {row['fill_ahead_mib']:.0f}/{row['fill_ahead_used_mib']:.0f} MiB/token, "
                  f"{'same' if row['same'] else 'DIFFER'}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if not all(r["same"] for r in out):
        sys.exit("probe_staged: tokens differ from the resident run")


if __name__ == "__main__":
    main()
