"""The server's YAML config: validated by pydantic, CLI flags merged in before validation.

The shape is the one the seed's ``server_config.yaml`` uses (model / server /
engine / resources); every section and field has a default, so an empty file
(or no file) serves the embedded model on loopback.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dspark.llm.config import EngineConfig, PreemptionPolicy, SchedulerPolicy
from dspark.llm.config import QuantizationConfig

SpecStrategy = Literal["deepspec", "deepspec_v2", "fixed", "off"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Router = Literal["least_tokens", "prefix_affinity", "power_of_two"]


class _Section(BaseModel):
    # Unknown keys are typos until proven otherwise: fail at startup, not silently.
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Section):
    path: str | None = Field(None, description="checkpoint directory or .gguf file; null or 'default' = the "
                             "embedded model")
    name: str | None = Field(None, description="served model id; default: the checkpoint directory's name")
    dtype: Dtype = "auto"
    quantization: QuantizationConfig | None = Field(
        None, description="quantize at startup (calibrates first): a scheme name (int8, int4, int8_mixed, "
        "int4_mixed) or QuantizationConfig fields; a directory from `dspark convert` needs none")

    @field_validator("path")
    @classmethod
    def _default_path(cls, v: str | None) -> str | None:
        return None if v in (None, "", "default") else v


class ServerSection(_Section):
    host: str = "127.0.0.1"  # loopback unless asked: the API has no key by default
    port: int = Field(8000, ge=0, le=65535, description="0 = any free port (logged at startup)")
    api_type: Literal["openai"] = "openai"
    api_key: str | None = Field(None, description="required as 'Authorization: Bearer KEY' on /v1 when set")
    timeout_graceful_shutdown_s: float = Field(
        5, ge=0, allow_inf_nan=False, description="drain time: at SIGTERM/SIGINT the server stops accepting, open "
        "requests get this many seconds to finish, then every remaining stream ends with an error event and [DONE]")
    max_body_bytes: int | None = Field(16 * 2**20, ge=1, description="larger request bodies are refused with 413; "
                                       "null = no limit")
    cors_allow_origins: list[str] = Field(default_factory=list, description="origins allowed by CORS ('*' = any); "
                                          "empty = no CORS headers")


class ContinuousBatching(_Section):
    enabled: bool = Field(True, description="false = one sequence at a time (max_batch_size forced to 1)")
    max_batch_size: int = Field(32, ge=1)
    kv_cache_page_size: int = Field(16, ge=1)
    preemption_policy: PreemptionPolicy = "newest_first"
    max_num_batched_tokens: int = Field(512, ge=1)
    decode_run_ms: float = Field(EngineConfig.model_fields["decode_run_ms"].default, ge=0,
                                 description="greedy decode steps in one decoder call while every running request "
                                 "is plain greedy and none waits (EngineConfig.decode_run_ms); 0 = off")


class SchedulerSection(_Section):
    policy: SchedulerPolicy = "fcfs_with_priority"


class SpeculativeDecoding(_Section):
    """Handed to the engine's ``EngineConfig.speculative`` (unset keys keep the engine's defaults)."""

    enabled: bool = False
    strategy: SpecStrategy = "deepspec"
    draft_model: str = Field("auto", description="'auto' = a draft checkpoint made for the target if one is found, "
                             "'none' = no separate draft model (self-drafting, n-gram), or a checkpoint directory")
    num_speculative_tokens: int = Field(4, ge=1, le=64, description="k of the fixed strategy")
    conservative: bool = Field(False, description="cap k for long open-ended text")
    max_k: int | None = Field(None, ge=1, le=64, description="most tokens DeepSpec drafts per sequence and step")
    exit_layer: int | Literal["auto"] | None = Field(None, description="self-drafting exit layer")
    drafters: list[str] | None = Field(None, description="drafters to use by name or kind; None = every offer")
    drafter_timeout_s: float | None = Field(None, gt=0, description="deadline of a third-party drafter's calls")

    @field_validator("strategy")
    @classmethod
    def _alias(cls, v: str) -> str:
        return "deepspec" if v == "deepspec_v2" else v  # the seed's name for the same strategy

    @field_validator("draft_model", mode="before")
    @classmethod
    def _none(cls, v: object) -> object:
        return "none" if v is None else v

    @property
    def active(self) -> bool:
        return self.enabled and self.strategy != "off"

    def engine_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, **self.model_dump(exclude_unset=True, exclude={"enabled"})}


class EngineSection(_Section):
    max_total_tokens: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    continuous_batching: ContinuousBatching = Field(default_factory=ContinuousBatching)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    speculative_decoding: SpeculativeDecoding = Field(default_factory=SpeculativeDecoding)
    devices: str | None = Field(None, description="EngineConfig.devices: None (CPU), 'auto' or a profile path")
    dense_offload: str = "off"
    packed_linear: Literal["auto", "on", "off"] = Field(
        "auto", description="EngineConfig.packed_linear: oneDNN-packed projection copies for multi-row steps")
    decoder: str | None = Field(
        None, description="EngineConfig.decoder: 'auto' (the plugins' compiled decoders bid, the fastest measured "
        "runs), 'torch', or 'PLUGIN[@DEVICE]'; null = $DSPARK_DECODER or 'auto'")


class ResourcesSection(_Section):
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    cpu_cores_per_worker: int | None = Field(None, ge=1, description="torch intra-op threads; None = torch's default")
    enable_metrics: bool = True
    metrics_port: int = Field(9090, ge=0, le=65535)


class ObservabilitySection(_Section):
    """Tracing, the access log and the periodic stats line (metrics are ``resources.enable_metrics``)."""

    otlp_traces_endpoint: str | None = Field(
        None, description="OTLP/HTTP traces URL (e.g. http://localhost:4318/v1/traces); null = tracing off")
    service_name: str = Field("dspark", min_length=1, description="the traces' service.name")
    stats_log_interval_s: float = Field(10.0, ge=0, allow_inf_nan=False,
                                        description="seconds between stats log lines; 0 = no stats line")
    access_log: bool = Field(True, description="one log line per HTTP request")

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v in (None, ""):
            return None
        if not v.startswith(("http://", "https://")):
            raise ValueError("expected an http:// or https:// URL, e.g. http://localhost:4318/v1/traces")
        return v


class Autoscaling(_Section):
    """Handed to Ray Serve's ``autoscaling_config`` (replicas follow the queue depth between the bounds)."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_ongoing_requests: float = Field(
        16, gt=0, description="sequences in flight per replica the autoscaler aims at (queue depth)")
    upscale_delay_s: float = Field(10, ge=0)
    downscale_delay_s: float = Field(60, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        return self


class ReplicaResources(_Section):
    """What one engine replica asks of its node (Ray places it on a node that has them)."""

    num_cpus: float = Field(1, ge=0, description="CPU cores reserved per replica; also its torch threads "
                            "when resources.cpu_cores_per_worker is unset")
    num_gpus: float = Field(0, ge=0)
    memory_bytes: int | None = Field(None, ge=1, description="RAM reserved per replica (Ray's 'memory')")
    custom: dict[str, float] = Field(default_factory=dict, description="custom Ray resources, e.g. {npu: 1}")


class ClusterSection(_Section):
    """``dspark serve --replicas N`` / ``--ray-address``: serve through Ray Serve instead of one process."""

    replicas: int | None = Field(None, ge=1, description="fixed number of engine replicas; null with no "
                                 "autoscaling = single-process server (no Ray)")
    autoscaling: Autoscaling | None = Field(None, description="a replica range instead of a fixed count")
    ray_address: str | None = Field(None, description="join this Ray cluster ('auto' = the one this machine "
                                    "belongs to); null = start a local Ray")
    resources_per_replica: ReplicaResources = Field(default_factory=ReplicaResources)
    router: Router = Field("least_tokens", description="least_tokens: fewest outstanding tokens; "
                           "prefix_affinity: also keep a prompt prefix on the replica that served it; "
                           "power_of_two: Ray Serve's default (request counts)")
    affinity_slack_tokens: int = Field(
        2048, ge=0, description="prefix_affinity: keep the affine replica unless its outstanding tokens exceed "
        "the least loaded one's by more than this")
    max_ongoing_requests: int = Field(64, ge=1, description="sequences one replica accepts at once (Ray Serve "
                                      "queues the rest at the router)")
    ingress_replicas: int = Field(1, ge=1, description="replicas of the OpenAI ingress (each with a router of its "
                                  "own; they share the replicas' reported load)")
    app_name: str = Field("dspark", min_length=1)
    namespace: str = Field("dspark", min_length=1, description="Ray namespace of the app and its actors")

    @model_validator(mode="after")
    def _one_way(self) -> ClusterSection:
        if self.replicas is not None and self.autoscaling is not None:
            raise ValueError("set either replicas or autoscaling, not both")
        return self

    @property
    def enabled(self) -> bool:
        return self.replicas is not None or self.autoscaling is not None or self.ray_address is not None


class ServerConfig(_Section):
    model: ModelSection = Field(default_factory=ModelSection)
    server: ServerSection = Field(default_factory=ServerSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    resources: ResourcesSection = Field(default_factory=ResourcesSection)
    observability: ObservabilitySection = Field(default_factory=ObservabilitySection)
    cluster: ClusterSection = Field(default_factory=ClusterSection, description="serve through Ray Serve: "
                                    "replicas, resources per replica, router (docs/cluster.md)")

    def model_path(self) -> Path:
        from dspark.llm import default_model_path

        return Path(self.model.path) if self.model.path else default_model_path()

    def served_name(self) -> str:
        return self.model.name or self.model_path().name

    def engine_config(self) -> EngineConfig:
        e, cb = self.engine, self.engine.continuous_batching
        kw: dict[str, Any] = dict(
            max_batch_size=cb.max_batch_size if cb.enabled else 1, max_model_len=e.max_model_len,
            max_total_tokens=e.max_total_tokens, page_size=cb.kv_cache_page_size,
            max_num_batched_tokens=cb.max_num_batched_tokens, decode_run_ms=cb.decode_run_ms,
            scheduler_policy=e.scheduler.policy,
            preemption_policy=cb.preemption_policy, devices=e.devices, dense_offload=e.dense_offload,
            packed_linear=e.packed_linear,
        )
        if e.decoder is not None:
            kw["decoder"] = e.decoder
        # Handed over where the engine knows the field; validated and logged either way.
        if "gpu_memory_utilization" in EngineConfig.model_fields:
            kw["gpu_memory_utilization"] = self.resources.gpu_memory_utilization
        if "speculative" in EngineConfig.model_fields:
            kw["speculative"] = e.speculative_decoding.engine_dict()
        if self.model.quantization is not None:
            kw["quantization"] = self.model.quantization
        return EngineConfig(**kw)


class ConfigError(ValueError):
    """A config problem, worded for the operator: one line per field path."""


# CLI flag -> dotted path in the config; flags win over the file.
OVERRIDES: dict[str, str] = {
    "host": "server.host", "port": "server.port", "api_key": "server.api_key",
    "model": "model.path", "served_model_name": "model.name", "dtype": "model.dtype",
    "max_batch_size": "engine.continuous_batching.max_batch_size", "max_model_len": "engine.max_model_len",
    "max_total_tokens": "engine.max_total_tokens", "metrics_port": "resources.metrics_port",
    "enable_metrics": "resources.enable_metrics", "cpu_cores": "resources.cpu_cores_per_worker",
    "replicas": "cluster.replicas", "ray_address": "cluster.ray_address",
}


def _set(d: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        child = d.get(p)
        if not isinstance(child, dict):
            child = d[p] = {}
        d = child
    d[leaf] = value


def format_errors(exc: ValidationError, docs: str = "docs/server.md") -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(x) for x in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = f"unknown field (check the spelling; see {docs} for the accepted keys)"
        lines.append(f"{where}: {msg}")
    return "\n".join(lines)


def read_yaml_mapping(path: str | Path,
                      sections: str = "model/server/engine/resources/observability/cluster") -> dict[str, Any]:
    """A config file's top-level mapping ({} for an empty file); ConfigError naming the file otherwise."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a mapping with {sections} sections, got {type(raw).__name__}")
    return raw


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ServerConfig:
    """Read ``path`` (None = all defaults), apply ``overrides`` (flag name -> value, None = unset), validate."""
    raw: Any = read_yaml_mapping(path) if path is not None else {}
    for flag, value in (overrides or {}).items():
        if value is not None:
            _set(raw, OVERRIDES[flag], value)
    try:
        return ServerConfig.model_validate(raw)
    except ValidationError as e:
        where = f"{path}: " if path is not None else ""
        raise ConfigError(f"{where}invalid server config\n{format_errors(e)}") from None
