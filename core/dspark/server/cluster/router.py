"""The routing decision of :mod:`.routing` behind Ray Serve's request-router extension point.

Set as the engine deployment's ``request_router_config`` (see :mod:`.deploy`);
it runs inside whatever holds a handle to the engine replicas -- the ingress.
Ray Serve keeps the candidate list current (replicas that died or are
stopping are not offered) and retries the next rank when a replica is at
``max_ongoing_requests``.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from dspark.server.cluster.routing import RouteInfo, TokenLoad

OUTSTANDING = "outstanding_tokens"  # the key replicas report in record_routing_stats


class TokenAwareRouter(FIFOMixin, RequestRouter):  # type: ignore[misc]
    """Least outstanding tokens first; with ``affinity``, a prompt prefix goes back where it went before."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.book = TokenLoad(affinity=bool(kwargs.get("affinity", False)),
                              slack_tokens=int(kwargs.get("slack_tokens", 2048)))

    @staticmethod
    def _info(pending: PendingRequest | None) -> RouteInfo | None:
        if pending is None:
            return None
        return next((a for a in pending.args if isinstance(a, RouteInfo)), None)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        reported = {r.replica_id: int((r.routing_stats or {}).get(OUTSTANDING, 0)) for r in candidate_replicas}
        info = self._info(pending_request)
        ranked = self.book.rank(by_id, info, reported)
        if pending_request is not None:  # count it now: a burst routed together must spread out
            self.book.chosen(pending_request.metadata.internal_request_id, ranked[0], info, sent=False)
        return [[by_id[r]] for r in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.book.chosen(pending_request.metadata.internal_request_id, replica_id, self._info(pending_request))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.book.release(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.book.forget(replica_id)
