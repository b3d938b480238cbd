"""The runner's weight layout: per-layer tensors, the projections quantization treats as units.

:func:`mm` runs a float projection the way its weight is stored (see the note
on transposition below) and through its oneDNN-packed copy for steps of more
than one row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.llm.runner import packed_linear


@dataclass
class Layer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    w_qkv_t: torch.Tensor  # [hidden, q+k+v]: stored transposed, see the note below
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    w_gate_up_t: torch.Tensor  # [hidden, 2 * intermediate], transposed
    w_down: torch.Tensor
    b_o: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # Gemma: norms of the attention and MLP outputs
    mlp_out_norm: torch.Tensor | None = None
    # Installed by quantization (dspark.llm.quantization.apply): x -> x @ W through a plugin's
    # compiled kernel. None = the float weight above runs.
    f_qkv: Callable[[torch.Tensor], torch.Tensor] | None = None
    f_o: Callable[[torch.Tensor], torch.Tensor] | None = None
    f_gate_up: Callable[[torch.Tensor], torch.Tensor] | None = None
    f_down: Callable[[torch.Tensor], torch.Tensor] | None = None
    # oneDNN-packed copies for steps of more than one row (dspark.llm.runner.packed_linear); None = not packed.
    p_qkv: torch.Tensor | None = None
    p_o: torch.Tensor | None = None
    p_gate_up: torch.Tensor | None = None
    p_down: torch.Tensor | None = None


# The projections quantization treats as units: (name suffix, Layer weight, stored transposed?, kernel slot).
# A kernel slot "f_x" has a packed-copy slot "p_x".
# Names follow the checkpoint's, with the fused ones named like vLLM's (qkv_proj, gate_up_proj).
PROJECTIONS: tuple[tuple[str, str, bool, str], ...] = (
    ("self_attn.qkv_proj", "w_qkv_t", True, "f_qkv"),
    ("self_attn.o_proj", "w_o", False, "f_o"),
    ("mlp.gate_up_proj", "w_gate_up_t", True, "f_gate_up"),
    ("mlp.down_proj", "w_down", False, "f_down"),
)
# Each projection's checkpoint tensors (suffixes), in the order they are fused, unless the checkpoint stores
# the fused one itself (Phi-3).
PROJECTION_PARTS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
EMBED, HEAD = "model.embed_tokens", "lm_head"
# Every tensor a Layer holds (what moves with it to a device, what its weight bytes count).
LAYER_TENSORS = ("in_norm", "post_norm", "w_qkv_t", "b_qkv", "w_o", "w_gate_up_t", "w_down", "b_o", "q_norm",
                 "k_norm", "attn_out_norm", "mlp_out_norm")


# Widening projections (out > in) are stored transposed and run as ``x @ w_t``: MKL's GEMV
# streams an [in, out] matrix faster than F.linear's [out, in] one when the weights come from
# DRAM (batch-1 decode), and is no slower for prefill-sized batches. Narrowing ones (o, down)
# are faster as F.linear.


def mm(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """A float projection: one row through the plain weight (GEMV), more through the packed copy."""
    if packed is not None and x.shape[0] > 1:
        return packed_linear.linear(x, packed)
    return x @ w if transposed else F.linear(x, w)
