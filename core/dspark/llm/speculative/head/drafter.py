"""The feature-head drafter: drafts from the target's own last row (``DraftRequest.target_row``).

Stateless (no KV of its own: the target's row carries the context), so ``commit`` and
``release`` have nothing to do; batched over the step's sequences, one head call and one
LM-head product per draft position.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from dspark.llm.speculative.drafters import _draft, _pick
from dspark.llm.speculative.head.model import FeatureHead, load_head
from dspark.types import Draft, DraftRequest


def _target_matrices(target: Path) -> tuple[torch.Tensor, torch.Tensor]:
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


class FeatureHeadDrafter:
    """Drafts with a :class:`FeatureHead` over the target's row; declines (empty draft) without one."""

    wants_target_row = True
    # Logit rows solved for the hidden state when the target gives logits: the equations are exact up
    # to the logits' rounding, so the most frequent tokens' rows (well-trained embeddings) are plenty.
    RECOVER_ROWS = 1024

    def __init__(self, head_path: str | Path, target_path: str | Path) -> None:
        self.head, vocab = load_head(head_path)
        emb, W = _target_matrices(Path(target_path))
        H, V = self.head.hidden, W.shape[0]
        if W.shape[1] != H or emb.shape[1] != H:
            raise ValueError(f"{head_path}: hidden size {H} differs from {target_path}'s {W.shape[1]}")
        self.vocab_size, self.emb = V, emb
        self.ids = vocab if vocab is not None else torch.arange(V)  # what the head drafts among
        self.Wt = W[self.ids].T.contiguous()  # [H, len(ids)]
        rows = self.ids[: max(self.RECOVER_ROWS, 2 * H)]
        Wr = W[rows].double()
        self.recover_rows = rows
        self.recover = (Wr @ torch.linalg.inv(Wr.T @ Wr)).float()  # u = logits[rows] @ recover

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

    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = [Draft(tokens=[]) for _ in requests]
        idx, feats = [], []
        for i, r in enumerate(requests):
            if r.k <= 0 or not r.tokens or r.target_row is None:
                continue
            u = self._feature(r.target_row)
            if u is not None:
                idx.append(i)
                feats.append(u)
        if not idx:
            return drafts
        out: dict[int, tuple[list[int], list[float], list[torch.Tensor | None]]] = {i: ([], [], []) for i in idx}
        with torch.inference_mode():
            active = idx
            u = torch.stack(feats)
            tok = torch.tensor([requests[i].tokens[-1] for i in idx])
            while active:
                u = self.head(u, self.emb[tok])
                reqs = [requests[i] for i in active]
                toks, confs, qs = self._pick(u @ self.Wt, reqs)
                keep = []
                for row, i in enumerate(active):
                    r, (ts, cs, q) = requests[i], out[i]
                    ts.append(toks[row])
                    cs.append(confs[row])
                    q.append(qs[row])
                    if len(ts) < r.k and (r.keep_going is None or r.keep_going(len(ts), confs[row])):
                        keep.append(row)
                active = [active[j] for j in keep]
                u = u[keep]
                tok = torch.tensor([toks[j] for j in keep], dtype=torch.long)
        for i, o in out.items():
            drafts[i] = _draft(*o)
        return drafts

    def propose(self, tokens: list[int], k: int) -> Draft:
        """Outside an engine there is no target row to draft from."""
        return Draft(tokens=[])

    def commit(self, seq_id: str, num_tokens: int) -> None:
        pass

    def release(self, seq_id: str) -> None:
        pass
