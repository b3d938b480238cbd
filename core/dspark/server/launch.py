"""Start the server from a validated config: engine, metrics endpoint, uvicorn on a pre-bound socket."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from typing import Any

from dspark.host import progress
from dspark.host.log import get_logger
from dspark.server.config import ServerConfig

log = get_logger("dspark.server")


class _ToStructlog(logging.Handler):
    """uvicorn logs through the stdlib; send it through structlog too, so every line has one format."""

    def emit(self, record: logging.LogRecord) -> None:
        fields: dict[str, Any] = {"logger": record.name}
        if record.exc_info and record.exc_info[0] is not None:
            fields["exception"] = "".join(traceback.format_exception(*record.exc_info))
        level = record.levelname.lower() if record.levelname.lower() in ("debug", "info", "warning", "error",
                                                                          "critical") else "info"
        getattr(log, level)(record.getMessage(), **fields)


def _route_stdlib_logs() -> None:
    handler = _ToStructlog()
    for name in ("uvicorn", "uvicorn.error", "uvicorn.asgi"):
        lg = logging.getLogger(name)
        lg.handlers, lg.propagate = [handler], False
        lg.setLevel(logging.WARNING)  # its INFO lines ("Started server process") repeat ours


def _bind(host: str, port: int) -> socket.socket:
    # Bound here, not by uvicorn, so port 0 works and the log names the real port.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048)
    sock.set_inheritable(True)
    return sock


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _log_scheduler(cfg: ServerConfig, drafters: list[str] | None) -> str | None:
    """Log what scheduling is used; returns the speculative strategy in effect (None = off). ``drafters``:
    the engine's (``EngineLayout.drafters``; None: it drafts nothing)."""
    e = cfg.engine
    spec = e.speculative_decoding
    strategy = spec.strategy if spec.active else None
    if strategy is not None:
        log.info("Initializing DeepSpec scheduler..." if strategy == "deepspec" else "Initializing speculative decoding...",
                 strategy=strategy, draft_model=spec.draft_model, num_speculative_tokens=spec.num_speculative_tokens,
                 conservative=spec.conservative, drafters=drafters or [])
        if drafters is None:  # an engine without a drafting step: say so rather than pretend
            log.warning("speculative decoding is configured but this engine does not implement it; decoding one "
                        "token per step (the dspark_spec_decode_* metrics stay 0)", strategy=strategy)
            strategy = None
    cb = e.continuous_batching
    log.info("Initializing scheduler...", policy=e.scheduler.policy, continuous_batching=cb.enabled,
             max_batch_size=cb.max_batch_size if cb.enabled else 1, kv_cache_page_size=cb.kv_cache_page_size,
             preemption_policy=cb.preemption_policy)
    return strategy


def _observability(cfg: ServerConfig, engine: Any) -> Any:
    """Log what runs the model; build the tracer and the rest of ``cfg.observability`` for ``create_app``."""
    from dspark.server.observability import Observability, describe_runtime
    from dspark.server.tracing import build_tracer

    t0 = time.perf_counter()
    rt = describe_runtime(engine)
    log.info(f"Active plugins: {', '.join(rt.plugins) or 'none'}", plugins=rt.plugins,
             plugins_used=rt.plugins_used, seconds=round(time.perf_counter() - t0, 3))
    log.info(f"Model runs on {rt.target}", target=rt.target, devices=rt.devices)
    o = cfg.observability
    tracer = build_tracer(o.otlp_traces_endpoint, service_name=o.service_name, model_name=cfg.served_name(),
                          device=rt.device, plugin=rt.plugin, target=rt.target)
    if tracer is not None:
        log.info(f"Tracing requests to {o.otlp_traces_endpoint}", otlp_traces_endpoint=o.otlp_traces_endpoint,
                 service_name=o.service_name)
    return Observability(access_log=o.access_log, stats_log_interval_s=o.stats_log_interval_s, tracer=tracer)


