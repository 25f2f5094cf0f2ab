#!/usr/bin/env python3
"""End-to-end PyTorch benchmark: a Llama-style decoder whose decoder-layer
weights do not fit the VRAM budget, decoded greedily, side by side in one process:

  resident     every weight on the GPU (the reference tokens and ms/token)
  registered   epmem.torch.offload, sources="registered" (the default)
  staged       epmem.torch.offload, sources="staged" (pageable, staged; prefetches filled by
               epmem's background thread, filling the next weight ahead into every one of
               4 staging slots, prefetch depth 2: the defaults)
  staged_caller  the same with caller_fills=1: prefetches filled on the thread that runs the
               model (the behaviour before the background filler; --no-caller-row skips it)
  staged_plain staged as the defaults were before the H200 probe of 2026-12-01 (prefetch
               depth 1, 3 staging slots, nothing filled ahead; the engine's full-chunk tail,
               not a config field, stays): what the tuning bought (--no-plain-row skips it)
  accelerate   accelerate.dispatch_model, the same bytes resident, the rest cpu-offloaded
  floor        (offloaded bytes - budget) / pinned H2D peak (measured here, torch pinned->cuda copy)

The staged rows copy from pageable memory, so they also get a floor of their own:
(offloaded bytes - budget) / the staged peak, the best of epmem's copy engine copying
1 GiB of pageable memory to the device with nothing else running (default slots and
4 slots), measured here beside torch's own pageable->cuda copy (the CUDA driver's
staging, what a user without epmem gets). staged peak / pinned peak bounds what any
staged row can reach against the registered row on a PCIe-bound decode.

Per epmem row: streamed bytes/token against the ideal (offloaded - budget), the
whole-weight floor (the fewest bytes any schedule copying whole matrices can
copy: (offloaded - budget) + the smallest largest-streamed-matrix the budget
allows, docs/RESIDENCY.md) and the target bound (offloaded - budget) + 2 x largest.
With whole matrices the floor above is out of reach by the whole-weight floor's
margin (6% on "big" at 50%); --split-mib N splits every decoder-layer linear
into equal blocks of about N MiB (rows, or columns where the rows do not divide;
one matmul per block; the resident reference runs the same split model), so the
streamed unit, and that margin, shrink ("big" at 32: every block 32 MiB).

What is offloaded: every nn.Linear weight inside model.model.layers (q/k/v/o,
gate/up/down). What stays resident in every row: the embedding, the norms, the
rotary tables, lm_head (vocab 32000, so it is small next to the layers) and the
KV cache. Budgets are 25/50/75% of the offloaded bytes. Tokens must be
identical to the resident run's in every row (asserted; accelerate is compared on
the tokens it decoded, the first --accelerate-tokens).

    python3 scripts/bench_torch.py [--json PATH] [--plot PATH] [--tokens 32] [--shapes big,small]
    python3 scripts/bench_torch.py --shapes big --budgets 50 --no-accelerate [--split-mib 32]
    python3 scripts/bench_torch.py --quick     # seconds, CPU + host device, tiny model (CI smoke)

Needs torch (CUDA build for the real run), transformers (else a transformers-free
stand-in decoder is used: --quick only), accelerate (its rows are skipped, with a
note, when it is absent), matplotlib for the PNG (skipped when absent).
Markdown table on stdout; exit 1 if any row's tokens differ.
"""

import argparse
import gc
import json
import math
import os
import sys
import time
from functools import reduce

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
    "big": (8, 8192, 28672, 64, 64),     # ~14.5 GiB of bf16 layer weights: PCIe-bound
    "small": (16, 4096, 11008, 32, 32),  # ~6.0 GiB
    "quick": (4, 128, 352, 4, 4),        # --quick
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---- models -------------------------------------------------------------------------

class _StandInBlock(nn.Module):
    """A decoder layer's linears (q, k, v, o, gate, up, down) with no attention:
    deterministic, so tokens can be compared. Used only without transformers."""

    def __init__(self, d, f):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x):
        h = self.norm(x)
        x = x + self.o(self.q(h) * torch.sigmoid(self.k(h)) + self.v(h))
        h = self.norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


