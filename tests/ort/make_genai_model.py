"""A tiny Llama as an onnxruntime-genai model, made the way genai's users make
one: transformers' LlamaForCausalLM from a config (fixed seed, float32), saved
with a small word-level tokenizer, then genai's model builder.

    python3 tests/ort/make_genai_model.py OUT_DIR [--ep cpu|cuda]

Needs torch, transformers, onnx, onnx_ir and the onnxruntime-genai package
(its builder, models/builder.py, is run as a script, so genai's native library
is not loaded here). Writes OUT_DIR/model.onnx (+ external data),
genai_config.json and the tokenizer files, and OUT_DIR/weights.json: the
2-D float32 initializers of the model's MatMul/Gemm nodes and their bytes.

Sizes (float32): hidden 256, 2 layers, 4 heads / 2 kv heads (head 64), ffn
768, vocab 1024. The builder (0.18, fp32, cpu) fuses q/k/v into one 256x512
MatMul: per layer qkv 512 KiB, o 256 KiB, gate/up/down 768 KiB each; lm_head
1 MiB; 11 MatMul weights, 7 MiB (7340032 bytes).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile


def hf_model(dirname):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, 1024)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(dirname)

    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                      # Wider than the default 0.02, so greedy choices are not near-ties.
                      initializer_range=0.2, torch_dtype="float32")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(dirname)


def weights(out_dir):
    import onnx

    m = onnx.load(os.path.join(out_dir, "model.onnx"), load_external_data=False)
    inits = {i.name: i for i in m.graph.initializer}
    found = {}
    for n in m.graph.node:
        if n.domain in ("", "ai.onnx") and n.op_type in ("MatMul", "Gemm") and len(n.input) > 1:
            t = inits.get(n.input[1])
            size = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.FLOAT16: 2, onnx.TensorProto.BFLOAT16: 2}
            if t is not None and len(t.dims) == 2 and t.data_type in size:
                found[t.name] = int(t.dims[0] * t.dims[1] * size[t.data_type])
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--ep", default="cpu", choices=["cpu", "cuda"])
    a = ap.parse_args()
    import importlib.util

    spec = importlib.util.find_spec("onnxruntime_genai")  # found, not imported
    if spec is None:
        sys.exit("make_genai_model: no onnxruntime_genai package (pip install onnxruntime-genai)")
    builder = os.path.join(os.path.dirname(spec.origin), "models", "builder.py")
    with tempfile.TemporaryDirectory() as hf, tempfile.TemporaryDirectory() as cache:
        hf_model(hf)
        # float16 for cuda: the builder's float32 CUDA graph uses the packed
        # Attention op without its present key/value outputs, a model ORT
        # refuses to load (genai 0.18); float16 takes its GroupQueryAttention path.
        precision = "fp16" if a.ep == "cuda" else "fp32"
        subprocess.run([sys.executable, builder, "-i", hf, "-o", a.out, "-p", precision, "-e", a.ep, "-c", cache],
                       check=True)
    w = weights(a.out)
    with open(os.path.join(a.out, "weights.json"), "w") as f:
        json.dump(w, f, indent=1, sort_keys=True)
    print(f"make_genai_model: {a.out}: {len(w)} MatMul weights, {sum(w.values())} bytes")


if __name__ == "__main__":
    main()
