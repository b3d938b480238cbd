"""Real models for plugin authors: whole graphs, their inputs, the activations at every op, and op cases from them.

The generated op cases (:mod:`dspark.testing.op_cases`) are tiny and random;
a kernel can pass them and still be wrong on the values a real model
produces. :func:`real_model` gives a whole model built in-process, with no
downloads, and :meth:`RealModel.op_cases` turns every op of it into an
:class:`OpCase` fed with the activations the torch reference computes there,
ready for :func:`dspark.testing.check_plugin`::

    from dspark.testing import check_plugin, real_model

    report = check_plugin("mychip", cases=real_model().op_cases())
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from dspark.graph.model import Graph
from dspark.testing.demo_block import NAME as DEMO, demo_graph, demo_inputs
from dspark.testing.llama import NAME as LLAMA, stdlib_llama_onnx
from dspark.testing.op_cases import OpCase

REAL_MODELS = (LLAMA, DEMO)


@dataclass(frozen=True)
class RealModel:
    """A whole model and the inputs it is run on."""

    name: str
    graph: Graph
    inputs: dict[str, np.ndarray] = field(repr=False)

    def activations(self) -> dict[str, np.ndarray]:
        """Every tensor's value on :attr:`inputs` (see :func:`activations`)."""
        return activations(self.graph, self.inputs)

    def op_cases(self, *, unique: bool = True) -> list[OpCase]:
        """One case per op, fed with its real input activations (see :func:`model_op_cases`)."""
        return model_op_cases(self.graph, self.inputs, unique=unique)


def real_model(name: str = LLAMA) -> RealModel:
    """A real model by name (built once per process; treat its graph and arrays as read-only).

    - ``"stdlib-llama"`` (default): the shipped default model with its
      trained weights in float32, every layer up to the logits (about 370
      ops), on the first lines of a Python function, tokenized.
    - ``"demo_block"``: the seeded transformer block ``dspark demo`` runs, on
      a standard-normal ``x`` (20 ops).
    """
    return _build(name)


# Keyed by the name alone (a cache on real_model would build the default twice: real_model() and real_model(LLAMA)).
@functools.lru_cache(maxsize=len(REAL_MODELS))
def _build(name: str) -> RealModel:
    if name == LLAMA:
        model, inputs = stdlib_llama_onnx()
        return RealModel(name, Graph.from_onnx(model, name=name), inputs)
    if name == DEMO:
        return RealModel(name, demo_graph(), demo_inputs())
    raise KeyError(f"no real model {name!r}; have {list(REAL_MODELS)}")


def activations(graph: Graph, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every tensor of ``graph`` the torch reference computes on ``inputs`` (CPU, float as declared), and the inputs.

    Weights are left out: they are in ``graph.initializers``.
    """
    from dspark.sdk.reference.executable import TorchExecutable  # torch loads only when a model runs

    values = TorchExecutable(graph.subgraph(), "cpu").run_all(inputs)
    return {**values, **inputs}


def model_op_cases(graph: Graph, inputs: dict[str, np.ndarray], *, unique: bool = True) -> list[OpCase]:
    """One case per op of a real model, fed with the activations the model really produces there.

    The torch reference runs the whole graph once; each op becomes a
    standalone graph whose inputs are its real input activations and whose
    weights are the model's. With ``unique`` only the first op of each
    signature (same type, attributes, shapes) is kept: a transformer's layers
    repeat the same ops.
    """
    values = activations(graph, inputs)
    cases: list[OpCase] = []
    seen: set[str] = set()
    for op in graph.ops:
        sub = graph.subgraph([op.name])
        if unique:
            sig = sub.signature()
            if sig in seen:
                continue
            seen.add(sig)
        if any(t not in values for t in sub.inputs) or any(t not in graph.tensors for t in sub.inputs + sub.outputs):
            continue  # a tensor with no recorded value or spec: not checkable on its own
        outputs = [t for t in op.outputs if t]
        single = Graph(
            name=f"{graph.name}:{op.name}", opset=graph.opset, ops=[op],
            tensors={t: graph.tensors[t] for t in [*sub.inputs, *sub.params, *outputs] if t in graph.tensors},
            inputs=list(sub.inputs), outputs=outputs,
            initializers={p: graph.initializers[p] for p in sub.params},
        )
        cases.append(OpCase(name=f"{graph.name}:{op.name}", graph=single,
                            inputs={t: np.asarray(values[t]) for t in sub.inputs}))
    return cases
