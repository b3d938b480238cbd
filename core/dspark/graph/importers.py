"""Load a model (ONNX file, torch ``nn.Module``, JAX function or Flax module, ``module:factory`` spec) as a Graph.

Everything ends up as ONNX: torch modules go through ``torch.export`` and the
dynamo ONNX exporter, JAX functions and Flax modules through ``jax2onnx``
(:mod:`.jax_import`), so the graph the placer and the plugins see has ONNX
operator semantics whatever the source. Symbolic dims the user declares stay
symbolic (``str`` dims, under the user's names); the example inputs' sizes
for them go into ``Graph.dim_hints`` so cost estimates have numbers.

Errors: a missing file raises ``FileNotFoundError`` naming it; a bad
``module:factory`` spec raises :class:`ModelSpecError`; a model dspark cannot
represent (control flow, unknown op domain, a module torch cannot export)
raises :class:`~dspark.graph.onnx_io.UnsupportedModelError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import io
import logging
import re
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx

from dspark.graph.jax_import import graph_from_jax, is_jax_model
from dspark.graph.model import Graph
from dspark.graph.onnx_io import KNOWN_DOMAINS, UnsupportedModelError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_OPSET", "ModelSpecError", "UnsupportedModelError", "export_onnx", "graph_from_jax", "graph_from_torch",
    "load_factory", "load_model",
]

# Opset 18 is the dynamo exporter's native target (no version conversion
# pass) and both OpenVINO 2026.x and ONNX Runtime 1.2x+ read it.
DEFAULT_OPSET = 18

ModelSpec = Any  # str | Path | torch.nn.Module | JAX function / Flax module | onnx.ModelProto (imported lazily)
Factory = tuple["torch.nn.Module", tuple[Any, ...], Any]


class ModelSpecError(ValueError):
    """A ``module:factory`` spec that does not resolve to a model; the message says which part."""


def load_model(
    spec: ModelSpec,
    *,
    example_inputs: Sequence[Any] | Any = None,
    dynamic: Mapping[str, Any] | Sequence[Any] | None = None,
    name: str | None = None,
    dim_hints: Mapping[str, int] | None = None,
    opset: int = DEFAULT_OPSET,
) -> Graph:
    """Import ``spec`` into a :class:`Graph` with shapes, dtypes and cost annotations.

    ``spec`` is an ONNX file path or ``ModelProto``, an ``nn.Module``, a JAX
    function or a Flax module (with ``example_inputs`` here or as its
    attribute; a ``flax.linen`` module as a function closing over its
    variables, or through :func:`.jax_import.import_jax` with ``variables=``),
    or ``"pkg.module:factory"`` / ``"path/to/file.py:factory"``. ``dynamic``
    marks symbolic dims of the inputs, ``{"x": {0: "batch"}}`` (or, for torch,
    ``torch.export.Dim`` values; or a tuple in argument order). ``dim_hints``
    sets representative sizes of symbolic dims for cost estimates; torch and
    JAX imports default them to the example inputs' sizes (so plan for
    seq=2048 while exporting with seq=8).
    """
    if isinstance(spec, onnx.ModelProto):
        return Graph.from_onnx(spec, name=name, dim_hints=dict(dim_hints or {}), domains=KNOWN_DOMAINS)
    if isinstance(spec, (str, Path)):
        text = str(spec)
        _, sep, attr = text.rpartition(":")
        is_factory = bool(sep) and bool(attr) and attr.isidentifier() and not Path(text).exists()
        if not is_factory:
            path = Path(text)
            if not path.is_file():
                raise FileNotFoundError(f"model file not found: {text}")
            if path.suffix == ".py":
                raise ModelSpecError(f"{text}: a Python model spec needs a factory, e.g. '{text}:make_model'")
            return Graph.from_onnx(path, name=name or path.stem, dim_hints=dict(dim_hints or {}), domains=KNOWN_DOMAINS)
        result = _resolve_factory(text)
        if _is_jax_source(result):
            fn, inputs, dyn = _jax_factory(result, text)
            return graph_from_jax(fn, inputs if example_inputs is None else example_inputs,
                                  dynamic=dyn if dynamic is None else dynamic, name=name or attr, opset=opset,
                                  dim_hints=dim_hints)
        module, inputs, dyn = _torch_factory(result, text)
        return graph_from_torch(
            module, inputs if example_inputs is None else example_inputs,
            dynamic=dyn if dynamic is None else dynamic, name=name or attr, opset=opset, dim_hints=dim_hints,
        )
    if _is_jax_source(spec) or (callable(spec) and not _is_torch_module(spec)):
        given = example_inputs if example_inputs is not None else getattr(spec, "example_inputs", None)
        if given is None:
            raise ModelSpecError(f"{type(spec).__qualname__}: no example_inputs given and the model has none")
        return graph_from_jax(spec, given, dynamic=dynamic if dynamic is not None else getattr(
            spec, "dynamic_shapes", None), name=name, opset=opset, dim_hints=dim_hints)
    import torch

    if isinstance(spec, torch.nn.Module):
        given = example_inputs if example_inputs is not None else getattr(spec, "example_inputs", None)
        if given is None:
            raise ModelSpecError(f"{type(spec).__qualname__}: no example_inputs given and the module has none")
        return graph_from_torch(
            spec, given, dynamic=dynamic if dynamic is not None else getattr(spec, "dynamic_shapes", None),
            name=name, opset=opset, dim_hints=dim_hints,
        )
    raise TypeError(f"cannot load a model from {type(spec).__name__}; expected a path, spec string, "
                    "nn.Module, JAX function, Flax module or onnx.ModelProto")


def load_factory(spec: str) -> Factory:
    """Resolve ``"pkg.module:factory"`` or ``"file.py:factory"`` to (module, example_inputs, dynamic_shapes).

    The factory returns an ``nn.Module`` carrying ``example_inputs`` (and
    optionally ``dynamic_shapes``), or a tuple ``(module, example_inputs[,
    dynamic_shapes])``; the attribute may also be a module instance itself.
    (A factory giving a JAX model is loaded by :func:`load_model`.)
    """
    return _torch_factory(_resolve_factory(spec), spec)


def _is_torch_module(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # a torch module exists only once torch is imported
    return torch is not None and isinstance(obj, torch.nn.Module)


def _is_jax_source(result: Any) -> bool:
    """A JAX model, or a factory's tuple ``(JAX function or Flax module, example_inputs[, dynamic])``."""
    if isinstance(result, tuple) and len(result) in (2, 3):
        return is_jax_model(result[0]) or (callable(result[0]) and not _is_torch_module(result[0]))
    return is_jax_model(result)


