"""OpenAI API request and response bodies (the subset this server implements).

Types are strict, as OpenAI's are: no string-to-number or string-to-bool
coercion (``"stream": "yes"`` is a 400), and NaN/Infinity are refused as not
finite. Fields the server cannot honour are typed so that only their neutral
value validates (``best_of: 1``, empty ``tools`` ...): clients that send the
defaults work, anything else is a 400 that names the field, and the OpenAPI
spec says exactly what is accepted. Unknown fields are rejected, as OpenAI
does, so a misspelt parameter is never silently ignored.
Extensions (vLLM's names): ``top_k``, ``ignore_eos``, ``stop_token_ids``,
``repetition_penalty``, ``min_tokens``, ``guided_json``, ``guided_regex``,
``guided_grammar``, ``guided_choice``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

NonEmptyStr = Annotated[str, StringConstraints(min_length=1, max_length=512)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # what torch.Generator.manual_seed takes
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
MAX_N = 64
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_GRAMMAR_CHARS = 65536

# Request bodies: unknown fields refused, no lax coercion, no NaN/Infinity.
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class ResponseFormatText(BaseModel):
    model_config = _STRICT
    type: Literal["text"]


class ResponseFormatJSONObject(BaseModel):
    model_config = _STRICT
    type: Literal["json_object"]


class JSONSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)
    name: Annotated[str, StringConstraints(min_length=1, max_length=64)] = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON schema the output must validate against")
    strict: bool | None = None


class ResponseFormatJSONSchema(BaseModel):
    model_config = _STRICT
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema,
                           Field(discriminator="type")]


class SamplingFields(BaseModel):
    """Fields completions and chat share."""

    model_config = _STRICT

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy; default 1")
    top_p: float | None = Field(None, ge=0.0, le=1.0, description="0 = greedy; default 1")
    n: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=16)] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = Field(None, description="-2..2: subtracted once from a token already in "
                                             "the output")
    frequency_penalty: Penalty | None = Field(None, description="-2..2: subtracted per occurrence in the output")
    logit_bias: dict[str, Bias] | None = Field(None, max_length=1024,
                                              description="token id (as a string) -> bias in -100..100")
    user: str | None = Field(None, description="accepted and ignored")
    response_format: ResponseFormat | None = Field(
        None, description="{type: text | json_object | json_schema}: constrain the output to JSON")
    # Extensions
    top_k: int | None = Field(None, ge=-1, description="extension: 0 or -1 disables top-k")
    ignore_eos: bool = Field(False, description="extension: keep generating past EOS")
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] | None = None
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0, description="extension: > 1 discourages "
                                             "tokens of the prompt and output (transformers' rule)")
    min_tokens: int | None = Field(None, ge=0, description="extension: EOS and stop tokens are masked until this "
                                   "many tokens were generated")
    guided_json: dict[str, Any] | Annotated[str, StringConstraints(max_length=MAX_GRAMMAR_CHARS)] | None = Field(
        None, description="extension: a JSON schema (object or JSON text) the output must validate against")
    guided_regex: Annotated[str, StringConstraints(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = Field(
        None, description="extension: a regular expression the whole output must match")
    guided_grammar: Annotated[str, StringConstraints(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = Field(
        None, description="extension: a grammar the output must follow (see docs/structured-output.md)")
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1, max_length=256)] | None = Field(
        None, description="extension: the output is exactly one of these strings")

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingFields:
        given = [k for k in ("guided_json", "guided_regex", "guided_grammar", "guided_choice")
                 if getattr(self, k) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.insert(0, "response_format")
        if len(given) > 1:
            raise ValueError(f"at most one output constraint may be given, got {', '.join(given)}")
        return self


PromptIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(min_length=1)]


class CompletionRequest(SamplingFields):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_N)] | PromptIds | Annotated[
        list[PromptIds], Field(min_length=1, max_length=MAX_N)]
    max_tokens: int | None = Field(16, ge=1, description="default 16, as OpenAI's")
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="return the log probability of each "
                                 "token and of this many most likely alternatives; with echo, the prompt's too")
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
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        # As OpenAI: only an assistant turn may come without content (it would have had tool calls).
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a '{self.role}' message needs 'content'")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, description="default: what is left of max_model_len")
    max_completion_tokens: int | None = Field(None, ge=1, description="newer name of max_tokens; wins if both")
    logprobs: bool | None = Field(None, description="return the log probability of each output token")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description="this many most likely alternatives per token (needs logprobs)")
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

    @model_validator(mode="after")
    def _top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


# -- responses -----------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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


# -- tokenizer endpoints (vLLM's shapes) ----------------------------------------------------------


class TokenizeCompletionRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str
    add_special_tokens: bool = Field(True, description="as the tokenizer adds them for a completion (BOS)")
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(max_length=1_000_000)]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
