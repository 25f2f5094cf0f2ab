"""epmem's EP streaming weights in an ONNX Runtime session (claim -> own ->
stream -> compute), driven from Python with the CPU onnxruntime wheel.

    EPMEM_LIB=/abs/path/libepmem.so python3 tests/ort/test_ort_streaming.py

Each scenario runs in a child process (ORT's log goes to its stderr, which is
where the EP's claim lines and its release statistics are read from); the
models are built by tests/ort/make_decoder.py from fixed seeds. Prints
"ort-stream: N passed, N failed, N skipped".

With EPMEM_FAKE_CUDA=1 (scripts/ort-test.sh's pass on the fake libcuda) the
device is a "GPU" with no cuBLAS: session creation must fail cleanly, naming
cuBLAS. With EPM_DEVICE=cuda on a real GPU the same scenarios check cuBLAS's
results, in sessions that list ORT's CUDA EP after epmem's (the set-up
docs/ORT.md gives for a GPU).
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import unittest

from _child import release_stats, run_child as _run_child

HERE = os.path.dirname(os.path.abspath(__file__))
LIB = os.environ.get("EPMEM_LIB", "")
FAKE_CUDA = os.environ.get("EPMEM_FAKE_CUDA") == "1"
REG = "epmem"

# The decoder of make_decoder.decoder(): 13 claimed weights (per layer Wq,
# Wk, Wv, Wo 64 KiB, W1, W2 256 KiB; Wlm 512 KiB) = 2 MiB, under a budget of
# half of that; three runs.
MIN = 32 << 10
# The benchmark decoder's proportions, small enough for a CPU run (142 MB of
# float32 weights, 15 claimed), and how many runs the "llama" scenario does.
LLAMA = dict(d=1024, heads=32, kv_heads=8, ffn=3584, layers=2, vocab=8000, dtype="float32")
LLAMA_RUNS = 3
BUDGET = 1 << 20
WEIGHTS, WEIGHT_BYTES, RUNS = 13, 2 << 20, 3


def child(mode, opts):
    """Runs in the child: one scenario, result as JSON on a "RESULT " line."""
    on_gpu = os.environ.get("EPM_DEVICE", "").lower() == "cuda" and not FAKE_CUDA
    if on_gpu:
        try:  # on a GPU machine torch brings the CUDA 13 libraries (cuBLAS) into the process
            import torch  # noqa: F401
        except ImportError:
            pass
    import numpy as np
    import onnx
    import onnxruntime as ort

    sys.path.insert(0, HERE)
    import make_decoder

    ort.set_default_logger_severity(1)
    ort.register_execution_provider_library(REG, LIB)
    dev = [d for d in ort.get_ep_devices() if d.ep_name == REG][0]
    tmp = tempfile.mkdtemp()
    out = {}

    def session(path, options):
        so = ort.SessionOptions()
        so.add_provider_for_devices([dev], options)
        if on_gpu:
            # On a GPU the EP computes only the nodes it claims, on device
            # tensors: ORT's CUDA EP runs the rest and keeps activations on the
            # GPU (docs/ORT.md). Without TF32, so its own float32 MatMuls stay
            # within the float32 tolerances below. A wheel without the CUDA EP
            # fails here, naming it.
            so.add_provider("CUDAExecutionProvider", {"use_tf32": "0"})
        return ort.InferenceSession(path, sess_options=so)

    try:
        if mode in ("decoder", "budget"):
            path = os.path.join(tmp, "decoder.onnx")
            onnx.save(make_decoder.decoder(), path)
            x = np.random.default_rng(3).standard_normal((2, 3, 128)).astype(np.float32)
            ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"X": x})
            if on_gpu:
                # What the session computes when epmem claims nothing: the
                # CUDA EP alone, with the same options.
                alone = ort.InferenceSession(
                    path, providers=[("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"])
                ref_alone = alone.run(None, {"X": x})
                del alone
            else:
                ref_alone = ref
            try:
                s = session(path, opts)
            except Exception as e:  # the error is the result
                out["error"] = str(e)
            else:
                ys = [s.run(None, {"X": x}) for _ in range(RUNS)]
                out["max_abs_diff"] = max(float(np.abs(a - b).max()) for y in ys for a, b in zip(y, ref))
                out["max_abs_diff_vs_alone"] = max(float(np.abs(a - b).max()) for y in ys for a, b in zip(y, ref_alone))
                out["ref_max"] = max(float(np.abs(r).max()) for r in ref)
                out["runs_identical"] = all(np.array_equal(a, b) for y in ys for a, b in zip(y, ys[0]))
                del s
        elif mode == "types":
            out["types"] = {}
            for dtype in ("float16", "bfloat16"):
                m, w = make_decoder.single_matmul(dtype)
                path = os.path.join(tmp, dtype + ".onnx")
                onnx.save(m, path)
                rng = np.random.default_rng(5)
                x = rng.standard_normal((2, 3, 256)).astype(np.float32)
                x2 = rng.standard_normal((4, 256)).astype(np.float32)
                s = session(path, opts)
                y1, y2 = s.run(None, {"X": x, "X2": x2})
                del s
                # Reference: the same rounded inputs, exact products (float64).
                r = lambda a: from_type(to_type(a, dtype), dtype).astype(np.float64)
                e1 = r(x) @ r(w["W"])
                e2 = 0.5 * r(x2) @ r(w["Wt"]).T + 2.0 * r(w["b"])
                out["types"][dtype] = [rel_err(y1, e1), rel_err(y2, e2)]
        elif mode == "llama":
            # scripts/bench_ort_stream.py's decoder with its big size's
            # proportions (kv = d/4, ffn = 3.5 d, vocab = 7.8125 d), float32
            # for the CPU EP, every weight >= 1 MiB (none coalesced).
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "scripts"))
            import bench_ort_stream as bos

            c = dict(LLAMA)
            path = os.path.join(tmp, "llama.onnx")
            bos.build(c, path)
            total = bos.streamed_bytes(c)
            budget = total * int(opts.pop("pct")) // 100
            split = int(opts.get("split_bytes", 0))
            opts.update({"budget_bytes": str(budget), "weight_min_bytes": "1MiB"})
            hd = c["d"] // c["heads"]
            feeds = {"input_ids": np.array([[7]], dtype=np.int64)}
            for i in range(c["layers"]):
                for kind in ("key", "value"):
                    feeds[f"past_{kind}_{i}"] = np.zeros((1, c["kv_heads"], 0, hd), dtype=np.float32)
            s = session(path, opts)
            for _ in range(LLAMA_RUNS):
                s.run(["logits"], feeds)
            del s
            out["sizes"] = bos.claimed_sizes(c, split)
            out["budget"] = budget
            out["floor"] = bos.whole_weight_floor(out["sizes"], budget)
        elif mode == "input_weight":
            path = os.path.join(tmp, "input_weight.onnx")
            onnx.save(make_decoder.graph_input_weight(), path)
            rng = np.random.default_rng(9)
            x = rng.standard_normal((4, 256)).astype(np.float32)
            w = rng.standard_normal((256, 512)).astype(np.float32)
            s = session(path, opts)
            y = s.run(None, {"X": x, "W": w})[0]
            out["max_abs_diff"] = float(np.abs(y - x @ w).max())
            del s
    finally:
        ort.unregister_execution_provider_library(REG)
    print("RESULT " + json.dumps(out), flush=True)


def to_type(a, dtype):
    """float32 -> the type's bits, rounded to nearest even (as ORT's Cast)."""
    import numpy as np

    if dtype == "float16":
        return a.astype(np.float16)
    u = a.astype(np.float32).view(np.uint32)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return bits


def from_type(a, dtype):
    import numpy as np

    if dtype == "float16":
        return a.astype(np.float32)
    return (a.astype(np.uint32) << 16).view(np.float32)


def rel_err(y, e):
    import numpy as np

    return float(np.abs(y - e).max() / np.abs(e).max())


def run_child(mode, opts):
    return _run_child(__file__, [mode, json.dumps(opts)])


def opts(**kw):
    o = {"weight_min_bytes": str(MIN), "budget_bytes": str(BUDGET)}
    o.update({k: str(v) for k, v in kw.items()})
    return o


def gpu_without_cuda_ep():
    """On a real GPU, whether this onnxruntime lacks the CUDA EP (the CPU
    wheel): the claimed nodes would get activations in CPU memory, which the
    EP refuses on a GPU, so the scenarios need onnxruntime-gpu."""
    if os.environ.get("EPM_DEVICE", "").lower() != "cuda" or FAKE_CUDA:
        return False
    try:
        import torch  # noqa: F401  (first, as in the child)
    except ImportError:
        pass
    import onnxruntime as ort

    return "CUDAExecutionProvider" not in ort.get_available_providers()


class Streaming(unittest.TestCase):
    def setUp(self):
        if FAKE_CUDA:
            self.skipTest("the fake libcuda has no cuBLAS: FakeCuda covers it")
        if gpu_without_cuda_ep():
            self.skipTest("on a GPU the EP runs next to ORT's CUDA EP, which this onnxruntime lacks "
                          "(run with onnxruntime-gpu first on PYTHONPATH)")

    def test_decoder_streams_its_weights_under_a_budget_and_matches_the_cpu_ep(self):
        res, log = run_child("decoder", opts())
        self.assertNotIn("error", res, log[-3000:])
        # float32 accumulation on both sides, in different orders: with K <= 512
        # and values of order 1, sums agree to ~K * 2^-24 relative; 1e-5 of the
        # output's magnitude leaves a wide margin and still catches any wrong
        # element, weight or layout (those are off by O(1)).
        self.assertLessEqual(res["max_abs_diff"], 1e-5 * max(1.0, res["ref_max"]), res)
        self.assertTrue(res["runs_identical"], res)
        claimed = re.findall(r"claiming (MatMul|Gemm) '([^']+)'", log)
        self.assertEqual(len(claimed), WEIGHTS, claimed)
        self.assertIn(("Gemm", "l0_k2_node"), claimed)  # transB with a bias
        self.assertIn(("MatMul", "l1_q_node"), claimed)  # batched A
        # Left to the CPU EP, each with its reason; the float64 one as a warning.
        self.assertRegex(log, r"\[W:[^\n]*leaving MatMul 'l0_m64_node'[^\n]*float64")
        self.assertRegex(log, r"\[I:[^\n]*leaving MatMul 'small_node'[^\n]*below weight_min_bytes")
        self.assertRegex(log, r"\[I:[^\n]*leaving MatMul 'l0_scores_node'[^\n]*not a constant")
        s = release_stats(log)
        self.assertEqual(s["weights"], WEIGHTS, s)
        self.assertEqual(s["weight_bytes"], WEIGHT_BYTES, s)
        self.assertEqual(s["budget_bytes"], BUDGET, s)
        self.assertLessEqual(s["peak_resident_bytes"], BUDGET, s)
        self.assertEqual(s["computes"], WEIGHTS * RUNS, s)
        self.assertEqual(s["acquires"], WEIGHTS * RUNS, s)
        # Half the weights fit: they must stream (more page-ins than weights).
        self.assertGreater(s["page_ins"], WEIGHTS, s)
        self.assertGreater(s["htod_bytes"], WEIGHT_BYTES, s)
        # Nothing left in the EP's device arena once the session is gone.
        self.assertEqual(s["live_allocations_after"], 0, s)
        self.assertEqual(s["in_use_bytes_after"], 0, s)

    def test_a_budget_holding_every_weight_pages_each_in_once_when_streaming_is_forced(self):
        res, log = run_child("decoder", opts(budget_bytes=8 << 20, stream_weights=1))
        self.assertLessEqual(res["max_abs_diff"], 1e-5 * max(1.0, res["ref_max"]), res)
        s = release_stats(log)
        self.assertEqual(s["page_ins"], WEIGHTS, s)
        self.assertEqual(s["evictions"], 0, s)
        # Every unit resident: acquire and release are all that is left of
        # the residency manager per node.
        self.assertGreater(s["residency_us_per_compute"], 0, s)
        self.assertLessEqual(s["residency_us_per_compute"], s["host_us_per_compute"], s)

    def test_by_default_a_budget_holding_every_weight_claims_nothing(self):
        # stream_weights=auto: the 2 MiB of weights that qualify fit 8 MiB,
        # so the other EPs keep them and the session runs as without epmem's
        # EP (bit-identical), saying why in the log.
        res, log = run_child("decoder", opts(budget_bytes=8 << 20))
        self.assertEqual(res["max_abs_diff_vs_alone"], 0.0, res)
        self.assertNotIn("claiming", log)
        self.assertRegex(log, rf"the {WEIGHTS} weights that could stream \({WEIGHT_BYTES} bytes\) fit the budget "
                              rf"of {8 << 20} bytes")
        # One byte less than the weights: they stream.
        res, log = run_child("decoder", opts(budget_bytes=WEIGHT_BYTES - 1))
        self.assertNotIn("error", res, log[-3000:])
        self.assertEqual(len(re.findall(r"claiming (MatMul|Gemm)", log)), WEIGHTS, log[-3000:])
        self.assertEqual(release_stats(log)["weights"], WEIGHTS)

    def test_a_llama_decoder_copies_at_most_the_whole_weight_floor_per_run(self):
        # Every run after the first copies at most the whole-weight floor for
        # the budget (the first pages every weight in once: the resident set's
        # fill). The EP reports what the first run copied. With split_bytes
        # the units are the EP's parts, and the floor is theirs.
        for pct, split in ((25, 0), (75, 0), (75, 4 << 20)):
            o = {"pct": pct, "split_bytes": str(split)} if split else {"pct": pct}
            res, log = run_child("llama", o)
            self.assertNotIn("error", res, log[-3000:])
            s = release_stats(log)
            sizes, budget = res["sizes"], res["budget"]
            total = sum(sizes)
            self.assertEqual((s["units"], s["weight_bytes"]), (len(sizes), total), s)
            nodes = 7 * LLAMA["layers"] + 1
            self.assertEqual((s["weights"], s["nodes_per_run"]), (nodes, nodes), s)
            self.assertEqual(s["computes"], nodes * LLAMA_RUNS, s)
            self.assertLessEqual(s["peak_resident_bytes"], budget, s)
            first = s["first_run_htod_bytes"]
            self.assertGreaterEqual(first, total, s)
            self.assertLessEqual(first, total + max(sizes), s)
            floor = res["floor"]
            per_run = (s["htod_bytes"] - first) / (LLAMA_RUNS - 1)
            # The arena aligns each weight to 256 bytes.
            self.assertLessEqual(per_run, floor + 256 * len(sizes), (pct, per_run, floor, s))
            self.assertGreaterEqual(per_run, total - budget, (pct, per_run, floor, s))
            self.assertEqual(s["eviction_waits"], 0, s)

    def test_split_weights_stream_in_parts_under_a_budget_below_the_largest(self):
        # split_bytes 64 KiB: every weight above it (W1, W2 256 KiB, Wlm 512
        # KiB; the transB Gemm with its bias among them) streams in parts of
        # whole output columns, so a 256 KiB budget, below the lm_head, runs;
        # outputs as with whole weights.
        res, log = run_child("decoder", opts(split_bytes="64KiB", budget_bytes=256 << 10))
        self.assertNotIn("error", res, log[-3000:])
        self.assertLessEqual(res["max_abs_diff"], 1e-5 * max(1.0, res["ref_max"]), res)
        self.assertTrue(res["runs_identical"], res)
        s = release_stats(log)
        self.assertEqual((s["weights"], s["weight_bytes"]), (WEIGHTS, WEIGHT_BYTES), s)
        self.assertGreater(s["units"], WEIGHTS, s)
        self.assertEqual(s["computes"], WEIGHTS * RUNS, s)
        self.assertEqual(s["acquires"], s["units"] * RUNS, s)
        self.assertLessEqual(s["peak_resident_bytes"], 256 << 10, s)
        self.assertEqual((s["live_allocations_after"], s["in_use_bytes_after"]), (0, 0), s)

    def test_float16_and_bfloat16_match_numpy(self):
        # stream_weights=1: the weights fit the budget, and the CPU EP has no
        # bfloat16 MatMul to leave them to.
        res, log = run_child("types", {"weight_min_bytes": "64KiB", "budget_bytes": "1MiB", "stream_weights": "1"})
        self.assertEqual(len(re.findall(r"claiming (MatMul|Gemm)", log)), 4, log[-3000:])
        # One rounding of the f32 result to the type (half an ulp: 2^-11 for
        # float16, 2^-8 for bfloat16) relative to the element, bounded here by
        # the largest element; 2x for slack in the f32 sums.
        for dtype, ulp in (("float16", 2.0 ** -10), ("bfloat16", 2.0 ** -7)):
            for err in res["types"][dtype]:
                self.assertLessEqual(err, ulp, (dtype, res))

    def test_a_weight_given_as_an_input_is_not_claimed(self):
        res, log = run_child("input_weight", opts())
        self.assertLessEqual(res["max_abs_diff"], 1e-4, res)
        self.assertNotIn("claiming", log)
        self.assertRegex(log, r"\[W:[^\n]*leaving MatMul 'mm_input_weight'[^\n]*'W' is not a constant initializer")

    def test_a_budget_below_the_largest_weight_fails_session_creation(self):
        res, log = run_child("budget", opts(budget_bytes=300 << 10))
        self.assertIn("error", res, log[-3000:])
        for part in ("'Wlm'", "524288 bytes", "307200 bytes"):
            self.assertIn(part, res["error"])

    def test_a_bad_option_is_an_error_naming_it(self):
        res, log = run_child("budget", opts(budget_bytes="lots"))
        want = 'EP option budget_bytes="lots": not a number'
        if "error" in res:
            self.assertIn(want, res["error"])
        else:
            # onnxruntime 1.23's Python InferenceSession prints an EP's
            # creation error and falls back to the CPU EP instead of raising.
            self.assertIn(want, log)
            self.assertIn("Falling back to ['CPUExecutionProvider']", log)
            self.assertNotIn("claiming", log)

    def test_stream_weights_0_claims_nothing(self):
        res, log = run_child("decoder", opts(stream_weights=0))
        # Bit-identical to the session's other EPs alone (the CPU EP on the
        # host; on a GPU the CUDA EP, whose float32 MatMuls differ from the
        # CPU EP's in the last bits).
        self.assertEqual(res["max_abs_diff_vs_alone"], 0.0, res)
        self.assertNotIn("claiming", log)
        self.assertNotIn("weight streaming released", log)


class ExternalAllocator(unittest.TestCase):
    """The functions for the CUDA EP's gpu_external_alloc/free/empty_cache
    options, called as the CUDA EP calls them (plain C functions)."""

    def test_alloc_free_and_bad_input(self):
        code = r"""
