#!/usr/bin/env python3
"""epmem as PyTorch's CUDA allocator against PyTorch's caching allocator, with
and without expandable segments, on a transformers decode (docs/ALLOCATOR.md).

    EPMEM_LIB=target/release/libepmem.so python3 scripts/bench_torch_alloc.py \\
        --out-json docs/bench/torch_alloc.json --out-md docs/bench/torch_alloc.md

Each row runs in its own process (an allocator is chosen before CUDA starts):

  torch       PyTorch's caching allocator (the reference for tokens)
  expandable  the same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  epmem       epmem.torch_allocator.use_as_allocator()

The workload: a Llama built from a config (fixed seed, bf16; by default
hidden 2048, 8 layers, ~0.51 B parameters: 1 GB of weights), greedy
generate() over --shapes (batch, prompt length) pairs drawn with a fixed seed
(prefill, then --new-tokens - 1 decode steps each). A warm-up pass runs every
shape once; the measured pass runs them again in another order.

The defaults fit the three rows in one GPU call (about 3 minutes on an H200).
Eager generate() at these sizes is bound by kernel launches, not FLOPs: on the
H200 a 24-layer model (the same widths) ran 240 shapes x 8 tokens in 37 s per
pass (0.154 s per shape, ~19 ms per forward, ~0.75 ms of it per layer), which
with the warm-up pass, model build and trace made one row outlast a 330 s
call. With 8 layers a forward is ~7.5 ms: a pass of 200 shapes ~12 s, a row
(import and model build, warm-up pass, measured pass, trace replay) about a
minute. Each row prints its phases (setup, warm-up, measured, trace) and is
stopped after --row-timeout seconds, the other rows still running. Depth
changes how often the pattern repeats, not the pattern: every layer allocates
the same tensors and its KV cache grows at each decode step; the weights'
share of the peak is smaller than with 24 layers (--layers 24 restores it).

Reported per row:

- tok/s: generated tokens of the measured pass / its wall time.
- peak reserved / peak requested: the most memory the allocator held from the
  driver over the bytes tensors asked for at the peak (fragmentation and
  caching overhead). PyTorch: memory_stats() reserved_bytes.all.peak /
  requested_bytes.all.peak (allocated_bytes, rounded to 512 B, also shown);
  epmem: peak_committed_bytes / peak_live_bytes.
- driver allocation calls after warm-up: PyTorch's num_device_alloc (cudaMalloc
  calls, or with expandable segments cuMemMap calls); epmem's driver_alloc_calls
  (cuMemCreate calls, one per 2 MiB granule). Both count how often the
  allocator went to the driver for memory; a steady state makes none.
- time in the allocator: every row replays the same allocation trace (the
  alloc/free sequence of a few shapes, recorded by PyTorch's memory history in
  the torch row) through torch.empty / del, ns per alloc+free (PyTorch's own
  dispatch overhead is in every row alike); epmem also reports the time spent
  inside epm_torch_alloc/free during the measured pass.
- tokens identical to the torch row, shape by shape.

--smoke runs the same code on the CPU with a tiny model and 4 shapes (no
allocator figures): argument parsing, shapes, generation, token comparison and
the reports, for machines without a GPU.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if os.environ.get("EPMEM_USE_INSTALLED") != "1":
    sys.path.insert(0, os.path.join(ROOT, "python"))

ROWS = {
    "torch": {},
    "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "epmem": {},
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="torch,expandable,epmem",
                    help="comma-separated rows to run, in order (torch first: it is the token reference)")
    ap.add_argument("--shapes", type=int, default=200, help="(batch, prompt) pairs per pass (>= 200 for the record)")
    ap.add_argument("--new-tokens", type=int, default=8, help="decode steps per shape")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--min-prompt", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace-shapes", type=int, default=4, help="shapes whose allocations are replayed for timing")
    ap.add_argument("--replays", type=int, default=20, help="times the recorded trace is replayed")
    ap.add_argument("--row-timeout", type=float, default=150.0,
                    help="seconds a row's process may run before it is stopped and reported as an error")
    ap.add_argument("--out-json", help="write the results here (JSON)")
    ap.add_argument("--out-md", help="write a markdown table here")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, 4 shapes: no allocator figures")
    ap.add_argument("--child", choices=sorted(ROWS), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--trace", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in args.rows if r not in ROWS]
    if bad:
        ap.error(f"unknown rows {bad}: choose from {sorted(ROWS)}")
    if args.smoke:
        args.shapes, args.new_tokens, args.max_batch, args.max_prompt = 4, 3, 3, 24
        args.hidden, args.layers, args.intermediate, args.heads, args.kv_heads, args.vocab = 64, 2, 128, 4, 2, 101
        args.dtype, args.trace_shapes, args.replays = "float32", 1, 1
    if args.shapes < 1 or args.new_tokens < 1 or args.max_batch < 1 or not 1 <= args.min_prompt <= args.max_prompt:
        ap.error("--shapes, --new-tokens, --max-batch must be positive and --min-prompt <= --max-prompt")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        ap.error("--hidden must divide by --heads, and --heads by --kv-heads")
    return args


def shapes(args):
    """The (batch, prompt length) pairs, the same in every row."""
    rnd = random.Random(args.seed)
    return [(rnd.randint(1, args.max_batch), rnd.randint(args.min_prompt, args.max_prompt)) for _ in range(args.shapes)]


def measured_order(args):
    order = list(range(args.shapes))
    random.Random(args.seed + 1).shuffle(order)
    return order


def param_count(args):
    h, i, v, n = args.hidden, args.intermediate, args.vocab, args.layers
    kv = h // args.heads * args.kv_heads
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return n * per_layer + 2 * v * h + h


# ---- one row, in its own process ------------------------------------------------------

def torch_counters(torch, cuda):
    if not cuda:
        return None
    s = torch.cuda.memory_stats()
    return {k: s.get(k) for k in ("num_device_alloc", "num_device_free", "reserved_bytes.all.peak",
                                  "allocated_bytes.all.peak", "requested_bytes.all.peak",
                                  "allocation.all.allocated", "segment.all.allocated", "num_alloc_retries")}


def record_trace(torch, run_shape, idx, path):
    """The allocation sequence of `idx` shapes, from PyTorch's memory history."""
    mem = torch.cuda.memory
    try:
        mem._record_memory_history(enabled="all", context=None, stacks="python", max_entries=1_000_000)
    except TypeError:
        mem._record_memory_history(True)
    for i in idx:
        run_shape(i)
    torch.cuda.synchronize()
    snap = mem._snapshot()
    mem._record_memory_history(enabled=None)
    events = []
    for ev in (snap.get("device_traces") or [[]])[0]:
        if ev.get("action") == "alloc":
            events.append(["a", ev["addr"], ev["size"]])
        elif ev.get("action") == "free_requested":
            events.append(["f", ev["addr"], ev["size"]])
    with open(path, "w") as f:
        json.dump(events, f)
    return len(events)


