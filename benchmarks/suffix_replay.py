"""What a *fixed* lookup configuration would gain from suffix-lookup's store, replayed (issue 6).

Usage: .venv/bin/python benchmarks/suffix_replay.py [--step 6.2 --verify 1.2 --token 0.25]

DeepSpec picks between prompt-lookup (the request's own context) and
suffix-lookup (earlier requests' text) per step, each priced by its own
learned acceptance. A fixed configuration drafts with one drafter. This
asks what a fixed lookup would get if it also combined the two by a rule:
the greedy outputs of benchmarks/speculative.py's requests (and of its
warm-up requests, which fill the store first, as there) are replayed
through the real drafters, step by step, and each step is priced by a fixed
cost line (defaults: the joint fit of benchmarks/spec_costs.py, ms: a plain
step, plus per verification, plus per drafted token). Rules:

  own      prompt-lookup only (what the benchmark's fixed lookup does)
  longer   the draft whose true match with the context is longer
  gated    suffix-lookup only where the request's own match is under 4
           tokens and the store's is 16 or more (read off these requests'
           own data: an optimistic hand-tuned rule)

Printed first, position by position (every position of every request, not
only where a step starts): how many tokens each drafter's draft (k=32) would
hold, bucketed by the true length of the request's own match and of the
store's. Then modelled tokens/s per workload and on the mix, per rule and k,
and the ratio to ``own`` at the same k.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from speculative import WORKLOADS, make_workloads  # noqa: E402

from dspark import LLM, SamplingParams  # noqa: E402
from dspark.builtin.ngram import PromptLookupDrafter  # noqa: E402
from dspark.builtin.suffix import SuffixDrafter  # noqa: E402
from dspark.llm.api import default_model_path  # noqa: E402
from dspark.types import DraftRequest  # noqa: E402

RULES = ("own", "longer", "gated")
BUCKETS = ((0, 0, "none"), (1, 3, "1-3"), (4, 7, "4-7"), (8, 15, "8-15"), (16, 10**6, "16+"))


def held(draft: list[int], future: list[int]) -> int:
    n = 0
    for x, y in zip(draft, future):
        if x != y:
            break
        n += 1
    return n


def positions(texts: dict[str, list[tuple[list[int], list[int]]]], warm: list[list[int]]) -> None:
    """Per workload and (own match, store match) bucket: positions, mean tokens each draft holds."""
    store = SuffixDrafter()
    for t in warm:
        store.add(t)
    print("position by position, k=32: tokens held by the request's own lookup and by the store's")
    for w in WORKLOADS:
        tab: dict[tuple[int, int], list[int]] = {}
        for prompt, gen in texts[w]:
            full = prompt + gen
            own = PromptLookupDrafter()
            for t in range(len(prompt), len(full) - 1):
                a = own.propose_batch([DraftRequest(w, full[:t], 32)])[0]
                b = store.propose(full[:t], 32)
                key = (match_len(a.confidence), match_len(b.confidence))
                key = (next(i for i, (lo, hi, _) in enumerate(BUCKETS) if lo <= key[0] <= hi),
                       next(i for i, (lo, hi, _) in enumerate(BUCKETS) if lo <= key[1] <= hi))
                e = tab.setdefault(key, [0, 0, 0])
                e[0] += 1
                e[1] += held(a.tokens, full[t:])
                e[2] += held(b.tokens, full[t:])
            store.add(full)
        print(f"  {w}: {'own match':>9} {'store match':>11} {'positions':>9} {'own holds':>9} {'store holds':>11}")
        for (i, j), (n, ha, hb) in sorted(tab.items()):
            print(f"  {'':<{len(w) + 1}} {BUCKETS[i][2]:>9} {BUCKETS[j][2]:>11} {n:9d} {ha / n:9.2f} {hb / n:11.2f}")


def match_len(conf: list[float] | None) -> int:
    """The true match length a lookup draft's confidence encodes (c = m / (m + 2))."""
    if not conf:
        return 0
    c = conf[0]
    return round(2 * c / (1 - c)) if c < 1 else 10**6


def replay(texts: dict[str, list[tuple[list[int], list[int]]]], warm: list[list[int]], rule: str, k: int,
           cost: tuple[float, float, float]) -> dict[str, tuple[float, int]]:
    """Per workload: (modelled ms, tokens generated)."""
    step, verify, per_token = cost
    store = SuffixDrafter()
    for t in warm:
        store.add(t)
    out = {}
    for w in WORKLOADS:
        ms, toks = 0.0, 0
        for i, (prompt, gen) in enumerate(texts[w]):
            own = PromptLookupDrafter()
            full = prompt + gen
            t, end = len(prompt), len(full)
            sid = f"{w}{i}"
            while t < end:
                ctx = full[:t]
                a = own.propose_batch([DraftRequest(sid, ctx, k)])[0]
                b = store.propose(ctx, k)
                ma, mb = match_len(a.confidence), match_len(b.confidence)
                use = a.tokens
                if b.tokens and ((rule == "longer" and mb > ma) or (rule == "gated" and ma < 4 and mb >= 16)):
                    use = b.tokens
                n = min(held(use, full[t:]), end - t - 1)
                ms += step + (verify + per_token * len(use) if use else 0.0)
                t += n + 1
                toks += n + 1
            store.add(full)
        out[w] = (ms, toks)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4, help="prompts per workload")
    ap.add_argument("--out", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--step", type=float, default=6.2, help="ms of a plain step")
    ap.add_argument("--verify", type=float, default=1.2, help="ms a verification adds")
    ap.add_argument("--token", type=float, default=0.25, help="ms per drafted token")
    args = ap.parse_args()
    model = default_model_path()
    llm = LLM(model, dtype="float32", max_batch_size=1, max_total_tokens=2048)
    work = make_workloads(llm, model, args.n, args.out)
    warm = make_workloads(llm, model, args.n, args.out, first=args.n)
    sp = SamplingParams(max_tokens=args.out, temperature=0.0, ignore_eos=True)

    def outputs(ws: dict[str, list[list[int]]]) -> dict[str, list[tuple[list[int], list[int]]]]:
        return {w: [(p, llm.generate([p], sp)[0].token_ids) for p in ws[w]] for w in WORKLOADS}

    texts = outputs(work)
    warm_texts = [p + g for pairs in outputs(warm).values() for p, g in pairs]
    cost = (args.step, args.verify, args.token)
    positions(texts, warm_texts)
    print(f"cost line: {args.step} ms a plain step, + {args.verify} per verification, + {args.token} per drafted "
          "token; modelled tokens/s")
    print(f"{'rule':<7} {'k':>3} " + " ".join(f"{w:>7}" for w in (*WORKLOADS, "mix")) + "   / own, mix")
    for k in (4, 7, 16):
        base = None
        for rule in RULES:
            r = replay(texts, warm_texts, rule, k, cost)
            tps = {w: r[w][1] / r[w][0] * 1e3 for w in WORKLOADS}
            mix = sum(v[1] for v in r.values()) / sum(v[0] for v in r.values()) * 1e3
            base = mix if base is None else base
            print(f"{rule:<7} {k:>3} " + " ".join(f"{tps[w]:7.1f}" for w in WORKLOADS) + f" {mix:7.1f}"
                  + f"   {mix / base:.3f}")


if __name__ == "__main__":
    main()
