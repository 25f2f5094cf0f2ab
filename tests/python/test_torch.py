"""epmem.torch: offload() on a tiny transformers-free model, and epmem memory as
torch tensors. Runs on the host device in CI (CPU torch) and on CUDA on the GPU
machine (EPM_DEVICE=cuda): the model lives where epmem's device is."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

try:
    import torch
    from torch import nn
except ImportError:  # the tests below skip themselves
    torch = None

import epmem

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1 << 20

if torch is not None:
    import epmem.torch as et

    class Block(nn.Module):
        def __init__(self, d, f):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.up = nn.Linear(d, f)
            self.down = nn.Linear(f, d, bias=False)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))

    class Inner(nn.Module):
        def __init__(self, vocab, d, f, n):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.layers = nn.ModuleList([Block(d, f) for _ in range(n)])

    class Tiny(nn.Module):
        """embed -> n blocks of (norm, linear up, relu, linear down) -> lm_head, like a
        decoder's shape: `model.layers` holds the repeated blocks."""

        def __init__(self, vocab=97, d=64, f=256, n=6, seed=0, dtype=None):
            super().__init__()
            torch.manual_seed(seed)
            self.model = Inner(vocab, d, f, n)
            self.lm_head = nn.Linear(d, vocab, bias=False)
            if dtype is not None:
                self.to(dtype)

        def forward(self, ids):
            x = self.model.embed(ids)
            for blk in self.model.layers:
                x = blk(x)
            return self.lm_head(x)

    def greedy(model, steps=8, start=(1, 2, 3)):
        ids = torch.tensor([list(start)], device=next(model.lm_head.parameters()).device)
        with torch.no_grad():
            for _ in range(steps):
                nxt = model(ids)[:, -1].float().argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], 1)
        return ids[0].tolist()


def torch_device():
    return torch.device("cuda", 0) if os.environ.get("EPM_DEVICE") == "cuda" else torch.device("cpu")


def block_linear_bytes(model):
    return sum(p.numel() * p.element_size() for blk in model.model.layers
               for m in blk.modules() if isinstance(m, nn.Linear) for p in m.parameters())


@unittest.skipIf(torch is None, "torch is not installed")
class AdoptedStreams(unittest.TestCase):
    def test_the_cache_starts_over_past_its_limit_only_when_may_clear_allows(self):
        made, closed = [], []

        class Adopted:
            def __init__(self, native):
                self.native = native
                made.append(native)

            def close(self):
                closed.append(self.native)

        orig = et.adopt_stream
        et.adopt_stream = lambda dev, tdev, native: Adopted(native)
        busy = [True]
        try:
            a = et.AdoptedStreams(None, None, limit=4, may_clear=lambda: not busy[0])
            for n in range(6):  # held: it grows past the limit
                s, new = a.get(n)
                self.assertEqual((s.native, new), (n, True))
            self.assertEqual(a.get(3)[1], False)
            self.assertEqual((len(a), closed), (6, []))
            busy[0] = False
            a.get(6)  # now it starts over
            self.assertEqual((len(a), sorted(closed)), (1, list(range(6))))
            a.close()
            self.assertEqual((len(a), len(closed)), (0, 7))
        finally:
            et.adopt_stream = orig


