#!/usr/bin/env python3
"""Where a streamed prefill's time goes: one prompt's forward through
epmem.torch.offload at a budget, traced with torch.profiler (CUDA kernels and
copies of every stream, epmem's included: the profiler sees the whole
process's CUDA activity), beside the all-resident prefill and the PCIe floor.

    EPM_DEVICE=cuda python3 scripts/probe_prefill.py --shape big --pct 75 --out DIR

Per configuration (compress auto and off, each optionally with offload() keywords:
--compress auto,auto:prefetch_depth=4,off) it reports the time to the first
token (best of 2), the floor, the resident time, and from the trace of a third
pass: the busy time of the compute stream(s) and of the copy stream(s), their
overlap, the compute stream's idle gaps (sum, largest, and the 12 largest with
the kernel before each), and the host->device copies' start and end against
the pass. Writes DIR/probe_prefill.json (and, with --trace, the Chrome traces).
A probe, not a benchmark of record: docs/BENCHMARKS.md's figures come from
scripts/bench_torch.py.
"""
import argparse
import bisect
import gzip
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_torch as bt  # noqa: E402
import torch  # noqa: E402

import epmem.torch as et  # noqa: E402


def intervals(evts):
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in evts)


def union(iv):
    out = []
    for a, b in iv:
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def length(u):
    return sum(b - a for a, b in u)


def overlap(u, v):
    i = j = 0
    tot = 0.0
    while i < len(u) and j < len(v):
        a, b = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        if a < b:
            tot += b - a
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return tot


def percentile(values, q):
    """The q-quantile of `values` (nearest rank below)."""
    v = sorted(values)
    return v[int(q * (len(v) - 1))]


def rates_of(copies):
    r = [e["args"]["bytes"] / e["dur"] / 1e3 for e in copies
         if e.get("args", {}).get("bytes", 0) >= 4 << 20 and e["dur"] > 0]
    return [round(percentile(r, q), 2) for q in (0.1, 0.5, 0.9)] if r else None


