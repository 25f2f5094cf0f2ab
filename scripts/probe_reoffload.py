#!/usr/bin/env python3
"""Is an offload slower when it is not the process's first? A diagnostic.

In one process: the resident 2048-token prefill, then N rounds of
epmem.torch.offload(model, budget) -> 4 decode steps (the plan, the first
page-ins) -> prefill (best of 3) -> 3 more prefill passes, read through the
handle's stats (page-in copy bytes and device time, decode time) -> 16
batch-1 decode steps -> remove(). Each round prints one line.

    EPM_DEVICE=cuda python3 scripts/probe_reoffload.py --shape small --pcts 75,75,75
    EPM_DEVICE=cuda python3 scripts/probe_reoffload.py --empty-cache     # torch's cache emptied after each offload()
    EPM_DEVICE=cuda python3 scripts/probe_reoffload.py --pcts 25,50,75 --batches --uva   # the bench's sequence
    EPM_DEVICE=host python3 scripts/probe_reoffload.py --shape quick --tokens 64        # the mechanics, on the CPU

--empty-cache empties torch's CUDA cache after each offload() returns, as
offload() itself did before it left the cache alone where the budget fits
beside it. --batches decodes batches of 16 and 64 (2 steps each) before each
round's prefill, as bench_torch's warm-up does; --uva runs a UVA cell (the
bench's run_uva: batch-1 decode and the prefill) after each round at the
round's budget, as bench_torch does after each epmem cell. A probe, not a
benchmark of record: docs/BENCHMARKS.md's figures come from
scripts/bench_torch.py.
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


def gbs(nbytes, ms):
    """Bytes over milliseconds, in GB/s."""
    return nbytes / max(ms, 1e-9) / 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small", choices=list(bt.SHAPES))
    ap.add_argument("--pcts", default="75,75,75", help="one round per budget, in this order")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length of the prefill")
    ap.add_argument("--empty-cache", action="store_true", help="torch.cuda.empty_cache() after each offload()")
    ap.add_argument("--batches", action="store_true", help="batch 16 and 64 decodes before each round's prefill")
    ap.add_argument("--uva", action="store_true", help="a UVA cell after each round, at its budget")
    ap.add_argument("--json")
    a = ap.parse_args()
    with epmem.Device() as edev:
        cuda = edev.kind == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    vocab = 32000 if a.shape != "quick" else 512
    model = bt.make_model(a.shape, dev, torch.bfloat16, vocab, 1234, a.tokens + 64)
    lin = bt.offloaded_linears(model)
    off = sum(p.numel() * p.element_size() for _, m in lin for p in m.parameters(recurse=False))
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(1, vocab, (1, a.tokens), generator=g).to(dev)
    short = torch.randint(1, vocab, (1, 8), generator=g).to(dev)
    batched = [torch.randint(1, vocab, (b, 8), generator=g).to(dev) for b in (16, 64)]
    host = bt.pinned_copies(model, dev) if a.uva else None
    bt.prefill(model, prompt, dev)
    ref, resident_s = bt.prefill(model, prompt, dev, repeats=3)
    out = {"gpu": torch.cuda.get_device_name(dev) if cuda else "cpu", "shape": a.shape, "pcts": a.pcts,
           "empty_cache": a.empty_cache, "batches": a.batches, "uva": a.uva,
           "resident_prefill_s": resident_s, "rounds": []}
    print(f"{a.shape}: resident prefill {resident_s * 1e3:.1f} ms", flush=True)
    for i, pct in enumerate(int(p) for p in a.pcts.split(",")):
        budget = off * pct // 100
        h = et.offload(model, budget)
        try:
            if a.empty_cache and cuda:
                torch.cuda.empty_cache()
            bt.decode(model, short, 4, dev)
            for b in batched if a.batches else []:
                bt.decode(model, b, 2, dev)
            tok, ttft = bt.prefill(model, prompt, dev, repeats=3)
            s0 = h.stats()
            with torch.no_grad():
                for _ in range(3):
                    model(prompt, use_cache=True)
            bt.sync(dev)
            s1 = h.stats()
            _, dsec = bt.decode(model, short, 16, dev)
            s2 = h.stats()
        finally:
            h.remove()
        r = {"pct": pct, "prefill_s": ttft, "x_resident": ttft / resident_s, "token_ok": tok == ref,
             "pass_htod_bytes": (s1["htod_bytes"] - s0["htod_bytes"]) / 3,
             "pass_htod_ms": (s1["htod_ms"] - s0["htod_ms"]) / 3,
             "pass_decode_ms": (s1["decode_ms"] - s0["decode_ms"]) / 3,
             "b1_step_s": dsec / 16,
             "b1_htod_gbs": gbs(s2["htod_bytes"] - s1["htod_bytes"], s2["htod_ms"] - s1["htod_ms"])}
        r["pass_htod_gbs"] = gbs(r["pass_htod_bytes"], r["pass_htod_ms"])
        out["rounds"].append(r)
        print(f"offload {i} at {pct}%: prefill {ttft * 1e3:.1f} ms ({r['x_resident']:.3f} x resident, token "
              f"{'ok' if r['token_ok'] else 'DIFFERS'}); per prefill pass: copies "
              f"{r['pass_htod_bytes'] / 1e6:.0f} MB in {r['pass_htod_ms']:.2f} ms "
              f"({r['pass_htod_gbs']:.1f} GB/s), decode "
              f"{r['pass_decode_ms']:.2f} ms; b1 {dsec / 16 * 1e3:.1f} ms/step, copies {r['b1_htod_gbs']:.1f} GB/s",
              flush=True)
        if not r["token_ok"]:
            sys.exit(f"offload {i}: the prefill's token differs from the resident one")
        if a.uva:
            work = bt.Workload(dev, vocab, 1234, [], 2, 8, a.tokens)
            res, _ = bt.run_uva(model, work, dev, budget, host)
            r["uva_prefill_s"] = res["prefill"]["seconds"]
            print(f"   uva at {pct}%: prefill {r['uva_prefill_s'] * 1e3:.1f} ms", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
