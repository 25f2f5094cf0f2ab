#!/usr/bin/env python3
"""Weight offload as users call it, beside the peers a user would pick instead,
in one process: a transformers Llama-shaped decoder (random bf16 weights, fixed
seed) whose decoder-layer linears do not fit a VRAM budget, decoded greedily.

Rows (each at 25/50/75% of the offloaded bytes unless it has no budget):

  epmem         epmem.torch.offload(model, budget) with nothing else set, on torch's
                default stream: the product path, exactly as docs/PYTHON.md shows it
                (compress="auto": on CUDA the bf16 weights stream compressed and are
                decoded on the device)
  epmem_raw     epmem.torch.offload(model, budget, compress=False): the same path
                streaming raw bytes, against which compression is measured
  epmem_staged  epmem.torch.offload(model, budget, sources="staged"): pageable sources
                (no page-locking), every page-in staged; the product API with one argument
  uva           UVA zero-copy (vLLM's --cpu-offload-gb): the first budget-worth of
                linears (forward order) stays on the GPU, the rest are pin_memory()
                copies aliased as CUDA tensors through the CUDA array interface, so the
                GEMMs read them in place over PCIe. No library, no VRAM for them.
  accelerate    accelerate.dispatch_model: the first budget-worth of linears on the
                GPU, the rest cpu-offloaded (AlignDevicesHook copies each per forward).
                Its host copies are pinned (faster than the pageable state dict a user
                would have: the stronger peer)
  diffusers     diffusers' apply_group_offloading(model.model, block_level,
                num_blocks_per_group=1, use_stream=True, record_stream=True): prefetches
                the next block on a side stream, no budget (every block streams every
                token), so one row per shape with its own floor (offloaded / peak)
  resident      every weight on the GPU: the reference tokens and times

Modes: decode at batch 1 (--tokens steps after an 8-token prompt), decode at
batch 16 and 64 (--batch-tokens steps), and a --prefill-token prompt's time to
the first token. The floor of a row is the bytes it must move over the pinned
H2D peak measured in this process: (offloaded - budget) / peak per token (per
prefill), offloaded / peak for diffusers. Every row's tokens must equal the
resident run's (same mode); a mismatch fails the run (exit 1). Compressed rows
also report the compressed bytes streamed per pass, their ratio to the raw
(offloaded - budget) floor's bytes, the decode time per pass, and the host RAM of
the offloaded weights ÷ raw.

    python3 scripts/bench_torch.py --json PATH [--shapes big,gqa,small] [--budgets 25,50,75]
    python3 scripts/bench_torch.py --cells --json PATH    # one process per shape and budget, merged
    python3 scripts/bench_torch.py --quick     # seconds, CPU + host device, tiny model (CI smoke)

--cells runs each (shape, budget) in a process of its own (diffusers, which has
no budget, in each shape's first) and merges them (bench_torch_merge.py): every
epmem cell is then the first offload of its process, as a user's single
offload() is. A process's later offloads copy 2-6% slower on an H100
(docs/BENCHMARKS.md, "What else the runs of 2026-12-07 showed").

Needs torch (CUDA build for the real run) and transformers; accelerate and
diffusers for their rows (skipped with a note when missing, or when --no-X);
matplotlib for the PNG. Markdown table on stdout and next to --json.
"""

import argparse
import gc
import json
import os
import sys
import time
from _floor import whole_weight_floor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.environ.get("EPMEM_USE_INSTALLED") != "1":
    sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import epmem  # noqa: E402
import epmem.torch as et  # noqa: E402

GiB = 1 << 30
SHAPES = {
    # name: (blocks, hidden, intermediate, heads, kv_heads)
    "big": (8, 8192, 28672, 64, 64),     # ~14.5 GiB of bf16 layer weights, multi-head: PCIe-bound
    "gqa": (6, 8192, 28672, 64, 8),      # ~9.6 GiB, grouped-query (K/V 8x smaller than q/o)
    "small": (16, 4096, 11008, 32, 32),  # ~6.0 GiB, smaller matrices
    "quick": (4, 128, 352, 4, 2),        # --quick
}
BUDGET_METHODS = ("epmem", "epmem_raw", "epmem_staged", "uva", "accelerate")
METHODS = BUDGET_METHODS + ("diffusers",)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---- model and decoding -----------------------------------------------------------------

