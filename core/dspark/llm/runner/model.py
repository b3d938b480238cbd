"""Our own decoder forward pass over the paged KV cache, for every supported family (families.py).

One ``step`` runs any mix of prefill chunks and decode tokens for many
sequences: tokens are flattened for the dense parts (norms, projections, MLP;
steps of several rows through oneDNN-packed copies, see packed_linear.py) and
attention is per sequence over the pages by block table. On the CPU in float32,
every chunk of up to 64 tokens (decode rows, drafts, short prompts) goes to the
paged kernel (paged_attention.c), all in one call per layer, reading K/V in
place; longer chunks get one SDPA call each over their gathered pages. Where
the kernel does not run, decode rows are batched into padded SDPA calls, one
per group of similar length (K/V gathered slot by slot, index tensors built
once per step). attention.py runs a layer's attention; what differs between
families (q/k norms, Gemma's norms and scales, soft-caps, sliding windows, which
RoPE a layer uses) is read from the config here, once.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from dspark.llm.runner import packed_linear
from dspark.llm.runner.attention import StepAttention
from dspark.llm.runner.families import SLIDING
from dspark.llm.runner.kv_cache import PagedKVCache
from dspark.llm.runner.layout import EMBED, HEAD, LAYER_TENSORS, PROJECTION_PARTS, PROJECTIONS, Layer, mm
from dspark.llm.runner.loader import load_checkpoint, page_releaser, resolve_dtype
from dspark.llm.runner.rope import Rope, longrope_splits, longrope_switch, run_split
from dspark.llm.runner.torch_ops import RunnerOps, RunnerWeights, runner_spec
from dspark.llm.runner.types import ModelConfig, SeqChunk, StepObservers
from dspark.sdk.decoder import DecoderSpec
from dspark.sdk.family import forward

__all__ = ["EMBED", "HEAD", "PROJECTIONS", "ModelRunner", "SeqChunk"]


def _spans(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each chunk's positions among the rows that went through the final norm."""
    out, o = [], 0
    for r in rows:
        out.append(torch.arange(o, o + len(r)))
        o += len(r)
    return out


