"""A feature-level draft head (EAGLE-style): one small block over the target's own last hidden states.

The target's final-normed hidden state ``u_i`` at position ``i`` already sums up the whole
context; the head maps ``(u_i, embed(x_{i+1}))`` to a prediction of ``u_{i+1}`` (attending over
the few rows before it when it has a window), and the target's own LM head turns that into the
next token. Drafting k tokens chains the head on its own predictions: k small steps and k
LM-head rows, no second model and at most ``window`` keys and values per sequence.

It needs nothing but the target's logits: with a linear LM head and no soft-cap, ``u`` is the
least-squares solution of ``logits = u @ W.T`` (``W`` [vocab, hidden] has full column rank),
so any decoder target, compiled or not, can feed it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

HEAD_KIND = "feature-head"
VOCAB_KEY = "draft_vocab"


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Block(nn.Module):
    """x + SwiGLU(norm(x))."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.norm = _RMSNorm(dim)
        self.gate_up = nn.Linear(dim, 2 * inner, bias=False)
        self.down = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(g) * u)


class _Rope:
    """Rotary embedding (theta 10000), its cos/sin table grown as positions need."""

    def __init__(self, hd: int) -> None:
        self.inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.cos = self.sin = torch.empty(0, hd)

    def __call__(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``x`` [..., N, heads, hd] at positions ``pos`` [..., N]."""
        need = int(pos.max()) + 1
        if need > self.cos.shape[0]:
            ang = torch.arange(max(need, 2 * self.cos.shape[0], 1024), dtype=torch.float32)[:, None] * self.inv
            self.cos, self.sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        cos, sin = self.cos[pos][..., None, :], self.sin[pos][..., None, :]
        a, b = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-b, a], dim=-1) * sin


class _WindowAttention(nn.Module):
    """Causal attention over the last ``window`` positions (the row itself included)."""

    def __init__(self, dim: int, heads: int, window: int) -> None:
        super().__init__()
        self.norm = _RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.heads, self.hd, self.window = heads, dim // heads, window
        self.rope = _Rope(self.hd)

    def qkv_at(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [..., N, dim] at ``pos`` [..., N] -> q, k, v [..., N, heads, hd] (q and k rotated)."""
        q, k, v = self.qkv(self.norm(x)).unflatten(-1, (3, self.heads, self.hd)).unbind(-3)
        return self.rope(q, pos), self.rope(k, pos), v

    def forward_seq(self, x: torch.Tensor) -> torch.Tensor:
        """Training: every row of ``x`` [B, T, dim] over its window."""
        T = x.shape[1]
        pos = torch.arange(T)
        q, k, v = self.qkv_at(x, pos.expand(x.shape[0], T))
        band = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - self.window)
        out = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                         attn_mask=band)
        return self.o(out.transpose(1, 2).flatten(-2))

    def attend(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Drafting: one query per row, ``q`` [B, heads, hd], over ``K``/``V`` [B, W, heads, hd] where
        ``mask`` [B, W] is true."""
        out = nn.functional.scaled_dot_product_attention(q[:, :, None], K.transpose(1, 2), V.transpose(1, 2),
                                                         attn_mask=mask[:, None, None, :])
        return self.o(out[:, :, 0].flatten(-2))


class FeatureHead(nn.Module):
    """``(u_i [.., H], e_{i+1} [.., H]) -> u_{i+1} [.., H]`` in the target's final-normed space.

    With ``window > 0`` each row also attends over the ``window - 1`` rows before it (EAGLE's
    attention layer, bounded so drafting keeps only a few rows per sequence)."""

    def __init__(self, hidden: int, inner: int, blocks: int = 1, window: int = 0) -> None:
        super().__init__()
        self.hidden, self.inner, self.blocks, self.window = hidden, inner, blocks, window
        self.feat_norm = _RMSNorm(hidden)
        self.tok_norm = _RMSNorm(hidden)
        self.fuse = nn.Linear(2 * hidden, hidden, bias=True)
        self.attn = _WindowAttention(hidden, max(1, hidden // 64), window) if window > 0 else None
        self.layers = nn.ModuleList(_Block(hidden, inner) for _ in range(blocks))
        self.out_norm = _RMSNorm(hidden)

    def fuse_in(self, u: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return self.fuse(torch.cat([self.feat_norm(u), self.tok_norm(e)], dim=-1))

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out_norm(x)

    def forward(self, u: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Rows without context (``window == 0``), or training sequences [B, T, H] (any window)."""
        x = self.fuse_in(u, e)
        if self.attn is not None:
            x = x + self.attn.forward_seq(x)
        return self.finish(x)

    def config(self) -> dict[str, Any]:
        return {"hidden_size": self.hidden, "intermediate_size": self.inner, "num_blocks": self.blocks,
                "window": self.window}


def save_head(head: FeatureHead, out_dir: Path, target_name: str, extra: dict[str, Any],
              draft_vocab: torch.Tensor | None = None) -> None:
    """``draft_vocab``: the token ids the head drafts among, most frequent first (FR-Spec's
    frequency-ranked subset: the LM-head product per drafted token shrinks to its rows); None = all."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    if draft_vocab is not None:
        tensors[VOCAB_KEY] = draft_vocab.to(torch.int32).contiguous()
    save_file(tensors, str(out_dir / "head.safetensors"))
    cfg = {"dspark_role": HEAD_KIND, "dspark_head_for": target_name, **head.config(), **extra}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def load_head(path: str | Path) -> tuple[FeatureHead, torch.Tensor | None]:
    """A saved head, in float32 (its weights are stored in bfloat16), and its draft vocabulary."""
    from safetensors.torch import load_file

    p = Path(path)
    cfg = json.loads((p / "config.json").read_text())
    if cfg.get("dspark_role") != HEAD_KIND:
        raise ValueError(f"{p / 'config.json'}: dspark_role is {cfg.get('dspark_role')!r}, not {HEAD_KIND!r}")
    head = FeatureHead(int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg.get("num_blocks", 1)),
                       int(cfg.get("window", 0)))
    state = load_file(str(p / "head.safetensors"))
    vocab = state.pop(VOCAB_KEY, None)
    head.load_state_dict({k: v.float() for k, v in state.items()})
    return head.eval(), None if vocab is None else vocab.long()


def find_heads(target: str | Path) -> list[Path]:
    """Feature heads made for ``target``: sibling directories whose config says
    ``dspark_head_for: <target dir name>``."""
    root = Path(target).resolve()
    if not root.parent.is_dir():
        return []
    found = []
    for d in sorted(root.parent.iterdir()):
        cfg = d / "config.json"
        if d == root or not cfg.exists():
            continue
        try:
            raw = json.loads(cfg.read_text())
        except ValueError:
            continue
        if raw.get("dspark_role") == HEAD_KIND and raw.get("dspark_head_for") == root.name:
            found.append(d)
    return found


def _rms(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class FusedHead:
    """A :class:`FeatureHead` for drafting: norm weights folded into the matrices after them, and the
    token half of ``fuse`` precomputed per vocabulary entry, so a drafted token is a few products and
    few calls (its cost is mostly per-call overhead and reading weights). Computes what the module does."""

    def __init__(self, head: FeatureHead, emb: torch.Tensor) -> None:
        H = head.hidden
        with torch.no_grad():
            Wf = head.fuse.weight
            self.fu = (Wf[:, :H] * head.feat_norm.weight[None, :]).T.contiguous()
            self.fe = (_rms(emb) * head.tok_norm.weight) @ Wf[:, H:].T + head.fuse.bias  # [V, H]
            self.attn = head.attn
            if head.attn is not None:
                a = head.attn
                self.qkv = (a.qkv.weight * a.norm.weight[None, :]).T.contiguous()
                self.o = a.o.weight.T.contiguous()
            self.blocks = [((b.gate_up.weight * b.norm.weight[None, :]).T.contiguous(), b.down.weight.T.contiguous())
                           for b in head.layers]
            self.out = head.out_norm.weight.detach().clone()
        self.inner = head.inner

    def fuse_in(self, u: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``u`` [N, H] and token ids [N] -> the block's input [N, H]."""
        return _rms(u) @ self.fu + self.fe[tokens]

    def qkv_at(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [N, H] at ``pos`` [N] -> q, k, v [N, heads, hd]."""
        a = self.attn
        assert a is not None
        q, k, v = (_rms(x) @ self.qkv).unflatten(-1, (3, a.heads, a.hd)).unbind(-3)
        return a.rope(q, pos), a.rope(k, pos), v

    def attend(self, x: torch.Tensor, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """Rows ``x`` [B, H], queries [B, heads, hd] over ``K``/``V`` [B, W, heads, hd] -> x + attention."""
        out = nn.functional.scaled_dot_product_attention(q[:, :, None], K.transpose(1, 2), V.transpose(1, 2),
                                                         attn_mask=mask[:, None, None, :])
        return x + out[:, :, 0].flatten(-2) @ self.o

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        for gu, d in self.blocks:
            g, u = (_rms(x) @ gu).split(self.inner, dim=-1)
            x = x + (nn.functional.silu(g) * u) @ d
        return _rms(x) * self.out
