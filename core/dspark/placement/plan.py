"""Placement plans: which target runs which ops, saved and loaded as JSON."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, Field

from dspark.graph.model import Graph


class Target(BaseModel):
    """A (plugin, device) pair: the unit ops are assigned to."""

    plugin: str
    device_id: str
    runtime: str = ""

    @property
    def key(self) -> str:
        return f"{self.plugin}@{self.device_id}"


class BidSummary(BaseModel):
    target: str
    latency_ms: float
    precision: str


class Partition(BaseModel):
    id: int
    target: Target
    ops: list[str]
    inputs: list[str] = Field(default_factory=list)
    outputs: list[str] = Field(default_factory=list)
    predicted_ms: float
    precision: str = "float32"
    depends_on: list[int] = Field(default_factory=list)
    beaten_bids: list[BidSummary] = Field(default_factory=list, description="Other targets' bids for these ops.")
    boundary_bytes_in: int = 0

    @property
    def device(self) -> str:
        return self.target.device_id

    @property
    def plugin(self) -> str:
        return self.target.plugin


class Plan(BaseModel):
    """An explained placement: partitions in dependency order plus the figures behind it."""

    model: str
    graph_fingerprint: str
    hardware_fingerprint: str
    partitions: list[Partition]
    predicted_total_ms: float
    transfer_ms: float = 0.0
    best_single_target: str = ""
    best_single_ms: float = 0.0
    gate: str = Field("", description="Why this plan and not a single target.")
    solver: str = ""
    decision: str = Field("", description="How it won against its rivals: by prediction, or measured "
                                          "against those whose predictions were within the cost model's error.")

    def to_json_dict(self) -> dict[str, object]:
        data = self.model_dump(mode="json")
        for part, obj in zip(data["partitions"], self.partitions, strict=True):  # type: ignore[arg-type]
            part["device"], part["plugin"] = obj.device, obj.plugin
        return data

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json_dict(), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            return cls.model_validate_json(Path(path).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"plan file not found: {path}") from None

    def assignment(self) -> dict[str, str]:
        return {op: p.target.key for p in self.partitions for op in p.ops}


def graph_fingerprint(graph: Graph) -> str:
    """Changes when the model's structure, shapes (dim hints included) or weights change."""
    h = hashlib.sha256()
    for op in graph.ops:
        h.update(json.dumps([op.name, op.op_type, op.inputs, op.outputs, sorted(map(str, op.attrs.items()))],
                            default=str).encode())
    for name in sorted(graph.tensors):
        h.update(f"{name}:{graph.tensors[name].dtype}:{graph.tensors[name].shape}".encode())
    h.update(json.dumps(sorted(graph.dim_hints.items())).encode())  # a plan is made at these sizes
    for name in sorted(graph.initializers):
        arr = graph.initializers[name]
        h.update(name.encode())
        h.update(arr.tobytes()[:4096])
        h.update(str(arr.shape).encode())
    return h.hexdigest()[:16]


def hardware_fingerprint(targets: list[Target]) -> str:
    """Changes when the set of (plugin, device, runtime) targets changes."""
    keys = sorted(f"{t.key}/{t.runtime}" for t in targets)
    return hashlib.sha256("|".join(keys).encode()).hexdigest()[:16]


def tensor_bytes(graph: Graph, names: list[str]) -> int:
    """Bytes of these tensors at the graph's dim hints (unknown sizes count 0): what a partition boundary carries."""
    total = 0
    for t in names:
        spec = graph.tensors.get(t)
        total += (spec.nbytes(graph.dim_hints) if spec else 0) or 0
    return total
