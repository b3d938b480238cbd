"""dspark (``decoder=auto``) against llama.cpp alone and against llama.cpp's own server, on GGUF files.

Usage: bash scripts/setup.sh                      (the llamacpp plugin and llama-cpp-python, built natively)
       bash benchmarks/llamacpp_server.sh         (llama-server from the same llama.cpp source; ~10 min, once)
       .venv/bin/python benchmarks/vs_llamacpp.py [--rounds 3] [--quick] [--only single,serve8,serve32,spec]
                                                  [--models embedded-bf16,...] [--threads 2] [--dtype auto]

Files (written once under benchmarks/out/llamacpp/files): the embedded model (core/dspark/assets/models/
stdlib-llama) as BF16 (the llamacpp plugin's converter), Q8_0 and Q4_K_M (llama.cpp's own quantizer from an
F32 file); a seeded random-weight Llama of about 0.5B parameters (hidden 1536, 20 layers, 12 heads, 4 KV
heads, vocab 8192: the embedded model's tokenizer) as Q4_K_M and Q8_0, where the weights dominate a step;
the embedded draft model (stdlib-llama-draft) as BF16 for the speculation row.

Workloads (``--only``):

  single   one request at a time, greedy, 128 new tokens (4 prompts of 96 tokens from the held-out files):
           dspark's ``LLMEngine.from_model(file, decoder="auto")`` against llama.cpp alone (llama-cpp-python's C API
           driven directly: one ``llama_decode`` per token, numpy argmax), same file and threads
  serve8   8 / 32 requests at once (64 new tokens each, prompts of 32-128 tokens) through ``dspark serve``
  serve32  and through ``llama-server`` (``-np`` = the batch, continuous batching), each its own process,
           hit by the same asyncio client (streaming ``/v1/completions`` with token-id prompts,
           ``ignore_eos``): output tokens/s over the wall time of the batch and the median time to the first
           streamed token
  checkpoint  dspark alone on safetensors checkpoints (the embedded model; the 0.5B random one): the RSS a
           started engine holds and its peak, against the checkpoint's weight bytes on disk
  spec     one request at a time, 128 new tokens, the code prompts of benchmarks/speculative.py: dspark
           serve with DeepSpec (its default drafters; the embedded draft model among them) against
           llama-server's draft-model speculation (``-md`` the same draft model, ``--spec-type draft-simple``,
           ``--spec-draft-n-max 8``), on the
           embedded model only (the random model has no draft)

Settings on both sides: ``--threads`` (llama.cpp ``n_threads`` = ``n_threads_batch``, dspark's torch
threads, which the llamacpp plugin's contexts take), the KV cache as the llamacpp plugin holds it for the
dtype dspark computes the file in (f32 for float32, f16 for bfloat16; llama-server ``-ctk``/``-ctv`` the
same) and flash attention as the plugin runs it for that KV (on over f16, off over f32; llama-server
``-fa on|off``),
greedy, EOS ignored. llama.cpp's extra CPU buffer types (repacked weights): the plugin repacks for
engines of up to 8 sequences, on AMX CPUs for every engine where its AMX probe passes (the plugin's
README), llama.cpp alone as the plugin would for one sequence,
llama-server by its default (on; ``--no-repack`` where the plugin never repacks). Every contender runs in
a process of its own (OpenMP workers spin between calls); processes alternate, ``--rounds`` rounds, who
goes first rotating. Peak RSS is the process's VmHWM (servers: read before they are stopped); load time is the process start to the first token it can serve
(a dspark start measures the decoder targets once per model and caches the timings, as a user's warm
start does: the first round's start is the cold one, its figures are reported beside).
Ratios are dspark / peer (> 1: dspark better for speed; < 1 better for memory and load time).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "out" / "llamacpp"
FILES = OUT / "files"
MODELS = ROOT / "core" / "dspark" / "assets" / "models"
RAND = HERE / "out" / "models" / "random-0.5b"
ROWS = {"embedded-bf16": "stdlib-llama-bf16.gguf", "embedded-q8_0": "stdlib-llama-q8_0.gguf",
        "embedded-q4_k_m": "stdlib-llama-q4_k_m.gguf", "random-0.5b-q4_k_m": "random-0.5b-q4_k_m.gguf",
        "random-0.5b-q8_0": "random-0.5b-q8_0.gguf"}
DRAFT = "stdlib-llama-draft-bf16.gguf"
REPACK = True  # llama-server repacks (its default) unless the plugin never does here (main() decides)


# -- files ---------------------------------------------------------------------------------------------
def _gguf_of(checkpoint: Path, dtype: str) -> Path:
    """The llamacpp plugin's GGUF of a checkpoint (written by the engine's own start on that target)."""
    from dspark.llm.engine import LLMEngine

    e = LLMEngine.from_model(checkpoint, dtype=dtype, decoder="llamacpp", max_batch_size=1, max_total_tokens=256)
    if e.stats().decoder != "llamacpp@cpu":
        raise SystemExit(f"the llamacpp plugin did not take {checkpoint}: {e.decoder_choice}")
    return Path(e.runner.current.compiled.model.path)


def _random_checkpoint() -> Path:
    if (RAND / "model.safetensors").exists():
        return RAND
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=1536, intermediate_size=4096, num_hidden_layers=20,
                                   num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024,
                                   bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    RAND.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(RAND, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (MODELS / "stdlib-llama" / f).exists():
            shutil.copy(MODELS / "stdlib-llama" / f, RAND / f)
    return RAND


def prepare(log: Any = print) -> None:
    from dspark_llamacpp import runtime

    FILES.mkdir(parents=True, exist_ok=True)

    def put(name: str, make: Any) -> None:
        if not (FILES / name).exists():
            log(f"writing {name}")
            tmp = FILES / (name + ".tmp")
            make(tmp)
            tmp.rename(FILES / name)

    put("stdlib-llama-f32.gguf", lambda p: shutil.copy(_gguf_of(MODELS / "stdlib-llama", "float32"), p))
    put("stdlib-llama-bf16.gguf", lambda p: shutil.copy(_gguf_of(MODELS / "stdlib-llama", "bfloat16"), p))
    put(DRAFT, lambda p: shutil.copy(_gguf_of(MODELS / "stdlib-llama-draft", "bfloat16"), p))
    for t in ("q8_0", "q4_k_m"):
        put(f"stdlib-llama-{t}.gguf", lambda p, t=t: runtime.quantize(FILES / "stdlib-llama-f32.gguf", p, t.upper()))
    if not all((FILES / f"random-0.5b-{t}.gguf").exists() for t in ("q8_0", "q4_k_m")):
        put("random-0.5b-bf16.gguf", lambda p: shutil.copy(_gguf_of(_random_checkpoint(), "bfloat16"), p))
        for t in ("q8_0", "q4_k_m"):
            put(f"random-0.5b-{t}.gguf", lambda p, t=t: runtime.quantize(FILES / "random-0.5b-bf16.gguf", p, t.upper()))


# -- prompts ----------------------------------------------------------------------------------------------
def prompts(workload: str, quick: bool) -> tuple[list[list[int]], list[list[int]], int]:
    """Token-id prompts from the held-out files (as benchmarks/vs_openvino_genai.py cuts them)."""
    from tokenizers import Tokenizer

    sys.path.insert(0, str(HERE))
    from vs_openvino_genai import make_prompts

    tok = Tokenizer.from_file(str(MODELS / "stdlib-llama" / "tokenizer.json"))
    genai_name = {"single": "single", "serve8": "batch8", "serve32": "batch32", "spec": "spec"}[workload]
    return make_prompts(genai_name, MODELS / "stdlib-llama", tok, quick)  # (timed, warm-up, new tokens)


# -- children ----------------------------------------------------------------------------------------------
def _rss_mb(field: str = "VmHWM") -> float:
    """This process's peak (VmHWM) or current (VmRSS) resident set; getrusage's ru_maxrss would carry the
    parent's peak across exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child_dspark_single(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    torch.set_num_threads(spec["threads"])
    from dspark.llm.engine import LLMEngine
    from dspark.llm.sampling import SamplingParams

    base = _rss_mb("VmRSS")  # the interpreter and the libraries imported: what loading the model adds comes after
    t0 = time.perf_counter()
    e = LLMEngine.from_model(spec["file"], dtype=spec.get("dtype", "auto"), decoder="auto", max_batch_size=1,
                             max_total_tokens=1024)
    load = time.perf_counter() - t0
    params = SamplingParams(max_tokens=spec["new"], temperature=0, ignore_eos=True)
    e.add_request("warm", spec["warm"], params)
    while e.has_unfinished():  # untimed, the warm-up llama.cpp alone gets: first-touch of buffers
        e.step()
    times, outs = [], []
    for i, p in enumerate(spec["prompts"]):
        t = time.perf_counter()
        e.add_request(str(i), p, params)
        while e.has_unfinished():
            for o in e.step():
                if o.finished:
                    outs.append(o.token_ids)
        times.append(time.perf_counter() - t)
    n = sum(len(o) for o in outs)
    return {"tok_s": n / sum(times), "load_s": load, "peak_rss_mb": _rss_mb(), "base_rss_mb": base,
            "decoder": e.stats().decoder, "tokens": outs}


