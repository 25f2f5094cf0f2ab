"""KV sharing namespaces (per-tenant cache salts, docs/KV.md "Namespaces") through
the Python binding and epmem.kvcache: identical prompts in two namespaces share
nothing (the ledger's owned bytes and the driver's physical handles both grow by a
private copy), one namespace shares as the unsalted calls do, bad namespaces are
refused with a message. Runs on whatever EPM_DEVICE opens (host in CI)."""

import ctypes
import os
import unittest

try:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:  # the kvcache tests below skip themselves
    torch = None

import epmem
from epmem import _lib as L

LAYERS, HEADS, DIM, ELEM = 4, 4, 128, 2  # 8 KiB per token: 256 tokens per 2 MiB granule
PROMPT = list(range(1000, 1300))         # 300 tokens: 288 in whole 16-token blocks


class Binding(unittest.TestCase):
    def setUp(self):
        self.dev = epmem.Device()
        self.layout = epmem.kv_layout_token_major(LAYERS, HEADS, DIM, ELEM)
        self.g = self.dev.info()["granularity"]
        self.pool = epmem.KvPool(self.dev, 64 * self.g)
        self.stream = self.dev.stream()

    def tearDown(self):
        self.dev.synchronize()
        self.stream.close()
        self.pool.close()
        self.dev.close()

    def pinned(self, namespace):
        seq, shared = self.pool.seq_for_tokens(self.layout, 512, PROMPT, namespace=namespace)
        self.assertEqual(shared, 0)
        seq.prepare_append(len(PROMPT), self.stream)
        return seq, seq.pin(len(PROMPT), self.stream)

    def test_two_namespaces_share_nothing(self):
        origin, pre = self.pinned("tenant-a")
        st0 = self.pool.stats()
        self.assertEqual(self.pool.find_prefix(self.layout, PROMPT, namespace="tenant-b"), 0)
        self.assertEqual(self.pool.find_prefix(self.layout, PROMPT), 0, "the default namespace is a namespace too")
        b, shared = self.pool.seq_for_tokens(self.layout, 512, PROMPT, namespace=b"tenant-b")
        self.assertEqual(shared, 0)
        self.assertEqual(b.info()["shared_granules"], 0)
        b.prepare_append(len(PROMPT), self.stream)
        st1 = self.pool.stats()
        granules = -(-len(PROMPT) * self.layout.token_stride // self.g)
        self.assertEqual(st1["hash_hits"], st0["hash_hits"])
        self.assertEqual(st1["owned_bytes"] - st0["owned_bytes"], granules * self.g)
        self.assertEqual(st1["pool_created"] - st0["pool_created"], granules, "the driver agrees with the ledger")
        # The same namespace shares as before: no owned byte, no new handle.
        a2, shared = self.pool.seq_for_tokens(self.layout, 512, PROMPT + [7], namespace="tenant-a")
        self.assertEqual(shared, 288)
        st2 = self.pool.stats()
        self.assertEqual((st2["owned_bytes"], st2["pool_created"]), (st1["owned_bytes"], st1["pool_created"]))
        self.assertEqual(st2["hash_hits"], st1["hash_hits"] + 1)
        self.assertEqual(self.pool.find_prefix(self.layout, PROMPT, namespace="tenant-a"), 288)
        for s in (a2, b, origin):
            s.close()
        pre.unpin()

    def test_unsalted_calls_are_the_default_namespace(self):
        origin, pre = self.pinned(None)
        for same in (None, "", b""):
            self.assertEqual(self.pool.find_prefix(self.layout, PROMPT, namespace=same), 288)
        self.assertEqual(self.pool.find_prefix(self.layout, PROMPT, namespace="x"), 0)
        seq, shared = self.pool.seq_for_tokens(self.layout, 512, PROMPT)
        self.assertEqual(shared, 288)
        seq.close()
        origin.close()
        pre.unpin()

    def test_batch_slots(self):
        batch = self.pool.batch(self.layout, 512, 4)
        first, shared = batch.take_slot_for_tokens(PROMPT, self.stream, namespace="a")
        self.assertEqual(shared, 0)
        first.prepare_append(len(PROMPT), self.stream)
        pre = first.pin(len(PROMPT), self.stream)
        other, shared = batch.take_slot_for_tokens(PROMPT, self.stream, namespace="b")
        self.assertEqual(shared, 0)
        same, shared = batch.take_slot_for_tokens(PROMPT, self.stream, namespace="a")
        self.assertEqual(shared, 288)
        for s in (same, other, first):
            s.release(self.stream)
        pre.unpin()
        batch.close()

    def test_bad_namespaces_are_refused_with_a_message(self):
        longest = "x" * L.EPM_KV_NAMESPACE_MAX_BYTES
        self.assertEqual(self.pool.find_prefix(self.layout, PROMPT, namespace=longest), 0)
        with self.assertRaisesRegex(ValueError, "129 bytes exceeds the limit of 128"):
            self.pool.seq_for_tokens(self.layout, 512, PROMPT, namespace=longest + "x")
        with self.assertRaisesRegex(ValueError, "NUL byte at offset 3"):
            self.pool.find_prefix(self.layout, PROMPT, namespace="ten\0ant")
        with self.assertRaisesRegex(TypeError, "namespace must be a str, bytes or None, not int"):
            self.pool.seq_for_tokens(self.layout, 512, PROMPT, namespace=3)
        batch = self.pool.batch(self.layout, 512, 2)
        with self.assertRaisesRegex(ValueError, "NUL"):
            batch.take_slot_for_tokens(PROMPT, self.stream, namespace=b"\0")
        # The C layer refuses them too (a caller that bypasses the checks above).
        arr, n = (ctypes.c_uint32 * 4)(1, 2, 3, 4), 4
        out = ctypes.c_uint64(77)
        with self.assertRaises(epmem.errors.InvalidArgument) as cm:
            epmem.core._l().epm_kv_find_prefix_ns(self.pool.handle, ctypes.byref(self.layout), b"a\0b", 3, arr, n,
                                                   ctypes.byref(out))
        self.assertIn("NUL byte at offset 1", cm.exception.message)
        with self.assertRaises(epmem.errors.InvalidArgument) as cm:
            epmem.core._l().epm_kv_find_prefix_ns(self.pool.handle, ctypes.byref(self.layout), b"y" * 129, 129, arr, n,
                                                  ctypes.byref(out))
        self.assertIn("EPM_KV_NAMESPACE_MAX_BYTES (128)", cm.exception.message)
        self.assertEqual(out.value, 77)
        self.assertEqual(self.pool.stats()["sequences"], 0, "a refused call creates nothing")
        batch.close()


def _tdev():
    return torch.device("cuda", 0) if os.environ.get("EPM_DEVICE") == "cuda" else torch.device("cpu")


@unittest.skipIf(torch is None, "transformers (or torch) is not installed")
class KvCacheTenants(unittest.TestCase):
    """Two tenants send the same system prompt through epmem.kvcache."""

    @classmethod
    def setUpClass(cls):
        torch.manual_seed(11)
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          max_position_embeddings=512, initializer_range=0.3, pad_token_id=0,
                          eos_token_id=None, bos_token_id=1)
        with torch.device(_tdev()):
            cls.model = LlamaForCausalLM(cfg).to(torch.float32).eval()

    def test_tenants_share_only_their_own_prefixes(self):
        import epmem.kvcache as ek
        sys_prompt = [1] + [(7 * i) % 60 + 2 for i in range(63)]  # 4 whole blocks
        with ek.KvStore(self.model.config, 64 << 20, max_tokens=128, dtype=torch.float32) as store:
            pre = store.prefill_shared(self.model, sys_prompt, namespace="tenant-a")
            owned = store.stats()["owned_bytes"]
            hits = store.stats()["hash_hits"]
            b = store.request_for_tokens(sys_prompt + [5], namespace="tenant-b")
            self.assertEqual(b.shared_tokens, 0, "tenant B must not see tenant A's prompt")
            a = store.request_for_tokens(sys_prompt + [5], namespace="tenant-a")
            self.assertEqual(a.shared_tokens, 64)
            self.assertEqual(store.stats()["hash_hits"], hits + 1)
            self.assertEqual((a.info()["shared_granules"], b.info()["shared_granules"]), (1, 0))
            self.assertEqual(store.stats()["owned_bytes"], owned, "nothing written yet")
            # Both decode the same tokens; B prefills all of its prompt itself.
            ta = ek.greedy(self.model, a, (sys_prompt + [5])[a.shared_tokens:], steps=4)
            tb = ek.greedy(self.model, b, sys_prompt + [5], steps=4)
            self.assertEqual(ta, tb)
            self.assertEqual(b.info()["len_tokens"], 65 + 3)
            for c in (a, b, pre.origin):
                c.close()
            pre.unpin()


if __name__ == "__main__":
    unittest.main()
