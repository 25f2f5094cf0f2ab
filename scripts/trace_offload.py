#!/usr/bin/env python3
"""Read a torch.profiler trace of offloaded decode (scripts/probe_offload_trace.py --trace).

Per trace: the GPU window (ms a token over the 6 traced tokens); per stream
the busy time of copies and kernels; the H2D copies' own rates by size; every
gap between two H2D copies, classified by when the second was issued (its
API call ended after the first copy finished: the host issued it late) or
else waited on the device (the gate, a decode, the GEMMs behind it); and the
host side: time in torch ops against the gaps between them (hooks, Python),
the largest gaps by the ops around them.

    python3 scripts/trace_offload.py trace-small-75.json [...]
"""
import argparse
import bisect
import collections
import gzip
import json


def load(path):
    with (gzip.open if path.endswith(".gz") else open)(path) as f:
        return json.load(f)


def gpu_side(ev, tokens):
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    api = {e["args"].get("correlation"): e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver") and "args" in e}
    t0, t1 = min(e["ts"] for e in gpu), max(e["ts"] + e["dur"] for e in gpu)
    win = (t1 - t0) / 1e3
    print(f"  GPU window {win:.1f} ms ({win / tokens:.2f} ms a token)")
    by = collections.defaultdict(list)
    for e in gpu:
        by[(e["cat"], e["args"].get("stream"))].append(e)
    for (cat, s), es in sorted(by.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
        busy = sum(e["dur"] for e in es) / 1e3
        nbytes = sum(e["args"].get("bytes", 0) for e in es)
        top = collections.Counter(e["name"][:40] for e in es).most_common(1)[0][0]
        rate = f", {nbytes / busy / 1e6:.1f} GB/s while busy" if nbytes else ""
        print(f"  {cat} stream {s}: {len(es)}, busy {busy:.1f} ms ({100 * busy / win:.0f}%){rate}; {top}")
    h2d = sorted((e for e in gpu if e["cat"] == "gpu_memcpy" and "HtoD" in e["name"]), key=lambda e: e["ts"])
    if not h2d:
        return
    sizes = collections.defaultdict(list)
    for e in h2d:
        sizes[round(e["args"].get("bytes", 0) / 2**20)].append(e["args"].get("bytes", 0) / max(e["dur"], 1) / 1e3)
    print("  H2D rate by size (MiB: n, median GB/s):",
          ", ".join(f"{k}: {len(v)}, {sorted(v)[len(v) // 2]:.1f}" for k, v in sorted(sizes.items())))
    # Each gap between two H2D copies: issued late by the host (its API call
    # ended after the first copy finished), waiting on the device, or unknown
    # (the trace has no API call for the copy: CUPTI records epmem's
    # driver-API copies only in some setups, and never with --cuda-only).
    # Beside it, what ended last on another stream before the copy started
    # (the GEMM, decode or other kernel it may have waited for).
    gaps = {"late": [0.0, 0], "device": [0.0, 0], "unknown": [0.0, 0]}
    before = collections.defaultdict(lambda: [0.0, 0])
    others = sorted((e for e in gpu if e["cat"] == "kernel"), key=lambda e: e["ts"] + e["dur"])
    ends = [e["ts"] + e["dur"] for e in others]
    for a, b in zip(h2d, h2d[1:]):
        gap = b["ts"] - (a["ts"] + a["dur"])
        if gap <= 3:
            continue
        c = api.get(b["args"].get("correlation"))
        k = "unknown" if c is None else "late" if c["ts"] + c["dur"] > a["ts"] + a["dur"] else "device"
        gaps[k][0] += gap
        gaps[k][1] += 1
        i = bisect.bisect_right(ends, b["ts"]) - 1
        if i >= 0 and b["ts"] - ends[i] <= 20:
            name = others[i]["name"]
            what = "decode" if "epm_codec" in name else "gemm" if any(
                t in name.lower() for t in ("gemm", "gemv", "sm90", "cutlass")) else "other kernel"
        else:
            what = "nothing within 20 us"
        before[what][0] += gap
        before[what][1] += 1
    print("  H2D idle between copies: " + ", ".join(
        f"{label} {gaps[k][0] / 1e3:.2f} ms ({gaps[k][1]})" for k, label in
        (("late", "issued late by the host"), ("device", "waiting on the device"), ("unknown", "issue time unknown")))
        + f" of {win:.1f}")
    print("  a gap's copy started within 20 us of the end of: " + ", ".join(
        f"{k} {v[0] / 1e3:.2f} ms ({v[1]})" for k, v in sorted(before.items(), key=lambda kv: -kv[1][0])))
    compute_side(gpu, tokens)


def compute_side(gpu, tokens):
    """The compute stream's (the stream with the most non-decode kernels)
    idle gaps: a kernel that started within 20 us of a decode's end waited
    for a page-in; one that did not waited for the host's launch (or for
    something this trace does not show)."""
    ks = [e for e in gpu if e["cat"] == "kernel" and "epm_codec" not in e["name"]]
    if not ks:
        return
    main = collections.Counter(e["args"].get("stream") for e in ks).most_common(1)[0][0]
    comp = sorted((e for e in ks if e["args"].get("stream") == main), key=lambda e: e["ts"])
    dec_ends = sorted(e["ts"] + e["dur"] for e in gpu if e["cat"] == "kernel" and "epm_codec" in e["name"])
    after_decode = other = 0.0
    n_dec = n_other = 0
    for a, b in zip(comp, comp[1:]):
        gap = b["ts"] - (a["ts"] + a["dur"])
        if gap <= 3:
            continue
        i = bisect.bisect_right(dec_ends, b["ts"]) - 1
        if i >= 0 and dec_ends[i] >= a["ts"] + a["dur"] and b["ts"] - dec_ends[i] <= 20:
            after_decode, n_dec = after_decode + gap, n_dec + 1
        else:
            other, n_other = other + gap, n_other + 1
    print(f"  compute stream {main} idle: {after_decode / tokens / 1e3:.2f} ms a token waiting for page-ins "
          f"({n_dec // tokens} gaps a token, the next kernel within 20 us of a decode's end), "
          f"{other / tokens / 1e3:.2f} ms otherwise ({n_other // tokens} gaps a token: the host's launches, "
          "or waits this trace does not show)")


def host_side(ev, tokens):
    cpu = sorted((e for e in ev if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    if not cpu:
        return
    top, end = [], -1
    for e in cpu:  # top-level ops only
        if e["ts"] >= end:
            top.append(e)
            end = e["ts"] + e["dur"]
    span = (top[-1]["ts"] + top[-1]["dur"] - top[0]["ts"]) / 1e3
    inside = sum(e["dur"] for e in top) / 1e3
    print(f"  host: {span / tokens:.2f} ms a token, {inside / tokens:.2f} in torch ops, "
          f"{(span - inside) / tokens:.2f} between them (hooks, Python)")
    gaps, counts = collections.defaultdict(float), collections.Counter()
    for x, y in zip(top, top[1:]):
        k = (x["name"], y["name"])
        gaps[k] += y["ts"] - (x["ts"] + x["dur"])
        counts[k] += 1
    for k, v in sorted(gaps.items(), key=lambda kv: -kv[1])[:5]:
        print(f"    {k[0][:30]} -> {k[1][:30]}: {v / tokens / 1e3:.2f} ms a token, "
              f"{counts[k] // tokens} a token, {v / counts[k]:.0f} us each")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", help="chrome traces (.json or .json.gz)")
    ap.add_argument("--tokens", type=int, default=6, help="tokens the traces hold (per-token figures)")
    a = ap.parse_args()
    for path in a.traces:
        ev = [e for e in load(path)["traceEvents"] if e.get("ph") == "X"]
        print(f"== {path}")
        gpu_side(ev, a.tokens)
        host_side(ev, a.tokens)


if __name__ == "__main__":
    main()
