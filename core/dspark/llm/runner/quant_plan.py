"""The quantization plan: per layer, its sensitivity, chosen precision and why.

A plan is data (JSON in a converted model directory, a table for people);
:mod:`dspark.llm.quantization.sensitivity` builds one, :mod:`dspark.llm.quantization.apply`
installs it on a runner through the plugins' quantization hook, and the
runner's loader reads an optimized directory's weights by it, which is why it
lives with the runner.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Precision = Literal["float", "int8", "int4"]
LADDER: tuple[Precision, ...] = ("int4", "int8", "float")


class LayerPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    kind: Literal["linear", "embedding"]
    shape: tuple[int, int]  # linear: [in, out]; embedding: [vocab, hidden]
    precision: Precision
    # Group along the input dimension (int4; int8 from a GGUF's Q8_0 blocks); None = per output channel.
    group_size: int | None = None
    activations: Literal["float", "dynamic_int8"] = "float"
    sensitivity: dict[str, float] = Field(
        default_factory=dict, description="relative calibration-perplexity increase with this layer alone at "
        "each precision (0.01 = +1%)")
    act_outlier: float | None = Field(None, description="input's p99 over tokens of max|x| / rms(x)")
    reason: str = ""

    @property
    def params(self) -> int:
        return self.shape[0] * self.shape[1]

    def weight_bytes(self, float_bytes: int = 4) -> int:
        """Bytes of this layer's weights at its precision (int4 packed two per byte, float32 scales)."""
        k, n = self.shape
        if self.precision == "float":
            return k * n * float_bytes
        if self.kind == "embedding":
            return k * n + k * 4
        g = self.group_size or k
        if self.precision == "int8":
            return k * n + -(-k // g) * n * 4
        return -(-k // 2) * n + -(-k // g) * n * 4


class QuantPlan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scheme: str
    weight_bits: int
    group_size: int
    budget: float = Field(description="max_drop: allowed relative calibration-perplexity increase")
    float_dtype: str = "float32"
    tied_embeddings: bool = Field(False, description="the float model shares one matrix for embedding and lm_head")
    layers: list[LayerPlan]
    calibration: dict[str, float | int | str] = Field(default_factory=dict)

    def layer(self, name: str) -> LayerPlan:
        for lp in self.layers:
            if lp.name == name:
                return lp
        raise KeyError(f"the plan has no layer {name!r}")

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for lp in self.layers:
            out[lp.precision] = out.get(lp.precision, 0) + 1
        return out

    def shares_tied_int8(self) -> bool:
        """A tied model whose embedding and lm_head are both int8: one matrix, stored once (as NNCF does)."""
        prec = {lp.name: lp.precision for lp in self.layers}
        return self.tied_embeddings and prec.get("model.embed_tokens") == "int8" and prec.get("lm_head") == "int8"

    def weight_bytes(self, float_bytes: int = 4) -> int:
        total = sum(lp.weight_bytes(float_bytes) for lp in self.layers)
        if self.shares_tied_int8():
            total -= self.layer("model.embed_tokens").weight_bytes(float_bytes)
        return total

    def float_bytes(self, float_bytes: int = 4) -> int:
        """The float model's weight bytes (a tied embedding/head matrix counted once)."""
        total = sum(lp.params * float_bytes for lp in self.layers)
        if self.tied_embeddings and any(lp.kind == "embedding" for lp in self.layers):
            total -= next(lp.params for lp in self.layers if lp.kind == "embedding") * float_bytes
        return total

    def table(self) -> str:
        """The plan as a fixed-width table: layer, sensitivity, outliers, precision, why."""
        head = f"{'layer':40} {'in x out':>11} {'int8 Δppl':>9} {'int4 Δppl':>9} {'outlier':>7}  {'precision':10} why"
        rows = [head, "-" * len(head)]
        for lp in self.layers:
            s8 = lp.sensitivity.get("int8")
            s4 = lp.sensitivity.get("int4")
            prec = lp.precision + (f"/g{lp.group_size}" if lp.precision != "float" and lp.group_size else "")
            if lp.precision == "int8" and lp.activations == "dynamic_int8":
                prec += "+a8"
            rows.append(
                f"{lp.name:40} {f'{lp.shape[0]}x{lp.shape[1]}':>11} "
                f"{'' if s8 is None else f'{100 * s8:+.2f}%':>9} {'' if s4 is None else f'{100 * s4:+.2f}%':>9} "
                f"{'' if lp.act_outlier is None else f'{lp.act_outlier:.1f}':>7}  {prec:10} {lp.reason}")
        c = self.calibration
        if c:
            rows.append(
                f"calibration: {c.get('windows')} windows x {c.get('seq_len')} tokens ({c.get('source')}); "
                f"float ppl {c.get('float_ppl')}, planned ppl {c.get('planned_ppl')} "
                f"({100 * float(c.get('drop', 0.0)):+.2f}%, budget {100 * self.budget:.1f}%)")
        fb = self.float_bytes()
        rows.append(f"weights: {self.weight_bytes() / 1e6:.2f} MB vs {fb / 1e6:.2f} MB float32 "
                    f"({self.weight_bytes() / fb:.3f}x); {self.counts()}")
        return "\n".join(rows)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"

    @classmethod
    def read(cls, path: str | Path) -> QuantPlan:
        p = Path(path)
        try:
            return cls.model_validate_json(p.read_text())
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{p}: quantization plan missing") from e
        except ValueError as e:
            raise ValueError(f"{p}: not a valid quantization plan: {e}") from e
