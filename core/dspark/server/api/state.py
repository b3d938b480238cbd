"""What every route of one server shares: the engine, the served model's identity, limits, open requests."""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark.llm.api import EngineClient
from dspark.server.group import SequenceGroup
from dspark.server.metrics import ServerMetrics
from dspark.server.protocol.chat_template import ChatTemplate
from dspark.server.protocol.token_text import TokenText


@dataclass
class ServerState:
    engine: EngineClient
    model_name: str
    model_root: str
    metrics: ServerMetrics
    chat_template: ChatTemplate
    api_key: str | None = None
    created: int = 0
    max_body_bytes: int | None = None  # larger request bodies are a 413; None = no limit
    cors_allow_origins: list[str] = field(default_factory=list)  # empty = no CORS headers
    draining: bool = False  # set at SIGTERM: new generation requests are refused with 503
    groups: set[SequenceGroup] = field(default_factory=set)  # requests being generated, for the drain
    token_text: TokenText | None = None
    max_token_bytes: int = 0  # the longest token's bytes: bounds how few tokens a text can become

    @property
    def max_model_len(self) -> int:
        return int(self.engine.inputs.max_model_len)

    @property
    def token_budget(self) -> int:
        """The most prompt + output tokens one sequence can get: model length and KV capacity."""
        return self.engine.inputs.token_budget
