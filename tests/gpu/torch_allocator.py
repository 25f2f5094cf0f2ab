"""epmem as PyTorch's CUDA allocator, checked on a GPU (the lead runs this on the H200).

    EPMEM_LIB=target/release/libepmem.so python3 tests/gpu/torch_allocator.py all

`all` runs every check below in its own process (the allocator must be
installed before CUDA starts, so each case needs a fresh interpreter) and
exits non-zero if any fails:

- `generate --allocator torch|epmem`: a transformers Llama built from a config
  (fixed seed) generates greedily for prompts of several batch sizes and
  lengths; `all` requires the tokens from epmem's arena to equal those from
  PyTorch's own allocator, and epmem's counters to show it served the tensors.
- `streams`: tensors freed on one stream while a kernel queued there still
  reads them; another stream allocates and writes at once. The kernel's result
  proves the block was not handed over early; the same stream reuses at once.
- `too-late`: use_as_allocator() after CUDA started raises AllocatorTooLate.

Tests/python/test_torch_allocator.py runs `all` where CUDA is available.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if os.environ.get("EPMEM_USE_INSTALLED") != "1":
    sys.path.insert(0, os.path.join(ROOT, "python"))

# (batch, prompt length) of each generate call.
SHAPES = [(1, 5), (3, 17), (8, 33), (2, 64), (5, 9)]
NEW_TOKENS = 24


def build_model(torch):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).to("cuda").eval()


def generate(allocator):
    if allocator == "epmem":
        import epmem.torch_allocator as eta
        eta.use_as_allocator()
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = build_model(torch)
    g = torch.Generator().manual_seed(1)
    out = []
    with torch.no_grad():
        for b, t in SHAPES:
            ids = torch.randint(3, 1000, (b, t), generator=g).to("cuda")
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            out.append(gen[:, t:].tolist())
    torch.cuda.synchronize()
    result = {"tokens": out}
    if allocator == "epmem":
        import epmem.torch_allocator as eta
        s = eta.stats(0)
        del model, ids, gen
        import gc
        gc.collect()
        torch.cuda.synchronize()
        result["stats"] = s
        result["trimmed_bytes"] = eta.empty_cache()
        result["after_trim"] = eta.stats(0)
    return result


def streams():
    import epmem.torch_allocator as eta
    eta.use_as_allocator()
    import torch

    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    failures = []
    # While one stream makes every allocation, frees are immediate (the
    # single-stream fast path); a second stream's first allocation waits for
    # the first stream once. Leave that path before the rounds below, which
    # check the stream order proper.
    first = torch.empty(256, device="cuda")
    with torch.cuda.stream(s2):
        second = torch.empty(256, device="cuda")
    torch.cuda.synchronize()
    del first, second
    n = 1 << 20  # floats: 4 MiB blocks
    cycles = 200_000_000  # ~0.1 s of GPU time: far longer than the host's checks
    for i in range(20):
        with torch.cuda.stream(s1):
            x = torch.full((n,), float(i + 1), device="cuda")  # allocated on s1
            torch.cuda._sleep(cycles)
            y = x * 2  # queued behind the sleep: reads x late
            x_ptr = x.data_ptr()
            del x  # freed on s1 while the kernel reading it is still queued
        busy = not s1.query()
        with torch.cuda.stream(s2):
            z = torch.empty((n,), device="cuda")  # another stream: must not get x's block
            z.fill_(-7.0)
            z_ptr = z.data_ptr()
        if not busy:
            failures.append(f"round {i}: s1 finished before the checks; they proved nothing")
        if not (z_ptr + 4 * n <= x_ptr or z_ptr >= x_ptr + 4 * n):
            failures.append(f"round {i}: stream 2 got stream 1's block while its kernel was queued")
        with torch.cuda.stream(s1):
            w = torch.empty((n,), device="cuda")  # the same stream reuses at once
            same = w.data_ptr() == x_ptr
            del w
        torch.cuda.synchronize()
        if not torch.all(y == 2.0 * (i + 1)).item():
            failures.append(f"round {i}: the kernel read overwritten data: {y[:4].tolist()}")
        if not torch.all(z == -7.0).item():
            failures.append(f"round {i}: stream 2's data was overwritten")
        if i == 0 and not same:
            failures.append("the same stream did not reuse its freed block at once")
        del y, z
    # Cross-stream use the documented way (record_stream is a no-op under a
    # pluggable allocator): the allocating stream waits for the user before the free.
    for i in range(10):
        with torch.cuda.stream(s1):
            x = torch.full((n,), 3.0, device="cuda")
        s2.wait_stream(s1)
        with torch.cuda.stream(s2):
            torch.cuda._sleep(cycles // 4)
            y = x + 1
        s1.wait_stream(s2)
        with torch.cuda.stream(s1):
            del x
            v = torch.empty((n,), device="cuda")
            v.fill_(-1.0)
        torch.cuda.synchronize()
        if not torch.all(y == 4.0).item():
            failures.append(f"wait_stream round {i}: the reader on stream 2 saw overwritten data")
        del y, v
    st = eta.stats(0)
    if st["stream_frees"] == 0 or st["same_stream_reuses"] == 0:
        failures.append(f"the counters show no stream-ordered frees or reuses: {st}")
    return {"failures": failures, "stats": st}


def too_late():
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")
    import epmem.torch_allocator as eta
    try:
        eta.use_as_allocator()
    except eta.AllocatorTooLate as e:
        return {"failures": [], "message": str(e)}
    return {"failures": ["use_as_allocator() after CUDA started did not raise AllocatorTooLate"]}


def child(args):
    if args.cmd == "generate":
        r = generate(args.allocator)
    elif args.cmd == "streams":
        r = streams()
    else:
        r = too_late()
    with open(args.out, "w") as f:
        json.dump(r, f)


def run_child(cmd, *extra):
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        path = f.name
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), cmd, *extra, "--out", path],
                           capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            return None, f"{cmd} {' '.join(extra)} exited {p.returncode}:\n{p.stdout[-3000:]}{p.stderr[-3000:]}"
        with open(path) as f:
            return json.load(f), None
    finally:
        os.unlink(path)


def run_all():
    failures = []
    ref, err = run_child("generate", "--allocator", "torch")
    if err:
        failures.append(err)
    got, err = run_child("generate", "--allocator", "epmem")
    if err:
        failures.append(err)
    if ref and got:
        for (b, t), a, e in zip(SHAPES, ref["tokens"], got["tokens"]):
            if a != e:
                failures.append(f"generate batch {b} prompt {t}: tokens differ from PyTorch's allocator")
        s = got["stats"]
        if s["single_stream_frees"] == 0:
            failures.append(f"generation on one stream did not take the single-stream fast path: {s}")
        if s["alloc_calls"] < 100 or s["peak_live_bytes"] == 0 or s["driver_alloc_calls"] == 0:
            failures.append(f"epmem's counters show it did not serve the model: {s}")
        if got["trimmed_bytes"] == 0 or got["after_trim"]["committed_bytes"] >= s["committed_bytes"]:
            failures.append(f"empty_cache gave nothing back: {got['trimmed_bytes']} bytes, {got['after_trim']}")
        print(f"generate: {len(SHAPES)} shapes x {NEW_TOKENS} tokens identical; epmem peak live "
              f"{s['peak_live_bytes'] >> 20} MiB, peak committed {s['peak_committed_bytes'] >> 20} MiB, "
              f"{s['driver_alloc_calls']} driver allocations, {s['alloc_calls']} allocations, "
              f"{(s['alloc_ns'] + s['free_ns']) / max(1, s['alloc_calls']):.0f} ns per alloc+free")
    for cmd in ("streams", "too-late"):
        r, err = run_child(cmd)
        if err:
            failures.append(err)
        else:
            failures += [f"{cmd}: {m}" for m in r["failures"]]
            print(f"{cmd}: {'ok' if not r['failures'] else 'FAILED'}"
                  + (f" ({r['message']})" if "message" in r else ""))
    for f in failures:
        print("FAIL:", f)
    print(f"torch_allocator: {'PASS' if not failures else 'FAIL'} ({len(failures)} failures)")
    return 1 if failures else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=["all", "generate", "streams", "too-late"])
    ap.add_argument("--allocator", choices=["torch", "epmem"], default="epmem")
    ap.add_argument("--out", help="where a single case writes its JSON result")
    args = ap.parse_args()
    if args.cmd == "all":
        sys.exit(run_all())
    if not args.out:
        ap.error(f"{args.cmd} needs --out")
    child(args)


if __name__ == "__main__":
    main()