def replay(torch, path, times):
    """ns per alloc+free replaying the trace through torch.empty / del."""
    with open(path) as f:
        events = json.load(f)
    live, n, t0 = {}, 0, time.perf_counter()
    for _ in range(times):
        for kind, addr, size in events:
            if kind == "a":
                live[addr] = torch.empty(size, dtype=torch.uint8, device="cuda")
                n += 1
            else:
                live.pop(addr, None)
        live.clear()
    torch.cuda.synchronize()
    return {"events": len(events), "allocs": n, "ns_per_alloc_free": (time.perf_counter() - t0) * 1e9 / max(1, n)}


def child(args):
    t_start = time.perf_counter()
    row, cuda = args.child, not args.smoke
    out = {"row": row, "env": {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "EPM_TORCH_CAPACITY")}}
    if row == "epmem":
        import epmem.torch_allocator as eta
        eta.use_as_allocator()  # before torch touches CUDA
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dev = "cuda" if cuda else "cpu"
    dtype = getattr(torch, args.dtype)
    out["versions"] = {"torch": torch.__version__, "transformers": __import__("transformers").__version__}
    if cuda:
        out["gpu"] = torch.cuda.get_device_name(0)
        torch.backends.cuda.matmul.allow_tf32 = False
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=args.max_prompt + args.new_tokens + 8)
    torch.manual_seed(args.seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(prev)
    out["params"] = sum(p.numel() for p in model.parameters())
    sh = shapes(args)
    inputs = []
    for i, (b, t) in enumerate(sh):
        g = torch.Generator().manual_seed(args.seed * 100003 + i)
        inputs.append(torch.randint(3, args.vocab, (b, t), generator=g))

    def run_shape(i):
        ids = inputs[i].to(dev)
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
        return gen[:, ids.shape[1]:].tolist()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    sync()
    t0 = time.perf_counter()
    out["setup_s"] = t0 - t_start
    for i in range(len(sh)):
        run_shape(i)
    sync()
    out["warmup_s"] = time.perf_counter() - t0
    warm_torch = torch_counters(torch, cuda) if row != "epmem" else None
    warm_epmem = eta.stats(0) if row == "epmem" else None

    tokens = [None] * len(sh)
    t0 = time.perf_counter()
    for i in measured_order(args):
        tokens[i] = run_shape(i)
    sync()
    wall = time.perf_counter() - t0
    gen_tokens = sum(b * args.new_tokens for b, _ in sh)
    out.update(measured_s=wall, generated_tokens=gen_tokens, prefill_tokens=sum(b * t for b, t in sh),
               tok_per_s=gen_tokens / wall, tokens=tokens)

    if row == "epmem":
        s = eta.stats(0)
        out["epmem"] = s
        out["peak_reserved"] = s["peak_committed_bytes"]
        out["peak_requested"] = s["peak_live_bytes"]
        out["peak_allocated"] = s["peak_in_use_bytes"]
        out["driver_allocs_after_warmup"] = s["driver_alloc_calls"] - warm_epmem["driver_alloc_calls"]
        n = s["alloc_calls"] - warm_epmem["alloc_calls"]
        ns = (s["alloc_ns"] + s["free_ns"]) - (warm_epmem["alloc_ns"] + warm_epmem["free_ns"])
        out["allocs_measured"] = n
        out["inside_ns_per_alloc_free"] = ns / max(1, n)
    elif cuda:
        c = torch_counters(torch, cuda)
        out["torch"] = c
        out["peak_reserved"] = c["reserved_bytes.all.peak"]
        out["peak_requested"] = c["requested_bytes.all.peak"]
        out["peak_allocated"] = c["allocated_bytes.all.peak"]
        key = "num_device_alloc" if c.get("num_device_alloc") is not None else "segment.all.allocated"
        out["driver_counter"] = key
        out["driver_allocs_after_warmup"] = c[key] - warm_torch[key]
        out["allocs_measured"] = c["allocation.all.allocated"] - warm_torch["allocation.all.allocated"]
    if cuda and out.get("peak_requested"):
        out["reserved_over_requested"] = out["peak_reserved"] / out["peak_requested"]

    if cuda and args.trace:
        t0 = time.perf_counter()
        try:
            if row == "torch" and not os.path.exists(args.trace):
                out["trace_events"] = record_trace(torch, run_shape, range(min(args.trace_shapes, len(sh))), args.trace)
            if os.path.exists(args.trace):
                out["replay"] = replay(torch, args.trace, args.replays)
        except Exception as e:  # the timing column is reported missing, with why
            out["replay_error"] = f"{type(e).__name__}: {e}"
        out["trace_s"] = time.perf_counter() - t0
    with open(args.result, "w") as f:
        json.dump(out, f)


# ---- the driver ---------------------------------------------------------------------------

def run_row(args, row, trace):
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        result = f.name
    env = dict(os.environ, **ROWS[row])
    env.pop("EPM_DEVICE", None)
    if row != "expandable":
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    argv = [sys.executable, os.path.abspath(__file__), "--child", row, "--result", result, "--trace", trace]
    argv += forward_args(args)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.row_timeout)
    except subprocess.TimeoutExpired as e:
        os.unlink(result)
        tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return {"row": row, "error": f"{tail[-2000:]}\nstopped after --row-timeout {args.row_timeout:.0f} s"}
    try:
        if p.returncode != 0:
            return {"row": row, "error": f"exit {p.returncode}: {(p.stderr or p.stdout)[-2000:]}"}
        with open(result) as f:
            r = json.load(f)
        r["process_s"] = time.perf_counter() - t0
        return r
    finally:
        os.unlink(result)


