"""epmem as PyTorch's CUDA allocator, checked on a GPU (the lead runs this on the H200).

    EPMEM_LIB=target/release/libepmem.so python3 tests/gpu/torch_allocator.py all

`all` runs every check below in its own process (the allocator must be
installed before CUDA starts, so each case needs a fresh interpreter) and
exits non-zero if any fails:

- `generate --allocator torch|epmem`: a transformers Llama built from a config
  (fixed seed) generates greedily for prompts of several batch sizes and
  lengths; `all` requires the tokens from epmem's arena to equal those from
  PyTorch's own allocator, and epmem's counters to show it served the tensors.
- `streams`: (1) the single-stream fast path: the default stream frees a block
  at once while a spin it queued still runs; stream 2's first allocation must
  not return before that spin is done. (2) x is freed on stream 1 while a
  reader of x is queued there behind a gate (a stream memory wait on a host
  word: the stream cannot finish before the checks, however fast the GPU, and
  each round asserts it was still held at the end); stream 2 allocates and
  writes a block of the same size at once and must not get x's block; stream 1
  allocates again and must get it at once (the test's layout makes it the only
  free range that fits), writing it after the reader in stream order. The
  reader's result proves the block was not overwritten early. (3) the
  wait_stream pattern for a tensor used on another stream, with the user held.
  Every kernel the held windows launch runs once unheld first: CUDA's lazy
  loading loads a kernel at its first launch, which can wait for the device.
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


# The streams case. Blocks of 64 MiB: the test sets the arena's layout so
# that a stream's freed block is the only free range a same-size request of
# that stream fits (see `reset_layout`).
N = 1 << 24  # floats per block
STRIDE = 4096  # the late reader reads every STRIDE-th float of its block
FOOTPRINT = 136 << 20  # bytes committed before the held rounds: two blocks, the reader's output, slack
SPIN_CYCLES = 200_000_000  # torch.cuda._sleep: ~0.1 s of GPU time at ~2 GHz
WATCHDOG_S = 20.0
HELD_ROUNDS, WAITED_ROUNDS = 20, 10


class CudaDriver:
    """The few driver calls the gate needs, from libcuda through ctypes."""

    def __init__(self):
        import ctypes as C

        self.C = C
        self.lib = C.CDLL("libcuda.so.1")
        for name, args in [
            ("cuCtxGetCurrent", [C.POINTER(C.c_void_p)]),
            ("cuMemHostAlloc", [C.POINTER(C.c_void_p), C.c_size_t, C.c_uint]),
            ("cuMemHostGetDevicePointer_v2", [C.POINTER(C.c_uint64), C.c_void_p, C.c_uint]),
            ("cuStreamWaitValue32_v2", [C.c_void_p, C.c_uint64, C.c_uint32, C.c_uint]),
            ("cuMemFreeHost", [C.c_void_p]),
            ("cuGetErrorString", [C.c_int, C.POINTER(C.c_char_p)]),
        ]:
            f = getattr(self.lib, name)
            f.argtypes, f.restype = args, C.c_int

    def call(self, name, *args):
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            msg = self.C.c_char_p()
            self.lib.cuGetErrorString(rc, self.C.byref(msg))
            raise RuntimeError(f"{name}: CUDA error {rc} ({(msg.value or b'?').decode()})")


class Gate:
    """Holds a stream until opened: a stream memory wait (cuStreamWaitValue32,
    GEQ 1) on a word of mapped pinned memory that `open` sets to 1. Unlike a
    timed spin, the held stream cannot finish before the checks, however fast
    the GPU; unlike a host function, a memory wait leaves cudaStreamQuery
    non-blocking. A watchdog thread opens it after WATCHDOG_S (and says so), so
    a check that blocks on the held stream fails instead of hanging."""

    def __init__(self, drv):
        import threading

        C = drv.C
        self.drv, self.threading = drv, threading
        ctx = C.c_void_p()
        drv.call("cuCtxGetCurrent", C.byref(ctx))
        if not ctx.value:
            raise RuntimeError("no CUDA context is current on this thread after PyTorch started CUDA")
        host = C.c_void_p()
        # CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP
        drv.call("cuMemHostAlloc", C.byref(host), 4, 0x03)
        self.host = host
        self.word = C.c_uint32.from_address(host.value)
        self.word.value = 1
        dptr = C.c_uint64()
        drv.call("cuMemHostGetDevicePointer_v2", C.byref(dptr), host, 0)
        self.dptr = dptr.value
        self.lock = threading.Lock()
        self.timer = None
        self.watchdog_fired = False

    def hold(self, stream):
        """Queue the wait on `stream` (a torch.cuda.Stream). The previous hold
        must be open and passed (the caller synchronized)."""
        with self.lock:
            self.word.value = 0
            self.watchdog_fired = False
        try:
            # flags 0: CU_STREAM_WAIT_VALUE_GEQ
            self.drv.call("cuStreamWaitValue32_v2", self.drv.C.c_void_p(stream.cuda_stream), self.dptr, 1, 0)
        except RuntimeError:
            self.open()
            raise
        self.timer = self.threading.Timer(WATCHDOG_S, self._watchdog)
        self.timer.daemon = True
        self.timer.start()

    def _watchdog(self):
        with self.lock:
            if self.word.value == 0:
                self.watchdog_fired = True
                self.word.value = 1

    def open(self):
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        with self.lock:
            self.word.value = 1

    def free(self):
        """After every hold is open and the device synchronized."""
        self.open()
        self.drv.call("cuMemFreeHost", self.host)


def overlaps(a, b, nbytes):
    return a < b + nbytes and b < a + nbytes


def streams():
    """Cross-stream frees with data checks; every check that needs a stream's
    work still queued holds that stream on a Gate and asserts it is."""
    import epmem.torch_allocator as eta
    eta.use_as_allocator()
    import torch

    failures = []
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    default = torch.cuda.default_stream()
    blk = 4 * N

    # 1. The single-stream fast path and its exit. The default stream makes
    # the first allocation, so its free is immediate (no event) while a spin
    # it queued may still use the block; stream 2's first allocation must wait
    # for that spin before returning.
    first = torch.empty(256, device="cuda")
    torch.cuda._sleep(SPIN_CYCLES)
    del first
    busy = not default.query()
    with torch.cuda.stream(s2):
        second = torch.empty(256, device="cuda")
    idle = default.query()
    st = eta.stats(0)
    if not busy:
        failures.append("fast path: the default stream's spin finished before stream 2 allocated; "
                        "the check proved nothing")
    elif not idle:
        failures.append("fast path: stream 2's first allocation returned while the default stream's work "
                        "(which may use memory freed at once) was still queued")
    if st["single_stream_frees"] < 1 or st["stream_waits"] < 1:
        failures.append(f"fast path: the counters show no immediate free or no wait on leaving it: {st}")
    torch.cuda.synchronize()
    del second

    drv = CudaDriver()
    gate = Gate(drv)

    def held_round(tag, hold):
        """x is freed on s1 while a reader of x is queued behind a gate on s1;
        s2 allocates and writes a block of the same size at once (must not be
        x's); s1 allocates again (gets x's block at once, writes it after the
        reader in stream order)."""
        v = float(tag + 2)
        with torch.cuda.stream(s1):
            x = torch.full((N,), v, device="cuda")
            x_ptr = x.data_ptr()
            if hold:
                gate.hold(s1)
            y = x[::STRIDE] * 2  # queued behind the gate: reads x late
            del x  # freed on s1 while its reader is queued
        with torch.cuda.stream(s2):
            z = torch.empty((N,), device="cuda")  # another stream: not x's block
            z.fill_(-7.0)  # runs at once: s2 is not held
        before = eta.stats(0)
        with torch.cuda.stream(s1):
            w = torch.empty((N,), device="cuda")  # the same stream: may take x's block at once
            w.fill_(-3.0)  # after the reader, in s1's order
        after = eta.stats(0)
        held = not s1.query()
        if hold:
            gate.open()
        torch.cuda.synchronize()
        name = f"held round {tag}"
        if hold and (not held or gate.watchdog_fired):
            failures.append(f"{name}: stream 1 was not held through the checks (query {held}, watchdog "
                            f"{gate.watchdog_fired}): they proved nothing, or a check waited for it")
        if hold and overlaps(z.data_ptr(), x_ptr, blk):
            failures.append(f"{name}: stream 2 got stream 1's block while its reader was queued")
        if hold and not overlaps(w.data_ptr(), x_ptr, blk):
            failures.append(f"{name}: stream 1 did not reuse its freed block at once although it was the only "
                            f"free range that fits (w {w.data_ptr():#x}, x {x_ptr:#x}): {after}")
        if hold and after["same_stream_reuses"] <= before["same_stream_reuses"]:
            failures.append(f"{name}: same_stream_reuses did not count stream 1's reuse: {before} -> {after}")
        # Checked on host copies: a CUDA temporary here would be one more
        # block (on the default stream) in the layout the rounds rely on.
        yc = y.cpu()
        if not torch.all(yc == 2 * v).item():
            failures.append(f"{name}: the reader saw overwritten data: {yc[:4].tolist()}")
        if not torch.all(z.cpu() == -7.0).item() or not torch.all(w.cpu() == -3.0).item():
            failures.append(f"{name}: a block's data was overwritten by another user")

    def waited_round(tag, hold):
        """The documented pattern for a tensor used on another stream (record_stream
        is a no-op under a pluggable allocator): the allocating stream waits for
        the user before the free. The user (s2) is held; s1 frees x, takes its
        block back at once and writes it, ordered after s2's read by the wait."""
        with torch.cuda.stream(s1):
            x = torch.full((N,), 3.0, device="cuda")
            x_ptr = x.data_ptr()
        s2.wait_stream(s1)
        if hold:
            gate.hold(s2)
        with torch.cuda.stream(s2):
            y = x + 1  # queued behind the gate
        s1.wait_stream(s2)
        with torch.cuda.stream(s1):
            del x
            v = torch.empty((N,), device="cuda")
            v.fill_(-1.0)  # s1 waits for s2: after the read
        held = not s2.query() and not s1.query()
        if hold:
            gate.open()
        torch.cuda.synchronize()
        name = f"wait_stream round {tag}"
        if hold and (not held or gate.watchdog_fired):
            failures.append(f"{name}: the streams were not held through the checks (watchdog "
                            f"{gate.watchdog_fired})")
        if hold and not overlaps(v.data_ptr(), x_ptr, blk):
            failures.append(f"{name}: stream 1 did not take x's block back, so the data check proves nothing "
                            f"(v {v.data_ptr():#x}, x {x_ptr:#x})")
        if not torch.all(y.cpu() == 4.0).item():
            failures.append(f"{name}: the reader on stream 2 saw overwritten data")
        if not torch.all(v.cpu() == -1.0).item():
            failures.append(f"{name}: stream 1's block was overwritten")

    def reset_layout(what):
        """Every block free; the arena trimmed, then FOOTPRINT committed and
        free for everyone (freed on s2, which then synchronizes): the held
        rounds fit in committed memory, and a block freed on s1 is the only
        free range outside the arena's top that fits a same-size request."""
        torch.cuda.synchronize()
        live = eta.stats(0)["live_allocations"]
        if live:
            failures.append(f"{what}: {live} allocations still live before the layout reset")
        eta.empty_cache()
        with torch.cuda.stream(s2):
            pre = torch.empty(FOOTPRINT, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        del pre
        torch.cuda.synchronize()

    try:
        # Every kernel the held windows launch runs once first, unheld: with
        # CUDA's lazy loading the first launch of a kernel loads it, which can
        # wait for the whole device, held stream included.
        held_round(-1, False)
        waited_round(-1, False)
        reset_layout("held rounds")
        for i in range(HELD_ROUNDS):
            held_round(i, True)
        reset_layout("wait_stream rounds")
        for i in range(WAITED_ROUNDS):
            waited_round(i, True)
    finally:
        gate.open()
        torch.cuda.synchronize()
        gate.free()
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


def run_child(cmd, *extra, timeout=600):
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        path = f.name
    try:
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), cmd, *extra, "--out", path],
                               capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"")[-3000:], (e.stderr or b"")[-3000:]
            return None, f"{cmd} {' '.join(extra)} did not finish in {timeout} s:\n" + "".join(
                x.decode(errors="replace") if isinstance(x, bytes) else x for x in out)
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
        # A check that blocks on a held stream is opened by the gate's
        # watchdog (WATCHDOG_S per hold); the timeout bounds anything else.
        r, err = run_child(cmd, timeout=240)
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