def _resolve_factory(spec: str) -> Any:
    """What ``"pkg.module:attr"`` names: a model instance as it is, else the result of calling the factory."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ModelSpecError(f"model spec {spec!r} is not of the form 'package.module:factory' or 'file.py:factory'")
    pymod = _import_target(target, spec)
    try:
        obj = getattr(pymod, attr)
    except AttributeError:
        raise ModelSpecError(f"{target!r} has no attribute {attr!r} (from model spec {spec!r})") from None
    instance = _is_torch_module(obj) or is_jax_model(obj)  # modules are callable: not factories
    return obj if instance else obj() if callable(obj) else obj


def _jax_factory(result: Any, spec: str) -> tuple[Any, tuple[Any, ...], Any]:
    """(function or Flax module, example_inputs, dynamic) from a factory's JAX result.

    A ``flax.linen`` module comes as a function closing over its variables:
    ``(lambda x: model.apply(variables, x), example_inputs)``.
    """
    if isinstance(result, tuple):
        return result[0], _as_tuple(result[1]), result[2] if len(result) == 3 else None
    inputs = getattr(result, "example_inputs", None)
    if inputs is None:
        raise ModelSpecError(f"{spec}: returned {type(result).__qualname__} without an 'example_inputs' attribute")
    return result, _as_tuple(inputs), getattr(result, "dynamic_shapes", None)


def _torch_factory(result: Any, spec: str) -> Factory:
    import torch

    if isinstance(result, torch.nn.Module):
        inputs = getattr(result, "example_inputs", None)
        if inputs is None:
            raise ModelSpecError(f"{spec}: returned {type(result).__qualname__} without an 'example_inputs' attribute")
        return result, _as_tuple(inputs), getattr(result, "dynamic_shapes", None)
    if isinstance(result, tuple) and len(result) in (2, 3) and isinstance(result[0], torch.nn.Module):
        return result[0], _as_tuple(result[1]), result[2] if len(result) == 3 else None
    raise ModelSpecError(
        f"{spec}: expected an nn.Module with 'example_inputs' or a tuple (module, example_inputs[, dynamic_shapes]), "
        f"got {type(result).__name__}"
    )


def _import_target(target: str, spec: str) -> Any:
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {target} (from model spec {spec!r})")
        # One module object per file, so its classes stay identical across loads.
        modname = f"_dspark_model_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        if modname in sys.modules:
            return sys.modules[modname]
        loader_spec = importlib.util.spec_from_file_location(modname, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ModelSpecError(f"cannot load {target} as a Python module (from model spec {spec!r})")
        pymod = importlib.util.module_from_spec(loader_spec)
        sys.modules[modname] = pymod
        sys.path.insert(0, str(path.parent))  # sibling imports, as if run as a script
        try:
            loader_spec.loader.exec_module(pymod)
        except BaseException:
            del sys.modules[modname]
            raise
        finally:
            sys.path.remove(str(path.parent))
        return pymod
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        raise ModelSpecError(f"cannot import {target!r} (from model spec {spec!r}): {exc}") from exc


def _as_tuple(inputs: Any) -> tuple[Any, ...]:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def graph_from_torch(
    module: torch.nn.Module,
    example_inputs: Sequence[Any] | Any,
    *,
    dynamic: Mapping[str, Any] | Sequence[Any] | None = None,
    name: str | None = None,
    opset: int = DEFAULT_OPSET,
    dim_hints: Mapping[str, int] | None = None,
) -> Graph:
    """Export ``module`` with torch.export + the dynamo ONNX exporter and import the result."""
    model, hints = export_onnx(module, example_inputs, dynamic=dynamic, opset=opset)
    hints.update(dim_hints or {})
    try:
        return Graph.from_onnx(model, name=name or type(module).__name__, dim_hints=hints, domains=KNOWN_DOMAINS)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{type(module).__qualname__}: {exc}") from exc


def export_onnx(
    module: torch.nn.Module,
    example_inputs: Sequence[Any] | Any,
    *,
    dynamic: Mapping[str, Any] | Sequence[Any] | None = None,
    opset: int = DEFAULT_OPSET,
) -> tuple[onnx.ModelProto, dict[str, int]]:
    """The module as an optimized ONNX model with real weights, plus sizes of its symbolic dims.

    Symbolic dims are renamed from torch's ``s77`` to the user's names (the
    ``Dim`` names or the strings in ``dynamic``); the returned hints map those
    names to the example inputs' sizes.
    """
    import torch

    args = _as_tuple(example_inputs)
    cls = type(module).__qualname__
    module = module.eval()
    arg_names = _arg_names(module, len(args))
    dynamic_shapes, declared = _dynamic_shapes(dynamic, arg_names)
    try:
        with _quiet_torch():
            ep = torch.export.export(module, args, dynamic_shapes=dynamic_shapes)
    except Exception as exc:
        raise UnsupportedModelError(f"cannot export {cls} with torch.export: {_summarize(exc)}") from exc
    try:
        with _quiet_torch():
            program = torch.onnx.export(ep, args, dynamo=True, opset_version=opset, optimize=True, verbose=False)
    except Exception as exc:
        raise UnsupportedModelError(f"cannot convert {cls} to ONNX: {_summarize(exc)}") from exc
    if program is None:  # only the TorchScript path returns None
        raise UnsupportedModelError(f"cannot convert {cls} to ONNX: the exporter returned no program")
    model = program.model_proto
    hints = _rename_dims(model, args, arg_names, declared)
    _name_folded_weights(model)
    return model, hints


def _arg_names(module: torch.nn.Module, n: int) -> list[str]:
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (names + [f"arg{i}" for i in range(len(names), n)])[:n]


def _dynamic_shapes(
    dynamic: Mapping[str, Any] | Sequence[Any] | None, arg_names: list[str]
) -> tuple[Any, list[tuple[int, int, str]]]:
    """torch.export's ``dynamic_shapes`` (str names become shared ``Dim``s) and (arg, axis, name) triples."""
    if dynamic is None:
        return None, []
    from torch.export import Dim

    if isinstance(dynamic, Mapping):
        unknown = [k for k in dynamic if k not in arg_names]
        if unknown:
            raise ModelSpecError(f"dynamic shapes name inputs {unknown} but forward() takes {arg_names}")
        per_arg = [dynamic.get(n) for n in arg_names]
    else:
        per_arg = list(dynamic) + [None] * (len(arg_names) - len(dynamic))
    dims: dict[str, Any] = {}
    declared: list[tuple[int, int, str]] = []
    converted: list[Any] = []
    for i, axes in enumerate(per_arg):
        if axes is None:
            converted.append(None)
            continue
        if not isinstance(axes, Mapping):  # a list of axes in torch's tuple form
            axes = dict(enumerate(axes))
        spec: dict[int, Any] = {}
        for axis, dim in axes.items():
            if dim is None:
                continue
            if isinstance(dim, str):
                dim_name = dim
                dim = dims.setdefault(dim, Dim(dim))
            else:  # a torch.export.Dim has a name; Dim.AUTO / DYNAMIC hints do not
                dim_name = getattr(dim, "__name__", None) or f"{arg_names[i]}_dim{axis}"
            spec[int(axis)] = dim
            declared.append((i, int(axis), dim_name))
        converted.append(spec)
    return dict(zip(arg_names, converted, strict=True)), declared


