"""Small decoder-shaped ONNX models for the weight-streaming tests, built with
the `onnx` package from a fixed seed (nothing is committed: tests build them).

    python3 tests/ort/make_decoder.py OUT.onnx [--layers N] [--d D] [--ffn F]
        [--vocab V] [--dtype float32|float16|bfloat16] [--seed S]

decoder(): X [batch, seq, d] -> per layer: q = X·Wq (batched MatMul), k, v by
Gemm on X reshaped to rows (k: transB=1 with a bias; v: alpha 0.5), scores
q·kᵀ and att·v (activation × activation: never claimed), o = ctx·Wo,
residual, MLP up/down (MatMul, Relu), residual; layer 0 also has a float64
branch (a MatMul the EP cannot compute) and a tiny projection (below the
claiming threshold). Outputs: logits = h·Wlm, and the tiny projection.

single_matmul(): Y = X·W (+ Gemm variants) in float16/bfloat16, for checking
those types against numpy; graph_input_weight(): W is a graph input, not a
constant.
"""

import argparse

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ELEM = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


def _init(name, arr, dtype="float32"):
    if dtype == "bfloat16":
        # bfloat16: the top 16 bits of float32 (rounded to nearest even).
        u = arr.astype(np.float32).view(np.uint32)
        bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        t = helper.make_tensor(name, TensorProto.BFLOAT16, arr.shape, bits.tobytes(), raw=True)
        return t
    if dtype == "float16":
        return numpy_helper.from_array(arr.astype(np.float16), name)
    return numpy_helper.from_array(arr.astype(np.float32 if dtype == "float32" else dtype), name)


def decoder(layers=2, d=128, ffn=512, vocab=1024, seed=0):
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def w(name, shape, scale=None):
        s = scale if scale is not None else 1.0 / np.sqrt(shape[0] if len(shape) > 1 else 1)
        inits.append(_init(name, rng.standard_normal(shape).astype(np.float32) * s))
        return name

    def n(op, ins, outs, **attrs):
        nodes.append(helper.make_node(op, ins, outs, name=outs[0] + "_node", **attrs))
        return outs[0]

    inits.append(numpy_helper.from_array(np.array([-1, d], dtype=np.int64), "rows_shape"))
    inits.append(numpy_helper.from_array(np.array(1.0 / np.sqrt(d), dtype=np.float32), "scale"))
    h = "X"
    small = None
    for layer in range(layers):
        p = f"l{layer}_"
        q = n("MatMul", [h, w(p + "Wq", (d, d))], [p + "q"])
        rows = n("Reshape", [h, "rows_shape"], [p + "rows"])
        k2 = n("Gemm", [rows, w(p + "Wk", (d, d)), w(p + "bk", (d,), 0.1)], [p + "k2"], transB=1)
        v2 = n("Gemm", [rows, w(p + "Wv", (d, d))], [p + "v2"], alpha=0.5)
        qshape = n("Shape", [q], [p + "qshape"])
        k = n("Reshape", [k2, qshape], [p + "k"])
        v = n("Reshape", [v2, qshape], [p + "v"])
        kt = n("Transpose", [k], [p + "kt"], perm=[0, 2, 1])
        s = n("MatMul", [q, kt], [p + "scores"])
        s = n("Mul", [s, "scale"], [p + "scaled"])
        a = n("Softmax", [s], [p + "att"], axis=-1)
        ctx = n("MatMul", [a, v], [p + "ctx"])
        o = n("MatMul", [ctx, w(p + "Wo", (d, d))], [p + "o"])
        h1 = n("Add", [h, o], [p + "h1"])
        up = n("MatMul", [h1, w(p + "W1", (d, ffn))], [p + "up"])
        act = n("Relu", [up], [p + "act"])
        down = n("MatMul", [act, w(p + "W2", (ffn, d))], [p + "down"])
        h = n("Add", [h1, down], [p + "h2"])
        if layer == 0:
            h64 = n("Cast", [h], [p + "h64"], to=TensorProto.DOUBLE)
            inits.append(numpy_helper.from_array(rng.standard_normal((d, d)) * (0.1 / np.sqrt(d)), p + "W64"))
            m64 = n("MatMul", [h64, p + "W64"], [p + "m64"])
            back = n("Cast", [m64], [p + "m32"], to=TensorProto.FLOAT)
            h = n("Add", [h, back], [p + "h3"])
            small = n("MatMul", [h, w(p + "Wsmall", (d, 4))], ["small"])
    n("MatMul", [h, w("Wlm", (d, vocab))], ["logits"])
    graph = helper.make_graph(
        nodes,
        "decoder",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", "seq", d])],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocab]),
            helper.make_tensor_value_info(small, TensorProto.FLOAT, ["batch", "seq", 4]),
        ],
        inits,
    )
    return _model(graph)


def _model(graph):
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def single_matmul(dtype, k=256, n=512, seed=1):
    """Y1 = X·W (MatMul), Y2 = Gemm(X2, Wt, b, transB=1, alpha=0.5, beta=2),
    weights [k, n] / [n, k] of `dtype`; inputs and outputs are float32, cast
    to and from `dtype` inside the model (numpy has no bfloat16). Returns
    (model, weights as float32 before rounding)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    wt = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    b = rng.standard_normal((n,)).astype(np.float32)
    t = ELEM[dtype]
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Cast", ["X"], ["Xt"], to=t, name="cast_x"),
        helper.make_node("Cast", ["X2"], ["X2t"], to=t, name="cast_x2"),
        helper.make_node("MatMul", ["Xt", "W"], ["Y1t"], name="mm"),
        helper.make_node("Gemm", ["X2t", "Wt", "b"], ["Y2t"], name="gemm", transB=1, alpha=0.5, beta=2.0),
        helper.make_node("Cast", ["Y1t"], ["Y1"], to=f, name="cast_y1"),
        helper.make_node("Cast", ["Y2t"], ["Y2"], to=f, name="cast_y2"),
    ]
    graph = helper.make_graph(
        nodes,
        "single",
        [helper.make_tensor_value_info("X", f, ["batch", "seq", k]), helper.make_tensor_value_info("X2", f, ["rows", k])],
        [helper.make_tensor_value_info("Y1", f, ["batch", "seq", n]), helper.make_tensor_value_info("Y2", f, ["rows", n])],
        [_init("W", w, dtype), _init("Wt", wt, dtype), _init("b", b, dtype)],
    )
    return _model(graph), {"W": w, "Wt": wt, "b": b}


def graph_input_weight(k=256, n=512):
    """Y = X·W where W is a graph input: never a constant, never claimed."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"], name="mm_input_weight")],
        "input_weight",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["rows", k]),
         helper.make_tensor_value_info("W", TensorProto.FLOAT, [k, n])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["rows", n])],
        [],
    )
    return _model(graph)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    onnx.save(decoder(a.layers, a.d, a.ffn, a.vocab, a.seed), a.out)


if __name__ == "__main__":
    main()
