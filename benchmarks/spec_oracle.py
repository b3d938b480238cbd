"""How much adaptive drafting could gain at most here: lookup drafting with perfect foresight.

Usage: .venv/bin/python benchmarks/spec_oracle.py [--n 4] [--out 128]

On the workloads of benchmarks/speculative.py (greedy, batch 1), replays each
request's plain greedy output step by step with the built-in prompt-lookup
drafter and prices every step with this machine's measured verify cost
(a line fitted to timed target forwards of 1 + k tokens at k = 0, 1, 4, 8,
16, 32). Policies: fixed k (what a fixed configuration does), and the oracle
that drafts exactly the tokens that will be accepted (k <= 32), the ceiling
of any controller that chooses k per step for this drafter. Drafting time is
left out (lookups cost ~0.02 ms), as is the engine's per-step overhead, so the
figures are upper bounds; the ratios are what matter.
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
from dspark.builtin.ngram import PromptLookupDrafter  # noqa: E402
from dspark.llm.api import default_model_path  # noqa: E402
from dspark.llm.runner.types import SeqChunk  # noqa: E402


def verify_cost(llm: LLM, ks: tuple[int, ...] = (0, 1, 4, 8, 16, 32), reps: int = 15) -> tuple[float, float, float]:
    """(plain step ms, intercept, ms per drafted token) of the target's forward at a 300-token context."""
    runner, cache = llm.engine.runner, llm.engine.cache
    runner.step(cache, [SeqChunk("cost", list(range(5, 305)))])
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(reps):
        for k in ks:
            t0 = time.perf_counter()
            runner.step(cache, [SeqChunk("cost", [9] * (1 + k), all_logits=k > 0)])
            times[k].append((time.perf_counter() - t0) * 1e3)
            cache.truncate("cost", 1 + k)
    cache.free("cost")
    med = {k: statistics.median(v) for k, v in times.items()}
    drafted = [k for k in ks if k > 0]
    slope, icpt = np.polyfit(drafted, [med[k] for k in drafted], 1)
    print("verify ms by drafted tokens k: " + ", ".join(f"k={k}: {med[k]:.2f}" for k in ks)
          + f"; fitted {icpt:.2f} + {slope:.3f} k")
    return med[0], float(icpt), float(slope)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4, help="prompts per workload")
    ap.add_argument("--out", type=int, default=128, help="tokens generated per request")
    args = ap.parse_args()
    model = default_model_path()
    llm = LLM(model, dtype="float32")
    plain_ms, icpt, slope = verify_cost(llm)

    def cost(k: int) -> float:
        return plain_ms if k == 0 else icpt + slope * k

    work = make_workloads(llm, model, args.n, args.out)
    drafter = PromptLookupDrafter()
    policies = {f"fixed k={k}": k for k in (4, 8, 16, 32)} | {"oracle k<=32": -32}
    tot: dict[str, dict[str, list[float]]] = {w: {p: [0, 0.0] for p in ["plain", *policies]} for w in WORKLOADS}
    for w in WORKLOADS:
        for prompt in work[w]:
            out = llm.generate([prompt], SamplingParams(max_tokens=args.out, temperature=0.0, ignore_eos=True))[0]
            ids = out.token_ids
            for pol, k_pol in [("plain", 0), *policies.items()]:
                t, ms = 0, 0.0
                while t < len(ids):
                    prop = drafter.propose(prompt + ids[:t], 32).tokens if k_pol else []
                    a = 0
                    while a < len(prop) and t + a < len(ids) and prop[a] == ids[t + a]:
                        a += 1
                    k = min(a, -k_pol) if k_pol < 0 else min(k_pol, len(prop))
                    ms += cost(k)
                    t += min(a, k) + 1
                tot[w][pol][0] += len(ids)
                tot[w][pol][1] += ms
    print(f"\nmodelled tokens/s ({args.n} prompts x {args.out} tokens per workload; drafting and overhead left out)")
    names = ["plain", *policies]
    print(f"{'policy':<14} " + " ".join(f"{w:>7}" for w in (*WORKLOADS, "mix")))
    mix = {}
    for p in names:
        n, ms = sum(tot[w][p][0] for w in WORKLOADS), sum(tot[w][p][1] for w in WORKLOADS)
        mix[p] = n / ms * 1e3
        print(f"{p:<14} " + " ".join(f"{tot[w][p][0] / tot[w][p][1] * 1e3:7.1f}" for w in WORKLOADS)
              + f" {mix[p]:7.1f}")
    best = max((p for p in policies if p.startswith("fixed") and int(p.split("=")[1]) <= 8), key=mix.get)
    print(f"\noracle / best fixed k<=8 ({best}) on the mix: {mix['oracle k<=32'] / mix[best]:.2f}")


if __name__ == "__main__":
    main()
