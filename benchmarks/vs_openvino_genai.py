"""dspark's LLM engine vs OpenVINO GenAI (and llama.cpp's one-request figure) on the same checkpoint and threads.

Usage: .venv/bin/pip install openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0   (once; the
       installed openvino's version)
       .venv/bin/python benchmarks/vs_openvino_genai.py [--rounds 3] [--quick] [--only single,batch8,...]
                                                        [--precision bf16|f32] [--threads 2] [--decoder auto]
       bash benchmarks/llamacpp_setup.sh   (optional, not in CI: llama.cpp's row; "not set up" without it)

Workloads (``--only`` takes a comma-separated subset; default all):

  single        one request at a time, greedy, 128 new tokens per request
                (4 held-out prompts of 96 tokens); GenAI ``LLMPipeline``
  batch8/32     8 / 32 requests at once, 64 new tokens each (prompts of 32-128
                tokens); GenAI ``ContinuousBatchingPipeline`` (max_num_seqs =
                the batch, 512 batched tokens a step as dspark's default),
                dspark ``LLM.generate`` with max_batch_size = the batch
  batch32-sample  ``batch32`` sampling at temperature 0.8, top_p 0.95 on both
                sides (GenAI ``do_sample``; the random streams differ, so the
                tokens do too)
  spec          one at a time, 128 new tokens, prompts that repeat their
                context (benchmarks/speculative.py's ``code`` and ``edit``
                prompts from the held-out files): dspark DeepSpec
                (``speculative_decoding`` enabled, its default strategy and
                drafters, the embedded draft model among them) vs GenAI prompt
                lookup (``prompt_lookup=True``, ``num_assistant_tokens`` /
                ``max_ngram_size`` as GenAI's sample: 5 / 3) and GenAI
                speculative decoding with the same draft model
                (core/dspark/assets/models/stdlib-llama-draft, exported the same
                way, ``num_assistant_tokens`` 5); plain decoding of both on the
                same prompts for reference
  int8/int4     ``single`` with quantized weights: dspark's quantization scheme
                ``int8`` / ``int4`` vs NNCF ``compress_weights`` INT8_ASYM /
                INT4_SYM at NNCF's defaults (benchmarks/quant_peer.py's variants)
  rand-*        a seeded random-weight Llama (benchmarks/rand_model.py: hidden
                768, 12 layers, vocab 8192, 82M stored parameters, fp32
                safetensors and the embedded model's tokenizer, built once into
                benchmarks/out/models/random-90m), where the weights dominate a
                step: rand-single, rand-batch32, rand-int8, rand-int4

Each contender runs in a process of its own (the runtimes' worker threads
spin after a call and slow whatever runs next in the same process); the
processes alternate: ``--rounds`` rounds, each starting every contender of
every workload once, a workload's contenders back to back, who goes first
rotating from round to round. A process loads
its pipeline, runs one untimed warm-up pass over other prompts of the same
shape (DeepSpec's predictor and cost models learn online; what it learned is
restored before each timed pass, so no timed request meets its own earlier
output), then ``--reps`` timed passes. tokens/s = generated tokens of a pass
/ the median pass time over all rounds (wall time of the generate calls:
prefill included, loading not). Ratios are dspark / peer (> 1: dspark faster).

Same settings on both sides: ``--threads`` (OpenVINO INFERENCE_NUM_THREADS,
torch.set_num_threads), compute precision ``--precision`` (OpenVINO
INFERENCE_PRECISION_HINT and KV_CACHE_PRECISION; dspark's dtype, which its KV
cache follows), greedy, ``ignore_eos`` (GenAI also ``min_new_tokens``) so
every request yields exactly its new tokens: every contender checks its
count. GenAI's prefix caching is off (dspark has none). The OpenVINO IR is
quant_peer.py's stateful export of the checkpoint in fp32 (checked against
transformers' logits), with the tokenizer converted by
``openvino_tokenizers.convert_tokenizer`` from the local one; GenAI gets
token ids, as dspark does, so both see identical prompts. Greedy rows report
whether the two contenders' token ids agree (requests identical; tokens equal
position by position).

llama.cpp (llama-cpp-python 0.3.36 built from its sdist by
benchmarks/llamacpp_setup.sh into its own venv under benchmarks/out/llamacpp):
single and rand-single, one request at a time, ``Llama.generate`` on the
token ids (greedy, EOS not stopping it, n_threads = n_threads_batch =
``--threads``), on a GGUF of the same checkpoint written by llama.cpp's own
convert_hf_to_gguf.py: f32 (``--precision f32``) or bf16 where the setup made
one (the default precision; else f32, said in the table).

``--decoder`` is EngineConfig.decoder (default auto: plugin decoders bid,
the torch runner being one contender); what the engine chose, and why, is
printed and recorded. A plugin decoder runs at the precision it supports for
the engine's dtype (the OpenVINO plugin's follows it); ``--decoder torch``
pins dspark to its own torch runner at ``--precision``.
dspark's host and forward time per decoder step (EngineStats ``host_ms_per_step`` /
``forward_ms_per_step`` over ``forward_steps``: a greedy run of several steps in one decoder call counts
its steps; means over the timed passes only) are reported per row.

``--quick`` (a smoke test of the script, not a measurement): one prompt per
one-at-a-time workload with 8 new tokens, the batches with 4, spec with 1 code
and 1 edit prompt of 16, one timed pass per process. The full run: 3 rounds of
25 processes (27 with llama.cpp), each loading, warming up and timing 2
passes (its length was not measured when this was written; the quick run,
mostly loading and the one-off exports, took about 3.5 minutes on 2 shared cores).

Writes benchmarks/out/vs_openvino_genai.json and prints a markdown table; exits
1 when a contender failed or generated the wrong number of tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "out"
WORK = OUT / "vs_openvino_genai"
GENAI = WORK / "genai"  # GenAI model directories, one per checkpoint and weight variant
LLAMACPP = OUT / "llamacpp"
LLAMACPP_PY = LLAMACPP / "venv" / "bin" / "python"
RESULT = "@@RESULT "  # a child's result line on stdout (libraries may print too)
MODELS = ROOT / "core" / "dspark" / "assets" / "models"

# name: (checkpoint, weights, batch, spec); weights: float | int8 | int4
WORKLOADS: dict[str, tuple[str, str, int, bool]] = {
    "single": ("main", "float", 1, False),
    "batch8": ("main", "float", 8, False),
    "batch32": ("main", "float", 32, False),
    "batch32-sample": ("main", "float", 32, False),
    "spec": ("main", "float", 1, True),
    "int8": ("main", "int8", 1, False),
    "int4": ("main", "int4", 1, False),
    "rand-single": ("rand", "float", 1, False),
    "rand-batch32": ("rand", "float", 32, False),
    "rand-int8": ("rand", "int8", 1, False),
    "rand-int4": ("rand", "int4", 1, False),
}
NNCF = {"float": "fp32", "int8": "nncf-int8", "int4": "nncf-int4"}  # quant_peer.py's variant names
# Workloads that sample instead of decoding greedily: (temperature, top_p), the same on both sides (the
# random streams differ, so the tokens do too).
SAMPLED = {"batch32-sample": (0.8, 0.95)}
SPEC_CONTENDERS = ("dspark", "dspark-deepspec", "genai", "genai-lookup", "genai-draft")
# (dspark contender, peer) pairs reported per workload kind
SPEC_ROWS = (("dspark-deepspec", "genai-lookup"), ("dspark-deepspec", "genai-draft"),
             ("dspark-deepspec", "genai"), ("dspark", "genai"))
PLAIN_ROWS = (("dspark", "genai"), ("dspark", "llamacpp"))


# ============================================================ children (one contender, one process)
def _ids_tensor(prompt: list[int]) -> Any:
    import numpy as np
    import openvino as ov

    return ov.Tensor(np.asarray([prompt], np.int64))


def child_dspark(spec: dict[str, Any], contender: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    from dspark import LLM, SamplingParams

    B, n = spec["batch"], spec["n_out"]
    longest = max(len(p) for p in spec["prompts"] + spec["warm"])
    kw: dict[str, Any] = {"dtype": "bfloat16" if spec["precision"] == "bf16" else "float32",
                          "decoder": spec["decoder"], "max_batch_size": B,
                          "max_total_tokens": max(B, 2) * (longest + n + 32)}
    if spec["weights"] != "float":
        kw["quantization"] = spec["weights"]
    if contender == "dspark-deepspec":
        kw["speculative_decoding"] = {"enabled": True}  # the default strategy (deepspec), every drafter offered
    t0 = time.perf_counter()
    llm = LLM(spec["model"], **kw)
    load_s = time.perf_counter() - t0
    temp, top_p = spec.get("sample") or (0.0, 1.0)
    sp = SamplingParams(max_tokens=n, temperature=temp, top_p=top_p, ignore_eos=True)

    def run(prompts: list[list[int]]) -> list[list[int]]:
        if B == 1:
            return [llm.generate([p], sp)[0].token_ids for p in prompts]
        return [o.token_ids for o in llm.generate(prompts, sp)]

    run(spec["warm"])
    restore = None
    if llm.engine.spec is not None:
        from speculative import learned_restorer  # benchmarks/speculative.py

        restore = learned_restorer(llm)
    before = llm.stats()
    times, outs = [], []
    for _ in range(spec["reps"]):
        if restore is not None:
            restore()
        t0 = time.perf_counter()
        outs = run(spec["prompts"])
        times.append(time.perf_counter() - t0)
    after = llm.stats()
    info: dict[str, Any] = {"load_s": load_s, "dtype": str(llm.engine.runner.dtype).replace("torch.", ""),
                            "torch_threads": torch.get_num_threads()}
    choice = getattr(llm.engine, "decoder_choice", None)
    info["decoder"] = choice.to_dict() if hasattr(choice, "to_dict") else (str(choice) if choice else "torch")
    # Per-step host and forward time over the timed passes only (the stats are means over every step so far).
    # Per decoder step: a greedy run (several steps in one decoder call) counts its steps (forward_steps).
    if getattr(after, "host_ms_per_step", None) is not None and getattr(after, "steps", None) is not None:
        steps = after.steps - before.steps
        fsteps = getattr(after, "forward_steps", after.steps) - getattr(before, "forward_steps", before.steps)
        info["steps"], info["forward_steps"] = steps, fsteps
        if steps > 0 and fsteps > 0:
            for f in ("host_ms_per_step", "forward_ms_per_step"):
                if getattr(after, f, None) is not None:
                    info[f] = (getattr(after, f) * after.steps - getattr(before, f) * before.steps) / fsteps
    if getattr(after, "decoder", None) is not None:
        info["decoder_running"] = after.decoder
        info["decoder_failovers"] = getattr(after, "decoder_failovers", 0)
    if llm.engine.quant_plan is not None:
        info["weight_bytes"] = llm.weight_bytes()
    if after.spec_strategy:
        drafted = after.spec_draft_tokens - before.spec_draft_tokens
        accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
        drafts = after.spec_drafts - before.spec_drafts
        info["spec"] = {"strategy": after.spec_strategy, "drafts": drafts, "drafted": drafted, "accepted": accepted,
                        "acceptance": accepted / drafted if drafted else None,
                        "accepted_per_draft": accepted / drafts if drafts else None,
                        "drafters": {k: {f: v.get(f) for f in ("drafts", "draft_tokens", "accepted_tokens")}
                                     for k, v in after.spec_drafters.items()}}
    return {"times": times, "tokens": outs, "info": info}


def child_genai(spec: dict[str, Any], contender: str) -> dict[str, Any]:
    import openvino_genai as og

    B, n = spec["batch"], spec["n_out"]
    props = {"INFERENCE_NUM_THREADS": spec["threads"], "INFERENCE_PRECISION_HINT": spec["precision"],
             "KV_CACHE_PRECISION": spec["precision"]}
    sc = og.SchedulerConfig()
    sc.enable_prefix_caching = False
    sc.max_num_batched_tokens = 512  # dspark's default max_num_batched_tokens
    sc.max_num_seqs = max(B, 1)
    sc.dynamic_split_fuse = True
    cfg = og.GenerationConfig()
    cfg.max_new_tokens = cfg.min_new_tokens = n
    cfg.ignore_eos = True
    cfg.do_sample = bool(spec.get("sample"))
    if spec.get("sample"):
        cfg.temperature, cfg.top_p = spec["sample"]
    extra: dict[str, Any] = {}
    if contender == "genai-lookup":
        extra["prompt_lookup"] = True
        cfg.num_assistant_tokens, cfg.max_ngram_size = spec["lookup_k"], spec["lookup_ngram"]
    elif contender == "genai-draft":
        extra["draft_model"] = og.draft_model(spec["genai_draft"], "CPU", **props)
        cfg.num_assistant_tokens = spec["draft_k"]
    t0 = time.perf_counter()
    if B == 1:
        pipe = og.LLMPipeline(spec["genai_dir"], "CPU", scheduler_config=sc, **extra, **props)
    else:
        pipe = og.ContinuousBatchingPipeline(spec["genai_dir"], sc, "CPU", props)
    load_s = time.perf_counter() - t0
    spec_metrics: list[Any] = []

    def run(prompts: list[list[int]]) -> list[list[int]]:
        if B == 1:
            out = []
            for p in prompts:
                r = pipe.generate(_ids_tensor(p), cfg)
                out.append([int(t) for t in r.tokens[0]])
                spec_metrics.append(getattr(r, "extended_perf_metrics", None))
            return out
        rs = pipe.generate([_ids_tensor(p) for p in prompts], [cfg] * len(prompts))
        return [[int(t) for t in r.m_generation_ids[0]] for r in rs]

    run(spec["warm"])
    spec_metrics.clear()
    times, outs = [], []
    for _ in range(spec["reps"]):
        t0 = time.perf_counter()
        outs = run(spec["prompts"])
        times.append(time.perf_counter() - t0)
    info: dict[str, Any] = {"load_s": load_s, "ov_properties": props, "pipeline": type(pipe).__name__,
                            "scheduler": {"max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": 512,
                                          "enable_prefix_caching": False}}
    if contender in ("genai-lookup", "genai-draft"):
        info["num_assistant_tokens"] = cfg.num_assistant_tokens
        if contender == "genai-lookup":
            info["max_ngram_size"] = cfg.max_ngram_size
        acc = [m.get_num_accepted_tokens() for m in spec_metrics if m is not None and
               hasattr(m, "get_num_accepted_tokens")]
        if acc:
            info["accepted_tokens"] = int(sum(acc))
    return {"times": times, "tokens": outs, "info": info}


def child_llamacpp(spec: dict[str, Any], contender: str) -> dict[str, Any]:
    from llama_cpp import Llama, __version__

    n = spec["n_out"]
    longest = max(len(p) for p in spec["prompts"] + spec["warm"])
    t0 = time.perf_counter()
    llm = Llama(model_path=spec["gguf"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
                n_ctx=longest + n + 16, n_batch=512, seed=0, verbose=False)
    load_s = time.perf_counter() - t0

    def one(prompt: list[int]) -> list[int]:
        llm.reset()  # no prompt-prefix reuse from the previous request
        out: list[int] = []
        for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))  # EOS does not stop generate(); the count does
            if len(out) == n:
                break
        return out

    [one(p) for p in spec["warm"]]
    times, outs = [], []
    for _ in range(spec["reps"]):
        t0 = time.perf_counter()
        outs = [one(p) for p in spec["prompts"]]
        times.append(time.perf_counter() - t0)
    return {"times": times, "tokens": outs,
            "info": {"load_s": load_s, "llama_cpp_python": __version__, "gguf": spec["gguf"],
                     "n_threads": spec["threads"]}}


def child_main(spec_path: str, contender: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    fn = {"dspark": child_dspark, "dspark-deepspec": child_dspark, "genai": child_genai,
          "genai-lookup": child_genai, "genai-draft": child_genai, "llamacpp": child_llamacpp}[contender]
    res = fn(spec, contender)
    bad = [i for i, t in enumerate(res["tokens"]) if len(t) != spec["n_out"]]
    if len(res["tokens"]) != len(spec["prompts"]) or bad:
        res["error"] = (f"expected {len(spec['prompts'])} requests of {spec['n_out']} tokens; got "
                        f"{[len(t) for t in res['tokens']]}")
    print(RESULT + json.dumps(res), flush=True)


# ============================================================ parent: preparation
def genai_dir(model: Path, variant: str, log: Any = print) -> Path:
    """A GenAI model directory for ``model`` (quant_peer.py's export, ``variant`` of its weights); built once."""
    import quant_peer  # benchmarks/quant_peer.py

    xml = quant_peer.export(model)  # cached under benchmarks/out/openvino, keyed by the checkpoint file
    d = GENAI / f"{xml.parent.name}-{variant}"
    if (d / "openvino_detokenizer.xml").exists():
        return d
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    tmp = d.with_name(d.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ov.save_model(quant_peer.load_variant(xml, variant), tmp / "openvino_model.xml", compress_to_fp16=False)
    tok, detok = convert_tokenizer(AutoTokenizer.from_pretrained(str(model), local_files_only=True),
                                   with_detokenizer=True)
    ov.save_model(tok, tmp / "openvino_tokenizer.xml")
    ov.save_model(detok, tmp / "openvino_detokenizer.xml")
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json"):
        if (model / f).exists():
            shutil.copy2(model / f, tmp / f)
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
    log(f"  built {d.relative_to(ROOT)} ({time.perf_counter() - t0:.0f} s)")
    return d


def slices(model: Path, tok: Any, n: int, lengths: list[int], seed: int) -> list[list[int]]:
    """``n`` deterministic slices of the held-out files (benchmarks/engine.py's choice of source)."""
    import random

    from engine import stdlib_files  # benchmarks/engine.py

    files, _ = stdlib_files(model)
    docs = [ids for f in files if len(ids := tok.encode(f.read_text(errors="replace")).ids) > max(lengths) + 1]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        d = rng.choice(docs)
        L = lengths[i % len(lengths)]
        off = rng.randint(0, len(d) - L)
        out.append(d[off:off + L])
    return out


def make_prompts(workload: str, model: Path, tok: Any, quick: bool) -> tuple[list[list[int]], list[list[int]], int]:
    """(timed prompts, warm-up prompts, new tokens per request)."""
    _, _, batch, spec = WORKLOADS[workload]
    if spec:
        from types import SimpleNamespace

        from speculative import make_workloads  # benchmarks/speculative.py's code and edit prompts

        n = 1 if quick else 4
        fake = SimpleNamespace(engine=SimpleNamespace(tokenizer=tok))
        work = make_workloads(fake, model, n, 0)  # type: ignore[arg-type]
        warm = make_workloads(fake, model, n, 0, first=n)  # type: ignore[arg-type]
        return work["code"] + work["edit"], warm["code"] + warm["edit"], 16 if quick else 128
    if batch == 1:
        n = 1 if quick else 4
        return (slices(model, tok, n, [96], seed=1), slices(model, tok, 1, [96], seed=2), 8 if quick else 128)
    lengths = [32, 48, 64, 80, 96, 112, 128]
    return (slices(model, tok, batch, lengths, seed=3), slices(model, tok, batch, lengths, seed=4),
            4 if quick else 64)


def gguf_for(model: Path, precision: str) -> tuple[Path | None, str]:
    """The llama.cpp GGUF of ``model`` at ``precision`` (else f32), or None and why."""
    if not LLAMACPP_PY.exists() or not (LLAMACPP / "READY").exists():
        return None, "not set up (bash benchmarks/llamacpp_setup.sh)"
    for p in dict.fromkeys((precision, "f32")):
        g = LLAMACPP / "gguf" / f"{model.name}-{p}.gguf"
        if g.exists():
            return g, p
    return None, f"no GGUF of {model.name} in {LLAMACPP / 'gguf'}"


def contenders_for(workload: str, has_llamacpp: bool) -> list[str]:
    _, weights, batch, spec = WORKLOADS[workload]
    if spec:
        return list(SPEC_CONTENDERS)
    out = ["dspark", "genai"]
    if batch == 1 and weights == "float" and has_llamacpp:
        out.append("llamacpp")
    return out


def run_child(spec_file: Path, contender: str, timeout: float) -> dict[str, Any]:
    py = str(LLAMACPP_PY) if contender == "llamacpp" else sys.executable
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    if contender == "llamacpp":
        env.pop("PYTHONPATH")  # its own venv; this file imports nothing else at the top
    cmd = [py, str(Path(__file__).resolve()), "--child", contender, "--spec", str(spec_file)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln[len(RESULT):] for ln in done.stdout.splitlines() if ln.startswith(RESULT)]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-12:]
        return {"error": f"rc {done.returncode}: " + "\n".join(tail)}
    return json.loads(lines[-1])


# ============================================================ parent: report
def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    if len(a) != len(b):  # a failed contender's partial output
        return {"identical_requests": 0, "requests": max(len(a), len(b)), "token_match": None}
    pairs = list(zip(a, b, strict=True))  # the same prompts, in order
    same = sum(x == y for x, y in pairs)
    tot = sum(max(len(x), len(y)) for x, y in pairs)
    eq = sum(sum(p == q for p, q in zip(x, y, strict=False)) for x, y in pairs)  # position by position
    return {"identical_requests": same, "requests": len(a), "token_match": eq / tot if tot else None}


def fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds, median reported (default 3)")
    ap.add_argument("--reps", type=int, default=None, help="timed passes per process (default 2, quick 1)")
    ap.add_argument("--quick", action="store_true", help="tiny counts: a smoke test of the script, not a measurement")
    ap.add_argument("--only", default=None, help=f"comma-separated workloads (default all): {', '.join(WORKLOADS)}")
    ap.add_argument("--precision", choices=("bf16", "f32"), default="bf16",
                    help="compute precision of both (GenAI INFERENCE_PRECISION_HINT and KV cache; dspark dtype)")
    ap.add_argument("--threads", type=int, default=2, help="threads of every contender (default 2)")
    ap.add_argument("--decoder", default="auto", help="dspark EngineConfig.decoder: auto | torch | PLUGIN[@DEVICE]")
    ap.add_argument("--model", type=Path, default=MODELS / "stdlib-llama")
    ap.add_argument("--draft", type=Path, default=MODELS / "stdlib-llama-draft",
                    help="GenAI's draft model (dspark's DeepSpec finds the embedded model's own)")
    ap.add_argument("--lookup-k", type=int, default=5, help="GenAI prompt lookup num_assistant_tokens")
    ap.add_argument("--lookup-ngram", type=int, default=3, help="GenAI prompt lookup max_ngram_size")
    ap.add_argument("--draft-k", type=int, default=5, help="GenAI draft model num_assistant_tokens")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per contender process")
    ap.add_argument("--json", type=Path, default=OUT / "vs_openvino_genai.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_main(args.spec, args.child)
        return
    sys.path.insert(0, str(HERE))
    import platform

    import openvino
    import openvino_genai
    import torch
    from tokenizers import Tokenizer

    import rand_model  # benchmarks/rand_model.py

    names = list(WORKLOADS) if not args.only else [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; one of {', '.join(WORKLOADS)}")
    reps = args.reps or (1 if args.quick else 2)
    print(f"machine: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}; openvino {openvino.__version__}, openvino-genai "
          f"{openvino_genai.__version__}, torch {torch.__version__}")
    print(f"precision {args.precision}, {args.threads} thread(s), dspark decoder={args.decoder!r}, {args.rounds} "
          f"round(s) x {reps} timed pass(es){', QUICK (smoke test: not a measurement)' if args.quick else ''}",
          flush=True)

    # ---- preparation: checkpoints, GenAI directories, prompts (all once, before any timing)
    ckpt = {"main": args.model}
    if any(WORKLOADS[w][0] == "rand" for w in names):
        ckpt["rand"] = rand_model.build()
    WORK.mkdir(parents=True, exist_ok=True)
    specs: dict[str, Path] = {}
    plan: dict[str, list[str]] = {}
    meta: dict[str, dict[str, Any]] = {}
    llama_note: dict[str, str] = {}
    for w in names:
        which, weights, batch, spec = WORKLOADS[w]
        model = ckpt[which]
        tok = Tokenizer.from_file(str(model / "tokenizer.json"))  # the engine's own tokenizer file
        prompts, warm, n_out = make_prompts(w, model, tok, args.quick)
        gdir = genai_dir(model, NNCF[weights])
        s: dict[str, Any] = {"workload": w, "model": str(model), "weights": weights, "batch": batch,
                             "n_out": n_out, "prompts": prompts, "warm": warm, "threads": args.threads,
                             "precision": args.precision, "decoder": args.decoder, "reps": reps,
                             "genai_dir": str(gdir), "lookup_k": args.lookup_k, "lookup_ngram": args.lookup_ngram,
                             "draft_k": args.draft_k}
        if spec:
            s["genai_draft"] = str(genai_dir(args.draft, "fp32"))
        if w in SAMPLED:
            s["sample"] = list(SAMPLED[w])
        has_llama = False
        if batch == 1 and weights == "float" and not spec:
            g, why = gguf_for(model, args.precision)
            has_llama = g is not None
            if g is not None:
                s["gguf"] = str(g)
                llama_note[w] = f"GGUF {why}"
            else:
                llama_note[w] = why
        specs[w] = WORK / f"spec-{w}.json"
        specs[w].write_text(json.dumps(s))
        plan[w] = contenders_for(w, has_llama)
        meta[w] = {"model": model.name, "weights": weights, "batch": batch, "n_out": n_out,
                   "requests": len(prompts), "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))]}
        print(f"  {w}: {model.name}, {weights} weights, {len(prompts)} request(s) of {meta[w]['prompt_tokens'][0]}-"
              f"{meta[w]['prompt_tokens'][1]} prompt tokens, {n_out} new each, "
              f"{'one at a time' if batch == 1 else f'{batch} at once'}; contenders {', '.join(plan[w])}",
              flush=True)

    # ---- the rounds: every (workload, contender) process once per round, order rotating
    results: dict[str, dict[str, dict[str, Any]]] = {w: {c: {"times": []} for c in plan[w]} for w in names}
    t_start = time.perf_counter()
    for rnd in range(args.rounds):
        # a workload's contenders back to back (a slow spell falls on all of them), who goes first rotating
        jobs = [(w, c) for w in names for c in plan[w][rnd % len(plan[w]):] + plan[w][:rnd % len(plan[w])]]
        for w, c in jobs:
            r = run_child(specs[w], c, args.timeout)
            slot = results[w][c]
            if "error" in r:
                slot.setdefault("errors", []).append(r["error"])
                print(f"  round {rnd + 1} {w}/{c}: FAILED {r['error'].splitlines()[-1][:300]}", flush=True)
                if "times" not in r:
                    continue
            slot["times"] += r["times"]
            slot["tokens"], slot["info"] = r["tokens"], r["info"]
            tok_s = meta[w]["requests"] * meta[w]["n_out"] / statistics.median(r["times"])
            print(f"  round {rnd + 1} {w}/{c}: {tok_s:,.1f} tok/s", flush=True)
    print(f"total {time.perf_counter() - t_start:.0f} s; load average now "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")

    # ---- report
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for w in names:
        tokens = meta[w]["requests"] * meta[w]["n_out"]
        for c, slot in results[w].items():
            slot["tok_s"] = tokens / statistics.median(slot["times"]) if slot["times"] else None
            if slot.get("errors"):
                problems.append(f"{w}/{c}: {slot['errors'][-1].splitlines()[-1][:300]}")
        pairs = SPEC_ROWS if WORKLOADS[w][3] else PLAIN_ROWS
        for d, p in pairs:
            if p == "llamacpp" and w not in llama_note:
                continue  # llama.cpp is run on one-at-a-time float workloads only
            a, b = results[w].get(d, {}), results[w].get(p, {})
            row: dict[str, Any] = {"workload": w, "dspark": d, "peer": p, "dspark_tok_s": a.get("tok_s"),
                                   "peer_tok_s": b.get("tok_s")}
            if row["dspark_tok_s"] and row["peer_tok_s"]:
                row["ratio"] = row["dspark_tok_s"] / row["peer_tok_s"]
            if a.get("tokens") and b.get("tokens"):
                row["agree"] = agreement(a["tokens"], b["tokens"])
            for f in ("host_ms_per_step", "forward_ms_per_step"):
                if (a.get("info") or {}).get(f) is not None:
                    row[f"dspark_{f}"] = a["info"][f]
            if p == "llamacpp":
                row["note"] = llama_note.get(w, "")
            rows.append(row)

    any_host = any("dspark_host_ms_per_step" in r for r in rows)
    print(f"\ndspark vs OpenVINO GenAI{' and llama.cpp' if any(r.get('peer_tok_s') and r['peer'] == 'llamacpp' for r in rows) else ''}: "
          f"tokens/s (generated tokens / median pass time, prefill included), {args.precision} compute, "
          f"{args.threads} thread(s), {args.rounds} round(s) x {reps} pass(es)"
          f"{'  [QUICK: smoke test, not a measurement]' if args.quick else ''}\n")
    print("| workload | weights | requests | new tokens | dspark | tok/s | peer | tok/s | dspark / peer "
          "| ids agree (requests; tokens) |" + (" dspark host / forward ms per decoder step |" if any_host else ""))
    print("|---|---|---|---|---|---|---|---|---|---|" + ("---|" if any_host else ""))
    for r in rows:
        m = meta[r["workload"]]
        reqs = f"{m['requests']} {'one at a time' if m['batch'] == 1 else 'at once'}"
        peer = {"genai": "GenAI", "genai-lookup": "GenAI prompt lookup", "genai-draft": "GenAI draft model",
                "llamacpp": "llama.cpp"}[r["peer"]]
        if r["peer"] == "llamacpp":
            peer += f" ({r.get('note', '')})"
        ag = r.get("agree")
        ags = "-" if not ag else (f"{ag['identical_requests']}/{ag['requests']}; "
                                  f"{100 * ag['token_match']:.1f}%" if ag["token_match"] is not None else "-")
        ratio = r.get("ratio")
        print(f"| {r['workload']} | {m['weights']} | {reqs} | {m['n_out']} | {r['dspark']} | {fmt(r.get('dspark_tok_s'))} "
              f"| {peer} | {fmt(r.get('peer_tok_s'))} | {'-' if ratio is None else f'{ratio:.2f}'} | {ags} |"
              + (f" {fmt(r.get('dspark_host_ms_per_step'), 3)} / {fmt(r.get('dspark_forward_ms_per_step'), 3)} |"
                 if any_host else ""))
    if not any_host:
        print("\n(dspark's EngineStats has no host_ms_per_step: per-step host time not reported)")
    for w in names:
        for c, slot in results[w].items():
            info = slot.get("info") or {}
            if "spec" in info:
                sp = info["spec"]
                print(f"{w}/{c}: drafted {sp['drafted']} tokens in {sp['drafts']} drafts, accepted {sp['accepted']} "
                      f"({fmt(sp['acceptance'], 2)}; {fmt(sp['accepted_per_draft'], 2)} per draft)")
            if "accepted_tokens" in info:
                print(f"{w}/{c}: accepted {info['accepted_tokens']} drafted tokens (last pass)")
            if c in ("dspark", "dspark-deepspec") and "decoder" in info:
                dec = info["decoder"]
                why = f"{dec.get('chosen')}: {dec.get('reason')}" if isinstance(dec, dict) else dec
                print(f"{w}/{c}: decoder running {info.get('decoder_running', '?')} (failovers "
                      f"{info.get('decoder_failovers', 0)}; choice {why}); torch dtype {info.get('dtype')}")
            own = {"dspark-deepspec": "dspark", "genai-lookup": "genai", "genai-draft": "genai"}.get(c)
            if own and slot.get("tokens") and results[w].get(own, {}).get("tokens"):
                ag = agreement(slot["tokens"], results[w][own]["tokens"])
                slot["agree_with_own_plain"] = ag
                print(f"{w}/{c}: identical to {own}'s plain decoding in {ag['identical_requests']}/{ag['requests']} "
                      f"requests, {fmt(None if ag['token_match'] is None else 100 * ag['token_match'])}% of tokens")

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "config": {"precision": args.precision, "threads": args.threads, "decoder": args.decoder,
                   "rounds": args.rounds, "reps": reps, "quick": args.quick, "model": str(args.model),
                   "draft": str(args.draft), "openvino": openvino.__version__,
                   "openvino_genai": openvino_genai.__version__, "torch": torch.__version__,
                   "lookup": {"num_assistant_tokens": args.lookup_k, "max_ngram_size": args.lookup_ngram},
                   "draft_num_assistant_tokens": args.draft_k, "llamacpp": llama_note},
        "workloads": {w: {**meta[w], "contenders": {c: {k: v for k, v in s.items() if k != "tokens"}
                                                    for c, s in results[w].items()}} for w in names},
        "rows": rows}, indent=2, default=str))
    print(f"\nwrote {args.json}")
    if problems:
        print("\nFAILED:\n  " + "\n  ".join(problems))
        raise SystemExit(1)


if __name__ == "__main__":
    main()
