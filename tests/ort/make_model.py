"""Write the tiny model the ORT tests run: Y = MatMul(X, W) + B.

    python3 tests/ort/make_model.py OUT.onnx

X is float32 [2, 4] (input), W float32 [4, 3] and B float32 [3] are
initializers with fixed values (W[i][j] = i - j, B = [0.5, -1, 2]), so a test
can compute the expected output with numpy. Needs the `onnx` package; the
machines that lack it (the GPU machine) use the committed tiny_matmul_add.onnx,
which this script reproduces byte for byte.
"""

import sys

W = [[float(i - j) for j in range(3)] for i in range(4)]
B = [0.5, -1.0, 2.0]


def build():
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3])
    w = helper.make_tensor("W", TensorProto.FLOAT, [4, 3], [v for row in W for v in row])
    b = helper.make_tensor("B", TensorProto.FLOAT, [3], B)
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["XW"], name="matmul"),
        helper.make_node("Add", ["XW", "B"], ["Y"], name="add"),
    ]
    graph = helper.make_graph(nodes, "epmem_tiny", [x], [y], [w, b])
    # Opset 13 and IR 8: old enough for every onnxruntime from 1.23 on.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="epmem-tests")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_model.py OUT.onnx")
    with open(sys.argv[1], "wb") as f:
        f.write(build())