class _StandIn(nn.Module):
    def __init__(self, vocab, d, f, n):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, d)
        self.model.layers = nn.ModuleList(_StandInBlock(d, f) for _ in range(n))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        for blk in self.model.layers:
            x = blk(x)
        return self.lm_head(x)


def make_model(shape, device, dtype, vocab, seed):
    n, d, f, heads, kv = SHAPES[shape]
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            try:
                from transformers import LlamaConfig, LlamaForCausalLM
                cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=f, num_hidden_layers=n,
                                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
                                  tie_word_embeddings=False)
                model, kind = LlamaForCausalLM(cfg), "transformers LlamaForCausalLM"
            except ImportError:
                model, kind = _StandIn(vocab, d, f, n), "stand-in decoder (no transformers)"
    finally:
        torch.set_default_dtype(old)
    return model.to(dtype).eval().requires_grad_(False), kind


class SplitLinear(nn.Module):
    """An nn.Linear (no bias) as k equal blocks of at most about `max_bytes`, each
    its own nn.Linear, so epmem.torch (granularity="linear") streams each as its
    own unit. Row blocks (y = cat(x @ W_i^T)) when k divides the rows, else column
    blocks (y = sum(x_i @ W_i^T)) when k divides the columns: equal sizes keep
    the cyclic policy exact (a Llama down_proj, 8192 rows by 7 x 4096 columns,
    has no equal 32 MiB row blocks). k is the smallest count from
    ceil(bytes / max_bytes) up that divides one of them."""

    def __init__(self, lin, max_bytes):
        super().__init__()
        out, inp = lin.weight.shape
        nbytes = lin.weight.numel() * lin.weight.element_size()
        k = max(1, math.ceil(nbytes / max_bytes))
        while out % k and inp % k:
            k += 1
        self.by_rows = out % k == 0
        w = lin.weight.detach()
        step = (out if self.by_rows else inp) // k
        self.parts = nn.ModuleList()
        for i in range(k):
            piece = w[i * step:(i + 1) * step] if self.by_rows else w[:, i * step:(i + 1) * step]
            part = nn.Linear(piece.shape[1], piece.shape[0], bias=False, device="meta")
            part.weight = nn.Parameter(piece.clone(memory_format=torch.contiguous_format), requires_grad=False)
            self.parts.append(part)
        self.step = step

    def forward(self, x):
        if self.by_rows:
            return torch.cat([p(x) for p in self.parts], dim=-1)
        out = None
        for i, p in enumerate(self.parts):
            y = p(x[..., i * self.step:(i + 1) * self.step])
            out = y if out is None else out + y
        return out


def split_linears(model, max_bytes):
    """Replace every decoder-layer nn.Linear larger than `max_bytes` by a SplitLinear."""
    for blk in model.model.layers:
        for name, m in list(blk.named_modules()):
            if isinstance(m, nn.Linear) and m.bias is None and m.weight.numel() * m.weight.element_size() > max_bytes:
                parent = blk.get_submodule(name.rpartition(".")[0]) if "." in name else blk
                setattr(parent, name.rpartition(".")[2], SplitLinear(m, max_bytes))
    model.eval().requires_grad_(False)  # the new modules start in training mode
    gc.collect()


