"""Where DeepSpec's time goes one request at a time: its stretches, the target's calls and the engine's work.

Usage: .venv/bin/python benchmarks/spec_stretches.py [--decoder cpu] [--dtype bfloat16] [--rounds 5]

On the prompts of ``vs_openvino_genai.py``'s spec row (benchmarks/speculative.py's code and edit prompts,
128 new tokens each, greedy, one request at a time), one engine with DeepSpec and one without, in one
process, their rounds alternated. Each DeepSpec engine step is put in one kind, timed, and split into the
target's calls (``runner.step``, ``runner.greedy_steps``) and the rest (the engine's and DeepSpec's host
work):

- prefill: the step that reads the prompt (and any proposal made with it);
- greedy stretches: greedy runs (several one-row steps in one decoder call);
- copy stretches: copy runs (verification steps of k tokens drafted by a lookup, docs/decoders.md);
- proposals: the steps that ask every drafter (every eighth stretch or so, so the model drafters can show);
- the stretch choice (``lone_plan``: the replay of the request's text) inside the kinds above.

A copy run's first verification step follows a step of another shape (a greedy run, a proposal, the
prefill) unless the run before it had its width; on a target that prepares its nodes again at a change of
shape (OpenVINO) that step costs more. "first step" and "later steps" are the copy steps' own target calls.

Printed per round and as medians: tokens/s of each engine, each kind's milliseconds and tokens, and
milliseconds a token. The plain engine runs greedy runs only (its prefill apart). The ratio of the
engines is DeepSpec's speed-up over plain decoding on this target.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from speculative import learned_restorer  # noqa: E402
from vs_openvino_genai import MODELS, make_prompts  # noqa: E402

KINDS = ("prefill", "greedy", "copy", "proposal")


class Stretches:
    """Times and sorts the engine steps of one DeepSpec engine (wrapping its engine, runner and spec calls)."""

    def __init__(self, llm: Any) -> None:
        eng, runner, spec = llm.engine, llm.engine.runner, llm.engine.spec
        self.ms: collections.Counter[str] = collections.Counter()
        self.n: collections.Counter[str] = collections.Counter()
        self.cur: collections.Counter[str] = collections.Counter()
        self.in_copy = self.first = False
        o_estep, o_step, o_greedy = eng.step, runner.step, runner.greedy_steps
        o_copy, o_plan = spec.copy_run, spec.lone_plan

        def timed(key: str, f: Any, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self.cur[key] += (time.perf_counter() - t0) * 1e3
                self.cur[key + "#"] += 1

        def step(cache: Any, chunks: Any, exit_layer: int | None = None) -> Any:
            if any(cache.seq_lens.get(ch.seq_id, 0) == 0 for ch in chunks):
                self.cur["prefill"] += 1
            key = "target" if not self.in_copy else "copy_first" if self.first else "copy_later"
            self.first = False
            return timed(key, o_step, cache, chunks, exit_layer)

        def copy_run(*a: Any, **k: Any) -> Any:
            self.in_copy = self.first = True
            self.cur["copy_runs"] += 1
            try:
                toks, steps = o_copy(*a, **k)
            finally:
                self.in_copy = False
            self.cur["copy_steps"] += steps
            return toks, steps

        def estep(*a: Any, **k: Any) -> Any:
            self.cur = collections.Counter()
            t0 = time.perf_counter()
            before = sum(len(s.output_ids) for s in eng._seqs.values())
            outs = o_estep(*a, **k)
            ms = (time.perf_counter() - t0) * 1e3
            c = self.cur
            kind = "prefill" if c["prefill"] else "copy" if c["copy_runs"] else "greedy" if c["greedy#"] \
                else "proposal"
            made = sum(len(s.output_ids) for s in eng._seqs.values()) + sum(
                len(o.token_ids) for o in outs if o.finished) - before
            target = c["target"] + c["greedy"] + c["copy_first"] + c["copy_later"]
            self.ms[kind] += ms
            self.ms[kind + " target"] += target
            self.n[kind + " tokens"] += made
            self.n[kind + " steps"] += 1
            self.ms["choice"] += c["choice"]
            for key in ("copy_first", "copy_later"):
                self.ms[key] += c[key]
                self.n[key] += c[key + "#"]
            self.n["verification steps"] += c["copy_steps"]
            return outs

        eng.step = estep
        runner.step = step
        runner.greedy_steps = lambda *a, **k: timed("greedy", o_greedy, *a, **k)
        spec.copy_run = copy_run
        spec.lone_plan = lambda *a, **k: timed("choice", o_plan, *a, **k)

    def reset(self) -> None:
        self.ms.clear()
        self.n.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--decoder", default="cpu", help="EngineConfig.decoder (default cpu: OpenVINO; the spec row "
                    "runs on the decoder the engine measures fastest: llamacpp on some CPUs)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch
    from tokenizers import Tokenizer

    from dspark import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    model = MODELS / "stdlib-llama"
    prompts, warm, n_out = make_prompts("spec", model, Tokenizer.from_file(str(model / "tokenizer.json")), False)
    kw = {"dtype": args.dtype, "decoder": args.decoder, "max_batch_size": 1,
          "max_total_tokens": 2 * (max(map(len, prompts + warm)) + n_out + 32)}
    spec_llm = LLM(str(model), speculative_decoding={"enabled": True}, **kw)
    plain_llm = LLM(str(model), **kw)
    sp = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)

    def gen(llm: Any, ps: list[list[int]]) -> float:
        t0 = time.perf_counter()
        made = sum(len(llm.generate([p], sp)[0].token_ids) for p in ps)
        return made / (time.perf_counter() - t0)

    gen(spec_llm, warm)
    gen(plain_llm, warm)
    restore = learned_restorer(spec_llm)
    probe = Stretches(spec_llm)
    rates: dict[str, list[float]] = {"deepspec": [], "plain": []}
    per: dict[str, list[float]] = collections.defaultdict(list)
    for r in range(args.rounds):
        for name in (("deepspec", "plain") if r % 2 == 0 else ("plain", "deepspec")):
            if name == "plain":
                rates[name].append(gen(plain_llm, prompts))
                continue
            restore()
            probe.reset()
            rates[name].append(gen(spec_llm, prompts))
            for k, v in probe.ms.items():
                per[k + " ms"].append(v)
            for k, v in probe.n.items():
                per[k].append(float(v))
        print(f"round {r + 1}: deepspec {rates['deepspec'][-1]:,.1f} tok/s, plain {rates['plain'][-1]:,.1f} "
              f"({rates['deepspec'][-1] / rates['plain'][-1]:.2f}x)", flush=True)

    med = {k: statistics.median(v) for k, v in per.items()}
    ds, pl = statistics.median(rates["deepspec"]), statistics.median(rates["plain"])
    print(f"\n{len(prompts)} requests of {n_out} new tokens, {args.decoder} decoder, {args.dtype}, "
          f"{args.threads} threads, {args.rounds} rounds; medians")
    print(f"deepspec {ds:,.1f} tok/s, plain {pl:,.1f} tok/s: {ds / pl:.2f}x; plain {1e3 / pl:.3f} ms a token\n")
    total = sum(med.get(k + " ms", 0.0) for k in KINDS)
    print("| stretch | engine steps | tokens | ms | share | target ms | host ms | ms a token |")
    print("|---|---|---|---|---|---|---|---|")
    for k in KINDS:
        ms, tgt, toks = med.get(k + " ms", 0.0), med.get(k + " target ms", 0.0), med.get(k + " tokens", 0.0)
        print(f"| {k} | {med.get(k + ' steps', 0):.0f} | {toks:.0f} | {ms:.1f} | {ms / total:.0%} | {tgt:.1f} | "
              f"{ms - tgt:.1f} | {ms / toks if toks else float('nan'):.3f} |")
    host = total - sum(med.get(k + " target ms", 0.0) for k in KINDS)
    print(f"| all | | {sum(med.get(k + ' tokens', 0) for k in KINDS):.0f} | {total:.1f} | | "
          f"{total - host:.1f} | {host:.1f} ({host / total:.0%}) | |")
    first, later = med.get("copy_first ms", 0.0), med.get("copy_later ms", 0.0)
    nf, nl = med.get("copy_first", 0.0), med.get("copy_later", 0.0)
    if nf and nl:
        print(f"\ncopy runs' verification steps: {med.get('verification steps', 0):.0f}; a run's first "
              f"{first / nf:.3f} ms ({nf:.0f}), its later ones {later / nl:.3f} ms ({nl:.0f}); "
              f"the stretch choice {med.get('choice ms', 0):.1f} ms")
    # What the stretch choice prices a lone sequence's step at after the last round (learned where a copy or
    # greedy run measured it, else the startup calibration's model): why it takes copy runs or not.
    step_ms = spec_llm.engine.spec._step_ms
    print("a lone step by rows, as DeepSpec prices it: "
          + ", ".join(f"{r} {step_ms(r):.2f} ms" for r in (1, 2, 3, 4, 6, 8)))


if __name__ == "__main__":
    main()