def child_dspark_checkpoint(spec: dict[str, Any]) -> dict[str, Any]:
    """dspark's start on a safetensors checkpoint (decoder=auto): what it holds once loaded, and at its peak."""
    import torch

    torch.set_num_threads(spec["threads"])
    from dspark.llm.engine import LLMEngine
    from dspark.llm.sampling import SamplingParams

    base = _rss_mb("VmRSS")
    t0 = time.perf_counter()
    e = LLMEngine.from_model(spec["file"], dtype=spec.get("dtype", "auto"), decoder="auto", max_batch_size=1,
                             max_total_tokens=1024)
    load = time.perf_counter() - t0
    e.add_request("r", spec["warm"], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    while e.has_unfinished():
        e.step()
    weights = sum(f.stat().st_size for f in Path(spec["file"]).glob("*.safetensors"))
    return {"load_s": load, "peak_rss_mb": _rss_mb(), "rss_mb": _rss_mb("VmRSS"), "base_rss_mb": base,
            "weight_mb": weights / 2**20, "decoder": e.stats().decoder, "dtype": str(e.runner.dtype)}


def child_llamacpp_single(spec: dict[str, Any]) -> dict[str, Any]:
    import ctypes

    import numpy as np

    from llama_cpp import llama_cpp as C

    base = _rss_mb("VmRSS")
    t0 = time.perf_counter()

    quiet = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda *a: None)  # kept alive
    C.llama_log_set(quiet, None)
    C.llama_backend_init()
    mp = C.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.use_extra_bufts = spec["extra_bufts"]  # as the plugin loads it (decided in the parent: no dspark import here)
    model = C.llama_model_load_from_file(spec["file"].encode(), mp)
    cp = C.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 1024, 512, 512, 1
    cp.n_threads = cp.n_threads_batch = spec["threads"]
    cp.type_k = cp.type_v = KV_TYPES[spec["kv_dtype"]][1]
    cp.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_ENABLED if spec["flash_attn"] else C.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = C.llama_init_from_model(model, cp)
    mem = C.llama_get_memory(ctx)
    n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))
    load = time.perf_counter() - t0
    times, outs = [], []
    for i, p in enumerate([spec["warm"], *spec["prompts"]]):  # the first, untimed: first-touch of buffers
        C.llama_memory_clear(mem, True)
        t = time.perf_counter()
        arr = (C.llama_token * len(p))(*p)
        C.llama_decode(ctx, C.llama_batch_get_one(arr, len(p)))
        out = []
        for _ in range(spec["new"]):
            logits = np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            tok = int(logits.argmax())
            out.append(tok)
            one = (C.llama_token * 1)(tok)
            C.llama_decode(ctx, C.llama_batch_get_one(one, 1))
        if i:
            times.append(time.perf_counter() - t)
            outs.append(out)
    n = sum(len(o) for o in outs)
    return {"tok_s": n / sum(times), "load_s": load, "peak_rss_mb": _rss_mb(), "base_rss_mb": base, "tokens": outs}


