"""Prometheus metrics, all prefixed ``dspark_``, in a registry of the server's own.

Request-level series (latencies, phases, lengths, token counters) are updated
as requests run and finish; engine state (queue lengths, KV cache,
preemptions, speculative counters, device memory) is read by a custom
collector at scrape time, so a scrape costs one ``engine.stats()`` call and no
work between scrapes. Every ``dspark_`` series carries a ``model_name`` label
(the served model id), as vLLM's ``vllm:`` series do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psutil
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dspark.llm import AsyncLLMEngine, RequestOutput
from dspark.llm.api import EngineClient

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_PHASE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                  40.0, 60.0, 120.0, 300.0)
# Powers of two, then 1-2-5 steps: fine where most prompts and outputs are short, still resolving long ones.
_LENGTH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


@dataclass(frozen=True)
class DeviceMemory:
    """A device whose memory is reported: ``read()`` returns bytes in use (cheap: no probing)."""

    device: str
    total_bytes: int | None
    read: Callable[[], int]


def probe_devices(device_map: Any = None) -> list[DeviceMemory]:
    """The devices this process holds model memory on, looked up once at startup.

    The CPU is always one (this process's resident set); CUDA devices are the
    ones an in-process engine's device map (``device_map``) put pieces on.
    """
    proc = psutil.Process()
    devs = [DeviceMemory("cpu", psutil.virtual_memory().total, lambda: int(proc.memory_info().rss))]
    used = set(device_map.devices) if device_map is not None else set()
    for dev in sorted(d for d in used if d.startswith("cuda:")):
        import torch

        idx = int(dev.split(":")[1])
        total = int(torch.cuda.get_device_properties(idx).total_memory)
        # reserved = what the caching allocator holds, the figure nvidia-smi shows for this process
        devs.append(DeviceMemory(dev, total, lambda i=idx: int(torch.cuda.memory_reserved(i))))  # type: ignore[misc]
    return devs


class _EngineCollector(Collector):
    """Reads engine state when Prometheus scrapes."""

    def __init__(self, engine: EngineClient, devices: list[DeviceMemory], spec_strategy: str | None,
                 model_name: str = "") -> None:
        self.engine, self.devices, self.spec_strategy, self.model = engine, devices, spec_strategy, model_name

    def _family(self, cls: type[Any], name: str, doc: str, value: float | None = None,
                labels: tuple[str, ...] = ()) -> Any:
        """A metric family labelled ``model_name`` (first) plus ``labels``; one sample when ``value`` is given."""
        fam = cls(name, doc, labels=["model_name", *labels])
        if value is not None:
            fam.add_metric([self.model], value)
        return fam

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return self._family(GaugeMetricFamily, f"dspark_{name}", doc, value)  # type: ignore[no-any-return]

        yield gauge("requests_running", "Sequences in the running batch.", s.num_running)
        yield gauge("requests_waiting", "Sequences queued for a batch slot or KV pages.", s.num_waiting)
        yield gauge("kv_cache_used_bytes", "KV cache bytes held by sequences (whole pages).", s.kv_used_bytes)
        yield gauge("kv_cache_total_bytes", "KV cache capacity in bytes.", s.kv_total_bytes)
        yield gauge("kv_cache_usage_ratio", "Used KV pages / all KV pages.", s.kv_usage)
        yield gauge("kv_cache_fragmentation_ratio", "Unused slots in held pages / held slots.", s.kv_fragmentation)
        yield gauge("batch_size_limit", "The scheduler's current batch limit (adaptive or fixed).",
                    s.effective_max_batch)
        yield self._family(CounterMetricFamily, "dspark_preemptions",
                           "Sequences preempted (pages reclaimed, recomputed later).", s.num_preemptions)
        # A failover keeps every request but may run the model far slower: operators alert on it.
        yield self._family(CounterMetricFamily, "dspark_decoder_failovers",
                           "Times the decoder target running the model failed and the next one took over.",
                           s.decoder_failovers)
        info = self._family(GaugeMetricFamily, "dspark_decoder_info",
                            "The decoder target running the model now, plugin@device or torch (value 1).",
                            labels=("decoder",))
        info.add_metric([self.model, s.decoder], 1)
        yield info
        yield from self._speculative(s)
        used = self._family(GaugeMetricFamily, "dspark_device_memory_used_bytes",
                            "Memory in use per device (CPU: process RSS; CUDA: allocator reserved).",
                            labels=("device",))
        total = self._family(GaugeMetricFamily, "dspark_device_memory_total_bytes", "Memory capacity per device.",
                             labels=("device",))
        for d in self.devices:
            used.add_metric([self.model, d.device], d.read())
            if d.total_bytes is not None:
                total.add_metric([self.model, d.device], d.total_bytes)
        yield used
        yield total

    def _speculative(self, s: Any) -> Iterator[Metric]:
        # Read with getattr: an engine without speculative decoding has none of these fields (all 0 then).
        drafts = int(getattr(s, "spec_drafts", 0) or 0)
        draft_tokens = int(getattr(s, "spec_draft_tokens", 0) or 0)
        accepted = int(getattr(s, "spec_accepted_tokens", 0) or 0)
        counter, gauge = CounterMetricFamily, GaugeMetricFamily
        yield self._family(counter, "dspark_spec_decode_drafts", "Drafts verified ((sequence, step) pairs).", drafts)
        yield self._family(counter, "dspark_spec_decode_draft_tokens", "Tokens proposed by the drafters.",
                           draft_tokens)
        yield self._family(counter, "dspark_spec_decode_accepted_tokens", "Draft tokens the target model accepted.",
                           accepted)
        yield self._family(counter, "dspark_spec_decode_drafter_failures", "Drafter calls that failed.",
                           int(getattr(s, "spec_drafter_failures", 0) or 0))
        yield self._family(gauge, "dspark_spec_decode_acceptance_rate",
                           "Accepted / proposed draft tokens since start (0 before any).",
                           accepted / draft_tokens if draft_tokens else 0.0)
        yield self._family(gauge, "dspark_spec_decode_mean_accepted_length", "Accepted tokens per draft since start.",
                           accepted / drafts if drafts else 0.0)
        enabled = self._family(gauge, "dspark_spec_decode_enabled", "1 when speculative decoding is on.",
                               labels=("strategy",))
        strategy = getattr(s, "spec_strategy", None) or self.spec_strategy
        enabled.add_metric([self.model, strategy or "off"], 1.0 if strategy else 0.0)
        yield enabled
        labels = ("drafter", "plugin")
        d_tokens = self._family(counter, "dspark_spec_decode_drafter_draft_tokens", "Tokens proposed, per drafter.",
                                labels=labels)
        d_acc = self._family(counter, "dspark_spec_decode_drafter_accepted_tokens", "Tokens accepted, per drafter.",
                             labels=labels)
        d_time = self._family(counter, "dspark_spec_decode_drafter_seconds", "Time spent drafting, per drafter.",
                              labels=labels)
        for name, d in (getattr(s, "spec_drafters", None) or {}).items():
            key = [self.model, str(name), str(d.get("plugin") or "")]
            d_tokens.add_metric(key, float(d.get("draft_tokens", 0)))
            d_acc.add_metric(key, float(d.get("accepted_tokens", 0)))
            d_time.add_metric(key, float(d.get("draft_ms", 0.0)) / 1e3)
        yield d_tokens
        yield d_acc
        yield d_time


class _ModelLabelled:
    """A labelled metric whose first label, ``model_name``, is filled in: ``.labels(route, status)``."""

    def __init__(self, metric: Any, model_name: str) -> None:
        self.metric, self.model = metric, model_name

    def labels(self, *values: str) -> Any:
        return self.metric.labels(self.model, *values)


class ServerMetrics:
    def __init__(self, engine: EngineClient, *, model_name: str, spec_strategy: str | None = None,
                 devices: list[DeviceMemory] | None = None, device_map: Any = None) -> None:
        """``device_map``: the in-process engine's device map, whose devices' memory is reported."""
        r = self.registry = CollectorRegistry()
        self.model_name = model_name
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        r.register(_EngineCollector(engine, devices if devices is not None else probe_devices(device_map), spec_strategy,
                                    model_name))
        Gauge("dspark_model_info", "The served model (value 1).", ["model_name"], registry=r).labels(model_name).set(1)
        m = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        self.ttft = hist("dspark_time_to_first_token_seconds", "Request arrival to its first output token.",
                         _TTFT_BUCKETS)
        self.tpot = hist("dspark_time_per_output_token_seconds",
                         "Mean time between output tokens after the first, one sample per request.", _TPOT_BUCKETS)
        self.itl = hist("dspark_inter_token_latency_seconds",
                        "Time between consecutive output tokens, one sample per gap. Several tokens arriving in one "
                        "step (speculative decoding) split the gap since the previous output evenly between them.",
                        _ITL_BUCKETS)
        self.e2e = hist("dspark_e2e_request_latency_seconds", "Request arrival to its last token (or abort).",
                        _E2E_BUCKETS)
        self.queue_time = hist("dspark_request_queue_time_seconds",
                               "Request arrival to the engine first scheduling the sequence.", _PHASE_BUCKETS)
        self.prefill_time = hist("dspark_request_prefill_time_seconds",
                                 "First scheduled to the first output token (the prompt's prefill).", _PHASE_BUCKETS)
        self.decode_time = hist("dspark_request_decode_time_seconds", "First output token to the last.",
                                _PHASE_BUCKETS)
        self.prompt_len = hist("dspark_request_prompt_tokens", "Prompt length in tokens, one sample per sequence.",
                               _LENGTH_BUCKETS)
        self.generation_len = hist("dspark_request_generation_tokens",
                                   "Tokens generated, one sample per sequence.", _LENGTH_BUCKETS)
        self.prompt_tokens = Counter("dspark_prompt_tokens", "Prompt tokens prefilled (once per sequence).", m,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("dspark_generation_tokens", "Tokens generated.", m,
                                         registry=r).labels(model_name)
        self.finished = _ModelLabelled(Counter("dspark_requests_finished", "Sequences finished, by finish reason.",
                                               [*m, "finish_reason"], registry=r), model_name)
        self.http = _ModelLabelled(Counter("dspark_http_requests", "HTTP requests served, by route and status code.",
                                           [*m, "route", "status"], registry=r), model_name)
        self.partition = _ModelLabelled(Histogram(
            "dspark_partition_latency_seconds",
            "Measured time of one execution of a model partition, by the plugin running it.",
            [*m, "plugin", "device", "partition"], buckets=_STEP_BUCKETS, registry=r), model_name)
        self.partition_predicted = _ModelLabelled(Gauge(
            "dspark_partition_predicted_latency_seconds", "The placer's predicted time of a partition per step.",
            [*m, "plugin", "device", "partition"], registry=r), model_name)
        # Running totals as tokens come (the counters above move when sequences finish): the stats log's rates.
        self.live_prompt_tokens = 0
        self.live_generation_tokens = 0

    def sequence(self, prompt_tokens: int, arrival: float | None = None) -> SequenceTimer:
        """``arrival``: ``time.perf_counter()`` when the HTTP request came in (default: now)."""
        return SequenceTimer(self, prompt_tokens, arrival)

    def instrument_engine(self, engine: AsyncLLMEngine) -> None:
        """Time each forward step and each offloaded MLP call, labelled by who runs it."""
        lay = engine.layout()
        placed = lay.device_map
        devices = "cpu" if placed is None else "+".join(sorted({p.device_id for p in placed.layers}))
        if placed is not None and placed.plan is not None:
            for part in placed.plan.partitions:
                self.partition_predicted.labels(part.plugin, part.device, f"p{part.id}").set(part.predicted_ms / 1e3)
        # torch executes the layers wherever the placer put them; the forward is the torch partition.
        hists = {"forward": self.partition.labels("torch", devices, "forward"),
                 "draft": self.partition.labels("torch", devices, "draft")}  # self-drafting: the first layers only
        if lay.mlp is not None:  # the torch runner's prefill MLPs
            hists["mlp"] = self.partition.labels(*lay.mlp, "mlp")
        engine.observe(lambda work, seconds: hists[work].observe(seconds) if work in hists else None)


class SequenceTimer:
    """Per-sequence latency bookkeeping; ``finish`` records once, whichever way the sequence ends.

    The times are ``time.perf_counter()`` values: ``arrival`` (the HTTP request came in), ``scheduled``
    (the engine first planned the sequence into a step: ``RequestOutput.first_scheduled``, or, from an
    engine that does not report it, the first output's arrival, so queue time then includes the prefill),
    ``first`` / ``last`` (first and latest output token), ``end`` (finished or aborted).
    """

    def __init__(self, m: ServerMetrics, prompt_tokens: int, arrival: float | None = None) -> None:
        self.m, self.prompt = m, prompt_tokens
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.scheduled: float | None = None
        self.first: float | None = None
        self.last = self.arrival
        self.end: float | None = None
        self.tokens = 0
        self.finish_reason: str | None = None
        self.done = False

    def update(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        sched = getattr(out, "first_scheduled", None)
        if self.scheduled is None and sched is not None:
            self.scheduled = min(max(float(sched), self.arrival), now)
        n = len(out.token_ids)
        new = n - self.tokens
        if new > 0:
            if self.first is None:
                self.first = now
                if self.scheduled is None:  # an engine without first_scheduled: the first output's arrival
                    self.scheduled = now
                self.m.ttft.observe(now - self.arrival)
                self.m.live_prompt_tokens += self.prompt
                # Tokens after the first that came with it are gaps of zero.
                for _ in range(new - 1):
                    self.m.itl.observe(0.0)
            else:
                gap = (now - self.last) / new  # several tokens in one step: the gap split evenly
                for _ in range(new):
                    self.m.itl.observe(gap)
            self.m.live_generation_tokens += new
            self.last, self.tokens = now, n
        elif new < 0:  # never seen: an engine that takes tokens back; count what it reports
            self.tokens = n
        if out.finished:
            self.finish(out.finish_reason or "stop")

    def finish(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        self.end = time.perf_counter()
        self.finish_reason = reason
        m = self.m
        if self.first is not None:  # its prompt was prefilled
            sched = self.scheduled if self.scheduled is not None else self.first
            m.prompt_tokens.inc(self.prompt)
            m.generation_tokens.inc(self.tokens)
            m.queue_time.observe(sched - self.arrival)
            m.prefill_time.observe(self.first - sched)
            m.decode_time.observe(self.last - self.first)
            m.prompt_len.observe(self.prompt)
            m.generation_len.observe(self.tokens)
            if self.tokens > 1:
                m.tpot.observe((self.last - self.first) / (self.tokens - 1))
        if reason != "abort":  # an abandoned request's lifetime is the client's, not ours
            m.e2e.observe(self.end - self.arrival)
        m.finished.labels(reason).inc()
