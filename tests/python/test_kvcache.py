"""epmem.kvcache: a transformers LlamaForCausalLM decoding from KV caches that live in
epmem sequences. A tiny model from a LlamaConfig (fixed seed, no download) whose
token stride (16 KiB) makes a 320-token system prompt span three 2 MiB granules.
Runs on the host device in CI (CPU torch) and on CUDA from gpu-check.sh (step
python, EPM_DEVICE=cuda). Skipped where transformers is not installed.

Every comparison is with transformers' own DynamicCache run on the same schedule
(the system prompt prefilled in one forward, then the request's own prompt, then
one token per forward): the caches differ, the arithmetic does not."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

try:
    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
except ImportError:
    torch = None

import epmem

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if torch is not None:
    import epmem.kvcache as ek

SYS_TOKENS = 320        # 2.5 granules at 16 KiB/token: two full shared granules + the boundary one
STEPS = 12
OWN = ([11, 12, 13, 14, 15], [21, 22, 23, 24, 25, 26, 27], [31, 32, 33, 34, 35, 36, 37, 38, 39])


def tdev():
    return torch.device("cuda", 0) if os.environ.get("EPM_DEVICE") == "cuda" else torch.device("cpu")


def dtype():
    # bf16 as on a GPU; float32 on the CPU, where bf16 matmuls are slow. The KV heads
    # differ so that a token is 16 KiB either way.
    return torch.bfloat16 if tdev().type == "cuda" else torch.float32


def make_model():
    torch.manual_seed(20261201)
    # initializer_range 0.3: at the default 0.02 a random tiny model repeats one token.
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4 if dtype() == torch.bfloat16 else 2,
                      head_dim=256, max_position_embeddings=1024, initializer_range=0.3,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=None, bos_token_id=1)
    with torch.device(tdev()):
        m = LlamaForCausalLM(cfg)
    return m.to(dtype()).eval()


def system_prompt():
    g = torch.Generator().manual_seed(7)
    return [1] + torch.randint(2, 128, (SYS_TOKENS - 1,), generator=g).tolist()


def reference(model, sys_toks, prompt, shared=None):
    """transformers' DynamicCache: prefill sys_toks, keep the first `shared` of them
    (default all), then the rest of `prompt`, then STEPS tokens one forward each."""
    shared = len(sys_toks) if shared is None else shared
    dc = DynamicCache(config=model.config)
    ek.forward(model, dc, sys_toks)
    if shared < len(sys_toks):
        dc.crop(shared - len(sys_toks))  # negative: remove that many tokens (5.17 semantics)
    d = ek.Decode(model, dc, prompt[shared:])
    for _ in range(STEPS):
        d.step()
    return d.tokens


def run_interleaved(decodes, steps=STEPS, before_step=None):
    """Prefill each, then one token of every request per round (neighbours interleaved)."""
    for d in decodes:
        d.prefill()
    for i in range(steps):
        if before_step is not None:
            before_step(i)
        for d in decodes:
            if not getattr(d, "stopped", False):
                d.step()


@unittest.skipIf(torch is None, "transformers (or torch) is not installed")
class KvCacheLlama(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = make_model()
        cls.sys = system_prompt()
        cls.prompts = [cls.sys + own for own in OWN]
        cls.ref = [reference(cls.model, cls.sys, p) for p in cls.prompts]
        # The references must be worth comparing with: not one repeated token.
        for r in cls.ref:
            assert len(set(r)) > 1, r

    def setUp(self):
        self.store = ek.KvStore(self.model.config, 64 << 20, max_tokens=512, dtype=dtype())
        self.G = self.store.stats()["granule_bytes"]
        self.assertEqual(self.store.token_bytes, 16 << 10)

    def tearDown(self):
        self.store.close()

    def owned(self):
        return self.store.stats()["owned_bytes"]

    def prefix_granules(self):
        return -(-SYS_TOKENS * self.store.token_bytes // self.G)

    def test_explicit_prefix_tokens_identical_one_physical_copy(self):
        before = self.owned()
        pre = self.store.prefill_shared(self.model, self.sys)
        self.assertEqual(pre.info()["granules"], self.prefix_granules())
        self.assertEqual(self.owned() - before, self.prefix_granules() * self.G)
        cow0 = self.store.stats()["cow_granules"]
        caches = [self.store.request_from_prefix(pre, tokens=p) for p in self.prompts]
        for c in caches:
            self.assertEqual(c.get_seq_length(), SYS_TOKENS)
            self.assertEqual(c.info()["shared_granules"], self.prefix_granules())
        # Sharing costs nothing until a request writes: then only its boundary granule.
        self.assertEqual(self.owned() - before, self.prefix_granules() * self.G)
        decodes = [ek.Decode(self.model, c, p[SYS_TOKENS:]) for c, p in zip(caches, self.prompts)]
        run_interleaved(decodes)
        for d, r in zip(decodes, self.ref):
            self.assertEqual(d.tokens, r)
        st = self.store.stats()
        n = len(caches)
        # Each request wrote < 1 granule past the prefix, all inside the boundary granule:
        # it owns exactly the copy of that granule; the prefix is owned once.
        self.assertEqual(st["cow_granules"] - cow0, n)
        self.assertEqual(st["owned_bytes"] - before, (self.prefix_granules() + n) * self.G)
        private_copies = n * -(-(SYS_TOKENS + 9 + STEPS) * self.store.token_bytes // self.G) * self.G
        self.assertLess(st["owned_bytes"] - before, private_copies)
        for c in caches:
            i = c.info()
            self.assertEqual((i["shared_granules"], i["private_granules"]), (self.prefix_granules() - 1, 1))
            c.close()
        pre.origin.close()
        pre.unpin()
        self.assertEqual(self.owned(), before)

    def test_content_hash_detection(self):
        pre = self.store.prefill_shared(self.model, self.sys)
        hits = self.store.stats()["hash_hits"]
        owned = self.owned()
        caches = [self.store.request_for_tokens(p) for p in self.prompts]
        self.assertEqual([c.shared_tokens for c in caches], [SYS_TOKENS] * 3)
        self.assertEqual(self.store.stats()["hash_hits"] - hits, 3)
        self.assertEqual(self.owned(), owned)
        decodes = [ek.Decode(self.model, c, p[c.shared_tokens:]) for c, p in zip(caches, self.prompts)]
        run_interleaved(decodes)
        self.assertEqual([d.tokens for d in decodes], self.ref)
        self.assertEqual(self.owned() - owned, 3 * self.G)
        for c in caches:
            c.close()
        pre.origin.close()
        pre.unpin()

    def test_generate_through_the_cache(self):
        """model.generate() with an EpmCache that already holds the shared prompt."""
        pre = self.store.prefill_shared(self.model, self.sys)
        c = self.store.request_from_prefix(pre, tokens=self.prompts[0])
        ids = torch.tensor([self.prompts[0]], device=tdev())
        g = self.model.generate(ids, **ek.cache_kwargs(self.model, c), max_new_tokens=STEPS, min_new_tokens=STEPS,
                                do_sample=False, pad_token_id=0)
        self.assertEqual(g[0, len(self.prompts[0]):].tolist(), self.ref[0])
        c.close()
        pre.origin.close()
        pre.unpin()

    def test_request_longer_than_its_reservation(self):
        pre = self.store.prefill_shared(self.model, self.sys)
        short_max = len(self.prompts[1]) + 4
        short = self.store.request_from_prefix(pre, tokens=self.prompts[1], max_tokens=short_max)
        decodes = [ek.Decode(self.model, self.store.request_from_prefix(pre, tokens=p), p[SYS_TOKENS:])
                   for p in (self.prompts[0], self.prompts[2])]
        bad = ek.Decode(self.model, short, self.prompts[1][SYS_TOKENS:])
        bad.prefill()
        errs = []

        def bad_step(_i):
            if bad.tokens and len(bad.tokens) >= 4 and not errs:
                st, length = self.store.stats(), short.get_seq_length()
                with self.assertRaises(ek.ReservationExceeded) as cm:
                    bad.step()
                errs.append(str(cm.exception))
                # Nothing changed: the length, the ledger, and the tokens so far.
                self.assertEqual(short.get_seq_length(), length)
                self.assertEqual(short.info()["len_tokens"], short_max)
                after = self.store.stats()
                for k in ("owned_bytes", "promised_bytes", "refusals", "cow_granules", "committed_granules"):
                    self.assertEqual(after[k], st[k], k)
            elif not errs:
                bad.step()

        run_interleaved(decodes, before_step=bad_step)
        self.assertEqual(len(errs), 1)
        self.assertIn(f"holds {short_max} (max_tokens)", errs[0])
        self.assertEqual(bad.tokens, self.ref[1][:4])
        self.assertEqual([d.tokens for d in decodes], [self.ref[0], self.ref[2]])
        # The library refuses it too, without the Python check (the backstop).
        with self.assertRaises(epmem.InvalidArgument):
            short.seq.prepare_append(1, self.store.streams.private)
        for c in (short, *[d.cache for d in decodes]):
            c.close()
        pre.origin.close()
        pre.unpin()

    def test_prompt_diverging_inside_the_shared_prefix(self):
        pre = self.store.prefill_shared(self.model, self.sys)
        div = self.sys[:100] + [(self.sys[100] + 1) % 128 or 2] + [41, 42, 43]
        n_seq = self.store.stats()["sequences"]
        with self.assertRaises(ek.PrefixMismatch) as cm:
            self.store.request_from_prefix(pre, tokens=div)
        self.assertIn("at token 100", str(cm.exception))
        self.assertEqual(self.store.stats()["sequences"], n_seq)  # nothing created
        # By content: the matching whole 16-token blocks are shared, the rest prefilled
        # into a copy of granule 0 (the shared one is never written).
        by_hash = self.store.request_for_tokens(div)
        self.assertEqual(by_hash.shared_tokens, 96)
        # Explicitly, asking for the 100 tokens that match (not block-aligned).
        explicit = self.store.request_from_prefix(pre, tokens=div, n_tokens=100)
        self.assertEqual(explicit.get_seq_length(), 100)
        neighbour = self.store.request_from_prefix(pre, tokens=self.prompts[0])
        decodes = [ek.Decode(self.model, by_hash, div[96:]), ek.Decode(self.model, explicit, div[100:]),
                   ek.Decode(self.model, neighbour, self.prompts[0][SYS_TOKENS:])]
        run_interleaved(decodes)
        self.assertEqual(decodes[0].tokens, reference(self.model, self.sys, div, shared=96))
        self.assertEqual(decodes[1].tokens, reference(self.model, self.sys, div, shared=100))
        self.assertEqual(decodes[2].tokens, self.ref[0])
        # The prefix itself is intact: a request started from it now still decodes the same.
        late = self.store.request_for_tokens(self.prompts[2])
        self.assertEqual(late.shared_tokens, SYS_TOKENS)
        self.assertEqual(ek.greedy(self.model, late, self.prompts[2][SYS_TOKENS:], STEPS), self.ref[2])
        for c in (by_hash, explicit, neighbour, late):
            c.close()
        pre.origin.close()
        pre.unpin()

    def test_request_ends_while_others_share_its_prefix(self):
        before = self.owned()
        pre = self.store.prefill_shared(self.model, self.sys)
        caches = [self.store.request_from_prefix(pre, tokens=p) for p in self.prompts]
        decodes = [ek.Decode(self.model, c, p[SYS_TOKENS:]) for c, p in zip(caches, self.prompts)]

        def events(i):
            if i == 3:
                pre.origin.close()              # the request the prefix was pinned from ends
            if i == 5:
                decodes[1].cache.close()        # a sharer ends mid-decode
                decodes[1].stopped = True
                with self.assertRaises(ek.RequestClosed):
                    decodes[1].step()
            if i == 7:
                pre.unpin()                     # the pin ends; the sharers keep the prefix alive
                with self.assertRaises(epmem.InvalidHandle):
                    self.store.request_from_prefix(pre)

        run_interleaved(decodes, before_step=events)
        self.assertEqual(decodes[0].tokens, self.ref[0])
        self.assertEqual(decodes[2].tokens, self.ref[2])
        self.assertEqual(decodes[1].tokens, self.ref[1][:5])
        self.assertEqual(self.store.stats()["prefixes"], 1)      # alive through its sharers
        caches[0].close()
        caches[2].close()
        self.assertEqual(self.store.stats()["prefixes"], 0)      # freed with the last sharer
        self.assertEqual(self.owned(), before)
        fresh = self.store.request_for_tokens(self.prompts[0])
        self.assertEqual(fresh.shared_tokens, 0)
        fresh.close()

    def test_views_alias_the_sequence_and_hold_dynamiccache_bytes(self):
        """No copy: each layer's keys/values are views at the sequence's own addresses,
        and the bytes there are exactly what DynamicCache holds."""
        pre = self.store.prefill_shared(self.model, self.sys)
        c = self.store.request_for_tokens(self.prompts[0])
        ek.greedy(self.model, c, self.prompts[0][SYS_TOKENS:], 3)
        dc = DynamicCache(config=self.model.config)
        ek.forward(self.model, dc, self.sys)
        ek.greedy(self.model, dc, self.prompts[0][SYS_TOKENS:], 3)
        i = c.info()
        n = c.get_seq_length()
        self.assertEqual(n, dc.get_seq_length())
        self.assertEqual(i["len_tokens"], n)
        esz = i["elem_bytes"]
        for l, (lay, ref) in enumerate(zip(c.layers, dc.layers)):
            k, v = lay.keys, lay.values
            self.assertEqual(k.data_ptr(), i["base"] + l * i["layer_stride"])
            self.assertEqual(v.data_ptr(), i["base"] + l * i["layer_stride"] + i["kv_stride"])
            self.assertEqual(k.stride(2) * esz, i["token_stride"])
            self.assertEqual(k.stride(1) * esz, i["head_stride"])
            self.assertTrue(torch.equal(k, ref.keys), l)
            self.assertTrue(torch.equal(v, ref.values), l)
        c.close()
        pre.origin.close()
        pre.unpin()

    def test_eager_attention_reads_the_views_too(self):
        self.model.set_attn_implementation("eager")
        try:
            ref = reference(self.model, self.sys, self.prompts[1])
            pre = self.store.prefill_shared(self.model, self.sys)
            c = self.store.request_from_prefix(pre, tokens=self.prompts[1])
            self.assertEqual(ek.greedy(self.model, c, self.prompts[1][SYS_TOKENS:], STEPS), ref)
            c.close()
            pre.origin.close()
            pre.unpin()
        finally:
            self.model.set_attn_implementation("sdpa")

    @unittest.skipIf(os.environ.get("EPM_DEVICE") != "cuda", "a torch CUDA stream: CUDA only")
    def test_on_a_non_default_torch_stream(self):
        """prepare_append on an adopted torch stream (a non-default one; the default one is adopted as CU_STREAM_LEGACY)."""
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            pre = self.store.prefill_shared(self.model, self.sys)
            caches = [self.store.request_from_prefix(pre, tokens=p) for p in self.prompts]
            decodes = [ek.Decode(self.model, c, p[SYS_TOKENS:]) for c, p in zip(caches, self.prompts)]
            run_interleaved(decodes)
        self.assertEqual([d.tokens for d in decodes], self.ref)
        self.assertGreaterEqual(len(self.store.streams.wrapped), 1)
        for c in caches:
            c.close()
        pre.origin.close()
        pre.unpin()

    def test_misuse(self):
        c = self.store.request()
        with self.assertRaises(ek.KvCacheError), torch.no_grad():   # batch 2 in a one-request cache
            self.model(torch.tensor([[1, 2], [3, 4]], device=tdev()), use_cache=True, **ek.cache_kwargs(self.model, c))
        self.assertEqual(c.get_seq_length(), 0)
        with self.assertRaises(ek.KvCacheError):
            c.reset()
        c.close()
        c.close()                                     # a second close is a no-op
        with self.assertRaises(ek.RequestClosed):
            ek.forward(self.model, c, [1, 2])


@unittest.skipIf(torch is None, "transformers (or torch) is not installed")
class Streams(unittest.TestCase):
    def test_adopted_streams_are_bounded_and_no_private_stream_on_cuda(self):
        """_Streams on a CUDA device (stand-ins for the device and the adoption): one
        adoption per torch stream, the cache starts over past its limit (closing what
        it drops), and no stream of its own is made."""
        closed = []

        class Adopted:
            def __init__(self, native):
                self.native = native

            def close(self):
                closed.append(self.native)

        class CudaDev:
            is_cuda, ordinal = True, 0

        import epmem.torch as et
        orig = ek.current_native_stream, et.adopt_stream
        current = [0]
        ek.current_native_stream = lambda tdev: current[0]
        et.adopt_stream = lambda dev, tdev, native: Adopted(native)
        try:
            st = ek._Streams(CudaDev())
            limit = st.wrapped.limit
            for i in range(3 * limit):
                current[0] = i % (2 * limit)
                self.assertEqual(st.run(lambda s: s.native), current[0])
                self.assertEqual(st.run(lambda s: s.native), current[0])  # the cached adoption
                self.assertLessEqual(len(st.wrapped), limit)
            self.assertEqual(len(closed) + len(st.wrapped), 3 * limit)
            self.assertIsNone(st._private)
        finally:
            ek.current_native_stream, et.adopt_stream = orig


@unittest.skipIf(torch is None, "transformers (or torch) is not installed")
class BenchSmoke(unittest.TestCase):
    def test_bench_kvcache_quick(self):
        """scripts/bench_kvcache.py --quick: identical tokens in every row, sharing owns
        less than private copies, capacity measured equals epm_kv_admissible."""
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "bench.json")
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
            p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_kvcache.py"), "--quick",
                                "--json", out], capture_output=True, text=True, env=env, timeout=600)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            with open(out) as f:
                res = json.load(f)
        self.assertIn("tokens identical in every eager row", p.stdout)
        dyn, shared, private = res["rows"]
        self.assertEqual([r["attention"] for r in res["rows"]], ["eager"] * 3)
        self.assertEqual([(r["method"], r["attention"]) for r in res["sdpa_rows"]],
                         [("dynamic", "sdpa"), ("epmem shared", "sdpa")])
        self.assertEqual([r["method"] for r in res["rows"]], ["dynamic", "epmem shared", "epmem private"])
        self.assertTrue(all(r["tokens_identical"] for r in res["rows"]))
        self.assertEqual(len(dyn["tokens"]), res["requests"])
        self.assertEqual(sorted(set(shared["modes"])), ["content-hash", "explicit"])
        G = shared["granule_bytes"]
        # One prefix copy plus one boundary copy per request, against N full copies.
        self.assertEqual(shared["owned_bytes"], (shared["prefix_granules"] + res["requests"]) * G)
        self.assertEqual(shared["cow_granules"], res["requests"])
        self.assertGreater(private["owned_bytes"], shared["owned_bytes"])
        cap = res["capacity"]
        for k in ("shared", "private"):
            self.assertEqual(cap[k]["admitted"], cap[k]["admissible"], k)
            self.assertIn("budget", cap[k]["refusal"].lower())
        self.assertGreater(cap["shared"]["admitted"], cap["private"]["admitted"])


if __name__ == "__main__":
    unittest.main()