def _rename_dims(
    model: onnx.ModelProto, args: tuple[Any, ...], arg_names: list[str], declared: list[tuple[int, int, str]]
) -> dict[str, int]:
    """Rename torch's dim symbols to the declared names everywhere; return the example sizes."""
    init_names = {t.name for t in model.graph.initializer}
    onnx_inputs = {vi.name: vi for vi in model.graph.input if vi.name not in init_names}
    positional = list(onnx_inputs.values())
    rename: dict[str, str] = {}
    hints: dict[str, int] = {}
    for i, axis, dim_name in declared:
        vi = onnx_inputs.get(arg_names[i]) or (positional[i] if i < len(positional) else None)
        if vi is None or axis >= len(vi.type.tensor_type.shape.dim):
            continue
        d = vi.type.tensor_type.shape.dim[axis]
        if d.HasField("dim_param"):
            rename[d.dim_param] = dim_name
        hints[dim_name] = int(args[i].shape[axis])
    if rename:
        pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(rename, key=len, reverse=True))) + r")\b")
        g = model.graph
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            for d in vi.type.tensor_type.shape.dim:
                if d.HasField("dim_param"):
                    d.dim_param = pattern.sub(lambda m: rename[m.group(1)], d.dim_param)
    return hints


def _name_folded_weights(model: onnx.ModelProto) -> None:
    """Give weights the exporter folded (e.g. a transposed Linear weight, ``val_4``) their module's name.

    Names like ``qkv.weight`` are what sensitive-layer rules and reports key
    on; the node's ``pkg.torch.onnx.name_scopes`` metadata says which module
    it came from. The tensor keeps ONNX layout (MatMul's [in, out]).
    """
    g = model.graph
    taken = {t.name for t in g.initializer} | {v.name for v in g.input} | {o for n in g.node for o in n.output}
    users: dict[str, list[onnx.NodeProto]] = {}
    for node in g.node:
        for t in node.input:
            users.setdefault(t, []).append(node)
    rename: dict[str, str] = {}
    for init in g.initializer:
        nodes = users.get(init.name, [])
        if not re.fullmatch(r"val_\d+", init.name) or len(init.dims) < 2 or len(nodes) != 1:
            continue
        if nodes[0].op_type not in ("MatMul", "Gemm", "Conv", "ConvTranspose", "Gather"):
            continue
        scopes = next((p.value for p in nodes[0].metadata_props if p.key == "pkg.torch.onnx.name_scopes"), "")
        parts = [s for s in re.findall(r"'([^']*)'", scopes)][:-1]  # the last scope is the aten op
        path = ".".join(p for p in parts if p)
        new = f"{path}.weight" if path else ""
        if new and new not in taken:
            rename[init.name] = new
            taken.add(new)
    if not rename:
        return
    for init in g.initializer:
        init.name = rename.get(init.name, init.name)
    for vi in g.value_info:
        vi.name = rename.get(vi.name, vi.name)
    for node in g.node:
        node.input[:] = [rename.get(t, t) for t in node.input]


