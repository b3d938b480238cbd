"""The torch runner as the reference implementation of dspark's one decoder definition.

:class:`RunnerOps` supplies :func:`dspark.sdk.family.forward`'s ops on the
runner's own tensors and machinery, so the runner's layers are the same
definition every plugin lowers: projections by their engine names (an
installed quantized kernel, the oneDNN-packed copy for several rows, or the
plain weight), the step's attention plans (the paged C kernel, SDPA, soft-capped
matmuls), the step's cos/sin (context-dependent RoPE included), and the rows
moved to each layer's torch device when a layer's first norm lives elsewhere.
A layer's MLP placed on a plugin for prefill (``ModelRunner.mlp_offload``) runs
there whole: its gate/up projection hands the normed rows to the plugin and
the ops through the down projection pass its output on.

:func:`family_fields` reads off the runner what a family changes in the forward,
the data of a :class:`~dspark.sdk.decoder.DecoderSpec`; :func:`runner_spec` is
the weightless spec the runner runs the definition with.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dspark.llm.runner.layout import HEAD, PROJECTIONS, Layer, mm
from dspark.sdk.decoder import DecoderSpec
from dspark.sdk.family import Attention

if TYPE_CHECKING:
    from dspark.llm.runner.attention import StepAttention
    from dspark.llm.runner.kv_cache import PagedKVCache
    from dspark.llm.runner.rope import Rope
    from dspark.llm.runner.types import ModelConfig


class ModelRunner(Protocol):
    """What these ops read off :class:`dspark.llm.runner.model.ModelRunner` (named here, below it)."""

    cfg: ModelConfig
    dtype: torch.dtype
    layers: list[Layer]
    ropes: list[Rope]
    windows: list[int | None]
    layer_rope: list[int | None]
    attn_scale: float | None
    embed_scale: torch.Tensor | None
    embed: torch.Tensor
    norm: torch.Tensor
    lm_head_t: torch.Tensor
    act: Callable[[torch.Tensor], torch.Tensor]
    mlp_offload: Callable[[int, torch.Tensor], torch.Tensor | None] | None

    def _lookup(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...

    def _offloaded_mlp(self, li: int, h: torch.Tensor) -> torch.Tensor | None: ...

_ACTIVATION = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def features(runner: ModelRunner) -> frozenset[str]:
    """What the model needs beyond a plain Llama decoder (dspark.sdk.decoder.FEATURES)."""
    c = runner.cfg
    f: set[str] = set()
    if c.attention_bias:
        f.add("qkv_bias")
    if c.o_bias:
        f.add("o_bias")
    if c.qk_norm:
        f.add("qk_norm")
    if c.hidden_act not in ("silu", "swish"):
        f.add("gelu_tanh" if "tanh" in c.hidden_act else "gelu")
    if c.gemma or c.local_rope is not None:
        f.add("gemma")
    if any(w is not None for w in runner.windows):
        f.add("sliding_window")
    if c.attn_logit_softcapping is not None or c.final_logit_softcapping is not None:
        f.add("softcap")
    if any(r.by_context for r in runner.ropes):
        f.add("context_rope")
    if c.partial_rotary_factor != 1.0:
        f.add("partial_rotary")
    if any(r is None for r in runner.layer_rope):
        f.add("no_rope_layers")
    if c.query_pre_attn_scalar is not None:
        f.add("attn_scale")
    return frozenset(f)


def family_fields(runner: ModelRunner) -> dict[str, Any]:
    """The DecoderSpec fields that say what the family changes in the forward (API 1.10)."""
    c = runner.cfg
    return dict(
        architecture=c.model_type, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, features=features(runner),
        dtype=str(runner.dtype).removeprefix("torch."), windows=tuple(runner.windows),
        layer_rope=tuple(runner.layer_rope), rotary_dim=runner.ropes[0].dim, attn_scale=runner.attn_scale,
        attn_softcap=c.attn_logit_softcapping, final_softcap=c.final_logit_softcapping,
        embed_scale=None if runner.embed_scale is None else float(runner.embed_scale),
        activation=_ACTIVATION.get(c.hidden_act, c.hidden_act))


def runner_spec(runner: ModelRunner) -> DecoderSpec:
    """The spec the runner runs :func:`~dspark.sdk.family.forward` with: its family, no weights of its own
    (the runner passes :class:`RunnerWeights`)."""
    c = runner.cfg
    return DecoderSpec(name=c.model_type, path="", fingerprint="", layers=(0, c.num_hidden_layers),
                       **family_fields(runner))


class _LayerView:
    """A runner layer under the names of :class:`~dspark.sdk.decoder.LayerWeights` (read live: a quantized
    kernel installed later is seen)."""

    __slots__ = ("L",)

    def __init__(self, layer: Layer) -> None:
        self.L = layer


# LayerWeights name -> the runner Layer's attribute.
_LAYER_NAMES = {"in_norm": "in_norm", "post_norm": "post_norm", "qkv": "w_qkv_t", "o": "w_o",
                "gate_up": "w_gate_up_t", "down": "w_down", "qkv_bias": "b_qkv", "o_bias": "b_o",
                "q_norm": "q_norm", "k_norm": "k_norm", "attn_out_norm": "attn_out_norm",
                "mlp_out_norm": "mlp_out_norm"}
for _name, _attr in _LAYER_NAMES.items():
    setattr(_LayerView, _name, property(operator.attrgetter(f"L.{_attr}")))


class RunnerWeights:
    """The runner's tensors where the definition reads :class:`~dspark.sdk.decoder.DecoderWeights`."""

    def __init__(self, runner: ModelRunner) -> None:
        self.r = runner
        self.layers = [_LayerView(L) for L in runner.layers]

    embed = property(lambda s: s.r.embed)
    norm = property(lambda s: s.r.norm)
    head = property(lambda s: s.r.lm_head_t)


