#!/usr/bin/env python3
"""ORT's CUDA EP on epmem memory vs on ORT's own allocator (its BFC arena).

    ORT_GPU_DIR=... EPMEM_LIB=/abs/libepmem.so python3 scripts/bench_ort.py [--out DIR] [--runs 240]

A transformer-shaped model (tests/ort/gpu/make_transformer.py: 6 blocks,
d_model 1024, ffn 4096, 288 MiB of float initializers; dynamic batch and
sequence) is driven by a trace of random (batch, seq) shapes, twice: the
first pass is the warm-up, the second is measured. Each allocator runs in its
own process, so memory figures start clean:

  ort    the plain CUDA EP (its BFC arena, default settings)
  epmem  the same after registering epmem, with session.use_env_allocators=1

Reported per allocator: latency per run (median, mean, total of the measured
pass), device memory taken (driver free memory, cuMemGetInfo via torch,
before the session vs after every run; peak, and peak above the initializers),
driver allocations in the warm-up and the measured pass, counted from each
worker's ORT log at INFO (ORT's BFC arena logs "Extended allocation by" and
"Reserving memory in BFCArena for Cuda" for every cudaMalloc of its Cuda
arena; epmem logs "arena grew (N physical
allocation(s) ...)"), and growth steps: measured runs after which the
driver's free memory dropped (a cross-check that needs no log). Logging at
INFO costs both processes the same.
Outputs of every run are compared bit for bit across the two processes.

The physical floor: the peak of bytes live at once (the sizes ORT asked for,
summed over the allocations outstanding together, initializers included).
epmem counts it (AllocatorGetStats key epmem.peak_live_bytes; Python has no
AllocatorGetStats, so it is read from the INFO line "allocator footprint at
release" epmem logs when ORT releases the allocator), next to its peak
committed bytes. ORT's BFC arena keeps MaxInUse in its own stats, which no
Python API reaches; its bytes taken from the driver are summed from its
"Extended allocation by N bytes" / "Reserving memory ... size: N" lines. Both
processes run the same model, trace and ORT, so ORT's planner makes the same
requests: the floor counted in the epmem process is the floor of both.
Device memory that does not go through either allocator (CUDA EP handles,
cuBLAS workspaces, kernel images) is the peak taken minus the allocator's
peak; no allocator can save it. The best any allocator could reach above the
initializers is floor - initializers + that memory; if it is above 0.6x ORT's
figure, the 0.6x target cannot be met on this trace by any allocator.

Writes DIR/bench_ort.json and DIR/bench_ort_memory.png (matplotlib). Closes
with one "TARGET ..." line per target it judges and a "FLOOR ..." line.
"""
import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(a):
    import torch  # first: CUDA 13 libraries for onnxruntime-gpu; also makes the context
    import numpy as np
    import onnxruntime as ort

    torch.cuda.init()
    # INFO: ORT's BFC arena logs each extension, epmem each arena growth.
    ort.set_default_logger_severity(1)
    free0, total = torch.cuda.mem_get_info()
    trace = json.load(open(a.trace))
    so = ort.SessionOptions()
    if a.worker == "epmem":
        ort.register_execution_provider_library("epmem", a.lib)
        so.add_session_config_entry("session.use_env_allocators", "1")
    t0 = time.perf_counter()
    s = ort.InferenceSession(a.model, sess_options=so, providers=[a.provider])
    load_s = time.perf_counter() - t0
    assert s.get_providers()[0] == a.provider, s.get_providers()
    after_load = free0 - torch.cuda.mem_get_info()[0]
    # One pool of random values; a trace position's input is a fixed slice of
    # it, the same in both passes and both processes (drawing 8M normals per
    # run would take longer than the run).
    most = max(b * t for b, t in trace) * a.d_model
    pool = np.random.default_rng(7).standard_normal(2 * most).astype(np.float32)
    lat, taken, hashes = [], [], []
    for i, (b, t) in enumerate(trace + trace):
        if i == len(trace):
            print(MARK, file=sys.stderr, flush=True)
        off = (i % len(trace)) * 7919 % most
        x = pool[off:off + b * t * a.d_model].reshape(b, t, a.d_model)
        t1 = time.perf_counter()
        y = s.run(None, {"X": x})[0]
        lat.append(time.perf_counter() - t1)
        taken.append(free0 - torch.cuda.mem_get_info()[0])
        hashes.append(hashlib.sha256(y.tobytes()).hexdigest())
    res = {
        "allocator": a.worker,
        "onnxruntime": ort.__version__,
        "total_bytes": total,
        "load_s": load_s,
        "taken_after_load": after_load,
        "latency_s": lat,
        "taken_bytes": taken,
        "hashes": hashes,
    }
    del s
    if a.worker == "epmem":
        ort.unregister_execution_provider_library("epmem")
    json.dump(res, open(a.result, "w"))


