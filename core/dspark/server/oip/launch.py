"""Start the OIP server: load and warm the models, then REST (uvicorn) and gRPC (grpc.aio) in one event loop.

The plugins are loaded and the devices probed once, for every model. The REST
socket is bound before uvicorn starts (port 0 works and the log names the real
port); gRPC binds in the app's startup, in uvicorn's loop. SIGTERM/SIGINT
drains (:class:`~dspark.server.shutdown.DrainingServer`): readiness turns
false, new inference requests get 503 / UNAVAILABLE, queued batches are sent
at once, the gRPC server stops accepting and gives its calls the drain time.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from dspark.host.log import get_logger
from dspark.server.oip.config import OipConfig
from dspark.server.oip.model import ModelLoadError, ServedModel
from dspark.server.oip.service import OipService

log = get_logger("dspark.server.oip")


def load_models(cfg: OipConfig) -> list[ServedModel]:
    """Open a Session per model (one plugin host and device probe for all), check it, warm it up."""
    from dspark.host.inventory import probe
    from dspark.host.plugin_manager import PluginHost
    from dspark.host.settings import PluginSettings
    from dspark.session import Session

    host = PluginHost(PluginSettings.from_env([])).load()
    inventory = probe(host)
    models = []
    for i, entry in enumerate(cfg.models):
        t0 = time.perf_counter()
        log.info(f"Loading model {entry.served_name} from {entry.path}", model=entry.served_name, path=entry.path)
        sizes = max(entry.max_batch_size, 1).bit_length() + 1  # size buckets the batcher can form
        try:
            session = Session(entry.path, name=entry.served_name, host=host, inventory=inventory,
                              max_shapes=max(8, sizes + 1))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"models.{i}.path: cannot load {entry.path}: {e}") from None
        try:
            model = ServedModel(entry, session)
        except ModelLoadError as e:
            session.close()
            raise ModelLoadError(f"models.{i}: {e}") from None
        model.warmup()
        log.info(f"Model {model.name} loaded in {time.perf_counter() - t0:.1f}s", model=model.name,
                 inputs=[t.json(model.batched) for t in model.inputs], max_batch_size=model.max_batch_size,
                 dynamic_batching=entry.dynamic_batching is not None, instance_count=entry.instance_count,
                 targets=sorted({p.target.key for p in session.plan.partitions}))
        models.append(model)
    return models


class OipServer:
    """One server: :meth:`run` serves in this thread until a signal; :meth:`start` serves from a background
    thread (tests, notebooks) and returns once both protocols listen; :meth:`stop` drains it."""

    def __init__(self, cfg: OipConfig, models: list[ServedModel] | None = None) -> None:
        self.cfg, self._models = cfg, models
        self.http_port = self.grpc_port = 0
        self.metrics_port: int | None = None
        self.service: OipService | None = None
        self._uvicorn: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listening = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def run(self) -> None:
        import uvicorn

        from dspark.server.launch import _bind, _route_stdlib_logs, _url
        from dspark.server.oip.grpc_service import start_grpc
        from dspark.server.oip.metrics import MetricsServer, build_registry
        from dspark.server.oip.rest import create_app
        from dspark.server.shutdown import FLUSH_S, DrainingServer

        s = self.cfg.server
        models = self._models if self._models is not None else load_models(self.cfg)
        service = self.service = OipService(models, api_key=s.api_key)
        sock = _bind(s.host, s.port)
        self.http_port = sock.getsockname()[1]
        metrics = None
        if s.metrics_port is not None:
            metrics = MetricsServer(build_registry(lambda: [m.stats for m in service.models.values()]), s.host,
                                    s.metrics_port)
            self.metrics_port = metrics.port
        grpc: dict[str, Any] = {}

        @asynccontextmanager
        async def lifespan(_: Any) -> AsyncIterator[None]:
            self._loop = asyncio.get_running_loop()
            try:
                for m in models:
                    m.batcher.start()
                    m.ready = True
                grpc["server"], self.grpc_port = await start_grpc(service, s.host, s.grpc_port, s.max_body_bytes)
            except BaseException as e:
                self._error = e  # uvicorn only logs a failed startup; run() raises it
                raise
            url = _url(s.host, self.http_port)
            log.info(f"DSpark OIP server is listening on {url} (gRPC on port {self.grpc_port})", url=url,
                     host=s.host, port=self.http_port, grpc_port=self.grpc_port, metrics_port=self.metrics_port,
                     models=sorted(service.models), api_key_required=s.api_key is not None)
            if s.host not in ("127.0.0.1", "::1", "localhost") and s.api_key is None:
                log.warning("listening on a non-loopback address without an API key", host=s.host)
            self._listening.set()
            try:
                yield
            finally:
                await self._shutdown(service, grpc, metrics)

        def on_drain() -> None:
            for m in models:
                m.batcher.flush()  # nothing can join a batch now: send what waits
            if "server" in grpc:  # new calls are refused; those in flight get the drain time (and the flush's)
                grpc["stopping"] = asyncio.ensure_future(grpc["server"].stop(s.timeout_graceful_shutdown_s + FLUSH_S))

        app = create_app(service, max_body_bytes=s.max_body_bytes, cors_allow_origins=list(s.cors_allow_origins),
                         lifespan=lifespan)
        _route_stdlib_logs()
        self._uvicorn = DrainingServer(
            uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                           timeout_graceful_shutdown=int(FLUSH_S)),
            service, s.timeout_graceful_shutdown_s, on_drain=on_drain)
        try:
            self._uvicorn.run(sockets=[sock])
            if self._error is not None:
                raise self._error
        finally:
            sock.close()
            if metrics is not None:
                metrics.close()
            for m in models:
                m.session.close()
            log.info("DSpark OIP server stopped", models=sorted(service.models))

    async def _shutdown(self, service: OipService, grpc: dict[str, Any], metrics: Any) -> None:
        for m in service.models.values():
            m.ready = False
        if "stopping" in grpc:  # the drain stopped it already; let its last calls finish writing
            await asyncio.wait([grpc["stopping"]], timeout=5)
        if "server" in grpc:
            await grpc["server"].stop(0)
        for m in service.models.values():
            await m.batcher.close()

    # -- in a background thread ----------------------------------------------------

    def start(self, timeout: float = 300.0) -> OipServer:
        """Serve from a daemon thread; return once REST and gRPC listen (raise what stopped the start)."""
        def target() -> None:
            try:
                self.run()
            except BaseException as e:  # noqa: BLE001  (handed to the starting thread)
                self._error = e
                self._listening.set()

        self._thread = threading.Thread(target=target, name="oip-server", daemon=True)
        self._thread.start()
        if not self._listening.wait(timeout):
            raise TimeoutError(f"the OIP server did not start in {timeout}s")
        if self._error is not None:
            raise self._error
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Drain and stop the background server (as SIGTERM does)."""
        if self._loop is not None and self._uvicorn is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._uvicorn.handle_exit, signal.SIGTERM, None)
            self._thread.join(timeout)


def serve(cfg: OipConfig) -> None:
    """``dspark serve MODEL.onnx`` / ``dspark serve --config oip.yaml``: serve until SIGINT/SIGTERM."""
    OipServer(cfg).run()