def make_model(shape, device, dtype, vocab, seed, max_pos):
    from transformers import LlamaConfig, LlamaForCausalLM
    n, d, f, heads, kv = SHAPES[shape]
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=f, num_hidden_layers=n,
                              num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max_pos,
                              tie_word_embeddings=False)
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.to(dtype).eval().requires_grad_(False)


def offloaded_linears(model):
    """(name, module) of every nn.Linear inside model.model.layers, forward order:
    what epmem.torch.offload offloads by default."""
    return [(f"model.layers.{i}.{n}", m) for i, blk in enumerate(model.model.layers)
            for n, m in blk.named_modules() if isinstance(m, nn.Linear)]


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def decode(model, prompt, steps, dev):
    """Greedy: prefill `prompt` (untimed), then `steps` single-token steps (timed).
    Returns (tokens [batch][steps], seconds of the timed steps)."""
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        cache, logits = out.past_key_values, out.logits
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        sync(dev)
        cols, t0 = [], time.perf_counter()
        for _ in range(steps):
            out = model(nxt, past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            cols.append(nxt)
        sync(dev)
        secs = time.perf_counter() - t0
    toks = torch.cat(cols, 1).tolist() if cols else [[] for _ in range(prompt.shape[0])]
    return toks, secs


PREFILL_REPEATS = 2


def prefill(model, prompt, dev, repeats=PREFILL_REPEATS):
    """Time to the first token of `prompt` (best of `repeats`) and that token."""
    best, tok = None, None
    with torch.no_grad():
        for _ in range(repeats):
            sync(dev)
            t0 = time.perf_counter()
            logits = model(prompt, use_cache=True).logits
            nxt = logits[:, -1].argmax(-1)
            sync(dev)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
            tok = nxt.tolist()
            del logits
    return tok, best


def h2d_peak(dev, nbytes):
    """Pinned host -> device bytes/s, torch copies (the floor's denominator)."""
    if dev.type != "cuda":
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        src.fill_(1)
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = max(best, nbytes / (time.perf_counter() - t0))
        return best
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 0.0
    for _ in range(3):  # the first warms up
        a.record()
        for _ in range(4):
            dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        best = max(best, 4 * nbytes / (a.elapsed_time(b) / 1e3))
    del src, dst
    return best


class Workload:
    """The prompts of every mode, made once per shape from the seed."""

    def __init__(self, dev, vocab, seed, batches, batch_tokens, tokens, prefill_tokens):
        g = torch.Generator().manual_seed(seed + 1)
        self.modes = [("b1", torch.randint(1, vocab, (1, 8), generator=g), tokens)]
        for b in batches:
            self.modes.append((f"b{b}", torch.randint(1, vocab, (b, 8), generator=g), batch_tokens))
        self.prefill = torch.randint(1, vocab, (1, prefill_tokens), generator=g) if prefill_tokens else None
        self.modes = [(m, p.to(dev), s) for m, p, s in self.modes]
        if self.prefill is not None:
            self.prefill = self.prefill.to(dev)
        self.dev = dev

    def warm(self, model):
        """Every decode mode once with 2 steps, and one prefill forward: the
        first use of each batch shape (cuBLAS heuristics, lazily loaded
        kernels, the offload's plan) stays out of every measured mode."""
        for m, prompt, steps in self.modes:
            decode(model, prompt, min(2, steps), self.dev)
        if self.prefill is not None:
            prefill(model, self.prefill, self.dev, repeats=1)

    def run(self, model, modes=None):
        """{mode: {"tokens", "seconds"}} and "prefill": {"tokens", "seconds"}."""
        out = {}
        for m, prompt, steps in self.modes:
            if modes is not None and m not in modes:
                continue
            toks, secs = decode(model, prompt, steps, self.dev)
            out[m] = {"tokens": toks, "seconds": secs, "steps": steps, "batch": prompt.shape[0]}
        if self.prefill is not None and (modes is None or "prefill" in modes):
            tok, secs = prefill(model, self.prefill, self.dev)
            out["prefill"] = {"tokens": [tok], "seconds": secs, "steps": 1, "batch": 1,
                              "prompt_tokens": self.prefill.shape[1]}
        return out


# ---- the peers --------------------------------------------------------------------------

_INT = {1: "|u1", 2: "<i2", 4: "<i4"}


class CudaArray:
    """A __cuda_array_interface__ over memory torch did not allocate: `ptr`
    (a device pointer, or with unified addressing a page-locked host pointer,
    which is UVA) read as `shape` items of `typestr`; `owner` is kept alive."""

    def __init__(self, ptr, shape, typestr, owner=None):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "data": (ptr, False), "strides": None, "version": 3}