# -- servers ------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _vmhwm_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


DECODE_RUN_MS: float | None = None  # --decode-run-ms
BATCHED_TOKENS: int | None = None  # --max-num-batched-tokens
DTYPE = "auto"  # --dtype: dspark's dtype (serve's model.dtype; the engine's one at a time)
KV_TYPES = {"float32": ("f32", 0), "float16": ("f16", 1)}  # llama.cpp's name and ggml type of a KV dtype
RETRIES = [0]  # requests sent again after the server closed their connection unanswered (_one)


def kv_dtype(file: str) -> str:
    """What the llamacpp plugin holds K and V in for ``file`` under ``--dtype`` (the engine's dtype for a GGUF
    file: float32, else float16): llama.cpp alone and llama-server are given the same (the cpu plugin holds
    a bfloat16 engine's in bfloat16, the same bytes)."""
    from dspark.llm.gguf import block_types, load_gguf, tensor_dtype
    from dspark_llamacpp import kv_dtype as plugin_kv

    g = load_gguf(file, tensors=False)
    return plugin_kv(str(tensor_dtype(g.cfg, DTYPE, blocks=block_types(g.stored))).removeprefix("torch."))


def flash_attn(kv: str) -> bool:
    """Whether the llamacpp plugin runs llama.cpp's flash attention over K and V held in ``kv``: the peers do
    the same."""
    from dspark_llamacpp import flash_attn as plugin_fa

    return bool(plugin_fa(kv))


