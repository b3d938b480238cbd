"""The feature-head drafter: drafts from the target's own last rows (``DraftRequest.target_rows``).

The target's row carries the context; the head's attention reaches back only ``window`` rows,
so a sequence's state here is at most that many keys and values (dropped by ``release``). Batched
over the step's sequences: one head call and one LM-head product (over the draft vocabulary) per
draft position.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dspark.llm.speculative.drafters import _draft, _extend, _pick
from dspark.llm.speculative.head.model import FusedHead, load_head
from dspark.types import Draft, DraftRequest


def target_matrices(target: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(token embedding [V, H], LM head [V, H]) of a safetensors checkpoint, in float32."""
    index = target / "model.safetensors.index.json"
    files = sorted({target / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.exists() \
        else sorted(target.glob("*.safetensors"))
    found: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                if name in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                    found[name] = sf.get_tensor(name).float()
    if "model.embed_tokens.weight" not in found:
        raise ValueError(f"{target}: no model.embed_tokens.weight in its safetensors files")
    emb = found["model.embed_tokens.weight"]
    return emb, found.get("lm_head.weight", emb)  # tied embeddings: the head is the embedding


class _Window:
    """One sequence's attention rows: positions and their keys and values (at most the head's window)."""

    __slots__ = ("pos", "K", "V")

    def __init__(self, pos: list[int], K: torch.Tensor, V: torch.Tensor) -> None:
        self.pos, self.K, self.V = pos, K, V


class FeatureHeadDrafter:
    """Drafts with a :class:`FeatureHead` over the target's rows; declines (empty draft) without them."""

    # Logit rows solved for the hidden state when the target gives logits: the equations are exact up
    # to the logits' rounding, so the most frequent tokens' rows (well-trained embeddings) are plenty.
    RECOVER_ROWS = 1024

    def __init__(self, head_path: str | Path, target_path: str | Path) -> None:
        self.head, vocab = load_head(head_path)
        emb, W = target_matrices(Path(target_path))
        H, V = self.head.hidden, W.shape[0]
        if W.shape[1] != H or emb.shape[1] != H:
            raise ValueError(f"{head_path}: hidden size {H} differs from {target_path}'s {W.shape[1]}")
        self.vocab_size = V
        self.fast = FusedHead(self.head, emb)
        self.window = self.head.window
        self.target_rows = max(1, self.window)  # API 1.9: how many of the context's last rows it reads
        self.ids = vocab if vocab is not None else torch.arange(V)  # what the head drafts among
        self.Wt = W[self.ids].T.contiguous()  # [H, len(ids)]
        rows = self.ids[: max(self.RECOVER_ROWS, 2 * H)]
        Wr = W[rows].double()
        self.recover_rows = rows
        self.recover = (Wr @ torch.linalg.inv(Wr.T @ Wr)).float()  # u = logits[rows] @ recover
        self.state: dict[str, _Window] = {}

    def _feature(self, row: torch.Tensor) -> torch.Tensor | None:
        """The target's final-normed hidden state from its row: as given, or solved from its logits."""
        r = row.detach().reshape(-1).float()
        if r.numel() == self.head.hidden:
            return r
        if r.numel() != self.vocab_size:
            return None
        return r[self.recover_rows] @ self.recover

    def _pick(self, logits: torch.Tensor, reqs: list[DraftRequest]) -> tuple[list[int], list[float],
                                                                              list[torch.Tensor | None]]:
        """Per row: the head's token (argmax, or a sample at the request's temperature, whose full-vocabulary
        distribution is then returned) and its probability under the head."""
        if all(r.temperature <= 0 for r in reqs):
            top, arg = logits.max(dim=-1)
            conf = 1.0 / torch.exp(logits - top[:, None]).sum(dim=-1)
            return self.ids[arg].tolist(), conf.tolist(), [None] * len(reqs)
        full = torch.full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.ids] = logits
        return _pick(full, reqs)

    def _start(self, r: DraftRequest) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The fused input of the context's last pair (the target's state at len - 2, the last token)
        and its query; the sequence's window brought up to date from the request's rows."""
        rows = list(r.target_rows or [])
        L = len(r.tokens)
        if not rows or (L < 2 and self.window):
            return None
        if self.attn is None:
            u = self._feature(rows[-1])
            return None if u is None else (self.fast.fuse_in(u[None], torch.tensor([r.tokens[-1]]))[0], None)
        first = L - 1 - len(rows)  # position of rows[0]
        st = self.state.get(r.seq_id)
        keep = [] if st is None else [j for j, p in enumerate(st.pos) if p < L - 1 and p >= L - 1 - self.window]
        have = {st.pos[j] for j in keep} if st is not None else set()
        new = [p for p in range(max(first, L - 1 - self.window, 0), L - 1) if p not in have or p == L - 2]
        us = [self._feature(rows[p - first]) for p in new]
        if not new or any(u is None for u in us):
            return None
        pos = torch.tensor(new)
        x = self.fast.fuse_in(torch.stack(us), torch.tensor([r.tokens[p + 1] for p in new]))  # type: ignore[misc]
        q, k, v = self.fast.qkv_at(x, pos)
        keep = [j for j in keep if st is not None and st.pos[j] not in new]
        P = [st.pos[j] for j in keep] + new if st is not None else new
        K = torch.cat([st.K[keep], k]) if st is not None and keep else k
        V = torch.cat([st.V[keep], v]) if st is not None and keep else v
        order = sorted(range(len(P)), key=P.__getitem__)[-self.window:]
        self.state[r.seq_id] = _Window([P[j] for j in order], K[order], V[order])
        return x[-1], q[-1]

    @property
    def attn(self) -> Any:
        """The head's attention module, or None (a head without attention)."""
        return self.head.attn

    def _attend(self, x: torch.Tensor, q: torch.Tensor, wins: list[_Window]) -> torch.Tensor:
        """Rows ``x`` [B, H] with queries ``q`` [B, heads, hd] over each one's window -> u^ [B, H]."""
        W = self.window
        K = torch.zeros(len(wins), W, *q.shape[1:])
        V = torch.zeros_like(K)
        mask = torch.zeros(len(wins), W, dtype=torch.bool)
        for b, w in enumerate(wins):
            n = len(w.pos)
            K[b, :n], V[b, :n], mask[b, :n] = w.K, w.V, True
        return self.fast.finish(self.fast.attend(x, q, K, V, mask))

    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = [Draft(tokens=[]) for _ in requests]
        idx, xs, qs = [], [], []
        with torch.inference_mode():
            for i, r in enumerate(requests):
                if r.k <= 0 or not r.tokens:
                    continue
                got = self._start(r)
                if got is not None:
                    idx.append(i)
                    xs.append(got[0])
                    qs.append(got[1])
            if not idx:
                return drafts
            out: dict[int, tuple[list[int], list[float], list[torch.Tensor | None]]] = {i: ([], [], []) for i in idx}
            active = idx
            # drafted pairs' keys join a copy of each window: the real rows replace them next call
            wins = [self.state[requests[i].seq_id] for i in idx] if self.attn is not None else []
            wins = [_Window(list(w.pos), w.K, w.V) for w in wins]
            x = torch.stack(xs)
            q = torch.stack(qs) if self.attn is not None else None  # type: ignore[arg-type]
            while active:
                u = self.fast.finish(x) if q is None else self._attend(x, q, wins)
                reqs = [requests[i] for i in active]
                toks, confs, ps = self._pick(u @ self.Wt, reqs)
                keep = _extend([out[i] for i in active], reqs, toks, confs, ps)
                active = [active[j] for j in keep]
                if not active:
                    break
                x = self.fast.fuse_in(u[keep], torch.tensor([toks[j] for j in keep], dtype=torch.long))
                if q is not None:
                    wins = [wins[j] for j in keep]
                    pos = torch.tensor([w.pos[-1] + 1 for w in wins])
                    q, k, v = self.fast.qkv_at(x, pos)
                    n = self.window
                    wins = [_Window((w.pos + [int(p)])[-n:], torch.cat([w.K, k[b:b + 1]])[-n:],
                                    torch.cat([w.V, v[b:b + 1]])[-n:]) for b, (w, p) in enumerate(zip(wins, pos))]
        for i, o in out.items():
            drafts[i] = _draft(*o)
        return drafts

    def propose(self, tokens: list[int], k: int) -> Draft:
        """Outside an engine there is no target row to draft from."""
        return Draft(tokens=[])

    def commit(self, seq_id: str, num_tokens: int) -> None:
        st = self.state.get(seq_id)
        if st is not None:  # rows past the kept tokens' states are not the target's any more
            keep = [j for j, p in enumerate(st.pos) if p <= num_tokens - 2]
            self.state[seq_id] = _Window([st.pos[j] for j in keep], st.K[keep], st.V[keep])

    def release(self, seq_id: str) -> None:
        self.state.pop(seq_id, None)
