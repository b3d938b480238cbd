"""A decoder target timed at the engine's real step shapes.

Shapes: decode at batch 1, 8 and 32 (capped at the engine's batch size), a
prefill chunk, and a k=8 verification (9 rows, every row's logits), each over
sequences that already hold ``context`` tokens. Each shape is one step run
again and again with its KV rolled back in between, so every run sees the same
context. Targets take turns in settled blocks, shape by shape, and the median is kept.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dspark.llm.runner.kv_cache import PagedKVCache
from dspark.llm.runner.types import SeqChunk


@dataclass(frozen=True)
class Shape:
    name: str
    seqs: int
    rows: int  # new tokens per sequence
    all_logits: bool = False

    @property
    def tokens(self) -> int:
        return self.seqs * self.rows


def shapes(max_batch: int, prefill_chunk: int) -> list[Shape]:
    out = [Shape("decode_b1", 1, 1)]
    for b in (8, 32):
        if b <= max_batch:
            out.append(Shape(f"decode_b{b}", b, 1))
    out.append(Shape(f"prefill_{prefill_chunk}", 1, prefill_chunk))
    out.append(Shape("verify_k8", 1, 9, all_logits=True))
    return out


# A step function: (cache, chunks) -> per chunk logits, as ModelRunner.step.
StepFn = Callable[[PagedKVCache, list[SeqChunk]], list[torch.Tensor]]


CONTEXT = 128  # tokens each timed sequence holds


class Bench:
    """One target's cache prepared for every shape: ``seqs`` sequences of ``context`` tokens."""

    def __init__(self, step: StepFn, make_cache: Callable[[int], PagedKVCache], page_size: int, *,
                 max_seqs: int, context: int, max_rows: int, vocab: int) -> None:
        self.step = step
        need = max_seqs * (-(-(context + max_rows) // page_size) + 1)
        self.cache = make_cache(need)
        g = torch.Generator().manual_seed(0)
        self.context = context
        self.ids = [f"t{i}" for i in range(max_seqs)]
        for i in range(0, max_seqs, 8):  # prefill eight sequences at a time
            step(self.cache, [SeqChunk(s, torch.randint(4, vocab, (context,), generator=g).tolist())
                              for s in self.ids[i : i + 8]])
        self.g = g
        self.vocab = vocab

    def run(self, shape: Shape) -> float:
        """Seconds for one step of ``shape``; the K/V it wrote is rolled back."""
        toks = torch.randint(4, self.vocab, (shape.seqs, shape.rows), generator=self.g).tolist()
        chunks = [SeqChunk(self.ids[i], toks[i], all_logits=shape.all_logits) for i in range(shape.seqs)]
        t0 = time.perf_counter()
        out = self.step(self.cache, chunks)
        float(out[-1].reshape(-1)[0])  # the logits are on the host: the step is done
        dt = time.perf_counter() - t0
        for ch in chunks:
            self.cache.truncate(ch.seq_id, shape.rows)
        return dt


# A runtime's worker threads keep spinning for a while after its step (OpenMP's, TBB's): the next runtime's
# first steps share the cores with them. Each block of timed steps follows this long of untimed ones.
SETTLE_S = 0.02


def time_targets(benches: dict[str, Bench], shape_list: list[Shape], reps: int = 3,
                 blocks: int = 3) -> dict[str, dict[str, float]]:
    """Median ms per step, per target and shape. Targets take turns in blocks (``blocks`` turns of ``reps``
    timed steps each, after :data:`SETTLE_S` of untimed ones), not step by step: a step timed right after
    another runtime's ran beside its spinning threads (OpenVINO's decode step at twice its time after each
    torch step), so a target was ranked on its neighbour's threads rather than its own speed."""
    out: dict[str, dict[str, float]] = {k: {} for k in benches}
    for shape in shape_list:
        samples: dict[str, list[float]] = {k: [] for k in benches}
        for _ in range(blocks):
            for k, b in benches.items():
                t0 = time.perf_counter()
                b.run(shape)  # at least one untimed run: first-touch of buffers, kernel selection
                while time.perf_counter() - t0 < SETTLE_S:
                    b.run(shape)
                samples[k].extend(b.run(shape) for _ in range(reps))
        for k in benches:
            out[k][shape.name] = round(statistics.median(samples[k]) * 1e3, 4)
    return out


# The request a target's score prices: this many prompt and output tokens. Per request the engine runs
# OUTPUT decode steps and a few prefill chunks, so decode dominates a request's time (the torch runner on the
# embedded model: 96% of it) and a runtime fast at prefill but slow at decode must not win on the average.
NOMINAL_PROMPT, NOMINAL_OUTPUT = 256, 256


def decode_rate(step_ms: dict[str, float], decode: list[Shape]) -> float:
    """Output tokens per ms over the decode shapes, each given an equal share of the time: the batch follows the
    load, and an engine sized for b sequences at once runs its busy hours near b, where each step gives b
    tokens. An equal share of the tokens instead spends nearly all of the time at one sequence (a one-row step
    costs a token many times what a full step does) and chose a one-row-fast runtime for a server of 32."""
    return sum(s.seqs / max(step_ms[s.name], 1e-9) for s in decode) / len(decode)


def request_ms(step_ms: dict[str, float], shape_list: list[Shape], speculative: bool = False) -> float:
    """The time of one nominal request in these step times: its prompt in prefill chunks, its output at the
    decode shapes' rate (:func:`decode_rate`), or with ``speculative``, half of it through k=8 verifications
    accepting 4 tokens each."""
    decode = [s for s in shape_list if s.name.startswith("decode_") and s.name in step_ms]
    prefill = [s for s in shape_list if s.name.startswith("prefill_") and s.name in step_ms]
    verify = [s for s in shape_list if s.name.startswith("verify_") and s.name in step_ms]
    plain = NOMINAL_OUTPUT / 2 if speculative and verify else NOMINAL_OUTPUT
    t = plain / decode_rate(step_ms, decode) if decode else 0.0
    t += sum(NOMINAL_PROMPT / s.rows / len(prefill) * step_ms[s.name] for s in prefill)
    if speculative and verify:
        t += sum((NOMINAL_OUTPUT - plain) / 4 / len(verify) * step_ms[s.name] for s in verify)
    return t


def score(step_ms: dict[str, float], reference: dict[str, float], shape_list: list[Shape],
          speculative: bool = False) -> float:
    """A target's cost relative to the reference's: the nominal request's time in its step times over the
    reference's (:func:`request_ms`), on the shapes both ran; inf when they share none."""
    both = [s for s in shape_list if s.name in step_ms and reference.get(s.name, 0) > 0]
    ref = request_ms(reference, both, speculative)
    return request_ms(step_ms, both, speculative) / ref if ref > 0 else float("inf")


def scores(step_ms: dict[str, dict[str, float]], reference_ms: list[dict[str, float]], shape_list: list[Shape],
           speculative: bool = False) -> tuple[dict[str, float], dict[str, float] | None]:
    """Every target's score (:func:`score`) and the torch runner's step times it is scored against.

    Each target was timed beside the torch runner, so there is one reference timing per target; the torch
    runner's own figure is its fastest time per shape over all of them. Beside some runtimes its steps are slower
    (sharing the cores with OpenVINO's worker threads, not with llama.cpp's, whose OpenMP it shares), and a ratio
    to the reference timed beside each target would credit that target with its neighbour's slowdown: the
    targets are ranked by their own times. Without any reference timing (a file run as stored: each target
    timed alone), the scores are relative to the fastest target."""
    if reference_ms:
        names = set.intersection(*(set(r) for r in reference_ms))
        ref = {n: min(r[n] for r in reference_ms) for n in names}
        return {k: score(ms, ref, shape_list, speculative) for k, ms in step_ms.items()}, ref
    if not step_ms:
        return {}, None
    best = min(step_ms.values(), key=lambda ms: request_ms(ms, shape_list, speculative))
    return {k: score(ms, best, shape_list, speculative) for k, ms in step_ms.items()}, None
