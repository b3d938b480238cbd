"""Import a JAX function or a Flax module through ``jax2onnx``: after that it is an ONNX model like any other.

``jax2onnx`` traces the function with example inputs and writes ONNX (weights
of a Flax module become initializers), so the placer and the plugins see ONNX
operator semantics, as for torch sources. Symbolic dims the user declares
stay symbolic under the user's names; the example inputs' sizes for them go
into ``Graph.dim_hints``.

Install with the ``jax`` extra and then ``jax2onnx`` without its
dependencies: it requires the ``onnxruntime`` distribution, which would
overwrite ``onnxruntime-gpu``'s files (the same ``onnxruntime`` package);
``scripts/setup.sh`` does both.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx

from dspark.graph.model import Graph
from dspark.graph.onnx_io import KNOWN_DOMAINS, UnsupportedModelError

__all__ = ["DEFAULT_OPSET", "export_jax_onnx", "graph_from_jax", "import_jax", "is_jax_model"]

# As for torch sources (see importers.DEFAULT_OPSET): every runtime we drive reads it.
DEFAULT_OPSET = 18
_INSTALL = "pip install 'dspark[jax]' && pip install --no-deps jax2onnx (scripts/setup.sh does both)"


def is_jax_model(obj: Any) -> bool:
    """True for a Flax module (``nnx`` or ``linen``) or a ``jax.jit``-wrapped function.

    Decided from the object's classes, so asking never imports JAX.
    """
    if isinstance(obj, type):
        return False
    return any(c.__module__.split(".")[0] in ("flax", "jax", "jaxlib") for c in type(obj).__mro__)


def _jax2onnx() -> Any:
    try:
        import jax2onnx
    except ImportError as exc:
        raise UnsupportedModelError(f"importing a JAX model needs jax, flax and jax2onnx: {exc}; {_INSTALL}") from exc
    return jax2onnx


def _load_converters(jax2onnx: Any, fn: Any) -> None:
    """Import jax2onnx's converter plugins, leaving out its examples and, unless ``fn`` is one,
    its Equinox converters.

    jax2onnx imports every module of its plugin tree on the first conversion, and its examples
    and Equinox converters build and JIT-compile models as they import: about a minute on a
    loaded two-core machine, against seconds for the rest. If its layout changed, nothing is
    done here and jax2onnx imports the tree itself.
    """
    system = sys.modules.get("jax2onnx.plugins.plugin_system")
    if system is None:
        try:
            system = importlib.import_module("jax2onnx.plugins.plugin_system")
        except ImportError:
            return
    if getattr(system, "_already_imported_plugins", None) is not False:
        return
    skip = {"examples"}
    if not any(c.__module__.split(".")[0] == "equinox" for c in type(fn).__mro__):
        skip.add("equinox")
    root = Path(system.__file__).parent
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        if rel.parts[0] in skip or path.name in ("plugin_system.py", "__init__.py"):
            continue
        try:
            importlib.import_module(".".join(("jax2onnx.plugins", *rel.parts)))
        except Exception:  # noqa: BLE001, S112  (as jax2onnx does: a converter that fails to import is skipped)
            continue
    system._already_imported_plugins = True


def _callable(fn: Any, variables: Any) -> Callable[..., Any]:
    """``fn`` as a function of its inputs alone: a linen module applies its ``variables``."""
    linen = sys.modules.get("flax.linen")
    if linen is not None and isinstance(fn, linen.Module):
        if variables is None:
            raise UnsupportedModelError(f"{type(fn).__qualname__} is a flax.linen module: pass its variables "
                                        "(the result of module.init) as variables=")
        return lambda *args: fn.apply(variables, *args)
    if not callable(fn):
        raise TypeError(f"cannot import {type(fn).__name__} as a JAX model: expected a function or a Flax module")
    return fn  # type: ignore[no-any-return]


def _arg_names(fn: Any, n: int) -> list[str]:
    try:  # a module's signature is its __call__'s, without self
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = [nm for nm in names if nm not in ("self", "args")]
    return (names + [f"arg{i}" for i in range(len(names), n)])[:n]


def _input_specs(args: Sequence[Any], names: list[str], dynamic: Mapping[Any, Any] | Sequence[Any] | None
                 ) -> tuple[list[Any], dict[str, int]]:
    """jax2onnx's input specs (ShapeDtypeStructs, declared dims by name) and the example sizes of those dims."""
    import jax

    per_arg: list[Any] = [None] * len(args)
    if isinstance(dynamic, Mapping):
        for key, axes in dynamic.items():
            index = names.index(key) if isinstance(key, str) and key in names else key
            if not isinstance(index, int) or not 0 <= index < len(args):
                raise ValueError(f"dynamic shapes name input {key!r}; the function takes {names}")
            per_arg[index] = axes
    elif dynamic is not None:
        per_arg[:len(dynamic)] = list(dynamic)
    specs, hints = [], {}
    for i, (arg, axes) in enumerate(zip(args, per_arg, strict=True)):
        shape: list[int | str] = [int(d) for d in arg.shape]
        declared = dict(enumerate(axes)) if isinstance(axes, (list, tuple)) else dict(axes or {})
        for axis, dim in declared.items():
            if dim is None:
                continue
            if not isinstance(dim, str):
                raise ValueError(f"input {names[i]!r} axis {axis}: name the dim with a string, got {dim!r}")
            hints[dim] = shape[int(axis)]
            shape[int(axis)] = dim
        specs.append(jax.ShapeDtypeStruct(tuple(shape), arg.dtype))
    return specs, hints