_OP_LINE = re.compile(r"\b(aten|prims|torch\.ops)[.:]|Unsupported|not supported|No decomposition")


def _summarize(exc: BaseException) -> str:
    """The lines of a torch export error that say what failed and where, not the whole essay."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # the exporter colours its messages
    text = re.sub(r"<class '(?:[\w]+\.)*(\w+)'>", r"\1", text)
    lines = [ln.rstrip()[:300] for ln in text.splitlines()]
    head = next((ln.strip() for ln in lines if ln.strip()), "")
    head = head.split(". This is step")[0]  # drop the exporter's "next steps" advice
    keep = [f"{type(exc).__name__}: {head}"]
    for i, ln in enumerate(lines):
        if "The following call raised this error" in ln:  # the user's source line
            keep += [x.strip() for x in lines[i + 1:i + 3] if x.strip()]
        elif _OP_LINE.search(ln) and ln.strip() != head:  # lines naming the op that failed
            keep.append(ln.strip())
    cause = exc.__cause__
    if cause is not None and len(keep) == 1:
        keep.append(_summarize(cause))
    return " | ".join(dict.fromkeys(keep[:6]))


@contextlib.contextmanager
def _quiet_torch() -> Iterator[None]:
    """Silence the exporter's warnings about optional packages (torchvision) and its progress chatter."""
    names = ("torch.onnx", "torch.export", "torch._export", "torch.fx.experimental.symbolic_shapes")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        # torch.export also prints the failing graph to stderr; the error we raise carries what matters.
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