def uva_alias(host, dev):
    t = torch.as_tensor(CudaArray(host.data_ptr(), host.shape, _INT[host.element_size()], host), device=dev)
    if t.data_ptr() != host.data_ptr():
        raise RuntimeError("torch copied the pinned host array instead of aliasing it")
    return t.view(host.dtype)


def pinned_copies(model, dev):
    """{param name: pinned host copy} of every offloadable weight (one copy per shape,
    shared by the uva and accelerate rows)."""
    out = {}
    for name, m in offloaded_linears(model):
        for pn, p in m.named_parameters(recurse=False):
            h = torch.empty(p.shape, dtype=p.dtype, pin_memory=dev.type == "cuda")
            h.copy_(p.detach())
            out[f"{name}.{pn}"] = h
    return out


def split_by_budget(model, budget):
    """The linears in forward order: the first ones up to `budget` bytes stay on
    the GPU, the rest are offloaded. Returns (names offloaded, bytes kept)."""
    used, off = 0, []
    for name, m in offloaded_linears(model):
        nb = sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
        if used + nb <= budget and not off:
            used += nb
        else:
            off.append(name)
    return off, used


def run_uva(model, work, dev, budget, host):
    mods = dict(offloaded_linears(model))
    off, kept = split_by_budget(model, budget)
    saved = {}
    for name in off:
        m = mods[name]
        for pn, p in m.named_parameters(recurse=False):
            saved[(name, pn)] = p.data
            h = host[f"{name}.{pn}"]
            p.data = uva_alias(h, dev) if dev.type == "cuda" else h
    gc.collect()
    try:
        work.warm(model)
        res = work.run(model)
    finally:
        for (name, pn), data in saved.items():
            getattr(mods[name], pn).data = data
    return res, {"resident_bytes": kept}


def run_accelerate(model, work, dev, budget, host, tokens):
    from accelerate import dispatch_model
    from accelerate.hooks import remove_hook_from_submodules
    mods = dict(offloaded_linears(model))
    off, kept = split_by_budget(model, budget)
    main = dev.index if dev.type == "cuda" else "cpu"
    device_map = {name: main for name in mods}
    saved = {}
    for name in off:
        device_map[name] = "cpu"
        m = mods[name]
        for pn, p in list(m.named_parameters(recurse=False)):
            saved[(name, pn)] = p
            m._parameters[pn] = nn.Parameter(host[f"{name}.{pn}"], requires_grad=False)
    for name, m in model.named_modules():
        if name and name not in device_map and (next(m.parameters(recurse=False), None) is not None
                                                or next(m.buffers(recurse=False), None) is not None):
            device_map[name] = main
    dispatch_model(model, device_map=device_map, main_device=main)
    short = Workload.__new__(Workload)
    short.dev, short.prefill = dev, None
    short.modes = [(m, p, min(s, tokens)) for m, p, s in work.modes if m == "b1"]
    try:
        short.run(model)
        res = short.run(model)
    finally:
        remove_hook_from_submodules(model)
        for (name, pn), p in saved.items():
            mods[name]._parameters[pn] = p
        if hasattr(model, "hf_device_map"):
            del model.hf_device_map
    return res, {"resident_bytes": kept}


def run_diffusers(model, work, dev, tokens):
    """Last on a shape: it moves model.model to the CPU and leaves hooks."""
    from diffusers.hooks import apply_group_offloading
    model.model.to("cpu")
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    apply_group_offloading(model.model, onload_device=dev, offload_type="block_level", num_blocks_per_group=1,
                           use_stream=dev.type == "cuda", record_stream=dev.type == "cuda")
    short = Workload.__new__(Workload)
    short.dev, short.prefill = dev, None
    short.modes = [(m, p, min(s, tokens)) for m, p, s in work.modes if m == "b1"]
    short.run(model)
    return short.run(model), {}


