"""The OIP server's YAML config: the LLM server's ``server:`` section plus gRPC and metrics ports, and ``models:``.

Same rules as :mod:`dspark.server.config`: unknown keys are errors, every
error names its field path (``models.0.max_batch_size: ...``), CLI flags are
merged in before validation. The model fields follow Triton's model
configuration (``max_batch_size``, ``dynamic_batching``, ``instance_count``
for its instance group).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from dspark.server.config import ConfigError, ServerSection, _Section, _set, format_errors, read_yaml_mapping

DOCS = "docs/serving-models.md"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class OipServerSection(ServerSection):
    port: int = Field(8000, ge=0, le=65535, description="REST port; 0 = any free port (logged at startup)")
    # The LLM server's section says "openai" here; a narrower literal of our own is the point.
    api_type: Literal["oip"] = Field(  # type: ignore[assignment]
        "oip", description="marks an Open Inference Protocol config")
    api_key: str | None = Field(None, description="required as 'Authorization: Bearer KEY' (REST header, gRPC "
                                "metadata) on every route but the health checks")
    grpc_port: int = Field(8001, ge=0, le=65535, description="gRPC port; 0 = any free port (logged at startup)")
    metrics_port: int | None = Field(8002, ge=0, le=65535, description="Prometheus /metrics port; 0 = any free "
                                     "port; null = no metrics endpoint")


class DynamicBatching(_Section):
    """Triton's ``dynamic_batching``: combine queued requests along dim 0 (docs/serving-models.md, "Batching")."""

    preferred_batch_size: list[int] = Field(default_factory=list, description="batch sizes sent as soon as they "
                                            "can be formed (largest first); empty = only max_batch_size")
    max_queue_delay_microseconds: int = Field(0, ge=0, description="how long the oldest request may wait for a "
                                              "preferred or full batch; 0 = send what is there at once")

    @field_validator("preferred_batch_size")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if any(x < 1 for x in v):
            raise ValueError("every preferred batch size must be >= 1")
        return sorted(set(v))


class ModelEntry(_Section):
    name: str | None = Field(None, description="served model name (URL-safe); default: the file's stem")
    path: str = Field(description="the .onnx file")
    max_batch_size: int = Field(0, ge=0, description="largest batch along dim 0; 0 = the model is not batched "
                                "(shapes are taken as they come)")
    dynamic_batching: DynamicBatching | None = Field(None, description="null = each request runs as sent")
    instance_count: int = Field(1, ge=1, le=64, description="model instances (worker threads) running at once")

    @field_validator("path")
    @classmethod
    def _onnx_file(cls, v: str) -> str:
        p = Path(v).expanduser()
        if p.suffix.lower() != ".onnx":
            raise ValueError(f"expected an .onnx file, got {v!r}")
        if not p.is_file():
            raise ValueError(f"no such file: {v}")
        return str(p)

    @model_validator(mode="after")
    def _consistent(self) -> ModelEntry:
        if self.name is None:
            self.name = Path(self.path).stem
        if not _NAME.match(self.name):
            raise ValueError(f"name {self.name!r}: use letters, digits, '_', '.' and '-' (it is a URL path segment)")
        db = self.dynamic_batching
        if db is not None and self.max_batch_size == 0:
            raise ValueError("dynamic_batching needs max_batch_size > 0")
        if db is not None and db.preferred_batch_size and max(db.preferred_batch_size) > self.max_batch_size:
            raise ValueError(f"dynamic_batching.preferred_batch_size {db.preferred_batch_size} exceeds "
                             f"max_batch_size ({self.max_batch_size})")
        return self

    @property
    def served_name(self) -> str:
        assert self.name is not None  # set by the validator
        return self.name


class OipConfig(_Section):
    server: OipServerSection = Field(default_factory=OipServerSection)
    models: list[ModelEntry] = Field(min_length=1, description="the models served")

    @model_validator(mode="after")
    def _unique(self) -> OipConfig:
        names = [m.served_name for m in self.models]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"model names must be unique: {dup} served twice")
        return self


# CLI flag -> dotted path under server:; flags win over the file.
SERVER_FLAGS = {"host": "host", "port": "port", "grpc_port": "grpc_port", "metrics_port": "metrics_port",
                "api_key": "api_key"}


def is_oip_config(raw: dict[str, Any]) -> bool:
    """A config for this server: it lists ``models:`` or says ``server.api_type: oip``."""
    server = raw.get("server")
    return "models" in raw or (isinstance(server, dict) and server.get("api_type") == "oip")


def single_model(path: str, max_batch_size: int | None = None, max_queue_delay_us: int | None = None) -> dict[str, Any]:
    """The ``models:`` entry for ``dspark serve MODEL.onnx`` and its flags: batching only when asked for."""
    entry: dict[str, Any] = {"path": path}
    if max_batch_size:
        entry["max_batch_size"] = max_batch_size
        entry["dynamic_batching"] = {"max_queue_delay_microseconds": max_queue_delay_us or 0}
    elif max_queue_delay_us is not None:
        raise ConfigError("--max-queue-delay-us needs --max-batch-size > 0 (requests are only queued to be batched)")
    return entry


def load_oip_config(path: str | Path | None = None, *, overrides: dict[str, Any] | None = None,
                    model: dict[str, Any] | None = None) -> OipConfig:
    """Read ``path`` (None = defaults), apply server ``overrides`` (flag name -> value, None = unset) and the
    positional ``model`` entry (it may not be combined with a file that lists models), validate."""
    raw: dict[str, Any] = read_yaml_mapping(path, "server/models") if path is not None else {}
    if model is not None:
        if raw.get("models"):
            raise ConfigError(f"{path}: lists models: and a MODEL was given too; serve one or the other")
        raw["models"] = [model]
    for flag, value in (overrides or {}).items():
        if value is not None:
            _set(raw, f"server.{SERVER_FLAGS[flag]}", value)
    server = raw.get("server")
    if isinstance(server, dict) and server.get("metrics_port") is False:
        server["metrics_port"] = None  # --no-metrics
    try:
        return OipConfig.model_validate(raw)
    except ValidationError as e:
        # One line per config: "FILE: field.path: problem; field.path: problem".
        problems = [line.replace(": Value error, ", ": ") for line in format_errors(e, DOCS).splitlines()]
        where = f"{path}: " if path is not None else ""
        raise ConfigError(where + "; ".join(problems)) from None
