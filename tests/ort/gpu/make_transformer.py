#!/usr/bin/env python3
"""A transformer-shaped ONNX model for the ORT GPU tests and scripts/bench_ort.py.

    make_transformer.py OUT.onnx [--layers N] [--d-model D] [--heads H] [--ffn F] [--seed S]

Input X [batch, seq, d_model] float32 (batch and seq dynamic), output Y of the
same shape. Each block: LayerNorm -> Q/K/V projections -> multi-head
attention (MatMul, Softmax) -> output projection -> residual -> LayerNorm ->
MLP (MatMul, GELU from Erf, MatMul) -> residual. Weights are random (fixed
seed), scaled so activations stay O(1) through many blocks. Initializer bytes
= layers * (4*d^2 + 2*d*ffn) * 4 (+ biases, norms).
"""
import argparse

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build(layers, d, heads, ffn, seed):
    assert d % heads == 0
    dh = d // heads
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def w(name, shape, scale):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def c(name, arr):
        inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def n(op, ins, outs, **kw):
        nodes.append(helper.make_node(op, ins, outs, **kw))
        return outs[0]

    split_shape = c("split_shape", np.array([0, 0, heads, dh], np.int64))
    merge_shape = c("merge_shape", np.array([0, 0, d], np.int64))
    scale = c("attn_scale", np.array(1.0 / np.sqrt(dh), np.float32))
    half = c("half", np.array(0.5, np.float32))
    one = c("one", np.array(1.0, np.float32))
    rsqrt2 = c("rsqrt2", np.array(1.0 / np.sqrt(2.0), np.float32))
    x = "X"
    for i in range(layers):
        p = f"l{i}_"
        g1 = c(p + "ln1_g", np.ones(d, np.float32))
        b1 = c(p + "ln1_b", np.zeros(d, np.float32))
        h = n("LayerNormalization", [x, g1, b1], [p + "ln1"], axis=-1, epsilon=1e-5)
        heads_out = []
        for t in "qkv":
            m = n("MatMul", [h, w(p + "w" + t, (d, d), 1 / np.sqrt(d))], [p + t])
            r = n("Reshape", [m, split_shape], [p + t + "_r"])
            perm = [0, 2, 3, 1] if t == "k" else [0, 2, 1, 3]
            heads_out.append(n("Transpose", [r], [p + t + "_t"], perm=perm))
        q, k, v = heads_out
        s = n("MatMul", [q, k], [p + "scores"])
        s = n("Mul", [s, scale], [p + "scores_s"])
        a = n("Softmax", [s], [p + "attn"], axis=-1)
        o = n("MatMul", [a, v], [p + "ctx"])
        o = n("Transpose", [o], [p + "ctx_t"], perm=[0, 2, 1, 3])
        o = n("Reshape", [o, merge_shape], [p + "ctx_m"])
        o = n("MatMul", [o, w(p + "wo", (d, d), 1 / np.sqrt(d))], [p + "proj"])
        x1 = n("Add", [x, o], [p + "res1"])
        g2 = c(p + "ln2_g", np.ones(d, np.float32))
        b2 = c(p + "ln2_b", np.zeros(d, np.float32))
        h2 = n("LayerNormalization", [x1, g2, b2], [p + "ln2"], axis=-1, epsilon=1e-5)
        u = n("MatMul", [h2, w(p + "w1", (d, ffn), 1 / np.sqrt(d))], [p + "up"])
        u = n("Add", [u, c(p + "b_up", np.zeros(ffn, np.float32))], [p + "up_b"])
        e = n("Mul", [u, rsqrt2], [p + "gelu_a"])
        e = n("Erf", [e], [p + "gelu_erf"])
        e = n("Add", [e, one], [p + "gelu_1p"])
        e = n("Mul", [e, half], [p + "gelu_h"])
        g = n("Mul", [u, e], [p + "gelu"])
        dn = n("MatMul", [g, w(p + "w2", (ffn, d), 1 / np.sqrt(ffn))], [p + "down"])
        x = n("Add", [x1, dn], [p + "res2"])
    nodes.append(helper.make_node("Identity", [x], ["Y"]))
    graph = helper.make_graph(
        nodes,
        "epmem_transformer",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", "seq", d])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", "seq", d])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="epmem")
    model.ir_version = 8
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    m = build(a.layers, a.d_model, a.heads, a.ffn, a.seed)
    onnx.checker.check_model(m)
    onnx.save(m, a.out)
    nbytes = sum(np.prod(t.dims) * 4 for t in m.graph.initializer if t.data_type == TensorProto.FLOAT)
    print(f"wrote {a.out}: {a.layers} blocks, d_model {a.d_model}, {nbytes / 2**20:.1f} MiB of float initializers")


if __name__ == "__main__":
    main()
