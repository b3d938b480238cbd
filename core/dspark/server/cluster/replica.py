"""One engine replica: an ``AsyncLLMEngine`` on its node's devices, streaming outputs to the ingress.

Ray places the replica on a node with the resources it asks for; inside it the
engine is built exactly as the single-process server builds it, so the model is
placed on *that node's* devices by *that node's* plugins. Each replica also
serves its own ``dspark_`` metrics (labelled ``replica`` and ``node``) on a port
of its own, listed by the app's registry for Prometheus' HTTP service discovery.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import ray
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from ray import serve

from dspark.host.log import get_logger
from dspark.llm import RequestOutput, SamplingParams
from dspark.server.cluster.registry import get_registry
from dspark.server.cluster.router import OUTSTANDING
from dspark.server.cluster.routing import RouteInfo

log = get_logger("dspark.server.cluster")
_END = object()


class _Labelled(Collector):
    """Every sample of ``inner`` with the replica's own labels added."""

    def __init__(self, inner: CollectorRegistry, labels: dict[str, str]) -> None:
        self.inner, self.labels = inner, labels

    def collect(self) -> Iterator[Metric]:
        for fam in self.inner.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                out.add_sample(s.name, {**s.labels, **self.labels}, s.value, s.timestamp, s.exemplar)
            yield out


def compact(o: RequestOutput, start: int, first: bool) -> RequestOutput:
    """Only what is new since token ``start`` (what the ingress already has); :func:`.frontend.Rebuild` undoes it.

    The engine's outputs are cumulative (every token and the whole text so far, the prompt each time):
    sent as they are, a sequence's messages would grow with its length and cost O(n^2) bytes in all.
    """
    return dataclasses.replace(
        o, token_ids=list(o.token_ids[start:]), text=o.text if o.finished else "",
        prompt_token_ids=o.prompt_token_ids if first else [],
        logprobs=list(o.logprobs[start:]) if o.logprobs is not None else None,
        prompt_logprobs=o.prompt_logprobs if first else None)


class EngineReplica:
    """The engine deployment's class (wrapped by ``serve.deployment`` in :mod:`.deploy`)."""

    def __init__(self, cfg: dict[str, Any], threads: int) -> None:
        import torch
        from prometheus_client import start_http_server

        from dspark.server.config import ServerConfig
        from dspark.server.launch import load_engine
        from dspark.server.protocol.chat_template import ChatTemplate

        self.cfg = c = ServerConfig.model_validate(cfg)
        torch.set_num_threads(max(1, threads))
        path = c.model_path()
        t0 = time.perf_counter()
        self.engine, self.metrics, self.strategy = load_engine(c)
        ctx = serve.get_replica_context()
        self.replica = ctx.replica_id.unique_id
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self._metrics_server: Any = None
        self.metrics_url = None
        if c.resources.enable_metrics:  # on a port of its own: Prometheus finds it through the registry
            served = CollectorRegistry()
            served.register(_Labelled(self.metrics.registry, {"replica": self.replica, "node": self.node_id[:12]}))
            self._metrics_server, _ = start_http_server(0, addr=self.node_ip, registry=served)
            self.metrics_url = f"http://{self.node_ip}:{self._metrics_server.server_port}/metrics"
        self.chat = ChatTemplate.from_checkpoint(path)
        self.model_root = str(path)
        self.outstanding = 0  # prompt + max_tokens of every sequence here, not finished
        self.registry = get_registry(c.cluster.app_name, c.cluster.namespace)
        from dspark.server.observability import describe_runtime

        self.target = describe_runtime(self.engine).target
        log.info("engine replica ready", replica=self.replica, node=self.node_id, target=self.target,
                 metrics=self.metrics_url, seconds=round(time.perf_counter() - t0, 2), torch_threads=threads)
        self.record_routing_stats()

    def describe(self) -> dict[str, Any]:
        """What the ingress needs to validate requests without a model of its own."""
        return {"inputs": self.engine.inputs.describe(), "model_root": self.model_root,
                "model_name": self.cfg.served_name(),
                "chat_template": self.chat.source, "special_tokens": self.chat.special_tokens,
                "spec_strategy": self.strategy}

    def record_routing_stats(self) -> dict[str, Any]:
        """Called by Ray Serve every routing-stats period: what the router reads, and the registry's heartbeat."""
        s = self.engine.stats()
        self.registry.report.remote(self.replica, {
            "node_id": self.node_id, "node_ip": self.node_ip, "pid": os.getpid(), "metrics_url": self.metrics_url,
            "target": self.target, "outstanding_tokens": self.outstanding, "stats": s.__dict__})
        return {OUTSTANDING: self.outstanding, "running": s.num_running, "waiting": s.num_waiting}

    async def generate(self, info: RouteInfo, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       priority: int = 0) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """Stream one sequence's outputs as ``(start, compact(output))``, several per item when they come faster
        than the ingress takes them."""
        self.outstanding += info.work_tokens
        timer = self.metrics.sequence(len(prompt_ids))
        q: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for out in self.engine.generate(prompt_ids, params, request_id=request_id, priority=priority):
                    q.put_nowait(out)
            except Exception as e:  # noqa: BLE001 (handed to the consumer, which raises it to the ingress)
                q.put_nowait(e)
            finally:
                q.put_nowait(_END)

        task = asyncio.create_task(pump())
        sent, first = 0, True
        try:
            while True:
                items = [await q.get()]
                while not q.empty():
                    items.append(q.get_nowait())
                outs = []
                for o in items:
                    if isinstance(o, RequestOutput):
                        timer.update(o)
                        start = min(sent, len(o.token_ids))  # an engine that took tokens back resends from there
                        outs.append((start, compact(o, start, first)))
                        sent, first = len(o.token_ids), False
                if outs:
                    yield outs
                err = next((i for i in items if isinstance(i, BaseException)), None)
                if err is not None:
                    raise err
                if any(i is _END for i in items):
                    return
        finally:
            task.cancel()  # a cancelled call (client gone): the engine's generator aborts and frees the KV pages
            self.outstanding -= info.work_tokens
            timer.finish("abort")  # no-op when it finished

    def __del__(self) -> None:
        try:
            self.registry.drop.remote(self.replica)
            self.engine.shutdown()
            if self._metrics_server is not None:
                self._metrics_server.shutdown()
        except Exception:  # noqa: BLE001 (interpreter shutdown: nothing left to tell)
            pass
