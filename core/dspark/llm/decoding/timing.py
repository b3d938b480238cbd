"""A decoder target timed at the engine's real step shapes.

Shapes: decode at batch 1, 8 and 32 (capped at the engine's batch size), at
batch 1 also as a greedy run (:data:`RUN` steps in one call, where the target
offers runs: what the engine runs while its requests are greedy), a prefill chunk,
and a k=8 verification (9 rows, every row's logits), each over sequences that
already hold ``context`` tokens. Each shape is one step (or run) again and
again with its KV rolled back in between, so every run sees the same context.
Targets take turns in settled blocks, in rounds over the shapes, and the median is kept.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dspark.host import hostinfo
from dspark.llm.runner.kv_cache import PagedKVCache
from dspark.llm.runner.types import SeqChunk


@dataclass(frozen=True)
class Shape:
    name: str
    seqs: int
    rows: int  # new tokens per sequence
    all_logits: bool = False
    run: int = 0  # steps of a greedy run in one call (priced per step); 0: one plain step

    @property
    def tokens(self) -> int:
        return self.seqs * self.rows


# Steps of a timed greedy run: what a decode budget of a few milliseconds holds of a small model's one-row
# steps. Only one row is timed as runs: there the engine's work between steps is a share of a step that
# counts, while a step of 8 or 32 rows takes long enough that open runs are short and save little.
RUN = 8


def shapes(max_batch: int, prefill_chunk: int) -> list[Shape]:
    out = [Shape("decode_b1", 1, 1), Shape("run_b1", 1, 1, run=RUN)]
    for b in (8, 32):
        if b <= max_batch:
            out.append(Shape(f"decode_b{b}", b, 1))
    out.append(Shape(f"prefill_{prefill_chunk}", 1, prefill_chunk))
    out.append(Shape("verify_k8", 1, 9, all_logits=True))
    return out


# A step function: (cache, chunks) -> per chunk logits, as ModelRunner.step.
StepFn = Callable[[PagedKVCache, list[SeqChunk]], list[torch.Tensor]]
# A greedy run: (cache, one-token chunks, tokens per chunk, stop ids) -> each chunk's tokens, as
# DecoderRunner.greedy_steps.
RunFn = Callable[[PagedKVCache, list[SeqChunk], list[int], frozenset[int]], "list[list[int]] | None"]


CONTEXT = 128  # tokens each timed sequence holds


class Bench:
    """One target's cache prepared for every shape: ``seqs`` sequences of ``context`` tokens."""

    def __init__(self, step: StepFn, make_cache: Callable[[int], PagedKVCache], page_size: int, *,
                 max_seqs: int, context: int, max_rows: int, vocab: int, greedy: RunFn | None = None) -> None:
        self.step = step
        self.greedy = greedy  # None: the target runs no greedy runs (its run shapes are not timed)
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

    def can(self, shape: Shape) -> bool:
        return not shape.run or self.greedy is not None

    def run(self, shape: Shape) -> float:
        """Seconds for one step of ``shape`` (a run's time over its steps); the K/V it wrote is rolled back."""
        toks = torch.randint(4, self.vocab, (shape.seqs, shape.rows), generator=self.g).tolist()
        if shape.run:
            assert self.greedy is not None
            chunks = [SeqChunk(self.ids[i], toks[i]) for i in range(shape.seqs)]
            before = {ch.seq_id: self.cache.seq_lens[ch.seq_id] for ch in chunks}
            t0 = time.perf_counter()
            got = self.greedy(self.cache, chunks, [shape.run] * shape.seqs, frozenset())
            dt = time.perf_counter() - t0
            if got is None:
                raise RuntimeError("the target offers greedy runs but ran none")
            for sid, n in before.items():
                self.cache.truncate(sid, self.cache.seq_lens[sid] - n)
            return dt / max(1, max(map(len, got)))
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
# The least time the timing spans (more rounds while it spans less, up to MAX_BLOCKS): a runtime's step time
# moves in phases on a shared machine, and a few blocks within tens of milliseconds caught one phase and
# ranked on it (docs/decoders.md, step 4).
SPAN_S = 1.5
MAX_BLOCKS = 12