def forward_args(args):
    names = ["shapes", "new_tokens", "max_batch", "min_prompt", "max_prompt", "hidden", "layers", "intermediate",
             "heads", "kv_heads", "vocab", "dtype", "seed", "trace_shapes", "replays"]
    out = [] if not args.smoke else ["--smoke"]
    if not args.smoke:
        for n in names:
            out += [f"--{n.replace('_', '-')}", str(getattr(args, n))]
    return out


def summarize(args, results):
    ref = next((r for r in results if r["row"] == "torch" and "tokens" in r), None)
    for r in results:
        if "tokens" in r and ref is not None:
            diff = [i for i, (a, b) in enumerate(zip(r["tokens"], ref["tokens"])) if a != b]
            r["tokens_identical"] = not diff and len(r["tokens"]) == len(ref["tokens"])
            r["shapes_differing"] = diff[:20]
            r["shapes_differing_count"] = len(diff)
    torch_rows = [r for r in results if r["row"] in ("torch", "expandable") and "tok_per_s" in r]
    ep = next((r for r in results if r["row"] == "epmem" and "tok_per_s" in r), None)
    targets = {}
    if torch_rows and ep is not None and not args.smoke:
        best_speed = max(r["tok_per_s"] for r in torch_rows)
        ratios = [r["reserved_over_requested"] for r in torch_rows if r.get("reserved_over_requested")]
        targets = {
            "speed_vs_best_torch": ep["tok_per_s"] / best_speed,
            "speed_target_met": ep["tok_per_s"] >= 0.98 * best_speed,
            "reserved_ratio_target_met": bool(ratios) and ep.get("reserved_over_requested", 1e9) <= min(ratios),
            "zero_driver_calls_after_warmup": ep.get("driver_allocs_after_warmup") == 0,
            "tokens_identical": ep.get("tokens_identical"),
        }
    for r in results:
        r.pop("tokens", None)
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": " ".join(sys.argv),
            "shapes": args.shapes, "new_tokens": args.new_tokens, "smoke": args.smoke,
            "params_estimate": param_count(args), "rows": results, "targets": targets}


