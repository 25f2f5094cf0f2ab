"""epmem.torch.offload on a transformers LlamaForCausalLM (built from a config with a
fixed seed: no hub download). Skipped where transformers is not installed (CI);
runs on the GPU machine with EPM_DEVICE=cuda from scripts/gpu-check.sh."""

import os
import unittest

try:
    import torch
    import transformers  # noqa: F401
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:
    torch = None

if torch is not None:
    import epmem.torch as et

STEPS = 16


def make_llama(dev):
    return build_llama(dev, 20261201, vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                       num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                       max_position_embeddings=256)


def build_llama(dev, seed, **shape):
    """A bf16 LlamaForCausalLM of `shape` (LlamaConfig keywords), random weights from `seed`, in eval mode."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(**shape, tie_word_embeddings=False, pad_token_id=0, eos_token_id=None, bos_token_id=1)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            m = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return m.to(torch.bfloat16).eval()


def greedy(model, ids):
    """A torch.no_grad() decode loop with the KV cache: STEPS tokens."""
    out, toks = None, []
    with torch.no_grad():
        out = model(ids, use_cache=True)
        for _ in range(STEPS):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            toks.append(int(nxt.item()))
            out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
    return toks


def generate(model, ids):
    g = model.generate(ids, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, pad_token_id=0)
    return g[0, ids.shape[1]:].tolist()


@unittest.skipIf(torch is None, "transformers (or torch) is not installed")
class LlamaOffload(unittest.TestCase):
    def test_offload_half_the_layers_gives_identical_tokens(self):
        dev = torch.device("cuda", 0) if os.environ.get("EPM_DEVICE") == "cuda" else torch.device("cpu")
        model = make_llama(dev)
        ids = torch.tensor([[1, 15043, 29892, 590, 1024, 338]], device=dev)
        ref, ref_gen = greedy(model, ids), generate(model, ids)
        self.assertEqual(ref, ref_gen, "greedy loop and generate() disagree even without epmem")
        layer_bytes = sum(p.numel() * p.element_size() for blk in model.model.layers
                          for m in blk.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
        budget = layer_bytes // 2
        h = et.offload(model, budget)
        try:
            self.assertEqual(greedy(model, ids), ref)
            self.assertEqual(generate(model, ids), ref)
            if dev.type == "cuda":
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    got = generate(model, ids)
                torch.cuda.synchronize()
                self.assertEqual(got, ref)
            st = h.stats()
            self.assertEqual(st["weights"], 8 * 7)
            self.assertEqual(st["offloaded_bytes"], layer_bytes)
            self.assertLessEqual(st["peak_resident_bytes"], budget)
            # Every forward over the 8 layers streams at least what the budget cannot hold.
            # greedy(): prefill + STEPS forwards; each generate(): prefill + STEPS - 1.
            # One hook call per linear (the default granularity): 8 layers x 7.
            self.assertEqual(st["granularity"], "linear")
            forwards = st["hook_calls"] // (8 * 7)
            generates = 2 if dev.type == "cuda" else 1
            self.assertEqual(forwards, (STEPS + 1) + generates * STEPS)
            self.assertEqual(st["acquires"], forwards * 8 * 7)
            # Compressed weights (compress="auto": on CUDA) stream fewer bytes than they decode
            # to: count what reached the device, decoded.
            streamed = st["htod_bytes"] - st["compressed_htod_bytes"] + st["decoded_bytes"]
            self.assertGreaterEqual(streamed, forwards * (layer_bytes - budget) * 0.95)
            self.assertEqual(st["compress"], dev.type == "cuda")
            if dev.type == "cuda":
                self.assertEqual(st["staged_page_ins"], 0, "registered sources should copy directly")
                self.assertGreater(st["wrapped_streams"], 0)
            print(f"\n  llama 8x1024 on {st['device']}: {st['page_ins']} page-ins, "
                  f"{st['htod_bytes'] / forwards / 2**20:.1f} MiB/forward, hit rate {st['hit_rate']:.2f}")
        finally:
            h.remove()
        self.assertEqual(generate(model, ids), ref)

    def test_compressed_offload_gives_identical_tokens(self):
        """compress=True on every device: q/o/gate/up/down (2-5.5 MiB bf16) are encoded and
        decoded on the device at each page-in; k/v (512 KiB, under the 1 MiB default)
        stay raw. Greedy decode and generate() give the all-resident tokens."""
        dev = torch.device("cuda", 0) if os.environ.get("EPM_DEVICE") == "cuda" else torch.device("cpu")
        model = make_llama(dev)
        ids = torch.tensor([[1, 15043, 29892, 590, 1024, 338]], device=dev)
        ref = greedy(model, ids)
        layer_bytes = sum(p.numel() * p.element_size() for blk in model.model.layers
                          for m in blk.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
        for pct in (25, 50):
            with self.subTest(pct=pct):
                budget = layer_bytes * pct // 100
                with et.offload(model, budget, compress=True) as h:
                    self.assertEqual(greedy(model, ids), ref)
                    self.assertEqual(generate(model, ids), ref)
                    st = h.stats()
                    self.assertTrue(st["compress"])
                    self.assertEqual(st["compressed_weights"], 8 * 5, st)
                    forwards = st["hook_calls"] // (8 * 7)
                    self.assertGreater(st["decodes"], forwards * 8, st)
                    self.assertLess(st["compressed_htod_bytes"], 0.75 * st["decoded_bytes"], st)
                    self.assertLess(st["host_weight_bytes"], 0.8 * layer_bytes, st)
                    self.assertLessEqual(st["peak_resident_bytes"] + st["decode_staging_bytes"], budget)
                    streamed = st["htod_bytes"] - st["compressed_htod_bytes"] + st["decoded_bytes"]
                    self.assertGreaterEqual(streamed, forwards * (layer_bytes - budget) * 0.95)
                    print(f"\n  llama 8x1024 compressed at {pct}% on {st['device']}: "
                          f"{st['htod_bytes'] / forwards / 2**20:.1f} MiB/forward streamed for "
                          f"{streamed / forwards / 2**20:.1f} MiB decoded, host weights "
                          f"{st['host_weight_bytes'] / layer_bytes:.3f} x raw")
                self.assertEqual(greedy(model, ids), ref)

    def test_split_weights_give_identical_tokens(self):
        """At 75% of a model whose matrices are several granules (2048/7168, 2 KV heads),
        the default offload streams each weight's tail and keeps its head resident behind
        the weight's own address: tokens are the all-resident ones, and a forward after
        the first copies exactly what the plan does not keep (total - planned resident)."""
        dev = torch.device("cuda", 0) if os.environ.get("EPM_DEVICE") == "cuda" else torch.device("cpu")
        model = build_llama(dev, 20261206, vocab_size=1000, hidden_size=2048, intermediate_size=7168,
                            num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=2,
                            max_position_embeddings=128)
        ids = torch.tensor([[1, 5, 9, 13]], device=dev)
        ref = greedy(model, ids)
        layer_bytes = sum(p.numel() * p.element_size() for blk in model.model.layers
                          for m in blk.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
        budget = layer_bytes * 3 // 4
        with et.offload(model, budget, compress=False) as h:
            self.assertEqual(greedy(model, ids), ref)
            a = h.stats()
            self.assertGreater(a["split_weights"], 0, a)
            self.assertGreater(a["split_head_bytes"], 0, a)
            self.assertLessEqual(a["peak_resident_bytes"], budget)
            self.assertEqual(greedy(model, ids), ref)
            b = h.stats()
            forwards = (b["hook_calls"] - a["hook_calls"]) // (4 * 7)
            per_forward = (b["htod_bytes"] - a["htod_bytes"]) / forwards
            self.assertEqual(per_forward, layer_bytes - b["planned_resident_bytes"], b)
            self.assertLess(per_forward, layer_bytes - budget + 2 * 7168 * 2048 * 2, b)
            print(f"\n  llama 4x2048 split at 75% on {b['device']}: {b['split_weights']} weights split, "
                  f"{per_forward / 2**20:.1f} MiB/forward for {(layer_bytes - budget) / 2**20:.1f} over the budget")
        self.assertEqual(greedy(model, ids), ref)


if __name__ == "__main__":
    unittest.main()
