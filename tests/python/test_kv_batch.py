"""epmem.KvBatch / KvSlot and epmem.torch.kv_batch_tensor (docs/KV.md, "Batches").

Runs on whatever EPM_DEVICE opens (host in CI, cuda on the GPU machine).
"""

import ctypes
import os
import sys
import unittest

try:
    import torch
except ImportError:  # the torch tests below skip themselves
    torch = None

import epmem

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# 8 KiB per token: 256 tokens per 2 MiB granule, so a few hundred tokens
# cross granules (a shared prefix's boundary granule is then copied on write).
LAYERS, HEADS, DIM, ELEM = 4, 4, 128, 2
MAX_TOKENS, MAX_SLOTS = 1024, 8


class _BatchCase(unittest.TestCase):
    def setUp(self):
        self.dev = epmem.Device()
        self.g = self.dev.info()["granularity"]
        self.layout = epmem.kv_layout_token_major(LAYERS, HEADS, DIM, ELEM)
        self.arena = epmem.KvPool(self.dev, 128 * self.g)
        self.stream = self.dev.stream()
        self.batch = self.arena.batch(self.layout, MAX_TOKENS, MAX_SLOTS)

    def tearDown(self):
        self.dev.synchronize()
        if not self.batch.closed:
            self.batch.close()
        self.stream.close()
        self.arena.close()
        self.dev.close()

    def release_all(self, slots):
        for s in slots:
            if not s.closed:
                s.release(self.stream)


