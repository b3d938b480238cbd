"""Build the Ray Serve application from a server config, and run it until SIGINT/SIGTERM.

Two deployments: ``EngineReplica`` (N replicas, or an autoscaling range on
queue depth; each asks its node for ``cluster.resources_per_replica``; routed
by :class:`~dspark.server.cluster.router.TokenAwareRouter`) and ``Ingress``
(one replica, no CPU reserved, the OpenAI app). Ray Serve's HTTP proxy listens
on ``server.host``/``server.port`` and hands requests to the ingress.
"""

from __future__ import annotations

import signal
import socket
import threading
from typing import Any

from dspark.host.log import get_logger
from dspark.server.config import ServerConfig

log = get_logger("dspark.server.cluster")
ROUTING_STATS_PERIOD_S = 2.0


def replica_threads(cfg: ServerConfig) -> int:
    """torch threads per replica: ``resources.cpu_cores_per_worker``, else the CPUs the replica reserves."""
    return cfg.resources.cpu_cores_per_worker or max(1, int(cfg.cluster.resources_per_replica.num_cpus))


def engine_options(cfg: ServerConfig) -> dict[str, Any]:
    from ray.serve.config import RequestRouterConfig

    cl, res = cfg.cluster, cfg.cluster.resources_per_replica
    actor: dict[str, Any] = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus}
    if res.custom:
        actor["resources"] = dict(res.custom)
    if res.memory_bytes is not None:
        actor["memory"] = res.memory_bytes
    opts: dict[str, Any] = dict(name="EngineReplica", ray_actor_options=actor,
                                max_ongoing_requests=cl.max_ongoing_requests, health_check_period_s=2.0,
                                health_check_timeout_s=30.0, graceful_shutdown_timeout_s=5.0)
    if cl.autoscaling is not None:
        a = cl.autoscaling
        opts["autoscaling_config"] = {"min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
                                      "initial_replicas": max(a.min_replicas, 1),
                                      "target_ongoing_requests": a.target_ongoing_requests,
                                      "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s}
    else:
        opts["num_replicas"] = cl.replicas or 1
    if cl.router != "power_of_two":
        from dspark.server.cluster.router import TokenAwareRouter

        opts["request_router_config"] = RequestRouterConfig(
            request_router_class=TokenAwareRouter,
            request_router_kwargs={"affinity": cl.router == "prefix_affinity", "slack_tokens": cl.affinity_slack_tokens},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S, request_routing_stats_timeout_s=5.0)
    return opts


def build_app(cfg: ServerConfig) -> Any:
    from ray import serve

    from dspark.server.cluster.ingress import Ingress
    from dspark.server.cluster.replica import EngineReplica

    raw = cfg.model_dump(mode="json", exclude_unset=True)  # unset stays unset (engine defaults)
    engine = serve.deployment(EngineReplica).options(**engine_options(cfg)).bind(raw, replica_threads(cfg))
    ingress = serve.deployment(serve.ingress()(Ingress)).options(
        name="Ingress", num_replicas=cfg.cluster.ingress_replicas, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000)  # the replicas' routers queue; the ingress never should
    return ingress.bind(engine, raw)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def serve_cluster(cfg: ServerConfig) -> None:
    """Start (or join) Ray, deploy, log the URL, and serve until SIGINT/SIGTERM; then take the app down."""
    import ray
    from ray import serve

    cl = cfg.cluster
    host = cfg.server.host
    port = cfg.server.port or _free_port(host)
    # "local": a new Ray of our own, never a stale address another `ray start` left in /tmp/ray.
    ray.init(address=cl.ray_address or "local", namespace=cl.namespace, log_to_driver=False,
             include_dashboard=None if cl.ray_address else False)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    log.info("Ray cluster joined" if cl.ray_address else "local Ray started", nodes=len(nodes),
             resources=ray.cluster_resources())
    from ray.serve.context import _get_global_client

    # Serve is one per cluster: whoever starts it owns it (and shuts it down); joining a running one keeps
    # its HTTP proxy where it is.
    owns_serve = _get_global_client(raise_if_no_controller_running=False) is None
    serve.start(http_options={"host": host, "port": port})
    if not owns_serve:
        client = _get_global_client()
        root = str(client.root_url if client is not None else f"http://{host}:{port}").rstrip("/")
        if root != f"http://{host}:{port}":
            log.warning("Ray Serve already runs on this cluster: its HTTP proxy stays at its own address "
                        "(server.host/server.port do not apply)", proxy=root)
            host, port = root.removeprefix("http://").rsplit(":", 1)[0], int(root.rsplit(":", 1)[1])
    try:
        serve.run(build_app(cfg), name=cl.app_name, route_prefix="/", blocking=False)
    except RuntimeError as e:  # a deployment failed to start: say which, with its own error, and clean up
        why = _deployment_errors(cl.app_name) or str(e)
        _take_down(cfg, owns_serve)
        raise ValueError(f"cluster: the Serve app did not start: {why}") from None
    url = f"http://{host}:{port}"
    log.info(f"DSpark server is listening on {url}", url=url, host=host, port=port, cluster=True,
             replicas=cl.replicas, autoscaling=cl.autoscaling.model_dump() if cl.autoscaling else None,
             router=cl.router, ray_address=cl.ray_address)
    if cfg.resources.enable_metrics:
        # The ingress's own series on the API port; each replica's on a port of its own, listed for Prometheus.
        log.info(f"Metrics endpoint is available on {url}/metrics", url=f"{url}/metrics", metrics_port=port,
                 replica_targets=f"{url}/cluster/metrics-targets")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("Stopping: deleting the Serve app and its replica registry.")
    _take_down(cfg, owns_serve)


def _deployment_errors(app_name: str) -> str:
    from ray import serve

    try:
        app = serve.status().applications[app_name]
    except Exception:  # noqa: BLE001 (no status to read: the caller reports what it has)
        return ""
    msgs = [f"{name}: {d.message.strip().splitlines()[-1]}" for name, d in app.deployments.items()
            if d.message and d.status != "HEALTHY"]
    return "; ".join(msgs)


def _take_down(cfg: ServerConfig, owns_serve: bool) -> None:
    import ray
    from ray import serve

    from dspark.server.cluster.registry import registry_name

    cl = cfg.cluster
    try:
        serve.delete(cl.app_name)
        ray.kill(ray.get_actor(registry_name(cl.app_name), namespace=cl.namespace))
    except Exception as e:  # noqa: BLE001 (already gone: nothing to take down)
        log.warning("cleanup incomplete", error=repr(e))
    if owns_serve:
        serve.shutdown()
    ray.shutdown()
