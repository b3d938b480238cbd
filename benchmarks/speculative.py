"""Speculative decoding benchmark (issue 6): DeepSpec vs plain, fixed drafters and transformers.

Usage: .venv/bin/python benchmarks/speculative.py [--quick] [--threads 1] [--model DIR] [--rounds N] [--draft-head auto]
       [--dtype bfloat16] [--no-hf]

In one run, on the embedded model (or ``--model``), greedy, one request at a
time (batch 1, the setting of transformers' assisted generation), three
workloads:

  code   code completion of held-out standard-library files: the prompt is
         the first part of a file (``heldout_files.txt`` next to the model:
         files the model never saw)
  edit   edit-like prompts that repeat much of their context: a window of a
         held-out file, a blank line, then the window's first third again,
         so the natural continuation re-types the rest with small changes
  open   open-ended generation from short prompts ("def ", "import os\\n", ...)

Contenders, every one on the same checkpoint, dtype and thread count:

  plain           dspark without speculation
  fixed D k       dspark, strategy fixed, drafter D (by name: draft-model,
                  self-draft, prompt-lookup in the request's own context,
                  suffix-lookup in earlier requests' text), k drafted
                  tokens; k swept over 1..8 (quick: 1, 2, 4, 8) in one
                  pass, then the best k per drafter (on the
                  mix of workloads) timed with the others, and for the best
                  drafter its two runners-up too: the best fixed configuration
                  is the best of the timed ones
  deepspec        dspark, strategy deepspec (all drafters offered; the
                  controller picks drafter and k per step)
  hf / hf-assist / hf-lookup
                  transformers ``generate``: plain, assisted generation with
                  the same draft model (its default schedule), prompt lookup
                  (``prompt_lookup_num_tokens=10``)

Every contender gets one untimed warm-up pass over other prompts of the same
workloads (the next held-out files and open prompts): DeepSpec's predictor
and cost models learn online, and suffix-lookup stores finished requests'
text, as they would from earlier traffic in a server. What each engine has
learned then is restored before each timed round (and what it knew before
the sweep, before each sweep pass), so none meets a timed request it has
learned from (it learns within the round, as it goes). Then ``--rounds``
timed rounds, interleaved request by request: each prompt is run by every
contender in turn (the order rotating), so a
slow spell of the machine falls on all of them alike. tokens/s = generated
tokens / median over rounds of the summed request times; the ratio to the
best fixed configuration is also given per round, and decode only: the time
to the first token (prefill and one step, the same code for every dspark
contender, timed in the rounds as plain requests of one token) left out.
Output lengths are fixed (``ignore_eos``), and every dspark contender's
tokens are checked identical to plain decoding. Printed: tokens/s per
workload, ratios, acceptance per drafter, the predictor's calibration
(predicted vs observed acceptance per bucket), and the measured cost ratios
(draft step vs target step, verify k tokens vs one) that decide whether a
drafter pays.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dspark import LLM, SamplingParams
from dspark.llm.api import default_model_path

WORKLOADS = ("code", "edit", "open")
RUNNERS_UP = 2  # the best drafter's next-best k from the sweep, timed beside its best
OPEN_PROMPTS = ["def ", "import os\n", "class ", "# ", "if __name__ == ", "for i in ", "return ", "\"\"\""]


def heldout(model: Path) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    listing = model / "heldout_files.txt"
    names = listing.read_text().split() if listing.exists() else ["sysconfig.py", "statistics.py", "socket.py"]
    return [root / n for n in names if (root / n).exists()]


def make_workloads(llm: LLM, model: Path, n: int, out_tokens: int, first: int = 0) -> dict[str, list[list[int]]]:
    """``n`` prompts per workload, from the ``first``-th held-out file (by length) and open prompt on."""
    tok = llm.engine.tokenizer
    docs = [ids for f in heldout(model) if len(ids := tok.encode(f.read_text(errors="replace")).ids) > 400]
    docs.sort(key=len, reverse=True)
    docs = docs[first:first + n]
    code = [d[:256] for d in docs]
    edit = []
    for d in docs:
        window = d[300:300 + 120]
        nl = tok.encode("\n\n").ids[1:]  # the tokenizer prepends <s>; only the first prompt piece keeps it
        edit.append([d[0]] + window + nl + window[:40])
    opn = [tok.encode(p).ids for p in OPEN_PROMPTS[first:first + n]]
    return {"code": code, "edit": edit, "open": opn}


class Contender:
    def __init__(self, name: str, run: Callable[[list[int], int], list[int]], stats: Callable[[], Any] | None = None,
                 restore: Callable[[], None] | None = None, llm: LLM | None = None):
        self.name, self.run, self.stats, self.restore = name, run, stats, restore
        self.llm = llm  # a dspark contender's engine
        self.times: dict[str, list[float]] = {w: [] for w in WORKLOADS}
        self.outputs: dict[str, list[list[int]]] = {}
        self.spec_delta: dict[str, dict[str, dict[str, float]]] = {}

    def start_round(self, work: dict[str, list[list[int]]]) -> None:
        """A round request by request (``one``): learned state restored, times and counts from 0."""
        if self.restore is not None:
            self.restore()
        for w in WORKLOADS:
            self.times[w].append(0.0)
            self.outputs[w] = [[] for _ in work[w]]
            self.spec_delta[w] = {}

    def one(self, w: str, i: int, prompt: list[int], n_out: int) -> None:
        stats = self.stats
        before = stats() if stats is not None else None
        t0 = time.perf_counter()
        self.outputs[w][i] = self.run(prompt, n_out)
        self.times[w][-1] += time.perf_counter() - t0
        if stats is not None:
            acc = self.spec_delta[w]
            for name, v in _delta(before, stats()).items():
                tot = acc.setdefault(name, dict.fromkeys(v, 0.0))
                for key, x in v.items():
                    tot[key] += x

    def pass_(self, work: dict[str, list[list[int]]], n_out: int, timed: bool) -> None:
        """Every workload's requests in turn (one contender alone); untimed, the times are dropped."""
        self.start_round(work)
        for w in WORKLOADS:
            for i, prompt in enumerate(work[w]):
                self.one(w, i, prompt, n_out)
            if not timed:
                self.times[w].pop()

    def tps(self, w: str, n_tok: int) -> float:
        return n_tok / statistics.median(self.times[w])