class Binding(_BatchCase):
    def test_descriptor_and_slot_info(self):
        d = self.batch.desc()
        lay = self.layout
        self.assertEqual(d["base"] % self.g, 0)
        self.assertEqual(d["slot_stride"] % self.g, 0)
        self.assertGreaterEqual(d["slot_stride"], MAX_TOKENS * lay.token_stride)
        self.assertEqual(d["reserved_bytes"], MAX_SLOTS * d["slot_stride"])
        self.assertEqual((d["max_slots"], d["max_tokens"]), (MAX_SLOTS, MAX_TOKENS))
        self.assertEqual((d["layers"], d["kv_heads"], d["head_dim"], d["elem_bytes"]), (LAYERS, HEADS, DIM, ELEM))
        for n in ("token_stride", "layer_stride", "kv_stride", "head_stride"):
            self.assertEqual(d[n], getattr(lay, n), n)
        self.assertEqual(d["granule_bytes"], self.g)
        self.assertEqual(d["live_slots"], 0)
        a = self.batch.take_slot()
        b = self.batch.take_slot(5)
        c = self.batch.take_slot()  # the lowest free one
        self.assertEqual((a.slot, b.slot, c.slot), (0, 5, 1))
        self.assertEqual(self.batch.desc()["live_slots"], 3)
        for s in (a, b, c):
            info = s.slot_info()
            self.assertEqual(info["slot"], s.slot)
            self.assertEqual(info["max_slots"], MAX_SLOTS)
            self.assertEqual(info["base"], d["base"] + s.slot * d["slot_stride"])
            self.assertEqual(info["len_tokens"], 0)
            self.assertEqual(info["max_tokens"], MAX_TOKENS)
            # A slot is a sequence: the KvSeq view of it agrees.
            self.assertEqual(s.info()["base"], info["base"])
        b.prepare_append(300, self.stream)
        info = b.slot_info()
        self.assertEqual(info["len_tokens"], 300)
        self.assertEqual(info["committed_tokens"], 512)  # two whole granules of 256 tokens
        self.assertEqual(info["private_granules"], 2)
        b.release(self.stream)
        self.assertTrue(b.closed)
        self.assertEqual(self.batch.desc()["live_slots"], 2)
        self.assertEqual(self.batch.take_slot().slot, 2)  # 2 is the lowest free; 5 is free again too
        self.release_all([a, c])
        self.batch.close()
        self.assertTrue(self.batch.closed)

    def test_bytes_written_to_a_slot_are_at_its_window(self):
        d = self.batch.desc_struct()
        s3 = self.batch.take_slot(3)
        s3.prepare_append(10, self.stream)
        data = bytes(range(256)) * (d.token_stride // 256)
        self.dev.memcpy_htod(s3.slot_info()["base"] + 7 * d.token_stride, data)
        back = bytearray(len(data))
        self.dev.memcpy_dtoh(back, d.base + 3 * d.slot_stride + 7 * d.token_stride)
        self.assertEqual(bytes(back), data)
        zeros = bytearray(len(data))
        for other in (2, 4):  # neighbouring free slots still read the zeroed dummy
            self.dev.memcpy_dtoh(zeros, d.base + other * d.slot_stride + 7 * d.token_stride)
            self.assertEqual(bytes(zeros), bytes(len(data)))
        s3.release(self.stream)
        self.dev.memcpy_dtoh(back, d.base + 3 * d.slot_stride + 7 * d.token_stride)
        self.assertEqual(bytes(back), bytes(len(data)), "a released slot reads zeros again")

    def test_take_slot_for_tokens_shares_a_live_prefix(self):
        toks = list(range(1000, 1300))
        first, shared = self.batch.take_slot_for_tokens(toks, self.stream)
        self.assertEqual(shared, 0)
        first.prepare_append(len(toks), self.stream)
        pre = first.pin(len(toks), self.stream)
        owned = self.arena.stats()["owned_bytes"]
        second, shared2 = self.batch.take_slot_for_tokens(toks + [7, 8, 9], self.stream)
        self.assertEqual(shared2, 288)  # whole 16-token blocks of the 300
        self.assertEqual(second.slot_info()["len_tokens"], 288)
        self.assertEqual(second.slot_info()["shared_granules"], 2)
        self.assertEqual(self.arena.stats()["owned_bytes"], owned, "sharing charged bytes")
        third, shared3 = self.batch.take_slot_for_tokens([5] * 40, self.stream)
        self.assertEqual(shared3, 0)
        self.release_all([first, second, third])
        pre.unpin()

    def test_misuse_is_an_error_and_leaves_the_batch_usable(self):
        with self.assertRaises(epmem.InvalidArgument):
            self.batch.take_slot(MAX_SLOTS)
        with self.assertRaises(epmem.InvalidArgument):
            self.batch.take_slot(0, admit=7)
        slots = [self.batch.take_slot() for _ in range(MAX_SLOTS)]
        with self.assertRaises(epmem.InvalidState):
            self.batch.take_slot(2)
        with self.assertRaises(epmem.AllInUse):
            self.batch.take_slot()
        with self.assertRaises(epmem.InvalidState):
            self.batch.close()  # slots are taken
        self.assertFalse(self.batch.closed)
        self.assertEqual(self.batch.desc()["live_slots"], MAX_SLOTS)
        with self.assertRaises(epmem.InvalidArgument):
            slots[0].prepare_append(MAX_TOKENS + 1, self.stream)
        plain = self.arena.seq(self.layout, 64)
        with self.assertRaises(epmem.InvalidArgument):
            self.batch.release_slot(plain, self.stream)
        with self.assertRaises(epmem.InvalidArgument):
            info = epmem._lib.new(epmem._lib.EpmKvBatchSlotInfo)
            epmem.lib().epm_kv_batch_slot_get_info(plain.handle, ctypes.byref(info))
        with self.assertRaises(epmem.InvalidArgument):
            epmem.lib().epm_kv_batch_release_slot(plain.handle, self.stream.handle)
        plain.close()
        other = epmem.KvPool(self.dev, 16 * self.g)
        try:
            b2 = other.batch(self.layout, 64, 2)
            with self.assertRaises(epmem.InvalidArgument):
                b2.release_slot(slots[1], self.stream)
            b2.close()
        finally:
            other.close()
        slots[1].release(self.stream)
        with self.assertRaises(epmem.InvalidHandle):
            slots[1].slot_info()  # released: the object is closed
        with self.assertRaises(epmem.InvalidHandle):
            slots[1].release(self.stream)
        slots[2].close()  # epm_kv_seq_destroy also gives the slot back (no wait)
        self.assertEqual(self.batch.desc()["live_slots"], MAX_SLOTS - 2)
        with self.assertRaises(epmem.InvalidArgument):
            self.arena.batch(self.layout, 0, 4)
        with self.assertRaises(epmem.InvalidArgument):
            self.arena.batch(self.layout, 64, 0)
        with self.assertRaises(epmem.InvalidArgument):
            self.arena.batch(self.layout, 64, epmem.EPM_KV_BATCH_ANY_SLOT)
        self.release_all(slots)
        self.assertEqual(self.arena.stats()["sequences"], 0)
        self.batch.close()


@unittest.skipIf(torch is None, "torch is not installed")
class BatchTensor(_BatchCase):
    def tokens(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, LAYERS, 2, HEADS, DIM, generator=g).to(torch.bfloat16)

    def write(self, view, slot, start, data):
        """Append `data` to `slot` through the batch view (prepare_append first)."""
        slot.prepare_append(data.shape[0], self.stream)
        # A copy-on-write of a shared boundary granule is queued on
        # self.stream; torch writes from another stream (or, on the host
        # device, from this thread now), so wait for it first.
        self.stream.synchronize()
        view[slot.slot, start:start + data.shape[0]].copy_(data.to(view.device))

    def sync(self):
        self.stream.synchronize()
        if self.dev.is_cuda:
            torch.cuda.synchronize()

    def test_view_shape_strides_and_aliasing(self):
        import epmem.torch as et
        view = et.kv_batch_tensor(self.batch, torch.bfloat16)
        d = self.batch.desc_struct()
        self.assertEqual(tuple(view.shape), (MAX_SLOTS, MAX_TOKENS, LAYERS, 2, HEADS, DIM))
        self.assertEqual(view.stride(), tuple(s // ELEM for s in (
            d.slot_stride, d.token_stride, d.layer_stride, d.kv_stride, d.head_stride, ELEM)))
        self.assertEqual(view.data_ptr(), d.base)
        self.assertEqual(view.device.type, "cuda" if self.dev.is_cuda else "cpu")
        self.assertEqual(view.dtype, torch.bfloat16)
        self.assertTrue(bool((view == 0).all()), "a new batch reads zeros everywhere")
        with self.assertRaises(ValueError):
            et.kv_batch_tensor(self.batch, torch.float32)
        s2 = self.batch.take_slot(2)
        self.assertEqual(view[2].data_ptr(), s2.slot_info()["base"])
        data = self.tokens(300, 1)
        self.write(view, s2, 0, data)
        self.sync()
        self.assertTrue(torch.equal(view[2, :300].cpu(), data))
        # The slot's own sequence tensor is the same memory.
        own = et.kv_seq_tensor(s2, torch.bfloat16)
        self.assertEqual(own.data_ptr(), view[2].data_ptr())
        self.assertTrue(torch.equal(own.cpu(), data))
        # Element (slot 2, token 123, layer 3, V, head 1) is where the descriptor says.
        off = 2 * d.slot_stride + 123 * d.token_stride + 3 * d.layer_stride + d.kv_stride + d.head_stride
        raw = bytearray(DIM * ELEM)
        self.dev.memcpy_dtoh(raw, d.base + off)
        self.assertEqual(bytes(raw), data[123, 3, 1, 1].view(torch.int16).numpy().tobytes())
        others = [s for s in range(MAX_SLOTS) if s != 2]
        self.assertTrue(bool((view[others] == 0).all()), "other slots still read zeros")
        s2.release(self.stream)
        self.sync()
        self.assertTrue(bool((view[2] == 0).all()), "a released slot reads zeros")

    def test_shared_prefix_reads_back_in_every_sharer(self):
        import epmem.torch as et
        view = et.kv_batch_tensor(self.batch, torch.bfloat16)
        P = 300  # crosses the first granule: the boundary granule is shared, then copied on write
        origin = self.batch.take_slot()
        prompt = self.tokens(P, 2)
        self.write(view, origin, 0, prompt)
        pre = origin.pin(P, self.stream)
        self.sync()
        owned = self.arena.stats()["owned_bytes"]
        sharers = [self.batch.take_shared_slot(pre, P, self.stream, admit=epmem.EPM_KV_ADMIT_ON_DEMAND)
                   for _ in range(4)]
        self.assertEqual(self.arena.stats()["owned_bytes"], owned, "four sharers charged bytes")
        for s in sharers:
            self.assertEqual(s.slot_info()["len_tokens"], P)
            self.assertTrue(torch.equal(view[s.slot, :P].cpu(), prompt), f"slot {s.slot}")
        # Two sharers diverge by appending (copy-on-write of the boundary granule).
        tails = {}
        for i, s in enumerate(sharers[:2]):
            tails[s.slot] = self.tokens(20 + i, 10 + i)
            self.write(view, s, P, tails[s.slot])
        self.sync()
        for s in [origin] + sharers:
            self.assertTrue(torch.equal(view[s.slot, :P].cpu(), prompt), f"slot {s.slot} prefix after divergence")
        for slot, t in tails.items():
            self.assertTrue(torch.equal(view[slot, P:P + t.shape[0]].cpu(), t))
        # The origin leaves; the pinned prompt lives on in every sharer.
        origin.release(self.stream)
        self.sync()
        self.assertTrue(bool((view[origin.slot] == 0).all()))
        for s in sharers:
            self.assertTrue(torch.equal(view[s.slot, :P].cpu(), prompt))
        self.release_all(sharers)
        pre.unpin()

    def test_release_and_join_keep_every_address(self):
        import epmem.torch as et
        view = et.kv_batch_tensor(self.batch, torch.bfloat16)
        base = view.data_ptr()
        slots, data = [], {}
        for i, n in enumerate((40, 256, 257, 600, 3)):
            s = self.batch.take_slot()
            data[s.slot] = self.tokens(n, 20 + i)
            self.write(view, s, 0, data[s.slot])
            slots.append(s)
        bases = {s.slot: s.slot_info()["base"] for s in slots}
        self.sync()
        leaving = slots.pop(1)
        leaving.release(self.stream)
        del data[1]
        self.sync()
        self.assertTrue(bool((view[1] == 0).all()))
        joined = self.batch.take_slot()
        self.assertEqual(joined.slot, 1)  # the lowest free slot, at the same address
        self.assertEqual(joined.slot_info()["base"], bases[1])
        data[1] = self.tokens(77, 30)
        self.write(view, joined, 0, data[1])
        slots.append(joined)
        # Another appends across a granule edge while the others stay put.
        more = self.tokens(100, 31)
        self.write(view, slots[0], 40, more)
        data[slots[0].slot] = torch.cat([data[slots[0].slot], more])
        self.sync()
        self.assertEqual(view.data_ptr(), base)
        for s in slots:
            self.assertEqual(s.slot_info()["base"], bases[s.slot])
            n = data[s.slot].shape[0]
            self.assertEqual(s.slot_info()["len_tokens"], n)
            self.assertTrue(torch.equal(view[s.slot, :n].cpu(), data[s.slot]), f"slot {s.slot}")
        self.release_all(slots)


