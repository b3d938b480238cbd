"""What dspark does with each GGUF storage type: the plugins' int8 kernels where the block format maps
onto them exactly, float otherwise, with the reason logged.

The plugins' quantized kernels (``dspark_quantize``) take float weights and
quantize them symmetrically (absmax per output channel or per group along the
input, int8 in -127..127, int4 in -7..7, float32 scales; dspark.sdk.quant). A
GGUF type maps onto them only when that re-quantization gives back the file's
own integers and scales, so that the kernels compute with exactly the weights
transformers dequantizes. Of the common types only Q8_0 does (checked per
tensor, tensors.exact_on_int8_kernels); the result is a QuantPlan the engine
installs like any other (apply_plan) and `dspark convert` writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dspark.host.log import get_logger
from dspark.llm.gguf.tensors import Q8_0_BLOCK, StoredTensor
from dspark.llm.runner.layout import EMBED, HEAD
from dspark.llm.runner.loader import source_parts
from dspark.llm.runner.quant_plan import LayerPlan, QuantPlan

if TYPE_CHECKING:
    from dspark.llm.runner.model import ModelRunner

log = get_logger("dspark.llm.gguf")

FLOAT = "float, as stored"
Q8_0_INT8 = (f"int8 kernels, group {Q8_0_BLOCK} along the input: Q8_0's blocks (32 int8 values in -127..127, one "
             "fp16 scale) are what those kernels hold, and re-quantizing the weights gives back the file's integers "
             "and scales bit for bit (checked per tensor)")
# Why each quantized type is dequantized to float32 (the runner's float path then runs it).
DEQUANTIZED = {
    "Q4_0": "32-value blocks of 16 levels (-8..7 times an fp16 scale); the int4 kernels are symmetric with 15 "
            "levels (-7..7), so a block's -8 cannot be held and re-quantizing would change the weights",
    "Q4_1": "blocks with a scale and a minimum (a zero point); the int4 kernels are symmetric, without one",
    "Q5_0": "5-bit values; no 5-bit kernel, and the int8 kernels would re-quantize them to other values",
    "Q5_1": "5-bit values with a minimum (a zero point); no kernel holds them",
    "Q2_K": "2-bit values with 4-bit sub-block scales and minimums; no kernel holds them",
    "Q3_K": "3-bit values with 6-bit sub-block scales; no 3-bit kernel",
    "Q4_K": "256-value superblocks of 8 sub-blocks, each with a 6-bit scale and a 6-bit minimum (a zero point); "
            "the int4 kernels are symmetric, without a zero point, and one float scale per group",
    "Q5_K": "5-bit values in superblocks with sub-block scales and minimums; no kernel holds them",
    "Q6_K": "6-bit values (-32..31) in 16-value sub-blocks with int8 scales; no 6-bit kernel, and the int8 kernels "
            "would re-quantize them to other values (absmax to 127 is not exact for 6-bit integers)",
}


# The same, short, for the plan's per-layer reasons (a table column).
SHORT = {"Q4_0": "levels -8..7, the int4 kernels hold -7..7", "Q4_1": "a zero point; the kernels are symmetric",
         "Q5_0": "5-bit, no exact kernel", "Q5_1": "5-bit with a zero point, no kernel",
         "Q2_K": "a zero point; the kernels are symmetric", "Q3_K": "3-bit, no kernel",
         "Q4_K": "6-bit sub-block minimums (a zero point); the kernels are symmetric",
         "Q5_K": "a zero point; the kernels are symmetric", "Q6_K": "6-bit values, no exact kernel"}
Q8_0_SHORT = f"int8/g{Q8_0_BLOCK} kernels hold its blocks and fp16 scales exactly (checked)"


@dataclass(frozen=True)
class TypeDecision:
    """One storage type of a file: its tensors, how many run on the int8 kernels, and why."""

    ggml_type: str
    tensors: int
    int8_tensors: int
    action: str  # "float" (F32/F16/BF16, as stored), "int8", "dequantized", or "int8+dequantized"
    reason: str


def _dequantized_reason(kind: str) -> str:
    return DEQUANTIZED.get(kind, f"{kind}: no int8/int4 kernel holds its blocks exactly")


def _layer(runner: ModelRunner, name: str, stored: dict[str, StoredTensor]) -> tuple[LayerPlan, list[str]]:
    """The plan of one projection and the Hugging Face tensors it runs on int8 kernels."""
    cfg = runner.cfg
    parts = [t for t, _ in source_parts(cfg, name)]
    if name == HEAD and cfg.tie_word_embeddings:
        parts = [f"{EMBED}.weight"]  # the tied head is the embedding matrix, rows of hidden-size blocks
    kinds = sorted({stored[p].ggml_type for p in parts})
    k, n = runner.weight_t(name).shape
    shape = (int(k), int(n))
    if all(stored[p].ggml_type == "Q8_0" and stored[p].exact_int8 for p in parts):
        return LayerPlan(name=name, kind="linear", shape=shape, precision="int8", group_size=Q8_0_BLOCK,
                         reason=f"GGUF Q8_0: {Q8_0_SHORT}"), parts
    if kinds == ["Q8_0"]:
        why = "GGUF Q8_0 whose blocks re-quantize to other values (a block's largest |q| is not 127): dequantized"
    elif "Q8_0" in kinds:
        why = f"GGUF {'+'.join(kinds)} fused into one projection, which runs one kernel: dequantized"
    else:
        why = "GGUF " + "; ".join(f"{k}: " + (FLOAT if k in ("F32", "F16", "BF16") else
                                              f"dequantized ({SHORT.get(k, 'no exact kernel')})") for k in kinds)
    return LayerPlan(name=name, kind="linear", shape=shape, precision="float", reason=why), []


def plan_for(runner: ModelRunner, stored: dict[str, StoredTensor],
             source: str) -> tuple[QuantPlan, dict[str, TypeDecision]]:
    """The file's plan over the runner's projections, and a decision per storage type (logged here)."""
    layers: list[LayerPlan] = []
    on_int8: set[str] = set()
    for name in runner.linear_names():
        lp, parts = _layer(runner, name, stored)
        layers.append(lp)
        on_int8.update(parts)
    emb = stored[f"{EMBED}.weight"]
    vocab, hidden = runner.embed.shape
    layers.append(LayerPlan(name=EMBED, kind="embedding", shape=(int(vocab), int(hidden)), precision="float",
                            reason=f"GGUF {emb.ggml_type}: " + (
                                FLOAT if emb.ggml_type in ("F32", "F16", "BF16") else
                                "dequantized (the embedding's int8 path keeps one scale per row)"
                                if emb.ggml_type == "Q8_0" else
                                f"dequantized ({SHORT.get(emb.ggml_type, 'no exact kernel')})")))
    decisions: dict[str, TypeDecision] = {}
    for kind in sorted({s.ggml_type for s in stored.values()}):
        names = [n for n, s in stored.items() if s.ggml_type == kind]
        n8 = sum(n in on_int8 for n in names)
        if kind in ("F32", "F16", "BF16"):
            d = TypeDecision(kind, len(names), 0, "float", FLOAT)
        elif n8 == len(names):
            d = TypeDecision(kind, len(names), n8, "int8", Q8_0_INT8)
        elif n8:
            rest = sorted(n for n in names if n not in on_int8)
            d = TypeDecision(kind, len(names), n8, "int8+dequantized",
                             f"{Q8_0_INT8}; dequantized: {', '.join(rest)} (see the plan's reasons)")
        else:
            why = _dequantized_reason(kind) if kind != "Q8_0" else "no Q8_0 projection maps exactly (plan reasons)"
            d = TypeDecision(kind, len(names), 0, "dequantized", why)
        decisions[kind] = d
        if d.action == "float":
            log.info("gguf.float", file=source, ggml_type=kind, tensors=d.tensors)
        elif d.action == "int8":
            log.info("gguf.int8_kernels", file=source, ggml_type=kind, tensors=d.tensors, reason=d.reason)
        else:
            log.warning("gguf.dequantized", file=source, ggml_type=kind, tensors=d.tensors,
                        int8_tensors=d.int8_tensors, reason=f"dequantized to float32: {d.reason}")
    plan = QuantPlan(scheme="gguf", weight_bits=8, group_size=Q8_0_BLOCK, budget=0.0, float_dtype="float32",
                     tied_embeddings=runner.cfg.tie_word_embeddings, layers=layers)  # nothing calibrated
    return plan, decisions
