"""``dspark bench ...``: load generation against a running server (registered on the main app)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from dspark.cli.app import app, err, out

bench = typer.Typer(no_args_is_help=True, help="Benchmarks against a running dspark (or any OpenAI-compatible) server.")
app.add_typer(bench, name="bench")


def _range(spec: str, what: str) -> tuple[int, int]:
    lo, _, hi = spec.partition("-")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise typer.BadParameter(f"{what}: want N or MIN-MAX, got {spec!r}") from None
    if not 1 <= a <= b:
        raise typer.BadParameter(f"{what}: want 1 <= MIN <= MAX, got {spec!r}")
    return a, b


@bench.command("serve")
def serve(
    url: Annotated[str, typer.Option(help="Server base URL (ignored with --sweep, which starts its own).")]
        = "http://127.0.0.1:8000",
    concurrency: Annotated[int | None, typer.Option(
        help="Closed loop: clients each sending their next request when the last ends. "
             "With --request-rate: the cap on requests in flight. Default 8 without --request-rate.")] = None,
    num_requests: Annotated[int | None, typer.Option(
        help="Requests to send (default: the whole --dataset, else 100).")] = None,
    request_rate: Annotated[float | None, typer.Option(help="Open loop: Poisson arrivals at this many requests/s.")]
        = None,
    dataset: Annotated[Path | None, typer.Option(
        help='JSONL, one {"prompt": ..., "max_tokens": ...} per line (cycled to --num-requests). '
             "Default: slices of the embedded model's held-out stdlib files.")] = None,
    prompt_tokens: Annotated[str, typer.Option(help="Default workload: prompt length range in tokens, MIN-MAX.")]
        = "16-256",
    max_tokens: Annotated[str, typer.Option(help="Default workload: max_tokens range, MIN-MAX.")] = "8-128",
    model: Annotated[str | None, typer.Option(help="Model name (default: the first of /v1/models).")] = None,
    seed: Annotated[int, typer.Option(help="Seeds the workload, the arrivals and the disconnects.")] = 0,
    slo_ttft_ms: Annotated[float | None, typer.Option(help="Goodput target: time to first token, ms.")] = None,
    slo_tpot_ms: Annotated[float | None, typer.Option(help="Goodput target: time per output token, ms.")] = None,
    disconnect_fraction: Annotated[float, typer.Option(
        help="Share of requests whose client hangs up at a random point mid-stream (seeded).")] = 0.0,
    chat: Annotated[bool, typer.Option("--chat", help="Use /v1/chat/completions instead of /v1/completions.")]
        = False,
    extra_body: Annotated[str | None, typer.Option(
        help='JSON object merged into every request body, e.g. \'{"temperature": 0.8}\'.')] = None,
    timeout: Annotated[float, typer.Option(help="Per-request timeout, s.")] = 600.0,
    api_key: Annotated[str | None, typer.Option(envvar="DSPARK_API_KEY", show_envvar=True,
                                                help="Sent as 'Authorization: Bearer KEY'.")] = None,
    sweep: Annotated[str | None, typer.Option(
        help="NAME=V1,V2,...: start a server per value (e.g. max_batch_size=1,4,16,64), run the same load on "
             "each, write sweep.csv and the throughput-vs-P99 plot sweep.png to --out.")] = None,
    config: Annotated[Path | None, typer.Option(help="Server config file for the servers --sweep starts.")] = None,
    out_dir: Annotated[Path, typer.Option("--out", help="Output directory for --sweep.")] = Path("bench-out"),
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Load-test an OpenAI-compatible server: throughput, TTFT/TPOT/ITL/e2e percentiles, goodput, errors."""
    from dspark.server.loadgen.bench import LoadConfig, default_workload, load_dataset, run
    from dspark.server.loadgen.report import latency_table, summary_table

    if concurrency is None and request_rate is None:
        concurrency = 8
    body: dict[str, Any] = {}
    if extra_body:
        try:
            body = json.loads(extra_body)
        except json.JSONDecodeError as e:
            raise typer.BadParameter(f"--extra-body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise typer.BadParameter("--extra-body must be a JSON object")
    try:
        cfg = LoadConfig(url=url, model=model, concurrency=concurrency, request_rate=request_rate, chat=chat,
                         seed=seed, disconnect_fraction=disconnect_fraction, timeout_s=timeout, extra_body=body,
                         slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms, api_key=api_key)
        if dataset is not None:
            pool = load_dataset(dataset)
            n = num_requests or len(pool)
            reqs = [pool[i % len(pool)] for i in range(n)]
        else:
            reqs = default_workload(num_requests or 100, seed=seed, prompt_tokens=_range(prompt_tokens, "--prompt-tokens"),
                                    max_tokens=_range(max_tokens, "--max-tokens"))
    except (ValueError, OSError) as e:
        err.print(f"[red]error:[/] {e}")
        raise typer.Exit(2) from None
    show = not as_json and err.is_terminal

    if sweep is not None:
        from dspark.server.loadgen.sweep import parse_sweep, sweep as run_sweep

        try:
            param, values = parse_sweep(sweep)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None

        def row_done(row: Any, res: Any) -> None:
            if not as_json:
                s = row.summary
                err.print(f"{param}={row.value}: {s.output_token_throughput:.1f} tok/s, "
                          f"P99 e2e {s.e2e_ms.p99 or float('nan'):.0f} ms, P99 TTFT {s.ttft_ms.p99 or float('nan'):.0f} ms, "
                          f"{s.failed} failed")

        try:
            rows = run_sweep(param, values, cfg, reqs, out_dir, config=config, progress=show, on_row=row_done)
        except RuntimeError as e:
            err.print(f"[red]error:[/] {e}")
            raise typer.Exit(1) from None
        if as_json:
            print(json.dumps({"param": param, "csv": str(out_dir / "sweep.csv"), "plot": str(out_dir / "sweep.png"),
                              "rows": [{"value": r.value, **r.summary.to_json_dict()} for r in rows]}, indent=2))
        else:
            for r in rows:
                out.print(summary_table(r.summary, f"{param}={r.value}"))
                out.print(latency_table(r.summary))
            out.print(f"wrote {out_dir / 'sweep.csv'} and {out_dir / 'sweep.png'}")
        if not any(r.summary.completed for r in rows):
            raise typer.Exit(1)
        return

    try:
        res = run(cfg, reqs, progress=show)
    except Exception as e:  # noqa: BLE001  (unreachable server, no model listed): a message, not a traceback
        err.print(f"[red]error:[/] {type(e).__name__}: {e}")
        raise typer.Exit(1) from None
    s = res.summary()
    if as_json:
        print(json.dumps({"url": cfg.base, "model": res.model, "concurrency": cfg.concurrency,
                          "request_rate": cfg.request_rate, **s.to_json_dict()}, indent=2))
    else:
        mode = f"request rate {request_rate:g}/s" if request_rate else f"concurrency {concurrency}"
        out.print(summary_table(s, f"{res.model} at {cfg.base}, {mode}"))
        out.print(latency_table(s))
    if s.completed == 0:
        raise typer.Exit(1)