def run_epmem(model, work, budget, **kw):
    h = et.offload(model, budget, **kw)
    try:
        work.warm(model)  # first page-ins, registrations, plan; every batch shape
        s0 = h.stats()
        res = work.run(model)
        s1 = h.stats()
    finally:
        h.remove()
    # Each decode mode runs one prefill forward and its steps; the prefill mode
    # runs prefill()'s repeats: every forward is one pass over the layers.
    passes = sum(r["steps"] + 1 for m, r in res.items() if m != "prefill") + (PREFILL_REPEATS if "prefill" in res else 0)
    d = {k: s1[k] - s0[k] for k in ("htod_bytes", "compressed_htod_bytes", "decoded_bytes", "decodes", "decode_ms")}
    extra = {"granularity": s1["granularity"], "sources": s1["sources"],
             "streamed_bytes_per_pass": d["htod_bytes"] / passes,
             # What reached the weights' memory per pass (compressed bytes counted decoded).
             "decoded_equiv_bytes_per_pass": (d["htod_bytes"] - d["compressed_htod_bytes"] + d["decoded_bytes"]) / passes,
             "compress": s1["compress"], "compressed_weights": s1["compressed_weights"],
             "compressed_htod_bytes_per_pass": d["compressed_htod_bytes"] / passes,
             "decodes_per_pass": d["decodes"] / passes, "decode_ms_per_pass": d["decode_ms"] / passes,
             "host_weight_bytes": s1["host_weight_bytes"],
             "host_ram_ratio": s1["host_weight_bytes"] / s1["offloaded_bytes"],
             "decode_staging_bytes": s1["decode_staging_bytes"],
             "host_stall_ms": s1["host_stall_ms"] - s0["host_stall_ms"],
             "peak_resident_bytes": s1["peak_resident_bytes"],
             "budget_held": s1["peak_resident_bytes"] + s1["decode_staging_bytes"] <= budget,
             "bypassed_page_ins": s1["bypassed_page_ins"] - s0["bypassed_page_ins"],
             "staged_page_ins": s1["staged_page_ins"] - s0["staged_page_ins"],
             "hook_calls": s1["hook_calls"], "legacy_stream_calls": s1["legacy_stream_calls"]}
    return res, extra


# ---- the run ----------------------------------------------------------------------------

def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here (and .md, .png beside it)")
    ap.add_argument("--plot", help="PNG of tok/s vs budget (default: next to --json)")
    ap.add_argument("--shapes", default="big,gqa,small")
    ap.add_argument("--budgets", default="25,50,75")
    ap.add_argument("--tokens", type=int, default=32, help="batch-1 decode steps")
    ap.add_argument("--batches", default="16,64", help="batched decode sizes ('' for none)")
    ap.add_argument("--batch-tokens", type=int, default=16)
    ap.add_argument("--prefill-tokens", type=int, default=2048, help="0: no prefill mode")
    ap.add_argument("--peer-tokens", type=int, default=8, help="decode steps of the accelerate/diffusers rows")
    ap.add_argument("--accelerate-budgets", default="50", help="budgets of the accelerate row ('' for none)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--methods", default=",".join(METHODS), help="rows to run (resident always runs)")
    ap.add_argument("--quick", action="store_true", help="tiny model, few tokens: a smoke run (CPU/host device ok)")
    ap.add_argument("--cells", action="store_true", help="one process per shape and budget, merged into --json")
    return ap


