"""``quantization_config``: what to quantize, how far, and against which data.

The same model validates ``optimize_model(quantization_config={...})``,
``LLM(..., quantization={...})``, the server config's ``model.quantization``
and ``dspark convert --quantization``. Methods:

* ``none``: float weights (the checkpoint's dtype).
* ``int8``: every projection and the embedding table in int8 (weights per
  output channel; activations quantized dynamically per token).
* ``int4``: every projection int4 weight-only, group-wise; the embedding
  table int8 (a gather has no int4 kernel here).
* ``auto_mixed_precision`` (aliases ``int8_mixed``, the seed's
  ``int8_activation_fp16_weight``; and ``int4_mixed`` with ``weight_bits=4``):
  a calibration pass measures each layer's sensitivity, then the most
  sensitive layers move up a precision (int4 -> int8 -> float) until the
  calibration perplexity is within ``max_drop`` of float.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Method = Literal["none", "int8", "int4", "auto_mixed_precision"]

_ALIASES: dict[str, dict[str, Any]] = {
    "fp32": {"method": "none"}, "float": {"method": "none"}, "off": {"method": "none"},
    "int8_mixed": {"method": "auto_mixed_precision", "weight_bits": 8},
    "int8_activation_fp16_weight": {"method": "auto_mixed_precision", "weight_bits": 8},
    "int4_mixed": {"method": "auto_mixed_precision", "weight_bits": 4},
    "mixed": {"method": "auto_mixed_precision"},
}

SCHEMES = ("none", "int8", "int4", "int8_mixed", "int4_mixed", "auto_mixed_precision", "int8_activation_fp16_weight")


class QuantizationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Method = "auto_mixed_precision"
    weight_bits: Literal[8, 4] = Field(8, description="the low precision of auto_mixed_precision")
    group_size: int = Field(128, gt=0, description="int4 group size along the input dimension")
    activations: Literal["dynamic_int8", "float"] = Field(
        "dynamic_int8", description="int8 layers: quantize activations per token at run time, or keep them float "
        "(layers whose inputs have outliers keep float activations either way)")
    max_drop: float | None = Field(
        None, ge=0.0, description="largest allowed relative increase of calibration perplexity over float "
        "(0.01 = 1%); default 0.01 for int8, 0.04 for int4")
    sensitive_layers: list[str] = Field(
        default_factory=list, description="layers kept in float: names or substrings ('lm_head', 'embed_tokens', "
        "'layers.0.', 'o_proj') or fnmatch patterns ('model.layers.*.mlp.down_proj')")
    calibration_data_path: Path | None = Field(
        None, description="JSONL, one {\"text\": ...} per line; default: a slice of the embedded training corpus "
        "(stdlib files that are not held out)")
    calibration_samples: int = Field(8, ge=1, description="calibration windows")
    calibration_seq_len: int = Field(128, ge=8, description="tokens per calibration window")
    outlier_threshold: float = Field(
        20.0, gt=1.0, description="a layer whose input's largest |activation| exceeds this many times the input's "
        "RMS keeps float activations (per-token int8 would crush the other channels)")
    max_weight_ratio: float | None = Field(
        None, gt=0.0, le=1.0, description="auto_mixed_precision: once the budget holds, keep moving layers up "
        "(most sensitivity per added byte first) while the weights stay within this fraction of float32; "
        "None = stop at the budget (smallest model)")
    target_device: str = Field("auto", description="where the quantized kernels run: auto, cpu, cuda:0 ...")
    prefer_speed: bool | None = Field(
        None, description="int8: a projection whose float kernel bids faster than every int8 kernel stays float "
        "(default true for int8, false for int4, where the point is size)")

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = {"method": v}
        if isinstance(v, dict):
            v = dict(v)
            if "calibration_dataset" in v and "calibration_data_path" not in v:  # the seed's key
                v["calibration_data_path"] = v.pop("calibration_dataset")
            m = v.get("method")
            if isinstance(m, str) and m in _ALIASES:
                alias = _ALIASES[m]
                if "weight_bits" in v and "weight_bits" in alias and v["weight_bits"] != alias["weight_bits"]:
                    raise ValueError(f"method {m!r} implies weight_bits {alias['weight_bits']}, "
                                     f"but weight_bits is {v['weight_bits']}")
                v = {**v, **alias}
            if v.get("method") == "int4":
                v.setdefault("weight_bits", 4)
            if v.get("method") == "int8" and v.get("weight_bits", 8) != 8:
                raise ValueError("method 'int8' needs weight_bits 8")
        return v

    @field_validator("method", mode="before")
    @classmethod
    def _known(cls, v: Any) -> Any:
        if isinstance(v, str) and v not in ("none", "int8", "int4", "auto_mixed_precision"):
            raise ValueError(f"unknown quantization scheme {v!r}; one of: {', '.join(SCHEMES)}")
        return v

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def budget(self) -> float:
        if self.max_drop is not None:
            return self.max_drop
        return 0.04 if self.weight_bits == 4 else 0.01

    @property
    def speed_first(self) -> bool:
        return self.prefer_speed if self.prefer_speed is not None else self.weight_bits == 8

    @property
    def scheme(self) -> str:
        """The short name: none, int8, int4, int8_mixed, int4_mixed."""
        if self.method == "auto_mixed_precision":
            return f"int{self.weight_bits}_mixed"
        return self.method