MARK = "epmem-bench-ort: measured pass begins"


def driver_allocs(log_path):
    """(warm-up, measured) driver allocations from the worker's log: ORT's
    "Extended allocation by" lines of its Cuda arena, epmem's "arena grew (N ...)"."""
    counts, phase, arena = [0, 0], 0, None
    for line in open(log_path, errors="replace"):
        if MARK in line:
            phase = 1
        m = re.search(r"Extending BFCArena for (\w+)", line)
        if m:
            arena = m.group(1)
        if "Extended allocation by" in line and arena == "Cuda":
            counts[phase] += 1
        if "Reserving memory in BFCArena for Cuda " in line:  # Reserve: a cudaMalloc of its own
            counts[phase] += 1
        m = re.search(r"epmem: \S+ Device allocator: arena grew \((\d+) physical", line)
        if m:
            counts[phase] += int(m.group(1))
    return counts


FOOTPRINT = re.compile(r"epmem: \S+ Device allocator footprint at (\w+): (.*)")


def epmem_footprint(log_path):
    """The epmem Device allocator footprint line with the most allocations
    (the env allocator the session used), as a dict of ints; None if absent."""
    best = None
    for line in open(log_path, errors="replace"):
        m = FOOTPRINT.search(line)
        if not m:
            continue
        kv = dict(p.split("=", 1) for p in m.group(2).split() if "=" in p)
        try:
            d = {k: int(v.rstrip("\x1b[m")) for k, v in kv.items()}
        except ValueError:
            continue
        d["when"] = m.group(1)
        if best is None or d.get("num_allocs", 0) >= best.get("num_allocs", 0):
            best = d
    return best


def bfc_driver_bytes(log_path):
    """Bytes ORT's Cuda BFC arena took from the driver (extensions + reserves)."""
    total, arena = 0, None
    for line in open(log_path, errors="replace"):
        m = re.search(r"Extending BFCArena for (\w+)", line)
        if m:
            arena = m.group(1)
        m = re.search(r"Extended allocation by (\d+) bytes", line)
        if m and arena == "Cuda":
            total += int(m.group(1))
        m = re.search(r"Reserving memory in BFCArena for Cuda size: (\d+)", line)
        if m:
            total += int(m.group(1))
    return total


def floor_report(s, fp, bfc_bytes, init_bytes):
    """Figures placing both allocators against the physical floor (MiB, ratios)."""
    mib = 2**20
    if not fp or "peak_live_bytes" not in fp:
        return None
    live = fp["peak_live_bytes"]
    epm_peak = fp.get("peak_committed_bytes", 0)
    other_epm = s["epmem"]["peak_taken_mib"] * mib - epm_peak
    other_ort = s["ort"]["peak_taken_mib"] * mib - bfc_bytes if bfc_bytes else None
    best_above = live - init_bytes + max(other_epm, 0)
    ort_above = s["ort"]["peak_above_init_mib"] * mib
    return {
        "peak_live_mib": live / mib,
        "epmem_peak_held_mib": fp.get("peak_held_bytes", 0) / mib,
        "epmem_peak_committed_mib": epm_peak / mib,
        "epmem_committed_over_floor": epm_peak / live if live else None,
        "bfc_driver_mib": bfc_bytes / mib,
        "bfc_over_floor": bfc_bytes / live if live and bfc_bytes else None,
        "other_device_mib_epmem": other_epm / mib,
        "other_device_mib_ort": other_ort / mib if other_ort is not None else None,
        "best_possible_above_init_mib": best_above / mib,
        "best_possible_ratio": best_above / ort_above if ort_above > 0 else None,
        "same_stream_reuses": fp.get("same_stream_reuses"),
        "stream_allocs": fp.get("stream_allocs"),
        "stream_waits": fp.get("stream_waits"),
    }


