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
    torch.manual_seed(20261201)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=256,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=None, bos_token_id=1)
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
            self.assertGreaterEqual(st["htod_bytes"], forwards * (layer_bytes - budget) * 0.95)
            if dev.type == "cuda":
                self.assertEqual(st["staged_page_ins"], 0, "registered sources should copy directly")
                self.assertGreater(st["wrapped_streams"], 0)
            print(f"\n  llama 8x1024 on {st['device']}: {st['page_ins']} page-ins, "
                  f"{st['htod_bytes'] / forwards / 2**20:.1f} MiB/forward, hit rate {st['hit_rate']:.2f}")
        finally:
            h.remove()
        self.assertEqual(generate(model, ids), ref)


if __name__ == "__main__":
    unittest.main()
