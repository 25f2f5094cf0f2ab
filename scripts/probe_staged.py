#!/usr/bin/env python3
"""Diagnostic (not a benchmark of record): staged page-ins under variants of
prefetch depth and who fills, on bench_torch's shapes. Prints one line per row.

A variant is sources:prefetch_depth:caller_fills[:fill_threads[:chunk_MiB[:slots[:fill_ahead_chunks]]]]
(0 for fill_threads or slots: the default), e.g. staged:1:0:0:16:3:2."""
import argparse, json, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_torch as bt  # noqa: E402
import torch  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="small")
ap.add_argument("--budgets", default="25,75")
ap.add_argument("--variants", default="registered:1:0,staged:1:0,staged:2:0,staged:3:0,staged:1:1,staged:2:1")
ap.add_argument("--tokens", type=int, default=16)
ap.add_argument("--json")
a = ap.parse_args()
dev = torch.device("cuda", 0)
model, kind = bt.make_model(a.shape, dev, torch.bfloat16, 32000, 1234)
off = sum(p.numel() * p.element_size() for _, m in bt.offloaded_linears(model) for p in m.parameters())
prompt = torch.tensor([[1, 15043, 29892, 590, 1024, 338, 263, 4086]], device=dev) % 32000
bt.decode(model, prompt, 2, dev)
ref, _ = bt.decode(model, prompt, a.tokens, dev)
out = []
for pct in [int(x) for x in a.budgets.split(",")]:
    budget = off * pct // 100
    for v in a.variants.split(","):
        src, depth, caller, *ft = v.split(":")
        extra = {}
        if ft and int(ft[0]):
            extra["fill_threads"] = int(ft[0])
        if len(ft) > 1:
            extra["staging_chunk_bytes"] = int(ft[1]) << 20
        if len(ft) > 2 and int(ft[2]):
            extra["staging_slots"] = int(ft[2])
        if len(ft) > 3:
            extra["fill_ahead_chunks"] = int(ft[3])
        r = bt.run_epmem(model, prompt, a.tokens, dev, budget, src, "linear",
                         prefetch_depth=int(depth), caller_fills=int(caller), **extra)
        ms = r["seconds"] / a.tokens * 1e3
        row = dict(pct=pct, variant=v, sources=src, depth=int(depth), caller_fills=int(caller), ms_per_token=ms,
                   same=r["tokens"] == ref, **{k: v for k, v in r.items() if k not in ("tokens", "seconds")})
        out.append(row)
        print(f"{pct}% {v}: {ms:.1f} ms/token, "
              f"{r['streamed_bytes_per_token'] / 2**20:.0f} MiB/token, fill {r['fill_ms_per_token']:.1f}, "
              f"slot waits {r['slot_wait_ms_per_token']:.1f}, filler busy {r['background_busy_ms_per_token']:.1f}, "
              f"bg waits {r['background_wait_ms_per_token']:.1f} ms/token ({r['background_waits']}), "
              f"ahead {r['fill_ahead_mib_per_token']:.0f}/{r['fill_ahead_used_mib_per_token']:.0f} MiB/token, "
              f"htod {r['htod_ms_per_token']:.1f}, dev stall {r['device_stall_ms_per_token']:.1f}, host stall {r['host_stall_ms_per_token']:.1f}, "
              f"{'same' if row['same'] else 'DIFFER'}", flush=True)
if a.json:
    json.dump(out, open(a.json, "w"), indent=1)
