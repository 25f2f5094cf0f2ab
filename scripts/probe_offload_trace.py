#!/usr/bin/env python3
"""Where does an offloaded decode's time go? A diagnostic.

Builds one shape of scripts/bench_torch.py, times its resident batch-1 decode,
offloads it with `epmem.torch.offload(model, budget)` (the defaults), and
records, on torch's default stream:

- three timed decodes of 16 tokens (ms a token, as bench_torch times them);
- the host's issue pace: when each token's forward returns, no synchronize
  (a host that issues a token slower than the GPU runs it is the limit);
- with --trace, a torch.profiler chrome trace of 6 more tokens (CUPTI sees
  epmem's driver-API copies and decode kernels beside torch's kernels), and
  the traced tokens' pace: read it with scripts/trace_offload.py. Recording
  torch's CPU ops slows a small model's host by half again (small at
  75%: 33 ms a token untraced, 52 traced), so the trace shows a host-bound
  run; --cuda-only records the GPU's activity alone.

    EPM_DEVICE=cuda python3 scripts/probe_offload_trace.py small 75 --out DIR --trace

A probe, not a benchmark: it prints one JSON line and writes DIR/res-SHAPE-PCT.json.
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(bt.SHAPES))
    ap.add_argument("pct", type=int, help="budget, %% of the offloadable bytes")
    ap.add_argument("--out", required=True, help="directory for res-*.json (and trace-*.json)")
    ap.add_argument("--tag", default="", help="suffix of the file names")
    ap.add_argument("--trace", action="store_true", help="also write a torch.profiler trace of 6 tokens")
    ap.add_argument("--cuda-only", action="store_true",
                    help="trace the GPU's activity alone: no CPU ops, so the host keeps its untraced pace "
                         "(recording every torch op slows a small model's host by half again)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    model = bt.make_model(a.shape, dev, torch.bfloat16, 32000, 0, 256)
    total = sum(m.weight.numel() * m.weight.element_size() for _, m in bt.offloaded_linears(model))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 32000, (1, 8), generator=g).to(dev)
    res = {"shape": a.shape, "pct": a.pct, "tag": a.tag}
    with torch.no_grad():
        bt.decode(model, prompt, 2, dev)
        res["resident_ms"] = [bt.decode(model, prompt, 16, dev)[1] / 16 * 1e3 for _ in range(2)]
        h = et.offload(model, total * a.pct // 100)
        bt.decode(model, prompt, 2, dev)
        res["ms_per_tok"] = [bt.decode(model, prompt, 16, dev)[1] / 16 * 1e3 for _ in range(3)]

        def start():
            out = model(prompt, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            bt.sync(dev)
            return out.past_key_values, nxt

        cache, nxt = start()
        ts = [time.perf_counter()]
        for _ in range(16):
            out = model(nxt, past_key_values=cache, use_cache=True)
            cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            ts.append(time.perf_counter())
        bt.sync(dev)
        res["host_issue_ms"] = [round((b - t) * 1e3, 3) for t, b in zip(ts, ts[1:])]
        res["host_total_ms"] = round((ts[-1] - ts[0]) * 1e3, 3)
        res["gpu_total_ms"] = round((time.perf_counter() - ts[0]) * 1e3, 3)
        if a.trace:
            from torch.profiler import ProfilerActivity, profile
            cache, nxt = start()
            acts = [ProfilerActivity.CUDA] if a.cuda_only else [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            t = time.perf_counter()
            with profile(activities=acts) as p:
                for _ in range(6):
                    out = model(nxt, past_key_values=cache, use_cache=True)
                    cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                bt.sync(dev)
                res["traced_ms_per_tok"] = round((time.perf_counter() - t) / 6 * 1e3, 3)
            p.export_chrome_trace(os.path.join(a.out, f"trace-{a.shape}-{a.pct}{a.tag}.json"))
    res["stats"] = {k: v for k, v in h.stats().items() if isinstance(v, (int, float, str, bool))}
    h.remove()
    with open(os.path.join(a.out, f"res-{a.shape}-{a.pct}{a.tag}.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res.get(k) for k in ("tag", "shape", "pct", "resident_ms", "ms_per_tok", "host_total_ms",
                                              "gpu_total_ms", "traced_ms_per_tok")}), flush=True)


if __name__ == "__main__":
    main()
