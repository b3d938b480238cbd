"""Typed records exchanged between the core and plugins.

Every value a plugin returns through a hook is validated against one of these
models; a value that does not validate is dropped and the plugin is reported
(see :mod:`dspark.host.plugin_manager`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

DType = Literal[
    "float64", "float32", "float16", "bfloat16",
    "int64", "int32", "int16", "int8", "uint8", "int4", "uint4", "bool",
]
DeviceKind = Literal["cpu", "cuda", "gpu", "npu", "other"]

_DEVICE_ID = re.compile(r"^[a-z][a-z0-9_]*(:\d+)?$")

# Relative and absolute tolerances a runtime may claim for each precision it
# runs at. The conformance kit and the executor compare against the fp32
# torch reference with these.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-6, 1e-7),
    "float32": (1e-4, 1e-5),
    "float16": (1e-2, 1e-3),
    "bfloat16": (5e-2, 1e-2),
    "int8": (1e-1, 5e-2),
    "int4": (2.5e-1, 1e-1),
}


class HardwareUnavailable(Exception):
    """Raised by ``dspark_probe_devices`` when the plugin's hardware is absent.

    The message is the reason shown in ``dspark devices`` (for example "no
    NVIDIA driver: libnvidia-ml.so.1 not found"). It is not a failure: the
    plugin's status becomes ``no hardware``.
    """


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class Device(_Strict):
    """One physical device as one plugin drives it with one runtime.

    Several plugins may report the same ``id`` (the CPU is driven by OpenVINO,
    ONNX Runtime and torch); the inventory merges them and shows every driver.
    """

    id: str = Field(description="Physical device id: 'cpu', 'cuda:0', 'npu:0'.")
    kind: DeviceKind
    name: str = Field(min_length=1, description="Marketing/driver name of the device.")
    runtime: str = Field(min_length=1, description="How this plugin drives it, e.g. 'openvino/CPU'.")
    plugin: str = Field("", description="Filled in by the core: the reporting plugin's name.")
    memory_total_bytes: int | None = Field(None, ge=0)
    memory_free_bytes: int | None = Field(None, ge=0)
    peak_flops: dict[str, float] = Field(
        default_factory=dict, description="Peak ops/s per dtype on this runtime (measured or spec)."
    )
    memory_bandwidth_bytes_per_s: float | None = Field(None, gt=0)
    host_link_bandwidth_bytes_per_s: float | None = Field(
        None, gt=0, description="Bandwidth between host memory and this device; None for host memory."
    )
    dtypes: list[DType] = Field(default_factory=list, description="Dtypes this runtime computes in.")
    utilization: float | None = Field(None, ge=0.0, le=1.0, description="Current load, 0..1.")
    properties: dict[str, Any] = Field(default_factory=dict, description="Runtime-specific details.")

    @field_validator("id")
    @classmethod
    def _check_id(cls, v: str) -> str:
        if not _DEVICE_ID.match(v):
            raise ValueError(f"device id {v!r} is not of the form 'kind' or 'kind:N'")
        return v

    @field_validator("peak_flops")
    @classmethod
    def _check_flops(cls, v: dict[str, float]) -> dict[str, float]:
        for dtype, flops in v.items():
            if not flops > 0:
                raise ValueError(f"peak_flops[{dtype!r}] must be > 0, got {flops!r}")
        return v


class Unavailable(_Strict):
    """Something a plugin found but cannot drive, returned among its devices.

    For example an ONNX Runtime execution provider that is compiled in but
    fails to create a session (no driver). Shown under the plugin in
    ``dspark devices`` so nothing is skipped silently.
    """

    what: str = Field(min_length=1, description="Device id or runtime name, e.g. 'CUDAExecutionProvider'.")
    reason: str = Field(min_length=1)


class Bid(_Strict):
    """A plugin's offer to run one subgraph on one of its devices."""

    plugin: str = Field("", description="Filled in by the core.")
    device_id: str
    runtime: str = Field(min_length=1)
    latency_s: float = Field(ge=0.0, description="Predicted wall time of one run of the subgraph.")
    peak_memory_bytes: int = Field(ge=0, description="Device memory the compiled subgraph needs.")
    precision: DType = Field(description="Precision the subgraph computes in.")
    fixed_overhead_s: float = Field(
        0.0, ge=0.0, description="Part of latency_s paid once per compiled call (dispatch), not per op."
    )
    source: Literal["roofline", "calibrated", "measured", "other"] = "roofline"
    note: str = ""


class DecoderBid(_Strict):
    """A plugin's offer to compile a decoder spec (:class:`dspark.sdk.decoder.DecoderSpec`) for one of its devices; ``declined`` says why it will not.

    Bidding is a promise: a plugin that bids must compile and produce the torch reference's
    logits (within float rounding), or decline. The engine measures each bid's compiled
    decoder at its real step shapes before choosing, so no latency is asked for here.
    """

    plugin: str = Field("", description="Filled in by the core.")
    device_id: str
    runtime: str = Field(min_length=1, description="e.g. 'openvino/CPU' or 'onnxruntime/CPUExecutionProvider'")
    runtime_version: str = ""
    precision: str = Field("float32", description="What the weights compute in.")
    kv_dtype: str = "float32"
    block_size: int | None = Field(None, ge=1, description="KV block size it needs; None: any the engine picks.")
    weight_bytes: int = Field(0, ge=0, description="Device memory for the weights of the range.")
    kv_bytes_per_token: int = Field(0, ge=0, description="Device memory per cached token, all layers of the range.")
    exit_layers: bool = Field(False, description="Runs StepBatch.exit_layer (self-drafting's early exit).")
    kv: Literal["paged", "sequence"] = Field(
        "paged", description="API 1.8: 'sequence' when the runtime keeps the KV per sequence itself "
        "(dspark.sdk.decoder.SequenceDecoder) instead of in the engine's blocks.")
    max_seqs: int | None = Field(None, ge=1, description="API 1.8: the most live sequences it holds; None = any.")
    declined: str | None = Field(None, description="Set when the plugin will not run this spec: why.")
    note: str = ""


class PluginStatus(str, Enum):
    ACTIVE = "active"
    NO_HARDWARE = "no hardware"
    FAILED = "failed"
    BLOCKED = "blocked"


FaultScope = Literal["subgraph", "device", "plugin"]


class PluginFault(BaseModel):
    """One kind of failure of one plugin, counted (API 1.4): shown by ``dspark devices`` and ``dspark plan``.

    ``charged_to`` is what the failure cost the plugin: only that subgraph
    signature on that device, the whole device, or the whole plugin (see
    docs/plugins.md, "Fault rules").
    """

    plugin: str
    hook: str = Field(description="The hook that failed, or 'run' for a compiled executable's run().")
    subgraph: str | None = Field(None, description="Signature of the subgraph (Subgraph.signature()), if any.")
    ops: str = Field("", description="The subgraph's op types, for people.")
    device: str | None = None
    reason: str
    count: int = Field(1, ge=1)
    charged_to: FaultScope = "subgraph"


class PluginRecord(BaseModel):
    """What the core knows about one plugin: shown by ``dspark devices``."""

    name: str
    version: str = ""
    module: str = ""
    source: Literal["builtin", "entry point", "command line"] = "entry point"
    api_version: str = ""
    status: PluginStatus = PluginStatus.ACTIVE
    reason: str = ""
    devices: list[str] = Field(default_factory=list)
    unavailable: list[Unavailable] = Field(default_factory=list, description="What it found but cannot drive.")
    faults: list[PluginFault] = Field(default_factory=list, description="Every failure so far, counted (API 1.4).")


class QuantSpec(_Strict):
    """A quantization scheme requested for the weights of a subgraph."""

    weight_bits: Literal[8, 4] = 8
    granularity: Literal["per_channel", "group"] = "per_channel"
    group_size: int = Field(128, gt=0)
    symmetric: bool = True
    activations: Literal["float", "dynamic_int8"] = "float"

    @property
    def precision(self) -> DType:
        return "int8" if self.weight_bits == 8 else "int4"


@runtime_checkable
class Executable(Protocol):
    """A subgraph compiled by a plugin for one device."""

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once on host arrays keyed by the subgraph's input names; return its outputs."""
        ...


def torch_runner(exe: Executable) -> Any:
    """The executable's ``run_torch`` (API 1.2, optional), or None.

    ``run_torch(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]``
    takes and returns tensors on the device's torch device (``cuda:0`` for a
    GPU, the host for a CPU), so an in-process caller such as the LLM engine
    skips the host round trip of ``run``. Results must equal ``run``'s.
    """
    fn = getattr(exe, "run_torch", None)
    return fn if callable(fn) else None


class Draft(BaseModel):
    """Tokens proposed by a drafter, with their proposal distributions when known.

    ``probs`` must be the distributions the tokens were *sampled* from: the
    verifier's rejection rule (accept with min(1, p/q)) is only lossless for
    those. A drafter that picks its tokens deterministically (argmax, lookup)
    leaves ``probs`` at None and the verifier treats each token as certain
    (q one-hot), which is lossless too. ``confidence`` (API 1.1) is the
    drafter's own estimate that each token is right, e.g. its probability
    for the token; the speculative-decoding controller learns from it how far
    a draft is worth verifying. ``source`` (API 1.3) tells a copy where it was
    copied from: whether that lies in the prompt or in the text generated so
    far is a feature of the controller's acceptance predictor (a model
    repeating its own output and one re-typing its prompt hold a copy for
    very different lengths).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    tokens: list[int]
    probs: np.ndarray | None = Field(
        None, description="(len(tokens), vocab) proposal probabilities; None for deterministic drafters."
    )
    confidence: list[float] | None = Field(
        None, description="Per token, the drafter's estimate in [0, 1] that it is right (API 1.1); None = unknown."
    )
    source: int | None = Field(
        None, description="For a drafter that copies from the context (lookup): the index in the request's "
        "tokens where the copied run starts (API 1.3); None = not a copy.", ge=0,
    )


@dataclass(eq=False)
class DraftRequest:
    """One sequence's drafting job in a batched call (``Drafter.propose_batch``, API 1.1).

    ``tokens`` is the sequence's whole context (prompt and output so far);
    treat it as read-only. The same ``seq_id`` comes back every step with a
    context that extends the previous one by the tokens the verifier kept,
    so a stateful drafter (one with its own KV cache) can keep what still
    matches and roll back the rest.
    """

    seq_id: str
    tokens: list[int]
    k: int
    temperature: float = 0.0  # > 0: the drafter may sample, and must then return the probs it sampled from
    generator: Any = None  # a torch.Generator to sample with (seeded requests stay reproducible), or None
    # Called by the drafter after its j-th token (1-based) with that token's confidence; False means
    # the controller expects no gain from more tokens of this sequence, so stop drafting it.
    keep_going: Callable[[int, float], bool] | None = None
    # API 1.9, for drafters with a ``target_rows`` attribute N > 0 (feature-level heads): the target's
    # own output rows at the context's last positions, oldest first, at most N; the last one is the
    # row at position len(tokens) - 2, the one that chose ``tokens[-1]``. Each is a 1-d float torch
    # tensor: the final-normed hidden state [hidden] or the raw logits [vocab], whichever the target's
    # forward gave (tell them apart by length). None when the engine has none (standalone ``propose``).
    target_rows: list[Any] | None = None


@runtime_checkable
class Drafter(Protocol):
    """Proposes up to ``k`` continuation tokens for a token sequence.

    Only ``propose`` is required. A drafter may also define (API 1.1), and the
    engine then uses them:

    - ``propose_batch(requests: list[DraftRequest]) -> list[Draft]``: all the
      step's sequences at once (a draft model runs one forward per draft
      position for the whole batch), one ``Draft`` per request, in order.
    - ``commit(seq_id: str, num_tokens: int)``: after verification, only the
      first ``num_tokens`` tokens of the last proposal's context followed by
      its draft are final; state beyond them (K/V of rejected tokens) can be
      dropped now.
    - ``release(seq_id: str)``: the sequence is finished; free its state.
    """

    def propose(self, tokens: list[int], k: int) -> Draft: ...


class TargetModel(_Strict):
    """What a drafting hook learns about the model it drafts for."""

    name: str
    path: str | None = None
    architecture: str = "llama"
    vocab_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    tokenizer_fingerprint: str = ""
    properties: dict[str, Any] = Field(default_factory=dict)
    runtime: Any = Field(
        None, exclude=True, repr=False,
        description="API 1.1: what runs the target in-process: its ``runner`` and KV ``cache``, so a drafter "
        "can reuse the target's own weights and cache (self-speculation), and ``place_decoder`` (or None); "
        "not the engine itself. None when not in-process.")


class DrafterSpec(BaseModel):
    """A drafter a plugin offers for a target model."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    name: str = Field(min_length=1)
    kind: Literal["model", "self", "ngram", "other"]
    plugin: str = ""
    description: str = ""
    create: Any = Field(description="Zero-argument callable returning a Drafter.")

    @field_validator("create")
    @classmethod
    def _callable(cls, v: Any) -> Any:
        if not callable(v):
            raise ValueError("create must be a zero-argument callable returning a Drafter")
        return v
