"""epmem.kvcache hands its Cache to transformers the supported way: `cache=` where
the model's forward names it so (transformers 5.24 on; `past_key_values=` is
deprecated there and removed in 5.40), `past_key_values=` before. Run against the
transformers CI installs (5.17) and the newest one (scripts/python-test.sh runs
this file again with it). Skipped where transformers is not installed."""

import functools
import os
import unittest
import warnings

try:
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:
    torch = None

if torch is not None:
    import epmem.kvcache as ek


def _tdev():
    return torch.device("cuda", 0) if os.environ.get("EPM_DEVICE") == "cuda" else torch.device("cpu")


def _renamed(fn):
    # What transformers' deprecate_kwarg does to a forward: a functools.wraps wrapper.
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


@unittest.skipIf(torch is None, "transformers (or torch) is not installed")
class CacheKeyword(unittest.TestCase):
    def test_the_keyword_follows_the_forward_signature(self):
        class New(torch.nn.Module):
            @_renamed
            def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
                pass

        class Old(torch.nn.Module):
            def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
                pass

        self.assertEqual(ek.cache_kwarg(New()), "cache")
        self.assertEqual(ek.cache_kwarg(Old()), "past_key_values")
        self.assertEqual(ek.cache_kwargs(New(), "c"), {"cache": "c"})

    def test_llama_forward_and_generate_use_the_cache_without_deprecation(self):
        torch.manual_seed(3)
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          max_position_embeddings=256, initializer_range=0.3, pad_token_id=0,
                          eos_token_id=None, bos_token_id=1)
        with torch.device(_tdev()):
            model = LlamaForCausalLM(cfg).to(torch.float32).eval()
        # transformers 5.24 names it `cache`; 5.17 (what CI installs first) has only `past_key_values`.
        newest = tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24)
        self.assertEqual(ek.cache_kwarg(model), "cache" if newest else "past_key_values")
        prompt = [1, 5, 9, 13, 17, 21]
        with ek.KvStore(model.config, 32 << 20, max_tokens=64, dtype=torch.float32) as store:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                c = store.request()
                toks = ek.greedy(model, c, prompt, steps=4)
                # The cache was really used, not passed through **kwargs and ignored.
                self.assertEqual(c.get_seq_length(), len(prompt) + 3)
                g = store.request()
                ids = torch.tensor([prompt], device=_tdev())
                out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
                                     **ek.cache_kwargs(model, g))
                self.assertEqual(out[0, len(prompt):].tolist(), toks)
                self.assertGreaterEqual(g.get_seq_length(), len(prompt) + 3)
                c.close()
                g.close()
            stale = [str(w.message) for w in seen
                     if issubclass(w.category, (FutureWarning, DeprecationWarning))
                     and ("past_key_values" in str(w.message) or "cache" in str(w.message))]
            self.assertEqual(stale, [], f"transformers {transformers.__version__}")


if __name__ == "__main__":
    unittest.main()