def export_jax_onnx(fn: Any, example_inputs: Sequence[Any] | Any, *, variables: Any = None,
                    dynamic: Mapping[Any, Any] | Sequence[Any] | None = None, opset: int = DEFAULT_OPSET
                    ) -> tuple[onnx.ModelProto, dict[str, int]]:
    """``fn`` (a JAX function or a Flax module) as an ONNX model with its weights, plus sizes of its symbolic dims.

    ``dynamic`` names symbolic dims per input, by argument name or position:
    ``{"x": {0: "batch"}}`` (or a sequence in argument order); the returned
    hints map those names to the example inputs' sizes.
    """
    jax2onnx = _jax2onnx()
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    names = _arg_names(fn, len(args))
    specs, hints = _input_specs(args, names, dynamic)
    what = type(fn).__qualname__ if not inspect.isfunction(fn) else fn.__qualname__
    try:
        with warnings.catch_warnings():  # jax2onnx's plugins use Flax APIs Flax now deprecates
            warnings.simplefilter("ignore", DeprecationWarning)
            _load_converters(jax2onnx, fn)
            model = jax2onnx.to_onnx(_callable(fn, variables), specs, model_name=what.replace(".", "_"),
                                     opset=opset, input_names=names)
    except UnsupportedModelError:
        raise
    except Exception as exc:  # jax2onnx's message names the primitive it has no rule for
        raise UnsupportedModelError(f"cannot convert {what} with jax2onnx: {type(exc).__name__}: {exc}") from exc
    return model, hints


def graph_from_jax(fn: Any, example_inputs: Sequence[Any] | Any, *, variables: Any = None,
                   dynamic: Mapping[Any, Any] | Sequence[Any] | None = None, name: str | None = None,
                   opset: int = DEFAULT_OPSET, dim_hints: Mapping[str, int] | None = None) -> Graph:
    """Export ``fn`` with jax2onnx and import the result (see :func:`export_jax_onnx`)."""
    model, hints = export_jax_onnx(fn, example_inputs, variables=variables, dynamic=dynamic, opset=opset)
    hints.update(dim_hints or {})
    label = name or getattr(fn, "__name__", None) or type(fn).__name__
    try:
        return Graph.from_onnx(model, name=label, dim_hints=hints, domains=KNOWN_DOMAINS)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{label}: {exc}") from exc


import_jax = graph_from_jax  # the name ``dspark.import_jax`` gives it
