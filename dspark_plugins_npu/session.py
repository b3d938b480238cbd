"""Creating ONNX Runtime sessions pinned to one execution provider, never silently on the CPU.

ONNX Runtime quietly falls back to the CPU provider when another one fails
to load; every session made here is checked with ``get_providers()`` and a
fallback becomes an :class:`EpUnusable` error that says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

from dspark_plugins_npu import providers

# ORT's own logger prints provider-load errors to stderr; we report them ourselves.
_ORT_SILENT = 4  # FATAL only
_ORT_DEFAULT = 2  # WARNING, ONNX Runtime's initial default
_quiet_lock = threading.Lock()
_quiet_depth = 0

# "/onnxruntime_src/.../file.cc:729 void ns::Func(args) message" -> "message"
_SRC_PREFIX = re.compile(r"\S+\.(?:cc|cpp|h):\d+ (?:[^()]*\([^()]*\)(?: const)?\s+)?")


class EpUnusable(RuntimeError):
    """The execution provider is listed but cannot run this model; the message says why."""


def ort() -> Any:
    import onnxruntime

    return onnxruntime


@contextlib.contextmanager
def quiet_ort() -> Iterator[None]:
    """Hold ORT's process-wide logger at FATAL while providers that may not load are tried."""
    global _quiet_depth
    rt = ort()
    with _quiet_lock:
        _quiet_depth += 1
        rt.set_default_logger_severity(_ORT_SILENT)
    try:
        yield
    finally:
        with _quiet_lock:
            _quiet_depth -= 1
            if _quiet_depth == 0:
                rt.set_default_logger_severity(_ORT_DEFAULT)


def clean_error(exc: BaseException) -> str:
    """ORT's exception text without the C++ source location and signature."""
    text = " ".join(str(exc).split())
    text = _SRC_PREFIX.sub("", text)
    return text[:400] or type(exc).__name__


def library_problem(ep: str) -> str | None:
    """Why the EP's provider library fails to load (e.g. which dependency is missing), if it does."""
    lib = providers.info(ep).library
    if lib is None:
        return None
    path = os.path.join(os.path.dirname(ort().__file__), "capi", f"libonnxruntime_providers_{lib}.so")
    if not os.path.exists(path):
        return None  # statically linked or named differently: nothing to tell
    try:
        ctypes.CDLL(path)  # ORT already tried to load it, so this costs nothing new
    except OSError as exc:
        return f"{os.path.basename(path)} fails to load: {str(exc).replace(path + ': ', '')}"
    return None


def hardware_hint(ep: str) -> str | None:
    """A note on missing hardware that explains a failure, when we can tell cheaply."""
    if providers.info(ep).id_prefix == "cuda" and not os.path.exists("/dev/nvidiactl") \
            and providers.nvidia_gpu_count() == 0:
        return "no NVIDIA driver or GPU (/dev/nvidiactl absent)"
    return None


def session_options(*, strict: bool, log_level: int = _ORT_SILENT, record_assignment: bool = False) -> Any:
    rt = ort()
    so = rt.SessionOptions()
    so.log_severity_level = log_level  # every failure reaches the caller as an exception
    so.graph_optimization_level = rt.GraphOptimizationLevel.ORT_ENABLE_ALL
    if strict:
        # Fail session creation when the EP does not claim every node, instead of
        # quietly placing the rest on the CPU provider.
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    if record_assignment:
        so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    # ORT's worker threads spin after each run by default. Our sessions run between torch
    # ops in the same process (the LLM engine calls them once per layer and step), so
    # spinning threads steal the cores torch needs next (docs/architecture.md, measured facts).
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return so


def create(model: bytes, ep: str, index: int = 0, *, strict: bool | None = None,
           record_assignment: bool = False) -> Any:
    """An ``InferenceSession`` on ``model`` that really runs on ``ep``; :class:`EpUnusable` otherwise.

    ``strict`` (default: every EP but the CPU's) also refuses a model whose
    nodes the EP does not all claim.
    """
    rt = ort()
    strict = ep != providers.CPU_EP if strict is None else strict
    so = session_options(strict=strict, record_assignment=record_assignment)
    opts = providers.provider_options(ep, index)
    try:
        # enable_fallback=0: raise instead of ORT's print-and-retry-on-CPU.
        sess = rt.InferenceSession(model, so, providers=[(ep, opts)] if opts else [ep], enable_fallback=0)
    except Exception as exc:
        raise EpUnusable(_explain(ep, f"creating a session on {ep} failed: {clean_error(exc)}")) from exc
    used = sess.get_providers()
    if ep not in used:
        raise EpUnusable(_explain(ep, f"a session asked for {ep} fell back to {', '.join(used) or 'nothing'}: "
                                      "provider library failed to load"))
    return sess


def _explain(ep: str, what: str) -> str:
    parts = [what]
    for extra in (library_problem(ep), hardware_hint(ep)):
        if extra:
            parts.append(extra)
    return "; ".join(parts)


def assigned_nodes(sess: Any) -> dict[str, int]:
    """Node count per EP in a session made with ``record_assignment`` (empty if ORT cannot tell)."""
    counts: dict[str, int] = {}
    try:
        for sg in sess.get_provider_graph_assignment_info():
            counts[sg.ep_name] = counts.get(sg.ep_name, 0) + len(sg.get_nodes())
    except Exception:  # older ORT: no assignment report
        return {}
    return counts