def analyse(trace_path):
    with open(trace_path) as f:
        tr = json.load(f)
    ev = [e for e in tr.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kern = [e for e in ev if e.get("cat") == "kernel"]
    copies = [e for e in ev if e.get("cat") == "gpu_memcpy"]
    h2d = [e for e in copies if "HtoD" in e.get("name", "")]
    by_stream = {}
    for e in kern:
        by_stream.setdefault(e.get("args", {}).get("stream"), []).append(e)
    # The compute stream: the one with the most kernel time.
    comp_id = max(by_stream, key=lambda s: sum(e["dur"] for e in by_stream[s])) if by_stream else None
    comp = sorted(by_stream.get(comp_id, []), key=lambda e: e["ts"])
    others = [e for s, es in by_stream.items() if s != comp_id for e in es]
    cu, hu = union(intervals(comp)), union(intervals(h2d))
    if not comp:
        return {"error": "no kernels in the trace"}
    t0, t1 = comp[0]["ts"], comp[-1]["ts"] + comp[-1]["dur"]
    # Why the compute stream idled before a kernel (gaps over 20 us): the host
    # had not launched it yet (its launch call ended after the gap began), or it
    # waited on the device for a copy or a decode that ended inside the gap, or neither.
    launch_end = {}
    for e in ev:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "Launch" in e.get("name", ""):
            c = e.get("args", {}).get("correlation")
            if c is not None:
                launch_end[c] = e["ts"] + e["dur"]
    dev_ends = sorted(e["ts"] + e["dur"] for e in h2d + others)
    gaps = []
    g_host = g_dev = g_other = 0.0
    for a, b in zip(comp, comp[1:]):
        start, end = a["ts"] + a["dur"], b["ts"]
        g = end - start
        if g > 0:
            gaps.append((g, a["name"][:60], b["name"][:60], start - t0))
        if g <= 20:
            continue
        le = launch_end.get(b.get("args", {}).get("correlation"))
        i = bisect.bisect_left(dev_ends, start)
        if le is not None and le > start + 5:
            g_host += g
        elif i < len(dev_ends) and dev_ends[i] <= end:
            g_dev += g
        else:
            g_other += g
    gaps.sort(reverse=True)
    hs = sorted(h2d, key=lambda e: e["ts"])
    hgaps = []
    for a, b in zip(hs, hs[1:]):
        g = b["ts"] - (a["ts"] + a["dur"])
        if g > 0:
            hgaps.append((g, a.get("args", {}).get("bytes", 0), b.get("args", {}).get("bytes", 0), a["ts"] + a["dur"] - t0))
    hgaps.sort(reverse=True)
    h_span = (hs[-1]["ts"] + hs[-1]["dur"] - hs[0]["ts"]) if hs else 0
    streams_h2d = sorted({e.get("args", {}).get("stream") for e in h2d})
    return {
        "compute_stream": comp_id,
        "span_ms": (t1 - t0) / 1e3,
        "compute_busy_ms": length(cu) / 1e3,
        "compute_idle_ms": (t1 - t0 - length(cu)) / 1e3,
        "other_stream_kernel_ms": sum(e["dur"] for e in others) / 1e3,
        "other_stream_kernels": len(others),
        "decode_overlap_compute_ms": overlap(cu, union(intervals(others))) / 1e3,
        "gap_host_ms": round(g_host / 1e3, 3),
        "gap_device_ms": round(g_dev / 1e3, 3),
        "gap_other_ms": round(g_other / 1e3, 3),
        "h2d_busy_ms": length(hu) / 1e3,
        "h2d_copies": len(h2d),
        "h2d_bytes": sum(e.get("args", {}).get("bytes", 0) for e in h2d),
        "h2d_streams": streams_h2d,
        "h2d_first_start_ms": (hu[0][0] - t0) / 1e3 if hu else None,
        "h2d_last_end_ms": (hu[-1][1] - t0) / 1e3 if hu else None,
        "overlap_ms": overlap(cu, hu) / 1e3,
        "gaps_over_50us": sum(1 for g in gaps if g[0] > 50),
        "largest_gaps": [{"us": round(g[0], 1), "after": g[1], "before": g[2], "at_ms": round(g[3] / 1e3, 3)}
                         for g in gaps[:12]],
        "h2d_span_ms": h_span / 1e3,
        "h2d_busy_of_span": length(hu) / h_span if h_span else None,
        "h2d_gap_ms": sum(g[0] for g in hgaps) / 1e3,
        "h2d_gaps_over_20us": sum(1 for g in hgaps if g[0] > 20),
        "h2d_largest_gaps": [{"us": round(g[0], 1), "after_bytes": g[1], "before_bytes": g[2],
                              "at_ms": round(g[3] / 1e3, 3)} for g in hgaps[:16]],
        "h2d_copy_sizes": sorted({e.get("args", {}).get("bytes", 0) for e in hs})[-8:],
        # Each copy's own rate (bytes over its duration), copies of 4 MiB or more:
        # 10th, 50th and 90th percentile, GB/s; and how many copies were smaller.
        "h2d_copy_gbs_p10_p50_p90": rates_of(hs),
        "h2d_copies_under_4mib": sum(1 for e in hs if e.get("args", {}).get("bytes", 0) < 4 << 20),
        "h2d_timeline_ms": [[round((a - t0) / 1e3, 3), round((b - t0) / 1e3, 3)] for a, b in hu[:200]],
        "other_stream_kernel_names": sorted({e["name"][:60] for e in others})[:10],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="big", choices=[s for s in bt.SHAPES if s != "quick"])
    ap.add_argument("--pct", default="75")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--compress", default="auto,off",
                    help="configurations, comma-separated: auto or off, each optionally followed by "
                         ":key=value offload() keywords, e.g. auto:prefetch_depth=4")
    ap.add_argument("--out", required=True)
    ap.add_argument("--trace", action="store_true", help="keep the Chrome traces (gzip) in --out")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dev = torch.device("cuda", 0)
    peak = bt.h2d_peak(dev, bt.GiB)
    model = bt.make_model(a.shape, dev, torch.bfloat16, 32000, 1234, a.tokens + 64)
    lin = bt.offloaded_linears(model)
    off = sum(p.numel() * p.element_size() for _, m in lin for p in m.parameters(recurse=False))
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(1, 32000, (1, a.tokens), generator=g).to(dev)
    short = torch.randint(1, 32000, (1, 8), generator=g).to(dev)
    bt.prefill(model, prompt, dev)
    ref_tok, resident_s = bt.prefill(model, prompt, dev)
    out = {"gpu": torch.cuda.get_device_name(dev), "shape": a.shape, "tokens": a.tokens, "peak_h2d": peak,
           "offloaded_bytes": off, "resident_s": resident_s, "runs": []}
    print(f"{a.shape}: resident prefill {resident_s * 1e3:.1f} ms, H2D peak {peak / 1e9:.1f} GB/s", flush=True)
    for pct in [int(p) for p in a.pct.split(",")]:
        budget = off * pct // 100
        floor = (off - budget) / peak
        for comp in a.compress.split(","):
            base, *extra = comp.split(":")
            kw = {} if base == "auto" else {"compress": False}
            for item in extra:
                k, v = item.split("=", 1)
                kw[k] = int(v) if v.lstrip("-").isdigit() else v
            h = et.offload(model, budget, **kw)
            try:
                bt.decode(model, short, 4, dev)  # the cycle, the plan, the first page-ins
                tok, secs = bt.prefill(model, prompt, dev)
                # The host's share: when the forward returns (everything enqueued)
                # against when the device is done, untraced.
                with torch.no_grad():
                    torch.cuda.synchronize(dev)
                    t = time.perf_counter()
                    model(prompt, use_cache=True)
                    host_s = time.perf_counter() - t
                    torch.cuda.synchronize(dev)
                    host_total_s = time.perf_counter() - t
                s0 = h.stats()
                trace = os.path.join(a.out, f"trace_{a.shape}_{pct}_{comp}.json")
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
                    with torch.no_grad():
                        t = time.perf_counter()
                        model(prompt, use_cache=True)
                        torch.cuda.synchronize(dev)
                        traced_s = time.perf_counter() - t
                prof.export_chrome_trace(trace)
                s1 = h.stats()
                # Three batch-1 decode steps, traced the same way.
                dtrace = os.path.join(a.out, f"dtrace_{a.shape}_{pct}_{comp}.json")
                with torch.no_grad():
                    o = model(short, use_cache=True)
                    cache, nxt = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True)
                    torch.cuda.synchronize(dev)
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA]) as dprof:
                        t = time.perf_counter()
                        for _ in range(3):
                            o = model(nxt, past_key_values=cache, use_cache=True)
                            cache, nxt = o.past_key_values, o.logits[:, -1].argmax(-1, keepdim=True)
                        torch.cuda.synchronize(dev)
                        decode_s = (time.perf_counter() - t) / 3
                dprof.export_chrome_trace(dtrace)
            finally:
                h.remove()
            an = analyse(trace)
            if a.trace:
                with open(trace, "rb") as f, gzip.open(trace + ".gz", "wb") as z:
                    z.write(f.read())
            os.remove(trace)
            dan = analyse(dtrace)
            os.remove(dtrace)
            r = {"pct": pct, "compress": comp, "ttft_s": secs, "floor_s": floor,
                 "x_max_floor_resident": secs / max(floor, resident_s), "traced_s": traced_s,
                 "host_enqueue_s": host_s, "host_pass_s": host_total_s,
                 "token_ok": tok == ref_tok,
                 "pass_htod_bytes": s1["htod_bytes"] - s0["htod_bytes"],
                 "pass_host_stall_ms": s1["host_stall_ms"] - s0["host_stall_ms"],
                 "prefetch_depth": s1.get("prefetch_depth"), "trace": an,
                 "decode_s_per_token": decode_s, "decode_floor_s": floor, "decode_trace": dan}
            out["runs"].append(r)
            print(f"  {pct}% compress={comp}: ttft {secs * 1e3:.1f} ms = {r['x_max_floor_resident']:.2f} x "
                  f"max(floor {floor * 1e3:.1f}, resident {resident_s * 1e3:.1f}); traced {traced_s * 1e3:.1f} ms: "
                  f"compute busy {an.get('compute_busy_ms', 0):.1f} idle {an.get('compute_idle_ms', 0):.1f}, "
                  f"h2d busy {an.get('h2d_busy_ms', 0):.1f} ({an.get('h2d_copies')} copies, "
                  f"{an.get('h2d_bytes', 0) / 1e9:.2f} GB), overlap {an.get('overlap_ms', 0):.1f}, "
                  f"h2d {an.get('h2d_first_start_ms')}..{an.get('h2d_last_end_ms')} ms; "
                  f"largest gaps {[g['us'] for g in an.get('largest_gaps', [])[:5]]}; host enqueue "
                  f"{host_s * 1e3:.1f} of {host_total_s * 1e3:.1f} ms; compute gaps waiting on the host "
                  f"{an.get('gap_host_ms')} ms, on copies/decodes {an.get('gap_device_ms')} ms, other "
                  f"{an.get('gap_other_ms')} ms; decode kernels {an.get('other_stream_kernel_ms')} ms, "
                  f"{an.get('decode_overlap_compute_ms')} of it beside compute", flush=True)
            print(f"    decode b1: {decode_s * 1e3:.1f} ms/token, floor {floor * 1e3:.1f}: h2d busy "
                  f"{dan.get('h2d_busy_ms', 0) / 3:.1f} ms/token, {dan.get('h2d_busy_of_span')} of the copies' span, "
                  f"gaps {dan.get('h2d_gap_ms', 0) / 3:.2f} ms/token ({dan.get('h2d_gaps_over_20us')} over 20 us), "
                  f"copy GB/s p10/50/90 {dan.get('h2d_copy_gbs_p10_p50_p90')} (prefill "
                  f"{an.get('h2d_copy_gbs_p10_p50_p90')}; {an.get('h2d_copies_under_4mib')} under 4 MiB), "
                  f"copy sizes {dan.get('h2d_copy_sizes')}", flush=True)
            with open(os.path.join(a.out, "probe_prefill.json"), "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
