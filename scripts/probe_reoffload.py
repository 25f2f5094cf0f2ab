#!/usr/bin/env python3
"""Is an offload slower when it is not the process's first? A diagnostic.

In one process: the resident 2048-token prefill, then N rounds of
epmem.torch.offload(model, budget) -> 4 decode steps (the plan, the first
page-ins) -> prefill (best of 3) -> 3 more prefill passes, read through the
handle's stats (page-in copy bytes and device time, decode time) -> 16
batch-1 decode steps -> remove(). Each round prints one line.

    EPM_DEVICE=cuda python3 scripts/probe_reoffload.py --shape small --pct 75 --offloads 3
    EPM_DEVICE=cuda python3 scripts/probe_reoffload.py --empty-cache     # torch's cache emptied after each offload()

--empty-cache empties torch's CUDA cache after each offload() returns, as
offload() itself did before it left the cache alone where the budget fits
beside it. A probe, not a benchmark of record: docs/BENCHMARKS.md's figures
come from scripts/bench_torch.py.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_torch as bt  # noqa: E402
import torch  # noqa: E402

import epmem.torch as et  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small", choices=[s for s in bt.SHAPES if s != "quick"])
    ap.add_argument("--pct", type=int, default=75)
    ap.add_argument("--offloads", type=int, default=3)
    ap.add_argument("--empty-cache", action="store_true", help="torch.cuda.empty_cache() after each offload()")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    model = bt.make_model(a.shape, dev, torch.bfloat16, 32000, 1234, 2048 + 64)
    lin = bt.offloaded_linears(model)
    off = sum(p.numel() * p.element_size() for _, m in lin for p in m.parameters(recurse=False))
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(1, 32000, (1, 2048), generator=g).to(dev)
    short = torch.randint(1, 32000, (1, 8), generator=g).to(dev)
    bt.prefill(model, prompt, dev)
    ref, resident_s = bt.prefill(model, prompt, dev, repeats=3)
    out = {"gpu": torch.cuda.get_device_name(dev), "shape": a.shape, "pct": a.pct,
           "empty_cache": a.empty_cache, "resident_prefill_s": resident_s, "rounds": []}
    print(f"{a.shape}: resident prefill {resident_s * 1e3:.1f} ms", flush=True)
    for i in range(a.offloads):
        h = et.offload(model, off * a.pct // 100)
        try:
            if a.empty_cache:
                torch.cuda.empty_cache()
            bt.decode(model, short, 4, dev)
            tok, ttft = bt.prefill(model, prompt, dev, repeats=3)
            s0 = h.stats()
            with torch.no_grad():
                for _ in range(3):
                    model(prompt, use_cache=True)
            torch.cuda.synchronize(dev)
            s1 = h.stats()
            _, dsec = bt.decode(model, short, 16, dev)
            s2 = h.stats()
        finally:
            h.remove()
        r = {"prefill_s": ttft, "x_resident": ttft / resident_s, "token_ok": tok == ref,
             "pass_htod_bytes": (s1["htod_bytes"] - s0["htod_bytes"]) / 3,
             "pass_htod_ms": (s1["htod_ms"] - s0["htod_ms"]) / 3,
             "pass_decode_ms": (s1["decode_ms"] - s0["decode_ms"]) / 3,
             "b1_step_s": dsec / 16,
             "b1_htod_gbs": (s2["htod_bytes"] - s1["htod_bytes"]) / max(s2["htod_ms"] - s1["htod_ms"], 1e-9) / 1e6}
        out["rounds"].append(r)
        print(f"offload {i}: prefill {ttft * 1e3:.1f} ms ({r['x_resident']:.3f} x resident, token "
              f"{'ok' if r['token_ok'] else 'DIFFERS'}); per prefill pass: copies "
              f"{r['pass_htod_bytes'] / 1e6:.0f} MB in {r['pass_htod_ms']:.2f} ms "
              f"({r['pass_htod_bytes'] / max(r['pass_htod_ms'], 1e-9) / 1e6:.1f} GB/s), decode "
              f"{r['pass_decode_ms']:.2f} ms; b1 {dsec / 16 * 1e3:.1f} ms/step, copies {r['b1_htod_gbs']:.1f} GB/s",
              flush=True)
        if not r["token_ok"]:
            sys.exit(f"offload {i}: the prefill's token differs from the resident one")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