def whole_weight_floor(sizes, budget):
    """The fewest bytes per token any schedule copying each streamed weight whole
    can copy (src/residency/placement.rs whole_weight_floor): for each candidate
    largest streamed size m, every larger weight is kept, the rest filled
    byte-optimally (exact knapsack, a bitset over units of the sizes' gcd) in
    budget - m."""
    total = sum(sizes)
    if total <= budget:
        return 0
    g = reduce(math.gcd, sizes)
    best = total
    for m in sorted(set(sizes)):
        kept = sum(x for x in sizes if x > m)
        room = budget - m - kept
        if room < 0:
            continue
        cap = room // g
        mask = (1 << (cap + 1)) - 1
        reach = 1
        for x in sizes:
            if x <= m:
                reach = (reach | (reach << (x // g))) & mask
        best = min(best, total - kept - (reach.bit_length() - 1) * g)
    return best


def offloaded_linears(model):
    return [(f"model.layers.{i}.{n}", m) for i, blk in enumerate(model.model.layers)
            for n, m in blk.named_modules() if isinstance(m, nn.Linear)]


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def decode(model, prompt, steps, dev):
    """Greedy: prefill `prompt`, then `steps` single-token steps (timed). Returns
    (tokens of the timed steps, seconds of the timed steps)."""
    hf = hasattr(model, "config")
    with torch.no_grad():
        if hf:
            out = model(prompt, use_cache=True)
            cache, logits = out.past_key_values, out.logits
        else:
            ids, logits = prompt, model(prompt)
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        sync(dev)
        toks, t0 = [], time.perf_counter()
        for _ in range(steps):
            if hf:
                out = model(nxt, past_key_values=cache, use_cache=True)
                cache, logits = out.past_key_values, out.logits
            else:
                ids = torch.cat([ids, nxt], 1)[:, -8:]
                logits = model(ids)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            toks.append(int(nxt.item()))
        sync(dev)
        return toks, time.perf_counter() - t0


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


def staged_peaks(dev, nbytes):
    """Pageable host -> device bytes/s: epmem's copy engine (default slots, and 4
    slots) into epmem device memory, and on CUDA torch's own pageable copy (the
    driver stages); best of 3 after a warm-up each."""
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    out = {}

    def best(fn):
        fn()
        b = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            b = max(b, nbytes / (time.perf_counter() - t0))
        return b

    if dev.type == "cuda":
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)

        def torch_copy():
            dst.copy_(src)
            torch.cuda.synchronize(dev)
        out["torch_pageable"] = best(torch_copy)
        del dst
    with epmem.Device("cuda" if dev.type == "cuda" else "host", dev.index or 0) as edev, \
            edev.alloc(nbytes) as dmem, epmem.StagingPool(edev) as pool:
        for name, cfg in (("epmem_default", {}), ("epmem_4_slots", {"slots": 4})):
            with epmem.CopyEngine(pool, **cfg) as eng:
                def eng_copy():
                    eng.htod(dmem, src, nbytes, fence=False)
                    eng.synchronize()
                out[name] = best(eng_copy)
                st = eng.stats()
                if st["bypassed"] or not st["chunks"]:
                    raise RuntimeError(f"{name}: the copies were not staged ({st}): not a pageable peak")
    return out


# ---- rows -------------------------------------------------------------------------------

def run_epmem(model, prompt, steps, dev, budget, sources, granularity, **cfg):
    h = et.offload(model, budget, sources=sources, granularity=granularity, **cfg)
    try:
        decode(model, prompt, 2, dev)  # warm-up: first page-ins, registrations, kernels
        s0 = h.stats()
        toks, secs = decode(model, prompt, steps, dev)
        s1 = h.stats()
    finally:
        h.remove()
    # decode() includes one untimed prefill forward: count only the timed steps'
    # bytes by subtracting a prefill's worth (one pass over the layers).
    per_pass = (s1["htod_bytes"] - s0["htod_bytes"]) / (steps + 1)
    return {
        "tokens": toks, "seconds": secs, "streamed_bytes_per_token": per_pass,
        "host_stall_ms_per_token": (s1["host_stall_ms"] - s0["host_stall_ms"]) / (steps + 1),
        "device_stall_ms_per_token": (s1["device_stall_ms"] - s0["device_stall_ms"]) / (steps + 1),
        "hit_rate": s1["hit_rate"], "granularity": s1["granularity"],
        "bypassed_page_ins": s1["bypassed_page_ins"] - s0["bypassed_page_ins"],
        "staged_page_ins": s1["staged_page_ins"] - s0["staged_page_ins"],
        "host_range_registered": s1["host_range_registered"],
        "background_page_ins": s1["background_page_ins"] - s0["background_page_ins"],
        "background_waits": s1["background_waits"] - s0["background_waits"],
        "background_wait_ms_per_token": (s1["background_wait_ms"] - s0["background_wait_ms"]) / (steps + 1),
        "fill_ms_per_token": (s1["fill_ms"] - s0["fill_ms"]) / (steps + 1),
        "htod_ms_per_token": (s1["htod_ms"] - s0["htod_ms"]) / (steps + 1),
        "fill_ahead_mib_per_token": (s1["fill_ahead_bytes"] - s0["fill_ahead_bytes"]) / (steps + 1) / 2**20,
        "slot_wait_ms_per_token": (s1["slot_wait_ms"] - s0["slot_wait_ms"]) / (steps + 1),
        "background_busy_ms_per_token": (s1["background_busy_ms"] - s0["background_busy_ms"]) / (steps + 1),
        "fill_ahead_used_mib_per_token": (s1["fill_ahead_used_bytes"] - s0["fill_ahead_used_bytes"]) / (steps + 1) / 2**20,
    }


def run_accelerate(model, prompt, steps, dev, budget, host_copy):
    """dispatch_model with the first linears (in forward order) up to `budget`
    bytes on the GPU and the rest cpu-offloaded (accelerate's AlignDevicesHook
    moves them per forward). Restores the model afterwards."""
    from accelerate import dispatch_model
    from accelerate.hooks import remove_hook_from_submodules
    linears = offloaded_linears(model)
    main = dev.index if dev.type == "cuda" else "cpu"  # "cpu": a smoke run of this code only
    device_map, used = {}, 0
    for name, m in linears:
        nb = sum(p.numel() * p.element_size() for p in m.parameters())
        on_gpu = used + nb <= budget
        used += nb if on_gpu else 0
        device_map[name] = main if on_gpu else "cpu"
        if not on_gpu:
            for pn, p in m.named_parameters(recurse=False):
                m._parameters[pn] = nn.Parameter(host_copy[f"{name}.{pn}"], requires_grad=False)
    # Every other module that holds tensors itself (embeddings, norms, rotary
    # buffers, lm_head) stays on the GPU.
    for name, m in model.named_modules():
        if name and name not in device_map and (next(m.parameters(recurse=False), None) is not None
                                                or next(m.buffers(recurse=False), None) is not None):
            device_map[name] = main
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    dispatch_model(model, device_map=device_map, main_device=main)
    try:
        decode(model, prompt, 1, dev)
        toks, secs = decode(model, prompt, steps, dev)
    finally:
        remove_hook_from_submodules(model)
        for name, m in linears:
            for pn, p in list(m.named_parameters(recurse=False)):
                m._parameters[pn] = nn.Parameter(host_copy[f"{name}.{pn}"].to(dev, copy=True), requires_grad=False)
        if hasattr(model, "hf_device_map"):
            del model.hf_device_map
        gc.collect()
    return {"tokens": toks, "seconds": secs, "resident_bytes": used}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="PNG of tok/s vs budget (default: next to --json)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--accelerate-tokens", type=int, default=8)
    ap.add_argument("--budgets", default="25,50,75")
    ap.add_argument("--shapes", default="big,small")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--no-accelerate", action="store_true")
    ap.add_argument("--no-caller-row", action="store_true", help="skip the staged_caller rows")
    ap.add_argument("--no-plain-row", action="store_true",
                    help="skip the staged_plain rows (staged with the defaults before the tuning)")
    ap.add_argument("--quick", action="store_true", help="tiny model, few tokens: a smoke run (CPU/host device ok)")
    # Per-Linear acquires (the default here) let the residency plan stream one
    # weight at a time: with whole-block holds no policy can copy less than
    # (offloaded - budget) x blocks / (blocks - 1) per token (docs/RESIDENCY.md).
    ap.add_argument("--granularity", default="linear", choices=("linear", "block"))
    ap.add_argument("--split-mib", type=float, default=0,
                    help="split each decoder-layer linear into equal blocks of about this many MiB (0: whole matrices)")
    a = ap.parse_args()
    budgets = [int(b) for b in a.budgets.split(",")]
    shapes = a.shapes.split(",")
    if a.quick:
        shapes, a.tokens, a.accelerate_tokens, a.vocab = ["quick"], 6, 3, 512

    with epmem.Device() as edev:
        ekind = edev.kind
    dev = torch.device("cuda", 0) if ekind == "cuda" else torch.device("cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_torch: epmem's device is CUDA but torch has no CUDA")
    if dev.type == "cpu" and not a.quick:
        sys.exit("bench_torch: no CUDA device (EPM_DEVICE=host): only --quick runs on the host device")
    dtype = torch.bfloat16
    have_acc = False
    if not a.no_accelerate and dev.type == "cuda":
        try:
            import accelerate  # noqa: F401
            have_acc = True
        except ImportError:
            log("accelerate is not installed: its rows are skipped")
    peak = h2d_peak(dev, (64 << 20) if a.quick else GiB)
    log(f"pinned H2D peak: {peak / 1e9:.1f} GB/s")
    pageable_n = (8 << 20) if a.quick else GiB
    speaks = staged_peaks(dev, pageable_n)
    stpeak = max(speaks.values()) if speaks else None
    if speaks:
        log("pageable H2D: " + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in speaks.items()))
    result = {"device": ekind, "torch": torch.__version__, "epmem": epmem.version_string(),
              "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "h2d_peak_bytes_per_s": peak,
              "pageable_h2d_bytes_per_s": speaks, "pageable_h2d_copy_bytes": pageable_n,
              "staged_peak_bytes_per_s": stpeak, "tokens": a.tokens, "accelerate_tokens": a.accelerate_tokens,
              "shapes": []}
    mismatches = []
    t_start = time.perf_counter()
    for shape in shapes:
        model, kind = make_model(shape, dev, dtype, a.vocab, a.seed)
        if a.split_mib > 0:
            split_linears(model, int(a.split_mib * 2**20))
            sz = sorted({p.numel() * p.element_size() for _, m in offloaded_linears(model) for p in m.parameters()})
            kind += f", linears split into equal blocks (sizes {', '.join(f'{x / 2**20:g}' for x in sz)} MiB)"
        off = sum(p.numel() * p.element_size() for _, m in offloaded_linears(model) for p in m.parameters())
        n, d, f, heads, kv = SHAPES[shape]
        log(f"== {shape}: {kind}, {n} blocks {d}/{f}, {off / GiB:.2f} GiB offloadable")
        prompt = torch.tensor([[1, 15043, 29892, 590, 1024, 338, 263, 4086]], device=dev) % a.vocab
        decode(model, prompt, 2, dev)
        # Two timed decodes: the first after building a model can run far
        # slower (allocator, kernel selection); the faster is the reference.
        ref, secs = decode(model, prompt, a.tokens, dev)
        ref2, secs2 = decode(model, prompt, a.tokens, dev)
        if ref2 != ref:
            mismatches.append(f"{shape} resident (two decodes differ)")
        resident_runs = [secs / a.tokens * 1e3, secs2 / a.tokens * 1e3]
        secs = min(secs, secs2)
        sh = {"name": shape, "model": kind, "blocks": n, "hidden": d, "intermediate": f, "heads": heads,
              "kv_heads": kv, "vocab": a.vocab, "offloaded_bytes": off, "split_mib": a.split_mib,
              "resident": {"tokens": ref, "ms_per_token": secs / a.tokens * 1e3, "tok_s": a.tokens / secs,
                           "ms_per_token_runs": resident_runs},
              "rows": []}
        log(f"   resident: {a.tokens / secs:.2f} tok/s")
        host_copy = None
        if have_acc:
            host_copy = {f"{name}.{pn}": p.detach().to("cpu") for name, m in offloaded_linears(model)
                         for pn, p in m.named_parameters(recurse=False)}
        for pct in budgets:
            budget = off * pct // 100
            floor_s = (off - budget) / peak
            sizes = [p.numel() * p.element_size() for _, m in offloaded_linears(model) for p in m.parameters()]
            largest = max(sizes)
            bound = off - budget + 2 * largest
            unit_floor = whole_weight_floor(sizes, budget)
            rows = {}
            methods = [("registered", "registered", {}), ("staged", "staged", {})]
            if not a.no_caller_row:
                methods.append(("staged_caller", "staged", {"caller_fills": 1}))
            if not a.no_plain_row:
                methods.append(("staged_plain", "staged", {"fill_ahead_chunks": 0, "staging_slots": 3,
                                                           "prefetch_depth": 1}))
            for method, sources, cfg in methods:
                r = run_epmem(model, prompt, a.tokens, dev, budget, sources, a.granularity, **cfg)
                rows[method] = r
                log(f"   {pct}% {method}: {a.tokens / r['seconds']:.2f} tok/s, "
                    f"{r['streamed_bytes_per_token'] / GiB:.2f} GiB/token")
            if have_acc:
                r = run_accelerate(model, prompt, a.accelerate_tokens, dev, budget, host_copy)
                rows["accelerate"] = r
                log(f"   {pct}% accelerate: {a.accelerate_tokens / r['seconds']:.3f} tok/s")
            acc_tok_s = (a.accelerate_tokens / rows["accelerate"]["seconds"]) if "accelerate" in rows else None
            for method, r in rows.items():
                steps = len(r["tokens"])
                tok_s = steps / r["seconds"]
                same = r["tokens"] == ref[:steps]
                if not same:
                    mismatches.append(f"{shape} {pct}% {method}")
                row = {"budget_pct": pct, "budget_bytes": budget, "method": method, "tok_s": tok_s,
                       "ms_per_token": r["seconds"] / steps * 1e3, "tokens_compared": steps,
                       "tokens_identical": same, "floor_tok_s": 1 / floor_s if floor_s > 0 else None,
                       "ratio_to_floor": tok_s * floor_s if floor_s > 0 else None,
                       "ratio_to_accelerate": tok_s / acc_tok_s if acc_tok_s else None}
                row.update({k: v for k, v in r.items() if k not in ("tokens", "seconds")})
                if method.startswith("staged") and stpeak and off > budget:
                    row["staged_floor_tok_s"] = stpeak / (off - budget)
                    row["ratio_to_staged_floor"] = tok_s * (off - budget) / stpeak
                if "streamed_bytes_per_token" in r:
                    row["bound_bytes_per_token"] = bound
                    row["within_bound"] = r["streamed_bytes_per_token"] <= bound
                    row["ideal_bytes_per_token"] = off - budget
                    row["whole_weight_floor_bytes_per_token"] = unit_floor
                    row["streamed_over_ideal"] = r["streamed_bytes_per_token"] / (off - budget)
                    row["streamed_over_whole_weight_floor"] = r["streamed_bytes_per_token"] / unit_floor
                    row["host_stall_fraction"] = r["host_stall_ms_per_token"] / row["ms_per_token"]
                sh["rows"].append(row)
        result["shapes"].append(sh)
        del model, host_copy
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    result["wall_s"] = time.perf_counter() - t_start
    result["tokens_identical"] = not mismatches
    table = table_md(result)
    print(table)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.splitext(a.json)[0] + ".md", "w") as f:
            f.write(table)
    plot = a.plot or (os.path.splitext(a.json)[0] + ".png" if a.json else None)
    if plot:
        write_plot(result, plot)
    if mismatches:
        print(f"TOKENS DIFFER: {', '.join(mismatches)}")
        return 1
    print("tokens identical in every row")
    return 0


