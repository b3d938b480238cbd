"""How much adaptive drafting could gain at most here: lookup drafting with perfect foresight.

Usage: .venv/bin/python benchmarks/spec_oracle.py [--n 4] [--out 128] [--dtype float32] [--decoder auto]
       [--candidates 4]

On the workloads of benchmarks/speculative.py (greedy, batch 1; its ``code`` and ``edit`` prompts are
also benchmarks/vs_openvino_genai.py's ``spec`` workload), replays each request's plain greedy output step
by step with the built-in prompt-lookup drafter and prices every step with this machine's measured verify
cost on the target the engine runs (a line fitted to the target's steps of 1 + k tokens at k = 1, 2, 4, 8,
16, 32, each k timed in a block of its own so that no step pays a change of shape; the change is timed
apart and printed). Policies:

* fixed k: what a fixed configuration does (a draft shorter than k verifies its own length);
* oracle: drafts exactly the tokens that will be accepted (k <= 32), the ceiling of any controller that
  chooses k per step for this drafter;
* oracle, several candidates: the same over up to ``--candidates`` lookup continuations (every earlier
  match of the last 3, 2, 1 tokens, most recent first): it drafts the accepted tokens of the best of them,
  a ceiling of verifying several continuations in one step (which would verify more rows).

Drafting time is left out (lookups cost ~0.02 ms), as are the engine's per-step overhead and the change of
a step's shape between steps of different widths, so the oracle figures are upper bounds; the ratios to
plain decoding are what matter.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from speculative import WORKLOADS, make_workloads  # noqa: E402

from dspark import LLM, SamplingParams  # noqa: E402
from dspark.builtin.prompt_lookup import PromptLookupDrafter  # noqa: E402
from dspark.llm.api import default_model_path  # noqa: E402
from dspark.llm.runner.types import SeqChunk  # noqa: E402

SPEC = ("code", "edit")  # benchmarks/vs_openvino_genai.py's spec workload


def verify_cost(llm: LLM, ks: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32), block: int = 12,
                rounds: int = 3) -> tuple[float, float, float]:
    """(plain step ms, intercept, ms per drafted token) of the target's forward at a 300-token context. Each k
    runs ``block`` steps in a row (the first two untimed: the change of shape from the k before), ``rounds``
    times; the change of shape is the first step of a block against the median."""
    runner, cache = llm.engine.runner, llm.engine.cache
    runner.step(cache, [SeqChunk("cost", list(range(5, 305)))])
    times: dict[int, list[float]] = {k: [] for k in ks}
    first: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(rounds):
        for k in ks:
            for i in range(block):
                t0 = time.perf_counter()
                runner.step(cache, [SeqChunk("cost", [9] * (1 + k), all_logits=k > 0)])
                dt = (time.perf_counter() - t0) * 1e3
                cache.truncate("cost", 1 + k)
                if i == 0:
                    first[k].append(dt)
                elif i >= 2:
                    times[k].append(dt)
    cache.free("cost")
    med = {k: statistics.median(v) for k, v in times.items()}
    changed = statistics.median(t / med[k] for k in ks for t in first[k])
    drafted = [k for k in ks if k > 0]
    slope, icpt = np.polyfit(drafted, [med[k] for k in drafted], 1)
    print("verify ms by drafted tokens k: " + ", ".join(f"k={k}: {med[k]:.3f}" for k in ks)
          + f"; fitted {icpt:.3f} + {slope:.4f} k; a step after a change of shape: "
          f"{changed:.2f}x its settled time")
    return med[0], float(icpt), float(slope)


def candidates(tokens: list[int], k: int, most: int) -> list[list[int]]:
    """Up to ``most`` distinct continuations of ``k`` tokens after earlier matches of the last 3, 2, 1 tokens
    (longest match first, then most recent)."""
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    L = len(tokens)
    for n in range(min(3, L - 1), 0, -1):
        suffix = tokens[-n:]
        for start in range(L - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                c = tuple(tokens[start + n:start + n + k])
                if c and c not in seen:
                    seen.add(c)
                    out.append(list(c))
                    if len(out) >= most:
                        return out
    return out


def accepted(draft: list[int], truth: list[int]) -> int:
    a = 0
    while a < len(draft) and a < len(truth) and draft[a] == truth[a]:
        a += 1
    return a


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4, help="prompts per workload")
    ap.add_argument("--out", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--dtype", default="float32", help="the engine's dtype (vs_openvino_genai.py: bfloat16)")
    ap.add_argument("--decoder", default="auto", help="the target (vs_openvino_genai.py's DeepSpec ran on cpu)")
    ap.add_argument("--candidates", type=int, default=4, help="most lookup continuations a step verifies at once")
    args = ap.parse_args()
    model = default_model_path()
    llm = LLM(model, dtype=args.dtype, decoder=args.decoder, max_batch_size=1)
    print(f"target: {llm.engine.stats().decoder}, {args.dtype}")
    plain_ms, icpt, slope = verify_cost(llm)

    def cost(rows: int) -> float:
        return plain_ms if rows <= 1 else icpt + slope * (rows - 1)

    work = make_workloads(llm, model, args.n, args.out)
    drafter = PromptLookupDrafter()
    many = f"oracle, {args.candidates} candidates"
    policies = [*(f"fixed k={k}" for k in (2, 4, 8, 16)), "oracle k<=32", many]
    tot: dict[str, dict[str, list[float]]] = {w: {p: [0, 0.0, 0] for p in ["plain", *policies]} for w in WORKLOADS}
    for w in WORKLOADS:
        for prompt in work[w]:
            sp = SamplingParams(max_tokens=args.out, temperature=0.0, ignore_eos=True)
            ids = llm.generate([prompt], sp)[0].token_ids
            for pol in ["plain", *policies]:
                t, ms, steps = 0, 0.0, 0
                while t < len(ids):
                    ctx, truth = prompt + ids[:t], ids[t:]
                    if pol == "plain":
                        a, rows = 0, 1
                    elif pol == many:
                        cands = candidates(ctx, 32, args.candidates)
                        a = max((accepted(c, truth) for c in cands), default=0)
                        rows = 1 + a  # the best candidate, as far as it is accepted: below any tree's rows
                    else:
                        prop = drafter.propose(ctx, 32).tokens
                        a = accepted(prop, truth)
                        if pol.startswith("fixed"):
                            k = min(int(pol.split("=")[1]), len(prop))
                            a = min(a, k)
                        else:
                            k = a
                        rows = 1 + k
                    ms += cost(rows)
                    t += a + 1
                    steps += 1
                tot[w][pol][0] += len(ids)
                tot[w][pol][1] += ms
                tot[w][pol][2] += steps
    print(f"\nmodelled tokens/s ({args.n} prompts x {args.out} tokens per workload; drafting, overhead and changes "
          "of shape left out); last columns: tokens per step")
    groups = {**{w: (w,) for w in WORKLOADS}, "spec": SPEC, "mix": WORKLOADS}
    print(f"{'policy':<22} " + " ".join(f"{g:>7}" for g in groups) + "   tok/step spec, mix")
    rate: dict[str, dict[str, float]] = {}
    for p in ["plain", *policies]:
        rate[p] = {g: sum(tot[w][p][0] for w in ws) / sum(tot[w][p][1] for w in ws) * 1e3 for g, ws in groups.items()}
        per = {g: sum(tot[w][p][0] for w in ws) / sum(tot[w][p][2] for w in ws) for g, ws in groups.items()}
        print(f"{p:<22} " + " ".join(f"{rate[p][g]:7.1f}" for g in groups) + f"   {per['spec']:.2f}, {per['mix']:.2f}")
    fixed = [p for p in policies if p.startswith("fixed")]
    for g in ("spec", "mix"):
        best = max(fixed, key=lambda p: rate[p][g])
        print(f"{g}: oracle / plain {rate['oracle k<=32'][g] / rate['plain'][g]:.2f}, "
              f"{many} / plain {rate[many][g] / rate['plain'][g]:.2f}; "
              f"oracle / best fixed ({best}) {rate['oracle k<=32'][g] / rate[best][g]:.2f}")


if __name__ == "__main__":
    main()
