"""Rich tables for ``dspark bench serve`` results."""

from __future__ import annotations

from rich.table import Table

from dspark.server.loadgen.stats import Dist, Summary


def _f(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def summary_table(s: Summary, title: str = "Load") -> Table:
    t = Table(title=title, title_justify="left", show_header=False)
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("requests sent", str(s.num_requests))
    t.add_row("completed", str(s.completed))
    if s.disconnected:
        t.add_row("disconnected by the client", str(s.disconnected))
    t.add_row("failed", f"[red]{s.failed}[/]" if s.failed else "0")
    for kind, n in s.errors.items():
        t.add_row(f"  {kind}", f"{n}  {s.error_samples.get(kind, '')[:80]}")
    t.add_row("finish reasons", ", ".join(f"{k} {v}" for k, v in s.finish_reasons.items()) or "-")
    if s.length_mismatches:
        t.add_row("[red]token count != finish reason[/]", str(s.length_mismatches))
    t.add_row("duration (s)", _f(s.duration_s, 2))
    t.add_row("request throughput (req/s)", _f(s.request_throughput, 2))
    t.add_row("output token throughput (tok/s)", _f(s.output_token_throughput, 1))
    t.add_row("output tokens", f"{s.total_output_tokens:,}")
    if s.total_prompt_tokens is not None:
        t.add_row("prompt tokens", f"{s.total_prompt_tokens:,}")
    slo = [f"{name} <= {v:g} ms" for name, v in (("TTFT", s.slo_ttft_ms), ("TPOT", s.slo_tpot_ms)) if v is not None]
    t.add_row(f"goodput (req/s, {' and '.join(slo) or 'no SLO set'})",
              f"{_f(s.goodput, 2)}  ({s.slo_met}/{s.completed})")
    return t


def latency_table(s: Summary, title: str = "Latency (ms)") -> Table:
    t = Table(title=title, title_justify="left")
    for col in ("", "mean", "P50", "P90", "P99", "samples"):
        t.add_column(col, justify="right" if col else "left")
    d: Dist
    for name, d in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("e2e", s.e2e_ms)):
        t.add_row(name, _f(d.mean), _f(d.p50), _f(d.p90), _f(d.p99), str(d.n))
    return t
