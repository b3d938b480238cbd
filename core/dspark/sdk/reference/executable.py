"""The reference's executables: a subgraph op by op with torch kernels, and the lean one-op linear.

Ops run with the torch kernels of :mod:`.ops`; the few nodes no kernel covers
exactly (:func:`.support.kernel_problem`) run through ``onnx.reference`` on the
host. Quantized weights run the int8/int4 kernels of :mod:`.quant_kernels`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from dspark.graph.model import Op, Subgraph
from dspark.sdk.quant import LINEAR_INPUT, LINEAR_OUTPUT
from dspark.sdk.reference.support import kernel_problem


class TorchExecutable:
    """Runs a subgraph op by op with torch kernels on one torch device."""

    def __init__(self, subgraph: Subgraph, device: str) -> None:
        import torch

        from dspark.sdk.reference.ops import KERNELS

        self._torch = torch
        self.device = torch.device(device)
        self.inputs = list(subgraph.inputs)
        self.outputs = list(subgraph.outputs)
        packed = subgraph.payload if subgraph.quantized_by == "torch" else {}
        steps: list[tuple[Op, Any]] = []
        for op in subgraph.ops:
            if _quantized_use(op, packed):
                # The packed weight is the kernel's own: the step reads no float weight ("" is None).
                unweighted = op.model_copy(update={"inputs": [op.inputs[0], "", *op.inputs[2:]]})
                steps.append((unweighted, _quantized_kernel(op, packed[op.inputs[1]])))
            elif kernel_problem(op, subgraph.graph) is None:
                steps.append((op, KERNELS[op.op_type]))
            else:
                steps.append((op, _reference_kernel(subgraph, op)))
        # A quantized weight is held packed only, unless another op reads it as a float.
        read = {t for op, _ in steps for t in op.inputs}
        self.weights = {k: to_torch(np.array(subgraph.graph.initializers[k])).to(self.device)
                        for k in subgraph.params if k in read}
        self.steps = steps
        self.opset = subgraph.graph.opset

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        env = self._evaluate(inputs)
        return {name: to_numpy(env[name]) for name in self.outputs}

    def run_all(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every tensor the subgraph computes, not only its outputs (for per-op checks)."""
        env = self._evaluate(inputs)
        return {name: to_numpy(value) for name, value in env.items() if name not in self.weights}

    def _evaluate(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        torch = self._torch
        env: dict[str, Any] = dict(self.weights)
        for name in self.inputs:
            env[name] = to_torch(inputs[name]).to(self.device)
        with torch.inference_mode():
            for op, fn in self.steps:
                args = [env[t] if t else None for t in op.inputs]
                attrs = {**op.attrs, "_opset": self.opset, "_num_outputs": len(op.outputs)}
                for name, value in zip(op.outputs, fn(attrs, args), strict=False):
                    if name:
                        env[name] = value
        return env


def _quantized_use(op: Op, packed: dict[str, Any]) -> bool:
    """``op`` reads a packed weight as its right operand (what :func:`dspark.sdk.quant.quantizable_weights` picks)."""
    return len(op.inputs) > 1 and op.inputs[1] in packed and (
        op.op_type == "MatMul" or (op.op_type == "Gemm" and not op.attrs.get("transB")))


def _quantized_kernel(op: Op, packed: Any) -> Any:
    """A step computing MatMul / Gemm(transB=0) through the packed weight's int8/int4 kernel."""
    from dspark.sdk.reference import quant_kernels as torch_quant

    def run(attrs: dict[str, Any], args: list[Any]) -> list[Any]:
        a = args[0]
        if op.op_type == "MatMul":
            return [torch_quant.apply(packed, a).to(a.dtype)]
        if attrs.get("transA"):
            a = a.T
        y = torch_quant.apply(packed, a) * float(attrs.get("alpha", 1.0))
        if len(args) > 2 and args[2] is not None:
            y = y + float(attrs.get("beta", 1.0)) * args[2]
        return [y.to(a.dtype)]

    return run


class LinearExecutable:
    """One linear ``y = x @ W`` on the CPU (the LLM's unit), with as little per-call work as
    possible: it sits in the decode loop, and its bid must time the kernel, not the op-by-op
    interpreter. ``kernel`` is ``torch.matmul`` with the float weight (what the float path
    computes) or a quantized kernel (:func:`dspark.sdk.reference.quant_kernels.apply`)."""

    def __init__(self, kernel: Any) -> None:
        self._kernel = kernel
        self.inputs, self.outputs = [LINEAR_INPUT], [LINEAR_OUTPUT]

    def run_torch(self, inputs: dict[str, Any]) -> dict[str, Any]:
        x = inputs[LINEAR_INPUT]
        if x.device.type != "cpu":
            raise ValueError(f"input on {x.device}: this linear runs on the CPU")
        return {LINEAR_OUTPUT: self._kernel(x)}

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        x = torch.from_numpy(np.ascontiguousarray(inputs[LINEAR_INPUT], dtype=np.float32))
        with torch.inference_mode():
            return {LINEAR_OUTPUT: self._kernel(x).numpy()}


def linear_executable(subgraph: Subgraph) -> LinearExecutable | None:
    """A :class:`LinearExecutable` for the one-op float32 ``x @ W`` of
    :func:`dspark.sdk.quant.linear_subgraph` (W packed or a float initializer); None for anything else."""
    ops = subgraph.ops
    if len(ops) != 1 or ops[0].op_type != "MatMul" or ops[0].inputs[0] != LINEAR_INPUT \
            or subgraph.inputs != [LINEAR_INPUT] or subgraph.outputs != [LINEAR_OUTPUT]:
        return None
    tensors, weight = subgraph.graph.tensors, ops[0].inputs[1]
    if any(t not in tensors or tensors[t].dtype != "float32" for t in (LINEAR_INPUT, LINEAR_OUTPUT)):
        return None
    if subgraph.quantized_by == "torch":
        packed = (subgraph.payload or {}).get(weight)
        if packed is None:
            return None
        from dspark.sdk.reference import quant_kernels as torch_quant

        return LinearExecutable(partial(torch_quant.apply, packed))
    w = subgraph.graph.initializers.get(weight)
    if w is None or w.ndim != 2 or w.dtype != np.float32:
        return None
    import torch

    w_t = torch.from_numpy(np.array(w))
    return LinearExecutable(partial(torch.matmul, other=w_t))


def to_torch(array: np.ndarray) -> Any:
    """A host array as a torch tensor; bfloat16 (ml_dtypes) crosses as its bits."""
    import torch

    array = np.asarray(array)
    if not array.flags.c_contiguous or not array.flags.writeable:
        array = array.copy()  # (not ascontiguousarray: it turns a 0-d array into 1-d)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def to_numpy(tensor: Any) -> np.ndarray:
    """A torch tensor as a host array; bfloat16 comes back as ml_dtypes' bfloat16."""
    import torch

    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return np.asarray(tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    return np.asarray(tensor.numpy())


def _reference_kernel(subgraph: Subgraph, op: Op) -> Any:
    """An ``onnx.reference`` evaluator for one node the torch kernels do not cover.

    The node is rebuilt as it was, at the graph's opset, with every output it
    declares (unused ones too), so the reference sees what the model said.
    """
    from onnx import TensorProto, helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    graph = subgraph.graph
    attrs = {k: numpy_helper.from_array(v) if isinstance(v, np.ndarray) else v for k, v in op.attrs.items()}
    # A control-flow node's bodies read its captured tensors by name: graph inputs here, not node inputs.
    node = helper.make_node(op.op_type, op.node_inputs, op.outputs, name=op.name, domain=op.domain, **attrs)

    def info(name: str) -> Any:
        spec = graph.tensors[name]
        dims = [d if isinstance(d, int) else None for d in spec.shape] if spec.rank_known else None
        elem = getattr(TensorProto, {"float32": "FLOAT", "float64": "DOUBLE"}.get(spec.dtype, spec.dtype.upper()))
        return helper.make_tensor_value_info(name, elem, dims)

    ins = list(dict.fromkeys(t for t in op.inputs if t))
    outs = [t for t in op.outputs if t]
    model = helper.make_model(helper.make_graph([node], f"{op.name}_ref", [info(t) for t in ins],
                                                [info(t) for t in outs]),
                              opset_imports=[helper.make_opsetid("", graph.opset)])
    evaluator = ReferenceEvaluator(model)

    def run(attrs: dict[str, Any], args: list[Any]) -> list[Any]:
        feeds = {t: to_numpy(a) for t, a in zip(op.inputs, args, strict=True) if t}
        with np.errstate(all="ignore"):  # ONNX defines the result of x % 0, 0 / 0 ...: no warning
            by_name = dict(zip(outs, evaluator.run(None, feeds), strict=True))
        return [to_torch(np.asarray(by_name[t])) if t else None for t in op.outputs]

    return run
