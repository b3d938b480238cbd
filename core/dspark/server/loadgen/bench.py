"""Load generator for an OpenAI-compatible server (``dspark bench serve``).

Streams every request (``stream: true`` with ``stream_options.include_usage``)
over httpx/asyncio and times it from the client side:

* TTFT: send -> first chunk carrying non-empty text
* ITL: gaps between consecutive non-empty chunks
* TPOT: (e2e - TTFT) / (output tokens - 1)
* e2e: send -> end of stream

Output tokens come from the usage chunk; without one, non-empty chunks are
counted (a chunk may then hold more or less than one token).

Closed loop (``concurrency``): that many clients, each sending its next
request when the previous one ends. Open loop (``request_rate``): Poisson
arrivals, seeded; ``concurrency`` then caps the requests in flight.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dspark.server.loadgen.stats import RequestResult, Summary, summarize


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    max_tokens: int
    # Request fields of this request alone (logprobs, penalties, response_format ...), over LoadConfig.extra_body.
    extra_body: dict[str, Any] | None = field(default=None, compare=False, hash=False)


def load_dataset(path: Path) -> list[BenchRequest]:
    """JSONL, one ``{"prompt": str, "max_tokens": int, "extra_body"?: {...}}`` per line; blank lines ignored."""
    reqs: list[BenchRequest] = []
    from dspark.host.jsonl import iter_objects

    for n, obj in iter_objects(path):
        if not isinstance(obj.get("prompt"), str):
            raise ValueError(f"{path}:{n}: expected an object with a string 'prompt'")
        mt = obj.get("max_tokens", 16)
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise ValueError(f"{path}:{n}: max_tokens must be a positive integer, got {mt!r}")
        extra = obj.get("extra_body")
        if extra is not None and not isinstance(extra, dict):
            raise ValueError(f"{path}:{n}: extra_body must be an object of request fields, got {extra!r}")
        reqs.append(BenchRequest(obj["prompt"], mt, extra))
    if not reqs:
        raise ValueError(f"{path}: no requests")
    return reqs


def _model_dir() -> Path:
    # dspark.llm.api.default_model_path(), without importing torch (seconds) into a load generator.
    return Path(__file__).resolve().parents[2] / "assets" / "models" / "stdlib-llama"


@functools.lru_cache(maxsize=4)
def _source_docs(min_tokens: int) -> tuple[tuple[str, tuple[tuple[int, int], ...]], ...]:
    """(text, token offsets) of each held-out stdlib file with more than ``min_tokens`` tokens."""
    from tokenizers import Tokenizer

    model = _model_dir()
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    root = Path(sysconfig.get_paths()["stdlib"])
    listing = model / "heldout_files.txt"
    names = [ln.strip() for ln in listing.read_text().splitlines() if ln.strip()] if listing.exists() else []
    files = sorted(root / nm for nm in names if (root / nm).is_file()) or [root / "sysconfig.py"]
    # The head of a file is plenty to cut prompts from and keeps tokenizing well under a second.
    texts = [f.read_text(errors="replace")[:_MAX_DOC_CHARS] for f in files]
    encs = tok.encode_batch(texts, add_special_tokens=False)
    return tuple((t, tuple(e.offsets)) for t, e in zip(texts, encs) if len(e.offsets) > min_tokens)


_MAX_DOC_CHARS = 24_000


def default_workload(n: int, *, seed: int = 0, prompt_tokens: tuple[int, int] = (16, 256),
                     max_tokens: tuple[int, int] = (8, 128)) -> list[BenchRequest]:
    """``n`` requests cut from the embedded model's held-out stdlib files: mixed lengths, seeded.

    Prompt lengths are drawn in tokens of the embedded model's tokenizer and cut
    at token boundaries, so the text is an exact substring of a source file.
    """
    docs = _source_docs(prompt_tokens[1])
    if not docs:
        raise ValueError(f"no held-out source file has more than {prompt_tokens[1]} tokens")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text, offsets = rng.choice(docs)
        p = rng.randint(*prompt_tokens)
        start = rng.randint(0, len(offsets) - p)
        out.append(BenchRequest(text[offsets[start][0]:offsets[start + p - 1][1]], rng.randint(*max_tokens)))
    return out


@dataclass
class LoadConfig:
    url: str  # server base URL, with or without a trailing /v1
    model: str | None = None  # None: the first of GET /v1/models
    concurrency: int | None = 8  # closed loop; with request_rate, the cap on requests in flight
    request_rate: float | None = None  # requests/s, Poisson arrivals (open loop)
    chat: bool = False  # /v1/chat/completions instead of /v1/completions
    seed: int = 0
    disconnect_fraction: float = 0.0  # share of requests whose client hangs up mid-stream
    temperature: float = 0.0
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request body
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    api_key: str | None = None  # sent as "Authorization: Bearer KEY"

    def __post_init__(self) -> None:
        if self.concurrency is None and self.request_rate is None:
            raise ValueError("give a concurrency (closed loop) or a request_rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if not 0.0 <= self.disconnect_fraction <= 1.0:
            raise ValueError(f"disconnect_fraction must be in [0, 1], got {self.disconnect_fraction}")

    @property
    def base(self) -> str:
        u = self.url.rstrip("/")
        return u[:-3] if u.endswith("/v1") else u


@dataclass
class RunResult:
    config: LoadConfig
    model: str
    results: list[RequestResult]
    duration_s: float

    def summary(self) -> Summary:
        return summarize(self.results, self.duration_s,
                         slo_ttft_ms=self.config.slo_ttft_ms, slo_tpot_ms=self.config.slo_tpot_ms)


def disconnect_plan(reqs: Sequence[BenchRequest], fraction: float, seed: int) -> list[int | None]:
    """Per request: None, or how many non-empty chunks to read before hanging up (0 = right after the headers).

    Seeded apart from the workload, so the same requests can be replayed with and without disconnects.
    """
    rng = random.Random(f"disconnect-{seed}")
    return [rng.randrange(r.max_tokens) if rng.random() < fraction else None for r in reqs]


async def fetch_model(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError("the server lists no models at /v1/models")
    return str(data[0]["id"])


def _body(cfg: LoadConfig, model: str, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": cfg.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    body.update(cfg.extra_body)
    body.update(req.extra_body or {})
    return body


def _chunk_text(obj: dict[str, Any], chat: bool) -> tuple[str, str | None]:
    text, finish = "", None
    for ch in obj.get("choices") or []:
        piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
        text += piece or ""
        finish = ch.get("finish_reason") or finish
    return text, finish


async def one_request(client: httpx.AsyncClient, cfg: LoadConfig, model: str, req: BenchRequest,
                      index: int, t_run: float, hang_up_after: int | None = None) -> RequestResult:
    """Send one streaming request and time it; never raises (errors are recorded by kind)."""
    res = RequestResult(index=index, max_tokens=req.max_tokens)
    t0 = time.perf_counter()
    res.start_s = t0 - t_run
    try:
        async with asyncio.timeout(cfg.timeout_s):
            done = await _stream(client, cfg, model, req, res, t0, hang_up_after)
    except (TimeoutError, httpx.TimeoutException) as e:
        res.error, res.detail = "timeout", repr(e)[:300]
        return res
    except httpx.ConnectError as e:
        res.error, res.detail = "connect", repr(e)[:300]
        return res
    except httpx.HTTPError as e:  # reset, protocol error, server gone mid-stream
        res.error, res.detail = "read_error", repr(e)[:300]
        return res
    except Exception as e:  # noqa: BLE001  (a malformed chunk must cost one request, not the run)
        res.error, res.detail = "client_error", repr(e)[:300]
        return res
    if res.error is not None or res.disconnected:
        return res
    res.e2e_s = time.perf_counter() - t0
    if not done or res.finish_reason is None:
        res.error = "incomplete"
        res.detail = f"stream ended without {'[DONE]' if not done else 'a finish_reason'}"
        return res
    if not res.usage_reported:
        res.output_tokens = res.chunks
    res.ok = True
    return res


async def _stream(client: httpx.AsyncClient, cfg: LoadConfig, model: str, req: BenchRequest, res: RequestResult,
                  t0: float, hang_up_after: int | None) -> bool:
    """Read one SSE response into ``res``; True once ``[DONE]`` arrived. Returning early closes the connection."""
    path = "/v1/chat/completions" if cfg.chat else "/v1/completions"
    last: float | None = None
    async with client.stream("POST", path, json=_body(cfg, model, req)) as resp:
        if resp.status_code != 200:
            res.error = f"http_{resp.status_code}"
            res.detail = (await resp.aread())[:300].decode(errors="replace")
            return False
        if hang_up_after == 0:
            res.disconnected = True  # before any chunk is read
            return False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return True
            try:
                obj = json.loads(data)
            except json.JSONDecodeError:
                obj = None
            if not isinstance(obj, dict):
                res.error, res.detail = "bad_chunk", data[:300]
                return False
            if "error" in obj:
                res.error, res.detail = "stream_error", data[:300]
                return False
            text, finish = _chunk_text(obj, cfg.chat)
            now = time.perf_counter()
            if text:
                if last is None:
                    res.ttft_s = now - t0
                else:
                    res.itl_s.append(now - last)
                last = now
                res.chunks += 1
            res.finish_reason = finish or res.finish_reason
            usage = obj.get("usage")
            if isinstance(usage, dict):
                res.usage_reported = True
                res.output_tokens = int(usage.get("completion_tokens", 0))
                res.prompt_tokens = usage.get("prompt_tokens")
            if hang_up_after is not None and res.chunks >= hang_up_after and res.finish_reason is None:
                res.disconnected = True
                return False
    return False


async def run_load(cfg: LoadConfig, reqs: Sequence[BenchRequest],
                   on_result: Callable[[RequestResult], None] | None = None,
                   transport: httpx.AsyncBaseTransport | None = None) -> RunResult:
    """Serve ``reqs`` (in order of dispatch) against ``cfg.url``; returns results in request order.

    ``transport`` replaces the network (tests of the client's parsing against canned responses).
    """
    hang = disconnect_plan(reqs, cfg.disconnect_fraction, cfg.seed)
    width = cfg.concurrency or len(reqs) or 1
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 30.0))
    results: list[RequestResult | None] = [None] * len(reqs)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    async with httpx.AsyncClient(base_url=cfg.base, limits=limits, timeout=timeout, transport=transport,
                                 headers=headers) as client:
        model = cfg.model or await fetch_model(client)
        t_run = time.perf_counter()

        async def go(i: int) -> None:
            r = await one_request(client, cfg, model, reqs[i], i, t_run, hang[i])
            results[i] = r
            if on_result is not None:
                on_result(r)

        if cfg.request_rate is None:
            nxt = iter(range(len(reqs)))

            async def worker() -> None:
                for i in nxt:  # shared iterator: each client takes the next unsent request
                    await go(i)

            await asyncio.gather(*(worker() for _ in range(min(width, len(reqs)))))
        else:
            rng = random.Random(f"arrivals-{cfg.seed}")
            gate = asyncio.Semaphore(width)

            async def gated(i: int) -> None:
                async with gate:
                    await go(i)

            tasks = []
            due = 0.0
            for i in range(len(reqs)):
                await asyncio.sleep(max(0.0, t_run + due - time.perf_counter()))
                tasks.append(asyncio.create_task(gated(i)))
                due += rng.expovariate(cfg.request_rate)
            await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_run
    return RunResult(cfg, model, [r for r in results if r is not None], duration)


def run(cfg: LoadConfig, reqs: Sequence[BenchRequest], *, progress: bool = False,
        description: str = "requests") -> RunResult:
    """Blocking wrapper around :func:`run_load`, with an optional rich progress bar on stderr."""
    if not progress:
        return asyncio.run(run_load(cfg, reqs))
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[errs]} errors"), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=len(reqs), errs=0)
        errs = 0

        def tick(r: RequestResult) -> None:
            nonlocal errs
            errs += r.error is not None
            bar.update(task, advance=1, errs=errs)

        return asyncio.run(run_load(cfg, reqs, tick))
