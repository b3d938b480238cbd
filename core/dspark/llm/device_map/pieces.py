"""A device map: where the embedding, each decoder layer and the head run, and who runs each range.

One type for every way an LLM is put on devices: the torch runner's layers spread over the devices torch
drives, a plugin's compiled decoder holding the whole model on one device, and compiled decoders holding
consecutive layer ranges on several devices. ``runs`` names who executes a device's layers (``"torch"`` or
the plugin whose compiled decoder holds them); ``plugin`` on a piece is the plugin whose op bid won the piece in
the placer, which is informational where torch runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dspark.graph.model import Graph
from dspark.placement.plan import Plan


@dataclass(frozen=True)
class Piece:
    """One piece of the model (embedding, a decoder layer, the head) and where it runs."""

    name: str
    device_id: str  # the inventory's device id: "cpu", "cuda:0", "gpu:0" ...
    plugin: str  # the plugin whose bid won the piece in the placer
    runtime: str
    weight_bytes: int
    kv_bytes: int = 0

    @property
    def memory_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True)
class Stage:
    """Consecutive layers ``[start, end)`` on one device, executed by ``runs``."""

    device_id: str
    start: int
    end: int
    runs: str

    def __str__(self) -> str:
        return f"{self.runs}@{self.device_id}[{self.start}:{self.end}]"


@dataclass
class DeviceMap:
    """The pieces' devices, who runs them, and, when the placer decided it, its explained Plan."""

    embed: Piece
    layers: list[Piece]
    head: Piece
    plan: Plan | None = None
    graph: Graph | None = field(default=None, repr=False)
    runs: dict[str, str] = field(default_factory=dict)  # device id -> "torch" or a decoder plugin

    @classmethod
    def whole(cls, num_layers: int, device_id: str, runs: str, runtime: str) -> DeviceMap:
        """Every piece on one device (a compiled decoder holding the model, or the torch runner on the CPU)."""
        def piece(name: str) -> Piece:
            return Piece(name, device_id, runs, runtime, 0)

        return cls(embed=piece("embed"), layers=[piece(f"layer{i}") for i in range(num_layers)],
                   head=piece("head"), runs={device_id: runs})

    @property
    def layer_devices(self) -> dict[int, str]:
        """Layer index -> device id."""
        return {i: p.device_id for i, p in enumerate(self.layers)}

    @property
    def devices(self) -> list[str]:
        """Every device a piece runs on, the CPU first."""
        return sorted({p.device_id for p in [self.embed, *self.layers, self.head]}, key=lambda d: (d != "cpu", d))

    def weight_bytes(self) -> int:
        """Bytes of the weights of every piece, wherever it runs."""
        return sum(p.weight_bytes for p in [self.embed, *self.layers, self.head])

    def device_bytes(self) -> dict[str, int]:
        """Bytes (weights + KV) each device must hold under this map."""
        out: dict[str, int] = {}
        for p in [self.embed, *self.layers, self.head]:
            out[p.device_id] = out.get(p.device_id, 0) + p.memory_bytes
        return out

    def layers_on(self, device_id: str) -> list[int]:
        return [i for i, p in enumerate(self.layers) if p.device_id == device_id]

    def stages(self) -> list[Stage]:
        """Runs of consecutive layers on one device, in layer order."""
        out: list[Stage] = []
        start = 0
        for i in range(1, len(self.layers) + 1):
            if i == len(self.layers) or self.layers[i].device_id != self.layers[start].device_id:
                dev = self.layers[start].device_id
                out.append(Stage(dev, start, i, self.runs.get(dev, "torch")))
                start = i
        return out

    def describe(self) -> str:
        return " + ".join(str(s) for s in self.stages())

    def summary(self) -> dict[str, Any]:
        """Compact, loggable description: runs of consecutive layers per device."""
        out: dict[str, Any] = {
            "embed": f"{self.embed.device_id} ({self.embed.plugin})",
            "layers": [f"layers {s.start}-{s.end - 1} on {s.device_id} ({s.runs})" for s in self.stages()],
            "head": f"{self.head.device_id} ({self.head.plugin})", "device_bytes": self.device_bytes()}
        if self.plan is not None:
            out.update(predicted_step_ms=round(self.plan.predicted_total_ms, 4), gate=self.plan.gate,
                       solver=self.plan.solver)
        return out
