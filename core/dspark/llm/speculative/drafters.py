"""The engine's own drafters: a separate draft model, and the target's early exit.

Both implement the batched, stateful drafter API (1.1): ``propose_batch``
runs one forward per draft position over every sequence of the step,
``commit`` rolls a sequence's draft state back to what the verifier kept,
``release`` frees it. Both are offered through the ``dspark_drafters`` hook
by the built-in plugin ``drafters`` (``dspark.llm.speculative.builtin_plugin``), so they
reach the engine exactly the way a third party's drafter does.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from dspark.llm.logits import argmax_last
from dspark.llm.runner.kv_cache import PagedKVCache
from dspark.llm.runner.model import ModelRunner, SeqChunk
from dspark.types import Draft, DraftRequest


def read_raw_config(path: str | Path) -> dict[str, Any]:
    try:
        return dict(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, ValueError):
        return {}


def tokenizer_fingerprint(path: str | Path) -> str:
    f = Path(path) / "tokenizer.json"
    return hashlib.sha256(f.read_bytes()).hexdigest()[:16] if f.exists() else ""


def compatibility_problem(target: str | Path, draft: str | Path) -> str | None:
    """Why ``draft`` cannot draft for ``target`` (vocabulary or tokenizer differ), or None."""
    t, d = read_raw_config(target), read_raw_config(draft)
    if not d:
        return f"{draft} has no readable config.json"
    if t.get("vocab_size") != d.get("vocab_size"):
        return f"vocab_size {d.get('vocab_size')} differs from the target's {t.get('vocab_size')}"
    ft, fd = tokenizer_fingerprint(target), tokenizer_fingerprint(draft)
    if ft and fd and ft != fd:
        return "its tokenizer.json differs from the target's"
    return None


def find_draft_models(target: str | Path) -> list[Path]:
    """Draft checkpoints made for ``target``: sibling directories whose config says
    ``dspark_draft_for: <target dir name>`` or named ``<target>-draft*``, and compatible."""
    root = Path(target).resolve()
    found = []
    spec = root / "dspark_draft.json"  # an optimized directory (dspark convert) names its own draft
    if spec.exists():
        try:
            rel = json.loads(spec.read_text()).get("draft_model")
        except ValueError:
            rel = None
        if isinstance(rel, str) and rel not in ("none", "auto") and (root / rel / "config.json").exists():
            if compatibility_problem(root, root / rel) is None:
                found.append(root / rel)
    if not root.parent.is_dir():
        return found
    for d in sorted(root.parent.iterdir()):
        if d == root or not (d / "config.json").exists():
            continue
        raw = read_raw_config(d)
        if raw.get("dspark_draft_for") == root.name or d.name.startswith(root.name + "-draft"):
            if compatibility_problem(root, d) is None:
                found.append(d)
    return found


def _pick(logits: torch.Tensor, reqs: list[DraftRequest]) -> tuple[list[int], list[float], list[torch.Tensor | None]]:
    """Next token per row: argmax for greedy requests, a sample from softmax(l / T) otherwise."""
    tokens: list[int] = []
    confs: list[float] = []
    qs: list[torch.Tensor | None] = []
    greedy = torch.softmax(logits, dim=-1)
    best = argmax_last(logits)
    for i, r in enumerate(reqs):
        if r.temperature > 0:
            q = torch.softmax(logits[i] / r.temperature, dim=-1)
            t = int(torch.multinomial(q, 1, generator=r.generator))
            tokens.append(t)
            confs.append(float(q[t]))
            qs.append(q)
        else:
            t = best[i]
            tokens.append(t)
            confs.append(float(greedy[i, t]))
            qs.append(None)
    return tokens, confs, qs


def _draft(tokens: list[int], confs: list[float], qs: list[torch.Tensor | None]) -> Draft:
    probs = None
    if qs and qs[0] is not None:
        probs = torch.stack(qs).numpy()  # type: ignore[arg-type]
    return Draft(tokens=tokens, probs=probs, confidence=confs)


def _extend(outs: list[tuple[list[int], list[float], list[Any]]], reqs: list[DraftRequest], toks: list[int],
            confs: list[float], qs: list[torch.Tensor | None]) -> list[int]:
    """Append row j's drafted token (with its confidence and distribution) to ``outs[j]``; return the
    rows whose request wants more (below its k, and its ``keep_going`` agrees)."""
    more = []
    for row, (r, (ts, cs, q)) in enumerate(zip(reqs, outs)):
        ts.append(toks[row])
        cs.append(confs[row])
        q.append(qs[row])
        if len(ts) < r.k and (r.keep_going is None or r.keep_going(len(ts), confs[row])):
            more.append(row)
    return more


def _draft_loop(runner: ModelRunner, cache: PagedKVCache, reqs: list[DraftRequest], first: list[SeqChunk],
                exit_layer: int | None) -> list[Draft]:
    """Shared by both drafters: ``first`` chunks end at each context's last token."""
    out: list[tuple[list[int], list[float], list[Any]]] = [([], [], []) for _ in reqs]
    active = [i for i, r in enumerate(reqs) if r.k > 0]
    chunks = [first[i] for i in active]
    while active:
        logits = torch.stack(runner.step(cache, chunks, exit_layer=exit_layer))
        toks, confs, qs = _pick(logits, [reqs[i] for i in active])
        active = [active[j] for j in _extend([out[i] for i in active], [reqs[i] for i in active], toks, confs, qs)]
        chunks = [SeqChunk(reqs[i].seq_id, [out[i][0][-1]]) for i in active]
    return [_draft(*o) for o in out]


