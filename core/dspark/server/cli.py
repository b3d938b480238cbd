"""``dspark serve`` / ``dspark-server`` / ``python -m dspark.server``: one command, three names.

Module level stays light (typer only): ``dspark --help`` imports this, and the
config model, the engine, torch and uvicorn load only when a server starts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer


def serve(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config (see examples/server_config.yaml).",
                                                dir_okay=False)] = None,
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="API port; 0 = any free port (default 8000).")] = None,
    model: Annotated[str | None, typer.Option(
        help="Checkpoint directory or .gguf file; 'default' = the embedded model.")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="Model id clients send (default directory name).")] = None,
    max_batch_size: Annotated[int | None, typer.Option(help="Sequences per step at most.")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Prompt + output tokens per sequence.")] = None,
    max_total_tokens: Annotated[int | None, typer.Option(help="KV cache budget in tokens.")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Prometheus /metrics port (default 9090).")] = None,
    no_metrics: Annotated[bool, typer.Option("--no-metrics", help="Do not open the metrics port.")] = False,
    api_key: Annotated[str | None, typer.Option(envvar="DSPARK_API_KEY", show_envvar=True,
                                                help="Require 'Authorization: Bearer KEY' on /v1.")] = None,
    dtype: Annotated[str | None, typer.Option(help="auto | float32 | bfloat16 | float16.")] = None,
    cpu_cores: Annotated[int | None, typer.Option(help="torch intra-op threads (resources.cpu_cores_per_worker).")] = None,
    replicas: Annotated[int | None, typer.Option(
        help="Serve through Ray Serve with this many engine replicas (cluster.replicas).")] = None,
    ray_address: Annotated[str | None, typer.Option(
        help="Join this Ray cluster (host:port, or 'auto'); default: start a local Ray (cluster.ray_address).")] = None,
    log_level: Annotated[str, typer.Option(envvar="DSPARK_LOG_LEVEL", help="DEBUG | INFO | WARNING | ERROR.")] = "INFO",
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    from dspark.host import log
    from dspark.server.config import ConfigError, load_config

    if log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        typer.echo(f"error: --log-level: expected DEBUG, INFO, WARNING, ERROR or CRITICAL, got {log_level!r}", err=True)
        raise typer.Exit(2)
    log.configure(level=log_level)
    overrides = dict(host=host, port=port, model=model, served_model_name=served_model_name,
                     max_batch_size=max_batch_size, max_model_len=max_model_len, max_total_tokens=max_total_tokens,
                     metrics_port=metrics_port, enable_metrics=False if no_metrics else None, api_key=api_key,
                     dtype=dtype, cpu_cores=cpu_cores, replicas=replicas, ray_address=ray_address)
    try:
        cfg = load_config(config, overrides)
        cfg.engine_config()  # engine-level checks too, before anything loads
    except (ConfigError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    path = cfg.model_path()
    if not (path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf")):
        typer.echo(f"error: model.path: no checkpoint directory or .gguf file at {path}", err=True)
        raise typer.Exit(2)
    if cfg.cluster.enabled:
        import importlib.util

        if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
            typer.echo("error: cluster: serving on Ray needs Ray Serve; install it with "
                       "pip install 'dspark[cluster]'", err=True)
            raise typer.Exit(2)
        from dspark.server.cluster.deploy import serve_cluster as run
    else:
        from dspark.server.launch import serve as run

    try:
        run(cfg)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except (OSError, ValueError) as e:  # at startup: a bad checkpoint or draft model, a port already taken
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None


def main(argv: list[str] | None = None) -> None:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(serve)
    name = os.path.basename(sys.argv[0])
    app(args=argv, prog_name=name if name.startswith("dspark") else "dspark-server")


if __name__ == "__main__":
    main()
