"""The engine's configuration, validated up front so a typo fails at construction.

:class:`EngineConfig` holds the engine's limits and policies, with
:class:`SpeculativeConfig` and :class:`QuantizationConfig` (``quantization_config``) as parts.

``quantization_config`` says what to quantize, how far, and against which data.
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

import os

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


SchedulerPolicy = Literal["fcfs_with_priority", "fcfs"]
# Which running sequence gives its pages back when a step runs out of them:
#   newest_first           the latest-arrived running sequence (vLLM's default; oldest work survives)
#   oldest_first           the earliest-arrived running sequence
#   lowest_priority_first  the largest priority number; ties go to the latest arrival
PreemptionPolicy = Literal["newest_first", "oldest_first", "lowest_priority_first"]


SpecStrategy = Literal["deepspec", "fixed", "off"]


class SpeculativeConfig(BaseModel):
    """Speculative decoding (``speculative_decoding={...}`` in ``LLM(...)`` and the server config).

    ``deepspec`` lets the adaptive controller pick, per request and step, the
    drafter and the number of drafted tokens (0 = plain decoding) from
    predicted acceptance and measured costs; ``fixed`` always drafts
    ``num_speculative_tokens`` with one drafter (the first of ``drafters``, or
    by preference the draft model, then self-drafting, then n-gram lookup: the
    request's own context before earlier requests' text).

    Greedy output is the target's argmax at every position, as plain decoding's: in float32 the same tokens;
    in a 16-bit dtype a runtime may round a step of several rows apart from a step of one, so a near-tie can
    go the other way (docs/benchmarks.md measures how often). Sampled output keeps
    the target's distribution exactly (the rejection rule), but a seeded
    request's tokens also depend on the drafts it was verified against, and
    under ``deepspec`` on timings, so they are not bit-reproducible the way
    plain seeded sampling is.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="false turns speculation off whatever the strategy")
    strategy: SpecStrategy = "deepspec"
    draft_model: str = Field(
        "auto", description="'auto' = a draft checkpoint made for the target if one is found (the embedded "
        "model's draft), 'none' = no separate draft model, or a checkpoint directory with the target's vocabulary")
    draft_head: str = Field(
        "none", description="a feature-level draft head (EAGLE-style) to offer: 'auto' = one made for the target "
        "if found next to it (the embedded model's stdlib-llama-head), or a head directory; 'none' (the default: "
        "on the embedded model a drafted token costs 0.4x a target step and offering it slows DeepSpec, "
        "docs/benchmarks.md)")
    num_speculative_tokens: int = Field(4, ge=1, le=64, description="k of the fixed strategy")
    max_k: int = Field(32, ge=1, le=64, description="most tokens DeepSpec drafts per sequence and step (it "
                       "picks fewer, down to 0, where they do not pay; long drafts pay in copies and loops)")
    conservative: bool = Field(False, description="cap k for long open-ended text (and long contexts)")
    exit_layer: int | Literal["auto"] = Field(
        "auto", description="self-drafting exit layer: 'auto' = chosen by measured acceptance and cost among the "
        "early-exit layers the model was trained with and the lower half of its layers; or a layer count >= 1")
    drafters: list[str] | None = Field(
        None, description="drafters to use, by name or kind (model, self, ngram, other); None = every offer")
    drafter_timeout_s: float = Field(
        2.0, gt=0, description="a third-party drafter's call (propose, commit, release) that takes longer is "
        "abandoned and the drafter disabled, decoding going on without it; built-in drafters run inline")
    stretch_ms: float = Field(
        8.0, ge=0, description="DeepSpec's stretches (a lone greedy request's copy runs, the greedy runs between its "
        "proposals) last about this long, and at most decode_run_ms: each is chosen on the text before it and runs "
        "to its end once chosen; greedy stretches grow to 4x while every copy way trails plain steps clearly")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        if isinstance(v, bool):
            return {"enabled": v}
        if isinstance(v, dict) and v.get("draft_model", "auto") is None:
            v = {**v, "draft_model": "none"}
        return v

    @field_validator("strategy", mode="before")
    @classmethod
    def _alias(cls, v: Any) -> Any:
        return "deepspec" if v == "deepspec_v2" else v  # the seed's name for the same strategy

    @field_validator("exit_layer")
    @classmethod
    def _exit(cls, v: Any) -> Any:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"exit_layer must be 'auto' or >= 1, got {v}")
        return v

    @property
    def active(self) -> bool:
        return self.enabled and self.strategy != "off"


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    max_batch_size: int = Field(32, ge=1, description="sequences in one step at most")
    max_model_len: int | None = Field(None, ge=2, description="prompt + output tokens; default: the model's max_position_embeddings")
    max_total_tokens: int | None = Field(None, ge=1, description="KV budget in tokens over all sequences; rounded up to whole pages")
    page_size: int = Field(16, ge=1, description="tokens per KV page")
    max_num_batched_tokens: int = Field(512, ge=1, description="tokens per step; longer prompts are prefilled in chunks")
    scheduler_policy: SchedulerPolicy = "fcfs_with_priority"
    preemption_policy: PreemptionPolicy = "newest_first"
    priority_preemption: bool = Field(
        False, description="a waiting request may preempt running ones of a strictly lower priority "
        "(larger number), lowest and newest first, when no batch slot or pages are left for it")
    target_step_ms: float | None = Field(None, gt=0, description="adaptive batch size target; None keeps max_batch_size fixed")
    decode_run_ms: float = Field(
        32.0, ge=0, description="greedy decode steps run in one call to a decoder that offers it (plugin API "
        "1.13: llama.cpp's, OpenVINO's): while every running request is plain greedy decoding and none waits, as "
        "many steps as fit in about this many milliseconds (at most 32), the engine's own work (and a server's "
        "streaming of the tokens) paid once per run; a request arriving meanwhile ends the run after the step in "
        "flight where the decoder can (API 1.15: llama.cpp's, OpenVINO's), else waits at most about this long to "
        "be admitted; with DeepSpec, its stretches (a lone greedy request's copy runs, greedy runs between "
        "proposals) take at most speculative_decoding.stretch_ms of it; 0 = one step per call. LLM.generate, "
        "which adds no request until its own have finished, runs what fits in 250 ms (at most 32 steps) whatever "
        "the budget (any but 0)")
    devices: str | None = Field(
        None, description="where the layers run: None = all on the CPU without asking the placer; 'auto' = "
        "the placer over the probed devices; or a device-profile YAML path (its devices torch can drive here)")
    packed_linear: Literal["auto", "on", "off"] = Field(
        "auto", description="oneDNN-packed copies of the float projections for steps of more than one row "
        "(batched decode, verification, prefill), one row staying on the plain weight: 'auto' = when the "
        "layers run float32 on the CPU and the copy is under a quarter of the available memory")
    dense_offload: str = Field(
        "off", description="prefill MLP through another plugin's compiled executable: 'off', 'auto' (when its "
        "bid beats torch's by a margin) or a plugin name to force it")
    decoder: str = Field(
        default_factory=lambda: os.environ.get("DSPARK_DECODER", "auto"),
        description="what runs the decoder: 'auto' = the plugins' compiled decoders bid (dspark_decoder_bid) "
        "and the one measured fastest at the engine's step shapes runs, the built-in torch runner being one "
        "contender and the fallback; 'torch' = the built-in runner only; or 'PLUGIN' / 'PLUGIN@DEVICE', "
        "comma-separated, to run on those plugins' decoders in that order, without timing (docs/decoders.md); "
        "the default is $DSPARK_DECODER or 'auto'")
    speculative: SpeculativeConfig = Field(
        default_factory=lambda: SpeculativeConfig(enabled=False), alias="speculative_decoding",
        description="speculative decoding; a dict of SpeculativeConfig fields, or true/false")
    quantization: QuantizationConfig | None = Field(
        None, alias="quantization_config", description="mixed-precision quantization at load (calibrates first): "
        "a QuantizationConfig dict or a scheme name (int8, int4, int8_mixed, int4_mixed); None = as the checkpoint "
        "is (an optimized directory from `dspark convert` carries its own plan)")

    @field_validator("decoder")
    @classmethod
    def _check_decoder(cls, v: str) -> str:
        import re

        one = r"[A-Za-z0-9_.-]+(@[a-z0-9_]+(:[0-9]+)?)?"
        if v not in ("auto", "torch") and not re.fullmatch(rf"{one}(,{one})*", v):
            raise ValueError(f"decoder must be 'auto', 'torch', or PLUGIN / PLUGIN@DEVICE, comma-separated "
                             f"(e.g. 'cpu@cpu' or 'cpu,npu'), got {v!r}")
        return v
