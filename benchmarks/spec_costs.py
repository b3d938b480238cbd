"""Where a speculative step's time goes: fixed lookup drafting vs DeepSpec, step by step.

Usage: .venv/bin/python benchmarks/spec_costs.py [--n 4] [--out 128] [--rounds 3] [--k 7] [--drafters A,B]

On the workloads of benchmarks/speculative.py (greedy, batch 1), runs a fixed
n-gram lookup configuration (k drafted tokens every step; k=7 is the best
fixed configuration there) and DeepSpec, interleaved request by request,
after the same untimed warm-up on other prompts (DeepSpec's learned state is
restored before each round, as there). Every engine step is timed and
counted: tokens drafted, verify chunks, second head calls (greedy
verification computes a long draft's logits in two parts, the rest only
when the first block held), head rows computed after the forward, context
length. Printed per contender:

- where the wall time of decode steps goes: the target's forward and LM
  head, drafting with the choice (``_draft``), learning (``_learn``), and the
  rest (sampling, KV bookkeeping, the scheduler);
- a least-squares fit of a decode step's wall time over
  ``[1, verify, drafted tokens, extra head calls, head rows, context / 100]``,
  per contender and jointly, and what the joint fit predicts for each
  contender's steps against what they took (read the joint fit: a fixed
  configuration's own is ill-conditioned, its drafted tokens and head rows
  moving together);
- DeepSpec over fixed, end to end and with prefill steps left out.

This is a diagnostic of the cost structure the controller works in (what a
drafted token, a verify step and a plain step cost here); the contest itself
is benchmarks/speculative.py.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from speculative import WORKLOADS, learned_restorer, make_workloads  # noqa: E402

from dspark import LLM, SamplingParams  # noqa: E402
from dspark.llm.api import default_model_path  # noqa: E402

COLS = ("1", "verify", "drafted", "extra head calls", "head rows", "ctx/100")


class Probe:
    """Counts and times every engine step of one LLM (wrapping its runner, engine and drafting calls)."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[dict[str, float]] = []
        self.cur: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.in_step = False
        eng, runner, spec = llm.engine, llm.engine.runner, llm.engine.spec
        o_step, o_head, o_estep = runner.step, runner.head, eng.step

        def step(cache: Any, chunks: Any, exit_layer: int | None = None) -> Any:
            c = self.cur
            for ch in chunks:
                n = len(ch.token_ids)
                if ch.all_logits:
                    c["drafted"] += n - 1
                    c["verify"] += 1
                elif n > 1:
                    c["prefill"] += n
                c["ctx"] = cache.seq_lens.get(ch.seq_id, 0) + n
            self.in_step = True
            t0 = time.perf_counter()
            try:
                return o_step(cache, chunks, exit_layer=exit_layer)
            finally:
                c["forward_ms"] += (time.perf_counter() - t0) * 1e3
                self.in_step = False

        def head(h: Any) -> Any:
            if self.in_step:  # the step's own head: timed with the forward
                return o_head(h)
            self.cur["head_calls"] += 1
            self.cur["head_rows"] += h.shape[0]
            t0 = time.perf_counter()
            out = o_head(h)
            self.cur["forward_ms"] += (time.perf_counter() - t0) * 1e3
            return out

        def estep(**kw: Any) -> Any:
            self.cur = collections.defaultdict(float)
            t0 = time.perf_counter()
            out = o_estep(**kw)
            if self.cur:
                self.steps.append(dict(self.cur, ms=(time.perf_counter() - t0) * 1e3))
            return out

        runner.step, runner.head, eng.step = step, head, estep
        for name in ("_draft", "_learn"):
            if hasattr(spec, name):
                setattr(spec, name, self._timed(getattr(spec, name), name + "_ms"))

    def _timed(self, f: Any, key: str) -> Any:
        def g(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self.cur[key] += (time.perf_counter() - t0) * 1e3
        return g


def row(s: dict[str, float]) -> list[float]:
    # One head call per step is a given (inside the forward for a plain step, after it for a verification
    # whose logits are computed lazily); "extra" are the second calls of long drafts whose first block held.
    extra = max(0.0, s.get("head_calls", 0) - (1 if s.get("verify") else 0))
    return [1.0, s.get("verify", 0), s.get("drafted", 0), extra, s.get("head_rows", 0), s.get("ctx", 0) / 100]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4, help="prompts per workload")
    ap.add_argument("--out", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--k", type=int, default=7, help="the fixed lookup configuration's k")
    ap.add_argument("--drafters", default=None, help="DeepSpec's drafters, comma-separated names (default: every "
                    "offer), e.g. prompt-lookup,draft-model,self-draft to leave suffix-lookup out")
    args = ap.parse_args()
    model = default_model_path()

    def mk(**spec: Any) -> LLM:
        return LLM(model, dtype="float32", max_batch_size=1, max_total_tokens=2048, speculative_decoding=spec)

    llms = {f"fixed prompt-lookup k={args.k}": mk(strategy="fixed", drafters=["prompt-lookup"],
                                                 num_speculative_tokens=args.k),
            "deepspec": mk(strategy="deepspec", drafters=args.drafters.split(",") if args.drafters else None)}
    first = next(iter(llms.values()))
    work = make_workloads(first, model, args.n, args.out)
    warm = make_workloads(first, model, args.n, args.out, first=args.n)
    sp = SamplingParams(max_tokens=args.out, temperature=0.0, ignore_eos=True)
    probes = {name: Probe(llm) for name, llm in llms.items()}
    for llm in llms.values():
        for w in WORKLOADS:
            for p in warm[w]:
                llm.generate([p], sp)
    restore = learned_restorer(llms["deepspec"])
    for pr in probes.values():
        pr.steps.clear()
    names = list(llms)
    for rnd in range(args.rounds):
        restore()
        i = 0
        for w in WORKLOADS:
            for p in work[w]:
                for name in names if (rnd + i) % 2 == 0 else names[::-1]:
                    llms[name].generate([p], sp)
                i += 1

    print(f"{args.rounds} rounds of {len(WORKLOADS)} x {args.n} requests x {args.out} tokens, greedy, batch 1; "
          "ms summed over the rounds\n")
    print(f"{'contender':<24} {'steps':>6} {'plain':>6} {'mean k':>7} {'all ms':>8} {'prefill':>8} {'decode':>8} "
          f"{'forward':>8} {'draft':>7} {'learn':>7} {'rest':>7} {'rest/step':>9}")
    dec_steps: dict[str, list[dict[str, float]]] = {}
    totals: dict[str, tuple[float, float]] = {}
    for name, pr in probes.items():
        dec = [s for s in pr.steps if not s.get("prefill")]
        dec_steps[name] = dec
        tot = sum(s["ms"] for s in pr.steps)
        dms = sum(s["ms"] for s in dec)
        fwd, dr, le = (sum(s.get(k, 0) for s in dec) for k in ("forward_ms", "_draft_ms", "_learn_ms"))
        rest = dms - fwd - dr - le
        drafted = [s.get("drafted", 0) for s in dec if s.get("drafted")]
        totals[name] = (tot, dms)
        print(f"{name:<24} {len(dec):6d} {sum(1 for s in dec if not s.get('drafted')):6d} "
              f"{(sum(drafted) / len(drafted) if drafted else 0):7.2f} {tot:8.0f} {tot - dms:8.0f} {dms:8.0f} "
              f"{fwd:8.0f} {dr:7.0f} {le:7.0f} {rest:7.0f} {rest / len(dec):9.3f}")

    print("\nleast-squares fit of a decode step's wall ms over [" + ", ".join(COLS) + "]")
    fits = {}
    for name, dec in [*dec_steps.items(), ("joint", [s for d in dec_steps.values() for s in d])]:
        A = np.array([row(s) for s in dec])
        y = np.array([s["ms"] for s in dec])
        fits[name], *_ = np.linalg.lstsq(A, y, rcond=None)
        print(f"  {name:<24} " + "  ".join(f"{c}: {v:.3f}" for c, v in zip(COLS, fits[name])))
    for name, dec in dec_steps.items():
        pred = float(sum(np.dot(fits["joint"], row(s)) for s in dec))
        print(f"  joint fit on {name}'s decode steps: {pred:.0f} ms predicted, {totals[name][1]:.0f} ms taken "
              f"({totals[name][1] / pred:.3f})")

    (ft, fd), (dt, dd) = totals[names[0]], totals["deepspec"]
    print(f"\ndeepspec / {names[0]}: end to end {ft / dt:.3f}, decode steps only {fd / dd:.3f}")


if __name__ == "__main__":
    main()
