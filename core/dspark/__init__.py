"""dspark: a pluggable inference runtime.

Hardware plugins, discovered from installed packages through the ``dspark``
entry-point group, probe devices, bid on subgraphs, compile them, quantize
and draft; the core places each op where its predicted cost is lowest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dspark.hookspecs import API_VERSION, hookimpl, hookspec
from dspark.types import (
    TOLERANCES,
    Bid,
    DecoderBid,
    Device,
    Draft,
    Drafter,
    DraftRequest,
    DrafterSpec,
    Executable,
    HardwareUnavailable,
    PluginRecord,
    PluginStatus,
    QuantSpec,
    TargetModel,
    Unavailable,
)

if TYPE_CHECKING:
    from dspark.graph import Graph, Op, Subgraph, TensorSpec
    from dspark.graph.jax_import import import_jax
    from dspark.host.inventory import Inventory
    from dspark.llm import LLM, SamplingParams, optimize_model
    from dspark.llm.quantization import QuantizationConfig, QuantPlan
    from dspark.host.plugin_manager import PluginHost
    from dspark.session import NodeArg, Session, SessionError

__version__ = "0.1.0"

__all__ = [
    "API_VERSION", "TOLERANCES", "Bid", "DecoderBid", "Device", "Draft", "DraftRequest", "Drafter", "DrafterSpec", "Executable",
    "Graph", "HardwareUnavailable", "Inventory", "LLM", "NodeArg", "Op", "PluginHost", "PluginRecord", "PluginStatus",
    "QuantPlan", "QuantSpec", "QuantizationConfig", "SamplingParams", "Session", "SessionError", "Subgraph", "TargetModel", "TensorSpec", "Unavailable", "hookimpl", "hookspec",
    "__version__", "import_jax", "optimize_model",
]

_LAZY = {
    "Graph": "dspark.graph", "Op": "dspark.graph", "Subgraph": "dspark.graph", "TensorSpec": "dspark.graph",
    "Inventory": "dspark.host.inventory", "PluginHost": "dspark.host.plugin_manager",
    "LLM": "dspark.llm", "SamplingParams": "dspark.llm", "optimize_model": "dspark.llm",
    "QuantizationConfig": "dspark.llm.quantization", "QuantPlan": "dspark.llm.quantization",
    "import_jax": "dspark.graph.jax_import",
    "Session": "dspark.session", "SessionError": "dspark.session", "NodeArg": "dspark.session",
}


def __getattr__(name: str) -> Any:
    # Keep ``import dspark`` light: a plugin importing the markers should not
    # pay for the plugin manager or the graph model.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dspark' has no attribute {name!r}")
