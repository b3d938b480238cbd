"""OpenAI API request and response bodies (the subset this server implements).

Fields the server cannot honour are typed so that only their neutral value
validates (``logprobs: false``, ``presence_penalty: 0``, empty ``tools`` ...):
clients that send the defaults work, anything else is a 400 that names the
field, and the OpenAPI spec says exactly what is accepted. Unknown fields are
rejected, as OpenAI does, so a misspelt parameter is never silently ignored.
Extensions (vLLM's names): ``top_k``, ``ignore_eos``, ``stop_token_ids``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

NonEmptyStr = Annotated[str, StringConstraints(min_length=1, max_length=512)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # what torch.Generator.manual_seed takes
Neutral = Annotated[float, Field(ge=0.0, le=0.0, description="not supported: only 0 is accepted")]
MAX_N = 64


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields completions and chat share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy; default 1")
    top_p: float | None = Field(None, ge=0.0, le=1.0, description="0 = greedy; default 1")
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=16)] | None = None
    seed: Seed | None = None
    presence_penalty: Neutral | None = None
    frequency_penalty: Neutral | None = None
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description="not supported: must be empty")
    user: str | None = Field(None, description="accepted and ignored")
    # Extensions
    top_k: int | None = Field(None, ge=-1, description="extension: 0 or -1 disables top-k")
    ignore_eos: bool = Field(False, description="extension: keep generating past EOS")
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] | None = None


PromptIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_N)] | PromptIds | Annotated[
        list[PromptIds], Field(min_length=1, max_length=MAX_N)]
    max_tokens: int | None = Field(16, ge=1, description="default 16, as OpenAI's")
    echo: bool | None = False
    logprobs: Literal[0] | None = Field(None, description="not supported: null or 0")
    best_of: Literal[1] | None = Field(None, description="not supported beyond 1")
    suffix: str | None = Field(None, max_length=0, description="not supported: must be empty")

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (OpenAI's batch forms included)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"] = Field(description="only plain text is supported")


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, description="default: what is left of max_model_len")
    max_completion_tokens: int | None = Field(None, ge=1, description="newer name of max_tokens; wins if both")
    logprobs: Literal[False] | None = Field(None, description="not supported")
    top_logprobs: Literal[0] | None = Field(None, description="not supported")
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=0, description="not supported: must be empty")
    tool_choice: Literal["none"] | None = None
    functions: list[dict[str, Any]] | None = Field(None, max_length=0, description="not supported")
    parallel_tool_calls: bool | None = None
    modalities: list[Literal["text"]] | None = None
    add_generation_prompt: bool = Field(True, description="extension: end the prompt with the assistant header")
    # Accepted and ignored: bookkeeping fields some clients always send.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


# -- responses -----------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dspark"
    max_model_len: int
    root: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class APIError(Exception):
    """Raised anywhere in a handler; rendered as OpenAI's error JSON with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, ErrorBody(message=message, type=type, param=param, code=code)
