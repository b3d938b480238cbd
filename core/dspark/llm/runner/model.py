"""Our own Llama-family forward pass over the paged KV cache.

One ``step`` runs any mix of prefill chunks and decode tokens for many
sequences: tokens are flattened for the dense parts (norms, projections, MLP;
steps of several rows through oneDNN-packed copies, see packed_linear.py) and
attention is per sequence over the pages by block table. On the CPU in float32,
every chunk of up to 64 tokens (decode rows, drafts, short prompts) goes to the
paged kernel (paged_attention.c), all in one call per layer, reading K/V in
place; longer chunks get one SDPA call each over their gathered pages. Where
the kernel does not run, decode rows are batched into padded SDPA calls, one
per group of similar length (K/V gathered slot by slot, index tensors built
once per step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dspark.llm.runner import packed_linear
from dspark.llm.runner.kv_cache import PagedKVCache
from dspark.llm.runner.loader import ModelConfig, load_checkpoint, resolve_dtype
from dspark.llm.runner.rope import apply_rope, cos_sin, inv_frequencies


@dataclass
class SeqChunk:
    """New tokens of one sequence to run this step; their K/V land after the cached ones."""

    seq_id: str
    token_ids: list[int]
    all_logits: bool = False  # logits for every position (speculative verification), not just the last
    # With all_logits: return the final-normed hidden rows [n, hidden] instead of logits; the caller
    # runs ``ModelRunner.head`` on the rows it needs (greedy verification stops at the first mismatch).
    hidden_only: bool = False


@dataclass
class _Layer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    w_qkv_t: torch.Tensor  # [hidden, q+k+v]: stored transposed, see the note below
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor
    w_gate_up_t: torch.Tensor  # [hidden, 2 * intermediate], transposed
    w_down: torch.Tensor
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


# The projections quantization treats as units: (name suffix, _Layer weight, stored transposed?, kernel slot).
# A kernel slot "f_x" has a packed-copy slot "p_x".
# Names follow the checkpoint's, with the fused ones named like vLLM's (qkv_proj, gate_up_proj).
PROJECTIONS: tuple[tuple[str, str, bool, str], ...] = (
    ("self_attn.qkv_proj", "w_qkv_t", True, "f_qkv"),
    ("self_attn.o_proj", "w_o", False, "f_o"),
    ("mlp.gate_up_proj", "w_gate_up_t", True, "f_gate_up"),
    ("mlp.down_proj", "w_down", False, "f_down"),
)
EMBED, HEAD = "model.embed_tokens", "lm_head"


# Widening projections (out > in) are stored transposed and run as ``x @ w_t``:
# MKL's GEMV streams a [in, out] matrix about 1.7x faster than F.linear's
# [out, in] one when the weights come from DRAM (batch-1 decode), and is no
# slower for prefill-sized batches. Narrowing ones (o, down) are faster as F.linear.


def _spans(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each chunk's positions among the rows that went through the final norm."""
    out, o = [], 0
    for r in rows:
        out.append(torch.arange(o, o + len(r)))
        o += len(r)
    return out