class DraftModelDrafter:
    """A small separate model with its own paged KV cache, kept in step with each sequence."""

    def __init__(self, path: str | Path, dtype: str = "float32", max_total_tokens: int = 8192,
                 page_size: int = 16, runtime: Any = None) -> None:
        """``runtime``: the target's (``TargetModel.runtime``); with its ``place_decoder`` the draft model's
        decoder is placed as the target's is (its plugins bid, the fastest measured runs; ``decoder_choice``
        says which)."""
        self.path = Path(path)
        self.runner: Any = ModelRunner.from_pretrained(str(path), dtype)
        from dspark.llm.runner.packed_linear import pack_runner

        pack_runner(self.runner, "auto")  # batched drafting steps run several rows
        self.decoder_choice = None
        place = getattr(runtime, "place_decoder", None)
        if place is not None:
            self.runner, self.decoder_choice = place(self.runner, self.path, max_total_tokens)
            page_size = getattr(self.runner, "block_size", None) or page_size
        self.cache = self.runner.make_cache(-(-max_total_tokens // page_size), page_size)
        self.toks: dict[str, list[int]] = {}  # per sequence, the tokens whose K/V are in self.cache
        self._last_use: dict[str, float] = {}

    # -- state --------------------------------------------------------------
    def _drop(self, seq_id: str, keep: int) -> None:
        have = self.toks[seq_id]
        if keep < len(have):
            self.cache.truncate(seq_id, len(have) - keep)
            del have[keep:]

    def commit(self, seq_id: str, num_tokens: int) -> None:
        if seq_id in self.toks:
            self._drop(seq_id, num_tokens)

    def release(self, seq_id: str) -> None:
        self.toks.pop(seq_id, None)
        self._last_use.pop(seq_id, None)
        self.cache.free(seq_id)

    def _room(self, seq_id: str, new_len: int, busy: set[str]) -> bool:
        """Pages for ``new_len`` tokens, evicting idle sequences (least recently used first)."""
        while not self.cache.can_grow(seq_id, new_len):
            idle = [s for s in self.toks if s not in busy]
            if not idle:
                return False
            self.release(min(idle, key=lambda s: self._last_use.get(s, 0.0)))
        self.cache.reserve(seq_id, new_len)
        return True

    # -- drafting -----------------------------------------------------------
    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        reqs, first, idx = [], [], []
        busy = {r.seq_id for r in requests}
        now = time.monotonic()
        for i, r in enumerate(requests):
            if r.k <= 0 or not r.tokens:
                continue
            have = self.toks.setdefault(r.seq_id, [])
            n = min(len(have), len(r.tokens) - 1)  # the last token is always fed: its logits start the draft
            if r.tokens[:n] != have[:n]:
                n = next(j for j, (a, b) in enumerate(zip(have, r.tokens)) if a != b)
            self._drop(r.seq_id, n)
            if not self._room(r.seq_id, len(r.tokens) + r.k - 1, busy):
                self.release(r.seq_id)
                continue
            self._last_use[r.seq_id] = now
            first.append(SeqChunk(r.seq_id, r.tokens[n:]))
            have.extend(r.tokens[n:])
            reqs.append(r)
            idx.append(i)
        drafts = [Draft(tokens=[]) for _ in requests]
        if reqs:
            for i, r, d in zip(idx, reqs, _draft_loop(self.runner, self.cache, reqs, first, None)):
                self.toks[r.seq_id].extend(d.tokens[:-1])  # every draft token but the last was fed
                self.cache.truncate(r.seq_id, 0)  # give back pages reserved for tokens not drafted
                drafts[i] = d
        return drafts

    def propose(self, tokens: list[int], k: int) -> Draft:
        sid = f"__propose_{id(tokens)}"
        try:
            return self.propose_batch([DraftRequest(sid, list(tokens), k)])[0]
        finally:
            self.release(sid)


class SelfDrafter:
    """The target's first ``exit_layer`` layers, its final norm and LM head (LayerSkip-style early exit).

    Inside the engine it shares the target's weights and KV cache: the
    context's K/V of those layers are already there, and the draft tokens'
    K/V it writes are overwritten by the verification forward (rejected ones
    are rolled back with the rest). Outside an engine (``propose``) it runs
    on a scratch cache.
    """

    def __init__(self, runtime: Any, exit_layer: int | None = None, candidates: list[int] | None = None) -> None:
        self.runtime = runtime
        self.runner: ModelRunner = runtime.runner
        L = self.runner.cfg.num_hidden_layers
        self.candidates = sorted({c for c in (candidates or []) if 1 <= c < L}) or [max(1, L // 3)]
        self.exit_layer = exit_layer if exit_layer is not None else self.candidates[0]
        self.measured: dict[int, dict[str, float]] = {}  # exit layer -> agreement, relative cost

    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        cache: PagedKVCache = self.runtime.cache
        drafts = [Draft(tokens=[]) for _ in requests]
        mine, first, idx, starts = [], [], [], []
        for i, r in enumerate(requests):
            if r.k <= 0 or not r.tokens:
                continue
            if cache.seq_lens.get(r.seq_id) != len(r.tokens) - 1:
                drafts[i] = self.propose(r.tokens, r.k)  # not the engine's decode state: run standalone
                continue
            mine.append(r)
            idx.append(i)
            starts.append(len(r.tokens) - 1)
            first.append(SeqChunk(r.seq_id, [r.tokens[-1]]))
        if mine:
            try:
                for i, d in zip(idx, _draft_loop(self.runner, cache, mine, first, self.exit_layer)):
                    drafts[i] = d
            finally:
                for r, s in zip(mine, starts):
                    cache.set_len(r.seq_id, s)  # the verifier writes these positions again, all layers
        return drafts

    def propose(self, tokens: list[int], k: int) -> Draft:
        if k <= 0 or not tokens:
            return Draft(tokens=[])
        page = 16
        cache = self.runner.make_cache(-(-(len(tokens) + k) // page), page)
        self.runner.step(cache, [SeqChunk("s", tokens[:-1])], exit_layer=self.exit_layer) if len(tokens) > 1 else None
        return _draft_loop(self.runner, cache, [DraftRequest("s", list(tokens), k)], [SeqChunk("s", [tokens[-1]])],
                           self.exit_layer)[0]

    def choose_exit_layer(self, tokens: list[int], rounds: int = 7) -> int:
        """Pick the exit layer by measurement on real context ``tokens``.

        For each candidate: the agreement ``a`` of its argmax with the full
        model's over ``tokens`` (teacher-forced, i.e. the acceptance of greedy
        self-drafting) and its 1-token step time ``c`` relative to the full
        model's (interleaved rounds, lower quartile); the winner maximises the
        best speed-up over k of E(a, k) / (1 + k c), E = (1 - a^(k+1)) / (1 - a).
        """
        r = self.runner
        toks = tokens[-128:]
        if len(toks) < 8:
            return self.exit_layer
        page = 16
        n = len(toks)
        depths: list[int | None] = [None, *self.candidates]
        caches = {e: r.make_cache(-(-(n + 1) // page), page) for e in depths}
        argmax = {}
        for e in depths:
            out = r.step(caches[e], [SeqChunk("s", toks, all_logits=True)], exit_layer=e)[0]
            argmax[e] = torch.argmax(out, dim=-1)
        times: dict[int | None, list[float]] = {e: [] for e in depths}
        for _ in range(rounds):
            for e in depths:
                t0 = time.perf_counter()
                r.step(caches[e], [SeqChunk("s", [toks[-1]])], exit_layer=e)
                times[e].append(time.perf_counter() - t0)
                caches[e].truncate("s", 1)
        cost = {e: sorted(ts)[(len(ts) - 1) // 4] for e, ts in times.items()}
        best, best_gain = self.exit_layer, 0.0
        for e in self.candidates:
            a = float((argmax[e] == argmax[None]).float().mean())
            c = cost[e] / max(cost[None], 1e-9)
            gain = max(_expected(a, k) / (1 + k * c) for k in range(1, 9))
            self.measured[e] = {"agreement": a, "relative_cost": c, "best_speedup": gain}
            if gain > best_gain:
                best, best_gain = e, gain
        self.exit_layer = best
        return best


def _expected(a: float, k: int) -> float:
    """Expected tokens from a k-token draft with per-token acceptance a (bonus token included)."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)
