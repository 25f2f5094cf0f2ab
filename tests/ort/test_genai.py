"""epmem's EP inside onnxruntime-genai: a model made by genai's builder
(tests/ort/make_genai_model.py) generates greedily with genai alone, then with
epmem's EP registered into genai (og.register_execution_provider_library) and
listed in genai_config.json's provider_options, under a budget smaller than
the weights it claims. The tokens must be identical, the logits equal within
summation-order noise (float32 on cpu, float16 for the cuda model), and the EP's statistics must show that it
claimed every MatMul weight of the model and streamed them.

    EPMEM_LIB=/abs/libepmem.so EPMEM_GENAI_MODEL=DIR python3 tests/ort/test_genai.py

DIR is make_genai_model.py's output (scripts/ort-test.sh makes it). With a
model built for cuda (--ep cuda, onnxruntime-genai-cuda + onnxruntime-gpu,
EPM_DEVICE=cuda) the reference is genai on the CUDA EP alone and epmem's entry
goes before "cuda", with session.use_env_allocators=1 (docs/ORT.md).

A missing onnxruntime_genai or model is a failure, not a skip. Prints
"ort-genai: N passed, N failed".
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

from _child import release_stats, run_child as _run_child

LIB = os.environ.get("EPMEM_LIB", "")
MODEL = os.environ.get("EPMEM_GENAI_MODEL", "")
REG = "epmem"
PROMPT = [1, 17, 245, 3, 999, 512, 64, 8]
NEW = 16
# Claimed: every weight of at least 64 KiB (all of this model's MatMul
# weights); the budget holds a part of them (a quarter of the float32
# model's, about half of the float16 one's).
MIN = 64 << 10
BUDGET = 2 << 20


def child(mode, model_dir):
    """Runs in the child: one generation, result as JSON on a "RESULT " line."""
    if os.environ.get("EPM_DEVICE", "").lower() == "cuda":
        try:  # on a GPU machine torch brings the CUDA 13 libraries into the process
            import torch  # noqa: F401
        except ImportError:
            pass
    import numpy as np
    import onnxruntime_genai as og

    if mode == "epmem":
        og.register_execution_provider_library(REG, LIB)
    out = {}
    try:
        model = og.Model(model_dir)
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(PROMPT) + NEW)
        gen = og.Generator(model, params)
        gen.append_tokens(PROMPT)
        logits = []
        while not gen.is_done():
            gen.generate_next_token()
            raw = np.asarray(gen.get_output("logits"))
            out["logits_dtype"] = str(raw.dtype)
            lg = raw.astype(np.float32)
            logits.append(lg.reshape(-1, lg.shape[-1])[-1].tolist())
        out["tokens"] = [int(t) for t in gen.get_sequence(0)]
        out["logits"] = logits
        del gen, params, model  # the EP logs its release statistics here
    except Exception as e:  # the error is the result
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        if mode == "epmem":
            og.unregister_execution_provider_library(REG)
    print("RESULT " + json.dumps(out), flush=True)


def run_child(mode, model_dir):
    # With epmem, the EP's claim lines and release statistics (INFO, on stderr).
    return _run_child(__file__, [mode, model_dir], log_level="info" if mode == "epmem" else None)


def with_epmem(src, dst, options):
    """DST: SRC's model with epmem's entry first in provider_options (none
    when OPTIONS is None). The CUDA EP, where listed, runs without TF32 in
    both (its float32 MatMuls then round like the EP's cuBLAS GEMM, which
    never uses TF32)."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f != "genai_config.json":
            os.symlink(os.path.join(src, f), os.path.join(dst, f))
    with open(os.path.join(src, "genai_config.json")) as f:
        cfg = json.load(f)
    so = cfg["model"]["decoder"]["session_options"]
    others = so.get("provider_options", [])
    for p in others:
        if "cuda" in p:
            p["cuda"]["use_tf32"] = "0"
            if options is not None:
                so["session.use_env_allocators"] = "1"  # the CUDA EP's memory from epmem too
    so["provider_options"] = ([{REG: options}] if options is not None else []) + others
    with open(os.path.join(dst, "genai_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return so


class Genai(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp()

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        # (torch first where it is: on a GPU machine it loads the CUDA libraries genai-cuda needs)
        r = subprocess.run([sys.executable, "-c", "try:\n import torch\nexcept ImportError:\n pass\n"
                            "import onnxruntime_genai as og, onnxruntime as o\nprint(og.__version__, o.__version__)"],
                           capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, "onnxruntime_genai does not import here (pip install "
                         "onnxruntime-genai; it needs onnxruntime 1.31+):\n" + r.stderr[-2000:])
        self.assertTrue(MODEL and os.path.isfile(os.path.join(MODEL, "genai_config.json")),
                        f"EPMEM_GENAI_MODEL={MODEL!r} is not a genai model (tests/ort/make_genai_model.py makes one)")
        with open(os.path.join(MODEL, "weights.json")) as f:
            self.weights = json.load(f)

    def test_streamed_weights_generate_the_same_tokens(self):
        alone = os.path.join(self.tmp, "alone")
        with_epmem(MODEL, alone, None)  # the model as built (no TF32 where the CUDA EP is)
        ref, _ = run_child("alone", alone)
        self.assertNotIn("error", ref)
        d = os.path.join(self.tmp, "epmem")
        so = with_epmem(MODEL, d, {"budget_bytes": str(BUDGET), "weight_min_bytes": str(MIN)})
        print("  provider_options:", json.dumps(so["provider_options"]))
        res, log = run_child("epmem", d)
        self.assertNotIn("error", res, log[-4000:])
        self.assertEqual(len(ref["tokens"]), len(PROMPT) + NEW, ref["tokens"])
        self.assertEqual(res["tokens"], ref["tokens"])
        # float32 sums in another order (the EP's GEMM vs MLAS / cuBLAS): with
        # K <= 768 and values of order 1, ~K * 2^-24 relative; 1e-4 of the
        # logits' magnitude still catches a wrong weight or layout (off by O(1)).
        # A float16 model (the cuda one) rounds every activation to 2^-11
        # relative, so one differently rounded value moves later layers by a
        # few of those: 1e-2 of the magnitude, still far below a wrong weight.
        import numpy as np

        a, b = np.array(res["logits"]), np.array(ref["logits"])
        scale = max(1.0, float(np.abs(b).max()))
        diff = float(np.abs(a - b).max())
        print(f"  tokens {res['tokens'][len(PROMPT):]}; logits max |diff| {diff:.3g} (max |logit| {scale:.3g})")
        rel = 1e-2 if ref.get("logits_dtype") == "float16" else 1e-4
        self.assertLessEqual(diff, rel * scale, ref.get("logits_dtype"))
        # The EP claimed every MatMul weight of the model: the claim lines name them.
        claimed = set(re.findall(r"claiming (?:MatMul|Gemm) '[^']+': weight '([^']+)'", log))
        big = {k for k, v in self.weights.items() if v >= MIN}
        self.assertTrue(big, self.weights)
        self.assertEqual(claimed, big, log[-4000:])
        s = release_stats(log)
        print("  release:", {k: int(v) for k, v in s.items()})
        self.assertEqual(s["weights"], len(big), s)
        self.assertEqual(s["weight_bytes"], sum(self.weights[k] for k in big), s)
        self.assertEqual(s["budget_bytes"], BUDGET, s)
        self.assertGreater(s["weight_bytes"], BUDGET, s)
        self.assertLessEqual(s["peak_resident_bytes"], BUDGET, s)
        # The weights do not fit, so they stream: more page-ins than weights,
        # more bytes uploaded than the weights hold.
        self.assertGreater(s["page_ins"], s["weights"], s)
        self.assertGreater(s["htod_bytes"], s["weight_bytes"], s)
        self.assertEqual(s["live_allocations_after"], 0, s)

    def test_an_unregistered_name_is_an_error(self):
        # epmem listed but its library not registered: genai must refuse the
        # model, not run it on the other EPs.
        d = os.path.join(self.tmp, "unregistered")
        with_epmem(MODEL, d, {"budget_bytes": str(BUDGET)})
        res, _ = run_child("alone", d)
        self.assertIn("error", res, res.get("tokens"))
        self.assertIn("epmem", res["error"])


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return
    if not LIB:
        sys.exit("set EPMEM_LIB to the absolute path of libepmem.so")
    res = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(
        unittest.defaultTestLoader.loadTestsFromTestCase(Genai))
    failed = len(res.failures) + len(res.errors)
    passed = res.testsRun - failed - len(res.skipped)
    print(f"ort-genai: {passed} passed, {failed} failed", flush=True)
    sys.exit(1 if failed or passed == 0 else 0)


if __name__ == "__main__":
    main()
