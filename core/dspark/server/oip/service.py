"""What both protocols share: the models, readiness, the drain, and running a request through a model's batcher.

REST and gRPC decode their own wire formats into arrays, call
:meth:`OipService.infer`, and encode the outputs back; everything between
(draining, the in-flight set the drain waits on, statistics) happens here, so
one batcher serves both protocols.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from dspark.server.oip.errors import OipError, draining, not_found
from dspark.server.oip.model import ServedModel


class _Open:
    """A request in flight, as :class:`~dspark.server.shutdown.DrainingServer` sees it (``groups``)."""

    def __init__(self, future: asyncio.Future[list[np.ndarray]]) -> None:
        self.future = future

    def shutdown(self) -> None:
        # The drain time is over: end the request in-band (a 503 / UNAVAILABLE), never cut the connection.
        if not self.future.done():
            self.future.set_exception(OipError(503, "the server shut down before the request finished "
                                                    "(server.timeout_graceful_shutdown_s)"))


class OipService:
    def __init__(self, models: list[ServedModel], *, api_key: str | None = None) -> None:
        self.models = {m.name: m for m in models}
        self.api_key = api_key
        self.draining = False  # set at SIGTERM: new inference requests get 503 / UNAVAILABLE
        self.groups: set[_Open] = set()  # requests in flight, for the drain

    @property
    def live(self) -> bool:
        return True

    @property
    def ready(self) -> bool:
        return not self.draining and all(m.ready for m in self.models.values())

    def model(self, name: str, version: str = "") -> ServedModel:
        m = self.models.get(name)
        if m is None:
            raise not_found(f"unknown model '{name}'; this server serves {sorted(self.models)}")
        if version not in ("", m.version):
            raise not_found(f"model '{name}' has no version '{version}'; its versions are ['{m.version}']")
        return m

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            return self.model(name, version).ready and not self.draining
        except OipError:
            return False

    def server_metadata(self) -> dict[str, Any]:
        from dspark import __version__

        return {"name": "dspark", "version": __version__,
                "extensions": ["binary_tensor_data", "model_configuration", "statistics"]}

    def repository_index(self) -> list[dict[str, str]]:
        return [{"name": m.name, "version": m.version, "state": "READY" if m.ready else "UNAVAILABLE"}
                for m in self.models.values()]

    def statistics(self, name: str = "", version: str = "") -> list[dict[str, Any]]:
        models = [self.model(name, version)] if name else list(self.models.values())
        return [m.stats.snapshot() for m in models]

    async def infer(self, model: ServedModel, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one decoded request through the model's batcher: every output by name."""
        if self.draining:
            raise draining()
        rows = model.check_feed(feed)
        future = model.batcher.submit(feed, rows)
        open_ = _Open(future)
        self.groups.add(open_)
        try:
            outs = await future
        finally:
            self.groups.discard(open_)
        return {t.name: o for t, o in zip(model.outputs, outs)}

    @staticmethod
    def finished(model: ServedModel, started_ns: int, error: OipError | None = None) -> None:
        """Count a request that reached a model: success, or failure with Triton's reason label."""
        reason = "OTHER"
        if error is not None:
            reason = {503: "REJECTED", 500: "BACKEND"}.get(error.status, "OTHER")
        model.stats.finished(error is None, time.monotonic_ns() - started_ns, reason)
