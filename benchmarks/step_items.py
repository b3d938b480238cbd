"""Where one engine step's time goes on a decoder target: the runtime's forward against each piece of host work.

Usage: .venv/bin/python benchmarks/step_items.py FILE_OR_CHECKPOINT [--batch 1] [--decoder llamacpp] [--new 128]
       [--dtype auto]

Runs ``--batch`` requests of 96 prompt tokens and ``--new`` greedy tokens each through ``LLMEngine`` (three
runs after a warm-up) and prints, per decode step (per token of a sequence: a greedy run of several steps in
one decoder call, plugin API 1.13, counts as its steps) and as the median of the runs, the wall time and the time inside
each wrapped piece: the scheduler, building the step's chunks, the runner (the plugin's compiled step, the
watchdog's thread hand-off around it, building the batch, splitting the logits), sampling, appending tokens
with the stop checks and detokenizing, and building the outputs. Pieces nest (``runner.step`` holds
``thread+step``, which holds ``compiled.step``; ``runner.greedy_steps`` holds ``compiled.greedy_steps``); each
wrapper adds about a microsecond. A decoder that
offers ``cancel`` (plugin API 1.11) steps on the engine's thread: it has no ``thread+step``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--decoder", default="llamacpp")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from dspark.llm import engine as em
    from dspark.llm.decoding import runner as rm
    from dspark.llm.engine import LLMEngine
    from dspark.llm.sampling import SamplingParams

    b = args.batch
    e = LLMEngine.from_model(args.model, dtype=args.dtype, decoder=args.decoder, max_batch_size=b,
                             max_total_tokens=2048 * max(1, b // 4))
    acc: dict[str, float] = {}

    def wrap(obj: Any, name: str, label: str | None = None) -> None:
        f = getattr(obj, name)
        key = label or name

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[key] = acc.get(key, 0.0) + time.perf_counter() - t

        setattr(obj, name, timed)

    for obj, name, label in [(e.scheduler, "schedule", None), (e, "_chunk", None), (e, "_append", None),
                             (e, "_output", None), (e, "_sample", None), (em, "argmax_rows", None),
                             (rm, "build_seq_batch", None), (rm, "build_batch", None), (rm, "split_logits", None),
                             (rm.hook_threads, "call_with_timeout", "thread+step"), (e.runner, "step", "runner.step")]:
        wrap(obj, name, label)
    if getattr(e.runner, "current", None) is not None and e.runner.current.compiled is not None:
        wrap(e.runner.current.compiled, "step", "compiled.step")
        if hasattr(e.runner.current.compiled, "greedy_steps"):  # greedy runs (plugin API 1.13)
            wrap(e.runner, "greedy_steps", "runner.greedy_steps")
            wrap(e.runner.current.compiled, "greedy_steps", "compiled.greedy_steps")
    prompt = list(range(5, 101))

    def run(new: int) -> tuple[float, int]:
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        for i in range(b):
            e.add_request(f"r{time.time_ns()}-{i}", [p + i for p in prompt], params)
        steps, t = 0, time.perf_counter()
        while e.has_unfinished():
            e.step()
            steps += 1
        return time.perf_counter() - t, steps

    run(8)
    per: dict[str, list[float]] = {}
    n_steps = []
    for _ in range(3):
        acc.clear()
        wall, steps = run(args.new)
        n_steps.append(steps)
        for k, v in acc.items():
            per.setdefault(k, []).append(v / args.new * 1e3)
        per.setdefault("wall", []).append(wall / args.new * 1e3)
    print(f"{e.stats().decoder}, {b} at once, {args.new} new tokens in {statistics.median(n_steps):.0f} engine steps "
          f"(a greedy run is one): ms per token of a sequence, i.e. per decode step (median of 3 runs)")
    for k, v in sorted(per.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"  {k:22s} {statistics.median(v):.4f}")


if __name__ == "__main__":
    main()
