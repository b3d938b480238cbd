"""ONNX operator semantics implemented with torch, for the reference backend.

Each function takes the op's attributes and its input tensors (None for an
omitted optional input) and returns a list of output tensors. The attributes
also carry ``_opset`` (the model's default-domain opset) and
``_num_outputs``. Ops not listed here, and nodes a kernel does not cover
(:func:`dspark.sdk.reference.support.kernel_problem`), run through
``onnx.reference`` on the host (see ``torch_ref``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

Kernel = Callable[[dict[str, Any], list[Any]], list[Any]]
KERNELS: dict[str, Kernel] = {}

_ONNX_DTYPES = {
    1: torch.float32, 2: torch.uint8, 3: torch.int8, 5: torch.int16, 6: torch.int32, 7: torch.int64,
    9: torch.bool, 10: torch.float16, 11: torch.float64, 16: torch.bfloat16,
}


def kernel(*names: str) -> Callable[[Kernel], Kernel]:
    def register(fn: Kernel) -> Kernel:
        for n in names:
            KERNELS[n] = fn
        return fn
    return register


def _ints(t: Any) -> list[int]:
    # reshape: a 0-d axes tensor (onnx.reference accepts one) lists as one int, not an int
    return [int(v) for v in (t.reshape(-1).tolist() if isinstance(t, torch.Tensor) else t)]


def _unary(fn: Callable[[torch.Tensor], torch.Tensor]) -> Kernel:
    return lambda a, x: [fn(x[0])]


for _name, _fn in {
    "Relu": torch.relu, "Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Erf": torch.erf,
    "Sqrt": torch.sqrt, "Exp": torch.exp, "Log": torch.log, "Neg": torch.neg, "Abs": torch.abs,
    "Reciprocal": torch.reciprocal, "Floor": torch.floor, "Ceil": torch.ceil, "Sin": torch.sin,
    "Cos": torch.cos, "Not": torch.logical_not, "Identity": lambda t: t, "Softplus": F.softplus,
    "Sign": torch.sign, "Round": torch.round,
}.items():
    KERNELS[_name] = _unary(_fn)

_BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul,
    "Equal": torch.eq, "Greater": torch.gt, "Less": torch.lt, "GreaterOrEqual": torch.ge,
    "LessOrEqual": torch.le, "And": torch.logical_and, "Or": torch.logical_or, "Xor": torch.logical_xor,
}
for _name, _bfn in _BINARY.items():
    KERNELS[_name] = (lambda f: (lambda a, x: [f(x[0], x[1])]))(_bfn)


@kernel("Pow")
def _pow(a: dict[str, Any], x: list[Any]) -> list[Any]:
    # ONNX: the result has the base's type (an int base with a float exponent stays int).
    return [torch.pow(x[0], x[1]).to(x[0].dtype)]


@kernel("Div")
def _div(a: dict[str, Any], x: list[Any]) -> list[Any]:
    if x[0].is_floating_point():
        return [x[0] / x[1]]
    return [torch.div(x[0], x[1], rounding_mode="trunc")]


def _fold(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], mean: bool = False) -> Kernel:
    def run(a: dict[str, Any], x: list[Any]) -> list[Any]:
        out = x[0]
        for t in x[1:]:
            out = fn(out, t)
        return [out / len(x) if mean else out]
    return run


KERNELS.update({"Max": _fold(torch.maximum), "Min": _fold(torch.minimum), "Sum": _fold(torch.add),
                "Mean": _fold(torch.add, mean=True)})


@kernel("Where")
def _where(a: dict[str, Any], x: list[Any]) -> list[Any]:
    return [torch.where(x[0].bool(), x[1], x[2])]


@kernel("Cast")
def _cast(a: dict[str, Any], x: list[Any]) -> list[Any]:
    return [x[0].to(_ONNX_DTYPES[int(a["to"])])]


@kernel("Gelu")
def _gelu(a: dict[str, Any], x: list[Any]) -> list[Any]:
    return [F.gelu(x[0], approximate=str(a.get("approximate", "none")))]


@kernel("LeakyRelu")
def _leaky(a: dict[str, Any], x: list[Any]) -> list[Any]:
    return [F.leaky_relu(x[0], float(a.get("alpha", 0.01)))]


@kernel("HardSigmoid")
def _hsig(a: dict[str, Any], x: list[Any]) -> list[Any]:
    return [torch.clamp(float(a.get("alpha", 0.2)) * x[0] + float(a.get("beta", 0.5)), 0, 1)]


@kernel("Clip")
def _clip(a: dict[str, Any], x: list[Any]) -> list[Any]:
    if a.get("_opset", 11) < 11:  # min and max were attributes
        lo = float(a["min"]) if "min" in a else None
        hi = float(a["max"]) if "max" in a else None
    else:
        lo = x[1] if len(x) > 1 and x[1] is not None else None
        hi = x[2] if len(x) > 2 and x[2] is not None else None
    if lo is None and hi is None:
        return [x[0].clone()]
    return [torch.clamp(x[0], lo, hi)]


@kernel("MatMul")
def _matmul(a: dict[str, Any], x: list[Any]) -> list[Any]:
    return [torch.matmul(x[0], x[1])]


@kernel("Gemm")
def _gemm(a: dict[str, Any], x: list[Any]) -> list[Any]:
    A = x[0].T if a.get("transA") else x[0]
    B = x[1].T if a.get("transB") else x[1]
    out = float(a.get("alpha", 1.0)) * (A @ B)
    if len(x) > 2 and x[2] is not None:
        out = out + float(a.get("beta", 1.0)) * x[2]
    return [out]


def _softmax(fn: Callable[[torch.Tensor, int], torch.Tensor]) -> Kernel:
    def run(a: dict[str, Any], x: list[Any]) -> list[Any]:
        if a.get("_opset", 13) >= 13:
            return [fn(x[0], int(a.get("axis", -1)))]
        # Before opset 13 the input is flattened to 2-D at ``axis`` (default 1).
        t = x[0]
        axis = int(a.get("axis", 1))
        axis = axis + t.dim() if axis < 0 else axis
        lead = 1
        for d in t.shape[:axis]:
            lead *= d
        return [fn(t.reshape(lead, -1), 1).reshape(t.shape)]
    return run


KERNELS["Softmax"] = _softmax(torch.softmax)
KERNELS["LogSoftmax"] = _softmax(torch.log_softmax)


@kernel("LayerNormalization")
def _layernorm(a: dict[str, Any], x: list[Any]) -> list[Any]:
    axis = int(a.get("axis", -1)) % x[0].dim()
    shape = x[0].shape[axis:]
    bias = x[2] if len(x) > 2 else None
    return [F.layer_norm(x[0], shape, x[1], bias, float(a.get("epsilon", 1e-5)))]


@kernel("BatchNormalization")
def _batchnorm(a: dict[str, Any], x: list[Any]) -> list[Any]:
    return [F.batch_norm(x[0], x[3], x[4], x[1], x[2], False, 0.0, float(a.get("epsilon", 1e-5)))]


def _pads(a: dict[str, Any], nd: int) -> tuple[list[int], list[int]]:
    if a.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        raise NotImplementedError(f"auto_pad={a['auto_pad']}")
    pads = list(a.get("pads", [0] * (2 * nd)))
    return pads[:nd], pads[nd:]


def _pad_input(t: torch.Tensor, begin: list[int], end: list[int], value: float = 0.0) -> tuple[torch.Tensor, list[int]]:
    """Symmetric pads go to the op; asymmetric ones are applied explicitly."""
    if begin == end:
        return t, begin
    spec: list[int] = []
    for b, e in reversed(list(zip(begin, end, strict=True))):
        spec += [b, e]
    return F.pad(t, spec, value=value), [0] * len(begin)


@kernel("Conv")
def _conv(a: dict[str, Any], x: list[Any]) -> list[Any]:
    nd = x[0].dim() - 2
    begin, end = _pads(a, nd)
    inp, padding = _pad_input(x[0], begin, end)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]
    bias = x[2] if len(x) > 2 else None
    return [conv(inp, x[1], bias, stride=a.get("strides", [1] * nd), padding=padding,
                 dilation=a.get("dilations", [1] * nd), groups=int(a.get("group", 1)))]


@kernel("MaxPool")
def _maxpool(a: dict[str, Any], x: list[Any]) -> list[Any]:
    nd = x[0].dim() - 2
    begin, end = _pads(a, nd)
    inp, padding = _pad_input(x[0], begin, end, float("-inf"))
    pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[nd]
    return [pool(inp, a["kernel_shape"], stride=a.get("strides", [1] * nd), padding=padding,
                 dilation=a.get("dilations", [1] * nd), ceil_mode=bool(a.get("ceil_mode", 0)))]


@kernel("AveragePool")
def _avgpool(a: dict[str, Any], x: list[Any]) -> list[Any]:
    nd = x[0].dim() - 2
    begin, end = _pads(a, nd)
    if begin != end:
        raise NotImplementedError("asymmetric pads in AveragePool")
    pool = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[nd]
    return [pool(x[0], a["kernel_shape"], stride=a.get("strides", [1] * nd), padding=begin,
                 ceil_mode=bool(a.get("ceil_mode", 0)), count_include_pad=bool(a.get("count_include_pad", 0)))]


@kernel("GlobalAveragePool")
def _gap(a: dict[str, Any], x: list[Any]) -> list[Any]:
    return [x[0].mean(dim=tuple(range(2, x[0].dim())), keepdim=True)]


@kernel("Reshape")
def _reshape(a: dict[str, Any], x: list[Any]) -> list[Any]:
    shape = _ints(x[1])
    if not a.get("allowzero", 0):
        shape = [x[0].shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return [x[0].reshape(shape)]


@kernel("Flatten")
def _flatten(a: dict[str, Any], x: list[Any]) -> list[Any]:
    axis = int(a.get("axis", 1))
    axis = axis + x[0].dim() if axis < 0 else axis
    lead = 1
    for d in x[0].shape[:axis]:
        lead *= d
    return [x[0].reshape(lead, -1)]


@kernel("Transpose")
def _transpose(a: dict[str, Any], x: list[Any]) -> list[Any]:
    perm = a.get("perm") or list(reversed(range(x[0].dim())))
    return [x[0].permute(*perm)]


@kernel("Concat")
def _concat(a: dict[str, Any], x: list[Any]) -> list[Any]:
    return [torch.cat([t for t in x if t is not None], dim=int(a["axis"]))]


@kernel("Split")
def _split(a: dict[str, Any], x: list[Any]) -> list[Any]:
    axis = int(a.get("axis", 0))
    if len(x) > 1 and x[1] is not None:
        return list(torch.split(x[0], _ints(x[1]), dim=axis))
    if "split" in a:  # an attribute before opset 13
        return list(torch.split(x[0], [int(v) for v in a["split"]], dim=axis))
    n = int(a["num_outputs"]) if "num_outputs" in a else int(a["_num_outputs"])
    size = -(-x[0].shape[axis] // n)
    return list(torch.split(x[0], size, dim=axis))


@kernel("Slice")
def _slice(a: dict[str, Any], x: list[Any]) -> list[Any]:
    t = x[0]
    if a.get("_opset", 10) < 10:  # starts, ends and axes were attributes
        starts, ends = [int(v) for v in a["starts"]], [int(v) for v in a["ends"]]
        axes = [int(v) for v in a["axes"]] if "axes" in a else list(range(len(starts)))
        steps = [1] * len(starts)
    else:
        starts, ends = _ints(x[1]), _ints(x[2])
        axes = _ints(x[3]) if len(x) > 3 and x[3] is not None else list(range(len(starts)))
        steps = _ints(x[4]) if len(x) > 4 and x[4] is not None else [1] * len(starts)
    index: list[Any] = [slice(None)] * t.dim()
    for s, e, ax, st in zip(starts, ends, axes, steps, strict=True):
        ax %= t.dim()
        n = t.shape[ax]
        if st > 0:
            index[ax] = slice(max(0, min(n, s + n if s < 0 else s)), max(0, min(n, e + n if e < 0 else e)), st)
        else:  # negative step: torch has none; slice then flip
            s = min(n - 1, s + n if s < 0 else s)
            e = e + n if e < 0 else e
            e = max(-1, min(n - 1, e))
            idx = torch.arange(s, e, st, device=t.device)
            t = t.index_select(ax, idx)
    return [t[tuple(index)]]


@kernel("Gather")
def _gather(a: dict[str, Any], x: list[Any]) -> list[Any]:
    axis = int(a.get("axis", 0)) % x[0].dim()
    idx = x[1].long()
    idx = torch.where(idx < 0, idx + x[0].shape[axis], idx)
    out = x[0].index_select(axis, idx.reshape(-1))
    shape = list(x[0].shape[:axis]) + list(idx.shape) + list(x[0].shape[axis + 1:])
    return [out.reshape(shape)]


@kernel("Unsqueeze")
def _unsqueeze(a: dict[str, Any], x: list[Any]) -> list[Any]:
    axes = _ints(x[1]) if len(x) > 1 else list(a["axes"])
    t = x[0]
    rank = t.dim() + len(axes)
    for ax in sorted(ax % rank for ax in axes):
        t = t.unsqueeze(ax)
    return [t]


@kernel("Squeeze")
def _squeeze(a: dict[str, Any], x: list[Any]) -> list[Any]:
    axes = _ints(x[1]) if len(x) > 1 and x[1] is not None else a.get("axes")
    if axes is None:
        return [x[0].squeeze()]
    return [x[0].squeeze(tuple(ax % x[0].dim() for ax in axes))]


@kernel("Shape")
def _shape(a: dict[str, Any], x: list[Any]) -> list[Any]:
    dims = list(x[0].shape)[int(a.get("start", 0)): a.get("end")]
    return [torch.tensor(dims, dtype=torch.int64)]


@kernel("Expand")
def _expand(a: dict[str, Any], x: list[Any]) -> list[Any]:
    shape = _ints(x[1])
    return [x[0] * torch.ones(shape, dtype=x[0].dtype, device=x[0].device)]


@kernel("ConstantOfShape")
def _cos(a: dict[str, Any], x: list[Any]) -> list[Any]:
    value = a.get("value")
    fill = torch.as_tensor(value).reshape(-1)[0] if value is not None else torch.tensor(0.0)
    return [torch.full(_ints(x[0]), fill.item(), dtype=fill.dtype)]


@kernel("Constant")
def _constant(a: dict[str, Any], x: list[Any]) -> list[Any]:
    for key in ("value", "value_float", "value_int", "value_floats", "value_ints"):
        if key in a:
            return [torch.as_tensor(a[key])]
    raise NotImplementedError("Constant without a value attribute")


@kernel("Range")
def _range(a: dict[str, Any], x: list[Any]) -> list[Any]:
    return [torch.arange(x[0].item(), x[1].item(), x[2].item(), dtype=x[0].dtype)]


def _reduce(fn: Callable[..., torch.Tensor]) -> Kernel:
    def run(a: dict[str, Any], x: list[Any]) -> list[Any]:
        axes = _ints(x[1]) if len(x) > 1 and x[1] is not None else a.get("axes")
        keep = bool(a.get("keepdims", 1))
        if not axes:
            if a.get("noop_with_empty_axes", 0):
                return [x[0]]
            axes = list(range(x[0].dim()))
        # torch sums small ints into int64; ONNX keeps the input type.
        return [fn(x[0], dim=tuple(axes), keepdim=keep).to(x[0].dtype)]
    return run


KERNELS.update({
    "ReduceMean": _reduce(torch.mean), "ReduceSum": _reduce(torch.sum),
    "ReduceMax": _reduce(torch.amax), "ReduceMin": _reduce(torch.amin),
})


@kernel("GatherElements")
def _gather_elements(a: dict[str, Any], x: list[Any]) -> list[Any]:
    axis = int(a.get("axis", 0)) % x[0].dim()
    idx = x[1].long()
    idx = torch.where(idx < 0, idx + x[0].shape[axis], idx)
    return [torch.gather(x[0], axis, idx)]


@kernel("Tile")
def _tile(a: dict[str, Any], x: list[Any]) -> list[Any]:
    return [x[0].repeat(*_ints(x[1]))]


@kernel("Trilu")
def _trilu(a: dict[str, Any], x: list[Any]) -> list[Any]:
    k = int(x[1].item()) if len(x) > 1 and x[1] is not None else 0
    return [torch.triu(x[0], k) if int(a.get("upper", 1)) else torch.tril(x[0], k)]


@kernel("CumSum")
def _cumsum(a: dict[str, Any], x: list[Any]) -> list[Any]:
    axis = int(x[1].item())
    t = x[0].flip(axis) if a.get("reverse") else x[0]
    out = torch.cumsum(t, axis).to(t.dtype)
    if a.get("exclusive"):
        out = out - t
    return [out.flip(axis) if a.get("reverse") else out]


@kernel("IsNaN")
def _isnan(a: dict[str, Any], x: list[Any]) -> list[Any]:
    return [torch.isnan(x[0])]


@kernel("GatherND")
def _gather_nd(a: dict[str, Any], x: list[Any]) -> list[Any]:
    data, idx, b = x[0], x[1].long(), int(a.get("batch_dims", 0))
    batch = data.shape[:b]
    data_f = data.reshape(-1, *data.shape[b:])
    idx_f = idx.reshape(-1, *idx.shape[b:])
    k = idx.shape[-1]
    outs = []
    for d, i in zip(data_f, idx_f, strict=True):
        i = torch.where(i < 0, i + torch.tensor(d.shape[:k], device=i.device), i)
        outs.append(d[tuple(i.unbind(-1))])
    out = torch.stack(outs)
    return [out.reshape(*batch, *out.shape[1:])]