def main():
    ap = parser()
    a = ap.parse_args()
    if a.cells:
        return run_cells(a, ap)
    budgets = [int(b) for b in a.budgets.split(",") if b]
    shapes = a.shapes.split(",")
    batches = [int(b) for b in a.batches.split(",") if b]
    methods = [m for m in a.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            sys.exit(f"bench_torch: unknown method {m!r} (one of {', '.join(METHODS)})")
    acc_budgets = [int(b) for b in a.accelerate_budgets.split(",") if b]
    if a.quick:
        shapes, a.tokens, a.batch_tokens, a.peer_tokens, a.vocab = ["quick"], 6, 3, 3, 512
        batches, a.prefill_tokens = [4], 64

    with epmem.Device() as edev:
        ekind = edev.kind
    dev = torch.device("cuda", 0) if ekind == "cuda" else torch.device("cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_torch: epmem's device is CUDA but torch has no CUDA")
    if dev.type == "cpu" and not a.quick:
        sys.exit("bench_torch: no CUDA device (EPM_DEVICE=host): only --quick runs on the host device")
    notes = []
    for m, mod in (("accelerate", "accelerate"), ("diffusers", "diffusers")):
        if m in methods:
            try:
                __import__(mod)
            except ImportError:
                notes.append(f"{m} is not installed: its rows were not run")
                methods.remove(m)
    if dev.type != "cuda" and "diffusers" in methods:
        notes.append("diffusers: runs on CUDA only (its stream prefetch); not run on the host device")
        methods.remove("diffusers")
    for n in notes:
        log(n)
    peak = h2d_peak(dev, (64 << 20) if a.quick else GiB)
    log(f"pinned H2D peak: {peak / 1e9:.1f} GB/s")
    result = {"device": ekind, "torch": torch.__version__, "epmem": epmem.version_string(),
              "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "h2d_peak_bytes_per_s": peak, "tokens": a.tokens, "batch_tokens": a.batch_tokens,
              "peer_tokens": a.peer_tokens, "prefill_tokens": a.prefill_tokens, "methods": methods,
              "notes": notes, "shapes": []}
    mismatches = []
    t_start = time.perf_counter()
    for shape in shapes:
        max_pos = max(256, a.prefill_tokens + 64)
        model = make_model(shape, dev, torch.bfloat16, a.vocab, a.seed, max_pos)
        lin = offloaded_linears(model)
        sizes = [p.numel() * p.element_size() for _, m in lin for p in m.parameters(recurse=False)]
        off = sum(sizes)
        n, d, f, heads, kv = SHAPES[shape]
        log(f"== {shape}: {n} blocks {d}/{f}, {heads} heads / {kv} KV heads, {off / GiB:.2f} GiB offloadable")
        work = Workload(dev, a.vocab, a.seed, batches, a.batch_tokens, a.tokens, a.prefill_tokens)
        work.warm(model)
        ref = work.run(model)
        ref2 = work.run(model, modes={"b1"})
        if ref2["b1"]["tokens"] != ref["b1"]["tokens"]:
            mismatches.append(f"{shape} resident: two decodes differ")
        ref["b1"]["seconds"] = min(ref["b1"]["seconds"], ref2["b1"]["seconds"])
        sh = {"name": shape, "blocks": n, "hidden": d, "intermediate": f, "heads": heads, "kv_heads": kv,
              "vocab": a.vocab, "offloaded_bytes": off, "largest_weight_bytes": max(sizes),
              "resident": {m: {"tok_s": r["batch"] * r["steps"] / r["seconds"] if m != "prefill" else None,
                               "seconds": r["seconds"], "steps": r["steps"], "batch": r["batch"],
                               "tokens": r["tokens"]}
                           for m, r in ref.items()},
              "rows": []}
        log("   resident: " + ", ".join(f"{m} {r['seconds'] / r['steps'] * 1e3:.1f} ms/step" for m, r in ref.items()))

        def add(method, pct, budget, res, extra):
            floor_bytes = off - budget
            for mode, r in res.items():
                want = ref[mode]["tokens"]
                got = r["tokens"]
                same = all(g == w[:len(g)] for g, w in zip(got, want)) and len(got) == len(want)
                if not same:
                    mismatches.append(f"{shape} {pct}% {method} {mode}")
                per_step = r["seconds"] / r["steps"]
                row = {"method": method, "budget_pct": pct, "budget_bytes": budget, "mode": mode,
                       "batch": r["batch"], "steps": r["steps"], "seconds_per_step": per_step,
                       "tok_s": r["batch"] / per_step if mode != "prefill" else None,
                       "ttft_s": per_step if mode == "prefill" else None,
                       "floor_bytes": floor_bytes, "floor_s": floor_bytes / peak,
                       "ratio_to_floor": (floor_bytes / peak) / per_step if floor_bytes > 0 else None,
                       "tokens_identical": same, "tokens_compared": len(got[0]) if got else 0,
                       "resident_seconds_per_step": ref[mode]["seconds"] / ref[mode]["steps"]}
                row.update(extra)
                if floor_bytes > 0 and "streamed_bytes_per_pass" in extra:
                    # Bytes over PCIe ÷ the raw floor's: below 1 only by compression.
                    row["streamed_ratio_to_floor_bytes"] = extra["streamed_bytes_per_pass"] / floor_bytes
                sh["rows"].append(row)
                log(f"   {pct}% {method} {mode}: {per_step * 1e3:.1f} ms/step, "
                    f"{row['ratio_to_floor'] or 0:.3f} x floor{'' if same else ', TOKENS DIFFER'}")

        host = None
        if "uva" in methods or "accelerate" in methods:
            host = pinned_copies(model, dev)
        for pct in budgets:
            budget = off * pct // 100
            extra_common = {"whole_weight_floor_bytes": whole_weight_floor(sizes, budget)}
            for method in methods:
                if method == "epmem":
                    res, extra = run_epmem(model, work, budget)
                elif method == "epmem_raw":
                    res, extra = run_epmem(model, work, budget, compress=False)
                elif method == "epmem_staged":
                    res, extra = run_epmem(model, work, budget, sources="staged")
                    res = {"b1": res["b1"]}
                elif method == "uva":
                    res, extra = run_uva(model, work, dev, budget, host)
                elif method == "accelerate" and pct in acc_budgets:
                    res, extra = run_accelerate(model, work, dev, budget, host, a.peer_tokens)
                else:
                    continue
                add(method, pct, budget, res, dict(extra_common, **extra))
                gc.collect()
        del host
        gc.collect()
        if "diffusers" in methods:
            res, extra = run_diffusers(model, work, dev, a.peer_tokens)
            add("diffusers", None, 0, res, extra)
        sh["wall_s"] = time.perf_counter() - t_start
        result["shapes"].append(sh)
        if a.json:  # what is done so far survives a run cut short by a time limit
            with open(a.json, "w") as f:
                json.dump(dict(result, partial=True, mismatches=mismatches), f, indent=1)
        del model, work
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    result["wall_s"] = time.perf_counter() - t_start
    result["tokens_identical"] = not mismatches
    result["mismatches"] = mismatches
    write_results(result, a.json, a.plot)
    if mismatches:
        print(f"TOKENS DIFFER: {', '.join(mismatches)}")
        return 1
    print("tokens identical in every row")
    return 0


# the options run_cells sets per cell (or that mean nothing inside one); every other
# option of the parser is forwarded to each cell as given
CELL_OWN = {"--json", "--plot", "--shapes", "--budgets", "--methods", "--cells", "--help"}


def forwarded(a, ap):
    """Every option of `ap` but CELL_OWN, as command-line words with `a`'s values."""
    words = []
    for act in ap._actions:
        flag = next((o for o in act.option_strings if o.startswith("--")), None)
        if flag is None or flag in CELL_OWN:
            continue
        v = getattr(a, act.dest)
        if act.nargs == 0:  # store_true / store_false
            if v != act.default:
                words.append(flag)
        elif v is not None:  # an option left unset stays unset in the cells
            words += [flag, str(v)]
    return words


def run_cells(a, ap):
    """--cells: this script once per (shape, budget), each cell's JSON beside
    --json, then one merged JSON, table and plot. Exit 1 if a cell failed or
    any row's tokens differ."""
    import subprocess
    from bench_torch_merge import merge
    if not a.json:
        sys.exit("bench_torch: --cells needs --json (the cells' results are written beside it)")
    shapes = ["quick"] if a.quick else [s for s in a.shapes.split(",") if s]
    budgets = [b for b in a.budgets.split(",") if b]
    methods = [m for m in a.methods.split(",") if m]
    if not shapes or not budgets:
        sys.exit("bench_torch: --cells needs at least one shape and one budget")
    common = forwarded(a, ap)
    stem = os.path.splitext(a.json)[0]
    parts, failed = [], []
    for shape in shapes:
        for i, pct in enumerate(budgets):
            ms = [m for m in methods if m != "diffusers" or i == 0]
            part = f"{stem}-{shape}-{pct}.json"
            if os.path.exists(part):  # an earlier run's cell must not pass for this one's
                os.remove(part)
            cmd = [sys.executable, os.path.abspath(__file__), "--shapes", shape, "--budgets", pct,
                   "--methods", ",".join(ms), "--json", part, *common]
            log(f"== cell {shape} {pct}%: {' '.join(cmd[1:])}")
            rc = subprocess.run(cmd).returncode
            if rc != 0 or not os.path.exists(part):
                failed.append(f"{shape} {pct}% (exit {rc})")
            if os.path.exists(part):
                parts.append(part)
    with_results, done = [], []
    for p in parts:
        with open(p) as f:
            r = json.load(f)
        if r.get("partial"):  # a cell cut short: its rows are not all there
            failed.append(f"{os.path.basename(p)} (partial)")
        else:
            with_results.append(r)
            done.append(os.path.basename(p))
    if not with_results:
        sys.exit(f"bench_torch: no cell completed ({', '.join(failed)})")
    res = merge(with_results)
    res["cells"] = done
    write_results(res, a.json, a.plot)
    if failed:
        print(f"cells that failed: {', '.join(failed)}")
    if not res["tokens_identical"]:
        print("TOKENS DIFFER in some cell")
        return 1
    print("tokens identical in every row")
    return 1 if failed else 0


# ---- report -----------------------------------------------------------------------------

def write_results(res, json_path, plot=None):
    """The table on stdout; with `json_path`, the JSON there and the table
    beside it (.md); the plot at `plot`, or beside the JSON (.png)."""
    table = table_md(res)
    print(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
        with open(os.path.splitext(json_path)[0] + ".md", "w") as f:
            f.write(table)
    plot = plot or (os.path.splitext(json_path)[0] + ".png" if json_path else None)
    if plot:
        write_plot(res, plot)


def fmt(x, spec):
    return "—" if x is None else format(x, spec)


def _verdict(ok):
    return "met" if ok else "MISSED"


def table_md(res):
    lines = []
    out = lines.append
    out(f"\n# bench_torch: {res['gpu']}, torch {res['torch']}, epmem {res['epmem']}, "
        f"pinned H2D peak {res['h2d_peak_bytes_per_s'] / 1e9:.1f} GB/s\n")
    for n in res.get("notes", []):
        out(f"- {n}")
    for sh in res["shapes"]:
        out(f"\n## {sh['name']}: {sh['blocks']} blocks {sh['hidden']}/{sh['intermediate']}, "
            f"{sh['heads']} heads, {sh['kv_heads']} KV heads, {sh['offloaded_bytes'] / GiB:.2f} GiB offloaded\n")
        out("| mode | budget | method | ms/step | tok/s | × floor | × uva | streamed MiB/pass | "
            "whole-weight floor MiB | tokens |")
        out("|---|---|---|---|---|---|---|---|---|---|")
        by = {(r["mode"], r["budget_pct"], r["method"]): r for r in sh["rows"]}
        modes = [m for m in sh["resident"]]
        for mode in modes:
            rr = sh["resident"][mode]
            out(f"| {mode} | — | resident | {rr['seconds'] / rr['steps'] * 1e3:.1f} | "
                f"{fmt(rr['tok_s'], '.2f')} | — | — | — | — | reference |")
            for r in sh["rows"]:
                if r["mode"] != mode:
                    continue
                uva = by.get((mode, r["budget_pct"], "uva"))
                x_uva = uva["seconds_per_step"] / r["seconds_per_step"] if uva else None
                streamed = r.get("streamed_bytes_per_pass")
                wwf = r.get("whole_weight_floor_bytes")
                out(f"| {mode} | {'—' if r['budget_pct'] is None else str(r['budget_pct']) + '%'} | {r['method']} | "
                    f"{r['seconds_per_step'] * 1e3:.1f} | {fmt(r['tok_s'], '.2f')} | "
                    f"{fmt(r['ratio_to_floor'], '.3f')} | {fmt(x_uva, '.2f')} | "
                    f"{fmt(streamed and streamed / 2**20, '.0f')} | {fmt(wwf and wwf / 2**20, '.0f')} | "
                    f"{'identical' if r['tokens_identical'] else 'DIFFER'} ({r['tokens_compared']}) |")
        out("")
        for pct in sorted({r["budget_pct"] for r in sh["rows"] if r["budget_pct"] is not None}):
            ep, uva = by.get(("b1", pct, "epmem")), by.get(("b1", pct, "uva"))
            if ep and ep["ratio_to_floor"] is not None:
                v = ep["ratio_to_floor"]
                line = f"target {sh['name']} {pct}% decode: epmem defaults >= 0.95 x floor: {v:.3f} {_verdict(v >= 0.95)}"
                if uva:
                    u = uva["seconds_per_step"] / ep["seconds_per_step"]
                    line += f"; >= 1.05 x uva: {u:.3f} {_verdict(u >= 1.05)}"
                out(line)
            raw = by.get(("b1", pct, "epmem_raw"))
            if ep and ep.get("compressed_weights"):
                ratio = ep.get("streamed_ratio_to_floor_bytes")
                line = (f"compressed {sh['name']} {pct}%: {ep['compressed_weights']} weights, streamed "
                        f"{ep['streamed_bytes_per_pass'] / 2**20:.0f} MiB/pass = {fmt(ratio, '.3f')} x the raw floor's "
                        f"bytes, {ep['compressed_htod_bytes_per_pass'] / 2**20:.0f} MiB of it compressed, decode "
                        f"{ep['decode_ms_per_pass']:.2f} ms/pass, host RAM of offloaded weights "
                        f"{ep['host_ram_ratio']:.3f} x raw")
                if raw:
                    line += f"; {raw['seconds_per_step'] / ep['seconds_per_step']:.3f} x epmem_raw"
                out(line)
                if ep["ratio_to_floor"] is not None:
                    v, res_x = ep["ratio_to_floor"], ep["resident_seconds_per_step"] / ep["seconds_per_step"]
                    out(f"target {sh['name']} {pct}% compressed decode: >= 1.3 x raw floor: {v:.3f} "
                        f"{_verdict(v >= 1.3)}; or >= 0.95 x all-resident where that is lower: {res_x:.3f} "
                        f"{_verdict(v >= 1.3 or res_x >= 0.95)}")
            st = by.get(("b1", pct, "epmem_staged"))
            if ep and st:
                v = ep["seconds_per_step"] / st["seconds_per_step"]
                out(f"target {sh['name']} {pct}% staged: >= 0.92 x registered: {v:.3f} {_verdict(v >= 0.92)}")
            pf, pu = by.get(("prefill", pct, "epmem")), by.get(("prefill", pct, "uva"))
            if pf:
                bound = 1.15 * max(pf["floor_s"], pf["resident_seconds_per_step"])
                line = (f"target {sh['name']} {pct}% prefill: ttft {pf['ttft_s']:.3f} s <= 1.15 x max(floor "
                        f"{pf['floor_s']:.3f}, resident {pf['resident_seconds_per_step']:.3f}) = {bound:.3f}: "
                        f"{_verdict(pf['ttft_s'] <= bound)}")
                if pu:
                    line += f"; <= 0.2 x uva ({pu['ttft_s']:.3f} s): {pf['ttft_s'] / pu['ttft_s']:.3f} {_verdict(pf['ttft_s'] <= 0.2 * pu['ttft_s'])}"
                out(line)
            for mode in [m for m in modes if m.startswith("b") and m != "b1"]:
                e, u = by.get((mode, pct, "epmem")), by.get((mode, pct, "uva"))
                if e and e["ratio_to_floor"] is not None:
                    line = f"target {sh['name']} {pct}% {mode}: >= 0.95 x floor: {e['ratio_to_floor']:.3f} {_verdict(e['ratio_to_floor'] >= 0.95)}"
                    if u:
                        x = u["seconds_per_step"] / e["seconds_per_step"]
                        line += f"; ahead of uva: {x:.3f} {_verdict(x > 1.0)}"
                    out(line)
            if ep and "budget_held" in ep:
                out(f"budget {sh['name']} {pct}%: peak resident {ep['peak_resident_bytes'] / 2**20:.0f} MiB <= "
                    f"budget {ep['budget_bytes'] / 2**20:.0f} MiB: {_verdict(ep['budget_held'])}; host stall "
                    f"{ep['host_stall_ms']:.1f} ms")
        out("")
    return "\n".join(lines) + "\n"


def write_plot(res, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plot")
        return
    shapes = res["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.2), squeeze=False)
    for ax, sh in zip(axes[0], shapes):
        rows = [r for r in sh["rows"] if r["mode"] == "b1"]
        pcts = sorted({r["budget_pct"] for r in rows if r["budget_pct"] is not None})
        for method in BUDGET_METHODS:
            ys = [next((r["tok_s"] for r in rows if r["budget_pct"] == p and r["method"] == method), None)
                  for p in pcts]
            if any(y is not None for y in ys):
                ax.plot(pcts, ys, marker="o", label=method)
        dif = next((r for r in rows if r["method"] == "diffusers"), None)
        if dif:
            ax.axhline(dif["tok_s"], linestyle="-.", color="tab:purple", label="diffusers (no budget)")
        if pcts:
            def peak(p):  # a merged result's rows keep their own run's peak
                return next((r["h2d_peak_bytes_per_s"] for r in rows
                             if r["budget_pct"] == p and "h2d_peak_bytes_per_s" in r), res["h2d_peak_bytes_per_s"])
            ax.plot(pcts, [peak(p) / (sh["offloaded_bytes"] * (100 - p) / 100) for p in pcts],
                    linestyle="--", color="gray", label="PCIe floor")
        ax.axhline(sh["resident"]["b1"]["tok_s"], linestyle=":", color="black", label="all resident")
        ax.set_yscale("log")
        ax.set_xlabel("VRAM budget, % of offloaded bytes")
        ax.set_ylabel("tokens/s (batch 1)")
        ax.set_title(f"{sh['name']}: {sh['blocks']}x{sh['hidden']}/{sh['intermediate']}, "
                     f"{sh['kv_heads']} KV heads, {sh['offloaded_bytes'] / GiB:.1f} GiB")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
