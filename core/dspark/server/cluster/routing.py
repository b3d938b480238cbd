"""Which replica gets a sequence: fewest outstanding tokens, with optional prefix affinity.

Pure bookkeeping, no Ray: :mod:`.router` calls it from Ray Serve's request
router. A replica's load is the larger of two counts of outstanding tokens
(prompt + max_tokens of every sequence sent and not finished):

* what this router sent it and has not seen finish -- exact and immediate for
  one ingress, and counted the moment a replica is chosen so that a burst of
  requests routed together spreads out instead of piling onto the replica
  that was idle a moment ago;
* what the replica last reported (``record_routing_stats``, every routing-stats
  period) -- which covers what other ingresses sent it.

Requests, not tokens, would treat a 4,000-token summary and a 5-token
completion as the same work; that is what Ray Serve's default power-of-two
router counts.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

PREFIX_PAGE = 16  # tokens per prefix hash: the engine's default KV page size
PREFIX_PAGES = 64  # prefix hashes per prompt at most (its first 1,024 tokens)


@dataclass(frozen=True)
class RouteInfo:
    """What the router needs of one sequence; the first argument of every replica ``generate`` call."""

    request_id: str
    work_tokens: int  # prompt + max_tokens
    prefix_hashes: tuple[int, ...] = ()  # hash of the prompt's first k*PREFIX_PAGE tokens, k = 1, 2, ...


def route_info(request_id: str, prompt_ids: Sequence[int], max_tokens: int, *, affinity: bool) -> RouteInfo:
    hashes: list[int] = []
    if affinity:
        h = 0
        for k in range(min(len(prompt_ids) // PREFIX_PAGE, PREFIX_PAGES)):
            # Chained page by page: the hash of the first k pages, in O(prompt) in all. hash() of ints and
            # tuples of ints is the same in every process (only str/bytes hashing is salted).
            h = hash((h, tuple(prompt_ids[k * PREFIX_PAGE:(k + 1) * PREFIX_PAGE])))
            hashes.append(h)
    return RouteInfo(request_id, len(prompt_ids) + max_tokens, tuple(hashes))


class TokenLoad:
    """Outstanding tokens per replica, and which replica last served each prompt prefix."""

    def __init__(self, *, affinity: bool = False, slack_tokens: int = 2048, table_size: int = 100_000,
                 unconfirmed_ttl_s: float = 60.0) -> None:
        self.affinity, self.slack, self.table_size = affinity, slack_tokens, table_size
        self.inflight: dict[Hashable, int] = {}
        self._requests: dict[str, tuple[Hashable, int]] = {}  # request key -> (replica, tokens)
        self._prefixes: OrderedDict[int, Hashable] = OrderedDict()  # prefix hash -> replica, LRU order
        # Chosen but not (yet) sent: a request cancelled while it waited at the router is never sent, so it
        # never completes either; its count is dropped after unconfirmed_ttl_s.
        self._unconfirmed: dict[str, float] = {}
        self.unconfirmed_ttl_s = unconfirmed_ttl_s

    def load(self, replica: Hashable, reported: dict[Hashable, int]) -> int:
        return max(self.inflight.get(replica, 0), reported.get(replica, 0))

    def rank(self, candidates: Iterable[Hashable], info: RouteInfo | None,
             reported: dict[Hashable, int] | None = None) -> list[Hashable]:
        """``candidates`` best first: least loaded, or the prefix's replica while it is not overloaded."""
        reported = reported or {}
        self._expire()
        ranked = sorted(candidates, key=lambda r: (self.load(r, reported), str(r)))
        if not ranked or info is None or not self.affinity:
            return ranked
        floor = self.load(ranked[0], reported)
        for h in reversed(info.prefix_hashes):  # the longest cached prefix first
            owner = self._prefixes.get(h)
            if owner is not None and owner in ranked:
                if self.load(owner, reported) <= floor + self.slack:
                    ranked.remove(owner)
                    ranked.insert(0, owner)
                break
        return ranked

    def chosen(self, key: str, replica: Hashable, info: RouteInfo | None, *, sent: bool = True,
               now: float | None = None) -> None:
        """Count ``key``'s tokens against ``replica`` (moved there if it was counted elsewhere).

        ``sent=False``: only picked so far; released after ``unconfirmed_ttl_s`` unless sent by then.
        """
        self.release(key)
        if not sent:
            self._unconfirmed[key] = time.monotonic() if now is None else now
        tokens = info.work_tokens if info is not None else 1
        self._requests[key] = (replica, tokens)
        self.inflight[replica] = self.inflight.get(replica, 0) + tokens
        if info is not None and self.affinity:
            for h in info.prefix_hashes:
                self._prefixes[h] = replica
                self._prefixes.move_to_end(h)
            while len(self._prefixes) > self.table_size:
                self._prefixes.popitem(last=False)

    def _expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for key in [k for k, t in self._unconfirmed.items() if now - t > self.unconfirmed_ttl_s]:
            self.release(key)

    def release(self, key: str) -> None:
        self._unconfirmed.pop(key, None)
        held = self._requests.pop(key, None)
        if held is not None:
            replica, tokens = held
            left = self.inflight.get(replica, 0) - tokens
            if left > 0:
                self.inflight[replica] = left
            else:
                self.inflight.pop(replica, None)

    def forget(self, replica: Hashable) -> None:
        """A replica died: drop its counts and its prefixes (their KV is gone with it)."""
        self.inflight.pop(replica, None)
        for key in [k for k, (r, _) in self._requests.items() if r == replica]:
            del self._requests[key]
            self._unconfirmed.pop(key, None)
        for h in [h for h, r in self._prefixes.items() if r == replica]:
            del self._prefixes[h]
