"""The ingress deployment: the single-process server's FastAPI app, over the engine replicas.

Same routes, errors, streaming, API key, limits and ``/metrics`` (the
ingress's own request series, and the replicas' engine state summed) as
``dspark serve`` without a cluster; the generation calls go to the engine
deployment through a Ray Serve handle, whose router (:mod:`.router`) picks the
replica. Two routes more:

* ``GET /cluster/replicas`` -- every live replica: node, pid, what runs the
  model there, outstanding tokens, engine state, metrics URL.
* ``GET /cluster/metrics-targets`` -- the replicas' metrics endpoints in
  Prometheus' HTTP service-discovery format (``http_sd_configs``).
"""

from __future__ import annotations

import time
from typing import Any

from dspark.host.log import get_logger

log = get_logger("dspark.server.cluster")


class Ingress:
    """Wrapped by ``serve.ingress()`` (late-bound app) and ``serve.deployment`` in :mod:`.deploy`."""

    async def __init__(self, engine: Any, cfg: dict[str, Any]) -> None:  # type: ignore[misc]  # Serve awaits it
        from dspark.server.app import ServerState, create_app
        from dspark.llm.inputs import InputProcessor
        from dspark.server.cluster.frontend import RemoteAsyncEngine
        from dspark.server.cluster.registry import get_registry
        from dspark.server.config import ServerConfig
        from dspark.server.metrics import ServerMetrics
        from dspark.server.observability import Observability
        from dspark.server.protocol.chat_template import ChatTemplate

        c = ServerConfig.model_validate(cfg)
        d = await engine.describe.remote()  # from whichever replica is up first; they serve one model
        registry = get_registry(c.cluster.app_name, c.cluster.namespace)
        self.remote = remote = RemoteAsyncEngine(engine, InputProcessor.from_description(d["inputs"]), registry,
                                                 affinity=c.cluster.router == "prefix_affinity")
        metrics = ServerMetrics(remote, model_name=d["model_name"], spec_strategy=d["spec_strategy"])
        state = ServerState(engine=remote, model_name=d["model_name"], model_root=d["model_root"],
                            metrics=metrics, chat_template=ChatTemplate(d["chat_template"], d["special_tokens"]),
                            api_key=c.server.api_key, created=int(time.time()), max_body_bytes=c.server.max_body_bytes,
                            cors_allow_origins=list(c.server.cors_allow_origins))
        o = c.observability
        self._fastapi = create_app(state, observability=Observability(access_log=o.access_log,
                                                                  stats_log_interval_s=o.stats_log_interval_s))
        self._add_cluster_routes(c.cluster.app_name)
        log.info("ingress ready", model=d["model_name"], router=c.cluster.router)

    def _add_cluster_routes(self, app_name: str) -> None:
        remote = self.remote

        @self._fastapi.get("/cluster/replicas")
        async def replicas() -> dict[str, Any]:
            return {"replicas": remote.replicas}

        @self._fastapi.get("/cluster/metrics-targets")
        async def targets() -> list[dict[str, Any]]:
            out = []
            for e in remote.replicas:
                if not e.get("metrics_url"):
                    continue
                hostport = e["metrics_url"].removeprefix("http://").removesuffix("/metrics")
                # The samples carry replica and node labels themselves; these only name the app.
                out.append({"targets": [hostport], "labels": {"dspark_app": app_name}})
            return out

    def __serve_build_asgi_app__(self) -> Any:
        return self._fastapi