def _delta(a: Any, b: Any) -> dict[str, dict[str, float]]:
    out = {}
    for name, d in b.spec_drafters.items():
        prev = a.spec_drafters.get(name, {})
        out[name] = {k: d[k] - prev.get(k, 0) for k in ("drafts", "draft_tokens", "accepted_tokens")}
    return out


def dspark_contender(llm: LLM, name: str) -> Contender:
    def run(prompt: list[int], n: int) -> list[int]:
        return llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0].token_ids

    return Contender(name, run, llm.stats if llm.engine.spec is not None else None, llm=llm)


def learned_restorer(llm: LLM) -> Callable[[], None]:
    """Snapshot what the engine's DeepSpec has learned now; the returned call puts it back."""
    spec = llm.engine.spec
    assert spec is not None
    snap = spec.snapshot()
    return lambda: spec.restore(snap)


def hf_contenders(model: Path, draft: Path | None) -> list[Contender]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    a = AutoModelForCausalLM.from_pretrained(str(draft), dtype=torch.float32).eval() if draft else None

    def make(**kw: Any) -> Callable[[list[int], int], list[int]]:
        def gen(prompt: list[int], n: int) -> list[int]:
            ids = torch.tensor([prompt])
            cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=0, eos_token_id=None,
                                   pad_token_id=m.generation_config.pad_token_id, use_cache=True,
                                   **{k: v for k, v in kw.items() if k != "assistant_model"})
            extra = {"assistant_model": kw["assistant_model"]} if "assistant_model" in kw else {}
            with torch.inference_mode():
                out = m.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg, **extra)
            return out[0, len(prompt):].tolist()

        return gen

    cs = [Contender("hf", make())]
    if a is not None:
        cs.append(Contender("hf-assist", make(assistant_model=a)))
    cs.append(Contender("hf-lookup", make(prompt_lookup_num_tokens=10)))
    return cs


