#!/usr/bin/env python3
"""A Llama-shaped decoder larger than its budget, in one ONNX Runtime run:
ORT's CUDA EP with every weight resident, against epmem's EP streaming the
weights (next to the CUDA EP) at budgets of 25, 50, 75 and 100% of the
streamed weight bytes, and the PCIe floor.

    # H200, onnxruntime-gpu (ORT_GPU_DIR = the unpacked wheel), torch for CUDA 13:
    PYTHONPATH=$ORT_GPU_DIR EPMEM_LIB=$PWD/.carry/lib/libepmem.so \\
        python3 scripts/bench_ort_stream.py --size both --out bench-out
    # anywhere, CPU onnxruntime wheel (smoke: the tiny model, CPU EP as "resident"):
    EPMEM_LIB=$PWD/target/debug/libepmem.so python3 scripts/bench_ort_stream.py --size tiny --out /tmp/s

The model is built with the `onnx` package from a fixed seed (no download):
token embedding (Gather), per layer RMSNorm, q/k/v projections (grouped-query:
kv heads < heads), a KV cache (inputs past_key_i/past_value_i
[batch, kv_heads, past, head_dim], outputs present_* = past ++ new), attention
for one new token, output projection, residual, RMSNorm, SwiGLU MLP
(gate/up/down), residual; final RMSNorm and an lm_head MatMul. Sizes:
  big    d 4096, 32 heads / 8 kv heads, ffn 14336, 20 layers, vocab 32000,
         float16: 8.4 GiB of projection weights (what epmem streams) + 0.25
         GiB embedding (a Gather: stays with the CUDA EP)
  small  d 1024, 16/4 heads, ffn 3584, 4 layers, vocab 8192, float16: 0.12 GiB streamed
  tiny   d 64, 4/2 heads, ffn 192, 2 layers, vocab 256, float32 (CPU smoke)
Big models are saved with external data next to the .onnx (--model-dir).

Each configuration runs in its own process (device memory starts clean):
  resident  the CUDA EP alone (CPU EP on a CPU-only wheel): the reference
            tokens (greedy, 32 after an 8-token prompt fed one at a time),
            their logits, ms/token
  epmem-P   epmem's EP (budget_bytes = P% of the streamed bytes) listed
            before the CUDA EP, session.use_env_allocators=1 (unless
            --no-env-allocators); it is fed the
            reference tokens (teacher forcing), so its argmax at every step is
            compared with the reference token and its logits with the
            reference logits (largest absolute difference)
A warm-up generation of 4 tokens precedes the measured one in every process.
Device memory: driver free memory (torch.cuda.mem_get_info) before the
session vs the lowest seen during the measured generation. The PCIe floor:
(streamed bytes - budget) / (pinned host->device bandwidth measured in the same
run with torch, 1 GiB copies, best of 5) per token.

Writes DIR/bench_ort_stream.json and DIR/bench_ort_stream.md; closes with
"TARGET ..." lines (tokens identical; memory <= budget + what the resident
run needs besides weights; decode >= 0.9 x the floor; at 100%, >= 0.95 x the
CUDA EP alone) and "bench-ort-stream: N passed, N failed".
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from _floor import whole_weight_floor  # noqa: F401  (tests/ort/test_ort_streaming.py reads it here)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
REG = "epmem"

SIZES = {
    "big": dict(d=4096, heads=32, kv_heads=8, ffn=14336, layers=20, vocab=32000, dtype="float16"),
    "small": dict(d=1024, heads=16, kv_heads=4, ffn=3584, layers=4, vocab=8192, dtype="float16"),
    "tiny": dict(d=64, heads=4, kv_heads=2, ffn=192, layers=2, vocab=256, dtype="float32"),
}
PROMPT, TOKENS, WARM = 8, 32, 4
# Part of the model's file name: a model built by an earlier build() (kept in
# --model-dir) is never reused after build() changes. Bump with build().
MODEL_REV = 2


# ---------------------------------------------------------------- the model


def streamed_bytes(c):
    """Bytes of the MatMul weights epmem claims (everything but the embedding)."""
    eb = 2 if c["dtype"] == "float16" else 4
    hd = c["d"] // c["heads"]
    kvd = c["kv_heads"] * hd
    per_layer = c["d"] * (2 * c["d"] + 2 * kvd) + 3 * c["d"] * c["ffn"]
    return (c["layers"] * per_layer + c["d"] * c["vocab"]) * eb


def claimed_sizes(c, split_bytes=0):
    """Bytes of each unit epmem streams, in execution order: per layer q, k,
    v, o, gate, up, down; then the lm_head. With the EP option split_bytes, a
    weight above it is cut as the EP cuts it (src/ort/streaming.rs `split`:
    whole output columns, a multiple of 64 but the last, at most split_bytes,
    balanced)."""
    eb = 2 if c["dtype"] == "float16" else 4
    d, f, v = c["d"], c["ffn"], c["vocab"]
    kvd = c["kv_heads"] * (d // c["heads"])
    per = [(d, d), (d, kvd), (d, kvd), (d, d), (d, f), (d, f), (f, d)]
    out = []
    for k, n in [kn for _ in range(c["layers"]) for kn in per] + [(d, v)]:
        b = k * n * eb
        if not split_bytes or b <= split_bytes or n < 128:
            out.append(b)
            continue
        most = max(64, split_bytes // (k * eb) // 64 * 64)
        cols = -(-n // -(-n // most))
        cols = min(n, -(-cols // 64) * 64)
        out += [k * min(cols, n - n0) * eb for n0 in range(0, n, cols)]
    return out


def build(c, path, seed=0):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    T = TensorProto.FLOAT16 if c["dtype"] == "float16" else TensorProto.FLOAT
    npt = np.float16 if c["dtype"] == "float16" else np.float32
    d, H, KV, F, L, V = c["d"], c["heads"], c["kv_heads"], c["ffn"], c["layers"], c["vocab"]
    hd = d // H
    rep = H // KV
    inits, nodes = [], []

    def w(name, shape, scale):
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= scale
        inits.append(numpy_helper.from_array(a.astype(npt), name))
        return name

    def const(name, arr):
        inits.append(numpy_helper.from_array(arr, name))
        return name

    def n(op, ins, out, **attrs):
        nodes.append(helper.make_node(op, ins, [out], name=out + "_n", **attrs))
        return out

    const("eps", np.array(1e-5, dtype=np.float32))
    const("att_scale", np.array(1.0 / np.sqrt(hd), dtype=npt))
    const("shape_q", np.array([0, 1, H, hd], dtype=np.int64))
    const("shape_kv", np.array([0, 1, KV, hd], dtype=np.int64))
    const("shape_qg", np.array([0, KV, rep, hd], dtype=np.int64))
    const("shape_ctx", np.array([0, 1, d], dtype=np.int64))

    def rms(x, g, p):
        # In float32, as Llama's RMSNorm computes it: in float16 the sum of
        # squares overflows once the residual stream's RMS passes
        # sqrt(65504 / d) (about 4 at d 4096, reached by layer ~10 of the big
        # model), the norm becomes x / inf = 0 and every logit 0.
        lo = T == TensorProto.FLOAT16
        xf = n("Cast", [x], p + "xf", to=TensorProto.FLOAT) if lo else x
        sq = n("Mul", [xf, xf], p + "sq")
        ms = n("ReduceMean", [sq], p + "ms", axes=[-1], keepdims=1)
        ms = n("Add", [ms, "eps"], p + "mse")
        r = n("Sqrt", [ms], p + "rt")
        y = n("Div", [xf, r], p + "nx")
        if lo:
            y = n("Cast", [y], p + "nx16", to=T)
        return n("Mul", [y, g], p + "out")

    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", 1])]
    outputs = [helper.make_tensor_value_info("logits", T, ["batch", 1, V])]
    h = n("Gather", [w("embed", (V, d), 1.0), "input_ids"], "h0")
    for i in range(L):
        p = f"l{i}_"
        const(p + "g1", np.ones(d, dtype=npt))
        const(p + "g2", np.ones(d, dtype=npt))
        x = rms(h, p + "g1", p + "n1")
        q = n("MatMul", [x, w(p + "wq", (d, d), d ** -0.5)], p + "q")
        k = n("MatMul", [x, w(p + "wk", (d, KV * hd), d ** -0.5)], p + "k")
        v = n("MatMul", [x, w(p + "wv", (d, KV * hd), d ** -0.5)], p + "v")
        q = n("Reshape", [q, "shape_q"], p + "q4")  # [B,1,H,hd]
        q = n("Transpose", [q], p + "qt", perm=[0, 2, 1, 3])  # [B,H,1,hd]
        q = n("Reshape", [q, "shape_qg"], p + "qg")  # [B,KV,rep,hd]
        k = n("Transpose", [n("Reshape", [k, "shape_kv"], p + "k4")], p + "kt", perm=[0, 2, 1, 3])
        v = n("Transpose", [n("Reshape", [v, "shape_kv"], p + "v4")], p + "vt", perm=[0, 2, 1, 3])
        pk, pv = f"past_key_{i}", f"past_value_{i}"
        inputs += [helper.make_tensor_value_info(pk, T, ["batch", KV, "past", hd]),
                   helper.make_tensor_value_info(pv, T, ["batch", KV, "past", hd])]
        k = n("Concat", [pk, k], f"present_key_{i}", axis=2)  # [B,KV,T,hd]
        v = n("Concat", [pv, v], f"present_value_{i}", axis=2)
        outputs += [helper.make_tensor_value_info(f"present_key_{i}", T, ["batch", KV, "total", hd]),
                    helper.make_tensor_value_info(f"present_value_{i}", T, ["batch", KV, "total", hd])]
        kT = n("Transpose", [k], p + "kT", perm=[0, 1, 3, 2])
        s = n("MatMul", [q, kT], p + "s")
        s = n("Mul", [s, "att_scale"], p + "ss")
        a = n("Softmax", [s], p + "a", axis=-1)
        ctx = n("MatMul", [a, v], p + "ctx")  # [B,KV,rep,hd] = [B,H,1,hd] in order
        ctx = n("Reshape", [ctx, "shape_ctx"], p + "ctx3")
        o = n("MatMul", [ctx, w(p + "wo", (d, d), d ** -0.5)], p + "o")
        h = n("Add", [h, o], p + "h1")
        x = rms(h, p + "g2", p + "n2")
        g = n("MatMul", [x, w(p + "wg", (d, F), d ** -0.5)], p + "gate")
        u = n("MatMul", [x, w(p + "wu", (d, F), d ** -0.5)], p + "up")
        act = n("Mul", [n("Mul", [g, n("Sigmoid", [g], p + "sg")], p + "silu"), u], p + "act")
        dn = n("MatMul", [act, w(p + "wd", (F, d), F ** -0.5)], p + "down")
        h = n("Add", [h, dn], p + "h2")
    const("gf", np.ones(d, dtype=npt))
    x = rms(h, "gf", "nf")
    # A larger lm_head scale spreads the logits, so greedy choices are not
    # near-ties that rounding differences between two GEMMs could flip.
    n("MatMul", [x, w("lm_head", (d, V), 4.0 * d ** -0.5)], "logits")
    graph = helper.make_graph(nodes, "llama_like", inputs, outputs, inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    big = streamed_bytes(c) > (1 << 30)
    if big:
        onnx.save(m, path, save_as_external_data=True, all_tensors_to_one_file=True,
                  location=os.path.basename(path) + ".data", size_threshold=1024)
    else:
        onnx.save(m, path)


# ---------------------------------------------------------------- a child


def gpu():
    try:
        import torch  # noqa: F401  (first: it loads the CUDA 13 libraries)

        return torch.cuda.is_available()
    except ImportError:
        return False


def child(a):
    on_gpu = gpu()
    import numpy as np
    import onnxruntime as ort

    c = SIZES[a.size]
    providers = ort.get_available_providers()
    cuda = on_gpu and "CUDAExecutionProvider" in providers
    if a.mode != "resident":
        ort.set_default_logger_severity(1)
        ort.register_execution_provider_library(REG, os.path.abspath(a.lib))
    free0 = free_mem() if cuda else None
    so = ort.SessionOptions()
    if a.mode == "resident":
        so_providers = ["CUDAExecutionProvider"] if cuda else ["CPUExecutionProvider"]
        sess = ort.InferenceSession(a.model, sess_options=so, providers=so_providers)
    else:
        dev = [e for e in ort.get_ep_devices() if e.ep_name == REG][0]
        if not a.no_env_allocators:
            so.add_session_config_entry("session.use_env_allocators", "1")
        opts = {"budget_bytes": str(a.budget), "weight_min_bytes": "1024"}
        if a.register_sources:
            opts["register_sources"] = a.register_sources
        if a.prefetch_depth:
            opts["prefetch_depth"] = a.prefetch_depth
        if a.split_mib:
            opts["split_bytes"] = f"{a.split_mib}MiB"
        if a.stream_weights:
            opts["stream_weights"] = a.stream_weights
        so.add_provider_for_devices([dev], opts)
        if cuda:
            so.add_provider("CUDAExecutionProvider", {})
        sess = ort.InferenceSession(a.model, sess_options=so)
    hd = c["d"] // c["heads"]
    dt = np.float16 if c["dtype"] == "float16" else np.float32
    devname = "cuda" if cuda else "cpu"
    prompt = list(np.random.default_rng(11).integers(0, c["vocab"], PROMPT))
    ref = json.load(open(a.ref)) if a.ref else None

    def generate(n_new, forced=None):
        empty = np.zeros((1, c["kv_heads"], 0, hd), dtype=dt)
        past = {}
        for i in range(c["layers"]):
            for kind in ("key", "value"):
                past[f"past_{kind}_{i}"] = ort.OrtValue.ortvalue_from_numpy(empty, devname, 0)
        toks, chosen, logits, times, low = list(prompt), [], [], [], None
        for step in range(PROMPT + n_new):
            # A fresh binding per step: onnxruntime 1.23 crashed reusing one
            # whose previous outputs are this step's inputs.
            io = sess.io_binding()
            io.bind_cpu_input("input_ids", np.array([[toks[step]]], dtype=np.int64))
            for k, v in past.items():
                io.bind_ortvalue_input(k, v)
            io.bind_output("logits")
            for i in range(c["layers"]):
                for kind in ("key", "value"):
                    io.bind_output(f"present_{kind}_{i}", devname, 0)
            t = time.perf_counter()
            sess.run_with_iobinding(io)
            outs = io.get_outputs()
            lg = outs[0].numpy()[0, -1].astype(np.float32)
            dt_ms = (time.perf_counter() - t) * 1e3
            names = [o.name for o in sess.get_outputs()]
            for name, v in zip(names[1:], outs[1:]):
                past[name.replace("present", "past")] = v
            if step >= PROMPT - 1:
                nxt = int(lg.argmax())
                if step >= PROMPT:
                    times.append(dt_ms)
                if len(chosen) < n_new:
                    chosen.append(nxt)
                    logits.append(lg)
                    toks.append(forced[len(chosen) - 1] if forced else nxt)
            if cuda:
                f = free_mem()
                low = f if low is None else min(low, f)
        return chosen, logits, times, low

    generate(WARM, ref["tokens"][:WARM] if ref else None)
    chosen, logits, times, low = generate(TOKENS, ref["tokens"] if ref else None)
    res = {"mode": a.mode, "budget": a.budget, "tokens": chosen,
           "ms_per_token": float(np.median(times)), "ms_mean": float(np.mean(times)),
           "providers": sess.get_providers()}
    if cuda:
        res["device_bytes_used"] = int(free0 - low)
    if a.mode == "resident":
        np.save(a.logits_out, np.stack(logits))
    else:
        ref_logits = np.load(a.ref_logits)
        res["max_logit_diff"] = float(np.abs(np.stack(logits) - ref_logits).max())
        res["tokens_identical"] = chosen == ref["tokens"]
    del sess
    if a.mode != "resident":
        ort.unregister_execution_provider_library(REG)
    print("RESULT " + json.dumps(res), flush=True)


def free_mem():
    import torch

    return torch.cuda.mem_get_info()[0]


def pcie_bandwidth():
    """Pinned host -> device bytes/s, 1 GiB copies, best of 5 (torch)."""
    import torch

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8).pin_memory()
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    best = 0.0
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src, non_blocking=True)
        e1.record()
        e1.synchronize()
        best = max(best, n / (e0.elapsed_time(e1) / 1e3))
    del src, dst
    torch.cuda.empty_cache()
    return best


# ---------------------------------------------------------------- the parent


def run_child(args, log_path):
    env = dict(os.environ)
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"] + args, env=env,
                       capture_output=True, text=True, timeout=3600)
    with open(log_path, "w") as f:
        f.write(r.stdout + r.stderr)
    m = re.search(r"^RESULT (.*)$", r.stdout, re.M)
    if r.returncode != 0 or not m:
        raise RuntimeError(f"child {args[:4]} failed ({r.returncode}); log {log_path}:\n{(r.stdout + r.stderr)[-3000:]}")
    res = json.loads(m.group(1))
    rel = re.search(r"weight streaming released: (.*)", r.stdout + r.stderr)
    if rel:
        res["stream"] = {k: float(v) for k, v in re.findall(r"(\w+)=([0-9.]+)", rel.group(1))}
    res["claimed"] = len(re.findall(r"claiming (?:MatMul|Gemm)", r.stdout + r.stderr))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="small", choices=["tiny", "small", "big", "both"])
    ap.add_argument("--out", default="bench-ort-stream")
    ap.add_argument("--model-dir", default=None, help="where models are built / reused (default OUT/models)")
    ap.add_argument("--budgets", default="25,50,75,100")
    ap.add_argument("--lib", default=os.environ.get("EPMEM_LIB", ""))
    ap.add_argument("--register-sources", default="", choices=["", "memlock", "always", "never"],
                    help="the EP option register_sources (default: the EP's, memlock)")
    ap.add_argument("--split-mib", default="",
                    help="the EP option split_bytes in MiB (weights above it stream in parts; default: whole weights)")
    ap.add_argument("--prefetch-depth", default="",
                    help="the EP option prefetch_depth (weights paged in ahead of use; default: the EP's, 2)")
    ap.add_argument("--no-env-allocators", action="store_true",
                    help="epmem rows without session.use_env_allocators (the CUDA EP keeps its own arena): "
                         "separates the allocator's cost from the streaming EP's")
    ap.add_argument("--repeat-100", type=int, default=1,
                    help="run the CUDA EP alone and the 100%% rows this many times, alternating, and compare "
                         "medians (the CUDA EP alone moves by several %% between processes)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stream-weights", default="")
    ap.add_argument("--mode", default="resident")
    ap.add_argument("--model")
    ap.add_argument("--budget", type=int, default=0)
    ap.add_argument("--ref")
    ap.add_argument("--ref-logits")
    ap.add_argument("--logits-out")
    a = ap.parse_args()
    if a.child:
        return child(a)
    if not a.lib:
        sys.exit("set EPMEM_LIB (or --lib) to libepmem.so")
    os.makedirs(a.out, exist_ok=True)
    mdir = a.model_dir or os.path.join(a.out, "models")
    os.makedirs(mdir, exist_ok=True)
    sizes = ["small", "big"] if a.size == "both" else [a.size]
    on_gpu = gpu()
    bw = pcie_bandwidth() if on_gpu else None
    report = {"pcie_bytes_per_s": bw, "sizes": {}}
    passed = failed = 0
    lines = []
    for size in sizes:
        c = SIZES[size]
        model = os.path.join(mdir, f"llama_{size}_r{MODEL_REV}.onnx")
        if not os.path.exists(model):
            t = time.time()
            build(c, model)
            print(f"built {model} in {time.time() - t:.0f} s", flush=True)
        W = streamed_bytes(c)
        tmp = tempfile.mkdtemp(prefix="bos-")
        ref_json, ref_logits = os.path.join(tmp, "ref.json"), os.path.join(tmp, "ref_logits.npy")
        base = ["--size", size, "--model", model, "--lib", a.lib, "--register-sources", a.register_sources]
        if a.no_env_allocators:
            base.append("--no-env-allocators")
        if a.prefetch_depth:
            base += ["--prefetch-depth", a.prefetch_depth]
        if a.split_mib:
            base += ["--split-mib", a.split_mib]
        res = run_child(base + ["--mode", "resident", "--logits-out", ref_logits],
                        os.path.join(a.out, f"{size}_resident.log"))
        json.dump(res, open(ref_json, "w"))
        rows = [res]
        pcts = [int(p) for p in a.budgets.split(",") if p]
        # At 100% the default (stream_weights=auto: every weight fits, so
        # nothing is claimed) and streaming forced (stream_weights=1), each
        # against the CUDA EP alone, in alternating processes.
        runs = []
        for pct in pcts:
            if pct < 100:
                runs.append((pct, "", ""))
            else:
                runs += [(pct, "", ""), (pct, "1", "-forced")]
        alone_ms = [res["ms_per_token"]]
        reps = {}
        for rep_i in range(max(1, a.repeat_100)):
            for pct, sw, tag in runs:
                if rep_i > 0 and pct < 100:
                    continue
                if rep_i > 0 and tag == "":
                    again = run_child(base + ["--mode", "resident", "--logits-out", ref_logits + ".again.npy"],
                                      os.path.join(a.out, f"{size}_resident_{rep_i}.log"))
                    alone_ms.append(again["ms_per_token"])
                budget = W * pct // 100 + (4 << 20 if pct >= 100 else 0)
                extra = ["--stream-weights", sw] if sw else []
                r = run_child(base + extra + ["--mode", f"epmem-{pct}{tag}", "--budget", str(budget), "--ref", ref_json,
                                              "--ref-logits", ref_logits],
                              os.path.join(a.out, f"{size}_epmem{pct}{tag}{f'_{rep_i}' if rep_i else ''}.log"))
                reps.setdefault((pct, tag), []).append(r)
        if len(alone_ms) > 1:
            res["ms_runs"] = alone_ms
            res["ms_per_token"] = float(sorted(alone_ms)[len(alone_ms) // 2])
        for (pct, tag), rs in reps.items():
            r = rs[0]
            if len(rs) > 1:
                ms = [x["ms_per_token"] for x in rs]
                r["ms_runs"] = ms
                r["ms_per_token"] = float(sorted(ms)[len(ms) // 2])
                r["tokens_identical"] = all(x.get("tokens_identical", False) for x in rs)
                r["max_logit_diff"] = max(x["max_logit_diff"] for x in rs)
            r["pct"] = pct
            r["forced"] = bool(tag)
            budget = r["budget"]
            split = int(a.split_mib) << 20 if a.split_mib else 0
            r["whole_weight_floor_bytes"] = whole_weight_floor(claimed_sizes(c, split), budget)
            st = r.get("stream", {})
            runs = st.get("computes", 0) / max(1, st.get("nodes_per_run", 0))
            if runs > 1 and "first_run_htod_bytes" in st:
                # Runs after the first: the first also fills the resident set.
                r["htod_bytes_per_later_run"] = (st["htod_bytes"] - st["first_run_htod_bytes"]) / (runs - 1)
            if bw:
                r["floor_ms"] = max(0, W - budget) / bw * 1e3
            rows.append(r)
        report["sizes"][size] = {"config": c, "streamed_bytes": W, "rows": rows}

        # Judge.
        def target(ok, what):
            nonlocal passed, failed
            passed += ok
            failed += not ok
            line = f"TARGET {size} {what}: {'met' if ok else 'NOT met'}"
            print(line, flush=True)
            lines.append(line)

        res_ms = res["ms_per_token"]
        other = None
        if "device_bytes_used" in res:
            other = res["device_bytes_used"] - W
        for r in rows[1:]:
            name = r["mode"]
            # The default at 100% claims nothing when every weight fits.
            claims_ok = r["claimed"] > 0 or (r["pct"] >= 100 and not r["forced"])
            target(r.get("tokens_identical", False) and claims_ok,
                   f"{name}: {TOKENS} greedy tokens identical (max logit diff {r['max_logit_diff']:.3g}, {r['claimed']} nodes claimed)")
            if other is not None and "device_bytes_used" in r:
                b = r["budget"]
                target(r["device_bytes_used"] <= b + other,
                       f"{name}: device memory {r['device_bytes_used'] / 2**30:.2f} GiB <= budget {b / 2**30:.2f} + {other / 2**30:.2f} GiB")
            if r["pct"] < 100 and r.get("floor_ms"):
                target(r["floor_ms"] / r["ms_per_token"] >= 0.9,
                       f"{name}: {r['ms_per_token']:.1f} ms/token vs floor {r['floor_ms']:.1f} ({r['floor_ms'] / r['ms_per_token']:.2f} x)")
            if r["pct"] >= 100 and on_gpu:
                runs_note = f" (medians of {len(r['ms_runs'])} alternating runs)" if "ms_runs" in r else ""
                line = (f"{name}: {r['ms_per_token']:.2f} ms/token vs the CUDA EP alone {res_ms:.2f} "
                        f"({res_ms / r['ms_per_token']:.2f} x){runs_note}")
                if r["forced"]:
                    # Streaming forced where nothing needs streaming: the
                    # EP's per-node cost, reported, not the product's default.
                    print("INFO " + line, flush=True)
                    lines.append("INFO " + line)
                else:
                    target(res_ms / r["ms_per_token"] >= 0.95, line)
    json.dump(report, open(os.path.join(a.out, "bench_ort_stream.json"), "w"), indent=1)
    with open(os.path.join(a.out, "bench_ort_stream.md"), "w") as f:
        f.write(markdown(report, lines))
    print(f"wrote {a.out}/bench_ort_stream.json and .md", flush=True)
    print(f"bench-ort-stream: {passed} passed, {failed} failed", flush=True)
    sys.exit(1 if failed else 0)


def markdown(report, lines):
    bw = report["pcie_bytes_per_s"]
    out = [f"PCIe host->device (pinned): {bw / 1e9:.1f} GB/s\n" if bw else "No GPU: CPU EP as the resident reference, no PCIe floor.\n"]
    for size, s in report["sizes"].items():
        c = s["config"]
        out.append(f"\n### {size}: d {c['d']}, {c['heads']}/{c['kv_heads']} heads, ffn {c['ffn']}, {c['layers']} layers, "
                   f"vocab {c['vocab']}, {c['dtype']}; streamed weights {s['streamed_bytes'] / 2**30:.2f} GiB\n\n")
        out.append("| run | budget GiB | ms/token (median) | tok/s | floor ms | floor/ms | tokens identical | max logit diff | device GiB used | page-ins | GiB copied | GiB per run after the first | whole-weight floor GiB | EP host us/node | of it acquire+release us | GEMM call us |\n")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
        for r in s["rows"]:
            st = r.get("stream", {})
            out.append("| {} | {} | {:.2f} | {:.1f} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n".format(
                r["mode"], f"{r['budget'] / 2**30:.2f}" if r["budget"] else "all",
                r["ms_per_token"], 1e3 / r["ms_per_token"],
                f"{r['floor_ms']:.1f}" if r.get("floor_ms") is not None else "-",
                f"{r['floor_ms'] / r['ms_per_token']:.2f}" if r.get("floor_ms") else "-",
                r.get("tokens_identical", "ref"), f"{r['max_logit_diff']:.3g}" if "max_logit_diff" in r else "-",
                f"{r['device_bytes_used'] / 2**30:.2f}" if "device_bytes_used" in r else "-",
                int(st["page_ins"]) if "page_ins" in st else "-",
                f"{st['htod_bytes'] / 2**30:.2f}" if "htod_bytes" in st else "-",
                f"{r['htod_bytes_per_later_run'] / 2**30:.3f}" if "htod_bytes_per_later_run" in r else "-",
                f"{r['whole_weight_floor_bytes'] / 2**30:.3f}" if "whole_weight_floor_bytes" in r else "-",
                f"{st['host_us_per_compute']:.1f}" if "host_us_per_compute" in st else "-",
                f"{st['residency_us_per_compute']:.2f}" if "residency_us_per_compute" in st else "-",
                f"{st['gemm_call_us_per_compute']:.2f}" if "gemm_call_us_per_compute" in st else "-"))
    out.append("\n" + "\n".join(lines) + "\n")
    return "".join(out)


if __name__ == "__main__":
    main()
