"""The plugin SDK (plugin API 1.4): what plugin authors use besides the hookspecs, types and graph.

A plugin imports only :mod:`dspark` (its top-level names), :mod:`dspark.hookspecs`,
:mod:`dspark.types`, :mod:`dspark.graph`, :mod:`dspark.sdk` and :mod:`dspark.testing`;
every name below is documented in ``docs/plugins.md`` ("The SDK"). The SDK is
versioned with the plugin API (:data:`dspark.API_VERSION`): a minor version only adds names.

- whole-decoder targets (API 1.6): :mod:`decoder` (``DecoderSpec``, ``StepBatch``, ``CompiledDecoder``, ...);
  every family's decoder written once over ops a plugin supplies (API 1.10): :mod:`family`
- calibrated estimates: :mod:`calibration` (``estimate``, ``Estimate``, ``CannotCalibrate``,
  ``calibration_enabled``, ``make_inputs``, ``streams_weights``); ``DSPARK_CALIBRATE=0`` turns them off
- timing and roofline: :mod:`cost` (``time_call``, ``roofline``, ``DEFAULT_OP_OVERHEAD_S``)
- the disk cache: :mod:`cache`; host facts: :mod:`hostinfo` (``cpu_benchmark_lock``); a probe's device list
  kept there (API 1.16): :mod:`devices` (``cached_devices``, ``store_devices``)
- weights a runtime maps from a file and holds once (API 1.12): :mod:`mapped` (``MappedWeights``)
- quantization layouts: :mod:`quant` (``QuantizedWeight``, ``quantize_weight``, ...)
- logging: ``get_logger``
- the torch reference executor: ``ReferenceExecutable``, ``REFERENCE_OPS``,
  ``reference_problem``, ``unsupported_ops``

Every name is loaded on first use: ``import dspark.sdk`` imports neither numpy nor
torch, and torch is imported only when a :class:`ReferenceExecutable` is built.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dspark.host import cache, hostinfo
    from dspark.host.hostinfo import cpu_benchmark_lock
    from dspark.host.log import get_logger
    from dspark.sdk import calibration, cost, decoder, devices, family, mapped, quant, reference
    from dspark.sdk.devices import cached_devices, store_devices
    from dspark.sdk.mapped import MappedWeights, release_file, resident_file
    from dspark.sdk.calibration import (
        CannotCalibrate,
        Estimate,
        estimate,
        make_inputs,
        streams_weights,
    )
    from dspark.sdk.calibration import enabled as calibration_enabled
    from dspark.sdk.cost import DEFAULT_OP_OVERHEAD_S, roofline, time_call
    from dspark.sdk.quant import (
        QuantizedWeight,
        dequantize,
        linear_subgraph,
        quantizable_weights,
        quantize_activations_per_token,
        quantize_weight,
        reference_linear,
        unpack_int4,
    )
    from dspark.sdk.reference import (
        REFERENCE_OPS,
        ReferenceExecutable,
        reference_problem,
        unsupported_ops,
    )

# name -> (module, attribute); attribute None: the module itself.
_NAMES: dict[str, tuple[str, str | None]] = {
    # modules
    "cache": ("dspark.host.cache", None),
    "calibration": ("dspark.sdk.calibration", None),
    "cost": ("dspark.sdk.cost", None),
    "decoder": ("dspark.sdk.decoder", None),
    "devices": ("dspark.sdk.devices", None),
    "family": ("dspark.sdk.family", None),
    "hostinfo": ("dspark.host.hostinfo", None),
    "mapped": ("dspark.sdk.mapped", None),
    "quant": ("dspark.sdk.quant", None),
    "reference": ("dspark.sdk.reference", None),
    # calibrated estimates
    "CannotCalibrate": ("dspark.sdk.calibration", "CannotCalibrate"),
    "Estimate": ("dspark.sdk.calibration", "Estimate"),
    "calibration_enabled": ("dspark.sdk.calibration", "enabled"),
    "estimate": ("dspark.sdk.calibration", "estimate"),
    "make_inputs": ("dspark.sdk.calibration", "make_inputs"),
    "streams_weights": ("dspark.sdk.calibration", "streams_weights"),
    # timing and roofline
    "DEFAULT_OP_OVERHEAD_S": ("dspark.sdk.cost", "DEFAULT_OP_OVERHEAD_S"),
    "roofline": ("dspark.sdk.cost", "roofline"),
    "time_call": ("dspark.sdk.cost", "time_call"),
    # weights mapped from a file, held once
    "MappedWeights": ("dspark.sdk.mapped", "MappedWeights"),
    "release_file": ("dspark.sdk.mapped", "release_file"),
    "resident_file": ("dspark.sdk.mapped", "resident_file"),
    # host facts
    "cpu_benchmark_lock": ("dspark.host.hostinfo", "cpu_benchmark_lock"),
    "cached_devices": ("dspark.sdk.devices", "cached_devices"),
    "store_devices": ("dspark.sdk.devices", "store_devices"),
    # quantization
    "QuantizedWeight": ("dspark.sdk.quant", "QuantizedWeight"),
    "dequantize": ("dspark.sdk.quant", "dequantize"),
    "linear_subgraph": ("dspark.sdk.quant", "linear_subgraph"),
    "quantizable_weights": ("dspark.sdk.quant", "quantizable_weights"),
    "quantize_activations_per_token": ("dspark.sdk.quant", "quantize_activations_per_token"),
    "quantize_weight": ("dspark.sdk.quant", "quantize_weight"),
    "reference_linear": ("dspark.sdk.quant", "reference_linear"),
    "unpack_int4": ("dspark.sdk.quant", "unpack_int4"),
    # logging
    "get_logger": ("dspark.host.log", "get_logger"),
    # the reference executor
    "REFERENCE_OPS": ("dspark.sdk.reference", "REFERENCE_OPS"),
    "ReferenceExecutable": ("dspark.sdk.reference", "ReferenceExecutable"),
    "reference_problem": ("dspark.sdk.reference", "reference_problem"),
    "unsupported_ops": ("dspark.sdk.reference", "unsupported_ops"),
}

__all__ = [
    "DEFAULT_OP_OVERHEAD_S",
    "REFERENCE_OPS",
    "CannotCalibrate",
    "Estimate",
    "MappedWeights",
    "QuantizedWeight",
    "ReferenceExecutable",
    "cache",
    "calibration",
    "calibration_enabled",
    "cost",
    "decoder",
    "devices",
    "family",
    "cpu_benchmark_lock",
    "cached_devices",
    "store_devices",
    "dequantize",
    "estimate",
    "get_logger",
    "hostinfo",
    "mapped",
    "linear_subgraph",
    "make_inputs",
    "quant",
    "quantizable_weights",
    "quantize_activations_per_token",
    "quantize_weight",
    "reference",
    "reference_linear",
    "release_file",
    "resident_file",
    "reference_problem",
    "roofline",
    "streams_weights",
    "time_call",
    "unpack_int4",
    "unsupported_ops",
]


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'dspark.sdk' has no attribute {name!r} (the SDK's names: dspark.sdk.__all__)")
    module, attr = _NAMES[name]
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

if set(__all__) != set(_NAMES):  # pragma: no cover - a mistake when editing this file
    raise ImportError(f"dspark.sdk: __all__ and the lazy table differ: {set(__all__) ^ set(_NAMES)}")
