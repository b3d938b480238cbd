"""The ingress's engine client: it validates requests locally and streams each sequence from a replica.

The server's routes use an engine client (:class:`dspark.llm.api.EngineClient`:
``inputs``, ``generate``, ``stats``, ``shutdown``); ``inputs`` runs the checks
that turn bad input into a 400 before anything runs (tokenizer, vocabulary,
model length, KV capacity, grammars). :class:`RemoteAsyncEngine` builds the
engine's own :class:`~dspark.llm.inputs.InputProcessor` from a replica's
``describe()``, so the ingress says exactly what the single-process server
says, without a model.

A sequence whose replica dies before its first output is sent again (Ray
Serve's router then picks among the live replicas); one that had started
streaming ends with :class:`~dspark.server.group.EngineUnavailable`, which the
routes turn into an OpenAI error.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from dspark.host.log import get_logger
from dspark.llm import RequestOutput, SamplingParams
from dspark.llm.engine import EngineStats
from dspark.llm.inputs import InputProcessor
from dspark.server.cluster.routing import route_info
from dspark.server.group import EngineUnavailable

log = get_logger("dspark.server.cluster")
RETRIES = 2  # sends after the first, while nothing has streamed yet
_REPLICA_GONE = (ActorDiedError, ActorUnavailableError, RayActorError)


def _sum_stats(entries: list[dict[str, Any]]) -> EngineStats:
    """The replicas' engine state as one engine's: counts and bytes add up, ratios are recomputed, and the
    decoder is every decoder a replica runs (sorted, comma-separated)."""
    stats = [e["stats"] for e in entries]
    total = {k: sum(int(s.get(k, 0)) for s in stats) for k in (
        "kv_used_bytes", "kv_total_bytes", "kv_used_pages", "kv_free_pages", "kv_total_pages", "num_running",
        "num_waiting", "num_preemptions", "effective_max_batch", "decoder_failovers", "spec_drafts",
        "spec_draft_tokens", "spec_accepted_tokens", "spec_drafter_failures", "spec_explore_steps", "spec_copy_runs")}
    pages = total["kv_total_pages"]
    drafts, drafted, accepted = total["spec_drafts"], total["spec_draft_tokens"], total["spec_accepted_tokens"]
    return EngineStats(
        **{k: v for k, v in total.items() if not k.startswith("spec_")},
        kv_usage=total["kv_used_pages"] / pages if pages else 0.0,
        kv_fragmentation=max((float(s.get("kv_fragmentation", 0.0)) for s in stats), default=0.0),
        page_size=int(stats[0]["page_size"]) if stats else 0,
        decoder=",".join(sorted({str(s.get("decoder", "torch")) for s in stats})) or "torch",
        spec_strategy=next((s.get("spec_strategy") for s in stats if s.get("spec_strategy")), None),
        spec_drafts=drafts, spec_draft_tokens=drafted, spec_accepted_tokens=accepted,
        spec_acceptance_rate=accepted / drafted if drafted else 0.0,
        spec_mean_accepted_length=accepted / drafts if drafts else 0.0,
        spec_drafter_failures=total["spec_drafter_failures"], spec_explore_steps=total["spec_explore_steps"],
        spec_copy_runs=total["spec_copy_runs"])


class Rebuild:
    """The cumulative outputs the routes expect, from a replica's compact ones (``replica.compact``)."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_ids, self.tokens, self.logprobs, self.text = prompt_ids, [], [], ""
        self.prompt_logprobs: Any = None

    def __call__(self, start: int, o: RequestOutput) -> RequestOutput:
        del self.tokens[start:]
        self.tokens.extend(o.token_ids)
        if o.logprobs is not None:
            del self.logprobs[start:]
            self.logprobs.extend(o.logprobs)
        if o.prompt_logprobs is not None:
            self.prompt_logprobs = o.prompt_logprobs
        self.text = o.text if o.finished else self.text + o.delta
        return dataclasses.replace(o, token_ids=list(self.tokens), text=self.text, prompt_token_ids=self.prompt_ids,
                                   logprobs=list(self.logprobs) if o.logprobs is not None else None,
                                   prompt_logprobs=self.prompt_logprobs)


class RemoteAsyncEngine:
    """The engine client (``AsyncLLMEngine``'s surface) over a Ray Serve handle to the engine replicas;
    ``inputs``: the replicas' request checks (``InputProcessor.from_description`` of a replica's)."""

    def __init__(self, handle: Any, inputs: InputProcessor, registry: Any, *, affinity: bool,
                 refresh_s: float = 1.0) -> None:
        self.handle = handle.options(stream=True)
        self.inputs = inputs
        self.registry, self.affinity = registry, affinity
        self._ids = itertools.count()
        self.replicas: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._refresh_s = refresh_s
        self._thread = threading.Thread(target=self._refresh, name="dspark-cluster-stats", daemon=True)
        self._thread.start()

    def _refresh(self) -> None:
        import ray

        while not self._stop.is_set():
            try:
                self.replicas = ray.get(self.registry.entries.remote(), timeout=10)
            except Exception as e:  # noqa: BLE001 (the registry restarting: keep the last view)
                log.warning("replica registry unavailable", error=repr(e))
            self._stop.wait(self._refresh_s)

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        rid = request_id or f"cluster-{next(self._ids)}"
        params = params or SamplingParams()
        seq = self.inputs.make_sequence(rid, prompt, params, priority)  # raises here, in the caller
        info = route_info(rid, seq.prompt_ids, params.max_tokens, affinity=self.affinity)
        for attempt in range(RETRIES + 1):
            stream = self.handle.generate.remote(info, seq.prompt_ids, params, rid, priority)
            started = finished = False
            rebuild = Rebuild(seq.prompt_ids)
            try:
                async for batch in stream:
                    for start, part in batch:
                        out = rebuild(start, part)
                        started = True
                        finished = out.finished
                        yield out
                return
            except _REPLICA_GONE as e:
                if started or attempt == RETRIES:
                    raise EngineUnavailable(
                        f"the engine replica serving this request stopped "
                        f"{'mid-generation' if started else 'before it started'} ({type(e).__name__}); "
                        f"retry the request") from None
                log.warning("engine replica gone before the sequence started; sending it again",
                            request_id=rid, attempt=attempt + 1, error=type(e).__name__)
            finally:
                if not finished:
                    stream.cancel()  # the consumer went away (or the replica did): stop it there, free its KV

    def stats(self) -> EngineStats:
        return _sum_stats(self.replicas)

    def shutdown(self) -> None:
        self._stop.set()
