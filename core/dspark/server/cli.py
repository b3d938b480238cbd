"""``dspark serve`` / ``dspark-server`` / ``python -m dspark.server``: one command, three names.

Two servers behind it: an ``.onnx`` model (``dspark serve MODEL.onnx``, ``--model X.onnx``, or a config
that lists ``models:``) is served over the Open Inference Protocol (:mod:`dspark.server.oip`,
docs/serving-models.md); anything else starts the OpenAI-compatible LLM server, as it always has.

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
    model_path: Annotated[str | None, typer.Argument(
        metavar="MODEL", help="An .onnx file to serve over the Open Inference Protocol (KServe v2 / Triton, REST "
        "and gRPC); a checkpoint directory or .gguf file serves the LLM (as --model).", show_default=False)] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config (see examples/server_config.yaml; "
                                                "examples/oip_config.yaml for .onnx models).", dir_okay=False)] = None,
    host: Annotated[str | None, typer.Option(help="Bind address (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="API port; 0 = any free port (default 8000).")] = None,
    model: Annotated[str | None, typer.Option(
        help="Checkpoint directory or .gguf file; 'default' = the embedded model; an .onnx file = as MODEL.")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="Model id clients send (default directory name).")] = None,
    max_batch_size: Annotated[int | None, typer.Option(
        help="Sequences per step at most; for an .onnx MODEL: its max_batch_size (dynamic batching; default 0, "
        "no batching).")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="Prompt + output tokens per sequence.")] = None,
    max_total_tokens: Annotated[int | None, typer.Option(help="KV cache budget in tokens.")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Prometheus /metrics port (default 9090; 8002 for an .onnx model).")] = None,
    no_metrics: Annotated[bool, typer.Option("--no-metrics", help="Do not open the metrics port.")] = False,
    api_key: Annotated[str | None, typer.Option(envvar="DSPARK_API_KEY", show_envvar=True,
                                                help="Require 'Authorization: Bearer KEY' (/v1; every OIP route but health).")] = None,
    dtype: Annotated[str | None, typer.Option(help="auto | float32 | bfloat16 | float16.")] = None,
    cpu_cores: Annotated[int | None, typer.Option(help="torch intra-op threads (resources.cpu_cores_per_worker).")] = None,
    replicas: Annotated[int | None, typer.Option(
        help="Serve through Ray Serve with this many engine replicas (cluster.replicas).")] = None,
    ray_address: Annotated[str | None, typer.Option(
        help="Join this Ray cluster (host:port, or 'auto'); default: start a local Ray (cluster.ray_address).")] = None,
    log_level: Annotated[str, typer.Option(envvar="DSPARK_LOG_LEVEL", help="DEBUG | INFO | WARNING | ERROR.")] = "INFO",
    grpc_port: Annotated[int | None, typer.Option(
        help="OIP (.onnx) only: gRPC port; 0 = any free port (default 8001).")] = None,
    max_queue_delay_us: Annotated[int | None, typer.Option(
        help="OIP (.onnx) only: dynamic batching's max_queue_delay_microseconds (with --max-batch-size).")] = None,
) -> None:
    """Serve an LLM over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions), or an .onnx
    model over the Open Inference Protocol (KServe v2 / Triton: REST and gRPC, dynamic batching)."""
    from dspark.host import log
    from dspark.server.config import ConfigError, load_config

    if log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        typer.echo(f"error: --log-level: expected DEBUG, INFO, WARNING, ERROR or CRITICAL, got {log_level!r}", err=True)
        raise typer.Exit(2)
    log.configure(level=log_level)
    if model_path is not None and not model_path.lower().endswith(".onnx"):
        if model is not None:
            typer.echo(f"error: MODEL {model_path!r} and --model {model!r}: give one", err=True)
            raise typer.Exit(2)
        model, model_path = model_path, None
    if model_path is None and model is not None and model.lower().endswith(".onnx"):
        model_path, model = model, None
    if model_path is not None or _is_oip_config(config):
        llm_only = dict(served_model_name=served_model_name, max_model_len=max_model_len, dtype=dtype, model=model,
                        max_total_tokens=max_total_tokens, cpu_cores=cpu_cores, replicas=replicas,
                        ray_address=ray_address)
        given = [f"--{k.replace('_', '-')}" for k, v in llm_only.items() if v is not None]
        if given:
            typer.echo(f"error: {', '.join(given)}: LLM server option(s), not for an .onnx model", err=True)
            raise typer.Exit(2)
        _serve_oip(model_path, config, host=host, port=port, grpc_port=grpc_port, metrics_port=metrics_port,
                   no_metrics=no_metrics, api_key=api_key, max_batch_size=max_batch_size,
                   max_queue_delay_us=max_queue_delay_us)
        return
    if grpc_port is not None or max_queue_delay_us is not None:
        typer.echo("error: --grpc-port and --max-queue-delay-us apply to an .onnx model (Open Inference Protocol) "
                   "only", err=True)
        raise typer.Exit(2)
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


def _is_oip_config(config: Path | None) -> bool:
    """A config for the OIP server (it lists ``models:``); unreadable files are left to the LLM path's errors."""
    if config is None:
        return False
    from dspark.server.config import ConfigError, read_yaml_mapping
    from dspark.server.oip.config import is_oip_config

    try:
        return is_oip_config(read_yaml_mapping(config))
    except ConfigError:
        return False


def _serve_oip(model_path: str | None, config: Path | None, *, host: str | None, port: int | None,
               grpc_port: int | None, metrics_port: int | None, no_metrics: bool, api_key: str | None,
               max_batch_size: int | None, max_queue_delay_us: int | None) -> None:
    from dspark.server.config import ConfigError
    from dspark.server.oip.config import load_oip_config, single_model
    from dspark.server.oip.model import ModelLoadError

    overrides = dict(host=host, port=port, grpc_port=grpc_port, api_key=api_key,
                     metrics_port=False if no_metrics else metrics_port)
    try:
        if model_path is None and (max_batch_size is not None or max_queue_delay_us is not None):
            raise ConfigError("--max-batch-size and --max-queue-delay-us apply to a MODEL given on the command "
                              "line; set them per model in the config's models: list")
        entry = single_model(model_path, max_batch_size, max_queue_delay_us) if model_path is not None else None
        cfg = load_oip_config(config, overrides=overrides, model=entry)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    from dspark.server.oip.launch import serve as run_oip

    try:
        run_oip(cfg)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except ModelLoadError as e:  # the model does not fit its config (e.g. batching a fixed first dim)
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    except (OSError, ValueError) as e:  # at startup: a port already taken
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None


def main(argv: list[str] | None = None) -> None:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(serve)
    name = os.path.basename(sys.argv[0])
    app(args=argv, prog_name=name if name.startswith("dspark") else "dspark-server")


if __name__ == "__main__":
    main()