import ctypes, os, sys
lib = ctypes.CDLL(sys.argv[1])
lib.epm_ort_external_alloc.restype = ctypes.c_void_p
lib.epm_ort_external_alloc.argtypes = [ctypes.c_size_t]
lib.epm_ort_external_free.argtypes = [ctypes.c_void_p]
a = lib.epm_ort_external_alloc(1 << 20)
b = lib.epm_ort_external_alloc(0)
assert a and b and a != b, (a, b)
assert a % 256 == 0, a
if os.environ.get("EPM_DEVICE", "auto") != "cuda" or os.environ.get("EPMEM_FAKE_CUDA") == "1":
    ctypes.memset(a, 0x5A, 1 << 20)  # host-device (and fake-CUDA) memory is host-addressable
    assert ctypes.string_at(a + 12345, 1) == b"Z"
lib.epm_ort_external_free(ctypes.c_void_p(a))
lib.epm_ort_external_free(ctypes.c_void_p(a))          # twice: logged, ignored
lib.epm_ort_external_free(ctypes.c_void_p(None))       # NULL: ignored
assert not lib.epm_ort_external_alloc(1 << 62)         # more than any device: NULL
lib.epm_ort_external_empty_cache()
c = lib.epm_ort_external_alloc(4096)
assert c
lib.epm_ort_external_free(ctypes.c_void_p(c))
lib.epm_ort_external_free(ctypes.c_void_p(b))
print("EXTERNAL-OK")
"""
        env = dict(os.environ, EPM_LOG="warn")
        r = subprocess.run([sys.executable, "-c", code, LIB], env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("EXTERNAL-OK", r.stdout)
        self.assertIn("external free", r.stderr, "the double free should be reported")


class FakeCuda(unittest.TestCase):
    def setUp(self):
        if not FAKE_CUDA:
            self.skipTest("only on the fake libcuda")

    def test_no_cublas_is_a_clean_session_error(self):
        res, _ = run_child("budget", opts())
        self.assertIn("cuBLAS", res.get("error", ""), res)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], json.loads(sys.argv[3]))
        return
    if not LIB:
        sys.exit("set EPMEM_LIB to the absolute path of libepmem.so")
    load = unittest.defaultTestLoader.loadTestsFromTestCase
    res = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(
        unittest.TestSuite([load(Streaming), load(ExternalAllocator), load(FakeCuda)]))
    failed = len(res.failures) + len(res.errors)
    skipped = len(res.skipped)
    passed = res.testsRun - failed - skipped
    print(f"ort-stream: {passed} passed, {failed} failed, {skipped} skipped", flush=True)
    sys.exit(1 if failed or passed == 0 else 0)


if __name__ == "__main__":
    main()
