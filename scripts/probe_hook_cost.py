#!/usr/bin/env python3
"""What an offloaded linear costs the host per forward, and where it goes. A diagnostic
for docs/BENCHMARKS.md's "Small at 75% decodes at one of two speeds".

A batch-1 decode step of a transformers Llama (random bf16 weights) is timed
all-resident, then through epmem.torch.offload with a budget that holds every
weight (after the first step each acquire is a hit: no copy, no decode), so
the difference per offloaded linear is what offload() costs the host per
linear (a plain nn.Linear runs through offload's own forward: acquire,
F.linear on the device tensor, release; other units through hooks). Where the device
is faster than the host (the small shape on an H100) a step's wall time is the
host's. The parts are then timed alone, per call, in loops:

  dispatch   torch's module call with a no-op pre- and post-hook (always_call)
             minus the same call with none, on a tiny nn.Linear
  library    one acquire + release of a resident weight through epmem.core
             (ctypes, the library, on CUDA the driver calls of a hit)
  swap       the two `param.data = ...` assignments a linear's hooks make
  stream     reading torch's current stream as the pre-hook does
  hooks      every unit's pre- and post-hook called directly, in forward
             order, with no torch module call and no kernel between them
  cycle      acquire + release of every weight in forward order (the
             declared cycle), through epmem.core alone

Then the same units through a pair of hooks that swap `param.data` (what a
plain nn.Linear got before it had a forward of its own). Last, the step with
every weight acquired once and left in place, no hook and no offload forward:
the model reading epmem's memory with no hook at all; and, after
remove(), with torch-only hooks on the same linears: no-ops, then hooks that
only swap each weight in and out as epmem's do (`param.data` between the
weight and a CPU placeholder of its shape), which is what the hooks cost
inside a forward without epmem.

The residency counters over the timed offloaded steps (acquires, hits,
page-ins, bytes copied, decodes) say whether they were hits only. If `hooks`
is far above dispatch + library + swap + stream, the time is in the hooks'
Python; if the offloaded step exceeds the resident one by more than `hooks`
(x units), by the device or by what the hooks make torch do.

    EPM_DEVICE=cuda python3 scripts/probe_hook_cost.py --json hook_cost.json
    EPM_DEVICE=host python3 scripts/probe_hook_cost.py --shape quick

A probe, not a benchmark of record.
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
from torch import nn  # noqa: E402

import epmem.torch as et  # noqa: E402


def per_call(fn, n):
    """Best of 3 runs of `n` calls of fn(), in microseconds per call."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def step_us(model, dev, steps):
    """Microseconds per batch-1 decode step: bench_torch's decode, best of 3."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, 1000, (1, 8), generator=g).to(dev)
    return min(bt.decode(model, prompt, steps, dev)[1] for _ in range(3)) / steps * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small", choices=list(bt.SHAPES))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json")
    a = ap.parse_args()
    cuda = os.environ.get("EPM_DEVICE", "cuda") == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model = bt.make_model(a.shape, dev, torch.bfloat16, 32000 if cuda else 1000, 1234, 256)
    lin = bt.offloaded_linears(model)
    off = sum(p.numel() * p.element_size() for _, m in lin for p in m.parameters(recurse=False))
    out = {"device": torch.cuda.get_device_name(dev) if cuda else "host", "shape": a.shape, "linears": len(lin)}

    out["resident_step_us"] = step_us(model, dev, a.steps)
    h = et.offload(model, off * 2)
    try:
        step_us(model, dev, 2)  # the first page-ins, outside the counted steps
        before = h.stats()
        out["offloaded_step_us"] = step_us(model, dev, a.steps)
        after = h.stats()
        out["counters_over_timed_steps"] = {k: after[k] - before[k] for k in (
            "acquires", "hits", "page_ins", "htod_bytes", "decodes", "evictions", "hook_calls")}
        st = h._st
        w = st.weights[0]
        stream = st._stream()
        res = st.res
        if cuda:
            def lib():
                res.acquire(w.id, stream)
                res.release(w.id, stream)
        else:
            def lib():
                res.acquire_host(w.id)
                res.release_host(w.id)
        out["library_us"] = per_call(lib, a.calls)
        ptr = res.acquire(w.id, stream) if cuda else res.acquire_host(w.id)
        t = st._device_tensor(ptr, w)

        def swap():
            w.param.data = t
            w.param.data = w.host
        out["swap_us"] = per_call(swap, a.calls)
        if cuda:
            res.release(w.id, stream)
        else:
            res.release_host(w.id)
        out["stream_us"] = per_call(st._stream, a.calls)
        hooks = [(u.module, st._pre_hook(u), st._post_hook(u)) for u in st.units]

        def all_hooks():
            for mod, pre, post in hooks:
                pre(mod, ())
                post(mod, (), None)
        out["hooks_direct_us_per_unit"] = per_call(all_hooks, max(a.calls // len(hooks), 5)) / len(hooks)
        seq = [w.id for u in st.units for w in u.weights]
        if cuda:
            def cycle():
                for wid in seq:
                    res.acquire(wid, stream)
                    res.release(wid, stream)
        else:
            def cycle():
                for wid in seq:
                    res.acquire_host(wid)
                    res.release_host(wid)
        out["cycle_us_per_weight"] = per_call(cycle, max(a.calls // len(seq), 5)) / len(seq)
        out["units"] = len(st.units)
        # The same units through a pair of hooks that swap `param.data` (what
        # every unit got before plain linears got their own forward).
        direct = [u for u in st.units if u.forward is not None]
        pairs = []
        for u in direct:
            del u.module.forward
            pairs.append(u.module.register_forward_pre_hook(st._pre_hook(u)))
            pairs.append(u.module.register_forward_hook(st._post_hook(u), always_call=True))
        try:
            out["hook_pair_step_us"] = step_us(model, dev, a.steps)
        finally:
            for hd in pairs:
                hd.remove()
        # The step with the weights in epmem's memory and no hooks.
        for hd in st.hooks:
            hd.remove()
        held = []
        try:
            for x in st.weights:
                held.append(x)
                x.param.data = st._device_tensor(res.acquire(x.id, stream) if cuda else res.acquire_host(x.id), x)
            out["epmem_memory_no_hooks_step_us"] = step_us(model, dev, a.steps)
        finally:
            for x in held:
                x.param.data = x.host
                if cuda:
                    res.release(x.id, stream)
                else:
                    res.release_host(x.id)
            for u in direct:
                u.module.forward = u.forward
    finally:
        h.remove()

    mods = [m for _, m in lin]
    noop = [h for m in mods for h in (m.register_forward_pre_hook(lambda mod, args: None),
                                      m.register_forward_hook(lambda mod, args, o: None, always_call=True))]
    out["noop_hooks_step_us"] = step_us(model, dev, a.steps)
    for h_ in noop:
        h_.remove()
    swaps = []
    for m in mods:
        wt = m.weight.data
        ph = torch.zeros((), dtype=wt.dtype).expand(wt.shape)
        m.weight.data = ph
        swaps.append((m, wt))
        noop.append(m.register_forward_pre_hook(lambda mod, args, wt=wt: setattr(mod.weight, "data", wt)))
        noop.append(m.register_forward_hook(lambda mod, args, o, ph=ph: setattr(mod.weight, "data", ph),
                                            always_call=True))
    out["swap_hooks_step_us"] = step_us(model, dev, a.steps)
    for h_ in noop:
        h_.remove()
    for m, wt in swaps:
        m.weight.data = wt

    bare_mod = nn.Linear(8, 8, device=dev, dtype=torch.bfloat16)
    hooked_mod = nn.Linear(8, 8, device=dev, dtype=torch.bfloat16)
    hooked_mod.register_forward_pre_hook(lambda m, args: None)
    hooked_mod.register_forward_hook(lambda m, args, o: None, always_call=True)
    x = torch.zeros(1, 8, device=dev, dtype=torch.bfloat16)
    bare = hooked = float("inf")
    with torch.no_grad():
        for _ in range(3):  # interleaved: a burst of load elsewhere hits both
            bare = min(bare, per_call(lambda: bare_mod(x), a.calls))
            hooked = min(hooked, per_call(lambda: hooked_mod(x), a.calls))
    out["dispatch_us"] = hooked - bare
    out["hooks_per_linear_us"] = (out["offloaded_step_us"] - out["resident_step_us"]) / len(lin)
    known = out["dispatch_us"] + out["library_us"] + out["swap_us"] + out["stream_us"]
    out["python_rest_us"] = out["hooks_per_linear_us"] - known
    print(f"{out['device']}, {a.shape}: step {out['resident_step_us']:.0f} us resident, "
          f"{out['offloaded_step_us']:.0f} us offloaded (a budget that holds every weight), {len(lin)} linears: "
          f"{out['hooks_per_linear_us']:.1f} us per linear = dispatch {out['dispatch_us']:.1f} + library "
          f"{out['library_us']:.1f} + swap {out['swap_us']:.1f} + stream {out['stream_us']:.1f} + the rest "
          f"{out['python_rest_us']:.1f}; the hooks called directly {out['hooks_direct_us_per_unit']:.1f} us per "
          f"unit ({out['units']} units), acquire+release in cycle order {out['cycle_us_per_weight']:.1f} us per "
          f"weight; the step on epmem's memory with no hooks {out['epmem_memory_no_hooks_step_us']:.0f} us, with "
          f"torch-only no-op hooks {out['noop_hooks_step_us']:.0f} us, with swap-only hooks "
          f"{out['swap_hooks_step_us']:.0f} us; the units through hook pairs that swap param.data "
          f"{out['hook_pair_step_us']:.0f} us; "
          f"over the timed steps {out['counters_over_timed_steps']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