@unittest.skipIf(torch is None, "torch is not installed")
class Offload(unittest.TestCase):
    def setUp(self):
        self.dev = torch_device()
        self.model = Tiny().to(self.dev).eval()
        self.ref = greedy(self.model)
        self.offloaded = block_linear_bytes(self.model)

    def assert_usable(self):
        """The module still decodes exactly as before (nothing was left half-changed)."""
        self.assertEqual(greedy(self.model), self.ref)
        self.assertIsNone(getattr(self.model, "_epmem_offload", None))
        for p in self.model.parameters():
            self.assertEqual(p.device.type, self.dev.type)

    def test_identical_tokens_at_every_budget_source_and_granularity(self):
        for sources in et.SOURCES:
            for gran in et.GRANULARITIES:
                for pct in (25, 50, 100):
                    with self.subTest(sources=sources, granularity=gran, pct=pct):
                        budget = self.offloaded * pct // 100
                        h = et.offload(self.model, budget, sources=sources, granularity=gran)
                        try:
                            self.assertEqual(greedy(self.model), self.ref)
                            st = h.stats()
                            self.assertEqual(st["weights"], 6 * 3)  # up.weight, up.bias, down.weight
                            self.assertEqual(st["offloaded_bytes"], self.offloaded)
                            self.assertGreater(st["page_ins"], 0)
                            self.assertGreater(st["htod_bytes"], 0)
                            self.assertLessEqual(st["peak_resident_bytes"], budget)
                            # greedy(): 8 forwards, each acquiring all 18 weights once.
                            self.assertEqual(st["acquires"], 8 * 18)
                            self.assertEqual(st["hook_calls"], 8 * len(h._st.units))
                            if pct < 100:
                                self.assertGreater(st["evictions"], 0)
                                # Every decode step streams what the budget cannot hold.
                                self.assertGreaterEqual(st["htod_bytes"], 8 * (self.offloaded - budget) * 0.9)
                            if sources == "staged":
                                self.assertEqual(st["bypassed_page_ins"], 0)
                                self.assertGreater(st["staged_page_ins"], 0)
                            else:
                                self.assertEqual(st["staged_page_ins"], 0, st)
                            # At rest the offloaded parameters are host tensors.
                            self.assertEqual(self.model.model.layers[0].up.weight.device.type, "cpu")
                        finally:
                            h.remove()
                        self.assert_usable()

    def test_staged_prefetches_fill_in_the_background_unless_caller_fills(self):
        budget = self.offloaded // 2
        for caller_fills in (0, 1):
            with self.subTest(caller_fills=caller_fills):
                with et.offload(self.model, budget, sources="staged", granularity="linear",
                                caller_fills=caller_fills) as h:
                    self.assertEqual(greedy(self.model), self.ref)
                    st = h.stats()
                self.assertEqual(st["staged_page_ins"], st["page_ins"], st)
                self.assertLessEqual(st["peak_resident_bytes"], budget, st)
                self.assertGreaterEqual(st["slot_wait_ms"], 0.0, st)
                if caller_fills:
                    self.assertEqual((st["background_page_ins"], st["background_waits"]), (0, 0), st)
                    self.assertEqual(st["background_wait_ms"], 0.0, st)
                    self.assertEqual(st["background_busy_ms"], 0.0, st)
                else:
                    # Which page-ins are prefetches depends on timing (the filler
                    # may overwrite the weight just released); every prefetch of
                    # a staged source goes to the filler.
                    self.assertGreater(st["prefetch_page_ins"], 0, st)
                    self.assertGreater(st["background_busy_ms"], 0.0, st)
                    self.assertEqual(st["background_page_ins"], st["prefetch_page_ins"], st)
                    self.assertLessEqual(st["background_waits"], st["background_page_ins"], st)
                self.assert_usable()

    def test_staged_prefetches_can_be_filled_ahead(self):
        budget = self.offloaded // 2
        with et.offload(self.model, budget, sources="staged", granularity="linear",
                        fill_ahead_chunks=2) as h:
            for _ in range(2):
                self.assertEqual(greedy(self.model), self.ref)
            st = h.stats()
        # Whether the filler idles long enough to fill ahead depends on timing;
        # what it filled is counted, and never more is used than was filled.
        self.assertLessEqual(st["fill_ahead_used_bytes"], st["fill_ahead_bytes"], st)
        self.assertLessEqual(st["peak_resident_bytes"], budget, st)
        self.assert_usable()
        with et.offload(self.model, budget, sources="staged", granularity="linear", fill_ahead_chunks=0) as h:
            self.assertEqual(greedy(self.model), self.ref)
            self.assertEqual(h.stats()["fill_ahead_bytes"], 0, "fill_ahead_chunks=0 turns it off")
        # On by default: every staging slot (the C default the binding passes on).
        self.assertEqual(epmem.core._config(epmem._lib.EpmResidencyConfig, epmem._lib.lib().epm_residency_config_default, {})
                         .fill_ahead_chunks, epmem.EPM_FILL_AHEAD_ALL_SLOTS)
        with et.offload(self.model, budget, sources="staged", granularity="linear") as h:
            self.assertEqual(greedy(self.model), self.ref)
            st = h.stats()
            self.assertLessEqual(st["fill_ahead_used_bytes"], st["fill_ahead_bytes"], st)
        # More chunks ahead than staging slots: refused, the module intact.
        with self.assertRaises(epmem.errors.InvalidConfig):
            et.offload(self.model, budget, sources="staged", fill_ahead_chunks=99)
        self.assert_usable()

    def test_bf16_model(self):
        m = Tiny(dtype=torch.bfloat16).to(self.dev).eval()
        ref = greedy(m)
        with et.offload(m, block_linear_bytes(m) // 2) as h:
            self.assertEqual(greedy(m), ref)
            self.assertEqual(h.stats()["device"], "cuda" if self.dev.type == "cuda" else "host")
        self.assertEqual(greedy(m), ref)

    def test_compressed_weights_give_identical_tokens_and_drop_host_ram(self):
        m = Tiny(dtype=torch.bfloat16).to(self.dev).eval()
        ref = greedy(m)
        offloaded = block_linear_bytes(m)
        for sources in et.SOURCES:
            for pct in (50, 100):
                with self.subTest(sources=sources, pct=pct):
                    # min_bytes 0: these test-sized weights (32 KiB, biases of 512 bytes)
                    # are below the default 1 MiB worth encoding.
                    with et.offload(m, offloaded * pct // 100, sources=sources, compress=True,
                                    compress_options={"min_bytes": 0}) as h:
                        self.assertEqual(greedy(m), ref)
                        st = h.stats()
                        self.assertTrue(st["compress"])
                        # A decode follows each copy: two page-ins ahead by default.
                        self.assertEqual(st["prefetch_depth"], 2)
                        # up.weight and down.weight; the biases (512 bytes) do not compress
                        # below 0.9 x (the header alone is 128 bytes) and stream raw.
                        self.assertEqual(st["compressed_weights"], 6 * 2, st)
                        self.assertGreater(st["decodes"], 0)
                        self.assertEqual(st["compressed_raw_bytes"], 6 * 2 * 256 * 64 * 2)
                        self.assertLess(st["host_weight_bytes"], offloaded * 0.85, st)
                        self.assertLess(st["compressed_htod_bytes"], st["decoded_bytes"], st)
                        self.assertLessEqual(st["peak_resident_bytes"] + st["decode_staging_bytes"],
                                             st["budget_bytes"])
                        if pct < 100:
                            self.assertGreater(st["evictions"], 0)
                            # What the budget cannot hold still streams every step, compressed.
                            self.assertGreaterEqual(st["decoded_bytes"], 8 * (offloaded - st["budget_bytes"]) * 0.9)
                        # At rest a compressed weight's parameter is a placeholder of its shape.
                        self.assertEqual(tuple(m.model.layers[0].up.weight.shape), (256, 64))
                    # remove() decodes the weights back: the module is exactly as before.
                    self.assertEqual(greedy(m), ref)
                    self.assertEqual(m.model.layers[0].up.weight.device.type, self.dev.type)

    def test_compress_auto_is_on_for_cuda_only_and_keeps_small_or_other_weights_raw(self):
        with et.offload(self.model, self.offloaded // 2) as h:
            st = h.stats()
            self.assertEqual(st["compress"], self.dev.type == "cuda")
            self.assertEqual(st["prefetch_depth"], 2 if self.dev.type == "cuda" else 1)
            # fp32 weights are never encoded: all raw, streamed as before.
            self.assertEqual(st["compressed_weights"], 0)
            self.assertEqual(st["host_weight_bytes"], self.offloaded)
            self.assertEqual(greedy(self.model), self.ref)
        m = Tiny(dtype=torch.float16).to(self.dev).eval()
        ref = greedy(m)
        # Default options: every weight of this model is below 1 MiB, so all stay raw.
        with et.offload(m, block_linear_bytes(m) // 2, compress=True) as h:
            st = h.stats()
            self.assertTrue(st["compress"])
            self.assertEqual(st["prefetch_depth"], 2)
            self.assertEqual((st["compressed_weights"], st["decodes"]), (0, 0))
            self.assertEqual(greedy(m), ref)
        self.assertEqual(greedy(m), ref)
        # A budget that holds the largest weight but not beside its decode staging
        # is refused with the sizes, and the module is left as it was.
        with self.assertRaisesRegex(epmem.errors.OutOfBudget, "staging"):
            et.offload(m, 256 * 64 * 2 + 4096, compress=True, compress_options={"min_bytes": 0})
        self.assertEqual(greedy(m), ref)
        self.assertIsNone(getattr(m, "_epmem_offload", None))
        with self.assertRaises(ValueError):
            et.offload(m, block_linear_bytes(m) // 2, compress="yes")
        with self.assertRaises(ValueError):
            et.offload(m, block_linear_bytes(m) // 2, compress=True, compress_options={"level": 9})
        self.assertEqual(greedy(m), ref)

    def test_inference_mode(self):
        ids = torch.tensor([[1, 2, 3]], device=self.dev)
        with torch.inference_mode():
            ref = self.model(ids)
        with et.offload(self.model, self.offloaded // 2) as h, torch.inference_mode():
            self.assertTrue(torch.equal(self.model(ids), ref))
            self.assertEqual(h.stats()["acquires"], 18)

    def test_block_granularity_falls_back_to_linear_when_a_block_does_not_fit(self):
        one_block = block_linear_bytes(self.model) // 6
        h = et.offload(self.model, one_block // 2 + 4096)
        try:
            self.assertEqual(h.granularity, "linear")
            self.assertEqual(greedy(self.model), self.ref)
        finally:
            h.remove()
        with et.offload(self.model, one_block * 3, granularity="block") as h:
            self.assertEqual(h.granularity, "block")
        with et.offload(self.model, one_block * 3) as h:
            self.assertEqual(h.granularity, "linear")  # the default

    def test_remove_restores_weights_and_unhooks(self):
        before = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        ids_before = {n: id(p) for n, p in self.model.named_parameters()}
        h = et.offload(self.model, self.offloaded // 3)
        greedy(self.model)
        h.remove()
        for n, p in self.model.named_parameters():
            self.assertEqual(id(p), ids_before[n], "the Parameter objects are kept")
            self.assertEqual(p.device.type, self.dev.type)
            self.assertTrue(torch.equal(p, before[n]), n)
        for blk in self.model.model.layers:
            self.assertEqual(len(blk._forward_pre_hooks), 0)
            self.assertEqual(len(blk._forward_hooks), 0)
        self.assert_usable()
        with self.assertRaisesRegex(et.OffloadError, "removed"):
            h.stats()
        with self.assertRaisesRegex(et.OffloadError, "removed"):
            h.remove()
        # and offloading again after a remove works
        with et.offload(self.model, self.offloaded // 2):
            self.assertEqual(greedy(self.model), self.ref)

    def test_torch_cache_is_emptied_only_when_the_budget_needs_its_memory(self):
        budget = self.offloaded // 2
        h = et.offload(self.model, budget)
        st = h._state()
        calls = []
        real = torch.cuda.empty_cache
        torch.cuda.empty_cache = lambda: calls.append(1)
        try:
            self.assertFalse(st._return_cached(budget + et.CACHE_HEADROOM))
            self.assertEqual(calls, [], "the budget fits beside torch's cache: it is left alone")
            self.assertTrue(st._return_cached(budget + et.CACHE_HEADROOM - 1))
            self.assertEqual(calls, [1], "the budget needs the cached memory: it is given back")
        finally:
            torch.cuda.empty_cache = real
        self.assertEqual(greedy(self.model), self.ref)
        h.remove()
        self.assert_usable()

    def test_refuses_training_mode(self):
        self.model.train()
        with self.assertRaisesRegex(et.OffloadError, "training mode"):
            et.offload(self.model, self.offloaded)
        self.model.eval()
        self.assert_usable()

    def test_refuses_grad_in_forward_and_stays_usable(self):
        h = et.offload(self.model, self.offloaded // 2)
        try:
            ids = torch.tensor([[1, 2, 3]], device=self.dev)
            with self.assertRaisesRegex(et.OffloadError, "no_grad"):
                self.model(ids)
            self.assertEqual(greedy(self.model), self.ref)
            st = h.stats()  # each hook call acquires its unit's weights (every unit alike here)
            self.assertEqual(st["acquires"] * st["units"], st["hook_calls"] * st["weights"])
            # .train() after offload is refused at the block
            self.model.train()
            with torch.no_grad(), self.assertRaisesRegex(et.OffloadError, "training mode"):
                self.model(ids)
            self.model.eval()
            self.assertEqual(greedy(self.model), self.ref)
        finally:
            h.remove()
        self.assert_usable()

    def test_refuses_parameter_shared_by_two_blocks(self):
        layers = self.model.model.layers
        saved = layers[3].up.weight
        layers[3].up.weight = layers[1].up.weight
        try:
            with self.assertRaisesRegex(et.OffloadError, "shared"):
                et.offload(self.model, self.offloaded)
            self.assertEqual(getattr(self.model.model.layers[1].up.weight, "_epmem_offloaded", False), False)
        finally:
            layers[3].up.weight = saved
        self.assert_usable()

    def test_refuses_parameter_tied_outside_the_blocks(self):
        m = Tiny(d=64, f=64, vocab=64).to(self.dev).eval()
        m.lm_head.weight = m.model.layers[0].up.weight  # 64x64 both
        with self.assertRaisesRegex(et.OffloadError, "tied"):
            et.offload(m, 10 * MiB)

    def test_refuses_sharing_inside_a_block_and_with_explicit_blocks(self):
        m = Tiny(d=64, f=64, vocab=64).to(self.dev).eval()
        blk = m.model.layers[2]
        saved = blk.down.weight
        blk.down.weight = blk.up.weight  # 64x64 both, inside one block
        with self.assertRaisesRegex(et.OffloadError, "shared"):
            et.offload(m, 10 * MiB)
        blk.down.weight = saved
        m.lm_head.weight = m.model.layers[0].up.weight
        with self.assertRaisesRegex(et.OffloadError, "tied"):
            et.offload(m, 10 * MiB, blocks=list(m.model.layers))

    def test_refuses_budget_below_largest_weight(self):
        with self.assertRaisesRegex(et.OffloadError, "smaller than the largest weight"):
            et.offload(self.model, 1000)
        self.assert_usable()
        with self.assertRaises(ValueError):
            et.offload(self.model, 0)

    def test_refuses_device_side_fill_waits(self):
        # fill_waits_on_host=0 (the stream waiting on the device for a fill
        # not yet issued) deadlocked on the H200: refused, the module intact.
        with self.assertRaisesRegex(epmem.errors.Unsupported, "fill_waits_on_host") as cm:
            et.offload(self.model, self.offloaded // 2, sources="staged", fill_waits_on_host=0)
        self.assertEqual(cm.exception.name, "EPM_STATUS_UNSUPPORTED")
        self.assertIsNone(et.offload_of(self.model))
        self.assert_usable()

    def test_refuses_module_with_no_matching_parameters(self):
        with self.assertRaisesRegex(et.OffloadError, "no parameters to offload"):
            et.offload(self.model, self.offloaded, include=lambda name, m: isinstance(m, nn.Conv2d))
        with self.assertRaisesRegex(et.OffloadError, "no nn.ModuleList"):
            et.offload(nn.Sequential(nn.ReLU()).eval(), MiB)
        self.assert_usable()

    def test_refuses_offloading_twice(self):
        h = et.offload(self.model, self.offloaded)
        try:
            with self.assertRaisesRegex(et.OffloadError, "offloaded already"):
                et.offload(self.model, self.offloaded)
            with self.assertRaisesRegex(et.OffloadError, "offloaded already"):
                et.offload(self.model.model, self.offloaded, blocks=self.model.model.layers)
            self.assertIsNone(et.offload_of(self.model.model))
            self.assertEqual(et.offload_of(self.model).stats()["weights"], 18)
            self.assertEqual(greedy(self.model), self.ref)
        finally:
            h.remove()
        self.assertIsNone(et.offload_of(self.model))
        self.assert_usable()

    def test_refuses_device_mismatch(self):
        if self.dev.type == "cuda":
            other = Tiny().eval()  # on the CPU, while epmem's device is CUDA
            with self.assertRaisesRegex(et.OffloadError, "device mismatch"):
                et.offload(other, MiB)
            with self.assertRaisesRegex(et.OffloadError, "device mismatch"):
                et.offload(self.model, MiB, device="host")
        else:
            with torch.device("meta"):
                other = Tiny().eval()
            with self.assertRaisesRegex(et.OffloadError, "meta"):
                et.offload(other, MiB)
        self.assert_usable()

    def test_refuses_cpu_only_torch_with_a_cuda_epmem_device(self):
        """Under the fake libcuda (src/device/cuda/fake_libcuda.c) epmem's device is
        CUDA while this torch has no GPU: offload() must say so."""
        if torch.cuda.is_available():
            self.skipTest("torch has CUDA here")
        cc = shutil.which(os.environ.get("CC", "gcc"))
        src = os.path.join(ROOT, "src", "device", "cuda", "fake_libcuda.c")
        if not cc or not os.path.isfile(src):
            self.skipTest("no C compiler or no fake libcuda source")
        with tempfile.TemporaryDirectory() as d:
            subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", os.path.join(d, "libcuda.so"), src], check=True)
            code = ("import torch, epmem, epmem.torch as et, sys\n"
                    "sys.path.insert(0, %r)\n"
                    "import test_torch as t\n"
                    "m = t.Tiny().eval(); ref = t.greedy(m)\n"
                    "assert epmem.Device().is_cuda\n"
                    "try:\n"
                    "    et.offload(m, 1 << 20)\n"
                    "except et.OffloadError as e:\n"
                    "    print('refused:', e)\n"
                    "assert t.greedy(m) == ref\n") % os.path.dirname(os.path.abspath(__file__))
            env = dict(os.environ, EPM_DEVICE="cuda", PYTHONPATH=os.pathsep.join(sys.path),
                       LD_LIBRARY_PATH=d + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("refused:", p.stdout)
        self.assertIn("no CUDA", p.stdout)

    def test_nondefault_current_stream(self):
        if self.dev.type != "cuda":
            self.skipTest("CUDA only (the host device has no native streams)")
        s = torch.cuda.Stream()
        with et.offload(self.model, self.offloaded // 2) as h:
            with torch.cuda.stream(s):
                out = greedy(self.model)
            torch.cuda.synchronize()
            self.assertEqual(out, self.ref)
            st = h.stats()
            self.assertGreaterEqual(st["wrapped_streams"], 1)
            self.assertEqual(st["legacy_stream_calls"], 0)
            # and on the legacy default stream, adopted as CU_STREAM_LEGACY: a second adoption
            self.assertEqual(greedy(self.model), self.ref)
            st2 = h.stats()
            self.assertEqual(st2["legacy_stream_calls"], st2["hook_calls"] - st["hook_calls"])
            self.assertEqual(st2["wrapped_streams"], st["wrapped_streams"] + 1)

    def test_exception_inside_a_block_releases_its_weights(self):
        h = et.offload(self.model, self.offloaded)
        blk = self.model.model.layers[2]
        orig = blk.down.forward

        def boom(x):
            raise KeyError("boom")

        blk.down.forward = boom
        try:
            with torch.no_grad(), self.assertRaises(KeyError):
                self.model(torch.tensor([[1]], device=self.dev))
        finally:
            blk.down.forward = orig
        try:
            self.assertEqual(greedy(self.model), self.ref)  # nothing stayed acquired
        finally:
            h.remove()

    def test_plain_linears_run_through_a_forward_of_their_own_and_others_get_hooks(self):
        """A plain nn.Linear gets offload's forward (no hooks, its parameters
        stay on the host copy); a Linear subclass with its own forward, and a
        Linear whose forward someone replaced already, get the hook pair.
        Tokens are the reference's either way; remove() takes both away."""

        class Scaled(nn.Linear):
            def forward(self, x):
                return super().forward(x) * 1.0

        blk0, blk1 = self.model.model.layers[0], self.model.model.layers[1]
        blk0.up.__class__ = Scaled
        theirs = blk1.down.forward
        blk1.down.forward = lambda x: theirs(x)  # what accelerate's hooks do
        h = et.offload(self.model, self.offloaded // 2)
        try:
            for i, blk in enumerate(self.model.model.layers):
                for name in ("up", "down"):
                    m = getattr(blk, name)
                    hooked = (i, name) in ((0, "up"), (1, "down"))
                    with self.subTest(block=i, linear=name):
                        self.assertEqual("forward" in m.__dict__ and m.forward.__qualname__.startswith("_State"),
                                         not hooked)
                        self.assertEqual((len(m._forward_pre_hooks), len(m._forward_hooks)),
                                         (1, 1) if hooked else (0, 0))
            self.assertEqual(greedy(self.model), self.ref)
            st = h.stats()
            # one call per linear and forward: the acquires less the biases' (6 blocks, 8 forwards)
            self.assertEqual(st["hook_calls"], st["acquires"] - 6 * 8)
            self.assertEqual(blk1.up.weight.device.type, "cpu")  # between forwards: the host copy
        finally:
            h.remove()
        for blk in self.model.model.layers:
            for m in (blk.up, blk.down):
                self.assertEqual((len(m._forward_pre_hooks), len(m._forward_hooks)), (0, 0))
        self.assertNotIn("forward", blk0.up.__dict__)
        self.assertIn("forward", blk1.down.__dict__)  # theirs stays
        self.assertEqual(greedy(self.model), self.ref)

    def test_an_error_inside_a_linear_releases_its_weights(self):
        """F.linear raising while its weight is acquired (a wrong input width):
        the weight is released, the module decodes exactly afterwards and can
        be removed (nothing stays acquired)."""
        h = et.offload(self.model, self.offloaded // 3)
        try:
            up = self.model.model.layers[3].up
            x = torch.zeros(1, 5, device=self.dev)
            before = h.stats()
            with torch.no_grad(), self.assertRaises(RuntimeError):
                up(x)
            st = h.stats()
            self.assertEqual(st["acquires"] - before["acquires"], 2)  # weight and bias, acquired
            # ... and released: one more release is refused by the manager
            res = h._st.res
            for p in (up.weight, up.bias):
                wid = next(w.id for w in h._st.weights if w.param is p)
                with self.assertRaisesRegex(epmem.EpmError, "released more often than acquired"):
                    if self.dev.type == "cuda":
                        res.release(wid, h._st._stream())
                    else:
                        res.release_host(wid)
            self.assertEqual(greedy(self.model), self.ref)
        finally:
            h.remove()
        self.assert_usable()

    def test_reentrant_block_call_is_refused_and_releases_cleanly(self):
        h = et.offload(self.model, self.offloaded, granularity="block")
        blk = self.model.model.layers[1]
        orig = blk.down.forward
        blk.down.forward = lambda x: blk(x[..., :64])  # the block inside its own forward
        try:
            with torch.no_grad(), self.assertRaisesRegex(et.OffloadError, "re-entrant"):
                self.model(torch.tensor([[1]], device=self.dev))
        finally:
            blk.down.forward = orig
        try:
            st = h.stats()
            self.assertEqual(st["acquires"], 2 * 3)  # blocks 0 and 1, once each
            self.assertEqual(greedy(self.model), self.ref)
        finally:
            h.remove()


@unittest.skipIf(torch is None, "torch is not installed")
class BenchSmoke(unittest.TestCase):
    def test_bench_torch_quick(self):
        """scripts/bench_torch.py --quick: the product path (offload with its
        defaults) and the peers decode the resident run's tokens in every mode,
        epmem streams what the budget cannot hold and holds the budget."""
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "bench.json")
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
            p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_torch.py"), "--quick",
                                "--json", out, "--methods", "epmem,epmem_staged,uva"], capture_output=True,
                               text=True, env=env, timeout=600)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            with open(out) as f:
                res = json.load(f)
            self.check_merge(d, res, env)
        self.assertIn("tokens identical in every row", p.stdout)
        self.assertTrue(res["tokens_identical"])
        sh = res["shapes"][0]
        modes = {r["mode"] for r in sh["rows"]}
        self.assertEqual(modes, {"b1", "b4", "prefill"})
        # 3 budgets: epmem in 3 modes, uva in 3 modes, epmem_staged in b1.
        self.assertEqual(len(sh["rows"]), 3 * (3 + 3 + 1))
        for r in sh["rows"]:
            self.assertTrue(r["tokens_identical"], r)
            self.assertGreater(r["tokens_compared"], 0)
            if r["method"].startswith("epmem"):
                # The product's defaults: per-linear acquisition.
                self.assertEqual(r["granularity"], "linear")
                # Compressed weights cross PCIe smaller than they land.
                self.assertGreaterEqual(r["decoded_equiv_bytes_per_pass"], r["floor_bytes"])
                self.assertLessEqual(r["streamed_bytes_per_pass"], r["decoded_equiv_bytes_per_pass"])
                self.assertLessEqual(r["streamed_bytes_per_pass"], sh["offloaded_bytes"])
                self.assertTrue(r["budget_held"], r)
                if r["method"] == "epmem_staged":
                    self.assertEqual(r["bypassed_page_ins"], 0)
                else:
                    self.assertEqual(r["staged_page_ins"], 0)
        self.assertIn("| b1 | 50% | epmem |", p.stdout)
        self.assertIn("target quick 50% decode", p.stdout)

    def test_bench_torch_cells(self):
        """scripts/bench_torch.py --cells: one process per budget, each cell's
        JSON holding its budget's rows only, merged into one result with every
        budget's rows; --cells without --json is refused."""
        script = os.path.join(ROOT, "scripts", "bench_torch.py")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "cells.json")
            with open(os.path.join(d, "cells-quick-75.json"), "w") as f:
                json.dump({"partial": True}, f)  # an earlier run's cell, replaced by this run's
            p = subprocess.run([sys.executable, script, "--quick", "--cells", "--budgets", "25,75", "--methods",
                                "epmem,uva", "--json", out], capture_output=True, text=True, env=env, timeout=600)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertIn("tokens identical in every row", p.stdout)
            with open(out) as f:
                res = json.load(f)
            self.assertEqual(res["cells"], ["cells-quick-25.json", "cells-quick-75.json"])
            self.assertEqual(len(res["runs"]), 2)
            self.assertEqual([r["budgets"] for r in res["runs"]], [[25], [75]])
            rows = res["shapes"][0]["rows"]
            self.assertEqual({(r["method"], r["budget_pct"]) for r in rows},
                             {(m, b) for m in ("epmem", "uva") for b in (25, 75)})
            self.assertTrue(all(r["tokens_identical"] for r in rows))
            for pct in (25, 75):
                with open(os.path.join(d, f"cells-quick-{pct}.json")) as f:
                    cell = json.load(f)
                self.assertEqual({r["budget_pct"] for r in cell["shapes"][0]["rows"]}, {pct})
            # A run whose cells all fail does not merge the last run's cells.
            p = subprocess.run([sys.executable, script, "--quick", "--cells", "--budgets", "25,75", "--methods",
                                "no-such-method", "--json", out], capture_output=True, text=True, env=env,
                               timeout=300)
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("no cell completed", p.stderr)
            self.assertFalse(os.path.exists(os.path.join(d, "cells-quick-25.json")))
        p = subprocess.run([sys.executable, script, "--quick", "--cells"], capture_output=True, text=True,
                           env=env, timeout=300)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("--cells needs --json", p.stderr)

    def test_bench_torch_cells_forward_every_option(self):
        """--cells hands each cell every option it was given but the ones it sets
        per cell, so a flag added to bench_torch later reaches the cells too."""
        sys.path.insert(0, os.path.join(ROOT, "scripts"))
        try:
            import bench_torch as bt
        finally:
            sys.path.pop(0)
        ap = bt.parser()
        argv, given = ["--cells", "--json", "x.json"], {}
        for act in ap._actions:
            flag = next((o for o in act.option_strings if o.startswith("--")), None)
            if flag is None or flag in bt.CELL_OWN:
                continue
            if act.nargs == 0:
                argv.append(flag)
                given[act.dest] = not act.default
            else:
                v = "7" if act.type is int else "a,b"
                argv += [flag, v]
                given[act.dest] = int(v) if act.type is int else v
        self.assertGreaterEqual(len(given), 9)  # the bench's own options, not an empty loop
        words = bt.forwarded(ap.parse_args(argv), ap)
        self.assertFalse(set(words) & bt.CELL_OWN)
        cell = ap.parse_args(words)
        self.assertEqual({k: getattr(cell, k) for k in given}, given)

    def check_merge(self, d, res, env):
        """scripts/bench_torch_merge.py: runs split by budget merge back into the same
        rows, and runs whose all-resident tokens differ are refused."""
        merge = os.path.join(ROOT, "scripts", "bench_torch_merge.py")
        parts = []
        for i, pct in enumerate(sorted({r["budget_pct"] for r in res["shapes"][0]["rows"]})):
            part = json.loads(json.dumps(res))
            part["shapes"][0]["rows"] = [r for r in part["shapes"][0]["rows"] if r["budget_pct"] == pct]
            part["h2d_peak_bytes_per_s"] = res["h2d_peak_bytes_per_s"] * (1 + i)
            parts.append(os.path.join(d, f"part{pct}.json"))
            with open(parts[-1], "w") as f:
                json.dump(part, f)
        self.assertGreaterEqual(len(parts), 2)
        merged = os.path.join(d, "merged.json")
        p = subprocess.run([sys.executable, merge, *parts, "--json", merged], capture_output=True, text=True,
                           env=env, timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        with open(merged) as f:
            m = json.load(f)
        strip = lambda rows: [{k: v for k, v in r.items() if k != "h2d_peak_bytes_per_s"} for r in rows]  # noqa: E731
        self.assertEqual(strip(m["shapes"][0]["rows"]), res["shapes"][0]["rows"])
        self.assertEqual([r["h2d_peak_bytes_per_s"] for r in m["runs"]],
                         [res["h2d_peak_bytes_per_s"] * (1 + i) for i in range(len(parts))])
        # A merge merged again keeps its runs, and its rows keep their own runs' peaks.
        again = os.path.join(d, "again.json")
        p = subprocess.run([sys.executable, merge, merged, parts[0], "--json", again], capture_output=True,
                           text=True, env=env, timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        with open(again) as f:
            a2 = json.load(f)
        self.assertEqual(a2["runs"], m["runs"] + m["runs"][:1])
        n = len(m["shapes"][0]["rows"])
        self.assertEqual(a2["shapes"][0]["rows"][:n], m["shapes"][0]["rows"])
        with open(parts[1]) as f:
            bad = json.load(f)
        bad["shapes"][0]["resident"]["b1"]["tokens"][0][0] += 1
        with open(parts[1], "w") as f:
            json.dump(bad, f)
        p = subprocess.run([sys.executable, merge, *parts, "--json", merged], capture_output=True, text=True,
                           env=env, timeout=300)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("all-resident tokens differ", p.stdout + p.stderr)


@unittest.skipIf(torch is None, "torch is not installed")
class Tensors(unittest.TestCase):
    def setUp(self):
        self.dev = epmem.Device()

    def tearDown(self):
        self.dev.close()

    def read(self, ptr, n):
        out = bytearray(n)
        self.dev.memcpy_dtoh(out, ptr)
        return bytes(out)

    def test_arena_memory_as_tensor_without_copy(self):
        with epmem.Arena.create_device(self.dev, 64 * MiB) as arena:
            block = arena.block(4096)
            t = et.as_tensor(block.ptr, (16, 64), torch.bfloat16, self.dev, owner=block)
            self.assertEqual(t.data_ptr(), block.ptr)
            self.assertEqual(t.dtype, torch.bfloat16)
            self.assertEqual(t.device.type, "cuda" if self.dev.is_cuda else "cpu")
            t.fill_(1.5)
            if self.dev.is_cuda:
                torch.cuda.synchronize()
            want = torch.full((16, 64), 1.5, dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
            self.assertEqual(self.read(block.ptr, 2048), want)
            self.dev.memcpy_htod(block, bytes(range(256)) * 16)
            self.assertEqual(bytes(t.view(torch.uint8).cpu().flatten().tolist()[:256]), bytes(range(256)))
            e = et.empty(arena, (8, 8), torch.float32)
            e.copy_(torch.arange(64, dtype=torch.float32).view(8, 8))
            self.assertEqual(arena.stats()["live_allocations"], 2)
            del e
            import gc
            gc.collect()
            self.assertEqual(arena.stats()["live_allocations"], 1)
            del t
            block.close()

    def test_pinned_arena_tensor_is_host_memory(self):
        with epmem.Arena.create_pinned(self.dev, 32 * MiB, chunk_bytes=32 * MiB) as arena:
            t = et.empty(arena, (1024,), torch.float16)
            self.assertEqual(t.device.type, "cpu")
            t.fill_(2.0)
            self.assertEqual(float(t.sum()), 2048.0)

    def test_kv_sequence_as_tensor_in_its_layout(self):
        layers, heads, hd = 3, 2, 32
        layout = epmem.kv_layout_token_major(layers, heads, hd, 2)
        g = self.dev.info()["granularity"]
        with epmem.KvPool(self.dev, 32 * g) as kv, self.dev.stream() as s:
            seq = kv.seq(layout, 256)
            seq.prepare_append(10, s)
            s.synchronize()
            t = et.kv_seq_tensor(seq, torch.float16)
            self.assertEqual(tuple(t.shape), (10, layers, 2, heads, hd))
            info = seq.info()
            self.assertEqual(t.data_ptr(), info["base"])
            # token 7, layer 2, V, head 1 = 1..32
            t[7, 2, 1, 1] = torch.arange(1, hd + 1, dtype=torch.float16, device=t.device)
            if self.dev.is_cuda:
                torch.cuda.synchronize()
            off = (7 * layout.token_stride + 2 * layout.layer_stride + layout.kv_stride + layout.head_stride)
            got = self.read(info["base"] + off, hd * 2)
            self.assertEqual(got, torch.arange(1, hd + 1, dtype=torch.float16).numpy().tobytes())
            self.assertEqual(float(t.float().sum()), float(sum(range(1, hd + 1))))
            with self.assertRaises(ValueError):
                et.kv_seq_tensor(seq, torch.float32)
            with self.assertRaises(ValueError):
                et.kv_seq_tensor(seq, torch.float16, tokens=257)
            del t
            seq.close()


if __name__ == "__main__":
    unittest.main()