def _start_server(kind: str, file: str, batch: int, threads: int, spec: bool,
                  kv: str = "float32") -> tuple[subprocess.Popen[bytes], int, str]:
    port = _free_port()
    if kind == "dspark":
        cfg = {"model": {"path": file, "name": "m", "dtype": DTYPE},
               "server": {"host": "127.0.0.1", "port": port},
               "engine": {"max_total_tokens": 8192, "max_model_len": 1024, "decoder": "auto",
                          "continuous_batching": {"max_batch_size": batch,
                                                  **({} if DECODE_RUN_MS is None else {"decode_run_ms": DECODE_RUN_MS}),
                                                  **({} if BATCHED_TOKENS is None
                                                     else {"max_num_batched_tokens": BATCHED_TOKENS})},
                          "speculative_decoding": {"enabled": spec}},
               "resources": {"cpu_cores_per_worker": threads, "enable_metrics": False},
               "observability": {"stats_log_interval_s": 0, "access_log": False}}
        path = OUT / f"serve-{port}.json"
        path.write_text(json.dumps(cfg))  # YAML is a superset of JSON
        cmd = [sys.executable, "-m", "dspark.cli", "serve", "--config", str(path), "--log-level", "WARNING"]
    else:
        binary = OUT / "server-build" / "bin" / "llama-server"
        cmd = [str(binary), "-m", file, "--port", str(port), "--host", "127.0.0.1", "-t", str(threads), "-tb",
               str(threads), "-c", str(1024 * batch), "-np", str(batch), "-ctk", KV_TYPES[kv][0], "-ctv",
               KV_TYPES[kv][0], "-fa", "on" if flash_attn(kv) else "off",
               "-b", "512", "-ub", "512", "--no-webui"] + ([] if REPACK else ["--no-repack"])
        if spec:
            cmd += ["-md", str(FILES / DRAFT), "--spec-type", "draft-simple", "--spec-draft-n-max", "8",
                    "--spec-draft-n-min", "0", "-ctkd", KV_TYPES[kv][0], "-ctvd", KV_TYPES[kv][0]]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(OUT / f"server-{kind}-{port}.log", "wb"))
    return proc, port, "/health"