class RunnerOps:
    """:class:`dspark.sdk.family.DecoderOps` on the runner's tensors, for one step at a time (:meth:`begin`)."""

    variants = frozenset({"activation.gelu", "activation.gelu_tanh", "attention.window", "attention.softcap",
                          "rope.partial", "softcap", "linear.int8", "linear.int4", "embed.int8"})

    def __init__(self, runner: ModelRunner) -> None:
        self.r = runner
        self._slots: dict[str, tuple[Any, str, bool, str, int]] = {}
        for i, L in enumerate(runner.layers):
            for p in PROJECTIONS:
                self._slots[f"model.layers.{i}.{p[0]}"] = (L, p[1], p[2], p[3], i)
        self._slots[HEAD] = (runner, "lm_head_t", True, "f_head", -1)
        self._skip: torch.Tensor | None = None  # an offloaded MLP's output, passed on to the down projection
        # q and k as views of one [T, H + KVH, D] tensor (the fused projection's columns), so that RoPE rotates
        # both in one go when nothing came between (no q/k norm): half the dispatches at batch 1.
        self._qkv: torch.Tensor | None = None
        self._q: torch.Tensor | None = None
        self._k: torch.Tensor | None = None
        self._k_roped: torch.Tensor | None = None
        self._parts: list[torch.Tensor] = []

    def begin(self, cache: PagedKVCache, tokens: torch.Tensor, write_slots: torch.Tensor,
              rope_cs: list[tuple[torch.Tensor, torch.Tensor]], plan: StepAttention, multi: bool) -> None:
        self.cache, self.ids, self.write_slots, self.rope_cs, self.plan = cache, tokens, write_slots, rope_cs, plan
        self.multi = multi

    def end(self) -> None:
        self.cache = self.ids = self.write_slots = self.plan = None  # type: ignore[assignment]
        self.rope_cs = []
        self._skip = self._qkv = self._q = self._k = self._k_roped = None

    def tokens(self, table: Any, quant: Any) -> torch.Tensor:
        return self.r._lookup(self.ids)

    def hidden_in(self) -> torch.Tensor:
        raise NotImplementedError("the torch runner runs every layer from the tokens")

    def scale(self, x: torch.Tensor, factor: float) -> torch.Tensor:
        return x * self.r.embed_scale  # rounded to the model's dtype, as transformers does

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if weight.device != x.device:  # a layer on another device: the rows and the step's small tensors move
            d = weight.device
            x, self.write_slots = x.to(d), self.write_slots.to(d)
            self.rope_cs = [(c.to(d), s.to(d)) for c, s in self.rope_cs]
            self.plan.to(d)
        return self.r._rms(x, weight)

    def linear(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None, quant: Any, name: str) -> torch.Tensor:
        owner, attr, transposed, slot, li = self._slots[name]
        if self._skip is not None:  # the rest of an offloaded MLP: its output is already there
            y, self._skip = self._skip, None
            return y
        if slot == "f_gate_up" and self.r.mlp_offload is not None and self.multi:
            out = self.r._offloaded_mlp(li, x)
            if out is not None:
                self._skip = out
                return x
        fn = getattr(owner, slot)
        y = fn(x) if fn is not None else mm(x, getattr(owner, attr), getattr(owner, "p" + slot[1:]), transposed)
        return y if bias is None else y + bias

    def split(self, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        if self._skip is not None:
            return [x] * len(sizes)
        if len(sizes) == 2 and sizes[0] == sizes[1]:
            return list(x.chunk(2, dim=-1))
        parts = list(torch.split(x, sizes, dim=-1))
        if len(parts) == 3:
            self._qkv, self._parts = x, parts
        return parts

    def heads(self, x: torch.Tensor, num: int, dim: int) -> torch.Tensor:
        y = x.view(x.shape[0], num, dim)
        if self._qkv is not None:
            if x is self._parts[0]:
                self._q = y
            elif x is self._parts[1]:
                self._k = y
        return y

    def rope(self, x: torch.Tensor, table: int) -> torch.Tensor:
        from dspark.llm.runner.rope import apply_rope

        cos_sin = self.rope_cs[table]
        if self._k_roped is not None and x is self._k:  # k, rotated with q
            k = self._k_roped
            self._k_roped = self._k = None
            return k
        if x is self._q and self._k is not None and self._qkv is not None:  # q, k still the projection's views
            h = x.shape[1]
            qk = apply_rope(self._qkv[:, : (h + self._k.shape[1]) * x.shape[2]].view(x.shape[0], -1, x.shape[2]),
                            *cos_sin)
            self._k_roped = qk[:, h:]
            self._q = self._qkv = None
            return qk[:, :h]
        return apply_rope(x, *cos_sin)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: Attention) -> torch.Tensor:
        c = self.r.cfg
        kc, vc = self.cache.k[spec.layer], self.cache.v[spec.layer]
        kc.view(-1, c.num_key_value_heads, c.head_dim)[self.write_slots] = k
        vc.view(-1, c.num_key_value_heads, c.head_dim)[self.write_slots] = v
        attn = self.plan(q, kc, vc, window=spec.window, scale=self.r.attn_scale, softcap=spec.softcap)
        return attn.reshape(q.shape[0], spec.num_heads * spec.head_dim)

    def activation(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        return x if self._skip is not None else self.r.act(x)

    def mul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a if self._skip is not None else a * b

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    def logit_rows(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("the runner selects the rows for its head itself (ModelRunner._step)")

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        return torch.tanh(x / cap) * cap
