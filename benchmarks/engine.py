"""LLM engine benchmark (issue 4): dspark vs transformers, continuous vs sequential vs static batching.

Usage: .venv/bin/python benchmarks/engine.py [--quick] [--threads 1] [--dtype float32] [--model DIR]

In one run, on the embedded model (or ``--model``):

(b) total output tokens/s at 1, 8, 32, 64 concurrent requests with mixed
    prompt/output lengths (deterministic slices of held-out stdlib files;
    greedy, ``ignore_eos`` so every request yields exactly its max_tokens).
    Lengths are long-tailed like chat traffic (ShareGPT, vLLM's standard
    serving workload, has about as many output as prompt tokens and a long
    tail of long answers): log-normal, clipped to the ranges printed.
    Level N serves ``--per-level`` x N requests (at least 8) three ways, all on
    the same dspark engine (max_batch_size=N), so only the scheduling differs:
      continuous  all submitted at once to ``LLM.generate``; the engine keeps
                  up to N in flight and refills a slot as soon as one finishes
      static      batches of N, run the way static batching runs them
                  (``transformers`` ``generate`` on a batch, FasterTransformer):
                  a finished request keeps its batch slot, still computing,
                  until the batch's longest request is done, and only then does
                  the next batch start. Emulated on the same engine by giving
                  every request of a batch the batch's largest max_tokens and
                  counting only the tokens the request asked for. Prompts are
                  not padded (that would only make static slower).
      sequential  one ``LLM.generate`` per request
    Continuous and static run once per round (interleaved, median reported);
    the sequential time of each request is measured once, the pool cut into
    shares run between the other runs, and a level's sequential time is the
    sum over its requests. Greedy outputs of the three are compared token by token.
(c) KV fragmentation (``engine.stats().kv_fragmentation``) sampled after every
    engine step of the continuous runs: mean, max, and the last sample with
    pages in use; afterwards every page must be back.
(a) single-request greedy decode, dspark ``LLM.generate`` vs transformers
    ``AutoModelForCausalLM.generate(do_sample=False)`` on the same checkpoint
    and dtype, interleaved rounds; decode tokens/s = (T(n) - T(1)) / (n - 1)
    so prefill is excluded; outputs checked token-identical. Runs after (b), so
    the peak RSS of (d) taken after (b) is dspark's alone (transformers not yet
    imported).
(d) peak RSS (getrusage ru_maxrss) and current RSS (psutil) after each phase.
(e) where the dense parts and attention run, and whether it paid: prefill and
    batch-8 tokens/s of engines that differ only in that: torch alone (MKL
    matmuls, gathered K/V + SDPA), the default (oneDNN-packed projections for
    multi-row steps, the paged attention kernel), and the default with the
    prefill MLP offloaded to another plugin (the
    placer's bids are printed, with what ``dense_offload="auto"`` picks), one
    engine per plugin that bids.
"""

from __future__ import annotations

import argparse
import gc
import os
import hashlib
import math
import random
import resource
import shutil
import tempfile
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from dspark import LLM, SamplingParams
from dspark.llm.api import default_model_path


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


@dataclass
class Req:
    prompt: list[int]
    max_tokens: int


def stdlib_files(model: Path) -> tuple[list[Path], str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    listing = model / "heldout_files.txt"
    if listing.exists():
        files = [root / line.strip() for line in listing.read_text().splitlines() if line.strip()]
        files = [f for f in files if f.exists()]
        if files:
            return files, f"held-out files ({listing.name}, {len(files)} files)"
    return [root / "sysconfig.py", root / "_sysconfigdata__linux_x86_64-linux-gnu.py"], "sysconfig stdlib files"


def long_tailed(rng: random.Random, lo_hi: tuple[int, int]) -> int:
    """Log-normal length with its median at a third of the range's top, clipped to the range."""
    lo, hi = lo_hi
    return max(lo, min(hi, round(rng.lognormvariate(math.log(hi / 3), 0.75))))


def make_pool(llm: LLM, model: Path, n: int, plen: tuple[int, int], olen: tuple[int, int],
              seed: int = 0) -> tuple[list[Req], str]:
    files, source = stdlib_files(model)
    tok = llm.engine.tokenizer
    docs = [ids for f in files if len(ids := tok.encode(f.read_text(errors="replace")).ids) > plen[1] + 1]
    if not docs:
        raise SystemExit(f"no source file of more than {plen[1]} tokens in {source}")
    rng = random.Random(seed)
    pool = []
    for _ in range(n):
        ids = rng.choice(docs)
        p = long_tailed(rng, plen)
        off = rng.randint(0, len(ids) - p)
        pool.append(Req(ids[off : off + p], long_tailed(rng, olen)))
    return pool, source


def params(r: Req) -> SamplingParams:
    return SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)