async def _wait_ready(port: int, path: str, proc: subprocess.Popen[bytes], deadline_s: float = 600) -> None:
    import httpx

    end = time.monotonic() + deadline_s
    async with httpx.AsyncClient() as c:
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
            try:
                r = await c.get(f"http://127.0.0.1:{port}{path}", timeout=2)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"server on {port} not ready within {deadline_s} s")


async def _one(client: Any, port: int, prompt: list[int], new: int) -> tuple[float, float, int]:
    import httpx

    body = {"model": "m", "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, toks = None, 0
    for attempt in (1, 2):
        try:
            async with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                                     timeout=600) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    if ttft is None and d.get("choices") and d["choices"][0].get("text"):
                        ttft = time.perf_counter() - t0
                    if d.get("usage"):
                        toks = int(d["usage"]["completion_tokens"])
            break
        except httpx.RemoteProtocolError:
            # A kept-alive connection the server closed as the request went out (llama-server's HTTP layer does,
            # one slot and requests queued): nothing was answered, so it is sent once more, its clock running.
            if attempt == 2 or ttft is not None:
                raise
            RETRIES[0] += 1
    return ttft or (time.perf_counter() - t0), time.perf_counter() - t0, toks or new


async def _batch(port: int, ps: list[list[int]], new: int, client: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    res = await asyncio.gather(*[_one(client, port, p, new) for p in ps])
    wall = time.perf_counter() - t0
    return {"tok_s": sum(r[2] for r in res) / wall, "ttft_ms": statistics.median(r[0] for r in res) * 1e3,
            "tokens": sum(r[2] for r in res)}


def _limits() -> Any:
    import httpx

    return httpx.Limits(max_connections=64, max_keepalive_connections=64)


async def _timed(port: int, warm: list[list[int]], ps: list[list[int]], new: int,
                 one_at_a_time: bool) -> dict[str, Any]:
    """The warm-up batch, then the timed one(s), on one client whose connections the warm-up opened: a request
    timed on a new connection waited for its connect, and its send for the client's loop, busy reading the
    streams already answered (a server that streams its first tokens early paid for it in TTFT)."""
    import httpx

    async with httpx.AsyncClient(limits=_limits()) as c:
        await _batch(port, warm, 8, c)  # warm-up: first-touch, DeepSpec's online models, the connections
        # The client's own full collections walk everything this process imported, a pause that would land in
        # either server's TTFT: none while timed.
        gc.collect()
        gc.freeze()
        gc.disable()
        try:
            if one_at_a_time:
                t = time.perf_counter()
                n = 0
                for p in ps:
                    n += (await _batch(port, [p], new, c))["tokens"]
                return {"tok_s": n / (time.perf_counter() - t)}
            return await _batch(port, ps, new, c)
        finally:
            gc.enable()


def run_server_contender(kind: str, file: str, ps: list[list[int]], new: int, batch: int, threads: int,
                         spec: bool, warm: list[list[int]], kv: str = "float32") -> dict[str, Any]:
    t0 = time.perf_counter()
    RETRIES[0] = 0  # this contender's own
    proc, port, health = _start_server(kind, file, batch, threads, spec, kv)
    try:
        asyncio.run(_wait_ready(port, health, proc))
        load = time.perf_counter() - t0
        out = asyncio.run(_timed(port, warm, ps, new, spec))  # spec: one request at a time
        out["load_s"] = load
        if RETRIES[0]:
            out["retries"] = RETRIES[0]
        out["peak_rss_mb"] = _vmhwm_mb(proc.pid)
        if kind == "dspark":  # what the server's engine chose by its timings (and still runs: no failover)
            import httpx

            h = httpx.get(f"http://127.0.0.1:{port}{health}", timeout=30).json()
            out["decoder"] = h["decoder"] + (f" (after {h['decoder_failovers']} failovers)" if h["decoder_failovers"]
                                             else "")
        return out
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


# -- the run ----------------------------------------------------------------------------------------------
def run_child(contender: str, spec: dict[str, Any]) -> dict[str, Any]:
    f = OUT / f"spec-{os.getpid()}.json"
    f.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, __file__, "--child", contender, "--spec", str(f)], capture_output=True,
                          text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{contender} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="single,serve8,serve32,spec,checkpoint")
    ap.add_argument("--models", default=",".join(ROWS))
    ap.add_argument("--quick", action="store_true", help="a smoke test of the script, not a measurement")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="dspark serve's engine.continuous_batching.max_num_batched_tokens (default: the engine's)")
    ap.add_argument("--decode-run-ms", type=float, default=None,
                    help="dspark serve's engine.continuous_batching.decode_run_ms (default: the engine's; 0 = no greedy runs)")
    ap.add_argument("--dtype", default="auto",
                    help="dspark's dtype (serve's model.dtype; default: the engine's choice)")
    ap.add_argument("--child")
    ap.add_argument("--spec")
    args = ap.parse_args()
    if args.child:
        spec = json.loads(Path(args.spec).read_text())
        fn = {"dspark": child_dspark_single, "llamacpp": child_llamacpp_single,
              "checkpoint": child_dspark_checkpoint}[args.child]
        print(json.dumps(fn(spec)))
        return
    prepare()
    have_server = (OUT / "server-build" / "bin" / "llama-server").exists()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    from dspark_llamacpp.runtime import extra_bufts

    global REPACK, DECODE_RUN_MS, BATCHED_TOKENS, DTYPE
    DECODE_RUN_MS = args.decode_run_ms
    DTYPE = args.dtype
    BATCHED_TOKENS = args.max_num_batched_tokens
    # llama.cpp alone loads one sequence's model as the plugin would; llama-server repacks (its default) unless
    # the plugin never does here (an AMX build that faults, or DSPARK_LLAMACPP_EXTRA_BUFTS=0): --no-repack then.
    extra = REPACK = extra_bufts(1)
    print(f"llama.cpp's extra CPU buffer types (repacked weights), one sequence: {'on' if extra else 'off'}",
          flush=True)
    work = [w for w in args.only.split(",") if w]
    models = [m for m in args.models.split(",") if m]
    for r in range(1 if args.quick else args.rounds):
        for w in work:
            if w == "checkpoint":  # dspark alone: its memory against the checkpoint's weight bytes
                for name, ckpt in (("embedded", MODELS / "stdlib-llama"), ("random-0.5b", _random_checkpoint())):
                    res = run_child("checkpoint", {"file": str(ckpt), "warm": list(range(5, 69)), "dtype": DTYPE,
                                                   "threads": args.threads})
                    results.setdefault(f"checkpoint/{name}", {}).setdefault("dspark", []).append(res)
                    print(f"round {r + 1} checkpoint/{name}: " + ", ".join(
                        f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in res.items()), flush=True)
                continue
            ps, warm, new = prompts(w, args.quick)
            for m in (["embedded-bf16"] if w == "spec" else models):
                file = str(FILES / ROWS[m])
                kv = kv_dtype(file)
                key = f"{w}/{m}"
                sides = ["dspark", "llamacpp" if w == "single" else "llama-server"]
                if w != "single" and not have_server:
                    continue
                for side in (sides if r % 2 == 0 else sides[::-1]):
                    if w == "single":
                        res = run_child(side, {"file": file, "prompts": ps, "warm": warm[0], "new": new,
                                               "threads": args.threads, "extra_bufts": extra, "dtype": DTYPE,
                                               "kv_dtype": kv, "flash_attn": flash_attn(kv)})
                    else:
                        batch = 1 if w == "spec" else int(w.removeprefix("serve"))
                        res = run_server_contender("dspark" if side == "dspark" else "llama", file, ps, new, batch,
                                                   args.threads, w == "spec", warm[:4], kv)
                    results.setdefault(key, {}).setdefault(side, []).append(res)
                    print(f"round {r + 1} {key} {side} (KV {kv}): " + ", ".join(
                        f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in res.items()
                        if k not in ("tokens",)), flush=True)
    report(results)