class ModelRunner:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 after_layer: Callable[[], None] | None = None) -> None:
        """``after_layer``: called once each layer's fused copies are made (what the copied pages may go)."""
        self.cfg = cfg
        self.dtype = dtype
        self.embed = weights["model.embed_tokens.weight"]
        self.norm = weights["model.norm.weight"]
        # A tied model's head is the embedding, unless the loader supplies it apart (an optimized
        # directory whose embedding is int8 but whose lm_head stayed float).
        head = weights["lm_head.weight"] if "lm_head.weight" in weights else self.embed
        self.lm_head_t = head.t().contiguous()  # [hidden, vocab]; a copy even when tied (see the note in layout.py)
        self._family(cfg, dtype)
        if cfg.gemma:
            self.norm = self._gemma_norm(self.norm)
        self.layers = []
        for n in range(cfg.num_hidden_layers):
            self.layers.append(self._layer(cfg, weights, n))
            if after_layer is not None:
                after_layer()
        # Per-layer torch devices once place() ran with anything but the CPU; None = all on the CPU.
        self.layer_devices: list[torch.device] | None = None
        # Optional prefill MLP replacement: (layer index, normed h) -> MLP output or None (torch runs it).
        self.mlp_offload: Callable[[int, torch.Tensor], torch.Tensor | None] | None = None
        self.observers = StepObservers()  # told each step's and each offloaded MLP call's time, when any listen
        self.f_head: Callable[[torch.Tensor], torch.Tensor] | None = None  # quantized lm_head, when installed
        self.embed_q: tuple[torch.Tensor, torch.Tensor] | None = None  # int8 [vocab, hidden], scales [vocab, 1]
        self.p_head: torch.Tensor | None = None  # oneDNN-packed lm_head for more than one row
        # "auto": the paged C kernel for short chunks where it builds and fits (dspark.llm.runner.paged_attention),
        # "torch": always gather + SDPA.
        self.attention = "auto"

    def _family(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        """What the family changes in the forward, resolved once."""
        # Gemma scales embeddings by sqrt(hidden), rounded to the model's dtype as transformers does.
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5).to(dtype) if cfg.gemma else None
        self.attn_scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar ** -0.5
        self.act: Callable[[torch.Tensor], torch.Tensor] = (
            F.silu if cfg.hidden_act in ("silu", "swish")
            else functools.partial(F.gelu, approximate="tanh" if "tanh" in cfg.hidden_act else "none"))
        self.windows = [cfg.window(n) for n in range(cfg.num_hidden_layers)]
        # RoPEs: the model's, and Gemma 3's own for sliding layers; per layer its index, None = no RoPE.
        d, mp, pr = cfg.head_dim, cfg.max_position_embeddings, cfg.partial_rotary_factor
        self.ropes = [Rope({**(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}, d, mp, pr)]
        if cfg.local_rope is not None:
            self.ropes.append(Rope(cfg.local_rope, d, mp, pr))
        # LongRoPE switches whole sequences at its original context length (rope.py).
        self.longrope_orig = next((r.orig for r in self.ropes if r.kind == "longrope"), None)
        self.layer_rope: list[int | None] = []
        for n in range(cfg.num_hidden_layers):
            local = cfg.local_rope is not None and bool(cfg.layer_types) and cfg.layer_types[n] == SLIDING
            on = not cfg.rope_layers or cfg.rope_layers[n]
            self.layer_rope.append((1 if local else 0) if on else None)

    @staticmethod
    def _gemma_norm(w: torch.Tensor) -> torch.Tensor:
        # Gemma's RMSNorm scales by (1 + w), computed in float32: folded once, kept in float32.
        return 1.0 + w.float()

    def _layer(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], n: int) -> Layer:
        p = f"model.layers.{n}."
        a = p + "self_attn."
        # Fused QKV and gate/up: one matmul each instead of three and two (Phi-3 stores them so).
        def fused(proj: str) -> torch.Tensor:
            parts = (proj,) if cfg.fused_projections else PROJECTION_PARTS[proj]
            return _stacked_t([weights[f"{p}{x}.weight"] for x in parts])

        qkv_t, gate_up_t = fused("self_attn.qkv_proj"), fused("mlp.gate_up_proj")
        norm = self._gemma_norm if cfg.gemma else (lambda w: w)
        L = Layer(
            in_norm=norm(weights[p + "input_layernorm.weight"]),
            # The norm before the MLP: Llama calls it post_attention_layernorm, Gemma pre_feedforward_layernorm
            # (its post_attention_layernorm normalises the attention output).
            post_norm=norm(weights[p + ("pre_feedforward_layernorm" if cfg.gemma else "post_attention_layernorm")
                                   + ".weight"]),
            w_qkv_t=qkv_t,
            b_qkv=torch.cat([weights[a + f"{x}_proj.bias"] for x in "qkv"]) if cfg.attention_bias else None,
            w_o=weights[a + "o_proj.weight"],
            w_gate_up_t=gate_up_t,
            w_down=weights[p + "mlp.down_proj.weight"],
            b_o=weights[a + "o_proj.bias"] if cfg.o_bias else None,
        )
        if cfg.qk_norm:
            L.q_norm, L.k_norm = norm(weights[a + "q_norm.weight"]), norm(weights[a + "k_norm.weight"])
        if cfg.gemma:
            L.attn_out_norm = norm(weights[p + "post_attention_layernorm.weight"])
            L.mlp_out_norm = norm(weights[p + "post_feedforward_layernorm.weight"])
        return L

    # -- projections as units (quantization) -------------------------------------------------

    def linear_names(self) -> list[str]:
        """Every projection, in forward order, then ``lm_head``."""
        return [f"model.layers.{i}.{p[0]}" for i in range(len(self.layers)) for p in PROJECTIONS] + [HEAD]

    def _slot(self, name: str) -> tuple[Any, str, bool, str]:
        if name == HEAD:
            return self, "lm_head_t", True, "f_head"
        parts = name.split(".")
        if len(parts) == 5 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
            li, suffix = int(parts[2]), ".".join(parts[3:])
            for p in PROJECTIONS:
                if p[0] == suffix and li < len(self.layers):
                    return self.layers[li], p[1], p[2], p[3]
        raise KeyError(f"{name!r} is not a projection of this model; projections: {self.linear_names()[:5]} ...")

    def weight_t(self, name: str) -> torch.Tensor:
        """A projection's float weight as [in, out] (so that y = x @ W), as stored or a transposed view."""
        owner, attr, transposed, _ = self._slot(name)
        w = getattr(owner, attr)
        if w.numel() == 0:
            raise ValueError(f"{name}: its float weight was dropped when a quantized kernel was installed")
        return w if transposed else w.t()

    def set_linear(self, name: str, fn: Callable[[torch.Tensor], torch.Tensor] | None, *,
                   drop_float: bool = False) -> None:
        """Run ``name`` through ``fn`` (x[T, in] -> y[T, out]); optionally free its float weight."""
        owner, attr, _, slot = self._slot(name)
        setattr(owner, slot, fn)
        if drop_float and fn is not None:
            setattr(owner, attr, getattr(owner, attr).new_empty(0))
            setattr(owner, "p" + slot[1:], None)  # its packed copy goes too

    def float_projections(self) -> list[tuple[Any, str, bool, str]]:
        """(owner, weight attribute, stored transposed?, packed slot) of every projection that runs its
        float weight (no quantized kernel installed), the LM head included."""
        out = []
        for name in self.linear_names():
            owner, attr, transposed, slot = self._slot(name)
            if getattr(owner, slot) is None and getattr(owner, attr).numel():
                out.append((owner, attr, transposed, "p" + slot[1:]))
        return out

    def linear_fn(self, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        owner, _, _, slot = self._slot(name)
        return getattr(owner, slot)

    def set_embedding_int8(self, q: torch.Tensor | None, scales: torch.Tensor | None) -> None:
        """Look tokens up in an int8 table (per-row scales) instead of the float one, which is freed."""
        if q is None or scales is None:
            self.embed_q = None
            return
        self.embed_q = (q.to(self.embed.device), scales.to(self.embed.device, torch.float32))
        self.embed = self.embed.new_empty(0)

    def _lookup(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.embed_q is None:
            return self.embed[tokens]
        q, sc = self.embed_q
        return (q[tokens].to(torch.float32) * sc[tokens]).to(self.dtype)

    def weight_bytes(self) -> int:
        """Bytes of the weights the runner holds, a tied lm_head's float copy counted once with the embedding."""
        seen: set[int] = set()
        total = 0

        def add(t: Any) -> None:
            nonlocal total
            if isinstance(t, torch.Tensor) and t.numel() and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()

        for L in self.layers:
            for name in LAYER_TENSORS:
                add(getattr(L, name))
        add(self.norm)
        add(self.embed)
        # A tied model's int8 embedding and int8 head are the same integers (per-row scales = per-output-
        # channel scales): one matrix, counted once like the float tied pair.
        shared = self.cfg.tie_word_embeddings and getattr(self.f_head, "precision", None) == "int8"
        if self.embed_q is not None and not shared:
            add(self.embed_q[0])
            add(self.embed_q[1])
        if not (self.cfg.tie_word_embeddings and self.f_head is None and self.embed_q is None):
            add(self.lm_head_t)
        for fn in [self.f_head] + [getattr(L, p[3]) for L in self.layers for p in PROJECTIONS]:
            nbytes = getattr(fn, "weight_bytes", None)
            if nbytes is not None:
                total += int(nbytes)
        return total

    @classmethod
    def weightless(cls, cfg: ModelConfig, dtype: torch.dtype) -> ModelRunner:
        """The config's runner without weights: what a decoder that reads the model file itself needs of it
        (config, dtype, RoPE, windows). It cannot step; ``is_weightless`` says so."""
        self = cls.__new__(cls)
        self.cfg, self.dtype = cfg, dtype
        self._family(cfg, dtype)
        self.layers = []
        self.layer_devices, self.mlp_offload, self.f_head, self.embed_q, self.p_head = None, None, None, None, None
        self.observers = StepObservers()
        self.attention = "auto"
        self.is_weightless = True
        return self

    is_weightless = False

    def drop_weights(self) -> None:
        """Let go of every weight in place: this runner becomes what :meth:`weightless` makes (config,
        dtype, RoPE, windows), for every holder of it at once (a compiled decoder now holds the model)."""
        bare = ModelRunner.weightless(self.cfg, self.dtype)
        self.__dict__.clear()
        self.__dict__.update(bare.__dict__)

    @classmethod
    def from_pretrained(cls, path: str, dtype: str | torch.dtype = "auto") -> ModelRunner:
        cfg, weights = load_checkpoint(path, dtype)
        # The file's pages each layer's fused copies were made from go as the layers are built, so the load
        # peaks at the copies and one layer's pages, not at the copies and the whole file.
        return cls(cfg, weights, resolve_dtype(dtype, cfg), after_layer=page_releaser(path))

    def place(self, layer_devices: list[str], embed_device: str = "cpu", head_device: str = "cpu") -> None:
        """Hold each layer's weights (and, via make_cache, its KV pages) on its torch device."""
        if len(layer_devices) != len(self.layers):
            raise ValueError(f"{len(layer_devices)} layer devices for {len(self.layers)} layers")
        devs = [torch.device(d) for d in layer_devices]
        for owner, _, _, pslot in self.float_projections():  # packed copies are CPU-only; pack again after
            setattr(owner, pslot, None)
        for L, d in zip(self.layers, devs):
            for name in LAYER_TENSORS:
                t = getattr(L, name)
                if t is not None:
                    setattr(L, name, t.to(d))
        self.embed = self.embed.to(embed_device)
        if self.embed_q is not None:
            self.embed_q = (self.embed_q[0].to(embed_device), self.embed_q[1].to(embed_device))
        self.norm = self.norm.to(head_device)
        self.lm_head_t = self.lm_head_t.to(head_device)
        generic = any(d != torch.device("cpu") for d in devs + [torch.device(embed_device), torch.device(head_device)])
        self.layer_devices = devs if generic else None

    def make_cache(self, num_pages: int, page_size: int = 16) -> PagedKVCache:
        c = self.cfg
        devs = self.layer_devices
        cache = PagedKVCache(num_layers=c.num_hidden_layers, num_pages=num_pages, page_size=page_size,
                             kv_heads=c.num_key_value_heads, head_dim=c.head_dim, dtype=self.dtype,
                             device="cpu" if devs is None else "meta")
        if devs is not None:  # each layer's pages live where the layer runs
            for li, d in enumerate(devs):
                cache.k[li] = torch.zeros(cache.k[li].shape, dtype=self.dtype, device=d)
                cache.v[li] = torch.zeros(cache.v[li].shape, dtype=self.dtype, device=d)
        return cache

    def _kernel(self, cache: PagedKVCache) -> Any:
        if self.attention != "auto" or self.layer_devices is not None or cache.k[0].device.type != "cpu":
            return None
        from dspark.llm.runner.paged_attention import kernel

        k = kernel()
        c = self.cfg
        if k is None or not k.supports(heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                                       head_dim=c.head_dim, page_size=cache.page_size, dtype=self.dtype):
            return None
        return k

    def padded_rows(self, n: int) -> int:
        """The rows a forward of ``n`` rows computes its projections over: steps of several rows run
        through the packed copies, padded to their row bucket (packed_linear.row_bucket)."""
        if n > 1 and self.layers and self.layers[0].p_gate_up is not None:
            return packed_linear.row_bucket(n)
        return n

    def kv_bytes_per_token(self) -> int:
        c = self.cfg
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * torch.finfo(self.dtype).bits // 8

    # The runner's layers as dspark.sdk.family.forward runs them: its family as a spec, its ops and weights.
    @functools.cached_property
    def _spec(self) -> DecoderSpec:
        return runner_spec(self)

    @functools.cached_property
    def _ops(self) -> RunnerOps:
        return RunnerOps(self)

    @functools.cached_property
    def _weights(self) -> RunnerWeights:
        return RunnerWeights(self)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # Same op order as HF LlamaRMSNorm: statistics in fp32, scale in model dtype; a float32 weight on
        # half-precision x is Gemma's (1 + w), which scales in fp32 too. The fused kernel saves four
        # dispatches per norm, which matters at batch 1.
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_norm_eps)
        if w.dtype == torch.float32:
            return F.rms_norm(x.float(), (x.shape[-1],), w, self.cfg.rms_norm_eps).to(x.dtype)
        return w * F.rms_norm(x.float(), (x.shape[-1],), None, self.cfg.rms_norm_eps).to(x.dtype)

    @torch.inference_mode()
    def step(self, cache: PagedKVCache, chunks: list[SeqChunk], exit_layer: int | None = None) -> list[torch.Tensor]:
        """Run one forward; returns per chunk fp32 logits, [vocab] or [n, vocab] if ``all_logits``.

        ``exit_layer=E`` runs only the first E layers, then the final norm and
        the LM head (early exit, for self-drafting); only those layers' K/V are
        written, and the sequence lengths advance as for a full step.
        """
        if not self.observers:
            return self._step_chunks(cache, chunks, exit_layer)
        with self.observers.timed("draft" if exit_layer is not None else "forward"):
            return self._step_chunks(cache, chunks, exit_layer)

    def _step_chunks(self, cache: PagedKVCache, chunks: list[SeqChunk], exit_layer: int | None) -> list[torch.Tensor]:
        splits = {} if self.longrope_orig is None else longrope_splits(chunks, cache.seq_lens, self.longrope_orig)
        if not splits:
            return self._step(cache, chunks, exit_layer)
        # A chunk crossing LongRoPE's switch: its rows before the switch run first, in short mode.
        return run_split(chunks, splits, lambda part: self._step(cache, part, exit_layer))

    def _longrope_switch(self, cache: PagedKVCache, chunks: list[SeqChunk]) -> None:
        """Before a chunk that runs in the other LongRoPE mode than its sequence's cache holds, recompute that
        cache in the chunk's mode, all layers (rope.longrope_switch)."""
        orig = self.longrope_orig
        assert orig is not None
        # prompt_len past the switch runs the prefix long; the prefix alone is short (its length <= orig).
        longrope_switch(cache, chunks, orig, lambda prefix, long: self._step(
            cache, [replace(prefix, prompt_len=orig + 1 if long else None)], None))

    def _offloaded_mlp(self, li: int, h: torch.Tensor) -> torch.Tensor | None:
        """Layer ``li``'s MLP by the plugin that won it (None: torch runs it after all), timed for observers."""
        assert self.mlp_offload is not None
        if not self.observers:
            return self.mlp_offload(li, h)
        t0 = time.perf_counter()
        out = self.mlp_offload(li, h)
        if out is not None:
            for fn in self.observers.callbacks:
                fn("mlp", time.perf_counter() - t0)
        return out

    def _step(self, cache: PagedKVCache, chunks: list[SeqChunk], exit_layer: int | None) -> list[torch.Tensor]:
        if self.longrope_orig is not None:
            self._longrope_switch(cache, chunks)
            for ch in chunks:
                have = cache.tokens.setdefault(ch.seq_id, [])
                del have[cache.seq_lens.get(ch.seq_id, 0):]
                have.extend(ch.token_ids)
        starts: list[int] = []
        for ch in chunks:
            if not ch.token_ids:
                raise ValueError(f"sequence {ch.seq_id}: empty chunk")
            start = cache.seq_lens.get(ch.seq_id, 0)
            cache.reserve(ch.seq_id, start + len(ch.token_ids))
            starts.append(start)
        tokens = torch.tensor([t for ch in chunks for t in ch.token_ids], dtype=torch.long)
        # Positions and the K/V slots they write, in plain Python: at large batches a tensor op per
        # chunk costs more than the arithmetic.
        ps = cache.page_size
        pos_l: list[int] = []
        slot_l: list[int] = []
        for s, ch in zip(starts, chunks):
            table = cache.block_tables[ch.seq_id]
            for pos in range(s, s + len(ch.token_ids)):
                pos_l.append(pos)
                slot_l.append(table[pos // ps] * ps + pos % ps)
        positions = torch.tensor(pos_l, dtype=torch.long)
        write_slots = torch.tensor(slot_l, dtype=torch.long)
        # Per row, the context length context-dependent RoPE goes by (rope.py): dynamic NTK the row's own,
        # LongRoPE its sequence's after this step (a crossing chunk was split, so one mode per chunk).
        ctx_row = ctx_seq = None
        if any(r.by_context for r in self.ropes):
            ctx_row = torch.tensor([max(pos + 1, ch.prompt_len or 0) for s, ch in zip(starts, chunks)
                                    for pos in range(s, s + len(ch.token_ids))], dtype=torch.long)
            ctx_seq = torch.tensor([max(s + len(ch.token_ids), ch.prompt_len or 0) for s, ch in zip(starts, chunks)
                                    for _ in ch.token_ids], dtype=torch.long)
        rope_cs = [r.cos_sin(positions, self.dtype, ctx_seq if r.kind == "longrope" else ctx_row) for r in self.ropes]

        offsets, o = [], 0
        for ch in chunks:
            offsets.append(o)
            o += len(ch.token_ids)
        multi = any(len(ch.token_ids) > 1 for ch in chunks)  # a prefill (or verification) chunk is in this step
        # Attention plans, shared by all layers of one window: which rows, which cached slots, which mask.
        plan = StepAttention(cache, chunks, starts, offsets, self._kernel(cache), self.windows)

        devs = self.layer_devices
        # The layers are dspark.sdk.family.forward, the definition every plugin lowers, on this runner's ops.
        ops = self._ops
        ops.begin(cache, tokens if devs is None else tokens.to(self.embed.device), write_slots, rope_cs, plan, multi)
        try:
            x = forward(self._spec, ops, (0, len(self.layers) if exit_layer is None else exit_layer), head=False,
                        weights=self._weights)
        finally:
            ops.end()

        for s, ch in zip(starts, chunks):
            cache.set_len(ch.seq_id, s + len(ch.token_ids))
        # Only the rows whose logits are wanted go through the final norm and lm_head.
        rows: list[torch.Tensor] = []
        for off, ch in zip(offsets, chunks):
            n = len(ch.token_ids)
            rows.append(torch.arange(off, off + n) if ch.all_logits else torch.tensor([off + n - 1]))
        sel = torch.cat(rows)
        if devs is not None:
            x, sel = x.to(self.norm.device), sel.to(self.norm.device)
        hn = self._rms(x[sel], self.norm)
        lazy = [ch.all_logits and ch.hidden_only for ch in chunks]
        if any(lazy):  # the head only over the rows that want logits now
            want = [r_ for r_, lz in zip(_spans(rows), lazy) if not lz]
            logits = self.head(hn[torch.cat(want)]) if want else hn[:0]
        else:
            logits = self.head(hn)
        result, o, e = [], 0, 0
        for ch, r, lz in zip(chunks, rows, lazy):
            n = len(r)
            if lz:
                result.append(hn[o : o + n])
            else:
                part = logits[e : e + n]
                e += n
                result.append(part if ch.all_logits else part[0])
            o += n
        return result

    @torch.inference_mode()
    def head(self, hn: torch.Tensor) -> torch.Tensor:
        """fp32 logits on the host for final-normed hidden rows (what ``hidden_only`` chunks return)."""
        logits = (self.f_head(hn) if self.f_head is not None else mm(hn, self.lm_head_t, self.p_head, True)).float()
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.cpu() if self.layer_devices is not None else logits  # the sampler lives on the host


def _stacked_t(parts: list[torch.Tensor]) -> torch.Tensor:
    """``cat(parts).t()``, contiguous, written in place: no stacked intermediate, whose freed block the
    allocator would keep (at load the process would grow by a stacked layer per layer)."""
    out = torch.empty((parts[0].shape[1], sum(w.shape[0] for w in parts)), dtype=parts[0].dtype)
    o = 0
    for w in parts:
        out[:, o:o + w.shape[0]].copy_(w.t())
        o += w.shape[0]
    return out