class Level:
    """One concurrency level: its own engine (max_batch_size=N, KV for N of the longest requests)."""

    def __init__(self, model: Path, dtype: str, n: int, reqs: list[Req], max_len: int) -> None:
        self.n, self.reqs = n, reqs
        self.llm = LLM(model, dtype=dtype, max_batch_size=n, max_total_tokens=max(n * max_len, 2 * max_len))
        eng = self.llm.engine
        self.frag: list[float] = []  # one sample per step with pages in use (continuous runs only)
        self.sampling = False
        orig = eng.step

        def step(**kw):  # wraps the engine's step so LLM.generate runs unchanged
            out = orig(**kw)
            if self.sampling:
                s = eng.stats()
                if s.kv_used_pages:
                    self.frag.append(s.kv_fragmentation)
            return out

        eng.step = step  # type: ignore[method-assign]
        self.tokens = sum(r.max_tokens for r in reqs)
        self.cont_s: list[float] = []
        self.static_s: list[float] = []
        self.outputs: dict[str, list[list[int]]] = {}
        self.preemptions = 0

    def run(self, reqs: list[Req]) -> list[list[int]]:
        outs = self.llm.generate([r.prompt for r in reqs], [params(r) for r in reqs])
        for r, o in zip(reqs, outs):
            assert len(o.token_ids) == r.max_tokens, (len(o.token_ids), r.max_tokens, o.finish_reason)
            self.preemptions += o.num_preemptions
        return [o.token_ids for o in outs]

    def continuous(self) -> None:
        self.sampling = True
        t0 = time.perf_counter()
        out = self.run(self.reqs)
        self.cont_s.append(time.perf_counter() - t0)
        self.sampling = False
        self.outputs["continuous"] = out

    def static(self) -> None:
        t0 = time.perf_counter()
        out: list[list[int]] = []
        for i in range(0, len(self.reqs), self.n):
            batch = self.reqs[i : i + self.n]
            hold = max(r.max_tokens for r in batch)  # every slot is held until the longest is done
            full = self.run([Req(r.prompt, hold) for r in batch])
            out += [o[: r.max_tokens] for o, r in zip(full, batch)]
        self.static_s.append(time.perf_counter() - t0)
        self.outputs["static"] = out


def hf_decode(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()

    def gen(prompt: list[int], n: int) -> list[int]:
        ids = torch.tensor([prompt])
        cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=0, eos_token_id=None,
                               pad_token_id=model.generation_config.pad_token_id, use_cache=True)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
        return out[0, len(prompt):].tolist()

    return gen