def report(results: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    def med(rows: list[dict[str, Any]], k: str) -> float | None:
        v = [x[k] for x in rows if x.get(k) is not None]
        return statistics.median(v) if v else None

    lines = ["| row | dspark tok/s | peer tok/s | ratio | dspark / peer median TTFT ms | dspark / peer peak RSS MB | "
             "dspark / peer RSS added by the model MB | dspark / peer load s | dspark decoder | greedy tokens equal |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    out: dict[str, Any] = {}
    ckpt = [(k, v["dspark"]) for k, v in results.items() if k.startswith("checkpoint/")]
    for key, sides in results.items():
        if key.startswith("checkpoint/"):
            continue
        d, p = sides.get("dspark", []), next((v for k, v in sides.items() if k != "dspark"), [])
        a, b = med(d, "tok_s"), med(p, "tok_s")
        same = ""
        if d and p and isinstance(d[0].get("tokens"), list) and isinstance(p[0].get("tokens"), list):
            same = "yes" if d[0]["tokens"] == p[0]["tokens"] else "no"
        ttft = f"{med(d, 'ttft_ms') or 0:.0f} / {med(p, 'ttft_ms') or 0:.0f}" if med(d, "ttft_ms") else "-"
        rss = f"{med(d, 'peak_rss_mb') or 0:.0f} / {med(p, 'peak_rss_mb') or 0:.0f}"
        load = f"{med(d, 'load_s') or 0:.2f} / {med(p, 'load_s') or 0:.2f}"
        added = "-"
        if d and "base_rss_mb" in d[0] and p and "base_rss_mb" in p[0]:
            da = statistics.median(x["peak_rss_mb"] - x["base_rss_mb"] for x in d)
            pa = statistics.median(x["peak_rss_mb"] - x["base_rss_mb"] for x in p)
            added = f"{da:.0f} / {pa:.0f}"
        dec = d[0].get("decoder", "-") if d else "-"
        ratio = f"{a / b:.2f}" if a and b else "-"
        lines.append(f"| {key} | {a or 0:.0f} | {b or 0:.0f} | {ratio} | {ttft} | {rss} | {added} | {load} | {dec} | {same} |")
        out[key] = {"dspark": d, "peer": p}
    if ckpt:
        lines += ["", "| checkpoint (safetensors) | weights on disk MB | dspark dtype | RSS added once loaded MB | "
                  "peak RSS added MB | loaded / weight bytes | peak / weight bytes | load s | dspark decoder |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for key, rows in ckpt:
            w = rows[0]["weight_mb"]
            held = statistics.median(x["rss_mb"] - x["base_rss_mb"] for x in rows)
            peak = statistics.median(x["peak_rss_mb"] - x["base_rss_mb"] for x in rows)
            lines.append(f"| {key} | {w:.0f} | {rows[0]['dtype']} | {held:.0f} | {peak:.0f} | {held / w:.2f} | "
                         f"{peak / w:.2f} | {med(rows, 'load_s') or 0:.1f} | {rows[0]['decoder']} |")
            out[key] = {"dspark": rows}
    print("\n".join(lines))
    (OUT / "vs_llamacpp.json").write_text(json.dumps({k: {s: [{kk: vv for kk, vv in x.items() if kk != "tokens"}
                                                             for x in v] for s, v in sides.items()}
                                                     for k, sides in out.items()}, indent=1))


if __name__ == "__main__":
    main()
