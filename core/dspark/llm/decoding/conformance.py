"""Does a compiled decoder compute what the torch reference does? A scenario shared by the engine's
probe step, the plugins' tests and third-party plugin authors.

The scenario mixes what the engine sends: two prompts prefilled in one step (one of them in two
chunks), batched decode steps, and a verified draft (every row's logits) with a rollback after it,
then one sequence freed and a new one started beside the other, and a greedy run of both (several
decode steps in one call, API 1.13, where the decoder offers it; one step per token otherwise, fed the
reference's tokens). The decoder is driven through the
engine's own :class:`~dspark.llm.decoding.runner.DecoderRunner` (failover off), so a per-sequence
decoder (API 1.8) sees the drops and ids the engine sends. The reference runs first and its logits
are recorded (:func:`record`), so the engine can let go of the reference's weights before the
decoder's first step (:func:`replay`), where a runtime packs its own copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dspark.llm.decoding.runner import DecoderRunner, Target
from dspark.llm.runner.model import ModelRunner, SeqChunk
from dspark.llm.runner.types import ModelConfig
from dspark.sdk.decoder import CompiledDecoder, SequenceDecoder, is_sequence


@dataclass
class Conformance:
    max_abs_diff: float  # over every logit compared
    rows: int  # logit rows compared
    argmax_flips: int  # rows whose argmax differs from the reference's

    @property
    def flip_rate(self) -> float:
        return self.argmax_flips / max(1, self.rows)

    def why_not(self, exact: bool) -> str | None:
        """Why these logits cannot be trusted, or None: ``exact`` (float32 both sides) allows rounding only;
        otherwise (half precision, quantized) a few flips; a broken decoder is far off both."""
        tol, flips = (1e-2, 0.1) if exact else (1.0, 0.25)
        if self.max_abs_diff > tol or self.flip_rate > flips:
            return (f"its logits differ from the torch runner's by up to {self.max_abs_diff:.3g} with "
                    f"{self.argmax_flips}/{self.rows} argmax flips on the probe scenario")
        return None


def _as_tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))


@dataclass
class Transcript:
    """The scenario as the torch reference ran it: each event is ("step", chunks, its logits),
    ("truncate", seq, n) or ("free", seq), in order; replayed on a decoder without the reference."""

    block_size: int
    events: list[tuple[Any, ...]]


# The engine's probe step: a short scenario (every kind of step, few rows), with the blocks it needs.
PROBE_SCENARIO: dict[str, Any] = {"prompt_lens": (5, 19), "decode_steps": 2, "draft": 3}


def probe_blocks(block_size: int) -> int:
    return max(8, -(-64 // block_size) * 3 + 4)


def to_state(t: Transcript) -> dict[str, Any]:
    """The recording as lists, dicts and tensors only (``torch.load(..., weights_only=True)`` reads it back)."""
    def chunks(cs: list[SeqChunk]) -> list[dict[str, Any]]:
        return [dict(vars(c)) for c in cs]

    out: list[list[Any]] = []
    for kind, *args in t.events:
        if kind == "step":
            out.append([kind, chunks(args[0]), list(args[1])])
        elif kind == "run":
            first, limits, stop, toks, nxt, want = args
            out.append([kind, chunks(first), list(limits), sorted(stop), toks, chunks(nxt), list(want)])
        else:
            out.append([kind, *args])
    return {"block_size": t.block_size, "events": out}


def from_state(state: dict[str, Any]) -> Transcript:
    """The recording :func:`to_state` wrote."""
    def chunks(cs: list[dict[str, Any]]) -> list[SeqChunk]:
        return [SeqChunk(**c) for c in cs]

    events: list[tuple[Any, ...]] = []
    for kind, *args in state["events"]:
        if kind == "step":
            events.append((kind, chunks(args[0]), list(args[1])))
        elif kind == "run":
            first, limits, stop, toks, nxt, want = args
            events.append((kind, chunks(first), list(limits), frozenset(stop), toks, chunks(nxt), list(want)))
        else:
            events.append((kind, *args))
    return Transcript(int(state["block_size"]), events)


def record(runner: ModelRunner, block_size: int, *, seed: int = 0, prompt_lens: tuple[int, int] = (11, 37),
           decode_steps: int = 6, draft: int = 8, num_blocks: int = 64, run: int = 5) -> Transcript:
    """Run the scenario on ``runner`` (the torch reference) alone, greedy tokens from its own logits."""
    g = torch.Generator().manual_seed(seed)
    vocab = runner.cfg.vocab_size
    ref = runner.make_cache(num_blocks, block_size)
    events: list[tuple[Any, ...]] = []

    def step(chunks: list[SeqChunk]) -> list[torch.Tensor]:
        want = [w.float().clone() for w in runner.step(ref, chunks)]
        events.append(("step", chunks, want))
        return want

    def edit(kind: str, *args: Any) -> None:
        getattr(ref, kind)(*args)
        events.append((kind, *args))

    a, b = (torch.randint(4, vocab, (n,), generator=g).tolist() for n in prompt_lens)
    half = len(b) // 2
    out = step([SeqChunk("a", a), SeqChunk("b", b[:half])])
    out = [out[0], step([SeqChunk("b", b[half:])])[0]]
    last = [int(o.argmax()) for o in out]
    for _ in range(decode_steps):
        out = step([SeqChunk("a", [last[0]]), SeqChunk("b", [last[1]])])
        last = [int(o.argmax()) for o in out]
    drafted = [last[0], *torch.randint(4, vocab, (draft,), generator=g).tolist()]
    out = step([SeqChunk("a", drafted, all_logits=True), SeqChunk("b", [last[1]])])
    edit("truncate", "a", draft)  # the draft is rejected after its first token: roll back
    out = step([SeqChunk("a", [int(out[0][0].argmax())])])
    edit("free", "b")  # "b" finishes; "c" starts beside "a" (a per-sequence decoder is told to drop "b")
    c = torch.randint(4, vocab, (prompt_lens[0],), generator=g).tolist()
    out = step([SeqChunk("a", [int(out[0].argmax())]), SeqChunk("c", c)])
    _record_run(runner, ref, events, [("a", int(out[0].argmax())), ("c", int(out[1].argmax()))], run)
    return Transcript(block_size, events)


def _record_run(runner: ModelRunner, ref: Any, events: list[tuple[Any, ...]], last: list[tuple[str, int]],
                run: int) -> None:
    """A greedy run (what ``greedy_steps``, API 1.13, computes): the first sequence decodes ``run`` tokens,
    the second stops at its second token (given as a stop token), then one step continues both. Recorded as
    ("run", first chunks, limits, stop ids, each sequence's tokens, the next step's chunks and logits)."""
    toks: list[list[int]] = [[], []]
    feed = [t for _, t in last]
    for j in range(run):
        live = [i for i in range(2) if i == 0 or j < 2]
        got = runner.step(ref, [SeqChunk(last[i][0], [feed[i]]) for i in live])
        for i, o in zip(live, got):
            feed[i] = int(o.argmax())
            toks[i].append(feed[i])
    stop = frozenset({toks[1][1]} if toks[1][1] != toks[1][0] else {toks[1][0]})
    for i in range(2):  # every sequence's run ends at its first stop token (the set is shared)
        k = next((j for j, t in enumerate(toks[i]) if t in stop), len(toks[i]) - 1)
        if k < len(toks[i]) - 1:
            ref.truncate(last[i][0], len(toks[i]) - 1 - k)
            del toks[i][k + 1:]
    nxt = [SeqChunk(last[i][0], [toks[i][-1]]) for i in range(2)]
    want = [w.float().clone() for w in runner.step(ref, nxt)]
    events.append(("run", [SeqChunk(sid, [t]) for sid, t in last], [run, 2], stop, toks, nxt, want))


def replay(decoder: CompiledDecoder | SequenceDecoder, transcript: Transcript, cfg: ModelConfig,
           dtype: torch.dtype, *, num_blocks: int = 64) -> Conformance:
    """Run a recorded scenario on ``decoder``; how far its logits are from the reference's. Needs no
    weights of the reference: the recording holds its logits."""
    driver = DecoderRunner(ModelRunner.weightless(cfg, dtype), [Target("checked", "checked", decoder)],
                           step_timeout_s=None, max_seqs=4, failover=False)
    mine = driver.make_cache(num_blocks, transcript.block_size)
    worst, rows, flips = 0.0, 0, 0
    for kind, *args in transcript.events:
        if kind == "run":
            first, limits, stop, toks, chunks, want = args
            got_toks = driver.greedy_steps(mine, first, limits, stop) if driver.offers_greedy_steps() else None
            have = got_toks or [[] for _ in first]
            if got_toks is not None:  # a run may end a sequence sooner than asked: its tokens lead the reference's
                for w_t, g_t in zip(toks, got_toks, strict=True):
                    rows += len(g_t)
                    flips += int(g_t != w_t[: len(g_t)])
                if any(g_t != w_t[: len(g_t)] for w_t, g_t in zip(toks, got_toks)):
                    continue  # the caches went apart: nothing after compares
            for i, ch in enumerate(first):  # what the run did not give, one step per token, fed the reference's
                fed = [*ch.token_ids, *toks[i][:-1]]
                for j in range(len(have[i]), len(toks[i])):
                    o = _as_tensor(driver.step(mine, [SeqChunk(ch.seq_id, [fed[j]])])[0]).float()
                    rows += 1
                    flips += int(int(o.argmax()) != toks[i][j])
        elif kind != "step":
            getattr(mine, kind)(*args)
            continue
        else:
            chunks, want = args
        got = [_as_tensor(o).float() for o in driver.step(mine, chunks)]
        for w, o in zip(want, got, strict=True):
            w2, o2 = w.reshape(-1, cfg.vocab_size), o.reshape(-1, cfg.vocab_size)
            worst = max(worst, float((w2 - o2).abs().max()))
            rows += w2.shape[0]
            flips += int((w2.argmax(-1) != o2.argmax(-1)).sum())
    return Conformance(max_abs_diff=worst, rows=rows, argmax_flips=flips)


def compare(decoder: CompiledDecoder | SequenceDecoder, runner: ModelRunner, *, seed: int = 0,
            prompt_lens: tuple[int, int] = (11, 37), decode_steps: int = 6, draft: int = 8,
            num_blocks: int = 64) -> Conformance:
    """Run the scenario on ``decoder`` and on ``runner`` (the torch reference), greedy tokens fed to
    both from the reference; returns how far the logits are apart."""
    ps = 16 if is_sequence(decoder) else decoder.block_size  # type: ignore[union-attr]
    t = record(runner, ps, seed=seed, prompt_lens=prompt_lens, decode_steps=decode_steps, draft=draft,
               num_blocks=num_blocks)
    return replay(decoder, t, runner.cfg, runner.dtype, num_blocks=num_blocks)