def snapshot(src: Path) -> tuple[Path, str]:
    """Copy the checkpoint aside so every phase uses the same files even if a trainer replaces them.

    Retries until no file changed during the copy and none is younger than 2 s (a writer mid-way).
    """
    for _ in range(30):
        files = [f for f in src.iterdir() if f.is_file()]
        before = {f.name: f.stat().st_mtime_ns for f in files}
        if time.time() - max(before.values()) / 1e9 < 2:
            time.sleep(2)
            continue
        dst = Path(tempfile.mkdtemp(prefix="dspark-bench-model-"))
        for f in files:
            shutil.copy2(f, dst / f.name)
        after = {f.name: f.stat().st_mtime_ns for f in src.iterdir() if f.is_file()}
        if after == before:
            digest = hashlib.sha256((dst / "model.safetensors").read_bytes()).hexdigest()[:12]
            return dst, digest
        shutil.rmtree(dst)
    raise SystemExit(f"{src} keeps changing; cannot take a consistent snapshot")


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def dense_paths(model: Path, dtype: str, pool: list[Req], rounds: int) -> None:
    """(e) Where the dense parts and attention run, and whether it paid: the same requests on engines
    that differ only in that. Prefill = each of 8 prompts alone with max_tokens=1; batch 8 = 16
    requests of 32 tokens with up to 8 in flight. Interleaved rounds, medians. These are the torch runner's
    paths: every engine here runs it (``decoder="torch"``), whatever a compiled decoder would do."""
    from dspark.llm.device_map.offload import decide_dense_offload
    from dspark.llm.device_map.torch_layers import host_and_inventory

    prompts = [r.prompt for r in pool[:8]]
    batch = [r.prompt for r in pool[:16]]
    configs: dict[str, dict] = {
        "torch only (gather+SDPA, MKL)": dict(packed_linear="off"),
        "default (paged kernel, oneDNN)": {},
    }
    probe = LLM(model, dtype=dtype, max_batch_size=8, packed_linear="off", decoder="torch")
    host, inv = host_and_inventory("auto")
    dec = decide_dense_offload(probe.engine.runner, host, inv, mode="auto")
    print(f"\n(e) dense offload decision (prefill MLP bids at {dec.bucket} tokens, ms): {dec.bids}; "
          f"auto picks {dec.plugin or 'torch'}: {dec.reason}")
    for other in [b.split("@")[0] for b in sorted(dec.bids, key=dec.bids.get) if not b.startswith("torch@")]:
        configs[f"+ prefill MLP on {other} (dense_offload={other})"] = dict(dense_offload=other)
    del probe
    llms = {}
    for name, kw in configs.items():
        llms[name] = LLM(model, dtype=dtype, max_batch_size=8, decoder="torch", **kw)
        if kw.get("packed_linear") == "off":
            llms[name].engine.runner.attention = "torch"
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    p32 = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    times: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "batch": []} for n in llms}
    outs: dict[str, list[list[int]]] = {}
    for llm in llms.values():  # warm-up (compiles the offloaded executables)
        for p in prompts:
            llm.generate([p], one)
        llm.generate(batch[:8], p32)
    for _ in range(rounds):
        for n, llm in llms.items():
            t0 = time.perf_counter()
            for p in prompts:
                llm.generate([p], one)
            times[n]["prefill"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            outs[n] = [o.token_ids for o in llm.generate(batch, p32)]
            times[n]["batch"].append(time.perf_counter() - t0)
    ptok = sum(len(p) for p in prompts)
    btok = 32 * len(batch)
    ref = next(iter(llms))
    print(f"(e) prefill {len(prompts)} prompts alone ({ptok} tokens), batch 8 = {len(batch)} requests x 32 tokens; "
          f"median of {rounds} interleaved rounds")
    print(f"{'engine':<46} {'prefill tok/s':>13} {'batch-8 tok/s':>13} {'vs torch only':>14}  identical")
    base_p = ptok / med(times[ref]["prefill"])
    base_b = btok / med(times[ref]["batch"])
    for n in llms:
        pt, bt = ptok / med(times[n]["prefill"]), btok / med(times[n]["batch"])
        print(f"{n:<46} {pt:13.1f} {bt:13.1f} {pt / base_p:6.2f} /{bt / base_b:5.2f}  {outs[n] == outs[ref]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=default_model_path())
    ap.add_argument("--dtype", default="float32",
                    help="float32 (default: this CPU has no native bf16 matmul), bfloat16, or auto (= as stored)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads for every contender; 0 = torch's default (all cores). "
                    "Use 1 when the machine is shared: OpenMP spin barriers then cost more than they give")
    ap.add_argument("--quick", action="store_true", help="levels 1/8/32, shorter prompts and outputs")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 2)")
    ap.add_argument("--per-level", type=int, default=2, help="requests served at level N = this x N (at least 8)")
    ap.add_argument("--levels", type=str, default=None, help="comma list, default 1,8,32,64 (quick 1,8,32)")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    quick = args.quick
    levels = [int(x) for x in (args.levels or ("1,8,32" if quick else "1,8,32,64")).split(",")]
    rounds = args.rounds or 2
    plen, olen = ((16, 256), (8, 192)) if quick else ((16, 384), (8, 320))
    dec_tokens = 64 if quick else 128
    dec_rounds = 3 if quick else 5
    dtype_name = args.dtype
    model, digest = snapshot(args.model)
    st = os.stat(model / "model.safetensors")
    print(f"model {args.model}, snapshot in {model} (model.safetensors {st.st_size / 2**20:.1f} MiB, "
          f"sha256 {digest}..., mtime {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(st.st_mtime))})")
    print(f"dtype {dtype_name}; torch {torch.__version__}, intra-op threads {torch.get_num_threads()}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; mode {'quick' if quick else 'full'}")
    phase_rss: list[tuple[str, float, float]] = []

    def mark(what: str) -> None:
        gc.collect()
        phase_rss.append((what, rss_mb(), maxrss_mb()))

    mark("start (torch + dspark imported)")

    # ---------------------------------------------------------------- (b) + (c)
    probe = LLM(model, dtype=dtype_name, max_batch_size=1, max_total_tokens=2048)
    sizes = {n: max(8, args.per_level * n) for n in levels}
    pool, source = make_pool(probe, model, max(sizes.values()), plen, olen)
    del probe
    max_len = plen[1] + olen[1]
    pl = [len(r.prompt) for r in pool]
    ol = [r.max_tokens for r in pool]
    print(f"(b) prompts: {source}; prompt {plen[0]}-{plen[1]} tokens (mean {statistics.fmean(pl):.0f}, median "
          f"{statistics.median(pl):.0f}), max_tokens {olen[0]}-{olen[1]} (mean {statistics.fmean(ol):.0f}, median "
          f"{statistics.median(ol):.0f}), log-normal; ignore_eos, greedy; requests per level {sizes}; "
          f"{rounds} interleaved rounds")
    lv = {n: Level(model, dtype_name, n, pool[: sizes[n]], max_len) for n in levels}
    mark("engines built")
    seq_engine = lv[levels[0]]  # sequential = one request per generate; batch size is irrelevant
    seq_t: dict[int, float] = {}
    seq_out: dict[int, list[int]] = {}
    # warm-up: one small generate on every engine
    for L in lv.values():
        L.run(pool[:1])
    # The sequential pass over the pool is cut into one share per (round, level) slot and run
    # right after that slot's continuous and static runs, so load drift hits all three alike.
    order = list(range(len(pool)))
    slots = rounds * len(levels)
    share = -(-len(order) // slots)
    t_b = time.perf_counter()
    slot = 0
    for rnd in range(rounds):
        for n in levels:
            L = lv[n]
            L.continuous()
            L.static()
            t0 = time.perf_counter()
            mine = order[slot * share : (slot + 1) * share]
            slot += 1
            for i in mine:
                t1 = time.perf_counter()
                seq_out[i] = seq_engine.run([pool[i]])[0]
                seq_t[i] = time.perf_counter() - t1
            print(f"  round {rnd + 1} N={n:<3} continuous {L.cont_s[-1]:7.2f} s  static {L.static_s[-1]:7.2f} s"
                  f"  sequential share ({len(mine)} requests) {time.perf_counter() - t0:6.2f} s", flush=True)
    print(f"(b) took {time.perf_counter() - t_b:.0f} s")
    mark("after (b): dspark only")

    b_rows = []
    mismatch_notes = []
    for n in levels:
        L = lv[n]
        seq_s = sum(seq_t[i] for i in range(sizes[n]))
        c, s = L.tokens / med(L.cont_s), L.tokens / med(L.static_s)
        q = L.tokens / seq_s
        b_rows.append((n, sizes[n], L.tokens, c, s, q))
        ref = [seq_out[i] for i in range(sizes[n])]
        for name in ("continuous", "static"):
            bad = [i for i, (a, b) in enumerate(zip(L.outputs[name], ref)) if a != b]
            if bad:
                i = bad[0]
                j = next(k for k, (x, y) in enumerate(zip(L.outputs[name][i], ref[i])) if x != y)
                mismatch_notes.append(f"N={n} {name}: {len(bad)}/{len(ref)} requests differ from sequential "
                                      f"(first: request {i}, token {j} of {len(ref[i])})")
    frag_all = [f for n in levels for f in lv[n].frag]
    last = lv[levels[-1]]
    eng_last = last.llm.engine
    end = eng_last.stats()
    pages_back = all(lv[n].llm.engine.cache.all_free() for n in levels)
    preempt = {n: lv[n].llm.engine.stats().num_preemptions for n in levels}

    print("\n(b) total output tokens/s (median of rounds; sequential = sum of per-request times)")
    print(f"{'N':>3} {'requests':>8} {'out tok':>7} {'continuous':>10} {'static':>8} {'sequential':>10} "
          f"{'cont/seq':>8} {'cont/static':>11}")
    for n, m, tok, c, s, q in b_rows:
        print(f"{n:>3} {m:>8} {tok:>7} {c:>10.1f} {s:>8.1f} {q:>10.1f} {c / q:>8.2f} {c / s:>11.2f}")
    print("greedy outputs continuous/static vs sequential: "
          + ("all token-identical" if not mismatch_notes else "; ".join(mismatch_notes)))
    print(f"preemptions per level (cumulative over all runs): {preempt}")
    print("prompt tokens prefilled per level (same for all three policies): "
          + ", ".join(f"N={n}: {sum(len(r.prompt) for r in pool[: sizes[n]])}" for n in levels))

    print("\n(c) KV fragmentation (wasted slots in allocated pages / allocated slots), sampled after every step "
          "of the continuous runs")
    print(f"{'N':>3} {'samples':>7} {'mean':>7} {'max':>7} {'last':>7}")
    for n in levels:
        f = lv[n].frag
        print(f"{n:>3} {len(f):>7} {100 * statistics.fmean(f):6.2f}% {100 * max(f):6.2f}% {100 * f[-1]:6.2f}%")
    print(f"all levels: mean {100 * statistics.fmean(frag_all):.2f}%; at the end of (b): last sample with pages "
          f"in use (N={levels[-1]}) {100 * last.frag[-1]:.2f}%, now {end.kv_used_pages} pages used of "
          f"{end.kv_total_pages}; every engine has every page back: {pages_back}")

    # free the engines before (a)
    del lv, seq_engine, L, last, eng_last
    gc.collect()

    # ---------------------------------------------------------------- (a)
    single = LLM(model, dtype=dtype_name, max_batch_size=1, max_total_tokens=2048)
    torch_dtype = single.engine.runner.dtype
    hf = hf_decode(model, torch_dtype)
    mark("transformers model loaded")
    prompt = pool[0].prompt[:64]
    sp = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731

    def ours(n: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        out = single.generate([prompt], sp(n))[0].token_ids
        return time.perf_counter() - t0, out

    def theirs(n: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        out = hf(prompt, n)
        return time.perf_counter() - t0, out

    for f in (ours, theirs):  # warm-up
        f(8)
    res: dict[str, dict[int, list[float]]] = {"dspark": {1: [], dec_tokens: []}, "transformers": {1: [], dec_tokens: []}}
    toks: dict[str, list[int]] = {}
    for _ in range(dec_rounds):
        for name, f in (("dspark", ours), ("transformers", theirs)):
            for n in (1, dec_tokens):
                t, out = f(n)
                res[name][n].append(t)
                if n == dec_tokens:
                    toks[name] = out
    mark("after (a)")
    print(f"\n(a) single request, prompt {len(prompt)} tokens, {dec_tokens} greedy tokens, dtype {torch_dtype}, "
          f"median of {dec_rounds} interleaved rounds")
    print(f"{'engine':<13} {'T(1) s':>8} {f'T({dec_tokens}) s':>9} {'end-to-end tok/s':>16} {'decode tok/s':>12}")
    dec = {}
    for name in res:
        t1, tn = med(res[name][1]), med(res[name][dec_tokens])
        dec[name] = (dec_tokens - 1) / (tn - t1)
        print(f"{name:<13} {t1:8.4f} {tn:9.3f} {dec_tokens / tn:16.1f} {dec[name]:12.1f}")
    a, b = toks["dspark"], toks["transformers"]
    same = a == b
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    print(f"outputs token-identical: {same}" + ("" if same else f" (lengths {len(a)}/{len(b)}, first differing "
                                                           f"token at {first})"))

    # ---------------------------------------------------------------- (e)
    del hf, single
    gc.collect()
    dense_paths(model, dtype_name, pool, rounds=3)

    # ---------------------------------------------------------------- (d)
    print("\n(d) memory (MiB): RSS now / peak RSS so far, after each phase")
    for what, r, p in phase_rss:
        print(f"  {what:<36} {r:8.0f} {p:8.0f}")

    print("\nratios")
    print(f"{'what':<46} {'dspark':>9} {'peer':>9} {'ratio':>7} {'target':>8}")
    print(f"{'(a) decode tok/s vs transformers generate':<46} {dec['dspark']:9.1f} {dec['transformers']:9.1f} "
          f"{dec['dspark'] / dec['transformers']:7.2f} {'>= 1.5':>8}")
    for n, m, tok, c, s, q in b_rows:
        tgt = ">= 5" if n == 32 else ""
        print(f"{f'(b) N={n} continuous vs sequential tok/s':<46} {c:9.1f} {q:9.1f} {c / q:7.2f} {tgt:>8}")
    for n, m, tok, c, s, q in b_rows:
        tgt = ">= 2" if n == 32 else ""
        print(f"{f'(b) N={n} continuous vs static tok/s':<46} {c:9.1f} {s:9.1f} {c / s:7.2f} {tgt:>8}")
    print(f"{'(c) KV fragmentation, mean during (b)':<46} {100 * statistics.fmean(frag_all):8.2f}% "
          f"{'':>9} {'':>7} {'< 4%':>8}")
    print(f"{'(c) KV fragmentation, last sample of (b)':<46} {100 * frag_all[-1]:8.2f}% {'':>9} {'':>7} {'< 4%':>8}")
    print(f"{'(d) peak RSS after (b), dspark only (MiB)':<46} {dict((w, pk) for w, _, pk in phase_rss)['after (b): dspark only']:9.0f}")
    print(f"{'(d) peak RSS, whole run incl. transformers':<46} {maxrss_mb():9.0f}")
    sys.stdout.flush()
    shutil.rmtree(model, ignore_errors=True)


if __name__ == "__main__":
    main()
