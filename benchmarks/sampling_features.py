"""What the server's sampling features cost the engine (issue 22), as ratios to plain decoding.

Usage: .venv/bin/python benchmarks/sampling_features.py [--threads 2] [--batch 32] [--tokens 64] [--rounds 3]
       [--variants plain,logprobs=5,...] [--host-only] [--json]

On the embedded model, float32, in one process: the same requests (``--batch``
prompts cut from held-out stdlib files, greedy, ``ignore_eos`` so each yields
exactly ``--tokens`` tokens, continuous batching) run once per variant per
round, variants interleaved within a round so drifting load hits all alike:

  plain        no processing: the engine's batched-argmax fast path
  logprobs=5   raw logprobs of every token and its 5 likeliest alternatives
  penalties    presence 0.5, frequency 0.3, repetition 1.1, a logit_bias entry
  json_object  output held to a JSON object by xgrammar (``ignore_eos`` off:
               the grammar ends it; tokens/s counts what was generated)
  regex        output held to ``[a-z_]{1,12}( [a-z_]{1,12}){0,80}``

and, with ``--batch 1``, the same one request at a time. Reported: median
output tokens/s per variant and its ratio to plain, and the per-token cost
over plain in microseconds (1/tps - 1/tps_plain, per sequence-token).
Speculative decoding is off: the figures are the per-row processing's cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from dspark.llm import LLM, SamplingParams
from dspark.server.loadgen.bench import default_workload

REGEX = r"[a-z_]{1,12}( [a-z_]{1,12}){0,80}"


def variants(tokens: int, names: list[str] | None) -> dict[str, dict[str, Any]]:
    base: dict[str, Any] = {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    if names == ["plain"]:  # runs on engines older than these features too (an A/B of the plain path)
        return {"plain": base}
    from dspark.llm.sampling import GuidedSpec

    out = {
        "plain": base,
        "logprobs=5": {**base, "logprobs": 5},
        "penalties": {**base, "presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.1,
                      "logit_bias": {5: 2.0}},
        "json_object": {**base, "ignore_eos": False, "guided": GuidedSpec(kind="json_object", value=None)},
        "regex": {**base, "guided": GuidedSpec(kind="regex", value=REGEX)},
    }
    return {k: v for k, v in out.items() if names is None or k in names}


def run(llm: LLM, prompts: list[str], kw: dict[str, Any]) -> tuple[float, int]:
    params = [SamplingParams(**kw) for _ in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    return dt, sum(len(o.token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=None, help="comma list (default all); 'plain' alone also runs on an "
                    "engine from before these features, for an A/B of the plain path")
    ap.add_argument("--host-only", action="store_true", help="replace the model's forward by fixed logits: "
                    "report the engine's own host time per step (scheduling, sampling, processing, outputs)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    llm = LLM(dtype="float32", max_batch_size=max(a.batch, 1))
    if a.host_only:
        vocab = llm.engine.runner.cfg.vocab_size
        fixed = [torch.randn(vocab, generator=torch.Generator().manual_seed(i)) for i in range(64)]
        llm.engine.runner.step = lambda cache, chunks, **kw: [fixed[i % 64] for i in range(len(chunks))]
    prompts = [r.prompt for r in default_workload(a.batch, seed=3, prompt_tokens=(16, 64), max_tokens=(1, 2))]
    vs = variants(a.tokens, a.variants.split(",") if a.variants else None)
    for kw in vs.values():  # warm-up: allocator, grammar compiles and xgrammar's import
        run(llm, prompts[: min(4, len(prompts))], kw)
    tps: dict[str, list[float]] = {k: [] for k in vs}
    for _ in range(a.rounds):
        for name, kw in vs.items():
            dt, n = run(llm, prompts, kw)
            tps[name].append(n / dt)
    plain = statistics.median(tps["plain"]) if "plain" in tps else float("nan")
    rows = []
    for name, xs in tps.items():
        med = statistics.median(xs)
        extra_us = (1 / med - 1 / plain) * 1e6  # wall time added per generated token
        rows.append({"variant": name, "tok_s": round(med, 1), "vs_plain": round(med / plain, 3),
                     "extra_us_per_token": round(extra_us, 1)})
    if a.host_only:
        for r in rows:  # every request yields --tokens tokens in --tokens steps
            r["host_ms_per_step"] = round(a.batch / r["tok_s"] * 1e3, 3)
    if a.json:
        print(json.dumps({"batch": a.batch, "tokens": a.tokens, "threads": a.threads, "rows": rows}, indent=1))
        return
    print(f"batch {a.batch}, {a.tokens} tokens each, {a.threads} threads, median of {a.rounds} rounds")
    print(f"{'variant':<12} {'tok/s':>9} {'vs plain':>9} {'+us/token':>10}" + (" host ms/step" if a.host_only else ""))
    for r in rows:
        print(f"{r['variant']:<12} {r['tok_s']:>9} {r['vs_plain']:>9} {r['extra_us_per_token']:>10}"
              + (f" {r['host_ms_per_step']:>12}" if a.host_only else ""))


if __name__ == "__main__":
    main()
