#!/usr/bin/env python3
"""Does a process run slower after epmem.torch.offload cycles? A diagnostic.

In docs/BENCHMARKS.md's offload run, the small shape's *resident* decode (no
epmem involved) ran at half speed in a process that had first run the gqa
shape's compressed offloads. This probe times a host-bound workload -- the
resident batch-1 decode of one shape, and a pure-Python loop -- before and
after N offload/decode/remove cycles of another shape, with compression on
or off, and records what the process holds after each cycle: threads (and
the CPU time each used since the last check), locked memory (VmLck),
resident memory, the load average, and the same loop in a fresh process
(slow there too: the machine changed, not this process).

    EPM_DEVICE=cuda python3 scripts/probe_slowdown.py --load gqa --probe small --cycles 3 --compress auto,off --json out.json
    EPM_DEVICE=host python3 scripts/probe_slowdown.py --quick     # the mechanics, on the CPU

A probe, not a benchmark: it prints a line per check and writes --json.
"""
import argparse
import gc
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_torch as bt  # noqa: E402
import torch  # noqa: E402

import epmem.torch as et  # noqa: E402
from probe_slowdown_loop import py_loop_ms  # noqa: E402


def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmLck", "VmRSS", "VmPin", "Threads"):
                out[k] = v.strip()
    return out


def thread_cpu():
    """{tid: (name, utime + stime in clock ticks)} of this process's threads."""
    res = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                s = f.read()
            name = s[s.index("(") + 1:s.rindex(")")]
            fields = s[s.rindex(")") + 2:].split()
            res[tid] = (name, int(fields[11]) + int(fields[12]))
        except (OSError, ValueError):
            pass
    return res


FRESH = "import sys\nsys.path.insert(0, sys.argv[1])\nfrom probe_slowdown_loop import py_loop_ms\nprint(py_loop_ms())"


def fresh_loop_ms():
    """The same loop in a fresh interpreter: slow there too means the machine
    (CPU clocks, a throttled VM), not this process, is what changed."""
    out = subprocess.run([sys.executable, "-c", FRESH, HERE], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", default="gqa", help="the shape offloaded in each cycle")
    ap.add_argument("--probe", default="small", help="the shape whose resident decode is timed")
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--pct", type=int, default=50, help="budget, % of the load shape's offloaded bytes")
    ap.add_argument("--compress", default="auto,off")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (the mechanics)")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.quick
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    load_shape, probe_shape = ("quick", "quick") if a.quick else (a.load, a.probe)
    tokens = 4 if a.quick else a.tokens
    probe = bt.make_model(probe_shape, dev, torch.bfloat16, 32000 if not a.quick else 512, 1, 256)
    prompt = torch.randint(1, 500, (1, 8)).to(dev)
    last = thread_cpu()
    checks = []

    def check(what):
        nonlocal last
        bt.decode(probe, prompt, 2, dev)
        _, secs = bt.decode(probe, prompt, tokens, dev)
        now = thread_cpu()
        busy = sorted(((now[t][1] - last.get(t, (None, 0))[1], now[t][0], t) for t in now), reverse=True)[:6]
        last = thread_cpu()
        c = {"what": what, "resident_ms_per_token": secs / tokens * 1e3, "py_loop_ms": py_loop_ms(),
             "fresh_process_py_loop_ms": fresh_loop_ms(),
             "status": status(), "loadavg": os.getloadavg(),
             "busiest_threads_ticks": [[n, ticks, tid] for ticks, n, tid in busy]}
        checks.append(c)
        print(f"{what}: resident {c['resident_ms_per_token']:.2f} ms/token, python loop {c['py_loop_ms']:.2f} ms "
              f"(fresh process {c['fresh_process_py_loop_ms']:.2f}), "
              f"{c['status']}, load {c['loadavg'][0]:.1f}, busiest {c['busiest_threads_ticks'][:3]}", flush=True)

    check("start")
    for comp in a.compress.split(","):
        for i in range(a.cycles):
            model = bt.make_model(load_shape, dev, torch.bfloat16, 32000 if not a.quick else 512, 2, 256)
            off = sum(p.numel() * p.element_size() for _, m in bt.offloaded_linears(model)
                      for p in m.parameters(recurse=False))
            kw = {} if comp == "auto" else {"compress": comp not in ("off", "false")}
            if not cuda:
                kw["device"] = "host"
            h = et.offload(model, max(off * a.pct // 100, 1), **kw)
            bt.decode(model, prompt, 2, dev)
            h.remove()
            del h, model
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            check(f"after {comp} cycle {i + 1}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(dev) if cuda else "cpu", "args": vars(a),
                       "checks": checks}, f, indent=1)


if __name__ == "__main__":
    main()
