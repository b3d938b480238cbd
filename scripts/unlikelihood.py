"""Sequence-level unlikelihood training (Welleck et al., 2019, "Neural Text Generation with Unlikelihood
Training"), for ``train_default_model.py --seq-ul-every``.

A small model's greedy continuations fall into loops ("(a.g. (a.g. (a.g."); maximum likelihood on
human text never shows it its own loops. Here the model continues prefixes of training text greedily,
and every continuation token that completes an n-gram already seen in its context (prefix and
continuation so far) is penalised by -log(1 - p(token)): the probability mass of the loop is pushed
elsewhere, on the model's own outputs. Steps of this loss alternate with ordinary likelihood steps,
which keep the model's perplexity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prefixes(x: torch.Tensor, length: int, count: int) -> torch.Tensor:
    """Up to ``count`` prefixes of ``length`` tokens cut from the windows ``x`` [batch, seq]."""
    per = x.shape[1] // length
    return x[:, : per * length].reshape(-1, length)[:count]


@torch.no_grad()
def greedy(model, prefix: torch.Tensor, new: int) -> torch.Tensor:
    """``prefix`` [b, p] continued by ``new`` greedy tokens (no stop): [b, p + new]."""
    was = model.training
    model.eval()
    out = model(input_ids=prefix, use_cache=True)
    past, seq = out.past_key_values, [prefix]
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(new - 1):
        seq.append(nxt)
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    seq.append(nxt)
    model.train(was)
    return torch.cat(seq, 1)


def repeats(seq: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """[b, len - start] booleans: the tokens from ``start`` on that belong to an n-gram which occurred
    earlier in the same row (Welleck et al.'s candidates: every token of a repeated n-gram)."""
    rows = seq.tolist()
    out = torch.zeros(seq.shape[0], seq.shape[1] - start, dtype=torch.bool)
    for b, row in enumerate(rows):
        seen = {tuple(row[i:i + n]) for i in range(max(start - n + 1, 0))}
        for end in range(max(start, n - 1), len(row)):  # the n-gram row[end - n + 1 .. end]
            g = tuple(row[end - n + 1:end + 1])
            if g in seen:
                lo = max(end - n + 1, start)
                out[b, lo - start:end + 1 - start] = True
            seen.add(g)
    return out


def seq_ul_loss(model, x: torch.Tensor, prefix_len: int, new: int, n: int,
                count: int) -> tuple[torch.Tensor, float]:
    """(the unlikelihood loss over greedy continuations of prefixes of ``x``, the share of their tokens
    that repeat an n-gram): the loss is summed over the repeated tokens and divided by all tokens."""
    seq = greedy(model, prefixes(x, prefix_len, count), new)
    cand = repeats(seq, prefix_len, n)
    logits = model(input_ids=seq[:, :-1], use_cache=False).logits[:, prefix_len - 1:]
    p = F.softmax(logits.float(), -1).gather(-1, seq[:, prefix_len:, None]).squeeze(-1)
    ul = -torch.log((1.0 - p).clamp_min(1e-5)) * cand
    return ul.sum() / cand.numel(), float(cand.float().mean())
