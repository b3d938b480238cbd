"""Per-request measurements of ``dspark bench serve`` and their summary (percentiles, goodput).

Pure functions only, so the arithmetic is unit-tested without a server.
Latencies are kept in seconds internally and reported in milliseconds.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

QUANTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """What one request did, as seen by the client."""

    index: int
    max_tokens: int
    ok: bool = False  # the stream ended normally ([DONE] after a finish_reason)
    disconnected: bool = False  # the client closed the connection on purpose mid-stream
    error: str | None = None  # kind, e.g. "http_422", "timeout", "read_error"; None if ok or disconnected
    detail: str = ""  # first bytes of the error body, for the report
    start_s: float = 0.0  # send time, relative to the start of the run
    ttft_s: float | None = None  # send -> first non-empty text chunk
    e2e_s: float | None = None  # send -> end of stream
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive non-empty chunks
    chunks: int = 0  # non-empty text chunks received
    output_tokens: int = 0  # usage.completion_tokens if the server sent it, else ``chunks``
    prompt_tokens: int | None = None
    usage_reported: bool = False
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; undefined below two tokens."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def length_mismatch(self) -> bool:
        """A completed request cut by max_tokens must have exactly max_tokens; one stopped early, fewer."""
        if not self.ok:
            return False
        if self.finish_reason == "length":
            return self.output_tokens != self.max_tokens
        return self.output_tokens > self.max_tokens


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's default method)."""
    if not xs:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    s = sorted(xs)
    h = (len(s) - 1) * q / 100
    lo = math.floor(h)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (h - lo) * (s[hi] - s[lo])


@dataclass
class Dist:
    """Mean and percentiles of one latency, in ms; all None when nothing was measured."""

    n: int = 0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of_seconds(cls, xs: Sequence[float]) -> Dist:
        if not xs:
            return cls()
        ms = [x * 1e3 for x in xs]
        return cls(len(ms), sum(ms) / len(ms), *(percentile(ms, q) for q in QUANTILES))


@dataclass
class Summary:
    num_requests: int
    completed: int
    disconnected: int
    failed: int
    errors: dict[str, int]
    finish_reasons: dict[str, int]
    length_mismatches: int  # completed requests whose token count contradicts their finish_reason
    duration_s: float
    request_throughput: float  # completed requests / s
    output_token_throughput: float  # output tokens of completed requests / s
    total_output_tokens: int
    total_prompt_tokens: int | None
    ttft_ms: Dist
    tpot_ms: Dist
    itl_ms: Dist
    e2e_ms: Dist
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    slo_met: int  # completed requests within both targets (a target not set always holds)
    goodput: float  # slo_met / duration_s
    error_samples: dict[str, str] = field(default_factory=dict)  # one body excerpt per error kind

    def to_json_dict(self) -> dict[str, Any]:
        return asdict(self)


def meets_slo(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if not r.ok or r.ttft_s is None:
        return False
    if slo_ttft_ms is not None and r.ttft_s * 1e3 > slo_ttft_ms:
        return False
    tpot = r.tpot_s
    # A one-token answer has no TPOT; only its TTFT can miss.
    return slo_tpot_ms is None or tpot is None or tpot * 1e3 <= slo_tpot_ms


def summarize(results: Sequence[RequestResult], duration_s: float, *,
              slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> Summary:
    done = [r for r in results if r.ok]
    errors = Counter(r.error for r in results if r.error is not None)
    samples: dict[str, str] = {}
    for r in results:
        if r.error is not None and r.error not in samples:
            samples[r.error] = r.detail
    dur = max(duration_s, 1e-9)
    tokens = sum(r.output_tokens for r in done)
    prompt = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    met = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in done)
    return Summary(
        num_requests=len(results),
        completed=len(done),
        disconnected=sum(r.disconnected for r in results),
        failed=sum(r.error is not None for r in results),
        errors=dict(sorted(errors.items())),
        finish_reasons=dict(sorted(Counter(str(r.finish_reason) for r in done).items())),
        length_mismatches=sum(r.length_mismatch for r in done),
        duration_s=duration_s,
        request_throughput=len(done) / dur,
        output_token_throughput=tokens / dur,
        total_output_tokens=tokens,
        total_prompt_tokens=sum(prompt) if len(prompt) == len(done) and done else None,
        ttft_ms=Dist.of_seconds([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot_ms=Dist.of_seconds([t for r in done if (t := r.tpot_s) is not None]),
        itl_ms=Dist.of_seconds([g for r in done for g in r.itl_s]),
        e2e_ms=Dist.of_seconds([r.e2e_s for r in done if r.e2e_s is not None]),
        slo_ttft_ms=slo_ttft_ms,
        slo_tpot_ms=slo_tpot_ms,
        slo_met=met,
        goodput=met / dur,
        error_samples=samples,
    )