def fmt(x, spec):
    return "—" if x is None else format(x, spec)


def table_md(res):
    lines = []
    out = lines.append
    out(f"\n# bench_torch: {res['gpu']}, torch {res['torch']}, epmem {res['epmem']}, "
          f"pinned H2D peak {res['h2d_peak_bytes_per_s'] / 1e9:.1f} GB/s\n")
    sp = res.get("pageable_h2d_bytes_per_s") or {}
    if sp:
        out(f"pageable H2D, {res['pageable_h2d_copy_bytes'] / 2**20:g} MiB copies, nothing else running: "
            + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in sp.items())
            + f"; staged peak / pinned peak = {res['staged_peak_bytes_per_s'] / res['h2d_peak_bytes_per_s']:.2f} "
            "(what a staged row can reach against the registered one when the decode is PCIe-bound)\n")
    for sh in res["shapes"]:
        r0 = sh["resident"]
        out(f"## {sh['name']}: {sh['model']}, {sh['blocks']} blocks {sh['hidden']}/{sh['intermediate']}, "
              f"{sh['offloaded_bytes'] / GiB:.2f} GiB offloaded (decoder-layer linears); "
              f"resident {r0['tok_s']:.2f} tok/s ({r0['ms_per_token']:.1f} ms/token)\n")
        out("| budget | method | tok/s | ms/token | streamed MiB/token | ideal (offloaded − budget) MiB | "
              "whole-weight floor MiB | bound MiB/token | streamed ÷ ideal | floor tok/s | × floor "
              "| × accelerate | host stall ms/token | tokens |")
        out("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in sh["rows"]:
            streamed = r.get("streamed_bytes_per_token")
            out(f"| {r['budget_pct']}% | {r['method']} | {r['tok_s']:.3f} | {r['ms_per_token']:.1f} | "
                  f"{fmt(streamed and streamed / 2**20, '.1f')} | "
                  f"{fmt(r.get('ideal_bytes_per_token') and r['ideal_bytes_per_token'] / 2**20, '.1f')} | "
                  f"{fmt(r.get('whole_weight_floor_bytes_per_token') and r['whole_weight_floor_bytes_per_token'] / 2**20, '.1f')} | "
                  f"{fmt(r.get('bound_bytes_per_token') and r['bound_bytes_per_token'] / 2**20, '.1f')} | "
                  f"{fmt(r.get('streamed_over_ideal'), '.4f')} | "
                  f"{fmt(r['floor_tok_s'], '.3f')} | "
                  f"{fmt(r['ratio_to_floor'], '.2f')} | {fmt(r['ratio_to_accelerate'], '.1f')} | "
                  f"{fmt(r.get('host_stall_ms_per_token'), '.1f')} | "
                  f"{'identical' if r['tokens_identical'] else 'DIFFER'} ({r['tokens_compared']}) |")
        out("")
        by = {(r["budget_pct"], r["method"]): r for r in sh["rows"]}
        for pct in sorted({r["budget_pct"] for r in sh["rows"]}):
            reg, stg, acc = by.get((pct, "registered")), by.get((pct, "staged")), by.get((pct, "accelerate"))
            if reg and acc:
                v = reg["tok_s"] / acc["tok_s"]
                out(f"target {sh['name']} {pct}%: epmem >= 5x accelerate: {v:.1f}x {'met' if v >= 5 else 'MISSED'}")
            if reg and reg.get("ratio_to_floor") is not None:
                v = reg["ratio_to_floor"]
                out(f"target {sh['name']} {pct}%: registered >= 0.95x floor: {v:.3f}x {'met' if v >= 0.95 else 'MISSED'}; "
                      f"streamed within (offloaded - budget) + 2 x largest: "
                      f"{'met' if reg['within_bound'] else 'MISSED'}; host stall {reg['host_stall_fraction']:.1%} of the run "
                      f"{'met' if reg['host_stall_fraction'] < 0.02 else 'MISSED'}")
                out(f"bytes {sh['name']} {pct}%: streamed {reg['streamed_bytes_per_token'] / 2**20:.1f} MiB/token = "
                      f"{reg['streamed_over_ideal']:.4f} x ideal (offloaded - budget, {reg['ideal_bytes_per_token'] / 2**20:.1f} MiB), "
                      f"{reg['streamed_over_whole_weight_floor']:.4f} x whole-weight floor "
                      f"({reg['whole_weight_floor_bytes_per_token'] / 2**20:.1f} MiB: the best whole units can do; "
                      "0.95x floor needs streamed <= ideal / 0.95 with copies at the full peak, ~1.02x ideal at 97% of it)")
            if reg and stg:
                v = stg["tok_s"] / reg["tok_s"]
                out(f"target {sh['name']} {pct}%: staged >= 0.8x registered: {v:.2f}x "
                      f"{'met' if v >= 0.8 else 'MISSED'}")
            for m in ("staged", "staged_plain"):
                r = by.get((pct, m))
                if r and r.get("ratio_to_staged_floor") is not None:
                    out(f"staged floor {sh['name']} {pct}% {m}: {r['ratio_to_staged_floor']:.2f}x the staged floor "
                        f"({r['staged_floor_tok_s']:.3f} tok/s: offloaded - budget at the staged peak)")
            pln = by.get((pct, "staged_plain"))
            if reg and pln and stg:
                v = pln["tok_s"] / reg["tok_s"]
                out(f"staged_plain {sh['name']} {pct}%: {v:.2f}x registered; staged (the defaults) "
                    f"{stg['tok_s'] / pln['tok_s']:.2f}x staged_plain; staged filled ahead "
                    f"{stg.get('fill_ahead_mib_per_token', 0):.1f} MiB/token, used "
                    f"{stg.get('fill_ahead_used_mib_per_token', 0):.1f}")
            cal = by.get((pct, "staged_caller"))
            if stg and cal:
                out(f"fill {sh['name']} {pct}%: staged (background fill) {stg['tok_s']:.3f} tok/s = "
                      f"{stg['tok_s'] / cal['tok_s']:.2f}x staged_caller (the caller fills) {cal['tok_s']:.3f}; "
                      f"background waits {stg.get('background_wait_ms_per_token', 0):.1f} ms/token, "
                      f"fill {stg.get('fill_ms_per_token', 0):.1f} ms/token")
            for m in ("staged", "staged_plain"):
                r = by.get((pct, m))
                if r and "background_busy_ms_per_token" in r:
                    busy = r["background_busy_ms_per_token"]
                    out(f"filler {sh['name']} {pct}% {m}: busy {busy:.1f} of {r['ms_per_token']:.1f} ms/token "
                        f"(fill {r['fill_ms_per_token']:.1f}, slot waits {r['slot_wait_ms_per_token']:.1f}); "
                        f"idle {r['ms_per_token'] - busy:.1f}")
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
    fig, axes = plt.subplots(1, len(res["shapes"]), figsize=(6 * len(res["shapes"]), 4.2), squeeze=False)
    for ax, sh in zip(axes[0], res["shapes"]):
        pcts = sorted({r["budget_pct"] for r in sh["rows"]})
        for method in ("registered", "staged", "staged_caller", "staged_plain", "accelerate"):
            ys = [next((r["tok_s"] for r in sh["rows"] if r["budget_pct"] == p and r["method"] == method), None)
                  for p in pcts]
            if any(y is not None for y in ys):
                ax.plot(pcts, ys, marker="o", label=f"epmem {method}" if method != "accelerate" else method)
        floors = [next(r["floor_tok_s"] for r in sh["rows"] if r["budget_pct"] == p) for p in pcts]
        ax.plot(pcts, floors, linestyle="--", color="gray", label="floor (PCIe peak)")
        ax.axhline(sh["resident"]["tok_s"], linestyle=":", color="black", label="all resident")
        ax.set_yscale("log")
        ax.set_xlabel("VRAM budget, % of offloaded bytes")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{sh['name']}: {sh['blocks']}x{sh['hidden']}/{sh['intermediate']}, "
                     f"{sh['offloaded_bytes'] / GiB:.1f} GiB offloaded")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