def summarize(r, n, init_bytes):
    import statistics

    meas = r["latency_s"][n:]
    taken = r["taken_bytes"]
    steps = sum(1 for i in range(n, 2 * n) if taken[i] > taken[i - 1])
    return {
        "median_ms": statistics.median(meas) * 1e3,
        "mean_ms": statistics.fmean(meas) * 1e3,
        "total_s": sum(meas),
        "peak_taken_mib": max(taken) / 2**20,
        "peak_above_init_mib": (max(taken) - init_bytes) / 2**20,
        "growth_steps_after_warmup": steps,
        "driver_allocs_warmup": r["driver_allocs"][0],
        "driver_allocs_after_warmup": r["driver_allocs"][1],
        "load_s": r["load_s"],
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/epmem-bench-ort")
    ap.add_argument("--runs", type=int, default=240, help="shapes in the trace (each run twice)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--lib", default=os.environ.get("EPMEM_LIB", ""))
    ap.add_argument("--provider", default="CUDAExecutionProvider", help="only for a smoke test of the script itself")
    ap.add_argument("--worker", choices=["ort", "epmem"])
    ap.add_argument("--model")
    ap.add_argument("--trace")
    ap.add_argument("--result")
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    if not a.lib:
        for c in (".carry/lib/libepmem.so", "target/release/libepmem.so"):
            if os.path.exists(os.path.join(ROOT, c)):
                a.lib = os.path.join(ROOT, c)
                break
    if not a.lib:
        sys.exit("set EPMEM_LIB or --lib")
    os.makedirs(a.out, exist_ok=True)
    import numpy as np

    model = os.path.join(a.out, "transformer.onnx")
    subprocess.run([sys.executable, os.path.join(ROOT, "tests/ort/gpu/make_transformer.py"), model, "--layers",
                    str(a.layers), "--d-model", str(a.d_model), "--heads", str(a.d_model // 64), "--ffn",
                    str(4 * a.d_model)], check=True)
    init_bytes = a.layers * (4 * a.d_model**2 + 2 * a.d_model * 4 * a.d_model) * 4
    rng = np.random.default_rng(2026)
    trace = [(int(rng.integers(1, a.max_batch + 1)), int(rng.integers(1, a.max_seq + 1))) for _ in range(a.runs)]
    tpath = os.path.join(a.out, "trace.json")
    json.dump(trace, open(tpath, "w"))
    results = {}
    for w in ("ort", "epmem"):
        rpath = os.path.join(a.out, f"result_{w}.json")
        env = dict(os.environ, EPM_DEVICE=os.environ.get("EPM_DEVICE", "cuda"))
        t0 = time.time()
        lpath = os.path.join(a.out, f"worker_{w}.log")
        with open(lpath, "w") as log:
            r = subprocess.run([sys.executable, __file__, "--worker", w, "--model", model, "--trace", tpath, "--result",
                                rpath, "--lib", a.lib, "--d-model", str(a.d_model), "--provider", a.provider],
                               env=env, stdout=log, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            sys.stdout.write(open(lpath, errors="replace").read()[-4000:])
            sys.exit(f"the {w} worker failed (rc {r.returncode}); log {lpath}")
        results[w] = json.load(open(rpath))
        results[w]["driver_allocs"] = driver_allocs(lpath)
        if w == "epmem":
            results[w]["footprint"] = epmem_footprint(lpath)
        else:
            results[w]["bfc_driver_bytes"] = bfc_driver_bytes(lpath)
        print(f"{w}: {time.time() - t0:.1f} s in its process", flush=True)
    n = len(trace)
    s = {w: summarize(results[w], n, init_bytes) for w in results}
    same = sum(1 for x, y in zip(results["ort"]["hashes"], results["epmem"]["hashes"]) if x == y)
    lat_ratio = s["epmem"]["total_s"] / s["ort"]["total_s"]
    mem_ratio = s["epmem"]["peak_above_init_mib"] / max(s["ort"]["peak_above_init_mib"], 1e-9)
    print(f"\nonnxruntime {results['ort']['onnxruntime']}, {a.layers} blocks d_model {a.d_model}, "
          f"{init_bytes / 2**20:.0f} MiB initializers, trace of {n} shapes (batch 1..{a.max_batch}, seq 1..{a.max_seq}), "
          f"warm-up pass + measured pass\n")
    print("| allocator | median ms | mean ms | measured total s | peak taken MiB | peak above initializers MiB | "
          "driver allocs warm-up | driver allocs after warm-up | growth steps after warm-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for w in ("ort", "epmem"):
        v = s[w]
        print(f"| {w} | {v['median_ms']:.3f} | {v['mean_ms']:.3f} | {v['total_s']:.3f} | {v['peak_taken_mib']:.0f} | "
              f"{v['peak_above_init_mib']:.0f} | {v['driver_allocs_warmup']} | {v['driver_allocs_after_warmup']} | "
              f"{v['growth_steps_after_warmup']} |")
    print(f"\noutputs bit-identical: {same}/{2 * n} runs")
    fl = floor_report(s, results["epmem"].get("footprint"), results["ort"].get("bfc_driver_bytes", 0), init_bytes)
    if fl:
        f = lambda v, spec: "n/a" if v is None else format(v, spec)
        print(f"\nfloor (peak of bytes live at once, initializers included; ORT's requests counted by epmem): "
              f"{fl['peak_live_mib']:.0f} MiB")
        print(f"| allocator | allocator peak MiB | x floor | device memory not through the allocator MiB |")
        print("|---|---|---|---|")
        print(f"| ort | {f(fl['bfc_driver_mib'], '.0f')} (BFC extensions + reserves, from its log) | "
              f"{f(fl['bfc_over_floor'], '.3f')} | {f(fl['other_device_mib_ort'], '.0f')} |")
        print(f"| epmem | {fl['epmem_peak_committed_mib']:.0f} (peak committed; held by live + stream-pending "
              f"{fl['epmem_peak_held_mib']:.0f}) | {f(fl['epmem_committed_over_floor'], '.3f')} | "
              f"{fl['other_device_mib_epmem']:.0f} |")
        print(f"epmem stream reuse: {fl['same_stream_reuses']} of {fl['stream_allocs']} stream allocations "
              f"served by the same stream's freed memory; waits for pending work: {fl['stream_waits']}")
        print("ORT's BFC MaxInUse is not reachable from Python (no AllocatorGetStats); the floor above is "
              "counted in the epmem process on the same model, trace and ORT.")
    else:
        print("\nfloor: epmem's footprint line (\"allocator footprint at release\") is not in its log: not measured")
    verdict = lambda ok: "MET" if ok else "MISSED"
    da = s["epmem"]["driver_allocs_after_warmup"]
    print()
    print(f"TARGET latency <= 1.02x ORT: {lat_ratio:.3f}x {verdict(lat_ratio <= 1.02)} "
          f"(measured-pass totals {s['epmem']['total_s']:.3f} s vs {s['ort']['total_s']:.3f} s)")
    print(f"TARGET memory above initializers <= 0.6x ORT: {mem_ratio:.3f}x {verdict(mem_ratio <= 0.6)} "
          f"({s['epmem']['peak_above_init_mib']:.0f} vs {s['ort']['peak_above_init_mib']:.0f} MiB)")
    print(f"TARGET 0 driver allocations after warm-up (epmem, from its log): {da} {verdict(da == 0)}; "
          f"growth steps in driver free memory: {s['epmem']['growth_steps_after_warmup']}")
    if fl and fl["best_possible_ratio"] is not None:
        bp = fl["best_possible_ratio"]
        print(f"FLOOR best possible memory above initializers (floor - initializers + memory not through the "
              f"allocator): {fl['best_possible_above_init_mib']:.0f} MiB = {bp:.3f}x ORT's; "
              + ("the 0.6x target is out of reach of any allocator on this trace" if bp > 0.6
                 else "the 0.6x target is reachable in principle")
              + f"; epmem committed {f(fl['epmem_committed_over_floor'], '.3f')}x the floor, "
              f"ORT's BFC {f(fl['bfc_over_floor'], '.3f')}x")
    else:
        print("FLOOR not measured (see above)")
    out = {"summary": s, "bit_identical_runs": same, "runs": 2 * n, "latency_ratio": lat_ratio,
           "memory_above_init_ratio": mem_ratio, "init_bytes": init_bytes, "trace": trace, "floor": fl,
           "taken_bytes": {w: results[w]["taken_bytes"] for w in results},
           "latency_s": {w: results[w]["latency_s"] for w in results}}
    json.dump(out, open(os.path.join(a.out, "bench_ort.json"), "w"))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 4))
        for w in ("ort", "epmem"):
            ax.plot([b / 2**20 for b in results[w]["taken_bytes"]], label=f"{w} (peak {s[w]['peak_taken_mib']:.0f} MiB)")
        ax.axhline(init_bytes / 2**20, color="gray", ls=":", label="initializers")
        ax.axvline(n, color="gray", ls="--", lw=0.8)
        ax.set_xlabel("run (warm-up pass | measured pass)")
        ax.set_ylabel("device memory taken, MiB")
        ax.set_title("ORT CUDA EP: device memory over the trace")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(a.out, "bench_ort_memory.png"), dpi=120)
        print(f"plot: {os.path.join(a.out, 'bench_ort_memory.png')}")
    except ImportError:
        print("matplotlib missing: no plot")
    ok = same == 2 * n
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
