"""A feature-level draft head (EAGLE-style): one small block over the target's own last hidden state.

The target's final-normed hidden state ``u_i`` at position ``i`` already sums up the whole
context; the head maps ``(u_i, embed(x_{i+1}))`` to a prediction of ``u_{i+1}``, and the
target's own LM head turns that into the next token. Drafting k tokens chains the head on its
own predictions: k small matrix products and k LM-head rows, no KV cache, no second model.

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


class FeatureHead(nn.Module):
    """``(u_i [.., H], e_{i+1} [.., H]) -> u_{i+1} [.., H]`` in the target's final-normed space."""

    def __init__(self, hidden: int, inner: int, blocks: int = 1) -> None:
        super().__init__()
        self.hidden, self.inner, self.blocks = hidden, inner, blocks
        self.feat_norm = _RMSNorm(hidden)
        self.tok_norm = _RMSNorm(hidden)
        self.fuse = nn.Linear(2 * hidden, hidden, bias=True)
        self.layers = nn.ModuleList(_Block(hidden, inner) for _ in range(blocks))
        self.out_norm = _RMSNorm(hidden)

    def forward(self, u: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        x = self.fuse(torch.cat([self.feat_norm(u), self.tok_norm(e)], dim=-1))
        for layer in self.layers:
            x = layer(x)
        return self.out_norm(x)

    def config(self) -> dict[str, Any]:
        return {"hidden_size": self.hidden, "intermediate_size": self.inner, "num_blocks": self.blocks}


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
    head = FeatureHead(int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg.get("num_blocks", 1)))
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