def _mm(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """A float projection: one row through the plain weight (GEMV), more through the packed copy."""
    if packed is not None and x.shape[0] > 1:
        return packed_linear.linear(x, packed)
    return x @ w if transposed else F.linear(x, w)


# A decode SDPA call's fixed cost, in padded-token equivalents, for grouping rows by length.
_GROUP_COST = 64
# Chunks of at most this many tokens go to the paged kernel (decode, verification, short prompts);
# longer ones to SDPA. Measured per layer here (2 threads, the embedded model): the kernel beat
# SDPA over gathered pages at 1-64 queries (64 queries over 300 tokens: 428 against 457 us), and
# was even at 128 over 500.
_KERNEL_MAX_CHUNK = 64


def _decode_groups(cache: PagedKVCache, chunks: list[SeqChunk], starts: list[int], offsets: list[int],
                   dec: list[int]) -> list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor | None]]:
    """The torch path's decode attention plan: (q rows, key length, K/V slots, mask) per SDPA group."""
    # Decode rows are grouped by length (sorted, then cut where padding a row up to its
    # group's longest costs more than another SDPA call); each group gathers only its
    # own tokens' K/V slots with one index_select per layer, the slot indices built once
    # per step. Rows shorter than their group's longest mask their tail.
    dec_plan: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor | None]] = []
    if dec:
        ps = cache.page_size
        lens = [starts[i] + 1 for i in dec]
        order = sorted(range(len(dec)), key=lambda r: lens[r])
        sl = [lens[r] for r in order]
        # cost[j] = cheapest split of sorted rows [0, j); a group [i, j) costs one call
        # (worth _GROUP_COST tokens) plus (j - i) rows padded to sl[j - 1].
        n = len(sl)
        cost = [0] + [0] * n
        cut = [0] * (n + 1)
        for j in range(1, n + 1):
            best, bi = _GROUP_COST + j * sl[j - 1], 0
            for i in range(1, j):
                c_ = cost[i] + _GROUP_COST + (j - i) * sl[j - 1]
                if c_ < best:
                    best, bi = c_, i
            cost[j], cut[j] = best, bi
        bounds, j = [], n
        while j > 0:
            bounds.append((cut[j], j))
            j = cut[j]
        for a, b in reversed(bounds):
            members = sorted(order[a:b])  # row order within a group is free; keep step order
            glen = sl[b - 1]
            width = cache.pages_for(glen)
            pages = torch.zeros(len(members), width, dtype=torch.long)
            for r, m in enumerate(members):
                table = cache.block_tables[chunks[dec[m]].seq_id][:width]
                pages[r, : len(table)] = torch.tensor(table)
            slots = ((pages * ps).unsqueeze(2) + torch.arange(ps)).view(len(members), -1)[:, :glen].reshape(-1)
            mask = None
            if sl[a] != glen:
                mlens = torch.tensor([lens[m] for m in members])
                mask = (torch.arange(glen)[None, :] < mlens[:, None])[:, None, None, :]
            rows = torch.tensor([offsets[dec[m]] for m in members], dtype=torch.long)
            dec_plan.append((rows, glen, slots, mask))
    return dec_plan


