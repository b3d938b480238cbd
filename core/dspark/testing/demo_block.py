"""The demo model: a pre-norm transformer block (attention + GELU MLP) with seeded weights.

Built with ``onnx.helper`` from a seeded RNG, so the package ships code, not
a binary, and every build is bit-identical. ``dspark demo`` and
``dspark plan demo`` run it; plugin authors get it through
:func:`dspark.testing.real_model` as a whole graph to feed their kernels.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dspark.graph.model import Graph

NAME = "demo_block"
SEQ, DIM, HIDDEN = 32, 64, 256


def demo_onnx(seq: int = SEQ, dim: int = DIM, hidden: int = HIDDEN, seed: int = 0) -> onnx.ModelProto:
    """The block as an ONNX model: input ``x`` (1, seq, dim) float32, output ``y`` of the same shape."""
    rng = np.random.default_rng(seed)

    def w(name: str, *shape: int) -> onnx.TensorProto:
        # 1/sqrt(fan_in) keeps activations of unit scale through the block, as a trained model's are.
        return numpy_helper.from_array((rng.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32), name)

    inits = [w("wq", dim, dim), w("wk", dim, dim), w("wv", dim, dim), w("wo", dim, dim),
             w("w1", dim, hidden), w("w2", hidden, dim),
             numpy_helper.from_array(np.ones(dim, np.float32), "ln_g"),
             numpy_helper.from_array(np.zeros(dim, np.float32), "ln_b"),
             numpy_helper.from_array(np.array(1 / math.sqrt(dim), np.float32), "scale"),
             numpy_helper.from_array(np.array(1 / math.sqrt(2), np.float32), "inv_sqrt2"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(0.5, np.float32), "half")]
    n = helper.make_node
    nodes = [
        n("LayerNormalization", ["x", "ln_g", "ln_b"], ["h"], name="ln1", axis=-1),
        n("MatMul", ["h", "wq"], ["q"], name="q_proj"),
        n("MatMul", ["h", "wk"], ["k"], name="k_proj"),
        n("MatMul", ["h", "wv"], ["v"], name="v_proj"),
        n("Transpose", ["k"], ["kt"], name="k_t", perm=[0, 2, 1]),
        n("MatMul", ["q", "kt"], ["s"], name="scores"),
        n("Mul", ["s", "scale"], ["ss"], name="scale_scores"),
        n("Softmax", ["ss"], ["p"], name="softmax", axis=-1),
        n("MatMul", ["p", "v"], ["a"], name="attend"),
        n("MatMul", ["a", "wo"], ["o"], name="o_proj"),
        n("Add", ["x", "o"], ["r1"], name="residual1"),
        n("LayerNormalization", ["r1", "ln_g", "ln_b"], ["h2"], name="ln2", axis=-1),
        n("MatMul", ["h2", "w1"], ["u"], name="up"),
        n("Mul", ["u", "inv_sqrt2"], ["u2"], name="gelu_scale"),
        n("Erf", ["u2"], ["e"], name="gelu_erf"),
        n("Add", ["e", "one"], ["e1"], name="gelu_add"),
        n("Mul", ["u", "e1"], ["ue"], name="gelu_mul"),
        n("Mul", ["ue", "half"], ["g"], name="gelu_half"),
        n("MatMul", ["g", "w2"], ["d"], name="down"),
        n("Add", ["r1", "d"], ["y"], name="residual2"),
    ]
    graph = helper.make_graph(
        nodes, NAME,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, dim])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, seq, dim])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="dspark-demo")
    model.ir_version = 9
    return model


def demo_graph() -> Graph:
    """The block (default sizes) imported as a :class:`dspark.graph.Graph`, shapes and costs annotated."""
    return Graph.from_onnx(demo_onnx(), name=NAME)


def demo_inputs(seed: int = 0, seq: int = SEQ, dim: int = DIM) -> dict[str, np.ndarray]:
    """A standard-normal ``x`` for the block, the scale its LayerNorm sees in a real residual stream."""
    return {"x": np.random.default_rng(seed).standard_normal((1, seq, dim)).astype(np.float32)}