def _script_env():
    env = dict(os.environ)
    import epmem as pkg
    # The same package and library these tests use (installed wheel or python/).
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(pkg.__file__))] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["EPMEM_LIB"] = pkg.get_library_path()
    return env


@unittest.skipIf(torch is None, "torch is not installed")
class GpuScripts(unittest.TestCase):
    """tests/gpu/kv_batch_attention.py and scripts/bench_kv_batch.py run their
    CUDA parts only on the GPU machine (scripts/gpu-check.sh steps
    py-kv_batch_attention, py-bench_kv_batch); here their logic runs on the
    host device."""

    def test_kv_batch_attention_checks_pass_on_the_host_device(self):
        import importlib.util
        spec = importlib.util.spec_from_file_location("kv_batch_attention",
                                                      os.path.join(ROOT, "tests", "gpu", "kv_batch_attention.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        results = []
        with epmem.Device("host") as dev:
            # 5 steps: appends across granules, two leave, two join, the origin leaves.
            mod.run(dev, lambda name, ok, detail="": results.append((name, bool(ok), detail)),
                    log=lambda m: None, graph_steps=5)
        failed = [r for r in results if not r[1]]
        self.assertEqual(failed, [])
        self.assertGreaterEqual(len(results), 15)
        names = " | ".join(r[0] for r in results)
        for what in ("batched SDPA over the batch view == over the plain tensor", "eager step 4",
                     "the ledger charges the prompt once", "teardown returns every granule"):
            self.assertIn(what, names)

    def test_scripts_answer_help_and_the_bench_dry_run_passes(self):
        import subprocess
        env = _script_env()
        for script in ("tests/gpu/kv_batch_attention.py", "scripts/bench_kv_batch.py"):
            r = subprocess.run([sys.executable, os.path.join(ROOT, script), "--help"], env=env,
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, f"{script}: {r.stderr}")
            self.assertIn("usage:", r.stdout, script)
        r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_kv_batch.py"), "--dry-run"],
                           env=env, capture_output=True, text=True, timeout=300)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("dry run 4x512 on the host device: ok", r.stdout)


if __name__ == "__main__":
    unittest.main()