def _kernel_plan(cache: PagedKVCache, chunks: list[SeqChunk], starts: list[int], offsets: list[int],
                 short: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The paged kernel's plan: block tables [S, W], and per row of the step its table row and
    visible length (causal within a chunk; 0 = a row another path runs)."""
    T = offsets[-1] + len(chunks[-1].token_ids)
    tabs = [cache.block_tables[chunks[i].seq_id] for i in short]
    W = max(len(t) for t in tabs)
    row_seq, row_len = [0] * T, [0] * T
    for r, i in enumerate(short):
        off, s = offsets[i], starts[i]
        for j in range(len(chunks[i].token_ids)):
            row_seq[off + j], row_len[off + j] = r, s + j + 1
    tables = torch.tensor([t + [0] * (W - len(t)) for t in tabs], dtype=torch.int32)
    return tables, torch.tensor(row_seq, dtype=torch.int32), torch.tensor(row_len, dtype=torch.int32)


class ModelRunner:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.embed = weights["model.embed_tokens.weight"]
        self.norm = weights["model.norm.weight"]
        # A tied model's head is the embedding, unless the loader supplies it apart (an optimized
        # directory whose embedding is int8 but whose lm_head stayed float).
        head = weights["lm_head.weight"] if "lm_head.weight" in weights else self.embed
        self.lm_head_t = head.t().contiguous()  # [hidden, vocab]; a copy even when tied (see the note on _Layer)
        self.inv_freq = inv_frequencies(cfg)
        self.layers: list[_Layer] = []
        for n in range(cfg.num_hidden_layers):
            p = f"model.layers.{n}."
            a = p + "self_attn."
            # Fused QKV and gate/up: one matmul each instead of three and two.
            bias = None
            if cfg.attention_bias:
                bias = torch.cat([weights[a + f"{x}_proj.bias"] for x in "qkv"])
            self.layers.append(_Layer(
                in_norm=weights[p + "input_layernorm.weight"],
                post_norm=weights[p + "post_attention_layernorm.weight"],
                w_qkv_t=torch.cat([weights[a + f"{x}_proj.weight"] for x in "qkv"]).t().contiguous(),
                b_qkv=bias,
                w_o=weights[a + "o_proj.weight"],
                w_gate_up_t=torch.cat([weights[p + "mlp.gate_proj.weight"],
                                       weights[p + "mlp.up_proj.weight"]]).t().contiguous(),
                w_down=weights[p + "mlp.down_proj.weight"],
            ))
        # Per-layer torch devices once place() ran with anything but the CPU; None = all on the CPU.
        self.layer_devices: list[torch.device] | None = None
        # Optional prefill MLP replacement: (layer index, normed h) -> MLP output or None (torch runs it).
        self.mlp_offload: Callable[[int, torch.Tensor], torch.Tensor | None] | None = None
        self.f_head: Callable[[torch.Tensor], torch.Tensor] | None = None  # quantized lm_head, when installed
        self.embed_q: tuple[torch.Tensor, torch.Tensor] | None = None  # int8 [vocab, hidden], scales [vocab, 1]
        self.p_head: torch.Tensor | None = None  # oneDNN-packed lm_head for more than one row
        # "auto": the paged C kernel for short chunks where it builds and fits (dspark.llm.runner.paged_attention),
        # "torch": always gather + SDPA.
        self.attention = "auto"

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
            for name in ("in_norm", "post_norm", "w_qkv_t", "b_qkv", "w_o", "w_gate_up_t", "w_down"):
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
    def from_pretrained(cls, path: str, dtype: str | torch.dtype = "auto") -> ModelRunner:
        cfg, weights = load_checkpoint(path, dtype)
        return cls(cfg, weights, resolve_dtype(dtype, cfg))

    def place(self, layer_devices: list[str], embed_device: str = "cpu", head_device: str = "cpu") -> None:
        """Hold each layer's weights (and, via make_cache, its KV pages) on its torch device."""
        if len(layer_devices) != len(self.layers):
            raise ValueError(f"{len(layer_devices)} layer devices for {len(self.layers)} layers")
        devs = [torch.device(d) for d in layer_devices]
        for owner, _, _, pslot in self.float_projections():  # packed copies are CPU-only; pack again after
            setattr(owner, pslot, None)
        for L, d in zip(self.layers, devs):
            for name in ("in_norm", "post_norm", "w_qkv_t", "b_qkv", "w_o", "w_gate_up_t", "w_down"):
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

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # Same op order as HF LlamaRMSNorm: statistics in fp32, scale in model dtype.
        # The fused kernel saves four dispatches per norm, which matters at batch 1.
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, self.cfg.rms_norm_eps)
        return w * F.rms_norm(x.float(), (x.shape[-1],), None, self.cfg.rms_norm_eps).to(x.dtype)

    @torch.inference_mode()
    def step(self, cache: PagedKVCache, chunks: list[SeqChunk], exit_layer: int | None = None) -> list[torch.Tensor]:
        """Run one forward; returns per chunk fp32 logits, [vocab] or [n, vocab] if ``all_logits``.

        ``exit_layer=E`` runs only the first E layers, then the final norm and
        the LM head (early exit, for self-drafting); only those layers' K/V are
        written, and the sequence lengths advance as for a full step.
        """
        c = self.cfg
        H, KVH, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        starts: list[int] = []
        for ch in chunks:
            if not ch.token_ids:
                raise ValueError(f"sequence {ch.seq_id}: empty chunk")
            start = cache.seq_lens.get(ch.seq_id, 0)
            cache.reserve(ch.seq_id, start + len(ch.token_ids))
            starts.append(start)
        tokens = torch.tensor([t for ch in chunks for t in ch.token_ids], dtype=torch.long)
        # Positions and the K/V slots they write, in plain Python: a tensor op per chunk cost more
        # than the arithmetic at batch 32.
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
        cos, sin = cos_sin(self.inv_freq, positions, self.dtype)

        # Attention plan, shared by all layers: which rows, which cached slots, which mask.
        offsets, o = [], 0
        for ch in chunks:
            offsets.append(o)
            o += len(ch.token_ids)
        multi = any(len(ch.token_ids) > 1 for ch in chunks)  # a prefill (or verification) chunk is in this step
        # Short chunks (decode rows, verification drafts, tiny prompts) go to the paged kernel when it
        # runs here; otherwise decode rows are batched SDPA groups and every longer chunk is one SDPA call.
        kern = self._kernel(cache)
        if kern is not None:
            short = [i for i, ch in enumerate(chunks) if len(ch.token_ids) <= _KERNEL_MAX_CHUNK]
            kplan = _kernel_plan(cache, chunks, starts, offsets, short) if short else None
            dec_plan: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor | None]] = []
            pre = [i for i, ch in enumerate(chunks) if len(ch.token_ids) > _KERNEL_MAX_CHUNK]
        else:
            kplan = None
            dec_plan = _decode_groups(cache, chunks, starts, offsets,
                                      [i for i, ch in enumerate(chunks) if len(ch.token_ids) == 1])
            pre = [i for i, ch in enumerate(chunks) if len(ch.token_ids) > 1]
        pre_plan: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []
        for i in pre:
            n, s = len(chunks[i].token_ids), starts[i]
            pages = torch.tensor(cache.block_tables[chunks[i].seq_id][: cache.pages_for(s + n)])
            mask = None if s == 0 else (torch.arange(s + n)[None, :] <= torch.arange(s, s + n)[:, None])
            pre_plan.append((offsets[i], n, pages, mask))

        devs = self.layer_devices
        x = self._lookup(tokens if devs is None else tokens.to(self.embed.device))
        T = x.shape[0]
        for li, L in enumerate(self.layers if exit_layer is None else self.layers[:exit_layer]):
            if devs is not None and devs[li] != x.device:
                # Crossing to another device: the hidden state and the step's small plan tensors move.
                d = devs[li]
                x, cos, sin, write_slots = (t.to(d) for t in (x, cos, sin, write_slots))
                dec_plan = [(r_.to(d), g_, s_.to(d), None if m_ is None else m_.to(d)) for r_, g_, s_, m_ in dec_plan]
                pre_plan = [(o_, n_, p_.to(d), None if m_ is None else m_.to(d)) for o_, n_, p_, m_ in pre_plan]
            h = self._rms(x, L.in_norm)
            qkv = L.f_qkv(h) if L.f_qkv is not None else _mm(h, L.w_qkv_t, L.p_qkv, True)
            if L.b_qkv is not None:
                qkv = qkv + L.b_qkv
            qk = apply_rope(qkv[:, : (H + KVH) * D].view(T, H + KVH, D), cos, sin)  # q and k in one go
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, (H + KVH) * D :].view(T, KVH, D)
            kc, vc = cache.k[li], cache.v[li]
            kc.view(-1, KVH, D)[write_slots] = k
            vc.view(-1, KVH, D)[write_slots] = v
            kflat, vflat = kc.view(-1, KVH, D), vc.view(-1, KVH, D)
            # A decode-only step with one group has its rows already in order: no gather/scatter of q.
            whole = not pre_plan and len(dec_plan) == 1
            attn = None if whole else torch.empty(T, H, D, dtype=x.dtype, device=x.device)
            if kplan is not None:
                assert kern is not None and attn is not None
                kern(q, attn, kc, vc, *kplan, D ** -0.5)
            for rows, glen, slots, mask in dec_plan:
                B = rows.shape[0]
                qd = (q if whole else q.index_select(0, rows)).unsqueeze(2)  # [B, H, 1, D]
                kd = kflat.index_select(0, slots).view(B, glen, KVH, D).transpose(1, 2)
                vd = vflat.index_select(0, slots).view(B, glen, KVH, D).transpose(1, 2)
                out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=H != KVH)
                if attn is None:
                    attn = out.squeeze(2)
                else:
                    attn.index_copy_(0, rows, out.squeeze(2))
            for off, n, pages, mask in pre_plan:
                L_ = n if mask is None else mask.shape[1]
                qp = q[off : off + n].transpose(0, 1).unsqueeze(0)
                kp = kc[pages].view(-1, KVH, D)[:L_].transpose(0, 1).unsqueeze(0)
                vp = vc[pages].view(-1, KVH, D)[:L_].transpose(0, 1).unsqueeze(0)
                out = F.scaled_dot_product_attention(
                    qp, kp, vp, attn_mask=mask, is_causal=mask is None, enable_gqa=H != KVH
                )
                attn[off : off + n] = out[0].transpose(0, 1)
            assert attn is not None
            a = attn.reshape(T, H * D)
            x = x + (L.f_o(a) if L.f_o is not None else _mm(a, L.w_o, L.p_o, False))
            h = self._rms(x, L.post_norm)
            mlp = self.mlp_offload(li, h) if self.mlp_offload is not None and multi else None
            if mlp is None:
                gu = L.f_gate_up(h) if L.f_gate_up is not None else _mm(h, L.w_gate_up_t, L.p_gate_up, True)
                g, u = gu.chunk(2, dim=-1)
                a = F.silu(g) * u
                mlp = L.f_down(a) if L.f_down is not None else _mm(a, L.w_down, L.p_down, False)
            x = x + mlp

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
        logits = (self.f_head(hn) if self.f_head is not None else _mm(hn, self.lm_head_t, self.p_head, True)).float()
        return logits.cpu() if self.layer_devices is not None else logits  # the sampler lives on the host