def fmt(v, spec):
    return "n/a" if v is None else format(v, spec)


def markdown(s):
    lines = [f"# epmem as PyTorch's allocator vs PyTorch's caching allocator ({s['date']})", "",
             f"`{s['command']}`", "",
             f"{s['shapes']} shapes x {s['new_tokens']} new tokens per pass; ~{s['params_estimate'] / 1e9:.2f} B "
             "parameters. Driver calls: PyTorch num_device_alloc, epmem driver_alloc_calls. Replay: ns per "
             "torch.empty+del over the same recorded trace in every row.", "",
             "| allocator | tok/s | peak reserved / requested | peak reserved (MiB) | driver allocs after warm-up "
             "| replay ns/op | epmem inside ns/op | tokens vs the torch row |",
             "|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        if "error" in r:
            lines.append(f"| {r['row']} | error: {r['error'].splitlines()[-1][:120] if r['error'] else ''} "
                         "| | | | | | |")
            continue
        rep = r.get("replay") or {}
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r["row"], fmt(r.get("tok_per_s"), ".1f"), fmt(r.get("reserved_over_requested"), ".3f"),
            fmt(r["peak_reserved"] / 2**20 if r.get("peak_reserved") else None, ".0f"),
            fmt(r.get("driver_allocs_after_warmup"), "d"), fmt(rep.get("ns_per_alloc_free"), ".0f"),
            fmt(r.get("inside_ns_per_alloc_free"), ".0f"),
            "reference" if r["row"] == "torch" else
            f"{r.get('shapes_differing_count', '?')} of {s.get('shapes', '?')} shapes differ"))
    if s["targets"]:
        t = s["targets"]
        lines += ["", f"Targets: speed {t['speed_vs_best_torch']:.3f} x the better PyTorch row (>= 0.98: "
                      f"{'met' if t['speed_target_met'] else 'NOT met'}); reserved/requested <= the better PyTorch "
                      f"row's: {'met' if t['reserved_ratio_target_met'] else 'NOT met'}; 0 driver calls after "
                      f"warm-up: {'met' if t['zero_driver_calls_after_warmup'] else 'NOT met'}; tokens identical: "
                      f"{t['tokens_identical']}."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    if args.rows[0] != "torch" and "torch" in args.rows:
        args.rows.remove("torch")
        args.rows.insert(0, "torch")
    sh = shapes(args)
    print(f"bench_torch_alloc: rows {args.rows}, {len(sh)} shapes (batch 1-{args.max_batch}, prompt "
          f"{args.min_prompt}-{args.max_prompt}), {args.new_tokens} new tokens, ~{param_count(args) / 1e9:.2f} B "
          f"parameters ({args.dtype}){' [smoke: CPU]' if args.smoke else ''}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        results = []
        for row in args.rows:
            r = run_row(args, row, trace)
            results.append(r)
            print(f"  {row}: " + (r["error"].splitlines()[-1] if "error" in r else
                                  f"{r['tok_per_s']:.1f} tok/s, reserved/requested "
                                  f"{fmt(r.get('reserved_over_requested'), '.3f')}, driver allocs after warm-up "
                                  f"{r.get('driver_allocs_after_warmup', 'n/a')}; seconds: setup "
                                  f"{fmt(r.get('setup_s'), '.1f')}, warm-up {fmt(r.get('warmup_s'), '.1f')}, "
                                  f"measured {fmt(r.get('measured_s'), '.1f')}, trace {fmt(r.get('trace_s'), '.1f')}, "
                                  f"process {fmt(r.get('process_s'), '.1f')}"), flush=True)
    s = summarize(args, results)
    md = markdown(s)
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(s, f, indent=1)
    if args.out_md:
        with open(args.out_md, "w") as f:
            f.write(md)
    print(md)
    # Tokens are reported, not judged: PyTorch's own expandable-segments row
    # flips near-tied argmaxes of the random-weight model on some shapes too
    # (placement changes kernel choice). Bit-identical tokens are the job of
    # tests/gpu/torch_allocator.py. The run fails on an error or a missed target.
    t = s.get("targets") or {}
    ok = all("error" not in r for r in results) and all(
        t.get(k, True) for k in ("speed_target_met", "reserved_ratio_target_met", "zero_driver_calls_after_warmup"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