def load_engine(cfg: ServerConfig) -> tuple[Any, Any, str | None]:
    """Load the model, log what runs it, build its metrics: ``(AsyncLLMEngine, ServerMetrics, spec strategy)``.

    The single-process server and every cluster replica build their engine here; torch's threads are set first.
    """
    import torch

    from dspark.llm import AsyncLLMEngine
    from dspark.server.metrics import ServerMetrics

    path = cfg.model_path()
    log.info(f"Loading model from {path}", path=str(path), dtype=cfg.model.dtype,
             torch_threads=torch.get_num_threads(), gpu_memory_utilization=cfg.resources.gpu_memory_utilization)
    t0 = time.perf_counter()
    with progress.on_terminal(f"starting {cfg.served_name()}"):
        engine = AsyncLLMEngine.from_pretrained(path, dtype=cfg.model.dtype, config=cfg.engine_config())
    dt = time.perf_counter() - t0
    log.info(f"Model loaded in {dt:.1f}s.", seconds=round(dt, 3), model=cfg.served_name(),
             max_model_len=engine.inputs.max_model_len, kv_cache_tokens=engine.inputs.kv_tokens,
             kv_cache_bytes=engine.stats().kv_total_bytes)
    layout = engine.layout()
    strategy = _log_scheduler(cfg, layout.drafters)
    metrics = ServerMetrics(engine, model_name=cfg.served_name(), spec_strategy=strategy, device_map=layout.device_map)
    metrics.instrument_engine(engine)
    return engine, metrics, strategy


def serve(cfg: ServerConfig) -> None:
    """Load the model and serve until SIGINT/SIGTERM (uvicorn then drains and runs the app's shutdown)."""
    import torch
    import uvicorn

    from dspark.server.app import ServerState, create_app
    from dspark.server.protocol.chat_template import ChatTemplate

    res = cfg.resources
    if res.cpu_cores_per_worker is not None:
        # More intra-op threads than usable cores only adds OpenMP spin contention.
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = min(res.cpu_cores_per_worker, usable)
        if threads < res.cpu_cores_per_worker:
            log.warning("resources.cpu_cores_per_worker exceeds the usable cores; capped",
                        requested=res.cpu_cores_per_worker, usable=usable, threads=threads)
        torch.set_num_threads(threads)
    path = cfg.model_path()
    engine, metrics, _ = load_engine(cfg)
    obs = _observability(cfg, engine)

    host = cfg.server.host
    sock = _bind(host, cfg.server.port)
    port = sock.getsockname()[1]
    metrics_server: Any = None
    if res.enable_metrics:
        from prometheus_client import start_http_server

        metrics_server, _ = start_http_server(res.metrics_port, addr=host, registry=metrics.registry)

    def stop_metrics() -> None:
        if metrics_server is not None:
            threading.Thread(target=metrics_server.shutdown, daemon=True).start()  # it blocks until the loop ends
        if obs.tracer is not None:
            obs.tracer.shutdown()  # sends the spans still batched

    state = ServerState(engine=engine, model_name=cfg.served_name(), model_root=str(path), metrics=metrics,
                        chat_template=ChatTemplate.from_checkpoint(path), api_key=cfg.server.api_key,
                        created=int(time.time()), max_body_bytes=cfg.server.max_body_bytes,
                        cors_allow_origins=list(cfg.server.cors_allow_origins))
    app = create_app(state, on_shutdown=stop_metrics, observability=obs)
    url = _url(host, port)
    log.info(f"DSpark server is listening on {url}", url=url, host=host, port=port, model=state.model_name,
             api_key_required=state.api_key is not None)
    if metrics_server is not None:
        mport = metrics_server.server_port
        log.info(f"Metrics endpoint is available on {_url(host, mport)}/metrics", url=f"{_url(host, mport)}/metrics",
                 metrics_port=mport)
    if host not in ("127.0.0.1", "::1", "localhost") and state.api_key is None:
        log.warning("listening on a non-loopback address without an API key; anyone who can reach it can use it",
                    host=host)
    _route_stdlib_logs()
    _freeze_heap()
    from dspark.server.shutdown import FLUSH_S, DrainingServer

    # The drain (DrainingServer) ends every request before uvicorn's own shutdown, whose grace time then
    # only has to cover closing connections.
    server = DrainingServer(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                                           timeout_graceful_shutdown=FLUSH_S),
                            state, cfg.server.timeout_graceful_shutdown_s)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        kv = engine.stats()
        log.info("DSpark server stopped", kv_cache_used_bytes=kv.kv_used_bytes, requests_running=kv.num_running,
                 requests_waiting=kv.num_waiting)


def _freeze_heap() -> None:
    """Everything alive once the server is built (the runtimes' modules, the model, the app) moved out of the
    cyclic collector's reach (``gc.freeze``, as vLLM does after warm-up and SGLang offers): every full
    collection while serving would otherwise walk it all, stalling the engine and the event loop together
    (docs/server.md). Garbage first, so none is frozen."""
    import gc

    gc.collect()
    gc.freeze()
    log.info("heap frozen for the collector", objects=gc.get_freeze_count())