def batch_section(model: Path, dtype: str, work: dict[str, list[list[int]]], warm: dict[str, list[list[int]]],
                  n_out: int, best_fixed: str, rounds: int) -> None:
    """Every workload's prompts at once (continuous batching, up to 8 in flight): speculation pays less."""
    prompts = [p for w in WORKLOADS for p in work[w]]
    B = min(8, len(prompts))
    kind, k = best_fixed.split()[1], int(best_fixed.split("k=")[1])
    llms = {"plain": LLM(model, dtype=dtype, max_batch_size=B),
            best_fixed: LLM(model, dtype=dtype, max_batch_size=B,
                            speculative_decoding={"strategy": "fixed", "drafters": [kind], "num_speculative_tokens": k}),
            "deepspec": LLM(model, dtype=dtype, max_batch_size=B, speculative_decoding={"strategy": "deepspec"})}
    p = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {n: [] for n in llms}
    outs: dict[str, list[list[int]]] = {}
    for llm in llms.values():
        llm.generate([q for w in WORKLOADS for q in warm[w]], p)  # warm-up, on other prompts
    restore = {n: learned_restorer(llm) for n, llm in llms.items() if llm.engine.spec is not None}
    for _ in range(rounds):
        for n, llm in llms.items():
            if n in restore:
                restore[n]()
            t0 = time.perf_counter()
            outs[n] = [o.token_ids for o in llm.generate(prompts, p)]
            times[n].append(time.perf_counter() - t0)
    tok = len(prompts) * n_out
    plain = tok / statistics.median(times["plain"])
    print(f"\ncontinuous batching, {len(prompts)} requests (all workloads) with up to {B} in flight, median of "
          f"{rounds} round(s): tokens/s")
    for n in llms:
        v = tok / statistics.median(times[n])
        print(f"  {n:<20} {v:7.1f}  ({v / plain:.2f}x plain; identical to plain: {outs[n] == outs['plain']})")
    s = llms["deepspec"].stats()
    print(f"  deepspec drafted {s.spec_draft_tokens} tokens in {s.spec_drafts} drafts, accepted "
          f"{s.spec_accepted_tokens} ({s.spec_acceptance_rate:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=default_model_path())
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads for every contender; 0 = torch's "
                    "default (all cores), as benchmarks/engine.py; use 1 on a shared machine")
    ap.add_argument("--quick", action="store_true", help="fewer and shorter requests, k swept over 1,2,4,8")
    ap.add_argument("--rounds", type=int, default=None, help="timed interleaved rounds (default 5, quick 2)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peers")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="every dspark engine's dtype (bfloat16: vs_openvino_genai.py's spec row; the engine "
                         "then picks its decoder at that dtype); the transformers peers stay float32")
    ap.add_argument("--draft-head", default="none",
                    help="speculative_decoding.draft_head of every dspark engine (auto: the embedded feature head "
                         "too, swept like the other drafters, and DeepSpec also timed without it)")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    quick = args.quick
    n_req, n_out = (2, 64) if quick else (4, 128)
    rounds = args.rounds or (2 if quick else 5)
    ks = [1, 2, 4, 8] if quick else list(range(1, 9))
    model = args.model
    dtype = args.dtype
    print(f"model {model}; dtype {dtype}; torch {torch.__version__}, {torch.get_num_threads()} thread(s); "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; mode {'quick' if quick else 'full'}")

    plain = LLM(model, dtype=dtype, max_batch_size=1, max_total_tokens=2048)
    work = make_workloads(plain, model, n_req, n_out)
    warm = make_workloads(plain, model, n_req, n_out, first=n_req)  # warm-up and learning: other prompts
    n_tok = {w: len(work[w]) * n_out for w in WORKLOADS}
    print("workloads: " + "; ".join(f"{w}: {len(work[w])} prompts of {min(map(len, work[w]))}-"
                                     f"{max(map(len, work[w]))} tokens, {n_out} tokens out" for w in WORKLOADS))

    def spec_llm(**spec: Any) -> LLM:
        spec.setdefault("draft_head", args.draft_head)
        return LLM(model, dtype=dtype, max_batch_size=1, max_total_tokens=2048, speculative_decoding=spec)

    deep = spec_llm(strategy="deepspec")
    sd = deep.engine.spec
    # Each drafter is swept on its own, by name (two of the built-ins are lookups of kind ngram).
    drafters = [(h.name.split(":")[0], h.name) for h in sd.handles]
    print("drafters offered: " + ", ".join(f"{n} ({h.kind}, plugin {h.plugin})" for (_, n), h in zip(drafters, sd.handles)))
    base = dspark_contender(plain, "plain")
    base.pass_(work, n_out, timed=False)
    ref = base.outputs

    # ---- the k sweep: one timed pass per (drafter, k), one engine per drafter, k changed between passes
    fixed_llms = {kind: spec_llm(strategy="fixed", drafters=[kind], num_speculative_tokens=ks[0])
                  for kind, _ in drafters}
    # A drafter that learns across requests (suffix-lookup) starts every sweep pass from what it knew
    # before the sweep: no pass drafts from the same requests' outputs stored by an earlier one.
    fresh = {kind: learned_restorer(llm) for kind, llm in fixed_llms.items()}
    sweep: dict[tuple[str, int], dict[str, float]] = {}
    t_sweep = time.perf_counter()
    base.pass_(work, n_out, timed=True)  # plain alongside the sweep, for its ratios
    long_k = deep.engine.spec.cfg.max_k  # DeepSpec's own ceiling
    # Beyond the brief's sweep of 1..8: lookup drafts are nearly free and loops are long, so a fixed
    # lookup as long as DeepSpec may go is shown for reference (it is not a contender for "best fixed").
    extra = {"prompt-lookup": sorted({16, long_k})}
    for kind, llm in fixed_llms.items():
        for k in ks + extra.get(kind, []):
            llm.engine.spec.cfg = llm.engine.spec.cfg.model_copy(update={"num_speculative_tokens": k})
            c = dspark_contender(llm, f"fixed {kind} k={k}")
            c.restore = fresh[kind]
            c.pass_(work, n_out, timed=True)
            sweep[(kind, k)] = {w: c.tps(w, n_tok[w]) for w in WORKLOADS}
            sweep[(kind, k)]["mix"] = sum(n_tok.values()) / sum(c.times[w][0] for w in WORKLOADS)
            bad = [w for w in WORKLOADS if c.outputs[w] != ref[w]]
            if bad:
                print(f"  WARNING fixed {kind} k={k}: outputs differ from plain on {bad}")
    plain_mix = sum(n_tok.values()) / sum(base.times[w][0] for w in WORKLOADS)
    print(f"\nk sweep (one pass each, {time.perf_counter() - t_sweep:.0f} s): tokens/s; plain mix {plain_mix:.1f}")
    print(f"{'drafter':<14} {'k':>2} " + " ".join(f"{w:>7}" for w in (*WORKLOADS, "mix")))
    best_k: dict[str, int] = {}
    for kind, _ in drafters:
        for k in ks + extra.get(kind, []):
            r = sweep[(kind, k)]
            print(f"{kind:<14} {k:>2} " + " ".join(f"{r[w]:7.1f}" for w in (*WORKLOADS, "mix"))
                  + ("   (outside the 1..8 sweep)" if k not in ks else ""))
        best_k[kind] = max(ks, key=lambda k: sweep[(kind, k)]["mix"])
        print(f"  best k for {kind} on the mix: {best_k[kind]}; per workload: "
              + ", ".join(f"{w} {max(ks, key=lambda k: sweep[(kind, k)][w])}" for w in WORKLOADS))
    for kind, llm in fixed_llms.items():
        llm.engine.spec.cfg = llm.engine.spec.cfg.model_copy(update={"num_speculative_tokens": best_k[kind]})
        # The sweep's last pass stored the timed prompts' own continuations (suffix-lookup); the
        # snapshot taken after the warm-up must not hold them, or the timed rounds replay them.
        fresh[kind]()

    # ---- the timed comparison
    base = dspark_contender(plain, "plain")
    contenders = [base] + [dspark_contender(fixed_llms[kind], f"fixed {kind} k={best_k[kind]}")
                           for kind, _ in drafters]
    # The sweep is one pass per k on a noisy machine: the best drafter's runners-up in it are timed
    # too, and the best fixed configuration is the best of all timed ones (never a lucky sweep pass
    # against a weaker k).
    lead = max(best_k, key=lambda kind: sweep[(kind, best_k[kind])]["mix"])
    for k in sorted(ks, key=lambda k: sweep[(lead, k)]["mix"], reverse=True)[1:RUNNERS_UP + 1]:
        contenders.append(dspark_contender(spec_llm(strategy="fixed", drafters=[lead], num_speculative_tokens=k),
                                           f"fixed {lead} k={k}"))
    contenders.append(dspark_contender(deep, "deepspec"))
    if args.draft_head != "none":  # what offering the head does to DeepSpec, in the same interleaved rounds
        contenders.append(dspark_contender(spec_llm(strategy="deepspec", draft_head="none"),
                                           "(deepspec without the head)"))
    long_lookup = None
    if "prompt-lookup" in fixed_llms:  # the same lookup drafter at DeepSpec's max_k, outside the brief's sweep
        long_lookup = dspark_contender(spec_llm(strategy="fixed", drafters=["prompt-lookup"],
                                                num_speculative_tokens=long_k), f"(fixed prompt-lookup k={long_k})")
        contenders.append(long_lookup)
    draft_path = next((Path(n.split(":", 1)[1]) for _, n in drafters if n.startswith("draft-model:")), None)
    if draft_path is not None:
        draft_path = model.parent / draft_path
    hf: list[Contender] = [] if args.no_hf else hf_contenders(model, draft_path)
    # Time to the first token (prefill and one step, the same code for every dspark contender),
    # timed in the rounds too: the decode-only ratio leaves it out.
    first = dspark_contender(plain, "(first token)")
    first.run = lambda prompt, n, _run=first.run: _run(prompt, 1)
    contenders.append(first)
    contenders += hf
    for c in contenders:
        c.pass_(warm, n_out, timed=False)  # warm-up on other prompts (DeepSpec learns from them)
    d = next(c for c in contenders if c.name == "deepspec")
    for c in contenders:  # what each engine learned in the warm-up is restored before every round
        if c.llm is not None and c.llm.engine.spec is not None:
            c.restore = learned_restorer(c.llm)
    for rnd in range(rounds):
        for c in contenders:
            c.start_round(work)
        for w in WORKLOADS:
            for i, prompt in enumerate(work[w]):
                shift = (rnd * len(work[w]) + i) % len(contenders)
                for c in contenders[shift:] + contenders[:shift]:
                    c.one(w, i, prompt, n_out)
        print(f"  round {rnd + 1}/{rounds} done", flush=True)

    def mix(c: Contender) -> float:
        return sum(n_tok.values()) / sum(statistics.median(c.times[w]) for w in WORKLOADS)

    print(f"\ntokens/s, batch 1, greedy, median of {rounds} rounds interleaved request by request (load average now "
          f"{os.getloadavg()[0]:.1f})")
    print(f"{'contender':<26} " + " ".join(f"{w:>7}" for w in (*WORKLOADS, "mix")) + "   identical to plain   runs")
    for c in contenders:
        if c is first:
            continue
        same = all(c.outputs[w] == ref[w] for w in WORKLOADS)
        runs = c.llm.engine.stats().decoder if c.llm is not None else ""  # the target each engine chose
        print(f"{c.name:<26} " + " ".join(f"{c.tps(w, n_tok[w]):7.1f}" for w in WORKLOADS)
              + f" {mix(c):7.1f}   {str(same):<19} {runs}")
    t_first = {w: statistics.median(first.times[w]) for w in WORKLOADS}
    print("time to the first token (prefill and one step), s per workload pass: "
          + ", ".join(f"{w} {t_first[w]:.2f}" for w in WORKLOADS))
    fixed_cs = [c for c in contenders if c.name.startswith("fixed")]  # the brief's sweep, k in 1..8
    best_fixed = max(fixed_cs, key=mix)

    print("\nratios")
    print(f"{'what':<52} {'value':>7} {'target':>8}")
    for w in WORKLOADS:
        tgt = ">= 2" if w == "code" else ">= 0.97"
        print(f"{f'deepspec / plain, {w}':<52} {d.tps(w, n_tok[w]) / base.tps(w, n_tok[w]):7.2f} {tgt:>8}")
    print(f"{'deepspec / plain, mix':<52} {mix(d) / mix(base):7.2f} {'':>8}")
    print(f"{f'deepspec / best fixed ({best_fixed.name}), mix':<52} {mix(d) / mix(best_fixed):7.2f} {'>= 1.2':>8}")
    per_round = [sum(best_fixed.times[w][r] for w in WORKLOADS) / sum(d.times[w][r] for w in WORKLOADS)
                 for r in range(rounds)]
    print(f"{'  the same, round by round':<52} " + " ".join(f"{v:.2f}" for v in per_round))

    def decode_s(c: Contender) -> float:
        return sum(statistics.median(c.times[w]) - t_first[w] for w in WORKLOADS)

    print(f"{'  the same, decode only (first token left out)':<52} {decode_s(best_fixed) / decode_s(d):7.2f}")
    for w in WORKLOADS:
        bw = max(fixed_cs, key=lambda c: c.tps(w, n_tok[w]))
        print(f"{f'deepspec / best fixed on {w} ({bw.name})':<52} {d.tps(w, n_tok[w]) / bw.tps(w, n_tok[w]):7.2f}")
    if long_lookup is not None:
        print(f"{f'deepspec / {long_lookup.name}, mix  [outside the sweep]':<52} {mix(d) / mix(long_lookup):7.2f}")
    for c in hf:
        if c.name != "hf":
            print(f"{f'deepspec / {c.name}, mix':<52} {mix(d) / mix(c):7.2f} {'> 1':>8}")
    if hf:
        print(f"{'plain dspark / hf plain, mix':<52} {mix(base) / mix(hf[0]):7.2f}")

    batch_section(model, dtype, work, warm, n_out, best_fixed.name, 1 if quick else 2)

    print("\nacceptance in the timed rounds (accepted / drafted tokens; accepted per draft)")
    for c in [*fixed_cs, d]:
        for w in WORKLOADS:
            for name, v in c.spec_delta.get(w, {}).items():
                if v["drafts"]:
                    print(f"  {c.name:<20} {w:<5} {name:<32} drafts {v['drafts']:5.0f}  acceptance "
                          f"{v['accepted_tokens'] / max(v['draft_tokens'], 1):5.2f}  mean accepted length "
                          f"{v['accepted_tokens'] / v['drafts']:5.2f}")
    st = deep.stats()
    print(f"\ndeepspec over the whole run: drafts {st.spec_drafts}, drafted {st.spec_draft_tokens}, accepted "
          f"{st.spec_accepted_tokens} ({st.spec_acceptance_rate:.2f}); plain steps {sd.steps - sd.spec_steps} of "
          f"{sd.steps}")
    print("predictor calibration (per drafted token: predicted vs observed acceptance), expected calibration "
          f"error {st.spec_calibration_error:.3f}")
    print(f"  {'bucket':>8} {'n':>6} {'predicted':>9} {'observed':>9}")
    for row in sd.calibration_table():
        print(f"  {row['bucket']:8.1f} {row['n']:6d} {row['predicted']:9.3f} {row['observed']:9.3f}")
    for name, v in st.spec_drafters.items():
        ce = v["calibration_error"]
        print(f"  {name:<32} acceptance {v['acceptance_rate']:.2f}, calibration error "
              f"{'n/a' if ce is None else f'{ce:.3f}'}")
    cal = sd.calibration
    vm = cal.get("verify_ms", {})
    one = vm.get("B1+0")
    print("\nmeasured costs (startup calibration, ms, lower quartile of interleaved rounds):")
    if one:
        print("  target verify, batch 1: " + ", ".join(f"k={key.split('+')[1]}: {v:.2f} ({v / one:.2f}x)"
                                                        for key, v in vm.items() if key.startswith("B1+")))
        for name in (n for _, n in drafters):
            if name in cal:
                print(f"  {name}: k=1 {cal[name]['ms_k1']:.2f} ms ({cal[name]['ms_k1'] / one:.2f}x a target step)"
                      + (f", k=4 {cal[name]['ms_k4']:.2f} ms" if cal[name].get("ms_k4") else ""))
    th = sd.verify_cost.theta
    print(f"  DeepSpec's verify cost model after the run: a plain step {th[0] + th[1]:.2f} ms; drafting adds "
          f"{th[3]:.2f} ms per verify chunk, {th[2]:.3f} ms per drafted token and {th[5]:.3f} ms per head row "
          f"computed (long drafts' rows past the first block only when it held)")
    if "self_exit_layer" in cal:
        print(f"  self-draft exit layer (measured on the first real context): {cal['self_exit_layer']}")
    if "shape_change_ms" in cal:
        print(f"  a change of the step's row count: {cal['shape_change_ms']:.2f} ms beyond the rows (0: the target "
              "pays none; else a lone sequence's step may be padded with filler to keep its shape)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