def time_targets(benches: dict[str, Bench], shape_list: list[Shape], reps: int = 3,
                 blocks: int = 3, span_s: float = SPAN_S) -> dict[str, dict[str, float]]:
    """Median ms per step, per target and shape. The timing goes in rounds, each a block of every shape for
    every target in turn (``reps`` timed steps after :data:`SETTLE_S` of untimed ones; a run shape, one
    run), at least ``blocks`` rounds and more while they span less than ``span_s``: each shape's samples
    spread over the whole timing, not over one phase of the machine. Targets take turns by blocks, not step
    by step: a step timed right after another runtime's ran beside its spinning threads (OpenVINO's decode
    step at twice its time after each torch step), so a target was ranked on its neighbour's threads rather
    than its own speed."""
    samples: dict[tuple[str, str], list[float]] = {
        (s.name, k): [] for s in shape_list for k, b in benches.items() if b.can(s)}
    start, done = time.perf_counter(), 0
    while done < blocks or (done < MAX_BLOCKS and time.perf_counter() - start < span_s):
        done += 1
        for shape in shape_list:
            for k, b in benches.items():
                if (shape.name, k) not in samples:
                    continue
                t0 = time.perf_counter()
                b.run(shape)  # at least one untimed run: first-touch of buffers, kernel selection
                while time.perf_counter() - t0 < SETTLE_S:
                    b.run(shape)
                samples[shape.name, k].extend(b.run(shape) for _ in range(1 if shape.run else reps))
    out: dict[str, dict[str, float]] = {k: {} for k in benches}
    for (name, k), ts in samples.items():
        out[k][name] = round(statistics.median(ts) * 1e3, 4)
    return out


# The request a target's score prices: this many prompt and output tokens. Per request the engine runs
# OUTPUT decode steps and a few prefill chunks, so decode dominates a request's time (the torch runner on the
# embedded model: 96% of it) and a runtime fast at prefill but slow at decode must not win on the average.
NOMINAL_PROMPT, NOMINAL_OUTPUT = 256, 256


def decode_ms(step_ms: dict[str, float], shape: Shape) -> float:
    """A decode step's price: half of a nominal request's steps are greedy, in runs where the target has a time
    for them (``run_b*``), half sampled, one step each (the torch runner, which runs no runs: its step)."""
    step = step_ms[shape.name]
    return (step + step_ms.get("run" + shape.name.removeprefix("decode"), step)) / 2


def decode_rate(step_ms: dict[str, float], decode: list[Shape]) -> float:
    """Output tokens per ms over the decode shapes, each given an equal share of the time: the batch follows the
    load, and an engine sized for b sequences at once runs its busy hours near b, where each step gives b
    tokens. An equal share of the tokens instead spends nearly all of the time at one sequence (a one-row step
    costs a token many times what a full step does) and chose a one-row-fast runtime for a server of 32."""
    return sum(s.seqs / max(decode_ms(step_ms, s), 1e-9) for s in decode) / len(decode)


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


# Targets timed one after the other are each timed in one stretch of the machine's time, and a shared
# machine's speed moves in phases longer than one target's timing: the same two runtimes traded places between
# starts (docs/decoders.md, step 4). Those whose scores are within this factor of the best are timed again in
# the other order, each taking the mean of its two times per shape (not the faster: that rewards the runtime
# whose speed varies the most).
CLOSE = 1.25


def close_calls(by_target: dict[str, float], factor: float = CLOSE) -> list[str]:
    """The targets whose score is within ``factor`` of the best (the best among them), in their order."""
    best = min(by_target.values(), default=float("inf"))
    return [k for k, v in by_target.items() if v <= best * factor]


def averaged(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Per shape, the mean of two timings of one target (a shape timed once keeps its one time)."""
    return {**b, **{n: round((v + b.get(n, v)) / 2, 4) for n, v in a.items()}}


# Other processes' share of the usable cores while a target was timed (hostinfo.others_share) above which its
# timings are kept only until a quieter start: a start beside a build or a test run ranks on what they left it,
# and a cache that kept those timings for good kept that ranking for good.
BUSY = 0.25
NOW_S = 0.2  # how long a start looks at the machine before it trusts or re-times busy timings


class Contention:
    """Other processes' share of the usable cores over a ``with`` block: ``share``, once the block has ended."""

    share: float | None = None

    def __enter__(self) -> Contention:
        self._start = hostinfo.cpu_sample()
        return self

    def __exit__(self, *exc: object) -> None:
        self.share = round(hostinfo.others_share(self._start, hostinfo.cpu_sample()), 3)


def contention_now(window_s: float = NOW_S) -> float:
    """Other processes' share of the usable cores over the next ``window_s`` (this process waits)."""
    with Contention() as c:
        time.sleep(window_s)
    return c.share or 0.0


def retime_enabled() -> bool:
    """False with ``DSPARK_BUSY_RETIME=0`` (or ``off``, ``false``, ``no``): cached timings are kept whatever
    the machine's load when they were taken, so every start ranks as the first did (reproducible starts: a
    test suite on a busy machine, a benchmark). Their share is recorded either way."""
    return os.environ.get("DSPARK_BUSY_RETIME", "1").strip().lower() not in ("0", "off", "false", "no")


def was_busy(busy: float | None) -> bool:
    """Whether timings were taken while other processes held more than :data:`BUSY` of the cores (an unknown
    share, None, counts as not busy)."""
    return busy is not None and busy > BUSY


def retime(busy: float | None, now: float) -> bool:
    """Whether timings taken while other processes held ``busy`` of the cores are taken again at a start that
    sees ``now``: they were busy (:func:`was_busy`) and the machine is quieter now by half."""
    return was_busy(busy) and now <= (busy or 0.0) / 2
